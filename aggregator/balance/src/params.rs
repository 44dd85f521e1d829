//! Tunables of the balancing cycle, with the defaults chosen by the simulator.

use serde::{Deserialize, Serialize};

/// Gains of the per-endpoint PID controller. The controller's output is the relative
/// change of the endpoint's weight in one cycle, and its error is the endpoint's load
/// relative to the fleet average, so the gains are dimensionless and per cycle.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct PidGains {
    /// Proportional gain.
    pub kp: f64,
    /// Integral gain.
    pub ki: f64,
    /// Derivative gain.
    pub kd: f64,
    /// Smoothing of the derivative, 0 (none) to below 1 (heavy). Report noise would
    /// otherwise reach the weights amplified.
    pub derivative_filter: f64,
    /// The integral is held within ±this, so that a long saturation does not wind it up.
    pub integral_limit: f64,
}

impl Default for PidGains {
    fn default() -> Self {
        // Chosen by the simulator's sweep (docs/balance.md): with the one-window lag of
        // real reports, a gentler proportional gain settles faster than a stronger one
        // and stays within 5 % overshoot; the velocity form needs no integral term.
        PidGains {
            kp: 0.4,
            ki: 0.0,
            kd: 0.1,
            derivative_filter: 0.5,
            integral_limit: 1.0,
        }
    }
}

/// A way of computing weights that a service may enable, alone or gated with others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// One PID controller per endpoint, with the fleet's average load as setpoint.
    Pid,
    /// Equal weights: what the load balancer did before Ballast.
    RoundRobin,
}

impl Strategy {
    /// The name used in config files and the API.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Pid => "pid",
            Strategy::RoundRobin => "round_robin",
        }
    }
}

/// One endpoint's weight under each strategy, kept apart as the routing store keeps
/// them. A plain pair rather than a map: every cycle reads and writes it for every
/// endpoint, and a publication copies it. It serialises as the map it stands for,
/// `{"pid": .., "round_robin": ..}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StrategyWeights {
    /// The PID controller's weight.
    pub pid: f64,
    /// Round robin's weight: always 1, the mean.
    pub round_robin: f64,
}

impl StrategyWeights {
    /// `pid` for the controller, and round robin's 1.
    pub fn new(pid: f64) -> Self {
        StrategyWeights {
            pid,
            round_robin: 1.0,
        }
    }

    /// The weight under `strategy`.
    pub fn get(&self, strategy: Strategy) -> f64 {
        match strategy {
            Strategy::Pid => self.pid,
            Strategy::RoundRobin => self.round_robin,
        }
    }

    /// Sets the weight under `strategy`.
    pub fn set(&mut self, strategy: Strategy, weight: f64) {
        match strategy {
            Strategy::Pid => self.pid = weight,
            Strategy::RoundRobin => self.round_robin = weight,
        }
    }

    /// Each strategy with its weight, in the order of [`Strategy`].
    pub fn iter(&self) -> impl Iterator<Item = (Strategy, f64)> {
        [
            (Strategy::Pid, self.pid),
            (Strategy::RoundRobin, self.round_robin),
        ]
        .into_iter()
    }

    /// As the routing store keeps them: a map by strategy.
    pub fn to_map(&self) -> std::collections::BTreeMap<Strategy, f64> {
        self.iter().collect()
    }
}

/// One strategy and its gate: the share of the effective weight it contributes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Gate {
    /// The strategy.
    pub strategy: Strategy,
    /// Its share, 0 to 1. Gates need not add up to 1: they are normalised.
    pub gate: f64,
}

/// Which signal the balancer steers by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum LoadMetric {
    /// `max(cpu, in-flight)`: Robinhood's choice, immune to the dead spiral. The
    /// in-flight term is the count over the agent's capacity when one is configured,
    /// and otherwise the count per unit of weight against the service's typical value.
    #[default]
    Max,
    /// CPU utilization alone.
    Cpu,
    /// In-flight requests alone: over the capacity, or relative to the fleet.
    Inflight,
}

/// Everything that shapes a service's cycle. The defaults are the global config; a
/// service may override any of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct Params {
    /// How often the cycle runs, in milliseconds.
    pub cycle_ms: u64,
    /// A report older than this is stale and its endpoint counts as missing.
    pub stale_ms: u64,
    /// An endpoint silent for this long is forgotten.
    pub expire_ms: u64,
    /// If more than this share of known endpoints is missing (and at least two are), the
    /// cycle changes nothing.
    pub missing_threshold: f64,
    /// After a restart, no update for this long, so that reports can arrive first.
    pub grace_ms: u64,
    /// The controller's gains.
    pub pid: PidGains,
    /// A new or returning endpoint starts at this fraction of the mean weight.
    pub cold_start_weight: f64,
    /// The most an endpoint's weight may grow in one cycle, as a factor. Bounds the
    /// ramp of a cold endpoint and the reaction to a single noisy report.
    pub max_growth: f64,
    /// The most an endpoint's weight may shrink in one cycle, as a factor below 1.
    pub max_shrink: f64,
    /// Weight floor, relative to the mean weight (gRPC A58 uses 0.01 of the mean).
    pub min_weight: f64,
    /// Weight ceiling, relative to the mean weight (gRPC A58 uses 10× the mean).
    pub max_weight: f64,
    /// Below this average load the feedback is too thin to steer by: weights are held
    /// and the API says why, rather than chase noise.
    pub thin_load: f64,
    /// If the average load moves by more than this share between two cycles, the
    /// second cycle changes nothing: its reports straddle the change, some from before
    /// and some from after, and would move weights by when each node happened to report
    /// rather than by how busy it is. Cycles are skipped while the average keeps
    /// jumping, at most three in a row, so a real new level is steered by as soon as it
    /// settles. 0 turns the rule off.
    pub jump_threshold: f64,
    /// Errors raise an endpoint's load by `error_rate × error_penalty`.
    pub error_penalty: f64,
    /// The signal to balance.
    pub metric: LoadMetric,
    /// When loads are far apart at steady weights, step once to weights proportional
    /// to each endpoint's capacity estimate (its weight over its load) and let the
    /// controllers trim from there: a fleet converges in a cycle or two instead of
    /// ramping there at `max_growth` per cycle.
    pub feed_forward: bool,
    /// The strategies in force and their gates.
    pub strategies: Vec<Gate>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            cycle_ms: 1000,
            stale_ms: 3000,
            expire_ms: 10 * 60 * 1000,
            missing_threshold: 0.15,
            grace_ms: 3000,
            pid: PidGains::default(),
            cold_start_weight: 0.1,
            max_growth: 1.5,
            max_shrink: 0.5,
            min_weight: 0.01,
            max_weight: 10.0,
            thin_load: 0.02,
            jump_threshold: 0.3,
            error_penalty: 1.0,
            metric: LoadMetric::Max,
            feed_forward: true,
            strategies: vec![Gate {
                strategy: Strategy::Pid,
                gate: 1.0,
            }],
        }
    }
}

