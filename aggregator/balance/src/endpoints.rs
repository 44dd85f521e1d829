//! A service's endpoints, laid out for the cycle and for reports.
//!
//! A cycle walks every endpoint of its service several times (expiry, the in-flight
//! assessment, the counts, the controller, the mixture), and a service may have
//! 100,000 endpoints. A walk costs what it streams through the cache, not what it
//! computes, so an endpoint's fields are kept apart by who reads them: a dense array of
//! the few that nearly every walk reads (`Hot`, one cache line), and beside it, slot
//! for slot, arrays of the controller's memory, the version's weights, the last
//! report, the in-flight tracker and the names. Slots are in node order (the order
//! every sum over the endpoints is taken in; newcomers out of order wait at the end
//! until the next cycle puts them in place), and a hash index finds a node's slot
//! for a report with one hash and one comparison of names.
//!
//! Readers outside the crate see an endpoint through [`Endpoint`], a view of one slot.

use crate::cpu_floor::CpuFloor;
use crate::inflight::InflightTracker;
use crate::params::{Params, StrategyWeights};
use crate::pid::Pid;
use crate::{Millis, Observation};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// An endpoint's state as operators see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EndpointState {
    /// Reporting and balanced.
    Serving,
    /// New or returning, ramping up from the cold-start weight.
    Warming,
    /// Lame duck: weight 0.
    Draining,
    /// Known but its last report is stale; its weight is held.
    Missing,
}

/// What [`Hot`] keeps for a time that has not happened: 64 bytes an endpoint (one
/// cache line) rather than the 80 that two `Option<Millis>` would make it.
const NEVER: Millis = Millis::MAX;

/// The fields of an endpoint that nearly every walk of a cycle reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Hot {
    /// When its last report arrived; [`NEVER`] if it has not reported since it was
    /// registered or restored (see [`Hot::last_report`]).
    last_report: Millis,
    /// When it last showed any sign of life (hello or report); drives expiry.
    pub(crate) last_seen: Millis,
    /// When the controller last ran for it; [`NEVER`] before that.
    last_update: Millis,
    /// The load the balancer steers by.
    pub(crate) load: f64,
    /// The published weight: the gated mixture, 0 when draining.
    pub(crate) weight: f64,
    /// Each strategy's weight.
    pub(crate) strategy_weights: StrategyWeights,
    /// Lame duck.
    pub(crate) draining: bool,
    /// Ramping up from the cold-start weight.
    pub(crate) warming: bool,
    /// Whether its weight was earned (a controller update or a restore).
    pub(crate) established: bool,
    /// Whether its node said hello to another service while registered here.
    pub(crate) moved: bool,
    /// Whether its in-flight count is distrusted: the tracker's verdict, kept here
    /// so that the cycle's counts need not read the trackers.
    pub(crate) distrusted: bool,
}

impl Hot {
    fn new(now: Millis, weight: f64) -> Self {
        Hot {
            last_report: NEVER,
            last_seen: now,
            last_update: NEVER,
            load: 0.0,
            weight,
            strategy_weights: StrategyWeights::new(weight),
            draining: false,
            warming: true,
            established: false,
            moved: false,
            distrusted: false,
        }
    }

    /// When its last report arrived; `None` if it has not reported since it was
    /// registered or restored.
    pub(crate) fn last_report(&self) -> Option<Millis> {
        (self.last_report != NEVER).then_some(self.last_report)
    }

    /// Records a report's arrival.
    pub(crate) fn set_last_report(&mut self, at: Millis) {
        self.last_report = at;
    }

    /// When the controller last ran for it.
    pub(crate) fn last_update(&self) -> Option<Millis> {
        (self.last_update != NEVER).then_some(self.last_update)
    }

    /// Records a controller update, or (`None`) forgets the last one.
    pub(crate) fn set_last_update(&mut self, at: Option<Millis>) {
        self.last_update = at.unwrap_or(NEVER);
    }

    /// Whether its last report is younger than the staleness bound.
    pub(crate) fn is_fresh(&self, now: Millis, params: &Params) -> bool {
        self.last_report()
            .is_some_and(|t| now.saturating_sub(t) <= params.stale_ms)
    }

    /// Whether it showed a sign of life here within `stale_ms`.
    pub(crate) fn is_alive(&self, now: Millis, params: &Params) -> bool {
        now.saturating_sub(self.last_seen) <= params.stale_ms
    }

