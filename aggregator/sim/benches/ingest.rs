//! Ingest against bare QUIC: what the release `ballast-aggregator` spends per report,
//! next to a bare quinn server with the same mutual-TLS configuration and ALPN that
//! only counts each report datagram and answers it with a reply-sized one. Both run as
//! processes of their own, with tokio on two worker threads, and both are measured the
//! same way (`/proc/PID/task/*/schedstat`) under the same load generator, in one run.
//!
//! The load generator is this process: N QUIC connections, each with its own client
//! certificate from the project's CA, each opening with the real session (hello,
//! welcome) driven by `ballast_shared::session::ClientSession`, then sending 13-byte
//! reports at a fixed rate. Patterns: 200 × 10 Hz, 2,000 × 1 Hz and 10,000 × 1 Hz (or
//! as many as connect), each run twice per server in the order a b b a (or b a a b);
//! then a saturating pattern, 10 Hz per connection on more connections at each step
//! until the server stops keeping up.
//!
//! Run: `cargo build --release --bins && cargo bench -p ballast-sim --bench ingest`
//! (`-- quick`: one 5 s window per server and pattern, no 10,000 pattern, three
//! saturating steps; `-- max=N`: the largest pattern's connection count;
//! `-- aggregator=PATH`: another build as (b), to compare commits by their ratios). The bench
//! re-executes itself as `bare-server ADDR DIR INTERVAL_MS` for the bare server.
//!
//! `-- gate` is a performance gate, not yet in CI: the 2,000 × 1 Hz pattern only,
//! twice per server (a b b a), 8 s windows, no saturating pattern; it exits non-zero
//! when (b)/(a) exceeds [`GATE_BOUND`] or the run overruns [`GATE_BUDGET`].

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{cpu_seconds, release_binary, status_mib};

use ballast_shared::pki::Ca;
use ballast_shared::tls::{self, Identity};
use ballast_shared::wire::{self, Message, Reply, Welcome};
use ballast_sim::loadgen::{node_name, Load, Stats, Target};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The service every load connection reports for.
const SERVICE: &str = "bench";

/// The gate's bound on (b)/(a), CPU-µs per report of the aggregator over bare quinn's,
/// at 2,000 × 1 Hz (both servers' windows summed, a b b a).
///
/// The target, not yet a bound set from spread: one complete run measured 1.03 (the
/// aggregator 51.4 and 52.4 CPU-µs a report, bare quinn 47.2 and 53.4); two more, one
/// of them with 16 µs a report injected (`direct=16000`), overran the budget.
const GATE_BOUND: f64 = 1.15;
/// The gate gives up after this long, failing.
const GATE_BUDGET: Duration = Duration::from_secs(240);

/// How much the bench runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Full,
    Quick,
    Gate,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("bare-server") {
        bare_server(&args[2..]);
        return;
    }
    let mode = if args.iter().any(|a| a == "gate") {
        Mode::Gate
    } else if args.iter().any(|a| a == "quick") {
        Mode::Quick
    } else {
        Mode::Full
    };
    let max = args
        .iter()
        .find_map(|a| a.strip_prefix("max="))
        .map(|v| v.parse::<usize>().expect("max=N takes a number"))
        .unwrap_or(10_000);
    // `-- aggregator=PATH` measures another build as (b), such as an earlier commit's,
    // beside the same bare server.
    let agg = args
        .iter()
        .find_map(|a| a.strip_prefix("aggregator="))
        .map_or_else(|| release_binary("ballast-aggregator"), PathBuf::from);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        // Interrupted, the bench is dropped where it stands: its servers are killed and
        // its files removed on the way out.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        let budget = if mode == Mode::Gate {
            GATE_BUDGET
        } else {
            Duration::MAX
        };
        let passed = tokio::select! {
            passed = bench(agg, mode, max) => passed,
            () = tokio::time::sleep(budget) => {
                eprintln!("ingest gate: not done within {budget:?}: failed");
                false
            }
            _ = tokio::signal::ctrl_c() => { eprintln!("interrupted"); false }
            _ = term.recv() => { eprintln!("terminated"); false }
        };
        if !passed {
            std::process::exit(1);
        }
    });
}

/// A directory removed with everything in it when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------
// The bare server: another process running this binary.

