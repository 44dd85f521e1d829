//! Version skew: agents, aggregators, relays and replicas of two releases side by side.
//!
//! Every process here is today's binary; one that speaks only the previous agent
//! protocol (`ballast/1`, `BALLAST_PROTOCOL=previous`) stands for a process of the
//! previous release on the wire. An agent of the previous version reports to today's
//! aggregator, and today's agent negotiates down to an aggregator that accepts only
//! the previous version; an agent more than one version apart is refused in the
//! handshake and counted; agents of both versions report through a relay to a current
//! replica, and through a relay of the previous version; and a cluster of three
//! replicas of the previous version is upgraded one replica at a time under a mixed
//! fleet, with every service published in etcd the whole time, by one writer at a
//! time.

use ballast_tests::harness::cluster::{self, converged_to_speeds, ClusterKeys};
use ballast_tests::*;
use std::time::Duration;

const PREVIOUS: &str = "ballast/1";
const CURRENT: &str = "ballast/2";
const CONNECT: Duration = Duration::from_secs(20);

/// The agent connections open at `agg` that negotiated `protocol`.
fn connections(agg: &Aggregator, protocol: &str) -> f64 {
    agg.counter("ballast_agent_connections", &[("protocol", protocol)])
}

/// Waits until `agg` holds `previous` connections of the previous version and
/// `current` of the current.
fn wait_connections(agg: &Aggregator, previous: f64, current: f64) {
    wait_for(CONNECT, "agent connections by protocol", || {
        let got = (connections(agg, PREVIOUS), connections(agg, CURRENT));
        (got == (previous, current))
            .then_some(())
            .ok_or(format!("{PREVIOUS}, {CURRENT}: {got:?}"))
    });
}

/// Whether the agent's log says it connected with `protocol`.
fn connected_with(agent: &Agent, protocol: &str) -> bool {
    agent
        .log_tail(200)
        .lines()
        .any(|l| l.contains("connected") && l.contains(&format!("protocol={protocol}")))
}

#[test]
fn an_agent_of_the_previous_version_reports_to_todays_aggregator() {
    let pki = Pki::new();
    pki.issue_nodes_for("web", &["old-1", "old-2", "new-1"]);
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let old: Vec<Agent> = ["old-1", "old-2"]
        .iter()
        .map(|n| Agent::start(&pki, &agg, AgentOpts::new("web", n).protocol("previous")))
        .collect();
    let new = Agent::start(&pki, &agg, AgentOpts::new("web", "new-1"));
    agg.wait_for_endpoints("web", 3, CONNECT);
    for a in old.iter().chain([&new]) {
        let s = a.wait_weight(CONNECT);
        assert!(s.weight.is_some_and(|w| w > 0.0), "{}: {s:?}", a.node());
    }
    for a in &old {
        assert!(connected_with(a, PREVIOUS), "{}", a.log_tail(20));
    }
    assert!(connected_with(&new, CURRENT), "{}", new.log_tail(20));
    wait_connections(&agg, 2.0, 1.0);
    // Reports of both versions reach the balancer: every endpoint is fresh, cycle
    // after cycle.
    let before = agg.counter("ballast_reports_accepted_total", &[]);
    std::thread::sleep(Duration::from_secs(2));
    let after = agg.counter("ballast_reports_accepted_total", &[]);
    assert!(
        after - before >= 3.0 * 3.0,
        "{} reports in 2 s from 3 agents at 500 ms",
        after - before
    );
    assert_eq!(
        agg.counter(
            "ballast_agent_connections_accepted_total",
            &[("protocol", PREVIOUS)]
        ),
        2.0
    );
    assert_eq!(agg.counter("ballast_reports_rejected_total", &[]), 0.0);
}

