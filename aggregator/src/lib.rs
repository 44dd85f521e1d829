//! The Ballast aggregator: ingest reports over QUIC, balance per service, publish weights.
//!
//! The sans-IO core is the `ballast-balance` crate; this is the daemon around it.

pub mod api;
pub mod audit;
pub mod certs;
pub mod cli;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod daemon;
pub mod door;
pub mod feed;
// Entry points for the fuzz targets (`fuzz/`), compiled only when cargo-fuzz sets
// `--cfg fuzzing`.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
pub mod ingest;
pub mod metrics;
pub mod ownership;
pub mod reload;
pub mod state;
pub mod store;
// The watched tasks, shared with the relay: `ballast-ingest` holds them.
pub use ballast_ingest::supervise;
#[cfg(test)]
mod test_http;
pub mod ui;
