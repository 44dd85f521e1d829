//! Who may use a Ballast daemon's HTTP listener: bearer tokens from a file of argon2
//! hashes, and client certificates by name, each holding a role. The aggregator's API
//! and the relay's `/metrics` check the same credentials, from the same `[http_auth]`
//! table, with this crate.
//!
//! - `viewer` reads everything: the API, the dashboard, the metrics, the watch streams.
//! - `operator` is a viewer that may also act.
//! - `scrape` reads `/metrics` only.
//!
//! `/healthz` is always open. With no credential configured a listener is open to
//! whoever reaches it: the daemons refuse that off loopback unless `insecure_http` is
//! set (`ballast_config::Config::check_http_exposure`).
//!
//! A request without a credential is answered 401 with `WWW-Authenticate: Bearer`, one
//! whose role does not reach the route 403; each refusal is counted by reason
//! ([`AuthCounts`]: `missing`, `bad_token`, `bad_cert`, `revoked`, `expired`,
//! `forbidden`). A
//! token never appears in a log or a metric: the logs name the token's entry.
//!
//! A client certificate is checked at the TLS handshake (`ballast_ingest::http_listener`)
//! and, on each request, again as a handshake would check it then
//! ([`Auth::with_revocation`]): a connection kept alive from before the revocation list
//! or the CA bundle changed gets 401 for a certificate revoked or expired since, and
//! 403 for one whose CA is no longer trusted.

pub mod tokens;

#[cfg(test)]
mod tests;

pub use ballast_config::{CertRoles, HttpAuthConfig, MetricsAccess};
pub use tokens::{hash_entry, token_names, AuthError, TokenStore, MIN_TOKEN_LEN};

use axum::extract::{ConnectInfo, Request, State as AxState};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ballast_ingest::http_listener::Peer;
use ballast_ingest::revocation::{Revocation, Verdict};
use ballast_shared::session::authz::glob_match;
use std::sync::Arc;
use std::time::Duration;

/// What a credential may do.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Reads `/metrics` only.
    Scrape,
    /// Reads everything: the API, the dashboard, the metrics, the watch streams.
    Viewer,
    /// A viewer that may also act.
    Operator,
}

impl Role {
    /// Its name in files and logs.
    pub fn label(self) -> &'static str {
        match self {
            Role::Scrape => "scrape",
            Role::Viewer => "viewer",
            Role::Operator => "operator",
        }
    }

    /// Whether it reads the API, the dashboard and the watch streams.
    pub fn reads_api(self) -> bool {
        matches!(self, Role::Viewer | Role::Operator)
    }

    /// Whether it reads `/metrics` under `access`.
    pub fn reads_metrics(self, access: MetricsAccess) -> bool {
        self == Role::Scrape || (access == MetricsAccess::ScrapeAndViewers && self.reads_api())
    }
}

/// How a request's holder was recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// A bearer token of the token file.
    Token,
    /// A client certificate.
    Certificate,
    /// No credential is configured: the listener is open.
    Open,
}

impl Via {
    /// Its name in the audit trail.
    pub fn label(self) -> &'static str {
        match self {
            Via::Token => "token",
            Via::Certificate => "certificate",
            Via::Open => "open",
        }
    }
}

/// Who made a request, as the handlers see it (a request extension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token entry's name, or the certificate's name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// How it was recognised.
    pub via: Via,
}

/// Why a request was refused, for the metric's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No credential (401).
    Missing,
    /// An `Authorization` header that is not a known bearer token (401).
    BadToken,
    /// A client certificate that holds no role, one refused at the handshake, or one
    /// that no longer verifies on a request of a connection made before the CA bundle
    /// changed (its CA is no longer trusted).
    BadCert,
    /// A client certificate the revocation list in force names (401): refused at the
    /// handshake, or on a request of a connection made before the list named it.
    Revoked,
    /// A client certificate past its validity period on a request of a connection made
    /// while it was valid (401).
    Expired,
    /// A credential whose role does not reach the route (403).
    Forbidden,
}

