//! `docs/lab.md` and its charts, from a [`LabResult`], and the targets the full lab
//! must meet.

use super::{LabResult, Plan, RunResult, CONVERGENCE_BAND, CONVERGENCE_WINDOW_S, STALLED_SHARE};
use ballast_sim::simulate::chart::{line_chart, Line, LineChart};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Ballast's steady max/avg may exceed the oracle's by this factor at most.
pub const TARGET_VS_ORACLE: f64 = 1.03;
/// No backend's steady utilization below this share of the mean.
pub const TARGET_MIN_OVER_AVG: f64 = 0.85;
/// Seconds from the start of the load to convergence, at most.
pub const TARGET_CONVERGENCE_S: f64 = 5.0;
/// The other backends' p99 during the stall, relative to the oracle's, at most.
pub const TARGET_OTHERS_P99_VS_ORACLE: f64 = 1.5;
/// Connections HAProxy must have held to the smallest backend for the saturated start
/// to be one: "a dozen or so".
pub const TARGET_POOLED: u32 = 10;
/// With a neighbour in its cgroup, a backend's share of new requests within this
/// factor of its fair share of the capacity left (either way).
pub const TARGET_NEIGHBOUR_FAIR: (f64, f64) = (0.75, 1.25);
/// A niced neighbour changes the backend's share by less than this.
pub const TARGET_NICED_CHANGE: f64 = 0.10;
/// Round robin must bring the smallest quotas to at least this utilization, or the lab
/// shows no imbalance to correct.
pub const TARGET_RR_SATURATES: f64 = 0.9;

/// One target: what, the figure, whether it was met.
#[derive(Debug, Clone)]
pub struct Target {
    /// What is asked.
    pub what: String,
    /// What was measured.
    pub measured: String,
    /// Met.
    pub met: bool,
}

