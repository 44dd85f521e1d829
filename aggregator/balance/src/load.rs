//! Load arithmetic and the integer weight ranges of each load-balancer sink.
//!
//! A single place so that the agent, the aggregator, the simulator and every feed turn
//! the same numbers into the same integers.

/// Loads are clamped to this. A value above it is a broken sampler, not a busy node,
/// and one absurd report must not drag the fleet average.
pub const MAX_LOAD: f64 = 100.0;

/// Replaces NaN and negative values with 0 and clamps to [`MAX_LOAD`].
pub fn sanitize(x: f64) -> f64 {
    if x.is_nan() || x <= 0.0 {
        0.0
    } else {
        x.min(MAX_LOAD)
    }
}

/// In-flight requests as a fraction of capacity. A capacity of 0 means the agent does
/// not measure in-flight requests, so they do not count.
pub(crate) fn inflight_utilization(inflight: u32, capacity: u32) -> f64 {
    if capacity == 0 {
        0.0
    } else {
        sanitize(f64::from(inflight) / f64::from(capacity))
    }
}

/// The node's load: `max(cpu, inflight / capacity)`, plus `error_rate × penalty`.
///
/// The max is Robinhood's fix for the dead spiral: a node stuck on slow I/O has low
/// CPU but piles up in-flight requests. The error term is gRPC A58's fix for the
/// broken cashier: a node that fails fast looks idle on both other signals.
pub fn combine(
    cpu: f64,
    inflight: u32,
    capacity: u32,
    error_rate: Option<f64>,
    penalty: f64,
) -> f64 {
    let base = sanitize(cpu).max(inflight_utilization(inflight, capacity));
    let errors = error_rate.map(sanitize).unwrap_or(0.0).min(1.0);
    sanitize(base + errors * sanitize(penalty))
}

/// Envoy and gRPC weights per unit of mean weight: weight 1.0 (the mean) becomes 1000,
/// so that the 0.01 floor still has ten steps of resolution.
pub(crate) const ENVOY_SCALE: f64 = 1000.0;

/// An xDS `load_balancing_weight`: a uint32 of at least 1. Draining endpoints are
/// marked DRAINING by health status instead, since xDS forbids 0.
pub fn envoy_weight(weight: f64) -> u32 {
    let w = (sanitize(weight) * ENVOY_SCALE).round();
    (w as u32).max(1)
}

/// HAProxy agent-check percentage: 100 means the mean weight. HAProxy applies it to
/// the server's configured weight and caps the result at 256, so with the usual
/// configured weight of 100 anything above 256 % is flattened.
pub fn haproxy_percent(weight: f64) -> u32 {
    let p = (sanitize(weight) * 100.0).round();
    (p as u32).max(1)
}

/// The agent-check reply line for a weight, or for a drain.
pub fn haproxy_agent_reply(weight: Option<f64>, draining: bool) -> String {
    match (draining, weight) {
        (true, _) => "drain\n".to_string(),
        (false, Some(w)) => format!("ready up {}%\n", haproxy_percent(w)),
        (false, None) => "ready up 100%\n".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_is_the_max_of_cpu_and_inflight() {
        assert_eq!(combine(0.2, 8, 10, None, 1.0), 0.8);
        assert_eq!(combine(0.9, 1, 10, None, 1.0), 0.9);
        assert_eq!(combine(0.9, 5, 0, None, 1.0), 0.9);
    }

    #[test]
    fn errors_raise_load() {
        assert!((combine(0.1, 0, 0, Some(0.5), 1.0) - 0.6).abs() < 1e-9);
    }

    #[test]
    fn garbage_never_becomes_nan_or_infinite() {
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -3.0] {
            let l = combine(x, u32::MAX, 1, Some(x), x);
            assert!(l.is_finite() && (0.0..=MAX_LOAD).contains(&l));
        }
    }

    #[test]
    fn sink_ranges() {
        assert_eq!(envoy_weight(1.0), 1000);
        assert_eq!(envoy_weight(0.0), 1);
        assert_eq!(envoy_weight(f64::NAN), 1);
        assert_eq!(haproxy_percent(1.7), 170);
        assert_eq!(haproxy_percent(0.001), 1);
        assert_eq!(haproxy_agent_reply(Some(0.75), false), "ready up 75%\n");
        assert_eq!(haproxy_agent_reply(Some(0.75), true), "drain\n");
    }
}
