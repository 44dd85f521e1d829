use super::*;
use crate::config::{Config, MetricsAccess};
use crate::metrics::Metrics;
use axum::body::Body;
use axum::http::header;
use axum::routing::{get, post};
use axum::Router;

const VIEWER_TOKEN: &str = "viewer-token-0123456789";
const OPERATOR_TOKEN: &str = "operator-token-0123456789";
const SCRAPE_TOKEN: &str = "scrape-token-0123456789";

fn token_file(dir: &Path) -> PathBuf {
    let mut text = String::new();
    for (name, role, token) in [
        ("grafana", Role::Viewer, VIEWER_TOKEN),
        ("oncall", Role::Operator, OPERATOR_TOKEN),
        ("prometheus", Role::Scrape, SCRAPE_TOKEN),
    ] {
        text.push_str(&hash_entry(name, role, token).expect("hash"));
    }
    let path = dir.join("tokens.toml");
    std::fs::write(&path, text).expect("write tokens");
    path
}

fn auth(dir: &Path, metrics: MetricsAccess) -> Arc<Auth> {
    let mut cfg = Config::default();
    cfg.http_auth.tokens = Some(token_file(dir));
    cfg.http_auth.metrics = metrics;
    Arc::new(Auth::new(&cfg.http_auth, Arc::new(Metrics::new())).expect("auth"))
}

/// A route that acts, guarded by [`Operator`], beside a reading one and the metrics.
fn app(auth: Arc<Auth>) -> Router {
    Router::new()
        .route("/v1/services", get(|| async { "read" }))
        .route("/metrics", get(|| async { "metrics" }))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/v1/act",
            post(|Operator(p): Operator| async move { format!("acted as {}", p.name) }),
        )
        .layer(axum::middleware::from_fn_with_state(auth, authenticate))
}

async fn call(app: &Router, method: &str, path: &str, token: Option<&str>) -> (u16, String) {
    use tower::ServiceExt as _;
    let mut req = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let response = app
        .clone()
        .oneshot(req.body(Body::empty()).expect("request"))
        .await
        .expect("response");
    let status = response.status().as_u16();
    let challenge = response.headers().get(header::WWW_AUTHENTICATE).cloned();
    if status == 401 {
        assert!(
            challenge.is_some_and(|c| c.to_str().is_ok_and(|c| c.starts_with("Bearer"))),
            "a 401 says how to authenticate"
        );
    }
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn roles_reach_their_routes_and_only_those() {
    let dir = tempfile::tempdir().expect("tempdir");
    let app = app(auth(dir.path(), MetricsAccess::ScrapeAndViewers));
    assert_eq!(call(&app, "GET", "/healthz", None).await.0, 200);
    assert_eq!(call(&app, "GET", "/v1/services", None).await.0, 401);
    assert_eq!(
        call(&app, "GET", "/v1/services", Some("nope-nope-nope-nope"))
            .await
            .0,
        401
    );
    assert_eq!(
        call(&app, "GET", "/v1/services", Some(VIEWER_TOKEN))
            .await
            .0,
        200
    );
    assert_eq!(
        call(&app, "GET", "/metrics", Some(VIEWER_TOKEN)).await.0,
        200
    );
    assert_eq!(
        call(&app, "GET", "/v1/services", Some(SCRAPE_TOKEN))
            .await
            .0,
        403
    );
    assert_eq!(
        call(&app, "GET", "/metrics", Some(SCRAPE_TOKEN)).await.0,
        200
    );
    // The guard of a route that acts.
    assert_eq!(
        call(&app, "POST", "/v1/act", Some(VIEWER_TOKEN)).await.0,
        403
    );
    assert_eq!(call(&app, "POST", "/v1/act", None).await.0, 401);
    let (status, body) = call(&app, "POST", "/v1/act", Some(OPERATOR_TOKEN)).await;
    assert_eq!((status, body.as_str()), (200, "acted as oncall"));

    let app = self::app(auth(dir.path(), MetricsAccess::ScrapeOnly));
    assert_eq!(
        call(&app, "GET", "/metrics", Some(VIEWER_TOKEN)).await.0,
        403
    );
    assert_eq!(
        call(&app, "GET", "/metrics", Some(SCRAPE_TOKEN)).await.0,
        200
    );
}

#[tokio::test]
async fn a_new_token_is_written_alone_and_its_hash_added_to_the_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_file(dir.path());
    let before = std::fs::read_to_string(&tokens).expect("read");
    let out = dir.path().join("ops.token");
    new_token(&tokens, "ops", Role::Operator, &out).expect("new token");

    let token = std::fs::read_to_string(&out).expect("token");
    let token = token.trim_end();
    assert_eq!(token.len(), 64, "{token}");
    let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&out), 0o600);
    assert_eq!(mode(&tokens), 0o600);
    let after = std::fs::read_to_string(&tokens).expect("read");
    assert!(after.starts_with(&before), "the entries before are kept");
    assert!(
        !after.contains(token),
        "the token itself is not in the hashes' file"
    );
    // The running aggregator's view of the file: the new token acts as operator, and
    // the old ones still hold their roles.
    let mut cfg = Config::default();
    cfg.http_auth.tokens = Some(tokens.clone());
    let app = app(Arc::new(
        Auth::new(&cfg.http_auth, Arc::new(Metrics::new())).expect("auth"),
    ));
    let (status, body) = call(&app, "POST", "/v1/act", Some(token)).await;
    assert_eq!((status, body.as_str()), (200, "acted as ops"));
    assert_eq!(
        call(&app, "GET", "/v1/services", Some(VIEWER_TOKEN))
            .await
            .0,
        200
    );

    // A second token of that name, or over an existing token file, is refused and
    // leaves both files as they were.
    let again = dir.path().join("again.token");
    let e = new_token(&tokens, "ops", Role::Viewer, &again).expect_err("same name");
    assert!(e.to_string().contains("already has a token named"), "{e}");
    assert!(!again.exists());
    let e = new_token(&tokens, "other", Role::Viewer, &out).expect_err("existing out");
    assert!(e.to_string().contains("ops.token"), "{e}");
    assert_eq!(std::fs::read_to_string(&tokens).expect("read"), after);
    assert_eq!(
        std::fs::read_to_string(&out).expect("read").trim_end(),
        token
    );

    // A token file made from nothing.
    let fresh = dir.path().join("fresh.toml");
    new_token(&fresh, "ci", Role::Viewer, &dir.path().join("ci.token")).expect("fresh");
    assert_eq!(
        token_names(&std::fs::read_to_string(&fresh).expect("read"), &fresh)
            .expect("parse")
            .len(),
        1
    );
}
