//! A cgroup's CPU utilization relative to its quota.
//!
//! Measuring against the quota rather than the host is what makes the number mean "how
//! much of what this service may use": a container limited to half a core that uses half
//! a core is saturated, however idle the host is.
//!
//! Two layouts exist and both are in use:
//! - cgroup v2: one hierarchy; `cpu.stat` has `usage_usec`, the quota is `cpu.max`.
//! - cgroup v1: one hierarchy per controller. Usage is `cpuacct.usage` (nanoseconds) in
//!   the `cpuacct` hierarchy, the quota is `cpu.cfs_quota_us` / `cpu.cfs_period_us` in
//!   the `cpu` hierarchy. Distributions either co-mount them (`cpu,cpuacct`) or mount
//!   them separately, so the same cgroup name lives under two different directories.
//!
//! On a hybrid host (v1 controllers plus an empty v2 `unified` hierarchy) the v2
//! `cpu.stat` has usage but the quota is enforced by v1, so v1 is preferred when a name
//! resolves in both.

use std::io::ErrorKind;
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use super::niced::NicedTime;
use super::siblings::{QuotaLevel, Siblings};
use super::{read_file, CpuSource, SampleError};

/// Where cgroupfs is normally mounted.
pub(crate) const DEFAULT_ROOT: &str = "/sys/fs/cgroup";

/// v1 hierarchies that hold `cpuacct.usage`, in the order they are tried.
const V1_USAGE_HIERARCHIES: [&str; 3] = ["cpuacct", "cpu,cpuacct", "cpuacct,cpu"];
/// v1 hierarchies that hold the CFS quota, in the order they are tried.
const V1_QUOTA_HIERARCHIES: [&str; 3] = ["cpu", "cpu,cpuacct", "cpuacct,cpu"];
/// v2 hierarchies relative to the root: pure v2 mounts at the root, hybrid at `unified`.
const V2_HIERARCHIES: [&str; 2] = ["", "unified"];

/// Which cgroup interface a source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Per-controller hierarchies: `cpuacct.usage` and `cpu.cfs_quota_us`.
    V1,
    /// The unified hierarchy: `cpu.stat` and `cpu.max`.
    V2,
}

/// The files a cgroup's CPU is read from, resolved once when the source is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupPaths {
    /// Which interface the files belong to.
    pub version: CgroupVersion,
    /// `cpuacct.usage` (v1) or `cpu.stat` (v2).
    pub usage_file: PathBuf,
    /// The directories whose quota applies, from the cgroup up to its hierarchy's root:
    /// a parent's quota caps its children, so the tightest one is the real limit. Empty
    /// when no quota directory exists (a v1 cgroup with only a `cpuacct` side), which
    /// means unlimited.
    pub quota_dirs: Vec<PathBuf>,
}

/// Finds the usage and quota files for `spec` under cgroupfs mounted at `root`.
///
/// `spec` is either an absolute path (under `root`, in any hierarchy, or a cgroup mounted
/// elsewhere), or a name relative to the hierarchies such as `ballast/web1`. An absolute
/// path that does not exist is read as the hierarchy-relative path `/proc/PID/cgroup`
/// prints, so `/ballast/web1` works too.
pub fn resolve(root: &Path, spec: &str) -> Result<CgroupPaths, SampleError> {
    let spec = spec.trim();
    let path = Path::new(spec);
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(SampleError::InvalidSpec(format!(
            "cgroup {spec:?}: `..` is not allowed"
        )));
    }
    // `direct` is a directory the spec names exactly, with the hierarchy root that bounds
    // its ancestor walk; `rel` is the name to look up in every hierarchy.
    let (direct, rel): (Option<(PathBuf, PathBuf)>, PathBuf) = if path.is_absolute() {
        if let Ok(under) = path.strip_prefix(root) {
            let mut comps = under.components();
            let first = comps.next().and_then(|c| c.as_os_str().to_str());
            let is_hierarchy = first.is_some_and(|h| {
                V1_USAGE_HIERARCHIES.contains(&h)
                    || V1_QUOTA_HIERARCHIES.contains(&h)
                    || V2_HIERARCHIES.contains(&h)
            });
            match first {
                Some(h) if is_hierarchy => (
                    Some((path.to_path_buf(), root.join(h))),
                    comps.as_path().to_path_buf(),
                ),
                _ => (Some((path.to_path_buf(), root.to_path_buf())), under.into()),
            }
        } else {
            let direct = path
                .is_dir()
                .then(|| (path.to_path_buf(), path.to_path_buf()));
            let rel = path.strip_prefix("/").unwrap_or(path).to_path_buf();
            (direct, rel)
        }
    } else {
        (None, path.to_path_buf())
    };

    let in_hierarchies = |names: &[&str]| -> Vec<(PathBuf, PathBuf)> {
        names
            .iter()
            .map(|h| {
                let base = root.join(h);
                (base.join(&rel), base)
            })
            .collect()
    };
    // What the user pointed at wins, then the name in every v1 hierarchy, then in every
    // v2 one: v1 wins on hybrid hosts because it is what enforces the quota there.
    let mut candidates = Vec::new();
    if let Some((dir, base)) = &direct {
        candidates.push((CgroupVersion::V1, dir.clone(), base.clone()));
        candidates.push((CgroupVersion::V2, dir.clone(), base.clone()));
    }
    for (dir, base) in in_hierarchies(&V1_USAGE_HIERARCHIES) {
        candidates.push((CgroupVersion::V1, dir, base));
    }
    for (dir, base) in in_hierarchies(&V2_HIERARCHIES) {
        candidates.push((CgroupVersion::V2, dir, base));
    }
    let mut tried = Vec::new();
    let mut found = None;
    for (version, dir, base) in candidates {
        let ok = match version {
            CgroupVersion::V1 => dir.join("cpuacct.usage").is_file(),
            CgroupVersion::V2 => has_v2_usage(&dir.join("cpu.stat")),
        };
        if ok {
            found = Some((version, dir, base));
            break;
        }
        tried.push(dir.display().to_string());
    }
    let Some((version, dir, base)) = found else {
        return Err(SampleError::NotFound(format!(
            "cgroup {spec:?}: no cpuacct.usage or cpu.stat with usage_usec in {}",
            tried.join(", ")
        )));
    };

    Ok(match version {
        CgroupVersion::V2 => CgroupPaths {
            version,
            usage_file: dir.join("cpu.stat"),
            quota_dirs: ancestors_within(&dir, &base),
        },
        CgroupVersion::V1 => {
            let quota = direct
                .into_iter()
                .chain(in_hierarchies(&V1_QUOTA_HIERARCHIES))
                .find(|(d, _)| d.join("cpu.cfs_quota_us").is_file());
            CgroupPaths {
                version,
                usage_file: dir.join("cpuacct.usage"),
                quota_dirs: quota
                    .map(|(d, b)| ancestors_within(&d, &b))
                    .unwrap_or_default(),
            }
        }
    })
}

