//! Report ingest: agents connect over QUIC with mutual TLS.

pub(crate) mod quic;
