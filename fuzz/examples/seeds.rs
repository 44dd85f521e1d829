//! Writes the seed corpora, `fuzz/corpus/<target>/`, from real messages: values
//! encoded by the product's own encoders (wire messages, frames, DiscoveryRequests,
//! store files), files as the kernel and exporters write them, and the shipped config.
//!
//! `cargo +nightly run --example seeds` in `fuzz/`; it replaces each file it writes
//! and leaves the rest of a corpus alone.

use ballast_agent::control::Request;
use ballast_aggregator::config::dir::{backup, ServiceConfigs};
use ballast_aggregator::config::service::FileError;
use ballast_aggregator::feed::xds::resources::ResourceType;
use ballast_aggregator::store::file::FileStore;
use ballast_aggregator::store::RoutingStore;
use ballast_balance::service::{EndpointSnapshot, ServiceSnapshot};
use ballast_balance::{Params, Strategy};
use ballast_fuzz::op;
use ballast_shared::frame;
use ballast_shared::trunk::{encode_control, Attach, BatchEncoder, BatchKind, ToPrimary, ToRelay};
use ballast_shared::wire::{
    self, Hello, Message, NodeState, Reject, RejectReason, Reply, Report, RequestAge, Welcome,
};
use envoy_types::pb::envoy::config::core::v3::{Locality, Node};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status;
use prost::Message as _;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Error = Box<dyn std::error::Error>;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

fn write(target: &str, name: &str, bytes: &[u8]) -> Result<(), Error> {
    let dir = corpus().join(target);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(name), bytes)?;
    Ok(())
}

fn hello(node: &str, address: &str) -> Hello {
    Hello {
        node: node.into(),
        service: "web".into(),
        address: address.into(),
        zone: "z1".into(),
        version: ballast_shared::VERSION.into(),
    }
}

fn report(seq: u32, cpu: f32, inflight: u32) -> Message {
    Message::Report(Report {
        seq,
        cpu,
        inflight,
        inflight_mean: inflight as f32,
        age: Some(RequestAge {
            mean_ms: 12,
            oldest_ms: 250,
        }),
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    })
}

fn reply(weight: f32, cycle: u64, interval_ms: u32, draining: bool) -> Message {
    Message::Reply(Reply {
        weight,
        cycle,
        interval_ms,
        draining,
        load: 0.62,
        inflight_trusted: true,
    })
}

fn enc(m: &Message) -> Result<Vec<u8>, Error> {
    Ok(wire::encode(m)?)
}

fn framed(m: &Message) -> Result<Vec<u8>, Error> {
    Ok(frame::encode(m)?)
}

fn wire_seeds() -> Result<(), Error> {
    let msgs = [
        ("hello", Message::Hello(hello("web-1", "10.0.0.1:8080"))),
        ("welcome", Message::Welcome(Welcome { interval_ms: 1000 })),
        (
            "reject",
            Message::Reject(Reject {
                reason: RejectReason::IdentityMismatch,
                detail: "certificate is for \"web-1\", hello claims \"web-2\"".into(),
            }),
        ),
        (
            "report",
            Message::Report(Report {
                seq: 4711,
                cpu: 0.73,
                inflight: 12,
                inflight_mean: 11.6,
                age: Some(RequestAge {
                    mean_ms: 18,
                    oldest_ms: 420,
                }),
                capacity: 64,
                error_rate: Some(0.01),
                state: NodeState::Draining,
            }),
        ),
        ("reply", reply(1.25, 340, 1000, false)),
    ];
    for (name, m) in &msgs {
        write("wire", name, &enc(m)?)?;
        // The same messages in the previous protocol, as an agent or aggregator one
        // release behind sends them.
        write("wire_v2", name, &wire::v2::encode(m)?)?;
    }
    Ok(())
}

/// A relay's certificate chain as an attach carries it: DER bytes, not checked here.
fn chain() -> Vec<Vec<u8>> {
    vec![vec![0x30; 600], vec![0x30; 500]]
}

