//! The QUIC side of ingest: one task per agent connection.
//!
//! The session's rules (the hello and the certificate's identity, what the peer may
//! claim, the welcome or reject, reordered reports, the reply to each report, what a
//! fault costs) are the sans-IO [`ServerSession`], shared with the agent's side of the
//! protocol; this module is its async driver: the connection, the peer's grant from
//! its certificate and the policy, the hello's deadline, the caps, the rate limit and
//! the silence rule, the metrics, and the end of a connection whose certificate is
//! revoked or expires. What serves an admitted agent and its reports is the driver's
//! [`Upstream`] ([`super::upstream`]): the aggregator's own balancer
//! (the aggregator's `Local`) or another. Faults are counted and never reach other
//! connections: each has its own task and a bad one is closed.

use super::revocation::Verdict;
use super::upstream::{
    Admitted, Arrival, Downstream, Forwarded, Link, ProofRequest, Prover, Trunk, Upstream,
};
use super::Ingest;
use crate::metrics::IngestMetrics;
use ballast_shared::protocol::Protocol;
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::ProtocolError;
use ballast_shared::session::{Peer, ServerConfig, ServerError, ServerEvent, ServerSession};
use ballast_shared::tls::{CertInfo, CertificateDer};
use ballast_shared::trunk::TrunkProtocol;
use ballast_shared::wire::Proof;
use ballast_shared::wire::{Message, Reject};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// QUIC application error codes for closing connections; the protocol's own.
pub use ballast_shared::session::close;

/// The TLS alerts a refused client certificate ends its handshake with (RFC 8446),
/// each with the reason it is counted under: the alert says why. rustls sends
/// `unknown_ca` for a certificate from another CA and also for one whose revocation
/// status cannot be told (an expired revocation list); `bad_certificate` for one it
/// cannot parse or that is not valid for its use; `certificate_required` when the
/// client sent none; `no_application_protocol` when the client offered no version of
/// the agent or trunk protocol this build speaks (a peer more than one release apart).
const HANDSHAKE_ALERTS: [(u8, &str); 6] = [
    (42, "bad_certificate"),
    (44, "revoked"),
    (45, "expired"),
    (48, "unknown_ca"),
    (116, "no_certificate"),
    (120, "no_common_protocol"),
];

/// The reason a hello naming a zone the policy does not allow its node is counted
/// under (`ballast_reports_rejected_total`).
pub(crate) const ZONE_NOT_ALLOWED: &str = "zone_not_allowed";

/// Accepts connections until the endpoint closes, each served by a task of its own on
/// the caller's runtime, its agent by `upstream`.
pub async fn serve<U: Upstream>(
    endpoint: quinn::Endpoint,
    metrics: Arc<IngestMetrics>,
    ingest: Arc<Ingest>,
    upstream: Arc<U>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let Some(slot) = ingest.connections.open(ingest.limits.quic_max_connections) else {
            // Refused before any cryptography: the cap is the whole point.
            tracing::debug!(open = ingest.connections.total(), remote = %incoming.remote_address(),
                "agent connection refused: at the connection limit");
            metrics.reject_connection("connections");
            incoming.refuse();
            continue;
        };
        if ingest.limits.quic_retry && !incoming.remote_address_validated() {
            // A stateless round trip proves the source address before a handshake is
            // spent on it; the client comes back with the token.
            if incoming.retry().is_err() {
                metrics.reject_connection("retry");
            }
            continue;
        }
        let metrics = metrics.clone();
        let ingest = ingest.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let mut slot = slot;
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    // Missing, untrusted, expired and revoked client certificates end
                    // here.
                    let reason = handshake_reason(&e);
                    tracing::info!(error = %e, reason, "agent handshake failed");
                    metrics.reject_connection(reason);
                    return;
                }
            };
            // A relay's link: its trunk of reports, or the routes it follows.
            let routes = crate::routes_feed::is_routes(&conn);
            if routes || is_trunk(&conn) {
                let trunk = Trunk {
                    conn: &conn,
                    metrics: &metrics,
                    ingest: &ingest,
                    place: &mut slot,
                };
                let (link, result) = if routes {
                    ("routes", upstream.serve_routes(trunk).await)
                } else {
                    ("trunk", upstream.trunk(trunk).await)
                };
                if let Err(reason) = result {
                    tracing::debug!(remote = %conn.remote_address(), link, reason, "relay link ended");
                }
                return;
            }
            // A client that offered no ALPN at all gets the current protocol, as before
            // there were versions to choose from.
            let protocol = Protocol::negotiated(&conn).unwrap_or(Protocol::CURRENT);
            let by_protocol = metrics.agent_connections(protocol);
            metrics.connections_open.inc();
            by_protocol.inc();
            let result = handle(&conn, protocol, &metrics, &ingest, &*upstream, &mut slot).await;
            by_protocol.dec();
            metrics.connections_open.dec();
            if let Err(reason) = result {
                tracing::debug!(remote = %conn.remote_address(), reason, "agent connection ended");
            }
        });
    }
}

