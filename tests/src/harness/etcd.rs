//! A real single-member etcd (Debian's `etcd-server` package) on free 127.0.0.1 ports
//! with a temporary data directory, `etcdctl` (`etcd-client`) to read keys, and a
//! `etcdctl watch` child that records every event. Each is killed on drop.
//!
//! [`Etcd::start_tls`] starts it secured as production would run it: `https://` with a
//! server certificate, client certificates required (`--client-cert-auth`) and checked
//! against a CA (`--trusted-ca-file`), all made here by the project's own CA code
//! ([`Ca`]). [`Etcd::enable_auth`] then turns on user authentication, and
//! [`Etcd::add_user`] adds a user who may read and write one prefix. The harness's own
//! `etcdctl` calls present a client certificate and, once authentication is on, log in
//! as root. Health is checked on a separate plain-HTTP metrics port, so that it does not
//! need the client certificate.

use super::ports;
use super::process::{run_bounded, Proc};
use ballast_shared::pki::Ca;
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

/// The TLS files of a secured etcd ([`Etcd::start_tls`]), all PEM.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The CA that signed etcd's server certificate and the client certificates.
    pub ca: PathBuf,
    /// etcd's server certificate (for 127.0.0.1 and localhost) and key.
    pub server_cert: PathBuf,
    /// The server certificate's key.
    pub server_key: PathBuf,
    /// A client certificate etcd accepts, for an aggregator.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// The client certificate the harness's `etcdctl` presents.
    ctl_cert: PathBuf,
    ctl_key: PathBuf,
}

impl EtcdTls {
    /// Makes a CA, a server certificate and two client certificates in `dir`.
    fn generate(dir: &Path) -> EtcdTls {
        std::fs::create_dir_all(dir).expect("etcd TLS directory");
        let ca = Ca::generate("ballast test etcd CA").expect("etcd CA");
        std::fs::write(dir.join("ca.pem"), ca.pem().cert).expect("write the etcd CA");
        ca.issue_server(&["127.0.0.1".to_string(), "localhost".to_string()])
            .expect("etcd server certificate")
            .write(dir, "server")
            .expect("write the etcd server certificate");
        for name in ["aggregator", "etcdctl"] {
            ca.issue_node(&format!("ballast-{name}"), &[])
                .expect("etcd client certificate")
                .pem
                .write(dir, name)
                .expect("write an etcd client certificate");
        }
        EtcdTls {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("aggregator.pem"),
            client_key: dir.join("aggregator.key"),
            ctl_cert: dir.join("etcdctl.pem"),
            ctl_key: dir.join("etcdctl.key"),
        }
    }
}

