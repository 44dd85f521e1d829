//! The adapter between the simulated fleet and the real balancing core.
//!
//! Nothing of the controller is copied here: reports go into
//! [`ballast_balance::Balancer::observe`], cycles run
//! [`ballast_balance::Balancer::cycle`], and the weights the clients apply are the
//! published `Endpoint::weight`s, read only when the cycle says they changed
//! materially, as the weight feeds do.

use super::fleet::{InflightMeasure, Measurement};
use super::strategy::AgentConfig;
use ballast_balance::inflight::InflightEstimate;
use ballast_balance::{BalanceError, Balancer, CycleResult, Observation, Params};

/// Counts of what the core made of the in-flight counts in one cycle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InflightVerdicts {
    /// Endpoints whose load was set by the in-flight term.
    pub binding: u32,
    /// Endpoints whose in-flight count is distrusted.
    pub distrusted: u32,
    /// Feed-forward steps so far.
    pub feed_forward_steps: u64,
}

/// The one service the simulated fleet is.
pub const SERVICE: &str = "sim";

/// A `Balancer` with one service whose endpoints are numbered.
#[derive(Debug, Clone)]
pub struct BallastAdapter {
    balancer: Balancer,
    names: Vec<String>,
    seq: Vec<u32>,
    agent: AgentConfig,
}

fn name(idx: usize) -> String {
    // Zero-padded, so that the balancer's sorted map keeps index order.
    format!("ep-{idx:05}")
}

impl BallastAdapter {
    /// A balancer at `now` with `endpoints` registered endpoints, whose agents
    /// measure in-flight requests as `agent` says.
    pub fn new(
        params: Params,
        endpoints: usize,
        now: u64,
        agent: AgentConfig,
    ) -> Result<Self, BalanceError> {
        let mut a = BallastAdapter {
            balancer: Balancer::new(params, now),
            names: Vec::new(),
            seq: Vec::new(),
            agent,
        };
        for i in 0..endpoints {
            a.register(now, i)?;
        }
        Ok(a)
    }

    /// Registers endpoint `idx`, as its first report would (auto-registration).
    pub fn register(&mut self, now: u64, idx: usize) -> Result<(), BalanceError> {
        while self.names.len() <= idx {
            self.names.push(name(self.names.len()));
            self.seq.push(0);
        }
        let node = &self.names[idx];
        self.balancer
            .register(now, SERVICE, node, &format!("10.0.0.{idx}:443"), "zone-a")
    }

    /// Hands one delivered report to the balancer.
    pub fn observe(&mut self, now: u64, idx: usize, m: &Measurement) -> Result<(), BalanceError> {
        let (Some(node), Some(seq)) = (self.names.get(idx), self.seq.get_mut(idx)) else {
            return Err(BalanceError::UnknownEndpoint {
                service: SERVICE.to_string(),
                node: name(idx),
            });
        };
        *seq += 1;
        let obs = Observation {
            seq: Some(*seq),
            cpu: m.cpu,
            inflight: m.inflight.get(self.agent.measure),
            inflight_mean: Some(m.mean(self.agent.measure)),
            // A source that counts connections owing a response reads their ages too.
            age_ms: (self.agent.measure == InflightMeasure::Owed).then_some(m.age_ms),
            oldest_ms: (self.agent.measure == InflightMeasure::Owed).then_some(m.oldest_ms),
            capacity: self.agent.capacity,
            error_rate: Some(m.error_rate),
            draining: false,
        };
        self.balancer.observe(now, SERVICE, node, obs).map(|_| ())
    }

    /// Runs the aggregator's cycle.
    pub fn cycle(&mut self, now: u64) -> Option<CycleResult> {
        self.balancer.cycle_service(now, SERVICE)
    }

    /// What the last cycle made of the in-flight counts: how many endpoints' loads
    /// were set by their in-flight term, and how many terms are distrusted.
    pub fn inflight_verdicts(&self) -> InflightVerdicts {
        let mut v = InflightVerdicts::default();
        if let Some(s) = self.balancer.service(SERVICE) {
            for e in s.endpoints().values() {
                v.binding += u32::from(e.inflight().estimate.binding);
                v.distrusted += u32::from(e.inflight().distrusted());
            }
            v.feed_forward_steps = s.stats.feed_forward_steps;
        }
        v
    }

    /// The in-flight verdict of endpoint `idx` after the last cycle, if it is known.
    pub fn inflight_estimate(&self, idx: usize) -> Option<InflightEstimate> {
        let svc = self.balancer.service(SERVICE)?;
        let node = self.names.get(idx)?;
        svc.endpoints().get(node).map(|e| e.inflight().estimate)
    }

    /// The published weights by endpoint index (0 for an unknown endpoint).
    pub fn weights(&self) -> Vec<f64> {
        let svc = self.balancer.service(SERVICE);
        self.names
            .iter()
            .map(|n| {
                svc.and_then(|s| s.endpoints().get(n))
                    .map(|e| e.weight())
                    .unwrap_or(0.0)
            })
            .collect()
    }
}
