//! Scenario: HAProxy splits requests by the weights Ballast's agents hand it through
//! the agent-check.
//!
//! A real aggregator (500 ms cycles), three real HTTP backends, and for each a real
//! `ballast-agent` that registers the backend's address, runs the synthetic source
//! with speed 0.6, 1.0 or 1.5 and answers HAProxy's agent-check (`--agent-check`).
//! Debian's HAProxy 2.6 balances round robin over the three servers (`weight 100`,
//! `agent-check agent-inter 500ms`). Then:
//!
//! 1. once the weights have converged, HAProxy's weights (`srv_uweight` from
//!    `show servers state` on its runtime API) equal the aggregator's
//!    `haproxy_percent` (capped at 256) within ±2;
//! 2. 3000 requests from a Rust client (4 connections, `Connection: close`, 1000
//!    requests/s) through HAProxy split across the backends by those weights: each
//!    backend's share is within 0.05 of its weight's share, both the aggregator's and
//!    HAProxy's own (sampled every 100 ms and averaged over the round), and each
//!    backend counted exactly the requests the client saw it answer;
//! 3. after `ballast-agent drain`, HAProxy shows that server in DRAIN (admin state
//!    bit 0x08, effective weight 0), and a second round gives it no request while the
//!    other two split by their weights;
//! 4. after `ballast-agent undrain`, it comes back: ready, with a weight above 0 that
//!    again matches the aggregator's once the controllers settle, and a third round
//!    splits by the weights again with its share;
//! 5. when the aggregator dies, each agent's weight goes stale after 5 report
//!    intervals and it answers `ready up 100%`: HAProxy falls back to equal weights
//!    (plain round robin), draining nothing.
//!
//! Two more tests take HAProxy's cap on a server's weight (256):
//! - a fleet whose fastest node earns a weight above 2.56 × the mean: HAProxy holds it
//!   at 256 while its agent asks for more, and the requests split by HAProxy's capped
//!   weights, visibly short of the aggregator's; then that agent is killed, and HAProxy,
//!   failing to reach it, keeps the server up at its last weight and the split as it
//!   was;
//! - the worked example of `docs/feeds.md`: each row's percentage, set on a real
//!   HAProxy with the configured weights 100 and 25, gives the weights and the shares
//!   of requests the table says.
//!
//! Needs Debian's `haproxy` package; the tests fail, naming it, when it is missing.

use ballast_tests::harness::haproxy::request;
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use std::collections::BTreeMap;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SERVICE: &str = "hap";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];
/// Requests in a measured round.
const REQUESTS: u32 = 3000;
/// Concurrent client connections.
const CLIENTS: usize = 4;
/// The client's request rate. A round then spans several agent-check intervals, like
/// steady traffic: HAProxy's round robin repositions a server when its weight
/// changes, so the split of the few hundred requests right after a change can stray
/// from the weights by several percent; over seconds it follows them.
const RATE_PER_SEC: f64 = 1000.0;
/// How long a round may take.
const ROUND_LIMIT: Duration = Duration::from_secs(20);
/// How far a backend's share of the requests may be from its weight's share.
/// Round robin follows the weights in force exactly; the slack is for the weights
/// moving (a few percent per cycle) during the round.
const TOLERANCE: f64 = 0.05;
/// How far HAProxy's weight may be from the aggregator's percentage: the agent's
/// weight and HAProxy's agent-check each lag by up to an interval.
const WEIGHT_SLACK: i64 = 2;
/// HAProxy's cap on a server's effective weight.
const HAPROXY_MAX_WEIGHT: u32 = 256;

/// The weight the aggregator tells HAProxy to use for `e`: its percentage of the
/// configured weight 100; 0 while draining. Not capped: where HAProxy's cap of 256
/// flattens a weight, HAProxy no longer follows the aggregator, and the test of the
/// cap shows by how much.
fn aggregator_haproxy_weight(e: &ballast_tests::harness::api::WeightEntry) -> u32 {
    if e.draining {
        0
    } else {
        e.haproxy_percent
    }
}

fn shares<'a>(weights: impl Iterator<Item = (&'a String, u32)>) -> BTreeMap<String, f64> {
    let weights: Vec<(&String, u32)> = weights.collect();
    let total: f64 = weights.iter().map(|(_, w)| f64::from(*w)).sum();
    weights
        .into_iter()
        .map(|(n, w)| {
            let share = if total > 0.0 {
                f64::from(w) / total
            } else {
                0.0
            };
            (n.clone(), share)
        })
        .collect()
}