/// `dir` and its parents up to and including `base`.
fn ancestors_within(dir: &Path, base: &Path) -> Vec<PathBuf> {
    dir.ancestors()
        .take_while(|a| a.starts_with(base))
        .map(Path::to_path_buf)
        .collect()
}

/// v1's `cpu` hierarchy also has a `cpu.stat`, with throttling counters only, so the file
/// existing does not make a directory v2.
fn has_v2_usage(cpu_stat: &Path) -> bool {
    std::fs::read_to_string(cpu_stat).is_ok_and(|t| parse_v2_usage_usec(&t).is_some())
}

/// The `usage_usec` line of a v2 `cpu.stat`.
pub(crate) fn parse_v2_usage_usec(text: &str) -> Option<u64> {
    stat_field(text, "usage_usec")
}

/// The value of a `cpu.stat` line `NAME VALUE`; `None` without one that parses.
fn stat_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        match (it.next(), it.next()) {
            (Some(k), Some(v)) if k == name => v.parse().ok(),
            _ => None,
        }
    })
}

/// A quota as a number of cores, `None` when unlimited.
pub(crate) fn parse_cpu_max(text: &str) -> Result<Option<f64>, String> {
    let mut it = text.split_whitespace();
    let quota = it.next().ok_or("empty")?;
    if quota == "max" {
        return Ok(None);
    }
    let quota: u64 = quota.parse().map_err(|_| format!("bad quota {quota:?}"))?;
    let period: u64 = match it.next() {
        Some(p) => p.parse().map_err(|_| format!("bad period {p:?}"))?,
        None => return Err("missing period".into()),
    };
    cores(quota, period).map(Some)
}

/// A v1 quota (`cpu.cfs_quota_us`, -1 = unlimited) over its period, as cores.
pub(crate) fn parse_cfs_quota(quota: &str, period: &str) -> Result<Option<f64>, String> {
    let quota: i64 = quota
        .trim()
        .parse()
        .map_err(|_| format!("bad quota {:?}", quota.trim()))?;
    if quota < 0 {
        return Ok(None);
    }
    let period: u64 = period
        .trim()
        .parse()
        .map_err(|_| format!("bad period {:?}", period.trim()))?;
    cores(quota.unsigned_abs(), period).map(Some)
}

fn cores(quota: u64, period: u64) -> Result<f64, String> {
    if quota == 0 || period == 0 {
        return Err(format!(
            "quota {quota} / period {period} is not a usable limit"
        ));
    }
    Ok(quota as f64 / period as f64)
}

/// How many CPUs are online, which is what an unlimited cgroup may use.
///
/// Reads `/sys/devices/system/cpu/online` rather than asking the standard library,
/// because `available_parallelism` already divides by the agent's own cgroup quota and
/// affinity, which are not the measured service's.
pub fn online_cpus() -> f64 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| parse_cpu_list(&t))
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .map_or(1.0, |n| n as f64)
}

/// Counts the CPUs in a kernel CPU list such as `0-3,6,8-9`; `None` for a list that is
/// malformed or counts beyond `usize`.
pub(crate) fn parse_cpu_list(text: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let cpus = match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)?.checked_add(1)?
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
        n = n.checked_add(cpus)?;
    }
    (n > 0).then_some(n)
}

/// A quota level's index among the quota directories, and its `nr_periods` and
/// `nr_throttled` (`None`: unreadable).
type Throttling = (usize, Option<(u64, u64)>);

/// What [`CgroupCpu::quota_levels`] reads: the cores the cgroup may use, each quota
/// level's throttling counters, and the nearest parent quota (level, cores).
type QuotaLevels = (f64, Vec<Throttling>, Option<(usize, f64)>);

/// A cgroup's CPU utilization: CPU time used over wall time × the cores its quota allows.
///
/// Not clamped at 1: a cgroup with burst allowance (or one read a little late) can use
/// more than its quota over an interval, and hiding that would hide overload.
///
/// The time of the cgroup's niced processes counts as idle, as on the host: batch work
/// that yields to the service is not the service's load ([`super::niced`]). Except
/// while the quota binds: a niced process on another core than the service's spends
/// the cgroup's quota at full speed, nice or not, and the whole group then waits for
/// the next period. So niced time counts as idle in the share of the interval's
/// periods that were not throttled (`nr_throttled` over `nr_periods` in `cpu.stat`, at
/// the quota's level that was throttled most).
#[derive(Debug)]
pub struct CgroupCpu {
    spec: String,
    paths: CgroupPaths,
    online_cpus: f64,
    niced: NicedTime,
    /// The throttling counters of each level with a quota at the last sample.
    throttling: Vec<Throttling>,
    /// Other cgroups under a parent's quota, which take their share of it.
    siblings: Siblings,
    prev: Option<(u64, Instant)>,
}

