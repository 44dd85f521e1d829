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
//! machine in [`protocol`]; the resources are built in [`resources`]; [`server`] wires
//! them to tonic and to the daemon's change notifications.

pub mod protocol;
pub mod resources;
pub mod server;

pub use server::XdsServer;

use serde::{Deserialize, Serialize};

/// The load-balancing policy the served Clusters carry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    /// `RING_HASH`: the only policy under which proxyless gRPC honours endpoint
    /// weights (with no hash policy each RPC gets a random hash).
    #[default]
    RingHash,
    /// `ROUND_ROBIN`: weighted round robin in Envoy; gRPC ignores the weights.
    RoundRobin,
    /// `LEAST_REQUEST`: Envoy's weighted least request.
    LeastRequest,
}

#[cfg(test)]
mod tests;
