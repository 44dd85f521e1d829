//! Where each service is served: the cluster's members and bucket owners, read from
//! etcd and followed by a watch.
//!
//! The relay reads the keys under the cluster's prefix (the bucket count, each
//! member's advertised QUIC address, each bucket's owner), then watches them from the
//! read's revision on, and publishes every new reading as an [`Arc<Routes>`] on a
//! `tokio::sync::watch`. It writes nothing: it is no member, so rendezvous hashing
//! never gives it a bucket. A lost etcd connection keeps the last routes published
//! and is made again with backoff.

use ballast_config::EtcdConfig;
use ballast_etcd::cluster::{bucket_of, cluster_prefix, parse_view, ClusterKv, View};
use ballast_etcd::Connection;
use etcd_client::{EventType, GetOptions, WatchOptions};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often an idle watch asks etcd to confirm that it is current.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Who serves what, as one reading of the cluster's keys says.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Routes {
    /// The bucket count services hash into; `None` until the cluster's config key is
    /// read, when no service has an owner.
    pub(crate) buckets: Option<u32>,
    /// Live replicas and the QUIC address each advertises.
    pub(crate) members: BTreeMap<String, String>,
    /// Each held bucket's owner.
    pub(crate) owners: BTreeMap<u32, String>,
}

/// The replica that serves a service, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The replica's name.
    pub(crate) replica: String,
    /// The QUIC address it advertises.
    pub(crate) address: String,
}

impl Routes {
    /// The routes a view amounts to.
    pub(crate) fn from_view(view: View) -> Self {
        Routes {
            buckets: view.buckets,
            members: view.members,
            owners: view
                .owners
                .into_iter()
                .map(|(bucket, owner)| (bucket, owner.replica))
                .collect(),
        }
    }

    /// The owner of `service`'s bucket, if it has one that is a live member.
    pub(crate) fn owner(&self, service: &str) -> Option<Owner> {
        let bucket = bucket_of(service, self.buckets?);
        let replica = self.owners.get(&bucket)?;
        let address = self.members.get(replica)?;
        Some(Owner {
            replica: replica.clone(),
            address: address.clone(),
        })
    }

    /// How many buckets have an owner that is a live member.
    pub(crate) fn owned_buckets(&self) -> usize {
        let Some(buckets) = self.buckets else {
            return 0;
        };
        self.owners
            .iter()
            .filter(|(b, r)| **b < buckets && self.members.contains_key(*r))
            .count()
    }
}

/// When etcd last confirmed the routes current, for `/healthz`.
#[derive(Debug)]
pub(crate) struct Freshness {
    base: Instant,
    /// Milliseconds from `base` of the last confirmation, plus one; 0 for none yet.
    confirmed_ms: AtomicU64,
}

impl Freshness {
    fn new() -> Self {
        Freshness {
            base: Instant::now(),
            confirmed_ms: AtomicU64::new(0),
        }
    }

    fn confirm(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.confirmed_ms
            .store(ms.saturating_add(1), Ordering::Relaxed);
    }

    /// How long since etcd last confirmed the routes, in milliseconds; `None` before
    /// the first reading.
    pub(crate) fn behind_ms(&self) -> Option<u64> {
        let at = self.confirmed_ms.load(Ordering::Relaxed).checked_sub(1)?;
        let now = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        Some(now.saturating_sub(at))
    }
}

/// Why the routes could not be followed.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    /// The etcd settings are unusable (a TLS or password file).
    #[error(transparent)]
    Setup(#[from] ballast_etcd::SetupError),
}

/// Follows one cluster's routes in etcd.
pub(crate) struct Follower {
    connection: Connection,
    prefix: String,
    tx: watch::Sender<Arc<Routes>>,
    freshness: Arc<Freshness>,
}

/// A follower, the receiver of its routes, and their freshness.
pub(crate) type Following = (Follower, watch::Receiver<Arc<Routes>>, Arc<Freshness>);

/// The follower of cluster `cluster` on `etcd`, the receiver of its routes (empty until
/// the first reading) and their freshness. Nothing is contacted yet.
pub(crate) fn follower(etcd: &EtcdConfig, cluster: &str) -> Result<Following, RoutesError> {
    let connection = Connection::new(&etcd.connect())?;
    let (tx, rx) = watch::channel(Arc::new(Routes::default()));
    let freshness = Arc::new(Freshness::new());
    let follower = Follower {
        connection,
        prefix: cluster_prefix(&etcd.prefix, cluster),
        tx,
        freshness: freshness.clone(),
    };
    Ok((follower, rx, freshness))
}

/// One key as the follower keeps it.
#[derive(Debug, Clone)]
struct Kept {
    value: Vec<u8>,
    create_revision: i64,
    lease: i64,
}

/// The routes the kept keys under `prefix` amount to.
fn routes_of(prefix: &str, kvs: &BTreeMap<Vec<u8>, Kept>) -> Routes {
    Routes::from_view(parse_view(
        prefix,
        kvs.iter().map(|(key, kept)| ClusterKv {
            key,
            value: &kept.value,
            create_revision: kept.create_revision,
            lease: kept.lease,
        }),
    ))
}

impl Follower {
    /// Follows the routes until the receivers are all gone: a session per etcd
    /// connection, made again with backoff when one ends.
    pub(crate) async fn run(self) {
        let mut backoff = ballast_shared::reconnect::Backoff::new(
            Duration::from_millis(200),
            Duration::from_secs(5),
        );
        loop {
            let (error, read) = self.session().await;
            if self.tx.is_closed() {
                return;
            }
            if read {
                backoff.reset();
            }
            let wait = backoff.next_delay(&mut rand::thread_rng());
            tracing::warn!(%error, retry_in = ?wait, "following the cluster's owners in etcd failed; the relay keeps the last routes");
            tokio::time::sleep(wait).await;
        }
    }

