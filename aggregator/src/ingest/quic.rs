//! The QUIC side of ingest: one task per agent connection.
//!
//! The session's rules (the hello and the certificate's identity, the welcome or
//! reject, reordered reports, the reply to each report, what a fault costs) are the
//! sans-IO [`ServerSession`], shared with the agent's side of the protocol; this module
//! is its async driver: the connection, the hello's deadline, the metrics, and the
//! calls into the balancer, which all go through [`balance`]. Faults are counted and
//! never reach other connections: each has its own task and a bad one is closed.

use crate::state::State;
use ballast_balance::{BalanceError, Observation};
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::{Assignment, ServerConfig, ServerError, ServerEvent, ServerSession};
use ballast_shared::wire::{Hello, Reject, RejectReason, Report};
use std::sync::Arc;
use std::time::Duration;

/// QUIC application error codes for closing connections; the protocol's own.
pub(crate) use ballast_shared::session::close;

/// Accepts connections until the endpoint closes.
pub(crate) async fn serve(endpoint: quinn::Endpoint, state: Arc<State>) {
    while let Some(incoming) = endpoint.accept().await {
        let state = state.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    // Missing or untrusted client certificates end here.
                    tracing::info!(error = %e, "agent handshake failed");
                    state.metrics.reject_connection("handshake");
                    return;
                }
            };
            state.metrics.connections_open.inc();
            let result = handle(&conn, &state).await;
            state.metrics.connections_open.dec();
            if let Err(reason) = result {
                tracing::debug!(remote = %conn.remote_address(), reason, "agent connection ended");
            }
        });
    }
}

async fn handle(conn: &quinn::Connection, state: &State) -> Result<(), &'static str> {
    let identity = match ballast_shared::tls::peer_identity(conn) {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(error = %e, "client certificate carries no identity");
            state.metrics.reject_connection("no_identity");
            conn.close(close::REJECTED.into(), b"no identity");
            return Err("no identity");
        }
    };
    let config = ServerConfig::new(state.report_interval_ms);
    let mut session = ServerSession::new(identity, config, now());
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
    let welcome = match balance(state, &hello, Ask::Register) {
        Answer::UnknownService(detail) => {
            let reject = Reject {
                reason: RejectReason::UnknownService,
                detail,
            };
            return match session.reject(reject.reason, reject.detail.clone()) {
                Ok(frame) => {
                    refuse(conn, state, session.identity(), &mut send, reject, frame).await
                }
                Err(_) => Err("reject failed"),
            };
        }
        _ => session.welcome(),
    };
    let Ok(welcome) = welcome else {
        return Err("welcome failed");
    };
    if send.write_all(&welcome).await.is_err() {
        return Err("welcome failed");
    }
    let _ = send.finish();
    tracing::info!(node = %hello.node, service = %hello.service, address = %hello.address, zone = %hello.zone, agent_version = %hello.version, "agent connected");

    loop {
        let bytes = match conn.read_datagram().await {
            Ok(b) => b,
            Err(_) => return Ok(()),
        };
        match session.handle_datagram(&bytes) {
            Ok(ServerEvent::Report(report)) => match balance(state, &hello, Ask::Report(&report)) {
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
                Answer::UnknownService(_) => state.metrics.reject("unknown_service"),
                Answer::Registered => {}
            },
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
    Report(&'a Report),
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
    /// The service is not served here.
    UnknownService(String),
}

/// Every call ingest makes into the balancer, in one place: registering a node and
/// recording its reports. The reply's weight comes from the last publication, as every
/// feed's does, so an agent's HAProxy agent-check answers what xDS and the store say;
/// only a node registered since then, not yet published, hears the balancer's own
/// starting weight.
fn balance(state: &State, hello: &Hello, ask: Ask<'_>) -> Answer {
    let now = state.clock.now();
    let mut balancer = state.balancer();
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
        Ask::Register => match register(&mut balancer) {
            Ok(()) => Answer::Registered,
            Err(e) => Answer::UnknownService(e.to_string()),
        },
        Ask::Report(report) => {
            match balancer.observe(now, &hello.service, &hello.node, observation(report)) {
                Ok(a) => {
                    drop(balancer);
                    let published = state.published();
                    let assignment = match published
                        .service(&hello.service)
                        .and_then(|svc| Some((svc, svc.endpoints.get(hello.node.as_str())?)))
                    {
                        Some((svc, e)) => Assignment {
                            weight: e.weight,
                            cycle: svc.cycle,
                            draining: e.draining,
                            load: e.load,
                            inflight_trusted: e.inflight_trusted,
                        },
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
                Err(BalanceError::UnknownEndpoint { .. }) => {
                    let _ = register(&mut balancer);
                    Answer::Reregistered
                }
                Err(BalanceError::UnknownService(s)) => Answer::UnknownService(s),
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
