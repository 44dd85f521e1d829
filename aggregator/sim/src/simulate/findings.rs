//! The prose of `docs/balance.md` that depends on the numbers: what each scenario
//! shows, where Ballast falls short, and what the balancing core should change.

use super::metrics::Metrics;
use super::report::{f3, gains, pct};
use super::scenario::EventKind;
use super::step;
use super::strategy::{AgentConfig, StrategyKind};
use super::tune::Sweep;
use super::{ScenarioSummary, SimSummary};
use ballast_balance::cpu_floor;
use std::fmt::Write as _;

/// What a scenario's table shows and why, with its numbers.
pub fn notes(id: &str, sc: &ScenarioSummary) -> String {
    use StrategyKind::*;
    let g = |k| sc.get(k).map_or(f64::NAN, |m: &Metrics| m.max_over_avg);
    match id {
        "steady" => format!(
            "Round robin ({}) carries two imbalances at once: hardware (a 0.6-speed node does \
             1.7× the work per request of a 1.0) and connection skew (each endpoint is in a \
             binomially distributed number of client subsets, and client rates differ). \
             A58 ({}) removes the first, since `qps / utilization` measures each node's \
             speed, but not the second: every client weighs only its own subset, and no \
             client knows how many others share an endpoint. P2C ({}) sees only its own \
             in-flight requests, a fraction of one per endpoint at these rates, so it is \
             nearly random. Ballast ({}) closes the loop on each endpoint's total load, \
             which includes every client's share. The average load is lower under the \
             weighted strategies than under round robin for the same requests: more of \
             them go to fast hardware, which spends less core time on each.",
            f3(g(RoundRobin)),
            f3(g(A58)),
            f3(g(P2c)),
            f3(g(Ballast)),
        ),
        "step" => "The step brings new subsets, so new skew. Round robin, A58 and P2C have \
             nothing to settle (their ratios jump to a new, worse level at once and stay). \
             The overload column is where the step hurts: the hottest round-robin and A58 \
             nodes go past 100 %."
            .to_string(),
        "cold_join" => "The newcomer starts at the cold-start weight (0.1 of the mean) and \
             the controller ramps it multiplicatively (at most ×1.5 per cycle). A58 gives \
             it the mean weight of each subset during its 10 s blackout and then \
             `qps / utilization`, which leaves it under-loaded by the connection skew of \
             its few subsets; round robin and P2C leave it where its subset count puts it."
            .to_string(),
        "degraded_io" => degraded_io(sc),
        "pooled_http2" => pooled_http2(sc),
        "fail_fast" => "A node that fails at once looks idle: low CPU, nothing in flight. \
             P2C prefers it (its in-flight count is always 0), round robin gives it its \
             share. A58's `eps/qps × penalty` halves its weight. Ballast adds the reported \
             error rate to its load (`error_rate × error_penalty`), so its load stays \
             above the average whatever its traffic and its weight goes to the floor \
             (0.01 of the mean)."
            .to_string(),
        "loss_10" | "loss_20" => "Lost reports come in bursts (Gilbert–Elliott, 5 s mean): an \
             endpoint is missing after 3 s of silence. A missing endpoint keeps its weight; \
             when more than 15 % are missing the whole cycle is skipped (the skipped column). \
             A58 and the others do not depend on agent reports."
            .to_string(),
        "small_loss" => "In a service this small one silent endpoint is 25 % of it, above \
             the 15 % at which a cycle is skipped for missing endpoints; if that alone \
             skipped, every lost report would freeze the other three. A cycle is skipped \
             for missing endpoints only when at least two are (the skipped column counts \
             those), and the silent one keeps its weight meanwhile."
            .to_string(),
        "low_traffic" => "At about 1 % CPU the average load is below `thin_load` (0.02), so \
             Ballast holds its weights and says so (`thin_feedback` skips) instead of \
             chasing noise: no oscillation, no churn. The cycle whose reports straddle the \
             50× drop (some taken before it, some after) is skipped too (`load_jump`: \
             the average moved more than 30 % since the last cycle), so the weights held \
             are the ones earned before the drop. Without that rule the straddling cycle \
             moved every weight by its growth or shrink limit on a mere difference in \
             report phase, and those weights were then held (max/avg 1.369 in an earlier \
             run of this seed). Every strategy's max/avg here is mostly request noise: 7 \
             requests per endpoint per second."
            .to_string(),
        "fleet_1000" => "At 1,000 endpoints with about 90 requests per endpoint per \
             second each report is noisy (±15 % per second), which shows in the churn and \
             the 5 s ratio; the steady-state mean is still balanced. The round-robin \
             max/avg is one node whose offered load is above its capacity: its queue grows \
             for the whole run."
            .to_string(),
        "neighbour" => neighbour(sc),
        "niced_neighbour" => niced_neighbour(sc),
        _ => String::new(),
    }
}

