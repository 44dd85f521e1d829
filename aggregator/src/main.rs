//! `ballast-aggregator`: flags, logging and messages for people. The work is in the
//! library.

use anyhow::{Context, Result};
use ballast_aggregator::config::{Config, TlsFiles};
use ballast_aggregator::daemon::{self, Daemon};
use ballast_aggregator::demo::{self, DemoOptions};
use ballast_shared::config::init_logging;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Ballast aggregator: one PID controller per endpoint, weights for your load balancers.
#[derive(Parser)]
#[command(name = "ballast-aggregator", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run the aggregator daemon (the default).
    Run(RunArgs),
    /// Start an aggregator and a fleet of real agents on loopback and watch them converge.
    Demo(DemoArgs),
    /// Compare balancing strategies on simulated fleets; write docs/balance.md and charts.
    Simulate {
        /// Directory for balance.md and img/ (the repository's docs/).
        #[arg(long, default_value = "docs")]
        out: PathBuf,
        /// Random seed; the same seed gives the same numbers.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Fewer ticks per scenario, for a quick look.
        #[arg(long)]
        quick: bool,
        /// Only these scenarios (comma-separated names).
        #[arg(long, value_delimiter = ',')]
        scenario: Vec<String>,
    },
    /// Certificates for a first deployment.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Validate a configuration file and exit: 0 if valid, 1 if not.
    Check {
        /// The file.
        #[arg(long, short, env = "BALLAST_CONFIG")]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Create a CA, a server certificate and node certificates in DIR (an existing CA is reused).
    Init {
        /// Output directory.
        dir: PathBuf,
        /// Node identities to issue certificates for (comma-separated).
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// Names the server certificate covers (default: localhost, 127.0.0.1, ::1, host name).
        #[arg(long = "server-name", value_delimiter = ',')]
        server_names: Vec<String>,
    },
}

#[derive(Args, Clone, Default)]
struct RunArgs {
    /// TOML configuration file.
    #[arg(long, short, env = "BALLAST_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// UDP address for agents (QUIC).
    #[arg(long, env = "BALLAST_QUIC")]
    quic: Option<SocketAddr>,
    /// TCP address of the HTTP API.
    #[arg(long, env = "BALLAST_HTTP")]
    http: Option<SocketAddr>,
    /// TCP address of the xDS (ADS) server for Envoy and proxyless gRPC (off by default).
    #[arg(long, env = "BALLAST_XDS")]
    xds: Option<SocketAddr>,
    /// Directory with ca.pem, server.pem and server.key.
    #[arg(long, env = "BALLAST_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Routing store file.
    #[arg(long, env = "BALLAST_STORE")]
    store: Option<PathBuf>,
    /// Keep weights in etcd at these endpoints (comma-separated URLs) instead of the
    /// store file. Needs a binary built with the `etcd` feature.
    #[arg(long, env = "BALLAST_ETCD", value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// Key prefix in etcd (default /ballast); needs --etcd or [store.etcd].
    #[arg(long, env = "BALLAST_ETCD_PREFIX")]
    etcd_prefix: Option<String>,
    /// Balancing cycle in milliseconds.
    #[arg(long, env = "BALLAST_CYCLE_MS")]
    cycle_ms: Option<u64>,
    /// Start-up grace period in milliseconds.
    #[arg(long, env = "BALLAST_GRACE_MS")]
    grace_ms: Option<u64>,
    /// Report interval agents are told to use, in milliseconds.
    #[arg(long, env = "BALLAST_REPORT_INTERVAL_MS")]
    report_interval_ms: Option<u32>,
    /// Log as JSON lines.
    #[arg(long, env = "BALLAST_LOG_JSON", global = true)]
    log_json: bool,
}

