//! The wire envelope and every message: `wire::decode` on arbitrary bytes, as the
//! aggregator and the agent do on every datagram and hello frame.
//!
//! Invariants: decoding never panics; a decoded message encodes; decode∘encode
//! round-trips (the re-encoding decodes to a message with the very same bytes, which
//! compares float fields bit for bit, NaN included); the canonical encoding is never
//! longer than the input; its frame is the same bytes behind their length.

#![no_main]

use ballast_shared::wire::{self, Message};
use ballast_shared::{frame, wire::MAX_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = wire::decode(data) else {
        return;
    };
    let bytes = wire::encode(&msg).expect("a decoded message encodes");
    assert!(
        bytes.len() <= data.len() && bytes.len() <= MAX_MESSAGE,
        "the canonical encoding ({} bytes) is longer than the input ({} bytes)",
        bytes.len(),
        data.len()
    );
    let again = wire::decode(&bytes).expect("an encoded message decodes");
    assert_eq!(
        wire::encode(&again).expect("re-encodes"),
        bytes,
        "decode(encode(m)) differs from m"
    );
    // Messages without floats compare whole.
    if matches!(
        msg,
        Message::Hello(_) | Message::Welcome(_) | Message::Reject(_)
    ) {
        assert_eq!(again, msg);
    }
    let framed = frame::encode(&msg).expect("a decoded message frames");
    assert_eq!(
        usize::from(u16::from_be_bytes([framed[0], framed[1]])),
        bytes.len()
    );
    assert_eq!(&framed[2..], &bytes[..]);
    if let Message::Hello(h) = &msg {
        // Validation must hold up to whatever the hello holds.
        if h.validate().is_ok() {
            assert!(wire::is_host_port(&h.address));
            assert!(!h.node.is_empty() && wire::is_valid_name(&h.node));
        }
    }
});
