//! Agents behind relays, in front of aggregator replicas sharing services through a
//! real etcd, with the shipped cluster defaults (64 buckets, a 3 s lease) and relay
//! defaults: three replicas, two relays, thirty agents in three services, each agent
//! told of both relays only. The replicas hold the relays' trunks, not the agents'
//! connections, and balance every service; when the owner of a service is killed,
//! its agents stay connected to their relays while another replica takes the service
//! over with its weights, and a proxyless gRPC client of a replica that is not the
//! owner sees the new owner's versions; a killed relay's agents go on through the
//! other relay; a fourth replica takes its buckets, and only the agents of the services
//! in them move, to it, without leaving their relays.

use ballast_aggregator::cluster::{bucket_of, preferred};
use ballast_tests::harness::ads::xds_aggregator_opts;
use ballast_tests::harness::cluster::{self, converged_to_speeds, largest_change, ClusterKeys};
use ballast_tests::harness::grpc::{require_grpcio, Backends, XdsClient};
use ballast_tests::*;
use std::time::{Duration, Instant};

const PREFIX: &str = "/ballast-relayed";
const CLUSTER: &str = "edge";
const KEYS: ClusterKeys = ClusterKeys {
    prefix: PREFIX,
    name: CLUSTER,
    buckets: 64,
};
/// The shipped lease.
const LEASE_TTL: Duration = Duration::from_secs(3);
/// The replicas' cycle (`xds_aggregator_opts`).
const CYCLE: Duration = Duration::from_millis(300);
const SERVICES: [&str; 3] = ["alpha", "beta", "gamma"];
const PER_SERVICE: usize = 10;

fn replica(pki: &Pki, etcd: &Etcd, name: &str) -> Aggregator {
    Aggregator::start(
        pki,
        xds_aggregator_opts()
            .etcd(&etcd.endpoint(), PREFIX)
            .cluster(CLUSTER, name)
            .relays(&["relay-*"]),
    )
}

/// Relay `name`, told of every replica in `replicas` (as an operator lists them in
/// `[relay] replicas`).
fn relay(pki: &Pki, replicas: &[Aggregator], name: &str) -> Relay {
    let all: Vec<&Aggregator> = replicas.iter().collect();
    Relay::start(pki, RelayOpts::new(name, &all))
}

/// Thirty agents in three services, each told of both relays and nothing else, half
/// of them starting at each. `alpha`'s nodes register the addresses of `backends`.
fn fleet(pki: &Pki, any: &Aggregator, relays: &[Relay], backends: &Backends) -> Vec<Agent> {
    let addrs: Vec<String> = relays.iter().map(|r| r.quic_addr().to_string()).collect();
    cluster::fleet(pki, any, &addrs, &SERVICES, PER_SERVICE, |node| {
        node.starts_with("alpha-").then(|| backends.address(node))
    })
}

/// The sum of a metric over the replicas that are still running.
fn total(replicas: &[Aggregator], skip: Option<usize>, name: &str) -> f64 {
    replicas
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != skip)
        .map(|(_, r)| r.counter(name, &[]))
        .sum()
}

