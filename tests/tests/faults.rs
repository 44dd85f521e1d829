//! Scenario: real network faults and crashes, with the aggregator in a network
//! namespace of its own and nftables dropping real packets on its side of the link.
//!
//! 1. **Report loss of 10 %, 20 % and 50 %.** Six agents report every 300 ms; the rule drops
//!    that share of the datagrams arriving for the QUIC port (reports, and the
//!    handshake and acknowledgements with them). After 20 s of each, the fleet is
//!    still balanced (max/avg within [`LOSSY_MAX_OVER_AVG`] over the last cycles),
//!    every agent still has its endpoint, and the rule counted its drops.
//! 2. **One agent partitioned, then healed.** Its datagrams are dropped (it dials the
//!    namespace's second address, and the rule drops what arrives there) for 2 s, shorter than `stale_ms`: its endpoint keeps its weight (no cold
//!    start), the others keep being balanced. Then for 8 s, past `stale_ms`: it counts
//!    as missing and its weight is held; after healing it reports again within the
//!    reconnect budget, and its weight was never reset to the cold-start value.
//! 3. **An xDS client cut off from the aggregator.** A proxyless `grpcio` client keeps
//!    calling every backend with its last assignment while TCP to the xDS port is
//!    dropped, and a drain made meanwhile reaches it after healing.
//! 4. **The aggregator cut off from etcd.** With etcd outside the namespace and every
//!    TCP segment between them dropped, balancing goes on (new versions in the API),
//!    `/healthz` names the store's error, and after healing etcd holds the version the
//!    API serves. An `etcdctl watch` sees the writes from both sides of the cut, each
//!    once, in increasing versions, the last of them the version served.
//! 5. **SIGKILL, repeatedly.** The aggregator is killed 20 times at random moments of
//!    its cycles under a reporting fleet, each time once it has written a newer version
//!    than it restored. After each restart the store file is whole,
//!    the restored weights are those of a version it held, and no endpoint that was
//!    serving restarts from the cold-start weight.
//!
//! Needs root (network namespaces), nftables and grpcio; fails, naming what is missing.

use ballast_tests::harness::ads::xds_aggregator_opts;
use ballast_tests::harness::converge::{converged, node_names, start_speeds};
use ballast_tests::harness::grpc::{require_grpcio, Backends, XdsClient};
use ballast_tests::harness::netns::Netns;
use ballast_tests::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SPEEDS: [f64; 6] = [0.6, 0.8, 1.0, 1.0, 1.2, 1.5];
/// max/avg under loss, over the last five cycles. Without loss this fleet settles at
/// 1.02–1.05 (the synthetic agents' noise is 2 %); a lost report holds the node's
/// weight for a cycle, which costs a little more.
const LOSSY_MAX_OVER_AVG: f64 = 1.12;

/// Agents reporting every 300 ms to an aggregator with 300 ms cycles in `ns`.
fn lossy_opts(ns: &Arc<Netns>) -> AggregatorOpts {
    AggregatorOpts::default()
        .cycle_ms(300)
        .report_interval_ms(300)
        .grace_ms(1000)
        .netns(ns)
}

/// The largest max/avg of the last `n` cycles that updated weights.
fn recent_max_over_avg(agg: &Aggregator, service: &str, n: usize) -> f64 {
    let d = agg.service(service);
    d.history
        .iter()
        .rev()
        .filter(|h| !h.skipped)
        .take(n)
        .map(|h| h.spread.max_over_avg)
        .fold(0.0, f64::max)
}

