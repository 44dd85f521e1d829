//! Measurement sources: where the agent's CPU and in-flight numbers come from.
//!
//! Every source is a plain blocking reader of `/proc`, cgroupfs or a local HTTP
//! endpoint. They are cheap (a few small file reads, or one localhost GET), so the
//! daemon can run them once per report interval on a blocking thread.
//!
//! A source that cannot measure returns an error instead of a zero: the design's rule is
//! that a failure must never look like an idle node, because an idle-looking node is sent
//! more traffic.

pub mod cgroup;
pub mod expr;
pub mod host;
pub mod nginx;
mod niced;
pub mod probe;
pub mod process;
pub mod prometheus;
mod siblings;
pub mod synthetic;
pub mod tcp;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use ballast_balance::load;
use ballast_shared::session::Assignment;
use tokio::sync::watch;

/// The aggregator's current assignment for this node, as the report loop publishes it:
/// `None` until the first reply. A source that models how the node responds to its
/// weight (the synthetic one) subscribes to it; the others never look.
pub(crate) type AssignmentWatch = watch::Receiver<Option<Assignment>>;

/// A watch that stays at "no assignment", for a measurement taken without a daemon
/// (`ballast-agent sample`, `check`): a source following the weight sees the fleet
/// mean.
pub fn no_assignment() -> AssignmentWatch {
    watch::channel(None).1
}

/// Why a measurement failed. Every variant names the file, URL or spec at fault, because
/// the operator reading the log has to find it.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// A file could not be read.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file or response was read but its contents are not what the kernel or the
    /// exporter should produce.
    #[error("cannot parse {what}: {detail}")]
    Parse {
        /// What was being parsed, with its path or URL.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// An HTTP scrape failed: connection, timeout, status or size limit.
    #[error("http: {0}")]
    Http(String),
    /// The thing to measure does not exist (a process that exited, a cgroup not found,
    /// a metric the endpoint does not export).
    #[error("not found: {0}")]
    NotFound(String),
    /// An expression came out below zero: counters read out of step (a restart between
    /// two reads, a page that renders the finished calls after the started ones), or a
    /// status count smaller than the status request itself. Never clamped to 0, which
    /// would look like an idle node.
    #[error("in-flight count below zero: {0}")]
    Negative(String),
    /// A source specification (CLI or config syntax) is malformed.
    #[error("invalid source spec: {0}")]
    InvalidSpec(String),
}

impl SampleError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        SampleError::Io {
            path: path.into(),
            source,
        }
    }

    /// A parse error on `what`.
    pub(crate) fn parse(what: impl Into<String>, detail: impl Into<String>) -> Self {
        SampleError::Parse {
            what: what.into(),
            detail: detail.into(),
        }
    }
}

/// Reads a whole (small) file to a string, naming the path on failure.
pub(crate) fn read_file(path: &std::path::Path) -> Result<String, SampleError> {
    std::fs::read_to_string(path).map_err(|e| SampleError::io(path, e))
}

/// A source of CPU utilization, relative to what the service may use (1.0 = all of it).
pub trait CpuSource: Send {
    /// Utilization since the previous call; `Ok(None)` on the first call (no delta yet).
    ///
    /// May exceed 1 when the service bursts above its share (an unthrottled cgroup, a
    /// process tree measured against fewer cores than it uses).
    fn sample(&mut self) -> Result<Option<f64>, SampleError>;
    /// A one-line description for logs and `status`.
    fn describe(&self) -> String;
}

/// A source of the number of requests currently in flight.
pub trait InflightSource: Send {
    /// The current number of in-flight requests.
    fn sample(&mut self) -> Result<u32, SampleError>;
    /// A one-line description for logs and `status`.
    fn describe(&self) -> String;
    /// How the last sample's count was derived, in one short line for `sample` and
    /// `status`, e.g. `3 of 12 connections owe a response`; `None` (the default) when
    /// the count is all there is to say.
    fn detail(&self) -> Option<String> {
        None
    }
    /// The series the last count summed, one per line (`+ name{labels} value`), for a
    /// source that reads them; empty (the default) otherwise.
    fn series(&self) -> Vec<String> {
        Vec::new()
    }
    /// Tells the source the capacity its count will be divided by. [`Sampler::new`] calls
    /// it so that a source which models utilization (the synthetic one) can express it
    /// in the same units; real counters ignore it.
    fn set_capacity(&mut self, _capacity: u32) {}
    /// The capacity the source's count is expressed against, for a source that models
    /// utilization rather than counting requests; `None` (the default) for counters,
    /// whose count the aggregator judges against the fleet.
    fn own_capacity(&self) -> Option<u32> {
        None
    }
}

