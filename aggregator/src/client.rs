//! A read-only client of a running aggregator's HTTP API, for the operator commands
//! (`services`, `service NAME`, `endpoints NAME`, `watch NAME`), and the tables they
//! print.
//!
//! HTTP is reqwest's (hyper underneath); the weight watch's server-sent events are
//! parsed by eventsource-stream. An [`ApiClient`] is built from the aggregator's base
//! URL, and every request goes through its one [`reqwest::Client`]: an `https://` base
//! (reqwest's rustls with the aggregator's CA as root) and a bearer token (a default
//! header) are options of that builder, with nothing else to change. Everything is
//! bounded: the connect time, each request, the watch's silence and the body's size.

use crate::api::views::{EndpointView, ErrorBody, ServiceDetail, ServiceSummary, WeightSet};
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::StreamExt as _;
use serde::de::DeserializeOwned;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The aggregator's default API address, as a URL.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7401";
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a plain request may take, from sending it to the end of its body.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a watch may go without a byte: three keep-alive intervals of the server.
pub const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(45);
/// The largest body read.
pub const MAX_BODY: usize = 16 * 1024 * 1024;
/// The most bytes a watch reads without completing an event.
const MAX_EVENT: usize = MAX_BODY;
/// The most of an error body read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The event type of a weight set on the watch stream (an event without a type is
/// taken as one too).
const WEIGHTS_EVENT: &str = "weights";

/// What can go wrong talking to the aggregator. Each names the aggregator's URL.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `http://host[:port][/prefix]`.
    #[error("bad aggregator URL {url:?}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection could be made (refused, unreachable, timed out, no address).
    #[error("cannot reach the aggregator at {url}: {reason}")]
    Connect {
        /// The aggregator's URL.
        url: String,
        /// Why, as the system said it.
        reason: String,
    },
    /// The connection failed or timed out after it was made.
    #[error("reading from the aggregator at {url}: {reason}")]
    Io {
        /// The aggregator's URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The answer is not what this client reads: too large, not UTF-8, not server-sent
    /// events.
    #[error("bad HTTP response from the aggregator at {url}: {reason}")]
    Protocol {
        /// The aggregator's URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The aggregator answered an error status; `message` is its error body's text.
    #[error("{message} (HTTP {status} from the aggregator at {url})")]
    Status {
        /// The aggregator's URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The API's message, or the body if it has none.
        message: String,
    },
    /// The body is not the JSON expected.
    #[error("bad JSON from the aggregator at {url}: {source}")]
    Json {
        /// The aggregator's URL.
        url: String,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The aggregator closed a watch stream.
    #[error("the aggregator at {url} ended the watch stream")]
    StreamEnded {
        /// The aggregator's URL.
        url: String,
    },
}

/// The innermost cause of an error: for a refused connection, the system's words
/// rather than reqwest's wrapping of them.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut e = e;
    while let Some(source) = e.source() {
        e = source;
    }
    e.to_string()
}

/// Why a watch's byte stream stopped: reqwest's error, or an event that grew too large.
#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("an event over {MAX_EVENT} bytes")]
    TooLarge,
}

/// What an operator's action is on: [`ApiClient::act`].
#[derive(Debug, Clone, Copy)]
pub enum ActTarget<'a> {
    /// The service's hold.
    Hold,
    /// The drain of this node.
    Drain(&'a str),
    /// The pin of this node.
    Pin(&'a str),
}

/// `name` as one path segment: every byte but the unreserved characters of RFC 3986
/// percent-encoded, so that a `/` or `?` in a name cannot change the route.
fn segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The seconds of a duration written for people: `90s`, `30m`, `2h`, `1d`, or a bare
/// number of seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 30m, 2h or 1d"))?;
    let factor = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit is one of s, m, h, d")),
    };
    n.checked_mul(factor)
        .filter(|s| *s > 0)
        .ok_or_else(|| format!("{text:?} is not a duration above zero that fits"))
}