    /// Whether it has shown no sign of life for longer than `expire_ms`.
    pub(crate) fn past_expiry(&self, now: Millis, params: &Params) -> bool {
        now.saturating_sub(self.last_seen) > params.expire_ms
    }

    /// Whether its node said hello to another service and it has gone stale here since
    /// (a drained one excepted: it expires on its own clock).
    pub(crate) fn moved_and_stale(&self, now: Millis, params: &Params) -> bool {
        self.moved && !self.draining && !self.is_alive(now, params)
    }

    /// Its state as operators see it.
    pub(crate) fn state(&self, now: Millis, params: &Params) -> EndpointState {
        if self.draining {
            EndpointState::Draining
        } else if !self.is_fresh(now, params) {
            EndpointState::Missing
        } else if self.warming {
            EndpointState::Warming
        } else {
            EndpointState::Serving
        }
    }
}

/// An endpoint's identity as a publication carries it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Names {
    pub(crate) node: Arc<str>,
    pub(crate) address: Arc<str>,
    pub(crate) zone: Arc<str>,
    /// The digest of the three ([`crate::publish::names_digest`]), made when they are
    /// set, so that a publication's change digest reads one number per endpoint.
    pub(crate) digest: u64,
}

impl Names {
    /// Node `node` at `address` in `zone`.
    pub(crate) fn new(node: Arc<str>, address: Arc<str>, zone: Arc<str>) -> Self {
        let digest = crate::publish::names_digest(&node, &address, &zone);
        Names {
            node,
            address,
            zone,
            digest,
        }
    }

    /// The node, moved to `address` in `zone`.
    pub(crate) fn moved(&mut self, address: &str, zone: Arc<str>) {
        *self = Names::new(Arc::clone(&self.node), Arc::from(address), zone);
    }
}

/// What only registration, sessions and publication read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cold {
    /// Node, address and zone, shared with every publication.
    pub(crate) names: Names,
    /// Sequence number of the last accepted report in this session.
    pub(crate) last_seq: Option<u32>,
    /// When its node said hello to another service while registered here.
    pub(crate) moved_at: Option<Millis>,
}

/// An endpoint's weights as of its service's current version.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Version {
    /// Weight and drain state; `None` if it registered since the version.
    pub(crate) state: Option<(f64, bool)>,
    /// Strategy weights.
    pub(crate) strategies: StrategyWeights,
}

/// One service's endpoints: parallel arrays, one entry per endpoint, in node order
/// except for the endpoints registered out of order since the last [`Slots::sort`],
/// which wait at the end.
///
/// Each endpoint also has an id that stays its own while it is known, so that the
/// index from node names need not change when slots move: the index gives the id,
/// and a dense array the id's slot.
#[derive(Debug, Clone, Default)]
pub(crate) struct Slots {
    pub(crate) hot: Vec<Hot>,
    pub(crate) pid: Vec<Pid>,
    pub(crate) version: Vec<Version>,
    pub(crate) obs: Vec<Observation>,
    pub(crate) inflight: Vec<InflightTracker>,
    pub(crate) cpu_floor: Vec<CpuFloor>,
    pub(crate) cold: Vec<Cold>,
    /// Each slot's id.
    ids: Vec<usize>,
    /// Each id's slot; `usize::MAX` for an id not in use.
    slot_of: Vec<usize>,
    /// Ids not in use.
    free: Vec<usize>,
    /// Node to id.
    index: HashMap<Arc<str>, usize>,
    /// Zones, each stored once per service and shared by its endpoints.
    zones: HashSet<Arc<str>>,
    /// Slots below this are in node order; those from it on were registered out of
    /// order since the last sort.
    sorted: usize,
}

impl Slots {
    /// How many endpoints.
    pub(crate) fn len(&self) -> usize {
        self.hot.len()
    }

    /// The slot of `node`.
    pub(crate) fn slot(&self, node: &str) -> Option<usize> {
        self.index
            .get(node)
            .and_then(|&id| self.slot_of.get(id).copied())
    }

    /// The CPU load of the endpoint in `slot`: its reported CPU, above the floor its
    /// weight did not move if one was found (see [`crate::cpu_floor`]).
    pub(crate) fn own_cpu(&self, slot: usize) -> f64 {
        self.cpu_floor[slot].own(crate::load::sanitize(self.obs[slot].cpu))
    }

