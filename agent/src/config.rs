//! The agent's configuration: a TOML file, overridden by flags and environment.

use crate::sample::{CpuSpec, InflightSpec};
pub use ballast_shared::config::{ConfigError, TlsFiles};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything the agent needs. Only `service`, `port` and `aggregators` lack a usable
/// default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The service this node serves.
    pub service: String,
    /// This node's identity; defaults to the host name. Must match the certificate.
    pub node: String,
    /// The service's port on this host.
    pub port: u16,
    /// The endpoint address load balancers should use; defaults to the local address of
    /// the route to the first aggregator, with `port`.
    pub address: String,
    /// Where [`AgentConfig::address`] came from, in words; set by
    /// [`AgentConfig::resolve`] and [`crate::cli::Flags::config`].
    #[serde(skip)]
    pub address_origin: AddressOrigin,
    /// Zone of this node.
    pub zone: String,
    /// Aggregators, `host:port`, tried in order with failover.
    pub aggregators: Vec<String>,
    /// TLS server name to expect from aggregators; defaults to each one's host part.
    pub server_name: Option<String>,
    /// Report interval until the aggregator says otherwise, in milliseconds.
    pub interval_ms: u32,
    /// CPU source.
    pub cpu: CpuSpec,
    /// In-flight source; defaults to established TCP connections on `port`.
    pub inflight: Option<InflightSpec>,
    /// In-flight requests that mean fully busy, if the operator knows; 0 (the default)
    /// lets the aggregator judge the count against the rest of the service.
    pub capacity: u32,
    /// In-flight samples per report interval, the report's own included: the report
    /// carries their mean and the age of the requests they found owed, so that one
    /// empty sample cannot erase a backlog. 1 samples only at the report.
    pub inflight_samples: u32,
    /// TLS files.
    pub tls: TlsFiles,
    /// The local socket the CLI talks to.
    pub control_socket: PathBuf,
    /// Where to answer HAProxy's agent-check, if anywhere.
    pub agent_check: Option<std::net::SocketAddr>,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// The file whose presence says the node is drained, so that a drain survives a
    /// restart of the agent: only `undrain` ends it. `None` until [`AgentConfig::resolve`]
    /// puts it next to the control socket; an empty path keeps no drain file.
    pub drain_file: Option<PathBuf>,
    /// How long, in milliseconds, the in-flight count must stay at 0 after a drain
    /// before `status` calls stopping safe. Load balancers that poll (HAProxy's
    /// `agent-inter`) must have seen the drain by then, so it must be at least their
    /// longest polling interval.
    pub drain_quiet_ms: u64,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            service: String::new(),
            node: String::new(),
            port: 0,
            address: String::new(),
            address_origin: AddressOrigin::Unset,
            zone: String::new(),
            aggregators: Vec::new(),
            server_name: None,
            interval_ms: 1000,
            cpu: CpuSpec::Host,
            inflight: None,
            capacity: 0,
            inflight_samples: DEFAULT_INFLIGHT_SAMPLES,
            tls: TlsFiles::in_dir(Path::new("/etc/ballast/tls"), "node"),
            control_socket: PathBuf::from("/run/ballast/agent.sock"),
            agent_check: None,
            metrics: None,
            drain_file: None,
            drain_quiet_ms: 5000,
        }
    }
}

/// In-flight samples per report interval by default: at a 1 s interval one each
/// 200 ms, which costs the TCP source about 1 ms of CPU a second (`docs/inflight.md`).
pub const DEFAULT_INFLIGHT_SAMPLES: u32 = 5;

/// The most in-flight samples per report interval.
pub const MAX_INFLIGHT_SAMPLES: u32 = 20;

/// The host name, from the kernel.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string())
}

/// Where the address the agent advertises came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AddressOrigin {
    /// Not worked out (no port, or not resolved yet).
    #[default]
    Unset,
    /// Given by the operator: the words say where (`--address`, a file).
    Explicit(String),
    /// The local address of the route to this aggregator (`host:port`).
    Route(String),
    /// It could not be worked out: why, in words.
    Failed(String),
}

impl std::fmt::Display for AddressOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddressOrigin::Unset => f.write_str("not set"),
            AddressOrigin::Explicit(from) => f.write_str(from),
            AddressOrigin::Route(agg) => write!(f, "route to {agg}"),
            AddressOrigin::Failed(why) => write!(f, "not worked out: {why}"),
        }
    }
}

