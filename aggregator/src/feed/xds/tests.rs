//! Tests of the xDS feed: the resource builders, the protocol state machine, and the
//! server over a real socket with a tonic ADS client (ACK, NACK, stale nonces, many
//! clients, pushes on change, shutdown).

use super::protocol::{StreamState, Verdict};
use super::resources::{
    cluster, listener, load_assignment, locality_weights, parse_address, route_configuration,
    split_assignment, EndpointInput, ResourceType, ServiceResources, Snapshot,
    LOCALITY_WEIGHT_TOTAL, RING_SIZE, ZONE_WEIGHT_TOTAL,
};
use super::{Inputs, LbPolicy, XdsServer};
use crate::clock::Clock;
use crate::config::locality::{Localities, LocalitySplit};
use crate::metrics::XdsResource;
use crate::state::State;
use crate::store::file::FileStore;
use ballast_balance::{Balancer, Observation, Params, Published};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, ApiVersion, HealthStatus, Locality,
};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::{route, route_action, route_match};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager,
};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::rpc;
use prost::{Message, Name};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

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

// ---------------------------------------------------------------------------------
// Resource builders

#[test]
fn zones_become_localities_and_weights_follow_the_envoy_scale() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "10.0.0.1:80", "a", 0.5, false),
            ep("n2", "10.0.0.2:80", "b", 2.0, false),
            ep("n3", "10.0.0.3:81", "a", 1.0, false),
            ep("n4", "10.0.0.4:80", "", 1.0, false),
        ],
    );
    assert_eq!(cla.cluster_name, "web");
    let zones: Vec<&str> = cla
        .endpoints
        .iter()
        .map(|l| l.locality.as_ref().map_or("?", |l| l.zone.as_str()))
        .collect();
    assert_eq!(zones, ["", "a", "b"], "one locality per zone");
    for loc in &cla.endpoints {
        assert_eq!(loc.load_balancing_weight.map(|w| w.value), Some(1));
        assert_eq!(loc.priority, 0);
    }
    let healthy = HealthStatus::Healthy as i32;
    assert_eq!(
        flatten(&cla),
        vec![
            ("".into(), "10.0.0.4".into(), 80, 1000, healthy),
            ("a".into(), "10.0.0.1".into(), 80, 500, healthy),
            ("a".into(), "10.0.0.3".into(), 81, 1000, healthy),
            ("b".into(), "10.0.0.2".into(), 80, 2000, healthy),
        ]
    );
}

#[test]
fn draining_endpoints_are_draining_with_the_minimum_weight() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "10.0.0.1:80", "a", 0.0, true),
            ep("n2", "10.0.0.2:80", "a", 1.0, false),
        ],
    );
    let eps = flatten(&cla);
    // xDS forbids weight 0: the health status carries the drain.
    assert_eq!(eps[0].3, 1);
    assert_eq!(eps[0].4, HealthStatus::Draining as i32);
    assert_eq!(eps[1].4, HealthStatus::Healthy as i32);
}

#[test]
fn endpoints_without_an_ip_address_are_left_out() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "db.example:80", "", 1.0, false),
            ep("n2", "10.0.0.2", "", 1.0, false),
            ep("n3", "[::1]:8080", "", 1.0, false),
            ep("n4", "10.0.0.4:99999", "", 1.0, false),
        ],
    );
    let eps = flatten(&cla);
    assert_eq!(eps.len(), 1, "{eps:?}");
    assert_eq!((eps[0].1.as_str(), eps[0].2), ("::1", 8080));
}

#[test]
fn addresses_parse_as_ip_and_port() {
    assert_eq!(
        parse_address("127.0.0.1:50051"),
        Some(("127.0.0.1".parse().expect("ip"), 50051))
    );
    assert_eq!(
        parse_address("[fe80::1]:1"),
        Some(("fe80::1".parse().expect("ip"), 1))
    );
    for bad in [
        "",
        ":",
        "host:80",
        "1.2.3.4",
        "1.2.3.4:x",
        "1.2.3.4:65536",
        "[::1:80",
    ] {
        assert_eq!(parse_address(bad), None, "{bad:?}");
    }
}

#[test]
fn the_listener_fetches_its_route_over_ads_and_ends_with_the_router() {
    let l = listener("web");
    assert_eq!(l.name, "web");
    let any = l
        .api_listener
        .and_then(|a| a.api_listener)
        .expect("an api_listener");
    assert_eq!(any.type_url, HttpConnectionManager::type_url());
    let hcm = HttpConnectionManager::decode(any.value.as_slice()).expect("decodes");
    let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = hcm.route_specifier else {
        panic!("no RDS: {hcm:?}");
    };
    assert_eq!(rds.route_config_name, "web");
    let src = rds.config_source.expect("config source");
    assert!(matches!(
        src.config_source_specifier,
        Some(config_source::ConfigSourceSpecifier::Ads(_))
    ));
    let last = hcm.http_filters.last().expect("an HTTP filter");
    let Some(http_filter::ConfigType::TypedConfig(cfg)) = &last.config_type else {
        panic!("router without typed config");
    };
    assert_eq!(cfg.type_url, Router::type_url());
}

#[test]
fn the_route_sends_every_call_to_the_cluster_without_a_hash_policy() {
    let rc = route_configuration("web");
    assert_eq!(rc.name, "web");
    assert_eq!(rc.virtual_hosts.len(), 1);
    let vh = &rc.virtual_hosts[0];
    assert_eq!(vh.domains, ["*"]);
    assert_eq!(vh.routes.len(), 1);
    let r = &vh.routes[0];
    assert_eq!(
        r.r#match.as_ref().and_then(|m| m.path_specifier.clone()),
        Some(route_match::PathSpecifier::Prefix(String::new()))
    );
    let Some(route::Action::Route(action)) = &r.action else {
        panic!("not a route action");
    };
    assert_eq!(
        action.cluster_specifier,
        Some(route_action::ClusterSpecifier::Cluster("web".into()))
    );
    // A hash policy would pin calls to endpoints; none gives each call a random hash.
    assert!(action.hash_policy.is_empty());
}

#[test]
fn clusters_use_eds_over_ads_with_the_configured_policy() {
    let c = cluster("web", LbPolicy::RingHash, false);
    assert_eq!(c.name, "web");
    // Without a split, Envoy must not pick localities by their (equal) weights.
    assert!(c.common_lb_config.is_none());
    assert_eq!(
        c.cluster_discovery_type,
        Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32
        ))
    );
    let eds = c.eds_cluster_config.expect("EDS config");
    assert_eq!(eds.service_name, "web");
    assert!(matches!(
        eds.eds_config.and_then(|s| s.config_source_specifier),
        Some(config_source::ConfigSourceSpecifier::Ads(_))
    ));
    assert_eq!(c.lb_policy, cluster::LbPolicy::RingHash as i32);
    let Some(cluster::LbConfig::RingHashLbConfig(rh)) = c.lb_config else {
        panic!("no ring hash config");
    };
    assert_eq!(rh.minimum_ring_size.map(|v| v.value), Some(RING_SIZE));
    let rr = cluster("web", LbPolicy::RoundRobin, false);
    assert_eq!(rr.lb_policy, cluster::LbPolicy::RoundRobin as i32);
    assert!(rr.lb_config.is_none());
    let lr = cluster("web", LbPolicy::LeastRequest, false);
    assert_eq!(lr.lb_policy, cluster::LbPolicy::LeastRequest as i32);
}

