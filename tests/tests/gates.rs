//! Performance gates that run under `cargo test`, on the test command's binaries
//! (`target/debug`): each figure is asserted as a ratio to a baseline measured in the
//! same run, with a bound set from the spread of repeated runs (docs/performance.md,
//! "The gates"). The gates of this file run one at a time (a lock), and cargo runs this
//! test binary alone, so each has the machine mostly to itself.
//!
//! - relay: the primary's CPU per report when the agents report through a relay, over
//!   its CPU per report when the same agents connect to it directly
//!   (`benches/relay_scale.rs`, shorter).
//! - soak: the aggregator's and a never-restarted agent's resident memory at the end of
//!   a short run under churn, over their level after the warm-up (`benches/soak.rs`,
//!   shorter).
//!
//! Debug builds, on purpose: neither figure is a speed of optimised code. The relayed
//! and the direct path are the same build's code, so their ratio says what batching
//! saves at the primary; a leak grows the resident set alike in any build.

use ballast_sim::loadgen::{node_name, Load, Target};
use ballast_sim::procstat::{cpu_seconds, status_mib};
use ballast_tests::harness::converge::node_names;
// One gate at a time: each measures CPU or memory on a machine it should have to itself.
use ballast_tests::harness::process::one_at_a_time;
use ballast_tests::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------
// The relay gate.

const PREFIX: &str = "/ballast-relay-gate";
const CLUSTER: &str = "gate";
const SERVICE: &str = "gate";
/// Agent connections of the load generator, and each one's reports a second.
const RELAY_AGENTS: usize = 500;
const RELAY_HZ: u32 = 4;
/// Each measured window, after a warm-up of [`RELAY_WARM`].
const RELAY_WINDOW: Duration = Duration::from_secs(8);
const RELAY_WARM: Duration = Duration::from_secs(3);
/// Relayed, direct, relayed, direct: drift on the machine falls on both alike.
const RELAY_ROUNDS: usize = 2;
/// The primary's CPU per report relayed, over its CPU per report direct (the whole
/// primary process: sessions or trunk, the cycle and the etcd writes).
///
/// Measured (debug builds, 2 cores, light work beside): 0.140 (relayed 24.1 CPU-µs a
/// report, windows 23.8 and 24.4; direct 172.7) and 0.167 (relayed 29.1, windows 28.3
/// and 29.9; direct 174.0): the windows of a run agree within 6 %, the runs do not.
/// The target is 0.25 (docs/scale.md's release figures are about 0.2). 0.21 is 25 %
/// above the worst run: it fails a relayed path 30 % dearer than that run's, but not
/// one 30 % dearer than the best run's (`trunk=7500` measured 0.183, which passes it);
/// the two runs' spread allows no bound that does both without failing quiet runs.
const RELAY_BOUND: f64 = 0.21;

/// The primary's CPU and accepted reports, as counters at one moment (the harness's
/// HTTP client blocks: off the runtime's workers).
fn primary_now(primary: &Aggregator) -> (f64, f64) {
    tokio::task::block_in_place(|| {
        (
            primary.pid().map_or(f64::NAN, cpu_seconds),
            primary.counter("ballast_reports_accepted_total", &[]),
        )
    })
}

/// One window of the load through `server`: the primary's CPU seconds, the reports it
/// accepted, and the reports sent.
async fn relay_window(
    target: &Target,
    server: std::net::SocketAddr,
    primary: &Aggregator,
) -> (f64, f64, f64) {
    let target = Target {
        server,
        ..target.clone()
    };
    let load = Load::start(target, RELAY_AGENTS, RELAY_HZ)
        .await
        .unwrap_or_else(|e| panic!("load generator: {e}"));
    let (ok, failed) = load.outcome();
    // A straggler or two does not bias a cost per report; more than that is a run that
    // did not carry its load.
    assert!(
        ok * 100 >= RELAY_AGENTS * 98,
        "relay gate: {ok} of {RELAY_AGENTS} connections welcomed through {server}, {failed} \
         failed: {:?}",
        load.stats.first_error()
    );
    tokio::time::sleep(RELAY_WARM).await;
    let (cpu0, acc0) = primary_now(primary);
    let sent0 = load.stats.sent.load(std::sync::atomic::Ordering::Relaxed) as f64;
    tokio::time::sleep(RELAY_WINDOW).await;
    let (cpu1, acc1) = primary_now(primary);
    let sent1 = load.stats.sent.load(std::sync::atomic::Ordering::Relaxed) as f64;
    load.stop().await;
    // Let the connections' ends settle before the next window.
    tokio::time::sleep(Duration::from_secs(2)).await;
    (cpu1 - cpu0, acc1 - acc0, sent1 - sent0)
}

