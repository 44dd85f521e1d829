//! The .deb and .rpm packages, built once per test run by `packaging/build`, and a
//! scratch root to install them into: a copy-on-write overlay of this machine's root in
//! a private mount namespace, where `dpkg -i` runs its maintainer scripts for real and
//! nothing reaches the machine itself.

use crate::harness::process::{binary, run_bounded, AGENT_BIN};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The four package files of one build.
#[derive(Debug, Clone)]
pub struct Packages {
    /// `ballast-agent_VERSION_ARCH.deb`.
    pub agent_deb: PathBuf,
    /// `ballast-aggregator_VERSION_ARCH.deb`.
    pub aggregator_deb: PathBuf,
    /// `ballast-agent-VERSION.ARCH.rpm`.
    pub agent_rpm: PathBuf,
    /// `ballast-aggregator-VERSION.ARCH.rpm`.
    pub aggregator_rpm: PathBuf,
}

/// Fails the test, naming the Debian package or the command that provides it, unless
/// `tool` is on the PATH. The packaging tests need real tools; a missing one is a broken
/// test machine, never a reason to skip.
pub fn require_tool(tool: &str, provided_by: &str) {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "{tool} not found on PATH: the packaging tests run it. Install it with \
         `{provided_by}` (tests/run does)."
    );
}

/// The repository's top directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// The packages of the binaries the tests run (`target/debug`), built by
/// `packaging/build --profile dev --no-build --fast` on the first call and shared by
/// every later one. A file lock keeps test processes from building into the same folder
/// at once.
pub fn packages() -> &'static Packages {
    static BUILT: OnceLock<Packages> = OnceLock::new();
    BUILT.get_or_init(build_packages)
}

fn build_packages() -> Packages {
    require_tool("cargo-deb", "cargo install --locked cargo-deb");
    require_tool(
        "cargo-generate-rpm",
        "cargo install --locked cargo-generate-rpm",
    );
    require_tool("protoc", "apt-get install protobuf-compiler");
    // target/debug/ballast-agent -> target/
    let target = binary(AGENT_BIN)
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("the target directory");
    let out = target.join("packaging").join("test-packages");
    std::fs::create_dir_all(&out).expect("create the packages folder");
    let _lock = FileLock::acquire(&target.join("packaging").join("test-packages.lock"));
    let mut cmd = Command::new(repo_root().join("packaging").join("build"));
    cmd.args(["--profile", "dev", "--no-build", "--fast", "--out"])
        .arg(&out)
        .stdin(Stdio::null());
    let built = run_bounded(cmd, Duration::from_secs(600));
    assert!(
        built.status.success(),
        "packaging/build failed ({}):\n{}\n{}",
        built.status,
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    Packages {
        agent_deb: one_file(&out, "ballast-agent_", ".deb"),
        aggregator_deb: one_file(&out, "ballast-aggregator_", ".deb"),
        agent_rpm: one_file(&out, "ballast-agent-", ".rpm"),
        aggregator_rpm: one_file(&out, "ballast-aggregator-", ".rpm"),
    }
}

/// The one file in `dir` named `prefix…suffix`.
fn one_file(dir: &Path, prefix: &str, suffix: &str) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read the packages folder")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(suffix))
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {prefix}*{suffix} in {}, found {found:?}",
        dir.display()
    );
    found.into_iter().next().expect("one file")
}

/// An exclusive `flock` on a file, released when dropped (or when the process dies).
struct FileLock {
    _file: std::fs::File,
}

impl FileLock {
    fn acquire(path: &Path) -> FileLock {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("cannot open lock file {}: {e}", path.display()));
        // SAFETY: flock on a descriptor this function owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock {}", path.display());
        FileLock { _file: file }
    }
}

/// A throwaway copy of this machine's root filesystem: an overlay whose lower layer is
/// `/` and whose upper layer is a temporary directory, mounted in a private mount
/// namespace held by a helper process, with `/proc`, `/sys` and `/dev` bound in and an
/// empty `/run` (so maintainer scripts see no running systemd and start nothing).
/// Commands run chrooted into it; dropping it kills the helper, which unmounts
/// everything, and deletes the upper layer. Needs root, as the test command runs.
pub struct ScratchRoot {
    helper: Child,
    merged: PathBuf,
    // Last, so that the namespace is gone before its directories are removed.
    _dir: tempfile::TempDir,
}

