//! The shared snapshot: what a selection carries, how versions follow contents, which
//! services a new publication rebuilds, and what a stream's version costs.

use super::*;
use crate::config::locality::Localities;
use crate::feed::xds::resources::{ResourceType, ServiceResources, Snapshot};
use crate::feed::xds::LbPolicy;
use ballast_balance::{Balancer, Observation, Params};
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use prost::Message;
use std::collections::BTreeSet;

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
