//! What a relay costs and saves: many QUIC agent connections (real sessions, one
//! client certificate each) against a relay in front of a primary, and the same
//! connections straight to the primary, in one run against a real etcd.
//!
//! It measures, per pattern:
//! - CPU-µs per report at the relay (its CPU over the reports it forwarded);
//! - CPU-µs per report at the primary, relayed (reports reach it batched over one
//!   trunk) and direct (one datagram per report, one connection per agent), and the
//!   reports per batch on the trunk;
//! - memory per agent connection at the relay (VmRSS before and after connecting);
//! - the time from a drain to the node's state in etcd and at an xDS client of the
//!   primary, for a real agent behind the relay and one straight to the primary: a
//!   drain goes out at once in a report, so it times the report's way through the
//!   relay, the primary's next cycle, and the publication's way to etcd and to xDS.
//!
//! The primary is one replica of a cluster (it owns every bucket) and the relay finds
//! it through etcd, as in a deployment. The runs go relayed, direct, relayed, direct,
//! so that drift on the machine falls on both alike.
//!
//! ```sh
//! cargo build --release --workspace --bins --features ballast-aggregator/etcd
//! cargo bench -p ballast-tests --features ballast-aggregator/etcd --bench relay_scale
//! # -- --agents N --hz H --seconds S to change the pattern, --batch-delay-ms MS the relay's
//! ```
//!
//! It prints a table and one line, `relay scale:`, which `docs/scale.md` keeps with
//! the date, and exits non-zero if no report was counted.

use ballast_sim::loadgen::{node_name, Load, Target};
use ballast_sim::procstat::{cpu_seconds, status_mib};
use ballast_tests::harness::ads::EdsWatch;
use ballast_tests::*;
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PREFIX: &str = "/ballast-relay-bench";
const CLUSTER: &str = "bench";
const SERVICE: &str = "bench";

/// One measured window.
#[derive(Debug, Default, Clone, Copy)]
struct Window {
    seconds: f64,
    relay_cpu: f64,
    primary_cpu: f64,
    forwarded: f64,
    accepted: f64,
    batches: f64,
    trunk_reports: f64,
    sent: f64,
}

/// What the counters and clocks say now.
fn sample(relay: &Relay, primary: &Aggregator, load: &Load) -> Window {
    Window {
        seconds: 0.0,
        relay_cpu: relay.pid().map_or(f64::NAN, cpu_seconds),
        primary_cpu: primary.pid().map_or(f64::NAN, cpu_seconds),
        forwarded: relay.counter("ballast_relay_reports_forwarded_total", &[]),
        accepted: primary.counter("ballast_reports_accepted_total", &[]),
        batches: primary.counter("ballast_trunk_batches_total", &[]),
        trunk_reports: primary.counter("ballast_trunk_reports_total", &[]),
        sent: load.stats.sent.load(std::sync::atomic::Ordering::Relaxed) as f64,
    }
}

fn delta(a: Window, b: Window, seconds: f64) -> Window {
    Window {
        seconds,
        relay_cpu: b.relay_cpu - a.relay_cpu,
        primary_cpu: b.primary_cpu - a.primary_cpu,
        forwarded: b.forwarded - a.forwarded,
        accepted: b.accepted - a.accepted,
        batches: b.batches - a.batches,
        trunk_reports: b.trunk_reports - a.trunk_reports,
        sent: b.sent - a.sent,
    }
}

