//! Report ingest: agents connect over QUIC with mutual TLS (`ballast-ingest`).
//!
//! Who may claim what is decided here, before anything reaches the balancer: the
//! handshake checks each client certificate's chain, lifetime and revocation
//! ([`revocation`]), and each hello is checked against what its certificate and the
//! authorization policy grant ([`policy`]) and, with a config directory that accepts
//! no unknown services, against the services that have a file.
//!
//! What is done with an admitted agent is an [`upstream::Upstream`]'s: the
//! aggregator's balancer, or a relay's trunks; this crate knows neither.

pub mod http_listener;
mod limits;
pub mod metrics;
pub mod policy;
pub mod primary_trunk;
pub mod quic;
pub mod revocation;
pub mod routes_feed;
pub mod supervise;
pub mod threads;
pub mod upstream;

pub use metrics::IngestMetrics;
pub use policy::PolicyError;
pub use threads::ThreadsError;

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
    /// Settings that cannot work together: which one (its dotted path in the
    /// configuration file), and why.
    #[error("{setting}: {reason}")]
    Setting {
        /// The setting's dotted path.
        setting: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `BALLAST_PROTOCOL` names no set of agent protocol versions.
    #[error(transparent)]
    Protocol(#[from] ballast_shared::protocol::UnknownChoice),
}

/// What ingest is set up from: the parts of a configuration file it reads.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The server's certificate, its key and the client CAs' files (`tls`).
    pub tls: ballast_shared::config::TlsFiles,
    /// The authorization policy's file (`authorization.policy`).
    pub policy: Option<std::path::PathBuf>,
    /// The certificate revocation list's file (`authorization.crl`).
    pub crl: Option<std::path::PathBuf>,
    /// How often the revocation list's file is checked for changes
    /// (`authorization.crl_check_ms`).
    pub crl_check: std::time::Duration,
    /// Whether a config directory is set (`service_config.dir`).
    pub config_dir: bool,
    /// Whether hellos for services without a file in it are taken
    /// (`service_config.accept_unknown_services`).
    pub accept_unknown_services: bool,
    /// What connections and nodes may cost.
    pub limits: Limits,
}

impl Settings {
    /// The server's files `tls`, and the defaults of a configuration file for the rest:
    /// no policy, no revocation list, and no config directory, so that hellos for any
    /// service are taken.
    pub fn new(tls: ballast_shared::config::TlsFiles) -> Self {
        Settings {
            tls,
            policy: None,
            crl: None,
            crl_check: std::time::Duration::from_secs(1),
            config_dir: false,
            accept_unknown_services: true,
            limits: Limits::default(),
        }
    }
}

/// The `[limits]` ingest holds connections and trunks to; each field is the
/// configuration file's setting of the same name (`docs/security.md`), which the
/// configuration crate's `Limits::ingest` hands over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Agent connections open at once, handshakes included; more are refused before
    /// any cryptography.
    pub quic_max_connections: usize,
    /// Connections one node may hold at once (a reconnecting agent briefly has two).
    pub quic_max_connections_per_identity: usize,
    /// Whether a new connection must first prove its source address with a QUIC Retry
    /// (one more round trip), so that spoofed floods cost no handshake.
    pub quic_retry: bool,
    /// Datagrams one connection may send per second, sustained (twice that in a
    /// burst); the rest are dropped unread, before they reach the balancer.
    pub quic_max_datagrams_per_second: u32,
    /// How long an established connection may go without a report before it is
    /// closed, in milliseconds; at least five report intervals are always allowed.
    pub quic_report_timeout_ms: u64,
    /// Agents one relay's trunk may hold attached at once; more attaches are refused
    /// (`limit_reached`).
    pub trunk_max_slots: u32,
    /// Attaches one relay's trunk may make per second, sustained; more are refused
    /// (`attach_rate`).
    pub trunk_attach_rate: u32,
    /// Attaches one relay's trunk may make at once, above the sustained rate.
    pub trunk_attach_burst: u32,
}

