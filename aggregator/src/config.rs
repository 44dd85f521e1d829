//! The aggregator's configuration file.

use crate::balance::Params;
pub use ballast_shared::config::{ConfigError, TlsFiles};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The embedded routing store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// The weights file.
    pub path: PathBuf,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: PathBuf::from("/var/lib/ballast/weights.json"),
        }
    }
}

/// The whole configuration. Every field has a default, so an empty file is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// UDP address for agents' QUIC connections.
    pub quic: SocketAddr,
    /// TCP address of the HTTP API.
    pub http: SocketAddr,
    /// How often agents report, in milliseconds.
    pub report_interval_ms: u32,
    /// TLS files.
    pub tls: TlsFiles,
    /// Routing store.
    pub store: StoreConfig,
    /// If set, only these services may register; otherwise any may (zero config).
    pub services: Option<Vec<String>>,
    /// TCP address of the xDS (ADS) server; none by default.
    pub xds: Option<SocketAddr>,
    /// Load-balancing policy of the xDS clusters: `ring_hash` for proxyless gRPC,
    /// `round_robin` or `least_request` for Envoy.
    pub xds_lb_policy: crate::feed::xds::LbPolicy,
    /// Balancing defaults for every service.
    pub balance: Params,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            quic: SocketAddr::from(([0, 0, 0, 0], 7400)),
            http: SocketAddr::from(([127, 0, 0, 1], 7401)),
            report_interval_ms: 1000,
            tls: TlsFiles::in_dir(Path::new("/etc/ballast/tls"), "server"),
            store: StoreConfig::default(),
            services: None,
            balance: Params::default(),
            xds: None,
            xds_lb_policy: crate::feed::xds::LbPolicy::default(),
        }
    }
}

impl Config {
    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let cfg: Config = ballast_shared::config::parse_toml(text, origin)?;
        cfg.validate()
            .map_err(|message| ConfigError::Invalid(format!("{origin}: {message}")))?;
        Ok(cfg)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = ballast_shared::config::load_toml(path)?;
        cfg.validate()
            .map_err(|message| ConfigError::Invalid(format!("{}: {message}", path.display())))?;
        Ok(cfg)
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), String> {
        self.balance
            .validate()
            .map_err(|e| format!("balance.{e}"))?;
        if !(100..=60_000).contains(&self.report_interval_ms) {
            return Err("report_interval_ms must be between 100 and 60000".into());
        }
        if let Some(services) = &self.services {
            if let Some(bad) = services
                .iter()
                .find(|s| s.is_empty() || !ballast_shared::wire::is_valid_name(s))
            {
                return Err(format!("services: {bad:?} is not a valid service name"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(Config::parse("", "t").expect("parses"), Config::default());
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let err = Config::parse("quic = \"0.0.0.0:7400\"\nbogus = 1\n", "agg.toml")
            .expect_err("unknown key");
        let msg = err.to_string();
        assert!(msg.contains("agg.toml") && msg.contains("line 2"), "{msg}");
        let err =
            Config::parse("[balance]\nmissing_threshold = 2.0\n", "agg.toml").expect_err("range");
        assert!(err.to_string().contains("missing_threshold"), "{err}");
    }
}