fn trunk_seeds() -> Result<(), Error> {
    let hello_frame = framed(&Message::Hello(hello("web-1", "10.0.0.1:8080")))?;
    let mut relay = vec![0, 7];
    for m in [
        ToPrimary::Open {
            relay: "relay-1".into(),
            version: ballast_shared::VERSION.into(),
        },
        ToPrimary::Attach(Attach {
            slot: 1,
            hello: hello_frame,
            chain: chain(),
            source: std::net::IpAddr::from([10, 0, 0, 1]),
        }),
        ToPrimary::Detach { slot: 1 },
    ] {
        relay.extend(encode_control(&m)?);
    }
    write("wire_trunk", "relay_control", &relay)?;
    let mut primary = vec![1, 5];
    for m in [
        ToRelay::Opened {
            replica: "a".into(),
            max_slots: 1000,
            max_batch_bytes: 1200,
        },
        ToRelay::Attached {
            slot: 1,
            welcome: framed(&Message::Welcome(Welcome { interval_ms: 1000 }))?,
        },
        ToRelay::Rejected {
            slot: 2,
            reject: Reject {
                reason: RejectReason::NotOwner,
                detail: "replica b".into(),
            },
        },
        ToRelay::Detached {
            slot: 1,
            code: 5,
            reason: "moved".into(),
        },
    ] {
        primary.extend(encode_control(&m)?);
    }
    write("wire_trunk", "primary_control", &primary)?;
    let mut reports = BatchEncoder::new(BatchKind::Reports, 1200);
    let mut replies = BatchEncoder::new(BatchKind::Replies, 1200);
    for slot in [1u64, 2, 200, 70_000] {
        reports.push(slot, &enc(&report(7, 0.5, 3))?)?;
        replies.push(slot, &enc(&reply(1.25, 340, 1000, false))?)?;
    }
    let reports = reports.take().ok_or("no batch")?;
    write("wire_trunk", "reports", &[&[2, 0][..], &reports].concat())?;
    let replies = replies.take().ok_or("no batch")?;
    write("wire_trunk", "replies", &[&[3, 0][..], &replies].concat())?;
    Ok(())
}

fn trunk_session_seeds() -> Result<(), Error> {
    let hello_frame = framed(&Message::Hello(hello("web-1", "10.0.0.1:8080")))?;
    let open = encode_control(&ToPrimary::Open {
        relay: "relay-1".into(),
        version: ballast_shared::VERSION.into(),
    })?;
    let attach = |slot| {
        encode_control(&ToPrimary::Attach(Attach {
            slot,
            hello: hello_frame.clone(),
            chain: chain(),
            source: std::net::IpAddr::from([10, 0, 0, 1]),
        }))
    };
    let mut reports = BatchEncoder::new(BatchKind::Reports, 300);
    reports.push(0, &enc(&report(1, 0.5, 3))?)?;
    reports.push(1, &enc(&report(1, 0.7, 2))?)?;
    let reports = reports.take().ok_or("no batch")?;
    // Header: 4 slots, 8 bad batches.
    let mut s = vec![4, 8];
    op(&mut s, 0, &open);
    op(&mut s, 0, &attach(0)?);
    op(&mut s, 0, &attach(1)?);
    op(&mut s, 1, &[0]);
    op(&mut s, 2, &[0]);
    op(&mut s, 1, &[1]);
    op(&mut s, 3, &[1]);
    op(&mut s, 5, &reports);
    op(&mut s, 6, &[0]);
    op(&mut s, 7, &[]);
    op(&mut s, 4, &[0]);
    op(&mut s, 0, &encode_control(&ToPrimary::Detach { slot: 0 })?);
    write("session_trunk_server", "attach_report_reply", &s)?;

    let welcome = framed(&Message::Welcome(Welcome { interval_ms: 1000 }))?;
    let mut replies = BatchEncoder::new(BatchKind::Replies, 300);
    replies.push(0, &enc(&reply(1.25, 340, 1000, false))?)?;
    let replies = replies.take().ok_or("no batch")?;
    // Header: 1200-byte batches, 5 ms delay.
    let mut s = vec![0x04, 0xb0, 5];
    let opened = encode_control(&ToRelay::Opened {
        replica: "a".into(),
        max_slots: 100,
        max_batch_bytes: 1200,
    })?;
    op(&mut s, 0, &opened);
    op(&mut s, 1, &hello_frame);
    op(&mut s, 1, &hello_frame);
    op(
        &mut s,
        0,
        &encode_control(&ToRelay::Attached { slot: 0, welcome })?,
    );
    op(&mut s, 3, &[&[0][..], &enc(&report(1, 0.5, 3))?].concat());
    op(&mut s, 5, &[0, 5]);
    op(&mut s, 4, &replies);
    op(&mut s, 5, &[0x13, 0x88]);
    op(
        &mut s,
        0,
        &encode_control(&ToRelay::Detached {
            slot: 0,
            code: 5,
            reason: "moved".into(),
        })?,
    );
    op(&mut s, 6, &[]);
    write("session_trunk_client", "attach_batch_timeout", &s)?;
    Ok(())
}

