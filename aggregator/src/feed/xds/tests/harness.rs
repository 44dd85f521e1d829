//! The server over a socket, with a tonic ADS client: the harness the socket tests share.

use super::*;
use crate::clock::Clock;
use crate::config::locality::Localities;
use crate::feed::xds::resources::ResourceType;
use crate::feed::xds::{Inputs, LbPolicy, XdsServer};
use crate::metrics::XdsResource;
use crate::state::State;
use crate::store::file::FileStore;
use ballast_balance::{Balancer, Observation, Params};
use envoy_types::pb::envoy::config::core::v3::Locality;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::rpc;
use prost::Message;
use std::sync::Arc;
use std::time::Duration;

pub(super) struct Harness {
    pub(super) state: Arc<State>,
    pub(super) server: XdsServer,
    _dir: tempfile::TempDir,
}

pub(super) fn state() -> (Arc<State>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = Clock::start();
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let balancer = Balancer::new(params, clock.now());
    let store = Arc::new(FileStore::new(dir.path().join("weights.json")));
    (Arc::new(State::new(balancer, store, clock, 1000)), dir)
}

/// What the daemon gives the feed of `state`: its publications, limits and counters.
pub(super) fn inputs(state: &State) -> Inputs {
    Inputs {
        publications: state.subscribe(),
        limits: (&state.limits).into(),
        metrics: state.metrics.xds.clone(),
    }
}

impl Harness {
    pub(super) async fn start(endpoints: &[(&str, &str)]) -> Harness {
        let zoned: Vec<(&str, &str, &str)> =
            endpoints.iter().map(|(n, a)| (*n, *a, "z1")).collect();
        Self::start_in_zones(&zoned, Localities::default()).await
    }

    /// Service `web` with endpoints (node, address, zone), and `localities` in force
    /// from the first snapshot on.
    pub(super) async fn start_in_zones(
        endpoints: &[(&str, &str, &str)],
        localities: Localities,
    ) -> Harness {
        let (state, dir) = state();
        state.localize(localities);
        let now = state.clock.now();
        ingest(&state, |b| {
            for (node, addr, zone) in endpoints {
                b.register(now, "web", node, addr, zone).expect("register");
            }
        });
        state.cycle(state.clock.now());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let server = XdsServer::start(listener, inputs(&state), LbPolicy::RingHash).expect("start");
        Harness {
            state,
            server,
            _dir: dir,
        }
    }

    pub(super) fn nacks(&self) -> u64 {
        self.state
            .metrics
            .xds
            .nacks
            .get_or_create(&XdsResource::of("endpoints"))
            .get()
    }

    /// Drains `node` and runs a cycle, which publishes a new weights version.
    pub(super) fn drain(&self, node: &str) {
        let now = self.state.clock.now();
        let obs = Observation {
            draining: true,
            ..Observation::default()
        };
        ingest(&self.state, |b| {
            b.observe(now, "web", node, obs).expect("observe");
        });
        self.state.cycle(now);
    }

    /// Change `k`: a new service `extra-k` (new listeners and clusters for wildcard
    /// subscribers) and `web`'s node `w0` at a new port (a new assignment), then a
    /// cycle, which publishes both.
    pub(super) fn change(&self, k: u16) {
        let now = self.state.clock.now();
        ingest(&self.state, |b| {
            b.register(now, &format!("extra-{k}"), "x", "127.0.0.1:1", "z1")
                .expect("register");
            b.register(now, "web", "w0", &format!("127.0.0.1:{}", 20_000 + k), "z1")
                .expect("register");
        });
        self.state.cycle(now);
    }

    /// Responses of type `t` sent so far, on every stream.
    pub(super) fn pushes(&self, t: ResourceType) -> u64 {
        self.state
            .metrics
            .xds
            .pushes
            .get_or_create(&XdsResource::of(t.label()))
            .get()
    }
}

/// Changes the balancer as ingest does (registrations, reports). The tests play the
/// agents here; the xDS feed itself only reads publications.
pub(super) fn ingest(state: &State, change: impl FnOnce(&mut Balancer)) {
    state.write_balancer(change);
}

/// One ADS stream of a test client.
pub(super) struct Client {
    pub(super) tx: tokio::sync::mpsc::Sender<DiscoveryRequest>,
    pub(super) rx: tonic::Streaming<DiscoveryResponse>,
}

impl Client {
    pub(super) async fn connect(server: &XdsServer, node: &str) -> Client {
        Self::connect_in_zone(server, node, None).await
    }

    /// A stream whose node names `zone` as its locality.
    pub(super) async fn connect_in_zone(
        server: &XdsServer,
        node: &str,
        zone: Option<&str>,
    ) -> Client {
        Self::open(server, node, zone, None).await
    }

    /// A stream on its own connection; with `window`, the HTTP/2 flow-control window
    /// the client grants each stream, in bytes: what the server can send it before it
    /// reads.
    pub(super) async fn open(
        server: &XdsServer,
        node: &str,
        zone: Option<&str>,
        window: Option<u32>,
    ) -> Client {
        let url = format!("http://{}", server.local_addr());
        let channel = tonic::transport::Endpoint::from_shared(url)
            .expect("url")
            .initial_stream_window_size(window)
            .connect()
            .await
            .expect("connect");
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let first = DiscoveryRequest {
            node: Some(envoy_types::pb::envoy::config::core::v3::Node {
                id: node.to_string(),
                locality: zone.map(|z| Locality {
                    zone: z.to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        // The node goes in a request of a type not served, which must be ignored.
        tx.send(DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret".into(),
            ..first
        })
        .await
        .expect("send");
        let rx = client
            .stream_aggregated_resources(
                tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await
            .expect("stream")
            .into_inner();
        Client { tx, rx }
    }

    pub(super) async fn send(
        &self,
        t: ResourceType,
        names: &[&str],
        version: &str,
        nonce: &str,
        error: Option<&str>,
    ) {
        let req = DiscoveryRequest {
            version_info: version.to_string(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            type_url: t.type_url().to_string(),
            response_nonce: nonce.to_string(),
            error_detail: error.map(|m| rpc::Status {
                code: 3,
                message: m.to_string(),
                details: vec![],
            }),
            ..Default::default()
        };
        self.tx.send(req).await.expect("send");
    }

    pub(super) async fn recv(&mut self) -> DiscoveryResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("a response within 5 s")
            .expect("stream open")
            .expect("a response")
    }

    /// Answers `resp` as a client that accepts it, keeping its subscription `names`.
    pub(super) async fn ack(&self, resp: &DiscoveryResponse, names: &[&str]) {
        let t = ResourceType::from_type_url(&resp.type_url).expect("a type served");
        self.send(t, names, &resp.version_info, &resp.nonce, None)
            .await;
    }

    /// Asserts that nothing arrives for a while.
    pub(super) async fn quiet(&mut self) {
        if let Ok(got) = tokio::time::timeout(Duration::from_millis(300), self.rx.message()).await {
            panic!("expected no response, got {got:?}");
        }
    }
}

pub(super) fn endpoints_of(resp: &DiscoveryResponse) -> Vec<(String, String, u32, u32, i32)> {
    assert_eq!(resp.type_url, ResourceType::Endpoints.type_url());
    resp.resources
        .iter()
        .flat_map(|a| flatten(&ClusterLoadAssignment::decode(a.value.as_slice()).expect("cla")))
        .collect()
}
