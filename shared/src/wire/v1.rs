//! The previous wire protocol, `ballast/1` (wire version 1), kept as a codec so that an
//! agent or an aggregator one release behind still talks to this one.
//!
//! Two messages differ from today's ([`super`]):
//!
//! - the **report** carried the agent's own `load` and a `timestamp_ms`. Today's
//!   aggregator computes the load itself and times reports by their arrival, so both
//!   are dropped on the way in; on the way out (to an aggregator of the previous
//!   release) the load is `max(cpu, inflight / capacity)` (the CPU alone without a
//!   capacity) and the timestamp 0, neither of which that release ever read;
//! - the **reply** lacked the aggregator's `load` and whether it trusts the node's
//!   in-flight count. On the way in the load is NaN (not known) and the count
//!   counts as trusted, which is all an aggregator of that release did; on the way out
//!   both are dropped.
//!
//! The hello, the welcome and the reject are the same in both versions; only the
//! version byte in front of them differs. The translation happens here, at the edge,
//! so that the sessions and the balancer only ever see today's [`Message`].

use super::{
    DecodeError, EncodeError, Hello, Message as Current, NodeState, Reject, Reply as CurrentReply,
    Report as CurrentReport, Welcome,
};
use serde::{Deserialize, Serialize};

/// The version byte that opens every message of this protocol.
pub const WIRE_VERSION: u8 = 1;

/// Its ALPN protocol name.
pub const ALPN: &[u8] = b"ballast/1";

/// Every message of the previous protocol, in its own layout.
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
}

/// The previous protocol's report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Increases by one per report.
    pub seq: u32,
    /// When the sample was taken, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// CPU utilization relative to what the service may use.
    pub cpu: f32,
    /// Requests in flight at the sample.
    pub inflight: u32,
    /// The in-flight count that means fully busy.
    pub capacity: u32,
    /// The load the agent computed.
    pub load: f32,
    /// Errors per request over the window, when measured.
    pub error_rate: Option<f32>,
    /// Serving or draining.
    pub state: NodeState,
}

/// The previous protocol's reply.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The node's weight.
    pub weight: f32,
    /// The balancing cycle that produced the weight.
    pub cycle: u64,
    /// How often the agent should report, in milliseconds.
    pub interval_ms: u32,
    /// Whether the aggregator has this node as draining.
    pub draining: bool,
}

impl From<&CurrentReport> for Report {
    fn from(r: &CurrentReport) -> Self {
        let share = if r.capacity > 0 {
            r.inflight as f32 / r.capacity as f32
        } else {
            0.0
        };
        Report {
            seq: r.seq,
            timestamp_ms: 0,
            cpu: r.cpu,
            inflight: r.inflight,
            capacity: r.capacity,
            load: r.cpu.max(share),
            error_rate: r.error_rate,
            state: r.state,
        }
    }
}

impl From<Report> for CurrentReport {
    fn from(r: Report) -> Self {
        CurrentReport {
            seq: r.seq,
            cpu: r.cpu,
            inflight: r.inflight,
            capacity: r.capacity,
            error_rate: r.error_rate,
            state: r.state,
        }
    }
}

impl From<&CurrentReply> for Reply {
    fn from(r: &CurrentReply) -> Self {
        Reply {
            weight: r.weight,
            cycle: r.cycle,
            interval_ms: r.interval_ms,
            draining: r.draining,
        }
    }
}

impl From<Reply> for CurrentReply {
    fn from(r: Reply) -> Self {
        CurrentReply {
            weight: r.weight,
            cycle: r.cycle,
            interval_ms: r.interval_ms,
            draining: r.draining,
            load: f32::NAN,
            inflight_trusted: true,
        }
    }
}

impl TryFrom<&Current> for Message {
    type Error = EncodeError;

    /// Today's message in this version; the challenge and the proof of a relayed
    /// attach do not exist in it.
    fn try_from(m: &Current) -> Result<Self, EncodeError> {
        Ok(match m {
            Current::Hello(h) => Message::Hello(h.clone()),
            Current::Welcome(w) => Message::Welcome(*w),
            Current::Reject(r) => Message::Reject(r.clone()),
            Current::Report(r) => Message::Report(r.into()),
            Current::Reply(r) => Message::Reply(r.into()),
            Current::Challenge(_) => {
                return Err(EncodeError::NotInVersion("a challenge", "ballast/1"))
            }
            Current::Proof(_) => return Err(EncodeError::NotInVersion("a proof", "ballast/1")),
        })
    }
}

