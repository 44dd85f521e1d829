//! When the TCP in-flight source counts afresh, and when a report repeats its last count.
//!
//! A count is a sock_diag dump, and the kernel walks its whole established hash for it,
//! visiting every socket in it (TIME_WAIT ones included) from cold caches: about 0.3 ms
//! of CPU on a quiet host, 3–5 ms on a host holding 20,000 unrelated sockets. At one
//! count a second that walk is most of what the agent costs (`docs/footprint.md`).
//!
//! The count is only worth that while it can change the node's load. The load is
//! `max(CPU, in-flight term)`, and a report whose count is far from binding moves nothing
//! if the count has not moved either. So a report counts afresh when any of these holds
//! ([`Why`]), and otherwise repeats the last count:
//!
//! - there is no count yet, or the last one failed;
//! - the last count is [`MAX_AGE`] old: the bound on how stale a count gets, and so on
//!   how late a pile-up that shows nowhere else is seen;
//! - there is no CPU figure this report (no CPU source, or its first report): the count
//!   is then the whole load;
//! - the in-flight term binds or is close to it: with a capacity, the last count is at
//!   least half the CPU in its units; without one, the aggregator steers the node by a
//!   load above its CPU (it alone can judge a count against the fleet);
//! - the last count was raised: above twice the node's usual count (an average of its
//!   earlier counts) plus one, so it may be rising; counting goes on every report until
//!   the usual count has caught up or the count falls back;
//! - the CPU moved since the last count ([`cpu_moved`]): a node that stalls on I/O goes
//!   quiet on CPU while its requests pile up, and a surge raises it. This is what
//!   catches a stall within a report.
//!
//! Sans-IO: the time and the report's other figures come in as arguments.

use std::time::{Duration, Instant};

/// The longest a count is repeated before the next report counts afresh.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(10);
/// A CPU change of this much of the resource since the last count makes a report count,
/// whatever the level.
const CPU_STEP_ABSOLUTE: f64 = 0.1;
/// A smaller change counts from this much of the resource ...
const CPU_STEP: f64 = 0.05;
/// ... when it is also this fraction of the larger of the two levels (a small service on
/// a big host, stalling).
const CPU_STEP_RELATIVE: f64 = 0.3;
/// The share of each fresh count in the node's usual count (an exponential average).
const USUAL_ALPHA: f64 = 0.1;
/// A count above `RAISED_FACTOR × usual + RAISED_MARGIN` is raised.
const RAISED_FACTOR: f64 = 2.0;
const RAISED_MARGIN: f64 = 1.0;
/// With a capacity, the in-flight term is close to binding from this fraction of the
/// CPU on.
const NEAR_BINDING: f64 = 0.5;
/// Without a capacity, the aggregator's load binds on the count when it exceeds the CPU
/// by this factor and margin (its CPU may be smoothed, and an error penalty adds to it).
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
    /// The last count is [`MAX_AGE`] old.
    Stale,
    /// No CPU figure: the count is the whole load.
    NoCpu,
    /// The in-flight term binds or is close to it.
    Binding,
    /// The last count was above the node's usual one.
    Raised,
    /// The CPU moved since the last count.
    CpuMoved,
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
}

/// Whether the CPU moved enough between two reports to count afresh: by 0.1 of the
/// resource, or by 0.05 when that is also 30 % of the larger level.
pub(crate) fn cpu_moved(before: f64, now: f64) -> bool {
    let change = (now - before).abs();
    change >= CPU_STEP_ABSOLUTE
        || (change >= CPU_STEP && change >= CPU_STEP_RELATIVE * before.max(now))
}

impl Pacer {
    /// A pacer with no count yet: the first report counts.
    pub(crate) fn new() -> Self {
        Pacer::default()
    }

