//! An open-loop HTTP load generator, bounded in time and in requests.
//!
//! In open-loop mode request `i` leaves at its scheduled moment whatever happened to the
//! earlier ones, and its latency counts from that moment, so a generator that falls
//! behind is charged to the latency instead of hiding it (coordinated omission).
//! Closed-loop mode (`concurrency` clients, each waiting for its answer before sending
//! again) is only for calibration: it finds what a backend sustains.
//!
//! Requests go over a pool of persistent HTTP/1.1 keep-alive connections, as the
//! clients of a real service send them: a request takes an idle pooled connection, or
//! opens a new one when none is free, and gives it back after a complete answer. The
//! pool holds no more connections than requests may be outstanding, so a slow target
//! makes the pool grow only up to that bound, and a request due beyond it is counted
//! as an overflow instead of waiting (which would close the loop). Like real clients,
//! the pool drops a connection idle for longer than [`IDLE_TIMEOUT`] or closed by the
//! peer, and sends a request again, once, on a fresh connection when a reused one
//! turns out to have been closed before any byte of the answer came back (the server
//! may close an idle connection at any moment; RFC 9112 §9.3.1 lets a client retry an
//! idempotent request then).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest response read; the lab's answers are a few dozen bytes.
const MAX_RESPONSE: usize = 64 * 1024;
/// A pooled connection idle for this long is closed instead of reused. It is below the
/// keep-alive timeout of the lab's HAProxy (its `timeout client`, 10 s), so that the
/// client ends idle connections in the common case, as browsers and HTTP client
/// libraries do, and a request rarely meets a connection the server is closing.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How requests are paced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Mode {
    /// A fixed rate, in requests per second, independent of the answers.
    Open {
        /// Requests per second.
        rate: f64,
    },
    /// Open loop at `rate`, except from `at_secs` for `surge_secs` at `surge_rate`: a
    /// run that, once balanced, gets more load than part of the fleet can take.
    Surge {
        /// When the surge begins, seconds from the start.
        at_secs: f64,
        /// Requests per second during the surge.
        surge_rate: f64,
        /// How long the surge lasts, seconds.
        surge_secs: f64,
        /// Requests per second after it.
        rate: f64,
    },
    /// `concurrency` clients, each sending its next request when the last is answered.
    Closed {
        /// Clients.
        concurrency: usize,
    },
}

impl Mode {
    /// When open-loop request `i` is due, in seconds from the start; `None` in closed
    /// loop, where requests are not scheduled.
    pub fn due(&self, i: u64) -> Option<f64> {
        match *self {
            Mode::Open { rate } => Some(i as f64 / rate),
            Mode::Surge {
                at_secs,
                surge_rate,
                surge_secs,
                rate,
            } => {
                // Requests 0..before are due before the surge, the next in_surge during it.
                let before = (at_secs * rate).ceil() as u64;
                let in_surge = (surge_secs * surge_rate).ceil() as u64;
                Some(if i < before {
                    i as f64 / rate
                } else if i < before + in_surge {
                    at_secs + (i - before) as f64 / surge_rate
                } else {
                    at_secs + surge_secs + (i - before - in_surge) as f64 / rate
                })
            }
            Mode::Closed { .. } => None,
        }
    }
}

