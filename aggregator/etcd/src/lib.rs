//! Ballast in etcd: a cluster's keys ([`cluster`], no I/O), and, with the `client`
//! feature, the connection to etcd, one for every part of Ballast that talks to it:
//! the routing store and the cluster (whose lease shares the store's client). Relays
//! read no etcd: they learn the routes from the replicas, and use only [`cluster`]'s
//! bucket hash.
//!
//! [`Connection::new`] reads and checks the files the settings name (a CA, a client
//! certificate, a password file) at start, before anything is contacted;
//! [`Connection::connect`] connects (and logs in) within the connect and request
//! timeouts.

pub mod cluster;
#[cfg(feature = "client")]
mod connection;
#[cfg(feature = "client")]
pub use connection::*;

use std::path::PathBuf;
use std::time::Duration;

/// What a connection is made from: `[store.etcd]`'s connection settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Client URLs of the etcd members, all `http://` or all `https://`.
    pub endpoints: Vec<String>,
    /// How long connecting to a member may take.
    pub connect_timeout: Duration,
    /// How long one read or write may take.
    pub request_timeout: Duration,
    /// The CA certificate(s), PEM, etcd's server certificate must chain to
    /// (`https://` only).
    pub ca_file: Option<PathBuf>,
    /// The client certificate, PEM (`https://` only).
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key, PEM.
    pub key_file: Option<PathBuf>,
    /// The etcd user to authenticate as.
    pub user: Option<String>,
    /// A file holding the user's password (one line; a final newline is ignored).
    pub password_file: Option<PathBuf>,
}

impl Connect {
    /// Whether the endpoints are `https://`: the connection uses TLS.
    pub fn uses_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
}