/// Where CPU utilization comes from. Serialized with a `kind` tag for config files.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CpuSpec {
    /// The whole host, from `/proc/stat`.
    Host,
    /// A cgroup (v1 or v2), relative to its CPU quota. `path` is absolute, or a name
    /// relative to the hierarchy such as `ballast/web1`.
    Cgroup {
        /// Absolute cgroupfs path or hierarchy-relative name.
        path: String,
    },
    /// A process and all its descendants, relative to one core.
    Process {
        /// The root of the process tree.
        pid: u32,
    },
    /// No CPU measurement; load comes from in-flight requests alone.
    None,
}

/// Where the in-flight count comes from. Serialized with a `kind` tag for config files.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum InflightSpec {
    /// TCP connections whose local port is one of `ports` and that are owed a response
    /// (they received data after they last sent any, or hold unread bytes).
    Tcp {
        /// The service's listening ports.
        ports: Vec<u16>,
    },
    /// An expression over the series of a Prometheus endpoint (text format or
    /// OpenMetrics): [`expr`] has the syntax. A bare metric name sums all its series.
    Prometheus {
        /// `http://host:port/path`.
        url: String,
        /// The expression, e.g. `a_total{x="y"} - b_total{x="y"}`.
        #[serde(alias = "metric")]
        expr: String,
    },
    /// The `grpc` preset: go-grpc-prometheus's `grpc_server_started_total -
    /// grpc_server_handled_total`, for one gRPC service or all.
    Grpc {
        /// The metrics URL.
        url: String,
        /// The `grpc_service` label to select (e.g. `shop.Cart`); all services if unset.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        service: Option<String>,
    },
    /// The `otel-http` preset: OpenTelemetry's `http_server_active_requests`.
    #[serde(rename = "otel-http", alias = "otel_http")]
    OtelHttp {
        /// The metrics URL.
        url: String,
    },
    /// The `envoy` preset: `envoy_http_downstream_rq_active` of one HTTP connection
    /// manager.
    Envoy {
        /// Envoy's Prometheus stats URL (`/stats/prometheus` on the admin port).
        url: String,
        /// The connection manager's `stat_prefix` [default: `ingress_http`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<String>,
    },
    /// The `haproxy` preset: a backend's current sessions plus its queue, from
    /// HAProxy's Prometheus exporter.
    Haproxy {
        /// The exporter's URL.
        url: String,
        /// The backend's name (the `proxy` label); every backend if unset.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        backend: Option<String>,
    },
    /// The `nginx` preset: the `Writing` count of nginx's `stub_status` page, less the
    /// status request itself.
    Nginx {
        /// The `stub_status` location's URL.
        url: String,
    },
    /// `auto[:METRICS_URL]`: for `ballast-agent check` only, which probes the service's
    /// port and the URL and suggests a source; the daemon refuses it.
    #[serde(skip)]
    Auto {
        /// The metrics URL to look for the presets' series on.
        url: Option<String>,
    },
    /// The closed-loop model of [`synthetic`], for demos and tests.
    Synthetic {
        /// Relative speed of this node (> 0).
        speed: f64,
        /// Mean per-node utilization at equal weights.
        offered: f64,
        /// Relative noise amplitude.
        noise: f64,
        /// Random seed, so that a demo is reproducible.
        seed: u64,
    },
    /// No in-flight measurement; load comes from CPU alone.
    None,
}

/// Defaults of the `synthetic:` spec, chosen so that a bare `synthetic` is a plausible
/// healthy node.
const SYNTHETIC_DEFAULTS: (f64, f64, f64, u64) = (1.0, 0.6, 0.02, 0);

impl FromStr for CpuSpec {
    type Err = SampleError;

