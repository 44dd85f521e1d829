//! Counters the agent's tasks bump and `/metrics` renders, beside the [`Status`]
//! (which holds the rest). They live apart from both the tasks that count (the report
//! loop, the agent-check) and the one that renders (the metrics server), so that no
//! task depends on another.
//!
//! [`Status`]: crate::status::Status

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Upper bounds of the sample-duration buckets, in seconds. A host or cgroup sample
/// takes tens of microseconds; a Prometheus source is an HTTP round trip.
pub(crate) const SAMPLE_BUCKETS: [f64; 9] =
    [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0];

/// What the agent-check answered, for [`Metrics::agentcheck_reply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AgentCheckReply {
    /// The aggregator's weight.
    Weight,
    /// `drain`.
    Drain,
    /// The mean weight, because no fresh weight was at hand.
    Mean,
}

/// Counters that the status does not hold.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Samples per bucket of [`SAMPLE_BUCKETS`] (not cumulative), then the overflow.
    pub(crate) sample_buckets: [AtomicU64; SAMPLE_BUCKETS.len() + 1],
    /// Total sample time, in nanoseconds.
    pub(crate) sample_sum_ns: AtomicU64,
    /// Agent-check answers, indexed by [`AgentCheckReply`].
    pub(crate) agentcheck: [AtomicU64; 3],
    /// Connections the metrics server is serving now.
    pub(crate) open: AtomicUsize,
}

impl Metrics {
    /// Records how long one sample took.
    pub(crate) fn observe_sample(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let i = SAMPLE_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(SAMPLE_BUCKETS.len());
        self.sample_buckets[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.sample_sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Counts one agent-check answer.
    pub(crate) fn agentcheck_reply(&self, reply: AgentCheckReply) {
        self.agentcheck[reply as usize].fetch_add(1, Ordering::Relaxed);
    }
}