    /// Whether the report at `now` counts afresh.
    pub(crate) fn decide(&self, now: Instant, ctx: Context) -> Decision {
        let Some(last) = self.last else {
            return Decision::Count(Why::First);
        };
        let age = now.saturating_duration_since(last.at);
        if age >= MAX_AGE {
            return Decision::Count(Why::Stale);
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
        match last.cpu {
            Some(before) if !cpu_moved(before, cpu) => Decision::Repeat(age),
            _ => Decision::Count(Why::CpuMoved),
        }
    }

    /// Records a fresh count taken at `now` by a report whose CPU was `cpu`.
    pub(crate) fn counted(&mut self, now: Instant, owed: u32, cpu: Option<f64>) {
        let owed_f = f64::from(owed);
        let usual = self.usual.unwrap_or(owed_f);
        self.usual = Some(usual + USUAL_ALPHA * (owed_f - usual));
        self.last = Some(Last {
            at: now,
            owed,
            cpu,
            raised: owed_f > RAISED_FACTOR * usual + RAISED_MARGIN,
        });
    }

    /// Forgets the last count after a failed one, so that the next report counts.
    pub(crate) fn failed(&mut self) {
        self.last = None;
    }

    /// With a capacity, whether the last count's term is close to the CPU; without,
    /// whether the aggregator steers by more than the CPU on a count it trusts.
    fn binding(&self, last: Last, cpu: f64, ctx: Context) -> bool {
        if ctx.capacity > 0 {
            return f64::from(last.owed) / f64::from(ctx.capacity) >= NEAR_BINDING * cpu;
        }
        match ctx.steered {
            Some((load, trusted)) => trusted && load > STEERED_FACTOR * cpu + STEERED_MARGIN,
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

    /// A pacer that counted `owed` at time 0 with CPU `c`, after `history` earlier
    /// counts of the same value (to set the usual count).
    fn counted(t0: Instant, owed: u32, c: f64, history: usize) -> Pacer {
        let mut p = Pacer::new();
        for _ in 0..history {
            p.counted(t0, owed, Some(c));
        }
        p.counted(t0, owed, Some(c));
        p
    }

    #[test]
    fn first_report_counts_and_a_failure_forgets() {
        let t0 = Instant::now();
        let mut p = Pacer::new();
        assert_eq!(p.decide(t0, cpu(0.3)), Decision::Count(Why::First));
        p.counted(t0, 0, Some(0.3));
        assert_eq!(
            p.decide(at(t0, 1.0), cpu(0.3)),
            Decision::Repeat(Duration::from_secs(1))
        );
        p.failed();
        assert_eq!(p.decide(at(t0, 1.0), cpu(0.3)), Decision::Count(Why::First));
    }

    #[test]
    fn a_quiet_node_counts_at_most_every_max_age() {
        let t0 = Instant::now();
        let mut p = counted(t0, 0, 0.3, 0);
        let mut counts = Vec::new();
        for s in 1..=35 {
            let now = at(t0, f64::from(s));
            if let Decision::Count(why) = p.decide(now, cpu(0.3)) {
                counts.push((s, why));
                p.counted(now, 0, Some(0.3));
            }
        }
        assert_eq!(
            counts,
            vec![(10, Why::Stale), (20, Why::Stale), (30, Why::Stale)]
        );
    }

    #[test]
    fn no_cpu_figure_means_the_count_is_the_load() {
        let t0 = Instant::now();
        let p = counted(t0, 0, 0.3, 0);
        let none = Context::default();
        assert_eq!(p.decide(at(t0, 1.0), none), Decision::Count(Why::NoCpu));
    }

    /// A stall: the CPU falls while requests pile up. The next report counts.
    #[test]
    fn a_cpu_drop_or_rise_counts_and_noise_does_not() {
        let t0 = Instant::now();
        let p = counted(t0, 1, 0.6, 20);
        let next = at(t0, 1.0);
        assert_eq!(p.decide(next, cpu(0.05)), Decision::Count(Why::CpuMoved));
        assert_eq!(p.decide(next, cpu(0.75)), Decision::Count(Why::CpuMoved));
        assert!(matches!(p.decide(next, cpu(0.55)), Decision::Repeat(_)));
        assert!(matches!(p.decide(next, cpu(0.66)), Decision::Repeat(_)));
        // A small service on a big host: 8 % of it falling to 1 %.
        let small = counted(t0, 0, 0.08, 20);
        assert_eq!(
            small.decide(next, cpu(0.01)),
            Decision::Count(Why::CpuMoved)
        );
        assert!(matches!(small.decide(next, cpu(0.05)), Decision::Repeat(_)));
        // Jitter of an idle host does not.
        let idle = counted(t0, 0, 0.01, 20);
        assert!(matches!(idle.decide(next, cpu(0.04)), Decision::Repeat(_)));
    }

    #[test]
    fn cpu_steps() {
        assert!(cpu_moved(0.5, 0.61));
        assert!(cpu_moved(0.61, 0.5));
        assert!(!cpu_moved(0.5, 0.59));
        assert!(cpu_moved(0.1, 0.16));
        assert!(!cpu_moved(0.2, 0.26)); // 0.06 < 0.3 × 0.26
        assert!(!cpu_moved(0.0, 0.049));
        assert!(cpu_moved(0.0, 0.05));
    }

    /// A count above the node's usual one keeps the next reports counting, until the
    /// usual count has caught up with it or it falls back.
    #[test]
    fn a_raised_count_counts_every_report_until_it_settles() {
        let t0 = Instant::now();
        let mut p = counted(t0, 2, 0.3, 20);
        assert!(matches!(
            p.decide(at(t0, 1.0), cpu(0.3)),
            Decision::Repeat(_)
        ));
        // 2 usual: 5 is not raised (not above 2 × 2 + 1); 8 is.
        p.counted(at(t0, 1.0), 5, Some(0.3));
        assert!(matches!(
            p.decide(at(t0, 2.0), cpu(0.3)),
            Decision::Repeat(_)
        ));
        let mut p = counted(t0, 2, 0.3, 20);
        p.counted(at(t0, 1.0), 8, Some(0.3));
        assert_eq!(
            p.decide(at(t0, 2.0), cpu(0.3)),
            Decision::Count(Why::Raised)
        );
        // It holds at 8: counted every report until the usual count nears it.
        let mut raised = 0;
        for s in 2..60 {
            let now = at(t0, f64::from(s));
            match p.decide(now, cpu(0.3)) {
                Decision::Count(Why::Raised) => {
                    raised += 1;
                    p.counted(now, 8, Some(0.3));
                }
                Decision::Count(_) => p.counted(now, 8, Some(0.3)),
                Decision::Repeat(_) => break,
            }
        }
        assert!((2..=6).contains(&raised), "{raised}");
        // Falling back to the usual level stops it at once.
        let mut p = counted(t0, 2, 0.3, 20);
        p.counted(at(t0, 1.0), 8, Some(0.3));
        p.counted(at(t0, 2.0), 2, Some(0.3));
        assert!(matches!(
            p.decide(at(t0, 3.0), cpu(0.3)),
            Decision::Repeat(_)
        ));
    }

    #[test]
    fn a_binding_term_counts_every_report() {
        let t0 = Instant::now();
        // With a capacity of 10: 3 in flight is 0.3, close to a CPU of 0.4 ...
        let p = counted(t0, 3, 0.4, 20);
        let cap = |capacity| Context {
            cpu: Some(0.4),
            capacity,
            steered: None,
        };
        assert_eq!(
            p.decide(at(t0, 1.0), cap(10)),
            Decision::Count(Why::Binding)
        );
        // ... and far from it with a capacity of 100.
        assert!(matches!(
            p.decide(at(t0, 1.0), cap(100)),
            Decision::Repeat(_)
        ));
        // Without one, the aggregator's load says.
        let steered = |load, trusted| Context {
            cpu: Some(0.4),
            capacity: 0,
            steered: Some((load, trusted)),
        };
        assert_eq!(
            p.decide(at(t0, 1.0), steered(0.9, true)),
            Decision::Count(Why::Binding)
        );
        assert!(matches!(
            p.decide(at(t0, 1.0), steered(0.9, false)),
            Decision::Repeat(_)
        ));
        assert!(matches!(
            p.decide(at(t0, 1.0), steered(0.42, true)),
            Decision::Repeat(_)
        ));
    }
}
