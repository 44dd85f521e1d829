//! The QUIC side of ingest: one task per agent connection.
//!
//! A connection begins with a hello on a bidirectional stream; the node it names must
//! be the node in the client certificate. After the welcome, reports arrive as
//! datagrams and each is answered with the node's weight. Faults are counted and never
//! reach other connections: each has its own task and a bad one is closed.

use ballast_balance::{BalanceError, Observation};
use crate::state::State;
use ballast_shared::frame;
use ballast_shared::wire::{self, Hello, Message, Reject, RejectReason, Reply, Welcome};
use std::sync::Arc;
use std::time::Duration;

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection that sends this many undecodable datagrams is closed: it is broken or
/// hostile, and serving it costs the others.
const MAX_BAD_DATAGRAMS: u32 = 16;

/// QUIC application error codes for closing connections.
pub mod close {
    /// Normal shutdown.
    pub const NORMAL: u32 = 0;
    /// The hello was refused.
    pub const REJECTED: u32 = 1;
    /// Too many malformed messages.
    pub const PROTOCOL: u32 = 2;
}

/// Accepts connections until the endpoint closes.
pub async fn serve(endpoint: quinn::Endpoint, state: Arc<State>) {
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
    let (mut send, mut recv) = match tokio::time::timeout(HELLO_TIMEOUT, conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => return Err("closed before hello"),
        Err(_) => {
            state.metrics.reject_connection("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no hello");
            return Err("hello timeout");
        }
    };
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, frame::read(&mut recv)).await {
        Ok(Ok(Message::Hello(h))) => h,
        Ok(Ok(_)) => {
            state.metrics.reject("unexpected_message");
            conn.close(close::PROTOCOL.into(), b"expected hello");
            return Err("expected hello");
        }
        Ok(Err(e)) => {
            state.metrics.reject(e.label());
            conn.close(close::PROTOCOL.into(), b"bad hello");
            return Err("bad hello");
        }
        Err(_) => {
            state.metrics.reject_connection("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no hello");
            return Err("hello timeout");
        }
    };
    if let Err(reject) = admit(state, &identity, &hello) {
        tracing::warn!(%identity, claimed = %hello.node, service = %hello.service, reason = %reject.reason, detail = %reject.detail, "hello rejected");
        state.metrics.reject(&reject.reason.to_string());
        let _ = frame::write(&mut send, &Message::Reject(reject)).await;
        let _ = send.finish();
        // Give the reject a moment to leave before the close overtakes it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.close(close::REJECTED.into(), b"rejected");
        return Err("rejected");
    }
    let welcome = Message::Welcome(Welcome {
        interval_ms: state.report_interval_ms,
    });
    if frame::write(&mut send, &welcome).await.is_err() {
        return Err("welcome failed");
    }
    let _ = send.finish();
    tracing::info!(node = %hello.node, service = %hello.service, address = %hello.address, "agent connected");

    let mut bad = 0u32;
    loop {
        let bytes = match conn.read_datagram().await {
            Ok(b) => b,
            Err(_) => return Ok(()),
        };
        let msg = match wire::decode(&bytes) {
            Ok(m) => m,
            Err(e) => {
                state.metrics.reject(e.label());
                bad += 1;
                if bad >= MAX_BAD_DATAGRAMS {
                    state.metrics.reject_connection("malformed");
                    conn.close(close::PROTOCOL.into(), b"too many malformed messages");
                    return Err("too many malformed messages");
                }
                continue;
            }
        };
        let Message::Report(report) = msg else {
            state.metrics.reject("unexpected_message");
            continue;
        };
        let now = state.clock.now();
        let assignment =
            state
                .balancer()
                .observe(now, &hello.service, &hello.node, observation(&report));
        match assignment {
            Ok(a) => {
                if a.accepted {
                    state.metrics.reports_accepted.inc();
                } else {
                    state.metrics.reject("reordered");
                }
                let reply = Message::Reply(Reply {
                    weight: a.weight as f32,
                    cycle: a.cycle,
                    interval_ms: state.report_interval_ms,
                    draining: a.draining,
                    load: a.load as f32,
                    inflight_trusted: a.inflight_trusted,
                });
                if let Ok(bytes) = wire::encode(&reply) {
                    let _ = conn.send_datagram(bytes.into());
                }
            }
            Err(BalanceError::UnknownEndpoint { .. }) => {
                // Expired while connected (a very long stall): register again.
                state.metrics.reject("unknown_endpoint");
                let _ = state.balancer().register(
                    now,
                    &hello.service,
                    &hello.node,
                    &hello.address,
                    &hello.zone,
                );
            }
            Err(BalanceError::UnknownService(_)) => {
                state.metrics.reject("unknown_service");
            }
        }
    }
}

fn admit(state: &State, identity: &str, hello: &Hello) -> Result<(), Reject> {
    if let Err(e) = hello.validate() {
        return Err(Reject {
            reason: RejectReason::InvalidHello,
            detail: e.to_string(),
        });
    }
    if hello.node != identity {
        return Err(Reject {
            reason: RejectReason::IdentityMismatch,
            detail: format!(
                "certificate is for {identity:?}, hello claims {:?}",
                hello.node
            ),
        });
    }
    let now = state.clock.now();
    state
        .balancer()
        .register(
            now,
            &hello.service,
            &hello.node,
            &hello.address,
            &hello.zone,
        )
        .map_err(|e| Reject {
            reason: RejectReason::UnknownService,
            detail: e.to_string(),
        })
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
