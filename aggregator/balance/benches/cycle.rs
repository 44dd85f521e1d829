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
#[path = "common/cycle.rs"]
mod measure;

use measure::run;

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