/// One run of the generator.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Where requests go (HAProxy's frontend, or one backend for calibration).
    pub target: SocketAddr,
    /// The request path.
    pub path: String,
    /// Pacing.
    pub mode: Mode,
    /// No request is scheduled after this much time.
    pub duration: Duration,
    /// No more than this many requests are sent.
    pub max_requests: u64,
    /// A request not answered within this is a failure.
    pub timeout: Duration,
    /// Open loop: requests in flight at most. Each holds its own connection, so this
    /// also bounds the pool's connections; a request due while this many are
    /// outstanding is not sent and counts as [`Failure::Overflow`], so a dead target
    /// cannot make the generator pile up sockets without bound.
    pub max_outstanding: usize,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// The TCP connection was refused or failed.
    Connect,
    /// No complete answer within the timeout.
    Timeout,
    /// An answer other than 200.
    Status(u16),
    /// The connection broke, or closed without an answer.
    Io,
    /// The answer is not HTTP.
    Malformed,
    /// Not sent: too many requests were outstanding.
    Overflow,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(code) => write!(f, "status {code}"),
            other => write!(f, "{}", format!("{other:?}").to_lowercase()),
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// When it was due, in seconds from the start of the run.
    pub at: f64,
    /// From when it was due to the end of the answer, in milliseconds.
    pub latency_ms: f64,
    /// The `X-Backend` header of the answer: which backend served it.
    pub backend: Option<String>,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
    /// Sent a second time, on a fresh connection, because the pooled one it first
    /// took had been closed by the server.
    #[serde(default)]
    pub retried: bool,
}

/// The connections a run used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Connections opened over the run.
    pub opened: u64,
    /// Most connections open at once (busy and idle).
    pub max_open: u64,
}

/// Every request of a run, in the order they were due.
#[derive(Debug, Clone)]
pub struct LoadRun {
    /// When the run started: outcomes' `at` count from here.
    pub started: Instant,
    /// One per request.
    pub outcomes: Vec<Outcome>,
    /// The pool's connections.
    pub connections: PoolStats,
}

/// Latency and errors over a set of outcomes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests due (sent or overflowed).
    pub requests: u64,
    /// Answered with 200.
    pub ok: u64,
    /// Failed, for any reason.
    pub errors: u64,
    /// Failures by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Sent again on a fresh connection after a pooled one turned out closed.
    pub retried: u64,
    /// Median latency of the successful requests, ms.
    pub p50_ms: f64,
    /// 99th percentile latency of the successful requests, ms.
    pub p99_ms: f64,
    /// Highest latency of the successful requests, ms.
    pub max_ms: f64,
    /// Successful requests by backend.
    pub by_backend: BTreeMap<String, u64>,
}

/// Why the generator cannot run.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The spec cannot be run.
    #[error("invalid load spec: {0}")]
    Spec(String),
    /// The runtime could not be built, or the run's thread died.
    #[error("load generator runtime: {0}")]
    Runtime(String),
}

/// The nearest-rank quantile `q` of `sorted` (ascending); 0 when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises `outcomes`.
pub fn summarize<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>) -> Summary {
    let mut s = Summary::default();
    let mut lat = Vec::new();
    for o in outcomes {
        s.requests += 1;
        s.retried += u64::from(o.retried);
        match o.failure {
            None => {
                s.ok += 1;
                lat.push(o.latency_ms);
                if let Some(b) = &o.backend {
                    *s.by_backend.entry(b.clone()).or_default() += 1;
                }
            }
            Some(f) => {
                s.errors += 1;
                *s.errors_by_kind.entry(f.to_string()).or_default() += 1;
            }
        }
    }
    lat.sort_by(f64::total_cmp);
    s.p50_ms = quantile(&lat, 0.5);
    s.p99_ms = quantile(&lat, 0.99);
    s.max_ms = lat.last().copied().unwrap_or(0.0);
    s
}

impl LoadRun {
    /// The outcomes due within `[from, to)` seconds of the start.
    pub fn window(&self, from: f64, to: f64) -> impl Iterator<Item = &Outcome> {
        self.outcomes
            .iter()
            .filter(move |o| o.at >= from && o.at < to)
    }
}

