//! The trunk codec: how a relay and a primary aggregator talk over one QUIC connection
//! ([`RELAY_ALPN`]) on behalf of many agents.
//!
//! A trunk carries the agents' own wire messages ([`crate::wire`]) unchanged, each
//! behind the number of the *slot* the relay gave its agent:
//!
//! - the **control stream** (one bidirectional stream, opened by the relay) carries
//!   frames: a 4-byte big-endian length, then [`TRUNK_VERSION`] and one bincode 2
//!   message, at most [`MAX_CONTROL_FRAME`] bytes after the length. The relay sends
//!   [`ToPrimary`] (open the trunk, attach an agent with its hello, certificate chain
//!   and source address, detach it); the primary answers with [`ToRelay`].
//!   [`ControlReader`] takes the stream in whatever chunks it arrives;
//! - **datagrams**, both ways, carry batches of entries:
//!   `[TRUNK_VERSION][kind]{varint slot, u8 length, message}*` ([`BatchKind`]): the
//!   agents' reports to the primary, the primary's replies to the relay.
//!   [`BatchEncoder`] fills a batch up to a size limit; [`decode_batch`] reads one.
//!
//! Every decoder checks lengths before it buffers or allocates, and never panics.

use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// The ALPN protocol name of the current trunk protocol. Agents keep
/// [`crate::ALPN`].
pub const RELAY_ALPN: &[u8] = b"ballast-relay/2";

/// The ALPN protocol name of the previous trunk protocol, without proofs.
pub const RELAY_ALPN_V1: &[u8] = b"ballast-relay/1";

/// A version of the trunk protocol, chosen by ALPN as the agents' is
/// ([`crate::protocol`]): a relay offers every version it speaks, current first, and a
/// primary accepts every version it speaks. Each version fixes the layout of its
/// control frames and batches *and* the agent protocol its entries carry
/// ([`TrunkProtocol::entries`]), so that a primary reads a relay of another release
/// without guessing. A relay translates its agents' messages into that version at its
/// edge, whatever its agents speak.
///
/// The next change to the trunk, or to the agent protocol its entries carry, adds a
/// version here, keeps the previous one for a release, and needs nothing else: the
/// negotiation picks the newest both ends speak, and a relay and a primary that share
/// none fail the handshake with `no_application_protocol`, counted at the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrunkProtocol {
    /// `ballast-relay/1`: [`TRUNK_VERSION`] 1, entries in `ballast/2`; no proofs of
    /// possession, so its agents are unproven.
    V1,
    /// `ballast-relay/2`: the frames and batches of `ballast-relay/1`, and the
    /// primary challenges each attach ([`ToRelay::Challenge`], [`ToPrimary::Proof`]).
    V2,
}

impl TrunkProtocol {
    /// The version this build speaks natively.
    pub const CURRENT: TrunkProtocol = TrunkProtocol::V2;
    /// Every version this build speaks, current first.
    pub const ALL: [TrunkProtocol; 2] = [TrunkProtocol::V2, TrunkProtocol::V1];

    /// Its ALPN protocol name.
    pub fn alpn(self) -> &'static [u8] {
        match self {
            TrunkProtocol::V1 => RELAY_ALPN_V1,
            TrunkProtocol::V2 => RELAY_ALPN,
        }
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            TrunkProtocol::V1 => "ballast-relay/1",
            TrunkProtocol::V2 => "ballast-relay/2",
        }
    }

    /// The agent protocol the entries of its batches and the hellos and welcomes of
    /// its control frames are in.
    pub fn entries(self) -> crate::protocol::Protocol {
        match self {
            TrunkProtocol::V1 | TrunkProtocol::V2 => crate::protocol::Protocol::V2,
        }
    }

    /// Whether the primary challenges each attach for a proof of possession.
    pub fn proves(self) -> bool {
        match self {
            TrunkProtocol::V1 => false,
            TrunkProtocol::V2 => true,
        }
    }

    /// The version an ALPN name stands for, if this build speaks it.
    pub fn from_alpn(alpn: &[u8]) -> Option<TrunkProtocol> {
        TrunkProtocol::ALL.into_iter().find(|p| p.alpn() == alpn)
    }

    /// The version `conn` negotiated, if it is a trunk this build speaks.
    pub fn negotiated(conn: &quinn::Connection) -> Option<TrunkProtocol> {
        crate::protocol::negotiated_alpn(conn).and_then(|a| TrunkProtocol::from_alpn(&a))
    }

    /// The trunk versions of the agent protocol versions `protocols`: a process that
    /// speaks only the previous agent protocol (`BALLAST_PROTOCOL=previous`, standing
    /// for the previous release) speaks only the previous trunk protocol too.
    pub fn of(protocols: &[crate::protocol::Protocol]) -> Vec<TrunkProtocol> {
        protocols
            .iter()
            .map(|p| match p {
                crate::protocol::Protocol::V1 => TrunkProtocol::V1,
                crate::protocol::Protocol::V2 => TrunkProtocol::V2,
            })
            .collect()
    }

    /// The trunk versions this process speaks, from the environment
    /// ([`crate::protocol::ENV`]).
    pub fn from_env() -> Result<Vec<TrunkProtocol>, crate::protocol::UnknownChoice> {
        Ok(Self::of(&crate::protocol::from_env()?))
    }

    /// The names of every version, for an error that lists what was offered.
    pub fn names() -> String {
        TrunkProtocol::ALL.map(|p| p.name()).join(", ")
    }
}

