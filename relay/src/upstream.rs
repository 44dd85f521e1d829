//! The relay's [`Upstream`]: each agent the ingest driver admits is attached over the
//! trunk of the replica that owns its service, its reports go into that trunk's
//! batches, and the primary's replies come back to it verbatim.
//!
//! **Failover.** When the trunk is lost, the primary detaches the slot with MOVED, or
//! the routes give the service's bucket to another replica, the link goes
//! *rehoming*: it keeps only the agent's latest report, answers each report from the
//! last reply it had (so that the agent's silence rule does not fire and its load
//! balancers keep their weights), and attaches again once the routes name an owner
//! that takes the agent (one that has not restored the bucket yet answers NotOwner:
//! the link waits and tries again). Then it sends the kept report if it is younger
//! than [`BUFFERED_MAX_AGE`]. An agent no owner takes within the hold is closed with
//! MOVED, and goes on to its next address.

use super::metrics::RelayMetrics;
use super::routes::Routes;
use super::trunks::{close_reason, AttachError, Attached, Command, Down, Trunks};
use ballast_ingest::upstream::{
    Admitted, Arrival, Close, Downstream, Forwarded, Link, Prover, Upstream,
};
use ballast_shared::session::close;
use ballast_shared::wire::{Message, Reject, RejectReason, Report};
use bytes::Bytes;
use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// How old a report kept while rehoming may be and still be sent to the new owner.
pub(crate) const BUFFERED_MAX_AGE: Duration = Duration::from_secs(1);

/// How long a rehoming link waits before it asks an owner again after a refusal.
const RETRY_EVERY: Duration = Duration::from_millis(250);

/// How long an attached agent's report may wait for the primary's reply before the
/// relay answers its next one from the last reply. A primary answers each batch as it
/// takes it, in milliseconds; one that stays silent this long is stalled or gone
/// (a killed process's trunk looks open until QUIC's idle timeout), and the agent's
/// own silence rule would otherwise close its connection before the routes name
/// the replica that takes the service over.
const REPLY_GRACE: Duration = Duration::from_millis(500);

/// The relay's settings for its agents.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// How long an attach may take, the primary's answer included.
    pub(crate) attach_timeout: Duration,
    /// How long a rehoming agent is held before it is closed with MOVED.
    pub(crate) failover_hold: Duration,
}

/// Hands agents on to the owners of their services.
pub(crate) struct RelayUpstream {
    routes: watch::Receiver<Arc<Routes>>,
    trunks: Arc<Trunks>,
    metrics: Arc<RelayMetrics>,
    settings: Settings,
}

impl RelayUpstream {
    /// Agents go to the owners `routes` name, over `trunks`.
    pub(crate) fn new(
        routes: watch::Receiver<Arc<Routes>>,
        trunks: Arc<Trunks>,
        metrics: Arc<RelayMetrics>,
        settings: Settings,
    ) -> Self {
        RelayUpstream {
            routes,
            trunks,
            metrics,
            settings,
        }
    }
}

/// What a link needs to attach its agent again.
#[derive(Debug, Clone)]
struct Agent {
    service: String,
    hello: Vec<u8>,
    chain: Vec<Vec<u8>>,
    source: IpAddr,
    /// Asks the agent for the proof each owner challenges it for.
    prover: Prover,
}

/// An attach in flight: its answer, and where its slot's replies will come.
struct Attempt {
    replica: String,
    trunk: mpsc::Sender<Command>,
    down: mpsc::UnboundedReceiver<Down>,
    answer: oneshot::Receiver<Result<Attached, AttachError>>,
}

/// Asks `replica`'s trunk to attach `agent`; the attempt to await.
fn attempt(trunks: &Trunks, replica: &str, agent: &Agent) -> Result<Attempt, AttachError> {
    let trunk = trunks.commands(replica).ok_or(AttachError::TrunkDown)?;
    let (down_tx, down) = mpsc::unbounded_channel();
    let (answer_tx, answer) = oneshot::channel();
    trunk
        .try_send(Command::Attach {
            hello: agent.hello.clone(),
            chain: agent.chain.clone(),
            source: agent.source,
            down: down_tx,
            answer: answer_tx,
            prover: agent.prover.clone(),
        })
        .map_err(|_| AttachError::TrunkDown)?;
    Ok(Attempt {
        replica: replica.to_string(),
        trunk,
        down,
        answer,
    })
}

