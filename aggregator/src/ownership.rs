//! Which replica of a cluster owns which services, with no I/O: the hashes, the key
//! names, and [`Ownership`], which says whether this replica may serve and write a
//! service now, and with which fencing revision.
//!
//! Service names hash into a fixed number of buckets, and each bucket has at most one
//! owner at a time, the replica holding its owner key in etcd
//! (`<prefix>/cluster/<name>/owners/<bucket>`) under the lease that also keeps the
//! replica's member key (`<prefix>/cluster/<name>/members/<replica>`) alive. A bucket
//! goes to the live member that rendezvous hashing ranks first for it, so a replica
//! that joins or leaves moves only the buckets it gains or had.
//!
//! It is a leaf: the routing store (which fences its writes by it), ingest (which takes
//! only the agents of owned services), the state and the cluster's etcd side (which
//! claims, renews and resigns) all read it, and it reads none of them.

use ballast_ingest::routes_feed::Reading;
use ballast_shared::trunk::routes::RouteTable;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub use ballast_etcd::cluster::{
    bucket_of, cluster_prefix, config_key, member_key, owner_key, preferred,
};

/// Whether a replica with `ownership` balances `service` itself: always, for a lone
/// aggregator (`None`), which owns every service. The routing store writes only those.
pub fn balances(ownership: Option<&Ownership>, service: &str) -> bool {
    ownership.is_none_or(|o| o.owns(service))
}

/// What this replica may do with each bucket now. Written by the cluster task, read by
/// ingest (may it take this agent?) and the routing store (may it write this service,
/// and under which fence?).
#[derive(Debug)]
pub struct Ownership {
    /// This replica's name in the cluster.
    replica: String,
    /// Per bucket, the create revision of this replica's owner key, the fencing token
    /// every write compares; 0 when the bucket is not this replica's.
    fences: Box<[AtomicI64]>,
    /// Per bucket, the QUIC address of its owner as last seen, for refusals that point
    /// agents on.
    owners: RwLock<Vec<Option<Arc<str>>>>,
    /// Moves on every bucket this replica loses, so that connections can check
    /// whether their service went with it.
    lost: tokio::sync::watch::Sender<u64>,
    /// Each reading of the cluster's keys, as the routes relays follow
    /// ([`ballast_ingest::routes_feed`]); `None` before the first.
    routes: tokio::sync::watch::Sender<Option<Reading>>,
    /// Buckets taken over since start.
    takeovers: AtomicU64,
    /// What [`Ownership::valid_until`] counts from.
    base: Instant,
    /// Until when, in milliseconds from `base`, the lease is known to be valid (its
    /// last acknowledged renewal, less a margin). Past it every fence reads as gone,
    /// whatever the cluster task is doing, so that nothing is written or accepted
    /// once etcd may have handed the buckets on.
    valid_until_ms: AtomicU64,
    /// When, in milliseconds from `base`, etcd last confirmed that this replica's watch
    /// of the stored services is current (an event, or the answer to a progress
    /// request); 0 before the first.
    feed_confirmed_ms: AtomicU64,
}

/// How long without etcd confirming the services watch before a replica reports
/// itself behind: ten of the progress requests it sends every half second.
pub const FEED_BEHIND_AFTER: Duration = Duration::from_secs(5);

impl Ownership {
    /// Owning nothing yet, with `buckets` buckets.
    pub fn new(replica: &str, buckets: u32) -> Self {
        let n = usize::try_from(buckets.max(1)).unwrap_or(1);
        Ownership {
            replica: replica.to_string(),
            fences: (0..n).map(|_| AtomicI64::new(0)).collect(),
            owners: RwLock::new(vec![None; n]),
            lost: tokio::sync::watch::channel(0).0,
            routes: tokio::sync::watch::channel(None).0,
            takeovers: AtomicU64::new(0),
            base: Instant::now(),
            valid_until_ms: AtomicU64::new(0),
            feed_confirmed_ms: AtomicU64::new(0),
        }
    }