/// The version byte behind every control frame's length and at the start of every
/// batch.
pub const TRUNK_VERSION: u8 = 1;

/// The largest control frame, in bytes after its length prefix.
pub const MAX_CONTROL_FRAME: usize = 16 * 1024;

/// The most certificates an attach may carry for its agent.
pub const MAX_CHAIN_CERTS: usize = 4;

/// The most bytes of certificates (DER, all of the chain) an attach may carry.
pub const MAX_CHAIN_BYTES: usize = 8 * 1024;

/// The largest batch, in bytes: more than any QUIC datagram carries.
pub const MAX_BATCH: usize = 16 * 1024;

/// The largest entry of a batch: its length is one byte.
pub const MAX_ENTRY: usize = u8::MAX as usize;

/// The longest signature a proof may carry (an Ed25519 or ECDSA one is far shorter).
pub const MAX_SIGNATURE: usize = 512;

/// The longest name (relay, replica) and the longest reason text a frame carries.
pub const MAX_TEXT: usize = 256;

/// The longest a frame's hello or welcome may be: one framed wire message.
const MAX_FRAMED_MESSAGE: usize = crate::wire::MAX_MESSAGE + 2;

/// A slot: the number a relay gives one of its agents on one trunk. Slots increase
/// per trunk and are never reused.
pub type Slot = u64;

/// What the relay sends on the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToPrimary {
    /// The first frame: which relay opens the trunk, and its software version.
    Open {
        /// The relay's name.
        relay: String,
        /// The relay's software version.
        version: String,
    },
    /// An agent to attach: its hello and what the primary needs to check it again.
    Attach(Attach),
    /// The agent of `slot` is gone.
    Detach {
        /// Its slot.
        slot: Slot,
    },
    /// The answer to [`ToRelay::Challenge`] (`ballast-relay/2` only): the agent's
    /// proof, or `None` when it cannot make one (it speaks `ballast/1`).
    Proof {
        /// Its slot.
        slot: Slot,
        /// The agent's proof, as it sent it.
        proof: Option<crate::wire::Proof>,
    },
}

/// One agent attaching through a relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attach {
    /// The slot the relay gave it.
    pub slot: Slot,
    /// Its hello, framed as the agent sent it on its stream ([`crate::frame::encode`]).
    pub hello: Vec<u8>,
    /// Its certificate chain, leaf first, DER as the agent presented it.
    pub chain: Vec<Vec<u8>>,
    /// The source address of its connection to the relay.
    pub source: IpAddr,
}

/// What the primary sends on the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToRelay {
    /// The trunk is open: which replica answers, and its limits.
    Opened {
        /// The replica's name.
        replica: String,
        /// The most agents the trunk may have attached (or attaching) at once.
        max_slots: u32,
        /// The largest batch the primary takes, in bytes.
        max_batch_bytes: u32,
    },
    /// The trunk is refused or ends; the connection closes after this frame.
    Closed(crate::wire::Reject),
    /// The agent of `slot` is welcome.
    Attached {
        /// Its slot.
        slot: Slot,
        /// The framed welcome from the primary's session for it.
        welcome: Vec<u8>,
    },
    /// The agent of `slot` is refused, as a direct connection would be.
    Rejected {
        /// Its slot.
        slot: Slot,
        /// Why.
        reject: crate::wire::Reject,
    },
    /// The primary ended the session of `slot`.
    Detached {
        /// Its slot.
        slot: Slot,
        /// The close code a direct connection would get ([`crate::session::close`]).
        code: u32,
        /// Why, for people.
        reason: String,
    },
    /// Before it admits the agent of `slot`, the primary asks it to prove that it
    /// holds its certificate's key (`ballast-relay/2` only); the relay hands the
    /// challenge to the agent and its answer back ([`ToPrimary::Proof`]).
    Challenge {
        /// Its slot.
        slot: Slot,
        /// The challenge.
        challenge: crate::wire::Challenge,
    },
}

