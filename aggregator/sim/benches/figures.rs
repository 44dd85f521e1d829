//! The figures in `docs/performance.md` and `docs/protocol.md`: encoded sizes, the
//! balancing core's cost, the aggregator's CPU per report over real QUIC, and the
//! agent's footprint. Counts and ratios, not timed assertions.
//!
//! Run: `cargo build --release --bins && cargo bench -p ballast-sim --bench figures`
//! (add `-- quick` for a shorter run).

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ballast_balance::{Balancer, Limits, Observation, Params, Published};
use ballast_shared::pki::Ca;
use ballast_shared::wire::{self, Hello, Message, NodeState, Reply, Report};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    sizes();
    core(quick);
    let release = release_dir();
    let agg = release.join("ballast-aggregator");
    let agent = release.join("ballast-agent");
    if !agg.exists() || !agent.exists() {
        eprintln!(
            "release binaries missing in {}: run `cargo build --release --bins` first",
            release.display()
        );
        std::process::exit(1);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(end_to_end(&agg, &agent, quick));
}

fn release_dir() -> PathBuf {
    // target/release/deps/figures-HASH -> target/release
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().and_then(Path::parent).map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/release"))
}

fn sizes() {
    let typical = Report {
        seq: 3600,
        cpu: 0.42,
        inflight: 17,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    };
    let worst = Report {
        seq: u32::MAX,
        inflight: u32::MAX,
        capacity: u32::MAX,
        error_rate: Some(0.5),
        state: NodeState::Draining,
        ..typical
    };
    let reply = Reply {
        weight: 1.23,
        cycle: 86_400,
        interval_ms: 1000,
        draining: false,
        load: 0.42,
        inflight_trusted: true,
    };
    let hello = Hello {
        node: "web-042.dc1.example.com".into(),
        service: "web-frontend".into(),
        address: "10.1.2.3:8080".into(),
        zone: "dc1-a".into(),
        version: ballast_shared::VERSION.into(),
    };
    let len = |m: Message| wire::encode(&m).map(|b| b.len()).unwrap_or(0);
    println!("## Encoded sizes (bytes, including the version byte)\n");
    println!("| message | bytes |\n|---|---|");
    println!("| report, typical | {} |", len(Message::Report(typical)));
    println!(
        "| report, every field at its maximum | {} |",
        len(Message::Report(worst))
    );
    println!("| reply | {} |", len(Message::Reply(reply)));
    println!("| hello | {} |", len(Message::Hello(hello)));
    println!();
}

fn core(quick: bool) {
    println!("## Balancing core (one thread, no I/O)\n");
    println!("| endpoints | observe, ns/report | cycle, ms | publish, ms |\n|---|---|---|---|");
    let sizes: &[usize] = if quick {
        &[1_000, 10_000]
    } else {
        &[1_000, 10_000, 100_000]
    };
    for &n in sizes {
        let params = Params {
            grace_ms: 0,
            ..Params::default()
        };
        let mut b = Balancer::new(params, 0);
        // The shipped limit is 50,000 endpoints a service; the largest size goes past it.
        b.set_limits(Limits {
            max_endpoints_per_service: usize::MAX,
            ..Limits::default()
        });
        let nodes: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
        for (i, node) in nodes.iter().enumerate() {
            b.register(
                0,
                "svc",
                node,
                &format!("10.{}.{}.{}:80", i / 65_536, (i / 256) % 256, i % 256),
                "",
            )
            .expect("register");
        }
        let rounds = 5u64;
        let mut observe_ns = 0u128;
        let mut cycle_ns = 0u128;
        let mut publish_ns = 0u128;
        let mut published = Published::default();
        let ran: BTreeSet<String> = ["svc".to_string()].into();
        for r in 0..rounds {
            let now = r * 1000;
            let t = Instant::now();
            for (i, node) in nodes.iter().enumerate() {
                let obs = Observation {
                    seq: Some(r as u32 + 1),
                    cpu: 0.3 + (i % 7) as f64 * 0.05,
                    ..Observation::default()
                };
                let _ = b.observe(now, "svc", node, obs);
            }
            observe_ns += t.elapsed().as_nanos();
            let t = Instant::now();
            let _ = b.cycle(now);
            cycle_ns += t.elapsed().as_nanos();
            // What the daemon adds to each cycle: the value every reader takes.
            let t = Instant::now();
            published = published.next(&b, &ran, &BTreeMap::new(), now);
            publish_ns += t.elapsed().as_nanos();
        }
        println!(
            "| {n} | {:.0} | {:.2} | {:.2} |",
            observe_ns as f64 / (rounds as f64 * n as f64),
            cycle_ns as f64 / rounds as f64 / 1e6,
            publish_ns as f64 / rounds as f64 / 1e6
        );
    }
    println!();
}

