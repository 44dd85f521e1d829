//! The routing store: where published weights live beyond the aggregator's memory.
//!
//! A restarted aggregator reads its weights back from here, and load balancers that
//! watch the store see every change. The embedded default is one local file; etcd is
//! the other implementation.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod file;

use ballast_balance::ServiceSnapshot;
use std::collections::BTreeMap;

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
}

/// Persistent per-service weights.
pub trait RoutingStore: Send + Sync {
    /// Every stored service.
    fn load(&self) -> Result<BTreeMap<String, ServiceSnapshot>, StoreError>;
    /// Writes the given services in one batch; services not named are left as stored.
    fn put(&self, changed: &BTreeMap<String, ServiceSnapshot>) -> Result<(), StoreError>;
    /// A short name for logs and the API.
    fn describe(&self) -> String;
}
