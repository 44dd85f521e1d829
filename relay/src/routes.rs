//! Where each service is served: the cluster's members and bucket owners, as the
//! replicas tell them.
//!
//! The relay follows two replicas at once with the routes protocol
//! ([`ballast_shared::trunk::routes`]), each lane taking the addresses it was given
//! (`[relay] replicas`), then every member the routes name, in turn. The replica sends the
//! cluster as it reads it from etcd, whenever that changes and at least every second;
//! each table is published as an [`Arc<Routes>`] on a `tokio::sync::watch`. A replica
//! that goes quiet, refuses, or is lost is left for the next address, with backoff;
//! the last routes stay published meanwhile. The relay holds no etcd credential: it
//! writes nothing and reads only what the replicas tell it, over its own mutual TLS.

use super::metrics::RelayMetrics;
use ballast_etcd::cluster::bucket_of;
use ballast_shared::reconnect::{host_part, Backoff};
use ballast_shared::trunk::routes::{RouteTable, RoutesMessage, ROUTES_CONFIRM};
use ballast_shared::trunk::{encode_control, ControlReader, ToPrimary, MAX_CONTROL_FRAME};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a replica may go without sending a table before the relay asks another:
/// it confirms its routes every [`ROUTES_CONFIRM`] while it reads etcd.
const SILENT_AFTER: Duration = Duration::from_secs(5);

/// How many replicas the relay follows the routes from at once ([`Follower::run`]
/// runs that many lanes).
const LANES: usize = 2;

/// The reason a lane gives up a replica the other lane follows under another name;
/// not a failure.
const DUPLICATE: &str = "duplicate";

