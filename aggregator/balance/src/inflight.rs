//! The in-flight term of an endpoint's load, without a capacity guess.
//!
//! An agent counts the requests its service owes a response. What that count means
//! depends on the service: a dozen requests in flight is nothing for a proxy with a
//! thousand threads and a pile-up for a single-threaded worker. A configured capacity
//! (`inflight / capacity`) needs somebody to know that number, and the wrong number
//! either hides a stalled node or pins a healthy one at the weight floor.
//!
//! So by default the count is judged against the fleet instead, two ways, and an
//! endpoint must stand out both ways before its count says anything:
//!
//! - **Per unit of weight.** Little's law says that the requests in flight at an
//!   endpoint are its arrival rate times its latency; its arrival rate follows the
//!   weight the load balancers apply, so the count per unit of weight is a latency
//!   proxy that needs no throughput figure. Healthy endpoints of one service have
//!   latencies within a small factor of each other (a slower generation of hardware is
//!   slower per request by its speed ratio); a node stalled on I/O holds its requests
//!   many times longer. Where traffic does not follow the weight exactly (clients that
//!   each see a subset of the endpoints, least-request pickers) this alone misjudges.
//! - **Per unit of CPU.** A CPU-bound endpoint's in-flight count over its utilization
//!   is its parallelism (more as it queues), the same at balance whatever its speed or
//!   its share of the traffic; a stalled node holds requests while its CPU idles. This
//!   alone misjudges endpoints with more cores than the rest.
//!
//! The smaller of the two ratios to the service's typical values is the endpoint's
//! excess. The term binds only above [`TOLERANCE`], and then grows with the excess: a
//! stalled node loses weight for as long as it stays stalled, while the others keep
//! being balanced by CPU. An endpoint that holds its requests with idle hands (its
//! count per unit of CPU far above the typical one) is judged by its count per unit of
//! weight against the typical one itself ([`IDLE_HANDED_TOLERANCE`]): at a low request
//! rate a stalled node's count is too small to stand out threefold.
//!
//! A count that does not respond to the weight is not load: pooled connections or
//! long polls counted as requests, a broken gauge. When the term has driven an
//! endpoint's weight down by [`UNRESPONSIVE_DROP`] with idle CPU and the count has
//! stayed flat for [`UNRESPONSIVE_CYCLES`] cycles, the term is distrusted for that
//! endpoint (the API and a metric say so) and its load is its CPU. A node that truly
//! stalls is told apart by its requests completing: its backlog keeps draining, and
//! with less weight fewer requests arrive and fewer are in flight. If
//! a distrusted count then rises with the weight (a hung node piling up new
//! requests), it is load after all and is trusted again for the rest of the episode.

use super::params::{LoadMetric, Params};
use serde::{Deserialize, Serialize};

