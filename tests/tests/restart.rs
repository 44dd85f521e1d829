//! Scenario: the aggregator restarts under a running fleet.
//!
//! Six agents of mixed speeds converge. The aggregator goes away (SIGTERM in one test,
//! SIGKILL as in a crash in the other) and is started again on the same ports and
//! store, with a 3 s grace period. Right away it serves the weights it stored,
//! unchanged, and changes nothing while the grace period lasts. The agents reconnect by
//! themselves (after a crash, once their idle timeout notices the dead connection), and
//! the cycles resume from the restored weights rather than from round robin.

use ballast_tests::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const SERVICE: &str = "store";
const NODES: usize = 6;
const GRACE_MS: u64 = 3000;

/// The weights the routing store file holds for the service, and their version.
fn stored(agg: &Aggregator) -> (u64, BTreeMap<String, f64>) {
    let text = std::fs::read_to_string(agg.store_path()).expect("read the store file");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("the store is JSON");
    let svc = &doc["services"][SERVICE];
    let version = svc["version"].as_u64().expect("stored version");
    let weights = svc["endpoints"]
        .as_object()
        .expect("stored endpoints")
        .iter()
        .map(|(node, e)| (node.clone(), e["weight"].as_f64().expect("stored weight")))
        .collect();
    (version, weights)
}

fn api_weights(agg: &Aggregator) -> BTreeMap<String, f64> {
    agg.weights(SERVICE)
        .weights
        .into_iter()
        .map(|(n, w)| (n, w.weight))
        .collect()
}

