//! The per-endpoint PID controller in velocity form.
//!
//! Its output is the change of the endpoint's weight, not the weight itself, so the
//! proportional term already acts like integral action on the weight: an endpoint
//! above the average keeps losing weight until it is at the average. The integral
//! term only removes a residual bias, such as a node whose load does not scale
//! linearly with its traffic.

use super::params::PidGains;

/// One controller's memory.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Pid {
    /// Accumulated error, within ±`integral_limit`.
    pub integral: f64,
    /// The previous error, for the derivative; `None` before the first update.
    pub last_error: Option<f64>,
    /// The filtered derivative.
    pub derivative: f64,
}

impl Pid {
    /// Advances the controller by `dt` cycles with `error` (positive means the endpoint
    /// is below the average and should get more), and returns the relative change of
    /// weight. `limits` is the (lowest, highest) change the caller will apply; while
    /// the output is pinned to one of them the integral does not grow further in that
    /// direction (conditional integration, the anti-windup).
    pub fn update(&mut self, gains: &PidGains, error: f64, dt: f64, limits: (f64, f64)) -> f64 {
        let error = if error.is_finite() { error } else { 0.0 };
        let dt = if dt.is_finite() {
            dt.clamp(0.1, 10.0)
        } else {
            1.0
        };
        let raw_derivative = match self.last_error {
            Some(prev) => (error - prev) / dt,
            None => 0.0,
        };
        let a = gains.derivative_filter;
        self.derivative = a * self.derivative + (1.0 - a) * raw_derivative;
        self.last_error = Some(error);

        let candidate =
            (self.integral + error * dt).clamp(-gains.integral_limit, gains.integral_limit);
        let output =
            |integral: f64| gains.kp * error + gains.ki * integral + gains.kd * self.derivative;
        let unclamped = output(candidate);
        let (lo, hi) = limits;
        let winding_up = (unclamped > hi && error > 0.0) || (unclamped < lo && error < 0.0);
        if !winding_up {
            self.integral = candidate;
        }
        let out = output(self.integral).clamp(lo, hi);
        if out.is_finite() {
            out
        } else {
            0.0
        }
    }

    /// Forgets everything, as for an endpoint that restarts its ramp.
    pub fn reset(&mut self) {
        *self = Pid::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_response_has_the_error_sign() {
        let g = PidGains {
            ki: 0.0,
            kd: 0.0,
            ..PidGains::default()
        };
        let mut pid = Pid::default();
        assert!(pid.update(&g, 0.2, 1.0, (-0.5, 0.5)) > 0.0);
        assert!(pid.update(&g, -0.2, 1.0, (-0.5, 0.5)) < 0.0);
    }

    #[test]
    fn integral_does_not_wind_up_while_saturated() {
        let g = PidGains {
            kp: 1.0,
            ki: 0.5,
            kd: 0.0,
            integral_limit: 100.0,
            ..PidGains::default()
        };
        let mut pid = Pid::default();
        for _ in 0..100 {
            assert_eq!(pid.update(&g, 0.9, 1.0, (-0.5, 0.5)), 0.5);
        }
        assert!(pid.integral < 1.0, "integral wound up to {}", pid.integral);
        // Once the error flips, the output follows at once instead of unwinding.
        assert!(pid.update(&g, -0.1, 1.0, (-0.5, 0.5)) < 0.0);
    }

    #[test]
    fn integral_is_bounded() {
        let g = PidGains {
            kp: 0.0,
            ki: 0.01,
            kd: 0.0,
            integral_limit: 0.3,
            ..PidGains::default()
        };
        let mut pid = Pid::default();
        for _ in 0..1000 {
            pid.update(&g, 1.0, 1.0, (-1.0, 1.0));
        }
        assert!((pid.integral - 0.3).abs() < 1e-12);
    }

    #[test]
    fn derivative_is_filtered() {
        let g = PidGains {
            kp: 0.0,
            ki: 0.0,
            kd: 1.0,
            derivative_filter: 0.5,
            ..PidGains::default()
        };
        let mut pid = Pid::default();
        pid.update(&g, 0.0, 1.0, (-10.0, 10.0));
        // A step of 1 in the error shows half of its derivative at once.
        assert!((pid.update(&g, 1.0, 1.0, (-10.0, 10.0)) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn garbage_in_gives_zero_out() {
        // A NaN error counts as no error, an infinite dt as one cycle: nothing moves,
        // and the memory stays clean for the next real error.
        let mut pid = Pid::default();
        let out = pid.update(&PidGains::default(), f64::NAN, f64::INFINITY, (-0.5, 0.5));
        assert_eq!(out, 0.0);
        assert_eq!(pid.integral, 0.0);
        assert_eq!(pid.last_error, Some(0.0));
        let out = pid.update(
            &PidGains::default(),
            f64::NEG_INFINITY,
            f64::NAN,
            (-0.5, 0.5),
        );
        assert_eq!(out, 0.0);
        // After the garbage, a real error gets the same answer as from a fresh start.
        let g = PidGains::default();
        let after = pid.update(&g, 0.2, 1.0, (-0.5, 0.5));
        let mut fresh = Pid::default();
        fresh.update(&g, 0.0, 1.0, (-0.5, 0.5));
        assert_eq!(after, fresh.update(&g, 0.2, 1.0, (-0.5, 0.5)));
    }
}
