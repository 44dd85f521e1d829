//! The running agent: the report loop and the control socket around shared state.

use crate::config::AgentConfig;
use crate::sample::{self, synthetic::SyntheticHandle, SampleError, Sampler};
use crate::status::Status;
use ballast_shared::tls::{self, TlsError};
use std::sync::atomic::AtomicBool;
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
        }
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
        let shared = Arc::new(Shared::new(cfg, synthetic));
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
