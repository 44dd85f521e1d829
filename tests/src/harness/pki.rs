//! Certificates for one test: made by the real `ballast-aggregator certs init`,
//! `certs issue` and `certs revoke`, in a temporary directory removed when the test
//! ends. Node certificates name the services their node may serve; those an attacker
//! would hold (expired, from another CA) are made in-process.

use super::process::{command, run_bounded, AGGREGATOR_BIN};
use ballast_shared::pki::{Ca, NodeSpec, RelaySpec};
use ballast_shared::tls::{self, CertInfo, CertificateDer, Identity};
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
        Self::with_server_names(&[])
    }

    /// Like [`Pki::new`], with a server certificate that also names `extra` (the
    /// address of an aggregator in a network namespace, say).
    pub fn with_server_names(extra: &[&str]) -> Pki {
        let mut names = SERVER_NAMES.to_string();
        for n in extra {
            names.push(',');
            names.push_str(n);
        }
        let dir = tempfile::Builder::new()
            .prefix("ballast-pki-")
            .tempdir()
            .expect("temporary directory for the PKI");
        let pki = Pki {
            dir,
            issue: Mutex::new(()),
        };
        pki.certs(&["init"], &["--server-name", &names]);
        for f in ["ca.pem", "ca.key", "server.pem", "server.key"] {
            assert!(
                pki.dir().join(f).is_file(),
                "`certs init` did not write {f} in {}",
                pki.dir().display()
            );
        }
        pki
    }

    /// Runs `ballast-aggregator certs SUB DIR ARGS`; panics unless it succeeds.
    /// Returns what it printed.
    fn certs(&self, sub: &[&str], args: &[&str]) -> String {
        let mut cmd = command(AGGREGATOR_BIN);
        cmd.arg("certs").args(sub).arg(self.dir()).args(args);
        let out = run_bounded(cmd, Duration::from_secs(30));
        assert!(
            out.status.success(),
            "`ballast-aggregator certs {} {}` failed ({}): {}{}",
            sub.join(" "),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `ballast-aggregator certs init DIR --nodes NODES [--service SERVICE]`.
    fn certs_init(&self, nodes: &[&str], service: Option<&str>) {
        let nodes = nodes.join(",");
        let mut args = vec!["--server-name", SERVER_NAMES, "--nodes", &nodes];
        if let Some(s) = service {
            args.extend(["--service", s]);
        }
        self.certs(&["init"], &args);
    }

    /// The directory: `ca.pem`, `server.pem`, `server.key` (the aggregator's `--tls-dir`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The aggregator's TLS directory.
    pub fn server_tls_dir(&self) -> PathBuf {
        self.dir().to_path_buf()
    }

    fn node_dir(&self, id: &str) -> PathBuf {
        self.dir().join("nodes").join(id)
    }

    /// What node `id`'s certificate says, if it has one.
    pub fn node_info(&self, id: &str) -> Option<CertInfo> {
        let pem = std::fs::read_to_string(self.node_dir(id).join("node.pem")).ok()?;
        let chain = tls::certs_from_pem(&pem, "node.pem").ok()?;
        CertInfo::parse(chain.first()?).ok()
    }

    /// A ready agent TLS directory (`ca.pem`, `node.pem`, `node.key`) whose certificate
    /// names node `id`, issued by this CA on first use. A certificate issued here names
    /// no service: see [`Pki::node_tls_dir_for`] for one that may serve.
    pub fn node_tls_dir(&self, id: &str) -> PathBuf {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.node_dir(id);
        if !dir.join("node.pem").is_file() {
            self.certs_init(&[id], None);
            assert!(
                dir.join("node.key").is_file() && dir.join("ca.pem").is_file(),
                "`certs init --nodes {id}` did not write {}",
                dir.display()
            );
        }
        dir
    }

    /// Node `id`'s TLS directory, with a certificate that may serve each of
    /// `services`: issued with `certs issue` on first use, and issued again (with the
    /// services it had, and these) when the one there does not name them all.
    pub fn node_tls_dir_for(&self, id: &str, services: &[&str]) -> PathBuf {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.node_dir(id);
        let had = self.node_info(id).map(|i| i.services).unwrap_or_default();
        if dir.join("node.pem").is_file() && services.iter().all(|s| had.iter().any(|h| h == s)) {
            return dir;
        }
        let mut all = had;
        for s in services {
            if !all.iter().any(|h| h == s) {
                all.push(s.to_string());
            }
        }
        let list = all.join(",");
        let mut args = vec![id];
        if !list.is_empty() {
            args.extend(["--service", &list]);
        }
        self.certs(&["issue"], &args);
        dir
    }

    /// Issues certificates for every node of `ids` that has none yet, in one
    /// `certs init` run (faster than one at a time for a fleet). They name no service.
    pub fn issue_nodes(&self, ids: &[&str]) {
        self.issue_nodes_inner(ids, None);
    }

    /// Issues certificates that may serve `service` for every node of `ids` that has
    /// none yet, in one `certs init --service` run.
    pub fn issue_nodes_for(&self, service: &str, ids: &[&str]) {
        self.issue_nodes_inner(ids, Some(service));
    }

    fn issue_nodes_inner(&self, ids: &[&str], service: Option<&str>) {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let missing: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| !self.node_dir(id).join("node.pem").is_file())
            .collect();
        if !missing.is_empty() {
            self.certs_init(&missing, service);
        }
    }

    /// An agent TLS directory that trusts this CA's aggregator but whose own certificate,
    /// naming node `id`, comes from another CA: the aggregator must refuse it.
    pub fn foreign_node_tls_dir(&self, id: &str) -> PathBuf {
        let dir = self.dir().join("foreign").join(id);
        let other = Ca::generate("Some other CA").expect("generate a foreign CA");
        other
            .issue_node(id, &[])
            .expect("issue a foreign node certificate")
            .pem
            .write(&dir, "node")
            .expect("write the foreign node certificate");
        std::fs::copy(self.dir().join("ca.pem"), dir.join("ca.pem")).expect("copy ca.pem");
        dir
    }

    /// A ready relay TLS directory (`ca.pem`, `relay.pem`, `relay.key`) whose
    /// certificate names relay `name` and the relay role, issued with `certs relay` on
    /// first use.
    pub fn relay_tls_dir(&self, name: &str) -> PathBuf {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.dir().join("relays").join(name);
        if !dir.join("relay.pem").is_file() {
            self.certs(&["relay"], &[name]);
            assert!(
                dir.join("relay.key").is_file() && dir.join("ca.pem").is_file(),
                "`certs relay {name}` did not write {}",
                dir.display()
            );
        }
        dir
    }

    /// A relay TLS directory that trusts this CA's aggregator but whose own relay
    /// certificate, naming `name`, comes from another CA: the aggregator must refuse it.
    pub fn foreign_relay_tls_dir(&self, name: &str) -> PathBuf {
        let dir = self.dir().join("foreign-relays").join(name);
        let other = Ca::generate("Some other CA").expect("generate a foreign CA");
        let spec = RelaySpec::new(name, Duration::from_secs(86_400)).expect("relay spec");
        other
            .issue_relay(&spec)
            .expect("issue a foreign relay certificate")
            .pem
            .write(&dir, "relay")
            .expect("write the foreign relay certificate");
        std::fs::copy(self.dir().join("ca.pem"), dir.join("ca.pem")).expect("copy ca.pem");
        dir
    }

    /// This CA, loaded from its files, to issue what `certs` will not, or many
    /// certificates at once (a bench's thousands of agents).
    pub fn ca(&self) -> Ca {
        let read = |f: &str| std::fs::read_to_string(self.dir().join(f)).expect("read the CA");
        Ca::from_pem(&read("ca.pem"), &read("ca.key")).expect("load the CA")
    }

    /// An agent TLS directory with a certificate from this CA for node `id`, serving
    /// `services`, valid only from `not_before_unix_s` to `not_after_unix_s`: for an
    /// expired certificate, which `certs` never issues.
    pub fn node_tls_dir_valid(
        &self,
        id: &str,
        services: &[&str],
        not_before_unix_s: i64,
        not_after_unix_s: i64,
    ) -> PathBuf {
        let dir = self
            .dir()
            .join("custom")
            .join(format!("{id}-{not_after_unix_s}"));
        let spec = NodeSpec {
            node: id.to_string(),
            services: services.iter().map(|s| s.to_string()).collect(),
            not_before_unix_s,
            not_after_unix_s,
        };
        self.ca()
            .issue_node_with(&spec)
            .expect("issue a node certificate")
            .pem
            .write(&dir, "node")
            .expect("write the node certificate");
        std::fs::copy(self.dir().join("ca.pem"), dir.join("ca.pem")).expect("copy ca.pem");
        dir
    }

    /// Revokes node `id`'s certificate with `certs revoke`: [`Pki::crl_path`] then
    /// lists it.
    pub fn revoke(&self, id: &str) -> String {
        let _guard = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        self.certs(&["revoke"], &[id])
    }

    /// The revocation list `certs revoke` writes.
    pub fn crl_path(&self) -> PathBuf {
        self.dir().join("crl.pem")
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

    /// A QUIC client configuration presenting the certificate in TLS directory `dir`.
    pub fn client_config_from(&self, dir: &Path) -> quinn::ClientConfig {
        let id = Identity::load(&dir.join("node.pem"), &dir.join("node.key"))
            .expect("load node identity");
        tls::client_config(id, &self.ca_certs()).expect("client config")
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}
