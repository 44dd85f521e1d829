//! The strategies compared: what each client does with its subset, and where the
//! weights come from.
//!
//! Round robin, power of two choices and gRPC's A58 weighted round robin are
//! client-side algorithms and live here whole. Ballast's weights come from the real
//! balancing core through [`BallastAdapter`]; clients apply them with an earliest
//! deadline first scheduler (as Envoy's weighted round robin and Robinhood's custom
//! gRPC picker do), or with Envoy's weighted least request.

use super::ballast::BallastAdapter;
use super::fleet::{Client, InflightMeasure, Measurement};
use super::scenario::FleetSpec;
use ballast_balance::{BalanceError, LoadMetric, Params};
use rand::rngs::SmallRng;
use rand::Rng;

/// gRPC A58's `blackout_period`: a new endpoint's weight is ignored this long.
const A58_BLACKOUT_MS: u64 = 10_000;
/// gRPC A58's `error_utilization_penalty` default.
const A58_ERROR_PENALTY: f64 = 1.0;

/// How the agents that feed Ballast measure in-flight requests and what capacity
/// they are configured with: the connection-counting source and the capacity decide
/// whether the in-flight term of the load carries load information at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct AgentConfig {
    /// What the in-flight source counts.
    pub measure: InflightMeasure,
    /// The configured capacity; 0 (the shipped default) leaves the in-flight count
    /// to be judged against the fleet's typical value.
    pub capacity: u32,
}

impl AgentConfig {
    /// The shipped agent: connections that owe a response, no capacity.
    pub const SHIPPED: AgentConfig = AgentConfig {
        measure: InflightMeasure::Owed,
        capacity: 0,
    };
    /// The agent before connections owing a response: established connections
    /// against a capacity of 100.
    pub const OLD_DEFAULT: AgentConfig = AgentConfig {
        measure: InflightMeasure::Established,
        capacity: 100,
    };

    /// The agents of a fleet as its scenario configures them.
    pub fn of(spec: &FleetSpec) -> Self {
        AgentConfig {
            measure: spec.inflight,
            capacity: spec.capacity,
        }
    }

    /// How tables name it.
    pub fn label(self) -> String {
        let cap = if self.capacity == 0 {
            "fleet-relative (capacity 0)".to_string()
        } else {
            format!("capacity {}", self.capacity)
        };
        let what = format!("{}, {cap}", self.measure.label());
        if self == AgentConfig::SHIPPED {
            format!("new default: {what}")
        } else if self == AgentConfig::OLD_DEFAULT {
            format!("old default: {what}")
        } else {
            what
        }
    }
}

/// A load balancing strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyKind {
    /// Each client rotates through its subset: equal weights.
    RoundRobin,
    /// Ballast PID weights from `max(cpu, in-flight term)`, applied by weighted round
    /// robin, with the scenario's agents.
    Ballast,
    /// Ballast as [`StrategyKind::Ballast`], with agents configured as given rather
    /// than as the scenario's default: to compare in-flight sources and capacities on
    /// the same fleet.
    BallastAgent(AgentConfig),
    /// Static weights proportional to each endpoint's cores × speed, applied by
    /// weighted round robin: what a perfectly informed static configuration would do,
    /// the reference for the step response. It does not see connection skew.
    Oracle,
    /// Ballast steering by CPU alone (`LoadMetric::Cpu`), to show the dead spiral.
    BallastCpuOnly,
    /// gRPC A58 client-side weighted round robin: `qps / (util + eps/qps × penalty)`
    /// from each endpoint's own (ORCA) reports.
    A58,
    /// Power of two choices on the client's own in-flight counts.
    P2c,
    /// Envoy least request with Ballast's weights: `weight / (active + 1)^1`.
    EnvoyLeastRequest,
}

