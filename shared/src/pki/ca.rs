//! The certificate authority: certificates and revocation lists issued with rcgen.

use super::{is_valid_service, DEFAULT_VALIDITY, RELAY_ROLE, ROLE_URI_PREFIX, SERVICE_URI_PREFIX};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevokedCertParams, SanType, SerialNumber,
};
use std::path::Path;
use std::time::Duration;

/// How far back a new certificate's validity starts, so that a node whose clock runs a
/// little behind the issuer's can use it at once.
const BACKDATE_S: i64 = 3600;

/// Why a certificate could not be issued or stored.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// rcgen refused.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A name is not usable in a certificate.
    #[error("invalid name {0:?}")]
    BadName(String),
    /// A service name is not usable: empty, too long, or with characters outside
    /// `[A-Za-z0-9._-]`.
    #[error("invalid service name {0:?} (letters, digits, '.', '_', '-'; at most 128)")]
    BadService(String),
    /// A validity period that is zero or beyond what a certificate can carry.
    #[error("invalid validity period: {0}")]
    BadValidity(String),
    /// A certificate or revocation list could not be read.
    #[error("{what}: {reason}")]
    Parse {
        /// What was being read.
        what: String,
        /// Why it could not be.
        reason: String,
    },
}

/// A PEM certificate and its PEM private key.
#[derive(Debug, Clone)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// The private key.
    pub key: String,
}

impl Pem {
    /// The pair as a TLS identity.
    pub fn identity(&self, what: &str) -> Result<crate::tls::Identity, crate::tls::TlsError> {
        crate::tls::Identity::from_pem(&self.cert, &self.key, what)
    }

