//! The physical lab: CPU-bound HTTP backends in cgroups with different CPU quotas,
//! behind a real HAProxy, balanced by real agents and a real aggregator, under an
//! open-loop load. One call, [`run`], does everything and returns what was measured;
//! `tests/tests/lab.rs` runs a short [`Plan`] and asserts the direction of every
//! result, `tests/benches/lab.rs` runs the full one and writes `docs/lab.md`.
//!
//! The runs, on the same processes one after the other:
//! 1. round robin: HAProxy's agent-check off, equal static weights;
//! 2. Ballast: an aggregator and one agent per backend (cgroup CPU, in-flight
//!    connections) start, HAProxy's agent-check goes on, and the weights converge;
//! 3. degraded: part way through, one backend's handler stalls on a sleep instead of
//!    burning CPU — low CPU, piling-up requests;
//! 4. restart: one backend is drained, stopped, started again and undrained, under
//!    load.
//!
//! Every process is a harness [`Proc`] (killed on drop, and by the kernel if the lab's
//! thread dies) and the cgroups are a [`Cgroups`] guard declared first, so dropped
//! last: a failing run leaves nothing behind.

pub mod cgroup;
pub mod report;
pub mod sampler;

use crate::harness::agent::{Agent, AgentOpts};
use crate::harness::aggregator::{Aggregator, AggregatorOpts};
use crate::harness::haproxy::{Haproxy, HaproxyOpts, OP_RUNNING};
use crate::harness::pki::Pki;
use crate::harness::ports::free_tcp;
use crate::harness::process::{command, Proc};
use crate::harness::wait::wait_for;
use ballast_agent::sample::cgroup::CgroupCpu;
use ballast_agent::sample::prometheus::parse_gauge;
use ballast_agent::sample::CpuSource;
use ballast_aggregator::balance::stats::Spread;
use ballast_lab::backend::INFLIGHT_METRIC;
use ballast_lab::load::{self, summarize, LoadRun, LoadSpec, Mode, Summary};
use cgroup::{Cgroups, Group, Layout};
use sampler::Sample;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The backend binary.
pub const BACKEND_BIN: &str = "ballast-lab-backend";
/// The service the agents report for.
const SERVICE: &str = "lab";
/// HAProxy's backend section.
const HAPROXY_BACKEND: &str = "be";
/// A request not answered within this counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Open-loop requests outstanding at most.
const MAX_OUTSTANDING: usize = 4096;
/// The window of the convergence check and of the windowed max/avg.
const WINDOW_S: f64 = 5.0;
/// Run 2 has converged once a window's max/avg is at most this.
const CONVERGED: f64 = 1.10;

/// What the lab runs, and for how long.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `full` or `short`.
    pub name: &'static str,
    /// Each backend's CPU quota, in cores.
    pub quotas: Vec<f64>,
    /// CPU per request, ms (turned into hash rounds on this machine).
    pub work_ms: f64,
    /// The agents' `--capacity`: in-flight requests that count as fully loaded.
    pub capacity: u32,
    /// Closed-loop calibration length.
    pub calibrate: Duration,
    /// Offered load as a share of the calibrated capacity.
    pub utilization: f64,
    /// Run 1 length, and when its steady state starts.
    pub rr: (Duration, Duration),
    /// Run 2 length, and when its steady state starts.
    pub ballast: (Duration, Duration),
    /// Run 3 length, when the stall starts, and how long the controller gets to react
    /// before the degraded phase is measured.
    pub degraded: (Duration, Duration, Duration),
    /// The stall of the degraded backend's handler, ms.
    pub stall_ms: u64,
    /// Run 4 length, when the drain starts, and how long the backend stays down.
    pub restart: (Duration, Duration, Duration),
    /// The aggregator's cycle.
    pub cycle_ms: u64,
    /// The agents' report interval.
    pub report_interval_ms: u32,
    /// HAProxy's agent-check interval.
    pub agent_inter_ms: u64,
    /// The lab's sampling interval.
    pub sample_every: Duration,
}

