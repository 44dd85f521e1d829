//! Report ingest as the aggregator runs it: the listener of `ballast-ingest`
//! (`aggregator/ingest`), with this aggregator's balancer behind it ([`local::Local`]).

pub(crate) mod local;

pub use ballast_ingest::{
    agent_alpns, aggregator_alpns, policy, quic, revocation, threads, upstream, Ingest,
    IngestError, PolicyError, ThreadsError,
};

use crate::config::Config;
use ballast_shared::tls::{CertificateDer, Identity};

/// [`ballast_ingest::setup`] with the settings `cfg` gives: the server offers agents'
/// connections and relays' trunks.
pub(crate) fn setup(
    cfg: &Config,
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
) -> Result<(quinn::ServerConfig, Ingest), IngestError> {
    ballast_ingest::setup(&cfg.ingest(), identity, client_ca)
}