impl CgroupCpu {
    /// Opens a cgroup under [`DEFAULT_ROOT`].
    pub fn open(spec: &str) -> Result<Self, SampleError> {
        Self::open_at(Path::new(DEFAULT_ROOT), spec, online_cpus())
    }

    /// Opens a cgroup under cgroupfs mounted at `root`, on a host with `online_cpus`
    /// CPUs (the divisor for an unlimited quota). Reads usage and quota once, so a wrong
    /// name fails now.
    pub(crate) fn open_at(root: &Path, spec: &str, online_cpus: f64) -> Result<Self, SampleError> {
        Self::open_with_proc(root, Path::new("/proc"), spec, online_cpus)
    }

    /// [`Self::open_at`] with the members' stats read under `proc_root`.
    pub(crate) fn open_with_proc(
        root: &Path,
        proc_root: &Path,
        spec: &str,
        online_cpus: f64,
    ) -> Result<Self, SampleError> {
        let paths = resolve(root, spec)?;
        let group = paths
            .usage_file
            .parent()
            .map_or_else(|| root.to_path_buf(), Path::to_path_buf);
        let src = CgroupCpu {
            spec: spec.trim().to_string(),
            niced: NicedTime::new(proc_root, &group),
            throttling: Vec::new(),
            siblings: Siblings::default(),
            paths,
            online_cpus: if online_cpus.is_finite() && online_cpus > 0.0 {
                online_cpus
            } else {
                1.0
            },
            prev: None,
        };
        src.usage_ns()?;
        src.cores()?;
        Ok(src)
    }

    /// The files this source reads.
    pub fn paths(&self) -> &CgroupPaths {
        &self.paths
    }

    /// The cores the cgroup may use now: the tightest quota on the way to the hierarchy
    /// root, and never more than the online CPUs. Read every sample because quotas are
    /// changed at runtime (container resizes).
    pub fn cores(&self) -> Result<f64, SampleError> {
        Ok(self.quota_levels()?.0)
    }

    /// [`Self::cores`]; the throttling counters (`nr_periods`, `nr_throttled`) of each
    /// level with a quota, by its index in the quota directories, `None` where they
    /// cannot be read; and the nearest parent level with a quota (index, and the quota
    /// in cores, at most the online CPUs), whose other children share it.
    fn quota_levels(&self) -> Result<QuotaLevels, SampleError> {
        let mut cores = self.online_cpus;
        let mut shared = None;
        let mut throttling = Vec::new();
        for (level, dir) in self.paths.quota_dirs.iter().enumerate() {
            let limit = match self.paths.version {
                CgroupVersion::V2 => {
                    let file = dir.join("cpu.max");
                    match read_optional(&file)? {
                        Some(t) => parse_cpu_max(&t).map_err(|e| parse_err(&file, e))?,
                        None => None,
                    }
                }
                CgroupVersion::V1 => {
                    let qfile = dir.join("cpu.cfs_quota_us");
                    let pfile = dir.join("cpu.cfs_period_us");
                    match (read_optional(&qfile)?, read_optional(&pfile)?) {
                        (Some(q), Some(p)) => {
                            parse_cfs_quota(&q, &p).map_err(|e| parse_err(&qfile, e))?
                        }
                        _ => None,
                    }
                }
            };
            if let Some(limit) = limit {
                cores = cores.min(limit);
                if level > 0 && shared.is_none() {
                    shared = Some((level, limit.min(self.online_cpus)));
                }
                let counters = std::fs::read_to_string(dir.join("cpu.stat"))
                    .ok()
                    .and_then(|t| parse_throttling(&t));
                throttling.push((level, counters));
            }
        }
        Ok((cores, throttling, shared))
    }

    /// The cgroup holding the quota at `level` of the quota directories, if it is a
    /// parent of the service's (level 0 is the service's own cgroup), with the same
    /// cgroup on the usage side: its other children share the quota with the service.
    /// `None` in v2 where the parent does not delegate the `cpu` controller to its
    /// children: the scheduler then splits the quota between threads, not cgroups, and
    /// the siblings are not told apart from the service.
    fn quota_level(&self, level: usize) -> Option<QuotaLevel> {
        if level == 0 {
            return None;
        }
        let dirs = &self.paths.quota_dirs;
        if self.paths.version == CgroupVersion::V2 {
            let control = std::fs::read_to_string(dirs.get(level)?.join("cgroup.subtree_control"));
            if !control.is_ok_and(|c| c.split_whitespace().any(|x| x == "cpu")) {
                return None;
            }
        }
        let usage_dirs: Vec<&Path> = self.paths.usage_file.parent()?.ancestors().collect();
        // Both sides must name the same cgroups from the service's up to the level (v1
        // mounts `cpu` and `cpuacct` apart; they mirror one tree).
        for j in 0..level {
            if dirs.get(j)?.file_name()? != usage_dirs.get(j)?.file_name()? {
                return None;
            }
        }
        Some(QuotaLevel {
            version: self.paths.version,
            weights_dir: dirs.get(level)?.clone(),
            usage_dir: usage_dirs.get(level)?.to_path_buf(),
            own: dirs.get(level - 1)?.file_name()?.to_os_string(),
        })
    }

