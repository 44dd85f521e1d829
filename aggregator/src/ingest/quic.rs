//! The QUIC side of ingest: one task per agent connection.
//!
//! The session's rules (the hello and the certificate's identity, what the peer may
//! claim, the welcome or reject, reordered reports, the reply to each report, what a
//! fault costs) are the sans-IO [`ServerSession`], shared with the agent's side of the
//! protocol; this module is its async driver: the connection, the peer's grant from
//! its certificate and the policy, the hello's deadline, the metrics, the calls into
//! the balancer, which all go through [`balance`], and the end of a connection whose
//! certificate is revoked or expires. Faults are counted and never reach other
//! connections: each has its own task and a bad one is closed.

use super::revocation::Verdict;
use super::Ingest;
use crate::state::State;
use ballast_balance::{BalanceError, Observation, Published};
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::{
    Assignment, Peer, ServerConfig, ServerError, ServerEvent, ServerSession,
};
use ballast_shared::tls::{CertInfo, CertificateDer};
use ballast_shared::wire::{Hello, Reject, RejectReason, Report};
use std::sync::Arc;
use std::time::Duration;

/// QUIC application error codes for closing connections; the protocol's own.
pub(crate) use ballast_shared::session::close;

/// The TLS alerts a refused client certificate ends its handshake with (RFC 8446),
/// each with the reason it is counted under: the alert says why. rustls sends
/// `unknown_ca` for a certificate from another CA and also for one whose revocation
/// status cannot be told (an expired revocation list); `bad_certificate` for one it
/// cannot parse or that is not valid for its use; `certificate_required` when the
/// client sent none.
const HANDSHAKE_ALERTS: [(u8, &str); 5] = [
    (42, "bad_certificate"),
    (44, "revoked"),
    (45, "expired"),
    (48, "unknown_ca"),
    (116, "no_certificate"),
];

