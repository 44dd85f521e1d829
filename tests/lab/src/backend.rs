//! The lab's backend: an HTTP/1.1 service with a CPU-bound handler.
//!
//! - `GET /work`: burns [`BackendConfig::rounds`] rounds of a hash and answers `200`
//!   with the backend's name in the body and in `X-Backend`, so the client can tell
//!   where each request went. While stalled, the handler sleeps instead: a service
//!   waiting on a slow disk or database, with low CPU and piling-up requests.
//! - `GET /metrics`, in Prometheus text format: the in-flight gauge
//!   ([`INFLIGHT_METRIC`]) and the highest in-flight since the previous read
//!   ([`INFLIGHT_PEAK_METRIC`]), a request counter, and the TCP connections open now
//!   ([`CONNECTIONS_METRIC`]), at most since the previous read
//!   ([`CONNECTIONS_PEAK_METRIC`]) and accepted in all. Connections and requests differ
//!   behind a proxy that keeps idle connections to its servers for reuse: the lab
//!   shows with these how many such pooled connections a backend holds.
//! - `POST /admin/stall?ms=N`: stall every later request for `N` ms (0: back to work).
//! - `GET /healthz`: `ok`.
//!
//! The CPU work runs on the request's own task: a server whose workers do the work
//! themselves, so a throttled cgroup delays every request behind it, as it would a real
//! one.

use axum::extract::{Query, State};
use axum::http::header::HeaderName;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The name of the in-flight gauge on `/metrics`.
pub const INFLIGHT_METRIC: &str = "lab_inflight_requests";
/// The highest in-flight count since the previous `/metrics` read: a sampler that
/// reads once a second still sees a brief pile-up.
pub const INFLIGHT_PEAK_METRIC: &str = "lab_inflight_requests_peak";
/// The name of the served-requests counter on `/metrics`.
pub const SERVED_METRIC: &str = "lab_requests_served_total";
/// TCP connections open now (the scraper's own included).
pub const CONNECTIONS_METRIC: &str = "lab_connections_open";
/// The most TCP connections open at once since the previous `/metrics` read.
pub const CONNECTIONS_PEAK_METRIC: &str = "lab_connections_open_peak";
/// TCP connections accepted since the start.
pub const ACCEPTED_METRIC: &str = "lab_connections_accepted_total";
/// The longest stall accepted, so that a typo cannot hang every request for hours.
pub const MAX_STALL_MS: u64 = 60_000;

/// What a backend does per request.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    /// Its name, returned with every answer.
    pub name: String,
    /// Hash rounds per request.
    pub rounds: u64,
    /// Initial stall in ms (0: burn CPU).
    pub stall_ms: u64,
}

struct Shared {
    name: HeaderValue,
    body: String,
    rounds: u64,
    stall_ms: AtomicU64,
    inflight: Gauge,
    served: AtomicU64,
    connections: Arc<Connections>,
}

/// A count that goes up and down, with the highest value since it was last read.
#[derive(Default)]
struct Gauge {
    now: AtomicI64,
    peak: AtomicI64,
}

impl Gauge {
    fn up(&self) {
        let v = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(v, Ordering::SeqCst);
    }

