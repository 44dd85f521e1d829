//! The running agent: builds the shared state and starts the tasks around it (the
//! report loop, the control socket, the agent-check and the metrics server).

use crate::config::AgentConfig;
use crate::sample::{self, synthetic::SyntheticHandle, AssignmentWatch, SampleError, Sampler};
use crate::shared::{drained_on_disk, DrainFileError, Shared};
use ballast_shared::protocol;
use ballast_shared::tls::live::LiveTls;
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
    /// `BALLAST_PROTOCOL` names no set of protocol versions.
    #[error(transparent)]
    Protocol(#[from] ballast_shared::protocol::UnknownChoice),
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

/// The QUIC client configuration from the configured TLS files, offering every
/// version of the protocol this build speaks, current first (`BALLAST_PROTOCOL` may
/// narrow them: [`ballast_shared::protocol`]). The aggregator picks the newest it
/// speaks too.
pub fn client_config(cfg: &AgentConfig) -> Result<quinn::ClientConfig, AgentError> {
    let alpns = protocol::alpns(&protocol::from_env()?);
    Ok(tls::client_config_with_alpns(
        cfg.tls.identity()?,
        &cfg.tls.ca_certs()?,
        &alpns,
    )?)
}

/// The configured TLS files, loaded to be watched ([`LiveTls::watch`]); and the QUIC
/// client configuration that presents the certificate in force at each handshake.
/// Like [`client_config`], it offers every version of the protocol this build speaks.
pub fn live_client_config(
    cfg: &AgentConfig,
) -> Result<(Arc<LiveTls>, quinn::ClientConfig), AgentError> {
    let alpns = protocol::alpns(&protocol::from_env()?);
    let live = LiveTls::client(&cfg.tls)?;
    let client = tls::client_config_live(&live, &alpns)?;
    Ok((live, client))
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

/// When the node's certificate expires, in milliseconds since the Unix epoch; `None`
/// if it cannot be read (the TLS set-up reports that).
fn certificate_expiry(cfg: &AgentConfig) -> Option<u64> {
    let pem = tls::read(&cfg.tls.cert).ok()?;
    let chain = tls::certs_from_pem(&pem, "node certificate").ok()?;
    let info = tls::CertInfo::parse(chain.first()?).ok()?;
    u64::try_from(info.not_after_unix_s).ok()?.checked_mul(1000)
}

/// What the node's certificate will make the aggregator refuse, in words, for
/// `ballast-agent check`: another node's name, a service it does not name (the
/// aggregator's policy may still grant it), or an expiry within 30 days.
pub fn certificate_notes(cfg: &AgentConfig, now_unix_ms: u64) -> Vec<String> {
    let mut notes = Vec::new();
    let Some(info) = tls::read(&cfg.tls.cert)
        .ok()
        .and_then(|pem| tls::certs_from_pem(&pem, "node certificate").ok())
        .and_then(|chain| tls::CertInfo::parse(chain.first()?).ok())
    else {
        return notes;
    };
    if info.identity != cfg.node {
        notes.push(format!(
            "the certificate names node {:?}, not {:?}: the aggregator refuses the hello \
             (identity_mismatch)",
            info.identity, cfg.node
        ));
    }
    if info.services.is_empty() {
        notes.push(format!(
            "the certificate names no service: the aggregator refuses service {:?} \
             (service_not_allowed) unless its policy grants it",
            cfg.service
        ));
    } else if !info.services.contains(&cfg.service) {
        notes.push(format!(
            "the certificate allows service(s) {}, not {:?}: the aggregator refuses the \
             hello (service_not_allowed) unless its policy grants it",
            info.services.join(", "),
            cfg.service
        ));
    }
    let status = crate::status::Status {
        certificate_expires_unix_ms: u64::try_from(info.not_after_unix_s)
            .ok()
            .and_then(|s| s.checked_mul(1000)),
        ..Default::default()
    };
    notes.extend(status.certificate_warning(now_unix_ms));
    notes
}

/// Warns in the log, once a day, from 30 days before the node's certificate expires.
async fn watch_certificate(shared: Arc<Shared>) {
    const DAY_MS: u64 = 24 * 3600 * 1000;
    loop {
        let status = shared.status();
        let Some(expires) = status.certificate_expires_unix_ms else {
            return;
        };
        let now = ballast_shared::unix_ms();
        let expires_at = ballast_shared::pki::rfc3339(i64::try_from(expires / 1000).unwrap_or(0));
        let wait_ms = match status.certificate_warning(now) {
            Some(w) if now >= expires => {
                tracing::error!(certificate = %shared.config.tls.cert.display(), expired = %expires_at, "{w}");
                DAY_MS
            }
            Some(w) => {
                tracing::warn!(certificate = %shared.config.tls.cert.display(), expires = %expires_at, "{w}");
                DAY_MS.min(expires - now)
            }
            None => (expires - now)
                .saturating_sub(crate::status::CERTIFICATE_WARNING_MS)
                .clamp(1000, DAY_MS),
        };
        tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
    }
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
    /// can turn them while the agent runs. The TLS files are watched: a renewed
    /// certificate moves the session to a connection made with it.
    pub async fn start(cfg: AgentConfig, synthetic: SyntheticHandle) -> Result<Agent, AgentError> {
        let (live, client) = live_client_config(&cfg)?;
        Self::start_with(cfg, client, Some(live), synthetic).await
    }

    /// [`Agent::start`] with the client configuration `client`, made in memory: no
    /// file is watched, and the certificate never changes.
    pub async fn start_in_memory(
        cfg: AgentConfig,
        client: quinn::ClientConfig,
        synthetic: SyntheticHandle,
    ) -> Result<Agent, AgentError> {
        Self::start_with(cfg, client, None, synthetic).await
    }

    async fn start_with(
        cfg: AgentConfig,
        client: quinn::ClientConfig,
        live: Option<Arc<LiveTls>>,
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
        let expires = certificate_expiry(&shared.config);
        shared.update(|s| s.certificate_expires_unix_ms = expires);
        if expires.is_some() {
            tasks.push(tokio::spawn(watch_certificate(shared.clone())));
        }
        if let Some(live) = &live {
            tasks.push(tokio::spawn(live.clone().watch(
                ballast_shared::tls::live::CHECK_EVERY,
                shared.metrics.tls_reloads.counter(),
            )));
        }
        // Made in memory, the certificate's key is the configured file's if there is
        // one: a relay's primary asks for proofs made with it.
        let key = match &live {
            Some(_) => None,
            None => shared
                .config
                .tls
                .identity()
                .ok()
                .and_then(|id| ballast_shared::session::proof::signing_key(&id.key).ok()),
        };
        // Last: `stop` waits for the report loop to say goodbye.
        tasks.push(tokio::spawn(crate::report::run(
            shared.clone(),
            sampler,
            crate::report::Tls { client, live, key },
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
    use ballast_shared::config::TlsFiles;
    use ballast_shared::pki::{Ca, NodeSpec};

    fn config_with(dir: &std::path::Path, spec: &NodeSpec, service: &str) -> AgentConfig {
        let ca = Ca::generate("test CA").expect("ca");
        ca.issue_node_with(spec)
            .expect("issue")
            .pem
            .write(dir, "node")
            .expect("write");
        AgentConfig {
            service: service.into(),
            node: "web-1".into(),
            tls: TlsFiles::in_dir(dir, "node"),
            ..AgentConfig::default()
        }
    }

    #[test]
    fn check_says_what_the_certificate_will_make_the_aggregator_refuse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let year = std::time::Duration::from_secs(365 * 86_400);
        let now = ballast_shared::unix_ms();
        let web = vec!["web".to_string()];
        let good = NodeSpec::new("web-1", &web, year).expect("spec");
        let cfg = config_with(dir.path(), &good, "web");
        assert_eq!(certificate_notes(&cfg, now), Vec::<String>::new());
        assert_eq!(
            certificate_expiry(&cfg),
            Some(u64::try_from(good.not_after_unix_s).expect("time") * 1000)
        );

        let cfg = config_with(dir.path(), &good, "payments");
        let notes = certificate_notes(&cfg, now);
        assert!(
            notes.len() == 1 && notes[0].contains("not \"payments\""),
            "{notes:?}"
        );

        let other =
            NodeSpec::new("web-2", &[], std::time::Duration::from_secs(86_400)).expect("spec");
        let notes = certificate_notes(&config_with(dir.path(), &other, "web"), now);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes[0].contains("identity_mismatch"), "{notes:?}");
        assert!(notes[1].contains("names no service"), "{notes:?}");
        assert!(notes[2].contains("expires in 1.0 days"), "{notes:?}");
    }
}
