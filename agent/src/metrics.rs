//! Prometheus metrics on an optional port (`--metrics ADDR`, off by default).
//!
//! The agent's footprint is held against node_exporter's, so this is a hand-written
//! HTTP/1.0 responder on a tokio listener with hand-formatted text rather than a
//! metrics crate and an HTTP stack: one route, `GET /metrics`; requests are bounded
//! in size, time and number, and anything else gets an error status. Counters and
//! the last sample come from the agent's [`Status`]; the sample-duration histogram,
//! the agent-check replies and the refused connections from its [`Metrics`] counters.
//!
//! Idle connections cannot keep a scrape out: a connection has [`HEAD_TIMEOUT`] to
//! send its request, and when all [`MAX_CONNECTIONS`] places are taken a new
//! connection takes the place of the oldest one that has sent nothing yet. Only when
//! every place is busy answering a request is the new connection closed.

use crate::counters::{AgentCheckReply, Metrics, Refused, SAMPLE_BUCKETS};
use crate::shared::{accept, Shared};
use crate::status::Status;
use ballast_shared::tls::live::{Reload, TlsFile};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// The longest request head accepted; a scraper sends a few hundred bytes.
pub(crate) const MAX_REQUEST: usize = 4096;
/// How long a client has, from its connection, to send its request head. A scraper
/// sends it at once; a connection that has not is idle, and is closed after this.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a client has to take the answer.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections open at once. Past it, a new connection closes the oldest idle one
/// (no request yet); if none is idle, the new one is closed. Either way a flood
/// cannot grow the agent.
pub(crate) const MAX_CONNECTIONS: usize = 64;

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{name} {value}");
}

