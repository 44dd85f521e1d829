//! CPU that does not follow the weight.
//!
//! An endpoint's CPU is what its host or cgroup spends, and other work there is read as
//! the service's load: a batch job, a log shipper, a sidecar that is not niced. Such a
//! neighbour's part of the reading does not fall when the weight does, so the
//! controller, seeing the endpoint above the fleet's average whatever its weight,
//! drives it to the weight floor, and whatever capacity the neighbour left the service
//! is lost to the fleet (the simulator's neighbour scenario, `docs/balance.md`).
//!
//! Such a reading is told apart as the in-flight count that does not respond to the
//! weight is: the controller has cut the weight by [`FLOOR_DROP`] while the CPU kept at
//! least [`FLOOR_KEEP`] of its level, for [`FLOOR_CYCLES`] cycles, and the count says
//! nothing unusual (a queue that drains keeps a node's CPU up too, and its count
//! stands out). The part that stayed is the reading's floor: the two ends of the
//! episode give the reading's slope per unit of weight, and the floor is what is left
//! of the reading at no weight. From then on the endpoint's CPU load is the service's
//! use of what the neighbour leaves, `(cpu − floor) / (1 − floor)`, and the controller
//! gives it the share of the traffic that capacity carries.
//!
//! A floor above `1 −` [`MIN_LEFT`] is not one: a reading pinned at the quota whatever
//! the weight (a greedy neighbour in a quota'd cgroup fills whatever the service leaves)
//! says nothing of what the service could get, and the endpoint stays steered by its
//! reading. A reading below [`FLOOR_GONE`] of the floor says the neighbour has left or
//! shrunk: the floor is forgotten and the reading is the service's again. A floor the
//! reading does not rise above soon after ([`FLOOR_PROOF_REPORTS`]) was a reading that
//! follows nothing, and is dropped for good. A floor is kept for
//! [`FLOOR_TTL`] reports and then found again, if it is still there: with the node's
//! load above the floor held at the average, the reading cannot show a neighbour that
//! shrinks slowly. A saturated reading ([`SATURATED`]) starts no episode: capped at the
//! capacity, it would take a queue for a floor.
//!
//! The service judges each fresh endpoint's report once a cycle, in the walk that
//! assesses its load, against the last cycle's average and in-flight verdict (a
//! cycle's lag, where the rule takes several), at the mean of the last two published
//! weights: a report's window straddles the last publication.

/// The episode starts when the endpoint's CPU is this multiple of the fleet's average
/// load: the controller is steering it down.
pub const FLOOR_START: f64 = 1.2;
/// The weight must have fallen by this factor since the episode began...
pub const FLOOR_DROP: f64 = 4.0;
/// ...while the CPU kept at least this share of its level. A reading that follows the
/// weight keeps about 1 / [`FLOOR_DROP`] of it (a little more where a lightly loaded
/// service spends more per request); a neighbour of half the cores beside a service at
/// the fleet's average keeps about 0.65.
pub const FLOOR_KEEP: f64 = 0.5;
/// Cycles in a row it must hold so: reports and the load balancers lag the weight by a
/// cycle or two.
pub const FLOOR_CYCLES: u32 = 3;
/// At least this share of the capacity must be left beside the floor for the floor to
/// be used.
pub const MIN_LEFT: f64 = 0.1;
/// A floor smaller than this is the noise of the reading's slope, not a neighbour.
pub const MIN_FLOOR: f64 = 0.05;
/// A reading below this share of the floor forgets it.
pub const FLOOR_GONE: f64 = 0.7;
/// Within this many reports of a floor being found, the reading above it must show the
/// service's work, at least [`FLOOR_PROOF_OWN`] of the fleet's average, once: the
/// weight grows back while the load above the floor is small, and a service's CPU
/// grows with it. A reading that stays at the floor whatever the weight is not a
/// service beside a neighbour but a reading that follows nothing (a source measuring
/// the wrong cgroup): with the floor its load would read 0, and its weight grow until
/// its in-flight count held it. The floor is disproved, and none is looked for again
/// until the endpoint is drained and undrained, or the aggregator restarts.
pub const FLOOR_PROOF_REPORTS: u32 = 10;
/// See [`FLOOR_PROOF_REPORTS`].
pub const FLOOR_PROOF_OWN: f64 = 0.1;
/// A floor is kept for this many reports, then forgotten, to be found again if it is
/// still there. While the controller holds the service's load above the floor at the
/// average, the reading stays above the floor however the neighbour changes, so a
/// neighbour that shrinks slowly would leave the floor too high (and the node with more
/// than its capacity) for good. Finding it again costs the node a few cycles at a
/// smaller weight, once in this many.
pub const FLOOR_TTL: u32 = 120;
/// A reading at or above this is saturated: it neither starts an episode nor sets its
/// level. Capped at the capacity, it understates the work waiting, and an episode
/// measured from it would take a saturated node's queue for a floor.
pub const SATURATED: f64 = 0.95;
/// The episode is measured again from a reading this much above its level (a neighbour
/// that came meanwhile), not from every noisy rise: each new start needs the weight to
/// fall by [`FLOOR_DROP`] again, which near the weight floor it cannot.
pub const FLOOR_RISE: f64 = 1.1;

