//! The primary's side of a relay's trunk: one task per trunk, driving a
//! [`TrunkServer`].
//!
//! A relay connects with the relays' protocol and a certificate with the relay role;
//! the policy's `relays` list says which relays may. Each agent behind it is attached
//! once: its chain is checked here with this aggregator's own verifier and revocation
//! list, its identity and grant are worked out from its certificate and the policy as
//! a direct agent's are, and its hello goes through a session of its own, held to the
//! same rules; then the [`Replica`] admits it as it admits a direct agent. Reports come
//! in batches, each through its slot's session and [`Link`] as a direct report is,
//! and the replies go back in batches, right after the batch they answer. Each slot
//! keeps a direct agent's rate limit and silence rule, and is detached when its
//! service leaves this replica (MOVED) or its certificate is revoked or expires; the
//! whole trunk ends when the relay's own certificate is.

use super::limits::{report_timeout, NodePlace, Rate};
use super::quic::{
    admit_identity, certificate_of, close, close_for, expires_in, peer, ZONE_NOT_ALLOWED,
};
use super::revocation::Verdict;
use super::upstream::{lost, Admitted, Arrival, Downstream, Forwarded, Link, Replica, Trunk};
use super::Ingest;
use crate::metrics::IngestMetrics;
use ballast_shared::session::driver::now;
use ballast_shared::session::trunk::{Admission, SlotEvent, TrunkServerError, TrunkServerEvent};
use ballast_shared::session::TrunkServerConfig;
use ballast_shared::session::{ServerConfig, ServerError, ServerEvent, TrunkServer};
use ballast_shared::tls::{CertInfo, CertificateDer};
use ballast_shared::trunk::TrunkProtocol;
use ballast_shared::trunk::{Slot, MAX_BATCH, MAX_CONTROL_FRAME};
use ballast_shared::wire::RejectReason;
use futures_util::FutureExt;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// How often slots are checked for silence and expiry.
const SWEEP: Duration = Duration::from_secs(1);

/// The most slots checked again in one pass after the revocation list changed; each
/// check verifies the slot's chain (a signature). Between passes the trunk's task
/// yields, so that the thread's other connections and this trunk's reports go on.
const RECHECK_BATCH: usize = 64;

/// The longest one pass of checks may take, whatever its count: at least one slot is
/// checked a pass.
const RECHECK_SLICE: Duration = Duration::from_millis(2);

/// How long a relay has to open its control stream and send its open.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a refused relay has to read why before its connection is closed.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

/// How long a write on the control stream may wait for the relay to read. A relay
/// that stops reading would otherwise hold the trunk's task, and with it the checks
/// of its certificate, its slots' silence and its batches, while its connection
/// stays alive.
const CONTROL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One agent attached through the trunk.
struct Agent<L> {
    /// Where its reports go.
    link: L,
    /// Its certificate chain, leaf first, checked again when the revocation list
    /// changes.
    chain: Vec<CertificateDer<'static>>,
    /// Its node, for the log.
    node: String,
    /// When its certificate expires.
    not_after_unix_s: i64,
    /// Its reports per second.
    rate: Rate,
    /// When it last sent a report, or was welcomed.
    heard: Instant,
    /// How long it may go without a report.
    silence_limit: Duration,
    /// Its place among its node's sessions, direct and relayed, on this aggregator.
    _place: NodePlace,
}

/// Why a trunk ended.
type End = &'static str;

