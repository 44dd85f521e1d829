//! The Ballast wire protocol: a one-byte version followed by one bincode 2 message.
//!
//! The hello goes on a reliable stream because a lost hello would leave the node
//! unknown. Reports and replies go in QUIC datagrams: a lost report is simply a
//! missing report, which the balancing cycle already handles, and a datagram never
//! queues behind a retransmission of an older one.

use serde::{Deserialize, Serialize};
use std::fmt;

pub mod examples;
pub mod v1;

/// The version byte that opens every encoded message.
pub const WIRE_VERSION: u8 = 2;

/// The largest encoded message either side accepts or sends, in bytes. Every message
/// fits one QUIC datagram on a 1280-byte path MTU with room to spare.
pub const MAX_MESSAGE: usize = 1024;

/// Upper bounds for the strings of a [`Hello`], checked by [`Hello::validate`].
pub(crate) const MAX_NODE_ID: usize = 128;
/// Longest accepted service name.
pub(crate) const MAX_SERVICE: usize = 128;
/// Longest accepted endpoint address.
pub(crate) const MAX_ADDRESS: usize = 256;
/// Longest accepted zone name.
pub(crate) const MAX_ZONE: usize = 64;

/// Everything that travels between an agent and an aggregator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Agent to aggregator, first thing on a connection.
    Hello(Hello),
    /// Aggregator to agent: the hello is accepted.
    Welcome(Welcome),
    /// Aggregator to agent: the hello or a report is refused.
    Reject(Reject),
    /// Agent to aggregator, once per interval.
    Report(Report),
    /// Aggregator to agent, in answer to each report.
    Reply(Reply),
    /// Relay to agent, on the hello stream: prove that you hold your certificate's key
    /// to the primary named here ([`crate::session::proof`]). Before the welcome when
    /// the agent first attaches, at any time after it when the relay moves it to
    /// another primary. Only in `ballast/2`; a direct aggregator never sends it.
    Challenge(Challenge),
    /// Agent to relay, on the hello stream: the answer to a [`Message::Challenge`].
    Proof(Proof),
}

/// The length of a challenge's nonce, in bytes.
pub const NONCE_LEN: usize = 32;

/// A primary's challenge to a relayed agent, handed on by its relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// Fresh random bytes, one challenge per attach.
    pub nonce: [u8; NONCE_LEN],
    /// The name of the primary that asks: the proof is good for it alone.
    pub primary: String,
}

/// An agent's answer to a [`Challenge`]: a signature with its certificate's key over
/// the challenge and its own hello ([`crate::session::proof`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof {
    /// The TLS 1.3 signature scheme of the signature (its IANA number).
    pub scheme: u16,
    /// The signature.
    pub signature: Vec<u8>,
}

/// Registration: who the node is and where its service listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The node's identity. It must match the identity in the client certificate.
    pub node: String,
    /// The service the node serves.
    pub service: String,
    /// The endpoint address load balancers send traffic to, `host:port`.
    pub address: String,
    /// The zone (datacenter, availability zone) the node runs in; may be empty.
    pub zone: String,
    /// The agent's software version.
    pub version: String,
}

/// Serving state as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum NodeState {
    /// Taking traffic.
    #[default]
    Serving,
    /// Lame duck: finishing in-flight work and asking for weight 0.
    Draining,
}

/// One measurement from one node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Increases by one per report; lets the aggregator drop reordered datagrams.
    pub seq: u32,
    /// CPU utilization relative to what the service may use. May exceed 1.
    pub cpu: f32,
    /// Requests awaiting a response at the sample.
    pub inflight: u32,
    /// The in-flight count that means fully busy, when the operator configured one;
    /// 0 (the default) lets the aggregator judge the count against the fleet.
    ///
    /// The report carries no load of its own and no timestamp: the aggregator computes
    /// the load (it alone sees the fleet) and times reports by their arrival.
    pub capacity: u32,
    /// Errors per request over the window, when the agent measures it.
    pub error_rate: Option<f32>,
    /// Serving or draining.
    pub state: NodeState,
}

/// The aggregator's answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// How often the agent should report, in milliseconds.
    pub interval_ms: u32,
}

/// The aggregator's answer to a report: what this node should be getting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The node's weight, normalised so that the mean over serving endpoints is 1.0.
    /// Zero while draining.
    pub weight: f32,
    /// The balancing cycle that produced the weight; 0 means none has yet.
    pub cycle: u64,
    /// How often the agent should report, in milliseconds.
    pub interval_ms: u32,
    /// Whether the aggregator has this node as draining.
    pub draining: bool,
    /// The load the aggregator steers this node by, from its last cycle.
    pub load: f32,
    /// Whether the aggregator trusts this node's in-flight count. A count that does
    /// not follow the node's weight is not load, and is set aside until it does.
    pub inflight_trusted: bool,
}