/// One endpoint's memory of its CPU against its weight. Sixteen bytes: a service may
/// have 100,000 endpoints, and the cycle walks them all.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuFloor {
    /// The CPU and the weight when the episode began; a weight of 0 for no episode.
    /// Once a floor is found, `cpu0` is 1 when the reading has risen above it.
    cpu0: f32,
    weight0: f32,
    /// The part of the reading that does not follow the weight; 0 until found, and
    /// negative once a floor was disproved.
    floor: f32,
    /// Reports in a row the CPU held at the low weight; once a floor is found, reports
    /// since.
    held: u32,
}

impl CpuFloor {
    /// The floor, once found.
    pub fn floor(&self) -> Option<f64> {
        (self.floor > 0.0).then_some(f64::from(self.floor))
    }

    /// The service's CPU load: `cpu` itself, or its share of what the floor leaves.
    pub(crate) fn own(&self, cpu: f64) -> f64 {
        match self.floor() {
            Some(a) => ((cpu - a) / (1.0 - a)).max(0.0),
            None => cpu,
        }
    }

    /// Takes in a report: the endpoint's CPU reading `cpu` taken at `weight` (the
    /// weight the load balancers applied over the report's window), the fleet's
    /// average load `avg`, and whether its in-flight count said nothing unusual and it
    /// is not warming (`steady`). Returns true when a floor is newly found.
    pub(crate) fn judge(&mut self, cpu: f64, weight: f64, avg: f64, steady: bool) -> bool {
        if let Some(a) = self.floor() {
            self.held = self.held.saturating_add(1);
            if cpu < a * FLOOR_GONE || self.held >= FLOOR_TTL {
                *self = CpuFloor::default();
            } else if self.own(cpu) >= FLOOR_PROOF_OWN * avg {
                self.cpu0 = 1.0;
            } else if self.cpu0 < 1.0 && self.held >= FLOOR_PROOF_REPORTS {
                self.floor = -1.0;
            }
            return false;
        }
        if self.floor < 0.0 {
            return false;
        }
        if !(steady && cpu.is_finite() && weight > 0.0 && weight.is_finite() && avg > 0.0) {
            self.end_episode();
            return false;
        }
        if cpu >= SATURATED {
            return false;
        }
        if self.weight0 <= 0.0 {
            if cpu > avg * FLOOR_START {
                self.cpu0 = cpu as f32;
                self.weight0 = weight as f32;
            }
            return false;
        }
        if cpu <= avg {
            // The reading followed the weight down to the average.
            self.end_episode();
            return false;
        }
        if cpu > f64::from(self.cpu0) * FLOOR_RISE {
            // An episode that began on a noisy report is measured again from where the
            // reading rose: a neighbour that started meanwhile.
            self.cpu0 = cpu as f32;
            self.weight0 = weight as f32;
            self.held = 0;
            return false;
        }
        let (cpu0, weight0) = (f64::from(self.cpu0), f64::from(self.weight0));
        let fell = weight * FLOOR_DROP <= weight0;
        let kept = cpu >= cpu0 * FLOOR_KEEP;
        self.held = if fell && kept { self.held + 1 } else { 0 };
        if self.held < FLOOR_CYCLES {
            return false;
        }
        // The reading's slope over the episode, and what is left of it at no weight.
        let slope = ((cpu0 - cpu) / (weight0 - weight)).max(0.0);
        let floor = (cpu - slope * weight).clamp(0.0, cpu);
        self.end_episode();
        if (MIN_FLOOR..=1.0 - MIN_LEFT).contains(&floor) {
            self.floor = floor as f32;
            self.cpu0 = 0.0;
            return true;
        }
        false
    }

