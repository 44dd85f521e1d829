//! The ADS gRPC server: one task keeps the shared [`Snapshot`] current; each stream
//! has a task that reads its client's requests, and an outbound side that builds its
//! responses from the snapshot.
//!
//! The snapshot is rebuilt from each publication of the cycle (weights, drains,
//! addresses, zones and locality splits all come from there) and republished only
//! when its contents changed. Each stream then sends, for each type its client
//! subscribed to, the resources it asked for if they differ from what it was last
//! sent. A stream's EDS resources are those of its client's zone
//! (`node.locality.zone` of its first request), so a locality config change reaches
//! exactly the streams whose zone's split it changed.
//!
//! # No queue per stream: the newest, when the client can take it
//!
//! A stream's responses are not queued. Its outbound side is the response stream
//! tonic polls, and tonic polls it for the next message only once the HTTP/2 stream
//! has taken the previous one (and, past the peer's flow-control window, waits before
//! it asks again). Only then is a response built: from the latest snapshot, for the
//! first type in push order whose contents for this client differ from what it was
//! last sent; the responses one change calls for (at most one per type) go out as
//! one write. A client that cannot keep up therefore skips the versions published
//! while it was behind and gets the newest when it reads again, and what the server
//! holds for it is what the transport holds (the response being written, and at most
//! one more taken and waiting for window), however many versions go by: no copies
//! pile up per slow client. The request task and the outbound side share the
//! protocol state ([`StreamState`], sans-IO) under a mutex that no await holds.

use super::protocol::{StreamState, Verdict};
use super::resources::{ResourceType, Snapshot};
use super::LbPolicy;
use crate::metrics::XdsResource;
use crate::state::State;
use crate::supervise::Supervisor;
use ballast_balance::Published;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures_util::stream::BoxStream;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{oneshot, watch, Notify};
use tonic::{Request, Response, Status, Streaming};

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
        Self::start_supervised(listener, state, policy, None, &Supervisor::detached())
    }

    /// Like [`XdsServer::start`], over TLS when `tls` is given, with its tasks
    /// watched by `supervisor`. Fails if the TLS configuration is unusable.
    pub fn start_supervised(
        listener: tokio::net::TcpListener,
        state: Arc<State>,
        policy: LbPolicy,
        tls: Option<tonic::transport::ServerTlsConfig>,
        supervisor: &Supervisor,
    ) -> std::io::Result<XdsServer> {
        let addr = listener.local_addr()?;
        let state_tls = if tls.is_some() { "on" } else { "off" };
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            builder = builder
                .tls_config(tls)
                .map_err(|e| std::io::Error::other(format!("xDS TLS: {e}")))?;
        }
        let (shutdown, shutdown_rx) = watch::channel(false);
        let first = build(&state.published(), policy, &Snapshot::default());
        let (snapshots, snapshots_rx) = watch::channel(Arc::new(first));
        let publisher = supervisor.spawn(
            "xDS publisher",
            publish(state.clone(), policy, snapshots, shutdown_rx.clone()),
        );
        let limits = state.limits.clone();
        let ads = Ads {
            state,
            snapshots: snapshots_rx,
            shutdown: shutdown_rx.clone(),
            open: Arc::new(AtomicUsize::new(0)),
        };
        let mut stop = shutdown_rx;
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = supervisor.spawn("xDS server", async move {
            let result = builder
                // Streams live for hours: find dead clients without waiting for TCP.
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(10)))
                .max_concurrent_streams(Some(limits.xds_max_streams_per_connection))
                .serve_with_incoming_shutdown(
                    AggregatedDiscoveryServiceServer::new(ads)
                        .max_decoding_message_size(limits.xds_max_request_bytes),
                    incoming,
                    async move { stopping(&mut stop).await },
                )
                .await;
            if let Err(e) = result {
                tracing::error!(error = %e, "xDS server stopped");
            }
        });
        tracing::info!(xds_addr = %addr, ?policy, tls = %state_tls, "xDS (ADS) serving");
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

/// Builds a snapshot from a publication: only services that changed are encoded.
fn build(published: &Published, policy: LbPolicy, previous: &Snapshot) -> Snapshot {
    Snapshot::prepare(published, previous).finish(policy)
}