/// The weight of a new report in the smoothed in-flight count. Reports are point
/// samples of a small integer; smoothing over a few of them is what makes a count of
/// 0, 1, 0, 2 mean "about one".
pub(crate) const SMOOTHING: f64 = 0.4;
/// The weight of a new report that is lower than the smoothed count. A backlog that
/// drains shows at once: a count that lags behind an emptied queue would go on
/// pushing the endpoint down after the cause is gone.
pub(crate) const SMOOTHING_DOWN: f64 = 0.8;
/// The term is at most this multiple of the fleet's average CPU load: enough to take
/// weight off the endpoint every cycle, and never so much that one endpoint's excess
/// drags the average the others are steered to.
pub(crate) const TERM_CAP: f64 = 2.0;
/// Cycles of weight remembered: the count per unit of weight divides by the largest,
/// because the requests in flight now arrived under the weights of the last cycles,
/// and a weight that fell faster than a queue drains must not inflate the ratio.
pub(crate) const WEIGHT_MEMORY: usize = 3;
/// Requests a node still stalled would have shown in flight, summed over the reports
/// since its last stalled verdict, before its weight may grow again. A stalled node
/// held at a small weight has a count of a fraction of a request, so most reports find
/// nothing in flight: three reports of 0 say little at a weight where a stalled node
/// shows 0.3 requests, and much at one where it shows 3. A still-stalled node shows
/// none over this many expected requests one time in a hundred (Poisson, e^-4.6).
pub(crate) const STALL_EVIDENCE: f64 = 4.6;
/// The longest hold after a stall, in controller steps (cycles with a report of the
/// endpoint's), however little a stalled node would have shown: a node cut to the
/// weight floor, where a stalled one shows a tenth of a request per report, is released
/// at most this many steps after its last stalled verdict, and then grows back at the
/// growth bound.
pub(crate) const MAX_STALL_HOLD: u32 = 30;
/// While held, a stalled node's weight may grow to where a node still stalled shows
/// this many requests in flight per report: few enough that it costs its users little
/// (the requests it holds are this many), enough that the evidence comes within a
/// few reports.
pub(crate) const PROBE_COUNT: f64 = 0.5;
/// ...and at most this share of the service's requests. At a low request rate half a
/// request in flight at a stalled node is a share of the requests that sets the
/// service's tail: at 40 requests a second and a 250 ms stall, two a second, 5 %. Below
/// this share the hold's evidence comes slowly and the node is released by
/// [`MAX_STALL_HOLD`] instead, to be cut again if it is still stalled. Below 1 %, as a
/// service's p99 lets 1 % of its requests be slow: at 1 % a stalled node held at the
/// probe set the p99 of the lab's low-rate run. The price is a slower return for a
/// node that has recovered: regrown in 23 cycles (median of seeded runs) at 0.6 %
/// against 19 at 1 %, and at 0.5 % one run in twenty had not regrown in 50. (26 since a
/// confirmed stall is brought to the probe in the first steps of its hold as well.)
pub(crate) const PROBE_SHARE: f64 = 0.006;
/// How far above the service's typical in-flight per unit of weight an endpoint must be
/// before the in-flight term binds. Healthy endpoints of different speeds differ by
/// their speed ratio (a 1.5× slower node holds each request 1.5× longer); a stalled
/// node by ten times or more.
pub const TOLERANCE: f64 = 3.0;
/// The tolerance for an endpoint that holds its requests with idle hands: its count per
/// unit of CPU at least [`IDLE_HANDED_RATIO`] times the typical one. Its count per unit
/// of weight is then judged against the typical one itself, so that a latency above the
/// fleet's makes its load above the average. Holding requests costs a healthy node CPU
/// in proportion (one with more cores holds a few times more per unit of CPU, not
/// nine); a node that holds them nine times as long per CPU-second is waiting on
/// something, and whatever its latency exceeds the fleet's by is that wait. At a low
/// request rate a stalled node holds a request or two per unit of weight, against the
/// typical count's floor of [`MIN_TYPICAL`]: judged by [`TOLERANCE`], its term read
/// below the average, and the controller gave the stalled node more traffic for as long
/// as the stall lasted (60 % of the requests, from 30 % before the stall, in the lab at
/// 47 requests a second; 1.7 % with this tolerance).
pub(crate) const IDLE_HANDED_TOLERANCE: f64 = 1.0;
/// How many times the typical count per unit of CPU an endpoint holds before it is
/// judged by [`IDLE_HANDED_TOLERANCE`], if its CPU is also below the fleet's average
/// load: a busy node is not idle-handed, whatever its count.
pub(crate) const IDLE_HANDED_RATIO: f64 = 9.0;
/// Reports in a row on which an idle-handed endpoint's term binds, each finding
/// a request in flight, before it is stalled beyond doubt: it then sheds at the shrink
/// bound and is held after, as one whose count stands out by [`TOLERANCE`] is. At a
/// low request rate a stalled node's count stands out by less, and a proportional step
/// took ten seconds to bring its share down. One report is not enough: a healthy node
/// growing back from a small weight has a CPU near zero, so a report that happens to
/// find one of its requests in flight reads idle-handed and binding; two in a row at a
/// weight where it holds a request one report in a hundred come one time in ten
/// thousand, while a stalled node holding one or two requests shows them at most
/// reports.
pub(crate) const IDLE_HANDED_STREAK: u32 = 2;
/// An endpoint with fewer requests than this in flight on average is not piling them
/// up: its count says nothing. Kept low on purpose: a stalled node held at a small
/// weight has a small count, and its count per unit of weight is what keeps it there
/// (a higher floor lets it climb back and be flooded again, in a cycle).
pub(crate) const MIN_INFLIGHT: f64 = 0.25;
/// A count must be at least this to be judged unresponsive: one that has drained to a
/// request or less has followed the weight.
pub(crate) const MIN_STUCK: f64 = 1.0;
/// The typical in-flight per unit of weight is at least this, so that a nearly idle
/// fleet does not turn one request into a large multiple.
pub(crate) const MIN_TYPICAL: f64 = 0.5;
/// CPU utilization below this counts as zero when dividing by it.
pub(crate) const MIN_CPU: f64 = 0.01;
/// CPU below this share of the fleet's average CPU load counts as idle.
pub(crate) const IDLE_CPU: f64 = 0.25;
/// The weight must have fallen by this factor (or to twice the floor) while the count
/// held before the count is called unresponsive.
pub(crate) const UNRESPONSIVE_DROP: f64 = 8.0;
/// "Held" means at least this share of the count when the episode began.
pub(crate) const UNRESPONSIVE_KEEP: f64 = 0.5;
/// ...and over the cycles it is watched at the low weight it must not fall below this
/// share of where it stood when the watch began: a backlog that drains at its own pace
/// (a node whose requests complete slowly) falls steadily, a stuck count does not.
pub(crate) const UNRESPONSIVE_FLAT: f64 = 0.9;
/// Cycles in a row the count must hold at the low weight: reports and the load
/// balancers lag the weight by a cycle or two, so a count that falls late is still a
/// count that falls.
pub(crate) const UNRESPONSIVE_CYCLES: u32 = 5;
/// A distrusted count that rises above this multiple of its level (plus one request)
/// responds to the weight after all.
pub(crate) const RESPONSIVE_RISE: f64 = 1.5;