/// The neighbour's host's share in the steady window over its fair share of the
/// capacity left, and over its share before the neighbour, under `kind`.
fn neighbour_shares(sc: &ScenarioSummary, kind: StrategyKind) -> Option<(f64, f64)> {
    let m = sc.get(kind)?;
    let (before, after) = m.watched_shares?;
    let fair = m.watched_fair_share.filter(|f| *f > 0.0)?;
    (before > 0.0).then(|| (after / fair, after / before))
}

fn neighbour(sc: &ScenarioSummary) -> String {
    use StrategyKind::*;
    let fair = |k| neighbour_shares(sc, k).map_or(f64::NAN, |s| s.0);
    // The spread leaves the neighbour's host out: a round-robin ratio this far above
    // the steady fleet's is a queue that grows for the whole run.
    let runaway = sc
        .get(RoundRobin)
        .filter(|m| m.max_over_avg > 3.0)
        .map_or(String::new(), |m| {
            format!(
                " Round robin's max/avg ({}) is another node whose offered load, in this \
                 draw of subsets, is above its capacity: its queue grows for the whole run \
                 (the overloaded column).",
                f3(m.max_over_avg)
            )
        });
    format!(
        "The agent reads the host's CPU, the neighbour's included. The controller cuts \
         the node's weight and the reading does not follow it down: once the weight has \
         fallen {}× with the reading above {} of its level for {} reports, the core \
         takes the part that stayed as a floor (`cpu_floor` in the balancing core) and \
         steers the node by its CPU above the floor, over what the floor leaves. The \
         node keeps {} of its fair share of the capacity left, and the rest of the fleet \
         stays balanced (max/avg {}). A floor is kept for {} reports and then found again, \
         which costs the node a few cycles at a smaller weight each time; this run ends \
         before the first. A58's `qps / utilization` counts the neighbour's CPU ({} of the fair \
         share). P2C sees only the requests' latency, which the neighbour leaves alone \
         until the node's own requests fill the cores it leaves, and sends the node about \
         its old share ({} of the fair share): more than the capacity left. In the \
         physical lab the greedy neighbour is a loop in a \
         backend's quota'd cgroup, which fills whatever the service leaves: the reading \
         stays at the quota whatever the weight, no capacity shows beside it, and the \
         backend is steered down (`docs/lab.md`).{}",
        cpu_floor::FLOOR_DROP,
        cpu_floor::FLOOR_KEEP,
        cpu_floor::FLOOR_CYCLES,
        f3(fair(Ballast)),
        f3(sc.get(Ballast).map_or(f64::NAN, |m| m.others_max_over_avg)),
        cpu_floor::FLOOR_TTL,
        f3(fair(A58)),
        f3(fair(P2c)),
        runaway,
    )
}

fn niced_neighbour(sc: &ScenarioSummary) -> String {
    use StrategyKind::*;
    let before = |k| neighbour_shares(sc, k).map_or(f64::NAN, |s| s.1);
    format!(
        "The scheduler gives a niced neighbour only what the service leaves, and the \
         agent leaves its time out of the CPU it reports, so nothing the balancers read \
         changes: Ballast keeps {} of the node's share before the neighbour, P2C {}. \
         (In a cgroup whose CPU quota binds, a niced loop on another core spends the \
         quota as fast as any, and the agent counts its time while the quota throttles \
         the cgroup: the physical lab measures that case, `docs/lab.md`.)",
        f3(before(Ballast)),
        f3(before(P2c)),
    )
}

