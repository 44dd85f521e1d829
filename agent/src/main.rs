//! `ballast-agent`: flags, logging and messages for people. The work is in the library.

use anyhow::{Context, Result};
use ballast_agent::config::{AgentConfig, TlsFiles};
use ballast_agent::control::{self, Request, Response};
use ballast_agent::daemon::{self, Agent};
use ballast_agent::sample::{synthetic::SyntheticHandle, CpuSpec, InflightSpec};
use ballast_shared::config::init_logging;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// Ballast host agent: measures how busy this node's service is and reports it.
#[derive(Parser)]
#[command(name = "ballast-agent", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    flags: Flags,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent daemon (the default).
    Run(Flags),
    /// Take one measurement and print it; no daemon or aggregator needed.
    Sample {
        #[command(flatten)]
        flags: Flags,
        /// Seconds between the two readings a CPU delta needs.
        #[arg(long, default_value_t = 1.0)]
        window: f64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the running daemon's connection, last report and weight.
    Status(CtlArgs),
    /// Lame duck: ask the aggregator for weight 0 and let in-flight work finish.
    Drain(CtlArgs),
    /// Come back from a drain through the cold-start ramp.
    Undrain(CtlArgs),
    /// Validate the configuration and TLS files, then exit.
    Check(Flags),
}

#[derive(Args, Clone)]
struct CtlArgs {
    /// The daemon's control socket.
    #[arg(
        long,
        env = "BALLAST_CONTROL",
        default_value = "/run/ballast/agent.sock"
    )]
    control: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Clone, Default)]
struct Flags {
    /// TOML configuration file; flags and environment override it.
    #[arg(long, short, env = "BALLAST_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Service name.
    #[arg(long, env = "BALLAST_SERVICE", global = true)]
    service: Option<String>,
    /// Service port on this host.
    #[arg(long, env = "BALLAST_PORT", global = true)]
    port: Option<u16>,
    /// Aggregator address host:port; repeat or comma-separate for failover.
    #[arg(
        long = "aggregator",
        env = "BALLAST_AGGREGATOR",
        value_delimiter = ',',
        global = true
    )]
    aggregators: Vec<String>,
    /// Node identity (default: host name). Must match the certificate.
    #[arg(long, env = "BALLAST_NODE", global = true)]
    node: Option<String>,
    /// Endpoint address load balancers use (default: host name and port).
    #[arg(long, env = "BALLAST_ADDRESS", global = true)]
    address: Option<String>,
    /// Zone of this node.
    #[arg(long, env = "BALLAST_ZONE", global = true)]
    zone: Option<String>,
    /// CPU source: host, cgroup:PATH, pid:N or none.
    #[arg(long, env = "BALLAST_CPU", global = true)]
    cpu: Option<CpuSpec>,
    /// In-flight source: tcp:PORTS, prometheus:URL#METRIC, synthetic:speed=..,offered=.. or none.
    #[arg(long, env = "BALLAST_INFLIGHT", global = true)]
    inflight: Option<InflightSpec>,
    /// In-flight requests that mean fully busy.
    #[arg(long, env = "BALLAST_CAPACITY", global = true)]
    capacity: Option<u32>,
    /// Report interval in milliseconds.
    #[arg(long, env = "BALLAST_INTERVAL_MS", global = true)]
    interval_ms: Option<u32>,
    /// Directory with ca.pem, node.pem and node.key.
    #[arg(long, env = "BALLAST_TLS_DIR", global = true)]
    tls_dir: Option<PathBuf>,
    /// TLS server name expected from the aggregator.
    #[arg(long, env = "BALLAST_SERVER_NAME", global = true)]
    server_name: Option<String>,
    /// Answer HAProxy's agent-check on this address (e.g. 0.0.0.0:7402).
    #[arg(long, env = "BALLAST_AGENT_CHECK", global = true)]
    agent_check: Option<std::net::SocketAddr>,
    /// Control socket path ("" for none).
    #[arg(long, env = "BALLAST_CONTROL", global = true, value_parser = any_path)]
    control: Option<PathBuf>,
    /// Log as JSON lines.
    #[arg(long, env = "BALLAST_LOG_JSON", global = true)]
    log_json: bool,
}

impl Flags {
    fn merged(&self, other: &Flags) -> Flags {
        macro_rules! pick {
            ($($f:ident),*) => { Flags { $($f: other.$f.clone().or_else(|| self.$f.clone()),)*
                aggregators: if other.aggregators.is_empty() { self.aggregators.clone() } else { other.aggregators.clone() },
                log_json: self.log_json || other.log_json } };
        }
        pick!(
            config,
            service,
            port,
            node,
            address,
            zone,
            cpu,
            inflight,
            capacity,
            interval_ms,
            tls_dir,
            server_name,
            control,
            agent_check
        )
    }