/// The aggregator's weight shares, as HAProxy should apply them.
fn aggregator_shares(w: &WeightSet) -> BTreeMap<String, f64> {
    shares(
        w.weights
            .iter()
            .map(|(n, e)| (n, aggregator_haproxy_weight(e))),
    )
}

/// HAProxy's own weight shares (0 for a server in drain, maintenance or down).
fn haproxy_shares(s: &BTreeMap<String, ServerState>) -> BTreeMap<String, f64> {
    shares(s.iter().map(|(n, st)| (n, st.effective_weight())))
}

/// Ok when every server's HAProxy weight is the aggregator's, within the slack, and
/// its readiness matches the aggregator's drain flag.
fn weights_match(w: &WeightSet, s: &BTreeMap<String, ServerState>) -> Result<String, String> {
    let mut table = String::new();
    let mut ok = w.weights.len() == s.len();
    for (node, e) in &w.weights {
        let want = aggregator_haproxy_weight(e);
        let Some(st) = s.get(node) else {
            ok = false;
            table.push_str(&format!("  {node}: not a HAProxy server\n"));
            continue;
        };
        let state_ok = if e.draining {
            st.draining()
        } else {
            st.ready()
        };
        let weight_ok =
            e.draining || (i64::from(st.uweight) - i64::from(want)).abs() <= WEIGHT_SLACK;
        ok &= state_ok && weight_ok;
        table.push_str(&format!(
            "  {node}: aggregator weight {:.3} → {}%{} | HAProxy uweight {} admin {:#x} op {}\n",
            e.weight,
            e.haproxy_percent,
            if e.draining { " (draining)" } else { "" },
            st.uweight,
            st.admin_state,
            st.op_state
        ));
    }
    if ok {
        Ok(table)
    } else {
        Err(format!("\n{table}"))
    }
}

/// Sends `n` requests at [`RATE_PER_SEC`] without measuring them. HAProxy's round
/// robin only moves on when it picks servers, so after a large weight change (a drain,
/// a ramp) it owes the changed servers part of a rotation; this traffic settles that
/// before a round is measured.
fn warm_up(hap: &Haproxy, n: u32) {
    let started = Instant::now();
    for i in 0..n {
        let slot = started + Duration::from_secs_f64(f64::from(i) / RATE_PER_SEC);
        std::thread::sleep(slot.saturating_duration_since(Instant::now()));
        request(hap.frontend()).unwrap_or_else(|e| panic!("warm-up request failed: {e}"));
        assert!(
            started.elapsed() < ROUND_LIMIT,
            "warm-up: {i} requests took over {ROUND_LIMIT:?}"
        );
    }
}

/// What one round of requests gave, with the weights sampled while it ran.
struct Round {
    sent: u32,
    counts: BTreeMap<String, u32>,
    errors: BTreeMap<String, u32>,
    seconds: f64,
    /// The aggregator's shares, averaged over the round.
    aggregator: BTreeMap<String, f64>,
    /// HAProxy's shares, averaged over the round.
    haproxy: BTreeMap<String, f64>,
    versions: Vec<u64>,
}

