//! The seam between an agent's connection and what serves the agent behind it.
//!
//! The connection's driver ([`super::quic`]) keeps everything that is the connection's
//! own, in one place whatever serves the agent: the certificate and the policy's grant,
//! the hello and its deadline, the connection caps, the rate limit, the silence rule,
//! and the end of a connection whose certificate is revoked or expires. What is done
//! with an admitted agent and its reports is an [`Upstream`]'s: the aggregator's own
//! balancer (the aggregator's `Local`), or another process the reports are handed on to,
//! whose answers then come back later through [`Link::next`].

use ballast_shared::session::{Assignment, Peer};
use ballast_shared::tls::CertificateDer;
use ballast_shared::wire::{Challenge, Hello, Proof, Reject, RejectReason, Report};
use bytes::Bytes;
use std::borrow::Cow;
use std::future::Future;
use std::net::SocketAddr;

/// An agent whose hello the session has accepted, as the upstream is asked to admit
/// it: who it is by its certificate, and what it says of itself.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// The identity its certificate names, its source address and what it may claim.
    pub peer: &'a Peer,
    /// Its certificate chain as presented, leaf first (DER): for an upstream that must
    /// have it checked again elsewhere.
    pub chain: &'a [CertificateDer<'static>],
    /// The connection's source address and port.
    pub remote: SocketAddr,
    /// Its hello.
    pub hello: &'a Hello,
    /// How to ask the agent to prove that it holds its certificate's key, for an
    /// upstream that hands it on (a relay's primary challenges each attach); `None`
    /// where the agent's handshake was this process's own.
    pub prover: Option<&'a Prover>,
}

/// Asks an agent, over its connection's hello stream, to answer challenges
/// ([`ballast_shared::session::proof`]). Cloned into whatever may need a proof later
/// (a relay's link, which attaches again when its agent's service moves).
#[derive(Debug, Clone)]
pub struct Prover(tokio::sync::mpsc::UnboundedSender<ProofRequest>);

/// One challenge for the agent, and where its proof goes: `None` when it cannot
/// prove (it speaks `ballast/1`, or its stream or connection ended).
#[derive(Debug)]
pub struct ProofRequest {
    /// The primary's challenge.
    pub challenge: Challenge,
    /// The agent's answer.
    pub answer: tokio::sync::oneshot::Sender<Option<Proof>>,
}

impl Prover {
    /// A prover, and the requests its connection's driver answers.
    pub fn new() -> (Prover, tokio::sync::mpsc::UnboundedReceiver<ProofRequest>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Prover(tx), rx)
    }

    /// Asks for the agent's proof of `challenge`: its answer, `None` if it cannot
    /// give one.
    pub async fn prove(&self, challenge: Challenge) -> Option<Proof> {
        let (answer, rx) = tokio::sync::oneshot::channel();
        self.0.send(ProofRequest { challenge, answer }).ok()?;
        rx.await.ok().flatten()
    }
}

/// An admitted agent: the report interval its welcome gives it, and the link its
/// reports go through.
#[derive(Debug)]
pub struct Admitted<L> {
    /// The report interval the agent is told to use, in milliseconds. The connection's
    /// silence rule is counted from it too.
    pub interval_ms: u32,
    /// Where the agent's reports go, and its replies come from, until the connection
    /// ends; dropped when it ends.
    pub link: L,
}

/// What serves the agents that a connection driver admits.
pub trait Upstream: Send + Sync + 'static {
    /// One admitted agent's link.
    type Link: Link;

    /// Admits the agent of a hello the session accepted (its claims are within its
    /// grant): checks that the agent is served here and registers it; or the reject
    /// the agent is sent.
    fn admit(
        &self,
        arrival: Arrival<'_>,
    ) -> impl Future<Output = Result<Admitted<Self::Link>, Reject>> + Send;

    /// Serves a connection that negotiated the relays' protocol (a trunk) until it
    /// ends; the reason it ended, for the log, if not cleanly. An upstream that takes
    /// no trunks closes it (a server that offers no such protocol never gets one).
    fn trunk(&self, trunk: Trunk<'_>) -> impl Future<Output = Result<(), &'static str>> + Send {
        trunk.metrics.reject_connection("trunks_not_served");
        trunk.conn.close(
            ballast_shared::session::close::REJECTED.into(),
            b"no trunks are taken here",
        );
        std::future::ready(Err("no trunks are taken here"))
    }

    /// Serves a connection that negotiated the routes protocol (a relay following the
    /// cluster's routes, [`crate::routes_feed`]) until it ends. An upstream that has no
    /// routes closes it.
    fn serve_routes(
        &self,
        trunk: Trunk<'_>,
    ) -> impl Future<Output = Result<(), &'static str>> + Send {
        trunk.metrics.reject_connection("routes_not_served");
        trunk.conn.close(
            ballast_shared::session::close::REJECTED.into(),
            b"no routes are served here",
        );
        std::future::ready(Err("no routes are served here"))
    }
}