#[test]
fn agents_behind_relays_stay_connected_while_a_killed_owner_hands_their_service_on() {
    require_etcd();
    require_grpcio();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("temporary directory");
    let names = ["r0", "r1", "r2"];
    let mut replicas: Vec<Aggregator> = names.iter().map(|r| replica(&pki, &etcd, r)).collect();
    let relays = [
        relay(&pki, &replicas, "relay-a"),
        relay(&pki, &replicas, "relay-b"),
    ];
    let watch = etcd.watch(&format!("{PREFIX}/services/"));
    let alpha_nodes: Vec<String> = (0..PER_SERVICE).map(|i| format!("alpha-{i}")).collect();
    let backends = Backends::start(
        &alpha_nodes.iter().map(String::as_str).collect::<Vec<_>>(),
        dir.path(),
    );
    let agents = fleet(&pki, &replicas[0], &relays, &backends);
    KEYS.wait_balanced(&etcd, &SERVICES, PER_SERVICE, Duration::from_secs(90));

    // The replicas hold the relays' trunks, not the agents: every agent is connected to
    // a relay, each replica has at most one trunk from each relay, and the slots on
    // them are the thirty agents.
    let relay_addrs: Vec<String> = relays.iter().map(|r| r.quic_addr().to_string()).collect();
    for a in &agents {
        let s = a.status();
        assert!(
            s.connected_to
                .as_ref()
                .is_some_and(|c| relay_addrs.contains(c)),
            "{} is connected to {:?}, not a relay",
            a.node(),
            s.connected_to
        );
    }
    wait_for(
        Duration::from_secs(10),
        "twelve slots on the replicas",
        || {
            let slots = total(&replicas, None, "ballast_trunk_slots");
            (slots == (SERVICES.len() * PER_SERVICE) as f64)
                .then_some(())
                .ok_or(format!("{slots} slots"))
        },
    );
    for (i, r) in replicas.iter().enumerate() {
        let trunks = r.counter("ballast_trunks_open", &[]);
        let direct = r.counter("ballast_connections_open", &[]);
        assert!(
            trunks <= 2.0 && direct <= trunks,
            "{}: {trunks} trunks, {direct} connections",
            names[i]
        );
    }

    // A proxyless gRPC client of a replica that does not own alpha reaches every
    // backend of alpha.
    let service = "alpha";
    let first = KEYS.owner(&etcd, service).expect("alpha has an owner");
    let watcher = names
        .iter()
        .position(|n| *n != first)
        .expect("another replica");
    let mut client = XdsClient::start(
        &replicas[watcher].xds(),
        service,
        "relay-client",
        None,
        dir.path(),
    );
    // Enough calls that the lightest backend (1 of 55 shares of the weight) is
    // reached: about 18 of them.
    let warm = client.round(1000, Duration::from_secs(30));
    assert!(
        warm.errors.is_empty() && warm.counts.len() == PER_SERVICE,
        "before the kill: {warm:?}\n{}",
        client.stderr_tail()
    );

    // A few more writes of alpha give a normal cycle's change.
    let before_count = KEYS.history(&watch, service).len();
    wait_for(
        Duration::from_secs(30),
        "three more writes of alpha",
        || {
            let n = KEYS.history(&watch, service).len();
            (n >= before_count + 3)
                .then_some(())
                .ok_or(format!("{n} writes"))
        },
    );
    let before = KEYS.history(&watch, service);
    let normal = before
        .windows(2)
        .rev()
        .take(5)
        .map(|w| largest_change(&w[0], &w[1]))
        .fold(0.0, f64::max);
    let statuses: Vec<_> = agents.iter().map(|a| a.status()).collect();
    let rehomed_before: f64 = relays
        .iter()
        .map(|r| r.counter("ballast_relay_rehomed_total", &[]))
        .sum();
    // Every service the victim owns moves, not only alpha: the relays must rehome the
    // agents of each of them, so that one service's agents cannot stand in for
    // another's in the count.
    let moving = SERVICES
        .iter()
        .filter(|s| KEYS.owner(&etcd, s).as_deref() == Some(first.as_str()))
        .count();

    // SIGKILL alpha's owner.
    let victim = names
        .iter()
        .position(|n| *n == first)
        .expect("the owner is a replica");
    let last = KEYS.stored(&etcd, service).expect("stored");
    replicas[victim].kill();
    let killed = Instant::now();
    let next = KEYS.new_owner(&etcd, service, &first);
    let took = killed.elapsed();
    // The lease lapses at most its time to live after the last renewal; the goal is
    // the time to live and two cycles, and 1 s more for a loaded 2-core machine.
    let bound = LEASE_TTL + 2 * CYCLE + Duration::from_secs(1);
    assert!(
        took <= bound,
        "alpha went to {next} {took:?} after its owner {first} died (bound {bound:?})"
    );
    let resumed = wait_for(
        Duration::from_secs(20),
        "alpha written by its new owner",
        || {
            let s = KEYS.stored(&etcd, service).ok_or("not stored")?;
            (s.version > last.version)
                .then_some(s.clone())
                .ok_or(format!("version {} cycle {}", s.version, s.cycle))
        },
    );
    let jump = largest_change(&last, &resumed);
    let allowed = (3.0 * normal).max(0.1);
    assert!(
        jump <= allowed,
        "weights moved by {jump:.3} across the failover (a normal cycle: {normal:.3})"
    );
    if let Err(w) = converged_to_speeds(&resumed, PER_SERVICE) {
        panic!("weights reset across the failover: {w}");
    }
    eprintln!(
        "relayed failover: {first} killed, {next} owns alpha after {took:?}; weights moved \
         by at most {jump:.3} (a normal cycle: {normal:.3})"
    );

    // Its agents never left their relays: same relay, no failed connection attempt,
    // and their weights keep coming (from the new owner, through the relay).
    let relayed = |a: &Agent| a.node().starts_with("alpha");
    for (a, before) in agents.iter().zip(&statuses).filter(|(a, _)| relayed(a)) {
        let now = a.status();
        assert_eq!(
            now.connected_to,
            before.connected_to,
            "{} changed connection across the failover; the relays' logs:\n{}\n{}",
            a.node(),
            relays[0].log_tail(40),
            relays[1].log_tail(40)
        );
        assert_eq!(
            now.connect_failures,
            before.connect_failures,
            "{} failed to connect across the failover",
            a.node()
        );
    }
    let rehomed: f64 = relays
        .iter()
        .map(|r| r.counter("ballast_relay_rehomed_total", &[]))
        .sum();
    let expected = moving * PER_SERVICE;
    eprintln!(
        "relayed failover: {moving} services moved with their owner, {} agents rehomed",
        rehomed - rehomed_before
    );
    assert!(
        rehomed >= rehomed_before + expected as f64,
        "the relays rehomed {} agents, not the {expected} of the {moving} services \
         its owner held",
        rehomed - rehomed_before
    );
    wait_for(
        Duration::from_secs(20),
        "alpha's agents weighted by the new owner",
        || {
            for a in agents.iter().filter(|a| relayed(a)) {
                let s = a.status();
                let fresh = s.weight_cycle.is_some_and(|c| c > resumed.cycle);
                if !fresh {
                    return Err(format!("{}: cycle {:?}", a.node(), s.weight_cycle));
                }
            }
            Ok(())
        },
    );

    // The gRPC client sees the new owner's versions: a drain published by the new
    // owner takes the drained backend out of its calls.
    // The heaviest backend (10 of 55 shares): a round without it means the drain.
    let drained = &alpha_nodes[PER_SERVICE - 1];
    let drainer = agents
        .iter()
        .find(|a| a.node() == drained)
        .expect("the agent");
    assert!(drainer.drain().ok, "drain refused");
    wait_for(
        Duration::from_secs(30),
        "the client of a non-owner to stop calling the drained backend",
        || {
            let probe = client.round(200, Duration::from_secs(5));
            if probe.errors.is_empty() && !probe.counts.contains_key(drained.as_str()) {
                Ok(())
            } else {
                Err(format!("{probe:?}"))
            }
        },
    );

    // One writer at a time: every service's stored versions only ever grow.
    for service in SERVICES {
        KEYS.assert_one_writer(&watch, service);
    }
    eprintln!(
        "relayed failover: drain seen by the gRPC client {:?} after the kill",
        killed.elapsed()
    );
}

