//! The CPU time a cgroup's niced processes used, to count as idle.
//!
//! Batch work at `nice -n 19` yields to the service: the scheduler gives an ordinary
//! task some seventy times a niced one's share, so a niced loop in the service's cgroup
//! takes only what the service leaves. It still fills the cgroup's quota, and the
//! cgroup's usage counter cannot tell its time from the service's: read as load, it
//! would take the node's traffic away while the service has all the CPU it wants. The
//! host source leaves niced time out through `/proc/stat`'s nice column; this is the
//! same rule for a cgroup, from its members' `/proc/PID/stat`.
//!
//! The members are the pids in `cgroup.procs` of the cgroup and of its descendants
//! (their usage is in the cgroup's counter too). The service is taken to be the least
//! niced members: a member counts as idle when it is niced above 0 and above them, so a
//! service that itself runs niced, alone in its cgroup, is still its load. Both files
//! are world-readable, so the agent needs no privilege; pids it cannot see (`hidepid`)
//! count as load, as before. A small cgroup is listed every sample; a large one (many
//! members or many descendant cgroups) every [`LARGE_RESCAN`] samples, with only its
//! niced members read in between, so that a cgroup of a whole slice does not cost a
//! read of every process's stat each second. The niceness is the process's (its main
//! thread's); a thread niced on its own counts as load. A member's own time counts
//! (`utime` and `stime`), not its reaped children's: a niced child's time was counted
//! while it ran, and a parent's `cutime` would count it again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::process::{read_stat, ProcStat, CLOCK_TICKS_PER_SEC};

/// A cgroup with more members or descendant cgroups than this is listed every
/// [`LARGE_RESCAN`] samples rather than every sample.
const SMALL_CGROUP: usize = 64;
/// Samples between listings of a large cgroup.
const LARGE_RESCAN: u32 = 10;
/// Descendant cgroups walked at most; deeper trees' extra members count as load.
const MAX_GROUPS: usize = 256;
/// Members read at most per listing, and niced ones tracked at most: bounds the memory
/// and the cost whatever the cgroup holds.
const MAX_MEMBERS: usize = 4096;

/// A niced member's last reading.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    start_time: u64,
    ticks: u64,
}

/// The niced members of a cgroup and their CPU time.
#[derive(Debug)]
pub(crate) struct NicedTime {
    proc_root: PathBuf,
    group: PathBuf,
    tracked: HashMap<u32, Tracked>,
    /// Members and cgroups at the last listing, whichever is more.
    members: usize,
    /// The smallest nice value among them, at least 0: members niced above it yield
    /// to the rest.
    least_nice: i64,
    since_listing: u32,
}

impl NicedTime {
    /// Tracks the niced members of the cgroup at `group` (a directory with
    /// `cgroup.procs`), reading their stats under `proc_root`.
    pub(crate) fn new(proc_root: &Path, group: &Path) -> Self {
        NicedTime {
            proc_root: proc_root.to_path_buf(),
            group: group.to_path_buf(),
            tracked: HashMap::new(),
            members: 0,
            least_nice: 0,
            since_listing: u32::MAX,
        }
    }

