//! The etcd routing store: one key per service, `<prefix>/services/<service>`, holding
//! the service's [`ServiceSnapshot`] as JSON (endpoints, addresses, zones, states and
//! weights), so that load balancers and tools can watch one service's key.
//!
//! Writes are batched: the services a write carries go to etcd in one transaction (more
//! only past etcd's limits of [`MAX_TXN_OPS`] operations and about [`MAX_TXN_BYTES`]),
//! and a service whose value is byte for byte what this store last wrote or loaded is
//! left out.
//!
//! etcd going away must not stop the aggregator. A failed write keeps the services it
//! carried in a pending set and dates the outage; the next write, which the routing
//! store's writer makes on the next publication or after its backoff, carries the
//! latest value of every pending service, so etcd catches up without waiting for those
//! services to change again. Every network wait is bounded by `request_timeout_ms`.
//!
//! The client is async and runs on the daemon's runtime: the store owns no runtime and
//! no thread, and nothing in it blocks a worker.

use super::{RoutingStore, StoreError, StoreFuture};
use crate::config::EtcdConfig;
use ballast_balance::ServiceSnapshot;
use etcd_client::{Client, ConnectOptions, GetOptions, KvClient, Txn, TxnOp};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// etcd's default `--max-txn-ops`: a larger batch is split into transactions of this
/// many puts, or etcd would refuse it whole.
pub(crate) const MAX_TXN_OPS: usize = 128;
/// The most value bytes put in one transaction: etcd refuses requests over 1.5 MiB
/// (`--max-request-bytes`), so a batch of big snapshots is split well below that. A
/// single service larger than this still goes alone.
pub(crate) const MAX_TXN_BYTES: usize = 1 << 20;
/// The largest response `load` accepts: every service of a big fleet in one range read
/// is well over tonic's default of 4 MiB.
const MAX_RESPONSE_BYTES: usize = 256 << 20;

/// The range all service keys live in: `<prefix>/services/`. The trailing `/` keeps a
/// prefix `/ballast` from reading the keys of `/ballast2`.
pub(crate) fn services_prefix(prefix: &str) -> String {
    format!("{prefix}/services/")
}

/// The key of one service: `<prefix>/services/<service>`.
pub(crate) fn service_key(prefix: &str, service: &str) -> String {
    format!("{}{service}", services_prefix(prefix))
}

/// The service a key names, if it is a service key under `prefix` with a valid name.
pub(crate) fn service_from_key<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
    key.strip_prefix(&services_prefix(prefix))
        .filter(|s| !s.is_empty() && ballast_shared::wire::is_valid_name(s))
}

