//! Scenario: bad bytes from an authenticated client.
//!
//! A raw QUIC client with a valid node certificate sends what no agent would: garbage
//! datagrams, an unknown wire version, an oversized datagram, an oversized hello frame
//! and an invalid hello. Each fault is counted by reason, a connection that keeps
//! sending garbage is closed, a single bad datagram does not cost the connection, and
//! a normal agent on the same aggregator keeps getting weights. The aggregator is
//! alive at the end. Unknown API paths get a JSON 404.

use ballast_shared::wire::{self, Hello, Message, NodeState, RejectReason, Report, WIRE_VERSION};
use ballast_tests::*;
use std::time::Duration;

const SERVICE: &str = "steady";
/// The raw clients register under their own service, so that their silence never
/// counts as missing endpoints of the agents' service.
const RAW_SERVICE: &str = "junk";
/// Datagrams the aggregator tolerates before closing the connection.
const MAX_BAD_DATAGRAMS: usize = 16;
/// QUIC application close code for protocol faults.
const CLOSE_PROTOCOL: u32 = 2;

/// A hello for `node`, at an address of its own: two live endpoints of a service may
/// not share one.
fn hello(node: &str) -> Hello {
    static NEXT_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(9000);
    let port = NEXT_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Hello {
        node: node.to_string(),
        service: RAW_SERVICE.to_string(),
        address: format!("127.0.0.1:{port}"),
        zone: String::new(),
        version: "test".to_string(),
    }
}

fn report(seq: u32) -> Report {
    Report {
        seq,
        cpu: 0.0,
        inflight: 10,
        inflight_mean: 10.0,
        age: None,
        capacity: 100,
        error_rate: None,
        state: NodeState::Serving,
    }
}

fn rejected(agg: &Aggregator, reason: &str) -> f64 {
    agg.counter("ballast_reports_rejected_total", &[("reason", reason)])
}

