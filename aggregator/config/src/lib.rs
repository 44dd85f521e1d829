//! Ballast's configuration file, as the aggregator and the relay both read it: every
//! table but the balancing defaults, whose type is the aggregator's (the relay reads
//! that table as TOML and uses none of it), so that a relay links no balancer. Also the
//! command-line flags both programs share ([`cli`]), and the names a replica or a relay
//! goes by when none is configured ([`default_replica_name`]).

pub mod cli;
pub mod limits;

pub use ballast_shared::config::{ConfigError, TlsFiles};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The type of the `[balance]` table: the balancing defaults of every service, which
/// the aggregator reads and checks, and the relay reads as TOML and leaves alone.
pub trait BalanceTable:
    Default + Clone + PartialEq + std::fmt::Debug + Serialize + DeserializeOwned
{
    /// Checks what the type cannot.
    fn validate(&self) -> Result<(), InvalidSetting>;
}

/// `[balance]` unread: what a program that does not balance (the relay) takes it as.
impl BalanceTable for toml::Table {
    fn validate(&self) -> Result<(), InvalidSetting> {
        Ok(())
    }
}

/// The routing store: the embedded file by default, etcd when `[store.etcd]` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// The weights file (the embedded store; unused when `etcd` is set).
    pub path: PathBuf,
    /// Keep the weights in etcd instead of the file. Needs a binary built with the
    /// `etcd` cargo feature.
    pub etcd: Option<EtcdConfig>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: PathBuf::from("/var/lib/ballast/weights.json"),
            etcd: None,
        }
    }
}

/// etcd's default `--max-request-bytes`: 1.5 MiB.
pub const ETCD_MAX_REQUEST_BYTES: usize = 1536 * 1024;

/// The etcd routing store: one key per service, `<prefix>/services/<service>`, holding
/// its snapshot as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdConfig {
    /// Client URLs of the etcd members, all `http://` or all `https://`, e.g.
    /// `https://10.0.0.1:2379`. `https://` connects with TLS and needs `ca_file`.
    pub endpoints: Vec<String>,
    /// Key prefix, without a trailing `/`.
    pub prefix: String,
    /// How long connecting to a member may take, in milliseconds.
    pub connect_timeout_ms: u64,
    /// How long one read or write may take, in milliseconds. Writes are made by the
    /// routing store's background writer, so a dead etcd delays no cycle: each attempt
    /// fails after at most this long, and the writer retries.
    pub request_timeout_ms: u64,
    /// etcd's `--max-request-bytes` (1.5 MiB unless raised). A service whose value
    /// would make a larger request is stored in chunks of 1 MiB under
    /// `<prefix>/chunks/<service>/`, its own key holding a manifest that names them
    /// (`docs/operations.md`).
    pub max_request_bytes: usize,
    /// The largest service value stored, chunks and all (64 MiB by default, some
    /// 400,000 endpoints). A larger one is not written: etcd keeps its last value that
    /// fitted, the other services are written as usual, and the refusal is counted
    /// (`ballast_store_refused_total{reason="too_large"}`) and shown in `/healthz`.
    pub max_value_bytes: usize,
    /// The CA certificate(s), PEM, that etcd's server certificate must chain to.
    /// Required with `https://` endpoints; only those.
    pub ca_file: Option<PathBuf>,
    /// The client certificate, PEM, for an etcd that checks them
    /// (`--client-cert-auth`). Needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key, PEM.
    pub key_file: Option<PathBuf>,
    /// The etcd user to authenticate as (etcd's `auth enable`). Needs `password_file`.
    pub user: Option<String>,
    /// A file holding the user's password (one line; a final newline is ignored). A
    /// file and not the password itself, so that the password stays out of the
    /// configuration (world-readable as packaged) and out of the process's arguments.
    pub password_file: Option<PathBuf>,
    /// Where the aggregator keeps its local copy of the weights it stores in etcd,
    /// served when etcd cannot be read at start. By default beside `store.path`,
    /// with the extension `etcd-copy.json` (`/var/lib/ballast/weights.etcd-copy.json`).
    pub local_copy: Option<PathBuf>,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".to_string()],
            prefix: "/ballast".to_string(),
            connect_timeout_ms: 2000,
            request_timeout_ms: 2000,
            max_request_bytes: ETCD_MAX_REQUEST_BYTES,
            max_value_bytes: 64 << 20,
            ca_file: None,
            cert_file: None,
            key_file: None,
            user: None,
            password_file: None,
            local_copy: None,
        }
    }
}

