//! The running agent: the report loop and the control socket around shared state.

use crate::config::AgentConfig;
use crate::sample::{self, synthetic::SyntheticHandle, SampleError, Sampler};
use crate::status::Status;
use ballast_shared::tls::{self, TlsError};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// What the report loop, the control socket and the CLI share.
pub struct Shared {
    /// The resolved configuration.
    pub config: AgentConfig,
    /// The agent's status.
    status: Mutex<Status>,
    /// Set by `drain`, cleared by `undrain`.
    pub draining: AtomicBool,
    /// The synthetic model's inputs, when that source is in use.
    pub synthetic: SyntheticHandle,
    /// Counters for `/metrics` that the status does not hold.
    pub metrics: crate::metrics::Metrics,
}

impl Shared {
    /// Shared state for a configuration.
    pub fn new(config: AgentConfig, synthetic: SyntheticHandle) -> Self {
        let status = Status {
            node: config.node.clone(),
            service: config.service.clone(),
            ..Status::default()
        };
        Shared {
            config,
            status: Mutex::new(status),
            draining: AtomicBool::new(false),
            synthetic,
            metrics: crate::metrics::Metrics::default(),
        }
    }

    /// Starts (`true`) or ends a drain, and records it in the drain file so that a
    /// restarted agent keeps it. The drain takes effect even when the file cannot be
    /// written: taking traffic off a node must not depend on its disk. The error says
    /// what will not survive a restart.
    pub fn set_draining(&self, on: bool) -> Result<(), DrainFileError> {
        let was = self.draining.swap(on, Ordering::Relaxed);
        self.update(|s| {
            s.draining = on;
            // The quiet period counts from the drain: a node idle before it proves
            // nothing about the load balancers having seen it. A repeated drain (a
            // script that retries) does not start it again.
            if on != was {
                s.inflight_zero_since_unix_ms = None;
            }
        });
        match self.config.drain_path() {
            Some(path) if on => write_drain_file(path),
            Some(path) => match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(DrainFileError {
                    path: path.display().to_string(),
                    source: e,
                }),
                _ => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Whether stopping the service is safe now, by the configured quiet period; a
    /// sample older than three report intervals is too old to tell.
    pub fn stop_verdict(&self, status: &Status, now_unix_ms: u64) -> crate::status::StopVerdict {
        let max_age = u64::from(self.config.interval_ms) * 3;
        status.stop_verdict(now_unix_ms, self.config.drain_quiet_ms, max_age)
    }

    /// A copy of the status.
    pub fn status(&self) -> Status {
        self.status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Changes the status in place.
    pub fn update(&self, f: impl FnOnce(&mut Status)) {
        let mut guard = self.status.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard);
    }
}

/// The drain file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("drain file {path}: {source}")]
pub struct DrainFileError {
    /// The file.
    pub path: String,
    /// The cause.
    pub source: std::io::Error,
}

/// Writes the drain file atomically (a temporary file renamed over it), creating its
/// directory.
fn write_drain_file(path: &Path) -> Result<(), DrainFileError> {
    let err = |source| DrainFileError {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("drained.tmp");
    let text = format!(
        "drained at {} ms since the Unix epoch; `ballast-agent undrain` ends it\n",
        ballast_shared::unix_ms()
    );
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Whether the drain file says the node is drained. A file that cannot be looked at
/// is an error: starting undrained could send traffic to a node under maintenance.
pub fn drained_on_disk(cfg: &AgentConfig) -> Result<bool, DrainFileError> {
    let Some(path) = cfg.drain_path() else {
        return Ok(false);
    };
    match std::fs::metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DrainFileError {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// TLS material is missing or invalid.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A measurement source could not be opened.
    #[error(transparent)]
    Sample(#[from] SampleError),
    /// The agent-check port could not be bound.
    #[error("agent-check port {addr}: {source}")]
    AgentCheck {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The metrics port could not be bound.
    #[error("metrics port {addr}: {source}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The drain file could not be read.
    #[error(transparent)]
    DrainFile(#[from] DrainFileError),
    /// The control socket could not be opened.
    #[error("control socket {path}: {source}")]
    Control {
        /// The socket.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// The QUIC client configuration from the configured TLS files.
pub fn client_config(cfg: &AgentConfig) -> Result<quinn::ClientConfig, TlsError> {
    tls::client_config(cfg.tls.identity()?, &cfg.tls.ca_certs()?)
}

/// Opens the configured sources.
pub fn open_sampler(
    cfg: &AgentConfig,
    synthetic: &SyntheticHandle,
) -> Result<Sampler, SampleError> {
    let cpu = sample::open_cpu(&cfg.cpu)?;
    let inflight = match &cfg.inflight {
        Some(spec) => sample::open_inflight(spec, synthetic)?,
        None => None,
    };
    Ok(Sampler::new(cpu, inflight, cfg.capacity))
}

/// A running agent.
pub struct Agent {
    /// Its shared state.
    pub shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Agent {
    /// Starts the report loop and, if `control` is set in the config, the control
    /// socket. `cfg` must be resolved and valid.
    pub async fn start(
        cfg: AgentConfig,
        client: quinn::ClientConfig,
        synthetic: SyntheticHandle,
    ) -> Result<Agent, AgentError> {
        cfg.validate()?;
        let sampler = open_sampler(&cfg, &synthetic)?;
        let drained = drained_on_disk(&cfg)?;
        let shared = Arc::new(Shared::new(cfg, synthetic));
        if drained {
            shared.draining.store(true, Ordering::Relaxed);
            shared.update(|s| s.draining = true);
            tracing::warn!(
                drain_file = %shared.config.drain_path().map(|p| p.display().to_string()).unwrap_or_default(),
                "starting drained, as before the restart: `ballast-agent undrain` brings the node back"
            );
        }
        let (shutdown, rx) = watch::channel(false);
        let mut tasks = Vec::new();
        let control = shared.config.control_socket.clone();
        if !control.as_os_str().is_empty() {
            // Bind now so that a bad path is an error at start, not a silent log line.
            let sh = shared.clone();
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            tasks.push(tokio::spawn(async move {
                let result = crate::control::serve(control, sh, ready_tx).await;
                if let Err(e) = result {
                    tracing::error!(error = %e, "control socket stopped");
                }
            }));
            if let Ok(Err(source)) = ready_rx.await {
                return Err(AgentError::Control {
                    path: shared.config.control_socket.display().to_string(),
                    source,
                });
            }
        }
        if let Some(addr) = shared.config.agent_check {
            let listener = crate::agentcheck::bind(addr)
                .await
                .map_err(|source| AgentError::AgentCheck { addr, source })?;
            tasks.push(tokio::spawn(crate::agentcheck::serve(
                listener,
                shared.clone(),
            )));
        }
        if let Some(addr) = shared.config.metrics {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AgentError::Metrics { addr, source })?;
            tasks.push(tokio::spawn(crate::metrics::serve(
                listener,
                shared.clone(),
            )));
        }
        tasks.push(tokio::spawn(crate::report::run(
            shared.clone(),
            sampler,
            client,
            rx,
        )));
        Ok(Agent {
            shared,
            shutdown,
            tasks,
        })
    }

    /// Stops reporting and closes the connection cleanly.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let mut tasks = self.tasks;
        if let Some(report) = tasks.pop() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), report).await;
        }
        for t in tasks {
            t.abort();
        }
        let path = &self.shared.config.control_socket;
        if !path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_survives_in_the_drain_file_until_undrain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = AgentConfig {
            control_socket: dir.path().join("run/agent.sock"),
            ..AgentConfig::default()
        }
        .resolve();
        let file = dir.path().join("run/agent.drained");
        assert_eq!(cfg.drain_path(), Some(file.as_path()));
        assert!(!drained_on_disk(&cfg).expect("readable"));
        let shared = Shared::new(cfg.clone(), SyntheticHandle::new());
        shared.update(|s| s.inflight_zero_since_unix_ms = Some(1));
        shared.set_draining(true).expect("written");
        assert!(shared.status().draining);
        assert_eq!(
            shared.status().inflight_zero_since_unix_ms,
            None,
            "the quiet period restarts at the drain"
        );
        assert!(drained_on_disk(&cfg).expect("readable"), "{file:?}");
        shared.update(|s| s.inflight_zero_since_unix_ms = Some(2));
        shared.set_draining(true).expect("drain twice is fine");
        assert_eq!(
            shared.status().inflight_zero_since_unix_ms,
            Some(2),
            "a repeated drain keeps the quiet period"
        );
        shared.set_draining(false).expect("removed");
        assert!(!drained_on_disk(&cfg).expect("readable"));
        shared.set_draining(false).expect("undrain twice is fine");

        // A drain file that cannot be written: the drain still holds, with the error.
        let blocked = AgentConfig {
            drain_file: Some(dir.path().join("not-a-dir")),
            ..AgentConfig::default()
        };
        std::fs::create_dir_all(dir.path().join("not-a-dir/x")).expect("a directory");
        let shared = Shared::new(blocked, SyntheticHandle::new());
        let err = shared
            .set_draining(true)
            .expect_err("a directory is in the way");
        assert!(err.to_string().contains("not-a-dir"), "{err}");
        assert!(shared.draining.load(Ordering::Relaxed) && shared.status().draining);
    }
}
