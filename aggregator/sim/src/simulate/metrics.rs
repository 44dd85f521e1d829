//! The balance figures, derived from a run's recording.
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
use ballast_balance::Spread;
use std::collections::BTreeMap;

/// Cycles a run must stay inside the band to count as settled.
pub const SETTLE_HOLD: usize = 10;
/// The settling band: residual imbalance within 5 % of the initial one.
pub const SETTLE_BAND: f64 = 0.05;
/// Cycles after the disturbance in which overshoot is looked for.
pub const OVERSHOOT_HORIZON: usize = 30;
/// Trailing window of the charts and the 5 s ratio, in cycles.
pub const CHART_WINDOW: usize = 5;
/// A weight within this factor of a bound (`Params::min_weight` or `max_weight`
/// times the mean) counts as sitting at it.
pub const PIN_TOLERANCE: f64 = 1.05;

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
/// centred mean over cycles after the first), `a(t) = Σ D_i d_i(t) / S` is the share
/// of the initial imbalance pattern still present: 1 at the disturbance, 0 when it is
/// corrected, negative if the controller pushed past balance (overshoot). `S` is
/// `Σ D_i²` less the energy that one cycle's noise puts into `D` (`n σ²`), so that the
/// noise in `D`, which does not persist, does not read as a fast first step.
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
    /// Largest single initial deviation.
    pub initial_max: f64,
    /// Whether the initial imbalance stands clearly above one cycle's noise; if not,
    /// there was no transient and `remaining` is all 0.
    pub significant: bool,
}

/// The endpoint a scenario watches.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Watched {
    /// Highest 3-cycle mean of its load over the average, in the first
    /// [`OVERSHOOT_HORIZON`] cycles after the disturbance.
    pub peak_ratio: f64,
    /// Its mean load over the average in the steady window.
    pub steady_ratio: f64,
    /// Cycles until its 3-cycle mean load first reached 95 % of the average.
    pub cycles_to_reach: Option<u32>,
    /// Its load over the average per cycle from the disturbance on (3-cycle centred
    /// mean).
    pub curve: Vec<f64>,
    /// Highest in-flight count at a cycle's end, from the disturbance on.
    pub peak_inflight: u32,
    /// In-flight count at the end of the run.
    pub final_inflight: u32,
}

/// Weights that sat at a bound of the normaliser for at least half of the steady
/// window: a controller whose signal does not respond to the weight drives weights
/// to the bounds and leaves them there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Pinned {
    /// Endpoints at the floor (`min_weight` × the mean).
    pub floor: u32,
    /// Endpoints at the ceiling (`max_weight` × the mean).
    pub ceiling: u32,
    /// Whether the watched endpoint is among those at the floor.
    pub watched_at_floor: bool,
}

