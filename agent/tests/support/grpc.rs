//! What the gRPC in-flight test and the measurement bench share: the Python server
//! with a known in-flight count, its load generator, sampling and statistics.

// Shared by a test and a bench, each of which uses part of it; a failed set-up there
// is a failed run with its message.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ballast_agent::sample::tcp::TcpInflight;

/// A child process killed and reaped when dropped.
pub struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/grpc/inflight_server.py")
}

/// The Python with grpcio: `BALLAST_PYTHON`, else the test command's virtual
/// environment, `tests/.venv` (Debian's system Python refuses `pip install`).
pub fn python() -> PathBuf {
    let path = std::env::var_os("BALLAST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/.venv/bin/python"));
    assert!(
        path.is_file(),
        "these tests need a Python with grpcio: {} is not there. Run `bash tests/run`, \
         which makes tests/.venv, or set BALLAST_PYTHON",
        path.display()
    );
    path
}

pub fn require_grpcio() {
    let ok = Command::new(python())
        .args(["-c", "import grpc"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "these tests need a Python with the package grpcio: `{} -c 'import grpc'` failed \
         (run `bash tests/run`, which installs it in tests/.venv)",
        python().display()
    );
}

/// Reads lines of `child`'s stdout until one starts with `prefix`; returns the rest.
pub fn wait_line(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with(prefix) => {
                // Keep draining in the background so the child never blocks on a full pipe.
                std::thread::spawn(move || lines.for_each(drop));
                return line[prefix.len()..].trim().to_string();
            }
            Some(Ok(_)) => {}
            other => panic!(
                "{} exited before printing {prefix:?}: {other:?}",
                script().display()
            ),
        }
    }
}

/// Reads lines of `child`'s stdout until one starts with `prefix` and returns the rest,
/// leaving stdout in place for the next read (the lines are read one byte at a time).
pub fn wait_line_keep(child: &mut Child, prefix: &str) -> String {
    use std::io::Read;
    let out = child.stdout.as_mut().expect("piped stdout");
    loop {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            match out.read(&mut b) {
                Ok(1) if b[0] == b'\n' => break,
                Ok(1) => line.push(b[0]),
                other => panic!(
                    "{} exited before printing {prefix:?}: {other:?}",
                    script().display()
                ),
            }
        }
        let line = String::from_utf8_lossy(&line).into_owned();
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.trim().to_string();
        }
    }
}

/// The server: its process, port and state file.
pub struct Server {
    _proc: Proc,
    pub port: u16,
    /// Where its py-grpc-prometheus counters are served (`serve --metrics`).
    pub metrics_port: Option<u16>,
    pub state: File,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn start(service_ms: f64) -> Server {
        Self::spawn("serve", service_ms, &[])
    }