#[test]
fn balancing_holds_under_real_report_loss() {
    const SERVICE: &str = "lossy";
    let ns = Netns::new();
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, lossy_opts(&ns));
    let nodes = node_names(SERVICE, SPEEDS.len());
    let _agents = start_speeds(&pki, &agg, SERVICE, &nodes, &SPEEDS, |_, _| {});
    wait_for(Duration::from_secs(30), "the fleet to converge", || {
        converged(&agg, SERVICE, 10, 1.08).map(|_| ())
    });
    let mut figures = Vec::new();
    for loss in [10, 20, 50] {
        ns.set_rules(&Netns::drop_udp_to_port(agg.quic_addr().port(), loss));
        let before = agg.service(SERVICE).stats;
        std::thread::sleep(Duration::from_secs(20));
        let after = agg.service(SERVICE);
        let worst = recent_max_over_avg(&agg, SERVICE, 5);
        let dropped = ns.dropped_packets();
        let skipped_missing = after.stats.skipped.get("missing").copied().unwrap_or(0)
            - before.skipped.get("missing").copied().unwrap_or(0);
        figures.push((
            loss,
            worst,
            dropped,
            after.stats.updates - before.updates,
            skipped_missing,
        ));
        assert!(dropped > 0, "{loss} %: the rule dropped nothing");
        assert_eq!(
            agg.endpoints(SERVICE).len(),
            SPEEDS.len(),
            "{loss} %: an endpoint was lost"
        );
        assert!(
            worst <= LOSSY_MAX_OVER_AVG,
            "{loss} % loss: max/avg {worst:.3} over the last cycles ({})",
            after.recent_max_over_avg(8)
        );
        // 20 s is about 66 cycles of 300 ms. At 10 and 20 % loss no cycle is skipped,
        // and more than 20 updates is a wide margin. At 50 % an agent now and then
        // misses six replies in a row, takes the connection for dead and reconnects,
        // and a handshake through 50 % loss took 3 to 14 s here (each try cut off
        // after 3 s): meanwhile one node of six is missing, which alone skips no cycle,
        // but two at once skip every cycle until one is back. Measured about 40 updates
        // in the documented run and 17 in an unlucky one (when one missing node was
        // enough to skip); the bound asks that balancing goes on at all, at least one
        // update in 4 s.
        let least = if loss >= 50 { 5 } else { 20 };
        assert!(
            after.stats.updates > before.updates + least,
            "{loss} % loss: only {} updates in 20 s",
            after.stats.updates - before.updates
        );
    }
    ns.clear_rules();
    // Skipped cycles are counted where operators look: /metrics agrees with the API.
    wait_for(Duration::from_secs(10), "the skips counted alike", || {
        let api = agg
            .service(SERVICE)
            .stats
            .skipped
            .get("missing")
            .copied()
            .unwrap_or(0);
        let metric = agg.counter(
            "ballast_cycles_skipped_total",
            &[("service", SERVICE), ("reason", "missing")],
        );
        if api as f64 == metric {
            Ok(())
        } else {
            Err(format!("API {api}, /metrics {metric}"))
        }
    });
    for (loss, worst, dropped, updates, skipped) in figures {
        eprintln!(
            "report loss {loss} %: max/avg {worst:.3}, {dropped} datagrams dropped, \
             {updates} updates and {skipped} cycles skipped for missing reports in 20 s"
        );
    }
}

