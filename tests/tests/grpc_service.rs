//! Scenario: a CPU-bound gRPC service behind proxyless gRPC, measured by agents with
//! their shipped defaults.
//!
//! Four gRPC backends (`tests/grpc/cpu_service.py`, Python `grpcio`, one process each,
//! so each is bound to about one core by its interpreter lock) burn 2, 2, 4 and 6 ms of
//! CPU per call: the last is the slow node. Each keeps its true in-flight count (calls
//! inside the handler) and its CPU time in an mmap'd file. One real `ballast-agent`
//! per backend runs as the README's one line does, plus what a test on loopback needs:
//! `--inflight tcp:PORT` (connections owed a response, from `tcp_info`), `--cpu
//! pid:PID` (the backend is not alone on this host), `--address 127.0.0.1:PORT`, and no
//! `--capacity` (the count is judged against the fleet). A real aggregator serves the
//! weights over xDS (RING_HASH, its default), and a `grpcio` load generator calls
//! `xds:///grpcwork` over four channels at a fixed Poisson rate without waiting for
//! answers, so calls that overlap share a connection.
//!
//! The aggregator's start-up grace keeps every weight at 1 for the first seconds: that
//! is the round-robin baseline, measured in the same run. Then it balances, and the
//! test checks:
//!
//! 1. the agents' in-flight count follows the servers' true count: each report's count
//!    against the true count at the moment the agent sampled it (mean error and
//!    correlation);
//! 2. balancing converges: the slow node ends below both fast ones' weights, the CPU
//!    max/avg across the backends (their own CPU clocks) is clearly below the
//!    equal-weight one, and no weight sits at the floor or the ceiling;
//! 3. the aggregator trusts every endpoint's in-flight count throughout;
//! 4. then one fast backend stalls (each new call sleeps 250 ms instead of burning
//!    CPU: low CPU, piling-up calls) and its share of the calls started from 10 s
//!    after the stall, over 6 s, is measured: with the TCP count it is printed (the
//!    figure is in `docs/inflight.md`), not held to a bound.
//!
//! A second test runs the same service with the agents reading the backends'
//! go-grpc-prometheus counters (`--inflight grpc:URL#service=ballast.Cpu`, kept by
//! py-grpc-prometheus' interceptor and served by prometheus_client) instead, with a shorter balancing phase before the same stall,
//! and holds the stalled backend's share of new calls from 10 s after the stall to
//! 2 % or less, with the shipped defaults.
//!
//! The two take turns (one lock): run at once, each scenario's servers take CPU from
//! the other's, the calls wait inside the servers where no socket shows them, and the
//! TCP count's mean error measured −0.58 in a run of the suite (−0.36 to −0.83 beside
//! a busy loop), against −0.26 over fifteen runs alone.
//!
//! It prints a table of the figures. Needs the tests' Python with `grpcio` (`tests/.venv`, made by `bash tests/run`, or
//! `BALLAST_PYTHON`); the test fails, naming the package, when it is missing.

use ballast_tests::harness::grpc::{require_grpcio, write_bootstrap, Python};
use ballast_tests::harness::process::unix_request;
use ballast_tests::*;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SERVICE: &str = "grpcwork";
/// CPU per call of each backend, in milliseconds. The 6 ms node is the slow one.
const BURN_MS: [f64; 4] = [2.0, 2.0, 4.0, 6.0];
/// Wall time each call then waits, in milliseconds, as on a downstream call. It makes
/// the true in-flight count about one call per backend, so that the count has
/// something to follow and overlapping calls share a connection now and then; with
/// CPU alone it would be about 0.2.
const SLEEP_MS: f64 = 20.0;
/// Calls per second offered to the whole service. At equal weights the slow node then
/// runs at about 26 % of a core and the fast ones at about 12 % (gRPC adds about 1 ms
/// of CPU per call); balanced, each carries about 15 %, above the 0.1 average load that
/// feed-forward needs. Under three quarters of a core in all, on a 2-core machine
/// shared with the client, the agents and the aggregator.
const RATE: f64 = 160.0;
/// Channels of the load generator: each has its own connection to every backend.
const CHANNELS: u32 = 4;
/// The shipped cycle and report interval (1 s): a report then covers 20 to 55 calls
/// per backend, so the agent's CPU figure is not all arrival noise.
const CYCLE_MS: u64 = 1000;
/// Start-up grace: the weights stay equal until it ends, which gives the round-robin
/// baseline a few seconds of traffic once every agent reports and the client runs.
const GRACE_MS: u64 = 9000;
/// The equal-weight window starts this long after the client is ready (connections
/// warm) and must last at least `MIN_EQUAL_WINDOW`.
const EQUAL_SETTLE: Duration = Duration::from_secs(1);
const MIN_EQUAL_WINDOW: Duration = Duration::from_secs(2);
/// Balancing runs this long after the grace; the last `END_WINDOW` is the end state.
const BALANCE: Duration = Duration::from_secs(19);
const END_WINDOW: Duration = Duration::from_secs(9);
/// The endpoints API is polled this often (trust, weights).
const POLL_EVERY: Duration = Duration::from_millis(250);
/// How a report's true in-flight count is taken: the mean of the server's count over
/// this window around the agent's report stamp (ms). The agent samples CPU, then the
/// sockets, then stamps the report in whole milliseconds.
const TRUTH_BEFORE_MS: f64 = 3.0;
const TRUTH_AFTER_MS: f64 = 1.0;

