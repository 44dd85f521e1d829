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
    /// How the in-flight count was derived, e.g. "3 of 12 connections owe a response".
    #[serde(default)]
    pub inflight_detail: Option<String>,
    /// The load the aggregator steers this node by (it judges the in-flight count
    /// against the fleet), from its last reply.
    #[serde(default)]
    pub aggregator_load: Option<f64>,
    /// Whether the aggregator trusts this node's in-flight count, from its last reply.
    #[serde(default)]
    pub inflight_trusted: Option<bool>,
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
    /// Since when (milliseconds since the Unix epoch) every sample has counted 0 in
    /// flight; reset by a drain, so that the quiet period starts after it.
    pub inflight_zero_since_unix_ms: Option<u64>,
    /// Sessions established with an aggregator since the agent started.
    pub connections: u64,
    /// The last error, in words.
    pub last_error: Option<String>,
    /// The aggregator's last refusal of this node: of its hello (a service or an
    /// address it may not claim, an unknown service, another node's certificate) or of
    /// its certificate (revoked, expired, not trusted). Cleared by the next welcome.
    #[serde(default)]
    pub rejection: Option<Rejection>,
    /// Refusals since the agent started.
    #[serde(default)]
    pub rejections: u64,
    /// When this node's certificate expires, in milliseconds since the Unix epoch.
    #[serde(default)]
    pub certificate_expires_unix_ms: Option<u64>,
}

/// A refusal by the aggregator, as the agent heard it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// A stable code: a reject reason of the protocol (`service_not_allowed`,
    /// `address_not_allowed`, `unknown_service`, `identity_mismatch`,
    /// `invalid_hello`), or what became of the certificate (`revoked`, `expired`,
    /// `certificate_refused`).
    pub reason: String,
    /// The aggregator's words, or what the agent could tell.
    pub detail: String,
    /// The aggregator that refused.
    pub aggregator: String,
    /// When, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

/// From how long before its certificate expires the agent warns.
pub const CERTIFICATE_WARNING_MS: u64 = 30 * 24 * 3600 * 1000;

impl Status {
    /// A warning about the certificate's lifetime at `now_unix_ms`, from
    /// [`CERTIFICATE_WARNING_MS`] before it expires.
    pub fn certificate_warning(&self, now_unix_ms: u64) -> Option<String> {
        let expires = self.certificate_expires_unix_ms?;
        if now_unix_ms >= expires {
            return Some(
                "this node's certificate has expired: the aggregator refuses it; issue a new \
                 one (ballast-aggregator certs issue) and restart the agent"
                    .to_string(),
            );
        }
        let left = expires - now_unix_ms;
        (left < CERTIFICATE_WARNING_MS).then(|| {
            format!(
                "this node's certificate expires in {:.1} days: issue a new one \
                 (ballast-aggregator certs issue) and restart the agent before then",
                left as f64 / 86_400_000.0
            )
        })
    }
}

/// Whether stopping the service now loses nothing, and why or why not, in words an
/// operator can act on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopVerdict {
    /// Stopping now loses nothing.
    pub safe: bool,
    /// Why, e.g. "safe to stop: drained, acknowledged by the aggregator, 0 in flight
    /// for 6.0 s".
    pub reason: String,
}

