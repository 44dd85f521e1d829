//! `ballast-aggregator certs`: a CA, a server certificate, node certificates and a
//! revocation list, so that a first deployment needs no openssl.
//!
//! A node certificate names its node and the services it may serve
//! (`ballast://service/NAME` URIs), and expires after its validity period; each
//! command says when each certificate it writes expires. Revoking a node adds its
//! certificate to `crl.pem` beside the CA, which the aggregator reads
//! (`[authorization] crl`) and reloads when it changes.
//!
//! `certs server` issues one more server certificate from the same CA, for a replica or
//! a relay whose names `certs init`'s does not cover, into a ready-made TLS directory.
//!
//! A relay certificate names a relay and its role (`ballast://role/relay`), no
//! service; `certs relay` writes it beside the nodes', and `certs revoke` finds it too.
//!
//! Every certificate issued is recorded in the ledger `issued.log` beside the CA (its
//! kind, name, serial and expiry), so that `certs revoke NODE` revokes every
//! certificate ever issued to that node, not only the newest: issuing again replaces
//! `nodes/NODE/node.pem`, while a copy taken of the one before stays valid until it
//! expires or is revoked.

use ballast_shared::pki::{self, Ca, NodeSpec, PkiError, RelaySpec, RevocationList, Revoked};
use ballast_shared::tls::{CertInfo, TlsError};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The revocation list's file name in the certificate directory.
pub const CRL_FILE: &str = "crl.pem";

/// The issuance ledger's file name in the certificate directory.
pub const LEDGER_FILE: &str = "issued.log";

/// One certificate the CA in a directory issued, as its ledger records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// When it was issued, in seconds since the Unix epoch.
    pub issued_unix_s: i64,
    /// `node`, `relay` or `server`.
    pub kind: String,
    /// The node's, relay's or replica's name.
    pub name: String,
    /// Its serial number.
    pub serial: Vec<u8>,
    /// When it expires, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Appends `kind name`'s certificate `cert_pem` to the ledger in `dir`, before the
/// certificate is written anywhere: a certificate the ledger does not know is never
/// handed out.
fn record_issued(dir: &Path, kind: &str, name: &str, cert_pem: &str) -> Result<(), CertsError> {
    use std::io::Write;
    let info = ballast_shared::tls::certs_from_pem(cert_pem, name)?
        .first()
        .map(CertInfo::parse)
        .transpose()?
        .ok_or_else(|| TlsError::Certificate(format!("{kind} {name}: no certificate issued")))?;
    let path = dir.join(LEDGER_FILE);
    let new = !path.exists();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io(&path))?;
    let mut line = String::new();
    if new {
        line.push_str("# every certificate this CA issued: ISSUED_UNIX_S KIND NAME SERIAL_HEX NOT_AFTER_UNIX_S\n");
    }
    let now = i64::try_from(ballast_shared::unix_ms() / 1000).unwrap_or(0);
    line.push_str(&format!(
        "{now} {kind} {name} {} {}\n",
        hex(&info.serial),
        info.not_after_unix_s
    ));
    file.write_all(line.as_bytes())
        .and_then(|()| file.sync_data())
        .map_err(io(&path))?;
    Ok(())
}

/// Every certificate the ledger in `dir` records, oldest first; none if there is no
/// ledger yet (a directory made before it existed).
pub fn ledger(dir: &Path) -> Result<Vec<LedgerEntry>, CertsError> {
    let path = dir.join(LEDGER_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(&path)(e).into()),
    };
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: &str| CertsError::Ledger {
            path: path.display().to_string(),
            line: i + 1,
            reason: reason.to_string(),
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [issued, kind, name, serial, not_after] = fields[..] else {
            return Err(bad("not five fields"));
        };
        entries.push(LedgerEntry {
            issued_unix_s: issued.parse().map_err(|_| bad("bad issue time"))?,
            kind: kind.to_string(),
            name: name.to_string(),
            serial: parse_hex(serial).map_err(|_| bad("bad serial"))?,
            not_after_unix_s: not_after.parse().map_err(|_| bad("bad expiry"))?,
        });
    }
    Ok(entries)
}

