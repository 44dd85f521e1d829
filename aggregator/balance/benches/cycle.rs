//! The balancing core's cycle at fleet scale, beside a trivial baseline on the same
//! data: one pass that reads every endpoint's load and writes a weight. The ratio says
//! how much of a cycle is bookkeeping rather than arithmetic; the milliseconds drift
//! with the machine, the ratio much less.
//!
//! Run: `cargo bench -p ballast-balance --bench cycle` (`-- quick` for 10,000
//! endpoints only; `-- N` for one size of N endpoints).
//!
//! Each size runs warm-up cycles first (the cold start and the feed-forward step are
//! behind it), then times `ROUNDS` cycles: the reports of a cycle (`observe`), the cycle
//! itself, and its publication (the value every reader takes), each as the median of the
//! rounds. The baseline runs on a plain vector of the same loads in the same rounds.
//!
//! Reports arrive in node order in even rounds and in a shuffled order (the same one
//! every odd round, from a fixed seed) in odd rounds, as they do from a real fleet:
//! the two observe figures are the medians of each.

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use ballast_balance::{Observation, Published};
use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::time::Instant;

const WARMUP: u64 = 12;
const ROUNDS: u64 = 15;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = if let Some(n) = args.iter().find_map(|a| a.parse().ok()) {
        vec![n]
    } else if args.iter().any(|a| a == "quick") {
        vec![10_000]
    } else {
        vec![1_000, 10_000, 100_000]
    };
    println!("## The cycle beside a trivial pass (one thread, one service)\n");
    println!(
        "| endpoints | observe in node order, ns/report | observe shuffled, ns/report | cycle, ms | publish, ms | cycle + publish, ms | trivial pass, ms | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for n in sizes {
        let r = run(n);
        println!(
            "| {n} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.3} | {:.0}× |",
            r.observe_ns,
            r.shuffled_ns,
            r.cycle_ms,
            r.publish_ms,
            r.cycle_ms + r.publish_ms,
            r.trivial_ms,
            (r.cycle_ms + r.publish_ms) / r.trivial_ms.max(1e-9)
        );
    }
}

struct Figures {
    observe_ns: f64,
    shuffled_ns: f64,
    cycle_ms: f64,
    publish_ms: f64,
    trivial_ms: f64,
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(n: usize) -> Figures {
    let (mut b, nodes, cycle_ms) = common::fleet(n);
    let ran: BTreeSet<String> = ["svc".to_string()].into();
    let localities = BTreeMap::new();
    let mut published = Published::default();
    let in_order: Vec<usize> = (0..n).collect();
    let shuffled = shuffled(n);
    let (mut observe, mut cycle, mut publish) = (Vec::new(), Vec::new(), Vec::new());
    let mut observe_shuffled = Vec::new();
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
        }
    }
    black_box(&published);
    Figures {
        observe_ns: median(observe),
        shuffled_ns: median(observe_shuffled),
        cycle_ms: median(cycle),
        publish_ms: median(publish),
        trivial_ms: trivial(n),
    }
}

/// The least a cycle can do: read every endpoint's load, compute the average, and
/// write each weight from its error, on a flat vector.
fn trivial(n: usize) -> f64 {
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
    median(times)
}
