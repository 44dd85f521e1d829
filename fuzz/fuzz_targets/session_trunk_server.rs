//! The primary's trunk machine (`TrunkServer`): control-stream bytes in any chunks
//! (real frames in the seeds), batches of reports, and the driver's calls (admit,
//! welcome, reject, detach, reply, take the replies) for any slot, in any order. The
//! input is a 2-byte header (slot limit, bad-batch limit) and operations
//! (`ballast_fuzz::ops`); a call's slot is its payload's first byte.
//!
//! Invariants: nothing panics; the slots never pass their limit; every frame the
//! machine gives decodes as a primary's frame, and every batch of replies decodes and
//! fits its limit; a closed trunk stays closed and takes nothing more.

#![no_main]

use ballast_fuzz::{header, ops};
use ballast_shared::session::trunk::{TrunkServerConfig, TrunkServerError};
use ballast_shared::session::{Assignment, Grant, Peer, ServerConfig, TrunkServer};
use ballast_shared::trunk::{decode_batch, decode_control, BatchKind, ToRelay};
use ballast_shared::wire::RejectReason;
use libfuzzer_sys::fuzz_target;
use std::net::IpAddr;
use std::time::Instant;

fn frame_ok(frame: &[u8]) {
    assert!(frame.len() > 4);
    decode_control::<ToRelay>(&frame[4..]).expect("a frame the primary sends decodes");
}

fuzz_target!(|data: &[u8]| {
    let ([max_slots, max_bad], rest) = header::<2>(data);
    let now = Instant::now();
    let config = TrunkServerConfig {
        max_slots: u32::from(max_slots),
        max_batch_bytes: 300,
        max_bad_batches: u32::from(max_bad),
        ..TrunkServerConfig::new("a", ServerConfig::new(1000))
    };
    let mut s = TrunkServer::new(config);
    let peer = Peer {
        identity: "web-1".into(),
        source: IpAddr::from([10, 0, 0, 1]),
        grant: Grant::anything(),
    };
    let assignment = Assignment {
        weight: 1.0,
        cycle: 1,
        draining: false,
        load: 0.5,
        inflight_trusted: true,
    };
    for (tag, payload) in ops(rest).take(128) {
        let closed = s.close_code();
        let slot = u64::from(payload.first().copied().unwrap_or(0));
        let result: Result<(), TrunkServerError> = match tag % 8 {
            0 => s.handle_control(payload).map(|events| {
                for e in events {
                    if let ballast_shared::session::trunk::TrunkServerEvent::Refused {
                        frame, ..
                    } = e
                    {
                        frame_ok(&frame);
                    }
                }
            }),
            1 => s.admit(slot, peer.clone(), now).map(|a| {
                if let ballast_shared::session::trunk::Admission::Refused { frame, .. } = a {
                    frame_ok(&frame);
                }
            }),
            2 => s.welcome(slot).map(|f| frame_ok(&f)),
            3 => s
                .reject(slot, RejectReason::NotOwner, "b")
                .map(|f| frame_ok(&f)),
            4 => s.detach(slot, 5, "moved").map(|f| frame_ok(&f)),
            5 => s.handle_datagram(payload).map(drop),
            6 => s.reply(slot, &assignment).map(|full| {
                if let Some(b) = full {
                    assert!(b.len() <= 300);
                    decode_batch(&b, BatchKind::Replies).expect("replies decode");
                }
            }),
            _ => {
                if let Some(b) = s.take_replies() {
                    assert!(b.len() <= 300);
                    decode_batch(&b, BatchKind::Replies).expect("replies decode");
                }
                Ok(())
            }
        };
        assert!(s.slot_count() <= usize::from(max_slots));
        if let Some(code) = closed {
            assert_eq!(s.close_code(), Some(code), "a closed trunk reopened");
            if tag % 8 != 7 {
                assert!(result.is_err(), "a closed trunk took operation {tag}");
            }
            assert_eq!(s.slot_count(), 0);
        }
    }
});
