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

use super::conn::{Acceptor, Full, Place, Places, XdsTls};
use super::protocol::{StreamState, Verdict};
use super::resources::{ResourceType, Snapshot};
use super::{Inputs, LbPolicy, XdsLimits};
use crate::metrics::{XdsMetrics, XdsResource};
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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch, Notify};
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
    /// Serves ADS on `listener` from the publications of `inputs`, with clusters of
    /// `policy`. Must be called within a Tokio runtime. Fails only if the listener's
    /// address cannot be read, before anything is spawned.
    pub fn start(
        listener: tokio::net::TcpListener,
        inputs: Inputs,
        policy: LbPolicy,
    ) -> std::io::Result<XdsServer> {
        Self::start_supervised(listener, inputs, policy, None, &Supervisor::detached())
    }

    /// Like [`XdsServer::start`], over TLS when `tls` is given, with its tasks
    /// watched by `supervisor`.
    pub fn start_supervised(
        listener: tokio::net::TcpListener,
        inputs: Inputs,
        policy: LbPolicy,
        tls: Option<XdsTls>,
        supervisor: &Supervisor,
    ) -> std::io::Result<XdsServer> {
        let addr = listener.local_addr()?;
        let state_tls = match &tls {
            None => "off",
            Some(t) if t.revocation.is_some() => "mutual",
            Some(_) => "on",
        };
        let builder = tonic::transport::Server::builder();
        let (shutdown, shutdown_rx) = watch::channel(false);
        let Inputs {
            publications,
            limits,
            metrics,
        } = inputs;
        let first = build(&publications.borrow(), policy, &Snapshot::default());
        let (snapshots, snapshots_rx) = watch::channel(Arc::new(first));
        let publisher = supervisor.spawn(
            "xDS publisher",
            publish(publications, policy, snapshots, shutdown_rx.clone()),
        );
        let acceptor = Acceptor {
            listener,
            tls,
            places: Arc::new(Places::default()),
            max: limits.max_connections,
            per_source: limits.max_connections_per_source,
            metrics: metrics.clone(),
        };
        let ads = Ads {
            limits,
            metrics,
            snapshots: snapshots_rx,
            shutdown: shutdown_rx.clone(),
            open: Arc::new(Places::default()),
            nack_log: Arc::new(Mutex::new(NackLog::default())),
        };
        let mut stop = shutdown_rx.clone();
        let (conns, conns_rx) = mpsc::channel(64);
        let accepting = supervisor.spawn("xDS listener", acceptor.run(conns, shutdown_rx));
        let incoming = futures_util::stream::unfold(conns_rx, |mut rx| async move {
            let conn = rx.recv().await?;
            Some((Ok::<_, std::io::Error>(conn), rx))
        });
        let server = supervisor.spawn("xDS server", async move {
            let result = builder
                // Streams live for hours: find dead clients without waiting for TCP.
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(10)))
                .max_concurrent_streams(Some(limits.max_streams_per_connection))
                .serve_with_incoming_shutdown(
                    AggregatedDiscoveryServiceServer::new(ads)
                        .max_decoding_message_size(limits.max_request_bytes),
                    incoming,
                    async move { stopping(&mut stop).await },
                )
                .await;
            accepting.abort();
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
    mut published: watch::Receiver<Arc<Published>>,
    policy: LbPolicy,
    snapshots: watch::Sender<Arc<Snapshot>>,
    mut shutdown: watch::Receiver<bool>,
) {
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
    limits: XdsLimits,
    metrics: Arc<XdsMetrics>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    shutdown: watch::Receiver<bool>,
    /// Streams open, against `limits.max_streams` and
    /// `limits.max_streams_per_source`.
    open: Arc<Places>,
    /// The NACK warnings' rate limit, over every stream.
    nack_log: Arc<Mutex<NackLog>>,
}

/// NACK warnings logged at most in one [`NACK_LOG_WINDOW`]: a client that rejects
/// every response, on many streams, cannot fill the log.
const NACK_LOG_BURST: u32 = 10;

/// The window of [`NACK_LOG_BURST`].
const NACK_LOG_WINDOW: Duration = Duration::from_secs(60);

