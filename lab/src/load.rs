//! An open-loop HTTP load generator, bounded in time and in requests.
//!
//! In open-loop mode request `i` leaves at `start + i / rate` whatever happened to the
//! earlier ones, and its latency counts from that scheduled moment, so a generator that
//! falls behind is charged to the latency instead of hiding it (coordinated omission).
//! Closed-loop mode (`concurrency` clients, each waiting for its answer before sending
//! again) is only for calibration: it finds what a backend sustains.
//!
//! Every request is its own HTTP/1.1 connection with `Connection: close`: the cost is a
//! loopback handshake, and nothing about one request (a dead pooled connection) can
//! fail another.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The largest response read; the lab's answers are a few dozen bytes.
const MAX_RESPONSE: u64 = 64 * 1024;

/// How requests are paced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Mode {
    /// A fixed rate, in requests per second, independent of the answers.
    Open {
        /// Requests per second.
        rate: f64,
    },
    /// `concurrency` clients, each sending its next request when the last is answered.
    Closed {
        /// Clients.
        concurrency: usize,
    },
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
    /// Open loop: requests in flight at most; one due while this many are outstanding
    /// is not sent and counts as [`Failure::Overflow`], so a dead target cannot make the
    /// generator pile up sockets without bound.
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
    /// The `X-Backend` header of the answer.
    pub backend: Option<String>,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
}

/// Every request of a run, in the order they were due.
#[derive(Debug, Clone)]
pub struct LoadRun {
    /// When the run started: outcomes' `at` count from here.
    pub started: Instant,
    /// One per request.
    pub outcomes: Vec<Outcome>,
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
        match self.mode {
            Mode::Open { rate } if !(rate.is_finite() && rate > 0.0) => {
                return bad("rate must be a positive number")
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
    let request = Arc::new(format!(
        "GET {} HTTP/1.1\r\nHost: ballast-lab\r\nConnection: close\r\n\r\n",
        spec.path
    ));
    let started = Instant::now();
    let mut outcomes = match spec.mode {
        Mode::Open { rate } => open_loop(&spec, rate, started, request).await,
        Mode::Closed { concurrency } => closed_loop(&spec, concurrency, started, request).await,
    };
    outcomes.sort_by(|a, b| a.at.total_cmp(&b.at));
    Ok(LoadRun { started, outcomes })
}

async fn open_loop(spec: &LoadSpec, rate: f64, started: Instant, req: Arc<String>) -> Vec<Outcome> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut outcomes = Vec::new();
    let outstanding = Arc::new(AtomicU64::new(0));
    for i in 0..spec.max_requests {
        let due = Duration::from_secs_f64(i as f64 / rate);
        if due >= spec.duration {
            break;
        }
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
            });
            continue;
        }
        outstanding.fetch_add(1, Ordering::SeqCst);
        let (target, timeout, req, outstanding) =
            (spec.target, spec.timeout, req.clone(), outstanding.clone());
        tasks.spawn(async move {
            let due_at = started + due;
            let result = request(target, &req, timeout).await;
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
    concurrency: usize,
    started: Instant,
    req: Arc<String>,
) -> Vec<Outcome> {
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (sent, req) = (sent.clone(), req.clone());
        let (target, timeout, duration, max) =
            (spec.target, spec.timeout, spec.duration, spec.max_requests);
        tasks.spawn(async move {
            let mut out = Vec::new();
            while started.elapsed() < duration && sent.fetch_add(1, Ordering::SeqCst) < max {
                let due_at = Instant::now();
                let result = request(target, &req, timeout).await;
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

fn outcome(due_at: Instant, started: Instant, result: Result<String, Failure>) -> Outcome {
    let (backend, failure) = match result {
        Ok(b) => (Some(b), None),
        Err(f) => (None, Some(f)),
    };
    Outcome {
        at: due_at.saturating_duration_since(started).as_secs_f64(),
        latency_ms: due_at.elapsed().as_secs_f64() * 1000.0,
        backend,
        failure,
    }
}

/// One request on its own connection; the answer's `X-Backend`, or why it failed.
async fn request(target: SocketAddr, req: &str, timeout: Duration) -> Result<String, Failure> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(target)
            .await
            .map_err(|_| Failure::Connect)?;
        let _ = s.set_nodelay(true);
        s.write_all(req.as_bytes()).await.map_err(|_| Failure::Io)?;
        let mut buf = Vec::new();
        (&mut s)
            .take(MAX_RESPONSE)
            .read_to_end(&mut buf)
            .await
            .map_err(|_| Failure::Io)?;
        parse_response(&buf)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(Failure::Timeout))
}

/// The status and `X-Backend` of a whole HTTP/1.x response.
fn parse_response(buf: &[u8]) -> Result<String, Failure> {
    if buf.is_empty() {
        return Err(Failure::Io);
    }
    let text = String::from_utf8_lossy(buf);
    let (head, _) = text.split_once("\r\n\r\n").ok_or(Failure::Malformed)?;
    let mut lines = head.lines();
    let status = lines.next().unwrap_or("");
    let code: u16 = match status.split_whitespace().collect::<Vec<_>>()[..] {
        [version, code, ..] if version.starts_with("HTTP/1.") => {
            code.parse().map_err(|_| Failure::Malformed)?
        }
        _ => return Err(Failure::Malformed),
    };
    if code != 200 {
        return Err(Failure::Status(code));
    }
    Ok(lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("x-backend"))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default())
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

    #[test]
    fn parses_responses() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nx-backend: b-1\r\n\r\nb-1";
        assert_eq!(parse_response(ok), Ok("b-1".to_string()));
        let busy = b"HTTP/1.1 503 Service Unavailable\r\n\r\n";
        assert_eq!(parse_response(busy), Err(Failure::Status(503)));
        assert_eq!(parse_response(b""), Err(Failure::Io));
        assert_eq!(parse_response(b"garbage"), Err(Failure::Malformed));
        assert_eq!(parse_response(b"SSH-2.0\r\n\r\n"), Err(Failure::Malformed));
    }

    #[test]
    fn summarises_latency_errors_and_backends() {
        let o = |at: f64, ms: f64, b: &str, f: Option<Failure>| Outcome {
            at,
            latency_ms: ms,
            backend: (!b.is_empty()).then(|| b.to_string()),
            failure: f,
        };
        let run = LoadRun {
            started: Instant::now(),
            outcomes: vec![
                o(0.0, 10.0, "a", None),
                o(0.5, 30.0, "b", None),
                o(1.0, 20.0, "a", None),
                o(1.5, 0.0, "", Some(Failure::Status(503))),
            ],
        };
        let s = summarize(&run.outcomes);
        assert_eq!((s.requests, s.ok, s.errors), (4, 3, 1));
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
    }

    /// A real loopback server: every request answered, at the rate asked, none early.
    #[test]
    fn open_loop_keeps_its_rate_against_a_real_server() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let run = rt.block_on(async {
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
    }
}
