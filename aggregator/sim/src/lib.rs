//! Ballast's simulator and demo, kept out of the daemon so that the production
//! `ballast-aggregator` links neither the agent nor the chart library.
//!
//! [`simulate`] drives the real balancing core (`ballast-balance`) through seeded
//! fleets and writes `docs/balance.md`; its [`simulate::chart`] helper also draws the
//! lab report's charts. [`demo`] starts a real aggregator and a fleet of real agents on
//! loopback and prints them converging. [`loadgen`] is the benches' load generator:
//! many real agent sessions over QUIC from one process.

pub mod demo;
pub mod loadgen;
pub mod procstat;
pub mod simulate;
