//! A read-only client of a running aggregator's HTTP API, for the operator commands
//! (`services`, `service NAME`, `endpoints NAME`, `watch NAME`), and the tables they
//! print.
//!
//! The aggregator has no HTTP client dependency: this is a small HTTP/1.1 client over
//! [`std::net::TcpStream`]. Each request is one `GET` with `Connection: close`; the body
//! is read by `Content-Length`, chunked transfer coding, or to the end of the
//! connection. Everything is bounded: the connect time, each read, each header line and
//! the body's size.

use crate::api::views::{EndpointView, ErrorBody, ServiceDetail, ServiceSummary, WeightSet};
use serde::de::DeserializeOwned;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The aggregator's default API address, as a URL.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7401";
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one read of a plain request may wait.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a watch may go without a byte: three keep-alive intervals of the server.
pub const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(45);
/// The largest body read.
pub const MAX_BODY: usize = 16 * 1024 * 1024;
/// The longest status, header, chunk-size or event line read.
pub const MAX_LINE: usize = 64 * 1024;
/// The most header lines read.
const MAX_HEADERS: usize = 100;
/// The largest server-sent event (all its `data:` lines).
const MAX_EVENT: usize = MAX_BODY;

/// What can go wrong talking to the aggregator.
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
    /// No connection could be made.
    #[error("cannot reach the aggregator at {url}: {source}")]
    Connect {
        /// The aggregator's URL.
        url: String,
        /// Why.
        source: std::io::Error,
    },
    /// The connection failed or timed out after it was made.
    #[error("reading from the aggregator at {url}: {source}")]
    Io {
        /// The aggregator's URL.
        url: String,
        /// Why.
        source: std::io::Error,
    },
    /// The answer is not HTTP as this client reads it.
    #[error("bad HTTP response from the aggregator at {url}: {reason}")]
    Protocol {
        /// The aggregator's URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The aggregator answered an error status; `message` is its error body's text.
    #[error("{message} (HTTP {status})")]
    Status {
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

/// A malformed response, before the URL is known to the reader.
#[derive(Debug)]
enum ReadError {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// A response's status line and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The status code.
    pub status: u16,
    /// Headers in order, names lower-cased.
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// The first header named `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the body is chunked.
    fn chunked(&self) -> bool {
        self.header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
    }
}

/// Reads one line ending in `\n`, without its `\r\n` or `\n`; `None` at the end of the
/// input before any byte. A line longer than `max` is an error.
fn read_line(r: &mut impl BufRead, max: usize) -> Result<Option<String>, ReadError> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            if line.is_empty() {
                return Ok(None);
            }
            break;
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if line.len() > max + 2 {
            return Err(ReadError::Protocol(format!(
                "a line longer than {max} bytes"
            )));
        }
        if done {
            break;
        }
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line)
        .map(Some)
        .map_err(|_| ReadError::Protocol("a line that is not UTF-8".into()))
}