impl Default for Limits {
    /// The defaults of a configuration file's `[limits]` table.
    fn default() -> Self {
        Limits {
            quic_max_connections: 65_536,
            // A node's sessions, direct and relayed together. An agent holds one at a
            // time; the one it left (a lost path, a relay that died, a trunk dialled
            // again) stays until its silence rule or its trunk's end lets go of it, so
            // a reconnecting agent briefly has two. Four leaves room for a second
            // reconnect within the silence timeout, and stops one certificate from
            // being attached through every trunk many times over.
            quic_max_connections_per_identity: 4,
            quic_retry: true,
            quic_max_datagrams_per_second: 50,
            quic_report_timeout_ms: 30_000,
            trunk_max_slots: 100_000,
            // A relay re-attaches all the agents a dead owner had as soon as the
            // routes name the new one, which is 2.4-3.3 s after the kill (the goal
            // 3.6 s); it holds them for `failover_hold_ms` (10 s), so it has at least
            // 6.4 s. 10,000 at once and 2,000 a second pass 22,800 agents of one trunk
            // in that time: a relay's whole share of a primary many times over (a
            // 2-core relay carries about 25,000 agents spread over every primary,
            // docs/scale.md). A hostile relay churning attaches makes the primary
            // check at most 2,000 proofs a second on its trunk.
            trunk_attach_rate: 2_000,
            trunk_attach_burst: 10_000,
        }
    }
}

/// What ingest needs besides what serves its agents: the policy, the revocation list
/// and the config directory's rule for unknown services.
pub struct Ingest {
    policy: Policy,
    revocation: Arc<Revocation>,
    /// Hellos for services without a file in the config directory are refused.
    require_service_file: bool,
    /// What connections and nodes may cost.
    limits: Limits,
    /// The connections open now.
    connections: Arc<limits::Connections>,
    /// The server's certificate and the client CAs, taken from their files while the
    /// server runs.
    tls: Arc<LiveTls>,
}

impl Ingest {
    /// The server's certificate as its files give it now, for other listeners that
    /// present the same one (xDS).
    pub fn live_tls(&self) -> Arc<LiveTls> {
        self.tls.clone()
    }

    /// The revocation list and client CAs in force, for other listeners that check
    /// client certificates the same way (xDS in mutual mode).
    pub fn revocation(&self) -> Arc<Revocation> {
        self.revocation.clone()
    }

    /// Whether hellos for services without a file in the config directory are
    /// refused.
    pub fn require_service_file(&self) -> bool {
        self.require_service_file
    }
}

/// What an aggregator's QUIC server offers: agents' connections in every version of
/// their protocol it speaks (current first, so that an agent that offers both gets
/// the current), relays' trunks in every version of theirs, and relays' routes
/// ([`routes_feed`]), which a process standing for the previous release
/// (`BALLAST_PROTOCOL=previous`) does not offer: that release had none.
pub fn aggregator_alpns() -> Result<Vec<&'static [u8]>, IngestError> {
    let mut alpns = agent_alpns()?;
    alpns.extend(
        TrunkProtocol::from_env()?
            .into_iter()
            .map(TrunkProtocol::alpn),
    );
    if protocol::from_env()?.contains(&protocol::Protocol::CURRENT) {
        alpns.push(ballast_shared::trunk::routes::ROUTES_ALPN);
    }
    Ok(alpns)
}

/// What a server that takes agents only offers (a relay's, facing its agents): every
/// version of their protocol, current first, unless `BALLAST_PROTOCOL` narrows them.
pub fn agent_alpns() -> Result<Vec<&'static [u8]>, IngestError> {
    Ok(protocol::alpns(&protocol::from_env()?))
}

/// Loads the policy and the revocation list `settings` name and builds the QUIC server
/// configuration whose handshakes check client certificates against `client_ca` and
/// the revocation list, offering agents' connections and relays' trunks
/// ([`aggregator_alpns`]). A bad policy or list stops the start with its reason.
pub fn setup(
    settings: &Settings,
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
) -> Result<(quinn::ServerConfig, Ingest), IngestError> {
    setup_with(settings, identity, client_ca, &aggregator_alpns()?)
}

/// [`setup`], its server offering the application protocols `alpns` only: a server
/// that takes no trunks offers [`agent_alpns`].
pub fn setup_with(
    settings: &Settings,
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
    alpns: &[&[u8]],
) -> Result<(quinn::ServerConfig, Ingest), IngestError> {
    if !settings.accept_unknown_services && !settings.config_dir {
        return Err(IngestError::Setting {
            setting: "service_config.accept_unknown_services",
            reason: "false needs a config directory (service_config.dir or --config-dir): \
                     without one no service has a file, and every hello would be refused",
        });
    }
    let policy = match &settings.policy {
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
        settings.crl.clone(),
        settings.crl_check,
    )?);
    let live = LiveTls::server(
        &settings.tls,
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
    server.max_incoming(settings.limits.quic_max_connections.clamp(1, 1 << 16));
    let ingest = Ingest {
        policy,
        revocation,
        require_service_file: settings.config_dir && !settings.accept_unknown_services,
        limits: settings.limits.clone(),
        connections: Arc::new(limits::Connections::default()),
        tls: live,
    };
    Ok((server, ingest))
}
