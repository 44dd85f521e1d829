//! A real `ballast-aggregator run` on 127.0.0.1, with its own ports, store and log.

use super::api::{
    parse_health, parse_metrics, sum_samples, ConfigView, EndpointView, ErrorBody, Health,
    HealthStatus, MetricSample, Published, ServiceDetail, ServiceSummary, WeightSet,
};
use super::netns::Netns;
use super::pki::Pki;
use super::ports;
use super::process::{command, run_bounded, Proc, AGGREGATOR_BIN};
pub use ballast_aggregator::config::XdsTls;
use serde::de::DeserializeOwned;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a start may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a graceful stop may take before the process is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Where an xDS client connects, and how it checks the server.
#[derive(Debug, Clone)]
pub struct XdsTarget {
    /// The ADS port.
    pub addr: SocketAddr,
    /// The CA that signed the server's certificate, for TLS; `None` for plaintext.
    pub ca: Option<PathBuf>,
    /// The client's own certificate and key, for mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl XdsTarget {
    /// The server name to check its certificate for: the harness's server certificate
    /// names localhost.
    pub const SERVER_NAME: &'static str = "localhost";

    /// A tonic channel to it, over TLS unless the port is plaintext.
    pub async fn channel(&self) -> Result<tonic::transport::Channel, String> {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", self.addr))
            .map_err(|e| e.to_string())?;
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        if let Some(ca) = &self.ca {
            let mut tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(read(ca)?))
                .domain_name(Self::SERVER_NAME);
            if let Some((cert, key)) = &self.client {
                tls = tls.identity(tonic::transport::Identity::from_pem(
                    read(cert)?,
                    read(key)?,
                ));
            }
            endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
        }
        endpoint
            .connect()
            .await
            .map_err(|e| format!("connect to xDS at {}: {e:?}", self.addr))
    }
}

/// How the aggregator runs.
#[derive(Debug, Clone)]
pub struct AggregatorOpts {
    /// `--cycle-ms`.
    pub cycle_ms: u64,
    /// `--grace-ms`.
    pub grace_ms: u64,
    /// `--report-interval-ms`.
    pub report_interval_ms: u32,
    /// Extra TOML for `--config` (e.g. a `[balance]` table); flags still win.
    pub config_toml: Option<String>,
    /// `--xds` on a free loopback port.
    pub xds: bool,
    /// `--xds-tls`, always passed. The harness's default is `tls` (server
    /// certificate only), which the tests' clients use unless they ask for more; the
    /// shipped default is `mutual`.
    pub xds_tls: XdsTls,
    /// `--agent-check` on a free port of its address: HAProxy's agent-check answered
    /// by the aggregator.
    pub agent_check: bool,
    /// `--etcd ENDPOINTS --etcd-prefix PREFIX`: weights in etcd instead of the file.
    pub etcd: Option<(String, String)>,
    /// `--config-dir`: the per-service config directory, watched live.
    pub config_dir: Option<PathBuf>,
    /// `--log-json`.
    pub log_json: bool,
    /// Run inside this network namespace, on its address instead of 127.0.0.1, so
    /// that a test can drop packets on their way to it (see [`Netns`]).
    pub netns: Option<Arc<Netns>>,
    /// `--cluster NAME --replica REPLICA`: one replica of a cluster (needs `etcd`).
    pub cluster: Option<(String, String)>,
    /// `BALLAST_PROTOCOL`: the agent protocol versions it accepts (`previous` stands
    /// for an aggregator of the previous release); default: every version.
    pub protocol: Option<String>,
    /// The authorization policy file's text (`[authorization] policy`), written next
    /// to the aggregator's other files; joined with any `[authorization]` table of
    /// `config_toml`.
    pub policy_toml: Option<String>,
    /// How the harness reads an API served over TLS (`[http_tls]` in `config_toml`):
    /// none for plain HTTP. Without it, an aggregator in a namespace is started with
    /// `--insecure-http`, its API being on an address other than loopback.
    pub api: Option<ApiAccess>,
}

