//! Experiments behind the changes this simulator recommends for the balancing core.
//!
//! The core cannot be changed from here, so an experiment runs a scenario twice with
//! Ballast, once as shipped and once with a parameter that approximates the proposed
//! change, and the report shows both.

use super::metrics::{self, Metrics};
use super::scenario;
use super::strategy::StrategyKind;
use super::{engine, parallel, SimError};
use crate::balance::{Params, PidGains};

/// One experiment's two runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Experiment {
    /// Short name.
    pub name: &'static str,
    /// The scenario it runs.
    pub scenario: &'static str,
    /// What the variant changes.
    pub change: &'static str,
    /// Ballast as shipped (with the gains of the run).
    pub base: Metrics,
    /// Ballast with the change.
    pub variant: Metrics,
}

/// Runs every experiment with `gains`.
pub fn run_all(seed: u64, gains: PidGains, quick: bool) -> Result<Vec<Experiment>, SimError> {
    let base = Params {
        grace_ms: 0,
        pid: gains,
        ..Params::default()
    };
    // Stale reports: an endpoint that missed a report or two is still fresh under the
    // 3 s bound, and every cycle applies its last error again. A 1 s bound makes it
    // missing (weight held) instead, which is what updating only on a new report
    // would do, at the cost of more cycles skipped by the 15 % rule.
    let one_report = Params {
        stale_ms: base.cycle_ms,
        ..base.clone()
    };
    let plans: [(&'static str, &'static str, &'static str, &Params); 1] = [(
        "stale_reports",
        "loss_10",
        "staleness bound 1 s instead of 3 s, so that a lost report holds the weight",
        &one_report,
    )];
    let all = scenario::all();
    let mut jobs = Vec::new();
    for (i, (_, id, _, variant)) in plans.iter().enumerate() {
        let Some(sc) = all.iter().find(|s| s.id == *id) else {
            continue;
        };
        let sc = if quick { sc.quick() } else { sc.clone() };
        jobs.push((i, sc.clone(), base.clone()));
        jobs.push((i, sc, (*variant).clone()));
    }
    let results = parallel(jobs.len(), |j| {
        let (_, sc, p) = &jobs[j];
        let rec = engine::simulate_with(sc, StrategyKind::Ballast, seed, p)?;
        Ok(metrics::measure(sc, &rec))
    })?;
    let mut out = Vec::new();
    for (pair, runs) in jobs.chunks(2).zip(results.chunks(2)) {
        let i = pair[0].0;
        let (name, scenario, change, _) = plans[i];
        if let [b, v] = runs {
            out.push(Experiment {
                name,
                scenario,
                change,
                base: b.clone(),
                variant: v.clone(),
            });
        }
    }
    Ok(out)
}
