//! Child processes: finding the binaries, spawning them with a clean environment and a
//! log file, stopping them, and never leaking one.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The agent binary's name.
pub const AGENT_BIN: &str = "ballast-agent";
/// The aggregator binary's name.
pub const AGGREGATOR_BIN: &str = "ballast-aggregator";
/// The relay binary's name.
pub const RELAY_BIN: &str = "ballast-relay";

/// The path of a workspace binary, next to the test executable:
/// `target/debug/deps/<test>` → `target/debug/<name>`. Panics with the command to run
/// if it has not been built.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's own path");
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} not found: the integration tests run the real binaries. \
         Run `cargo build --workspace --bins` first (the test command does).",
        path.display()
    );
    path
}

/// A command for a workspace binary with an environment that cannot steer it: every
/// `BALLAST_*` variable is removed, logs are plain `info` text, and the child is killed
/// by the kernel if the thread that spawned it dies (a crashed test leaks nothing).
pub fn command(name: &str) -> Command {
    let mut cmd = Command::new(binary(name));
    for (key, _) in std::env::vars_os() {
        // But the performance gates' probe: it reaches only builds with the
        // `gate-probe` feature, and does nothing in any other (tests/gates).
        if key.to_string_lossy().starts_with("BALLAST_") && key != "BALLAST_GATE_PROBE" {
            cmd.env_remove(&key);
        }
    }
    cmd.env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// Runs a command to completion, at most `timeout`; kills it and panics past that.
pub fn run_bounded(mut cmd: Command, timeout: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let what = format!("{cmd:?}");
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.unwrap_or_else(|e| panic!("{what}: {e}")),
        Err(_) => {
            signal(pid, libc::SIGKILL);
            let _ = rx.recv_timeout(Duration::from_secs(5));
            panic!("{what} did not finish within {timeout:?} and was killed");
        }
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: plain syscall on a pid we spawned and have not reaped yet.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// A running child whose stdout and stderr go to a log file. Killed on drop; if the
/// test is panicking, the end of its log is printed first, for the failure report.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    tail_on_panic: usize,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Spawns `cmd` with its output appended to `log`.
    pub fn spawn(mut cmd: Command, name: &str, log: &Path, tail_on_panic: usize) -> Proc {
        let file = File::options()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("cannot open log {}: {e}", log.display()));
        let err = file.try_clone().expect("clone log file handle");
        cmd.stdout(file).stderr(err);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            tail_on_panic,
            exited: None,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Freezes it (SIGSTOP), as a long pause of the machine or the process would.
    pub fn pause(&self) {
        signal(self.pid(), libc::SIGSTOP);
    }

    /// Lets it run again (SIGCONT) after [`Proc::pause`].
    pub fn resume(&self) {
        signal(self.pid(), libc::SIGCONT);
    }

    /// The exit status, if it has exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// SIGTERM, then up to `grace` for it to exit, then SIGKILL. Returns how it ended
    /// and whether it had to be killed.
    pub fn terminate(&mut self, grace: Duration) -> (ExitStatus, bool) {
        if let Some(status) = self.exit_status() {
            return (status, false);
        }
        signal(self.pid(), libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.exit_status() {
                return (status, false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        (self.kill(), true)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.exit_status() {
            return status;
        }
        let _ = self.child.kill();
        let status = self.child.wait().expect("reap a killed child");
        self.exited = Some(status);
        status
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() && self.tail_on_panic > 0 {
            eprintln!(
                "----- last lines of {} ({}) -----\n{}",
                self.name,
                self.log.display(),
                self.log_tail(self.tail_on_panic)
            );
        }
    }
}

/// A turn of this test binary's tests that measure timing: the guard, held for the
/// test, keeps the others holding one waiting. The harness runs a binary's tests on
/// two threads by default; two measurements sharing this machine's two cores measure
/// each other. One lock per test binary (each links its own copy of this crate).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The processes whose parent is `parent`, as `(pid, command)` (the kernel's 15-byte
/// command name). Fails when `/proc` cannot be read, or does not show `parent` itself:
/// an empty list must mean none were found, not that nothing could be looked at.
pub fn children_of(parent: u32) -> Result<Vec<(u32, String)>, String> {
    let parent_s = parent.to_string();
    let entries = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    let mut found = Vec::new();
    let mut seen_parent = false;
    for e in entries {
        let e = e.map_err(|e| format!("/proc: {e}"))?;
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process may exit between the listing and the read: then it is no child.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        seen_parent |= pid == parent;
        // `pid (comm) state ppid ...`; the command may hold spaces and parentheses, so
        // it ends at the last ") ".
        let Some((head, rest)) = stat.rsplit_once(") ") else {
            return Err(format!("/proc/{pid}/stat: {stat:?}"));
        };
        let comm = head.split_once(" (").map_or("", |(_, c)| c);
        if rest.split_whitespace().nth(1) == Some(parent_s.as_str()) {
            found.push((pid, comm.to_string()));
        }
    }
    if !seen_parent {
        return Err(format!(
            "process {parent} is not in /proc: its children cannot be listed"
        ));
    }
    Ok(found)
}

/// The last `lines` lines of a file (at most its last 64 KiB).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The lines a child writes, read on a thread of their own so that a test can wait for
/// them with a bound (`recv_timeout`) instead of blocking on the pipe.
pub fn lines_of(out: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// Sends `request` on a Unix socket and reads the answer until the peer closes, at
/// most `limit` bytes, every step bounded to 5 s. `what` names the peer in errors.
pub fn unix_request(
    socket: &std::path::Path,
    request: &str,
    limit: u64,
    what: &str,
) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|e| format!("{what}: {e}"))?;
    let timeout = Some(std::time::Duration::from_secs(5));
    stream
        .set_read_timeout(timeout)
        .and_then(|_| stream.set_write_timeout(timeout))
        .map_err(|e| format!("{what}: {e}"))?;
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("{what}: {e}"))?;
    let mut out = String::new();
    stream
        .take(limit)
        .read_to_string(&mut out)
        .map_err(|e| format!("{what}: {e}"))?;
    Ok(out)
}

/// A bench's numeric option: the value after `name` among the process's arguments
/// (`-- --agents 500`), or `default`. Panics, naming it, on a value that is no number:
/// a bench is run by hand.
pub fn bench_arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|e| panic!("{name} {v}: {e}")))
        .unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "cargo build --workspace --bins")]
    fn a_missing_binary_says_how_to_build_it() {
        binary("ballast-no-such-binary");
    }

    #[test]
    fn a_child_dies_with_a_panicking_test() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("sleep.log");
        let (tx, rx) = mpsc::channel();
        let joined = std::thread::spawn(move || {
            let mut cmd = Command::new("sleep");
            cmd.arg("60");
            let proc = Proc::spawn(cmd, "sleep", &log, 0);
            tx.send(proc.pid()).expect("send pid");
            panic!("the test fails while the child runs");
        })
        .join();
        assert!(joined.is_err(), "the thread panicked");
        let pid = rx.recv().expect("pid");
        // Killed and reaped: no process, not even a zombie.
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "child {pid} outlived the panic"
        );
    }

    #[test]
    fn run_bounded_kills_what_overruns() {
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        let started = Instant::now();
        let result =
            std::thread::spawn(move || run_bounded(cmd, Duration::from_millis(200))).join();
        assert!(result.is_err(), "an overrun must fail the test");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
