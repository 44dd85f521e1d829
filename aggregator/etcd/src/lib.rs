//! Ballast in etcd: a cluster's keys ([`cluster`], no I/O), and, with the `client`
//! feature, the connection to etcd, one for every part of Ballast that talks to it:
//! the routing store (whose client the cluster's lease shares) and the relay's routes.
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
