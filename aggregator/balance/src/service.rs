//! One service's endpoints and its balancing cycle.

pub use super::endpoints::{Endpoint, EndpointState, Endpoints};

use super::endpoints::Slots;
use super::inflight;
use super::mixture::mix;
use super::normalize::normalize_bounded;
use super::operator::{self, Act, ActError, Action, Actions, Lapsed, Mark, WallMillis};
use super::params::{LoadMetric, Params, Strategy, StrategyWeights};
use super::stats::Spread;
use super::{Millis, Observation};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// How many cycles of history a service keeps for the dashboard.
pub(crate) const HISTORY: usize = 900;

/// A weight that moved less than this (in units of the mean weight) since it was last
/// published is not a material change: rewriting a consensus store for it costs a
/// commit and buys nothing.
pub const MATERIAL_CHANGE: f64 = 0.01;

/// The fleet's load level, as the load-jump rule follows it: the mean without the
/// highest and the lowest load once there are five or more. A real change of level
/// moves every endpoint; one endpoint whose load swings (a broken or hostile agent
/// alternating 0 and 100 %) is the highest or the lowest and is left out, so it cannot
/// make the rule hold the whole service's weights three cycles in four.
fn fleet_level(loads: &[f64]) -> f64 {
    if loads.len() < 5 {
        return loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    }
    let (mut lo, mut hi, mut sum) = (f64::INFINITY, f64::NEG_INFINITY, 0.0);
    for &l in loads {
        lo = lo.min(l);
        hi = hi.max(l);
        sum += l;
    }
    (sum - lo - hi) / (loads.len() - 2) as f64
}

/// The most cycles in a row skipped because the average keeps jumping. Reports lag
/// and are spread over a cycle, so a sudden change can take two or three cycles to show
/// whole; a load that keeps climbing past that is a real trend, and is steered by.
pub(crate) const MAX_JUMP_SKIPS: u32 = 3;

/// Cycles after a run of jump skips during which the level is steered by whatever it
/// does. Real jumps of a service's whole load are rare; one endpoint whose load swings
/// every cycle (a broken or hostile agent) is not, and in a service too small for
/// [`fleet_level`] to leave it out it would otherwise hold the weights three cycles in
/// four. With this rest it holds them at most three in
/// `MAX_JUMP_SKIPS + 1 + JUMP_REST`.
pub(crate) const JUMP_REST: u32 = 8;

/// The fewest missing endpoints that skip a cycle, whatever their share: in a service
/// of six or fewer one silent endpoint is above the missing threshold by itself, and a
/// node that reports once and goes quiet would freeze the rest of the service until it
/// expires.
pub(crate) const MIN_MISSING_TO_SKIP: usize = 2;

/// Why a cycle changed no weights.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum SkipReason {
    /// Just after start: reports are still arriving.
    Grace {
        /// Milliseconds left.
        remaining_ms: u64,
    },
    /// Too many endpoints are missing for the average to be trusted.
    Missing {
        /// The share missing.
        share: f64,
        /// The threshold it exceeds.
        threshold: f64,
    },
    /// The average load is too low to steer by.
    ThinFeedback {
        /// The average load.
        avg: f64,
        /// The floor it is under.
        threshold: f64,
    },
    /// No fresh endpoint is serving.
    NoServingEndpoints,
    /// The last cycle stepped weights straight to the capacity estimate; this cycle's
    /// reports were taken partly before the load balancers applied them.
    Settling,
    /// The fleet's load level jumped since the last cycle; this cycle's reports
    /// straddle it.
    LoadJump {
        /// The last cycle's level: the mean load, without the highest and the lowest
        /// once there are five endpoints or more.
        from: f64,
        /// This cycle's.
        to: f64,
    },
    /// An operator holds the service's weights.
    Held {
        /// When the hold lapses by itself (wall-clock milliseconds since the Unix
        /// epoch); `None` until it is released.
        until_ms: Option<u64>,
    },
}

impl SkipReason {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            SkipReason::Grace { .. } => "grace",
            SkipReason::Missing { .. } => "missing",
            SkipReason::ThinFeedback { .. } => "thin_feedback",
            SkipReason::NoServingEndpoints => "no_serving_endpoints",
            SkipReason::LoadJump { .. } => "load_jump",
            SkipReason::Settling => "settling",
            SkipReason::Held { .. } => "held",
        }
    }

    /// A sentence for the API.
    pub fn describe(&self) -> String {
        match self {
            SkipReason::Grace { remaining_ms } => {
                format!("grace period after start: {remaining_ms} ms left for reports to arrive")
            }
            SkipReason::Missing { share, threshold } => format!(
                "{:.1} % of endpoints missing, more than the {:.1} % threshold: weights held",
                share * 100.0,
                threshold * 100.0
            ),
            SkipReason::ThinFeedback { avg, threshold } => format!(
                "feedback too thin to steer by: average load {avg:.4} is below {threshold:.4}; weights held"
            ),
            SkipReason::NoServingEndpoints => "no fresh endpoint is serving".to_string(),
            SkipReason::Settling => "the last cycle stepped weights to the capacity estimate; \
                 weights are held while the load balancers apply them"
                .to_string(),
            SkipReason::LoadJump { from, to } => format!(
                "average load jumped from {from:.3} to {to:.3}: this cycle's reports \
                 straddle the change, so weights are held for one cycle"
            ),
            SkipReason::Held { until_ms: None } => {
                "an operator holds the weights until they are released".to_string()
            }
            SkipReason::Held {
                until_ms: Some(until),
            } => format!(
                "an operator holds the weights until they are released or until {until} ms \
                 since the Unix epoch"
            ),
        }
    }
}

/// What one cycle did for one service.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CycleResult {
    /// The service.
    pub service: String,
    /// The cycle number, counted per service from 1.
    pub cycle: u64,
    /// `None` if weights were updated, else why not.
    pub skipped: Option<SkipReason>,
    /// Whether the published weights changed materially, so feeds and the store should
    /// be told. A new version number goes with it.
    pub changed: bool,
    /// The spread of load over fresh serving endpoints at the start of the cycle.
    pub spread: Spread,
    /// Share of known endpoints that are missing.
    pub missing_share: f64,
    /// Endpoints forgotten this cycle after a long silence.
    pub expired: Vec<String>,
    /// Endpoints past `expire_ms` that were kept because too much of the service is
    /// silent at once.
    pub expiry_held: usize,
    /// Endpoints forgotten since the last cycle because their node moved: it said
    /// hello to another service and stopped reporting here, or another node took its
    /// address after it stopped reporting.
    pub moved: Vec<String>,
}

/// One cycle's figures, kept for the dashboard and the API.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HistoryPoint {
    /// Cycle number.
    pub cycle: u64,
    /// When it ran.
    #[cfg_attr(feature = "openapi", schema(value_type = u64))]
    pub at: Millis,
    /// The load spread.
    pub spread: Spread,
    /// Whether it was skipped.
    pub skipped: bool,
}

/// Counters and last results of a service, for the API.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceStats {
    /// Cycles run.
    pub cycles: u64,
    /// Cycles that updated weights.
    pub updates: u64,
    /// Skipped cycles by reason label.
    pub skipped: BTreeMap<String, u64>,
    /// Why the last cycle was skipped, if it was.
    pub last_skip: Option<SkipReason>,
    /// The last cycle's spread.
    pub spread: Spread,
    /// The last cycle's missing share.
    pub missing_share: f64,
    /// Whether the feedback is currently too thin to steer by.
    pub thin_feedback: bool,
    /// Feed-forward steps: cycles that moved weights straight to the capacity estimate.
    pub feed_forward_steps: u64,
    /// Feed-forward steps put back because max/avg was worse after them; after one,
    /// the service takes no more steps.
    pub feed_forward_undone: u64,
    /// Times an endpoint's in-flight count was found not to follow its weight and was
    /// distrusted.
    pub inflight_distrusts: u64,
    /// Endpoints whose in-flight count is distrusted now.
    pub inflight_distrusted: usize,
    /// Times an endpoint's CPU was found to keep a floor its weight did not move
    /// (other work on its host or in its cgroup; see [`crate::cpu_floor`]).
    #[serde(default)]
    pub cpu_floors_found: u64,
    /// Endpoints steered by their CPU above such a floor now.
    #[serde(default)]
    pub cpu_floors: usize,
    /// Endpoints silent for longer than `expire_ms` that are kept, with their last
    /// weights, because too much of the service fell silent for the silence to be
    /// believed (see [`Service::cycle`]): the aggregator's view failed, not the fleet.
    #[serde(default)]
    pub expiry_held: usize,
}

