//! `docs/balance.md` and its charts, generated from a [`SimSummary`]: every number in
//! the document comes from the run that wrote it.

use super::fleet::SCORE_CAPACITY;
use super::metrics::{Metrics, CHART_WINDOW, OVERSHOOT_HORIZON, SETTLE_BAND, SETTLE_HOLD};
use super::scenario::EventKind;
use super::tune::{self, Sweep};
use super::{chart, findings, headline, step, ScenarioSummary, SimError, SimSummary, REGENERATE};
use ballast_balance::{Params, PidGains};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Writes `dir/balance.md` and `dir/img/balance-*.svg`; returns the files written.
pub fn write(dir: &Path, s: &SimSummary) -> Result<Vec<PathBuf>, SimError> {
    let img = dir.join("img");
    std::fs::create_dir_all(&img).map_err(|source| SimError::Io {
        path: img.clone(),
        source,
    })?;
    let mut written = Vec::new();
    for sc in &s.scenarios {
        let id = sc.scenario.id;
        let q = img.join(format!("balance-{id}-quantiles.svg"));
        chart::quantiles(&q, sc)?;
        written.push(q);
        let r = img.join(format!("balance-{id}-max-avg.svg"));
        chart::max_over_avg(&r, sc)?;
        written.push(r);
        if let Some(what) = watched_name(id) {
            let w = img.join(format!("balance-{id}-watched.svg"));
            chart::watched(&w, sc, what)?;
            written.push(w);
        }
    }
    for r in &s.steps {
        let p = img.join(format!("balance-{}-step-response.svg", r.scenario));
        chart::step_response(&p, r)?;
        written.push(p);
    }
    let md = dir.join("balance.md");
    std::fs::write(&md, markdown(s)).map_err(|source| SimError::Io {
        path: md.clone(),
        source,
    })?;
    written.push(md);
    Ok(written)
}

pub(super) fn watched_name(id: &str) -> Option<&'static str> {
    match id {
        "cold_join" => Some("the newcomer's"),
        "degraded_io" | "pooled_http2" => Some("the degraded node's"),
        "fail_fast" => Some("the failing node's"),
        "neighbour" | "niced_neighbour" => Some("the neighbour's host's"),
        _ => None,
    }
}