/// Accepts connections until the endpoint closes, each served by a task of its own on
/// the caller's runtime.
pub(crate) async fn serve(endpoint: quinn::Endpoint, state: Arc<State>, ingest: Arc<Ingest>) {
    while let Some(incoming) = endpoint.accept().await {
        let Some(slot) = ingest.connections.open(ingest.limits.quic_max_connections) else {
            // Refused before any cryptography: the cap is the whole point.
            tracing::debug!(open = ingest.connections.total(), remote = %incoming.remote_address(),
                "agent connection refused: at the connection limit");
            state.metrics.reject_connection("connections");
            incoming.refuse();
            continue;
        };
        if ingest.limits.quic_retry && !incoming.remote_address_validated() {
            // A stateless round trip proves the source address before a handshake is
            // spent on it; the client comes back with the token.
            if incoming.retry().is_err() {
                state.metrics.reject_connection("retry");
            }
            continue;
        }
        let state = state.clone();
        let ingest = ingest.clone();
        tokio::spawn(async move {
            let mut slot = slot;
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    // Missing, untrusted, expired and revoked client certificates end
                    // here.
                    let reason = handshake_reason(&e);
                    tracing::info!(error = %e, reason, "agent handshake failed");
                    state.metrics.reject_connection(reason);
                    return;
                }
            };
            state.metrics.connections_open.inc();
            let result = handle(&conn, &state, &ingest, &mut slot).await;
            state.metrics.connections_open.dec();
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

/// Who the peer of `conn` is and what it may claim, from its certificate and the
/// policy; with its chain, and when its certificate expires.
fn peer_of(
    conn: &quinn::Connection,
    ingest: &Ingest,
) -> Result<(Peer, Vec<CertificateDer<'static>>, i64), ballast_shared::tls::TlsError> {
    let chain = ballast_shared::tls::peer_chain(conn)?;
    let leaf = chain
        .first()
        .ok_or(ballast_shared::tls::TlsError::NoIdentity)?;
    let info = CertInfo::parse(leaf)?;
    let grant = ingest.policy.grant(&info.identity, &info.services);
    let peer = Peer {
        identity: info.identity,
        source: conn.remote_address().ip(),
        grant,
    };
    Ok((peer, chain, info.not_after_unix_s))
}

async fn handle(
    conn: &quinn::Connection,
    state: &State,
    ingest: &Ingest,
    slot: &mut super::limits::Slot,
) -> Result<(), &'static str> {
    let (peer, chain, not_after_unix_s) = match peer_of(conn, ingest) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "client certificate carries no identity");
            state.metrics.reject_connection("no_identity");
            conn.close(close::REJECTED.into(), b"no identity");
            return Err("no identity");
        }
    };
    let per_node = ingest.limits.quic_max_connections_per_identity;
    if !slot.claim(&peer.identity, per_node) {
        tracing::warn!(node = %peer.identity, limit = per_node, "connection refused: the node holds too many");
        state.metrics.reject_connection("identity_connections");
        conn.close(
            close::REJECTED.into(),
            b"too many connections for this node",
        );
        return Err("too many connections for this node");
    }
    // Subscribed before the first check, so that a list put in force after the
    // handshake is never missed.
    let mut revocations = ingest.revocation.subscribe();
    if let Some(end) = credentials_end(conn, state, ingest, &peer.identity, &chain) {
        return Err(end);
    }
    let config = ServerConfig::new(state.report_interval_ms);
    let mut session = ServerSession::new(peer, config, now());
    let (mut send, mut recv) = loop {
        tokio::select! {
            s = conn.accept_bi() => match s {
                Ok(s) => break s,
                Err(_) => return Err("closed before hello"),
            },
            _ = until(session.poll_timeout()) => {
                if let Err(e) = session.handle_timeout(now()) {
                    return Err(fault(conn, state, &session, &e));
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
                    return Err(fault(conn, state, &session, &e));
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
                return refuse(conn, state, session.identity(), &mut send, reject, frame).await
            }
            Ok(_) => continue,
            Err(e) => return Err(fault(conn, state, &session, &e)),
        }
    };
    // Subscribed before ownership is checked, so that a loss after the check is seen.
    let mut losses = state.ownership.as_ref().map(|o| o.watch_losses());
    let not_owner = state
        .ownership
        .as_ref()
        .filter(|o| !o.owns(&hello.service))
        .map(|o| (RejectReason::NotOwner, o.refusal(&hello.service)));
    let refused = match (not_owner, unconfigured(state, ingest, &hello.service)) {
        (Some(refusal), _) => Some(refusal),
        (None, Some(detail)) => Some((RejectReason::UnknownService, detail)),
        (None, None) => match balance(state, &hello, Ask::Register) {
            Answer::Refused(reason, detail) => Some((reason, detail)),
            _ => None,
        },
    };
    let welcome = match refused {
        Some((reason, detail)) => {
            let reject = Reject { reason, detail };
            return match session.reject(reject.reason, reject.detail.clone()) {
                Ok(frame) => {
                    refuse(conn, state, session.identity(), &mut send, reject, frame).await
                }
                Err(_) => Err("reject failed"),
            };
        }
        None => session.welcome(),
    };
    let Ok(welcome) = welcome else {
        return Err("welcome failed");
    };
    if send.write_all(&welcome).await.is_err() {
        return Err("welcome failed");
    }
    let _ = send.finish();
    tracing::info!(node = %hello.node, service = %hello.service, address = %hello.address, zone = %hello.zone, agent_version = %hello.version, "agent connected");

    let expired = tokio::time::sleep(expires_in(not_after_unix_s));
    tokio::pin!(expired);
    let silence_limit = super::limits::report_timeout(
        ingest.limits.quic_report_timeout_ms,
        state.report_interval_ms,
    );
    let silence = tokio::time::sleep(silence_limit);
    tokio::pin!(silence);
    let mut rate = super::limits::Rate::new(
        ingest.limits.quic_max_datagrams_per_second,
        std::time::Instant::now(),
    );
    let mut watching = true;
    let mut published = Publication::new(state.subscribe());
    // A cluster replica that loses the service closes the connection, so that the
    // agent goes on to the replica that took it over.
    loop {
        let bytes = tokio::select! {
            read = conn.read_datagram() => match read {
                Ok(b) => b,
                Err(_) => return Ok(()),
            },
            _ = &mut silence => {
                tracing::info!(node = %hello.node, after = ?silence_limit, "connection closed: no report");
                state.metrics.reject_connection("no_reports");
                conn.close(close::NORMAL.into(), b"no report");
                return Err("no report");
            }
            changed = revocations.changed(), if watching => {
                if changed.is_err() {
                    // The list is gone with the daemon: nothing more changes.
                    watching = false;
                    continue;
                }
                match credentials_end(conn, state, ingest, &hello.node, &chain) {
                    Some(end) => return Err(end),
                    None => continue,
                }
            }
            Some(()) = lost(&mut losses) => {
                if state.ownership.as_ref().is_some_and(|o| !o.owns(&hello.service)) {
                    tracing::info!(node = %hello.node, service = %hello.service,
                        "connection closed: the service moved to another replica");
                    state.metrics.reject_connection("moved");
                    conn.close(close::MOVED.into(), b"service moved to another replica");
                    return Ok(());
                }
                continue;
            }
            _ = &mut expired => {
                let left = expires_in(not_after_unix_s);
                if left.is_zero() {
                    return Err(close_for(conn, state, &hello.node, Verdict::Expired));
                }
                expired.as_mut().reset(tokio::time::Instant::now() + left);
                continue;
            }
        };
        if !rate.take(std::time::Instant::now()) {
            // Dropped unread: a flood never reaches the decoder or the balancer's lock.
            state.metrics.reject("rate_limited");
            continue;
        }
        match session.handle_datagram(&bytes) {
            Ok(ServerEvent::Report(report)) => {
                silence
                    .as_mut()
                    .reset(tokio::time::Instant::now() + silence_limit);
                match balance(state, &hello, Ask::Report(&report, &mut published)) {
                    Answer::Assigned {
                        assignment,
                        accepted,
                    } => {
                        if accepted {
                            state.metrics.reports_accepted.inc();
                        } else {
                            state.metrics.reject("reordered");
                        }
                        // Answered even when another session of the node got ahead, so
                        // that this one still hears its weight.
                        if let Ok(reply) = session.reply(&assignment) {
                            let _ = conn.send_datagram(reply.into());
                        }
                    }
                    Answer::Reregistered => state.metrics.reject("unknown_endpoint"),
                    Answer::Refused(reason, _) => state.metrics.reject(&reason.to_string()),
                    Answer::Registered => {}
                }
            }
            Ok(ServerEvent::Reordered { .. }) => state.metrics.reject("reordered"),
            Ok(_) => {}
            Err(e) => {
                let reason = fault(conn, state, &session, &e);
                if session.close_code().is_some() {
                    return Err(reason);
                }
            }
        }
    }
}

