//! The harness: one call each to get certificates, an aggregator, agents and a raw
//! QUIC client, all real processes or sockets on 127.0.0.1, each cleaned up on drop.

pub mod ads;
pub mod agent;
pub mod aggregator;
pub mod api;
pub mod backend;
pub mod browser;
pub mod cluster;
pub mod converge;
pub mod etcd;
pub mod fleet;
pub mod grpc;
pub mod haproxy;
pub mod netns;
pub mod node;
pub mod packages;
pub mod pki;
pub mod ports;
pub mod process;
pub mod quic;
pub mod raw_trunk;
pub mod relay;
pub mod wait;