fn session_server_seeds() -> Result<(), Error> {
    // Header: 16 bad datagrams, hello within 5000 ms, interval 1000 ms, grant.
    let head = |grant: u8| vec![16, 0x13, 0x88, 0x03, 0xe8, grant];
    let hello_frame = framed(&Message::Hello(hello("web-1", "10.0.0.1:8080")))?;

    let mut s = head(0);
    op(&mut s, 0, &hello_frame);
    op(&mut s, 2, &[]);
    op(&mut s, 4, &enc(&report(1, 0.5, 3))?);
    op(
        &mut s,
        5,
        &[0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 7, 0, 0, 0, 0, 0, 0, 0, 0],
    );
    op(&mut s, 4, &enc(&report(2, 0.6, 4))?);
    op(&mut s, 4, &enc(&report(1, 0.5, 3))?);
    op(&mut s, 6, &2000u32.to_le_bytes());
    op(&mut s, 7, &1000u16.to_le_bytes());
    write("session_server", "hello_reports", &s)?;

    let mut s = head(0);
    op(&mut s, 0, &hello_frame[..3]);
    op(&mut s, 0, &hello_frame[3..]);
    op(&mut s, 1, &[]);
    op(&mut s, 2, &[]);
    op(&mut s, 4, b"\x02garbage");
    op(
        &mut s,
        4,
        &enc(&Message::Hello(hello("web-1", "10.0.0.1:8080")))?,
    );
    op(&mut s, 4, &enc(&report(u32::MAX, 0.5, 3))?);
    op(&mut s, 4, &enc(&report(0, 0.5, 3))?);
    write("session_server", "split_and_bad_datagrams", &s)?;

    let mut s = head(1);
    op(
        &mut s,
        0,
        &framed(&Message::Hello(hello("web-2", "10.0.0.2:8080")))?,
    );
    write("session_server", "another_node", &s)?;

    let mut s = head(1);
    op(
        &mut s,
        0,
        &framed(&Message::Hello(hello("web-1", "node-1.example.com:8080")))?,
    );
    op(&mut s, 3, b"\x03no such service");
    write("session_server", "host_name_then_reject", &s)?;

    let mut s = head(2);
    op(&mut s, 7, &6000u16.to_le_bytes());
    op(&mut s, 0, &hello_frame);
    write("session_server", "hello_too_late", &s)?;
    Ok(())
}