/// Serves a trunk until it ends: admits the relay, then drives the trunk.
pub async fn serve<R: Replica>(replica: &R, trunk: Trunk<'_>) -> Result<(), End> {
    let Trunk {
        conn,
        metrics,
        ingest,
        place,
    } = trunk;
    let (chain, info, mut revocations) =
        admit_relay_connection(conn, metrics, ingest, place, "trunk")?;
    let protocol = TrunkProtocol::negotiated(conn).unwrap_or(TrunkProtocol::CURRENT);
    let limits = &ingest.limits;
    metrics.trunks_open.inc();
    let mut driver = PrimaryTrunk {
        conn,
        metrics,
        ingest,
        replica,
        scope: ingest.policy.relay_scope(&info.identity),
        relay: info.identity,
        relay_chain: chain,
        relay_not_after: info.not_after_unix_s,
        attaches: Rate::with_burst(
            limits.trunk_attach_rate,
            limits.trunk_attach_burst,
            Instant::now(),
        ),
        challenged: protocol.proves(),
        server: TrunkServer::new(TrunkServerConfig {
            replica: replica.name().to_string(),
            max_slots: ingest.limits.trunk_max_slots,
            max_batch_bytes: batch_limit(conn.max_datagram_size()),
            // Each attach proves its agent's key, on every trunk version that can.
            challenge: protocol.proves(),
            admit_unproven: ingest.policy.admit_unproven_relayed_agents(),
            ..TrunkServerConfig::new(
                replica.name(),
                ServerConfig {
                    // The agents' messages in the version the trunk's carries.
                    protocol: protocol.entries(),
                    ..ServerConfig::new(replica.report_interval_ms())
                },
            )
        }),
        agents: HashMap::new(),
        rechecks: VecDeque::new(),
    };
    let result = driver.run(&mut revocations).await;
    driver.end();
    metrics.trunks_open.dec();
    result
}

/// Admits a relay's connection (a trunk, or its routes): a certificate that names it,
/// with the relay role and a name the policy allows ([`admit_relay`]), and a place
/// among its identity's connections. Its chain, what its certificate says, and the
/// revocation list's changes to check it against again; or why it was refused,
/// counted, with the connection closed. `what` names the connection in the log.
#[allow(clippy::type_complexity)]
pub(crate) fn admit_relay_connection(
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    ingest: &Ingest,
    place: &mut super::limits::Slot,
    what: &'static str,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        CertInfo,
        tokio::sync::watch::Receiver<u64>,
    ),
    End,
> {
    let (chain, info) = match certificate_of(conn) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "relay certificate carries no identity");
            metrics.reject_connection("no_identity");
            conn.close(close::REJECTED.into(), b"no identity");
            return Err("no identity");
        }
    };
    if let Err((reason, text)) = admit_relay(ingest, &info) {
        tracing::warn!(relay = %info.identity, reason, what, "relay refused");
        metrics.reject_connection(reason);
        conn.close(close::REJECTED.into(), text.as_bytes());
        return Err(reason);
    }
    let revocations = admit_identity(conn, metrics, ingest, place, &info.identity, &chain)?;
    Ok((chain, info, revocations))
}

/// Whether a relay with the certificate `info` may open a trunk: the reason it is
/// counted under and the close's text, if not.
pub(crate) fn admit_relay(
    ingest: &Ingest,
    info: &CertInfo,
) -> Result<(), (&'static str, &'static str)> {
    if !info.has_role(ballast_shared::pki::RELAY_ROLE) {
        return Err(("not_relay", "the certificate has no relay role"));
    }
    if !ingest.policy.relay_allowed(&info.identity) {
        return Err(("relay_not_allowed", "the policy allows no such relay"));
    }
    Ok(())
}

/// The largest batch either way: what a datagram on the connection can carry, and
/// never more than the protocol allows.
fn batch_limit(max_datagram: Option<usize>) -> u32 {
    let limit = max_datagram.unwrap_or(1200).min(MAX_BATCH);
    u32::try_from(limit).unwrap_or(1200)
}