/// How long a replica has to answer the dial.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS alert a server ends a handshake with when it speaks none of the
/// application protocols offered (RFC 7301).
const NO_APPLICATION_PROTOCOL: u8 = 120;

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
    /// The routes a replica's table says.
    pub(crate) fn from_table(table: &RouteTable) -> Self {
        Routes {
            buckets: Some(table.buckets),
            members: table.member_map(),
            owners: table.owner_map(),
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

/// When a replica last confirmed the routes current, for `/healthz`.
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

    /// How long since a replica last confirmed the routes, in milliseconds; `None` before
    /// the first reading.
    pub(crate) fn behind_ms(&self) -> Option<u64> {
        let at = self.confirmed_ms.load(Ordering::Relaxed).checked_sub(1)?;
        let now = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        Some(now.saturating_sub(at))
    }
}

/// Follows the cluster's routes from its replicas.
pub(crate) struct Follower {
    /// The relay's name, told to each replica.
    relay: String,
    /// The endpoint the routes connections are dialled from.
    endpoint: quinn::Endpoint,
    /// The relay's client identity, offering the routes protocol.
    client: quinn::ClientConfig,
    /// The name replicas' certificates are checked against, if not the host part of
    /// the address dialled.
    server_name: Option<String>,
    /// The addresses the relay was given.
    seeds: Vec<String>,
    tx: watch::Sender<Arc<Routes>>,
    freshness: Arc<Freshness>,
    metrics: Arc<RelayMetrics>,
    /// The address each lane follows now.
    lanes_at: Mutex<[Option<String>; LANES]>,
    /// The replica each lane is connected to, as the connection's remote address: two
    /// names of one replica (a seed's host name, the address it advertises) are one.
    lanes_peer: Mutex<[Option<SocketAddr>; LANES]>,
    /// The revision of the newest table published, and when.
    newest: Mutex<Option<(i64, Instant)>>,
}

/// A follower, the receiver of its routes, and their freshness.
pub(crate) type Following = (Follower, watch::Receiver<Arc<Routes>>, Arc<Freshness>);

/// What a follower dials with.
pub(crate) struct Dial {
    /// The relay's name.
    pub(crate) relay: String,
    /// The endpoint to dial from.
    pub(crate) endpoint: quinn::Endpoint,
    /// The relay's client identity, offering [`ballast_shared::trunk::routes::ROUTES_ALPN`].
    pub(crate) client: quinn::ClientConfig,
    /// The name replicas' certificates are checked against, if not the host part of
    /// each address.
    pub(crate) server_name: Option<String>,
    /// The replicas' addresses to start from.
    pub(crate) seeds: Vec<String>,
}

/// The follower of the routes the replicas at `dial.seeds` (and then every member)
/// tell, the receiver of its routes (empty until the first table) and their
/// freshness. Nothing is contacted yet.
pub(crate) fn follower(dial: Dial, metrics: Arc<RelayMetrics>) -> Following {
    let (tx, rx) = watch::channel(Arc::new(Routes::default()));
    let freshness = Arc::new(Freshness::new());
    let follower = Follower {
        relay: dial.relay,
        endpoint: dial.endpoint,
        client: dial.client,
        server_name: dial.server_name,
        seeds: dial.seeds,
        tx,
        freshness: freshness.clone(),
        metrics,
        lanes_at: Mutex::new(Default::default()),
        lanes_peer: Mutex::new(Default::default()),
        newest: Mutex::new(None),
    };
    (follower, rx, freshness)
}

/// How a routes connection ended: why, counted under which reason, and whether it
/// brought a table.
struct Ended {
    error: String,
    reason: &'static str,
    heard: bool,
}

impl Ended {
    fn before(reason: &'static str, error: String) -> Self {
        Ended {
            error,
            reason,
            heard: false,
        }
    }
}

impl Follower {
    /// The addresses to ask, in order: those given, then the members the routes name
    /// that are not among them.
    fn candidates(&self) -> Vec<String> {
        let mut out: Vec<String> = self.tx.borrow().members.values().cloned().collect();
        for seed in &self.seeds {
            if !out.contains(seed) {
                out.push(seed.clone());
            }
        }
        out
    }

    /// Follows the routes until the receivers are all gone, from [`LANES`] replicas
    /// at once where there are that many: a replica that dies leaves the other's
    /// tables coming, so that the relay hears of the new owners as soon as etcd does,
    /// not a silence later.
    pub(crate) async fn run(self) {
        tokio::join!(self.lane(0), self.lane(1));
    }

    /// One lane: one replica at a time, the next one free of the other lanes when a
    /// connection ends, with backoff.
    async fn lane(&self, lane: usize) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut next = lane;
        loop {
            let candidates = self.candidates();
            if candidates.is_empty() {
                tracing::error!(
                    "the relay has no replica to ask for the routes ([relay] replicas)"
                );
                self.tx.closed().await;
                return;
            }
            // The first address from `next` on that no other lane follows; none while
            // the relay knows fewer replicas than lanes (it learns of more from the
            // first table).
            let address = {
                let mut busy = self.lanes_at.lock().unwrap_or_else(|p| p.into_inner());
                let free = (0..candidates.len())
                    .map(|i| (next + i) % candidates.len())
                    .find(|i| {
                        candidates.get(*i).is_some_and(|c| {
                            !busy
                                .iter()
                                .enumerate()
                                .any(|(l, b)| l != lane && b.as_deref() == Some(c.as_str()))
                        })
                    });
                free.and_then(|i| {
                    next = i + 1;
                    let address = candidates.get(i).cloned()?;
                    if let Some(mine) = busy.get_mut(lane) {
                        *mine = Some(address.clone());
                    }
                    Some(address)
                })
            };
            let Some(address) = address else {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = self.tx.closed() => return,
                }
            };
            let ended = tokio::select! {
                ended = self.session(lane, &address) => ended,
                () = self.tx.closed() => return,
            };
            if let Some(peer) = self
                .lanes_peer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(lane)
            {
                *peer = None;
            }
            if let Some(mine) = self
                .lanes_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(lane)
            {
                *mine = None;
            }
            if ended.reason == DUPLICATE {
                // Another name of the replica the other lane follows: the next.
                tracing::debug!(replica = %address, "the other lane follows this replica");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = self.tx.closed() => return,
                }
            }
            self.metrics.routes_failed(ended.reason);
            if ended.heard {
                backoff.reset();
            }
            let wait = backoff.next_delay(&mut rand::thread_rng());
            tracing::warn!(replica = %address, error = %ended.error, retry_in = ?wait,
                "following the routes from a replica ended; the relay keeps the last routes and asks the next");
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.tx.closed() => return,
            }
        }
    }

    /// One connection's life: dial, open, then read tables until it ends.
    async fn session(&self, lane: usize, address: &str) -> Ended {
        let conn = match tokio::time::timeout(CONNECT_TIMEOUT, self.connect(address)).await {
            Ok(Ok(c)) => c,
            Ok(Err(ended)) => return ended,
            Err(_) => {
                return Ended::before(
                    "unreachable",
                    format!("{address} did not answer within {CONNECT_TIMEOUT:?}"),
                )
            }
        };
        {
            let mut peers = self.lanes_peer.lock().unwrap_or_else(|p| p.into_inner());
            let remote = conn.remote_address();
            let taken = peers
                .iter()
                .enumerate()
                .any(|(l, p)| l != lane && *p == Some(remote));
            if taken {
                drop(peers);
                conn.close(quinn::VarInt::from_u32(0), b"followed already");
                return Ended::before(
                    DUPLICATE,
                    format!("{address} is {remote}, followed already"),
                );
            }
            if let Some(mine) = peers.get_mut(lane) {
                *mine = Some(remote);
            }
        }
        let ended = self.follow(&conn).await;
        conn.close(quinn::VarInt::from_u32(0), b"routes followed elsewhere");
        ended
    }

    async fn connect(&self, address: &str) -> Result<quinn::Connection, Ended> {
        let unreachable = |e: String| Ended::before("unreachable", e);
        let addr: SocketAddr = tokio::net::lookup_host(address)
            .await
            .map_err(|e| unreachable(format!("resolving {address}: {e}")))?
            .next()
            .ok_or_else(|| unreachable(format!("{address} resolves to no address")))?;
        let name = self
            .server_name
            .as_deref()
            .unwrap_or_else(|| host_part(address));
        let connecting = self
            .endpoint
            .connect_with(self.client.clone(), addr, name)
            .map_err(|e| unreachable(format!("dialling {addr}: {e}")))?;
        connecting.await.map_err(|e| match &e {
            quinn::ConnectionError::ConnectionClosed(c)
                if c.error_code == quinn::TransportErrorCode::crypto(NO_APPLICATION_PROTOCOL) =>
            {
                Ended::before(
                    "no_routes_protocol",
                    format!(
                        "{address} speaks no routes protocol: a replica of a release whose \
                         relays read etcd themselves; upgrade the replicas before the relays \
                         ({e})"
                    ),
                )
            }
            _ => unreachable(format!("connecting to {addr}: {e}")),
        })
    }

    /// Opens the routes stream on `conn` and publishes every table it brings.
    async fn follow(&self, conn: &quinn::Connection) -> Ended {
        let lost = |e: String| Ended::before("lost", e);
        let (mut send, mut recv) = match conn.open_bi().await {
            Ok(s) => s,
            Err(e) => return lost(format!("opening the routes stream: {e}")),
        };
        let open = ToPrimary::Open {
            relay: self.relay.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let frame = match encode_control(&open) {
            Ok(f) => f,
            Err(e) => return lost(format!("the open frame: {e}")),
        };
        if let Err(e) = send.write_all(&frame).await {
            return lost(format!("writing the open: {e}"));
        }
        let mut reader = ControlReader::<RoutesMessage>::new();
        let mut buf = vec![0u8; MAX_CONTROL_FRAME];
        let mut heard = false;
        loop {
            let read = match tokio::time::timeout(SILENT_AFTER, recv.read(&mut buf)).await {
                Ok(r) => r,
                Err(_) => {
                    return Ended {
                        error: format!(
                            "no routes for {SILENT_AFTER:?} (a replica confirms them every \
                             {ROUTES_CONFIRM:?} while it reads etcd)"
                        ),
                        reason: "silent",
                        heard,
                    }
                }
            };
            let n = match read {
                Ok(Some(n)) => n,
                Ok(None) => {
                    return Ended {
                        error: "the replica ended the routes stream".into(),
                        reason: "lost",
                        heard,
                    }
                }
                Err(e) => {
                    return Ended {
                        error: format!("reading the routes: {e}"),
                        reason: "lost",
                        heard,
                    }
                }
            };
            let messages = match reader.push(buf.get(..n).unwrap_or_default()) {
                Ok(m) => m,
                Err(e) => {
                    return Ended {
                        error: format!("the replica's routes: {e}"),
                        reason: "malformed",
                        heard,
                    }
                }
            };
            for message in messages {
                match message {
                    RoutesMessage::Routes(table) => {
                        heard = true;
                        self.metrics.routes_received.inc();
                        // Only a table that stands confirms the routes current: an
                        // older reading than the other lane's says nothing of now.
                        if self.publish(&table) {
                            self.freshness.confirm();
                        }
                    }
                    RoutesMessage::Closed(reason) => {
                        return Ended {
                            error: format!("refused: {reason}"),
                            reason: "refused",
                            heard,
                        }
                    }
                }
            }
        }
    }

    /// Publishes `table`, unless another lane published a newer reading (of a later
    /// etcd revision) within the last silence: two replicas' readings interleave, and
    /// an older one must not undo a newer. (An etcd restored from a backup, whose
    /// revisions go back, is followed again after one silence.)
    fn publish(&self, table: &RouteTable) -> bool {
        {
            let mut newest = self.newest.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((revision, at)) = *newest {
                if table.revision < revision && at.elapsed() < SILENT_AFTER {
                    return false;
                }
            }
            *newest = Some((table.revision, Instant::now()));
        }
        let routes = Routes::from_table(table);
        self.tx.send_if_modified(|current| {
            if **current == routes {
                return false;
            }
            *current = Arc::new(routes);
            true
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_name_each_services_owner_from_a_replicas_table() {
        let buckets = 4;
        let members: BTreeMap<String, String> = [
            ("a".to_string(), "10.0.0.1:7400".to_string()),
            ("b".to_string(), "10.0.0.2:7400".to_string()),
        ]
        .into_iter()
        .collect();
        // a owns the buckets 0 and 1, b owns 2; 3 is held by a replica that is no
        // member any more (its member key lapsed first), so the table leaves it out.
        let table = RouteTable::new(
            7,
            buckets,
            &members,
            [(0, "a"), (1, "a"), (2, "b"), (3, "gone")],
        );
        let routes = Routes::from_table(&table);
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
        // Before any table nothing has an owner.
        let none = Routes::default();
        assert_eq!(none.owner("svc-1"), None);
        assert_eq!(none.owned_buckets(), 0);
    }
}