/// Figures of one strategy in one scenario.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Metrics {
    /// Steady-state max/avg of per-endpoint mean load.
    pub max_over_avg: f64,
    /// Steady-state max/avg of per-endpoint mean CPU alone (Robinhood's metric; blind
    /// to queues).
    pub cpu_max_over_avg: f64,
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
    /// The band settling was judged against: [`SETTLE_BAND`], or twice the noise
    /// floor where that is wider (a lone newcomer's ratio is noisier than 5 %).
    pub settle_band: f64,
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
    /// The watched endpoint's share of all requests that arrived from the
    /// disturbance on.
    pub watched_request_share: Option<f64>,
    /// Its share of the fleet's cores × speed: what balanced weights would send it.
    pub watched_fair_share: Option<f64>,
    /// Its share of the requests in the second half of the cycles before the
    /// disturbance and in the steady window: what a change beside the service (a
    /// neighbour) did to it once the weights settled.
    pub watched_shares: Option<(f64, f64)>,
    /// Steady-state max/avg over the endpoints other than the watched one: how the
    /// rest of the fleet fares, which a runaway queue on the watched node would
    /// otherwise hide behind its own ratio.
    pub others_max_over_avg: f64,
    /// Steady-state p95/avg over the endpoints other than the watched one.
    pub others_p95_over_avg: f64,
    /// Steady-state mean load of the smallest endpoints (least cores × speed) other
    /// than the watched one, over the others' average: far below 1 is a small node
    /// starved, far above it one flooded.
    pub smallest_ratio: f64,
    /// Weights pinned at a bound in the steady window; `None` without weights.
    pub pinned: Option<Pinned>,
    /// Mean number of endpoints per cycle in the steady window whose load Ballast
    /// set by the in-flight term, and whose in-flight count it distrusted; `None`
    /// for strategies without Ballast.
    pub inflight_verdicts: Option<(f64, f64)>,
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
fn ratios(load: &[Vec<f64>], excluded: Option<usize>) -> Vec<Vec<f64>> {
    load.iter()
        .map(|row| {
            let avg = mean(
                row.iter()
                    .enumerate()
                    .filter(|(i, _)| Some(*i) != excluded)
                    .map(|(_, l)| *l),
            );
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
    let excluded = if scenario.spread_excludes_watched {
        rec.watched
    } else {
        None
    };
    // Endpoints present through the whole steady window.
    let steady_set: Vec<usize> = (0..n_end)
        .filter(|&i| Some(i) != excluded)
        .filter(|&i| rec.load[steady_from..].iter().all(|r| i < r.len()))
        .collect();

    let steady_means: Vec<f64> = steady_set
        .iter()
        .filter_map(|&i| endpoint_mean(&rec.load, i, steady_from, cycles))
        .collect();
    let spread = Spread::of(&steady_means);
    let cpu_means: Vec<f64> = steady_set
        .iter()
        .filter_map(|&i| endpoint_mean(&rec.cpu, i, steady_from, cycles))
        .collect();
    let cpu_spread = Spread::of(&cpu_means);

    let (series, ratio) = chart_series(&rec.load, excluded);
    let max_over_avg_5s = mean(ratio[steady_from..].iter().copied());

    let rel = ratios(&rec.load, excluded);
    let transient = transient(&rel, dist, steady_from, excluded);
    let settle_band = SETTLE_BAND.max(2.0 * transient.noise);
    let (settle_cycles, overshoot) = if transient.significant {
        let (s, o) = settle_and_overshoot(&transient.remaining, settle_band);
        (s, Some(o))
    } else {
        (Some(0), None)
    };

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
        let curve: Vec<f64> = (dist..cycles).map(|c| smooth(c).unwrap_or(0.0)).collect();
        let (peak_ratio, cycles_to_reach) = peak_and_reach(&curve);
        Watched {
            peak_ratio,
            steady_ratio: endpoint_mean(&rel, w, steady_from, cycles).unwrap_or(0.0),
            cycles_to_reach,
            curve,
            peak_inflight: rec.watched_inflight[dist..]
                .iter()
                .copied()
                .max()
                .unwrap_or(0),
            final_inflight: rec.watched_inflight.last().copied().unwrap_or(0),
        }
    });

    let (watched_request_share, watched_fair_share) = match rec.watched {
        Some(w) => {
            let total: u64 = rec.arrivals[dist..]
                .iter()
                .flat_map(|r| r.iter().map(|&a| u64::from(a)))
                .sum();
            let mine: u64 = rec.arrivals[dist..]
                .iter()
                .filter_map(|r| r.get(w).map(|&a| u64::from(a)))
                .sum();
            let cap: f64 = rec.capacities.iter().sum();
            (
                (total > 0).then(|| mine as f64 / total as f64),
                rec.capacities.get(w).filter(|_| cap > 0.0).map(|c| c / cap),
            )
        }
        None => (None, None),
    };
    let watched_shares = rec.watched.and_then(|w| {
        Some((
            share_of(&rec.arrivals, w, dist / 2, dist)?,
            share_of(&rec.arrivals, w, steady_from, cycles)?,
        ))
    });
    let others: Vec<f64> = steady_set
        .iter()
        .filter(|&&i| Some(i) != rec.watched)
        .filter_map(|&i| endpoint_mean(&rec.load, i, steady_from, cycles))
        .collect();
    let others = Spread::of(&others);
    let smallest = steady_set
        .iter()
        .filter(|&&i| Some(i) != rec.watched)
        .filter_map(|&i| rec.capacities.get(i).copied())
        .fold(f64::INFINITY, f64::min);
    let small_mean = mean(
        steady_set
            .iter()
            .filter(|&&i| {
                Some(i) != rec.watched
                    && rec
                        .capacities
                        .get(i)
                        .is_some_and(|c| (c - smallest).abs() < 1e-9)
            })
            .filter_map(|&i| endpoint_mean(&rec.load, i, steady_from, cycles)),
    );
    let smallest_ratio = if others.avg > 0.0 {
        small_mean / others.avg
    } else {
        0.0
    };
    let pinned = pinned(&rec.weights[steady_from..], rec.watched);
    let inflight_verdicts = rec.kind.uses_ballast().then(|| {
        let m = |v: &[u32]| {
            mean(
                v.get(steady_from..)
                    .unwrap_or(&[])
                    .iter()
                    .map(|&x| f64::from(x)),
            )
        };
        (m(&rec.inflight_binding), m(&rec.inflight_distrusted))
    });

    Metrics {
        max_over_avg: spread.max_over_avg,
        cpu_max_over_avg: cpu_spread.max_over_avg,
        p95_over_avg: spread.p95_over_avg,
        p5_over_avg: spread.p5_over_avg,
        max_over_avg_5s,
        settle_cycles,
        overshoot,
        transient_noise: transient.noise,
        settle_band,
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
        watched_request_share,
        watched_fair_share,
        watched_shares,
        others_max_over_avg: others.max_over_avg,
        others_p95_over_avg: others.p95_over_avg,
        smallest_ratio,
        pinned,
        inflight_verdicts,
        series,
        ratio,
        transient,
    }
}

