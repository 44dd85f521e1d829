//! The `ballast-agent` command line, in the library so that man pages and shell
//! completions can be generated from it without the generators in the agent binary.

use crate::config::{AddressOrigin, AgentConfig, ConfigError, TlsFiles};
use crate::sample::{CpuSpec, InflightSpec};
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::path::PathBuf;

/// Ballast host agent: measures how busy this node's service is and reports it.
#[derive(Parser)]
#[command(name = "ballast-agent", version, about, propagate_version = true)]
pub struct Cli {
    /// The subcommand; none runs the daemon.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Daemon flags given before any subcommand.
    #[command(flatten)]
    pub flags: Flags,
}

/// The agent's subcommands.
#[derive(Subcommand)]
pub enum Command {
    /// Run the agent daemon (the default).
    Run(Flags),
    /// Take one measurement and print it; no daemon or aggregator needed.
    Sample {
        /// The sources to sample, as the daemon takes them.
        #[command(flatten)]
        flags: Flags,
        /// Seconds between the two readings a CPU delta needs.
        #[arg(long, default_value_t = 1.0)]
        window: f64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the running daemon's connection, last report and weight.
    Status(CtlArgs),
    /// Lame duck: ask the aggregator for weight 0 and let in-flight work finish.
    Drain(CtlArgs),
    /// Come back from a drain through the cold-start ramp.
    Undrain(CtlArgs),
    /// Validate the configuration and TLS files, then exit.
    Check(Flags),
}

/// How to reach a running daemon's control socket.
#[derive(Args, Clone)]
pub struct CtlArgs {
    /// The daemon's control socket.
    #[arg(
        long,
        env = "BALLAST_CONTROL",
        default_value = "/run/ballast/agent.sock"
    )]
    pub control: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The daemon's settings; each overrides the configuration file.
#[derive(Args, Clone, Default)]
pub struct Flags {
    /// TOML configuration file; flags and environment override it.
    #[arg(long, short, env = "BALLAST_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Service name.
    #[arg(long, env = "BALLAST_SERVICE", global = true)]
    pub service: Option<String>,
    /// Service port on this host.
    #[arg(long, env = "BALLAST_PORT", global = true)]
    pub port: Option<u16>,
    /// Aggregator address host:port; repeat or comma-separate for failover.
    #[arg(
        long = "aggregator",
        env = "BALLAST_AGGREGATOR",
        value_delimiter = ',',
        global = true
    )]
    pub aggregators: Vec<String>,
    /// Node identity; must match the certificate [default: the host name].
    #[arg(long, env = "BALLAST_NODE", global = true)]
    pub node: Option<String>,
    /// Endpoint address load balancers use, IP:PORT [default: the local address of the
    /// route to the first aggregator, with --port].
    #[arg(long, env = "BALLAST_ADDRESS", global = true)]
    pub address: Option<String>,
    /// Zone of this node.
    #[arg(long, env = "BALLAST_ZONE", global = true)]
    pub zone: Option<String>,
    /// CPU source: host, cgroup:PATH (both count niced processes as idle), pid:N or
    /// none [default: host].
    #[arg(long, env = "BALLAST_CPU", global = true)]
    pub cpu: Option<CpuSpec>,
    /// In-flight source [default: tcp:PORT, the service's port]: tcp:PORTS;
    /// prometheus:URL#EXPR, where EXPR is a metric with label matchers (=, !=, =~, !~;
    /// anchored patterns of literals, ., .*, .+ and a|b), or a sum or difference of such
    /// terms, e.g. 'a_total{x="y"} - b_total{x="y"}'; a preset: grpc:URL[#service=NAME],
    /// otel-http:URL, envoy:URL[#prefix=NAME], haproxy:URL[#backend=NAME], nginx:URL
    /// (stub_status); synthetic:speed=..,offered=..; or none. `check --inflight
    /// auto[:METRICS_URL]` probes --port for HTTP/2 and the URL for the presets' series.
    #[arg(long, env = "BALLAST_INFLIGHT", global = true)]
    pub inflight: Option<InflightSpec>,
    /// In-flight requests that mean fully busy. Unset (0), the aggregator judges the
    /// count against the rest of the service: no guess needed.
    #[arg(long, env = "BALLAST_CAPACITY", global = true)]
    pub capacity: Option<u32>,
    /// Report interval in milliseconds, until the aggregator says otherwise [default: 1000].
    #[arg(long, env = "BALLAST_INTERVAL_MS", global = true)]
    pub interval_ms: Option<u32>,
    /// Directory with ca.pem, node.pem and node.key [default: /etc/ballast/tls].
    #[arg(long, env = "BALLAST_TLS_DIR", global = true)]
    pub tls_dir: Option<PathBuf>,
    /// TLS server name expected from the aggregators' certificates [default: the host part
    /// of each --aggregator].
    #[arg(long, env = "BALLAST_SERVER_NAME", global = true)]
    pub server_name: Option<String>,
    /// Answer HAProxy's agent-check on this address, e.g. 0.0.0.0:7403 [default: off].
    #[arg(long, env = "BALLAST_AGENT_CHECK", global = true)]
    pub agent_check: Option<std::net::SocketAddr>,
    /// Control socket path ("" for none) [default: /run/ballast/agent.sock].
    #[arg(long, env = "BALLAST_CONTROL", global = true, value_parser = any_path)]
    pub control: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464 [default: off].
    #[arg(long, env = "BALLAST_METRICS", global = true)]
    pub metrics: Option<std::net::SocketAddr>,
    /// File that keeps a drain across agent restarts ("" for none) [default: next to the
    /// control socket, agent.drained].
    #[arg(long, env = "BALLAST_DRAIN_FILE", global = true, value_parser = any_path)]
    pub drain_file: Option<PathBuf>,
    /// Milliseconds with nothing in flight after a drain before stopping is safe
    /// [default: 5000].
    #[arg(long, env = "BALLAST_DRAIN_QUIET_MS", global = true)]
    pub drain_quiet_ms: Option<u64>,
    /// Log as JSON lines.
    #[arg(long, env = "BALLAST_LOG_JSON", global = true)]
    pub log_json: bool,
}