    /// Writes `NAME.pem` and `NAME.key` into `dir`; the key is readable by its owner only.
    pub fn write(&self, dir: &Path, name: &str) -> Result<(), PkiError> {
        write_file(&dir.join(format!("{name}.pem")), &self.cert, 0o644)?;
        write_file(&dir.join(format!("{name}.key")), &self.key, 0o600)
    }
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| PkiError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

/// A certificate authority that signs server and node certificates.
pub struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn generate(name: &str) -> Result<Ca, PkiError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Ca { key, cert })
    }

    /// A CA loaded from its PEM certificate and key, to issue more certificates later.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, PkiError> {
        let key = KeyPair::from_pem(key_pem)?;
        let params = CertificateParams::from_ca_cert_pem(cert_pem)?;
        let cert = params.self_signed(&key)?;
        Ok(Ca { key, cert })
    }

    /// The CA's own certificate and key.
    pub fn pem(&self) -> Pem {
        Pem {
            cert: self.cert.pem(),
            key: self.key.serialize_pem(),
        }
    }

    /// A server certificate for the aggregator, valid for each of `names` (DNS names or
    /// IP addresses).
    pub fn issue_server(&self, names: &[String]) -> Result<Pem, PkiError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(names
            .first()
            .map(String::as_str)
            .unwrap_or("ballast-aggregator"));
        params.subject_alt_names = names.iter().map(|n| san(n)).collect::<Result<_, _>>()?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate for `node`, which may serve each of `services`, valid for
    /// [`DEFAULT_VALIDITY`] from now.
    pub fn issue_node(&self, node: &str, services: &[String]) -> Result<Issued, PkiError> {
        self.issue_node_with(&NodeSpec::new(node, services, DEFAULT_VALIDITY)?)
    }

    /// A client certificate as `spec` describes it; the aggregator binds reports to its
    /// node and authorizes its services.
    pub fn issue_node_with(&self, spec: &NodeSpec) -> Result<Issued, PkiError> {
        let node = spec.node.as_str();
        if node.is_empty() || !crate::wire::is_valid_name(node) {
            return Err(PkiError::BadName(node.to_string()));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(node);
        params.subject_alt_names = vec![san(node)?];
        for service in &spec.services {
            params.subject_alt_names.push(service_san(service)?);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = datetime(spec.not_before_unix_s)?;
        params.not_after = datetime(spec.not_after_unix_s)?;
        Ok(Issued {
            pem: self.sign(params)?,
            not_after_unix_s: spec.not_after_unix_s,
        })
    }

    /// A client certificate for a relay, as `spec` describes it: the relay's name as
    /// common name and DNS subject alternative name, the role [`RELAY_ROLE`], and no
    /// service.
    pub fn issue_relay(&self, spec: &RelaySpec) -> Result<Issued, PkiError> {
        let name = spec.name.as_str();
        if name.is_empty() || !crate::wire::is_valid_name(name) {
            return Err(PkiError::BadName(name.to_string()));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(name);
        params.subject_alt_names = vec![san(name)?, role_san(RELAY_ROLE)?];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = datetime(spec.not_before_unix_s)?;
        params.not_after = datetime(spec.not_after_unix_s)?;
        Ok(Issued {
            pem: self.sign(params)?,
            not_after_unix_s: spec.not_after_unix_s,
        })
    }

    /// A certificate shaped like a SPIFFE X.509-SVID as SPIRE issues them: its only
    /// subject alternative name the URI `spiffe_id`, no common name (the subject is
    /// `O=SPIRE, C=US`), for client and server authentication, valid from `window`'s
    /// first to its second second since the Unix epoch. For trying SPIFFE identities
    /// without a SPIRE server; `spiffe_id` must be a SPIFFE ID.
    pub fn issue_svid(&self, spiffe_id: &str, window: (i64, i64)) -> Result<Pem, PkiError> {
        if !crate::tls::is_spiffe_id(spiffe_id) {
            return Err(PkiError::BadName(spiffe_id.to_string()));
        }
        let mut params = CertificateParams::default();
        let mut subject = DistinguishedName::new();
        subject.push(DnType::CountryName, "US");
        subject.push(DnType::OrganizationName, "SPIRE");
        params.distinguished_name = subject;
        let uri = spiffe_id
            .to_string()
            .try_into()
            .map_err(|_| PkiError::BadName(spiffe_id.to_string()))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyAgreement,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = datetime(window.0)?;
        params.not_after = datetime(window.1)?;
        self.sign(params)
    }

    /// A revocation list (PEM) signed by this CA, listing `revoked`, numbered
    /// `number` (each new list must carry a higher number than the last).
    pub fn revocation_list(&self, revoked: &[Revoked], number: u64) -> Result<String, PkiError> {
        let now = unix_s();
        let params = CertificateRevocationListParams {
            this_update: datetime(now)?,
            // Ballast does not enforce the next update; other readers may, so a year.
            next_update: datetime(now.saturating_add(365 * 24 * 3600))?,
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: revoked
                .iter()
                .map(|r| {
                    Ok(RevokedCertParams {
                        serial_number: SerialNumber::from_slice(&r.serial),
                        revocation_time: datetime(r.revoked_unix_s)?,
                        reason_code: None,
                        invalidity_date: None,
                    })
                })
                .collect::<Result<_, PkiError>>()?,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        Ok(params.signed_by(&self.cert, &self.key)?.pem()?)
    }

    fn sign(&self, params: CertificateParams) -> Result<Pem, PkiError> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// A node certificate to issue: whom it names, what it may serve, and when it is
/// valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// The node's identity.
    pub node: String,
    /// The services it may serve (none: what the aggregator's policy grants alone).
    pub services: Vec<String>,
    /// Valid from, in seconds since the Unix epoch.
    pub not_before_unix_s: i64,
    /// Valid until, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
}

impl NodeSpec {
    /// `node`, serving `services`, valid from (a little before) now for `validity`.
    pub fn new(node: &str, services: &[String], validity: Duration) -> Result<Self, PkiError> {
        let (not_before_unix_s, not_after_unix_s) = window(validity)?;
        Ok(NodeSpec {
            node: node.to_string(),
            services: services.to_vec(),
            not_before_unix_s,
            not_after_unix_s,
        })
    }
}

/// A relay certificate to issue: the relay's name and when it is valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelaySpec {
    /// The relay's identity.
    pub name: String,
    /// Valid from, in seconds since the Unix epoch.
    pub not_before_unix_s: i64,
    /// Valid until, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
}

impl RelaySpec {
    /// Relay `name`, valid from (a little before) now for `validity`.
    pub fn new(name: &str, validity: Duration) -> Result<Self, PkiError> {
        let (not_before_unix_s, not_after_unix_s) = window(validity)?;
        Ok(RelaySpec {
            name: name.to_string(),
            not_before_unix_s,
            not_after_unix_s,
        })
    }
}

/// From (a little before) now for `validity`, in seconds since the Unix epoch.
fn window(validity: Duration) -> Result<(i64, i64), PkiError> {
    let secs = i64::try_from(validity.as_secs())
        .ok()
        .filter(|s| *s > 0 && *s <= MAX_VALIDITY_S)
        .ok_or_else(|| {
            PkiError::BadValidity(format!(
                "{} s (between 1 s and {} days)",
                validity.as_secs(),
                MAX_VALIDITY_S / 86_400
            ))
        })?;
    let now = unix_s();
    Ok((now - BACKDATE_S, now + secs))
}

/// The longest validity accepted: 100 years.
const MAX_VALIDITY_S: i64 = 100 * 365 * 24 * 3600;

/// A certificate just issued, and when it expires.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate and its key.
    pub pem: Pem,
    /// When it expires, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
}

/// One revoked certificate in a revocation list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoked {
    /// Its serial number, big-endian.
    pub serial: Vec<u8>,
    /// When it was revoked, in seconds since the Unix epoch.
    pub revoked_unix_s: i64,
}