/// Replicas sharing services through etcd (`[cluster]`, `--cluster`): each service is
/// served and written by one replica at a time, the owner of its bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// The cluster's name: replicas with the same etcd prefix and name share the work.
    pub name: String,
    /// This replica's name in the cluster, unique among its replicas; by default the
    /// host name and the QUIC port.
    pub replica: Option<String>,
    /// The QUIC address agents are pointed to when another replica refuses them; by
    /// default the bound QUIC address, or the host name and port when it is bound to
    /// every address.
    pub advertise: Option<String>,
    /// The time to live of the replica's etcd lease, in seconds: a replica that dies
    /// gives up its services this long after its last renewal (etcd grants at least
    /// 1.5 election timeouts: 2 s with etcd's defaults).
    pub lease_ttl_s: u32,
    /// How many buckets service names hash into: the units ownership moves in. Every
    /// replica of a cluster must use the same number.
    pub buckets: u32,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            name: String::new(),
            replica: None,
            advertise: None,
            lease_ttl_s: 3,
            buckets: 64,
        }
    }
}

impl ClusterConfig {
    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        if !name_ok(&self.name) {
            return Err(InvalidSetting::new(
                "cluster.name",
                "must be 1-64 letters, digits, '-', '_' or '.'",
            ));
        }
        if let Some(r) = &self.replica {
            if !name_ok(r) {
                return Err(InvalidSetting::new(
                    "cluster.replica",
                    "must be 1-64 letters, digits, '-', '_' or '.'",
                ));
            }
        }
        if !(1..=60).contains(&self.lease_ttl_s) {
            return Err(InvalidSetting::new(
                "cluster.lease_ttl_s",
                "must be between 1 and 60",
            ));
        }
        if !(1..=128).contains(&self.buckets) {
            // A write's fences are one compare per bucket it touches, and etcd takes
            // at most 128 compares in a transaction.
            return Err(InvalidSetting::new(
                "cluster.buckets",
                "must be between 1 and 128",
            ));
        }
        Ok(())
    }
}

/// The relay (`[relay]`, `ballast-relay`): agents connect to it as to an
/// aggregator, and it hands each agent on over a trunk to the cluster replica that
/// owns its service. It learns which replica owns what from the replicas it is
/// given (`replicas`), and reads no etcd.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// The relay's name, told to the replicas; by default the host name and the QUIC
    /// port.
    pub name: Option<String>,
    /// The relay's own client identity for its trunks (`ballast-aggregator certs relay`
    /// writes it): the CA the replicas' server certificates are checked against, and
    /// the relay certificate and key.
    pub tls: TlsFiles,
    /// The name the replicas' certificates are checked against; by default the host
    /// part of each replica's advertised address.
    pub server_name: Option<String>,
    /// How long the first report of a batch waits for others, in milliseconds. Reports
    /// feed a cycle of a second, so waiting costs nothing the weights can show, and
    /// fuller batches cost the primary less a report (`docs/scale.md`).
    pub batch_delay_ms: u64,
    /// How long the owner has to answer an agent's attach, in milliseconds (agents
    /// wait 3 s for their welcome).
    pub attach_timeout_ms: u64,
    /// How long an agent whose owner went away is held, answered from its last reply,
    /// until a new owner takes it, in milliseconds; then it is closed with MOVED.
    pub failover_hold_ms: u64,
    /// Addresses (`host:port`) of replicas to learn the cluster's routes from: the
    /// relay follows two at once, and then every member the routes name. Any replica
    /// of the cluster will do; list more than one, so that the relay can start while
    /// one is down.
    pub replicas: Vec<String>,
    /// No longer read: relays learn the routes from the replicas
    /// ([`RelayConfig::replicas`]) and need no etcd credential. Accepted, with a
    /// warning, so that the previous release's file still reads.
    pub etcd: Option<EtcdConfig>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: None,
            tls: TlsFiles::in_dir(Path::new("/etc/ballast/relay-tls"), "relay"),
            server_name: None,
            batch_delay_ms: 25,
            attach_timeout_ms: 2000,
            failover_hold_ms: 10_000,
            replicas: Vec::new(),
            etcd: None,
        }
    }
}