/// A parameter out of its range.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{field}: {reason}")]
pub struct ParamsError {
    /// The parameter.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl Params {
    /// Checks every range, so that a bad override is refused before it reaches a cycle.
    pub fn validate(&self) -> Result<(), ParamsError> {
        fn check(ok: bool, field: &'static str, reason: &str) -> Result<(), ParamsError> {
            if ok {
                Ok(())
            } else {
                Err(ParamsError {
                    field,
                    reason: reason.to_string(),
                })
            }
        }
        let finite = |x: f64| x.is_finite();
        check(self.cycle_ms >= 10, "cycle_ms", "must be at least 10")?;
        check(
            self.stale_ms >= self.cycle_ms,
            "stale_ms",
            "must be at least cycle_ms",
        )?;
        check(
            self.expire_ms >= self.stale_ms,
            "expire_ms",
            "must be at least stale_ms",
        )?;
        check(
            finite(self.missing_threshold) && (0.0..=1.0).contains(&self.missing_threshold),
            "missing_threshold",
            "must be between 0 and 1",
        )?;
        for (field, v) in [
            ("pid.kp", self.pid.kp),
            ("pid.ki", self.pid.ki),
            ("pid.kd", self.pid.kd),
        ] {
            check(
                finite(v) && (0.0..=10.0).contains(&v),
                field,
                "must be between 0 and 10",
            )?;
        }
        check(
            finite(self.pid.derivative_filter) && (0.0..1.0).contains(&self.pid.derivative_filter),
            "pid.derivative_filter",
            "must be in [0, 1)",
        )?;
        check(
            finite(self.pid.integral_limit) && self.pid.integral_limit >= 0.0,
            "pid.integral_limit",
            "must be 0 or more",
        )?;
        check(
            finite(self.min_weight) && self.min_weight > 0.0 && self.min_weight <= 1.0,
            "min_weight",
            "must be in (0, 1]",
        )?;
        check(
            finite(self.max_weight) && self.max_weight >= 1.0 && self.max_weight <= 1000.0,
            "max_weight",
            "must be in [1, 1000]",
        )?;
        check(
            finite(self.cold_start_weight)
                && self.cold_start_weight >= self.min_weight
                && self.cold_start_weight <= 1.0,
            "cold_start_weight",
            "must be between min_weight and 1",
        )?;
        check(
            finite(self.max_growth) && self.max_growth > 1.0 && self.max_growth <= 10.0,
            "max_growth",
            "must be in (1, 10]",
        )?;
        check(
            finite(self.max_shrink) && self.max_shrink > 0.0 && self.max_shrink < 1.0,
            "max_shrink",
            "must be in (0, 1)",
        )?;
        check(
            finite(self.thin_load) && self.thin_load >= 0.0,
            "thin_load",
            "must be 0 or more",
        )?;
        check(
            finite(self.jump_threshold) && self.jump_threshold >= 0.0,
            "jump_threshold",
            "must be 0 (off) or more",
        )?;
        check(
            finite(self.error_penalty) && self.error_penalty >= 0.0,
            "error_penalty",
            "must be 0 or more",
        )?;
        check(
            !self.strategies.is_empty(),
            "strategies",
            "at least one is needed",
        )?;
        for g in &self.strategies {
            check(
                finite(g.gate) && (0.0..=1.0).contains(&g.gate),
                "strategies.gate",
                "must be between 0 and 1",
            )?;
        }
        check(
            self.strategies.iter().map(|g| g.gate).sum::<f64>() > 0.0,
            "strategies",
            "the gates add up to 0",
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Params::default().validate(), Ok(()));
    }

    #[test]
    fn out_of_range_values_are_named() {
        let p = Params {
            missing_threshold: 1.5,
            ..Params::default()
        };
        assert_eq!(p.validate().map_err(|e| e.field), Err("missing_threshold"));
        let p = Params {
            pid: PidGains {
                kp: f64::NAN,
                ..PidGains::default()
            },
            ..Params::default()
        };
        assert_eq!(p.validate().map_err(|e| e.field), Err("pid.kp"));
    }
}
