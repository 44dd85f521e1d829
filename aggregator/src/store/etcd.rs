//! The etcd routing store: one key per service, `<prefix>/services/<service>`, holding
//! the service's [`ServiceSnapshot`] as JSON (endpoints, addresses, zones, states and
//! weights), so that load balancers and tools can watch one service's key.
//!
//! Writes are batched: the services a write carries go to etcd in one transaction (more
//! only past etcd's limits of [`MAX_TXN_OPS`] operations and about [`MAX_TXN_BYTES`]),
//! and a service whose value is byte for byte what this store last wrote or loaded is
//! left out. A value too large for one request goes in chunks first, and the service's
//! key takes a manifest naming them ([`super::chunks`]); readers here follow it.
//!
//! etcd going away must not stop the aggregator. A failed write keeps the services it
//! carried in a pending set and dates the outage; the next write, which the routing
//! store's writer makes on the next publication or after its backoff, carries the
//! latest value of every pending service, so etcd catches up without waiting for those
//! services to change again. Every network wait is bounded by `request_timeout_ms`.
//!
//! **Security.** `https://` endpoints connect with TLS, checking etcd's certificate
//! against `ca_file` and presenting the client certificate `cert_file` if set; `user`
//! authenticates with the password in `password_file`, and the client renews its token
//! when etcd expires it (after a restart of etcd, say). The files are read at start: one
//! that cannot be used stops the start with the setting that names it. A key read back
//! is restored only if it is a valid snapshot ([`super::validate`]); others are skipped
//! with a log line naming the key, and counted.
//!
//! **The local copy.** Every write also goes to a local file (the file store's format,
//! labelled with the prefix): what etcd holds as far as this store knows, with the
//! values put since, written after each write whether etcd took it or not. When etcd
//! cannot be read at start, [`RoutingStore::load`] serves that copy instead of failing,
//! so that an etcd outage cannot keep the aggregator from starting (and systemd's start
//! limit from stopping it for good). The store is then in fallback
//! ([`RoutingStore::fallback`]): the writer's next write, made at once and retried with
//! its backoff, first reads etcd, and reconciles service by service, by version: a
//! service etcd holds at a higher version than the aggregator serves, or that the
//! aggregator does not have, is left in etcd and handed back
//! ([`RoutingStore::take_newer`]) to be restored; everything else is written.
//!
//! The client is async and runs on the daemon's runtime: the store owns no runtime and
//! no thread, and nothing in it blocks a worker. It connects on first use, and again
//! after a connection attempt fails.

use super::chunks::{self, Chunked, Manifest};
use super::file::FileStore;
use super::validate::{self, Corrupt, Defect, SkipCounts};
use super::{RoutingStore, StoreError, StoreFuture};
use crate::config::EtcdConfig;
use crate::ownership::Ownership;
use ballast_balance::ServiceSnapshot;
use ballast_etcd::{describe, Connection};
use etcd_client::{Client, Compare, CompareOp, DeleteOptions, GetOptions, KvClient, Txn, TxnOp};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// etcd's default `--max-txn-ops`: a larger batch is split into transactions of this
/// many puts, or etcd would refuse it whole.
pub(crate) const MAX_TXN_OPS: usize = 128;
/// The most value bytes put in one transaction: etcd refuses requests over 1.5 MiB
/// (`--max-request-bytes`), so a batch of big snapshots is split well below that. A
/// single service larger than this still goes alone.
pub(crate) const MAX_TXN_BYTES: usize = 1 << 20;
// etcd's default `--max-request-bytes`: a put larger than the member's limit is
// refused by etcd; `max_request_bytes` tells the store an etcd's raised one.
use crate::config::ETCD_MAX_REQUEST_BYTES as DEFAULT_MAX_REQUEST_BYTES;
/// What a request carries beside the key and value of its one put: the transaction's
/// framing, well within this.
const REQUEST_OVERHEAD: usize = 1024;
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
        .filter(|s| validate::check_service_name(s).is_ok())
}

/// A key and value read from etcd as a service and its snapshot, or what is wrong.
pub(crate) fn decode_entry(
    prefix: &str,
    key: &str,
    value: &[u8],
) -> Result<(String, ServiceSnapshot), Corrupt> {
    let service = match service_from_key(prefix, key) {
        Some(s) => s,
        None => {
            let name = key.strip_prefix(&services_prefix(prefix)).unwrap_or(key);
            return Err(validate::check_service_name(name).err().unwrap_or(Corrupt {
                defect: Defect::Service,
                detail: format!("{key:?} is not a service key under {prefix}"),
            }));
        }
    };
    let snapshot = validate::parse_snapshot(service, value)?;
    Ok((service.to_string(), snapshot))
}

/// The services etcd holds (`stored`) that are newer than what a write carries
/// (`ours`): at a higher version, or not carried at all.
fn newer_in_store(
    stored: BTreeMap<String, ServiceSnapshot>,
    ours: &BTreeMap<String, ServiceSnapshot>,
) -> BTreeMap<String, ServiceSnapshot> {
    stored
        .into_iter()
        .filter(|(service, s)| ours.get(service).is_none_or(|o| s.version > o.version))
        .collect()
}

/// Services and their encoded values, as one write carries them.
type Batch = Vec<(String, Vec<u8>)>;
/// The fencing revision of each bucket a write touches, as taken when it was made.
type Fences = BTreeMap<u32, i64>;
/// For each service of a write whose value went in chunks: the manifest its key takes,
/// and the generation the manifest names.
type Manifests = HashMap<String, (Vec<u8>, String)>;

