//! The routing store's writer: the one task that writes publications to the store.
//!
//! It subscribes to the publications and writes the services whose weights version or
//! endpoint set (node, address, zone, draining) differ from what it last wrote
//! successfully. One write is in flight at a time, and publications that arrive
//! meanwhile are not queued: when the write returns, the writer takes the latest one
//! and writes what differs from the store then ("the last value wins"). Memory is
//! therefore bounded by one publication and one batch, however slow the store.
//!
//! A failed write leaves its services differing, so they go again with the next write,
//! which comes after a short backoff (doubling from [`RETRY_FIRST`] to [`RETRY_MAX`])
//! with the latest publication. While a write is in flight or waiting to be retried,
//! the writer keeps following publications, so [`StoreStatus`] and the metrics show
//! how many services wait and for how long even when the store hangs.
//!
//! When the store served a fallback at start (etcd's local copy, etcd being down), the
//! writer does not take the restored services as stored: `/healthz` shows why from the
//! start, and the writer writes every service at once, and again after each backoff,
//! until the store takes it. That write reads the store first and reconciles; the
//! services the store turns out to hold newer are restored into the balancer, unless
//! the aggregator has balanced them from reports since, in which case its live weights
//! are written over them.

use super::StoreError;
use crate::metrics::Metrics;
use crate::ownership::Ownership;
use ballast_balance::{Balancer, Millis, Published, PublishedService, ServiceSnapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a write may be in flight before `/healthz` calls the store stalled: well
/// past any healthy write (etcd's request timeout is 2 s by default), yet short enough
/// that a hung store shows up before weights go stale for long.
pub const STALL_AFTER: Duration = Duration::from_secs(10);
/// The wait before retrying a first failed write: short, as a single failure is
/// usually a blip.
const RETRY_FIRST: Duration = Duration::from_millis(250);
/// The longest wait between retries, so that the store catches up soon after it
/// answers again.
const RETRY_MAX: Duration = Duration::from_secs(2);
/// How often the lag figures are refreshed while a write is in flight or waiting.
const REFRESH: Duration = Duration::from_secs(1);

/// How the routing store is doing, as `/healthz` reports it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum StoreCondition {
    /// The last write succeeded (or none was needed) and none is stuck.
    Ok,
    /// The last write failed; it is being retried.
    Error,
    /// A write has been in flight for longer than [`STALL_AFTER`].
    Stalled,
}

/// The routing store's health: what `/healthz` shows under `store_writer`, so that a
/// slow, hung or failing store is visible without reading logs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct StoreHealth {
    /// `ok`, `error` or `stalled`.
    pub status: StoreCondition,
    /// The store, as its `describe` names it.
    pub name: String,
    /// The last write's error; `None` once a write succeeds.
    pub error: Option<String>,
    /// Writes that failed in a row.
    pub consecutive_failures: u32,
    /// Whether a write is in flight.
    pub writing: bool,
    /// How long the write in flight has been, in seconds.
    pub writing_seconds: Option<f64>,
    /// The publication the write in flight carries.
    pub writing_version: Option<u64>,
    /// The last publication the store holds in full; `None` before the writer starts.
    pub written_version: Option<u64>,
    /// Services whose latest change is not in the store yet.
    pub pending: usize,
    /// The age of the oldest of those changes, in seconds.
    pub lag_seconds: Option<f64>,
    /// How long writes have been failing (or the one in flight stalled), in seconds;
    /// `None` while the store is ok.
    pub failing_seconds: Option<f64>,
    /// Services whose latest value is too large for the store, with its size in
    /// bytes: the store keeps their last value that fitted, and writes the others.
    pub too_large: BTreeMap<String, usize>,
}

/// How long the routing store may fail before `/healthz` fails: long enough to ride
/// out an etcd leader election or restart, short enough that a store that is gone
/// for good pages someone while the weights it would restore are still recent.
pub(crate) const FAILING_UNHEALTHY_AFTER: Duration = Duration::from_secs(300);

impl StoreHealth {
    /// Whether the store has been failing for longer than [`FAILING_UNHEALTHY_AFTER`].
    pub fn unhealthy(&self) -> bool {
        self.failing_seconds
            .is_some_and(|s| s > FAILING_UNHEALTHY_AFTER.as_secs_f64())
    }
}

/// The writer's progress, shared with `/healthz`. The writer updates it; anyone may
/// read it.
#[derive(Debug, Default)]
pub struct StoreStatus {
    inner: Mutex<Progress>,
}

#[derive(Debug, Default)]
struct Progress {
    /// When the current run of failed writes began.
    failing_since: Option<Instant>,
    writing_since: Option<Instant>,
    writing_version: Option<u64>,
    error: Option<String>,
    consecutive_failures: u32,
    written_version: Option<u64>,
    pending: usize,
    oldest_pending: Option<Instant>,
    too_large: BTreeMap<String, usize>,
}

