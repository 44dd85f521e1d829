//! Envoy's own validation rules (its protos' `validate` annotations) on the clusters and
//! assignments Ballast generates.

use super::*;
use crate::feed::xds::resources::{cluster, load_assignment, split_assignment};
use crate::feed::xds::LbPolicy;
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{address, socket_address, ApiVersion};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use std::collections::BTreeMap;

/// Envoy's API protos as the `envoy-types` crate ships them
/// (`proto/data-plane-api/envoy`), found in Cargo's registry at the version
/// `Cargo.lock` pins; `None` if the crate's sources are elsewhere (vendored).
fn envoy_protos() -> Option<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).ok()?;
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"envoy-types\""))?
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))?
        .trim_end_matches('"')
        .to_string();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))?;
    std::fs::read_dir(cargo_home.join("registry/src"))
        .ok()?
        .filter_map(Result::ok)
        .map(|d| {
            d.path()
                .join(format!("envoy-types-{version}/proto/data-plane-api/envoy"))
        })
        .find(|p| p.is_dir())
}

/// Whitespace collapsed to single spaces and comment markers dropped, to compare
/// declarations and comments that run over several lines.
fn squeeze(text: &str) -> String {
    text.replace("//", " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// One protoc-gen-validate rule of Envoy's API on a field Ballast sets: where it is
/// declared, the declaration, and whether a resource keeps it.
struct Rule {
    file: &'static str,
    declaration: &'static str,
    what: String,
    holds: bool,
}

fn rule(file: &'static str, declaration: &'static str, what: String, holds: bool) -> Rule {
    Rule {
        file,
        declaration,
        what,
        holds,
    }
}

/// The rules Envoy's `validate` annotations put on the fields Ballast sets in a
/// Cluster, checked on `c`.
fn cluster_rules(c: &Cluster) -> Vec<Rule> {
    const CDS: &str = "config/cluster/v3/cluster.proto";
    const SRC: &str = "config/core/v3/config_source.proto";
    const RING_MAX: u64 = 8_388_608;
    let mut rules = vec![
        rule(
            CDS,
            "string name = 1 [(validate.rules).string = {min_len: 1}];",
            format!("name {:?}", c.name),
            !c.name.is_empty(),
        ),
        rule(
            CDS,
            "DiscoveryType type = 2 [(validate.rules).enum = {defined_only: true}];",
            format!("type {:?}", c.cluster_discovery_type),
            matches!(c.cluster_discovery_type,
                Some(cluster::ClusterDiscoveryType::Type(t)) if cluster::DiscoveryType::try_from(t).is_ok()),
        ),
        rule(
            CDS,
            "LbPolicy lb_policy = 6 [(validate.rules).enum = {defined_only: true}];",
            format!("lb_policy {}", c.lb_policy),
            cluster::LbPolicy::try_from(c.lb_policy).is_ok(),
        ),
        rule(
            CDS,
            "google.protobuf.Duration connect_timeout = 4 [(validate.rules).duration = {gt {}}];",
            format!("connect_timeout {:?}", c.connect_timeout),
            c.connect_timeout
                .as_ref()
                .is_none_or(|d| d.seconds > 0 || (d.seconds == 0 && d.nanos > 0)),
        ),
    ];
    let eds = c.eds_cluster_config.clone().unwrap_or_default();
    let src = eds.eds_config.unwrap_or_default();
    rules.push(rule(
        SRC,
        "oneof config_source_specifier { option (validate.required) = true;",
        format!("eds_config {:?}", src.config_source_specifier),
        src.config_source_specifier.is_some(),
    ));
    rules.push(rule(
        SRC,
        "ApiVersion resource_api_version = 6 [(validate.rules).enum = {defined_only: true}];",
        format!("resource_api_version {}", src.resource_api_version),
        ApiVersion::try_from(src.resource_api_version).is_ok(),
    ));
    if let Some(cluster::LbConfig::RingHashLbConfig(rh)) = &c.lb_config {
        let min = rh.minimum_ring_size.as_ref().map(|v| v.value);
        let max = rh.maximum_ring_size.as_ref().map(|v| v.value);
        rules.push(rule(
            CDS,
            "google.protobuf.UInt64Value minimum_ring_size = 1 [(validate.rules).uint64 = {lte: 8388608}];",
            format!("minimum_ring_size {min:?}"),
            min.is_none_or(|v| v <= RING_MAX),
        ));
        rules.push(rule(
            CDS,
            "google.protobuf.UInt64Value maximum_ring_size = 4 [(validate.rules).uint64 = {lte: 8388608}];",
            format!("maximum_ring_size {max:?}"),
            max.is_none_or(|v| v <= RING_MAX),
        ));
        rules.push(rule(
            CDS,
            "HashFunction hash_function = 3 [(validate.rules).enum = {defined_only: true}];",
            format!("hash_function {}", rh.hash_function),
            cluster::ring_hash_lb_config::HashFunction::try_from(rh.hash_function).is_ok(),
        ));
        // Not a `validate` rule but Envoy's own check when it builds the ring
        // (minimum_ring_size > maximum_ring_size is rejected); the proto's comment
        // says the two bound each other.
        rules.push(rule(
            CDS,
            "See also :ref:`maximum_ring_size<envoy_v3_api_field_config.cluster.v3.Cluster.RingHashLbConfig.maximum_ring_size>`.",
            format!("minimum_ring_size {min:?} <= maximum_ring_size {max:?}"),
            min.unwrap_or(1024) <= max.unwrap_or(RING_MAX),
        ));
        // "Specifying ring_hash_lb_config ... without setting the corresponding
        // LbPolicy will generate an error at runtime."
        rules.push(rule(
            CDS,
            "Specifying ring_hash_lb_config or maglev_lb_config or least_request_lb_config without setting the corresponding",
            format!("ring_hash_lb_config with lb_policy {}", c.lb_policy),
            c.lb_policy == cluster::LbPolicy::RingHash as i32,
        ));
    }
    rules
}

/// The rules on the fields Ballast sets in a ClusterLoadAssignment, checked on `cla`.
fn assignment_rules(cla: &ClusterLoadAssignment) -> Vec<Rule> {
    const EDS: &str = "config/endpoint/v3/endpoint.proto";
    const PARTS: &str = "config/endpoint/v3/endpoint_components.proto";
    const ADDR: &str = "config/core/v3/address.proto";
    let mut rules = vec![rule(
        EDS,
        "string cluster_name = 1 [(validate.rules).string = {min_len: 1}];",
        format!("cluster_name {:?}", cla.cluster_name),
        !cla.cluster_name.is_empty(),
    )];
    let mut total: u64 = 0;
    for l in &cla.endpoints {
        let lw = l.load_balancing_weight.as_ref().map(|w| w.value);
        rules.push(rule(
            PARTS,
            "google.protobuf.UInt32Value load_balancing_weight = 3 [(validate.rules).uint32 = {gte: 1}];",
            format!("locality {:?} weight {lw:?}", l.locality),
            lw.is_none_or(|w| w >= 1),
        ));
        rules.push(rule(
            PARTS,
            "uint32 priority = 5 [(validate.rules).uint32 = {lte: 128}];",
            format!("priority {}", l.priority),
            l.priority <= 128,
        ));
        for e in &l.lb_endpoints {
            let w = e.load_balancing_weight.as_ref().map(|w| w.value);
            total += u64::from(w.unwrap_or(1));
            rules.push(rule(
                PARTS,
                "google.protobuf.UInt32Value load_balancing_weight = 4 [(validate.rules).uint32 = {gte: 1}];",
                format!("endpoint weight {w:?}"),
                w.is_none_or(|w| w >= 1),
            ));
            let sa = match &e.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => ep
                    .address
                    .as_ref()
                    .and_then(|a| a.address.as_ref())
                    .and_then(|a| match a {
                        address::Address::SocketAddress(sa) => Some(sa.clone()),
                        _ => None,
                    }),
                _ => None,
            }
            .unwrap_or_default();
            rules.push(rule(
                ADDR,
                "string address = 2 [(validate.rules).string = {min_len: 1}];",
                format!("address {:?}", sa.address),
                !sa.address.is_empty(),
            ));
            let port = match sa.port_specifier {
                Some(socket_address::PortSpecifier::PortValue(p)) => Some(p),
                _ => None,
            };
            rules.push(rule(
                ADDR,
                "oneof port_specifier { option (validate.required) = true; uint32 port_value = 3 [(validate.rules).uint32 = {lte: 65535}];",
                format!("port {port:?}"),
                port.is_some_and(|p| p <= 65535),
            ));
        }
    }
    // Envoy and gRPC both reject a priority whose endpoint weights add up past
    // 2^32 - 1 (grpc-js-xds: "priority 0 has total weight greater than UINT32_MAX").
    rules.push(rule(
        PARTS,
        "google.protobuf.UInt32Value load_balancing_weight = 4",
        format!("sum of endpoint weights {total}"),
        total <= u64::from(u32::MAX),
    ));
    rules
}

#[test]
fn generated_clusters_and_assignments_keep_envoys_validation_rules() {
    let mut eps = zoned_endpoints();
    eps.push(ep("d", "10.0.0.9:8080", "zone_2", 0.0, true));
    let mut rules = Vec::new();
    for policy in [
        LbPolicy::RingHash,
        LbPolicy::RoundRobin,
        LbPolicy::LeastRequest,
    ] {
        for weighted in [false, true] {
            rules.extend(cluster_rules(&cluster("web", policy, weighted)));
        }
    }
    rules.extend(assignment_rules(&load_assignment("web", &eps)));
    for shares in seed_split().values() {
        let cla = split_assignment("web", &eps, shares).expect("a split assignment");
        rules.extend(assignment_rules(&cla));
    }
    let broken: Vec<String> = rules
        .iter()
        .filter(|r| !r.holds)
        .map(|r| format!("{}: {} breaks `{}`", r.file, r.what, r.declaration))
        .collect();
    assert!(broken.is_empty(), "{broken:#?}");

    // The rules above are copied from the protos; check the copies against the
    // protos themselves when their sources are at hand.
    let Some(protos) = envoy_protos() else {
        eprintln!("envoy-types' protos not found in Cargo's registry: rules not re-read");
        return;
    };
    let mut texts: BTreeMap<&str, String> = BTreeMap::new();
    for r in &rules {
        let text = texts.entry(r.file).or_insert_with(|| {
            squeeze(&std::fs::read_to_string(protos.join(r.file)).expect("proto file"))
        });
        assert!(
            text.contains(&squeeze(r.declaration)),
            "{} no longer declares `{}`: update the rule",
            r.file,
            r.declaration
        );
    }
}
