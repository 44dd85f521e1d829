//! Mutual TLS for QUIC: both sides present certificates from the same CA, and the
//! aggregator reads the node's identity, the services it may serve and its lifetime
//! from the client certificate ([`CertInfo`]). The aggregator's verifier
//! ([`ClientVerifier`]) checks each client certificate's chain, validity period and
//! revocation, and takes new revocation lists while it runs.

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::UnixTime;
pub use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub mod live;

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
    #[error(
        "certificate has neither a DNS subject alternative name, a SPIFFE ID whose last \
         path segment is a node name, nor a common name"
    )]
    NoIdentity,
    /// The PEM holds no certificate revocation list.
    #[error("{0}: no X509 CRL found in PEM")]
    NoCrl(String),
    /// A revocation list that is not one of the trusted CAs' own: issued by a name no
    /// trusted CA has, or not signed by that CA's key. Put in force, it would refuse
    /// every certificate of that CA.
    #[error("revocation list issued by {issuer}: {reason}")]
    CrlIssuer {
        /// The list's issuer, as it names it.
        issuer: String,
        /// What is wrong.
        reason: String,
    },
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

/// How much unread stream data a connection may hold, per stream and in all: what the
/// protocols need and no more. An agent's one stream carries its hello (a frame of
/// at most 1 KiB) and a relay's its control frames (at most 16 KiB each, attaches in
/// bursts after a failover); 256 KiB keeps a burst of attaches flowing at about 5 MB/s
/// across a 50 ms round trip, and is a twentieth of what quinn's defaults let a peer
/// park in a connection that is not read.
pub const STREAM_RECEIVE_WINDOW: u32 = 256 * 1024;

/// Transport settings both sides use: datagrams on, keep-alives well inside the idle
/// timeout so that a quiet but healthy connection is never dropped, and an idle
/// timeout short enough that an agent notices a dead aggregator within seconds.
///
/// One bidirectional stream, opened by the client (the agent's session or the relay's
/// trunk control), and no unidirectional stream: a peer can open no other stream to
/// park data in, and the one it has holds at most [`STREAM_RECEIVE_WINDOW`] unread.
pub fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.keep_alive_interval(Some(Duration::from_secs(2)));
    t.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        10_000,
    ))));
    t.datagram_receive_buffer_size(Some(64 * 1024));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(1));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    t.stream_receive_window(quinn::VarInt::from_u32(STREAM_RECEIVE_WINDOW));
    t.receive_window(quinn::VarInt::from_u32(STREAM_RECEIVE_WINDOW));
    t
}

/// The aggregator's QUIC config: TLS 1.3, a client certificate from `client_ca` required.
pub fn server_config(
    identity: Identity,
    client_ca: &[CertificateDer<'static>],
) -> Result<quinn::ServerConfig, TlsError> {
    let verifier = ClientVerifier::new(client_ca, Vec::new())?;
    server_config_with(identity, Arc::new(verifier))
}

/// The aggregator's QUIC config: TLS 1.3, each client certificate checked by
/// `verifier` (keep a clone of the `Arc` to give it new revocation lists); agents'
/// ALPN only.
pub fn server_config_with(
    identity: Identity,
    verifier: Arc<ClientVerifier>,
) -> Result<quinn::ServerConfig, TlsError> {
    server_config_for(identity, verifier, &[crate::ALPN])
}

/// [`server_config_with`], offering the application protocols `alpns` (the client's
/// choice among them is the connection's `handshake_data`).
pub fn server_config_for(
    identity: Identity,
    verifier: Arc<ClientVerifier>,
    alpns: &[&[u8]],
) -> Result<quinn::ServerConfig, TlsError> {
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain, identity.key)?;
    quic_server(tls, alpns)
}

/// [`server_config_for`], presenting the certificate `live` has in force at each
/// handshake, and checking clients with `live`'s verifier.
pub fn server_config_live(
    live: &Arc<live::LiveTls>,
    verifier: Arc<ClientVerifier>,
    alpns: &[&[u8]],
) -> Result<quinn::ServerConfig, TlsError> {
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(live.clone());
    quic_server(tls, alpns)
}

fn quic_server(
    mut tls: rustls::ServerConfig,
    alpns: &[&[u8]],
) -> Result<quinn::ServerConfig, TlsError> {
    // No session resumption: a resumed session skips the client certificate's check,
    // and so would let a revoked or expired certificate back in. Agents connect
    // rarely; a full handshake each time costs nothing that matters.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    tls.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    cfg.transport_config(Arc::new(transport()));
    Ok(cfg)
}