/// The metrics in Prometheus text format (version 0.0.4).
pub(crate) fn render(
    metrics: &Metrics,
    status: &Status,
    safe_to_stop: bool,
    now: Instant,
    now_unix_ms: u64,
) -> String {
    let mut out = String::with_capacity(4096);
    let name = "ballast_agent_sample_duration_seconds";
    family(
        &mut out,
        name,
        "histogram",
        "Time taken by one sample of CPU and in-flight work.",
    );
    let mut cumulative = 0u64;
    for (i, bound) in SAMPLE_BUCKETS.iter().enumerate() {
        cumulative += metrics.sample_buckets[i].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
    }
    cumulative += metrics.sample_buckets[SAMPLE_BUCKETS.len()].load(Ordering::Relaxed);
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
    let sum = metrics.sample_sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
    sample(&mut out, &format!("{name}_sum"), sum);
    sample(&mut out, &format!("{name}_count"), cumulative);

    let name = "ballast_agent_inflight_subsample_seconds_total";
    family(
        &mut out,
        name,
        "counter",
        "Time taken by the in-flight samples between reports (the cost of the means).",
    );
    let sum = metrics.subsample_sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
    sample(&mut out, name, sum);

    let counters: [(&str, &str, u64); 10] = [
        (
            "ballast_agent_inflight_subsamples_total",
            "In-flight samples taken between reports, for the mean count and the ages \
             each report carries.",
            metrics.subsamples.load(Ordering::Relaxed),
        ),
        (
            "ballast_agent_inflight_subsample_failures_total",
            "In-flight samples between reports that failed; the report's mean is over \
             the others.",
            metrics.subsample_failures.load(Ordering::Relaxed),
        ),
        (
            "ballast_agent_reports_sent_total",
            "Reports sent to an aggregator.",
            status.reports_sent,
        ),
        (
            "ballast_agent_reports_failed_total",
            "Reports that could not be sent.",
            status.reports_failed,
        ),
        (
            "ballast_agent_connect_failures_total",
            "Aggregator sessions that failed.",
            status.connect_failures,
        ),
        (
            "ballast_agent_sample_errors_total",
            "Samples that failed; no report was sent for them.",
            status.sample_errors,
        ),
        (
            "ballast_agent_reconnects_total",
            "Sessions established with an aggregator after the first.",
            status.connections.saturating_sub(1),
        ),
        (
            "ballast_agent_rejections_total",
            "Refusals by an aggregator: of the hello, or of the node's certificate.",
            status.rejections,
        ),
        (
            "ballast_agent_certificate_moves_total",
            "Moves to a connection made with a renewed certificate, opened before the \
             old one was closed.",
            status.certificate_moves,
        ),
        (
            "ballast_agent_certificate_move_failures_total",
            "Moves to a connection with a renewed certificate that failed; the old \
             connection stayed.",
            metrics.certificate_move_failures.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in counters {
        family(&mut out, name, "counter", help);
        sample(&mut out, name, value);
    }
    let name = "ballast_agent_tls_reloads_total";
    family(
        &mut out,
        name,
        "counter",
        "Changed TLS files (the certificate and key together, or the CA bundle), by \
         file and result: applied, or why refused.",
    );
    for file in [TlsFile::Certificate, TlsFile::Ca] {
        for result in Reload::ALL {
            let n = metrics.tls_reloads.get(file, result);
            let _ = writeln!(
                out,
                "{name}{{file=\"{}\",result=\"{}\"}} {n}",
                file.label(),
                result.label()
            );
        }
    }
    let name = "ballast_agent_agentcheck_replies_total";
    family(
        &mut out,
        name,
        "counter",
        "HAProxy agent-check answers, by reply.",
    );
    for (reply, label) in [
        (AgentCheckReply::Weight, "weight"),
        (AgentCheckReply::Drain, "drain"),
        (AgentCheckReply::Mean, "mean"),
    ] {
        let n = metrics.agentcheck[reply as usize].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}{{reply=\"{label}\"}} {n}");
    }
    let name = "ballast_agent_connections_refused_total";
    family(
        &mut out,
        name,
        "counter",
        "Connections to the agent's listeners closed without their normal answer, by \
         listener and reason.",
    );
    for why in Refused::ALL {
        let (listener, reason) = why.labels();
        let n = metrics.refusals(why);
        let _ = writeln!(
            out,
            "{name}{{listener=\"{listener}\",reason=\"{reason}\"}} {n}"
        );
    }

    let flag = |b: bool| u8::from(b);
    let gauges: [(&str, &str, Option<f64>); 9] = [
        (
            "ballast_agent_connected",
            "1 while a session with an aggregator is up.",
            Some(f64::from(flag(status.connected_to.is_some()))),
        ),
        (
            "ballast_agent_draining",
            "1 while the node is draining (lame duck).",
            Some(f64::from(flag(status.draining))),
        ),
        (
            "ballast_agent_drain_acknowledged",
            "1 once the aggregator publishes the node as draining.",
            Some(f64::from(flag(status.drain_acknowledged))),
        ),
        (
            "ballast_agent_safe_to_stop",
            "1 when the service can be stopped without losing work.",
            Some(f64::from(flag(safe_to_stop))),
        ),
        (
            "ballast_agent_load",
            "Load of the last report: max of CPU and in-flight share.",
            status.last_load,
        ),
        (
            "ballast_agent_inflight",
            "In-flight count of the last report.",
            status.last_inflight.map(f64::from),
        ),
        (
            "ballast_agent_weight",
            "The weight last received from the aggregator; mean 1.",
            status.weight,
        ),
        (
            "ballast_agent_weight_age_seconds",
            "Seconds since the last weight arrived.",
            status.weight_age(now).map(|age| age.as_secs_f64()),
        ),
        (
            "ballast_agent_certificate_expiry_seconds",
            "Seconds until the node's certificate expires; negative once it has.",
            status
                .certificate_expires_unix_ms
                .map(|at| (at as f64 - now_unix_ms as f64) / 1000.0),
        ),
    ];
    for (name, help, value) in gauges {
        family(&mut out, name, "gauge", help);
        // A value never seen is left out rather than made up.
        if let Some(v) = value {
            sample(&mut out, name, v);
        }
    }
    out
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    BadRequest,
    TooLarge,
    NotFound,
    MethodNotAllowed,
}

impl Refusal {
    pub(crate) fn status_line(self) -> &'static str {
        match self {
            Refusal::BadRequest => "400 Bad Request",
            Refusal::TooLarge => "431 Request Header Fields Too Large",
            Refusal::NotFound => "404 Not Found",
            Refusal::MethodNotAllowed => "405 Method Not Allowed",
        }
    }
}

/// Reads the request line from a head (`GET /metrics HTTP/1.1`) and decides.
pub(crate) fn route(head: &[u8]) -> Result<(), Refusal> {
    let text = std::str::from_utf8(head).map_err(|_| Refusal::BadRequest)?;
    let line = text.lines().next().ok_or(Refusal::BadRequest)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Refusal::BadRequest);
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(Refusal::BadRequest);
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    if path != "/metrics" {
        return Err(Refusal::NotFound);
    }
    if method != "GET" && method != "HEAD" {
        return Err(Refusal::MethodNotAllowed);
    }
    Ok(())
}