    /// CLI syntax: `host`, `none`, `cgroup:/sys/fs/cgroup/cpu/foo` or `cgroup:foo`,
    /// `pid:1234`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (s, None),
        };
        match (kind, arg) {
            ("host", None) => Ok(CpuSpec::Host),
            ("none", None) => Ok(CpuSpec::None),
            ("cgroup", Some(path)) if !path.trim().is_empty() => Ok(CpuSpec::Cgroup {
                path: path.trim().to_string(),
            }),
            ("pid" | "process", Some(pid)) => match pid.trim().parse::<u32>() {
                Ok(pid) if pid > 0 => Ok(CpuSpec::Process { pid }),
                _ => Err(SampleError::InvalidSpec(format!(
                    "{s:?}: pid must be a positive integer"
                ))),
            },
            _ => Err(SampleError::InvalidSpec(format!(
                "{s:?}: expected host, none, cgroup:PATH or pid:PID"
            ))),
        }
    }
}

impl fmt::Display for CpuSpec {
    /// The same syntax [`FromStr`] accepts, so a spec can be printed and parsed back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuSpec::Host => write!(f, "host"),
            CpuSpec::Cgroup { path } => write!(f, "cgroup:{path}"),
            CpuSpec::Process { pid } => write!(f, "pid:{pid}"),
            CpuSpec::None => write!(f, "none"),
        }
    }
}

impl FromStr for InflightSpec {
    type Err = SampleError;

    /// CLI syntax: `tcp:8080,8443`,
    /// `prometheus:http://127.0.0.1:9100/metrics#my_inflight` (or any expression after
    /// the `#`), the presets `grpc:URL[#service=NAME]`, `otel-http:URL`,
    /// `envoy:URL[#prefix=NAME]`, `haproxy:URL[#backend=NAME]`, `nginx:URL`,
    /// `synthetic:speed=0.6,offered=0.6,noise=0.02,seed=1` (every key optional), `none`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let invalid = |why: &str| SampleError::InvalidSpec(format!("{s:?}: {why}"));
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (s, None),
        };
        match (kind, arg) {
            ("none", None) => Ok(InflightSpec::None),
            ("auto", None) => Ok(InflightSpec::Auto { url: None }),
            ("auto", Some(url)) => {
                prometheus::HttpUrl::parse(url)?;
                Ok(InflightSpec::Auto {
                    url: Some(url.to_string()),
                })
            }
            ("tcp", Some(list)) => {
                let ports = list
                    .split(',')
                    .map(|p| match p.trim().parse::<u16>() {
                        Ok(port) if port > 0 => Ok(port),
                        _ => Err(invalid("ports must be integers in 1..=65535")),
                    })
                    .collect::<Result<Vec<u16>, _>>()?;
                Ok(InflightSpec::Tcp { ports })
            }
            ("prometheus", Some(rest)) => {
                // The expression follows the first '#': URL fragments are never sent to
                // the server, so a '#' cannot be part of a meaningful scrape URL.
                let (url, expr) = rest
                    .split_once('#')
                    .ok_or_else(|| invalid("expected prometheus:URL#EXPRESSION"))?;
                prometheus::HttpUrl::parse(url)?;
                expr::Expr::parse(expr)?;
                Ok(InflightSpec::Prometheus {
                    url: url.to_string(),
                    expr: expr.to_string(),
                })
            }
            (name, Some(rest)) if expr::Preset::from_name(name).is_some() => {
                let preset = expr::Preset::from_name(name)
                    .ok_or_else(|| invalid("unknown preset"))?;
                let (url, option) = match rest.split_once('#') {
                    Some((url, opt)) => (url, Some(opt)),
                    None => (rest, None),
                };
                prometheus::HttpUrl::parse(url)?;
                let value = match (preset.option(), option) {
                    (_, None) => None,
                    (Some(key), Some(opt)) => {
                        let v = opt
                            .strip_prefix(key)
                            .and_then(|v| v.strip_prefix('='))
                            .ok_or_else(|| invalid(&format!("expected {name}:URL#{key}=VALUE")))?;
                        preset.check_option(v).map_err(|e| invalid(&e))?;
                        Some(v.to_string())
                    }
                    (None, Some(_)) => {
                        return Err(invalid(&format!("{name} takes no option: {name}:URL")))
                    }
                };
                let url = url.to_string();
                Ok(match preset {
                    expr::Preset::Grpc => InflightSpec::Grpc {
                        url,
                        service: value,
                    },
                    expr::Preset::OtelHttp => InflightSpec::OtelHttp { url },
                    expr::Preset::Envoy => InflightSpec::Envoy { url, prefix: value },
                    expr::Preset::Haproxy => InflightSpec::Haproxy {
                        url,
                        backend: value,
                    },
                    expr::Preset::Nginx => InflightSpec::Nginx { url },
                })
            }
            ("synthetic", params) => {
                let (mut speed, mut offered, mut noise, mut seed) = SYNTHETIC_DEFAULTS;
                for kv in params.unwrap_or("").split(',').map(str::trim) {
                    if kv.is_empty() {
                        continue;
                    }
                    let (k, v) = kv
                        .split_once('=')
                        .ok_or_else(|| invalid("expected key=value"))?;
                    let num = || {
                        v.trim()
                            .parse::<f64>()
                            .ok()
                            .filter(|x| x.is_finite())
                            .ok_or_else(|| invalid(&format!("{k}: not a finite number")))
                    };
                    match k.trim() {
                        "speed" => speed = num()?,
                        "offered" => offered = num()?,
                        "noise" => noise = num()?,
                        "seed" => {
                            seed = v
                                .trim()
                                .parse::<u64>()
                                .map_err(|_| invalid("seed must be an unsigned integer"))?
                        }
                        other => {
                            return Err(invalid(&format!(
                                "unknown key {other:?} (speed, offered, noise, seed)"
                            )))
                        }
                    }
                }
                if speed <= 0.0 {
                    return Err(invalid("speed must be > 0"));
                }
                if offered < 0.0 || noise < 0.0 {
                    return Err(invalid("offered and noise must be >= 0"));
                }
                Ok(InflightSpec::Synthetic {
                    speed,
                    offered,
                    noise,
                    seed,
                })
            }
            _ => Err(invalid(
                "expected tcp:PORTS, prometheus:URL#EXPRESSION, a preset (grpc:URL, otel-http:URL, \
                 envoy:URL, haproxy:URL, nginx:URL), synthetic[:k=v,...] or none",
            )),
        }
    }
}