#[test]
fn lb_policy_reads_from_the_config_file() {
    let cfg = crate::config::Config::parse(
        "xds = \"127.0.0.1:7402\"\nxds_lb_policy = \"least_request\"\n",
        "t",
    )
    .expect("parses");
    assert_eq!(cfg.xds, Some("127.0.0.1:7402".parse().expect("addr")));
    assert_eq!(cfg.xds_lb_policy, LbPolicy::LeastRequest);
    let cfg = crate::config::Config::parse("", "t").expect("parses");
    assert_eq!((cfg.xds, cfg.xds_lb_policy), (None, LbPolicy::RingHash));
    assert!(crate::config::Config::parse("xds_lb_policy = \"maglev\"\n", "t").is_err());
}

#[test]
fn type_urls_round_trip() {
    for t in ResourceType::ALL {
        assert_eq!(ResourceType::from_type_url(t.type_url()), Some(t));
    }
    assert_eq!(ResourceType::Listener.type_url(), Listener::type_url());
    assert_eq!(
        ResourceType::Route.type_url(),
        envoy_types::pb::envoy::config::route::v3::RouteConfiguration::type_url()
    );
    assert_eq!(
        ResourceType::Cluster.type_url(),
        envoy_types::pb::envoy::config::cluster::v3::Cluster::type_url()
    );
    assert_eq!(
        ResourceType::Endpoints.type_url(),
        ClusterLoadAssignment::type_url()
    );
    assert_eq!(
        ResourceType::from_type_url("type.googleapis.com/envoy.config.listener.v3.Listener"),
        Some(ResourceType::Listener)
    );
    assert_eq!(ResourceType::from_type_url("type.googleapis.com/x.Y"), None);
    assert_eq!(ResourceType::from_type_url(""), None);
}

fn two_services(web_weight: f64) -> Snapshot {
    let web = ServiceResources::build(
        "web",
        1,
        LbPolicy::RingHash,
        &[
            ep("w1", "10.0.0.1:80", "", web_weight, false),
            ep("w2", "10.0.0.2:80", "", 1.0, false),
        ],
        None,
    );
    let api = ServiceResources::build(
        "api",
        1,
        LbPolicy::RingHash,
        &[ep("a1", "10.0.1.1:80", "", 1.0, false)],
        None,
    );
    Snapshot::from_services([("web".to_string(), web), ("api".to_string(), api)])
}

#[test]
fn selections_carry_what_was_asked_and_versions_follow_contents() {
    let snap = two_services(1.0);
    let all = snap.select(ResourceType::Listener, true, &set(&[]), "");
    let got: Vec<String> = all
        .resources
        .iter()
        .map(|a| Listener::decode(a.value.as_slice()).expect("listener").name)
        .collect();
    assert_eq!(got, ["api", "web"]);

    let web = snap.select(ResourceType::Endpoints, false, &set(&["web", "nope"]), "");
    assert_eq!(web.resources.len(), 1, "unknown names are left out");
    assert_eq!(
        snap.select(ResourceType::Endpoints, false, &set(&["nope"]), "")
            .resources
            .len(),
        0
    );

    // The same contents have the same version; other contents another.
    let again = two_services(1.0).select(ResourceType::Endpoints, false, &set(&["web"]), "");
    assert_eq!(again.version, web.version);
    let moved = two_services(1.5).select(ResourceType::Endpoints, false, &set(&["web"]), "");
    assert_ne!(moved.version, web.version);
    // A weight change is not a listener change.
    assert_eq!(
        two_services(1.5)
            .select(ResourceType::Listener, true, &set(&[]), "")
            .version,
        all.version
    );
    assert!(two_services(1.0).same_as(&snap));
    assert!(!two_services(1.5).same_as(&snap));
}

fn now_of(b: &Balancer) -> u64 {
    // Past the grace period, so that cycles may move weights.
    b.grace_until() + 1
}

/// What a cycle of every service publishes: each service of `b` afresh, under the
/// splits of `localities`.
fn publish(b: &Balancer, localities: &Localities) -> Published {
    Published::default().next(b, &BTreeSet::new(), &localities.services, now_of(b))
}

#[test]
fn snapshots_keep_services_whose_version_and_addresses_did_not_change() {
    let mut b = Balancer::new(Params::default(), 0);
    let now = now_of(&b);
    b.register(now, "web", "w1", "127.0.0.1:1", "a")
        .expect("register");
    b.register(now, "web", "w2", "127.0.0.1:2", "a")
        .expect("register");
    b.cycle(now);
    let v1 = b.service("web").expect("web").version;
    let s1 = Snapshot::prepare(&publish(&b, &Localities::default()), &Snapshot::default())
        .finish(LbPolicy::RingHash);
    assert_eq!(s1.service("web").map(|s| s.version), Some(v1));

    let s2 =
        Snapshot::prepare(&publish(&b, &Localities::default()), &s1).finish(LbPolicy::RingHash);
    assert!(s2.same_as(&s1));
    assert!(std::ptr::eq(
        s1.service("web").expect("web"),
        s2.service("web").expect("web")
    ));

    // A re-registration at a new address changes no weight but must reach clients.
    b.register(now, "web", "w2", "127.0.0.1:3", "a")
        .expect("register");
    let s3 =
        Snapshot::prepare(&publish(&b, &Localities::default()), &s2).finish(LbPolicy::RingHash);
    assert!(!s3.same_as(&s2));

    // A drain bumps the version: a new assignment with the endpoint DRAINING.
    let obs = Observation {
        draining: true,
        ..Observation::default()
    };
    b.observe(now, "web", "w1", obs).expect("observe");
    b.cycle(now + 1);
    assert!(b.service("web").expect("web").version > v1);
    let s4 =
        Snapshot::prepare(&publish(&b, &Localities::default()), &s3).finish(LbPolicy::RingHash);
    let sel = s4.select(ResourceType::Endpoints, false, &set(&["web"]), "");
    let cla = ClusterLoadAssignment::decode(sel.resources[0].value.as_slice()).expect("cla");
    let health: Vec<i32> = flatten(&cla).iter().map(|e| e.4).collect();
    assert_eq!(
        health,
        [HealthStatus::Draining as i32, HealthStatus::Healthy as i32]
    );
}

// ---------------------------------------------------------------------------------
// Locality splits

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

/// Each zone's share of the calls under gRPC's RING_HASH, which weighs every endpoint
/// by locality weight × endpoint weight (gRFC A42), and under a locality-first picker
/// (gRPC's weighted_target, gRFC A27), which picks a locality by its weight. DRAINING
/// endpoints get nothing in either.
fn zone_shares(cla: &ClusterLoadAssignment) -> (BTreeMap<String, f64>, BTreeMap<String, f64>) {
    let mut ring: BTreeMap<String, f64> = BTreeMap::new();
    let mut first: BTreeMap<String, f64> = BTreeMap::new();
    for loc in &cla.endpoints {
        let zone = loc
            .locality
            .as_ref()
            .map(|l| l.zone.clone())
            .unwrap_or_default();
        let lw = f64::from(loc.load_balancing_weight.map_or(0, |w| w.value));
        let serving: f64 = loc
            .lb_endpoints
            .iter()
            .filter(|e| e.health_status == HealthStatus::Healthy as i32)
            .map(|e| f64::from(e.load_balancing_weight.map_or(1, |w| w.value)))
            .sum();
        *ring.entry(zone.clone()).or_default() += lw * serving;
        *first.entry(zone).or_default() += lw;
    }
    for m in [&mut ring, &mut first] {
        let total: f64 = m.values().sum();
        m.values_mut().for_each(|v| *v /= total);
    }
    (ring, first)
}