/// What a batch carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKind {
    /// Agents' reports, relay to primary.
    Reports = 0,
    /// The primary's replies, primary to relay.
    Replies = 1,
}

impl BatchKind {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(BatchKind::Reports),
            1 => Some(BatchKind::Replies),
            _ => None,
        }
    }
}

/// Why trunk bytes could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrunkError {
    /// A frame or batch with no bytes after its length.
    #[error("empty trunk frame or batch")]
    Empty,
    /// A length over its limit; refused before anything is buffered.
    #[error("{what} of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The version byte is not one this build speaks.
    #[error("unknown trunk version {0} (this build speaks {TRUNK_VERSION})")]
    UnknownVersion(u8),
    /// The body is not a valid message.
    #[error("malformed trunk frame: {0}")]
    Malformed(String),
    /// A valid message followed by extra bytes.
    #[error("{0} trailing bytes after the trunk message")]
    Trailing(usize),
    /// An attach carries more certificates than [`MAX_CHAIN_CERTS`], or none.
    #[error("a chain of {0} certificates (1 to {MAX_CHAIN_CERTS})")]
    ChainLength(usize),
    /// A batch kind other than reports or replies.
    #[error("unknown batch kind {0}")]
    UnknownKind(u8),
    /// A batch of the other kind than expected.
    #[error("a batch of {got:?} where {expected:?} belong")]
    WrongKind {
        /// What the reader takes.
        expected: BatchKind,
        /// What came.
        got: BatchKind,
    },
    /// A batch entry cut short, or with an empty message.
    #[error("a batch entry cut short or empty")]
    BadEntry,
    /// A slot number that is not a canonical varint.
    #[error("a malformed slot number in a batch")]
    BadSlot,
    /// bincode refused a value to encode.
    #[error("encoding failed: {0}")]
    Encode(String),
}

impl TrunkError {
    /// A short, stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            TrunkError::TooLarge { .. } | TrunkError::ChainLength(_) => "oversized",
            TrunkError::UnknownVersion(_) => "unknown_version",
            TrunkError::WrongKind { .. } | TrunkError::UnknownKind(_) => "unexpected_message",
            TrunkError::Encode(_) => "encode",
            TrunkError::Empty
            | TrunkError::Malformed(_)
            | TrunkError::Trailing(_)
            | TrunkError::BadEntry
            | TrunkError::BadSlot => "malformed",
        }
    }
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_CONTROL_FRAME>()
}

/// Whether `len` is within `max`, as a [`TrunkError::TooLarge`] naming `what`.
pub(crate) fn within(what: &'static str, len: usize, max: usize) -> Result<(), TrunkError> {
    if len > max {
        return Err(TrunkError::TooLarge { what, len, max });
    }
    Ok(())
}

/// A control message's bounds beyond the frame's size.
pub trait ControlMessage: Serialize + serde::de::DeserializeOwned {
    /// Checks every field against its limit.
    fn check(&self) -> Result<(), TrunkError>;
}

impl ControlMessage for ToPrimary {
    fn check(&self) -> Result<(), TrunkError> {
        match self {
            ToPrimary::Open { relay, version } => {
                within("relay name", relay.len(), MAX_TEXT)?;
                within("version", version.len(), MAX_TEXT)
            }
            ToPrimary::Attach(a) => a.check(),
            ToPrimary::Detach { .. } => Ok(()),
            ToPrimary::Proof { proof, .. } => within(
                "proof",
                proof.as_ref().map_or(0, |p| p.signature.len()),
                MAX_SIGNATURE,
            ),
        }
    }
}

impl Attach {
    fn check(&self) -> Result<(), TrunkError> {
        check_attach(&self.hello, &self.chain)
    }
}

/// Whether an agent with this framed hello and certificate chain can be attached
/// through a trunk: a relay asks before it tries, so that an agent whose chain the
/// protocol cannot carry is refused for that, not for a trunk that seems down.
pub fn check_attach(hello: &[u8], chain: &[Vec<u8>]) -> Result<(), TrunkError> {
    within("hello", hello.len(), MAX_FRAMED_MESSAGE)?;
    if chain.is_empty() || chain.len() > MAX_CHAIN_CERTS {
        return Err(TrunkError::ChainLength(chain.len()));
    }
    let bytes = chain.iter().map(Vec::len).sum();
    within("certificate chain", bytes, MAX_CHAIN_BYTES)
}