    /// Niced processes being followed now.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.tracked.len()
    }

    /// The CPU time, in nanoseconds, that members niced above the least niced ones
    /// (and above 0) used since the last call. A member first seen now has no time yet;
    /// one that exited or was renamed takes its last interval with it (counted as load,
    /// the safe side).
    pub(crate) fn since_last(&mut self) -> u64 {
        self.since_listing = self.since_listing.saturating_add(1);
        let list = self.members <= SMALL_CGROUP || self.since_listing >= LARGE_RESCAN;
        let stats: Vec<(u32, ProcStat)> = if list {
            self.since_listing = 0;
            let (pids, groups) = self.members();
            self.members = pids.len().max(groups);
            let stats: Vec<(u32, ProcStat)> = pids
                .into_iter()
                .filter_map(|pid| self.read(pid).map(|s| (pid, s)))
                .collect();
            // The least niced members are the service: a service that itself runs
            // niced, alone in its cgroup, is its load.
            self.least_nice = stats.iter().map(|(_, s)| s.nice).min().unwrap_or(0).max(0);
            stats
        } else {
            self.tracked
                .keys()
                .filter_map(|&pid| self.read(pid).map(|s| (pid, s)))
                .collect()
        };
        let mut ticks = 0u64;
        let mut next = HashMap::new();
        for (pid, stat) in stats {
            if stat.nice <= self.least_nice || next.len() >= MAX_MEMBERS {
                continue;
            }
            if let Some(before) = self.tracked.get(&pid) {
                if before.start_time == stat.start_time {
                    ticks = ticks.saturating_add(stat.own_ticks.saturating_sub(before.ticks));
                }
            }
            next.insert(
                pid,
                Tracked {
                    start_time: stat.start_time,
                    ticks: stat.own_ticks,
                },
            );
        }
        self.tracked = next;
        // Whole ticks to nanoseconds: 100 ticks a second, 10 ms each.
        (ticks as f64 * 1e9 / CLOCK_TICKS_PER_SEC) as u64
    }

    /// A member's stat; `None` when it is gone, unreadable or not a stat line (a
    /// member the agent cannot read counts as load).
    fn read(&self, pid: u32) -> Option<ProcStat> {
        read_stat(&self.proc_root, pid)
            .ok()
            .flatten()
            .filter(|s| !matches!(s.state, 'Z' | 'X'))
    }

    /// The pids in the cgroup and its descendants, at most [`MAX_MEMBERS`] (read no
    /// further), and the cgroups walked, at most [`MAX_GROUPS`]. A list that cannot be
    /// read has no members: its processes' time counts as load, and a removed cgroup
    /// fails on its usage counter, which the caller reads first.
    fn members(&self) -> (Vec<u32>, usize) {
        let mut pids = Vec::new();
        read_procs(&self.group.join("cgroup.procs"), &mut pids);
        let mut groups = 1usize;
        let mut queue = vec![self.group.clone()];
        'walk: while let Some(dir) = queue.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if groups >= MAX_GROUPS || pids.len() >= MAX_MEMBERS {
                    break 'walk;
                }
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                groups += 1;
                read_procs(&entry.path().join("cgroup.procs"), &mut pids);
                queue.push(entry.path());
            }
        }
        (pids, groups)
    }
}

