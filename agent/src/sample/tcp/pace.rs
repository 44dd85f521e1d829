//! When the TCP in-flight source counts afresh, and when a report repeats its last count.
//!
//! A count is a sock_diag dump, and the kernel walks its whole established hash for it,
//! visiting every socket in it (TIME_WAIT ones included) from cold caches: under a
//! millisecond of CPU on a quiet host, 3–4 ms on one holding 20,000 unrelated sockets.
//! At one count a second that walk is most of what the agent costs
//! (`docs/footprint.md`).
//!
//! The count is worth that only while it can change the node's load, which is
//! `max(CPU, in-flight term)`. A report counts afresh when any of these holds ([`Why`]),
//! and otherwise repeats the last count:
//!
//! - there is no count yet, or the last one failed;
//! - the last count is due: as old as its own cost allows within a budget of
//!   0.02 % of a core ([`PER_BUDGET`]) (a count that cost 0.4 ms is due after 2 s, one that cost 4 ms
//!   after 20 s), and never older than [`MAX_AGE`]. This bounds how late a pile-up that
//!   shows nowhere else is seen;
//! - there is no CPU figure this report (no CPU source, or its first report): the count
//!   is then the whole load;
//! - the in-flight term binds or is close to it: with a capacity, the last count is at
//!   least half the CPU in its units; without one, the aggregator steers the node by a
//!   load above every CPU the node reported lately (it alone can judge a count against
//!   the fleet), or it has set the count aside and is watching whether it follows the
//!   weight again, which it can only judge on fresh counts;
//! - the last count was raised: above twice the node's usual count (an average of its
//!   earlier counts) plus one, so it may be rising; counting goes on every report until
//!   the usual count has caught up or the count falls back;
//! - the CPU fell ([`cpu_fell`]) to half or less, by at least 0.05 of the resource, both
//!   from its usual level (an average over the last reports) and since the last count.
//!   A node that stalls on I/O goes quiet on CPU while its requests pile up, which is
//!   the case the in-flight count is for; this catches it at the first report. The
//!   usual level keeps the swings of a shared host from counting; the last count's
//!   level makes one fall count once, not at every report while the average catches
//!   up. A rising CPU raises the load by itself.
//!
//! Sans-IO: the time, the CPU and a count's cost come in as arguments.

use std::time::{Duration, Instant};

/// The share of one core a count may cost when nothing says it matters, as its inverse:
/// a count is due after this many times its own CPU time (0.02 % of a core).
pub(crate) const PER_BUDGET: u32 = 5000;
/// The shortest a count is repeated for, whatever it cost.
pub(crate) const MIN_AGE: Duration = Duration::from_secs(1);
/// The longest a count is repeated for, whatever it cost.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(30);
/// The CPU fell when it is at most this fraction of its usual level ...
const CPU_FALL_FACTOR: f64 = 0.5;
/// ... and at least this much below it, in units of the whole resource.
const CPU_FALL_MIN: f64 = 0.05;
/// The share of each report's CPU in the usual CPU (an exponential average).
const USUAL_CPU_ALPHA: f64 = 0.2;
/// How many recent CPU figures the aggregator's load is compared with.
const RECENT_CPUS: usize = 4;
/// The share of each fresh count in the node's usual count (an exponential average).
const USUAL_ALPHA: f64 = 0.1;
/// A count above `RAISED_FACTOR × usual + RAISED_MARGIN` is raised.
const RAISED_FACTOR: f64 = 2.0;
const RAISED_MARGIN: f64 = 1.0;
/// With a capacity, the in-flight term is close to binding from this fraction of the
/// CPU on.
const NEAR_BINDING: f64 = 0.5;
/// Without a capacity, the aggregator's load binds on the count when it exceeds the
/// recent CPU figures by this factor and margin (an error penalty also adds to it).
const STEERED_FACTOR: f64 = 1.1;
const STEERED_MARGIN: f64 = 0.02;

