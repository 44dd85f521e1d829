//! The trunk between a relay and a primary aggregator, as bytes: its codec
//! ([`codec`]), re-exported here, and the routes a replica tells a relay
//! ([`routes`]). The two ends' machines are [`crate::session::trunk`].

pub mod codec;
pub mod routes;

pub use codec::*;