impl StoreStatus {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        // Every update is a few plain assignments; a panic cannot leave it torn.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last publication the store holds all of, if any.
    pub(crate) fn written_version(&self) -> Option<u64> {
        self.lock().written_version
    }

    /// The store's health at `now`, for the store named `name`.
    pub fn health(&self, name: String, now: Instant) -> StoreHealth {
        let p = self.lock();
        let writing_for = p.writing_since.map(|t| now.saturating_duration_since(t));
        let status = if writing_for.is_some_and(|d| d > STALL_AFTER) {
            StoreCondition::Stalled
        } else if p.error.is_some() {
            StoreCondition::Error
        } else {
            StoreCondition::Ok
        };
        let failing_for = match status {
            StoreCondition::Ok => None,
            // A stalled write that follows failures has been failing since the first.
            StoreCondition::Error | StoreCondition::Stalled => p
                .failing_since
                .or(p.writing_since)
                .map(|t| now.saturating_duration_since(t)),
        };
        StoreHealth {
            status,
            name,
            error: p.error.clone(),
            consecutive_failures: p.consecutive_failures,
            writing: writing_for.is_some(),
            writing_seconds: writing_for.map(|d| d.as_secs_f64()),
            writing_version: p.writing_version,
            written_version: p.written_version,
            pending: p.pending,
            lag_seconds: p
                .oldest_pending
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            failing_seconds: failing_for.map(|d| d.as_secs_f64()),
            too_large: p.too_large.clone(),
        }
    }
}

/// What the writer last wrote of each service, what it is writing, and since when
/// each service that differs has waited.
struct Tracker {
    written: BTreeMap<String, Arc<PublishedService>>,
    in_flight: BTreeMap<String, Arc<PublishedService>>,
    waiting: BTreeMap<String, Waiting>,
}

/// Since when a service has differed from the store.
struct Waiting {
    /// First seen differing from what was written.
    since: Instant,
    /// First seen differing from what the write in flight carries: the change that
    /// still waits once that write lands.
    newer_since: Option<Instant>,
}