/// What the report in progress knows besides the count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Context {
    /// This report's CPU utilization; `None` without a CPU source, or before it has a
    /// delta.
    pub(crate) cpu: Option<f64>,
    /// The in-flight count that means fully loaded; 0 when the aggregator judges it.
    pub(crate) capacity: u32,
    /// The load the aggregator last said it steers the node by, if it said, and
    /// whether it trusts the node's count.
    pub(crate) steered: Option<(f64, bool)>,
}

/// Why a report counts afresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// No count yet, or the last one failed.
    First,
    /// The last count is due (its cost's budget, or [`MAX_AGE`]).
    Due,
    /// No CPU figure: the count is the whole load.
    NoCpu,
    /// The in-flight term binds or is close to it, or the aggregator distrusts it.
    Binding,
    /// The last count was above the node's usual one.
    Raised,
    /// The CPU fell well below its usual level.
    CpuFell,
}

/// What a report does about the in-flight count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decision {
    /// Count afresh.
    Count(Why),
    /// Repeat the last count, taken this long ago.
    Repeat(Duration),
}

/// The last fresh count.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Last {
    at: Instant,
    owed: u32,
    /// How long it may be repeated for.
    lasts: Duration,
    /// The CPU of the report that counted it.
    cpu: Option<f64>,
    /// Whether it was above the usual count before it.
    raised: bool,
}

/// Decides, report by report, whether to count (see the module documentation).
#[derive(Debug, Clone, Default)]
pub(crate) struct Pacer {
    last: Option<Last>,
    /// The node's usual count: an exponential average of fresh counts.
    usual: Option<f64>,
    /// The node's usual CPU: an exponential average over reports.
    usual_cpu: Option<f64>,
    /// The last reports' CPU figures, newest first.
    recent_cpu: Vec<f64>,
}

/// Whether the CPU fell from its usual level `usual` to `now`: to
/// `CPU_FALL_FACTOR` of it or less, and by `CPU_FALL_MIN` of the resource or more.
pub(crate) fn cpu_fell(usual: f64, now: f64) -> bool {
    now <= CPU_FALL_FACTOR * usual && usual - now >= CPU_FALL_MIN
}

/// How long a count that cost `cost` of CPU may be repeated for.
pub(crate) fn lasts(cost: Duration) -> Duration {
    cost.saturating_mul(PER_BUDGET).clamp(MIN_AGE, MAX_AGE)
}

impl Pacer {
    /// A pacer with no count yet: the first report counts.
    pub(crate) fn new() -> Self {
        Pacer::default()
    }

    /// Whether the report at `now` counts afresh. Every report goes through here once:
    /// it also takes the report's CPU into the usual level.
    pub(crate) fn decide(&mut self, now: Instant, ctx: Context) -> Decision {
        let decision = self.judge(now, ctx);
        if let Some(cpu) = ctx.cpu {
            let usual = self.usual_cpu.unwrap_or(cpu);
            self.usual_cpu = Some(usual + USUAL_CPU_ALPHA * (cpu - usual));
            self.recent_cpu.insert(0, cpu);
            self.recent_cpu.truncate(RECENT_CPUS);
        }
        decision
    }

    fn judge(&self, now: Instant, ctx: Context) -> Decision {
        let Some(last) = self.last else {
            return Decision::Count(Why::First);
        };
        let age = now.saturating_duration_since(last.at);
        if age >= last.lasts {
            return Decision::Count(Why::Due);
        }
        let Some(cpu) = ctx.cpu else {
            return Decision::Count(Why::NoCpu);
        };
        if self.binding(last, cpu, ctx) {
            return Decision::Count(Why::Binding);
        }
        if last.raised {
            return Decision::Count(Why::Raised);
        }
        match (self.usual_cpu, last.cpu) {
            (Some(usual), Some(then)) if cpu_fell(usual, cpu) && cpu_fell(then, cpu) => {
                Decision::Count(Why::CpuFell)
            }
            _ => Decision::Repeat(age),
        }
    }

