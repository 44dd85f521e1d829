//! The HTTP listener of the aggregator's API and of the relay's `/healthz` and
//! `/metrics`, with its limits: a cap on open connections, a deadline for
//! every request on a connection (the first and each one after it), and an idle
//! timeout. A client that trickles its headers, on a new connection or on one that
//! has had its answers, or a watcher that stops reading, holds a connection for a
//! bounded time, and no number of them can take more than the cap.
//!
//! With TLS (`[http_tls]`), each connection's handshake runs in a task of its own, under
//! the same deadline, so that a slow handshake holds up no other connection; a client
//! certificate is optional, and one that does not verify fails the handshake (counted
//! as `revoked` when the revocation list in force names it, `bad_cert` otherwise). The
//! certificate's name and chain travel with the connection ([`Peer`]), so that a
//! request on a connection made before the list changed can be checked again.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

use crate::revocation::Revocation;
use ballast_shared::tls::CertificateDer;

/// Who is at the other end of a connection: its address, and the name of the client
/// certificate it presented over TLS, if any (for the HTTP API's authentication).
#[derive(Debug, Clone)]
pub struct Peer {
    /// The remote address.
    pub addr: SocketAddr,
    /// The client certificate's name ([`ballast_shared::tls::CertInfo::identity`]).
    pub cert: Option<Arc<str>>,
    /// The client certificate's chain as presented (leaf first), checked again against
    /// the revocation list in force on each request: a keep-alive connection outlives
    /// a change of the list.
    pub chain: Option<Arc<[CertificateDer<'static>]>>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Limited>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Limited>) -> Self {
        stream.remote_addr().clone()
    }
}

/// What the listener holds its connections to: `[limits]`' `http_` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections open at once (`http_max_connections`).
    pub max_connections: usize,
    /// How long each request has, from its first byte, for its response to start
    /// (`http_request_timeout_ms`).
    pub request_timeout: Duration,
    /// How long a connection may then go without a byte either way
    /// (`http_idle_timeout_ms`).
    pub idle_timeout: Duration,
}

/// Where the listener counts what it refuses: the program's own metrics.
pub trait HttpCounts: Send + Sync + 'static {
    /// A connection refused or cut off, for `reason` (`connections`, `timeout`, ...).
    fn refuse(&self, reason: &str);
    /// A TLS handshake that failed on the client's certificate: `revoked` when the
    /// revocation list in force names it, `bad_cert` for any other reason.
    fn refuse_cert(&self, reason: &str);
}

/// Accepts at most `http_max_connections` at a time; the rest wait in the backlog.
pub struct Limited {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    /// Where refusals and cut-off connections are counted.
    metrics: Arc<dyn HttpCounts>,
    /// How long each request has, from its first byte, for its response to start.
    request: Duration,
    /// How long a connection may then go without a byte either way.
    idle: Duration,
    /// TLS, when configured.
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// Handshakes under way.
    handshakes: JoinSet<Option<(Conn, Peer)>>,
}

impl Limited {
    /// Limits `inner` by `limits`, counting what it refuses or cuts off in `metrics`.
    pub fn new(inner: TcpListener, metrics: Arc<dyn HttpCounts>, limits: HttpLimits) -> Self {
        let permits = Arc::new(Semaphore::new(limits.max_connections));
        Limited {
            inner,
            permits,
            metrics,
            request: limits.request_timeout,
            idle: limits.idle_timeout,
            tls: None,
            handshakes: JoinSet::new(),
        }
    }

    /// Serves TLS with `config` on every connection.
    pub fn with_tls(mut self, config: Arc<rustls::ServerConfig>) -> Self {
        self.tls = Some(tokio_rustls::TlsAcceptor::from(config));
        self
    }

    /// The next TCP connection, under the cap.
    async fn next_tcp(
        inner: &TcpListener,
        permits: &Arc<Semaphore>,
        metrics: &dyn HttpCounts,
    ) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
        loop {
            let permit = match permits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    metrics.refuse("connections");
                    match permits.clone().acquire_owned().await {
                        Ok(p) => p,
                        // The semaphore is never closed.
                        Err(_) => continue,
                    }
                }
            };
            match inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (stream, addr, permit);
                }
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Runs the TLS handshake of `stream`; `None` (logged, and counted when the client's
/// certificate was refused) if it fails or misses the connection's deadline.
async fn handshake(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: Guarded,
    addr: SocketAddr,
    metrics: Arc<dyn HttpCounts>,
) -> Option<(Conn, Peer)> {
    match acceptor.accept(stream).await {
        Ok(tls) => {
            let presented = tls.get_ref().1.peer_certificates();
            let cert = presented
                .and_then(|chain| chain.first())
                .and_then(|leaf| ballast_shared::tls::CertInfo::parse(leaf).ok())
                .map(|info| Arc::from(info.identity.as_str()));
            let chain = presented
                .filter(|chain| !chain.is_empty())
                .map(|chain| chain.iter().map(|c| c.clone().into_owned()).collect());
            Some((Conn::Tls(Box::new(tls)), Peer { addr, cert, chain }))
        }
        Err(e) => {
            let refused = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                .and_then(|r| match r {
                    rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked) => {
                        Some("revoked")
                    }
                    rustls::Error::InvalidCertificate(_)
                    | rustls::Error::InvalidCertRevocationList(_) => Some("bad_cert"),
                    _ => None,
                });
            if let Some(reason) = refused {
                metrics.refuse_cert(reason);
            }
            tracing::debug!(%addr, error = %e, "HTTP TLS handshake failed");
            None
        }
    }
}