// The bounds. Measured over 15 runs on this 2-core machine (debug build, grpcio
// 1.85.3, other builds running: load average 2 to 7), about 95 reports compared per
// run; mean, run-to-run standard deviation, worst run:
//
//   mean error (count - truth)   -0.26  0.06  -0.35   (the truth is about 1 per backend)
//   correlation                   0.67  0.09   0.48   (95 pairs of small integers)
//   CPU max/avg, equal weights    1.57  0.07   1.47
//   CPU max/avg, end              1.06  0.03   1.10   (keeps at most 0.17 of the excess)
//   weights at the end: slow 0.44-0.59, fast 1.21-1.44; none at a bound, none distrusted
//
// The count reads low, by a quarter: a connection carrying two calls counts one, and
// none from the moment either is answered until another call arrives on it.
// Each bound sits four standard deviations or more from the mean and beyond the worst
// run.

/// The largest |mean error| of the count, in calls.
const MAX_MEAN_ERROR: f64 = 0.55;
/// The smallest correlation of the count with the truth.
const MIN_CORRELATION: f64 = 0.3;
/// The end's CPU max/avg must have shed at least this share of the equal-weight
/// excess over 1 (the worst run kept 0.17 of it) ...
const MIN_EXCESS_SHED: f64 = 0.5;
/// ... and be at most this. Six seconds of Poisson arrivals put about ±0.06 on each
/// backend's CPU, and the aggregator's own max/avg swings from cycle to cycle within the
/// end window (1.02–1.55 in one run). Alone, 28 runs measured 1.016–1.10 (six-second
/// window). Runs of the whole suite measured 1.088, 1.203 and 1.258; the last had the
/// fleet's average jump inside the end window, so two cycles held their weights (the
/// settling rule) while the loads drifted apart, and it still shed 0.54 of the excess.
/// The window is therefore nine seconds, which dilutes such a hold, and the bound 1.28.
const MAX_END_MAX_OVER_AVG: f64 = 1.28;
/// The stalled backend: a fast one, which carries the most calls when it stalls.
const STALLED: usize = 0;
/// Once stalled, each of its calls sleeps this long instead of burning CPU and
/// waiting (the lab's stall): low CPU, piling-up calls.
const STALL_MS: u64 = 250;
/// Its share of the calls started is measured from this long after the stall ...
const STALL_REACTION: Duration = Duration::from_secs(10);
/// ... over this window ...
const STALL_WINDOW: Duration = Duration::from_secs(6);
/// ... and with the `grpc` preset must be at most this. Measured 0.8 % (seconds 5
/// to 16 after the stall: 0 to 3 % each); 2.7 % and 4.6 % before a stalled node
/// shed weight at the shrink bound and stopped growing back at once.
const MAX_STALLED_SHARE: f64 = 0.02;
/// With the preset, balancing before the stall runs this long, the last
/// `PRESET_END_WINDOW` its end state (the convergence is the TCP run's subject).
const PRESET_BALANCE: Duration = Duration::from_secs(10);
const PRESET_END_WINDOW: Duration = Duration::from_secs(5);
/// The preset's count against the truth, before the stall. Three runs measured a
/// mean error of -0.09 (the truth is about 1 per backend) and correlations of
/// 0.93–0.96; the bounds are loose, as the stall is this test's subject.
const PRESET_MAX_MEAN_ERROR: f64 = 0.3;
const PRESET_MIN_CORRELATION: f64 = 0.5;
/// A weight at or beyond these (relative to the mean, which is 1) sits at a bound.
const FLOOR: f64 = 0.011;
const CEILING: f64 = 9.9;

/// Where the agents read the in-flight count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `tcp:PORT`: connections owed a response, the default that needs nothing of the
    /// service.
    Tcp,
    /// `grpc:URL#service=ballast.Cpu`: the calls started less those handled, from the
    /// go-grpc-prometheus counters the backend exports (py-grpc-prometheus).
    GrpcPreset,
}

/// One backend: its process, port, pid, metrics port and state file.
struct Backend {
    name: String,
    burn_ms: f64,
    port: u16,
    pid: u32,
    metrics: Option<u16>,
    state: File,
    process: Python,
}

/// What a backend's state file says at one moment.
#[derive(Debug, Clone, Copy)]
struct Reading {
    inflight: u32,
    cpu_s: f64,
    answered: u64,
    started: u64,
}

impl Backend {
    fn read(&self) -> Reading {
        read_state(&self.state, &self.name)
    }
}

/// Reads a backend's state file (see `tests/grpc/cpu_service.py`).
fn read_state(state: &File, name: &str) -> Reading {
    let mut b = [0u8; 32];
    state
        .read_exact_at(&mut b, 0)
        .unwrap_or_else(|e| panic!("{name}: read state file: {e}"));
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    Reading {
        inflight: u32_at(0),
        cpu_s: f64::from_bits(u64_at(8)),
        answered: u64_at(16),
        started: u64_at(24),
    }
}