/// Reads the status line and headers.
fn read_head(r: &mut impl BufRead) -> Result<Head, ReadError> {
    let line = read_line(r, MAX_LINE)?
        .ok_or_else(|| ReadError::Protocol("the connection closed before a status line".into()))?;
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(ReadError::Protocol(format!("status line {line:?}")));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..=999).contains(s))
        .ok_or_else(|| ReadError::Protocol(format!("status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let line = read_line(r, MAX_LINE)?
            .ok_or_else(|| ReadError::Protocol("the connection closed in the headers".into()))?;
        if line.is_empty() {
            break;
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ReadError::Protocol(format!(
                "more than {MAX_HEADERS} headers"
            )));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| ReadError::Protocol(format!("header line {line:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok(Head { status, headers })
}

/// Decodes the chunked transfer coding of a body as it is read.
struct Chunked<R> {
    inner: R,
    /// Bytes left in the current chunk.
    left: u64,
    /// Whether the last chunk was read.
    done: bool,
    /// Whether a chunk's data ended and its CRLF is still to be read.
    crlf_due: bool,
}

impl<R: BufRead> Chunked<R> {
    fn new(inner: R) -> Self {
        Chunked {
            inner,
            left: 0,
            done: false,
            crlf_due: false,
        }
    }

    fn protocol(msg: impl Into<String>) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
    }

    /// Reads the next chunk-size line; at the last chunk, the trailers too.
    fn next_chunk(&mut self) -> std::io::Result<()> {
        let line = |r: &mut R| match read_line(r, MAX_LINE) {
            Ok(Some(l)) => Ok(l),
            Ok(None) => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the connection closed inside a chunked body",
            )),
            Err(ReadError::Io(e)) => Err(e),
            Err(ReadError::Protocol(m)) => Err(Self::protocol(m)),
        };
        if self.crlf_due {
            if !line(&mut self.inner)?.is_empty() {
                return Err(Self::protocol("chunk data longer than its size"));
            }
            self.crlf_due = false;
        }
        let size_line = line(&mut self.inner)?;
        let size = size_line.split(';').next().unwrap_or_default().trim();
        let size = u64::from_str_radix(size, 16)
            .map_err(|_| Self::protocol(format!("chunk size {size_line:?}")))?;
        if size == 0 {
            // Trailers, if any, up to a blank line.
            while !line(&mut self.inner)?.is_empty() {}
            self.done = true;
        } else {
            self.left = size;
        }
        Ok(())
    }
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        while self.left == 0 {
            if self.done {
                return Ok(0);
            }
            self.next_chunk()?;
        }
        let want = out
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut out[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the connection closed inside a chunk",
            ));
        }
        self.left -= n as u64;
        if self.left == 0 {
            self.crlf_due = true;
        }
        Ok(n)
    }
}

/// Reads the whole body after `head`, at most `max` bytes.
fn read_body(head: &Head, r: impl BufRead, max: usize) -> Result<Vec<u8>, ReadError> {
    let limit = max as u64 + 1;
    let mut body = Vec::new();
    if head.chunked() {
        Chunked::new(r).take(limit).read_to_end(&mut body)?;
    } else if let Some(len) = head.header("content-length") {
        let len: u64 = len
            .parse()
            .map_err(|_| ReadError::Protocol(format!("Content-Length {len:?}")))?;
        if len > max as u64 {
            return Err(ReadError::Protocol(format!(
                "a body of {len} bytes, more than {max}"
            )));
        }
        r.take(len).read_to_end(&mut body)?;
        if (body.len() as u64) < len {
            return Err(ReadError::Protocol(format!(
                "the body ended after {} of {len} bytes",
                body.len()
            )));
        }
    } else {
        r.take(limit).read_to_end(&mut body)?;
    }
    if body.len() > max {
        return Err(ReadError::Protocol(format!("a body over {max} bytes")));
    }
    Ok(body)
}

/// One server-sent event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `id:` field, if any.
    pub id: Option<String>,
    /// The `data:` lines, joined by newlines.
    pub data: String,
}

/// Builds server-sent events from the lines of a stream.
#[derive(Debug, Default)]
pub struct SseParser {
    current: SseEvent,
    has_data: bool,
}

impl SseParser {
    /// Takes one line (without its line ending). A blank line ends the event, which is
    /// returned if it had any field; a line starting with `:` is a comment (the
    /// server's keep-alive) and is ignored, as are unknown fields.
    pub fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let had = self.has_data || self.current.event.is_some() || self.current.id.is_some();
            let ev = std::mem::take(&mut self.current);
            self.has_data = false;
            return had.then_some(ev);
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => self.current.event = Some(value.to_string()),
            "id" => self.current.id = Some(value.to_string()),
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.has_data = true;
            }
            _ => {}
        }
        None
    }

    /// The size of the event being built, to bound it.
    fn pending(&self) -> usize {
        self.current.data.len()
    }
}

/// A response whose status said success: its head and a reader of its body.
struct Open {
    head: Head,
    reader: BufReader<TcpStream>,
}

/// A client of one aggregator's API.
#[derive(Debug, Clone)]
pub struct Client {
    url: String,
    host: String,
    port: u16,
    prefix: String,
}