/// Runs `agents` connections at `hz` against `server` for a warm-up and a window of
/// `seconds`; the window's figures.
async fn run(
    target: &Target,
    server: std::net::SocketAddr,
    relay: &Relay,
    primary: &Aggregator,
    agents: usize,
    hz: u32,
    seconds: f64,
) -> Window {
    let target = Target {
        server,
        ..target.clone()
    };
    let load = Load::start(target, agents, hz)
        .await
        .unwrap_or_else(|e| panic!("load generator: {e}"));
    let (ok, failed) = load.outcome();
    assert!(
        ok == agents,
        "{ok} of {agents} connections welcomed, {failed} failed: {:?}",
        load.stats.first_error()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let a = sample(relay, primary, &load);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let b = sample(relay, primary, &load);
    let w = delta(a, b, t.elapsed().as_secs_f64());
    load.stop().await;
    // Let the connections' ends settle before the next run.
    tokio::time::sleep(Duration::from_secs(2)).await;
    w
}

/// Whether `node`'s state in etcd and at the xDS client is draining (`want`), each.
fn seen(etcd: &Etcd, eds: &EdsWatch, node: &str, address: &str, want: bool) -> (bool, bool) {
    let stored = etcd
        .get(&format!("{PREFIX}/services/{SERVICE}"))
        .and_then(|v| serde_json::from_str::<ballast_balance::ServiceSnapshot>(&v).ok())
        .and_then(|s| s.endpoints.get(node).map(|e| e.draining))
        == Some(want);
    let draining = HealthStatus::Draining as i32;
    let xds = eds.latest().and_then(|r| {
        let e = r.endpoints().ok()?;
        e.get(address).map(|lb| lb.health_status == draining)
    }) == Some(want);
    (stored, xds)
}

/// Drains and undrains `agent` `flips` times in all, one flip every three seconds, and
/// returns how long each took to show in etcd and at the xDS client, in milliseconds.
fn flip_times(etcd: &Etcd, eds: &EdsWatch, agent: &Agent, flips: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut to_etcd, mut to_xds) = (Vec::new(), Vec::new());
    let node = agent.node().to_string();
    let address = agent
        .opts()
        .address
        .clone()
        .unwrap_or_else(|| panic!("{node} has no address"));
    for i in 0..flips {
        let want = i % 2 == 0;
        let t = Instant::now();
        let ok = if want {
            agent.drain().ok
        } else {
            agent.undrain().ok
        };
        assert!(ok, "{node}: the agent refused to flip");
        let (mut e, mut x) = (None, None);
        while (e.is_none() || x.is_none()) && t.elapsed() < Duration::from_secs(10) {
            let (stored, served) = seen(etcd, eds, &node, &address, want);
            if stored && e.is_none() {
                e = Some(t.elapsed().as_secs_f64() * 1e3);
            }
            if served && x.is_none() {
                x = Some(t.elapsed().as_secs_f64() * 1e3);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        to_etcd.push(e.unwrap_or_else(|| panic!("{node}: flip {i} never reached etcd")));
        to_xds.push(x.unwrap_or_else(|| panic!("{node}: flip {i} never reached xDS")));
        std::thread::sleep(Duration::from_secs(3).saturating_sub(t.elapsed()));
    }
    (to_etcd, to_xds)
}

/// Median and largest of `v`.
fn median_max(v: &[f64]) -> (f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let median = v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
    (median, v.last().copied().unwrap_or(f64::NAN))
}

fn per_report_us(cpu: f64, reports: f64) -> f64 {
    if reports > 0.0 {
        cpu * 1e6 / reports
    } else {
        f64::NAN
    }
}

fn main() {
    let agents = usize::try_from(bench_arg("--agents", 2_000)).unwrap_or(2_000);
    let hz = u32::try_from(bench_arg("--hz", 1)).unwrap_or(1);
    let seconds = bench_arg("--seconds", 20) as f64;
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let interval_ms = (1000 / hz.max(1)).max(100);
    let primary = Aggregator::start(
        &pki,
        AggregatorOpts {
            xds: true,
            ..AggregatorOpts::default()
                .etcd(&etcd.endpoint(), PREFIX)
                .cluster(CLUSTER, "p0")
                .relays(&["relay-bench"])
                .report_interval_ms(interval_ms)
                .cycle_ms(1000)
        },
    );
    // `--batch-delay-ms` sets the relay's `[relay] batch_delay_ms`; 0 keeps its default.
    let batch_delay_ms = bench_arg("--batch-delay-ms", 0);
    let mut relay_opts = RelayOpts::new("relay-bench", &[&primary]);
    if batch_delay_ms > 0 {
        relay_opts = relay_opts.config(&format!("[relay]\nbatch_delay_ms = {batch_delay_ms}\n"));
    }
    let relay = Relay::start(&pki, relay_opts);

    let ca = pki.ca();
    let t = Instant::now();
    let identities: Vec<_> = (0..agents)
        .map(|i| {
            let node = node_name(i);
            ca.issue_node(&node, &[SERVICE.to_string()])
                .unwrap_or_else(|e| panic!("{node}: {e}"))
                .pem
                .identity(&node)
                .unwrap_or_else(|e| panic!("{node}: {e}"))
        })
        .collect();
    eprintln!(
        "{agents} client certificates issued in {:.1} s",
        t.elapsed().as_secs_f64()
    );
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

    let relay_pid = relay.pid().expect("the relay runs");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let idle_rss = status_mib(relay_pid, "VmRSS:");
    let mut relayed = Vec::new();
    let mut direct = Vec::new();
    let mut rss_per_connection = Vec::new();
    rt.block_on(async {
        for round in 0..2 {
            eprintln!(
                "round {}: {agents} agents at {hz} Hz through the relay",
                round + 1
            );
            let before = status_mib(relay_pid, "VmRSS:");
            let target_relay = Target {
                server: relay.quic_addr(),
                ..target.clone()
            };
            let load = Load::start(target_relay, agents, hz)
                .await
                .unwrap_or_else(|e| panic!("load generator: {e}"));
            let loaded = status_mib(relay_pid, "VmRSS:");
            rss_per_connection.push((loaded - before) * 1024.0 / agents as f64);
            load.stop().await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            relayed.push(
                run(
                    &target,
                    relay.quic_addr(),
                    &relay,
                    &primary,
                    agents,
                    hz,
                    seconds,
                )
                .await,
            );
            eprintln!("round {}: {agents} agents at {hz} Hz direct", round + 1);
            direct.push(
                run(
                    &target,
                    primary.quic_addr(),
                    &relay,
                    &primary,
                    agents,
                    hz,
                    seconds,
                )
                .await,
            );
        }
    });

    let sum = |ws: &[Window], f: fn(&Window) -> f64| ws.iter().map(f).sum::<f64>();
    let relay_us = per_report_us(
        sum(&relayed, |w| w.relay_cpu),
        sum(&relayed, |w| w.forwarded),
    );
    let primary_relayed_us = per_report_us(
        sum(&relayed, |w| w.primary_cpu),
        sum(&relayed, |w| w.accepted),
    );
    let primary_direct_us = per_report_us(
        sum(&direct, |w| w.primary_cpu),
        sum(&direct, |w| w.accepted),
    );
    let per_batch = sum(&relayed, |w| w.trunk_reports) / sum(&relayed, |w| w.batches).max(1.0);
    let rss_kib = rss_per_connection.iter().sum::<f64>() / rss_per_connection.len().max(1) as f64;

    println!("| path | agents × Hz | window s | reports sent | counted at the primary | primary CPU s | primary CPU-µs per report | relay CPU s | relay CPU-µs per report | reports per trunk batch |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (label, ws) in [("relayed", &relayed), ("direct", &direct)] {
        for w in ws.iter() {
            println!(
                "| {label} | {agents} × {hz} | {:.1} | {:.0} | {:.0} | {:.2} | {:.1} | {} | {} | {} |",
                w.seconds,
                w.sent,
                w.accepted,
                w.primary_cpu,
                per_report_us(w.primary_cpu, w.accepted),
                if label == "relayed" {
                    format!("{:.2}", w.relay_cpu)
                } else {
                    "—".into()
                },
                if label == "relayed" {
                    format!("{:.1}", per_report_us(w.relay_cpu, w.forwarded))
                } else {
                    "—".into()
                },
                if label == "relayed" {
                    format!("{:.1}", w.trunk_reports / w.batches.max(1.0))
                } else {
                    "—".into()
                },
            );
        }
    }
    println!(
        "relay scale: {agents} agents × {hz} Hz; primary {primary_relayed_us:.1} CPU-µs per \
         report relayed, {primary_direct_us:.1} direct ({:.2}×); relay {relay_us:.1} CPU-µs per \
         report; {per_batch:.1} reports per trunk batch; relay memory {rss_kib:.1} KiB per \
         agent connection (idle {idle_rss:.1} MiB)",
        primary_relayed_us / primary_direct_us
    );
    assert!(
        sum(&relayed, |w| w.accepted) > 0.0 && sum(&direct, |w| w.accepted) > 0.0,
        "no report was counted"
    );

    // From a drain to etcd and to xDS: two real agents behind the relay, two straight
    // to the primary (a service of one endpoint drains too, but keeps another
    // serving), each pair flipping its first agent.
    let flips = usize::try_from(bench_arg("--flips", 10)).unwrap_or(10);
    let eds = EdsWatch::start(primary.xds(), SERVICE);
    let mut lines = Vec::new();
    for (path, addr) in [
        ("relayed", relay.quic_addr()),
        ("direct", primary.quic_addr()),
    ] {
        let probes: Vec<Agent> = (0..2)
            .map(|i| {
                let mut opts = AgentOpts::new(SERVICE, &format!("probe-{path}-{i}"));
                opts.aggregators = Some(vec![addr.to_string()]);
                opts.interval_ms = 1000;
                Agent::start(&pki, &primary, opts)
            })
            .collect();
        for p in &probes {
            p.wait_weight(Duration::from_secs(20));
        }
        let (to_etcd, to_xds) = flip_times(&etcd, &eds, &probes[0], flips);
        let (e50, emax) = median_max(&to_etcd);
        let (x50, xmax) = median_max(&to_xds);
        lines.push(format!(
            "{path}: a drain reached etcd in {e50:.0} ms (median; at most {emax:.0}) and the \
             xDS client in {x50:.0} ms (at most {xmax:.0}), {flips} flips"
        ));
    }
    for l in &lines {
        println!("relay scale, drain to weight: {l}");
    }
}
