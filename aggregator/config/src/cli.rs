//! The command-line flags the aggregator and the relay share ([`CommonArgs`],
//! [`HttpArgs`]), and the relay's ([`RelayArgs`]), with how they amend a configuration
//! file.

use crate::{BalanceTable, Config, EtcdConfig, TlsFiles};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The settings the daemon and the relay share; each overrides the configuration file.
#[derive(Args, Clone, Default)]
pub struct CommonArgs {
    /// TOML configuration file.
    #[arg(long, short, env = "BALLAST_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// UDP address for agents (QUIC) [default: 0.0.0.0:7400].
    #[arg(long, env = "BALLAST_QUIC")]
    pub quic: Option<SocketAddr>,
    /// TCP address of the HTTP API and /metrics [default: 127.0.0.1:7401].
    #[arg(long, env = "BALLAST_HTTP")]
    pub http: Option<SocketAddr>,
    /// Directory with ca.pem, server.pem and server.key: the certificate agents check
    /// [default: /etc/ballast/tls].
    #[arg(long, env = "BALLAST_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Keep weights in etcd at these endpoints (comma-separated URLs) instead of the
    /// store file. Needs a binary built with the `etcd` feature.
    #[arg(long, env = "BALLAST_ETCD", value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// Key prefix in etcd; needs --etcd or [store.etcd] [default: /ballast].
    #[arg(long, env = "BALLAST_ETCD_PREFIX")]
    pub etcd_prefix: Option<String>,
    /// CA certificate (PEM) that etcd's server certificate is checked against; needed
    /// with https:// endpoints.
    #[arg(long, env = "BALLAST_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that checks them; needs --etcd-key.
    #[arg(long, env = "BALLAST_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "BALLAST_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user to authenticate as; needs --etcd-password-file.
    #[arg(long, env = "BALLAST_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (one line).
    #[arg(long, env = "BALLAST_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// Run as one replica of the named cluster (a relay: serve that cluster's agents):
    /// replicas on the same etcd share the services, each served by one of them at a
    /// time. Needs --etcd or [store.etcd].
    #[arg(long, env = "BALLAST_CLUSTER")]
    pub cluster: Option<String>,
    /// Authorization policy file: the services, networks and host names node identity
    /// patterns may claim, beyond what their certificates name.
    #[arg(long, env = "BALLAST_POLICY")]
    pub policy: Option<PathBuf>,
    /// Certificate revocation list (PEM), reloaded when it changes.
    #[arg(long, env = "BALLAST_CRL")]
    pub crl: Option<PathBuf>,
    /// Log as JSON lines.
    #[arg(long, env = "BALLAST_LOG_JSON", global = true)]
    pub log_json: bool,
}

/// The relay's settings; each overrides the configuration file.
#[derive(Args, Clone, Default)]
pub struct RelayArgs {
    /// The settings the daemon has too. --tls-dir holds the identity agents see; the
    /// etcd flags are the daemon's only: a relay reads no etcd.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Directory with the relay's own client identity for trunks to the replicas:
    /// ca.pem, relay.pem and relay.key (`ballast-aggregator certs relay DIR NAME`
    /// writes them to DIR/relays/NAME) [default: /etc/ballast/relay-tls].
    #[arg(long, env = "BALLAST_RELAY_TLS_DIR")]
    pub relay_tls_dir: Option<PathBuf>,
    /// The relay's name, told to the replicas (default: host name and QUIC port).
    #[arg(long, env = "BALLAST_RELAY_NAME")]
    pub name: Option<String>,
    /// A replica to learn the cluster's routes from, host:port (its QUIC address);
    /// repeat it, or separate addresses with commas. Replaces `[relay] replicas`.
    #[arg(
        long = "replica",
        env = "BALLAST_RELAY_REPLICAS",
        value_delimiter = ','
    )]
    pub replicas: Vec<String>,
    /// The HTTP port's TLS and credentials.
    #[command(flatten)]
    pub http: HttpArgs,
}