fn session_client_seeds() -> Result<(), Error> {
    // Header: welcome within 3000 ms, 3 replies may be missed, 1000 ms slack.
    let head = || vec![0x0b, 0xb8, 3, 0x03, 0xe8];
    let welcome = framed(&Message::Welcome(Welcome { interval_ms: 1000 }))?;

    let mut s = head();
    op(&mut s, 0, &welcome);
    op(&mut s, 3, &[]);
    op(&mut s, 2, &enc(&reply(1.0, 1, 1000, false))?);
    op(&mut s, 4, &1000u16.to_le_bytes());
    op(&mut s, 3, &[]);
    op(&mut s, 2, &enc(&reply(1.5, 2, 2000, false))?);
    op(&mut s, 4, &2000u16.to_le_bytes());
    op(&mut s, 2, &enc(&reply(0.0, 3, 2000, true))?);
    op(&mut s, 5, &[]);
    write("session_client", "welcome_replies", &s)?;

    let mut s = head();
    op(
        &mut s,
        0,
        &framed(&Message::Reject(Reject {
            reason: RejectReason::UnknownService,
            detail: "the aggregator does not serve \"web\"".into(),
        }))?,
    );
    write("session_client", "rejected", &s)?;

    let mut s = head();
    op(&mut s, 0, &welcome[..1]);
    op(&mut s, 0, &welcome[1..]);
    op(&mut s, 1, &[]);
    op(&mut s, 2, &enc(&report(1, 0.5, 3))?);
    op(&mut s, 4, &60000u16.to_le_bytes());
    write("session_client", "split_then_silence", &s)?;
    Ok(())
}

fn agent_check_seeds() -> Result<(), Error> {
    let mut s = Vec::new();
    op(&mut s, 0, &enc(&reply(1.5, 7, 1000, false))?);
    op(&mut s, 0, &enc(&reply(0.42, 8, 1000, false))?);
    op(&mut s, 1, &enc(&reply(0.0, 9, 1000, true))?);
    write("agent_check", "replies", &s)?;
    let mut s = Vec::new();
    op(&mut s, 0, &enc(&reply(12.5, 1, 1000, false))?);
    op(&mut s, 0, &enc(&reply(0.001, 2, 1000, false))?);
    write("agent_check", "extreme_weights", &s)?;
    Ok(())
}