/// What a revocation list holds: its number and its entries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RevocationList {
    /// The list's number (0 for a list without one).
    pub number: u64,
    /// The certificates it revokes.
    pub revoked: Vec<Revoked>,
}

impl RevocationList {
    /// Reads a PEM revocation list; `what` names it in errors.
    pub fn from_pem(pem: &str, what: &str) -> Result<Self, PkiError> {
        let bad = |reason: String| PkiError::Parse {
            what: what.to_string(),
            reason,
        };
        let der = rustls_pemfile::crls(&mut pem.as_bytes())
            .next()
            .ok_or_else(|| bad("no X509 CRL in PEM".into()))?
            .map_err(|e| bad(e.to_string()))?;
        use x509_parser::prelude::FromDer;
        let (_, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(&der)
            .map_err(|e| bad(e.to_string()))?;
        let number = crl
            .crl_number()
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0);
        let revoked = crl
            .iter_revoked_certificates()
            .map(|r| Revoked {
                serial: r.raw_serial().to_vec(),
                revoked_unix_s: r.revocation_date.timestamp(),
            })
            .collect();
        Ok(RevocationList { number, revoked })
    }
}

/// Seconds since the Unix epoch now.
fn unix_s() -> i64 {
    i64::try_from(crate::unix_ms() / 1000).unwrap_or(i64::MAX)
}

fn datetime(unix_s: i64) -> Result<time::OffsetDateTime, PkiError> {
    time::OffsetDateTime::from_unix_timestamp(unix_s)
        .map_err(|e| PkiError::BadValidity(e.to_string()))
}

fn service_san(service: &str) -> Result<SanType, PkiError> {
    if !is_valid_service(service) {
        return Err(PkiError::BadService(service.to_string()));
    }
    let uri = format!("{SERVICE_URI_PREFIX}{service}")
        .try_into()
        .map_err(|_| PkiError::BadService(service.to_string()))?;
    Ok(SanType::URI(uri))
}

fn role_san(role: &str) -> Result<SanType, PkiError> {
    let uri = format!("{ROLE_URI_PREFIX}{role}")
        .try_into()
        .map_err(|_| PkiError::BadName(role.to_string()))?;
    Ok(SanType::URI(uri))
}