    fn config(&self) -> Result<AgentConfig> {
        let mut cfg = match &self.config {
            Some(path) => AgentConfig::load(path)?,
            None => AgentConfig::default(),
        };
        if let Some(v) = &self.service {
            cfg.service = v.clone();
        }
        if let Some(v) = self.port {
            cfg.port = v;
        }
        if !self.aggregators.is_empty() {
            cfg.aggregators = self.aggregators.clone();
        }
        if let Some(v) = &self.node {
            cfg.node = v.clone();
        }
        if let Some(v) = &self.address {
            cfg.address = v.clone();
        }
        if let Some(v) = &self.zone {
            cfg.zone = v.clone();
        }
        if let Some(v) = &self.cpu {
            cfg.cpu = v.clone();
        }
        if let Some(v) = &self.inflight {
            cfg.inflight = Some(v.clone());
        }
        if let Some(v) = self.capacity {
            cfg.capacity = v;
        }
        if let Some(v) = self.interval_ms {
            cfg.interval_ms = v;
        }
        if let Some(dir) = &self.tls_dir {
            cfg.tls = TlsFiles::in_dir(dir, "node");
        }
        if let Some(v) = &self.server_name {
            cfg.server_name = Some(v.clone());
        }
        if let Some(v) = &self.control {
            cfg.control_socket = v.clone();
        }
        if let Some(v) = self.agent_check {
            cfg.agent_check = Some(v);
        }
        Ok(cfg.resolve())
    }
}

/// Any path, the empty one included: `--control ""` turns the control socket off,
/// which clap's own path parser would refuse.
fn any_path(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => run(cli.flags),
        Some(Command::Run(f)) => run(cli.flags.merged(&f)),
        Some(Command::Sample {
            flags,
            window,
            json,
        }) => sample(cli.flags.merged(&flags), window, json),
        Some(Command::Status(c)) => ctl(&c, Request::Status),
        Some(Command::Drain(c)) => ctl(&c, Request::Drain),
        Some(Command::Undrain(c)) => ctl(&c, Request::Undrain),
        Some(Command::Check(f)) => check(cli.flags.merged(&f)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ballast-agent: {}", ballast_shared::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(flags: Flags) -> Result<ExitCode> {
    init_logging(flags.log_json, "info");
    let cfg = flags.config()?;
    cfg.validate()?;
    let client = daemon::client_config(&cfg).context("loading TLS files")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let agent = Agent::start(cfg, client, SyntheticHandle::new()).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        agent.stop().await;
        Ok(ExitCode::SUCCESS)
    })
}

fn sample(flags: Flags, window: f64, json: bool) -> Result<ExitCode> {
    let cfg = flags.config()?;
    let mut sampler = daemon::open_sampler(&cfg, &SyntheticHandle::new())?;
    // CPU needs two readings for a delta.
    sampler.sample()?;
    std::thread::sleep(std::time::Duration::from_secs_f64(window.clamp(0.05, 60.0)));
    let s = sampler.sample()?;
    if json {
        let v = serde_json::json!({
            "cpu": s.cpu, "inflight": s.inflight, "capacity": s.capacity,
            "error_rate": s.error_rate, "load": s.load, "sources": sampler.describe(),
        });
        println!("{v}");
    } else {
        println!("sources   {}", sampler.describe());
        println!("cpu       {:.1} %", s.cpu * 100.0);
        println!(
            "in-flight {} of {} ({:.1} %)",
            s.inflight,
            s.capacity,
            if s.capacity > 0 {
                f64::from(s.inflight) / f64::from(s.capacity) * 100.0
            } else {
                0.0
            }
        );
        println!("load      {:.3}  (max of cpu and in-flight share)", s.load);
    }
    Ok(ExitCode::SUCCESS)
}

fn ctl(args: &CtlArgs, req: Request) -> Result<ExitCode> {
    let resp = control::request(&args.control, req)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&resp)?);
    } else {
        print_human(req, &resp);
    }
    Ok(if resp.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_human(req: Request, resp: &Response) {
    if let Some(err) = &resp.error {
        println!("error: {err}");
        return;
    }
    let Some(s) = &resp.status else { return };
    match req {
        Request::Drain => println!(
            "draining {} of {}: the aggregator will publish weight 0",
            s.node, s.service
        ),
        Request::Undrain => println!(
            "undrained {} of {}: back through the cold-start ramp",
            s.node, s.service
        ),
        Request::Status => {}
    }
    let fmt_opt =
        |v: Option<f64>, d: usize| v.map(|x| format!("{x:.d$}")).unwrap_or_else(|| "-".into());
    println!("node        {} ({})", s.node, s.service);
    println!(
        "aggregator  {}",
        s.connected_to.as_deref().unwrap_or("not connected")
    );
    println!(
        "last report load {} cpu {} in-flight {}",
        fmt_opt(s.last_load, 3),
        fmt_opt(s.last_cpu, 3),
        s.last_inflight
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!(
        "weight      {} (cycle {})",
        fmt_opt(s.weight, 3),
        s.weight_cycle
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!(
        "reports     {} sent, {} failed; {} connect failures, {} sample errors",
        s.reports_sent, s.reports_failed, s.connect_failures, s.sample_errors
    );
    let state = if !s.draining {
        "serving".to_string()
    } else if resp.safe_to_stop == Some(true) {
        "draining: safe to stop (weight 0 acknowledged, nothing in flight)".to_string()
    } else {
        "draining: not yet safe to stop".to_string()
    };
    println!("state       {state}");
    if let Some(e) = &s.last_error {
        println!("last error  {e}");
    }
}

fn check(flags: Flags) -> Result<ExitCode> {
    let cfg = flags.config()?;
    cfg.validate()?;
    daemon::client_config(&cfg).context("TLS files")?;
    daemon::open_sampler(&cfg, &SyntheticHandle::new()).context("measurement sources")?;
    println!(
        "ok: node {} of service {} at {}, reporting to {}",
        cfg.node,
        cfg.service,
        cfg.address,
        cfg.aggregators.join(", ")
    );
    Ok(ExitCode::SUCCESS)
}