/// The metric reason of a failed handshake: the TLS alert that refused the client's
/// certificate says why ([`HANDSHAKE_ALERTS`]); any other failure (a wrong ALPN, a
/// client that went away) is `handshake`.
fn handshake_reason(e: &quinn::ConnectionError) -> &'static str {
    if let quinn::ConnectionError::TransportError(t) = e {
        for (alert, reason) in HANDSHAKE_ALERTS {
            if t.code == quinn::TransportErrorCode::crypto(alert) {
                return reason;
            }
        }
    }
    "handshake"
}

/// Whether `conn` negotiated a version of the relays' protocol: a trunk, not an agent.
fn is_trunk(conn: &quinn::Connection) -> bool {
    TrunkProtocol::negotiated(conn).is_some()
}

/// The certificate of a peer: its chain as presented (leaf first) and what its leaf
/// says.
pub(crate) fn certificate_of(
    conn: &quinn::Connection,
) -> Result<(Vec<CertificateDer<'static>>, CertInfo), ballast_shared::tls::TlsError> {
    let chain = ballast_shared::tls::peer_chain(conn)?;
    let leaf = chain
        .first()
        .ok_or(ballast_shared::tls::TlsError::NoIdentity)?;
    let info = CertInfo::parse(leaf)?;
    Ok((chain, info))
}

/// Who an agent with the certificate `info` is, and what it may claim from `source`
/// under the policy.
pub(crate) fn peer(ingest: &Ingest, info: CertInfo, source: std::net::IpAddr) -> Peer {
    let grant = ingest
        .policy
        .grant(&info.identity, info.spiffe_id.as_deref(), &info.services);
    Peer {
        identity: info.identity,
        source,
        grant,
    }
}

/// How long a challenge may wait for the agent to read it.
const CHALLENGE_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection's end of its agent's proofs of possession: the challenges a relay's
/// primaries send go out on the hello stream, and the agent's proofs come back on it,
/// in the same order.
struct Proofs {
    protocol: Protocol,
    requests: tokio::sync::mpsc::UnboundedReceiver<ProofRequest>,
    waiting: VecDeque<tokio::sync::oneshot::Sender<Option<Proof>>>,
    /// Whether the agent's side of the stream is still open.
    reading: bool,
}

impl Proofs {
    /// Hands a challenge to the agent; one that cannot take it (`ballast/1`, or its
    /// stream ended) is answered `None` at once.
    async fn ask(
        &mut self,
        request: Option<ProofRequest>,
        session: &ServerSession,
        send: &mut quinn::SendStream,
    ) {
        let Some(request) = request else { return };
        if self.protocol != Protocol::CURRENT || !self.reading {
            let _ = request.answer.send(None);
            return;
        }
        let sent = match session.challenge_frame(&request.challenge) {
            Ok(frame) => matches!(
                tokio::time::timeout(CHALLENGE_WRITE_TIMEOUT, send.write_all(&frame)).await,
                Ok(Ok(()))
            ),
            Err(_) => false,
        };
        if sent {
            self.waiting.push_back(request.answer);
        } else {
            let _ = request.answer.send(None);
        }
    }

    /// Takes what the agent sent on its hello stream: each proof answers the oldest
    /// challenge waiting. Anything else there breaks the protocol.
    fn take(
        &mut self,
        read: Result<Option<usize>, quinn::ReadError>,
        buf: &[u8],
        session: &mut ServerSession,
    ) -> Result<(), ProtocolError> {
        let n = match read {
            Ok(Some(n)) => n,
            Ok(None) | Err(_) => {
                // The agent finished its stream (one of the previous release does
                // after its hello): no proof can come any more.
                self.reading = false;
                self.waiting.clear();
                return Ok(());
            }
        };
        for proof in session.handle_proofs(buf.get(..n).unwrap_or_default())? {
            // A proof nobody asked for is dropped.
            if let Some(answer) = self.waiting.pop_front() {
                let _ = answer.send(Some(proof));
            }
        }
        Ok(())
    }
}