impl Flags {
    /// These flags with `other`'s set ones taking precedence: a subcommand's flags
    /// override the ones given before it.
    pub fn merged(&self, other: &Flags) -> Flags {
        macro_rules! pick {
            ($($f:ident),*) => { Flags { $($f: other.$f.clone().or_else(|| self.$f.clone()),)*
                aggregators: if other.aggregators.is_empty() { self.aggregators.clone() } else { other.aggregators.clone() },
                log_json: self.log_json || other.log_json } };
        }
        pick!(
            config,
            service,
            port,
            node,
            address,
            zone,
            cpu,
            inflight,
            capacity,
            interval_ms,
            tls_dir,
            server_name,
            control,
            agent_check,
            metrics,
            drain_file,
            drain_quiet_ms
        )
    }

    /// The configuration file (or the defaults) with these flags applied, resolved.
    pub fn config(&self) -> Result<AgentConfig, ConfigError> {
        let mut cfg = match &self.config {
            Some(path) => {
                let mut cfg = AgentConfig::load(path)?;
                if !cfg.address.is_empty() {
                    cfg.address_origin =
                        AddressOrigin::Explicit(format!("address in {}", path.display()));
                }
                cfg
            }
            None => AgentConfig::default(),
        };
        if let Some(v) = &self.service {
            cfg.service = v.clone();
        }
        if let Some(v) = self.port {
            cfg.port = v;
        }
        if !self.aggregators.is_empty() {
            cfg.aggregators = self.aggregators.clone();
        }
        if let Some(v) = &self.node {
            cfg.node = v.clone();
        }
        if let Some(v) = &self.address {
            cfg.address = v.clone();
            cfg.address_origin = AddressOrigin::Explicit("--address".into());
        }
        if let Some(v) = &self.zone {
            cfg.zone = v.clone();
        }
        if let Some(v) = &self.cpu {
            cfg.cpu = v.clone();
        }
        if let Some(v) = &self.inflight {
            cfg.inflight = Some(v.clone());
        }
        if let Some(v) = self.capacity {
            cfg.capacity = v;
        }
        if let Some(v) = self.interval_ms {
            cfg.interval_ms = v;
        }
        if let Some(dir) = &self.tls_dir {
            cfg.tls = TlsFiles::in_dir(dir, "node");
        }
        if let Some(v) = &self.server_name {
            cfg.server_name = Some(v.clone());
        }
        if let Some(v) = &self.control {
            cfg.control_socket = v.clone();
        }
        if let Some(v) = self.agent_check {
            cfg.agent_check = Some(v);
        }
        if let Some(v) = self.metrics {
            cfg.metrics = Some(v);
        }
        if let Some(v) = &self.drain_file {
            cfg.drain_file = Some(v.clone());
        }
        if let Some(v) = self.drain_quiet_ms {
            cfg.drain_quiet_ms = v;
        }
        Ok(cfg.resolve())
    }
}