#[test]
fn a_partitioned_agent_keeps_its_weight_and_comes_back() {
    const SERVICE: &str = "parted";
    // Seven, so that one missing (14 %) is under the 15 % missing threshold and the
    // others go on being balanced meanwhile.
    const SEVEN: [f64; 7] = [0.6, 0.8, 1.0, 1.0, 1.0, 1.2, 1.5];
    let ns = Netns::new();
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, lossy_opts(&ns));
    let nodes = node_names(SERVICE, SEVEN.len());
    // The first agent dials the namespace's second address: the partition drops what
    // arrives there, whatever port the agent sends from after reconnecting.
    let quic_port = agg.quic_addr().port();
    let victim_addr = format!("{}:{quic_port}", ns.ip2());
    let agents = start_speeds(&pki, &agg, SERVICE, &nodes, &SEVEN, |i, o| {
        if i == 0 {
            o.aggregators = Some(vec![victim_addr.clone()]);
        }
    });
    let partition = Netns::drop_udp_to(ns.ip2(), quic_port);
    wait_for(Duration::from_secs(30), "the fleet to converge", || {
        converged(&agg, SERVICE, 10, 1.08).map(|_| ())
    });
    let cold = ballast_balance::Params::default().cold_start_weight;
    let victim = &agents[0];
    let node = victim.node().to_string();
    let weight_of = |agg: &Aggregator| agg.weights(SERVICE).weights[&node].weight;
    let before = weight_of(&agg);

    // Briefly: 2 s, under stale_ms (3 s).
    ns.set_rules(&partition);
    std::thread::sleep(Duration::from_secs(2));
    assert!(ns.dropped_packets() > 0, "the rule dropped nothing");
    let during = agg.weights(SERVICE);
    assert!(
        during.weights.contains_key(&node),
        "the endpoint was dropped"
    );
    ns.clear_rules();
    let brief = weight_of(&agg);
    assert!(
        (brief / before - 1.0).abs() < 0.25,
        "a 2 s partition moved the weight from {before:.3} to {brief:.3}"
    );

    // Longer: 8 s, past stale_ms. Its weight is held, the rest are balanced.
    ns.set_rules(&partition);
    let held = wait_for(
        Duration::from_secs(10),
        "the endpoint to go missing",
        || {
            let e = agg
                .endpoints(SERVICE)
                .into_iter()
                .find(|e| e.node == node)
                .ok_or("the endpoint was dropped")?;
            if format!("{:?}", e.state) == "Missing" {
                Ok(e.weight)
            } else {
                Err(format!("{:?}", e.state))
            }
        },
    );
    let updates = agg.service(SERVICE).stats.updates;
    std::thread::sleep(Duration::from_secs(5));
    let e = agg
        .endpoints(SERVICE)
        .into_iter()
        .find(|e| e.node == node)
        .expect("the missing endpoint is kept");
    assert_eq!(e.weight, held, "a missing endpoint's weight is held");
    assert!(
        agg.service(SERVICE).stats.updates > updates,
        "the six others must go on being balanced: {:?}",
        agg.service(SERVICE).stats
    );
    ns.clear_rules();
    let healed = Instant::now();
    let back = wait_for(Duration::from_secs(15), "the agent to report again", || {
        let e = agg
            .endpoints(SERVICE)
            .into_iter()
            .find(|e| e.node == node)
            .ok_or("the endpoint was dropped")?;
        if format!("{:?}", e.state) != "Missing" {
            Ok(e)
        } else {
            Err(format!("{:?}", e.state))
        }
    });
    eprintln!(
        "partitioned agent reported again {:.1} s after healing; weight {:.3} (held {held:.3}, cold start {cold})",
        healed.elapsed().as_secs_f64(),
        back.weight
    );
    assert!(
        back.weight > cold * 1.5,
        "the returning endpoint restarted from the cold-start weight: {:.3}",
        back.weight
    );
}

#[test]
fn an_xds_client_cut_off_keeps_its_assignment_and_catches_up() {
    const SERVICE: &str = "cutoff";
    const NODES: [&str; 3] = ["cutoff-0", "cutoff-1", "cutoff-2"];
    require_grpcio();
    let ns = Netns::new();
    let pki = Pki::with_server_names(&[&ns.ip().to_string()]);
    let dir = tempfile::tempdir().expect("temporary directory");
    let backends = Backends::start_on(std::net::IpAddr::V4(ns.host_ip()), &NODES, dir.path());
    let agg = Aggregator::start(&pki, xds_aggregator_opts().netns(&ns));
    let nodes: Vec<String> = NODES.iter().map(|n| n.to_string()).collect();
    let agents = start_speeds(&pki, &agg, SERVICE, &nodes, &[0.8, 1.0, 1.2], |_, o| {
        o.address = Some(backends.address(&o.node));
    });
    let mut client = XdsClient::start(&agg.xds(), SERVICE, "cut-client", None, dir.path());
    let warm = client.round(300, Duration::from_secs(30));
    assert!(
        warm.errors.is_empty() && warm.counts.len() == NODES.len(),
        "before: {warm:?}\n{}",
        client.stderr_tail()
    );

    // Cut the client off from the xDS port, then drain a backend meanwhile.
    ns.set_rules(&Netns::drop_tcp_to_port(agg.xds_addr().port()));
    let drained = NODES[1];
    assert!(agents[1].drain().ok, "drain refused");
    wait_for(
        Duration::from_secs(10),
        "the aggregator to publish the drain",
        || {
            let w = agg.weights(SERVICE);
            if w.weights[drained].draining {
                Ok(())
            } else {
                Err("not yet".into())
            }
        },
    );
    let during = client.round(300, Duration::from_secs(30));
    assert!(ns.dropped_packets() > 0, "the rule dropped nothing");
    assert!(
        during.errors.is_empty() && during.counts.len() == NODES.len(),
        "cut off, the client keeps its last assignment, drained backend included: {during:?}"
    );

    // Heal: the client gets the current assignment.
    ns.clear_rules();
    let healed = Instant::now();
    wait_for(
        Duration::from_secs(60),
        "the client to see the drain",
        || {
            let probe = client.round(100, Duration::from_secs(5));
            if probe.errors.is_empty() && !probe.counts.contains_key(drained) {
                Ok(())
            } else {
                Err(format!("{probe:?}"))
            }
        },
    );
    eprintln!(
        "xDS client caught up {:.1} s after healing",
        healed.elapsed().as_secs_f64()
    );
}

