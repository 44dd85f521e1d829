use super::*;
use axum::body::Body;
use axum::routing::get;
use axum::Router;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const VIEWER_TOKEN: &str = "viewer-token-0123456789";
const OPERATOR_TOKEN: &str = "operator-token-0123456789";
const SCRAPE_TOKEN: &str = "scrape-token-0123456789";

/// Refusals and reloads as counted.
#[derive(Default)]
struct Counted(Mutex<Vec<String>>);

impl AuthCounts for Counted {
    fn auth_failure(&self, reason: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("failure {reason}"));
    }
    fn tokens_reload(&self, outcome: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("reload {outcome}"));
    }
}

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

#[tokio::test]
async fn a_removed_token_is_refused_though_it_was_cached() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = token_file(dir.path());
    let store = TokenStore::load(&path).expect("load");
    let counts = Counted::default();
    assert_eq!(
        store.verify(VIEWER_TOKEN).await.map(|(_, r)| r),
        Some(Role::Viewer)
    );
    // Cached now: the second check costs a hash.
    let t = std::time::Instant::now();
    assert!(store.verify(VIEWER_TOKEN).await.is_some());
    assert!(t.elapsed() < Duration::from_millis(5), "{:?}", t.elapsed());
    let text = std::fs::read_to_string(&path).expect("read");
    let kept: String = text
        .split("[[token]]")
        .filter(|e| !e.contains("grafana") && !e.trim().is_empty())
        .map(|e| format!("[[token]]{e}"))
        .collect();
    store.take(&Ok(kept.into_bytes()), &counts);
    assert_eq!(store.len(), 2);
    assert_eq!(store.verify(VIEWER_TOKEN).await, None);
    assert!(store.verify(OPERATOR_TOKEN).await.is_some());
    // A file that does not parse leaves the entries in force.
    store.take(&Ok(b"[[token]]\nname = 1\n".to_vec()), &counts);
    assert!(store.verify(OPERATOR_TOKEN).await.is_some());
    // A file removed leaves none.
    store.take(&Err(std::io::ErrorKind::NotFound), &counts);
    assert_eq!(store.verify(OPERATOR_TOKEN).await, None);
    assert_eq!(
        *counts.0.lock().expect("counts"),
        ["reload applied", "reload invalid", "reload applied"]
    );
}

#[test]
fn token_files_hold_argon2_hashes_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.toml");
    for (text, why) in [
        ("[[token]]\nname = \"a\"\nrole = \"viewer\"\nhash = \"secret\"\n", "plain text"),
        (
            "[[token]]\nname = \"a\"\nrole = \"viewer\"\nhash = \"$2b$10$abcdefghijklmnopqrstuu\"\n",
            "not argon2",
        ),
        ("[[token]]\nname = \"a\"\nrole = \"boss\"\nhash = \"x\"\n", "unknown role"),
    ] {
        std::fs::write(&path, text).expect("write");
        assert!(TokenStore::load(&path).is_err(), "{why}");
    }
    assert!(hash_entry("a", Role::Viewer, "short").is_err());
}

#[test]
fn certificate_names_map_to_the_role_that_may_do_most() {
    let cfg = HttpAuthConfig {
        cert_roles: CertRoles {
            viewer: vec!["ops-*".into()],
            operator: vec!["ops-lead".into()],
            scrape: vec!["prom?".into()],
        },
        ..HttpAuthConfig::default()
    };
    let auth = Auth::new(&cfg, Arc::new(Counted::default())).expect("auth");
    assert_eq!(auth.cert_role("ops-alice"), Some(Role::Viewer));
    assert_eq!(auth.cert_role("ops-lead"), Some(Role::Operator));
    assert_eq!(auth.cert_role("prom1"), Some(Role::Scrape));
    assert_eq!(auth.cert_role("node-1"), None);
}

async fn call(app: &Router, path: &str, token: Option<&str>) -> u16 {
    use tower::ServiceExt as _;
    let mut req = axum::http::Request::builder().uri(path);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let response = app
        .clone()
        .oneshot(req.body(Body::empty()).expect("request"))
        .await
        .expect("response");
    response.status().as_u16()
}

#[tokio::test]
async fn the_metrics_only_listener_opens_healthz_and_gives_metrics_to_the_roles_that_read_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let counts = Arc::new(Counted::default());
    let app = |metrics: MetricsAccess| {
        let cfg = HttpAuthConfig {
            tokens: Some(token_file(dir.path())),
            metrics,
            ..HttpAuthConfig::default()
        };
        let auth = Arc::new(Auth::new(&cfg, counts.clone()).expect("auth"));
        Router::new()
            .route("/metrics", get(|| async { "metrics" }))
            .route("/healthz", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(auth, metrics_only))
    };
    let both = app(MetricsAccess::ScrapeAndViewers);
    assert_eq!(call(&both, "/healthz", None).await, 200);
    assert_eq!(call(&both, "/metrics", None).await, 401);
    assert_eq!(
        call(&both, "/metrics", Some("nope-nope-nope-nope")).await,
        401
    );
    assert_eq!(call(&both, "/metrics", Some(SCRAPE_TOKEN)).await, 200);
    assert_eq!(call(&both, "/metrics", Some(VIEWER_TOKEN)).await, 200);
    let scrape_only = app(MetricsAccess::ScrapeOnly);
    assert_eq!(
        call(&scrape_only, "/metrics", Some(VIEWER_TOKEN)).await,
        403
    );
    assert_eq!(
        call(&scrape_only, "/metrics", Some(SCRAPE_TOKEN)).await,
        200
    );
    let failures: Vec<String> = counts
        .0
        .lock()
        .expect("counts")
        .iter()
        .filter(|c| c.starts_with("failure"))
        .cloned()
        .collect();
    assert_eq!(
        failures,
        ["failure missing", "failure bad_token", "failure forbidden"]
    );

    let open = Router::new()
        .route("/metrics", get(|| async { "metrics" }))
        .layer(axum::middleware::from_fn_with_state(
            Auth::open(counts.clone()),
            metrics_only,
        ));
    assert_eq!(call(&open, "/metrics", None).await, 200);
}

#[test]
fn a_certificate_that_expired_or_no_longer_verifies_is_refused_with_its_own_reason() {
    // Expired since its connection was made: 401, with the challenge, as revoked is.
    let expired = Failure::Expired.response();
    assert_eq!(Failure::Expired.label(), "expired");
    assert_eq!(expired.status(), StatusCode::UNAUTHORIZED);
    assert!(expired.headers().contains_key(header::WWW_AUTHENTICATE));
    // From a CA no longer trusted: 403, as any certificate the listener refuses.
    let unverified = Failure::BadCert.response();
    assert_eq!(Failure::BadCert.label(), "bad_cert");
    assert_eq!(unverified.status(), StatusCode::FORBIDDEN);
}
