//! Certificates, keys and CA bundles taken from their files while the process runs.
//!
//! A [`LiveTls`] holds one side's TLS files (its certificate chain, its key, the CAs
//! it trusts for the peer) as loaded last, and hands them to rustls at each handshake:
//! it is the certificate resolver of the QUIC client or server configuration, and it
//! swaps the verifier of the peer's certificate when the CA file changes. So a new
//! handshake uses new files as soon as they are taken, with no new configuration and
//! no restart; connections already up keep what they were made with.
//!
//! [`LiveTls::watch`] polls the three files (every second by default) and takes a
//! change once the files have stopped changing for a moment, so that a certificate and
//! key written one after the other are read as a pair. A new pair is refused, and the
//! pair in force stays, when the key is not the certificate's, when the chain is not
//! signed by a CA of the CA file (checked only when the pair in force at the start
//! was), when the certificate has expired, or when a file does not parse. Each
//! outcome is handed to the caller's counter and logged.

use super::{certs_from_pem, key_from_pem, provider, roots, ClientVerifier, TlsError};
use crate::config::TlsFiles;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;

/// How often [`LiveTls::watch`] looks at the files unless told otherwise.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long the files must stay unchanged before a change is taken: a certificate
/// and its key are two files, written one after the other.
pub const SETTLE: Duration = Duration::from_millis(200);

/// Which of the files a reload concerns, for the `file` label of the reload metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TlsFile {
    /// The certificate chain and its key, taken together.
    Certificate,
    /// The CA bundle trusted for the peer.
    Ca,
}

impl TlsFile {
    /// Its label.
    pub fn label(self) -> &'static str {
        match self {
            TlsFile::Certificate => "certificate",
            TlsFile::Ca => "ca",
        }
    }
}

/// What became of a changed file, for the `result` label of the reload metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reload {
    /// Taken: new handshakes use it.
    Applied,
    /// Refused: the key is not the certificate's.
    KeyMismatch,
    /// Refused: the chain is not signed by a CA of the CA file.
    Untrusted,
    /// Refused: the certificate has expired.
    Expired,
    /// Refused: a file could not be read or does not parse.
    Invalid,
}

impl Reload {
    /// Every outcome, in label order.
    pub const ALL: [Reload; 5] = [
        Reload::Applied,
        Reload::KeyMismatch,
        Reload::Untrusted,
        Reload::Expired,
        Reload::Invalid,
    ];

    /// Its label.
    pub fn label(self) -> &'static str {
        match self {
            Reload::Applied => "applied",
            Reload::KeyMismatch => "key_mismatch",
            Reload::Untrusted => "untrusted",
            Reload::Expired => "expired",
            Reload::Invalid => "invalid",
        }
    }
}

/// Why a new certificate, key or CA file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// A file could not be read or parsed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The key is not the certificate's.
    #[error("the private key does not match the certificate's public key")]
    KeyMismatch,
    /// The chain does not lead to a CA of the CA file.
    #[error("the certificate is not signed by a CA of {ca}: {reason}")]
    Untrusted {
        /// The CA file.
        ca: String,
        /// Where the chain breaks.
        reason: String,
    },
    /// The certificate's validity ended.
    #[error("the certificate expired at {0}")]
    Expired(String),
}

impl ReloadError {
    /// The outcome it counts as.
    pub fn outcome(&self) -> Reload {
        match self {
            ReloadError::Tls(_) => Reload::Invalid,
            ReloadError::KeyMismatch => Reload::KeyMismatch,
            ReloadError::Untrusted { .. } => Reload::Untrusted,
            ReloadError::Expired(_) => Reload::Expired,
        }
    }
}

/// Which end of the handshake the files are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A QUIC client (an agent, a relay's trunks): the CAs verify the server.
    Client,
    /// A QUIC server (an aggregator, a relay facing agents): the CAs verify clients.
    Server,
}

/// What is counted for each reload: the file and the outcome.
pub type ReloadCounter = Arc<dyn Fn(TlsFile, Reload) + Send + Sync>;