fn request(
    t: ResourceType,
    names: &[&str],
    version: &str,
    nonce: &str,
    zone: Option<&str>,
    error: Option<&str>,
) -> Vec<u8> {
    DiscoveryRequest {
        version_info: version.into(),
        node: zone.map(|z| Node {
            id: "grpc-client-1".into(),
            cluster: "clients".into(),
            user_agent_name: "gRPC Python".into(),
            locality: Some(Locality {
                region: "eu".into(),
                zone: z.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        type_url: t.type_url().into(),
        response_nonce: nonce.into(),
        error_detail: error.map(|m| Status {
            code: 3,
            message: m.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn xds_seeds() -> Result<(), Error> {
    use ResourceType::{Cluster, Endpoints, Listener, Route};
    // A proxyless gRPC client walking xds:///web: LDS, RDS, CDS, EDS, each ACKed.
    let mut s = Vec::new();
    op(
        &mut s,
        0,
        &request(Listener, &["web"], "", "", Some("b"), None),
    );
    op(&mut s, 2, &[]);
    op(
        &mut s,
        0,
        &request(Listener, &["web"], "v", "1", None, None),
    );
    op(&mut s, 0, &request(Route, &["web"], "", "", None, None));
    op(&mut s, 2, &[]);
    op(&mut s, 0, &request(Route, &["web"], "v", "2", None, None));
    op(&mut s, 0, &request(Cluster, &["web"], "", "", None, None));
    op(&mut s, 2, &[]);
    op(&mut s, 0, &request(Cluster, &["web"], "v", "3", None, None));
    op(&mut s, 0, &request(Endpoints, &["web"], "", "", None, None));
    op(&mut s, 2, &[]);
    op(
        &mut s,
        0,
        &request(Endpoints, &["web"], "v", "4", None, None),
    );
    op(&mut s, 3, &[]);
    op(&mut s, 2, &[]);
    write("xds_requests", "grpc_client", &s)?;
    // Envoy: CDS wildcard, EDS by name, a NACK, a stale answer.
    let mut s = Vec::new();
    op(&mut s, 0, &request(Cluster, &[], "", "", Some("a"), None));
    op(
        &mut s,
        0,
        &request(Endpoints, &["web", "api"], "", "", None, None),
    );
    op(&mut s, 2, &[]);
    op(
        &mut s,
        0,
        &request(
            Endpoints,
            &["web", "api"],
            "v",
            "2",
            None,
            Some("endpoint weight out of range"),
        ),
    );
    op(
        &mut s,
        0,
        &request(Cluster, &["*", "web"], "v", "1", None, None),
    );
    op(&mut s, 0, &request(Cluster, &[], "v", "0", None, None));
    op(&mut s, 3, &[]);
    op(&mut s, 2, &[]);
    write("xds_requests", "envoy_nack", &s)?;
    Ok(())
}

fn metrics_http_seeds() -> Result<(), Error> {
    write(
        "metrics_http",
        "prometheus",
        b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1:9464\r\nUser-Agent: Prometheus/2.53.0\r\n\
          Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1\r\n\
          Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
    )?;
    write(
        "metrics_http",
        "curl_head",
        b"HEAD /metrics?debug=1 HTTP/1.0\r\nHost: localhost:9464\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n",
    )?;
    write(
        "metrics_http",
        "not_found",
        b"POST /admin HTTP/1.1\nHost: x\n\n",
    )?;
    Ok(())
}

fn control_seeds() -> Result<(), Error> {
    let line = |r: Request| -> Result<String, Error> { Ok(serde_json::to_string(&r)? + "\n") };
    write(
        "control_socket",
        "status",
        line(Request::Status)?.as_bytes(),
    )?;
    let drain = line(Request::Drain)? + &line(Request::Status)? + &line(Request::Undrain)?;
    write("control_socket", "drain_undrain", drain.as_bytes())?;
    write("control_socket", "bad", b"{\"cmd\":\"reboot\"}\nnot json\n")?;
    Ok(())
}

const PAGE_GO: &str = r#"# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 42
# HELP http_inflight Requests in flight.
# TYPE http_inflight gauge
http_inflight{handler="/api/v1/query"} 3
http_inflight{handler="/api/v1/write",note="has } brace and \"quote\""} 1.5e1
# HELP http_request_duration_seconds Request latency.
# TYPE http_request_duration_seconds histogram
http_request_duration_seconds_bucket{le="0.1"} 129389
http_request_duration_seconds_bucket{le="+Inf"} 133988
http_request_duration_seconds_sum 53423
http_request_duration_seconds_count 133988
"#;

const PAGE_PYTHON: &str = r#"# HELP inflight Requests being served
# TYPE inflight gauge
inflight{worker="0"} 2.0
inflight{worker="1"} 0.0
# HELP requests_total Requests served
# TYPE requests_total counter
requests_total{code="200"} 1027.0
requests_created{code="200"} 1.7640000000000e+09
"#;

fn prometheus_seeds() -> Result<(), Error> {
    write("prometheus_text", "go_client", PAGE_GO.as_bytes())?;
    write("prometheus_text", "python_client", PAGE_PYTHON.as_bytes())?;
    write(
        "prometheus_text",
        "declared_only",
        b"# HELP http_requests_in_flight In flight.\n# TYPE http_requests_in_flight gauge\n",
    )?;
    write(
        "prometheus_text",
        "broken",
        b"http_inflight NaN\nhttp_inflight -1\nhttp_inflight{a=\"b\" 3\n",
    )?;
    Ok(())
}

fn http_seeds() -> Result<(), Error> {
    let mut plain = format!(
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\r\n",
        PAGE_PYTHON.len()
    )
    .into_bytes();
    plain.extend_from_slice(PAGE_PYTHON.as_bytes());
    write("http_response", "content_length", &plain)?;
    let body = PAGE_PYTHON.as_bytes();
    let (a, b) = body.split_at(100);
    let mut chunked =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    chunked.extend_from_slice(format!("{:x}\r\n", a.len()).as_bytes());
    chunked.extend_from_slice(a);
    chunked.extend_from_slice(format!("\r\n{:x};ext=1\r\n", b.len()).as_bytes());
    chunked.extend_from_slice(b);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    write("http_response", "chunked", &chunked)?;
    write(
        "http_response",
        "not_found",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\nnot found\n",
    )?;
    write(
        "http_response",
        "gzip",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\n\x1f\x8b\x08",
    )?;
    Ok(())
}

/// One netlink message: header plus payload, padded to 4 bytes.
fn nlmsg(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(16 + payload.len()).unwrap_or(u32::MAX);
    let mut m = Vec::new();
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&2u16.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&4242u32.to_ne_bytes());
    m.extend_from_slice(payload);
    m.resize((m.len() + 3) & !3, 0);
    m
}

fn nlattr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
    let mut a = Vec::new();
    a.extend_from_slice(&len.to_ne_bytes());
    a.extend_from_slice(&kind.to_ne_bytes());
    a.extend_from_slice(value);
    a.resize((a.len() + 3) & !3, 0);
    a
}

/// An `inet_diag_msg` record with `tcp_info` (ages sent, received) and
/// `INET_DIAG_SHUTDOWN`, as the kernel sends it.
fn socket_record(state: u8, sport: u16, rqueue: u32, sent_ms: u32, recv_ms: u32) -> Vec<u8> {
    let mut p = vec![0u8; 72];
    p[0] = 2; // AF_INET
    p[1] = state;
    p[4..6].copy_from_slice(&sport.to_be_bytes());
    p[6..8].copy_from_slice(&51234u16.to_be_bytes());
    p[8..12].copy_from_slice(&[127, 0, 0, 1]);
    p[24..28].copy_from_slice(&[127, 0, 0, 1]);
    p[56..60].copy_from_slice(&rqueue.to_ne_bytes());
    let mut info = vec![0u8; 232];
    info[0] = state;
    info[44..48].copy_from_slice(&sent_ms.to_ne_bytes());
    info[52..56].copy_from_slice(&recv_ms.to_ne_bytes());
    info[152..156].copy_from_slice(&3u32.to_ne_bytes());
    info[156..160].copy_from_slice(&2u32.to_ne_bytes());
    p.extend(nlattr(2, &info));
    p.extend(nlattr(8, &[0]));
    p
}

fn netlink_seeds() -> Result<(), Error> {
    let mut d = Vec::new();
    d.extend(nlmsg(18, 7, &socket_record(1, 8080, 0, 500, 500)));
    d.extend(nlmsg(18, 7, &socket_record(1, 8080, 0, 400, 100)));
    d.extend(nlmsg(18, 7, &socket_record(1, 443, 120, 20, 20)));
    d.extend(nlmsg(18, 7, &socket_record(8, 80, 0, 0, 0)));
    d.extend(nlmsg(18, 7, &socket_record(1, 9999, 0, 0, 0)));
    d.extend(nlmsg(3, 7, &0i32.to_ne_bytes()));
    write("netlink", "getsock_dump", &d)?;
    let mut d = Vec::new();
    d.extend(nlmsg(20, 9, &socket_record(1, 80, 0, 4, 8)));
    d.extend(nlmsg(20, 8, &socket_record(1, 80, 0, 8, 4)));
    d.extend(nlmsg(1, 9, &[]));
    write("netlink", "by_family_partial", &d)?;
    let mut e = (-22i32).to_ne_bytes().to_vec();
    e.extend(nlmsg(18, 11, &[0u8; 72])[..16].iter());
    write("netlink", "error", &nlmsg(2, 11, &e))?;
    write(
        "netlink",
        "done_failed",
        &nlmsg(3, 12, &(-16i32).to_ne_bytes()),
    )?;
    Ok(())
}

fn proc_seeds() -> Result<(), Error> {
    write(
        "proc_files",
        "pid_stat",
        b"31203 (nginx: worker (1)) S 31199 31199 15743 0 -1 4194304 101 0 0 0 1842 377 12 3 20 0 1 0 1838145 3133440 384 18446744073709551615 94526675697664 94526675717545 140724229684432 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 94526675733552 94526675735168 94527593250816 140724229687827 140724229687847 140724229687847 140724229689323 0\n",
    )?;
    write(
        "proc_files",
        "stat",
        b"cpu  1615935 108609 316273 1595359 8856 0 10276 800 0 0\ncpu0 792042 53326 152861 822123 2836 0 4598 387 0 0\ncpu1 823892 55283 163411 773236 6020 0 5677 413 0 0\nintr 212812 0 9 0 0\nctxt 48861735\nbtime 1764550000\nprocesses 31210\nprocs_running 2\nprocs_blocked 0\n",
    )?;
    write(
        "proc_files",
        "net_tcp",
        b"  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1151 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1152 1 0000000000000000 20 4 30 10 -1\n\
   2: 0100007F:1F90 0100007F:D434 01 00000000:000001A2 00:00000000 00000000     0        0 1157 1 0000000000000000 20 4 30 10 -1\n\
   3: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 1154 1 0000000000000000 20 4 30 10 -1\n\
   4: 0100007F:1F90 0100007F:D433 06 00000000:00000000 03:00000F9E 00000000     0        0 0 3 0000000000000000\n",
    )?;
    write(
        "proc_files",
        "net_tcp6",
        b"  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0\n\
   1: 0000000000000000FFFF00000100007F:1CE8 0000000000000000FFFF00000100007F:E002 01 00000000:00000010 00:00000000 00000000     0        0 2003 1 0000000000000000 20 4 30 10 -1\n",
    )?;
    Ok(())
}

fn cgroup_seeds() -> Result<(), Error> {
    write("cgroup_files", "cpu_max", b"150000 100000\n")?;
    write("cgroup_files", "cpu_max_unlimited", b"max 100000\n")?;
    write(
        "cgroup_files",
        "cpu_stat",
        b"usage_usec 94713262\nuser_usec 62010711\nsystem_usec 32702551\nnr_periods 1204\nnr_throttled 17\nthrottled_usec 893112\nnr_bursts 0\nburst_usec 0\n",
    )?;
    write("cgroup_files", "cfs_quota_period", b"50000\n100000\n")?;
    write("cgroup_files", "cfs_unlimited", b"-1\n100000\n")?;
    write("cgroup_files", "cpu_list", b"0-3,6,8-9\n")?;
    write("cgroup_files", "cpuacct_usage", b"18446744073709\n")?;
    Ok(())
}

fn config_seeds() -> Result<(), Error> {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/etc/aggregator.toml");
    write("aggregator_config", "shipped", &std::fs::read(shipped)?)?;
    write(
        "aggregator_config",
        "set",
        br#"quic = "0.0.0.0:7400"
http = "127.0.0.1:7401"
xds = "[::]:7402"
xds_lb_policy = "least_request"
report_interval_ms = 500
services = ["web", "api"]

[tls]
ca = "/etc/ballast/tls/ca.pem"
cert = "/etc/ballast/tls/server.pem"
key = "/etc/ballast/tls/server.key"

[balance]
cycle_ms = 500
missing_threshold = 0.2
max_weight = 4.0
metric = "inflight"
strategies = [{ strategy = "pid", gate = 0.3 }, { strategy = "round_robin", gate = 0.7 }]

[balance.pid]
kp = 0.5
kd = 0.2

[store]
path = "/var/lib/ballast/weights.json"

[service_config]
dir = "/etc/ballast/services"
tombstone_ttl_s = 86400
backup_keep = 10
"#,
    )?;
    write(
        "service_config",
        "overrides_and_locality",
        br#"# Overrides of the global [balance] defaults; anything left out keeps the default.
[balance]
missing_threshold = 0.2
pid = { kp = 0.5 }
strategies = [
  { strategy = "pid", gate = 0.3 },
  { strategy = "round_robin", gate = 0.7 },
]

# Client zone -> traffic split across destination zones.
[locality.zone_2]
zone_2 = 50
zone_1 = 50
"#,
    )?;
    write(
        "service_config",
        "locality_only",
        b"[locality.zone_1]\nzone_1 = 100\n\n[locality.zone_2]\nzone_2 = 1\nzone_1 = 3\nzone_3 = 1000000\n",
    )?;
    write(
        "service_config",
        "gains",
        b"[balance]\ncycle_ms = 250\nstale_ms = 1000\nmetric = \"cpu\"\nfeed_forward = false\n\n[balance.pid]\nkp = 0.8\nki = 0.05\nderivative_filter = 0.9\n",
    )?;
    write("service_config", "bad_share", b"[locality.a]\nb = 0\n")?;
    Ok(())
}

fn store_seeds() -> Result<(), Error> {
    let scratch = std::env::temp_dir().join(format!("ballast-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    // weights.json as the routing store writes it.
    let endpoint = |address: &str, zone: &str, draining: bool, weight: f64| EndpointSnapshot {
        address: address.into(),
        zone: zone.into(),
        draining,
        weight,
        strategy_weights: [(Strategy::Pid, weight), (Strategy::RoundRobin, 1.0)].into(),
    };
    let services: BTreeMap<String, ServiceSnapshot> = [
        (
            "web".to_string(),
            ServiceSnapshot {
                version: 12,
                cycle: 340,
                endpoints: [
                    (
                        "web-1".to_string(),
                        endpoint("10.0.0.1:8080", "a", false, 1.25),
                    ),
                    (
                        "web-2".to_string(),
                        endpoint("10.0.0.2:8080", "b", true, 0.75),
                    ),
                ]
                .into(),
            },
        ),
        (
            "api".to_string(),
            ServiceSnapshot {
                version: 3,
                cycle: 9,
                endpoints: [(
                    "api-1".to_string(),
                    endpoint("[fd00::1]:90", "", false, 1.0),
                )]
                .into(),
            },
        ),
    ]
    .into();
    let path = scratch.join("weights.json");
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    rt.block_on(FileStore::new(&path).put(&services))?;
    write("store_weights", "weights", &std::fs::read(&path)?)?;
    let one: BTreeMap<String, ServiceSnapshot> =
        services.into_iter().filter(|(n, _)| n == "api").collect();
    rt.block_on(FileStore::new(scratch.join("one.json")).put(&one))?;
    write(
        "store_weights",
        "one_service",
        &std::fs::read(scratch.join("one.json"))?,
    )?;

    // services.json (a backup has the same format) as the aggregator writes it.
    let defaults = Params::default();
    let files: BTreeMap<String, Result<String, FileError>> = [
        (
            "web.toml".to_string(),
            Ok("[balance]\nmissing_threshold = 0.2\npid = { kp = 0.5 }\n\n[locality.zone_2]\nzone_2 = 50\nzone_1 = 50\n".to_string()),
        ),
        (
            "api.toml".to_string(),
            Ok("[balance]\nstrategies = [{ strategy = \"pid\", gate = 0.3 }, { strategy = \"round_robin\", gate = 0.7 }]\n".to_string()),
        ),
    ]
    .into();
    let mut configs = ServiceConfigs::new(Default::default(), &defaults, 3 * 24 * 3600 * 1000);
    configs.apply(&files, &defaults, 1_764_000_000_000);
    // A deletion leaves a tombstone.
    let later: BTreeMap<String, Result<String, FileError>> =
        files.into_iter().filter(|(f, _)| f == "web.toml").collect();
    configs.apply(&later, &defaults, 1_764_000_600_000);
    let written = backup(
        &scratch.join("backups"),
        configs.merged(),
        1_764_000_600_000,
        3,
    )?
    .ok_or("no backup written")?;
    write("store_services", "services", &std::fs::read(written)?)?;
    std::fs::remove_dir_all(&scratch)?;
    Ok(())
}

fn main() -> Result<(), Error> {
    wire_seeds()?;
    trunk_seeds()?;
    trunk_session_seeds()?;
    session_server_seeds()?;
    session_client_seeds()?;
    agent_check_seeds()?;
    xds_seeds()?;
    metrics_http_seeds()?;
    control_seeds()?;
    prometheus_seeds()?;
    http_seeds()?;
    netlink_seeds()?;
    proc_seeds()?;
    cgroup_seeds()?;
    config_seeds()?;
    store_seeds()?;
    println!("seeds written to {}", corpus().display());
    Ok(())
}
