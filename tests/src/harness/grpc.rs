//! Proxyless gRPC peers for the xDS tests: Python `grpcio` backends that answer with
//! their names, and `grpcio` xDS clients that count calls per backend, driven over
//! their standard input and output (the scripts are in `tests/xds/`).

use super::aggregator::XdsTarget;
use super::api::WeightSet;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The Python the tests run: `BALLAST_PYTHON` if set (the test command sets it to the
/// virtual environment it makes, `tests/.venv`, with grpcio, the OpenAPI validator and
/// Schemathesis), else that environment's interpreter if it exists. Panics, saying how
/// to make it, otherwise: Debian's system Python refuses `pip install` (PEP 668), so the
/// tests never use it silently.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("BALLAST_PYTHON") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "BALLAST_PYTHON is {}, which is not a file",
            p.display()
        );
        return p;
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.is_file(),
        "the tests that run Python need the virtual environment the test command makes: \
         run `bash tests/run`, or make it with `python3 -m venv tests/.venv && \
         tests/.venv/bin/pip install grpcio openapi-spec-validator 'schemathesis>=4.32,<5'`, \
         or set BALLAST_PYTHON to a Python that has those packages"
    );
    venv
}

/// A Python process with piped standard input and output, killed on drop. Closing its
/// standard input also ends it, so it cannot outlive the test by much.
pub struct Python {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: PathBuf,
    what: String,
}

impl Python {
    /// Runs `tests/xds/<script>` with `args` and extra environment `env`; its standard
    /// error goes to a file in `dir` (named after `label`), quoted when it fails.
    pub fn spawn(
        script: &str,
        label: &str,
        args: &[&str],
        env: &[(&str, &Path)],
        dir: &Path,
    ) -> Python {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("xds")
            .join(script);
        let stderr = dir.join(format!("{label}.stderr"));
        let mut cmd = Command::new(python());
        cmd.arg(&path)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            // No proxy may capture the loopback connections.
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("grpc_proxy")
            .env("GRPC_VERBOSITY", "ERROR");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start python {}: {e}", path.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let lines = super::process::lines_of(stdout);
        Python {
            child,
            stdin,
            lines,
            stderr,
            what: label.to_string(),
        }
    }

    /// The last 30 lines of its standard error.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The next line of output, within `timeout`; panics with its stderr otherwise.
    pub fn line(&mut self, timeout: Duration) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => line,
            Err(e) => {
                let status = self.child.try_wait().ok().flatten();
                panic!(
                    "{}: no output within {timeout:?} ({e}; exit status {status:?}); stderr:\n{}",
                    self.what,
                    self.stderr_tail()
                )
            }
        }
    }

    /// Writes one line to its standard input.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .unwrap_or_else(|e| {
                panic!("{}: write: {e}; stderr:\n{}", self.what, self.stderr_tail())
            });
    }
}

impl Drop for Python {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fails, naming the package, unless [`python`] can import grpc.
pub fn require_grpcio() {
    let out = Command::new(python())
        .args(["-c", "import grpc; print(grpc.__version__)"])
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "the xDS tests need the Python package grpcio: `{} -c 'import grpc'` failed. \
             Install it with `tests/.venv/bin/pip install grpcio` (`bash tests/run` does).\n{}",
            python().display(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "the xDS tests need {} with the package grpcio: it does not run: {e}",
            python().display()
        ),
    }
}

/// gRPC backends, one per name, each answering every call with its name.
pub struct Backends {
    /// Each backend's port, by name.
    pub ports: BTreeMap<String, u16>,
    host: IpAddr,
    _process: Python,
}

impl Backends {
    /// Starts one backend per name, in one Python process, on 127.0.0.1.
    pub fn start(names: &[&str], dir: &Path) -> Backends {
        Self::start_on(IpAddr::from([127, 0, 0, 1]), names, dir)
    }

    /// Starts one backend per name, in one Python process, on `host` (an address of
    /// this machine, such as the test's side of a network namespace's link).
    pub fn start_on(host: IpAddr, names: &[&str], dir: &Path) -> Backends {
        let host_arg = host.to_string();
        let mut args = vec!["--host", host_arg.as_str()];
        args.extend_from_slice(names);
        let mut process = Python::spawn("backends.py", "backends", &args, &[], dir);
        let line = process.line(Duration::from_secs(20));
        let ports: BTreeMap<String, u16> =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("backends said {line:?}: {e}"));
        Backends {
            ports,
            host,
            _process: process,
        }
    }

    /// `HOST:PORT` of backend `name`, as its agent registers it.
    pub fn address(&self, name: &str) -> String {
        SocketAddr::from((self.host, self.ports[name])).to_string()
    }
}

