//! A regression on purpose, for the performance gates only (`tests/gates`): compiled
//! only with the `gate-probe` feature, which no shipped build and no `cargo test`
//! enables. With it, each service's cycle busy-waits `cycle=NS` nanoseconds per
//! endpoint, as `BALLAST_GATE_PROBE` sets (`cycle=60`): the cycle gate is run with it
//! to see it fail. The core reads no environment otherwise.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Busy-waits the probe's nanoseconds per endpoint for a cycle of `endpoints`.
pub(crate) fn spin_cycle(endpoints: usize) {
    static NS: OnceLock<u64> = OnceLock::new();
    let ns = *NS.get_or_init(|| {
        std::env::var("BALLAST_GATE_PROBE")
            .unwrap_or_default()
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("cycle="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    if ns == 0 {
        return;
    }
    let until = Instant::now() + Duration::from_nanos(ns.saturating_mul(endpoints as u64));
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}
