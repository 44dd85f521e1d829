//! Normalisation of weights within bounds.

/// Scales `weights` so that they add up to `target`, with each held within
/// `[lo, hi]`. Scaling alone can push a weight past a bound, and clamping alone breaks
/// the sum, so weights that hit a bound are pinned there and the rest are scaled again
/// (water-filling). When no assignment can satisfy both, the bounds win.
pub(crate) fn normalize_bounded(weights: &mut [f64], target: f64, lo: f64, hi: f64) {
    let n = weights.len();
    if n == 0 {
        return;
    }
    for w in weights.iter_mut() {
        if !w.is_finite() || *w < 0.0 {
            *w = 0.0;
        }
    }
    let mut pinned = vec![false; n];
    for _ in 0..=n {
        let pinned_sum: f64 = (0..n).filter(|&i| pinned[i]).map(|i| weights[i]).sum();
        let free: Vec<usize> = (0..n).filter(|&i| !pinned[i]).collect();
        if free.is_empty() {
            break;
        }
        let free_sum: f64 = free.iter().map(|&i| weights[i]).sum();
        let remaining = (target - pinned_sum).max(0.0);
        if free_sum > 0.0 {
            let scale = remaining / free_sum;
            for &i in &free {
                weights[i] *= scale;
            }
        } else {
            let each = remaining / free.len() as f64;
            for &i in &free {
                weights[i] = each;
            }
        }
        let mut changed = false;
        for &i in &free {
            if weights[i] < lo {
                weights[i] = lo;
                pinned[i] = true;
                changed = true;
            } else if weights[i] > hi {
                weights[i] = hi;
                pinned[i] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    for w in weights.iter_mut() {
        *w = w.clamp(lo, hi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scales_to_the_target() {
        let mut w = [1.0, 2.0, 3.0];
        normalize_bounded(&mut w, 3.0, 0.01, 10.0);
        assert!((w.iter().sum::<f64>() - 3.0).abs() < 1e-9);
        assert!((w[2] / w[0] - 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_pinned_weight_leaves_the_rest_scaled() {
        let mut w = [100.0, 1.0, 1.0, 1.0];
        normalize_bounded(&mut w, 4.0, 0.01, 2.0);
        assert_eq!(w[0], 2.0);
        assert!((w.iter().sum::<f64>() - 4.0).abs() < 1e-9);
    }

    #[test]
    fn zeros_become_equal_shares() {
        let mut w = [0.0, f64::NAN, -1.0];
        normalize_bounded(&mut w, 3.0, 0.01, 10.0);
        assert_eq!(w, [1.0, 1.0, 1.0]);
    }

    proptest! {
        #[test]
        fn feasible_targets_are_met_within_bounds(
            mut w in proptest::collection::vec(0.0f64..1000.0, 1..50),
        ) {
            let n = w.len() as f64;
            normalize_bounded(&mut w, n, 0.01, 10.0);
            for x in &w {
                prop_assert!(x.is_finite() && *x >= 0.01 && *x <= 10.0);
            }
            prop_assert!((w.iter().sum::<f64>() - n).abs() < 1e-6 * n);
        }
    }
}
