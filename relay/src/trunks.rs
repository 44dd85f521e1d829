//! The relay's trunks: one QUIC connection per replica, each driven by a task of its
//! own around the sans-IO [`TrunkClient`].
//!
//! A trunk task dials the replica's advertised address with the relay's identity
//! (offering every [`TrunkProtocol`] it speaks), dials again with backoff when the connection is lost or the
//! address changes, and ends once the replica is no member of the cluster any more.
//! Agents' links talk to it through [`Command`]s: an attach is answered once the
//! primary answers; each attached slot gets the primary's replies, verbatim, and the
//! end of its slot ([`Down`]) on a channel of its own.

use super::metrics::RelayMetrics;
use super::routes::Routes;
use ballast_ingest::supervise::Children;
use ballast_ingest::upstream::Prover;
use ballast_shared::reconnect::{host_part, Backoff};
use ballast_shared::session::close;
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::trunk::{
    TrunkClient, TrunkClientConfig, TrunkClientError, TrunkClientEvent,
};
use ballast_shared::trunk::{Slot, MAX_BATCH};
use ballast_shared::wire::{Proof, Reject};
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

use ballast_shared::trunk::TrunkProtocol;

/// What a relay offers a primary: every version of the trunk protocol it speaks,
/// current first, unless `BALLAST_PROTOCOL` narrows them.
pub(crate) fn trunk_alpns() -> Result<Vec<&'static [u8]>, ballast_ingest::IngestError> {
    Ok(TrunkProtocol::from_env()?
        .into_iter()
        .map(TrunkProtocol::alpn)
        .collect())
}

/// The TLS alert a server ends a handshake with when it speaks none of the
/// application protocols offered (RFC 7301).
const NO_APPLICATION_PROTOCOL: u8 = 120;

/// How many commands (mostly reports) wait for a trunk's task before reports are
/// dropped (`trunk_full`).
const COMMAND_QUEUE: usize = 8192;

/// The largest control read.
const READ_CHUNK: usize = 16 * 1024;

/// How long a write on the control stream may wait for the primary to read: a
/// primary that stops reading would otherwise hold the trunk's task, its replies and
/// its timers, while the connection itself looks alive.
const CONTROL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a primary has to answer the trunk's open.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How often slots whose agent's link is gone without its detach are let go.
const SWEEP: Duration = Duration::from_secs(1);

/// The most attaches held for a trunk that is not open yet; more are refused.
const MAX_WAITING: usize = 4096;

/// What a link asks of a trunk.
#[derive(Debug)]
pub(crate) enum Command {
    /// Attach an agent: its framed hello, its chain (DER) and source address. Its
    /// replies and its slot's end go to `down`; the outcome to `answer`.
    Attach {
        /// The framed hello as the agent sent it.
        hello: Vec<u8>,
        /// The agent's certificate chain, leaf first.
        chain: Vec<Vec<u8>>,
        /// The agent's source address.
        source: IpAddr,
        /// Where the slot's replies and end go.
        down: mpsc::UnboundedSender<Down>,
        /// Where the outcome goes.
        answer: oneshot::Sender<Result<Attached, AttachError>>,
        /// How to ask the agent for the proof the primary challenges it for.
        prover: Prover,
    },
    /// An attached slot's report, as its agent sent it.
    Report {
        /// The slot.
        slot: Slot,
        /// The report datagram.
        bytes: Bytes,
    },
    /// The slot's agent is gone, or has moved on.
    Detach {
        /// The slot.
        slot: Slot,
    },
}

/// A slot the primary took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attached {
    /// The slot.
    pub(crate) slot: Slot,
    /// The interval the primary's welcome gives.
    pub(crate) interval_ms: u32,
}

/// Why an attach did not come through.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum AttachError {
    /// The primary refused the agent, as it would a direct connection.
    #[error("refused by the owner: {} ({})", .0.reason, .0.detail)]
    Rejected(Reject),
    /// The trunk is not open (connecting, or its replica is gone).
    #[error("the trunk to the owner is not open")]
    TrunkDown,
    /// The primary did not answer in time.
    #[error("the owner did not answer in time")]
    Timeout,
    /// The trunk has as many slots as the primary takes.
    #[error("the trunk to the owner is full")]
    SlotsFull,
    /// The primary ended the slot before it was attached, as it closes a direct
    /// connection (a revoked or expired certificate): `code` is that close's.
    #[error("the owner closed the agent's slot: {reason}")]
    Closed {
        /// The close code a direct connection would get.
        code: u32,
        /// Why, for people.
        reason: String,
    },
}

