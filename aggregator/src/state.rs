//! What the daemon's tasks share: the balancer and its writers' lock, the value each
//! cycle publishes, the clock and the metrics.
//!
//! It publishes and nothing else: what a cluster replica serves beside its balancer
//! (the cluster's overlay) is an argument of [`State::publish`],
//! held by the cycle loop, and the routing store, the cluster and the config directory
//! import nothing of it.

use crate::clock::Clock;
use crate::config::locality::Localities;
use crate::metrics::Metrics;
use crate::ownership::Ownership;
use crate::store::RoutingStore;
use ballast_balance::{Balancer, Millis, Published, PublishedService};
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
    /// How the store's writer is doing, for `/healthz`; shared with the writer.
    pub store_status: Arc<crate::store::StoreStatus>,
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
    pub ownership: Option<Arc<Ownership>>,
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
            store_status: Arc::new(crate::store::StoreStatus::default()),
            published: tokio::sync::watch::channel(Arc::new(first)).0,
            report_interval_ms,
            localities: RwLock::new(Arc::new(Localities::default())),
            config_dir: Mutex::new(None),
            health,
            limits: crate::config::limits::Limits::default(),
            ownership: None,
        }
    }

    /// As one replica of a cluster, serving only the services `ownership` gives it.
    pub fn with_ownership(mut self, ownership: Arc<Ownership>) -> Self {
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

    /// Puts new locality splits in force; returns whether they differ from those
    /// before, and so need publishing (the cycle loop's [`crate::door::Command::Publish`]).
    pub(crate) fn set_localities(&self, localities: Localities) -> bool {
        let mut current = self.localities.write().unwrap_or_else(|p| p.into_inner());
        if **current == localities {
            return false;
        }
        *current = Arc::new(localities);
        true
    }

    /// Puts new locality splits in force and publishes them at once, for a lone
    /// aggregator (no overlay): for tests that play the config directory's part.
    #[cfg(test)]
    pub(crate) fn localize(&self, localities: Localities) {
        if self.set_localities(localities) {
            let b = self.balancer();
            self.publish(&b, &BTreeSet::new(), &BTreeMap::new(), self.clock.now());
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

    /// Publishes the balancer's services, afresh for those in `ran`, with `followed`
    /// (the services a cluster replica serves but does not balance) beside those the
    /// balancer does not hold. The caller holds the balancer, so publications go out
    /// in the order of the states they show.
    pub(crate) fn publish(
        &self,
        balancer: &Balancer,
        ran: &BTreeSet<String>,
        followed: &BTreeMap<String, Arc<PublishedService>>,
        now: Millis,
    ) -> Arc<Published> {
        let localities = self.localities();
        let previous = self.published();
        let mut next = previous.next(balancer, ran, &localities.services, now);
        for (name, service) in followed {
            if balancer.service(name).is_none() {
                next.services.insert(name.clone(), Arc::clone(service));
            }
        }
        let next = Arc::new(next);
        self.published.send_replace(next.clone());
        next
    }

    /// Whether this replica balances `service` itself (always, for a lone
    /// aggregator): the routing store writes only those.
    pub fn balances(&self, service: &str) -> bool {
        crate::ownership::balances(self.ownership.as_deref(), service)
    }

    /// Runs one cycle of every service, counts it, publishes, and returns the
    /// publication: for a lone aggregator, with no overlay (the demo, tests, benches).
    pub fn cycle(&self, now: Millis) -> Arc<Published> {
        self.run_cycle(now, &BTreeMap::new(), |b| b.cycle(now))
            .unwrap_or_else(|| self.published())
    }

    /// Like [`State::cycle`], for the services whose own cycle is due at `now` (see
    /// [`Balancer::cycle_due`]), with `followed` beside them; nothing is counted or
    /// published when none is due.
    pub(crate) fn cycle_due(
        &self,
        now: Millis,
        slack: Millis,
        followed: &BTreeMap<String, Arc<PublishedService>>,
    ) -> Option<Arc<Published>> {
        self.run_cycle(now, followed, |b| b.cycle_due(now, slack))
    }

    fn run_cycle(
        &self,
        now: Millis,
        followed: &BTreeMap<String, Arc<PublishedService>>,
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
            let published = self.publish(&b, &ran, followed, now);
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