impl ControlMessage for ToRelay {
    fn check(&self) -> Result<(), TrunkError> {
        match self {
            ToRelay::Opened { replica, .. } => within("replica name", replica.len(), MAX_TEXT),
            ToRelay::Closed(reject) | ToRelay::Rejected { reject, .. } => {
                within("reason", reject.detail.len(), MAX_TEXT)
            }
            ToRelay::Attached { welcome, .. } => {
                within("welcome", welcome.len(), MAX_FRAMED_MESSAGE)
            }
            ToRelay::Detached { reason, .. } => within("reason", reason.len(), MAX_TEXT),
            ToRelay::Challenge { challenge, .. } => {
                within("primary name", challenge.primary.len(), MAX_TEXT)
            }
        }
    }
}

/// One control message as a frame: its length, [`TRUNK_VERSION`], the message.
pub fn encode_control<M: ControlMessage>(msg: &M) -> Result<Vec<u8>, TrunkError> {
    msg.check()?;
    let body = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| TrunkError::Encode(e.to_string()))?;
    let len = body.len() + 1;
    within("control frame", len, MAX_CONTROL_FRAME)?;
    let prefix = u32::try_from(len).map_err(|_| TrunkError::Encode("length".into()))?;
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&prefix.to_be_bytes());
    out.push(TRUNK_VERSION);
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes the bytes of one control frame after its length prefix.
pub fn decode_control<M: ControlMessage>(frame: &[u8]) -> Result<M, TrunkError> {
    let (&version, body) = frame.split_first().ok_or(TrunkError::Empty)?;
    within("control frame", frame.len(), MAX_CONTROL_FRAME)?;
    if version != TRUNK_VERSION {
        return Err(TrunkError::UnknownVersion(version));
    }
    let (msg, used): (M, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| TrunkError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(TrunkError::Trailing(body.len() - used));
    }
    msg.check()?;
    Ok(msg)
}

/// Reads control frames from a stream delivered in chunks of any size. It holds at
/// most one unfinished frame, whose length is checked before its bytes are kept; after
/// an error it takes nothing more (the trunk is over).
#[derive(Debug)]
pub struct ControlReader<M> {
    buf: Vec<u8>,
    failed: Option<TrunkError>,
    _message: std::marker::PhantomData<M>,
}

impl<M> Default for ControlReader<M> {
    fn default() -> Self {
        ControlReader {
            buf: Vec::new(),
            failed: None,
            _message: std::marker::PhantomData,
        }
    }
}

impl<M: ControlMessage> ControlReader<M> {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes of the stream: the messages whose frames they complete.
    pub fn push(&mut self, mut bytes: &[u8]) -> Result<Vec<M>, TrunkError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut out = Vec::new();
        while !bytes.is_empty() {
            match self.take(bytes) {
                Ok((used, msg)) => {
                    bytes = bytes.get(used..).unwrap_or_default();
                    out.extend(msg);
                }
                Err(e) => {
                    self.failed = Some(e.clone());
                    self.buf = Vec::new();
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Whether the stream may end here: no frame is half read.
    pub fn is_idle(&self) -> bool {
        self.buf.is_empty() && self.failed.is_none()
    }

    /// Buffers from `bytes` what the current frame lacks: how many bytes it took, and
    /// the message if the frame is now whole.
    fn take(&mut self, bytes: &[u8]) -> Result<(usize, Option<M>), TrunkError> {
        let need = match self.frame_len()? {
            None => 4 - self.buf.len(),
            Some(len) => 4 + len - self.buf.len(),
        };
        let used = need.min(bytes.len());
        self.buf
            .extend_from_slice(bytes.get(..used).unwrap_or_default());
        match self.frame_len()? {
            Some(len) if self.buf.len() == 4 + len => {
                let msg = decode_control(self.buf.get(4..).unwrap_or_default());
                self.buf.clear();
                Ok((used, Some(msg?)))
            }
            _ => Ok((used, None)),
        }
    }

    /// The current frame's length, once its prefix is whole; checked against the limit.
    fn frame_len(&self) -> Result<Option<usize>, TrunkError> {
        let Some(prefix) = self.buf.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = usize::try_from(u32::from_be_bytes(*prefix)).unwrap_or(usize::MAX);
        if len == 0 {
            return Err(TrunkError::Empty);
        }
        within("control frame", len, MAX_CONTROL_FRAME)?;
        Ok(Some(len))
    }
}

/// One entry of a batch: a slot and that slot's message, as its agent or session
/// encoded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The slot.
    pub slot: Slot,
    /// The wire message.
    pub message: &'a [u8],
}

/// Decodes a batch of `expected` kind. The whole batch is checked before any entry is
/// returned: a batch with one bad entry is dropped whole.
pub fn decode_batch(bytes: &[u8], expected: BatchKind) -> Result<Vec<Entry<'_>>, TrunkError> {
    within("batch", bytes.len(), MAX_BATCH)?;
    let [version, kind, rest @ ..] = bytes else {
        return Err(TrunkError::Empty);
    };
    let mut rest: &[u8] = rest;
    if *version != TRUNK_VERSION {
        return Err(TrunkError::UnknownVersion(*version));
    }
    let got = BatchKind::from_byte(*kind).ok_or(TrunkError::UnknownKind(*kind))?;
    if got != expected {
        return Err(TrunkError::WrongKind { expected, got });
    }
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let (slot, tail) = read_varint(rest)?;
        let (&len, tail) = tail.split_first().ok_or(TrunkError::BadEntry)?;
        let len = usize::from(len);
        let (message, tail) = tail.split_at_checked(len).ok_or(TrunkError::BadEntry)?;
        if message.is_empty() {
            return Err(TrunkError::BadEntry);
        }
        entries.push(Entry { slot, message });
        rest = tail;
    }
    if entries.is_empty() {
        return Err(TrunkError::Empty);
    }
    Ok(entries)
}

