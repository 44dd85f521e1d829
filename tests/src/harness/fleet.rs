//! The legitimate fleet a hostile test runs beside: whatever an intruder tries, the
//! fleet's agents stay connected with fresh weights, its service holds exactly its
//! endpoints, and its cycles keep updating weights.

use super::agent::Agent;
use super::aggregator::Aggregator;
use super::api::{EndpointState, EndpointView};

/// How old a fleet endpoint's last report may be while it counts as served.
const MAX_REPORT_AGE_MS: u64 = 2000;

/// Whether `agents` of `service` are being balanced now: each agent is connected and
/// holds a weight; the service's endpoints are exactly theirs (no intruder among
/// them), each serving or warming up with a positive weight and a report younger than
/// two seconds. Returns the service's count of cycles that updated weights, so that a
/// test can check that balancing went on between two calls.
pub fn fleet_served(agg: &Aggregator, service: &str, agents: &[Agent]) -> Result<u64, String> {
    // Not served yet (a service is published a cycle after its first hello) is not
    // served: an error to wait on, not a panic.
    let eps: Vec<EndpointView> = agg.try_get_json(&format!("/v1/services/{service}/endpoints"))?;
    let mut nodes: Vec<&str> = eps.iter().map(|e| e.node.as_str()).collect();
    let mut want: Vec<&str> = agents.iter().map(Agent::node).collect();
    nodes.sort_unstable();
    want.sort_unstable();
    if nodes != want {
        return Err(format!("{service} has endpoints {nodes:?}, not {want:?}"));
    }
    for e in &eps {
        if !matches!(e.state, EndpointState::Serving | EndpointState::Warming) || e.weight <= 0.0 {
            return Err(format!(
                "{} is {:?} with weight {}",
                e.node, e.state, e.weight
            ));
        }
        match e.report_age_ms {
            Some(age) if age <= MAX_REPORT_AGE_MS => {}
            age => return Err(format!("{} last reported {age:?} ms ago", e.node)),
        }
    }
    for a in agents {
        let s = a.status();
        if s.connected_to.is_none() || s.weight.is_none() {
            return Err(format!("{} lost its link: {s:?}", a.node()));
        }
    }
    Ok(agg.try_service(service)?.stats.updates)
}