impl StrategyKind {
    /// Short name for tables and file names.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::RoundRobin => "round_robin",
            StrategyKind::Ballast => "ballast",
            StrategyKind::BallastAgent(_) => "ballast_agent",
            StrategyKind::Oracle => "oracle",
            StrategyKind::BallastCpuOnly => "ballast_cpu_only",
            StrategyKind::A58 => "a58_wrr",
            StrategyKind::P2c => "p2c",
            StrategyKind::EnvoyLeastRequest => "envoy_wlr",
        }
    }

    /// Human label for tables and charts.
    pub fn label(self) -> String {
        match self {
            StrategyKind::RoundRobin => "round robin".to_string(),
            StrategyKind::Ballast => "Ballast PID".to_string(),
            StrategyKind::BallastAgent(a) => format!("Ballast, {}", a.label()),
            StrategyKind::Oracle => "static weights by cores × speed".to_string(),
            StrategyKind::BallastCpuOnly => "Ballast PID, CPU only".to_string(),
            StrategyKind::A58 => "gRPC A58 WRR".to_string(),
            StrategyKind::P2c => "P2C least request".to_string(),
            StrategyKind::EnvoyLeastRequest => "Envoy WLR + Ballast".to_string(),
        }
    }

    /// Whether it is driven by the Ballast balancer.
    pub fn uses_ballast(self) -> bool {
        matches!(
            self,
            StrategyKind::Ballast
                | StrategyKind::BallastAgent(_)
                | StrategyKind::BallastCpuOnly
                | StrategyKind::EnvoyLeastRequest
        )
    }

    /// Whether it applies weights (and so has a weight churn).
    pub fn has_weights(self) -> bool {
        self.uses_ballast() || matches!(self, StrategyKind::A58 | StrategyKind::Oracle)
    }
}

/// A client's scheduler state.
#[derive(Debug, Clone)]
pub struct PickerState {
    rr_next: usize,
    deadline: Vec<f64>,
    weight: Vec<f64>,
    vnow: f64,
}

impl PickerState {
    /// State for `slots` subset slots, with a random round-robin start so that clients
    /// do not move in step.
    pub fn new(slots: usize, rng: &mut SmallRng) -> Self {
        PickerState {
            rr_next: if slots > 0 {
                rng.gen_range(0..slots)
            } else {
                0
            },
            deadline: (0..slots).map(|_| rng.gen::<f64>()).collect(),
            weight: vec![1.0; slots],
            vnow: 0.0,
        }
    }

    /// The weight each subset slot has in this client's scheduler (1 for every slot
    /// of strategies without weights).
    pub fn weights(&self) -> &[f64] {
        &self.weight
    }

    /// Makes room for one more slot; it gets a weight at the next rebuild.
    pub fn add_slot(&mut self) {
        self.deadline.push(self.vnow + 1.0);
        self.weight.push(1.0);
    }

    fn round_robin(&mut self, n: usize) -> usize {
        let s = self.rr_next % n;
        self.rr_next = (s + 1) % n;
        s
    }

    /// Earliest deadline first. With `active`, a pick pushes the slot's next deadline
    /// out by `(active + 1) / weight`, which is Envoy's least request with weights.
    fn edf(&mut self, active: Option<&[u32]>) -> usize {
        let mut best = usize::MAX;
        let mut at = f64::INFINITY;
        for (i, &d) in self.deadline.iter().enumerate() {
            if d < at {
                at = d;
                best = i;
            }
        }
        if best == usize::MAX {
            // Every weight is 0: nothing better to do than rotate.
            return self.round_robin(self.deadline.len().max(1));
        }
        self.vnow = at;
        let k = active
            .and_then(|a| a.get(best))
            .map_or(1.0, |&a| f64::from(a) + 1.0);
        self.deadline[best] = at + k / self.weight[best];
        best
    }

