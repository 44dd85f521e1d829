//! Seeded random streams and the few distributions the model needs.
//!
//! `rand` 0.8 without `rand_distr` has no normal or exponential distribution, and
//! one more dependency for three formulas is not worth it.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Independent streams, so that a strategy's own coin flips never shift the
/// arrival sequence: every strategy of a scenario sees the same requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Speeds, subsets, client rates, report phases.
    Fleet,
    /// Arrival times, clients and request costs.
    Arrivals,
    /// The strategy's picks and scheduler offsets.
    Picker,
    /// Measurement noise and report loss.
    Reports,
}

/// A generator for `stream` of scenario `scenario` under the run's `seed`.
pub fn stream(seed: u64, scenario: &str, stream: Stream) -> SmallRng {
    // FNV-1a over the scenario name, then a SplitMix64 finaliser, so that nearby
    // seeds and similar names still give unrelated streams.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in scenario.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let tag = match stream {
        Stream::Fleet => 1u64,
        Stream::Arrivals => 2,
        Stream::Picker => 3,
        Stream::Reports => 4,
    };
    SmallRng::seed_from_u64(mix(seed ^ mix(h ^ mix(tag))))
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An exponential variate with mean `mean`.
pub fn exponential(rng: &mut SmallRng, mean: f64) -> f64 {
    // 1 - u lies in (0, 1], so the logarithm is finite.
    let u: f64 = rng.gen();
    -(1.0 - u).ln() * mean
}

/// A standard normal variate (Box–Muller; one of the pair is thrown away, which
/// costs a little speed and keeps the generator stateless).
pub fn normal(rng: &mut SmallRng) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>();
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A log-normal variate with the given mean and shape `sigma` (the standard
/// deviation of its logarithm): heavy-tailed, as request costs are.
pub fn lognormal(rng: &mut SmallRng, mean: f64, sigma: f64) -> f64 {
    let mu = mean.ln() - sigma * sigma / 2.0;
    (mu + sigma * normal(rng)).exp()
}

/// Standard normal variates two at a time (Box–Muller keeping both), for the
/// request-cost stream where every nanosecond counts.
#[derive(Debug, Clone, Default)]
pub struct Normals {
    spare: Option<f64>,
}

impl Normals {
    /// The next standard normal variate.
    pub fn next(&mut self, rng: &mut SmallRng) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1: f64 = 1.0 - rng.gen::<f64>();
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }
}

/// Walker's alias table: draws an index with probability proportional to its
/// weight in constant time.
#[derive(Debug, Clone, Default)]
pub struct Alias {
    prob: Vec<f64>,
    alias: Vec<u32>,
}

impl Alias {
    /// A table for `weights` (negative or non-finite weights count as 0).
    pub fn new(weights: &[f64]) -> Self {
        let n = weights.len();
        let clean = |w: f64| if w.is_finite() && w > 0.0 { w } else { 0.0 };
        let sum: f64 = weights.iter().map(|w| clean(*w)).sum();
        if n == 0 || sum <= 0.0 {
            return Alias {
                prob: vec![1.0; n],
                alias: (0..n as u32).collect(),
            };
        }
        let mut scaled: Vec<f64> = weights.iter().map(|w| clean(*w) * n as f64 / sum).collect();
        let mut prob = vec![1.0; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| scaled[i] < 1.0);
        while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
            prob[s] = scaled[s];
            alias[s] = l as u32;
            scaled[l] -= 1.0 - scaled[s];
            if scaled[l] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        // Leftovers are 1 up to rounding.
        Alias { prob, alias }
    }

    /// Draws an index.
    pub fn sample(&self, rng: &mut SmallRng) -> usize {
        let n = self.prob.len();
        if n == 0 {
            return 0;
        }
        let u = rng.gen::<f64>() * n as f64;
        let i = (u as usize).min(n - 1);
        if u - (i as f64) < self.prob[i] {
            i
        } else {
            self.alias[i] as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: u64 = stream(7, "steady", Stream::Arrivals).gen();
        let b: u64 = stream(7, "steady", Stream::Arrivals).gen();
        let c: u64 = stream(7, "steady", Stream::Picker).gen();
        let d: u64 = stream(8, "steady", Stream::Arrivals).gen();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
    }

    #[test]
    fn alias_draws_in_proportion() {
        let table = Alias::new(&[1.0, 3.0, 0.0, 4.0]);
        let mut rng = stream(3, "alias", Stream::Arrivals);
        let mut counts = [0u32; 4];
        for _ in 0..80_000 {
            counts[table.sample(&mut rng)] += 1;
        }
        assert_eq!(counts[2], 0);
        for (i, want) in [(0, 10_000.0), (1, 30_000.0), (3, 40_000.0)] {
            let got = f64::from(counts[i]);
            assert!((got - want).abs() < want * 0.05, "{i}: {got}");
        }
    }

    #[test]
    fn paired_normals_are_standard() {
        let mut rng = stream(5, "n", Stream::Arrivals);
        let mut n = Normals::default();
        let xs: Vec<f64> = (0..100_000).map(|_| n.next(&mut rng)).collect();
        let m = xs.iter().sum::<f64>() / xs.len() as f64;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64;
        assert!(m.abs() < 0.02 && (v - 1.0).abs() < 0.03, "mean {m} var {v}");
    }

    #[test]
    fn lognormal_has_the_requested_mean() {
        let mut rng = stream(1, "x", Stream::Arrivals);
        let n = 200_000;
        let m = (0..n).map(|_| lognormal(&mut rng, 10.0, 1.0)).sum::<f64>() / n as f64;
        assert!((m - 10.0).abs() < 0.3, "mean {m}");
    }
}
