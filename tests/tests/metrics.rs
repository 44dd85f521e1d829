//! Scenario: both binaries' Prometheus metrics, scraped over loopback, and JSON logs.
//!
//! - The aggregator's `/metrics` has every family the operations guide lists: reports
//!   accepted and rejected, per-service max/avg, p95/avg and missing share, skipped
//!   cycles, the cycle-duration histogram, feed pushes (xDS, store writes, the HTTP
//!   watch) and NACKs, and config reloads and rejections. An open watch stream shows
//!   in the watch gauge and its events in the watch counter. Run with `--log-json`,
//!   its log lines are JSON objects.
//! - The agent, run with `--metrics` and `--log-json`, serves `GET /metrics` with its
//!   sample-duration histogram, reports sent and failed, connection state, drain state
//!   and last load; malformed, oversized and unknown requests get an error, and it
//!   keeps serving; idle connections, even more of them than it has places for, never
//!   keep a scrape out (the oldest idle one makes room; idle ones are closed after a
//!   short deadline); its log lines are JSON objects.

use ballast_tests::harness::api::{parse_metrics, sum_samples};
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const SERVICE: &str = "scraped";

/// One raw exchange: sends `request`, returns everything the server answers until it
/// closes (at most 1 MiB, 10 s).
fn exchange(addr: SocketAddr, request: &[u8]) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .and_then(|_| s.set_write_timeout(Some(Duration::from_secs(5))))
        .map_err(|e| e.to_string())?;
    // The server may answer and close before an oversized request is all written.
    let _ = s.write_all(request);
    let mut out = Vec::new();
    s.take(1 << 20)
        .read_to_end(&mut out)
        .map_err(|e| format!("read {addr}: {e}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `GET /metrics` from the agent: status line and body.
fn scrape(addr: SocketAddr) -> (String, String) {
    let text = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: agent\r\n\r\n")
        .unwrap_or_else(|e| panic!("scrape: {e}"));
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head: {text:?}"));
    let status = head.lines().next().unwrap_or_default().to_string();
    (status, body.to_string())
}

fn value(text: &str, name: &str) -> f64 {
    sum_samples(&parse_metrics(text), name, &[])
}

/// Asserts that every line of `log` is a JSON object of `tracing`'s JSON format, and
/// that one of them contains `want`.
fn assert_json_log(log: &str, want: &str) {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no log lines");
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
    assert!(
        lines.iter().any(|l| l.contains(want)),
        "no {want:?} in:\n{log}"
    );
}

#[test]
fn aggregator_metrics_have_every_family() {
    let pki = Pki::new();
    let mut opts = AggregatorOpts::default()
        .cycle_ms(300)
        .report_interval_ms(300)
        .grace_ms(300);
    opts.xds = true;
    opts.log_json = true;
    let agg = Aggregator::start(&pki, opts);
    pki.issue_nodes(&["scraped-1", "scraped-2"]);
    let _agents: Vec<Agent> = ["scraped-1", "scraped-2"]
        .iter()
        .map(|n| Agent::start(&pki, &agg, AgentOpts::new(SERVICE, n)))
        .collect();
    // A report that is refused: an identity the certificate does not carry.
    let _impostor = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "scraped-3").tls_dir(pki.node_tls_dir("scraped-1")),
    );
    wait_for(Duration::from_secs(15), "cycles with reports", || {
        let text = agg.metrics();
        let cycles = value(&text, "ballast_cycle_duration_seconds_count");
        let accepted = value(&text, "ballast_reports_accepted_total");
        let rejected = value(&text, "ballast_reports_rejected_total");
        if cycles >= 3.0 && accepted >= 4.0 && rejected >= 1.0 {
            Ok(())
        } else {
            Err(format!(
                "{cycles} cycles, {accepted} accepted, {rejected} rejected"
            ))
        }
    });

    // An open watch stream counts, and so do its events.
    let mut watch = TcpStream::connect(agg.http_addr()).expect("connect for a watch");
    watch
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        watch,
        "GET /v1/services/{SERVICE}/weights?watch=true HTTP/1.1\r\nHost: agg\r\n\r\n"
    )
    .expect("watch request");
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !String::from_utf8_lossy(&seen).contains("event: weights") {
        assert!(Instant::now() < deadline, "no watch event: {seen:?}");
        let mut buf = [0u8; 4096];
        let n = watch.read(&mut buf).expect("read the watch stream");
        assert!(n > 0, "the watch stream ended: {seen:?}");
        seen.extend_from_slice(&buf[..n]);
    }
    let text = agg.metrics();
    let samples = parse_metrics(&text);
    assert_eq!(
        sum_samples(&samples, "ballast_watch_streams", &[]),
        1.0,
        "{text}"
    );
    assert!(
        sum_samples(
            &samples,
            "ballast_watch_events_total",
            &[("service", SERVICE)]
        ) >= 1.0,
        "{text}"
    );

    for family in [
        "ballast_reports_accepted",
        "ballast_reports_rejected",
        "ballast_service_max_over_avg",
        "ballast_service_p95_over_avg",
        "ballast_service_missing_share",
        "ballast_cycles_skipped",
        "ballast_cycle_duration_seconds",
        "ballast_store_writes",
        "ballast_xds_pushes",
        "ballast_xds_nacks",
        "ballast_xds_streams",
        "ballast_watch_events",
        "ballast_watch_streams",
        "ballast_config_reloads",
        "ballast_config_rejected",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("# TYPE {family} "))),
            "no {family} family in /metrics:\n{text}"
        );
    }
    assert!(
        text.contains("# TYPE ballast_cycle_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        sum_samples(&samples, "ballast_store_writes_total", &[]) >= 1.0,
        "{text}"
    );
    for gauge in [
        "ballast_service_max_over_avg",
        "ballast_service_p95_over_avg",
        "ballast_service_missing_share",
    ] {
        assert!(
            samples
                .iter()
                .any(|s| s.name == gauge
                    && s.labels.get("service").map(String::as_str) == Some(SERVICE)),
            "no {gauge} for {SERVICE}:\n{text}"
        );
    }

    assert_json_log(&agg.log_tail(50), "agent connected");
    drop(watch);
    wait_for(
        Duration::from_secs(10),
        "the closed watch to leave the gauge",
        || {
            let v = agg.counter("ballast_watch_streams", &[]);
            if v == 0.0 {
                Ok(())
            } else {
                Err(format!("{v} open"))
            }
        },
    );
}

