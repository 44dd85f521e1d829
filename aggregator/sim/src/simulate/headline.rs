//! The headline of `docs/balance.md`: each balance target against what the shipped
//! gains and the sweep's gains measured.

use super::fleet::SCORE_CAPACITY;
use super::metrics::{Metrics, Watched};
use super::report::{f3, overshoot, pct, settle};
use super::strategy::AgentConfig;
use super::strategy::StrategyKind;
use super::tune::SweepRow;
use super::{ScenarioSummary, SimSummary};
use std::fmt::Write as _;

/// Writes the headline table.
pub fn table(out: &mut String, s: &SimSummary) {
    out.push_str(
        "Settling, overshoot and the newcomer's peak are judged on the sweep's figures \
         (the same scenarios cut to 100 cycles, averaged over several seeds), because one \
         run's noise floor — shown as ± — is about as large as the 5 % targets. The other \
         targets are judged on this run.\n\n",
    );
    let checks = checks(s);
    // The second group of columns only while the sweep's gains are not the default.
    let two = checks.iter().any(|c| c.cols[1].is_some());
    if two {
        out.push_str(
            "| target | shipped gains: this run | sweep mean | | sweep's gains: this run | sweep mean | |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|\n");
    } else {
        out.push_str("| target | this run | sweep mean | |\n");
        out.push_str("|---|---|---|---|\n");
    }
    let col = |x: &Option<(String, String, bool)>| match x {
        Some((run, sweep, ok)) => format!("{run} | {sweep} | {}", mark(*ok)),
        None => "– | – | ".to_string(),
    };
    for c in &checks {
        if two {
            let _ = writeln!(
                out,
                "| {} | {} | {} |",
                c.target,
                col(&c.cols[0]),
                col(&c.cols[1])
            );
        } else {
            let _ = writeln!(out, "| {} | {} |", c.target, col(&c.cols[0]));
        }
    }
    out.push('\n');
}

/// The headline in one sentence, between the `<!-- figures: simulator -->` and
/// `<!-- figures: end -->` lines of `docs/balance.md`, where the README quotes it: the
/// steady fleet under Ballast beside round robin, gRPC's weighted round robin and power
/// of two choices. Empty when the steady scenario did not run.
pub fn sentence(s: &SimSummary) -> String {
    use StrategyKind::*;
    let Some(sc) = s.scenario("steady") else {
        return String::new();
    };
    let fig = |k: StrategyKind| sc.get(k).map_or("–".to_string(), |m| f2(m.max_over_avg));
    let fleet = &sc.scenario.fleet;
    format!(
        "On a {}-node fleet of {} hardware generations Ballast holds max/avg at {} where \
         round robin gives {}, gRPC's weighted round robin {} and power of two choices {}.",
        fleet.endpoints,
        match fleet.speeds.len() {
            2 => "two".to_string(),
            3 => "three".to_string(),
            n => n.to_string(),
        },
        sc.get(Ballast)
            .map_or("–".to_string(), |m| f3(m.max_over_avg)),
        fig(RoundRobin),
        fig(A58),
        fig(P2c),
    )
}

/// Two decimals, for the figures quoted beside Ballast's three.
fn f2(x: f64) -> String {
    format!("{x:.2}")
}

/// A target, and what each set of gains measured against it.
struct Check {
    target: String,
    /// Per gains (shipped, sweep's): this run's figure, the sweep's seed-averaged
    /// figure, and whether the target was met.
    cols: [Option<(String, String, bool)>; 2],
}

/// A stalled node is bounded when its queue is back under the scoring capacity by the
/// end and its steady load is not far above the average.
fn bounded(m: &Metrics) -> bool {
    m.watched
        .as_ref()
        .is_some_and(|w| f64::from(w.final_inflight) <= SCORE_CAPACITY && w.steady_ratio < 1.5)
}