pub(super) fn f3(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

pub(super) fn pct(x: f64) -> String {
    if x > 0.0 && x < 0.001 {
        "<0.1 %".to_string()
    } else {
        format!("{:.1} %", x * 100.0)
    }
}

pub(super) fn settle(m: &Metrics) -> String {
    match (m.settle_cycles, m.overshoot) {
        (_, None) => "–".to_string(),
        (None, Some(_)) => "never".to_string(),
        (Some(k), Some(_)) if m.settle_band > SETTLE_BAND + 1e-9 => {
            format!("{k} (±{:.0} %)", m.settle_band * 100.0)
        }
        (Some(k), Some(_)) => k.to_string(),
    }
}

pub(super) fn overshoot(m: &Metrics) -> String {
    match m.overshoot {
        None => "–".to_string(),
        Some(o) => format!("{} (±{:.1})", pct(o), m.transient_noise * 100.0),
    }
}

pub(super) fn skipped(m: &Metrics) -> String {
    if m.skipped.is_empty() {
        "0".to_string()
    } else {
        m.skipped
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

pub(super) fn gains(g: &PidGains) -> String {
    format!("kp {} · ki {} · kd {}", g.kp, g.ki, g.kd)
}

fn scenario_table(out: &mut String, sc: &ScenarioSummary) {
    out.push_str(
        "| strategy | max/avg | CPU max/avg | p95/avg | p5/avg | max/avg (5 s) | settle (cycles) \
         | overshoot (± noise) | weight churn / cycle | requests on nodes > 100 % | errors \
         | p99 latency | Ballast skipped cycles |\n",
    );
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in &sc.results {
        let m = &r.metrics;
        let _ = writeln!(
            out,
            "| {} | **{}** | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} ms | {} |",
            r.label(),
            f3(m.max_over_avg),
            f3(m.cpu_max_over_avg),
            f3(m.p95_over_avg),
            f3(m.p5_over_avg),
            f3(m.max_over_avg_5s),
            settle(m),
            overshoot(m),
            m.churn.map_or("–".to_string(), pct),
            pct(m.overloaded_share),
            pct(m.error_share),
            m.p99_latency_ms,
            if r.strategy.uses_ballast() {
                skipped(m)
            } else {
                "–".to_string()
            },
        );
    }
    if sc.results.iter().any(|r| r.metrics.watched.is_some()) {
        out.push_str(
            "\n| strategy | watched node: peak load / avg (first 30 cycles) | steady load / avg \
             | cycles to reach 95 % of avg | peak in-flight | in-flight at the end |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|\n");
        for r in &sc.results {
            if let Some(w) = &r.metrics.watched {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} |",
                    r.label(),
                    f3(w.peak_ratio),
                    f3(w.steady_ratio),
                    w.cycles_to_reach
                        .map_or("never".to_string(), |c| c.to_string()),
                    w.peak_inflight,
                    w.final_inflight,
                );
            }
        }
    }
}

/// The watched endpoint's share of the fleet's capacity, as the scenario's runs
/// measured it; 0 without one.
fn watched_fair_share(sc: &ScenarioSummary) -> f64 {
    sc.results
        .iter()
        .find_map(|r| r.metrics.watched_fair_share)
        .unwrap_or(0.0)
}

/// For scenarios with a neighbour: the node's share of the requests before the
/// neighbour came and once the weights settled after, against its fair share of the
/// capacity the neighbour leaves and against its share before.
fn neighbour_table(out: &mut String, sc: &ScenarioSummary) {
    if !sc
        .scenario
        .events
        .iter()
        .any(|e| matches!(e.kind, EventKind::Neighbour { .. }))
    {
        return;
    }
    let fair = watched_fair_share(sc);
    let _ = writeln!(
        out,
        "\nThe neighbour's host, before the neighbour (cycles {}–{}) and in the steady \
         window, against its fair share of the fleet's capacity left beside the neighbour \
         ({}):\n\n\
         | strategy | its share of the requests before | in the steady window | over its \
         fair share | over its share before | max/avg of the other nodes |",
        sc.scenario.disturbance / 2,
        sc.scenario.disturbance.saturating_sub(1),
        pct(fair),
    );
    out.push_str("|---|---:|---:|---:|---:|---:|\n");
    for r in &sc.results {
        let m = &r.metrics;
        let (before, after) = m.watched_shares.unwrap_or((f64::NAN, f64::NAN));
        let ratio = |x: f64, y: f64| {
            if y > 0.0 {
                f3(x / y)
            } else {
                "–".to_string()
            }
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.label(),
            pct(before),
            pct(after),
            ratio(after, fair),
            ratio(after, before),
            f3(m.others_max_over_avg),
        );
    }
}

/// For scenarios with a stalled node: where its requests went after the stall, how
/// the smallest nodes fared, and whether weights sat at a bound.
fn stall_table(out: &mut String, sc: &ScenarioSummary) {
    let Some(drain) = sc.scenario.events.iter().find_map(|e| match e.kind {
        EventKind::DegradeIo { share } => Some(share),
        _ => None,
    }) else {
        return;
    };
    let fair = watched_fair_share(sc);
    let _ = writeln!(
        out,
        "\nThe other nodes, steady window, and where the stalled node's requests went:\n\n\
         | strategy | max/avg without the stalled node | p95/avg without it | stalled node's \
         share of requests after the stall (balanced {}, its I/O drains {}) | smallest nodes' \
         load / avg | weights pinned at a bound (half the steady window or more) | endpoints \
         whose in-flight term binds / is distrusted, per cycle |",
        pct(fair),
        pct(fair * drain)
    );
    out.push_str("|---|---:|---:|---:|---:|---|---:|\n");
    for r in &sc.results {
        let m = &r.metrics;
        let pinned = match m.pinned {
            None => "–".to_string(),
            Some(p) if p.floor == 0 && p.ceiling == 0 => "none".to_string(),
            Some(p) => format!(
                "{} at the floor{}, {} at the ceiling",
                p.floor,
                if p.watched_at_floor {
                    " (the stalled node among them)"
                } else {
                    ""
                },
                p.ceiling
            ),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.label(),
            f3(m.others_max_over_avg),
            f3(m.others_p95_over_avg),
            m.watched_request_share.map_or("–".to_string(), pct),
            f3(m.smallest_ratio),
            pinned,
            m.inflight_verdicts
                .map_or("–".to_string(), |(b, d)| format!("{b:.1} / {d:.1}")),
        );
    }
}

fn sweep_table(out: &mut String, sw: &Sweep) {
    out.push_str(
        "| kp | ki | kd | steady max/avg | settle from equal weights | overshoot | churn / cycle \
         | step max/avg | step settle | step overshoot | newcomer peak | newcomer at 95 % after | admissible |\n",
    );
    out.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    let o = |x: Option<f64>| x.map_or("–".to_string(), pct);
    let c = |x: Option<u32>| x.map_or("never".to_string(), |v| v.to_string());
    for (i, r) in sw.rows.iter().enumerate() {
        let g = r.gains;
        let previous = (g.kp, g.ki, g.kd) == tune::PREVIOUS_DEFAULT;
        let tag = match (Some(i) == sw.chosen, Some(i) == sw.default_row) {
            (true, true) => " **chosen**, shipped default",
            (true, false) => " **chosen**",
            (false, true) => " (shipped default)",
            (false, false) if previous => " (default before the sweep)",
            _ => "",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}{} |",
            r.gains.kp,
            r.gains.ki,
            r.gains.kd,
            f3(r.steady_max_over_avg),
            c(r.steady_settle),
            o(r.steady_overshoot),
            o(r.churn),
            f3(r.step_max_over_avg),
            c(r.step_settle),
            o(r.step_overshoot),
            f3(r.cold_peak),
            c(r.cold_reach),
            if r.admissible { "yes" } else { "no" },
            tag,
        );
    }
}