/// What one round of calls gave.
#[derive(Debug, serde::Deserialize)]
pub struct Round {
    /// Calls made.
    pub sent: u32,
    /// Calls answered, by backend name.
    pub counts: BTreeMap<String, u32>,
    /// Calls failed, by status code.
    pub errors: BTreeMap<String, u32>,
    /// How long the round took.
    pub seconds: f64,
}

/// A proxyless gRPC client of `xds:///<service>`, bootstrapped to an ADS server.
pub struct XdsClient {
    process: Python,
    label: String,
}

impl XdsClient {
    /// A client whose xDS node is `node_id`, in `zone` if given (`node.locality.zone`
    /// of the bootstrap), resolving `xds:///<service>` through the ADS server at `xds`.
    pub fn start(
        xds: &XdsTarget,
        service: &str,
        node_id: &str,
        zone: Option<&str>,
        dir: &Path,
    ) -> XdsClient {
        let bootstrap = write_bootstrap(xds, node_id, zone, dir);
        let target = format!("xds:///{service}");
        let process = Python::spawn(
            "client.py",
            node_id,
            &[&target],
            &[("GRPC_XDS_BOOTSTRAP", &bootstrap)],
            dir,
        );
        XdsClient {
            process,
            label: node_id.to_string(),
        }
    }

    /// Makes at most `calls` calls, one at a time, for at most `budget`; the client
    /// answers within the budget plus 10 s or the test fails.
    pub fn round(&mut self, calls: u32, budget: Duration) -> Round {
        self.process
            .send(&format!("round {calls} {}", budget.as_secs_f64()));
        let line = self.process.line(budget + Duration::from_secs(10));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{} said {line:?}: {e}", self.label))
    }

    /// The last lines of its standard error.
    pub fn stderr_tail(&self) -> String {
        self.process.stderr_tail()
    }
}

/// Writes a gRPC xDS bootstrap for node `node_id` (in `zone` if given) that points at
/// the ADS server `xds`, over TLS with its CA (the `tls` channel credentials of
/// gRPC's bootstrap) unless the port is plaintext, as `dir/bootstrap-<node_id>.json`,
/// and returns its path: the file `GRPC_XDS_BOOTSTRAP` names, for an [`XdsClient`] or
/// a client of a test's own making (a load generator, say).
pub fn write_bootstrap(xds: &XdsTarget, node_id: &str, zone: Option<&str>, dir: &Path) -> PathBuf {
    let path = dir.join(format!("bootstrap-{node_id}.json"));
    let mut node = serde_json::json!({ "id": node_id });
    if let Some(zone) = zone {
        node["locality"] = serde_json::json!({ "zone": zone });
    }
    let creds = match (&xds.ca, &xds.client) {
        (Some(ca), Some((cert, key))) => serde_json::json!({
            "type": "tls",
            "config": {
                "ca_certificate_file": ca,
                "certificate_file": cert,
                "private_key_file": key,
            },
        }),
        (Some(ca), None) => serde_json::json!({
            "type": "tls",
            "config": { "ca_certificate_file": ca },
        }),
        (None, _) => serde_json::json!({ "type": "insecure" }),
    };
    let doc = serde_json::json!({
        "xds_servers": [{
            "server_uri": xds.addr.to_string(),
            "channel_creds": [creds],
            "server_features": ["xds_v3"],
        }],
        "node": node,
    });
    std::fs::write(&path, doc.to_string()).expect("write the xDS bootstrap");
    path
}

/// Each node's share of the weight an xDS client is given, `envoy / Σ envoy` over the endpoints not
/// draining (a draining endpoint's share is 0).
pub fn weight_shares(w: &WeightSet) -> BTreeMap<String, f64> {
    let total: f64 = w
        .weights
        .values()
        .filter(|e| !e.draining)
        .map(|e| f64::from(e.envoy))
        .sum();
    w.weights
        .iter()
        .map(|(node, e)| {
            let share = if e.draining || total == 0.0 {
                0.0
            } else {
                f64::from(e.envoy) / total
            };
            (node.clone(), share)
        })
        .collect()
}
