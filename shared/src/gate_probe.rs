//! A regression on purpose, for the performance gates only (`tests/gates`).
//!
//! Compiled only with the `gate-probe` feature, which no shipped build and no
//! `cargo test` enables: a normal build has neither this code nor the environment read.
//! With it, `BALLAST_GATE_PROBE` names what to slow down, as `WHAT=N` pairs separated
//! by commas: `direct=NS` busy-waits NS nanoseconds per report accepted from an agent's
//! own connection, `trunk=NS` per report accepted from a relay's trunk, `agent=NS` per
//! report an agent sends, `leak=BYTES` keeps BYTES per accepted direct report for
//! good. Each gate is run with one of them to see it fail (docs/performance.md).

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The amount the probe sets for `what`, read once from `BALLAST_GATE_PROBE`.
pub fn amount(what: &str) -> u64 {
    static PROBE: OnceLock<Vec<(String, u64)>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            std::env::var("BALLAST_GATE_PROBE")
                .unwrap_or_default()
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.trim().to_string(), v.trim().parse().ok()?))
                })
                .collect()
        })
        .iter()
        .find(|(k, _)| k == what)
        .map_or(0, |(_, v)| *v)
}

/// Busy-waits the nanoseconds the probe sets for `what` (none when unset).
pub fn spin(what: &str) {
    let ns = amount(what);
    if ns == 0 {
        return;
    }
    let until = Instant::now() + Duration::from_nanos(ns);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Keeps the bytes the probe sets for `leak` for the life of the process.
pub fn leak() {
    static KEPT: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
    let bytes = amount("leak") as usize;
    if bytes > 0 {
        if let Ok(mut kept) = KEPT.lock() {
            // Touched, so that the pages count in the resident set.
            kept.push(vec![1u8; bytes]);
        }
    }
}
