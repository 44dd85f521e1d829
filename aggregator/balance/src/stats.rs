//! Balance statistics of one cycle: how far the hottest endpoints are from the average.

use serde::{Deserialize, Serialize};

/// The nearest-rank quantile `q` (0 to 1) of `sorted`, which must be sorted ascending.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Load spread over the fresh, serving endpoints of a service.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Spread {
    /// Mean load.
    pub avg: f64,
    /// Highest load.
    pub max: f64,
    /// `max / avg`: what the fleet must be sized for, relative to what it uses.
    pub max_over_avg: f64,
    /// 95th percentile over the average.
    pub p95_over_avg: f64,
    /// 5th percentile over the average.
    pub p5_over_avg: f64,
}

impl Spread {
    /// The spread of `loads`. Ratios are 1 when the average is 0, so that an idle fleet
    /// reads as balanced rather than as NaN.
    pub fn of(loads: &[f64]) -> Spread {
        if loads.is_empty() {
            return Spread::default();
        }
        let mut sorted: Vec<f64> = loads.iter().map(|&l| crate::load::sanitize(l)).collect();
        // Unstable is as good as stable here and needs no buffer: values equal under
        // `total_cmp` are the same bits, so either order gives the same array (and
        // the same sum below).
        sorted.sort_unstable_by(f64::total_cmp);
        let avg = sorted.iter().sum::<f64>() / sorted.len() as f64;
        let max = sorted[sorted.len() - 1];
        let ratio = |x: f64| if avg > 0.0 { x / avg } else { 1.0 };
        Spread {
            avg,
            max,
            max_over_avg: ratio(max),
            p95_over_avg: ratio(quantile(&sorted, 0.95)),
            p5_over_avg: ratio(quantile(&sorted, 0.05)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.95), 95.0);
        assert_eq!(quantile(&v, 0.05), 5.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn spread_of_idle_fleet_is_one() {
        let s = Spread::of(&[0.0, 0.0]);
        assert_eq!(s.max_over_avg, 1.0);
        let s = Spread::of(&[0.5, 1.0, 1.5]);
        assert!((s.max_over_avg - 1.5).abs() < 1e-12);
    }
}