#[test]
fn a_killed_relays_agents_go_on_through_the_other() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("temporary directory");
    let names = ["r0", "r1"];
    let replicas: Vec<Aggregator> = names.iter().map(|r| replica(&pki, &etcd, r)).collect();
    let mut relays = [
        relay(&pki, &replicas, "relay-a"),
        relay(&pki, &replicas, "relay-b"),
    ];
    let watch = etcd.watch(&format!("{PREFIX}/services/"));
    let alpha_nodes: Vec<String> = (0..PER_SERVICE).map(|i| format!("alpha-{i}")).collect();
    let backends = Backends::start(
        &alpha_nodes.iter().map(String::as_str).collect::<Vec<_>>(),
        dir.path(),
    );
    let agents = fleet(&pki, &replicas[0], &relays, &backends);
    KEYS.wait_balanced(&etcd, &SERVICES, PER_SERVICE, Duration::from_secs(90));
    let survivor = relays[1].quic_addr().to_string();

    relays[0].kill();
    let killed = Instant::now();
    for a in &agents {
        wait_for(
            Duration::from_secs(15),
            &format!("{} through the other relay", a.node()),
            || {
                let s = a.status();
                (s.connected_to.as_deref() == Some(survivor.as_str()))
                    .then_some(())
                    .ok_or(format!("{:?}", s.connected_to))
            },
        );
    }
    eprintln!(
        "relay killed: every agent through the other relay {:?} later",
        killed.elapsed()
    );
    // The replicas let go of the dead relay's slots, and hold one per agent again.
    wait_for(
        Duration::from_secs(15),
        "twelve slots on one relay's trunks",
        || {
            let slots = total(&replicas, None, "ballast_trunk_slots");
            let trunks = total(&replicas, None, "ballast_trunks_open");
            (slots == (SERVICES.len() * PER_SERVICE) as f64 && trunks <= names.len() as f64)
                .then_some(())
                .ok_or(format!("{slots} slots on {trunks} trunks"))
        },
    );
    // And every service goes on being balanced and written.
    let writes: Vec<usize> = SERVICES
        .iter()
        .map(|s| KEYS.history(&watch, s).len())
        .collect();
    wait_for(
        Duration::from_secs(20),
        "every service written again",
        || {
            for (s, n) in SERVICES.iter().zip(&writes) {
                let h = KEYS.history(&watch, s);
                let last = h.last().ok_or("not stored")?;
                if h.len() < n + 2 {
                    return Err(format!("{s}: {} writes", h.len()));
                }
                converged_to_speeds(last, PER_SERVICE)?;
            }
            Ok(())
        },
    );
}

