//! Prometheus metrics on an optional port (`--metrics ADDR`, off by default).
//!
//! The agent's footprint is held against node_exporter's, so this is a hand-written
//! HTTP/1.0 responder on a tokio listener with hand-formatted text rather than a
//! metrics crate and an HTTP stack: one route, `GET /metrics`; requests are bounded
//! in size, time and number, and anything else gets an error status. Counters and
//! the last sample come from the agent's [`Status`]; the sample-duration histogram
//! and the agent-check replies from its [`Metrics`] counters.

use crate::counters::{AgentCheckReply, Metrics, SAMPLE_BUCKETS};
use crate::shared::{accept, Shared};
use crate::status::Status;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The longest request head accepted; a scraper sends a few hundred bytes.
pub(crate) const MAX_REQUEST: usize = 4096;
/// How long a client has to send its request and read the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed at once, so a flood cannot grow the
/// agent.
pub(crate) const MAX_CONNECTIONS: usize = 8;

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

    let counters: [(&str, &str, u64); 6] = [
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
    ];
    for (name, help, value) in counters {
        family(&mut out, name, "counter", help);
        sample(&mut out, name, value);
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
            status
                .weight_unix_ms
                .map(|at| now_unix_ms.saturating_sub(at) as f64 / 1000.0),
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

async fn answer(stream: &mut tokio::net::TcpStream, shared: &Shared) {
    let head = read_head(stream).await;
    let head_only = head.as_ref().is_ok_and(|h| h.starts_with(b"HEAD "));
    let (status, body) = match head.and_then(|h| route(&h)) {
        Ok(()) => {
            let now = ballast_shared::unix_ms();
            let st = shared.status();
            let safe = shared.stop_verdict(&st, now).safe;
            ("200 OK", render(&shared.metrics, &st, safe, now))
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

/// Serves `GET /metrics` until the task is dropped.
pub(crate) async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    loop {
        let mut stream = accept(&listener).await;
        if shared.metrics.open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            shared.metrics.open.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed at once
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(&mut stream, &shared)).await;
            shared.metrics.open.fetch_sub(1, Ordering::SeqCst);
        });
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
        let text = render(&m, &st, false, 0);
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
}