/// Reads up to the end of the head; at most [`MAX_REQUEST`] bytes.
async fn read_head(stream: &mut tokio::net::TcpStream) -> Result<Vec<u8>, Refusal> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|_| Refusal::BadRequest)?;
        if n == 0 {
            return Err(Refusal::BadRequest);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(buf);
        }
        if buf.len() > MAX_REQUEST {
            return Err(Refusal::TooLarge);
        }
    }
}

/// Answers a request whose head was read (or failed to be).
async fn answer(
    stream: &mut tokio::net::TcpStream,
    shared: &Shared,
    head: Result<Vec<u8>, Refusal>,
) {
    let head_only = head.as_ref().is_ok_and(|h| h.starts_with(b"HEAD "));
    let (status, body) = match head.and_then(|h| route(&h)) {
        Ok(()) => {
            let now = Instant::now();
            let st = shared.status();
            let safe = shared.stop_verdict(&st, now).safe;
            let body = render(&shared.metrics, &st, safe, now, ballast_shared::unix_ms());
            ("200 OK", body)
        }
        Err(r) => (r.status_line(), format!("{}\n", r.status_line())),
    };
    let mut resp = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        resp.push_str(&body);
    }
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// The open connections, oldest first.
#[derive(Debug, Default)]
struct Table {
    next_id: u64,
    open: VecDeque<Entry>,
}

/// One open connection. `evict` is set while it is idle (no request head yet): the
/// way to close it for a newcomer.
#[derive(Debug)]
struct Entry {
    id: u64,
    evict: Option<oneshot::Sender<()>>,
}

/// The places for connections, at most `max`.
#[derive(Debug)]
struct Slots {
    table: Mutex<Table>,
    max: usize,
}

/// A connection's place; given back when dropped.
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    id: u64,
}

/// A place given to a new connection.
#[derive(Debug)]
struct Admitted {
    slot: Slot,
    /// Fires when a newer connection takes this one's place while it is idle.
    evicted: oneshot::Receiver<()>,
    /// Whether an idle connection was closed to make room.
    closed_idle: bool,
}

impl Slots {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Slots {
            table: Mutex::new(Table::default()),
            max,
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection: a free one, or the oldest idle connection's (that
    /// connection is told to close); `None` when every place is busy answering.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut t = self.table();
        let mut closed_idle = false;
        if t.open.len() >= self.max {
            let oldest_idle = t.open.iter().position(|e| e.evict.is_some())?;
            if let Some(tx) = t.open.remove(oldest_idle).and_then(|e| e.evict) {
                let _ = tx.send(());
            }
            closed_idle = true;
        }
        let id = t.next_id;
        t.next_id = t.next_id.wrapping_add(1);
        let (tx, evicted) = oneshot::channel();
        t.open.push_back(Entry {
            id,
            evict: Some(tx),
        });
        Some(Admitted {
            slot: Slot {
                slots: self.clone(),
                id,
            },
            evicted,
            closed_idle,
        })
    }

    /// How many places are taken.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.table().open.len()
    }
}

impl Slot {
    /// The request head is in: the connection is no longer idle, and keeps its place
    /// until it has been answered.
    fn busy(&self) {
        let mut t = self.slots.table();
        if let Some(e) = t.open.iter_mut().find(|e| e.id == self.id) {
            e.evict = None;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self.slots.table();
        if let Some(i) = t.open.iter().position(|e| e.id == self.id) {
            t.open.remove(i);
        }
    }
}

/// One connection: its head within [`HEAD_TIMEOUT`] (unless a newcomer takes its
/// place first), then its answer within [`WRITE_TIMEOUT`].
async fn connection(mut stream: tokio::net::TcpStream, shared: Arc<Shared>, admitted: Admitted) {
    let Admitted { slot, evicted, .. } = admitted;
    let head = tokio::select! {
        // A head already in wins over an eviction that came with it.
        biased;
        head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)) => match head {
            Ok(head) => head,
            Err(_) => {
                shared.metrics.count_refusal(Refused::MetricsTimeout);
                return;
            }
        },
        // Counted when it was decided.
        _ = evicted => return,
    };
    slot.busy();
    if tokio::time::timeout(WRITE_TIMEOUT, answer(&mut stream, &shared, head))
        .await
        .is_err()
    {
        shared.metrics.count_refusal(Refused::MetricsTimeout);
    }
    drop(slot);
}

