//! What the running agent knows about itself, for `ballast-agent status` and the
//! HAProxy agent-check.

use serde::{Deserialize, Serialize};

/// The agent's view of its link and its weight.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Node identity.
    pub node: String,
    /// Service.
    pub service: String,
    /// The aggregator currently connected, if any.
    pub connected_to: Option<String>,
    /// Reports sent in total.
    pub reports_sent: u64,
    /// Reports that could not be sent.
    pub reports_failed: u64,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Samples that failed.
    pub sample_errors: u64,
    /// The last report: load, CPU, in-flight.
    pub last_load: Option<f64>,
    /// CPU of the last sample.
    pub last_cpu: Option<f64>,
    /// In-flight count of the last sample.
    pub last_inflight: Option<u32>,
    /// Milliseconds since the Unix epoch of the last report.
    pub last_report_unix_ms: Option<u64>,
    /// The weight last received, mean 1.0.
    pub weight: Option<f64>,
    /// The cycle it came from.
    pub weight_cycle: Option<u64>,
    /// Milliseconds since the Unix epoch when it arrived.
    pub weight_unix_ms: Option<u64>,
    /// This node asked to drain.
    pub draining: bool,
    /// The aggregator has it as draining.
    pub drain_acknowledged: bool,
    /// The last error, in words.
    pub last_error: Option<String>,
}

impl Status {
    /// Draining, acknowledged by the aggregator, and no request in flight: stopping
    /// the service now loses nothing.
    pub fn safe_to_stop(&self) -> bool {
        self.draining && self.drain_acknowledged && self.last_inflight == Some(0)
    }

    /// The weight if it is younger than `max_age_ms`: an old weight says nothing about
    /// the fleet now.
    pub fn fresh_weight(&self, now_unix_ms: u64, max_age_ms: u64) -> Option<f64> {
        match (self.weight, self.weight_unix_ms) {
            (Some(w), Some(at)) if now_unix_ms.saturating_sub(at) <= max_age_ms => Some(w),
            _ => None,
        }
    }
}