/// Quantiles of the trailing [`CHART_WINDOW`]-cycle mean load per cycle, and max/avg.
fn chart_series(load: &[Vec<f64>], excluded: Option<usize>) -> (Series, Vec<f64>) {
    let mut s = Series::default();
    let mut ratio = Vec::with_capacity(load.len());
    for c in 0..load.len() {
        let from = (c + 1).saturating_sub(CHART_WINDOW);
        let n = load[c].len();
        let means: Vec<f64> = (0..n)
            .filter(|&i| Some(i) != excluded)
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

fn transient(
    rel: &[Vec<f64>],
    dist: usize,
    steady_from: usize,
    excluded: Option<usize>,
) -> Transient {
    let cycles = rel.len();
    if cycles == 0 || dist >= cycles {
        return Transient::default();
    }
    let from = steady_from.max(dist);
    let n = rel[dist].len();
    let set: Vec<usize> = (0..n)
        .filter(|&i| i < rel[cycles - 1].len() && Some(i) != excluded)
        .collect();
    let ss: Vec<f64> = set
        .iter()
        .map(|&i| endpoint_mean(rel, i, from, cycles).unwrap_or(1.0))
        .collect();
    // One endpoint's one-cycle noise, pooled over the steady window.
    let cycle_noise = mean(set.iter().zip(&ss).flat_map(|(&i, s)| {
        rel[from..]
            .iter()
            .filter_map(move |r| r.get(i).map(|x| (x - s) * (x - s)))
    }))
    .sqrt();
    let d0: Vec<f64> = set
        .iter()
        .zip(&ss)
        .map(|(&i, s)| rel[dist][i] - s)
        .collect();
    let raw: f64 = d0.iter().map(|d| d * d).sum();
    let noise_energy = set.len() as f64 * cycle_noise * cycle_noise;
    let signal = raw - noise_energy;
    let initial_rms = (signal.max(0.0) / set.len().max(1) as f64).sqrt();
    let initial_max = d0.iter().fold(0.0f64, |m, d| m.max(d.abs()));
    // Significant if the signal energy stands 3 standard deviations above what noise
    // alone would put there.
    let significant = signal > 3.0 * cycle_noise * cycle_noise * (2.0 * set.len() as f64).sqrt()
        && initial_rms >= 0.02;
    let a = |c: usize| -> f64 {
        if !significant {
            return 0.0;
        }
        if c == dist {
            return 1.0;
        }
        let (lo, hi) = ((c - 1).max(dist + 1), (c + 2).min(cycles));
        let dot: f64 = set
            .iter()
            .zip(&d0)
            .zip(&ss)
            .map(|((&i, d), s)| d * (endpoint_mean(rel, i, lo, hi).unwrap_or(*s) - s))
            .sum();
        dot / signal
    };
    let remaining: Vec<f64> = (dist..cycles).map(a).collect();
    let tail = &remaining[from.saturating_sub(dist).min(remaining.len())..];
    let m = mean(tail.iter().copied());
    let noise = mean(tail.iter().map(|x| (x - m) * (x - m))).sqrt();
    Transient {
        initial_rms,
        remaining,
        noise,
        cycle_noise,
        initial_max,
        significant,
    }
}

/// Endpoint `w`'s share of the requests that arrived in cycles `lo..hi`; `None`
/// when none did.
fn share_of(arrivals: &[Vec<u32>], w: usize, lo: usize, hi: usize) -> Option<f64> {
    let rows = arrivals.get(lo..hi.min(arrivals.len()))?;
    let total: u64 = rows.iter().flatten().map(|&a| u64::from(a)).sum();
    let mine: u64 = rows
        .iter()
        .filter_map(|r| r.get(w))
        .map(|&a| u64::from(a))
        .sum();
    (total > 0).then(|| mine as f64 / total as f64)
}

/// Settling and overshoot of an imbalance curve `a(t)` (see [`Transient`]): the first
/// cycle from which `|a|` stays within `band` for [`SETTLE_HOLD`] cycles (or to the
/// end of the run, if at least 3 remain), and how far below 0 it went in the first
/// [`OVERSHOOT_HORIZON`] cycles.
pub fn settle_and_overshoot(curve: &[f64], band: f64) -> (Option<u32>, f64) {
    let settle = (0..curve.len()).find(|&k| {
        let end = (k + SETTLE_HOLD).min(curve.len());
        end - k >= SETTLE_HOLD.min(3) && curve[k..end].iter().all(|x| x.abs() <= band)
    });
    let horizon = OVERSHOOT_HORIZON.min(curve.len());
    let low = curve[..horizon].iter().copied().fold(0.0f64, f64::min);
    (settle.map(|k| k as u32), if low < 0.0 { -low } else { 0.0 })
}

/// The peak of a watched endpoint's load-ratio curve in the first
/// [`OVERSHOOT_HORIZON`] cycles, and the first cycle it reached 95 % of the average.
pub fn peak_and_reach(curve: &[f64]) -> (f64, Option<u32>) {
    let horizon = OVERSHOOT_HORIZON.min(curve.len());
    let peak = curve[..horizon].iter().copied().fold(0.0f64, f64::max);
    let reach = curve.iter().position(|&r| r >= 0.95).map(|k| k as u32);
    (peak, reach)
}

/// The endpoints whose weight sat at a bound (within [`PIN_TOLERANCE`]) in at least
/// half of the cycles of `weights`.
fn pinned(weights: &[Option<Vec<f64>>], watched: Option<usize>) -> Option<Pinned> {
    let p = ballast_balance::Params::default();
    let mut floor: Vec<usize> = Vec::new();
    let mut ceiling: Vec<usize> = Vec::new();
    for w in weights {
        let w = w.as_ref()?;
        let m = mean(w.iter().copied().filter(|x| *x > 0.0));
        if m <= 0.0 {
            continue;
        }
        if floor.len() < w.len() {
            floor.resize(w.len(), 0);
            ceiling.resize(w.len(), 0);
        }
        for (i, x) in w.iter().enumerate() {
            let r = x / m;
            if r <= p.min_weight * PIN_TOLERANCE {
                floor[i] += 1;
            } else if r >= p.max_weight / PIN_TOLERANCE {
                ceiling[i] += 1;
            }
        }
    }
    let half = weights.len().div_ceil(2).max(1);
    let count = |v: &[usize]| u32::try_from(v.iter().filter(|&&n| n >= half).count()).unwrap_or(0);
    Some(Pinned {
        floor: count(&floor),
        ceiling: count(&ceiling),
        watched_at_floor: watched.is_some_and(|w| floor.get(w).is_some_and(|&n| n >= half)),
    })
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
