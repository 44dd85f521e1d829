//! The lab's cgroups: one per backend with its CPU quota, under one parent per run that
//! is removed, with every process still in it, when the [`Cgroups`] guard drops —
//! also when the lab panics.
//!
//! Both interfaces are supported and detected:
//! - cgroup v2 (`cgroup.controllers` at the root): `cpu.max`, `cpu.weight`, usage in
//!   `cpu.stat`;
//! - cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` and `cpu.shares` in the `cpu`
//!   hierarchy, usage in `cpuacct`'s `cpuacct.usage`. The two are either co-mounted
//!   (`cpu,cpuacct`) or separate, and a process joins each hierarchy on its own.
//!
//! The agent and the lab's sampler name a group by its path relative to the hierarchies
//! ([`Group::spec`]), which the agent's cgroup source resolves under either layout.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where cgroupfs is mounted.
pub const ROOT: &str = "/sys/fs/cgroup";
/// The CFS period: the kernel's default, and Kubernetes'.
pub const PERIOD_US: u64 = 100_000;
/// Prefix of the lab's parent cgroup; the owning process id follows.
const PREFIX: &str = "ballast-lab-";
/// v1 `cpu.shares` of the lab's parent: ten times a plain process's, so that a compile
/// running beside the lab does not eat into the quotas being measured.
const V1_SHARES: u64 = 10_240;
/// v2 `cpu.weight` of the lab's parent, for the same reason (default 100).
const V2_WEIGHT: u64 = 1_000;

/// Why a cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither a usable v1 nor a v2 `cpu` controller was found.
    #[error("no usable cgroup cpu controller under {0}: {1}")]
    NoController(PathBuf, String),
    /// A cgroupfs file or directory operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io {
        action,
        path,
        source,
    }
}

/// Which interface the machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Per-controller hierarchies: the one holding the CFS quota, the one holding usage.
    V1 {
        /// The `cpu` (or `cpu,cpuacct`) hierarchy.
        cpu: PathBuf,
        /// The `cpuacct` (or `cpu,cpuacct`) hierarchy.
        cpuacct: PathBuf,
    },
    /// The unified hierarchy with the `cpu` controller.
    V2 {
        /// Its root.
        root: PathBuf,
    },
}

impl Layout {
    /// Detects the layout under `root`. v2 needs `cpu` among the root's controllers;
    /// v1 needs a writable CFS quota. A hybrid host (v1 controllers plus an empty
    /// `unified` mount) is v1, which is what enforces quotas there.
    pub fn detect(root: &Path) -> Result<Layout, CgroupError> {
        let controllers = root.join("cgroup.controllers");
        if let Ok(text) = std::fs::read_to_string(&controllers) {
            if text.split_whitespace().any(|c| c == "cpu") {
                return Ok(Layout::V2 {
                    root: root.to_path_buf(),
                });
            }
            return Err(CgroupError::NoController(
                root.to_path_buf(),
                format!("cgroup v2 without the cpu controller ({text:?})"),
            ));
        }
        let find = |names: &[&str], file: &str| {
            names
                .iter()
                .map(|n| root.join(n))
                .find(|d| d.join(file).is_file())
                // `cpu` and `cpuacct` are often symlinks to `cpu,cpuacct`: one directory.
                .map(|d| d.canonicalize().unwrap_or(d))
        };
        let cpu = find(&["cpu", "cpu,cpuacct", "cpuacct,cpu"], "cpu.cfs_quota_us");
        let cpuacct = find(&["cpuacct", "cpu,cpuacct", "cpuacct,cpu"], "cpuacct.usage");
        match (cpu, cpuacct) {
            (Some(cpu), Some(cpuacct)) => Ok(Layout::V1 { cpu, cpuacct }),
            (cpu, acct) => Err(CgroupError::NoController(
                root.to_path_buf(),
                format!("no v2 cgroup.controllers; v1 cpu {cpu:?}, cpuacct {acct:?}"),
            )),
        }
    }

    /// `v1` or `v2`, for the report.
    pub fn name(&self) -> &'static str {
        match self {
            Layout::V1 { cpu, cpuacct } if cpu == cpuacct => "v1 (cpu,cpuacct co-mounted)",
            Layout::V1 { .. } => "v1 (cpu and cpuacct mounted separately)",
            Layout::V2 { .. } => "v2",
        }
    }

    /// The hierarchy roots a group has a directory in (one for v2 or co-mounted v1).
    fn hierarchies(&self) -> Vec<PathBuf> {
        match self {
            Layout::V1 { cpu, cpuacct } if cpu == cpuacct => vec![cpu.clone()],
            Layout::V1 { cpu, cpuacct } => vec![cpu.clone(), cpuacct.clone()],
            Layout::V2 { root } => vec![root.clone()],
        }
    }

    /// The hierarchy root that holds quotas and weights.
    fn cpu_root(&self) -> &Path {
        match self {
            Layout::V1 { cpu, .. } => cpu,
            Layout::V2 { root } => root,
        }
    }
}