/// Closes a connection whose agent sent something other than proofs on its hello
/// stream: the reason.
fn proof_fault(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    node: &str,
    e: &ProtocolError,
) -> &'static str {
    tracing::warn!(%node, error = %e, "connection closed: a bad frame on the hello stream");
    metrics.reject_connection(e.label());
    conn.close(close::PROTOCOL.into(), b"a bad frame on the hello stream");
    "bad frame on the hello stream"
}

async fn handle<U: Upstream>(
    conn: &quinn::Connection,
    protocol: Protocol,
    metrics: &IngestMetrics,
    ingest: &Ingest,
    upstream: &U,
    slot: &mut super::limits::Slot,
) -> Result<(), &'static str> {
    let (chain, info) = match certificate_of(conn) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "client certificate carries no identity");
            metrics.reject_connection("no_identity");
            conn.close(close::REJECTED.into(), b"no identity");
            return Err("no identity");
        }
    };
    if info.has_role(ballast_shared::pki::RELAY_ROLE) {
        // A relay never registers as a node: its certificate vouches for agents.
        tracing::warn!(relay = %info.identity, "a relay's certificate connected as an agent");
        metrics.reject_connection("relay_as_agent");
        conn.close(
            close::REJECTED.into(),
            b"a relay certificate is not an agent's",
        );
        return Err("relay as agent");
    }
    let not_after_unix_s = info.not_after_unix_s;
    let zones = ingest
        .policy
        .zones(&info.identity, info.spiffe_id.as_deref());
    let peer = peer(ingest, info, conn.remote_address().ip());
    let mut revocations = admit_identity(conn, metrics, ingest, slot, &peer.identity, &chain)?;
    // The report interval is the upstream's, set when it admits the hello: until then
    // the session sends nothing that carries one.
    let config = ServerConfig {
        protocol,
        ..ServerConfig::new(0)
    };
    let mut session = ServerSession::new(peer, config, now());
    let (mut send, mut recv) = loop {
        tokio::select! {
            s = conn.accept_bi() => match s {
                Ok(s) => break s,
                Err(_) => return Err("closed before hello"),
            },
            _ = until(session.poll_timeout()) => {
                if let Err(e) = session.handle_timeout(now()) {
                    return Err(fault(conn, metrics, &session, &e));
                }
            }
        }
    };
    let mut buf = [0u8; 512];
    let hello = loop {
        let read = tokio::select! {
            r = recv.read(&mut buf) => r,
            _ = until(session.poll_timeout()) => {
                if let Err(e) = session.handle_timeout(now()) {
                    return Err(fault(conn, metrics, &session, &e));
                }
                continue;
            }
        };
        let event = match read {
            Ok(Some(n)) => session.handle_stream(now(), buf.get(..n).unwrap_or_default()),
            // Finished or reset before the hello was whole.
            Ok(None) | Err(_) => session.handle_stream_end().map(|()| None),
        };
        match event {
            Ok(Some(ServerEvent::Hello(h))) => break h,
            Ok(Some(ServerEvent::Refused { reject, frame })) => {
                let counted = reject.reason.to_string();
                return refuse(conn, metrics, &counted, &session, &mut send, reject, frame).await;
            }
            Ok(_) => continue,
            Err(e) => return Err(fault(conn, metrics, &session, &e)),
        }
    };
    if let Err(detail) = zones.check(&hello.node, &hello.zone) {
        // Told as a service the node may not serve there: agents of every version know
        // that reason; the count says which.
        let reason = ballast_shared::wire::RejectReason::ServiceNotAllowed;
        return match session.reject(reason, detail.clone()) {
            Ok(frame) => {
                let reject = Reject { reason, detail };
                refuse(
                    conn,
                    metrics,
                    ZONE_NOT_ALLOWED,
                    &session,
                    &mut send,
                    reject,
                    frame,
                )
                .await
            }
            Err(_) => Err("reject failed"),
        };
    }
    let (prover, requests) = Prover::new();
    let mut proofs = Proofs {
        protocol,
        requests,
        waiting: VecDeque::new(),
        reading: true,
    };
    let peer = session.peer().clone();
    let arrival = Arrival {
        peer: &peer,
        chain: &chain,
        remote: conn.remote_address(),
        hello: &hello,
        prover: Some(&prover),
    };
    // A relay's primary may challenge the agent while it is admitted: the challenges
    // go out on the hello stream, and the proofs come back on it.
    let admitted = {
        let admit = upstream.admit(arrival);
        tokio::pin!(admit);
        loop {
            tokio::select! {
                admitted = &mut admit => break admitted,
                request = proofs.requests.recv() => proofs.ask(request, &session, &mut send).await,
                read = recv.read(&mut buf), if proofs.reading => {
                    if let Err(e) = proofs.take(read, &buf, &mut session) {
                        return Err(proof_fault(conn, metrics, &hello.node, &e));
                    }
                }
            }
        }
    };
    let (interval_ms, mut link) = match admitted {
        Ok(Admitted { interval_ms, link }) => (interval_ms, link),
        Err(reject) => {
            return match session.reject(reject.reason, reject.detail.clone()) {
                Ok(frame) => {
                    let counted = reject.reason.to_string();
                    refuse(conn, metrics, &counted, &session, &mut send, reject, frame).await
                }
                Err(_) => Err("reject failed"),
            };
        }
    };
    session.set_interval_ms(interval_ms);
    let Ok(welcome) = session.welcome() else {
        return Err("welcome failed");
    };
    if send.write_all(&welcome).await.is_err() {
        return Err("welcome failed");
    }
    if protocol != Protocol::CURRENT {
        // No challenge can follow in the previous protocol.
        let _ = send.finish();
    }
    tracing::info!(node = %hello.node, service = %hello.service, address = %hello.address, zone = %hello.zone, agent_version = %hello.version, "agent connected");

    let expired = tokio::time::sleep(expires_in(not_after_unix_s));
    tokio::pin!(expired);
    let silence_limit =
        super::limits::report_timeout(ingest.limits.quic_report_timeout_ms, interval_ms);
    let silence = tokio::time::sleep(silence_limit);
    tokio::pin!(silence);
    let mut rate = super::limits::Rate::new(
        ingest.limits.quic_max_datagrams_per_second,
        std::time::Instant::now(),
    );
    let mut watching = true;
    loop {
        let bytes = tokio::select! {
            read = conn.read_datagram() => match read {
                Ok(b) => b,
                Err(_) => return Ok(()),
            },
            request = proofs.requests.recv() => {
                proofs.ask(request, &session, &mut send).await;
                continue;
            }
            read = recv.read(&mut buf), if proofs.reading => {
                if let Err(e) = proofs.take(read, &buf, &mut session) {
                    return Err(proof_fault(conn, metrics, &hello.node, &e));
                }
                continue;
            }
            _ = &mut silence => {
                tracing::info!(node = %hello.node, after = ?silence_limit, "connection closed: no report");
                metrics.reject_connection("no_reports");
                conn.close(close::NORMAL.into(), b"no report");
                return Err("no report");
            }
            changed = revocations.changed(), if watching => {
                if changed.is_err() {
                    // The list is gone with the daemon: nothing more changes.
                    watching = false;
                    continue;
                }
                match credentials_end(conn, metrics, ingest, &hello.node, &chain) {
                    Some(end) => return Err(end),
                    None => continue,
                }
            }
            down = link.next() => match down {
                Downstream::Reply(reply) => {
                    match to_agent(protocol, reply) {
                        Ok(reply) => { let _ = conn.send_datagram(reply); }
                        Err(e) => {
                            tracing::debug!(node = %hello.node, error = %e, "a reply the agent's protocol cannot carry");
                            metrics.reject("untranslatable");
                        }
                    }
                    continue;
                }
                Downstream::Close(close) => {
                    tracing::info!(node = %hello.node, service = %hello.service,
                        reason = close.reason, "connection closed: {}", close.detail);
                    metrics.reject_connection(close.reason);
                    conn.close(close.code.into(), close.detail.as_bytes());
                    return Ok(());
                }
            },
            _ = &mut expired => {
                let left = expires_in(not_after_unix_s);
                if left.is_zero() {
                    return Err(close_for(conn, metrics, &hello.node, Verdict::Expired));
                }
                expired.as_mut().reset(tokio::time::Instant::now() + left);
                continue;
            }
        };
        if !rate.take(std::time::Instant::now()) {
            // Dropped unread: a flood never reaches the decoder or the balancer's lock.
            metrics.reject("rate_limited");
            continue;
        }
        match session.handle_datagram(&bytes) {
            Ok(ServerEvent::Report(report)) => {
                silence
                    .as_mut()
                    .reset(tokio::time::Instant::now() + silence_limit);
                // The upstream takes today's protocol: a report of the previous one is
                // translated here, at the edge, and only for the agents that speak it.
                let current;
                let raw = if protocol == Protocol::CURRENT {
                    &bytes[..]
                } else {
                    match Protocol::CURRENT.encode(&Message::Report(report)) {
                        Ok(b) => {
                            current = b;
                            &current[..]
                        }
                        Err(_) => {
                            metrics.reject("untranslatable");
                            continue;
                        }
                    }
                };
                match link.report(&report, raw) {
                    Forwarded::Assigned {
                        assignment,
                        accepted,
                    } => {
                        if accepted {
                            metrics.reports_accepted.inc();
                            #[cfg(feature = "gate-probe")]
                            {
                                ballast_shared::gate_probe::spin("direct");
                                ballast_shared::gate_probe::leak();
                            }
                        } else {
                            metrics.reject("reordered");
                        }
                        // Answered even when another session of the node got ahead, so
                        // that this one still hears its weight.
                        if let Ok(reply) = session.reply(&assignment) {
                            let _ = conn.send_datagram(reply.into());
                        }
                    }
                    Forwarded::Queued => {}
                    Forwarded::Refused(reason) => metrics.reject(&reason.to_string()),
                    Forwarded::Dropped(reason) => metrics.reject(reason),
                }
            }
            Ok(ServerEvent::Reordered { .. }) => metrics.reject("reordered"),
            Ok(_) => {}
            Err(e) => {
                let reason = fault(conn, metrics, &session, &e);
                if session.close_code().is_some() {
                    return Err(reason);
                }
            }
        }
    }
}