/// Why a relayed agent's chain is refused, as a handshake would have refused it: the
/// code, the reason it is counted under, and the text; `None` if it is good.
fn chain_refusal(
    judged: Result<Verdict, quinn::rustls::Error>,
) -> Option<(u32, &'static str, String)> {
    match judged {
        Ok(Verdict::Valid) => None,
        Ok(Verdict::Revoked) => Some((close::REVOKED, "revoked", "certificate revoked".into())),
        Ok(Verdict::Expired) => Some((close::EXPIRED, "expired", "certificate expired".into())),
        Err(e) => {
            let reason = match e {
                quinn::rustls::Error::InvalidCertificate(
                    quinn::rustls::CertificateError::UnknownIssuer
                    | quinn::rustls::CertificateError::BadSignature,
                ) => "unknown_ca",
                quinn::rustls::Error::NoCertificatesPresented => "no_certificate",
                _ => "bad_certificate",
            };
            Some((close::REJECTED, reason, format!("certificate refused: {e}")))
        }
    }
}

/// Writes `frames` on the control stream; a relay that reads none of it for
/// [`CONTROL_WRITE_TIMEOUT`] loses its trunk (`trunk_stalled`).
async fn write(
    send: &mut quinn::SendStream,
    conn: &quinn::Connection,
    metrics: &IngestMetrics,
    frames: impl IntoIterator<Item = Vec<u8>>,
) -> Result<(), End> {
    for frame in frames {
        match tokio::time::timeout(CONTROL_WRITE_TIMEOUT, send.write_all(&frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err("control stream closed"),
            Err(_) => {
                metrics.reject_connection("trunk_stalled");
                conn.close(close::PROTOCOL.into(), b"the relay stopped reading");
                return Err("the relay stopped reading");
            }
        }
    }
    Ok(())
}

/// One relay's trunk as the primary serves it: the connection, its [`TrunkServer`]
/// machine and the slots it welcomed, each with its agent's link.
struct PrimaryTrunk<'a, R: Replica> {
    conn: &'a quinn::Connection,
    metrics: &'a IngestMetrics,
    ingest: &'a Ingest,
    replica: &'a R,
    /// The relay's identity.
    relay: String,
    /// What the relay's agents may be, by the policy's `[[relay]]` tables.
    scope: crate::policy::RelayScope,
    /// The relay's own chain, checked again when the revocation list changes.
    relay_chain: Vec<CertificateDer<'static>>,
    /// When the relay's certificate expires.
    relay_not_after: i64,
    /// The attaches the trunk may make (`trunk_attach_rate`, `trunk_attach_burst`),
    /// taken before any proof is checked.
    attaches: Rate,
    /// Whether attaches are challenged (their token is then taken at the challenge).
    challenged: bool,
    server: TrunkServer,
    /// The welcomed slots.
    agents: HashMap<Slot, Agent<R::Link>>,
    /// The slots still to check under the revocation list that changed last.
    rechecks: VecDeque<Slot>,
}

