//! Scenario: a proxyless gRPC client splits its calls by the weights the aggregator
//! publishes over xDS.
//!
//! A real aggregator serves ADS (RING_HASH clusters, its default). Three real gRPC
//! backends (Python grpcio servers that answer with their names) each have a real
//! `ballast-agent` registering the backend's address, with synthetic speeds 0.6, 1.0
//! and 1.6, so the converged weights differ about threefold. A Python grpcio client
//! with `GRPC_XDS_BOOTSTRAP` pointing at the aggregator calls `xds:///grpcsvc` and
//! counts the calls per backend:
//!
//! 1. each backend's share of 3000 calls is within 0.05 of its weight's share
//!    (`envoy / Σ envoy` from `/v1/services/grpcsvc/weights`, averaged over the round);
//! 2. after `ballast-agent drain`, the drained backend gets no call, and the other two
//!    split by their weights again;
//! 3. the client accepted every resource: no NACK was counted.
//!
//! Needs the tests' Python with `grpcio` (`tests/.venv`, made by `bash tests/run`, or
//! `BALLAST_PYTHON`); the test fails, naming the
//! package, when it is missing.

use ballast_tests::harness::grpc::{require_grpcio, weight_shares, Backends, Round, XdsClient};
use ballast_tests::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const SERVICE: &str = "grpcsvc";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.6];
/// Calls per measured round.
const CALLS: u32 = 3000;
/// How far a backend's share of the calls may be from its weight's share. Ring hash
/// with 4096 entries places each share to about 1 %, 3000 calls sample it to about
/// 1 %, and weights drift a little during a round.
const TOLERANCE: f64 = 0.05;

/// Runs a round of `calls` calls while sampling the published weights every 100 ms;
/// returns the round and the weights' shares averaged over it.
fn measured_round(
    agg: &Aggregator,
    client: &mut XdsClient,
    calls: u32,
) -> (Round, BTreeMap<String, f64>, Vec<u64>) {
    let running = AtomicBool::new(true);
    let http = agg.http_addr();
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let http_client = reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("HTTP client");
            let url = format!("http://{http}/v1/services/{SERVICE}/weights");
            let mut samples: Vec<WeightSet> = Vec::new();
            loop {
                let w: WeightSet = http_client
                    .get(&url)
                    .send()
                    .and_then(|r| r.json())
                    .unwrap_or_else(|e| panic!("GET {url}: {e}"));
                samples.push(w);
                if !running.load(Ordering::Relaxed) {
                    return samples;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let round = client.round(calls, Duration::from_secs(30));
        running.store(false, Ordering::Relaxed);
        let samples = sampler.join().expect("sampler");
        let mut avg: BTreeMap<String, f64> = BTreeMap::new();
        for w in &samples {
            for (node, share) in weight_shares(w) {
                *avg.entry(node).or_default() += share / samples.len() as f64;
            }
        }
        let versions = samples.iter().map(|w| w.version).collect();
        (round, avg, versions)
    })
}

/// Each backend's share of the calls against its weight's share; returns the table
/// for the failure message and the largest difference.
fn compare(round: &Round, expected: &BTreeMap<String, f64>) -> (String, f64) {
    let total: u32 = round.counts.values().sum();
    let mut table = String::new();
    let mut worst: f64 = 0.0;
    for (node, want) in expected {
        let got = f64::from(round.counts.get(node).copied().unwrap_or(0)) / f64::from(total);
        worst = worst.max((got - want).abs());
        table.push_str(&format!(
            "  {node}: calls {got:.3}, weights {want:.3}, diff {:+.3}\n",
            got - want
        ));
    }
    for node in round.counts.keys().filter(|n| !expected.contains_key(*n)) {
        table.push_str(&format!("  {node}: answered but is not an endpoint!\n"));
        worst = 1.0;
    }
    (table, worst)
}