impl InflightSpec {
    /// A preset's kind, URL and option; `None` for the other sources.
    pub fn preset(&self) -> Option<(expr::Preset, &str, Option<&str>)> {
        use expr::Preset;
        Some(match self {
            InflightSpec::Grpc { url, service } => (Preset::Grpc, url, service.as_deref()),
            InflightSpec::OtelHttp { url } => (Preset::OtelHttp, url, None),
            InflightSpec::Envoy { url, prefix } => (Preset::Envoy, url, prefix.as_deref()),
            InflightSpec::Haproxy { url, backend } => (Preset::Haproxy, url, backend.as_deref()),
            InflightSpec::Nginx { url } => (Preset::Nginx, url, None),
            _ => return None,
        })
    }
}

impl fmt::Display for InflightSpec {
    /// The same syntax [`FromStr`] accepts, so a spec can be printed and parsed back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InflightSpec::Tcp { ports } => {
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                write!(f, "tcp:{}", ports.join(","))
            }
            InflightSpec::Prometheus { url, expr } => write!(f, "prometheus:{url}#{expr}"),
            InflightSpec::Auto { url: None } => write!(f, "auto"),
            InflightSpec::Auto { url: Some(url) } => write!(f, "auto:{url}"),
            InflightSpec::Grpc { .. }
            | InflightSpec::OtelHttp { .. }
            | InflightSpec::Envoy { .. }
            | InflightSpec::Haproxy { .. }
            | InflightSpec::Nginx { .. } => match self.preset() {
                Some((preset, url, Some(v))) => match preset.option() {
                    Some(key) => write!(f, "{}:{url}#{key}={v}", preset.name()),
                    None => write!(f, "{}:{url}", preset.name()),
                },
                Some((preset, url, None)) => write!(f, "{}:{url}", preset.name()),
                None => Ok(()),
            },
            InflightSpec::Synthetic {
                speed,
                offered,
                noise,
                seed,
            } => write!(
                f,
                "synthetic:speed={speed},offered={offered},noise={noise},seed={seed}"
            ),
            InflightSpec::None => write!(f, "none"),
        }
    }
}

/// Opens the CPU source a spec names; `None` for [`CpuSpec::None`].
///
/// Opening reads the source once, so that a wrong path or pid fails at startup rather
/// than at the first report.
pub(crate) fn open_cpu(spec: &CpuSpec) -> Result<Option<Box<dyn CpuSource>>, SampleError> {
    Ok(match spec {
        CpuSpec::Host => Some(Box::new(host::HostCpu::open()?)),
        CpuSpec::Cgroup { path } => Some(Box::new(cgroup::CgroupCpu::open(path)?)),
        CpuSpec::Process { pid } => Some(Box::new(process::ProcessCpu::open(*pid)?)),
        CpuSpec::None => None,
    })
}