#[test]
fn a_split_gives_each_destination_zone_its_share_under_ring_hash_and_locality_picking() {
    let eps = zoned_endpoints();
    let split = seed_split();

    let z2 = split_assignment("web", &eps, &split["zone_2"]).expect("zone_2 has endpoints");
    let (ring, first) = zone_shares(&z2);
    assert_eq!(
        first,
        BTreeMap::from([("zone_1".into(), 0.5), ("zone_2".into(), 0.5)])
    );
    for zone in ["zone_1", "zone_2"] {
        assert!((ring[zone] - 0.5).abs() < 1e-4, "{zone}: {ring:?}");
    }
    // 50/50 is served as 1/1; inside zone_1 the balancer's 3:1 holds, the zone's
    // weights adding up to the common total.
    let flat = flatten(&z2);
    assert_eq!(
        flat.iter()
            .map(|e| (e.0.as_str(), e.1.as_str(), e.3))
            .collect::<Vec<_>>(),
        [
            ("zone_1", "10.0.0.1", 75_000),
            ("zone_1", "10.0.0.2", 25_000),
            ("zone_2", "10.0.0.3", ZONE_WEIGHT_TOTAL),
        ]
    );
    assert!(z2
        .endpoints
        .iter()
        .all(|l| l.load_balancing_weight.map(|w| w.value) == Some(1)));

    // zone_1 keeps everything at home: zone_2 and the zoneless endpoint are absent.
    let z1 = split_assignment("web", &eps, &split["zone_1"]).expect("zone_1 has endpoints");
    let (ring, _) = zone_shares(&z1);
    assert_eq!(ring.keys().collect::<Vec<_>>(), ["zone_1"]);
    assert_eq!(flatten(&z1).len(), 2);

    // 1:3, with three endpoints on one side and one on the other.
    let mut eps3 = eps.clone();
    eps3.push(ep("e", "10.0.0.5:80", "zone_1", 1.0, false));
    let shares = BTreeMap::from([("zone_1".to_string(), 10), ("zone_2".to_string(), 30)]);
    let cla = split_assignment("web", &eps3, &shares).expect("endpoints");
    let (ring, first) = zone_shares(&cla);
    assert!((ring["zone_1"] - 0.25).abs() < 1e-4, "{ring:?}");
    assert!((first["zone_1"] - 0.25).abs() < 1e-9, "{first:?}");
}

#[test]
fn zones_at_zero_absent_or_all_draining_get_nothing_and_an_empty_split_falls_back() {
    let mut eps = zoned_endpoints();
    // A share of 0 and a zone nobody is in are left out; the rest is still served.
    let shares = BTreeMap::from([
        ("zone_1".to_string(), 0),
        ("zone_2".to_string(), 5),
        ("zone_9".to_string(), 5),
    ]);
    let cla = split_assignment("web", &eps, &shares).expect("zone_2 has an endpoint");
    assert_eq!(
        flatten(&cla)
            .iter()
            .map(|e| e.1.as_str())
            .collect::<Vec<_>>(),
        ["10.0.0.3"]
    );

    // zone_2's only endpoint drains: nothing in the split can serve, so no
    // assignment of its own (the snapshot then serves the default).
    eps[2].draining = true;
    assert_eq!(split_assignment("web", &eps, &shares), None);
    // With zone_1 in the split too, zone_1 takes everything; zone_2, with nothing
    // left to serve, has no locality.
    let shares = BTreeMap::from([("zone_1".to_string(), 1), ("zone_2".to_string(), 1)]);
    let cla = split_assignment("web", &eps, &shares).expect("zone_1 serves");
    let (ring, _) = zone_shares(&cla);
    assert_eq!(ring.keys().collect::<Vec<_>>(), ["zone_1"]);
    // A draining endpoint beside serving ones stays, DRAINING at weight 1, and the
    // serving ones share the zone's total.
    eps[0].draining = true;
    let cla = split_assignment("web", &eps, &shares).expect("b serves");
    assert_eq!(
        flatten(&cla),
        [
            (
                "zone_1".into(),
                "10.0.0.1".into(),
                80,
                1,
                HealthStatus::Draining as i32
            ),
            (
                "zone_1".into(),
                "10.0.0.2".into(),
                80,
                ZONE_WEIGHT_TOTAL,
                HealthStatus::Healthy as i32
            ),
        ]
    );
    // Endpoints whose address is not an IP are not there to serve.
    let named = [ep("n", "web-1:80", "zone_1", 1.0, false)];
    assert_eq!(split_assignment("web", &named, &shares), None);
}

