//! Entry points for the fuzz targets in `fuzz/`: the parsers and machines of untrusted
//! input that are private to this crate, behind thin public wrappers. Not a stable
//! API; nothing in the aggregator calls it.

use crate::config::dir::{DirError, Merged};
use crate::feed::xds::protocol::{Sent, StreamState, Verdict};
use crate::feed::xds::resources::ResourceType;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use std::collections::BTreeSet;
use std::path::Path;

/// Reads a persisted merged service config (`services.json`) or a backup, with the
/// checks the aggregator applies when it starts.
pub fn services_file(path: &Path) -> Result<Merged, DirError> {
    crate::config::dir::load_merged(path)
}

/// What the protocol machine made of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XdsVerdict {
    /// A type this server does not serve: ignored.
    Ignored,
    /// A (re)subscription.
    Subscribe,
    /// The client accepted the response with this version.
    Ack(String),
    /// The client rejected the response with this version.
    Nack(String),
    /// It answers a superseded response: ignored.
    Stale,
}

/// One type's protocol state on a stream, as far as it can be seen from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsTypeView {
    /// The subscription is a wildcard.
    pub wildcard: bool,
    /// The names subscribed to explicitly.
    pub names: BTreeSet<String>,
    /// The last response sent.
    pub sent: Option<Sent>,
    /// The last version accepted.
    pub acked: Option<String>,
    /// The last version rejected, while no later one was accepted.
    pub nacked: Option<String>,
}

/// The request side of one ADS stream without its transport: the protocol machine,
/// and the client's zone taken from the first request that names a node.
#[derive(Debug, Default)]
pub struct XdsStream {
    protocol: StreamState,
    zone: Option<String>,
}

impl XdsStream {
    /// A new stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies a request as the ADS server does.
    pub fn request(&mut self, req: &DiscoveryRequest) -> XdsVerdict {
        if self.zone.is_none() {
            if let Some(node) = &req.node {
                let zone = node.locality.as_ref().map_or("", |l| l.zone.as_str());
                self.zone = Some(zone.to_string());
            }
        }
        let Some(t) = ResourceType::from_type_url(&req.type_url) else {
            return XdsVerdict::Ignored;
        };
        let error = req.error_detail.as_ref().map(|e| e.message.as_str());
        match self
            .protocol
            .on_request(t, &req.resource_names, &req.response_nonce, error)
        {
            Verdict::Subscribe => XdsVerdict::Subscribe,
            Verdict::Ack { version } => XdsVerdict::Ack(version),
            Verdict::Nack { version, .. } => XdsVerdict::Nack(version),
            Verdict::Stale => XdsVerdict::Stale,
        }
    }

    /// The client's zone; empty until a request names a node with one.
    pub fn zone(&self) -> &str {
        self.zone.as_deref().unwrap_or("")
    }

    /// The state of type `t`, once the client subscribed to it.
    pub fn view(&self, t: ResourceType) -> Option<XdsTypeView> {
        self.protocol.get(t).map(|s| XdsTypeView {
            wildcard: s.subscription.wildcard,
            names: s.subscription.names.clone(),
            sent: s.sent.clone(),
            acked: s.acked.clone(),
            nacked: s.nacked.clone(),
        })
    }

    /// Whether contents of type `t` with `version` are to be sent now.
    pub fn should_send(&self, t: ResourceType, version: &str) -> bool {
        self.protocol.should_send(t, version)
    }

    /// Records a response of type `t` with `version` as sent; its nonce.
    pub fn record_sent(&mut self, t: ResourceType, version: &str) -> String {
        self.protocol.record_sent(t, version)
    }
}
