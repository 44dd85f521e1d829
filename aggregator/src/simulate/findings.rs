//! The prose of `docs/balance.md` that depends on the numbers: what each scenario
//! shows, where Ballast falls short, and what the balancing core should change.

use super::metrics::Metrics;
use super::report::{f3, gains};
use super::strategy::StrategyKind;
use super::tune::Sweep;
use super::{ScenarioSummary, SimSummary};
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
        "degraded_io" => "CPU alone cannot tell a node stuck on I/O from an idle one: its \
             CPU falls, the controller raises its weight, more requests queue behind the \
             I/O stage, CPU stays low. That is Robinhood's dead spiral, and the \
             CPU-only row shows it — its weight climbs to the 10× ceiling and its in-flight \
             count grows without bound. With `max(cpu, in-flight / capacity)` the queue \
             itself is load, and the weight falls until the queue is as loaded as the \
             average node. Round robin and A58 send the node its full share whatever \
             happens (A58's `qps / utilization` still reads as a healthy node of its \
             speed), so its queue grows without bound too. P2C is bounded by its clients' \
             own in-flight counts. The max/avg column is dominated by the queue (in-flight \
             / capacity); the CPU max/avg column is blind to it.\n\n\
             Bounded is not steady. With the max metric the node settles into a sawtooth \
             (the spikes in the max/avg chart): its queue builds whenever its weight \
             creeps above what the I/O stage drains, the controller sees that only once \
             the queue is as loaded as an average node, a cycle later, and cuts the \
             weight; the queue drains, the node looks light, and its weight climbs again. \
             The peak in-flight column is the height of those teeth. The in-flight gauge \
             is read at one instant per report, which makes the teeth irregular. A \
             queue-aware term (for example in-flight growth between reports) would damp \
             it; this simulator does not try one."
            .to_string(),
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
        _ => String::new(),
    }
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
    if n == 0 {
        let _ = writeln!(out, "None from this run.");
    }
    out.push('\n');
}
