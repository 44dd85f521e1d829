//! The lab's own measurements, taken independently of the agents: each backend's CPU
//! from its cgroup's accounting (and its service's child cgroup's, to check the agent's
//! reading against), its in-flight requests and open connections from its
//! own gauges, HAProxy's weight for it and its server connections (in use and idle in
//! the pool) from the runtime API, and how busy the whole host is. Beside them, for the
//! diagnosis, what the aggregator holds for each endpoint once there is one: the load,
//! CPU and in-flight count the agent reported and the weight it was given.

use super::cgroup::Group;
use crate::harness::haproxy::{admin_command, parse_servers_state};
use ballast_agent::sample::cgroup::CgroupCpu;
use ballast_agent::sample::host::HostCpu;
use ballast_agent::sample::prometheus::parse_gauge;
use ballast_agent::sample::CpuSource;
use ballast_aggregator::api::views::EndpointView;
use ballast_balance::inflight::InflightEstimate;
use ballast_lab::backend::{CONNECTIONS_PEAK_METRIC, INFLIGHT_METRIC, INFLIGHT_PEAK_METRIC};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
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
    /// The child of that cgroup the service runs in, whose agent reads it.
    pub service: Group,
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
    /// Cores the service's own cgroup used over the interval, by backend, read from
    /// its accounting file.
    pub service_cores: Vec<Option<f64>>,
    /// In-flight requests at the sample, from the backend's gauge (`None`: down).
    pub inflight: Vec<Option<u32>>,
    /// The highest in-flight count since the previous sample, from the backend.
    pub inflight_peak: Vec<Option<u32>>,
    /// The most TCP connections the backend had open at once since the previous
    /// sample (the sampler's own included).
    pub conns_peak: Vec<Option<u32>>,
    /// HAProxy's connections to the server: in use and idle in its pool.
    pub hap_conns: Vec<Option<ServerConns>>,
    /// HAProxy's effective weight (0 when drained or down).
    pub weight: Vec<Option<u32>>,
    /// What the aggregator holds for the endpoint, once it runs.
    pub reported: Vec<Option<Reported>>,
    /// Cores busy on the whole host over the interval.
    pub host_cores: Option<f64>,
}

/// A server's connections in HAProxy (`show servers conn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConns {
    /// Carrying a request now (`used_cur`).
    pub used: u32,
    /// Idle in the pool, ready for reuse (`idle_cur`).
    pub idle: u32,
}

/// One endpoint as the aggregator's API shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reported {
    /// The load it steers by.
    pub load: f64,
    /// The CPU the agent reported.
    pub cpu: f64,
    /// The in-flight count the agent reported.
    pub inflight: u32,
    /// The weight it published, mean 1.
    pub weight: f64,
    /// What the aggregator made of the in-flight count.
    pub estimate: Option<InflightEstimate>,
}

/// Parses `show servers conn BACKEND`: a `#` header naming the columns, then a row per
/// server named `backend/server`. Columns are matched by name; the per-thread counts
/// at the end need not be.
pub fn parse_servers_conn(text: &str) -> Result<BTreeMap<String, ServerConns>, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let header: Vec<&str> = lines
        .next()
        .and_then(|h| h.strip_prefix('#'))
        .ok_or_else(|| format!("no header line: {text:?}"))?
        .split_whitespace()
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("no column {name} in {header:?}"))
    };
    let (used, idle) = (col("used_cur")?, col("idle_cur")?);
    let mut out = BTreeMap::new();
    for line in lines {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<u32, String> {
            f.get(i)
                .ok_or_else(|| format!("short row {line:?}"))?
                .parse()
                .map_err(|e| format!("{line:?}: {e}"))
        };
        let name = f
            .first()
            .and_then(|n| n.split_once('/'))
            .map(|(_, s)| s.to_string())
            .ok_or_else(|| format!("no backend/server in {line:?}"))?;
        out.insert(
            name,
            ServerConns {
                used: num(used)?,
                idle: num(idle)?,
            },
        );
    }
    Ok(out)
}

/// The endpoints of `GET /v1/services/{service}/endpoints`, by node, read into the
/// API's own type.
fn parse_endpoints(text: &str) -> Option<BTreeMap<String, Reported>> {
    let views: Vec<EndpointView> = serde_json::from_str(text).ok()?;
    Some(
        views
            .into_iter()
            .map(|e| {
                (
                    e.node,
                    Reported {
                        load: e.load,
                        cpu: e.cpu,
                        inflight: e.inflight,
                        weight: e.weight,
                        estimate: Some(e.inflight_estimate),
                    },
                )
            })
            .collect(),
    )
}

/// Where the sampler finds what it reads besides the backends.
pub struct Sources<'a> {
    /// HAProxy's runtime API socket.
    pub admin: PathBuf,
    /// HAProxy's backend section.
    pub backend: &'a str,
    /// The aggregator's `GET .../endpoints` URL, once there is an aggregator.
    pub endpoints: &'a Mutex<Option<String>>,
}