/// How the harness reaches an HTTPS API: the CA its certificate is checked against,
/// and the credential the harness's own requests carry.
#[derive(Debug, Clone)]
pub struct ApiAccess {
    /// The CA certificate (PEM) of the API's server certificate.
    pub ca: PathBuf,
    /// A bearer token sent with every request of the harness.
    pub token: Option<String>,
}

impl ApiAccess {
    /// A blocking client that trusts `ca` alone and sends `token`.
    pub fn client(&self) -> reqwest::blocking::Client {
        self.builder().build().expect("HTTPS client")
    }

    /// The builder of [`ApiAccess::client`], for a test to add to (a client
    /// certificate, say).
    pub fn builder(&self) -> reqwest::blocking::ClientBuilder {
        let pem = std::fs::read(&self.ca).expect("read the API's CA");
        let mut builder = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("CA PEM"));
        if let Some(token) = &self.token {
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(
                reqwest::header::AUTHORIZATION,
                format!("Bearer {token}").parse().expect("header"),
            );
            builder = builder.default_headers(headers);
        }
        builder
    }
}

impl Default for AggregatorOpts {
    fn default() -> Self {
        AggregatorOpts {
            cycle_ms: 500,
            grace_ms: 1000,
            report_interval_ms: 500,
            config_toml: None,
            xds: false,
            xds_tls: XdsTls::Tls,
            agent_check: false,
            etcd: None,
            config_dir: None,
            log_json: false,
            netns: None,
            cluster: None,
            protocol: None,
            policy_toml: None,
            api: None,
        }
    }
}

impl AggregatorOpts {
    /// Inside `ns`.
    pub fn netns(mut self, ns: &Arc<Netns>) -> Self {
        self.netns = Some(Arc::clone(ns));
        self
    }

    /// With this cycle length.
    pub fn cycle_ms(mut self, v: u64) -> Self {
        self.cycle_ms = v;
        self
    }

    /// With this start-up grace period.
    pub fn grace_ms(mut self, v: u64) -> Self {
        self.grace_ms = v;
        self
    }

    /// With this report interval for agents.
    pub fn report_interval_ms(mut self, v: u32) -> Self {
        self.report_interval_ms = v;
        self
    }

    /// With a per-service config directory.
    pub fn config_dir(mut self, dir: &Path) -> Self {
        self.config_dir = Some(dir.to_path_buf());
        self
    }

    /// With the etcd routing store at `endpoints` (comma-separated) under `prefix`.
    pub fn etcd(mut self, endpoints: &str, prefix: &str) -> Self {
        self.etcd = Some((endpoints.to_string(), prefix.to_string()));
        self
    }

    /// Accepting only the agent protocol versions `choice` names
    /// (`BALLAST_PROTOCOL`: `previous`, `current`, `both`).
    pub fn protocol(mut self, choice: &str) -> Self {
        self.protocol = Some(choice.to_string());
        self
    }

    /// With the policy `policy` (the text of its file).
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy_toml = Some(policy.to_string());
        self
    }

    /// Accepting the trunks of the relays whose certificates match `patterns` (the
    /// policy's `relays`; without it no relay is accepted).
    pub fn relays(self, patterns: &[&str]) -> Self {
        let list: Vec<String> = patterns.iter().map(|p| format!("{p:?}")).collect();
        self.policy(&format!("relays = [{}]\n", list.join(", ")))
    }

    /// As replica `replica` of cluster `name` (with [`AggregatorOpts::etcd`]).
    pub fn cluster(mut self, name: &str, replica: &str) -> Self {
        self.cluster = Some((name.to_string(), replica.to_string()));
        self
    }
}