/// Opens the in-flight source a spec names; `None` for [`InflightSpec::None`].
///
/// `synthetic` holds the synthetic model's speed and offered load, which a synthetic
/// spec resets to its values, and `assignment` the weight the aggregator gives the
/// node, which the model follows. Other sources ignore both.
pub(crate) fn open_inflight(
    spec: &InflightSpec,
    synthetic: &synthetic::SyntheticHandle,
    assignment: &AssignmentWatch,
) -> Result<Option<Box<dyn InflightSource>>, SampleError> {
    Ok(match spec {
        InflightSpec::Tcp { ports } => Some(Box::new(tcp::TcpInflight::open(ports.clone())?)),
        InflightSpec::Prometheus { url, expr } => {
            Some(Box::new(prometheus::PrometheusInflight::new(url, expr)?))
        }
        InflightSpec::Auto { .. } => {
            return Err(SampleError::InvalidSpec(
                "auto is for `ballast-agent check --inflight auto[:METRICS_URL]`, which \
                 suggests a source; the agent needs the source itself"
                    .into(),
            ))
        }
        InflightSpec::Grpc { .. }
        | InflightSpec::OtelHttp { .. }
        | InflightSpec::Envoy { .. }
        | InflightSpec::Haproxy { .. }
        | InflightSpec::Nginx { .. } => match spec.preset() {
            Some((expr::Preset::Nginx, url, _)) => Some(Box::new(nginx::NginxInflight::new(url)?)),
            Some((preset, url, option)) => {
                let text = preset.expression(option).unwrap_or_default();
                let label = format!("{spec} ({text})");
                Some(Box::new(prometheus::PrometheusInflight::with_label(
                    url, &text, label,
                )?))
            }
            None => None,
        },
        InflightSpec::Synthetic {
            speed,
            offered,
            noise,
            seed,
        } => {
            synthetic.set_speed(*speed);
            synthetic.set_offered(*offered);
            Some(Box::new(synthetic::SyntheticInflight::new(
                synthetic.clone(),
                assignment.clone(),
                *noise,
                *seed,
            )))
        }
        InflightSpec::None => None,
    })
}

/// One measurement.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Sample {
    /// CPU utilization relative to what the service may use (0 without a CPU source).
    pub cpu: f64,
    /// Requests in flight (0 without an in-flight source).
    pub inflight: u32,
    /// The configured in-flight capacity; 0 means in-flight requests do not count.
    pub capacity: u32,
    /// The fraction of requests failing, when known.
    pub error_rate: Option<f64>,
    /// `max(cpu, inflight / capacity)` plus the error penalty: what the agent reports.
    pub load: f64,
}

/// The error-rate penalty passed to [`load::combine`]: an all-failing node looks one
/// full unit busier, which is what gRPC's weighted round robin does by default.
const ERROR_PENALTY: f64 = 1.0;

/// Both sources plus the capacity: turns them into one [`Sample`] per call.
pub struct Sampler {
    cpu: Option<Box<dyn CpuSource>>,
    inflight: Option<Box<dyn InflightSource>>,
    capacity: u32,
    error_rate: Option<f64>,
}

impl Sampler {
    /// Combines the two sources. `capacity` is the in-flight count that means "fully
    /// loaded", when the operator knows it; 0 (the default) reports the count without
    /// one, for the aggregator to judge against the fleet, and the agent's own load is
    /// then its CPU (a source that models utilization brings its own capacity).
    pub fn new(
        cpu: Option<Box<dyn CpuSource>>,
        mut inflight: Option<Box<dyn InflightSource>>,
        capacity: u32,
    ) -> Self {
        let mut capacity = capacity;
        if let Some(src) = inflight.as_mut() {
            src.set_capacity(capacity);
            if capacity == 0 {
                capacity = src.own_capacity().unwrap_or(0);
            }
        }
        Sampler {
            cpu,
            inflight,
            capacity,
            error_rate: None,
        }
    }

    /// Sets the error rate added to the load from now on (`None`: unknown, adds nothing).
    #[cfg(test)]
    pub(crate) fn set_error_rate(&mut self, error_rate: Option<f64>) {
        self.error_rate = error_rate;
    }

