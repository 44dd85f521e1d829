//! A real `ballast-agent run`, reporting to an [`Aggregator`] with the synthetic
//! closed-loop source by default, with its own control socket.

use super::aggregator::Aggregator;
use super::pki::Pki;
use super::process::{command, run_bounded, Proc, AGENT_BIN};
use super::wait::wait_for;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

/// How long a start may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(15);

static NEXT_ADDRESS_PORT: AtomicU16 = AtomicU16::new(20_000);

/// How an agent runs.
#[derive(Debug, Clone)]
pub struct AgentOpts {
    /// `--service`.
    pub service: String,
    /// `--node`: the identity the hello claims.
    pub node: String,
    /// Speed of the synthetic node (0.6 is slow, 1.5 fast).
    pub speed: f64,
    /// Offered utilization at equal weights.
    pub offered: f64,
    /// Relative noise of the synthetic load.
    pub noise: f64,
    /// Seed of the noise.
    pub seed: u64,
    /// `--capacity`.
    pub capacity: u32,
    /// Pass no `--capacity` at all, so that the agent runs with its own default, as
    /// a deployment that leaves it unset does; `capacity` is then unused.
    pub default_capacity: bool,
    /// `--interval-ms`, until the aggregator says otherwise.
    pub interval_ms: u32,
    /// `--inflight`, replacing the synthetic source.
    pub inflight: Option<String>,
    /// `--cpu` (default `none`: the load is the synthetic one alone).
    pub cpu: String,
    /// `--tls-dir`; default: `pki.node_tls_dir(node)`.
    pub tls_dir: Option<PathBuf>,
    /// `--address`; default: a unique `127.0.0.1:PORT` (nothing listens there).
    pub address: Option<String>,
    /// `--zone`.
    pub zone: Option<String>,
    /// `--aggregator`s; default: the aggregator's QUIC address.
    pub aggregators: Option<Vec<String>>,
    /// `--agent-check`: where to answer HAProxy's agent-check; default: nowhere.
    pub agent_check: Option<std::net::SocketAddr>,
    /// `--metrics`: where to serve Prometheus metrics; default: nowhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// `--drain-quiet-ms`; default: the agent's.
    pub drain_quiet_ms: Option<u64>,
    /// `--log-json`.
    pub log_json: bool,
    /// `BALLAST_PROTOCOL`: the protocol versions it offers (`previous` stands for an
    /// agent of the previous release); default: every version this build speaks.
    pub protocol: Option<String>,
}

impl AgentOpts {
    /// Node `node` of `service`, speed 1, offered 0.6, 2 % noise.
    pub fn new(service: &str, node: &str) -> Self {
        AgentOpts {
            service: service.to_string(),
            node: node.to_string(),
            speed: 1.0,
            offered: 0.6,
            noise: 0.02,
            seed: node
                .bytes()
                .fold(7u64, |h, b| h.wrapping_mul(31) ^ u64::from(b)),
            capacity: 1000,
            default_capacity: false,
            interval_ms: 500,
            inflight: None,
            cpu: "none".to_string(),
            tls_dir: None,
            address: None,
            zone: None,
            aggregators: None,
            agent_check: None,
            metrics: None,
            drain_quiet_ms: None,
            log_json: false,
            protocol: None,
        }
    }

    /// Offering only the protocol versions `choice` names (`BALLAST_PROTOCOL`:
    /// `previous`, `current`, `both`).
    pub fn protocol(mut self, choice: &str) -> Self {
        self.protocol = Some(choice.to_string());
        self
    }

    /// With this synthetic speed.
    pub fn speed(mut self, v: f64) -> Self {
        self.speed = v;
        self
    }

    /// With this noise seed.
    pub fn seed(mut self, v: u64) -> Self {
        self.seed = v;
        self
    }

    /// Answering HAProxy's agent-check on `addr` (`--agent-check`).
    pub fn agent_check(mut self, addr: std::net::SocketAddr) -> Self {
        self.agent_check = Some(addr);
        self
    }

    /// Serving Prometheus metrics on `addr` (`--metrics`).
    pub fn metrics(mut self, addr: std::net::SocketAddr) -> Self {
        self.metrics = Some(addr);
        self
    }

    /// Counting established TCP connections on `port` as in flight.
    pub fn inflight_tcp(mut self, port: u16) -> Self {
        self.inflight = Some(format!("tcp:{port}"));
        self
    }

    /// Safe to stop after `ms` with nothing in flight since the drain.
    pub fn drain_quiet_ms(mut self, ms: u64) -> Self {
        self.drain_quiet_ms = Some(ms);
        self
    }

    /// With this TLS directory instead of the node's own.
    pub fn tls_dir(mut self, dir: PathBuf) -> Self {
        self.tls_dir = Some(dir);
        self
    }

    /// The `--inflight` spec this runs with.
    pub fn inflight_spec(&self) -> String {
        self.inflight.clone().unwrap_or_else(|| {
            format!(
                "synthetic:speed={},offered={},noise={},seed={}",
                self.speed, self.offered, self.noise, self.seed
            )
        })
    }
}

