//! A trunk's two ends as sans-IO machines ([`machines`]: [`TrunkServer`] on the
//! primary, [`TrunkClient`] on the relay), re-exported here; the bytes they exchange
//! are [`crate::trunk`]'s codec.

pub mod machines;

pub use machines::*;