/// How the in-flight term was derived, for the API and the agents' status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Derivation {
    /// No in-flight count is measured, or the metric ignores it.
    #[default]
    None,
    /// Judged against the service's typical in-flight per unit of weight.
    FleetRelative,
    /// Divided by the capacity the agent was configured with.
    Capacity,
}

/// What the cycle made of an endpoint's in-flight count.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InflightEstimate {
    /// How the term was derived.
    pub derivation: Derivation,
    /// The smoothed count of requests in flight.
    pub smoothed: f64,
    /// How far the count stands out (fleet-relative only; 1 is typical): the smaller of
    /// its ratios per unit of weight and per unit of CPU to the service's typical ones.
    pub ratio: f64,
    /// The in-flight term, in units of load.
    pub term: f64,
    /// Whether the term set the endpoint's load this cycle.
    pub binding: bool,
    /// Whether the term is trusted. An untrusted term does not count.
    pub trusted: bool,
}

/// One endpoint's in-flight memory across reports and cycles.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InflightTracker {
    smoothed: Option<f64>,
    /// The last reported count.
    last: u32,
    /// The count when the term was distrusted.
    distrusted_at: Option<f64>,
    /// The count and weight when the term began to bind in this episode.
    episode: Option<(f64, f64)>,
    /// The count rose with the weight in this episode: it is load.
    proven: bool,
    /// Cycles in a row the count held at a low weight, and its level when they began.
    held_cycles: u32,
    held_from: f64,
    /// The published weights of the last cycles, newest first.
    weights: [f64; WEIGHT_MEMORY],
    /// The hold on the weight since the endpoint was last stalled (see
    /// [`Self::hold_after_stall`]).
    stall_hold: Option<StallHold>,
    /// Reports in a row that found a request in flight while the endpoint held its
    /// requests with idle hands and its term bound (see [`IDLE_HANDED_STREAK`]).
    idle_streak: u32,
    /// The last assessment found the endpoint holding its requests with idle hands
    /// (its count per unit of CPU [`IDLE_HANDED_RATIO`] times the typical one, its CPU
    /// below the fleet's average load).
    idle_handed: bool,
    /// A report has come since the last assessment: a cycle that finds none (a
    /// skipped step assesses the same report again) leaves the streak as it is.
    news: bool,
    /// The last cycle's verdict.
    pub estimate: InflightEstimate,
}

impl InflightTracker {
    /// Takes a reported count into the smoothed one.
    pub fn observe(&mut self, inflight: u32) {
        self.last = inflight;
        self.news = true;
        let x = f64::from(inflight);
        self.smoothed = Some(match self.smoothed {
            Some(s) if x < s => s + SMOOTHING_DOWN * (x - s),
            Some(s) => s + SMOOTHING * (x - s),
            None => x,
        });
    }

    /// The smoothed count; 0 before any report.
    pub fn smoothed(&self) -> f64 {
        self.smoothed.unwrap_or(0.0)
    }

    /// Called at each controller step: whether the endpoint's weight is held this step,
    /// and if so up to which weight it may still grow (0 for not at all). `stalled`
    /// says whether the endpoint is stalled now.
    ///
    /// For [`WEIGHT_MEMORY`] steps after the last stalled one it may not grow: the count
    /// per unit of weight divides by the largest weight of those cycles, so right after
    /// a stall has cut the weight it reads low, and a weight grown on that would bring
    /// the stalled node its share back before its count could say it is still stalled.
    ///
    /// Beyond those it is held until the count has had the chance to say so: until a
    /// node still stalled (its count per unit of weight over the episode) would have
    /// shown [`STALL_EVIDENCE`] requests in flight at the weights since, at most
    /// [`MAX_STALL_HOLD`] steps. At a small weight a stalled node's count is a fraction
    /// of a request, mostly 0 when a report is taken; a few reports of 0 in a row are
    /// not a node that has recovered, and a weight grown on them creeps back up by the
    /// growth bound and brings the stalled node its requests again. Meanwhile it may
    /// grow to where a node still stalled shows [`PROBE_COUNT`] requests: at the weight
    /// floor the count would take a minute to say anything. A node that really has
    /// recovered shows fewer and is released once the evidence is in.
    pub(crate) fn hold_after_stall(&mut self, stalled: bool) -> Option<f64> {
        let (count, weight) = (f64::from(self.last), self.weights[0]);
        if stalled {
            let hold = self.stall_hold.get_or_insert(StallHold::default());
            hold.steps = 0;
            hold.expected = 0.0;
            hold.verdicts = hold.verdicts.saturating_add(1);
            hold.counts += count;
            hold.weights += weight;
            return None;
        }
        let hold = self.stall_hold.as_mut()?;
        hold.steps += 1;
        let per_weight = hold.counts / hold.weights.max(f64::MIN_POSITIVE);
        hold.expected += per_weight * weight;
        if hold.steps <= WEIGHT_MEMORY as u32 {
            return Some(0.0);
        }
        // No count to weigh the evidence by (every verdict fell on a report of 0, the
        // smoothed count still draining): the three steps are all the hold there is.
        let weighed = per_weight > 0.0 && per_weight.is_finite();
        if weighed && hold.expected < STALL_EVIDENCE && hold.steps <= MAX_STALL_HOLD {
            return Some(PROBE_COUNT / per_weight);
        }
        self.stall_hold = None;
        None
    }

