//! What other cgroups under the same quota leave the service.
//!
//! A quota set on a parent cgroup is shared by everything below it: a systemd slice
//! with `CPUQuota=` holding the service's unit and a log shipper's, a pod with a
//! pod-level limit over containers without limits of their own. When the service's own cgroup has no
//! quota of its own, the agent divides its usage by the parent's quota, and a sibling
//! that takes the rest of that quota (a batch job, a busy sidecar) leaves the reading
//! low while the service is starved of CPU: its requests queue, and only the in-flight
//! count shows it.
//!
//! The scheduler splits a contended parent between its children by their weights
//! (`cpu.shares` in v1, `cpu.weight` in v2 where the parent delegates the `cpu`
//! controller to them; equal by default, the smallest for an idle-class group), and
//! each child keeps at most what it uses. So what the service can count on is the quota less what each
//! sibling takes, where a sibling takes what it uses up to its weighted share of the
//! quota against the service's branch and the other busy siblings:
//!
//! `left = quota − Σ min(used_i, quota × w_i / (w_own + Σ_busy w_j))`
//!
//! A greedy sibling of equal weight leaves the service half the quota, whatever the
//! service uses; a sidecar using a tenth of the quota leaves nine tenths; a batch job
//! whose weight was set low leaves nearly all of it. The service's load is its usage
//! over what is left, so the controller gives the node the traffic that capacity
//! carries, neither the whole quota's (its requests would queue) nor none (the greedy
//! neighbour's usage read as the service's, which drives its weight to the floor).
//!
//! Only the nearest parent with a quota is split this way, among its children, and the
//! service's own quota binds where it is smaller. Each busy sibling's weight counts in
//! full, even where one uses less than its share and leaves the rest to the others: the
//! service is then counted on for a little more than it can get (its reading a little
//! low), never for the whole quota as before siblings were counted. Processes in the service's own cgroup share it by
//! task, not by cgroup, and are not told apart here (their niced time is,
//! [`super::niced`]); nor are processes attached to the parent itself (v1).

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::cgroup::{usage_file_name, usage_ns_in, CgroupVersion};

/// Sibling cgroups read at most per sample: a parent with more children (a whole
/// slice of a large host) has the rest ignored, which reads the service as it was
/// read before siblings were counted, never lower.
pub(crate) const MAX_SIBLINGS: usize = 64;
/// A sibling using less than this share of the quota is idle: it keeps what it uses,
/// and its weight does not count against the service's.
pub(crate) const BUSY_SHARE: f64 = 0.01;
/// Whatever the siblings' readings, the service counts on at least this share of the
/// quota: the sum of many readings must not divide its usage by nearly nothing.
pub(crate) const MIN_LEFT: f64 = 0.05;
/// `cpu.shares` when the file cannot be read (v1's default).
const V1_DEFAULT_WEIGHT: f64 = 1024.0;
/// `cpu.weight` when the file cannot be read (v2's default).
const V2_DEFAULT_WEIGHT: f64 = 100.0;

/// Where the binding quota sits: the cgroup that holds it, on the side of the
/// hierarchy with the weights (`cpu` in v1) and on the side with the usage
/// (`cpuacct` in v1; the same directory in v2), and the name of its child on the way
/// to the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QuotaLevel {
    pub version: CgroupVersion,
    pub weights_dir: PathBuf,
    pub usage_dir: PathBuf,
    pub own: OsString,
}

/// The siblings' usage counters at the last sample.
#[derive(Debug, Default)]
pub(crate) struct Siblings {
    prev: HashMap<OsString, u64>,
    /// The level they were read at: another level starts afresh.
    at: Option<QuotaLevel>,
}

impl Siblings {
    /// The cores the service can count on, of `quota`, over the `wall` seconds since the
    /// last call. Without a level (the quota is the service's own cgroup's) or on the
    /// first call at a level, the whole quota: a sibling's use is known only from two
    /// readings.
    pub(crate) fn left(&mut self, level: Option<&QuotaLevel>, quota: f64, wall: f64) -> f64 {
        let Some(level) = level else {
            self.prev.clear();
            self.at = None;
            return quota;
        };
        if self.at.as_ref() != Some(level) {
            self.prev.clear();
            self.at = Some(level.clone());
        }
        let now = read_siblings(level);
        let mut used = Vec::with_capacity(now.siblings.len());
        for (name, usage, weight) in &now.siblings {
            if let Some(before) = self.prev.get(name) {
                // A counter that went backwards is a sibling recreated under the name.
                if let Some(delta) = usage.checked_sub(*before) {
                    if wall > 0.0 {
                        used.push((delta as f64 / 1e9 / wall, *weight));
                    }
                }
            }
        }
        self.prev = now
            .siblings
            .into_iter()
            .map(|(name, usage, _)| (name, usage))
            .collect();
        left_of(quota, now.own_weight, &used)
    }
}

