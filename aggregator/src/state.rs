//! What the daemon's tasks share: the balancer and its writers' lock, the value each
//! cycle publishes, the clock, the metrics and the store.

use crate::clock::Clock;
use crate::config::locality::Localities;
use crate::metrics::Metrics;
use crate::store::RoutingStore;
use ballast_balance::{Balancer, Millis, Published};
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
    /// Counters.
    pub metrics: Metrics,
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
            metrics: Metrics::new(),
            store,
            store_status: crate::store::StoreStatus::default(),
            published: tokio::sync::watch::channel(Arc::new(first)).0,
            report_interval_ms,
            localities: RwLock::new(Arc::new(Localities::default())),
            config_dir: Mutex::new(None),
            health,
            limits: crate::config::limits::Limits::default(),
        }
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
        let next = Arc::new(previous.next(balancer, ran, &localities.services, now));
        self.published.send_replace(next.clone());
        next
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