/// The full lab's targets, each with its figure.
pub fn targets(r: &LabResult) -> Vec<Target> {
    let rr = r.run("rr");
    let or = r.run("oracle");
    let ba = r.run("ballast");
    let rs = r.run("restart");
    let d = &r.degraded;
    let sat = &r.saturation;
    let small = r.plan.quotas.iter().copied().fold(f64::INFINITY, f64::min);
    let smallest: Vec<f64> = rr
        .util
        .iter()
        .zip(&r.plan.quotas)
        .filter(|(_, q)| (**q - small).abs() < 1e-9)
        .map(|(u, _)| *u)
        .collect();
    let lowest = ba
        .util
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    let mut out = vec![
        Target {
            what: "round robin saturates the smallest quotas".into(),
            measured: format!(
                "{} of their quota",
                smallest
                    .iter()
                    .map(|u| pct(*u))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            met: smallest.iter().all(|u| *u >= TARGET_RR_SATURATES),
        },
        Target {
            what: format!(
                "the surge leaves a pool: HAProxy holds at least {TARGET_POOLED} \
                 connections to the smallest backend (HAProxy's count at a sample, or the \
                 backend's own peak between samples)"
            ),
            measured: format!(
                "{}: {} at most ({} idle), {} by its own count",
                r.names[sat.backend], sat.hap_conns_peak, sat.hap_idle_peak, sat.backend_conns_peak
            ),
            met: sat.pool() >= TARGET_POOLED,
        },
        Target {
            what: format!("Ballast: no backend below {TARGET_MIN_OVER_AVG}× the mean utilization"),
            measured: format!(
                "lowest {} at {:.2}× (the smallest, {}, at {:.2}×)",
                r.names[lowest],
                ba.min_over_avg(),
                r.names[sat.backend],
                sat.steady_rel_util
            ),
            met: ba.min_over_avg() >= TARGET_MIN_OVER_AVG,
        },
        Target {
            what: format!("Ballast's max/avg ≤ oracle's × {TARGET_VS_ORACLE}"),
            measured: format!(
                "{:.3} vs {:.3} (× {:.3})",
                ba.spread.max_over_avg,
                or.spread.max_over_avg,
                ba.spread.max_over_avg / or.spread.max_over_avg.max(1e-9)
            ),
            met: ba.spread.max_over_avg <= or.spread.max_over_avg * TARGET_VS_ORACLE,
        },
        Target {
            what: format!(
                "converged (max/avg within {:.0} % of the oracle's) ≤ {TARGET_CONVERGENCE_S:.0} s \
                 from the first reports that carried the load",
                (CONVERGENCE_BAND - 1.0) * 100.0
            ),
            measured: match (r.convergence.after_reports, r.convergence.after) {
                (Some(t), Some(load)) => {
                    format!("{t:.0} s ({load:.0} s from the start of the load)")
                }
                _ => "never".into(),
            },
            met: r
                .convergence
                .after_reports
                .is_some_and(|t| t <= TARGET_CONVERGENCE_S + 1e-9),
        },
        stalled_share_target(r, "<", STALLED_SHARE, d.share.1 < STALLED_SHARE),
        Target {
            what: format!(
                "meanwhile the other backends' p99 ≤ oracle's × {TARGET_OTHERS_P99_VS_ORACLE}"
            ),
            measured: format!("{:.0} ms vs {:.0} ms", d.others.p99_ms, or.load.p99_ms),
            met: d.others.p99_ms <= or.load.p99_ms * TARGET_OTHERS_P99_VS_ORACLE,
        },
        Target {
            what: "zero failed requests across stop and restart".into(),
            measured: format!("{} of {}", rs.whole.errors, rs.whole.requests),
            met: rs.whole.errors == 0,
        },
    ];
    if let Some(n) = &r.neighbour {
        let (lo, hi) = TARGET_NEIGHBOUR_FAIR;
        let ratio = n.ballast.0 / n.fair_share.max(1e-9);
        out.push(Target {
            what: format!(
                "a greedy neighbour in a backend's cgroup: its share {lo}–{hi}× its fair \
                 share of the capacity left"
            ),
            measured: format!(
                "{:.1} % against {:.1} % (× {ratio:.2}; leastconn {:.1} %)",
                n.ballast.0 * 100.0,
                n.fair_share * 100.0,
                n.leastconn.0 * 100.0
            ),
            met: (lo..=hi).contains(&ratio),
        });
        let sib = &n.sibling;
        let ratio = sib.ballast.0 / sib.fair_share.max(1e-9);
        out.push(Target {
            what: format!(
                "a greedy neighbour in a sibling cgroup under the backend's quota: its share \
                 {lo}–{hi}× its fair share of the capacity left"
            ),
            measured: format!(
                "{:.1} % against {:.1} % (× {ratio:.2})",
                sib.ballast.0 * 100.0,
                sib.fair_share * 100.0,
            ),
            met: (lo..=hi).contains(&ratio),
        });
        let change = n.niced.0 / n.base_share.max(1e-9) - 1.0;
        out.push(Target {
            what: format!(
                "a niced neighbour changes the backend's share by less than {:.0} % (under \
                 a quota it takes capacity like a greedy one: section 10)",
                TARGET_NICED_CHANGE * 100.0
            ),
            measured: format!(
                "{:.1} % against {:.1} % without ({:+.0} %)",
                n.niced.0 * 100.0,
                n.base_share * 100.0,
                change * 100.0
            ),
            met: change.abs() < TARGET_NICED_CHANGE,
        });
    }
    out
}

/// The target on the stalled backend's share of new requests from the reaction time
/// on: `relation` and `limit` say it, `met` whether it held.
fn stalled_share_target(r: &LabResult, relation: &str, limit: f64, met: bool) -> Target {
    let d = &r.degraded;
    Target {
        what: format!(
            "the stalled backend's share of new requests {relation} {:.0} % from {:.0} s \
             after the stall",
            limit * 100.0,
            r.plan.degraded.2.as_secs_f64()
        ),
        measured: format!(
            "{:.1} % ({:.1} % before the stall)",
            d.share.1 * 100.0,
            d.share.0 * 100.0
        ),
        met,
    }
}

/// Writes the charts `docs/lab.md` shows: for runs 1–3 each backend's CPU use relative
/// to its quota, sample by sample; for run 4 the stalled backend's CPU, its share of
/// new requests, its in-flight requests and its weight. Returns the files written.
pub fn charts(r: &LabResult, dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    let mut draw = |file: &str, c: LineChart| -> Result<(), String> {
        let path = dir.join(file);
        line_chart(&path, &c).map_err(|e| e.to_string())?;
        out.push(path);
        Ok(())
    };
    for name in ["rr", "oracle", "ballast"] {
        let run = r.run(name);
        let lines = r
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| Line {
                label: format!("{n} ({:.0} %)", r.plan.quotas[i] * 100.0),
                points: series(r, run, |s| s.util[i]),
            })
            .collect();
        let mut markers = vec![run.window.0];
        if name == "ballast" {
            markers.push(r.saturation.at + r.saturation.secs);
            markers.extend(r.convergence.after);
        }
        let title = format!("{}: CPU used / quota per backend (1 s samples)", run.title);
        draw(
            &format!("lab-{name}.svg"),
            LineChart {
                title: &title,
                x_desc: "seconds into the run",
                y_desc: "utilization of the quota",
                x_max: run.end - run.start,
                y_floor: 0.0,
                lines,
                markers,
            },
        )?;
    }
    let run = r.run("degraded");
    let d = &r.degraded;
    let k = d.backend;
    let title = format!(
        "{}: {} stalls {} ms per request from {:.0} s",
        run.title, r.names[k], r.plan.stall_ms, d.at
    );
    draw(
        "lab-degraded.svg",
        LineChart {
            title: &title,
            x_desc: "seconds into the run",
            y_desc: "see the legend",
            x_max: run.end - run.start,
            y_floor: 0.0,
            lines: vec![
                Line {
                    label: "CPU / quota".into(),
                    points: series(r, run, |s| s.util[k]),
                },
                Line {
                    label: "share of new requests".into(),
                    points: d
                        .share_by_second
                        .iter()
                        .enumerate()
                        .map(|(i, v)| (d.at + i as f64 + 0.5, *v))
                        .collect(),
                },
                Line {
                    label: "highest in flight in the second / 10".into(),
                    points: series(r, run, |s| s.inflight_peak[k].map(|v| f64::from(v) / 10.0)),
                },
                Line {
                    label: "HAProxy weight / mean weight".into(),
                    points: series(r, run, |s| {
                        let ws: Vec<f64> =
                            s.weight.iter().flatten().map(|w| f64::from(*w)).collect();
                        let mean = ws.iter().sum::<f64>() / ws.len().max(1) as f64;
                        let w = f64::from(s.weight[k]?);
                        (mean > 0.0).then(|| w / mean)
                    }),
                },
            ],
            markers: vec![d.at, d.at + r.plan.degraded.2.as_secs_f64()],
        },
    )?;
    Ok(out)
}

/// `value(sample)` for the samples of `run`, against seconds into the run.
fn series(
    r: &LabResult,
    run: &RunResult,
    value: impl Fn(&super::sampler::Sample) -> Option<f64>,
) -> Vec<(f64, f64)> {
    r.samples
        .iter()
        .filter(|s| s.t > run.start && s.t <= run.end)
        .filter_map(|s| value(s).map(|v| (s.t - run.start, v)))
        .collect()
}

fn pct(v: f64) -> String {
    format!("{:.0} %", v * 100.0)
}

