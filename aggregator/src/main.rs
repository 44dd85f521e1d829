//! `ballast-aggregator`: flags, logging and messages for people. The work is in the
//! library.

use anyhow::{Context, Result};
use ballast_aggregator::cli::{CertsCommand, Cli, Command, ConfigCommand, RunArgs};
use ballast_aggregator::config::{Config, TlsFiles};
use ballast_aggregator::daemon::{self, Daemon};
use ballast_shared::config::init_logging;
use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(RunArgs {
            config: args.config.or(cli.run.config),
            log_json: args.log_json || cli.run.log_json,
            ..args
        }),
        Some(Command::Certs(CertsCommand::Init {
            dir,
            nodes,
            server_names,
        })) => certs_init(&dir, &nodes, server_names),
        Some(Command::Check { config }) => check(&config),
        Some(Command::Config(ConfigCommand::Check { dir })) => config_check(&dir, &cli.run),
        Some(Command::Config(ConfigCommand::Restore { backup, to, exact })) => {
            config_restore(&backup, &to, exact)
        }
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
    if let Some(dir) = &args.config_dir {
        cfg.service_config.dir = Some(dir.clone());
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
    cfg.validate().context("configuration")?;
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
        let mut daemon = Daemon::start(&cfg, identity, &ca).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let failed = tokio::select! {
            _ = tokio::signal::ctrl_c() => None,
            _ = term.recv() => None,
            end = daemon.failed() => Some(end),
        };
        match failed {
            None => {
                tracing::info!("stopping");
                daemon.shutdown().await;
                Ok(ExitCode::SUCCESS)
            }
            Some(end) => {
                tracing::error!(task = end.task, reason = %end.reason,
                    "stopping: a task the daemon needs has ended; exiting non-zero so that \
                     the service manager restarts it");
                daemon.shutdown().await;
                eprintln!("ballast-aggregator: {end}");
                Ok(ExitCode::FAILURE)
            }
        }
    })
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

/// Exit code of `config check` when the directory or the config file cannot be read,
/// so that CI can tell "your file is wrong" (1) from "the check could not run" (2).
const CHECK_UNUSABLE: u8 = 2;

fn config_check(dir: &std::path::Path, args: &RunArgs) -> Result<ExitCode> {
    let defaults = match &args.config {
        Some(path) => match Config::load(path) {
            Ok(cfg) => cfg.balance,
            Err(e) => {
                eprintln!("cannot use {}: {e}", path.display());
                return Ok(ExitCode::from(CHECK_UNUSABLE));
            }
        },
        None => Config::default().balance,
    };
    let verdicts = match ballast_aggregator::config::dir::check(dir, &defaults) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("cannot check: {e}");
            return Ok(ExitCode::from(CHECK_UNUSABLE));
        }
    };
    let mut bad = 0;
    for (file, verdict) in &verdicts {
        match verdict {
            Ok(()) => println!("ok: {file}"),
            Err(e) => {
                bad += 1;
                match e.line {
                    Some(line) => println!("invalid: {file}, line {line}: {}", e.message),
                    None => println!("invalid: {file}: {}", e.message),
                }
            }
        }
    }
    println!(
        "{} file(s) checked in {}, {bad} invalid",
        verdicts.len(),
        dir.display()
    );
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn config_restore(backup: &std::path::Path, to: &std::path::Path, exact: bool) -> Result<ExitCode> {
    let (written, removed) = ballast_aggregator::config::dir::restore(backup, to, exact)?;
    for f in &written {
        println!("restored {}", to.join(f).display());
    }
    for f in &removed {
        println!("removed {}", to.join(f).display());
    }
    Ok(ExitCode::SUCCESS)
}