/// Appends the pids of a `cgroup.procs`, one a line, until `pids` holds
/// [`MAX_MEMBERS`]; lines that are not a pid are skipped, an unreadable file adds none.
fn read_procs(path: &Path, pids: &mut Vec<u32>) {
    use std::io::BufRead as _;
    let Ok(file) = std::fs::File::open(path) else {
        return;
    };
    for line in std::io::BufReader::new(file).lines() {
        if pids.len() >= MAX_MEMBERS {
            return;
        }
        let Ok(line) = line else { return };
        if let Ok(pid) = line.trim().parse::<u32>() {
            pids.push(pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A `/proc/PID/stat` line with the given nice value, ticks and start time.
    fn stat(pid: u32, nice: i64, ticks: u64, start: u64) -> String {
        stat_reaped(pid, nice, ticks, 0, start)
    }

    /// The same with `reaped` ticks of reaped children (`cutime`).
    fn stat_reaped(pid: u32, nice: i64, ticks: u64, reaped: u64, start: u64) -> String {
        format!(
            "{pid} (x) R 1 {pid} {pid} 0 -1 4194560 100 0 0 0 {ticks} 0 {reaped} 0 {} {nice} 1 0 \
             {start} 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n",
            20 + nice
        )
    }

    struct Fake {
        dir: tempfile::TempDir,
    }

    impl Fake {
        fn new() -> Fake {
            let f = Fake {
                dir: tempfile::tempdir().unwrap(),
            };
            fs::create_dir_all(f.group()).unwrap();
            fs::write(f.group().join("cgroup.procs"), "").unwrap();
            f
        }
        fn proc_root(&self) -> PathBuf {
            self.dir.path().join("proc")
        }
        fn group(&self) -> PathBuf {
            self.dir.path().join("cg/web")
        }
        fn process(&self, pid: u32, nice: i64, ticks: u64, start: u64) {
            let d = self.proc_root().join(pid.to_string());
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("stat"), stat(pid, nice, ticks, start)).unwrap();
        }
        fn members(&self, sub: &str, pids: &[u32]) {
            let d = self.group().join(sub);
            fs::create_dir_all(&d).unwrap();
            let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
            fs::write(d.join("cgroup.procs"), text).unwrap();
        }
    }

    const TICK_NS: u64 = 10_000_000;

    #[test]
    fn only_niced_members_time_counts_from_their_second_reading() {
        let f = Fake::new();
        f.process(10, 0, 500, 1); // the service
        f.process(11, 19, 100, 2); // a batch job
        f.process(12, 5, 40, 3); // a niced one in a child cgroup
        f.process(13, -5, 40, 4); // a favoured one: load
        f.members("", &[10, 11]);
        f.members("sidecar", &[12, 13]);
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        assert_eq!(n.since_last(), 0, "a first reading has no interval");
        assert_eq!(n.tracked(), 2);
        f.process(10, 0, 900, 1);
        f.process(11, 19, 160, 2);
        f.process(12, 5, 45, 3);
        f.process(13, -5, 90, 4);
        assert_eq!(n.since_last(), 65 * TICK_NS);
    }

    #[test]
    fn a_member_that_exits_or_whose_pid_is_reused_adds_nothing() {
        let f = Fake::new();
        f.process(11, 19, 100, 2);
        f.process(12, 19, 100, 3);
        f.process(10, 0, 100, 1);
        f.members("", &[10, 11, 12]);
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        n.since_last();
        fs::remove_dir_all(f.proc_root().join("11")).unwrap();
        f.process(12, 19, 50, 9); // reused: another process, fewer ticks
        assert_eq!(n.since_last(), 0);
        f.process(12, 19, 80, 9);
        assert_eq!(n.since_last(), 30 * TICK_NS);
    }

    /// A niced child's time counts while it runs; when it exits, its parent's `cutime`
    /// takes its whole life, which must not count again.
    #[test]
    fn a_reaped_niced_child_is_not_counted_twice() {
        let f = Fake::new();
        f.process(10, 0, 100, 1);
        f.process(11, 19, 100, 2); // make
        f.process(12, 19, 50, 3); // its compiler
        f.members("", &[10, 11, 12]);
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        n.since_last();
        f.process(12, 19, 80, 3);
        assert_eq!(n.since_last(), 30 * TICK_NS);
        // The compiler exits after 10 more ticks; make reaps its 90.
        fs::remove_dir_all(f.proc_root().join("12")).unwrap();
        f.members("", &[10, 11]);
        let make = stat_reaped(11, 19, 100, 90, 2);
        fs::write(f.proc_root().join("11/stat"), make).unwrap();
        assert_eq!(n.since_last(), 0);
    }

    #[test]
    fn the_members_read_are_bounded() {
        let f = Fake::new();
        let text: String = (1..=MAX_MEMBERS as u32 + 500)
            .map(|p| format!("{p}\n"))
            .collect();
        fs::write(f.group().join("cgroup.procs"), text).unwrap();
        let n = NicedTime::new(&f.proc_root(), &f.group());
        let (pids, groups) = n.members();
        assert_eq!((pids.len(), groups), (MAX_MEMBERS, 1));
    }

    #[test]
    fn a_service_that_runs_niced_is_load_and_yields_to_nothing_niced_alike() {
        let f = Fake::new();
        f.process(10, 10, 100, 1); // the service, niced
        f.process(11, 10, 100, 2); // its worker, as niced
        f.process(12, 19, 100, 3); // a batch job niced further
        f.members("", &[10, 11, 12]);
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        n.since_last();
        assert_eq!(n.tracked(), 1);
        f.process(10, 10, 200, 1);
        f.process(11, 10, 200, 2);
        f.process(12, 19, 150, 3);
        assert_eq!(n.since_last(), 50 * TICK_NS);
        // The batch job gone, the niced service alone is all load.
        f.members("", &[10, 11]);
        f.process(10, 10, 300, 1);
        assert_eq!(n.since_last(), 0);
        assert_eq!(n.tracked(), 0);
    }

    #[test]
    fn a_large_cgroup_is_listed_every_few_samples() {
        let f = Fake::new();
        let pids: Vec<u32> = (100..100 + SMALL_CGROUP as u32 + 1).collect();
        for &p in &pids {
            f.process(p, 0, 0, u64::from(p));
        }
        f.members("", &pids);
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        n.since_last();
        // A member niced after the listing is seen at the next one, not before.
        f.process(100, 19, 10, 100);
        for _ in 1..LARGE_RESCAN {
            n.since_last();
            assert_eq!(n.tracked(), 0);
        }
        n.since_last();
        assert_eq!(n.tracked(), 1);
        f.process(100, 19, 30, 100);
        assert_eq!(n.since_last(), 20 * TICK_NS);
    }

    #[test]
    fn junk_and_a_missing_list_add_nothing() {
        let f = Fake::new();
        fs::write(f.group().join("cgroup.procs"), "x\n\n42\n").unwrap();
        fs::create_dir_all(f.proc_root().join("42")).unwrap();
        fs::write(f.proc_root().join("42/stat"), "not a stat line").unwrap();
        let mut n = NicedTime::new(&f.proc_root(), &f.group());
        assert_eq!(n.since_last(), 0);
        assert_eq!(n.tracked(), 0);
        fs::remove_dir_all(f.group()).unwrap();
        assert_eq!(n.since_last(), 0);
    }
}