/// `quota` less what each sibling, as `(cores used, weight)`, takes of it beside a
/// branch of weight `own`.
pub(crate) fn left_of(quota: f64, own: f64, siblings: &[(f64, f64)]) -> f64 {
    if !(quota.is_finite() && quota > 0.0) {
        return quota;
    }
    let busy = |used: f64| used >= BUSY_SHARE * quota;
    let contending: f64 = own
        + siblings
            .iter()
            .filter(|(u, _)| busy(*u))
            .map(|(_, w)| *w)
            .sum::<f64>();
    let taken: f64 = siblings
        .iter()
        .map(|&(u, w)| {
            let u = u.max(0.0);
            let fair = if busy(u) { quota * w / contending } else { u };
            u.min(fair)
        })
        .sum();
    (quota - taken).clamp(quota * MIN_LEFT, quota)
}

/// One reading of a level: the branch's weight and each sibling's usage counter (ns)
/// and weight.
struct Reading {
    own_weight: f64,
    siblings: Vec<(OsString, u64, f64)>,
}

fn read_siblings(level: &QuotaLevel) -> Reading {
    let own_weight = weight(level.version, &level.weights_dir.join(&level.own));
    let mut siblings = Vec::new();
    let Ok(entries) = std::fs::read_dir(&level.weights_dir) else {
        return Reading {
            own_weight,
            siblings,
        };
    };
    for entry in entries.flatten() {
        if siblings.len() >= MAX_SIBLINGS {
            break;
        }
        let name = entry.file_name();
        if name == level.own || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        // A sibling that vanished or cannot be read is left out: it takes nothing.
        let file = level
            .usage_dir
            .join(&name)
            .join(usage_file_name(level.version));
        if let Ok(usage) = usage_ns_in(level.version, &file) {
            let w = weight(level.version, &entry.path());
            siblings.push((name, usage, w));
        }
    }
    Reading {
        own_weight,
        siblings,
    }
}

/// A cgroup's scheduling weight, its version's default where unreadable or out of the
/// kernel's range, and its smallest where the group is idle-class (`cpu.idle` 1,
/// systemd's `CPUWeight=idle`), which yields to every other.
fn weight(version: CgroupVersion, dir: &Path) -> f64 {
    let (file, default, range) = match version {
        CgroupVersion::V1 => ("cpu.shares", V1_DEFAULT_WEIGHT, 2.0..=262_144.0),
        CgroupVersion::V2 => ("cpu.weight", V2_DEFAULT_WEIGHT, 1.0..=10_000.0),
    };
    let idle = std::fs::read_to_string(dir.join("cpu.idle")).is_ok_and(|t| t.trim() == "1");
    if idle {
        return *range.start();
    }
    std::fs::read_to_string(dir.join(file))
        .ok()
        .and_then(|t| t.trim().parse::<f64>().ok())
        .filter(|w| range.contains(w))
        .unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn a_greedy_sibling_of_equal_weight_leaves_half_the_quota() {
        // 0.3 cores; the service used 0.1, the sibling the other 0.2.
        assert!(close(left_of(0.3, 1024.0, &[(0.2, 1024.0)]), 0.15));
        // However little the service uses: the sibling keeps at most its half.
        assert!(close(left_of(0.3, 1024.0, &[(0.29, 1024.0)]), 0.15));
    }

    #[test]
    fn a_sibling_keeps_what_it_uses_below_its_share() {
        assert!(close(left_of(0.3, 1024.0, &[(0.03, 1024.0)]), 0.27));
        // Idle ones (below 1 % of the quota) take what they use and weigh nothing.
        assert!(close(left_of(0.3, 1024.0, &[(0.001, 1024.0)]), 0.299));
        assert!(close(left_of(0.3, 1024.0, &[]), 0.3));
    }

    #[test]
    fn weights_set_the_split() {
        // A batch job at a tenth of the service's weight: 0.3 × 102.4 / 1126.4.
        let left = left_of(0.3, 1024.0, &[(0.25, 102.4)]);
        assert!(close(left, 0.3 - 0.3 * 102.4 / 1126.4), "{left}");
        // Two greedy siblings of equal weight: a third each.
        assert!(close(
            left_of(0.3, 100.0, &[(0.15, 100.0), (0.15, 100.0)]),
            0.1
        ));
    }

    #[test]
    fn nonsense_readings_leave_between_a_twentieth_and_all_of_the_quota() {
        // A reading above the quota takes no more than its weighted share.
        assert!(close(left_of(0.3, 1024.0, &[(5.0, 1024.0)]), 0.15));
        assert!(close(left_of(0.3, 1024.0, &[(-1.0, 1024.0)]), 0.3));
        // Siblings of the largest weight, busy: the service still counts on a twentieth.
        let heavy = [(5.0, 262_144.0), (5.0, 262_144.0)];
        assert!(close(left_of(0.3, 1024.0, &heavy), 0.3 * MIN_LEFT));
        assert!(left_of(f64::NAN, 1024.0, &[]).is_nan());
    }
}