/// A service: its endpoints, parameters and counters.
#[derive(Debug, Clone)]
pub struct Service {
    /// The service's name.
    pub name: String,
    /// Its parameters.
    pub params: Params,
    /// Its endpoints, laid out for the cycle (see [`crate::endpoints`]).
    slots: Slots,
    /// Counters and last results.
    pub stats: ServiceStats,
    /// Version of the published weights; increases on every material change.
    pub version: u64,
    /// The cycle whose weights are published.
    pub weights_cycle: u64,
    /// Recent cycles, newest last.
    pub history: VecDeque<HistoryPoint>,
    /// How many endpoints the current version lists (each of them has its
    /// `version_state`): fewer with a state now means some were forgotten since.
    published_count: usize,
    published_cycle: u64,
    /// The last cycle's average load, and how many cycles in a row before it were
    /// skipped for a jump.
    last_avg: Option<(f64, u32)>,
    /// Cycles left of the rest after a run of jump skips ([`JUMP_REST`]).
    jump_rest: u32,
    /// The first cycle at which a feed-forward step may be taken again.
    feed_forward_from: u64,
    /// Weights are held through this cycle after a feed-forward step.
    settle_through: u64,
    /// The largest relative change of a controller weight in the last cycle.
    last_step: f64,
    /// The weights a feed-forward step replaced, until the first update after it shows
    /// whether it helped.
    feed_forward_undo: Option<FeedForwardUndo>,
    /// Endpoints forgotten since the last cycle because their node moved, for its
    /// result.
    moved: Vec<String>,
    /// Which node registered each address, so that a hello's address is checked
    /// without a walk over every endpoint. An entry may be stale (the node left, or
    /// moved address): a lookup checks it against the endpoint, and the map is rebuilt
    /// when it grows past twice the endpoints.
    addresses: HashMap<Arc<str>, Arc<str>>,
    /// Whether any endpoint has ever been established here (a controller update or a
    /// restore): until one has, no newcomer is cold, and a registration need not walk
    /// the endpoints to find that out (a new service of 100,000 registering at once
    /// would otherwise walk them 100,000 times).
    any_established: bool,
    /// What operators set on the service: drains, a hold, pins.
    actions: Actions,
}

/// What a feed-forward step replaced.
#[derive(Debug, Clone, PartialEq)]
struct FeedForwardUndo {
    /// Each stepped endpoint's controller weight before the step.
    weights: BTreeMap<String, f64>,
    /// max/avg of the loads the step was computed from.
    max_over_avg: f64,
    /// Cycles the judgment has waited for the hottest node's queue to drain.
    waited: u64,
}

impl Service {
    /// An empty service.
    pub fn new(name: &str, params: Params) -> Self {
        Service {
            name: name.to_string(),
            params,
            slots: Slots::default(),
            stats: ServiceStats::default(),
            version: 0,
            weights_cycle: 0,
            history: VecDeque::new(),
            published_count: 0,
            published_cycle: 0,
            last_avg: None,
            jump_rest: 0,
            feed_forward_from: 0,
            settle_through: 0,
            last_step: 0.0,
            feed_forward_undo: None,
            moved: Vec::new(),
            addresses: HashMap::new(),
            any_established: false,
            actions: Actions::default(),
        }
    }

