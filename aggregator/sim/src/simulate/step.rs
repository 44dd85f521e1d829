//! The step response of the balancer's first moves: from equal weights, how many
//! cycles Ballast needs to bring max/avg within 5 % of what a perfectly informed
//! static configuration gets, with and without the core's feed-forward first step;
//! and after the step or the join, how many cycles until max/avg is back to its
//! level before.
//!
//! The reference ("oracle") is static weights proportional to each endpoint's cores ×
//! speed ([`StrategyKind::Oracle`]). It knows the hardware but not the connection
//! skew, so Ballast ends below it; the figure here is how fast it gets there.
//!
//! Max/avg is read from the load the weights in force imply
//! (`Fleet::implied_max_over_avg`: each endpoint's expected rate from the clients'
//! rates and weights, over its cores × speed), not from one second's measured load:
//! that carries request noise (a few hundred heavy-tailed requests per endpoint per
//! second put one-second max/avg near 1.25 even at perfect weights), which is as
//! large as the whole difference between the oracle and a balanced fleet. The
//! curves are averaged over [`SEEDS`] seeds.

use super::scenario::{self, Scenario};
use super::strategy::{AgentConfig, StrategyKind};
use super::{engine, parallel, SimError};
use ballast_balance::{Params, PidGains};

/// The scenarios whose transients are measured.
pub const SCENARIOS: [&str; 2] = ["step", "cold_join"];
/// Seeds averaged per curve (the run's seed and the next ones).
pub const SEEDS: u64 = 3;
/// "Within 5 %": max/avg at most `(1 + WITHIN)` × the reference.
pub const WITHIN: f64 = 0.05;
/// Cycles max/avg must stay within the band to count, so that one lucky cycle does
/// not.
pub const HOLD: usize = 3;
/// Cycles before the disturbance whose mean is the level to return to after it.
pub const LEVEL_WINDOW: usize = 20;
/// Cycles of the curves drawn after the disturbance.
pub const SHOWN: usize = 30;

/// Agents whose in-flight term never binds on a healthy node of this fleet (a
/// capacity of 32 against 3 to 6 requests in flight): the arm that shows the
/// feed-forward step on CPU alone, whatever the fleet-relative judgement does.
pub const CPU_BOUND_AGENT: AgentConfig = AgentConfig {
    capacity: 32,
    ..AgentConfig::SHIPPED
};

/// Ballast's parameters without the feed-forward first step, for the arms that show
/// what the step buys.
pub fn without_feed_forward(params: &Params) -> Params {
    Params {
        feed_forward: false,
        ..params.clone()
    }
}

/// One arm: the oracle, or Ballast with some agents, with or without feed-forward.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Arm {
    /// What ran.
    pub kind: StrategyKind,
    /// Whether feed-forward was on (Ballast only).
    pub feed_forward: bool,
    /// Per-cycle max/avg of the load the weights imply, averaged over the seeds.
    pub curve: Vec<f64>,
    /// Cycles from equal weights (cycle 0) until max/avg is within [`WITHIN`] of the
    /// oracle's.
    pub to_oracle: Option<u32>,
    /// Its own level before the disturbance: the mean of the [`LEVEL_WINDOW`] cycles
    /// before it.
    pub level: f64,
    /// Cycles from the disturbance until max/avg is back within [`WITHIN`] of
    /// `level` (0 if it never left).
    pub recovery: Option<u32>,
    /// Feed-forward steps the core took, mean per seed.
    pub feed_forward_steps: f64,
    /// Mean number of endpoints per cycle whose load the in-flight term set, before
    /// the disturbance.
    pub inflight_binding: f64,
}

impl Arm {
    /// Label for tables and charts.
    pub fn label(&self) -> String {
        match self.kind {
            StrategyKind::Oracle => self.kind.label(),
            k => format!(
                "{}, {}",
                k.label(),
                if self.feed_forward {
                    "feed-forward"
                } else {
                    "no feed-forward"
                }
            ),
        }
    }
}

/// One scenario's step response.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepResponse {
    /// The scenario id.
    pub scenario: &'static str,
    /// Its title.
    pub title: &'static str,
    /// The cycle of its disturbance.
    pub disturbance: u32,
    /// The oracle's max/avg before the disturbance (its mean from cycle 1).
    pub oracle_before: f64,
    /// The oracle first, then Ballast with the shipped agents with and without
    /// feed-forward, then Ballast with [`CPU_BOUND_AGENT`] with and without.
    pub arms: Vec<Arm>,
    /// Seeds averaged.
    pub seeds: u64,
}