impl RelayConfig {
    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if let Some(name) = &self.name {
            if name.is_empty() || !ballast_shared::wire::is_valid_name(name) {
                return Err(InvalidSetting::new(
                    "relay.name",
                    format!("{name:?} is not a valid name"),
                ));
            }
        }
        if self.server_name.as_deref() == Some("") {
            return Err(InvalidSetting::new(
                "relay.server_name",
                "must not be empty",
            ));
        }
        if self.batch_delay_ms > 1000 {
            return Err(InvalidSetting::new(
                "relay.batch_delay_ms",
                "must be at most 1000",
            ));
        }
        if !(100..=60_000).contains(&self.attach_timeout_ms) {
            return Err(InvalidSetting::new(
                "relay.attach_timeout_ms",
                "must be between 100 and 60000",
            ));
        }
        if self.failover_hold_ms > 600_000 {
            return Err(InvalidSetting::new(
                "relay.failover_hold_ms",
                "must be at most 600000",
            ));
        }
        for replica in &self.replicas {
            let port = replica
                .rsplit_once(':')
                .map(|(host, port)| (host, port.parse::<u16>()));
            if !matches!(port, Some((host, Ok(p))) if !host.is_empty() && p > 0) {
                return Err(InvalidSetting::new(
                    "relay.replicas",
                    format!("{replica:?} is not host:port"),
                ));
            }
        }
        Ok(())
    }
}

/// The load-balancing policy the xDS Clusters carry (`xds_lb_policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    /// `RING_HASH`: the only policy under which proxyless gRPC honours endpoint
    /// weights (with no hash policy each RPC gets a random hash).
    #[default]
    RingHash,
    /// `ROUND_ROBIN`: weighted round robin in Envoy; gRPC ignores the weights.
    RoundRobin,
    /// `LEAST_REQUEST`: Envoy's weighted least request.
    LeastRequest,
}

/// How the xDS port is secured (`xds_tls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum XdsTls {
    /// TLS with the aggregator's server certificate (`tls.cert`, `tls.key`): clients
    /// check it against the CA, so an on-path attacker cannot rewrite the weights.
    /// Any client that reaches the port may read them: for clients that cannot
    /// present a certificate.
    Tls,
    /// The default: TLS, and clients must present a certificate signed by the
    /// aggregator's CA (`tls.ca`), checked against the revocation list
    /// (`authorization.crl`) as agents' are: only known proxies may read the endpoint
    /// lists, and nobody else can hold streams open.
    #[default]
    Mutual,
    /// No TLS: anyone who can reach the port reads every endpoint, and anyone on the
    /// path can rewrite them. Only for a port bound to loopback or a trusted network.
    Plaintext,
}

/// A setting that parses but cannot be used: which one, and why. Its text names the
/// setting by its dotted path, as an operator finds it in the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct InvalidSetting {
    /// The setting's dotted path, e.g. `store.etcd.prefix`.
    pub setting: String,
    /// What is wrong with it.
    pub reason: String,
}

impl InvalidSetting {
    /// `setting` is unusable for `reason`.
    pub fn new(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        InvalidSetting {
            setting: setting.into(),
            reason: reason.into(),
        }
    }
}

