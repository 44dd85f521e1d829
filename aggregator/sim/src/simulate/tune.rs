//! The gain sweep that chose the PID defaults.
//!
//! Ballast alone runs the three scenarios that exercise the controller's dynamics —
//! the steady fleet from equal weights, the +50 % step and the cold join, each cut to
//! 100 cycles with the disturbance at cycle 40 — for every point of a small grid of
//! gains and [`SEEDS`] seeds. The transient curves are averaged over the seeds before
//! settling, overshoot and the newcomer's peak are read off them, because one run's
//! request noise alone moves those figures by a few per cent.
//!
//! A point is *admissible* when it meets the dynamic targets: overshoot at
//! most 5 % from equal weights and after the step, the step settled within 10 cycles,
//! and the newcomer never above 1.1× the average. Among admissible points the one
//! with the most margin to those limits wins (see [`margin`]); ties within 0.02 go to
//! the lower weight churn, since every material change is a write to the routing
//! store. Steady-state max/avg does not decide: every admissible point reaches about
//! 1.01 on the shortened runs, and their differences are below the noise.

use super::metrics::Metrics;
use super::scenario::{self, Scenario};
use super::strategy::StrategyKind;
use super::{engine, metrics, parallel, SimError};
use ballast_balance::PidGains;

/// Proportional gains tried.
pub const KP: [f64; 6] = [0.25, 0.3, 0.35, 0.4, 0.5, 0.6];
/// (integral, derivative) pairs tried with each proportional gain: pure P and P with
/// a derivative.
pub const KI_KD: [(f64, f64); 2] = [(0.0, 0.0), (0.0, 0.1)];
/// Points with an integral term, to show what it does. A wider sweep tried ki 0.05
/// and 0.1 with every kp and every kd: each of them overshot by 15 % or more, so
/// only these two stay, to keep the run short.
pub const INTEGRAL_PROBES: [(f64, f64, f64); 2] = [(0.3, 0.05, 0.0), (0.6, 0.05, 0.0)];
/// The defaults before this sweep chose new ones, kept on the grid for the record.
pub const PREVIOUS_DEFAULT: (f64, f64, f64) = (0.6, 0.05, 0.05);
/// Seeds per grid point (the run's seed and the next ones).
pub const SEEDS: u64 = 3;
/// The scenarios the sweep runs.
pub const SCENARIOS: [&str; 3] = ["steady", "step", "cold_join"];

/// One point of the grid and what it measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SweepRow {
    /// The gains (filter and integral limit as the defaults).
    pub gains: PidGains,
    /// Steady fleet: steady-state max/avg.
    pub steady_max_over_avg: f64,
    /// Steady fleet: cycles to settle from equal weights.
    pub steady_settle: Option<u32>,
    /// Steady fleet: overshoot from equal weights.
    pub steady_overshoot: Option<f64>,
    /// Steady fleet: weight churn per cycle.
    pub churn: Option<f64>,
    /// Step: steady-state max/avg after the step.
    pub step_max_over_avg: f64,
    /// Step: cycles to settle.
    pub step_settle: Option<u32>,
    /// Step: overshoot.
    pub step_overshoot: Option<f64>,
    /// Cold join: the newcomer's peak load over the average.
    pub cold_peak: f64,
    /// Cold join: cycles until the newcomer first carries 95 % of the average.
    pub cold_reach: Option<u32>,
    /// Whether it meets every dynamic target.
    pub admissible: bool,
}

/// The sweep's table and its choice.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sweep {
    /// Every grid point, in grid order.
    pub rows: Vec<SweepRow>,
    /// Index of the chosen row, if any point was admissible.
    pub chosen: Option<usize>,
    /// Index of the row with the shipped default gains, if they are on the grid.
    pub default_row: Option<usize>,
    /// Seeds averaged per point.
    pub seeds: u64,
}

impl Sweep {
    /// The chosen gains.
    pub fn chosen_gains(&self) -> Option<PidGains> {
        self.chosen.and_then(|i| self.rows.get(i)).map(|r| r.gains)
    }
}

/// The grid: every combination of [`KP`] and [`KI_KD`], then [`INTEGRAL_PROBES`] and
/// [`PREVIOUS_DEFAULT`] (one point in quick
/// mode), plus the shipped defaults if they are not on it.
pub fn grid(quick: bool) -> Vec<PidGains> {
    let base = PidGains::default();
    let mut out = Vec::new();
    if quick {
        out.push(PidGains {
            kp: 0.25,
            ki: 0.05,
            kd: 0.0,
            ..base
        });
    } else {
        for kp in KP {
            for (ki, kd) in KI_KD {
                out.push(PidGains { kp, ki, kd, ..base });
            }
        }
        for (kp, ki, kd) in INTEGRAL_PROBES.into_iter().chain([PREVIOUS_DEFAULT]) {
            out.push(PidGains { kp, ki, kd, ..base });
        }
    }
    if !out.contains(&base) {
        out.push(base);
    }
    out
}

fn admissible(r: &SweepRow) -> bool {
    let within = |o: Option<f64>| o.is_none_or(|x| x <= 0.05);
    within(r.steady_overshoot)
        && within(r.step_overshoot)
        && r.step_settle.is_some_and(|s| s <= 10)
        && r.cold_peak <= 1.1
}

