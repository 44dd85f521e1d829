use super::*;
use crate::wire::{self, Hello, Message, NodeState, Reject, RejectReason, Report};
use proptest::prelude::*;

fn hello_frame() -> Vec<u8> {
    crate::frame::encode(&Message::Hello(Hello {
        node: "web-1".into(),
        service: "web".into(),
        address: "10.0.0.1:8080".into(),
        zone: "z1".into(),
        version: "0.1.0".into(),
    }))
    .expect("frames")
}

fn report(seq: u32) -> Vec<u8> {
    wire::encode(&Message::Report(Report {
        seq,
        cpu: 0.5,
        inflight: 3,
        inflight_mean: 3.0,
        age: None,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    }))
    .expect("encodes")
}

fn attach(slot: Slot) -> ToPrimary {
    ToPrimary::Attach(Attach {
        slot,
        hello: hello_frame(),
        chain: vec![vec![0x30; 900], vec![0x30; 700]],
        source: IpAddr::from([10, 0, 0, 1]),
    })
}

fn relay_messages() -> Vec<ToPrimary> {
    vec![
        ToPrimary::Open {
            relay: "relay-1".into(),
            version: crate::VERSION.into(),
        },
        attach(0),
        attach(u64::MAX),
        ToPrimary::Detach { slot: 7 },
    ]
}

fn primary_messages() -> Vec<ToRelay> {
    let reject = Reject {
        reason: RejectReason::NotOwner,
        detail: "replica b".into(),
    };
    vec![
        ToRelay::Opened {
            replica: "a".into(),
            max_slots: 10_000,
            max_batch_bytes: 1200,
        },
        ToRelay::Closed(reject.clone()),
        ToRelay::Attached {
            slot: 3,
            welcome: vec![0, 4, 2, 1, 2, 3],
        },
        ToRelay::Rejected { slot: 4, reject },
        ToRelay::Detached {
            slot: 5,
            code: 5,
            reason: "moved".into(),
        },
    ]
}

fn read_all<M: ControlMessage>(bytes: &[u8], chunk: usize) -> Result<Vec<M>, TrunkError> {
    let mut reader = ControlReader::new();
    let mut out = Vec::new();
    for c in bytes.chunks(chunk.max(1)) {
        out.extend(reader.push(c)?);
    }
    Ok(out)
}

#[test]
fn every_control_message_round_trips_in_any_chunks() {
    let relay = relay_messages();
    let stream: Vec<u8> = relay
        .iter()
        .flat_map(|m| encode_control(m).expect("encodes"))
        .collect();
    for chunk in [1, 3, 4, 5, 100, stream.len()] {
        assert_eq!(read_all::<ToPrimary>(&stream, chunk), Ok(relay.clone()));
    }
    let primary = primary_messages();
    let stream: Vec<u8> = primary
        .iter()
        .flat_map(|m| encode_control(m).expect("encodes"))
        .collect();
    assert_eq!(read_all::<ToRelay>(&stream, 7), Ok(primary));
}

#[test]
fn a_frame_names_its_length_and_version() {
    let frame = encode_control(&ToPrimary::Detach { slot: 1 }).expect("encodes");
    let len = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
    assert_eq!(len, frame.len() - 4);
    assert_eq!(frame[4], TRUNK_VERSION);
    let mut bad = frame.clone();
    bad[4] = 9;
    assert_eq!(
        decode_control::<ToPrimary>(&bad[4..]),
        Err(TrunkError::UnknownVersion(9))
    );
    let mut long = frame[4..].to_vec();
    long.push(0);
    assert_eq!(
        decode_control::<ToPrimary>(&long),
        Err(TrunkError::Trailing(1))
    );
    assert_eq!(decode_control::<ToPrimary>(&[]), Err(TrunkError::Empty));
}

#[test]
fn an_oversized_length_is_refused_before_it_is_buffered() {
    let mut reader = ControlReader::<ToPrimary>::new();
    let len = (MAX_CONTROL_FRAME as u32 + 1).to_be_bytes();
    assert!(matches!(
        reader.push(&len),
        Err(TrunkError::TooLarge { len, .. }) if len == MAX_CONTROL_FRAME + 1
    ));
    assert!(!reader.is_idle());
    let ok = encode_control(&ToPrimary::Detach { slot: 1 }).expect("encodes");
    assert!(
        reader.push(&ok).is_err(),
        "a failed reader takes nothing more"
    );
    let mut reader = ControlReader::<ToPrimary>::new();
    assert_eq!(reader.push(&[0, 0, 0, 0]), Err(TrunkError::Empty));
    let mut reader = ControlReader::<ToPrimary>::new();
    assert_eq!(reader.push(&ok[..6]), Ok(vec![]));
    assert!(!reader.is_idle(), "half a frame is not the end of a stream");
    assert_eq!(
        reader.push(&ok[6..]),
        Ok(vec![ToPrimary::Detach { slot: 1 }])
    );
    assert!(reader.is_idle());
}

