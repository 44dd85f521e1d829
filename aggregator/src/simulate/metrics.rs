//! The figures of issue 3, derived from a run's recording.
//!
//! Request-level noise is large at one-second resolution (a few hundred heavy-tailed
//! requests per endpoint per second), so every figure says over what it averages:
//! - steady-state ratios use each endpoint's mean load over the steady window, which
//!   is what a fleet is sized against;
//! - the charts and the "5 s" ratio use a trailing 5-cycle mean per endpoint, like a
//!   dashboard at 5 s resolution;
//! - settling and overshoot follow the *imbalance pattern* of the disturbance (see
//!   [`Transient`]), which averages the noise out across endpoints.

use super::engine::Recording;
use super::scenario::Scenario;
use crate::balance::Spread;
use std::collections::BTreeMap;

/// Cycles a run must stay inside the band to count as settled.
pub const SETTLE_HOLD: usize = 10;
/// The settling band: residual imbalance within 5 % of the initial one.
pub const SETTLE_BAND: f64 = 0.05;
/// Cycles after the disturbance in which overshoot is looked for.
pub const OVERSHOOT_HORIZON: usize = 30;
/// Trailing window of the charts and the 5 s ratio, in cycles.
pub const CHART_WINDOW: usize = 5;

/// Utilization quantiles per cycle, for the charts.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Series {
    /// Highest endpoint load.
    pub max: Vec<f64>,
    /// 95th percentile.
    pub p95: Vec<f64>,
    /// Mean.
    pub avg: Vec<f64>,
    /// 5th percentile.
    pub p5: Vec<f64>,
}

/// The step response of the imbalance after a disturbance.
///
/// With `D_i` each endpoint's deviation from its steady load ratio in the first
/// cycle after the disturbance, and `d_i(t)` the same deviation later (3-cycle
/// centred mean), `a(t) = Σ D_i d_i(t) / Σ D_i²` is the share of the initial
/// imbalance pattern still present: 1 at the disturbance, 0 when it is corrected,
/// negative if the controller pushed past balance (overshoot).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Transient {
    /// RMS of the initial deviations `D`.
    pub initial_rms: f64,
    /// `a(t)` from the disturbance on.
    pub remaining: Vec<f64>,
    /// Standard deviation of `a(t)` over the steady window: its noise floor.
    pub noise: f64,
    /// Standard deviation of one endpoint's one-cycle load ratio in the steady window.
    pub cycle_noise: f64,
}

/// The endpoint a scenario watches.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Watched {
    /// Highest 3-cycle mean of its load over the average, in the first
    /// [`OVERSHOOT_HORIZON`] cycles after the disturbance.
    pub peak_ratio: f64,
    /// Its mean load over the average in the steady window.
    pub steady_ratio: f64,
    /// Cycles until its 3-cycle mean load first reached 95 % of the average.
    pub cycles_to_reach: Option<u32>,
    /// Highest in-flight count at a cycle's end, from the disturbance on.
    pub peak_inflight: u32,
    /// In-flight count at the end of the run.
    pub final_inflight: u32,
}

/// Figures of one strategy in one scenario.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Metrics {
    /// Steady-state max/avg of per-endpoint mean load.
    pub max_over_avg: f64,
    /// Steady-state p95/avg of per-endpoint mean load.
    pub p95_over_avg: f64,
    /// Steady-state p5/avg of per-endpoint mean load.
    pub p5_over_avg: f64,
    /// Mean over the steady window of max/avg at 5 s resolution (the charts' view).
    pub max_over_avg_5s: f64,
    /// Cycles from the disturbance until the imbalance stays within 5 % of its initial
    /// size for [`SETTLE_HOLD`] cycles; `Some(0)` when the disturbance caused no
    /// imbalance above the noise, `None` if it never settled.
    pub settle_cycles: Option<u32>,
    /// How far past balance the imbalance went, as a share of the initial imbalance;
    /// `None` when there was no transient to speak of.
    pub overshoot: Option<f64>,
    /// Noise floor of the overshoot and settling figures.
    pub transient_noise: f64,
    /// Mean weight moved per cycle in the steady window, as a share of the total
    /// weight; `None` for strategies without weights.
    pub churn: Option<f64>,
    /// Share of requests, from the disturbance on, that arrived at an endpoint whose
    /// load over that cycle exceeded 1.
    pub overloaded_share: f64,
    /// Share of requests that failed, from the disturbance on.
    pub error_share: f64,
    /// 99th percentile latency from the disturbance on, in ms.
    pub p99_latency_ms: f64,
    /// Ballast's skipped cycles by reason.
    pub skipped: BTreeMap<String, u32>,
    /// The watched endpoint, if the scenario has one.
    pub watched: Option<Watched>,
    /// Utilization quantiles per cycle (5 s trailing means).
    pub series: Series,
    /// Max/avg per cycle at 5 s resolution.
    pub ratio: Vec<f64>,
    /// The imbalance step response.
    pub transient: Transient,
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Per cycle, each endpoint's load over the fleet average (absent endpoints: None).
fn ratios(load: &[Vec<f64>]) -> Vec<Vec<f64>> {
    load.iter()
        .map(|row| {
            let avg = mean(row.iter().copied());
            row.iter()
                .map(|&l| if avg > 0.0 { l / avg } else { 1.0 })
                .collect()
        })
        .collect()
}