impl LoadSpec {
    fn validate(&self) -> Result<(), LoadError> {
        let bad = |why: &str| Err(LoadError::Spec(why.to_string()));
        let rate_ok = |r: f64| r.is_finite() && r > 0.0;
        match self.mode {
            Mode::Open { rate } if !rate_ok(rate) => return bad("rate must be a positive number"),
            Mode::Surge {
                at_secs,
                surge_rate,
                surge_secs,
                rate,
            } if !(rate_ok(surge_rate)
                && rate_ok(rate)
                && surge_secs.is_finite()
                && surge_secs >= 0.0
                && at_secs.is_finite()
                && at_secs >= 0.0) =>
            {
                return bad("surge: rates must be positive numbers and the length at least 0")
            }
            Mode::Closed { concurrency: 0 } => return bad("concurrency must be at least 1"),
            _ => {}
        }
        if self.duration.is_zero() || self.timeout.is_zero() || self.max_outstanding == 0 {
            return bad("duration, timeout and max_outstanding must be above 0");
        }
        if !self.path.starts_with('/') || self.path.chars().any(|c| c.is_ascii_control()) {
            return bad("path must start with / and hold no control characters");
        }
        Ok(())
    }
}

/// Runs `spec` to its end: the last request is due before `duration` and each is
/// bounded by `timeout`, so the run takes at most about their sum.
pub async fn run(spec: LoadSpec) -> Result<LoadRun, LoadError> {
    spec.validate()?;
    // HTTP/1.1: the connection stays open unless a side says `Connection: close`.
    let request: Arc<[u8]> = format!("GET {} HTTP/1.1\r\nHost: ballast-lab\r\n\r\n", spec.path)
        .into_bytes()
        .into();
    let pool = Arc::new(Pool::new(spec.target));
    let started = Instant::now();
    let mut outcomes = match spec.mode {
        Mode::Open { .. } | Mode::Surge { .. } => open_loop(&spec, &pool, started, request).await,
        Mode::Closed { concurrency } => {
            closed_loop(&spec, &pool, concurrency, started, request).await
        }
    };
    outcomes.sort_by(|a, b| a.at.total_cmp(&b.at));
    Ok(LoadRun {
        started,
        outcomes,
        connections: pool.stats(),
    })
}

async fn open_loop(
    spec: &LoadSpec,
    pool: &Arc<Pool>,
    started: Instant,
    req: Arc<[u8]>,
) -> Vec<Outcome> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut outcomes = Vec::new();
    let outstanding = Arc::new(AtomicU64::new(0));
    for i in 0..spec.max_requests {
        let Some(due) = spec.mode.due(i) else { break };
        if due >= spec.duration.as_secs_f64() {
            break;
        }
        let due = Duration::from_secs_f64(due);
        tokio::time::sleep_until((started + due).into()).await;
        // Collect what has finished, so memory stays bounded by what is outstanding.
        while let Some(done) = tasks.try_join_next() {
            if let Ok(o) = done {
                outcomes.push(o);
            }
        }
        if outstanding.load(Ordering::SeqCst) >= spec.max_outstanding as u64 {
            outcomes.push(Outcome {
                at: due.as_secs_f64(),
                latency_ms: 0.0,
                backend: None,
                failure: Some(Failure::Overflow),
                retried: false,
            });
            continue;
        }
        outstanding.fetch_add(1, Ordering::SeqCst);
        let (timeout, req, outstanding, pool) =
            (spec.timeout, req.clone(), outstanding.clone(), pool.clone());
        tasks.spawn(async move {
            let due_at = started + due;
            let result = exchange_within(&pool, &req, timeout).await;
            outstanding.fetch_sub(1, Ordering::SeqCst);
            outcome(due_at, started, result)
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Ok(o) = done {
            outcomes.push(o);
        }
    }
    outcomes
}

async fn closed_loop(
    spec: &LoadSpec,
    pool: &Arc<Pool>,
    concurrency: usize,
    started: Instant,
    req: Arc<[u8]>,
) -> Vec<Outcome> {
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (sent, req, pool) = (sent.clone(), req.clone(), pool.clone());
        let (timeout, duration, max) = (spec.timeout, spec.duration, spec.max_requests);
        tasks.spawn(async move {
            let mut out = Vec::new();
            while started.elapsed() < duration && sent.fetch_add(1, Ordering::SeqCst) < max {
                let due_at = Instant::now();
                let result = exchange_within(&pool, &req, timeout).await;
                out.push(outcome(due_at, started, result));
            }
            out
        });
    }
    let mut outcomes = Vec::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok(o) = done {
            outcomes.extend(o);
        }
    }
    outcomes
}