impl EtcdConfig {
    /// Checks what the types cannot: the endpoints' scheme, and that the TLS and
    /// authentication settings come in usable combinations.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        self.validate_as("store.etcd")
    }

    /// [`EtcdConfig::validate`] for the table at `table` (`store.etcd`),
    /// which its errors name.
    pub fn validate_as(&self, table: &str) -> Result<(), InvalidSetting> {
        let at = |name: &str| format!("{table}.{name}");
        if self.endpoints.is_empty() || self.endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(InvalidSetting::new(
                at("endpoints"),
                "must name at least one endpoint",
            ));
        }
        if let Some(bad) = self
            .endpoints
            .iter()
            .find(|e| !e.starts_with("https://") && !e.starts_with("http://"))
        {
            return Err(InvalidSetting::new(
                at("endpoints"),
                format!("{bad:?} is not an http:// or https:// URL"),
            ));
        }
        if self.uses_tls() && self.endpoints.iter().any(|e| e.starts_with("http://")) {
            return Err(InvalidSetting::new(
                at("endpoints"),
                "must be all http:// or all https://, not a mix",
            ));
        }
        if self.prefix.is_empty() || self.prefix.ends_with('/') {
            return Err(InvalidSetting::new(
                at("prefix"),
                "must be non-empty and must not end with '/'",
            ));
        }
        for (name, ms) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
        ] {
            if !(100..=60_000).contains(&ms) {
                return Err(InvalidSetting::new(
                    at(name),
                    "must be between 100 and 60000",
                ));
            }
        }
        if !(64 * 1024..=1 << 30).contains(&self.max_request_bytes) {
            return Err(InvalidSetting::new(
                at("max_request_bytes"),
                "must be between 65536 and 1073741824, as etcd's --max-request-bytes",
            ));
        }
        if !(64 * 1024..=256 << 20).contains(&self.max_value_bytes) {
            return Err(InvalidSetting::new(
                at("max_value_bytes"),
                "must be between 65536 and 268435456 (256 MiB, the most one read takes)",
            ));
        }
        if self.uses_tls() {
            if self.ca_file.is_none() {
                return Err(InvalidSetting::new(
                    at("ca_file"),
                    "https:// endpoints need the CA certificate that etcd's server \
                     certificate is checked against",
                ));
            }
        } else {
            for (name, set) in [
                ("ca_file", self.ca_file.is_some()),
                ("cert_file", self.cert_file.is_some()),
                ("key_file", self.key_file.is_some()),
            ] {
                if set {
                    return Err(InvalidSetting::new(
                        at(name),
                        "is used only with https:// endpoints",
                    ));
                }
            }
        }
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => {
                return Err(InvalidSetting::new(
                    at("key_file"),
                    "cert_file needs the key of the client certificate",
                ))
            }
            (None, Some(_)) => {
                return Err(InvalidSetting::new(
                    at("cert_file"),
                    "key_file needs the client certificate it belongs to",
                ))
            }
            _ => {}
        }
        match (&self.user, &self.password_file) {
            (Some(user), _) if user.is_empty() => {
                return Err(InvalidSetting::new(at("user"), "must not be empty"))
            }
            (Some(_), None) => {
                return Err(InvalidSetting::new(
                    at("password_file"),
                    "user needs a password: the file that holds it",
                ))
            }
            (None, Some(_)) => {
                return Err(InvalidSetting::new(
                    at("user"),
                    "password_file needs the user it is the password of",
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether the endpoints are `https://`: the connection uses TLS.
    pub fn uses_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// The connection settings (`ballast-etcd`'s) of this table.
    pub fn connect(&self) -> ballast_etcd::Connect {
        ballast_etcd::Connect {
            endpoints: self.endpoints.clone(),
            connect_timeout: std::time::Duration::from_millis(self.connect_timeout_ms),
            request_timeout: std::time::Duration::from_millis(self.request_timeout_ms),
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            user: self.user.clone(),
            password_file: self.password_file.clone(),
        }
    }

    /// The local copy's file: `local_copy`, or beside `store_path` with the extension
    /// `etcd-copy.json`.
    pub fn local_copy_path(&self, store_path: &Path) -> PathBuf {
        self.local_copy
            .clone()
            .unwrap_or_else(|| store_path.with_extension("etcd-copy.json"))
    }
}

/// The per-service config directory: where it is, and how its merged config is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceConfigSettings {
    /// The directory of `<service>.toml` files; none by default (zero config).
    pub dir: Option<PathBuf>,
    /// Where the merged config (last good versions, tombstones) persists across
    /// restarts; `services.json` beside the routing store's file by default.
    pub state: Option<PathBuf>,
    /// How long a deleted file's tombstone keeps its config, in seconds (3 days).
    pub tombstone_ttl_s: u64,
    /// Where backups of the merged config go; `config-backups` beside the routing
    /// store's file by default.
    pub backup_dir: Option<PathBuf>,
    /// How often the merged config is backed up, in seconds, if it changed.
    pub backup_interval_s: u64,
    /// How many backups to keep.
    pub backup_keep: usize,
    /// How often the directory is scanned whatever file events say, in milliseconds:
    /// it catches what a watcher can miss (network file systems) and expires tombstones.
    pub rescan_ms: u64,
    /// Whether a hello may register a service that has no file in the directory
    /// (true by default: a new service starts balancing as soon as its certificates
    /// allow it, with the defaults). False refuses such hellos with `unknown_service`,
    /// so that only services an operator has configured exist. Needs `dir`.
    pub accept_unknown_services: bool,
}

impl Default for ServiceConfigSettings {
    fn default() -> Self {
        ServiceConfigSettings {
            dir: None,
            state: None,
            tombstone_ttl_s: 3 * 24 * 3600,
            backup_dir: None,
            backup_interval_s: 3600,
            backup_keep: 72,
            rescan_ms: 10_000,
            accept_unknown_services: true,
        }
    }
}

impl ServiceConfigSettings {
    /// The merged config's file, given where the routing store keeps its file.
    pub fn state_path(&self, store: &StoreConfig) -> PathBuf {
        self.state
            .clone()
            .unwrap_or_else(|| beside(&store.path, "services.json"))
    }

    /// The backup directory, given where the routing store keeps its file.
    pub fn backup_path(&self, store: &StoreConfig) -> PathBuf {
        self.backup_dir
            .clone()
            .unwrap_or_else(|| beside(&store.path, "config-backups"))
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let bad = |name: &str, reason: &str| {
            Err(InvalidSetting::new(
                format!("service_config.{name}"),
                reason,
            ))
        };
        if self.tombstone_ttl_s == 0 {
            return bad("tombstone_ttl_s", "must be at least 1");
        }
        if !(60..=30 * 24 * 3600).contains(&self.backup_interval_s) {
            return bad("backup_interval_s", "must be between 60 and 2592000");
        }
        if self.backup_keep == 0 {
            return bad("backup_keep", "must be at least 1");
        }
        if !(100..=3_600_000).contains(&self.rescan_ms) {
            return bad("rescan_ms", "must be between 100 and 3600000");
        }
        Ok(())
    }
}

/// Who may claim what (`[authorization]`): the optional policy file and the
/// certificate revocation list. Without either, a node may serve the services its
/// certificate names, at its connection's source address, and nothing is revoked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthorizationConfig {
    /// A policy file granting services, networks and host names to node identity
    /// patterns (see `docs/security.md`); none by default.
    pub policy: Option<PathBuf>,
    /// A certificate revocation list (PEM, one or more `X509 CRL` blocks), as
    /// `ballast-aggregator certs revoke` writes it; none by default. Reloaded when it
    /// changes: a revoked node is refused at its next handshake and its live
    /// connection is closed.
    pub crl: Option<PathBuf>,
    /// How often the revocation list's file is checked for changes, in milliseconds.
    pub crl_check_ms: u64,
}

impl Default for AuthorizationConfig {
    fn default() -> Self {
        AuthorizationConfig {
            policy: None,
            crl: None,
            crl_check_ms: 1000,
        }
    }
}

impl AuthorizationConfig {
    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(100..=3_600_000).contains(&self.crl_check_ms) {
            return Err(InvalidSetting::new(
                "authorization.crl_check_ms",
                "must be between 100 and 3600000",
            ));
        }
        Ok(())
    }
}

