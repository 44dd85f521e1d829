//! The figures in `docs/performance.md` and `docs/protocol.md`: encoded sizes, the
//! aggregator's CPU per report over real QUIC, and the agent's footprint. Counts and
//! ratios, not timed assertions. The balancing core's cycle has a bench of its own
//! (`cargo bench -p ballast-balance --bench cycle`).
//!
//! Run: `cargo build --release --bins && cargo bench -p ballast-sim --bench figures`
//! (add `-- quick` for a shorter run).

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{cpu_seconds, release_binary, status_mib};

use ballast_shared::pki::Ca;
use ballast_shared::wire::{self, examples, Message};

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    sizes();
    let agg = release_binary("ballast-aggregator");
    let agent = release_binary("ballast-agent");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(end_to_end(&agg, &agent, quick));
}

fn sizes() {
    let typical = examples::typical_report();
    let worst = examples::largest_report();
    let reply = examples::documented_reply();
    let hello = examples::hello();
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
        status_mib(pid, "VmRSS:"),
        status_mib(pid, "VmHWM:"),
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
            ballast_agent::daemon::Agent::start_in_memory(
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
        status_mib(agg_pid, "VmRSS:")
    );
    println!();

    drop(agg);
    let _ = std::fs::remove_dir_all(&dir);
}
