//! Fleets of agents at synthetic speeds, and the check that their controllers have
//! converged.
//!
//! The scenarios that compare a feed with the weights (HAProxy, xDS, every reader of a
//! publication) start the same kind of fleet, one agent per speed so the converged
//! weights differ, and wait for the same sign of convergence before they compare.

use super::agent::{Agent, AgentOpts};
use super::aggregator::Aggregator;
use super::api::{ServiceDetail, ServiceHistory};
use super::pki::Pki;
use std::time::Duration;

/// How long an agent may take to get its first weight.
const FIRST_WEIGHT_WITHIN: Duration = Duration::from_secs(15);

/// Node names `{service}-0`, `{service}-1`, …: one for each of `n` agents.
pub fn node_names(service: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{service}-{i}")).collect()
}

/// Starts an agent of `service` for each of `nodes`, the `i`th with speed `speeds[i]`
/// and seed `i` (so a run repeats), and the rest of its options as `adjust` sets them
/// (its address, zone, agent-check…). Issues the nodes' certificates first, and
/// returns once every agent has a weight.
pub fn start_speeds(
    pki: &Pki,
    agg: &Aggregator,
    service: &str,
    nodes: &[String],
    speeds: &[f64],
    mut adjust: impl FnMut(usize, &mut AgentOpts),
) -> Vec<Agent> {
    assert_eq!(nodes.len(), speeds.len(), "one speed for each node");
    pki.issue_nodes_for(
        service,
        &nodes.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let agents: Vec<Agent> = nodes
        .iter()
        .zip(speeds)
        .enumerate()
        .map(|(i, (node, speed))| {
            let mut opts = AgentOpts::new(service, node).speed(*speed).seed(i as u64);
            adjust(i, &mut opts);
            Agent::start(pki, agg, opts)
        })
        .collect();
    for a in &agents {
        a.wait_weight(FIRST_WEIGHT_WITHIN);
    }
    agents
}

/// `service`'s detail once its controllers have converged: at least `updates` weight
/// updates so far, and the last cycle's max/avg of the load at most `max_over_avg`.
/// `Err` says how far they have got, for [`wait_for`](super::wait::wait_for).
pub fn converged(
    agg: &Aggregator,
    service: &str,
    updates: usize,
    max_over_avg: f64,
) -> Result<ServiceDetail, String> {
    let d = agg.service(service);
    let done = d.updates().count();
    let last = d
        .history
        .last()
        .map_or(f64::INFINITY, |h| h.spread.max_over_avg);
    if done >= updates && last <= max_over_avg {
        Ok(d)
    } else {
        Err(format!(
            "{done} updates, max/avg {}",
            d.recent_max_over_avg(5)
        ))
    }
}
