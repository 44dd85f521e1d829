//! The connection to etcd: the client's options from the settings, and a bounded
//! connect.

use crate::Connect;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use std::path::Path;
use std::time::Duration;

/// A file a setting names cannot be used: which setting (its dotted path, e.g.
/// `store.etcd.ca_file`), and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct SetupError {
    /// The setting's dotted path.
    pub setting: String,
    /// What is wrong with what it names.
    pub reason: String,
}

/// How to reach etcd: its members, the client's options, and the bounds of a connect.
#[derive(Debug, Clone)]
pub struct Connection {
    endpoints: Vec<String>,
    options: ConnectOptions,
    connect_timeout: Duration,
    request_timeout: Duration,
}

impl Connection {
    /// The connection `cfg` describes, the files it names read and checked now.
    /// Nothing is contacted yet, so this succeeds while etcd is down.
    pub fn new(cfg: &Connect) -> Result<Connection, SetupError> {
        Ok(Connection {
            endpoints: cfg.endpoints.clone(),
            options: connect_options(cfg)?,
            connect_timeout: cfg.connect_timeout,
            request_timeout: cfg.request_timeout,
        })
    }

    /// The members' URLs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// How long connecting to a member may take.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long one request may take.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Connects, and logs in when a user is set: a wrong password shows here. Bounded
    /// by the connect and request timeouts together; the error says why, for the log.
    pub async fn connect(&self) -> Result<Client, String> {
        let limit = self.connect_timeout + self.request_timeout;
        tokio::time::timeout(
            limit,
            Client::connect(self.endpoints.clone(), Some(self.options.clone())),
        )
        .await
        .map_err(|_| format!("connecting timed out after {limit:?}"))?
        .map_err(|e| format!("connecting: {}", describe(&e)))
    }
}

/// An etcd error with its causes, for the log.
pub fn describe(e: &etcd_client::Error) -> String {
    ballast_shared::error_chain(e)
}

/// Reads a file an etcd setting names, at start.
fn read_setting(setting: &str, path: &Path) -> Result<String, SetupError> {
    std::fs::read_to_string(path).map_err(|e| SetupError {
        setting: format!("store.etcd.{setting}"),
        reason: format!("{}: {e}", path.display()),
    })
}

fn setup_error(setting: &str, reason: impl std::fmt::Display) -> SetupError {
    SetupError {
        setting: format!("store.etcd.{setting}"),
        reason: reason.to_string(),
    }
}

/// The client's options from `cfg`: timeouts, TLS and the user, with the files they
/// name read and checked now.
fn connect_options(cfg: &Connect) -> Result<ConnectOptions, SetupError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(cfg.connect_timeout)
        .with_timeout(cfg.request_timeout)
        // A simple token dies with the etcd member that issued it: log in again.
        .with_auto_token_refresh(true);
    if cfg.uses_tls() {
        let ca_path = cfg
            .ca_file
            .as_deref()
            .ok_or_else(|| setup_error("ca_file", "required with https:// endpoints"))?;
        let ca = read_setting("ca_file", ca_path)?;
        ballast_shared::tls::certs_from_pem(&ca, &ca_path.display().to_string())
            .map_err(|e| setup_error("ca_file", e))?;
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
        if let (Some(cert_path), Some(key_path)) = (&cfg.cert_file, &cfg.key_file) {
            let cert = read_setting("cert_file", cert_path)?;
            let key = read_setting("key_file", key_path)?;
            ballast_shared::tls::Identity::from_pem(&cert, &key, &cert_path.display().to_string())
                .map_err(|e| setup_error("cert_file", e))?;
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls);
    }
    if let (Some(user), Some(path)) = (&cfg.user, &cfg.password_file) {
        let text = read_setting("password_file", path)?;
        let password = text
            .strip_suffix('\n')
            .map(|p| p.strip_suffix('\r').unwrap_or(p))
            .unwrap_or(&text);
        if password.is_empty() {
            return Err(setup_error(
                "password_file",
                format!("{} is empty", path.display()),
            ));
        }
        warn_if_readable_by_others(path);
        if !cfg.uses_tls() {
            tracing::warn!(
                user = %user,
                "the etcd password goes over http:// in clear text: use https:// endpoints \
                 unless etcd is on this host"
            );
        }
        options = options.with_user(user.clone(), password.to_string());
    }
    Ok(options)
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o007 != 0 {
            tracing::warn!(file = %path.display(),
                "the etcd password file is open to every user on this host (chmod o-rwx it)");
        }
    }
}