impl AttachError {
    /// The reason an attach refused so is counted under.
    pub(crate) fn label(&self) -> String {
        match self {
            AttachError::Rejected(r) => r.reason.to_string(),
            AttachError::TrunkDown => "trunk_down".into(),
            AttachError::Timeout => "timeout".into(),
            AttachError::SlotsFull => "slots_full".into(),
            AttachError::Closed { code, .. } => close_reason(*code).into(),
        }
    }
}

/// The reason a close with `code` from the primary is counted under.
pub(super) fn close_reason(code: u32) -> &'static str {
    match code {
        close::MOVED => "moved",
        close::REVOKED => "revoked",
        close::EXPIRED => "expired",
        close::PROTOCOL => "protocol",
        close::NORMAL => "no_reports",
        _ => "upstream_closed",
    }
}

/// What a trunk tells an attached slot's link.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Down {
    /// A reply from the primary, to send to the agent as it is.
    Reply(Bytes),
    /// The primary ended the slot with a close code for the agent.
    Detached {
        /// The close code.
        code: u32,
        /// Why.
        reason: String,
    },
    /// The trunk is gone, and the slot with it.
    Lost,
}

/// What the trunks share: how to dial, and where the routes are.
pub(crate) struct Dialer {
    /// The relay's name, told to each primary.
    pub(crate) relay: String,
    /// The endpoint trunks are dialled from.
    pub(crate) endpoint: quinn::Endpoint,
    /// The relay's client identity, offering every [`TrunkProtocol`] it speaks.
    pub(crate) client: quinn::ClientConfig,
    /// The name replicas' certificates are checked against, if not the host part of
    /// their advertised address.
    pub(crate) server_name: Option<String>,
    /// How long a batch's first report waits for others.
    pub(crate) batch_delay: Duration,
    /// How long an attach waits for the primary's answer.
    pub(crate) attach_timeout: Duration,
    /// The cluster's routes.
    pub(crate) routes: watch::Receiver<Arc<Routes>>,
    /// The relay's metrics.
    pub(crate) metrics: Arc<RelayMetrics>,
}

/// One trunk as the rest of the relay sees it.
#[derive(Debug, Clone)]
struct Handle {
    commands: mpsc::Sender<Command>,
    open: Arc<AtomicBool>,
}

/// Every replica's trunk.
pub(crate) struct Trunks {
    dialer: Arc<Dialer>,
    trunks: Mutex<BTreeMap<String, Handle>>,
}

