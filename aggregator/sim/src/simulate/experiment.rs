//! Experiments behind the changes this simulator recommends for the balancing core.
//!
//! The core cannot be changed from here, so an experiment runs a scenario twice with
//! Ballast, once as shipped and once with a parameter that approximates the proposed
//! change, and the report shows both.

use super::metrics::{self, Metrics};
use super::scenario;
use super::strategy::StrategyKind;
use super::{engine, parallel, SimError};
use ballast_balance::{Params, PidGains};

/// Seeds per experiment: a single run's max/avg moves by about as much as the
/// effects measured here.
pub const SEEDS: u64 = 4;

/// One arm of an experiment: per seed, the steady-state max/avg and the cycles
/// Ballast skipped.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Arm {
    /// Steady-state max/avg per seed.
    pub max_over_avg: Vec<f64>,
    /// Skipped cycles per seed.
    pub skipped: Vec<u32>,
}

impl Arm {
    fn push(&mut self, m: &Metrics) {
        self.max_over_avg.push(m.max_over_avg);
        self.skipped.push(m.skipped.values().sum());
    }

    /// Mean max/avg over the seeds.
    pub fn mean(&self) -> f64 {
        self.max_over_avg.iter().sum::<f64>() / self.max_over_avg.len().max(1) as f64
    }

    /// Mean skipped cycles over the seeds.
    pub fn mean_skipped(&self) -> f64 {
        f64::from(self.skipped.iter().sum::<u32>()) / self.skipped.len().max(1) as f64
    }
}

/// One experiment: Ballast as shipped against Ballast with a change, on the same
/// seeds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Experiment {
    /// Short name.
    pub name: &'static str,
    /// The scenario it runs.
    pub scenario: &'static str,
    /// What the variant changes.
    pub change: &'static str,
    /// Ballast as shipped (with the gains of the run).
    pub base: Arm,
    /// Ballast with the change.
    pub variant: Arm,
}

/// Runs every experiment with `gains`.
pub fn run_all(seed: u64, gains: PidGains, quick: bool) -> Result<Vec<Experiment>, SimError> {
    let base = Params {
        grace_ms: 0,
        pid: gains,
        ..Params::default()
    };
    // No experiment is pending: the last one (holding the weight of an endpoint whose
    // report was lost, instead of repeating its last error) is now how the core works.
    let plans: [(&'static str, &'static str, &'static str, &Params); 0] = [];
    let all = scenario::all();
    let seeds = if quick { 1 } else { SEEDS };
    let mut jobs = Vec::new();
    for (i, (_, id, _, variant)) in plans.iter().enumerate() {
        let Some(sc) = all.iter().find(|s| s.id == *id) else {
            continue;
        };
        let sc = if quick { sc.quick() } else { sc.clone() };
        for k in 0..seeds {
            jobs.push((i, false, k, sc.clone(), base.clone()));
            jobs.push((i, true, k, sc.clone(), (*variant).clone()));
        }
    }
    let results = parallel(jobs.len(), |j| {
        let (_, _, k, sc, p) = &jobs[j];
        let rec = engine::simulate_with(sc, StrategyKind::Ballast, seed.wrapping_add(*k), p)?;
        Ok(metrics::measure(sc, &rec))
    })?;
    let mut out: Vec<Experiment> = plans
        .iter()
        .map(|(name, scenario, change, _)| Experiment {
            name,
            scenario,
            change,
            base: Arm::default(),
            variant: Arm::default(),
        })
        .collect();
    for ((i, is_variant, ..), m) in jobs.iter().zip(&results) {
        if let Some(e) = out.get_mut(*i) {
            if *is_variant {
                e.variant.push(m);
            } else {
                e.base.push(m);
            }
        }
    }
    out.retain(|e| !e.base.max_over_avg.is_empty());
    Ok(out)
}
