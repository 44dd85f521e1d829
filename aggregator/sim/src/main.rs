//! `ballast-sim`: the live demo and the fleet simulator, flags and messages for people.
//! The work is in the library.

use anyhow::Result;
use ballast_shared::config::init_logging;
use ballast_sim::demo::{self, DemoOptions};
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Ballast's demo and simulator: watch a fleet converge, or compare strategies.
#[derive(Parser)]
#[command(name = "ballast-sim", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
}

/// The demo's fleet and pace.
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
        Command::Demo(args) => demo(args),
        Command::Simulate {
            out,
            seed,
            quick,
            scenario,
        } => simulate(out, seed, quick, scenario),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ballast-sim: {}", ballast_shared::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
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
    let opts = ballast_sim::simulate::SimOptions {
        seed,
        out_dir: out,
        quick,
        scenarios: if scenario.is_empty() {
            None
        } else {
            Some(scenario)
        },
    };
    let summary = ballast_sim::simulate::run(&opts)?;
    for path in &summary.written {
        println!("wrote {}", path.display());
    }
    let missed = ballast_sim::simulate::headline::missed(&summary);
    if missed.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for target in &missed {
        eprintln!("target missed: {target}");
    }
    Ok(ExitCode::FAILURE)
}