/// Splits a batch into transactions etcd accepts: at most [`MAX_TXN_OPS`] puts and,
/// unless one value alone is larger, at most [`MAX_TXN_BYTES`] of values each.
fn txn_chunks(batch: &[(String, Vec<u8>)], max_ops: usize) -> Vec<&[(String, Vec<u8>)]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (service, value)) in batch.iter().enumerate() {
        let size = service.len() + value.len();
        if i > start && (i - start == max_ops || bytes + size > MAX_TXN_BYTES) {
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

/// An etcd client error with its causes: tonic's transport errors say only
/// "transport error" on their own, the TLS or connection failure is in their source.
/// How the store talks to etcd, to explain its errors.
#[derive(Debug, Clone)]
struct Credentials {
    tls: bool,
    client_cert: bool,
    user: Option<String>,
}

impl Credentials {
    /// `detail`, led by what it most likely means for the settings, where the error
    /// says: a refused certificate, a refused login, a missing permission. The raw
    /// error always follows.
    fn explain(&self, prefix: &str, detail: String) -> String {
        let user = self.user.as_deref().unwrap_or("(none)");
        let hint = if detail.contains("received fatal alert") {
            Some(if self.client_cert {
                "etcd refused the TLS connection: its trusted CA (--trusted-ca-file) does not \
                 accept the client certificate store.etcd.cert_file"
                    .to_string()
            } else {
                "etcd refused the TLS connection: it requires a client certificate, and none \
                 is configured (store.etcd.cert_file, key_file)"
                    .to_string()
            })
        } else if detail.contains("invalid peer certificate") {
            Some(
                "etcd's server certificate is not accepted: it must be signed by \
                 store.etcd.ca_file and name the endpoint's host"
                    .to_string(),
            )
        } else if self.tls && !self.client_cert && detail.contains("connection closed") {
            Some(
                "etcd closed the TLS connection: if it requires client certificates \
                 (--client-cert-auth), set store.etcd.cert_file and key_file"
                    .to_string(),
            )
        } else if detail.contains("authentication failed") {
            Some(format!(
                "etcd refused user {user:?}: wrong user or password (store.etcd.user, \
                 password_file)"
            ))
        } else if detail.contains("authentication is not enabled") {
            Some(format!(
                "etcd has no authentication enabled, yet user {user:?} is configured"
            ))
        } else if detail.contains("permission denied") {
            Some(format!(
                "user {user:?} may not read and write the keys under {prefix}/ (services/, \
                 chunks/ and, in a cluster, cluster/)"
            ))
        } else if detail.contains("user name is empty") || detail.contains("invalid auth token") {
            Some("etcd requires authentication: set store.etcd.user and password_file".to_string())
        } else {
            None
        };
        match hint {
            Some(hint) => format!("{hint}: {detail}"),
            None => detail,
        }
    }
}

/// The connection to the etcd `cfg` describes, the files it names read and checked
/// now.
pub(crate) fn connection(cfg: &EtcdConfig) -> Result<Connection, StoreError> {
    Connection::new(&cfg.connect()).map_err(|e| StoreError::Setup {
        setting: e.setting,
        reason: e.reason,
    })
}

/// Why etcd is considered unreachable.
#[derive(Debug, Clone)]
struct Outage {
    since: Instant,
    error: String,
}

/// What etcd holds and what is still to be written: the bookkeeping of batching,
/// skipping unchanged values and catching up, with no I/O, so it can be tested alone.
#[derive(Debug)]
struct Ledger {
    /// The value etcd holds for each service as far as this store knows: what it last
    /// wrote or loaded.
    written: HashMap<String, Vec<u8>>,
    /// The latest value of each service that etcd does not hold yet: changed since the
    /// last write, or carried by a write that failed.
    pending: BTreeMap<String, Vec<u8>>,
    /// Set from a failed write until the next good one.
    outage: Option<Outage>,
    /// The most bytes a service's name and value may take together in one put: a
    /// larger value is written in chunks.
    max_entry_bytes: usize,
    /// The most bytes a service's value may take, chunks and all: a larger one is not
    /// written.
    max_value_bytes: usize,
    /// Services whose latest value is over `max_value_bytes`, with its size: not
    /// written, so etcd keeps their last value that fitted.
    too_large: BTreeMap<String, usize>,
    /// Values refused for their size since the last [`Ledger::take_refused`].
    refused: u64,
    /// The mod revision of each service's key as this store last wrote or read it: a
    /// write is made only if the key is still at that revision (or still absent, for
    /// a service not in it), so that a write which timed out but reaches etcd later
    /// cannot land over a newer one.
    revisions: HashMap<String, i64>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new(DEFAULT_MAX_REQUEST_BYTES - REQUEST_OVERHEAD, 64 << 20)
    }
}

impl Ledger {
    fn new(max_entry_bytes: usize, max_value_bytes: usize) -> Self {
        Ledger {
            written: HashMap::new(),
            pending: BTreeMap::new(),
            outage: None,
            max_entry_bytes,
            max_value_bytes,
            too_large: BTreeMap::new(),
            refused: 0,
            revisions: HashMap::new(),
        }
    }

    /// Takes a service's new value. A value equal to what etcd holds needs no write, and
    /// replaces any older pending one (the service changed back). A value over
    /// `max_value_bytes` is not written: the service keeps the last value etcd took,
    /// the others are written as usual, and the refusal is counted; the first one of a
    /// run is logged.
    fn absorb(&mut self, service: &str, value: Vec<u8>) {
        let size = service.len() + value.len();
        if size > self.max_value_bytes {
            self.pending.remove(service);
            self.refused += 1;
            if self.too_large.insert(service.to_string(), size).is_none() {
                tracing::error!(
                    service,
                    bytes = size,
                    limit = self.max_value_bytes,
                    "service too large for etcd: its weights are not written there (etcd \
                     keeps the last ones that fitted) until it shrinks; raise the store's \
                     max_value_bytes, or split the service"
                );
            }
            return;
        }
        if self.too_large.remove(service).is_some() {
            tracing::info!(service, bytes = size, "service fits in etcd again");
        }
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

    /// Records that `batch` is in etcd, put by a transaction at `revision`.
    fn committed_at(&mut self, batch: &[(String, Vec<u8>)], revision: i64) {
        self.committed(batch);
        for (service, _) in batch {
            self.revisions.insert(service.clone(), revision);
        }
    }

    /// Records what etcd holds, as just read: the ledger's knowledge of etcd becomes
    /// that, and a pending value equal to what etcd holds needs no write.
    fn loaded(&mut self, values: Vec<(String, Vec<u8>)>) {
        self.written = values.into_iter().collect();
        let written = &self.written;
        self.pending
            .retain(|service, value| written.get(service) != Some(value));
    }

    /// How many values were refused for their size since the last call.
    fn take_refused(&mut self) -> u64 {
        std::mem::take(&mut self.refused)
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

/// The local copy of what etcd holds, with the values put since.
struct LocalCopy {
    file: FileStore,
    state: Mutex<CopyState>,
    /// Whether the last attempt to write the copy failed, so that a run of failures
    /// is logged once.
    failing: AtomicBool,
}

#[derive(Default)]
struct CopyState {
    services: BTreeMap<String, ServiceSnapshot>,
    /// Changed since it was last written.
    dirty: bool,
}

impl LocalCopy {
    fn lock(&self) -> MutexGuard<'_, CopyState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What etcd holds, as just read: the copy becomes that.
    fn reset(&self, services: &BTreeMap<String, ServiceSnapshot>, dirty: bool) {
        let mut state = self.lock();
        state.services = services.clone();
        state.dirty = dirty;
    }

    /// Values being put, or kept from etcd.
    fn absorb(&self, services: &BTreeMap<String, ServiceSnapshot>) {
        let mut state = self.lock();
        for (service, snapshot) in services {
            if state.services.get(service) != Some(snapshot) {
                state.services.insert(service.clone(), snapshot.clone());
                state.dirty = true;
            }
        }
    }

    /// Writes the copy if it changed. A failure is logged, not returned: the copy is a
    /// fallback, and etcd itself may be fine.
    async fn save(&self) {
        let services = {
            let mut state = self.lock();
            if !state.dirty {
                return;
            }
            state.dirty = false;
            state.services.clone()
        };
        match self.file.replace(services).await {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(file = %self.file.path().display(),
                        "the local copy of the etcd routing store is written again");
                }
            }
            Err(e) => {
                // Written again with the next change.
                self.lock().dirty = true;
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e,
                        "cannot write the local copy of the etcd routing store; a start \
                         while etcd is down would serve an older copy");
                }
            }
        }
    }
}

/// A routing store in etcd. See the module documentation.
pub(crate) struct EtcdStore {
    prefix: String,
    connection: Connection,
    credentials: Credentials,
    request_timeout: Duration,
    /// Connected on first use; kept once connected (the client reconnects by itself),
    /// dropped never, retried when connecting fails (authentication does at connect).
    client: tokio::sync::Mutex<Option<Client>>,
    ledger: Mutex<Ledger>,
    // One transaction in flight at a time, so that an older batch can never land after
    // a newer one.
    writer: tokio::sync::Mutex<()>,
    copy: LocalCopy,
    /// Why the services served at start came from the local copy, until etcd is read.
    fallback: Mutex<Option<String>>,
    /// Services etcd held newer than the aggregator when it was read after a fallback.
    newer: Mutex<BTreeMap<String, ServiceSnapshot>>,
    skipped: SkipCounts,
    /// As one replica of a cluster: which services this replica may write, and the
    /// owner keys its writes are fenced by.
    fence: Option<Fence>,
    /// Values left unwritten since the last call because their service is not this
    /// replica's (any more).
    fenced: std::sync::atomic::AtomicU64,
    /// What makes this store's chunk generations its own: its process and start time.
    generation_base: String,
    /// Chunked writes made, for the next generation's name.
    generations: std::sync::atomic::AtomicU64,
}

