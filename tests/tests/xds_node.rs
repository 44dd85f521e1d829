//! Scenario: a second, independent proxyless gRPC implementation, `@grpc/grpc-js-xds`
//! 1.14 on Node, against the aggregator's xDS feed: the scenarios `xds.rs` and
//! `locality.rs` run with Python `grpcio`, and what differs between the two clients.
//!
//! Every aggregator serves ADS over TLS (the default). grpc-js-xds 1.14 takes no
//! `tls` channel credentials from its bootstrap, so its ADS stream goes through the
//! client script's TLS sidecar (`harness::node`), which checks the server against the
//! harness CA. The backends are the Python grpcio servers of the other xDS tests,
//! each registered by a real `ballast-agent`.
//!
//! 1. [`weights_and_drain`] (as `xds.rs`): RING_HASH, three backends at speeds 0.6,
//!    1.0 and 1.6; each backend's share of 3000 calls is within 0.05 of its weight's
//!    share; after `ballast-agent drain` the drained backend gets none and the other
//!    two split by their weights; no NACK.
//! 2. [`locality_splits_and_live_edit`] (as `locality.rs`): RING_HASH, two backends in
//!    `zone_1`, one in `zone_2`, the seed's split; the zone_1 client stays in zone_1,
//!    the zone_2 client splits 50/50, a zone_3 client (no split) follows the weights
//!    across the fleet; the file is rewritten and the splits follow (zone_1 → zone_2
//!    only, zone_2 → 75/25); no NACK, no restart.
//! 3. [`round_robin_weighs_localities_not_endpoints`]: ROUND_ROBIN, the zone_1
//!    backends at speeds 0.6 and 1.6 (weights far apart): grpc-js-xds picks a locality
//!    by its weight (`xds_wrr_locality` → `weighted_target`) and then round-robins
//!    inside it, ignoring the endpoint weights: the zone_2 client's 75/25 split holds,
//!    and both zone_1 backends get the same share; the zone_3 client's default
//!    assignment (locality weights 1) gives each zone half. A `grpcio` client in
//!    zone_2 does the same. The zone_2 clients get the Cluster with Envoy's
//!    `locality_weighted_lb_config`, which neither gRPC rejects.
//! 4. [`nacks_least_request_and_rejects_tls_bootstrap`]: with `xds_lb_policy =
//!    "least_request"` grpc-js-xds NACKs the Cluster (it supports only RING_HASH and
//!    ROUND_ROBIN): the aggregator counts it in `ballast_xds_nacks_total{resource=
//!    "cluster"}` and logs the client's reason, and fail-fast calls end `UNAVAILABLE`
//!    naming it; a `grpcio` client NACKs the same Cluster. A bootstrap with only
//!    `tls` credentials (what `grpcio` takes) is rejected by grpc-js-xds before it
//!    dials: every call fails, no stream opens.
//!
//! Needs `node` and the modules of `tests/xds-node` (`npm ci` there; `tests/run` does
//! it), and the tests' Python with `grpcio` (`tests/.venv`); the tests fail, naming
//! the command, otherwise.

use ballast_tests::harness::grpc::{require_grpcio, weight_shares, Backends, XdsClient};
use ballast_tests::harness::node::{require_node, Creds, NodeRound, NodeXdsClient};
use ballast_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The per-call budget of a round.
const ROUND_BUDGET: Duration = Duration::from_secs(30);

fn require_all() {
    require_node();
    require_grpcio();
}

fn workdir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("temporary directory")
}

/// Warms a client up: the first calls wait for the resources and connect the
/// subchannels. All of them must be answered.
fn warm_up(client: &mut NodeXdsClient, who: &str, calls: u32, agg: &Aggregator) {
    let warm = client.round(calls, ROUND_BUDGET);
    assert_eq!(
        warm.answered(),
        calls,
        "{who}: warm-up calls failed: {warm:?}; stderr:\n{}\naggregator log:\n{}",
        client.stderr_tail(),
        agg.log_tail(20)
    );
}