/// `bare-server ADDR DIR INTERVAL_MS`: serves QUIC on ADDR with DIR's `server.pem`,
/// `server.key` and `ca.pem`, as the aggregator would. Prints `ready ADDR` once bound;
/// answers each `count` line on stdin with the datagrams received so far; exits when
/// stdin closes, so that it never outlives the bench.
fn bare_server(args: &[String]) {
    let [addr, dir, interval_ms] = args else {
        eprintln!("usage: ingest bare-server ADDR DIR INTERVAL_MS");
        std::process::exit(2);
    };
    let addr: SocketAddr = addr.parse().expect("address");
    let dir = Path::new(dir);
    let interval_ms: u32 = interval_ms.parse().expect("interval");
    let identity =
        Identity::load(&dir.join("server.pem"), &dir.join("server.key")).expect("identity");
    let ca = tls::certs_from_pem(&tls::read(&dir.join("ca.pem")).expect("ca"), "ca").expect("ca");
    // The aggregator's set-up: the shared TLS and transport config, and no keep-alives
    // from the server's side.
    let mut server = tls::server_config(identity, &ca).expect("server config");
    let mut transport = tls::transport();
    transport.keep_alive_interval(None);
    server.transport_config(Arc::new(transport));
    let welcome =
        ballast_shared::frame::encode(&Message::Welcome(Welcome { interval_ms })).expect("welcome");
    // A reply of the size the figures bench measures for a typical one.
    let reply = wire::encode(&Message::Reply(Reply {
        weight: 1.23,
        cycle: 86_400,
        interval_ms: 1000,
        draining: false,
        load: 0.42,
        inflight_trusted: true,
    }))
    .expect("reply");
    let count = Arc::new(AtomicU64::new(0));

    let counted = count.clone();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            match line.as_deref() {
                Ok("count") => println!("{}", counted.load(Ordering::Relaxed)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        std::process::exit(0);
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let endpoint = quinn::Endpoint::server(server, addr).expect("bind");
        println!("ready {}", endpoint.local_addr().expect("address"));
        let welcome: Arc<[u8]> = welcome.into();
        let reply: Arc<[u8]> = reply.into();
        while let Some(incoming) = endpoint.accept().await {
            // The aggregator's default: a Retry proves the address before the handshake.
            if !incoming.remote_address_validated() {
                let _ = incoming.retry();
                continue;
            }
            let (welcome, reply, count) = (welcome.clone(), reply.clone(), count.clone());
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                    return;
                };
                // Whatever the hello says, it is welcomed. The agent keeps its side of
                // the stream open (proofs of possession come on it), so one frame is
                // read, as the aggregator reads it, not the stream's end.
                if ballast_shared::frame::read(&mut recv).await.is_err()
                    || send.write_all(&welcome).await.is_err()
                {
                    return;
                }
                while let Ok(_report) = conn.read_datagram().await {
                    count.fetch_add(1, Ordering::Relaxed);
                    let _ = conn.send_datagram(reply.to_vec().into());
                }
            });
        }
    });
}

// ---------------------------------------------------------------------------------
// The servers as the bench sees them.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bare,
    Aggregator,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bare => "(a) bare quinn",
            Kind::Aggregator => "(b) ballast-aggregator",
        }
    }
}

/// Kills and reaps its child when dropped, however the bench ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What every server and pattern share: the TLS files, the clients' identities, the
/// binaries.
struct Setup {
    dir: PathBuf,
    aggregator: PathBuf,
    /// Where the load generator's connections go, but for the server's address.
    target: Target,
}

impl Setup {
    /// The load generator's target with `server` as its address.
    fn target_at(&self, server: SocketAddr) -> Target {
        Target {
            server,
            ..self.target.clone()
        }
    }
}

struct Server {
    kind: Kind,
    // Dropped first: the bare server's stdin closes as it is killed.
    io: Option<(ChildStdin, BufReader<ChildStdout>)>,
    process: Killed,
    quic: SocketAddr,
    http: String,
}