#[test]
fn todays_agent_negotiates_down_to_an_aggregator_of_the_previous_version() {
    let pki = Pki::new();
    pki.issue_nodes_for("web", &["new-1", "new-2", "next-1"]);
    let agg = Aggregator::start(&pki, AggregatorOpts::default().protocol("previous"));
    let new: Vec<Agent> = ["new-1", "new-2"]
        .iter()
        .map(|n| Agent::start(&pki, &agg, AgentOpts::new("web", n)))
        .collect();
    agg.wait_for_endpoints("web", 2, CONNECT);
    for a in &new {
        let s = a.wait_weight(CONNECT);
        assert!(s.weight.is_some_and(|w| w > 0.0), "{}: {s:?}", a.node());
        assert!(connected_with(a, PREVIOUS), "{}", a.log_tail(20));
    }
    wait_connections(&agg, 2.0, 0.0);

    // An agent that speaks only the current version stands for one two releases
    // ahead of this aggregator: refused in the handshake, and counted.
    let next = Agent::start(
        &pki,
        &agg,
        AgentOpts::new("web", "next-1").protocol("current"),
    );
    wait_for(CONNECT, "a handshake refused for its protocol", || {
        let n = agg.counter(
            "ballast_connections_rejected_total",
            &[("reason", "no_common_protocol")],
        );
        (n >= 1.0).then_some(()).ok_or(format!("{n}"))
    });
    // The agent says why, in its status and its log.
    let s = wait_for(CONNECT, "the refusal in the agent's status", || {
        let s = next.status();
        match &s.rejection {
            Some(r) if r.reason == "no_common_protocol" => Ok(s),
            other => Err(format!("{other:?}")),
        }
    });
    assert!(s.connected_to.is_none() && s.weight.is_none(), "{s:?}");
    assert!(
        next.log_tail(50)
            .contains("none of the protocol versions this agent offers"),
        "{}",
        next.log_tail(20)
    );
    assert_eq!(agg.weights("web").weights.len(), 2);
}

const RELAY_PREFIX: &str = "/ballast-skew-relay";
const RELAY_CLUSTER: &str = "skew";