    /// Installs new weights, restarting the schedule at random offsets (as gRPC
    /// rebuilds its scheduler on every weight update).
    fn rebuild(&mut self, weights: impl Iterator<Item = f64>, rng: &mut SmallRng) {
        for (i, w) in weights.enumerate() {
            let w = if w.is_finite() && w > 0.0 { w } else { 0.0 };
            if let (Some(slot_w), Some(d)) = (self.weight.get_mut(i), self.deadline.get_mut(i)) {
                *slot_w = w;
                *d = if w > 0.0 {
                    self.vnow + rng.gen::<f64>() / w
                } else {
                    f64::INFINITY
                };
            }
        }
    }
}

/// A58's per-endpoint state, as every client computes it from the endpoint's own
/// server-wide reports.
#[derive(Debug, Clone, Copy, Default)]
struct A58Endpoint {
    weight: f64,
    non_empty_since: Option<u64>,
}

/// What a cycle of the strategy did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CycleOutcome {
    /// Why Ballast skipped the update, if it did.
    pub skipped: Option<&'static str>,
}

/// One strategy's running state.
#[derive(Debug, Clone)]
pub struct Strategy {
    /// Which strategy.
    pub kind: StrategyKind,
    ballast: Option<BallastAdapter>,
    weights: Vec<f64>,
    a58: Vec<A58Endpoint>,
    dirty: bool,
}

impl Strategy {
    /// A strategy for endpoints of `capacities` (cores × speed each) at time `now`;
    /// `params` are Ballast's and `agent` how the scenario's agents measure in-flight
    /// requests (a [`StrategyKind::BallastAgent`] brings its own).
    pub fn new(
        kind: StrategyKind,
        params: &Params,
        capacities: &[f64],
        now: u64,
        agent: AgentConfig,
    ) -> Result<Self, BalanceError> {
        let endpoints = capacities.len();
        let ballast = if kind.uses_ballast() {
            let mut p = params.clone();
            if kind == StrategyKind::BallastCpuOnly {
                p.metric = LoadMetric::Cpu;
            }
            let agent = match kind {
                StrategyKind::BallastAgent(a) => a,
                _ => agent,
            };
            Some(BallastAdapter::new(p, endpoints, now, agent)?)
        } else {
            None
        };
        let mut s = Strategy {
            kind,
            ballast,
            weights: vec![1.0; endpoints],
            a58: vec![A58Endpoint::default(); endpoints],
            dirty: true,
        };
        if let Some(b) = &s.ballast {
            s.weights = b.weights();
        }
        if kind == StrategyKind::Oracle {
            s.weights = capacities.to_vec();
        }
        Ok(s)
    }

    /// Picks a slot of `client`'s subset for one request.
    pub fn pick(&self, client: &mut Client, rng: &mut SmallRng) -> usize {
        let n = client.subset.len();
        if n == 0 {
            return 0;
        }
        match self.kind {
            StrategyKind::RoundRobin => client.picker.round_robin(n),
            StrategyKind::Ballast
            | StrategyKind::BallastAgent(_)
            | StrategyKind::BallastCpuOnly
            | StrategyKind::A58
            | StrategyKind::Oracle => client.picker.edf(None),
            StrategyKind::EnvoyLeastRequest => client.picker.edf(Some(&client.inflight)),
            StrategyKind::P2c => {
                if n == 1 {
                    return 0;
                }
                let a = rng.gen_range(0..n);
                let mut b = rng.gen_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                if client.inflight[b] < client.inflight[a] {
                    b
                } else {
                    a
                }
            }
        }
    }

    /// An endpoint's agent reported; `delivered` is false if the report was lost on
    /// the way to the aggregator (A58's own reports travel on the client's
    /// connection and are not subject to it).
    pub fn report(
        &mut self,
        now: u64,
        idx: usize,
        m: &Measurement,
        delivered: bool,
    ) -> Result<(), BalanceError> {
        if let Some(b) = &mut self.ballast {
            if delivered {
                b.observe(now, idx, m)?;
            }
        }
        if self.kind == StrategyKind::A58 {
            if let Some(e) = self.a58.get_mut(idx) {
                if m.qps > 0.0 && m.cpu > 0.0 {
                    let util = m.cpu + m.eps / m.qps * A58_ERROR_PENALTY;
                    e.weight = m.qps / util;
                    e.non_empty_since.get_or_insert(now);
                } else {
                    e.weight = 0.0;
                    e.non_empty_since = None;
                }
            }
        }
        Ok(())
    }