/// The headline targets the shipped gains missed in `s`, by name; empty when every one
/// was met. `simulate` exits non-zero when one is missed.
pub fn missed(s: &SimSummary) -> Vec<String> {
    checks(s)
        .into_iter()
        .filter(|c| matches!(c.cols[0], Some((_, _, false))))
        .map(|c| c.target)
        .collect()
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**missed**"
    }
}

/// The sweep rows of the shipped and the chosen gains.
fn sweep_rows(s: &SimSummary) -> [Option<&SweepRow>; 2] {
    let Some(sw) = &s.sweep else {
        return [None, None];
    };
    let shipped = sw.default_row.and_then(|i| sw.rows.get(i));
    let chosen = sw
        .chosen
        .filter(|i| Some(*i) != sw.default_row)
        .and_then(|i| sw.rows.get(i));
    [shipped, chosen]
}

fn checks(s: &SimSummary) -> Vec<Check> {
    use StrategyKind::*;
    let rows = sweep_rows(s);
    let runs = |sc: &ScenarioSummary| -> [Option<Metrics>; 2] {
        [sc.get(Ballast).cloned(), sc.tuned(Ballast).cloned()]
    };
    let mut out = Vec::new();
    // One check from a run figure, a sweep figure and a verdict on (run, sweep).
    fn make(
        target: String,
        runs: &[Option<Metrics>; 2],
        rows: &[Option<&SweepRow>; 2],
        run_fig: &dyn Fn(&Metrics) -> String,
        sweep_fig: &dyn Fn(&SweepRow) -> String,
        verdict: &dyn Fn(&Metrics, Option<&SweepRow>) -> bool,
    ) -> Check {
        let col = |k: usize| {
            runs[k].as_ref().map(|m| {
                (
                    run_fig(m),
                    rows[k].map_or("–".to_string(), sweep_fig),
                    verdict(m, rows[k]),
                )
            })
        };
        Check {
            target,
            cols: [col(0), col(1)],
        }
    }
    let within5 = |o: Option<f64>| o.is_none_or(|x| x <= 0.05);
    let opt_pct = |o: Option<f64>| o.map_or("–".to_string(), pct);
    let cycles = |c: Option<u32>| c.map_or("never".to_string(), |v| v.to_string());

    if let Some(sc) = s.scenario("steady") {
        let rr = sc.get(RoundRobin).map_or(f64::NAN, |m| m.max_over_avg);
        let r = runs(sc);
        out.push(make(
            format!(
                "steady fleet: Ballast max/avg ≤ 1.02 where round robin ≥ 1.25 (round robin: {})",
                f3(rr)
            ),
            &r,
            &rows,
            &|m| f3(m.max_over_avg),
            &|w| f3(w.steady_max_over_avg),
            &|m, _| m.max_over_avg <= 1.02 && rr >= 1.25,
        ));
        out.push(make(
            "steady fleet: overshoot ≤ 5 % converging from equal weights".to_string(),
            &r,
            &rows,
            &overshoot,
            &|w| opt_pct(w.steady_overshoot),
            &|m, w| w.map_or(within5(m.overshoot), |w| within5(w.steady_overshoot)),
        ));
    }
    if let Some(sc) = s.scenario("step") {
        let r = runs(sc);
        out.push(make(
            "+50 % step: settles within 10 cycles".to_string(),
            &r,
            &rows,
            &settle,
            &|w| cycles(w.step_settle),
            &|m, w| {
                w.map_or(m.settle_cycles, |w| w.step_settle)
                    .is_some_and(|c| c <= 10)
            },
        ));
        out.push(make(
            "+50 % step: overshoot ≤ 5 %".to_string(),
            &r,
            &rows,
            &overshoot,
            &|w| opt_pct(w.step_overshoot),
            &|m, w| w.map_or(within5(m.overshoot), |w| within5(w.step_overshoot)),
        ));
    }
    if let Some(sc) = s.scenario("cold_join") {
        let r = runs(sc);
        out.push(make(
            "cold node reaches the average without passing 1.1× it".to_string(),
            &r,
            &rows,
            &|m| {
                m.watched.as_ref().map_or("–".into(), |w| {
                    format!(
                        "peak {}, 95 % after {}",
                        f3(w.peak_ratio),
                        cycles(w.cycles_to_reach)
                    )
                })
            },
            &|w| {
                format!(
                    "peak {}, 95 % after {}",
                    f3(w.cold_peak),
                    cycles(w.cold_reach)
                )
            },
            &|m, w| match w {
                Some(w) => w.cold_peak <= 1.1 && w.cold_reach.is_some(),
                None => m
                    .watched
                    .as_ref()
                    .is_some_and(|w| w.peak_ratio <= 1.1 && w.cycles_to_reach.is_some()),
            },
        ));
    }
    if let Some(sc) = s.scenario("degraded_io") {
        let cpu = sc.get(BallastCpuOnly).and_then(|m| m.watched.clone());
        let r = runs(sc);
        let show = |w: &Watched| {
            format!(
                "in flight: peak {}, end {}",
                w.peak_inflight, w.final_inflight
            )
        };
        out.push(make(
            format!(
                "degraded-I/O node stays bounded (CPU alone: {})",
                cpu.as_ref().map_or("–".into(), show)
            ),
            &r,
            &rows,
            &|m| m.watched.as_ref().map_or("–".into(), show),
            &|_| "–".to_string(),
            // Bounded: its queue is back under the scoring capacity by the end, and its
            // steady load is not far above the average.
            &|m, _| bounded(m),
        ));
    }
    if let Some(sc) = s.scenario("pooled_http2") {
        let others = |a: AgentConfig| {
            sc.get(BallastAgent(a))
                .map_or(f64::NAN, |m| m.others_max_over_avg)
        };
        let tuned = AgentConfig {
            capacity: 32,
            ..AgentConfig::OLD_DEFAULT
        };
        let (old, cap32) = (others(AgentConfig::OLD_DEFAULT), others(tuned));
        let new = sc.get(BallastAgent(AgentConfig::SHIPPED)).cloned();
        out.push(Check {
            target: format!(
                "pooled and HTTP/2 connections: the new default keeps the other nodes' \
                 max/avg ≤ 1.05 and ≤ the established count's (capacity 100: {}, capacity \
                 32: {}), and the stalled node bounded",
                f3(old),
                f3(cap32)
            ),
            cols: [
                new.map(|m| {
                    (
                        format!(
                            "{}; stalled node in flight: peak {}, end {}",
                            f3(m.others_max_over_avg),
                            m.watched.as_ref().map_or(0, |w| w.peak_inflight),
                            m.watched.as_ref().map_or(0, |w| w.final_inflight),
                        ),
                        "–".to_string(),
                        m.others_max_over_avg <= 1.05
                            && m.others_max_over_avg <= old.min(cap32)
                            && bounded(&m),
                    )
                }),
                None,
            ],
        });
    }
    let worse = |tuned: bool| -> Vec<&'static str> {
        s.scenarios
            .iter()
            .filter(|sc| {
                let others = [A58, P2c]
                    .iter()
                    .filter_map(|k| sc.get(*k).map(|m| m.max_over_avg))
                    .fold(f64::INFINITY, f64::min);
                let b = if tuned {
                    sc.tuned(Ballast)
                } else {
                    sc.get(Ballast)
                };
                b.is_some_and(|b| b.max_over_avg > others)
            })
            .map(|sc| sc.scenario.id)
            .collect()
    };
    let list = |v: Vec<&str>| {
        let ok = v.is_empty();
        let text = if ok {
            "in every scenario".to_string()
        } else {
            format!("not in: {}", v.join(", "))
        };
        (text, "–".to_string(), ok)
    };
    let any_tuned = s.scenarios.iter().any(|sc| sc.tuned(Ballast).is_some());
    out.push(Check {
        target: "Ballast max/avg ≤ both A58's and P2C's in every scenario".to_string(),
        cols: [
            Some(list(worse(false))),
            any_tuned.then(|| list(worse(true))),
        ],
    });
    out
}
