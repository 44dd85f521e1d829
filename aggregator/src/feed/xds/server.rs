//! The ADS gRPC server: one task keeps the shared [`Snapshot`] current, and one task
//! per stream answers its client from it.
//!
//! The snapshot is rebuilt when a cycle changes some service's weights (the daemon's
//! `changes` signal) and, as a safety net for re-registrations at a new address, every
//! few seconds; it is republished only when its contents changed. Each stream then
//! sends, for each type its client subscribed to, the resources it asked for if they
//! differ from what it was last sent. A stream's EDS resources are those of its
//! client's zone (`node.locality.zone` of its first request), so a locality config
//! change reaches exactly the streams whose zone's split it changed.

use super::protocol::{StreamState, Verdict};
use super::resources::{ResourceType, Snapshot};
use super::LbPolicy;
use crate::metrics::XdsResource;
use crate::state::State;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// How often the snapshot is rebuilt without a change signal. Weight changes are
/// signalled; this only catches an endpoint re-registering at a new address or zone,
/// which changes no weight.
const RESCAN: Duration = Duration::from_secs(2);

/// Responses buffered per stream before the stream waits for its client.
const STREAM_BUFFER: usize = 8;

/// How long [`XdsServer::stop`] waits for streams to close before it cuts them.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Order of pushes after a change: clusters and their endpoints before the listeners
/// and routes that may point at them ("make before break", as the xDS protocol
/// recommends).
const PUSH_ORDER: [ResourceType; 4] = [
    ResourceType::Cluster,
    ResourceType::Endpoints,
    ResourceType::Listener,
    ResourceType::Route,
];

/// A running xDS server.
pub struct XdsServer {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    publisher: tokio::task::JoinHandle<()>,
}

impl XdsServer {
    /// Serves ADS on `listener` from `state`, with clusters of `policy`. Must be
    /// called within a Tokio runtime. Fails only if the listener's address cannot be
    /// read, before anything is spawned.
    pub fn start(
        listener: tokio::net::TcpListener,
        state: Arc<State>,
        policy: LbPolicy,
    ) -> std::io::Result<XdsServer> {
        let addr = listener.local_addr()?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let first = build(&state, policy, &Snapshot::default());
        let (snapshots, snapshots_rx) = watch::channel(Arc::new(first));
        let publisher = tokio::spawn(publish(
            state.clone(),
            policy,
            snapshots,
            shutdown_rx.clone(),
        ));
        let ads = Ads {
            state,
            snapshots: snapshots_rx,
            shutdown: shutdown_rx.clone(),
        };
        let mut stop = shutdown_rx;
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                // Streams live for hours: find dead clients without waiting for TCP.
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(10)))
                .serve_with_incoming_shutdown(
                    AggregatedDiscoveryServiceServer::new(ads),
                    incoming,
                    async move { stopping(&mut stop).await },
                )
                .await;
            if let Err(e) = result {
                tracing::error!(error = %e, "xDS server stopped");
            }
        });
        tracing::info!(xds_addr = %addr, ?policy, "xDS (ADS) serving");
        Ok(XdsServer {
            addr,
            shutdown,
            server,
            publisher,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Ends every stream and stops serving; clients reconnect elsewhere.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        self.publisher.abort();
        let mut server = self.server;
        if tokio::time::timeout(STOP_GRACE, &mut server).await.is_err() {
            tracing::warn!("xDS streams did not close in time; cutting them");
            server.abort();
        }
    }
}

/// Resolves once shutdown is asked, or its sender is gone.
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Builds a snapshot: changed services are copied out under the balancer's lock and
/// encoded after it is released.
fn build(state: &State, policy: LbPolicy, previous: &Snapshot) -> Snapshot {
    let localities = state.localities();
    let pending = Snapshot::prepare(&state.balancer(), &localities, previous);
    pending.finish(policy)
}

/// Keeps the shared snapshot current until shutdown.
async fn publish(
    state: Arc<State>,
    policy: LbPolicy,
    snapshots: watch::Sender<Arc<Snapshot>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut changes = state.changes.subscribe();
    let mut rescan = tokio::time::interval(RESCAN);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = rescan.tick() => {}
            _ = shutdown.changed() => return,
        }
        let current = snapshots.borrow().clone();
        let next = build(&state, policy, &current);
        if !next.same_as(&current) {
            snapshots.send_replace(Arc::new(next));
        }
    }
}

/// The ADS service.
struct Ads {
    state: Arc<State>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    shutdown: watch::Receiver<bool>,
}

type ResponseStream<T> = ReceiverStream<Result<T, Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let peer = request.remote_addr();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stream = AdsStream {
            state: self.state.clone(),
            snapshots: self.snapshots.clone(),
            shutdown: self.shutdown.clone(),
            protocol: StreamState::new(),
            node: None,
            peer,
            tx,
        };
        tokio::spawn(stream.run(request.into_inner()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        // Clients fall back to the state-of-the-world variant.
        Err(Status::unimplemented(
            "incremental xDS is not served; use StreamAggregatedResources",
        ))
    }
}

/// The client went away.
struct Closed;