/// The HTTP listener's flags, the daemon's (its API and /metrics) and the relay's (its
/// /metrics and /healthz) alike; each overrides the configuration file.
#[derive(Args, Clone, Default)]
pub struct HttpArgs {
    /// HTTPS on the HTTP port (an aggregator's API and /metrics, a relay's /metrics and
    /// /healthz) with the files of this directory: ca.pem (client certificates are checked
    /// against it), server.pem and server.key, as `certs init` lays them out; the
    /// --tls-dir will do (`[http_tls]`).
    #[arg(long, env = "BALLAST_HTTP_TLS_DIR")]
    pub http_tls_dir: Option<PathBuf>,
    /// The token file of the HTTP port (`[http_auth] tokens`): entries from
    /// `ballast-aggregator token new` or `token hash` (on a relay, of role scrape for
    /// a scraper).
    #[arg(long, env = "BALLAST_HTTP_TOKENS")]
    pub http_tokens: Option<PathBuf>,
    /// Serve the HTTP port (an aggregator's API, a relay's /metrics) on an address other
    /// than loopback without TLS or credentials (`insecure_http = true`).
    #[arg(long, env = "BALLAST_INSECURE_HTTP")]
    pub insecure_http: bool,
}

impl HttpArgs {
    /// These flags, with those given before the subcommand (`top`) where these are unset.
    pub fn inherit(&mut self, top: &HttpArgs) {
        crate::fill_unset!(self, top; http_tls_dir, http_tokens);
        self.insecure_http |= top.insecure_http;
    }

    /// Amends `cfg` with these flags: `[http_tls]` in the directory, the token file,
    /// `insecure_http`. Nothing is validated yet.
    pub fn apply<B: BalanceTable>(&self, cfg: &mut Config<B>) {
        if let Some(dir) = &self.http_tls_dir {
            cfg.http_tls = Some(TlsFiles::in_dir(dir, "server"));
        }
        if let Some(tokens) = &self.http_tokens {
            cfg.http_auth.tokens = Some(tokens.clone());
        }
        cfg.insecure_http |= self.insecure_http;
    }
}

/// Fills every unset field of `$dst` from `$src` (the flags given before a subcommand,
/// inherited by the subcommand's own).
#[macro_export]
macro_rules! fill_unset {
    ($dst:expr, $src:expr; $($f:ident),*) => {
        $( if $dst.$f.is_none() { $dst.$f.clone_from(&$src.$f); } )*
    };
}

impl CommonArgs {
    /// These flags, with those given before the subcommand (`top`) where these are unset.
    pub fn inherit(&mut self, top: &CommonArgs) {
        crate::fill_unset!(self, top; config, quic, http, tls_dir, etcd, etcd_prefix, etcd_ca, etcd_cert,
            etcd_key, etcd_user, etcd_password_file, cluster, policy, crl);
        self.log_json |= top.log_json;
    }
}

/// A flag that amends a table the configuration does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} needs {needs}")]
pub struct FlagError {
    /// The flag, e.g. `--etcd-prefix`.
    pub flag: &'static str,
    /// What it needs, e.g. `--etcd or a [store.etcd] table`.
    pub needs: &'static str,
}

impl CommonArgs {
    /// Amends `cfg` (read from the file, or the defaults) with these flags; nothing is
    /// validated yet.
    pub fn apply<B: BalanceTable>(&self, cfg: &mut Config<B>) -> Result<(), FlagError> {
        self.apply_etcd(&mut cfg.store.etcd)?;
        self.apply_others(cfg);
        Ok(())
    }

    /// Amends `cfg` with every flag but the etcd ones.
    fn apply_others<B: BalanceTable>(&self, cfg: &mut Config<B>) {
        if let Some(v) = self.quic {
            cfg.quic = v;
        }
        if let Some(v) = self.http {
            cfg.http = v;
        }
        if let Some(dir) = &self.tls_dir {
            cfg.tls = TlsFiles::in_dir(dir, "server");
        }
        if let Some(name) = &self.cluster {
            cfg.cluster.get_or_insert_with(Default::default).name = name.clone();
        }
        if let Some(v) = &self.policy {
            cfg.authorization.policy = Some(v.clone());
        }
        if let Some(v) = &self.crl {
            cfg.authorization.crl = Some(v.clone());
        }
    }

