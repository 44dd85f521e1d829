//! `ballast-lab-backend`: the lab's CPU-bound HTTP backend (see `ballast_lab::backend`).

use anyhow::Context;
use ballast_lab::backend::{serve, BackendConfig};
use clap::Parser;
use std::net::SocketAddr;
use std::time::Duration;

/// How long in-flight requests may take to finish after SIGTERM before the process exits.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A CPU-bound HTTP/1.1 backend for Ballast's lab.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Name returned in every answer (`X-Backend`).
    #[arg(long)]
    name: String,
    /// Hash rounds per request.
    #[arg(long, default_value_t = 100_000)]
    rounds: u64,
    /// Stall every request this many ms instead of burning CPU (0: burn).
    #[arg(long, default_value_t = 0)]
    stall_ms: u64,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers.max(1))
        .enable_all()
        .build()
        .context("building the runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot bind {}", args.listen))?;
        let cfg = BackendConfig {
            name: args.name.clone(),
            rounds: args.rounds,
            stall_ms: args.stall_ms,
        };
        eprintln!(
            "ballast-lab-backend {} listening on {} ({} rounds per request)",
            cfg.name, args.listen, cfg.rounds
        );
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("cannot watch SIGTERM: {e}");
                        return;
                    }
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            let _ = stop_tx.send(true);
        });
        let mut graceful = stop_rx.clone();
        let server = serve(listener, &cfg, async move {
            let _ = graceful.wait_for(|s| *s).await;
        });
        // Graceful shutdown waits for open connections; a client that holds one open
        // must not keep the process alive past the grace period.
        tokio::select! {
            r = server => r.context("serving")?,
            _ = async {
                let _ = stop_rx.wait_for(|s| *s).await;
                tokio::time::sleep(STOP_GRACE).await;
            } => eprintln!("connections still open after {STOP_GRACE:?}: exiting"),
        }
        eprintln!("ballast-lab-backend {} stopped", cfg.name);
        Ok(())
    })
}