impl Server {
    /// Starts a server that tells agents to report every `interval_ms`.
    fn start(kind: Kind, setup: &Setup, interval_ms: u32) -> Server {
        match kind {
            Kind::Bare => {
                let mut child = Command::new(std::env::current_exe().expect("own path"))
                    .arg("bare-server")
                    .arg("127.0.0.1:0")
                    .arg(&setup.dir)
                    .arg(interval_ms.to_string())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("spawn the bare server");
                let stdin = child.stdin.take().expect("stdin");
                let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
                let process = Killed(child);
                let mut line = String::new();
                stdout.read_line(&mut line).expect("bare server output");
                let quic = line
                    .trim()
                    .strip_prefix("ready ")
                    .and_then(|a| a.parse().ok())
                    .unwrap_or_else(|| panic!("bare server did not start: {line:?}"));
                Server {
                    kind,
                    io: Some((stdin, stdout)),
                    process,
                    quic,
                    http: String::new(),
                }
            }
            Kind::Aggregator => {
                let quic: SocketAddr = format!("127.0.0.1:{}", free_udp_port()).parse().unwrap();
                let http = format!("127.0.0.1:{}", free_tcp_port());
                let store = setup.dir.join(format!("weights-{}.json", quic.port()));
                let mut cmd = Command::new(&setup.aggregator);
                cmd.arg("run")
                    .arg("--quic")
                    .arg(quic.to_string())
                    .args(["--http", &http, "--tls-dir"])
                    .arg(&setup.dir)
                    .arg("--store")
                    .arg(store)
                    .args(["--report-interval-ms", &interval_ms.to_string()]);
                let process = Killed(
                    cmd.env("RUST_LOG", "warn")
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("spawn the aggregator"),
                );
                let server = Server {
                    kind,
                    io: None,
                    process,
                    quic,
                    http,
                };
                let deadline = Instant::now() + Duration::from_secs(15);
                while metric(&server.http, "ballast_reports_accepted_total").is_none() {
                    assert!(Instant::now() < deadline, "the aggregator did not start");
                    std::thread::sleep(Duration::from_millis(100));
                }
                server
            }
        }
    }

    fn pid(&self) -> u32 {
        self.process.0.id()
    }

    /// Reports the server has counted: the aggregator's accepted reports, the bare
    /// server's datagrams.
    fn counted(&mut self) -> f64 {
        match &mut self.io {
            Some((stdin, stdout)) => {
                writeln!(stdin, "count").expect("ask the bare server");
                let mut line = String::new();
                stdout.read_line(&mut line).expect("bare server count");
                line.trim().parse().expect("count")
            }
            None => metric(&self.http, "ballast_reports_accepted_total").unwrap_or(f64::NAN),
        }
    }

    /// Reports the aggregator refused, for every reason (none for the bare server).
    fn refused(&self) -> f64 {
        match self.kind {
            Kind::Bare => 0.0,
            Kind::Aggregator => metric(&self.http, "ballast_reports_rejected_total").unwrap_or(0.0),
        }
    }
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free TCP port")
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("a free UDP port")
}

/// The sum of every sample of `name` (over all its labels) on the aggregator's
/// `/metrics`; `None` when the aggregator does not answer.
fn metric(http: &str, name: &str) -> Option<f64> {
    let mut s = std::net::TcpStream::connect(http).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {http}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let mut found = false;
    let mut sum = 0.0;
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            found = true;
            sum += v;
        }
    }
    found.then_some(sum)
}

/// Datagrams the kernel dropped at the UDP sockets bound to `ports` on loopback, for
/// want of room in their receive buffers (the last column of `/proc/net/udp`).
fn udp_drops(ports: &[u16]) -> u64 {
    let text = std::fs::read_to_string("/proc/net/udp").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = fields.get(1)?.rsplit(':').next()?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let drops = fields.last()?.parse::<u64>().ok()?;
            ports.contains(&port).then_some(drops)
        })
        .sum()
}

/// CPU seconds the whole machine has been busy (every state but idle and I/O wait),
/// from `/proc/stat`'s clock ticks: what the servers, the generator and anything else
/// running beside them used together.
fn machine_busy_seconds() -> f64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return f64::NAN;
    };
    let ticks: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is within user).
    let busy: u64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    // USER_HZ is 100 on every Linux this bench runs on.
    busy as f64 / 100.0
}

// ---------------------------------------------------------------------------------
// Measuring.

/// Counters at one moment.
struct Sample {
    at: Instant,
    server_cpu: f64,
    counted: f64,
    refused: f64,
    sent: u64,
    replies: u64,
    generator_cpu: f64,
    machine_busy: f64,
    server_drops: u64,
    generator_drops: u64,
}