/// One side's TLS files, as loaded last, for the handshakes to come.
pub struct LiveTls {
    files: TlsFiles,
    side: Side,
    /// The certificate chain and key in force.
    key: RwLock<Arc<CertifiedKey>>,
    /// The CAs in force.
    cas: RwLock<Vec<CertificateDer<'static>>>,
    /// Whether a new chain must lead to a CA of the CA file: it did at the start.
    anchored: bool,
    /// A client's verifier of the server, rebuilt when the CAs change.
    server_verifier: RwLock<Arc<WebPkiServerVerifier>>,
    /// A server's verifier of clients, told when the CAs change.
    client_verifier: Option<Arc<ClientVerifier>>,
    /// Counts a new certificate in force.
    generation: watch::Sender<u64>,
}

impl std::fmt::Debug for LiveTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveTls")
            .field("cert", &self.files.cert)
            .field("side", &self.side)
            .finish_non_exhaustive()
    }
}

impl LiveTls {
    /// Loads `files` for a client: the CAs verify the server it dials.
    pub fn client(files: &TlsFiles) -> Result<Arc<Self>, TlsError> {
        Self::new(
            files,
            files.identity()?,
            files.ca_certs()?,
            Side::Client,
            None,
        )
    }

    /// `identity` and the CAs `cas`, loaded from `files`, for a server whose client
    /// certificates `verifier` checks: a new CA file is put in force there.
    pub fn server(
        files: &TlsFiles,
        identity: super::Identity,
        cas: Vec<CertificateDer<'static>>,
        verifier: Arc<ClientVerifier>,
    ) -> Result<Arc<Self>, TlsError> {
        Self::new(files, identity, cas, Side::Server, Some(verifier))
    }

    /// `identity` and the CAs `cas`, loaded from `files`, for a client.
    pub fn client_from(
        files: &TlsFiles,
        identity: super::Identity,
        cas: Vec<CertificateDer<'static>>,
    ) -> Result<Arc<Self>, TlsError> {
        Self::new(files, identity, cas, Side::Client, None)
    }

