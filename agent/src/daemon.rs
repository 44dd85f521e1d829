//! The running agent: builds the shared state and starts the tasks around it (the
//! report loop, the control socket, the agent-check and the metrics server).

use crate::config::AgentConfig;
use crate::sample::{self, synthetic::SyntheticHandle, AssignmentWatch, SampleError, Sampler};
use crate::shared::{drained_on_disk, DrainFileError, Shared};
use ballast_shared::tls::{self, TlsError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::watch;

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

/// Opens the configured sources. `assignment` is the aggregator's current
/// assignment, for a source that follows the node's weight (the synthetic model);
/// [`sample::no_assignment`] for a measurement without a daemon.
pub fn open_sampler(
    cfg: &AgentConfig,
    synthetic: &SyntheticHandle,
    assignment: &AssignmentWatch,
) -> Result<Sampler, SampleError> {
    let cpu = sample::open_cpu(&cfg.cpu)?;
    let inflight = match &cfg.inflight {
        Some(spec) => sample::open_inflight(spec, synthetic, assignment)?,
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
    /// socket. `cfg` must be resolved and valid. `synthetic` holds the synthetic
    /// model's speed and offered load, when that source is configured, so that a test
    /// can turn them while the agent runs.
    pub async fn start(
        cfg: AgentConfig,
        client: quinn::ClientConfig,
        synthetic: SyntheticHandle,
    ) -> Result<Agent, AgentError> {
        cfg.validate()?;
        let drained = drained_on_disk(&cfg)?;
        let shared = Arc::new(Shared::new(cfg));
        let sampler = open_sampler(&shared.config, &synthetic, &shared.subscribe_assignment())?;
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