    /// Whether the episode has had more than one stalled verdict (a second step judged
    /// stalled, in a row or later in the hold): the weight is then brought down to the
    /// probe. One verdict may be a healthy node's unlucky report (two requests in
    /// flight at a small weight, a few times in a hundred) and only holds it.
    pub(crate) fn stall_confirmed(&self) -> bool {
        self.stall_hold.is_some_and(|h| h.verdicts >= 2)
    }

    /// Whether the weight is held after a stall (see [`Self::hold_after_stall`]).
    pub(crate) fn held_after_stall(&self) -> bool {
        self.stall_hold.is_some()
    }

    /// The endpoint's weight when this cycle's inputs were gathered: what the load
    /// balancers were applying, within the change that makes a new publication.
    pub(crate) fn applied_weight(&self) -> f64 {
        self.weights[0]
    }

    /// Whether the endpoint has held its requests with idle hands, its term binding and
    /// a request in flight at each report, for [`IDLE_HANDED_STREAK`] reports in a row.
    pub(crate) fn idle_handed_beyond_doubt(&self) -> bool {
        self.idle_streak >= IDLE_HANDED_STREAK
    }

    /// Whether the last assessment found the endpoint holding its requests with idle
    /// hands: its CPU does little for the requests it holds, however much it does for
    /// the requests it receives.
    pub(crate) fn idle_handed(&self) -> bool {
        self.idle_handed
    }

    /// Forgets the streak of an endpoint that was not assessed (silent past its
    /// freshness): reports before a gap are not "in a row" with those after it.
    pub(crate) fn break_idle_streak(&mut self) {
        self.idle_streak = 0;
        self.idle_handed = false;
    }

    /// Whether a report has come since the last assessment.
    pub(crate) fn has_news(&self) -> bool {
        self.news
    }

    /// Whether the term is currently distrusted.
    pub fn distrusted(&self) -> bool {
        self.distrusted_at.is_some()
    }

    /// Forgets the episode and the smoothing, as after a drain or a restart.
    pub fn reset(&mut self) {
        *self = InflightTracker::default();
    }
}

/// The hold on an endpoint's weight while it is stalled and after.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct StallHold {
    /// Controller steps since the last stalled verdict.
    steps: u32,
    /// The reported counts and the weights they were taken at, summed over the
    /// episode's stalled verdicts: their ratio is the count per unit of weight of the
    /// node stalled, what it shows while it stays so. A ratio of sums, not the last
    /// verdict's: at a small weight a verdict falls on a report that happened to find a
    /// request in flight, and one request over a small weight overstates the latency;
    /// the episode's first verdicts, at the weight the node had, weigh the most. The
    /// report's own count and weight, not the smoothed count over the largest recent
    /// weight the verdict reads: while the weight halves each step those read a
    /// quarter of the latency, and the hold weighed by it let the node back at twice
    /// the weight (a share of 0.84 % against 0.68 % in the unit test of twenty runs).
    counts: f64,
    weights: f64,
    /// What a node still stalled would have shown since the last stalled verdict.
    expected: f64,
    /// Stalled verdicts in the episode.
    verdicts: u32,
}

/// One endpoint's inputs to [`assess`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Input {
    /// Load without the in-flight term: CPU and the error penalty, as the metric says.
    pub base: f64,
    /// CPU utilization, to tell an idle node.
    pub cpu: f64,
    /// The configured capacity; 0 for fleet-relative.
    pub capacity: u32,
    /// The last reported count.
    pub inflight: u32,
    /// The published weight the load balancers applied while the count was taken.
    pub weight: f64,
    /// Ramping up from a cold start: its few requests at a small weight are noise
    /// against the fleet, so the count is not judged against it until it has warmed.
    pub warming: bool,
}

/// What [`assess`] reads of one endpoint's tracker, once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Count {
    /// The smoothed count.
    smoothed: f64,
    /// The largest of the last cycles' weights.
    peak_weight: f64,
}

/// What [`assess`] returns per endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Assessed {
    /// The load to steer by.
    pub load: f64,
    /// Whether the term was distrusted in this cycle (a new distrust, for the metric).
    pub newly_distrusted: bool,
    /// Whether the term is distrusted now.
    pub distrusted: bool,
}

