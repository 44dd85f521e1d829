//! The netlink `sock_diag` dump parser the agent's TCP in-flight source reads the
//! kernel's answers with: `parse_chunk` on the input as a datagram (real dumps in the
//! seeds), for the request its first message answers; and on datagrams built from
//! socket records drawn from the input (with and without `tcp_info`, other
//! attributes, other sequence numbers, then `NLMSG_DONE`).
//!
//! Invariants: nothing panics; owed ≤ established ≤ sockets; a built datagram counts
//! exactly its records: the established ones on the ports, and of those the ones owed
//! a response (unread bytes, or data received more recently than sent).

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use ballast_agent::fuzzing::netlink_chunk;
use libfuzzer_sys::fuzz_target;

const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const INET_DIAG_MSG_LEN: usize = 72;
const INET_DIAG_INFO: u16 = 2;

#[derive(Arbitrary, Debug)]
struct Record {
    state: u8,
    sport: u16,
    rqueue: u8,
    /// `tcp_info` with (sent, received) ages, and whether data was ever sent.
    info: Option<(u16, u16, bool)>,
    other_attr: Option<Vec<u8>>,
    /// A leftover of an earlier request.
    old_seq: bool,
}

fn msg(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(NLMSG_HDRLEN + payload.len()).expect("small");
    let mut m = Vec::new();
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&2u16.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&4242u32.to_ne_bytes());
    m.extend_from_slice(payload);
    m.resize((m.len() + 3) & !3, 0);
    m
}

fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
    let mut a = Vec::new();
    a.extend_from_slice(&len.to_ne_bytes());
    a.extend_from_slice(&kind.to_ne_bytes());
    a.extend_from_slice(value);
    a.resize((a.len() + 3) & !3, 0);
    a
}

fn tcp_info(sent: u32, recv: u32, answered: bool) -> Vec<u8> {
    let mut info = vec![0u8; 232];
    info[44..48].copy_from_slice(&sent.to_ne_bytes());
    info[52..56].copy_from_slice(&recv.to_ne_bytes());
    info[152..156].copy_from_slice(&1u32.to_ne_bytes()); // data segments in
    info[156..160].copy_from_slice(&u32::from(answered).to_ne_bytes()); // and out
    info
}

/// The ports of the service: sorted, as the counter keeps them.
const PORTS: [u16; 3] = [80, 443, 8080];

fuzz_target!(|data: &[u8]| {
    // The request the datagram answers: the first message's sequence number, and its
    // type if it is one of the two record types.
    let seq = data
        .get(8..12)
        .map_or(7, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    let kind = match data.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]])) {
        Some(18) => 18,
        _ => 20,
    };
    if let Ok(c) = netlink_chunk(data, seq, kind, &PORTS) {
        assert!(
            c.owed <= c.established && c.established <= c.sockets,
            "{c:?}"
        );
        assert!(c.refused.is_none() || c.done);
    }
    // A datagram of known records.
    let mut u = Unstructured::new(data);
    let records: Vec<Record> = u.arbitrary().unwrap_or_default();
    let done: bool = u.arbitrary().unwrap_or(true);
    let mut buf = Vec::new();
    let (mut sockets, mut established, mut owed) = (0u32, 0u32, 0u32);
    for r in records.iter().take(64) {
        let mut p = vec![0u8; INET_DIAG_MSG_LEN];
        p[0] = 2;
        p[1] = r.state;
        p[4..6].copy_from_slice(&r.sport.to_be_bytes());
        p[56..60].copy_from_slice(&u32::from(r.rqueue).to_ne_bytes());
        if let Some(value) = &r.other_attr {
            // Any attribute but INET_DIAG_INFO, whatever it holds.
            let t = 8 + u16::try_from(value.len() % 8).unwrap_or(0);
            p.extend(attr(t, value));
        }
        if let Some((sent, recv, answered)) = r.info {
            p.extend(attr(
                INET_DIAG_INFO,
                &tcp_info(u32::from(sent), u32::from(recv), answered),
            ));
        }
        let record_seq = if r.old_seq { seq.wrapping_sub(1) } else { seq };
        buf.extend(msg(kind, record_seq, &p));
        if r.old_seq {
            continue;
        }
        sockets += 1;
        if r.state == 1 && PORTS.binary_search(&r.sport).is_ok() {
            established += 1;
            let times_owe = r
                .info
                .is_some_and(|(sent, recv, answered)| recv < sent || (recv == sent && !answered));
            if r.rqueue > 0 || times_owe {
                owed += 1;
            }
        }
    }
    if done {
        buf.extend(msg(NLMSG_DONE, seq, &0i32.to_ne_bytes()));
    }
    let c = netlink_chunk(&buf, seq, kind, &PORTS).expect("a well-formed datagram parses");
    assert_eq!(
        (c.sockets, c.established, c.owed, c.done, c.refused),
        (sockets, established, owed, done, None)
    );
});
