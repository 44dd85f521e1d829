//! What a cluster of replicas keeps in etcd, read the way the cluster tests check it:
//! which replica owns a service, what its owner stored, and the history of its values.

use super::agent::{Agent, AgentOpts};
use super::aggregator::Aggregator;
use super::etcd::{Etcd, Watch};
use super::pki::Pki;
use super::wait::wait_for;
use ballast_aggregator::cluster::{bucket_of, owner_key};
use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;
use std::time::Duration;

/// Where a cluster keeps its keys: the routing prefix, the cluster's name and its
/// bucket count.
#[derive(Debug, Clone, Copy)]
pub struct ClusterKeys {
    /// `--etcd-prefix`.
    pub prefix: &'static str,
    /// `--cluster`.
    pub name: &'static str,
    /// `[cluster] buckets` (64 by default).
    pub buckets: u32,
}

impl ClusterKeys {
    /// The replica holding `service`'s bucket, as etcd says.
    pub fn owner(&self, etcd: &Etcd, service: &str) -> Option<String> {
        etcd.get(&owner_key(
            self.prefix,
            self.name,
            bucket_of(service, self.buckets),
        ))
    }

    /// Waits until a replica other than `first` owns `service`, and names it.
    pub fn new_owner(&self, etcd: &Etcd, service: &str, first: &str) -> String {
        wait_for(
            Duration::from_secs(20),
            &format!("another owner of {service} than {first}"),
            || match self.owner(etcd, service) {
                Some(o) if o != first => Ok(o),
                o => Err(format!("{o:?}")),
            },
        )
    }

    /// `service` as its owner last stored it.
    pub fn stored(&self, etcd: &Etcd, service: &str) -> Option<ServiceSnapshot> {
        let value = etcd.get(&self.service_key(service))?;
        Some(serde_json::from_str(&value).unwrap_or_else(|e| panic!("{service}: {e}: {value}")))
    }

    /// The key `service`'s published value is stored under.
    pub fn service_key(&self, service: &str) -> String {
        format!("{}/services/{service}", self.prefix)
    }

    /// Every bucket's owner, by owner key.
    pub fn owners(&self, etcd: &Etcd) -> BTreeMap<String, String> {
        let out = etcd
            .try_ctl(&[
                "get",
                "--prefix",
                &format!("{}/cluster/{}/owners/", self.prefix, self.name),
            ])
            .unwrap_or_else(|e| panic!("{e}"));
        let lines: Vec<&str> = out.lines().collect();
        lines
            .chunks(2)
            .filter_map(|kv| Some((kv.first()?.to_string(), kv.get(1)?.to_string())))
            .collect()
    }

    /// The values `service`'s key took, in order, as `watch` saw them.
    pub fn history(&self, watch: &Watch, service: &str) -> Vec<ServiceSnapshot> {
        let key = self.service_key(service);
        watch
            .events()
            .into_iter()
            .filter(|e| e.kind == "PUT" && e.key == key)
            .map(|e| serde_json::from_str(&e.value).unwrap_or_else(|err| panic!("{err}: {e:?}")))
            .collect()
    }

    /// Waits until every one of `services` is owned, stored with its whole fleet of
    /// `per_service` nodes, and converged to its nodes' speeds.
    pub fn wait_balanced(
        &self,
        etcd: &Etcd,
        services: &[&str],
        per_service: usize,
        timeout: Duration,
    ) {
        wait_for(timeout, "every service owned, stored and converged", || {
            for service in services {
                self.owner(etcd, service)
                    .ok_or(format!("{service} has no owner"))?;
                let s = self
                    .stored(etcd, service)
                    .ok_or(format!("{service} not stored"))?;
                converged_to_speeds(&s, per_service).map_err(|e| format!("{service}: {e}"))?;
            }
            Ok(())
        });
    }

    /// Panics unless every value `service`'s key took has a higher version than the
    /// one before and no lower cycle: one writer at a time.
    pub fn assert_one_writer(&self, watch: &Watch, service: &str) {
        for pair in self.history(watch, service).windows(2) {
            assert!(
                pair[1].version > pair[0].version && pair[1].cycle >= pair[0].cycle,
                "{service} went from version {} cycle {} to version {} cycle {}",
                pair[0].version,
                pair[0].cycle,
                pair[1].version,
                pair[1].cycle
            );
        }
    }
}

/// A stored service's weights by node.
pub fn weights(s: &ServiceSnapshot) -> BTreeMap<String, f64> {
    s.endpoints
        .iter()
        .map(|(n, e)| (n.clone(), e.weight))
        .collect()
}

/// The largest change of one node's weight from `a` to `b`.
pub fn largest_change(a: &ServiceSnapshot, b: &ServiceSnapshot) -> f64 {
    let (wa, wb) = (weights(a), weights(b));
    wa.iter()
        .map(|(n, w)| (w - wb.get(n).copied().unwrap_or(0.0)).abs())
        .fold(0.0, f64::max)
}

/// Whether `s`'s weights are within 10 % of its agents' speeds, where node `NAME-i`
/// of `per_service` runs at speed `1 + i` (over their mean): converged, as a balanced
/// fleet of these speeds is.
pub fn converged_to_speeds(s: &ServiceSnapshot, per_service: usize) -> Result<(), String> {
    let w = weights(s);
    let mean_speed = (1..=per_service).sum::<usize>() as f64 / per_service as f64;
    let near = w.len() == per_service
        && w.iter().all(|(node, w)| {
            let i: f64 = node
                .rsplit('-')
                .next()
                .and_then(|i| i.parse().ok())
                .unwrap_or(-9.0);
            let want = (1.0 + i) / mean_speed;
            (w - want).abs() <= 0.1 * want
        });
    near.then_some(()).ok_or(format!("{w:?}"))
}

/// `per_service` agents in each of `services`, node `NAME-i` at speed `1 + i`, each
/// told of every address in `addrs` (replicas or relays), agent `i` starting at the
/// `i`-th, so that they spread. `address` may give a node the address it registers
/// (a real backend's); `any` is an aggregator of the cluster, for the agents' defaults.
pub fn fleet(
    pki: &Pki,
    any: &Aggregator,
    addrs: &[String],
    services: &[&str],
    per_service: usize,
    address: impl Fn(&str) -> Option<String>,
) -> Vec<Agent> {
    fleet_with(pki, any, addrs, services, per_service, |_, mut opts| {
        opts.address = address(&opts.node);
        opts
    })
}

/// [`fleet`], each agent's options (node `NAME-i`: `i`) passed through `customize`
/// before it starts.
pub fn fleet_with(
    pki: &Pki,
    any: &Aggregator,
    addrs: &[String],
    services: &[&str],
    per_service: usize,
    customize: impl Fn(usize, AgentOpts) -> AgentOpts,
) -> Vec<Agent> {
    let mut agents = Vec::new();
    for service in services {
        let nodes: Vec<String> = (0..per_service).map(|i| format!("{service}-{i}")).collect();
        pki.issue_nodes_for(
            service,
            &nodes.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        for (i, node) in nodes.iter().enumerate() {
            let mut opts = AgentOpts::new(service, node).speed(1.0 + i as f64);
            let mut list = addrs.to_vec();
            list.rotate_left(i % addrs.len().max(1));
            opts.aggregators = Some(list);
            agents.push(Agent::start(pki, any, customize(i, opts)));
        }
    }
    agents
}
