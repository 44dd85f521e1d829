//! The HTTP API: JSON views of services and endpoints, health, and Prometheus metrics.

pub mod act;
pub mod auth;
/// The listener the API is served on (`ballast-ingest`'s, shared with the relay).
pub use ballast_ingest::http_listener as listener;

/// The listener counts its refusals in the API's families.
impl listener::HttpCounts for crate::metrics::Metrics {
    fn refuse(&self, reason: &str) {
        self.refuse_http(reason);
    }

    fn refuse_cert(&self, reason: &str) {
        self.fail_http_auth(reason);
    }
}
pub(crate) mod openapi;
pub mod views;

use crate::state::State;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State as AxState};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;

/// The router over shared state, open to whoever reaches it.
pub fn router(state: Arc<State>) -> Router {
    let auth = auth::Auth::open(state.metrics.clone());
    router_with(state, auth)
}

/// The router over shared state, each request admitted by `auth`.
pub fn router_with(state: Arc<State>, auth: Arc<auth::Auth>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/openapi.json", get(openapi_v1))
        .route("/v1/services", get(services))
        .route("/v1/services/{name}", get(service))
        .route("/v1/services/{name}/endpoints", get(endpoints))
        .route("/v1/services/{name}/weights", get(weights))
        .route("/v1/config", get(config))
        .route("/v1/published", get(published))
        .route(
            "/v1/services/{name}/endpoints/{node}/drain",
            post(act::drain).delete(act::undrain),
        )
        .route(
            "/v1/services/{name}/endpoints/{node}/pin",
            post(act::pin).delete(act::unpin),
        )
        .route(
            "/v1/services/{name}/hold",
            post(act::hold).delete(act::release),
        )
        .route("/v1/audit", get(act::audit))
        .merge(crate::ui::router(&state))
        .fallback(not_found)
        .layer(axum::Extension(Arc::new(
            crate::feed::watch::WatchFeed::new(state.subscribe(), state.metrics.watch.clone()),
        )))
        .layer(axum::middleware::from_fn_with_state(
            auth,
            auth::authenticate,
        ))
        .with_state(state)
}

/// A JSON error body with its status.
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    fn unknown_service(name: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("unknown service {name:?}"),
        }
    }

    /// A request the API cannot read: a query or path that does not parse. axum's own
    /// answer would be plain text; every error of the API has the same JSON shape.
    fn bad_request(rejection: impl std::fmt::Display) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: rejection.to_string(),
        }
    }
}

/// The service name of a `{name}` path, or the API's 400.
fn service_name(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    path.map(|Path(name)| name).map_err(ApiError::bad_request)
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
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "health",
    tag = "operations",
    summary = "Whether the aggregator balances, and the routing store's health",
    description = "200 and `ok` while the cycle loop runs and the routing store keeps up; \
        503 and `failing`, with the reasons, when the cycle loop has not run for three \
        cycle lengths or the store has been failing for more than 300 s. A shorter store \
        failure shows under `store_writer` (`error`, or `stalled` when a write has been in \
        flight for more than 10 s) and leaves the status ok.",
    responses(
        (status = 200, description = "Balancing", body = views::Health),
        (status = 503, description = "Failing: the cycle loop is late or the store has failed for too long", body = views::Health),
    )
)]
async fn healthz(AxState(state): AxState<Arc<State>>) -> (StatusCode, Json<views::Health>) {
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
        (StatusCode::OK, views::HealthStatus::Ok)
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            views::HealthStatus::Failing,
        )
    };
    (
        code,
        Json(views::Health {
            status,
            failing,
            store: store.name.clone(),
            store_error: store.error.clone(),
            store_writer: store,
            cluster: state.ownership.as_ref().map(|o| {
                let behind = o.feed_behind();
                views::ClusterHealth {
                    replica: o.replica().to_string(),
                    buckets_owned: o.owned(),
                    behind_etcd_ms: u64::try_from(behind.as_millis()).unwrap_or(u64::MAX),
                    following: o.following(),
                }
            }),
        }),
    )
}

#[utoipa::path(
    get,
    path = "/v1/config",
    operation_id = "get_config",
    tag = "config",
    summary = "The per-service config directory as merged",
    description = "Services in force, tombstones of deleted files until they expire, and \
        the files refused now. Without a config directory every field is null or empty.",
    responses((status = 200, description = "The config directory's status", body = views::ConfigView))
)]
async fn config(AxState(state): AxState<Arc<State>>) -> Json<views::ConfigView> {
    Json(views::ConfigView::of(state.config_dir().as_ref()))
}

#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    operation_id = "get_openapi",
    tag = "document",
    summary = "This document: the API in OpenAPI 3.1",
    responses((status = 200, description = "The OpenAPI document", body = Object))
)]
async fn openapi_v1(axum::Extension(auth): axum::Extension<Arc<auth::Auth>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        openapi::document_for(&auth),
    )
}

/// The document at its first address, for the clients that know that one.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "get_openapi_unversioned",
    tag = "document",
    summary = "This document again, at its first address",
    description = "The same document as `/v1/openapi.json`, kept for existing clients.",
    responses((status = 200, description = "The OpenAPI document", body = Object))
)]
async fn openapi(auth: axum::Extension<Arc<auth::Auth>>) -> impl IntoResponse {
    openapi_v1(auth).await
}

