//! The cycle when the fleet changes: one service of N endpoints (`-- N`, 100,000 by
//! default) cycles 15 times as it is, then 15 times with one newcomer a cycle whose
//! name sorts into the middle of the fleet, so that the cycle first puts it in node
//! order. Prints each cycle's time.
//!
//! Run: `cargo bench -p ballast-balance --bench churn -- 100000`.

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
mod common;

use ballast_balance::Observation;
use std::time::Instant;
fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let (mut b, mut nodes, cycle_ms) = common::fleet(n);
    for r in 0..30u64 {
        let now = (r + 1) * cycle_ms;
        if r >= 15 {
            // One newcomer a cycle, named in the middle of the fleet.
            let node = format!("node-{:06}x", (r as usize * 7919) % n);
            b.register(now, "svc", &node, &format!("11.0.0.{r}:80"), "")
                .unwrap();
            nodes.push(node);
        }
        for (i, node) in nodes.iter().enumerate() {
            let obs = Observation {
                seq: Some(r as u32 + 1),
                cpu: 0.3 + (i % 7) as f64 * 0.05,
                ..Observation::default()
            };
            b.observe(now, "svc", node, obs).unwrap();
        }
        let t = Instant::now();
        b.cycle(now);
        println!(
            "round {r} cycle {:.2} ms{}",
            t.elapsed().as_secs_f64() * 1e3,
            if r >= 15 {
                " (one newcomer out of order)"
            } else {
                ""
            }
        );
    }
}