impl Status {
    /// Safe to stop when the node is draining, the aggregator has acknowledged it
    /// (every feed publishes weight 0), the last sample is at most `max_sample_age_ms`
    /// old, and every sample since the drain for at least `quiet_ms` counted nothing
    /// in flight: load balancers that poll within `quiet_ms` have seen the drain, and
    /// the work they sent before it is done.
    pub(crate) fn stop_verdict(
        &self,
        now_unix_ms: u64,
        quiet_ms: u64,
        max_sample_age_ms: u64,
    ) -> StopVerdict {
        let not_yet = |why: String| StopVerdict {
            safe: false,
            reason: format!("not yet safe to stop: {why}"),
        };
        if !self.draining {
            return StopVerdict {
                safe: false,
                reason: "not safe to stop: serving (run `ballast-agent drain` first)".into(),
            };
        }
        if !self.drain_acknowledged {
            return not_yet("draining, waiting for the aggregator to acknowledge the drain".into());
        }
        let sample_age = self
            .last_report_unix_ms
            .map(|at| now_unix_ms.saturating_sub(at));
        if sample_age.is_none_or(|age| age > max_sample_age_ms) {
            return not_yet("draining, but no recent sample of the work in flight".into());
        }
        let quiet = match (self.last_inflight, self.inflight_zero_since_unix_ms) {
            (Some(0), Some(since)) => now_unix_ms.saturating_sub(since),
            (Some(n), _) if n > 0 => return not_yet(format!("draining, {n} in flight")),
            _ => return not_yet("draining, waiting for a sample with nothing in flight".into()),
        };
        let secs = |ms: u64| ms as f64 / 1000.0;
        if quiet < quiet_ms {
            return not_yet(format!(
                "draining, 0 in flight for {:.1} s of the {:.1} s required",
                secs(quiet),
                secs(quiet_ms)
            ));
        }
        StopVerdict {
            safe: true,
            reason: format!(
                "safe to stop: drained, acknowledged by the aggregator, 0 in flight for {:.1} s",
                secs(quiet)
            ),
        }
    }

    /// The weight if it is younger than `max_age_ms`: an old weight says nothing about
    /// the fleet now.
    pub(crate) fn fresh_weight(&self, now_unix_ms: u64, max_age_ms: u64) -> Option<f64> {
        match (self.weight, self.weight_unix_ms) {
            (Some(w), Some(at)) if now_unix_ms.saturating_sub(at) <= max_age_ms => Some(w),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_is_warned_about_from_30_days_before_it_expires() {
        let day = 86_400_000;
        let now = 1_000 * day;
        let at = |expires: u64| Status {
            certificate_expires_unix_ms: Some(expires),
            ..Status::default()
        };
        assert_eq!(Status::default().certificate_warning(now), None);
        assert_eq!(at(now + 31 * day).certificate_warning(now), None);
        let w = at(now + 29 * day).certificate_warning(now).expect("warned");
        assert!(w.contains("29.0 days"), "{w}");
        let w = at(now - 1).certificate_warning(now).expect("expired");
        assert!(w.contains("has expired"), "{w}");
    }

    fn drained(now: u64) -> Status {
        Status {
            draining: true,
            drain_acknowledged: true,
            last_inflight: Some(0),
            last_report_unix_ms: Some(now - 100),
            inflight_zero_since_unix_ms: Some(now - 6000),
            ..Status::default()
        }
    }

    #[test]
    fn safe_to_stop_needs_drain_acknowledgement_fresh_sample_and_quiet() {
        let now = 1_000_000;
        let v = drained(now).stop_verdict(now, 5000, 1500);
        assert!(v.safe, "{v:?}");
        assert_eq!(
            v.reason,
            "safe to stop: drained, acknowledged by the aggregator, 0 in flight for 6.0 s"
        );
        let cases: [(Status, &str); 6] = [
            (
                Status {
                    draining: false,
                    ..drained(now)
                },
                "serving",
            ),
            (
                Status {
                    drain_acknowledged: false,
                    ..drained(now)
                },
                "acknowledge",
            ),
            (
                Status {
                    last_report_unix_ms: Some(now - 5000),
                    ..drained(now)
                },
                "no recent sample",
            ),
            (
                Status {
                    last_inflight: Some(3),
                    ..drained(now)
                },
                "3 in flight",
            ),
            (
                Status {
                    inflight_zero_since_unix_ms: None,
                    ..drained(now)
                },
                "waiting for a sample",
            ),
            (
                Status {
                    inflight_zero_since_unix_ms: Some(now - 1200),
                    ..drained(now)
                },
                "0 in flight for 1.2 s of the 5.0 s required",
            ),
        ];
        for (status, why) in cases {
            let v = status.stop_verdict(now, 5000, 1500);
            assert!(!v.safe, "{v:?}");
            assert!(v.reason.contains(why), "{:?} lacks {why:?}", v.reason);
        }
    }
}