#[test]
fn an_agent_no_replica_takes_within_the_hold_is_closed_with_moved_and_moves_on() {
    require_etcd();
    // The shipped hold: the test runs in about 20 s with it.
    const HOLD: Duration = Duration::from_millis(10_000);
    let etcd = Etcd::start();
    let pki = Pki::new();
    let mut owner = replica(&pki, &etcd, "r0");
    let relays = [
        relay(&pki, std::slice::from_ref(&owner), "relay-a"),
        relay(&pki, std::slice::from_ref(&owner), "relay-b"),
    ];
    let addrs: Vec<String> = relays.iter().map(|r| r.quic_addr().to_string()).collect();
    // One agent, told of both relays: relay-a first, but it goes on to relay-b if
    // relay-a had no routes yet.
    let agents = cluster::fleet(&pki, &owner, &addrs, &["alpha"], 1, |_| None);
    let status = agents[0].wait_weight(Duration::from_secs(20));
    let at = addrs
        .iter()
        .position(|a| status.connected_to.as_ref() == Some(a))
        .unwrap_or_else(|| panic!("not through a relay: {status:?}"));
    let (holding, next) = (&relays[at], &relays[1 - at]);
    let moved = |r: &Relay| r.counter("ballast_connections_rejected_total", &[("reason", "moved")]);
    // No replica is left to tell the relays the owner is gone: their routes still
    // name it, and its trunk is down (`trunk_down`); a relay that never heard of an
    // owner refuses with `no_owner`. Either way no replica takes the agent.
    let refused = |r: &Relay| {
        ["no_owner", "trunk_down"]
            .iter()
            .map(|reason| r.counter("ballast_relay_attach_refused_total", &[("reason", reason)]))
            .sum::<f64>()
    };

    // The only replica stops: its buckets go to nobody, and the relay holds the agent,
    // answering it from its last reply, for the hold; then closes it with MOVED.
    let (stopped, killed) = owner.stop();
    assert!(
        stopped.success() && !killed,
        "stop: {stopped}, killed {killed}"
    );
    let since = Instant::now();
    std::thread::sleep(HOLD - Duration::from_secs(2));
    assert_eq!(moved(holding), 0.0, "closed before the hold ran out");
    let s = agents[0].status();
    assert_eq!(s.connected_to, status.connected_to, "held: {s:?}");
    let before = refused(next);
    wait_for(
        Duration::from_secs(8),
        "the relay closes the agent with MOVED",
        || {
            let n = moved(holding);
            (n == 1.0).then_some(()).ok_or(format!("{n} closed"))
        },
    );
    eprintln!(
        "the owner stopped: the agent closed with MOVED {:?} later",
        since.elapsed()
    );
    assert!(
        holding.counter(
            "ballast_relay_reports_dropped_total",
            &[("reason", "failover")]
        ) >= 1.0
    );
    // The agent moves on to its next address, the other relay, which finds no live
    // owner either.
    wait_for(
        Duration::from_secs(10),
        "the agent tries the other relay",
        || {
            let n = refused(next) - before;
            (n >= 1.0).then_some(()).ok_or(format!("{n} refused"))
        },
    );
}