    fn new(
        files: &TlsFiles,
        identity: super::Identity,
        cas: Vec<CertificateDer<'static>>,
        side: Side,
        client_verifier: Option<Arc<ClientVerifier>>,
    ) -> Result<Arc<Self>, TlsError> {
        let key = CertifiedKey::from_der(identity.chain, identity.key, &provider())?;
        let anchored = match check_chain(&key.cert, &cas, &files.ca) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(cert = %files.cert.display(), error = %e,
                    "the certificate does not lead to the CA file: new certificates \
                     taken from the file are checked for their key and expiry only");
                false
            }
        };
        let server_verifier = server_verifier(&cas)?;
        Ok(Arc::new(LiveTls {
            files: files.clone(),
            side,
            key: RwLock::new(Arc::new(key)),
            cas: RwLock::new(cas),
            anchored,
            server_verifier: RwLock::new(server_verifier),
            client_verifier,
            generation: watch::channel(0).0,
        }))
    }

    /// The files.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The certificate chain in force, leaf first.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current().cert.clone()
    }

    /// A receiver that sees each new certificate put in force from now on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The key of the certificate in force, to sign with (a relayed agent's proofs).
    pub fn signing_key(&self) -> Arc<dyn rustls::sign::SigningKey> {
        self.current().key.clone()
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.key.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn server_verifier_now(&self) -> Arc<WebPkiServerVerifier> {
        self.server_verifier
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts the certificate chain `cert_pem` and key `key_pem` in force, after the
    /// checks the module describes. `Ok(false)`: the same chain as in force.
    pub fn set_identity(&self, cert_pem: &str, key_pem: &str) -> Result<bool, ReloadError> {
        let what = self.files.cert.display().to_string();
        let chain = certs_from_pem(cert_pem, &what)?;
        let key = key_from_pem(key_pem, &self.files.key.display().to_string())?;
        let signing = provider()
            .key_provider
            .load_private_key(key)
            .map_err(TlsError::from)?;
        let next = CertifiedKey::new(chain, signing);
        match next.keys_match() {
            Ok(()) => {}
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
                return Err(ReloadError::KeyMismatch)
            }
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
            Err(e) => return Err(TlsError::from(e).into()),
        }
        let leaf = next.cert.first().ok_or(TlsError::NoCertificate(what))?;
        let info = super::CertInfo::parse(leaf)?;
        let now = i64::try_from(crate::unix_ms() / 1000).unwrap_or(i64::MAX);
        if info.not_after_unix_s < now {
            return Err(ReloadError::Expired(crate::pki::rfc3339(
                info.not_after_unix_s,
            )));
        }
        if self.anchored {
            let cas = self.cas.read().unwrap_or_else(|p| p.into_inner()).clone();
            check_chain(&next.cert, &cas, &self.files.ca)?;
        }
        let mut key = self.key.write().unwrap_or_else(|p| p.into_inner());
        if key.cert == next.cert {
            return Ok(false);
        }
        *key = Arc::new(next);
        drop(key);
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
        Ok(true)
    }

    /// Puts the CA bundle `ca_pem` in force for verifying the peer.
    pub fn set_cas(&self, ca_pem: &str) -> Result<(), ReloadError> {
        let cas = certs_from_pem(ca_pem, &self.files.ca.display().to_string())?;
        match self.side {
            Side::Client => {
                let next = server_verifier(&cas)?;
                *self
                    .server_verifier
                    .write()
                    .unwrap_or_else(|p| p.into_inner()) = next;
            }
            Side::Server => {
                if let Some(v) = &self.client_verifier {
                    v.set_cas(&cas)?;
                }
            }
        }
        *self.cas.write().unwrap_or_else(|p| p.into_inner()) = cas;
        Ok(())
    }

    fn outcome(&self, counter: &ReloadCounter, file: TlsFile, result: Result<bool, ReloadError>) {
        let path = match file {
            TlsFile::Certificate => &self.files.cert,
            TlsFile::Ca => &self.files.ca,
        };
        match result {
            Ok(true) if file == TlsFile::Ca => {
                tracing::info!(file = %path.display(), "new CA bundle in force");
                counter(file, Reload::Applied);
            }
            Ok(true) => {
                let serial = self
                    .chain()
                    .first()
                    .and_then(|leaf| super::CertInfo::parse(leaf).ok())
                    .map(|i| i.serial_hex())
                    .unwrap_or_default();
                tracing::info!(file = %path.display(), %serial,
                    "new certificate in force: new handshakes use it");
                counter(file, Reload::Applied);
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e,
                    "new TLS file refused; the one in force stays");
                counter(file, e.outcome());
            }
        }
    }

    /// Watches the files until the task ends, looking every `every`: a CA file
    /// changed is put in force first, then a certificate or key changed (see the
    /// module). Each outcome goes to `counter`; a refused version is counted once, and
    /// tried again when it changes.
    pub async fn watch(self: Arc<Self>, every: Duration, counter: ReloadCounter) {
        let paths = [
            self.files.cert.clone(),
            self.files.key.clone(),
            self.files.ca.clone(),
        ];
        let mut seen = read_all(&paths).await;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut now = read_all(&paths).await;
            if now == seen {
                continue;
            }
            // Changing: wait until it stops (bounded), so that a pair is read whole.
            for _ in 0..25 {
                tokio::time::sleep(SETTLE).await;
                let again = read_all(&paths).await;
                if again == now {
                    break;
                }
                now = again;
            }
            let [cert, key, ca] = &now;
            if *ca != seen[2] {
                let result = text(ca, &self.files.ca).and_then(|pem| self.set_cas(&pem));
                self.outcome(&counter, TlsFile::Ca, result.map(|()| true));
            }
            if *cert != seen[0] || *key != seen[1] {
                let result = text(cert, &self.files.cert).and_then(|c| {
                    let k = text(key, &self.files.key)?;
                    self.set_identity(&c, &k)
                });
                self.outcome(&counter, TlsFile::Certificate, result);
            }
            seen = now;
        }
    }
}

/// A file's bytes, or why it could not be read.
type Contents = Result<Vec<u8>, std::io::ErrorKind>;

