//! The cycle bench's measurement, shared by the bench (`benches/cycle.rs`) and the
//! performance gate (`tests/cycle_gate.rs`): the cycle at fleet scale, and a trivial
//! pass over the same loads, in one run.

use super::common;
use ballast_balance::{Observation, Published};
use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::time::Instant;

/// Cycles run before any is timed: the cold start and the feed-forward step.
pub(crate) const WARMUP: u64 = 12;
/// Cycles timed, each figure the median of them.
pub(crate) const ROUNDS: u64 = 15;

// The bench prints the medians, the gate asserts on the fastest rounds: each reads
// its own.
#[allow(dead_code)]
pub(crate) struct Figures {
    pub(crate) observe_ns: f64,
    pub(crate) shuffled_ns: f64,
    pub(crate) cycle_ms: f64,
    pub(crate) publish_ms: f64,
    pub(crate) trivial_ms: f64,
    /// The fastest round's cycle + publish, and the fastest trivial pass: the figures
    /// least moved by whatever else the machine runs (a round is only ever slowed).
    pub(crate) best_ms: f64,
    pub(crate) trivial_best_ms: f64,
}

/// The load endpoint `i` reports in round `r`: seven speeds, and a little movement
/// from round to round so that weights change and versions are published.
fn cpu(i: usize, r: u64) -> f64 {
    0.3 + (i % 7) as f64 * 0.05 + ((i as u64 + r) % 5) as f64 * 0.004
}

/// `0..n` in an order shuffled by a fixed seed (Fisher-Yates on a xorshift
/// generator), so that every run reports in the same order.
fn shuffled(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The figures of one run at `n` endpoints.
pub(crate) fn run(n: usize) -> Figures {
    let (mut b, nodes, cycle_ms) = common::fleet(n);
    let ran: BTreeSet<String> = ["svc".to_string()].into();
    let localities = BTreeMap::new();
    let mut published = Published::default();
    let in_order: Vec<usize> = (0..n).collect();
    let shuffled = shuffled(n);
    let (mut observe, mut cycle, mut publish) = (Vec::new(), Vec::new(), Vec::new());
    let mut observe_shuffled = Vec::new();
    let mut best = f64::INFINITY;
    for r in 0..WARMUP + ROUNDS {
        let now = (r + 1) * cycle_ms;
        let order = if r % 2 == 0 { &in_order } else { &shuffled };
        let t = Instant::now();
        for &i in order {
            let node = &nodes[i];
            let obs = Observation {
                seq: Some(r as u32 + 1),
                cpu: cpu(i, r),
                ..Observation::default()
            };
            b.observe(now, "svc", node, obs).expect("observe");
        }
        let t_observe = t.elapsed();
        let t = Instant::now();
        black_box(b.cycle(now));
        let t_cycle = t.elapsed();
        // What the daemon adds to each cycle: the value every reader takes; the
        // previous one is dropped once the last reader lets go of it, here at once.
        let t = Instant::now();
        published = published.next(&b, &ran, &localities, now);
        let t_publish = t.elapsed();
        if r >= WARMUP {
            let ns = t_observe.as_secs_f64() * 1e9 / n as f64;
            if r % 2 == 0 {
                observe.push(ns);
            } else {
                observe_shuffled.push(ns);
            }
            cycle.push(t_cycle.as_secs_f64() * 1e3);
            publish.push(t_publish.as_secs_f64() * 1e3);
            best = best.min((t_cycle + t_publish).as_secs_f64() * 1e3);
        }
    }
    black_box(&published);
    let (trivial_ms, trivial_best_ms) = trivial(n);
    Figures {
        observe_ns: median(observe),
        shuffled_ns: median(observe_shuffled),
        cycle_ms: median(cycle),
        publish_ms: median(publish),
        trivial_ms,
        best_ms: best,
        trivial_best_ms,
    }
}

/// The least a cycle can do: read every endpoint's load, compute the average, and
/// write each weight from its error, on a flat vector. The median round and the
/// fastest, in milliseconds.
fn trivial(n: usize) -> (f64, f64) {
    let mut loads: Vec<(f64, f64)> = (0..n).map(|i| (cpu(i, 0), 1.0)).collect();
    let mut times = Vec::new();
    for r in 0..WARMUP + ROUNDS {
        for (i, e) in loads.iter_mut().enumerate() {
            e.0 = cpu(i, r);
        }
        let t = Instant::now();
        let avg = loads.iter().map(|e| e.0).sum::<f64>() / n as f64;
        for e in loads.iter_mut() {
            e.1 *= 1.0 + 0.1 * (avg - e.0) / avg;
        }
        black_box(&loads);
        if r >= WARMUP {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    (median(times), best)
}