#[test]
fn a_new_replica_takes_its_buckets_and_only_their_agents_move_to_it() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("temporary directory");
    let names = ["r0", "r1", "r2"];
    let mut replicas: Vec<Aggregator> = names.iter().map(|r| replica(&pki, &etcd, r)).collect();
    let relays = [
        relay(&pki, &replicas, "relay-a"),
        relay(&pki, &replicas, "relay-b"),
    ];
    let watch = etcd.watch(&format!("{PREFIX}/services/"));
    let alpha_nodes: Vec<String> = (0..PER_SERVICE).map(|i| format!("alpha-{i}")).collect();
    let backends = Backends::start(
        &alpha_nodes.iter().map(String::as_str).collect::<Vec<_>>(),
        dir.path(),
    );
    let agents = fleet(&pki, &replicas[0], &relays, &backends);
    KEYS.wait_balanced(&etcd, &SERVICES, PER_SERVICE, Duration::from_secs(90));

    // A fourth replica whose name rendezvous hashing ranks first for some of the
    // services' buckets, not all: the names fix which.
    let owner_among = |members: &[&str], service: &str| {
        preferred(members.iter().copied(), bucket_of(service, KEYS.buckets))
            .expect("a member")
            .to_string()
    };
    let newcomer = (3..40)
        .map(|i| format!("r{i}"))
        .find(|n| {
            let four = [names[0], names[1], names[2], n.as_str()];
            let won = SERVICES
                .iter()
                .filter(|s| owner_among(&four, s) == *n)
                .count();
            won > 0 && won < SERVICES.len()
        })
        .expect("a name that wins some services");
    let four = [names[0], names[1], names[2], newcomer.as_str()];
    let moving: Vec<&str> = SERVICES
        .iter()
        .copied()
        .filter(|s| owner_among(&four, s) == newcomer)
        .collect();
    let statuses: Vec<_> = agents.iter().map(|a| a.status()).collect();
    let rehomed = || -> f64 {
        relays
            .iter()
            .map(|r| r.counter("ballast_relay_rehomed_total", &[]))
            .sum()
    };
    let rehomed_before = rehomed();
    let writes: Vec<usize> = SERVICES
        .iter()
        .map(|s| KEYS.history(&watch, s).len())
        .collect();

    replicas.push(replica(&pki, &etcd, &newcomer));
    for service in SERVICES {
        let want = owner_among(&four, service);
        wait_for(
            Duration::from_secs(30),
            &format!("{service} owned by {want}"),
            || match KEYS.owner(&etcd, service) {
                Some(o) if o == want => Ok(()),
                o => Err(format!("{o:?}")),
            },
        );
    }
    // The moved services are balanced and written by the newcomer, with the weights
    // they had, and every service goes on being written.
    wait_for(
        Duration::from_secs(30),
        "every service written again",
        || {
            for (s, n) in SERVICES.iter().zip(&writes) {
                let h = KEYS.history(&watch, s);
                let last = h.last().ok_or("not stored")?;
                if h.len() < n + 2 {
                    return Err(format!("{s}: {} writes", h.len()));
                }
                converged_to_speeds(last, PER_SERVICE).map_err(|e| format!("{s}: {e}"))?;
            }
            Ok(())
        },
    );
    // The relays rehomed exactly the moved services' agents; no agent left its relay.
    let moved_agents = (moving.len() * PER_SERVICE) as f64;
    wait_for(
        Duration::from_secs(15),
        "the moved services' agents rehomed",
        || {
            let n = rehomed() - rehomed_before;
            (n == moved_agents)
                .then_some(())
                .ok_or(format!("{n} rehomed, {moved_agents} to move"))
        },
    );
    for (a, before) in agents.iter().zip(&statuses) {
        let now = a.status();
        assert_eq!(
            (now.connected_to.as_ref(), now.connect_failures),
            (before.connected_to.as_ref(), before.connect_failures),
            "{} changed connection when {newcomer} joined",
            a.node()
        );
    }
    let slots = replicas
        .last()
        .expect("the newcomer")
        .counter("ballast_trunk_slots", &[]);
    assert_eq!(
        slots, moved_agents,
        "{newcomer} holds {slots} agents, not the {moved_agents} of {moving:?}"
    );
    for service in SERVICES {
        KEYS.assert_one_writer(&watch, service);
    }
    eprintln!("a new replica: {newcomer} took {moving:?}; {moved_agents} agents rehomed");
}

