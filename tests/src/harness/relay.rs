//! A real `ballast-relay` on 127.0.0.1 (or, asked for, the same relay started by its
//! old name, `ballast-aggregator relay`): agents connect to it as to an
//! aggregator, and it hands their reports on to the replicas that own their services.

use super::aggregator::Aggregator;
use super::api::{parse_metrics, sum_samples};
use super::pki::Pki;
use super::ports;
use super::process::{command, Proc, AGGREGATOR_BIN, RELAY_BIN};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// How long a start may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a graceful stop may take before the process is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// How a relay runs: the cluster it serves and its name.
#[derive(Debug, Clone)]
pub struct RelayOpts {
    /// `--name`, which its certificate also names.
    pub name: String,
    /// `--replica`, each: the replicas it learns the routes from.
    pub replicas: Vec<String>,
    /// Extra TOML for `--config` (e.g. a `[relay]` table).
    pub config_toml: Option<String>,
    /// `BALLAST_PROTOCOL`: the agent protocol versions it accepts; default: every
    /// version.
    pub protocol: Option<String>,
    /// Started as `ballast-aggregator relay` (deprecated) rather than `ballast-relay`.
    pub aggregator_alias: bool,
}

impl RelayOpts {
    /// Relay `name`, told of the replicas `replicas` (any of a cluster's will do: it
    /// learns the others from them).
    pub fn new(name: &str, replicas: &[&Aggregator]) -> Self {
        Self::at(
            name,
            replicas.iter().map(|r| r.quic_addr().to_string()).collect(),
        )
    }

    /// Relay `name`, told of the replicas at `addresses` (`host:port`).
    pub fn at(name: &str, addresses: Vec<String>) -> Self {
        RelayOpts {
            name: name.to_string(),
            replicas: addresses,
            config_toml: None,
            protocol: None,
            aggregator_alias: false,
        }
    }

    /// Accepting only the agent protocol versions `choice` names.
    pub fn protocol(mut self, choice: &str) -> Self {
        self.protocol = Some(choice.to_string());
        self
    }

    /// Started by the relay's old name, `ballast-aggregator relay`.
    pub fn aggregator_alias(mut self) -> Self {
        self.aggregator_alias = true;
        self
    }

    /// With this TOML as its config file.
    pub fn config(mut self, toml: &str) -> Self {
        self.config_toml = Some(toml.to_string());
        self
    }
}

/// A running relay. Killed on drop.
pub struct Relay {
    opts: RelayOpts,
    quic: SocketAddr,
    http: SocketAddr,
    http_client: reqwest::blocking::Client,
    runs: u32,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

impl Relay {
    /// Starts a relay with the aggregator's server identity from `pki` for its agents
    /// and a relay certificate of its own name for its trunks, on free loopback ports,
    /// and waits until `/healthz` says it is a relay.
    pub fn start(pki: &Pki, opts: RelayOpts) -> Relay {
        let dir = tempfile::Builder::new()
            .prefix("ballast-relay-")
            .tempdir()
            .expect("temporary directory for the relay");
        let http_client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy()
            .build()
            .expect("HTTP client");
        let mut relay = Relay {
            opts,
            quic: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            http: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            http_client,
            runs: 0,
            proc: None,
            dir,
        };
        let mut last = String::new();
        for _ in 0..5 {
            relay.quic = SocketAddr::from((Ipv4Addr::LOCALHOST, ports::free_udp()));
            relay.http = SocketAddr::from((Ipv4Addr::LOCALHOST, ports::free_tcp()));
            match relay.launch(pki) {
                Ok(()) => return relay,
                Err((status, log)) if log.contains("cannot bind") => {
                    last = format!("{status}: {log}");
                }
                Err((status, log)) => {
                    panic!("the relay exited during start ({status}):\n{log}")
                }
            }
        }
        panic!("the relay could not bind free ports in 5 attempts; last: {last}");
    }

    fn launch(&mut self, pki: &Pki) -> Result<(), (ExitStatus, String)> {
        self.runs += 1;
        let log = self.dir.path().join(format!("relay-{}.log", self.runs));
        let (mut cmd, program) = if self.opts.aggregator_alias {
            let mut cmd = command(AGGREGATOR_BIN);
            cmd.arg("relay");
            (cmd, "ballast-aggregator relay")
        } else {
            (command(RELAY_BIN), "ballast-relay")
        };
        cmd.arg("--quic")
            .arg(self.quic.to_string())
            .arg("--http")
            .arg(self.http.to_string())
            .arg("--tls-dir")
            .arg(pki.server_tls_dir())
            .arg("--relay-tls-dir")
            .arg(pki.relay_tls_dir(&self.opts.name))
            .args(["--name", &self.opts.name]);
        for replica in &self.opts.replicas {
            cmd.args(["--replica", replica]);
        }
        if let Some(toml) = &self.opts.config_toml {
            let path = self.dir.path().join("relay.toml");
            std::fs::write(&path, toml).expect("write relay.toml");
            cmd.arg("--config").arg(path);
        }
        if let Some(choice) = &self.opts.protocol {
            cmd.env("BALLAST_PROTOCOL", choice);
        }
        let name = format!("{program} {}", self.opts.name);
        let mut proc = Proc::spawn(cmd, &name, &log, 40);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = proc.exit_status() {
                return Err((status, proc.log_tail(20)));
            }
            if let Ok(v) = self.try_healthz() {
                if v["role"] == "relay" && v["name"] == self.opts.name.as_str() {
                    self.proc = Some(proc);
                    return Ok(());
                }
            }
            assert!(
                Instant::now() < deadline,
                "the relay did not answer /healthz on {} within {START_TIMEOUT:?}; log:\n{}",
                self.http,
                proc.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.opts.name
    }

    /// The QUIC address agents dial.
    pub fn quic_addr(&self) -> SocketAddr {
        self.quic
    }

    /// The HTTP address of its metrics and health.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    fn try_get(&self, path: &str) -> Result<(u16, String), String> {
        let url = format!("http://{}{path}", self.http);
        let resp = self
            .http_client
            .get(&url)
            .send()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp.text().map_err(|e| format!("GET {url}: body: {e}"))?;
        Ok((status, body))
    }

    /// `GET /healthz` as JSON, whatever its status.
    pub fn try_healthz(&self) -> Result<serde_json::Value, String> {
        let (_, body) = self.try_get("/healthz")?;
        serde_json::from_str(&body).map_err(|e| format!("/healthz: {e}: {body}"))
    }

    /// `GET /healthz` as JSON. Panics if it does not answer.
    pub fn healthz(&self) -> serde_json::Value {
        self.try_healthz().unwrap_or_else(|e| panic!("{e}"))
    }

    /// `GET /metrics` as text.
    pub fn metrics(&self) -> String {
        let (status, body) = self.try_get("/metrics").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 200, "GET /metrics: {body}");
        body
    }

    /// The sum of the samples of `name` whose labels include `labels`; 0 if none.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sum_samples(&parse_metrics(&self.metrics()), name, labels)
    }

    /// Stops the process gracefully (SIGTERM; SIGKILL after 10 s).
    pub fn stop(&mut self) -> (ExitStatus, bool) {
        let mut proc = self.proc.take().expect("the relay is not running");
        proc.terminate(STOP_GRACE)
    }

    /// Kills the process (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.kill();
        }
    }

    /// The last lines of its current log.
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc
            .as_ref()
            .map_or_else(String::new, |p| p.log_tail(lines))
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.proc.take();
    }
}