/// An accepted connection: plain, or TLS once its handshake is done.
pub enum Conn {
    /// Plain HTTP.
    Plain(Guarded),
    /// HTTPS.
    Tls(Box<tokio_rustls::server::TlsStream<Guarded>>),
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, data),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }
}

impl axum::serve::Listener for Limited {
    type Io = Conn;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Limited {
                inner,
                permits,
                metrics,
                handshakes,
                ..
            } = self;
            let (stream, addr, permit) = tokio::select! {
                Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                    match done {
                        Ok(Some(conn)) => return conn,
                        _ => continue,
                    }
                }
                next = Self::next_tcp(inner, permits, metrics.as_ref()) => next,
            };
            let guarded = Guarded::new(
                stream,
                permit,
                self.metrics.clone(),
                self.request,
                self.idle,
            );
            match &self.tls {
                None => {
                    let peer = Peer {
                        addr,
                        cert: None,
                        chain: None,
                    };
                    return (Conn::Plain(guarded), peer);
                }
                Some(acceptor) => {
                    self.handshakes.spawn(handshake(
                        acceptor.clone(),
                        guarded,
                        addr,
                        self.metrics.clone(),
                    ));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(Peer {
            addr: self.inner.local_addr()?,
            cert: None,
            chain: None,
        })
    }
}

/// Where a connection is between requests, for its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A request is being read: from the accept, or from the first byte after a
    /// response. Reads do not move the deadline: the whole request head must come
    /// within `http_request_timeout_ms`, so no request can be trickled in.
    Request,
    /// A response is being written (a watch stream's, say); each write moves the
    /// deadline `http_idle_timeout_ms` on.
    Responding,
}

/// One accepted connection, holding its place under the cap, cut off when it misses
/// its deadline: every request on it (the first and each one after a response) must
/// have its response started within `http_request_timeout_ms` of its first byte,
/// and between requests, or while a response is written, a byte must move every
/// `http_idle_timeout_ms`.
pub struct Guarded {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    metrics: Arc<dyn HttpCounts>,
    deadline: Pin<Box<Sleep>>,
    phase: Phase,
    request: Duration,
    idle: Duration,
}

impl Guarded {
    fn new(
        stream: TcpStream,
        permit: OwnedSemaphorePermit,
        metrics: Arc<dyn HttpCounts>,
        request: Duration,
        idle: Duration,
    ) -> Self {
        Guarded {
            stream,
            _permit: permit,
            metrics,
            deadline: Box::pin(tokio::time::sleep(request)),
            phase: Phase::Request,
            request,
            idle,
        }
    }

    /// After bytes were read: the first after a response begins the next request,
    /// whose deadline runs from now and is not moved by the rest of it.
    fn read_some(&mut self) {
        if self.phase == Phase::Responding {
            self.phase = Phase::Request;
            self.deadline.as_mut().reset(Instant::now() + self.request);
        }
    }

    /// After bytes were written: a response is under way, and may go on while bytes
    /// keep moving.
    fn wrote_some(&mut self) {
        let next = Instant::now() + self.idle;
        if self.phase == Phase::Request {
            self.phase = Phase::Responding;
            self.deadline.as_mut().reset(next);
        } else if next > self.deadline.deadline() + Duration::from_millis(250) {
            // Resetting the timer on every small write costs more than it buys.
            self.deadline.as_mut().reset(next);
        }
    }

    /// `poll` as the stream answered it; a pending one becomes the timeout error once
    /// the deadline has passed (its waker is registered either way).
    fn guard<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => match self.expired(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }

    /// Moves the deadline on after a write of `n` bytes.
    fn wrote(&mut self, r: &io::Result<usize>) {
        if matches!(r, Ok(n) if *n > 0) {
            self.wrote_some();
        }
    }

