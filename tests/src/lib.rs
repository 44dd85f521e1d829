//! Ballast integration tests: real `ballast-aggregator` and `ballast-agent` processes
//! over loopback QUIC with mutual TLS, driven through a shared harness in the
//! linkerd2-proxy style.
//!
//! ```no_run
//! use ballast_tests::*;
//! use std::time::Duration;
//!
//! let pki = Pki::new();
//! let agg = Aggregator::start(&pki, AggregatorOpts::default());
//! let agent = Agent::start(&pki, &agg, AgentOpts::new("web", "web-1"));
//! agent.wait_weight(Duration::from_secs(10));
//! let eps = wait_until(Duration::from_secs(5), "web-1 serving", || {
//!     let eps = agg.endpoints("web");
//!     eps.iter()
//!         .any(|e| e.node == "web-1" && e.state == EndpointState::Serving)
//!         .then_some(eps)
//! });
//! assert_eq!(eps.len(), 1);
//! ```
//!
//! The binaries are found next to the test executable (`target/debug/`); build them
//! first with `cargo build --workspace --bins`. Every child process is killed when its
//! handle drops, panicking or not, and by the kernel if the test thread dies.

pub mod harness;
pub mod lab;

pub use harness::ads::{xds_aggregator_opts, EdsResponse, EdsWatch};
pub use harness::agent::{start_fleet, Agent, AgentOpts, AgentStatus, ControlResponse};
pub use harness::aggregator::{Aggregator, AggregatorOpts};
pub use harness::api::{
    ConfigView, EndpointState, EndpointView, ErrorBody, Health, HealthStatus, HistoryPoint,
    MetricSample, Published, ServiceDetail, ServiceHistory, ServiceStats, ServiceSummary,
    SkipReason, Spread, StoreCondition, WeightEntry, WeightSet,
};
pub use harness::backend::Backend;
pub use harness::converge::{converged, node_names, start_speeds};
pub use harness::etcd::{endpoints_for, require_etcd, snapshot_value, Etcd, Watch, WatchEvent};
pub use harness::fleet::fleet_served;
pub use harness::haproxy::{require_haproxy, Haproxy, HaproxyOpts, ServerState};
pub use harness::packages::{packages, repo_root, require_tool, Packages, ScratchRoot};
pub use harness::pki::Pki;
pub use harness::process::{
    bench_arg, binary, children_of, command, one_at_a_time, run_bounded, AGENT_BIN, AGGREGATOR_BIN,
};
pub use harness::quic::{client_config_without_certificate, RawClient, RawConn};
pub use harness::raw_trunk::RawTrunk;
pub use harness::relay::{Relay, RelayOpts};
pub use harness::wait::{holds_for, wait_for, wait_for_polling, wait_until};

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    ballast_shared::unix_ms()
}
