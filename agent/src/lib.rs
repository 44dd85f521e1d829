//! Ballast agent library.
//!
//! The agent samples how busy its service is, reports it to an aggregator over QUIC,
//! and keeps the weight it gets back for the CLI and the HAProxy agent-check.

pub(crate) mod agentcheck;
pub mod cli;
pub mod config;
pub mod control;
pub(crate) mod counters;
pub mod daemon;
// Entry points for the fuzz targets (`fuzz/`), compiled only when cargo-fuzz sets
// `--cfg fuzzing`.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod metrics;
pub(crate) mod report;
pub mod sample;
pub mod shared;
pub mod status;
