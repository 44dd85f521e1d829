//! The replica's side of the cluster in etcd: one lease, renewed here, under which
//! the replica's member key and every owner key it holds live; and the loop that
//! claims the buckets rendezvous hashing gives it, resigns those it no longer should
//! hold, and takes over a bucket's services from what their last owner stored.
//!
//! **No two writers.** Every write of a service's weights is a transaction that
//! compares its bucket's owner key with the create revision this replica got when it
//! claimed it ([`crate::store::etcd`]). The key is bound to the replica's lease, so it
//! vanishes when the lease lapses, and a new owner's key has a higher create revision:
//! a replica that lost its lease cannot write, whatever it believes. It also stops
//! believing early: when no renewal has been acknowledged for the lease's time to live
//! less a margin, it gives up every bucket before etcd can hand them on.
//!
//! **Takeover.** A bucket is claimed with a transaction that creates its owner key only
//! if it is absent. The services stored for it are then read and restored with their
//! weights and cycle numbers, and only then does the replica take the bucket's agents
//! and write: weights carry on, with no cold start.
//!
//! A claim is not queued behind the holder, as an etcd election campaign would be: a
//! replica claims only buckets whose owner key is absent, and the reconciling loop
//! runs on every change under the cluster's prefix (an etcd watch) and twice a second,
//! so a bucket whose owner died is claimed as soon as etcd deletes the key.

use super::requests::{Answerer, Answering};
use super::{
    cluster_prefix, config_key, member_key, owner_key, parse_view, preferred, ClusterKv, OwnerKey,
    Ownership, View,
};
use crate::config::ClusterConfig;
use crate::door::Door;
use crate::metrics::Metrics;
use crate::store::etcd::EtcdStore;
use crate::store::etcd::{decode_entry, service_from_key, services_prefix};
use ballast_shared::trunk::routes::RouteTable;
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, WatchOptions, WatchResponse, WatchStream,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long before the lease's end, as last renewed, the replica stops writing.
const LEASE_MARGIN: Duration = Duration::from_millis(500);
/// How often the loop reconciles when etcd reports no change.
const RECONCILE_EVERY: Duration = Duration::from_millis(500);
/// How long after a failed session the replica tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// One replica's membership of a cluster.
pub(crate) struct Replica {
    /// How each move of services in or out of the balancer is asked of the cycle loop.
    door: Door,
    metrics: Arc<Metrics>,
    store: Arc<EtcdStore>,
    ownership: Arc<Ownership>,
    cluster: String,
    advertise: String,
    lease_ttl_s: u32,
    /// Turns true when the daemon shuts down: the replica hands its buckets on at once.
    stop: tokio::sync::watch::Receiver<bool>,
    /// Applies the operators' actions other replicas received for its services, in a
    /// task of its own that [`Replica::run`] starts.
    answerer: Option<Answerer>,
    /// How this task asks it to, without ever waiting for it.
    answering: Answering,
}