#[test]
fn agent_serves_metrics_and_survives_bad_requests() {
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .cycle_ms(300)
            .report_interval_ms(300)
            .grace_ms(300),
    );
    pki.issue_nodes(&["metered"]);
    let addr = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
    let mut opts = AgentOpts::new(SERVICE, "metered").metrics(addr);
    opts.log_json = true;
    let mut agent = Agent::start(&pki, &agg, opts);
    agent.wait_weight(Duration::from_secs(15));

    let body = wait_for(
        Duration::from_secs(10),
        "a few reports in the metrics",
        || {
            let (status, body) = scrape(addr);
            if status != "HTTP/1.0 200 OK" {
                return Err(status);
            }
            if value(&body, "ballast_agent_reports_sent_total") >= 3.0
                && value(&body, "ballast_agent_weight") > 0.0
            {
                Ok(body)
            } else {
                Err(body)
            }
        },
    );
    for family in [
        ("ballast_agent_sample_duration_seconds", "histogram"),
        ("ballast_agent_reports_sent_total", "counter"),
        ("ballast_agent_reports_failed_total", "counter"),
        ("ballast_agent_connect_failures_total", "counter"),
        ("ballast_agent_reconnects_total", "counter"),
        ("ballast_agent_agentcheck_replies_total", "counter"),
        ("ballast_agent_connected", "gauge"),
        ("ballast_agent_draining", "gauge"),
        ("ballast_agent_drain_acknowledged", "gauge"),
        ("ballast_agent_safe_to_stop", "gauge"),
        ("ballast_agent_load", "gauge"),
        ("ballast_agent_weight", "gauge"),
    ] {
        let line = format!("# TYPE {} {}", family.0, family.1);
        assert!(body.lines().any(|l| l == line), "no {line:?}:\n{body}");
    }
    assert_eq!(value(&body, "ballast_agent_connected"), 1.0, "{body}");
    assert_eq!(value(&body, "ballast_agent_draining"), 0.0, "{body}");
    assert!(value(&body, "ballast_agent_load") > 0.0, "{body}");
    let samples = value(&body, "ballast_agent_sample_duration_seconds_count");
    assert!(samples >= 3.0, "{body}");
    assert_eq!(
        sum_samples(
            &parse_metrics(&body),
            "ballast_agent_sample_duration_seconds_bucket",
            &[("le", "+Inf")]
        ),
        samples
    );

    // The drain shows.
    agent.drain();
    wait_for(Duration::from_secs(10), "the drain in the metrics", || {
        let (_, body) = scrape(addr);
        if value(&body, "ballast_agent_draining") == 1.0
            && value(&body, "ballast_agent_drain_acknowledged") == 1.0
        {
            Ok(())
        } else {
            Err(body)
        }
    });

    // Bad requests get an error status; the agent keeps serving.
    let oversized = format!(
        "GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(8192)
    );
    let cases: [(&[u8], &str); 5] = [
        (b"GET /nope HTTP/1.1\r\n\r\n", "HTTP/1.0 404 Not Found"),
        (
            b"POST /metrics HTTP/1.1\r\n\r\n",
            "HTTP/1.0 405 Method Not Allowed",
        ),
        (
            b"\x16\x03\x01\x02\x00garbage\r\n\r\n",
            "HTTP/1.0 400 Bad Request",
        ),
        (b"GET /metrics\r\n\r\n", "HTTP/1.0 400 Bad Request"),
        (
            oversized.as_bytes(),
            "HTTP/1.0 431 Request Header Fields Too Large",
        ),
    ];
    for (request, want) in cases {
        let got = exchange(addr, request).unwrap_or_else(|e| panic!("{want}: {e}"));
        assert!(got.starts_with(want), "{request:?}: {got:?}");
        assert_eq!(scrape(addr).0, "HTTP/1.0 200 OK", "after {request:?}");
    }
    // Idle connections (they send nothing) cannot keep a scrape out. More of them are
    // held than the agent has places for, and each scrape is answered at its first
    // try: a newcomer takes the place of the oldest idle connection. Every idle one is
    // closed, to make room or after the short deadline for a request.
    const IDLE: usize = 100;
    let mut idle: Vec<TcpStream> = Vec::new();
    for round in 0..2 {
        idle.extend((0..IDLE).map(|_| TcpStream::connect(addr).expect("idle connection")));
        let (status, body) = scrape(addr);
        assert_eq!(status, "HTTP/1.0 200 OK", "round {round}: {body}");
        assert!(
            value(&body, "ballast_agent_reports_sent_total") >= 3.0,
            "{body}"
        );
    }
    wait_for(
        Duration::from_secs(10),
        "the agent to close every idle connection",
        || {
            let open = idle
                .iter()
                .filter(|s| {
                    let _ = s.set_nonblocking(true);
                    let mut byte = [0u8; 1];
                    let mut s: &TcpStream = s;
                    matches!(s.read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                })
                .count();
            if open == 0 {
                Ok(())
            } else {
                Err(format!("{open} still open"))
            }
        },
    );
    drop(idle);
    let (_, body) = scrape(addr);
    let samples = parse_metrics(&body);
    let closed = |reason: &str| {
        sum_samples(
            &samples,
            "ballast_agent_connections_refused_total",
            &[("listener", "metrics"), ("reason", reason)],
        )
    };
    assert!(closed("evicted") >= 1.0, "{body}");
    assert_eq!(
        closed("evicted") + closed("timeout"),
        2.0 * IDLE as f64,
        "each idle connection was closed once, to make room or at its deadline:\n{body}"
    );
    assert_eq!(closed("connections"), 0.0, "{body}");
    assert!(
        agent.is_running(),
        "the agent died:\n{}",
        agent.log_tail(20)
    );

    // Its logs are JSON lines.
    assert_json_log(&agent.log_tail(50), "drain requested");
}