/// A full round that must succeed whole, only from `known` backends.
fn full_round(
    client: &mut NodeXdsClient,
    who: &str,
    calls: u32,
    known: &[&str],
    agg: &Aggregator,
) -> NodeRound {
    let r = client.round(calls, ROUND_BUDGET);
    assert_eq!(
        r.sent,
        calls,
        "{who}: round ran out of time: {r:?}; stderr:\n{}",
        client.stderr_tail()
    );
    assert!(
        r.errors.is_empty(),
        "{who}: calls failed: {r:?}; aggregator log:\n{}",
        agg.log_tail(20)
    );
    let unknown: Vec<&String> = r
        .counts
        .keys()
        .filter(|b| !known.contains(&b.as_str()))
        .collect();
    assert!(unknown.is_empty(), "{who}: answers from {unknown:?}");
    r
}

/// `backend`'s share of a round's answered calls.
fn share(round: &NodeRound, backend: &str) -> f64 {
    f64::from(round.counts.get(backend).copied().unwrap_or(0)) / f64::from(round.answered().max(1))
}

fn assert_no_nacks(agg: &Aggregator) {
    let nacks = agg.counter("ballast_xds_nacks_total", &[]);
    assert_eq!(
        nacks,
        0.0,
        "grpc-js-xds rejected resources; log:\n{}",
        agg.log_tail(30)
    );
}

// ---------------------------------------------------------------------------------
// 1. Weights and drain (RING_HASH), as xds.rs with grpcio.

const WEIGHTED: &str = "nodesvc";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.6];
/// Calls per measured round.
const CALLS: u32 = 3000;
/// How far a backend's share of the calls may be from its weight's share: the same
/// bound as `xds.rs` (ring of 4096 entries ≈ 1 %, 3000 calls ≈ 1 %, weight drift).
const TOLERANCE: f64 = 0.05;

/// A round of `calls` calls while the published weights are sampled every 100 ms:
/// the round, and the weights' shares averaged over it.
fn measured_round(
    agg: &Aggregator,
    client: &mut NodeXdsClient,
    known: &[&str],
    calls: u32,
) -> (NodeRound, BTreeMap<String, f64>) {
    let running = AtomicBool::new(true);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut samples: Vec<WeightSet> = Vec::new();
            // Bounded: the round ends within its budget, and so does this loop.
            for _ in 0..600 {
                samples.push(agg.weights(WEIGHTED));
                if !running.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        });
        let round = full_round(client, "client", calls, known, agg);
        running.store(false, Ordering::Relaxed);
        let samples = sampler.join().expect("sampler");
        let mut avg: BTreeMap<String, f64> = BTreeMap::new();
        for w in &samples {
            for (node, s) in weight_shares(w) {
                *avg.entry(node).or_default() += s / samples.len() as f64;
            }
        }
        (round, avg)
    })
}

/// Each backend's share of the calls against its weight's share: the table for the
/// failure message and the largest difference.
fn compare(round: &NodeRound, expected: &BTreeMap<String, f64>) -> (String, f64) {
    let mut table = String::new();
    let mut worst: f64 = 0.0;
    for (node, want) in expected {
        let got = share(round, node);
        worst = worst.max((got - want).abs());
        table.push_str(&format!(
            "  {node}: calls {got:.3}, weights {want:.3}, diff {:+.3}\n",
            got - want
        ));
    }
    (table, worst)
}

