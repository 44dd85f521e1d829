//! The routing store: where published weights live beyond the aggregator's memory.
//!
//! A restarted aggregator reads its weights back from here, and load balancers that
//! watch the store see every change. The embedded default is one local file; etcd is
//! the other implementation.
//!
//! The store is asynchronous and only ever written by one background task, the
//! [`writer`]: a cycle publishes and goes on, and a slow or hung store delays nothing
//! but the store itself. The writer takes the latest publication each time a write
//! returns ("the last value wins"), so a store that falls behind skips intermediate
//! versions rather than queueing them. How it is doing shows in [`StoreStatus`]
//! (`/healthz`) and in the `ballast_store_*` metrics.

//!
//! What a store reads back is checked ([`validate`]): a stored service that is not one
//! the aggregator could have written is skipped, logged and counted, and the rest
//! loads.

pub mod chunks;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod file;
pub mod validate;
mod writer;
#[cfg(test)]
pub(crate) use writer::differs;
pub(crate) use writer::restore_newer;

pub use writer::{writer, Restored, Sink, StoreCondition, StoreHealth, StoreStatus, STALL_AFTER};

use crate::config::StoreConfig;
use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use validate::Defect;

/// Why the store could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file system refused.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The stored bytes are not a valid snapshot.
    #[error("{path}: corrupt routing store: {detail}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// A remote store failed.
    #[error("routing store backend: {0}")]
    Backend(String),
    /// The blocking task that did the file I/O panicked or was cancelled.
    #[error("routing store task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A file the store's settings name cannot be used (a CA, a client certificate,
    /// a password file): found at start, before anything is served.
    #[error("{setting}: {reason}")]
    Setup {
        /// The setting's dotted path, e.g. `store.etcd.ca_file`.
        setting: String,
        /// What is wrong with what it names.
        reason: String,
    },
}

/// What a store's asynchronous calls return: boxed, so that [`RoutingStore`] stays
/// usable as `Arc<dyn RoutingStore>` and tests can put their own store in the daemon.
pub(crate) type StoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Persistent per-service weights.
///
/// Implementations must not block the runtime's workers: file I/O goes to
/// `spawn_blocking`, network I/O is async and bounded by the store's own timeouts.
pub trait RoutingStore: Send + Sync {
    /// Every valid stored service; called once at start, before serving. A store that
    /// keeps a local copy (etcd) serves the copy when it cannot be read, and says so
    /// in [`RoutingStore::fallback`], rather than failing the start.
    fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>>;
    /// Writes the given services in one batch; services not named are left as stored.
    /// Only the [`writer`] calls it, one call at a time. After a [fallback], the
    /// first call reads the store first and reconciles (see
    /// [`RoutingStore::take_newer`]); it is made even with an empty batch.
    ///
    /// [fallback]: RoutingStore::fallback
    fn put<'a>(&'a self, changed: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()>;
    /// A short name for logs and the API.
    fn describe(&self) -> String;
    /// Why what `load` returned is not known to be what the store holds (etcd could
    /// not be read at start and its local copy was served), until a `put` has read the
    /// store again; `None` when `load` read the store itself.
    fn fallback(&self) -> Option<String> {
        None
    }
    /// The services that the store, read again after a fallback, holds at a higher
    /// version than the `put` that read it carried, or that it did not carry at all.
    /// They were left as stored; the writer restores them into the balancer where that
    /// replaces nothing live. Each is returned once.
    fn take_newer(&self) -> BTreeMap<String, ServiceSnapshot> {
        BTreeMap::new()
    }
    /// How many stored services were skipped as corrupt since the last call, by
    /// defect; the writer counts them in `ballast_store_corrupt_total`.
    fn take_skipped(&self) -> BTreeMap<Defect, u64> {
        BTreeMap::new()
    }
    /// Services whose latest value is too large for the store to take, with its size
    /// in bytes: they keep their last stored value while the others are written. The
    /// writer shows them in `/healthz` and `ballast_store_too_large`.
    fn too_large(&self) -> BTreeMap<String, usize> {
        BTreeMap::new()
    }
    /// How many values were refused for their size since the last call; the writer
    /// counts them in `ballast_store_refused_total{reason="too_large"}`.
    fn take_refused(&self) -> u64 {
        0
    }
    /// How many values were left unwritten since the last call because another
    /// cluster replica owns their service now; the writer counts them in
    /// `ballast_store_refused_total{reason="not_owner"}`.
    fn take_fenced(&self) -> u64 {
        0
    }
}

/// The routing store `cfg` configures: etcd when `[store.etcd]` is set, else the file.
/// Nothing is read yet; a file an etcd setting names that cannot be used is an error.
pub fn open(cfg: &StoreConfig) -> Result<Arc<dyn RoutingStore>, StoreError> {
    match &cfg.etcd {
        Some(etcd) => open_etcd(etcd, &cfg.path),
        None => Ok(Arc::new(file::FileStore::new(cfg.path.clone()))),
    }
}

#[cfg(feature = "etcd")]
fn open_etcd(
    cfg: &crate::config::EtcdConfig,
    store_path: &std::path::Path,
) -> Result<Arc<dyn RoutingStore>, StoreError> {
    Ok(Arc::new(etcd::EtcdStore::open(
        cfg,
        cfg.local_copy_path(store_path),
        None,
    )?))
}

/// The etcd store of one replica of a cluster: its writes fenced by the owner keys
/// of `fence`.
#[cfg(feature = "etcd")]
pub(crate) fn open_fenced(
    cfg: &StoreConfig,
    fence: etcd::Fence,
) -> Result<Arc<etcd::EtcdStore>, StoreError> {
    let etcd = cfg.etcd.as_ref().ok_or_else(|| StoreError::Setup {
        setting: "cluster".into(),
        reason: "a cluster needs the etcd routing store ([store.etcd] or --etcd)".into(),
    })?;
    Ok(Arc::new(etcd::EtcdStore::open(
        etcd,
        etcd.local_copy_path(&cfg.path),
        Some(fence),
    )?))
}

#[cfg(not(feature = "etcd"))]
fn open_etcd(
    _cfg: &crate::config::EtcdConfig,
    _store_path: &std::path::Path,
) -> Result<Arc<dyn RoutingStore>, StoreError> {
    Err(StoreError::Backend(
        "an etcd routing store is configured, but this ballast-aggregator was built without \
         the etcd feature (build with `--features ballast-aggregator/etcd`)"
            .into(),
    ))
}
