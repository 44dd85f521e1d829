//! `ballast-agent`: flags, logging and messages for people. The work is in the library.

use anyhow::{Context, Result};
use ballast_agent::cli::{Cli, Command, CtlArgs, Flags};
use ballast_agent::control::{self, Request, Response};
use ballast_agent::daemon::{self, Agent};
use ballast_agent::sample::{no_assignment, synthetic::SyntheticHandle, InflightSpec};
use ballast_shared::config::init_logging;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse_checked();
    let result = match cli.command {
        None => run(cli.flags),
        Some(Command::Run(f)) => run(cli.flags.merged(&f)),
        Some(Command::Sample {
            flags,
            window,
            json,
        }) => sample(cli.flags.merged(&flags), window, json),
        Some(Command::Status(c)) => ctl(&c, Request::Status),
        Some(Command::Drain(c)) => ctl(&c, Request::Drain),
        Some(Command::Undrain(c)) => ctl(&c, Request::Undrain),
        Some(Command::Check(f)) => check(cli.flags.merged(&f)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ballast-agent: {}", ballast_shared::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(flags: Flags) -> Result<ExitCode> {
    init_logging(flags.log_json, "info");
    let cfg = flags.config()?;
    cfg.validate()?;
    // Checked before the runtime starts, for an error that says what it was loading.
    daemon::client_config(&cfg).context("loading TLS files")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let code = rt.block_on(async move {
        let agent = Agent::start(cfg, SyntheticHandle::new()).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        agent.stop().await;
        Ok(ExitCode::SUCCESS)
    });
    // A sample stuck in a source (a hung DNS lookup) must not hold up the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

fn sample(flags: Flags, window: f64, json: bool) -> Result<ExitCode> {
    let cfg = flags.config()?;
    let mut sampler = daemon::open_sampler(&cfg, &SyntheticHandle::new(), &no_assignment())?;
    // CPU needs two readings for a delta.
    sampler.sample()?;
    std::thread::sleep(std::time::Duration::from_secs_f64(window.clamp(0.05, 60.0)));
    let s = sampler.sample()?;
    if json {
        let v = serde_json::json!({
            "cpu": s.cpu, "inflight": s.inflight, "capacity": s.capacity,
            "inflight_detail": sampler.inflight_detail(),
            "inflight_series": sampler.inflight_series(),
            "error_rate": s.error_rate, "load": s.load, "sources": sampler.describe(),
        });
        println!("{v}");
    } else {
        println!("sources   {}", sampler.describe());
        println!("cpu       {:.1} %", s.cpu * 100.0);
        let detail = sampler
            .inflight_detail()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        if s.capacity > 0 {
            println!(
                "in-flight {}{detail}, {:.1} % of the configured capacity {}",
                s.inflight,
                f64::from(s.inflight) / f64::from(s.capacity) * 100.0,
                s.capacity
            );
            print_series(&sampler);
            println!("load      {:.3}  (max of cpu and in-flight share)", s.load);
        } else {
            println!("in-flight {}{detail}", s.inflight);
            print_series(&sampler);
            println!(
                "load      {:.3}  (cpu here; the aggregator adds the in-flight term by \
                 comparing this count per unit of weight with the rest of the service)",
                s.load
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `check --inflight auto[:URL]`: what the service's port speaks, and which presets'
/// series the URL has.
fn probe_inflight(port: u16, url: Option<&str>) -> Result<ExitCode> {
    use ballast_agent::sample::probe::{self, Speaks};
    if port == 0 {
        println!("port      not set (--port): not probed");
    } else {
        match probe::port_protocol(port).context("probing the service port")? {
            Speaks::Http2 => println!(
                "port      {port} speaks HTTP/2 (it answered the preface with SETTINGS): the \
                 TCP count sees at most 1 per connection; if it is gRPC, use grpc:METRICS_URL"
            ),
            Speaks::Http1 => println!(
                "port      {port} speaks HTTP/1.x, not HTTP/2 with prior knowledge: tcp:{port} \
                 counts its requests unless clients send back to back on keep-alive"
            ),
            Speaks::Other(what) => println!("port      {port}: {what}"),
        }
    }
    let Some(url) = url else {
        println!("metrics   no URL given (auto:http://HOST:PORT/PATH): no preset checked");
        return Ok(ExitCode::SUCCESS);
    };
    let mut any = false;
    for (preset, found) in probe::presets_on(url).context("scraping the metrics URL")? {
        let spec = match preset.option() {
            Some(key) => format!("{}:{url}[#{key}=...]", preset.name()),
            None => format!("{}:{url}", preset.name()),
        };
        match found {
            Ok(how) => {
                any = true;
                println!("found     {spec}  ({how})");
            }
            Err(why) => println!("absent    {}: {why}", preset.name()),
        }
    }
    if !any {
        println!("metrics   {url} has none of the presets' series: prometheus:{url}#EXPR");
    }
    Ok(ExitCode::SUCCESS)
}

/// The series the in-flight count summed, one per line under it.
fn print_series(sampler: &ballast_agent::sample::Sampler) {
    for line in sampler.inflight_series() {
        println!("          {line}");
    }
}

fn ctl(args: &CtlArgs, req: Request) -> Result<ExitCode> {
    let resp = control::request(&args.control, req)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&resp)?);
    } else {
        print_human(req, &resp);
    }
    Ok(if resp.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_human(req: Request, resp: &Response) {
    if let Some(err) = &resp.error {
        println!("error: {err}");
        return;
    }
    let Some(s) = &resp.status else { return };
    match req {
        Request::Drain => println!(
            "draining {} of {}: the aggregator will publish weight 0",
            s.node, s.service
        ),
        Request::Undrain => println!(
            "undrained {} of {}: back through the cold-start ramp",
            s.node, s.service
        ),
        Request::Status => {}
    }
    let fmt_opt =
        |v: Option<f64>, d: usize| v.map(|x| format!("{x:.d$}")).unwrap_or_else(|| "-".into());
    println!("node        {} ({})", s.node, s.service);
    if !s.address.is_empty() {
        println!("address     {} ({})", s.address, s.address_origin);
    }
    println!(
        "aggregator  {}",
        s.connected_to.as_deref().unwrap_or("not connected")
    );
    println!(
        "last report load {} cpu {} in-flight {}",
        fmt_opt(s.last_load, 3),
        fmt_opt(s.last_cpu, 3),
        s.last_inflight
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    if let Some(d) = &s.inflight_detail {
        println!("in-flight   {d}");
    }
    let trust = match s.inflight_trusted {
        Some(true) => "in-flight count trusted",
        Some(false) => "in-flight count set aside: it does not follow this node's weight",
        None => "no reply yet",
    };
    println!(
        "aggregator's view  load {} ({trust})",
        fmt_opt(s.aggregator_load, 3)
    );
    println!(
        "weight      {} (cycle {})",
        fmt_opt(s.weight, 3),
        s.weight_cycle
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!(
        "reports     {} sent, {} failed; {} connect failures, {} sample errors",
        s.reports_sent, s.reports_failed, s.connect_failures, s.sample_errors
    );
    let state = match (s.draining, s.drain_acknowledged) {
        (false, _) => "serving",
        (true, false) => "draining (the aggregator has not acknowledged it yet)",
        (true, true) => "draining (acknowledged: every feed publishes weight 0)",
    };
    println!("state       {state}");
    if s.draining {
        if let Some(reason) = &resp.stop_reason {
            println!("stop        {reason}");
        }
    }
    if let Some(e) = &s.last_error {
        println!("last error  {e}");
    }
    if let Some(r) = &s.rejection {
        println!("refused     {} by {}: {}", r.reason, r.aggregator, r.detail);
    }
    if let Some(expires) = s.certificate_expires_unix_ms {
        let at = ballast_shared::pki::rfc3339(i64::try_from(expires / 1000).unwrap_or(0));
        match s.certificate_warning(ballast_shared::unix_ms()) {
            Some(w) => println!("certificate expires {at}: {w}"),
            None => println!("certificate expires {at}"),
        }
    }
    if let Some(w) = &resp.warning {
        println!("warning     {w}");
    }
}

fn check(flags: Flags) -> Result<ExitCode> {
    let cfg = flags.config()?;
    if let Some(InflightSpec::Auto { url }) = &cfg.inflight {
        return probe_inflight(cfg.port, url.as_deref());
    }
    cfg.validate()?;
    daemon::client_config(&cfg).context("TLS files")?;
    daemon::open_sampler(&cfg, &SyntheticHandle::new(), &no_assignment())
        .context("measurement sources")?;
    println!(
        "ok: node {} of service {} at {} ({}), reporting to {}",
        cfg.node,
        cfg.service,
        cfg.address,
        cfg.address_origin,
        cfg.aggregators.join(", ")
    );
    for note in daemon::certificate_notes(&cfg, ballast_shared::unix_ms()) {
        eprintln!("warning: {note}");
    }
    Ok(ExitCode::SUCCESS)
}