/// A client of one aggregator's API, built from its base URL.
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// The base URL as given, without a trailing `/`: what errors name.
    url: String,
    /// The base URL, parsed; request paths are appended to its path.
    base: reqwest::Url,
    http: reqwest::Client,
}

/// What a client presents and trusts beyond the URL.
#[derive(Debug, Clone, Default)]
pub struct ClientOptions {
    /// The bearer token sent with every request.
    pub token: Option<String>,
    /// The CA certificate (PEM file) an `https://` aggregator's certificate is checked
    /// against: the only root trusted.
    pub ca: Option<std::path::PathBuf>,
    /// A client certificate and its key (PEM files), presented over `https://`.
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// The token in a token file: its first line, without surrounding blanks.
pub fn read_token(path: &std::path::Path) -> Result<String, std::io::Error> {
    let text = std::fs::read_to_string(path)?;
    let token = text.lines().next().unwrap_or_default().trim().to_string();
    if token.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the token file is empty",
        ));
    }
    Ok(token)
}

impl ApiClient {
    /// A client of the aggregator at `url`, `http://host[:port][/prefix]`, with no
    /// credentials.
    pub fn new(url: &str) -> Result<ApiClient, ClientError> {
        Self::with_options(url, &ClientOptions::default())
    }

    /// A client of the aggregator at `url`, `http://` or `https://host[:port][/prefix]`,
    /// presenting and trusting what `options` say.
    pub fn with_options(url: &str, options: &ClientOptions) -> Result<ApiClient, ClientError> {
        let bad = |reason: &str| ClientError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let base = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        match base.scheme() {
            "http" | "https" => {}
            _ => return Err(bad("only http:// and https:// are supported")),
        }
        if base.host_str().is_none_or(str::is_empty) {
            return Err(bad("no host"));
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(bad("credentials in the URL"));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(bad("a query or fragment"));
        }
        let https = base.scheme() == "https";
        if !https && (options.ca.is_some() || options.identity.is_some()) {
            return Err(bad("--ca, --cert and --key need an https:// URL"));
        }
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("ballast-aggregator/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(WATCH_READ_TIMEOUT)
            // The aggregator is addressed directly, whatever proxy the environment names.
            .no_proxy();
        if https {
            builder = builder.use_rustls_tls().tls_built_in_root_certs(false);
        }
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|e| bad(&format!("{}: {e}", path.display())))
        };
        if let Some(ca) = &options.ca {
            let pem = read(ca)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| bad(&format!("{}: {}", ca.display(), root_cause(&e))))?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let Some((cert, key)) = &options.identity {
            let mut pem = read(cert)?;
            pem.push(b'\n');
            pem.extend(read(key)?);
            let identity = reqwest::Identity::from_pem(&pem)
                .map_err(|e| bad(&format!("{}: {}", cert.display(), root_cause(&e))))?;
            builder = builder.identity(identity);
        }
        if let Some(token) = &options.token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| bad("the token is not printable ASCII"))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        let http = builder.build().map_err(|e| bad(&root_cause(&e)))?;
        Ok(ApiClient {
            url: url.trim_end_matches('/').to_string(),
            base,
            http,
        })
    }

    /// The aggregator's URL, as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL of `path_and_query` (which starts with `/`) under the base URL.
    fn url_of(&self, path_and_query: &str) -> Result<reqwest::Url, ClientError> {
        let (path, query) = match path_and_query.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path_and_query, None),
        };
        let mut url = self.base.clone();
        url.set_path(&format!("{}{path}", self.base.path().trim_end_matches('/')));
        url.set_query(query);
        Ok(url)
    }

    /// The error of a failed request or body read.
    fn transport(&self, e: &reqwest::Error) -> ClientError {
        let reason = root_cause(e);
        if e.is_connect() {
            ClientError::Connect {
                url: self.url.clone(),
                reason,
            }
        } else if e.is_timeout() {
            ClientError::Io {
                url: self.url.clone(),
                reason: format!("timed out ({reason})"),
            }
        } else {
            ClientError::Io {
                url: self.url.clone(),
                reason,
            }
        }
    }

    fn protocol(&self, reason: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            url: self.url.clone(),
            reason: reason.into(),
        }
    }

    /// Sends `GET path` and checks the status: an error status becomes
    /// [`ClientError::Status`] with the API's message. `timeout` bounds the whole
    /// request, body included (none: the watch's silence bound alone).
    async fn open(
        &self,
        path: &str,
        accept: &str,
        timeout: Option<Duration>,
    ) -> Result<reqwest::Response, ClientError> {
        let mut request = self
            .http
            .get(self.url_of(path)?)
            .header(reqwest::header::ACCEPT, accept);
        if let Some(t) = timeout {
            request = request.timeout(t);
        }
        let response = request.send().await.map_err(|e| self.transport(&e))?;
        let status = response.status();
        if !status.is_success() {
            let body = self
                .body(response, MAX_ERROR_BODY)
                .await
                .unwrap_or_default();
            return Err(status_error(&self.url, status.as_u16(), &body));
        }
        Ok(response)
    }

    /// The whole body of `response`, at most `max` bytes.
    async fn body(
        &self,
        mut response: reqwest::Response,
        max: usize,
    ) -> Result<Vec<u8>, ClientError> {
        if let Some(len) = response.content_length() {
            if len > max as u64 {
                return Err(self.protocol(format!("a body of {len} bytes, more than {max}")));
            }
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.transport(&e))? {
            if body.len() + chunk.len() > max {
                return Err(self.protocol(format!("a body over {max} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// `GET path`: the body as text.
    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let response = self
            .open(path, "application/json", Some(REQUEST_TIMEOUT))
            .await?;
        let body = self.body(response, MAX_BODY).await?;
        String::from_utf8(body).map_err(|_| self.protocol("a body that is not UTF-8"))
    }

    /// `GET path`: the body parsed, with its text as the aggregator sent it.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<(T, String), ClientError> {
        let text = self.get_text(path).await?;
        let value = serde_json::from_str(&text).map_err(|source| ClientError::Json {
            url: self.url.clone(),
            source,
        })?;
        Ok((value, text))
    }

    /// Sends `method path` with the JSON `body` (an operator's action) and reads the
    /// answer: the body parsed, with its text as the aggregator sent it. An error
    /// status becomes [`ClientError::Status`] with the API's message.
    pub async fn send_json<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(T, String), ClientError> {
        let response = self
            .http
            .request(method, self.url_of(path)?)
            .header(reqwest::header::ACCEPT, "application/json")
            .json(body)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .map_err(|e| self.transport(&e))?;
        let status = response.status();
        let bytes = self.body(response, MAX_BODY).await?;
        let text =
            String::from_utf8(bytes).map_err(|_| self.protocol("a body that is not UTF-8"))?;
        if !status.is_success() {
            return Err(status_error(&self.url, status.as_u16(), text.as_bytes()));
        }
        let value = serde_json::from_str(&text).map_err(|source| ClientError::Json {
            url: self.url.clone(),
            source,
        })?;
        Ok((value, text))
    }

    /// An operator's `action` (`POST`, or `DELETE` to lift it) on `service`, or on its
    /// endpoint `node`, with `body` (its `reason` and the action's own fields).
    pub async fn act(
        &self,
        method: reqwest::Method,
        service: &str,
        target: ActTarget<'_>,
        body: &serde_json::Value,
    ) -> Result<(crate::api::act::ActResult, String), ClientError> {
        let service = segment(service);
        let path = match target {
            ActTarget::Hold => format!("/v1/services/{service}/hold"),
            ActTarget::Drain(node) => {
                format!("/v1/services/{service}/endpoints/{}/drain", segment(node))
            }
            ActTarget::Pin(node) => {
                format!("/v1/services/{service}/endpoints/{}/pin", segment(node))
            }
        };
        self.send_json(method, &path, body).await
    }

    /// `GET /v1/audit`.
    pub async fn audit(&self) -> Result<(Vec<crate::audit::AuditRecord>, String), ClientError> {
        self.get_json("/v1/audit").await
    }

    /// `GET /v1/services`.
    pub async fn services(&self) -> Result<(Vec<ServiceSummary>, String), ClientError> {
        self.get_json("/v1/services").await
    }

    /// `GET /v1/services/{name}`.
    pub async fn service(&self, name: &str) -> Result<(ServiceDetail, String), ClientError> {
        self.get_json(&format!("/v1/services/{}", encode_segment(name)))
            .await
    }

    /// `GET /v1/services/{name}/endpoints`.
    pub async fn endpoints(&self, name: &str) -> Result<(Vec<EndpointView>, String), ClientError> {
        self.get_json(&format!("/v1/services/{}/endpoints", encode_segment(name)))
            .await
    }

    /// Follows `GET /v1/services/{name}/weights?watch=true`: calls `each` with every
    /// weight set and its JSON text, the current one first, until `each` returns
    /// `false` (then `Ok`) or the stream fails or ends (an error). A silence longer
    /// than [`WATCH_READ_TIMEOUT`] (the server sends keep-alives) is an error.
    pub async fn watch(
        &self,
        name: &str,
        mut each: impl FnMut(&WeightSet, &str) -> bool,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/services/{}/weights?watch=true", encode_segment(name));
        let response = self.open(&path, "text/event-stream", None).await?;
        // Bytes read since the last complete event, to bound what the parser buffers.
        let pending = Arc::new(AtomicUsize::new(0));
        let counted = pending.clone();
        let mut events = response
            .bytes_stream()
            .map(move |chunk| {
                let chunk = chunk?;
                let total = counted.fetch_add(chunk.len(), Ordering::Relaxed) + chunk.len();
                if total > MAX_EVENT {
                    return Err(WatchError::TooLarge);
                }
                Ok(chunk)
            })
            .eventsource();
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| match e {
                EventStreamError::Transport(WatchError::Http(e)) => self.transport(&e),
                EventStreamError::Transport(e @ WatchError::TooLarge) => {
                    self.protocol(e.to_string())
                }
                EventStreamError::Utf8(e) => self.protocol(format!("an event stream: {e}")),
                EventStreamError::Parser(e) => self.protocol(format!("an event stream: {e}")),
            })?;
            pending.store(0, Ordering::Relaxed);
            if event.event != WEIGHTS_EVENT && event.event != "message" {
                continue;
            }
            let set: WeightSet =
                serde_json::from_str(&event.data).map_err(|source| ClientError::Json {
                    url: self.url.clone(),
                    source,
                })?;
            if !each(&set, &event.data) {
                return Ok(());
            }
        }
        Err(ClientError::StreamEnded {
            url: self.url.clone(),
        })
    }
}

/// The error of a non-success answer: the API's message if the body is its error
/// shape, else the body's text.
fn status_error(url: &str, status: u16, body: &[u8]) -> ClientError {
    let message = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.error,
        Err(_) => {
            let text = String::from_utf8_lossy(body).trim().to_string();
            if text.is_empty() {
                "the aggregator answered an error".to_string()
            } else {
                text
            }
        }
    };
    ClientError::Status {
        url: url.to_string(),
        status,
        message,
    }
}