/// The agent's QUIC config: trusts only `server_ca` and presents `identity`.
pub fn client_config(
    identity: Identity,
    server_ca: &[CertificateDer<'static>],
) -> Result<quinn::ClientConfig, TlsError> {
    client_config_with_alpns(identity, server_ca, &[crate::ALPN])
}

/// A client QUIC config as [`client_config`]'s that offers the protocols `alpns`
/// (a relay's trunks offer [`crate::trunk::RELAY_ALPN`]).
pub fn client_config_with_alpns(
    identity: Identity,
    server_ca: &[CertificateDer<'static>],
    alpns: &[&[u8]],
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(server_ca)?)
        .with_client_auth_cert(identity.chain, identity.key)?;
    quic_client(tls, alpns)
}

/// A client QUIC config as [`client_config_with_alpns`]'s that presents the
/// certificate `live` has in force at each handshake, and checks the server against
/// the CAs it has in force.
pub fn client_config_live(
    live: &Arc<live::LiveTls>,
    alpns: &[&[u8]],
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(live::LiveServerVerifier(live.clone())))
        .with_client_cert_resolver(live.clone());
    quic_client(tls, alpns)
}

fn quic_client(
    mut tls: rustls::ClientConfig,
    alpns: &[&[u8]],
) -> Result<quinn::ClientConfig, TlsError> {
    tls.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    let mut cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    cfg.transport_config(Arc::new(transport()));
    Ok(cfg)
}

/// What a node certificate says about its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// The node identity: the first DNS subject alternative name; failing that the
    /// node name of the SPIFFE ID ([`spiffe_node_name`]); failing that the common name.
    pub identity: String,
    /// The SPIFFE ID (`spiffe://trust-domain/path`), the first URI subject alternative
    /// name of that scheme, if the certificate carries one: an X.509-SVID's identity.
    pub spiffe_id: Option<String>,
    /// The services the certificate names as URI subject alternative names
    /// ([`crate::pki::SERVICE_URI_PREFIX`]`NAME`), in its order. A URI with that prefix
    /// but no valid service name after it names nothing.
    pub services: Vec<String>,
    /// The roles the certificate names as URI subject alternative names
    /// ([`crate::pki::ROLE_URI_PREFIX`]`NAME`), in its order; empty for a node's.
    pub roles: Vec<String>,
    /// Valid from, in seconds since the Unix epoch.
    pub not_before_unix_s: i64,
    /// Valid until, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
    /// The serial number, big-endian, as encoded.
    pub serial: Vec<u8>,
}

impl CertInfo {
    /// Reads a DER certificate.
    pub fn parse(cert: &CertificateDer<'_>) -> Result<CertInfo, TlsError> {
        use x509_parser::prelude::*;
        let (_, x509) = X509Certificate::from_der(cert.as_ref())
            .map_err(|e| TlsError::Certificate(e.to_string()))?;
        let mut dns = None;
        let mut spiffe_id = None;
        let mut services = Vec::new();
        let mut roles = Vec::new();
        if let Ok(Some(san)) = x509.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(d) if dns.is_none() => dns = Some((*d).to_string()),
                    GeneralName::URI(uri) if spiffe_id.is_none() && is_spiffe_id(uri) => {
                        spiffe_id = Some((*uri).to_string());
                    }
                    GeneralName::URI(uri) => {
                        let service = uri.strip_prefix(crate::pki::SERVICE_URI_PREFIX);
                        push_name(&mut services, service, crate::pki::is_valid_service);
                        let role = uri.strip_prefix(crate::pki::ROLE_URI_PREFIX);
                        push_name(&mut roles, role, crate::pki::is_valid_role);
                    }
                    _ => {}
                }
            }
        }
        let spiffe_node = spiffe_id.as_deref().and_then(spiffe_node_name);
        let identity = match dns.or(spiffe_node) {
            Some(d) => d,
            None => x509
                .subject()
                .iter_common_name()
                .next()
                .and_then(|cn| cn.as_str().ok())
                .map(str::to_string)
                .ok_or(TlsError::NoIdentity)?,
        };
        let validity = x509.validity();
        Ok(CertInfo {
            identity,
            spiffe_id,
            services,
            roles,
            not_before_unix_s: validity.not_before.timestamp(),
            not_after_unix_s: validity.not_after.timestamp(),
            serial: x509.raw_serial().to_vec(),
        })
    }

    /// Whether the certificate names role `role` ([`crate::pki::RELAY_ROLE`], say).
    pub fn has_role(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }

    /// The serial number as lower-case hex, for people.
    pub fn serial_hex(&self) -> String {
        self.serial.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Seconds from `now_unix_s` until the certificate expires; negative once it has.
    pub fn expires_in_s(&self, now_unix_s: i64) -> i64 {
        self.not_after_unix_s.saturating_sub(now_unix_s)
    }
}

