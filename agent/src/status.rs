//! What the running agent knows about itself, for `ballast-agent status` and the
//! HAProxy agent-check.

use ballast_shared::session::Assignment;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// The agent's view of its link and its weight.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Node identity.
    pub node: String,
    /// Service.
    pub service: String,
    /// The endpoint address this node advertises.
    #[serde(default)]
    pub address: String,
    /// Where that address came from, e.g. "route to agg.example:7400" or "--address".
    #[serde(default)]
    pub address_origin: String,
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
    /// against the fleet), from its last reply. Like the weight, its cycle, the drain
    /// acknowledgment and the in-flight trust, it is shown from the assignment, which
    /// the agent keeps in one place ([`crate::shared::Shared::assignment`]) and
    /// [`Status::show_assignment`] writes into a copy of the status.
    #[serde(default)]
    pub aggregator_load: Option<f64>,
    /// Whether the aggregator trusts this node's in-flight count, from its last reply.
    #[serde(default)]
    pub inflight_trusted: Option<bool>,
    /// Milliseconds since the Unix epoch of the last report, for display; decisions
    /// use [`Status::last_report_at`].
    pub last_report_unix_ms: Option<u64>,
    /// When the last report's sample was taken, on the monotonic clock. Not serialized:
    /// an `Instant` means nothing outside this process.
    #[serde(skip)]
    pub last_report_at: Option<Instant>,
    /// The weight last received, mean 1.0.
    pub weight: Option<f64>,
    /// The cycle it came from.
    pub weight_cycle: Option<u64>,
    /// Milliseconds since the Unix epoch when it arrived, for display; its freshness
    /// is judged by [`Status::weight_at`].
    pub weight_unix_ms: Option<u64>,
    /// When the weight arrived, on the monotonic clock, which a change of the wall
    /// clock does not move. Not serialized.
    #[serde(skip)]
    pub weight_at: Option<Instant>,
    /// This node asked to drain.
    pub draining: bool,
    /// The aggregator has it as draining.
    pub drain_acknowledged: bool,
    /// Since when (milliseconds since the Unix epoch) every sample has counted 0 in
    /// flight; reset by a drain, so that the quiet period starts after it. For
    /// display; the quiet period is timed by [`Status::inflight_zero_since`].
    pub inflight_zero_since_unix_ms: Option<u64>,
    /// The same moment on the monotonic clock. Not serialized.
    #[serde(skip)]
    pub inflight_zero_since: Option<Instant>,
    /// Sessions established with an aggregator since the agent started. A move to a
    /// connection made with a renewed certificate is not one: see
    /// [`Status::certificate_moves`].
    pub connections: u64,
    /// Moves to a new connection made with a renewed certificate, each opened and
    /// welcomed before the old one was closed.
    #[serde(default)]
    pub certificate_moves: u64,
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
    /// `invalid_hello`), what became of the certificate (`revoked`, `expired`,
    /// `certificate_refused`), or `no_common_protocol` (no protocol version shared).
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
    /// (every feed publishes weight 0), the last sample is at most `max_sample_age`
    /// old, and every sample since the drain for at least `quiet` counted nothing in
    /// flight: load balancers that poll within `quiet` have seen the drain, and the
    /// work they sent before it is done.
    ///
    /// Every age is measured on the monotonic clock (`now` and the status's
    /// `Instant`s), never from the `*_unix_ms` fields: a wall clock that jumps
    /// forward must not make stopping look safe.
    pub(crate) fn stop_verdict(
        &self,
        now: Instant,
        quiet: Duration,
        max_sample_age: Duration,
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
            .last_report_at
            .map(|at| now.saturating_duration_since(at));
        if sample_age.is_none_or(|age| age > max_sample_age) {
            return not_yet("draining, but no recent sample of the work in flight".into());
        }
        let quiet_for = match (self.last_inflight, self.inflight_zero_since) {
            (Some(0), Some(since)) => now.saturating_duration_since(since),
            (Some(n), _) if n > 0 => return not_yet(format!("draining, {n} in flight")),
            _ => return not_yet("draining, waiting for a sample with nothing in flight".into()),
        };
        if quiet_for < quiet {
            return not_yet(format!(
                "draining, 0 in flight for {:.1} s of the {:.1} s required",
                quiet_for.as_secs_f64(),
                quiet.as_secs_f64()
            ));
        }
        StopVerdict {
            safe: true,
            reason: format!(
                "safe to stop: drained, acknowledged by the aggregator, 0 in flight for {:.1} s",
                quiet_for.as_secs_f64()
            ),
        }
    }

    /// The weight if it is younger than `max_age` at `now`, on the monotonic clock: an
    /// old weight says nothing about the fleet now, and a wall clock set back must not
    /// make it look young.
    pub(crate) fn fresh_weight(&self, now: Instant, max_age: Duration) -> Option<f64> {
        match (self.weight, self.weight_at) {
            (Some(w), Some(at)) if now.saturating_duration_since(at) <= max_age => Some(w),
            _ => None,
        }
    }

    /// Shows `assignment` (the aggregator's last, if any) in this copy of the status.
    pub(crate) fn show_assignment(&mut self, assignment: Option<&Assignment>) {
        self.weight = assignment.map(|a| a.weight);
        self.weight_cycle = assignment.map(|a| a.cycle);
        self.drain_acknowledged = assignment.is_some_and(|a| a.draining);
        self.aggregator_load = assignment.map(|a| a.load);
        self.inflight_trusted = assignment.map(|a| a.inflight_trusted);
    }

    /// How long ago the weight arrived, at `now`, on the monotonic clock.
    pub(crate) fn weight_age(&self, now: Instant) -> Option<Duration> {
        self.weight_at.map(|at| now.saturating_duration_since(at))
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

    const QUIET: Duration = Duration::from_millis(5000);
    const MAX_SAMPLE_AGE: Duration = Duration::from_millis(1500);

    /// `now` minus `ms` milliseconds on the monotonic clock.
    fn ago(now: Instant, ms: u64) -> Instant {
        now.checked_sub(Duration::from_millis(ms))
            .expect("the monotonic clock started long enough ago")
    }

    /// Drained, acknowledged, sampled 100 ms ago and quiet for 6 s, on both clocks.
    fn drained(now: Instant, now_ms: u64) -> Status {
        Status {
            draining: true,
            drain_acknowledged: true,
            last_inflight: Some(0),
            last_report_unix_ms: Some(now_ms - 100),
            last_report_at: Some(ago(now, 100)),
            inflight_zero_since_unix_ms: Some(now_ms - 6000),
            inflight_zero_since: Some(ago(now, 6000)),
            ..Status::default()
        }
    }

    #[test]
    fn safe_to_stop_needs_drain_acknowledgement_fresh_sample_and_quiet() {
        let now = Instant::now();
        let now_ms = 1_000_000;
        let v = drained(now, now_ms).stop_verdict(now, QUIET, MAX_SAMPLE_AGE);
        assert!(v.safe, "{v:?}");
        assert_eq!(
            v.reason,
            "safe to stop: drained, acknowledged by the aggregator, 0 in flight for 6.0 s"
        );
        let base = drained(now, now_ms);
        let cases: [(Status, &str); 6] = [
            (
                Status {
                    draining: false,
                    ..base.clone()
                },
                "serving",
            ),
            (
                Status {
                    drain_acknowledged: false,
                    ..base.clone()
                },
                "acknowledge",
            ),
            (
                Status {
                    last_report_at: Some(ago(now, 5000)),
                    ..base.clone()
                },
                "no recent sample",
            ),
            (
                Status {
                    last_inflight: Some(3),
                    ..base.clone()
                },
                "3 in flight",
            ),
            (
                Status {
                    inflight_zero_since: None,
                    ..base.clone()
                },
                "waiting for a sample",
            ),
            (
                Status {
                    inflight_zero_since: Some(ago(now, 1200)),
                    ..base.clone()
                },
                "0 in flight for 1.2 s of the 5.0 s required",
            ),
        ];
        for (status, why) in cases {
            let v = status.stop_verdict(now, QUIET, MAX_SAMPLE_AGE);
            assert!(!v.safe, "{v:?}");
            assert!(v.reason.contains(why), "{:?} lacks {why:?}", v.reason);
        }
    }

    /// The wall clock jumps (NTP stepping it, an operator setting it): the `*_unix_ms`
    /// fields then say anything, far in the past or in the future. No verdict moves.
    #[test]
    fn a_wall_clock_jump_changes_no_verdict() {
        let now = Instant::now();
        let wall = ballast_shared::unix_ms();
        let hour = 3_600_000;
        let jumps = [0, wall - hour, wall + hour, u64::MAX];

        // Quiet for 1.2 s only: a clock stepped an hour forward since the drain would
        // make the quiet period look an hour long. Still not safe.
        for jump in jumps {
            let s = Status {
                inflight_zero_since: Some(ago(now, 1200)),
                inflight_zero_since_unix_ms: Some(jump),
                last_report_unix_ms: Some(jump),
                ..drained(now, wall)
            };
            let v = s.stop_verdict(now, QUIET, MAX_SAMPLE_AGE);
            assert!(!v.safe, "unix stamps {jump}: {v:?}");
            assert!(v.reason.contains("1.2 s of the 5.0 s"), "{v:?}");
        }
        // Quiet for 6 s with a sample 100 ms ago: safe whatever the wall clock says.
        for jump in jumps {
            let s = Status {
                inflight_zero_since_unix_ms: Some(jump),
                last_report_unix_ms: Some(jump),
                ..drained(now, wall)
            };
            assert!(s.stop_verdict(now, QUIET, MAX_SAMPLE_AGE).safe, "{jump}");
        }
        // A sample 5 s old is too old, even if its wall-clock stamp says now.
        let s = Status {
            last_report_at: Some(ago(now, 5000)),
            last_report_unix_ms: Some(wall),
            ..drained(now, wall)
        };
        assert!(!s.stop_verdict(now, QUIET, MAX_SAMPLE_AGE).safe);

        // A weight 10 s old is stale however young its wall-clock stamp looks (a clock
        // set back); one 100 ms old is fresh however old its stamp looks.
        let max_age = Duration::from_millis(2500);
        for jump in jumps {
            let stale = Status {
                weight: Some(1.5),
                weight_at: Some(ago(now, 10_000)),
                weight_unix_ms: Some(jump),
                ..Status::default()
            };
            assert_eq!(stale.fresh_weight(now, max_age), None, "{jump}");
            let fresh = Status {
                weight_at: Some(ago(now, 100)),
                ..stale
            };
            assert_eq!(fresh.fresh_weight(now, max_age), Some(1.5), "{jump}");
            assert_eq!(fresh.weight_age(now), Some(Duration::from_millis(100)));
        }
        assert_eq!(Status::default().fresh_weight(now, max_age), None);
    }
}
