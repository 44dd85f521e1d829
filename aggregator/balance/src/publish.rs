//! What a cycle publishes: one immutable value that every reader takes.
//!
//! The routing store, the xDS server, the watch feed, the HTTP API and the replies to
//! agents all read a [`Published`], never the balancer itself, so none of them can
//! show a state that no cycle published, and none contends with ingest for the
//! balancer. Services that did not cycle keep their [`PublishedService`] from the
//! previous value by `Arc`, so a publication costs the services that ran, not the fleet.
//!
//! The value is plain data with a [`FORMAT`] number: it can be written to a consensus
//! store by one process and read by another, and a reader can refuse a format it does
//! not know instead of misreading it.

use crate::by_node::ByNode;
use crate::endpoints::Endpoint;
use crate::inflight::InflightEstimate;
use crate::service::{EndpointSnapshot, HistoryPoint, ServiceSnapshot, ServiceStats};
use crate::{Actions, Balancer, EndpointState, Millis, Params, Service, StrategyWeights};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The format of [`Published`]; bumped when a field changes meaning or goes away.
pub const FORMAT: u32 = 1;

/// Client zone → destination zone → relative share: how a service's clients in each
/// zone split their traffic across zones. Shares are relative, not percentages.
pub type LocalitySplit = BTreeMap<String, BTreeMap<String, u32>>;

/// Every service as of one publication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Published {
    /// [`FORMAT`] when it was written.
    pub format: u32,
    /// Increases with every publication, whether or not weights moved.
    pub version: u64,
    /// When it was published, on the publisher's clock.
    #[cfg_attr(feature = "openapi", schema(value_type = u64))]
    pub at: Millis,
    /// Services by name.
    pub services: BTreeMap<String, Arc<PublishedService>>,
}

impl Default for Published {
    fn default() -> Self {
        Published {
            format: FORMAT,
            version: 0,
            at: 0,
            services: BTreeMap::new(),
        }
    }
}

/// One service as its last cycle left it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedService {
    /// The service's name.
    pub name: String,
    /// The weights' version: increases with every material change.
    pub version: u64,
    /// Whether the service changed for the feeds, in one number: the digest of the
    /// weights version and of each endpoint's node, address, zone and draining flag
    /// ([`change_digest`]). The xDS resources, the routing store's writes and the HTTP
    /// watch's events all follow it: a service whose digest is that of the last one a
    /// feed sent has nothing new for it.
    #[serde(default)]
    pub digest: u64,
    /// The cycle the published weights came from.
    pub cycle: u64,
    /// The last cycle that updated the live weights; what the store keeps, so that
    /// cycle numbers go on from there after a restart.
    pub weights_cycle: u64,
    /// When its last cycle ran, on the publisher's clock.
    #[cfg_attr(feature = "openapi", schema(value_type = u64))]
    pub at: Millis,
    /// The locality split in force; empty when traffic spreads evenly over zones.
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, BTreeMap<String, u32>>))]
    pub locality: LocalitySplit,
    /// The parameters in force.
    pub params: Params,
    /// Counters and the last cycle's figures.
    pub stats: ServiceStats,
    /// Recent cycles, oldest first.
    pub history: Vec<HistoryPoint>,
    /// Endpoints by node.
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, PublishedEndpoint>))]
    pub endpoints: ByNode<PublishedEndpoint>,
    /// What operators set on the service: drains, a hold, pins.
    #[serde(default)]
    pub operator: Actions,
}

/// One endpoint as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedEndpoint {
    /// `host:port`.
    pub address: Arc<str>,
    /// Its zone; empty when unknown.
    pub zone: Arc<str>,
    /// The weight of this version, mean 1.0 over serving endpoints.
    pub weight: f64,
    /// Whether this version has it draining (weight 0 to every sink).
    pub draining: bool,
    /// Whether the balancer has it draining now (it asked; the version may lag).
    pub draining_now: bool,
    /// Its state when the cycle ran.
    pub state: EndpointState,
    /// The load the balancer steered it by.
    pub load: f64,
    /// Its last reported CPU utilization.
    pub cpu: f64,
    /// Its last reported in-flight count.
    pub inflight: u32,
    /// Its last reported capacity; 0 when it has none.
    pub capacity: u32,
    /// What the cycle made of its in-flight count.
    pub inflight_estimate: InflightEstimate,
    /// Whether its in-flight count is believed (false once it was set aside for not
    /// following the weight); what its agent is told.
    pub inflight_trusted: bool,
    /// The part of its CPU that did not fall when its weight did (other work on its
    /// host or in its cgroup), when one was found: it is steered by its CPU above it.
    pub cpu_floor: Option<f64>,
    /// Milliseconds from its last report to the cycle; `None` if it has not reported
    /// since it was registered or restored.
    pub report_age_ms: Option<u64>,
    /// Each strategy's own weight as of this version, which the routing store keeps.
    pub strategy_weights: StrategyWeights,
}