#[test]
fn weights_and_drain() {
    require_all();
    let dir = workdir("ballast-xds-node-");
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, xds_aggregator_opts());

    let nodes = node_names(WEIGHTED, SPEEDS.len());
    let known: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let backends = Backends::start(&known, dir.path());
    let agents = start_speeds(&pki, &agg, WEIGHTED, &nodes, &SPEEDS, |_, opts| {
        opts.address = Some(backends.address(&opts.node));
    });
    let weights = wait_for(Duration::from_secs(40), "weights to converge", || {
        let w = agg.try_weights(WEIGHTED)?;
        let shares = weight_shares(&w);
        converged(&agg, WEIGHTED, 10, 1.08).map_err(|e| format!("{e}, shares {shares:?}"))?;
        let spread = shares.values().cloned().fold(0.0, f64::max)
            - shares.values().cloned().fold(1.0, f64::min);
        if w.weights.len() == SPEEDS.len() && spread >= 0.15 {
            Ok(w)
        } else {
            Err(format!("shares {shares:?}"))
        }
    });
    eprintln!("converged weights: {:?}", weight_shares(&weights));

    let mut client = NodeXdsClient::start(
        &agg.xds(),
        WEIGHTED,
        "node-xds-client",
        Some("test"),
        Creds::TlsSidecar,
        dir.path(),
    );
    warm_up(&mut client, "client", 300, &agg);

    // Round 1: the split follows the weights.
    let (r1, want1) = measured_round(&agg, &mut client, &known, CALLS);
    let (table1, worst1) = compare(&r1, &want1);
    eprintln!("round 1: {CALLS} calls in {:.1} s\n{table1}", r1.seconds);
    assert!(
        worst1 <= TOLERANCE,
        "round 1: the split is off the weights by {worst1:.3} > {TOLERANCE}:\n{table1}"
    );

    // Round 2: drain the heaviest backend; its share must fall to nothing.
    let drained = &nodes[SPEEDS.len() - 1];
    agents[SPEEDS.len() - 1].drain();
    wait_for(Duration::from_secs(10), "the drain to be published", || {
        let w = agg.weights(WEIGHTED);
        if w.weights.get(drained).is_some_and(|e| e.draining) {
            Ok(())
        } else {
            Err(format!("{:?}", w.weights.get(drained)))
        }
    });
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
    let (r2, want2) = measured_round(&agg, &mut client, &known, CALLS);
    let (table2, worst2) = compare(&r2, &want2);
    eprintln!(
        "round 2 ({drained} drained): {CALLS} calls in {:.1} s\n{table2}",
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
    assert_no_nacks(&agg);
    drop(client);
    drop(agents);
    drop(backends);
}

// ---------------------------------------------------------------------------------
// 2. Locality splits and a live edit (RING_HASH), as locality.rs with grpcio.

const GEO: &str = "nodegeo";
/// Backend → zone. Two in zone_1, one in zone_2.
const GEO_BACKENDS: [(&str, &str); 3] = [
    ("ngeo-1a", "zone_1"),
    ("ngeo-1b", "zone_1"),
    ("ngeo-2a", "zone_2"),
];
/// Calls per measured round and client.
const GEO_CALLS: u32 = 2000;
/// As `locality.rs`: over three standard deviations of sampling and ring together.
const GEO_TOLERANCE: f64 = 0.06;

const SEED: &str = "\
[locality.zone_1]
zone_1 = 100

[locality.zone_2]
zone_2 = 50
zone_1 = 50
";

const FAILOVER: &str = "\
[locality.zone_1]
zone_2 = 100

[locality.zone_2]
zone_2 = 25
zone_1 = 75
";

/// Replaces `service`'s file as a deploy does: a dotfile renamed over it.
fn write_service_file(dir: &Path, service: &str, text: &str) {
    let tmp = dir.join(format!(".{service}.toml.tmp"));
    std::fs::write(&tmp, text).expect("write service file");
    std::fs::rename(&tmp, dir.join(format!("{service}.toml"))).expect("rename service file");
}

/// Waits until `GET /v1/config` shows `service` with a split that has `zones`
/// client zones, `check` holding for it.
fn wait_split(agg: &Aggregator, service: &str, check: impl Fn(&serde_json::Value) -> bool) {
    wait_for(
        Duration::from_secs(10),
        "the locality split in force",
        || {
            let view: serde_json::Value = agg.get_json("/v1/config");
            let split = view["services"]
                .as_array()
                .and_then(|s| s.iter().find(|s| s["name"] == service))
                .map(|s| s["locality"].clone())
                .unwrap_or(serde_json::Value::Null);
            if check(&split) {
                Ok(())
            } else {
                Err(format!("in force: {split}"))
            }
        },
    );
}

/// Each zone's share of a round's calls.
fn zone_share(round: &NodeRound, backends: &[(&str, &str)], zone: &str) -> f64 {
    backends
        .iter()
        .filter(|(_, z)| *z == zone)
        .map(|(b, _)| share(round, b))
        .sum()
}

/// zone_1's share of the published weight (Envoy scale, over serving endpoints).
fn zone_1_weight_share(agg: &Aggregator, service: &str) -> f64 {
    let w = agg.weights(service);
    let serving = || w.weights.values().filter(|e| !e.draining);
    let total: f64 = serving().map(|e| f64::from(e.envoy)).sum();
    let zone_1: f64 = serving()
        .filter(|e| e.zone == "zone_1")
        .map(|e| f64::from(e.envoy))
        .sum();
    zone_1 / total.max(1.0)
}

