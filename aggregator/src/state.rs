//! What the daemon's tasks share: the balancer, the clock, the metrics and the store.

use ballast_balance::{Balancer, Millis, ServiceSnapshot};
use crate::clock::Clock;
use crate::config::locality::Localities;
use crate::metrics::Metrics;
use crate::store::RoutingStore;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// Shared daemon state. The balancer sits behind one mutex, held only for the short,
/// allocation-light calls of the sans-IO core: ingest and the cycle never wait on I/O
/// while holding it.
pub struct State {
    /// The daemon's clock.
    pub clock: Clock,
    /// The balancing core.
    balancer: Mutex<Balancer>,
    /// Counters.
    pub metrics: Metrics,
    /// Where weights persist.
    pub store: Arc<dyn RoutingStore>,
    /// The last routing-store error, cleared by the next good write.
    pub store_error: Mutex<Option<String>>,
    /// Bumped after every cycle that changed some service's weights; feeds wait on it.
    pub changes: tokio::sync::watch::Sender<u64>,
    /// The report interval agents are told to use, in milliseconds.
    pub report_interval_ms: u32,
    /// The locality splits in force, replaced whole on a config reload.
    localities: RwLock<Arc<Localities>>,
    /// The per-service config directory, when one is configured.
    config_dir: Mutex<Option<crate::config::watch::ConfigDirStatus>>,
}

impl State {
    /// State around a balancer.
    pub fn new(
        balancer: Balancer,
        store: Arc<dyn RoutingStore>,
        clock: Clock,
        report_interval_ms: u32,
    ) -> Self {
        State {
            clock,
            balancer: Mutex::new(balancer),
            metrics: Metrics::new(),
            store,
            store_error: Mutex::new(None),
            changes: tokio::sync::watch::channel(0).0,
            report_interval_ms,
            localities: RwLock::new(Arc::new(Localities::default())),
            config_dir: Mutex::new(None),
        }
    }

    /// The config directory's merged config and refusals; `None` without a directory.
    pub fn config_dir(&self) -> MutexGuard<'_, Option<crate::config::watch::ConfigDirStatus>> {
        self.config_dir.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The locality splits in force.
    pub fn localities(&self) -> Arc<Localities> {
        self.localities
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts new locality splits in force and wakes the feeds if they differ.
    pub fn set_localities(&self, localities: Localities) {
        let mut current = self.localities.write().unwrap_or_else(|p| p.into_inner());
        if **current != localities {
            *current = Arc::new(localities);
            drop(current);
            self.changes.send_modify(|v| *v += 1);
        }
    }

    /// The balancer. A panic while it was held cannot leave it half-updated in a way
    /// the next cycle does not repair, so a poisoned lock is taken over, not spread.
    pub fn balancer(&self) -> MutexGuard<'_, Balancer> {
        self.balancer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one cycle of every service, counts it, and returns the snapshots of the
    /// services whose weights changed, for the store and the feeds.
    pub fn cycle(&self, now: Millis) -> BTreeMap<String, ServiceSnapshot> {
        self.run_cycle(|b| b.cycle(now))
    }

    /// Like [`State::cycle`], for the services whose own cycle is due at `now` (see
    /// [`Balancer::cycle_due`]); nothing is counted when none is.
    pub fn cycle_due(&self, now: Millis, slack: Millis) -> BTreeMap<String, ServiceSnapshot> {
        self.run_cycle(|b| b.cycle_due(now, slack))
    }

    fn run_cycle(
        &self,
        run: impl FnOnce(&mut Balancer) -> Vec<ballast_balance::CycleResult>,
    ) -> BTreeMap<String, ServiceSnapshot> {
        let started = std::time::Instant::now();
        let mut changed = BTreeMap::new();
        let results = {
            let mut b = self.balancer();
            let results = run(&mut b);
            if results.is_empty() {
                return changed;
            }
            for r in results.iter().filter(|r| r.changed) {
                if let Some(svc) = b.service(&r.service) {
                    changed.insert(r.service.clone(), svc.snapshot());
                }
            }
            results
        };
        self.metrics
            .cycle_duration
            .observe(started.elapsed().as_secs_f64());
        for r in &results {
            let service = r.service.clone();
            self.metrics
                .cycles
                .get_or_create(&crate::metrics::ServiceLabel {
                    service: service.clone(),
                })
                .inc();
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
        if !changed.is_empty() {
            self.changes.send_modify(|v| *v += 1);
        }
        changed
    }

    /// Writes changed services to the store, recording the outcome.
    pub fn persist(&self, changed: &BTreeMap<String, ServiceSnapshot>) {
        if changed.is_empty() {
            return;
        }
        let outcome = self.store.put(changed);
        let label = if outcome.is_ok() { "ok" } else { "error" };
        self.metrics
            .store_writes
            .get_or_create(&crate::metrics::Reason {
                reason: label.to_string(),
            })
            .inc();
        let mut err = self.store_error.lock().unwrap_or_else(|p| p.into_inner());
        match outcome {
            Ok(()) => *err = None,
            Err(e) => {
                tracing::warn!(error = %e, "routing store write failed");
                *err = Some(e.to_string());
            }
        }
    }
}