/// Where Ballast falls short, with the numbers of the run.
pub fn shortfalls(out: &mut String, s: &SimSummary) {
    use StrategyKind::*;
    let _ = writeln!(out, "## Where Ballast falls short, and why\n");
    let mut any = false;
    for sc in &s.scenarios {
        let Some(b) = sc.get(Ballast) else { continue };
        for k in [A58, P2c] {
            if let Some(o) = sc.get(k) {
                if b.max_over_avg > o.max_over_avg {
                    any = true;
                    let _ = writeln!(
                        out,
                        "- **{}**: Ballast's max/avg {} is worse than {}'s {}.",
                        sc.scenario.title,
                        f3(b.max_over_avg),
                        k.label(),
                        f3(o.max_over_avg)
                    );
                }
            }
        }
    }
    if !any {
        let _ = writeln!(
            out,
            "- On steady-state max/avg Ballast (shipped gains) is at least as good as A58 \
             and P2C in every scenario of this run."
        );
    }
    let stale = s.experiments.iter().find(|e| e.name == "stale_reports");
    for id in ["loss_10", "loss_20"] {
        if let (Some(sc), Some(steady)) = (s.scenario(id), s.scenario("steady")) {
            let pick = |x: &ScenarioSummary| x.tuned(Ballast).or(x.get(Ballast)).cloned();
            if let (Some(b), Some(b0)) = (pick(sc), pick(steady)) {
                if b.max_over_avg > b0.max_over_avg + 0.01 {
                    let evidence = match stale {
                        Some(e) if e.scenario == id => format!(
                            " Over {} seeds the experiment below takes this scenario from {} \
                             to {} by holding such endpoints instead.",
                            e.base.max_over_avg.len(),
                            f3(e.base.mean()),
                            f3(e.variant.mean())
                        ),
                        _ => String::new(),
                    };
                    let _ = writeln!(
                        out,
                        "- **{}**: max/avg {} against {} without loss{}. An endpoint whose \
                         report is lost holds its weight until the next one arrives, and \
                         one silent for many seconds keeps whatever weight it had, noise \
                         included: nothing can correct it without reports.{} Cycles \
                         skipped by the 15 % rule change nothing, which is their purpose.",
                        sc.scenario.title,
                        f3(b.max_over_avg),
                        f3(b0.max_over_avg),
                        if sc.tuned(Ballast).is_some() {
                            " (sweep's gains)"
                        } else {
                            ""
                        },
                        evidence
                    );
                }
            }
        }
    }
    if let Some((fair, _)) = s
        .scenario("neighbour")
        .and_then(|sc| neighbour_shares(sc, Ballast))
        .filter(|(fair, _)| *fair < 0.75)
    {
        let _ = writeln!(
            out,
            "- **A CPU-bound neighbour**: the node it shares keeps {} of its fair share of \
             the capacity left: the floor the neighbour puts under the agent's CPU was not \
             found or not set aside (see the scenario above).",
            f3(fair)
        );
    }
    let _ = writeln!(
        out,
        "- **Noise floor.** With a few hundred heavy-tailed requests per endpoint per \
         second, one report is ±7–10 % noise and the controller passes about kp × that \
         into the weights every cycle (the churn column). Steady-state means average it \
         out; the 5 s view does not, and nothing that steers by one-second reports can \
         get the 5 s max/avg much below 1.05 on this fleet.\n\
         - **What the model leaves out.** Endpoint speed does not drift, requests do not \
         retry, the network adds no latency, the weight feed delivers at once, and \
         clients do not come and go (except in the step). The dead spiral is modelled as \
         an I/O stage of fixed throughput, not as a real disk.\n"
    );
}