/// An upstream that serves relays' trunks as a primary ([`crate::primary_trunk::serve`]): each
/// agent behind a trunk is admitted through [`Upstream::admit`] as a direct agent is,
/// and the trunk tells its relay what this says besides. A trunk's reports reach the
/// links decoded only: [`Link::report`] is given no datagram (`raw` is empty).
pub trait Replica: Upstream {
    /// The replica's name, told to relays.
    fn name(&self) -> &str;

    /// The report interval agents are told to use, in milliseconds.
    fn report_interval_ms(&self) -> u32;

    /// Moves whenever this replica loses services: each link is then asked
    /// ([`Link::next`]) whether its agent must go. `None` when it never loses any.
    fn losses(&self) -> Option<tokio::sync::watch::Receiver<u64>>;

    /// The cluster's routes as this replica reads them, for relays
    /// ([`crate::routes_feed`]); `None` for an aggregator that is no cluster member.
    fn cluster_routes(&self) -> Option<crate::routes_feed::RoutesReceiver>;
}

/// Resolves when `losses` has moved since the last call; never when there is none, or
/// once its sender is gone. Cancel-safe.
pub async fn lost(losses: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    match losses {
        Some(rx) => {
            if rx.changed().await.is_err() {
                *losses = None;
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// A connection that negotiated the relays' protocol, as the driver hands it on, with
/// what serves it.
pub struct Trunk<'a> {
    /// The connection.
    pub(crate) conn: &'a quinn::Connection,
    /// The daemon's metrics.
    pub(crate) metrics: &'a crate::metrics::IngestMetrics,
    /// The policy, the revocation list and the limits.
    pub(crate) ingest: &'a super::Ingest,
    /// The connection's place among the open ones, to claim for the relay's identity.
    pub(crate) place: &'a mut super::limits::Slot,
}

/// One admitted agent's path to what serves it. Dropping it lets go of the agent
/// there.
pub trait Link: Send + 'static {
    /// Takes a report the session accepted, with its datagram in today's protocol
    /// (`raw`: as it came, or translated from the agent's previous version).
    /// Called for every report on the connection's task: it must not block, and the
    /// aggregator's own link allocates nothing and takes no lock beyond the
    /// balancer's.
    fn report(&mut self, report: &Report, raw: &[u8]) -> Forwarded;

    /// The next thing to tell the agent that is not an answer [`Link::report`] gave
    /// at once: a reply to a report handed on earlier, or the end of the connection.
    /// Pending for as long as there is none; it may never resolve. Cancel-safe: the
    /// driver drops it whenever something else happens first, and calls it again.
    fn next(&mut self) -> impl Future<Output = Downstream> + Send;
}

/// What became of a report.
#[derive(Debug, Clone, PartialEq)]
pub enum Forwarded {
    /// Recorded (`accepted`), or a newer one from another session of the node was
    /// already; either way the reply tells the agent `assignment`.
    Assigned {
        /// What the reply tells the agent.
        assignment: Assignment,
        /// Whether this report was recorded.
        accepted: bool,
    },
    /// Handed on: its reply, if any, comes through [`Link::next`].
    Queued,
    /// Refused for `reason`, unanswered: counted as a rejected report.
    Refused(RejectReason),
    /// Dropped unanswered, counted as a rejected report for the reason named.
    Dropped(&'static str),
}

/// What an upstream tells the agent later.
#[derive(Debug, Clone, PartialEq)]
pub enum Downstream {
    /// A reply datagram, encoded in today's protocol, to send to the agent (translated
    /// first for an agent of the previous version).
    Reply(Bytes),
    /// The connection is to be closed.
    Close(Close),
}

/// How and why an upstream ends a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close {
    /// The application close code ([`super::quic::close`]): it tells the agent what to
    /// do next (MOVED: try the next aggregator).
    pub code: u32,
    /// The reason the close is counted under in `ballast_connections_rejected_total`.
    pub reason: &'static str,
    /// The close's text, for the agent's log and this one's.
    pub detail: Cow<'static, str>,
}