/// The scheme of a SPIFFE ID.
pub const SPIFFE_SCHEME: &str = "spiffe://";

/// Whether `uri` is a SPIFFE ID as the SPIFFE standard writes them: `spiffe://`, a
/// trust domain of lower-case letters, digits, `.`, `-` and `_`, then a path of
/// segments of letters, digits, `.`, `-` and `_` (none empty, `.` or `..`), at most
/// 2048 bytes in all.
pub fn is_spiffe_id(uri: &str) -> bool {
    let Some(rest) = uri.strip_prefix(SPIFFE_SCHEME) else {
        return false;
    };
    if uri.len() > 2048 {
        return false;
    }
    let (domain, path) = rest.split_once('/').unwrap_or((rest, ""));
    let domain_ok = !domain.is_empty()
        && domain.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
        });
    let path_ok = rest.len() == domain.len()
        || path.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        });
    domain_ok && path_ok
}

/// The node name a SPIFFE ID maps to: its last path segment, if that is a valid node
/// name (`spiffe://prod.example/ns/web/sa/web-1` is node `web-1`). A SPIFFE ID with
/// no path, or whose last segment is no node name, maps to none.
pub fn spiffe_node_name(id: &str) -> Option<String> {
    let rest = id.strip_prefix(SPIFFE_SCHEME)?;
    let (_, path) = rest.split_once('/')?;
    let last = path.rsplit('/').next()?;
    (!last.is_empty() && crate::wire::is_valid_name(last)).then(|| last.to_string())
}

/// Adds `name` to `names` if there is one, `valid` accepts it, and it is not there yet.
fn push_name(names: &mut Vec<String>, name: Option<&str>, valid: fn(&str) -> bool) {
    if let Some(name) = name.filter(|n| valid(n)) {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
}

/// The certificate chain the peer of an established QUIC connection presented, leaf
/// first.
pub fn peer_chain(conn: &quinn::Connection) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or(TlsError::NoIdentity)?;
    if chain.is_empty() {
        return Err(TlsError::NoIdentity);
    }
    Ok(*chain)
}

/// The identity of the peer of an established QUIC connection.
pub fn peer_identity(conn: &quinn::Connection) -> Result<String, TlsError> {
    let chain = peer_chain(conn)?;
    let leaf = chain.first().ok_or(TlsError::NoIdentity)?;
    Ok(CertInfo::parse(leaf)?.identity)
}

/// Every certificate revocation list in a PEM text; `what` names it in errors. None
/// at all is an error: an empty file is more likely a botched copy than a wish to
/// revoke nothing.
pub fn crls_from_pem(
    pem: &str,
    what: &str,
) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let crls = rustls_pemfile::crls(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            what: what.to_string(),
            source,
        })?;
    if crls.is_empty() {
        return Err(TlsError::NoCrl(what.to_string()));
    }
    Ok(crls)
}

/// The aggregator's check of client certificates: the chain to one of the trusted CAs,
/// the validity period at the time of the handshake (an expired certificate is
/// refused), and revocation by the lists in force, which [`ClientVerifier::set_crls`]
/// replaces while connections come and go.
///
/// Only the node's own certificate is checked for revocation, and a certificate whose
/// issuer has no list is not refused for it: a list covers the CA that signed it.
/// A list past its next update stays in force (an old list is better than none).
pub struct ClientVerifier {
    hints: Vec<DistinguishedName>,
    inner: RwLock<Trust>,
}

/// The CAs and revocation lists in force, and the verifier built from them.
struct Trust {
    cas: Vec<CertificateDer<'static>>,
    roots: Arc<rustls::RootCertStore>,
    crls: Vec<CertificateRevocationListDer<'static>>,
    verifier: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for ClientVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let roots = self.read().roots.len();
        f.debug_struct("ClientVerifier")
            .field("roots", &roots)
            .finish_non_exhaustive()
    }
}