impl Cli {
    /// Parses `args` (the program name first). A daemon flag given to a subcommand that
    /// does not use it (`status --port 80`: `status` only reads the running daemon
    /// through `--control`) is an error that says where it belongs, not ignored.
    pub fn try_parse_checked<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut command = Cli::command();
        let matches = command.try_get_matches_from_mut(args)?;
        if let Some(message) = misplaced(&matches) {
            return Err(command.error(clap::error::ErrorKind::ArgumentConflict, message));
        }
        Cli::from_arg_matches(&matches)
    }

    /// [`Cli::try_parse_checked`] on the process's arguments; prints the error and exits
    /// on one.
    pub fn parse_checked() -> Cli {
        Cli::try_parse_checked(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }
}

/// What is wrong with a daemon flag given on the command line for a subcommand that
/// does not use it, if one was.
fn misplaced(matches: &ArgMatches) -> Option<String> {
    let (sub, sub_matches) = matches.subcommand()?;
    let daemon = Flags::augment_args(clap::Command::new("flags"));
    for arg in daemon.get_arguments() {
        let id = arg.get_id().as_str();
        let given = [matches, sub_matches]
            .iter()
            .any(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine));
        let used = match sub {
            "run" => true,
            // They check or sample what the daemon would run with; they log nothing.
            "check" | "sample" => id != "log_json",
            // They talk to the running daemon through its control socket.
            _ => id == "control",
        };
        if given && !used {
            let flag = arg
                .get_long()
                .map(|l| format!("--{l}"))
                .unwrap_or_else(|| id.to_string());
            return Some(format!(
                "`{flag}` is a flag of the daemon (`ballast-agent run`), and `{sub}` does \
                 not use it{}",
                if sub == "status" || sub == "drain" || sub == "undrain" {
                    ": it reads the running daemon through --control only"
                } else {
                    ""
                }
            ));
        }
    }
    None
}

/// Any path, the empty one included: `--control ""` turns the control socket off,
/// which clap's own path parser would refuse.
fn any_path(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_checked(std::iter::once("ballast-agent").chain(args.iter().copied()))
    }

    #[test]
    fn daemon_flags_where_they_are_not_used_are_refused() {
        for (args, words) in [
            (
                &["status", "--port", "80"][..],
                "`--port` is a flag of the daemon",
            ),
            (
                &["--service", "web", "drain"][..],
                "`drain` does not use it",
            ),
            (&["check", "--log-json"][..], "`--log-json`"),
        ] {
            let err = parse(args).err().expect("refused").to_string();
            assert!(err.contains(words), "{args:?}: {err}");
        }
        parse(&["--service", "web", "check", "--port", "80"]).expect("check takes them");
        let cli = parse(&["status", "--control", "/tmp/a.sock"]).expect("status");
        let Some(Command::Status(c)) = cli.command else {
            panic!("status")
        };
        assert_eq!(c.control, PathBuf::from("/tmp/a.sock"));
    }

    #[test]
    fn help_shows_the_defaults_the_configuration_has() {
        let cfg = AgentConfig::default();
        let help = Cli::command().render_long_help().to_string();
        for default in [
            format!("[default: {}]", cfg.interval_ms),
            format!("[default: {}]", cfg.control_socket.display()),
            format!("[default: {}]", cfg.drain_quiet_ms),
            "[default: /etc/ballast/tls]".to_string(),
            "[default: host]".to_string(),
        ] {
            assert!(help.contains(&default), "--help lacks {default}:\n{help}");
        }
        assert_eq!(cfg.cpu, CpuSpec::Host);
        assert!(cfg.tls.cert.starts_with("/etc/ballast/tls"));
    }
}
