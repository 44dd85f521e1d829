//! The lab's own measurements, taken independently of the agents: each backend's CPU
//! from its cgroup's accounting, its in-flight requests from its own gauge, HAProxy's
//! weight for it from the runtime API, and how busy the whole host is.

use crate::harness::haproxy::{admin_command, parse_servers_state};
use ballast_agent::sample::cgroup::CgroupCpu;
use ballast_agent::sample::host::HostCpu;
use ballast_agent::sample::prometheus::parse_gauge;
use ballast_agent::sample::CpuSource;
use ballast_lab::backend::INFLIGHT_METRIC;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What is sampled for one backend.
#[derive(Debug, Clone)]
pub struct Target {
    /// Its server name in HAProxy.
    pub name: String,
    /// Where it serves (its `/metrics` too).
    pub addr: SocketAddr,
    /// Its cgroup, relative to the hierarchies.
    pub cgroup: String,
}

/// One sample of every backend.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Seconds since the lab's epoch, at the end of the interval.
    pub t: f64,
    /// Length of the interval the utilizations cover, seconds.
    pub dt: f64,
    /// CPU used over the interval relative to the quota, by backend.
    pub util: Vec<Option<f64>>,
    /// In-flight requests at the sample, from the backend's gauge (`None`: down).
    pub inflight: Vec<Option<u32>>,
    /// HAProxy's effective weight (0 when drained or down).
    pub weight: Vec<Option<u32>>,
    /// Cores busy on the whole host over the interval.
    pub host_cores: Option<f64>,
}

/// Samples every `every` until `stop` is set; returns the samples.
pub fn run(
    targets: &[Target],
    admin: PathBuf,
    every: Duration,
    epoch: Instant,
    stop: &AtomicBool,
) -> Vec<Sample> {
    let mut cpus: Vec<CgroupCpu> = targets
        .iter()
        .map(|t| {
            CgroupCpu::open(&t.cgroup)
                .unwrap_or_else(|e| panic!("sampler: cgroup {} of {}: {e}", t.cgroup, t.name))
        })
        .collect();
    let online = ballast_agent::sample::cgroup::online_cpus();
    let mut host = HostCpu::open().ok();
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .no_proxy()
        .build()
        .expect("HTTP client");
    // The first reading is only a baseline.
    for c in &mut cpus {
        let _ = c.sample();
    }
    if let Some(h) = host.as_mut() {
        let _ = h.sample();
    }
    let mut samples = Vec::new();
    let mut last = epoch.elapsed().as_secs_f64();
    while !stop.load(Ordering::Relaxed) {
        let next = Instant::now() + every;
        let util: Vec<Option<f64>> = cpus.iter_mut().map(|c| c.sample().ok().flatten()).collect();
        let host_cores = host
            .as_mut()
            .and_then(|h| h.sample().ok().flatten())
            .map(|f| f * online);
        let t = epoch.elapsed().as_secs_f64();
        let inflight = targets
            .iter()
            .map(|tg| {
                let text = http
                    .get(format!("http://{}/metrics", tg.addr))
                    .send()
                    .ok()?
                    .text()
                    .ok()?;
                parse_gauge(&text, INFLIGHT_METRIC).ok().map(|v| v as u32)
            })
            .collect();
        let states = admin_command(&admin, "show servers state")
            .ok()
            .and_then(|t| parse_servers_state(&t).ok());
        let weight = targets
            .iter()
            .map(|tg| {
                states
                    .as_ref()
                    .and_then(|s| s.get(&tg.name))
                    .map(|s| s.effective_weight())
            })
            .collect();
        samples.push(Sample {
            t,
            dt: t - last,
            util,
            inflight,
            weight,
            host_cores,
        });
        last = t;
        // Sleep to the next tick in short steps, so a stop is seen quickly.
        while Instant::now() < next && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20).min(next - Instant::now()));
        }
    }
    samples
}

/// Each backend's mean utilization over `(from, to]` (lab seconds), weighting every
/// sample by the interval it covers, so the mean is CPU used over CPU allowed.
pub fn mean_util(samples: &[Sample], n: usize, from: f64, to: f64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let (used, time) = samples
                .iter()
                .filter(|s| s.t > from && s.t <= to)
                .filter_map(|s| s.util[i].map(|u| (u * s.dt, s.dt)))
                .fold((0.0, 0.0), |(a, b), (u, d)| (a + u, b + d));
            if time > 0.0 {
                used / time
            } else {
                0.0
            }
        })
        .collect()
}

/// Backend `i`'s in-flight samples within `(from, to]`.
pub fn inflight(samples: &[Sample], i: usize, from: f64, to: f64) -> Vec<u32> {
    samples
        .iter()
        .filter(|s| s.t > from && s.t <= to)
        .filter_map(|s| s.inflight[i])
        .collect()
}

/// Mean host cores busy within `(from, to]`.
pub fn host_cores(samples: &[Sample], from: f64, to: f64) -> Option<f64> {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.t > from && s.t <= to)
        .filter_map(|s| s.host_cores)
        .collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}
