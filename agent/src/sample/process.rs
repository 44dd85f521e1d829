//! CPU utilization of one process tree, from `/proc/PID/stat`.
//!
//! For services that run neither in their own cgroup nor alone on the host. The whole
//! tree counts because pre-forking servers (nginx, gunicorn, postgres) do their work in
//! children of the pid an operator knows.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{CpuSource, SampleError};

/// Clock ticks per second of the `/proc/PID/stat` times. This is `sysconf(_SC_CLK_TCK)`,
/// which the Linux ABI fixes at 100 on every architecture the agent targets; hardcoded
/// to keep the agent free of a libc dependency.
pub(crate) const CLOCK_TICKS_PER_SEC: f64 = 100.0;

/// The fields of `/proc/PID/stat` the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: the state letter. `Z` (zombie) and `X` (dead) mean the process is gone.
    pub state: char,
    /// Field 4: the parent pid.
    pub ppid: u32,
    /// Fields 14-17: utime + stime + cutime + cstime, in clock ticks. The children's
    /// times are included because a reaped child's time moves into its parent's
    /// cutime/cstime: without them, CPU used by short-lived children would vanish.
    pub ticks: u64,
    /// Fields 14-15: utime + stime, the process's own time without its reaped
    /// children's.
    pub own_ticks: u64,
    /// Field 19: the nice value, -20 to 19. Above 0 the process yields the CPU to
    /// ordinary ones.
    pub nice: i64,
    /// Field 22: start time since boot, in clock ticks. Tells a reused pid apart.
    pub start_time: u64,
}

/// Parses one `/proc/PID/stat` line. The fields are read after the *last* `)`, because
/// the command name in field 2 may contain spaces and parentheses.
pub(crate) fn parse_stat(text: &str) -> Result<ProcStat, String> {
    let close = text.rfind(')').ok_or("no `)` after the command name")?;
    let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // fields[0] is field 3 of the man page.
    let field = |n: usize| -> Result<&str, String> {
        fields
            .get(n - 3)
            .copied()
            .ok_or_else(|| format!("only {} fields after the command name", fields.len()))
    };
    let num = |n: usize| -> Result<u64, String> {
        let f = field(n)?;
        // cutime and cstime are signed in the kernel's format; never negative in practice.
        f.parse::<u64>()
            .or_else(|_| f.parse::<i64>().map(|v| v.max(0).unsigned_abs()))
            .map_err(|_| format!("field {n} is {f:?}, not a number"))
    };
    let state = field(3)?.chars().next().ok_or("empty state field")?;
    let ppid = u32::try_from(num(4)?).map_err(|_| "ppid out of range".to_string())?;
    let sum = |fields: &[usize]| {
        fields
            .iter()
            .map(|&n| num(n))
            .try_fold(0u64, |acc, t| t.map(|t| acc.saturating_add(t)))
    };
    let ticks = sum(&[14, 15, 16, 17])?;
    let own_ticks = sum(&[14, 15])?;
    let nice = field(19)?;
    let nice = nice
        .parse::<i64>()
        .map_err(|_| format!("field 19 is {nice:?}, not a nice value"))?;
    Ok(ProcStat {
        state,
        ppid,
        ticks,
        own_ticks,
        nice,
        start_time: num(22)?,
    })
}

/// How to find a process's children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildLookup {
    /// `/proc/PID/task/TID/children` when the kernel has it (`CONFIG_PROC_CHILDREN`),
    /// otherwise a scan.
    Auto,
    /// Scan every `/proc/*/stat` for its ppid: always works, costs one read per process.
    Scan,
}

/// The pids of `pid` and all its descendants, each with its stat, root first.
///
/// Descendants can exit while being walked; those are skipped. The root vanishing is an
/// error, since then there is nothing to measure.
pub fn tree(
    proc_root: &Path,
    pid: u32,
    lookup: ChildLookup,
) -> Result<Vec<(u32, ProcStat)>, SampleError> {
    let use_children_files = lookup == ChildLookup::Auto
        && proc_root
            .join(pid.to_string())
            .join("task")
            .join(pid.to_string())
            .join("children")
            .is_file();
    if use_children_files {
        tree_by_children_files(proc_root, pid)
    } else {
        tree_by_scan(proc_root, pid)
    }
}