#[test]
fn attach_limits_hold_both_ways() {
    let base = Attach {
        slot: 1,
        hello: hello_frame(),
        chain: vec![vec![1; 100]],
        source: IpAddr::from([10, 0, 0, 1]),
    };
    let cases = [
        Attach {
            chain: vec![],
            ..base.clone()
        },
        Attach {
            chain: vec![vec![1; 10]; MAX_CHAIN_CERTS + 1],
            ..base.clone()
        },
        Attach {
            chain: vec![vec![1; MAX_CHAIN_BYTES / 2 + 1]; 2],
            ..base.clone()
        },
        Attach {
            hello: vec![0; wire::MAX_MESSAGE + 3],
            ..base.clone()
        },
    ];
    for a in cases {
        let msg = ToPrimary::Attach(a.clone());
        assert!(encode_control(&msg).is_err(), "{} certs", a.chain.len());
        // Encoded anyway, as a hostile relay would: the primary refuses it.
        let mut frame = vec![TRUNK_VERSION];
        frame.extend(bincode::serde::encode_to_vec(&msg, config()).expect("bincode"));
        assert!(decode_control::<ToPrimary>(&frame).is_err());
    }
    let long = ToPrimary::Open {
        relay: "r".repeat(MAX_TEXT + 1),
        version: String::new(),
    };
    assert!(matches!(
        encode_control(&long),
        Err(TrunkError::TooLarge { .. })
    ));
}

#[test]
fn a_hostile_length_inside_a_frame_is_refused_without_allocating_it() {
    // Attach (tag 1), slot 0, then a varint length of u64::MAX for the hello.
    let mut frame = vec![TRUNK_VERSION, 1, 0, 0xff];
    frame.extend([0xff; 8]);
    assert!(matches!(
        decode_control::<ToPrimary>(&frame),
        Err(TrunkError::Malformed(_))
    ));
}

#[test]
fn batches_round_trip_and_fill_up_to_their_limit() {
    let mut enc = BatchEncoder::new(BatchKind::Reports, 1200);
    let mut sent = Vec::new();
    let mut batches = Vec::new();
    for i in 0..200u32 {
        let slot = u64::from(i) * 1000;
        let msg = report(i + 1);
        if !enc.push(slot, &msg).expect("fits alone") {
            batches.push(enc.take().expect("full"));
            assert!(enc.push(slot, &msg).expect("fits"));
        }
        sent.push((slot, msg));
    }
    batches.extend(enc.take());
    assert!(enc.take().is_none() && enc.is_empty());
    let mut got = Vec::new();
    for b in &batches {
        assert!(b.len() <= 1200);
        for e in decode_batch(b, BatchKind::Reports).expect("decodes") {
            got.push((e.slot, e.message.to_vec()));
        }
    }
    assert_eq!(got, sent);
    assert!(batches.len() >= 3, "{} batches", batches.len());
    // Every batch but the last is full: the next entry would not have fitted.
    let first = &batches[0];
    assert!(first.len() + 3 + report(1).len() > 1200, "{}", first.len());
}

#[test]
fn bad_batches_are_refused_whole() {
    let mut enc = BatchEncoder::new(BatchKind::Replies, 1200);
    assert!(enc.push(300, &report(1)).expect("fits"));
    let good = enc.take().expect("batch");
    assert!(decode_batch(&good, BatchKind::Replies).is_ok());
    assert!(matches!(
        decode_batch(&good, BatchKind::Reports),
        Err(TrunkError::WrongKind { .. })
    ));
    let cases: Vec<(Vec<u8>, TrunkError)> = vec![
        (vec![], TrunkError::Empty),
        (vec![TRUNK_VERSION, 1], TrunkError::Empty),
        (vec![2, 1, 0, 1, 0], TrunkError::UnknownVersion(2)),
        (vec![TRUNK_VERSION, 7, 0, 1, 0], TrunkError::UnknownKind(7)),
        (good[..good.len() - 1].to_vec(), TrunkError::BadEntry),
        (vec![TRUNK_VERSION, 1, 0, 0], TrunkError::BadEntry),
        (vec![TRUNK_VERSION, 1, 0x80, 0, 1, 9], TrunkError::BadSlot),
        (vec![TRUNK_VERSION, 1, 0xff], TrunkError::BadSlot),
        (
            [vec![TRUNK_VERSION, 1], vec![0xff; 9], vec![0x02, 1, 9]].concat(),
            TrunkError::BadSlot,
        ),
    ];
    for (bytes, want) in cases {
        assert_eq!(
            decode_batch(&bytes, BatchKind::Replies),
            Err(want),
            "{bytes:?}"
        );
    }
    let big = vec![TRUNK_VERSION; MAX_BATCH + 1];
    assert!(matches!(
        decode_batch(&big, BatchKind::Reports),
        Err(TrunkError::TooLarge { .. })
    ));
}