fn assert_near(who: &str, what: &str, got: f64, want: f64, tolerance: f64, round: &NodeRound) {
    assert!(
        (got - want).abs() <= tolerance,
        "{who}: {what} got {got:.3} of the calls, expected {want:.3} (± {tolerance}); \
         calls per backend {:?}",
        round.counts
    );
}

/// An aggregator (300 ms cycles, `policy`) watching `config_dir`, and one agent per
/// backend in its zone at `speeds`; returns once all are serving.
fn zoned_fleet(
    pki: &Pki,
    config_dir: &Path,
    policy: &str,
    service: &str,
    zoned: &[(&str, &str)],
    speeds: &[f64],
    backends: &Backends,
) -> (Aggregator, Vec<Agent>) {
    let agg = Aggregator::start(
        pki,
        AggregatorOpts {
            xds: true,
            config_toml: Some(format!(
                "xds_lb_policy = \"{policy}\"\n[service_config]\nrescan_ms = 200\n"
            )),
            ..AggregatorOpts::default()
                .cycle_ms(300)
                .report_interval_ms(300)
                .grace_ms(1000)
                .config_dir(config_dir)
        },
    );
    let nodes: Vec<String> = zoned.iter().map(|(n, _)| n.to_string()).collect();
    let agents = start_speeds(pki, &agg, service, &nodes, speeds, |i, opts| {
        opts.address = Some(backends.address(&opts.node));
        opts.zone = Some(zoned[i].1.to_string());
    });
    wait_for(Duration::from_secs(15), "all endpoints serving", || {
        let serving = agg
            .endpoints(service)
            .iter()
            .filter(|e| e.state == EndpointState::Serving)
            .count();
        if serving == zoned.len() {
            Ok(())
        } else {
            Err(format!("{serving} serving"))
        }
    });
    (agg, agents)
}