/// Starts the backends, all at once (each imports grpcio, which takes a second); with
/// `metrics`, each exports go-grpc-prometheus counters.
fn start_backends(dir: &Path, metrics: bool) -> Vec<Backend> {
    let mut procs: Vec<(String, f64, PathBuf, Python)> = BURN_MS
        .iter()
        .enumerate()
        .map(|(i, &burn)| {
            let name = format!("{SERVICE}-{i}");
            let state = dir.join(format!("{name}.state"));
            let state_arg = state.display().to_string();
            let (burn_arg, sleep_arg) = (burn.to_string(), SLEEP_MS.to_string());
            let mut args = vec![
                "serve",
                "--state",
                &state_arg,
                "--name",
                &name,
                "--burn-ms",
                &burn_arg,
                "--sleep-ms",
                &sleep_arg,
            ];
            if metrics {
                args.push("--metrics");
            }
            // Python::spawn runs scripts of tests/xds/; this one is a gRPC peer.
            let process = Python::spawn("../grpc/cpu_service.py", &name, &args, &[], dir);
            (name, burn, state, process)
        })
        .collect();
    procs
        .drain(..)
        .map(|(name, burn_ms, state, mut process)| {
            let line = process.line(Duration::from_secs(30));
            let words: Vec<&str> = line.split_whitespace().collect();
            let (port, pid, metrics_port) = match words.as_slice() {
                ["port", port, "pid", pid] if !metrics => {
                    (port.parse().ok(), pid.parse().ok(), None)
                }
                ["port", port, "pid", pid, "metrics", m] if metrics => {
                    (port.parse().ok(), pid.parse().ok(), m.parse().ok())
                }
                _ => (None, None, None),
            };
            let (Some(port), Some(pid)) = (port, pid) else {
                panic!(
                    "{name} said {line:?}, not \"port N pid P\" (with \" metrics M\": {metrics})"
                );
            };
            assert!(
                metrics == metrics_port.is_some(),
                "{name} said {line:?}: no metrics port"
            );
            let state = File::open(&state)
                .unwrap_or_else(|e| panic!("{name}: open {}: {e}", state.display()));
            Backend {
                name,
                burn_ms,
                port,
                pid,
                metrics: metrics_port,
                state,
                process,
            }
        })
        .collect()
}

/// Milliseconds since the Unix epoch, with the fraction: the agents stamp reports in
/// whole milliseconds, and the truth is read every millisecond or so.
fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// One agent report: which backend, when the agent stamped it, what it counted.
#[derive(Debug, Clone, Copy)]
struct Report {
    backend: usize,
    at_ms: f64,
    inflight: u32,
    cpu: f64,
}

/// What the stall phase measured.
struct Stall {
    /// When it began, in the agents' clock (Unix ms).
    at_ms: f64,
    /// The stalled backend's share of the calls started in the end window, and from
    /// [`STALL_REACTION`] after the stall for [`STALL_WINDOW`].
    share_before: f64,
    share: f64,
    /// Its share in each second from the stall on.
    per_second: Vec<String>,
    /// The endpoints API during the stall.
    polls: Vec<Poll>,
}

/// One poll of the endpoints API.
#[derive(Debug, Clone)]
struct Poll {
    at: Instant,
    weight: Vec<f64>,
    trusted: Vec<bool>,
    estimate: Vec<serde_json::Value>,
    /// The reported CPU and the load the aggregator steered by.
    cpu: Vec<f64>,
    load: Vec<f64>,
}

/// Pearson correlation of two series; NaN if either is constant.
fn correlation(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let mx = xs.iter().sum::<f64>() / n;
    let my = ys.iter().sum::<f64>() / n;
    let cov: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let vx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let vy: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    if vx > 0.0 && vy > 0.0 {
        cov / (vx * vy).sqrt()
    } else {
        f64::NAN
    }
}

/// max/avg of a set of values.
fn max_over_avg(v: &[f64]) -> f64 {
    let avg = v.iter().sum::<f64>() / v.len() as f64;
    v.iter().cloned().fold(0.0, f64::max) / avg
}

/// What the backends did between two sets of readings.
struct Window {
    /// CPU utilization of each, relative to one core.
    cpu: Vec<f64>,
    /// Each one's share of the calls answered.
    share: Vec<f64>,
    /// Each one's share of the calls started.
    started_share: Vec<f64>,
    /// How long the window lasted.
    secs: f64,
}

/// The window between two sets of readings taken `secs` apart.
fn window(a: &[Reading], b: &[Reading], secs: f64) -> Window {
    let cpu: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(a, b)| (b.cpu_s - a.cpu_s) / secs)
        .collect();
    let calls: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(a, b)| (b.answered - a.answered) as f64)
        .collect();
    let total: f64 = calls.iter().sum();
    let share = calls.iter().map(|c| c / total.max(1.0)).collect();
    let started: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(a, b)| (b.started - a.started) as f64)
        .collect();
    let total: f64 = started.iter().sum();
    let started_share = started.iter().map(|c| c / total.max(1.0)).collect();
    Window {
        cpu,
        share,
        started_share,
        secs,
    }
}

/// Clears the flag the sampler threads run by when dropped, so that a failing
/// assertion does not leave the scope waiting for them.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

fn sleep_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
}

