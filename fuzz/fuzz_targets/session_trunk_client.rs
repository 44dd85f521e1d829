//! The relay's trunk machine (`TrunkClient`): control-stream bytes in any chunks (real
//! frames in the seeds), batches of replies, and the driver's calls (attach, detach,
//! push a report, flush) and the passing of time, in any order. The input is a 3-byte
//! header (batch limit, batch delay) and operations (`ballast_fuzz::ops`); a call's
//! slot is its payload's first byte.
//!
//! Invariants: nothing panics; slots are given in increasing order; every batch of
//! reports decodes and fits its limit; replies are handed back only for attached
//! slots; a timeout comes no earlier than asked; a closed trunk stays closed.

#![no_main]

use ballast_fuzz::{header, ops};
use ballast_shared::session::trunk::TrunkClientConfig;
use ballast_shared::session::TrunkClient;
use ballast_shared::trunk::{decode_batch, BatchKind};
use libfuzzer_sys::fuzz_target;
use std::net::IpAddr;
use std::time::{Duration, Instant};

fn batch_ok(b: &[u8], limit: usize) {
    assert!(
        b.len() <= limit,
        "a batch of {} bytes over {limit}",
        b.len()
    );
    decode_batch(b, BatchKind::Reports).expect("a batch the relay sends decodes");
}

fuzz_target!(|data: &[u8]| {
    let ([l0, l1, delay], rest) = header::<3>(data);
    let mut now = Instant::now();
    let limit = usize::from(u16::from_be_bytes([l0, l1]));
    let config = TrunkClientConfig {
        batch_delay: Duration::from_millis(u64::from(delay)),
        max_batch_bytes: limit,
        ..TrunkClientConfig::new("relay-1")
    };
    let mut c = TrunkClient::new(config);
    c.open_frame().expect("the open frame encodes");
    let mut last_slot: Option<u64> = None;
    for (tag, payload) in ops(rest).take(128) {
        let closed = c.is_closed();
        let slot = u64::from(payload.first().copied().unwrap_or(0));
        match tag % 7 {
            0 => drop(c.handle_control(payload)),
            1 => {
                let source = IpAddr::from([10, 0, 0, 1]);
                if let Ok((s, _)) = c.attach(now, payload, vec![vec![0x30; 8]], source) {
                    assert!(
                        last_slot.is_none_or(|l| s > l),
                        "slot {s} after {last_slot:?}"
                    );
                    last_slot = Some(s);
                }
            }
            2 => drop(c.detach(slot)),
            3 => {
                if let Ok(Some(b)) = c.push_report(now, slot, payload.get(1..).unwrap_or_default())
                {
                    batch_ok(&b, limit);
                }
            }
            4 => {
                if let Ok(entries) = c.handle_datagram(payload) {
                    for e in entries {
                        assert!(
                            c.is_attached(e.slot),
                            "a reply for slot {} not attached",
                            e.slot
                        );
                    }
                }
            }
            5 => {
                let ms = u64::from(u16::from_be_bytes([
                    payload.first().copied().unwrap_or(0),
                    payload.get(1).copied().unwrap_or(0),
                ]));
                let due = c.poll_timeout();
                now += Duration::from_millis(ms);
                let expired = c.handle_timeout(now);
                if expired.batch.is_some() || !expired.timed_out.is_empty() {
                    assert!(due.is_some_and(|d| d <= now), "expired before its time");
                }
                if let Some(b) = expired.batch {
                    batch_ok(&b, limit);
                }
            }
            _ => {
                if let Some(b) = c.flush() {
                    batch_ok(&b, limit);
                }
            }
        }
        if closed {
            assert!(c.is_closed(), "a closed trunk reopened");
            assert_eq!(c.slot_count(), 0);
        }
    }
});