#[test]
fn locality_splits_and_live_edit() {
    require_all();
    let work = workdir("ballast-xds-node-geo-");
    let config_dir = work.path().join("services.d");
    std::fs::create_dir(&config_dir).expect("config directory");
    write_service_file(&config_dir, GEO, SEED);

    let pki = Pki::new();
    let names: Vec<&str> = GEO_BACKENDS.iter().map(|(n, _)| *n).collect();
    let backends = Backends::start(&names, work.path());
    let (agg, agents) = zoned_fleet(
        &pki,
        &config_dir,
        "ring_hash",
        GEO,
        &GEO_BACKENDS,
        &[1.0, 1.0, 1.0],
        &backends,
    );
    let pid = agg.pid();
    wait_split(&agg, GEO, |s| s["zone_2"]["zone_1"] == 50);

    let xds = agg.xds();
    let mut clients: Vec<(&str, NodeXdsClient)> = ["zone_1", "zone_2", "zone_3"]
        .into_iter()
        .map(|zone| {
            let c = NodeXdsClient::start(
                &xds,
                GEO,
                &format!("node-client-{zone}"),
                Some(zone),
                Creds::TlsSidecar,
                work.path(),
            );
            (zone, c)
        })
        .collect();
    for (zone, c) in &mut clients {
        warm_up(c, zone, 200, &agg);
    }

    // Round 1: the seed's split.
    let r1 = full_round(&mut clients[0].1, "zone_1", GEO_CALLS, &names, &agg);
    let r2 = full_round(&mut clients[1].1, "zone_2", GEO_CALLS, &names, &agg);
    let before = zone_1_weight_share(&agg, GEO);
    let r3 = full_round(&mut clients[2].1, "zone_3", GEO_CALLS, &names, &agg);
    let default_share = (before + zone_1_weight_share(&agg, GEO)) / 2.0;
    eprintln!(
        "seed split: zone_1 client {:?} ({:.1} s); zone_2 client {:?} ({:.1} s); \
         zone_3 client {:?} ({:.1} s), zone_1's weight share {default_share:.3}",
        r1.counts, r1.seconds, r2.counts, r2.seconds, r3.counts, r3.seconds
    );
    assert_eq!(
        r1.counts.get("ngeo-2a"),
        None,
        "the zone_1 client must not call zone_2: {:?}",
        r1.counts
    );
    let z = |r: &NodeRound| zone_share(r, &GEO_BACKENDS, "zone_1");
    assert_near("zone_2 client", "zone_1", z(&r2), 0.5, GEO_TOLERANCE, &r2);
    assert!(
        default_share > 0.6,
        "zone_1's two backends should hold about two thirds of the weight, not {default_share:.3}"
    );
    assert_near(
        "zone_3 client",
        "zone_1",
        z(&r3),
        default_share,
        GEO_TOLERANCE,
        &r3,
    );

    // Round 2: the file is rewritten; nothing restarts.
    write_service_file(&config_dir, GEO, FAILOVER);
    wait_split(&agg, GEO, |s| s["zone_2"]["zone_1"] == 75);
    let c1 = &mut clients[0].1;
    wait_for(
        Duration::from_secs(10),
        "the zone_1 client to fail over",
        || {
            let probe = c1.round(50, Duration::from_secs(5));
            if probe.counts.keys().all(|b| b == "ngeo-2a") && probe.errors.is_empty() {
                Ok(())
            } else {
                Err(format!("{probe:?}"))
            }
        },
    );
    let c2 = &mut clients[1].1;
    wait_for(
        Duration::from_secs(10),
        "the zone_2 client to take the new split",
        || {
            let probe = c2.round(200, Duration::from_secs(5));
            let s = zone_share(&probe, &GEO_BACKENDS, "zone_1");
            if s > 0.65 && probe.errors.is_empty() {
                Ok(())
            } else {
                Err(format!("zone_1 share {s:.3}: {probe:?}"))
            }
        },
    );
    let r1 = full_round(&mut clients[0].1, "zone_1", GEO_CALLS, &names, &agg);
    let r2 = full_round(&mut clients[1].1, "zone_2", GEO_CALLS, &names, &agg);
    eprintln!(
        "after the edit: zone_1 client {:?} ({:.1} s); zone_2 client {:?} ({:.1} s)",
        r1.counts, r1.seconds, r2.counts, r2.seconds
    );
    assert_eq!(
        r1.counts.keys().collect::<Vec<_>>(),
        ["ngeo-2a"],
        "the zone_1 client must now call zone_2 only"
    );
    assert_near("zone_2 client", "zone_1", z(&r2), 0.75, GEO_TOLERANCE, &r2);

    let mut agg = agg;
    assert!(agg.is_running(), "the aggregator stopped");
    assert_eq!(agg.pid(), pid, "the aggregator was restarted");
    assert_no_nacks(&agg);
    drop(clients);
    drop(agents);
    drop(backends);
}

// ---------------------------------------------------------------------------------
// 3. ROUND_ROBIN: locality weights yes, endpoint weights no.

const RR: &str = "noderr";
/// zone_1's backends at speeds 0.6 and 1.6, so their weights are far apart.
const RR_BACKENDS: [(&str, &str); 3] = [
    ("nrr-1a", "zone_1"),
    ("nrr-1b", "zone_1"),
    ("nrr-2a", "zone_2"),
];
const RR_SPEEDS: [f64; 3] = [0.6, 1.6, 1.0];
const RR_SPLIT: &str = "\
[locality.zone_2]
zone_2 = 25
zone_1 = 75
";
const RR_CALLS: u32 = 2000;