/// Why a `certs` command failed.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// Issuing or writing failed.
    #[error(transparent)]
    Pki(#[from] PkiError),
    /// A certificate could not be read.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The directory holds no CA to issue from.
    #[error(
        "no CA in {0} (ca.pem and ca.key): create one with `ballast-aggregator certs init {0}`"
    )]
    NoCa(String),
    /// There is no certificate for the node (or relay) to revoke.
    #[error(
        "no certificate for node or relay {node:?} at {path}: give its serial number with --serial"
    )]
    NoNode {
        /// The node.
        node: String,
        /// Where its certificate was looked for.
        path: String,
    },
    /// `certs init --server-name` where a server certificate that lacks a name exists.
    #[error(
        "{path} exists and is kept, and it does not cover --server-name {names}: issue a \
         certificate for other names with `ballast-aggregator certs server {dir} NAME \
         --server-name ...`, or remove server.pem and server.key to make init issue it again"
    )]
    ServerKept {
        /// The server certificate.
        path: String,
        /// The names asked for.
        names: String,
        /// The directory.
        dir: String,
    },
    /// A line of the issuance ledger that does not read.
    #[error("{path} line {line}: {reason} (each line: ISSUED_UNIX_S KIND NAME SERIAL_HEX NOT_AFTER_UNIX_S)")]
    Ledger {
        /// The ledger.
        path: String,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A serial number that is not hex.
    #[error("serial number {0:?} is not hexadecimal")]
    BadSerial(String),
}

/// A file a command wrote, and what it holds in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The file or directory.
    pub path: PathBuf,
    /// What it is: for certificates, whom they name, what they may serve and when
    /// they expire.
    pub summary: String,
}

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

