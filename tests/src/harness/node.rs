//! A second proxyless gRPC xDS client: `@grpc/grpc-js-xds` on Node, driven over its
//! standard input and output exactly like the Python `grpcio` client of
//! [`super::grpc`] (the script is `tests/xds-node/client.js`, its pinned packages in
//! `tests/xds-node/package.json` and `package-lock.json`).
//!
//! `@grpc/grpc-js-xds` 1.14 takes only `google_default` and `insecure` channel
//! credentials from its bootstrap, so it cannot reach the aggregator's TLS port by
//! itself. [`NodeXdsClient::start`] writes the same bootstrap as the `grpcio` client
//! (`tls` credentials with the CA) and, with [`Creds::TlsSidecar`], the script
//! forwards a loopback port to the aggregator over TLS, checking the server against
//! that CA, and gives grpc-js-xds the loopback port with `insecure` credentials.

use super::aggregator::XdsTarget;
use super::grpc::write_bootstrap;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The package versions `tests/xds-node/package.json` pins: a different one in
/// `node_modules` means `npm ci` was not run since the pins changed.
pub const GRPC_JS_XDS_VERSION: &str = "1.14.1";

/// `tests/xds-node`.
pub fn package_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("xds-node")
}

/// Fails, naming the command to run, unless `node` runs and `tests/xds-node` has its
/// modules installed at the pinned version.
pub fn require_node() {
    let dir = package_dir();
    let fix = format!(
        "run `npm ci` in {} (tests/run does it when node_modules is missing)",
        dir.display()
    );
    match Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "the Node xDS tests need Node.js 18 or later: `node --version` failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "the Node xDS tests need Node.js 18 or later (`apt-get install nodejs npm`), \
             then {fix}: cannot run node: {e}"
        ),
    }
    let manifest = dir.join("node_modules/@grpc/grpc-js-xds/package.json");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| {
        panic!(
            "the Node xDS tests need @grpc/grpc-js-xds: {}: {e}; {fix}",
            manifest.display()
        )
    });
    let version = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["version"].as_str().map(str::to_string))
        .unwrap_or_default();
    assert_eq!(
        version, GRPC_JS_XDS_VERSION,
        "tests/xds-node/node_modules holds @grpc/grpc-js-xds {version:?}, the lock pins \
         {GRPC_JS_XDS_VERSION}: {fix}"
    );
}

/// How the client reaches the ADS port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Creds {
    /// The bootstrap as `grpcio` gets it, handed to grpc-js-xds unchanged (it
    /// rejects `tls` channel credentials).
    AsWritten,
    /// The script's loopback TLS sidecar carries the ADS stream.
    TlsSidecar,
}

/// What one round of calls gave.
#[derive(Debug, serde::Deserialize)]
pub struct NodeRound {
    /// Calls made.
    pub sent: u32,
    /// Calls answered, by backend name.
    pub counts: BTreeMap<String, u32>,
    /// Calls failed, by status code name (`UNAVAILABLE`).
    pub errors: BTreeMap<String, u32>,
    /// The first failure's message, by status code name.
    #[serde(default)]
    pub details: BTreeMap<String, String>,
    /// How long the round took.
    pub seconds: f64,
}

impl NodeRound {
    /// Calls answered.
    pub fn answered(&self) -> u32 {
        self.counts.values().sum()
    }
}

/// A grpc-js-xds client of `xds:///<service>`, bootstrapped to an ADS server; killed
/// on drop. Closing its standard input also ends it.
pub struct NodeXdsClient {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: PathBuf,
    label: String,
}

impl NodeXdsClient {
    /// A client whose xDS node is `node_id`, in `zone` if given (`node.locality.zone`
    /// of the bootstrap), resolving `xds:///<service>` through the ADS server at `xds`.
    /// Its standard error goes to `dir/<node_id>.stderr`.
    pub fn start(
        xds: &XdsTarget,
        service: &str,
        node_id: &str,
        zone: Option<&str>,
        creds: Creds,
        dir: &Path,
    ) -> NodeXdsClient {
        let bootstrap = write_bootstrap(xds, node_id, zone, dir);
        // grpc-js-xds 1.14 rejects a bootstrap whose node has no `locality` (grpcio
        // takes one without): give it an empty one when there is no zone.
        if zone.is_none() {
            let text = std::fs::read_to_string(&bootstrap).expect("read the bootstrap");
            let mut doc: serde_json::Value = serde_json::from_str(&text).expect("bootstrap JSON");
            doc["node"]["locality"] = serde_json::json!({});
            std::fs::write(&bootstrap, doc.to_string()).expect("write the bootstrap");
        }
        let script = package_dir().join("client.js");
        let stderr = dir.join(format!("{node_id}.stderr"));
        let mut cmd = Command::new("node");
        cmd.arg(&script);
        if creds == Creds::TlsSidecar {
            cmd.arg("--tls-sidecar");
        }
        cmd.arg(format!("xds:///{service}"))
            .current_dir(package_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            // No proxy may capture the loopback connections, and no other bootstrap
            // may win over ours.
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("grpc_proxy")
            .env_remove("GRPC_XDS_BOOTSTRAP_CONFIG")
            .env("GRPC_XDS_BOOTSTRAP", &bootstrap);
        // Quiet unless asked (GRPC_VERBOSITY=DEBUG GRPC_TRACE=xds_client,… to debug).
        if std::env::var_os("GRPC_VERBOSITY").is_none() {
            cmd.env("GRPC_VERBOSITY", "ERROR");
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start node {}: {e}", script.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        NodeXdsClient {
            child,
            stdin,
            lines: super::process::lines_of(stdout),
            stderr,
            label: node_id.to_string(),
        }
    }

    /// Makes at most `calls` calls, one at a time, for at most `budget`, each waiting
    /// for the channel to be ready; the client answers within the budget plus 10 s or
    /// the test fails.
    pub fn round(&mut self, calls: u32, budget: Duration) -> NodeRound {
        self.command(&format!("round {calls} {}", budget.as_secs_f64()), budget)
    }

    /// Like [`NodeXdsClient::round`], but calls fail at once when the channel is not
    /// ready, with the reason in [`NodeRound::details`].
    pub fn round_fail_fast(&mut self, calls: u32, budget: Duration) -> NodeRound {
        self.command(
            &format!("round {calls} {} fast", budget.as_secs_f64()),
            budget,
        )
    }

    fn command(&mut self, line: &str, budget: Duration) -> NodeRound {
        let stdin = self.stdin.as_mut().expect("stdin open");
        if let Err(e) = writeln!(stdin, "{line}").and_then(|_| stdin.flush()) {
            panic!(
                "{}: write: {e}; stderr:\n{}",
                self.label,
                self.stderr_tail()
            );
        }
        let timeout = budget + Duration::from_secs(10);
        let answer = match self.lines.recv_timeout(timeout) {
            Ok(answer) => answer,
            Err(e) => {
                let status = self.child.try_wait().ok().flatten();
                panic!(
                    "{}: no answer within {timeout:?} ({e}; exit status {status:?}); stderr:\n{}",
                    self.label,
                    self.stderr_tail()
                )
            }
        };
        serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{} said {answer:?}: {e}", self.label))
    }

    /// The last 30 lines of its standard error.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for NodeXdsClient {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