/// Families only an aggregator has: a relay balances nothing, stores nothing, serves no
/// xDS, watch or API, and owns no buckets.
const AGGREGATOR_FAMILIES: [&str; 9] = [
    "ballast_cycle",
    "ballast_endpoints_",
    "ballast_store_",
    "ballast_xds_",
    "ballast_http_",
    "ballast_watch_",
    "ballast_config_",
    "ballast_cluster_",
    "ballast_service_",
];

#[test]
fn ballast_relay_and_its_deprecated_alias_run_the_same_relay_with_only_relay_metrics() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let replica = replica(&pki, &etcd, "r0");
    let relays = [
        relay(&pki, std::slice::from_ref(&replica), "relay-a"),
        Relay::start(
            &pki,
            RelayOpts::new("relay-b", &[&replica]).aggregator_alias(),
        ),
    ];
    let addrs: Vec<String> = relays.iter().map(|r| r.quic_addr().to_string()).collect();
    // Each agent told of one relay only: both relays carry agents.
    let mut agents = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        agents.extend(cluster::fleet_with(
            &pki,
            &replica,
            std::slice::from_ref(addr),
            &[SERVICES[i]],
            2,
            |_, opts| opts,
        ));
    }
    KEYS.wait_balanced(&etcd, &SERVICES[..2], 2, Duration::from_secs(60));

    let alias_log = relays[1].log_tail(400);
    assert!(
        alias_log.contains("`ballast-aggregator relay` is deprecated")
            && alias_log.contains("run `ballast-relay`"),
        "the alias did not say it is deprecated:\n{alias_log}"
    );
    assert!(
        !relays[0].log_tail(400).contains("deprecated"),
        "ballast-relay itself says it is deprecated"
    );
    for r in &relays {
        let text = r.metrics();
        assert!(
            r.counter("ballast_relay_reports_forwarded_total", &[]) > 0.0,
            "{}: no reports forwarded:\n{text}",
            r.name()
        );
        assert_eq!(
            r.counter("ballast_connections_open", &[]),
            2.0,
            "{}",
            r.name()
        );
        // Samples, and the descriptions of families that have none yet.
        let foreign: Vec<&str> = text
            .lines()
            .map(|l| {
                l.strip_prefix("# TYPE ")
                    .or_else(|| l.strip_prefix("# HELP "))
                    .unwrap_or(l)
            })
            .filter(|l| AGGREGATOR_FAMILIES.iter().any(|f| l.starts_with(f)))
            .collect();
        assert!(
            foreign.is_empty(),
            "{}'s /metrics carries an aggregator's families: {foreign:?}",
            r.name()
        );
    }
    drop(agents);
}
