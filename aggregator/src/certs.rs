//! `ballast-aggregator certs`: a CA, a server certificate and node certificates, so
//! that a first deployment needs no openssl.

use ballast_shared::pki::{Ca, PkiError};
use std::path::Path;

/// The names the server certificate covers unless told otherwise.
pub fn default_server_names() -> Vec<String> {
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let h = h.trim();
        if !h.is_empty() && !names.iter().any(|n| n == h) {
            names.push(h.to_string());
        }
    }
    names
}

/// Writes `ca.pem`, `ca.key`, `server.pem`, `server.key` and, per node,
/// `nodes/NODE/{ca.pem,node.pem,node.key}` (a ready-made TLS dir for that agent).
/// An existing CA in `dir` is reused, so nodes can be added later.
pub fn init(
    dir: &Path,
    server_names: &[String],
    nodes: &[String],
) -> Result<Vec<String>, PkiError> {
    let ca_cert = dir.join("ca.pem");
    let ca_key = dir.join("ca.key");
    let mut written = Vec::new();
    let ca = match (
        std::fs::read_to_string(&ca_cert),
        std::fs::read_to_string(&ca_key),
    ) {
        (Ok(c), Ok(k)) => Ca::from_pem(&c, &k)?,
        _ => {
            let ca = Ca::generate("Ballast CA")?;
            ca.pem().write(dir, "ca")?;
            written.push(ca_cert.display().to_string());
            ca
        }
    };
    if !dir.join("server.pem").exists() {
        ca.issue_server(server_names)?.write(dir, "server")?;
        written.push(dir.join("server.pem").display().to_string());
    }
    for node in nodes {
        let node_dir = dir.join("nodes").join(node);
        ca.issue_node(node)?.write(&node_dir, "node")?;
        std::fs::copy(&ca_cert, node_dir.join("ca.pem")).map_err(|source| PkiError::Io {
            path: node_dir.join("ca.pem").display().to_string(),
            source,
        })?;
        written.push(node_dir.display().to_string());
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_then_add_a_node_reuses_the_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        init(dir.path(), &default_server_names(), &["a".into()]).expect("init");
        let ca1 = std::fs::read_to_string(dir.path().join("ca.pem")).expect("ca");
        init(dir.path(), &default_server_names(), &["b".into()]).expect("add");
        let ca2 = std::fs::read_to_string(dir.path().join("ca.pem")).expect("ca");
        assert_eq!(ca1, ca2);
        assert!(dir.path().join("nodes/b/node.key").exists());
        assert!(init(dir.path(), &[], &["bad/name".into()]).is_err());
    }
}