    /// The shared string for `zone`.
    pub(crate) fn zone(&mut self, zone: &str) -> Arc<str> {
        if let Some(z) = self.zones.get(zone) {
            return Arc::clone(z);
        }
        let z: Arc<str> = Arc::from(zone);
        self.zones.insert(Arc::clone(&z));
        z
    }

    /// Adds an endpoint that is not there yet; returns its slot. One that sorts
    /// after every other joins the ordered slots; any other waits at the end for the
    /// next [`Slots::sort`], so that a whole fleet registering in any order costs one
    /// sort, not a shift of every array per registration.
    pub(crate) fn insert(
        &mut self,
        node: &str,
        address: &str,
        zone: &str,
        now: Millis,
        weight: f64,
    ) -> usize {
        let names = Names::new(Arc::from(node), Arc::from(address), self.zone(zone));
        let in_order = self.sorted == self.len()
            && self
                .cold
                .last()
                .is_none_or(|last| *last.names.node < *names.node);
        let slot = self.len();
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.slot_of.push(usize::MAX);
                self.slot_of.len() - 1
            }
        };
        self.slot_of[id] = slot;
        self.ids.push(id);
        self.index.insert(Arc::clone(&names.node), id);
        self.hot.push(Hot::new(now, weight));
        self.pid.push(Pid::default());
        self.version.push(Version {
            state: None,
            strategies: StrategyWeights::new(weight),
        });
        self.obs.push(Observation::default());
        self.inflight.push(InflightTracker::default());
        self.cpu_floor.push(CpuFloor::default());
        self.cold.push(Cold {
            names,
            last_seq: None,
            moved_at: None,
        });
        if in_order {
            self.sorted += 1;
        }
        slot
    }

    /// Puts the endpoint in `slot` back to what [`Slots::insert`] makes of a newcomer,
    /// at `address` and `zone`: a restore over a known node starts it afresh in place.
    pub(crate) fn reset(
        &mut self,
        slot: usize,
        address: &str,
        zone: &str,
        now: Millis,
        weight: f64,
    ) {
        if slot >= self.len() {
            return;
        }
        let zone = self.zone(zone);
        self.hot[slot] = Hot::new(now, weight);
        self.pid[slot] = Pid::default();
        self.version[slot] = Version {
            state: None,
            strategies: StrategyWeights::new(weight),
        };
        self.obs[slot] = Observation::default();
        self.inflight[slot] = InflightTracker::default();
        self.cpu_floor[slot] = CpuFloor::default();
        let cold = &mut self.cold[slot];
        cold.names.moved(address, zone);
        cold.last_seq = None;
        cold.moved_at = None;
    }

    /// Lets go of the id of the endpoint in `slot`, which is being removed.
    fn release(&mut self, slot: usize) {
        let id = self.ids[slot];
        self.index.remove(&self.cold[slot].names.node);
        self.slot_of[id] = usize::MAX;
        self.free.push(id);
    }

    /// Points every id at its slot from `from` on, after slots moved.
    fn renumber(&mut self, from: usize) {
        for (slot, &id) in self.ids.iter().enumerate().skip(from) {
            self.slot_of[id] = slot;
        }
    }

    /// Forgets the endpoint in `slot`, keeping the order of the rest.
    pub(crate) fn remove(&mut self, slot: usize) {
        if slot >= self.len() {
            return;
        }
        self.release(slot);
        self.hot.remove(slot);
        self.pid.remove(slot);
        self.version.remove(slot);
        self.obs.remove(slot);
        self.inflight.remove(slot);
        self.cpu_floor.remove(slot);
        self.cold.remove(slot);
        self.ids.remove(slot);
        if slot < self.sorted {
            self.sorted -= 1;
        }
        self.renumber(slot);
    }

    /// Forgets the endpoints whose `gone` entry is true, keeping the order of the rest.
    pub(crate) fn remove_marked(&mut self, gone: &[bool]) {
        let mut first = None;
        let mut ordered_gone = 0;
        for slot in (0..self.len()).filter(|&s| gone.get(s).copied().unwrap_or(false)) {
            self.release(slot);
            first.get_or_insert(slot);
            ordered_gone += usize::from(slot < self.sorted);
        }
        self.sorted -= ordered_gone;
        let Some(first) = first else {
            return;
        };
        fn keep<T>(v: &mut Vec<T>, gone: &[bool]) {
            let mut marks = gone.iter();
            v.retain(|_| !marks.next().copied().unwrap_or(false));
        }
        keep(&mut self.hot, gone);
        keep(&mut self.pid, gone);
        keep(&mut self.version, gone);
        keep(&mut self.obs, gone);
        keep(&mut self.inflight, gone);
        keep(&mut self.cpu_floor, gone);
        keep(&mut self.cold, gone);
        keep(&mut self.ids, gone);
        self.renumber(first);
    }

    /// The slots in node order, if they are not in it: the ordered ones with each
    /// waiting one merged in where it belongs (found by binary search, so a few
    /// newcomers cost a few comparisons each, not one per endpoint).
    fn order(&self) -> Option<Vec<usize>> {
        let n = self.len();
        if self.sorted >= n {
            return None;
        }
        let name = |slot: usize| &*self.cold[slot].names.node;
        let mut waiting: Vec<usize> = (self.sorted..n).collect();
        waiting.sort_by(|&a, &b| name(a).cmp(name(b)));
        let mut order = Vec::with_capacity(n);
        let mut next = 0;
        for slot in waiting {
            let before =
                self.cold[next..self.sorted].partition_point(|c| *c.names.node < *name(slot));
            order.extend(next..next + before);
            next += before;
            order.push(slot);
        }
        order.extend(next..self.sorted);
        Some(order)
    }

    /// Puts the endpoints registered out of order where they belong, and forgets the
    /// zones no endpoint or publication holds any more, so that agents that come and go
    /// with ever new zones cannot grow the set.
    pub(crate) fn sort(&mut self) {
        if self.zones.len() > 1 {
            self.zones.retain(|z| Arc::strong_count(z) > 1);
        }
        let Some(order) = self.order() else {
            return;
        };
        /// Moves `v[order[i]]` to `v[i]` for every `i`, in place: each cycle of the
        /// permutation is followed by swaps, and the slots that stay cost a check.
        fn permute<T>(v: &mut [T], order: &[usize], done: &mut Vec<bool>) {
            done.clear();
            done.resize(v.len(), false);
            for start in 0..v.len() {
                if done[start] {
                    continue;
                }
                let mut i = start;
                loop {
                    done[i] = true;
                    let j = order[i];
                    if j == start {
                        break;
                    }
                    v.swap(i, j);
                    i = j;
                }
            }
        }
        let first = order
            .iter()
            .enumerate()
            .position(|(i, &s)| i != s)
            .unwrap_or(0);
        let order = &order[first..];
        let shifted: Vec<usize> = order.iter().map(|&s| s - first).collect();
        let mut done = Vec::new();
        permute(&mut self.hot[first..], &shifted, &mut done);
        permute(&mut self.pid[first..], &shifted, &mut done);
        permute(&mut self.version[first..], &shifted, &mut done);
        permute(&mut self.obs[first..], &shifted, &mut done);
        permute(&mut self.inflight[first..], &shifted, &mut done);
        permute(&mut self.cpu_floor[first..], &shifted, &mut done);
        permute(&mut self.cold[first..], &shifted, &mut done);
        permute(&mut self.ids[first..], &shifted, &mut done);
        self.renumber(first);
        self.sorted = self.len();
    }

    /// Every slot, in node order.
    pub(crate) fn iter_sorted(&self) -> SlotIter {
        SlotIter {
            order: self.order(),
            pos: 0,
            len: self.len(),
        }
    }

    /// Every endpoint, in node order.
    pub(crate) fn view(&self) -> Endpoints<'_> {
        Endpoints { slots: self }
    }

    /// A view of the endpoint in `slot`.
    pub(crate) fn at(&self, slot: usize) -> Endpoint<'_> {
        Endpoint { slots: self, slot }
    }
}