/// What one request came to: the serving backend's name or why it failed, and whether
/// it was sent a second time.
type Exchanged = (Result<String, Failure>, bool);

fn outcome(due_at: Instant, started: Instant, (result, retried): Exchanged) -> Outcome {
    let (backend, failure) = match result {
        Ok(b) => (Some(b), None),
        Err(f) => (None, Some(f)),
    };
    Outcome {
        at: due_at.saturating_duration_since(started).as_secs_f64(),
        latency_ms: due_at.elapsed().as_secs_f64() * 1000.0,
        backend,
        failure,
        retried,
    }
}

/// Connection counts shared by a pool and its connections.
#[derive(Default)]
struct Counters {
    open: AtomicU64,
    opened: AtomicU64,
    max_open: AtomicU64,
}

/// One keep-alive connection and what it has read.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    counters: Arc<Counters>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Conn {
    /// Whether the peer has neither closed the connection nor sent anything unasked:
    /// an idle HTTP/1.1 connection has nothing to read.
    fn still_open(&self) -> bool {
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// Reads more of the answer. `Ok(0)` is the end of the stream.
    async fn fill(&mut self) -> Result<usize, Broken> {
        if self.buf.len() >= MAX_RESPONSE {
            return Err(Broken::after(Failure::Malformed));
        }
        let mut chunk = [0u8; 4096];
        let n = self
            .stream
            .read(&mut chunk)
            .await
            .map_err(|_| Broken::io(&self.buf))?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads until `buf` holds at least `len` bytes.
    async fn fill_to(&mut self, len: usize) -> Result<(), Broken> {
        while self.buf.len() < len {
            if self.fill().await? == 0 {
                return Err(Broken::io(&self.buf));
            }
        }
        Ok(())
    }

    /// Reads until `needle` appears at or after `from`; returns where it starts.
    async fn fill_until(&mut self, from: usize, needle: &[u8]) -> Result<usize, Broken> {
        loop {
            if let Some(p) = find(&self.buf[from.min(self.buf.len())..], needle) {
                return Ok(from + p);
            }
            if self.fill().await? == 0 {
                return Err(Broken::io(&self.buf));
            }
        }
    }
}

/// The connections of one run: idle ones kept most recently used first, so that a
/// steady load keeps reusing the same few and the rest age out.
struct Pool {
    target: SocketAddr,
    idle: Mutex<Vec<(Conn, Instant)>>,
    counters: Arc<Counters>,
}

impl Pool {
    fn new(target: SocketAddr) -> Pool {
        Pool {
            target,
            idle: Mutex::new(Vec::new()),
            counters: Arc::new(Counters::default()),
        }
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            opened: self.counters.opened.load(Ordering::SeqCst),
            max_open: self.counters.max_open.load(Ordering::SeqCst),
        }
    }

    /// The most recently used idle connection that is still usable; older or closed
    /// ones met on the way are dropped.
    fn take_idle(&self) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((conn, since)) = idle.pop() {
            if since.elapsed() < IDLE_TIMEOUT && conn.still_open() {
                return Some(conn);
            }
        }
        None
    }

    fn put(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.push((conn, Instant::now()));
    }

    async fn connect(&self) -> Result<Conn, Failure> {
        let stream = TcpStream::connect(self.target)
            .await
            .map_err(|_| Failure::Connect)?;
        let _ = stream.set_nodelay(true);
        let c = &self.counters;
        let open = c.open.fetch_add(1, Ordering::SeqCst) + 1;
        c.opened.fetch_add(1, Ordering::SeqCst);
        c.max_open.fetch_max(open, Ordering::SeqCst);
        Ok(Conn {
            stream,
            buf: Vec::new(),
            counters: c.clone(),
        })
    }
}

