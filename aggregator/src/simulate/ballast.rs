//! The adapter between the simulated fleet and the real balancing core.
//!
//! Nothing of the controller is copied here: reports go into
//! [`crate::balance::Balancer::observe`], cycles run
//! [`crate::balance::Balancer::cycle`], and the weights the clients apply are the
//! published `Endpoint::weight`s, read only when the cycle says they changed
//! materially, as the weight feeds do.

use super::fleet::Measurement;
use crate::balance::{BalanceError, Balancer, CycleResult, Observation, Params};

/// The one service the simulated fleet is.
pub const SERVICE: &str = "sim";

/// A `Balancer` with one service whose endpoints are numbered.
#[derive(Debug, Clone)]
pub struct BallastAdapter {
    balancer: Balancer,
    names: Vec<String>,
    seq: Vec<u32>,
}

fn name(idx: usize) -> String {
    // Zero-padded, so that the balancer's sorted map keeps index order.
    format!("ep-{idx:05}")
}

impl BallastAdapter {
    /// A balancer at `now` with `endpoints` registered endpoints.
    pub fn new(params: Params, endpoints: usize, now: u64) -> Result<Self, BalanceError> {
        let mut a = BallastAdapter {
            balancer: Balancer::new(params, now),
            names: Vec::new(),
            seq: Vec::new(),
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
            inflight: m.inflight,
            capacity: m.capacity,
            error_rate: Some(m.error_rate),
            draining: false,
        };
        self.balancer.observe(now, SERVICE, node, obs).map(|_| ())
    }

    /// Runs the aggregator's cycle.
    pub fn cycle(&mut self, now: u64) -> Option<CycleResult> {
        self.balancer.cycle_service(now, SERVICE)
    }

    /// The published weights by endpoint index (0 for an unknown endpoint).
    pub fn weights(&self) -> Vec<f64> {
        let svc = self.balancer.service(SERVICE);
        self.names
            .iter()
            .map(|n| {
                svc.and_then(|s| s.endpoints.get(n))
                    .map(|e| e.weight)
                    .unwrap_or(0.0)
            })
            .collect()
    }
}