#[test]
fn round_robin_weighs_localities_not_endpoints() {
    require_all();
    let work = workdir("ballast-xds-node-rr-");
    let config_dir = work.path().join("services.d");
    std::fs::create_dir(&config_dir).expect("config directory");
    write_service_file(&config_dir, RR, RR_SPLIT);

    let pki = Pki::new();
    let names: Vec<&str> = RR_BACKENDS.iter().map(|(n, _)| *n).collect();
    let backends = Backends::start(&names, work.path());
    let (agg, agents) = zoned_fleet(
        &pki,
        &config_dir,
        "round_robin",
        RR,
        &RR_BACKENDS,
        &RR_SPEEDS,
        &backends,
    );
    wait_split(&agg, RR, |s| s["zone_2"]["zone_1"] == 75);
    // The zone_1 backends' weights must be far apart for "ignores them" to mean
    // something: the slow one's at most 0.7 of the fast one's.
    let ratio = wait_for(
        Duration::from_secs(40),
        "zone_1's weights to move apart",
        || {
            let w = agg.try_weights(RR)?;
            let get = |n: &str| w.weights.get(n).map_or(0.0, |e| f64::from(e.envoy));
            let ratio = get("nrr-1a") / get("nrr-1b").max(1.0);
            if ratio <= 0.7 {
                Ok(ratio)
            } else {
                Err(format!("weights {:?}", w.weights))
            }
        },
    );

    let xds = agg.xds();
    let mut c2 = NodeXdsClient::start(
        &xds,
        RR,
        "node-rr-zone_2",
        Some("zone_2"),
        Creds::TlsSidecar,
        work.path(),
    );
    let mut c3 = NodeXdsClient::start(
        &xds,
        RR,
        "node-rr-zone_3",
        Some("zone_3"),
        Creds::TlsSidecar,
        work.path(),
    );
    // grpcio in zone_2 too: the same split, and the same Cluster (locality
    // weighted for Envoy, which gRPC ignores).
    let mut py = XdsClient::start(&xds, RR, "py-rr-zone_2", Some("zone_2"), work.path());
    warm_up(&mut c2, "zone_2", 200, &agg);
    warm_up(&mut c3, "zone_3", 200, &agg);
    let warm = py.round(200, ROUND_BUDGET);
    assert_eq!(
        warm.counts.values().sum::<u32>(),
        200,
        "grpcio warm-up: {warm:?}; stderr:\n{}",
        py.stderr_tail()
    );
    let r2 = full_round(&mut c2, "zone_2", RR_CALLS, &names, &agg);
    let r3 = full_round(&mut c3, "zone_3", RR_CALLS, &names, &agg);
    let rp = py.round(RR_CALLS, ROUND_BUDGET);
    assert!(
        rp.sent == RR_CALLS && rp.errors.is_empty(),
        "grpcio round: {rp:?}"
    );
    let rp = NodeRound {
        sent: rp.sent,
        counts: rp.counts,
        errors: rp.errors,
        details: BTreeMap::new(),
        seconds: rp.seconds,
    };
    eprintln!(
        "round_robin (nrr-1a/nrr-1b weight ratio {ratio:.2}): zone_2 client {:?}; \
         zone_3 client {:?}; grpcio zone_2 client {:?}",
        r2.counts, r3.counts, rp.counts
    );
    // Locality weights: 75/25 for the split, 1/1 for the default.
    let z = |r: &NodeRound| zone_share(r, &RR_BACKENDS, "zone_1");
    assert_near("zone_2 client", "zone_1", z(&r2), 0.75, GEO_TOLERANCE, &r2);
    assert_near("zone_3 client", "zone_1", z(&r3), 0.5, GEO_TOLERANCE, &r3);
    assert_near(
        "grpcio zone_2 client",
        "zone_1",
        z(&rp),
        0.75,
        GEO_TOLERANCE,
        &rp,
    );
    // Endpoint weights ignored: round robin inside zone_1 alternates, so the two get
    // the same share to within a call or two, whatever their weights.
    for (who, r) in [
        ("zone_2 client", &r2),
        ("zone_3 client", &r3),
        ("grpcio zone_2 client", &rp),
    ] {
        let (a, b) = (share(r, "nrr-1a"), share(r, "nrr-1b"));
        assert!(
            (a - b).abs() <= 0.01,
            "{who}: round robin should give nrr-1a and nrr-1b the same share, got \
             {a:.3} and {b:.3} (their weights are {ratio:.2} to 1)"
        );
    }
    assert_no_nacks(&agg);
    drop(py);
    drop(c2);
    drop(c3);
    drop(agents);
    drop(backends);
}

// ---------------------------------------------------------------------------------
// 4. NACK: a Cluster grpc-js-xds cannot use; and the bootstrap it cannot read.

