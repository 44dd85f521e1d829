//! Whole-host CPU utilization from `/proc/stat`.
//!
//! The kernel counts time per state in clock ticks since boot; utilization over an
//! interval is the busy share of the ticks that passed. Using the ticks themselves as the
//! clock (rather than wall time) makes the result immune to a late or early sample.
//!
//! Time in niced processes (nice above 0) counts as idle: such a process yields the CPU
//! to the service whenever the service wants it (the scheduler gives a nice-19 task
//! 1.5 % of a CPU against a nice-0 one), so batch work beside the service (a backup, a
//! log compaction, a build at `nice -n 19`) is capacity the service still has, not
//! load. A service that itself runs niced is measured with `--cpu pid:N` or
//! `--cpu cgroup:PATH` instead.

use std::path::{Path, PathBuf};

use super::{read_file, CpuSource, SampleError};

/// The aggregate `cpu ` line of `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Ticks spent running at nice 0 or below: user, system, irq, softirq and steal.
    /// Steal counts as busy because a hypervisor that takes our CPU leaves the service
    /// none of it. Niced time does not (see the module's notes).
    pub busy: u64,
    /// All ticks: busy plus nice, idle and iowait. Guest time is already inside
    /// user/nice, so adding it would count it twice.
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
    let busy = [user, system, irq, softirq, steal]
        .iter()
        .fold(0u64, |acc, x| acc.saturating_add(*x));
    Ok(CpuTimes {
        busy,
        total: busy
            .saturating_add(nice)
            .saturating_add(idle)
            .saturating_add(iowait),
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
        assert_eq!(t.busy, 9260 + 1675 + 5 + 39 + 11);
        assert_eq!(t.total, t.busy + 10 + 51681 + 219);
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
        // 40 busy of 200 ticks, with the idle time partly iowait and niced.
        std::fs::write(&path, "cpu  120 10 20 1000 50 0 0 0\n").unwrap();
        assert_eq!(src.sample().unwrap(), Some(0.2));
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

    /// A busy loop on this host, at nice 0 and then at nice 19, each for the same
    /// window: the first reads as a core's worth of utilization, the second as next to
    /// nothing. Two pairs of windows; one clean pair is the proof, so other work on the
    /// host in one window does not decide it.
    #[test]
    fn real_proc_stat_counts_a_niced_loop_as_idle() {
        use std::process::{Command, Stdio};
        // `nice -n` is relative: from a niced test process the "nice 0" loop is niced too.
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let own: i64 = stat
            .rsplit(") ")
            .next()
            .and_then(|rest| rest.split_whitespace().nth(16))
            .and_then(|f| f.parse().ok())
            .expect("the niceness in /proc/self/stat");
        assert!(
            own <= 0,
            "this test must run at nice 0 or below, not {own}: it compares a loop at nice 0 \
             with one at nice 19"
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        /// The loop, under `timeout` so that it ends even if this test is killed; ended
        /// with TERM when dropped (`timeout` passes it on), whatever the test did meanwhile.
        struct Loop(std::process::Child);
        impl Drop for Loop {
            fn drop(&mut self) {
                let _ = Command::new("kill")
                    .args(["-TERM", &self.0.id().to_string()])
                    .status();
                let _ = self.0.wait();
            }
        }
        let window = |nice: &str| -> f64 {
            let _busy = Loop(
                Command::new("nice")
                    .args([
                        "-n",
                        nice,
                        "timeout",
                        "10",
                        "sh",
                        "-c",
                        "while :; do :; done",
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("nice, timeout and sh run"),
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
            let mut src = HostCpu::open().unwrap();
            assert_eq!(src.sample().unwrap(), None);
            std::thread::sleep(std::time::Duration::from_millis(800));
            src.sample().unwrap().expect("800 ms is many ticks")
        };
        let seen: Vec<(f64, f64)> = (0..2).map(|_| (window("0"), window("19"))).collect();
        let diff = seen.iter().map(|(g, n)| g - n).fold(f64::MIN, f64::max);
        eprintln!("utilization (nice 0, nice 19): {seen:?} on {cores} cores");
        // The loop takes one core of `cores`; half of that is left for the host's noise.
        assert!(
            diff >= 0.5 / cores,
            "a niced loop read as load: utilization (nice 0, nice 19) {seen:?} on {cores} cores"
        );
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