/// A running aggregator. Killed on drop.
pub struct Aggregator {
    opts: AggregatorOpts,
    tls_dir: PathBuf,
    quic: SocketAddr,
    http: SocketAddr,
    xds: Option<SocketAddr>,
    agent_check: Option<SocketAddr>,
    store: PathBuf,
    runs: u32,
    http_client: reqwest::blocking::Client,
    proc: Option<Proc>,
    // Last, so that the process is gone before its directory is removed.
    dir: tempfile::TempDir,
}

/// Why a start attempt failed.
enum StartError {
    /// The process exited; its log says why.
    Exited(ExitStatus, String),
}

impl Aggregator {
    /// Starts an aggregator with TLS from `pki` on free loopback ports, and waits until
    /// `/healthz` answers from it.
    pub fn start(pki: &Pki, opts: AggregatorOpts) -> Aggregator {
        let dir = tempfile::Builder::new()
            .prefix("ballast-agg-")
            .tempdir()
            .expect("temporary directory for the aggregator");
        let http_client = match &opts.api {
            Some(api) => api.client(),
            None => reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("HTTP client"),
        };
        let mut agg = Aggregator {
            opts,
            tls_dir: pki.server_tls_dir(),
            quic: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            xds: None,
            agent_check: None,
            store: dir.path().join("weights.json"),
            runs: 0,
            http_client,
            proc: None,
            dir,
        };
        // A port picked free can be taken by another process before the child binds it:
        // then try other ports.
        let mut last = String::new();
        let ip = agg
            .opts
            .netns
            .as_ref()
            .map_or(Ipv4Addr::LOCALHOST, |ns| ns.ip());
        for _ in 0..5 {
            agg.quic = SocketAddr::from((ip, ports::free_udp()));
            agg.http = SocketAddr::from((ip, ports::free_tcp()));
            let xds = agg.opts.xds;
            agg.xds = xds.then(|| SocketAddr::from((ip, ports::free_tcp())));
            let agent_check = agg.opts.agent_check;
            agg.agent_check = agent_check.then(|| SocketAddr::from((ip, ports::free_tcp())));
            match agg.launch() {
                Ok(()) => return agg,
                Err(StartError::Exited(status, log)) if log.contains("cannot bind") => {
                    last = format!("{status}: {log}");
                }
                Err(StartError::Exited(status, log)) => {
                    panic!("ballast-aggregator exited during start ({status}):\n{log}")
                }
            }
        }
        panic!("ballast-aggregator could not bind free ports in 5 attempts; last: {last}");
    }