fn endpoints_poll(agg: &Aggregator, backends: &[Backend]) -> Result<Poll, String> {
    let eps: serde_json::Value = agg.try_get_json(&format!("/v1/services/{SERVICE}/endpoints"))?;
    let list = eps.as_array().ok_or_else(|| format!("not a list: {eps}"))?;
    let mut poll = Poll {
        at: Instant::now(),
        weight: vec![f64::NAN; backends.len()],
        trusted: vec![true; backends.len()],
        estimate: vec![serde_json::Value::Null; backends.len()],
        cpu: vec![f64::NAN; backends.len()],
        load: vec![f64::NAN; backends.len()],
    };
    for (i, b) in backends.iter().enumerate() {
        let e = list
            .iter()
            .find(|e| e["node"] == b.name.as_str())
            .ok_or_else(|| format!("{} is not an endpoint: {eps}", b.name))?;
        poll.weight[i] = e["weight"]
            .as_f64()
            .ok_or_else(|| format!("{}: no weight: {e}", b.name))?;
        poll.trusted[i] = e["inflight_estimate"]["trusted"]
            .as_bool()
            .ok_or_else(|| format!("{}: no inflight_estimate.trusted: {e}", b.name))?;
        poll.estimate[i] = e["inflight_estimate"].clone();
        poll.cpu[i] = e["cpu"].as_f64().unwrap_or(f64::NAN);
        poll.load[i] = e["load"].as_f64().unwrap_or(f64::NAN);
    }
    Ok(poll)
}

/// What one run of the scenario measured, for the test's assertions.
struct Outcome {
    table: String,
    /// The load generator's summary.
    summary: serde_json::Value,
    /// Reports compared with the truth (before the stall), mean error, correlation.
    compared: usize,
    mean_error: f64,
    corr: f64,
    /// CPU max/avg at equal weights and at the end of balancing.
    eq_mo: f64,
    end_mo: f64,
    /// Mean weights over the end window, and polls at a bound there per backend.
    end_weight: Vec<f64>,
    pinned: Vec<usize>,
    /// Endpoints distrusted before the stall, and after it.
    distrusted: Vec<String>,
    distrusted_in_stall: Vec<String>,
    /// The stalled backend's share of the calls started before the stall (the end
    /// window) and over the stall's measured window.
    stalled_share_before: f64,
    stalled_share: f64,
    nacks: f64,
}