    /// Takes one sample. A CPU source with no delta yet counts as 0 cpu. A source error
    /// is returned, never turned into a zero load (failures must not look like idle).
    pub fn sample(&mut self) -> Result<Sample, SampleError> {
        let cpu = match self.cpu.as_mut() {
            Some(src) => load::sanitize(src.sample()?.unwrap_or(0.0)),
            None => 0.0,
        };
        let inflight = match self.inflight.as_mut() {
            Some(src) => src.sample()?,
            None => 0,
        };
        let load = load::combine(cpu, inflight, self.capacity, self.error_rate, ERROR_PENALTY);
        Ok(Sample {
            cpu,
            inflight,
            capacity: self.capacity,
            error_rate: self.error_rate,
            load,
        })
    }

    /// How the in-flight source derived its last count ([`InflightSource::detail`]),
    /// e.g. `3 of 12 connections owe a response`; `None` without a source or detail.
    pub fn inflight_detail(&self) -> Option<String> {
        self.inflight.as_ref().and_then(|s| s.detail())
    }

    /// The series the in-flight source's last count summed ([`InflightSource::series`]).
    pub fn inflight_series(&self) -> Vec<String> {
        self.inflight
            .as_ref()
            .map(|s| s.series())
            .unwrap_or_default()
    }

