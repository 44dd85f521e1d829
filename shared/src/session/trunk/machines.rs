//! A trunk's two ends, sans IO: [`TrunkServer`] on the primary, [`TrunkClient`] on the
//! relay ([`crate::trunk`] has the bytes).
//!
//! The machines only multiplex, frame and keep each slot's lifecycle; the session
//! rules stay with [`ServerSession`]. The relay runs one for each agent, as an
//! aggregator does; the primary runs one for each slot, fed the agent's hello as it
//! came and each of its reports, so that a relayed agent is held to the rules of a
//! direct one. Like the session machines, these read no clock and touch no socket:
//! bytes and [`Instant`]s in, events and bytes to send out.
//!
//! A slot's life: the relay attaches it ([`TrunkClient::attach`]); the primary checks
//! the agent's chain itself, then [`TrunkServer::admit`]s it and answers with
//! [`TrunkServer::welcome`] or [`TrunkServer::reject`]; reports go in batches
//! ([`TrunkClient::push_report`]), replies come back in batches
//! ([`TrunkServer::reply`]); either end detaches it. Slots increase per trunk and are
//! never reused, so an answer for a slot that is gone is only counted.

use crate::session::proof::{self, ProofError};
use crate::session::{
    close, server, Assignment, FrameReader, Peer, ProtocolError, ServerConfig, ServerError,
    ServerEvent, ServerSession,
};
use crate::trunk::{
    decode_batch, encode_control, Attach, BatchEncoder, BatchKind, ControlReader, Entry, Slot,
    ToPrimary, ToRelay, TrunkError, MAX_TEXT,
};
use crate::wire::{Challenge, Hello, Message, Proof, Reject, RejectReason, Welcome};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

/// The primary's settings for each trunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrunkServerConfig {
    /// The replica's name, told to the relay.
    pub replica: String,
    /// The most slots attached or attaching at once; more are refused
    /// ([`RejectReason::LimitReached`]).
    pub max_slots: u32,
    /// The largest batch either way, in bytes.
    pub max_batch_bytes: u32,
    /// A trunk that sends this many batches that do not decode is closed.
    pub max_bad_batches: u32,
    /// The settings of each slot's session.
    pub session: ServerConfig,
    /// Whether each attach is challenged for a proof of possession
    /// ([`crate::trunk::TrunkProtocol::proves`]: the trunk's version carries proofs).
    pub challenge: bool,
    /// Whether an agent that cannot prove it holds its key (behind a relay of the
    /// previous release, or speaking `ballast/1`) is admitted all the same. Only for
    /// the time of an upgrade; refused by default.
    pub admit_unproven: bool,
}

impl TrunkServerConfig {
    /// The defaults for replica `replica`, whose slots' sessions use `session`.
    pub fn new(replica: &str, session: ServerConfig) -> Self {
        TrunkServerConfig {
            replica: replica.to_string(),
            max_slots: 10_000,
            max_batch_bytes: 1200,
            max_bad_batches: 64,
            session,
            challenge: true,
            admit_unproven: false,
        }
    }
}

/// What the relay's control frames ask of the primary's driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrunkServerEvent {
    /// The relay opened the trunk: answer with [`TrunkServer::opened`] or
    /// [`TrunkServer::refuse`].
    Open {
        /// The name the relay gives itself.
        relay: String,
        /// Its software version.
        version: String,
    },
    /// An agent to attach: check its chain and source, then [`TrunkServer::admit`].
    AttachRequested {
        /// Its slot.
        slot: Slot,
        /// Its certificate chain, leaf first (DER).
        chain: Vec<Vec<u8>>,
        /// Its source address at the relay.
        source: IpAddr,
        /// Whether the agent proved that it holds its certificate's key (`false`: it
        /// could not, and [`TrunkServerConfig::admit_unproven`] let it in).
        proven: bool,
    },
    /// An attach to challenge: send `frame` (`Challenge`) and wait for the proof.
    Challenged {
        /// Its slot.
        slot: Slot,
        /// The `Challenge` frame.
        frame: Vec<u8>,
    },
    /// An attach whose proof is missing or wrong, refused here: send `frame`. The
    /// slot is gone.
    ProofRefused {
        /// Its slot.
        slot: Slot,
        /// What was wrong ([`ProofError::label`] for metrics).
        error: ProofError,
        /// The `Rejected` frame.
        frame: Vec<u8>,
    },
    /// An attach over [`TrunkServerConfig::max_slots`], refused here: send `frame`.
    Refused {
        /// Its slot.
        slot: Slot,
        /// The `Rejected` frame.
        frame: Vec<u8>,
    },
    /// The relay detached a slot: its agent is gone.
    DetachRequested {
        /// The slot.
        slot: Slot,
    },
}

/// What became of an admitted slot's hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A hello its peer may make: register the node, then [`TrunkServer::welcome`] or
    /// [`TrunkServer::reject`].
    Hello(Hello),
    /// The hello is refused and the slot gone: send `frame` (`Rejected`).
    Refused {
        /// Why.
        reject: Reject,
        /// The `Rejected` frame.
        frame: Vec<u8>,
    },
}