/// Who may read `/metrics` (`http_auth.metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsAccess {
    /// The `scrape` role, and every role that reads the API (`viewer`, `operator`).
    #[default]
    ScrapeAndViewers,
    /// The `scrape` role alone: a viewer's credential does not read the metrics.
    ScrapeOnly,
}

/// Client certificates that hold each role on the HTTP API (`[http_auth.cert_roles]`):
/// glob patterns (`*`, `?`) on the certificate's name, its first DNS subject
/// alternative name, else its common name. A name that matches several roles holds the
/// one that may do most.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CertRoles {
    /// May read the API, the dashboard, the metrics and the watch streams.
    pub viewer: Vec<String>,
    /// A viewer that may also act (the API's POST and DELETE routes).
    pub operator: Vec<String>,
    /// May read `/metrics` only.
    pub scrape: Vec<String>,
}

impl CertRoles {
    /// Whether no certificate holds any role.
    pub fn is_empty(&self) -> bool {
        self.viewer.is_empty() && self.operator.is_empty() && self.scrape.is_empty()
    }
}

/// Who may use the HTTP API (`[http_auth]`): bearer tokens from a file of hashes, and
/// client certificates by name. With neither, the API is open to whoever reaches it
/// (the default, on loopback). `/healthz` is always open.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpAuthConfig {
    /// The token file: `[[token]]` entries, each a `name`, a `role` (`viewer`,
    /// `operator` or `scrape`) and the argon2 `hash` of the token
    /// (`ballast-aggregator token hash` makes one). Re-read when it changes: a token
    /// removed is refused from then on.
    pub tokens: Option<PathBuf>,
    /// How often the token file is checked for changes, in milliseconds.
    pub tokens_check_ms: u64,
    /// Who may read `/metrics`: `scrape_and_viewers` (the default) or `scrape_only`.
    pub metrics: MetricsAccess,
    /// The roles of client certificates (from the CA of `[http_tls] ca`), by name.
    pub cert_roles: CertRoles,
    /// A certificate revocation list (PEM, one or more `X509 CRL` blocks) of the CA of
    /// `[http_tls] ca`, when that CA is not the agents' (`[tls] ca`): a client
    /// certificate it names is refused at the handshake, and on the next request of a
    /// connection made before. Reloaded when it changes. None by default. With
    /// `[http_tls]` on the files of `[tls]`, the list is `authorization.crl`.
    pub crl: Option<PathBuf>,
    /// How often the revocation list's file is checked for changes, in milliseconds.
    pub crl_check_ms: u64,
}