/// Changes to the balancing core that the run supports, with their evidence.
pub fn recommendations(out: &mut String, s: &SimSummary) {
    let _ = writeln!(out, "## Recommended changes to the balancing core\n");
    let mut n = 0;
    if let Some(g) = s
        .sweep
        .as_ref()
        .and_then(Sweep::chosen_gains)
        .filter(|g| *g != s.gains)
    {
        n += 1;
        let _ = writeln!(
            out,
            "{n}. **Default gains {}** instead of {} (`PidGains::default()` in \
             `balance/params.rs`), from the sweep above: the integral term is what makes \
             the shipped defaults overshoot by 20–40 %.",
            gains(&g),
            gains(&s.gains)
        );
    }
    for e in &s.experiments {
        if e.name == "stale_reports" {
            n += 1;
            let _ = writeln!(
                out,
                "{n}. **Run the controller only for endpoints with a report newer than their \
                 last update**; hold the others' weights as for missing ones (in \
                 `Service::update_pid`, treat `last_report <= last_update` like a stale \
                 endpoint). Today an endpoint that missed a report or two is still fresh \
                 under the 3 s bound, and each cycle applies its last error again. \
                 Evidence, {} over {} seeds: mean max/avg {} as shipped ({}), {} with the \
                 {} ({}). That variant is only an approximation: it also makes more cycles \
                 skip under the 15 % rule (a mean of {:.0} against {:.0} per run), which \
                 the change itself would not. With independent single losses the effect \
                 is small; it grows with the length of the loss bursts.",
                e.scenario,
                e.base.max_over_avg.len(),
                f3(e.base.mean()),
                e.base
                    .max_over_avg
                    .iter()
                    .map(|x| f3(*x))
                    .collect::<Vec<_>>()
                    .join(", "),
                f3(e.variant.mean()),
                e.change,
                e.variant
                    .max_over_avg
                    .iter()
                    .map(|x| f3(*x))
                    .collect::<Vec<_>>()
                    .join(", "),
                e.variant.mean_skipped(),
                e.base.mean_skipped(),
            );
        }
    }
    let steady_binding = s
        .scenario("steady")
        .and_then(|sc| sc.get(StrategyKind::Ballast))
        .and_then(|m| m.inflight_verdicts)
        .map_or(0.0, |v| v.0);
    let blocked: Vec<&step::StepResponse> = s
        .steps
        .iter()
        .filter(|r| r.shipped(true).is_some_and(|a| a.feed_forward_steps < 0.5))
        .collect();
    if steady_binding > 0.1 || !blocked.is_empty() {
        n += 1;
        let _ = writeln!(
            out,
            "{n}. **Keep the fleet-relative in-flight term from binding on healthy nodes.** \
             On the steady fleet, where no node is stalled, it set the load of {:.1} of {} \
             endpoints per cycle on average in the steady window: the count is a gauge read \
             at one instant, 3 to 6 requests here, so its noise alone makes a node with a \
             light CPU load stand out by 2× now and then. Each such cycle moves that node's \
             weight on noise, and as long as one endpoint binds the feed-forward step does \
             not fire{}.",
            steady_binding,
            s.scenario("steady")
                .map_or(0, |sc| sc.scenario.fleet.endpoints),
            if blocked.is_empty() {
                String::new()
            } else {
                format!(
                    " (with the shipped agents it fired {} per run)",
                    blocked
                        .iter()
                        .map(|r| format!(
                            "{:.1} times in {}",
                            r.shipped(true).map_or(0.0, |a| a.feed_forward_steps),
                            r.title
                        ))
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            }
        );
    }
    let slower: Vec<String> = s
        .steps
        .iter()
        .filter_map(|r| {
            let arm = |f: bool| {
                r.arms.iter().find(|a| {
                    a.kind == StrategyKind::BallastAgent(step::CPU_BOUND_AGENT)
                        && a.feed_forward == f
                })
            };
            let (w, wo) = (arm(true)?, arm(false)?);
            (w.feed_forward_steps > 0.5 && w.to_oracle > wo.to_oracle).then(|| {
                format!(
                    "{}: {} cycles to the band with it, {} without",
                    r.title,
                    w.to_oracle.map_or("never".to_string(), |c| c.to_string()),
                    wo.to_oracle.map_or("never".to_string(), |c| c.to_string())
                )
            })
        })
        .collect();
    if !slower.is_empty() {
        n += 1;
        let _ = writeln!(
            out,
            "{n}. **Estimate capacities for the feed-forward step with the clients' subsets \
             in mind.** Where it fires (capacity-{} agents) it is slower than the \
             controllers alone ({}). An endpoint's traffic is proportional to its weight \
             only when every client sees every endpoint: with subsets it is \
             `Σ rate_c × w_i / Σ_{{j ∈ subset_c}} w_j`, so stepping a lightly loaded \
             endpoint up by `avg / load` while its subset-mates step down sends it far more \
             than its share. The core puts such a step back at the first update after \
             its settling cycles (it closed less than half of the excess) and takes no \
             more steps for the service, which costs those cycles once.",
            step::CPU_BOUND_AGENT.capacity,
            slower.join("; ")
        );
    }
    if n == 0 {
        let _ = writeln!(out, "None from this run.");
    }
    out.push('\n');
}

/// The stalled node's figures under `kind`: share of the requests after the stall,
/// steady load over the average, peak and final in-flight.
fn stall(sc: &ScenarioSummary, kind: StrategyKind) -> String {
    match sc.get(kind) {
        Some(m) => format!(
            "{} of the requests after the stall, {} in flight at most and {} at the end",
            m.watched_request_share.map_or("–".to_string(), pct),
            m.watched.as_ref().map_or(0, |w| w.peak_inflight),
            m.watched.as_ref().map_or(0, |w| w.final_inflight),
        ),
        None => "–".to_string(),
    }
}

fn degraded_io(sc: &ScenarioSummary) -> String {
    use StrategyKind::*;
    let cap32 = BallastAgent(AgentConfig {
        capacity: 32,
        ..AgentConfig::SHIPPED
    });
    let fair = sc
        .results
        .iter()
        .find_map(|r| r.metrics.watched_fair_share)
        .unwrap_or(0.0);
    let drain = sc
        .scenario
        .events
        .iter()
        .find_map(|e| match e.kind {
            EventKind::DegradeIo { share } => Some(share),
            _ => None,
        })
        .unwrap_or(0.0);
    format!(
        "CPU alone cannot tell a node stuck on I/O from an idle one: its CPU falls, the \
         controller raises its weight, more requests queue behind the I/O stage, CPU stays \
         low. That is Robinhood's dead spiral, and the CPU-only row shows it ({}): its \
         weight climbs to the 10× ceiling and its in-flight count grows without bound. \
         Round robin and A58 send the node its full share whatever happens (A58's \
         `qps / utilization` still reads as a healthy node of its speed), so its queue \
         grows without bound too. P2C is bounded by its clients' own in-flight counts. \
         The max/avg column is dominated by the queue; the CPU max/avg column is blind \
         to it.\n\n\
         With the shipped agents (no capacity) the core compares each endpoint's smoothed \
         in-flight count per unit of weight, and per unit of CPU, with the fleet's typical \
         values and judges a node stalled once both stand out by more than 3× while its \
         hands idle (its CPU below a quarter of the fleet's average, or its count per \
         unit of CPU nine times the typical one): the stalled node holds its requests \
         many times longer than a healthy \
         one, so its weight falls at the shrink bound and is held down until its count \
         could have shown otherwise ({}). It settles where its count keeps it; {} With \
         a configured capacity of 32 the \
         term is `in-flight / 32`, an absolute override ({}): the node is held where its \
         queue is as loaded as an average node, in a sawtooth — the queue builds whenever \
         the weight creeps above what the I/O drains, the controller sees it a cycle \
         later and cuts the weight, the queue drains and the weight climbs again; the \
         peak in-flight column is the height of those teeth.",
        stall(sc, BallastCpuOnly),
        stall(sc, Ballast),
        versus_drain(sc.get(Ballast), fair, drain),
        stall(sc, cap32),
    )
}

/// How the stalled node's share of requests compares with what its I/O stage drains.
fn versus_drain(m: Option<&Metrics>, fair: f64, drain: f64) -> String {
    let can = fair * drain;
    match m.and_then(|m| m.watched_request_share) {
        Some(x) if x < 0.9 * can => format!(
            "for this node that is below what its I/O stage drains: it gets less than the \
             {} of the requests its I/O could complete (a fair share would be {}) — a \
             little too careful, never flooded.",
            pct(can),
            pct(fair)
        ),
        Some(x) if x > 1.1 * can => format!(
            "for this node that is more than its I/O stage drains ({} of the requests; a \
             fair share would be {}), so its queue builds between cuts.",
            pct(can),
            pct(fair)
        ),
        Some(_) => format!(
            "for this node that is about what its I/O stage drains ({} of the requests; a \
             fair share would be {}).",
            pct(can),
            pct(fair)
        ),
        None => String::new(),
    }
}

fn pooled_http2(sc: &ScenarioSummary) -> String {
    use StrategyKind::*;
    let tuned = AgentConfig {
        capacity: 32,
        ..AgentConfig::OLD_DEFAULT
    };
    let fig = |a: AgentConfig| {
        sc.get(BallastAgent(a)).map_or("–".to_string(), |m| {
            format!(
                "max/avg {} without the stalled node, p5/avg {}, the in-flight term \
                 binding on {:.0} endpoints per cycle",
                f3(m.others_max_over_avg),
                f3(m.p5_over_avg),
                m.inflight_verdicts.map_or(0.0, |v| v.0)
            )
        })
    };
    let clients = sc.scenario.fleet.clients as f64 * sc.scenario.fleet.http2_share;
    let per_endpoint =
        clients * sc.scenario.fleet.subset as f64 / sc.scenario.fleet.endpoints.max(1) as f64;
    format!(
        "An established-connection count carries no load information here: each endpoint \
         has {} idle pooled connections and one per HTTP/2 client that has it in its \
         subset (about {:.0} on average, spread binomially from endpoint to endpoint), \
         whatever traffic it gets. With the old default's capacity of 100 that alone is \
         a load of about {:.2}, above the CPU of most nodes, so the in-flight term sets \
         the load and steers by subscription counts ({}). With a capacity tuned to the \
         fleet's request concurrency (32) the idle connections read as about {:.1} on \
         every node and the term sets every load ({}). Either way the stalled node's \
         HTTP/2 requests add nothing to the count, since their connections were counted \
         already. Counting connections that owe a response (an idle pooled connection 0, \
         an HTTP/2 connection 1 while a stream is outstanding) with no capacity gives \
         {}; the stalled node: {}.",
        sc.scenario.fleet.pooled,
        per_endpoint,
        (f64::from(sc.scenario.fleet.pooled) + per_endpoint) / 100.0,
        fig(AgentConfig::OLD_DEFAULT),
        (f64::from(sc.scenario.fleet.pooled) + per_endpoint) / 32.0,
        fig(tuned),
        fig(AgentConfig::SHIPPED),
        stall(sc, BallastAgent(AgentConfig::SHIPPED)),
    )
}

/// What the step-response table shows, with its numbers.
pub fn step_notes(s: &SimSummary) -> String {
    let mut out = String::new();
    for r in &s.steps {
        let (Some(ff), Some(no)) = (r.shipped(true), r.shipped(false)) else {
            continue;
        };
        let cpu = |f: bool| {
            r.arms.iter().find(|a| {
                a.kind == StrategyKind::BallastAgent(step::CPU_BOUND_AGENT) && a.feed_forward == f
            })
        };
        let c = |x: Option<u32>| x.map_or("never".to_string(), |v| v.to_string());
        let _ = write!(
            out,
            "- **{}**: with the shipped agents feed-forward took {:.1} steps per run (cycles \
             to the band: {} with it, {} without); the in-flight term bound on {:.1} \
             endpoints per cycle before the disturbance, and a step needs no endpoint to \
             stand out by its fleet-relative term.",
            r.title,
            ff.feed_forward_steps,
            c(ff.to_oracle),
            c(no.to_oracle),
            ff.inflight_binding,
        );
        if let (Some(cf), Some(cn)) = (cpu(true), cpu(false)) {
            let worst = |a: &step::Arm| {
                a.curve
                    .iter()
                    .skip(1)
                    .take(3)
                    .fold(0.0f64, |m, x| m.max(*x))
            };
            let _ = write!(
                out,
                " With capacity-{} agents it took {:.1} steps per run: cycles to the band {} \
                 with it, {} without, the highest max/avg in cycles 1–3 {} against {}.",
                step::CPU_BOUND_AGENT.capacity,
                cf.feed_forward_steps,
                c(cf.to_oracle),
                c(cn.to_oracle),
                f3(worst(cf)),
                f3(worst(cn)),
            );
        }
        out.push('\n');
    }
    out
}