/// Keeps the shared snapshot current until shutdown.
async fn publish(
    state: Arc<State>,
    policy: LbPolicy,
    snapshots: watch::Sender<Arc<Snapshot>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut published = state.subscribe();
    published.mark_changed();
    loop {
        tokio::select! {
            r = published.changed() => if r.is_err() { return },
            _ = shutdown.changed() => return,
        }
        let latest = published.borrow_and_update().clone();
        let current = snapshots.borrow().clone();
        let next = build(&latest, policy, &current);
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
    /// Streams open, against `limits.xds_max_streams`.
    open: Arc<AtomicUsize>,
}

/// Holds one place among the open streams for as long as the stream's request side
/// lives.
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    /// A place, if fewer than `max` are taken.
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<StreamSlot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| StreamSlot(open.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The most bytes of a NACK's `error_detail` kept for the log: a client's message is
/// its own business, and its size is the client's choice.
const MAX_NACK_DETAIL: usize = 512;

/// `text`, cut to at most `max` bytes at a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

type ResponseStream<T> = BoxStream<'static, Result<T, Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let peer = request.remote_addr();
        let max = self.state.limits.xds_max_streams;
        let Some(slot) = StreamSlot::take(&self.open, max) else {
            self.state.metrics.refuse_xds("streams");
            tracing::warn!(?peer, max, "xDS stream refused: too many open streams");
            return Err(Status::resource_exhausted(format!(
                "this xDS server has {max} streams open, its limit"
            )));
        };
        let shared = Arc::new(Shared {
            session: Mutex::new(Session {
                protocol: StreamState::new(),
                node: None,
                ended: None,
            }),
            wake: Notify::new(),
        });
        let (alive, gone) = oneshot::channel();
        let requests = AdsStream {
            state: self.state.clone(),
            shared: shared.clone(),
            shutdown: self.shutdown.clone(),
            peer,
            alive,
            _slot: slot,
        };
        tokio::spawn(requests.run(request.into_inner()));
        let outbound = Outbound {
            state: self.state.clone(),
            shared,
            snapshots: self.snapshots.clone(),
            shutdown: self.shutdown.clone(),
            round: None,
            done: false,
            _gone: gone,
        };
        let responses = futures_util::stream::unfold(outbound, |mut o| async move {
            let next = o.next().await?;
            Some((next, o))
        });
        Ok(Response::new(Box::pin(responses)))
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

/// Who is at the other end of a stream.
struct ClientNode {
    /// `node.id`, for logs.
    id: String,
    /// `node.locality.zone`; empty when the client gave none.
    zone: String,
}

/// One stream's state, shared by its request task and its outbound side.
struct Session {
    /// Subscriptions, what was sent with which nonce, ACKs and NACKs.
    protocol: StreamState,
    /// The client's node, from its first request that carries one: xDS clients send
    /// it once per stream, and its locality's zone picks the assignment they get.
    node: Option<ClientNode>,
    /// How the request side ended, once it has: `Ok` when the client closed its side,
    /// else the status to end the stream with.
    ended: Option<Result<(), Status>>,
}

impl Session {
    fn node_id(&self) -> &str {
        self.node.as_ref().map_or("", |n| n.id.as_str())
    }
}

/// What a stream's two sides share.
struct Shared {
    session: Mutex<Session>,
    /// Wakes the outbound side when a request may call for a response, or when the
    /// request side ends. A wake while it is busy is kept (one permit), not lost.
    wake: Notify,
}

impl Shared {
    /// The session. A panic while it was held leaves at worst a response unsent,
    /// which the next change repairs, so a poisoned lock is taken over.
    fn lock(&self) -> MutexGuard<'_, Session> {
        self.session.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The request side of one ADS stream: reads the client's requests into the protocol
/// state and wakes the outbound side.
struct AdsStream {
    state: Arc<State>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
    peer: Option<SocketAddr>,
    /// Closed when tonic drops the outbound side: the client is gone.
    alive: oneshot::Sender<()>,
    _slot: StreamSlot,
}

impl AdsStream {
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) {
        self.state.metrics.xds_streams.inc();
        tracing::debug!(peer = ?self.peer, "xDS stream opened");
        let outcome = self.serve(&mut requests).await;
        self.state.metrics.xds_streams.dec();
        let mut session = self.shared.lock();
        match &outcome {
            Ok(()) => {
                tracing::debug!(peer = ?self.peer, node = %session.node_id(), "xDS stream closed")
            }
            Err(status) => {
                tracing::debug!(peer = ?self.peer, node = %session.node_id(), %status, "xDS stream ended");
            }
        }
        // The outbound side sends what is due, then ends the stream (with the status,
        // if the client is still there to read it).
        session.ended = Some(outcome);
        drop(session);
        self.shared.wake.notify_one();
    }

    async fn serve(&mut self, requests: &mut Streaming<DiscoveryRequest>) -> Result<(), Status> {
        let mut shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                msg = requests.message() => match msg {
                    Ok(Some(req)) => {
                        let max = self.state.limits.xds_max_resource_names;
                        if req.resource_names.len() > max {
                            self.state.metrics.refuse_xds("resource_names");
                            return Err(Status::invalid_argument(format!(
                                "{} resource names in one request; the limit is {max}",
                                req.resource_names.len()
                            )));
                        }
                        self.on_request(req);
                        self.shared.wake.notify_one();
                    }
                    Ok(None) => return Ok(()),
                    // Undecodable input or a reset: the stream cannot go on.
                    Err(status) => return Err(status),
                },
                () = stopping(&mut shutdown) => {
                    return Err(Status::unavailable("xDS server shutting down"));
                }
                () = self.alive.closed() => return Ok(()),
            }
        }
    }

    fn on_request(&self, req: DiscoveryRequest) {
        let mut session = self.shared.lock();
        if session.node.is_none() {
            if let Some(node) = &req.node {
                let zone = node.locality.as_ref().map_or("", |l| l.zone.as_str());
                tracing::debug!(peer = ?self.peer, node = %node.id, zone, "xDS client");
                session.node = Some(ClientNode {
                    id: node.id.clone(),
                    zone: zone.to_string(),
                });
            }
        }
        let Some(t) = ResourceType::from_type_url(&req.type_url) else {
            tracing::debug!(node = %session.node_id(), type_url = %req.type_url, "xDS request for a type not served; ignored");
            return;
        };
        let error = req
            .error_detail
            .as_ref()
            .map(|e| truncated(&e.message, MAX_NACK_DETAIL));
        let verdict =
            session
                .protocol
                .on_request(t, &req.resource_names, &req.response_nonce, error);
        match verdict {
            Verdict::Stale => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), nonce = %req.response_nonce, "stale xDS request ignored");
            }
            Verdict::Nack { version, message } => {
                tracing::warn!(node = %session.node_id(), peer = ?self.peer, r#type = t.label(), %version,
                    accepted = ?session.protocol.get(t).and_then(|s| s.acked.as_deref()),
                    error = %message, "xDS client rejected resources (NACK); it keeps its last accepted version");
                self.state
                    .metrics
                    .xds_nacks
                    .get_or_create(&XdsResource::of(t.label()))
                    .inc();
            }
            Verdict::Ack { version } => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), %version, "xDS ACK");
            }
            Verdict::Subscribe => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), names = ?req.resource_names, "xDS subscription");
            }
        }
    }
}