impl Failure {
    /// Its label.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Missing => "missing",
            Failure::BadToken => "bad_token",
            Failure::BadCert => "bad_cert",
            Failure::Revoked => "revoked",
            Failure::Expired => "expired",
            Failure::Forbidden => "forbidden",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Failure::Missing | Failure::BadToken | Failure::Revoked | Failure::Expired => {
                StatusCode::UNAUTHORIZED
            }
            Failure::BadCert | Failure::Forbidden => StatusCode::FORBIDDEN,
        }
    }

    fn message(self) -> &'static str {
        match self {
            Failure::Missing => "authentication required: a bearer token or a client certificate",
            Failure::BadToken => "the bearer token is not valid",
            Failure::BadCert => {
                "the client certificate holds no role on this listener, or no longer verifies"
            }
            Failure::Revoked => "the client certificate is revoked",
            Failure::Expired => "the client certificate has expired",
            Failure::Forbidden => "the credential's role does not allow this",
        }
    }

    /// The error response for it: the API's JSON error body (`error`, `status`), and
    /// for a 401 the `WWW-Authenticate` challenge.
    pub fn response(self) -> Response {
        #[derive(serde::Serialize)]
        struct ErrorBody {
            error: &'static str,
            status: u16,
        }
        let status = self.status();
        let body = ErrorBody {
            error: self.message(),
            status: status.as_u16(),
        };
        let mut response = (status, axum::Json(body)).into_response();
        let challenge = match self {
            Failure::Missing => Some(r#"Bearer realm="ballast""#),
            Failure::BadToken => Some(r#"Bearer realm="ballast", error="invalid_token""#),
            Failure::Revoked | Failure::Expired => Some(r#"Bearer realm="ballast""#),
            _ => None,
        };
        if let Some(c) = challenge {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(c));
        }
        response
    }
}

/// Where refusals and token file reloads are counted: the daemon's own metrics.
pub trait AuthCounts: Send + Sync + 'static {
    /// A request (or handshake) refused, for `reason` ([`Failure::label`]).
    fn auth_failure(&self, reason: &str);
    /// A change of the token file, by outcome (`applied`, `invalid`).
    fn tokens_reload(&self, outcome: &str);
}

