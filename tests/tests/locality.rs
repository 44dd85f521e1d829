//! Scenario: proxyless gRPC clients in two zones split their calls across zones as the
//! service's locality config says, and follow a live edit of the config file.
//!
//! A real aggregator serves ADS (RING_HASH clusters, its default) and watches a config
//! directory holding `geosvc.toml` with the seed's split:
//!
//! ```toml
//! [locality.zone_1]
//! zone_1 = 100
//! [locality.zone_2]
//! zone_2 = 50
//! zone_1 = 50
//! ```
//!
//! Three real gRPC backends (Python grpcio servers that answer with their names), two
//! in `zone_1` and one in `zone_2`, each registered by a real `ballast-agent --zone`.
//! The zones have unequal numbers of backends on purpose: gRPC's RING_HASH weighs each
//! endpoint by locality weight × endpoint weight, so a 50/50 split only holds if the
//! aggregator evens out the zones' endpoint weights (without that, zone_1 would get
//! two thirds). Two Python grpcio clients call `xds:///geosvc`, one bootstrapped with
//! `node.locality.zone = zone_1`, the other with `zone_2`:
//!
//! 1. the zone_1 client's calls all go to zone_1; the zone_2 client's split 50/50
//!    between the zones (within [`TOLERANCE`]). A third client, in `zone_3`, which the
//!    config does not name, gets the default assignment: every zone at locality
//!    weight 1, so under RING_HASH zone_1's share is its endpoints' share of the
//!    weight, about two thirds. That is what the zone_2 client would see if its
//!    zones' endpoint weights were not evened out;
//! 2. the file is rewritten (zone_1 fails over to zone_2; zone_2 sends 75 % to
//!    zone_1), nothing is restarted, and the splits follow: the zone_1 client's calls
//!    all go to zone_2, the zone_2 client's 75/25;
//! 3. no client rejected a resource (no NACK), and the aggregator is the same process.
//!
//! Needs the tests' Python with `grpcio` (`tests/.venv`, made by `bash tests/run`, or
//! `BALLAST_PYTHON`); the test fails, naming the
//! package, when it is missing.

use ballast_tests::harness::grpc::{require_grpcio, Backends, Round, XdsClient};
use ballast_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const SERVICE: &str = "geosvc";
/// Backend → zone. Two in zone_1, one in zone_2.
const BACKENDS: [(&str, &str); 3] = [
    ("geo-1a", "zone_1"),
    ("geo-1b", "zone_1"),
    ("geo-2a", "zone_2"),
];
/// Calls per measured round and client.
const CALLS: u32 = 2000;
/// How far a zone's share of a round's calls may be from its configured share. Over
/// 2000 calls a share of 0.5 samples to a standard deviation of 0.011; the ring
/// (4096 entries) places a zone's share to about 0.01 more. 0.06 is over three
/// deviations of both together, and well under the 0.17 by which an uncorrected
/// RING_HASH (two thirds to the zone with two backends) would miss.
const TOLERANCE: f64 = 0.06;
/// The per-call budget of a round.
const ROUND_BUDGET: Duration = Duration::from_secs(30);

const SEED: &str = "\
# Robinhood's example: zone_1 stays home, zone_2 splits evenly.
[locality.zone_1]
zone_1 = 100

[locality.zone_2]
zone_2 = 50
zone_1 = 50
";

const FAILOVER: &str = "\
# zone_1 fails over to zone_2; zone_2 sends most of its calls to zone_1.
[locality.zone_1]
zone_2 = 100

[locality.zone_2]
zone_2 = 25
zone_1 = 75
";

/// Replaces the service's file the way an editor or a deploy does: a dotfile (which
/// the aggregator ignores) renamed over it, so it is never read half-written.
fn write_service_file(dir: &Path, text: &str) {
    let tmp = dir.join(format!(".{SERVICE}.toml.tmp"));
    std::fs::write(&tmp, text).expect("write service file");
    std::fs::rename(&tmp, dir.join(format!("{SERVICE}.toml"))).expect("rename service file");
}

/// The locality split in force for the service, as `GET /v1/config` reports it.
fn split_in_force(agg: &Aggregator) -> serde_json::Value {
    let view: serde_json::Value = agg.get_json("/v1/config");
    view["services"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == SERVICE))
        .map(|s| s["locality"].clone())
        .unwrap_or(serde_json::Value::Null)
}

