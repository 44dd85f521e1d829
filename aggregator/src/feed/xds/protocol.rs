//! The state of one ADS stream as the xDS protocol (state of the world) defines it:
//! per type URL, what the client subscribed to, what was last sent with which nonce,
//! and what the client last accepted or rejected. Pure: no sockets, no clocks.
//!
//! - A request whose `response_nonce` is that of the last response of its type is the
//!   client's answer to it: an ACK without `error_detail`, a NACK with one.
//! - A request with an older nonce answers a response the client has since been sent
//!   a newer one of; it is stale and ignored, subscription and all (the client will
//!   repeat its subscription when it answers the newer one).
//! - A request without a nonce, or the first of its type on the stream, opens (or
//!   re-opens) the type's subscription.
//! - After a NACK the client keeps the last version it accepted, so the server does
//!   not send the rejected contents again: it sends when the contents change or the
//!   subscription does.

use super::resources::ResourceType;
use std::collections::{BTreeMap, BTreeSet};

/// The resource names a stream asked for, for one type.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Subscription {
    /// Everything of the type (LDS and CDS only): an empty first request, or `*`.
    pub wildcard: bool,
    /// The names asked for explicitly (without `*`).
    pub names: BTreeSet<String>,
}

impl Subscription {
    /// The subscription a request sets, given the one before it (`None` on the first
    /// request of the type). An empty list keeps a legacy wildcard a wildcard.
    fn from_request(t: ResourceType, names: &[String], before: Option<&Subscription>) -> Self {
        let star = names.iter().any(|n| n == "*");
        let explicit: BTreeSet<String> = names.iter().filter(|n| *n != "*").cloned().collect();
        let legacy = names.is_empty() && before.is_none_or(|b| b.wildcard);
        Subscription {
            wildcard: t.allows_wildcard() && (star || legacy),
            names: explicit,
        }
    }
}

/// A response sent on the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// Its nonce.
    pub nonce: String,
    /// Its `version_info`.
    pub version: String,
}

/// What a request was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The first request of a type, or one without a nonce: a (re)subscription.
    Subscribe,
    /// The client accepted the response with this version.
    Ack {
        /// The version accepted.
        version: String,
    },
    /// The client rejected the response with this version; it keeps the last one it
    /// accepted.
    Nack {
        /// The version rejected.
        version: String,
        /// The client's reason.
        message: String,
    },
    /// It answers a response that has since been superseded; ignored.
    Stale,
}

/// One type's state on one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TypeState {
    /// What the client asked for.
    pub subscription: Subscription,
    /// The last response sent.
    pub sent: Option<Sent>,
    /// The last version the client accepted.
    pub acked: Option<String>,
    /// The last version the client rejected, while no later one was accepted.
    pub nacked: Option<String>,
    /// Set when a request asks for a response whatever the contents: a new or
    /// changed subscription must be answered even if the resources are the same.
    must_respond: bool,
}

/// One ADS stream's protocol state over every type.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamState {
    types: BTreeMap<ResourceType, TypeState>,
    nonces: u64,
}

impl StreamState {
    /// A new stream.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Applies a request of type `t` and says what it was.
    pub(crate) fn on_request(
        &mut self,
        t: ResourceType,
        names: &[String],
        response_nonce: &str,
        error: Option<&str>,
    ) -> Verdict {
        let before = self.types.get(&t);
        let verdict = match before.and_then(|s| s.sent.as_ref()) {
            // Nothing of this type sent yet on this stream: whatever nonce the request
            // carries (one from an earlier stream, say) means nothing here.
            None => Verdict::Subscribe,
            Some(_) if response_nonce.is_empty() => Verdict::Subscribe,
            Some(sent) if sent.nonce == response_nonce => match error {
                None => Verdict::Ack {
                    version: sent.version.clone(),
                },
                Some(message) => Verdict::Nack {
                    version: sent.version.clone(),
                    message: message.to_string(),
                },
            },
            Some(_) => return Verdict::Stale,
        };
        let subscription = Subscription::from_request(t, names, before.map(|s| &s.subscription));
        let state = self.types.entry(t).or_default();
        if state.subscription != subscription || verdict == Verdict::Subscribe {
            state.must_respond = true;
        }
        state.subscription = subscription;
        match &verdict {
            Verdict::Ack { version } => {
                state.acked = Some(version.clone());
                state.nacked = None;
            }
            Verdict::Nack { version, .. } => state.nacked = Some(version.clone()),
            Verdict::Subscribe | Verdict::Stale => {}
        }
        verdict
    }

    /// Whether a response of type `t` whose contents have `version` should be sent
    /// now: the client subscribed to the type, and either asked for an answer or has
    /// not been sent these contents yet. Contents the client rejected are not sent
    /// again: they were the last sent.
    pub(crate) fn should_send(&self, t: ResourceType, version: &str) -> bool {
        self.types.get(&t).is_some_and(|s| {
            s.must_respond || s.sent.as_ref().is_none_or(|sent| sent.version != version)
        })
    }

    /// Records that a response of type `t` with `version` is being sent, and returns
    /// its nonce, unique on the stream.
    pub(crate) fn record_sent(&mut self, t: ResourceType, version: &str) -> String {
        self.nonces += 1;
        let nonce = self.nonces.to_string();
        let state = self.types.entry(t).or_default();
        state.sent = Some(Sent {
            nonce: nonce.clone(),
            version: version.to_string(),
        });
        state.must_respond = false;
        nonce
    }

    /// The state of type `t`, if the client subscribed to it.
    pub(crate) fn get(&self, t: ResourceType) -> Option<&TypeState> {
        self.types.get(&t)
    }
}
