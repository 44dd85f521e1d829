//! The previous protocol's codec (`ballast/1`): `wire::v1::decode` on arbitrary bytes,
//! as an aggregator does on every datagram and hello frame of an agent one release
//! behind, and as an agent does on the replies of such an aggregator.
//!
//! Invariants: decoding never panics; what decodes (translated into today's message)
//! encodes again in the previous protocol, never longer than the limit, and that
//! decodes to the same message (floats compared bit for bit through the bytes);
//! today's codec refuses the previous protocol's bytes by their version.

#![no_main]

use ballast_shared::protocol::Protocol;
use ballast_shared::wire::{self, v1, DecodeError, MAX_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = v1::decode(data) else {
        return;
    };
    let bytes = v1::encode(&msg).expect("a decoded message encodes");
    assert!(bytes.len() <= MAX_MESSAGE);
    let again = v1::decode(&bytes).expect("an encoded message decodes");
    assert_eq!(
        v1::encode(&again).expect("re-encodes"),
        bytes,
        "decode(encode(m)) differs from m"
    );
    assert_eq!(
        wire::decode(&bytes),
        Err(DecodeError::UnknownVersion(v1::WIRE_VERSION))
    );
    // Into today's protocol and back: what both versions carry survives.
    let current = Protocol::CURRENT
        .translate(Protocol::PREVIOUS, &bytes)
        .expect("translates");
    let back = Protocol::PREVIOUS
        .translate(Protocol::CURRENT, &current)
        .expect("translates back");
    let (Ok(a), Ok(b)) = (v1::decode_raw(&bytes), v1::decode_raw(&back)) else {
        panic!("both decode");
    };
    if let (v1::Message::Reply(a), v1::Message::Reply(b)) = (&a, &b) {
        assert_eq!(a.weight.to_bits(), b.weight.to_bits());
        assert_eq!((a.cycle, a.interval_ms, a.draining), (b.cycle, b.interval_ms, b.draining));
    }
    if let (v1::Message::Report(a), v1::Message::Report(b)) = (&a, &b) {
        assert_eq!((a.seq, a.inflight, a.capacity, a.state), (b.seq, b.inflight, b.capacity, b.state));
    }
});