#[test]
fn repeated_sigkill_never_tears_the_store_or_resets_a_weight() {
    const SERVICE: &str = "killed";
    const KILLS: usize = 20;
    let pki = Pki::new();
    let mut agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .cycle_ms(300)
            .report_interval_ms(300)
            .grace_ms(1000),
    );
    let nodes = node_names(SERVICE, 4);
    let _agents = start_speeds(
        &pki,
        &agg,
        SERVICE,
        &nodes,
        &[0.6, 1.0, 1.2, 1.5],
        |_, _| {},
    );
    wait_for(Duration::from_secs(30), "the fleet to converge", || {
        converged(&agg, SERVICE, 8, 1.1).map(|_| ())
    });
    let cold = ballast_balance::Params::default().cold_start_weight;
    // The store as it is: its version of the service and each endpoint's weight.
    let read_store = |agg: &Aggregator, kill: usize| -> (u64, Vec<(String, f64)>) {
        let text = std::fs::read_to_string(agg.store_path()).expect("the store file exists");
        let doc: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("kill {kill}: a torn store ({e}):\n{text}"));
        let svc = &doc["services"][SERVICE];
        let version = svc["version"].as_u64().expect("a stored version");
        let stored = svc["endpoints"]
            .as_object()
            .expect("stored endpoints")
            .iter()
            .map(|(n, e)| (n.clone(), e["weight"].as_f64().expect("a weight")))
            .collect();
        (version, stored)
    };
    // Each kill lands while the aggregator is writing: once it has stored a version
    // newer than the one it restored (so its grace period is over, its agents are back
    // and its writer works), at a moment spread over the next cycle and a half. A kill
    // inside the grace period would find a store nobody writes, and prove nothing.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut restored = read_store(&agg, 0).0;
    let mut written = Vec::new();
    for kill in 0..KILLS {
        let newer = wait_for(
            Duration::from_secs(30),
            &format!("kill {kill}: a version newer than {restored} stored"),
            || match read_store(&agg, kill).0 {
                v if v > restored => Ok(v),
                v => Err(format!("version {v}")),
            },
        );
        written.push(newer - restored);
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        std::thread::sleep(Duration::from_millis((seed >> 33) % 450));
        agg.kill();
        let (version, stored) = read_store(&agg, kill);
        restored = version;
        agg.restart();
        // In the grace period nothing moves: the API serves exactly what was stored.
        let w = agg.weights(SERVICE);
        assert_eq!(w.version, version, "kill {kill}: restored another version");
        for (node, weight) in &stored {
            let got = w.weights[node].weight;
            assert!(
                (got - weight).abs() < 1e-9,
                "kill {kill}: {node} restored at {got}, stored {weight}"
            );
            assert!(
                got > cold * 1.5,
                "kill {kill}: {node} is back at the cold-start weight ({got})"
            );
        }
        assert!(
            agg.endpoints(SERVICE)
                .iter()
                .all(|e| format!("{:?}", e.state) != "Warming"),
            "kill {kill}: a restored endpoint is warming up again"
        );
    }
    eprintln!("versions written between restart and kill: {written:?}");
    // And the fleet is balanced again after the last one.
    wait_for(
        Duration::from_secs(30),
        "the fleet to converge again",
        || converged(&agg, SERVICE, 8, 1.1).map(|_| ()),
    );
}