    /// The aggregator's cycle (Ballast) or the weight update period (A58).
    pub fn cycle(&mut self, now: u64) -> CycleOutcome {
        let mut out = CycleOutcome::default();
        if let Some(b) = &mut self.ballast {
            if let Some(r) = b.cycle(now) {
                out.skipped = r.skipped.map(|s| s.label());
                if r.changed {
                    self.weights = b.weights();
                    self.dirty = true;
                }
            }
        }
        if self.kind == StrategyKind::A58 {
            for (w, e) in self.weights.iter_mut().zip(&self.a58) {
                let usable = e
                    .non_empty_since
                    .is_some_and(|t| now.saturating_sub(t) >= A58_BLACKOUT_MS);
                // 0 means "no weight": the client substitutes the mean.
                *w = if usable { e.weight } else { 0.0 };
            }
            self.dirty = true;
        }
        out
    }

    /// A cold endpoint of `capacity` (cores × speed) joined at `now`.
    pub fn join(&mut self, now: u64, idx: usize, capacity: f64) -> Result<(), BalanceError> {
        while self.weights.len() <= idx {
            self.weights.push(1.0);
            self.a58.push(A58Endpoint::default());
        }
        if self.kind == StrategyKind::Oracle {
            self.weights[idx] = capacity;
        }
        if let Some(b) = &mut self.ballast {
            b.register(now, idx)?;
            // Discovery announces the endpoint with the weight it has now.
            self.weights = b.weights();
        }
        self.dirty = true;
        Ok(())
    }

    /// Clients appeared: every scheduler gets the weights at the next publish.
    pub fn invalidate(&mut self) {
        self.dirty = true;
    }

    /// Hands changed weights to the clients' schedulers.
    pub fn publish(&mut self, clients: &mut [Client], rng: &mut SmallRng) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        match self.kind {
            StrategyKind::RoundRobin | StrategyKind::P2c => {}
            StrategyKind::A58 => {
                for c in clients {
                    let known: Vec<f64> = c
                        .subset
                        .iter()
                        .map(|&e| self.weights.get(e as usize).copied().unwrap_or(0.0))
                        .collect();
                    let (sum, n) = known
                        .iter()
                        .filter(|w| **w > 0.0)
                        .fold((0.0, 0usize), |(s, n), w| (s + w, n + 1));
                    // A58: endpoints without a usable weight get the mean of the others.
                    let mean = if n > 0 { sum / n as f64 } else { 1.0 };
                    c.picker.rebuild(
                        known.into_iter().map(|w| if w > 0.0 { w } else { mean }),
                        rng,
                    );
                }
            }
            _ => {
                for c in clients {
                    let w = &self.weights;
                    c.picker.rebuild(
                        c.subset
                            .iter()
                            .map(|&e| w.get(e as usize).copied().unwrap_or(0.0)),
                        rng,
                    );
                }
            }
        }
    }

    /// What Ballast's last cycle made of the in-flight counts; `None` without Ballast.
    pub fn inflight_verdicts(&self) -> Option<super::ballast::InflightVerdicts> {
        self.ballast.as_ref().map(BallastAdapter::inflight_verdicts)
    }

    /// Ballast's in-flight verdict on endpoint `idx` after its last cycle.
    pub fn inflight_estimate(
        &self,
        idx: usize,
    ) -> Option<ballast_balance::inflight::InflightEstimate> {
        self.ballast.as_ref()?.inflight_estimate(idx)
    }

    /// The weights in force, for churn figures; `None` for strategies without weights.
    pub fn weights(&self) -> Option<&[f64]> {
        self.kind.has_weights().then_some(self.weights.as_slice())
    }
}