/// Serves `GET /metrics` until the task is dropped.
pub(crate) async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    let slots = Slots::new(MAX_CONNECTIONS);
    loop {
        let stream = accept(&listener).await;
        let Some(admitted) = slots.admit() else {
            shared.metrics.count_refusal(Refused::MetricsConnections);
            continue; // dropped: closed at once
        };
        if admitted.closed_idle {
            shared.metrics.count_refusal(Refused::MetricsEvicted);
        }
        tokio::spawn(connection(stream, shared.clone(), admitted));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_only_get_metrics() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Ok(()));
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Ok(()));
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Err(Refusal::NotFound));
        assert_eq!(
            route(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Err(Refusal::MethodNotAllowed)
        );
        for bad in [
            &b"GET /metrics\r\n\r\n"[..],
            b"\xff\xfe\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"\r\n\r\n",
        ] {
            assert_eq!(route(bad), Err(Refusal::BadRequest), "{bad:?}");
        }
    }

    #[test]
    fn renders_every_family_and_the_histogram_cumulatively() {
        let m = Metrics::default();
        m.observe_sample(Duration::from_micros(50));
        m.observe_sample(Duration::from_millis(2));
        m.observe_sample(Duration::from_secs(3));
        m.agentcheck_reply(AgentCheckReply::Drain);
        let st = Status {
            reports_sent: 7,
            connections: 3,
            draining: true,
            last_load: Some(0.25),
            connected_to: Some("agg:7400".into()),
            rejections: 2,
            certificate_expires_unix_ms: Some(86_400_000),
            ..Status::default()
        };
        m.count_refusal(Refused::MetricsEvicted);
        let text = render(&m, &st, false, Instant::now(), 0);
        for line in [
            "ballast_agent_sample_duration_seconds_bucket{le=\"0.0001\"} 1",
            "ballast_agent_sample_duration_seconds_bucket{le=\"0.003\"} 2",
            "ballast_agent_sample_duration_seconds_bucket{le=\"1\"} 2",
            "ballast_agent_sample_duration_seconds_bucket{le=\"+Inf\"} 3",
            "ballast_agent_sample_duration_seconds_count 3",
            "ballast_agent_reports_sent_total 7",
            "ballast_agent_reconnects_total 2",
            "ballast_agent_agentcheck_replies_total{reply=\"drain\"} 1",
            "ballast_agent_connected 1",
            "ballast_agent_draining 1",
            "ballast_agent_safe_to_stop 0",
            "ballast_agent_load 0.25",
            "ballast_agent_rejections_total 2",
            "ballast_agent_certificate_expiry_seconds 86400",
            "ballast_agent_connections_refused_total{listener=\"metrics\",reason=\"evicted\"} 1",
            "ballast_agent_connections_refused_total{listener=\"control\",reason=\"peer\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from:\n{text}"
            );
        }
        assert!(
            !text.lines().any(|l| l.starts_with("ballast_agent_weight ")),
            "no weight yet, so no sample:\n{text}"
        );
    }

    #[test]
    fn the_weight_age_is_read_on_the_monotonic_clock() {
        let now = Instant::now();
        let st = Status {
            weight: Some(1.0),
            // A wall clock set back an hour since the weight arrived.
            weight_unix_ms: Some(ballast_shared::unix_ms() + 3_600_000),
            weight_at: now.checked_sub(Duration::from_secs(2)),
            ..Status::default()
        };
        let text = render(
            &Metrics::default(),
            &st,
            false,
            now,
            ballast_shared::unix_ms(),
        );
        assert!(
            text.lines()
                .any(|l| l == "ballast_agent_weight_age_seconds 2"),
            "{text}"
        );
    }

    #[test]
    fn a_newcomer_takes_the_place_of_the_oldest_idle_connection() {
        let slots = Slots::new(2);
        let mut a = slots.admit().expect("a place");
        let b = slots.admit().expect("a place");
        assert!(!a.closed_idle && !b.closed_idle);
        // Full of idle connections: the next one closes the oldest, a.
        let c = slots.admit().expect("an idle place");
        assert!(c.closed_idle);
        assert_eq!(a.evicted.try_recv(), Ok(()), "a is told to close");
        assert_eq!(slots.open(), 2);
        drop(a); // its task ends: nothing more to give back
        assert_eq!(slots.open(), 2);
        // Both remaining connections sent their request: none idle, so a newcomer is
        // refused until one is answered.
        b.slot.busy();
        c.slot.busy();
        assert!(slots.admit().is_none(), "every place is busy answering");
        drop(b);
        let d = slots.admit().expect("b's place");
        assert!(!d.closed_idle);
        assert_eq!(slots.open(), 2);
    }
}