/// A failed exchange on one connection, and whether the failure came before any byte
/// of the answer: then a request sent on a reused connection may be sent again.
#[derive(Debug, PartialEq)]
struct Broken {
    failure: Failure,
    before_answer: bool,
}

impl Broken {
    fn io(read: &[u8]) -> Broken {
        Broken {
            failure: Failure::Io,
            before_answer: read.is_empty(),
        }
    }

    fn after(failure: Failure) -> Broken {
        Broken {
            failure,
            before_answer: false,
        }
    }
}

/// [`exchange`] bounded by `timeout`, retry included.
async fn exchange_within(pool: &Pool, req: &[u8], timeout: Duration) -> Exchanged {
    tokio::time::timeout(timeout, exchange(pool, req))
        .await
        .unwrap_or((Err(Failure::Timeout), false))
}

/// One request over a pooled connection, or a new one when none is idle; sent again
/// once on a new connection when the pooled one had been closed before answering.
async fn exchange(pool: &Pool, req: &[u8]) -> Exchanged {
    if let Some(conn) = pool.take_idle() {
        match roundtrip(pool, conn, req).await {
            Ok(backend) => return (Ok(backend), false),
            Err(b) if b.before_answer => {}
            Err(b) => return (Err(b.failure), false),
        }
        return (fresh(pool, req).await, true);
    }
    (fresh(pool, req).await, false)
}

async fn fresh(pool: &Pool, req: &[u8]) -> Result<String, Failure> {
    let conn = pool.connect().await?;
    roundtrip(pool, conn, req).await.map_err(|b| b.failure)
}

/// Sends `req` on `conn` and reads the whole answer; the connection goes back to the
/// pool when the answer was complete and neither side asked to close it.
async fn roundtrip(pool: &Pool, mut conn: Conn, req: &[u8]) -> Result<String, Broken> {
    conn.buf.clear();
    conn.stream
        .write_all(req)
        .await
        .map_err(|_| Broken::io(&[]))?;
    let answer = read_answer(&mut conn).await?;
    if answer.code != 200 {
        return Err(Broken::after(Failure::Status(answer.code)));
    }
    if answer.keep {
        pool.put(conn);
    }
    Ok(answer.backend)
}