/// The first address `aggregator` (`host:port`) resolves to.
fn resolve_aggregator(aggregator: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    aggregator
        .to_socket_addrs()
        .map_err(|e| format!("aggregator {aggregator} does not resolve: {e}"))?
        .next()
        .ok_or_else(|| format!("aggregator {aggregator} resolves to no address"))
}

/// `IP:port` the aggregator at `aggregator` (`host:port`) will see this host connect
/// from: the local address the kernel picks for the route to it (a connected UDP
/// socket's, which sends nothing), with `port`. The host name is not used: on Debian it
/// resolves to 127.0.1.1, which no remote aggregator sees.
pub(crate) fn route_address(aggregator: &str, port: u16) -> Result<String, String> {
    let to = resolve_aggregator(aggregator)?;
    let any: std::net::SocketAddr = if to.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let local = std::net::UdpSocket::bind(any)
        .and_then(|s| {
            s.connect(to)?;
            s.local_addr()
        })
        .map_err(|e| format!("no route to aggregator {aggregator} ({to}): {e}"))?;
    Ok(std::net::SocketAddr::new(local.ip(), port).to_string())
}

impl AgentConfig {
    /// Parses TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        ballast_shared::config::parse_toml(text, origin)
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        ballast_shared::config::load_toml(path)
    }

    /// Fills the derived defaults: node from the host name, address from the route to
    /// the first aggregator and the port, in-flight from the port.
    pub fn resolve(mut self) -> Self {
        if self.node.is_empty() {
            self.node = hostname();
        }
        if !self.address.is_empty() {
            if self.address_origin == AddressOrigin::Unset {
                self.address_origin = AddressOrigin::Explicit("address in the config".into());
            }
        } else if self.port != 0 {
            if let Some(first) = self.aggregators.first() {
                match route_address(first, self.port) {
                    Ok(a) => {
                        self.address = a;
                        self.address_origin = AddressOrigin::Route(first.clone());
                    }
                    Err(why) => self.address_origin = AddressOrigin::Failed(why),
                }
            }
        }
        if self.inflight.is_none() && self.port != 0 {
            self.inflight = Some(InflightSpec::Tcp {
                ports: vec![self.port],
            });
        }
        if self.drain_file.is_none() && !self.control_socket.as_os_str().is_empty() {
            self.drain_file = Some(self.control_socket.with_extension("drained"));
        }
        self
    }

    /// The drain file in use, if any.
    pub(crate) fn drain_path(&self) -> Option<&Path> {
        self.drain_file
            .as_deref()
            .filter(|p| !p.as_os_str().is_empty())
    }

    /// Checks that the agent can run with this.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.service.is_empty() {
            return bad("service is not set (--service or BALLAST_SERVICE)".into());
        }
        if self.aggregators.is_empty() {
            return bad("no aggregator is set (--aggregator or BALLAST_AGGREGATOR)".into());
        }
        for a in &self.aggregators {
            if !ballast_shared::wire::is_host_port(a) {
                return bad(format!("aggregator {a:?} is not host:port"));
            }
        }
        if !(100..=60_000).contains(&self.interval_ms) {
            return bad("interval_ms must be between 100 and 60000".into());
        }
        if !(1..=MAX_INFLIGHT_SAMPLES).contains(&self.inflight_samples) {
            return bad(format!(
                "inflight_samples must be between 1 and {MAX_INFLIGHT_SAMPLES}"
            ));
        }
        if self.drain_quiet_ms > 3_600_000 {
            return bad("drain_quiet_ms must be at most 3600000 (an hour)".into());
        }
        self.check_address()?;
        let hello = self.hello();
        hello
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("registration: {e}")))?;
        Ok(())
    }

    /// The advertised address must be one a remote aggregator can see: worked out, and
    /// not loopback unless the aggregator is too or the operator said so.
    fn check_address(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if let AddressOrigin::Failed(why) = &self.address_origin {
            return bad(format!(
                "cannot work out the address to advertise: {why}; give it with --address IP:PORT"
            ));
        }
        if matches!(self.address_origin, AddressOrigin::Explicit(_)) {
            return Ok(());
        }
        let Ok(addr) = self.address.parse::<std::net::SocketAddr>() else {
            return Ok(());
        };
        let Some(first) = self.aggregators.first() else {
            return Ok(());
        };
        if addr.ip().is_loopback() {
            if let Ok(agg) = resolve_aggregator(first) {
                if !agg.ip().is_loopback() {
                    return bad(format!(
                        "the address worked out for this node, {addr}, is loopback, but \
                         aggregator {first} ({agg}) is not: it would refuse it; give the \
                         address load balancers should use with --address IP:PORT"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The hello this configuration sends.
    pub fn hello(&self) -> ballast_shared::wire::Hello {
        ballast_shared::wire::Hello {
            node: self.node.clone(),
            service: self.service.clone(),
            address: self.address.clone(),
            zone: self.zone.clone(),
            version: ballast_shared::VERSION.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_resolves_and_validates() {
        let cfg = AgentConfig::parse(
            "service = \"web\"\nport = 8080\naggregators = [\"127.0.0.1:7400\"]\n",
            "agent.toml",
        )
        .expect("parses")
        .resolve();
        cfg.validate().expect("valid");
        assert_eq!(
            cfg.address, "127.0.0.1:8080",
            "the route to a loopback aggregator"
        );
        assert_eq!(
            cfg.address_origin,
            AddressOrigin::Route("127.0.0.1:7400".into())
        );
        assert_eq!(cfg.address_origin.to_string(), "route to 127.0.0.1:7400");
        assert_eq!(cfg.inflight, Some(InflightSpec::Tcp { ports: vec![8080] }));
        assert_eq!(
            cfg.drain_path(),
            Some(Path::new("/run/ballast/agent.drained")),
            "the drain file sits next to the control socket"
        );
        assert_eq!(cfg.metrics, None, "metrics are off by default");
    }

    #[test]
    fn an_address_is_worked_out_or_refused() {
        let unresolved = AgentConfig {
            service: "web".into(),
            port: 8080,
            aggregators: vec!["no-such-host.invalid:7400".into()],
            ..AgentConfig::default()
        }
        .resolve();
        assert!(unresolved.address.is_empty());
        let err = unresolved.validate().expect_err("no address").to_string();
        assert!(
            err.contains("cannot work out the address") && err.contains("--address"),
            "{err}"
        );
        // A loopback address worked out for a remote aggregator is refused; given
        // explicitly, it is the operator's choice.
        let remote = AgentConfig {
            service: "web".into(),
            port: 8080,
            aggregators: vec!["10.77.0.1:7400".into()],
            address: "127.0.1.1:8080".into(),
            address_origin: AddressOrigin::Route("10.77.0.1:7400".into()),
            ..AgentConfig::default()
        };
        let err = remote.validate().expect_err("loopback").to_string();
        assert!(err.contains("is loopback"), "{err}");
        let explicit = AgentConfig {
            address_origin: AddressOrigin::Unset,
            ..remote
        }
        .resolve();
        assert_eq!(
            explicit.address_origin,
            AddressOrigin::Explicit("address in the config".into())
        );
        explicit.validate().expect("an explicit address stands");
        assert!(route_address("no-such-host.invalid:7400", 80).is_err());
    }

    #[test]
    fn metrics_and_drain_keys_parse() {
        let cfg = AgentConfig::parse(
            "service = \"web\"\naggregators = [\"agg:7400\"]\nmetrics = \"127.0.0.1:9464\"\n\
             drain_file = \"\"\ndrain_quiet_ms = 1500\n",
            "agent.toml",
        )
        .expect("parses")
        .resolve();
        assert_eq!(cfg.metrics, Some("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(cfg.drain_path(), None, "an empty path keeps no drain file");
        assert_eq!(cfg.drain_quiet_ms, 1500);
        let off = AgentConfig {
            control_socket: PathBuf::new(),
            ..AgentConfig::default()
        }
        .resolve();
        assert_eq!(off.drain_path(), None, "no control socket, no drain file");
    }

    #[test]
    fn bad_files_say_where() {
        let err = AgentConfig::parse("service = 3\n", "agent.toml").expect_err("type");
        assert!(err.to_string().contains("agent.toml"), "{err}");
        let cfg = AgentConfig {
            service: "web".into(),
            ..AgentConfig::default()
        };
        assert!(cfg
            .validate()
            .expect_err("no aggregator")
            .to_string()
            .contains("aggregator"));
    }
}