#[utoipa::path(
    get,
    path = "/v1/services",
    operation_id = "list_services",
    tag = "services",
    summary = "Every service with its balance figures",
    responses((status = 200, description = "One line per service", body = Vec<views::ServiceSummary>))
)]
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

#[utoipa::path(
    get,
    path = "/v1/services/{name}",
    operation_id = "get_service",
    tag = "services",
    summary = "Cycle statistics of one service",
    description = "Endpoints by state, counters, the last cycle's spread (avg, max/avg, \
        p95/avg), the missing share, skipped cycles and why, the parameters in force and \
        the recent history.",
    params(("name" = String, Path, description = "The service")),
    responses(
        (status = 200, description = "The service", body = views::ServiceDetail),
        (status = 400, description = "A name that is not UTF-8 once percent-decoded", body = views::ErrorBody),
        (status = 404, description = "No such service", body = views::ErrorBody),
    )
)]
async fn service(
    AxState(state): AxState<Arc<State>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<views::ServiceDetail>, ApiError> {
    let name = service_name(name)?;
    let svc = published_service(&state, &name)?;
    Ok(Json(views::ServiceDetail::of(&svc)))
}

#[utoipa::path(
    get,
    path = "/v1/services/{name}/endpoints",
    operation_id = "list_endpoints",
    tag = "services",
    summary = "Endpoints of one service with load, weight, state and report age",
    params(("name" = String, Path, description = "The service")),
    responses(
        (status = 200, description = "Every endpoint of the service", body = Vec<views::EndpointView>),
        (status = 400, description = "A name that is not UTF-8 once percent-decoded", body = views::ErrorBody),
        (status = 404, description = "No such service", body = views::ErrorBody),
    )
)]
async fn endpoints(
    AxState(state): AxState<Arc<State>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<Vec<views::EndpointView>>, ApiError> {
    let name = service_name(name)?;
    let svc = published_service(&state, &name)?;
    Ok(Json(views::EndpointView::all(&svc)))
}

/// The whole last publication: what every feed serves, with its version.
#[utoipa::path(
    get,
    path = "/v1/published",
    operation_id = "get_published",
    tag = "services",
    summary = "The whole last publication: what every feed serves, with its version",
    responses((status = 200, description = "The last publication", body = ballast_balance::Published))
)]
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

#[utoipa::path(
    get,
    path = "/v1/services/{name}/weights",
    operation_id = "get_weights",
    tag = "services",
    summary = "The published weight set of one service, or a stream of them",
    description = "The weights with their version and each sink's integer. With \
        `watch=true`, a server-sent event stream instead: the current set at once, then \
        one `weights` event per material change, whose id is the weight version. The \
        stream ends when the service expires; its number is limited (503 past it).",
    params(
        ("name" = String, Path, description = "The service"),
        ("watch" = Option<bool>, Query, description = "Stream every new weight set as server-sent events"),
    ),
    responses(
        (status = 200, description = "The weight set, or with `watch=true` a stream of them", content(
            (views::WeightSet = "application/json"),
            (openapi::WeightEvent = "text/event-stream"),
        )),
        (status = 400, description = "A `watch` that is not `true` or `false`, or a name that is not UTF-8 once percent-decoded", body = views::ErrorBody),
        (status = 404, description = "No such service", body = views::ErrorBody),
        (status = 503, description = "As many watch streams are open as the limit allows", body = views::ErrorBody),
    )
)]
async fn weights(
    AxState(state): AxState<Arc<State>>,
    axum::Extension(feed): axum::Extension<Arc<crate::feed::watch::WatchFeed>>,
    name: Result<Path<String>, PathRejection>,
    query: Result<Query<WatchQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let name = service_name(name)?;
    let Query(q) = query.map_err(ApiError::bad_request)?;
    if !q.watch {
        let current = views::WeightSet::of(&*published_service(&state, &name)?);
        return Ok(Json(current).into_response());
    }
    let max = state.limits.watch_max_streams;
    if state.metrics.watch.streams.get() >= i64::try_from(max).unwrap_or(i64::MAX) {
        state.metrics.refuse_http("watch_streams");
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("{max} watch streams are open, the limit; try again later"),
        });
    }
    match crate::feed::watch::stream(&feed, name.clone()) {
        Some(events) => Ok(events.into_response()),
        None => Err(ApiError::unknown_service(&name)),
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "operations",
    summary = "Prometheus metrics, in the OpenMetrics text format",
    responses((status = 200, description = "Every metric family", body = String, content_type = "application/openmetrics-text"))
)]
async fn metrics(AxState(state): AxState<Arc<State>>) -> impl IntoResponse {
    if let Some(o) = &state.ownership {
        state
            .metrics
            .cluster_feed_behind_seconds
            .set(o.feed_behind().as_secs_f64());
    }
    let summaries: Vec<crate::metrics::ServiceRow> = state
        .published()
        .services
        .values()
        .map(|s| views::ServiceSummary::of(s).into())
        .collect();
    let out = state.metrics.encode_with_services(summaries);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
}