/// One entry of a batch of reports, through its slot's session.
#[derive(Debug)]
pub struct SlotEvent {
    /// The slot.
    pub slot: Slot,
    /// What its session made of the entry. A session that closes
    /// ([`ServerError::TooManyBadDatagrams`]) is for the driver to
    /// [`TrunkServer::detach`].
    pub event: Result<ServerEvent, ServerError>,
}

/// Why the primary's trunk machine could not go on, or refused a call.
#[derive(Debug, thiserror::Error)]
pub enum TrunkServerError {
    /// The control stream does not decode; the trunk is over.
    #[error(transparent)]
    Control(TrunkError),
    /// A frame or reply could not be encoded; nothing was sent.
    #[error("cannot encode: {0}")]
    Encode(TrunkError),
    /// A control frame out of order; the trunk is over.
    #[error("unexpected on the trunk: {0}")]
    Unexpected(&'static str),
    /// An attach for a slot not above every slot before it; the trunk is over.
    #[error("slot {slot} attached after slot {last}: slots are never reused")]
    SlotNotNew {
        /// The slot.
        slot: Slot,
        /// The highest slot before it.
        last: Slot,
    },
    /// A call for a slot that is not there, or not in the state the call needs.
    #[error("slot {slot} is not {wanted}")]
    Slot {
        /// The slot.
        slot: Slot,
        /// What it should have been.
        wanted: &'static str,
    },
    /// The slot's session refused the call.
    #[error(transparent)]
    Session(#[from] ServerError),
    /// A batch that does not decode; it is dropped.
    #[error("bad batch: {0}")]
    BadBatch(TrunkError),
    /// The last of too many bad batches; the trunk is over.
    #[error("{count} bad batches, the last: {last}")]
    TooManyBadBatches {
        /// How many.
        count: u32,
        /// What was wrong with the last.
        last: TrunkError,
    },
    /// The trunk is over.
    #[error("the trunk is closed")]
    Closed,
}

#[derive(Debug)]
enum ServerSlot {
    /// Challenged, waiting for the agent's proof.
    Challenged {
        hello: Vec<u8>,
        chain: Vec<Vec<u8>>,
        source: IpAddr,
        challenge: Challenge,
    },
    Requested {
        hello: Vec<u8>,
    },
    Session(Box<ServerSession>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitingOpen,
    Open,
    Closed(u32),
}

/// The primary's end of one trunk.
#[derive(Debug)]
pub struct TrunkServer {
    config: TrunkServerConfig,
    phase: Phase,
    reader: ControlReader<ToPrimary>,
    slots: BTreeMap<Slot, ServerSlot>,
    last_slot: Option<Slot>,
    replies: BatchEncoder,
    unknown: u64,
    bad_batches: u32,
}

impl TrunkServer {
    /// A trunk just accepted from a relay whose certificate the driver has checked.
    pub fn new(config: TrunkServerConfig) -> Self {
        let limit = usize::try_from(config.max_batch_bytes).unwrap_or(usize::MAX);
        TrunkServer {
            replies: BatchEncoder::new(BatchKind::Replies, limit),
            config,
            phase: Phase::AwaitingOpen,
            reader: ControlReader::new(),
            slots: BTreeMap::new(),
            last_slot: None,
            unknown: 0,
            bad_batches: 0,
        }
    }

    /// Takes bytes of the control stream: what its whole frames ask.
    pub fn handle_control(
        &mut self,
        bytes: &[u8],
    ) -> Result<Vec<TrunkServerEvent>, TrunkServerError> {
        self.check_open()?;
        let msgs = match self.reader.push(bytes) {
            Ok(msgs) => msgs,
            Err(e) => return Err(self.fail(TrunkServerError::Control(e))),
        };
        let mut events = Vec::new();
        for msg in msgs {
            let event = self.on_control(msg).map_err(|e| self.fail(e))?;
            events.extend(event);
        }
        Ok(events)
    }

    fn on_control(&mut self, msg: ToPrimary) -> Result<Option<TrunkServerEvent>, TrunkServerError> {
        match (self.phase, msg) {
            (Phase::AwaitingOpen, ToPrimary::Open { relay, version }) => {
                self.phase = Phase::Open;
                Ok(Some(TrunkServerEvent::Open { relay, version }))
            }
            (Phase::AwaitingOpen, _) => {
                Err(TrunkServerError::Unexpected("a frame before the open"))
            }
            (_, ToPrimary::Open { .. }) => Err(TrunkServerError::Unexpected("a second open")),
            (_, ToPrimary::Attach(a)) => self.on_attach(a).map(Some),
            (_, ToPrimary::Detach { slot }) => Ok(self.on_detach(slot)),
            (_, ToPrimary::Proof { slot, proof }) => self.on_proof(slot, proof),
        }
    }

    /// The agent's answer to the challenge of `slot`: its attach goes on if the proof
    /// is its certificate key's over this challenge and its own hello.
    fn on_proof(
        &mut self,
        slot: Slot,
        proof: Option<Proof>,
    ) -> Result<Option<TrunkServerEvent>, TrunkServerError> {
        match self.slots.get(&slot) {
            Some(ServerSlot::Challenged { .. }) => {}
            Some(_) => {
                return Err(TrunkServerError::Unexpected(
                    "a proof for a slot that was not challenged",
                ))
            }
            None => {
                // Detached meanwhile (the relay gave up on the attach): counted.
                self.unknown = self.unknown.saturating_add(1);
                return Ok(None);
            }
        }
        let Some(ServerSlot::Challenged {
            hello,
            chain,
            source,
            challenge,
        }) = self.slots.remove(&slot)
        else {
            return Err(TrunkServerError::Closed);
        };
        let checked = match &proof {
            None if self.config.admit_unproven => Ok(false),
            None => Err(ProofError::Unproven("ballast/1".into())),
            Some(p) => self
                .check_proof(&hello, &chain, &challenge, p)
                .map(|()| true),
        };
        match checked {
            Ok(proven) => {
                self.slots.insert(slot, ServerSlot::Requested { hello });
                Ok(Some(TrunkServerEvent::AttachRequested {
                    slot,
                    chain,
                    source,
                    proven,
                }))
            }
            Err(error) => Ok(Some(self.proof_refused(slot, error)?)),
        }
    }

    /// Whether `proof` is the agent's over `challenge` and the hello it sent.
    fn check_proof(
        &self,
        hello: &[u8],
        chain: &[Vec<u8>],
        challenge: &Challenge,
        proof: &Proof,
    ) -> Result<(), ProofError> {
        let leaf = chain
            .first()
            .map(|c| rustls::pki_types::CertificateDer::from(c.as_slice()))
            .ok_or_else(|| ProofError::BadCertificate("no certificate".into()))?;
        // The hello as the agent sent it: a proof over another is no proof of it.
        let hello = match FrameReader::new(self.config.session.protocol).push(hello) {
            Ok(Some(Message::Hello(h))) => h,
            _ => return Err(ProofError::BadSignature),
        };
        proof::verify(&leaf, challenge, &hello, proof)
    }

    /// Refuses the slot for `error`: the event with its `Rejected` frame.
    fn proof_refused(
        &mut self,
        slot: Slot,
        error: ProofError,
    ) -> Result<TrunkServerEvent, TrunkServerError> {
        self.slots.remove(&slot);
        let reject = Reject {
            reason: RejectReason::IdentityMismatch,
            detail: cut(&format!("no proof of possession: {error}")),
        };
        Ok(TrunkServerEvent::ProofRefused {
            slot,
            error,
            frame: rejected(slot, reject)?,
        })
    }

    fn on_attach(&mut self, a: Attach) -> Result<TrunkServerEvent, TrunkServerError> {
        if let Some(last) = self.last_slot.filter(|last| a.slot <= *last) {
            return Err(TrunkServerError::SlotNotNew { slot: a.slot, last });
        }
        self.last_slot = Some(a.slot);
        if self.slots.len() >= usize::try_from(self.config.max_slots).unwrap_or(usize::MAX) {
            let reject = Reject {
                reason: RejectReason::LimitReached,
                detail: format!("the trunk has {} agents already", self.slots.len()),
            };
            let frame = rejected(a.slot, reject)?;
            return Ok(TrunkServerEvent::Refused {
                slot: a.slot,
                frame,
            });
        }
        if self.config.challenge {
            let challenge = Challenge {
                nonce: rand::random(),
                primary: cut(&self.config.replica),
            };
            let frame = to_relay(&ToRelay::Challenge {
                slot: a.slot,
                challenge: challenge.clone(),
            })?;
            self.slots.insert(
                a.slot,
                ServerSlot::Challenged {
                    hello: a.hello,
                    chain: a.chain,
                    source: a.source,
                    challenge,
                },
            );
            return Ok(TrunkServerEvent::Challenged {
                slot: a.slot,
                frame,
            });
        }
        self.slots
            .insert(a.slot, ServerSlot::Requested { hello: a.hello });
        if !self.config.admit_unproven {
            // A trunk without proofs: its relay is of the previous release.
            return self.proof_refused(a.slot, ProofError::Unproven("ballast-relay/1".into()));
        }
        Ok(TrunkServerEvent::AttachRequested {
            slot: a.slot,
            chain: a.chain,
            source: a.source,
            proven: false,
        })
    }

    fn on_detach(&mut self, slot: Slot) -> Option<TrunkServerEvent> {
        if self.slots.remove(&slot).is_none() {
            self.unknown = self.unknown.saturating_add(1);
            return None;
        }
        Some(TrunkServerEvent::DetachRequested { slot })
    }

    /// Opens the trunk after [`TrunkServerEvent::Open`]: the `Opened` frame.
    pub fn opened(&mut self) -> Result<Vec<u8>, TrunkServerError> {
        self.check_open()?;
        if self.phase != Phase::Open {
            return Err(TrunkServerError::Unexpected("an answer before the open"));
        }
        to_relay(&ToRelay::Opened {
            replica: cut(&self.config.replica),
            max_slots: self.config.max_slots,
            max_batch_bytes: self.config.max_batch_bytes,
        })
    }

    /// Refuses or ends the trunk: the `Closed` frame, to send before closing the
    /// connection. The trunk takes nothing more.
    pub fn refuse(
        &mut self,
        reason: RejectReason,
        detail: &str,
    ) -> Result<Vec<u8>, TrunkServerError> {
        self.check_open()?;
        self.phase = Phase::Closed(close::REJECTED);
        self.slots.clear();
        let detail = cut(detail);
        to_relay(&ToRelay::Closed(Reject { reason, detail }))
    }

    /// Starts the session of a requested slot for `peer` (worked out from the chain
    /// and source of its [`TrunkServerEvent::AttachRequested`]) and gives it the hello.
    pub fn admit(
        &mut self,
        slot: Slot,
        peer: Peer,
        now: Instant,
    ) -> Result<Admission, TrunkServerError> {
        self.check_open()?;
        if !matches!(self.slots.get(&slot), Some(ServerSlot::Requested { .. })) {
            return Err(TrunkServerError::Slot {
                slot,
                wanted: "requested",
            });
        }
        let Some(ServerSlot::Requested { hello }) = self.slots.remove(&slot) else {
            return Err(TrunkServerError::Closed);
        };
        let mut session = ServerSession::new(peer, self.config.session, now);
        let answer = match session.handle_stream(now, &hello) {
            Ok(Some(ServerEvent::Hello(h))) => Ok(h),
            Ok(Some(ServerEvent::Refused { reject, .. })) => Err(reject),
            Ok(_) => Err(invalid(session.handle_stream_end().err())),
            Err(e) => Err(invalid(Some(e))),
        };
        match answer {
            Ok(h) => {
                self.slots
                    .insert(slot, ServerSlot::Session(Box::new(session)));
                Ok(Admission::Hello(h))
            }
            Err(reject) => Ok(Admission::Refused {
                frame: rejected(slot, reject.clone())?,
                reject,
            }),
        }
    }

    /// Refuses a requested or challenged slot before its hello is read (its chain or
    /// source is refused, or the trunk attaches too fast): the `Rejected` frame. The
    /// slot is gone.
    pub fn refuse_attach(
        &mut self,
        slot: Slot,
        reason: RejectReason,
        detail: &str,
    ) -> Result<Vec<u8>, TrunkServerError> {
        self.check_open()?;
        if !matches!(
            self.slots.get(&slot),
            Some(ServerSlot::Requested { .. } | ServerSlot::Challenged { .. })
        ) {
            return Err(TrunkServerError::Slot {
                slot,
                wanted: "requested",
            });
        }
        self.slots.remove(&slot);
        let detail = server::truncate(detail.to_string(), server::MAX_DETAIL);
        rejected(slot, Reject { reason, detail })
    }

    /// Welcomes the admitted slot: the `Attached` frame, with its session's welcome.
    pub fn welcome(&mut self, slot: Slot) -> Result<Vec<u8>, TrunkServerError> {
        let session = self.session_of(slot)?;
        let welcome = session.welcome()?;
        to_relay(&ToRelay::Attached { slot, welcome })
    }

    /// Refuses the admitted slot (for a reason only the driver can judge): the
    /// `Rejected` frame. The slot is gone.
    pub fn reject(
        &mut self,
        slot: Slot,
        reason: RejectReason,
        detail: &str,
    ) -> Result<Vec<u8>, TrunkServerError> {
        let session = self.session_of(slot)?;
        session.reject(reason, detail.to_string())?;
        self.slots.remove(&slot);
        let detail = server::truncate(detail.to_string(), server::MAX_DETAIL);
        rejected(slot, Reject { reason, detail })
    }

    /// Ends the session of `slot` with `code` ([`close`]): the `Detached` frame. The
    /// slot is gone.
    pub fn detach(
        &mut self,
        slot: Slot,
        code: u32,
        reason: &str,
    ) -> Result<Vec<u8>, TrunkServerError> {
        self.check_open()?;
        if self.slots.remove(&slot).is_none() {
            return Err(TrunkServerError::Slot {
                slot,
                wanted: "attached",
            });
        }
        let reason = cut(reason);
        to_relay(&ToRelay::Detached { slot, code, reason })
    }

    /// Takes a batch of reports: each entry for an admitted slot through its session.
    /// Entries for slots that are gone are counted ([`TrunkServer::unknown_slots`]).
    pub fn handle_datagram(&mut self, bytes: &[u8]) -> Result<Vec<SlotEvent>, TrunkServerError> {
        self.check_open()?;
        let entries = match decode_batch(bytes, BatchKind::Reports) {
            Ok(entries) => entries,
            Err(e) => return Err(self.bad_batch(e)),
        };
        let mut events = Vec::with_capacity(entries.len());
        for Entry { slot, message } in entries {
            let event = match self.slots.get_mut(&slot) {
                Some(ServerSlot::Session(s)) => s.handle_datagram(message),
                Some(ServerSlot::Requested { .. } | ServerSlot::Challenged { .. }) => {
                    Err(ServerError::BeforeWelcome)
                }
                None => {
                    self.unknown = self.unknown.saturating_add(1);
                    continue;
                }
            };
            events.push(SlotEvent { slot, event });
        }
        Ok(events)
    }

    fn bad_batch(&mut self, e: TrunkError) -> TrunkServerError {
        self.bad_batches = self.bad_batches.saturating_add(1);
        if self.bad_batches >= self.config.max_bad_batches {
            let count = self.bad_batches;
            return self.fail(TrunkServerError::TooManyBadBatches { count, last: e });
        }
        TrunkServerError::BadBatch(e)
    }

    /// Adds the reply of `slot`'s session to the batch of replies: the batch if it was
    /// full. Send what [`TrunkServer::take_replies`] gives after each batch of reports.
    pub fn reply(
        &mut self,
        slot: Slot,
        assignment: &Assignment,
    ) -> Result<Option<Vec<u8>>, TrunkServerError> {
        let reply = self.session_of(slot)?.reply(assignment)?;
        let encode = TrunkServerError::Encode;
        if self.replies.push(slot, &reply).map_err(encode)? {
            return Ok(None);
        }
        let full = self.replies.take();
        self.replies.push(slot, &reply).map_err(encode)?;
        Ok(full)
    }

    /// The replies batched since the last call, if any.
    pub fn take_replies(&mut self) -> Option<Vec<u8>> {
        self.replies.take()
    }

    /// The session of an admitted slot.
    pub fn session(&self, slot: Slot) -> Option<&ServerSession> {
        match self.slots.get(&slot) {
            Some(ServerSlot::Session(s)) => Some(s),
            _ => None,
        }
    }

    /// The session of an admitted slot, to change its interval, say.
    pub fn session_mut(&mut self, slot: Slot) -> Option<&mut ServerSession> {
        match self.slots.get_mut(&slot) {
            Some(ServerSlot::Session(s)) => Some(s),
            _ => None,
        }
    }

    /// The slots requested or admitted, in order.
    pub fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        self.slots.keys().copied()
    }

    /// How many slots are requested or admitted.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// How many frames and entries named a slot that was gone.
    pub fn unknown_slots(&self) -> u64 {
        self.unknown
    }

    /// How many batches did not decode.
    pub fn bad_batches(&self) -> u32 {
        self.bad_batches
    }

    /// The QUIC close code for the trunk's connection once it is over.
    pub fn close_code(&self) -> Option<u32> {
        match self.phase {
            Phase::Closed(code) => Some(code),
            _ => None,
        }
    }

    fn session_of(&mut self, slot: Slot) -> Result<&mut ServerSession, TrunkServerError> {
        self.check_open()?;
        self.session_mut(slot).ok_or(TrunkServerError::Slot {
            slot,
            wanted: "admitted",
        })
    }

    fn check_open(&self) -> Result<(), TrunkServerError> {
        match self.phase {
            Phase::Closed(_) => Err(TrunkServerError::Closed),
            _ => Ok(()),
        }
    }

    fn fail(&mut self, e: TrunkServerError) -> TrunkServerError {
        self.phase = Phase::Closed(close::PROTOCOL);
        self.slots.clear();
        e
    }
}

/// The reject for a hello the session could not even read.
fn invalid(e: Option<ServerError>) -> Reject {
    let detail = e.map_or_else(|| "no hello".to_string(), |e| e.to_string());
    Reject {
        reason: RejectReason::InvalidHello,
        detail: cut(&detail),
    }
}

fn rejected(slot: Slot, reject: Reject) -> Result<Vec<u8>, TrunkServerError> {
    to_relay(&ToRelay::Rejected { slot, reject })
}

fn to_relay(msg: &ToRelay) -> Result<Vec<u8>, TrunkServerError> {
    encode_control(msg).map_err(TrunkServerError::Encode)
}

/// `text` cut to what a frame carries.
fn cut(text: &str) -> String {
    server::truncate(text.to_string(), MAX_TEXT)
}

/// The relay's settings for each trunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrunkClientConfig {
    /// The relay's name, told to the primary.
    pub relay: String,
    /// How long the first report of a batch waits for others.
    pub batch_delay: Duration,
    /// How long an attach may wait for its answer.
    pub attach_timeout: Duration,
    /// The largest batch the connection carries (its datagram size), in bytes; the
    /// primary's own limit applies too.
    pub max_batch_bytes: usize,
    /// The trunk protocol the connection negotiated: the agent protocol of the
    /// primary's welcomes ([`crate::trunk::TrunkProtocol::entries`]).
    pub protocol: crate::trunk::TrunkProtocol,
}

impl TrunkClientConfig {
    /// The defaults for relay `relay`.
    pub fn new(relay: &str) -> Self {
        TrunkClientConfig {
            relay: relay.to_string(),
            batch_delay: Duration::from_millis(5),
            attach_timeout: Duration::from_secs(5),
            max_batch_bytes: 1200,
            protocol: crate::trunk::TrunkProtocol::CURRENT,
        }
    }
}

/// What the primary's control frames tell the relay's driver.
#[derive(Debug, Clone, PartialEq)]
pub enum TrunkClientEvent {
    /// The trunk is open; slots may be attached.
    Opened {
        /// The replica's name.
        replica: String,
        /// The most slots at once.
        max_slots: u32,
        /// The largest batch it takes.
        max_batch_bytes: u32,
    },
    /// The primary refused or ended the trunk; it takes nothing more.
    Closed(Reject),
    /// The slot's agent is welcome: give its session the welcome's interval, then
    /// welcome the agent.
    Attached {
        /// The slot.
        slot: Slot,
        /// The primary's welcome.
        welcome: Welcome,
    },
    /// The slot's agent is refused; the slot is gone.
    Rejected {
        /// The slot.
        slot: Slot,
        /// Why.
        reject: Reject,
    },
    /// The primary ended the slot's session; the slot is gone.
    Detached {
        /// The slot.
        slot: Slot,
        /// The close code for the agent's connection.
        code: u32,
        /// Why.
        reason: String,
    },
    /// The primary asks the attaching slot's agent to prove that it holds its key:
    /// hand the challenge to the agent, and its answer to [`TrunkClient::prove`].
    Challenged {
        /// The slot.
        slot: Slot,
        /// The challenge.
        challenge: Challenge,
    },
}

/// What passing time did to a trunk's relay end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expired {
    /// A batch whose delay is over, to send.
    pub batch: Option<Vec<u8>>,
    /// Slots whose attach had no answer in time; they are gone.
    pub timed_out: Vec<Slot>,
    /// Detach frames for those slots, to send on the control stream.
    pub control: Vec<u8>,
}