/// Sends `n` requests through HAProxy from [`CLIENTS`] threads at
/// [`RATE_PER_SEC`], within [`ROUND_LIMIT`], while sampling both sides' weights
/// every 100 ms.
fn round(agg: &Aggregator, hap: &Haproxy, n: u32) -> Round {
    let next = AtomicU32::new(0);
    let done = AtomicBool::new(false);
    let counts: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());
    let errors: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());
    let frontend = hap.frontend();
    let started = Instant::now();
    let deadline = started + ROUND_LIMIT;
    let (agg_samples, hap_samples) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut a = Vec::new();
            let mut h = Vec::new();
            loop {
                a.push(agg.weights(SERVICE));
                h.push(hap.show_servers_state());
                if done.load(Ordering::Relaxed) {
                    return (a, h);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let slot = started + Duration::from_secs_f64(f64::from(i) / RATE_PER_SEC);
                    if slot >= deadline {
                        break;
                    }
                    std::thread::sleep(slot.saturating_duration_since(Instant::now()));
                    match request(frontend) {
                        Ok(name) => *counts.lock().unwrap().entry(name).or_default() += 1,
                        Err(e) => *errors.lock().unwrap().entry(e).or_default() += 1,
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().expect("client thread");
        }
        done.store(true, Ordering::Relaxed);
        sampler.join().expect("sampler thread")
    });
    let seconds = started.elapsed().as_secs_f64();
    let counts = counts.into_inner().unwrap();
    let errors = errors.into_inner().unwrap();
    let sent = counts.values().sum::<u32>() + errors.values().sum::<u32>();
    let mut aggregator: BTreeMap<String, f64> = BTreeMap::new();
    for w in &agg_samples {
        for (node, share) in aggregator_shares(w) {
            *aggregator.entry(node).or_default() += share / agg_samples.len() as f64;
        }
    }
    let mut haproxy: BTreeMap<String, f64> = BTreeMap::new();
    for st in &hap_samples {
        for (node, share) in haproxy_shares(st) {
            *haproxy.entry(node).or_default() += share / hap_samples.len() as f64;
        }
    }
    let mut versions: Vec<u64> = agg_samples.iter().map(|w| w.version).collect();
    versions.dedup();
    Round {
        sent,
        counts,
        errors,
        seconds,
        aggregator,
        haproxy,
        versions,
    }
}

impl Round {
    /// The share of the round's answered requests that `node` served.
    fn share(&self, node: &str) -> f64 {
        let total: u32 = self.counts.values().sum();
        f64::from(self.counts.get(node).copied().unwrap_or(0)) / f64::from(total.max(1))
    }

    /// The table of request shares against both weight shares, and the largest
    /// difference from the aggregator's and from HAProxy's.
    fn compare(&self) -> (String, f64, f64) {
        let mut table = String::new();
        let (mut worst_agg, mut worst_hap): (f64, f64) = (0.0, 0.0);
        for (node, want) in &self.aggregator {
            let got = self.share(node);
            let hap = self.haproxy.get(node).copied().unwrap_or(0.0);
            worst_agg = worst_agg.max((got - want).abs());
            worst_hap = worst_hap.max((got - hap).abs());
            table.push_str(&format!(
                "  {node}: requests {got:.3} ({}), aggregator weights {want:.3}, \
                 HAProxy weights {hap:.3}, diff {:+.3}\n",
                self.counts.get(node).copied().unwrap_or(0),
                got - want
            ));
        }
        for node in self
            .counts
            .keys()
            .filter(|n| !self.aggregator.contains_key(*n))
        {
            table.push_str(&format!("  {node}: answered but is not an endpoint!\n"));
            worst_agg = 1.0;
        }
        (table, worst_agg, worst_hap)
    }

    /// Prints the round and asserts every one of its `n` requests was answered;
    /// returns [`Round::compare`]'s table and differences.
    fn answered(&self, what: &str, n: u32) -> (String, f64, f64) {
        let (table, worst_agg, worst_hap) = self.compare();
        eprintln!(
            "{what}: {n} requests in {:.1} s, weight versions {:?}\n{table}",
            self.seconds, self.versions
        );
        assert_eq!(
            self.sent, n,
            "{what}: only {} requests within {ROUND_LIMIT:?}",
            self.sent
        );
        assert!(
            self.errors.is_empty(),
            "{what}: failed requests: {:?}",
            self.errors
        );
        (table, worst_agg, worst_hap)
    }

    /// Asserts every request was answered, and the split follows the weights.
    fn check(&self, what: &str, n: u32) -> String {
        let (table, worst_agg, worst_hap) = self.answered(what, n);
        assert!(
            worst_agg <= TOLERANCE,
            "{what}: the split is off the aggregator's weights by {worst_agg:.3} > {TOLERANCE}:\n{table}"
        );
        assert!(
            worst_hap <= TOLERANCE,
            "{what}: the split is off HAProxy's own weights by {worst_hap:.3} > {TOLERANCE}:\n{table}"
        );
        table
    }
}