impl Default for HttpAuthConfig {
    fn default() -> Self {
        HttpAuthConfig {
            tokens: None,
            tokens_check_ms: 1000,
            metrics: MetricsAccess::default(),
            cert_roles: CertRoles::default(),
            crl: None,
            crl_check_ms: 1000,
        }
    }
}

impl HttpAuthConfig {
    /// Whether any credential is configured, and so required.
    pub fn enabled(&self) -> bool {
        self.tokens.is_some() || !self.cert_roles.is_empty()
    }

    /// Checks what the types cannot; `tls` is `[http_tls]`, `agents` `[tls]`.
    pub fn validate(
        &self,
        tls: Option<&TlsFiles>,
        agents: &TlsFiles,
    ) -> Result<(), InvalidSetting> {
        if !(100..=3_600_000).contains(&self.tokens_check_ms) {
            return Err(InvalidSetting::new(
                "http_auth.tokens_check_ms",
                "must be between 100 and 3600000",
            ));
        }
        if !(100..=3_600_000).contains(&self.crl_check_ms) {
            return Err(InvalidSetting::new(
                "http_auth.crl_check_ms",
                "must be between 100 and 3600000",
            ));
        }
        if self.crl.is_some() {
            match tls {
                None => {
                    return Err(InvalidSetting::new(
                        "http_auth.crl",
                        "a revocation list is for client certificates, which need TLS on \
                         the HTTP listener: add [http_tls] with ca, cert and key",
                    ))
                }
                Some(files) if files == agents => {
                    return Err(InvalidSetting::new(
                        "http_auth.crl",
                        "[http_tls] names the files of [tls], whose client certificates \
                         are checked against authorization.crl: set that one instead",
                    ))
                }
                Some(_) => {}
            }
        }
        for (role, patterns) in [
            ("viewer", &self.cert_roles.viewer),
            ("operator", &self.cert_roles.operator),
            ("scrape", &self.cert_roles.scrape),
        ] {
            if let Some(reason) = ballast_ingest::policy::bad_glob(patterns) {
                return Err(InvalidSetting::new(
                    format!("http_auth.cert_roles.{role}"),
                    reason,
                ));
            }
        }
        if !self.cert_roles.is_empty() && tls.is_none() {
            return Err(InvalidSetting::new(
                "http_auth.cert_roles",
                "client certificates need TLS on the HTTP listener: add [http_tls] with \
                 ca, cert and key",
            ));
        }
        Ok(())
    }
}

fn beside(file: &Path, name: &str) -> PathBuf {
    file.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .join(name)
}

/// The most QUIC threads a configuration may ask for.
pub const MAX_QUIC_THREADS: usize = 64;

