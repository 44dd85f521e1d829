//! `ballast-aggregator`: flags, logging and messages for people. The work is in the
//! library.

use anyhow::{Context, Result};
use ballast_aggregator::cli::{
    CertsCommand, Cli, ClientArgs, Command, CommonArgs, ConfigCommand, NodeAction, RelayArgs,
    RunArgs, TokenCommand,
};
use ballast_aggregator::client::{self, ActTarget, ApiClient};
use ballast_aggregator::config::Config;
use ballast_aggregator::daemon::{self, Daemon};
use ballast_shared::config::init_logging;
use reqwest::Method;
use serde_json::json;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse_checked();
    let result = match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(args),
        Some(Command::Relay(args)) => relay(args),
        Some(Command::Certs(CertsCommand::Init {
            dir,
            nodes,
            services,
            validity_days,
            server_names,
        })) => certs_init(&dir, &nodes, &services, validity_days, server_names),
        Some(Command::Certs(CertsCommand::Issue {
            dir,
            node,
            services,
            validity_days,
        })) => certs_issue(&dir, &node, &services, validity_days),
        Some(Command::Certs(CertsCommand::Server {
            dir,
            name,
            server_names,
        })) => certs_server(&dir, &name, &server_names),
        Some(Command::Certs(CertsCommand::Relay {
            dir,
            name,
            validity_days,
        })) => certs_relay(&dir, &name, validity_days),
        Some(Command::Certs(CertsCommand::Revoke { dir, node, serial })) => {
            certs_revoke(&dir, node, serial)
        }
        Some(Command::Token(TokenCommand::Hash { name, role })) => token_hash(&name, role),
        Some(Command::Token(TokenCommand::New {
            tokens,
            name,
            role,
            out,
        })) => token_new(&tokens, &name, role, &out),
        Some(Command::Check { config }) => check(&config),
        Some(Command::Config(ConfigCommand::Check { dir })) => config_check(&dir, &cli.run),
        Some(Command::Config(ConfigCommand::Restore { backup, to, exact })) => {
            config_restore(&backup, &to, exact)
        }
        Some(Command::Services(args)) => services(&args),
        Some(Command::Service { name, client }) => service(&name, &client),
        Some(Command::Endpoints { name, client }) => endpoints(&name, &client),
        Some(Command::Watch { name, client }) => watch(&name, &client),
        Some(Command::Drain(a)) => on_node(Method::POST, ActTarget::Drain(&a.node), &a, json!({})),
        Some(Command::Undrain(a)) => {
            on_node(Method::DELETE, ActTarget::Drain(&a.node), &a, json!({}))
        }
        Some(Command::Pin {
            weight,
            for_s,
            target,
        }) => on_node(
            Method::POST,
            ActTarget::Pin(&target.node),
            &target,
            json!({ "weight": weight, "for_s": for_s }),
        ),
        Some(Command::Unpin(a)) => on_node(Method::DELETE, ActTarget::Pin(&a.node), &a, json!({})),
        Some(Command::Hold {
            service,
            for_s,
            reason,
            client,
        }) => act(
            Method::POST,
            &service,
            ActTarget::Hold,
            &client,
            json!({ "reason": reason, "for_s": for_s }),
        ),
        Some(Command::Release {
            service,
            reason,
            client,
        }) => act(
            Method::DELETE,
            &service,
            ActTarget::Hold,
            &client,
            json!({ "reason": reason }),
        ),
        Some(Command::Audit(client)) => audit(&client),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "ballast-aggregator: {}",
                ballast_shared::error_chain(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

/// The configuration file named by `args`, or the defaults, with the flags both
/// commands share applied; not validated yet.
fn common_config(args: &CommonArgs) -> Result<Config> {
    let mut cfg = match &args.config {
        // Checked once the flags are in (each command's own config does it).
        Some(path) => Config::read(path)?,
        None => Config::default(),
    };
    args.apply(&mut cfg)?;
    Ok(cfg)
}

fn config(args: &RunArgs) -> Result<Config> {
    let mut cfg = common_config(&args.common)?;
    if let Some(v) = args.xds {
        cfg.xds = Some(v);
    }
    if let Some(v) = args.xds_tls {
        cfg.xds_tls = v;
    }
    if let Some(v) = args.agent_check {
        cfg.agent_check = Some(v);
    }
    if let Some(dir) = &args.config_dir {
        cfg.service_config.dir = Some(dir.clone());
    }
    if let Some(v) = &args.store {
        cfg.store.path = v.clone();
    }
    if let Some(replica) = &args.replica {
        cfg.cluster
            .as_mut()
            .context("--replica needs --cluster or a [cluster] table")?
            .replica = Some(replica.clone());
    }
    if let Some(v) = args.cycle_ms {
        cfg.balance.cycle_ms = v;
    }
    if let Some(v) = args.grace_ms {
        cfg.balance.grace_ms = v;
    }
    if let Some(v) = args.report_interval_ms {
        cfg.report_interval_ms = v;
    }
    args.http.apply(&mut cfg);
    cfg.validate().with_context(|| args.common.origin())?;
    cfg.check_http_exposure()
        .with_context(|| args.common.origin())?;
    Ok(cfg)
}

fn run(args: RunArgs) -> Result<ExitCode> {
    init_logging(args.common.log_json, "info");
    let cfg = config(&args)?;
    let (identity, ca) = daemon::load_tls(&cfg)
        .context("loading TLS files (create them with `ballast-aggregator certs init DIR`)")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut daemon = Daemon::start(&cfg, identity, &ca).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let failed = tokio::select! {
            _ = tokio::signal::ctrl_c() => None,
            _ = term.recv() => None,
            end = daemon.failed() => Some(end),
        };
        match failed {
            None => {
                tracing::info!("stopping");
                daemon.shutdown().await;
                Ok(ExitCode::SUCCESS)
            }
            Some(end) => {
                tracing::error!(task = end.task, reason = %end.reason,
                    "stopping: a task the daemon needs has ended; exiting non-zero so that \
                     the service manager restarts it");
                daemon.shutdown().await;
                eprintln!("ballast-aggregator: {end}");
                Ok(ExitCode::FAILURE)
            }
        }
    })
}