/// Why the aggregator refused something.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectReason {
    /// The hello names a node other than the one in the client certificate.
    IdentityMismatch,
    /// A field of the hello is empty, too long or malformed.
    InvalidHello,
    /// A report arrived before any hello on this connection.
    NoHello,
    /// The aggregator does not serve this service.
    UnknownService,
    /// The node's certificate (and the aggregator's policy) do not allow it to serve
    /// this service.
    ServiceNotAllowed,
    /// The advertised address is not one the node may claim: not the connection's
    /// source address, nor in a network or a host name its policy allows.
    AddressNotAllowed,
    /// Registering would pass one of the aggregator's limits (services in all,
    /// endpoints in a service).
    LimitReached,
    /// The aggregator is one replica of a cluster, and another replica serves this
    /// service (the detail names it when known): the agent should try its next
    /// aggregator.
    NotOwner,
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::IdentityMismatch => "identity_mismatch",
            RejectReason::InvalidHello => "invalid_hello",
            RejectReason::NoHello => "no_hello",
            RejectReason::UnknownService => "unknown_service",
            RejectReason::ServiceNotAllowed => "service_not_allowed",
            RejectReason::AddressNotAllowed => "address_not_allowed",
            RejectReason::LimitReached => "limit_reached",
            RejectReason::NotOwner => "not_owner",
        })
    }
}

/// A refusal, with a reason code for metrics and text for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    /// Machine-readable reason.
    pub reason: RejectReason,
    /// Human-readable detail.
    pub detail: String,
}

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Zero bytes.
    #[error("empty message")]
    Empty,
    /// The message is longer than [`MAX_MESSAGE`].
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    /// The version byte is not one this build speaks.
    #[error("unknown wire version {0} (this build speaks {WIRE_VERSION})")]
    UnknownVersion(u8),
    /// The body is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A valid message followed by extra bytes.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

impl DecodeError {
    /// A short, stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            DecodeError::Empty | DecodeError::Malformed(_) | DecodeError::Trailing(_) => {
                "malformed"
            }
            DecodeError::TooLarge(_) => "oversized",
            DecodeError::UnknownVersion(_) => "unknown_version",
        }
    }
}

/// Why a message could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The encoded message would exceed [`MAX_MESSAGE`].
    #[error("encoded message exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge,
    /// bincode refused the value.
    #[error("encoding failed: {0}")]
    Bincode(String),
    /// The message does not exist in the version asked for.
    #[error("{0} does not exist in {1}")]
    NotInVersion(&'static str, &'static str),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MESSAGE>()
}

/// Encodes a message behind the version byte.
pub fn encode(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    encode_as(WIRE_VERSION, msg)
}

/// Decodes one whole message. Never panics, whatever the bytes.
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    decode_as(WIRE_VERSION, bytes)
}

/// `msg` behind the version byte `version`, held to [`MAX_MESSAGE`]: the envelope of
/// every version of the protocol.
fn encode_as<T: Serialize>(version: u8, msg: &T) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64);
    out.push(version);
    let body = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| EncodeError::Bincode(e.to_string()))?;
    out.extend_from_slice(&body);
    if out.len() > MAX_MESSAGE {
        return Err(EncodeError::TooLarge);
    }
    Ok(out)
}

/// One whole message of the version `version`. Never panics, whatever the bytes.
fn decode_as<T: serde::de::DeserializeOwned>(version: u8, bytes: &[u8]) -> Result<T, DecodeError> {
    let (&found, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(DecodeError::TooLarge(bytes.len()));
    }
    if found != version {
        return Err(DecodeError::UnknownVersion(found));
    }
    let (msg, used): (T, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(DecodeError::Trailing(body.len() - used));
    }
    Ok(msg)
}

