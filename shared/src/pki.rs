//! A small certificate authority, so that a first run needs no openssl: the
//! aggregator's `certs init`, the demo and the tests all issue certificates here.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use std::path::Path;

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

    /// A client certificate naming node `node`; the aggregator binds reports to it.
    pub fn issue_node(&self, node: &str) -> Result<Pem, PkiError> {
        if node.is_empty() || !crate::wire::is_valid_name(node) {
            return Err(PkiError::BadName(node.to_string()));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(node);
        params.subject_alt_names = vec![san(node)?];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
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

    #[test]
    fn node_certificate_names_the_node() {
        let ca = Ca::generate("test CA").expect("ca");
        let node = ca.issue_node("web-7").expect("node");
        let id = node.identity("node").expect("parses");
        assert_eq!(crate::tls::identity_of(&id.chain[0]).expect("id"), "web-7");
    }

    #[test]
    fn ca_round_trips_through_pem() {
        let ca = Ca::generate("test CA").expect("ca");
        let pem = ca.pem();
        let again = Ca::from_pem(&pem.cert, &pem.key).expect("loads");
        again.issue_node("n1").expect("issues");
        assert!(ca.issue_node("bad/name").is_err());
    }
}