    /// Its endpoints, in node order.
    pub fn endpoints(&self) -> Endpoints<'_> {
        self.slots.view()
    }

    /// The endpoint of `node`.
    pub fn endpoint(&self, node: &str) -> Option<Endpoint<'_>> {
        self.slots.view().get(node)
    }

    /// Registers an endpoint, or refreshes the address and zone of a known one. A
    /// newcomer to a fleet that already carries traffic starts at the cold-start
    /// weight, relative to the mean; the first endpoints of a new service start
    /// equal, since there is nobody to take the traffic from.
    pub fn register(&mut self, now: Millis, node: &str, address: &str, zone: &str) {
        let slot = match self.slots.slot(node) {
            Some(slot) => {
                let names = &self.slots.cold[slot].names;
                if *names.address != *address || *names.zone != *zone {
                    let zone = self.slots.zone(zone);
                    self.slots.cold[slot].names.moved(address, zone);
                }
                slot
            }
            None => {
                let fleet_established = self.any_established
                    && self.slots.hot.iter().any(|e| e.established && !e.draining);
                let start = if fleet_established {
                    self.params.cold_start_weight
                } else {
                    1.0
                };
                let slot = self.slots.insert(node, address, zone, now, start);
                self.slots.hot[slot].warming = fleet_established;
                if self.actions.drained(node) {
                    set_draining(&mut self.slots, &self.params, slot, true);
                }
                slot
            }
        };
        self.slots.hot[slot].last_seen = now;
        self.slots.hot[slot].moved = false;
        let cold = &mut self.slots.cold[slot];
        cold.moved_at = None;
        // A new session restarts its sequence numbers.
        cold.last_seq = None;
        self.index_address(slot);
    }

    /// Makes room for `node` at `address`: another endpoint there that has shown no
    /// sign of life for `stale_ms` was replaced (a host renamed, a node moved) and is
    /// forgotten; one still alive keeps it, and the registration is refused.
    pub fn take_address(
        &mut self,
        now: Millis,
        node: &str,
        address: &str,
    ) -> Result<(), crate::BalanceError> {
        let holder = self
            .addresses
            .get(address)
            .filter(|n| ***n != *node)
            .and_then(|n| self.slots.slot(n))
            .filter(|&slot| *self.slots.cold[slot].names.address == *address)
            .map(|slot| {
                (
                    slot,
                    self.slots.cold[slot].names.node.to_string(),
                    self.slots.hot[slot].is_alive(now, &self.params),
                )
            });
        match holder {
            Some((_, holder, true)) => Err(crate::BalanceError::AddressInUse {
                address: address.to_string(),
                holder,
            }),
            Some((slot, holder, false)) => {
                self.slots.remove(slot);
                self.moved.push(holder);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Records that the endpoint in `slot` registered its address (the map shares its
    /// names); rebuilds the map from the endpoints when stale entries have made it
    /// twice their number.
    fn index_address(&mut self, slot: usize) {
        let names = &self.slots.cold[slot].names;
        if self.addresses.get(&*names.address) != Some(&names.node) {
            self.addresses
                .insert(Arc::clone(&names.address), Arc::clone(&names.node));
        }
        if self.addresses.len() > 2 * self.slots.len() + 16 {
            self.reindex_addresses();
        }
    }

    /// The address map, from the endpoints as they are.
    fn reindex_addresses(&mut self) {
        self.addresses = self
            .slots
            .cold
            .iter()
            .map(|c| (Arc::clone(&c.names.address), Arc::clone(&c.names.node)))
            .collect();
    }

    /// Forgets `node`, which moved: its registration elsewhere needed the room. The
    /// next cycle's result names it among [`CycleResult::moved`].
    pub(crate) fn forget_moved_node(&mut self, node: &str) {
        if let Some(slot) = self.slots.slot(node) {
            self.slots.remove(slot);
            self.moved.push(node.to_string());
        }
    }

    /// `node` said hello to another service. Returns true if it has shown no sign of
    /// life here for `stale_ms` and is forgotten now; otherwise it is marked, and
    /// forgotten once it has not, unless it reports or says hello here again.
    pub fn moved_away(&mut self, now: Millis, node: &str) -> bool {
        let Some(slot) = self.slots.slot(node) else {
            return false;
        };
        let ep = &mut self.slots.hot[slot];
        // A drained endpoint freezes nothing by its silence and expires on its own
        // clock: the operator drained it, it did not go missing.
        if ep.draining {
            return false;
        }
        if ep.is_alive(now, &self.params) {
            ep.moved = true;
            self.slots.cold[slot].moved_at = Some(now);
            false
        } else {
            self.slots.remove(slot);
            self.moved.push(node.to_string());
            true
        }
    }

    /// Records a report. Returns false if it is older than one already seen (a
    /// reordered datagram), in which case nothing changes.
    pub fn observe(&mut self, now: Millis, node: &str, obs: Observation) -> Option<bool> {
        self.observe_endpoint(now, node, obs)
            .map(|(accepted, _)| accepted)
    }

    /// [`Service::observe`], with the endpoint as the report left it: one lookup per
    /// report, by hash, not two.
    pub(crate) fn observe_endpoint(
        &mut self,
        now: Millis,
        node: &str,
        obs: Observation,
    ) -> Option<(bool, Endpoint<'_>)> {
        let params = &self.params;
        let slot = self.slots.slot(node)?;
        let cold = &mut self.slots.cold[slot];
        if let (Some(last), Some(seq)) = (cold.last_seq, obs.seq) {
            if seq <= last {
                return Some((false, self.slots.at(slot)));
            }
        }
        if obs.seq.is_some() {
            cold.last_seq = obs.seq;
        }
        cold.moved_at = None;
        let ep = &mut self.slots.hot[slot];
        ep.set_last_report(now);
        ep.last_seen = now;
        ep.moved = false;
        self.slots.obs[slot] = obs;
        let tracker = &mut self.slots.inflight[slot];
        tracker.observe(obs.inflight);
        // Until the next cycle judges the count against the fleet, the load is what the
        // report says on its own.
        ep.load = obs.load(params);
        // An operator's drain holds whatever the agent says.
        let draining = obs.draining || self.actions.drained(node);
        set_draining(&mut self.slots, params, slot, draining);
        Some((true, self.slots.at(slot)))
    }

    /// Runs one cycle at `now`. `grace_until` is when the aggregator's start-up grace
    /// period ends.
    ///
    /// The cycle fails static: losing reports never empties a service. An endpoint
    /// silent for longer than `expire_ms` is forgotten only while the rest of its
    /// service is heard, that is, while some endpoint is fresh and the share of the
    /// others that are silent is within `missing_threshold`. When a large share falls
    /// silent at once, it is the aggregator's view that failed (a partition, blocked
    /// UDP, an expired server certificate), not the fleet: nothing expires, the last
    /// weights stay published, and [`ServiceStats::expiry_held`] says how many are
    /// held so. A draining endpoint carries no traffic and expires on its own clock.
    ///
    /// An endpoint that has not reported since it said hello, or since it was
    /// restored from the store, is not counted as missing: a hello with no report
    /// hides no load, and after a restart the grace period's reports show which
    /// restored endpoints are alive; those that stay silent keep their stored weights
    /// and expire by the rule above, without freezing the rest of the service.
    pub fn cycle(&mut self, now: Millis, grace_until: Millis) -> CycleResult {
        #[cfg(feature = "gate-probe")]
        crate::gate_probe::spin_cycle(self.slots.len());
        self.stats.cycles += 1;
        let cycle = self.stats.cycles;
        // Registrations out of order and removals since the last cycle left the slots
        // out of node order, which every sum below is taken in.
        self.slots.sort();
        let gone = self.forget_gone(now);
        let census = self.take_census(now);
        let spread = Spread::of(&census.loads);
        let level = fleet_level(&census.loads);
        // A stalled node neither drains nor settles: the waits after a feed-forward
        // step (its settling cycles, and its judgment while a queue drains) give way
        // to its shedding. Asked only while one of them may apply, as walking every
        // endpoint costs.
        let waits = self.settling() || self.feed_forward_undo.is_some();
        let shedding = waits && self.any_sheds(now, spread.avg);
        let skipped = self.skip_reason(now, grace_until, &census, spread, level, shedding);
        if !census.loads.is_empty() {
            self.remember_level(skipped, level);
        }
        if shedding && skipped.is_none() {
            // What the loads say of the step is the stall's doing, not the step's. A
            // cycle skipped for another reason leaves the judgment to the next update.
            self.feed_forward_undo = None;
        }
        self.update_weights(now, skipped, spread);
        // Drains and returns take effect even in a skipped cycle: they are operator
        // actions, not inferences from possibly missing data.
        let changed = self.publish_mixture();
        if changed {
            self.version += 1;
        }
        self.record(now, skipped, spread, census.missing_share, gone.expiry_held);
        CycleResult {
            service: self.name.clone(),
            cycle,
            skipped,
            changed,
            spread,
            missing_share: census.missing_share,
            expired: gone.expired,
            expiry_held: gone.expiry_held,
            moved: gone.moved,
        }
    }

    /// Forgets the endpoints silent past `expire_ms` while the rest of the service is
    /// heard (see [`Service::expire`]) and those whose node moved away. One walk says
    /// whether either may apply; most cycles neither does, and each would otherwise
    /// walk every endpoint.
    fn forget_gone(&mut self, now: Millis) -> Gone {
        let (any_past, any_gone) = {
            let params = &self.params;
            self.slots
                .hot
                .iter()
                .fold((false, false), |(past, gone), e| {
                    (
                        past || e.past_expiry(now, params),
                        gone || e.moved_and_stale(now, params),
                    )
                })
        };
        let (expired, expiry_held) = if any_past {
            self.expire(now)
        } else {
            (Vec::new(), 0)
        };
        let moved = self.forget_moved(now, any_gone);
        Gone {
            expired,
            expiry_held,
            moved,
        }
    }

    /// Assesses the loads (see [`Service::assess_loads`]) and, in the walk that
    /// writes them and the in-flight trust, counts the endpoints that are missing and
    /// takes the fresh serving endpoints' loads.
    ///
    /// A draining endpoint is left out: a lame duck whose agent was stopped after the
    /// drain is silent on purpose and carries no traffic, so its silence hides no
    /// load, and maintenance on a few nodes must not freeze the rest. So is one that
    /// has not reported yet (see [`Service::cycle`]).
    fn take_census(&mut self, now: Millis) -> Census {
        let (assessed_slots, assessed) = self.assess_loads(now);
        let params = &self.params;
        let mut assessed = assessed_slots.iter().zip(&assessed).peekable();
        let mut newly = 0u64;
        let mut known = 0usize;
        let mut missing = 0usize;
        let mut distrusted = 0usize;
        let mut loads: Vec<f64> = Vec::with_capacity(self.slots.len());
        for (slot, e) in self.slots.hot.iter_mut().enumerate() {
            if let Some((_, a)) = assessed.next_if(|(&s, _)| s == slot) {
                e.load = a.load;
                e.distrusted = a.distrusted;
                newly += u64::from(a.newly_distrusted);
            }
            distrusted += usize::from(e.distrusted);
            if e.draining {
                continue;
            }
            let fresh = e.is_fresh(now, params);
            if e.last_report().is_some() {
                known += 1;
                missing += usize::from(!fresh);
            }
            if fresh {
                loads.push(e.load);
            }
        }
        self.stats.inflight_distrusts += newly;
        self.stats.inflight_distrusted = distrusted;
        let missing_share = if known == 0 {
            0.0
        } else {
            missing as f64 / known as f64
        };
        Census {
            loads,
            missing_share,
            missing,
        }
    }

    /// Whether this cycle is within the settling cycles of a feed-forward step, during
    /// which the weights are held ([`FEED_FORWARD_SETTLE`]).
    fn settling(&self) -> bool {
        self.stats.cycles <= self.settle_through
    }

    /// Whether a fresh serving endpoint is stalled and sheds its weight at the bound
    /// (see [`sheds_at_bound`]) against the average load `avg`.
    fn any_sheds(&self, now: Millis, avg: f64) -> bool {
        let params = &self.params;
        (0..self.slots.len()).any(|s| {
            let ep = &self.slots.hot[s];
            !ep.draining
                && ep.is_fresh(now, params)
                && sheds_at_bound(&self.slots, s, avg, params.metric)
        })
    }

    /// Why this cycle changes no weights, if it does not: the first of the rules that
    /// holds, in order. The settling cycles after a feed-forward step do not hold
    /// while a node is `shedding` (stalled: see [`Service::any_sheds`]).
    fn skip_reason(
        &self,
        now: Millis,
        grace_until: Millis,
        census: &Census,
        spread: Spread,
        level: f64,
        shedding: bool,
    ) -> Option<SkipReason> {
        let params = &self.params;
        if let Some(hold) = &self.actions.hold {
            Some(SkipReason::Held {
                until_ms: hold.until_ms,
            })
        } else if now < grace_until {
            Some(SkipReason::Grace {
                remaining_ms: grace_until - now,
            })
        } else if census.missing_share > params.missing_threshold
            && census.missing >= MIN_MISSING_TO_SKIP
        {
            Some(SkipReason::Missing {
                share: census.missing_share,
                threshold: params.missing_threshold,
            })
        } else if census.loads.is_empty() {
            Some(SkipReason::NoServingEndpoints)
        } else if self.settling() && !shedding {
            Some(SkipReason::Settling)
        } else if spread.avg < params.thin_load {
            Some(SkipReason::ThinFeedback {
                avg: spread.avg,
                threshold: params.thin_load,
            })
        } else {
            self.jumped(level)
                .map(|from| SkipReason::LoadJump { from, to: level })
        }
    }

    /// Keeps this cycle's load level for the load-jump rule, with how many cycles in a
    /// row before it were skipped for a jump.
    fn remember_level(&mut self, skipped: Option<SkipReason>, level: f64) {
        let run = match (skipped, self.last_avg) {
            (Some(SkipReason::LoadJump { .. }), Some((_, run))) => run + 1,
            _ => 0,
        };
        let run_ended = run == 0 && self.last_avg.is_some_and(|(_, before)| before > 0);
        self.jump_rest = if run_ended {
            JUMP_REST
        } else {
            self.jump_rest.saturating_sub(1)
        };
        self.last_avg = Some((level, run));
    }

    /// Updates the controller weights (or puts back a feed-forward step that did not
    /// help), unless the cycle is skipped; then counts why.
    fn update_weights(&mut self, now: Millis, skipped: Option<SkipReason>, spread: Spread) {
        match skipped {
            None => {
                if !self.undo_feed_forward(spread.max_over_avg) {
                    self.last_step = self.step_pid(now, spread.avg);
                }
                self.stats.updates += 1;
                self.weights_cycle = self.stats.cycles;
            }
            Some(reason) => {
                *self
                    .stats
                    .skipped
                    .entry(reason.label().to_string())
                    .or_insert(0) += 1;
                self.last_step = 0.0;
            }
        }
    }

    /// Keeps the cycle's figures in the stats, and its point in the history.
    fn record(
        &mut self,
        now: Millis,
        skipped: Option<SkipReason>,
        spread: Spread,
        missing_share: f64,
        expiry_held: usize,
    ) {
        self.stats.last_skip = skipped;
        self.stats.spread = spread;
        self.stats.missing_share = missing_share;
        self.stats.expiry_held = expiry_held;
        self.stats.thin_feedback = matches!(skipped, Some(SkipReason::ThinFeedback { .. }));
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(HistoryPoint {
            cycle: self.stats.cycles,
            at: now,
            spread,
            skipped: skipped.is_some(),
        });
    }

    /// Assesses the load of every fresh serving endpoint: its CPU and error penalty,
    /// and its in-flight count judged against the fleet (see [`inflight`]). Returns
    /// their slots, in order, and what was made of each; the caller writes the loads
    /// in its next walk over the endpoints.
    fn assess_loads(&mut self, now: Millis) -> (Vec<usize>, Vec<inflight::Assessed>) {
        let params = &self.params;
        let slots = &mut self.slots;
        let n = slots.len();
        let mut items: Vec<(inflight::Input, &mut inflight::InflightTracker)> =
            Vec::with_capacity(n);
        let mut counts: Vec<inflight::Count> = Vec::with_capacity(n);
        let mut assessed_slots: Vec<usize> = Vec::with_capacity(n);
        // CPU floors (see `cpu_floor`) are judged against the last cycle's average and
        // in-flight verdicts, in this same walk: a cycle's lag, where they take several.
        let judge_floors = params.metric != LoadMetric::Inflight;
        let last_avg = self.stats.spread.avg;
        let (mut floors, mut floors_found) = (0usize, 0u64);
        for (slot, (((ep, obs), tracker), floor)) in slots
            .hot
            .iter()
            .zip(&slots.obs)
            .zip(slots.inflight.iter_mut())
            .zip(slots.cpu_floor.iter_mut())
            .enumerate()
        {
            if ep.draining || !ep.is_fresh(now, params) {
                tracker.break_idle_streak();
                continue;
            }
            let reported = crate::load::sanitize(obs.cpu);
            // Each report once: a cycle that finds no new one (a skipped step, a lost
            // report) would count the same reading again.
            if judge_floors && tracker.has_news() {
                let steady = !ep.warming && !tracker.estimate.binding;
                // A report's window straddles the last publication: about half of it
                // ran at the weight before.
                let before = tracker.applied_weight();
                let weight = if before > 0.0 {
                    (ep.weight + before) / 2.0
                } else {
                    ep.weight
                };
                floors_found += u64::from(floor.judge(reported, weight, last_avg, steady));
            }
            floors += usize::from(floor.floor().is_some());
            // The service's own CPU, above any floor its weight did not move.
            let cpu = floor.own(reported);
            let input = inflight::Input {
                base: obs.base_load_of(params, cpu),
                cpu,
                capacity: obs.capacity,
                inflight: obs.inflight,
                weight: ep.weight,
                warming: ep.warming,
            };
            // The tracker takes in this cycle's weight in this same walk.
            counts.push(inflight::take_in(&input, tracker));
            items.push((input, tracker));
            assessed_slots.push(slot);
        }
        let assessed = inflight::assess_counted(params, &mut items, &counts);
        self.stats.cpu_floors = floors;
        self.stats.cpu_floors_found += floors_found;
        (assessed_slots, assessed)
    }

    /// The last level, if `avg` (this cycle's [`fleet_level`]) jumped away from it,
    /// the run of jump skips is not yet at its limit, and no rest after the last run
    /// is under way.
    fn jumped(&self, avg: f64) -> Option<f64> {
        let threshold = self.params.jump_threshold;
        let (from, run) = self.last_avg?;
        let moved = (avg - from).abs() / from.max(f64::MIN_POSITIVE);
        let resting = self.jump_rest > 0;
        (threshold > 0.0
            && run < MAX_JUMP_SKIPS
            && !resting
            && from.is_finite()
            && moved > threshold)
            .then_some(from)
    }

    /// Forgets the endpoints whose node said hello to another service and has gone
    /// stale here since; returns them with those forgotten since the last cycle for
    /// the same reason (by a hello elsewhere, or by another node taking the address).
    /// `any_gone` says whether any endpoint may qualify; without one the walk is skipped.
    fn forget_moved(&mut self, now: Millis, any_gone: bool) -> Vec<String> {
        let params = &self.params;
        let mut gone = Vec::new();
        if any_gone {
            let marks: Vec<bool> = self
                .slots
                .hot
                .iter()
                .map(|e| e.moved_and_stale(now, params))
                .collect();
            for (cold, _) in self.slots.cold.iter().zip(&marks).filter(|(_, m)| **m) {
                gone.push(cold.names.node.to_string());
            }
            self.slots.remove_marked(&marks);
        }
        let mut moved = std::mem::take(&mut self.moved);
        moved.extend(gone);
        moved
    }

    /// Forgets the endpoints silent for longer than `expire_ms` while the rest of the
    /// service is heard (see [`Service::cycle`]). Returns those forgotten and how
    /// many were held instead.
    fn expire(&mut self, now: Millis) -> (Vec<String>, usize) {
        let params = &self.params;
        let hot = &self.slots.hot;
        let active = hot.iter().filter(|e| !e.draining).count();
        let fresh = hot
            .iter()
            .filter(|e| !e.draining && e.is_fresh(now, params))
            .count();
        let silent = active - fresh;
        // The share of the others that are silent, seen from one silent endpoint.
        let others_silent = if active > 1 {
            silent.saturating_sub(1) as f64 / (active - 1) as f64
        } else {
            1.0
        };
        let heard = fresh > 0 && others_silent <= params.missing_threshold;
        let mut gone = Vec::new();
        let mut marks = vec![false; hot.len()];
        let mut held = 0;
        for (slot, e) in hot.iter().enumerate() {
            if !e.past_expiry(now, params) {
                continue;
            }
            if e.draining || heard {
                gone.push(self.slots.cold[slot].names.node.to_string());
                marks[slot] = true;
            } else {
                held += 1;
            }
        }
        if !gone.is_empty() {
            self.slots.remove_marked(&marks);
        }
        (gone, held)
    }

    /// One controller step; returns the largest relative change of a controller weight.
    fn step_pid(&mut self, now: Millis, avg: f64) -> f64 {
        let split = self.split_by_news(now);
        let stepped = if self.feed_forward_due(&split, avg) {
            self.step_feed_forward(now, &split.fresh, avg)
        } else {
            self.step_controllers(now, &split.fresh, split.serving, avg)
        };
        self.any_established |= !split.fresh.is_empty();
        self.share_out(split, stepped)
    }

    /// The serving endpoints, split into those with news, which the step updates, and
    /// those it holds. Only a report newer than the last update says anything new: an
    /// endpoint whose report was lost holds its weight, like a missing one, instead of
    /// having its last error applied a second time.
    fn split_by_news(&self, now: Millis) -> Split {
        let all = self.slots.len();
        let mut split = Split {
            fresh: Vec::with_capacity(all),
            fresh_before: Vec::with_capacity(all),
            held: Vec::new(),
            held_before: Vec::new(),
            serving: 0,
        };
        for (slot, ep) in self.slots.hot.iter().enumerate() {
            if ep.draining {
                continue;
            }
            split.serving += 1;
            if let Some(pin) = self.actions.pinned(&self.slots.cold[slot].names.node) {
                // A pinned endpoint keeps its weight; the others share what is left.
                split.held_before.push(pin);
                split.held.push(slot);
                continue;
            }
            let has_news = match (ep.last_report(), ep.last_update()) {
                (Some(r), Some(u)) => r > u,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if ep.is_fresh(now, &self.params) && has_news {
                split
                    .fresh_before
                    .push(ep.strategy_weights.get(Strategy::Pid));
                split.fresh.push(slot);
            } else {
                split
                    .held_before
                    .push(ep.strategy_weights.get(Strategy::Pid));
                split.held.push(slot);
            }
        }
        split
    }

    /// Whether this step is a feed-forward step: configured, nothing held, the weights
    /// steady, past the hold-off of the last one, and the loads fit to estimate
    /// capacities from (see [`feed_forward_applies`]).
    fn feed_forward_due(&self, split: &Split, avg: f64) -> bool {
        self.params.feed_forward
            && split.held.is_empty()
            && self.last_step < FEED_FORWARD_STEADY
            && self.stats.cycles >= self.feed_forward_from
            && feed_forward_applies(&self.slots, &split.fresh, avg)
    }

    /// The feed-forward step: each endpoint's capacity is about its weight over its
    /// load, so the `fresh` endpoints step straight to weights in that proportion, and
    /// the controllers trim from there. What the step replaces is kept, to be put back
    /// if it made things worse. Returns the stepped weights, in the order of `fresh`.
    fn step_feed_forward(&mut self, now: Millis, fresh: &[usize], avg: f64) -> Vec<f64> {
        let params = &self.params;
        let slots = &mut self.slots;
        let cycle = self.stats.cycles;
        self.feed_forward_undo = Some(FeedForwardUndo {
            weights: fresh
                .iter()
                .map(|&s| {
                    (
                        slots.cold[s].names.node.to_string(),
                        slots.hot[s].strategy_weights.get(Strategy::Pid),
                    )
                })
                .collect(),
            max_over_avg: fresh.iter().map(|&s| slots.hot[s].load).fold(0.0, f64::max) / avg,
            waited: 0,
        });
        // Where the in-flight term stands out against the fleet the estimate divides
        // by the CPU (and errors) instead: an overloaded node queues requests, which
        // says it is over capacity but not by how much, while its CPU says how much
        // of its capacity the traffic used.
        let loads: Vec<f64> = fresh
            .iter()
            .map(|&s| {
                let estimate = &slots.inflight[s].estimate;
                let queued =
                    estimate.binding && estimate.derivation == inflight::Derivation::FleetRelative;
                if queued && params.metric == crate::LoadMetric::Max {
                    slots.obs[s].base_load_of(params, slots.own_cpu(s))
                } else {
                    slots.hot[s].load
                }
            })
            .collect();
        let base_avg = loads.iter().sum::<f64>() / fresh.len() as f64;
        let mut stepped: Vec<f64> = Vec::with_capacity(fresh.len());
        for (&s, load) in fresh.iter().zip(&loads) {
            let factor = (base_avg / load.max(f64::MIN_POSITIVE))
                .clamp(1.0 / FEED_FORWARD_MAX, FEED_FORWARD_MAX);
            let ep = &mut slots.hot[s];
            let w = ep.strategy_weights.get(Strategy::Pid) * factor;
            ep.strategy_weights.set(Strategy::Pid, w);
            stepped.push(w);
            ep.set_last_update(Some(now));
            ep.established = true;
            slots.pid[s].reset();
        }
        self.stats.feed_forward_steps += 1;
        self.settle_through = cycle + FEED_FORWARD_SETTLE;
        self.feed_forward_from = cycle + FEED_FORWARD_HOLDOFF;
        stepped
    }

    /// The controllers' step: each of the `fresh` endpoints' PID moves its weight by
    /// its error against the average, within the growth and shrink bounds; a stalled
    /// one shrinks by the bound, and its share does not grow for a while after (see
    /// [`inflight::InflightTracker::hold_after_stall`]). Returns the stepped weights,
    /// in the order of `fresh`.
    fn step_controllers(
        &mut self,
        now: Millis,
        fresh: &[usize],
        serving: usize,
        avg: f64,
    ) -> Vec<f64> {
        let params = &self.params;
        // Weights have a mean of 1 over the serving endpoints.
        let probe_cap = inflight::PROBE_SHARE * serving as f64;
        let slots = &mut self.slots;
        let lo = params.max_shrink - 1.0;
        let hi = params.max_growth - 1.0;
        // The steps of those not held are taken at once; the held ones (rarely any)
        // are settled after, against the others' mean step.
        let mut stepped: Vec<f64> = Vec::with_capacity(fresh.len());
        let mut held: Vec<(usize, f64, f64)> = Vec::new();
        let (mut moved, mut moved_weight) = (0.0, 0.0);
        for (i, &s) in fresh.iter().enumerate() {
            let stalled = sheds_at_bound(slots, s, avg, params.metric);
            let hold = slots.inflight[s]
                .hold_after_stall(stalled)
                .map(|probe| probe.min(probe_cap));
            let ep = &mut slots.hot[s];
            let pid = &mut slots.pid[s];
            let error = (avg - ep.load) / avg;
            let dt = ep
                .last_update()
                .map(|t| now.saturating_sub(t) as f64 / params.cycle_ms as f64)
                .unwrap_or(1.0);
            let delta = pid.update(&params.pid, error, dt, (lo, hi));
            // A stalled node holds each request as long whatever its weight (its count
            // per unit of weight is its latency), so a proportional step gains nothing
            // by being gentle: it sheds at the fastest rate the bounds allow for as long
            // as the stall lasts.
            match (stalled, hold) {
                (false, Some(probe)) => {
                    held.push((i, delta, probe));
                    stepped.push(0.0);
                }
                _ => {
                    let delta = if stalled { lo } else { delta };
                    let w = slots.hot[s].strategy_weights.get(Strategy::Pid);
                    moved += w * (1.0 + delta);
                    moved_weight += w;
                    stepped.push(take_step(slots, s, delta, now, avg));
                }
            }
        }
        // A held node's share must not grow (beyond the probe weight): its weight moves
        // at most by the others' mean step. Holding the weight itself is not enough:
        // the stalled node's idle CPU pulls the average down, every healthy node reads
        // above it and shrinks by the same step, and normalisation would hand that
        // step to the held node.
        let others = if moved_weight > 0.0 {
            moved / moved_weight - 1.0
        } else {
            0.0
        };
        for (i, delta, probe) in held {
            let Some(&s) = fresh.get(i) else { continue };
            // Up to the probe weight, in the units the load balancers apply
            // (normalisation then scales it by about 1 / (1 + others): a little above
            // the probe while the others shrink). When the stall is confirmed, a weight
            // above the probe is brought down to it within the shrink bound: the probe
            // is what a node that may still be stalled is trusted with. In the first
            // steps of the hold, where it may not grow at all, that is the probe's
            // share: left where its last verdict cut it, a node cut from a third of a
            // gRPC service's calls sat at 3 % and then 1.6 % of them for three steps
            // each, between reports that found nothing in flight at that weight.
            let tracker = &slots.inflight[s];
            let applied = tracker.applied_weight().max(f64::MIN_POSITIVE);
            let to_probe = probe / applied - 1.0;
            let trusted_with = if probe > 0.0 { probe } else { probe_cap };
            let to_trusted = trusted_with / applied - 1.0;
            let bound = if to_trusted < 0.0 && tracker.stall_confirmed() {
                to_trusted.max(lo)
            } else {
                others.min(0.0).max(to_probe)
            };
            let delta = delta.min(bound);
            if let Some(w) = stepped.get_mut(i) {
                *w = take_step(slots, s, delta, now, avg);
            }
        }
        stepped
    }

    /// Normalises the step's weights and writes them; returns the largest relative
    /// change of a controller weight.
    ///
    /// Held endpoints (missing, or without a new report) keep their weights: the
    /// updated ones share what is left of a mean weight of 1. When that cannot be
    /// done within the bounds, normalisation wins and everyone is rescaled.
    /// The held weights are as they were before the step.
    fn share_out(&mut self, split: Split, stepped: Vec<f64>) -> f64 {
        let params = &self.params;
        let Split {
            fresh,
            fresh_before,
            held,
            held_before,
            serving,
        } = split;
        let held_sum: f64 = held_before.iter().sum();
        let target = serving as f64 - held_sum;
        let n = fresh.len() as f64;
        let feasible =
            !fresh.is_empty() && target >= n * params.min_weight && target <= n * params.max_weight;
        let (group, before, mut ws): (Vec<usize>, Vec<f64>, Vec<f64>) = if feasible {
            (fresh, fresh_before, stepped)
        } else {
            (
                fresh.into_iter().chain(held).collect(),
                fresh_before.iter().chain(&held_before).copied().collect(),
                stepped.into_iter().chain(held_before).collect(),
            )
        };
        let target = if feasible { target } else { serving as f64 };
        normalize_bounded(&mut ws, target, params.min_weight, params.max_weight);
        // Endpoints outside the group (draining, or held while the others could make
        // room) kept their weights.
        let mut step: f64 = 0.0;
        for ((&s, w), b) in group.iter().zip(ws).zip(before) {
            self.slots.hot[s].strategy_weights.set(Strategy::Pid, w);
            step = step.max((w / b.max(f64::MIN_POSITIVE) - 1.0).abs());
        }
        step
    }
}

/// What a cycle forgot, and what it held instead of forgetting.
struct Gone {
    /// Endpoints silent past `expire_ms` and forgotten.
    expired: Vec<String>,
    /// Endpoints silent past `expire_ms` but held (see [`ServiceStats::expiry_held`]).
    expiry_held: usize,
    /// Endpoints forgotten because their node moved.
    moved: Vec<String>,
}

/// The serving endpoints as one cycle finds them.
struct Census {
    /// The fresh serving endpoints' loads, in node order.
    loads: Vec<f64>,
    /// The share of the serving endpoints that have reported and are not fresh.
    missing_share: f64,
    /// How many they are.
    missing: usize,
}

/// The serving endpoints of one controller step: those with news, which it updates,
/// and those it holds, each with its controller weight before the step.
struct Split {
    /// The updated endpoints' slots.
    fresh: Vec<usize>,
    /// Their controller weights before the step, to tell how far it moved them.
    fresh_before: Vec<f64>,
    /// The held endpoints' slots.
    held: Vec<usize>,
    /// Their controller weights, which they keep.
    held_before: Vec<f64>,
    /// Serving (not draining) endpoints in all.
    serving: usize,
}

/// A feed-forward step moves no weight by more than this factor: a load near zero says
/// little about how much more the endpoint could take.
pub(crate) const FEED_FORWARD_MAX: f64 = 2.0;
/// A step is kept if the first update after it finds max/avg's excess over 1 at most
/// this share of what it was before the step.
pub(crate) const FEED_FORWARD_KEEP: f64 = 0.5;

/// Cycles at most that the judgment of a feed-forward step waits while the hottest
/// node's in-flight term binds: a node saturated before the step reads 100 % until its
/// queue has drained, whatever its new weight, and judging the step then undoes a step
/// that was right.
pub(crate) const FEED_FORWARD_JUDGE_WAIT: u64 = 3;
/// Feed-forward needs an average load of at least this: enough traffic for the loads
/// to say how each endpoint's capacity compares.
pub(crate) const FEED_FORWARD_MIN_AVG: f64 = 0.1;
/// ...and a spread at least this wide (the mean relative distance from the average):
/// near balance the controllers trim better than an estimate, and one noisy endpoint
/// among many must not trigger a step.
pub(crate) const FEED_FORWARD_MIN_SPREAD: f64 = 0.1;
/// ...and weights that held still in the cycle the loads were measured in (no weight
/// moved by more than this share): a load measured under other weights than the ones
/// in force says nothing about the capacity behind them.
pub(crate) const FEED_FORWARD_STEADY: f64 = 0.05;
/// Cycles after a feed-forward step whose weights are held: their reports were taken
/// partly before the load balancers applied the step. A new weight reaches the load
/// balancers within a report interval or a health-check interval, and shows in the
/// load a report later, so two cycles.
pub const FEED_FORWARD_SETTLE: u64 = 2;
/// Cycles after a feed-forward step before another may be taken: the controllers trim
/// the first one, and a second would undo their work.
pub(crate) const FEED_FORWARD_HOLDOFF: u64 = 10;

/// Moves endpoint `s`'s controller weight by `delta` in the step at `now`, and
/// returns it; ends its ramp once a newcomer carries its share of `avg`.
fn take_step(slots: &mut Slots, s: usize, delta: f64, now: Millis, avg: f64) -> f64 {
    let ep = &mut slots.hot[s];
    let w = ep.strategy_weights.get(Strategy::Pid) * (1.0 + delta);
    ep.strategy_weights.set(Strategy::Pid, w);
    ep.set_last_update(Some(now));
    ep.established = true;
    // The ramp ends once the newcomer carries its share; its integral, built up on
    // the way, would otherwise carry it past the average.
    if ep.warming && ep.load >= avg * 0.95 {
        ep.warming = false;
        slots.pid[s].integral = 0.0;
    }
    w
}

/// Whether the endpoint in `slot` is stalled beyond doubt, so that it sheds at the
/// shrink bound and is held after ([`Service::step_controllers`]): [`stalled`], with its
/// hands idle, not merely below the average, and under `max` its count above the
/// tolerance, or its requests held with idle hands report after report
/// ([`inflight::IDLE_HANDED_STREAK`]). Scaled to the fleet's load, the term of a count
/// within the tolerance binds on any node far below the mean weight, whose CPU is idle
/// for want of traffic: a healthy node growing back from a small weight would be judged
/// stalled, and held, whenever a report found a request in flight.
///
/// Idle hands: its CPU below a quarter of the fleet's average, or its count per unit of
/// CPU far above the typical one ([`inflight::InflightTracker::idle_handed`]). A node
/// that does next to nothing is one; so is one whose CPU goes on what arrives rather
/// than on what it holds. A stalled gRPC server still decodes every call it receives
/// and starts its handler: at a third of a service's calls that kept its CPU above the
/// quarter for the first seconds of a stall, while the node held many times the typical
/// count per unit of CPU, and it shed by a fifth a cycle instead of by half.
fn sheds_at_bound(slots: &Slots, slot: usize, avg: f64, metric: crate::LoadMetric) -> bool {
    let tracker = &slots.inflight[slot];
    let piled_up = metric != crate::LoadMetric::Max
        || tracker.estimate.ratio >= inflight::TOLERANCE
        || tracker.idle_handed_beyond_doubt();
    let idle = slots.own_cpu(slot) < inflight::IDLE_CPU * avg || tracker.idle_handed();
    stalled(slots, slot, avg) && piled_up && idle
}

/// Whether the endpoint in `slot` is stalled: its trusted in-flight count stands out
/// against the fleet (the term binds) while its CPU is below the average `avg`. One
/// whose CPU is high as well is merely overloaded.
fn stalled(slots: &Slots, slot: usize, avg: f64) -> bool {
    let estimate = &slots.inflight[slot].estimate;
    estimate.binding
        && estimate.derivation == inflight::Derivation::FleetRelative
        && slots.own_cpu(slot) < avg
}

/// Whether the fresh endpoints' loads can be trusted to estimate capacities: every one
/// has a new report (the caller checks that none is held), none is ramping up from a
/// cold start, stalled (its in-flight count stands out against the fleet while its
/// CPU is below the average: its capacity is not its weight over its load) or held
/// after a stall, the average is high enough and the spread wide enough.
fn feed_forward_applies(slots: &Slots, fresh: &[usize], avg: f64) -> bool {
    if fresh.is_empty() || avg < FEED_FORWARD_MIN_AVG {
        return false;
    }
    // A node whose in-flight count stands out while its CPU is below the average is
    // stalled, and its weight over its load is no capacity: no step while any is, or
    // is held after a stall (its few requests may all have completed at a report, and
    // its idle CPU would read as room for twice its weight). One whose CPU is high as
    // well is merely overloaded, and the step is what it needs.
    let calm = fresh.iter().all(|&s| {
        let inflight = &slots.inflight[s];
        !slots.hot[s].warming
            && !stalled(slots, s, avg)
            && !inflight.held_after_stall()
            && !inflight.distrusted()
    });
    let spread = fresh
        .iter()
        .map(|&s| (slots.hot[s].load - avg).abs() / avg)
        .sum::<f64>()
        / fresh.len() as f64;
    calm && spread >= FEED_FORWARD_MIN_SPREAD
}

impl Service {
    /// At the first update after a feed-forward step: if the step did not close at
    /// least half of the excess of max/avg over 1 (traffic that does not follow the
    /// weights, such as clients that each see a subset of the endpoints, defeats the
    /// estimate), put the old weights back and take no more steps for this service.
    /// While the hottest stepped node's in-flight term binds (its queue, built before
    /// the step, is still draining), the judgment waits, weights held, for at most
    /// [`FEED_FORWARD_JUDGE_WAIT`] cycles. A node that sheds as stalled in an update
    /// before the judgment drops it (see [`Service::cycle`]): the stall moved the loads.
    /// Returns whether it took this cycle's update (an undo, or a wait).
    fn undo_feed_forward(&mut self, max_over_avg: f64) -> bool {
        let Some(mut undo) = self.feed_forward_undo.take() else {
            return false;
        };
        if max_over_avg - 1.0 <= FEED_FORWARD_KEEP * (undo.max_over_avg - 1.0) {
            return false;
        }
        if undo.waited < FEED_FORWARD_JUDGE_WAIT && self.hottest_queue_binds(&undo) {
            undo.waited += 1;
            self.feed_forward_undo = Some(undo);
            return true;
        }
        for (node, w) in &undo.weights {
            if let Some(slot) = self.slots.slot(node) {
                self.slots.hot[slot].strategy_weights.set(Strategy::Pid, *w);
                self.slots.pid[slot].reset();
            }
        }
        self.stats.feed_forward_undone += 1;
        self.feed_forward_from = u64::MAX;
        true
    }

    /// Whether the in-flight term binds for the most loaded of the nodes a step moved.
    fn hottest_queue_binds(&self, undo: &FeedForwardUndo) -> bool {
        undo.weights
            .keys()
            .filter_map(|node| self.slots.slot(node))
            .max_by(|&a, &b| self.slots.hot[a].load.total_cmp(&self.slots.hot[b].load))
            .is_some_and(|s| self.slots.inflight[s].estimate.binding)
    }

    /// Sets every endpoint's published weight from its strategies' (0 when draining),
    /// and says whether the weights moved materially since the current version or the
    /// set of endpoints changed; if so, they become the next version's. One pass over
    /// the endpoints that allocates nothing: from the first endpoint that moved on, it
    /// also makes each one's weights the new version's, so that a second pass covers
    /// only those before it (or all, when only the set of endpoints changed).
    fn publish_mixture(&mut self) -> bool {
        let gates = &self.params.strategies;
        let actions = &self.actions;
        let cold = &self.slots.cold;
        let mut listed = 0usize;
        let mut moved_from: Option<usize> = None;
        for (slot, (ep, version)) in self
            .slots
            .hot
            .iter_mut()
            .zip(self.slots.version.iter_mut())
            .enumerate()
        {
            ep.weight = if ep.draining {
                0.0
            } else if let Some(pin) = actions.pinned(&cold[slot].names.node) {
                pin
            } else {
                let strategies = ep.strategy_weights;
                mix(gates, |s| strategies.get(s))
            };
            if moved_from.is_none() {
                let moved = match version.state {
                    Some((pw, pd)) => {
                        listed += 1;
                        pd != ep.draining || (ep.weight - pw).abs() >= MATERIAL_CHANGE
                    }
                    None => true,
                };
                if moved {
                    moved_from = Some(slot);
                }
            }
            if moved_from.is_some() {
                version.state = Some((ep.weight, ep.draining));
                version.strategies = ep.strategy_weights;
            }
        }
        let upto = match moved_from {
            Some(slot) => slot,
            None if listed != self.published_count => self.slots.len(),
            None => return false,
        };
        self.mark_published(upto);
        self.published_cycle = self.weights_cycle;
        true
    }

    /// Makes the live weights of the endpoints before slot `upto` those of the
    /// current version (the others' are already), and counts every endpoint listed.
    fn mark_published(&mut self, upto: usize) {
        for (e, version) in self
            .slots
            .hot
            .iter()
            .zip(self.slots.version.iter_mut())
            .take(upto)
        {
            version.state = Some((e.weight, e.draining));
            version.strategies = e.strategy_weights;
        }
        self.published_count = self.slots.len();
    }

    /// Every endpoint with its weight, drain state and strategy weights as of the
    /// current version (its live ones if it registered since), in node order.
    pub(crate) fn published_endpoints(
        &self,
    ) -> impl Iterator<Item = (Endpoint<'_>, (f64, bool), StrategyWeights)> + '_ {
        self.slots.view().iter().map(|ep| {
            let hot = ep.hot();
            match ep.version() {
                crate::endpoints::Version {
                    state: Some(state),
                    strategies,
                } => (ep, *state, *strategies),
                _ => (ep, (hot.weight, hot.draining), hot.strategy_weights),
            }
        })
    }

    /// An endpoint's weight and drain state as of the current version: what feeds publish.
    /// Live weights drift below the material-change threshold between versions; a
    /// version always names one set.
    /// An endpoint registered since the last version shows its live state.
    pub fn published(&self, ep: &Endpoint<'_>) -> (f64, bool) {
        ep.published()
    }

    /// The cycle the current version's weights came from.
    pub fn published_cycle(&self) -> u64 {
        self.published_cycle
    }

    /// Puts restored endpoints back as they were stored, to be served as they are
    /// until reports arrive. They are not cold: their weights were earned. Until one
    /// reports it is not counted as missing, and it expires only by the fail-static
    /// rule of [`Service::cycle`].
    pub fn restore(&mut self, now: Millis, snapshot: &ServiceSnapshot) {
        self.version = snapshot.version;
        // Cycle numbers go on from where they were, so that a reply's cycle never
        // goes backwards across a restart (and 0 keeps meaning "no weights yet").
        self.weights_cycle = snapshot.cycle;
        self.stats.cycles = snapshot.cycle;
        for (node, s) in &snapshot.endpoints {
            let slot = match self.slots.slot(node) {
                Some(slot) => {
                    self.slots.reset(slot, &s.address, &s.zone, now, s.weight);
                    slot
                }
                None => self.slots.insert(node, &s.address, &s.zone, now, s.weight),
            };
            let ep = &mut self.slots.hot[slot];
            ep.warming = false;
            ep.established = true;
            ep.draining = s.draining;
            ep.weight = s.weight;
            for (k, v) in &s.strategy_weights {
                ep.strategy_weights.set(*k, *v);
            }
        }
        self.actions = snapshot.operator.clone();
        for node in self.actions.drains.keys() {
            if let Some(slot) = self.slots.slot(node) {
                set_draining(&mut self.slots, &self.params, slot, true);
            }
        }
        self.slots.sort();
        self.reindex_addresses();
        self.any_established |= !snapshot.endpoints.is_empty();
        self.published_cycle = snapshot.cycle;
        self.mark_published(self.slots.len());
    }
}

impl Observation {
    /// The load without the in-flight term: the CPU (unless the metric ignores it) plus
    /// the error penalty. The cycle adds the in-flight term, judged against the fleet.
    pub fn base_load(&self, params: &Params) -> f64 {
        self.base_load_of(params, self.cpu)
    }

    /// [`Self::base_load`] with `cpu` in place of the reported CPU.
    pub(crate) fn base_load_of(&self, params: &Params, cpu: f64) -> f64 {
        let cpu = match params.metric {
            LoadMetric::Inflight => 0.0,
            LoadMetric::Max | LoadMetric::Cpu => cpu,
        };
        crate::load::combine(cpu, 0, 0, self.error_rate, params.error_penalty)
    }

    /// The load this report shows on its own: its CPU, its in-flight count over its
    /// capacity if it has one, and the error penalty, under `params`' metric.
    pub fn load(&self, params: &Params) -> f64 {
        let (cpu, inflight, capacity) = match params.metric {
            LoadMetric::Max => (self.cpu, self.inflight, self.capacity),
            LoadMetric::Cpu => (self.cpu, 0, 0),
            LoadMetric::Inflight => (0.0, self.inflight, self.capacity),
        };
        crate::load::combine(
            cpu,
            inflight,
            capacity,
            self.error_rate,
            params.error_penalty,
        )
    }
}

/// A service as the routing store keeps it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ServiceSnapshot {
    /// Version of the weights.
    pub version: u64,
    /// The cycle they came from.
    pub cycle: u64,
    /// Endpoints by node.
    pub endpoints: BTreeMap<String, EndpointSnapshot>,
    /// What operators set on the service, so that it holds across a restart and a
    /// change of owner.
    #[serde(default)]
    pub operator: Actions,
}

/// An endpoint as the routing store keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointSnapshot {
    /// `host:port`.
    pub address: String,
    /// Zone.
    #[serde(default)]
    pub zone: String,
    /// Lame duck.
    #[serde(default)]
    pub draining: bool,
    /// The published (mixed) weight.
    pub weight: f64,
    /// Each strategy's own weight.
    #[serde(default)]
    pub strategy_weights: BTreeMap<Strategy, f64>,
}

/// Turns the endpoint in `slot` draining or back. A return is cold, as a newcomer: its
/// weight ramps up from the cold-start weight.
fn set_draining(slots: &mut Slots, params: &Params, slot: usize, draining: bool) {
    let ep = &mut slots.hot[slot];
    if draining && !ep.draining {
        ep.draining = true;
        ep.weight = 0.0;
    } else if !draining && ep.draining {
        ep.draining = false;
        ep.warming = true;
        ep.set_last_update(None);
        ep.distrusted = false;
        ep.strategy_weights
            .set(Strategy::Pid, params.cold_start_weight);
        slots.pid[slot].reset();
        slots.inflight[slot].reset();
        slots.cpu_floor[slot].reset();
    }
}

impl Service {
    /// What operators set on the service.
    pub fn actions(&self) -> &Actions {
        &self.actions
    }

    /// Carries out an operator's action (see [`crate::operator`]). It shows in the
    /// next publication: the weights of every endpoint are set again, and the
    /// version goes up, so that every feed and the routing store take it.
    pub fn act(&mut self, act: &Act) -> Result<(), ActError> {
        operator::check(act)?;
        let mark = |until_ms| Mark {
            by: act.by.clone(),
            reason: act.reason.clone(),
            since_ms: act.at,
            until_ms,
        };
        match &act.action {
            Action::Drain { node } => {
                let slot = self.known(node)?;
                self.actions.drains.insert(node.clone(), mark(None));
                set_draining(&mut self.slots, &self.params, slot, true);
            }
            Action::Undrain { node } => {
                if self.actions.drains.remove(node).is_none() {
                    return Err(ActError::NotInForce(format!(
                        "node {node:?} of service {:?} is not drained by an operator",
                        self.name
                    )));
                }
                if let Some(slot) = self.slots.slot(node) {
                    // Back to what its agent last said.
                    let wants = self.slots.obs[slot].draining;
                    set_draining(&mut self.slots, &self.params, slot, wants);
                }
            }
            Action::Hold { until_ms } => {
                self.actions.hold = Some(mark(*until_ms));
            }
            Action::Release => {
                if self.actions.hold.take().is_none() {
                    return Err(ActError::NotInForce(format!(
                        "service {:?} is not held",
                        self.name
                    )));
                }
            }
            Action::Pin {
                node,
                weight,
                until_ms,
            } => {
                let (min, max) = (self.params.min_weight, self.params.max_weight);
                if !weight.is_finite() || *weight < min || *weight <= 0.0 || *weight > max {
                    return Err(ActError::BadWeight {
                        got: *weight,
                        min,
                        max,
                    });
                }
                let slot = self.known(node)?;
                self.actions.pins.insert(
                    node.clone(),
                    operator::Pin {
                        weight: *weight,
                        mark: mark(*until_ms),
                    },
                );
                // Unpinned, the controller goes on from the pinned weight.
                self.slots.hot[slot]
                    .strategy_weights
                    .set(Strategy::Pid, *weight);
                self.slots.pid[slot].reset();
            }
            Action::Unpin { node } => {
                self.unpin(node).ok_or_else(|| {
                    ActError::NotInForce(format!(
                        "node {node:?} of service {:?} is not pinned",
                        self.name
                    ))
                })?;
            }
        }
        self.republish();
        Ok(())
    }

    /// Lifts the holds and pins whose end time has passed at `wall`; returns them.
    pub fn lapse(&mut self, wall: WallMillis) -> Vec<Lapsed> {
        let mut lapsed = Vec::new();
        if self.actions.hold.as_ref().is_some_and(|h| h.lapsed(wall)) {
            if let Some(mark) = self.actions.hold.take() {
                lapsed.push(Lapsed {
                    service: self.name.clone(),
                    action: Action::Release,
                    mark,
                });
            }
        }
        let ended: Vec<String> = self
            .actions
            .pins
            .iter()
            .filter(|(_, p)| p.mark.lapsed(wall))
            .map(|(node, _)| node.clone())
            .collect();
        for node in ended {
            if let Some(pin) = self.unpin(&node) {
                lapsed.push(Lapsed {
                    service: self.name.clone(),
                    action: Action::Unpin { node },
                    mark: pin.mark,
                });
            }
        }
        if !lapsed.is_empty() {
            self.republish();
        }
        lapsed
    }

    /// Removes the pin of `node`, if any; its controller starts afresh from the
    /// pinned weight.
    fn unpin(&mut self, node: &str) -> Option<operator::Pin> {
        let pin = self.actions.pins.remove(node)?;
        if let Some(slot) = self.slots.slot(node) {
            self.slots.pid[slot].reset();
        }
        Some(pin)
    }

    /// The slot of `node`, or the error that it is unknown.
    fn known(&self, node: &str) -> Result<usize, ActError> {
        self.slots
            .slot(node)
            .ok_or_else(|| ActError::UnknownEndpoint {
                service: self.name.clone(),
                node: node.to_string(),
            })
    }

    /// Sets the published weights again after an action and makes a new version, so
    /// that the store keeps the action even when no weight moved (a hold).
    fn republish(&mut self) {
        self.publish_mixture();
        self.version += 1;
    }
}
