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

#[cfg(test)]
mod tests;
