//! The aggregator's session machine (`ServerSession`): bytes on the hello stream in
//! any chunks (real hello frames in the seeds), datagrams (real reports in the seeds),
//! the driver's calls (welcome, reject, reply, interval changes) and the passing of
//! time, in any order, for connections with different grants. The input is a 6-byte
//! header (bad-datagram limit, hello timeout, interval, grant) and operations
//! (`ballast_fuzz::ops`).
//!
//! Invariants: nothing panics; a hello that reaches the driver is valid, from the
//! certificate's node, for a service and address the grant allows; reports taken are
//! each newer than the last (serial-number order); what the machine gives to send
//! decodes to what it should; the interval stays within its bounds; a closed session
//! stays closed and takes nothing more; too many bad datagrams close it.

#![no_main]

use arbitrary::Unstructured;
use ballast_fuzz::{header, ops};
use ballast_shared::session::{
    Assignment, Cidr, Grant, Peer, ServerConfig, ServerError, ServerEvent, ServerSession,
};
use ballast_shared::wire::{self, Message, RejectReason};
use libfuzzer_sys::fuzz_target;
use std::net::IpAddr;
use std::time::{Duration, Instant};

const IDENTITY: &str = "web-1";

/// Operation tags (modulo 8).
const STREAM: u8 = 0;
const STREAM_END: u8 = 1;
const WELCOME: u8 = 2;
const REJECT: u8 = 3;
const DATAGRAM: u8 = 4;
const REPLY: u8 = 5;
const SET_INTERVAL: u8 = 6;
const WAIT: u8 = 7;

fn reason(r: u8) -> RejectReason {
    match r % 6 {
        0 => RejectReason::IdentityMismatch,
        1 => RejectReason::InvalidHello,
        2 => RejectReason::NoHello,
        3 => RejectReason::UnknownService,
        4 => RejectReason::ServiceNotAllowed,
        _ => RejectReason::AddressNotAllowed,
    }
}

/// The grants a connection may hold: anything; one service pattern, one network and
/// host names by pattern; nothing at all.
fn grant(choice: u8) -> Grant {
    match choice % 3 {
        0 => Grant::anything(),
        1 => Grant {
            services: vec!["web".into(), "api-*".into()],
            networks: ["10.0.0.0/8", "fd00::/8"]
                .iter()
                .filter_map(|n| n.parse::<Cidr>().ok())
                .collect(),
            hostnames: vec!["*.example.com".into(), "node-?".into()],
        },
        _ => Grant::default(),
    }
}

/// The message in a frame the machine gave to send.
fn unframe(bytes: &[u8]) -> Message {
    assert!(bytes.len() >= 2, "a frame has its length");
    let len = usize::from(u16::from_be_bytes([bytes[0], bytes[1]]));
    assert_eq!(len, bytes.len() - 2, "the frame's length is its body's");
    wire::decode(&bytes[2..]).expect("a frame the machine sends decodes")
}

fn newer(seq: u32, last: u32) -> bool {
    let ahead = seq.wrapping_sub(last);
    ahead != 0 && ahead < 1 << 31
}

