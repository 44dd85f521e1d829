//! The threads that terminate agents' QUIC connections.
//!
//! Each thread runs a single-threaded runtime of its own, with a UDP socket of its own on
//! the QUIC port, and everything of a connection runs on it: the endpoint's driver, the
//! connection's driver and the connection's task. A report then wakes one thread, which
//! finds all of that at hand, where on a runtime with several workers a datagram woke
//! the endpoint's driver on one thread and the connection's task on another: on this
//! machine that hand-over, the futex and the context switch, was a fifth of the CPU a
//! report cost (`docs/performance.md`). With more than one thread the sockets share the
//! port (`SO_REUSEPORT`), and the kernel keeps each agent's datagrams on one socket by
//! their addresses.
//!
//! The rest of the daemon (the cycle, the feeds, the HTTP API) stays on the daemon's
//! runtime; the two meet in the shared state, as before.

use super::upstream::Upstream;
use super::Ingest;
use crate::metrics::IngestMetrics;
use crate::supervise::Supervisor;
use std::net::{SocketAddr, UdpSocket};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// How long a stopping thread waits for its closed connections to be told so.
const DRAIN: Duration = Duration::from_secs(3);

/// Why the QUIC threads could not start.
#[derive(Debug, thiserror::Error)]
pub enum ThreadsError {
    /// A socket could not be made or bound.
    #[error("binding QUIC socket {index} of {count} to {addr}: {source}")]
    Bind {
        /// Which socket.
        index: usize,
        /// How many there are to be.
        count: usize,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// A thread or its runtime could not be started.
    #[error("starting QUIC thread {index}: {source}")]
    Start {
        /// Which thread.
        index: usize,
        /// The cause.
        source: std::io::Error,
    },
}

/// The running threads.
pub struct Threads {
    /// Each thread's endpoint, to close them all at shutdown.
    endpoints: Vec<quinn::Endpoint>,
    /// Each thread's runtime, for work that belongs beside its connections.
    runtimes: Vec<tokio::runtime::Handle>,
    /// The bound address, its port resolved.
    pub addr: SocketAddr,
    /// How many threads still run.
    running: watch::Receiver<usize>,
    /// The panic that ended a thread, if one did.
    panicked: Arc<Mutex<Option<String>>>,
    /// The watched tasks that reload the revocation list and the TLS files, which end
    /// with the threads' handle.
    watchers: [tokio::task::JoinHandle<()>; 2],
}

/// Counts a thread out when it ends, however it ends.
struct Running(watch::Sender<usize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Binds `count` sockets to `addr` and starts a thread for each that accepts and serves
/// agents' connections until its endpoint is closed, each agent by `upstream`. Runs in
/// the daemon's runtime, where `supervisor` watches the tasks that reload the
/// revocation list and the TLS files.
pub async fn start<U: Upstream>(
    server: quinn::ServerConfig,
    addr: SocketAddr,
    count: usize,
    metrics: Arc<IngestMetrics>,
    ingest: Ingest,
    upstream: Arc<U>,
    supervisor: &Supervisor,
) -> Result<Threads, ThreadsError> {
    let count = count.max(1);
    let sockets = bind(addr, count)?;
    let bound = sockets
        .first()
        .and_then(|s| s.local_addr().ok())
        .unwrap_or(addr);
    let ingest = Arc::new(ingest);
    let (counter, running) = watch::channel(count);
    let panicked = Arc::new(Mutex::new(None));
    // One configuration for all, so that their stateless resets share a key: an agent
    // whose datagrams reach another thread's socket (its address changed) is told at
    // once that its connection is gone there, and connects again.
    let config = quinn::EndpointConfig::default();
    let mut endpoints: Vec<quinn::Endpoint> = Vec::with_capacity(count);
    let mut runtimes = Vec::with_capacity(count);
    let started = |endpoints: &[quinn::Endpoint]| {
        for e in endpoints {
            e.close(
                quinn::VarInt::from_u32(super::quic::close::NORMAL),
                b"start failed",
            );
        }
    };
    for (index, socket) in sockets.into_iter().enumerate() {
        let (ready, endpoint) = oneshot::channel();
        let running = Running(counter.clone());
        let (server, metrics, ingest) = (server.clone(), metrics.clone(), ingest.clone());
        let upstream = upstream.clone();
        let config = config.clone();
        let panicked = panicked.clone();
        std::thread::Builder::new()
            .name(format!("ballast-quic-{index}"))
            .spawn(move || {
                let _running = running;
                let run = AssertUnwindSafe(|| {
                    serve(socket, config, server, metrics, ingest, upstream, ready)
                });
                if let Err(panic) = std::panic::catch_unwind(run) {
                    let message = crate::supervise::panic_message(panic.as_ref());
                    tracing::error!(thread = index, %message, "a QUIC thread panicked");
                    *panicked.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
                }
            })
            .map_err(|source| {
                started(&endpoints);
                ThreadsError::Start { index, source }
            })?;
        let source = match endpoint.await {
            Ok(Ok((e, runtime))) => {
                endpoints.push(e);
                runtimes.push(runtime);
                continue;
            }
            Ok(Err(source)) => source,
            Err(_) => std::io::Error::other("the thread ended before it served"),
        };
        // The threads started so far end with their endpoints.
        started(&endpoints);
        return Err(ThreadsError::Start { index, source });
    }
    let tls_counter = crate::metrics::tls_reload_counter(&metrics, "");
    let tls = ingest
        .tls
        .clone()
        .watch(ballast_shared::tls::live::CHECK_EVERY, tls_counter);
    let crl = ingest.revocation.clone().watch(metrics);
    let watchers = [
        supervisor.spawn("TLS files", tls),
        supervisor.spawn("revocation list", crl),
    ];
    Ok(Threads {
        endpoints,
        runtimes,
        addr: bound,
        running,
        panicked,
        watchers,
    })
}

/// One thread's life: its runtime, its endpoint on `socket`, serving until the endpoint
/// is closed, then a short wait for its connections' close to go out.
fn serve<U: Upstream>(
    socket: UdpSocket,
    config: quinn::EndpointConfig,
    server: quinn::ServerConfig,
    metrics: Arc<IngestMetrics>,
    ingest: Arc<Ingest>,
    upstream: Arc<U>,
    ready: oneshot::Sender<std::io::Result<(quinn::Endpoint, tokio::runtime::Handle)>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    rt.block_on(async move {
        let endpoint =
            match quinn::Endpoint::new(config, Some(server), socket, Arc::new(quinn::TokioRuntime))
            {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
        let runtime = tokio::runtime::Handle::current();
        if ready.send(Ok((endpoint.clone(), runtime))).is_err() {
            return;
        }
        super::quic::serve(endpoint.clone(), metrics, ingest, upstream).await;
        let _ = tokio::time::timeout(DRAIN, endpoint.wait_idle()).await;
    });
}

/// `count` UDP sockets bound to `addr`: one alone, or several sharing the port, the
/// first choosing it when `addr` asks for any.
fn bind(addr: SocketAddr, count: usize) -> Result<Vec<UdpSocket>, ThreadsError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let mut sockets: Vec<UdpSocket> = Vec::with_capacity(count);
    let mut at = addr;
    if count > 1 {
        // Sharing the port would also share it with another process that asked to:
        // a plain bind first makes a port already in use an error, as with one thread,
        // and picks the port when `addr` asks for any.
        let probe = UdpSocket::bind(addr).map_err(|source| ThreadsError::Bind {
            index: 0,
            count,
            addr,
            source,
        })?;
        at = probe.local_addr().map_err(|source| ThreadsError::Bind {
            index: 0,
            count,
            addr,
            source,
        })?;
    }
    for index in 0..count {
        let err = |source| ThreadsError::Bind {
            index,
            count,
            addr: at,
            source,
        };
        let socket = if count == 1 {
            // Alone: a plain bind, so that another process on the port is an error.
            UdpSocket::bind(at).map_err(err)?
        } else {
            let s = Socket::new(Domain::for_address(at), Type::DGRAM, Some(Protocol::UDP))
                .map_err(err)?;
            s.set_reuse_port(true).map_err(err)?;
            s.bind(&at.into()).map_err(err)?;
            s.into()
        };
        if index == 0 {
            at = socket.local_addr().map_err(err)?;
        }
        sockets.push(socket);
    }
    Ok(sockets)
}

impl Threads {
    /// Resolves when a thread has ended, as it must not before shutdown; carries on
    /// the panic that ended it, if one did.
    pub async fn ended(&self) {
        let mut running = self.running.clone();
        let all = self.endpoints.len();
        let _ = running.wait_for(|n| *n < all).await;
        let panicked = self
            .panicked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(message) = panicked {
            std::panic::resume_unwind(Box::new(message));
        }
    }

    /// The first thread's runtime: work spawned there runs beside that thread's
    /// connections, and hands them data with no wake-up of another thread.
    pub fn runtime(&self) -> Option<&tokio::runtime::Handle> {
        self.runtimes.first()
    }

    /// Closes every endpoint: agents see the connection close.
    pub fn close(&self, code: u32, reason: &[u8]) {
        for e in &self.endpoints {
            e.close(quinn::VarInt::from_u32(code), reason);
        }
    }

    /// Waits until every thread has ended, its connections closed.
    pub async fn stopped(&self) {
        let mut running = self.running.clone();
        let _ = running.wait_for(|n| *n == 0).await;
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        // A daemon dropped without its shutdown still lets go of the port.
        self.close(super::quic::close::NORMAL, b"shutting down");
        for watcher in &self.watchers {
            watcher.abort();
        }
    }
}