/// Splits a batch into transactions etcd accepts: at most [`MAX_TXN_OPS`] puts and,
/// unless one value alone is larger, at most [`MAX_TXN_BYTES`] of values each.
fn txn_chunks(batch: &[(String, Vec<u8>)]) -> Vec<&[(String, Vec<u8>)]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (service, value)) in batch.iter().enumerate() {
        let size = service.len() + value.len();
        if i > start && (i - start == MAX_TXN_OPS || bytes + size > MAX_TXN_BYTES) {
            chunks.push(&batch[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < batch.len() {
        chunks.push(&batch[start..]);
    }
    chunks
}

/// Why etcd is considered unreachable.
#[derive(Debug, Clone)]
struct Outage {
    since: Instant,
    error: String,
}

/// What etcd holds and what is still to be written: the bookkeeping of batching,
/// skipping unchanged values and catching up, with no I/O, so it can be tested alone.
#[derive(Debug, Default)]
struct Ledger {
    /// The value etcd holds for each service as far as this store knows: what it last
    /// wrote or loaded.
    written: HashMap<String, Vec<u8>>,
    /// The latest value of each service that etcd does not hold yet: changed since the
    /// last write, or carried by a write that failed.
    pending: BTreeMap<String, Vec<u8>>,
    /// Set from a failed write until the next good one.
    outage: Option<Outage>,
}

impl Ledger {
    /// Takes a service's new value. A value equal to what etcd holds needs no write, and
    /// replaces any older pending one (the service changed back).
    fn absorb(&mut self, service: &str, value: Vec<u8>) {
        if self.written.get(service) == Some(&value) {
            self.pending.remove(service);
        } else {
            self.pending.insert(service.to_string(), value);
        }
    }

    /// What the next write must carry: every pending service, latest value each.
    fn batch(&self) -> Vec<(String, Vec<u8>)> {
        self.pending
            .iter()
            .filter(|(s, v)| self.written.get(*s) != Some(*v))
            .map(|(s, v)| (s.clone(), v.clone()))
            .collect()
    }

    /// Records that `batch` is in etcd. A service absorbed again while the write was in
    /// flight stays pending with its newer value.
    fn committed(&mut self, batch: &[(String, Vec<u8>)]) {
        for (service, value) in batch {
            if self.pending.get(service) == Some(value) {
                self.pending.remove(service);
            }
            self.written.insert(service.clone(), value.clone());
        }
    }

    /// Records a failed write; the first failure of an outage dates it.
    fn failed(&mut self, error: String, now: Instant) {
        match &mut self.outage {
            Some(o) => o.error = error,
            None => self.outage = Some(Outage { since: now, error }),
        }
    }

    /// Ends an outage, returning it for the log.
    fn recovered(&mut self) -> Option<Outage> {
        self.outage.take()
    }

    /// What to say about the outage in progress, or `None` if etcd last answered.
    fn outage_message(&self, now: Instant) -> Option<String> {
        self.outage.as_ref().map(|o| {
            format!(
                "{}; unreachable for {:.1} s, {} service(s) waiting",
                o.error,
                now.saturating_duration_since(o.since).as_secs_f64(),
                self.pending.len(),
            )
        })
    }
}

/// A routing store in etcd. See the module documentation.
pub(crate) struct EtcdStore {
    // Kept so that the client's channel keeps its endpoint list alive.
    _client: Client,
    kv: KvClient,
    prefix: String,
    endpoints: Vec<String>,
    request_timeout: Duration,
    ledger: Mutex<Ledger>,
    // One transaction in flight at a time, so that an older batch can never land after
    // a newer one.
    writer: tokio::sync::Mutex<()>,
}

impl EtcdStore {
    /// A store on the etcd members `cfg.endpoints` under `cfg.prefix`, on the calling
    /// runtime. The connection is made lazily, so this succeeds while etcd is down;
    /// `load` then reports it.
    pub(crate) async fn connect(cfg: &EtcdConfig) -> Result<EtcdStore, StoreError> {
        cfg.validate()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        let request_timeout = Duration::from_millis(cfg.request_timeout_ms);
        let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
        let options = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            .with_timeout(request_timeout);
        let endpoints = cfg.endpoints.clone();
        let client = tokio::time::timeout(
            connect_timeout,
            Client::connect(endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| StoreError::Backend("etcd: connect timed out".into()))?
        .map_err(|e| StoreError::Backend(format!("etcd: {e}")))?;
        let kv = client
            .kv_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        Ok(EtcdStore {
            _client: client,
            kv,
            prefix: cfg.prefix.clone(),
            endpoints,
            request_timeout,
            ledger: Mutex::new(Ledger::default()),
            writer: tokio::sync::Mutex::new(()),
        })
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        // The ledger is updated in single statements; a panic cannot leave it torn.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes every pending service, in as few transactions as etcd accepts (one for
    /// any ordinary cycle). Returns how many services were written.
    async fn flush(&self) -> Result<usize, StoreError> {
        let _writer = self.writer.lock().await;
        let batch = self.ledger().batch();
        for chunk in txn_chunks(&batch) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(service, value)| {
                    TxnOp::put(service_key(&self.prefix, service), value.clone(), None)
                })
                .collect();
            let mut kv = self.kv.clone();
            let outcome =
                tokio::time::timeout(self.request_timeout, kv.txn(Txn::new().and_then(ops)))
                    .await
                    .map_err(|_| format!("write timed out after {:?}", self.request_timeout))
                    .and_then(|r| r.map_err(|e| e.to_string()));
            match outcome {
                Ok(_) => self.ledger().committed(chunk),
                Err(error) => {
                    let now = Instant::now();
                    let mut ledger = self.ledger();
                    ledger.failed(error.clone(), now);
                    let detail = ledger.outage_message(now).unwrap_or(error);
                    return Err(StoreError::Backend(format!(
                        "etcd {}: {detail}",
                        self.endpoints.join(",")
                    )));
                }
            }
        }
        if let Some(outage) = self.ledger().recovered() {
            tracing::info!(
                down_for_s = outage.since.elapsed().as_secs_f64(),
                services = batch.len(),
                "etcd routing store reachable again; pending weights written"
            );
        }
        Ok(batch.len())
    }

    /// Every key and value under the services prefix.
    async fn read_all(&self) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut kv = self.kv.clone();
        let range = services_prefix(&self.prefix);
        let mut resp = tokio::time::timeout(
            self.request_timeout,
            kv.get(range, Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| {
            StoreError::Backend(format!(
                "etcd {}: read timed out after {:?}",
                self.endpoints.join(","),
                self.request_timeout
            ))
        })?
        .map_err(|e| StoreError::Backend(format!("etcd {}: {e}", self.endpoints.join(","))))?;
        Ok(resp
            .take_kvs()
            .into_iter()
            .map(|kv| {
                let (key, value) = kv.into_key_value();
                (String::from_utf8_lossy(&key).into_owned(), value)
            })
            .collect())
    }

    async fn load_all(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError> {
        let entries = self.read_all().await?;
        let mut services = BTreeMap::new();
        let mut values = Vec::with_capacity(entries.len());
        for (key, value) in entries {
            let corrupt = |detail: String| StoreError::Corrupt {
                path: key.clone(),
                detail,
            };
            let service = service_from_key(&self.prefix, &key)
                .ok_or_else(|| corrupt("not a valid service name".into()))?
                .to_string();
            let snapshot: ServiceSnapshot =
                serde_json::from_slice(&value).map_err(|e| corrupt(e.to_string()))?;
            services.insert(service.clone(), snapshot);
            values.push((service, value));
        }
        // What etcd holds needs no rewrite until it changes.
        let mut ledger = self.ledger();
        for (service, value) in values {
            ledger.pending.remove(&service);
            ledger.written.insert(service, value);
        }
        Ok(services)
    }

    async fn put_all(&self, changed: &BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError> {
        if changed.is_empty() {
            return Ok(());
        }
        let mut values = Vec::with_capacity(changed.len());
        for (service, snapshot) in changed {
            let value = serde_json::to_vec(snapshot)
                .map_err(|e| StoreError::Backend(format!("encoding {service}: {e}")))?;
            values.push((service, value));
        }
        {
            let mut ledger = self.ledger();
            for (service, value) in values {
                ledger.absorb(service, value);
            }
        }
        self.flush().await.map(|_| ())
    }
}

impl RoutingStore for EtcdStore {
    fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
        Box::pin(self.load_all())
    }

    fn put<'a>(&'a self, changed: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()> {
        Box::pin(self.put_all(changed))
    }

    fn describe(&self) -> String {
        format!("etcd {} {}", self.endpoints.join(","), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn keys_are_per_service_under_the_prefix() {
        assert_eq!(service_key("/ballast", "web"), "/ballast/services/web");
        assert_eq!(
            service_from_key("/ballast", "/ballast/services/web"),
            Some("web")
        );
        // A sibling prefix is not ours, and neither is a nested or empty name.
        assert_eq!(service_from_key("/ballast", "/ballast2/services/web"), None);
        assert_eq!(service_from_key("/ballast", "/ballast/services/"), None);
        assert_eq!(service_from_key("/ballast", "/ballast/services/a/b"), None);
    }

    #[test]
    fn batches_are_split_only_where_etcd_would_refuse_them() {
        let small: Vec<(String, Vec<u8>)> = (0..300)
            .map(|i| (format!("s{i}"), vec![b'x'; 100]))
            .collect();
        let sizes: Vec<usize> = txn_chunks(&small).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [MAX_TXN_OPS, MAX_TXN_OPS, 300 - 2 * MAX_TXN_OPS]);
        assert_eq!(
            txn_chunks(&small[..5]).len(),
            1,
            "a cycle's batch is one txn"
        );
        let big: Vec<(String, Vec<u8>)> = (0..3)
            .map(|i| (format!("b{i}"), vec![b'x'; MAX_TXN_BYTES / 2 + 1]))
            .chain([("huge".to_string(), vec![b'x'; 2 * MAX_TXN_BYTES])])
            .collect();
        let sizes: Vec<usize> = txn_chunks(&big).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [1, 1, 1, 1]);
        assert!(txn_chunks(&[]).is_empty());
    }

    #[test]
    fn unchanged_values_are_not_written_again() {
        let mut l = Ledger::default();
        l.absorb("a", v("1"));
        l.absorb("b", v("1"));
        let batch = l.batch();
        assert_eq!(batch.len(), 2);
        l.committed(&batch);
        assert!(l.pending.is_empty());
        l.absorb("a", v("1"));
        l.absorb("b", v("2"));
        assert_eq!(l.batch(), vec![("b".to_string(), v("2"))]);
    }

    #[test]
    fn a_failed_write_is_carried_by_the_next_with_the_latest_values() {
        let mut l = Ledger::default();
        let t0 = Instant::now();
        l.absorb("a", v("a1"));
        let batch = l.batch();
        l.failed("refused".into(), t0);
        assert!(l.outage_message(t0).is_some_and(|m| m.contains("refused")));
        // While etcd is away a changes again and b changes for the first time.
        l.absorb("a", v("a2"));
        l.absorb("b", v("b1"));
        l.failed("refused again".into(), t0 + Duration::from_secs(3));
        assert_eq!(
            l.outage.as_ref().map(|o| o.since),
            Some(t0),
            "dated by the first"
        );
        let next = l.batch();
        assert_eq!(
            next,
            vec![("a".to_string(), v("a2")), ("b".to_string(), v("b1"))]
        );
        assert_ne!(batch, next);
        l.committed(&next);
        assert!(l.recovered().is_some());
        assert!(l.pending.is_empty() && l.outage_message(t0).is_none());
    }

    #[test]
    fn a_value_absorbed_during_a_write_stays_pending() {
        let mut l = Ledger::default();
        l.absorb("a", v("1"));
        let batch = l.batch();
        l.absorb("a", v("2"));
        l.committed(&batch);
        assert_eq!(l.batch(), vec![("a".to_string(), v("2"))]);
        // Changing back to what etcd holds cancels the pending write.
        l.absorb("a", v("1"));
        assert!(l.batch().is_empty());
    }

    fn closed_port_config() -> EtcdConfig {
        // A port that was free a moment ago: nothing answers there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        EtcdConfig {
            endpoints: vec![format!("http://127.0.0.1:{port}")],
            prefix: "/t".into(),
            connect_timeout_ms: 300,
            request_timeout_ms: 300,
        }
    }

    fn snapshot() -> ServiceSnapshot {
        ServiceSnapshot {
            version: 1,
            cycle: 1,
            endpoints: BTreeMap::new(),
        }
    }

    #[tokio::test]
    async fn an_unreachable_etcd_fails_writes_within_the_timeout_and_keeps_them_pending() {
        let store = EtcdStore::connect(&closed_port_config())
            .await
            .expect("lazy connect");
        assert!(store.describe().starts_with("etcd http://127.0.0.1:"));
        let changed: BTreeMap<_, _> = [("web".to_string(), snapshot())].into();
        for attempt in 0..2 {
            let started = Instant::now();
            let err = store.put(&changed).await.expect_err("nothing listens");
            assert!(matches!(err, StoreError::Backend(_)), "{err}");
            assert!(err.to_string().contains("unreachable for"), "{err}");
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "attempt {attempt}: {:?}",
                started.elapsed()
            );
        }
        // The failed value waits for the next write, which carries it.
        assert_eq!(store.ledger().pending.len(), 1);
        assert!(store.ledger().outage.is_some());
        assert!(store.load().await.is_err());
    }

    #[tokio::test]
    async fn runs_on_the_callers_runtime_and_drops_there() {
        // The daemon builds the store and calls `load` on its own runtime (here a
        // current-thread one): nothing may need a second runtime, block the one
        // thread, or panic when dropped there.
        let store = EtcdStore::connect(&closed_port_config())
            .await
            .expect("lazy connect");
        assert!(store.load().await.is_err());
        drop(store);
    }
}