    /// The share of the periods since the last call in which the cgroup was throttled,
    /// at the level of its quota where it was most: 0 without a quota; 1 where a
    /// level's counters cannot be read, went backwards (a recreated cgroup) or a quota
    /// is new, whose interval is unknown: niced time is then load, the safe side.
    fn throttled_share(&mut self, now: Vec<Throttling>) -> f64 {
        let before = std::mem::replace(&mut self.throttling, now);
        self.throttling
            .iter()
            .map(|&(level, counters)| {
                let earlier = before.iter().find(|(l, _)| *l == level).map(|(_, c)| *c);
                match (earlier.flatten(), counters) {
                    (Some((p0, t0)), Some((p1, t1))) => {
                        match (p1.checked_sub(p0), t1.checked_sub(t0)) {
                            (Some(0), Some(_)) => 0.0,
                            (Some(periods), Some(throttled)) => {
                                (throttled as f64 / periods as f64).min(1.0)
                            }
                            _ => 1.0,
                        }
                    }
                    _ => 1.0,
                }
            })
            .fold(0.0, f64::max)
    }

    /// Cumulative CPU time of the cgroup, in nanoseconds.
    fn usage_ns(&self) -> Result<u64, SampleError> {
        usage_ns_in(self.paths.version, &self.paths.usage_file)
    }

    /// [`CpuSource::sample`] with an explicit clock, so tests need not sleep.
    fn sample_at(&mut self, now: Instant) -> Result<Option<f64>, SampleError> {
        let usage = self.usage_ns()?;
        let (cores, throttling, shared) = self.quota_levels()?;
        let niced = self.niced.since_last();
        let throttled = self.throttled_share(throttling);
        // What the siblings under a parent's quota leave the service; on the first
        // sample their baseline.
        let since = self.prev.map_or(0.0, |(_, at)| {
            now.saturating_duration_since(at).as_secs_f64()
        });
        let left = match shared {
            Some((k, quota)) => {
                let level = self.quota_level(k);
                self.siblings.left(level.as_ref(), quota, since).min(cores)
            }
            None => self.siblings.left(None, cores, since),
        };
        let Some((prev_usage, prev_at)) = self.prev else {
            self.prev = Some((usage, now));
            return Ok(None);
        };
        let wall = now.saturating_duration_since(prev_at).as_secs_f64();
        if wall <= 0.0 {
            return Ok(None);
        }
        self.prev = Some((usage, now));
        // A counter that went backwards means the cgroup was recreated under the same
        // name: there is no meaningful delta, only a new baseline.
        let Some(used) = usage.checked_sub(prev_usage) else {
            return Ok(None);
        };
        // Niced time read at whole ticks may exceed the counter's delta by a tick.
        let idle = (niced as f64 * (1.0 - throttled)) as u64;
        let used = used.saturating_sub(idle);
        Ok(Some(used as f64 / 1e9 / (wall * left)))
    }
}

/// The file a cgroup's cumulative CPU time is read from.
pub(crate) fn usage_file_name(version: CgroupVersion) -> &'static str {
    match version {
        CgroupVersion::V1 => "cpuacct.usage",
        CgroupVersion::V2 => "cpu.stat",
    }
}

/// Cumulative CPU time in nanoseconds from `file`, a v1 `cpuacct.usage` or a v2
/// `cpu.stat`.
pub(crate) fn usage_ns_in(version: CgroupVersion, file: &Path) -> Result<u64, SampleError> {
    let text = read_file(file)?;
    match version {
        CgroupVersion::V1 => text
            .trim()
            .parse::<u64>()
            .map_err(|_| parse_err(file, format!("bad usage {:?}", text.trim()))),
        CgroupVersion::V2 => parse_v2_usage_usec(&text)
            .map(|us| us.saturating_mul(1000))
            .ok_or_else(|| parse_err(file, "no usage_usec line")),
    }
}

/// `nr_periods` and `nr_throttled` of a `cpu.stat` (v1's `cpu` hierarchy, or v2's);
/// `None` without them.
pub(crate) fn parse_throttling(text: &str) -> Option<(u64, u64)> {
    Some((
        stat_field(text, "nr_periods")?,
        stat_field(text, "nr_throttled")?,
    ))
}

/// Reads a file that may legitimately be absent (no quota at that level).
fn read_optional(path: &Path) -> Result<Option<String>, SampleError> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SampleError::io(path, e)),
    }
}

fn parse_err(path: &Path, detail: impl Into<String>) -> SampleError {
    SampleError::parse(path.display().to_string(), detail)
}

impl CpuSource for CgroupCpu {
    fn sample(&mut self) -> Result<Option<f64>, SampleError> {
        self.sample_at(Instant::now())
    }