/// Slot numbers in node order.
#[derive(Debug)]
pub(crate) struct SlotIter {
    order: Option<Vec<usize>>,
    pos: usize,
    len: usize,
}

impl Iterator for SlotIter {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.pos >= self.len {
            return None;
        }
        let slot = match &self.order {
            Some(order) => order.get(self.pos).copied(),
            None => Some(self.pos),
        };
        self.pos += 1;
        slot
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.len - self.pos;
        (left, Some(left))
    }
}

impl ExactSizeIterator for SlotIter {}

/// A service's endpoints, as readers see them.
#[derive(Debug, Clone, Copy)]
pub struct Endpoints<'a> {
    slots: &'a Slots,
}

impl<'a> Endpoints<'a> {
    /// How many.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.slots.len() == 0
    }

    /// The endpoint of `node`.
    pub fn get(&self, node: &str) -> Option<Endpoint<'a>> {
        self.slots.slot(node).map(|slot| self.slots.at(slot))
    }

    /// Whether `node` has an endpoint here.
    pub fn contains_key(&self, node: &str) -> bool {
        self.slots.slot(node).is_some()
    }

    /// Every endpoint, in node order.
    pub fn iter(&self) -> Iter<'a> {
        Iter {
            slots: self.slots,
            order: self.slots.iter_sorted(),
        }
    }

    /// Every endpoint, in node order (as [`Endpoints::iter`]).
    pub fn values(&self) -> Iter<'a> {
        self.iter()
    }

    /// Every node, in order.
    pub fn keys(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.iter().map(|e| e.node())
    }
}