/// Resolves when the replica has lost a bucket since the last call; never for a lone
/// aggregator, or once the ownership is gone with the daemon.
async fn lost(losses: &mut Option<tokio::sync::watch::Receiver<u64>>) -> Option<()> {
    match losses {
        Some(rx) => match rx.changed().await {
            Ok(()) => Some(()),
            Err(_) => {
                *losses = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}

/// The longest a connection's expiry timer is set for; a later expiry sets it again
/// when it fires (and the wall clock may have moved meanwhile).
const EXPIRY_TIMER_MAX: Duration = Duration::from_secs(24 * 3600);

/// How long until a certificate valid until `not_after_unix_s` expires: zero if it
/// has, and at most [`EXPIRY_TIMER_MAX`].
fn expires_in(not_after_unix_s: i64) -> Duration {
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
    state: &State,
    ingest: &Ingest,
    node: &str,
    chain: &[CertificateDer<'static>],
) -> Option<&'static str> {
    match ingest.revocation.verdict(chain) {
        Verdict::Valid => None,
        v => Some(close_for(conn, state, node, v)),
    }
}

/// Closes a connection whose certificate is no longer good, with the code that says
/// why, and counts it.
fn close_for(
    conn: &quinn::Connection,
    state: &State,
    node: &str,
    verdict: Verdict,
) -> &'static str {
    let (code, reason, text): (u32, &'static str, &[u8]) = match verdict {
        Verdict::Revoked => (close::REVOKED, "revoked", b"certificate revoked"),
        Verdict::Expired | Verdict::Valid => (close::EXPIRED, "expired", b"certificate expired"),
    };
    tracing::warn!(%node, reason, "closing the connection of a node whose certificate is no longer valid");
    state.metrics.reject_connection(reason);
    conn.close(code.into(), text);
    reason
}

/// Why a hello for `service` is refused as unknown before it reaches the balancer:
/// with a config directory that accepts no unknown services, a service without a file
/// (a deleted file's tombstone still counts as one, as does a file refused for a
/// mistake: its team configured the service).
fn unconfigured(state: &State, ingest: &Ingest, service: &str) -> Option<String> {
    if !ingest.require_service_file {
        return None;
    }
    let file = crate::config::dir::file_name(service);
    let known = state.config_dir().as_ref().is_some_and(|status| {
        status.configs.merged().services.contains_key(service)
            || status.configs.errors().contains_key(&file)
    });
    if known {
        None
    } else {
        Some(format!(
            "service {service:?} has no file {file} in the config directory, and this \
             aggregator accepts no unknown services (accept_unknown_services = false)"
        ))
    }
}

/// Counts a fault of the session, and closes the connection when the session ended
/// over it. Returns the fault in words, for the log.
fn fault(
    conn: &quinn::Connection,
    state: &State,
    session: &ServerSession,
    e: &ServerError,
) -> &'static str {
    match e {
        ServerError::HelloTimeout(_) => state.metrics.reject_connection("hello_timeout"),
        ServerError::TooManyBadDatagrams { .. } => {
            state.metrics.reject(e.label());
            state.metrics.reject_connection("malformed");
        }
        _ => state.metrics.reject(e.label()),
    }
    if let Some(code) = session.close_code() {
        conn.close(code.into(), e.to_string().as_bytes());
    }
    e.label()
}

/// Sends a reject, counts it by reason, and closes the connection.
async fn refuse(
    conn: &quinn::Connection,
    state: &State,
    identity: &str,
    send: &mut quinn::SendStream,
    reject: Reject,
    frame: Vec<u8>,
) -> Result<(), &'static str> {
    tracing::warn!(%identity, reason = %reject.reason, detail = %reject.detail, "hello rejected");
    state.metrics.reject(&reject.reason.to_string());
    let _ = send.write_all(&frame).await;
    let _ = send.finish();
    // Give the reject a moment to leave before the close overtakes it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.close(close::REJECTED.into(), b"rejected");
    Err("rejected")
}

