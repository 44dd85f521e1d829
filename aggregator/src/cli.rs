//! The `ballast-aggregator` command line, in the library so that man pages and shell
//! completions can be generated from it.

pub use ballast_config::cli::{CommonArgs, HttpArgs, RelayArgs};
use ballast_config::fill_unset as fill;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Ballast aggregator: one PID controller per endpoint, weights for your load balancers.
#[derive(Parser)]
#[command(name = "ballast-aggregator", version, about, propagate_version = true)]
pub struct Cli {
    /// The subcommand; none runs the daemon.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Daemon flags given before any subcommand.
    #[command(flatten)]
    pub run: RunArgs,
}

/// The aggregator's subcommands.
// Parsed once per process: the size of the daemon's flags is of no consequence.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Run the aggregator daemon (the default).
    Run(RunArgs),
    /// Deprecated, to be removed in the next release: run `ballast-relay`, with the same
    /// flags. Runs a relay: agents connect to it as to an aggregator, and it hands their
    /// hellos and reports on to the cluster replica that owns each agent's service.
    Relay(RelayArgs),
    /// Certificates for a first deployment.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// The per-service config directory: check it offline, restore a backup.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Bearer tokens of the HTTP API.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Validate a configuration file and exit: 0 if valid, 1 if not.
    Check {
        /// The file.
        #[arg(long, short, env = "BALLAST_CONFIG")]
        config: PathBuf,
    },
    /// List the services of a running aggregator: endpoints, load spread, version.
    Services(ClientArgs),
    /// One service of a running aggregator: a summary and its recent cycles.
    Service {
        /// The service.
        name: String,
        /// Where the aggregator is, and the output format.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The endpoints of one service: address, zone, state, load, weight, report age.
    Endpoints {
        /// The service.
        name: String,
        /// Where the aggregator is, and the output format.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Follow one service's weights: a line per new weight version, until interrupted.
    Watch {
        /// The service.
        name: String,
        /// Where the aggregator is, and the output format.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Drain an endpoint from the control plane (operator role): weight 0 and
    /// DRAINING in every feed, whether or not its agent answers, until undrained.
    Drain(NodeAction),
    /// Lift an operator's drain (operator role).
    Undrain(NodeAction),
    /// Freeze a service's weights at their current values (operator role).
    Hold {
        /// The service.
        service: String,
        /// How long: 90s, 30m, 2h, 1d. Without it, until released.
        #[arg(long = "for", value_parser = crate::client::parse_duration)]
        for_s: Option<u64>,
        /// Why, for the audit trail.
        #[arg(long)]
        reason: String,
        /// Where the aggregator is, and the output format.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Release a service's hold (operator role).
    Release {
        /// The service.
        service: String,
        /// Why, for the audit trail.
        #[arg(long)]
        reason: String,
        /// Where the aggregator is, and the output format.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Fix one endpoint's weight, in units of the mean (operator role).
    Pin {
        /// The weight: 1.0 is an even share.
        #[arg(long)]
        weight: f64,
        /// How long: 90s, 30m, 2h, 1d. Without it, until unpinned.
        #[arg(long = "for", value_parser = crate::client::parse_duration)]
        for_s: Option<u64>,
        /// The endpoint and why.
        #[command(flatten)]
        target: NodeAction,
    },
    /// Lift a pin (operator role).
    Unpin(NodeAction),
    /// The audit trail of operators' actions, newest first.
    Audit(ClientArgs),
}

/// An action on one endpoint.
#[derive(Args, Clone)]
pub struct NodeAction {
    /// The endpoint's node.
    pub node: String,
    /// Its service.
    #[arg(long)]
    pub service: String,
    /// Why, for the audit trail.
    #[arg(long)]
    pub reason: String,
    /// Where the aggregator is, and the output format.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// How the read-only commands reach a running aggregator, and what they print.
#[derive(Args, Clone)]
pub struct ClientArgs {
    /// The aggregator's HTTP API.
    #[arg(long, env = "BALLAST_URL", default_value = crate::client::DEFAULT_URL)]
    pub url: String,
    /// Print the API's JSON as it is (for `watch`, one object per line).
    #[arg(long)]
    pub json: bool,
    /// A file holding the bearer token to send (its first line).
    #[arg(long, env = "BALLAST_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// The CA certificate (PEM) the aggregator's https:// certificate is checked
    /// against; without it, the system's roots are not used and https:// fails.
    #[arg(long, env = "BALLAST_CA")]
    pub ca: Option<PathBuf>,
    /// A client certificate (PEM) to present over https://; needs --key.
    #[arg(long, env = "BALLAST_CERT", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "BALLAST_KEY", requires = "cert")]
    pub key: Option<PathBuf>,
}

/// Token subcommands.
#[derive(Subcommand)]
pub enum TokenCommand {
    /// Read a token from standard input (one line) and print a `[[token]]` entry of
    /// the token file with its argon2 hash: the token itself is never written.
    Hash {
        /// The token's name, as the logs and metrics show it.
        #[arg(long)]
        name: String,
        /// Its role: viewer, operator or scrape.
        #[arg(long, value_enum)]
        role: crate::api::auth::Role,
    },
    /// Make a random token, write it to --out (a new file, mode 0600) and add its
    /// `[[token]]` entry (the argon2 hash) to the token file TOKENS, created if
    /// missing. A running aggregator takes it within `tokens_check_ms`.
    New {
        /// The token file of hashes (`[http_auth] tokens`, `run --http-tokens`).
        tokens: PathBuf,
        /// The token's name, as the logs, metrics and audit records show it.
        #[arg(long)]
        name: String,
        /// Its role: viewer, operator or scrape.
        #[arg(long, value_enum)]
        role: crate::api::auth::Role,
        /// Where to write the token itself, for the client (`--token-file`).
        #[arg(long)]
        out: PathBuf,
    },
}

/// Config-directory subcommands.
#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Validate every service file in DIR as the running aggregator would. Exit code 0
    /// if all are valid, 1 if any is not, 2 if DIR or --config cannot be read.
    Check {
        /// The per-service config directory.
        dir: PathBuf,
    },
    /// Write a backup's service files back into a config directory; a running
    /// aggregator picks them up live.
    Restore {
        /// A backup, `services-<unix ms>.json` in the backup directory.
        backup: PathBuf,
        /// The config directory to restore into.
        #[arg(long)]
        to: PathBuf,
        /// Also remove service files the backup does not have.
        #[arg(long)]
        exact: bool,
    },
}

/// Certificate subcommands.
#[derive(Subcommand)]
pub enum CertsCommand {
    /// Create a CA, a server certificate and node certificates in DIR (an existing CA and
    /// server certificate are reused).
    Init {
        /// Output directory.
        dir: PathBuf,
        /// Node identities to issue certificates for (comma-separated).
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// Services the --nodes may serve (comma-separated or repeated). A node
        /// certificate without one may serve nothing unless the aggregator's policy
        /// grants it services.
        #[arg(long = "service", value_delimiter = ',')]
        services: Vec<String>,
        /// How long the node certificates are valid, in days.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
        validity_days: u32,
        /// Every DNS name and IP address agents dial the aggregator by (comma-separated
        /// or repeated), e.g. agg.example [default: localhost, 127.0.0.1, ::1 and the
        /// host name]. A replica or relay with other names gets its own with `certs server`.
        #[arg(long = "server-name", value_delimiter = ',')]
        server_names: Vec<String>,
    },
    /// Issue a server certificate for a replica or relay from the CA in DIR, into
    /// DIR/servers/NAME/ (ca.pem, server.pem, server.key: copy it to that host and give
    /// it as --tls-dir), replacing any certificate there. It covers NAME and every
    /// --server-name.
    Server {
        /// The directory holding the CA (ca.pem, ca.key).
        dir: PathBuf,
        /// The replica's or relay's DNS name, as agents (and relays) dial it.
        name: String,
        /// More DNS names and IP addresses it is dialled by (comma-separated or repeated).
        #[arg(long = "server-name", value_delimiter = ',')]
        server_names: Vec<String>,
    },
    /// Issue one node certificate from the CA in DIR, into DIR/nodes/NODE/ (replacing
    /// any certificate there: to renew it, or to change its services).
    Issue {
        /// The directory holding the CA (ca.pem, ca.key).
        dir: PathBuf,
        /// The node's identity.
        node: String,
        /// The services it may serve (comma-separated or repeated; at least one).
        #[arg(long = "service", value_delimiter = ',', required = true)]
        services: Vec<String>,
        /// How long the certificate is valid, in days.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
        validity_days: u32,
    },
    /// Issue a relay certificate from the CA in DIR, into DIR/relays/NAME/ (replacing
    /// any certificate there). It names the relay and its role, and no service.
    Relay {
        /// The directory holding the CA (ca.pem, ca.key).
        dir: PathBuf,
        /// The relay's name (its identity).
        name: String,
        /// How long the certificate is valid, in days.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
        validity_days: u32,
    },
    /// Revoke a node's or relay's certificates: add them to DIR/crl.pem, which an
    /// aggregator given that file (`--crl`) reloads, closing the node's connection.
    Revoke {
        /// The directory holding the CA (ca.pem, ca.key).
        dir: PathBuf,
        /// The node (or relay) whose certificates are revoked: every one the CA issued
        /// to that name (DIR/issued.log), and the one in DIR/nodes/NODE/node.pem (or
        /// DIR/relays/NAME/relay.pem).
        #[arg(required_unless_present = "serial", conflicts_with = "serial")]
        node: Option<String>,
        /// Revoke one certificate by its serial number instead (hex).
        #[arg(long)]
        serial: Option<String>,
    },
}

/// The daemon's settings; each overrides the configuration file.
#[derive(Args, Clone, Default)]
pub struct RunArgs {
    /// The settings the relay has too.
    #[command(flatten)]
    pub common: CommonArgs,
    /// TCP address of the xDS (ADS) server for Envoy and proxyless gRPC, e.g.
    /// 0.0.0.0:7402 [default: off].
    #[arg(long, env = "BALLAST_XDS")]
    pub xds: Option<SocketAddr>,
    /// How the xDS port is secured: `tls` (the default, with the server certificate),
    /// `mutual` (clients need a certificate from the CA) or `plaintext` [default: tls].
    #[arg(long, env = "BALLAST_XDS_TLS", value_enum)]
    pub xds_tls: Option<crate::config::XdsTls>,
    /// TCP address where the aggregator answers HAProxy's agent-check for every node it
    /// publishes, so that a drain reaches HAProxy even from a node whose agent is
    /// wedged, e.g. 0.0.0.0:7404 [default: off].
    #[arg(long, env = "BALLAST_AGENT_CHECK")]
    pub agent_check: Option<SocketAddr>,
    /// The HTTP API's TLS and credentials, as the relay has them for its HTTP port.
    #[command(flatten)]
    pub http: HttpArgs,
    /// Per-service config directory (`<service>.toml` files), merged live.
    #[arg(long, env = "BALLAST_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,
    /// Routing store file [default: /var/lib/ballast/weights.json].
    #[arg(long, env = "BALLAST_STORE")]
    pub store: Option<PathBuf>,
    /// This replica's name in its cluster (default: host name and QUIC port).
    #[arg(long, env = "BALLAST_REPLICA")]
    pub replica: Option<String>,
    /// Balancing cycle in milliseconds [default: 1000].
    #[arg(long, env = "BALLAST_CYCLE_MS")]
    pub cycle_ms: Option<u64>,
    /// Start-up grace period in milliseconds [default: 3000].
    #[arg(long, env = "BALLAST_GRACE_MS")]
    pub grace_ms: Option<u64>,
    /// Report interval agents are told to use, in milliseconds [default: 1000].
    #[arg(long, env = "BALLAST_REPORT_INTERVAL_MS")]
    pub report_interval_ms: Option<u32>,
}

impl RunArgs {
    /// These flags, with those given before `run` (`top`) where these are unset.
    fn inherit(&mut self, top: &RunArgs) {
        self.common.inherit(&top.common);
        self.http.inherit(&top.http);
        fill!(self, top; xds, xds_tls, agent_check, config_dir, store, replica,
            cycle_ms, grace_ms, report_interval_ms);
    }
}

impl Cli {
    /// Parses `args` (the program name first). The daemon's flags given before the
    /// subcommand are honoured: by `run`, and by `relay` for those it has too (a flag
    /// after the subcommand wins). Given before (or with) any other subcommand, which
    /// would not use them, they are an error that says where they belong.
    pub fn try_parse_checked<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut command = Cli::command();
        let matches = command.try_get_matches_from_mut(args)?;
        if let Some(message) = misplaced(&command, &matches) {
            return Err(command.error(clap::error::ErrorKind::ArgumentConflict, message));
        }
        let mut cli = Cli::from_arg_matches(&matches)?;
        match &mut cli.command {
            Some(Command::Run(args)) => args.inherit(&cli.run),
            Some(Command::Relay(args)) => args.common.inherit(&cli.run.common),
            _ => {}
        }
        Ok(cli)
    }

    /// [`Cli::try_parse_checked`] on the process's arguments; prints the error and exits
    /// on one.
    pub fn parse_checked() -> Cli {
        Cli::try_parse_checked(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }
}

/// What is wrong with a daemon flag given on the command line for a subcommand that
/// does not use it, if one was.
fn misplaced(command: &clap::Command, matches: &ArgMatches) -> Option<String> {
    let (sub, sub_matches) = matches.subcommand()?;
    let path = match sub_matches.subcommand_name() {
        Some(inner) => format!("{sub} {inner}"),
        None => sub.to_string(),
    };
    let common: Vec<String> = CommonArgs::augment_args(clap::Command::new("common"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if matches.value_source(id) != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let is_common = common.iter().any(|c| c == id);
        let used = match path.as_str() {
            "run" => true,
            "relay" => is_common,
            "check" | "config check" => id == "config",
            _ => false,
        };
        if used {
            continue;
        }
        let flag = arg
            .get_long()
            .map(|l| format!("--{l}"))
            .unwrap_or_else(|| id.to_string());
        let belongs = if is_common {
            "a flag of `run` and `relay`"
        } else {
            "a flag of `run`"
        };
        return Some(format!(
            "`{flag}` is {belongs}, and `{path}` does not use it: give it to the command \
             that does, e.g. `ballast-aggregator run {flag} ...`"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_checked(std::iter::once("ballast-aggregator").chain(args.iter().copied()))
    }

    #[test]
    fn flags_before_run_are_honoured_and_after_win() {
        let cli = parse(&[
            "--http",
            "0.0.0.0:7401",
            "--store",
            "/s",
            "run",
            "--store",
            "/t",
        ])
        .expect("parses");
        let Some(Command::Run(args)) = cli.command else {
            panic!("run")
        };
        assert_eq!(
            args.common.http,
            Some("0.0.0.0:7401".parse().expect("addr"))
        );
        assert_eq!(
            args.store,
            Some(PathBuf::from("/t")),
            "the flag after run wins"
        );
        let cli = parse(&["--quic", "0.0.0.0:7500", "relay"]).expect("parses");
        let Some(Command::Relay(args)) = cli.command else {
            panic!("relay")
        };
        assert_eq!(
            args.common.quic,
            Some("0.0.0.0:7500".parse().expect("addr"))
        );
    }

    #[test]
    fn flags_a_subcommand_does_not_use_are_refused_saying_where_they_belong() {
        for (args, words) in [
            (
                &["--store", "/s", "relay"][..],
                "`--store` is a flag of `run`, and `relay` does not use it",
            ),
            (
                &["--http", "0.0.0.0:7401", "certs", "init", "/d"][..],
                "`--http` is a flag of `run` and `relay`, and `certs init` does not use it",
            ),
            (
                &["--xds", "0.0.0.0:7402", "services"][..],
                "`services` does not use it",
            ),
            (&["--log-json", "endpoints", "web"][..], "`--log-json`"),
        ] {
            let err = parse(args).err().expect("refused").to_string();
            assert!(err.contains(words), "{args:?}: {err}");
        }
        parse(&["--config", "/c", "config", "check", "/d"]).expect("config check reads --config");
    }

    #[test]
    fn help_shows_the_defaults_the_configuration_has() {
        let cfg = crate::config::Config::default();
        let help = Cli::command().render_long_help().to_string();
        for default in [
            format!("[default: {}]", cfg.quic),
            format!("[default: {}]", cfg.http),
            format!("[default: {}]", cfg.store.path.display()),
            format!("[default: {}]", cfg.balance.cycle_ms),
            format!("[default: {}]", cfg.balance.grace_ms),
            format!("[default: {}]", cfg.report_interval_ms),
            "[default: /etc/ballast/tls]".to_string(),
        ] {
            assert!(help.contains(&default), "--help lacks {default}:\n{help}");
        }
        assert!(cfg.tls.cert.starts_with("/etc/ballast/tls"));
    }
}