/// Percent-encodes a path segment (everything but unreserved characters).
pub(crate) fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Aligned columns in the style of `kubectl get`: a header row, then one row per line,
/// each column as wide as its widest cell, three spaces apart; an empty cell shows `-`.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count().max(1));
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("   ");
            }
            let pad = widths.get(i).copied().unwrap_or(0);
            let cell = if cell.is_empty() { "-" } else { cell };
            let _ = write!(l, "{cell:<pad$}");
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

fn dash(s: Option<&str>) -> String {
    s.unwrap_or("-").to_string()
}

/// A duration in milliseconds, short: `850ms`, `12.3s`, `4m05s`.
pub fn age(ms: Option<u64>) -> String {
    match ms {
        None => "-".to_string(),
        Some(ms) if ms < 1000 => format!("{ms}ms"),
        Some(ms) if ms < 60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        Some(ms) => format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

/// The `services` table.
pub fn services_table(services: &[ServiceSummary]) -> String {
    let rows: Vec<Vec<String>> = services
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                s.endpoints.to_string(),
                format!("{:.3}", s.avg),
                format!("{:.3}", s.max_over_avg),
                format!("{:.3}", s.p95_over_avg),
                format!("{:.0}%", s.missing_share * 100.0),
                s.version.to_string(),
                dash(s.last_skip.as_deref()),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "ENDPOINTS",
            "AVG LOAD",
            "MAX/AVG",
            "P95/AVG",
            "MISSING",
            "VERSION",
            "LAST SKIP",
        ],
        &rows,
    )
}