impl PublishedService {
    /// The service as the balancer holds it at `now`, under `locality`.
    pub fn of(svc: &Service, now: Millis, locality: LocalitySplit) -> Self {
        Self::after(svc, now, locality)
    }

    /// [`PublishedService::of`]. The endpoints are listed by one walk of the service's
    /// arrays, which yields them in node order: the list is built by appending, with no
    /// comparison of node names, and the previous publication's is dropped whole.
    fn after(svc: &Service, now: Millis, locality: LocalitySplit) -> Self {
        // Sized first: growing it would copy every entry made so far, more than once.
        let mut entries = Vec::with_capacity(svc.endpoints().len());
        let mut digest = ChangeDigest::new(svc.version);
        entries.extend(svc.published_endpoints().map(|(e, state, strategies)| {
            let names = e.names();
            let mut out = PublishedEndpoint {
                address: Arc::clone(&names.address),
                zone: Arc::clone(&names.zone),
                weight: 0.0,
                draining: false,
                draining_now: false,
                state: EndpointState::Serving,
                load: 0.0,
                cpu: 0.0,
                inflight: 0,
                capacity: 0,
                inflight_estimate: InflightEstimate::default(),
                inflight_trusted: true,
                cpu_floor: None,
                report_age_ms: None,
                strategy_weights: strategies,
            };
            fill(&mut out, svc, now, e, state, strategies);
            digest.push(names.digest, out.draining);
            (Arc::clone(&names.node), out)
        }));
        let endpoints = ByNode::from_node_order(entries);
        PublishedService {
            name: svc.name.clone(),
            version: svc.version,
            digest: digest.finish(),
            cycle: svc.published_cycle(),
            weights_cycle: svc.weights_cycle,
            at: now,
            locality,
            params: svc.params.clone(),
            stats: svc.stats.clone(),
            history: svc.history.iter().copied().collect(),
            endpoints,
            operator: svc.actions().clone(),
        }
    }

    /// What the routing store keeps of this publication.
    pub fn snapshot(&self) -> ServiceSnapshot {
        ServiceSnapshot {
            version: self.version,
            cycle: self.weights_cycle,
            endpoints: self
                .endpoints
                .iter()
                .map(|(node, e)| {
                    (
                        node.to_string(),
                        EndpointSnapshot {
                            address: e.address.to_string(),
                            zone: e.zone.to_string(),
                            draining: e.draining,
                            weight: e.weight,
                            strategy_weights: e.strategy_weights.to_map(),
                        },
                    )
                })
                .collect(),
            operator: self.operator.clone(),
        }
    }

    /// Endpoints by state.
    pub fn states(&self) -> BTreeMap<EndpointState, usize> {
        let mut states = BTreeMap::new();
        for e in self.endpoints.values() {
            *states.entry(e.state).or_insert(0) += 1;
        }
        states
    }
}

/// Sets every value of `out` but its address and zone from endpoint `e` of `svc` at
/// `now`, with its weight and drain state and strategy weights as of the version.
fn fill(
    out: &mut PublishedEndpoint,
    svc: &Service,
    now: Millis,
    e: Endpoint<'_>,
    (weight, draining): (f64, bool),
    strategies: StrategyWeights,
) {
    // Every field by name, so that a new one cannot be left stale in a copied map.
    let PublishedEndpoint {
        address: _,
        zone: _,
        weight: out_weight,
        draining: out_draining,
        draining_now,
        state,
        load,
        cpu,
        inflight,
        capacity,
        inflight_estimate,
        inflight_trusted,
        cpu_floor,
        report_age_ms,
        strategy_weights,
    } = out;
    *out_weight = weight;
    *out_draining = draining;
    *draining_now = e.draining();
    *state = e.state(now, &svc.params);
    *load = e.load();
    *cpu = e.observation().cpu;
    *inflight = e.observation().inflight;
    *capacity = e.observation().capacity;
    *inflight_estimate = e.inflight().estimate;
    *inflight_trusted = e.inflight_trusted();
    *cpu_floor = e.cpu_floor().floor();
    *report_age_ms = e.report_age(now);
    *strategy_weights = strategies;
}

/// The digest of a service's weights `version` and of its endpoints' (node, address,
/// zone, draining), in node order, each endpoint's names given by their
/// [`names_digest`]: [`PublishedService::digest`].
pub fn change_digest(version: u64, endpoints: impl Iterator<Item = (u64, bool)>) -> u64 {
    let mut digest = ChangeDigest::new(version);
    for (names, draining) in endpoints {
        digest.push(names, draining);
    }
    digest.finish()
}