/// Who is at the other end of a stream.
struct ClientNode {
    /// `node.id`, for logs.
    id: String,
    /// `node.locality.zone`; empty when the client gave none.
    zone: String,
}

impl AdsStream {
    fn node_id(&self) -> &str {
        self.node.as_ref().map_or("", |n| n.id.as_str())
    }

    fn zone(&self) -> &str {
        self.node.as_ref().map_or("", |n| n.zone.as_str())
    }
}

/// One ADS stream.
struct AdsStream {
    state: Arc<State>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    shutdown: watch::Receiver<bool>,
    protocol: StreamState,
    /// The client's node, from its first request that carries one: xDS clients send
    /// it once per stream, and its locality's zone picks the assignment they get.
    node: Option<ClientNode>,
    peer: Option<SocketAddr>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
}

impl AdsStream {
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) {
        self.state.metrics.xds_streams.inc();
        tracing::debug!(peer = ?self.peer, "xDS stream opened");
        let outcome = self.serve(&mut requests).await;
        self.state.metrics.xds_streams.dec();
        match outcome {
            Ok(()) => {
                tracing::debug!(peer = ?self.peer, node = %self.node_id(), "xDS stream closed")
            }
            Err(status) => {
                tracing::debug!(peer = ?self.peer, node = %self.node_id(), %status, "xDS stream ended");
                // Tells the client why, if it is still there.
                let _ = self.tx.try_send(Err(status));
            }
        }
    }

    async fn serve(&mut self, requests: &mut Streaming<DiscoveryRequest>) -> Result<(), Status> {
        let mut snapshots = self.snapshots.clone();
        let mut shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                msg = requests.message() => match msg {
                    Ok(Some(req)) => {
                        let snap = snapshots.borrow().clone();
                        if self.on_request(req, &snap).await.is_err() {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    // Undecodable input or a reset: the stream cannot go on.
                    Err(status) => return Err(status),
                },
                r = snapshots.changed() => {
                    if r.is_err() {
                        return Err(Status::unavailable("xDS server shutting down"));
                    }
                    let snap = snapshots.borrow_and_update().clone();
                    for t in PUSH_ORDER {
                        if self.push(t, &snap).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                () = stopping(&mut shutdown) => {
                    return Err(Status::unavailable("xDS server shutting down"));
                }
                _ = self.tx.closed() => return Ok(()),
            }
        }
    }

    async fn on_request(&mut self, req: DiscoveryRequest, snap: &Snapshot) -> Result<(), Closed> {
        if self.node.is_none() {
            if let Some(node) = &req.node {
                let zone = node.locality.as_ref().map_or("", |l| l.zone.as_str());
                tracing::debug!(peer = ?self.peer, node = %node.id, zone, "xDS client");
                self.node = Some(ClientNode {
                    id: node.id.clone(),
                    zone: zone.to_string(),
                });
            }
        }
        let Some(t) = ResourceType::from_type_url(&req.type_url) else {
            tracing::debug!(node = %self.node_id(), type_url = %req.type_url, "xDS request for a type not served; ignored");
            return Ok(());
        };
        let error = req.error_detail.as_ref().map(|e| e.message.as_str());
        match self
            .protocol
            .on_request(t, &req.resource_names, &req.response_nonce, error)
        {
            Verdict::Stale => {
                tracing::debug!(node = %self.node_id(), r#type = t.label(), nonce = %req.response_nonce, "stale xDS request ignored");
                return Ok(());
            }
            Verdict::Nack { version, message } => {
                tracing::warn!(node = %self.node_id(), peer = ?self.peer, r#type = t.label(), %version,
                    accepted = ?self.protocol.get(t).and_then(|s| s.acked.as_deref()),
                    error = %message, "xDS client rejected resources (NACK); it keeps its last accepted version");
                self.state
                    .metrics
                    .xds_nacks
                    .get_or_create(&XdsResource::of(t.label()))
                    .inc();
            }
            Verdict::Ack { version } => {
                tracing::debug!(node = %self.node_id(), r#type = t.label(), %version, "xDS ACK");
            }
            Verdict::Subscribe => {
                tracing::debug!(node = %self.node_id(), r#type = t.label(), names = ?req.resource_names, "xDS subscription");
            }
        }
        self.push(t, snap).await
    }

    /// Sends type `t` from `snap` if the client should get it.
    async fn push(&mut self, t: ResourceType, snap: &Snapshot) -> Result<(), Closed> {
        let Some(ts) = self.protocol.get(t) else {
            return Ok(());
        };
        let sel = snap.select(
            t,
            ts.subscription.wildcard,
            &ts.subscription.names,
            self.zone(),
        );
        if !self.protocol.should_send(t, &sel.version) {
            return Ok(());
        }
        let nonce = self.protocol.record_sent(t, &sel.version);
        let resp = DiscoveryResponse {
            version_info: sel.version,
            resources: sel.resources,
            type_url: t.type_url().to_string(),
            nonce,
            ..Default::default()
        };
        self.tx.send(Ok(resp)).await.map_err(|_| Closed)?;
        self.state
            .metrics
            .xds_pushes
            .get_or_create(&XdsResource::of(t.label()))
            .inc();
        Ok(())
    }
}