#[test]
fn locality_weights_are_reduced_and_bounded() {
    let w = |pairs: &[(&'static str, u32)]| locality_weights(&pairs.iter().copied().collect());
    assert_eq!(
        w(&[("a", 50), ("b", 50)]),
        BTreeMap::from([("a".into(), 1), ("b".into(), 1)])
    );
    assert_eq!(w(&[("a", 100)]), BTreeMap::from([("a".into(), 1)]));
    assert_eq!(
        w(&[("a", 30), ("b", 70)]),
        BTreeMap::from([("a".into(), 3), ("b".into(), 7)])
    );
    // Coprime and large: scaled to the total, the smallest kept at 1.
    let big = w(&[("a", 1_000_000), ("b", 999_999), ("c", 1)]);
    assert!(
        big.values().sum::<u32>() <= LOCALITY_WEIGHT_TOTAL + 3,
        "{big:?}"
    );
    assert_eq!(big["c"], 1);
    assert_eq!(big["a"], 5000);
    // gRPC multiplies locality and endpoint weights in 32 bits: the largest product
    // must stay below 2^31.
    let worst = u64::from(LOCALITY_WEIGHT_TOTAL + 3) * u64::from(ZONE_WEIGHT_TOTAL);
    assert!(worst < 1 << 31, "{worst}");
}

fn web_with(split: Option<&LocalitySplit>, eps: &[EndpointInput]) -> Snapshot {
    let web = ServiceResources::build("web", 1, LbPolicy::RingHash, eps, split);
    Snapshot::from_services([("web".to_string(), web)])
}

#[test]
fn each_client_zone_selects_its_assignment_and_versions_follow_its_split() {
    let eps = zoned_endpoints();
    let split = seed_split();
    let snap = web_with(Some(&split), &eps);
    let web = set(&["web"]);
    let sel = |snap: &Snapshot, zone: &str| snap.select(ResourceType::Endpoints, false, &web, zone);
    let cla = |s: &super::resources::Selection| {
        ClusterLoadAssignment::decode(s.resources[0].value.as_slice()).expect("cla")
    };

    let z1 = sel(&snap, "zone_1");
    let z2 = sel(&snap, "zone_2");
    let other = sel(&snap, "zone_3");
    let none = sel(&snap, "");
    assert_eq!(
        zone_shares(&cla(&z1)).0.keys().collect::<Vec<_>>(),
        ["zone_1"]
    );
    assert_eq!(zone_shares(&cla(&z2)).0.len(), 2);
    // Zones without a split, and clients without a zone, get the default: every zone,
    // locality weights 1, the balancer's weights on the Envoy scale.
    assert_eq!(cla(&other), load_assignment("web", &eps));
    assert_eq!(other.version, none.version);
    assert_eq!(
        other.version,
        web_with(None, &eps)
            .select(ResourceType::Endpoints, false, &web, "zone_1")
            .version
    );
    let versions: BTreeSet<&str> = [&z1, &z2, &other]
        .iter()
        .map(|s| s.version.as_str())
        .collect();
    assert_eq!(versions.len(), 3, "three contents, three versions");
    // Listeners and routes are the same for everyone; the Cluster is locality
    // weighted for the zones with a split assignment of their own (for Envoy), plain
    // for the others.
    for t in [ResourceType::Listener, ResourceType::Route] {
        assert_eq!(
            snap.select(t, true, &set(&[]), "zone_1"),
            snap.select(t, true, &set(&[]), "zone_3")
        );
    }
    let cds =
        |snap: &Snapshot, zone: &str| snap.select(ResourceType::Cluster, true, &set(&[]), zone);
    assert_eq!(cds(&snap, "zone_1"), cds(&snap, "zone_2"));
    assert_ne!(cds(&snap, "zone_1").version, cds(&snap, "zone_3").version);
    assert_eq!(cds(&snap, "zone_3"), cds(&snap, ""));
    assert_eq!(cds(&snap, "zone_3"), cds(&web_with(None, &eps), "zone_1"));

    // Failing zone_1 over changes zone_1's version and nobody else's.
    let mut failover = split.clone();
    failover.insert(
        "zone_1".into(),
        BTreeMap::from([("zone_2".to_string(), 100)]),
    );
    let after = web_with(Some(&failover), &eps);
    assert!(!after.same_as(&snap));
    assert_ne!(sel(&after, "zone_1").version, z1.version);
    assert_eq!(sel(&after, "zone_2").version, z2.version);
    assert_eq!(sel(&after, "zone_3").version, other.version);
    assert_eq!(
        flatten(&cla(&sel(&after, "zone_1")))
            .iter()
            .map(|e| e.1.as_str())
            .collect::<Vec<_>>(),
        ["10.0.0.3"]
    );
    assert!(web_with(Some(&failover), &eps).same_as(&after));

    // A split none of whose destinations can serve falls back to the default.
    let dead = LocalitySplit::from([(
        "zone_1".to_string(),
        BTreeMap::from([("zone_9".to_string(), 1)]),
    )]);
    let fallback = web_with(Some(&dead), &eps);
    assert_eq!(fallback.service("web").map(|s| s.zones().count()), Some(0));
    assert_eq!(
        fallback
            .service("web")
            .map(|s| s.fallen_back().collect::<Vec<_>>()),
        Some(vec!["zone_1"])
    );
    assert_eq!(
        snap.service("web").map(|s| s.fallen_back().count()),
        Some(0)
    );
    assert_eq!(sel(&fallback, "zone_1").version, other.version);
    // A zone that falls back gets the plain Cluster with the default assignment.
    assert_eq!(cds(&fallback, "zone_1"), cds(&snap, "zone_3"));
}

#[test]
fn a_new_split_rebuilds_the_service_without_a_weights_version() {
    let mut b = Balancer::new(Params::default(), 0);
    let now = now_of(&b);
    b.register(now, "web", "w1", "127.0.0.1:1", "zone_1")
        .expect("register");
    b.register(now, "web", "w2", "127.0.0.1:2", "zone_2")
        .expect("register");
    b.cycle(now);
    let none = Localities::default();
    let s1 =
        Snapshot::prepare(&publish(&b, &none), &Snapshot::default()).finish(LbPolicy::RingHash);
    let seeded = Localities {
        services: BTreeMap::from([("web".to_string(), seed_split())]),
    };
    let s2 = Snapshot::prepare(&publish(&b, &seeded), &s1).finish(LbPolicy::RingHash);
    assert!(!s2.same_as(&s1), "the split must reach clients");
    assert_eq!(
        s2.service("web").map(|s| s.zones().collect::<Vec<_>>()),
        Some(vec!["zone_1", "zone_2"])
    );
    // The same split again keeps the resources, shared, not rebuilt.
    let s3 = Snapshot::prepare(&publish(&b, &seeded), &s2).finish(LbPolicy::RingHash);
    assert!(std::ptr::eq(
        s2.service("web").expect("web"),
        s3.service("web").expect("web")
    ));
    // Another service's split does not touch this one.
    let mut elsewhere = seeded.clone();
    elsewhere.services.insert("api".into(), seed_split());
    let s4 = Snapshot::prepare(&publish(&b, &elsewhere), &s3).finish(LbPolicy::RingHash);
    assert!(std::ptr::eq(
        s3.service("web").expect("web"),
        s4.service("web").expect("web")
    ));
    // Removing the split goes back to the default for everyone.
    let s5 = Snapshot::prepare(&publish(&b, &none), &s4).finish(LbPolicy::RingHash);
    assert!(s5.same_as(&s1));
}

#[test]
fn split_zones_get_a_locality_weighted_cluster_and_the_others_the_plain_one() {
    use cluster::common_lb_config::LocalityConfigSpecifier;
    let eps = zoned_endpoints();
    let split = seed_split();
    let clusters = |snap: &Snapshot, zone: &str| {
        let sel = snap.select(ResourceType::Cluster, true, &set(&[]), zone);
        assert_eq!(sel.resources.len(), 1);
        Cluster::decode(sel.resources[0].value.as_slice()).expect("cluster")
    };
    for policy in [
        LbPolicy::RingHash,
        LbPolicy::RoundRobin,
        LbPolicy::LeastRequest,
    ] {
        let web = ServiceResources::build("web", 1, policy, &eps, Some(&split));
        let snap = Snapshot::from_services([("web".to_string(), web)]);
        for zone in ["zone_1", "zone_2"] {
            let c = clusters(&snap, zone);
            assert!(
                matches!(
                    c.common_lb_config
                        .as_ref()
                        .and_then(|l| l.locality_config_specifier.as_ref()),
                    Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(_))
                ),
                "{policy:?}, {zone}: {c:?}"
            );
            // Everything else is the plain Cluster.
            let plain = Cluster {
                common_lb_config: None,
                ..c.clone()
            };
            assert_eq!(plain, cluster("web", policy, false), "{policy:?}");
            assert_eq!(c, cluster("web", policy, true), "{policy:?}");
        }
        for zone in ["zone_3", ""] {
            assert_eq!(clusters(&snap, zone), cluster("web", policy, false));
        }
        // No split: nobody gets locality weighting.
        let plain = web_with_policy(policy, None, &eps);
        assert_eq!(clusters(&plain, "zone_1"), cluster("web", policy, false));
    }
}

fn web_with_policy(
    policy: LbPolicy,
    split: Option<&LocalitySplit>,
    eps: &[EndpointInput],
) -> Snapshot {
    let web = ServiceResources::build("web", 1, policy, eps, split);
    Snapshot::from_services([("web".to_string(), web)])
}

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

// ---------------------------------------------------------------------------------
// Protocol state machine

const EDS: ResourceType = ResourceType::Endpoints;

#[test]
fn first_request_subscribes_and_an_ack_records_the_version() {
    let mut s = StreamState::new();
    assert!(!s.should_send(EDS, "v1"), "nothing subscribed yet");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "", None),
        Verdict::Subscribe
    );
    assert!(s.should_send(EDS, "v1"));
    let n1 = s.record_sent(EDS, "v1");
    assert!(!s.should_send(EDS, "v1"), "already sent");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), &n1, None),
        Verdict::Ack {
            version: "v1".into()
        }
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(st.acked.as_deref(), Some("v1"));
    assert_eq!(st.subscription.names, set(&["web"]));
    assert!(
        !s.should_send(EDS, "v1"),
        "an ACK of the same contents asks for nothing"
    );
    assert!(s.should_send(EDS, "v2"), "new contents are pushed");
}