#[test]
fn agents_of_both_versions_report_through_relays_of_both_versions_to_a_current_replica() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let nodes = ["web-0", "web-1", "web-2", "web-3"];
    pki.issue_nodes_for("web", &nodes);
    // During the upgrade the replica admits the agents that cannot prove their key
    // through a relay: those of ballast/1, and those behind a relay of the previous
    // release (its trunk, ballast-relay/1, carries no proofs).
    let replica = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .etcd(&etcd.endpoint(), RELAY_PREFIX)
            .cluster(RELAY_CLUSTER, "r0")
            .policy("relays = [\"relay-*\"]\nadmit_unproven_relayed_agents = true\n"),
    );
    // A relay of today's release, and one that speaks only the previous agent
    // protocol to its agents and the previous trunk protocol to the replica. (The
    // previous release's relays read the routes from etcd themselves; today's binary
    // standing for one learns them from the replica, which changes nothing on the
    // trunk.)
    let current = Relay::start(&pki, RelayOpts::new("relay-a", &[&replica]));
    let previous = Relay::start(
        &pki,
        RelayOpts::new("relay-b", &[&replica]).protocol("previous"),
    );
    // web-0: old agent, current relay; web-1: new agent, current relay;
    // web-2: old agent, old relay; web-3: new agent, old relay (negotiates down).
    let agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let relay = if i < 2 { &current } else { &previous };
            let mut opts = AgentOpts::new("web", n);
            opts.aggregators = Some(vec![relay.quic_addr().to_string()]);
            if i % 2 == 0 {
                opts = opts.protocol("previous");
            }
            Agent::start(&pki, &replica, opts)
        })
        .collect();
    replica.wait_for_endpoints("web", 4, Duration::from_secs(30));
    for a in &agents {
        let s = a.wait_weight(CONNECT);
        assert!(s.weight.is_some_and(|w| w > 0.0), "{}: {s:?}", a.node());
    }
    assert!(connected_with(&agents[0], PREVIOUS));
    assert!(connected_with(&agents[1], CURRENT));
    assert!(connected_with(&agents[2], PREVIOUS));
    assert!(connected_with(&agents[3], PREVIOUS));
    let by = |r: &Relay, p: &str| r.counter("ballast_agent_connections", &[("protocol", p)]);
    assert_eq!((by(&current, PREVIOUS), by(&current, CURRENT)), (1.0, 1.0));
    assert_eq!(
        (by(&previous, PREVIOUS), by(&previous, CURRENT)),
        (2.0, 0.0)
    );
    // The replica holds them all through the two trunks, in today's protocol.
    wait_for(CONNECT, "four slots on two trunks", || {
        let slots = replica.counter("ballast_trunk_slots", &[]);
        let trunks = replica.counter("ballast_trunks_open", &[]);
        (slots == 4.0 && trunks == 2.0)
            .then_some(())
            .ok_or(format!("{slots} slots, {trunks} trunks"))
    });
    // Only today's agent behind today's relay proved its key; the three others were
    // admitted unproven, as the policy allows while the upgrade lasts.
    // (An attach the replica refused as not_owner while the relay learned the
    // routes is tried again, and counted again.)
    let unproven = replica.counter("ballast_trunk_unproven_admitted_total", &[]);
    assert!(unproven >= 3.0, "{unproven}: {}", replica.log_tail(20));
    // Reports keep flowing for every agent: none goes stale.
    let before = replica.counter("ballast_reports_accepted_total", &[]);
    std::thread::sleep(Duration::from_secs(2));
    let after = replica.counter("ballast_reports_accepted_total", &[]);
    assert!(after - before >= 12.0, "{} reports in 2 s", after - before);
    // Nothing was lost in translation (an agent may be told not_owner while the
    // relay first learns the routes; that is not a fault of either version).
    for r in [&current, &previous] {
        for reason in ["unknown_version", "malformed", "untranslatable"] {
            assert_eq!(
                r.counter("ballast_reports_rejected_total", &[("reason", reason)]),
                0.0,
                "{reason}: {}",
                r.log_tail(20)
            );
        }
    }
    assert_eq!(
        replica.counter(
            "ballast_reports_rejected_total",
            &[("reason", "unknown_version")]
        ),
        0.0
    );
}

const UPGRADE_PREFIX: &str = "/ballast-skew-upgrade";
const UPGRADE_CLUSTER: &str = "rolling";
const KEYS: ClusterKeys = ClusterKeys {
    prefix: UPGRADE_PREFIX,
    name: UPGRADE_CLUSTER,
    buckets: 64,
};
const SERVICES: [&str; 3] = ["alpha", "beta", "gamma"];
const PER_SERVICE: usize = 4;

/// Replica `name` of the rolling cluster; of the previous version when `previous`.
fn rolling_opts(etcd: &Etcd, name: &str, previous: bool) -> AggregatorOpts {
    let opts = AggregatorOpts::default()
        .etcd(&etcd.endpoint(), UPGRADE_PREFIX)
        .cluster(UPGRADE_CLUSTER, name);
    if previous {
        opts.protocol("previous")
    } else {
        opts
    }
}

/// Panics unless every service is in etcd with its whole fleet: published.
fn all_published(etcd: &Etcd) -> Result<(), String> {
    for s in SERVICES {
        let stored = KEYS.stored(etcd, s).ok_or(format!("{s} not stored"))?;
        assert_eq!(
            stored.endpoints.len(),
            PER_SERVICE,
            "{s} published without its whole fleet: {stored:?}"
        );
    }
    Ok(())
}