/// The agent's status, as `status --json` and the control socket give it: the
/// agent's own type, so that the tests read every field the agent writes.
pub use ballast_agent::status::Status as AgentStatus;

/// An answer on the control socket: the agent's own type.
pub use ballast_agent::control::Response as ControlResponse;

/// A running agent. Killed on drop.
pub struct Agent {
    opts: AgentOpts,
    control: PathBuf,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

impl Agent {
    /// Spawns the process without waiting for it.
    fn spawn(pki: &Pki, agg: &Aggregator, mut opts: AgentOpts) -> Agent {
        // The address the aggregator sees the agent connect from: loopback, or the
        // test's side of the link to the aggregator's network namespace. Fixed here,
        // so that a restart keeps it.
        let host = agg
            .opts()
            .netns
            .as_ref()
            .map_or(Ipv4Addr::LOCALHOST, |ns| ns.host_ip());
        opts.address.get_or_insert_with(|| {
            format!(
                "{host}:{}",
                NEXT_ADDRESS_PORT.fetch_add(1, Ordering::Relaxed)
            )
        });
        // Short path: a Unix socket path must fit in 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("bal-")
            .tempdir()
            .expect("temporary directory for the agent");
        let control = dir.path().join("ctl.sock");
        let proc = Self::spawn_process(pki, agg, &opts, dir.path(), &control);
        Agent {
            opts,
            control,
            proc: Some(proc),
            dir,
        }
    }

    /// Starts `ballast-agent run` for `opts` with its control socket (and so its
    /// drain file) in `dir`.
    fn spawn_process(
        pki: &Pki,
        agg: &Aggregator,
        opts: &AgentOpts,
        dir: &Path,
        control: &Path,
    ) -> Proc {
        let tls_dir = opts
            .tls_dir
            .clone()
            .unwrap_or_else(|| pki.node_tls_dir_for(&opts.node, &[&opts.service]));
        let address = opts.address.clone().unwrap_or_default();
        let aggregators = opts
            .aggregators
            .clone()
            .unwrap_or_else(|| vec![agg.quic_addr().to_string()]);
        let mut cmd = command(AGENT_BIN);
        cmd.arg("run")
            .args(["--service", &opts.service])
            .args(["--node", &opts.node])
            .args(["--address", &address])
            .args(["--aggregator", &aggregators.join(",")])
            .args(["--cpu", &opts.cpu])
            .args(["--inflight", &opts.inflight_spec()])
            .args(["--interval-ms", &opts.interval_ms.to_string()])
            .arg("--tls-dir")
            .arg(&tls_dir)
            .arg("--control")
            .arg(control);
        if !opts.default_capacity {
            cmd.args(["--capacity", &opts.capacity.to_string()]);
        }
        if let Some(zone) = &opts.zone {
            cmd.args(["--zone", zone]);
        }
        if agg.opts().netns.is_some() {
            // The server certificate names localhost, not the namespace's address.
            cmd.args(["--server-name", "localhost"]);
        }
        if let Some(addr) = opts.agent_check {
            cmd.args(["--agent-check", &addr.to_string()]);
        }
        if let Some(addr) = opts.metrics {
            cmd.args(["--metrics", &addr.to_string()]);
        }
        if let Some(ms) = opts.drain_quiet_ms {
            cmd.args(["--drain-quiet-ms", &ms.to_string()]);
        }
        if opts.log_json {
            cmd.arg("--log-json");
        }
        if let Some(choice) = &opts.protocol {
            cmd.env("BALLAST_PROTOCOL", choice);
        }
        // One log per run, so that a restart keeps the first run's log.
        let mut n = 0;
        let log = loop {
            let log = dir.join(format!("agent-{n}.log"));
            if !log.exists() {
                break log;
            }
            n += 1;
        };
        let name = format!("ballast-agent {}", opts.node);
        Proc::spawn(cmd, &name, &log, 8)
    }

    /// Starts the agent again after [`Agent::stop`], with the same options and
    /// directory (so the same control socket and drain file), and waits until its
    /// control socket answers.
    pub fn restart(&mut self, pki: &Pki, agg: &Aggregator) {
        assert!(self.proc.is_none(), "the agent is still running");
        let proc = Self::spawn_process(pki, agg, &self.opts, self.dir.path(), &self.control);
        self.proc = Some(proc);
        self.wait_ready();
    }

    /// Starts an agent for `opts.node` reporting to `agg`, and waits until its control
    /// socket answers. It need not connect: see [`Agent::wait_weight`].
    pub fn start(pki: &Pki, agg: &Aggregator, opts: AgentOpts) -> Agent {
        let mut agent = Self::spawn(pki, agg, opts);
        agent.wait_ready();
        agent
    }

    /// Waits until the control socket answers; panics if the process exits first.
    fn wait_ready(&mut self) {
        let what = format!("ballast-agent {}'s control socket", self.opts.node);
        wait_for(START_TIMEOUT, &what, || {
            let proc = self.proc.as_mut().expect("process");
            if let Some(status) = proc.exit_status() {
                panic!(
                    "ballast-agent {} exited at start ({status}):\n{}",
                    self.opts.node,
                    proc.log_tail(20)
                );
            }
            self.try_control("status").map(|_| ())
        });
    }