    /// Amends the etcd table `table` (`[store.etcd]`)
    /// with the etcd flags: `--etcd` makes one if there is none, the others need one.
    fn apply_etcd(&self, table: &mut Option<EtcdConfig>) -> Result<(), FlagError> {
        if let Some(endpoints) = &self.etcd {
            table.get_or_insert_with(Default::default).endpoints = endpoints.clone();
        }
        fn etcd<'a>(
            table: &'a mut Option<EtcdConfig>,
            flag: &'static str,
        ) -> Result<&'a mut EtcdConfig, FlagError> {
            table.as_mut().ok_or(FlagError {
                flag,
                needs: "--etcd or a [store.etcd] table",
            })
        }
        if let Some(prefix) = &self.etcd_prefix {
            etcd(table, "--etcd-prefix")?.prefix = prefix.clone();
        }
        if let Some(v) = &self.etcd_ca {
            etcd(table, "--etcd-ca")?.ca_file = Some(v.clone());
        }
        if let Some(v) = &self.etcd_cert {
            etcd(table, "--etcd-cert")?.cert_file = Some(v.clone());
        }
        if let Some(v) = &self.etcd_key {
            etcd(table, "--etcd-key")?.key_file = Some(v.clone());
        }
        if let Some(v) = &self.etcd_user {
            etcd(table, "--etcd-user")?.user = Some(v.clone());
        }
        if let Some(v) = &self.etcd_password_file {
            etcd(table, "--etcd-password-file")?.password_file = Some(v.clone());
        }
        Ok(())
    }

    /// Where a command's configuration came from, for its errors.
    pub fn origin(&self) -> String {
        match &self.config {
            Some(path) => format!("configuration ({} and the flags)", path.display()),
            None => "configuration (the flags and the defaults)".to_string(),
        }
    }
}

impl RelayArgs {
    /// The etcd flags given (or set in the environment) that a relay does not read.
    pub fn ignored_etcd_flags(&self) -> Vec<&'static str> {
        let c = &self.common;
        [
            ("--etcd", c.etcd.is_some()),
            ("--etcd-prefix", c.etcd_prefix.is_some()),
            ("--etcd-ca", c.etcd_ca.is_some()),
            ("--etcd-cert", c.etcd_cert.is_some()),
            ("--etcd-key", c.etcd_key.is_some()),
            ("--etcd-user", c.etcd_user.is_some()),
            ("--etcd-password-file", c.etcd_password_file.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect()
    }

    /// Amends `cfg` with the relay's own flags, into a `[relay]` table with its
    /// defaults if it has none; nothing is validated yet.
    /// The etcd flags are not applied: a relay reads no etcd, and a unit or
    /// environment file of the previous release that still sets them (without
    /// `[store.etcd]`) must not stop it; [`RelayArgs::ignored_etcd_flags`] names them
    /// for a warning.
    pub fn apply<B: BalanceTable>(&self, cfg: &mut Config<B>) -> Result<(), FlagError> {
        self.common.apply_others(cfg);
        let relay = cfg.relay.get_or_insert_with(Default::default);
        if !self.replicas.is_empty() {
            relay.replicas.clone_from(&self.replicas);
        }
        if let Some(dir) = &self.relay_tls_dir {
            relay.tls = TlsFiles::in_dir(dir, "relay");
        }
        if let Some(name) = &self.name {
            relay.name = Some(name.clone());
        }
        self.http.apply(cfg);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relays_etcd_flags_are_named_and_not_applied() {
        // A unit of the previous release: the relay read etcd with these.
        let args = RelayArgs {
            common: CommonArgs {
                etcd_prefix: Some("/ballast".into()),
                etcd_user: Some("relay".into()),
                ..CommonArgs::default()
            },
            replicas: vec!["agg-1:7400".into()],
            ..RelayArgs::default()
        };
        let mut cfg = Config::<toml::Table>::default();
        // The daemon's rule would refuse them without [store.etcd]; a relay takes them.
        assert!(args.common.apply(&mut cfg.clone()).is_err());
        args.apply(&mut cfg)
            .expect("a relay ignores its etcd flags");
        assert_eq!(cfg.store.etcd, None);
        assert_eq!(args.ignored_etcd_flags(), ["--etcd-prefix", "--etcd-user"]);
        assert_eq!(
            cfg.relay.map(|r| r.replicas),
            Some(vec!["agg-1:7400".to_string()])
        );
    }
}