/// The whole configuration. Every field has a default, so an empty file is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config<B> {
    /// UDP address for agents' QUIC connections.
    pub quic: SocketAddr,
    /// Threads that terminate agents' QUIC connections, each with a socket of its own on
    /// the `quic` port (the kernel spreads agents over them by address).
    pub quic_threads: usize,
    /// TCP address of the HTTP API.
    pub http: SocketAddr,
    /// Serve the HTTP API on an address other than loopback without TLS or without
    /// credentials. Off by default: `run` refuses such a listener.
    pub insecure_http: bool,
    /// TLS on the HTTP API: its certificate and key, and the CA client certificates
    /// are checked against (a client certificate is optional). Reloaded when the files
    /// change, as `tls` is. None by default: plain HTTP.
    pub http_tls: Option<TlsFiles>,
    /// Who may use the HTTP API: tokens and client certificates, by role.
    pub http_auth: HttpAuthConfig,
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
    pub xds_lb_policy: LbPolicy,
    /// How the xDS port is secured: `tls` (the default), `mutual`, or `plaintext`,
    /// which must be asked for.
    pub xds_tls: XdsTls,
    /// TCP address where the aggregator answers HAProxy's agent-check for every node
    /// it publishes (HAProxy names the node with `agent-send "SERVICE NODE\n"`); none
    /// by default. Plain TCP, as HAProxy's agent-check is.
    pub agent_check: Option<SocketAddr>,
    /// Balancing defaults for every service.
    pub balance: B,
    /// The per-service config directory.
    pub service_config: ServiceConfigSettings,
    /// Who may claim what: the policy file and the revocation list.
    pub authorization: AuthorizationConfig,
    /// Bounds on what peers can make the aggregator hold.
    pub limits: limits::Limits,
    /// Replicas sharing services through etcd; none by default (one aggregator serves
    /// everything).
    pub cluster: Option<ClusterConfig>,
    /// The relay's settings (`ballast-relay`); none by default. Ignored by
    /// `run`.
    pub relay: Option<RelayConfig>,
}

impl<B: BalanceTable> Default for Config<B> {
    fn default() -> Self {
        Config {
            quic: SocketAddr::from(([0, 0, 0, 0], 7400)),
            quic_threads: 1,
            http: SocketAddr::from(([127, 0, 0, 1], 7401)),
            insecure_http: false,
            http_tls: None,
            http_auth: HttpAuthConfig::default(),
            report_interval_ms: 1000,
            tls: TlsFiles::in_dir(Path::new("/etc/ballast/tls"), "server"),
            store: StoreConfig::default(),
            services: None,
            balance: B::default(),
            xds: None,
            xds_lb_policy: LbPolicy::default(),
            xds_tls: XdsTls::default(),
            agent_check: None,
            service_config: ServiceConfigSettings::default(),
            authorization: AuthorizationConfig::default(),
            limits: limits::Limits::default(),
            cluster: None,
            relay: None,
        }
    }
}