/// Samples every `every` until `stop` is set; returns the samples.
pub fn run(
    targets: &[Target],
    sources: &Sources<'_>,
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
    // No idle connection kept: a backend's connection count is then HAProxy's, plus
    // the one request reading it.
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .expect("HTTP client");
    let mut service_usage: Vec<Option<u64>> =
        targets.iter().map(|t| t.service.usage_ns()).collect();
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
        let service_cores = targets
            .iter()
            .zip(service_usage.iter_mut())
            .map(|(tg, before)| {
                // A reading that fails leaves no baseline: the next one is only that.
                let now = tg.service.usage_ns();
                let prev = std::mem::replace(before, now);
                let used = now?.checked_sub(prev?)?;
                (t > last).then(|| used as f64 / 1e9 / (t - last))
            })
            .collect();
        let metrics: Vec<Option<String>> = targets
            .iter()
            .map(|tg| {
                http.get(format!("http://{}/metrics", tg.addr))
                    .send()
                    .ok()?
                    .text()
                    .ok()
            })
            .collect();
        let gauge = |name: &str| -> Vec<Option<u32>> {
            metrics
                .iter()
                .map(|m| parse_gauge(m.as_deref()?, name).ok().map(|v| v as u32))
                .collect()
        };
        let states = admin_command(&sources.admin, "show servers state")
            .ok()
            .and_then(|t| parse_servers_state(&t).ok());
        let conns = admin_command(
            &sources.admin,
            &format!("show servers conn {}", sources.backend),
        )
        .ok()
        .and_then(|t| parse_servers_conn(&t).ok());
        let url = sources
            .endpoints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let endpoints = url.and_then(|u| {
            let text = http.get(u).send().ok()?.text().ok()?;
            parse_endpoints(&text)
        });
        let by_name = |tg: &Target| tg.name.clone();
        samples.push(Sample {
            t,
            dt: t - last,
            util,
            service_cores,
            inflight: gauge(INFLIGHT_METRIC),
            inflight_peak: gauge(INFLIGHT_PEAK_METRIC),
            conns_peak: gauge(CONNECTIONS_PEAK_METRIC),
            hap_conns: targets
                .iter()
                .map(|tg| conns.as_ref()?.get(&by_name(tg)).copied())
                .collect(),
            weight: targets
                .iter()
                .map(|tg| {
                    states
                        .as_ref()
                        .and_then(|s| s.get(&tg.name))
                        .map(|s| s.effective_weight())
                })
                .collect(),
            reported: targets
                .iter()
                .map(|tg| endpoints.as_ref()?.get(&tg.name).copied())
                .collect(),
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

/// The highest of `value` over the samples within `(from, to]`.
pub fn peak(
    samples: &[Sample],
    from: f64,
    to: f64,
    value: impl Fn(&Sample) -> Option<u32>,
) -> Option<u32> {
    samples
        .iter()
        .filter(|s| s.t > from && s.t <= to)
        .filter_map(value)
        .max()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_show_servers_conn() {
        // As HAProxy 2.6 prints it: the per-thread idle counts fill one header word.
        let text = "# bkname/svname bkid/svid addr port - purge_delay used_cur used_max \
            need_est unsafe_nb safe_nb idle_lim idle_cur idle_per_thr[2]\n\
            be/web-1 3/1 127.0.0.1 18998 - 5000 2 14 3 0 12 -1 12 7 5\n\
            be/web-2 3/2 127.0.0.1 18997 - 5000 0 0 0 0 0 -1 0 0 0\n\n";
        let c = parse_servers_conn(text).expect("parses");
        assert_eq!(c["web-1"], ServerConns { used: 2, idle: 12 });
        assert_eq!(c["web-2"], ServerConns { used: 0, idle: 0 });
        assert!(parse_servers_conn("Unknown command\n").is_err());
    }

    #[test]
    fn parses_endpoints() {
        let view = |node: &str, inflight, weight, binding| EndpointView {
            node: node.to_string(),
            address: "127.0.0.1:1".into(),
            zone: String::new(),
            load: 0.5,
            cpu: 0.5,
            inflight,
            capacity: 0,
            inflight_estimate: InflightEstimate {
                ratio: 5.0,
                binding,
                trusted: true,
                ..InflightEstimate::default()
            },
            cpu_floor: None,
            weight,
            state: ballast_balance::EndpointState::Serving,
            report_age_ms: Some(10),
        };
        let text =
            serde_json::to_string(&[view("web-1", 3, 0.8, false), view("web-2", 9, 0.2, true)])
                .expect("serialises");
        let e = parse_endpoints(&text).expect("parses");
        assert_eq!(e["web-1"].inflight, 3);
        assert_eq!(e["web-1"].weight, 0.8);
        let x = e["web-2"].estimate.expect("estimate");
        assert!(x.binding && x.trusted && x.ratio == 5.0);
        assert_eq!(parse_endpoints("[{\"node\": 1}]"), None);
    }
}