impl<'a> IntoIterator for Endpoints<'a> {
    type Item = Endpoint<'a>;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The endpoints of a service in node order.
#[derive(Debug)]
pub struct Iter<'a> {
    slots: &'a Slots,
    order: SlotIter,
}

impl<'a> Iterator for Iter<'a> {
    type Item = Endpoint<'a>;

    fn next(&mut self) -> Option<Endpoint<'a>> {
        self.order.next().map(|slot| self.slots.at(slot))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.order.size_hint()
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// One endpoint of a service, as readers see it.
#[derive(Clone, Copy)]
pub struct Endpoint<'a> {
    slots: &'a Slots,
    slot: usize,
}

impl std::fmt::Debug for Endpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("node", &self.node())
            .field("address", &self.address())
            .field("zone", &self.zone())
            .field("hot", self.hot())
            .field("observation", self.observation())
            .field("pid", self.pid())
            .finish()
    }
}

impl<'a> Endpoint<'a> {
    pub(crate) fn hot(&self) -> &'a Hot {
        &self.slots.hot[self.slot]
    }

    pub(crate) fn cold(&self) -> &'a Cold {
        &self.slots.cold[self.slot]
    }

    pub(crate) fn version(&self) -> &'a Version {
        &self.slots.version[self.slot]
    }

    /// Its node, address and zone, shared.
    pub(crate) fn names(&self) -> &'a Names {
        &self.cold().names
    }

    /// The node's identity.
    pub fn node(&self) -> &'a str {
        &self.cold().names.node
    }

    /// Where load balancers send its traffic, `host:port`.
    pub fn address(&self) -> &'a str {
        &self.cold().names.address
    }

    /// Its zone; empty when unknown.
    pub fn zone(&self) -> &'a str {
        &self.cold().names.zone
    }

    /// When its last report arrived; `None` if it has not reported since it was
    /// registered or restored.
    pub fn last_report(&self) -> Option<Millis> {
        self.hot().last_report()
    }

    /// When it last showed any sign of life (hello or report); drives expiry.
    pub fn last_seen(&self) -> Millis {
        self.hot().last_seen
    }

    /// Sequence number of the last accepted report in this session.
    pub fn last_seq(&self) -> Option<u32> {
        self.cold().last_seq
    }

    /// The last reported measurement.
    pub fn observation(&self) -> &'a Observation {
        &self.slots.obs[self.slot]
    }

    /// The load the balancer steers by, derived from the observation.
    pub fn load(&self) -> f64 {
        self.hot().load
    }

    /// Lame duck.
    pub fn draining(&self) -> bool {
        self.hot().draining
    }

    /// Ramping up from the cold-start weight.
    pub fn warming(&self) -> bool {
        self.hot().warming
    }

    /// Each strategy's weight, kept apart as the routing store keeps them.
    pub fn strategy_weights(&self) -> StrategyWeights {
        self.hot().strategy_weights
    }

    /// The live weight: the gated mixture, 0 when draining.
    pub fn weight(&self) -> f64 {
        self.hot().weight
    }

    /// The PID controller's memory.
    pub fn pid(&self) -> &'a Pid {
        &self.slots.pid[self.slot]
    }

    /// When the controller last ran for this endpoint.
    pub fn last_update(&self) -> Option<Millis> {
        self.hot().last_update()
    }

    /// Whether its weight was earned: set by its first controller update or by a
    /// restore. Only established endpoints make a newcomer cold.
    pub fn established(&self) -> bool {
        self.hot().established
    }

    /// Whether its in-flight count is believed: false once it was set aside for not
    /// following the weight. What its agent is told.
    pub fn inflight_trusted(&self) -> bool {
        !self.hot().distrusted
    }

    /// What its in-flight count means: smoothing, the fleet-relative verdict, trust.
    pub fn inflight(&self) -> &'a InflightTracker {
        &self.slots.inflight[self.slot]
    }

    /// What its CPU keeps whatever its weight, if anything (see [`crate::cpu_floor`]).
    pub fn cpu_floor(&self) -> &'a CpuFloor {
        &self.slots.cpu_floor[self.slot]
    }

    /// When its node said hello to another service while registered here.
    pub fn moved_at(&self) -> Option<Millis> {
        self.cold().moved_at
    }

    /// Whether its last report is younger than the staleness bound.
    pub fn is_fresh(&self, now: Millis, params: &Params) -> bool {
        self.hot().is_fresh(now, params)
    }

    /// Whether it showed a sign of life here (a hello or a report) within `stale_ms`:
    /// an endpoint that said hello and has not reported yet is alive, not stale.
    pub fn is_alive(&self, now: Millis, params: &Params) -> bool {
        self.hot().is_alive(now, params)
    }

    /// Its state as operators see it.
    pub fn state(&self, now: Millis, params: &Params) -> EndpointState {
        self.hot().state(now, params)
    }

    /// Milliseconds since its last report.
    pub fn report_age(&self, now: Millis) -> Option<u64> {
        self.hot().last_report().map(|t| now.saturating_sub(t))
    }

    /// Its weight and drain state as of the service's current version: what feeds
    /// publish. One registered since the last version shows its live state.
    pub fn published(&self) -> (f64, bool) {
        let hot = self.hot();
        self.version().state.unwrap_or((hot.weight, hot.draining))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every node's slot holds that node, and the slots read in node order.
    fn check(slots: &Slots, model: &BTreeSet<String>) {
        assert_eq!(slots.len(), model.len());
        for node in model {
            let slot = slots.slot(node).expect("indexed");
            assert_eq!(&*slots.cold[slot].names.node, node.as_str());
        }
        let read: Vec<&str> = slots.view().keys().collect();
        let want: Vec<&str> = model.iter().map(String::as_str).collect();
        assert_eq!(read, want);
    }

    /// Zones are kept while an endpoint holds them and forgotten at the next sort once
    /// none does: ever new zones cannot grow a service's memory.
    #[test]
    fn zones_no_endpoint_holds_are_forgotten() {
        let mut slots = Slots::default();
        for i in 0..50 {
            let node = format!("n{i:02}");
            let zone = format!("zone-{i}");
            slots.insert(&node, "a", &zone, 0, 1.0);
            if i > 0 {
                let gone = slots.slot(&format!("n{:02}", i - 1)).expect("indexed");
                slots.remove(gone);
            }
            slots.sort();
            assert!(slots.zones.len() <= 2, "{} zones kept", slots.zones.len());
        }
        assert!(
            slots.zones.contains("zone-49"),
            "the live endpoint's zone is kept"
        );
    }

    /// Registrations in any order and removals of any kind, against a set of names:
    /// lookups stay right throughout, readers always see node order, and a sort puts
    /// the arrays themselves in node order.
    #[test]
    fn slots_follow_registrations_and_removals_in_any_order() {
        let mut slots = Slots::default();
        let mut model = BTreeSet::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for round in 0..3000 {
            match next(10) {
                0..=5 => {
                    let node = format!("n{:03}", next(400));
                    if !model.contains(&node) {
                        slots.insert(&node, "a", "z", 0, 1.0);
                        model.insert(node);
                    }
                }
                6 | 7 if !model.is_empty() => {
                    let nodes: Vec<&String> = model.iter().collect();
                    let node = nodes[next(nodes.len() as u64) as usize].clone();
                    let slot = slots.slot(&node).expect("indexed");
                    slots.remove(slot);
                    model.remove(&node);
                }
                8 => {
                    let gone: Vec<bool> = (0..slots.len()).map(|_| next(5) == 0).collect();
                    for (slot, _) in gone.iter().enumerate().filter(|(_, g)| **g) {
                        model.remove(&*slots.cold[slot].names.node);
                    }
                    slots.remove_marked(&gone);
                }
                _ => {
                    slots.sort();
                    let names: Vec<&str> = slots.cold.iter().map(|c| &*c.names.node).collect();
                    assert!(names.windows(2).all(|w| w[0] < w[1]), "round {round}");
                }
            }
            check(&slots, &model);
        }
    }
}