/// One cgroup of the lab.
#[derive(Debug, Clone)]
pub struct Group {
    /// Its name under the lab's parent.
    pub name: String,
    /// Its CPU quota in cores; `None`: unlimited.
    pub quota: Option<f64>,
    /// Its path relative to the hierarchies, for `--cpu cgroup:SPEC`.
    pub spec: String,
    /// Its directory in every hierarchy.
    dirs: Vec<PathBuf>,
}

impl Group {
    /// The CPU time its tasks have used, in nanoseconds, from its accounting file
    /// (`cpuacct.usage`, or `cpu.stat`'s `usage_usec`); `None` where unreadable. The lab
    /// reads it itself, to check what the agent makes of it.
    pub fn usage_ns(&self) -> Option<u64> {
        self.dirs.iter().find_map(|d| {
            if let Ok(text) = std::fs::read_to_string(d.join("cpuacct.usage")) {
                return text.trim().parse().ok();
            }
            let text = std::fs::read_to_string(d.join("cpu.stat")).ok()?;
            let usec = text.lines().find_map(|l| l.strip_prefix("usage_usec "))?;
            usec.trim()
                .parse::<u64>()
                .ok()
                .map(|us| us.saturating_mul(1000))
        })
    }
}

/// The lab's parent cgroup and its groups. Dropping it kills what is left in them and
/// removes them.
#[derive(Debug)]
pub struct Cgroups {
    layout: Layout,
    parent: String,
    groups: Vec<Group>,
}

impl Cgroups {
    /// Creates `ballast-lab-PID` under every hierarchy of `layout`, with a CPU weight
    /// above the host's other work. Leftovers of earlier labs whose process is gone are
    /// removed first.
    pub fn create(layout: Layout) -> Result<Cgroups, CgroupError> {
        sweep_stale(&layout);
        let parent = format!("{PREFIX}{}", std::process::id());
        let cg = Cgroups {
            layout,
            parent,
            groups: Vec::new(),
        };
        for h in cg.layout.hierarchies() {
            let dir = h.join(&cg.parent);
            std::fs::create_dir(&dir).map_err(io("create", &dir))?;
        }
        let pdir = cg.layout.cpu_root().join(&cg.parent);
        match &cg.layout {
            Layout::V1 { .. } => write(&pdir.join("cpu.shares"), &V1_SHARES.to_string())?,
            Layout::V2 { root } => {
                // The cpu controller must be delegated down to the groups.
                delegate_cpu(root)?;
                delegate_cpu(&pdir)?;
                write(&pdir.join("cpu.weight"), &V2_WEIGHT.to_string())?;
            }
        }
        Ok(cg)
    }

