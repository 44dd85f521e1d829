//! Who may use the HTTP API: the credentials of `ballast-http-auth` (bearer tokens
//! from a file of argon2 hashes, client certificates by name, each holding a role,
//! shared with the relay's `/metrics`), and the API's rules for them.
//!
//! - `viewer` reads everything: the API, the dashboard, the metrics, the watch streams.
//! - `operator` is a viewer that may also act: the routes that change something take
//!   the [`Operator`] extractor.
//! - `scrape` reads `/metrics` only.
//!
//! `/healthz`, `/` (a redirect) and the dashboard's static files are always open. A
//! browser that asks for a dashboard page with no credential gets the sign-in form
//! (401), whose script keeps a token in memory and sends it with every request. With no credential configured the API is open to
//! whoever reaches it, as an operator: the daemon refuses that off loopback unless
//! `insecure_http` is set ([`crate::config::Config::check_http_exposure`]).
//!
//! A request without a credential is answered 401 with `WWW-Authenticate: Bearer`, one
//! whose role does not reach the route 403; each refusal is counted by reason in
//! `ballast_http_auth_failures_total` (`missing`, `bad_token`, `bad_cert`, `revoked`,
//! `expired`, `forbidden`). A token never appears in a log or a metric: the logs name
//! the token's entry. A client certificate revoked or expired since its connection was
//! made is refused (401) on that connection's next request, and one whose CA has been
//! taken out of the CA bundle since (403, `bad_cert`).

pub use ballast_http_auth::{
    hash_entry, token_names, Auth, AuthCounts, AuthError, Failure, Principal, Role, TokenStore,
    Via, MIN_TOKEN_LEN,
};

use axum::extract::{FromRequestParts, Request, State as AxState};
use axum::http::header;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The API counts refusals and token file reloads in its families.
impl AuthCounts for crate::metrics::Metrics {
    fn auth_failure(&self, reason: &str) {
        self.fail_http_auth(reason);
    }

    fn tokens_reload(&self, outcome: &str) {
        self.reload_tokens(outcome);
    }
}

/// Where `token new` wrote a token, and the entry it added.
#[derive(Debug)]
pub struct NewToken {
    /// The file holding the token itself (mode 0600).
    pub token_file: PathBuf,
    /// The token file of hashes the entry was added to.
    pub tokens: PathBuf,
}

/// Makes a token of 32 random bytes (64 hexadecimal characters), writes it to `out`
/// (a new file, mode 0600: an existing one is never overwritten), and adds its entry to
/// the token file `tokens` (created, mode 0600, if missing). A running aggregator takes
/// the entry at its next look at the file. Refuses a name the file already has, and
/// leaves both files as they were on any error.
pub fn new_token(tokens: &Path, name: &str, role: Role, out: &Path) -> Result<NewToken, AuthError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |path: &Path, e: std::io::Error| AuthError::Token(format!("{}: {e}", path.display()));
    let existing = match std::fs::read_to_string(tokens) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(tokens, e)),
    };
    let names = token_names(&existing, tokens)?;
    if names.iter().any(|n| n == name) {
        return Err(AuthError::Token(format!(
            "{} already has a token named {name:?}: remove its entry first, or pick another name",
            tokens.display()
        )));
    }
    let bytes: [u8; 32] = rand::random();
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let entry = hash_entry(name, role, &token)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| io(out, e))?;
    if let Err(e) = file.write_all(format!("{token}\n").as_bytes()) {
        let _ = std::fs::remove_file(out);
        return Err(io(out, e));
    }
    let mut text = existing;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    if !text.is_empty() {
        text.push('\n');
    }
    text.push_str(&entry);
    // Whole or not at all: a new file beside the old one, renamed over it.
    if let Err(e) = crate::config::dir::write_atomic_mode(tokens, text.as_bytes(), 0o600) {
        let _ = std::fs::remove_file(out);
        return Err(AuthError::Token(e.to_string()));
    }
    Ok(NewToken {
        token_file: out.to_path_buf(),
        tokens: tokens.to_path_buf(),
    })
}

/// The middleware that admits each request by its credential and the route's rule
/// (see the module), and hands the [`Principal`] on to the handlers.
pub(crate) async fn authenticate(
    AxState(auth): AxState<Arc<Auth>>,
    mut req: Request,
    next: Next,
) -> Response {
    req.extensions_mut().insert(auth.clone());
    if !auth.enabled() {
        req.extensions_mut().insert(Principal {
            name: "anonymous".into(),
            role: Role::Operator,
            via: Via::Open,
        });
        return next.run(req).await;
    }
    let path = req.uri().path().to_string();
    // The health check, the dashboard's redirect and its static files hold no data.
    if path == "/healthz" || path == "/" || path.starts_with("/ui/assets/") {
        return next.run(req).await;
    }
    let wants_html = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"));
    let authorization = req.headers().get(header::AUTHORIZATION).cloned();
    let peer = ballast_http_auth::peer_of(&req);
    let principal = match auth.identify(authorization, peer).await {
        Ok(p) => p,
        Err(Failure::Missing) if wants_html && (path == "/ui" || path.starts_with("/ui/")) => {
            // A browser: the sign-in form, whose script sends the token from then on.
            let mut response = auth.refuse(Failure::Missing, &path);
            let challenge = response.headers_mut().remove(header::WWW_AUTHENTICATE);
            response = crate::ui::login_page();
            if let Some(c) = challenge {
                response.headers_mut().insert(header::WWW_AUTHENTICATE, c);
            }
            return response;
        }
        Err(failure) => return auth.refuse(failure, &path),
    };
    let allowed = if path == "/metrics" {
        principal.role.reads_metrics(auth.metrics_access())
    } else {
        principal.role.reads_api()
    };
    if !allowed {
        return auth.refuse(Failure::Forbidden, &path);
    }
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// The guard of a route that acts: the request's holder must be an operator. A viewer
/// is answered 403, a request nobody authenticated 401.
#[derive(Debug, Clone)]
pub struct Operator(pub Principal);

impl<S: Send + Sync> FromRequestParts<S> for Operator {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let path = parts.uri.path().to_string();
        let refuse = |failure: Failure| match parts.extensions.get::<Arc<Auth>>() {
            Some(auth) => auth.refuse(failure, &path),
            None => failure.response(),
        };
        match parts.extensions.get::<Principal>() {
            Some(p) if p.role == Role::Operator => Ok(Operator(p.clone())),
            Some(_) => Err(refuse(Failure::Forbidden)),
            None => Err(refuse(Failure::Missing)),
        }
    }
}

#[cfg(test)]
mod tests;