#[test]
fn a_nack_keeps_the_acked_version_and_the_rejected_one_is_not_resent() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web"]), &n1, None);
    let n2 = s.record_sent(EDS, "v2");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), &n2, Some("bad weight")),
        Verdict::Nack {
            version: "v2".into(),
            message: "bad weight".into()
        }
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(st.acked.as_deref(), Some("v1"));
    assert_eq!(st.nacked.as_deref(), Some("v2"));
    assert!(
        !s.should_send(EDS, "v2"),
        "the rejected contents are not sent again"
    );
    assert!(s.should_send(EDS, "v3"), "changed contents are");
    let n3 = s.record_sent(EDS, "v3");
    s.on_request(EDS, &names(&["web"]), &n3, None);
    let st = s.get(EDS).expect("state");
    assert_eq!(
        (st.acked.as_deref(), st.nacked.as_deref()),
        (Some("v3"), None)
    );
}

#[test]
fn stale_nonces_are_ignored_whole() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    let _n2 = s.record_sent(EDS, "v2");
    assert_eq!(
        s.on_request(EDS, &names(&["web", "api"]), &n1, Some("late")),
        Verdict::Stale
    );
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "no-such-nonce", None),
        Verdict::Stale
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(
        st.subscription.names,
        set(&["web"]),
        "subscription untouched"
    );
    assert_eq!((st.acked.as_deref(), st.nacked.as_deref()), (None, None));
    assert!(!s.should_send(EDS, "v2"));
}

#[test]
fn a_changed_subscription_is_answered_even_with_the_same_contents() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web", "api"]), &n1, None);
    assert!(s.should_send(EDS, "v1"));
    let n2 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web", "api"]), &n2, Some("nope"));
    // Unsubscribing after a NACK is a new subscription: answered.
    s.on_request(EDS, &names(&["api"]), &n2, None);
    assert!(s.should_send(EDS, "v1"));
}

#[test]
fn wildcards_follow_the_legacy_rules() {
    let lds = ResourceType::Listener;
    let cds = ResourceType::Cluster;
    let mut s = StreamState::new();
    s.on_request(lds, &[], "", None);
    assert!(s.get(lds).expect("lds").subscription.wildcard);
    let n = s.record_sent(lds, "v1");
    s.on_request(lds, &[], &n, None);
    assert!(
        s.get(lds).expect("lds").subscription.wildcard,
        "an empty list keeps a wildcard"
    );

    s.on_request(cds, &names(&["web"]), "", None);
    assert!(!s.get(cds).expect("cds").subscription.wildcard);
    let n = s.record_sent(cds, "v1");
    s.on_request(cds, &[], &n, None);
    let sub = &s.get(cds).expect("cds").subscription;
    assert!(
        !sub.wildcard && sub.names.is_empty(),
        "emptied names unsubscribe"
    );
    let n = s.record_sent(cds, "v2");
    s.on_request(cds, &names(&["*", "web"]), &n, None);
    let sub = &s.get(cds).expect("cds").subscription;
    assert!(sub.wildcard && sub.names == set(&["web"]));

    // RDS and EDS have no wildcard.
    s.on_request(EDS, &[], "", None);
    assert!(!s.get(EDS).expect("eds").subscription.wildcard);
}

#[test]
fn a_first_request_with_a_foreign_nonce_still_subscribes() {
    let mut s = StreamState::new();
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "42", None),
        Verdict::Subscribe
    );
    assert!(s.should_send(EDS, "v1"));
}

#[test]
fn nonces_are_unique_across_types() {
    let mut s = StreamState::new();
    let mut seen = BTreeSet::new();
    for t in ResourceType::ALL {
        s.on_request(t, &[], "", None);
        for v in ["a", "b"] {
            assert!(seen.insert(s.record_sent(t, v)));
        }
    }
    // A nonce of another type is not an answer to this one.
    let lds_nonce = s.get(ResourceType::Listener).expect("lds").sent.clone();
    let nonce = lds_nonce.expect("sent").nonce;
    assert_eq!(s.on_request(EDS, &[], &nonce, None), Verdict::Stale);
}

// ---------------------------------------------------------------------------------
// The server over a socket, with a tonic ADS client

struct Harness {
    state: Arc<State>,
    server: XdsServer,
    _dir: tempfile::TempDir,
}

fn state() -> (Arc<State>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = Clock::start();
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let balancer = Balancer::new(params, clock.now());
    let store = Arc::new(FileStore::new(dir.path().join("weights.json")));
    (Arc::new(State::new(balancer, store, clock, 1000)), dir)
}

/// What the daemon gives the feed of `state`: its publications, limits and counters.
fn inputs(state: &State) -> Inputs {
    Inputs {
        publications: state.subscribe(),
        limits: (&state.limits).into(),
        metrics: state.metrics.xds.clone(),
    }
}

impl Harness {
    async fn start(endpoints: &[(&str, &str)]) -> Harness {
        let zoned: Vec<(&str, &str, &str)> =
            endpoints.iter().map(|(n, a)| (*n, *a, "z1")).collect();
        Self::start_in_zones(&zoned, Localities::default()).await
    }

    /// Service `web` with endpoints (node, address, zone), and `localities` in force
    /// from the first snapshot on.
    async fn start_in_zones(endpoints: &[(&str, &str, &str)], localities: Localities) -> Harness {
        let (state, dir) = state();
        state.localize(localities);
        let now = state.clock.now();
        ingest(&state, |b| {
            for (node, addr, zone) in endpoints {
                b.register(now, "web", node, addr, zone).expect("register");
            }
        });
        state.cycle(state.clock.now());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let server = XdsServer::start(listener, inputs(&state), LbPolicy::RingHash).expect("start");
        Harness {
            state,
            server,
            _dir: dir,
        }
    }

    fn nacks(&self) -> u64 {
        self.state
            .metrics
            .xds
            .nacks
            .get_or_create(&XdsResource::of("endpoints"))
            .get()
    }

    /// Drains `node` and runs a cycle, which publishes a new weights version.
    fn drain(&self, node: &str) {
        let now = self.state.clock.now();
        let obs = Observation {
            draining: true,
            ..Observation::default()
        };
        ingest(&self.state, |b| {
            b.observe(now, "web", node, obs).expect("observe");
        });
        self.state.cycle(now);
    }

    /// Change `k`: a new service `extra-k` (new listeners and clusters for wildcard
    /// subscribers) and `web`'s node `w0` at a new port (a new assignment), then a
    /// cycle, which publishes both.
    fn change(&self, k: u16) {
        let now = self.state.clock.now();
        ingest(&self.state, |b| {
            b.register(now, &format!("extra-{k}"), "x", "127.0.0.1:1", "z1")
                .expect("register");
            b.register(now, "web", "w0", &format!("127.0.0.1:{}", 20_000 + k), "z1")
                .expect("register");
        });
        self.state.cycle(now);
    }

    /// Responses of type `t` sent so far, on every stream.
    fn pushes(&self, t: ResourceType) -> u64 {
        self.state
            .metrics
            .xds
            .pushes
            .get_or_create(&XdsResource::of(t.label()))
            .get()
    }
}

/// Changes the balancer as ingest does (registrations, reports). The tests play the
/// agents here; the xDS feed itself only reads publications.
fn ingest(state: &State, change: impl FnOnce(&mut Balancer)) {
    state.write_balancer(change);
}

/// One ADS stream of a test client.
struct Client {
    tx: tokio::sync::mpsc::Sender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
}

impl Client {
    async fn connect(server: &XdsServer, node: &str) -> Client {
        Self::connect_in_zone(server, node, None).await
    }

    /// A stream whose node names `zone` as its locality.
    async fn connect_in_zone(server: &XdsServer, node: &str, zone: Option<&str>) -> Client {
        Self::open(server, node, zone, None).await
    }

