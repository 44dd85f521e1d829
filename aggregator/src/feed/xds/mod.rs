//! The xDS feed: an Aggregated Discovery Service (ADS, state of the world) that hands
//! the published weights to Envoy and to proxyless gRPC clients.
//!
//! For every service `S` it serves the chain a proxyless gRPC client walks for the
//! target `xds:///S` (gRFC A27):
//!
//! | type | name | contents |
//! | --- | --- | --- |
//! | Listener | `S` | an `api_listener` whose HttpConnectionManager fetches RDS `S` over ADS |
//! | RouteConfiguration | `S` | one virtual host, domains `*`, prefix `""` → cluster `S` |
//! | Cluster | `S` | type EDS over ADS, with the configured load-balancing policy |
//! | ClusterLoadAssignment | `S` | one locality per zone; each endpoint weighted, DRAINING when drained |
//!
//! Envoy needs only the Cluster and the ClusterLoadAssignment.
//!
//! # Locality
//!
//! When a service's config splits a client zone's traffic across destination zones
//! (`[locality.zone_2]` with `zone_2 = 50`, `zone_1 = 50`), clients whose xDS node
//! names that zone (`node.locality.zone`) get a ClusterLoadAssignment of their own:
//! one locality per destination zone with a share, weighted by it, and within each
//! the balancer's weights. Other clients get the default, every zone at weight 1. A
//! config reload pushes new assignments to the affected zones' streams only. See
//! [`resources`] for how the weights are chosen so that gRPC's RING_HASH honours them.
//!
//! # Which load-balancing policy for which client
//!
//! - **Proxyless gRPC: `ring_hash`** (the default). gRPC's `round_robin` ignores endpoint
//!   weights; under `RING_HASH` with no hash policy on the route, every RPC gets a
//!   random hash (gRFC A42), so calls split in proportion to the endpoint weights.
//! - **Envoy: `round_robin` or `least_request`.** Envoy honours endpoint weights in
//!   both; under least request with weights it picks by `weight / (active + 1)^bias`
//!   rather than by the power of two choices.
//!
//! The protocol bookkeeping (subscriptions, nonces, ACK and NACK) is the pure state
//! machine in [`protocol`]; the resources are built in [`resources`] from what each
//! cycle publishes ([`ballast_balance::Published`]); [`server`] wires them to tonic
//! and to the publications, and sends each stream the newest contents when its client
//! can take them, never a queue of versions.

pub mod conn;
pub mod protocol;
pub mod resources;
pub mod server;

pub use conn::XdsTls;
pub use server::XdsServer;

/// The configured policy, as the Clusters carry it; the config owns the setting.
pub use crate::config::LbPolicy;

use crate::metrics::XdsMetrics;
use ballast_balance::Published;
use std::sync::Arc;
use tokio::sync::watch;

/// What the feed is given of the daemon, and nothing more: the cycle's publications,
/// its own limits and its own counters.
pub struct Inputs {
    /// The cycle's publications; the feed serves the latest.
    pub publications: watch::Receiver<Arc<Published>>,
    /// How much its clients may make it hold.
    pub limits: XdsLimits,
    /// Its counters.
    pub metrics: Arc<XdsMetrics>,
}

/// How much xDS clients may make the feed hold: the `xds_max_*` settings of the
/// config's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XdsLimits {
    /// Open streams in all; more are refused with `RESOURCE_EXHAUSTED`.
    pub max_streams: usize,
    /// Open streams from one source address.
    pub max_streams_per_source: usize,
    /// TCP connections to the listener in all; more are closed at once, before any
    /// TLS.
    pub max_connections: usize,
    /// TCP connections to the listener from one source address.
    pub max_connections_per_source: usize,
    /// Concurrent HTTP/2 streams on one connection.
    pub max_streams_per_connection: u32,
    /// The largest request accepted, in bytes.
    pub max_request_bytes: usize,
    /// The most resource names one request may subscribe to.
    pub max_resource_names: usize,
    /// The most resource names one stream may keep subscribed, over all types.
    pub max_names_per_stream: usize,
    /// The most bytes one stream may keep for its subscriptions and its client's node.
    pub max_stream_bytes: usize,
    /// The longest `node.id`, and the longest `node.locality.zone`, in bytes.
    pub max_node_bytes: usize,
}

impl From<&crate::config::limits::Limits> for XdsLimits {
    fn from(l: &crate::config::limits::Limits) -> Self {
        XdsLimits {
            max_streams: l.xds_max_streams,
            max_streams_per_source: l.xds_max_streams_per_source,
            max_connections: l.xds_max_connections,
            max_connections_per_source: l.xds_max_connections_per_source,
            max_streams_per_connection: l.xds_max_streams_per_connection,
            max_request_bytes: l.xds_max_request_bytes,
            max_resource_names: l.xds_max_resource_names,
            max_names_per_stream: l.xds_max_names_per_stream,
            max_stream_bytes: l.xds_max_stream_bytes,
            max_node_bytes: l.xds_max_node_bytes,
        }
    }
}

impl Default for XdsLimits {
    fn default() -> Self {
        XdsLimits::from(&crate::config::limits::Limits::default())
    }
}

#[cfg(test)]
mod tests;