    async fn bounded<T, E: std::error::Error + 'static>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        let limit = self.connection.request_timeout();
        tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| format!("{what} timed out after {limit:?}"))?
            .map_err(|e| format!("{what}: {}", ballast_shared::error_chain(&e)))
    }

    /// One connection's life: read, then watch. Why it ended, and whether it read the
    /// routes.
    async fn session(&self) -> (String, bool) {
        let mut client = match self.connection.connect().await {
            Ok(c) => c,
            Err(e) => return (e, false),
        };
        let resp = match self
            .bounded(
                "reading the cluster",
                client.get(self.prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => return (e, false),
        };
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut kvs: BTreeMap<Vec<u8>, Kept> = resp
            .kvs()
            .iter()
            .map(|kv| {
                let kept = Kept {
                    value: kv.value().to_vec(),
                    create_revision: kv.create_revision(),
                    lease: kv.lease(),
                };
                (kv.key().to_vec(), kept)
            })
            .collect();
        self.publish(&kvs);
        self.freshness.confirm();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision.saturating_add(1))
            .with_progress_notify();
        let mut stream = match self
            .bounded(
                "watching the cluster",
                client.watch(self.prefix.clone(), Some(options)),
            )
            .await
        {
            Ok(s) => s,
            Err(e) => return (e, true),
        };
        let mut progress = tokio::time::interval(PROGRESS_EVERY);
        loop {
            tokio::select! {
                m = stream.message() => match m {
                    Ok(Some(resp)) if resp.canceled() => {
                        return ("etcd cancelled the watch (compacted past it)".into(), true)
                    }
                    Ok(Some(resp)) => {
                        let mut changed = false;
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            changed = true;
                            match event.event_type() {
                                EventType::Put => {
                                    kvs.insert(kv.key().to_vec(), Kept {
                                        value: kv.value().to_vec(),
                                        create_revision: kv.create_revision(),
                                        lease: kv.lease(),
                                    });
                                }
                                EventType::Delete => {
                                    kvs.remove(kv.key());
                                }
                            }
                        }
                        if changed {
                            self.publish(&kvs);
                        }
                        self.freshness.confirm();
                    }
                    Ok(None) => return ("the watch ended".into(), true),
                    Err(e) => return (format!("watch: {}", ballast_shared::error_chain(&e)), true),
                },
                _ = progress.tick() => {
                    if let Err(e) = self.bounded("watch progress", stream.request_progress()).await {
                        return (e, true);
                    }
                }
                () = self.tx.closed() => return ("the relay stopped".into(), true),
            }
        }
    }

    fn publish(&self, kvs: &BTreeMap<Vec<u8>, Kept>) {
        let routes = routes_of(&self.prefix, kvs);
        self.tx.send_if_modified(|current| {
            if **current == routes {
                return false;
            }
            *current = Arc::new(routes);
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str) -> (Vec<u8>, Kept) {
        let kept = Kept {
            value: value.as_bytes().to_vec(),
            create_revision: 7,
            lease: 1,
        };
        (key.as_bytes().to_vec(), kept)
    }

    #[test]
    fn routes_name_each_services_owner_from_the_cluster_keys() {
        let prefix = cluster_prefix("/ballast", "prod");
        let buckets = 4;
        // Every bucket owned: a to the buckets 0 and 1, b to 2; 3 by a replica that
        // is no member any more (its member key lapsed first).
        let fixture: BTreeMap<Vec<u8>, Kept> = [
            kv("/ballast/cluster/prod/config", "4"),
            kv("/ballast/cluster/prod/members/a", "10.0.0.1:7400"),
            kv("/ballast/cluster/prod/members/b", "10.0.0.2:7400"),
            kv("/ballast/cluster/prod/owners/00000", "a"),
            kv("/ballast/cluster/prod/owners/00001", "a"),
            kv("/ballast/cluster/prod/owners/00002", "b"),
            kv("/ballast/cluster/prod/owners/00003", "gone"),
            // Another cluster's keys are not this one's.
            kv("/ballast/cluster/other/members/c", "10.0.0.3:7400"),
        ]
        .into_iter()
        .collect();
        let routes = routes_of(&prefix, &fixture);
        assert_eq!(routes.buckets, Some(buckets));
        assert_eq!(routes.members.len(), 2);
        assert_eq!(routes.owned_buckets(), 3);
        let services: Vec<String> = (0..64).map(|i| format!("svc-{i}")).collect();
        for service in &services {
            let owner = routes.owner(service);
            match bucket_of(service, buckets) {
                0 | 1 => assert_eq!(
                    owner,
                    Some(Owner {
                        replica: "a".into(),
                        address: "10.0.0.1:7400".into()
                    })
                ),
                2 => assert_eq!(owner.map(|o| o.address), Some("10.0.0.2:7400".into())),
                _ => assert_eq!(owner, None, "{service}: its owner is no member"),
            }
        }
        // Without the bucket count nothing has an owner.
        let mut no_config = fixture.clone();
        no_config.remove("/ballast/cluster/prod/config".as_bytes());
        let routes = routes_of(&prefix, &no_config);
        assert_eq!(routes.owner("svc-1"), None);
        assert_eq!(routes.owned_buckets(), 0);
    }
}