/// [`change_digest`] one endpoint at a time: one step per endpoint, so that a
/// publication of 100,000 endpoints spends a fraction of a millisecond on it.
#[derive(Debug, Clone, Copy)]
pub struct ChangeDigest(u64);

impl ChangeDigest {
    /// Of weights `version`, no endpoint yet.
    pub fn new(version: u64) -> Self {
        ChangeDigest(mix64(FNV_OFFSET ^ version))
    }

    /// The next endpoint in node order: its [`names_digest`] and whether it drains.
    pub fn push(&mut self, names: u64, draining: bool) {
        self.0 = mix64(self.0.rotate_left(23) ^ names ^ u64::from(draining));
    }

    /// The digest.
    pub fn finish(self) -> u64 {
        self.0
    }
}

/// The digest of an endpoint's node, address and zone, made once when they are set.
pub fn names_digest(node: &str, address: &str, zone: &str) -> u64 {
    // The separators keep ("ab", "c") and ("a", "bc") apart.
    let h = fnv1a(fnv1a(FNV_OFFSET, node.as_bytes()), &[0]);
    let h = fnv1a(fnv1a(h, address.as_bytes()), &[0]);
    // Shifted left by one: the low bit is the drain state's in [`change_digest`].
    mix64(fnv1a(h, zone.as_bytes())) << 1
}

/// splitmix64's finaliser: every input bit moves every output bit.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of `bytes`, continuing from `h` ([`FNV_OFFSET`] to start): a stable
/// digest (the standard library's hasher may change between releases, and digests are
/// compared across a client's reconnections).
pub fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Where [`fnv1a`] starts.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

impl Published {
    /// The next publication after `self`, at `now`: the services named in `ran` (those
    /// whose cycle just ran) are taken from the balancer afresh, as is any service whose
    /// locality split changed; services the balancer no longer has are dropped; the
    /// rest are shared with `self`. The version is one more than `self`'s.
    pub fn next(
        &self,
        balancer: &Balancer,
        ran: &BTreeSet<String>,
        localities: &BTreeMap<String, LocalitySplit>,
        now: Millis,
    ) -> Published {
        let services = balancer
            .services()
            .map(|svc| {
                let locality = localities.get(&svc.name);
                let kept = self.services.get(&svc.name).filter(|p| {
                    !ran.contains(&svc.name)
                        && locality.map_or(p.locality.is_empty(), |l| *l == p.locality)
                });
                let entry = match kept {
                    Some(p) => Arc::clone(p),
                    None => Arc::new(PublishedService::after(
                        svc,
                        now,
                        locality.cloned().unwrap_or_default(),
                    )),
                };
                (svc.name.clone(), entry)
            })
            .collect();
        Published {
            format: FORMAT,
            version: self.version.saturating_add(1),
            at: now,
            services,
        }
    }

