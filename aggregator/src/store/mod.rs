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

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod file;
mod writer;

pub use writer::{writer, StoreCondition, StoreHealth, StoreStatus, STALL_AFTER};

use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

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
    /// Every stored service; called once at start, before serving.
    fn load(&self) -> StoreFuture<'_, BTreeMap<String, ServiceSnapshot>>;
    /// Writes the given services in one batch; services not named are left as stored.
    /// Only the [`writer`] calls it, one call at a time.
    fn put<'a>(&'a self, changed: &'a BTreeMap<String, ServiceSnapshot>) -> StoreFuture<'a, ()>;
    /// A short name for logs and the API.
    fn describe(&self) -> String;
}