fn sample(server: &mut Server, load: &Load) -> Sample {
    let generator_ports = load.ports();
    Sample {
        at: Instant::now(),
        server_cpu: cpu_seconds(server.pid()),
        counted: server.counted(),
        refused: server.refused(),
        sent: load.stats.sent.load(Ordering::Relaxed),
        replies: load.stats.replies.load(Ordering::Relaxed),
        generator_cpu: cpu_seconds(std::process::id()),
        machine_busy: machine_busy_seconds(),
        server_drops: udp_drops(&[server.quic.port()]),
        generator_drops: udp_drops(&generator_ports),
    }
}

/// What happened between two samples.
#[derive(Debug, Clone, Copy)]
struct Window {
    secs: f64,
    sent: f64,
    counted: f64,
    refused: f64,
    replies: f64,
    server_cpu: f64,
    generator_cpu: f64,
    machine_busy: f64,
    /// Datagrams the server's socket dropped, and the generator's sockets.
    server_drops: f64,
    generator_drops: f64,
    rss_mib: f64,
}

impl Window {
    fn between(a: &Sample, b: &Sample, rss_mib: f64) -> Window {
        Window {
            secs: b.at.duration_since(a.at).as_secs_f64(),
            sent: (b.sent - a.sent) as f64,
            counted: b.counted - a.counted,
            refused: b.refused - a.refused,
            replies: (b.replies - a.replies) as f64,
            server_cpu: b.server_cpu - a.server_cpu,
            generator_cpu: b.generator_cpu - a.generator_cpu,
            machine_busy: b.machine_busy - a.machine_busy,
            server_drops: b.server_drops.saturating_sub(a.server_drops) as f64,
            generator_drops: b.generator_drops.saturating_sub(a.generator_drops) as f64,
            rss_mib,
        }
    }

    /// Both windows together, as one of their summed length.
    fn plus(&self, o: &Window) -> Window {
        Window {
            secs: self.secs + o.secs,
            sent: self.sent + o.sent,
            counted: self.counted + o.counted,
            refused: self.refused + o.refused,
            replies: self.replies + o.replies,
            server_cpu: self.server_cpu + o.server_cpu,
            generator_cpu: self.generator_cpu + o.generator_cpu,
            machine_busy: self.machine_busy + o.machine_busy,
            server_drops: self.server_drops + o.server_drops,
            generator_drops: self.generator_drops + o.generator_drops,
            rss_mib: self.rss_mib.max(o.rss_mib),
        }
    }

    fn us_per_report(&self) -> f64 {
        self.server_cpu * 1e6 / self.counted
    }

    fn counted_per_s(&self) -> f64 {
        self.counted / self.secs
    }

    fn server_cores(&self) -> f64 {
        self.server_cpu / self.secs
    }

    fn machine_cores(&self) -> f64 {
        self.machine_busy / self.secs
    }
}

/// One server's run of one pattern.
struct Run {
    kind: Kind,
    connected: usize,
    window: Window,
    notes: Vec<String>,
}

/// One server's runs of a pattern, summed.
struct Runs {
    kind: Kind,
    /// The fewest connections any run had.
    connected: usize,
    window: Window,
    /// CPU-µs per report of each run, in the order they ran.
    each: Vec<f64>,
}

impl Runs {
    fn of(kind: Kind, runs: &[Run]) -> Option<Runs> {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.kind == kind).collect();
        let first = mine.first()?;
        Some(Runs {
            kind,
            connected: mine.iter().map(|r| r.connected).min().unwrap_or(0),
            window: mine[1..]
                .iter()
                .fold(first.window, |w, r| w.plus(&r.window)),
            each: mine.iter().map(|r| r.window.us_per_report()).collect(),
        })
    }
}