/// What a command inside a [`ScratchRoot`] gets as its environment: nothing of the
/// test's, so that the host's variables cannot steer the package scripts.
const CHROOT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl ScratchRoot {
    /// Mounts the overlay and waits, at most 20 s, until it is ready.
    pub fn mount() -> ScratchRoot {
        require_tool("unshare", "apt-get install util-linux");
        require_tool("nsenter", "apt-get install util-linux");
        let dir = tempfile::Builder::new()
            .prefix("ballast-root-")
            .tempdir()
            .expect("tempdir");
        let (upper, work, merged) = (
            dir.path().join("upper"),
            dir.path().join("work"),
            dir.path().join("merged"),
        );
        for d in [&upper, &work, &merged] {
            std::fs::create_dir(d).expect("create an overlay directory");
        }
        let script = format!(
            "set -e
             mount -t overlay overlay -o lowerdir=/,upperdir={u},workdir={w} {m}
             mount -t proc proc {m}/proc
             mount --rbind /sys {m}/sys
             mount --rbind /dev {m}/dev
             mount -t tmpfs tmpfs {m}/run
             mount -t tmpfs tmpfs {m}/tmp
             echo ready
             exec sleep 3600",
            u = upper.display(),
            w = work.display(),
            m = merged.display()
        );
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut helper = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start unshare: {e}"));
        let stdout = helper.stdout.take().expect("piped stdout");
        let stderr = helper.stderr.take().expect("piped stderr");
        let lines = crate::harness::process::lines_of(stdout);
        let ready = lines.recv_timeout(Duration::from_secs(20)).as_deref() == Ok("ready");
        let root = ScratchRoot {
            helper,
            merged,
            _dir: dir,
        };
        if !ready {
            drop(root);
            // The helper is dead now, so its stderr ends.
            let mut why = String::new();
            let _ = std::io::Read::read_to_string(&mut { stderr }, &mut why);
            panic!(
                "the scratch root did not mount (an overlay of / in a private mount \
                 namespace needs root and overlayfs): {why}"
            );
        }
        drop(stderr);
        root
    }

    /// A command chrooted into the scratch root, with a minimal environment.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("--target")
            .arg(self.helper.id().to_string())
            .arg("--mount")
            .arg("chroot")
            .arg(&self.merged)
            .arg(program)
            .env_clear()
            .env("PATH", CHROOT_PATH)
            .env("HOME", "/root")
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `args` (program first) inside, at most `timeout`.
    pub fn run(&self, args: &[&str], timeout: Duration) -> Output {
        let mut cmd = self.command(args[0]);
        cmd.args(&args[1..]);
        run_bounded(cmd, timeout)
    }

    /// Runs `args` inside and returns its standard output; panics with both outputs if
    /// it fails.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args, Duration::from_secs(300));
        assert!(
            out.status.success(),
            "{args:?} failed in the scratch root ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Where the scratch root's `path` (absolute inside it) is, seen from the test:
    /// through the helper's view of its mount namespace.
    pub fn host_path(&self, path: &str) -> PathBuf {
        let inside = self.merged.join(path.trim_start_matches('/'));
        PathBuf::from(format!("/proc/{}/root", self.helper.id()))
            .join(inside.strip_prefix("/").unwrap_or(&inside))
    }

    /// Whether `path` exists inside (symbolic links are not followed).
    pub fn exists(&self, path: &str) -> bool {
        self.host_path(path).symlink_metadata().is_ok()
    }

    /// The text of the file at `path` inside.
    pub fn read(&self, path: &str) -> String {
        std::fs::read_to_string(self.host_path(path))
            .unwrap_or_else(|e| panic!("cannot read {path} in the scratch root: {e}"))
    }

    /// Writes `text` to `path` inside.
    pub fn write(&self, path: &str, text: &str) {
        std::fs::write(self.host_path(path), text)
            .unwrap_or_else(|e| panic!("cannot write {path} in the scratch root: {e}"));
    }

    /// Copies a file of the test machine to `path` inside (under `/tmp`, which is the
    /// scratch root's own).
    pub fn copy_in(&self, from: &Path, path: &str) {
        std::fs::copy(from, self.host_path(path)).unwrap_or_else(|e| {
            panic!(
                "cannot copy {} to {path} in the scratch root: {e}",
                from.display()
            )
        });
    }
}

impl Drop for ScratchRoot {
    fn drop(&mut self) {
        let _ = self.helper.kill();
        let _ = self.helper.wait();
    }
}