    /// A stream on its own connection; with `window`, the HTTP/2 flow-control window
    /// the client grants each stream, in bytes: what the server can send it before it
    /// reads.
    async fn open(
        server: &XdsServer,
        node: &str,
        zone: Option<&str>,
        window: Option<u32>,
    ) -> Client {
        let url = format!("http://{}", server.local_addr());
        let channel = tonic::transport::Endpoint::from_shared(url)
            .expect("url")
            .initial_stream_window_size(window)
            .connect()
            .await
            .expect("connect");
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let first = DiscoveryRequest {
            node: Some(envoy_types::pb::envoy::config::core::v3::Node {
                id: node.to_string(),
                locality: zone.map(|z| Locality {
                    zone: z.to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        // The node goes in a request of a type not served, which must be ignored.
        tx.send(DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret".into(),
            ..first
        })
        .await
        .expect("send");
        let rx = client
            .stream_aggregated_resources(
                tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await
            .expect("stream")
            .into_inner();
        Client { tx, rx }
    }

    async fn send(
        &self,
        t: ResourceType,
        names: &[&str],
        version: &str,
        nonce: &str,
        error: Option<&str>,
    ) {
        let req = DiscoveryRequest {
            version_info: version.to_string(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            type_url: t.type_url().to_string(),
            response_nonce: nonce.to_string(),
            error_detail: error.map(|m| rpc::Status {
                code: 3,
                message: m.to_string(),
                details: vec![],
            }),
            ..Default::default()
        };
        self.tx.send(req).await.expect("send");
    }

    async fn recv(&mut self) -> DiscoveryResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("a response within 5 s")
            .expect("stream open")
            .expect("a response")
    }

    /// Answers `resp` as a client that accepts it, keeping its subscription `names`.
    async fn ack(&self, resp: &DiscoveryResponse, names: &[&str]) {
        let t = ResourceType::from_type_url(&resp.type_url).expect("a type served");
        self.send(t, names, &resp.version_info, &resp.nonce, None)
            .await;
    }

    /// Asserts that nothing arrives for a while.
    async fn quiet(&mut self) {
        if let Ok(got) = tokio::time::timeout(Duration::from_millis(300), self.rx.message()).await {
            panic!("expected no response, got {got:?}");
        }
    }
}

fn endpoints_of(resp: &DiscoveryResponse) -> Vec<(String, String, u32, u32, i32)> {
    assert_eq!(resp.type_url, ResourceType::Endpoints.type_url());
    resp.resources
        .iter()
        .flat_map(|a| flatten(&ClusterLoadAssignment::decode(a.value.as_slice()).expect("cla")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_is_counted_the_client_keeps_its_version_and_the_next_one_is_served() {
    let h = Harness::start(&[("w1", "127.0.0.1:1001"), ("w2", "127.0.0.1:1002")]).await;
    let mut a = Client::connect(&h.server, "client-a").await;
    let mut b = Client::connect(&h.server, "client-b").await;

    // A subscribes to an existing and an unknown name: the answer has the one.
    a.send(EDS, &["web", "nope"], "", "", None).await;
    let r1 = a.recv().await;
    assert_eq!(r1.resources.len(), 1);
    let eps = endpoints_of(&r1);
    assert_eq!(eps.len(), 2);
    assert!(eps
        .iter()
        .all(|e| e.4 == HealthStatus::Healthy as i32 && e.3 == 1000));
    // B, with its own subscription, ACKs.
    b.send(EDS, &["web"], "", "", None).await;
    let rb = b.recv().await;
    assert_eq!(
        rb.version_info, r1.version_info,
        "same contents, same version"
    );
    b.send(EDS, &["web"], &rb.version_info, &rb.nonce, None)
        .await;

    // A rejects: counted, and the same contents are not sent again.
    assert_eq!(h.nacks(), 0);
    a.send(
        EDS,
        &["web", "nope"],
        "",
        &r1.nonce,
        Some("weights look wrong"),
    )
    .await;
    a.quiet().await;
    assert_eq!(h.nacks(), 1);
    // A stale or garbled request changes nothing and breaks nothing.
    a.send(EDS, &["other"], "", "not-a-nonce", Some("stale"))
        .await;
    a.send(ResourceType::Route, &[], "", "", None).await;
    let routes = a.recv().await;
    assert!(routes.resources.is_empty(), "RDS has no wildcard");
    assert_eq!(h.nacks(), 1);

    // Garbage of a valid shape: no type, odd names, an error without a nonce.
    let junk = DiscoveryRequest {
        resource_names: vec!["\0\u{ffff}".repeat(3); 1000],
        error_detail: Some(rpc::Status::default()),
        ..Default::default()
    };
    a.tx.send(junk).await.expect("send");
    a.send(EDS, &["web"], "", "", Some("no nonce")).await;
    let again = a.recv().await;
    assert_eq!(
        again.version_info, r1.version_info,
        "a resubscription is answered"
    );
    a.send(EDS, &["web", "nope"], "", &again.nonce, None).await;
    let back = a.recv().await;
    assert_eq!(back.version_info, r1.version_info);
    assert_eq!(h.nacks(), 1, "an error without a nonce answers nothing");

    // The weights change: both clients get the new version.
    h.drain("w1");
    let r2 = a.recv().await;
    assert_ne!(r2.version_info, r1.version_info);
    let eps = endpoints_of(&r2);
    assert_eq!(eps[0].4, HealthStatus::Draining as i32, "{eps:?}");
    assert_eq!(eps[1].4, HealthStatus::Healthy as i32);
    let rb2 = b.recv().await;
    assert_eq!(rb2.version_info, r2.version_info);
    a.send(EDS, &["web", "nope"], &r2.version_info, &r2.nonce, None)
        .await;
    a.quiet().await;
    assert_eq!(h.nacks(), 1);

    // Wildcard LDS on the same stream; the server is alive and answers.
    a.send(ResourceType::Listener, &[], "", "", None).await;
    let l = a.recv().await;
    assert_eq!(l.resources.len(), 1);
    let pushes = h
        .state
        .metrics
        .xds
        .pushes
        .get_or_create(&XdsResource::of("endpoints"))
        .get();
    assert_eq!(pushes, 6, "r1, rb, again, back, r2, rb2");
    assert!(h
        .state
        .metrics
        .encode()
        .contains("ballast_xds_nacks_total{resource=\"endpoints\"} 1"));

    // Shutdown ends the streams promptly.
    let started = std::time::Instant::now();
    h.server.stop().await;
    assert!(started.elapsed() < Duration::from_secs(3));
    let end = tokio::time::timeout(Duration::from_secs(3), a.rx.message())
        .await
        .expect("the stream ends");
    assert!(!matches!(end, Ok(Some(_))), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_get_their_zones_assignment_and_a_reload_reaches_only_the_zones_it_changes() {
    let h = Harness::start_in_zones(
        &[
            ("a", "127.0.0.1:1001", "zone_1"),
            ("b", "127.0.0.1:1002", "zone_1"),
            ("c", "127.0.0.1:1003", "zone_2"),
        ],
        Localities {
            services: BTreeMap::from([("web".to_string(), seed_split())]),
        },
    )
    .await;
    let mut z1 = Client::connect_in_zone(&h.server, "client-1", Some("zone_1")).await;
    let mut z2 = Client::connect_in_zone(&h.server, "client-2", Some("zone_2")).await;
    let mut z3 = Client::connect_in_zone(&h.server, "client-3", Some("zone_3")).await;
    let mut first = BTreeMap::new();
    for (name, c) in [("z1", &mut z1), ("z2", &mut z2), ("z3", &mut z3)] {
        c.send(EDS, &["web"], "", "", None).await;
        let r = c.recv().await;
        c.send(EDS, &["web"], &r.version_info, &r.nonce, None).await;
        first.insert(name, r);
    }
    assert_eq!(
        endpoints_of(&first["z1"])
            .iter()
            .map(|e| (e.0.as_str(), e.2))
            .collect::<Vec<_>>(),
        [("zone_1", 1001), ("zone_1", 1002)]
    );
    assert_eq!(endpoints_of(&first["z2"]).len(), 3);
    // zone_3 has no split: the default, whose weights are the Envoy scale.
    assert!(endpoints_of(&first["z3"]).iter().all(|e| e.3 == 1000));
    assert_ne!(first["z1"].version_info, first["z2"].version_info);

    // The reload fails zone_1 over to zone_2: only zone_1's stream hears of it.
    let mut failover = seed_split();
    failover.insert(
        "zone_1".into(),
        BTreeMap::from([("zone_2".to_string(), 100)]),
    );
    h.state.localize(Localities {
        services: BTreeMap::from([("web".to_string(), failover)]),
    });
    let r = z1.recv().await;
    assert_ne!(r.version_info, first["z1"].version_info);
    assert_eq!(
        endpoints_of(&r)
            .iter()
            .map(|e| (e.0.as_str(), e.2))
            .collect::<Vec<_>>(),
        [("zone_2", 1003)]
    );
    z1.send(EDS, &["web"], &r.version_info, &r.nonce, None)
        .await;
    z2.quiet().await;
    z3.quiet().await;
    z1.quiet().await;
    assert_eq!(h.nacks(), 0);
    h.server.stop().await;
}

/// The HTTP/2 window the stalled client grants its stream: less than one response, so
/// that the server can have at most one response on the wire to it while it stalls.
const STALLED_WINDOW: u32 = 1024;

/// What the stall test's clients subscribe to, with the names each type asks for:
/// every listener and cluster, and `web`'s assignment.
const SUBSCRIPTIONS: [(ResourceType, &[&str]); 3] = [
    (ResourceType::Cluster, &[]),
    (ResourceType::Endpoints, &["web"]),
    (ResourceType::Listener, &[]),
];

fn names_for(t: ResourceType) -> &'static [&'static str] {
    SUBSCRIPTIONS
        .iter()
        .find(|(s, _)| *s == t)
        .map_or(&[], |(_, n)| n)
}

fn type_of(resp: &DiscoveryResponse) -> ResourceType {
    ResourceType::from_type_url(&resp.type_url).expect("a type served")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_is_not_queued_versions_and_gets_the_newest_when_it_reads_again() {
    // 150 endpoints: an assignment of several KiB, more than the stalled client's
    // window, so a response to it cannot be on the wire whole while it stalls.
    let endpoints: Vec<(String, String)> = (0..150)
        .map(|i| (format!("w{i}"), format!("127.0.0.1:{}", 10_000 + i)))
        .collect();
    let refs: Vec<(&str, &str)> = endpoints
        .iter()
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect();
    let h = Harness::start(&refs).await;
    let mut fast = Client::connect(&h.server, "fast").await;
    let mut stalled = Client::open(&h.server, "stalled", None, Some(STALLED_WINDOW)).await;
    for c in [&mut fast, &mut stalled] {
        for (t, names) in SUBSCRIPTIONS {
            c.send(t, names, "", "", None).await;
        }
        let mut first = BTreeSet::new();
        while first.len() < SUBSCRIPTIONS.len() {
            let r = c.recv().await;
            c.ack(&r, names_for(type_of(&r))).await;
            first.insert(type_of(&r));
        }
    }
    let cla = stalled_cla_bytes(&h);
    assert!(
        cla > STALLED_WINDOW as usize * 3,
        "the assignment ({cla} bytes) must exceed the stalled client's window"
    );

    // The stalled client reads nothing from here on. Twenty changes of every type it
    // subscribed to; the fast client on its own connection gets each one.
    let before: BTreeMap<ResourceType, u64> = SUBSCRIPTIONS
        .iter()
        .map(|(t, _)| (*t, h.pushes(*t)))
        .collect();
    let mut to_fast: BTreeMap<ResourceType, u64> = BTreeMap::new();
    let mut newest: BTreeMap<ResourceType, String> = BTreeMap::new();
    const CHANGES: u16 = 20;
    for k in 1..=CHANGES {
        h.change(k);
        let mut got = BTreeSet::new();
        while got.len() < SUBSCRIPTIONS.len() {
            let r = fast.recv().await;
            let t = type_of(&r);
            assert!(got.insert(t), "change {k}: two {t:?} responses");
            assert_ne!(newest.get(&t), Some(&r.version_info), "change {k}: {t:?}");
            *to_fast.entry(t).or_default() += 1;
            newest.insert(t, r.version_info.clone());
            fast.ack(&r, names_for(t)).await;
        }
    }
    // Handed to the stalled stream while it stalled: per type, the response the
    // transport is writing (it cannot finish: the window is smaller) and at most one
    // more waiting for window; not one per version.
    for (t, _) in SUBSCRIPTIONS {
        let to_stalled = h.pushes(t) - before[&t] - to_fast[&t];
        assert!(
            to_stalled <= 2,
            "{t:?}: {to_stalled} responses for a client that stalled over {CHANGES} versions"
        );
    }

    // It reads again: what was on its way, then the newest version of each type, and
    // nothing in between.
    let mut last: BTreeMap<ResourceType, String> = BTreeMap::new();
    let mut received: BTreeMap<ResourceType, u64> = BTreeMap::new();
    let mut last_eds = None;
    while last != newest {
        let r = stalled.recv().await;
        let t = type_of(&r);
        *received.entry(t).or_default() += 1;
        assert!(
            received[&t] <= 3,
            "{t:?}: more than two stale responses before the newest: {received:?}"
        );
        last.insert(t, r.version_info.clone());
        stalled.ack(&r, names_for(t)).await;
        if t == EDS {
            last_eds = Some(r);
        }
    }
    let eps = endpoints_of(&last_eds.expect("an assignment"));
    assert_eq!(eps.len(), 150);
    assert!(
        eps.iter().any(|e| e.2 == 20_000 + u32::from(CHANGES)),
        "the newest assignment has w0 at its last port: {eps:?}"
    );
    stalled.quiet().await;
    fast.quiet().await;
    assert_eq!(h.nacks(), 0);
    h.server.stop().await;
}

/// The size of `web`'s default assignment as the server holds it.
fn stalled_cla_bytes(h: &Harness) -> usize {
    latest_eds(h).resources.iter().map(|a| a.value.len()).sum()
}

/// `web`'s default assignment from the snapshot of the last publication.
fn latest_eds(h: &Harness) -> DiscoveryResponse {
    let snap =
        Snapshot::prepare(&h.state.published(), &Snapshot::default()).finish(LbPolicy::RingHash);
    let sel = snap.select(ResourceType::Endpoints, false, &set(&["web"]), "");
    DiscoveryResponse {
        version_info: sel.version,
        resources: sel.resources,
        type_url: ResourceType::Endpoints.type_url().to_string(),
        ..Default::default()
    }
}

/// A server for service `web` under `limits`.
async fn limited(
    limits: crate::config::limits::Limits,
) -> (XdsServer, Arc<State>, tempfile::TempDir) {
    let (state, dir) = state();
    let state = Arc::into_inner(state)
        .expect("the only reference")
        .with_limits(limits);
    let state = Arc::new(state);
    let now = state.clock.now();
    ingest(&state, |b| {
        b.register(now, "web", "w0", "127.0.0.1:9000", "z1")
            .expect("register");
    });
    state.cycle(now);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let server = XdsServer::start(listener, inputs(&state), LbPolicy::RingHash).expect("start");
    (server, state, dir)
}

fn refused(state: &State, reason: &str) -> u64 {
    state
        .metrics
        .xds
        .refused
        .get_or_create(&crate::metrics::Reason {
            reason: reason.to_string(),
        })
        .get()
}

impl Client {
    /// How the stream ends, within 5 s, reading past any responses.
    async fn ended(&mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => panic!("the stream ended cleanly"),
                Ok(Err(status)) => return status,
                Err(_) => panic!("the stream did not end within 5 s"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_stream_keeps_is_bounded_node_names_and_bytes() {
    let limits = crate::config::limits::Limits {
        xds_max_node_bytes: 64,
        xds_max_names_per_stream: 10,
        xds_max_stream_bytes: 2000,
        ..Default::default()
    };
    let (server, state, _dir) = limited(limits).await;

    // A node id over the limit ends the stream at its first request.
    let mut long = Client::open(&server, &"n".repeat(65), None, None).await;
    assert_eq!(long.ended().await.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused(&state, "node"), 1);
    let mut zone = Client::open(&server, "n", Some(&"z".repeat(65)), None).await;
    assert_eq!(zone.ended().await.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused(&state, "node"), 2);

    // Names count over every type; a type's new request replaces its names.
    let mut c = Client::connect(&server, "names").await;
    let six: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let six: Vec<&str> = six.iter().map(String::as_str).collect();
    c.send(ResourceType::Cluster, &six, "", "", None).await;
    c.send(ResourceType::Endpoints, &six[..4], "", "", None)
        .await;
    c.send(ResourceType::Endpoints, &six[..3], "", "", None)
        .await;
    let _ = c.recv().await;
    assert_eq!(refused(&state, "stream_names"), 0);
    c.send(ResourceType::Endpoints, &six[..5], "", "", None)
        .await;
    assert_eq!(c.ended().await.code(), tonic::Code::ResourceExhausted);
    assert_eq!(refused(&state, "stream_names"), 1);

    // Bytes: each name's length and its overhead.
    let mut b = Client::connect(&server, "bytes").await;
    let long_names: Vec<String> = (0..8).map(|i| format!("{i}{}", "x".repeat(199))).collect();
    let long_names: Vec<&str> = long_names.iter().map(String::as_str).collect();
    const { assert!(8 * (200 + super::server::NAME_OVERHEAD) > 2000) };
    const { assert!(7 * (200 + super::server::NAME_OVERHEAD) <= 2000 - "bytes".len()) };
    b.send(ResourceType::Endpoints, &long_names[..7], "", "", None)
        .await;
    let _ = b.recv().await;
    assert!(state.metrics.xds.stream_bytes.get() >= 7 * 200);
    b.send(ResourceType::Cluster, &long_names[7..], "", "", None)
        .await;
    assert_eq!(b.ended().await.code(), tonic::Code::ResourceExhausted);
    assert_eq!(refused(&state, "stream_bytes"), 1);

    // Everything kept is given back with the streams.
    drop((long, zone, c, b));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while state.metrics.xds.stream_bytes.get() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "stream bytes left: {}",
            state.metrics.xds.stream_bytes.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_connections_are_capped_per_source_and_in_all() {
    use tokio::io::AsyncReadExt;
    let limits = crate::config::limits::Limits {
        xds_max_streams_per_source: 3,
        xds_max_connections: 3,
        xds_max_connections_per_source: 2,
        ..Default::default()
    };
    let (server, state, _dir) = limited(limits).await;
    let addr = server.local_addr();

    // Streams from one address, on one connection.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut held = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let mut client = AggregatedDiscoveryServiceClient::new(channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        match client
            .stream_aggregated_resources(
                tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await
        {
            Ok(s) => held.push((tx, s)),
            Err(s) => statuses.push(s.code()),
        }
    }
    assert_eq!(held.len(), 3);
    assert_eq!(statuses, [tonic::Code::ResourceExhausted]);
    assert_eq!(refused(&state, "source_streams"), 1);
    drop(held);
    drop(channel);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while state.metrics.xds.connections.get() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "connections left open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Connections: two from 127.0.0.1, then one from 127.0.0.2 fills the cap in all.
    let from = |ip: [u8; 4]| async move {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(std::net::SocketAddr::from((ip, 0)))
            .expect("bind");
        socket.connect(addr).await.expect("connect")
    };
    // Whether the server closed `s` within a second (it never sends first).
    let closed = |mut s: tokio::net::TcpStream| async move {
        let mut buf = [0u8; 16];
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => (true, s),
            Ok(Ok(_)) | Err(_) => (false, s),
        }
    };
    let a = from([127, 0, 0, 1]).await;
    let b = from([127, 0, 0, 1]).await;
    let (c_closed, _c) = closed(from([127, 0, 0, 1]).await).await;
    assert!(c_closed, "a third connection from one address was kept");
    assert_eq!(refused(&state, "source_connections"), 1);
    let (d_closed, _d) = closed(from([127, 0, 0, 2]).await).await;
    assert!(
        !d_closed,
        "another address was refused under the cap in all"
    );
    let (e_closed, _e) = closed(from([127, 0, 0, 3]).await).await;
    assert!(e_closed, "a fourth connection was kept past the cap in all");
    assert_eq!(refused(&state, "connections"), 1);
    assert_eq!(state.metrics.xds.connections.get(), 3);
    let (a_closed, _a) = closed(a).await;
    assert!(!a_closed, "a connection under the caps was closed");
    drop(b);
    server.stop().await;
}

#[test]
fn a_streams_version_costs_the_snapshots_services_not_its_names() {
    let services = (0..10).map(|i| {
        let name = format!("svc-{i}");
        let eps = [ep("n", "10.0.0.1:80", "z1", 1.0, false)];
        let r = ServiceResources::build(&name, 1, LbPolicy::RingHash, &eps, None);
        (name, r)
    });
    let snap = Snapshot::from_services(services);
    let few = set(&["svc-1", "svc-2"]);
    let mut many: BTreeSet<String> = (0..20_000).map(|i| format!("absent-{i}")).collect();
    many.extend(few.iter().cloned());
    // The same contents, whichever way the names are walked.
    assert_eq!(
        snap.version(ResourceType::Endpoints, false, &many, ""),
        snap.version(ResourceType::Endpoints, false, &few, "")
    );
    let time = |names: &BTreeSet<String>| {
        let t = std::time::Instant::now();
        for _ in 0..100 {
            std::hint::black_box(snap.version(ResourceType::Endpoints, false, names, ""));
        }
        t.elapsed()
    };
    // Against a subscription to each of the ten services: walking 20,000 names took
    // some 2,000 times as long; walking the ten services and looking each up among
    // the names, a few times as long.
    let ten: BTreeSet<String> = snap.names().map(str::to_string).collect();
    let (small, large) = (time(&ten), time(&many));
    assert!(
        large < small * 50,
        "20,000 names: {large:?}; the 10 services' names: {small:?}"
    );
}

#[test]
fn nack_warnings_are_rate_limited_and_say_how_many_were_left_out() {
    let mut log = super::server::NackLog::default();
    let t0 = std::time::Instant::now();
    for _ in 0..10 {
        assert_eq!(log.admit(t0), Some(0));
    }
    for _ in 0..5 {
        assert_eq!(log.admit(t0 + Duration::from_secs(30)), None);
    }
    assert_eq!(log.admit(t0 + Duration::from_secs(60)), Some(5));
    assert_eq!(log.admit(t0 + Duration::from_secs(61)), Some(0));
}