/// The median, except that of two values it is the smaller, so that one stalled node
/// of two does not become the typical one. Of an even number above two, the mean of the
/// middle pair: a lower median of a few small noisy counts sits low and makes healthy
/// nodes look like outliers.
fn typical_of(mut v: Vec<f64>) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    let mid = (n - 1) / 2;
    // A selection, not a sort: linear in the endpoints of the service.
    let (_, m, upper) = v.select_nth_unstable_by(mid, f64::total_cmp);
    let lower = *m;
    if n % 2 == 1 || n == 2 {
        return Some(lower);
    }
    let next = upper.iter().copied().fold(f64::INFINITY, f64::min);
    Some((lower + next) / 2.0)
}

/// Computes the load of every fresh serving endpoint of a service from its inputs and
/// updates each tracker's verdict. `items` pairs each endpoint's inputs with its tracker.
#[cfg(test)]
pub(crate) fn assess(
    params: &Params,
    items: &mut [(Input, &mut InflightTracker)],
) -> Vec<Assessed> {
    let counts: Vec<Count> = items
        .iter_mut()
        .map(|(input, tracker)| take_in(input, tracker))
        .collect();
    assess_counted(params, items, &counts)
}

/// Takes this cycle's weight into an endpoint's tracker and reads what the
/// fleet-wide figures of [`assess_counted`] need from it, so that those figures are
/// taken from a dense array rather than from every tracker again (a service may
/// have 100,000). The caller does it in the walk that gathers the inputs.
pub(crate) fn take_in(input: &Input, tracker: &mut InflightTracker) -> Count {
    tracker.weights.rotate_right(1);
    tracker.weights[0] = input.weight;
    Count {
        smoothed: tracker.smoothed(),
        peak_weight: tracker.weights.iter().copied().fold(0.0, f64::max),
    }
}

/// [`assess`] for trackers that have taken in this cycle's weights: `counts[i]` is
/// what [`take_in`] returned for `items[i]`.
pub(crate) fn assess_counted(
    params: &Params,
    items: &mut [(Input, &mut InflightTracker)],
    counts: &[Count],
) -> Vec<Assessed> {
    let counts_inflight = params.metric != LoadMetric::Cpu;
    let n = items.len().max(1) as f64;
    let avg_base = items.iter().map(|(i, _)| i.base).sum::<f64>() / n;
    let per_weight = |c: &Count| c.smoothed / c.peak_weight.max(params.min_weight);
    let per_cpu = |i: &Input, c: &Count| c.smoothed / i.cpu.max(MIN_CPU);
    // Both ratios of the endpoints without a capacity, in one walk.
    let mut by_weight = Vec::with_capacity(items.len());
    let mut by_cpu = Vec::with_capacity(items.len());
    for ((i, _), c) in items
        .iter()
        .zip(counts)
        .filter(|((i, _), _)| i.capacity == 0)
    {
        by_weight.push(per_weight(c));
        by_cpu.push(per_cpu(i, c));
    }
    let typical = |v: Vec<f64>, floor: f64| typical_of(v).unwrap_or(0.0).max(floor);
    let typical_weight = typical(by_weight, MIN_TYPICAL);
    let typical_cpu = typical(by_cpu, MIN_TYPICAL);
    // With in-flight as the only signal the CPU says nothing.
    let use_cpu = params.metric == LoadMetric::Max;
    // Under `max` the term is scaled to the fleet's CPU load and binds only well above
    // typical; with in-flight as the only signal it is the relative latency itself.
    let (scale, tolerance, floor) = match params.metric {
        LoadMetric::Inflight => (1.0, 1.0, 0.0),
        _ => (avg_base, TOLERANCE, MIN_INFLIGHT),
    };
    let idle_cpu = IDLE_CPU * avg_base;
    items
        .iter_mut()
        .zip(counts)
        .map(|((input, tracker), count)| {
            let smoothed = count.smoothed;
            let (derivation, ratio, term, idle_handed) = if !counts_inflight
                || tracker.smoothed.is_none()
            {
                (Derivation::None, 0.0, 0.0, false)
            } else if input.capacity > 0 {
                let term = crate::load::inflight_utilization(input.inflight, input.capacity);
                (Derivation::Capacity, 0.0, term, false)
            } else if input.warming {
                (Derivation::FleetRelative, 0.0, 0.0, false)
            } else {
                let by_weight = per_weight(count) / typical_weight;
                let by_cpu = per_cpu(input, count) / typical_cpu;
                let ratio = if use_cpu {
                    by_weight.min(by_cpu)
                } else {
                    by_weight
                };
                let idle_handed = use_cpu && by_cpu >= IDLE_HANDED_RATIO && input.cpu < avg_base;
                let tolerance = if idle_handed {
                    IDLE_HANDED_TOLERANCE
                } else {
                    tolerance
                };
                let term = if smoothed >= floor {
                    (scale * ratio / tolerance).min(scale * TERM_CAP)
                } else {
                    0.0
                };
                (Derivation::FleetRelative, ratio, term, idle_handed)
            };
            let binding = term > input.base;
            let newly_distrusted = tracker.judge(
                binding,
                smoothed,
                input.weight,
                input.cpu <= idle_cpu,
                params.min_weight,
            );
            let trusted = !tracker.distrusted();
            // A report that found a request in flight, not the smoothed count, which
            // still reads one a cycle after a report of none; each report once.
            if std::mem::take(&mut tracker.news) {
                tracker.idle_streak = if trusted && binding && idle_handed && input.inflight > 0 {
                    tracker.idle_streak.saturating_add(1)
                } else {
                    0
                };
            }
            tracker.idle_handed = idle_handed;
            let load = if trusted && binding { term } else { input.base };
            tracker.estimate = InflightEstimate {
                derivation,
                smoothed,
                ratio,
                term,
                binding: trusted && binding,
                trusted,
            };
            Assessed {
                load: crate::load::sanitize(load),
                newly_distrusted,
                distrusted: !trusted,
            }
        })
        .collect()
}

