//! Scenario: agents go silent.
//!
//! Seven agents report. One stops: 1/7 ≈ 14 % of the endpoints are missing, under the
//! 15 % threshold, so the cycles go on updating while the silent endpoint keeps its
//! weight exactly. A second stops: 2/7 ≈ 29 % are missing, so every update is skipped,
//! with the reason in the API and in `/metrics`, and no weight moves. The second agent
//! comes back (a new process with the same identity) and the updates resume.

use ballast_tests::*;
use std::collections::BTreeMap;
use std::time::Duration;

const SERVICE: &str = "gaps";
const NODES: usize = 7;

fn weights(agg: &Aggregator) -> BTreeMap<String, f64> {
    agg.weights(SERVICE)
        .weights
        .into_iter()
        .map(|(n, w)| (n, w.weight))
        .collect()
}

fn wait_missing(agg: &Aggregator, node: &str) {
    wait_for(
        Duration::from_secs(10),
        &format!("{node} to be missing"),
        || {
            let eps = agg.endpoints(SERVICE);
            let e = eps
                .iter()
                .find(|e| e.node == node)
                .ok_or_else(|| format!("{node} is gone: {eps:?}"))?;
            if e.state == EndpointState::Missing {
                Ok(())
            } else {
                Err(format!("{:?} {:?}", e.state, e.report_age_ms))
            }
        },
    );
}

/// Waits until the service has run `n` more cycles than `after`; returns its detail.
fn cycles_after(agg: &Aggregator, after: u64, n: u64) -> ServiceDetail {
    wait_for(
        Duration::from_secs(10),
        &format!("{n} cycles after cycle {after}"),
        || {
            let d = agg.service(SERVICE);
            if d.stats.cycles >= after + n {
                Ok(d)
            } else {
                Err(format!("at cycle {}", d.stats.cycles))
            }
        },
    )
}

#[test]
fn missing_endpoints_hold_their_weight_and_too_many_skip_the_update() {
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            // Reports go stale after three intervals, so silence shows quickly.
            config_toml: Some("[balance]\nstale_ms = 1500\n".into()),
            ..AggregatorOpts::default().grace_ms(500)
        },
    );
    let mut agents = start_fleet(&pki, &agg, SERVICE, NODES, &[0.6, 1.0, 1.5]);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(Duration::from_secs(20), "a few updates", || {
        let d = agg.try_service(SERVICE)?;
        if d.stats.updates >= 6 {
            Ok(())
        } else {
            Err(format!("{:?}", d.stats))
        }
    });

    // One of seven goes silent: under the threshold, the others keep being balanced.
    let first = agents[0].node().to_string();
    agents[0].stop(Duration::from_secs(5));
    wait_missing(&agg, &first);
    let held = weights(&agg)[&first];
    let d0 = agg.service(SERVICE);
    let d = cycles_after(&agg, d0.stats.cycles, 4);
    assert_eq!(
        d.stats.updates,
        d0.stats.updates + (d.stats.cycles - d0.stats.cycles),
        "with 1/{NODES} missing every cycle must update: {:?}",
        d.stats
    );
    assert!(d.stats.last_skip.is_none(), "{:?}", d.stats);
    assert!(
        (d.stats.missing_share - 1.0 / NODES as f64).abs() < 1e-9,
        "missing share {}",
        d.stats.missing_share
    );
    let now = weights(&agg);
    assert_eq!(
        now[&first], held,
        "the missing endpoint's weight moved from {held} to {}",
        now[&first]
    );
    let eps = agg.endpoints(SERVICE);
    let e = eps.iter().find(|e| e.node == first).expect("still known");
    assert_eq!(e.state, EndpointState::Missing);
    assert!(e.report_age_ms.is_some_and(|a| a >= 1500), "{e:?}");

    // A second goes silent: over the threshold, every update is skipped.
    let second = agents[1].node().to_string();
    let second_opts = agents[1].opts().clone();
    agents[1].stop(Duration::from_secs(5));
    wait_missing(&agg, &second);
    let skipped_metric = |agg: &Aggregator| {
        agg.counter(
            "ballast_cycles_skipped_total",
            &[("service", SERVICE), ("reason", "missing")],
        )
    };
    let frozen = weights(&agg);
    let version = agg.weights(SERVICE).version;
    let d0 = agg.service(SERVICE);
    let metric0 = skipped_metric(&agg);
    let d = cycles_after(&agg, d0.stats.cycles, 4);
    let ran = d.stats.cycles - d0.stats.cycles;
    assert_eq!(
        d.stats.updates, d0.stats.updates,
        "with 2/{NODES} missing no cycle may update: {:?}",
        d.stats
    );
    let skip = d.stats.last_skip.expect("the last cycle was skipped");
    let SkipReason::Missing { share, threshold } = skip else {
        panic!("skipped for another reason: {skip:?}");
    };
    assert!((share - 2.0 / NODES as f64).abs() < 1e-9, "{skip:?}");
    assert_eq!(threshold, 0.15, "{skip:?}");
    assert!(
        d.stats.skipped.get("missing").copied().unwrap_or(0) >= ran,
        "{:?}",
        d.stats
    );
    let metric = skipped_metric(&agg);
    assert!(
        metric >= metric0 + ran as f64,
        "ballast_cycles_skipped_total{{reason=\"missing\"}} went from {metric0} to {metric} \
         over {ran} skipped cycles"
    );
    assert_eq!(weights(&agg), frozen, "weights moved during skipped cycles");
    assert_eq!(agg.weights(SERVICE).version, version);
    let summary = agg.services();
    let last_skip = summary[0].last_skip.as_deref().unwrap_or_default();
    assert!(
        last_skip.contains("missing"),
        "/v1/services says why: {summary:?}"
    );

    // The second comes back under the same identity: below the threshold again.
    agents[1] = Agent::start(&pki, &agg, second_opts);
    agents[1].wait_weight(Duration::from_secs(15));
    let d0 = agg.service(SERVICE);
    wait_for(Duration::from_secs(10), "updates to resume", || {
        let d = agg.service(SERVICE);
        if d.stats.updates > d0.stats.updates && d.stats.last_skip.is_none() {
            Ok(())
        } else {
            Err(format!("{:?}", d.stats))
        }
    });
    let eps = agg.endpoints(SERVICE);
    let back = eps.iter().find(|e| e.node == second).expect("known");
    assert!(
        matches!(back.state, EndpointState::Serving | EndpointState::Warming),
        "{back:?}"
    );
    assert_eq!(eps.len(), NODES, "the returning node is the same endpoint");
    assert_eq!(weights(&agg)[&first], held, "the first is still held");
}