impl StepResponse {
    /// Ballast with the shipped agents, with (`true`) or without feed-forward.
    pub fn shipped(&self, feed_forward: bool) -> Option<&Arm> {
        self.arms
            .iter()
            .find(|a| a.kind == StrategyKind::Ballast && a.feed_forward == feed_forward)
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// The first cycle from `start` on at which `curve` is at most `limit` for [`HOLD`]
/// cycles in a row (or to `end`), counted from `start`.
pub fn cycles_within(curve: &[f64], start: usize, end: usize, limit: f64) -> Option<u32> {
    let end = end.min(curve.len());
    (start..end)
        .find(|&c| curve[c..(c + HOLD).min(end)].iter().all(|&x| x <= limit))
        .and_then(|c| u32::try_from(c - start).ok())
}

/// What one run gives an arm.
struct Run {
    implied: Vec<f64>,
    feed_forward_steps: u64,
    binding: Vec<u32>,
}

/// Runs every scenario of [`SCENARIOS`] under the oracle and Ballast with and
/// without feed-forward, with `gains`.
pub fn run(seed: u64, gains: PidGains, quick: bool) -> Result<Vec<StepResponse>, SimError> {
    let all = scenario::all();
    let scenarios: Vec<Scenario> = SCENARIOS
        .iter()
        .filter_map(|id| all.iter().find(|s| s.id == *id))
        .map(|s| if quick { s.quick() } else { s.clone() })
        .collect();
    let with = Params {
        grace_ms: 0,
        pid: gains,
        ..Params::default()
    };
    let without = without_feed_forward(&with);
    let cpu_bound = StrategyKind::BallastAgent(CPU_BOUND_AGENT);
    let arms: [(StrategyKind, &Params); 5] = [
        (StrategyKind::Oracle, &with),
        (StrategyKind::Ballast, &with),
        (StrategyKind::Ballast, &without),
        (cpu_bound, &with),
        (cpu_bound, &without),
    ];
    let seeds = if quick { 1 } else { SEEDS };
    let jobs: Vec<(usize, usize, u64)> = (0..scenarios.len())
        .flat_map(|s| (0..arms.len()).flat_map(move |a| (0..seeds).map(move |k| (s, a, k))))
        .collect();
    let runs = parallel(jobs.len(), |j| {
        let (s, a, k) = jobs[j];
        let (kind, params) = arms[a];
        let rec = engine::simulate_with(&scenarios[s], kind, seed.wrapping_add(k), params)?;
        Ok(Run {
            implied: rec.implied,
            feed_forward_steps: rec.feed_forward_steps,
            binding: rec.inflight_binding,
        })
    })?;
    let per = seeds as usize;
    let mut out = Vec::new();
    for (s, sc) in scenarios.iter().enumerate() {
        let dist = sc.disturbance as usize;
        let group = |a: usize| {
            let first = (s * arms.len() + a) * per;
            &runs[first..first + per]
        };
        let curve_of = |a: usize| -> Vec<f64> {
            let g = group(a);
            let len = g.iter().map(|r| r.implied.len()).min().unwrap_or(0);
            (0..len)
                .map(|c| mean(&g.iter().map(|r| r.implied[c]).collect::<Vec<_>>()))
                .collect()
        };
        let oracle_before = mean(curve_of(0).get(1..dist).unwrap_or(&[]));
        let made: Vec<Arm> = arms
            .iter()
            .enumerate()
            .map(|(a, (kind, params))| {
                let curve = curve_of(a);
                let level = mean(
                    curve
                        .get(dist.saturating_sub(LEVEL_WINDOW)..dist)
                        .unwrap_or(&[]),
                );
                let g = group(a);
                let binding: Vec<f64> = g
                    .iter()
                    .flat_map(|r| r.binding.iter().take(dist).map(|&b| f64::from(b)))
                    .collect();
                Arm {
                    kind: *kind,
                    feed_forward: params.feed_forward,
                    to_oracle: cycles_within(&curve, 0, dist, oracle_before * (1.0 + WITHIN)),
                    level,
                    recovery: cycles_within(&curve, dist, curve.len(), level * (1.0 + WITHIN)),
                    feed_forward_steps: mean(
                        &g.iter()
                            .map(|r| r.feed_forward_steps as f64)
                            .collect::<Vec<_>>(),
                    ),
                    inflight_binding: mean(&binding),
                    curve,
                }
            })
            .collect();
        out.push(StepResponse {
            scenario: sc.id,
            title: sc.title,
            disturbance: sc.disturbance,
            oracle_before,
            arms: made,
            seeds,
        });
    }
    Ok(out)
}
