//! The trunk between a relay and a primary aggregator, as bytes: its codec
//! ([`codec`]), re-exported here. The two ends' machines are
//! [`crate::session::trunk`].

pub mod codec;

pub use codec::*;