impl Trunks {
    /// No trunk yet.
    pub(crate) fn new(dialer: Dialer) -> Arc<Self> {
        Arc::new(Trunks {
            dialer: Arc::new(dialer),
            trunks: Mutex::new(BTreeMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Handle>> {
        self.trunks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where `replica`'s trunk takes commands, if it has one.
    pub(crate) fn commands(&self, replica: &str) -> Option<mpsc::Sender<Command>> {
        self.lock().get(replica).map(|h| h.commands.clone())
    }

    /// Each trunk and whether it is open.
    pub(crate) fn states(&self) -> BTreeMap<String, bool> {
        self.lock()
            .iter()
            .map(|(name, h)| (name.clone(), h.open.load(Ordering::Relaxed)))
            .collect()
    }

    /// Starts a trunk for every member of the cluster as the routes name them, until
    /// the routes are gone with the relay. A trunk ends when its replica leaves the
    /// cluster; one that panics ends this task with its panic, which the supervisor
    /// reports (its replica would otherwise keep a dead trunk, never dialled again).
    pub(crate) async fn run(self: Arc<Self>) {
        let mut routes = self.dialer.routes.clone();
        let mut trunks = Children::default();
        loop {
            let members: Vec<String> = routes.borrow_and_update().members.keys().cloned().collect();
            for replica in members {
                let mut known = self.lock();
                if known.contains_key(&replica) {
                    continue;
                }
                let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
                let open = Arc::new(AtomicBool::new(false));
                known.insert(
                    replica.clone(),
                    Handle {
                        commands: tx,
                        open: open.clone(),
                    },
                );
                drop(known);
                trunks.spawn(self.clone().trunk(replica, rx, open));
            }
            tokio::select! {
                changed = routes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                payload = trunks.panicked() => std::panic::resume_unwind(payload),
            }
        }
    }

    /// One replica's trunk, dialled again with backoff, until the replica is no
    /// member.
    async fn trunk(
        self: Arc<Self>,
        replica: String,
        mut commands: mpsc::Receiver<Command>,
        open: Arc<AtomicBool>,
    ) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        // Slot numbers go on rising across the trunk's connections: a command for a
        // slot of a lost connection can then name no agent of the next one.
        let mut next_slot: Slot = 0;
        loop {
            let address = self.dialer.routes.borrow().members.get(&replica).cloned();
            let Some(address) = address else {
                // No member any more: its slots were lost with the trunk already.
                let mut trunks = self.lock();
                if trunks
                    .get(&replica)
                    .is_some_and(|h| Arc::ptr_eq(&h.open, &open))
                {
                    trunks.remove(&replica);
                }
                tracing::info!(%replica, "the replica left the cluster; its trunk ends");
                return;
            };
            let mut session = TrunkConnection::new(&self.dialer, &replica, &address, next_slot);
            let ended = session.run(&mut commands, &open).await;
            next_slot = session.next_slot;
            if open.swap(false, Ordering::Relaxed) {
                self.dialer.metrics.trunks_open.dec();
                backoff.reset();
            }
            session.lose();
            match ended {
                Ended::Stopped => return,
                // A new address is dialled at once: the old one's failures say
                // nothing of it.
                Ended::Moved => continue,
                Ended::Failed(_) => {}
            }
            let wait = backoff.next_delay(&mut rand::thread_rng());
            if let Ended::Failed(error) = &ended {
                tracing::warn!(%replica, %address, %error, retry_in = ?wait, "trunk lost");
            }
            let sleep = tokio::time::sleep(wait);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    () = &mut sleep => break,
                    cmd = commands.recv() => match cmd {
                        Some(cmd) => refuse(cmd, &self.dialer.metrics),
                        None => return,
                    }
                }
            }
        }
    }
}

/// What a failed dial of `addr` says in the relay's log: a replica that shares no
/// trunk version with this relay is named as such, so that a skew of more than one
/// release is not taken for a network fault.
fn dial_error(addr: SocketAddr, e: &quinn::ConnectionError) -> String {
    match e {
        quinn::ConnectionError::ConnectionClosed(c)
            if c.error_code == quinn::TransportErrorCode::crypto(NO_APPLICATION_PROTOCOL) =>
        {
            format!(
                "connecting to {addr}: the replica speaks none of the trunk protocols this \
                 relay offers ({}): the two are more than one release apart; upgrade the \
                 older first ({e})",
                TrunkProtocol::names()
            )
        }
        e => format!("connecting to {addr}: {e}"),
    }
}

/// Answers a command the trunk cannot carry out now.
fn refuse(cmd: Command, metrics: &RelayMetrics) {
    match cmd {
        Command::Attach { answer, .. } => {
            let _ = answer.send(Err(AttachError::TrunkDown));
        }
        // A report for a slot of a trunk that is down: its link hears of the loss
        // and holds its agent's reports from then on.
        Command::Report { .. } => metrics.drop_report("trunk_down"),
        Command::Detach { .. } => {}
    }
}

/// How a trunk's connection ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The relay stops.
    Stopped,
    /// The replica's address changed: dial the new one at once.
    Moved,
    /// Lost or refused, with why.
    Failed(String),
}

/// An agent's answer to the challenge of its slot's attach.
type Proved = (Slot, Option<Proof>);

/// An attach in flight: where its slot's replies will go, where its outcome goes, and
/// how to ask its agent for a proof.
type Pending = (
    mpsc::UnboundedSender<Down>,
    oneshot::Sender<Result<Attached, AttachError>>,
    Prover,
);

/// One connection of a trunk: its slots and attaches in flight.
struct TrunkConnection<'a> {
    dialer: &'a Dialer,
    replica: &'a str,
    address: &'a str,
    slots: HashMap<Slot, mpsc::UnboundedSender<Down>>,
    pending: HashMap<Slot, Pending>,
    /// Attaches that came before the primary's `Opened`, carried out once it comes.
    waiting: Vec<Command>,
    /// The number the next slot gets.
    next_slot: Slot,
    /// The agents' answers to the primary's challenges, as they come.
    proved: (
        mpsc::UnboundedSender<Proved>,
        mpsc::UnboundedReceiver<Proved>,
    ),
}