async fn read_all(paths: &[PathBuf; 3]) -> [Contents; 3] {
    let read = |p: &PathBuf| {
        let p = p.clone();
        async move { tokio::fs::read(&p).await.map_err(|e| e.kind()) }
    };
    let (a, b, c) = tokio::join!(read(&paths[0]), read(&paths[1]), read(&paths[2]));
    [a, b, c]
}

fn text(contents: &Contents, path: &std::path::Path) -> Result<String, ReloadError> {
    match contents {
        Ok(bytes) => Ok(String::from_utf8_lossy(bytes).into_owned()),
        Err(kind) => Err(TlsError::Read {
            path: path.display().to_string(),
            source: std::io::Error::from(*kind),
        }
        .into()),
    }
}

fn server_verifier(cas: &[CertificateDer<'static>]) -> Result<Arc<WebPkiServerVerifier>, TlsError> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots(cas)?), provider())
        .build()
        .map_err(|e| TlsError::Certificate(e.to_string()))
}

/// Checks that `chain` (leaf first) leads to one of `cas` by issuer names and
/// signatures; `ca_path` names the CA file in the error. The handshake's own checks
/// (validity, key usage, names) stay the peer's.
pub fn check_chain(
    chain: &[CertificateDer<'static>],
    cas: &[CertificateDer<'static>],
    ca_path: &std::path::Path,
) -> Result<(), ReloadError> {
    use x509_parser::prelude::*;
    fn parse<'a>(der: &'a CertificateDer<'static>) -> Result<X509Certificate<'a>, TlsError> {
        X509Certificate::from_der(der.as_ref())
            .map(|(_, c)| c)
            .map_err(|e| TlsError::Certificate(e.to_string()))
    }
    let untrusted = |reason: String| ReloadError::Untrusted {
        ca: ca_path.display().to_string(),
        reason,
    };
    let chain = chain.iter().map(parse).collect::<Result<Vec<_>, _>>()?;
    let cas = cas.iter().map(parse).collect::<Result<Vec<_>, _>>()?;
    let Some(mut current) = chain.first() else {
        return Err(untrusted("no certificate".into()));
    };
    // Each step climbs one certificate of the chain; a longer walk is a loop.
    for _ in 0..=chain.len() {
        let signed_by = |c: &&X509Certificate<'_>| {
            c.subject() == current.issuer()
                && current.verify_signature(Some(c.public_key())).is_ok()
        };
        if cas.iter().any(|ca| signed_by(&ca)) {
            return Ok(());
        }
        match chain.iter().skip(1).find(signed_by) {
            Some(next) => current = next,
            None => {
                return Err(untrusted(format!(
                    "no CA or intermediate named {} signed {}",
                    current.issuer(),
                    current.subject()
                )))
            }
        }
    }
    Err(untrusted("the chain loops".into()))
}

impl ResolvesClientCert for LiveTls {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl ResolvesServerCert for LiveTls {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A client's check of the server's certificate against the CAs in force.
#[derive(Debug)]
pub struct LiveServerVerifier(pub Arc<LiveTls>);

impl ServerCertVerifier for LiveServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.server_verifier_now().verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .server_verifier_now()
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .server_verifier_now()
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.server_verifier_now().supported_verify_schemes()
    }
}

/// Reload outcomes counted by file and result, for a process that renders its metrics
/// itself (the agent).
#[derive(Debug, Default)]
pub struct ReloadCounts {
    counts: [[std::sync::atomic::AtomicU64; Reload::ALL.len()]; 2],
}

impl ReloadCounts {
    /// Counts one outcome.
    pub fn count(&self, file: TlsFile, result: Reload) {
        self.counts[file as usize][result as usize]
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many times `result` came of `file`.
    pub fn get(&self, file: TlsFile, result: Reload) -> u64 {
        self.counts[file as usize][result as usize].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A counter for [`LiveTls`] that counts here.
    pub fn counter(self: &Arc<Self>) -> ReloadCounter {
        let counts = self.clone();
        Arc::new(move |file, result| counts.count(file, result))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Ca, NodeSpec};

    fn write_node(ca: &Ca, dir: &std::path::Path, node: &str) -> crate::pki::Pem {
        let spec = NodeSpec::new(node, &[], Duration::from_secs(60)).expect("spec");
        let pem = ca.issue_node_with(&spec).expect("issue").pem;
        pem.write(dir, "node").expect("write");
        std::fs::write(dir.join("ca.pem"), ca.pem().cert).expect("ca");
        pem
    }

    fn leaf_name(live: &LiveTls) -> String {
        super::super::CertInfo::parse(&live.chain()[0])
            .expect("info")
            .identity
    }

    #[test]
    fn a_pair_that_does_not_match_or_another_cas_is_refused_and_the_old_stays() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::generate("test CA").expect("ca");
        let first = write_node(&ca, dir.path(), "n1");
        let files = TlsFiles::in_dir(dir.path(), "node");
        let live = LiveTls::client(&files).expect("load");
        let renewed = live.subscribe();
        let spec = NodeSpec::new("n2", &[], Duration::from_secs(60)).expect("spec");
        let second = ca.issue_node_with(&spec).expect("issue").pem;

        let e = live
            .set_identity(&second.cert, &first.key)
            .expect_err("mismatch");
        assert_eq!(e.outcome(), Reload::KeyMismatch, "{e}");
        let other = Ca::generate("other CA").expect("ca");
        let foreign = other.issue_node_with(&spec).expect("issue").pem;
        let e = live
            .set_identity(&foreign.cert, &foreign.key)
            .expect_err("untrusted");
        assert_eq!(e.outcome(), Reload::Untrusted, "{e}");
        let e = live.set_identity("junk", &second.key).expect_err("junk");
        assert_eq!(e.outcome(), Reload::Invalid, "{e}");
        assert_eq!(leaf_name(&live), "n1", "the pair in force stays");
        assert!(!renewed.has_changed().expect("open"));

        assert!(live.set_identity(&second.cert, &second.key).expect("good"));
        assert_eq!(leaf_name(&live), "n2");
        assert!(renewed.has_changed().expect("open"));
        assert!(!live.set_identity(&second.cert, &second.key).expect("same"));

        // A new CA bundle that trusts the other CA too: its certificates are taken.
        let bundle = format!("{}{}", ca.pem().cert, other.pem().cert);
        live.set_cas(&bundle).expect("bundle");
        assert!(live
            .set_identity(&foreign.cert, &foreign.key)
            .expect("now trusted"));
    }

    #[tokio::test]
    async fn watched_files_are_taken_within_the_check_interval_and_refusals_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::generate("test CA").expect("ca");
        let first = write_node(&ca, dir.path(), "n1");
        let files = TlsFiles::in_dir(dir.path(), "node");
        let live = LiveTls::client(&files).expect("load");
        let counts = Arc::new(ReloadCounts::default());
        let every = Duration::from_millis(100);
        let task = tokio::spawn(live.clone().watch(every, counts.counter()));
        tokio::time::sleep(Duration::from_millis(150)).await;

        // A key that is not the certificate's: refused once, counted, old pair kept.
        let spec = NodeSpec::new("n2", &[], Duration::from_secs(60)).expect("spec");
        let second = ca.issue_node_with(&spec).expect("issue").pem;
        std::fs::write(files.cert.clone(), &second.cert).expect("write");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while counts.get(TlsFile::Certificate, Reload::KeyMismatch) == 0 {
            assert!(std::time::Instant::now() < deadline, "never refused");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(counts.get(TlsFile::Certificate, Reload::KeyMismatch), 1);
        assert_eq!(leaf_name(&live), "n1");

        // The matching key follows: taken.
        let written = std::time::Instant::now();
        std::fs::write(files.key.clone(), &second.key).expect("write");
        while leaf_name(&live) != "n2" {
            assert!(written.elapsed() < Duration::from_secs(5), "never taken");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            written.elapsed() < every * 2 + SETTLE * 2,
            "{:?}",
            written.elapsed()
        );
        assert_eq!(counts.get(TlsFile::Certificate, Reload::Applied), 1);
        drop(first);
        task.abort();
    }
}
