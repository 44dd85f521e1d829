//! The Ballast aggregator: ingest reports over QUIC, balance per service, publish weights.
//!
//! `balance` is the sans-IO core; everything else is the daemon around it.

pub mod api;
pub mod balance;
pub mod certs;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod feed;
pub mod ingest;
pub mod metrics;
pub mod simulate;
pub mod state;
pub mod store;