fn row(out: &mut String, run: &RunResult) {
    let l = &run.load;
    let _ = writeln!(
        out,
        "| {} | {:.0}–{:.0} s | **{:.3}** | {:.2} | {:.3} | {} | {:.0} | **{:.0}** | {} / {} | {} | {} |",
        run.title,
        run.window.0,
        run.window.1,
        run.spread.max_over_avg,
        run.min_over_avg(),
        run.windowed_max_over_avg,
        pct(run.spread.avg),
        l.p50_ms,
        l.p99_ms,
        run.whole.errors,
        run.whole.requests,
        run.client_connections,
        run.other_cores
            .map_or("–".to_string(), |c| format!("{c:.2}")),
    );
}

/// What the aggregator held for each backend, averaged over the samples of lab seconds
/// `(from, to]`: the agents' reports and the weights they were given.
fn reported_table(out: &mut String, r: &LabResult, from: f64, to: f64) {
    let _ = writeln!(
        out,
        "| backend | quota | reported CPU | reported in flight | in-flight ratio to typical | in-flight term set the load / distrusted | load steered by | weight (mean 1) | oracle weight (mean 1) |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    let oracle_mean = r.oracle_weights.iter().map(|w| f64::from(*w)).sum::<f64>()
        / r.oracle_weights.len().max(1) as f64;
    for (i, n) in r.names.iter().enumerate() {
        let got: Vec<_> = r
            .samples
            .iter()
            .filter(|s| s.t > from && s.t <= to)
            .filter_map(|s| s.reported[i])
            .collect();
        let avg = |f: fn(&super::sampler::Reported) -> f64| {
            got.iter().map(f).sum::<f64>() / got.len().max(1) as f64
        };
        if got.is_empty() {
            let _ = writeln!(
                out,
                "| {n} | {} | – | – | – | – | – | – | – |",
                pct(r.plan.quotas[i])
            );
            continue;
        }
        let est: Vec<_> = got.iter().filter_map(|x| x.estimate).collect();
        let ratio = if est.is_empty() {
            "–".to_string()
        } else {
            format!(
                "{:.2}",
                est.iter().map(|e| e.ratio).sum::<f64>() / est.len() as f64
            )
        };
        let _ = writeln!(
            out,
            "| {n} | {} | {} | {:.1} | {ratio} | {} / {} of {} samples | {:.2} | {:.2} | {:.2} |",
            pct(r.plan.quotas[i]),
            pct(avg(|x| x.cpu)),
            avg(|x| f64::from(x.inflight)),
            est.iter().filter(|e| e.binding).count(),
            est.iter().filter(|e| !e.trusted).count(),
            got.len(),
            avg(|x| x.load),
            avg(|x| x.weight),
            f64::from(r.oracle_weights[i]) / oracle_mean.max(1e-9),
        );
    }
    let _ = writeln!(out);
}

/// `docs/lab.md`: the headline (see [`headline`]), if given, the setup, the table, the
/// charts, what each run showed, and the targets. `command` is how to reproduce it;
/// `when` says when and where it ran.
pub fn markdown(r: &LabResult, headline: Option<&str>, command: &str, when: &str) -> String {
    let p = &r.plan;
    let c = &r.calibration;
    let rr = r.run("rr");
    let or = r.run("oracle");
    let ba = r.run("ballast");
    let dg = r.run("degraded");
    let rs = r.run("restart");
    let d = &r.degraded;
    let x = &r.restart;
    let sat = &r.saturation;
    let conv = &r.convergence;
    let agent_defaults = ballast_agent::config::AgentConfig::default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# The physical lab\n\n\
         The simulator shows the algorithm; this lab shows the product, deployed as users \
         deploy it. Six real HTTP backends burn real CPU inside cgroups with different \
         CPU quotas, standing for hardware generations. A real HAProxy (Debian's 2.6) \
         balances them with its default connection handling: clients keep their \
         connections open, and HAProxy keeps idle connections to the servers in a pool \
         for reuse. One real `ballast-agent` per backend, with the shipped defaults, \
         measures that backend's cgroup CPU and its in-flight requests and answers \
         HAProxy's agent-check; one aggregator, with the shipped defaults, steers. An \
         open-loop generator offers a fixed request rate, {} of the calibrated \
         capacity. Every Ballast figure stands beside round robin and an oracle (static \
         weights proportional to the true capacities) measured in the same lab run. \
         Everything runs on one machine, over loopback.\n\n\
         Reproduce (as root, about {:.0} minutes; installs nothing, needs Debian's \
         `haproxy`; exits non-zero, naming the target, when a target is missed):\n\n\
         ```sh\n{command}\n```\n\n\
         A short version of the same runs, with bounds measured from its own noise, is \
         `tests/tests/lab.rs`, part of `bash tests/run`.\n",
        pct(p.utilization),
        (r.seconds / 60.0).ceil().max(1.0),
    );

    if let Some(h) = headline {
        let _ = writeln!(
            out,
            "## In short\n\n<!-- figures: lab -->\n{h}\n<!-- figures: end -->\n"
        );
    }
    let _ = writeln!(out, "## Setup\n");
    let _ = writeln!(
        out,
        "| backend | CPU quota | saturated (closed loop) | CPU per request at {} load | \
         capacity at that cost | oracle weight |\n|---|---|---|---|---|---|",
        pct(p.utilization)
    );
    for (i, n) in r.names.iter().enumerate() {
        let _ = writeln!(
            out,
            "| {n} | {} of a core | {:.0} req/s | {:.2} ms | {:.0} req/s | {} |",
            pct(p.quotas[i]),
            c.saturated[i],
            c.cpu_ms[i],
            c.capacity[i],
            r.oracle_weights[i],
        );
    }
    let _ = writeln!(
        out,
        "| **all** | {} | {:.0} req/s | | **{:.0} req/s** | |\n",
        pct(p.quotas.iter().sum()),
        c.saturated.iter().sum::<f64>(),
        c.total
    );
    let _ = writeln!(
        out,
        "Calibration drives every backend straight (no HAProxy, keep-alive connections), \
         first closed loop to find what it serves at its quota, then open loop at {} of \
         that to measure what a request costs at the load the runs will offer. A backend \
         that is not saturated spends more CPU per request (it wakes up for each one \
         instead of finding the next one waiting), so the capacity the runs are offered a \
         share of is the quota over that cost. The oracle's weights are proportional to \
         the quotas, 100 on average: every backend runs the same code, so equal \
         utilization needs exactly these, while the calibrated capacities carry a few \
         seconds' noise.\n",
        pct(p.utilization)
    );
    let _ = writeln!(
        out,
        "- **Machine:** {}; {} at the end. cgroup {}. The backends' quotas add up to one \
         core; the other is left to HAProxy, the generator and Ballast. The lab's parent \
         cgroup has ten times the default CPU weight, so that other work on the machine \
         does not eat into the quotas being measured. Each backend runs in a child `svc` \
         of the cgroup that holds its quota, beside an empty sibling `batch` (section \
         10 fills one).\n\
         - **Work:** every request burns {} rounds of SipHash (calibrated to {} ms of \
         CPU in the lab's own process), on the request's own task; with the HTTP \
         handling, a request costs what the table says.\n\
         - **Load:** open loop at **{:.0} req/s** ({} of {:.0}), latency counted from \
         when each request was due, over a pool of keep-alive HTTP/1.1 connections to \
         HAProxy: a request takes an idle connection or opens one, up to {} (beyond \
         that it would count as failed). Run 3 has a surge part way (below).\n\
         - **HAProxy:** `balance roundrobin`, `weight 100`, `agent-check agent-inter \
         {}ms`, and its defaults otherwise: keep-alive on both sides, idle server \
         connections kept for reuse (`http-reuse safe`). In runs 1 and 2 the \
         agent-check is disabled on the runtime API and the weights are static (run 2 \
         sets the oracle's with `set weight`); from run 3 on it is enabled.\n\
         - **Ballast:** the shipped defaults. The aggregator runs its default cycle ({} \
         ms) and tells the agents its default report interval ({} ms); each agent runs \
         with `--cpu cgroup:ballast-lab-PID/web-N/svc --inflight tcp:PORT` (the in-flight \
         source a service port gives by default) and no `--capacity` (the agent's \
         default, {}).\n\
         - **Measurement:** every {:.0} s the lab reads each backend's cgroup CPU \
         accounting itself (not the agents' reports), its in-flight and connection \
         gauges (current and highest since the last read), HAProxy's weights and its \
         server connections (`show servers conn`), and what the aggregator's API shows \
         for each endpoint. max/avg and p95/avg are over the backends' mean utilization \
         in the run's window; min/avg is the lowest backend's.\n",
        r.host,
        r.load_end,
        r.layout,
        c.rounds,
        p.work_ms,
        c.offered,
        pct(p.utilization),
        c.total,
        super::MAX_OUTSTANDING,
        p.agent_inter_ms,
        p.cycle_ms,
        p.report_interval_ms,
        agent_defaults.capacity,
        p.sample_every.as_secs_f64(),
    );

    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(
        out,
        "| run | window | max/avg | min/avg | median 5 s max/avg | avg utilization | \
         p50 ms | p99 ms | errors / requests | client connections | other cores busy |\n\
         |---|---|---|---|---|---|---|---|---|---|---|"
    );
    for run in &r.runs {
        row(&mut out, run);
    }
    let _ = writeln!(
        out,
        "\nLatency is over the requests due in the window; errors and client connections \
         (opened by the generator) are over the whole run. \"Other cores busy\" is how \
         much of the machine everything outside the backends used meanwhile (HAProxy, \
         the generator, Ballast, and anything else running on the machine): the noise \
         the figures were taken under. With six backends the nearest-rank 95th \
         percentile is the highest one, so p95/avg equals max/avg and is not shown.\n"
    );

    let _ = writeln!(
        out,
        "### 1. Round robin\n\n\
         Per-backend utilization: {}.\n\n\
         Equal weights give every backend the same request rate, so the small quotas \
         saturate while the large ones idle: max/avg **{:.2}**, p99 **{:.0} ms**.\n\n\
         ![Run 1: utilization per backend under round robin](img/lab-rr.svg)\n",
        util_list(r, rr),
        rr.spread.max_over_avg,
        rr.load.p99_ms
    );
    let _ = writeln!(
        out,
        "### 2. Oracle\n\n\
         HAProxy's weights set to {} (proportional to the quotas). Per-backend \
         utilization: {}.\n\n\
         This is as balanced as the lab gets: max/avg **{:.3}**, p99 **{:.0} ms**. What \
         remains above 1 is the lab's own noise (contention, cgroup throttling periods), \
         which no balancer can remove.\n\n\
         ![Run 2: utilization per backend under the oracle's weights](img/lab-oracle.svg)\n",
        r.names
            .iter()
            .zip(&r.oracle_weights)
            .map(|(n, w)| format!("{n} {w}"))
            .collect::<Vec<_>>()
            .join(", "),
        util_list(r, or),
        or.spread.max_over_avg,
        or.load.p99_ms
    );
    let _ = writeln!(
        out,
        "### 3. Ballast, from equal weights, then a surge\n\n\
         The agents and the aggregator start fresh; HAProxy's weights are equal when the \
         load starts ({}). From {:.0} s into the run, for {:.0} s, the load is a surge of \
         {:.0} req/s, {:.2}× the fleet's calibrated capacity, so that requests pile up \
         on every backend including {} (the smallest); before and after it, the planned \
         {:.0} req/s. \
         Requests pile up on {}, HAProxy opens a server connection for each one waiting, \
         and keeps them in its pool once the surge is over: from the start of the surge \
         to 10 s after it, it held up to \
         **{}** connections to {} (up to {} carrying a request, up to {} idle), by the \
         backend's own count up to {} open.\n\n\
         Converged (max/avg within {:.0} % of the oracle's {:.3} over a whole {:.0} s \
         window from then on) **{}** after the start of the load. In the \
         steady window max/avg is **{:.3}** against the oracle's {:.3} and round robin's \
         {:.3}; the lowest backend is at {:.2}× the mean, the smallest ({}) at {:.2}×; \
         p99 **{:.0} ms** against the oracle's {:.0} ms. The grey lines mark the end of \
         the surge, the convergence and the start of the window.\n\n\
         Per-backend utilization in the steady window: {}.\n\n\
         ![Run 3: utilization per backend under Ballast](img/lab-ballast.svg)\n\n\
         HAProxy's weights at the end of the run: {} (the oracle's: {}).\n\n\
         What the aggregator held in the steady window (means over the samples):\n",
        sat.start_weights
            .iter()
            .zip(&r.names)
            .map(|(w, n)| format!("{n} {}", w.map_or("–".into(), |w| w.to_string())))
            .collect::<Vec<_>>()
            .join(", "),
        sat.at,
        sat.secs,
        sat.rate,
        sat.overload,
        r.names[sat.backend],
        c.offered,
        r.names[sat.backend],
        sat.hap_conns_peak,
        r.names[sat.backend],
        sat.hap_used_peak,
        sat.hap_idle_peak,
        sat.backend_conns_peak,
        (CONVERGENCE_BAND - 1.0) * 100.0,
        conv.oracle_windowed,
        CONVERGENCE_WINDOW_S,
        match (conv.after, conv.after_reports) {
            (Some(t), Some(r)) =>
                format!("{t:.0} s ({r:.0} s after the first reports that carried it)"),
            _ => "never".to_string(),
        },
        ba.spread.max_over_avg,
        or.spread.max_over_avg,
        rr.spread.max_over_avg,
        ba.min_over_avg(),
        r.names[sat.backend],
        sat.steady_rel_util,
        ba.load.p99_ms,
        or.load.p99_ms,
        util_list(r, ba),
        final_weights(r, ba),
        r.oracle_weights
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    );
    reported_table(&mut out, r, ba.start + ba.window.0, ba.end);
    let _ = writeln!(
        out,
        "The first {TRACE_S:.0} s of the run, sample by sample: each backend's \
         utilization, HAProxy's weight, and the load the aggregator steered it by — \
         followed, when its in-flight term set that load, by the smoothed count and its \
         ratio to the service's typical count, and marked † while the count was set \
         aside as not following the weight — with {}'s server connections in HAProxy \
         (in use / idle):\n",
        r.names[sat.backend]
    );
    trace_table(&mut out, r, ba, sat.backend);

    let late = d.at + p.degraded.2.as_secs_f64();
    let _ = writeln!(
        out,
        "### 4. Degraded backend\n\n\
         At {:.0} s, {} (the largest quota) starts stalling every request on a {} ms \
         sleep instead of burning CPU: its CPU falls to {} of its quota, which CPU \
         alone would read as an idle node and send more. Its share of new requests (by \
         when they left the client, attributed by the `X-Backend` header of the answer) \
         goes from {} before the stall to **{:.1} %** from {:.0} s after it; {}. The \
         most requests it held in flight after the stall was **{}** ({} from {:.0} s \
         after it; {:.1} on average then, {:.1} before the stall); at its old share it \
         would hold about {:.0}. Meanwhile the other backends answered with p99 \
         **{:.0} ms** (the oracle's {:.0} ms). Errors in the run: {}. The dark lines \
         mark the stall and the start of the measured phase.\n\n\
         ![Run 4: the stalled backend's CPU, share of new requests, in-flight requests and weight](img/lab-degraded.svg)\n\n\
         What the aggregator held from {:.0} s after the stall (means over the samples):\n",
        d.at,
        r.names[d.backend],
        p.stall_ms,
        pct(d.cpu_late),
        pct(d.share.0),
        d.share.1 * 100.0,
        p.degraded.2.as_secs_f64(),
        match d.share_low_after {
            Some(t) => format!(
                "it stayed below {:.0} % from {t:.0} s after the stall on",
                STALLED_SHARE * 100.0
            ),
            None => format!(
                "it was still at {:.0} % or more in the last second of the run",
                STALLED_SHARE * 100.0
            ),
        },
        d.inflight_max,
        d.inflight_max_late,
        p.degraded.2.as_secs_f64(),
        d.inflight_mean.1,
        d.inflight_mean.0,
        d.flood_at_old_share,
        d.others.p99_ms,
        or.load.p99_ms,
        dg.whole.errors,
        p.degraded.2.as_secs_f64(),
    );
    reported_table(&mut out, r, dg.start + late, dg.end);

    let _ = writeln!(
        out,
        "### 5. Stop and restart with drain\n\n\
         {}: `ballast-agent drain` at {:.1} s; HAProxy showed it in DRAIN at {:.1} s; \
         stopped (SIGTERM) at {:.1} s once its in-flight gauge read 0; started again \
         and seen up by HAProxy at {:.1} s; `ballast-agent undrain` at {:.1} s. It \
         answered {} requests while drained and {} after the undrain, ramping up as a \
         newcomer. **{} failed requests** out of {}.\n\n\
         The p99 of the requests due in each second, ms: {}. Requests slower than {:.0} ms, \
         by the backend that answered them: {}.\n",
        r.names[x.backend],
        x.marks[0],
        x.marks[1],
        x.marks[2],
        x.marks[3],
        x.marks[4],
        x.served_while_drained,
        x.served_after,
        rs.whole.errors,
        rs.whole.requests,
        x.p99_by_second
            .iter()
            .enumerate()
            .map(|(t, v)| format!("{t}: {v:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        super::SLOW_MS,
        if x.slow_by_backend.is_empty() {
            "none".to_string()
        } else {
            x.slow_by_backend
                .iter()
                .map(|(b, n)| format!("{b} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        },
    );

    let _ = writeln!(
        out,
        "### 6.–9. What users would pick instead\n\n\
         An HAProxy user without Ballast would pick `balance leastconn` or `balance \
         random(2)` (the least loaded of two random servers) rather than static weights. \
         Each ran in an HAProxy of its own over the same servers, equal weights, in this \
         lab run: steady as runs 1–3, then with run 4's stall (from {:.0} s, measured from \
         {:.0} s after it).\n",
        d.at,
        p.degraded.2.as_secs_f64(),
    );
    balancers_table(&mut out, r);

    if let Some(n) = &r.neighbour {
        neighbour_section(&mut out, r, n);
    }

    let cost = |run: &RunResult| {
        let cores: f64 = run.util.iter().zip(&p.quotas).map(|(u, q)| u * q).sum();
        cores * 1000.0 / c.offered.max(1e-9)
    };
    let others: Vec<f64> = r.runs.iter().filter_map(|x| x.other_cores).collect();
    let _ = writeln!(
        out,
        "## Conditions and noise\n\n\
         - The machine was shared: {}, {} at the end; beside the backends, {:.2}–{:.2} \
         cores were busy during the runs (last column of the table), much of it other \
         work than the lab's.\n\
         - In run 3 a request cost {:.2} ms of CPU, against {:.2} ms measured during \
         calibration at the same load: the difference moves the average utilization \
         away from the planned {}, for every backend alike, so it shifts the average, \
         not the spread.\n\
         - Contention moves all backends together, which max/avg is blind to by \
         construction; the oracle's max/avg is what the remaining noise costs, and the \
         median 5 s max/avg column shows what the short-term noise adds to a window's \
         figure.\n",
        r.host,
        r.load_end,
        others.iter().copied().fold(f64::INFINITY, f64::min),
        others.iter().copied().fold(0.0, f64::max),
        cost(ba),
        mean(&c.cpu_ms),
        pct(p.utilization),
    );

    let _ = writeln!(out, "## Targets\n");
    targets_table(&mut out, "target", &targets(r));
    let _ = writeln!(
        out,
        "\nRun with `{command}` on {when}; the whole lab took {:.0} s.",
        r.seconds
    );
    out
}

/// Every balancer of a lab run side by side: steady max/avg and p99, and for those that
/// ran the stall, what the stalled backend kept and what the service's users saw.
fn balancers_table(out: &mut String, r: &LabResult) {
    let rr = r.run("rr");
    let or = r.run("oracle");
    let ba = r.run("ballast");
    let dg = r.run("degraded");
    let d = &r.degraded;
    let _ = writeln!(
        out,
        "| balancer | steady max/avg | steady p99 ms | stalled backend's share | its share \
         stayed below {:.0} % from | service p99 ms | other backends' p99 ms | errors / \
         requests |\n|---|---|---|---|---|---|---|---|",
        STALLED_SHARE * 100.0,
    );
    let stall_cells = |d: &super::Degraded, run: &RunResult| {
        format!(
            "{:.1} % | {} | {:.0} | {:.0} | {} / {}",
            d.share.1 * 100.0,
            d.share_low_after
                .map_or("never".to_string(), |t| format!("{t:.0} s")),
            d.all.p99_ms,
            d.others.p99_ms,
            run.whole.errors,
            run.whole.requests
        )
    };
    for (title, steady, stalled) in [
        ("round robin", rr, None),
        ("oracle (static weights ∝ quotas)", or, None),
        ("Ballast, shipped defaults", ba, Some((d, dg))),
    ] {
        let _ = writeln!(
            out,
            "| {title} | {:.3} | {:.0} | {} |",
            steady.spread.max_over_avg,
            steady.load.p99_ms,
            stalled.map_or("– | – | – | – | –".to_string(), |(d, run)| {
                stall_cells(d, run)
            })
        );
    }
    for ((name, balance), (_, pd)) in super::PEERS.iter().zip(&r.peer_degraded) {
        let steady = r.run(name);
        let run = r.run(&format!("{name}_degraded"));
        let _ = writeln!(
            out,
            "| HAProxy `{balance}` | {:.3} | {:.0} | {} |",
            steady.spread.max_over_avg,
            steady.load.p99_ms,
            stall_cells(pd, run)
        );
    }
    let _ = writeln!(
        out,
        "\nThe service's p99 counts every request due in the measured phase, the stalled \
         backend's answers included: while it keeps even 1 % of the requests, its stall \
         is the service's p99.\n"
    );
}

/// The lab's headline, between the `<!-- figures: lab -->` and `<!-- figures: end -->`
/// lines of `docs/lab.md`, where the README quotes it: every balancer's steady max/avg
/// and p99, convergence, the stalled backend's share at both rates, the restart's
/// failures. `low` is the run at a low request rate.
pub fn headline(r: &LabResult, low: &LabResult) -> String {
    let rr = r.run("rr");
    let or = r.run("oracle");
    let ba = r.run("ballast");
    let lc = r.run("leastconn");
    let rs = r.run("restart");
    let peer_share = |r: &LabResult, name: &str| {
        r.peer_degraded
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("–".to_string(), |(_, d)| {
                format!("{:.1} %", d.share.1 * 100.0)
            })
    };
    let text = format!(
        "Round robin leaves the smallest backends saturated (max/avg {:.2}, p99 {:.0} ms); \
         static weights proportional to the true quotas, the oracle, give {:.3} and p99 \
         {:.0} ms, and HAProxy's `leastconn` {:.2} and p99 {:.0} ms. Ballast gives {:.3} and \
         p99 {:.0} ms, from equal weights within {} of the first reports that carried the \
         load. A backend stalled on I/O drops to {:.1} % of the new requests (leastconn \
         {}), and to {:.1} % at {:.0} requests a second instead of {:.0} (leastconn {}); a \
         backend is drained, restarted and undrained under load with {} failed requests \
         of {}.",
        rr.spread.max_over_avg,
        rr.load.p99_ms,
        or.spread.max_over_avg,
        or.load.p99_ms,
        lc.spread.max_over_avg,
        lc.load.p99_ms,
        ba.spread.max_over_avg,
        ba.load.p99_ms,
        r.convergence
            .after_reports
            .map_or("no window".to_string(), |t| format!("{t:.0} s")),
        r.degraded.share.1 * 100.0,
        peer_share(r, "leastconn"),
        low.degraded.share.1 * 100.0,
        low.calibration.offered,
        r.calibration.offered,
        peer_share(low, "leastconn"),
        rs.whole.errors,
        rs.whole.requests,
    );
    wrap(&text, 88)
}

/// `text` broken into lines of at most `width` characters at spaces.
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split_whitespace() {
        let n = word.chars().count();
        if line > 0 && line + 1 + n > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += n;
    }
    out
}

/// A table of targets, each with its figure and whether it was met.
fn targets_table(out: &mut String, heading: &str, targets: &[Target]) {
    let _ = writeln!(out, "| {heading} | measured | met |\n|---|---|---|");
    for t in targets {
        let _ = writeln!(
            out,
            "| {} | {} | {} |",
            t.what,
            t.measured,
            if t.met { "yes" } else { "**no**" }
        );
    }
}

/// The neighbour runs' section of `docs/lab.md`.
fn neighbour_section(out: &mut String, r: &LabResult, n: &super::NeighbourResult) {
    let (len, settle) = r.plan.neighbour.unwrap_or_default();
    let name = &r.names[n.backend];
    let _ = writeln!(
        out,
        "### 10. A neighbour in a backend's cgroup\n\n\
         A shell busy loop joins the cgroup {name} runs in, as a sidecar, a log shipper \
         or a batch job would, and shares its quota. Straight to {name} with nothing else (the \
         calibration's closed loop), it served {:.0} % of what it served alone: its fair \
         share of the requests with the capacity left is **{:.1} %** (the fleet's \
         capacity left divided among the backends as it is left). Ballast's agent on \
         {name} reads its cgroup's CPU, which the loop holds at the quota whatever the \
         weight. Each run is {:.0} s at the same rate as the others, measured from \
         {:.0} s. The loop at `nice -n 19` runs after the sibling run below, from where \
         that run left the backend. Nice puts the loop behind the service on a core they share, and the \
         agent counts a niced member's time as idle, but only in the periods its cgroup \
         was not throttled: on the other core the loop spends the quota at full speed, \
         nice or not, and the whole group then waits for the next period, so under a \
         quota it is as greedy as the first (read as idle regardless, it left the \
         backend most of its share, and the backend's requests waiting hundreds of ms).\n\n\
         The same loop in a sibling cgroup instead, under the same quota: {name} runs \
         in a child cgroup of the one that holds its quota, beside an empty sibling (a \
         slice with the service's unit and a batch unit under one `CPUQuota=`), and the \
         loop runs there first, before the two runs above. The scheduler splits a contended \
         quota between the two cgroups by their weights, and the agent, reading the \
         service's cgroup, counts on the quota less what the sibling takes of its \
         share. Beside the loop so placed, {name} served {:.0} % of what it served \
         alone (measured after the runs, so that the closed loop's saturation does not \
         cut the weight the run starts from): its fair share is **{:.1} %**.\n\n\
         | balancer | neighbour | {name}'s share of new requests | against its fair share \
         | service p99 ms | {name}'s own p99 ms |\n|---|---|---|---|---|---|",
        n.available * 100.0,
        n.fair_share * 100.0,
        len.as_secs_f64(),
        settle.as_secs_f64(),
        n.sibling.available * 100.0,
        n.sibling.fair_share * 100.0,
    );
    let fair = |share: f64| format!("× {:.2}", share / n.fair_share.max(1e-9));
    let _ = writeln!(
        out,
        "| Ballast, shipped defaults | none (run 3) | {:.1} % | – | – | – |",
        n.base_share * 100.0
    );
    for (who, what, (share, lat), own) in [
        (
            "Ballast, shipped defaults",
            "niced",
            &n.niced,
            n.own_p99_ms[1],
        ),
        (
            "Ballast, shipped defaults",
            "greedy",
            &n.ballast,
            n.own_p99_ms[0],
        ),
        (
            "HAProxy `leastconn`",
            "greedy",
            &n.leastconn,
            n.own_p99_ms[2],
        ),
    ] {
        let _ = writeln!(
            out,
            "| {who} | {what} | {:.1} % | {} | {:.0} | {own:.0} |",
            share * 100.0,
            if what == "greedy" {
                fair(*share)
            } else {
                "–".into()
            },
            lat.p99_ms
        );
    }
    let sib = &n.sibling;
    let _ = writeln!(
        out,
        "| Ballast, shipped defaults | greedy, in a sibling cgroup | {:.1} % | × {:.2} | {:.0} \
         | {:.0} |",
        sib.ballast.0 * 100.0,
        sib.ballast.0 / sib.fair_share.max(1e-9),
        sib.ballast.1.p99_ms,
        sib.own_p99_ms
    );
    let (reported, truth) = sib.reading;
    let _ = writeln!(
        out,
        "\nBeside the sibling, {name}'s agent read {:.1} % where its service used {:.1} % \
         of the half of the quota the loop leaves it (the lab reads the service cgroup's \
         counter itself): × {:.2}. The share it is given is then the controller's: its \
         requests wait for the quota's next period whenever the loop has spent it, a \
         latency several times the fleet's at any weight, and where the in-flight term \
         reads that as a slow node it sheds it, and the service's tail is the rest of \
         the fleet's.",
        reported * 100.0,
        truth * 100.0,
        reported / truth.max(1e-9)
    );
    let _ = writeln!(out);
}

/// The stalled backend's share of new requests, at most, in the low-rate run.
pub const TARGET_LOW_RATE_SHARE: f64 = 0.02;
/// The service's p99 during the low-rate stall, relative to the oracle's steady p99.
pub const TARGET_LOW_RATE_P99_VS_ORACLE: f64 = 2.0;

/// The targets of the lab at a low request rate ([`super::Plan::low_rate`]): where a
/// stalled backend holds a request or two, it sheds its traffic all the same, and the
/// service's tail stays the oracle's.
pub fn low_rate_targets(r: &LabResult) -> Vec<Target> {
    let or = r.run("oracle");
    let ba = r.run("ballast");
    let d = &r.degraded;
    let leastconn = r.run("leastconn");
    vec![
        stalled_share_target(
            r,
            "≤",
            TARGET_LOW_RATE_SHARE,
            d.share.1 <= TARGET_LOW_RATE_SHARE,
        ),
        Target {
            what: format!(
                "meanwhile the service's p99 ≤ {TARGET_LOW_RATE_P99_VS_ORACLE}× the \
                 oracle's steady p99"
            ),
            measured: format!("{:.0} ms vs {:.0} ms", d.all.p99_ms, or.load.p99_ms),
            met: d.all.p99_ms <= or.load.p99_ms * TARGET_LOW_RATE_P99_VS_ORACLE,
        },
        Target {
            what: "steady p99 ≤ leastconn's".into(),
            measured: format!(
                "{:.0} ms vs {:.0} ms",
                ba.load.p99_ms, leastconn.load.p99_ms
            ),
            met: ba.load.p99_ms <= leastconn.load.p99_ms,
        },
        Target {
            what: format!("steady max/avg ≤ oracle's × {TARGET_VS_ORACLE}"),
            measured: format!(
                "{:.3} vs {:.3}",
                ba.spread.max_over_avg, or.spread.max_over_avg
            ),
            met: ba.spread.max_over_avg <= or.spread.max_over_avg * TARGET_VS_ORACLE,
        },
    ]
}

/// The section of `docs/lab.md` on the lab at a low request rate: the same runs and
/// peers at about a sixth of the request rate, every balancer side by side, and its
/// targets.
pub fn low_rate_markdown(r: &LabResult) -> String {
    let p = &r.plan;
    let c = &r.calibration;
    let d = &r.degraded;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## At a low request rate\n\n\
         The same backends, quotas and runs, with requests {:.0} times as costly ({} ms \
         of CPU) offered at {} of the capacity: **{:.0} requests a second** in all. A \
         stalled backend then holds a few requests in flight at its old share and a \
         fraction of one once its weight has fallen, a count hard to tell from noise, and \
         the share a stalled node keeps depends on the rate: this is where it is hard. {} \
         stalls from {:.0} s into run 4; the stall columns are measured from {:.0} s \
         after it.\n",
        p.work_ms / Plan::full().work_ms,
        p.work_ms,
        pct(p.utilization),
        c.offered,
        r.names[d.backend],
        d.at,
        p.degraded.2.as_secs_f64(),
    );
    balancers_table(&mut out, r);
    targets_table(&mut out, "target at a low rate", &low_rate_targets(r));
    let _ = writeln!(out, "\nThis part took {:.0} s.", r.seconds);
    out
}

/// How much of run 3's start [`trace_table`] shows.
const TRACE_S: f64 = 15.0;

/// Run `run`'s first [`TRACE_S`] seconds, one row per sample: max/avg, and per backend
/// utilization / HAProxy weight / load steered by; `m`'s HAProxy connections.
fn trace_table(out: &mut String, r: &LabResult, run: &RunResult, m: usize) {
    let _ = writeln!(
        out,
        "| s | max/avg | {} | {} conns |\n|---|---|{}---|",
        r.names.join(" | "),
        r.names[m],
        "---|".repeat(r.names.len())
    );
    for s in r
        .samples
        .iter()
        .filter(|s| s.t > run.start && s.t <= run.start + TRACE_S)
    {
        let utils: Vec<f64> = s.util.iter().map(|u| u.unwrap_or(0.0)).collect();
        let spread = ballast_balance::stats::Spread::of(&utils);
        let cells: Vec<String> = (0..r.names.len())
            .map(|i| {
                let load = s.reported[i].map_or("–".into(), |x| {
                    let mut l = format!("{:.2}", x.load);
                    if let Some(e) = x.estimate {
                        if e.binding {
                            let _ = write!(l, " ({:.1}, ×{:.1})", e.smoothed, e.ratio);
                        }
                        if !e.trusted {
                            l.push_str(" †");
                        }
                    }
                    l
                });
                format!(
                    "{} / {} / {load}",
                    pct(utils[i]),
                    s.weight[i].map_or("–".into(), |w| w.to_string()),
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "| {:.0} | {:.2} | {} | {} |",
            s.t - run.start,
            spread.max_over_avg,
            cells.join(" | "),
            s.hap_conns[m].map_or("–".into(), |c| format!("{} / {}", c.used, c.idle))
        );
    }
    let _ = writeln!(out);
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// HAProxy's weights at the last sample of `run`, by backend.
fn final_weights(r: &LabResult, run: &RunResult) -> String {
    let last = r
        .samples
        .iter()
        .rev()
        .find(|s| s.t <= run.end && s.weight.iter().all(Option::is_some));
    match last {
        Some(s) => r
            .names
            .iter()
            .zip(&s.weight)
            .map(|(n, w)| format!("{n} {}", w.unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", "),
        None => "not sampled".to_string(),
    }
}

fn util_list(r: &LabResult, run: &RunResult) -> String {
    r.names
        .iter()
        .zip(&run.util)
        .zip(&r.plan.quotas)
        .map(|((n, u), q)| format!("{n} ({}) {}", pct(*q), pct(*u)))
        .collect::<Vec<_>>()
        .join(", ")
}
