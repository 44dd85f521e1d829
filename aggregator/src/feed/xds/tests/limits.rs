//! The limits on what clients make the server hold: a stream's node, names and bytes,
//! streams and connections per source and in all.

use super::harness::*;
use crate::feed::xds::resources::ResourceType;
use crate::feed::xds::{LbPolicy, XdsServer};
use crate::state::State;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use std::sync::Arc;
use std::time::Duration;

/// A server for service `web` under `limits`.
async fn limited(
    limits: crate::config::limits::Limits,
) -> (XdsServer, Arc<State>, tempfile::TempDir) {
    let (state, dir) = state();
    let state = Arc::into_inner(state)
        .expect("the only reference")
        .with_limits(limits);
    let state = Arc::new(state);
    let now = state.clock.now();
    ingest(&state, |b| {
        b.register(now, "web", "w0", "127.0.0.1:9000", "z1")
            .expect("register");
    });
    state.cycle(now);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let server = XdsServer::start(listener, inputs(&state), LbPolicy::RingHash).expect("start");
    (server, state, dir)
}

fn refused(state: &State, reason: &str) -> u64 {
    state
        .metrics
        .xds
        .refused
        .get_or_create(&crate::metrics::Reason {
            reason: reason.to_string(),
        })
        .get()
}

impl Client {
    /// How the stream ends, within 5 s, reading past any responses.
    async fn ended(&mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => panic!("the stream ended cleanly"),
                Ok(Err(status)) => return status,
                Err(_) => panic!("the stream did not end within 5 s"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_stream_keeps_is_bounded_node_names_and_bytes() {
    let limits = crate::config::limits::Limits {
        xds_max_node_bytes: 64,
        xds_max_names_per_stream: 10,
        xds_max_stream_bytes: 2000,
        ..Default::default()
    };
    let (server, state, _dir) = limited(limits).await;

    // A node id over the limit ends the stream at its first request.
    let mut long = Client::open(&server, &"n".repeat(65), None, None).await;
    assert_eq!(long.ended().await.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused(&state, "node"), 1);
    let mut zone = Client::open(&server, "n", Some(&"z".repeat(65)), None).await;
    assert_eq!(zone.ended().await.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused(&state, "node"), 2);

    // Names count over every type; a type's new request replaces its names.
    let mut c = Client::connect(&server, "names").await;
    let six: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let six: Vec<&str> = six.iter().map(String::as_str).collect();
    c.send(ResourceType::Cluster, &six, "", "", None).await;
    c.send(ResourceType::Endpoints, &six[..4], "", "", None)
        .await;
    c.send(ResourceType::Endpoints, &six[..3], "", "", None)
        .await;
    let _ = c.recv().await;
    assert_eq!(refused(&state, "stream_names"), 0);
    c.send(ResourceType::Endpoints, &six[..5], "", "", None)
        .await;
    assert_eq!(c.ended().await.code(), tonic::Code::ResourceExhausted);
    assert_eq!(refused(&state, "stream_names"), 1);

    // Bytes: each name's length and its overhead.
    let mut b = Client::connect(&server, "bytes").await;
    let long_names: Vec<String> = (0..8).map(|i| format!("{i}{}", "x".repeat(199))).collect();
    let long_names: Vec<&str> = long_names.iter().map(String::as_str).collect();
    const { assert!(8 * (200 + crate::feed::xds::server::NAME_OVERHEAD) > 2000) };
    const { assert!(7 * (200 + crate::feed::xds::server::NAME_OVERHEAD) <= 2000 - "bytes".len()) };
    b.send(ResourceType::Endpoints, &long_names[..7], "", "", None)
        .await;
    let _ = b.recv().await;
    assert!(state.metrics.xds.stream_bytes.get() >= 7 * 200);
    b.send(ResourceType::Cluster, &long_names[7..], "", "", None)
        .await;
    assert_eq!(b.ended().await.code(), tonic::Code::ResourceExhausted);
    assert_eq!(refused(&state, "stream_bytes"), 1);

    // Everything kept is given back with the streams.
    drop((long, zone, c, b));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while state.metrics.xds.stream_bytes.get() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "stream bytes left: {}",
            state.metrics.xds.stream_bytes.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_connections_are_capped_per_source_and_in_all() {
    use tokio::io::AsyncReadExt;
    let limits = crate::config::limits::Limits {
        xds_max_streams_per_source: 3,
        xds_max_connections: 3,
        xds_max_connections_per_source: 2,
        ..Default::default()
    };
    let (server, state, _dir) = limited(limits).await;
    let addr = server.local_addr();

    // Streams from one address, on one connection.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut held = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let mut client = AggregatedDiscoveryServiceClient::new(channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        match client
            .stream_aggregated_resources(
                tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await
        {
            Ok(s) => held.push((tx, s)),
            Err(s) => statuses.push(s.code()),
        }
    }
    assert_eq!(held.len(), 3);
    assert_eq!(statuses, [tonic::Code::ResourceExhausted]);
    assert_eq!(refused(&state, "source_streams"), 1);
    drop(held);
    drop(channel);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while state.metrics.xds.connections.get() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "connections left open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Connections: two from 127.0.0.1, then one from 127.0.0.2 fills the cap in all.
    let from = |ip: [u8; 4]| async move {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(std::net::SocketAddr::from((ip, 0)))
            .expect("bind");
        socket.connect(addr).await.expect("connect")
    };
    // Whether the server closed `s` within a second (it never sends first).
    let closed = |mut s: tokio::net::TcpStream| async move {
        let mut buf = [0u8; 16];
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => (true, s),
            Ok(Ok(_)) | Err(_) => (false, s),
        }
    };
    let a = from([127, 0, 0, 1]).await;
    let b = from([127, 0, 0, 1]).await;
    let (c_closed, _c) = closed(from([127, 0, 0, 1]).await).await;
    assert!(c_closed, "a third connection from one address was kept");
    assert_eq!(refused(&state, "source_connections"), 1);
    let (d_closed, _d) = closed(from([127, 0, 0, 2]).await).await;
    assert!(
        !d_closed,
        "another address was refused under the cap in all"
    );
    let (e_closed, _e) = closed(from([127, 0, 0, 3]).await).await;
    assert!(e_closed, "a fourth connection was kept past the cap in all");
    assert_eq!(refused(&state, "connections"), 1);
    assert_eq!(state.metrics.xds.connections.get(), 3);
    let (a_closed, _a) = closed(a).await;
    assert!(!a_closed, "a connection under the caps was closed");
    drop(b);
    server.stop().await;
}