/// Why the relay's trunk machine could not go on, or refused a call.
#[derive(Debug, thiserror::Error)]
pub enum TrunkClientError {
    /// The control stream does not decode; the trunk is over.
    #[error(transparent)]
    Control(TrunkError),
    /// A control frame out of order; the trunk is over.
    #[error("unexpected on the trunk: {0}")]
    Unexpected(&'static str),
    /// The primary's welcome is not a framed welcome; the trunk is over.
    #[error("a bad welcome: {0}")]
    BadWelcome(ProtocolError),
    /// A frame or entry could not be encoded; nothing was sent.
    #[error(transparent)]
    Encode(TrunkError),
    /// The trunk is not open yet.
    #[error("the trunk is not open yet")]
    NotOpen,
    /// The trunk has as many slots as the primary takes.
    #[error("the trunk has its {0} slots")]
    SlotsFull(u32),
    /// A call for a slot that is not there, or not attached.
    #[error("slot {0} is not attached")]
    UnknownSlot(Slot),
    /// A batch of replies that does not decode; it is dropped.
    #[error("bad batch: {0}")]
    BadBatch(TrunkError),
    /// The trunk is over.
    #[error("the trunk is closed")]
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientPhase {
    Opening,
    Open { max_slots: u32 },
    Closed,
}

/// The relay's end of one trunk.
#[derive(Debug)]
pub struct TrunkClient {
    config: TrunkClientConfig,
    phase: ClientPhase,
    reader: ControlReader<ToRelay>,
    /// The attached slots.
    attached: BTreeSet<Slot>,
    /// The slots attaching, each with the deadline of the primary's answer: kept apart,
    /// so that time is checked against the few attaches in flight, not every slot.
    pending: BTreeMap<Slot, Instant>,
    next_slot: Slot,
    reports: BatchEncoder,
    first_at: Option<Instant>,
    unknown: u64,
}

impl TrunkClient {
    /// A trunk on a connection just made.
    pub fn new(config: TrunkClientConfig) -> Self {
        TrunkClient {
            reports: BatchEncoder::new(BatchKind::Reports, config.max_batch_bytes),
            config,
            phase: ClientPhase::Opening,
            reader: ControlReader::new(),
            attached: BTreeSet::new(),
            pending: BTreeMap::new(),
            next_slot: 0,
            first_at: None,
            unknown: 0,
        }
    }

    /// The same trunk numbering its slots from `first` on: a relay that dials a
    /// replica again goes on from the previous connection's [`TrunkClient::next_slot`],
    /// so that a slot number never names two agents, even in a command sent for the
    /// lost connection and read after the new one opened.
    pub fn starting_at(mut self, first: Slot) -> Self {
        self.next_slot = first;
        self
    }

    /// The number the next attach gets.
    pub fn next_slot(&self) -> Slot {
        self.next_slot
    }

    /// The `Open` frame, first on the control stream.
    pub fn open_frame(&self) -> Result<Vec<u8>, TrunkClientError> {
        encode_control(&ToPrimary::Open {
            relay: cut(&self.config.relay),
            version: cut(crate::VERSION),
        })
        .map_err(TrunkClientError::Encode)
    }

    /// Attaches an agent whose hello (`hello`, framed as it came), chain and source
    /// the relay has checked: its new slot and the `Attach` frame.
    pub fn attach(
        &mut self,
        now: Instant,
        hello: &[u8],
        chain: Vec<Vec<u8>>,
        source: IpAddr,
    ) -> Result<(Slot, Vec<u8>), TrunkClientError> {
        let ClientPhase::Open { max_slots } = self.phase else {
            return Err(self.not_open());
        };
        if self.slot_count() >= usize::try_from(max_slots).unwrap_or(usize::MAX) {
            return Err(TrunkClientError::SlotsFull(max_slots));
        }
        let slot = self.next_slot;
        let next = slot
            .checked_add(1)
            .ok_or(TrunkClientError::SlotsFull(max_slots))?;
        let attach = Attach {
            slot,
            hello: hello.to_vec(),
            chain,
            source,
        };
        let frame = encode_control(&ToPrimary::Attach(attach)).map_err(TrunkClientError::Encode)?;
        self.next_slot = next;
        let deadline = now.checked_add(self.config.attach_timeout).unwrap_or(now);
        self.pending.insert(slot, deadline);
        Ok((slot, frame))
    }

    /// Detaches a slot whose agent is gone: the `Detach` frame.
    pub fn detach(&mut self, slot: Slot) -> Result<Vec<u8>, TrunkClientError> {
        self.check_open()?;
        let attaching = self.pending.remove(&slot).is_some();
        if !self.attached.remove(&slot) && !attaching {
            return Err(TrunkClientError::UnknownSlot(slot));
        }
        encode_control(&ToPrimary::Detach { slot }).map_err(TrunkClientError::Encode)
    }

    /// Adds an attached slot's report (as its agent sent it) to the batch: the batch
    /// if it was full, to send now.
    pub fn push_report(
        &mut self,
        now: Instant,
        slot: Slot,
        report: &[u8],
    ) -> Result<Option<Vec<u8>>, TrunkClientError> {
        self.check_open()?;
        if !self.attached.contains(&slot) {
            return Err(TrunkClientError::UnknownSlot(slot));
        }
        if self
            .reports
            .push(slot, report)
            .map_err(TrunkClientError::Encode)?
        {
            self.first_at = self.first_at.or(Some(now));
            return Ok(None);
        }
        let full = self.flush();
        self.reports
            .push(slot, report)
            .map_err(TrunkClientError::Encode)?;
        self.first_at = Some(now);
        Ok(full)
    }

    /// The batch so far, if any, to send now (before the trunk closes, say).
    pub fn flush(&mut self) -> Option<Vec<u8>> {
        self.first_at = None;
        self.reports.take()
    }

    /// When the driver must call [`TrunkClient::handle_timeout`]: the batch's delay or
    /// the first attach's deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let batch = self
            .first_at
            .map(|t| t.checked_add(self.config.batch_delay).unwrap_or(t));
        batch
            .into_iter()
            .chain(self.pending.values().copied())
            .min()
    }

    /// Lets time pass: the batch whose delay is over, and the attaches that timed out
    /// (detached, with their frames).
    pub fn handle_timeout(&mut self, now: Instant) -> Expired {
        let mut out = Expired::default();
        if self.phase == ClientPhase::Closed {
            return out;
        }
        let due = self
            .first_at
            .map(|t| t.checked_add(self.config.batch_delay).unwrap_or(t));
        if due.is_some_and(|d| now >= d) {
            out.batch = self.flush();
        }
        out.timed_out = self
            .pending
            .iter()
            .filter(|(_, deadline)| now >= **deadline)
            .map(|(slot, _)| *slot)
            .collect();
        for slot in &out.timed_out {
            self.pending.remove(slot);
            if let Ok(frame) = encode_control(&ToPrimary::Detach { slot: *slot }) {
                out.control.extend(frame);
            }
        }
        out
    }

    /// Takes bytes of the control stream: what the primary's frames say.
    pub fn handle_control(
        &mut self,
        bytes: &[u8],
    ) -> Result<Vec<TrunkClientEvent>, TrunkClientError> {
        self.check_open()?;
        let msgs = match self.reader.push(bytes) {
            Ok(msgs) => msgs,
            Err(e) => return Err(self.fail(TrunkClientError::Control(e))),
        };
        let mut events = Vec::new();
        for msg in msgs {
            match self.on_control(msg) {
                Ok(e) => events.extend(e),
                Err(e) => return Err(self.fail(e)),
            }
            if self.phase == ClientPhase::Closed {
                break;
            }
        }
        Ok(events)
    }

    fn on_control(&mut self, msg: ToRelay) -> Result<Option<TrunkClientEvent>, TrunkClientError> {
        match (self.phase, msg) {
            (_, ToRelay::Closed(reject)) => {
                self.phase = ClientPhase::Closed;
                self.attached.clear();
                self.pending.clear();
                Ok(Some(TrunkClientEvent::Closed(reject)))
            }
            (
                ClientPhase::Opening,
                ToRelay::Opened {
                    replica,
                    max_slots,
                    max_batch_bytes,
                },
            ) => {
                self.phase = ClientPhase::Open { max_slots };
                let limit = usize::try_from(max_batch_bytes).unwrap_or(usize::MAX);
                self.reports
                    .set_limit(limit.min(self.config.max_batch_bytes));
                Ok(Some(TrunkClientEvent::Opened {
                    replica,
                    max_slots,
                    max_batch_bytes,
                }))
            }
            (ClientPhase::Opening, _) => Err(TrunkClientError::Unexpected("a frame before opened")),
            (_, ToRelay::Opened { .. }) => Err(TrunkClientError::Unexpected("a second opened")),
            (_, ToRelay::Attached { slot, welcome }) => self.on_attached(slot, &welcome),
            (_, ToRelay::Rejected { slot, reject }) => Ok(self
                .take_pending(slot)
                .then_some(TrunkClientEvent::Rejected { slot, reject })),
            (_, ToRelay::Detached { slot, code, reason }) => Ok(self
                .take_any(slot)
                .then_some(TrunkClientEvent::Detached { slot, code, reason })),
            (_, ToRelay::Challenge { slot, challenge }) => {
                if self.pending.contains_key(&slot) {
                    return Ok(Some(TrunkClientEvent::Challenged { slot, challenge }));
                }
                self.unknown = self.unknown.saturating_add(1);
                Ok(None)
            }
        }
    }

    /// The agent's answer to the challenge of attaching `slot` (`None`: it cannot
    /// prove, as it speaks `ballast/1`): the `Proof` frame.
    pub fn prove(&mut self, slot: Slot, proof: Option<Proof>) -> Result<Vec<u8>, TrunkClientError> {
        self.check_open()?;
        if !self.pending.contains_key(&slot) {
            return Err(TrunkClientError::UnknownSlot(slot));
        }
        encode_control(&ToPrimary::Proof { slot, proof }).map_err(TrunkClientError::Encode)
    }

    fn on_attached(
        &mut self,
        slot: Slot,
        frame: &[u8],
    ) -> Result<Option<TrunkClientEvent>, TrunkClientError> {
        let welcome = match FrameReader::new(self.config.protocol.entries()).push(frame) {
            Ok(Some(Message::Welcome(w))) => w,
            Ok(_) => return Err(TrunkClientError::BadWelcome(ProtocolError::StreamEnded)),
            Err(e) => return Err(TrunkClientError::BadWelcome(e)),
        };
        if self.pending.remove(&slot).is_none() {
            self.unknown = self.unknown.saturating_add(1);
            return Ok(None);
        }
        self.attached.insert(slot);
        Ok(Some(TrunkClientEvent::Attached { slot, welcome }))
    }

    /// Removes a pending slot: whether there was one (else it is counted).
    fn take_pending(&mut self, slot: Slot) -> bool {
        if self.pending.remove(&slot).is_some() {
            return true;
        }
        self.unknown = self.unknown.saturating_add(1);
        false
    }

    /// Removes a slot: whether there was one (else it is counted).
    fn take_any(&mut self, slot: Slot) -> bool {
        let attaching = self.pending.remove(&slot).is_some();
        let found = self.attached.remove(&slot) || attaching;
        if !found {
            self.unknown = self.unknown.saturating_add(1);
        }
        found
    }

    /// Takes a batch of replies: the entries of attached slots, each a reply to send
    /// to the slot's agent as it is. Entries for slots that are gone are counted.
    pub fn handle_datagram<'a>(
        &mut self,
        bytes: &'a [u8],
    ) -> Result<Vec<Entry<'a>>, TrunkClientError> {
        self.check_open()?;
        let mut entries =
            decode_batch(bytes, BatchKind::Replies).map_err(TrunkClientError::BadBatch)?;
        let before = entries.len();
        entries.retain(|e| self.attached.contains(&e.slot));
        let dropped = u64::try_from(before - entries.len()).unwrap_or(u64::MAX);
        self.unknown = self.unknown.saturating_add(dropped);
        Ok(entries)
    }

    /// Whether `slot` is attached.
    pub fn is_attached(&self, slot: Slot) -> bool {
        self.attached.contains(&slot)
    }

    /// How many slots are attached or attaching.
    pub fn slot_count(&self) -> usize {
        self.attached.len() + self.pending.len()
    }

    /// How many answers and entries named a slot that was gone.
    pub fn unknown_slots(&self) -> u64 {
        self.unknown
    }

    /// Whether the trunk is open.
    pub fn is_open(&self) -> bool {
        matches!(self.phase, ClientPhase::Open { .. })
    }

    /// Whether the trunk is over.
    pub fn is_closed(&self) -> bool {
        self.phase == ClientPhase::Closed
    }

    fn not_open(&self) -> TrunkClientError {
        match self.phase {
            ClientPhase::Closed => TrunkClientError::Closed,
            _ => TrunkClientError::NotOpen,
        }
    }

    fn check_open(&self) -> Result<(), TrunkClientError> {
        match self.phase {
            ClientPhase::Closed => Err(TrunkClientError::Closed),
            _ => Ok(()),
        }
    }

    fn fail(&mut self, e: TrunkClientError) -> TrunkClientError {
        self.phase = ClientPhase::Closed;
        self.attached.clear();
        self.pending.clear();
        self.first_at = None;
        self.reports.take();
        e
    }
}
