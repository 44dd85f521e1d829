//! Counters the agent's tasks bump and `/metrics` renders, beside the [`Status`]
//! (which holds the rest). They live apart from both the tasks that count (the report
//! loop, the agent-check) and the one that renders (the metrics server), so that no
//! task depends on another.
//!
//! [`Status`]: crate::status::Status

use std::sync::atomic::{AtomicU64, Ordering};
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

/// A connection one of the agent's listeners closed without its normal answer, for
/// [`Metrics::count_refusal`]: which listener, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The control socket was serving its maximum of connections.
    ControlConnections,
    /// The control socket's peer is neither root nor the agent's own user.
    ControlPeer,
    /// A control request was not in, or its answer not out, in time.
    ControlTimeout,
    /// The agent-check was serving its maximum of connections.
    AgentCheckConnections,
    /// An agent-check answer was not taken in time.
    AgentCheckTimeout,
    /// The metrics server was answering its maximum of connections, none of them idle.
    MetricsConnections,
    /// An idle metrics connection (no request yet) was closed to make room for a new
    /// one.
    MetricsEvicted,
    /// A metrics request was not in, or its answer not out, in time.
    MetricsTimeout,
}

impl Refused {
    /// Every kind, in the order of the counters.
    pub(crate) const ALL: [Refused; 8] = [
        Refused::ControlConnections,
        Refused::ControlPeer,
        Refused::ControlTimeout,
        Refused::AgentCheckConnections,
        Refused::AgentCheckTimeout,
        Refused::MetricsConnections,
        Refused::MetricsEvicted,
        Refused::MetricsTimeout,
    ];

    /// The metric's `listener` and `reason` labels.
    pub(crate) fn labels(self) -> (&'static str, &'static str) {
        match self {
            Refused::ControlConnections => ("control", "connections"),
            Refused::ControlPeer => ("control", "peer"),
            Refused::ControlTimeout => ("control", "timeout"),
            Refused::AgentCheckConnections => ("agentcheck", "connections"),
            Refused::AgentCheckTimeout => ("agentcheck", "timeout"),
            Refused::MetricsConnections => ("metrics", "connections"),
            Refused::MetricsEvicted => ("metrics", "evicted"),
            Refused::MetricsTimeout => ("metrics", "timeout"),
        }
    }
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
    /// Connections closed without their normal answer, indexed by [`Refused`].
    pub(crate) refused: [AtomicU64; Refused::ALL.len()],
    /// What became of changed TLS files.
    pub(crate) tls_reloads: std::sync::Arc<ballast_shared::tls::live::ReloadCounts>,
    /// Moves to a connection made with a renewed certificate that failed: the old
    /// connection stayed.
    pub(crate) certificate_move_failures: AtomicU64,
    /// In-flight samples taken between reports, for their means.
    pub(crate) subsamples: AtomicU64,
    /// Their total time, in nanoseconds: the cost of the extra samples.
    pub(crate) subsample_sum_ns: AtomicU64,
    /// Those that failed (a source error, a timeout, a stuck sampler): the report's
    /// mean is then over fewer samples.
    pub(crate) subsample_failures: AtomicU64,
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

    /// Counts one connection closed without its normal answer.
    pub(crate) fn count_refusal(&self, why: Refused) {
        self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How many connections were closed for `why`.
    pub(crate) fn refusals(&self, why: Refused) -> u64 {
        self.refused[why as usize].load(Ordering::Relaxed)
    }
}
