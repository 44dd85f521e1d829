//! A service's config file (`<dir>/<service>.toml`, owned by that service's team):
//! `service::parse` on arbitrary text against the global defaults, with its `[balance]`
//! overrides, the strategy mixture and the `[locality]` table; and the xDS assignments
//! each accepted locality table produces.
//!
//! Invariants: nothing panics; an accepted file's parameters and locality validate and
//! are finite and not negative; the file round-trips (its parameters and table written
//! back as a file parse to the same); every client zone's ClusterLoadAssignment has
//! locality weights of at least 1 whose products with the zone's endpoint weights,
//! and their sum, fit gRPC's 32-bit arithmetic.

#![no_main]

use ballast_aggregator::config::locality;
use ballast_aggregator::config::service::parse;
use ballast_aggregator::config::LbPolicy;
use ballast_aggregator::feed::xds::resources::{ResourceType, Snapshot};
use ballast_balance::mixture::mix;
use ballast_balance::publish::LocalitySplit;
use ballast_balance::{Balancer, Params, Published, Strategy};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let defaults = Params::default();
    let Ok(cfg) = parse("web.toml", text, &defaults) else {
        return;
    };
    let p = &cfg.params;
    ballast_fuzz::assert_params_sane(p, "service file [balance]");
    assert_eq!(locality::validate(&cfg.locality), Ok(()));
    let w = mix(&p.strategies, |s| match s {
        Strategy::Pid => p.max_weight,
        Strategy::RoundRobin => p.min_weight,
    });
    assert!(
        w.is_finite() && w > 0.0 && w <= p.max_weight * (1.0 + 1e-12),
        "mixture {w}"
    );

    // Written back as a file, the same config.
    #[derive(serde::Serialize)]
    struct File<'a> {
        balance: &'a Params,
        locality: &'a LocalitySplit,
    }
    let again = toml::to_string(&File {
        balance: p,
        locality: &cfg.locality,
    })
    .expect("an accepted config serialises");
    let back = parse("web.toml", &again, &defaults).expect("a written-back file parses");
    assert_eq!(&back.params, p, "round trip through:\n{again}");
    assert_eq!(back.locality, cfg.locality);

    if !cfg.locality.is_empty() {
        assignments(&cfg.locality);
    }
});

/// Builds the xDS assignments of a fleet with two endpoints in each zone the table
/// names (at most 8 zones), and checks each client zone's.
fn assignments(split: &LocalitySplit) {
    let zones: BTreeSet<&str> = split
        .iter()
        .flat_map(|(client, dests)| {
            std::iter::once(client.as_str()).chain(dests.keys().map(String::as_str))
        })
        .take(8)
        .collect();
    let mut b = Balancer::new(Params::default(), 0);
    let now = b.grace_until();
    for (i, zone) in zones.iter().enumerate() {
        for j in 0..2 {
            let node = format!("n{i}-{j}");
            let addr = format!("10.0.{i}.{j}:80");
            b.register(now, "web", &node, &addr, zone)
                .expect("register");
        }
    }
    b.cycle(now);
    let localities: BTreeMap<String, LocalitySplit> = [("web".to_string(), split.clone())].into();
    let published = Published::default().next(&b, &BTreeSet::new(), &localities, now);
    let snap = Snapshot::prepare(&published, &Snapshot::default()).finish(LbPolicy::RingHash);
    let names: BTreeSet<String> = ["web".to_string()].into();
    for client in split.keys().filter(|c| zones.contains(c.as_str())) {
        let sel = snap.select(ResourceType::Endpoints, false, &names, client);
        assert_eq!(sel.resources.len(), 1);
        let cla = ClusterLoadAssignment::decode(sel.resources[0].value.as_slice())
            .expect("an assignment decodes");
        assert!(
            !cla.endpoints.is_empty(),
            "client zone {client:?} got no endpoints"
        );
        let mut total: u64 = 0;
        for loc in &cla.endpoints {
            let lw = loc.load_balancing_weight.as_ref().map_or(0, |w| w.value);
            assert!(lw >= 1, "a locality without weight");
            let eps: u64 = loc
                .lb_endpoints
                .iter()
                .map(|e| u64::from(e.load_balancing_weight.as_ref().map_or(0, |w| w.value)))
                .sum();
            total += u64::from(lw) * eps;
        }
        assert!(
            total <= i32::MAX as u64,
            "client zone {client:?}: {total} overflows gRPC"
        );
    }
}