impl Replica {
    /// The replica `ownership` describes, on `store`'s etcd, taking agents at
    /// `advertise`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        door: Door,
        metrics: Arc<Metrics>,
        store: Arc<EtcdStore>,
        ownership: Arc<Ownership>,
        cfg: &ClusterConfig,
        advertise: String,
        stop: tokio::sync::watch::Receiver<bool>,
        audit: Arc<crate::audit::Audit>,
    ) -> Self {
        let answerer = Answerer::new(
            door.clone(),
            audit,
            ownership.clone(),
            metrics.clone(),
            &store,
            &cfg.name,
        );
        Replica {
            answering: answerer.answering(),
            answerer: Some(answerer),
            door,
            metrics,
            store,
            ownership,
            cluster: cfg.name.clone(),
            advertise,
            lease_ttl_s: cfg.lease_ttl_s,
            stop,
        }
    }

    /// What answers other replicas' requests for actions, for the caller to run as a
    /// task of its own under the daemon's supervisor: answering never holds up the
    /// renewal of the lease. It ends when this replica does (its `Answering` dropped).
    pub(crate) fn take_answerer(&mut self) -> Option<Answerer> {
        self.answerer.take()
    }

    /// Runs until the daemon stops: a session per lease, another after any failure.
    /// The requests for actions are answered only while the task of
    /// [`Replica::take_answerer`] runs.
    pub(crate) async fn run(self) {
        let mut failing = false;
        loop {
            let started = Instant::now();
            let (error, held_lease, (held, gone)) = self.session().await;
            if *self.stop.borrow() {
                tracing::info!(
                    buckets = held,
                    services = gone,
                    "cluster replica stopping: its buckets are handed on"
                );
                return;
            }
            if held_lease {
                tracing::warn!(error = %error, buckets = held, services = gone,
                    "cluster session ended: this replica balances none of its services, \
                     and serves them as last published, until it holds a lease again");
                self.metrics.cluster_sessions_lost.inc();
                failing = false;
            } else if !failing {
                // Logged once for a run of failures: etcd may be down for a while.
                tracing::warn!(error = %error, "cannot join the cluster; retrying every second");
                failing = true;
            }
            let wait = RETRY_AFTER.saturating_sub(started.elapsed().min(RETRY_AFTER));
            tokio::time::sleep(wait.max(Duration::from_millis(100))).await;
        }
    }

    fn timeout(&self) -> Duration {
        self.store.request_timeout()
    }

    /// Bounds a call to etcd by the store's request timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, String> {
        tokio::time::timeout(self.timeout(), call)
            .await
            .map_err(|_| format!("{what} timed out after {:?}", self.timeout()))?
            .map_err(|e| format!("{what}: {e}"))
    }

    /// One lease's life: granted, kept, and used to hold buckets, until something
    /// fails. Returns why it ended, and whether a lease was held.
    async fn session(&self) -> (String, bool, (usize, usize)) {
        let mut client = match self.store.client().await {
            Ok(c) => c,
            Err(e) => return (e, false, self.give_up_all().await),
        };
        let lease = match self
            .bounded(
                "lease grant",
                client.lease_grant(i64::from(self.lease_ttl_s), None),
            )
            .await
        {
            Ok(l) => l,
            Err(e) => return (e, false, self.give_up_all().await),
        };
        let id = lease.id();
        let outcome = self.with_lease(&mut client, id, lease.ttl()).await;
        // Writes and agents stop first; then, best effort, the revoked lease frees the
        // buckets at once instead of after its time to live.
        let given_up = self.give_up_all().await;
        let _ = tokio::time::timeout(Duration::from_millis(500), client.lease_revoke(id)).await;
        (outcome, true, given_up)
    }

    /// Gives up every bucket, and lets go of every service: how many of each.
    async fn give_up_all(&self) -> (usize, usize) {
        let held = self.ownership.lose_all();
        let gone = self.sweep().await;
        self.metrics.cluster_buckets_owned.set(0);
        (held.len(), gone)
    }

    /// Lets go of every service this replica balances but does not own now (lost
    /// buckets, and anything a race with ingest left behind), and of their pending
    /// writes. Idempotent: it runs after every reconciling pass, failed or not.
    async fn sweep(&self) -> usize {
        self.store.drop_unowned_pending();
        let ownership = self.ownership.clone();
        self.door
            .hand_over(move |service| !ownership.owns(service))
            .await
            .len()
    }

    /// Holds lease `id` until it lapses or cannot be renewed in time. Losing etcd for
    /// less than that (a member restarting, a leader election) costs nothing: the
    /// renewals and watches are made again, and the buckets are kept.
    async fn with_lease(&self, client: &mut Client, id: i64, ttl_s: i64) -> String {
        let ttl = Duration::from_secs(u64::try_from(ttl_s.max(1)).unwrap_or(1));
        let prefix = self.store.prefix().to_string();
        let me = self.ownership.replica().to_string();
        if let Err(e) = self.join(client, id, &prefix, &me).await {
            return e;
        }
        tracing::info!(replica = %me, cluster = %self.cluster, lease = id, ttl_s,
            "cluster member: holding a lease");
        let mut valid_until = Instant::now() + ttl.saturating_sub(LEASE_MARGIN);
        self.ownership.valid_until(valid_until);
        let mut keeper = None;
        let mut members: Option<WatchStream> = None;
        let mut services: Option<WatchStream> = None;
        let mut renew = tokio::time::interval(ttl / 3);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll = tokio::time::interval(RECONCILE_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop = self.stop.clone();
        loop {
            if *stop.borrow_and_update() {
                // The caller gives every bucket up and revokes the lease: the other
                // replicas claim the buckets at once, not a TTL later.
                return "shutting down".into();
            }
            if members.is_none() || services.is_none() {
                match self.watches(client, &prefix).await {
                    Ok((m, s)) => {
                        (members, services) = (Some(m), Some(s));
                        // Watched first, then read: no write falls between the two.
                        match self.store.read_valid().await {
                            Ok(stored) => {
                                self.follow(stored).await;
                                self.ownership.feed_confirmed();
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "reading the stored services failed")
                            }
                        }
                        // Requests written while the watch was not there.
                        self.answering.scan();
                    }
                    Err(e) => tracing::warn!(error = %e, "cluster watch failed; retrying"),
                }
            }
            tokio::select! {
                _ = renew.tick() => match self.renew(client, id, &mut keeper).await {
                    Ok(Some(until)) => {
                        valid_until = until;
                        self.ownership.valid_until(until);
                    }
                    Ok(None) => return "the lease expired".into(),
                    Err(e) => {
                        tracing::warn!(error = %e, "lease renewal failed");
                        keeper = None;
                    }
                },
                m = next(&mut services) => match m {
                    // A watch etcd cancelled (compacted past it) is made again, and
                    // the services read again.
                    Ok(Some(resp)) if resp.canceled() => services = None,
                    // Events, or the answer to a progress request (none): either way
                    // etcd has sent everything up to its revision.
                    Ok(Some(resp)) => {
                        if self.follow_events(&prefix, &resp).await {
                            self.ownership.feed_confirmed();
                        } else {
                            services = None;
                        }
                    }
                    Ok(None) | Err(_) => services = None,
                },
                m = next(&mut members) => match m {
                    Ok(Some(resp)) if resp.canceled() => members = None,
                    Ok(Some(resp)) => {
                        // Operators' actions handed on by other replicas are answered;
                        // anything else under the cluster's keys may move buckets.
                        if self.answer_events(&resp) {
                            if let Err(e) = self.reconcile(client, id).await {
                                tracing::warn!(error = %e, "cluster reconcile failed");
                            }
                        }
                    }
                    Ok(None) | Err(_) => members = None,
                },
                _ = poll.tick() => {
                    if let Err(e) = self.reconcile(client, id).await {
                        tracing::warn!(error = %e, "cluster reconcile failed");
                    }
                    // An idle watch says nothing: ask etcd to confirm it is current,
                    // which is what tells a replica cut off from etcd that it is.
                    if let Some(w) = services.as_mut() {
                        if let Err(e) = self.bounded("watch progress", w.request_progress()).await {
                            tracing::warn!(error = %e, "asking etcd for the watch's progress failed");
                            services = None;
                        }
                    }
                }
                _ = stop.changed() => continue,
            }
            if Instant::now() >= valid_until {
                return format!(
                    "the lease was not renewed in time (no acknowledgement for {ttl:?} less \
                     {LEASE_MARGIN:?})"
                );
            }
        }
    }

    /// Checks that this replica hashes services as the cluster does, and puts its
    /// member key under lease `id`, refusing a name another live process holds.
    async fn join(
        &self,
        client: &mut Client,
        id: i64,
        prefix: &str,
        me: &str,
    ) -> Result<(), String> {
        let config = config_key(prefix, &self.cluster);
        let buckets = self.ownership.buckets().to_string();
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                config.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![TxnOp::put(config.clone(), buckets.clone(), None)])
            .or_else(vec![TxnOp::get(config, None)]);
        let resp = self.bounded("cluster settings", client.txn(txn)).await?;
        if !resp.succeeded() {
            let theirs = resp.op_responses().into_iter().find_map(|r| match r {
                etcd_client::TxnOpResponse::Get(g) => g
                    .kvs()
                    .first()
                    .and_then(|kv| kv.value_str().ok().map(str::to_string)),
                _ => None,
            });
            if theirs.as_deref() != Some(buckets.as_str()) {
                return Err(format!(
                    "this replica has buckets = {buckets}, and cluster {} has {}: every \
                     replica must hash services the same way, or two would own one",
                    self.cluster,
                    theirs.unwrap_or_else(|| "an unreadable setting".into())
                ));
            }
        }
        let key = member_key(prefix, &self.cluster, me);
        let txn = create(key, self.advertise.clone(), id);
        let resp = self.bounded("member key", client.txn(txn)).await?;
        if !resp.succeeded() {
            return Err(format!(
                "the replica name {me:?} is held by another live member of cluster {} (or \
                 by this replica's previous run, until its lease lapses)",
                self.cluster
            ));
        }
        Ok(())
    }

    /// Watches of the cluster's keys and of every stored service.
    async fn watches(
        &self,
        client: &mut Client,
        prefix: &str,
    ) -> Result<(WatchStream, WatchStream), String> {
        let members = self
            .bounded(
                "watch",
                client.watch(
                    cluster_prefix(prefix, &self.cluster),
                    Some(WatchOptions::new().with_prefix()),
                ),
            )
            .await?;
        let services = self
            .bounded(
                "watch",
                client.watch(
                    services_prefix(prefix),
                    Some(WatchOptions::new().with_prefix()),
                ),
            )
            .await?;
        Ok((members, services))
    }

    /// Renews lease `id` once, opening the keep-alive stream first if need be: when
    /// the lease is valid until now, less the margin (`Some`), or `None` when etcd
    /// says it has expired.
    async fn renew(
        &self,
        client: &mut Client,
        id: i64,
        keeper: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    ) -> Result<Option<Instant>, String> {
        let sent = Instant::now();
        let (k, acks) = match keeper {
            Some(k) => k,
            None => keeper.insert(
                self.bounded("lease keep-alive", client.lease_keep_alive(id))
                    .await?,
            ),
        };
        let ack = tokio::time::timeout(self.timeout(), async {
            k.keep_alive().await?;
            acks.message().await
        })
        .await
        .map_err(|_| format!("lease renewal timed out after {:?}", self.timeout()))?
        .map_err(|e| format!("lease renewal: {e}"))?;
        match ack {
            Some(r) if r.ttl() > 0 => {
                let left = Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(0));
                Ok(Some(sent + left.saturating_sub(LEASE_MARGIN)))
            }
            Some(_) => Ok(None),
            None => Err("the keep-alive stream ended".into()),
        }
    }

    /// Follows the services a watch response shows written; a chunked value is read
    /// whole at the revision of its write. Whether every one was followed: a chunk read
    /// that fails leaves its service as this replica last had it, and the caller makes
    /// the watch again, which reads every service anew.
    async fn follow_events(&self, prefix: &str, resp: &WatchResponse) -> bool {
        let mut stored = BTreeMap::new();
        let mut complete = true;
        for event in resp.events() {
            if event.event_type() != EventType::Put {
                continue;
            }
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key());
            // This replica's own writes need no reading back: it serves what it
            // balances (and `follow` would leave them alone anyway).
            if service_from_key(prefix, &key).is_some_and(|s| self.ownership.owns(s)) {
                continue;
            }
            let value = match self
                .store
                .whole(&key, kv.value().to_vec(), kv.mod_revision())
                .await
            {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(%key, error = %e, "reading a chunked service failed");
                    complete = false;
                    continue;
                }
            };
            match decode_entry(prefix, &key, &value) {
                Ok((service, snapshot)) => {
                    stored.insert(service, snapshot);
                }
                Err(corrupt) => tracing::warn!(%key, error = %corrupt,
                    "a stored service that is not a valid snapshot is not followed"),
            }
        }
        self.follow(stored).await;
        complete
    }

    /// Hands the requests for operators' actions that `resp` shows written to the
    /// answering task. Whether it shows anything else (or nothing), which the caller
    /// reconciles.
    fn answer_events(&self, resp: &WatchResponse) -> bool {
        let mut other = resp.events().is_empty();
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            if !self.answering.is_request(kv.key()) {
                other = true;
                continue;
            }
            if event.event_type() == EventType::Put {
                self.answering
                    .request(kv.key(), kv.value(), kv.mod_revision());
            }
        }
        other
    }

    /// Reads the cluster's members and owners, and publishes them as the routes.
    async fn view(&self, client: &mut Client) -> Result<View, String> {
        let prefix = cluster_prefix(self.store.prefix(), &self.cluster);
        let resp = self
            .bounded(
                "cluster read",
                client.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let kvs = resp.kvs().iter().map(|kv| ClusterKv {
            key: kv.key(),
            value: kv.value(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
        });
        let view = parse_view(&prefix, kvs);
        // Every reading goes to the relays that follow the routes here.
        let revision = resp.header().map_or(0, |h| h.revision());
        self.ownership.publish_routes(RouteTable::new(
            revision,
            view.buckets.unwrap_or_else(|| self.ownership.buckets()),
            &view.members,
            view.owners.iter().map(|(b, o)| (*b, o.replica.as_str())),
        ));
        Ok(view)
    }

    /// Brings what this replica holds in line with what it should (see
    /// [`Replica::reconcile_pass`]), then lets go of whatever it balances but does not
    /// own, however the pass ended.
    async fn reconcile(&self, client: &mut Client, lease: i64) -> Result<(), String> {
        let outcome = self.reconcile_pass(client, lease).await;
        self.sweep().await;
        self.metrics
            .cluster_buckets_owned
            .set(i64::try_from(self.ownership.owned()).unwrap_or(i64::MAX));
        outcome
    }

    /// Claims the absent buckets rendezvous hashing gives this replica, resigns those
    /// it should no longer hold, and notes those another holds.
    async fn reconcile_pass(&self, client: &mut Client, lease: i64) -> Result<(), String> {
        let view = self.view(client).await?;
        let me = self.ownership.replica().to_string();
        let prefix = self.store.prefix().to_string();
        let mut lost = Vec::new();
        let mut claimed = Vec::new();
        for b in 0..self.ownership.buckets() {
            let want = preferred(view.members.keys().map(String::as_str), b) == Some(&me);
            let key = owner_key(&prefix, &self.cluster, b);
            match view.owners.get(&b) {
                Some(OwnerKey {
                    replica: owner,
                    create_revision: rev,
                    lease: key_lease,
                }) if *owner == me && *key_lease == lease => {
                    if want {
                        // Held: taken over already, or claimed by a pass whose
                        // takeover failed, and taken over now.
                        if self.ownership.fence(b) != Some(*rev) {
                            claimed.push((b, *rev));
                        }
                    } else {
                        // Another member ranks first now: give it the bucket. Writes
                        // stop first, then the key goes.
                        if self.ownership.lost(b) {
                            lost.push(b);
                        }
                        let txn = release(key, *rev);
                        self.bounded("resign", client.txn(txn)).await?;
                        tracing::info!(
                            bucket = b,
                            "bucket handed to the replica that ranks first for it"
                        );
                    }
                }
                Some(OwnerKey {
                    replica: owner,
                    create_revision: rev,
                    ..
                }) if *owner == me => {
                    // Ours from an earlier lease, which is ending: free it now.
                    if self.ownership.lost(b) {
                        lost.push(b);
                    }
                    let txn = release(key, *rev);
                    self.bounded("release", client.txn(txn)).await?;
                }
                Some(OwnerKey { replica: owner, .. }) => {
                    if self.ownership.lost(b) {
                        lost.push(b);
                    }
                    self.ownership.set_owner_address(
                        b,
                        view.members.get(owner).map(|a| Arc::from(a.as_str())),
                    );
                }
                None => {
                    if self.ownership.lost(b) {
                        lost.push(b);
                    }
                    self.ownership.set_owner_address(b, None);
                    if want {
                        let txn = create(key, me.clone(), lease);
                        let resp = self.bounded("claim", client.txn(txn)).await?;
                        if resp.succeeded() {
                            let rev = resp.header().map_or(0, |h| h.revision());
                            if rev > 0 {
                                claimed.push((b, rev));
                            }
                        }
                    }
                }
            }
        }
        if !lost.is_empty() {
            let gone = self.sweep().await;
            tracing::info!(buckets = ?lost, services = gone, "buckets given up");
        }
        if !claimed.is_empty() {
            let taken = self.take_over(&claimed).await;
            if taken.is_ok() {
                // Actions handed on while nobody held these buckets are the new
                // owner's to apply.
                self.answering.scan();
            }
            if let Err(e) = taken {
                // Not held half-taken: given back, for this or another replica to
                // claim again.
                for (b, rev) in &claimed {
                    let key = owner_key(&prefix, &self.cluster, *b);
                    let txn = release(key, *rev);
                    let _ = self.bounded("release", client.txn(txn)).await;
                }
                return Err(format!("taking buckets over: {e}"));
            }
        }
        Ok(())
    }

    /// Restores the services stored for `claimed` buckets, then takes their agents
    /// and writes: in that order, so that no agent registers into a service the
    /// restore would then replace.
    async fn take_over(&self, claimed: &[(u32, i64)]) -> Result<(), String> {
        let buckets: BTreeSet<u32> = claimed.iter().map(|(b, _)| *b).collect();
        let stored = self.store.read_valid().await?;
        let mine: BTreeMap<_, _> = stored
            .into_iter()
            .filter(|(name, _)| buckets.contains(&self.ownership.bucket(name)))
            .collect();
        let restored = self.door.take_over(mine).await;
        for (b, rev) in claimed {
            self.ownership.gained(*b, *rev);
            self.ownership
                .set_owner_address(*b, Some(Arc::from(self.advertise.as_str())));
        }
        self.metrics.cluster_takeovers.inc_by(claimed.len() as u64);
        tracing::info!(buckets = ?buckets, services = restored,
            "buckets taken over: their services restored from etcd with their weights");
        Ok(())
    }

    /// Serves the services of `stored` that this replica does not own as their owners
    /// wrote them.
    async fn follow(&self, mut stored: BTreeMap<String, ballast_balance::ServiceSnapshot>) {
        stored.retain(|name, _| !self.ownership.owns(name));
        self.door.follow(stored).await;
    }
}

/// Creates `key` with `value` under `lease` if it is absent: a claim of a bucket, or
/// of a replica's name.
fn create(key: String, value: String, lease: i64) -> Txn {
    Txn::new()
        .when(vec![Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
}

/// Deletes owner key `key` if it is still the claim created at `rev`: a replica
/// never deletes another's claim.
fn release(key: String, rev: i64) -> Txn {
    Txn::new()
        .when(vec![Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            rev,
        )])
        .and_then(vec![TxnOp::delete(key, None)])
}

/// The next message of `watch`; never, while there is no watch.
async fn next(
    watch: &mut Option<WatchStream>,
) -> Result<Option<WatchResponse>, etcd_client::Error> {
    match watch {
        Some(w) => w.message().await,
        None => std::future::pending().await,
    }
}