fn stat_path(proc_root: &Path, pid: u32) -> PathBuf {
    proc_root.join(pid.to_string()).join("stat")
}

/// Reads a stat; `Ok(None)` when the process no longer exists.
pub(super) fn read_stat(proc_root: &Path, pid: u32) -> Result<Option<ProcStat>, SampleError> {
    let path = stat_path(proc_root, pid);
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_stat(&text)
            .map(Some)
            .map_err(|e| SampleError::parse(path.display().to_string(), e)),
        // ESRCH is what reading a stat returns when the process died after the open.
        Err(e) if e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(3) => Ok(None),
        Err(e) => Err(SampleError::io(path, e)),
    }
}

fn root_stat(proc_root: &Path, pid: u32) -> Result<ProcStat, SampleError> {
    read_stat(proc_root, pid)?.ok_or_else(|| {
        SampleError::NotFound(format!(
            "process {pid} ({} is gone)",
            stat_path(proc_root, pid).display()
        ))
    })
}

fn tree_by_children_files(proc_root: &Path, pid: u32) -> Result<Vec<(u32, ProcStat)>, SampleError> {
    let mut out = vec![(pid, root_stat(proc_root, pid)?)];
    let mut seen = HashSet::from([pid]);
    let mut queue = VecDeque::from([pid]);
    while let Some(parent) = queue.pop_front() {
        // Each thread has its own children file: a child belongs to the thread that
        // forked it.
        let task_dir = proc_root.join(parent.to_string()).join("task");
        let Ok(tasks) = std::fs::read_dir(&task_dir) else {
            continue; // exited while we walked
        };
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in text
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !seen.insert(child) {
                    continue;
                }
                if let Some(stat) = read_stat(proc_root, child)? {
                    out.push((child, stat));
                    queue.push_back(child);
                }
            }
        }
    }
    Ok(out)
}

fn tree_by_scan(proc_root: &Path, pid: u32) -> Result<Vec<(u32, ProcStat)>, SampleError> {
    let entries = std::fs::read_dir(proc_root).map_err(|e| SampleError::io(proc_root, e))?;
    let mut stats = HashMap::new();
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in entries.flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(stat) = read_stat(proc_root, p)? {
            children.entry(stat.ppid).or_default().push(p);
            stats.insert(p, stat);
        }
    }
    let root = match stats.get(&pid) {
        Some(s) => *s,
        None => root_stat(proc_root, pid)?,
    };
    let mut out = vec![(pid, root)];
    let mut seen = HashSet::from([pid]);
    let mut queue = VecDeque::from([pid]);
    while let Some(parent) = queue.pop_front() {
        for &child in children.get(&parent).map(Vec::as_slice).unwrap_or(&[]) {
            if let (true, Some(stat)) = (seen.insert(child), stats.get(&child)) {
                out.push((child, *stat));
                queue.push_back(child);
            }
        }
    }
    Ok(out)
}

/// CPU utilization of a process tree, relative to `cores` cores (1 by default).
///
/// Not clamped at 1: a multi-threaded service measured against one core reports 3.0
/// when it uses three, which is the truth about its load.
#[derive(Debug)]
pub(crate) struct ProcessCpu {
    proc_root: PathBuf,
    pid: u32,
    start_time: u64,
    cores: f64,
    lookup: ChildLookup,
    prev: Option<(u64, Instant)>,
}

impl ProcessCpu {
    /// Measures the tree rooted at `pid` in `/proc`, against one core.
    pub(crate) fn open(pid: u32) -> Result<Self, SampleError> {
        Self::open_at(Path::new("/proc"), pid)
    }

    /// Measures a tree in a procfs mounted elsewhere (tests, a host `/proc` seen from a
    /// container). Fails now if the process does not exist.
    pub(crate) fn open_at(proc_root: &Path, pid: u32) -> Result<Self, SampleError> {
        let root = root_stat(proc_root, pid)?;
        Ok(ProcessCpu {
            proc_root: proc_root.to_path_buf(),
            pid,
            start_time: root.start_time,
            cores: 1.0,
            lookup: ChildLookup::Auto,
            prev: None,
        })
    }