    fn end_episode(&mut self) {
        // Written only when there is one: the cycle walks every endpoint, and most
        // have none.
        if self.weight0 != 0.0 || self.held != 0 {
            self.weight0 = 0.0;
            self.held = 0;
        }
    }

    /// Forgets everything, as after a drain or a restart.
    pub fn reset(&mut self) {
        *self = CpuFloor::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steers one endpoint the way the controller would, halving its weight while its
    /// load is above `avg`, with its CPU `floor + slope × weight`; returns the cycle
    /// its floor was found at and the floor.
    fn steer(floor: f64, slope: f64, avg: f64) -> Option<(u32, f64)> {
        let mut f = CpuFloor::default();
        let mut weight = 1.0_f64;
        for cycle in 0..30 {
            let cpu = (floor + slope * weight).min(1.0);
            if f.judge(cpu, weight, avg, true) {
                return f.floor().map(|a| (cycle, a));
            }
            if f.own(cpu) > avg {
                weight = (weight * 0.5).max(0.01);
            }
        }
        None
    }

    #[test]
    fn a_neighbour_s_share_of_the_reading_is_found() {
        // Half the cores beside a service at the fleet's average of 0.45.
        let (cycle, floor) = steer(0.5, 0.45, 0.45).expect("found");
        assert!((floor - 0.5).abs() < 1e-9, "{floor}");
        assert!(cycle <= 6, "{cycle}");
    }

    #[test]
    fn a_reading_that_follows_the_weight_has_no_floor() {
        // A node twice as loaded as the rest, its CPU proportional to its weight, or
        // with a little more per request at a small weight.
        assert_eq!(steer(0.0, 0.9, 0.45), None);
        let mut f = CpuFloor::default();
        for (cpu, weight) in [(0.9, 1.0), (0.6, 0.5), (0.35, 0.25), (0.2, 0.12)] {
            assert!(!f.judge(cpu, weight, 0.45, true));
        }
        assert_eq!(f.floor(), None);
    }

    #[test]
    fn a_reading_pinned_at_the_quota_is_no_floor() {
        // A greedy neighbour in a quota'd cgroup: nothing is left beside it to steer by.
        assert_eq!(steer(1.0, 0.0, 0.45), None);
        // Below saturation, but too little left beside it to steer by.
        assert_eq!(steer(0.92, 0.0, 0.45), None);
    }

    #[test]
    fn a_floor_the_reading_never_rises_above_is_disproved_for_good() {
        // A reading that follows nothing: 0.7 whatever the weight. Once the weight has
        // fallen, a floor is found and the load reads 0; the weight grows back...
        let mut f = CpuFloor::default();
        let mut weight = 1.0_f64;
        while f.floor().is_none() {
            assert!(weight > 0.01, "no floor found");
            f.judge(0.7, weight, 0.45, true);
            weight *= 0.5;
        }
        assert!(f.own(0.7) < 1e-6, "{}", f.own(0.7));
        // ...and with nothing above the floor for as many reports, it is gone.
        for _ in 1..FLOOR_PROOF_REPORTS {
            weight = (weight * 1.5).min(1.0);
            f.judge(0.7, weight, 0.45, true);
        }
        assert!(f.floor().is_some());
        f.judge(0.7, weight, 0.45, true);
        assert_eq!(f.floor(), None);
        assert_eq!(f.own(0.7), 0.7);
        // And it is not looked for again.
        for weight in [1.0, 0.5, 0.25, 0.12, 0.06, 0.03, 0.015] {
            assert!(!f.judge(0.7, weight, 0.45, true));
        }
        assert_eq!(f.floor(), None);
        f.reset();
        assert_eq!(f, CpuFloor::default());
    }

    #[test]
    fn a_service_above_its_floor_keeps_it_as_its_weight_grows() {
        let mut f = CpuFloor {
            floor: 0.5,
            ..CpuFloor::default()
        };
        // Half the cores left; the service spends 0.45 of the node per unit of weight.
        for weight in [
            0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.55, 0.55,
        ] {
            f.judge(0.5 + 0.45 * weight, weight, 0.45, true);
        }
        assert_eq!(f.floor(), Some(0.5));
    }

    /// Feeds `f` the readings at the weights, against a fleet average of `avg`;
    /// returns whether a floor was found on the way.
    fn feed(f: &mut CpuFloor, avg: f64, points: &[(f64, f64)]) -> bool {
        let mut found = false;
        for &(cpu, weight) in points {
            found |= f.judge(cpu, weight, avg, true);
        }
        found
    }

    #[test]
    fn a_reading_that_falls_to_a_third_as_the_weight_falls_fourfold_follows_it() {
        // 0.1 + 0.8 × weight, falling slowly enough to stay above the average: a
        // tenth of it stays, but it falls with the weight, below half its level.
        let mut f = CpuFloor::default();
        let weights = [1.0, 0.7, 0.5, 0.35, 0.25, 0.2, 0.15];
        let points: Vec<(f64, f64)> = weights.iter().map(|&w| (0.1 + 0.8 * w, w)).collect();
        assert!(!feed(&mut f, 0.2, &points));
    }

    #[test]
    fn a_saturated_node_draining_its_queue_has_no_floor() {
        // Four times slower than its share: saturated until its weight is a quarter,
        // its reading then falls with its weight. Measured from the capped reading,
        // the fall would look like a floor of 0.6.
        let mut f = CpuFloor::default();
        let weights = [1.0_f64, 0.5, 0.33, 0.25, 0.2, 0.17, 0.14, 0.1, 0.08];
        let points: Vec<(f64, f64)> = weights.iter().map(|&w| ((4.0 * w).min(1.0), w)).collect();
        assert!(!feed(&mut f, 0.3, &points), "{f:?}");
    }

    #[test]
    fn a_floor_is_found_again_after_its_time() {
        let (_, floor) = steer(0.5, 0.45, 0.45).expect("found");
        let mut f = CpuFloor {
            floor: floor as f32,
            ..CpuFloor::default()
        };
        for _ in 1..FLOOR_TTL {
            f.judge(0.75, 0.55, 0.45, true);
        }
        assert!(f.floor().is_some());
        f.judge(0.75, 0.55, 0.45, true);
        assert_eq!(f, CpuFloor::default(), "forgotten, to be found again");
    }

    #[test]
    fn a_count_that_stands_out_is_a_queue_not_a_neighbour() {
        let mut f = CpuFloor::default();
        for weight in [1.0, 0.5, 0.25, 0.12, 0.06, 0.03] {
            assert!(!f.judge(0.8, weight, 0.45, false));
        }
        assert_eq!(f.floor(), None);
    }

    #[test]
    fn the_floor_is_the_service_s_use_of_what_is_left_and_goes_with_the_neighbour() {
        let mut f = CpuFloor {
            floor: 0.5,
            ..CpuFloor::default()
        };
        assert!((f.own(0.75) - 0.5).abs() < 1e-9);
        assert_eq!(f.own(0.4), 0.0);
        // The neighbour leaves: the reading falls well below the floor.
        assert!(!f.judge(0.3, 0.5, 0.45, true));
        assert_eq!(f.floor(), None);
        assert_eq!(f.own(0.3), 0.3);
    }
}