/// The listener's credentials and rules, for every request.
pub struct Auth {
    tokens: Option<Arc<TokenStore>>,
    cert_roles: CertRoles,
    metrics_access: MetricsAccess,
    counts: Arc<dyn AuthCounts>,
    /// Whether any credential is configured (and so required).
    enabled: bool,
    /// How often the token file is checked.
    check_every: Duration,
    /// The verifier (CA bundle and revocation list in force) client certificates are
    /// checked against again on each request; none without TLS.
    revocation: Option<Arc<Revocation>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl Auth {
    /// No credential: the listener is open to whoever reaches it.
    pub fn open(counts: Arc<dyn AuthCounts>) -> Arc<Auth> {
        Arc::new(Auth {
            tokens: None,
            cert_roles: CertRoles::default(),
            metrics_access: MetricsAccess::default(),
            counts,
            enabled: false,
            check_every: Duration::from_secs(1),
            revocation: None,
        })
    }

    /// The credentials `cfg` (`[http_auth]`) configures; the token file is read now.
    pub fn new(cfg: &HttpAuthConfig, counts: Arc<dyn AuthCounts>) -> Result<Auth, AuthError> {
        let tokens = match &cfg.tokens {
            Some(path) => Some(TokenStore::load(path)?),
            None => None,
        };
        Ok(Auth {
            tokens,
            cert_roles: cfg.cert_roles.clone(),
            metrics_access: cfg.metrics,
            counts,
            enabled: cfg.enabled(),
            check_every: Duration::from_millis(cfg.tokens_check_ms),
            revocation: None,
        })
    }

    /// Client certificates checked again, on each request, as the listener's handshakes
    /// would check them then: against the CA bundle and the revocation list in force in
    /// `revocation`'s verifier (the one the handshakes run).
    pub fn with_revocation(mut self, revocation: Arc<Revocation>) -> Auth {
        self.revocation = Some(revocation);
        self
    }

    /// Whether credentials are required.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Who may read `/metrics`.
    pub fn metrics_access(&self) -> MetricsAccess {
        self.metrics_access
    }

    /// Whether bearer tokens are accepted.
    pub fn takes_tokens(&self) -> bool {
        self.tokens.is_some()
    }

    /// Whether client certificates hold roles.
    pub fn takes_certificates(&self) -> bool {
        !self.cert_roles.is_empty()
    }

    /// The watch of the token file, if there is one, to run until shutdown.
    pub fn watch_tokens(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let tokens = self.tokens.clone()?;
        Some(tokens.watch(self.check_every, self.counts.clone()))
    }

    /// The role of a client certificate named `name`: the one that may do most among
    /// those whose patterns match it.
    pub fn cert_role(&self, name: &str) -> Option<Role> {
        let matches = |patterns: &[String]| patterns.iter().any(|p| glob_match(p, name));
        if matches(&self.cert_roles.operator) {
            Some(Role::Operator)
        } else if matches(&self.cert_roles.viewer) {
            Some(Role::Viewer)
        } else if matches(&self.cert_roles.scrape) {
            Some(Role::Scrape)
        } else {
            None
        }
    }

    /// Counts and answers a refusal.
    pub fn refuse(&self, failure: Failure, path: &str) -> Response {
        self.counts.auth_failure(failure.label());
        tracing::debug!(reason = failure.label(), path, "HTTP request refused");
        failure.response()
    }

    /// Who presented `authorization` (the header's value) or, failing that, the client
    /// certificate of `peer`; or why they are refused. A bearer token wins over a
    /// certificate; a certificate that a handshake would refuse now (revoked, expired,
    /// or from a CA no longer trusted) is refused whichever credential comes with it.
    pub async fn identify(
        &self,
        authorization: Option<HeaderValue>,
        peer: Option<&Peer>,
    ) -> Result<Principal, Failure> {
        if let (Some(revocation), Some(chain)) =
            (&self.revocation, peer.and_then(|p| p.chain.as_ref()))
        {
            let certificate = peer.and_then(|p| p.cert.as_deref());
            match revocation.judge(chain) {
                Ok(Verdict::Valid) => {}
                Ok(Verdict::Revoked) => {
                    tracing::info!(
                        ?certificate,
                        "a client certificate revoked since its connection was made"
                    );
                    return Err(Failure::Revoked);
                }
                Ok(Verdict::Expired) => {
                    tracing::info!(
                        ?certificate,
                        "a client certificate expired since its connection was made"
                    );
                    return Err(Failure::Expired);
                }
                Err(e) => {
                    tracing::info!(?certificate, error = %e,
                        "a client certificate that no longer verifies (its CA rotated out?)");
                    return Err(Failure::BadCert);
                }
            }
        }
        if let Some(value) = authorization {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .ok_or(Failure::BadToken)?;
            let store = self.tokens.as_ref().ok_or(Failure::BadToken)?;
            let (name, role) = store.verify(token).await.ok_or(Failure::BadToken)?;
            return Ok(Principal {
                name,
                role,
                via: Via::Token,
            });
        }
        if let Some(name) = peer.and_then(|p| p.cert.clone()) {
            let role = self.cert_role(&name).ok_or_else(|| {
                tracing::info!(certificate = %name, "a client certificate that holds no role");
                Failure::BadCert
            })?;
            return Ok(Principal {
                name: name.to_string(),
                role,
                via: Via::Certificate,
            });
        }
        Err(Failure::Missing)
    }
}

/// The peer of a request served with `ConnectInfo<Peer>`.
pub fn peer_of(req: &Request) -> Option<&Peer> {
    req.extensions()
        .get::<ConnectInfo<Peer>>()
        .map(|ConnectInfo(peer)| peer)
}

/// The middleware of a listener that serves `/metrics` and `/healthz` (the relay's):
/// `/healthz` is open; `/metrics` takes a credential whose role reads the metrics
/// (`scrape`, and under `http_auth.metrics = "scrape_and_viewers"` the viewers and
/// operators); any other path a credential of any role. The [`Principal`] goes on to
/// the handlers.
pub async fn metrics_only(
    AxState(auth): AxState<Arc<Auth>>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    if !auth.enabled || path == "/healthz" {
        return next.run(req).await;
    }
    let authorization = req.headers().get(header::AUTHORIZATION).cloned();
    let principal = match auth.identify(authorization, peer_of(&req)).await {
        Ok(p) => p,
        Err(failure) => return auth.refuse(failure, &path),
    };
    if path == "/metrics" && !principal.role.reads_metrics(auth.metrics_access) {
        return auth.refuse(Failure::Forbidden, &path);
    }
    req.extensions_mut().insert(principal);
    next.run(req).await
}