    fn describe(&self) -> String {
        let version = match self.paths.version {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        };
        let quota = self
            .paths
            .quota_dirs
            .first()
            .map_or_else(|| "none".to_string(), |d| d.display().to_string());
        format!(
            "cgroup {version} {} (usage {}, quota {quota})",
            self.spec,
            self.paths.usage_file.display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::time::Duration;

    fn write(dir: &Path, file: &str, text: &str) {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join(file), text).unwrap();
    }

    /// A v1 host with separately mounted `cpu` and `cpuacct`, like this machine, plus
    /// the hybrid `unified` v2 hierarchy whose `cpu.stat` has usage but no quota.
    fn v1_split(root: &Path, quota: &str, usage_ns: u64) {
        let cpu = root.join("cpu/ballast/web1");
        write(&root.join("cpu"), "cpu.cfs_quota_us", "-1\n");
        write(&root.join("cpu"), "cpu.cfs_period_us", "100000\n");
        write(&cpu, "cpu.cfs_quota_us", &format!("{quota}\n"));
        write(&cpu, "cpu.cfs_period_us", "100000\n");
        write(
            &cpu,
            "cpu.stat",
            "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n",
        );
        write(
            &root.join("cpuacct/ballast/web1"),
            "cpuacct.usage",
            &format!("{usage_ns}\n"),
        );
        write(
            &root.join("unified/ballast/web1"),
            "cpu.stat",
            "usage_usec 5\nuser_usec 3\nsystem_usec 2\n",
        );
    }

    fn set_v1_usage(root: &Path, usage_ns: u64) {
        write(
            &root.join("cpuacct/ballast/web1"),
            "cpuacct.usage",
            &format!("{usage_ns}\n"),
        );
    }

    fn v2(root: &Path, max: &str, usage_usec: u64) {
        let dir = root.join("ballast/web1");
        write(root, "cpu.stat", "usage_usec 999999999\n");
        write(&dir, "cpu.max", &format!("{max}\n"));
        write(
            &dir,
            "cpu.stat",
            &format!("usage_usec {usage_usec}\nuser_usec 1\nsystem_usec 1\nnr_periods 0\n"),
        );
    }

    /// Two samples one second apart, with `bump` applied in between.
    fn util_over_one_second(src: &mut CgroupCpu, bump: impl FnOnce()) -> f64 {
        let t0 = Instant::now();
        assert_eq!(src.sample_at(t0).unwrap(), None);
        bump();
        src.sample_at(t0 + Duration::from_secs(1))
            .unwrap()
            .expect("second sample has a delta")
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn a_niced_members_time_is_idle_in_the_periods_not_throttled_in_v1_and_v2() {
        let stat = |pid: u32, nice: i64, ticks: u64| {
            format!(
                "{pid} (x) R 1 7 7 0 -1 4194560 100 0 0 0 {ticks} 0 0 0 {} {nice} 1 0 \
                 42 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n",
                20 + nice
            )
        };
        // The cgroup's `cpu.stat` with `throttled` of 10 periods throttled.
        let throttling = |v: CgroupVersion, root: &Path, usage_usec: u64, throttled: u64| {
            let (dir, usage) = match v {
                CgroupVersion::V1 => (root.join("cpu/ballast/web1"), String::new()),
                CgroupVersion::V2 => (
                    root.join("ballast/web1"),
                    format!("usage_usec {usage_usec}\n"),
                ),
            };
            let periods = if usage_usec > 0 { 10 } else { 0 };
            let throttled = if usage_usec > 0 { throttled } else { 0 };
            write(
                &dir,
                "cpu.stat",
                &format!(
                    "{usage}nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time 0\n"
                ),
            );
        };
        for (v, nice, throttled) in [CgroupVersion::V1, CgroupVersion::V2]
            .into_iter()
            .flat_map(|v| [19, 0].map(|nice| (v, nice)))
            .flat_map(|(v, nice)| [0, 5, 10].map(|t| (v, nice, t)))
        {
            {
                let tmp = tempfile::tempdir().unwrap();
                let (root, proc_root) = (tmp.path().join("cg"), tmp.path().join("proc"));
                let members = match v {
                    CgroupVersion::V1 => {
                        v1_split(&root, "50000", 0);
                        root.join("cpuacct/ballast/web1")
                    }
                    CgroupVersion::V2 => {
                        v2(&root, "50000 100000", 0);
                        root.join("ballast/web1")
                    }
                };
                // The service (at nice 0) and the member.
                write(&members, "cgroup.procs", "6\n7\n");
                write(&proc_root.join("6"), "stat", &stat(6, 0, 0));
                write(&proc_root.join("7"), "stat", &stat(7, nice, 1000));
                throttling(v, &root, 0, 0);
                let mut src =
                    CgroupCpu::open_with_proc(&root, &proc_root, "ballast/web1", 2.0).unwrap();
                // Half a core's quota, all of it used over the second; 0.3 s of it by
                // the member (30 ticks), idle in the periods not throttled.
                let util = util_over_one_second(&mut src, || {
                    write(&proc_root.join("7"), "stat", &stat(7, nice, 1030));
                    match v {
                        CgroupVersion::V1 => set_v1_usage(&root, 500_000_000),
                        CgroupVersion::V2 => v2(&root, "50000 100000", 500_000),
                    }
                    throttling(v, &root, 500_000, throttled);
                });
                let idle = if nice > 0 {
                    0.6 * (1.0 - throttled as f64 / 10.0)
                } else {
                    0.0
                };
                let want = 1.0 - idle;
                assert!(
                    close(util, want),
                    "{v:?} nice {nice}, {throttled} of 10 periods throttled: {util}, not {want}"
                );
            }
        }
    }

    /// A quota whose throttling counters cannot be read may be binding: niced time is
    /// load then.
    #[test]
    fn niced_time_is_load_where_the_throttling_of_a_quota_is_unknown() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, proc_root) = (tmp.path().join("cg"), tmp.path().join("proc"));
        v1_split(&root, "50000", 0);
        let stat = |pid: u32, nice: i64, ticks: u64| {
            format!(
                "{pid} (x) R 1 7 7 0 -1 4194560 100 0 0 0 {ticks} 0 0 0 {} {nice} 1 0 \
                 42 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n",
                20 + nice
            )
        };
        write(&root.join("cpuacct/ballast/web1"), "cgroup.procs", "6\n7\n");
        write(&proc_root.join("6"), "stat", &stat(6, 0, 0));
        write(&proc_root.join("7"), "stat", &stat(7, 19, 1000));
        // Counters that wrapped print negative.
        let cpu = root.join("cpu/ballast/web1");
        write(&cpu, "cpu.stat", "nr_periods -5\nnr_throttled 3\n");
        let mut src = CgroupCpu::open_with_proc(&root, &proc_root, "ballast/web1", 2.0).unwrap();
        let util = util_over_one_second(&mut src, || {
            write(&proc_root.join("7"), "stat", &stat(7, 19, 1030));
            set_v1_usage(&root, 500_000_000);
        });
        assert!(close(util, 1.0), "{util}");
    }

