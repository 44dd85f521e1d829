//! The session protocol of one agent connection, sans IO: a [`ClientSession`] for the
//! agent and a [`ServerSession`] for the aggregator.
//!
//! The rules of a session (what may arrive when, what a malformed or unexpected message
//! costs, how reports are numbered and old ones dropped, when the interval changes,
//! when a silent peer is given up on) live here as plain state machines, so that both
//! ends follow one definition and every rule is tested deterministically and fuzzed.
//! Nothing in this module reads a clock, touches a socket or needs a runtime: bytes
//! and [`Instant`](std::time::Instant)s come in as arguments, and events and the bytes
//! to send go out as return values. The async drivers (the agent's report loop and the
//! aggregator's ingest) keep only the sockets, the timers and the calls into the rest
//! of their program.
//!
//! A session on one QUIC connection:
//!
//! 1. the agent sends one framed [`Hello`](crate::wire::Hello) on a bidirectional
//!    stream ([`crate::frame`]: a 2-byte length, then the message);
//! 2. the aggregator checks the hello against the connection's [`Peer`]: the node its
//!    certificate names, the services it may serve and the addresses it may advertise
//!    ([`authz`]); it answers on the same stream with one framed
//!    [`Welcome`](crate::wire::Welcome) (the report interval) or
//!    [`Reject`](crate::wire::Reject) (a reason code and text);
//! 3. after the welcome the agent sends one [`Report`](crate::wire::Report) datagram
//!    per interval, numbered from 1;
//! 4. the aggregator answers each report newer than any before it with a
//!    [`Reply`] datagram: the node's [`Assignment`] and the report
//!    interval, which the aggregator may change with any reply.
//!
//! A relay carries many agents' sessions to a primary over one connection, a trunk:
//! [`trunk`] has its two ends, which run a [`ServerSession`] per agent.
//!
//! Faults are typed ([`ProtocolError`], [`ClientError`], [`ServerError`]); a machine
//! never panics, whatever bytes it is fed.

pub mod authz;
mod client;
pub mod driver;
pub mod proof;
mod server;
#[cfg(test)]
mod tests;
pub mod trunk;

pub use authz::{Cidr, Grant, Peer};
pub use client::{ClientConfig, ClientError, ClientEvent, ClientSession, Measurement};
pub use server::{ServerConfig, ServerError, ServerEvent, ServerSession};
pub use trunk::{TrunkClient, TrunkClientConfig, TrunkServer, TrunkServerConfig};

use crate::protocol::Protocol;
use crate::wire::{DecodeError, Message, Reply, MAX_MESSAGE};
use std::fmt;

/// QUIC application error codes with which a session's connection is closed. Both
/// ends use them, so an agent can tell a refusal from a protocol fault.
pub mod close {
    /// Normal shutdown.
    pub const NORMAL: u32 = 0;
    /// The hello was refused.
    pub const REJECTED: u32 = 1;
    /// The peer broke the protocol (malformed or unexpected messages, no hello in time).
    pub const PROTOCOL: u32 = 2;
    /// The peer's certificate was revoked while it was connected.
    pub const REVOKED: u32 = 3;
    /// The peer's certificate expired while it was connected.
    pub const EXPIRED: u32 = 4;
    /// The aggregator is a cluster replica that no longer serves the node's service:
    /// another replica took it over, and the agent should try its next aggregator.
    pub const MOVED: u32 = 5;
}

/// The shortest report interval either side uses, in milliseconds: shorter would make
/// agents flood the aggregator.
pub(crate) const MIN_INTERVAL_MS: u32 = 100;
/// The longest report interval either side uses, in milliseconds: longer would leave
/// the balancer without fresh reports for whole cycles.
pub(crate) const MAX_INTERVAL_MS: u32 = 60_000;

/// An interval within [`MIN_INTERVAL_MS`, `MAX_INTERVAL_MS`]: the nearest bound for one
/// outside. A misconfigured aggregator must not make its agents spin or fall silent.
pub(crate) fn clamp_interval_ms(ms: u32) -> u32 {
    ms.clamp(MIN_INTERVAL_MS, MAX_INTERVAL_MS)
}

/// What the aggregator assigned to a node, as each reply carries it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Assignment {
    /// The node's weight, normalised so that the mean over serving endpoints is 1.0;
    /// zero while draining.
    pub weight: f64,
    /// The balancing cycle that produced the weight; 0 means none has yet.
    pub cycle: u64,
    /// Whether the aggregator has the node as draining.
    pub draining: bool,
    /// The load the aggregator steers the node by, from its last cycle.
    pub load: f64,
    /// Whether the aggregator trusts the node's in-flight count.
    pub inflight_trusted: bool,
}

impl From<&Reply> for Assignment {
    fn from(r: &Reply) -> Self {
        Assignment {
            weight: f64::from(r.weight),
            cycle: r.cycle,
            draining: r.draining,
            load: f64::from(r.load),
            inflight_trusted: r.inflight_trusted,
        }
    }
}

/// Which message arrived, for errors that say what was expected instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// [`Message::Hello`].
    Hello,
    /// [`Message::Welcome`].
    Welcome,
    /// [`Message::Reject`].
    Reject,
    /// [`Message::Report`].
    Report,
    /// [`Message::Reply`].
    Reply,
    /// [`Message::Challenge`].
    Challenge,
    /// [`Message::Proof`].
    Proof,
}

