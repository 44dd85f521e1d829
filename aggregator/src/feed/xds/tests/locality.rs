//! Locality splits: each client zone's share of the calls, locality weights, the
//! assignment each zone selects, and over a socket, the streams a split reaches.

use super::harness::*;
use super::*;
use crate::config::locality::{Localities, LocalitySplit};
use crate::feed::xds::resources::{
    cluster, load_assignment, locality_weights, split_assignment, EndpointInput, ResourceType,
    ServiceResources, Snapshot, LOCALITY_WEIGHT_TOTAL, ZONE_WEIGHT_TOTAL,
};
use crate::feed::xds::LbPolicy;
use ballast_balance::{Balancer, Params};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

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
    let cla = |s: &crate::feed::xds::resources::Selection| {
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
