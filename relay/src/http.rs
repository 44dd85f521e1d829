//! The relay's HTTP endpoints: `/metrics` and `/healthz`. `/healthz` is open;
//! `/metrics` takes, when `[http_auth]` configures any credential, a bearer token or
//! client certificate whose role reads the metrics (`scrape`, or a viewer's under
//! `http_auth.metrics = "scrape_and_viewers"`): `ballast-http-auth`'s rules, the
//! aggregator's own.

use super::metrics::RelayMetrics;
use super::routes::{Freshness, Routes};
use super::trunks::Trunks;
use axum::extract::State as AxState;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

/// What the endpoints read.
pub(crate) struct Status {
    /// The relay's name.
    pub(crate) name: String,
    /// The relay's metrics.
    pub(crate) metrics: Arc<RelayMetrics>,
    /// The routes as last read.
    pub(crate) routes: watch::Receiver<Arc<Routes>>,
    /// When a replica last confirmed them.
    pub(crate) freshness: Arc<Freshness>,
    /// The trunks.
    pub(crate) trunks: Arc<Trunks>,
}

/// The relay's `/healthz`: always `ok` while it runs (it serves from the last routes
/// while no replica confirms them), with what it knows.
#[derive(Debug, Serialize)]
pub(crate) struct Health {
    status: &'static str,
    role: &'static str,
    name: String,
    routes: RoutesHealth,
    trunks: BTreeMap<String, &'static str>,
}

/// The routes in `/healthz`.
#[derive(Debug, Serialize)]
struct RoutesHealth {
    /// The cluster's bucket count, 0 before it is read.
    buckets: u32,
    /// Live replicas.
    members: usize,
    /// Buckets with a live owner.
    owned_buckets: usize,
    /// Milliseconds since a replica last confirmed the routes; null before the first
    /// table.
    behind_ms: Option<u64>,
}

impl Status {
    /// What `/healthz` says now.
    pub(crate) fn health(&self) -> Health {
        let routes = self.routes.borrow().clone();
        Health {
            status: "ok",
            role: "relay",
            name: self.name.clone(),
            routes: RoutesHealth {
                buckets: routes.buckets.unwrap_or(0),
                members: routes.members.len(),
                owned_buckets: routes.owned_buckets(),
                behind_ms: self.freshness.behind_ms(),
            },
            trunks: self
                .trunks
                .states()
                .into_iter()
                .map(|(name, open)| (name, if open { "open" } else { "connecting" }))
                .collect(),
        }
    }
}

/// The relay's router, each request admitted by `auth`.
pub(crate) fn router(status: Arc<Status>, auth: Arc<ballast_http_auth::Auth>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn_with_state(
            auth,
            ballast_http_auth::metrics_only,
        ))
        .with_state(status)
}

async fn healthz(AxState(status): AxState<Arc<Status>>) -> Json<Health> {
    Json(status.health())
}

async fn metrics(AxState(status): AxState<Arc<Status>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        status.metrics.encode(),
    )
}
