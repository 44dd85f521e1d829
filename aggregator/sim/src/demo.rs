//! `ballast-sim demo`: an aggregator and a fleet of real agents on loopback,
//! converging live.
//!
//! The agents are in-process tasks, but each has its own QUIC endpoint and certificate
//! and talks to the aggregator over UDP on 127.0.0.1 exactly as a remote one would.
//! They use the synthetic source: a node of speed `s` carrying weight `w` shows load
//! `offered × w / s`, so the weights the aggregator sends back change what the agents
//! report next, and the loop is closed.

use ballast_agent::config::AgentConfig;
use ballast_agent::daemon::Agent;
use ballast_agent::sample::{synthetic::SyntheticHandle, CpuSpec, InflightSpec};
use ballast_aggregator::config::Config;
use ballast_aggregator::daemon::Daemon;
use ballast_balance::{Params, Spread};
use ballast_shared::pki::Ca;
use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Number of agents.
    pub nodes: usize,
    /// Hardware speeds, assigned round-robin to the nodes.
    pub speeds: Vec<f64>,
    /// Offered load: the mean utilization at equal weights.
    pub offered: f64,
    /// Cycles to show before the summary.
    pub cycles: u64,
    /// Cycle and report interval, in milliseconds.
    pub cycle_ms: u64,
    /// HTTP API address.
    pub http: SocketAddr,
    /// Keep running after the summary until interrupted.
    pub hold: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            nodes: 12,
            speeds: vec![0.6, 1.0, 1.5],
            offered: 0.6,
            cycles: 30,
            cycle_ms: 500,
            http: SocketAddr::from(([127, 0, 0, 1], 7401)),
            hold: false,
        }
    }
}

/// What the demo measured.
#[derive(Debug, Clone)]
pub struct DemoSummary {
    /// max/avg of the first balanced cycle (equal weights).
    pub first: Spread,
    /// max/avg of the last cycle.
    pub last: Spread,
    /// The first cycle from which max/avg stayed within 5 % of 1.
    pub settled_at: Option<u64>,
}

const SERVICE: &str = "demo";

fn bar(ratio: f64) -> String {
    let n = ((ratio - 1.0) * 40.0).clamp(0.0, 30.0).round() as usize;
    format!("{:<30}", "█".repeat(n))
}