/// Why a hello was refused by [`Hello::validate`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HelloError {
    /// A required field is empty.
    #[error("{0} is empty")]
    Empty(&'static str),
    /// A field is longer than its limit.
    #[error("{field} is {len} bytes, more than the limit of {max}")]
    TooLong {
        /// Which field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A name holds characters outside `[A-Za-z0-9._-]`.
    #[error("{0} may hold only letters, digits, '.', '_' and '-'")]
    BadName(&'static str),
    /// The address is not `host:port`.
    #[error("address {0:?} is not host:port")]
    BadAddress(String),
}

/// Whether `s` is a usable name for a service, node or zone.
pub fn is_valid_name(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Hello {
    /// Checks lengths and syntax, so that nothing hostile reaches the balancer's maps.
    pub fn validate(&self) -> Result<(), HelloError> {
        let fields: [(&'static str, &str, usize, bool); 4] = [
            ("node", &self.node, MAX_NODE_ID, true),
            ("service", &self.service, MAX_SERVICE, true),
            ("address", &self.address, MAX_ADDRESS, true),
            ("zone", &self.zone, MAX_ZONE, false),
        ];
        for (field, value, max, required) in fields {
            if required && value.is_empty() {
                return Err(HelloError::Empty(field));
            }
            if value.len() > max {
                return Err(HelloError::TooLong {
                    field,
                    len: value.len(),
                    max,
                });
            }
        }
        for (field, value) in [
            ("node", &self.node),
            ("service", &self.service),
            ("zone", &self.zone),
        ] {
            if !is_valid_name(value) {
                return Err(HelloError::BadName(field));
            }
        }
        if !is_host_port(&self.address) {
            return Err(HelloError::BadAddress(self.address.clone()));
        }
        Ok(())
    }
}

/// Whether `s` looks like `host:port` or `[v6]:port` with a non-zero port.
pub fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    };
    host_ok && matches!(port.parse::<u16>(), Ok(p) if p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn report() -> Report {
        Report {
            seq: 4_000_000_000,
            cpu: 0.73,
            inflight: 1_000_000,
            capacity: 1_000_000,
            error_rate: Some(0.5),
            state: NodeState::Draining,
        }
    }

    #[test]
    fn report_fits_in_64_bytes_even_with_large_fields() {
        let bytes = encode(&Message::Report(report())).expect("encodes");
        assert!(bytes.len() <= 64, "report is {} bytes", bytes.len());
    }

    #[test]
    fn round_trip_every_message() {
        let msgs = [
            Message::Hello(Hello {
                node: "web-1".into(),
                service: "web".into(),
                address: "10.0.0.1:8080".into(),
                zone: "z1".into(),
                version: "0.1.0".into(),
            }),
            Message::Welcome(Welcome { interval_ms: 1000 }),
            Message::Reject(Reject {
                reason: RejectReason::IdentityMismatch,
                detail: "x".into(),
            }),
            Message::Report(report()),
            Message::Reply(Reply {
                weight: 1.5,
                cycle: 7,
                interval_ms: 1000,
                draining: false,
                load: 0.62,
                inflight_trusted: true,
            }),
            Message::Challenge(Challenge {
                nonce: [7; NONCE_LEN],
                primary: "r1".into(),
            }),
            Message::Proof(Proof {
                scheme: 0x0403,
                signature: vec![1; 72],
            }),
        ];
        for m in msgs {
            assert_eq!(decode(&encode(&m).expect("encodes")), Ok(m));
        }
    }

    #[test]
    fn rejects_unknown_version_oversize_and_trailing_bytes() {
        let mut bytes = encode(&Message::Report(report())).expect("encodes");
        bytes[0] = 9;
        assert_eq!(decode(&bytes), Err(DecodeError::UnknownVersion(9)));
        bytes[0] = WIRE_VERSION;
        bytes.push(0);
        assert_eq!(decode(&bytes), Err(DecodeError::Trailing(1)));
        assert_eq!(
            decode(&vec![WIRE_VERSION; MAX_MESSAGE + 1]),
            Err(DecodeError::TooLarge(MAX_MESSAGE + 1))
        );
        assert_eq!(decode(&[]), Err(DecodeError::Empty));
    }

    #[test]
    fn a_hostile_string_length_is_refused_without_allocating_it() {
        // Tag 0 (Hello), then a varint length of u64::MAX for the first string.
        let bytes = [
            WIRE_VERSION,
            0,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
        ];
        assert!(matches!(decode(&bytes), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn an_oversized_hello_does_not_encode() {
        let hello = Hello {
            node: "n".repeat(2000),
            service: "s".into(),
            address: "a:1".into(),
            zone: String::new(),
            version: String::new(),
        };
        assert!(matches!(
            encode(&Message::Hello(hello)),
            Err(EncodeError::TooLarge)
        ));
    }

    #[test]
    fn hello_validation() {
        let ok = Hello {
            node: "web-1".into(),
            service: "web".into(),
            address: "[::1]:80".into(),
            zone: String::new(),
            version: "1".into(),
        };
        assert_eq!(ok.validate(), Ok(()));
        let bad_addr = Hello {
            address: "nohost".into(),
            ..ok.clone()
        };
        assert!(matches!(
            bad_addr.validate(),
            Err(HelloError::BadAddress(_))
        ));
        let bad_name = Hello {
            service: "a/b".into(),
            ..ok.clone()
        };
        assert_eq!(bad_name.validate(), Err(HelloError::BadName("service")));
        let empty = Hello {
            node: String::new(),
            ..ok
        };
        assert_eq!(empty.validate(), Err(HelloError::Empty("node")));
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn decoding_mutated_reports_never_panics(flip in 0usize..64, val in any::<u8>()) {
            let mut bytes = encode(&Message::Report(report())).expect("encodes");
            let i = flip % bytes.len();
            bytes[i] = val;
            let _ = decode(&bytes);
        }
    }
}