fn dn(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

fn san(name: &str) -> Result<SanType, PkiError> {
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let ia5 = name
        .to_string()
        .try_into()
        .map_err(|_| PkiError::BadName(name.to_string()))?;
    Ok(SanType::DnsName(ia5))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn services(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn an_svid_names_its_node_by_the_last_segment_of_its_spiffe_id() {
        let ca = Ca::generate("spire CA").expect("ca");
        let now = unix_s();
        let id = "spiffe://prod.example/ns/web/sa/web-3";
        let svid = ca.issue_svid(id, (now - 30, now + 3600)).expect("svid");
        let chain = svid.identity("svid").expect("parses").chain;
        let info = crate::tls::CertInfo::parse(&chain[0]).expect("info");
        assert_eq!(info.spiffe_id.as_deref(), Some(id));
        assert_eq!(info.identity, "web-3");
        assert!(info.services.is_empty() && info.roles.is_empty());
        assert_eq!(info.not_after_unix_s, now + 3600);
        // No usable last segment and nothing else: no identity.
        for bad in ["spiffe://prod.example", "spiffe://prod.example/a/b%20c"] {
            let refused = ca
                .issue_svid(bad, (now, now + 60))
                .ok()
                .and_then(|pem| pem.identity("svid").ok())
                .map(|i| crate::tls::CertInfo::parse(&i.chain[0]));
            assert!(!matches!(refused, Some(Ok(_))), "{bad}: {refused:?}");
        }
        assert!(ca.issue_svid("https://example/x", (now, now + 60)).is_err());
        assert_eq!(
            crate::tls::spiffe_node_name("spiffe://td/a/b.c"),
            Some("b.c".into())
        );
        assert!(!crate::tls::is_spiffe_id("spiffe://TD/x"));
        assert!(!crate::tls::is_spiffe_id("spiffe://td/x//y"));
        assert!(crate::tls::is_spiffe_id("spiffe://td"));
    }

    #[test]
    fn node_certificate_names_the_node_its_services_and_its_expiry() {
        let ca = Ca::generate("test CA").expect("ca");
        let node = ca
            .issue_node("web-7", &services(&["web", "web-canary"]))
            .expect("node");
        let id = node.pem.identity("node").expect("parses");
        let info = crate::tls::CertInfo::parse(&id.chain[0]).expect("info");
        assert_eq!(info.identity, "web-7");
        assert_eq!(info.services, ["web", "web-canary"]);
        assert_eq!(info.not_after_unix_s, node.not_after_unix_s);
        let year = DEFAULT_VALIDITY.as_secs() as i64;
        assert!(
            (info.not_after_unix_s - unix_s() - year).abs() < 60,
            "{info:?}"
        );
        assert!(info.not_before_unix_s < unix_s(), "{info:?}");
    }

    #[test]
    fn relay_certificate_names_the_relay_and_its_role_only() {
        let ca = Ca::generate("test CA").expect("ca");
        let spec = RelaySpec::new("relay-eu-1", Duration::from_secs(7 * 86_400)).expect("spec");
        let relay = ca.issue_relay(&spec).expect("relay");
        let id = relay.pem.identity("relay").expect("parses");
        let info = crate::tls::CertInfo::parse(&id.chain[0]).expect("info");
        assert_eq!(info.identity, "relay-eu-1");
        assert_eq!(info.roles, [RELAY_ROLE]);
        assert!(info.has_role(RELAY_ROLE));
        assert!(info.services.is_empty(), "{info:?}");
        assert_eq!(info.not_after_unix_s, spec.not_after_unix_s);
        let node = ca.issue_node("web-1", &services(&["web"])).expect("node");
        let id = node.pem.identity("node").expect("parses");
        let info = crate::tls::CertInfo::parse(&id.chain[0]).expect("info");
        assert!(
            info.roles.is_empty() && !info.has_role(RELAY_ROLE),
            "{info:?}"
        );
        let bad = RelaySpec::new("bad/name", Duration::from_secs(60)).expect("spec");
        assert!(matches!(ca.issue_relay(&bad), Err(PkiError::BadName(_))));
        assert!(matches!(
            RelaySpec::new("r", Duration::ZERO),
            Err(PkiError::BadValidity(_))
        ));
    }

    #[test]
    fn ca_round_trips_through_pem() {
        let ca = Ca::generate("test CA").expect("ca");
        let pem = ca.pem();
        let again = Ca::from_pem(&pem.cert, &pem.key).expect("loads");
        again.issue_node("n1", &[]).expect("issues");
        assert!(ca.issue_node("bad/name", &[]).is_err());
        assert!(matches!(
            ca.issue_node("n1", &services(&["a/b"])),
            Err(PkiError::BadService(_))
        ));
        assert!(matches!(
            NodeSpec::new("n1", &[], Duration::ZERO),
            Err(PkiError::BadValidity(_))
        ));
    }

    #[test]
    fn a_revocation_list_round_trips() {
        let ca = Ca::generate("test CA").expect("ca");
        let revoked = vec![
            Revoked {
                serial: vec![0x12, 0x34],
                revoked_unix_s: 1_700_000_000,
            },
            Revoked {
                serial: vec![0x7f; 20],
                revoked_unix_s: 1_700_000_100,
            },
        ];
        let pem = ca.revocation_list(&revoked, 7).expect("crl");
        let list = RevocationList::from_pem(&pem, "crl").expect("parses");
        assert_eq!(list.number, 7);
        assert_eq!(list.revoked, revoked);
        assert!(RevocationList::from_pem("nothing", "crl").is_err());
    }
}