impl<'a> TrunkConnection<'a> {
    fn new(dialer: &'a Dialer, replica: &'a str, address: &'a str, next_slot: Slot) -> Self {
        TrunkConnection {
            dialer,
            replica,
            address,
            slots: HashMap::new(),
            pending: HashMap::new(),
            waiting: Vec::new(),
            next_slot,
            proved: mpsc::unbounded_channel(),
        }
    }

    /// Every slot and attach of the connection is lost with it.
    fn lose(&mut self) {
        for (_, down) in self.slots.drain() {
            let _ = down.send(Down::Lost);
        }
        for (_, (_, answer, _)) in self.pending.drain() {
            let _ = answer.send(Err(AttachError::TrunkDown));
        }
        for cmd in self.waiting.drain(..) {
            refuse(cmd, &self.dialer.metrics);
        }
    }

    async fn connect(&self) -> Result<quinn::Connection, String> {
        let addr: SocketAddr = tokio::net::lookup_host(self.address)
            .await
            .map_err(|e| format!("resolving {}: {e}", self.address))?
            .next()
            .ok_or_else(|| format!("{} resolves to no address", self.address))?;
        let name = self
            .dialer
            .server_name
            .as_deref()
            .unwrap_or_else(|| host_part(self.address));
        let connecting = self
            .dialer
            .endpoint
            .connect_with(self.dialer.client.clone(), addr, name)
            .map_err(|e| format!("dialling {addr}: {e}"))?;
        connecting.await.map_err(|e| dial_error(addr, &e))
    }

    /// Dials and drives the trunk until it ends.
    async fn run(&mut self, commands: &mut mpsc::Receiver<Command>, open: &AtomicBool) -> Ended {
        let mut routes = self.dialer.routes.clone();
        routes.mark_unchanged();
        let conn = tokio::select! {
            c = self.connect() => match c {
                Ok(c) => c,
                Err(e) => return Ended::Failed(e),
            },
            // Attaches are not held while dialling: their agents try their next address.
            () = drain(commands, &self.dialer.metrics) => return Ended::Stopped,
            // An address that changes while it is dialled is given up at once, not
            // after the handshake's timeout.
            () = moved(&mut routes, self.replica, self.address) => return Ended::Moved,
        };
        let ended = self.drive(&conn, commands, open, &mut routes).await;
        conn.close(quinn::VarInt::from_u32(close::NORMAL), b"trunk ends");
        ended
    }