/// Mean of endpoint `i`'s value over cycles `from..to` where it is present.
fn endpoint_mean(rows: &[Vec<f64>], i: usize, from: usize, to: usize) -> Option<f64> {
    let vals: Vec<f64> = rows[from..to]
        .iter()
        .filter_map(|r| r.get(i).copied())
        .collect();
    (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
}

/// Computes every figure of `rec` under `scenario`'s windows.
pub fn measure(scenario: &Scenario, rec: &Recording) -> Metrics {
    let cycles = rec.load.len();
    let steady_from = (scenario.steady_from as usize).min(cycles.saturating_sub(1));
    let dist = (scenario.disturbance as usize).min(cycles.saturating_sub(1));
    let n_end = rec.load.last().map_or(0, Vec::len);
    // Endpoints present through the whole steady window.
    let steady_set: Vec<usize> = (0..n_end)
        .filter(|&i| rec.load[steady_from..].iter().all(|r| i < r.len()))
        .collect();

    let steady_means: Vec<f64> = steady_set
        .iter()
        .filter_map(|&i| endpoint_mean(&rec.load, i, steady_from, cycles))
        .collect();
    let spread = Spread::of(&steady_means);

    let (series, ratio) = chart_series(&rec.load);
    let max_over_avg_5s = mean(ratio[steady_from..].iter().copied());

    let rel = ratios(&rec.load);
    let transient = transient(&rel, dist, steady_from);
    let (settle_cycles, overshoot) = settle_and_overshoot(&transient);

    let churn = churn(&rec.weights[steady_from..]);

    let (mut over, mut all) = (0u64, 0u64);
    for (loads, arr) in rec.load[dist..].iter().zip(&rec.arrivals[dist..]) {
        for (&l, &a) in loads.iter().zip(arr) {
            all += u64::from(a);
            if l > 1.0 {
                over += u64::from(a);
            }
        }
    }
    let completions: u64 = rec.completions[dist..].iter().sum();
    let errors: u64 = rec.errors[dist..].iter().sum();

    let mut skipped = BTreeMap::new();
    for s in rec.skipped.iter().flatten() {
        *skipped.entry((*s).to_string()).or_insert(0) += 1;
    }

    let watched = rec.watched.map(|w| {
        let smooth = |c: usize| -> Option<f64> {
            let lo = c.saturating_sub(1).max(dist);
            let hi = (c + 2).min(cycles);
            endpoint_mean(&rel, w, lo, hi)
        };
        let horizon = (dist + OVERSHOOT_HORIZON).min(cycles);
        let peak_ratio = (dist..horizon).filter_map(smooth).fold(0.0f64, f64::max);
        let cycles_to_reach = (dist..cycles)
            .find(|&c| smooth(c).is_some_and(|r| r >= 0.95))
            .map(|c| (c - dist) as u32);
        Watched {
            peak_ratio,
            steady_ratio: endpoint_mean(&rel, w, steady_from, cycles).unwrap_or(0.0),
            cycles_to_reach,
            peak_inflight: rec.watched_inflight[dist..]
                .iter()
                .copied()
                .max()
                .unwrap_or(0),
            final_inflight: rec.watched_inflight.last().copied().unwrap_or(0),
        }
    });

    Metrics {
        max_over_avg: spread.max_over_avg,
        p95_over_avg: spread.p95_over_avg,
        p5_over_avg: spread.p5_over_avg,
        max_over_avg_5s,
        settle_cycles,
        overshoot,
        transient_noise: transient.noise,
        churn,
        overloaded_share: if all > 0 {
            over as f64 / all as f64
        } else {
            0.0
        },
        error_share: if completions > 0 {
            errors as f64 / completions as f64
        } else {
            0.0
        },
        p99_latency_ms: rec.p99_latency_ms,
        skipped,
        watched,
        series,
        ratio,
        transient,
    }
}

/// Quantiles of the trailing [`CHART_WINDOW`]-cycle mean load per cycle, and max/avg.
fn chart_series(load: &[Vec<f64>]) -> (Series, Vec<f64>) {
    let mut s = Series::default();
    let mut ratio = Vec::with_capacity(load.len());
    for c in 0..load.len() {
        let from = (c + 1).saturating_sub(CHART_WINDOW);
        let n = load[c].len();
        let means: Vec<f64> = (0..n)
            .filter_map(|i| endpoint_mean(load, i, from, c + 1))
            .collect();
        let sp = Spread::of(&means);
        s.max.push(sp.max);
        s.p95.push(sp.p95_over_avg * sp.avg);
        s.avg.push(sp.avg);
        s.p5.push(sp.p5_over_avg * sp.avg);
        ratio.push(sp.max_over_avg);
    }
    (s, ratio)
}

fn transient(rel: &[Vec<f64>], dist: usize, steady_from: usize) -> Transient {
    let cycles = rel.len();
    if cycles == 0 || dist >= cycles {
        return Transient::default();
    }
    let n = rel[dist].len();
    let set: Vec<usize> = (0..n).filter(|&i| i < rel[cycles - 1].len()).collect();
    let ss: Vec<f64> = set
        .iter()
        .map(|&i| endpoint_mean(rel, i, steady_from.max(dist), cycles).unwrap_or(1.0))
        .collect();
    let d0: Vec<f64> = set
        .iter()
        .zip(&ss)
        .map(|(&i, s)| rel[dist][i] - s)
        .collect();
    let norm: f64 = d0.iter().map(|d| d * d).sum();
    let initial_rms = (norm / d0.len().max(1) as f64).sqrt();
    let a = |c: usize| -> f64 {
        if norm <= 0.0 {
            return 0.0;
        }
        let (lo, hi) = if c == dist {
            (c, c + 1)
        } else {
            (c - 1, (c + 2).min(cycles))
        };
        let dot: f64 = set
            .iter()
            .zip(&d0)
            .zip(&ss)
            .map(|((&i, d), s)| d * (endpoint_mean(rel, i, lo, hi).unwrap_or(*s) - s))
            .sum();
        dot / norm
    };
    let remaining: Vec<f64> = (dist..cycles).map(a).collect();
    let tail: Vec<f64> =
        remaining[steady_from.saturating_sub(dist).min(remaining.len())..].to_vec();
    let m = mean(tail.iter().copied());
    let noise = mean(tail.iter().map(|x| (x - m) * (x - m))).sqrt();
    // Pooled per-endpoint noise of one cycle's ratio, to tell a transient from noise.
    let pooled = mean(set.iter().zip(&ss).flat_map(|(&i, s)| {
        rel[steady_from.max(dist)..]
            .iter()
            .filter_map(move |r| r.get(i).map(|x| (x - s) * (x - s)))
    }))
    .sqrt();
    Transient {
        initial_rms,
        remaining,
        noise,
        cycle_noise: pooled,
    }
}

/// An initial imbalance counts as a transient only if it clearly exceeds one cycle's
/// noise: round robin after a step has nothing to settle, and its `a(t)` would be
/// noise divided by noise.
fn is_transient(t: &Transient) -> bool {
    t.initial_rms >= 0.05_f64.max(2.0 * t.cycle_noise)
}

fn settle_and_overshoot(t: &Transient) -> (Option<u32>, Option<f64>) {
    if !is_transient(t) {
        return (Some(0), None);
    }
    let r = &t.remaining;
    let settle = (0..r.len()).find(|&k| {
        let end = (k + SETTLE_HOLD).min(r.len());
        end - k >= SETTLE_HOLD.min(3) && r[k..end].iter().all(|x| x.abs() <= SETTLE_BAND)
    });
    let horizon = OVERSHOOT_HORIZON.min(r.len());
    let low = r[..horizon].iter().copied().fold(f64::INFINITY, f64::min);
    (settle.map(|k| k as u32), Some((-low).max(0.0)))
}

fn churn(weights: &[Option<Vec<f64>>]) -> Option<f64> {
    let norm = |w: &Vec<f64>| -> Vec<f64> {
        let pos: Vec<f64> = w.iter().copied().filter(|x| *x > 0.0).collect();
        let m = mean(pos.iter().copied());
        w.iter()
            .map(|x| if m > 0.0 && *x > 0.0 { x / m } else { 0.0 })
            .collect()
    };
    let mut moved = Vec::new();
    for pair in weights.windows(2) {
        let (Some(a), Some(b)) = (&pair[0], &pair[1]) else {
            return None;
        };
        let (a, b) = (norm(a), norm(b));
        let total: f64 = a.iter().sum();
        let diff: f64 = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum();
        if total > 0.0 {
            moved.push(diff / total);
        }
    }
    (!moved.is_empty()).then(|| mean(moved.into_iter()))
}
