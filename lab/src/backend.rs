//! The lab's backend: an HTTP/1.1 service with a CPU-bound handler.
//!
//! - `GET /work`: burns [`BackendConfig::rounds`] rounds of a hash and answers `200`
//!   with the backend's name in the body and in `X-Backend`, so the client can tell
//!   where each request went. While stalled, the handler sleeps instead: a service
//!   waiting on a slow disk or database, with low CPU and piling-up requests.
//! - `GET /metrics`: the in-flight gauge ([`INFLIGHT_METRIC`]) and a request counter in
//!   Prometheus text format.
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
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The name of the in-flight gauge on `/metrics`.
pub const INFLIGHT_METRIC: &str = "lab_inflight_requests";
/// The name of the served-requests counter on `/metrics`.
pub const SERVED_METRIC: &str = "lab_requests_served_total";
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
    inflight: AtomicI64,
    served: AtomicU64,
}

/// Counts a request as in flight until dropped, so a request whose client went away
/// mid-way is not counted forever.
struct InFlight<'a>(&'a AtomicI64);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicI64) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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
    let shared = Arc::new(Shared {
        name: HeaderValue::from_str(&cfg.name).map_err(|_| BackendError::Name(cfg.name.clone()))?,
        body: format!("{}\n", cfg.name),
        rounds: cfg.rounds,
        stall_ms: AtomicU64::new(cfg.stall_ms.min(MAX_STALL_MS)),
        inflight: AtomicI64::new(0),
        served: AtomicU64::new(0),
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
    listener: tokio::net::TcpListener,
    cfg: &BackendConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BackendError> {
    let app = router(cfg)?;
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
    format!(
        "# TYPE {INFLIGHT_METRIC} gauge\n{INFLIGHT_METRIC} {}\n\
         # TYPE {SERVED_METRIC} counter\n{SERVED_METRIC} {}\n",
        s.inflight.load(Ordering::SeqCst).max(0),
        s.served.load(Ordering::Relaxed),
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