/// The whole document.
pub fn markdown(s: &SimSummary) -> String {
    let mut out = String::new();
    let p = Params::default();
    let _ = writeln!(out, "# Balance quality: the fleet simulator\n");
    let _ = writeln!(
        out,
        "Generated by the simulator in `aggregator/sim/src/simulate/`; every number and chart \
         below comes from one run of\n\n```sh\n{REGENERATE}\n```\n\n(seed {}, about a minute \
         on 2 cores{}). The simulator drives the real balancing core \
         (`aggregator/balance/src/`) through its public API: reports go into \
         `Balancer::observe`, cycles run `Balancer::cycle`, and clients apply the \
         published weights only when a cycle reports a material change, as the weight \
         feeds do. Nothing of the controller is copied.\n",
        s.seed,
        if s.quick {
            "; **this copy was written in quick mode: short runs on small fleets, not the \
             published figures**"
        } else {
            ""
        }
    );

    let _ = writeln!(out, "## Headline\n");
    let tuned = s
        .sweep
        .as_ref()
        .and_then(Sweep::chosen_gains)
        .filter(|g| *g != s.gains);
    let _ = writeln!(
        out,
        "Ballast ran with the shipped default gains ({}){}.\n",
        gains(&s.gains),
        match tuned {
            Some(t) => format!(
                " and again with the gains the sweep below chose ({}), which are not yet \
                 the default",
                gains(&t)
            ),
            None => String::new(),
        }
    );
    headline::table(&mut out, s);
    let sentence = headline::sentence(s);
    if !sentence.is_empty() {
        let _ = writeln!(
            out,
            "In one sentence, as the README quotes it:\n\n<!-- figures: simulator -->\n\
             {sentence}\n<!-- figures: end -->\n"
        );
    }

    let _ = writeln!(out, "## The model\n");
    let _ = writeln!(
        out,
        "- **Time.** Ticks of 10 ms; the aggregator cycles and each agent reports every \
         {} ms, agents at random phases within the cycle, so a report describes the \
         second before it and the weights act on the second after: the signal lags by \
         about one window.\n\
         - **Endpoints.** Three hardware generations at speeds 0.6, 1.0 and 1.4, 8 cores \
         each. Requests are served by processor sharing (each gets at most one core), \
         so in-flight counts and latencies are real.\n\
         - **Agents.** As shipped unless a row says otherwise: the in-flight source counts \
         connections that owe a response and no `capacity` is configured (0), so the \
         core judges each endpoint's in-flight count against the fleet's typical value \
         rather than against an absolute number. Clients send each request on a \
         connection of its own (HTTP/1) and no proxy pools connections, so that count is \
         the number of requests in flight; the pooled-connections scenario changes \
         that. Rows that name a capacity are about a configured one (`in-flight / \
         capacity`).\n\
         - **Requests.** One Poisson stream split among clients by their rates \
         (log-normal, σ 0.5); CPU cost log-normal with mean 10 ms and σ 1.0 (coefficient \
         of variation 1.3: a heavy tail). Offered load 45 % of the fleet's CPU.\n\
         - **Clients.** 300 clients, each with a random subset of 10 of the 50 \
         endpoints: the binomial connection skew of Robinhood's footnote.\n\
         - **Agent reports.** CPU over the window since the last report plus N(0, 0.005) \
         measurement noise; in-flight as a gauge read at the moment of the report; the \
         error rate over the window. Report loss as below.\n\
         - **Ballast.** `Params::default()` except `grace_ms = 0` (the simulated \
         aggregator does not restart): cycle {} ms, staleness {} ms, skip above {:.0} % \
         missing, cold-start weight {}, growth ≤ ×{} and shrink ≥ ×{} per cycle, weights \
         within [{}, {}] × the mean, metric `max(cpu, in-flight term)` (the term \
         fleet-relative, or `in-flight / capacity` where the agents configure one), the \
         feed-forward first step on.\n\
         - **Client pickers.** Weighted round robin is earliest-deadline-first per client, \
         rebuilt with random offsets on each weight update (Envoy's and gRPC's EDF). \
         A58: `qps / (utilization + eps/qps × 1.0)` from each endpoint's own server-wide \
         report every second, 10 s blackout for new endpoints, the subset's mean weight \
         for endpoints without one. P2C: two distinct random endpoints of the subset, the \
         one with fewer of this client's requests in flight. Envoy weighted least \
         request: EDF where a pick pushes the endpoint's next deadline out by \
         `(active + 1) / weight`, with Ballast's weights.\n\
         - **Determinism.** Separate seeded streams for the fleet, the arrivals, the \
         pickers and the reports, so every strategy of a scenario sees the same fleet and \
         the same requests, and the same seed gives the same document.\n",
        p.cycle_ms,
        p.cycle_ms,
        p.stale_ms,
        p.missing_threshold * 100.0,
        p.cold_start_weight,
        p.max_growth,
        p.max_shrink,
        p.min_weight,
        p.max_weight
    );

    let _ = writeln!(out, "## How the figures are computed\n");
    let _ = writeln!(
        out,
        "*Load* is `max(cpu, mean requests in flight / {SCORE_CAPACITY})` over each \
         one-second cycle, measured without noise; it exceeds 1 only when requests queue. \
         The {SCORE_CAPACITY} is a scoring constant (four requests per core of these \
         8-core endpoints, which hold 3 to 6 at 45 % CPU), the same for every row \
         whatever the agents count or are configured with, so that rows whose agents \
         differ are scored alike. One second of one endpoint is noisy (a few hundred \
         heavy-tailed requests: ±7–10 %), so:\n\n\
         - **max/avg, p95/avg, p5/avg**: over each endpoint's *mean* load in the steady \
         window (the last part of the run), the imbalance a fleet must be sized for. \
         **CPU max/avg** is the same with CPU alone, Robinhood's metric.\n\
         - **max/avg (5 s)**: the mean over the steady window of max/avg taken on {CHART_WINDOW}-s \
         means, what a dashboard at 5 s resolution shows (and the charts). It includes \
         request noise, so no strategy reaches 1.0 on it.\n\
         - **settle** and **overshoot** follow the imbalance pattern the disturbance \
         created: with `D_i` each endpoint's deviation from its steady load ratio in the \
         first cycle after the disturbance, `a(t) = Σ D_i d_i(t) / Σ D_i²` (noise energy \
         removed from the denominator) is the share of that pattern still present. \
         *Settle* is the first cycle after which `|a|` stays within {:.0} % for {SETTLE_HOLD} \
         cycles (or within twice its noise floor where that is wider, shown as ±); \
         *overshoot* is how far `a` went below 0 in the first {OVERSHOOT_HORIZON} cycles, with \
         its noise floor (the standard deviation of `a` in the steady window): an \
         overshoot within about twice that is indistinguishable from noise. A dash means \
         the disturbance created no imbalance above one cycle's noise (round robin after \
         the step has nothing to settle; it is simply worse).\n\
         - **weight churn**: the mean over the steady window of `Σ |Δw| / Σ w` per cycle.\n\
         - **requests on nodes > 100 %**, **errors**, **p99 latency**: over all requests \
         from the disturbance on (from cycle 0 where there is none).\n",
        SETTLE_BAND * 100.0
    );

    for sc in &s.scenarios {
        let id = sc.scenario.id;
        let _ = writeln!(out, "## {}\n", sc.scenario.title);
        let _ = writeln!(
            out,
            "{} {} cycles; steady window from cycle {}.\n",
            sc.scenario.about, sc.scenario.cycles, sc.scenario.steady_from
        );
        scenario_table(&mut out, sc);
        stall_table(&mut out, sc);
        neighbour_table(&mut out, sc);
        out.push('\n');
        let n = findings::notes(id, sc);
        if !n.is_empty() {
            let _ = writeln!(out, "{n}\n");
        }
        let _ = writeln!(
            out,
            "![{} quantiles](img/balance-{id}-quantiles.svg)\n\n![{} max/avg](img/balance-{id}-max-avg.svg)\n",
            sc.scenario.title, sc.scenario.title
        );
        if watched_name(id).is_some() {
            let _ = writeln!(
                out,
                "![{} watched node](img/balance-{id}-watched.svg)\n",
                sc.scenario.title
            );
        }
        if id == "cold_join" {
            step_section(&mut out, s);
        }
    }
    if s.scenario("cold_join").is_none() {
        step_section(&mut out, s);
    }

    if let Some(sw) = &s.sweep {
        tuning(&mut out, s, sw);
    }
    findings::shortfalls(&mut out, s);
    findings::recommendations(&mut out, s);
    out
}

