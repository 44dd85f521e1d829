//! The trunk codec (`ballast_shared::trunk`): control streams in any chunks, as a
//! primary reads a relay's and a relay a primary's, a replica's routes stream as a
//! relay reads it (`ballast_shared::trunk::routes`), and datagram batches of either
//! kind. The input is a 2-byte header (what the rest is: 0 a relay's control stream, 1
//! a primary's, 2 a batch of reports, 3 a batch of replies, 4 a routes stream; the
//! chunk size) and the bytes.
//!
//! Invariants: nothing panics; every decoded control message holds its limits,
//! encodes, and decodes again to itself, in no more bytes than it came in; the reader
//! keeps no more than one frame; a decoded batch is re-encoded by `BatchEncoder` to
//! the very same bytes (one encoding per batch), in one batch.

#![no_main]

use ballast_fuzz::header;
use ballast_shared::trunk::{
    decode_batch, decode_control, encode_control, BatchEncoder, BatchKind, ControlMessage,
    ControlReader, ToPrimary, ToRelay, MAX_BATCH, MAX_CONTROL_FRAME,
};
use ballast_shared::trunk::routes::RoutesMessage;
use libfuzzer_sys::fuzz_target;
use std::fmt::Debug;

fn control<M: ControlMessage + PartialEq + Debug>(data: &[u8], chunk: usize) {
    let mut reader = ControlReader::<M>::new();
    let mut taken = 0usize;
    for c in data.chunks(chunk) {
        let Ok(msgs) = reader.push(c) else {
            assert!(reader.push(&[1]).is_err(), "a failed reader took more");
            return;
        };
        for m in msgs {
            let frame = encode_control(&m).expect("a decoded message encodes");
            assert!(frame.len() <= MAX_CONTROL_FRAME + 4);
            taken += frame.len();
            assert!(taken <= data.len(), "the canonical encoding is longer");
            let again: M = decode_control(&frame[4..]).expect("an encoded message decodes");
            assert_eq!(again, m);
        }
    }
}

fn batch(data: &[u8], kind: BatchKind) {
    let Ok(entries) = decode_batch(data, kind) else {
        return;
    };
    assert!(!entries.is_empty() && data.len() <= MAX_BATCH);
    let mut enc = BatchEncoder::new(kind, data.len());
    for e in &entries {
        assert_eq!(
            enc.push(e.slot, e.message),
            Ok(true),
            "an entry did not fit again"
        );
    }
    assert_eq!(
        enc.take().as_deref(),
        Some(data),
        "another encoding of the batch"
    );
}

fuzz_target!(|data: &[u8]| {
    let ([mode, chunk], rest) = header::<2>(data);
    let chunk = usize::from(chunk).max(1);
    match mode % 5 {
        0 => control::<ToPrimary>(rest, chunk),
        1 => control::<ToRelay>(rest, chunk),
        2 => batch(rest, BatchKind::Reports),
        3 => batch(rest, BatchKind::Replies),
        _ => control::<RoutesMessage>(rest, chunk),
    }
});