/// What went wrong or is worth knowing about a run, for the notes under the tables.
fn notes_of(pattern: &str, kind: Kind, stats: &Stats, w: &Window) -> Vec<String> {
    let who = format!("{pattern}, {}", kind.name());
    let mut notes = Vec::new();
    let failed = stats.failed.load(Ordering::Relaxed);
    if failed > 0 {
        let why = stats.first_error().unwrap_or_default();
        notes.push(format!(
            "{who}: {} failed (first: {why})",
            plural(failed, "connection")
        ));
    }
    let retried = stats.retried.load(Ordering::Relaxed);
    if retried > 0 {
        notes.push(format!(
            "{who}: {} failed once and opened again",
            plural(retried, "connection")
        ));
    }
    let lost = stats.lost.load(Ordering::Relaxed);
    if lost > 0 {
        notes.push(format!("{who}: {} lost", plural(lost, "connection")));
    }
    for (what, v) in [
        ("send errors", stats.send_errors.load(Ordering::Relaxed)),
        (
            "reports not 13 bytes long",
            stats.odd_reports.load(Ordering::Relaxed),
        ),
    ] {
        if v > 0 {
            notes.push(format!("{who}: {v} {what}"));
        }
    }
    if w.server_drops > 0.0 || w.generator_drops > 0.0 {
        notes.push(format!(
            "{who}: the kernel dropped {} datagrams at the server's socket and {} at the \
             generator's in the window (full receive buffers)",
            thousands(w.server_drops),
            thousands(w.generator_drops)
        ));
    }
    if w.refused > 0.0 {
        notes.push(format!(
            "{who}: {:.0} reports refused in the window",
            w.refused
        ));
    }
    let (lo, hi) = (
        stats.reply_min.load(Ordering::Relaxed),
        stats.reply_max.load(Ordering::Relaxed),
    );
    if lo <= hi {
        let size = if lo == hi {
            format!("{lo}")
        } else {
            format!("{lo}–{hi}")
        };
        notes.push(format!("{who}: replies of {size} bytes"));
    }
    notes
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// The interval the aggregator tells agents, for a pattern's rate.
fn interval_for(hz: u32) -> u32 {
    (1000 / hz.max(1)).clamp(100, 60_000)
}

fn pattern_name(n: usize, hz: u32) -> String {
    format!("{} × {hz} Hz", thousands(n as f64))
}

/// A fixed pattern: `n` connections at `hz` each, measured for `secs` after `warm`.
async fn fixed(setup: &Setup, kind: Kind, n: usize, hz: u32, warm: f64, secs: f64) -> Run {
    let mut server = Server::start(kind, setup, interval_for(hz));
    eprintln!(
        "{} (pid {}): {n} connections at {hz} Hz",
        kind.name(),
        server.pid()
    );
    let load = Load::start(setup.target_at(server.quic), n, hz)
        .await
        .expect("load generator");
    tokio::time::sleep(Duration::from_secs_f64(warm)).await;
    let a = sample(&mut server, &load);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let b = sample(&mut server, &load);
    let window = Window::between(&a, &b, status_mib(server.pid(), "VmRSS:"));
    let connected = load.outcome().0;
    let notes = notes_of(&pattern_name(n, hz), kind, &load.stats, &window);
    load.stop().await;
    drop(server);
    eprintln!(
        "  {:.1} CPU-µs per report, {:.0} counted",
        window.us_per_report(),
        window.counted
    );
    Run {
        kind,
        connected,
        window,
        notes,
    }
}

/// One step of the saturating pattern.
#[derive(Clone, Copy)]
struct Step {
    /// The connections asked for, and those open.
    target: usize,
    connections: usize,
    window: Window,
}

/// The saturating pattern: connections at `hz` each, more of them at each step, until
/// the server's throughput stops growing, its CPU is saturated, or the generator
/// cannot send what is asked. Each report still travels in a packet of its own, as
/// an agent's does: raising each connection's rate instead would let QUIC pack many
/// reports into one packet and measure something no fleet sends.
async fn saturate(
    setup: &Setup,
    kind: Kind,
    hz: u32,
    steps: &[usize],
    settle: f64,
    secs: f64,
) -> (Vec<Step>, Vec<String>) {
    let mut server = Server::start(kind, setup, interval_for(hz));
    eprintln!(
        "{} (pid {}): saturating at {hz} Hz per connection",
        kind.name(),
        server.pid()
    );
    let mut load = Load::start(setup.target_at(server.quic), steps[0], hz)
        .await
        .expect("load generator");
    let mut out: Vec<Step> = Vec::new();
    let mut notes = Vec::new();
    let name = "saturating";
    for &n in steps {
        // New connections are opened with the others paused: handshakes under a load
        // that already drops datagrams time out, and nothing here measures them.
        if load.len() < n {
            load.pause();
            load.grow(n).await.expect("load generator");
            load.resume(hz);
        }
        tokio::time::sleep(Duration::from_secs_f64(settle)).await;
        let a = sample(&mut server, &load);
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        let b = sample(&mut server, &load);
        let w = Window::between(&a, &b, status_mib(server.pid(), "VmRSS:"));
        let connections = load.outcome().0;
        eprintln!(
            "  {connections} connections: {:.0} counted/s on {:.2} cores, {:.1} µs per report",
            w.counted_per_s(),
            w.server_cores(),
            w.us_per_report()
        );
        let best = out
            .iter()
            .map(|s| s.window.counted_per_s())
            .fold(0.0, f64::max);
        let offered = f64::from(hz) * connections as f64;
        let why = if w.server_cores() > 1.9 {
            Some("the server used more than 1.9 cores")
        } else if !out.is_empty() && w.counted_per_s() < best * 1.05 {
            Some("throughput grew by less than 5 %")
        } else if w.counted < 0.9 * w.sent {
            Some("the server counted less than 90 % of the reports sent")
        } else if w.sent / w.secs < 0.9 * offered {
            Some("the generator sent less than 90 % of the offered rate")
        } else if connections * 10 < n * 9 {
            Some("more than 10 % of the connections failed")
        } else {
            None
        };
        out.push(Step {
            target: n,
            connections,
            window: w,
        });
        if let Some(why) = why {
            notes.push(format!(
                "{name}, {}: stopped at {} connections: {why}",
                kind.name(),
                thousands(connections as f64)
            ));
            break;
        }
    }
    if let Some(last) = out.last() {
        notes.extend(notes_of(name, kind, &load.stats, &last.window));
    }
    load.stop().await;
    drop(server);
    (out, notes)
}

// ---------------------------------------------------------------------------------
// The run and its tables.

fn thousands(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 {
        format!("-{out}")
    } else {
        out
    }
}

/// The order of the two servers in the `p`th pattern: alternating, so that drift in
/// what else the machine runs does not always fall on the same server.
fn order(p: usize) -> [Kind; 2] {
    if p.is_multiple_of(2) {
        [Kind::Bare, Kind::Aggregator]
    } else {
        [Kind::Aggregator, Kind::Bare]
    }
}

fn table_row(label: &str, n: usize, hz: u32, r: &Runs, ratio: &str) {
    let (kind, connected, w) = (r.kind, r.connected, &r.window);
    let each: Vec<String> = r.each.iter().map(|us| format!("{us:.1}")).collect();
    let connections = if connected == n {
        thousands(n as f64)
    } else {
        format!("{} of {}", thousands(connected as f64), thousands(n as f64))
    };
    println!(
        "| {label} | {} | {connections} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {:.1} | {:.2} | {ratio} |",
        kind.name(),
        thousands(f64::from(hz) * connected as f64),
        thousands(w.sent),
        thousands(w.counted),
        thousands(w.replies),
        w.server_cpu,
        w.us_per_report(),
        each.join(", "),
        w.rss_mib,
        w.machine_cores(),
    );
}

/// Runs the bench; false when the gate failed (or was interrupted).
async fn bench(aggregator: PathBuf, mode: Mode, max: usize) -> bool {
    let quick = mode != Mode::Full;
    let scratch =
        Scratch(std::env::temp_dir().join(format!("ballast-ingest-{}", std::process::id())));
    let dir = scratch.0.clone();
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ca = Ca::generate("ingest bench CA").expect("ca");
    ca.pem().write(&dir, "ca").expect("write ca");
    ca.issue_server(&["127.0.0.1".into()])
        .expect("server cert")
        .write(&dir, "server")
        .expect("write server cert");
    let ca_certs = tls::certs_from_pem(&ca.pem().cert, "ca").expect("ca");

    let (secs, warm, rounds) = match mode {
        Mode::Full => (15.0, 3.0, 2),
        Mode::Quick => (5.0, 2.0, 1),
        Mode::Gate => (8.0, 2.0, 2),
    };
    let mut patterns: Vec<(usize, u32)> = vec![(200, 10), (2_000, 1)];
    if mode == Mode::Gate {
        patterns = vec![(2_000, 1)];
    }
    if !quick {
        patterns.push((max, 1));
    }
    let sat_hz = 10;
    let (sat_steps, settle, step_secs): (&[usize], f64, f64) = if mode == Mode::Gate {
        (&[], 0.0, 0.0)
    } else if quick {
        (&[250, 1_000, 2_000], 1.0, 3.0)
    } else {
        (
            &[250, 500, 1_000, 2_000, 3_000, 4_000, 6_000, 8_000],
            2.0,
            5.0,
        )
    };
    let most = patterns
        .iter()
        .map(|p| p.0)
        .chain(sat_steps.iter().copied())
        .max()
        .unwrap_or(0);
    let t = Instant::now();
    let identities: Vec<Identity> = (0..most)
        .map(|i| {
            let node = node_name(i);
            ca.issue_node(&node, &[SERVICE.to_string()])
                .expect("node cert")
                .pem
                .identity(&node)
                .expect("identity")
        })
        .collect();
    eprintln!(
        "{most} client certificates issued in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let setup = Setup {
        dir: dir.clone(),
        aggregator,
        target: Target {
            server: SocketAddr::from(([127, 0, 0, 1], 0)),
            server_name: "127.0.0.1".into(),
            ca: Arc::new(ca_certs),
            identities: Arc::new(identities),
            services: Arc::new(vec![SERVICE.to_string()]),
            // The previous protocol, which the bare server answers as well.
            current: false,
        },
    };

    let mut rows: Vec<(usize, u32, Runs, Runs)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for (p, &(n, hz)) in patterns.iter().enumerate() {
        let mut runs = Vec::new();
        // Two rounds in opposite orders (a b b a, then b a a b), so that a machine that
        // gets busier or quieter during a pattern weighs on both servers alike.
        for round in 0..rounds {
            for kind in order(p + round) {
                runs.push(fixed(&setup, kind, n, hz, warm, secs).await);
            }
        }
        notes.extend(runs.iter().flat_map(|r| r.notes.iter().cloned()));
        let a = Runs::of(Kind::Bare, &runs).unwrap();
        let b = Runs::of(Kind::Aggregator, &runs).unwrap();
        rows.push((n, hz, a, b));
    }
    let mut saturating = Vec::new();
    for kind in order(patterns.len())
        .into_iter()
        .filter(|_| !sat_steps.is_empty())
    {
        let (steps, n) = saturate(&setup, kind, sat_hz, sat_steps, settle, step_secs).await;
        notes.extend(n);
        saturating.push((kind, steps));
    }
    saturating.sort_by_key(|(k, _)| *k == Kind::Aggregator);

    println!(
        "## Ingest against bare QUIC (loopback, mutual TLS, {rounds} × {secs:.0} s windows per server and pattern)\n"
    );
    println!(
        "| pattern | server | connections | offered /s | reports sent | reports counted \
         | replies | server CPU s | CPU-µs per report | each run | RSS MiB | machine busy, cores | (b)/(a) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (n, hz, a, b) in &rows {
        let label = pattern_name(*n, *hz);
        let ratio = b.window.us_per_report() / a.window.us_per_report();
        table_row(&label, *n, *hz, a, "");
        table_row(&label, *n, *hz, b, &format!("**{ratio:.2}**"));
    }
    // The saturating pattern: each server at the step where it counted the most.
    let peaks: Vec<(Kind, Step)> = saturating
        .iter()
        .filter_map(|(k, steps)| {
            steps
                .iter()
                .copied()
                .max_by(|x, y| {
                    x.window
                        .counted_per_s()
                        .total_cmp(&y.window.counted_per_s())
                })
                .map(|s| (*k, s))
        })
        .collect();
    // In the main table, both servers at the highest step both ran: the cost per
    // report falls as the load rises, so only equal loads compare.
    let common = saturating
        .iter()
        .map(|(_, steps)| steps.iter().map(|s| s.target).max().unwrap_or(0))
        .min()
        .unwrap_or(0);
    let at_common: Vec<(Kind, Step)> = saturating
        .iter()
        .filter_map(|(k, steps)| {
            let s = steps.iter().find(|s| s.target == common)?;
            Some((*k, *s))
        })
        .collect();
    if let [(ka, pa), (kb, pb)] = at_common.as_slice() {
        let ratio = pb.window.us_per_report() / pa.window.us_per_report();
        let label = format!(
            "saturating, highest step both ran ({})",
            pattern_name(common, sat_hz)
        );
        for (kind, p, ratio) in [(ka, pa, String::new()), (kb, pb, format!("**{ratio:.2}**"))] {
            let runs = Runs {
                kind: *kind,
                connected: p.connections,
                window: p.window,
                each: vec![p.window.us_per_report()],
            };
            table_row(&label, p.target, sat_hz, &runs, &ratio);
        }
    }
    println!();
    if mode == Mode::Gate {
        let passed = gate(&rows, &notes);
        drop(setup);
        drop(scratch);
        return passed;
    }
    println!(
        "### Saturating: {sat_hz} Hz per connection, more connections at each step ({step_secs:.0} s windows)\n"
    );
    println!(
        "| server | connections | offered /s | sent /s | counted /s | server cores \
         | CPU-µs per report | generator cores | machine busy, cores | server socket drops /s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (kind, steps) in &saturating {
        for s in steps {
            let w = &s.window;
            println!(
                "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.2} | {:.2} | {} |",
                kind.name(),
                thousands(s.connections as f64),
                thousands(f64::from(sat_hz) * s.connections as f64),
                thousands(w.sent / w.secs),
                thousands(w.counted_per_s()),
                w.server_cores(),
                w.us_per_report(),
                w.generator_cpu / w.secs,
                w.machine_cores(),
                thousands(w.server_drops / w.secs),
            );
        }
    }
    println!();
    for (kind, p) in &peaks {
        let w = &p.window;
        println!(
            "- {}: at most {} reports/s counted ({} connections), on {:.2} server cores \
             (the generator {:.2}, the whole machine {:.2} of {}): {} reports/s per server core",
            kind.name(),
            thousands(w.counted_per_s()),
            thousands(p.connections as f64),
            w.server_cores(),
            w.generator_cpu / w.secs,
            w.machine_cores(),
            std::thread::available_parallelism().map_or(0, usize::from),
            thousands(w.counted_per_s() / w.server_cores()),
        );
    }
    // Each note once, in the order it first came.
    let mut seen = std::collections::HashSet::new();
    notes.retain(|n| seen.insert(n.clone()));
    if !notes.is_empty() {
        println!();
        for n in &notes {
            println!("- {n}");
        }
    }
    println!();
    drop(setup);
    drop(scratch);
    true
}

/// The gate's verdict on the 2,000 × 1 Hz pattern: (b)/(a) at most [`GATE_BOUND`], with
/// every report the generator sent counted by both servers (a server that dropped
/// reports would look cheap per report).
fn gate(rows: &[(usize, u32, Runs, Runs)], notes: &[String]) -> bool {
    let Some((n, hz, a, b)) = rows.first() else {
        eprintln!("ingest gate: no pattern ran");
        return false;
    };
    let ratio = b.window.us_per_report() / a.window.us_per_report();
    let each = |r: &Runs| {
        r.each
            .iter()
            .map(|us| format!("{us:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let figures = format!(
        "{} at {}: the aggregator {:.1} CPU-µs per report (runs {}), bare quinn {:.1} (runs {})",
        thousands(*n as f64),
        format_args!("{hz} Hz"),
        b.window.us_per_report(),
        each(b),
        a.window.us_per_report(),
        each(a)
    );
    let mut failed = Vec::new();
    for r in [a, b] {
        let w = &r.window;
        if r.connected < n * 99 / 100 || w.counted < 0.97 * w.sent {
            failed.push(format!(
                "{}: {} of {} connections, {} of {} reports counted: the run did not carry the                  pattern, so its ratio says nothing",
                r.kind.name(),
                r.connected,
                n,
                thousands(w.counted),
                thousands(w.sent)
            ));
        }
    }
    if ratio > GATE_BOUND {
        failed.push(format!(
            "the release aggregator costs {ratio:.2}× bare quinn's CPU per report, above the              gate's bound of {GATE_BOUND:.2}×: a regression in the ingest path"
        ));
    }
    eprintln!("ingest gate: (b)/(a) = {ratio:.2} (bound {GATE_BOUND:.2}); {figures}");
    if failed.is_empty() {
        return true;
    }
    eprintln!("ingest gate FAILED: {}; {figures}", failed.join("; "));
    for n in notes {
        eprintln!("  note: {n}");
    }
    false
}
