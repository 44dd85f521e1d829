//! The xDS listener's connections: how many may be open, in all and from one source
//! address, and their TLS.
//!
//! Connections are counted from the accept, before any TLS: one over
//! `xds_max_connections`, or over `xds_max_connections_per_source` from its address,
//! is closed at once and counted (`ballast_xds_refused_total{reason="connections"}`,
//! `{reason="source_connections"}`). Streams are counted the same way
//! ([`Places`], `xds_max_streams` and `xds_max_streams_per_source`).
//!
//! TLS is terminated here rather than by tonic, so that in `mutual` mode the client's
//! certificate is checked by the same verifier as the agents' (its chain, lifetime and
//! the revocation list in force), and a live connection whose certificate the list
//! comes to revoke is closed when the list changes.

use crate::ingest::revocation::{Revocation, Verdict};
use crate::metrics::XdsMetrics;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Places taken, in all and by source address, under two caps.
#[derive(Debug, Default)]
pub(crate) struct Places {
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// Why a place was refused: the cap in all, or the source's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// `max` places are taken.
    All,
    /// `per_source` places are taken by this source.
    Source,
}

impl Places {
    /// A place for `source`, if fewer than `max` are taken in all and fewer than
    /// `per_source` by `source` (not counted by source when unknown).
    pub(crate) fn take(
        self: &Arc<Self>,
        source: Option<IpAddr>,
        max: usize,
        per_source: usize,
    ) -> Result<Place, Full> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if c.total >= max {
            return Err(Full::All);
        }
        if let Some(ip) = source {
            let n = c.by_source.entry(ip).or_default();
            if *n >= per_source {
                return Err(Full::Source);
            }
            *n += 1;
        }
        c.total += 1;
        Ok(Place {
            places: self.clone(),
            source,
        })
    }
}

/// One place, given back when dropped.
#[derive(Debug)]
pub(crate) struct Place {
    places: Arc<Places>,
    source: Option<IpAddr>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut c = self.places.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(ip) = self.source {
            if let Some(n) = c.by_source.get_mut(&ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.by_source.remove(&ip);
                }
            }
        }
    }
}

/// The xDS port's TLS: the server's configuration, and in `mutual` mode the
/// revocation list its verifier checks, to check live connections again when it
/// changes.
#[derive(Clone)]
pub struct XdsTls {
    pub(crate) server: Arc<rustls::ServerConfig>,
    pub(crate) revocation: Option<Arc<Revocation>>,
}

impl XdsTls {
    /// TLS with the certificate `live` holds now, taken afresh at each handshake (so a
    /// renewed certificate serves the next client); with `revocation`, client
    /// certificates are required and checked by its verifier (mutual TLS), against the
    /// client CAs the agents' listener follows too.
    pub(crate) fn new(
        live: Arc<ballast_shared::tls::live::LiveTls>,
        revocation: Option<Arc<Revocation>>,
    ) -> Result<XdsTls, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?;
        let mut server = match &revocation {
            Some(r) => builder
                .with_client_cert_verifier(r.verifier())
                .with_cert_resolver(live),
            None => builder.with_no_client_auth().with_cert_resolver(live),
        };
        // No session resumption: a resumed session skips the client certificate's
        // check, and so would let a revoked certificate back in.
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        server.send_tls13_tickets = 0;
        server.alpn_protocols = vec![b"h2".to_vec()];
        Ok(XdsTls {
            server: Arc::new(server),
            revocation,
        })
    }
}

/// What the accept loop needs.
pub(crate) struct Acceptor {
    pub(crate) listener: TcpListener,
    pub(crate) tls: Option<XdsTls>,
    pub(crate) places: Arc<Places>,
    pub(crate) max: usize,
    pub(crate) per_source: usize,
    pub(crate) metrics: Arc<XdsMetrics>,
}