impl Tracker {
    /// Starts from `first`, the publication of what the store held at start (the
    /// restored services): it needs no write.
    fn new(first: &Published) -> Self {
        Tracker {
            written: first.services.clone(),
            in_flight: BTreeMap::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// The services of `published` that differ from what was written, noting since
    /// when each has waited. Services gone from the publication are forgotten (the
    /// store keeps them, as it always has).
    /// Only services `balances` names are this store's to write: a cluster replica
    /// publishes the services of other replicas too, and writes only its own.
    fn differing(
        &mut self,
        published: &Published,
        now: Instant,
        balances: &dyn Fn(&str) -> bool,
    ) -> Vec<Arc<PublishedService>> {
        self.written
            .retain(|name, _| published.services.contains_key(name) && balances(name));
        let due: Vec<Arc<PublishedService>> = published
            .services
            .values()
            .filter(|s| balances(&s.name))
            .filter(|s| self.written.get(&s.name).is_none_or(|w| differs(w, s)))
            .cloned()
            .collect();
        let names: BTreeSet<&str> = due.iter().map(|s| s.name.as_str()).collect();
        self.waiting.retain(|name, _| names.contains(name.as_str()));
        for s in &due {
            let waiting = self.waiting.entry(s.name.clone()).or_insert(Waiting {
                since: now,
                newer_since: None,
            });
            if self.in_flight.get(&s.name).is_some_and(|f| differs(f, s)) {
                waiting.newer_since.get_or_insert(now);
            }
        }
        due
    }

    /// Records that `batch` is being written.
    fn started(&mut self, batch: &[Arc<PublishedService>]) {
        self.in_flight = batch.iter().map(|s| (s.name.clone(), s.clone())).collect();
    }

    /// Records that the write in flight landed: its services are in the store, and
    /// those that changed again meanwhile wait from the time of that change.
    fn committed(&mut self) {
        for (name, service) in std::mem::take(&mut self.in_flight) {
            if let Some(waiting) = self.waiting.get_mut(&name) {
                match waiting.newer_since.take() {
                    Some(newer) => waiting.since = newer,
                    None => {
                        self.waiting.remove(&name);
                    }
                }
            }
            self.written.insert(name, service);
        }
    }

    /// Starts from nothing stored: every service is due (after a fallback at start,
    /// when what the store holds is not known).
    fn unconfirmed() -> Self {
        Tracker {
            written: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// Records that the store holds `service` as it is: restored from there by a
    /// takeover, it needs no write until it changes.
    fn restored(&mut self, name: String, service: Arc<PublishedService>) {
        self.written.insert(name, service);
    }

    /// Forgets what was written of `service`, so that it is written again.
    fn forget(&mut self, service: &str) {
        self.written.remove(service);
    }

    /// Records that the write in flight failed: its services wait as before.
    fn failed(&mut self) {
        for name in std::mem::take(&mut self.in_flight).keys() {
            if let Some(waiting) = self.waiting.get_mut(name) {
                waiting.newer_since = None;
            }
        }
    }

    fn pending(&self) -> usize {
        self.waiting.len()
    }

    fn oldest(&self) -> Option<Instant> {
        self.waiting.values().map(|w| w.since).min()
    }
}

/// Whether the store needs `now` after holding `written`: a new weights version, or
/// an endpoint added, removed, moved, rezoned, or drained or undrained; that is, a
/// new [`PublishedService::digest`], the one every feed follows.
pub(crate) fn differs(written: &PublishedService, now: &PublishedService) -> bool {
    written.digest != now.digest
}

/// The wait after `failures` failed writes in a row.
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// Writes publications to the store in the background, for as long as the daemon
/// runs: the cycle only publishes, and never waits for the store. See the module
/// documentation.
///
/// The publication current when this is called is taken as what the store holds (the
/// services restored from it at start), so call it before the first cycle runs; the
/// returned future does the writing.
pub fn writer(
    mut publications: watch::Receiver<Arc<Published>>,
    sink: Sink,
) -> impl Future<Output = ()> + Send + 'static {
    let first = publications.borrow_and_update().clone();
    count_skipped(&sink);
    let fallback = sink.store.fallback();
    let tracker = match &fallback {
        None => {
            sink.status.lock().written_version = Some(first.version);
            Tracker::new(&first)
        }
        Some(why) => {
            let mut p = sink.status.lock();
            p.error = Some(why.clone());
            p.failing_since = Some(Instant::now());
            Tracker::unconfirmed()
        }
    };
    run(sink, publications, tracker, fallback.is_some())
}

/// Counts the stored services the store skipped as corrupt in
/// `ballast_store_corrupt_total`, and the values it refused as too large in
/// `ballast_store_refused_total`, and shows the services too large now.
fn count_skipped(sink: &Sink) {
    for (reason, n) in [
        ("too_large", sink.store.take_refused()),
        ("not_owner", sink.store.take_fenced()),
    ] {
        if n > 0 {
            sink.metrics
                .store_refused
                .get_or_create(&crate::metrics::Reason {
                    reason: reason.to_string(),
                })
                .inc_by(n);
        }
    }
    let too_large = sink.store.too_large();
    sink.metrics
        .store_too_large
        .set(i64::try_from(too_large.len()).unwrap_or(i64::MAX));
    sink.status.lock().too_large = too_large;
    for (defect, n) in sink.store.take_skipped() {
        sink.metrics
            .store_corrupt
            .get_or_create(&crate::metrics::Reason {
                reason: defect.label().to_string(),
            })
            .inc_by(n);
    }
}

/// Restores into `balancer` the services the store holds newer than the aggregator
/// (found by the first write after a fallback), where that replaces nothing live: the
/// service is absent, or none of its endpoints has reported since the start and the
/// store's snapshot has every one of them. Returns the others: the writer writes them
/// again with the aggregator's weights, which come from reports.
///
/// The writer asks the cycle loop for this ([`crate::door::Command::RestoreNewer`]),
/// which calls it holding the balancer: the store never writes into the balancer
/// itself.
pub(crate) fn restore_newer(
    balancer: &mut Balancer,
    newer: BTreeMap<String, ServiceSnapshot>,
    balances: &dyn Fn(&str) -> bool,
    now: Millis,
) -> Vec<String> {
    let mut restore = BTreeMap::new();
    let mut rewrite = Vec::new();
    for (name, stored) in newer {
        // A cluster replica takes other replicas' services from etcd as it follows
        // them, never into its balancer.
        if !balances(&name) {
            continue;
        }
        let live = balancer.service(&name).map(|s| {
            let untouched = s
                .endpoints()
                .values()
                .all(|e| e.last_report().is_none() && stored.endpoints.contains_key(e.node()));
            (s.version, untouched)
        });
        match live {
            Some((version, _)) if version >= stored.version => rewrite.push(name),
            Some((version, false)) => {
                tracing::warn!(service = %name, stored = stored.version, live = version,
                    "the routing store holds a newer version of a service the aggregator \
                     has balanced from reports since it started: its live weights are \
                     written over it");
                rewrite.push(name);
            }
            Some((_, true)) | None => {
                restore.insert(name, stored);
            }
        }
    }
    if !restore.is_empty() {
        balancer.restore(now, &restore);
        tracing::info!(services = ?restore.keys().collect::<Vec<_>>(),
            "services restored from the routing store, which held them newer than the local copy");
    }
    rewrite
}

/// Services a cluster takeover restored from the store, as published at the takeover:
/// the store holds them so, and they need no write until they change. The cluster's
/// overlay fills it; the writer takes them.
#[derive(Debug, Clone, Default)]
pub struct Restored(Arc<Mutex<BTreeMap<String, Arc<PublishedService>>>>);

impl Restored {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Arc<PublishedService>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that the store holds `service` as it is.
    pub(crate) fn insert(&self, name: String, service: Arc<PublishedService>) {
        self.lock().insert(name, service);
    }

    /// Forgets `name`, handed over before the writer took it.
    pub(crate) fn remove(&self, name: &str) {
        self.lock().remove(name);
    }

    /// The restored services that this replica now balances (`balances`). Each is
    /// handed out once; those whose buckets are not owned yet wait for the next call.
    fn take_ready(&self, balances: impl Fn(&str) -> bool) -> Vec<(String, Arc<PublishedService>)> {
        let mut taken = self.lock();
        if taken.is_empty() {
            return Vec::new();
        }
        let ready: Vec<String> = taken
            .keys()
            .filter(|name| balances(name))
            .cloned()
            .collect();
        ready
            .into_iter()
            .filter_map(|name| taken.remove(&name).map(|s| (name, s)))
            .collect()
    }
}

/// What the writer works with besides the publications: the store, its status, the
/// counters, which services are this replica's to write, what a takeover restored,
/// and the cycle loop's door for the services the store holds newer.
#[derive(Clone)]
pub struct Sink {
    /// The store written to.
    pub store: Arc<dyn super::RoutingStore>,
    /// The writer's progress, for `/healthz`.
    pub status: Arc<StoreStatus>,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// As a cluster replica, which services it owns; `None` for a lone aggregator.
    pub ownership: Option<Arc<Ownership>>,
    /// What takeovers restored from the store.
    pub restored: Restored,
    /// How the writer asks the cycle loop to restore what the store holds newer.
    pub door: crate::door::Door,
}

impl Sink {
    fn balances(&self, service: &str) -> bool {
        crate::ownership::balances(self.ownership.as_deref(), service)
    }
}

async fn run(
    sink: Sink,
    mut publications: watch::Receiver<Arc<Published>>,
    mut tracker: Tracker,
    mut unconfirmed: bool,
) {
    let store = sink.store.clone();
    let mut open = true;
    let mut failures = 0u32;
    loop {
        let latest = publications.borrow_and_update().clone();
        let now = Instant::now();
        for (name, service) in sink.restored.take_ready(|name| sink.balances(name)) {
            tracker.restored(name, service);
        }
        let due = tracker.differing(&latest, now, &|name| sink.balances(name));
        report(&sink, &tracker, now);
        // After a fallback the store must be read and reconciled even with nothing due.
        if due.is_empty() && !unconfirmed {
            sink.status.lock().written_version = Some(latest.version);
            if !open || publications.changed().await.is_err() {
                return;
            }
            continue;
        }
        let batch: BTreeMap<String, ServiceSnapshot> =
            due.iter().map(|s| (s.name.clone(), s.snapshot())).collect();
        tracker.started(&due);
        {
            let mut p = sink.status.lock();
            p.writing_since = Some(now);
            p.writing_version = Some(latest.version);
        }
        let outcome = following(
            store.put(&batch),
            &sink,
            &mut publications,
            &mut tracker,
            &mut open,
        )
        .await;
        sink.metrics
            .store_write_seconds
            .observe(now.elapsed().as_secs_f64());
        sink.metrics
            .store_writes
            .get_or_create(&crate::metrics::Reason {
                reason: if outcome.is_ok() { "ok" } else { "error" }.to_string(),
            })
            .inc();
        count_skipped(&sink);
        match outcome {
            Ok(()) => {
                tracker.committed();
                if unconfirmed {
                    unconfirmed = false;
                    let newer = sink.store.take_newer();
                    if !newer.is_empty() {
                        for name in sink.door.restore_newer(newer).await {
                            tracker.forget(&name);
                        }
                    }
                }
                if failures > 0 {
                    tracing::info!(
                        failures,
                        services = batch.len(),
                        "routing store writes succeed again"
                    );
                }
                failures = 0;
                let mut p = sink.status.lock();
                p.writing_since = None;
                p.writing_version = None;
                p.error = None;
                p.failing_since = None;
                p.consecutive_failures = 0;
                p.written_version = Some(latest.version);
            }
            Err(e) => {
                tracker.failed();
                failures = failures.saturating_add(1);
                failed(&sink, &e, failures, batch.len());
                let wait = tokio::time::sleep(backoff(failures));
                following(wait, &sink, &mut publications, &mut tracker, &mut open).await;
            }
        }
    }
}

/// Records a failed write; the first of a run is logged as a warning, the rest (one
/// every [`RETRY_MAX`] at most) at debug level, as `/healthz` and the metrics show them.
fn failed(sink: &Sink, error: &StoreError, failures: u32, services: usize) {
    if failures == 1 {
        tracing::warn!(error = %error, services, "routing store write failed; retrying");
    } else {
        tracing::debug!(error = %error, failures, services, "routing store write failed again");
    }
    let mut p = sink.status.lock();
    p.writing_since = None;
    p.writing_version = None;
    p.error = Some(error.to_string());
    p.failing_since.get_or_insert_with(Instant::now);
    p.consecutive_failures = failures;
}

/// Awaits `fut` while following publications, so that the pending count and the lag
/// stay current while the store is slow, without queueing anything: only the latest
/// publication is ever looked at.
async fn following<F: Future>(
    fut: F,
    sink: &Sink,
    publications: &mut watch::Receiver<Arc<Published>>,
    tracker: &mut Tracker,
    open: &mut bool,
) -> F::Output {
    tokio::pin!(fut);
    let mut refresh = tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            out = &mut fut => return out,
            changed = publications.changed(), if *open => match changed {
                Ok(()) => {
                    let latest = publications.borrow_and_update().clone();
                    let now = Instant::now();
                    tracker.differing(&latest, now, &|name| sink.balances(name));
                    report(sink, tracker, now);
                }
                Err(_) => *open = false,
            },
            _ = refresh.tick() => report(sink, tracker, Instant::now()),
        }
    }
}

/// Sets the pending count and the lag in the metrics and the status.
fn report(sink: &Sink, tracker: &Tracker, now: Instant) {
    let pending = tracker.pending();
    let oldest = tracker.oldest();
    let lag = oldest.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
    sink.metrics
        .store_pending
        .set(i64::try_from(pending).unwrap_or(i64::MAX));
    sink.metrics.store_lag_seconds.set(lag);
    let mut p = sink.status.lock();
    p.pending = pending;
    p.oldest_pending = oldest;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::door::{Command, Door};
    use crate::store::{RoutingStore, StoreFuture};
    use ballast_balance::{Observation, Params};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::Notify;

    /// A store that records every batch, fails the first `fail` writes, and, when
    /// `hold` is set, holds each write until the test releases it.
    #[derive(Default)]
    struct TestStore {
        writes: Mutex<Vec<BTreeMap<String, ServiceSnapshot>>>,
        started: AtomicUsize,
        fail: AtomicUsize,
        hold: bool,
        release: Notify,
        entered: Notify,
    }

    impl TestStore {
        fn writes(&self) -> Vec<BTreeMap<String, ServiceSnapshot>> {
            self.writes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
        }
    }

    impl RoutingStore for TestStore {
        fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
            Box::pin(async { Ok(BTreeMap::new()) })
        }

        fn put<'a>(
            &'a self,
            changed: &'a BTreeMap<String, ServiceSnapshot>,
        ) -> StoreFuture<'a, ()> {
            Box::pin(async move {
                self.started.fetch_add(1, Ordering::SeqCst);
                self.entered.notify_one();
                if self.hold {
                    self.release.notified().await;
                }
                let failing = self
                    .fail
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if failing {
                    return Err(StoreError::Backend("the test store refuses".into()));
                }
                self.writes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(changed.clone());
                Ok(())
            })
        }

        fn describe(&self) -> String {
            "test".into()
        }
    }

    /// The writer's surroundings, as the daemon makes them: a balancer whose cycles
    /// publish, and a cycle loop's door that answers the writer's requests to restore
    /// what the store holds newer.
    struct Core {
        clock: Clock,
        balancer: Mutex<Balancer>,
        published: watch::Sender<Arc<Published>>,
        metrics: Arc<Metrics>,
        store: Arc<dyn RoutingStore>,
        store_status: Arc<StoreStatus>,
    }

    impl Core {
        fn new(balancer: Balancer, store: Arc<dyn RoutingStore>, clock: Clock) -> Self {
            let first = Published::default().next(
                &balancer,
                &BTreeSet::new(),
                &BTreeMap::new(),
                clock.now(),
            );
            Core {
                clock,
                balancer: Mutex::new(balancer),
                published: watch::channel(Arc::new(first)).0,
                metrics: Arc::new(Metrics::new()),
                store,
                store_status: Arc::default(),
            }
        }

        fn balancer(&self) -> MutexGuard<'_, Balancer> {
            self.balancer.lock().unwrap_or_else(|p| p.into_inner())
        }

        fn published(&self) -> Arc<Published> {
            self.published.borrow().clone()
        }

        /// Runs a cycle of every service and publishes it.
        fn cycle(&self, now: Millis) -> Arc<Published> {
            let b = &mut self.balancer();
            let ran = b.cycle(now).into_iter().map(|r| r.service).collect();
            let next = Arc::new(self.published().next(b, &ran, &BTreeMap::new(), now));
            self.published.send_replace(next.clone());
            next
        }

        /// The writer of a lone aggregator, with a task that serves the door as the
        /// cycle loop does.
        fn writer(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
            let (door, mut inbox) = Door::new();
            let core = self.clone();
            tokio::spawn(async move {
                while let Some(command) = inbox.recv().await {
                    if let Command::RestoreNewer(newer, answer) = command {
                        let now = core.clock.now();
                        let _ =
                            answer.send(restore_newer(&mut core.balancer(), newer, &|_| true, now));
                    }
                }
            });
            writer(
                self.published.subscribe(),
                Sink {
                    store: self.store.clone(),
                    status: self.store_status.clone(),
                    metrics: self.metrics.clone(),
                    ownership: None,
                    restored: Restored::default(),
                    door,
                },
            )
        }
    }

    fn state(store: Arc<TestStore>) -> Arc<Core> {
        let clock = Clock::start();
        let params = Params {
            grace_ms: 0,
            ..Params::default()
        };
        let balancer = Balancer::new(params, clock.now());
        Arc::new(Core::new(balancer, store, clock))
    }

    /// Adds `node` to service `web` and runs a cycle: a publication whose endpoint set
    /// differs from the last.
    fn add_node(state: &Core, node: &str) -> Arc<Published> {
        let now = state.clock.now();
        state
            .balancer()
            .register(now, "web", node, &format!("{node}:80"), "z1")
            .expect("register");
        state.cycle(now)
    }

    fn drain(state: &Core, node: &str) -> Arc<Published> {
        let now = state.clock.now();
        let obs = Observation {
            draining: true,
            ..Observation::default()
        };
        state
            .balancer()
            .observe(now, "web", node, obs)
            .expect("observe");
        state.cycle(now)
    }

    async fn wait<F: Future>(fut: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(5), fut)
            .await
            .expect("timed out waiting for the store")
    }

    async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn health(state: &Core) -> StoreHealth {
        state
            .store_status
            .health(state.store.describe(), Instant::now())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hung_store_delays_no_cycle_and_then_gets_only_the_latest() {
        let store = Arc::new(TestStore {
            hold: true,
            ..TestStore::default()
        });
        let state = state(store.clone());
        let task = tokio::spawn(state.writer());
        add_node(&state, "a");
        wait(store.entered.notified()).await;
        assert_eq!(store.started.load(Ordering::SeqCst), 1);

        // The store hangs; cycles go on at full speed and nothing queues up.
        let started = Instant::now();
        for node in ["b", "c", "d", "e"] {
            add_node(&state, node);
        }
        let latest = {
            let now = state.clock.now();
            state
                .balancer()
                .register(now, "api", "x", "x:80", "z1")
                .expect("register");
            state.cycle(now)
        };
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "cycles waited for the store: {:?}",
            started.elapsed()
        );
        // The writer follows the publications while it waits: both services pending.
        eventually("the pending count to follow", || {
            health(&state).pending == 2
        })
        .await;
        assert_eq!(
            store.started.load(Ordering::SeqCst),
            1,
            "a second write began"
        );
        assert!(health(&state).writing);
        // Long enough in flight, it is reported stalled.
        let later = state.store_status.health(
            "test".into(),
            Instant::now() + STALL_AFTER + Duration::from_secs(1),
        );
        assert_eq!(later.status, StoreCondition::Stalled);
        let json = serde_json::to_value(&later).expect("json");
        assert_eq!(
            (&json["status"], &json["writing"]),
            (&"stalled".into(), &true.into())
        );
        assert_eq!(health(&state).status, StoreCondition::Ok);

        // Released, the first write lands; the writer then takes the latest publication
        // and skips every one in between.
        store.release.notify_one();
        wait(store.entered.notified()).await;
        store.release.notify_one();
        eventually("two writes", || store.writes().len() == 2).await;
        let writes = store.writes();
        assert_eq!(writes[0]["web"].endpoints.len(), 1);
        assert_eq!(writes[0].len(), 1);
        assert_eq!(writes[1]["web"], latest.services["web"].snapshot());
        assert_eq!(writes[1]["web"].endpoints.len(), 5);
        assert_eq!(writes[1]["api"], latest.services["api"].snapshot());
        eventually("the status to settle", || {
            let h = health(&state);
            !h.writing && h.written_version == Some(latest.version) && h.pending == 0
        })
        .await;
        assert_eq!(store.started.load(Ordering::SeqCst), 2);
        let ok = state
            .metrics
            .store_writes
            .get_or_create(&crate::metrics::Reason {
                reason: "ok".into(),
            })
            .get();
        assert_eq!(ok, 2);
        task.abort();
    }

    #[tokio::test]
    async fn unchanged_services_are_not_written_again() {
        let store = Arc::new(TestStore::default());
        let state = state(store.clone());
        let task = tokio::spawn(state.writer());
        let first = add_node(&state, "a");
        eventually("the first write", || store.writes().len() == 1).await;
        // Cycles that change neither the version nor the endpoint set write nothing.
        let mut last = first;
        for _ in 0..3 {
            last = state.cycle(state.clock.now());
        }
        assert_eq!(
            last.services["web"].version,
            store.writes()[0]["web"].version
        );
        eventually("the writer to catch up", || {
            health(&state).written_version == Some(last.version)
        })
        .await;
        assert_eq!(store.writes().len(), 1);
        // A drain changes the endpoint set: written.
        drain(&state, "a");
        eventually("the drain to be written", || store.writes().len() == 2).await;
        assert!(store.writes()[1]["web"].endpoints["a"].draining);
        task.abort();
    }

    #[tokio::test]
    async fn a_failing_store_is_reported_and_retried() {
        let store = Arc::new(TestStore {
            fail: AtomicUsize::new(2),
            ..TestStore::default()
        });
        let state = state(store.clone());
        let task = tokio::spawn(state.writer());
        let published = add_node(&state, "a");
        eventually("a failed write", || health(&state).error.is_some()).await;
        let h = health(&state);
        assert_eq!(h.status, StoreCondition::Error, "{h:?}");
        assert!(
            h.error.as_deref().is_some_and(|e| e.contains("refuses")),
            "{h:?}"
        );
        assert_eq!(h.pending, 1);
        let metrics = state.metrics.encode();
        for family in [
            "# TYPE ballast_store_pending gauge",
            "# TYPE ballast_store_lag_seconds gauge",
            "# TYPE ballast_store_write_seconds histogram",
        ] {
            assert!(metrics.contains(family), "{family}:\n{metrics}");
        }
        assert!(metrics.contains("ballast_store_pending 1"), "{metrics}");
        // No new publication: the backoff alone brings the retries, and the second
        // retry succeeds with what was pending.
        eventually("a good write", || store.writes().len() == 1).await;
        assert_eq!(store.started.load(Ordering::SeqCst), 3);
        assert_eq!(
            store.writes()[0]["web"],
            published.services["web"].snapshot()
        );
        eventually("the error to clear", || health(&state).error.is_none()).await;
        let h = health(&state);
        assert_eq!(h.status, StoreCondition::Ok, "{h:?}");
        assert_eq!((h.pending, h.consecutive_failures), (0, 0));
        let count = |reason: &str| {
            state
                .metrics
                .store_writes
                .get_or_create(&crate::metrics::Reason {
                    reason: reason.into(),
                })
                .get()
        };
        assert_eq!((count("error"), count("ok")), (2, 1));
        task.abort();
    }

    /// A store that served a fallback at start: it fails the first `fail` writes, and
    /// the first good one hands back `newer` as the services it holds newer.
    struct FallbackStore {
        inner: TestStore,
        fallback: Mutex<Option<String>>,
        newer: Mutex<BTreeMap<String, ServiceSnapshot>>,
        handed: Mutex<BTreeMap<String, ServiceSnapshot>>,
    }

    impl RoutingStore for FallbackStore {
        fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
            self.inner.load()
        }

        fn put<'a>(
            &'a self,
            changed: &'a BTreeMap<String, ServiceSnapshot>,
        ) -> StoreFuture<'a, ()> {
            Box::pin(async move {
                self.inner.put(changed).await?;
                if self.fallback.lock().expect("lock").take().is_some() {
                    let newer = std::mem::take(&mut *self.newer.lock().expect("lock"));
                    *self.handed.lock().expect("lock") = newer;
                }
                Ok(())
            })
        }

        fn describe(&self) -> String {
            "fallback".into()
        }

        fn fallback(&self) -> Option<String> {
            self.fallback.lock().expect("lock").clone()
        }

        fn take_newer(&self) -> BTreeMap<String, ServiceSnapshot> {
            std::mem::take(&mut *self.handed.lock().expect("lock"))
        }
    }

    fn stored(version: u64, node: &str) -> ServiceSnapshot {
        ServiceSnapshot {
            version,
            cycle: version,
            endpoints: [(
                node.to_string(),
                ballast_balance::EndpointSnapshot {
                    address: format!("{node}:80"),
                    zone: "z1".into(),
                    draining: false,
                    weight: 1.0,
                    strategy_weights: BTreeMap::new(),
                },
            )]
            .into(),
            operator: Default::default(),
        }
    }

    #[tokio::test]
    async fn after_a_fallback_the_store_is_written_until_it_takes_it_and_newer_services_return() {
        let store = Arc::new(FallbackStore {
            inner: TestStore {
                fail: AtomicUsize::new(2),
                ..TestStore::default()
            },
            fallback: Mutex::new(Some("etcd is down; serving the local copy".into())),
            newer: Mutex::new(
                [
                    // Restored from the copy at version 5 and untouched since.
                    ("web".to_string(), stored(9, "w1")),
                    // Not in the copy at all.
                    ("gone".to_string(), stored(3, "g1")),
                    // Balanced from reports since the start: the live weights win.
                    ("busy".to_string(), stored(50, "b1")),
                    // A node the store does not know said hello: restoring would drop it.
                    ("mixed".to_string(), stored(9, "m1")),
                ]
                .into(),
            ),
            handed: Mutex::new(BTreeMap::new()),
        });
        let clock = Clock::start();
        let params = Params {
            grace_ms: 0,
            ..Params::default()
        };
        let mut balancer = Balancer::new(params, clock.now());
        balancer.restore(
            clock.now(),
            &[
                ("web".to_string(), stored(5, "w1")),
                ("mixed".to_string(), stored(5, "m1")),
            ]
            .into(),
        );
        let state = Arc::new(Core::new(balancer, store.clone(), clock));
        let now = state.clock.now();
        state
            .balancer()
            .register(now, "mixed", "m2", "m2:80", "z1")
            .expect("register");
        state
            .balancer()
            .register(now, "busy", "b1", "b1:80", "z1")
            .expect("register");
        state
            .balancer()
            .observe(now, "busy", "b1", Observation::default())
            .expect("observe");
        state.cycle(now);
        let busy_version = state.balancer().service("busy").expect("busy").version;
        assert!(busy_version < 50);

        let task = tokio::spawn(state.writer());
        // Shown from the start, before any write.
        let h = health(&state);
        assert_eq!(h.status, StoreCondition::Error, "{h:?}");
        assert!(
            h.error.as_deref().is_some_and(|e| e.contains("local copy")),
            "{h:?}"
        );
        assert_eq!(h.written_version, None);
        // Written although nothing changed, retried through two failures.
        eventually("the reconciling write", || !store.inner.writes().is_empty()).await;
        let first = &store.inner.writes()[0];
        assert!(
            ["web", "busy"].iter().all(|s| first.contains_key(*s)),
            "{first:?}"
        );
        let failed = state
            .metrics
            .store_writes
            .get_or_create(&crate::metrics::Reason {
                reason: "error".into(),
            })
            .get();
        assert_eq!(failed, 2);
        // What the store held newer is restored where nothing live is replaced…
        eventually("newer services restored", || {
            let b = state.balancer();
            b.service("web").is_some_and(|s| s.version == 9)
                && b.service("gone").is_some_and(|s| s.version == 3)
        })
        .await;
        // …and the live service is written over the store's.
        eventually("the live service written again", || {
            store.inner.writes().len() >= 2
        })
        .await;
        let second = &store.inner.writes()[1];
        assert!(
            second
                .get("busy")
                .is_some_and(|s| s.version == busy_version),
            "{second:?}"
        );
        assert!(second.contains_key("mixed"), "{second:?}");
        assert!(!second.contains_key("web"), "{second:?}");
        assert!(state
            .balancer()
            .service("mixed")
            .is_some_and(|s| s.endpoints().contains_key("m2")));
        assert_eq!(
            state.balancer().service("busy").map(|s| s.version),
            Some(busy_version)
        );
        let h = health(&state);
        assert_eq!(
            (h.status, h.error.clone()),
            (StoreCondition::Ok, None),
            "{h:?}"
        );
        task.abort();
    }

    #[test]
    fn a_store_failing_for_five_minutes_is_unhealthy_and_a_good_write_clears_it() {
        let status = StoreStatus::default();
        let now = Instant::now();
        {
            let mut p = status.lock();
            p.error = Some("etcd is gone".into());
            p.failing_since = now.checked_sub(Duration::from_secs(200));
        }
        let h = status.health("test".into(), now);
        assert_eq!(h.status, StoreCondition::Error);
        assert!(!h.unhealthy(), "200 s is within the limit: {h:?}");
        let later = now + Duration::from_secs(101);
        assert!(status.health("test".into(), later).unhealthy());
        {
            let mut p = status.lock();
            p.error = None;
            p.failing_since = None;
        }
        let h = status.health("test".into(), later);
        assert_eq!(h.failing_seconds, None);
        assert!(!h.unhealthy());
    }

    #[test]
    fn a_change_made_during_a_write_waits_from_when_it_was_made() {
        let state = state(Arc::new(TestStore::default()));
        let mut tracker = Tracker::new(&state.published());
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let p1 = add_node(&state, "a");
        let due = tracker.differing(&p1, at(0), &|_| true);
        assert_eq!((due.len(), tracker.oldest()), (1, Some(at(0))));
        tracker.started(&due);
        // The same publication seen again while in flight is no newer change.
        tracker.differing(&p1, at(1), &|_| true);
        let p2 = add_node(&state, "b");
        tracker.differing(&p2, at(2), &|_| true);
        assert_eq!(tracker.oldest(), Some(at(0)));
        tracker.committed();
        assert_eq!((tracker.pending(), tracker.oldest()), (1, Some(at(2))));
        // A failed write leaves the wait as it was.
        let due = tracker.differing(&p2, at(3), &|_| true);
        tracker.started(&due);
        let p3 = add_node(&state, "c");
        tracker.differing(&p3, at(4), &|_| true);
        tracker.failed();
        assert_eq!(tracker.oldest(), Some(at(2)));
        let due = tracker.differing(&p3, at(5), &|_| true);
        tracker.started(&due);
        tracker.committed();
        assert!(tracker.differing(&p3, at(6), &|_| true).is_empty());
        assert_eq!((tracker.pending(), tracker.oldest()), (0, None));
    }

    #[test]
    fn the_backoff_is_bounded() {
        assert_eq!(backoff(1), RETRY_FIRST);
        assert_eq!(backoff(2), 2 * RETRY_FIRST);
        assert_eq!(backoff(100), RETRY_MAX);
        assert_eq!(backoff(u32::MAX), RETRY_MAX);
    }
}