impl<B: BalanceTable> Config<B> {
    /// What ingest is set up from: `tls`, `[authorization]`, the config directory's
    /// rule for unknown services, and the QUIC `[limits]`.
    pub fn ingest(&self) -> ballast_ingest::Settings {
        ballast_ingest::Settings {
            tls: self.tls.clone(),
            policy: self.authorization.policy.clone(),
            crl: self.authorization.crl.clone(),
            crl_check: std::time::Duration::from_millis(self.authorization.crl_check_ms),
            config_dir: self.service_config.dir.is_some(),
            accept_unknown_services: self.service_config.accept_unknown_services,
            limits: self.limits.ingest(),
        }
    }

    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: Self = ballast_shared::config::parse_toml(text, origin)?;
        cfg.validate()
            .map_err(|message| ConfigError::Invalid(format!("{origin}: {message}")))?;
        Ok(cfg)
    }

    /// Reads the file at `path` without checking what the types cannot: for a caller
    /// that amends it (with command-line flags) and then calls [`Config::validate`] on
    /// the result, since a file may leave to the flags what its checks need.
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        ballast_shared::config::load_toml(path)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::read(path)?;
        cfg.validate()
            .map_err(|message| ConfigError::Invalid(format!("{}: {message}", path.display())))?;
        Ok(cfg)
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        self.balance.validate()?;
        if !(100..=60_000).contains(&self.report_interval_ms) {
            return Err(InvalidSetting::new(
                "report_interval_ms",
                "must be between 100 and 60000",
            ));
        }
        if !(1..=MAX_QUIC_THREADS).contains(&self.quic_threads) {
            return Err(InvalidSetting::new(
                "quic_threads",
                format!("must be between 1 and {MAX_QUIC_THREADS}"),
            ));
        }
        if let Some(services) = &self.services {
            if let Some(bad) = services
                .iter()
                .find(|s| s.is_empty() || !ballast_shared::wire::is_valid_name(s))
            {
                return Err(InvalidSetting::new(
                    "services",
                    format!("{bad:?} is not a valid service name"),
                ));
            }
        }
        if let Some(etcd) = &self.store.etcd {
            etcd.validate()?;
        }
        if let Some(cluster) = &self.cluster {
            cluster.validate()?;
            // A relay's file may name the cluster with no etcd at all (a relay reads
            // none); a replica started so is refused when it opens its store.
            if self.store.etcd.is_none() && self.relay.is_none() {
                return Err(InvalidSetting::new(
                    "cluster",
                    "a cluster shares its services through etcd: it needs [store.etcd] \
                     (or --etcd)",
                ));
            }
        }
        // A relay's replicas are required where it starts (`ballast-relay`), not here:
        // a replica may read a file with a [relay] table of the previous release.
        if let Some(relay) = &self.relay {
            relay.validate()?;
        }
        self.service_config.validate()?;
        self.limits.validate()?;
        self.authorization.validate()?;
        self.http_auth.validate(self.http_tls.as_ref(), &self.tls)?;
        Ok(())
    }

    /// Checks that the HTTP API is not served beyond this host unprotected: on an
    /// address other than loopback it needs TLS and at least one credential source,
    /// unless `insecure_http` says otherwise. The error says what to add. (`run`'s
    /// check; the relay's is [`Config::check_relay_http_exposure`].)
    pub fn check_http_exposure(&self) -> Result<(), InvalidSetting> {
        self.exposure(
            "the API would serve anyone who reaches it",
            "TLS: [http_tls] with ca = \"...\", cert = \"...\" and key = \"...\" \
             (the files of [tls] will do; `run --http-tls-dir DIR` for a directory \
             `certs init` made)",
            "credentials: [http_auth] with tokens = \"/etc/ballast/api-tokens.toml\" \
             (or `run --http-tokens FILE`; entries from `ballast-aggregator token new`) \
             or [http_auth.cert_roles] viewer = [\"NAME-PATTERN\", ...]",
        )
    }

    /// The relay's [`Config::check_http_exposure`]: its HTTP port serves `/metrics`
    /// (and an open `/healthz`), which off loopback needs TLS and a credential of the
    /// `scrape` role, unless `insecure_http` says otherwise. The error says what to add.
    pub fn check_relay_http_exposure(&self) -> Result<(), InvalidSetting> {
        self.exposure(
            "its /metrics would serve anyone who reaches it",
            "TLS: [http_tls] with ca = \"...\", cert = \"...\" and key = \"...\" \
             (the files of [tls] will do; `--http-tls-dir DIR` for a directory \
             `certs init` made)",
            "credentials: [http_auth] with tokens = \"/etc/ballast/relay-tokens.toml\" \
             (or `--http-tokens FILE`; an entry of role scrape from \
             `ballast-aggregator token new --role scrape`) or [http_auth.cert_roles] \
             scrape = [\"NAME-PATTERN\", ...]",
        )
    }

    /// The check of both daemons: what the listener would expose, and what to add.
    fn exposure(
        &self,
        exposed: &str,
        add_tls: &str,
        add_credentials: &str,
    ) -> Result<(), InvalidSetting> {
        if self.http.ip().is_loopback() || self.insecure_http {
            return Ok(());
        }
        let mut missing = Vec::new();
        if self.http_tls.is_none() {
            missing.push(add_tls);
        }
        if !self.http_auth.enabled() {
            missing.push(add_credentials);
        }
        if missing.is_empty() {
            return Ok(());
        }
        Err(InvalidSetting::new(
            "http",
            format!(
                "{} is not a loopback address, and {exposed}; add {}; or set \
                 insecure_http = true to serve it unprotected anyway",
                self.http,
                missing.join(", and ")
            ),
        ))
    }
}

/// This host's name, or `None` when the kernel gives none.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// A replica's (or a relay's) name when none is configured: the host's name and the
/// QUIC port, which tell replicas on one host apart.
pub fn default_replica_name(port: u16) -> String {
    let host = host_name().unwrap_or_else(|| "replica".to_string());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(56)
        .collect();
    format!("{host}-{port}")
}