#[test]
fn an_etcd_partition_stops_nothing_and_the_store_catches_up() {
    const SERVICE: &str = "etcdcut";
    let prefix = "/ballast-cut";
    let ns = Netns::new();
    let etcd = Etcd::start_also_on(ns.host_ip());
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        lossy_opts(&ns).etcd(&etcd.endpoint_on(ns.host_ip()), prefix),
    );
    let watch = etcd.watch(prefix);
    let nodes = node_names(SERVICE, 4);
    let agents = start_speeds(
        &pki,
        &agg,
        SERVICE,
        &nodes,
        &[0.6, 1.0, 1.2, 1.5],
        |_, _| {},
    );
    let key = format!("{prefix}/services/{SERVICE}");
    let stored_version = || -> Result<u64, String> {
        let v = etcd.get(&key).ok_or("no key yet")?;
        let doc: serde_json::Value = serde_json::from_str(&v).map_err(|e| e.to_string())?;
        doc["version"]
            .as_u64()
            .ok_or_else(|| format!("no version in {v}"))
    };
    wait_for(
        Duration::from_secs(20),
        "a first write to etcd",
        stored_version,
    );

    ns.set_rules(&Netns::drop_tcp_to(ns.host_ip(), etcd.client_port()));
    let cut_at = agg.weights(SERVICE).version;
    // A drain makes sure the weights change while etcd is away.
    assert!(agents[0].drain().ok, "drain refused");
    wait_for(
        Duration::from_secs(30),
        "new versions and a store error while etcd is cut off",
        || {
            let h = agg.health();
            let version = agg.weights(SERVICE).version;
            if version > cut_at + 1 && h.store_error.is_some() {
                Ok(())
            } else {
                Err(format!(
                    "version {version} (cut at {cut_at}), healthz {h:?}"
                ))
            }
        },
    );
    assert!(ns.dropped_packets() > 0, "the rule dropped nothing");
    // etcd is read from the host, which the rule does not cut: an unreadable key is a
    // failure of its own, not a pass.
    let stored = stored_version().expect("etcd's stored version, read from the host");
    assert!(
        stored <= cut_at,
        "etcd got a write through the partition: version {stored}, cut at {cut_at}"
    );

    ns.clear_rules();
    let served = wait_for(Duration::from_secs(30), "the store to catch up", || {
        let served = agg.weights(SERVICE).version;
        let stored = stored_version()?;
        if stored == served {
            Ok(served)
        } else {
            Err(format!("etcd has version {stored}, the API {served}"))
        }
    });
    // The watcher, from revision 1, sees the writes from both sides of the cut, each
    // once, in increasing versions, the last of them the version served.
    let versions = wait_for(
        Duration::from_secs(10),
        "the watcher to see the write after the cut",
        || {
            let mut versions = Vec::new();
            for e in watch
                .events()
                .iter()
                .filter(|e| e.key == key && e.kind == "PUT")
            {
                let doc: serde_json::Value = serde_json::from_str(&e.value)
                    .map_err(|why| format!("a value that is not JSON ({why}): {}", e.value))?;
                versions.push(
                    doc["version"]
                        .as_u64()
                        .ok_or_else(|| format!("a value without a version: {}", e.value))?,
                );
            }
            if versions.last() == Some(&served) {
                Ok(versions)
            } else {
                Err(format!("versions {versions:?}, served {served}"))
            }
        },
    );
    assert!(
        versions.windows(2).all(|w| w[0] < w[1]),
        "the watcher saw versions out of order or twice: {versions:?}"
    );
    assert!(
        versions[0] <= cut_at,
        "the watcher saw no write from before the cut (at version {cut_at}): {versions:?}"
    );
}