/// `unix_s` for people: the date, and how far from now.
pub fn describe_expiry(unix_s: i64) -> String {
    let now = i64::try_from(ballast_shared::unix_ms() / 1000).unwrap_or(i64::MAX);
    let days = (unix_s - now) / 86_400;
    if unix_s <= now {
        format!("expired {}", pki::rfc3339(unix_s))
    } else {
        format!("expires {} (in {days} days)", pki::rfc3339(unix_s))
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The CA in `dir`, if there is one.
fn load_ca(dir: &Path) -> Result<Option<Ca>, CertsError> {
    let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
    match (
        std::fs::read_to_string(&cert),
        std::fs::read_to_string(&key),
    ) {
        (Ok(c), Ok(k)) => Ok(Some(Ca::from_pem(&c, &k)?)),
        (Err(e), _) | (_, Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
            let path = if cert.exists() { key } else { cert };
            Err(io(&path)(e).into())
        }
        _ => Ok(None),
    }
}

/// What a node certificate names, in words.
fn node_summary(node: &str, services: &[String], not_after_unix_s: i64) -> String {
    let serves = if services.is_empty() {
        "no service (only what the aggregator's policy grants)".to_string()
    } else {
        format!("services {}", services.join(", "))
    };
    format!(
        "node {node}, {serves}, {}",
        describe_expiry(not_after_unix_s)
    )
}

/// Issues node `node`'s certificate into `dir/nodes/NODE/{ca.pem,node.pem,node.key}`
/// (a ready-made TLS directory for that agent), replacing any before it.
fn issue_into(dir: &Path, ca: &Ca, spec: &NodeSpec) -> Result<Written, CertsError> {
    let node_dir = dir.join("nodes").join(&spec.node);
    let issued = ca.issue_node_with(spec)?;
    record_issued(dir, "node", &spec.node, &issued.pem.cert)?;
    issued.pem.write(&node_dir, "node")?;
    let ca_pem = dir.join("ca.pem");
    std::fs::copy(&ca_pem, node_dir.join("ca.pem")).map_err(io(&node_dir.join("ca.pem")))?;
    Ok(Written {
        summary: node_summary(&spec.node, &spec.services, issued.not_after_unix_s),
        path: node_dir,
    })
}

/// Writes `ca.pem`, `ca.key`, an empty `crl.pem`, `server.pem`, `server.key` and, per node,
/// `nodes/NODE/{ca.pem,node.pem,node.key}`: each node may serve `services` and its
/// certificate is valid for `validity`. An existing CA and server certificate in
/// `dir` are kept, so nodes can be added later.
///
/// `server_names_asked` are the names the operator gave (`--server-name`): an existing
/// server certificate is then an error rather than silently kept, since it may not
/// cover them. Empty, the server certificate covers `server_names`.
pub fn init(
    dir: &Path,
    server_names: &[String],
    server_names_asked: &[String],
    nodes: &[String],
    services: &[String],
    validity: Duration,
) -> Result<Vec<Written>, CertsError> {
    // Every name is checked before anything is written.
    let specs = nodes
        .iter()
        .map(|n| NodeSpec::new(n, services, validity))
        .collect::<Result<Vec<_>, _>>()?;
    let mut written = Vec::new();
    let ca = match load_ca(dir)? {
        Some(ca) => ca,
        None => {
            let ca = Ca::generate("Ballast CA")?;
            ca.pem().write(dir, "ca")?;
            written.push(Written {
                path: dir.join("ca.pem"),
                summary: "the CA (keep ca.key off the fleet)".into(),
            });
            ca
        }
    };
    let crl = dir.join(CRL_FILE);
    if !crl.exists() {
        // An empty list from the start, so that the aggregator can be pointed at it
        // before anything is revoked.
        let pem = ca.revocation_list(&[], 1)?;
        std::fs::write(&crl, pem).map_err(io(&crl))?;
        written.push(Written {
            path: crl,
            summary: "the revocation list, empty (`certs revoke` adds to it)".into(),
        });
    }
    let server_pem = dir.join("server.pem");
    if !server_pem.exists() {
        written.push(write_server(&ca, dir, dir, server_names)?);
    } else if !server_names_asked.is_empty() {
        let pem = std::fs::read_to_string(&server_pem).map_err(io(&server_pem))?;
        let covered = server_names_of(&pem, &server_pem.display().to_string())?;
        let missing: Vec<&str> = server_names_asked
            .iter()
            .filter(|n| !covered.iter().any(|c| c.eq_ignore_ascii_case(n)))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(CertsError::ServerKept {
                path: server_pem.display().to_string(),
                names: missing.join(","),
                dir: dir.display().to_string(),
            });
        }
    }
    for spec in &specs {
        written.push(issue_into(dir, &ca, spec)?);
    }
    Ok(written)
}

/// The DNS names and IP addresses a server certificate (PEM, its leaf first) covers.
pub fn server_names_of(pem: &str, what: &str) -> Result<Vec<String>, CertsError> {
    use x509_parser::prelude::*;
    let chain = ballast_shared::tls::certs_from_pem(pem, what)?;
    let leaf = chain
        .first()
        .ok_or_else(|| TlsError::Certificate(format!("{what} holds no certificate")))?;
    let (_, x509) = X509Certificate::from_der(leaf.as_ref())
        .map_err(|e| TlsError::Certificate(format!("{what}: {e}")))?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(d) => names.push((*d).to_string()),
                GeneralName::IPAddress(b) => {
                    let ip = match b.len() {
                        4 => <[u8; 4]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        16 => <[u8; 16]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        _ => None,
                    };
                    names.extend(ip.map(|ip| ip.to_string()));
                }
                _ => {}
            }
        }
    }
    Ok(names)
}

/// Writes a server certificate from `ca` for `names` into `out/server.{pem,key}`.
/// The ledger in `dir` records it under the first of `names`.
fn write_server(ca: &Ca, dir: &Path, out: &Path, names: &[String]) -> Result<Written, CertsError> {
    let server = ca.issue_server(names)?;
    let name = names.first().map(String::as_str).unwrap_or("server");
    record_issued(dir, "server", name, &server.cert)?;
    server.write(out, "server")?;
    let expiry = ballast_shared::tls::certs_from_pem(&server.cert, "server.pem")?
        .first()
        .map(CertInfo::parse)
        .transpose()?
        .map(|i| describe_expiry(i.not_after_unix_s))
        .unwrap_or_default();
    Ok(Written {
        path: out.join("server.pem"),
        summary: format!("the server certificate for {}, {expiry}", names.join(", ")),
    })
}

