//! Tests of the xDS feed: the resource builders, the protocol state machine, and the
//! server over a real socket with a tonic ADS client (ACK, NACK, stale nonces, many
//! clients, pushes on change, shutdown), one file per subject: `eds`, `cds_lds_rds`,
//! `snapshot`, `locality`, `validation` (Envoy's own rules), `acks_nacks`,
//! `backpressure` (a stalled client), `limits`; `harness` is the server and client the
//! socket tests share, and this file the helpers the others share.

mod acks_nacks;
mod backpressure;
mod cds_lds_rds;
mod eds;
mod harness;
mod limits;
mod locality;
mod snapshot;
mod validation;

use crate::config::locality::{Localities, LocalitySplit};
use crate::feed::xds::resources::{EndpointInput, ResourceType};
use ballast_balance::{Balancer, Published};
use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use std::collections::BTreeSet;

fn ep(node: &str, address: &str, zone: &str, weight: f64, draining: bool) -> EndpointInput {
    EndpointInput {
        node: node.to_string(),
        address: address.to_string(),
        zone: zone.to_string(),
        weight,
        draining,
    }
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn set(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// (zone, ip, port, weight, health) of every endpoint, in order.
fn flatten(cla: &ClusterLoadAssignment) -> Vec<(String, String, u32, u32, i32)> {
    let mut out = Vec::new();
    for loc in &cla.endpoints {
        let zone = loc
            .locality
            .as_ref()
            .map(|l| l.zone.clone())
            .unwrap_or_default();
        for lb in &loc.lb_endpoints {
            let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &lb.host_identifier else {
                panic!("endpoint without an address: {lb:?}");
            };
            let Some(address::Address::SocketAddress(sa)) =
                e.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                panic!("not a socket address: {e:?}");
            };
            let Some(socket_address::PortSpecifier::PortValue(port)) = sa.port_specifier else {
                panic!("no port: {sa:?}");
            };
            let weight = lb.load_balancing_weight.map(|w| w.value).unwrap_or(0);
            out.push((
                zone.clone(),
                sa.address.clone(),
                port,
                weight,
                lb.health_status,
            ));
        }
    }
    out
}

/// The seed's example: clients in zone_1 stay there; clients in zone_2 split evenly.
fn seed_split() -> LocalitySplit {
    toml::from_str("[zone_1]\nzone_1 = 100\n[zone_2]\nzone_2 = 50\nzone_1 = 50\n")
        .expect("split parses")
}

/// Two endpoints in zone_1 (weights 1.5 and 0.5), one in zone_2 (1.0), one without a
/// zone. Unequal counts per zone, so a split that ignored the sums would show.
fn zoned_endpoints() -> Vec<EndpointInput> {
    vec![
        ep("a", "10.0.0.1:80", "zone_1", 1.5, false),
        ep("b", "10.0.0.2:80", "zone_1", 0.5, false),
        ep("c", "10.0.0.3:80", "zone_2", 1.0, false),
        ep("d", "10.0.0.4:80", "", 1.0, false),
    ]
}

const EDS: ResourceType = ResourceType::Endpoints;

fn now_of(b: &Balancer) -> u64 {
    // Past the grace period, so that cycles may move weights.
    b.grace_until() + 1
}

/// What a cycle of every service publishes: each service of `b` afresh, under the
/// splits of `localities`.
fn publish(b: &Balancer, localities: &Localities) -> Published {
    Published::default().next(b, &BTreeSet::new(), &localities.services, now_of(b))
}