impl<R: Replica> PrimaryTrunk<'_, R> {
    async fn run(
        &mut self,
        revocations: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<(), End> {
        let conn = self.conn;
        let (mut send, mut recv) = match tokio::time::timeout(OPEN_TIMEOUT, conn.accept_bi()).await
        {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => return Err("closed before the open"),
            Err(_) => {
                self.metrics.reject_connection("hello_timeout");
                conn.close(close::PROTOCOL.into(), b"no control stream");
                return Err("no control stream");
            }
        };
        let opened_by = tokio::time::Instant::now() + OPEN_TIMEOUT;
        let mut opened = false;
        let mut buf = vec![0u8; MAX_CONTROL_FRAME];
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut losses = self.replica.losses();
        let mut watching = true;
        loop {
            tokio::select! {
                read = recv.read(&mut buf) => match read {
                    Ok(Some(n)) => {
                        let bytes = buf.get(..n).unwrap_or_default();
                        let events = match self.server.handle_control(bytes) {
                            Ok(events) => events,
                            Err(e) => return Err(self.fault(&e)),
                        };
                        for event in events {
                            if let TrunkServerEvent::Open { relay, .. } = &event {
                                if let Err(frame) = self.check_name(relay) {
                                    write(&mut send, conn, self.metrics, frame).await?;
                                    // The relay reads why, and closes, before the
                                    // connection goes (a second at most).
                                    let _ = send.finish();
                                    let _ = tokio::time::timeout(REFUSAL_GRACE, conn.closed()).await;
                                    conn.close(close::REJECTED.into(), b"relay name mismatch");
                                    return Err("relay name mismatch");
                                }
                                opened = true;
                            }
                            let frames = self.on_control(event).await;
                            write(&mut send, conn, self.metrics, frames).await?;
                        }
                    }
                    Ok(None) | Err(_) => {
                        conn.close(close::NORMAL.into(), b"control stream ended");
                        return Err("control stream ended");
                    }
                },
                read = conn.read_datagram() => match read {
                    Ok(batch) => {
                        let frames = self.on_batch(&batch)?;
                        write(&mut send, conn, self.metrics, frames).await?;
                    }
                    Err(_) => return Ok(()),
                },
                _ = sweep.tick() => {
                    if !opened && tokio::time::Instant::now() >= opened_by {
                        self.metrics.reject_connection("hello_timeout");
                        conn.close(close::PROTOCOL.into(), b"no open");
                        return Err("no open");
                    }
                    if expires_in(self.relay_not_after).is_zero() {
                        return Err(close_for(conn, self.metrics, &self.relay, Verdict::Expired));
                    }
                    write(&mut send, conn, self.metrics, self.sweep()).await?;
                }
                changed = revocations.changed(), if watching => {
                    if changed.is_err() {
                        // The list is gone with the daemon: nothing more changes.
                        watching = false;
                        continue;
                    }
                    if let v @ (Verdict::Revoked | Verdict::Expired) =
                        self.ingest.revocation.verdict(&self.relay_chain)
                    {
                        return Err(close_for(conn, self.metrics, &self.relay, v));
                    }
                    // Every slot, checked a batch at a time below: a list that changes
                    // again meanwhile starts the checks over.
                    self.rechecks = self.agents.keys().copied().collect();
                }
                () = std::future::ready(()), if !self.rechecks.is_empty() => {
                    write(&mut send, conn, self.metrics, self.recheck()).await?;
                    // The thread's other tasks run before the next batch.
                    tokio::task::yield_now().await;
                }
                () = lost(&mut losses) => {
                    write(&mut send, conn, self.metrics, self.moved()).await?;
                }
            }
        }
    }

    /// Whether the name the relay gives itself in its open is its certificate's: the
    /// `Closed` frame to send before closing the trunk if not
    /// (`relay_name_mismatch`).
    fn check_name(&mut self, named: &str) -> Result<(), Option<Vec<u8>>> {
        if named == self.relay {
            return Ok(());
        }
        tracing::warn!(relay = %self.relay, %named, "trunk refused: the relay names itself other than its certificate");
        self.metrics.reject_connection("relay_name_mismatch");
        let text = format!(
            "the relay named itself {named:?}, its certificate {:?}",
            self.relay
        );
        Err(self
            .server
            .refuse(RejectReason::IdentityMismatch, &text)
            .ok())
    }

    /// What to send for one of the relay's control frames.
    async fn on_control(&mut self, event: TrunkServerEvent) -> Vec<Vec<u8>> {
        match event {
            TrunkServerEvent::Open { relay, version } => {
                tracing::info!(relay = %self.relay, named = %relay, %version, remote = %self.conn.remote_address(), "trunk opened");
                self.server.opened().ok().into_iter().collect()
            }
            TrunkServerEvent::AttachRequested {
                slot,
                chain,
                source,
                proven,
            } => {
                if !self.challenged {
                    if let Some(frame) = self.too_fast(slot) {
                        return vec![frame];
                    }
                }
                if !proven {
                    tracing::warn!(relay = %self.relay, slot, "relayed agent admitted without a proof of its key (admit_unproven_relayed_agents)");
                    self.metrics.trunk_unproven.inc();
                }
                self.attach(slot, chain, source).await.into_iter().collect()
            }
            TrunkServerEvent::Challenged { slot, frame } => match self.too_fast(slot) {
                Some(refused) => vec![refused],
                None => vec![frame],
            },
            TrunkServerEvent::ProofRefused { slot, error, frame } => {
                tracing::warn!(relay = %self.relay, slot, reason = error.label(), "relayed agent refused: {error}");
                self.metrics.reject_connection(error.label());
                vec![frame]
            }
            TrunkServerEvent::Refused { slot, frame } => {
                tracing::debug!(relay = %self.relay, slot, "attach refused: the trunk is full");
                self.metrics.reject(&RejectReason::LimitReached.to_string());
                vec![frame]
            }
            TrunkServerEvent::DetachRequested { slot } => {
                // The agent left the relay: dropping its link lets go of it here.
                self.forget(slot);
                Vec::new()
            }
        }
    }

    /// Takes an attach from the trunk's bucket: the frame that refuses `slot` if the
    /// relay attaches faster than `trunk_attach_rate` allows (`attach_rate`), before
    /// its proof or its chain costs anything.
    fn too_fast(&mut self, slot: Slot) -> Option<Vec<u8>> {
        if self.attaches.take(Instant::now()) {
            return None;
        }
        tracing::debug!(relay = %self.relay, slot, "attach refused: the trunk attaches too fast");
        self.metrics.reject_connection("attach_rate");
        let limits = &self.ingest.limits;
        let text = format!(
            "the trunk attaches faster than {} a second ({} at once)",
            limits.trunk_attach_rate, limits.trunk_attach_burst
        );
        self.server
            .refuse_attach(slot, RejectReason::LimitReached, &text)
            .ok()
    }

    /// Checks and admits a relayed agent: the frame that answers its attach.
    async fn attach(&mut self, slot: Slot, chain: Vec<Vec<u8>>, source: IpAddr) -> Option<Vec<u8>> {
        let chain: Vec<CertificateDer<'static>> =
            chain.into_iter().map(CertificateDer::from).collect();
        if let Err(text) = self.scope.source_allowed(source) {
            tracing::warn!(relay = %self.relay, slot, "relayed agent refused: {text}");
            self.metrics.reject_connection("relay_scope");
            return self
                .server
                .refuse_attach(slot, RejectReason::AddressNotAllowed, &text)
                .ok();
        }
        if let Some((code, reason, text)) = chain_refusal(self.ingest.revocation.judge(&chain)) {
            tracing::warn!(relay = %self.relay, slot, reason, "relayed agent refused: {text}");
            self.metrics.reject_connection(reason);
            return self.refuse(slot, code, reason, &text);
        }
        let info = match chain.first().map(CertInfo::parse) {
            Some(Ok(info)) => info,
            Some(Err(_)) | None => {
                self.metrics.reject_connection("no_identity");
                return self.refuse(slot, close::REJECTED, "no_identity", "no identity");
            }
        };
        if info.has_role(ballast_shared::pki::RELAY_ROLE) {
            tracing::warn!(relay = %self.relay, agent = %info.identity, "a relay's certificate attached as an agent");
            self.metrics.reject_connection("relay_as_agent");
            let text = "a relay certificate is not an agent's";
            return self.refuse(slot, close::REJECTED, "relay_as_agent", text);
        }
        let per_node = self.ingest.limits.quic_max_connections_per_identity;
        let Some(place) = self.ingest.connections.claim(&info.identity, per_node) else {
            tracing::warn!(relay = %self.relay, slot, node = %info.identity, limit = per_node,
                "relayed agent refused: the node holds too many sessions");
            self.metrics.reject_connection("identity_connections");
            let text = format!(
                "node {:?} holds {per_node} sessions already, direct and through relays",
                info.identity
            );
            return self
                .server
                .refuse_attach(slot, RejectReason::LimitReached, &text)
                .ok();
        };
        let not_after_unix_s = info.not_after_unix_s;
        let zones = self
            .ingest
            .policy
            .zones(&info.identity, info.spiffe_id.as_deref());
        let peer = peer(self.ingest, info, source);
        let hello = match self.server.admit(slot, peer, now()) {
            Ok(Admission::Hello(hello)) => hello,
            Ok(Admission::Refused { reject, frame }) => {
                tracing::warn!(relay = %self.relay, slot, reason = %reject.reason, detail = %reject.detail, "relayed hello rejected");
                self.metrics.reject(&reject.reason.to_string());
                return Some(frame);
            }
            Err(e) => {
                tracing::debug!(relay = %self.relay, slot, error = %e, "attach not admitted");
                self.metrics.reject("trunk_slot");
                return None;
            }
        };
        if let Err(text) = self.scope.service_allowed(&hello.service) {
            tracing::warn!(relay = %self.relay, slot, node = %hello.node, "relayed hello rejected: {text}");
            self.metrics.reject_connection("relay_scope");
            return self
                .server
                .reject(slot, RejectReason::ServiceNotAllowed, &text)
                .ok();
        }
        if let Err(text) = zones.check(&hello.node, &hello.zone) {
            tracing::warn!(relay = %self.relay, slot, node = %hello.node, "relayed hello rejected: {text}");
            self.metrics.reject(ZONE_NOT_ALLOWED);
            // Told as a service the node may not serve there, which agents of every
            // version know.
            return self
                .server
                .reject(slot, RejectReason::ServiceNotAllowed, &text)
                .ok();
        }
        let session = match self.server.session(slot) {
            Some(s) => s,
            None => return None,
        };
        let arrival = Arrival {
            peer: session.peer(),
            chain: &chain,
            remote: SocketAddr::new(source, 0),
            hello: &hello,
            prover: None,
        };
        match self.replica.admit(arrival).await {
            Ok(Admitted { interval_ms, link }) => {
                if let Some(s) = self.server.session_mut(slot) {
                    s.set_interval_ms(interval_ms);
                }
                let frame = self.server.welcome(slot).ok()?;
                tracing::info!(relay = %self.relay, slot, node = %hello.node, service = %hello.service,
                    address = %hello.address, zone = %hello.zone, agent_version = %hello.version,
                    "agent attached through a relay");
                let limits = &self.ingest.limits;
                self.agents.insert(
                    slot,
                    Agent {
                        link,
                        chain,
                        node: hello.node,
                        not_after_unix_s,
                        rate: Rate::new(limits.quic_max_datagrams_per_second, Instant::now()),
                        heard: Instant::now(),
                        silence_limit: report_timeout(limits.quic_report_timeout_ms, interval_ms),
                        _place: place,
                    },
                );
                self.metrics.trunk_slots.inc();
                Some(frame)
            }
            Err(reject) => {
                tracing::warn!(relay = %self.relay, slot, node = %hello.node, reason = %reject.reason, detail = %reject.detail, "relayed hello rejected");
                self.metrics.reject(&reject.reason.to_string());
                self.server.reject(slot, reject.reason, &reject.detail).ok()
            }
        }
    }

    /// Refuses a requested slot whose chain is refused: revoked and expired ones with
    /// their close codes, as the relay then closes the agent; others with a reject.
    fn refuse(&mut self, slot: Slot, code: u32, reason: &str, text: &str) -> Option<Vec<u8>> {
        let frame = if code == close::REJECTED {
            self.server
                .refuse_attach(slot, RejectReason::IdentityMismatch, text)
        } else {
            self.server.detach(slot, code, reason)
        };
        frame.ok()
    }

    /// Takes a batch of reports: the frames to send for slots it detached. The batch of
    /// replies leaves before this returns.
    fn on_batch(&mut self, batch: &[u8]) -> Result<Vec<Vec<u8>>, End> {
        self.metrics.trunk_batches.inc();
        let events = match self.server.handle_datagram(batch) {
            Ok(events) => events,
            Err(e @ TrunkServerError::BadBatch(_)) => {
                tracing::debug!(relay = %self.relay, error = %e, "bad batch dropped");
                self.metrics.reject("bad_batch");
                return Ok(Vec::new());
            }
            Err(e) => return Err(self.fault(&e)),
        };
        self.metrics.trunk_reports.inc_by(events.len() as u64);
        let mut frames = Vec::new();
        let at = Instant::now();
        for SlotEvent { slot, event } in events {
            let Some(agent) = self.agents.get_mut(&slot) else {
                // Attached but not yet welcomed: a report before the welcome.
                if let Err(e) = event {
                    self.metrics.reject(e.label());
                }
                continue;
            };
            if !agent.rate.take(at) {
                self.metrics.reject("rate_limited");
                continue;
            }
            match event {
                Ok(ServerEvent::Report(report)) => {
                    agent.heard = at;
                    // The replica's link reads the report, not its bytes.
                    match agent.link.report(&report, &[]) {
                        Forwarded::Assigned {
                            assignment,
                            accepted,
                        } => {
                            if accepted {
                                self.metrics.reports_accepted.inc();
                                #[cfg(feature = "gate-probe")]
                                ballast_shared::gate_probe::spin("trunk");
                            } else {
                                self.metrics.reject("reordered");
                            }
                            if let Ok(Some(full)) = self.server.reply(slot, &assignment) {
                                let _ = self.conn.send_datagram(full.into());
                            }
                        }
                        Forwarded::Queued => {}
                        Forwarded::Refused(reason) => self.metrics.reject(&reason.to_string()),
                        Forwarded::Dropped(reason) => self.metrics.reject(reason),
                    }
                }
                Ok(ServerEvent::Reordered { .. }) => self.metrics.reject("reordered"),
                Ok(_) => {}
                Err(e) => {
                    self.metrics.reject(e.label());
                    if matches!(e, ServerError::TooManyBadDatagrams { .. }) {
                        frames.extend(self.detach(
                            slot,
                            close::PROTOCOL,
                            "protocol",
                            &e.to_string(),
                        ));
                    }
                }
            }
        }
        if let Some(replies) = self.server.take_replies() {
            let _ = self.conn.send_datagram(replies.into());
        }
        Ok(frames)
    }

    /// Detaches silent slots and those whose certificate expired: the frames.
    fn sweep(&mut self) -> Vec<Vec<u8>> {
        let at = Instant::now();
        let ends: Vec<(Slot, u32, &'static str)> = self
            .agents
            .iter()
            .filter_map(|(slot, a)| {
                if expires_in(a.not_after_unix_s).is_zero() {
                    Some((*slot, close::EXPIRED, "expired"))
                } else if at.saturating_duration_since(a.heard) > a.silence_limit {
                    Some((*slot, close::NORMAL, "no_reports"))
                } else {
                    None
                }
            })
            .collect();
        ends.into_iter()
            .filter_map(|(slot, code, reason)| self.detach(slot, code, reason, reason))
            .collect()
    }

    /// Checks the next batch of slots still to check under a new revocation list
    /// (at most [`RECHECK_BATCH`], for at most [`RECHECK_SLICE`]): the frames that
    /// detach the revoked and expired. Slots gone meanwhile are skipped; those
    /// attached since were checked under the new list when they attached.
    fn recheck(&mut self) -> Vec<Vec<u8>> {
        let started = Instant::now();
        let mut frames = Vec::new();
        for _ in 0..RECHECK_BATCH {
            let Some(slot) = self.rechecks.pop_front() else {
                break;
            };
            let Some(agent) = self.agents.get(&slot) else {
                continue;
            };
            let end = match self.ingest.revocation.verdict(&agent.chain) {
                Verdict::Valid => None,
                Verdict::Revoked => Some((close::REVOKED, "revoked")),
                Verdict::Expired => Some((close::EXPIRED, "expired")),
            };
            if let Some((code, reason)) = end {
                frames.extend(self.detach(slot, code, reason, reason));
            }
            if started.elapsed() >= RECHECK_SLICE {
                break;
            }
        }
        frames
    }

    /// After the replica lost a bucket: the frames that detach the slots whose
    /// service went with it, as each link tells.
    fn moved(&mut self) -> Vec<Vec<u8>> {
        let ends: Vec<(Slot, u32, &'static str, String)> = self
            .agents
            .iter_mut()
            .filter_map(|(slot, a)| match a.link.next().now_or_never() {
                Some(Downstream::Close(c)) => {
                    Some((*slot, c.code, c.reason, c.detail.into_owned()))
                }
                Some(Downstream::Reply(_)) | None => None,
            })
            .collect();
        ends.into_iter()
            .filter_map(|(slot, code, reason, detail)| self.detach(slot, code, reason, &detail))
            .collect()
    }

    /// Detaches a welcomed slot with `code`, counted under `reason`: the frame.
    fn detach(
        &mut self,
        slot: Slot,
        code: u32,
        reason: &'static str,
        text: &str,
    ) -> Option<Vec<u8>> {
        let node = self.forget(slot)?;
        tracing::info!(relay = %self.relay, slot, %node, reason, "relayed agent detached: {text}");
        self.metrics.detach_slot(reason);
        self.server.detach(slot, code, text).ok()
    }

    /// Lets go of a welcomed slot's agent: its node, if it was one.
    fn forget(&mut self, slot: Slot) -> Option<String> {
        let agent = self.agents.remove(&slot)?;
        self.metrics.trunk_slots.dec();
        Some(agent.node)
    }

    /// Counts a fault that ends the trunk and closes its connection: the reason.
    fn fault(&mut self, e: &TrunkServerError) -> End {
        tracing::warn!(relay = %self.relay, error = %e, "trunk closed for a protocol fault");
        self.metrics.reject_connection("trunk_protocol");
        let code = self.server.close_code().unwrap_or(close::PROTOCOL);
        self.conn.close(code.into(), e.to_string().as_bytes());
        "trunk protocol fault"
    }

    /// The trunk is over: every agent still attached goes with it.
    fn end(&mut self) {
        let left = self.agents.len();
        for _ in 0..left {
            self.metrics.detach_slot("relay_gone");
            self.metrics.trunk_slots.dec();
        }
        self.agents.clear();
        if left > 0 {
            tracing::info!(relay = %self.relay, agents = left, "trunk ended; its agents are let go");
        }
    }
}

#[cfg(test)]
mod tests {
    //! The trunk's own arithmetic; the trunk served in-process with the aggregator's
    //! balancer behind it is tested there (`aggregator/src/ingest/local/primary_trunk_tests.rs`).

    use super::*;

    #[test]
    fn batches_fit_a_datagram_and_the_protocol() {
        assert_eq!(batch_limit(None), 1200);
        assert_eq!(batch_limit(Some(1452)), 1452);
        assert_eq!(
            batch_limit(Some(1 << 20)),
            u32::try_from(MAX_BATCH).expect("small")
        );
    }

    #[test]
    fn refused_chains_are_told_apart() {
        use quinn::rustls::{CertificateError as C, Error as E};
        assert!(chain_refusal(Ok(Verdict::Valid)).is_none());
        let code = |j| chain_refusal(j).map(|(code, reason, _)| (code, reason));
        assert_eq!(
            code(Ok(Verdict::Revoked)),
            Some((close::REVOKED, "revoked"))
        );
        assert_eq!(
            code(Ok(Verdict::Expired)),
            Some((close::EXPIRED, "expired"))
        );
        assert_eq!(
            code(Err(E::InvalidCertificate(C::UnknownIssuer))),
            Some((close::REJECTED, "unknown_ca"))
        );
        assert_eq!(
            code(Err(E::InvalidCertificate(C::BadEncoding))),
            Some((close::REJECTED, "bad_certificate"))
        );
    }
}