    /// One service.
    pub fn service(&self, name: &str) -> Option<&PublishedService> {
        self.services.get(name).map(Arc::as_ref)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Observation;

    fn balancer() -> Balancer {
        let params = Params {
            grace_ms: 0,
            ..Params::default()
        };
        let mut b = Balancer::new(params, 0);
        for (i, cpu) in [0.2, 0.8].into_iter().enumerate() {
            let node = format!("n{i}");
            b.register(0, "svc", &node, &format!("10.0.0.{i}:80"), "z")
                .expect("registers");
            b.observe(
                0,
                "svc",
                &node,
                Observation {
                    cpu,
                    ..Observation::default()
                },
            )
            .expect("observes");
        }
        b
    }

    #[test]
    fn services_that_did_not_run_are_shared_and_those_that_ran_are_fresh() {
        let mut b = balancer();
        b.register(0, "other", "o", "10.0.1.1:80", "z")
            .expect("registers");
        let first = Published::default().next(&b, &BTreeSet::new(), &BTreeMap::new(), 0);
        assert_eq!(first.version, 1);
        assert_eq!(first.services.len(), 2);
        b.cycle(1_000);
        let ran: BTreeSet<String> = ["svc".to_string()].into();
        let second = first.next(&b, &ran, &BTreeMap::new(), 1_000);
        assert_eq!(second.version, 2);
        assert!(Arc::ptr_eq(
            &first.services["other"],
            &second.services["other"]
        ));
        assert!(!Arc::ptr_eq(
            &first.services["svc"],
            &second.services["svc"]
        ));
        assert_eq!(second.services["svc"].at, 1_000);
    }

    /// The next publication holds the value a publication built afresh would: through
    /// plain cycles, an address and zone that change, and a newcomer, its endpoints in
    /// node order as a map would list them.
    #[test]
    fn a_publication_after_another_equals_one_built_afresh() {
        let mut b = balancer();
        let mut p = Published::default().next(&b, &BTreeSet::new(), &BTreeMap::new(), 0);
        let ran: BTreeSet<String> = ["svc".to_string()].into();
        for t in 1..=6u64 {
            let now = t * 1_000;
            match t {
                2 => b
                    .register(now, "svc", "n1", "10.0.0.9:80", "y")
                    .expect("moves"),
                4 => b
                    .register(now, "svc", "n2", "10.0.0.2:80", "z")
                    .expect("registers"),
                _ => {}
            }
            for (i, cpu) in [0.3, 0.7, 0.5].into_iter().enumerate() {
                let obs = Observation {
                    cpu,
                    ..Observation::default()
                };
                if b.observe(now, "svc", &format!("n{i}"), obs).is_err() {
                    assert!(i == 2 && t < 4, "n{i} at {now}");
                }
            }
            b.cycle(now);
            let next = p.next(&b, &ran, &BTreeMap::new(), now);
            let svc = b.service("svc").expect("svc");
            let afresh = PublishedService::of(svc, now, LocalitySplit::new());
            assert_eq!(*next.services["svc"], afresh, "at {now}");
            p = next;
        }
        assert_eq!(&*p.services["svc"].endpoints["n1"].address, "10.0.0.9:80");
        let nodes: Vec<&str> = p.services["svc"].endpoints.keys().map(|n| &**n).collect();
        assert_eq!(nodes, ["n0", "n1", "n2"]);
    }

    #[test]
    fn a_new_locality_split_republishes_the_service() {
        let b = balancer();
        let first = Published::default().next(&b, &BTreeSet::new(), &BTreeMap::new(), 0);
        let split: LocalitySplit = [("a".to_string(), [("a".to_string(), 1)].into())].into();
        let localities = [("svc".to_string(), split.clone())].into();
        let second = first.next(&b, &BTreeSet::new(), &localities, 0);
        assert_eq!(second.services["svc"].locality, split);
        let third = second.next(&b, &BTreeSet::new(), &localities, 0);
        assert!(Arc::ptr_eq(&second.services["svc"], &third.services["svc"]));
    }

    #[test]
    fn it_round_trips_as_data() {
        let mut b = balancer();
        b.cycle(1_000);
        let p = Published::default().next(&b, &BTreeSet::new(), &BTreeMap::new(), 1_000);
        let text = serde_json::to_string(&p).expect("serialises");
        let back: Published = serde_json::from_str(&text).expect("deserialises");
        assert_eq!(back, p);
        assert_eq!(back.format, FORMAT);
    }

    #[test]
    fn the_store_snapshot_carries_the_published_weights() {
        let mut b = balancer();
        for t in 1..=5 {
            b.cycle(t * 1_000);
        }
        let p = Published::default().next(&b, &BTreeSet::new(), &BTreeMap::new(), 5_000);
        let svc = p.service("svc").expect("published");
        let snap = svc.snapshot();
        assert_eq!(snap.version, svc.version);
        for (node, e) in &svc.endpoints {
            assert_eq!(snap.endpoints[node.as_ref()].weight, e.weight);
            assert_eq!(*snap.endpoints[node.as_ref()].address, *e.address);
        }
    }

    #[test]
    fn the_change_digest_moves_with_every_field_it_covers() {
        let a = names_digest("web-1", "10.0.0.1:80", "z1");
        let b = names_digest("web-2", "10.0.0.2:80", "z1");
        let base = change_digest(7, [(a, false), (b, false)].into_iter());
        assert_eq!(base, change_digest(7, [(a, false), (b, false)].into_iter()));
        let changed = [
            change_digest(8, [(a, false), (b, false)].into_iter()),
            change_digest(7, [(a, true), (b, false)].into_iter()),
            change_digest(7, [(a, false), (b, true)].into_iter()),
            change_digest(7, [(b, false), (a, false)].into_iter()),
            change_digest(7, [(a, false)].into_iter()),
            change_digest(
                7,
                [
                    (names_digest("web-1", "10.0.0.9:80", "z1"), false),
                    (b, false),
                ]
                .into_iter(),
            ),
            change_digest(
                7,
                [
                    (names_digest("web-1", "10.0.0.1:80", "z2"), false),
                    (b, false),
                ]
                .into_iter(),
            ),
        ];
        for (i, c) in changed.iter().enumerate() {
            assert_ne!(*c, base, "change {i} left the digest as it was");
        }
        // The separators keep the fields apart.
        assert_ne!(names_digest("ab", "c", ""), names_digest("a", "bc", ""));
        assert_ne!(names_digest("a", "b", "c"), names_digest("a", "bc", ""));
    }
}