fuzz_target!(|data: &[u8]| {
    let ([max_bad, t0, t1, i0, i1, g], rest) = header::<6>(data);
    let mut now = Instant::now();
    let grant = grant(g);
    let peer = Peer {
        identity: IDENTITY.to_string(),
        source: IpAddr::from([10, 0, 0, 1]),
        grant: grant.clone(),
    };
    let config = ServerConfig {
        interval_ms: u32::from(u16::from_be_bytes([i0, i1])),
        hello_timeout: Duration::from_millis(u64::from(u16::from_be_bytes([t0, t1]))),
        max_bad_datagrams: u32::from(max_bad),
        // The previous version's codec has its own target (wire_v2).
        protocol: ballast_shared::protocol::Protocol::CURRENT,
    };
    let mut s = ServerSession::new(peer, config, now);
    let mut last_seq: Option<u32> = None;
    let mut bad = 0u32;
    for (tag, payload) in ops(rest).take(64) {
        let tag = tag % 8;
        let closed_before = s.close_code();
        let result: Result<(), ServerError> = match tag {
            STREAM => s.handle_stream(now, payload).map(|e| {
                if let Some(e) = e {
                    check_event(&s, &grant, e);
                }
            }),
            STREAM_END => s.handle_stream_end(),
            WELCOME => s.welcome().map(|bytes| {
                match unframe(&bytes) {
                    Message::Welcome(w) => assert!((100..=60_000).contains(&w.interval_ms)),
                    other => panic!("welcome() framed {other:?}"),
                }
                assert!(s.is_established());
                last_seq = None;
                bad = 0;
            }),
            REJECT => {
                let (r, detail) = payload.split_first().unwrap_or((&0, &[]));
                let detail = String::from_utf8_lossy(detail).into_owned();
                s.reject(reason(*r), detail).map(|bytes| {
                    assert!(bytes.len() <= wire::MAX_MESSAGE + 2);
                    assert!(matches!(unframe(&bytes), Message::Reject(_)));
                    assert!(s.close_code().is_some(), "a reject closes the session");
                })
            }
            DATAGRAM => {
                let r = s.handle_datagram(payload);
                on_datagram(&s, r, &mut last_seq, &mut bad)
            }
            REPLY => {
                let mut u = Unstructured::new(payload);
                let a = Assignment {
                    weight: u.arbitrary().unwrap_or(1.0),
                    cycle: u.arbitrary().unwrap_or(1),
                    draining: u.arbitrary().unwrap_or(false),
                    load: u.arbitrary().unwrap_or(0.5),
                    inflight_trusted: u.arbitrary().unwrap_or(true),
                };
                s.reply(&a).map(|bytes| match wire::decode(&bytes) {
                    Ok(Message::Reply(r)) => {
                        assert_eq!(r.cycle, a.cycle);
                        assert_eq!(r.draining, a.draining);
                        assert_eq!(r.interval_ms, s.interval_ms());
                    }
                    other => panic!("reply() encoded {other:?}"),
                })
            }
            SET_INTERVAL => {
                let ms = Unstructured::new(payload).arbitrary().unwrap_or(0u32);
                let got = s.set_interval_ms(ms);
                assert!((100..=60_000).contains(&got));
                assert_eq!(got, s.interval_ms());
                Ok(())
            }
            _ => {
                let ms: u16 = Unstructured::new(payload).arbitrary().unwrap_or(1000);
                now += Duration::from_millis(u64::from(ms));
                if let Some(deadline) = s.poll_timeout() {
                    assert!(s.close_code().is_none());
                    let r = s.handle_timeout(now);
                    if now >= deadline {
                        assert!(matches!(r, Err(ServerError::HelloTimeout(_))));
                        assert!(s.close_code().is_some());
                    }
                }
                Ok(())
            }
        };
        assert!((100..=60_000).contains(&s.interval_ms()));
        if let Some(code) = closed_before {
            assert_eq!(s.close_code(), Some(code), "a closed session reopened");
            if tag != SET_INTERVAL && tag != WAIT {
                assert!(result.is_err(), "a closed session took operation {tag}");
            }
        }
        if s.close_code().is_some() {
            assert!(!s.is_established());
            assert!(s.poll_timeout().is_none());
        }
    }
});

fn check_event(s: &ServerSession, grant: &Grant, e: ServerEvent) {
    match e {
        ServerEvent::Hello(h) => {
            assert!(
                h.validate().is_ok(),
                "an invalid hello reached the driver: {h:?}"
            );
            assert_eq!(h.node, IDENTITY, "another node's hello reached the driver");
            assert!(
                grant.allows_service(&h.service),
                "a service not granted: {h:?}"
            );
            assert!(
                grant.check_address(&h.address, s.peer().source).is_ok(),
                "an address not granted: {h:?}"
            );
            assert_eq!(s.hello(), Some(&h));
        }
        ServerEvent::Refused { reject, frame } => {
            assert!(frame.len() <= wire::MAX_MESSAGE + 2);
            assert_eq!(unframe(&frame), Message::Reject(reject));
            assert!(s.close_code().is_some(), "a refusal closes the session");
        }
        other => panic!("the hello stream yielded {other:?}"),
    }
}

fn on_datagram(
    s: &ServerSession,
    r: Result<ServerEvent, ServerError>,
    last_seq: &mut Option<u32>,
    bad: &mut u32,
) -> Result<(), ServerError> {
    match r {
        Ok(ServerEvent::Report(report)) => {
            if let Some(last) = *last_seq {
                assert!(
                    newer(report.seq, last),
                    "report {} taken after {last}",
                    report.seq
                );
            }
            *last_seq = Some(report.seq);
            Ok(())
        }
        Ok(ServerEvent::Reordered { seq, last }) => {
            assert_eq!(Some(last), *last_seq);
            assert!(!newer(seq, last));
            Ok(())
        }
        Ok(other) => panic!("a datagram yielded {other:?}"),
        Err(ServerError::TooManyBadDatagrams { count, .. }) => {
            *bad += 1;
            assert_eq!(count, *bad);
            assert!(s.close_code().is_some());
            Err(ServerError::Closed)
        }
        Err(ServerError::Protocol(p)) => {
            *bad += 1;
            assert!(
                s.is_established(),
                "a bad datagram closed the session early: {p}"
            );
            Err(ServerError::Protocol(p))
        }
        Err(e) => Err(e),
    }
}
