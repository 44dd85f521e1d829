//! A closed-loop load model, for demos and tests without a real service.
//!
//! A node of relative speed `s` receiving a share `w` of the traffic (weights normalised
//! to mean 1) at an offered per-node utilization `L` runs at `L·w/s`. The weight comes
//! back from the aggregator through the assignment watch the report loop publishes
//! ([`AssignmentWatch`]), so the loop the balancer controls is closed: a slow node that
//! is given less weight reports less load. Speed and offered load are knobs on a
//! [`SyntheticHandle`], for tests that change them mid-run.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use ballast_balance::load::{self, MAX_LOAD};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{AssignmentWatch, InflightSource, SampleError};

/// Capacity assumed until [`InflightSource::set_capacity`] says otherwise: 100 gives
/// the in-flight count percent resolution.
const DEFAULT_CAPACITY: u32 = 100;

#[derive(Debug)]
struct Knobs {
    speed: AtomicU32,
    offered: AtomicU32,
}

/// The model's knobs, shared between whoever turns them (a test, the demo) and the
/// in-flight source (which reads them). Cloning shares.
///
/// Values are `f32` bits in atomics: lock-free, and the model needs no more precision.
#[derive(Debug, Clone)]
pub struct SyntheticHandle {
    knobs: Arc<Knobs>,
}

fn store(cell: &AtomicU32, x: f64) {
    cell.store((x as f32).to_bits(), Ordering::Relaxed);
}

fn load_f64(cell: &AtomicU32) -> f64 {
    f64::from(f32::from_bits(cell.load(Ordering::Relaxed)))
}

impl SyntheticHandle {
    /// Speed 1, offered 0.6.
    pub fn new() -> Self {
        let h = SyntheticHandle {
            knobs: Arc::new(Knobs {
                speed: AtomicU32::new(0),
                offered: AtomicU32::new(0),
            }),
        };
        h.set_speed(1.0);
        h.set_offered(0.6);
        h
    }

    /// Sets this node's relative speed, so a test can make it slow mid-run.
    pub(crate) fn set_speed(&self, speed: f64) {
        store(&self.knobs.speed, speed);
    }

    /// This node's current relative speed.
    pub fn speed(&self) -> f64 {
        load_f64(&self.knobs.speed)
    }

    /// Sets the mean per-node utilization at equal weights, so a test can raise traffic.
    pub(crate) fn set_offered(&self, offered: f64) {
        store(&self.knobs.offered, offered);
    }

    /// The current offered utilization.
    pub fn offered(&self) -> f64 {
        load_f64(&self.knobs.offered)
    }
}

impl Default for SyntheticHandle {
    fn default() -> Self {
        Self::new()
    }
}

/// The model: `L·w/s × (1 + noise·u)` for `u` in [-1, 1], in `[0, MAX_LOAD]`.
///
/// Total on every input, because the weight comes from the network and the knobs from
/// tests: a NaN or negative weight, offered load or noise counts as 0, and a speed that
/// is not positive is an infinitely slow node, i.e. [`MAX_LOAD`] whenever it has work.
pub(crate) fn model_utilization(weight: f64, speed: f64, offered: f64, noise: f64, u: f64) -> f64 {
    let nonneg = |x: f64| if x.is_nan() || x < 0.0 { 0.0 } else { x };
    let work = nonneg(offered) * nonneg(weight);
    let base = if speed.is_finite() && speed > 0.0 {
        work / speed
    } else if work > 0.0 {
        MAX_LOAD
    } else {
        0.0
    };
    let jitter = (1.0 + nonneg(noise) * u.clamp(-1.0, 1.0)).max(0.0);
    load::sanitize(base.min(MAX_LOAD) * jitter)
}

/// The model as an in-flight source: `round(utilization × capacity)` requests.
#[derive(Debug)]
pub(crate) struct SyntheticInflight {
    handle: SyntheticHandle,
    assignment: AssignmentWatch,
    noise: f64,
    seed: u64,
    rng: SmallRng,
    capacity: u32,
}

impl SyntheticInflight {
    /// A model reading its speed and offered load from `handle` and its weight from
    /// `assignment`, with noise of relative amplitude `noise` drawn from a generator
    /// seeded with `seed`.
    pub(crate) fn new(
        handle: SyntheticHandle,
        assignment: AssignmentWatch,
        noise: f64,
        seed: u64,
    ) -> Self {
        SyntheticInflight {
            handle,
            assignment,
            noise,
            seed,
            rng: SmallRng::seed_from_u64(seed),
            capacity: DEFAULT_CAPACITY,
        }
    }

    /// The node's current weight: the aggregator's latest, or 1 (the fleet mean)
    /// before the first reply, which is what a new node's share of round robin is.
    pub(crate) fn weight(&self) -> f64 {
        self.assignment.borrow().map_or(1.0, |a| a.weight)
    }

    /// Draws the next utilization.
    pub(crate) fn utilization(&mut self) -> f64 {
        let u = self.rng.gen_range(-1.0..=1.0);
        model_utilization(
            self.weight(),
            self.handle.speed(),
            self.handle.offered(),
            self.noise,
            u,
        )
    }
}