fn s(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

impl Plan {
    /// The full lab, for `docs/lab.md`: about five minutes.
    pub fn full() -> Plan {
        Plan {
            name: "full",
            quotas: vec![0.10, 0.10, 0.15, 0.15, 0.20, 0.30],
            work_ms: 2.0,
            capacity: 10,
            calibrate: s(6),
            utilization: 0.6,
            rr: (s(60), s(15)),
            ballast: (s(90), s(30)),
            degraded: (s(60), s(20), s(10)),
            stall_ms: 250,
            restart: (s(60), s(15), s(5)),
            cycle_ms: 1000,
            report_interval_ms: 500,
            agent_inter_ms: 500,
            sample_every: s(1),
        }
    }

    /// The short lab of the test suite: the same runs in about a minute and a half.
    pub fn short() -> Plan {
        Plan {
            name: "short",
            calibrate: s(3),
            rr: (s(14), s(4)),
            ballast: (s(26), s(14)),
            degraded: (s(18), s(6), s(5)),
            restart: (s(18), s(4), s(2)),
            cycle_ms: 500,
            ..Plan::full()
        }
    }
}

/// What calibration found.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// Hash rounds per request.
    pub rounds: u64,
    /// Requests per second each backend sustained when saturated (closed loop).
    pub saturated: Vec<f64>,
    /// CPU per request each backend used at the plan's utilization (open loop at that
    /// share of its saturated rate), ms, from its cgroup's accounting.
    pub cpu_ms: Vec<f64>,
    /// Requests per second each backend can take at that cost: its quota over it.
    pub capacity: Vec<f64>,
    /// The fleet's capacity, requests per second.
    pub total: f64,
    /// The open-loop rate of every run: the plan's utilization of `total`.
    pub offered: f64,
}

/// Finds the fleet's capacity, every backend at once and straight to it (no HAProxy):
/// first closed loop, so that each runs at its quota and what it serves per second is
/// its saturated rate; then open loop at the plan's utilization of that rate, which
/// gives the CPU a request costs at that load. A backend that is not saturated costs
/// more per request than one that is (it wakes up for each request instead of finding
/// the next one waiting), so the capacity the runs are offered a share of is the quota
/// over that cost: the offered load then is the planned utilization, not more.
fn calibrate(backends: &[Backend], plan: &Plan, rounds: u64) -> Calibration {
    let secs = plan.calibrate.as_secs_f64();
    let phase = |mode: &dyn Fn(usize) -> Mode| -> (Vec<f64>, Vec<f64>) {
        let mut cpus: Vec<CgroupCpu> = backends
            .iter()
            .map(|b| CgroupCpu::open(&b.group.spec).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        for c in &mut cpus {
            let _ = c.sample();
        }
        let handles: Vec<_> = backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                load::spawn(LoadSpec {
                    target: b.addr,
                    path: "/work".into(),
                    mode: mode(i),
                    duration: plan.calibrate,
                    max_requests: 1_000_000,
                    timeout: REQUEST_TIMEOUT,
                    max_outstanding: MAX_OUTSTANDING,
                })
                .expect("calibration load")
            })
            .collect();
        let served: Vec<f64> = handles
            .into_iter()
            .zip(backends)
            .map(|(h, b)| {
                let s = summarize(&h.join().expect("calibration run").outcomes);
                assert_eq!(
                    s.errors, 0,
                    "{} calibration: {:?}",
                    b.name, s.errors_by_kind
                );
                s.ok as f64 / secs
            })
            .collect();
        let util = cpus
            .iter_mut()
            .map(|c| c.sample().ok().flatten().unwrap_or(0.0))
            .collect();
        (served, util)
    };
    let (saturated, _) = phase(&|_| Mode::Closed { concurrency: 3 });
    let (served, util) = phase(&|i| Mode::Open {
        rate: (saturated[i] * plan.utilization).max(1.0),
    });
    let cpu_ms: Vec<f64> = (0..backends.len())
        .map(|i| util[i] * plan.quotas[i] * 1000.0 / served[i].max(1e-9))
        .collect();
    let capacity: Vec<f64> = cpu_ms
        .iter()
        .zip(&plan.quotas)
        .map(|(ms, q)| q * 1000.0 / ms.max(1e-9))
        .collect();
    let total: f64 = capacity.iter().sum();
    Calibration {
        rounds,
        saturated,
        cpu_ms,
        capacity,
        total,
        offered: total * plan.utilization,
    }
}