/// How close a point comes to the nearest dynamic target, as a share of it (1 is on
/// the limit): overshoot against 5 %, step settling against 10 cycles, the newcomer's
/// excess over the average against 0.1. The chosen point is the one farthest inside
/// every limit, because the steady-state max/avg of the admissible points differ by
/// less than their noise.
pub fn margin(r: &SweepRow) -> f64 {
    let over = |o: Option<f64>| o.unwrap_or(0.0) / 0.05;
    let settle = r.step_settle.map_or(f64::INFINITY, |s| f64::from(s) / 10.0);
    over(r.steady_overshoot)
        .max(over(r.step_overshoot))
        .max(settle)
        .max((r.cold_peak - 1.0).max(0.0) / 0.1)
}

/// A scenario cut to at most 100 cycles with its disturbance at cycle 40 at the
/// latest: the sweep runs many of them, and 40 cycles are enough to converge from
/// equal weights with every gain on the grid.
pub fn shortened(s: &Scenario) -> Scenario {
    let mut s = s.clone();
    let shift = s.disturbance.saturating_sub(40);
    s.disturbance -= shift;
    for e in &mut s.events {
        e.cycle = e.cycle.saturating_sub(shift);
    }
    s.cycles = (s.cycles - shift).min(100);
    s.steady_from = (s.steady_from - shift).min(s.cycles.saturating_sub(30));
    s
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// The element-wise mean of equally long curves.
fn mean_curve<'a>(curves: impl Iterator<Item = &'a [f64]>) -> Vec<f64> {
    let curves: Vec<&[f64]> = curves.collect();
    let len = curves.iter().map(|c| c.len()).min().unwrap_or(0);
    (0..len)
        .map(|t| mean(curves.iter().map(|c| c[t])))
        .collect()
}

/// Settling and overshoot of the seed-averaged imbalance curve, or "no transient" if
/// any seed saw none.
fn dynamics(runs: &[Metrics]) -> (Option<u32>, Option<f64>) {
    if runs.is_empty() || runs.iter().any(|m| !m.transient.significant) {
        return (Some(0), None);
    }
    let curve = mean_curve(runs.iter().map(|m| m.transient.remaining.as_slice()));
    let noise = mean(runs.iter().map(|m| m.transient.noise)) / (runs.len() as f64).sqrt();
    let (settle, over) =
        metrics::settle_and_overshoot(&curve, metrics::SETTLE_BAND.max(2.0 * noise));
    (settle, Some(over))
}

/// Runs the sweep with `seed`.
pub fn sweep(seed: u64, quick: bool) -> Result<Sweep, SimError> {
    let all = scenario::all();
    let scenarios: Vec<Scenario> = SCENARIOS
        .iter()
        .filter_map(|id| all.iter().find(|s| s.id == *id))
        .map(|s| {
            let s = shortened(s);
            if quick {
                s.quick()
            } else {
                s
            }
        })
        .collect();
    let points = grid(quick);
    let seeds = if quick { 1 } else { SEEDS };
    let per = scenarios.len() * seeds as usize;
    let jobs: Vec<(usize, usize, u64)> = (0..points.len())
        .flat_map(|p| (0..scenarios.len()).flat_map(move |s| (0..seeds).map(move |k| (p, s, k))))
        .collect();
    let results: Vec<Metrics> = parallel(jobs.len(), |j| {
        let (p, s, k) = jobs[j];
        let sc = &scenarios[s];
        let rec = engine::simulate(sc, StrategyKind::Ballast, seed.wrapping_add(k), points[p])?;
        Ok(metrics::measure(sc, &rec))
    })?;
    let k = seeds as usize;
    let mut rows: Vec<SweepRow> = points
        .iter()
        .enumerate()
        .map(|(p, g)| {
            let m = &results[p * per..(p + 1) * per];
            let (steady, step, cold) = (&m[0..k], &m[k..2 * k], &m[2 * k..3 * k]);
            let (steady_settle, steady_overshoot) = dynamics(steady);
            let (step_settle, step_overshoot) = dynamics(step);
            let cold_curve = mean_curve(
                cold.iter()
                    .filter_map(|m| m.watched.as_ref())
                    .map(|w| w.curve.as_slice()),
            );
            let (cold_peak, cold_reach) = metrics::peak_and_reach(&cold_curve);
            let mut row = SweepRow {
                gains: *g,
                steady_max_over_avg: mean(steady.iter().map(|m| m.max_over_avg)),
                steady_settle,
                steady_overshoot,
                churn: steady[0]
                    .churn
                    .map(|_| mean(steady.iter().filter_map(|m| m.churn))),
                step_max_over_avg: mean(step.iter().map(|m| m.max_over_avg)),
                step_settle,
                step_overshoot,
                cold_peak,
                cold_reach,
                admissible: false,
            };
            row.admissible = admissible(&row);
            row
        })
        .collect();
    let mut chosen: Option<usize> = None;
    for (i, r) in rows.iter().enumerate().filter(|(_, r)| r.admissible) {
        chosen = match chosen {
            None => Some(i),
            Some(c) => {
                let best = &rows[c];
                let (m, mb) = (margin(r), margin(best));
                let better = m < mb - 0.02
                    || ((m - mb).abs() <= 0.02
                        && r.churn.unwrap_or(0.0) < best.churn.unwrap_or(0.0));
                Some(if better { i } else { c })
            }
        };
    }
    let default_row = rows.iter().position(|r| r.gains == PidGains::default());
    rows.shrink_to_fit();
    Ok(Sweep {
        rows,
        chosen,
        default_row,
        seeds,
    })
}
