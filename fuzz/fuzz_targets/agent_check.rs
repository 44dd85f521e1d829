//! The HAProxy agent-check: the line the agent answers with, from the state the
//! aggregator's replies left. The reply datagrams are untrusted: each is decoded by an
//! established client session, kept as the report loop keeps it, and the line built
//! from it. The input is operations (`ballast_fuzz::ops`): a datagram each (real
//! replies in the seeds), the tag's low bit saying whether the node drains.
//!
//! Invariants: nothing panics; the line is `drain\n` while draining, otherwise
//! `ready up N%\n` with N a whole percentage between 1 and 10,000 (a weight of at most
//! 100 times the mean), whatever the weight: NaN, infinite, negative or huge.

#![no_main]

use ballast_agent::fuzzing::{agent_check_reply, assigned, shared};
use ballast_fuzz::ops;
use ballast_shared::frame;
use ballast_shared::session::{ClientConfig, ClientEvent, ClientSession};
use ballast_shared::wire::{Hello, Message, Welcome};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering;
use std::time::Instant;

fn check(line: &str, draining: bool) {
    if draining {
        assert_eq!(line, "drain\n");
        return;
    }
    let pct = line
        .strip_prefix("ready up ")
        .and_then(|l| l.strip_suffix("%\n"))
        .unwrap_or_else(|| panic!("malformed agent-check line {line:?}"));
    assert!(pct.bytes().all(|b| b.is_ascii_digit()), "{line:?}");
    let n: u32 = pct.parse().expect("a whole percentage");
    assert!((1..=10_000).contains(&n), "{line:?}");
}

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let sh = shared();
    let hello = Hello {
        node: "web-1".into(),
        service: "web".into(),
        address: "10.0.0.1:8080".into(),
        zone: String::new(),
        version: "0.1.0".into(),
    };
    let mut s = ClientSession::new(hello, ClientConfig::default(), now);
    let welcome = frame::encode(&Message::Welcome(Welcome { interval_ms: 1000 })).expect("frames");
    assert!(matches!(
        s.handle_stream(now, &welcome),
        Ok(Some(ClientEvent::Welcomed { .. }))
    ));
    check(&agent_check_reply(&sh), false);
    for (tag, datagram) in ops(data).take(16) {
        if let Ok(ClientEvent::Assigned { assignment, .. }) = s.handle_datagram(now, datagram) {
            assigned(&sh, assignment);
        }
        let draining = tag & 1 == 1;
        sh.draining.store(draining, Ordering::Relaxed);
        check(&agent_check_reply(&sh), draining);
    }
});