impl MessageKind {
    /// The kind of `msg`.
    pub fn of(msg: &Message) -> Self {
        match msg {
            Message::Hello(_) => MessageKind::Hello,
            Message::Welcome(_) => MessageKind::Welcome,
            Message::Reject(_) => MessageKind::Reject,
            Message::Report(_) => MessageKind::Report,
            Message::Reply(_) => MessageKind::Reply,
            Message::Challenge(_) => MessageKind::Challenge,
            Message::Proof(_) => MessageKind::Proof,
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MessageKind::Hello => "a hello",
            MessageKind::Welcome => "a welcome",
            MessageKind::Reject => "a reject",
            MessageKind::Report => "a report",
            MessageKind::Reply => "a reply",
            MessageKind::Challenge => "a challenge",
            MessageKind::Proof => "a proof",
        })
    }
}

/// Bytes from the peer that break the protocol. Either machine returns it; whether it
/// ends the session depends on where it came (on the hello stream it does; one bad
/// datagram does not).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The message does not decode: malformed, trailing bytes, an unknown wire version
    /// or over the size limit.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A frame's length prefix exceeds the limit; refused before anything is buffered.
    #[error("frame of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    FrameTooLarge(usize),
    /// Bytes after the one frame the hello stream carries each way.
    #[error("{0} bytes after the frame on the hello stream")]
    TrailingFrame(usize),
    /// The hello stream ended before its frame was whole.
    #[error("the hello stream ended before its message")]
    StreamEnded,
    /// A well-formed message that has no place here.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the machine was waiting for.
        expected: &'static str,
        /// What came.
        got: MessageKind,
    },
}

impl ProtocolError {
    /// A short, stable label for metrics; the decoder's labels for decode errors, so
    /// that a fault counts the same whichever side sees it.
    pub fn label(&self) -> &'static str {
        match self {
            ProtocolError::Decode(d) => d.label(),
            ProtocolError::FrameTooLarge(_) => "oversized",
            ProtocolError::TrailingFrame(_) => "malformed",
            ProtocolError::StreamEnded => "stream",
            ProtocolError::Unexpected { .. } => "unexpected_message",
        }
    }
}

/// Reassembles the one framed message a hello stream carries each way from the chunks
/// a stream delivers. The length prefix is checked before anything is buffered, and
/// the buffer never holds more than one frame, whatever the peer sends.
#[derive(Debug)]
pub(crate) struct FrameReader {
    protocol: Protocol,
    buf: Vec<u8>,
    done: bool,
}

impl FrameReader {
    /// A reader waiting for its frame, in `protocol`.
    pub(crate) fn new(protocol: Protocol) -> Self {
        FrameReader {
            protocol,
            buf: Vec::new(),
            done: false,
        }
    }

    /// Takes the next bytes of a stream that carries any number of frames: the messages
    /// whose frames they complete. The length prefix of each is checked before its
    /// bytes are kept.
    pub(crate) fn push_many(&mut self, mut bytes: &[u8]) -> Result<Vec<Message>, ProtocolError> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let head = (2usize.saturating_sub(self.buf.len())).min(bytes.len());
            let (prefix, rest) = bytes.split_at(head);
            self.buf.extend_from_slice(prefix);
            bytes = rest;
            let Some(&[hi, lo]) = self.buf.first_chunk::<2>() else {
                break;
            };
            let len = usize::from(u16::from_be_bytes([hi, lo]));
            if len > MAX_MESSAGE {
                return Err(ProtocolError::FrameTooLarge(len));
            }
            let missing = 2 + len - self.buf.len();
            let (take, rest) = bytes.split_at(missing.min(bytes.len()));
            self.buf.extend_from_slice(take);
            bytes = rest;
            if self.buf.len() == 2 + len {
                let msg = self.protocol.decode(self.buf.get(2..).unwrap_or_default());
                self.buf.clear();
                out.push(msg?);
            }
        }
        Ok(out)
    }

    /// Takes the next bytes of the stream; the message once its frame is whole. Bytes
    /// beyond the frame are an error: the stream carries one message each way.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Result<Option<Message>, ProtocolError> {
        if self.done {
            return if bytes.is_empty() {
                Ok(None)
            } else {
                Err(ProtocolError::TrailingFrame(bytes.len()))
            };
        }
        let mut rest = bytes;
        while self.buf.len() < 2 {
            let Some((&b, tail)) = rest.split_first() else {
                return Ok(None);
            };
            self.buf.push(b);
            rest = tail;
        }
        let len = usize::from(u16::from_be_bytes([self.buf[0], self.buf[1]]));
        if len > MAX_MESSAGE {
            return Err(ProtocolError::FrameTooLarge(len));
        }
        let missing = 2 + len - self.buf.len();
        let (take, extra) = rest.split_at(missing.min(rest.len()));
        self.buf.extend_from_slice(take);
        if self.buf.len() < 2 + len {
            return Ok(None);
        }
        if !extra.is_empty() {
            return Err(ProtocolError::TrailingFrame(extra.len()));
        }
        self.done = true;
        let msg = self.protocol.decode(&self.buf[2..])?;
        self.buf = Vec::new();
        Ok(Some(msg))
    }
}

/// Whether sequence number `seq` is newer than `last`, in serial-number arithmetic
/// (RFC 1982), so that numbering may wrap without every later report looking old.
pub(crate) fn seq_newer(seq: u32, last: u32) -> bool {
    let ahead = seq.wrapping_sub(last);
    ahead != 0 && ahead < 1 << 31
}