/// The `endpoints NAME` table.
pub fn endpoints_table(endpoints: &[EndpointView]) -> String {
    let rows: Vec<Vec<String>> = endpoints
        .iter()
        .map(|e| {
            let state = serde_json::to_value(e.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_else(|| format!("{:?}", e.state));
            vec![
                e.node.clone(),
                e.address.clone(),
                e.zone.clone(),
                state,
                format!("{:.3}", e.load),
                format!("{:.3}", e.weight),
                age(e.report_age_ms),
            ]
        })
        .collect();
    table(
        &[
            "NODE",
            "ADDRESS",
            "ZONE",
            "STATE",
            "LOAD",
            "WEIGHT",
            "REPORT AGE",
        ],
        &rows,
    )
}

/// How many recent cycles `service NAME` shows.
pub const RECENT_CYCLES: usize = 10;

/// The `service NAME` summary: key/value lines, then the recent cycles.
pub fn service_summary(d: &ServiceDetail) -> String {
    let s = &d.stats;
    let states = if d.states.is_empty() {
        "none".to_string()
    } else {
        d.states
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let skipped = if s.skipped.is_empty() {
        "none".to_string()
    } else {
        s.skipped
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let pairs: [(&str, String); 9] = [
        ("Name", d.name.clone()),
        (
            "Version",
            format!("{} (weights of cycle {})", d.version, d.weights_cycle),
        ),
        (
            "Cycles",
            format!("{} ({} updated weights)", s.cycles, s.updates),
        ),
        ("Endpoints", states),
        ("Avg load", format!("{:.3}", s.spread.avg)),
        (
            "Spread",
            format!(
                "max/avg {:.3}, p95/avg {:.3}, p5/avg {:.3}",
                s.spread.max_over_avg, s.spread.p95_over_avg, s.spread.p5_over_avg
            ),
        ),
        ("Missing", format!("{:.0}%", s.missing_share * 100.0)),
        ("Skipped", skipped),
        ("Last skip", dash(d.last_skip_reason.as_deref())),
    ];
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in &pairs {
        let key = format!("{k}:");
        let _ = writeln!(out, "{key:<width$}  {v}");
    }
    let recent = &d.history[d.history.len().saturating_sub(RECENT_CYCLES)..];
    let _ = writeln!(out, "\nRecent cycles:");
    let rows: Vec<Vec<String>> = recent
        .iter()
        .map(|h| {
            vec![
                h.cycle.to_string(),
                format!("{:.3}", h.spread.avg),
                format!("{:.3}", h.spread.max_over_avg),
                format!("{:.3}", h.spread.p95_over_avg),
                if h.skipped { "yes" } else { "no" }.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["CYCLE", "AVG LOAD", "MAX/AVG", "P95/AVG", "SKIPPED"],
        &rows,
    ));
    out
}

/// One `watch` line: version, cycle, then `node=weight` (a draining node's weight is
/// followed by `(draining)`).
pub fn watch_line(set: &WeightSet) -> String {
    let mut out = format!("version={} cycle={}", set.version, set.cycle);
    for (node, w) in &set.weights {
        let _ = write!(out, " {node}={:.3}", w.weight);
        if w.draining {
            out.push_str("(draining)");
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};

    #[test]
    fn error_bodies_give_the_api_message() {
        let url = "http://127.0.0.1:1";
        let e = status_error(
            url,
            404,
            br#"{"error":"unknown service \"x\"","status":404}"#,
        );
        assert_eq!(
            e.to_string(),
            "unknown service \"x\" (HTTP 404 from the aggregator at http://127.0.0.1:1)"
        );
        let e = status_error(url, 502, b"bad gateway");
        assert!(e.to_string().starts_with("bad gateway (HTTP 502 "), "{e}");
        let e = status_error(url, 500, b"");
        assert!(
            e.to_string()
                .starts_with("the aggregator answered an error"),
            "{e}"
        );
    }

    #[test]
    fn urls() {
        let c = ApiClient::new("http://127.0.0.1:7401").unwrap();
        assert_eq!(
            c.url_of("/v1/services").unwrap().as_str(),
            "http://127.0.0.1:7401/v1/services"
        );
        let c = ApiClient::new("http://[::1]:9/api/").unwrap();
        assert_eq!(c.url(), "http://[::1]:9/api");
        assert_eq!(
            c.url_of("/v1/services/a%20b/weights?watch=true")
                .unwrap()
                .as_str(),
            "http://[::1]:9/api/v1/services/a%20b/weights?watch=true"
        );
        let c = ApiClient::new("http://agg.example").unwrap();
        assert_eq!(c.base.port_or_known_default(), Some(80));
        assert!(ApiClient::new("https://agg.example").is_ok());
        let ca_on_http = ClientOptions {
            ca: Some("/ca.pem".into()),
            ..ClientOptions::default()
        };
        assert!(matches!(
            ApiClient::with_options("http://x", &ca_on_http),
            Err(ClientError::Url { .. })
        ));
        for bad in [
            "ftp://x",
            "127.0.0.1:7401",
            "http://",
            "http://h:port",
            "http://u@h",
            "http://h/?q=1",
        ] {
            assert!(
                matches!(ApiClient::new(bad), Err(ClientError::Url { .. })),
                "{bad}"
            );
        }
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }

    /// A one-connection HTTP server on loopback: reads one request's head and answers
    /// `pieces`, written one by one with a pause between (so that a body arrives in
    /// parts); the request line, when done.
    fn serve(pieces: Vec<Vec<u8>>) -> (String, std::thread::JoinHandle<String>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = BufReader::new(s.try_clone().unwrap());
            let mut first = String::new();
            req.read_line(&mut first).unwrap();
            loop {
                let mut line = String::new();
                req.read_line(&mut line).unwrap();
                if line.trim_end().is_empty() {
                    break;
                }
            }
            for piece in pieces {
                s.write_all(&piece).unwrap();
                s.flush().unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            first.trim_end().to_string()
        });
        (url, server)
    }

    #[tokio::test]
    async fn an_unreachable_aggregator_says_so() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let url = format!("http://127.0.0.1:{port}");
        let err = ApiClient::new(&url).unwrap().services().await.unwrap_err();
        assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with(&format!("cannot reach the aggregator at {url}: ")),
            "{err}"
        );
        assert!(err.to_string().contains("refused"), "{err}");
    }

    #[tokio::test]
    async fn a_get_against_a_local_server() {
        let (url, server) = serve(vec![
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n\r\n".to_vec(),
        ]);
        let (services, raw) = ApiClient::new(&url).unwrap().services().await.unwrap();
        assert!(services.is_empty());
        assert_eq!(raw, "[]");
        assert_eq!(server.join().unwrap(), "GET /v1/services HTTP/1.1");
    }

    #[tokio::test]
    async fn error_statuses_and_bad_json_name_the_aggregator() {
        let body = r#"{"error":"unknown service \"x\"","status":404}"#;
        let (url, server) = serve(vec![format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()]);
        let err = ApiClient::new(&url)
            .unwrap()
            .service("x")
            .await
            .unwrap_err();
        assert!(
            matches!(err, ClientError::Status { status: 404, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("unknown service \"x\""), "{err}");
        assert!(err.to_string().contains(&url), "{err}");
        assert_eq!(server.join().unwrap(), "GET /v1/services/x HTTP/1.1");

        let (url, server) = serve(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!".to_vec(),
        ]);
        let err = ApiClient::new(&url).unwrap().services().await.unwrap_err();
        assert!(matches!(err, ClientError::Json { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with(&format!("bad JSON from the aggregator at {url}: ")),
            "{err}"
        );
        server.join().unwrap();
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused() {
        let (url, server) = serve(vec![format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            MAX_BODY + 1
        )
        .into_bytes()]);
        let err = ApiClient::new(&url).unwrap().services().await.unwrap_err();
        assert!(matches!(err, ClientError::Protocol { .. }), "{err:?}");
        server.join().unwrap();
    }

    fn weight_set_json(version: u64) -> String {
        format!(
            r#"{{"service":"web","version":{version},"cycle":{version},"weights":{{"n1":{{"address":"10.0.0.1:80","zone":"z","weight":1.5,"draining":false,"envoy":150,"haproxy_percent":150}}}}}}"#
        )
    }

    #[tokio::test]
    async fn a_watch_reads_events_split_anywhere_and_says_when_the_stream_ends() {
        let mut body = String::from(":\n\n");
        body.push_str(&format!(
            "event: weights\nid: 3\ndata: {}\n\n",
            weight_set_json(3)
        ));
        // Another type of event is passed over; a keep-alive comment is ignored.
        body.push_str("event: other\ndata: {}\n\n: keep-alive\n\n");
        body.push_str(&format!(
            "event: weights\nid: 4\ndata: {}\n\n",
            weight_set_json(4)
        ));
        // Chunks cut at awkward places: inside a field name, inside the JSON.
        let cuts = [5, 17, 40, body.len() - 3, body.len()];
        let mut pieces = vec![b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              transfer-encoding: chunked\r\n\r\n"
            .to_vec()];
        let mut from = 0;
        for to in cuts {
            let piece = &body[from..to];
            pieces.push(format!("{:x}\r\n{piece}\r\n", piece.len()).into_bytes());
            from = to;
        }
        pieces.push(b"0\r\n\r\n".to_vec());
        let (url, server) = serve(pieces);
        let mut got = Vec::new();
        let err = ApiClient::new(&url)
            .unwrap()
            .watch("web", |set, raw| {
                got.push((set.version, raw.to_string()));
                true
            })
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::StreamEnded { .. }), "{err:?}");
        assert_eq!(got, vec![(3, weight_set_json(3)), (4, weight_set_json(4))]);
        assert_eq!(
            server.join().unwrap(),
            "GET /v1/services/web/weights?watch=true HTTP/1.1"
        );
    }

    #[tokio::test]
    async fn a_watch_stops_when_told_and_refuses_bad_events() {
        let ok = format!("data: {}\n\n", weight_set_json(1));
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n".to_vec();
        let (url, server) = serve(vec![head.clone(), ok.clone().into_bytes()]);
        let mut n = 0;
        ApiClient::new(&url)
            .unwrap()
            .watch("web", |_, _| {
                n += 1;
                false
            })
            .await
            .unwrap();
        assert_eq!(n, 1);
        server.join().unwrap();

        let (url, server) = serve(vec![head, b"event: weights\ndata: [1,\n\n".to_vec()]);
        let err = ApiClient::new(&url)
            .unwrap()
            .watch("web", |_, _| true)
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Json { .. }), "{err:?}");
        server.join().unwrap();
    }

    #[test]
    fn tables_align() {
        let t = table(
            &["NAME", "N"],
            &[
                vec!["a".into(), "1".into()],
                vec!["longer".into(), "22".into()],
                vec!["".into(), "".into()],
            ],
        );
        assert_eq!(t, "NAME     N\na        1\nlonger   22\n-        -\n");
        assert_eq!(age(None), "-");
        assert_eq!(age(Some(850)), "850ms");
        assert_eq!(age(Some(12_340)), "12.3s");
        assert_eq!(age(Some(245_000)), "4m05s");
    }
}
