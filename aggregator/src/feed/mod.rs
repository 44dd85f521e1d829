//! Weight feeds: how load balancers and watchers learn the published weights.

pub mod haproxy;
pub mod watch;
pub mod xds;

#[cfg(test)]
mod agree;