/// Issues a server certificate from the CA in `dir` for a replica or relay called
/// `name`, covering `name` and each of `more` (DNS names or IP addresses: every name
/// and address agents or relays dial it by), into
/// `dir/servers/NAME/{ca.pem,server.pem,server.key}`, the directory its `--tls-dir`
/// names; any certificate there is replaced.
pub fn issue_server(dir: &Path, name: &str, more: &[String]) -> Result<Written, CertsError> {
    if name.is_empty() || !ballast_shared::wire::is_valid_name(name) {
        return Err(PkiError::BadName(name.to_string()).into());
    }
    let ca = load_ca(dir)?.ok_or_else(|| CertsError::NoCa(dir.display().to_string()))?;
    let mut names = vec![name.to_string()];
    for n in more {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    let out = dir.join("servers").join(name);
    let mut written = write_server(&ca, dir, &out, &names)?;
    let ca_copy = out.join("ca.pem");
    std::fs::copy(dir.join("ca.pem"), &ca_copy).map_err(io(&ca_copy))?;
    written.path = out;
    Ok(written)
}

/// Issues one node certificate from the CA in `dir`: node `node`, serving `services`,
/// valid for `validity`, into `dir/nodes/NODE/`.
pub fn issue(
    dir: &Path,
    node: &str,
    services: &[String],
    validity: Duration,
) -> Result<Written, CertsError> {
    let spec = NodeSpec::new(node, services, validity)?;
    let ca = load_ca(dir)?.ok_or_else(|| CertsError::NoCa(dir.display().to_string()))?;
    issue_into(dir, &ca, &spec)
}

/// Issues relay `name`'s certificate from the CA in `dir`, valid for `validity`, into
/// `dir/relays/NAME/{ca.pem,relay.pem,relay.key}` (a ready-made TLS directory for that
/// relay), replacing any before it.
pub fn issue_relay(dir: &Path, name: &str, validity: Duration) -> Result<Written, CertsError> {
    let spec = RelaySpec::new(name, validity)?;
    let ca = load_ca(dir)?.ok_or_else(|| CertsError::NoCa(dir.display().to_string()))?;
    let relay_dir = dir.join("relays").join(name);
    let issued = ca.issue_relay(&spec)?;
    record_issued(dir, "relay", name, &issued.pem.cert)?;
    issued.pem.write(&relay_dir, "relay")?;
    let ca_copy = relay_dir.join("ca.pem");
    std::fs::copy(dir.join("ca.pem"), &ca_copy).map_err(io(&ca_copy))?;
    Ok(Written {
        summary: format!("relay {name}, {}", describe_expiry(issued.not_after_unix_s)),
        path: relay_dir,
    })
}

/// What to revoke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevokeTarget {
    /// The certificate `certs init`, `certs issue` or `certs relay` wrote for this node
    /// or relay.
    Node(String),
    /// A certificate by its serial number, in hex (colons allowed).
    Serial(String),
}

/// Adds certificates to `dir/crl.pem` (made if missing), signed by the CA in `dir`: by
/// name, every node or relay certificate the ledger records for that name and the one
/// in its directory; by serial, that one.
pub fn revoke(dir: &Path, target: &RevokeTarget) -> Result<Written, CertsError> {
    let ca = load_ca(dir)?.ok_or_else(|| CertsError::NoCa(dir.display().to_string()))?;
    let (serials, what) = match target {
        RevokeTarget::Node(node) => {
            let mut serials: Vec<Vec<u8>> = ledger(dir)?
                .into_iter()
                .filter(|e| &e.name == node && (e.kind == "node" || e.kind == "relay"))
                .map(|e| e.serial)
                .collect();
            let kind = match issued_info(dir, node) {
                Ok((kind, info)) => {
                    if !serials.contains(&info.serial) {
                        serials.push(info.serial);
                    }
                    kind
                }
                Err(e) if serials.is_empty() => return Err(e),
                Err(_) => "node",
            };
            let what = match serials.as_slice() {
                [one] => format!("{kind} {node}'s certificate (serial {})", hex(one)),
                many => format!(
                    "{kind} {node}'s {} certificates (serials {})",
                    many.len(),
                    many.iter().map(|s| hex(s)).collect::<Vec<_>>().join(", ")
                ),
            };
            (serials, what)
        }
        RevokeTarget::Serial(hex) => (vec![parse_hex(hex)?], format!("serial {hex}")),
    };
    let crl_path = dir.join(CRL_FILE);
    let mut list = match std::fs::read_to_string(&crl_path) {
        Ok(pem) => RevocationList::from_pem(&pem, &crl_path.display().to_string())?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => RevocationList::default(),
        Err(e) => return Err(io(&crl_path)(e).into()),
    };
    let now = i64::try_from(ballast_shared::unix_ms() / 1000).unwrap_or(0);
    let mut added = 0;
    for serial in serials {
        if !list.revoked.iter().any(|r| r.serial == serial) {
            list.revoked.push(Revoked {
                serial,
                revoked_unix_s: now,
            });
            added += 1;
        }
    }
    let pem = ca.revocation_list(&list.revoked, list.number.saturating_add(1))?;
    // Written beside and renamed, so that a reader never sees half a list.
    let tmp = dir.join(format!(".{CRL_FILE}.tmp"));
    std::fs::write(&tmp, pem).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &crl_path).map_err(io(&crl_path))?;
    let state = if added == 0 {
        "already revoked"
    } else {
        "revoked"
    };
    Ok(Written {
        path: crl_path,
        summary: format!(
            "{what} {state}; the list holds {} certificate(s)",
            list.revoked.len()
        ),
    })
}