    #[test]
    fn v1_split_hierarchies_by_name_and_by_either_path() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "20000", 1_000_000_000);
        let cpu_dir = root.join("cpu/ballast/web1");
        let acct_dir = root.join("cpuacct/ballast/web1");
        for spec in [
            "ballast/web1".to_string(),
            "/ballast/web1".to_string(),
            cpu_dir.display().to_string(),
            acct_dir.display().to_string(),
        ] {
            let mut src = CgroupCpu::open_at(root, &spec, 4.0).unwrap();
            assert_eq!(src.paths().version, CgroupVersion::V1, "{spec}");
            assert_eq!(src.paths().usage_file, acct_dir.join("cpuacct.usage"));
            assert_eq!(
                src.paths().quota_dirs,
                vec![cpu_dir.clone(), root.join("cpu/ballast"), root.join("cpu")]
            );
            assert!(close(src.cores().unwrap(), 0.2));
            set_v1_usage(root, 1_000_000_000);
            // 0.1 s of CPU in 1 s against a fifth of a core is half the quota.
            let util = util_over_one_second(&mut src, || set_v1_usage(root, 1_100_000_000));
            assert!(close(util, 0.5), "{spec}: {util}");
            assert!(src.describe().contains("v1"), "{}", src.describe());
        }
    }

    #[test]
    fn v1_unlimited_quota_uses_the_online_cpus() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "-1", 0);
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 4.0).unwrap();
        assert!(close(src.cores().unwrap(), 4.0));
        let util = util_over_one_second(&mut src, || set_v1_usage(root, 2_000_000_000));
        assert!(close(util, 0.5), "{util}");
    }

    #[test]
    fn v1_parent_quota_caps_an_unlimited_child() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "-1", 0);
        write(&root.join("cpu/ballast"), "cpu.cfs_quota_us", "50000\n");
        write(&root.join("cpu/ballast"), "cpu.cfs_period_us", "100000\n");
        let src = CgroupCpu::open_at(root, "ballast/web1", 4.0).unwrap();
        assert!(close(src.cores().unwrap(), 0.5));
    }

    /// A v1 split host whose quota, 0.3 cores, is on the parent `ballast`, over the
    /// service's `ballast/web1` and a sibling `ballast/batch` of weight `batch_shares`.
    fn v1_shared_quota(root: &Path, batch_shares: &str) {
        v1_split(root, "-1", 0);
        write(&root.join("cpu/ballast"), "cpu.cfs_quota_us", "30000\n");
        write(&root.join("cpu/ballast"), "cpu.cfs_period_us", "100000\n");
        write(&root.join("cpu/ballast/web1"), "cpu.shares", "1024\n");
        write(&root.join("cpu/ballast/batch"), "cpu.shares", batch_shares);
        set_usage(root, "cpuacct/ballast/batch", 0);
    }

    fn set_usage(root: &Path, group: &str, usage_ns: u64) {
        write(&root.join(group), "cpuacct.usage", &format!("{usage_ns}\n"));
    }

    #[test]
    fn a_greedy_sibling_under_a_parent_quota_leaves_the_service_its_weighted_half() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_shared_quota(root, "1024\n");
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let t = Instant::now();
        assert_eq!(src.sample_at(t).unwrap(), None);
        // The service used 0.1 cores, the batch job the other 0.2 of the quota: half of
        // the 0.3 is the service's to count on, and it used two thirds of it.
        set_v1_usage(root, 100_000_000);
        set_usage(root, "cpuacct/ballast/batch", 200_000_000);
        let u = src.sample_at(t + Duration::from_secs(1)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.15), "{u}");
        // The batch job idle: the whole quota is the service's again.
        set_v1_usage(root, 200_000_000);
        let u = src.sample_at(t + Duration::from_secs(2)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.3), "{u}");
    }

    #[test]
    fn a_sibling_of_low_weight_takes_only_its_weighted_share() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_shared_quota(root, "102\n");
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let u = util_over_one_second(&mut src, || {
            set_v1_usage(root, 100_000_000);
            set_usage(root, "cpuacct/ballast/batch", 200_000_000);
        });
        let left = 0.3 - 0.3 * 102.0 / 1126.0;
        assert!(close(u, 0.1 / left), "{u} against {}", 0.1 / left);
    }

    #[test]
    fn a_cgroup_s_own_quota_and_its_share_of_the_parent_s_bind_whichever_is_smaller() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_shared_quota(root, "1024\n");
        // web1's own 0.2 is above the 0.15 the greedy batch job leaves of the parent's
        // 0.3: the 0.15 binds.
        write(
            &root.join("cpu/ballast/web1"),
            "cpu.cfs_quota_us",
            "20000\n",
        );
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let t = Instant::now();
        src.sample_at(t).unwrap();
        set_v1_usage(root, 100_000_000);
        set_usage(root, "cpuacct/ballast/batch", 200_000_000);
        let u = src.sample_at(t + Duration::from_secs(1)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.15), "{u}");
        // Its own 0.1 binds below that.
        write(
            &root.join("cpu/ballast/web1"),
            "cpu.cfs_quota_us",
            "10000\n",
        );
        set_v1_usage(root, 150_000_000);
        set_usage(root, "cpuacct/ballast/batch", 400_000_000);
        let u = src.sample_at(t + Duration::from_secs(2)).unwrap().unwrap();
        assert!(close(u, 0.05 / 0.1), "{u}");
    }

    #[test]
    fn a_sibling_that_appears_counts_from_its_second_reading_and_one_that_goes_is_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_shared_quota(root, "1024\n");
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let t = Instant::now();
        src.sample_at(t).unwrap();
        // A new sibling with a large counter: no baseline yet, so it takes nothing.
        write(&root.join("cpu/ballast/late"), "cpu.shares", "1024\n");
        set_usage(root, "cpuacct/ballast/late", 9_000_000_000);
        set_v1_usage(root, 100_000_000);
        let u = src.sample_at(t + Duration::from_secs(1)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.3), "{u}");
        set_usage(root, "cpuacct/ballast/late", 9_200_000_000);
        set_v1_usage(root, 200_000_000);
        let u = src.sample_at(t + Duration::from_secs(2)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.15), "{u}");
        // Both siblings removed: nothing left to take the quota.
        fs::remove_dir_all(root.join("cpu/ballast/late")).unwrap();
        fs::remove_dir_all(root.join("cpu/ballast/batch")).unwrap();
        set_v1_usage(root, 300_000_000);
        let u = src.sample_at(t + Duration::from_secs(3)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.3), "{u}");
    }

    #[test]
    fn v2_siblings_share_a_parent_quota_by_cpu_weight() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v2(root, "max 100000", 0);
        write(&root.join("ballast"), "cpu.max", "30000 100000\n");
        write(&root.join("ballast"), "cpu.stat", "usage_usec 0\n");
        write(
            &root.join("ballast"),
            "cgroup.subtree_control",
            "cpu memory\n",
        );
        write(&root.join("ballast/web1"), "cpu.weight", "100\n");
        let batch = root.join("ballast/batch");
        write(&batch, "cpu.weight", "100\n");
        write(&batch, "cpu.stat", "usage_usec 0\n");
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let u = util_over_one_second(&mut src, || {
            v2(root, "max 100000", 100_000);
            write(&batch, "cpu.stat", "usage_usec 200000\n");
        });
        assert!(close(u, 0.1 / 0.15), "{u}");
        // Without the cpu controller delegated to the children the scheduler splits the
        // quota by thread: the siblings are not told apart, the quota is read whole.
        write(&root.join("ballast"), "cgroup.subtree_control", "memory\n");
        let t = Instant::now() + Duration::from_secs(5);
        src.sample_at(t).unwrap();
        v2(root, "max 100000", 200_000);
        write(&batch, "cpu.stat", "usage_usec 400000\n");
        let u = src.sample_at(t + Duration::from_secs(1)).unwrap().unwrap();
        assert!(close(u, 0.1 / 0.3), "{u}");
    }

    #[test]
    fn an_idle_class_sibling_takes_only_the_smallest_weighted_share() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_shared_quota(root, "1024\n");
        write(&root.join("cpu/ballast/batch"), "cpu.idle", "1\n");
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        let u = util_over_one_second(&mut src, || {
            set_v1_usage(root, 100_000_000);
            set_usage(root, "cpuacct/ballast/batch", 200_000_000);
        });
        let left = 0.3 - 0.3 * 2.0 / 1026.0;
        assert!(close(u, 0.1 / left), "{u}");
    }

    #[test]
    fn quota_above_the_host_is_capped_at_the_online_cpus() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "800000", 0);
        let src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        assert!(close(src.cores().unwrap(), 2.0));
    }

    #[test]
    fn v1_co_mounted_hierarchy() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let dir = root.join("cpu,cpuacct/svc");
        write(&dir, "cpuacct.usage", "0\n");
        write(&dir, "cpu.cfs_quota_us", "200000\n");
        write(&dir, "cpu.cfs_period_us", "100000\n");
        let mut src = CgroupCpu::open_at(root, "svc", 8.0).unwrap();
        assert_eq!(src.paths().usage_file, dir.join("cpuacct.usage"));
        assert_eq!(src.paths().quota_dirs[0], dir);
        assert!(close(src.cores().unwrap(), 2.0));
        let util = util_over_one_second(&mut src, || {
            write(&dir, "cpuacct.usage", "1000000000\n");
        });
        assert!(close(util, 0.5), "{util}");
    }

    #[test]
    fn v1_without_a_cpu_side_is_unlimited() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        write(&root.join("cpuacct/only"), "cpuacct.usage", "0\n");
        let src = CgroupCpu::open_at(root, "only", 3.0).unwrap();
        assert!(src.paths().quota_dirs.is_empty());
        assert!(close(src.cores().unwrap(), 3.0));
    }

    #[test]
    fn v2_limited_quota_by_name_and_by_path() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v2(root, "20000 100000", 1_000_000);
        let dir = root.join("ballast/web1");
        for spec in ["ballast/web1".to_string(), dir.display().to_string()] {
            v2(root, "20000 100000", 1_000_000);
            let mut src = CgroupCpu::open_at(root, &spec, 4.0).unwrap();
            assert_eq!(src.paths().version, CgroupVersion::V2);
            assert_eq!(src.paths().usage_file, dir.join("cpu.stat"));
            assert_eq!(
                src.paths().quota_dirs,
                vec![dir.clone(), root.join("ballast"), root.to_path_buf()]
            );
            let util = util_over_one_second(&mut src, || v2(root, "20000 100000", 1_100_000));
            assert!(close(util, 0.5), "{spec}: {util}");
        }
    }

    #[test]
    fn v2_unlimited_and_bursting_is_not_clamped() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v2(root, "max 100000", 0);
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        assert!(close(src.cores().unwrap(), 2.0));
        let util = util_over_one_second(&mut src, || v2(root, "max 100000", 1_000_000));
        assert!(close(util, 0.5), "{util}");

        v2(root, "20000 100000", 0);
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 2.0).unwrap();
        // 0.4 s of CPU against 0.2 cores: twice the quota, reported as such.
        let util = util_over_one_second(&mut src, || v2(root, "20000 100000", 400_000));
        assert!(close(util, 2.0), "{util}");
    }

    #[test]
    fn quota_changes_are_picked_up_without_reopening() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v2(root, "max 100000", 0);
        let src = CgroupCpu::open_at(root, "ballast/web1", 4.0).unwrap();
        assert!(close(src.cores().unwrap(), 4.0));
        write(&root.join("ballast/web1"), "cpu.max", "150000 100000\n");
        assert!(close(src.cores().unwrap(), 1.5));
    }

    #[test]
    fn v2_under_a_hybrid_unified_mount() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let dir = root.join("unified/app");
        write(&dir, "cpu.stat", "usage_usec 10\n");
        let src = CgroupCpu::open_at(root, "app", 2.0).unwrap();
        assert_eq!(src.paths().version, CgroupVersion::V2);
        assert_eq!(src.paths().usage_file, dir.join("cpu.stat"));
        // Usage exists but no quota anywhere: unlimited.
        assert!(close(src.cores().unwrap(), 2.0));
    }

    #[test]
    fn cgroup_mounted_outside_the_root_is_read_in_place() {
        let tmp = tempfile::tempdir().unwrap();
        let elsewhere = tmp.path().join("mnt/cg");
        write(&elsewhere, "cpu.stat", "usage_usec 0\n");
        write(&elsewhere, "cpu.max", "50000 100000\n");
        let root = tmp.path().join("empty-root");
        let src = CgroupCpu::open_at(&root, &elsewhere.display().to_string(), 4.0).unwrap();
        assert_eq!(src.paths().quota_dirs, vec![elsewhere.clone()]);
        assert!(close(src.cores().unwrap(), 0.5));
    }

    #[test]
    fn counter_reset_gives_a_new_baseline_not_a_huge_value() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "-1", 5_000_000_000);
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 1.0).unwrap();
        let t0 = Instant::now();
        assert_eq!(src.sample_at(t0).unwrap(), None);
        set_v1_usage(root, 100);
        assert_eq!(src.sample_at(t0 + Duration::from_secs(1)).unwrap(), None);
        set_v1_usage(root, 100 + 250_000_000);
        let util = src.sample_at(t0 + Duration::from_secs(2)).unwrap().unwrap();
        assert!(close(util, 0.25), "{util}");
        // Same instant: no delta, no division by zero.
        assert_eq!(src.sample_at(t0 + Duration::from_secs(2)).unwrap(), None);
    }

    #[test]
    fn missing_cgroup_names_the_paths_tried() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "-1", 0);
        let err = CgroupCpu::open_at(root, "nope", 1.0).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, SampleError::NotFound(_)));
        assert!(
            msg.contains("cpuacct/nope") && msg.contains("nope"),
            "{msg}"
        );
        assert!(matches!(
            CgroupCpu::open_at(root, "ballast/../../etc", 1.0),
            Err(SampleError::InvalidSpec(_))
        ));
    }

    #[test]
    fn removed_cgroup_is_an_error_not_idle() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v1_split(root, "-1", 0);
        let mut src = CgroupCpu::open_at(root, "ballast/web1", 1.0).unwrap();
        src.sample().unwrap();
        fs::remove_dir_all(root.join("cpuacct/ballast/web1")).unwrap();
        let err = src.sample().unwrap_err();
        assert!(matches!(err, SampleError::Io { .. }));
        assert!(err.to_string().contains("cpuacct.usage"), "{err}");
    }

    #[test]
    fn malformed_files_are_parse_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        v2(root, "lots 100000", 0);
        assert!(matches!(
            CgroupCpu::open_at(root, "ballast/web1", 1.0),
            Err(SampleError::Parse { .. })
        ));
        v2(root, "0 100000", 0);
        assert!(CgroupCpu::open_at(root, "ballast/web1", 1.0).is_err());
    }

    #[test]
    fn quota_parsers() {
        assert_eq!(parse_cpu_max("max 100000\n"), Ok(None));
        assert_eq!(parse_cpu_max("max"), Ok(None));
        assert_eq!(parse_cpu_max("20000 100000"), Ok(Some(0.2)));
        assert!(parse_cpu_max("20000").is_err());
        assert!(parse_cpu_max("").is_err());
        assert_eq!(parse_cfs_quota("-1\n", "100000\n"), Ok(None));
        assert_eq!(parse_cfs_quota("250000", "100000"), Ok(Some(2.5)));
        assert!(parse_cfs_quota("x", "100000").is_err());
        assert!(parse_cfs_quota("1000", "0").is_err());
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert!(online_cpus() >= 1.0);
    }

    #[test]
    fn a_cpu_list_counting_beyond_usize_is_refused_not_a_panic() {
        // Found by fuzzing: the count of a range, or the sum of the ranges, overflowed.
        assert_eq!(parse_cpu_list("0-18446744073709551615\n"), None);
        assert_eq!(
            parse_cpu_list("0-18446744073709551614,0-18446744073709551614"),
            None
        );
        assert_eq!(parse_cpu_list("1-18446744073709551615"), Some(usize::MAX));
    }

    /// This agent's own cgroup on the real machine, as `/proc/self/cgroup` names it. On
    /// v1 the `cpuacct` line is used, on v2 the `0::` line. The agent runs on Linux
    /// with cgroups only, so a machine without them fails the test rather than skip it.
    #[test]
    fn real_cgroup_of_this_process_sees_cpu_being_used() {
        let text = fs::read_to_string("/proc/self/cgroup").unwrap_or_else(|e| {
            panic!("/proc/self/cgroup is unreadable ({e}): the cgroup source cannot be tested")
        });
        let (mut v1, mut v2) = (None, None);
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let controllers = parts.nth(1).unwrap_or("");
            let path = parts.next().unwrap_or("");
            if controllers.split(',').any(|c| c == "cpuacct") {
                v1 = Some(path);
            } else if controllers.is_empty() {
                v2 = Some(path);
            }
        }
        let name = v1.or(v2).expect("/proc/self/cgroup names a cgroup");
        let mut src = CgroupCpu::open(name).unwrap();
        let t0 = Instant::now();
        assert_eq!(src.sample_at(t0).unwrap(), None);
        let mut x = 0u64;
        while t0.elapsed() < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let util = src.sample_at(Instant::now()).unwrap().unwrap();
        let cores = src.cores().unwrap();
        // At least this thread's 300 ms (a fraction of the cores), at most all of them
        // with some slack for the cgroup bursting.
        assert!(util > 0.05 / cores && util < 2.0, "{util} of {cores} cores");
    }
}