/// How the body of an answer is delimited.
#[derive(Debug, Clone, Copy, PartialEq)]
enum BodyLength {
    /// `Content-Length` bytes (0 for answers that have no body).
    Fixed(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Neither: the body ends with the connection.
    ToEof,
}

/// The head of an answer.
#[derive(Debug, Clone, PartialEq)]
struct Head {
    code: u16,
    /// `X-Backend`, empty when absent.
    backend: String,
    length: BodyLength,
    /// The server keeps the connection open after this answer.
    keep_alive: bool,
}

/// What a whole answer came to.
struct Answer {
    code: u16,
    backend: String,
    /// The connection can carry another request.
    keep: bool,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Parses the status line and headers of an HTTP/1.x answer (`head` ends with the
/// blank line).
fn parse_head(head: &[u8]) -> Result<Head, Failure> {
    let text = std::str::from_utf8(head).map_err(|_| Failure::Malformed)?;
    let mut lines = text.split("\r\n");
    let status = lines.next().unwrap_or("");
    let mut parts = status.split_whitespace();
    let (version, code) = match (parts.next(), parts.next()) {
        (Some(v), Some(c)) if v.starts_with("HTTP/1.") => {
            (v, c.parse::<u16>().map_err(|_| Failure::Malformed)?)
        }
        _ => return Err(Failure::Malformed),
    };
    let mut backend = String::new();
    let mut length = None;
    let mut chunked = false;
    // HTTP/1.1 keeps the connection by default, HTTP/1.0 closes it.
    let mut keep_alive = version == "HTTP/1.1";
    for line in lines.filter(|l| !l.is_empty()) {
        let (k, v) = line.split_once(':').ok_or(Failure::Malformed)?;
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("x-backend") {
            backend = v.to_string();
        } else if k.eq_ignore_ascii_case("content-length") {
            length = Some(v.parse::<usize>().map_err(|_| Failure::Malformed)?);
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v
                .rsplit(',')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("chunked"));
        } else if k.eq_ignore_ascii_case("connection") {
            for token in v.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }
    let length = if (100..200).contains(&code) || code == 204 || code == 304 {
        BodyLength::Fixed(0)
    } else if chunked {
        BodyLength::Chunked
    } else {
        length.map_or(BodyLength::ToEof, BodyLength::Fixed)
    };
    Ok(Head {
        code,
        backend,
        length,
        keep_alive,
    })
}

/// Reads one whole answer from `conn`.
async fn read_answer(conn: &mut Conn) -> Result<Answer, Broken> {
    let head_end = conn.fill_until(0, b"\r\n\r\n").await? + 4;
    let head = parse_head(&conn.buf[..head_end]).map_err(Broken::after)?;
    let end = match head.length {
        BodyLength::Fixed(n) => {
            conn.fill_to(head_end + n).await?;
            Some(head_end + n)
        }
        BodyLength::Chunked => Some(read_chunks(conn, head_end).await?),
        BodyLength::ToEof => {
            while conn.fill().await? > 0 {}
            None
        }
    };
    // Anything past the answer was not asked for: the connection is not trusted again.
    let keep = head.keep_alive && end == Some(conn.buf.len());
    Ok(Answer {
        code: head.code,
        backend: head.backend,
        keep,
    })
}

/// Reads a chunked body starting at `pos`; returns where the answer ends.
async fn read_chunks(conn: &mut Conn, mut pos: usize) -> Result<usize, Broken> {
    let malformed = || Broken::after(Failure::Malformed);
    loop {
        let line_end = conn.fill_until(pos, b"\r\n").await?;
        let size = std::str::from_utf8(&conn.buf[pos..line_end])
            .ok()
            .and_then(|l| l.split(';').next())
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .ok_or_else(malformed)?;
        pos = line_end + 2;
        if size == 0 {
            // Trailer fields, if any, up to an empty line.
            loop {
                let end = conn.fill_until(pos, b"\r\n").await?;
                if end == pos {
                    return Ok(pos + 2);
                }
                pos = end + 2;
            }
        }
        let data_end = pos.checked_add(size).ok_or_else(malformed)?;
        conn.fill_to(data_end + 2).await?;
        if &conn.buf[data_end..data_end + 2] != b"\r\n" {
            return Err(malformed());
        }
        pos = data_end + 2;
    }
}

/// A run on its own thread and runtime, so the caller can act while the load runs.
pub struct LoadHandle {
    started: Instant,
    thread: std::thread::JoinHandle<Result<LoadRun, LoadError>>,
}

impl LoadHandle {
    /// Roughly when the run started (just before its first request was due).
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Waits for the run to end.
    pub fn join(self) -> Result<LoadRun, LoadError> {
        self.thread
            .join()
            .map_err(|_| LoadError::Runtime("the load thread panicked".into()))?
    }
}

/// Starts `spec` on a new thread with a two-worker runtime.
pub fn spawn(spec: LoadSpec) -> Result<LoadHandle, LoadError> {
    spec.validate()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lab-load")
        .enable_all()
        .build()
        .map_err(|e| LoadError::Runtime(e.to_string()))?;
    let started = Instant::now();
    let thread = std::thread::Builder::new()
        .name("lab-load".into())
        .spawn(move || rt.block_on(run(spec)))
        .map_err(|e| LoadError::Runtime(e.to_string()))?;
    Ok(LoadHandle { started, thread })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Head, Failure> {
        parse_head(text.as_bytes())
    }

    #[test]
    fn parses_heads() {
        let ok =
            head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\nx-backend: b-1\r\n\r\n").expect("parses");
        assert_eq!(
            ok,
            Head {
                code: 200,
                backend: "b-1".into(),
                length: BodyLength::Fixed(3),
                keep_alive: true
            }
        );
        let busy =
            head("HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\n").expect("parses");
        assert_eq!((busy.code, busy.keep_alive), (503, false));
        assert_eq!(busy.length, BodyLength::ToEof);
        let old = head("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").expect("parses");
        assert!(!old.keep_alive, "HTTP/1.0 closes unless asked otherwise");
        let chunked =
            head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n").expect("parses");
        assert_eq!(chunked.length, BodyLength::Chunked);
        assert_eq!(
            head("HTTP/1.1 204 No Content\r\n\r\n").map(|h| h.length),
            Ok(BodyLength::Fixed(0))
        );
        assert_eq!(head("garbage\r\n\r\n"), Err(Failure::Malformed));
        assert_eq!(head("SSH-2.0\r\n\r\n"), Err(Failure::Malformed));
        assert_eq!(
            head("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"),
            Err(Failure::Malformed)
        );
    }

    #[test]
    fn surge_then_rate() {
        let m = Mode::Surge {
            at_secs: 0.0,
            surge_rate: 10.0,
            surge_secs: 1.0,
            rate: 2.0,
        };
        let due: Vec<f64> = (0..13).filter_map(|i| m.due(i)).collect();
        assert_eq!(due[9], 0.9);
        assert_eq!(due[10], 1.0, "the first request at the plain rate");
        assert_eq!(due[11], 1.5);
        // A surge part way: 2/s for 1 s, 10/s for 1 s, 2/s again.
        let m = Mode::Surge {
            at_secs: 1.0,
            surge_rate: 10.0,
            surge_secs: 1.0,
            rate: 2.0,
        };
        let due: Vec<f64> = (0..15).filter_map(|i| m.due(i)).collect();
        assert_eq!((due[1], due[2], due[11]), (0.5, 1.0, 1.9));
        assert_eq!((due[12], due[13]), (2.0, 2.5));
        assert_eq!(Mode::Open { rate: 4.0 }.due(2), Some(0.5));
        assert_eq!(Mode::Closed { concurrency: 1 }.due(0), None);
    }

    #[test]
    fn summarises_latency_errors_and_backends() {
        let o = |at: f64, ms: f64, b: &str, f: Option<Failure>| Outcome {
            at,
            latency_ms: ms,
            backend: (!b.is_empty()).then(|| b.to_string()),
            failure: f,
            retried: b == "b",
        };
        let run = LoadRun {
            started: Instant::now(),
            outcomes: vec![
                o(0.0, 10.0, "a", None),
                o(0.5, 30.0, "b", None),
                o(1.0, 20.0, "a", None),
                o(1.5, 0.0, "", Some(Failure::Status(503))),
            ],
            connections: PoolStats::default(),
        };
        let s = summarize(&run.outcomes);
        assert_eq!((s.requests, s.ok, s.errors, s.retried), (4, 3, 1, 1));
        assert_eq!(s.p50_ms, 20.0);
        assert_eq!(s.p99_ms, 30.0);
        assert_eq!(s.by_backend["a"], 2);
        assert_eq!(s.errors_by_kind["status 503"], 1);
        let early = summarize(run.window(0.0, 1.0));
        assert_eq!(early.requests, 2);
    }

    #[test]
    fn rejects_unbounded_or_empty_specs() {
        let spec = LoadSpec {
            target: "127.0.0.1:1".parse().expect("address"),
            path: "/work".into(),
            mode: Mode::Open { rate: 0.0 },
            duration: Duration::from_secs(1),
            max_requests: 10,
            timeout: Duration::from_secs(1),
            max_outstanding: 10,
        };
        assert!(spec.validate().is_err());
        let spec = LoadSpec {
            mode: Mode::Closed { concurrency: 0 },
            ..spec
        };
        assert!(spec.validate().is_err());
        let spec = LoadSpec {
            mode: Mode::Surge {
                at_secs: 0.0,
                surge_rate: 10.0,
                surge_secs: f64::NAN,
                rate: 1.0,
            },
            ..spec
        };
        assert!(spec.validate().is_err());
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A real loopback server: every request answered, at the rate asked, none early,
    /// over a few reused connections rather than one per request.
    #[test]
    fn open_loop_keeps_its_rate_over_reused_connections() {
        let run = runtime().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let target = listener.local_addr().expect("address");
            let cfg = crate::backend::BackendConfig {
                name: "t-1".into(),
                rounds: 10,
                stall_ms: 0,
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                crate::backend::serve(listener, &cfg, async {
                    let _ = stopped.await;
                })
                .await
            });
            let run = run(LoadSpec {
                target,
                path: "/work".into(),
                mode: Mode::Open { rate: 200.0 },
                duration: Duration::from_secs(1),
                max_requests: 150,
                timeout: Duration::from_secs(5),
                max_outstanding: 100,
            })
            .await
            .expect("run");
            let _ = stop.send(());
            let _ = server.await;
            run
        });
        let s = summarize(&run.outcomes);
        assert_eq!(s.requests, 150, "bounded by max_requests");
        assert_eq!(s.errors, 0, "{:?}", s.errors_by_kind);
        assert_eq!(s.by_backend["t-1"], 150);
        let last = run.outcomes.last().map_or(0.0, |o| o.at);
        assert!(
            (last - 149.0 / 200.0).abs() < 1e-6,
            "paced at the rate: {last}"
        );
        assert!(
            run.connections.opened < 30,
            "keep-alive: {:?} for 150 requests",
            run.connections
        );
    }