/// The attempt's outcome, within `timeout`.
async fn outcome(attempt: &mut Attempt, timeout: Duration) -> Result<Attached, AttachError> {
    match tokio::time::timeout(timeout, &mut attempt.answer).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(AttachError::TrunkDown),
        Err(_) => Err(AttachError::Timeout),
    }
}

impl Upstream for RelayUpstream {
    type Link = RelayLink;

    async fn admit(&self, arrival: Arrival<'_>) -> Result<Admitted<RelayLink>, Reject> {
        let service = arrival.hello.service.clone();
        let hello =
            ballast_shared::frame::encode(&Message::Hello(arrival.hello.clone())).map_err(|e| {
                Reject {
                    reason: RejectReason::InvalidHello,
                    detail: format!("the relay cannot frame the hello: {e}"),
                }
            })?;
        let agent = Agent {
            service: service.clone(),
            hello,
            chain: arrival.chain.iter().map(|c| c.to_vec()).collect(),
            source: arrival.remote.ip(),
            prover: arrival.prover.cloned().ok_or_else(|| Reject {
                reason: RejectReason::IdentityMismatch,
                detail: "the relay cannot ask the agent for a proof of its key".into(),
            })?,
        };
        if let Err(e) = ballast_shared::trunk::check_attach(&agent.hello, &agent.chain) {
            tracing::warn!(node = %arrival.peer.identity, %service, error = %e,
                "the agent cannot be handed on through a trunk");
            self.metrics.refuse_attach("too_large");
            return Err(Reject {
                reason: RejectReason::IdentityMismatch,
                detail: format!("the relay cannot hand the agent on: {e}"),
            });
        }
        tracing::debug!(node = %arrival.peer.identity, %service, "attaching an agent");
        let mut routes = self.routes.clone();
        let mut retried = false;
        loop {
            let owner = routes.borrow_and_update().owner(&service);
            let Some(owner) = owner else {
                self.metrics.refuse_attach("no_owner");
                return Err(Reject {
                    reason: RejectReason::NotOwner,
                    detail: format!("the relay knows no owner of service {service:?} now"),
                });
            };
            let result = match attempt(&self.trunks, &owner.replica, &agent) {
                Ok(mut a) => outcome(&mut a, self.settings.attach_timeout)
                    .await
                    .map(|attached| (attached, a)),
                Err(e) => Err(e),
            };
            match result {
                Ok((attached, a)) => {
                    let link = RelayLink {
                        agent,
                        routes,
                        routes_live: true,
                        trunks: self.trunks.clone(),
                        metrics: self.metrics.clone(),
                        settings: self.settings,
                        state: State::Attached {
                            replica: a.replica,
                            slot: attached.slot,
                            trunk: a.trunk,
                            down: a.down,
                        },
                        last_reply: None,
                        unanswered_since: None,
                        outbox: None,
                    };
                    return Ok(Admitted {
                        interval_ms: attached.interval_ms,
                        link,
                    });
                }
                Err(
                    AttachError::Rejected(Reject {
                        reason: RejectReason::NotOwner,
                        ..
                    })
                    | AttachError::TrunkDown
                    | AttachError::Timeout,
                ) if !retried => {
                    // The routes were stale, or name a replica that is gone and not yet
                    // replaced: the next ones may name the owner.
                    retried = true;
                    let _ =
                        tokio::time::timeout(self.settings.attach_timeout, routes.changed()).await;
                }
                Err(AttachError::Rejected(r)) => {
                    self.metrics.refuse_attach(&r.reason.to_string());
                    return Err(r);
                }
                Err(e @ AttachError::Closed { .. }) => {
                    // The owner refused the agent's certificate (revoked, expired),
                    // which this relay's own list did not yet say: no other replica
                    // will take it either.
                    self.metrics.refuse_attach(&e.label());
                    return Err(Reject {
                        reason: RejectReason::IdentityMismatch,
                        detail: format!("the owner of service {service:?} refused the agent: {e}"),
                    });
                }
                Err(e) => {
                    self.metrics.refuse_attach(&e.label());
                    return Err(Reject {
                        reason: RejectReason::NotOwner,
                        detail: format!(
                            "the relay cannot hand the agent to {}, the owner of service \
                             {service:?}: {e}",
                            owner.replica
                        ),
                    });
                }
            }
        }
    }
}