    /// The timeout error if the deadline has passed; registers the waker otherwise.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.deadline.as_mut().poll(cx).is_pending() {
            return None;
        }
        let reason = match self.phase {
            Phase::Request => "request_timeout",
            Phase::Responding => "idle_timeout",
        };
        self.metrics.refuse(reason);
        Some(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("HTTP connection cut off: {reason}"),
        ))
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if poll.is_ready() && buf.filled().len() > before {
            self.read_some();
        }
        self.guard(cx, poll)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, data);
        if let Poll::Ready(r) = &poll {
            self.wrote(r);
        }
        self.guard(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.guard(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = ready!(Pin::new(&mut self.stream).poll_shutdown(cx));
        Poll::Ready(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(r) = &poll {
            self.wrote(r);
        }
        self.guard(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A client certificate is optional on the HTTP listener: one that is presented is
/// checked by the CA verifier, and refused at the handshake if it does not verify.
#[derive(Debug)]
struct OptionalClientCert(Arc<ballast_shared::tls::ClientVerifier>);

impl rustls::server::danger::ClientCertVerifier for OptionalClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.0.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The HTTP listener's TLS as a daemon runs it (`[http_tls]`): the server
/// configuration, and what of it is the listener's own to watch.
pub struct HttpTls {
    /// The configuration every connection's handshake runs with.
    pub config: Arc<rustls::ServerConfig>,
    /// The certificate, key and CA files when they are the listener's own (run its
    /// `watch`); `None` when they are the agents' listener's, watched by ingest.
    pub files: Option<Arc<ballast_shared::tls::live::LiveTls>>,
    /// The revocation list client certificates are checked against: the listener's own
    /// (`http_auth.crl`; run its [`Revocation::watch_counting`]), or the agents'
    /// listener's (`authorization.crl`, watched by ingest) when the files are theirs.
    pub revocation: Arc<Revocation>,
    /// Whether `revocation` is the listener's own, for its caller to watch.
    pub own_revocation: bool,
}

impl HttpTls {
    /// Starts, under `supervisor`, the watches of what is the listener's own: its TLS
    /// files (reloads counted in `metrics`' `tls_reloads`, the `file` label prefixed
    /// `http_`) and its revocation list (reloads counted in `http_crl_reloads`). What
    /// is the agents' listener's is watched by ingest, and not here. The tasks, for
    /// the daemon to end at shutdown.
    pub fn spawn_watches(
        &self,
        supervisor: &crate::supervise::Supervisor,
        metrics: &Arc<crate::metrics::IngestMetrics>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        if let Some(live) = &self.files {
            tasks.push(supervisor.spawn(
                "HTTP TLS files",
                live.clone().watch(
                    ballast_shared::tls::live::CHECK_EVERY,
                    crate::metrics::tls_reload_counter(metrics, "http_"),
                ),
            ));
        }
        if self.own_revocation {
            tasks.push(
                supervisor.spawn(
                    "HTTP revocation list",
                    self.revocation
                        .clone()
                        .watch_counting(metrics.http_crl_reloads.clone()),
                ),
            );
        }
        tasks
    }
}

/// The HTTP listener's TLS from `files` (`[http_tls]`), for a daemon whose agents'
/// listener is `agents`, set up from `agent_files` (`[tls]`):
///
/// - on the agents' files, the agents' listener's live certificate and verifier, its
///   revocation list (`authorization.crl`) included: one set of watched files;
/// - on files of its own, the certificate and key taken live as the QUIC listener's
///   are, and client certificates (optional) checked against the CA file (also taken
///   live) and against the revocation list `crl` (`http_auth.crl`), if one is given,
///   its file checked for changes every `crl_check`.
///
/// `crl` with the agents' files is refused: their list is `authorization.crl`'s.
/// HTTP/1.1 only.
pub fn http_tls(
    files: &ballast_shared::config::TlsFiles,
    crl: Option<std::path::PathBuf>,
    crl_check: Duration,
    agent_files: &ballast_shared::config::TlsFiles,
    agents: &crate::Ingest,
) -> Result<HttpTls, crate::IngestError> {
    if files == agent_files {
        if crl.is_some() {
            return Err(crate::IngestError::Setting {
                setting: "http_auth.crl",
                reason: "[http_tls] names the files of [tls], whose client certificates are \
                         checked against authorization.crl: set that one instead",
            });
        }
        let revocation = agents.revocation();
        return Ok(HttpTls {
            config: server_config(agents.live_tls(), revocation.verifier())?,
            files: None,
            revocation,
            own_revocation: false,
        });
    }
    let identity = files.identity()?;
    let cas = files.ca_certs()?;
    let revocation = Arc::new(Revocation::load(&cas, crl, crl_check)?);
    let live =
        ballast_shared::tls::live::LiveTls::server(files, identity, cas, revocation.verifier())?;
    Ok(HttpTls {
        config: server_config(live.clone(), revocation.verifier())?,
        files: Some(live),
        revocation,
        own_revocation: true,
    })
}

/// The HTTP listener's TLS presenting the certificate `live` has in force, client
/// certificates (optional) checked by `verifier`: the QUIC listener's own when
/// `[http_tls]` names the files of `[tls]`, so that its revocation list holds here too.
pub fn server_config(
    live: Arc<ballast_shared::tls::live::LiveTls>,
    verifier: Arc<ballast_shared::tls::ClientVerifier>,
) -> Result<Arc<rustls::ServerConfig>, ballast_shared::tls::TlsError> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_client_cert_verifier(Arc::new(OptionalClientCert(verifier)))
    .with_cert_resolver(live);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