/// One run's figures.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Short name (`rr`, `ballast`, `degraded`, `restart`).
    pub name: &'static str,
    /// For people.
    pub title: &'static str,
    /// Lab seconds at which the load started and ended.
    pub start: f64,
    /// See `start`.
    pub end: f64,
    /// The measured window, in seconds from the run's start.
    pub window: (f64, f64),
    /// Each backend's mean utilization in the window.
    pub util: Vec<f64>,
    /// Their spread.
    pub spread: Spread,
    /// The median over the window's 5 s windows of max/avg: what short-term noise
    /// adds to the steady figure.
    pub windowed_max_over_avg: f64,
    /// Latency and errors of the requests due in the window.
    pub load: Summary,
    /// Latency and errors of the whole run.
    pub whole: Summary,
    /// Cores busy on the host outside the backends, on average over the run.
    pub other_cores: Option<f64>,
}

/// What the degraded run showed about the stalled backend.
#[derive(Debug, Clone)]
pub struct Degraded {
    /// Which backend.
    pub backend: usize,
    /// Run seconds at which it stalled.
    pub at: f64,
    /// Its share of the requests before the stall, and after the reaction time.
    pub share: (f64, f64),
    /// Its mean in-flight before, and after the reaction time.
    pub inflight_mean: (f64, f64),
    /// Its highest in-flight at any sample after the stall.
    pub inflight_max: u32,
    /// Its highest in-flight after the reaction time.
    pub inflight_max_late: u32,
    /// In flight it would hold with the share it had before (Little's law): what
    /// steering by CPU alone, which sees it idle, would give it at least.
    pub flood_at_old_share: f64,
    /// Its mean CPU utilization after the reaction time.
    pub cpu_late: f64,
}

/// What the restart run showed.
#[derive(Debug, Clone)]
pub struct Restart {
    /// Which backend.
    pub backend: usize,
    /// Run seconds of: drain asked, HAProxy in DRAIN, stopped, started again, undrained.
    pub marks: [f64; 5],
    /// Requests it answered after the undrain.
    pub served_after: u64,
    /// Requests it answered between the drain taking effect and the undrain.
    pub served_while_drained: u64,
}

/// Everything the lab measured.
#[derive(Debug, Clone)]
pub struct LabResult {
    /// The plan it ran.
    pub plan: Plan,
    /// Which cgroup interface it used.
    pub layout: String,
    /// Backend names, in order.
    pub names: Vec<String>,
    /// Calibration.
    pub calibration: Calibration,
    /// The four runs.
    pub runs: Vec<RunResult>,
    /// Run 2: seconds from agent-check on to the first 5 s window at max/avg ≤ 1.10.
    pub converged_after: Option<f64>,
    /// Run 3.
    pub degraded: Degraded,
    /// Run 4.
    pub restart: Restart,
    /// Every sample, on the lab's clock.
    pub samples: Vec<Sample>,
    /// Host cores and load average when the lab started.
    pub host: String,
    /// How long the whole lab took, seconds.
    pub seconds: f64,
}

impl LabResult {
    /// The run named `name`.
    pub fn run(&self, name: &str) -> &RunResult {
        self.runs
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no run {name}"))
    }
}

/// One backend process and its cgroup.
struct Backend {
    name: String,
    addr: SocketAddr,
    agent_check: SocketAddr,
    group: Group,
    proc: Option<Proc>,
}