/// A reply from the upstream (today's protocol) in the agent's `protocol`.
fn to_agent(
    protocol: Protocol,
    reply: bytes::Bytes,
) -> Result<bytes::Bytes, ballast_shared::protocol::TranslateError> {
    if protocol == Protocol::CURRENT {
        return Ok(reply);
    }
    protocol
        .translate(Protocol::CURRENT, &reply)
        .map(bytes::Bytes::from)
}

/// Counts the connection as `identity`'s (a node's or a relay's) and checks its
/// certificate under the revocation list in force; closes it, with the reason, if it
/// is over the per-node cap or its certificate is no longer good. The receiver that
/// sees the list's changes from before the check on.
pub(crate) fn admit_identity(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    ingest: &Ingest,
    slot: &mut super::limits::Slot,
    identity: &str,
    chain: &[CertificateDer<'static>],
) -> Result<tokio::sync::watch::Receiver<u64>, &'static str> {
    let per_node = ingest.limits.quic_max_connections_per_identity;
    if !slot.claim(identity, per_node) {
        tracing::warn!(node = %identity, limit = per_node, "connection refused: the node holds too many");
        metrics.reject_connection("identity_connections");
        conn.close(
            close::REJECTED.into(),
            b"too many connections for this node",
        );
        return Err("too many connections for this node");
    }
    // Subscribed before the first check, so that a list put in force after the
    // handshake is never missed.
    let revocations = ingest.revocation.subscribe();
    match credentials_end(conn, metrics, ingest, identity, chain) {
        Some(end) => Err(end),
        None => Ok(revocations),
    }
}