/// A LEB128 varint: 7 bits a byte, low bits first. Only the shortest encoding of a
/// number is accepted, so that every batch has one encoding.
fn read_varint(bytes: &[u8]) -> Result<(u64, &[u8]), TrunkError> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        let bits = u64::from(b & 0x7f);
        let shift = 7 * i as u32;
        if shift == 63 && bits > 1 {
            return Err(TrunkError::BadSlot);
        }
        value |= bits << shift;
        if b & 0x80 == 0 {
            if b == 0 && i > 0 {
                return Err(TrunkError::BadSlot);
            }
            return Ok((value, bytes.get(i + 1..).unwrap_or_default()));
        }
    }
    Err(TrunkError::BadSlot)
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// How many bytes `value` takes as a varint.
fn varint_len(value: u64) -> usize {
    let bits = 64 - value.leading_zeros() as usize;
    bits.div_ceil(7).max(1)
}

/// Builds batches of one kind, each at most a size limit.
#[derive(Debug, Clone)]
pub struct BatchEncoder {
    kind: BatchKind,
    limit: usize,
    buf: Vec<u8>,
}

impl BatchEncoder {
    /// An empty batch of `kind`, to be at most `limit` bytes (no more than
    /// [`MAX_BATCH`]).
    pub fn new(kind: BatchKind, limit: usize) -> Self {
        let limit = limit.min(MAX_BATCH);
        BatchEncoder {
            kind,
            limit,
            buf: Self::header(kind),
        }
    }

    fn header(kind: BatchKind) -> Vec<u8> {
        vec![TRUNK_VERSION, kind as u8]
    }

    /// The size limit of a batch.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Changes the size limit for entries pushed from now on (no more than
    /// [`MAX_BATCH`]).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(MAX_BATCH);
    }

    /// Whether the batch holds no entry.
    pub fn is_empty(&self) -> bool {
        self.buf.len() <= 2
    }

    /// The batch's size so far, in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether an entry of `slot` with a message of `len` bytes fits a batch at all:
    /// an empty one, within the limit.
    pub fn fits_alone(&self, slot: Slot, len: usize) -> bool {
        (1..=MAX_ENTRY).contains(&len) && 2 + varint_len(slot) + 1 + len <= self.limit
    }

    /// Appends an entry if it fits what is left of the limit; `false` if it does not
    /// (take the batch, then push again). An entry that fits no batch
    /// ([`BatchEncoder::fits_alone`]) is an error.
    pub fn push(&mut self, slot: Slot, message: &[u8]) -> Result<bool, TrunkError> {
        if !self.fits_alone(slot, message.len()) {
            return Err(TrunkError::TooLarge {
                what: "batch entry",
                len: message.len(),
                max: MAX_ENTRY.min(self.limit.saturating_sub(2 + varint_len(slot) + 1)),
            });
        }
        if self.buf.len() + varint_len(slot) + 1 + message.len() > self.limit {
            return Ok(false);
        }
        write_varint(&mut self.buf, slot);
        self.buf.push(message.len() as u8);
        self.buf.extend_from_slice(message);
        Ok(true)
    }

    /// The batch, if it holds an entry; the encoder starts a new one.
    pub fn take(&mut self) -> Option<Vec<u8>> {
        if self.is_empty() {
            return None;
        }
        Some(std::mem::replace(&mut self.buf, Self::header(self.kind)))
    }
}

#[cfg(test)]
mod tests;