/// Where an agent is.
enum State {
    /// Attached to a slot of `replica`'s trunk.
    Attached {
        replica: String,
        slot: ballast_shared::trunk::Slot,
        trunk: mpsc::Sender<Command>,
        down: mpsc::UnboundedReceiver<Down>,
    },
    /// Between owners since `since`.
    Rehoming {
        since: Instant,
        /// The latest report, and when it came.
        buffered: Option<(Bytes, Instant)>,
        /// An attach in flight.
        attempt: Option<Attempt>,
        /// When to try an owner next, with no attach in flight.
        retry_at: Instant,
    },
}

/// One agent handed on by the relay.
pub(crate) struct RelayLink {
    agent: Agent,
    routes: watch::Receiver<Arc<Routes>>,
    /// Whether the routes can still change (their follower runs).
    routes_live: bool,
    trunks: Arc<Trunks>,
    metrics: Arc<RelayMetrics>,
    settings: Settings,
    state: State,
    /// The primary's last reply, answered from while rehoming or while the primary is
    /// silent.
    last_reply: Option<Bytes>,
    /// Since when a report forwarded to the primary has gone unanswered.
    unanswered_since: Option<Instant>,
    /// A reply to send the agent at once.
    outbox: Option<Bytes>,
}

impl RelayLink {
    /// Leaves the current owner (telling it, if `detach`) and starts rehoming.
    fn rehome(&mut self, detach: bool) {
        if let State::Attached { slot, trunk, .. } = &self.state {
            if detach {
                let _ = trunk.try_send(Command::Detach { slot: *slot });
            }
        }
        if matches!(self.state, State::Attached { .. }) {
            let now = Instant::now();
            tracing::info!(service = %self.agent.service, "the agent's owner is gone; rehoming");
            self.unanswered_since = None;
            self.state = State::Rehoming {
                since: now,
                buffered: None,
                attempt: None,
                retry_at: now,
            };
        }
    }

    /// Whether the routes give the service to another replica than `replica`.
    fn moved_from(&self, replica: &str) -> bool {
        self.routes
            .borrow()
            .owner(&self.agent.service)
            .is_some_and(|o| o.replica != replica)
    }

    async fn routes_changed(routes: &mut watch::Receiver<Arc<Routes>>, live: &mut bool) {
        if !*live {
            return std::future::pending().await;
        }
        if routes.changed().await.is_err() {
            *live = false;
            std::future::pending::<()>().await;
        }
    }

    /// The new owner took the agent: the kept report goes to it if it is fresh.
    fn rehomed(&mut self, a: Attempt, attached: Attached, buffered: Option<(Bytes, Instant)>) {
        self.metrics.rehomed.inc();
        tracing::info!(service = %self.agent.service, replica = %a.replica, "agent rehomed");
        if let Some((bytes, at)) = buffered {
            if at.elapsed() <= BUFFERED_MAX_AGE {
                let report = Command::Report {
                    slot: attached.slot,
                    bytes,
                };
                if a.trunk.try_send(report).is_err() {
                    self.metrics.drop_report("trunk_full");
                }
            } else {
                self.metrics.drop_report("stale");
            }
        }
        self.state = State::Attached {
            replica: a.replica,
            slot: attached.slot,
            trunk: a.trunk,
            down: a.down,
        };
    }
}

impl Link for RelayLink {
    fn report(&mut self, _report: &Report, raw: &[u8]) -> Forwarded {
        let bytes = Bytes::copy_from_slice(raw);
        if let State::Attached { slot, trunk, .. } = &self.state {
            match trunk.try_send(Command::Report { slot: *slot, bytes }) {
                Ok(()) => {
                    let since = *self.unanswered_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > REPLY_GRACE {
                        self.answer_from_cache();
                    }
                    return Forwarded::Queued;
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    self.metrics.drop_report("trunk_full");
                    return Forwarded::Dropped("trunk_full");
                }
                // The trunk's task is gone: its slots with it.
                Err(mpsc::error::TrySendError::Closed(Command::Report { bytes, .. })) => {
                    self.rehome(false);
                    return self.keep(bytes);
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.rehome(false);
                    return Forwarded::Queued;
                }
            }
        }
        self.keep(bytes)
    }