    /// The layout in use.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Adds a group with a quota of `cores` (`None`: unlimited). A name with a `/` is a
    /// child of a group added before; in v2 its parent then delegates the cpu
    /// controller to it, so that the scheduler splits the parent's quota between its
    /// children by their weights, as in v1.
    pub fn add(&mut self, name: &str, cores: Option<f64>) -> Result<Group, CgroupError> {
        let spec = format!("{}/{name}", self.parent);
        if let (Layout::V2 { root }, Some((up, _))) = (&self.layout, name.rsplit_once('/')) {
            delegate_cpu(&root.join(&self.parent).join(up))?;
        }
        let dirs: Vec<PathBuf> = self
            .layout
            .hierarchies()
            .iter()
            .map(|h| h.join(&spec))
            .collect();
        for d in &dirs {
            std::fs::create_dir(d).map_err(io("create", d))?;
        }
        let group = Group {
            name: name.to_string(),
            quota: cores,
            spec,
            dirs,
        };
        // Registered before the quota is written, so that a failure still removes it.
        self.groups.push(group.clone());
        if let Some(cores) = cores {
            let quota = (cores * PERIOD_US as f64).round() as u64;
            let dir = self.layout.cpu_root().join(&group.spec);
            match self.layout {
                Layout::V1 { .. } => {
                    write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                    write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
                }
                Layout::V2 { .. } => write(&dir.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?,
            }
        }
        Ok(group)
    }

    /// Moves process `pid`, with all its threads, into `group` in every hierarchy.
    pub fn attach(&self, group: &Group, pid: u32) -> Result<(), CgroupError> {
        for d in &group.dirs {
            write(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// Kills every process left in the groups and removes them and the parent.
    /// Returns what could not be removed.
    fn remove_all(&mut self) -> Vec<String> {
        let mut failed = Vec::new();
        for g in self.groups.drain(..).rev() {
            for d in &g.dirs {
                if let Err(e) = empty_and_remove(d) {
                    failed.push(e);
                }
            }
        }
        for h in self.layout.hierarchies() {
            if let Err(e) = empty_and_remove(&h.join(&self.parent)) {
                failed.push(e);
            }
        }
        failed
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for e in self.remove_all() {
            eprintln!("lab cleanup: {e}");
        }
    }
}

/// Delegates v2's cpu controller from `dir` to its children, if it does not already.
fn delegate_cpu(dir: &Path) -> Result<(), CgroupError> {
    let ctl = dir.join("cgroup.subtree_control");
    let now = std::fs::read_to_string(&ctl).map_err(io("read", &ctl))?;
    if now.split_whitespace().any(|c| c == "cpu") {
        return Ok(());
    }
    write(&ctl, "+cpu")
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(io("write", path))
}

/// The process ids in a cgroup directory.
fn procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILLs the processes still in `dir` (the lab's own backends, normally gone by
/// now), waits up to 5 s for them to leave, and removes the directory.
fn empty_and_remove(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = procs(dir);
        if pids.is_empty() {
            break;
        }
        for pid in &pids {
            // SAFETY: plain syscall; the pids are those the lab put in its own cgroup.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{}: processes {pids:?} would not leave",
                dir.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Child groups first (the parent's own directory holds only the groups).
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                empty_and_remove(&e.path())?;
            }
        }
    }
    std::fs::remove_dir(dir).map_err(|e| format!("rmdir {}: {e}", dir.display()))
}

/// Removes the parents of earlier labs whose process no longer exists (a lab killed by
/// SIGKILL cannot clean up after itself; its children died with it through
/// PR_SET_PDEATHSIG, but the directories stay).
fn sweep_stale(layout: &Layout) {
    for h in layout.hierarchies() {
        let Ok(entries) = std::fs::read_dir(&h) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(pid) = name.strip_prefix(PREFIX) else {
                continue;
            };
            if Path::new("/proc").join(pid).exists() {
                continue;
            }
            if let Err(err) = empty_and_remove(&e.path()) {
                eprintln!("lab: cannot remove a stale cgroup: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, file: &str) {
        std::fs::create_dir_all(dir).expect("mkdir");
        std::fs::write(dir.join(file), "").expect("write");
    }

    #[test]
    fn detects_split_and_co_mounted_v1_and_v2() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let r = tmp.path();
        let r = &r.canonicalize().expect("canonical");
        touch(&r.join("cpu"), "cpu.cfs_quota_us");
        touch(&r.join("cpuacct"), "cpuacct.usage");
        touch(&r.join("unified"), "cgroup.procs");
        assert_eq!(
            Layout::detect(r).expect("v1"),
            Layout::V1 {
                cpu: r.join("cpu"),
                cpuacct: r.join("cpuacct")
            }
        );

        let tmp = tempfile::tempdir().expect("tempdir");
        let r = tmp.path();
        let r = &r.canonicalize().expect("canonical");
        touch(&r.join("cpu,cpuacct"), "cpu.cfs_quota_us");
        touch(&r.join("cpu,cpuacct"), "cpuacct.usage");
        std::os::unix::fs::symlink(r.join("cpu,cpuacct"), r.join("cpu")).expect("symlink");
        let l = Layout::detect(r).expect("co-mounted v1");
        assert_eq!(l.hierarchies(), vec![r.join("cpu,cpuacct")]);

        let tmp = tempfile::tempdir().expect("tempdir");
        let r = tmp.path();
        std::fs::write(r.join("cgroup.controllers"), "cpuset cpu io memory pids\n").expect("write");
        assert_eq!(
            Layout::detect(r).expect("v2"),
            Layout::V2 {
                root: r.to_path_buf()
            }
        );
        std::fs::write(r.join("cgroup.controllers"), "memory pids\n").expect("write");
        assert!(Layout::detect(r).is_err(), "v2 without cpu is unusable");

        let tmp = tempfile::tempdir().expect("tempdir");
        assert!(Layout::detect(tmp.path()).is_err());
    }
}
