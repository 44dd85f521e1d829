//! Whole-host CPU utilization from `/proc/stat`.
//!
//! The kernel counts time per state in clock ticks since boot; utilization over an
//! interval is the busy share of the ticks that passed. Using the ticks themselves as the
//! clock (rather than wall time) makes the result immune to a late or early sample.

use std::path::{Path, PathBuf};

use super::{read_file, CpuSource, SampleError};

/// The aggregate `cpu ` line of `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Ticks spent running: user, nice, system, irq, softirq and steal. Steal counts as
    /// busy because a hypervisor that takes our CPU leaves the service none of it.
    pub busy: u64,
    /// All ticks: busy plus idle and iowait. Guest time is already inside user/nice, so
    /// adding it would count it twice.
    pub total: u64,
}

/// Parses the first `cpu ` line of `/proc/stat` text.
pub(crate) fn parse_proc_stat(text: &str) -> Result<CpuTimes, SampleError> {
    let what = "/proc/stat";
    let line = text
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| SampleError::parse(what, "no aggregate `cpu ` line"))?;
    let fields = line
        .split_whitespace()
        .skip(1)
        .map(|f| {
            f.parse::<u64>()
                .map_err(|_| SampleError::parse(what, format!("bad counter {f:?} in {line:?}")))
        })
        .collect::<Result<Vec<u64>, _>>()?;
    // user nice system idle iowait irq softirq steal: kernels since 2.6.11 have all eight.
    let [user, nice, system, idle, iowait, irq, softirq, steal] = match fields.get(..8) {
        Some(&[a, b, c, d, e, f, g, h]) => [a, b, c, d, e, f, g, h],
        _ => {
            return Err(SampleError::parse(
                what,
                format!("expected at least 8 counters in {line:?}"),
            ))
        }
    };
    let busy = [user, nice, system, irq, softirq, steal]
        .iter()
        .fold(0u64, |acc, x| acc.saturating_add(*x));
    Ok(CpuTimes {
        busy,
        total: busy.saturating_add(idle).saturating_add(iowait),
    })
}

/// Utilization between two snapshots, or `None` when no tick has passed (two samples
/// within one jiffy) or the counters went backwards (which only a broken kernel does).
pub fn utilization(prev: CpuTimes, cur: CpuTimes) -> Option<f64> {
    let total = cur.total.checked_sub(prev.total)?;
    let busy = cur.busy.checked_sub(prev.busy)?;
    if total == 0 {
        return None;
    }
    Some((busy as f64 / total as f64).clamp(0.0, 1.0))
}

/// Whole-host CPU utilization, 0..1.
#[derive(Debug)]
pub struct HostCpu {
    path: PathBuf,
    prev: Option<CpuTimes>,
}

impl HostCpu {
    /// Reads `/proc/stat`.
    pub fn open() -> Result<Self, SampleError> {
        Self::open_at(Path::new("/proc/stat"))
    }

    /// Reads a `/proc/stat`-format file elsewhere (tests, a host `/proc` mounted into a
    /// container). Fails now if the file is unreadable or malformed.
    pub(crate) fn open_at(path: &Path) -> Result<Self, SampleError> {
        parse_proc_stat(&read_file(path)?)?;
        Ok(HostCpu {
            path: path.to_path_buf(),
            prev: None,
        })
    }
}

impl CpuSource for HostCpu {
    fn sample(&mut self) -> Result<Option<f64>, SampleError> {
        let cur = parse_proc_stat(&read_file(&self.path)?)?;
        let Some(prev) = self.prev else {
            self.prev = Some(cur);
            return Ok(None);
        };
        let util = utilization(prev, cur);
        // Keep the old baseline when no tick passed, so the next call still has a delta.
        if cur.total != prev.total {
            self.prev = Some(cur);
        }
        Ok(util)
    }

    fn describe(&self) -> String {
        format!("host ({})", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  9260 10 1675 51681 219 5 39 11 7 0\n\
                        cpu0 4446 0 881 25953 121 0 13 6 0 0\n\
                        intr 1 2 3\nctxt 100\n";

    #[test]
    fn parses_the_aggregate_line() {
        let t = parse_proc_stat(STAT).unwrap();
        assert_eq!(t.busy, 9260 + 10 + 1675 + 5 + 39 + 11);
        assert_eq!(t.total, t.busy + 51681 + 219);
    }

    #[test]
    fn rejects_malformed_text() {
        assert!(parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n").is_err());
        assert!(parse_proc_stat("cpu  1 2 3\n").is_err());
        assert!(parse_proc_stat("cpu  1 2 x 4 5 6 7 8\n").is_err());
        let err = parse_proc_stat("").unwrap_err().to_string();
        assert!(err.contains("/proc/stat"), "{err}");
    }

    #[test]
    fn utilization_is_busy_over_total_delta() {
        let a = CpuTimes {
            busy: 100,
            total: 1000,
        };
        let b = CpuTimes {
            busy: 130,
            total: 1100,
        };
        assert_eq!(utilization(a, b), Some(0.3));
        assert_eq!(utilization(a, a), None);
        assert_eq!(utilization(b, a), None);
    }

    #[test]
    fn source_reports_none_first_then_deltas() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stat");
        std::fs::write(&path, "cpu  100 0 0 900 0 0 0 0\n").unwrap();
        let mut src = HostCpu::open_at(&path).unwrap();
        assert_eq!(src.sample().unwrap(), None);
        // 50 busy of 200 ticks, with the idle time partly iowait.
        std::fs::write(&path, "cpu  120 10 20 1000 50 0 0 0\n").unwrap();
        assert_eq!(src.sample().unwrap(), Some(0.25));
        // No tick passed: no new information, and the baseline is kept.
        assert_eq!(src.sample().unwrap(), None);
        std::fs::write(&path, "cpu  220 10 20 1000 50 0 0 0\n").unwrap();
        assert_eq!(src.sample().unwrap(), Some(1.0));
        assert!(src.describe().contains("stat"));
    }

    #[test]
    fn source_fails_on_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stat");
        let err = HostCpu::open_at(&path).unwrap_err();
        assert!(matches!(err, SampleError::Io { .. }));
        assert!(err.to_string().contains("stat"));
        std::fs::write(&path, "cpu  1 0 0 1 0 0 0 0\n").unwrap();
        let mut src = HostCpu::open_at(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(src.sample().is_err());
    }

    #[test]
    fn real_proc_stat_sees_this_test_burn_cpu() {
        let mut src = HostCpu::open().unwrap();
        assert_eq!(src.sample().unwrap(), None);
        let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut x = 0u64;
        while std::time::Instant::now() < until {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let util = src.sample().unwrap().expect("300 ms is many ticks");
        // One busy thread on however many CPUs this host has.
        assert!(util > 0.0 && util <= 1.0, "utilization {util}");
    }
}