/// `ballast-aggregator relay`, the relay's old name: says so, and runs the relay
/// (`ballast-relay`'s own code).
fn relay(args: RelayArgs) -> Result<ExitCode> {
    init_logging(args.common.log_json, "info");
    eprintln!("ballast-aggregator: {RELAY_DEPRECATED}");
    run_relay(&args)
}

/// What `ballast-aggregator relay` says when it starts.
const RELAY_DEPRECATED: &str = "`ballast-aggregator relay` is deprecated and will be removed in \
    the next release: run `ballast-relay` (the same flags and configuration) instead";

#[cfg(feature = "etcd")]
fn run_relay(args: &RelayArgs) -> Result<ExitCode> {
    Ok(ballast_relay::cli::run(args, "ballast-aggregator relay")?)
}

#[cfg(not(feature = "etcd"))]
fn run_relay(_args: &RelayArgs) -> Result<ExitCode> {
    anyhow::bail!(
        "a relay reads its cluster's owners from etcd, but this ballast-aggregator was built \
         without the etcd feature: run `ballast-relay`"
    )
}

fn validity(days: u32) -> std::time::Duration {
    std::time::Duration::from_secs(u64::from(days) * 86_400)
}

fn print_written(written: &[ballast_aggregator::certs::Written]) {
    for w in written {
        println!("wrote {}: {}", w.path.display(), w.summary);
    }
}