impl InflightTracker {
    /// Advances the trust verdict by one cycle. Returns true when the term is
    /// distrusted now and was not before.
    fn judge(&mut self, binding: bool, count: f64, weight: f64, idle: bool, floor: f64) -> bool {
        if let Some(level) = self.distrusted_at {
            if count >= level * RESPONSIVE_RISE + 1.0 {
                // More weight brought more requests that stay: a hung node, not a
                // stuck gauge. Trusted from now on, until the count drains away.
                self.distrusted_at = None;
                self.proven = true;
                self.episode = Some((count, weight));
            } else if count < MIN_STUCK {
                self.distrusted_at = None;
                self.episode = None;
                self.proven = false;
            }
            return false;
        }
        if binding {
            self.episode.get_or_insert((count, weight));
        } else if count < MIN_STUCK {
            self.episode = None;
            self.proven = false;
        }
        let Some((count0, weight0)) = self.episode else {
            return false;
        };
        let weight_fell = weight <= (weight0 / UNRESPONSIVE_DROP).max(floor * 2.0);
        let count_held = count >= count0 * UNRESPONSIVE_KEEP && count >= MIN_STUCK;
        if binding && !self.proven && weight_fell && count_held && idle {
            if self.held_cycles == 0 {
                self.held_from = count;
            }
            if count >= self.held_from * UNRESPONSIVE_FLAT {
                self.held_cycles += 1;
            } else {
                // Falling: requests complete. Watch again from here.
                self.held_cycles = 1;
                self.held_from = count;
            }
        } else {
            self.held_cycles = 0;
        }
        if self.held_cycles >= UNRESPONSIVE_CYCLES {
            self.held_cycles = 0;
            self.distrusted_at = Some(count);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(base: f64, cpu: f64, inflight: u32, weight: f64) -> Input {
        Input {
            base,
            cpu,
            capacity: 0,
            inflight,
            weight,
            warming: false,
        }
    }

    /// Runs `assess` over parallel vectors of inputs and trackers.
    fn run(params: &Params, inputs: &[Input], trackers: &mut [InflightTracker]) -> Vec<f64> {
        for (i, t) in inputs.iter().zip(trackers.iter_mut()) {
            t.observe(i.inflight);
        }
        let mut items: Vec<(Input, &mut InflightTracker)> =
            inputs.iter().copied().zip(trackers.iter_mut()).collect();
        assess(params, &mut items).iter().map(|a| a.load).collect()
    }

    #[test]
    fn the_typical_value_is_the_median_and_of_two_the_smaller() {
        assert_eq!(typical_of(vec![]), None);
        assert_eq!(typical_of(vec![3.0]), Some(3.0));
        assert_eq!(typical_of(vec![10.0, 1.0]), Some(1.0));
        assert_eq!(typical_of(vec![5.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(typical_of(vec![4.0, 1.0, 2.0, 9.0]), Some(3.0));
    }

    #[test]
    fn a_balanced_fleet_is_steered_by_cpu() {
        let p = Params::default();
        // Six nodes, 2 to 4 requests each at equal weights: all within tolerance.
        let inputs: Vec<Input> = [2, 3, 4, 2, 3, 3]
            .iter()
            .map(|&n| input(0.6, 0.6, n, 1.0))
            .collect();
        let mut t = vec![InflightTracker::default(); 6];
        let loads = run(&p, &inputs, &mut t);
        assert!(loads.iter().all(|&l| (l - 0.6).abs() < 1e-12), "{loads:?}");
        assert!(t.iter().all(|t| t.estimate.trusted && !t.estimate.binding));
        assert_eq!(t[0].estimate.derivation, Derivation::FleetRelative);
    }

    /// The hold after a stall: three steps without growth, then growth only to the
    /// probe weight until a node still stalled would have shown 4.6 requests in flight,
    /// at most 30 steps.
    #[test]
    fn a_stall_hold_lasts_until_a_stalled_node_would_have_shown_itself() {
        let mut t = InflightTracker::default();
        let stall = |t: &mut InflightTracker| {
            // Five in flight at weight 0.5: ten per unit of weight.
            t.weights = [0.5; WEIGHT_MEMORY];
            t.last = 5;
            assert_eq!(
                t.hold_after_stall(true),
                None,
                "a stalled node sheds, not held"
            );
            assert!(t.held_after_stall());
        };
        let probe = |h: Option<f64>| h.map(|p| (p - PROBE_COUNT / 10.0).abs() < 1e-12);
        stall(&mut t);
        // At weight 0.025 a node still stalled shows 0.25 a step: 4.5 after 18 steps,
        // 4.75 after 19.
        t.weights = [0.025; WEIGHT_MEMORY];
        for step in 1..=3 {
            assert_eq!(t.hold_after_stall(false), Some(0.0), "step {step}");
        }
        for step in 4..=18 {
            assert_eq!(probe(t.hold_after_stall(false)), Some(true), "step {step}");
        }
        assert_eq!(t.hold_after_stall(false), None, "released at step 19");
        assert!(!t.held_after_stall());
        assert_eq!(t.hold_after_stall(false), None, "and stays released");
        // At the floor a node still stalled shows 0.1 a step: 3 after 30 steps, and
        // the hold ends there anyway. The episode's count per unit of weight is 10.
        stall(&mut t);
        t.weights = [0.01; WEIGHT_MEMORY];
        for step in 1..=3 {
            assert_eq!(t.hold_after_stall(false), Some(0.0), "step {step}");
        }
        for step in 4..=MAX_STALL_HOLD {
            assert_eq!(probe(t.hold_after_stall(false)), Some(true), "step {step}");
        }
        assert_eq!(t.hold_after_stall(false), None, "released at the cap");
    }

    #[test]
    fn a_stalled_node_is_loaded_by_its_excess_whatever_its_weight() {
        let p = Params::default();
        let mut t = vec![InflightTracker::default(); 6];
        // Five healthy nodes at 3 in flight, weight 1; the stalled one holds 20 at
        // weight 1, then 2 at weight 0.1: the same latency, the same verdict.
        for (stalled, w) in [(20, 1.0), (2, 0.1)] {
            let mut inputs: Vec<Input> = (0..5).map(|_| input(0.6, 0.6, 3, 1.0)).collect();
            inputs.push(input(0.05, 0.05, stalled, w));
            let mut fresh = vec![InflightTracker::default(); 6];
            let loads = run(&p, &inputs, &mut fresh);
            // 20/3 = 6.7× typical over the tolerance, times the average CPU, capped.
            let avg = (0.6 * 5.0 + 0.05) / 6.0;
            assert!(
                (loads[5] - (avg * 20.0 / 3.0 / TOLERANCE).min(avg * TERM_CAP)).abs() < 1e-9,
                "{loads:?}"
            );
            assert!(fresh[5].estimate.binding);
            t = fresh;
        }
        assert!(t[5].estimate.ratio > 6.0);
    }

    #[test]
    fn a_fraction_of_a_request_or_a_warming_node_is_not_judged() {
        let p = Params::default();
        let inputs = vec![
            input(0.6, 0.6, 0, 1.0),
            input(0.6, 0.6, 0, 1.0),
            input(0.1, 0.1, 1, 0.1),
        ];
        // A count that smooths to 0.18 (0.3, then an empty sample) is below
        // MIN_INFLIGHT: it does not count.
        let mut t = vec![InflightTracker::default(); 3];
        t[2].smoothed = Some(0.3);
        let mut drained = inputs.clone();
        drained[2].inflight = 0;
        let loads = run(&p, &drained, &mut t);
        assert_eq!(loads[2], 0.1);
        // A warming node's single request at a tenth of the weight is not judged.
        let mut warming = inputs.clone();
        warming[2].warming = true;
        let mut t = vec![InflightTracker::default(); 3];
        let loads = run(&p, &warming, &mut t);
        assert_eq!(loads[2], 0.1);
        assert_eq!(t[2].estimate.term, 0.0);
        // The same node once warm: one request per tenth of a weight against none
        // elsewhere is an excess.
        let mut t = vec![InflightTracker::default(); 3];
        let loads = run(&p, &inputs, &mut t);
        assert!(loads[2] > 0.1, "{loads:?}");
    }

    /// The idle-hands streak counts reports, not cycles: a cycle that assesses the same
    /// report again (a skipped step) does not make one report two in a row, and a report
    /// that finds nothing in flight ends the streak.
    #[test]
    fn the_idle_hands_streak_counts_reports() {
        let p = Params::default();
        // Four healthy nodes at 40 % CPU holding a request per unit of weight; the
        // last one holds two at 1 % CPU.
        let inputs = |held: u32| {
            let mut v = vec![input(0.4, 0.4, 1, 1.0); 4];
            v.push(input(0.01, 0.01, held, 1.0));
            v
        };
        let assess_again = |t: &mut [InflightTracker]| {
            let ins = inputs(2);
            let mut items: Vec<(Input, &mut InflightTracker)> =
                ins.iter().copied().zip(t.iter_mut()).collect();
            assess(&p, &mut items);
        };
        let mut t = vec![InflightTracker::default(); 5];
        run(&p, &inputs(2), &mut t);
        assert!(t[4].estimate.binding, "{:?}", t[4].estimate);
        assert!(!t[4].idle_handed_beyond_doubt(), "one report");
        assess_again(&mut t);
        assert!(
            !t[4].idle_handed_beyond_doubt(),
            "the same report, assessed again"
        );
        run(&p, &inputs(2), &mut t);
        assert!(t[4].idle_handed_beyond_doubt(), "two reports in a row");
        run(&p, &inputs(0), &mut t);
        assert!(!t[4].idle_handed_beyond_doubt(), "a report of none ends it");
        // A gap in its reports breaks the streak too.
        run(&p, &inputs(2), &mut t);
        t[4].break_idle_streak();
        run(&p, &inputs(2), &mut t);
        assert!(
            !t[4].idle_handed_beyond_doubt(),
            "not in a row across a gap"
        );
    }

    #[test]
    fn a_capacity_is_an_absolute_override() {
        let p = Params::default();
        let mut i = input(0.2, 0.2, 8, 1.0);
        i.capacity = 10;
        let mut t = vec![InflightTracker::default()];
        let loads = run(&p, &[i], &mut t);
        assert_eq!(loads[0], 0.8);
        assert_eq!(t[0].estimate.derivation, Derivation::Capacity);
        // Under the CPU metric the count is ignored.
        let cpu_only = Params {
            metric: LoadMetric::Cpu,
            ..Params::default()
        };
        let mut t = vec![InflightTracker::default()];
        assert_eq!(run(&cpu_only, &[i], &mut t)[0], 0.2);
        assert_eq!(t[0].estimate.derivation, Derivation::None);
    }

    /// A count stuck at 13 while the weight falls to the floor and the CPU is idle:
    /// distrusted, then the load is the CPU; a count that then rises with the weight is
    /// trusted again.
    #[test]
    fn a_count_that_does_not_follow_the_weight_is_distrusted() {
        let p = Params::default();
        let mut t = vec![InflightTracker::default(); 4];
        let mut distrusted_at = None;
        let mut w = 1.0;
        for cycle in 0..20 {
            let mut inputs: Vec<Input> = (0..3).map(|_| input(0.6, 0.6, 2, 1.0)).collect();
            inputs.push(input(0.0, 0.0, 13, w));
            let loads = run(&p, &inputs, &mut t);
            if t[3].distrusted() {
                distrusted_at.get_or_insert(cycle);
                assert_eq!(loads[3], 0.0, "cycle {cycle}: the CPU alone");
                assert!(!t[3].estimate.trusted);
            } else {
                assert!(loads[3] > 0.6, "cycle {cycle}: {loads:?}");
            }
            w = (w * 0.5).max(p.min_weight);
        }
        // 1 → 1/8 takes three halvings, then the count holds for three cycles.
        assert_eq!(distrusted_at, Some(3 + UNRESPONSIVE_CYCLES as usize - 1));
        // The weight comes back up and the count climbs with it: a hung node.
        let mut inputs: Vec<Input> = (0..3).map(|_| input(0.6, 0.6, 2, 1.0)).collect();
        inputs.push(input(0.0, 0.0, 40, 0.5));
        for _ in 0..5 {
            run(&p, &inputs, &mut t);
        }
        assert!(!t[3].distrusted() && t[3].estimate.binding);
    }

    /// A stalled node whose requests complete: its count falls with its weight, so it
    /// is never distrusted, and it is not pinned at the floor by a count of zero.
    #[test]
    fn a_count_that_follows_the_weight_stays_trusted() {
        let p = Params::default();
        let mut t = vec![InflightTracker::default(); 4];
        let mut w: f64 = 1.0;
        for _ in 0..30 {
            let mut inputs: Vec<Input> = (0..3).map(|_| input(0.6, 0.6, 2, 1.0)).collect();
            // Latency 10× the others': 20 requests per unit of weight.
            let held = (20.0 * w).round() as u32;
            inputs.push(input(0.0, 0.0, held, w));
            let loads = run(&p, &inputs, &mut t);
            assert!(!t[3].distrusted());
            // A crude controller: down while loaded above the average, up otherwise.
            w = if loads[3] > 0.45 { w * 0.5 } else { w * 1.5 }.clamp(0.01, 10.0);
        }
        assert!(w < 0.2, "the stalled node keeps a small weight: {w}");
    }
}
