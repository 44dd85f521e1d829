//! Report ingest: agents connect over QUIC with mutual TLS.
//!
//! Who may claim what is decided here, before anything reaches the balancer: the
//! handshake checks each client certificate's chain, lifetime and revocation
//! ([`revocation`]), and each hello is checked against what its certificate and the
//! authorization policy grant ([`policy`]) and, with a config directory that accepts
//! no unknown services, against the services that have a file.

mod limits;
pub(crate) mod local;
pub(crate) mod policy;
pub(crate) mod quic;
pub(crate) mod revocation;
pub(crate) mod threads;
mod trunk;
pub(crate) mod upstream;

pub use policy::PolicyError;
pub use threads::ThreadsError;

use crate::config::Config;
use ballast_shared::protocol;
use ballast_shared::tls::live::LiveTls;
use ballast_shared::tls::{self, CertificateDer, Identity, TlsError};
use ballast_shared::trunk::TrunkProtocol;
use policy::Policy;
use revocation::Revocation;
use std::sync::Arc;

/// Why ingest could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The authorization policy file is unusable.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The certificate revocation list is unusable.
    #[error("certificate revocation list {path}: {source}")]
    Crl {
        /// The file.
        path: String,
        /// The cause.
        source: TlsError,
    },
    /// The TLS configuration could not be built.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Settings that cannot work together.
    #[error(transparent)]
    Setting(#[from] crate::config::InvalidSetting),
    /// `BALLAST_PROTOCOL` names no set of agent protocol versions.
    #[error(transparent)]
    Protocol(#[from] ballast_shared::protocol::UnknownChoice),
}

/// What ingest needs besides the daemon's state: the policy, the revocation list and
/// the config directory's rule for unknown services.
pub(crate) struct Ingest {
    policy: Policy,
    revocation: Arc<Revocation>,
    /// Hellos for services without a file in the config directory are refused.
    require_service_file: bool,
    /// What connections and nodes may cost.
    limits: crate::config::limits::Limits,
    /// The connections open now.
    connections: Arc<limits::Connections>,
    /// The server's certificate and the client CAs, taken from their files while the
    /// server runs.
    tls: Arc<LiveTls>,
}

impl Ingest {
    /// The server's certificate as its files give it now, for other listeners that
    /// present the same one (xDS).
    pub(crate) fn live_tls(&self) -> Arc<LiveTls> {
        self.tls.clone()
    }

    /// The revocation list and client CAs in force, for other listeners that check
    /// client certificates the same way (xDS in mutual mode).
    pub(crate) fn revocation(&self) -> Arc<Revocation> {
        self.revocation.clone()
    }
}

/// What an aggregator's QUIC server offers: agents' connections in every version of
/// their protocol it speaks (current first, so that an agent that offers both gets
/// the current), and relays' trunks in every version of theirs.
pub(crate) fn aggregator_alpns() -> Result<Vec<&'static [u8]>, IngestError> {
    let mut alpns = agent_alpns()?;
    alpns.extend(
        TrunkProtocol::from_env()?
            .into_iter()
            .map(TrunkProtocol::alpn),
    );
    Ok(alpns)
}

/// What a server that takes agents only offers (a relay's, facing its agents): every
/// version of their protocol, current first, unless `BALLAST_PROTOCOL` narrows them.
pub(crate) fn agent_alpns() -> Result<Vec<&'static [u8]>, IngestError> {
    Ok(protocol::alpns(&protocol::from_env()?))
}

/// Loads the policy and the revocation list named in `cfg` and builds the QUIC server
/// configuration whose handshakes check client certificates against `client_ca` and
/// the revocation list, offering agents' connections and relays' trunks
/// ([`aggregator_alpns`]). A bad policy or list stops the start with its reason.
pub(crate) fn setup(
    cfg: &Config,
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
) -> Result<(quinn::ServerConfig, Ingest), IngestError> {
    setup_with(cfg, identity, client_ca, &aggregator_alpns()?)
}

/// [`setup`], its server offering the application protocols `alpns` only: a server
/// that takes no trunks offers [`agent_alpns`].
pub(crate) fn setup_with(
    cfg: &Config,
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
    alpns: &[&[u8]],
) -> Result<(quinn::ServerConfig, Ingest), IngestError> {
    if !cfg.service_config.accept_unknown_services && cfg.service_config.dir.is_none() {
        return Err(crate::config::InvalidSetting::new(
            "service_config.accept_unknown_services",
            "false needs a config directory (service_config.dir or --config-dir): without \
             one no service has a file, and every hello would be refused",
        )
        .into());
    }
    let auth = &cfg.authorization;
    let policy = match &auth.policy {
        Some(path) => {
            let p = Policy::load(path)?;
            tracing::info!(policy = %path.display(), rules = p.rules(),
                certificate_services = p.certificate_services(), "authorization policy loaded");
            p
        }
        None => Policy::default(),
    };
    let revocation = Arc::new(Revocation::load(
        client_ca,
        auth.crl.clone(),
        std::time::Duration::from_millis(auth.crl_check_ms),
    )?);
    let live = LiveTls::server(
        &cfg.tls,
        identity,
        client_ca.to_vec(),
        revocation.verifier(),
    )?;
    let mut server = tls::server_config_live(&live, revocation.verifier(), alpns)?;
    // The aggregator sends no keep-alives: a connection is kept alive by its agent,
    // so one whose agent went quiet times out instead of being held open from here.
    let mut transport = tls::transport();
    transport.keep_alive_interval(None);
    server.transport_config(Arc::new(transport));
    // Connections not yet accepted by the driver, beyond which the endpoint refuses.
    server.max_incoming(cfg.limits.quic_max_connections.clamp(1, 1 << 16));
    let ingest = Ingest {
        policy,
        revocation,
        require_service_file: cfg.service_config.dir.is_some()
            && !cfg.service_config.accept_unknown_services,
        limits: cfg.limits.clone(),
        connections: Arc::new(limits::Connections::default()),
        tls: live,
    };
    Ok((server, ingest))
}