/// The outbound side of one ADS stream: the response stream tonic polls. Each poll
/// builds at most one response, from the snapshot current when its round began.
struct Outbound {
    state: Arc<State>,
    shared: Arc<Shared>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    shutdown: watch::Receiver<bool>,
    /// The snapshot of the round under way: the responses one change calls for are
    /// all built from it, and the round ends with a yield (see [`Outbound::next`]).
    round: Option<Arc<Snapshot>>,
    /// Set once the stream has ended; nothing more is sent.
    done: bool,
    /// Dropped with this side, which tells the request task the client is gone.
    _gone: oneshot::Receiver<()>,
}

/// What the outbound side does next.
enum Step {
    /// Sends this response.
    Send(DiscoveryResponse),
    /// Ends the stream: cleanly, or with a status.
    End(Result<(), Status>),
    /// Waits for a new snapshot or a request.
    Wait,
}

impl Outbound {
    /// The next message of the stream; `None` ends it.
    ///
    /// The responses due after a change (one per type at most) are a round, built
    /// from one snapshot. tonic packs the messages it can poll without waiting into
    /// one write, so a round ends with a yield: the write then holds at most one
    /// response per type, and while the peer's window is full the transport takes
    /// nothing more from the stream, however many snapshots go by.
    async fn next(&mut self) -> Option<Result<DiscoveryResponse, Status>> {
        loop {
            if self.done {
                return None;
            }
            if *self.shutdown.borrow() {
                return self.end(Err(Status::unavailable("xDS server shutting down")));
            }
            let (snap, fresh) = match self.round.take() {
                Some(snap) => (snap, false),
                None => (self.snapshots.borrow_and_update().clone(), true),
            };
            match self.step(&snap) {
                Step::Send(resp) => {
                    self.round = Some(snap);
                    return Some(Ok(resp));
                }
                Step::End(outcome) => return self.end(outcome),
                Step::Wait if !fresh => {
                    tokio::task::yield_now().await;
                    continue;
                }
                Step::Wait => {}
            }
            tokio::select! {
                r = self.snapshots.changed() => if r.is_err() {
                    return self.end(Err(Status::unavailable("xDS server shutting down")));
                },
                () = self.shared.wake.notified() => {}
                () = stopping(&mut self.shutdown) => {}
            }
        }
    }

    fn end(&mut self, outcome: Result<(), Status>) -> Option<Result<DiscoveryResponse, Status>> {
        self.done = true;
        outcome.err().map(Err)
    }

    /// The first type, in push order, whose contents in `snap` the client should be
    /// sent, as a response with its nonce recorded; else the end of the stream if its
    /// request side ended; else nothing.
    fn step(&self, snap: &Snapshot) -> Step {
        let mut session = self.shared.lock();
        let Session {
            protocol,
            node,
            ended,
        } = &mut *session;
        let zone = node.as_ref().map_or("", |n| n.zone.as_str());
        for t in PUSH_ORDER {
            let Some(ts) = protocol.get(t) else {
                continue;
            };
            let (wildcard, names) = (ts.subscription.wildcard, &ts.subscription.names);
            if !protocol.should_send(t, &snap.version(t, wildcard, names, zone)) {
                continue;
            }
            let sel = snap.select(t, wildcard, names, zone);
            let nonce = protocol.record_sent(t, &sel.version);
            self.state
                .metrics
                .xds_pushes
                .get_or_create(&XdsResource::of(t.label()))
                .inc();
            return Step::Send(DiscoveryResponse {
                version_info: sel.version,
                resources: sel.resources,
                type_url: t.type_url().to_string(),
                nonce,
                ..Default::default()
            });
        }
        match ended.take() {
            Some(outcome) => Step::End(outcome),
            None => Step::Wait,
        }
    }
}