#[derive(Args)]
struct DemoArgs {
    /// Number of agents.
    #[arg(long, default_value_t = 12)]
    nodes: usize,
    /// Cycles to show.
    #[arg(long, default_value_t = 30)]
    cycles: u64,
    /// Cycle length in milliseconds.
    #[arg(long, default_value_t = 500)]
    cycle_ms: u64,
    /// Offered load at equal weights, 0 to 1.
    #[arg(long, default_value_t = 0.6)]
    offered: f64,
    /// Relative node speeds, assigned in turn.
    #[arg(long, value_delimiter = ',', default_value = "0.6,1.0,1.5")]
    speeds: Vec<f64>,
    /// HTTP API address.
    #[arg(long, default_value = "127.0.0.1:7401")]
    http: SocketAddr,
    /// Keep the API up after the summary until Ctrl-C.
    #[arg(long)]
    hold: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(RunArgs {
            config: args.config.or(cli.run.config),
            log_json: args.log_json || cli.run.log_json,
            ..args
        }),
        Some(Command::Demo(args)) => demo(args),
        Some(Command::Certs(CertsCommand::Init {
            dir,
            nodes,
            server_names,
        })) => certs_init(&dir, &nodes, server_names),
        Some(Command::Check { config }) => check(&config),
        Some(Command::Simulate {
            out,
            seed,
            quick,
            scenario,
        }) => simulate(out, seed, quick, scenario),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "ballast-aggregator: {}",
                ballast_shared::error_chain(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

fn config(args: &RunArgs) -> Result<Config> {
    let mut cfg = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(v) = args.quic {
        cfg.quic = v;
    }
    if let Some(v) = args.http {
        cfg.http = v;
    }
    if let Some(v) = args.xds {
        cfg.xds = Some(v);
    }
    if let Some(dir) = &args.tls_dir {
        cfg.tls = TlsFiles::in_dir(dir, "server");
    }
    if let Some(v) = &args.store {
        cfg.store.path = v.clone();
    }
    if let Some(endpoints) = &args.etcd {
        cfg.store
            .etcd
            .get_or_insert_with(Default::default)
            .endpoints = endpoints.clone();
    }
    if let Some(prefix) = &args.etcd_prefix {
        cfg.store
            .etcd
            .as_mut()
            .context("--etcd-prefix needs --etcd or a [store.etcd] table")?
            .prefix = prefix.clone();
    }
    if let Some(v) = args.cycle_ms {
        cfg.balance.cycle_ms = v;
    }
    if let Some(v) = args.grace_ms {
        cfg.balance.grace_ms = v;
    }
    if let Some(v) = args.report_interval_ms {
        cfg.report_interval_ms = v;
    }
    cfg.validate()
        .map_err(anyhow::Error::msg)
        .context("configuration")?;
    Ok(cfg)
}

fn run(args: RunArgs) -> Result<ExitCode> {
    init_logging(args.log_json, "info");
    let cfg = config(&args)?;
    let (identity, ca) = daemon::load_tls(&cfg)
        .context("loading TLS files (create them with `ballast-aggregator certs init DIR`)")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let daemon = Daemon::start(&cfg, identity, &ca).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        daemon.shutdown().await;
        Ok(ExitCode::SUCCESS)
    })
}

fn demo(args: DemoArgs) -> Result<ExitCode> {
    init_logging(false, "warn");
    anyhow::ensure!(
        args.nodes >= 2 && args.nodes <= 500,
        "--nodes must be between 2 and 500"
    );
    anyhow::ensure!(
        !args.speeds.is_empty() && args.speeds.iter().all(|s| *s > 0.0 && s.is_finite()),
        "--speeds must be positive"
    );
    anyhow::ensure!(
        (0.01..=2.0).contains(&args.offered),
        "--offered must be between 0.01 and 2"
    );
    anyhow::ensure!(
        (50..=10_000).contains(&args.cycle_ms),
        "--cycle-ms must be between 50 and 10000"
    );
    let opts = DemoOptions {
        nodes: args.nodes,
        speeds: args.speeds,
        offered: args.offered,
        cycles: args.cycles,
        cycle_ms: args.cycle_ms,
        http: args.http,
        hold: args.hold,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let summary = rt.block_on(async move {
        let mut out = std::io::stdout();
        demo::run(&opts, &mut out).await
    })?;
    Ok(if summary.last.max_over_avg <= 1.05 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

fn simulate(out: PathBuf, seed: u64, quick: bool, scenario: Vec<String>) -> Result<ExitCode> {
    let opts = ballast_aggregator::simulate::SimOptions {
        seed,
        out_dir: out,
        quick,
        scenarios: if scenario.is_empty() {
            None
        } else {
            Some(scenario)
        },
    };
    let summary = ballast_aggregator::simulate::run(&opts)?;
    for path in &summary.written {
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn certs_init(dir: &std::path::Path, nodes: &[String], names: Vec<String>) -> Result<ExitCode> {
    let names = if names.is_empty() {
        ballast_aggregator::certs::default_server_names()
    } else {
        names
    };
    let written = ballast_aggregator::certs::init(dir, &names, nodes)?;
    for w in written {
        println!("wrote {w}");
    }
    println!("server certificate names: {}", names.join(", "));
    Ok(ExitCode::SUCCESS)
}

fn check(path: &std::path::Path) -> Result<ExitCode> {
    match Config::load(path) {
        Ok(_) => {
            println!("ok: {}", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("invalid: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
