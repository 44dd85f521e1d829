//! The cycle when the fleet changes: one service of N endpoints (`-- N`, 100,000 by
//! default) cycles 15 times as it is, then 15 times with one newcomer a cycle whose
//! name sorts into the middle of the fleet, so that the cycle first puts it in node
//! order. Prints each cycle's time.
//!
//! Run: `cargo bench -p ballast-balance --bench churn -- 100000`.

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
use ballast_balance::{Balancer, Limits, Observation, Params};
use std::time::Instant;
fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let cycle_ms = params.cycle_ms;
    let mut b = Balancer::new(params, 0);
    b.set_limits(Limits {
        max_endpoints_per_service: usize::MAX,
        ..Limits::default()
    });
    let mut nodes: Vec<String> = (0..n).map(|i| format!("node-{i:06}")).collect();
    for (i, node) in nodes.iter().enumerate() {
        b.register(
            0,
            "svc",
            node,
            &format!("10.{}.{}.{}:80", i / 65_536, (i / 256) % 256, i % 256),
            "",
        )
        .unwrap();
    }
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
