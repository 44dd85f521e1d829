//! Scenario: losing reports never empties a service (fail-static).
//!
//! 1. **The aggregator cut off from every agent for longer than `expire_ms`.** The
//!    aggregator runs in a network namespace of its own; four real agents report to it
//!    over a veth link for four real gRPC backends (`grpcio`), and a proxyless
//!    `grpcio` client resolves the service over the aggregator's xDS. Once the weights
//!    have converged, an nftables rule in the namespace drops every datagram for the
//!    aggregator's QUIC port: real packet loss, no simulation. After `expire_ms` (4 s
//!    here) has passed for every endpoint:
//!    - nothing expired (`ballast_endpoints_expired_total` stays 0) and the service says
//!      why (`expiry_held` = 4 in `/v1/services/{name}` and its gauge);
//!    - the API still serves every endpoint with the last weights, at the same version;
//!    - the store file holds every endpoint at that version;
//!    - the grpcio client still reaches all four backends, with no failed call.
//!
//!    When the rule goes, the agents reconnect, and balancing resumes within two cycles
//!    of the first cycle that hears them all.
//! 2. **One node of ten going silent does expire.** Its agent is killed; after
//!    `expire_ms` it is forgotten (counted in `ballast_endpoints_expired_total`), the
//!    version moves, and the API, an xDS client and the store all show the same nine.
//!
//! Needs root (network namespaces), nftables and grpcio; the test fails, naming what is
//! missing.

use ballast_tests::harness::ads::{xds_aggregator_opts, EdsWatch};
use ballast_tests::harness::grpc::{require_grpcio, Backends, XdsClient};
use ballast_tests::harness::netns::Netns;
use ballast_tests::*;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

/// Short staleness and expiry, so that the scenario takes seconds.
const BALANCE: &str = "[balance]\nstale_ms = 1500\nexpire_ms = 4000\n";

/// The service's version and weights in the store file.
fn stored(agg: &Aggregator, service: &str) -> Result<(u64, BTreeMap<String, f64>), String> {
    let text = std::fs::read_to_string(agg.store_path()).map_err(|e| e.to_string())?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("the store is not JSON: {e}"))?;
    let svc = &doc["services"][service];
    let version = svc["version"]
        .as_u64()
        .ok_or_else(|| format!("no stored version: {svc}"))?;
    let endpoints = svc["endpoints"]
        .as_object()
        .ok_or_else(|| format!("no stored endpoints: {svc}"))?;
    let weights = endpoints
        .iter()
        .map(|(node, e)| Ok((node.clone(), e["weight"].as_f64().ok_or("no weight")?)))
        .collect::<Result<_, String>>()?;
    Ok((version, weights))
}

fn api_weights(w: &WeightSet) -> BTreeMap<String, f64> {
    w.weights
        .iter()
        .map(|(n, e)| (n.clone(), e.weight))
        .collect()
}