#[test]
fn a_cluster_upgraded_one_replica_at_a_time_keeps_every_service_published() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let watch = etcd.watch(&format!("{UPGRADE_PREFIX}/services/"));
    let names = ["r0", "r1", "r2"];
    let mut replicas: Vec<Aggregator> = names
        .iter()
        .map(|n| Aggregator::start(&pki, rolling_opts(&etcd, n, true)))
        .collect();
    let addrs: Vec<String> = replicas.iter().map(|r| r.quic_addr().to_string()).collect();
    // Half the fleet of each service speaks only the previous version, half both.
    let agents = cluster::fleet_with(
        &pki,
        &replicas[0],
        &addrs,
        &SERVICES,
        PER_SERVICE,
        |i, opts| {
            if i % 2 == 0 {
                opts.protocol("previous")
            } else {
                opts
            }
        },
    );
    KEYS.wait_balanced(&etcd, &SERVICES, PER_SERVICE, Duration::from_secs(90));
    // What was published before the upgrade began: from here on every write must
    // carry the whole fleet.
    let balanced: Vec<usize> = SERVICES
        .iter()
        .map(|s| KEYS.history(&watch, s).len())
        .collect();
    let total = |p: &str, rs: &[Aggregator]| -> f64 { rs.iter().map(|r| connections(r, p)).sum() };
    let fleet = (SERVICES.len() * PER_SERVICE) as f64;
    // Every agent speaks the previous version to the previous release.
    wait_for(CONNECT, "the whole fleet on the previous version", || {
        let got = (total(PREVIOUS, &replicas), total(CURRENT, &replicas));
        (got == (fleet, 0.0))
            .then_some(())
            .ok_or(format!("{got:?}"))
    });

    let started = std::time::Instant::now();
    for i in 0..replicas.len() {
        let writes: Vec<usize> = SERVICES
            .iter()
            .map(|s| KEYS.history(&watch, s).len())
            .collect();
        replicas[i].stop();
        all_published(&etcd).expect("published while a replica is down");
        let opts = rolling_opts(&etcd, names[i], false);
        replicas[i].restart_with(opts);
        // Every agent connected again and every service written on, converged,
        // through the mixed cluster.
        wait_for(
            Duration::from_secs(60),
            "the fleet settled after an upgrade",
            || {
                all_published(&etcd)?;
                for (s, n) in SERVICES.iter().zip(&writes) {
                    let h = KEYS.history(&watch, s);
                    if h.len() < n + 3 {
                        return Err(format!("{s}: {} writes", h.len()));
                    }
                    converged_to_speeds(h.last().ok_or("no write")?, PER_SERVICE)
                        .map_err(|e| format!("{s}: {e}"))?;
                }
                let open = total(PREVIOUS, &replicas) + total(CURRENT, &replicas);
                (open == fleet)
                    .then_some(())
                    .ok_or(format!("{open} agent connections"))
            },
        );
        eprintln!(
            "after upgrading {} ({:.1} s into the upgrade): {PREVIOUS} {} / {CURRENT} {} connections",
            names[i],
            started.elapsed().as_secs_f64(),
            total(PREVIOUS, &replicas),
            total(CURRENT, &replicas)
        );
    }
    // The whole cluster is upgraded: the new agents speak the current version, and
    // the old ones, still the previous; the metric shows what is left to upgrade.
    wait_for(CONNECT, "new agents on the current version", || {
        let got = (total(PREVIOUS, &replicas), total(CURRENT, &replicas));
        (got == (fleet / 2.0, fleet / 2.0))
            .then_some(())
            .ok_or(format!("{got:?}"))
    });
    for r in &replicas {
        let lines: Vec<String> = r
            .metrics()
            .lines()
            .filter(|l| l.starts_with("ballast_agent_connections"))
            .map(str::to_string)
            .collect();
        eprintln!("{}", lines.join("\n"));
    }
    // What etcd published: never deleted, never without its fleet, and one writer at
    // a time (versions only rise), across replicas of both versions.
    for e in watch.events() {
        assert_eq!(e.kind, "PUT", "a service key was deleted: {e:?}");
    }
    for (s, from) in SERVICES.iter().zip(&balanced) {
        KEYS.assert_one_writer(&watch, s);
        for snap in KEYS.history(&watch, s).into_iter().skip(*from) {
            assert_eq!(snap.endpoints.len(), PER_SERVICE, "{s}: {snap:?}");
        }
    }
    drop(agents);
}
