//! A real single-member etcd (Debian's `etcd-server` package) on free 127.0.0.1 ports
//! with a temporary data directory, `etcdctl` (`etcd-client`) to read keys, and a
//! `etcdctl watch` child that records every event. Each is killed on drop.

use super::ports;
use super::process::{run_bounded, Proc};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian installs the server.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// Where Debian installs the client.
pub const ETCDCTL_BIN: &str = "/usr/bin/etcdctl";
/// How long a start may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Fails the test, naming the packages, unless etcd and etcdctl are installed.
pub fn require_etcd() {
    for (bin, package) in [(ETCD_BIN, "etcd-server"), (ETCDCTL_BIN, "etcd-client")] {
        assert!(
            Path::new(bin).is_file(),
            "{bin} not found: the etcd tests run the real etcd. Install Debian's package \
             `{package}` (`apt-get install etcd-server etcd-client`; tests/run does)."
        );
    }
}

/// A command for an etcd binary: no stdin, no inherited `ETCD*` settings, and killed by
/// the kernel if the test thread that started it dies.
fn etcd_command(bin: &str) -> Command {
    let mut cmd = Command::new(bin);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("ETCD") {
            cmd.env_remove(&key);
        }
    }
    cmd.env("ETCDCTL_API", "3").stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// A running etcd. Killed on drop.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    runs: u32,
    http: reqwest::blocking::Client,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until `/health` says it is healthy.
    pub fn start() -> Etcd {
        require_etcd();
        let dir = tempfile::Builder::new()
            .prefix("ballast-etcd-")
            .tempdir()
            .expect("temporary directory for etcd");
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .no_proxy()
            .build()
            .expect("HTTP client");
        let mut etcd = Etcd {
            client_port: 0,
            peer_port: 0,
            runs: 0,
            http,
            proc: None,
            dir,
        };
        // A port picked free can be taken before etcd binds it: then try others.
        let mut last = String::new();
        for _ in 0..5 {
            etcd.client_port = ports::free_tcp();
            etcd.peer_port = ports::free_tcp();
            match etcd.launch() {
                Ok(()) => return etcd,
                Err(log) if log.contains("address already in use") => last = log,
                Err(log) => panic!("etcd exited during start:\n{log}"),
            }
        }
        panic!("etcd could not bind free ports in 5 attempts; last:\n{last}");
    }

    fn launch(&mut self) -> Result<(), String> {
        self.runs += 1;
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = etcd_command(ETCD_BIN);
        cmd.args(["--name", "ballast-test"])
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("ballast-test={peer}")])
            .args(["--logger", "zap", "--log-outputs", "stderr"]);
        let log = self.dir.path().join(format!("etcd-{}.log", self.runs));
        let mut proc = Proc::spawn(cmd, "etcd", &log, 20);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = proc.exit_status() {
                return Err(format!("{status}: {}", proc.log_tail(20)));
            }
            if self.healthy() {
                self.proc = Some(proc);
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy on {} within {START_TIMEOUT:?}; log:\n{}",
                self.endpoint(),
                proc.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn healthy(&self) -> bool {
        self.http
            .get(format!("{}/health", self.endpoint()))
            .send()
            .and_then(|r| r.json::<serde_json::Value>())
            .is_ok_and(|v| v["health"] == "true")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The client URL, e.g. `http://127.0.0.1:23790`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills etcd (SIGKILL), as a crash or a partition would look to its clients.
    pub fn kill(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.kill();
        }
    }

    /// Starts etcd again on the same ports and data directory, after [`Etcd::kill`].
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "etcd is still running");
        // The kernel may take a moment to let go of the ports.
        let mut last = String::new();
        for _ in 0..10 {
            match self.launch() {
                Ok(()) => return,
                Err(log) if log.contains("address already in use") => {
                    last = log;
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(log) => panic!("etcd exited during restart:\n{log}"),
            }
        }
        panic!("etcd could not bind its old ports again:\n{last}");
    }

    /// `etcdctl ARGS` against this etcd, bounded in time; its stdout, or why it failed.
    pub fn try_ctl(&self, args: &[&str]) -> Result<String, String> {
        let mut cmd = etcd_command(ETCDCTL_BIN);
        cmd.args(["--endpoints", &self.endpoint(), "--command-timeout", "3s"])
            .args(args);
        let out = run_bounded(cmd, Duration::from_secs(15));
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "etcdctl {args:?}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// The value of `key`, `None` if it does not exist. Panics if etcd does not answer.
    pub fn get(&self, key: &str) -> Option<String> {
        let out = self
            .try_ctl(&["get", key, "--print-value-only"])
            .unwrap_or_else(|e| panic!("{e}"));
        let value = out.trim_end_matches('\n');
        (!value.is_empty()).then(|| value.to_string())
    }

    /// Watches every key under `prefix` from the first revision on, so that no event is
    /// missed however late the watcher starts.
    pub fn watch(&self, prefix: &str) -> Watch {
        let out = self.dir.path().join(format!("watch-{}.out", self.runs));
        let err = self.dir.path().join(format!("watch-{}.err", self.runs));
        let mut cmd = etcd_command(ETCDCTL_BIN);
        cmd.args([
            "--endpoints",
            &self.endpoint(),
            "watch",
            "--prefix",
            "--rev",
            "1",
        ])
        .arg(prefix)
        .stdout(File::create(&out).expect("watch output file"))
        .stderr(File::create(&err).expect("watch error file"));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcdctl watch: {e}"));
        Watch { child, out, err }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.proc.take();
    }
}

/// One watch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// `PUT` or `DELETE`.
    pub kind: String,
    /// The key.
    pub key: String,
    /// The new value (empty for a delete).
    pub value: String,
}

/// A running `etcdctl watch`. Killed on drop.
pub struct Watch {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Watch {
    /// Every event printed so far. etcdctl prints each as three lines: the kind, the
    /// key and the value; a partly written last event is left for the next call.
    pub fn events(&self) -> Vec<WatchEvent> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let complete = match text.rfind('\n') {
            Some(i) => &text[..=i],
            None => "",
        };
        let lines: Vec<&str> = complete.lines().collect();
        let mut events = Vec::new();
        let mut i = 0;
        while i + 3 <= lines.len() {
            let kind = lines[i];
            if kind == "PUT" || kind == "DELETE" {
                events.push(WatchEvent {
                    kind: kind.to_string(),
                    key: lines[i + 1].to_string(),
                    value: lines[i + 2].to_string(),
                });
                i += 3;
            } else {
                i += 1;
            }
        }
        events
    }

    /// What etcdctl wrote to stderr, for failure messages.
    pub fn errors(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Whether the watcher is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