impl InflightSource for SyntheticInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        // `as` saturates; the utilization is already finite and at most MAX_LOAD.
        Ok((self.utilization() * f64::from(self.capacity)).round() as u32)
    }

    fn describe(&self) -> String {
        format!(
            "synthetic speed={} offered={} noise={} seed={} (weight {})",
            self.handle.speed(),
            self.handle.offered(),
            self.noise,
            self.seed,
            self.weight()
        )
    }

    /// A configured capacity replaces the model's; none (0) keeps it.
    fn set_capacity(&mut self, capacity: u32) {
        if capacity > 0 {
            self.capacity = capacity;
        }
    }

    /// The model expresses utilization as a count against its own capacity, so that
    /// is the capacity its count means even when none is configured.
    fn own_capacity(&self) -> Option<u32> {
        Some(self.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_shared::session::Assignment;
    use proptest::prelude::*;
    use tokio::sync::watch;

    fn assigned(weight: f64) -> Option<Assignment> {
        Some(Assignment {
            weight,
            cycle: 1,
            draining: false,
            load: 0.5,
            inflight_trusted: true,
        })
    }

    #[test]
    fn handle_starts_at_speed_1_and_clones_share() {
        let h = SyntheticHandle::new();
        assert_eq!(h.speed(), 1.0);
        assert!((h.offered() - 0.6).abs() < 1e-6);
        let other = h.clone();
        other.set_speed(0.25);
        assert_eq!(h.speed(), 0.25);
    }

    #[test]
    fn weight_is_the_mean_until_the_first_assignment() {
        let (tx, rx) = watch::channel(None);
        let src = SyntheticInflight::new(SyntheticHandle::new(), rx, 0.0, 0);
        assert_eq!(src.weight(), 1.0);
        tx.send_replace(assigned(1.5));
        assert_eq!(src.weight(), 1.5);
        drop(tx);
        assert_eq!(src.weight(), 1.5, "the last assignment outlives its sender");
    }

    #[test]
    fn model_without_noise_is_exact() {
        assert_eq!(model_utilization(1.0, 1.0, 0.6, 0.0, 0.7), 0.6);
        assert_eq!(model_utilization(0.5, 0.5, 0.6, 0.0, 0.0), 0.6);
        assert_eq!(model_utilization(2.0, 1.0, 0.5, 0.1, 1.0), 1.1);
        assert_eq!(model_utilization(-1.0, 1.0, 0.6, 0.0, 0.0), 0.0);
        assert_eq!(model_utilization(1.0, 0.0, 0.6, 0.0, 0.0), MAX_LOAD);
        assert_eq!(model_utilization(0.0, 0.0, 0.6, 0.0, 0.0), 0.0);
    }

    #[test]
    fn noise_stays_in_its_band_and_averages_out() {
        let h = SyntheticHandle::new();
        h.set_offered(0.5);
        let mut src = SyntheticInflight::new(h, crate::sample::no_assignment(), 0.1, 7);
        let draws: Vec<f64> = (0..5000).map(|_| src.utilization()).collect();
        assert!(draws.iter().all(|u| (0.45..=0.55).contains(u)));
        assert!(draws.iter().any(|u| *u < 0.46) && draws.iter().any(|u| *u > 0.54));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }

    #[test]
    fn same_seed_same_sequence() {
        let run = |seed| {
            let mut src = SyntheticInflight::new(
                SyntheticHandle::new(),
                crate::sample::no_assignment(),
                0.2,
                seed,
            );
            src.set_capacity(1000);
            (0..20).map(|_| src.sample().unwrap()).collect::<Vec<u32>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn reports_utilization_times_capacity_and_follows_handle_and_weight() {
        let h = SyntheticHandle::new();
        h.set_offered(0.5);
        let (tx, rx) = watch::channel(None);
        let mut src = SyntheticInflight::new(h.clone(), rx, 0.0, 0);
        assert_eq!(src.sample().unwrap(), 50); // default capacity 100
        src.set_capacity(40);
        assert_eq!(src.sample().unwrap(), 20);
        h.set_speed(0.5); // the node slows down: twice the load
        assert_eq!(src.sample().unwrap(), 40);
        tx.send_replace(assigned(0.5)); // the balancer halves its share: back to normal
        assert_eq!(src.sample().unwrap(), 20);
        assert!(src.describe().contains("speed=0.5"), "{}", src.describe());
    }

    #[test]
    fn weights_proportional_to_speed_equalise_load() {
        let speeds = [1.0, 0.5, 1.5];
        let mean_speed = speeds.iter().sum::<f64>() / speeds.len() as f64;
        let loads: Vec<f64> = speeds
            .iter()
            .map(|s| model_utilization(s / mean_speed, *s, 0.6, 0.0, 0.0))
            .collect();
        assert!(loads.iter().all(|l| (l - 0.6).abs() < 1e-12), "{loads:?}");
    }

    proptest! {
        #[test]
        fn never_nan_never_negative(
            w in proptest::num::f64::ANY,
            s in proptest::num::f64::ANY,
            l in proptest::num::f64::ANY,
            n in proptest::num::f64::ANY,
            u in -1.0f64..=1.0,
        ) {
            let x = model_utilization(w, s, l, n, u);
            prop_assert!(x.is_finite() && (0.0..=MAX_LOAD).contains(&x), "{x}");
        }

        #[test]
        fn source_is_total_on_any_handle_values(w: f32, s: f32, l: f32, cap: u32) {
            let h = SyntheticHandle::new();
            h.set_speed(f64::from(s));
            h.set_offered(f64::from(l));
            let (_tx, rx) = watch::channel(assigned(f64::from(w)));
            let mut src = SyntheticInflight::new(h, rx, 0.5, 3);
            src.set_capacity(cap);
            let n = src.sample().unwrap();
            prop_assert!(f64::from(n) <= MAX_LOAD * f64::from(cap) + 1.0);
        }
    }
}
