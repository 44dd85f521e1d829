//! The strategy mixture: during a migration several strategies run side by side and the
//! published weight is their gated sum, so that every client sees the same number.

use super::params::{Gate, Strategy};

/// The effective weight from each strategy's weight for one endpoint: the gate-weighted
/// mean. With PID gated at 0.3 and round robin at 0.7, weights of 100 and 200 give 170.
pub fn mix(gates: &[Gate], weight_of: impl Fn(Strategy) -> f64) -> f64 {
    let total: f64 = gates.iter().map(|g| g.gate).sum();
    if total.is_nan() || total <= 0.0 {
        return weight_of(Strategy::Pid);
    }
    gates
        .iter()
        .map(|g| g.gate * weight_of(g.strategy))
        .sum::<f64>()
        / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_example_gives_170() {
        let gates = [
            Gate {
                strategy: Strategy::Pid,
                gate: 0.3,
            },
            Gate {
                strategy: Strategy::RoundRobin,
                gate: 0.7,
            },
        ];
        let w = mix(&gates, |s| match s {
            Strategy::Pid => 100.0,
            Strategy::RoundRobin => 200.0,
        });
        assert!((w - 170.0).abs() < 1e-9);
    }

    #[test]
    fn a_single_strategy_passes_through() {
        let gates = [Gate {
            strategy: Strategy::Pid,
            gate: 1.0,
        }];
        assert_eq!(mix(&gates, |_| 1.25), 1.25);
    }
}