#[test]
fn entries_that_fit_no_batch_are_errors() {
    let mut enc = BatchEncoder::new(BatchKind::Reports, 20);
    assert!(enc.push(1, &[]).is_err());
    assert!(enc.push(1, &[0; MAX_ENTRY + 1]).is_err());
    assert!(enc.push(1, &[0; 17]).is_err(), "2 + 1 + 1 + 17 > 20");
    assert_eq!(enc.push(1, &[0; 16]), Ok(true));
    assert_eq!(enc.push(1, &[0; 1]), Ok(false));
    let mut big = BatchEncoder::new(BatchKind::Reports, usize::MAX);
    assert_eq!(big.limit(), MAX_BATCH);
    assert_eq!(big.push(u64::MAX, &[1; MAX_ENTRY]), Ok(true));
    let b = big.take().expect("batch");
    let e = decode_batch(&b, BatchKind::Reports).expect("decodes");
    assert_eq!(
        e,
        [Entry {
            slot: u64::MAX,
            message: &[1; MAX_ENTRY][..]
        }]
    );
}

proptest! {
    #[test]
    fn decoding_random_control_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096), chunk in 1usize..64) {
        let _ = read_all::<ToPrimary>(&bytes, chunk);
        let _ = read_all::<ToRelay>(&bytes, chunk);
    }

    #[test]
    fn decoding_random_batches_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode_batch(&bytes, BatchKind::Reports);
        let _ = decode_batch(&bytes, BatchKind::Replies);
    }

    #[test]
    fn any_entries_round_trip(entries in proptest::collection::vec((any::<u64>(), proptest::collection::vec(any::<u8>(), 1..=MAX_ENTRY)), 1..40), limit in 300usize..4000) {
        let mut enc = BatchEncoder::new(BatchKind::Replies, limit);
        let mut got = Vec::new();
        let drain = |b: Vec<u8>, got: &mut Vec<(u64, Vec<u8>)>| {
            prop_assert!(b.len() <= limit);
            for e in decode_batch(&b, BatchKind::Replies).map_err(|e| TestCaseError::fail(e.to_string()))? {
                got.push((e.slot, e.message.to_vec()));
            }
            Ok(())
        };
        for (slot, msg) in &entries {
            if !enc.push(*slot, msg).map_err(|e| TestCaseError::fail(e.to_string()))? {
                drain(enc.take().unwrap_or_default(), &mut got)?;
                prop_assert!(enc.push(*slot, msg).unwrap_or(false));
            }
        }
        if let Some(b) = enc.take() {
            drain(b, &mut got)?;
        }
        prop_assert_eq!(got, entries);
    }

    #[test]
    fn decoding_mutated_attaches_never_panics(flip in 0usize..2000, val in any::<u8>()) {
        let mut frame = encode_control(&attach(9)).expect("encodes");
        let i = flip % frame.len();
        frame[i] = val;
        let _ = read_all::<ToPrimary>(&frame, 5);
    }
}

#[test]
fn a_relay_can_tell_before_it_tries_whether_an_agent_fits_an_attach() {
    let hello = vec![0u8; 64];
    let leaf = vec![0x30; 1200];
    assert!(check_attach(&hello, std::slice::from_ref(&leaf)).is_ok());
    assert!(check_attach(&hello, &vec![leaf.clone(); MAX_CHAIN_CERTS]).is_ok());
    assert!(matches!(
        check_attach(&hello, &vec![leaf.clone(); MAX_CHAIN_CERTS + 1]),
        Err(TrunkError::ChainLength(5))
    ));
    assert!(matches!(
        check_attach(&hello, &[]),
        Err(TrunkError::ChainLength(0))
    ));
    let big = vec![
        vec![0x30; MAX_CHAIN_BYTES / 2 + 1],
        vec![0x30; MAX_CHAIN_BYTES / 2],
    ];
    assert!(check_attach(&hello, &big).is_err());
    // What it refuses is what an attach frame would fail to carry.
    let attach = ToPrimary::Attach(Attach {
        slot: 0,
        hello,
        chain: big,
        source: std::net::IpAddr::from([127, 0, 0, 1]),
    });
    assert!(encode_control(&attach).is_err());
}