/// What ingest asks of the balancer.
enum Ask<'a> {
    /// Register the node a hello names, or refresh it.
    Register,
    /// Record a report, and look up what the reply tells the node.
    Report(&'a Report, &'a mut Publication),
}

/// What the last publication assigns one connection's node, looked up once per
/// publication rather than once per report: a report then costs no search of the
/// published endpoints, only a check that no newer publication came out.
struct Publication {
    latest: tokio::sync::watch::Receiver<Arc<Published>>,
    /// The lookup in the publication `latest` has seen: `None` until it is made, then
    /// the node's assignment, or `None` within when the publication does not hold it.
    looked_up: Option<Option<Assignment>>,
}

impl Publication {
    fn new(latest: tokio::sync::watch::Receiver<Arc<Published>>) -> Publication {
        Publication {
            latest,
            looked_up: None,
        }
    }

    /// The node's assignment in the latest publication, if that holds it.
    fn assignment(&mut self, hello: &Hello) -> Option<Assignment> {
        // An error means the daemon's sender is gone: the last value still stands.
        if self.latest.has_changed().unwrap_or(false) {
            self.looked_up = None;
        }
        if let Some(found) = self.looked_up {
            return found;
        }
        let published = self.latest.borrow_and_update();
        let found = published
            .service(&hello.service)
            .and_then(|svc| Some((svc, svc.endpoints.get(hello.node.as_str())?)))
            .map(|(svc, e)| Assignment {
                weight: e.weight,
                cycle: svc.cycle,
                draining: e.draining,
                load: e.load,
                inflight_trusted: e.inflight_trusted,
            });
        drop(published);
        self.looked_up = Some(found);
        found
    }
}