/// The CPU time this thread has used: what calibrating the work must count, since the
/// thread may be preempted by anything else on the machine.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Hash rounds that take `work_ms` of CPU. The lab and the backend binary are built
/// with the same profile, so the same rounds cost the same in both.
fn rounds_for(work_ms: f64) -> u64 {
    const PROBE: u64 = 20_000;
    let best = (0..5)
        .map(|i| {
            let t0 = thread_cpu();
            std::hint::black_box(ballast_lab::work::burn(PROBE, i));
            (thread_cpu() - t0).as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
        .max(1e-9);
    ((work_ms / 1000.0) / best * PROBE as f64).round().max(1.0) as u64
}

/// Starts `b` in its cgroup and waits until it answers. `Err` holds the end of its log
/// when it exited during the start (e.g. its port was taken meanwhile).
fn spawn_backend(
    b: &mut Backend,
    rounds: u64,
    cgroups: &Cgroups,
    logs: &Path,
    http: &Http,
) -> Result<(), String> {
    let mut cmd = command(BACKEND_BIN);
    cmd.args(["--listen", &b.addr.to_string()])
        .args(["--name", &b.name])
        .args(["--rounds", &rounds.to_string()]);
    let proc = Proc::spawn(cmd, &b.name, &logs.join(format!("{}.log", b.name)), 20);
    cgroups
        .attach(&b.group, proc.pid())
        .unwrap_or_else(|e| panic!("{}: {e}", b.name));
    b.proc = Some(proc);
    let url = format!("http://{}/healthz", b.addr);
    let proc = b.proc.as_mut().expect("just spawned");
    wait_for(
        Duration::from_secs(15),
        &format!("{} to answer", b.name),
        || {
            if let Some(st) = proc.exit_status() {
                return Ok(Err(format!(
                    "{} exited at start ({st}):\n{}",
                    b.name,
                    proc.log_tail(20)
                )));
            }
            http.get(&url).map(|_| Ok(()))
        },
    )
}

/// A small blocking HTTP client for the backends' admin and health endpoints.
struct Http(reqwest::blocking::Client);

impl Http {
    fn new() -> Http {
        Http(
            reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("HTTP client"),
        )
    }

    fn get(&self, url: &str) -> Result<String, String> {
        Self::body(url, self.0.get(url).send())
    }

    fn post(&self, url: &str) -> Result<String, String> {
        Self::body(url, self.0.post(url).send())
    }

    /// The body of a successful answer, or why there is none.
    fn body(
        url: &str,
        sent: reqwest::Result<reqwest::blocking::Response>,
    ) -> Result<String, String> {
        let resp = sent.map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: {}", resp.status()));
        }
        resp.text().map_err(|e| format!("{url}: {e}"))
    }
}

/// Sets a flag when dropped, so the sampler stops even when a run panics (the scope
/// would otherwise wait for it forever).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn open_loop(target: SocketAddr, rate: f64, duration: Duration) -> load::LoadHandle {
    load::spawn(LoadSpec {
        target,
        path: "/work".into(),
        mode: Mode::Open { rate },
        duration,
        max_requests: (rate * duration.as_secs_f64()).ceil() as u64 + 1,
        timeout: REQUEST_TIMEOUT,
        max_outstanding: MAX_OUTSTANDING,
    })
    .expect("start the load generator")
}

fn hap_all(hap: &Haproxy, names: &[String], cmd: &str) {
    for n in names {
        let out = hap.command(&format!("{cmd} {HAPROXY_BACKEND}/{n}"));
        assert!(
            out.trim().is_empty(),
            "HAProxy `{cmd} {HAPROXY_BACKEND}/{n}`: {out}"
        );
    }
}

fn host_line() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!(
        "{} cores, load average {} at the start",
        ballast_agent::sample::cgroup::online_cpus(),
        load.join(" ")
    )
}

