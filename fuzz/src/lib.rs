//! What the fuzz targets share: the operation format of the targets that drive a state
//! machine, which the seed generator (`examples/seeds.rs`) writes.
//!
//! An input is a header the target reads first, then operations, each a tag byte, a
//! 2-byte big-endian length and that many bytes of payload (fewer, if the input ends
//! first). Real messages go in payloads as they are, so seeds are real bytes.

/// The operations of `data`: (tag, payload) pairs.
pub fn ops(mut data: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    std::iter::from_fn(move || {
        let (&tag, rest) = data.split_first()?;
        let (len, rest) = match rest {
            [a, b, rest @ ..] => (usize::from(u16::from_be_bytes([*a, *b])), rest),
            _ => (0, &[][..]),
        };
        let (payload, tail) = rest.split_at(len.min(rest.len()));
        data = tail;
        Some((tag, payload))
    })
}

/// Appends one operation to `out`, for seeds.
pub fn op(out: &mut Vec<u8>, tag: u8, payload: &[u8]) {
    let len = u16::try_from(payload.len()).unwrap_or(u16::MAX);
    out.push(tag);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&payload[..usize::from(len)]);
}

/// The first `n` bytes of `data` as a header (zero-padded), and the rest.
pub fn header<const N: usize>(data: &[u8]) -> ([u8; N], &[u8]) {
    let mut h = [0u8; N];
    let n = data.len().min(N);
    h[..n].copy_from_slice(&data[..n]);
    (h, &data[n..])
}

/// Checks parameters the product accepted: they validate, and every number is finite
/// and not negative. `what` names where they came from, for the failure message.
pub fn assert_params_sane(p: &ballast_balance::Params, what: &str) {
    assert_eq!(p.validate(), Ok(()), "{what}");
    for v in [
        p.missing_threshold,
        p.cold_start_weight,
        p.min_weight,
        p.max_weight,
        p.max_growth,
        p.max_shrink,
        p.thin_load,
        p.jump_threshold,
        p.error_penalty,
        p.pid.kp,
        p.pid.ki,
        p.pid.kd,
        p.pid.derivative_filter,
        p.pid.integral_limit,
    ] {
        assert!(v.is_finite() && v >= 0.0, "{what}: {v} accepted in {p:?}");
    }
}