/// The longest a connection's expiry timer is set for; a later expiry sets it again
/// when it fires (and the wall clock may have moved meanwhile).
const EXPIRY_TIMER_MAX: Duration = Duration::from_secs(24 * 3600);

/// How long until a certificate valid until `not_after_unix_s` expires: zero if it
/// has, and at most [`EXPIRY_TIMER_MAX`].
pub(crate) fn expires_in(not_after_unix_s: i64) -> Duration {
    let now_ms = i64::try_from(ballast_shared::unix_ms()).unwrap_or(i64::MAX);
    let left_ms = not_after_unix_s
        .saturating_mul(1000)
        .saturating_sub(now_ms)
        .max(0);
    Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)).min(EXPIRY_TIMER_MAX)
}

/// Closes the connection if its certificate is now revoked or expired (the list in
/// force changed since the handshake); the reason, if it did.
fn credentials_end(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    ingest: &Ingest,
    node: &str,
    chain: &[CertificateDer<'static>],
) -> Option<&'static str> {
    match ingest.revocation.verdict(chain) {
        Verdict::Valid => None,
        v => Some(close_for(conn, metrics, node, v)),
    }
}

/// Closes a connection whose certificate is no longer good, with the code that says
/// why, and counts it.
pub(crate) fn close_for(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    node: &str,
    verdict: Verdict,
) -> &'static str {
    let (code, reason, text): (u32, &'static str, &[u8]) = match verdict {
        Verdict::Revoked => (close::REVOKED, "revoked", b"certificate revoked"),
        Verdict::Expired | Verdict::Valid => (close::EXPIRED, "expired", b"certificate expired"),
    };
    tracing::warn!(%node, reason, "closing the connection of a node whose certificate is no longer valid");
    metrics.reject_connection(reason);
    conn.close(code.into(), text);
    reason
}