/// Waits until the split in force is `want` (zone → destination → share).
fn wait_split(agg: &Aggregator, want: &[(&str, &[(&str, u32)])]) {
    let want: serde_json::Value = want
        .iter()
        .map(|(client, dests)| {
            let d: serde_json::Map<String, serde_json::Value> = dests
                .iter()
                .map(|(z, s)| (z.to_string(), (*s).into()))
                .collect();
            (client.to_string(), serde_json::Value::Object(d))
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    wait_for(
        Duration::from_secs(10),
        "the locality split in force",
        || {
            let got = split_in_force(agg);
            if got == want {
                Ok(())
            } else {
                Err(format!("in force: {got}, want {want}"))
            }
        },
    );
}

/// Each zone's share of a round's answered calls.
fn zone_shares(round: &Round) -> BTreeMap<&'static str, f64> {
    let total: u32 = round.counts.values().sum();
    let mut shares: BTreeMap<&'static str, f64> = BTreeMap::new();
    for (backend, zone) in BACKENDS {
        let n = round.counts.get(backend).copied().unwrap_or(0);
        *shares.entry(zone).or_default() += f64::from(n) / f64::from(total.max(1));
    }
    shares
}

/// zone_1's share of the published weight (Envoy scale, over serving endpoints).
fn zone_1_weight_share(agg: &Aggregator) -> f64 {
    let w = agg.weights(SERVICE);
    let serving = || w.weights.values().filter(|e| !e.draining);
    let total: f64 = serving().map(|e| f64::from(e.envoy)).sum();
    let zone_1: f64 = serving()
        .filter(|e| e.zone == "zone_1")
        .map(|e| f64::from(e.envoy))
        .sum();
    zone_1 / total.max(1.0)
}

/// A full round that must succeed whole.
fn full_round(client: &mut XdsClient, who: &str, agg: &Aggregator) -> Round {
    let r = client.round(CALLS, ROUND_BUDGET);
    assert_eq!(
        r.sent,
        CALLS,
        "{who}: round ran out of time: {r:?}; client stderr:\n{}",
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
        .filter(|b| !BACKENDS.iter().any(|(n, _)| n == b))
        .collect();
    assert!(unknown.is_empty(), "{who}: answers from {unknown:?}");
    r
}

/// Asserts that `zone`'s share of `round` is `want` within the tolerance.
fn assert_share(who: &str, round: &Round, zone: &str, want: f64) {
    let got = zone_shares(round).get(zone).copied().unwrap_or(0.0);
    assert!(
        (got - want).abs() <= TOLERANCE,
        "{who}: {zone} got {got:.3} of the calls, the config says {want} (± {TOLERANCE}); \
         calls per backend {:?}",
        round.counts
    );
}

#[test]
fn grpc_clients_split_calls_across_zones_by_the_locality_config_and_follow_a_live_edit() {
    require_grpcio();
    let work = tempfile::Builder::new()
        .prefix("ballast-locality-")
        .tempdir()
        .expect("temporary directory");
    let config_dir = work.path().join("services.d");
    std::fs::create_dir(&config_dir).expect("config directory");
    write_service_file(&config_dir, SEED);

    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            xds: true,
            config_toml: Some("[service_config]\nrescan_ms = 200\n".to_string()),
            ..AggregatorOpts::default()
                .cycle_ms(300)
                .report_interval_ms(300)
                .grace_ms(1000)
                .config_dir(&config_dir)
        },
    );
    let pid = agg.pid();
    wait_split(
        &agg,
        &[
            ("zone_1", &[("zone_1", 100)]),
            ("zone_2", &[("zone_1", 50), ("zone_2", 50)]),
        ],
    );

    // The backends, and an agent in the backend's zone registering its address.
    let names: Vec<&str> = BACKENDS.iter().map(|(n, _)| *n).collect();
    let backends = Backends::start(&names, work.path());
    pki.issue_nodes(&names);
    let agents: Vec<Agent> = BACKENDS
        .iter()
        .enumerate()
        .map(|(i, (node, zone))| {
            let mut opts = AgentOpts::new(SERVICE, node).seed(i as u64);
            opts.address = Some(backends.address(node));
            opts.zone = Some(zone.to_string());
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(
        Duration::from_secs(15),
        "all three endpoints serving",
        || {
            let eps = agg.endpoints(SERVICE);
            let serving: Vec<(&str, &str)> = eps
                .iter()
                .filter(|e| e.state == EndpointState::Serving)
                .map(|e| (e.node.as_str(), e.zone.as_str()))
                .collect();
            if serving.len() == BACKENDS.len() {
                Ok(())
            } else {
                Err(format!("{serving:?}"))
            }
        },
    );

    let xds = agg.xds();
    let mut c1 = XdsClient::start(&xds, SERVICE, "client-zone-1", Some("zone_1"), work.path());
    let mut c2 = XdsClient::start(&xds, SERVICE, "client-zone-2", Some("zone_2"), work.path());
    let mut c3 = XdsClient::start(&xds, SERVICE, "client-zone-3", Some("zone_3"), work.path());
    // Warm up: the first calls wait for the resources and connect the subchannels.
    for (who, c) in [
        ("zone_1 client", &mut c1),
        ("zone_2 client", &mut c2),
        ("zone_3 client", &mut c3),
    ] {
        let warm = c.round(200, ROUND_BUDGET);
        assert_eq!(
            warm.counts.values().sum::<u32>(),
            200,
            "{who}: warm-up calls failed: {warm:?}; stderr:\n{}\naggregator log:\n{}",
            c.stderr_tail(),
            agg.log_tail(20)
        );
    }

    // Round 1: the seed's split.
    let r1 = full_round(&mut c1, "zone_1 client", &agg);
    let r2 = full_round(&mut c2, "zone_2 client", &agg);
    eprintln!(
        "seed split: zone_1 client {:?} ({:.1} s), zone_2 client {:?} ({:.1} s)",
        r1.counts, r1.seconds, r2.counts, r2.seconds
    );
    assert_eq!(
        r1.counts.get("geo-2a"),
        None,
        "the zone_1 client must not call zone_2: {:?}",
        r1.counts
    );
    assert_share("zone_2 client", &r2, "zone_1", 0.5);
    assert_share("zone_2 client", &r2, "zone_2", 0.5);
    // The default, for a zone without a split: zone_1's share of the published weight,
    // averaged over the round (the weights drift a little).
    let before = zone_1_weight_share(&agg);
    let r3 = full_round(&mut c3, "zone_3 client", &agg);
    let default_share = (before + zone_1_weight_share(&agg)) / 2.0;
    eprintln!(
        "seed split: zone_3 client (no split) {:?}, zone_1's share of the weight {default_share:.3}",
        r3.counts
    );
    assert!(
        default_share > 0.6,
        "zone_1's two backends should hold about two thirds of the weight, not {default_share:.3}"
    );
    assert_share("zone_3 client", &r3, "zone_1", default_share);

    // Round 2: the file is rewritten; nothing restarts.
    write_service_file(&config_dir, FAILOVER);
    wait_split(
        &agg,
        &[
            ("zone_1", &[("zone_2", 100)]),
            ("zone_2", &[("zone_1", 75), ("zone_2", 25)]),
        ],
    );
    // The push is on its way: small rounds until each client shows it. The zone_2
    // client goes from half to three quarters in zone_1: 0.65 lies more than three
    // standard deviations of a 200-call round from both.
    wait_for(
        Duration::from_secs(10),
        "the zone_1 client to fail over",
        || {
            let probe = c1.round(50, Duration::from_secs(5));
            if probe.counts.keys().all(|b| b == "geo-2a") && probe.errors.is_empty() {
                Ok(())
            } else {
                Err(format!("{probe:?}"))
            }
        },
    );
    wait_for(
        Duration::from_secs(10),
        "the zone_2 client to take the new split",
        || {
            let probe = c2.round(200, Duration::from_secs(5));
            let share = zone_shares(&probe).get("zone_1").copied().unwrap_or(0.0);
            if share > 0.65 && probe.errors.is_empty() {
                Ok(())
            } else {
                Err(format!("zone_1 share {share:.3}: {probe:?}"))
            }
        },
    );
    let r1 = full_round(&mut c1, "zone_1 client", &agg);
    let r2 = full_round(&mut c2, "zone_2 client", &agg);
    eprintln!(
        "after the edit: zone_1 client {:?} ({:.1} s), zone_2 client {:?} ({:.1} s)",
        r1.counts, r1.seconds, r2.counts, r2.seconds
    );
    assert_eq!(
        r1.counts.keys().collect::<Vec<_>>(),
        ["geo-2a"],
        "the zone_1 client must now call zone_2 only"
    );
    assert_share("zone_2 client", &r2, "zone_1", 0.75);
    assert_share("zone_2 client", &r2, "zone_2", 0.25);

    let mut agg = agg;
    assert!(agg.is_running(), "the aggregator stopped");
    assert_eq!(agg.pid(), pid, "the aggregator was restarted");
    let nacks = agg.counter("ballast_xds_nacks_total", &[]);
    assert_eq!(
        nacks,
        0.0,
        "a gRPC client rejected resources; log:\n{}",
        agg.log_tail(30)
    );
    drop(c1);
    drop(c2);
    drop(c3);
    drop(agents);
    drop(backends);
}