/// Polls until the controllers have settled after cycle `since` (the last three
/// cycles, all later than `since`, updated weights and left max/avg ≤ 1.08) and
/// HAProxy's weights match the aggregator's: a round is then measured against weights
/// that do not move much while it runs.
fn wait_settled(
    agg: &Aggregator,
    hap: &Haproxy,
    since: u64,
    timeout: Duration,
    what: &str,
) -> WeightSet {
    wait_for(timeout, what, || {
        let d = agg.service(SERVICE);
        let from = d.history.len().saturating_sub(3);
        let recent = &d.history[from..];
        let settled = recent.len() == 3
            && recent
                .iter()
                .all(|h| h.cycle > since && !h.skipped && h.spread.max_over_avg <= 1.08);
        if !settled {
            return Err(format!(
                "since cycle {since}: max/avg {}",
                d.recent_max_over_avg(5)
            ));
        }
        let w = agg.weights(SERVICE);
        let s = hap.show_servers_state();
        weights_match(&w, &s).map(|table| {
            eprintln!("{what}: version {}\n{table}", w.version);
            w
        })
    })
}

/// Waits until the aggregator publishes `node` as draining (or not) and returns the
/// latest cycle then.
fn wait_published_drain(agg: &Aggregator, node: &str, draining: bool) -> u64 {
    wait_for(
        Duration::from_secs(10),
        &format!("the aggregator to publish {node} with draining = {draining}"),
        || {
            let w = agg.weights(SERVICE);
            match w.weights.get(node) {
                Some(e) if e.draining == draining => {
                    Ok(agg.service(SERVICE).history.last().map_or(0, |h| h.cycle))
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
}

/// Polls until HAProxy's weights match the aggregator's; returns both.
fn wait_weights_match(
    agg: &Aggregator,
    hap: &Haproxy,
    timeout: Duration,
    what: &str,
) -> (WeightSet, BTreeMap<String, ServerState>) {
    wait_for(timeout, what, || {
        let w = agg.weights(SERVICE);
        let s = hap.show_servers_state();
        weights_match(&w, &s).map(|table| {
            eprintln!("{what}: version {}\n{table}", w.version);
            (w, s)
        })
    })
}

/// An aggregator (500 ms cycles), a real HTTP backend per speed, for each a real agent
/// that registers the backend's address, runs the synthetic source at that speed and
/// answers the agent-check on its own port, and HAProxy balancing over the backends.
struct Fleet {
    pki: Pki,
    agg: Aggregator,
    nodes: Vec<String>,
    backends: Vec<Backend>,
    agents: Vec<Agent>,
    hap: Haproxy,
}

impl Fleet {
    fn start(speeds: &[f64]) -> Fleet {
        let pki = Pki::new();
        let agg = Aggregator::start(&pki, AggregatorOpts::default());
        let nodes = node_names(SERVICE, speeds.len());
        let backends: Vec<Backend> = nodes.iter().map(|n| Backend::start(n)).collect();
        let checks: Vec<SocketAddr> = nodes
            .iter()
            .map(|_| SocketAddr::from(([127, 0, 0, 1], free_tcp())))
            .collect();
        let agents = start_speeds(&pki, &agg, SERVICE, &nodes, speeds, |i, opts| {
            opts.agent_check = Some(checks[i]);
            opts.address = Some(backends[i].addr.to_string());
        });
        let servers: Vec<(&str, SocketAddr, SocketAddr)> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), backends[i].addr, checks[i]))
            .collect();
        let hap = Haproxy::start(0, &servers, &HaproxyOpts::default());
        Fleet {
            pki,
            agg,
            nodes,
            backends,
            agents,
            hap,
        }
    }
}

#[test]
fn haproxy_applies_the_agents_weights_and_drain() {
    require_haproxy();
    let started = Instant::now();
    let Fleet {
        pki: _pki,
        agg,
        nodes,
        backends,
        agents,
        hap,
    } = Fleet::start(&SPEEDS);

    // The controllers converge: the weights then sit near the speeds' ratios.
    wait_for(Duration::from_secs(30), "weights to converge", || {
        let w = agg.weights(SERVICE);
        let pct: Vec<u32> = w.weights.values().map(aggregator_haproxy_weight).collect();
        converged(&agg, SERVICE, 8, 1.08).map_err(|e| format!("{e}, percentages {pct:?}"))?;
        let (lo, hi) = (
            pct.iter().copied().min().unwrap_or(0),
            pct.iter().copied().max().unwrap_or(0),
        );
        if w.weights.len() == SPEEDS.len() && hi >= lo * 2 {
            Ok(())
        } else {
            Err(format!("percentages {pct:?}"))
        }
    });

    // 1. HAProxy's weights are the aggregator's.
    let (w, s) = wait_weights_match(
        &agg,
        &hap,
        Duration::from_secs(15),
        "HAProxy's weights to match the aggregator's",
    );
    for (node, st) in &s {
        assert_eq!(st.iweight, 100, "{node}: configured weight");
        assert_eq!(
            backends
                .iter()
                .find(|b| &b.name == node)
                .map(|b| b.addr.to_string()),
            Some(w.weights[node].address.clone()),
            "{node}: the agent registered its backend's address"
        );
    }
    let uw: Vec<u32> = s.values().map(|st| st.uweight).collect();
    assert!(
        uw.iter().max() >= Some(&(uw.iter().min().copied().unwrap_or(0) * 2)),
        "HAProxy's weights do not reflect the speeds: {uw:?}"
    );

    // 2. The split of real requests follows the weights.
    let r1 = round(&agg, &hap, REQUESTS);
    r1.check("round 1", REQUESTS);
    for (b, node) in backends.iter().zip(&nodes) {
        assert_eq!(
            b.requests(),
            u64::from(r1.counts.get(node).copied().unwrap_or(0)),
            "{node}: requests counted by the backend and by the client differ"
        );
    }

    // 3. Drain the heaviest backend: HAProxy puts it in DRAIN and sends it nothing.
    let d = SPEEDS.len() - 1;
    let drained = &nodes[d];
    agents[d].drain();
    let st = wait_for(
        Duration::from_secs(10),
        "HAProxy to put the drained server in DRAIN",
        || {
            let s = hap.show_servers_state();
            let st = &s[drained];
            if st.draining() && st.effective_weight() == 0 {
                Ok(st.clone())
            } else {
                Err(format!("{st:?}"))
            }
        },
    );
    eprintln!(
        "{drained} drained: admin state {:#x}, uweight {}",
        st.admin_state, st.uweight
    );
    let since = wait_published_drain(&agg, drained, true);
    wait_settled(
        &agg,
        &hap,
        since,
        Duration::from_secs(20),
        "the weights to settle and match with one server drained",
    );
    warm_up(&hap, 1000);
    let before = backends[d].requests();
    let r2 = round(&agg, &hap, REQUESTS / 2);
    let table2 = r2.check("round 2 (drained)", REQUESTS / 2);
    assert_eq!(
        r2.counts.get(drained).copied().unwrap_or(0),
        0,
        "the drained backend still got requests:\n{table2}"
    );
    assert_eq!(
        backends[d].requests(),
        before,
        "the drained backend saw requests"
    );

    // 4. Undrain: it comes back with a weight, the aggregator's, and takes requests.
    agents[d].undrain();
    let st = wait_for(
        Duration::from_secs(10),
        "HAProxy to take the undrained server back",
        || {
            let s = hap.show_servers_state();
            let st = &s[drained];
            if st.ready() && st.uweight > 0 {
                Ok(st.clone())
            } else {
                Err(format!("{st:?}"))
            }
        },
    );
    eprintln!(
        "{drained} undrained: admin state {:#x}, uweight {}",
        st.admin_state, st.uweight
    );
    // It returns like a newcomer, at a small weight that ramps up: let it settle.
    let since = wait_published_drain(&agg, drained, false);
    wait_settled(
        &agg,
        &hap,
        since,
        Duration::from_secs(30),
        "the weights to settle and match after the undrain",
    );
    warm_up(&hap, 1000);
    let before = backends[d].requests();
    let r3 = round(&agg, &hap, REQUESTS / 2);
    let table3 = r3.check("round 3 (undrained)", REQUESTS / 2);
    assert!(
        backends[d].requests() > before,
        "the undrained backend got no request:\n{table3}"
    );

    // 5. The aggregator goes away: once their weights are stale, the agents answer
    //    the mean (`ready up 100%`), so HAProxy falls back to plain round robin
    //    instead of keeping old weights forever or draining the fleet.
    let mut agg = agg;
    agg.kill();
    let killed_at = Instant::now();
    let s = wait_for(
        Duration::from_secs(15),
        "HAProxy to fall back to equal weights after the aggregator died",
        || {
            let s = hap.show_servers_state();
            if s.values().all(|st| st.ready() && st.uweight == 100) {
                Ok(s)
            } else {
                Err(format!(
                    "{:?}",
                    s.values()
                        .map(|st| (st.uweight, st.admin_state))
                        .collect::<Vec<_>>()
                ))
            }
        },
    );
    eprintln!(
        "aggregator killed: HAProxy back at equal weights after {:.1} s",
        killed_at.elapsed().as_secs_f64()
    );
    for a in &agents {
        let st = a.status();
        assert!(
            st.weight.is_some(),
            "{}: still holds its last weight",
            a.node()
        );
    }
    let counts = {
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        for _ in 0..600 {
            let name = request(hap.frontend()).unwrap_or_else(|e| panic!("request failed: {e}"));
            *counts.entry(name).or_default() += 1;
        }
        counts
    };
    eprintln!(
        "aggregator gone: HAProxy weights {:?}, 600 requests split {counts:?}",
        s.values().map(|st| st.uweight).collect::<Vec<_>>()
    );
    for node in &nodes {
        let share = f64::from(counts.get(node).copied().unwrap_or(0)) / 600.0;
        assert!(
            (share - 1.0 / 3.0).abs() <= TOLERANCE,
            "{node}: share {share:.3} of the requests with equal weights: {counts:?}"
        );
    }
    eprintln!("scenario took {:.1} s", started.elapsed().as_secs_f64());
}

/// Speeds of a fleet whose fastest node earns three times the mean weight: 1 : 1 : 1 :
/// 9 over a mean of 1 is 0.33, 0.33, 0.33 and 3.0, so its agent answers `ready up
/// 300%`, above HAProxy's cap.
const CAPPED_SPEEDS: [f64; 4] = [1.0, 1.0, 1.0, 9.0];

#[test]
fn haproxy_caps_a_weight_above_256_and_the_split_follows_the_cap() {
    require_haproxy();
    let mut fleet = Fleet::start(&CAPPED_SPEEDS);
    let fast_node = fleet.nodes[CAPPED_SPEEDS.len() - 1].clone();
    let fast = &fast_node;
    let (agg, hap) = (&fleet.agg, &fleet.hap);

    // Converged, with the fast node's percentage well above the cap, and HAProxy
    // holding it at 256 while the others follow their agents.
    let (w, s) = wait_for(
        Duration::from_secs(40),
        "the fast node's weight above the cap, and HAProxy holding it at 256",
        || {
            converged(agg, SERVICE, 8, 1.08)?;
            let w = agg.weights(SERVICE);
            let s = hap.show_servers_state();
            let pct = w.weights.get(fast).map_or(0, |e| e.haproxy_percent);
            let table = weights_table(&w, &s);
            if pct < 280 {
                return Err(format!(
                    "{fast} at {pct} %, not yet well above 256:\n{table}"
                ));
            }
            for (node, e) in &w.weights {
                let st = s.get(node).ok_or_else(|| format!("{node}: no server"))?;
                let want = e.haproxy_percent.min(HAPROXY_MAX_WEIGHT);
                if !st.ready() || (i64::from(st.uweight) - i64::from(want)).abs() > WEIGHT_SLACK {
                    return Err(format!(
                        "{node}: HAProxy {} for {want}:\n{table}",
                        st.uweight
                    ));
                }
            }
            if s[fast].uweight != HAPROXY_MAX_WEIGHT {
                return Err(format!("{fast}: uweight {}:\n{table}", s[fast].uweight));
            }
            Ok((w, s))
        },
    );
    eprintln!("capped:\n{}", weights_table(&w, &s));
    let check = fleet.agents[CAPPED_SPEEDS.len() - 1]
        .opts()
        .agent_check
        .expect("an agent-check port");
    let line = read_agent_check(check);
    let asked: u32 = line
        .trim()
        .strip_prefix("ready up ")
        .and_then(|l| l.strip_suffix('%'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{fast}'s agent-check line: {line:?}"));
    assert!(
        asked > HAPROXY_MAX_WEIGHT,
        "{fast}'s agent asks HAProxy for {asked} %, not above the cap"
    );

    // The requests split by HAProxy's capped weights, not by the aggregator's.
    warm_up(hap, 500);
    let r = capped_round(agg, hap, "capped round");
    let got = r.share(fast);
    let uncapped = r.aggregator[fast];
    let capped = r.haproxy[fast];
    assert!(
        uncapped - capped >= 0.02,
        "the cap should cost {fast} a visible share: aggregator {uncapped:.3}, HAProxy \
         {capped:.3}"
    );
    assert!(
        uncapped - got >= (uncapped - capped) / 2.0,
        "{fast} got {got:.3} of the requests: its uncapped share ({uncapped:.3}), not the \
         capped one ({capped:.3})"
    );

    // The fast node's agent dies (SIGKILL) while it is not draining. HAProxy does not
    // count an agent it cannot reach as an error (docs/feeds.md): the server stays up,
    // with the last weight its agent gave, and keeps its share of the requests. The
    // aggregator, missing one node of four, holds the other weights meanwhile.
    fleet.agents[CAPPED_SPEEDS.len() - 1].kill();
    let (agg, hap) = (&fleet.agg, &fleet.hap);
    let agent_fails = || -> Result<String, String> {
        let status = hap.stat_column("agent_status")?;
        match status.get(fast.as_str()) {
            Some(s) if s.starts_with("L4") => Ok(s.clone()),
            other => Err(format!("{fast}'s agent check: {other:?}")),
        }
    };
    let failed = wait_for(
        Duration::from_secs(10),
        "HAProxy to find the fast node's agent gone",
        agent_fails,
    );
    let r = capped_round(agg, hap, &format!("with {fast}'s agent dead ({failed})"));
    // Throughout the round HAProxy went on trying the agent, and failing.
    let still = agent_fails().unwrap_or_else(|e| panic!("after the round: {e}"));
    let s = hap.show_servers_state();
    assert!(
        s[fast.as_str()].ready() && s[fast.as_str()].uweight == HAPROXY_MAX_WEIGHT,
        "{fast} with its agent dead ({still}): {:?}",
        s[fast.as_str()]
    );
    let got_dead = r.share(fast);
    assert!(
        (got_dead - capped).abs() <= CAPPED_TOLERANCE,
        "{fast} got {got_dead:.3} of the requests with its agent dead, {capped:.3} before"
    );
}

/// A round of requests through the capped fleet: every one answered, split by
/// HAProxy's own weights within [`CAPPED_TOLERANCE`].
fn capped_round(agg: &Aggregator, hap: &Haproxy, what: &str) -> Round {
    let r = round(agg, hap, REQUESTS);
    let (table, _, worst_hap) = r.answered(what, REQUESTS);
    assert!(
        worst_hap <= CAPPED_TOLERANCE,
        "{what}: the split is off HAProxy's own (capped) weights by {worst_hap:.3}:\n{table}"
    );
    r
}

/// How far a backend's share may be from HAProxy's weights in the test of the cap: the
/// weights hold still there (the fast node's is pinned at 256, the others move by a
/// point or two of 33), and HAProxy's round robin follows the weights in force.
const CAPPED_TOLERANCE: f64 = 0.02;

/// A table of the aggregator's percentages beside HAProxy's weights.
fn weights_table(w: &WeightSet, s: &BTreeMap<String, ServerState>) -> String {
    w.weights
        .iter()
        .map(|(node, e)| {
            format!(
                "  {node}: weight {:.3} → {} % | HAProxy uweight {}\n",
                e.weight,
                e.haproxy_percent,
                s.get(node).map_or(0, |st| st.uweight)
            )
        })
        .collect()
}

/// Reads one agent-check line from `addr`, as HAProxy does.
fn read_agent_check(addr: SocketAddr) -> String {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("agent-check {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    let mut line = String::new();
    s.take(256)
        .read_to_string(&mut line)
        .unwrap_or_else(|e| panic!("agent-check {addr}: {e}"));
    line
}

/// One row of the worked example's first table in `docs/feeds.md`.
#[derive(Debug)]
struct ExampleRow {
    endpoint: String,
    weight: f64,
    line: String,
    haproxy_weight: u32,
    haproxy_share: f64,
}

/// The worked example's first table, and the configured weight 25's weights from the
/// paragraph under it.
fn worked_example() -> (Vec<ExampleRow>, Vec<u32>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/feeds.md");
    let doc = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let section = doc
        .split("## Worked example")
        .nth(1)
        .expect("docs/feeds.md has a worked example");
    let rows: Vec<ExampleRow> = section
        .lines()
        .skip_while(|l| !l.starts_with("| Endpoint"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let c: Vec<&str> = l.split('|').map(str::trim).collect();
            let num = |s: &str| -> f64 {
                s.split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("not a number: {s:?} in {l}"))
            };
            ExampleRow {
                endpoint: c[1].to_string(),
                weight: num(c[2]),
                line: c[5].trim_matches('`').to_string(),
                haproxy_weight: num(c[6]) as u32,
                haproxy_share: num(c[7]),
            }
        })
        .collect();
    assert_eq!(rows.len(), 4, "the worked example's table: {rows:?}");
    let with_25: Vec<u32> = section
        .split("with `weight 25` the HAProxy\nweights would be ")
        .nth(1)
        .and_then(|t| t.split(" and").next())
        .map(|t| {
            t.split(", ")
                .map(|n| n.trim().parse().unwrap_or_else(|_| panic!("{n:?}")))
                .collect()
        })
        .expect("docs/feeds.md gives the weights under `weight 25`");
    (rows, with_25)
}

/// Sends `n` sequential requests and counts them by backend.
fn split(hap: &Haproxy, n: u32) -> BTreeMap<String, u32> {
    let mut counts = BTreeMap::new();
    let started = Instant::now();
    for i in 0..n {
        let name = request(hap.frontend()).unwrap_or_else(|e| panic!("request {i}: {e}"));
        *counts.entry(name).or_default() += 1;
        assert!(
            started.elapsed() < ROUND_LIMIT,
            "{i} requests took over {ROUND_LIMIT:?}"
        );
    }
    counts
}

#[test]
fn the_worked_example_of_the_cap_holds_on_a_real_haproxy() {
    require_haproxy();
    let (rows, with_25) = worked_example();
    for (configured, expected) in [
        (
            100u32,
            rows.iter().map(|r| r.haproxy_weight).collect::<Vec<_>>(),
        ),
        (25, with_25),
    ] {
        let backends: Vec<Backend> = rows.iter().map(|r| Backend::start(&r.endpoint)).collect();
        // No agent listens: HAProxy does not count an unreachable agent against a
        // server, so the weights stay as the runtime API sets them.
        let servers: Vec<(&str, SocketAddr, SocketAddr)> = rows
            .iter()
            .zip(&backends)
            .map(|(r, b)| {
                (
                    r.endpoint.as_str(),
                    b.addr,
                    SocketAddr::from(([127, 0, 0, 1], free_tcp())),
                )
            })
            .collect();
        let hap = Haproxy::start(
            0,
            &servers,
            &HaproxyOpts {
                weight: configured,
                ..HaproxyOpts::default()
            },
        );
        for r in &rows {
            // The line the agent sends for this weight, as the table has it.
            let line = ballast_balance::load::haproxy_agent_reply(Some(r.weight), false);
            assert_eq!(line.trim(), r.line, "{}: the agent-check line", r.endpoint);
            let pct = line.trim().trim_start_matches("ready up ");
            hap.command(&format!("set weight be/{} {pct}", r.endpoint));
        }
        let s = wait_for(
            Duration::from_secs(10),
            "the servers up with their weights",
            || {
                let s = hap.show_servers_state();
                if s.values().all(ServerState::ready) {
                    Ok(s)
                } else {
                    Err(format!("{s:?}"))
                }
            },
        );
        let got: Vec<u32> = rows.iter().map(|r| s[&r.endpoint].uweight).collect();
        assert_eq!(
            got, expected,
            "HAProxy's weights with `weight {configured}`, against docs/feeds.md"
        );
        // Ten rotations of the round robin: the split is exact but for a partial one.
        let rotation: u32 = got.iter().sum();
        let n = rotation * 10;
        let counts = split(&hap, n);
        for (r, w) in rows.iter().zip(&got) {
            let share = f64::from(counts.get(&r.endpoint).copied().unwrap_or(0)) / f64::from(n);
            let want = f64::from(*w) / f64::from(rotation);
            assert!(
                (share - want).abs() <= 0.01,
                "{} with `weight {configured}`: {share:.3} of {n} requests, weights say \
                 {want:.3}: {counts:?}",
                r.endpoint
            );
            if configured == 100 {
                assert!(
                    (share - r.haproxy_share).abs() <= 0.01,
                    "{}: {share:.3} of the requests, docs/feeds.md says {}",
                    r.endpoint,
                    r.haproxy_share
                );
            }
        }
        eprintln!("weight {configured}: HAProxy weights {got:?}, {n} requests {counts:?}");
    }
}