/// The balancer's answer.
enum Answer {
    /// The node is registered.
    Registered,
    /// The report is recorded (`accepted`), or the balancer already had a newer one
    /// from another session of the node; either way, what the reply tells the node.
    Assigned {
        assignment: Assignment,
        accepted: bool,
    },
    /// The endpoint had expired while connected (a very long stall): registered again,
    /// and the report dropped.
    Reregistered,
    /// Refused: the service is not served here, or a limit would be passed.
    Refused(RejectReason, String),
}

/// The refusal a registration error amounts to.
fn refusal(e: BalanceError) -> Answer {
    let reason = match e {
        BalanceError::Limit { .. } => RejectReason::LimitReached,
        BalanceError::AddressInUse { .. } => RejectReason::AddressNotAllowed,
        BalanceError::UnknownService(_) | BalanceError::UnknownEndpoint { .. } => {
            RejectReason::UnknownService
        }
    };
    Answer::Refused(reason, e.to_string())
}

/// Every call ingest makes into the balancer, in one place: registering a node and
/// recording its reports. The reply's weight comes from the last publication, as every
/// feed's does, so an agent's HAProxy agent-check answers what xDS and the store say;
/// only a node registered since then, not yet published, hears the balancer's own
/// starting weight.
fn balance(state: &State, hello: &Hello, ask: Ask<'_>) -> Answer {
    let now = state.clock.now();
    let mut balancer = state.balancer();
    // Checked under the balancer's lock: a cluster replica lets go of a service (under
    // the same lock) only after it stopped owning it, so a registration that passes
    // here is swept with the service, and none can bring a lost service back.
    let not_owner = || {
        (!state.balances(&hello.service)).then(|| {
            let detail = state
                .ownership
                .as_ref()
                .map(|o| o.refusal(&hello.service))
                .unwrap_or_default();
            Answer::Refused(RejectReason::NotOwner, detail)
        })
    };
    let register = |b: &mut ballast_balance::Balancer| {
        b.register(
            now,
            &hello.service,
            &hello.node,
            &hello.address,
            &hello.zone,
        )
    };
    match ask {
        Ask::Register => match not_owner() {
            Some(refused) => refused,
            None => match register(&mut balancer) {
                Ok(()) => Answer::Registered,
                Err(e) => refusal(e),
            },
        },
        Ask::Report(report, published) => {
            match balancer.observe(now, &hello.service, &hello.node, observation(report)) {
                Ok(a) => {
                    drop(balancer);
                    let assignment = match published.assignment(hello) {
                        Some(assignment) => assignment,
                        None => Assignment {
                            weight: a.weight,
                            cycle: a.cycle,
                            draining: a.draining,
                            load: a.load,
                            inflight_trusted: a.inflight_trusted,
                        },
                    };
                    Answer::Assigned {
                        assignment,
                        accepted: a.accepted,
                    }
                }
                // Forgotten while connected (a long stall, or another node took its
                // address): registered again if it still may be, else refused.
                Err(BalanceError::UnknownEndpoint { .. }) => match not_owner() {
                    Some(refused) => refused,
                    None => match register(&mut balancer) {
                        Ok(()) => Answer::Reregistered,
                        Err(e) => refusal(e),
                    },
                },
                // Reports never create anything, so no limit can refuse one; an
                // unknown service is one removed since the hello.
                Err(
                    e @ (BalanceError::UnknownService(_)
                    | BalanceError::Limit { .. }
                    | BalanceError::AddressInUse { .. }),
                ) => refusal(e),
            }
        }
    }
}

/// The balancer's view of a wire report: the conversion belongs to ingest, so that the
/// core knows nothing of the wire.
fn observation(r: &ballast_shared::wire::Report) -> Observation {
    Observation {
        seq: Some(r.seq),
        cpu: f64::from(r.cpu),
        inflight: r.inflight,
        capacity: r.capacity,
        error_rate: r.error_rate.map(f64::from),
        draining: r.state == ballast_shared::wire::NodeState::Draining,
    }
}