    async fn drive(
        &mut self,
        conn: &quinn::Connection,
        commands: &mut mpsc::Receiver<Command>,
        open: &AtomicBool,
        routes: &mut watch::Receiver<Arc<Routes>>,
    ) -> Ended {
        let fail = |what: &str, e: &dyn std::fmt::Display| Ended::Failed(format!("{what}: {e}"));
        let max_batch = conn.max_datagram_size().unwrap_or(1200).min(MAX_BATCH);
        let mut client = TrunkClient::new(TrunkClientConfig {
            relay: self.dialer.relay.clone(),
            batch_delay: self.dialer.batch_delay,
            attach_timeout: self.dialer.attach_timeout,
            max_batch_bytes: max_batch,
            protocol: TrunkProtocol::negotiated(conn).unwrap_or(TrunkProtocol::CURRENT),
        })
        .starting_at(self.next_slot);
        let (mut send, mut recv) = match conn.open_bi().await {
            Ok(s) => s,
            Err(e) => return fail("opening the control stream", &e),
        };
        let frame = match client.open_frame() {
            Ok(f) => f,
            Err(e) => return fail("the open frame", &e),
        };
        if let Err(e) = write(&mut send, &frame).await {
            return fail("writing the open frame", &e);
        }
        let mut buf = vec![0u8; READ_CHUNK];
        let opened_by = tokio::time::sleep(OPEN_TIMEOUT);
        tokio::pin!(opened_by);
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut control: Vec<u8> = Vec::new();
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    None => return Ended::Stopped,
                    Some(cmd) => self.command(&mut client, conn, cmd, &mut control),
                },
                read = recv.read(&mut buf) => match read {
                    Ok(Some(n)) => {
                        let events = match client.handle_control(buf.get(..n).unwrap_or_default()) {
                            Ok(e) => e,
                            Err(e) => return fail("the primary's control stream", &e),
                        };
                        for event in events {
                            if let Some(end) = self.event(&mut client, event, open, &mut control) {
                                return end;
                            }
                        }
                        if client.is_open() {
                            for cmd in std::mem::take(&mut self.waiting) {
                                self.command(&mut client, conn, cmd, &mut control);
                            }
                        }
                    }
                    Ok(None) => return Ended::Failed("the primary ended the control stream".into()),
                    Err(e) => return fail("reading the control stream", &e),
                },
                datagram = conn.read_datagram() => match datagram {
                    Ok(bytes) => self.replies(&mut client, &bytes, &mut control),
                    Err(e) => return fail("the connection", &e),
                },
                () = until(client.poll_timeout()) => {
                    let expired = client.handle_timeout(now());
                    if let Some(batch) = expired.batch {
                        let _ = conn.send_datagram(batch.into());
                    }
                    for slot in expired.timed_out {
                        if let Some((_, answer, _)) = self.pending.remove(&slot) {
                            let _ = answer.send(Err(AttachError::Timeout));
                        }
                    }
                    control.extend(expired.control);
                }
                _ = sweep.tick() => self.sweep(&mut client, &mut control),
                Some((slot, proof)) = self.proved.1.recv() => {
                    if proof.is_none() {
                        self.dialer.metrics.refuse_attach("unproven");
                    }
                    // An attach that timed out meanwhile is gone: its answer with it.
                    if let Ok(frame) = client.prove(slot, proof) {
                        control.extend(frame);
                    }
                }
                () = &mut opened_by, if !client.is_open() => {
                    return Ended::Failed(format!("no answer to the open in {OPEN_TIMEOUT:?}"));
                }
                () = moved(routes, self.replica, self.address) => return Ended::Moved,
            }
            if !control.is_empty() {
                if let Err(e) = write(&mut send, &control).await {
                    return fail("writing the control stream", &e);
                }
            }
        }
    }

    /// Carries out a link's command; control frames to send go to `control`.
    fn command(
        &mut self,
        client: &mut TrunkClient,
        conn: &quinn::Connection,
        cmd: Command,
        control: &mut Vec<u8>,
    ) {
        match cmd {
            // Dialled, not yet opened: one round trip to wait, not a refusal.
            cmd @ Command::Attach { .. } if !client.is_open() && !client.is_closed() => {
                if self.waiting.len() < MAX_WAITING {
                    self.waiting.push(cmd);
                } else {
                    refuse(cmd, &self.dialer.metrics);
                }
            }
            Command::Attach {
                hello,
                chain,
                source,
                down,
                answer,
                prover,
            } => match client.attach(now(), &hello, chain, source) {
                Ok((slot, frame)) => {
                    self.next_slot = client.next_slot();
                    control.extend(frame);
                    self.pending.insert(slot, (down, answer, prover));
                }
                Err(TrunkClientError::SlotsFull(_)) => {
                    let _ = answer.send(Err(AttachError::SlotsFull));
                }
                Err(_) => {
                    let _ = answer.send(Err(AttachError::TrunkDown));
                }
            },
            Command::Report { slot, bytes } => match client.push_report(now(), slot, &bytes) {
                Ok(full) => {
                    self.dialer.metrics.reports_forwarded.inc();
                    if let Some(batch) = full {
                        let _ = conn.send_datagram(batch.into());
                    }
                }
                Err(TrunkClientError::UnknownSlot(_)) => self.dialer.metrics.drop_report("stale"),
                Err(_) => self.dialer.metrics.drop_report("trunk_down"),
            },
            Command::Detach { slot } => {
                self.slots.remove(&slot);
                if let Ok(frame) = client.detach(slot) {
                    control.extend(frame);
                }
            }
        }
    }

    /// Acts on what the primary said; `Some` when the trunk is over.
    fn event(
        &mut self,
        client: &mut TrunkClient,
        event: TrunkClientEvent,
        open: &AtomicBool,
        control: &mut Vec<u8>,
    ) -> Option<Ended> {
        match event {
            TrunkClientEvent::Opened { replica, .. } => {
                if replica != self.replica {
                    // Another replica at this one's address (a stale route, or an
                    // address reused): its agents would be refused there one by one.
                    return Some(Ended::Failed(format!(
                        "the primary at {} is {replica:?}, not {:?}",
                        self.address, self.replica
                    )));
                }
                if !open.swap(true, Ordering::Relaxed) {
                    self.dialer.metrics.trunks_open.inc();
                }
                tracing::info!(replica = %self.replica, address = %self.address, "trunk open");
            }
            TrunkClientEvent::Closed(reject) => {
                return Some(Ended::Failed(format!(
                    "the primary closed the trunk: {} ({})",
                    reject.reason, reject.detail
                )));
            }
            TrunkClientEvent::Attached { slot, welcome } => {
                if let Some((down, answer, _)) = self.pending.remove(&slot) {
                    let attached = Attached {
                        slot,
                        interval_ms: welcome.interval_ms,
                    };
                    if answer.send(Ok(attached)).is_ok() {
                        self.slots.insert(slot, down);
                    } else if let Ok(frame) = client.detach(slot) {
                        // The agent left while it was attaching.
                        control.extend(frame);
                    }
                }
            }
            TrunkClientEvent::Rejected { slot, reject } => {
                if let Some((_, answer, _)) = self.pending.remove(&slot) {
                    let _ = answer.send(Err(AttachError::Rejected(reject)));
                }
            }
            TrunkClientEvent::Detached { slot, code, reason } => {
                if let Some(down) = self.slots.remove(&slot) {
                    let _ = down.send(Down::Detached { code, reason });
                } else if let Some((_, answer, _)) = self.pending.remove(&slot) {
                    let _ = answer.send(Err(AttachError::Closed { code, reason }));
                }
            }
            TrunkClientEvent::Challenged { slot, challenge } => {
                // The agent signs on its own connection; its answer comes back
                // through `proved`, within the attach's deadline.
                if let Some((_, _, prover)) = self.pending.get(&slot) {
                    let prover = prover.clone();
                    let proved = self.proved.0.clone();
                    let within = self.dialer.attach_timeout;
                    tokio::spawn(async move {
                        if let Ok(proof) =
                            tokio::time::timeout(within, prover.prove(challenge)).await
                        {
                            let _ = proved.send((slot, proof));
                        }
                    });
                }
            }
        }
        None
    }

    /// Detaches the slots whose link is gone without a detach (one dropped from a full
    /// queue, or a link dropped mid-rehoming), so that neither end holds them until
    /// the primary's silence rule.
    fn sweep(&mut self, client: &mut TrunkClient, control: &mut Vec<u8>) {
        let gone: Vec<Slot> = self
            .slots
            .iter()
            .filter(|(_, down)| down.is_closed())
            .map(|(slot, _)| *slot)
            .collect();
        for slot in gone {
            self.slots.remove(&slot);
            if let Ok(frame) = client.detach(slot) {
                control.extend(frame);
            }
        }
    }

    /// Hands a batch of replies to the slots' links.
    fn replies(&mut self, client: &mut TrunkClient, bytes: &[u8], control: &mut Vec<u8>) {
        let entries = match client.handle_datagram(bytes) {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(replica = %self.replica, error = %e, "a bad batch of replies dropped");
                return;
            }
        };
        for entry in entries {
            let Some(down) = self.slots.get(&entry.slot) else {
                continue;
            };
            let reply = Bytes::copy_from_slice(entry.message);
            if down.send(Down::Reply(reply)).is_err() {
                // The agent's link is gone without its detach.
                self.slots.remove(&entry.slot);
                if let Ok(frame) = client.detach(entry.slot) {
                    control.extend(frame);
                }
            }
        }
    }
}

/// Writes `bytes` on the control stream, unless the primary has not read for
/// [`CONTROL_WRITE_TIMEOUT`].
async fn write(send: &mut quinn::SendStream, bytes: &[u8]) -> Result<(), String> {
    match tokio::time::timeout(CONTROL_WRITE_TIMEOUT, send.write_all(bytes)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the primary read nothing for {CONTROL_WRITE_TIMEOUT:?}"
        )),
    }
}

/// Returns once the routes give `replica` another address than `address`, or none.
async fn moved(routes: &mut watch::Receiver<Arc<Routes>>, replica: &str, address: &str) {
    loop {
        if routes.changed().await.is_err() {
            return;
        }
        let gone = routes
            .borrow_and_update()
            .members
            .get(replica)
            .is_none_or(|a| a != address);
        if gone {
            return;
        }
    }
}

/// Refuses every command until the relay stops (the commands' sender is gone).
async fn drain(commands: &mut mpsc::Receiver<Command>, metrics: &RelayMetrics) {
    while let Some(cmd) = commands.recv().await {
        refuse(cmd, metrics);
    }
}

#[cfg(test)]
mod tests;
