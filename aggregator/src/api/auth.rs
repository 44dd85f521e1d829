//! Who may use the HTTP API: bearer tokens from a file of argon2 hashes, and client
//! certificates by name, each holding a role.
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
//! `ballast_http_auth_failures_total` (`missing`, `bad_token`, `bad_cert`, `forbidden`).
//! A token never appears in a log or a metric: the logs name the token's entry.
//!
//! Verifying an argon2 hash costs tens of milliseconds on purpose. A token once
//! verified is cached under its SHA-256, so that the next requests cost a hash; the
//! cache is emptied whenever the token file changes, so that a token removed from the
//! file is refused from its next request on. Verifications run off the async threads,
//! two at a time, so that a flood of bad tokens cannot stall the rest of the API.

use crate::api::listener::Peer;
use crate::config::{CertRoles, Config, MetricsAccess};
use crate::metrics::Metrics;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use axum::extract::{ConnectInfo, FromRequestParts, Request, State as AxState};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ballast_shared::session::authz::glob_match;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::Semaphore;

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
    /// No credential is configured: the API is open.
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

/// Who made a request, as the API's handlers see it (a request extension).
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
    /// A client certificate that holds no role, or one refused at the handshake.
    BadCert,
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
            Failure::Forbidden => "forbidden",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Failure::Missing | Failure::BadToken => StatusCode::UNAUTHORIZED,
            Failure::BadCert | Failure::Forbidden => StatusCode::FORBIDDEN,
        }
    }

    fn message(self) -> &'static str {
        match self {
            Failure::Missing => "authentication required: a bearer token or a client certificate",
            Failure::BadToken => "the bearer token is not valid",
            Failure::BadCert => "the client certificate holds no role on this API",
            Failure::Forbidden => "the credential's role does not allow this",
        }
    }

    /// The API's error response for it.
    fn response(self) -> Response {
        let mut response = super::ApiError {
            status: self.status(),
            message: self.message().to_string(),
        }
        .into_response();
        let challenge = match self {
            Failure::Missing => Some(r#"Bearer realm="ballast""#),
            Failure::BadToken => Some(r#"Bearer realm="ballast", error="invalid_token""#),
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

/// What can be wrong with the token file or a token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The file cannot be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not parse, or an entry is unusable.
    #[error("token file {path}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A token too weak to hash, or hashing failed.
    #[error("{0}")]
    Token(String),
}

/// The token file as written.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

/// One `[[token]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    /// The argon2 hash, as a PHC string (`$argon2id$v=19$m=...`).
    hash: String,
}

/// The shortest token `token hash` takes.
pub const MIN_TOKEN_LEN: usize = 16;

/// The entries of a token file's text; `path` names it in errors.
fn parse_tokens(text: &str, path: &Path) -> Result<Vec<TokenEntry>, AuthError> {
    let invalid = |reason: String| AuthError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let file: TokenFile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
    let mut names = std::collections::HashSet::new();
    for entry in &file.token {
        if entry.name.is_empty() || !ballast_shared::wire::is_valid_name(&entry.name) {
            return Err(invalid(format!("{:?} is not a valid name", entry.name)));
        }
        if !names.insert(entry.name.as_str()) {
            return Err(invalid(format!("{:?} has two entries", entry.name)));
        }
        let hash = PasswordHash::new(&entry.hash)
            .map_err(|e| invalid(format!("{}: the hash is not a PHC string: {e}", entry.name)))?;
        if !hash.algorithm.as_str().starts_with("argon2") {
            return Err(invalid(format!(
                "{}: the hash is {}, not argon2 (make one with `ballast-aggregator token hash`)",
                entry.name, hash.algorithm
            )));
        }
    }
    Ok(file.token)
}

/// A `[[token]]` entry of the token file for `token`, hashed with argon2id and a
/// random salt: what `ballast-aggregator token hash` prints.
pub fn hash_entry(name: &str, role: Role, token: &str) -> Result<String, AuthError> {
    if name.is_empty() || !ballast_shared::wire::is_valid_name(name) {
        return Err(AuthError::Token(format!("{name:?} is not a valid name")));
    }
    if token.chars().count() < MIN_TOKEN_LEN || token.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(AuthError::Token(format!(
            "a token must be at least {MIN_TOKEN_LEN} printable ASCII characters without \
             blanks (e.g. `openssl rand -hex 32`)"
        )));
    }
    let salt: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt).map_err(|e| AuthError::Token(e.to_string()))?;
    let hash = argon2::Argon2::default()
        .hash_password(token.as_bytes(), &salt)
        .map_err(|e| AuthError::Token(e.to_string()))?;
    Ok(format!(
        "[[token]]\nname = {name:?}\nrole = \"{}\"\nhash = \"{hash}\"\n",
        role.label()
    ))
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
    let entries = parse_tokens(&existing, tokens)?;
    if entries.iter().any(|e| e.name == name) {
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

/// The token file's entries in force, and the tokens verified against them.
#[derive(Default)]
struct Tokens {
    entries: Arc<Vec<TokenEntry>>,
    /// SHA-256 of a verified token, to the index of its entry.
    cache: HashMap<[u8; 32], usize>,
    /// Counts changes of `entries`: a verification begun before one is not cached.
    generation: u64,
}

/// The token file, as read last.
pub struct TokenStore {
    path: PathBuf,
    tokens: RwLock<Tokens>,
    /// Verifications running at once.
    verifying: Semaphore,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// How many argon2 verifications run at once.
const VERIFYING_AT_ONCE: usize = 2;

impl TokenStore {
    /// Reads the token file at `path`.
    pub fn load(path: &Path) -> Result<Arc<TokenStore>, AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let entries = parse_tokens(&text, path)?;
        Ok(Arc::new(TokenStore {
            path: path.to_path_buf(),
            tokens: RwLock::new(Tokens {
                entries: Arc::new(entries),
                ..Tokens::default()
            }),
            verifying: Semaphore::new(VERIFYING_AT_ONCE),
        }))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tokens> {
        self.tokens.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tokens> {
        self.tokens.write().unwrap_or_else(|p| p.into_inner())
    }

    /// How many entries are in force.
    pub fn len(&self) -> usize {
        self.read().entries.len()
    }

    /// Whether no entry is in force.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Puts `entries` in force and forgets every verified token.
    fn replace(&self, entries: Vec<TokenEntry>) {
        let mut tokens = self.write();
        tokens.entries = Arc::new(entries);
        tokens.cache.clear();
        tokens.generation = tokens.generation.wrapping_add(1);
    }

    /// The name and role of the entry `token` matches, if any.
    pub async fn verify(&self, token: &str) -> Option<(String, Role)> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // A file that changes during a verification is verified against once more: its
        // entry may be gone, or new.
        for _ in 0..2 {
            let (entries, generation) = {
                let tokens = self.read();
                if let Some(entry) = tokens
                    .cache
                    .get(&digest)
                    .and_then(|&i| tokens.entries.get(i))
                {
                    return Some((entry.name.clone(), entry.role));
                }
                (tokens.entries.clone(), tokens.generation)
            };
            let permit = self.verifying.acquire().await.ok()?;
            let token = token.to_string();
            let candidates = entries.clone();
            let found = tokio::task::spawn_blocking(move || {
                candidates.iter().position(|e| {
                    PasswordHash::new(&e.hash).is_ok_and(|hash| {
                        argon2::Argon2::default()
                            .verify_password(token.as_bytes(), &hash)
                            .is_ok()
                    })
                })
            })
            .await
            .ok()?;
            drop(permit);
            let mut tokens = self.write();
            if tokens.generation != generation {
                continue;
            }
            let index = found?;
            tokens.cache.insert(digest, index);
            let entry = entries.get(index)?;
            return Some((entry.name.clone(), entry.role));
        }
        None
    }

    /// Takes the file's new contents: parsed, they replace the entries in force; a
    /// file that does not parse leaves them, a file removed leaves none.
    fn take(&self, contents: &Result<Vec<u8>, std::io::ErrorKind>, metrics: &Metrics) {
        let result = match contents {
            Ok(bytes) => parse_tokens(&String::from_utf8_lossy(bytes), &self.path),
            Err(std::io::ErrorKind::NotFound) => {
                tracing::warn!(file = %self.path.display(),
                    "the token file is gone: every token is refused until it is back");
                Ok(Vec::new())
            }
            Err(kind) => Err(AuthError::Read {
                path: self.path.display().to_string(),
                source: std::io::Error::from(*kind),
            }),
        };
        match result {
            Ok(entries) => {
                tracing::info!(file = %self.path.display(), tokens = entries.len(),
                    "token file reloaded");
                self.replace(entries);
                metrics.reload_tokens("applied");
            }
            Err(e) => {
                tracing::error!(error = %e, "token file refused; the tokens in force stay");
                metrics.reload_tokens("invalid");
            }
        }
    }

    /// Watches the file until the task ends, looking every `every`, and takes each
    /// change (see [`TokenStore::take`]).
    pub async fn watch(self: Arc<Self>, every: Duration, metrics: Arc<Metrics>) {
        let read = || async { tokio::fs::read(&self.path).await.map_err(|e| e.kind()) };
        let mut seen = read().await;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = read().await;
            if now != seen {
                self.take(&now, &metrics);
                seen = now;
            }
        }
    }
}

/// The HTTP API's credentials and rules, for every request.
pub struct Auth {
    tokens: Option<Arc<TokenStore>>,
    cert_roles: CertRoles,
    metrics_access: MetricsAccess,
    metrics: Arc<Metrics>,
    /// Whether any credential is configured (and so required).
    enabled: bool,
    /// How often the token file is checked.
    check_every: Duration,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl Auth {
    /// No credential: the API is open to whoever reaches it.
    pub fn open(metrics: Arc<Metrics>) -> Arc<Auth> {
        Arc::new(Auth {
            tokens: None,
            cert_roles: CertRoles::default(),
            metrics_access: MetricsAccess::default(),
            metrics,
            enabled: false,
            check_every: Duration::from_secs(1),
        })
    }

    /// The credentials `cfg` configures; the token file is read now.
    pub fn new(cfg: &Config, metrics: Arc<Metrics>) -> Result<Arc<Auth>, AuthError> {
        let tokens = match &cfg.http_auth.tokens {
            Some(path) => Some(TokenStore::load(path)?),
            None => None,
        };
        Ok(Arc::new(Auth {
            tokens,
            cert_roles: cfg.http_auth.cert_roles.clone(),
            metrics_access: cfg.http_auth.metrics,
            metrics,
            enabled: cfg.http_auth.enabled(),
            check_every: Duration::from_millis(cfg.http_auth.tokens_check_ms),
        }))
    }

    /// Whether credentials are required.
    pub fn enabled(&self) -> bool {
        self.enabled
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
        Some(tokens.watch(self.check_every, self.metrics.clone()))
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
        self.metrics.fail_http_auth(failure.label());
        tracing::debug!(reason = failure.label(), path, "HTTP request refused");
        failure.response()
    }

    /// Who presented `authorization` (the header's value) or, failing that, the client
    /// certificate named `cert`; or why they are refused. A bearer token wins over a
    /// certificate.
    async fn identify(
        &self,
        authorization: Option<HeaderValue>,
        cert: Option<Arc<str>>,
    ) -> Result<Principal, Failure> {
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
        if let Some(name) = cert {
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

/// The middleware that admits each request by its credential and the route's rule
/// (see the module), and hands the [`Principal`] on to the handlers.
pub(crate) async fn authenticate(
    AxState(auth): AxState<Arc<Auth>>,
    mut req: Request,
    next: Next,
) -> Response {
    req.extensions_mut().insert(auth.clone());
    if !auth.enabled {
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
    let cert = req
        .extensions()
        .get::<ConnectInfo<Peer>>()
        .and_then(|ConnectInfo(peer)| peer.cert.clone());
    let principal = match auth.identify(authorization, cert).await {
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
        principal.role.reads_metrics(auth.metrics_access)
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
