//! Certificates for one test: made by the real `ballast-aggregator certs init`, in a
//! temporary directory removed when the test ends.

use super::process::{command, run_bounded, AGGREGATOR_BIN};
use ballast_shared::pki::Ca;
use ballast_shared::tls::{self, CertificateDer, Identity};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// The names the test server certificate covers: agents dial `127.0.0.1`.
const SERVER_NAMES: &str = "localhost,127.0.0.1";

/// A CA with a server certificate and node certificates issued on demand.
pub struct Pki {
    dir: tempfile::TempDir,
    issue: Mutex<()>,
}

impl Pki {
    /// A fresh CA and server certificate, from `ballast-aggregator certs init`.
    pub fn new() -> Pki {
        let dir = tempfile::Builder::new()
            .prefix("ballast-pki-")
            .tempdir()
            .expect("temporary directory for the PKI");
        let pki = Pki {
            dir,
            issue: Mutex::new(()),
        };
        pki.certs_init(&[]);
        for f in ["ca.pem", "ca.key", "server.pem", "server.key"] {
            assert!(
                pki.dir().join(f).is_file(),
                "`certs init` did not write {f} in {}",
                pki.dir().display()
            );
        }
        pki
    }

    fn certs_init(&self, nodes: &[&str]) {
        let mut cmd = command(AGGREGATOR_BIN);
        cmd.args(["certs", "init"])
            .arg(self.dir())
            .args(["--server-name", SERVER_NAMES]);
        if !nodes.is_empty() {
            cmd.arg("--nodes").arg(nodes.join(","));
        }
        let out = run_bounded(cmd, Duration::from_secs(30));
        assert!(
            out.status.success(),
            "`ballast-aggregator certs init` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The directory: `ca.pem`, `server.pem`, `server.key` (the aggregator's `--tls-dir`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The aggregator's TLS directory.
    pub fn server_tls_dir(&self) -> PathBuf {
        self.dir().to_path_buf()
    }

    /// A ready agent TLS directory (`ca.pem`, `node.pem`, `node.key`) whose certificate
    /// names node `id`, issued by this CA on first use.
    pub fn node_tls_dir(&self, id: &str) -> PathBuf {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.dir().join("nodes").join(id);
        if !dir.join("node.pem").is_file() {
            self.certs_init(&[id]);
            assert!(
                dir.join("node.key").is_file() && dir.join("ca.pem").is_file(),
                "`certs init --nodes {id}` did not write {}",
                dir.display()
            );
        }
        dir
    }

    /// Issues certificates for every node of `ids` that has none yet, in one
    /// `certs init` run (faster than one at a time for a fleet).
    pub fn issue_nodes(&self, ids: &[&str]) {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let missing: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| !self.dir().join("nodes").join(id).join("node.pem").is_file())
            .collect();
        if !missing.is_empty() {
            self.certs_init(&missing);
        }
    }

    /// An agent TLS directory that trusts this CA's aggregator but whose own certificate,
    /// naming node `id`, comes from another CA: the aggregator must refuse it.
    pub fn foreign_node_tls_dir(&self, id: &str) -> PathBuf {
        let dir = self.dir().join("foreign").join(id);
        let other = Ca::generate("Some other CA").expect("generate a foreign CA");
        other
            .issue_node(id)
            .expect("issue a foreign node certificate")
            .write(&dir, "node")
            .expect("write the foreign node certificate");
        std::fs::copy(self.dir().join("ca.pem"), dir.join("ca.pem")).expect("copy ca.pem");
        dir
    }

    /// The TLS identity of node `id` (issued on first use).
    pub fn node_identity(&self, id: &str) -> Identity {
        let dir = self.node_tls_dir(id);
        Identity::load(&dir.join("node.pem"), &dir.join("node.key")).expect("load node identity")
    }

    /// The CA certificate.
    pub fn ca_certs(&self) -> Vec<CertificateDer<'static>> {
        let pem = tls::read(&self.dir().join("ca.pem")).expect("read ca.pem");
        tls::certs_from_pem(&pem, "ca.pem").expect("parse ca.pem")
    }

    /// A QUIC client configuration presenting node `id`'s certificate, as an agent does.
    pub fn client_config(&self, id: &str) -> quinn::ClientConfig {
        tls::client_config(self.node_identity(id), &self.ca_certs()).expect("client config")
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}