    /// Measures against `cores` cores instead of one, for a service allowed several.
    #[cfg(test)]
    pub(crate) fn with_cores(mut self, cores: f64) -> Result<Self, SampleError> {
        if !(cores.is_finite() && cores > 0.0) {
            return Err(SampleError::InvalidSpec(format!(
                "process {}: cores must be > 0, not {cores}",
                self.pid
            )));
        }
        self.cores = cores;
        Ok(self)
    }

    /// Chooses how children are found (the default, [`ChildLookup::Auto`], is right
    /// outside tests).
    #[cfg(test)]
    pub(crate) fn with_child_lookup(mut self, lookup: ChildLookup) -> Self {
        self.lookup = lookup;
        self
    }

    /// Total ticks of the tree now, after checking the root is still the same process.
    fn ticks(&self) -> Result<u64, SampleError> {
        let tree = tree(&self.proc_root, self.pid, self.lookup)?;
        let root = tree.first().map(|(_, s)| *s);
        match root {
            Some(r) if r.start_time != self.start_time => Err(SampleError::NotFound(format!(
                "process {}: exited and its pid was reused",
                self.pid
            ))),
            Some(r) if matches!(r.state, 'Z' | 'X') => Err(SampleError::NotFound(format!(
                "process {}: exited (state {})",
                self.pid, r.state
            ))),
            _ => Ok(tree
                .iter()
                .fold(0u64, |acc, (_, s)| acc.saturating_add(s.ticks))),
        }
    }

    /// [`CpuSource::sample`] with an explicit clock, so tests need not sleep.
    fn sample_at(&mut self, now: Instant) -> Result<Option<f64>, SampleError> {
        let ticks = self.ticks()?;
        let Some((prev_ticks, prev_at)) = self.prev else {
            self.prev = Some((ticks, now));
            return Ok(None);
        };
        let wall = now.saturating_duration_since(prev_at).as_secs_f64();
        if wall <= 0.0 {
            return Ok(None);
        }
        self.prev = Some((ticks, now));
        // The total drops when a descendant is re-parented out of the tree (a daemon
        // double-forking) and takes its time with it; that interval reads as 0 rather
        // than as a negative number.
        let used = ticks.saturating_sub(prev_ticks) as f64 / CLOCK_TICKS_PER_SEC;
        Ok(Some(used / (wall * self.cores)))
    }
}

impl CpuSource for ProcessCpu {
    fn sample(&mut self) -> Result<Option<f64>, SampleError> {
        self.sample_at(Instant::now())
    }