impl ClientVerifier {
    /// A verifier trusting `client_ca`, with the revocation lists `crls` (none: nothing
    /// is revoked).
    pub fn new(
        client_ca: &[CertificateDer<'static>],
        crls: Vec<CertificateRevocationListDer<'static>>,
    ) -> Result<Self, TlsError> {
        let roots = Arc::new(roots(client_ca)?);
        check_crl_issuers(client_ca, &crls)?;
        let verifier = Self::build(&roots, crls.clone())?;
        Ok(ClientVerifier {
            hints: verifier.root_hint_subjects().to_vec(),
            inner: RwLock::new(Trust {
                cas: client_ca.to_vec(),
                roots,
                crls,
                verifier,
            }),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Trust> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Trust> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    fn build(
        roots: &Arc<rustls::RootCertStore>,
        crls: Vec<CertificateRevocationListDer<'static>>,
    ) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
        Ok(
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .with_crls(crls)
                .only_check_end_entity_revocation()
                .allow_unknown_revocation_status()
                .build()?,
        )
    }

    /// Puts new revocation lists in force for every handshake from now on. Lists that
    /// do not parse, or that are not signed by one of the trusted CAs, are refused, and
    /// the lists in force stay.
    pub fn set_crls(
        &self,
        crls: Vec<CertificateRevocationListDer<'static>>,
    ) -> Result<(), TlsError> {
        let mut trust = self.write();
        check_crl_issuers(&trust.cas, &crls)?;
        check_crl_numbers(&trust.crls, &crls)?;
        trust.verifier = Self::build(&trust.roots, crls.clone())?;
        trust.crls = crls;
        Ok(())
    }

    /// Trusts the CAs `client_ca` instead of those in force, for every handshake from
    /// now on, with the revocation lists in force. Refused, and the CAs in force stay,
    /// if a list in force is not one of the new CAs' own. The CA names the handshake
    /// hints at stay those given at the start: Ballast's clients do not read them.
    pub fn set_cas(&self, client_ca: &[CertificateDer<'static>]) -> Result<(), TlsError> {
        let roots = Arc::new(roots(client_ca)?);
        let mut trust = self.write();
        check_crl_issuers(client_ca, &trust.crls)?;
        trust.verifier = Self::build(&roots, trust.crls.clone())?;
        trust.roots = roots;
        trust.cas = client_ca.to_vec();
        Ok(())
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.read().verifier.clone()
    }

    /// Checks a chain (leaf first) as a handshake at `now_unix_s` would, with the lists
    /// in force now: for connections made before a list changed.
    pub fn check(
        &self,
        chain: &[CertificateDer<'_>],
        now_unix_s: u64,
    ) -> Result<(), rustls::Error> {
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or(rustls::Error::NoCertificatesPresented)?;
        self.current()
            .verify_client_cert(
                leaf,
                intermediates,
                UnixTime::since_unix_epoch(Duration::from_secs(now_unix_s)),
            )
            .map(|_| ())
    }
}

/// Checks that each list is issued and signed by one of `cas`.
/// Refuses a list numbered below the list in force from the same issuer: put in force,
/// an older list (replayed, or restored from a backup) would un-revoke whatever was
/// revoked since. A list of the same number is taken (the same list written again).
fn check_crl_numbers(
    in_force: &[CertificateRevocationListDer<'static>],
    new: &[CertificateRevocationListDer<'static>],
) -> Result<(), TlsError> {
    use x509_parser::prelude::*;
    use x509_parser::revocation_list::CertificateRevocationList as Crl;
    fn parse<'a>(der: &'a CertificateRevocationListDer<'static>) -> Result<Crl<'a>, TlsError> {
        Crl::from_der(der.as_ref())
            .map(|(_, c)| c)
            .map_err(|e| TlsError::CrlIssuer {
                issuer: "?".into(),
                reason: format!("not a revocation list: {e}"),
            })
    }
    let old = in_force.iter().map(parse).collect::<Result<Vec<_>, _>>()?;
    for der in new {
        let crl = parse(der)?;
        for before in old.iter().filter(|o| o.issuer() == crl.issuer()) {
            let (was, now) = (before.crl_number(), crl.crl_number());
            if now < was {
                let show = |n: Option<&_>| n.map_or_else(|| "none".to_string(), |n| format!("{n}"));
                return Err(TlsError::CrlIssuer {
                    issuer: crl.issuer().to_string(),
                    reason: format!(
                        "its number ({}) is below the list in force's ({}): an older list \
                         would un-revoke what was revoked since",
                        show(now),
                        show(was)
                    ),
                });
            }
        }
    }
    Ok(())
}

fn check_crl_issuers(
    cas: &[CertificateDer<'static>],
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<(), TlsError> {
    use x509_parser::prelude::*;
    let cas = cas
        .iter()
        .map(|der| {
            X509Certificate::from_der(der.as_ref())
                .map(|(_, c)| c)
                .map_err(|e| TlsError::Certificate(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    for der in crls {
        let (_, crl) =
            x509_parser::revocation_list::CertificateRevocationList::from_der(der.as_ref())
                .map_err(|e| TlsError::CrlIssuer {
                    issuer: "?".into(),
                    reason: format!("not a revocation list: {e}"),
                })?;
        let issuer = crl.issuer();
        let named: Vec<_> = cas.iter().filter(|c| c.subject() == issuer).collect();
        if named.is_empty() {
            return Err(TlsError::CrlIssuer {
                issuer: issuer.to_string(),
                reason: "no trusted CA has that name".into(),
            });
        }
        if !named
            .iter()
            .any(|ca| crl.verify_signature(ca.public_key()).is_ok())
        {
            return Err(TlsError::CrlIssuer {
                issuer: issuer.to_string(),
                reason: "its signature does not verify with that CA's key".into(),
            });
        }
    }
    Ok(())
}

impl ClientCertVerifier for ClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Ca, NodeSpec, Revoked};

    fn now_s() -> i64 {
        i64::try_from(crate::unix_ms() / 1000).expect("time")
    }

    fn node(ca: &Ca, spec: &NodeSpec) -> Vec<CertificateDer<'static>> {
        let issued = ca.issue_node_with(spec).expect("issue");
        issued.pem.identity("node").expect("parse").chain
    }

    fn check_now(v: &ClientVerifier, chain: &[CertificateDer<'_>]) -> Result<(), rustls::Error> {
        v.check(chain, u64::try_from(now_s()).expect("time"))
    }

    fn ca_certs(ca: &Ca) -> Vec<CertificateDer<'static>> {
        certs_from_pem(&ca.pem().cert, "ca").expect("ca")
    }

    /// A peer that writes into a stream nobody reads, or opens more streams, parks at
    /// most the window in the other side's memory.
    #[tokio::test]
    async fn unread_stream_data_is_bounded_by_the_window_and_one_stream() {
        use std::net::SocketAddr;
        let ca = Ca::generate("test CA").expect("ca");
        let server = ca.issue_server(&["localhost".into()]).expect("server");
        let cas = ca_certs(&ca);
        let node = ca
            .issue_node_with(&NodeSpec::new("n1", &[], Duration::from_secs(3600)).expect("spec"))
            .expect("node");
        let server_cfg =
            server_config(server.identity("server").expect("identity"), &cas).expect("config");
        let endpoint = quinn::Endpoint::server(server_cfg, SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("server endpoint");
        let addr = endpoint.local_addr().expect("address");
        // The server accepts the connection and its first stream, and reads nothing.
        let (held_tx, mut held) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let conn = endpoint
                .accept()
                .await
                .expect("incoming")
                .await
                .expect("conn");
            let stream = conn.accept_bi().await.expect("stream");
            let _ = held_tx.send((conn, stream));
            std::future::pending::<()>().await;
        });
        let mut client =
            quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).expect("client");
        client.set_default_client_config(
            client_config(node.pem.identity("node").expect("node"), &cas).expect("config"),
        );
        let conn = client
            .connect(addr, "localhost")
            .expect("connect")
            .await
            .expect("handshake");
        let (mut send, _recv) = conn.open_bi().await.expect("stream");
        send.write_all(b"x").await.expect("first byte");
        let _kept = held.recv().await.expect("accepted");
        // A mebibyte, four times the window and less than quinn's default window.
        let big = vec![0u8; 1 << 20];
        let mut written = 0usize;
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while written < big.len() {
                match send.write(&big[written..]).await {
                    Ok(n) => written += n,
                    Err(_) => break,
                }
            }
        })
        .await;
        assert!(
            written <= STREAM_RECEIVE_WINDOW as usize,
            "{written} bytes taken into a stream that is not read"
        );
        // No second stream opens to park more.
        let second = tokio::time::timeout(Duration::from_millis(500), conn.open_bi()).await;
        assert!(second.is_err(), "a second stream was opened");
    }

    #[test]
    fn an_expired_or_not_yet_valid_certificate_is_refused() {
        let ca = Ca::generate("test CA").expect("ca");
        let v = ClientVerifier::new(&ca_certs(&ca), Vec::new()).expect("verifier");
        let now = now_s();
        let good = node(
            &ca,
            &NodeSpec::new("n1", &[], Duration::from_secs(3600)).expect("spec"),
        );
        assert_eq!(check_now(&v, &good), Ok(()));
        let expired = node(
            &ca,
            &NodeSpec {
                node: "n1".into(),
                services: Vec::new(),
                not_before_unix_s: now - 2 * 86_400,
                not_after_unix_s: now - 86_400,
            },
        );
        let early = node(
            &ca,
            &NodeSpec {
                node: "n1".into(),
                services: Vec::new(),
                not_before_unix_s: now + 86_400,
                not_after_unix_s: now + 2 * 86_400,
            },
        );
        for (chain, what) in [(&expired, "expired"), (&early, "not yet valid")] {
            match check_now(&v, chain) {
                Err(rustls::Error::InvalidCertificate(e)) => assert_eq!(
                    rustls::AlertDescription::from(e),
                    rustls::AlertDescription::CertificateExpired,
                    "{what}"
                ),
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_revocation_list_refuses_its_certificates_from_when_it_is_set() {
        let ca = Ca::generate("test CA").expect("ca");
        let spec = |n: &str| NodeSpec::new(n, &[], Duration::from_secs(3600)).expect("spec");
        let (a, b) = (node(&ca, &spec("a")), node(&ca, &spec("b")));
        let v = ClientVerifier::new(&ca_certs(&ca), Vec::new()).expect("verifier");
        assert_eq!(check_now(&v, &a), Ok(()));
        let serial = |chain: &[CertificateDer<'_>]| {
            use x509_parser::prelude::*;
            let (_, c) = X509Certificate::from_der(chain[0].as_ref()).expect("x509");
            c.raw_serial().to_vec()
        };
        let crl = ca
            .revocation_list(
                &[Revoked {
                    serial: serial(&a),
                    revoked_unix_s: now_s(),
                }],
                1,
            )
            .expect("crl");
        v.set_crls(crls_from_pem(&crl, "crl").expect("crls"))
            .expect("set");
        assert_eq!(
            check_now(&v, &a),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked
            ))
        );
        assert_eq!(check_now(&v, &b), Ok(()), "only the revoked one");
        // The same list written again is taken.
        v.set_crls(crls_from_pem(&crl, "crl").expect("crls"))
            .expect("the same number");
        // An older list (number 0, empty: a replay, a backup restored) is refused, and
        // the revocation stays in force.
        let older = ca.revocation_list(&[], 0).expect("crl");
        let err = v
            .set_crls(crls_from_pem(&older, "crl").expect("crls"))
            .expect_err("an older list");
        assert!(
            err.to_string().contains("below the list in force's (1)"),
            "{err}"
        );
        assert_eq!(
            check_now(&v, &a),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked
            ))
        );
        // A newer empty list un-revokes.
        let empty = ca.revocation_list(&[], 2).expect("crl");
        v.set_crls(crls_from_pem(&empty, "crl").expect("crls"))
            .expect("set");
        assert_eq!(check_now(&v, &a), Ok(()));
    }

    #[test]
    fn a_revocation_list_of_another_ca_is_refused_and_the_old_one_stays() {
        let ca = Ca::generate("test CA").expect("ca");
        let other = Ca::generate("other CA").expect("ca");
        // Same name, other key: a CA made again from scratch.
        let twin = Ca::generate("test CA").expect("ca");
        let v = ClientVerifier::new(&ca_certs(&ca), Vec::new()).expect("verifier");
        let n = node(
            &ca,
            &NodeSpec::new("n", &[], Duration::from_secs(3600)).expect("spec"),
        );
        for (foreign, why) in [(&other, "no trusted CA"), (&twin, "signature")] {
            let crl = foreign.revocation_list(&[], 1).expect("crl");
            let err = v
                .set_crls(crls_from_pem(&crl, "crl").expect("crls"))
                .expect_err("foreign list");
            assert!(err.to_string().contains(why), "{err}");
            assert!(
                ClientVerifier::new(&ca_certs(&ca), crls_from_pem(&crl, "crl").expect("crls"))
                    .is_err()
            );
        }
        assert_eq!(check_now(&v, &n), Ok(()), "the lists in force stay");
        assert!(matches!(
            crls_from_pem("no pem here", "crl.pem"),
            Err(TlsError::NoCrl(_))
        ));
    }
}