fn same_weights(a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>) -> Result<(), String> {
    if a.len() != b.len() || a.keys().zip(b.keys()).any(|(x, y)| x != y) {
        return Err(format!("different nodes: {a:?} vs {b:?}"));
    }
    for (node, wa) in a {
        let wb = b[node];
        if (wa - wb).abs() > 1e-6 {
            return Err(format!("{node}: {wa} vs {wb}"));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Stop {
    Graceful,
    Crash,
}

fn restart_scenario(how: Stop) {
    let pki = Pki::new();
    let mut agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(1000));
    let agents = start_fleet(&pki, &agg, SERVICE, NODES, &[0.6, 1.0, 1.5]);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }

    // Converge far enough that the weights are clearly not round robin.
    wait_for(Duration::from_secs(30), "weights that follow speed", || {
        // Not published until its first cycle: retried until it is.
        let d = agg.try_service(SERVICE)?;
        let w = api_weights(&agg);
        let (lo, hi) = w
            .values()
            .fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
        if d.stats.updates >= 8 && d.stats.spread.max_over_avg <= 1.1 && lo < 0.8 && hi > 1.2 {
            Ok(())
        } else {
            Err(format!(
                "updates {}, max/avg {:.3}, weights {w:?}",
                d.stats.updates, d.stats.spread.max_over_avg
            ))
        }
    });
    let before = api_weights(&agg);

    match how {
        Stop::Graceful => {
            let (status, killed) = agg.stop();
            assert!(!killed, "the aggregator ignored SIGTERM for 10 s");
            assert!(
                status.success(),
                "the aggregator exited with {status} on SIGTERM"
            );
        }
        Stop::Crash => agg.kill(),
    }
    let (stored_version, stored_weights) = stored(&agg);
    assert!(stored_version > 0, "nothing was ever stored");
    assert_eq!(stored_weights.len(), NODES, "{stored_weights:?}");
    for (node, w) in &before {
        // The store is written on material changes (1 % of the mean weight), so it may
        // trail the live weights a little, never more.
        let s = stored_weights[node];
        assert!(
            (s - w).abs() <= 0.05,
            "{node}: stored {s:.4}, served {w:.4} just before the stop"
        );
    }

    // Start it again on the same ports and store, with a 3 s grace period.
    agg.restart_with(agg.opts().clone().grace_ms(GRACE_MS));
    let started = Instant::now();
    let restored = agg.weights(SERVICE);
    let restored_weights: BTreeMap<String, f64> = restored
        .weights
        .iter()
        .map(|(n, w)| (n.clone(), w.weight))
        .collect();
    if let Err(e) = same_weights(&restored_weights, &stored_weights) {
        panic!("after the restart the API does not serve the stored weights: {e}");
    }
    assert_eq!(restored.version, stored_version, "weight version");

    // During the grace period: cycles run, are skipped for "grace", and change nothing.
    // Cycle numbers carry on from the stored ones, so count from there. The grace
    // period is on the aggregator's clock (milliseconds since it started, which each
    // cycle's history point carries), not on ours: however late the test got its first
    // answer, it looks at exactly the cycles that ran in grace.
    let restored_cycles = agg.service(SERVICE).stats.cycles;
    let mut saw_grace_skip = false;
    loop {
        assert!(
            started.elapsed() < Duration::from_millis(GRACE_MS) + Duration::from_secs(20),
            "the grace period never ended"
        );
        // The weights first: if the detail read after them is still in grace, so
        // were they.
        let weights = api_weights(&agg);
        let d = agg.service(SERVICE);
        let last_at = d
            .history
            .last()
            .filter(|h| h.cycle > restored_cycles)
            .map(|h| h.at);
        if last_at.is_some_and(|at| at >= GRACE_MS) {
            break;
        }
        if d.stats.cycles > restored_cycles {
            let skip = d.stats.last_skip.as_ref().map(SkipReason::label);
            assert_eq!(
                skip,
                Some("grace"),
                "cycle {} during the grace period: {:?}",
                d.stats.cycles,
                d.stats
            );
            saw_grace_skip = true;
        }
        assert_eq!(
            d.stats.updates, 0,
            "a weight update during the grace period"
        );
        assert_eq!(
            d.version, stored_version,
            "the weights changed version in grace"
        );
        if let Err(e) = same_weights(&weights, &stored_weights) {
            panic!(
                "weights changed {:?} into the grace period: {e}",
                started.elapsed()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(saw_grace_skip, "no cycle ran during the grace period");
    let d = agg.service(SERVICE);
    assert!(
        d.stats.skipped.get("grace").copied().unwrap_or(0) >= 2,
        "{:?}",
        d.stats
    );

    // The agents come back by themselves: every endpoint fresh again.
    // After a crash the agents hold a dead connection until their idle timeout (10 s).
    let back_within = match how {
        Stop::Graceful => Duration::from_secs(10),
        Stop::Crash => Duration::from_secs(25),
    };
    wait_for(back_within, "every agent reconnected and reporting", || {
        let eps = agg.endpoints(SERVICE);
        let stale: Vec<String> = eps
            .iter()
            .filter(|e| {
                e.state == EndpointState::Missing
                    || !matches!(e.report_age_ms, Some(a) if a <= 1500)
            })
            .map(|e| format!("{} {:?} {:?}", e.node, e.state, e.report_age_ms))
            .collect();
        let disconnected: Vec<&str> = agents
            .iter()
            .filter(|a| a.status().connected_to.is_none())
            .map(|a| a.node())
            .collect();
        if eps.len() == NODES && stale.is_empty() && disconnected.is_empty() {
            Ok(())
        } else {
            Err(format!("stale {stale:?}, disconnected {disconnected:?}"))
        }
    });
    eprintln!("fleet back {:?} after the restart", started.elapsed());

    // After the grace period the cycles resume, from the restored weights: the first
    // update does not see round-robin imbalance again.
    let d = wait_for(Duration::from_secs(15), "cycles to resume", || {
        let d = agg.service(SERVICE);
        if d.stats.updates >= 3 && d.weights_cycle > 0 {
            Ok(d)
        } else {
            Err(format!("{:?}", d.stats))
        }
    });
    let first = d.updates().next().copied().expect("an update");
    assert!(
        first.spread.max_over_avg <= 1.2,
        "the first update after the restart saw max/avg {:.3}: the restored weights were lost",
        first.spread.max_over_avg
    );
    let grace_cycles = d.stats.skipped.get("grace").copied().unwrap_or(0);
    assert!(
        grace_cycles * agg.opts().cycle_ms >= GRACE_MS - agg.opts().cycle_ms,
        "only {grace_cycles} cycles were held for grace"
    );
    let skipped_for_grace = agg.counter(
        "ballast_cycles_skipped_total",
        &[("service", SERVICE), ("reason", "grace")],
    );
    assert_eq!(
        skipped_for_grace, grace_cycles as f64,
        "/metrics and the API disagree on grace skips"
    );
    let ws = agg.weights(SERVICE);
    assert!(ws.cycle > 0, "weights carry the cycle they came from");
    for a in &agents {
        let s = a.status();
        assert!(
            s.weight_cycle.is_some_and(|c| c > 0) && s.weight.is_some_and(|w| w > 0.0),
            "{} has no fresh weight: {s:?}",
            a.node()
        );
    }
}

#[test]
fn weights_survive_a_graceful_restart_and_agents_come_back() {
    restart_scenario(Stop::Graceful);
}

#[test]
fn weights_survive_a_crash_and_agents_come_back() {
    restart_scenario(Stop::Crash);
}

/// The weight set's `cycle` (also sent to agents as the reply's `cycle`) says which
/// balancing cycle produced the weights; the store keeps it. After a restart the
/// restored weights must still name that cycle, and later cycles must number on from
/// it, so that consumers ordering weight sets by cycle never see it go backwards.
#[test]
fn cycle_numbers_survive_a_restart() {
    let pki = Pki::new();
    let mut agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(500));
    let agents = start_fleet(&pki, &agg, "cycles", 3, &[0.6, 1.0, 1.5]);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(Duration::from_secs(20), "a few updates", || {
        let ws = agg.try_weights("cycles")?;
        if ws.cycle >= 5 {
            Ok(())
        } else {
            Err(format!("weights from cycle {}", ws.cycle))
        }
    });
    agg.stop();
    let text = std::fs::read_to_string(agg.store_path()).expect("store");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let stored_cycle = doc["services"]["cycles"]["cycle"]
        .as_u64()
        .expect("the store keeps the cycle");
    assert!(stored_cycle >= 5, "stored cycle {stored_cycle}");

    agg.restart_with(agg.opts().clone().grace_ms(2000));
    let restored = agg.weights("cycles");
    assert_eq!(
        restored.cycle, stored_cycle,
        "after a restart the restored weights claim cycle {} (\"none yet\"), but the store \
         says they came from cycle {stored_cycle}: Service::restore \
         (aggregator/balance/src/service.rs) ignores ServiceSnapshot::cycle",
        restored.cycle
    );
    // The controller's cycles go on from the stored number; the published set keeps
    // naming the cycle it came from, which never goes back either.
    let (updated, published) = wait_for(Duration::from_secs(15), "updates after grace", || {
        let d = agg.service("cycles");
        if d.stats.updates >= 1 {
            Ok((d.weights_cycle, agg.weights("cycles").cycle))
        } else {
            Err(format!("{:?}", d.stats))
        }
    });
    assert!(
        updated > stored_cycle,
        "cycle numbers went backwards across the restart: {stored_cycle} before, {updated} after"
    );
    assert!(
        published >= stored_cycle,
        "the published weights claim cycle {published}, older than the stored {stored_cycle}"
    );
}