    fn describe(&self) -> String {
        format!("process tree {} (/ {} cores)", self.pid, self.cores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::time::Duration;

    fn stat_line(
        pid: u32,
        comm: &str,
        state: char,
        ppid: u32,
        times: [u64; 4],
        start: u64,
    ) -> String {
        let [ut, st, cut, cst] = times;
        format!(
            "{pid} ({comm}) {state} {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 {ut} {st} {cut} {cst} \
             20 0 1 0 {start} 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n"
        )
    }

    struct FakeProc(tempfile::TempDir);

    impl FakeProc {
        fn new() -> Self {
            let p = FakeProc(tempfile::tempdir().unwrap());
            fs::create_dir_all(p.path().join("self")).unwrap();
            p
        }
        fn path(&self) -> &Path {
            self.0.path()
        }
        fn process(&self, pid: u32, ppid: u32, times: [u64; 4]) {
            self.process_full(pid, "svc", 'S', ppid, times, 1000 + u64::from(pid));
        }
        fn process_full(
            &self,
            pid: u32,
            comm: &str,
            state: char,
            ppid: u32,
            times: [u64; 4],
            start: u64,
        ) {
            let dir = self.path().join(pid.to_string());
            fs::create_dir_all(dir.join("task").join(pid.to_string())).unwrap();
            fs::write(
                dir.join("stat"),
                stat_line(pid, comm, state, ppid, times, start),
            )
            .unwrap();
        }
        fn children(&self, pid: u32, tid: u32, kids: &[u32]) {
            let dir = self
                .path()
                .join(pid.to_string())
                .join("task")
                .join(tid.to_string());
            fs::create_dir_all(&dir).unwrap();
            let list: Vec<String> = kids.iter().map(u32::to_string).collect();
            fs::write(dir.join("children"), format!("{} ", list.join(" "))).unwrap();
        }
        /// 100 forks 101 from its main thread and 102 from thread 105; 101 forks 103;
        /// 200 is unrelated; 104 is listed as a child but already exited.
        fn service(&self, root_utime: u64, with_children_files: bool) {
            self.process(1, 0, [0; 4]);
            self.process(100, 1, [root_utime, 5, 0, 0]);
            self.process(101, 100, [10, 0, 0, 0]);
            self.process(102, 100, [20, 0, 0, 0]);
            self.process(103, 101, [1, 2, 3, 4]);
            self.process(200, 1, [1000, 0, 0, 0]);
            if with_children_files {
                self.children(1, 1, &[100, 200]);
                self.children(100, 100, &[101, 104]);
                self.children(100, 105, &[102]);
                self.children(101, 101, &[103]);
                self.children(102, 102, &[]);
                self.children(103, 103, &[]);
                self.children(200, 200, &[]);
            }
        }
    }

    fn pids(tree: &[(u32, ProcStat)]) -> Vec<u32> {
        let mut v: Vec<u32> = tree.iter().map(|(p, _)| *p).collect();
        v[1..].sort_unstable();
        v
    }

    #[test]
    fn parses_stat_with_hostile_command_names() {
        let line = stat_line(7, "a) (b c) S 99 (", 'R', 42, [1, 2, 3, 4], 555);
        let s = parse_stat(&line).unwrap();
        assert_eq!(
            s,
            ProcStat {
                state: 'R',
                ppid: 42,
                ticks: 10,
                own_ticks: 3,
                nice: 0,
                start_time: 555
            }
        );
        assert!(parse_stat("7 (x) S 1 2 3").is_err());
        assert!(parse_stat("no parens at all").is_err());
        let bad = stat_line(7, "x", 'S', 1, [1, 2, 3, 4], 5).replace(" 1 2 3 4 ", " 1 x 3 4 ");
        assert!(parse_stat(&bad).is_err());
    }

    #[test]
    fn tree_by_children_files_and_by_scan_agree() {
        let fake = FakeProc::new();
        fake.service(100, true);
        let by_files = tree(fake.path(), 100, ChildLookup::Auto).unwrap();
        assert_eq!(pids(&by_files), vec![100, 101, 102, 103]);
        let by_scan = tree(fake.path(), 100, ChildLookup::Scan).unwrap();
        assert_eq!(pids(&by_scan), vec![100, 101, 102, 103]);

        let plain = FakeProc::new();
        plain.service(100, false);
        // No children files: Auto falls back to the scan.
        let auto = tree(plain.path(), 100, ChildLookup::Auto).unwrap();
        assert_eq!(pids(&auto), vec![100, 101, 102, 103]);
    }

    #[test]
    fn utilization_of_the_tree_against_cores() {
        for with_files in [true, false] {
            let fake = FakeProc::new();
            fake.service(100, with_files);
            let mut src = ProcessCpu::open_at(fake.path(), 100).unwrap();
            let t0 = Instant::now();
            assert_eq!(src.sample_at(t0).unwrap(), None);
            // 50 ticks (0.5 s) in the root and 25 in the grandchild's reaped children
            // over 1 s; the unrelated process 200 burns 1000 and must not count.
            fake.process(100, 1, [150, 5, 0, 0]);
            fake.process(103, 101, [1, 2, 28, 4]);
            fake.process(200, 1, [2000, 0, 0, 0]);
            let util = src.sample_at(t0 + Duration::from_secs(1)).unwrap().unwrap();
            assert!((util - 0.75).abs() < 1e-9, "{util}");

            let mut src = ProcessCpu::open_at(fake.path(), 100)
                .unwrap()
                .with_cores(2.0)
                .unwrap();
            assert_eq!(src.sample_at(t0).unwrap(), None);
            fake.process(101, 100, [110, 0, 0, 0]);
            let util = src.sample_at(t0 + Duration::from_secs(2)).unwrap().unwrap();
            assert!((util - 0.25).abs() < 1e-9, "{util}");
            assert!(src.describe().contains("100"));
        }
    }

    #[test]
    fn a_child_leaving_the_tree_reads_as_zero_not_negative() {
        let fake = FakeProc::new();
        fake.service(100, false);
        let mut src = ProcessCpu::open_at(fake.path(), 100).unwrap();
        let t0 = Instant::now();
        src.sample_at(t0).unwrap();
        fake.process(102, 1, [20, 0, 0, 0]); // re-parented to init
        let util = src.sample_at(t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(util, Some(0.0));
    }

    #[test]
    fn exited_zombie_or_reused_root_is_an_error() {
        let fake = FakeProc::new();
        fake.service(100, true);
        assert!(matches!(
            ProcessCpu::open_at(fake.path(), 999),
            Err(SampleError::NotFound(_))
        ));
        let mut src = ProcessCpu::open_at(fake.path(), 100).unwrap();
        src.sample().unwrap();

        fake.process_full(100, "svc", 'Z', 1, [0; 4], 1100);
        let err = src.sample().unwrap_err();
        assert!(matches!(err, SampleError::NotFound(_)), "{err}");

        fake.process_full(100, "other", 'S', 1, [0; 4], 99999);
        let err = src.sample().unwrap_err();
        assert!(err.to_string().contains("reused"), "{err}");

        fs::remove_dir_all(fake.path().join("100")).unwrap();
        let err = src.sample().unwrap_err();
        assert!(err.to_string().contains("100"), "{err}");
        assert!(matches!(err, SampleError::NotFound(_)));
    }

    #[test]
    fn cores_must_be_positive() {
        let fake = FakeProc::new();
        fake.service(1, false);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(ProcessCpu::open_at(fake.path(), 100)
                .unwrap()
                .with_cores(bad)
                .is_err());
        }
    }

    /// A real tree: sh → timeout → sh running a busy loop. The measured root (the outer
    /// sh) is idle, so the CPU seen can only come from walking to its grandchild.
    #[test]
    fn real_process_tree_includes_a_busy_grandchild() {
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("timeout 10 sh -c 'while :; do :; done'; true")
            .spawn()
            .unwrap();
        let pid = child.id();
        let proc_root = Path::new("/proc");
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut found = Vec::new();
        while Instant::now() < deadline {
            found = tree(proc_root, pid, ChildLookup::Auto).unwrap();
            if found.len() >= 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let scanned = tree(proc_root, pid, ChildLookup::Scan).unwrap();
        let result = || {
            assert_eq!(pids(&found), pids(&scanned));
            assert!(found.len() >= 3, "tree {found:?}");
            let mut src = ProcessCpu::open(pid).unwrap();
            assert_eq!(src.sample().unwrap(), None);
            let mut scan_src = ProcessCpu::open(pid)
                .unwrap()
                .with_child_lookup(ChildLookup::Scan);
            assert_eq!(scan_src.sample().unwrap(), None);
            // A busy loop is one core. On a loaded machine it may get less in one
            // window: sample until each source has seen it above 0.2 of a core, for up
            // to 8 s, and never more than one core and a half.
            let mut seen = (Vec::new(), Vec::new());
            let until = Instant::now() + Duration::from_secs(8);
            while Instant::now() < until {
                std::thread::sleep(Duration::from_millis(300));
                let util = src.sample().unwrap().unwrap();
                let scan = scan_src.sample().unwrap().unwrap();
                assert!(util < 1.5 && scan < 1.5, "utilization {util}, scan {scan}");
                seen.0.push(util);
                seen.1.push(scan);
                if seen.0.iter().any(|u| *u > 0.2) && seen.1.iter().any(|u| *u > 0.2) {
                    break;
                }
            }
            assert!(
                seen.0.iter().any(|u| *u > 0.2) && seen.1.iter().any(|u| *u > 0.2),
                "the busy grandchild never showed above 0.2 of a core: walked {:?}, \
                 scanned {:?}",
                seen.0,
                seen.1
            );
        };
        let outcome = std::panic::catch_unwind(result);
        // Stop every process this test started, deepest first, by pid.
        for (p, _) in found.iter().rev() {
            let _ = std::process::Command::new("kill")
                .arg(p.to_string())
                .status();
        }
        let _ = child.kill();
        let _ = child.wait();
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
}