/// CPU seconds a process has used, summed over its threads from the scheduler's
/// nanosecond account (`/proc/PID/task/*/schedstat`): the 10 ms ticks of
/// `/proc/PID/stat` are too coarse for an agent that uses about a millisecond per
/// second. (Threads that have exited are not counted; none do in these runs.)
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: f64 = tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
        })
        .sum();
    ns / 1e9
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn http_get(addr: &str, path: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn accepted(http: &str) -> f64 {
    http_get(http, "/metrics")
        .lines()
        .find(|l| l.starts_with("ballast_reports_accepted_total"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(17401)
}

async fn end_to_end(agg_bin: &Path, agent_bin: &Path, quick: bool) {
    let dir = std::env::temp_dir().join(format!("ballast-figures-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let ca = Ca::generate("bench CA").expect("ca");
    ca.pem().write(&dir, "ca").expect("write ca");
    ca.issue_server(&["127.0.0.1".into()])
        .expect("server cert")
        .write(&dir, "server")
        .expect("write server");
    let http = format!("127.0.0.1:{}", free_port());
    let quic = format!("127.0.0.1:{}", free_port());
    // Agents take their report interval from the aggregator's welcome, so each part
    // runs against an aggregator started with the interval it measures.
    let spawn_aggregator = |interval_ms: &str| {
        Killed(
            Command::new(agg_bin)
                .args(["run", "--quic", &quic, "--http", &http, "--tls-dir"])
                .arg(&dir)
                .arg("--store")
                .arg(dir.join("weights.json"))
                .args(["--report-interval-ms", interval_ms])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn aggregator"),
        )
    };
    let agg = spawn_aggregator("1000");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // First, on a quiet machine: one real agent binary at the default 1 s interval.
    let tls = dir.join("nodes/footprint");
    let _ = std::fs::create_dir_all(&tls);
    ca.issue_node("footprint", &["footprint".to_string()])
        .expect("cert")
        .pem
        .write(&tls, "node")
        .expect("write");
    let _ = std::fs::copy(dir.join("ca.pem"), tls.join("ca.pem"));
    let agent = Killed(
        Command::new(agent_bin)
            .args([
                "--service",
                "footprint",
                "--node",
                "footprint",
                "--address",
                "127.0.0.1:80",
                "--port",
                "80",
            ])
            .args(["--aggregator", &quic, "--tls-dir"])
            .arg(&tls)
            .arg("--control")
            .arg(dir.join("agent.sock"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn agent"),
    );
    let pid = agent.0.id();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let secs = if quick { 10 } else { 60 };
    let c0 = cpu_seconds(pid);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let c1 = cpu_seconds(pid);
    let per_hour = (c1 - c0) * 3600.0 / secs as f64;
    let size = std::fs::metadata(agent_bin).map(|m| m.len()).unwrap_or(0);
    println!(
        "## Agent footprint (release binary, host CPU + TCP in-flight, 1 s interval, {secs} s)\n"
    );
    println!("| RSS MiB | peak RSS MiB | CPU s per hour | % of one core | binary MiB |\n|---|---|---|---|---|");
    println!(
        "| {:.1} | {:.1} | {:.2} | {:.3} | {:.1} |",
        rss_kib(pid, "VmRSS:") as f64 / 1024.0,
        rss_kib(pid, "VmHWM:") as f64 / 1024.0,
        per_hour,
        per_hour / 36.0,
        size as f64 / 1_048_576.0
    );
    drop(agent);
    drop(agg);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let agg = spawn_aggregator("100");
    let agg_pid = agg.0.id();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Then many in-process agents at 10 Hz: the aggregator's CPU per report.
    let ca_certs = ballast_shared::tls::certs_from_pem(&ca.pem().cert, "ca").expect("ca");
    let n_agents = if quick { 50 } else { 200 };
    let mut agents = Vec::new();
    for i in 0..n_agents {
        let node = format!("load-{i}");
        let pem = ca
            .issue_node(&node, &["bench".to_string()])
            .expect("node cert")
            .pem;
        let client =
            ballast_shared::tls::client_config(pem.identity(&node).expect("id"), &ca_certs)
                .expect("client");
        let cfg = ballast_agent::config::AgentConfig {
            service: "bench".into(),
            node,
            address: format!("127.0.0.1:{}", 10_000 + i),
            aggregators: vec![quic.clone()],
            interval_ms: 100,
            cpu: ballast_agent::sample::CpuSpec::None,
            inflight: Some(ballast_agent::sample::InflightSpec::Synthetic {
                speed: 1.0,
                offered: 0.5,
                noise: 0.05,
                seed: i as u64,
            }),
            control_socket: PathBuf::new(),
            ..Default::default()
        };
        agents.push(
            ballast_agent::daemon::Agent::start(
                cfg,
                client,
                ballast_agent::sample::synthetic::SyntheticHandle::new(),
            )
            .await
            .expect("agent"),
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let secs = if quick { 5 } else { 20 };
    let (c0, r0) = (cpu_seconds(agg_pid), accepted(&http));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (c1, r1) = (cpu_seconds(agg_pid), accepted(&http));
    for a in agents {
        a.stop().await;
    }
    let reports = r1 - r0;
    println!("## Aggregator over real QUIC + mTLS on loopback\n");
    println!("| agents | report rate | reports counted | aggregator CPU s | CPU-µs per report | RSS MiB |\n|---|---|---|---|---|---|");
    println!(
        "| {n_agents} | 10 Hz each | {reports:.0} | {:.2} | {:.1} | {:.1} |",
        c1 - c0,
        if reports > 0.0 {
            (c1 - c0) * 1e6 / reports
        } else {
            f64::NAN
        },
        rss_kib(agg_pid, "VmRSS:") as f64 / 1024.0
    );
    println!();

    drop(agg);
    let _ = std::fs::remove_dir_all(&dir);
}
