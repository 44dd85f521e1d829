//! The live dashboard at `/ui`, served by the aggregator itself: a services overview,
//! and a page per service with its figures, its endpoints and charts of both over time.
//!
//! Everything comes from the binary: the pages are rendered here from the last
//! publication, the charts are SVG drawn server-side with the simulator's chart code,
//! and the stylesheet and the small script are the project's own files, compiled in.
//! Nothing is fetched from anywhere else, so the dashboard works on a host without
//! network access.
//!
//! The script keeps a page live without reloading it: a service page follows the
//! service's watch feed (`/v1/services/{name}/weights?watch=true`) and on each event
//! fetches the fragments under `/ui/services/{name}/…` and swaps them in; the overview
//! fetches its table every two seconds while it is visible.

mod charts;
mod history;
mod html;

use crate::api::act::Acting;
use crate::state::State;
use axum::extract::{Path, State as AxState};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Extension, Router};
use ballast_balance::PublishedService;
use charts::Chart;
use history::History;
use std::sync::Arc;

const STYLE: &str = include_str!("assets/style.css");
const SCRIPT: &str = include_str!("assets/app.js");
const ICON: &str = include_str!("assets/icon.svg");

/// What pages may load: only this server's own script, styles and images.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// The dashboard's routes, to merge into the API's router. Starts recording the
/// per-endpoint history its charts draw when called inside a Tokio runtime.
pub fn router(state: &Arc<State>) -> Router<Arc<State>> {
    let history = Arc::new(History::default());
    history.follow(state);
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui") }))
        .route("/ui/", get(|| async { Redirect::to("/ui") }))
        .route("/ui", get(overview))
        .route("/ui/fragments/services", get(services_fragment))
        .route("/ui/audit", get(audit))
        .route("/ui/fragments/audit", get(audit_fragment))
        .route("/ui/services/{name}", get(service))
        .route("/ui/services/{name}/live", get(service_fragment))
        .route("/ui/services/{name}/charts/{chart}", get(chart))
        .route(
            "/ui/assets/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route(
            "/ui/assets/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/assets/icon.svg",
            get(|| async { asset("image/svg+xml", ICON) }),
        )
        .layer(Extension(history))
}

/// Headers every dashboard response carries.
fn secured(mut response: Response, content_type: &'static str) -> Response {
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// An HTML page or fragment, never cached: it is live.
fn html(status: StatusCode, body: String) -> Response {
    let mut r = secured((status, body).into_response(), "text/html; charset=utf-8");
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = secured(body.into_response(), content_type);
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    r
}

/// The sign-in page, answered (401) to a browser that asks for a dashboard page with no
/// credential.
pub(crate) fn login_page() -> Response {
    html(StatusCode::UNAUTHORIZED, html::login())
}

/// One service of the last publication.
fn published_service(state: &State, name: &str) -> Option<Arc<PublishedService>> {
    state.published().services.get(name).cloned()
}

fn unknown(name: &str) -> Response {
    html(StatusCode::NOT_FOUND, html::unknown_service(name))
}

async fn overview(AxState(state): AxState<Arc<State>>) -> Response {
    let published = state.published();
    let services: Vec<&PublishedService> = published.services.values().map(Arc::as_ref).collect();
    html(StatusCode::OK, html::overview(&services))
}

/// The audit trail kept by the acting routes; empty where nothing acts (a test's bare
/// router).
fn audit_records(acting: Option<Extension<Arc<Acting>>>) -> Vec<crate::audit::AuditRecord> {
    acting
        .map(|Extension(a)| a.audit.newest_first())
        .unwrap_or_default()
}

async fn audit(acting: Option<Extension<Arc<Acting>>>) -> Response {
    html(StatusCode::OK, html::audit(&audit_records(acting)))
}

async fn audit_fragment(acting: Option<Extension<Arc<Acting>>>) -> Response {
    html(StatusCode::OK, html::audit_table(&audit_records(acting)))
}

async fn services_fragment(AxState(state): AxState<Arc<State>>) -> Response {
    let published = state.published();
    let services: Vec<&PublishedService> = published.services.values().map(Arc::as_ref).collect();
    html(StatusCode::OK, html::services_table(&services))
}

async fn service(AxState(state): AxState<Arc<State>>, Path(name): Path<String>) -> Response {
    match published_service(&state, &name) {
        Some(svc) => html(
            StatusCode::OK,
            html::service(&svc, &html::service_live(&svc)),
        ),
        None => unknown(&name),
    }
}

async fn service_fragment(
    AxState(state): AxState<Arc<State>>,
    Path(name): Path<String>,
) -> Response {
    match published_service(&state, &name) {
        Some(svc) => html(StatusCode::OK, html::service_live(&svc)),
        None => unknown(&name),
    }
}

async fn chart(
    AxState(state): AxState<Arc<State>>,
    Extension(history): Extension<Arc<History>>,
    Path((name, file)): Path<(String, String)>,
) -> Response {
    let Some(which) = Chart::of_file(&file) else {
        return html(
            StatusCode::NOT_FOUND,
            html::page(
                "Not found",
                "<a href=\"/ui\">Services</a>",
                "<h1>No such chart</h1>",
                None,
            ),
        );
    };
    let Some(svc) = published_service(&state, &name) else {
        return unknown(&name);
    };
    match which.draw(&svc, &history.of(&name), state.clock.now()) {
        Ok(svg) => {
            let mut r = secured(svg.into_response(), "image/svg+xml");
            r.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            r
        }
        Err(e) => {
            tracing::warn!(service = %name, chart = file, error = %e, "dashboard chart failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the chart could not be drawn",
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests;