fn certs_init(
    dir: &std::path::Path,
    nodes: &[String],
    services: &[String],
    validity_days: u32,
    names: Vec<String>,
) -> Result<ExitCode> {
    let used = if names.is_empty() {
        ballast_aggregator::certs::default_server_names()
    } else {
        names.clone()
    };
    let written = ballast_aggregator::certs::init(
        dir,
        &used,
        &names,
        nodes,
        services,
        validity(validity_days),
    )?;
    print_written(&written);
    if !nodes.is_empty() && services.is_empty() {
        eprintln!(
            "note: these node certificates name no service; the aggregator refuses their \
             hellos unless its authorization policy grants them services (--service names them)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn certs_issue(
    dir: &std::path::Path,
    node: &str,
    services: &[String],
    validity_days: u32,
) -> Result<ExitCode> {
    let written = ballast_aggregator::certs::issue(dir, node, services, validity(validity_days))?;
    print_written(&[written]);
    Ok(ExitCode::SUCCESS)
}

fn certs_server(dir: &std::path::Path, name: &str, more: &[String]) -> Result<ExitCode> {
    let written = ballast_aggregator::certs::issue_server(dir, name, more)?;
    print_written(&[written]);
    Ok(ExitCode::SUCCESS)
}

fn certs_relay(dir: &std::path::Path, name: &str, validity_days: u32) -> Result<ExitCode> {
    let written = ballast_aggregator::certs::issue_relay(dir, name, validity(validity_days))?;
    print_written(&[written]);
    Ok(ExitCode::SUCCESS)
}

fn certs_revoke(
    dir: &std::path::Path,
    node: Option<String>,
    serial: Option<String>,
) -> Result<ExitCode> {
    use ballast_aggregator::certs::RevokeTarget;
    let target = match (node, serial) {
        (_, Some(serial)) => RevokeTarget::Serial(serial),
        (Some(node), None) => RevokeTarget::Node(node),
        (None, None) => anyhow::bail!("name a node or give --serial"),
    };
    let written = ballast_aggregator::certs::revoke(dir, &target)?;
    print_written(&[written]);
    Ok(ExitCode::SUCCESS)
}

fn check(path: &std::path::Path) -> Result<ExitCode> {
    match Config::load(path) {
        Ok(_) => {
            println!("ok: {}", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("invalid: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Exit code of `config check` when the directory or the config file cannot be read,
/// so that CI can tell "your file is wrong" (1) from "the check could not run" (2).
const CHECK_UNUSABLE: u8 = 2;

fn config_check(dir: &std::path::Path, args: &RunArgs) -> Result<ExitCode> {
    let defaults = match &args.common.config {
        Some(path) => match Config::load(path) {
            Ok(cfg) => cfg.balance.0,
            Err(e) => {
                eprintln!("cannot use {}: {e}", path.display());
                return Ok(ExitCode::from(CHECK_UNUSABLE));
            }
        },
        None => Config::default().balance.0,
    };
    let verdicts = match ballast_aggregator::config::dir::check(dir, &defaults) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("cannot check: {e}");
            return Ok(ExitCode::from(CHECK_UNUSABLE));
        }
    };
    let mut bad = 0;
    for (file, verdict) in &verdicts {
        match verdict {
            Ok(()) => println!("ok: {file}"),
            Err(e) => {
                bad += 1;
                match e.line {
                    Some(line) => println!("invalid: {file}, line {line}: {}", e.message),
                    None => println!("invalid: {file}: {}", e.message),
                }
            }
        }
    }
    println!(
        "{} file(s) checked in {}, {bad} invalid",
        verdicts.len(),
        dir.display()
    );
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn config_restore(backup: &std::path::Path, to: &std::path::Path, exact: bool) -> Result<ExitCode> {
    let (written, removed) = ballast_aggregator::config::dir::restore(backup, to, exact)?;
    for f in &written {
        println!("restored {}", to.join(f).display());
    }
    for f in &removed {
        println!("removed {}", to.join(f).display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The API client `args` describe: the URL, and the credentials and CA to use.
fn api_client(args: &ClientArgs) -> Result<ApiClient> {
    let token = match &args.token_file {
        Some(path) => {
            Some(client::read_token(path).with_context(|| format!("reading {}", path.display()))?)
        }
        None => None,
    };
    let options = client::ClientOptions {
        token,
        ca: args.ca.clone(),
        identity: args.cert.clone().zip(args.key.clone()),
    };
    Ok(ApiClient::with_options(&args.url, &options)?)
}

/// Prints a token file entry for the token on standard input.
fn token_hash(name: &str, role: ballast_aggregator::api::auth::Role) -> Result<ExitCode> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("reading the token from standard input")?;
    let entry =
        ballast_aggregator::api::auth::hash_entry(name, role, line.trim_end_matches(['\r', '\n']))?;
    print!("{entry}");
    Ok(ExitCode::SUCCESS)
}

fn token_new(
    tokens: &std::path::Path,
    name: &str,
    role: ballast_aggregator::api::auth::Role,
    out: &std::path::Path,
) -> Result<ExitCode> {
    let made = ballast_aggregator::api::auth::new_token(tokens, name, role, out)?;
    println!(
        "token {name:?} ({}) written to {}; its hash added to {}",
        role.label(),
        made.token_file.display(),
        made.tokens.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs one client request to its end, on a runtime of its own (one thread).
fn block_on<T>(request: impl std::future::Future<Output = T>) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the client's runtime")?;
    Ok(runtime.block_on(request))
}

fn services(args: &ClientArgs) -> Result<ExitCode> {
    let (list, raw) = block_on(api_client(args)?.services())??;
    if args.json {
        println!("{}", raw.trim_end());
    } else {
        print!("{}", client::services_table(&list));
    }
    Ok(ExitCode::SUCCESS)
}

fn service(name: &str, args: &ClientArgs) -> Result<ExitCode> {
    let (detail, raw) = block_on(api_client(args)?.service(name))??;
    if args.json {
        println!("{}", raw.trim_end());
    } else {
        print!("{}", client::service_summary(&detail));
    }
    Ok(ExitCode::SUCCESS)
}

fn endpoints(name: &str, args: &ClientArgs) -> Result<ExitCode> {
    let (list, raw) = block_on(api_client(args)?.endpoints(name))??;
    if args.json {
        println!("{}", raw.trim_end());
    } else {
        print!("{}", client::endpoints_table(&list));
    }
    Ok(ExitCode::SUCCESS)
}

/// An action on one endpoint: `extra` are the action's own fields beside the reason.
fn on_node(
    method: Method,
    target: ActTarget<'_>,
    a: &NodeAction,
    mut extra: serde_json::Value,
) -> Result<ExitCode> {
    if let Some(fields) = extra.as_object_mut() {
        fields.insert("reason".into(), json!(a.reason));
    }
    act(method, &a.service, target, &a.client, extra)
}

/// Sends an operator's action and prints what it did.
fn act(
    method: Method,
    service: &str,
    target: ActTarget<'_>,
    args: &ClientArgs,
    body: serde_json::Value,
) -> Result<ExitCode> {
    let (done, raw) = block_on(api_client(args)?.act(method, service, target, &body))??;
    if args.json {
        println!("{}", raw.trim_end());
    } else {
        let r = &done.audit;
        let on = match &r.node {
            Some(node) => format!("{node} of {}", r.service),
            None => r.service.clone(),
        };
        let until = r
            .until_ms
            .map(|u| format!(" until {u} ms since the Unix epoch"))
            .unwrap_or_default();
        let replica = |name: &Option<String>| {
            name.as_deref()
                .map(|n| format!(" at replica {n}"))
                .unwrap_or_default()
        };
        match done.outcome {
            ballast_aggregator::api::act::Outcome::Applied => println!(
                "{} {on}{until}: done by {}{} (audit record {})",
                r.action,
                r.who,
                replica(&done.applied_by),
                r.seq
            ),
            ballast_aggregator::api::act::Outcome::Accepted => println!(
                "{} {on}{until}: accepted{} for the service's owner, which has not applied \
                 it yet; it does when it holds the service (audit record {})",
                r.action,
                replica(&r.received_by),
                r.seq
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints the audit trail, newest first.
fn audit(args: &ClientArgs) -> Result<ExitCode> {
    let (records, raw) = block_on(api_client(args)?.audit())??;
    if args.json {
        println!("{}", raw.trim_end());
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                r.seq.to_string(),
                r.at_ms.to_string(),
                r.who.clone(),
                r.from.clone().unwrap_or_default(),
                r.action.clone(),
                r.service.clone(),
                r.node.clone().unwrap_or_default(),
                r.reason.clone(),
            ]
        })
        .collect();
    print!(
        "{}",
        client::table(
            &["SEQ", "AT_MS", "WHO", "FROM", "ACTION", "SERVICE", "NODE", "REASON"],
            &rows
        )
    );
    Ok(ExitCode::SUCCESS)
}

/// Prints each new weight version until interrupted (the default SIGINT action ends
/// the process) or until the stream fails.
fn watch(name: &str, args: &ClientArgs) -> Result<ExitCode> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let mut failed = None;
    let client = api_client(args)?;
    block_on(client.watch(name, |set, raw| {
        let line = if args.json {
            raw.to_string()
        } else {
            client::watch_line(set)
        };
        // A closed stdout (the reader went away) ends the watch.
        match writeln!(out, "{line}").and_then(|()| out.flush()) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        }
    }))??;
    match failed {
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Some(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
        None => Ok(ExitCode::SUCCESS),
    }
}
