//! Mutual TLS for QUIC: both sides present certificates from the same CA, and the
//! aggregator reads the node's identity from the client certificate.

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
pub use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Why TLS material could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The PEM holds no certificate.
    #[error("{0}: no certificate found in PEM")]
    NoCertificate(String),
    /// The PEM holds no private key.
    #[error("{0}: no private key found in PEM")]
    NoKey(String),
    /// The PEM is not valid.
    #[error("{what}: invalid PEM: {source}")]
    Pem {
        /// What was being parsed.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client verifier could not be built.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// The TLS configuration cannot carry QUIC.
    #[error("QUIC crypto: {0}")]
    Quic(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
    /// The certificate is not parseable X.509.
    #[error("certificate: {0}")]
    Certificate(String),
    /// The certificate carries no name to use as a node identity.
    #[error("certificate has neither a DNS subject alternative name nor a common name")]
    NoIdentity,
}

/// A certificate chain and its private key.
pub struct Identity {
    /// Leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's key.
    pub key: PrivateKeyDer<'static>,
}

impl Identity {
    /// Parses an identity from PEM text. `what` names it in errors.
    pub fn from_pem(cert_pem: &str, key_pem: &str, what: &str) -> Result<Self, TlsError> {
        Ok(Identity {
            chain: certs_from_pem(cert_pem, what)?,
            key: key_from_pem(key_pem, what)?,
        })
    }

    /// Loads an identity from PEM files.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Self::from_pem(&read(cert)?, &read(key)?, &cert.display().to_string())
    }
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

/// Reads a file into a string, with the path in the error.
pub fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Every certificate in a PEM text.
pub fn certs_from_pem(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            what: what.to_string(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(what.to_string()));
    }
    Ok(certs)
}

/// The first private key in a PEM text.
pub(crate) fn key_from_pem(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .map_err(|source| TlsError::Pem {
            what: what.to_string(),
            source,
        })?
        .ok_or_else(|| TlsError::NoKey(what.to_string()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &[CertificateDer<'static>]) -> Result<rustls::RootCertStore, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for cert in ca {
        store.add(cert.clone())?;
    }
    Ok(store)
}

/// Transport settings both sides use: datagrams on, keep-alives well inside the idle
/// timeout so that a quiet but healthy connection is never dropped, and an idle
/// timeout short enough that an agent notices a dead aggregator within seconds.
pub fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.keep_alive_interval(Some(Duration::from_secs(2)));
    t.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        10_000,
    ))));
    t.datagram_receive_buffer_size(Some(64 * 1024));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(4));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    t
}

/// The aggregator's QUIC config: TLS 1.3, a client certificate from `client_ca` required.
pub fn server_config(
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
) -> Result<quinn::ServerConfig, TlsError> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(client_ca)?),
        provider(),
    )
    .build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain, identity.key)?;
    tls.alpn_protocols = vec![crate::ALPN.to_vec()];
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    cfg.transport_config(Arc::new(transport()));
    Ok(cfg)
}

/// The agent's QUIC config: trusts only `server_ca` and presents `identity`.
pub fn client_config(
    identity: Identity,
    server_ca: &[CertificateDer<'static>],
) -> Result<quinn::ClientConfig, TlsError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(server_ca)?)
        .with_client_auth_cert(identity.chain, identity.key)?;
    tls.alpn_protocols = vec![crate::ALPN.to_vec()];
    let mut cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    cfg.transport_config(Arc::new(transport()));
    Ok(cfg)
}

/// The node identity a certificate names: its first DNS subject alternative name, or
/// failing that its common name.
pub(crate) fn identity_of(cert: &CertificateDer<'_>) -> Result<String, TlsError> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert.as_ref())
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name {
                return Ok((*dns).to_string());
            }
        }
    }
    let cn = x509
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string);
    cn.ok_or(TlsError::NoIdentity)
}

/// The identity of the peer of an established QUIC connection.
pub fn peer_identity(conn: &quinn::Connection) -> Result<String, TlsError> {
    let chain = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or(TlsError::NoIdentity)?;
    let leaf = chain.first().ok_or(TlsError::NoIdentity)?;
    identity_of(leaf)
}