    /// Freezes it (SIGSTOP): an agent wedged on its host, silent but not gone.
    pub fn pause(&self) {
        self.proc.as_ref().expect("the agent is running").pause();
    }

    /// Lets it run again (SIGCONT) after [`Agent::pause`].
    pub fn resume(&self) {
        self.proc.as_ref().expect("the agent is running").resume();
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(|p| p.pid())
    }

    /// The address it registers (`--address`).
    pub fn address(&self) -> &str {
        self.opts.address.as_deref().unwrap_or_default()
    }

    /// Its options.
    pub fn opts(&self) -> &AgentOpts {
        &self.opts
    }

    /// The node it claims to be.
    pub fn node(&self) -> &str {
        &self.opts.node
    }

    /// Its control socket.
    pub fn control_path(&self) -> &Path {
        &self.control
    }

    /// Its temporary directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::is_running)
    }

    /// SIGTERM, then SIGKILL after `grace`. Returns the exit status and whether it had
    /// to be killed.
    pub fn stop(&mut self, grace: Duration) -> (ExitStatus, bool) {
        self.proc
            .take()
            .expect("the agent is not running")
            .terminate(grace)
    }

    /// SIGKILL: the agent dies without a word to anyone. Returns its exit status.
    pub fn kill(&mut self) -> ExitStatus {
        self.proc.take().expect("the agent is not running").kill()
    }

    /// The end of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc
            .as_ref()
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// One request straight on the control socket (`status`, `drain`, `undrain`).
    pub fn try_control(&self, cmd: &str) -> Result<ControlResponse, String> {
        let what = format!("control socket {}", self.control.display());
        let request = format!("{{\"cmd\":\"{cmd}\"}}\n");
        let line = super::process::unix_request(&self.control, &request, 1 << 20, &what)?;
        serde_json::from_str(&line).map_err(|e| format!("{what}: {e}: {line:?}"))
    }

    /// The status, from the control socket.
    pub fn status(&self) -> AgentStatus {
        let resp = self
            .try_control("status")
            .unwrap_or_else(|e| panic!("{}: {e}", self.opts.node));
        assert!(resp.ok, "status refused: {resp:?}");
        resp.status.expect("status in the answer")
    }

    /// Runs `ballast-agent ARGS --control SOCKET` (the operator's CLI), bounded in time.
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut cmd = command(AGENT_BIN);
        cmd.args(args).arg("--control").arg(&self.control);
        run_bounded(cmd, Duration::from_secs(20))
    }

    /// Runs `ballast-agent CMD --control SOCKET --json` and parses the answer; panics
    /// unless it exits 0 with `ok: true`.
    pub fn cli_json(&self, cmd: &str) -> ControlResponse {
        let out = self.cli(&[cmd, "--json"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`ballast-agent {cmd} --json` failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let resp: ControlResponse = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("`{cmd} --json` printed no valid answer: {e}: {stdout}"));
        assert!(resp.ok, "`{cmd}` answered not ok: {resp:?}");
        resp
    }

    /// `ballast-agent drain` through the CLI.
    pub fn drain(&self) -> ControlResponse {
        self.cli_json("drain")
    }

    /// `ballast-agent undrain` through the CLI.
    pub fn undrain(&self) -> ControlResponse {
        self.cli_json("undrain")
    }

    /// Waits until the agent is connected and holds a weight; returns that status.
    pub fn wait_weight(&self, timeout: Duration) -> AgentStatus {
        wait_for(
            timeout,
            &format!("agent {} to connect and receive a weight", self.opts.node),
            || {
                let s = self.status();
                if s.connected_to.is_some() && s.weight.is_some() {
                    Ok(s)
                } else {
                    Err(format!("{s:?}"))
                }
            },
        )
    }
}

/// The agent-check's answer on `addr`, as HAProxy reads it: connect, read until the
/// agent closes (at most 256 bytes), each step within `timeout`.
pub fn agent_check_reply(addr: std::net::SocketAddr, timeout: Duration) -> Result<String, String> {
    use std::io::Read;
    let s = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    s.take(256)
        .read_to_string(&mut line)
        .map_err(|e| format!("read {addr}: {e}"))?;
    Ok(line)
}

/// Starts `n` agents of `service`, nodes `{service}-00`…, with speeds taken in turn
/// from `speeds` and seeds 0, 1, …
pub fn start_fleet(
    pki: &Pki,
    agg: &Aggregator,
    service: &str,
    n: usize,
    speeds: &[f64],
) -> Vec<Agent> {
    let nodes: Vec<String> = (0..n).map(|i| format!("{service}-{i:02}")).collect();
    pki.issue_nodes_for(
        service,
        &nodes.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // Spawn them all, then wait: the fleet comes up together.
    let mut agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let opts = AgentOpts::new(service, node)
                .speed(speeds[i % speeds.len()])
                .seed(i as u64);
            Agent::spawn(pki, agg, opts)
        })
        .collect();
    for a in &mut agents {
        a.wait_ready();
    }
    agents
}
