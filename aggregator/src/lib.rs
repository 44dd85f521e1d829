//! The Ballast aggregator: ingest reports over QUIC, balance per service, publish weights.

pub mod balance;