    /// The gRPC server with py-grpc-prometheus' server interceptor counting its calls
    /// as go-grpc-prometheus does, served by prometheus_client.
    pub fn start_with_metrics(service_ms: f64) -> Server {
        let ok = Command::new(python())
            .args(["-c", "import prometheus_client, py_grpc_prometheus"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(
            ok,
            "this test needs a Python with the packages prometheus_client and \
             py-grpc-prometheus: `{} -c 'import prometheus_client, py_grpc_prometheus'` \
             failed (run `bash tests/run`, which installs them)",
            python().display()
        );
        let s = Self::spawn("serve", service_ms, &["--metrics"]);
        assert!(
            s.metrics_port.is_some(),
            "the server printed no metrics port"
        );
        s
    }

    /// The same handler behind HTTP/1.1 with keep-alive (no gRPC).
    pub fn start_http(service_ms: f64) -> Server {
        Self::spawn("serve-http", service_ms, &[])
    }

    /// The HTTP/1.1 server with its handler wrapped in OpenTelemetry's WSGI middleware,
    /// and the SDK's Prometheus exporter serving `http_server_active_requests`.
    pub fn start_otel(service_ms: f64) -> Server {
        let ok = Command::new(python())
            .args([
                "-c",
                "import opentelemetry.exporter.prometheus, opentelemetry.instrumentation.wsgi",
            ])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(
            ok,
            "this test needs a Python with the packages opentelemetry-sdk, \
             opentelemetry-exporter-prometheus and opentelemetry-instrumentation-wsgi: `{} -c \
             'import opentelemetry.exporter.prometheus, opentelemetry.instrumentation.wsgi'` \
             failed (run `bash tests/run`, which installs them)",
            python().display()
        );
        let s = Self::spawn("serve-otel", service_ms, &[]);
        assert!(
            s.metrics_port.is_some(),
            "the server printed no metrics port"
        );
        s
    }

    fn spawn(mode: &str, service_ms: f64, extra: &[&str]) -> Server {
        require_grpcio();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inflight");
        let mut child = Command::new(python())
            .arg(script())
            .args([mode, "--service-ms", &service_ms.to_string(), "--state"])
            .arg(&path)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start python {}: {e}", script().display()));
        // `metrics N`, when asked for (or served, as `serve-otel` does), comes before
        // `port N`.
        let metrics_port = (extra.contains(&"--metrics") || mode == "serve-otel")
            .then(|| wait_line_keep(&mut child, "metrics ").parse().unwrap());
        let port = wait_line(&mut child, "port ").parse().unwrap();
        let state = File::open(&path).unwrap();
        Server {
            _proc: Proc(child),
            port,
            metrics_port,
            state,
            _dir: dir,
        }
    }

    /// `channels` keep-alive HTTP/1.1 connections to `target`, each making request
    /// after request, as many of them at a time as `steps` says; waits until every
    /// connection has had an answer.
    pub fn load_http(
        &self,
        target: &str,
        channels: u32,
        think_ms: f64,
        secs: f64,
        steps: &Steps,
    ) -> Proc {
        let channels = channels.to_string();
        let (think, secs) = (think_ms.to_string(), secs.to_string());
        let mut args = vec![
            "load-http",
            "--target",
            target,
            "--channels",
            &channels,
            "--think-ms",
            &think,
            "--duration",
            &secs,
        ];
        let steps = steps.args();
        args.extend(steps.iter().map(String::as_str));
        run_load(&args)
    }

    /// The number of calls inside the server's handler now.
    pub fn truth(&self) -> u32 {
        let mut b = [0u8; 4];
        self.state.read_exact_at(&mut b, 0).unwrap();
        u32::from_le_bytes(b)
    }

    /// The true count when the metrics page last rendered (between its two families),
    /// and how many times it has rendered (`serve --metrics`).
    pub fn at_render(&self) -> (u32, u64) {
        let mut b = [0u8; 12];
        self.state.read_exact_at(&mut b, 4).unwrap();
        let truth = u32::from_le_bytes(b[..4].try_into().unwrap());
        let renders = u64::from_le_bytes(b[4..].try_into().unwrap());
        (truth, renders)
    }

    /// Starts `channels` connections with `callers` concurrent callers each, and waits
    /// until every connection is up.
    pub fn load(&self, channels: u32, callers: u32, think_ms: f64, secs: f64) -> Proc {
        self.load_stepped(channels, callers, think_ms, secs, &Steps::STEADY)
    }

    /// As `load`, with as many of the callers at a time as `steps` says.
    pub fn load_stepped(
        &self,
        channels: u32,
        callers: u32,
        think_ms: f64,
        secs: f64,
        steps: &Steps,
    ) -> Proc {
        let target = format!("127.0.0.1:{}", self.port);
        let (channels, callers) = (channels.to_string(), callers.to_string());
        let (think, secs) = (think_ms.to_string(), secs.to_string());
        let mut args = vec![
            "load",
            "--target",
            &target,
            "--channels",
            &channels,
            "--callers",
            &callers,
            "--think-ms",
            &think,
            "--duration",
            &secs,
        ];
        let steps = steps.args();
        args.extend(steps.iter().map(String::as_str));
        run_load(&args)
    }
}

/// How a load's concurrency varies: from its "ready" on, its callers step through these
/// fractions of their number (rounded up, at least one), each held `step_ms`, in turn.
pub struct Steps {
    pub fractions: &'static [f64],
    pub step_ms: u32,
}

impl Steps {
    /// Every caller throughout.
    pub const STEADY: Steps = Steps {
        fractions: &[1.0],
        step_ms: 1000,
    };

    /// How many of `callers` run at each step, as the load generator rounds them.
    pub fn levels(&self, callers: u32) -> Vec<u32> {
        self.fractions
            .iter()
            .map(|f| ((f * f64::from(callers) - 1e-9).ceil() as u32).max(1))
            .collect()
    }

    fn args(&self) -> Vec<String> {
        let fractions: Vec<String> = self.fractions.iter().map(f64::to_string).collect();
        vec![
            "--steps".into(),
            fractions.join(","),
            "--step-ms".into(),
            self.step_ms.to_string(),
        ]
    }
}

/// Runs the script with `args` (a load mode) and waits for its "ready".
fn run_load(args: &[&str]) -> Proc {
    let mut child = Command::new(python())
        .arg(script())
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_line(&mut child, "ready");
    Proc(child)
}

/// One sample: the true in-flight (mean of the readings just before and just after),
/// and the agent's owed and established counts.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    pub truth: f64,
    pub owed: u32,
    pub established: u32,
}

/// `n` samples `every` apart, after `warmup`.
pub fn measure(server: &Server, warmup: Duration, n: usize, every: Duration) -> Vec<Point> {
    let mut src = TcpInflight::open(vec![server.port]).unwrap();
    std::thread::sleep(warmup);
    let mut points = Vec::with_capacity(n);
    let mut next = Instant::now();
    for _ in 0..n {
        let before = server.truth();
        let count = src.sample_count().unwrap();
        let after = server.truth();
        points.push(Point {
            truth: f64::from(before + after) / 2.0,
            owed: count.owed,
            established: count.established,
        });
        next += every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    points
}

/// Summary figures of a run.
#[derive(Debug)]
pub struct Stats {
    pub connections: u32,
    pub mean_truth: f64,
    pub mean_owed: f64,
    /// Mean of owed − truth.
    pub mean_error: f64,
    pub mean_abs_error: f64,
    /// Mean of min(truth, connections): the best a count of connections can do.
    pub mean_ceiling: f64,
    pub max_owed: u32,
    /// Correlation of owed with truth over the samples.
    pub correlation: f64,
}

pub fn stats(points: &[Point]) -> Stats {
    let n = points.len() as f64;
    let mean = |f: &dyn Fn(&Point) -> f64| points.iter().map(f).sum::<f64>() / n;
    let connections = points.iter().map(|p| p.established).max().unwrap_or(0);
    let mean_truth = mean(&|p| p.truth);
    let mean_owed = mean(&|p| f64::from(p.owed));
    let cov = mean(&|p| (p.truth - mean_truth) * (f64::from(p.owed) - mean_owed));
    let var_t = mean(&|p| (p.truth - mean_truth).powi(2));
    let var_o = mean(&|p| (f64::from(p.owed) - mean_owed).powi(2));
    Stats {
        connections,
        mean_truth,
        mean_owed,
        mean_error: mean(&|p| f64::from(p.owed) - p.truth),
        mean_abs_error: mean(&|p| (f64::from(p.owed) - p.truth).abs()),
        mean_ceiling: mean(&|p| p.truth.min(f64::from(p.established))),
        max_owed: points.iter().map(|p| p.owed).max().unwrap_or(0),
        correlation: if var_t > 0.0 && var_o > 0.0 {
            cov / (var_t * var_o).sqrt()
        } else {
            f64::NAN
        },
    }
}

/// Service time and think time of the short tests, in milliseconds. The think time is
/// long against the kernel's clock tick (4 ms at `HZ=250`): a call that arrives in the
/// tick its connection's previous response left reads as answered (see the module
/// documentation of `sample::tcp`), and the measurement shows how much that costs with
/// back-to-back calls; these tests check the estimate away from that limit.
pub const SERVICE_MS: f64 = 20.0;
pub const THINK_MS: f64 = 50.0;
