//! `docs/lab.md` and its charts, from a [`LabResult`].

use super::{LabResult, RunResult};
use ballast_aggregator::simulate::chart::{line_chart, Line, LineChart};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The targets of the issue, as thresholds.
pub const TARGET_MAX_OVER_AVG: f64 = 1.05;

/// Writes the charts `docs/lab.md` shows: for runs 1 and 2 each backend's CPU use
/// relative to its quota, sample by sample; for run 3 the stalled backend's CPU, its
/// in-flight load and its weight. Returns the files written.
pub fn charts(r: &LabResult, dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    let mut draw = |file: &str, c: LineChart| -> Result<(), String> {
        let path = dir.join(file);
        line_chart(&path, &c).map_err(|e| e.to_string())?;
        out.push(path);
        Ok(())
    };
    for name in ["rr", "ballast"] {
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
            markers.extend(r.converged_after);
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
    let k = r.degraded.backend;
    let cap = f64::from(r.plan.capacity);
    let title = format!(
        "{}: {} stalls {} ms per request from {:.0} s",
        run.title, r.names[k], r.plan.stall_ms, r.degraded.at
    );
    draw(
        "lab-degraded.svg",
        LineChart {
            title: &title,
            x_desc: "seconds into the run",
            y_desc: "relative to quota, capacity, mean weight",
            x_max: run.end - run.start,
            y_floor: 0.0,
            lines: vec![
                Line {
                    label: "CPU / quota".into(),
                    points: series(r, run, |s| s.util[k]),
                },
                Line {
                    label: format!("in flight / capacity {cap:.0}"),
                    points: series(r, run, |s| s.inflight[k].map(|v| f64::from(v) / cap)),
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
            markers: vec![
                r.degraded.at,
                r.degraded.at + r.plan.degraded.2.as_secs_f64(),
            ],
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
        "| {} | {:.0}–{:.0} s | **{:.3}** | {:.3} | {:.3} | {} | {:.0} | **{:.0}** | {} / {} | {} |",
        run.title,
        run.window.0,
        run.window.1,
        run.spread.max_over_avg,
        run.spread.p95_over_avg,
        run.windowed_max_over_avg,
        pct(run.spread.avg),
        l.p50_ms,
        l.p99_ms,
        run.whole.errors,
        run.whole.requests,
        run.other_cores
            .map_or("–".to_string(), |c| format!("{c:.2}")),
    );
}

/// `docs/lab.md`: the setup, the table, the charts and what each run showed.
/// `command` is how to reproduce it; `when` says when and where it ran.
pub fn markdown(r: &LabResult, command: &str, when: &str) -> String {
    let p = &r.plan;
    let c = &r.calibration;
    let rr = r.run("rr");
    let ba = r.run("ballast");
    let dg = r.run("degraded");
    let rs = r.run("restart");
    let d = &r.degraded;
    let x = &r.restart;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# The physical lab\n\n\
         The simulator shows the algorithm; this lab shows the product. Six real HTTP \
         backends burn real CPU inside cgroups with different CPU quotas, standing for \
         hardware generations. A real HAProxy (Debian's 2.6) balances them round robin. \
         One real `ballast-agent` per backend measures that backend's cgroup CPU and its \
         in-flight requests and answers HAProxy's agent-check; one aggregator steers. \
         An open-loop generator offers a fixed request rate, {} of the calibrated \
         capacity. Everything runs on one machine, over loopback.\n\n\
         Reproduce (as root, about {:.0} minutes; installs nothing, needs Debian's \
         `haproxy`):\n\n```sh\n{command}\n```\n\n\
         A short version of the same runs (a few seconds each, the same assertions on \
         direction) is `tests/tests/lab.rs`, part of `bash tests/run`.\n",
        pct(p.utilization),
        (r.seconds / 60.0).ceil().max(1.0),
    );

    let _ = writeln!(out, "## Setup\n");
    let _ = writeln!(
        out,
        "| backend | CPU quota | saturated (closed loop) | CPU per request at {} load | \
         capacity at that cost |\n|---|---|---|---|---|",
        pct(p.utilization)
    );
    for (i, n) in r.names.iter().enumerate() {
        let _ = writeln!(
            out,
            "| {n} | {} of a core | {:.0} req/s | {:.2} ms | {:.0} req/s |",
            pct(p.quotas[i]),
            c.saturated[i],
            c.cpu_ms[i],
            c.capacity[i],
        );
    }
    let _ = writeln!(
        out,
        "| **all** | {} | {:.0} req/s | | **{:.0} req/s** |\n",
        pct(p.quotas.iter().sum()),
        c.saturated.iter().sum::<f64>(),
        c.total
    );
    let _ = writeln!(
        out,
        "Calibration drives every backend straight (no HAProxy), first closed loop to \
         find what it serves at its quota, then open loop at {} of that to measure what a \
         request costs at the load the runs will offer. A backend that is not saturated \
         spends more CPU per request (it wakes up for each one instead of finding the \
         next one waiting), so the capacity the runs are offered a share of is the quota \
         over that cost.\n",
        pct(p.utilization)
    );
    let _ = writeln!(
        out,
        "- **Machine:** {}. cgroup {}. The backends' quotas add up to one core; the \
         other is left to HAProxy, the generator and Ballast. The lab's parent cgroup \
         has ten times the default CPU weight, so that other work on the machine does \
         not eat into the quotas being measured.\n\
         - **Work:** every request burns {} rounds of SipHash (calibrated to {} ms of \
         CPU in the lab's own process), on the request's own task; with the HTTP \
         handling, a request costs what the table says.\n\
         - **Load:** open loop at **{:.0} req/s** ({} of {:.0}), one connection per \
         request, latency counted from when each request was due.\n\
         - **HAProxy:** `balance roundrobin`, `weight 100`, `option http-server-close`, \
         `agent-check agent-inter {}ms`. In run 1 the agent-check is disabled on the \
         runtime API; from run 2 on it is enabled.\n\
         - **Ballast:** aggregator cycle {} ms, agents report every {} ms with \
         `--cpu cgroup:ballast-lab-PID/web-N --inflight tcp:PORT --capacity {}`.\n\
         - **Measurement:** every {:.0} s the lab reads each backend's cgroup CPU \
         accounting itself (not the agents' reports), its in-flight gauge and \
         HAProxy's weights. max/avg and p95/avg are over the backends' mean \
         utilization in the run's window.\n",
        r.host,
        r.layout,
        c.rounds,
        p.work_ms,
        c.offered,
        pct(p.utilization),
        c.total,
        p.agent_inter_ms,
        p.cycle_ms,
        p.report_interval_ms,
        p.capacity,
        p.sample_every.as_secs_f64(),
    );

    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(
        out,
        "| run | window | max/avg | p95/avg | median 5 s max/avg | avg utilization | \
         p50 ms | p99 ms | errors / requests | other cores busy |\n\
         |---|---|---|---|---|---|---|---|---|---|"
    );
    for run in &r.runs {
        row(&mut out, run);
    }
    let _ = writeln!(
        out,
        "\nLatency is over the requests due in the window; errors are over the whole \
         run. \"Other cores busy\" is how much of the machine everything outside the \
         backends used meanwhile (HAProxy, the generator, Ballast, and anything else \
         running on the machine): the noise the figures were taken under. With six \
         backends the nearest-rank 95th percentile is the highest one, so p95/avg equals \
         max/avg.\n"
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
        "### 2. Ballast\n\n\
         Per-backend utilization in the steady window: {}.\n\n\
         From equal weights, the first 5 s window with max/avg ≤ 1.10 ends {} after the \
         agent-check is switched on. In the steady window max/avg is **{:.3}** \
         (target ≤ {TARGET_MAX_OVER_AVG}) and p99 **{:.0} ms** against round robin's \
         {:.0} ms. The grey lines mark the convergence and the start of the window.\n\n\
         ![Run 2: utilization per backend under Ballast](img/lab-ballast.svg)\n\n\
         HAProxy's weights at the end of the run: {} (the quotas are {}).\n",
        util_list(r, ba),
        r.converged_after
            .map_or("never".to_string(), |t| format!("{t:.0} s")),
        ba.spread.max_over_avg,
        ba.load.p99_ms,
        rr.load.p99_ms,
        final_weights(r, ba),
        r.plan
            .quotas
            .iter()
            .map(|q| format!("{:.0}", q * 100.0))
            .collect::<Vec<_>>()
            .join(" : "),
    );
    let _ = writeln!(
        out,
        "### 3. Degraded backend\n\n\
         At {:.0} s, {} (the largest quota) starts stalling every request on a {} ms \
         sleep instead of burning CPU: its CPU falls to {} of its quota, which CPU \
         alone would read as an idle node and send more. With `max(cpu, in-flight)` its \
         load is its in-flight count over the capacity {}, and its share of requests \
         goes from {} before the stall to {} from {:.0} s after it. Its in-flight \
         requests averaged {:.1} before and {:.1} after (highest {} right after the \
         stall, {} once the controller had reacted); at its old share it would hold \
         about {:.0}. Errors in the run: {}. The dark lines mark the stall and the start \
         of the measured phase.\n\n\
         ![Run 3: the stalled backend's CPU, in-flight load and weight](img/lab-degraded.svg)\n",
        d.at,
        r.names[d.backend],
        p.stall_ms,
        pct(d.cpu_late),
        p.capacity,
        pct(d.share.0),
        pct(d.share.1),
        p.degraded.2.as_secs_f64(),
        d.inflight_mean.0,
        d.inflight_mean.1,
        d.inflight_max,
        d.inflight_max_late,
        d.flood_at_old_share,
        dg.whole.errors,
    );
    let _ = writeln!(
        out,
        "### 4. Stop and restart with drain\n\n\
         {}: `ballast-agent drain` at {:.1} s; HAProxy showed it in DRAIN at {:.1} s; \
         stopped (SIGTERM) at {:.1} s once its in-flight gauge read 0; started again \
         and seen up by HAProxy at {:.1} s; `ballast-agent undrain` at {:.1} s. It \
         answered {} requests while drained and {} after the undrain, ramping up as a \
         newcomer. **{} failed requests** out of {}.\n",
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
    );

    let cost = |run: &RunResult| {
        let cores: f64 = run.util.iter().zip(&p.quotas).map(|(u, q)| u * q).sum();
        cores * 1000.0 / c.offered.max(1e-9)
    };
    let others: Vec<f64> = r.runs.iter().filter_map(|x| x.other_cores).collect();
    let _ = writeln!(
        out,
        "## Conditions and noise\n\n\
         - The machine was shared: {}; beside the backends, {:.2}–{:.2} cores were busy \
         during the runs (last column of the table), much of it other work than the \
         lab's.\n\
         - In run 2 a request cost {:.2} ms of CPU, against {:.2} ms measured during \
         calibration at the same load: the difference moves the average utilization \
         away from the planned {}, for every backend alike, so it shifts the average, \
         not the spread.\n\
         - Contention moves all backends together (the common swings in the run 2 chart), \
         which max/avg is blind to by construction; the median 5 s max/avg column shows \
         what the short-term noise adds to the window's figure.\n",
        r.host,
        others.iter().copied().fold(f64::INFINITY, f64::min),
        others.iter().copied().fold(0.0, f64::max),
        cost(ba),
        mean(&c.cpu_ms),
        pct(p.utilization),
    );

    let _ = writeln!(
        out,
        "## Targets\n\n| target | measured | met |\n|---|---|---|"
    );
    let small = r.plan.quotas.iter().copied().fold(f64::INFINITY, f64::min);
    let small_util: Vec<String> = rr
        .util
        .iter()
        .zip(&r.plan.quotas)
        .filter(|(_, q)| (**q - small).abs() < 1e-9)
        .map(|(u, _)| pct(*u))
        .collect();
    let targets = [
        (
            "round robin saturates the smallest quotas".to_string(),
            format!("{} of their quota", small_util.join(", ")),
            rr.util
                .iter()
                .zip(&r.plan.quotas)
                .filter(|(_, q)| (**q - small).abs() < 1e-9)
                .all(|(u, _)| *u >= 0.9),
        ),
        (
            format!("Ballast steady max/avg ≤ {TARGET_MAX_OVER_AVG}"),
            format!("{:.3}", ba.spread.max_over_avg),
            ba.spread.max_over_avg <= TARGET_MAX_OVER_AVG,
        ),
        (
            "p99 well below round robin's".to_string(),
            format!("{:.0} ms vs {:.0} ms", ba.load.p99_ms, rr.load.p99_ms),
            ba.load.p99_ms * 2.0 <= rr.load.p99_ms,
        ),
        (
            "the degraded backend is never flooded".to_string(),
            format!(
                "in-flight {:.1} on average, {} at most, after the reaction (capacity {})",
                d.inflight_mean.1, d.inflight_max_late, p.capacity
            ),
            d.inflight_mean.1 <= f64::from(p.capacity)
                && d.inflight_max_late <= 2 * p.capacity
                && d.share.1 < d.share.0,
        ),
        (
            "zero failed requests across stop and restart".to_string(),
            format!("{} of {}", rs.whole.errors, rs.whole.requests),
            rs.whole.errors == 0,
        ),
    ];
    for (what, got, ok) in targets {
        let _ = writeln!(
            out,
            "| {what} | {got} | {} |",
            if ok { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(
        out,
        "\nRun on {when}; the whole lab took {:.0} s.",
        r.seconds
    );
    out
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