/// What the certificate `certs` wrote for node (or failing that relay) `name` says,
/// and which of the two it is.
fn issued_info(dir: &Path, name: &str) -> Result<(&'static str, CertInfo), CertsError> {
    let node = dir.join("nodes").join(name).join("node.pem");
    let relay = dir.join("relays").join(name).join("relay.pem");
    let (kind, path, pem) = match std::fs::read_to_string(&node) {
        Ok(pem) => ("node", node, pem),
        Err(_) => match std::fs::read_to_string(&relay) {
            Ok(pem) => ("relay", relay, pem),
            Err(_) => {
                return Err(CertsError::NoNode {
                    node: name.to_string(),
                    path: node.display().to_string(),
                })
            }
        },
    };
    let what = path.display().to_string();
    let chain = ballast_shared::tls::certs_from_pem(&pem, &what)?;
    let leaf = chain.first().ok_or_else(|| CertsError::NoNode {
        node: name.to_string(),
        path: what,
    })?;
    Ok((kind, CertInfo::parse(leaf)?))
}

fn parse_hex(s: &str) -> Result<Vec<u8>, CertsError> {
    let digits: String = s.chars().filter(|c| *c != ':').collect();
    let bad = || CertsError::BadSerial(s.to_string());
    if digits.is_empty() || !digits.len().is_multiple_of(2) || digits.len() > 64 {
        return Err(bad());
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| {
            digits
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const YEAR: Duration = Duration::from_secs(365 * 86_400);

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn info(dir: &Path, node: &str) -> CertInfo {
        let pem = std::fs::read_to_string(dir.join("nodes").join(node).join("node.pem"))
            .expect("node.pem");
        let chain = ballast_shared::tls::certs_from_pem(&pem, "node.pem").expect("pem");
        CertInfo::parse(&chain[0]).expect("info")
    }

    #[test]
    fn init_then_add_a_node_reuses_the_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let web = names(&["web"]);
        init(
            dir.path(),
            &default_server_names(),
            &[],
            &names(&["a"]),
            &web,
            YEAR,
        )
        .expect("init");
        let ca1 = std::fs::read_to_string(dir.path().join("ca.pem")).expect("ca");
        let w = init(
            dir.path(),
            &default_server_names(),
            &[],
            &names(&["b"]),
            &web,
            YEAR,
        )
        .expect("add");
        assert_eq!(w.len(), 1, "only the node is new: {w:?}");
        assert!(w[0].summary.contains("services web") && w[0].summary.contains("expires"));
        let ca2 = std::fs::read_to_string(dir.path().join("ca.pem")).expect("ca");
        assert_eq!(ca1, ca2);
        assert!(dir.path().join("nodes/b/node.key").exists());
        assert!(init(dir.path(), &[], &[], &names(&["bad/name"]), &web, YEAR).is_err());
        assert!(init(dir.path(), &[], &[], &names(&["c"]), &names(&["a b"]), YEAR).is_err());
        assert!(
            !dir.path().join("nodes/c").exists(),
            "nothing written for a bad service"
        );
    }

    #[test]
    fn issue_writes_services_and_validity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = issue(dir.path(), "n1", &names(&["web"]), YEAR).expect_err("no CA yet");
        assert!(err.to_string().contains("certs init"), "{err}");
        init(dir.path(), &default_server_names(), &[], &[], &[], YEAR).expect("init");
        let days = Duration::from_secs(30 * 86_400);
        let w = issue(dir.path(), "n1", &names(&["web", "api"]), days).expect("issue");
        assert!(
            w.summary.contains("in 29 days") || w.summary.contains("in 30 days"),
            "{w:?}"
        );
        let i = info(dir.path(), "n1");
        assert_eq!(i.services, ["web", "api"]);
        let now = i64::try_from(ballast_shared::unix_ms() / 1000).expect("now");
        assert!((i.not_after_unix_s - now - 30 * 86_400).abs() < 60, "{i:?}");
    }

    #[test]
    fn a_relay_certificate_is_written_and_revoked_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let week = Duration::from_secs(7 * 86_400);
        let err = issue_relay(dir.path(), "relay-1", week).expect_err("no CA yet");
        assert!(matches!(err, CertsError::NoCa(_)), "{err}");
        init(dir.path(), &default_server_names(), &[], &[], &[], YEAR).expect("init");
        let w = issue_relay(dir.path(), "relay-1", week).expect("relay");
        assert!(w.summary.starts_with("relay relay-1, expires"), "{w:?}");
        let rdir = dir.path().join("relays/relay-1");
        assert!(rdir.join("ca.pem").is_file() && rdir.join("relay.key").is_file());
        let pem = std::fs::read_to_string(rdir.join("relay.pem")).expect("relay.pem");
        let chain = ballast_shared::tls::certs_from_pem(&pem, "relay.pem").expect("pem");
        let info = CertInfo::parse(&chain[0]).expect("info");
        assert_eq!(info.identity, "relay-1");
        assert!(info.has_role(pki::RELAY_ROLE) && info.services.is_empty());
        assert!(issue_relay(dir.path(), "bad/name", week).is_err());
        let w = revoke(dir.path(), &RevokeTarget::Node("relay-1".into())).expect("revoke");
        assert!(
            w.summary.starts_with("relay relay-1's certificate"),
            "{w:?}"
        );
        let pem = std::fs::read_to_string(dir.path().join(CRL_FILE)).expect("crl");
        let list = RevocationList::from_pem(&pem, "crl").expect("parse");
        assert_eq!(list.revoked.len(), 1);
        assert_eq!(list.revoked[0].serial, info.serial);
    }

    #[test]
    fn a_server_certificate_for_a_replica_names_what_it_is_dialled_by() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = issue_server(dir.path(), "agg-2", &[]).expect_err("no CA yet");
        assert!(matches!(err, CertsError::NoCa(_)), "{err}");
        let first = names(&["agg.example"]);
        init(dir.path(), &first, &first, &[], &[], YEAR).expect("init");
        init(dir.path(), &first, &first, &names(&["n"]), &[], YEAR).expect("same names");
        let other = names(&["agg.example", "10.0.0.1"]);
        let err = init(dir.path(), &other, &other, &[], &[], YEAR).expect_err("kept");
        assert!(
            err.to_string().contains("certs server")
                && err
                    .to_string()
                    .contains("does not cover --server-name 10.0.0.1:"),
            "{err}"
        );
        let w = issue_server(
            dir.path(),
            "agg-2.example",
            &names(&["10.0.0.2", "agg-2.example"]),
        )
        .expect("server");
        assert!(
            w.summary
                .starts_with("the server certificate for agg-2.example, 10.0.0.2, expires"),
            "{w:?}"
        );
        let out = dir.path().join("servers/agg-2.example");
        assert_eq!(w.path, out);
        assert_eq!(
            std::fs::read(out.join("ca.pem")).expect("ca copy"),
            std::fs::read(dir.path().join("ca.pem")).expect("ca")
        );
        assert!(out.join("server.key").is_file());
        let pem = std::fs::read_to_string(out.join("server.pem")).expect("server.pem");
        assert_eq!(
            server_names_of(&pem, "server.pem").expect("names"),
            ["agg-2.example", "10.0.0.2"]
        );
        assert!(issue_server(dir.path(), "bad/name", &[]).is_err());
    }

    fn revoked(dir: &Path) -> Vec<Vec<u8>> {
        let pem = std::fs::read_to_string(dir.join(CRL_FILE)).expect("crl");
        let list = RevocationList::from_pem(&pem, "crl").expect("parse");
        list.revoked.into_iter().map(|r| r.serial).collect()
    }

    #[test]
    fn revoking_a_node_revokes_every_certificate_it_was_issued() {
        let dir = tempfile::tempdir().expect("tempdir");
        let web = names(&["web"]);
        init(
            dir.path(),
            &default_server_names(),
            &[],
            &names(&["a", "b"]),
            &web,
            YEAR,
        )
        .expect("init");
        // A copy of a's first certificate is taken; then a is issued again (a new host,
        // a renewal), which replaces nodes/a/node.pem.
        let stolen = info(dir.path(), "a").serial;
        issue(dir.path(), "a", &web, YEAR).expect("again");
        let current = info(dir.path(), "a").serial;
        assert_ne!(stolen, current);
        let entries = ledger(dir.path()).expect("ledger");
        let kinds: Vec<(&str, &str)> = entries
            .iter()
            .map(|e| (e.kind.as_str(), e.name.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("server", "localhost"),
                ("node", "a"),
                ("node", "b"),
                ("node", "a")
            ]
        );
        let w = revoke(dir.path(), &RevokeTarget::Node("a".into())).expect("revoke");
        assert!(w.summary.contains("node a's 2 certificates"), "{w:?}");
        assert_eq!(
            revoked(dir.path()),
            [stolen, current],
            "both of a's, none of b's"
        );
        // By serial: exactly that one.
        let b = info(dir.path(), "b").serial;
        revoke(dir.path(), &RevokeTarget::Serial(hex(&b))).expect("by serial");
        assert_eq!(revoked(dir.path()).len(), 3);
        // A node whose directory is gone is still revoked through the ledger.
        issue(dir.path(), "c", &web, YEAR).expect("c");
        let c = info(dir.path(), "c").serial;
        std::fs::remove_dir_all(dir.path().join("nodes/c")).expect("rm");
        revoke(dir.path(), &RevokeTarget::Node("c".into())).expect("from the ledger");
        assert!(revoked(dir.path()).contains(&c));
    }

    #[test]
    fn a_damaged_ledger_line_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        init(
            dir.path(),
            &default_server_names(),
            &[],
            &names(&["a"]),
            &[],
            YEAR,
        )
        .expect("init");
        let path = dir.path().join(LEDGER_FILE);
        let mut text = std::fs::read_to_string(&path).expect("ledger");
        text.push_str("1700000000 node a zz 1800000000\n");
        std::fs::write(&path, text).expect("write");
        let err = revoke(dir.path(), &RevokeTarget::Node("a".into())).expect_err("damaged");
        assert!(
            matches!(&err, CertsError::Ledger { line: 4, .. })
                && err.to_string().contains("bad serial"),
            "{err}"
        );
    }

    #[test]
    fn revoke_adds_to_the_list_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let web = names(&["web"]);
        init(
            dir.path(),
            &default_server_names(),
            &[],
            &names(&["a", "b"]),
            &web,
            YEAR,
        )
        .expect("init");
        let w = revoke(dir.path(), &RevokeTarget::Node("a".into())).expect("revoke");
        assert!(w.summary.contains("holds 1"), "{w:?}");
        let w = revoke(dir.path(), &RevokeTarget::Node("a".into())).expect("again");
        assert!(w.summary.contains("already revoked"), "{w:?}");
        revoke(
            dir.path(),
            &RevokeTarget::Serial(info(dir.path(), "b").serial_hex()),
        )
        .expect("by serial");
        let pem = std::fs::read_to_string(dir.path().join(CRL_FILE)).expect("crl");
        let list = RevocationList::from_pem(&pem, "crl").expect("parse");
        assert_eq!(list.number, 4, "init's empty list, then three");
        let serials: Vec<Vec<u8>> = list.revoked.iter().map(|r| r.serial.clone()).collect();
        assert_eq!(
            serials,
            [info(dir.path(), "a").serial, info(dir.path(), "b").serial]
        );
        assert!(matches!(
            revoke(dir.path(), &RevokeTarget::Node("zz".into())),
            Err(CertsError::NoNode { .. })
        ));
        assert!(matches!(
            revoke(dir.path(), &RevokeTarget::Serial("xyz".into())),
            Err(CertsError::BadSerial(_))
        ));
    }
}