    /// Milliseconds since `base`.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records that etcd has just confirmed the services watch current: what this
    /// replica serves of the services it does not own is what etcd holds.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn feed_confirmed(&self) {
        self.feed_confirmed_ms
            .store(self.now_ms().max(1), Ordering::Release);
    }

    /// How long since etcd last confirmed the services watch current, or since start if
    /// it never has: how far behind etcd what this replica serves may be.
    pub fn feed_behind(&self) -> Duration {
        let confirmed = self.feed_confirmed_ms.load(Ordering::Acquire);
        Duration::from_millis(self.now_ms().saturating_sub(confirmed))
    }

    /// Whether this replica follows etcd: confirmed current at least once, and within
    /// [`FEED_BEHIND_AFTER`].
    pub fn following(&self) -> bool {
        self.feed_confirmed_ms.load(Ordering::Acquire) > 0
            && self.feed_behind() <= FEED_BEHIND_AFTER
    }

    /// Records that the lease is known valid until `until`.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn valid_until(&self, until: Instant) {
        let ms = until.saturating_duration_since(self.base).as_millis();
        self.valid_until_ms
            .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Whether the lease may have lapsed: past the last known validity.
    fn expired(&self) -> bool {
        self.now_ms() >= self.valid_until_ms.load(Ordering::Acquire)
    }

    /// This replica's name.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// How many buckets there are.
    pub fn buckets(&self) -> u32 {
        u32::try_from(self.fences.len()).unwrap_or(u32::MAX)
    }

    /// The bucket `service` hashes into.
    pub fn bucket(&self, service: &str) -> u32 {
        bucket_of(service, self.buckets())
    }

    fn slot(&self, bucket: u32) -> Option<&AtomicI64> {
        self.fences.get(usize::try_from(bucket).ok()?)
    }

    /// The fencing revision under which this replica owns `bucket`, if it does (and
    /// its lease is not past its known validity).
    pub fn fence(&self, bucket: u32) -> Option<i64> {
        let rev = self.slot(bucket)?.load(Ordering::Acquire);
        (rev > 0 && !self.expired()).then_some(rev)
    }

    /// Whether this replica owns `service` now.
    pub fn owns(&self, service: &str) -> bool {
        self.fence(self.bucket(service)).is_some()
    }

    /// How many buckets this replica owns now.
    pub fn owned(&self) -> usize {
        (0..self.buckets())
            .filter(|b| self.fence(*b).is_some())
            .count()
    }

    /// Records that this replica holds `bucket` under fencing revision `rev` (> 0).
    /// Returns whether it is new, a takeover.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn gained(&self, bucket: u32, rev: i64) -> bool {
        let Some(slot) = self.slot(bucket) else {
            return false;
        };
        let before = slot.swap(rev, Ordering::AcqRel);
        let new = before != rev;
        if new {
            self.takeovers.fetch_add(1, Ordering::Relaxed);
        }
        new
    }

    /// Records that `bucket` is no longer this replica's; returns whether it was.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn lost(&self, bucket: u32) -> bool {
        let was = self
            .slot(bucket)
            .is_some_and(|s| s.swap(0, Ordering::AcqRel) > 0);
        if was {
            self.lost.send_modify(|n| *n = n.wrapping_add(1));
        }
        was
    }

    /// Gives up every bucket at once (the lease is gone or cannot be renewed in
    /// time); returns the buckets that were held.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn lose_all(&self) -> Vec<u32> {
        // No member now: its last reading must not be served as current.
        self.routes.send_replace(None);
        let held: Vec<u32> = (0..self.buckets())
            .filter(|b| self.slot(*b).is_some_and(|s| s.load(Ordering::Acquire) > 0))
            .collect();
        for b in &held {
            self.lost(*b);
        }
        held
    }

    /// Notes the QUIC address agents of `bucket` should go to.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn set_owner_address(&self, bucket: u32, address: Option<Arc<str>>) {
        let mut owners = self.owners.write().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = usize::try_from(bucket).ok().and_then(|i| owners.get_mut(i)) {
            *slot = address;
        }
    }

    /// Where the owner of `service` takes agents, as last seen.
    pub fn owner_address(&self, service: &str) -> Option<Arc<str>> {
        let owners = self.owners.read().unwrap_or_else(|p| p.into_inner());
        usize::try_from(self.bucket(service))
            .ok()
            .and_then(|i| owners.get(i).cloned().flatten())
    }

    /// Publishes a reading of the cluster's keys to the relays that follow the routes
    /// here: every reading, changed or not, since each is what confirms a relay's
    /// routes current.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn publish_routes(&self, table: RouteTable) {
        self.routes.send_replace(Some(Reading {
            table: Arc::new(table),
            at: Instant::now(),
        }));
    }

    /// The readings of the cluster's keys, as [`Ownership::publish_routes`] gives them.
    pub fn watch_routes(&self) -> tokio::sync::watch::Receiver<Option<Reading>> {
        self.routes.subscribe()
    }

    /// A receiver that sees a change whenever this replica loses a bucket.
    pub fn watch_losses(&self) -> tokio::sync::watch::Receiver<u64> {
        self.lost.subscribe()
    }

    /// Buckets taken over since start.
    pub fn takeovers(&self) -> u64 {
        self.takeovers.load(Ordering::Relaxed)
    }

    /// Why `service` is refused here: it belongs to another replica (named with its
    /// address when known) or to none yet.
    pub fn refusal(&self, service: &str) -> String {
        match self.owner_address(service) {
            Some(addr) => format!(
                "service {service:?} is served by another replica of this cluster, at {addr}"
            ),
            None => {
                format!("service {service:?} has no owner in this cluster yet; try again shortly")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_stable_and_spread() {
        // Fixed values: a change of hash would move every service of a running cluster
        // when replicas of two releases run side by side.
        assert_eq!(bucket_of("api", 64), bucket_of("api", 64));
        let mut counts = [0u32; 16];
        for i in 0..16_000 {
            counts[bucket_of(&format!("svc-{i}"), 16) as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn rendezvous_moves_only_what_a_new_member_wins() {
        let three = ["a", "b", "c"];
        let four = ["a", "b", "c", "d"];
        let mut moved = 0;
        let mut to_d = 0;
        for b in 0..1024 {
            let before = preferred(three.iter().copied(), b).expect("a member");
            let after = preferred(four.iter().copied(), b).expect("a member");
            if before != after {
                moved += 1;
                assert_eq!(after, "d", "bucket {b} moved between old members");
            }
            if after == "d" {
                to_d += 1;
            }
        }
        assert_eq!(moved, to_d);
        // About a quarter moves to the fourth member.
        assert!((200..320).contains(&moved), "{moved} of 1024 moved");
        assert_eq!(preferred(std::iter::empty(), 3), None);
    }

    #[test]
    fn ownership_fences_and_losses() {
        let o = Ownership::new("r1", 8);
        let b = o.bucket("api");
        assert!(!o.owns("api"));
        o.valid_until(Instant::now() + std::time::Duration::from_secs(60));
        let losses = o.watch_losses();
        assert!(o.gained(b, 42));
        assert!(!o.gained(b, 42), "the same claim is not a new takeover");
        assert_eq!(o.fence(b), Some(42));
        assert!(o.owns("api") && o.owned() == 1 && o.takeovers() == 1);
        // Past the lease's known validity nothing is owned, whatever was claimed.
        o.valid_until(Instant::now());
        assert!(!o.owns("api") && o.fence(b).is_none());
        o.valid_until(Instant::now() + std::time::Duration::from_secs(60));
        assert_eq!(o.lose_all(), vec![b]);
        assert!(!o.owns("api"));
        assert!(losses.has_changed().unwrap_or(false));
        assert!(!o.lost(b), "already lost");
        o.set_owner_address(b, Some(Arc::from("10.0.0.2:7400")));
        assert!(o.refusal("api").contains("10.0.0.2:7400"));
        assert_eq!(o.fence(999), None);
    }

    #[test]
    fn the_feed_is_behind_until_etcd_confirms_it() {
        let o = Ownership::new("r1", 8);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let never = o.feed_behind();
        assert!(never >= std::time::Duration::from_millis(20), "{never:?}");
        assert!(!o.following(), "never confirmed");
        o.feed_confirmed();
        assert!(o.following());
        assert!(o.feed_behind() < never, "{:?}", o.feed_behind());
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(o.feed_behind() >= std::time::Duration::from_millis(20));
    }
}