impl Client {
    /// A client of the aggregator at `url`, `http://host[:port][/prefix]`.
    pub fn new(url: &str) -> Result<Client, ClientError> {
        let bad = |reason: &str| ClientError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("only http:// is supported"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("no host"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed ["))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad("bad port"))?,
                None if after.is_empty() => 80,
                None => return Err(bad("bad port")),
            };
            (h.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().map_err(|_| bad("bad port"))?),
                None => (authority.to_string(), 80),
            }
        };
        Ok(Client {
            url: url.trim_end_matches('/').to_string(),
            host,
            port,
            prefix: prefix.to_string(),
        })
    }

    /// The aggregator's URL, as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io {
            url: self.url.clone(),
            source,
        }
    }

    fn read_error(&self, e: ReadError) -> ClientError {
        match e {
            ReadError::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                ClientError::Protocol {
                    url: self.url.clone(),
                    reason: e.to_string(),
                }
            }
            ReadError::Io(e) => self.io(e),
            ReadError::Protocol(reason) => ClientError::Protocol {
                url: self.url.clone(),
                reason,
            },
        }
    }

    fn connect(&self) -> Result<TcpStream, ClientError> {
        let fail = |source| ClientError::Connect {
            url: self.url.clone(),
            source,
        };
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(fail)?
            .collect();
        let mut last = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{} has no address", self.host),
        );
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(fail(last))
    }

    /// Sends `GET path` and reads the head; an error status becomes
    /// [`ClientError::Status`] with the API's message.
    fn open(&self, path: &str, accept: &str, read_timeout: Duration) -> Result<Open, ClientError> {
        let stream = self.connect()?;
        stream
            .set_read_timeout(Some(read_timeout))
            .map_err(|e| self.io(e))?;
        stream
            .set_write_timeout(Some(READ_TIMEOUT))
            .map_err(|e| self.io(e))?;
        let host = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        let request = format!(
            "GET {}{path} HTTP/1.1\r\nHost: {host}\r\nAccept: {accept}\r\n\
             User-Agent: ballast-aggregator/{}\r\nConnection: close\r\n\r\n",
            self.prefix,
            env!("CARGO_PKG_VERSION")
        );
        (&stream)
            .write_all(request.as_bytes())
            .map_err(|e| self.io(e))?;
        let mut reader = BufReader::new(stream);
        let head = read_head(&mut reader).map_err(|e| self.read_error(e))?;
        if !(200..300).contains(&head.status) {
            let body = read_body(&head, &mut reader, MAX_LINE).unwrap_or_default();
            return Err(status_error(head.status, &body));
        }
        Ok(Open { head, reader })
    }

    /// `GET path`: the body as text.
    pub fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let mut open = self.open(path, "application/json", READ_TIMEOUT)?;
        let body =
            read_body(&open.head, &mut open.reader, MAX_BODY).map_err(|e| self.read_error(e))?;
        String::from_utf8(body).map_err(|_| ClientError::Protocol {
            url: self.url.clone(),
            reason: "a body that is not UTF-8".into(),
        })
    }

    /// `GET path`: the body parsed, with its text as the aggregator sent it.
    pub fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<(T, String), ClientError> {
        let text = self.get_text(path)?;
        let value = serde_json::from_str(&text).map_err(|source| ClientError::Json {
            url: self.url.clone(),
            source,
        })?;
        Ok((value, text))
    }

    /// `GET /v1/services`.
    pub fn services(&self) -> Result<(Vec<ServiceSummary>, String), ClientError> {
        self.get_json("/v1/services")
    }

    /// `GET /v1/services/{name}`.
    pub fn service(&self, name: &str) -> Result<(ServiceDetail, String), ClientError> {
        self.get_json(&format!("/v1/services/{}", encode_segment(name)))
    }

    /// `GET /v1/services/{name}/endpoints`.
    pub fn endpoints(&self, name: &str) -> Result<(Vec<EndpointView>, String), ClientError> {
        self.get_json(&format!("/v1/services/{}/endpoints", encode_segment(name)))
    }

    /// Follows `GET /v1/services/{name}/weights?watch=true`: calls `each` with every
    /// weight set and its JSON text, the current one first, until `each` returns
    /// `false` (then `Ok`) or the stream fails or ends (an error). A silence longer
    /// than [`WATCH_READ_TIMEOUT`] (the server sends keep-alives) is an error.
    pub fn watch(
        &self,
        name: &str,
        mut each: impl FnMut(&WeightSet, &str) -> bool,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/services/{}/weights?watch=true", encode_segment(name));
        let open = self.open(&path, "text/event-stream", WATCH_READ_TIMEOUT)?;
        let mut lines: Box<dyn BufRead> = if open.head.chunked() {
            Box::new(BufReader::new(Chunked::new(open.reader)))
        } else {
            Box::new(open.reader)
        };
        let mut parser = SseParser::default();
        loop {
            let Some(line) = read_line(&mut lines, MAX_LINE).map_err(|e| self.read_error(e))?
            else {
                return Err(ClientError::StreamEnded {
                    url: self.url.clone(),
                });
            };
            let Some(ev) = parser.line(&line) else {
                if parser.pending() > MAX_EVENT {
                    return Err(ClientError::Protocol {
                        url: self.url.clone(),
                        reason: format!("an event over {MAX_EVENT} bytes"),
                    });
                }
                continue;
            };
            if ev.event.as_deref().is_some_and(|e| e != "weights") {
                continue;
            }
            let set: WeightSet =
                serde_json::from_str(&ev.data).map_err(|source| ClientError::Json {
                    url: self.url.clone(),
                    source,
                })?;
            if !each(&set, &ev.data) {
                return Ok(());
            }
        }
    }
}

