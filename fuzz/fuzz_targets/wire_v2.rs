//! The previous protocol's codec (`ballast/2`): `wire::v2::decode` on arbitrary bytes,
//! as an aggregator does on every datagram and hello frame of an agent one release
//! behind, and as an agent does on the replies of such an aggregator.
//!
//! Invariants: decoding never panics; what decodes (translated into today's message)
//! encodes again in the previous protocol, never longer than the limit, and that
//! decodes to the same message (floats compared bit for bit through the bytes);
//! today's codec refuses the previous protocol's bytes by their version; a report
//! translated into today's has its count as its mean and no age.

#![no_main]

use ballast_shared::protocol::Protocol;
use ballast_shared::wire::{self, v2, DecodeError, Message, MAX_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = v2::decode(data) else {
        return;
    };
    if let Message::Report(r) = &msg {
        assert_eq!(r.inflight_mean, r.inflight as f32);
        assert_eq!(r.age, None);
    }
    let bytes = v2::encode(&msg).expect("a decoded message encodes");
    assert!(bytes.len() <= MAX_MESSAGE);
    let again = v2::decode(&bytes).expect("an encoded message decodes");
    assert_eq!(
        v2::encode(&again).expect("re-encodes"),
        bytes,
        "decode(encode(m)) differs from m"
    );
    assert_eq!(
        wire::decode(&bytes),
        Err(DecodeError::UnknownVersion(v2::WIRE_VERSION))
    );
    // Into today's protocol and back: the same bytes, since today's carries all the
    // previous one does.
    let current = Protocol::CURRENT
        .translate(Protocol::PREVIOUS, &bytes)
        .expect("translates");
    let back = Protocol::PREVIOUS
        .translate(Protocol::CURRENT, &current)
        .expect("translates back");
    assert_eq!(back, bytes, "a round trip through today's protocol changed it");
});
