//! Scenario: the README's first command, `ballast-sim demo`, run as a user runs it
//! (the shipped defaults: 12 agents of speeds 0.6, 1.0 and 1.5, offered load 0.6), only
//! shorter: 15 cycles. It starts a real aggregator and 12 real agents on loopback and
//! prints a summary; the test reads it and checks the fleet converged as the README
//! says: max/avg at equal weights around 1.5, and within 5 % of the average from cycle 5
//! at the latest, every cycle on.

use ballast_tests::harness::ports::free_tcp;
use ballast_tests::harness::process::{command, run_bounded};
use std::time::Duration;

/// The figure after `label` in the demo's summary.
fn figure(summary: &str, label: &str) -> f64 {
    summary
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .and_then(|rest| rest.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {label:?} in the summary:\n{summary}"))
}

#[test]
fn the_readme_demo_converges() {
    let mut cmd = command("ballast-sim");
    cmd.args(["demo", "--cycles", "15"])
        .args(["--http", &format!("127.0.0.1:{}", free_tcp())]);
    let out = run_bounded(cmd, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the demo failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let round_robin = figure(&stdout, "max/avg at equal weights (round robin):");
    let now = figure(&stdout, "max/avg now:");
    // Equal weights over speeds 0.6, 1.0 and 1.5 give 1 / 0.6 ÷ mean(1/speed) ≈ 1.5.
    assert!(
        (1.4..1.65).contains(&round_robin),
        "round robin at {round_robin}:\n{stdout}"
    );
    // The README shows 1.01–1.04 (2 % noise); the demo's own claim is within 5 %.
    assert!(now <= 1.05, "max/avg {now} after 15 cycles:\n{stdout}");
    // The README says the hottest node stays within 5 % of the average from cycle 5 at
    // the latest (the feed-forward step is taken from one noisy reading, so cycles 2–4
    // may reach 1.05–1.06; eleven runs settled from cycle 2, 2, 2, 2, 2, 2, 2, 2, 2, 4
    // and 5): the summary must say so, and every cycle the table prints from then on
    // must hold it.
    let from: u32 = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("within 5 % of the average from cycle ")?
                .strip_suffix(" on")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("the summary does not say when it converged:\n{stdout}"));
    assert!(from <= 5, "within 5 % only from cycle {from}:\n{stdout}");
    let rows: Vec<(u32, f64)> = stdout
        .lines()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            Some((cols.next()?.parse().ok()?, cols.next()?.parse().ok()?))
        })
        .collect();
    assert!(rows.len() >= 5, "no table of cycles:\n{stdout}");
    for (cycle, max_avg) in rows.iter().filter(|(c, _)| *c >= from) {
        assert!(
            *max_avg <= 1.05,
            "cycle {cycle} at max/avg {max_avg}, after the summary's cycle {from}:\n{stdout}"
        );
    }
}