/// The error of a non-success answer: the API's message if the body is its error
/// shape, else the body's text.
fn status_error(status: u16, body: &[u8]) -> ClientError {
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
    ClientError::Status { status, message }
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
    use std::io::Cursor;

    fn head_of(raw: &str) -> Result<(Head, Cursor<Vec<u8>>), ReadError> {
        let mut r = Cursor::new(raw.as_bytes().to_vec());
        let h = read_head(&mut r)?;
        Ok((h, r))
    }

    #[test]
    fn status_line_and_headers() {
        let (h, _) = head_of(
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\
             content-length:  12 \r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.status, 404);
        assert_eq!(h.header("content-type"), Some("application/json"));
        assert_eq!(h.header("content-length"), Some("12"));
        // A bare status line without a reason, and LF-only line ends.
        let (h, _) = head_of("HTTP/1.0 200\n\n").unwrap();
        assert_eq!(h.status, 200);
        assert!(h.headers.is_empty());
    }

    #[test]
    fn malformed_heads_are_refused() {
        for raw in [
            "",
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 abc OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA: b\r\n",
        ] {
            assert!(
                matches!(head_of(raw), Err(ReadError::Protocol(_))),
                "{raw:?}"
            );
        }
        let long = format!(
            "HTTP/1.1 200 OK\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_LINE + 10)
        );
        assert!(matches!(head_of(&long), Err(ReadError::Protocol(_))));
    }

    #[test]
    fn content_length_body() {
        let (h, r) = head_of("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello, extra").unwrap();
        assert_eq!(read_body(&h, r, 100).unwrap(), b"hello");
        let (h, r) = head_of("HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort").unwrap();
        assert!(matches!(read_body(&h, r, 100), Err(ReadError::Protocol(_))));
        let (h, r) = head_of("HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n").unwrap();
        assert!(matches!(read_body(&h, r, 100), Err(ReadError::Protocol(_))));
        // No length: to the end of the connection, bounded.
        let (h, r) = head_of("HTTP/1.1 200 OK\r\n\r\nall of it").unwrap();
        assert_eq!(read_body(&h, r, 100).unwrap(), b"all of it");
        let (h, r) = head_of("HTTP/1.1 200 OK\r\n\r\ntoo long").unwrap();
        assert!(read_body(&h, r, 4).is_err());
    }

    #[test]
    fn chunked_bodies_decode() {
        let raw = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                   5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: y\r\n\r\n";
        let (h, r) = head_of(raw).unwrap();
        assert_eq!(read_body(&h, r, 100).unwrap(), b"hello, world");
        // Upper-case hex sizes.
        let raw = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1A\r\n{}\r\n0\r\n\r\n",
            "z".repeat(26)
        );
        let (h, r) = head_of(&raw).unwrap();
        assert_eq!(read_body(&h, r, 100).unwrap().len(), 26);
        // Over the limit.
        let (h, r) = head_of(&raw).unwrap();
        assert!(read_body(&h, r, 10).is_err());
    }

    #[test]
    fn broken_chunked_bodies_are_errors() {
        for raw in [
            // Truncated inside a chunk.
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
            // Bad size.
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\nhello\r\n0\r\n\r\n",
            // Data longer than its size.
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhello\r\n0\r\n\r\n",
            // No last chunk.
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        ] {
            let (h, r) = head_of(raw).unwrap();
            assert!(read_body(&h, r, 100).is_err(), "{raw:?}");
        }
    }

    #[test]
    fn sse_events_from_lines() {
        let mut p = SseParser::default();
        let mut events = Vec::new();
        let text = ": keep-alive\n\nevent: weights\nid: 7\ndata: {\"a\":\ndata:1}\n\n\
                    :\n\ndata: plain\nretry: 10\n\n";
        for line in text.split('\n') {
            events.extend(p.line(line));
        }
        assert_eq!(
            events,
            vec![
                SseEvent {
                    event: Some("weights".into()),
                    id: Some("7".into()),
                    data: "{\"a\":\n1}".into(),
                },
                SseEvent {
                    event: None,
                    id: None,
                    data: "plain".into(),
                },
            ]
        );
    }

    #[test]
    fn sse_over_chunked_stream_split_anywhere() {
        // An event split across chunks at awkward places.
        let body = "event: weights\nid: 3\ndata: {\"x\":1}\n\n:\n\n";
        let mut raw = String::from("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        for piece in [&body[..7], &body[7..20], &body[20..]] {
            let _ = write!(raw, "{:x}\r\n{piece}\r\n", piece.len());
        }
        raw.push_str("0\r\n\r\n");
        let (_, r) = head_of(&raw).unwrap();
        let mut lines = BufReader::new(Chunked::new(r));
        let mut p = SseParser::default();
        let mut got = Vec::new();
        while let Some(l) = read_line(&mut lines, MAX_LINE).unwrap() {
            got.extend(p.line(&l));
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id.as_deref(), Some("3"));
        assert_eq!(got[0].data, "{\"x\":1}");
    }

    #[test]
    fn error_bodies_give_the_api_message() {
        let e = status_error(404, br#"{"error":"unknown service \"x\"","status":404}"#);
        assert_eq!(e.to_string(), "unknown service \"x\" (HTTP 404)");
        let e = status_error(502, b"bad gateway");
        assert_eq!(e.to_string(), "bad gateway (HTTP 502)");
    }

    #[test]
    fn urls() {
        let c = Client::new("http://127.0.0.1:7401").unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.prefix.as_str()),
            ("127.0.0.1", 7401, "")
        );
        let c = Client::new("http://[::1]:9/api/").unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.prefix.as_str()),
            ("::1", 9, "/api")
        );
        let c = Client::new("http://agg.example").unwrap();
        assert_eq!(c.port, 80);
        for bad in [
            "https://x",
            "127.0.0.1:7401",
            "http://",
            "http://h:port",
            "http://u@h",
        ] {
            assert!(
                matches!(Client::new(bad), Err(ClientError::Url { .. })),
                "{bad}"
            );
        }
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn an_unreachable_aggregator_says_so() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let url = format!("http://127.0.0.1:{port}");
        let err = Client::new(&url).unwrap().services().unwrap_err();
        assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with(&format!("cannot reach the aggregator at {url}: ")),
            "{err}"
        );
    }

    #[test]
    fn a_get_against_a_local_server() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = BufReader::new(s.try_clone().unwrap());
            let first = read_line(&mut req, MAX_LINE).unwrap().unwrap();
            while !read_line(&mut req, MAX_LINE).unwrap().unwrap().is_empty() {}
            s.write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n\r\n",
            )
            .unwrap();
            first
        });
        let (services, raw) = Client::new(&format!("http://{addr}"))
            .unwrap()
            .services()
            .unwrap();
        assert!(services.is_empty());
        assert_eq!(raw, "[]");
        assert_eq!(server.join().unwrap(), "GET /v1/services HTTP/1.1");
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