impl From<Message> for Current {
    fn from(m: Message) -> Self {
        match m {
            Message::Hello(h) => Current::Hello(h),
            Message::Welcome(w) => Current::Welcome(w),
            Message::Reject(r) => Current::Reject(r),
            Message::Report(r) => Current::Report(r.into()),
            Message::Reply(r) => Current::Reply(r.into()),
        }
    }
}

/// Encodes a message of this protocol as it is, behind its version byte.
pub fn encode_raw(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    super::encode_as(WIRE_VERSION, msg)
}

/// Decodes one whole message of this protocol as it is. Never panics.
pub fn decode_raw(bytes: &[u8]) -> Result<Message, DecodeError> {
    super::decode_as(WIRE_VERSION, bytes)
}

/// Encodes today's message in the previous protocol, translating what changed.
pub fn encode(msg: &Current) -> Result<Vec<u8>, EncodeError> {
    encode_raw(&Message::try_from(msg)?)
}

/// Decodes a message of the previous protocol into today's, translating what changed.
pub fn decode(bytes: &[u8]) -> Result<Current, DecodeError> {
    decode_raw(bytes).map(Current::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A report exactly as an agent of the previous release encoded it: version byte
    /// 1, variant 3 (report), then seq 7, timestamp 1_800_000_000_000, cpu 0.5,
    /// inflight 4, capacity 8, load 0.5, error rate none, serving; bincode 2's
    /// standard configuration (varints, a u64 above u32::MAX behind 253, floats
    /// little-endian).
    const PREVIOUS_REPORT: [u8; 24] = [
        1, 3, 7, 253, 0, 80, 92, 24, 163, 1, 0, 0, 0, 0, 0, 63, 4, 8, 0, 0, 0, 63, 0, 0,
    ];

    #[test]
    fn a_previous_release_report_decodes_into_todays() {
        let msg = decode(&PREVIOUS_REPORT);
        let want = CurrentReport {
            seq: 7,
            cpu: 0.5,
            inflight: 4,
            capacity: 8,
            error_rate: None,
            state: NodeState::Serving,
        };
        assert_eq!(msg, Ok(Current::Report(want)));
        // The previous layout, built by this codec, is the same bytes.
        let built = encode_raw(&Message::Report(Report {
            seq: 7,
            timestamp_ms: 1_800_000_000_000,
            cpu: 0.5,
            inflight: 4,
            capacity: 8,
            load: 0.5,
            error_rate: None,
            state: NodeState::Serving,
        }))
        .expect("encodes");
        assert_eq!(built, PREVIOUS_REPORT);
    }

    #[test]
    fn todays_reply_reaches_a_previous_agent_without_the_new_fields() {
        let reply = CurrentReply {
            weight: 1.25,
            cycle: 9,
            interval_ms: 500,
            draining: true,
            load: 0.7,
            inflight_trusted: false,
        };
        let bytes = encode(&Current::Reply(reply)).expect("encodes");
        assert_eq!(bytes[0], WIRE_VERSION);
        assert_eq!(
            decode_raw(&bytes),
            Ok(Message::Reply(Reply {
                weight: 1.25,
                cycle: 9,
                interval_ms: 500,
                draining: true,
            }))
        );
        // Back into today's: what the previous protocol lacked is "not known".
        let Ok(Current::Reply(back)) = decode(&bytes) else {
            panic!("a reply decodes");
        };
        assert!(back.load.is_nan());
        assert!(back.inflight_trusted);
        assert_eq!((back.weight, back.cycle), (1.25, 9));
    }

    #[test]
    fn a_report_for_a_previous_aggregator_carries_a_load() {
        let report = CurrentReport {
            seq: 1,
            cpu: 0.25,
            inflight: 6,
            capacity: 8,
            error_rate: Some(0.1),
            state: NodeState::Draining,
        };
        let Ok(Message::Report(old)) =
            decode_raw(&encode(&Current::Report(report)).expect("encodes"))
        else {
            panic!("a report decodes");
        };
        assert_eq!(old.load, 0.75);
        assert_eq!(Current::Report(old.into()), Current::Report(report));
    }

    #[test]
    fn the_versions_do_not_decode_each_other() {
        let report = CurrentReport {
            seq: 1,
            cpu: 0.25,
            inflight: 6,
            capacity: 0,
            error_rate: None,
            state: NodeState::Serving,
        };
        let current = super::super::encode(&Current::Report(report)).expect("encodes");
        assert_eq!(decode(&current), Err(DecodeError::UnknownVersion(2)));
        let previous = encode(&Current::Report(report)).expect("encodes");
        assert_eq!(
            super::super::decode(&previous),
            Err(DecodeError::UnknownVersion(1))
        );
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode(&bytes);
        }
    }
}