impl Acceptor {
    /// Accepts connections until `shutdown`, and hands each on, after its TLS
    /// handshake if any, to `out`.
    pub(crate) async fn run(self, out: mpsc::Sender<XdsConn>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let accepted = tokio::select! {
                a = self.listener.accept() => a,
                _ = shutdown.wait_for(|s| *s) => return,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!(error = %e, "xDS accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let place = match self.places.take(Some(peer.ip()), self.max, self.per_source) {
                Ok(p) => p,
                Err(full) => {
                    let reason = match full {
                        Full::All => "connections",
                        Full::Source => "source_connections",
                    };
                    self.metrics.refuse(reason);
                    tracing::debug!(%peer, reason, "xDS connection refused");
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let local = stream.local_addr().ok();
            let guard = Counted::new(self.metrics.clone(), place);
            let tls = self.tls.clone();
            let out = out.clone();
            let metrics = self.metrics.clone();
            tokio::spawn(async move {
                let conn = match tls {
                    None => XdsConn::new(Io::Plain(stream), peer, local, None, guard),
                    Some(tls) => {
                        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
                        let shaken =
                            tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                        let stream = match shaken {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                metrics.refuse("tls");
                                tracing::debug!(%peer, error = %e, "xDS TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                metrics.refuse("tls");
                                tracing::debug!(%peer, "xDS TLS handshake timed out");
                                return;
                            }
                        };
                        let watch = tls.revocation.and_then(|r| {
                            let chain = stream.get_ref().1.peer_certificates()?.to_vec();
                            Some(revoked(r, chain, metrics.clone()))
                        });
                        XdsConn::new(Io::Tls(Box::new(stream)), peer, local, watch, guard)
                    }
                };
                // The server is gone when the channel is: the connection closes.
                let _ = out.send(conn).await;
            });
        }
    }
}

/// Resolves once the revocation list in force revokes `chain` (or finds it expired
/// when the list changes), counting it.
fn revoked(
    revocation: Arc<Revocation>,
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    metrics: Arc<XdsMetrics>,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    let mut changes = revocation.subscribe();
    Box::pin(async move {
        loop {
            if changes.changed().await.is_err() {
                // No list will change any more: the connection lives on.
                return std::future::pending().await;
            }
            let reason = match revocation.verdict(&chain) {
                Verdict::Valid => continue,
                Verdict::Revoked => "revoked",
                Verdict::Expired => "expired",
            };
            metrics.refuse(reason);
            tracing::info!(
                reason,
                "xDS connection closed: its client certificate is no longer valid"
            );
            return;
        }
    })
}

/// A connection's place, and the open connections' gauge, for as long as it lives.
struct Counted {
    metrics: Arc<XdsMetrics>,
    _place: Place,
}

impl Counted {
    fn new(metrics: Arc<XdsMetrics>, place: Place) -> Self {
        metrics.connections.inc();
        Counted {
            metrics,
            _place: place,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.metrics.connections.dec();
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// One accepted connection, as the xDS server reads and writes it.
pub(crate) struct XdsConn {
    io: Io,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    /// Resolves when the client's certificate is revoked: the connection then fails.
    revoked: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    _counted: Counted,
}

impl XdsConn {
    fn new(
        io: Io,
        peer: SocketAddr,
        local: Option<SocketAddr>,
        revoked: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        counted: Counted,
    ) -> Self {
        XdsConn {
            io,
            peer,
            local,
            revoked,
            _counted: counted,
        }
    }

    /// An error once the client's certificate has been revoked (the waker is
    /// registered otherwise).
    fn check(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        let r = self.revoked.as_mut()?;
        r.as_mut().poll(cx).is_ready().then(|| {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the client's certificate was revoked",
            )
        })
    }
}

impl Connected for XdsConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        TcpConnectInfo {
            local_addr: self.local,
            remote_addr: Some(self.peer),
        }
    }
}

impl AsyncRead for XdsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for XdsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, data),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