    /// A one-line description of both sources and the capacity.
    pub fn describe(&self) -> String {
        let cpu = self
            .cpu
            .as_ref()
            .map_or_else(|| "none".to_string(), |s| s.describe());
        let inflight = self
            .inflight
            .as_ref()
            .map_or_else(|| "none".to_string(), |s| s.describe());
        format!(
            "cpu: {cpu}; in-flight: {inflight}; capacity: {}",
            self.capacity
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_spec_syntax() {
        assert_eq!("host".parse::<CpuSpec>().unwrap(), CpuSpec::Host);
        assert_eq!("none".parse::<CpuSpec>().unwrap(), CpuSpec::None);
        assert_eq!(
            "cgroup:ballast/web1".parse::<CpuSpec>().unwrap(),
            CpuSpec::Cgroup {
                path: "ballast/web1".into()
            }
        );
        assert_eq!(
            "cgroup:/sys/fs/cgroup/cpu/foo".parse::<CpuSpec>().unwrap(),
            CpuSpec::Cgroup {
                path: "/sys/fs/cgroup/cpu/foo".into()
            }
        );
        assert_eq!(
            "pid:1234".parse::<CpuSpec>().unwrap(),
            CpuSpec::Process { pid: 1234 }
        );
        for bad in [
            "", "hosts", "host:1", "cgroup:", "pid:", "pid:-1", "pid:0", "pid:x",
        ] {
            assert!(
                bad.parse::<CpuSpec>().is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn inflight_spec_syntax() {
        assert_eq!(
            "tcp:8080,8443".parse::<InflightSpec>().unwrap(),
            InflightSpec::Tcp {
                ports: vec![8080, 8443]
            }
        );
        assert_eq!(
            "prometheus:http://127.0.0.1:9100/metrics#my_inflight"
                .parse::<InflightSpec>()
                .unwrap(),
            InflightSpec::Prometheus {
                url: "http://127.0.0.1:9100/metrics".into(),
                expr: "my_inflight".into()
            }
        );
        assert_eq!(
            "grpc:http://[::1]:9090/metrics#service=shop.Cart"
                .parse::<InflightSpec>()
                .unwrap(),
            InflightSpec::Grpc {
                url: "http://[::1]:9090/metrics".into(),
                service: Some("shop.Cart".into())
            }
        );
        assert_eq!(
            "haproxy:http://127.0.0.1:8405/metrics#backend=app"
                .parse::<InflightSpec>()
                .unwrap(),
            InflightSpec::Haproxy {
                url: "http://127.0.0.1:8405/metrics".into(),
                backend: Some("app".into())
            }
        );
        assert_eq!(
            "nginx:http://127.0.0.1/status"
                .parse::<InflightSpec>()
                .unwrap(),
            InflightSpec::Nginx {
                url: "http://127.0.0.1/status".into()
            }
        );
        let e = "prometheus:http://h:1/m#a - b{x=1}"
            .parse::<InflightSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("column 9"), "{e}");
        assert_eq!(
            "synthetic:speed=0.5,offered=0.7,noise=0,seed=9"
                .parse::<InflightSpec>()
                .unwrap(),
            InflightSpec::Synthetic {
                speed: 0.5,
                offered: 0.7,
                noise: 0.0,
                seed: 9
            }
        );
        let defaults = InflightSpec::Synthetic {
            speed: 1.0,
            offered: 0.6,
            noise: 0.02,
            seed: 0,
        };
        assert_eq!("synthetic".parse::<InflightSpec>().unwrap(), defaults);
        assert_eq!("synthetic:".parse::<InflightSpec>().unwrap(), defaults);
        assert_eq!("none".parse::<InflightSpec>().unwrap(), InflightSpec::None);
        assert_eq!(
            "auto:http://h:9/m".parse::<InflightSpec>().unwrap(),
            InflightSpec::Auto {
                url: Some("http://h:9/m".into())
            }
        );
        let auto = "auto".parse::<InflightSpec>().unwrap();
        assert_eq!(auto.to_string(), "auto");
        let handle = synthetic::SyntheticHandle::new();
        assert!(open_inflight(&auto, &handle, &no_assignment()).is_err());
        for bad in [
            "tcp:",
            "tcp:0",
            "tcp:70000",
            "tcp:80,x",
            "prometheus:http://h:1/m",
            "prometheus:http://h:1/m#",
            "prometheus:http://h:1/m#1bad",
            "prometheus:https://h/m#ok",
            "grpc:http://h:1/m#backend=x",
            "grpc:http://h:1/m#service=",
            "grpc:http://h:1/m#service",
            "nginx:http://h:1/m#x=1",
            "otel-http:http://h:1/m#x=1",
            "envoy:",
            "haproxy:ftp://h/m",
            "synthetic:speed=0",
            "synthetic:speed=NaN",
            "synthetic:offered=-1",
            "synthetic:bogus=1",
            "synthetic:speed",
            "udp:53",
            "auto:ftp://h/m",
        ] {
            assert!(
                bad.parse::<InflightSpec>().is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn specs_round_trip_through_display_and_serde() {
        let cpu = [
            CpuSpec::Host,
            CpuSpec::None,
            CpuSpec::Cgroup {
                path: "ballast/web1".into(),
            },
            CpuSpec::Process { pid: 42 },
        ];
        for spec in cpu {
            assert_eq!(spec.to_string().parse::<CpuSpec>().unwrap(), spec);
            let json = serde_json::to_string(&spec).unwrap();
            assert_eq!(serde_json::from_str::<CpuSpec>(&json).unwrap(), spec);
        }
        let inflight = [
            InflightSpec::Tcp {
                ports: vec![80, 443],
            },
            InflightSpec::Prometheus {
                url: "http://[::1]:9100/metrics".into(),
                expr: "inflight".into(),
            },
            InflightSpec::Prometheus {
                url: "http://h/m".into(),
                expr: r#"a_total{x=~"b|c.*"} - d_total"#.into(),
            },
            InflightSpec::Grpc {
                url: "http://h/m".into(),
                service: None,
            },
            InflightSpec::Grpc {
                url: "http://h/m".into(),
                service: Some("a.B".into()),
            },
            InflightSpec::OtelHttp {
                url: "http://h/m".into(),
            },
            InflightSpec::Envoy {
                url: "http://h/stats/prometheus".into(),
                prefix: Some("egress".into()),
            },
            InflightSpec::Haproxy {
                url: "http://h/m".into(),
                backend: Some("app".into()),
            },
            InflightSpec::Nginx {
                url: "http://h/status".into(),
            },
            InflightSpec::Synthetic {
                speed: 0.6,
                offered: 0.6,
                noise: 0.02,
                seed: 1,
            },
            InflightSpec::None,
        ];
        for spec in inflight {
            assert_eq!(spec.to_string().parse::<InflightSpec>().unwrap(), spec);
            let json = serde_json::to_string(&spec).unwrap();
            assert_eq!(serde_json::from_str::<InflightSpec>(&json).unwrap(), spec);
        }
        // Configuration files written for the single-metric source still load.
        assert_eq!(
            serde_json::from_str::<InflightSpec>(
                r#"{"kind":"prometheus","url":"http://h/m","metric":"inflight"}"#
            )
            .unwrap(),
            InflightSpec::Prometheus {
                url: "http://h/m".into(),
                expr: "inflight".into()
            }
        );
        assert_eq!(
            serde_json::to_string(&InflightSpec::OtelHttp {
                url: "http://h/m".into()
            })
            .unwrap(),
            r#"{"kind":"otel-http","url":"http://h/m"}"#
        );
        assert_eq!(
            serde_json::to_string(&CpuSpec::Process { pid: 7 }).unwrap(),
            r#"{"kind":"process","pid":7}"#
        );
    }

    struct FixedCpu(Vec<Result<Option<f64>, ()>>);
    impl CpuSource for FixedCpu {
        fn sample(&mut self) -> Result<Option<f64>, SampleError> {
            match self.0.remove(0) {
                Ok(v) => Ok(v),
                Err(()) => Err(SampleError::NotFound("fixed".into())),
            }
        }
        fn describe(&self) -> String {
            "fixed cpu".into()
        }
    }

    struct FixedInflight(Result<u32, ()>);
    impl InflightSource for FixedInflight {
        fn sample(&mut self) -> Result<u32, SampleError> {
            self.0
                .map_err(|()| SampleError::Http("fixed in-flight failed".into()))
        }
        fn describe(&self) -> String {
            "fixed in-flight".into()
        }
    }

    #[test]
    fn sampler_takes_the_max_and_counts_a_missing_delta_as_zero() {
        let cpu = FixedCpu(vec![Ok(None), Ok(Some(0.3)), Ok(Some(0.9))]);
        let mut s = Sampler::new(
            Some(Box::new(cpu)),
            Some(Box::new(FixedInflight(Ok(5)))),
            10,
        );
        let first = s.sample().unwrap();
        assert_eq!((first.cpu, first.inflight, first.load), (0.0, 5, 0.5));
        assert_eq!(s.sample().unwrap().load, 0.5);
        assert_eq!(s.sample().unwrap().load, 0.9);
        assert_eq!(
            s.describe(),
            "cpu: fixed cpu; in-flight: fixed in-flight; capacity: 10"
        );
    }

    #[test]
    fn sampler_adds_the_error_rate() {
        let cpu = FixedCpu(vec![Ok(Some(0.2))]);
        let mut s = Sampler::new(Some(Box::new(cpu)), None, 0);
        s.set_error_rate(Some(0.5));
        let sample = s.sample().unwrap();
        assert!((sample.load - 0.7).abs() < 1e-9);
        assert_eq!(sample.error_rate, Some(0.5));
    }

    #[test]
    fn sampler_propagates_source_errors_instead_of_reporting_idle() {
        let mut s = Sampler::new(Some(Box::new(FixedCpu(vec![Err(())]))), None, 10);
        assert!(matches!(s.sample(), Err(SampleError::NotFound(_))));
        let mut s = Sampler::new(None, Some(Box::new(FixedInflight(Err(())))), 10);
        assert!(matches!(s.sample(), Err(SampleError::Http(_))));
    }

    #[test]
    fn sampler_without_sources_reports_zero() {
        let mut s = Sampler::new(None, None, 0);
        let sample = s.sample().unwrap();
        assert_eq!((sample.cpu, sample.inflight, sample.load), (0.0, 0, 0.0));
        assert_eq!(s.describe(), "cpu: none; in-flight: none; capacity: 0");
        assert_eq!(s.inflight_detail(), None);
    }

    #[test]
    fn synthetic_spec_opens_through_the_handle_and_follows_the_assignment() {
        let handle = synthetic::SyntheticHandle::new();
        let (assign, assignment) = watch::channel(None);
        let spec: InflightSpec = "synthetic:speed=0.5,offered=0.6,noise=0".parse().unwrap();
        let src = open_inflight(&spec, &handle, &assignment).unwrap();
        assert_eq!(handle.speed(), 0.5);
        let mut s = Sampler::new(None, src, 100);
        // 0.6 × 1 / 0.5 = 1.2 of capacity: a slow node is overloaded at equal weights.
        assert_eq!(s.sample().unwrap().inflight, 120);
        assign.send_replace(Some(Assignment {
            weight: 0.5,
            cycle: 1,
            draining: false,
            load: 1.2,
            inflight_trusted: true,
        }));
        assert_eq!(s.sample().unwrap().inflight, 60);
        assert!(
            open_inflight(&InflightSpec::None, &handle, &no_assignment())
                .unwrap()
                .is_none()
        );
        assert!(open_cpu(&CpuSpec::None).unwrap().is_none());
    }
}
