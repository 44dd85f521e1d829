//! The previous wire protocol, `ballast/2` (wire version 2), kept as a codec so that an
//! agent or an aggregator one release behind still talks to this one.
//!
//! One message differs from today's ([`super`]): the **report** carried only the
//! in-flight count at the moment it was taken. Today's report adds the mean count over
//! the report interval and the age of the requests the node owes
//! ([`super::Report::inflight_mean`], [`super::Report::age`]). On the way in the mean
//! is the point count and the age is not known, which is all a report of that release
//! says; on the way out (to an aggregator of the previous release) both are dropped,
//! and the point count is what that release reads.
//!
//! Every other message is the same in both versions; only the version byte in front of
//! it differs. The translation happens here, at the edge, so that the sessions and the
//! balancer only ever see today's [`Message`](super::Message).

use super::{
    Challenge, DecodeError, EncodeError, Hello, Message as Current, NodeState, Proof, Reject,
    Reply, Report as CurrentReport, Welcome,
};
use serde::{Deserialize, Serialize};

/// The version byte that opens every message of this protocol.
pub const WIRE_VERSION: u8 = 2;

/// Its ALPN protocol name.
pub const ALPN: &[u8] = b"ballast/2";

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
    /// Relay to agent: prove that you hold your certificate's key.
    Challenge(Challenge),
    /// Agent to relay: the answer to a challenge.
    Proof(Proof),
}

/// The previous protocol's report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Increases by one per report.
    pub seq: u32,
    /// CPU utilization relative to what the service may use.
    pub cpu: f32,
    /// Requests awaiting a response at the sample.
    pub inflight: u32,
    /// The in-flight count that means fully busy; 0 for fleet-relative.
    pub capacity: u32,
    /// Errors per request over the window, when measured.
    pub error_rate: Option<f32>,
    /// Serving or draining.
    pub state: NodeState,
}

impl From<&CurrentReport> for Report {
    fn from(r: &CurrentReport) -> Self {
        Report {
            seq: r.seq,
            cpu: r.cpu,
            inflight: r.inflight,
            capacity: r.capacity,
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
            // The only count that release took: the mean of one sample.
            inflight_mean: r.inflight as f32,
            age: None,
            capacity: r.capacity,
            error_rate: r.error_rate,
            state: r.state,
        }
    }
}

impl From<&Current> for Message {
    fn from(m: &Current) -> Self {
        match m {
            Current::Hello(h) => Message::Hello(h.clone()),
            Current::Welcome(w) => Message::Welcome(*w),
            Current::Reject(r) => Message::Reject(r.clone()),
            Current::Report(r) => Message::Report(r.into()),
            Current::Reply(r) => Message::Reply(*r),
            Current::Challenge(c) => Message::Challenge(c.clone()),
            Current::Proof(p) => Message::Proof(p.clone()),
        }
    }
}

impl From<Message> for Current {
    fn from(m: Message) -> Self {
        match m {
            Message::Hello(h) => Current::Hello(h),
            Message::Welcome(w) => Current::Welcome(w),
            Message::Reject(r) => Current::Reject(r),
            Message::Report(r) => Current::Report(r.into()),
            Message::Reply(r) => Current::Reply(r),
            Message::Challenge(c) => Current::Challenge(c),
            Message::Proof(p) => Current::Proof(p),
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
    encode_raw(&Message::from(msg))
}

/// Decodes a message of the previous protocol into today's, translating what changed.
pub fn decode(bytes: &[u8]) -> Result<Current, DecodeError> {
    decode_raw(bytes).map(Current::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::RequestAge;
    use proptest::prelude::*;

    /// A report exactly as an agent of the previous release encoded it: version byte
    /// 2, variant 3 (report), then seq 7, cpu 0.5, inflight 4, capacity 8, error rate
    /// none, serving; bincode 2's standard configuration (varints, floats
    /// little-endian).
    const PREVIOUS_REPORT: [u8; 11] = [2, 3, 7, 0, 0, 0, 63, 4, 8, 0, 0];

    #[test]
    fn a_previous_release_report_decodes_with_its_count_as_the_mean() {
        let want = CurrentReport {
            seq: 7,
            cpu: 0.5,
            inflight: 4,
            inflight_mean: 4.0,
            age: None,
            capacity: 8,
            error_rate: None,
            state: NodeState::Serving,
        };
        assert_eq!(decode(&PREVIOUS_REPORT), Ok(Current::Report(want)));
        let built = encode_raw(&Message::Report(Report {
            seq: 7,
            cpu: 0.5,
            inflight: 4,
            capacity: 8,
            error_rate: None,
            state: NodeState::Serving,
        }))
        .expect("encodes");
        assert_eq!(built, PREVIOUS_REPORT);
    }

    #[test]
    fn a_report_for_a_previous_aggregator_drops_the_mean_and_the_age() {
        let report = CurrentReport {
            seq: 1,
            cpu: 0.25,
            inflight: 0,
            inflight_mean: 1.6,
            age: Some(RequestAge {
                mean_ms: 240,
                oldest_ms: 900,
            }),
            capacity: 0,
            error_rate: Some(0.1),
            state: NodeState::Draining,
        };
        let bytes = encode(&Current::Report(report)).expect("encodes");
        assert_eq!(bytes[0], WIRE_VERSION);
        let Ok(Message::Report(old)) = decode_raw(&bytes) else {
            panic!("a report decodes");
        };
        assert_eq!(
            (old.seq, old.inflight, old.state),
            (1, 0, NodeState::Draining)
        );
        let Current::Report(back) = Current::from(Message::Report(old)) else {
            panic!("a report");
        };
        assert_eq!((back.inflight_mean, back.age), (0.0, None));
    }

    #[test]
    fn the_versions_do_not_decode_each_other() {
        let report = Current::Report(CurrentReport {
            seq: 1,
            cpu: 0.25,
            inflight: 6,
            inflight_mean: 6.0,
            age: None,
            capacity: 0,
            error_rate: None,
            state: NodeState::Serving,
        });
        let current = super::super::encode(&report).expect("encodes");
        assert_eq!(
            decode(&current),
            Err(DecodeError::UnknownVersion(super::super::WIRE_VERSION))
        );
        let previous = encode(&report).expect("encodes");
        assert_eq!(
            super::super::decode(&previous),
            Err(DecodeError::UnknownVersion(WIRE_VERSION))
        );
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode(&bytes);
        }
    }
}