    fn launch(&mut self) -> Result<(), StartError> {
        self.runs += 1;
        let log = self
            .dir
            .path()
            .join(format!("aggregator-{}.log", self.runs));
        let mut cmd = command(AGGREGATOR_BIN);
        // In a namespace, QUIC listens on every address of it, so that a test can cut
        // off the agents that dial one address and not those that dial the other.
        let quic_bind = match &self.opts.netns {
            Some(_) => SocketAddr::from(([0, 0, 0, 0], self.quic.port())),
            None => self.quic,
        };
        cmd.arg("run")
            .arg("--quic")
            .arg(quic_bind.to_string())
            .arg("--http")
            .arg(self.http.to_string())
            .arg("--tls-dir")
            .arg(&self.tls_dir)
            .arg("--store")
            .arg(&self.store)
            .arg("--cycle-ms")
            .arg(self.opts.cycle_ms.to_string())
            .arg("--grace-ms")
            .arg(self.opts.grace_ms.to_string())
            .arg("--report-interval-ms")
            .arg(self.opts.report_interval_ms.to_string());
        if let Some(xds) = self.xds {
            cmd.arg("--xds").arg(xds.to_string());
            let mode = match self.opts.xds_tls {
                XdsTls::Tls => "tls",
                XdsTls::Mutual => "mutual",
                XdsTls::Plaintext => "plaintext",
            };
            cmd.args(["--xds-tls", mode]);
        }
        if let Some(addr) = self.agent_check {
            cmd.arg("--agent-check").arg(addr.to_string());
        }
        if let Some((endpoints, prefix)) = &self.opts.etcd {
            cmd.args(["--etcd", endpoints, "--etcd-prefix", prefix]);
        }
        if let Some((name, replica)) = &self.opts.cluster {
            cmd.args(["--cluster", name, "--replica", replica]);
        }
        if let Some(dir) = &self.opts.config_dir {
            cmd.arg("--config-dir").arg(dir);
        }
        if self.opts.log_json {
            cmd.arg("--log-json");
        }
        let mut toml = self.opts.config_toml.clone();
        if let Some(policy) = &self.opts.policy_toml {
            let path = self.dir.path().join("policy.toml");
            std::fs::write(&path, policy).expect("write policy.toml");
            let line = format!("policy = {path:?}\n");
            let text = toml.unwrap_or_default();
            toml = Some(match text.find("[authorization]\n") {
                Some(at) => {
                    let end = at + "[authorization]\n".len();
                    format!("{}{line}{}", &text[..end], &text[end..])
                }
                None => format!("{text}\n[authorization]\n{line}"),
            });
        }
        if let Some(toml) = &toml {
            let path = self.dir.path().join("aggregator.toml");
            std::fs::write(&path, toml).expect("write aggregator.toml");
            cmd.arg("--config").arg(path);
        }
        if let Some(choice) = &self.opts.protocol {
            cmd.env("BALLAST_PROTOCOL", choice);
        }
        if let Some(ns) = &self.opts.netns {
            if self.opts.api.is_none() {
                cmd.arg("--insecure-http");
            }
            ns.enter(&mut cmd);
        }
        let mut proc = Proc::spawn(cmd, "ballast-aggregator", &log, 40);
        let deadline = Instant::now() + START_TIMEOUT;
        let want_store = match &self.opts.etcd {
            Some((endpoints, prefix)) => format!("etcd {endpoints} {prefix}"),
            None => self.store.display().to_string(),
        };
        loop {
            if let Some(status) = proc.exit_status() {
                return Err(StartError::Exited(status, proc.log_tail(20)));
            }
            // The health check names the store, which tells our process from any other
            // that might answer on this port.
            // If another process holds the port, ours exits with "cannot bind" and the
            // check above sees it.
            if let Ok(v) = self.try_health() {
                let ours = v.store.ends_with(&want_store);
                if ours && proc.is_running() {
                    assert_eq!(v.status, HealthStatus::Ok, "healthz: {v:?}");
                    self.proc = Some(proc);
                    return Ok(());
                }
            }
            assert!(
                Instant::now() < deadline,
                "ballast-aggregator did not answer /healthz on {} within {START_TIMEOUT:?}; log:\n{}",
                self.http,
                proc.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the process gracefully (SIGTERM; SIGKILL after 10 s). Returns its exit
    /// status and whether it had to be killed.
    pub fn stop(&mut self) -> (ExitStatus, bool) {
        let mut proc = self.proc.take().expect("the aggregator is not running");
        proc.terminate(STOP_GRACE)
    }

    /// Kills the process (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.kill();
        }
    }

    /// Stops it if running, then starts it again with the same options, ports and store.
    pub fn restart(&mut self) {
        let opts = self.opts.clone();
        self.restart_with(opts);
    }

    /// Stops it if running, then starts it again on the same ports and store with `opts`.
    pub fn restart_with(&mut self, opts: AggregatorOpts) {
        if self.proc.is_some() {
            self.stop();
        }
        self.opts = opts;
        // The UDP port is free as soon as the old process is gone; retry briefly in case
        // the kernel is slow to let go of it.
        let mut last = String::new();
        for _ in 0..10 {
            match self.launch() {
                Ok(()) => return,
                Err(StartError::Exited(status, log)) => {
                    assert!(
                        log.contains("cannot bind"),
                        "ballast-aggregator exited during restart ({status}):\n{log}"
                    );
                    last = log;
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        panic!("ballast-aggregator could not bind its old ports again: {last}");
    }

    /// Freezes the process (SIGSTOP); [`Aggregator::resume`] lets it go on.
    pub fn pause(&self) {
        self.proc
            .as_ref()
            .expect("the aggregator is running")
            .pause();
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.proc
            .as_ref()
            .expect("the aggregator is running")
            .resume();
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::is_running)
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// The QUIC address agents dial.
    pub fn quic_addr(&self) -> SocketAddr {
        self.quic
    }

    /// The HTTP API address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    /// The HTTP API's URL: `https://` when [`AggregatorOpts::api`] says it has TLS.
    pub fn base_url(&self) -> String {
        let scheme = if self.opts.api.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.http)
    }

    /// `ballast-aggregator ARGS --url (this aggregator's API)`, bounded to 30 s: its
    /// stdout, or a panic with all it said. The operators' commands (`drain`, `hold`,
    /// ...); credentials (`--ca`, `--token-file`) go in `args`.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut cmd = command(AGGREGATOR_BIN);
        cmd.args(args).arg("--url").arg(self.base_url());
        let out = run_bounded(cmd, Duration::from_secs(30));
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "ballast-aggregator {args:?}: {said}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The xDS address; panics unless started with `xds`.
    pub fn xds_addr(&self) -> SocketAddr {
        self.xds
            .expect("the aggregator was started without AggregatorOpts::xds")
    }

    /// Where the aggregator answers HAProxy's agent-check; panics unless started with
    /// `agent_check`.
    pub fn agent_check_addr(&self) -> SocketAddr {
        self.agent_check
            .expect("the aggregator was started without AggregatorOpts::agent_check")
    }

    /// How an xDS client reaches this aggregator: the address, and the CA to check its
    /// certificate with (none when the port is plaintext).
    pub fn xds(&self) -> XdsTarget {
        XdsTarget {
            addr: self.xds_addr(),
            ca: (self.opts.xds_tls != XdsTls::Plaintext).then(|| self.tls_dir.join("ca.pem")),
            client: None,
        }
    }

    /// The routing store file.
    pub fn store_path(&self) -> &Path {
        &self.store
    }

    /// The options in force.
    pub fn opts(&self) -> &AggregatorOpts {
        &self.opts
    }

    /// The end of the current run's log.
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc
            .as_ref()
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// The whole log of the current (or last) run.
    pub fn log(&self) -> String {
        let path = self
            .dir
            .path()
            .join(format!("aggregator-{}.log", self.runs));
        std::fs::read_to_string(path).unwrap_or_default()
    }

    /// GET `path`: status and body, or the transport error.
    pub fn try_get(&self, path: &str) -> Result<(u16, String), String> {
        let url = format!("{}{path}", self.base_url());
        let resp = self
            .http_client
            .get(&url)
            .send()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp.text().map_err(|e| format!("GET {url}: body: {e}"))?;
        Ok((status, body))
    }

    /// GET `path`: status and body. Panics if the request fails.
    pub fn get(&self, path: &str) -> (u16, String) {
        self.try_get(path).unwrap_or_else(|e| panic!("{e}"))
    }

    /// GET `path` as JSON of type `T`, requiring 200.
    pub fn try_get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let (status, body) = self.try_get(path)?;
        if status != 200 {
            return Err(format!("GET {path}: status {status}: {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("GET {path}: {e}: {body}"))
    }

    /// GET `path` as JSON of type `T` (e.g. `serde_json::Value`). Panics unless 200 with
    /// a body of that shape.
    pub fn get_json<T: DeserializeOwned>(&self, path: &str) -> T {
        self.try_get_json(path).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `GET /healthz` in the product's own shape, whether it says ok (200) or failing
    /// (503): a renamed or missing field fails here rather than reading as absent.
    pub fn health(&self) -> Health {
        self.try_health().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Aggregator::health`] without panicking, for waits.
    pub fn try_health(&self) -> Result<Health, String> {
        let (status, body) = self.try_get("/healthz")?;
        if status != 200 && status != 503 {
            return Err(format!("GET /healthz: status {status}: {body}"));
        }
        parse_health(&body)
    }

    /// GET `path` expecting a JSON error with `status`.
    pub fn get_error(&self, path: &str, status: u16) -> ErrorBody {
        let (got, body) = self.get(path);
        assert_eq!(got, status, "GET {path}: expected {status}, body {body}");
        serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: error body is not the JSON error: {e}: {body}"))
    }

    /// `GET /v1/services`.
    pub fn services(&self) -> Vec<ServiceSummary> {
        self.get_json("/v1/services")
    }

    /// `GET /v1/published`: the whole last publication, every feed's source.
    pub fn published(&self) -> Published {
        self.get_json("/v1/published")
    }

    /// `GET /v1/config`.
    pub fn config(&self) -> ConfigView {
        self.get_json("/v1/config")
    }

    /// `GET /v1/services/{name}`.
    pub fn service(&self, name: &str) -> ServiceDetail {
        self.get_json(&format!("/v1/services/{name}"))
    }

    /// `GET /v1/services/{name}`, or why not (e.g. not registered yet).
    pub fn try_service(&self, name: &str) -> Result<ServiceDetail, String> {
        self.try_get_json(&format!("/v1/services/{name}"))
    }

    /// `GET /v1/services/{name}/endpoints`.
    pub fn endpoints(&self, name: &str) -> Vec<EndpointView> {
        self.get_json(&format!("/v1/services/{name}/endpoints"))
    }

    /// `GET /v1/services/{name}/endpoints`, or why not (the service is not published
    /// yet: a cycle after its first agent registers).
    pub fn try_endpoints(&self, name: &str) -> Result<Vec<EndpointView>, String> {
        self.try_get_json(&format!("/v1/services/{name}/endpoints"))
    }

    /// `GET /v1/services/{name}/weights`.
    pub fn weights(&self, name: &str) -> WeightSet {
        self.get_json(&format!("/v1/services/{name}/weights"))
    }

    /// `GET /v1/services/{name}/weights`, or why not: a service is served from its
    /// first publication on, a cycle after its first agent registers.
    pub fn try_weights(&self, name: &str) -> Result<WeightSet, String> {
        self.try_get_json(&format!("/v1/services/{name}/weights"))
    }

    /// Waits up to `within` until the service publishes weights for `n` endpoints, and
    /// returns them. A service is first published as soon as one agent registers, so
    /// waiting for the service alone may see only part of its fleet.
    pub fn wait_for_endpoints(&self, name: &str, n: usize, within: Duration) -> WeightSet {
        super::wait::wait_for(within, &format!("{n} endpoints of {name}"), || {
            let w = self.try_weights(name)?;
            if w.weights.len() == n {
                Ok(w)
            } else {
                Err(format!("{} endpoints", w.weights.len()))
            }
        })
    }

    /// `GET /metrics` as text; checks the OpenMetrics terminator.
    pub fn metrics(&self) -> String {
        let (status, body) = self.get("/metrics");
        assert_eq!(status, 200, "GET /metrics: {body}");
        assert!(
            body.ends_with("# EOF\n"),
            "/metrics does not end with # EOF"
        );
        body
    }

    /// `GET /metrics`, parsed.
    pub fn metric_samples(&self) -> Vec<MetricSample> {
        parse_metrics(&self.metrics())
    }

    /// The sum of the samples of `name` (e.g. `ballast_reports_rejected_total`) whose
    /// labels include `labels`; 0 if none is exported.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sum_samples(&self.metric_samples(), name, labels)
    }
}

impl Drop for Aggregator {
    fn drop(&mut self) {
        // The process is killed by Proc's own drop; this makes the order explicit.
        self.proc.take();
    }
}
