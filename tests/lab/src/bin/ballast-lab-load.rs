//! `ballast-lab-load`: the lab's open-loop load generator (see `ballast_lab::load`).
//! Prints a JSON summary: requests, errors by kind, p50/p99 latency, split by backend,
//! and the keep-alive connections the run opened.

use anyhow::Context;
use ballast_lab::load::{spawn, summarize, LoadSpec, Mode};
use clap::Parser;
use std::net::SocketAddr;
use std::time::Duration;

/// Sends HTTP GETs at a fixed rate (open loop), bounded in time and count.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Where to send requests (e.g. HAProxy's frontend).
    #[arg(long)]
    target: SocketAddr,
    /// Request path.
    #[arg(long, default_value = "/work")]
    path: String,
    /// Requests per second (open loop).
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Open loop: run at this rate instead for `--surge-secs`, from `--surge-at-secs`.
    #[arg(long, requires_all = ["rate", "surge_secs"])]
    surge_rate: Option<f64>,
    /// How long the surge lasts, in seconds.
    #[arg(long, requires = "surge_rate")]
    surge_secs: Option<f64>,
    /// When the surge begins, in seconds from the start.
    #[arg(long, default_value_t = 0.0)]
    surge_at_secs: f64,
    /// Closed loop instead: this many clients, each waiting for its answer.
    #[arg(long)]
    concurrency: Option<usize>,
    /// How long to send, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_secs: f64,
    /// At most this many requests.
    #[arg(long, default_value_t = 1_000_000)]
    max_requests: u64,
    /// Per-request timeout in ms.
    #[arg(long, default_value_t = 15_000)]
    timeout_ms: u64,
    /// Open loop: at most this many requests outstanding (and so connections open);
    /// more are counted as overflow.
    #[arg(long, default_value_t = 4096)]
    max_outstanding: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mode = match (
        args.rate,
        args.concurrency,
        args.surge_rate,
        args.surge_secs,
    ) {
        (Some(rate), None, None, None) => Mode::Open { rate },
        (Some(rate), None, Some(surge_rate), Some(surge_secs)) => Mode::Surge {
            at_secs: args.surge_at_secs,
            surge_rate,
            surge_secs,
            rate,
        },
        (None, Some(concurrency), None, None) => Mode::Closed { concurrency },
        _ => anyhow::bail!("give --rate (open loop) or --concurrency (closed loop)"),
    };
    anyhow::ensure!(
        args.duration_secs.is_finite() && args.duration_secs > 0.0 && args.duration_secs <= 3600.0,
        "--duration-secs must be in (0, 3600]"
    );
    let spec = LoadSpec {
        target: args.target,
        path: args.path,
        mode,
        duration: Duration::from_secs_f64(args.duration_secs),
        max_requests: args.max_requests,
        timeout: Duration::from_millis(args.timeout_ms),
        max_outstanding: args.max_outstanding,
    };
    let run = spawn(spec)?.join()?;
    let elapsed = run.started.elapsed().as_secs_f64();
    let summary = summarize(&run.outcomes);
    let out = serde_json::json!({
        "mode": mode,
        "seconds": elapsed,
        "achieved_rate": summary.ok as f64 / elapsed.max(1e-9),
        "summary": summary,
        "connections": run.connections,
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&out).context("encoding the summary")?
    );
    Ok(())
}