    /// A scripted server: a chunked answer and a sized one on the first connection,
    /// which the server then closes; the third request finds the pooled connection
    /// closed and is answered on a second one.
    #[test]
    fn reuses_connections_and_survives_a_server_closing_one() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let answers: [&[u8]; 3] = [
            b"HTTP/1.1 200 OK\r\nX-Backend: c\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX-Backend: d\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nX-Backend: e\r\nContent-Length: 0\r\n\r\n",
        ];
        let (results, stats) = runtime().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let target = listener.local_addr().expect("address");
            let server = tokio::spawn(async move {
                let mut next = 0;
                // The first connection gets two answers and is closed; the next, one.
                for per_conn in [2, 1] {
                    let (mut s, _) = listener.accept().await.expect("accept");
                    for _ in 0..per_conn {
                        let mut req = Vec::new();
                        while find(&req, b"\r\n\r\n").is_none() {
                            let mut b = [0u8; 256];
                            let n = s.read(&mut b).await.expect("read");
                            assert!(n > 0, "client closed early");
                            req.extend_from_slice(&b[..n]);
                        }
                        s.write_all(answers[next]).await.expect("write");
                        next += 1;
                    }
                }
            });
            let pool = Pool::new(target);
            let req = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n";
            let mut results = Vec::new();
            for _ in 0..3 {
                results.push(exchange_within(&pool, req, Duration::from_secs(5)).await.0);
                // Let the server's close reach the client.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            server.await.expect("server");
            (results, pool.stats())
        });
        assert_eq!(
            results,
            vec![
                Ok("c".to_string()),
                Ok("d".to_string()),
                Ok("e".to_string())
            ]
        );
        assert_eq!(stats.opened, 2, "{stats:?}");
    }
}