/// The step response against static weights, with and without feed-forward.
fn step_section(out: &mut String, s: &SimSummary) {
    if s.steps.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Step response: the feed-forward first step\n");
    let seeds = s.steps.first().map_or(0, |r| r.seeds);
    let _ = writeln!(
        out,
        "From equal weights (cycle 0 of the step and cold-join scenarios), how many cycles \
         until max/avg is within {:.0} % of what static weights proportional to each \
         node's cores × speed give (the oracle: it knows the hardware, not the connection \
         skew, so Ballast ends below it); and from the disturbance, how many until max/avg \
         is back within {:.0} % of its own level over the {} cycles before. Max/avg here is \
         that of the load the weights in force imply — each endpoint's expected request \
         rate from the clients' rates and weights, times the mean cost, over its cores × \
         speed — not of one second's measured load: one second of a few hundred \
         heavy-tailed requests per endpoint puts max/avg near 1.25 even at perfect \
         weights, as much as the whole gap between equal weights' skew and the oracle's. \
         Each curve is the mean of {seeds} seeds; a cycle counts once max/avg stays within \
         the band for {} cycles. Cycle *n* is served under the weights of the update at \
         the end of cycle *n − 1*; cycle 0 is served at equal weights, so 1 is the \
         fastest possible. Without feed-forward is `Params {{ feed_forward: false, .. }}`. \
         Ballast runs with the shipped agents (capacity 0: in-flight judged against the \
         fleet) and with agents configured with capacity {} (`in-flight / {}`, which \
         never binds on a healthy node here), to show the feed-forward step on CPU alone.\n",
        step::WITHIN * 100.0,
        step::WITHIN * 100.0,
        step::LEVEL_WINDOW,
        step::HOLD,
        step::CPU_BOUND_AGENT.capacity,
        step::CPU_BOUND_AGENT.capacity,
    );
    out.push_str(
        "| scenario | strategy | cycles to within 5 % of static weights | max/avg in cycles \
         0–5 | level before the disturbance | cycles back to it after | feed-forward steps \
         per run | endpoints with the in-flight term binding, per cycle |\n",
    );
    out.push_str("|---|---|---:|---|---:|---:|---:|---:|\n");
    let c = |x: Option<u32>| x.map_or("never".to_string(), |v| v.to_string());
    for r in &s.steps {
        for a in &r.arms {
            let first = a
                .curve
                .iter()
                .take(6)
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" ");
            let ballast = a.kind.uses_ballast();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.title,
                a.label(),
                if ballast {
                    c(a.to_oracle)
                } else {
                    format!("({} itself)", f3(r.oracle_before))
                },
                first,
                f3(a.level),
                c(a.recovery),
                if ballast {
                    format!("{:.1}", a.feed_forward_steps)
                } else {
                    "–".to_string()
                },
                if ballast {
                    format!("{:.1}", a.inflight_binding)
                } else {
                    "–".to_string()
                },
            );
        }
    }
    out.push('\n');
    let note = findings::step_notes(s);
    if !note.is_empty() {
        let _ = writeln!(out, "{note}\n");
    }
    for r in &s.steps {
        let _ = writeln!(
            out,
            "![{} step response](img/balance-{}-step-response.svg)\n",
            r.title, r.scenario
        );
    }
}