/// Runs the demo, printing to `out`.
pub async fn run(opts: &DemoOptions, out: &mut (dyn Write + Send)) -> anyhow::Result<DemoSummary> {
    let ca = Ca::generate("Ballast demo CA")?;
    let ca_certs = ballast_shared::tls::certs_from_pem(&ca.pem().cert, "demo CA")?;
    let server = ca.issue_server(&["localhost".into(), "127.0.0.1".into()])?;
    let dir = tempfile_dir()?;

    let cfg = Config {
        quic: SocketAddr::from(([127, 0, 0, 1], 0)),
        http: opts.http,
        report_interval_ms: opts.cycle_ms as u32,
        store: ballast_aggregator::config::StoreConfig {
            path: dir.join("weights.json"),
            etcd: None,
        },
        balance: ballast_aggregator::config::BalanceDefaults(Params {
            cycle_ms: opts.cycle_ms,
            stale_ms: opts.cycle_ms * 3,
            grace_ms: opts.cycle_ms * 2,
            ..Params::default()
        }),
        ..Config::default()
    };
    let daemon = match Daemon::start(&cfg, server.identity("server")?, &ca_certs).await {
        Ok(d) => d,
        Err(ballast_aggregator::daemon::DaemonError::Bind { what: "HTTP", .. }) => {
            // Port taken: any free port will do for a demo.
            let cfg = Config {
                http: SocketAddr::from(([127, 0, 0, 1], 0)),
                ..cfg.clone()
            };
            Daemon::start(&cfg, server.identity("server")?, &ca_certs).await?
        }
        Err(e) => return Err(e.into()),
    };
    let api = format!("http://{}/v1/services/{SERVICE}", daemon.http_addr);
    writeln!(
        out,
        "Ballast demo: {} agents report over QUIC + mTLS to {}",
        opts.nodes, daemon.quic_addr
    )?;
    writeln!(
        out,
        "speeds {:?} (relative), offered load {:.0} % at equal weights",
        opts.speeds,
        opts.offered * 100.0
    )?;
    writeln!(
        out,
        "API: {api}  ·  {api}/endpoints  ·  http://{}/metrics\n",
        daemon.http_addr
    )?;

    let mut agents = Vec::new();
    for i in 0..opts.nodes {
        let node = format!("node-{i:02}");
        let speed = opts.speeds[i % opts.speeds.len().max(1)];
        let pem = ca.issue_node(&node, &[SERVICE.to_string()])?.pem;
        let client = ballast_shared::tls::client_config(pem.identity(&node)?, &ca_certs)?;
        let agent_cfg = AgentConfig {
            service: SERVICE.into(),
            node: node.clone(),
            address: format!("127.0.0.1:{}", 9000 + i),
            aggregators: vec![daemon.quic_addr.to_string()],
            interval_ms: opts.cycle_ms as u32,
            cpu: CpuSpec::None,
            inflight: Some(InflightSpec::Synthetic {
                speed,
                offered: opts.offered,
                noise: 0.02,
                seed: i as u64,
            }),
            capacity: 100,
            control_socket: Default::default(),
            ..AgentConfig::default()
        };
        agents.push((
            speed,
            Agent::start_in_memory(agent_cfg, client, SyntheticHandle::new()).await?,
        ));
    }

    writeln!(
        out,
        "{:>5}  {:>7}  {:>7}  {:>5}  {:<30}  mean weight by speed",
        "cycle", "max/avg", "p95/avg", "avg", ""
    )?;
    let mut published = daemon.state.subscribe();
    let mut first: Option<Spread> = None;
    let mut last = Spread::default();
    let mut settled_at = None;
    let mut shown = 0u64;
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(opts.cycle_ms * (opts.cycles + 20));
    let mut seen_cycle = 0;
    while shown < opts.cycles && tokio::time::Instant::now() < deadline {
        let _ = tokio::time::timeout(
            Duration::from_millis(opts.cycle_ms * 2),
            published.changed(),
        )
        .await;
        let (cycle, spread, skipped, by_speed) = {
            let current = published.borrow_and_update().clone();
            let Some(svc) = current.service(SERVICE) else {
                continue;
            };
            let mut by_speed: Vec<(f64, f64, usize)> =
                opts.speeds.iter().map(|&s| (s, 0.0, 0)).collect();
            for (speed, agent) in &agents {
                if let Some(e) = svc.endpoints.get(agent.shared.config.node.as_str()) {
                    if let Some(slot) = by_speed.iter_mut().find(|(s, _, _)| s == speed) {
                        slot.1 += e.weight;
                        slot.2 += 1;
                    }
                }
            }
            (
                svc.stats.cycles,
                svc.stats.spread,
                svc.stats.last_skip,
                by_speed,
            )
        };
        if cycle == seen_cycle || skipped.is_some() || spread.avg == 0.0 {
            continue;
        }
        seen_cycle = cycle;
        shown += 1;
        first.get_or_insert(spread);
        last = spread;
        if spread.max_over_avg <= 1.05 {
            settled_at.get_or_insert(shown);
        } else {
            settled_at = None;
        }
        let weights: Vec<String> = by_speed
            .iter()
            .map(|(s, sum, n)| {
                format!("{s:.1}×: {:.2}", if *n > 0 { sum / *n as f64 } else { 0.0 })
            })
            .collect();
        writeln!(
            out,
            "{shown:>5}  {:>7.3}  {:>7.3}  {:>4.0}%  {}  {}",
            spread.max_over_avg,
            spread.p95_over_avg,
            spread.avg * 100.0,
            bar(spread.max_over_avg),
            weights.join("  ")
        )?;
    }
    let first = first.unwrap_or_default();
    writeln!(out)?;
    writeln!(out, "Summary")?;
    writeln!(
        out,
        "  max/avg at equal weights (round robin): {:.3}",
        first.max_over_avg
    )?;
    writeln!(
        out,
        "  max/avg now:                            {:.3}",
        last.max_over_avg
    )?;
    match settled_at {
        Some(c) => writeln!(out, "  within 5 % of the average from cycle {c} on")?,
        None => writeln!(out, "  not yet within 5 % of the average")?,
    }
    writeln!(
        out,
        "  a fleet sized for its hottest node needs {:.0} % less headroom",
        (1.0 - last.max_over_avg / first.max_over_avg.max(1e-9)) * 100.0
    )?;
    out.flush()?;
    if opts.hold {
        writeln!(out, "\nAPI still up at {api}; Ctrl-C to stop.")?;
        let _ = tokio::signal::ctrl_c().await;
    }
    for (_, a) in agents {
        a.stop().await;
    }
    daemon.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(DemoSummary {
        first,
        last,
        settled_at,
    })
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("ballast-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