#[test]
fn proxyless_grpc_splits_calls_by_the_published_weights() {
    require_grpcio();
    let dir = tempfile::Builder::new()
        .prefix("ballast-xds-")
        .tempdir()
        .expect("temporary directory");

    let pki = Pki::new();
    let agg = Aggregator::start(&pki, xds_aggregator_opts());
    let xds = agg.xds();

    // The backends, then an agent for each that registers the backend's address.
    let nodes = node_names(SERVICE, SPEEDS.len());
    let node_refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let backends = Backends::start(&node_refs, dir.path());
    let agents = start_speeds(&pki, &agg, SERVICE, &nodes, &SPEEDS, |_, opts| {
        opts.address = Some(backends.address(&opts.node));
    });

    // Let the controllers converge: the weights then sit near the speeds' ratios.
    let weights = wait_for(Duration::from_secs(40), "weights to converge", || {
        let w = agg.try_weights(SERVICE)?;
        let shares = weight_shares(&w);
        converged(&agg, SERVICE, 10, 1.08).map_err(|e| format!("{e}, shares {shares:?}"))?;
        let spread = shares.values().cloned().fold(0.0, f64::max)
            - shares.values().cloned().fold(1.0, f64::min);
        if w.weights.len() == SPEEDS.len() && spread >= 0.15 {
            Ok(w)
        } else {
            Err(format!("shares {shares:?}"))
        }
    });
    eprintln!("converged weights: {:?}", weight_shares(&weights));

    // The client, bootstrapped to the aggregator's ADS server.
    let mut client = XdsClient::start(&xds, SERVICE, "xds-test-client", Some("test"), dir.path());

    // Warm up: the first calls wait for the resources and connect the subchannels.
    let warm = client.round(300, Duration::from_secs(30));
    assert_eq!(
        warm.counts.values().sum::<u32>(),
        300,
        "warm-up calls failed: {warm:?}; aggregator log:\n{}",
        agg.log_tail(20)
    );

    // Round 1: the split follows the weights.
    let (r1, want1, versions1) = measured_round(&agg, &mut client, CALLS);
    assert_eq!(r1.sent, CALLS, "round 1 ran out of time: {r1:?}");
    assert!(r1.errors.is_empty(), "round 1 had errors: {r1:?}");
    let (table1, worst1) = compare(&r1, &want1);
    eprintln!(
        "round 1: {CALLS} calls in {:.1} s, weight versions {versions1:?}\n{table1}",
        r1.seconds
    );
    assert!(
        worst1 <= TOLERANCE,
        "round 1: the split is off the weights by {worst1:.3} > {TOLERANCE}:\n{table1}"
    );

    // Round 2: drain the heaviest backend; its share must fall to nothing.
    let drained = &nodes[SPEEDS.len() - 1];
    let pushes_before = agg.counter("ballast_xds_pushes_total", &[("resource", "endpoints")]);
    agents[SPEEDS.len() - 1].drain();
    wait_for(Duration::from_secs(10), "the drain to be published", || {
        let w = agg.weights(SERVICE);
        if w.weights.get(drained).is_some_and(|e| e.draining) {
            Ok(())
        } else {
            Err(format!("{:?}", w.weights.get(drained)))
        }
    });
    wait_for(
        Duration::from_secs(5),
        "an EDS push after the drain",
        || {
            let now = agg.counter("ballast_xds_pushes_total", &[("resource", "endpoints")]);
            if now > pushes_before {
                Ok(())
            } else {
                Err(format!("{now} pushes"))
            }
        },
    );
    // The push is on its way to the client: small rounds until it has applied it.
    wait_for(
        Duration::from_secs(10),
        "the client to stop calling the drained backend",
        || {
            let probe = client.round(100, Duration::from_secs(5));
            if !probe.counts.contains_key(drained) && probe.errors.is_empty() {
                Ok(())
            } else {
                Err(format!("{probe:?}"))
            }
        },
    );
    let (r2, want2, versions2) = measured_round(&agg, &mut client, CALLS);
    assert_eq!(r2.sent, CALLS, "round 2 ran out of time: {r2:?}");
    assert!(r2.errors.is_empty(), "round 2 had errors: {r2:?}");
    let (table2, worst2) = compare(&r2, &want2);
    eprintln!(
        "round 2 ({drained} drained): {CALLS} calls in {:.1} s, weight versions {versions2:?}\n{table2}",
        r2.seconds
    );
    assert_eq!(
        r2.counts.get(drained).copied().unwrap_or(0),
        0,
        "the drained backend still got calls:\n{table2}"
    );
    assert!(
        worst2 <= TOLERANCE,
        "round 2: the split is off the weights by {worst2:.3} > {TOLERANCE}:\n{table2}"
    );

    // gRPC accepted every resource it was sent.
    let nacks = agg.counter("ballast_xds_nacks_total", &[]);
    assert_eq!(
        nacks,
        0.0,
        "the gRPC client rejected resources; log:\n{}",
        agg.log_tail(30)
    );
    drop(client);
    drop(backends);
}