/// What fences a cluster replica's writes: its ownership of each bucket, and the
/// cluster whose owner keys prove it.
pub(crate) struct Fence {
    /// The buckets this replica holds, with their fencing revisions.
    pub(crate) ownership: Arc<Ownership>,
    /// The cluster's name.
    pub(crate) cluster: String,
}

impl EtcdStore {
    /// A store on the etcd members `cfg.endpoints` under `cfg.prefix`, with its local
    /// copy at `copy`. Nothing is contacted yet, so this succeeds while etcd is down;
    /// the TLS and password files are read and checked now.
    pub(crate) fn open(
        cfg: &EtcdConfig,
        copy: PathBuf,
        fence: Option<Fence>,
    ) -> Result<EtcdStore, StoreError> {
        cfg.validate().map_err(|e| StoreError::Setup {
            setting: e.setting,
            reason: e.reason,
        })?;
        let connection = connection(cfg)?;
        Ok(EtcdStore {
            prefix: cfg.prefix.clone(),
            connection,
            credentials: Credentials {
                tls: cfg.uses_tls(),
                client_cert: cfg.cert_file.is_some(),
                user: cfg.user.clone(),
            },
            request_timeout: Duration::from_millis(cfg.request_timeout_ms),
            client: tokio::sync::Mutex::new(None),
            ledger: Mutex::new(Ledger::new(
                cfg.max_request_bytes
                    .saturating_sub(REQUEST_OVERHEAD + services_prefix(&cfg.prefix).len()),
                cfg.max_value_bytes,
            )),
            writer: tokio::sync::Mutex::new(()),
            copy: LocalCopy {
                file: FileStore::with_origin(copy, format!("etcd prefix {}", cfg.prefix)),
                state: Mutex::new(CopyState::default()),
                failing: AtomicBool::new(false),
            },
            fallback: Mutex::new(None),
            newer: Mutex::new(BTreeMap::new()),
            skipped: SkipCounts::default(),
            fence,
            fenced: std::sync::atomic::AtomicU64::new(0),
            generation_base: format!(
                "{:x}-{:x}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
                std::process::id()
            ),
            generations: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The key prefix.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How long one request may take.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        // The ledger is updated in single statements; a panic cannot leave it torn.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn members(&self) -> String {
        self.connection.endpoints().join(",")
    }

    /// A KV client, connecting first if need be. Connecting authenticates the user,
    /// so a wrong password shows here.
    async fn kv(&self) -> Result<KvClient, String> {
        Ok(self
            .client()
            .await?
            .kv_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES))
    }

    /// The client, connecting first if need be: shared with the cluster's task, so
    /// that one connection carries the store's writes and the replica's lease.
    pub(crate) async fn client(&self) -> Result<Client, String> {
        let mut slot = self.client.lock().await;
        let client = match slot.as_ref() {
            Some(client) => client.clone(),
            None => {
                let client = self.connection.connect().await?;
                slot.insert(client).clone()
            }
        };
        Ok(client)
    }

    /// Writes every pending service, in as few transactions as etcd accepts (one for
    /// any ordinary cycle). Returns how many services were written.
    async fn flush(&self) -> Result<usize, StoreError> {
        let _writer = self.writer.lock().await;
        // The ledger's guard must be gone before `owned`, which takes it again.
        let batch = self.ledger().batch();
        let (batch, fences) = self.owned(batch);
        // A transaction compares each key's revision, in a cluster each bucket's owner
        // key, and for a chunked value one of its chunks: at most 42 of each, within
        // etcd's 128 compares. Its operations are a put and a deletion per service, a
        // put and two deletions per chunked one: at most 126.
        let max_ops = MAX_TXN_OPS / 3;
        let (batch, manifests, chunks_failed) = self.put_large(batch, &fences).await?;
        for chunk in txn_chunks(&batch, max_ops) {
            let mut outcome = self.txn(chunk, &fences, &manifests).await;
            if let Ok(None) = outcome {
                // A key moved since this store last saw it (a write that timed out
                // landed after all, or the store was written by another): learn where
                // the keys are now and try once more.
                if let Err(error) = self.refresh(chunk).await {
                    return Err(self.failed(error));
                }
                outcome = self.txn(chunk, &fences, &manifests).await;
            }
            match outcome {
                Ok(Some(revision)) => self.ledger().committed_at(chunk, revision),
                Ok(None) if self.fence.is_some() => self.fenced_out(chunk, &fences),
                Ok(None) => {
                    return Err(self.failed(
                        "a write was refused twice because the service's key changed \
                         under it: another writer shares this prefix"
                            .into(),
                    ))
                }
                Err(error) => return Err(self.failed(error)),
            }
        }
        if let Some(error) = chunks_failed {
            return Err(self.failed(error));
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

    /// The part of `batch` this store may write, with the fencing revision of each
    /// bucket it touches as of now: all of it, except in a cluster, where a service
    /// another replica owns is left out, and dropped from the pending writes, since
    /// its owner writes it now. The revisions are taken once, here, so that a bucket
    /// lost and claimed again during the write cannot carry values of the earlier
    /// ownership.
    fn owned(&self, batch: Batch) -> (Batch, Fences) {
        let Some(fence) = &self.fence else {
            return (batch, BTreeMap::new());
        };
        let mut fences = BTreeMap::new();
        let (ours, theirs): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(service, _)| {
            let b = fence.ownership.bucket(service);
            match fence.ownership.fence(b) {
                Some(rev) => {
                    fences.insert(b, rev);
                    true
                }
                None => false,
            }
        });
        if !theirs.is_empty() {
            self.drop_pending(&theirs);
        }
        (ours, fences)
    }

    /// In a cluster, forgets the pending values of every service this replica does not
    /// own now: a bucket given up must not be written later from what was pending, if
    /// it comes back, since its new owner wrote it meanwhile.
    pub(crate) fn drop_unowned_pending(&self) {
        let Some(fence) = &self.fence else {
            return;
        };
        self.ledger()
            .pending
            .retain(|service, _| fence.ownership.owns(service));
    }

    /// After a fence failed: the services of buckets still held under the same claim
    /// stay pending (another bucket of the chunk failed it); the others are dropped.
    fn fenced_out(&self, chunk: &[(String, Vec<u8>)], fences: &BTreeMap<u32, i64>) {
        let Some(fence) = &self.fence else {
            return;
        };
        let gone: Vec<(String, Vec<u8>)> = chunk
            .iter()
            .filter(|(service, _)| {
                let b = fence.ownership.bucket(service);
                fence.ownership.fence(b) != fences.get(&b).copied()
            })
            .cloned()
            .collect();
        self.drop_pending(&gone);
    }

    /// Drops what another replica now writes, and counts it.
    fn drop_pending(&self, values: &[(String, Vec<u8>)]) {
        if values.is_empty() {
            return;
        }
        let mut ledger = self.ledger();
        for (service, _) in values {
            ledger.pending.remove(service);
        }
        drop(ledger);
        self.fenced
            .fetch_add(values.len() as u64, Ordering::Relaxed);
        tracing::info!(
            services = ?values.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
            "weights not written: these services belong to another replica now"
        );
    }

    /// The compares of `chunk`: each key still at the revision this store last saw
    /// (or still absent), and in a cluster each touched bucket's owner key still the
    /// one this replica's claim created, at the revision `fences` took.
    fn compares(&self, chunk: &[(String, Vec<u8>)], fences: &BTreeMap<u32, i64>) -> Vec<Compare> {
        let compares: Vec<Compare> = {
            let ledger = self.ledger();
            chunk
                .iter()
                .map(|(service, _)| {
                    let key = service_key(&self.prefix, service);
                    match ledger.revisions.get(service) {
                        Some(rev) => Compare::mod_revision(key, CompareOp::Equal, *rev),
                        None => Compare::create_revision(key, CompareOp::Equal, 0),
                    }
                })
                .collect()
        };
        let services = chunk.iter().map(|(service, _)| service.as_str());
        [compares, self.fence_compares(services, fences)].concat()
    }

    /// In a cluster, the compares that fence a write of `services`: each touched
    /// bucket's owner key still the one this replica's claim created, at the revision
    /// `fences` took. None outside a cluster.
    fn fence_compares<'s>(
        &self,
        services: impl Iterator<Item = &'s str>,
        fences: &BTreeMap<u32, i64>,
    ) -> Vec<Compare> {
        let mut compares = Vec::new();
        if let Some(fence) = &self.fence {
            let buckets: std::collections::BTreeSet<u32> = services
                .map(|service| fence.ownership.bucket(service))
                .collect();
            for b in buckets {
                let key = crate::ownership::owner_key(&self.prefix, &fence.cluster, b);
                // A bucket `owned` did not see held compares against -1, which no
                // key's create revision matches, present or absent.
                let rev = fences.get(&b).copied().unwrap_or(-1);
                compares.push(Compare::create_revision(key, CompareOp::Equal, rev));
            }
        }
        compares
    }

    /// Writes the chunks of every value of `batch` too large for one request, each
    /// chunk in a transaction of its own fenced like any write, and returns the batch
    /// to write with, for each of those services, the manifest its key is to take and
    /// the generation it names. A service whose fence failed is left out (and dropped,
    /// as [`EtcdStore::fenced_out`] says); one whose chunks could not be written is
    /// left out and stays pending, and the error is returned beside the rest, which is
    /// written all the same.
    async fn put_large(
        &self,
        batch: Batch,
        fences: &Fences,
    ) -> Result<(Batch, Manifests, Option<String>), StoreError> {
        let max_entry = self.ledger().max_entry_bytes;
        let mut manifests = HashMap::new();
        let mut kept = Vec::with_capacity(batch.len());
        let mut failed = None;
        for (service, value) in batch {
            if service.len() + value.len() <= max_entry {
                kept.push((service, value));
                continue;
            }
            // A chunk is a put of its own: its key and value within the request limit.
            let key_bytes = chunks::chunk_key(&self.prefix, &service, "", 0).len() + 64;
            let chunk_bytes = chunks::CHUNK_BYTES.min(max_entry.saturating_sub(key_bytes).max(1));
            match self.put_chunks(&service, &value, chunk_bytes, fences).await {
                Ok(Some(manifest)) => {
                    manifests.insert(service.clone(), manifest);
                    kept.push((service, value));
                }
                Ok(None) => self.fenced_out(&[(service, value)], fences),
                // It stays pending; the others are written all the same.
                Err(error) => failed = Some(error),
            }
        }
        Ok((kept, manifests, failed))
    }

    /// Puts `value`'s chunks under a new generation of `service`: the manifest naming
    /// them and the generation, or `None` when the write's fence failed.
    async fn put_chunks(
        &self,
        service: &str,
        value: &[u8],
        chunk_bytes: usize,
        fences: &Fences,
    ) -> Result<Option<(Vec<u8>, String)>, String> {
        let n = self.generations.fetch_add(1, Ordering::Relaxed);
        let generation = format!("{}-{n:x}", self.generation_base);
        let compares = self.fence_compares(std::iter::once(service), fences);
        let mut kv = self.kv().await?;
        let mut count = 0;
        for (i, piece) in value.chunks(chunk_bytes).enumerate() {
            let key = chunks::chunk_key(&self.prefix, service, &generation, i);
            let txn = Txn::new().when(compares.clone()).and_then(vec![TxnOp::put(
                key,
                piece.to_vec(),
                None,
            )]);
            let resp = tokio::time::timeout(self.request_timeout, kv.txn(txn))
                .await
                .map_err(|_| format!("write timed out after {:?}", self.request_timeout))?
                .map_err(|e| describe(&e))?;
            if !resp.succeeded() {
                return Ok(None);
            }
            count += 1;
        }
        let manifest = Manifest::new(&generation, count, value.len());
        Ok(Some((manifest.to_vec(), generation)))
    }

    /// Puts `chunk` in one transaction: `Some` with the revision it made, or `None`
    /// when a compare failed and nothing was written. A service in `manifests` has its
    /// key take the manifest, and every other generation of its chunks deleted; a
    /// service whose value etcd holds in chunks and that fits in one put now has its
    /// chunks deleted.
    async fn txn(
        &self,
        chunk: &[(String, Vec<u8>)],
        fences: &BTreeMap<u32, i64>,
        manifests: &Manifests,
    ) -> Result<Option<i64>, String> {
        let mut kv = self.kv().await?;
        let mut compares = self.compares(chunk, fences);
        let mut ops: Vec<TxnOp> = Vec::with_capacity(2 * chunk.len());
        for (service, value) in chunk {
            let key = service_key(&self.prefix, service);
            let all = chunks::chunks_prefix(&self.prefix, service);
            match manifests.get(service) {
                Some((manifest, generation)) => {
                    let current = chunks::generation_prefix(&self.prefix, service, generation);
                    // Its chunks are still there: a write of this store that timed out
                    // and landed late would have deleted them with every generation but
                    // its own. One chunk stands for all: a generation goes whole.
                    let count = Manifest::parse(manifest).map_or(0, |m| m.chunks as usize);
                    let last = chunks::chunk_key(
                        &self.prefix,
                        service,
                        generation,
                        count.saturating_sub(1),
                    );
                    compares.push(Compare::create_revision(last, CompareOp::Greater, 0));
                    ops.push(TxnOp::put(key, manifest.clone(), None));
                    ops.push(TxnOp::delete(
                        all.clone(),
                        Some(DeleteOptions::new().with_range(current.clone())),
                    ));
                    ops.push(TxnOp::delete(
                        chunks::prefix_end(&current),
                        Some(DeleteOptions::new().with_range(chunks::prefix_end(&all))),
                    ));
                }
                None => {
                    // Whole now: any chunks the service had go, those of an earlier
                    // chunked value and those a failed write left.
                    ops.push(TxnOp::put(key, value.clone(), None));
                    ops.push(TxnOp::delete(all, Some(DeleteOptions::new().with_prefix())));
                }
            }
        }
        let txn = Txn::new().when(compares).and_then(ops);
        let resp = tokio::time::timeout(self.request_timeout, kv.txn(txn))
            .await
            .map_err(|_| format!("write timed out after {:?}", self.request_timeout))?
            .map_err(|e| describe(&e))?;
        Ok(resp
            .succeeded()
            .then(|| resp.header().map_or(0, |h| h.revision())))
    }

    /// Learns the revision each key of `chunk` is at now.
    async fn refresh(&self, chunk: &[(String, Vec<u8>)]) -> Result<(), String> {
        let mut kv = self.kv().await?;
        for (service, _) in chunk {
            let resp = tokio::time::timeout(
                self.request_timeout,
                kv.get(service_key(&self.prefix, service), None),
            )
            .await
            .map_err(|_| format!("read timed out after {:?}", self.request_timeout))?
            .map_err(|e| describe(&e))?;
            let mut ledger = self.ledger();
            match resp.kvs().first() {
                Some(kv) => {
                    ledger.revisions.insert(service.clone(), kv.mod_revision());
                }
                None => {
                    ledger.revisions.remove(service);
                }
            }
        }
        Ok(())
    }

    /// Records a failed call in the outage and says what to report.
    fn failed(&self, error: String) -> StoreError {
        StoreError::Backend(self.outage(error))
    }

    /// Records a failed call in the outage: the error, and how long etcd has failed.
    fn outage(&self, error: String) -> String {
        let error = self.credentials.explain(&self.prefix, error);
        let now = Instant::now();
        let mut ledger = self.ledger();
        ledger.failed(error.clone(), now);
        let detail = ledger.outage_message(now).unwrap_or(error);
        format!("etcd {}: {detail}", self.members())
    }

    /// Every key under the services prefix, with its value and mod revision; a
    /// chunked value is read whole, at the revision of the read.
    async fn read_all(&self) -> Result<Vec<(String, Vec<u8>, i64)>, String> {
        let mut kv = self.kv().await?;
        let range = services_prefix(&self.prefix);
        let mut resp = tokio::time::timeout(
            self.request_timeout,
            kv.get(range, Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| format!("read timed out after {:?}", self.request_timeout))?
        .map_err(|e| describe(&e))?;
        let at = resp.header().map_or(0, |h| h.revision());
        let mut entries = Vec::new();
        for kv in resp.take_kvs() {
            let revision = kv.mod_revision();
            let (key, value) = kv.into_key_value();
            let key = String::from_utf8_lossy(&key).into_owned();
            let value = self.whole(&key, value, at).await?;
            entries.push((key, value, revision));
        }
        Ok(entries)
    }

    /// `value`, as read from `key` at revision `at`, whole: the value itself, or, when
    /// it is a manifest, its chunks joined as they were at `at`. Chunks that do not
    /// make the value the manifest describes are logged, and the manifest is returned
    /// as it is, which the reader then skips as corrupt; a failed read is an error.
    pub(crate) async fn whole(
        &self,
        key: &str,
        value: Vec<u8>,
        at: i64,
    ) -> Result<Vec<u8>, String> {
        let Some(manifest) = Manifest::parse(&value) else {
            return Ok(value);
        };
        let Some(service) = service_from_key(&self.prefix, key) else {
            return Ok(value);
        };
        match self.read_chunks(service, &manifest, at).await? {
            Ok(whole) => Ok(whole),
            Err(e) => {
                tracing::warn!(%key, error = %e, "a chunked service value is incomplete");
                Ok(value)
            }
        }
    }

    /// The chunks `manifest` names, read at revision `at` and joined.
    async fn read_chunks(
        &self,
        service: &str,
        manifest: &Chunked,
        at: i64,
    ) -> Result<Result<Vec<u8>, chunks::ChunkError>, String> {
        let mut kv = self.kv().await?;
        let range = chunks::generation_prefix(&self.prefix, service, &manifest.generation);
        let mut resp = tokio::time::timeout(
            self.request_timeout,
            kv.get(
                range,
                Some(GetOptions::new().with_prefix().with_revision(at)),
            ),
        )
        .await
        .map_err(|_| format!("read timed out after {:?}", self.request_timeout))?
        .map_err(|e| describe(&e))?;
        let pieces: Vec<Vec<u8>> = resp
            .take_kvs()
            .into_iter()
            .map(|kv| kv.into_key_value().1)
            .collect();
        Ok(chunks::assemble(manifest, &pieces))
    }

    /// Every valid service in etcd. A key that is not one is skipped, logged with the
    /// key, and counted; the rest loads. What etcd holds needs no rewrite until it
    /// changes, so the ledger learns it.
    pub(crate) async fn read_valid(&self) -> Result<BTreeMap<String, ServiceSnapshot>, String> {
        let entries = self.read_all().await?;
        let mut services = BTreeMap::new();
        let mut values = Vec::with_capacity(entries.len());
        let mut revisions = HashMap::with_capacity(entries.len());
        for (key, value, revision) in entries {
            if let Some(service) = service_from_key(&self.prefix, &key) {
                revisions.insert(service.to_string(), revision);
            }
            match decode_entry(&self.prefix, &key, &value) {
                Ok((service, snapshot)) => {
                    services.insert(service.clone(), snapshot);
                    values.push((service, value));
                }
                Err(corrupt) => {
                    tracing::warn!(%key, reason = corrupt.defect.label(), error = %corrupt,
                        "etcd routing store: a corrupt key is skipped; the others load");
                    self.skipped.record(corrupt.defect);
                }
            }
        }
        {
            let mut ledger = self.ledger();
            ledger.loaded(values);
            ledger.revisions = revisions;
        }
        Ok(services)
    }

    /// The start: etcd's services, or, when etcd cannot be read, the local copy's.
    async fn load_at_start(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError> {
        let error = match self.read_valid().await {
            Ok(services) => {
                self.copy.reset(&services, true);
                self.copy.save().await;
                return Ok(services);
            }
            Err(error) => error,
        };
        let path = self.copy.file.path().display().to_string();
        let (services, what) = match self.copy.file.load().await {
            Ok(services) => {
                let what = format!("{} service(s)", services.len());
                (services, what)
            }
            Err(e) => {
                tracing::error!(error = %e, "the local copy of the etcd routing store cannot be used either; starting with no weights");
                (
                    BTreeMap::new(),
                    format!("unusable: {e}; serving no weights"),
                )
            }
        };
        self.copy.reset(&services, false);
        let error = self.credentials.explain(&self.prefix, error);
        let why = format!(
            "etcd {} could not be read at start ({error}); serving the local copy {path} \
             ({what}) until it can be",
            self.members()
        );
        tracing::warn!(services = services.len(), copy = %path, error = %error,
            "etcd cannot be read at start: serving the local copy of the routing store, and \
             retrying etcd in the background");
        *Self::lock(&self.fallback) = Some(why);
        Ok(services)
    }

    /// After a fallback: reads etcd and reconciles with `ours`, the services the
    /// aggregator serves. A service etcd holds newer is taken out of the pending writes
    /// and kept for [`RoutingStore::take_newer`]; the rest is written by the flush that
    /// follows.
    async fn reconcile(&self, ours: &BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError> {
        let stored = match self.read_valid().await {
            Ok(stored) => stored,
            Err(error) => {
                return Err(StoreError::Backend(format!(
                    "{}; not read since the start: serving the local copy {}",
                    self.outage(error),
                    self.copy.file.path().display()
                )));
            }
        };
        let total = stored.len();
        let newer = newer_in_store(stored, ours);
        {
            let mut ledger = self.ledger();
            for service in newer.keys() {
                ledger.pending.remove(service);
            }
        }
        self.copy.absorb(&newer);
        tracing::info!(
            in_etcd = total,
            newer_in_etcd = newer.len(),
            services = ?newer.keys().collect::<Vec<_>>(),
            "etcd read after a start from the local copy: services etcd holds newer are \
             restored from it, the others are written"
        );
        Self::lock(&self.newer).extend(newer);
        *Self::lock(&self.fallback) = None;
        Ok(())
    }

    async fn put_all(&self, changed: &BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError> {
        let reconciling = Self::lock(&self.fallback).is_some();
        if changed.is_empty() && !reconciling {
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
        self.copy.absorb(changed);
        let outcome = match reconciling {
            true => self.reconcile(changed).await,
            false => Ok(()),
        };
        let outcome = match outcome {
            Ok(()) => self.flush().await.map(|_| ()),
            Err(e) => Err(e),
        };
        self.copy.save().await;
        outcome
    }
}

impl RoutingStore for EtcdStore {
    fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>> {
        Box::pin(self.load_at_start())
    }

    fn put<'a>(&'a self, changed: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()> {
        Box::pin(self.put_all(changed))
    }

    fn describe(&self) -> String {
        format!("etcd {} {}", self.members(), self.prefix)
    }

    fn fallback(&self) -> Option<String> {
        Self::lock(&self.fallback).clone()
    }

    fn take_newer(&self) -> BTreeMap<String, ServiceSnapshot> {
        std::mem::take(&mut *Self::lock(&self.newer))
    }

    fn take_skipped(&self) -> BTreeMap<Defect, u64> {
        let mut counts = self.skipped.take();
        for (defect, n) in self.copy.file.take_skipped() {
            *counts.entry(defect).or_default() += n;
        }
        counts
    }

    fn too_large(&self) -> BTreeMap<String, usize> {
        self.ledger().too_large.clone()
    }

    fn take_refused(&self) -> u64 {
        self.ledger().take_refused()
    }

    fn take_fenced(&self) -> u64 {
        self.fenced.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
pub(crate) mod tests {
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
        let sizes: Vec<usize> = txn_chunks(&small, MAX_TXN_OPS)
            .iter()
            .map(|c| c.len())
            .collect();
        assert_eq!(sizes, [MAX_TXN_OPS, MAX_TXN_OPS, 300 - 2 * MAX_TXN_OPS]);
        assert_eq!(
            txn_chunks(&small[..5], MAX_TXN_OPS).len(),
            1,
            "a cycle's batch is one txn"
        );
        let big: Vec<(String, Vec<u8>)> = (0..3)
            .map(|i| (format!("b{i}"), vec![b'x'; MAX_TXN_BYTES / 2 + 1]))
            .chain([("huge".to_string(), vec![b'x'; 2 * MAX_TXN_BYTES])])
            .collect();
        let sizes: Vec<usize> = txn_chunks(&big, MAX_TXN_OPS)
            .iter()
            .map(|c| c.len())
            .collect();
        assert_eq!(sizes, [1, 1, 1, 1]);
        assert!(txn_chunks(&[], MAX_TXN_OPS).is_empty());
    }

    #[test]
    fn a_value_too_large_to_store_is_held_back_and_the_others_are_written() {
        let v = |s: &str| s.as_bytes().to_vec();
        let mut l = Ledger::new(4, 10);
        l.absorb("a", v("1"));
        l.absorb("big", v("0123456789"));
        l.absorb("z", v("2"));
        // The big one is not in the batch: it is over the largest value stored, and
        // every write would carry it again.
        let batch = l.batch();
        let names: Vec<&str> = batch.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(names, ["a", "z"]);
        assert_eq!(l.too_large.get("big"), Some(&13));
        assert_eq!(l.take_refused(), 1);
        assert_eq!(l.take_refused(), 0);
        l.committed(&batch);
        // Still too large: refused again, and still listed.
        l.absorb("big", v("01234567890"));
        assert_eq!(l.take_refused(), 1);
        assert!(l.batch().is_empty());
        // It shrinks: written (in chunks, over the 4 bytes of one put), and no longer
        // listed.
        l.absorb("big", v("0123"));
        assert!(l.too_large.is_empty());
        assert_eq!(l.batch(), [("big".to_string(), v("0123"))]);
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
            ..EtcdConfig::default()
        }
    }

    fn snapshot() -> ServiceSnapshot {
        ServiceSnapshot {
            version: 1,
            cycle: 1,
            endpoints: BTreeMap::new(),
            operator: Default::default(),
        }
    }

    fn versioned(version: u64) -> ServiceSnapshot {
        ServiceSnapshot {
            version,
            cycle: version,
            endpoints: [(
                "n1".to_string(),
                ballast_balance::EndpointSnapshot {
                    address: "10.0.0.1:80".into(),
                    zone: "z".into(),
                    draining: false,
                    weight: 1.25,
                    strategy_weights: BTreeMap::new(),
                },
            )]
            .into(),
            operator: Default::default(),
        }
    }

    #[tokio::test]
    async fn an_unreachable_etcd_fails_writes_within_the_timeout_and_keeps_them_pending() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EtcdStore::open(&closed_port_config(), dir.path().join("copy.json"), None)
            .expect("opens without contacting etcd");
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
    }

    #[tokio::test]
    async fn a_start_while_etcd_is_down_serves_the_local_copy_and_keeps_it_current() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.etcd-copy.json");
        let cfg = closed_port_config();
        FileStore::with_origin(&path, "etcd prefix /t")
            .replace([("web".to_string(), versioned(7))].into())
            .await
            .expect("a copy from an earlier run");
        let store = EtcdStore::open(&cfg, path.clone(), None).expect("opens");
        assert_eq!(store.fallback(), None);
        let started = Instant::now();
        let served = store.load().await.expect("the copy, not an error");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(served, [("web".to_string(), versioned(7))].into());
        let why = store.fallback().expect("in fallback");
        assert!(
            why.contains("could not be read at start") && why.contains("local copy"),
            "{why}"
        );
        // Writes carry the reconciliation; while etcd is down they fail, saying so, and
        // the copy takes the new values for a restart during the outage.
        let err = store
            .put(&[("api".to_string(), versioned(2))].into())
            .await
            .expect_err("etcd is down");
        assert!(err.to_string().contains("serving the local copy"), "{err}");
        assert!(store.fallback().is_some());
        let copy = FileStore::with_origin(&path, "etcd prefix /t")
            .load()
            .await
            .expect("the copy");
        assert_eq!(copy.keys().collect::<Vec<_>>(), ["api", "web"]);
        // Even an empty write reads etcd while in fallback.
        assert!(store.put(&BTreeMap::new()).await.is_err());
        // A copy of another prefix is never served.
        let other = EtcdConfig {
            prefix: "/other".into(),
            ..cfg
        };
        let store = EtcdStore::open(&other, path, None).expect("opens");
        assert!(store.load().await.expect("starts").is_empty());
        assert!(store.fallback().is_some());
    }

    #[test]
    fn a_cluster_replica_writes_only_its_own_services_each_fenced_by_its_bucket() {
        let dir = tempfile::tempdir().expect("dir");
        let ownership = Arc::new(Ownership::new("r1", 8));
        ownership.valid_until(Instant::now() + Duration::from_secs(60));
        let (api, web) = (ownership.bucket("api"), ownership.bucket("web"));
        assert_ne!(api, web, "the test needs the two in different buckets");
        ownership.gained(api, 41);
        let store = EtcdStore::open(
            &closed_port_config(),
            dir.path().join("copy.json"),
            Some(Fence {
                ownership: ownership.clone(),
                cluster: "c".into(),
            }),
        )
        .expect("opens");
        let value = |v: u64| serde_json::to_vec(&versioned(v)).expect("json");
        {
            let mut ledger = store.ledger();
            ledger.absorb("api", value(1));
            ledger.absorb("web", value(1));
            ledger.revisions.insert("api".into(), 7);
        }
        // "web" belongs to another replica: dropped from the writes and counted.
        let batch = store.ledger().batch();
        let (batch, fences) = store.owned(batch);
        assert_eq!(
            batch.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
            ["api"]
        );
        assert_eq!(fences, [(api, 41)].into());
        assert!(!store.ledger().pending.contains_key("web"));
        assert_eq!(store.take_fenced(), 1);
        // The write of "api" compares its key with the revision last seen, and its
        // bucket's owner key with the revision the claim created it at, as taken
        // when the batch was made: a bucket lost meanwhile fails the write.
        // Each compare is checked whole: its key, what it compares (the key's mod
        // revision, the owner key's create revision), the operator and the value.
        let key = crate::ownership::owner_key("/t", "c", api);
        let expected = |owner_rev: i64| {
            format!(
                "{:?}",
                [
                    Compare::mod_revision(service_key("/t", "api"), CompareOp::Equal, 7),
                    Compare::create_revision(key.clone(), CompareOp::Equal, owner_rev),
                ]
            )
        };
        assert_eq!(
            format!("{:?}", store.compares(&batch, &fences)),
            expected(41)
        );
        // A bucket the batch's fences did not see held compares against -1, which no
        // create revision matches.
        assert_eq!(
            format!("{:?}", store.compares(&batch, &BTreeMap::new())),
            expected(-1)
        );
        // A fence that failed drops only the services whose bucket changed hands.
        store.ledger().absorb("api", value(2));
        store.fenced_out(&batch, &fences);
        assert!(store.ledger().pending.contains_key("api"), "still ours");
        ownership.lost(api);
        store.fenced_out(&batch, &fences);
        assert!(!store.ledger().pending.contains_key("api"));
        // A lone aggregator's writes compare only the keys' revisions.
        let lone = EtcdStore::open(&closed_port_config(), dir.path().join("c2.json"), None)
            .expect("opens");
        let compares = format!("{:?}", lone.compares(&batch, &BTreeMap::new()));
        assert!(
            !compares.contains("-1") && !compares.contains("owners"),
            "{compares}"
        );
    }

    /// A real etcd of Debian's, on free loopback ports in a directory of its own,
    /// stopped when dropped. Panics, saying what to install, when there is no etcd.
    pub(crate) struct RealEtcd {
        child: std::process::Child,
        pub(crate) url: String,
        _dir: tempfile::TempDir,
    }

    impl RealEtcd {
        pub(crate) fn start() -> RealEtcd {
            let port = || {
                std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .expect("a free port")
                    .port()
            };
            let (client, peer) = (port(), port());
            let dir = tempfile::tempdir().expect("tempdir");
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let child = std::process::Command::new("etcd")
                .args(["--name", "fence-test", "--data-dir"])
                .arg(dir.path().join("data"))
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("fence-test={peer_url}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("etcd is not installed: apt-get install etcd-server (tests/run does)");
            RealEtcd {
                child,
                url,
                _dir: dir,
            }
        }
    }

    impl Drop for RealEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// etcd itself refuses the write of a replica whose bucket was claimed by another
    /// since it took its fence, even when the replica still believes it owns it (a
    /// pause, a watch not yet delivered): the compare on the owner key's create
    /// revision, not the replica's own check, keeps the successor's value.
    #[tokio::test]
    async fn etcd_refuses_a_write_whose_owner_key_was_claimed_again() {
        let etcd = RealEtcd::start();
        let cfg = EtcdConfig {
            endpoints: vec![etcd.url.clone()],
            prefix: "/t".into(),
            ..EtcdConfig::default()
        };
        let mut raw = None;
        for _ in 0..100 {
            if let Ok(mut c) = Client::connect([etcd.url.as_str()], None).await {
                if c.get("/", None).await.is_ok() {
                    raw = Some(c);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut raw = raw.expect("etcd answers within 10 s");
        let ownership = Arc::new(Ownership::new("r1", 8));
        ownership.valid_until(Instant::now() + Duration::from_secs(60));
        let bucket = ownership.bucket("api");
        let owner = crate::ownership::owner_key("/t", "c", bucket);
        let claim = raw.put(owner.as_str(), "r1", None).await.expect("claim");
        let created = claim.header().map(|h| h.revision()).expect("revision");
        ownership.gained(bucket, created);
        let dir = tempfile::tempdir().expect("dir");
        let store = EtcdStore::open(
            &cfg,
            dir.path().join("copy.json"),
            Some(Fence {
                ownership: ownership.clone(),
                cluster: "c".into(),
            }),
        )
        .expect("opens");
        let stored = |raw: &mut Client| {
            let mut raw = raw.clone();
            async move {
                let got = raw.get(service_key("/t", "api"), None).await.expect("get");
                let kv = got.kvs().first().expect("api is stored");
                serde_json::from_slice::<ServiceSnapshot>(kv.value())
                    .expect("json")
                    .version
            }
        };
        let one = |v: u64| BTreeMap::from([("api".to_string(), versioned(v))]);
        store.put(&one(1)).await.expect("the owner writes");
        assert_eq!(stored(&mut raw).await, 1);

        // Another replica claims the bucket again (its key made anew) and writes.
        raw.delete(owner.as_str(), None).await.expect("delete");
        raw.put(owner.as_str(), "r2", None)
            .await
            .expect("claim again");
        let theirs = serde_json::to_vec(&versioned(50)).expect("json");
        raw.put(service_key("/t", "api"), theirs, None)
            .await
            .expect("successor writes");

        // The first replica, which has not heard, writes a newer value of its own.
        assert!(ownership.owns("api"), "it still believes it owns api");
        let _ = store.put(&one(2)).await;
        assert_eq!(
            stored(&mut raw).await,
            50,
            "etcd kept the successor's value: the fenced write was refused"
        );
    }

    /// A service's value exactly as the release that spoke `ballast/1` put it (compact
    /// JSON of its snapshot), one of a release before strategy weights, zones and
    /// draining were kept, and one with fields a later release may add: today's
    /// reader takes all three, so that replicas of two releases share the keys.
    #[test]
    fn values_of_the_previous_and_the_next_release_are_read() {
        let previous = br#"{"version":7,"cycle":30,"endpoints":{"n1":{"address":"10.0.0.1:80","zone":"z","draining":false,"weight":1.25,"strategy_weights":{"pid":1.25}}}}"#;
        let (service, snap) = decode_entry("/p", "/p/services/web", previous).expect("valid");
        assert_eq!(service, "web");
        let mut want = versioned(7);
        want.cycle = 30;
        if let Some(ep) = want.endpoints.get_mut("n1") {
            ep.strategy_weights = [(ballast_balance::Strategy::Pid, 1.25)].into();
        }
        assert_eq!(snap, want);

        let older = br#"{"version":7,"cycle":7,"endpoints":{"n1":{"address":"10.0.0.1:80","weight":1.25}}}"#;
        let (_, snap) = decode_entry("/p", "/p/services/web", older).expect("valid");
        assert_eq!(snap.endpoints["n1"].weight, 1.25);
        assert_eq!(snap.endpoints["n1"].zone, "");

        let next = br#"{"version":7,"cycle":7,"written_by":"9.9.9","endpoints":{"n1":{"address":"10.0.0.1:80","zone":"z","weight":1.25,"weight_floor":0.2}}}"#;
        let (_, snap) = decode_entry("/p", "/p/services/web", next).expect("valid");
        assert_eq!(snap, versioned(7));
    }

    #[test]
    fn keys_that_are_not_valid_services_are_told_apart() {
        let good = serde_json::to_vec(&versioned(3)).expect("json");
        let (service, snap) = decode_entry("/p", "/p/services/web", &good).expect("valid");
        assert_eq!((service.as_str(), snap), ("web", versioned(3)));
        let defect =
            |key: &str, value: &[u8]| decode_entry("/p", key, value).err().map(|c| c.defect);
        assert_eq!(defect("/p/services/a b", &good), Some(Defect::Service));
        assert_eq!(defect("/p/services/a/b", &good), Some(Defect::Service));
        assert_eq!(
            defect("/p/services/web", b"{not json"),
            Some(Defect::Unparseable)
        );
        let mut bad = versioned(3);
        if let Some(ep) = bad.endpoints.get_mut("n1") {
            ep.address = "nowhere".into();
        }
        let bad = serde_json::to_vec(&bad).expect("json");
        assert_eq!(defect("/p/services/web", &bad), Some(Defect::Address));
    }

    #[test]
    fn etcd_is_newer_where_its_version_is_higher_or_the_aggregator_lacks_the_service() {
        let stored: BTreeMap<_, _> = [
            ("older".to_string(), versioned(3)),
            ("same".to_string(), versioned(5)),
            ("newer".to_string(), versioned(9)),
            ("only-in-etcd".to_string(), versioned(1)),
        ]
        .into();
        let ours: BTreeMap<_, _> = [
            ("older".to_string(), versioned(4)),
            ("same".to_string(), versioned(5)),
            ("newer".to_string(), versioned(8)),
            ("only-ours".to_string(), versioned(1)),
        ]
        .into();
        let newer = newer_in_store(stored, &ours);
        assert_eq!(newer.keys().collect::<Vec<_>>(), ["newer", "only-in-etcd"]);
    }

    #[test]
    fn what_is_read_replaces_what_the_ledger_knew() {
        let mut l = Ledger::default();
        l.absorb("a", v("1"));
        l.absorb("b", v("2"));
        l.committed(&l.batch());
        l.absorb("a", v("3"));
        l.absorb("c", v("4"));
        // etcd holds a=3 (so nothing to write), and lost b.
        l.loaded(vec![("a".to_string(), v("3"))]);
        assert_eq!(l.batch(), vec![("c".to_string(), v("4"))]);
        assert!(!l.written.contains_key("b"));
    }

    #[test]
    fn errors_say_what_they_mean_for_the_settings() {
        let no_cert = Credentials {
            tls: true,
            client_cert: false,
            user: Some("ballast".into()),
        };
        let with_cert = Credentials {
            client_cert: true,
            ..no_cert.clone()
        };
        let plain = Credentials {
            tls: false,
            client_cert: false,
            user: None,
        };
        let alert = "transport error: received fatal alert: BadCertificate".to_string();
        assert!(no_cert
            .explain("/p", alert.clone())
            .starts_with("etcd refused the TLS connection: it requires a client certificate"));
        assert!(with_cert
            .explain("/p", alert.clone())
            .contains("does not accept the client certificate"));
        let closed = "hyper::Error(Canceled, \"connection closed\")".to_string();
        assert!(no_cert.explain("/p", closed.clone()).contains("cert_file"));
        assert_eq!(with_cert.explain("/p", closed.clone()), closed);
        assert_eq!(plain.explain("/p", closed.clone()), closed);
        let login = "etcdserver: authentication failed, invalid user ID or password".to_string();
        let explained = with_cert.explain("/p", login.clone());
        assert!(
            explained.contains("wrong user or password") && explained.ends_with(&login),
            "{explained}"
        );
        let denied = "etcdserver: permission denied".to_string();
        let explained = with_cert.explain("/p", denied);
        assert!(
            explained.contains("keys under /p/ (services/, chunks/"),
            "{explained}"
        );
        let refused = "tcp connect error: Connection refused".to_string();
        assert_eq!(no_cert.explain("/p", refused.clone()), refused);
    }

    #[test]
    fn unusable_files_stop_the_start_naming_the_setting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = ballast_shared::pki::Ca::generate("etcd test CA").expect("CA");
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, ca.pem().cert).expect("write");
        let client = ca.issue_node("agg", &[]).expect("client certificate").pem;
        let (cert, key) = (dir.path().join("c.pem"), dir.path().join("c.key"));
        client.write(dir.path(), "c").expect("write");
        let password = dir.path().join("pw");
        std::fs::write(&password, "secret\n").expect("write");
        let tls = EtcdConfig {
            endpoints: vec!["https://127.0.0.1:2379".into()],
            ca_file: Some(ca_path.clone()),
            cert_file: Some(cert.clone()),
            key_file: Some(key.clone()),
            user: Some("ballast".into()),
            password_file: Some(password.clone()),
            ..EtcdConfig::default()
        };
        let copy = dir.path().join("copy.json");
        assert!(EtcdStore::open(&tls, copy.clone(), None).is_ok());
        let setting_of = |cfg: EtcdConfig| match EtcdStore::open(&cfg, copy.clone(), None) {
            Err(StoreError::Setup { setting, reason }) => format!("{setting}: {reason}"),
            Err(e) => panic!("not a setup error: {e}"),
            Ok(_) => "opened".into(),
        };
        let missing = setting_of(EtcdConfig {
            ca_file: Some(dir.path().join("absent.pem")),
            ..tls.clone()
        });
        assert!(
            missing.starts_with("store.etcd.ca_file: ") && missing.contains("absent.pem"),
            "{missing}"
        );
        let not_pem = setting_of(EtcdConfig {
            ca_file: Some(password.clone()),
            ..tls.clone()
        });
        assert!(not_pem.starts_with("store.etcd.ca_file: "), "{not_pem}");
        let swapped = setting_of(EtcdConfig {
            cert_file: Some(key.clone()),
            ..tls.clone()
        });
        assert!(swapped.starts_with("store.etcd.cert_file: "), "{swapped}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").expect("write");
        let empty = setting_of(EtcdConfig {
            password_file: Some(empty),
            ..tls.clone()
        });
        assert!(empty.starts_with("store.etcd.password_file: "), "{empty}");
        let invalid = setting_of(EtcdConfig {
            ca_file: None,
            ..tls
        });
        assert!(invalid.starts_with("store.etcd.ca_file: "), "{invalid}");
    }

    #[tokio::test]
    async fn runs_on_the_callers_runtime_and_drops_there() {
        // The daemon builds the store and calls `load` on its own runtime (here a
        // current-thread one): nothing may need a second runtime, block the one
        // thread, or panic when dropped there.
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EtcdStore::open(&closed_port_config(), dir.path().join("copy.json"), None)
            .expect("opens");
        assert!(store.load().await.is_ok(), "falls back to the (empty) copy");
        assert!(store.put(&BTreeMap::new()).await.is_err());
        drop(store);
    }
}
