//! What the daemon's tasks share: the balancer and its writers' lock, the value each
//! cycle publishes, the clock, the metrics and the store.

use crate::clock::Clock;
use crate::config::locality::Localities;
use crate::metrics::Metrics;
use crate::store::RoutingStore;
use ballast_balance::{Balancer, Millis, Published, PublishedService, ServiceSnapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// Shared daemon state. The balancer sits behind one mutex, held only by its writers
/// (ingest, the cycle, config reloads) for the short, allocation-light calls of the
/// sans-IO core. Everything that reads weights (the store writer, xDS, the watch feed,
/// the API, the replies to agents) reads the value the last cycle published instead.
pub struct State {
    /// The daemon's clock.
    pub clock: Clock,
    /// The balancing core.
    balancer: Mutex<Balancer>,
    /// Counters; shared with the parts of the daemon that need nothing else of the state
    /// (the QUIC threads, the revocation list's watcher, the HTTP listener).
    pub metrics: Arc<Metrics>,
    /// Where weights persist.
    pub store: Arc<dyn RoutingStore>,
    /// How the store's writer is doing, for `/healthz`.
    pub store_status: crate::store::StoreStatus,
    /// What each cycle published; every reader subscribes here.
    published: tokio::sync::watch::Sender<Arc<Published>>,
    /// The report interval agents are told to use, in milliseconds.
    pub report_interval_ms: u32,
    /// The locality splits in force, replaced whole on a config reload.
    localities: RwLock<Arc<Localities>>,
    /// The per-service config directory, when one is configured.
    config_dir: Mutex<Option<crate::config::dir::ConfigDirStatus>>,
    /// Whether the cycle loop is alive, for `/healthz`.
    pub health: Health,
    /// How much peers may make the daemon hold.
    pub limits: crate::config::limits::Limits,
    /// Which services this replica owns, when it is one of a cluster; `None` for a
    /// lone aggregator, which owns every service.
    pub ownership: Option<Arc<crate::cluster::Ownership>>,
    /// As a cluster replica, the services it serves but does not balance: as their
    /// owners last stored them in etcd, or as this replica last published them before
    /// it lost them. Every publication carries them beside the balancer's own, so that
    /// every replica's feeds serve every service, and a lost service keeps its last
    /// weights rather than vanishing from the load balancers.
    followed: Mutex<BTreeMap<String, Arc<PublishedService>>>,
    /// As a cluster replica, the services a takeover restored from the store, as they
    /// were published then: what the store already holds, so that the writer does not
    /// write the same value again once their buckets are owned.
    taken_over: Mutex<BTreeMap<String, Arc<PublishedService>>>,
}

/// The cycle loop's liveness, for `/healthz`: a loop that stopped (a panic, a deadlock
/// on the balancer) leaves weights frozen while everything else still answers.
#[derive(Debug)]
pub struct Health {
    /// The configured cycle length, in milliseconds.
    cycle_ms: AtomicU64,
    /// When the cycle loop last ran (or the state was made, before its first tick).
    last_tick: AtomicU64,
}

/// How many cycle lengths the loop may be silent before `/healthz` fails.
pub const CYCLE_LATE_AFTER: u64 = 3;

impl Health {
    fn new(now: Millis) -> Self {
        Health {
            cycle_ms: AtomicU64::new(ballast_balance::Params::default().cycle_ms),
            last_tick: AtomicU64::new(now),
        }
    }

    /// Sets the cycle length the loop is held to.
    pub fn set_cycle_ms(&self, ms: u64) {
        self.cycle_ms.store(ms, Ordering::Relaxed);
    }

    /// Records that the cycle loop ran at `now`.
    pub fn ticked(&self, now: Millis) {
        self.last_tick.store(now, Ordering::Relaxed);
    }

    /// How long ago the loop last ran, if that is more than [`CYCLE_LATE_AFTER`] cycle
    /// lengths: the loop has stopped.
    pub fn cycle_late(&self, now: Millis) -> Option<u64> {
        let age = now.saturating_sub(self.last_tick.load(Ordering::Relaxed));
        let limit = CYCLE_LATE_AFTER.saturating_mul(self.cycle_ms.load(Ordering::Relaxed));
        (age > limit).then_some(age)
    }
}

impl State {
    /// State around a balancer, with a first publication of what it holds (restored
    /// services, if any).
    pub fn new(
        balancer: Balancer,
        store: Arc<dyn RoutingStore>,
        clock: Clock,
        report_interval_ms: u32,
    ) -> Self {
        let first =
            Published::default().next(&balancer, &BTreeSet::new(), &BTreeMap::new(), clock.now());
        let health = Health::new(clock.now());
        State {
            clock,
            balancer: Mutex::new(balancer),
            metrics: Arc::new(Metrics::new()),
            store,
            store_status: crate::store::StoreStatus::default(),
            published: tokio::sync::watch::channel(Arc::new(first)).0,
            report_interval_ms,
            localities: RwLock::new(Arc::new(Localities::default())),
            config_dir: Mutex::new(None),
            health,
            limits: crate::config::limits::Limits::default(),
            ownership: None,
            followed: Mutex::new(BTreeMap::new()),
            taken_over: Mutex::new(BTreeMap::new()),
        }
    }

    /// As one replica of a cluster, serving only the services `ownership` gives it.
    pub fn with_ownership(mut self, ownership: Arc<crate::cluster::Ownership>) -> Self {
        self.ownership = Some(ownership);
        self
    }

    /// With these limits instead of the defaults; the core's are set on the balancer.
    pub fn with_limits(mut self, limits: crate::config::limits::Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The config directory's merged config and refusals; `None` without a directory.
    pub fn config_dir(&self) -> MutexGuard<'_, Option<crate::config::dir::ConfigDirStatus>> {
        self.config_dir.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The locality splits in force.
    pub fn localities(&self) -> Arc<Localities> {
        self.localities
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts new locality splits in force and publishes them if they differ.
    pub(crate) fn set_localities(&self, localities: Localities) {
        let mut current = self.localities.write().unwrap_or_else(|p| p.into_inner());
        if **current != localities {
            *current = Arc::new(localities);
            drop(current);
            let b = self.balancer();
            self.publish(&b, &BTreeSet::new(), self.clock.now());
        }
    }

    /// The balancer, for its writers: ingest, the cycle and config reloads. A panic
    /// while it was held cannot leave it half-updated in a way the next cycle does not
    /// repair, so a poisoned lock is taken over, not spread.
    pub fn balancer(&self) -> MutexGuard<'_, Balancer> {
        self.balancer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `change` on the balancer, as ingest or a config reload would: for tests in
    /// other modules that play the agents' part.
    #[cfg(test)]
    pub(crate) fn write_balancer<R>(&self, change: impl FnOnce(&mut Balancer) -> R) -> R {
        change(&mut self.balancer())
    }

    /// The last publication.
    pub fn published(&self) -> Arc<Published> {
        self.published.borrow().clone()
    }

    /// A receiver of every publication from now on, marked as having seen the current.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Arc<Published>> {
        self.published.subscribe()
    }

    /// Publishes the balancer's services, afresh for those in `ran`; the caller holds
    /// the balancer, so publications go out in the order of the states they show.
    fn publish(&self, balancer: &Balancer, ran: &BTreeSet<String>, now: Millis) -> Arc<Published> {
        let localities = self.localities();
        let previous = self.published();
        let mut next = previous.next(balancer, ran, &localities.services, now);
        for (name, service) in self.followed().iter() {
            if balancer.service(name).is_none() {
                next.services.insert(name.clone(), Arc::clone(service));
            }
        }
        let next = Arc::new(next);
        self.published.send_replace(next.clone());
        next
    }

    fn followed(&self) -> MutexGuard<'_, BTreeMap<String, Arc<PublishedService>>> {
        self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes over the services of `stored` that the balancer does not hold, as a
    /// replica that just won them does: restored with their stored weights and cycle
    /// numbers, served as they were until their agents arrive, and published. Returns
    /// how many were restored.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn take_over(&self, stored: &BTreeMap<String, ServiceSnapshot>) -> usize {
        let now = self.clock.now();
        let mut b = self.balancer();
        let fresh: BTreeMap<String, ServiceSnapshot> = stored
            .iter()
            .filter(|(name, _)| b.service(name).is_none())
            .map(|(name, snap)| (name.clone(), snap.clone()))
            .collect();
        b.restore(now, &fresh);
        {
            let mut followed = self.followed();
            for name in fresh.keys() {
                followed.remove(name);
            }
        }
        // Published afresh, not from the previous publication's copy (the followed
        // one, which may lag what was just restored).
        let ran: BTreeSet<String> = fresh.keys().cloned().collect();
        let published = self.publish(&b, &ran, now);
        let mut taken = self.taken_over();
        for name in fresh.keys() {
            if let Some(service) = published.services.get(name) {
                taken.insert(name.clone(), Arc::clone(service));
            }
        }
        fresh.len()
    }

    fn taken_over(&self) -> MutexGuard<'_, BTreeMap<String, Arc<PublishedService>>> {
        self.taken_over.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The services a takeover restored from the store that this replica now
    /// balances, as published at the takeover: the store holds them so, and they need
    /// no write until they change. Each is handed out once; those whose buckets are not
    /// owned yet wait for the next call.
    pub(crate) fn take_restored(&self) -> Vec<(String, Arc<PublishedService>)> {
        let mut taken = self.taken_over();
        if taken.is_empty() {
            return Vec::new();
        }
        let ready: Vec<String> = taken
            .keys()
            .filter(|name| self.balances(name))
            .cloned()
            .collect();
        ready
            .into_iter()
            .filter_map(|name| taken.remove(&name).map(|s| (name, s)))
            .collect()
    }

    /// Lets go of the services `gone` picks, as a replica that lost them to another
    /// does: the balancer forgets them, and they are served as last published until
    /// their new owner's weights arrive ([`State::follow`]). Returns their names.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn hand_over(&self, gone: impl Fn(&str) -> bool) -> Vec<String> {
        let now = self.clock.now();
        let mut b = self.balancer();
        let names: Vec<String> = b
            .services()
            .filter(|s| gone(&s.name))
            .map(|s| s.name.clone())
            .collect();
        if names.is_empty() {
            return names;
        }
        let last = self.published();
        {
            let mut followed = self.followed();
            let mut taken = self.taken_over();
            for name in &names {
                taken.remove(name);
                b.remove_service(name);
                if let Some(p) = last.services.get(name) {
                    followed.insert(name.clone(), Arc::clone(p));
                }
            }
        }
        self.publish(&b, &BTreeSet::new(), now);
        names
    }

    /// Serves `stored` services, as their owners wrote them, where this replica does
    /// not balance them itself; publishes if any changed. Returns how many it took.
    pub(crate) fn follow(&self, stored: &BTreeMap<String, ServiceSnapshot>) -> usize {
        let now = self.clock.now();
        let b = self.balancer();
        let localities = self.localities();
        let mut taken = 0;
        {
            let mut followed = self.followed();
            for (name, snap) in stored {
                if b.service(name).is_some() {
                    continue;
                }
                // Versions only grow; an older value (a watch event from before a read)
                // never replaces a newer one.
                let known = followed.get(name).is_some_and(|p| {
                    p.version > snap.version
                        || (p.version == snap.version && p.weights_cycle >= snap.cycle)
                });
                if known {
                    continue;
                }
                let mut svc = ballast_balance::service::Service::new(name, b.params(name).clone());
                svc.restore(now, snap);
                let locality = localities.services.get(name).cloned().unwrap_or_default();
                followed.insert(
                    name.clone(),
                    Arc::new(PublishedService::of(&svc, now, locality)),
                );
                taken += 1;
            }
        }
        if taken > 0 {
            self.publish(&b, &BTreeSet::new(), now);
        }
        taken
    }

    /// Whether this replica balances `service` itself (always, for a lone
    /// aggregator): the routing store writes only those.
    pub fn balances(&self, service: &str) -> bool {
        self.ownership.as_ref().is_none_or(|o| o.owns(service))
    }

    /// Runs one cycle of every service, counts it, publishes, and returns the
    /// publication.
    pub fn cycle(&self, now: Millis) -> Arc<Published> {
        self.run_cycle(now, |b| b.cycle(now))
            .unwrap_or_else(|| self.published())
    }

    /// Like [`State::cycle`], for the services whose own cycle is due at `now` (see
    /// [`Balancer::cycle_due`]); nothing is counted or published when none is.
    pub(crate) fn cycle_due(&self, now: Millis, slack: Millis) -> Option<Arc<Published>> {
        self.run_cycle(now, |b| b.cycle_due(now, slack))
    }

    fn run_cycle(
        &self,
        now: Millis,
        run: impl FnOnce(&mut Balancer) -> Vec<ballast_balance::CycleResult>,
    ) -> Option<Arc<Published>> {
        let started = std::time::Instant::now();
        let previous = self.published();
        let (results, published) = {
            let mut b = self.balancer();
            let results = run(&mut b);
            let forgotten = b.sweep_empty(now);
            for service in &forgotten {
                tracing::info!(%service, "service forgotten: no endpoint, and no config file, for longer than the tombstone period");
            }
            if results.is_empty() && forgotten.is_empty() {
                return None;
            }
            let ran = results.iter().map(|r| r.service.clone()).collect();
            let published = self.publish(&b, &ran, now);
            (results, published)
        };
        self.metrics
            .cycle_duration
            .observe(started.elapsed().as_secs_f64());
        for r in &results {
            let service = r.service.clone();
            let label = crate::metrics::ServiceLabel {
                service: service.clone(),
            };
            self.metrics.cycles.get_or_create(&label).inc();
            if !r.expired.is_empty() {
                tracing::info!(%service, nodes = ?r.expired, "endpoints expired after a long silence");
                self.metrics
                    .endpoints_expired
                    .get_or_create(&label)
                    .inc_by(r.expired.len() as u64);
            }
            if !r.moved.is_empty() {
                tracing::info!(%service, nodes = ?r.moved,
                    "endpoints forgotten: their nodes moved to another service or address");
                self.metrics
                    .endpoints_moved
                    .get_or_create(&label)
                    .inc_by(r.moved.len() as u64);
            }
            let held_before = previous
                .service(&service)
                .map_or(0, |s| s.stats.expiry_held);
            if r.expiry_held > 0 && held_before == 0 {
                tracing::warn!(%service, held = r.expiry_held,
                    "endpoints silent past expire_ms are held with their last weights: \
                     too much of the service is silent at once to believe it");
            }
            if let Some(reason) = r.skipped {
                self.metrics
                    .cycles_skipped
                    .get_or_create(&crate::metrics::ServiceReason {
                        service,
                        reason: reason.label().to_string(),
                    })
                    .inc();
            }
        }
        Some(published)
    }
}