fn tuning(out: &mut String, s: &SimSummary, sw: &Sweep) {
    let _ = writeln!(out, "## Tuning the PID gains\n");
    let _ = writeln!(
        out,
        "`simulate::tune::sweep` runs Ballast alone on the steady fleet (from equal \
         weights), the +50 % step and the cold join, each cut to 100 cycles with the \
         disturbance at cycle 40, for every kp ∈ {:?} with (ki, kd) ∈ {:?}, then the \
         integral probes (kp, ki, kd) ∈ {:?}, the defaults before the sweep {:?} and \
         the shipped default (the derivative filter and integral limit stay at their \
         defaults), each over {} seeds whose \
         transient curves are averaged before settling, overshoot and the newcomer's \
         peak are read. A point is admissible if it meets the dynamic targets \
         (overshoot ≤ 5 % from equal weights and after the step, the step settled within \
         10 cycles, the newcomer never above 1.1×). Among admissible points the one with \
         the most margin to those limits wins (`tune::margin`: the largest of overshoot \
         / 5 %, settling / 10 cycles and the newcomer's excess / 0.1, smallest first), \
         ties within 0.02 going to lower churn. Steady-state max/avg does not decide: \
         every admissible point is at about 1.01 on these shortened runs, and the \
         differences are below the noise.\n",
        tune::KP,
        tune::KI_KD,
        tune::INTEGRAL_PROBES,
        tune::PREVIOUS_DEFAULT,
        sw.seeds
    );
    sweep_table(out, sw);
    out.push('\n');
    match sw.chosen_gains() {
        Some(g) if g == s.gains => {
            let _ = writeln!(
                out,
                "The sweep chose the shipped defaults ({}).\n",
                gains(&g)
            );
        }
        Some(g) => {
            let _ = writeln!(
                out,
                "**The sweep chose {}; the shipped defaults are {}.** Until the defaults in \
                 `aggregator/balance/src/params.rs` change, the scenario tables show both \
                 (rows marked \"sweep's gains\").\n",
                gains(&g),
                gains(&s.gains)
            );
        }
        None => {
            let _ = writeln!(
                out,
                "**No point met every dynamic target**; the defaults stay as shipped ({}).\n",
                gains(&s.gains)
            );
        }
    }
    let with_i: Vec<f64> = sw
        .rows
        .iter()
        .filter(|r| r.gains.ki > 0.0)
        .flat_map(|r| [r.steady_overshoot, r.step_overshoot])
        .flatten()
        .collect();
    let lo = with_i.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = with_i.iter().copied().fold(0.0f64, f64::max);
    let _ = writeln!(
        out,
        "Why these gains. The controller is in velocity form: its output is the *change* \
         of the weight, so the proportional term already integrates — an endpoint above \
         the average keeps losing weight until it is at the average. An integral term on \
         top is a second integrator: the rows with ki > 0 overshoot by {} to {}, because \
         the integral keeps pushing after the error is gone. The report lags the weights \
         by about one cycle, so to a first approximation the imbalance follows \
         `x(t+1) = x(t) − kp · x(t−1)`, critically damped at kp = 0.25 and ringing more \
         as kp grows. Low kp settles slowly after the step and ramps a newcomer in 20 \
         cycles; high kp overshoots the step. The derivative term changes little either \
         way, since the reports are noisy. Churn grows with kp: each cycle's noise moves \
         the weights by about kp × the noise. Neighbouring admissible points are within \
         the noise of each other; what the sweep establishes firmly is ki = 0 and kp \
         near {}, not the second decimal.\n",
        pct(lo),
        pct(hi),
        sw.chosen_gains()
            .map_or("the chosen value".to_string(), |g| g.kp.to_string())
    );
}