    /// Records a fresh count taken at `now` by a report whose CPU was `cpu`, which cost
    /// `cost` of CPU (`None`: unknown, and then it lasts [`MIN_AGE`]).
    pub(crate) fn counted(
        &mut self,
        now: Instant,
        owed: u32,
        cpu: Option<f64>,
        cost: Option<Duration>,
    ) {
        let owed_f = f64::from(owed);
        let usual = self.usual.unwrap_or(owed_f);
        self.usual = Some(usual + USUAL_ALPHA * (owed_f - usual));
        self.last = Some(Last {
            at: now,
            owed,
            lasts: cost.map_or(MIN_AGE, lasts),
            cpu,
            raised: owed_f > RAISED_FACTOR * usual + RAISED_MARGIN,
        });
    }

    /// Forgets the last count after a failed one, so that the next report counts.
    pub(crate) fn failed(&mut self) {
        self.last = None;
    }

    /// With a capacity, whether the last count's term is close to the CPU; without,
    /// whether the aggregator steers by more than any recent CPU, or distrusts the
    /// count (it then trusts it again only if fresh counts rise with the weight). Its
    /// load comes from a report or two ago, so comparing it with this report's CPU
    /// alone would read every fall of the CPU as a binding count.
    fn binding(&self, last: Last, cpu: f64, ctx: Context) -> bool {
        // Steered by the larger of the CPU and the in-flight term, the aggregator's load
        // is never below the CPU of the report it came from. A load below every recent
        // CPU figure is steered by something else (a service whose metric is the
        // in-flight count alone): then the count is the load, and every report counts.
        let lowest = self.recent_cpu.iter().copied().fold(cpu, f64::min);
        if ctx
            .steered
            .is_some_and(|(load, _)| load + STEERED_MARGIN < lowest)
        {
            return true;
        }
        if ctx.capacity > 0 {
            return f64::from(last.owed) / f64::from(ctx.capacity) >= NEAR_BINDING * cpu;
        }
        let recent = self.recent_cpu.iter().copied().fold(cpu, f64::max);
        match ctx.steered {
            Some((load, trusted)) => !trusted || load > STEERED_FACTOR * recent + STEERED_MARGIN,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, secs: f64) -> Instant {
        t0 + Duration::from_secs_f64(secs)
    }

    fn cpu(c: f64) -> Context {
        Context {
            cpu: Some(c),
            ..Context::default()
        }
    }

    const CHEAP: Option<Duration> = Some(Duration::from_micros(400));
    const DEAR: Option<Duration> = Some(Duration::from_millis(4));

    /// A pacer that has seen `history` reports at CPU `c` counting `owed` each, the
    /// last at time 0, with counts costing `cost`.
    fn settled(t0: Instant, owed: u32, c: f64, history: usize, cost: Option<Duration>) -> Pacer {
        let mut p = Pacer::new();
        for _ in 0..history.max(1) {
            p.decide(t0, cpu(c));
            p.counted(t0, owed, Some(c), cost);
        }
        p
    }

    /// Which seconds from 1 to `secs` count, with CPU `c` and counts of `owed` costing
    /// `cost`.
    fn counting_seconds(
        p: &mut Pacer,
        t0: Instant,
        secs: u32,
        c: f64,
        owed: u32,
        cost: Option<Duration>,
    ) -> Vec<(u32, Why)> {
        let mut counts = Vec::new();
        for s in 1..=secs {
            let now = at(t0, f64::from(s));
            if let Decision::Count(why) = p.decide(now, cpu(c)) {
                counts.push((s, why));
                p.counted(now, owed, Some(c), cost);
            }
        }
        counts
    }

    #[test]
    fn first_report_counts_and_a_failure_forgets() {
        let t0 = Instant::now();
        let mut p = Pacer::new();
        assert_eq!(p.decide(t0, cpu(0.3)), Decision::Count(Why::First));
        p.counted(t0, 0, Some(0.3), DEAR);
        assert_eq!(
            p.decide(at(t0, 1.0), cpu(0.3)),
            Decision::Repeat(Duration::from_secs(1))
        );
        p.failed();
        assert_eq!(p.decide(at(t0, 1.0), cpu(0.3)), Decision::Count(Why::First));
    }

    /// A quiet node counts as often as the budget allows: a dear count (a big hash)
    /// every 20 s, a cheap one every 2 s, an unmeasured one every report, and none is
    /// repeated for longer than MAX_AGE.
    #[test]
    fn a_quiet_node_counts_as_often_as_the_cost_allows() {
        let t0 = Instant::now();
        let mut p = settled(t0, 0, 0.3, 1, DEAR);
        assert_eq!(
            counting_seconds(&mut p, t0, 45, 0.3, 0, DEAR),
            vec![(20, Why::Due), (40, Why::Due)]
        );
        let mut p = settled(t0, 0, 0.3, 1, CHEAP);
        let cheap = counting_seconds(&mut p, t0, 10, 0.3, 0, CHEAP);
        assert_eq!(
            cheap.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![2, 4, 6, 8, 10]
        );
        let mut p = settled(t0, 0, 0.3, 1, None);
        assert_eq!(counting_seconds(&mut p, t0, 3, 0.3, 0, None).len(), 3);
        assert_eq!(lasts(Duration::from_secs(1)), MAX_AGE);
        assert_eq!(lasts(Duration::ZERO), MIN_AGE);
    }

    #[test]
    fn no_cpu_figure_means_the_count_is_the_load() {
        let t0 = Instant::now();
        let mut p = settled(t0, 0, 0.3, 1, DEAR);
        let none = Context::default();
        assert_eq!(p.decide(at(t0, 1.0), none), Decision::Count(Why::NoCpu));
    }

    /// A stall: the CPU falls while requests pile up. The next report counts. A rise,
    /// and the swings of a host shared with other work, do not.
    #[test]
    fn a_cpu_fall_counts_and_rises_and_noise_do_not() {
        let t0 = Instant::now();
        let next = at(t0, 1.0);
        let mut p = settled(t0, 1, 0.6, 20, DEAR);
        assert_eq!(p.decide(next, cpu(0.05)), Decision::Count(Why::CpuFell));
        for c in [0.35, 0.95, 1.0] {
            let mut p = settled(t0, 1, 0.6, 20, DEAR);
            assert!(matches!(p.decide(next, cpu(c)), Decision::Repeat(_)), "{c}");
        }
        // A small service on a big host: 8 % of it falling to 1 %.
        let mut small = settled(t0, 0, 0.08, 20, DEAR);
        assert_eq!(small.decide(next, cpu(0.01)), Decision::Count(Why::CpuFell));
        // Jitter of an idle host does not.
        let mut idle = settled(t0, 0, 0.04, 20, DEAR);
        assert!(matches!(idle.decide(next, cpu(0.0)), Decision::Repeat(_)));
        // A host whose CPU swings between 0.4 and 0.9 with other work: no fall.
        let mut p = settled(t0, 0, 0.65, 20, DEAR);
        let swings = [0.4, 0.9, 0.5, 0.85, 0.4, 0.4, 0.9, 0.45];
        for (i, c) in swings.into_iter().enumerate() {
            let now = at(t0, 1.0 + i as f64);
            assert!(
                matches!(p.decide(now, cpu(c)), Decision::Repeat(_)),
                "{i}: {c}"
            );
        }
    }

    /// A fall counts once: the reports after it, at the new level, repeat that count
    /// while the usual level catches up.
    #[test]
    fn one_fall_counts_once() {
        let t0 = Instant::now();
        let mut p = settled(t0, 0, 0.9, 20, DEAR);
        let counts = counting_seconds(&mut p, t0, 15, 0.01, 0, DEAR);
        assert_eq!(counts, vec![(1, Why::CpuFell)]);
        // A second fall, from a level the CPU held since, counts again.
        let mut p = settled(t0, 0, 0.9, 20, DEAR);
        p.decide(at(t0, 1.0), cpu(0.4));
        p.counted(at(t0, 1.0), 0, Some(0.4), DEAR);
        assert!(matches!(
            p.decide(at(t0, 2.0), cpu(0.35)),
            Decision::Repeat(_)
        ));
        assert_eq!(
            p.decide(at(t0, 3.0), cpu(0.05)),
            Decision::Count(Why::CpuFell)
        );
    }

    #[test]
    fn cpu_falls() {
        assert!(cpu_fell(0.6, 0.3));
        assert!(!cpu_fell(0.6, 0.31));
        assert!(cpu_fell(0.1, 0.05));
        assert!(!cpu_fell(0.09, 0.045)); // less than 0.05 of the resource
        assert!(!cpu_fell(0.6, 0.9));
    }

    /// A count above the node's usual one keeps the next reports counting, until the
    /// usual count has caught up with it or it falls back.
    #[test]
    fn a_raised_count_counts_every_report_until_it_settles() {
        let t0 = Instant::now();
        let mut p = settled(t0, 2, 0.3, 20, DEAR);
        let (s1, s2, s3) = (at(t0, 1.0), at(t0, 2.0), at(t0, 3.0));
        assert!(matches!(p.decide(s1, cpu(0.3)), Decision::Repeat(_)));
        // 2 usual: 5 is not raised (not above 2 × 2 + 1); 8 is.
        p.counted(s1, 5, Some(0.3), DEAR);
        assert!(matches!(p.decide(s2, cpu(0.3)), Decision::Repeat(_)));
        let mut p = settled(t0, 2, 0.3, 20, DEAR);
        p.counted(s1, 8, Some(0.3), DEAR);
        assert_eq!(p.decide(s2, cpu(0.3)), Decision::Count(Why::Raised));
        // It holds at 8: counted every report until the usual count nears it.
        let raised = counting_seconds(&mut p, s1, 30, 0.3, 8, DEAR);
        let raised: Vec<u32> = raised
            .iter()
            .filter(|c| c.1 == Why::Raised)
            .map(|c| c.0)
            .collect();
        assert_eq!(raised, vec![1, 2, 3], "{raised:?}");
        // Falling back to the usual level stops it at once.
        let mut p = settled(t0, 2, 0.3, 20, DEAR);
        p.counted(s1, 8, Some(0.3), DEAR);
        p.counted(s2, 2, Some(0.3), DEAR);
        assert!(matches!(p.decide(s3, cpu(0.3)), Decision::Repeat(_)));
    }

    #[test]
    fn a_binding_term_counts_every_report() {
        let t0 = Instant::now();
        let next = at(t0, 1.0);
        // With a capacity of 10: 3 in flight is 0.3, close to a CPU of 0.4 ...
        let cap = |capacity| Context {
            cpu: Some(0.4),
            capacity,
            steered: None,
        };
        let mut p = settled(t0, 3, 0.4, 20, DEAR);
        assert_eq!(p.decide(next, cap(10)), Decision::Count(Why::Binding));
        // ... and far from it with a capacity of 100.
        assert!(matches!(p.decide(next, cap(100)), Decision::Repeat(_)));
        // Without one, the aggregator's load says.
        let steered = |c, load, trusted| Context {
            cpu: Some(c),
            capacity: 0,
            steered: Some((load, trusted)),
        };
        let mut p = settled(t0, 3, 0.4, 20, DEAR);
        assert_eq!(
            p.decide(next, steered(0.4, 0.9, true)),
            Decision::Count(Why::Binding)
        );
        // A count the aggregator set aside is watched on fresh counts.
        assert_eq!(
            p.decide(next, steered(0.4, 0.4, false)),
            Decision::Count(Why::Binding)
        );
        assert!(matches!(
            p.decide(next, steered(0.4, 0.42, true)),
            Decision::Repeat(_)
        ));
        // A load below every recent CPU figure is not the larger of CPU and count: the
        // service is steered by the count alone, which then always matters, with a
        // capacity or without.
        let mut p = settled(t0, 3, 0.4, 20, DEAR);
        assert_eq!(
            p.decide(next, steered(0.4, 0.3, true)),
            Decision::Count(Why::Binding)
        );
        let mut p = settled(t0, 3, 0.4, 20, DEAR);
        let by_count = Context {
            cpu: Some(0.4),
            capacity: 100,
            steered: Some((0.03, true)),
        };
        assert_eq!(p.decide(next, by_count), Decision::Count(Why::Binding));
        // A load from a report whose CPU was higher than this one's is not binding.
        let mut p = settled(t0, 3, 0.4, 20, DEAR);
        p.decide(next, steered(0.7, 0.4, true));
        assert!(matches!(
            p.decide(at(t0, 2.0), steered(0.45, 0.7, true)),
            Decision::Repeat(_)
        ));
    }
}
