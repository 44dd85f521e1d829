//! Which version of the agent protocol a connection speaks, chosen in the TLS
//! handshake by ALPN.
//!
//! An agent offers the current protocol and the previous one, current first; an
//! aggregator or a relay accepts both and prefers the current. The negotiated ALPN
//! selects the codec on both ends ([`Protocol::encode`], [`Protocol::decode`]): a
//! message that changed between the versions is translated by the previous version's
//! codec ([`crate::wire::v2`]) into today's types, so that nothing past the session
//! layer ever sees the older layout. Either side may be upgraded first.
//!
//! `BALLAST_PROTOCOL` narrows what a process offers or accepts: `previous` speaks the
//! previous version only (what a process of the previous release does; tests use it
//! to stand in for one), `current` the current only. Unset or `both`, both.

use crate::wire::{self, DecodeError, EncodeError, Message};
use std::fmt;

/// The environment variable that narrows the protocols a process speaks.
pub const ENV: &str = "BALLAST_PROTOCOL";

/// A version of the agent protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// `ballast/2`: wire version 2, without the mean in-flight count and the age of
    /// the requests owed.
    V2,
    /// `ballast/3`: wire version 3, today's.
    V3,
}

impl Protocol {
    /// The version this build speaks natively.
    pub const CURRENT: Protocol = Protocol::V3;
    /// The version before it, still spoken at the edge.
    pub const PREVIOUS: Protocol = Protocol::V2;
    /// Every version this build speaks, current first: the order of preference.
    pub const ALL: [Protocol; 2] = [Protocol::CURRENT, Protocol::PREVIOUS];

    /// Its ALPN protocol name.
    pub fn alpn(self) -> &'static [u8] {
        match self {
            Protocol::V2 => wire::v2::ALPN,
            Protocol::V3 => crate::ALPN,
        }
    }

    /// Its name (the ALPN as text), for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V2 => "ballast/2",
            Protocol::V3 => "ballast/3",
        }
    }

    /// The version an ALPN protocol name stands for, if this build speaks it.
    pub fn from_alpn(alpn: &[u8]) -> Option<Protocol> {
        Protocol::ALL.into_iter().find(|p| p.alpn() == alpn)
    }

    /// The version `conn` negotiated; `None` for a connection that negotiated no agent
    /// protocol (a trunk, or a peer that offered no ALPN).
    pub fn negotiated(conn: &quinn::Connection) -> Option<Protocol> {
        negotiated_alpn(conn).and_then(|a| Protocol::from_alpn(&a))
    }

    /// Encodes `msg` in this version, translating what changed.
    pub fn encode(self, msg: &Message) -> Result<Vec<u8>, EncodeError> {
        match self {
            Protocol::V2 => wire::v2::encode(msg),
            Protocol::V3 => wire::encode(msg),
        }
    }

    /// Decodes one whole message of this version into today's. Never panics.
    pub fn decode(self, bytes: &[u8]) -> Result<Message, DecodeError> {
        match self {
            Protocol::V2 => wire::v2::decode(bytes),
            Protocol::V3 => wire::decode(bytes),
        }
    }

    /// `msg` in this version with its stream length prefix ([`crate::frame`]).
    pub fn frame(self, msg: &Message) -> Result<Vec<u8>, EncodeError> {
        let bytes = self.encode(msg)?;
        // Every encoding is held to MAX_MESSAGE, which a u16 always fits.
        let len = u16::try_from(bytes.len()).map_err(|_| EncodeError::TooLarge)?;
        let mut out = Vec::with_capacity(2 + bytes.len());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&bytes);
        Ok(out)
    }

    /// Re-encodes a message of version `from` in this one (a relay hands an agent's
    /// datagram on in the version its trunk speaks). The bytes as they are when the
    /// versions are the same.
    pub fn translate(self, from: Protocol, bytes: &[u8]) -> Result<Vec<u8>, TranslateError> {
        if self == from {
            return Ok(bytes.to_vec());
        }
        let msg = from.decode(bytes)?;
        Ok(self.encode(&msg)?)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a message could not be carried from one version into another.
#[derive(Debug, thiserror::Error)]
pub enum TranslateError {
    /// It does not decode in the version it came in.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// It does not encode in the version it goes out in.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// The ALPN protocol name `conn` negotiated, if any.
pub fn negotiated_alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.protocol)
}

/// `BALLAST_PROTOCOL` holds a value that names no set of versions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ENV}={0:?}: expected previous, current or both")]
pub struct UnknownChoice(pub String);

/// The versions a process speaks, in order of preference, from `BALLAST_PROTOCOL`'s
/// value (`None` when unset): both unless it narrows them.
pub fn choose(value: Option<&str>) -> Result<Vec<Protocol>, UnknownChoice> {
    match value.map(str::trim) {
        None | Some("") | Some("both") => Ok(Protocol::ALL.to_vec()),
        Some("current") => Ok(vec![Protocol::CURRENT]),
        Some("previous") => Ok(vec![Protocol::PREVIOUS]),
        Some(other) => Err(UnknownChoice(other.to_string())),
    }
}

/// The versions this process speaks, from the environment ([`ENV`]).
pub fn from_env() -> Result<Vec<Protocol>, UnknownChoice> {
    choose(std::env::var(ENV).ok().as_deref())
}

/// The ALPN names of `protocols`, in their order.
pub fn alpns(protocols: &[Protocol]) -> Vec<&'static [u8]> {
    protocols.iter().map(|p| p.alpn()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{NodeState, Report};

    #[test]
    fn current_comes_first_and_every_alpn_maps_back() {
        assert_eq!(Protocol::ALL[0], Protocol::CURRENT);
        assert_eq!(Protocol::CURRENT.alpn(), crate::ALPN);
        for p in Protocol::ALL {
            assert_eq!(Protocol::from_alpn(p.alpn()), Some(p));
            assert_eq!(p.name().as_bytes(), p.alpn());
        }
        assert_eq!(Protocol::from_alpn(b"ballast/4"), None);
        assert_eq!(Protocol::from_alpn(b"ballast/1"), None);
        assert_eq!(Protocol::from_alpn(crate::trunk::RELAY_ALPN), None);
    }

    #[test]
    fn the_choice_narrows_or_refuses() {
        assert_eq!(choose(None), Ok(Protocol::ALL.to_vec()));
        assert_eq!(choose(Some("both")), Ok(Protocol::ALL.to_vec()));
        assert_eq!(choose(Some("previous")), Ok(vec![Protocol::V2]));
        assert_eq!(choose(Some("current")), Ok(vec![Protocol::V3]));
        assert!(choose(Some("ballast/9")).is_err());
    }

    #[test]
    fn translation_carries_a_report_between_versions() {
        let report = Message::Report(Report {
            seq: 3,
            cpu: 0.5,
            inflight: 2,
            inflight_mean: 2.0,
            age: None,
            capacity: 0,
            error_rate: None,
            state: NodeState::Serving,
        });
        let old = Protocol::V2.encode(&report).expect("encodes");
        let new = Protocol::V3
            .translate(Protocol::V2, &old)
            .expect("translates");
        assert_eq!(wire::decode(&new), Ok(report.clone()));
        assert_eq!(
            Protocol::V3.translate(Protocol::V3, &new).expect("same"),
            new
        );
        assert!(Protocol::V3.translate(Protocol::V3, &[9]).is_ok());
        assert!(Protocol::V3.translate(Protocol::V2, &new).is_err());
    }
}