/// Runs the scenario with the agents' in-flight count from `source`: equal weights
/// for the grace, balancing for `balance` (the last `end_window` of it is the end
/// state), then backend [`STALLED`] stalls for [`STALL_REACTION`] and
/// [`STALL_WINDOW`].
fn scenario(source: Source, balance: Duration, end_window: Duration) -> Outcome {
    require_grpcio();
    let test_start = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("ballast-grpcsvc-")
        .tempdir()
        .expect("temporary directory");
    let mut backends = start_backends(dir.path(), source == Source::GrpcPreset);
    let names: Vec<&str> = backends.iter().map(|b| b.name.as_str()).collect();

    let pki = Pki::new();
    pki.issue_nodes(&names);
    // The grace is counted from the aggregator's own start, which is after this.
    let grace_end = Instant::now() + Duration::from_millis(GRACE_MS);
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            xds: true,
            ..AggregatorOpts::default()
                .cycle_ms(CYCLE_MS)
                .report_interval_ms(CYCLE_MS as u32)
                .grace_ms(GRACE_MS)
        },
    );
    let agents: Vec<Agent> = backends
        .iter()
        .map(|b| {
            let mut opts = AgentOpts::new(SERVICE, &b.name);
            opts.inflight = Some(match (source, b.metrics) {
                (Source::Tcp, _) => format!("tcp:{}", b.port),
                (Source::GrpcPreset, Some(m)) => {
                    format!("grpc:http://127.0.0.1:{m}/metrics#service=ballast.Cpu")
                }
                (Source::GrpcPreset, None) => panic!("{} exports no metrics", b.name),
            });
            opts.cpu = format!("pid:{}", b.pid);
            opts.address = Some(format!("127.0.0.1:{}", b.port));
            // No --capacity: the shipped default, judged against the fleet.
            opts.default_capacity = true;
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    wait_for(Duration::from_secs(15), "every agent to report", || {
        let eps =
            agg.try_get_json::<serde_json::Value>(&format!("/v1/services/{SERVICE}/endpoints"))?;
        let reported = eps
            .as_array()
            .map(|l| l.iter().filter(|e| !e["report_age_ms"].is_null()).count())
            .unwrap_or(0);
        if reported == backends.len() {
            Ok(())
        } else {
            Err(format!("{reported} reported: {eps}"))
        }
    });

    // The load runs until the end of the stall's window, and a little beyond so that
    // the last window is under full load.
    let load_secs = grace_end
        .saturating_duration_since(Instant::now())
        .as_secs_f64()
        + (balance + STALL_REACTION + STALL_WINDOW).as_secs_f64()
        + 1.0;
    let bootstrap = write_bootstrap(&agg.xds(), "grpcwork-load", None, dir.path());
    let target = format!("xds:///{SERVICE}");
    let mut client = Python::spawn(
        "../grpc/cpu_service.py",
        "load",
        &[
            "load",
            "--target",
            &target,
            "--rate",
            &RATE.to_string(),
            "--channels",
            &CHANNELS.to_string(),
            "--duration",
            &format!("{load_secs:.1}"),
        ],
        &[("GRPC_XDS_BOOTSTRAP", &bootstrap)],
        dir.path(),
    );
    let ready = client.line(Duration::from_secs(30));
    assert_eq!(ready, "ready", "the load generator said {ready:?}");
    let load_start = Instant::now();

    let running = AtomicBool::new(true);
    let truth: Mutex<Vec<(f64, Vec<u32>)>> = Mutex::new(Vec::new());
    let reports: Mutex<Vec<Report>> = Mutex::new(Vec::new());
    let controls: Vec<PathBuf> = agents
        .iter()
        .map(|a| a.control_path().to_path_buf())
        .collect();
    // Every loop below is bounded by the phase deadlines, and the samplers by a count.
    let max_samples = ((load_secs + 10.0) * 2000.0) as usize;
    let states: Vec<(File, String)> = backends
        .iter()
        .map(|b| {
            let f = b.state.try_clone().expect("clone the state file's handle");
            (f, b.name.clone())
        })
        .collect();
    let (equal, end, polls, window_from, window_from_ms, stall) = std::thread::scope(|s| {
        // The samplers stop when this scope's work ends, failed or not.
        let _stop = StopOnDrop(&running);
        // The true in-flight count of every backend, about every millisecond.
        s.spawn(|| {
            let mut n = 0;
            while running.load(Ordering::Relaxed) && n < max_samples {
                let at = now_ms();
                let counts = states
                    .iter()
                    .map(|(f, name)| read_state(f, name).inflight)
                    .collect();
                truth.lock().expect("truth").push((at, counts));
                n += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        // Every report the agents send, from their control sockets (one report a
        // second each; polled ten times as often so that none is missed).
        s.spawn(|| {
            let mut last = vec![0u64; controls.len()];
            let mut n = 0;
            while running.load(Ordering::Relaxed) && n < max_samples {
                for (i, path) in controls.iter().enumerate() {
                    let Ok(line) = unix_request(path, "{\"cmd\":\"status\"}\n", 1 << 20, "agent")
                    else {
                        continue;
                    };
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                        continue;
                    };
                    let st = &v["status"];
                    let (Some(at), Some(count), Some(cpu)) = (
                        st["last_report_unix_ms"].as_u64(),
                        st["last_inflight"].as_u64(),
                        st["last_cpu"].as_f64(),
                    ) else {
                        continue;
                    };
                    if at != last[i] {
                        last[i] = at;
                        reports.lock().expect("reports").push(Report {
                            backend: i,
                            at_ms: at as f64,
                            inflight: u32::try_from(count).unwrap_or(u32::MAX),
                            cpu,
                        });
                    }
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
        });

        // Equal weights: from a second after the client is ready to the end of the
        // grace.
        let equal_from = load_start + EQUAL_SETTLE;
        assert!(
            grace_end.saturating_duration_since(equal_from) >= MIN_EQUAL_WINDOW,
            "setup took {:?}: less than {MIN_EQUAL_WINDOW:?} of equal-weight traffic \
             before the grace ends; raise GRACE_MS",
            test_start.elapsed()
        );
        sleep_until(equal_from);
        let r0: Vec<Reading> = backends.iter().map(Backend::read).collect();
        let t0 = Instant::now();
        sleep_until(grace_end);
        // Checked before the readings that close the window: no weight had moved yet
        // (and a new one takes a push and a call to show).
        let detail = agg.service(SERVICE);
        let r1: Vec<Reading> = backends.iter().map(Backend::read).collect();
        let equal_secs = t0.elapsed().as_secs_f64();
        assert_eq!(
            detail.stats.updates, 0,
            "a cycle updated the weights inside the equal-weight window: {:?}",
            detail.history
        );

        // Balancing: poll the endpoints until the end, reading the last window.
        let end_at = grace_end + balance;
        let window_from = end_at - end_window;
        let mut polls: Vec<Poll> = Vec::new();
        let mut end_start: Option<(Vec<Reading>, Instant, f64)> = None;
        while Instant::now() < end_at && polls.len() < 1000 {
            if end_start.is_none() && Instant::now() >= window_from {
                let readings = backends.iter().map(Backend::read).collect();
                end_start = Some((readings, Instant::now(), now_ms()));
            }
            match endpoints_poll(&agg, &backends) {
                Ok(p) => polls.push(p),
                Err(e) => eprintln!("endpoints poll: {e}"),
            }
            std::thread::sleep(POLL_EVERY);
        }
        let r3: Vec<Reading> = backends.iter().map(Backend::read).collect();
        let (r2, t2, t2_ms) = end_start.expect("the end window was reached");
        let end = window(&r2, &r3, t2.elapsed().as_secs_f64());
        // The stall: one backend's calls sleep instead of burning CPU. Its share of the
        // calls started is read every poll, the endpoints polled as before.
        let stalled = &mut backends[STALLED];
        stalled.process.send(&format!("stall {STALL_MS}"));
        let ack = stalled.process.line(Duration::from_secs(5));
        assert_eq!(ack, "ok", "{} said {ack:?} to the stall", stalled.name);
        let stall_at = Instant::now();
        let stall_ms = now_ms();
        let stall_end = stall_at + STALL_REACTION + STALL_WINDOW;
        let mut stall_reads: Vec<(Instant, Vec<Reading>)> =
            vec![(stall_at, backends.iter().map(Backend::read).collect())];
        let mut stall_polls: Vec<Poll> = Vec::new();
        while Instant::now() < stall_end && stall_reads.len() < 1000 {
            std::thread::sleep(POLL_EVERY);
            stall_reads.push((Instant::now(), backends.iter().map(Backend::read).collect()));
            match endpoints_poll(&agg, &backends) {
                Ok(p) => stall_polls.push(p),
                Err(e) => eprintln!("endpoints poll: {e}"),
            }
        }
        // The calls each backend started in [from, to) seconds after the stall, from the
        // readings nearest those times.
        let started_between = |from: f64, to: f64| -> Vec<f64> {
            let at = |t: f64| {
                let k = stall_reads
                    .partition_point(|(i, _)| (*i - stall_at).as_secs_f64() < t)
                    .min(stall_reads.len() - 1);
                &stall_reads[k].1
            };
            let (a, b) = (at(from), at(to));
            a.iter()
                .zip(b)
                .map(|(a, b)| (b.started - a.started) as f64)
                .collect()
        };
        let share_of = |calls: &[f64]| calls[STALLED] / calls.iter().sum::<f64>().max(1.0);
        let reaction = STALL_REACTION.as_secs_f64();
        let stalled_share = share_of(&started_between(
            reaction,
            reaction + STALL_WINDOW.as_secs_f64(),
        ));
        let stalled_share_before = end.started_share[STALLED];
        let per_second: Vec<String> = (0..(STALL_REACTION + STALL_WINDOW).as_secs())
            .map(|k| {
                format!(
                    "{:.3}",
                    share_of(&started_between(k as f64, k as f64 + 1.0))
                )
            })
            .collect();
        (
            window(&r0, &r1, equal_secs),
            end,
            polls,
            t2,
            t2_ms,
            Stall {
                at_ms: stall_ms,
                share_before: stalled_share_before,
                share: stalled_share,
                per_second,
                polls: stall_polls,
            },
        )
    });

    let summary = client.line(Duration::from_secs(30));
    let summary: serde_json::Value = serde_json::from_str(&summary)
        .unwrap_or_else(|e| panic!("the load generator said {summary:?}: {e}"));
    let truth = truth.into_inner().expect("truth");
    let reports = reports.into_inner().expect("reports");

    // --- (a) the count against the truth -------------------------------------------
    let mut counts = Vec::new();
    let mut truths = Vec::new();
    let mut per_backend = vec![(0usize, 0.0f64, 0.0f64); backends.len()];
    for r in reports.iter().filter(|r| r.at_ms < stall.at_ms) {
        let lo = truth.partition_point(|(t, _)| *t < r.at_ms - TRUTH_BEFORE_MS);
        let hi = truth.partition_point(|(t, _)| *t < r.at_ms + TRUTH_AFTER_MS);
        if hi <= lo {
            continue;
        }
        let t = truth[lo..hi]
            .iter()
            .map(|(_, c)| f64::from(c[r.backend]))
            .sum::<f64>()
            / (hi - lo) as f64;
        counts.push(f64::from(r.inflight));
        truths.push(t);
        let pb = &mut per_backend[r.backend];
        pb.0 += 1;
        pb.1 += f64::from(r.inflight);
        pb.2 += t;
    }
    let n = counts.len() as f64;
    let mean_error = counts.iter().zip(&truths).map(|(c, t)| c - t).sum::<f64>() / n;
    let mean_abs_error = counts
        .iter()
        .zip(&truths)
        .map(|(c, t)| (c - t).abs())
        .sum::<f64>()
        / n;
    let corr = correlation(&counts, &truths);
    let time_avg_truth: Vec<f64> = (0..backends.len())
        .map(|i| {
            let before: Vec<f64> = truth
                .iter()
                .filter(|(t, _)| *t < stall.at_ms)
                .map(|(_, c)| f64::from(c[i]))
                .collect();
            before.iter().sum::<f64>() / before.len().max(1) as f64
        })
        .collect();
    let agent_cpu_end: Vec<f64> = (0..backends.len())
        .map(|i| {
            let rs: Vec<f64> = reports
                .iter()
                .filter(|r| r.backend == i && r.at_ms >= window_from_ms && r.at_ms < stall.at_ms)
                .map(|r| r.cpu)
                .collect();
            rs.iter().sum::<f64>() / rs.len().max(1) as f64
        })
        .collect();

    // --- (b) the weights at the end --------------------------------------------------
    let end_polls: Vec<&Poll> = polls.iter().filter(|p| p.at >= window_from).collect();
    let end_weight: Vec<f64> = (0..backends.len())
        .map(|i| end_polls.iter().map(|p| p.weight[i]).sum::<f64>() / end_polls.len().max(1) as f64)
        .collect();
    let pinned: Vec<usize> = (0..backends.len())
        .map(|i| {
            end_polls
                .iter()
                .filter(|p| p.weight[i] <= FLOOR || p.weight[i] >= CEILING)
                .count()
        })
        .collect();
    let distrusted_in = |polls: &[Poll]| -> Vec<String> {
        polls
            .iter()
            .flat_map(|p| {
                (0..backends.len())
                    .filter(|&i| !p.trusted[i])
                    .map(|i| {
                        format!(
                            "{} at +{:?}: {}",
                            backends[i].name,
                            p.at - load_start,
                            p.estimate[i]
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let distrusted = distrusted_in(&polls);
    let distrusted_in_stall = distrusted_in(&stall.polls);

    // How far the fleet-relative judgment came from letting a count bind (it binds
    // above a ratio of 3), for the record: nothing is stalled before the stall.
    let max_ratio: Vec<f64> = (0..backends.len())
        .map(|i| {
            polls
                .iter()
                .filter_map(|p| p.estimate[i]["ratio"].as_f64())
                .fold(0.0, f64::max)
        })
        .collect();
    let binding: Vec<usize> = (0..backends.len())
        .map(|i| {
            polls
                .iter()
                .filter(|p| p.estimate[i]["binding"].as_bool() == Some(true))
                .count()
        })
        .collect();

    // --- the table ------------------------------------------------------------------
    let eq_mo = max_over_avg(&equal.cpu);
    let end_mo = max_over_avg(&end.cpu);
    let last = polls.last().expect("the endpoints were polled");
    let detail = agg.service(SERVICE);
    let sum_count: f64 = counts.iter().sum();
    let sum_truth: f64 = truths.iter().sum();
    let mut table = format!(
        "{RATE} calls/s over {CHANNELS} channels, calls burn {BURN_MS:?} ms of CPU and wait \
         {SLEEP_MS} ms, cycle {CYCLE_MS} ms; equal-weight window {:.1} s, end window {:.1} s\n\
         client: {summary}\n\
         in-flight, {} reports against the truth: mean error {mean_error:+.3}, \
         mean |error| {mean_abs_error:.3}, correlation {corr:.3}, count/truth {:.2}\n\n",
        equal.secs,
        end.secs,
        counts.len(),
        sum_count / sum_truth.max(f64::MIN_POSITIVE),
    );
    table.push_str(
        "| backend | CPU ms per call | true in-flight (mean) | true at reports | count at reports \
         | aggregator's smoothed count, ratio (last; max) | CPU at equal weights | calls at equal weights \
         | CPU at the end | agent's CPU at the end | calls at the end | weight at the end |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, b) in backends.iter().enumerate() {
        let (k, c, t) = per_backend[i];
        let k = k.max(1) as f64;
        let est = &last.estimate[i];
        table.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2}, {:.2}; {:.2} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} |\n",
            b.name,
            b.burn_ms,
            time_avg_truth[i],
            t / k,
            c / k,
            est["smoothed"].as_f64().unwrap_or(f64::NAN),
            est["ratio"].as_f64().unwrap_or(f64::NAN),
            max_ratio[i],
            equal.cpu[i],
            equal.share[i],
            end.cpu[i],
            agent_cpu_end[i],
            end.share[i],
            end_weight[i],
        ));
    }
    table.push_str(&format!(
        "\nCPU max/avg: equal weights {eq_mo:.3}, end {end_mo:.3}\n\
         aggregator's max/avg by cycle (reported loads): {}\n\
         skipped cycles: {:?}\n\
         polls at a bound in the end window (of {}): {pinned:?}; distrusted polls: {}; \
         polls with the in-flight term binding (of {}): {binding:?}\n",
        detail.recent_max_over_avg(12),
        detail.stats.skipped,
        end_polls.len(),
        distrusted.len(),
        polls.len(),
    ));
    // The stall, second by second: the stalled backend's share of the calls started,
    // of the weight, and the aggregator's view of its count.
    let by_second = |f: &dyn Fn(&Poll) -> String| -> String {
        (1..=(STALL_REACTION + STALL_WINDOW).as_secs())
            .filter_map(|k| {
                stall
                    .polls
                    .iter()
                    .find(|p| p.at >= stall.polls[0].at + Duration::from_secs(k) - POLL_EVERY)
                    .map(f)
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    table.push_str(&format!(
        "\nstall of {} ({STALL_MS} ms per call, from {:.0} s after the grace): share of the calls \
         started {:.4} before (end window), {:.4} from {:.0} s to {:.0} s after\n\
         share of the calls started, second by second: {}\n\
         share of the weight, second by second: {}\n\
         smoothed count / ratio / binding, second by second: {}\n\
         reported CPU / load against the mean load, second by second: {}\n\
         distrusted polls during the stall: {}\n",
        backends[STALLED].name,
        balance.as_secs_f64(),
        stall.share_before,
        stall.share,
        STALL_REACTION.as_secs_f64(),
        (STALL_REACTION + STALL_WINDOW).as_secs_f64(),
        stall.per_second.join(" "),
        by_second(&|p| format!("{:.3}", p.weight[STALLED] / p.weight.iter().sum::<f64>())),
        by_second(&|p| {
            let e = &p.estimate[STALLED];
            format!(
                "{:.1}/{:.1}/{}",
                e["smoothed"].as_f64().unwrap_or(f64::NAN),
                e["ratio"].as_f64().unwrap_or(f64::NAN),
                if e["binding"].as_bool() == Some(true) {
                    "b"
                } else {
                    "-"
                }
            )
        }),
        by_second(&|p| {
            let mean = p.load.iter().sum::<f64>() / p.load.len() as f64;
            format!("{:.3}/{:.3}/{mean:.3}", p.cpu[STALLED], p.load[STALLED])
        }),
        distrusted_in_stall.len(),
    ));
    eprintln!("{table}");
    let nacks = agg.counter("ballast_xds_nacks_total", &[]);
    drop(client);
    drop(agents);
    Outcome {
        table,
        summary,
        compared: counts.len(),
        mean_error,
        corr,
        eq_mo,
        end_mo,
        end_weight,
        pinned,
        distrusted,
        distrusted_in_stall,
        stalled_share_before: stall.share_before,
        stalled_share: stall.share,
        nacks,
    }
}

/// The assertions both sources are held to: no call failed, enough reports were
/// compared, the client accepted every resource, and every count was trusted before
/// the stall.
fn assert_common(o: &Outcome) {
    let table = &o.table;
    let errors = o.summary["errors"].as_object().map_or(0, |m| m.len());
    assert_eq!(errors, 0, "calls failed:\n{table}");
    assert!(
        o.compared >= 40,
        "too few reports compared with the truth ({}):\n{table}",
        o.compared
    );
    assert!(
        o.distrusted.is_empty(),
        "the in-flight count was distrusted:\n{}\n{table}",
        o.distrusted.join("\n")
    );
    assert_eq!(o.nacks, 0.0, "the client rejected resources:\n{table}");
}

#[test]
fn a_cpu_bound_grpc_service_behind_proxyless_grpc_converges_with_shipped_agent_defaults() {
    let _turn = one_at_a_time();
    let o = scenario(Source::Tcp, BALANCE, END_WINDOW);
    let table = &o.table;
    assert_common(&o);
    let (mean_error, corr) = (o.mean_error, o.corr);
    // (a)
    assert!(
        mean_error.abs() <= MAX_MEAN_ERROR,
        "the count's mean error {mean_error:+.3} exceeds {MAX_MEAN_ERROR}:\n{table}"
    );
    assert!(
        corr >= MIN_CORRELATION,
        "the count's correlation with the truth {corr:.3} is below {MIN_CORRELATION}:\n{table}"
    );
    // (b)
    let (end_weight, eq_mo, end_mo) = (&o.end_weight, o.eq_mo, o.end_mo);
    let slow = BURN_MS.len() - 1;
    for i in 0..2 {
        assert!(
            end_weight[slow] < end_weight[i],
            "the slow backend's weight {:.3} is not below fast {i}'s {:.3}:\n{table}",
            end_weight[slow],
            end_weight[i]
        );
    }
    assert!(
        end_mo - 1.0 <= (1.0 - MIN_EXCESS_SHED) * (eq_mo - 1.0) && end_mo <= MAX_END_MAX_OVER_AVG,
        "CPU max/avg at the end {end_mo:.3}: not clearly below equal weights' {eq_mo:.3} \
         (at most {MAX_END_MAX_OVER_AVG}, and at least {MIN_EXCESS_SHED} of the excess shed):\n{table}"
    );
    let cycles_polled = (CYCLE_MS as f64 / POLL_EVERY.as_millis() as f64).round() as usize;
    assert!(
        o.pinned.iter().all(|&p| p <= 2 * cycles_polled),
        "a weight sat at a bound for more than two cycles at the end: {:?}:\n{table}",
        o.pinned
    );
    // (d) The stall, with the TCP count: what its share falls to is measured, not
    // held to the target (docs/inflight.md).
    eprintln!(
        "TCP count: the stalled backend's share {:.4} from {:.0} s after the stall ({:.4} before)",
        o.stalled_share,
        STALL_REACTION.as_secs_f64(),
        o.stalled_share_before
    );
}

#[test]
fn a_stalled_grpc_backend_loses_its_calls_with_the_grpc_preset() {
    let _turn = one_at_a_time();
    let o = scenario(Source::GrpcPreset, PRESET_BALANCE, PRESET_END_WINDOW);
    let table = &o.table;
    assert_common(&o);
    assert!(
        o.mean_error.abs() <= PRESET_MAX_MEAN_ERROR,
        "the preset's mean error {:+.3} exceeds {PRESET_MAX_MEAN_ERROR}:\n{table}",
        o.mean_error
    );
    assert!(
        o.corr >= PRESET_MIN_CORRELATION,
        "the preset's correlation with the truth {:.3} is below {PRESET_MIN_CORRELATION}:\n{table}",
        o.corr
    );
    assert!(
        o.stalled_share <= MAX_STALLED_SHARE,
        "the stalled backend's share of new calls {:.4} from {:.0} s after the stall is above \
         {MAX_STALLED_SHARE} ({:.4} before):\n{table}",
        o.stalled_share,
        STALL_REACTION.as_secs_f64(),
        o.stalled_share_before
    );
    assert!(
        o.distrusted_in_stall.is_empty(),
        "the stalled backend's count was distrusted: it follows the weight:\n{}\n{table}",
        o.distrusted_in_stall.join("\n")
    );
}
