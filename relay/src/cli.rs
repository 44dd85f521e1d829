//! The `ballast-relay` command line, in the library so that man pages and shell
//! completions can be generated from it, and so that `ballast-aggregator relay` (kept
//! for a release as an alias) runs the same relay.

use crate::{Config, Relay};
use ballast_config::cli::{FlagError, RelayArgs};
use ballast_config::{ConfigError, InvalidSetting};
use clap::Parser;
use std::process::ExitCode;

/// Ballast relay: agents connect to it as to an aggregator, and it hands their hellos
/// and reports on to the cluster replica that owns each agent's service. Needs
/// --replica (or [relay] replicas).
///
/// The relay learns which replica owns what from the replicas themselves: it asks
/// one at a time, at its QUIC address, with the routes protocol (ballast-routes/1) and
/// its relay certificate (--relay-tls-dir), first the addresses it is given, then every
/// member the routes name. The replicas' policy must list it, as for its trunks. It
/// reads no etcd and holds no etcd credential: [relay.etcd] is no longer read, and
/// the etcd flags amend only [store.etcd], which the relay does not read either
/// (docs/security.md).
#[derive(Parser)]
#[command(name = "ballast-relay", version, about)]
pub struct Cli {
    /// The relay's flags.
    #[command(flatten)]
    pub args: RelayArgs,
}

/// Why `ballast-relay` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration file could not be read.
    #[error(transparent)]
    Read(#[from] ConfigError),
    /// A flag amends a table the configuration lacks.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// The configuration, with the flags, is not usable.
    #[error("{origin}: {setting}")]
    Invalid {
        /// Where it came from.
        origin: String,
        /// What is wrong.
        setting: InvalidSetting,
    },
    /// The runtime or the signal handlers could not be set up.
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
    /// The relay could not start.
    #[error(transparent)]
    Start(#[from] crate::RelayError),
}

/// The relay's configuration: the file `args` name (or the defaults), amended by the
/// flags, with a `[relay]` table with its defaults if the file has none; validated,
/// and refused if it would serve `/metrics` off loopback without TLS and a credential
/// (unless `insecure_http`).
pub fn config(args: &RelayArgs) -> Result<Config, RunError> {
    let mut cfg = match &args.common.config {
        // Checked once the flags are in: a file may leave to them what its checks need.
        Some(path) => Config::read(path)?,
        None => Config::default(),
    };
    args.apply(&mut cfg)?;
    let invalid = |setting| RunError::Invalid {
        origin: args.common.origin(),
        setting,
    };
    cfg.validate().map_err(invalid)?;
    cfg.check_relay_http_exposure().map_err(invalid)?;
    Ok(cfg)
}

/// Runs the relay `args` describe until SIGINT or SIGTERM (success), or until a task
/// it needs ends (failure: the service manager restarts it). `program` names the
/// command in the message of such an end. Logging is the caller's to set up.
pub fn run(args: &RelayArgs, program: &str) -> Result<ExitCode, RunError> {
    let cfg = config(args)?;
    let ignored = args.ignored_etcd_flags();
    if !ignored.is_empty() {
        tracing::warn!(
            flags = ?ignored,
            "etcd flags are not read by a relay: it learns the routes from the replicas; \
             remove them from its unit or environment"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut relay = Relay::start(&cfg).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let failed = tokio::select! {
            _ = tokio::signal::ctrl_c() => None,
            _ = term.recv() => None,
            end = relay.failed() => Some(end),
        };
        tracing::info!("stopping");
        relay.shutdown().await;
        match failed {
            None => Ok(ExitCode::SUCCESS),
            Some(end) => {
                eprintln!("{program}: {end}");
                Ok(ExitCode::FAILURE)
            }
        }
    })
}