#[test]
fn a_partition_longer_than_expiry_keeps_every_endpoint_and_weight() {
    const SERVICE: &str = "static";
    const NODES: [&str; 4] = ["static-0", "static-1", "static-2", "static-3"];
    const SPEEDS: [f64; 4] = [0.6, 1.0, 1.5, 1.0];
    require_grpcio();
    let ns = Netns::new();
    // The xDS client checks the server's certificate for the namespace's address.
    let pki = Pki::with_server_names(&[&ns.ip().to_string()]);
    let dir = tempfile::tempdir().expect("temporary directory");
    let host = IpAddr::V4(ns.host_ip());
    let backends = Backends::start_on(host, &NODES, dir.path());
    let mut opts = xds_aggregator_opts().netns(&ns);
    opts.config_toml = Some(BALANCE.to_string());
    let agg = Aggregator::start(&pki, opts);
    let agents: Vec<Agent> = NODES
        .iter()
        .zip(SPEEDS)
        .enumerate()
        .map(|(i, (node, speed))| {
            let mut o = AgentOpts::new(SERVICE, node).speed(speed).seed(i as u64);
            o.address = Some(backends.address(node));
            Agent::start(&pki, &agg, o)
        })
        .collect();
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(Duration::from_secs(30), "weights that follow speed", || {
        let w = agg.try_weights(SERVICE)?;
        let ws: Vec<f64> = w.weights.values().map(|e| e.weight).collect();
        let lo = ws.iter().copied().fold(f64::MAX, f64::min);
        let hi = ws.iter().copied().fold(f64::MIN, f64::max);
        if ws.len() == NODES.len() && lo < 0.9 && hi > 1.1 {
            Ok(())
        } else {
            Err(format!("{ws:?}"))
        }
    });
    let mut client = XdsClient::start(&agg.xds(), SERVICE, "client", None, dir.path());
    let round = client.round(400, Duration::from_secs(20));
    assert!(
        round.errors.is_empty() && round.counts.len() == NODES.len(),
        "before the partition, every backend answers: {round:?}\n{}",
        client.stderr_tail()
    );

    // Cut every report off.
    ns.set_rules(&Netns::drop_udp_to_port(agg.quic_addr().port(), 100));
    wait_for(
        Duration::from_secs(10),
        "every endpoint to go stale",
        || {
            let d = agg.try_service(SERVICE)?;
            if d.stats.missing_share >= 1.0 {
                Ok(())
            } else {
                Err(format!("missing share {}", d.stats.missing_share))
            }
        },
    );
    let frozen = agg.weights(SERVICE);
    assert_eq!(frozen.weights.len(), NODES.len());
    // expire_ms (4 s) after the last report, every endpoint is past it.
    let held = wait_for(
        Duration::from_secs(20),
        "the silent endpoints to be held past expire_ms",
        || {
            let d = agg.try_service(SERVICE)?;
            if d.stats.expiry_held == NODES.len() {
                Ok(d)
            } else {
                Err(format!("{:?}", d.stats))
            }
        },
    );
    assert!(ns.dropped_packets() > 0, "the rule dropped nothing");
    assert!(
        held.stats.last_skip.is_some(),
        "no weight moves on missing data: {:?}",
        held.stats
    );
    assert_eq!(
        agg.counter("ballast_endpoints_expired_total", &[("service", SERVICE)]),
        0.0,
        "nothing expired"
    );
    assert_eq!(
        agg.counter("ballast_service_expiry_held", &[("service", SERVICE)]),
        NODES.len() as f64
    );
    let now = agg.weights(SERVICE);
    assert_eq!(now.version, frozen.version, "nothing new was published");
    assert_eq!(
        api_weights(&now),
        api_weights(&frozen),
        "the last weights hold"
    );
    let (version, weights) = stored(&agg, SERVICE).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(version, frozen.version, "the store holds the last version");
    assert_eq!(
        weights.keys().collect::<Vec<_>>(),
        frozen.weights.keys().collect::<Vec<_>>(),
        "the store holds every endpoint"
    );
    let round = client.round(400, Duration::from_secs(20));
    assert!(
        round.errors.is_empty() && round.counts.len() == NODES.len(),
        "during the partition, the xDS client still reaches every backend: {round:?}\n{}",
        client.stderr_tail()
    );

    // Heal: the agents come back, and the first cycle that hears them all, or the one
    // or two after it, balances again.
    ns.clear_rules();
    let heard = wait_for(
        Duration::from_secs(30),
        "every agent to report again",
        || {
            let d = agg.try_service(SERVICE)?;
            if d.stats.missing_share == 0.0 {
                Ok(d)
            } else {
                Err(format!("{:?}", d.stats))
            }
        },
    );
    let updated = wait_for(Duration::from_secs(10), "a weight update", || {
        let d = agg.try_service(SERVICE)?;
        if d.stats.updates > held.stats.updates {
            Ok(d)
        } else {
            Err(format!("{:?}", d.stats))
        }
    });
    // The first cycle that updated the weights from the one that heard them all on,
    // by the service's own history: at most two cycles after it.
    let resumed = updated
        .history
        .iter()
        .find(|p| p.cycle >= heard.stats.cycles && !p.skipped)
        .map(|p| p.cycle)
        .unwrap_or_else(|| panic!("no update in the history: {:?}", updated.history));
    assert!(
        resumed <= heard.stats.cycles + 2,
        "balancing resumed at cycle {resumed}, {} cycles after the one that heard every \
         agent ({})",
        resumed - heard.stats.cycles,
        heard.stats.cycles
    );
    assert_eq!(agg.service(SERVICE).stats.expiry_held, 0);
    drop(agents);
}

#[test]
fn one_silent_node_of_ten_expires_and_every_feed_drops_it() {
    const SERVICE: &str = "expiring";
    const NODES: usize = 10;
    let pki = Pki::new();
    let mut opts = xds_aggregator_opts();
    opts.config_toml = Some(BALANCE.to_string());
    let agg = Aggregator::start(&pki, opts);
    let mut agents = start_fleet(&pki, &agg, SERVICE, NODES, &[0.8, 1.0, 1.2]);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    let watch = EdsWatch::start(agg.xds(), SERVICE);
    wait_for(Duration::from_secs(15), "all ten in every feed", || {
        let w = agg.try_weights(SERVICE)?;
        let eds = watch.latest().ok_or("no EDS response yet")?;
        let (_, stored) = stored(&agg, SERVICE)?;
        let n = (w.weights.len(), eds.endpoints()?.len(), stored.len());
        if n == (NODES, NODES, NODES) {
            Ok(())
        } else {
            Err(format!("API, xDS, store: {n:?}"))
        }
    });
    let before = agg.weights(SERVICE).version;
    let gone = agents.remove(3);
    let node = gone.node().to_string();
    let address = gone.address().to_string();
    drop(gone);

    wait_for(Duration::from_secs(20), "the silent node to expire", || {
        let n = agg.counter("ballast_endpoints_expired_total", &[("service", SERVICE)]);
        if n == 1.0 {
            Ok(())
        } else {
            Err(format!("expired: {n}"))
        }
    });
    let w = wait_for(Duration::from_secs(10), "every feed to drop it", || {
        let w = agg.try_weights(SERVICE)?;
        let eds = watch.latest().ok_or("no EDS response")?;
        let eds = eds.endpoints()?;
        let (version, stored) = stored(&agg, SERVICE)?;
        if w.weights.len() == NODES - 1
            && !w.weights.contains_key(&node)
            && eds.len() == NODES - 1
            && !eds.contains_key(&address)
            && stored.len() == NODES - 1
            && version == w.version
        {
            Ok(w)
        } else {
            Err(format!(
                "API {} at v{}, xDS {}, store {} at v{version}",
                w.weights.len(),
                w.version,
                eds.len(),
                stored.len()
            ))
        }
    });
    assert!(w.version > before, "the version moves");
    let d = agg.service(SERVICE);
    assert_eq!(d.stats.expiry_held, 0, "{:?}", d.stats);
    // The nine left are renormalised: their mean weight is 1.
    let mean = w.weights.values().map(|e| e.weight).sum::<f64>() / (NODES - 1) as f64;
    assert!((mean - 1.0).abs() < 0.01, "mean weight {mean}");
}