/// Counts a fault of the session, and closes the connection when the session ended
/// over it. Returns the fault in words, for the log.
fn fault(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    session: &ServerSession,
    e: &ServerError,
) -> &'static str {
    match e {
        ServerError::HelloTimeout(_) => metrics.reject_connection("hello_timeout"),
        ServerError::TooManyBadDatagrams { .. } => {
            metrics.reject(e.label());
            metrics.reject_connection("malformed");
        }
        _ => metrics.reject(e.label()),
    }
    if let Some(code) = session.close_code() {
        conn.close(code.into(), e.to_string().as_bytes());
    }
    e.label()
}

/// Sends a reject, counts it by reason, and closes the connection.
async fn refuse(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    counted: &str,
    session: &ServerSession,
    send: &mut quinn::SendStream,
    reject: Reject,
    frame: Vec<u8>,
) -> Result<(), &'static str> {
    let identity = session.identity();
    tracing::warn!(%identity, reason = %reject.reason, counted, detail = %reject.detail, "hello rejected");
    metrics.reject(counted);
    let _ = send.write_all(&frame).await;
    let _ = send.finish();
    // Give the reject a moment to leave before the close overtakes it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.close(close::REJECTED.into(), b"rejected");
    Err("rejected")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::Close;
    use ballast_shared::frame;
    use ballast_shared::pki::Ca;
    use ballast_shared::wire::{Hello, Message, NodeState, Reply, Report};
    use bytes::Bytes;
    use std::net::SocketAddr;
    use tokio::sync::mpsc;

    /// What the queueing upstream saw of its agent.
    #[derive(Debug)]
    struct Seen {
        node: String,
        leaf: Vec<u8>,
        remote: SocketAddr,
    }

    /// An upstream that hands reports on, as a relay's does: every report is queued,
    /// and what goes back to the agent comes from the test through `Link::next`.
    struct Queueing {
        seen: mpsc::UnboundedSender<Seen>,
        reports: mpsc::UnboundedSender<Vec<u8>>,
        downstream: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Downstream>>>,
    }

    struct QueueingLink {
        reports: mpsc::UnboundedSender<Vec<u8>>,
        downstream: mpsc::UnboundedReceiver<Downstream>,
    }

    impl Upstream for Queueing {
        type Link = QueueingLink;

        async fn admit(&self, arrival: Arrival<'_>) -> Result<Admitted<QueueingLink>, Reject> {
            let _ = self.seen.send(Seen {
                node: arrival.hello.node.clone(),
                leaf: arrival
                    .chain
                    .first()
                    .map(|c| c.to_vec())
                    .unwrap_or_default(),
                remote: arrival.remote,
            });
            let downstream = self
                .downstream
                .lock()
                .expect("lock")
                .take()
                .expect("one agent");
            Ok(Admitted {
                interval_ms: 2000,
                link: QueueingLink {
                    reports: self.reports.clone(),
                    downstream,
                },
            })
        }
    }

    impl Link for QueueingLink {
        fn report(&mut self, _report: &Report, raw: &[u8]) -> Forwarded {
            let _ = self.reports.send(raw.to_vec());
            Forwarded::Queued
        }

        async fn next(&mut self) -> Downstream {
            match self.downstream.recv().await {
                Some(d) => d,
                None => std::future::pending().await,
            }
        }
    }

    #[tokio::test]
    async fn a_queued_report_is_answered_when_the_upstream_replies_and_it_may_close() {
        let ca = Ca::generate("test CA").expect("CA");
        let server = ca
            .issue_server(&["localhost".to_string()])
            .expect("server certificate");
        let ca_certs = ballast_shared::tls::certs_from_pem(&ca.pem().cert, "CA").expect("CA");
        let settings = crate::Settings::new(ballast_shared::config::TlsFiles::in_dir(
            std::path::Path::new("/etc/ballast/tls"),
            "server",
        ));
        let (server_config, ingest) = crate::setup(
            &settings,
            server.identity("server").expect("identity"),
            &ca_certs,
        )
        .expect("ingest");
        let endpoint =
            quinn::Endpoint::server(server_config, SocketAddr::from(([127, 0, 0, 1], 0)))
                .expect("server endpoint");
        let addr = endpoint.local_addr().expect("address");
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let (reports_tx, mut reports) = mpsc::unbounded_channel();
        let (down, down_rx) = mpsc::unbounded_channel();
        let upstream = Arc::new(Queueing {
            seen: seen_tx,
            reports: reports_tx,
            downstream: std::sync::Mutex::new(Some(down_rx)),
        });
        let metrics = Arc::new(IngestMetrics::new());
        tokio::spawn(serve(
            endpoint.clone(),
            metrics.clone(),
            Arc::new(ingest),
            upstream,
        ));

        let node = ca
            .issue_node("n1", &["web".to_string()])
            .expect("node certificate");
        let client_config = ballast_shared::tls::client_config(
            node.pem.identity("node").expect("node identity"),
            &ca_certs,
        )
        .expect("client config");
        let mut client =
            quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).expect("client");
        client.set_default_client_config(client_config);
        let conn = client
            .connect(addr, "localhost")
            .expect("connect")
            .await
            .expect("handshake");
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        let hello = Hello {
            node: "n1".into(),
            service: "web".into(),
            address: "127.0.0.1:8080".into(),
            zone: String::new(),
            version: "test".into(),
        };
        frame::write(&mut send, &Message::Hello(hello))
            .await
            .expect("hello");
        let _ = send.finish();
        match frame::read(&mut recv).await.expect("answer") {
            Message::Welcome(w) => assert_eq!(w.interval_ms, 2000),
            other => panic!("not welcomed: {other:?}"),
        }
        let seen = seen.recv().await.expect("admitted");
        assert_eq!(seen.node, "n1");
        let leaf = ballast_shared::tls::certs_from_pem(&node.pem.cert, "node").expect("leaf");
        assert_eq!(seen.leaf, leaf[0].to_vec());
        assert_eq!(seen.remote, client.local_addr().expect("client address"));

        let report = Report {
            seq: 1,
            cpu: 0.5,
            inflight: 3,
            capacity: 0,
            error_rate: None,
            state: NodeState::Serving,
        };
        let raw = ballast_shared::wire::encode(&Message::Report(report)).expect("encode");
        conn.send_datagram(Bytes::from(raw.clone()))
            .expect("report");
        let forwarded = tokio::time::timeout(Duration::from_secs(5), reports.recv())
            .await
            .expect("handed on in time")
            .expect("handed on");
        assert_eq!(
            forwarded, raw,
            "the report's datagram is handed on as it came"
        );

        // The upstream's reply, later, reaches the agent as it is.
        let reply = Reply {
            weight: 1.5,
            cycle: 7,
            interval_ms: 2000,
            draining: false,
            load: 0.5,
            inflight_trusted: true,
        };
        let reply = Bytes::from(
            ballast_shared::wire::encode(&Message::Reply(reply)).expect("encode reply"),
        );
        down.send(Downstream::Reply(reply.clone())).expect("reply");
        let got = tokio::time::timeout(Duration::from_secs(5), conn.read_datagram())
            .await
            .expect("a reply in time")
            .expect("a reply");
        assert_eq!(got, reply);

        // And its close ends the connection with its code.
        down.send(Downstream::Close(Close {
            code: close::MOVED,
            reason: "moved",
            detail: "service moved".into(),
        }))
        .expect("close");
        let closed = tokio::time::timeout(Duration::from_secs(5), conn.closed())
            .await
            .expect("closed in time");
        match closed {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(c.error_code, quinn::VarInt::from_u32(close::MOVED));
            }
            other => panic!("closed otherwise: {other}"),
        }
        assert_eq!(
            metrics.reports_accepted.get(),
            0,
            "counted by the upstream, not here"
        );
        endpoint.close(quinn::VarInt::from_u32(close::NORMAL), b"done");
    }
}