/// A running etcd. Killed on drop.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    runs: u32,
    tls: Option<EtcdTls>,
    /// root's password, once authentication is enabled.
    root_password: Option<String>,
    /// A second address clients may reach it on (a network namespace's link).
    also_on: Option<std::net::Ipv4Addr>,
    /// Flags added to every launch from the next one on: see [`Etcd::restart_with`].
    extra_args: Vec<String>,
    http: reqwest::blocking::Client,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd on free loopback ports (`http://`) and waits until `/health` says
    /// it is healthy.
    pub fn start() -> Etcd {
        Self::start_with(false)
    }

    /// Starts etcd secured: `https://` with a server certificate from a CA made for it,
    /// and client certificates from that CA required (`--cert-file`, `--key-file`,
    /// `--client-cert-auth`, `--trusted-ca-file`). See [`Etcd::tls`].
    pub fn start_tls() -> Etcd {
        Self::start_with(true)
    }

    /// Starts etcd like [`Etcd::start`], listening for clients on `ip` too (the
    /// test's side of a network namespace's link): see [`Etcd::endpoint_on`].
    pub fn start_also_on(ip: std::net::Ipv4Addr) -> Etcd {
        Self::start_on(false, Some(ip))
    }

    fn start_with(tls: bool) -> Etcd {
        Self::start_on(tls, None)
    }

    fn start_on(tls: bool, also_on: Option<std::net::Ipv4Addr>) -> Etcd {
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
        let tls = tls.then(|| EtcdTls::generate(&dir.path().join("tls")));
        let mut etcd = Etcd {
            client_port: 0,
            peer_port: 0,
            metrics_port: 0,
            runs: 0,
            tls,
            root_password: None,
            also_on,
            extra_args: Vec::new(),
            http,
            proc: None,
            dir,
        };
        // A port picked free can be taken before etcd binds it: then try others.
        let mut last = String::new();
        for _ in 0..5 {
            etcd.client_port = ports::free_tcp();
            etcd.peer_port = ports::free_tcp();
            etcd.metrics_port = ports::free_tcp();
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
        let client = match self.also_on {
            Some(ip) => format!("{},{}", self.endpoint(), self.endpoint_on(ip)),
            None => self.endpoint(),
        };
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
            .args(["--listen-metrics-urls", &self.metrics_url()])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .args(&self.extra_args);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&tls.ca);
        }
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

    fn metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.metrics_port)
    }

    fn healthy(&self) -> bool {
        self.http
            .get(format!("{}/health", self.metrics_url()))
            .send()
            .and_then(|r| r.json::<serde_json::Value>())
            .is_ok_and(|v| v["health"] == "true")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The client URL on `ip`, for an etcd started with [`Etcd::start_also_on`].
    pub fn endpoint_on(&self, ip: std::net::Ipv4Addr) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{ip}:{}", self.client_port)
    }

    /// The etcd client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The client URL, e.g. `http://127.0.0.1:23790`, or `https://` when secured.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The TLS files of an etcd started with [`Etcd::start_tls`]; panics otherwise.
    pub fn tls(&self) -> &EtcdTls {
        self.tls
            .as_ref()
            .expect("this etcd was started without TLS (Etcd::start_tls)")
    }

    /// Where a test may write files beside this etcd's (e.g. a password file).
    pub fn scratch_dir(&self) -> &Path {
        self.dir.path()
    }

    /// An `etcdctl` command for this etcd: its endpoint, a bounded command time, and
    /// when secured a client certificate, and root's login once authentication is on.
    fn ctl_command(&self) -> Command {
        let mut cmd = etcd_command(ETCDCTL_BIN);
        cmd.args(["--endpoints", &self.endpoint()]);
        if let Some(tls) = &self.tls {
            cmd.arg("--cacert")
                .arg(&tls.ca)
                .arg("--cert")
                .arg(&tls.ctl_cert)
                .arg("--key")
                .arg(&tls.ctl_key);
        }
        if let Some(password) = &self.root_password {
            cmd.arg("--user").arg(format!("root:{password}"));
        }
        cmd
    }

    /// `etcdctl ARGS`, panicking with its output unless it succeeds.
    fn must_ctl(&self, args: &[&str]) -> String {
        self.try_ctl(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Turns on etcd's authentication (`user add root`, `auth enable`), root having
    /// `root_password`; the harness's own calls log in as root from then on.
    pub fn enable_auth(&mut self, root_password: &str) {
        self.must_ctl(&[
            "user",
            "add",
            "root",
            "--interactive=false",
            "--new-user-password",
            root_password,
        ]);
        self.must_ctl(&["auth", "enable"]);
        self.root_password = Some(root_password.to_string());
        // Each call now logs in: check that root can.
        self.must_ctl(&["user", "list"]);
    }

    /// Adds user `user` with `password`, allowed to read and write the keys under
    /// `prefix` and nothing else (a role of the same name).
    pub fn add_user(&self, user: &str, password: &str, prefix: &str) {
        self.add_user_allowed(user, password, "readwrite", prefix);
    }

    /// Adds user `user` with `password`, allowed only to read the keys under `prefix`
    /// (a role of the same name), as `docs/security.md` has a relay's.
    pub fn add_reader(&self, user: &str, password: &str, prefix: &str) {
        self.add_user_allowed(user, password, "read", prefix);
    }

    /// `etcdctl ARGS` logged in as `user` rather than root, bounded in time; its
    /// stdout, or why it failed (etcd's refusal among them).
    pub fn try_ctl_as(&self, user: &str, password: &str, args: &[&str]) -> Result<String, String> {
        let mut cmd = etcd_command(ETCDCTL_BIN);
        cmd.args(["--endpoints", &self.endpoint()]);
        if let Some(tls) = &self.tls {
            cmd.arg("--cacert").arg(&tls.ca);
        }
        cmd.arg("--user")
            .arg(format!("{user}:{password}"))
            .args(["--command-timeout", "3s"])
            .args(args);
        let out = run_bounded(cmd, Duration::from_secs(15));
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn add_user_allowed(&self, user: &str, password: &str, permission: &str, prefix: &str) {
        self.must_ctl(&[
            "user",
            "add",
            user,
            "--interactive=false",
            "--new-user-password",
            password,
        ]);
        self.must_ctl(&["role", "add", user]);
        self.must_ctl(&[
            "role",
            "grant-permission",
            user,
            "--prefix=true",
            permission,
            prefix,
        ]);
        self.must_ctl(&["user", "grant-role", user, user]);
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

    /// Starts etcd again, after [`Etcd::kill`], with `args` added to its flags (and
    /// those of any earlier call dropped): `--max-request-bytes 4194304`, say.
    pub fn restart_with(&mut self, args: &[&str]) {
        self.extra_args = args.iter().map(|a| a.to_string()).collect();
        self.restart();
    }

    /// Puts `value` at `key` with `etcdctl put`, the value read from its standard input
    /// (a value of megabytes does not fit in an argument); panics if etcd refuses it.
    pub fn put_large(&self, key: &str, value: &[u8]) {
        let file = self.dir.path().join("put-large.value");
        std::fs::write(&file, value).expect("write the value to put");
        let mut cmd = self.ctl_command();
        cmd.args(["--command-timeout", "10s", "put", key])
            .stdin(std::fs::File::open(&file).expect("open the value to put"));
        let out = run_bounded(cmd, Duration::from_secs(30));
        assert!(
            out.status.success(),
            "etcdctl put {key} ({} bytes): {}: {}",
            value.len(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `etcdctl ARGS` against this etcd, bounded in time; its stdout, or why it failed.
    pub fn try_ctl(&self, args: &[&str]) -> Result<String, String> {
        let mut cmd = self.ctl_command();
        cmd.args(["--command-timeout", "3s"]).args(args);
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

    /// Service `service`'s value under `prefix` as the aggregator stored it, whole: the
    /// key's value, or, when it holds a manifest, its chunks joined (read with
    /// `etcdctl` as any tool would). `Err` when the service is not stored, or when its
    /// chunks do not make its value (a write between the two reads replaced them:
    /// read again).
    pub fn get_service(&self, prefix: &str, service: &str) -> Result<String, String> {
        use ballast_aggregator::store::chunks;
        let value = self
            .get(&format!("{prefix}/services/{service}"))
            .ok_or_else(|| format!("{service} is not stored"))?;
        let Some(manifest) = chunks::Manifest::parse(value.as_bytes()) else {
            return Ok(value);
        };
        let range = chunks::generation_prefix(prefix, service, &manifest.generation);
        // Compact JSON holds no newline: each line is one chunk's value.
        let out = self.try_ctl(&["get", "--prefix", &range, "--print-value-only"])?;
        let pieces: Vec<Vec<u8>> = out.lines().map(|l| l.as_bytes().to_vec()).collect();
        let whole = chunks::assemble(&manifest, &pieces).map_err(|e| e.to_string())?;
        String::from_utf8(whole).map_err(|e| format!("{service}: {e}"))
    }

    /// Watches every key under `prefix` from the first revision on, so that no event is
    /// missed however late the watcher starts.
    pub fn watch(&self, prefix: &str) -> Watch {
        let out = self.dir.path().join(format!("watch-{}.out", self.runs));
        let err = self.dir.path().join(format!("watch-{}.err", self.runs));
        let mut cmd = self.ctl_command();
        cmd.args(["watch", "--prefix", "--rev", "1"])
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

/// A service value of `n` endpoints as the store writes it, with weights of full
/// precision like the controllers'.
pub fn snapshot_value(n: usize, version: u64) -> Vec<u8> {
    use ballast_balance::{EndpointSnapshot, ServiceSnapshot, Strategy};
    let endpoints = (0..n)
        .map(|i| {
            // Mean about 1, every one a long decimal, as converged weights are.
            let weight = 0.75 + (i % 997) as f64 / 1994.0 + 1e-9 * (i % 7) as f64;
            (
                format!("n-{i:06}"),
                EndpointSnapshot {
                    address: format!("10.{}.{}.{}:8080", i >> 16, (i >> 8) & 255, i & 255),
                    zone: String::new(),
                    draining: false,
                    weight,
                    strategy_weights: [(Strategy::Pid, weight)].into_iter().collect(),
                },
            )
        })
        .collect();
    serde_json::to_vec(&ServiceSnapshot {
        version,
        cycle: version,
        endpoints,
        operator: Default::default(),
    })
    .expect("encode a snapshot")
}

/// The fewest endpoints whose value is at least `bytes`.
pub fn endpoints_for(bytes: usize) -> usize {
    let per = snapshot_value(1000, 7).len() / 1000;
    let mut n = bytes / per;
    while snapshot_value(n, 7).len() < bytes {
        n += n / 100 + 1;
    }
    n
}