#[test]
fn a_relayed_report_costs_the_primary_at_most_a_quarter_of_a_direct_one() {
    let _one = one_at_a_time();
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let primary = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .etcd(&etcd.endpoint(), PREFIX)
            .cluster(CLUSTER, "p0")
            .relays(&["relay-gate"])
            .report_interval_ms(1000 / RELAY_HZ)
            .cycle_ms(1000),
    );
    let relay = Relay::start(&pki, RelayOpts::new("relay-gate", &[&primary]));
    // The relay opens its trunk once the primary names itself the owner.
    wait_for(
        Duration::from_secs(30),
        "the relay's trunk to the primary",
        || {
            let open = primary.counter("ballast_trunks_open", &[]);
            (open >= 1.0)
                .then_some(())
                .ok_or(format!("{open} trunks open"))
        },
    );
    let ca = pki.ca();
    let identities: Vec<_> = (0..RELAY_AGENTS)
        .map(|i| {
            let node = node_name(i);
            ca.issue_node(&node, &[SERVICE.to_string()])
                .unwrap_or_else(|e| panic!("{node}: {e}"))
                .pem
                .identity(&node)
                .unwrap_or_else(|e| panic!("{node}: {e}"))
        })
        .collect();
    let ca_pem = std::fs::read_to_string(pki.server_tls_dir().join("ca.pem")).expect("ca.pem");
    let ca_certs = ballast_shared::tls::certs_from_pem(&ca_pem, "ca.pem").expect("the CA");
    let target = Target {
        server: relay.quic_addr(),
        server_name: "127.0.0.1".into(),
        ca: Arc::new(ca_certs),
        identities: Arc::new(identities),
        services: Arc::new(vec![SERVICE.to_string()]),
        // Today's agent: a relay admits no other.
        current: true,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (mut relayed, mut direct) = (Vec::new(), Vec::new());
    rt.block_on(async {
        for _ in 0..RELAY_ROUNDS {
            relayed.push(relay_window(&target, relay.quic_addr(), &primary).await);
            direct.push(relay_window(&target, primary.quic_addr(), &primary).await);
        }
    });
    let us = |w: &[(f64, f64, f64)]| {
        let cpu: f64 = w.iter().map(|x| x.0).sum();
        let accepted: f64 = w.iter().map(|x| x.1).sum();
        cpu * 1e6 / accepted.max(1.0)
    };
    let each = |w: &[(f64, f64, f64)]| {
        w.iter()
            .map(|x| format!("{:.1}", x.0 * 1e6 / x.1.max(1.0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (r, d) = (us(&relayed), us(&direct));
    let ratio = r / d;
    let figures = format!(
        "{RELAY_AGENTS} agents × {RELAY_HZ} Hz, {RELAY_ROUNDS} × {RELAY_WINDOW:?} windows: the \
         primary spent {r:.1} CPU-µs per report relayed (windows {}) and {d:.1} direct (windows \
         {})",
        each(&relayed),
        each(&direct)
    );
    eprintln!("relay gate: ratio {ratio:.3} (bound {RELAY_BOUND}); {figures}");
    for (path, w) in [("relayed", &relayed), ("direct", &direct)] {
        for &(_, accepted, sent) in w.iter() {
            assert!(
                accepted >= 0.95 * sent && sent > 0.0,
                "relay gate: {path}, the primary accepted {accepted:.0} of {sent:.0} reports \
                 sent in a window: the run did not carry the load, so its ratio says nothing; \
                 {figures}"
            );
        }
    }
    assert!(
        ratio <= RELAY_BOUND,
        "relay gate: a report relayed costs the primary {ratio:.3}× a direct one, above the \
         bound of {RELAY_BOUND}×: a regression in the primary's side of the trunk; {figures}"
    );
}

// ---------------------------------------------------------------------------------
// The soak gate.

/// Agents of the short soak, reporting every [`SOAK_INTERVAL_MS`].
const SOAK_AGENTS: usize = 30;
const SOAK_INTERVAL_MS: u32 = 250;
/// The run, and its warm-up: the level is the largest sample of the ten seconds after
/// the warm-up; the end, the largest of the last six seconds.
const SOAK_RUN: Duration = Duration::from_secs(75);
const SOAK_WARM: Duration = Duration::from_secs(25);
const SOAK_SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Resident memory allowed at the end over the level after the warm-up.
///
/// Measured (debug builds, 2 cores; one clean run in the time this gate was written):
/// the aggregator 1.003× (37.6 to 37.7 MiB), the agent 1.000× (15.9 MiB); the long
/// soak's own bound is
/// 1.15 over 30 minutes (benches/soak.rs). 1.10 leaves the allocator room to settle
/// and fails a leak of 2,000 bytes a report (`leak=2000`: 1.209×, 45.7 to 55.2 MiB).
const SOAK_RSS_BOUND: f64 = 1.10;

#[test]
fn memory_stays_flat_over_a_short_soak_under_churn() {
    let _one = one_at_a_time();
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .cycle_ms(1000)
            .report_interval_ms(SOAK_INTERVAL_MS),
    );
    let nodes = node_names(SERVICE, SOAK_AGENTS);
    let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
    pki.issue_nodes_for(SERVICE, &refs);
    let mut agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| Agent::start(&pki, &agg, AgentOpts::new(SERVICE, n).seed(i as u64)))
        .collect();
    for a in &agents {
        a.wait_weight(Duration::from_secs(60));
    }
    let agg_pid = agg.pid().expect("the aggregator runs");
    let agent_pid = agents[0].pid().expect("the first agent runs");
    let started = Instant::now();
    let mut samples: Vec<(f64, f64, f64)> = Vec::new();
    let mut turn = 0usize;
    let mut next_churn = started + Duration::from_secs(10);
    // Bounded by the run's length, and by a count besides.
    for _ in 0..(SOAK_RUN.as_millis() / 100) {
        if started.elapsed() >= SOAK_RUN {
            break;
        }
        let t = started.elapsed().as_secs_f64();
        if samples
            .last()
            .is_none_or(|s| t - s.0 >= SOAK_SAMPLE_EVERY.as_secs_f64())
        {
            samples.push((
                t,
                status_mib(agg_pid, "VmRSS:"),
                status_mib(agent_pid, "VmRSS:"),
            ));
        }
        if Instant::now() >= next_churn {
            // Two agents restarted (never the first, whose memory is sampled), one
            // drained or undrained.
            for _ in 0..2 {
                turn = 1 + (turn % (agents.len() - 1));
                agents[turn].stop(Duration::from_secs(5));
                agents[turn].restart(&pki, &agg);
            }
            let flip = &agents[1 + (turn + 7) % (agents.len() - 1)];
            let _ = if turn.is_multiple_of(2) {
                flip.drain()
            } else {
                flip.undrain()
            };
            next_churn += Duration::from_secs(10);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let accepted = agg.counter("ballast_reports_accepted_total", &[]);
    drop(agents);
    let warm = SOAK_WARM.as_secs_f64();
    let level = |f: fn(&(f64, f64, f64)) -> f64, from: f64, to: f64| {
        samples
            .iter()
            .filter(|s| s.0 >= from && s.0 < to)
            .map(f)
            .fold(0.0, f64::max)
    };
    let end = samples.last().map_or(0.0, |s| s.0);
    let figures: Vec<(&str, f64, f64)> = vec![
        (
            "aggregator",
            level(|s| s.1, warm, warm + 10.0),
            level(|s| s.1, end - 6.0, end + 1.0),
        ),
        (
            "agent (never restarted)",
            level(|s| s.2, warm, warm + 10.0),
            level(|s| s.2, end - 6.0, end + 1.0),
        ),
    ];
    let text = figures
        .iter()
        .map(|(who, base, last)| {
            format!(
                "{who} {base:.1} MiB after the warm-up, {last:.1} MiB at the end ({:.3}×)",
                last / base
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    eprintln!(
        "soak gate: {SOAK_AGENTS} agents every {SOAK_INTERVAL_MS} ms for {SOAK_RUN:?}, \
         {accepted:.0} reports accepted: {text} (bound {SOAK_RSS_BOUND}×)"
    );
    assert!(
        samples.len() >= 20 && accepted > 0.0,
        "soak gate: {} samples and {accepted:.0} reports accepted: the run did not happen",
        samples.len()
    );
    for (who, base, last) in &figures {
        assert!(
            *base > 0.0 && last / base <= SOAK_RSS_BOUND,
            "soak gate: the {who}'s resident memory grew from {base:.1} MiB after the warm-up \
             to {last:.1} MiB at the end of a {SOAK_RUN:?} run ({:.3}×), above the bound of \
             {SOAK_RSS_BOUND}×: memory that grows with reports or churn; {text}",
            last / base
        );
    }
}