    fn down(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    fn now(&self) -> i64 {
        self.now.load(Ordering::SeqCst).max(0)
    }

    /// The highest value since the last call (at least the current one), and starts
    /// the next period at the current value.
    fn take_peak(&self) -> i64 {
        let now = self.now.load(Ordering::SeqCst);
        self.peak.swap(now, Ordering::SeqCst).max(now).max(0)
    }
}

/// Counts a request as in flight until dropped, so a request whose client went away
/// mid-way is not counted forever.
struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    fn enter(gauge: &'a Gauge) -> Self {
        gauge.up();
        InFlight(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.down();
    }
}

/// The backend's TCP connections.
#[derive(Default)]
struct Connections {
    open: Gauge,
    accepted: AtomicU64,
}

/// A listener that counts the connections it accepts and how many are still open.
struct CountingListener {
    inner: TcpListener,
    connections: Arc<Connections>,
}

impl axum::serve::Listener for CountingListener {
    type Io = CountedStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        self.connections.accepted.fetch_add(1, Ordering::Relaxed);
        self.connections.open.up();
        let stream = CountedStream {
            inner: stream,
            connections: self.connections.clone(),
        };
        (stream, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An accepted connection, counted as open until dropped.
struct CountedStream {
    inner: TcpStream,
    connections: Arc<Connections>,
}

impl Drop for CountedStream {
    fn drop(&mut self) {
        self.connections.open.down();
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Why the backend cannot start.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The name cannot be an HTTP header value.
    #[error("backend name {0:?} is not a valid header value")]
    Name(String),
    /// The server failed.
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
}

/// The service's routes.
pub fn router(cfg: &BackendConfig) -> Result<Router, BackendError> {
    routes(cfg, Arc::default())
}

/// The routes, reporting `connections` on `/metrics`.
fn routes(cfg: &BackendConfig, connections: Arc<Connections>) -> Result<Router, BackendError> {
    let shared = Arc::new(Shared {
        name: HeaderValue::from_str(&cfg.name).map_err(|_| BackendError::Name(cfg.name.clone()))?,
        body: format!("{}\n", cfg.name),
        rounds: cfg.rounds,
        stall_ms: AtomicU64::new(cfg.stall_ms.min(MAX_STALL_MS)),
        inflight: Gauge::default(),
        served: AtomicU64::new(0),
        connections,
    });
    Ok(Router::new()
        .route("/work", get(work))
        .route("/metrics", get(metrics))
        .route("/admin/stall", post(stall))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(shared))
}

/// Serves `cfg` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: &BackendConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BackendError> {
    let connections = Arc::new(Connections::default());
    let app = routes(cfg, connections.clone())?;
    let listener = CountingListener {
        inner: listener,
        connections,
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

async fn work(State(s): State<Arc<Shared>>) -> Response {
    let _inflight = InFlight::enter(&s.inflight);
    let stall = s.stall_ms.load(Ordering::Relaxed);
    let seed = s.served.load(Ordering::Relaxed);
    if stall > 0 {
        tokio::time::sleep(Duration::from_millis(stall)).await;
    } else {
        std::hint::black_box(crate::work::burn(s.rounds, seed));
    }
    s.served.fetch_add(1, Ordering::Relaxed);
    let mut resp = s.body.clone().into_response();
    resp.headers_mut()
        .insert(HeaderName::from_static("x-backend"), s.name.clone());
    resp
}

async fn metrics(State(s): State<Arc<Shared>>) -> String {
    let c = &s.connections;
    format!(
        "# TYPE {INFLIGHT_METRIC} gauge\n{INFLIGHT_METRIC} {}\n\
         # TYPE {INFLIGHT_PEAK_METRIC} gauge\n{INFLIGHT_PEAK_METRIC} {}\n\
         # TYPE {SERVED_METRIC} counter\n{SERVED_METRIC} {}\n\
         # TYPE {CONNECTIONS_METRIC} gauge\n{CONNECTIONS_METRIC} {}\n\
         # TYPE {CONNECTIONS_PEAK_METRIC} gauge\n{CONNECTIONS_PEAK_METRIC} {}\n\
         # TYPE {ACCEPTED_METRIC} counter\n{ACCEPTED_METRIC} {}\n",
        s.inflight.now(),
        s.inflight.take_peak(),
        s.served.load(Ordering::Relaxed),
        c.open.now(),
        c.open.take_peak(),
        c.accepted.load(Ordering::Relaxed),
    )
}

#[derive(Deserialize)]
struct StallQuery {
    ms: u64,
}

async fn stall(State(s): State<Arc<Shared>>, Query(q): Query<StallQuery>) -> Response {
    if q.ms > MAX_STALL_MS {
        return (
            StatusCode::BAD_REQUEST,
            format!("ms must be at most {MAX_STALL_MS}\n"),
        )
            .into_response();
    }
    s.stall_ms.store(q.ms, Ordering::Relaxed);
    format!("stall {} ms\n", q.ms).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Connections are counted while open, whether or not they carry a request.
    #[test]
    fn metrics_count_open_connections() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let text = rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("address");
            let cfg = BackendConfig {
                name: "t-1".into(),
                rounds: 1,
                stall_ms: 0,
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                serve(listener, &cfg, async {
                    let _ = stopped.await;
                })
                .await
            });
            let idle: Vec<TcpStream> = vec![
                TcpStream::connect(addr).await.expect("connect"),
                TcpStream::connect(addr).await.expect("connect"),
            ];
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                .await
                .expect("write");
            let mut text = String::new();
            s.read_to_string(&mut text).await.expect("read");
            drop(idle);
            let _ = stop.send(());
            let _ = server.await;
            text
        });
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} in {text}"))
                .to_string()
        };
        assert_eq!(value(CONNECTIONS_METRIC), "3", "{text}");
        assert_eq!(value(ACCEPTED_METRIC), "3", "{text}");
        assert_eq!(value(INFLIGHT_METRIC), "0", "{text}");
    }
}