/// Waits until the `reason` counter reaches `at_least`.
fn wait_rejected(agg: &Aggregator, reason: &str, at_least: f64) {
    wait_for(
        Duration::from_secs(10),
        &format!("ballast_reports_rejected_total{{reason=\"{reason}\"}} ≥ {at_least}"),
        || {
            let n = rejected(agg, reason);
            if n >= at_least {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    );
}

fn assert_protocol_close(conn: &RawConn, what: &str) {
    let reason = conn
        .wait_closed(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the aggregator kept the connection open after {what}"));
    match &reason {
        quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(
            c.error_code,
            quinn::VarInt::from_u32(CLOSE_PROTOCOL),
            "close code after {what}: {reason}"
        ),
        other => panic!("after {what} the connection ended with {other}, not a protocol close"),
    }
}

/// A connection of node `node` that has said hello and been welcomed.
fn welcomed(pki: &Pki, agg: &Aggregator, node: &str) -> (RawClient, RawConn) {
    let client = RawClient::for_node_serving(pki, node, &[RAW_SERVICE]);
    let conn = client
        .connect(agg.quic_addr())
        .unwrap_or_else(|e| panic!("{node}: {e}"));
    match conn.hello(&hello(node)) {
        Ok(Message::Welcome(w)) => assert!(w.interval_ms >= 100, "{w:?}"),
        other => panic!("{node}: expected a welcome, got {other:?}"),
    }
    (client, conn)
}

#[test]
fn protocol_faults_are_counted_and_contained() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(500));
    let agent = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "steady-1"));
    agent.wait_weight(Duration::from_secs(15));
    let before = agent.status();

    // 0. A client that connects and never says hello is closed after the hello
    //    timeout (5 s); checked at the end.
    let idle_client = RawClient::for_node(&pki, "raw-idle");
    let idle = idle_client.connect(agg.quic_addr()).expect("connect");

    // 1. Garbage datagrams after a good hello: each is counted as malformed, and the
    //    connection is closed once there are too many.
    let malformed0 = rejected(&agg, "malformed");
    let closed0 = agg.counter(
        "ballast_connections_rejected_total",
        &[("reason", "malformed")],
    );
    let (_c1, garbage) = welcomed(&pki, &agg, "raw-garbage");
    let valid = wire::encode(&Message::Report(report(1))).expect("encode");
    for i in 0..MAX_BAD_DATAGRAMS + 4 {
        let bytes = match i % 3 {
            // The right version, then a body that is no message.
            0 => vec![WIRE_VERSION, 0xff, 0xfe, 0xfd, i as u8],
            // A valid report with a trailing byte.
            1 => [valid.as_slice(), &[0]].concat(),
            // The right version and nothing else.
            _ => vec![WIRE_VERSION],
        };
        if garbage.send_datagram(&bytes).is_err() {
            break; // already closed
        }
        garbage.pump(Duration::from_millis(10));
    }
    assert_protocol_close(&garbage, "repeated garbage");
    wait_rejected(&agg, "malformed", malformed0 + MAX_BAD_DATAGRAMS as f64);
    let closed = agg.counter(
        "ballast_connections_rejected_total",
        &[("reason", "malformed")],
    );
    assert_eq!(closed, closed0 + 1.0, "connections closed for garbage");

    // 2. One unknown version and one oversized datagram are counted and dropped, and
    //    the connection goes on: a valid report still gets its reply.
    let unknown0 = rejected(&agg, "unknown_version");
    let oversized0 = rejected(&agg, "oversized");
    let (_c2, conn) = welcomed(&pki, &agg, "raw-version");
    let mut future = valid.clone();
    future[0] = 9;
    conn.send_datagram(&future).expect("send");
    wait_rejected(&agg, "unknown_version", unknown0 + 1.0);
    let max = conn.max_datagram_size().expect("datagrams enabled");
    assert!(
        max > wire::MAX_MESSAGE,
        "the path cannot carry an oversized datagram ({max} bytes)"
    );
    let mut big = vec![0u8; wire::MAX_MESSAGE + 76];
    big[0] = WIRE_VERSION;
    conn.send_datagram(&big).expect("send");
    wait_rejected(&agg, "oversized", oversized0 + 1.0);
    assert!(
        conn.close_reason().is_none(),
        "one bad datagram closed the connection: {:?}",
        conn.close_reason()
    );
    let reply = wait_until(Duration::from_secs(10), "a reply to a valid report", || {
        let seq = (unix_ms() % 1_000_000) as u32 + 2;
        let bytes = wire::encode(&Message::Report(report(seq))).expect("encode");
        conn.send_datagram(&bytes).ok()?;
        let answer = conn.recv_datagram(Duration::from_millis(500))?;
        match wire::decode(&answer) {
            Ok(Message::Reply(r)) => Some(r),
            _ => None,
        }
    });
    assert!(
        reply.weight.is_finite() && reply.weight > 0.0 && !reply.draining,
        "{reply:?}"
    );

    // 3. A hello frame longer than the limit: counted as oversized, connection closed.
    let client = RawClient::for_node(&pki, "raw-big");
    let big_hello = client.connect(agg.quic_addr()).expect("connect");
    let len = 2048u16;
    let mut frame = len.to_be_bytes().to_vec();
    frame.extend(vec![0x41; usize::from(len)]);
    big_hello.send_stream_bytes(&frame).expect("send frame");
    assert_protocol_close(&big_hello, "an oversized hello frame");
    wait_rejected(&agg, "oversized", oversized0 + 2.0);

    // 4. A hello of an unknown version, and a hello with an invalid service name: the
    //    first closes the connection, the second gets a reject saying why.
    let client = RawClient::for_node(&pki, "raw-old");
    let old = client.connect(agg.quic_addr()).expect("connect");
    let mut body = wire::encode(&Message::Hello(hello("raw-old"))).expect("encode");
    body[0] = 0;
    let mut frame = (body.len() as u16).to_be_bytes().to_vec();
    frame.extend(&body);
    old.send_stream_bytes(&frame).expect("send frame");
    assert_protocol_close(&old, "a hello of wire version 0");
    wait_rejected(&agg, "unknown_version", unknown0 + 2.0);

    let invalid0 = rejected(&agg, "invalid_hello");
    let client = RawClient::for_node(&pki, "raw-invalid");
    let conn = client.connect(agg.quic_addr()).expect("connect");
    let bad = Hello {
        service: "no/slashes".into(),
        ..hello("raw-invalid")
    };
    match conn.hello(&bad) {
        Ok(Message::Reject(r)) => assert_eq!(r.reason, RejectReason::InvalidHello, "{r:?}"),
        other => panic!("an invalid hello got {other:?}"),
    }
    wait_rejected(&agg, "invalid_hello", invalid0 + 1.0);

    // The agent was served all along, and still is.
    wait_for(Duration::from_secs(5), "the agent still served", || {
        let s = agent.status();
        let fresh = s
            .weight_unix_ms
            .is_some_and(|t| unix_ms().saturating_sub(t) < 2000);
        if s.reports_sent >= before.reports_sent + 4 && fresh && s.connected_to.is_some() {
            Ok(())
        } else {
            Err(format!("before {before:?}, now {s:?}"))
        }
    });
    let eps = agg.endpoints(SERVICE);
    assert_eq!(eps.len(), 1, "{eps:?}");
    assert!(
        eps[0].state != EndpointState::Missing && eps[0].report_age_ms.is_some_and(|a| a <= 1500),
        "{:?}",
        eps[0]
    );
    assert!(
        agent.status().connect_failures == 0,
        "the agent lost its link"
    );

    // Nothing from the raw clients reached the agents' service.
    let services: Vec<serde_json::Value> = agg.get_json("/v1/services");
    let names: Vec<&str> = services.iter().filter_map(|s| s["name"].as_str()).collect();
    assert!(
        !names.iter().any(|n| n.contains('/')),
        "an invalid service registered: {names:?}"
    );

    // The silent client was closed for not saying hello.
    assert_protocol_close(&idle, "no hello for the hello timeout");
    let timeouts = agg.counter(
        "ballast_connections_rejected_total",
        &[("reason", "hello_timeout")],
    );
    assert_eq!(timeouts, 1.0, "hello timeouts");

    // The aggregator is alive and never panicked.
    let mut agg = agg;
    assert!(agg.is_running(), "the aggregator died");
    let health: serde_json::Value = agg.get_json("/healthz");
    assert_eq!(health["status"], "ok");
    let log = agg.log();
    assert!(!log.contains("panicked"), "the aggregator panicked:\n{log}");
}

#[test]
fn unknown_paths_get_json_404() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    for path in [
        "/v1/services/nope",
        "/v1/services/nope/endpoints",
        "/v1/services/nope/weights",
    ] {
        let e = agg.get_error(path, 404);
        assert_eq!(e.status, 404, "{path}: {e:?}");
        assert!(
            e.error.contains("nope"),
            "{path}: the error names the service: {e:?}"
        );
    }
    let e = agg.get_error("/v2/whatever", 404);
    assert_eq!(e.status, 404);
    assert!(!e.error.is_empty());
    let services: Vec<serde_json::Value> = agg.get_json("/v1/services");
    assert!(services.is_empty(), "{services:?}");
    // The API describes itself.
    let doc: serde_json::Value = agg.get_json("/openapi.json");
    for path in [
        "/v1/services",
        "/v1/services/{name}",
        "/v1/services/{name}/endpoints",
        "/v1/services/{name}/weights",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "/openapi.json lacks {path}"
        );
    }
}
