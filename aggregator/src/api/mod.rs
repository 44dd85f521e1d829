//! The HTTP API: JSON views of services and endpoints, health, and Prometheus metrics.

pub(crate) mod listener;
pub mod views;

use crate::state::State;
use axum::extract::{Path, Query, State as AxState};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use std::fmt::Write as _;
use std::sync::Arc;

/// The OpenAPI document of this API.
pub(crate) const OPENAPI: &str = include_str!("openapi.json");

/// The router over shared state.
pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/services", get(services))
        .route("/v1/services/{name}", get(service))
        .route("/v1/services/{name}/endpoints", get(endpoints))
        .route("/v1/services/{name}/weights", get(weights))
        .route("/v1/config", get(config))
        .route("/v1/published", get(published))
        .fallback(not_found)
        .with_state(state)
}

/// A JSON error body with its status.
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn unknown_service(name: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("unknown service {name:?}"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = views::ErrorBody {
            error: self.message,
            status: self.status.as_u16(),
        };
        (self.status, Json(body)).into_response()
    }
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such route".into(),
    }
}

/// `GET /healthz`: 200 and `"status": "ok"` while the daemon balances; 503 and
/// `"status": "failing"`, with the reasons, when the cycle loop has not run for
/// three cycle lengths or the routing store has been failing for longer than
/// [`crate::store::writer::FAILING_UNHEALTHY_AFTER`]. A store error shorter than that
/// shows under `store_writer` and leaves the status ok: the aggregator keeps serving
/// the weights it has.
async fn healthz(AxState(state): AxState<Arc<State>>) -> (StatusCode, Json<serde_json::Value>) {
    let store = state
        .store_status
        .health(state.store.describe(), std::time::Instant::now());
    let mut failing = Vec::new();
    if let Some(age) = state.health.cycle_late(state.clock.now()) {
        failing.push(format!(
            "the cycle loop last ran {age} ms ago, more than {} cycle lengths",
            crate::state::CYCLE_LATE_AFTER
        ));
    }
    if store.unhealthy() {
        failing.push(format!(
            "the routing store has been failing for {:.0} s: {}",
            store.failing_seconds.unwrap_or_default(),
            store.error.as_deref().unwrap_or("a write is stalled")
        ));
    }
    let (code, status) = if failing.is_empty() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "failing")
    };
    (
        code,
        Json(serde_json::json!({
            "status": status,
            "failing": failing,
            "store": store.name,
            "store_error": store.error,
            "store_writer": store,
        })),
    )
}

async fn config(AxState(state): AxState<Arc<State>>) -> Json<views::ConfigView> {
    Json(views::ConfigView::of(state.config_dir().as_ref()))
}

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
}

async fn services(AxState(state): AxState<Arc<State>>) -> Json<Vec<views::ServiceSummary>> {
    let published = state.published();
    Json(
        published
            .services
            .values()
            .map(|s| views::ServiceSummary::of(s))
            .collect(),
    )
}

/// One service of the last publication, or the API's 404.
fn published_service(
    state: &State,
    name: &str,
) -> Result<Arc<ballast_balance::PublishedService>, ApiError> {
    state
        .published()
        .services
        .get(name)
        .cloned()
        .ok_or_else(|| ApiError::unknown_service(name))
}

async fn service(
    AxState(state): AxState<Arc<State>>,
    Path(name): Path<String>,
) -> Result<Json<views::ServiceDetail>, ApiError> {
    let svc = published_service(&state, &name)?;
    Ok(Json(views::ServiceDetail::of(&svc)))
}

async fn endpoints(
    AxState(state): AxState<Arc<State>>,
    Path(name): Path<String>,
) -> Result<Json<Vec<views::EndpointView>>, ApiError> {
    let svc = published_service(&state, &name)?;
    Ok(Json(views::EndpointView::all(&svc)))
}

/// The whole last publication: what every feed serves, with its version.
async fn published(AxState(state): AxState<Arc<State>>) -> Json<ballast_balance::Published> {
    Json(state.published().as_ref().clone())
}

/// `?watch=true` turns the weights request into a stream.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct WatchQuery {
    /// Stream every new weight set as server-sent events.
    #[serde(default)]
    pub watch: bool,
}

async fn weights(
    AxState(state): AxState<Arc<State>>,
    Path(name): Path<String>,
    Query(q): Query<WatchQuery>,
) -> Result<Response, ApiError> {
    if !q.watch {
        let current = views::WeightSet::of(&*published_service(&state, &name)?);
        return Ok(Json(current).into_response());
    }
    let max = state.limits.watch_max_streams;
    if state.metrics.watch_streams.get() >= i64::try_from(max).unwrap_or(i64::MAX) {
        state.metrics.refuse_http("watch_streams");
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("{max} watch streams are open, the limit; try again later"),
        });
    }
    // Subscribed before the first set is read, so no publication falls between them.
    let changes = state.subscribe();
    let current = {
        let published = changes.borrow();
        let svc = published
            .service(&name)
            .ok_or_else(|| ApiError::unknown_service(&name))?;
        views::WeightSet::of(svc)
    };
    Ok(crate::feed::watch::stream(state.clone(), name, changes, current).into_response())
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> impl IntoResponse {
    let text = state.metrics.encode();
    let mut out = text.strip_suffix("# EOF\n").unwrap_or(&text).to_string();
    let published = state.published();
    type Gauge = (
        &'static str,
        &'static str,
        fn(&views::ServiceSummary) -> f64,
    );
    let gauges: [Gauge; 7] = [
        (
            "ballast_service_max_over_avg",
            "Max over average load of fresh serving endpoints",
            |s| s.max_over_avg,
        ),
        (
            "ballast_service_p95_over_avg",
            "95th percentile over average load",
            |s| s.p95_over_avg,
        ),
        (
            "ballast_service_avg_load",
            "Average load of fresh serving endpoints",
            |s| s.avg,
        ),
        (
            "ballast_service_missing_share",
            "Share of endpoints not draining whose reports are stale",
            |s| s.missing_share,
        ),
        ("ballast_service_endpoints", "Known endpoints", |s| {
            s.endpoints as f64
        }),
        (
            "ballast_service_inflight_distrusted",
            "Endpoints whose in-flight count does not follow their weight and is set aside",
            |s| s.inflight_distrusted as f64,
        ),
        (
            "ballast_service_expiry_held",
            "Endpoints silent past expire_ms kept with their last weights, because too \
             much of the service fell silent at once",
            |s| s.expiry_held as f64,
        ),
    ];
    let counters: [Gauge; 2] = [
        (
            "ballast_service_inflight_distrusts",
            "Times an endpoint's in-flight count was set aside for not following its weight",
            |s| s.inflight_distrusts as f64,
        ),
        (
            "ballast_service_feed_forward_steps",
            "Cycles that stepped weights straight to the capacity estimate",
            |s| s.feed_forward_steps as f64,
        ),
    ];
    let summaries: Vec<views::ServiceSummary> = published
        .services
        .values()
        .map(|s| views::ServiceSummary::of(s))
        .collect();
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} gauge");
        for s in &summaries {
            let _ = writeln!(out, "{name}{{service=\"{}\"}} {}", s.name, value(s));
        }
    }
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} counter");
        for s in &summaries {
            let _ = writeln!(out, "{name}_total{{service=\"{}\"}} {}", s.name, value(s));
        }
    }
    out.push_str("# EOF\n");
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
}
