//! Configuration helpers both daemons use: TOML files with errors that name the file
//! and line, the TLS file triple, and logging set-up.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Not valid TOML for the schema; the message carries line and column.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What and where.
        message: String,
    },
    /// A value is missing or out of range.
    #[error("{0}")]
    Invalid(String),
}

/// Parses TOML text; `origin` names it in errors.
pub fn parse_toml<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: origin.to_string(),
        message: e.to_string(),
    })
}

/// Reads and parses a TOML file.
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_toml(&text, &path.display().to_string())
}

/// The TLS files of one side: the CA that signs the other side, and this side's own
/// certificate and key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// CA certificate(s) trusted for the peer.
    pub ca: PathBuf,
    /// This side's certificate chain.
    pub cert: PathBuf,
    /// This side's private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// `ca.pem`, `NAME.pem` and `NAME.key` in `dir`, as `ballast-aggregator certs init`
    /// lays them out (`server` for the aggregator, `node` for an agent).
    pub fn in_dir(dir: &Path, name: &str) -> Self {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }

    /// The client or server identity these files hold.
    pub fn identity(&self) -> Result<crate::tls::Identity, crate::tls::TlsError> {
        crate::tls::Identity::load(&self.cert, &self.key)
    }

    /// The trusted CA certificates.
    pub fn ca_certs(
        &self,
    ) -> Result<Vec<crate::tls::CertificateDer<'static>>, crate::tls::TlsError> {
        crate::tls::certs_from_pem(&crate::tls::read(&self.ca)?, &self.ca.display().to_string())
    }
}

/// Logs to stderr, human-readable or as JSON lines; `RUST_LOG` overrides `default`.
pub fn init_logging(json: bool, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second initialisation (tests, embedding) is harmless: keep the first.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