/// The NACK warnings' rate limit: at most [`NACK_LOG_BURST`] in a window; the first
/// one logged after some were left out says how many.
#[derive(Debug, Default)]
pub(super) struct NackLog {
    window: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl NackLog {
    /// Whether a warning may be logged at `now`, and then how many were left out
    /// before it.
    pub(super) fn admit(&mut self, now: Instant) -> Option<u64> {
        if self
            .window
            .is_none_or(|start| now.saturating_duration_since(start) >= NACK_LOG_WINDOW)
        {
            self.window = Some(now);
            self.logged = 0;
        }
        if self.logged >= NACK_LOG_BURST {
            self.suppressed += 1;
            return None;
        }
        self.logged += 1;
        Some(std::mem::take(&mut self.suppressed))
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
        let (max, per_source) = (self.limits.max_streams, self.limits.max_streams_per_source);
        let slot = match self.open.take(peer.map(|p| p.ip()), max, per_source) {
            Ok(slot) => slot,
            Err(Full::All) => {
                self.metrics.refuse("streams");
                tracing::debug!(?peer, max, "xDS stream refused: too many open streams");
                return Err(Status::resource_exhausted(format!(
                    "this xDS server has {max} streams open, its limit"
                )));
            }
            Err(Full::Source) => {
                self.metrics.refuse("source_streams");
                tracing::debug!(
                    ?peer,
                    per_source,
                    "xDS stream refused: too many from its address"
                );
                return Err(Status::resource_exhausted(format!(
                    "{per_source} xDS streams are open from this address, the limit"
                )));
            }
        };
        let shared = Arc::new(Shared {
            session: Mutex::new(Session {
                protocol: StreamState::new(),
                node: None,
                ended: None,
                kept: Kept::default(),
            }),
            wake: Notify::new(),
        });
        let (alive, gone) = oneshot::channel();
        let requests = AdsStream {
            limits: self.limits,
            metrics: self.metrics.clone(),
            shared: shared.clone(),
            shutdown: self.shutdown.clone(),
            peer,
            alive,
            nack_log: self.nack_log.clone(),
            _slot: slot,
        };
        tokio::spawn(requests.run(request.into_inner()));
        let outbound = Outbound {
            metrics: self.metrics.clone(),
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
    /// What the stream keeps, against `xds_max_names_per_stream` and
    /// `xds_max_stream_bytes`.
    kept: Kept,
}

/// What one stream keeps for its client: names per type, and bytes in all.
#[derive(Debug, Default)]
struct Kept {
    /// Names subscribed, by type ([`ResourceType`] as index), and their bytes as
    /// [`name_bytes`] counts them.
    names: [(usize, usize); 4],
    /// The node id's and zone's bytes.
    node: usize,
}

impl Kept {
    fn names(&self) -> usize {
        self.names.iter().map(|(n, _)| n).sum()
    }

    fn bytes(&self) -> usize {
        self.node + self.names.iter().map(|(_, b)| b).sum::<usize>()
    }
}

/// What a kept name costs beyond its bytes: its `String` and its place in the set,
/// rounded up, so that the bytes counted are close to the memory held.
pub(crate) const NAME_OVERHEAD: usize = 64;

/// The names a request subscribes to (without `*`), and their bytes as a stream
/// keeps them. A name repeated in the request is counted each time: the request is
/// refused a little early rather than allowed a little late.
fn name_bytes(names: &[String]) -> (usize, usize) {
    names
        .iter()
        .filter(|n| *n != "*")
        .fold((0, 0), |(n, b), name| {
            (n + 1, b + name.len() + NAME_OVERHEAD)
        })
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
    limits: XdsLimits,
    metrics: Arc<XdsMetrics>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
    peer: Option<SocketAddr>,
    /// Closed when tonic drops the outbound side: the client is gone.
    alive: oneshot::Sender<()>,
    nack_log: Arc<Mutex<NackLog>>,
    _slot: Place,
}

impl AdsStream {
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) {
        self.metrics.streams.inc();
        tracing::debug!(peer = ?self.peer, "xDS stream opened");
        let outcome = self.serve(&mut requests).await;
        self.metrics.streams.dec();
        let mut session = self.shared.lock();
        // What it kept goes with the request side; the outbound side only reads it.
        let kept = std::mem::take(&mut session.kept);
        self.metrics.stream_bytes.dec_by(gauge(kept.bytes()));
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
                        let max = self.limits.max_resource_names;
                        if req.resource_names.len() > max {
                            self.metrics.refuse("resource_names");
                            return Err(Status::invalid_argument(format!(
                                "{} resource names in one request; the limit is {max}",
                                req.resource_names.len()
                            )));
                        }
                        self.on_request(req)?;
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

    /// Applies one request; an error ends the stream (a limit it broke).
    fn on_request(&self, req: DiscoveryRequest) -> Result<(), Status> {
        let limits = &self.limits;
        let mut session = self.shared.lock();
        if session.node.is_none() {
            if let Some(node) = &req.node {
                let zone = node.locality.as_ref().map_or("", |l| l.zone.as_str());
                let max = limits.max_node_bytes;
                if node.id.len() > max || zone.len() > max {
                    self.metrics.refuse("node");
                    return Err(Status::invalid_argument(format!(
                        "node id of {} bytes, zone of {}; the limit is {max} each",
                        node.id.len(),
                        zone.len()
                    )));
                }
                tracing::debug!(peer = ?self.peer, node = %node.id, zone, "xDS client");
                session.node = Some(ClientNode {
                    id: node.id.clone(),
                    zone: zone.to_string(),
                });
                session.kept.node = node.id.len() + zone.len();
                self.metrics.stream_bytes.inc_by(gauge(session.kept.node));
            }
        }
        let Some(t) = ResourceType::from_type_url(&req.type_url) else {
            tracing::debug!(node = %session.node_id(), type_url = %req.type_url, "xDS request for a type not served; ignored");
            return Ok(());
        };
        // The request replaces the type's subscription: what the stream would keep
        // then is what it keeps for the other types and this request's names.
        let (names, bytes) = name_bytes(&req.resource_names);
        let before = session.kept.names[t as usize];
        let (all_names, all_bytes) = (
            session.kept.names() - before.0 + names,
            session.kept.bytes() - before.1 + bytes,
        );
        if all_names > limits.max_names_per_stream {
            self.metrics.refuse("stream_names");
            return Err(Status::resource_exhausted(format!(
                "this stream would subscribe {all_names} names; the limit is {}",
                limits.max_names_per_stream
            )));
        }
        if all_bytes > limits.max_stream_bytes {
            self.metrics.refuse("stream_bytes");
            return Err(Status::resource_exhausted(format!(
                "this stream would keep {all_bytes} bytes of names; the limit is {}",
                limits.max_stream_bytes
            )));
        }
        let error = req
            .error_detail
            .as_ref()
            .map(|e| truncated(&e.message, MAX_NACK_DETAIL));
        let verdict =
            session
                .protocol
                .on_request(t, &req.resource_names, &req.response_nonce, error);
        if verdict != Verdict::Stale {
            session.kept.names[t as usize] = (names, bytes);
            let metric = &self.metrics.stream_bytes;
            metric.inc_by(gauge(bytes));
            metric.dec_by(gauge(before.1));
        }
        match verdict {
            Verdict::Stale => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), nonce = %req.response_nonce, "stale xDS request ignored");
            }
            Verdict::Nack { version, message } => {
                let admitted = self
                    .nack_log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .admit(Instant::now());
                match admitted {
                    Some(suppressed) => {
                        tracing::warn!(node = %session.node_id(), peer = ?self.peer, r#type = t.label(), %version,
                            accepted = ?session.protocol.get(t).and_then(|s| s.acked.as_deref()),
                            error = %message, suppressed_before = suppressed,
                            "xDS client rejected resources (NACK); it keeps its last accepted version");
                    }
                    None => {
                        self.metrics.nack_logs_suppressed.inc();
                    }
                }
                self.metrics
                    .nacks
                    .get_or_create(&XdsResource::of(t.label()))
                    .inc();
            }
            Verdict::Ack { version } => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), %version, "xDS ACK");
            }
            Verdict::Subscribe => {
                tracing::debug!(node = %session.node_id(), r#type = t.label(), names = req.resource_names.len(), "xDS subscription");
            }
        }
        Ok(())
    }
}

/// The outbound side of one ADS stream: the response stream tonic polls. Each poll
/// builds at most one response, from the snapshot current when its round began.
struct Outbound {
    metrics: Arc<XdsMetrics>,
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
            ..
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
            self.metrics
                .pushes
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

/// A byte count as the gauges take it.
fn gauge(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}