#[test]
fn nacks_least_request_and_rejects_tls_bootstrap() {
    require_all();
    let dir = workdir("ballast-xds-node-nack-");
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some("xds_lb_policy = \"least_request\"\n".to_string()),
            ..xds_aggregator_opts()
        },
    );
    const SERVICE: &str = "nodenack";
    let nodes = node_names(SERVICE, 1);
    let known: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let backends = Backends::start(&known, dir.path());
    let _agents = start_speeds(&pki, &agg, SERVICE, &nodes, &[1.0], |_, opts| {
        opts.address = Some(backends.address(&opts.node));
    });
    let xds = agg.xds();

    // The bootstrap grpcio takes (tls credentials with the CA), as written: grpc-js-xds
    // rejects it and never dials.
    let mut plain = NodeXdsClient::start(
        &xds,
        SERVICE,
        "node-tls-bootstrap",
        None,
        Creds::AsWritten,
        dir.path(),
    );
    let r = plain.round_fail_fast(20, Duration::from_secs(5));
    eprintln!("tls bootstrap as written: {r:?}");
    assert_eq!(r.answered(), 0, "a tls-only bootstrap was accepted: {r:?}");
    assert_eq!(
        r.errors.get("UNAVAILABLE").copied(),
        Some(r.sent),
        "every call should fail UNAVAILABLE: {r:?}"
    );
    assert_eq!(
        agg.counter("ballast_xds_streams", &[]),
        0.0,
        "grpc-js-xds opened a stream with a bootstrap it cannot read"
    );
    drop(plain);

    // LEAST_REQUEST: NACKed, counted, logged with the client's reason.
    let mut client = NodeXdsClient::start(
        &xds,
        SERVICE,
        "node-least-request",
        None,
        Creds::TlsSidecar,
        dir.path(),
    );
    let nacked = wait_for(Duration::from_secs(15), "a NACK of the Cluster", || {
        // A call makes the channel resolve, which opens the ADS stream.
        client.round_fail_fast(1, Duration::from_secs(2));
        let n = agg.counter("ballast_xds_nacks_total", &[("resource", "cluster")]);
        if n >= 1.0 {
            Ok(n)
        } else {
            Err(format!(
                "{n} NACKs; client stderr:\n{}",
                client.stderr_tail()
            ))
        }
    });
    let log = agg.log();
    let reason = log
        .lines()
        .find(|l| l.contains("LEAST_REQUEST"))
        .unwrap_or_else(|| panic!("no NACK reason naming LEAST_REQUEST in the log:\n{log}"));
    eprintln!("NACKs of the Cluster: {nacked}; aggregator log: {reason}");
    let r = client.round_fail_fast(20, Duration::from_secs(5));
    eprintln!("calls under the NACKed Cluster: {r:?}");
    assert_eq!(
        r.answered(),
        0,
        "calls went through a NACKed Cluster: {r:?}"
    );
    let detail = r.details.get("UNAVAILABLE").cloned().unwrap_or_default();
    assert!(
        detail.contains("LEAST_REQUEST"),
        "the calls should fail UNAVAILABLE naming the rejected policy: {r:?}"
    );
    // The rejected contents are not sent again: the count does not grow while nothing
    // changes (single endpoint, steady weight).
    std::thread::sleep(Duration::from_secs(2));
    let later = agg.counter("ballast_xds_nacks_total", &[("resource", "cluster")]);
    assert_eq!(
        later,
        nacked,
        "the NACKed Cluster was resent; log:\n{}",
        agg.log_tail(20)
    );
    drop(client);

    // grpcio NACKs the same Cluster: neither client balances by LEAST_REQUEST.
    let before = agg.counter("ballast_xds_nacks_total", &[("resource", "cluster")]);
    let mut py = XdsClient::start(&xds, SERVICE, "py-least-request", None, dir.path());
    wait_for(
        Duration::from_secs(15),
        "grpcio's NACK of the Cluster",
        || {
            // Each probe is one call, which waits for the channel for at most a second.
            let probe = py.round(1, Duration::from_secs(1));
            let n = agg.counter("ballast_xds_nacks_total", &[("resource", "cluster")]);
            if n > before && probe.counts.is_empty() {
                Ok(())
            } else {
                Err(format!("{n} NACKs, {probe:?}"))
            }
        },
    );
    let log = agg.log();
    let reason = log
        .lines()
        .find(|l| l.contains("NACK") && l.contains("node=py-least-request"))
        .unwrap_or_else(|| panic!("no NACK of py-least-request in the log:\n{log}"));
    eprintln!("grpcio: {reason}");
    drop(py);
    drop(backends);
}
