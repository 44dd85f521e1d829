//! Scenario: an operator gives the aggregator several QUIC threads (`quic_threads`).
//!
//! Each thread has a socket of its own on the one QUIC port, and the kernel spreads
//! the agents over them. Every agent must connect, report and hold a weight, whichever
//! socket it lands on, and the threads must share the work: with 12 agents and 3
//! sockets, at least two threads serve reports (all 12 on one socket has a chance of
//! 3 in 531,441).

use ballast_tests::*;
use std::time::Duration;

const SERVICE: &str = "threaded";
const THREADS: usize = 3;
const AGENTS: usize = 12;
const WAIT: Duration = Duration::from_secs(20);

/// Each QUIC thread of `pid` by name, with the times it has been scheduled so far.
fn quic_threads(pid: u32) -> Vec<(String, u64)> {
    let mut found = Vec::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the aggregator's threads");
    for task in tasks.flatten() {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let name = name.trim();
        if !name.starts_with("ballast-quic-") {
            continue;
        }
        // The third field of schedstat: how many times the thread was given the CPU.
        let runs = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
            .unwrap_or(0);
        found.push((name.to_string(), runs));
    }
    found.sort();
    found
}

#[test]
fn agents_spread_over_the_quic_threads_and_all_are_served() {
    let pki = Pki::new();
    let mut opts = AggregatorOpts::default().grace_ms(500);
    opts.config_toml = Some(format!("quic_threads = {THREADS}\n"));
    let agg = Aggregator::start(&pki, opts);
    let pid = agg.pid().expect("the aggregator runs");
    let threads = quic_threads(pid);
    assert_eq!(
        threads.len(),
        THREADS,
        "quic_threads = {THREADS} must start that many QUIC threads, found {threads:?}"
    );

    let fleet = start_fleet(&pki, &agg, SERVICE, AGENTS, &[0.7, 1.0, 1.3]);
    for a in &fleet {
        a.wait_weight(WAIT);
    }
    wait_for(WAIT, "the fleet served through every socket", || {
        fleet_served(&agg, SERVICE, &fleet)
    });

    // Who serves the reports from now on: a window of several report intervals.
    let before = quic_threads(pid);
    std::thread::sleep(Duration::from_secs(3));
    let after = quic_threads(pid);
    let busy: Vec<&str> = before
        .iter()
        .zip(&after)
        .filter(|((_, a), (_, b))| b > a)
        .map(|((name, _), _)| name.as_str())
        .collect();
    assert!(
        busy.len() >= 2,
        "{AGENTS} agents over {THREADS} sockets, yet only {busy:?} served reports \
         (before {before:?}, after {after:?}): the kernel is not spreading them"
    );
    fleet_served(&agg, SERVICE, &fleet).expect("still served after the window");
}