/// Runs the whole lab by `plan`. Panics, naming what failed, if any step does; every
/// process and cgroup it made is gone when it returns or unwinds.
pub fn run(plan: &Plan) -> LabResult {
    crate::harness::haproxy::require_haproxy();
    let host = host_line();
    let started = Instant::now();
    let layout = Layout::detect(Path::new(cgroup::ROOT)).unwrap_or_else(|e| panic!("{e}"));
    // Declared first, dropped last: every process below is gone before the cgroups go.
    let mut cgroups = Cgroups::create(layout.clone()).unwrap_or_else(|e| panic!("{e}"));
    let infra = cgroups.add("infra", None).unwrap_or_else(|e| panic!("{e}"));
    let logs = tempfile::Builder::new()
        .prefix("ballast-lab-")
        .tempdir()
        .expect("log directory");
    let http = Http::new();
    let rounds = rounds_for(plan.work_ms);
    eprintln!(
        "lab ({}): cgroup {}, {rounds} hash rounds = {} ms of CPU per request",
        plan.name,
        layout.name(),
        plan.work_ms
    );

    let mut backends: Vec<Backend> = Vec::new();
    for (i, q) in plan.quotas.iter().enumerate() {
        let name = format!("web-{}", i + 1);
        let group = cgroups
            .add(&name, Some(*q))
            .unwrap_or_else(|e| panic!("{e}"));
        backends.push(Backend {
            name,
            addr: SocketAddr::from(([127, 0, 0, 1], free_tcp())),
            agent_check: SocketAddr::from(([127, 0, 0, 1], free_tcp())),
            group,
            proc: None,
        });
    }
    for b in &mut backends {
        // A port picked free can be taken before the backend binds it: then another.
        let mut attempts = 0;
        while let Err(e) = spawn_backend(b, rounds, &cgroups, logs.path(), &http) {
            attempts += 1;
            assert!(e.contains("cannot bind") && attempts < 5, "{e}");
            b.addr = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
        }
    }
    let names: Vec<String> = backends.iter().map(|b| b.name.clone()).collect();
    let servers: Vec<(&str, SocketAddr, SocketAddr)> = backends
        .iter()
        .map(|b| (b.name.as_str(), b.addr, b.agent_check))
        .collect();
    let hap = Haproxy::start(
        0,
        &servers,
        &HaproxyOpts {
            agent_inter_ms: plan.agent_inter_ms,
            // One server connection per request: the agents count established
            // connections on the backend's port as its in-flight requests, and
            // HAProxy's idle pooled connections would count as busy.
            backend_lines: vec!["option http-server-close".into()],
            ..HaproxyOpts::default()
        },
    );
    // Run 1 is plain round robin: no agent may move a weight.
    hap_all(&hap, &names, "disable agent");
    let hap_pid: u32 = hap
        .command("show info")
        .lines()
        .find_map(|l| l.strip_prefix("Pid: "))
        .and_then(|p| p.trim().parse().ok())
        .expect("HAProxy's pid in `show info`");
    cgroups
        .attach(&infra, hap_pid)
        .unwrap_or_else(|e| panic!("{e}"));

    let targets: Vec<sampler::Target> = backends
        .iter()
        .map(|b| sampler::Target {
            name: b.name.clone(),
            addr: b.addr,
            cgroup: b.group.spec.clone(),
        })
        .collect();
    let epoch = Instant::now();
    let stop = AtomicBool::new(false);
    let admin = hap.admin_socket().to_path_buf();
    let pki = Pki::new();

    let raw = std::thread::scope(|scope| {
        let sampler =
            scope.spawn(|| sampler::run(&targets, admin.clone(), plan.sample_every, epoch, &stop));
        let guard = StopOnDrop(&stop);
        let now = || epoch.elapsed().as_secs_f64();

        let calibration = calibrate(&backends, plan, rounds);
        let rate = calibration.offered;
        eprintln!(
            "calibration: {:.0} req/s when saturated, {:.0} at the planned load's cost; \
             offering {rate:.0} req/s",
            calibration.saturated.iter().sum::<f64>(),
            calibration.total
        );
        let frontend = hap.frontend();
        let mut runs = Vec::new();

        // Run 1: round robin.
        let h = open_loop(frontend, rate, plan.rr.0);
        let start = since(epoch, h.started());
        runs.push((start, h.join().expect("run 1")));
        eprintln!("run 1 (round robin) done at {:.0} s", now());

        // Run 2: Ballast from equal weights. The agents and the aggregator start now,
        // so that nothing they learnt under round robin carries over.
        let agg = Aggregator::start(
            &pki,
            AggregatorOpts::default()
                .cycle_ms(plan.cycle_ms)
                .report_interval_ms(plan.report_interval_ms),
        );
        pki.issue_nodes(&names.iter().map(String::as_str).collect::<Vec<_>>());
        let agents: Vec<Agent> = backends
            .iter()
            .map(|b| {
                let mut o = AgentOpts::new(SERVICE, &b.name).agent_check(b.agent_check);
                o.cpu = format!("cgroup:{}", b.group.spec);
                o.inflight = Some(format!("tcp:{}", b.addr.port()));
                o.capacity = plan.capacity;
                o.interval_ms = plan.report_interval_ms;
                o.address = Some(b.addr.to_string());
                Agent::start(&pki, &agg, o)
            })
            .collect();
        for a in &agents {
            a.wait_weight(Duration::from_secs(20));
        }
        hap_all(&hap, &names, "enable agent");
        let h = open_loop(frontend, rate, plan.ballast.0);
        let start = since(epoch, h.started());
        runs.push((start, h.join().expect("run 2")));
        eprintln!("run 2 (Ballast) done at {:.0} s", now());

        // Run 3: the largest backend stalls part way through.
        let k = plan
            .quotas
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        let stall_url = |ms: u64| format!("http://{}/admin/stall?ms={ms}", backends[k].addr);
        let h = open_loop(frontend, rate, plan.degraded.0);
        let start = since(epoch, h.started());
        sleep_until(h.started() + plan.degraded.1);
        http.post(&stall_url(plan.stall_ms))
            .unwrap_or_else(|e| panic!("stall {}: {e}", names[k]));
        let stalled_at = now() - start;
        let run3 = h.join().expect("run 3");
        http.post(&stall_url(0))
            .unwrap_or_else(|e| panic!("unstall {}: {e}", names[k]));
        runs.push((start, run3));
        eprintln!("run 3 (degraded) done at {:.0} s", now());

        // Run 4: drain, stop, start again, undrain — a second-smallest backend.
        let j = plan
            .quotas
            .iter()
            .position(|q| *q > plan.quotas.iter().copied().fold(f64::INFINITY, f64::min))
            .unwrap_or(0);
        let name = &names[j];
        let h = open_loop(frontend, rate, plan.restart.0);
        let start = since(epoch, h.started());
        let mut marks = [0.0; 5];
        sleep_until(h.started() + plan.restart.1);
        marks[0] = now() - start;
        agents[j].drain();
        wait_for(
            Duration::from_secs(15),
            "HAProxy to drain the server",
            || match hap.show_servers_state().get(name) {
                Some(s) if s.draining() => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
        marks[1] = now() - start;
        // Stop only once nothing is in flight there: the point of draining.
        let metrics = format!("http://{}/metrics", backends[j].addr);
        wait_for(
            Duration::from_secs(20),
            "the drained backend to finish its requests",
            || {
                let text = http.get(&metrics)?;
                match parse_gauge(&text, INFLIGHT_METRIC) {
                    Ok(v) if v < 0.5 => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        );
        let (status, killed) = backends[j]
            .proc
            .take()
            .expect("the backend runs")
            .terminate(Duration::from_secs(5));
        assert!(!killed, "{name} did not stop on SIGTERM ({status})");
        marks[2] = now() - start;
        std::thread::sleep(plan.restart.2);
        spawn_backend(&mut backends[j], rounds, &cgroups, logs.path(), &http)
            .unwrap_or_else(|e| panic!("restarting {name}: {e}"));
        wait_for(
            Duration::from_secs(15),
            "HAProxy to see the restarted backend up",
            || match hap.show_servers_state().get(name) {
                Some(s) if s.op_state == OP_RUNNING => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
        marks[3] = now() - start;
        agents[j].undrain();
        marks[4] = now() - start;
        runs.push((start, h.join().expect("run 4")));
        eprintln!("run 4 (restart) done at {:.0} s", now());

        // One more sample, so that the last run's tail is measured.
        std::thread::sleep(plan.sample_every + Duration::from_millis(100));
        drop(guard);
        let samples = sampler.join().expect("sampler thread");
        drop(agents);
        drop(agg);
        Raw {
            calibration,
            runs,
            stalled: (k, stalled_at),
            restart: (j, marks),
            samples,
        }
    });
    drop(hap);
    let result = analyse(plan, layout.name(), names, raw, host, started);
    eprintln!("lab ({}) took {:.0} s", plan.name, result.seconds);
    result
}

/// What the runs produced, before analysis.
struct Raw {
    calibration: Calibration,
    /// Each run's start (lab seconds) and requests.
    runs: Vec<(f64, LoadRun)>,
    /// The stalled backend and when, in run 3's seconds.
    stalled: (usize, f64),
    /// The restarted backend and run 4's marks.
    restart: (usize, [f64; 5]),
    samples: Vec<Sample>,
}

fn since(epoch: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(epoch).as_secs_f64()
}

fn sleep_until(t: Instant) {
    std::thread::sleep(t.saturating_duration_since(Instant::now()));
}

fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// The share of the successful requests due in `(from, to)` that `name` answered.
fn share(run: &LoadRun, name: &str, from: f64, to: f64) -> f64 {
    let s = summarize(run.window(from, to));
    s.by_backend.get(name).copied().unwrap_or(0) as f64 / (s.ok.max(1)) as f64
}

fn analyse(
    plan: &Plan,
    layout: &str,
    names: Vec<String>,
    raw: Raw,
    host: String,
    started: Instant,
) -> LabResult {
    let n = names.len();
    let samples = raw.samples;
    let calibration = raw.calibration;
    let rate = calibration.offered;

    let specs: [(&'static str, &'static str, Duration, Duration); 4] = [
        ("rr", "1. round robin", plan.rr.0, plan.rr.1),
        ("ballast", "2. Ballast", plan.ballast.0, plan.ballast.1),
        (
            "degraded",
            "3. degraded backend",
            plan.degraded.0,
            Duration::ZERO,
        ),
        (
            "restart",
            "4. stop and restart",
            plan.restart.0,
            Duration::ZERO,
        ),
    ];
    let spread_over = |start: f64, from: f64, to: f64| -> (Vec<f64>, Spread) {
        let util = sampler::mean_util(&samples, n, start + from, start + to);
        let spread = Spread::of(&util);
        (util, spread)
    };
    let mut runs = Vec::new();
    for ((name, title, len, settle), (start, load)) in specs.into_iter().zip(&raw.runs) {
        let (w0, w1) = (settle.as_secs_f64(), len.as_secs_f64());
        let (util, spread) = spread_over(*start, w0, w1);
        let mut windows: Vec<f64> = Vec::new();
        let mut t = w0 + WINDOW_S;
        while t <= w1 + 1e-9 {
            windows.push(spread_over(*start, t - WINDOW_S, t).1.max_over_avg);
            t += WINDOW_S;
        }
        windows.sort_by(f64::total_cmp);
        let backends_cores: f64 = sampler::mean_util(&samples, n, *start, start + w1)
            .iter()
            .zip(&plan.quotas)
            .map(|(u, q)| u * q)
            .sum();
        runs.push(RunResult {
            name,
            title,
            start: *start,
            end: start + w1,
            window: (w0, w1),
            util,
            spread,
            windowed_max_over_avg: windows.get(windows.len() / 2).copied().unwrap_or(0.0),
            load: summarize(load.window(w0, w1)),
            whole: summarize(&load.outcomes),
            other_cores: sampler::host_cores(&samples, *start, start + w1)
                .map(|h| (h - backends_cores).max(0.0)),
        });
    }

    // Run 2: from agent-check on to the first 5 s window within the band.
    let (start2, _) = &raw.runs[1];
    let mut converged_after = None;
    let mut t = WINDOW_S;
    while t <= plan.ballast.0.as_secs_f64() {
        if spread_over(*start2, t - WINDOW_S, t).1.max_over_avg <= CONVERGED {
            converged_after = Some(t);
            break;
        }
        t += plan.sample_every.as_secs_f64();
    }

    let (k, at) = raw.stalled;
    let (start3, run3) = &raw.runs[2];
    let late = at + plan.degraded.2.as_secs_f64();
    let end3 = plan.degraded.0.as_secs_f64();
    let before = sampler::inflight(&samples, k, *start3, start3 + at);
    let after = sampler::inflight(&samples, k, start3 + at, start3 + end3);
    let after_late = sampler::inflight(&samples, k, start3 + late, start3 + end3);
    let share_before = share(run3, &names[k], 0.0, at);
    let degraded = Degraded {
        backend: k,
        at,
        share: (share_before, share(run3, &names[k], late, end3)),
        inflight_mean: (
            mean(before.iter().map(|&v| f64::from(v))),
            mean(after_late.iter().map(|&v| f64::from(v))),
        ),
        inflight_max: after.iter().copied().max().unwrap_or(0),
        inflight_max_late: after_late.iter().copied().max().unwrap_or(0),
        flood_at_old_share: share_before * rate * plan.stall_ms as f64 / 1000.0,
        cpu_late: sampler::mean_util(&samples, n, start3 + late, start3 + end3)[k],
    };

    let (j, marks) = raw.restart;
    let (_, run4) = &raw.runs[3];
    let served = |from: f64, to: f64| {
        run4.window(from, to)
            .filter(|o| o.failure.is_none() && o.backend.as_deref() == Some(names[j].as_str()))
            .count() as u64
    };
    let restart = Restart {
        backend: j,
        marks,
        served_after: served(marks[4], f64::INFINITY),
        served_while_drained: served(marks[1], marks[4]),
    };

    LabResult {
        plan: plan.clone(),
        layout: layout.to_string(),
        names,
        calibration,
        runs,
        converged_after,
        degraded,
        restart,
        samples,
        host,
        seconds: started.elapsed().as_secs_f64(),
    }
}