    async fn next(&mut self) -> Downstream {
        loop {
            if let Some(reply) = self.outbox.take() {
                return Downstream::Reply(reply);
            }
            let hold = self.settings.failover_hold;
            let attach_timeout = self.settings.attach_timeout;
            match &mut self.state {
                State::Attached { down, replica, .. } => {
                    let replica = replica.clone();
                    tokio::select! {
                        d = down.recv() => match d {
                            Some(Down::Reply(reply)) => {
                                self.metrics.replies_forwarded.inc();
                                self.unanswered_since = None;
                                self.last_reply = Some(reply.clone());
                                return Downstream::Reply(reply);
                            }
                            Some(Down::Detached { code, .. }) if code == close::MOVED => {
                                self.rehome(false);
                            }
                            Some(Down::Detached { code, reason }) => {
                                return Downstream::Close(Close {
                                    code,
                                    reason: close_reason(code),
                                    detail: Cow::Owned(reason),
                                });
                            }
                            Some(Down::Lost) | None => self.rehome(false),
                        },
                        () = Self::routes_changed(&mut self.routes, &mut self.routes_live) => {
                            if self.moved_from(&replica) {
                                self.rehome(true);
                            }
                        }
                    }
                }
                State::Rehoming {
                    since,
                    buffered,
                    attempt: in_flight,
                    retry_at,
                } => {
                    let deadline = *since + hold;
                    if in_flight.is_none() && Instant::now() >= *retry_at {
                        let owner = self.routes.borrow().owner(&self.agent.service);
                        match owner.map(|o| attempt(&self.trunks, &o.replica, &self.agent)) {
                            Some(Ok(a)) => *in_flight = Some(a),
                            _ => *retry_at = Instant::now() + RETRY_EVERY,
                        }
                    }
                    let retry = *retry_at;
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {
                            self.metrics.drop_report("failover");
                            return Downstream::Close(Close {
                                code: close::MOVED,
                                reason: "moved",
                                detail: Cow::Borrowed("no replica took the service over in time"),
                            });
                        }
                        result = async {
                            match in_flight.as_mut() {
                                Some(a) => outcome(a, attach_timeout).await,
                                None => std::future::pending().await,
                            }
                        } => match result {
                            Ok(attached) => {
                                let kept = buffered.take();
                                if let Some(a) = in_flight.take() {
                                    self.rehomed(a, attached, kept);
                                }
                            }
                            Err(AttachError::Closed { code, reason }) => {
                                // The new owner refused the agent's certificate.
                                self.metrics.refuse_attach(close_reason(code));
                                return Downstream::Close(Close {
                                    code,
                                    reason: close_reason(code),
                                    detail: Cow::Owned(format!(
                                        "the new owner closed the agent's slot: {reason}"
                                    )),
                                });
                            }
                            Err(AttachError::Rejected(r)) if r.reason != RejectReason::NotOwner => {
                                self.metrics.refuse_attach(&r.reason.to_string());
                                return Downstream::Close(Close {
                                    code: close::REJECTED,
                                    reason: "rejected",
                                    detail: Cow::Owned(format!(
                                        "the new owner refused the agent: {} ({})",
                                        r.reason, r.detail
                                    )),
                                });
                            }
                            Err(e) => {
                                // Not the owner yet (its takeover is under way), or
                                // unreachable: wait, and ask again.
                                tracing::debug!(service = %self.agent.service, error = %e, "rehoming: not taken yet");
                                *in_flight = None;
                                *retry_at = Instant::now() + RETRY_EVERY;
                            }
                        },
                        () = tokio::time::sleep_until(retry), if in_flight.is_none() => {}
                        () = Self::routes_changed(&mut self.routes, &mut self.routes_live) => {
                            if in_flight.is_none() {
                                *retry_at = Instant::now();
                            }
                        }
                    }
                }
            }
        }
    }
}

impl RelayLink {
    /// Keeps `bytes` as the rehoming agent's latest report, and answers it from the
    /// last reply.
    fn keep(&mut self, bytes: Bytes) -> Forwarded {
        if let State::Rehoming { buffered, .. } = &mut self.state {
            if buffered.replace((bytes, Instant::now())).is_some() {
                self.metrics.drop_report("failover");
            }
        }
        self.answer_from_cache();
        Forwarded::Queued
    }

    /// Answers the agent's report with the primary's last reply, if there was one.
    fn answer_from_cache(&mut self) {
        if let Some(reply) = &self.last_reply {
            self.metrics.replies_cached.inc();
            self.outbox = Some(reply.clone());
        }
    }
}

impl Drop for RelayLink {
    fn drop(&mut self) {
        if let State::Attached { slot, trunk, .. } = &self.state {
            let _ = trunk.try_send(Command::Detach { slot: *slot });
        }
    }
}
