//! The measurements behind `docs/inflight.md`: the TCP in-flight count against a gRPC
//! server's true in-flight count over connection patterns and think times, and the
//! cost of one sample at 0, 100 and 1000 matching connections.
//!
//!     cargo bench -p ballast-agent --bench inflight          # both, about 3 minutes
//!     BALLAST_GRPC_RUNS=4:1:0,4:1:50 cargo bench -p ballast-agent --bench inflight
//!
//! Needs a Python with grpcio: `BALLAST_PYTHON`, or `tests/.venv` (`bash tests/run`).

// A bench is a tool run by hand: a failed set-up aborts it with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/support/grpc.rs"]
mod support;

use ballast_agent::sample::tcp::TcpInflight;
use ballast_agent::sample::InflightSource;
use std::time::Duration;
use support::*;

/// The runs of the measurement, as (connections, calls per connection, think ms): each
/// connection pattern with back-to-back calls (think 0), the tests' 5 ms, and 50 ms.
/// `BALLAST_GRPC_RUNS=c:k:think,...` overrides it.
fn runs() -> Vec<(u32, u32, f64)> {
    if let Ok(spec) = std::env::var("BALLAST_GRPC_RUNS") {
        return spec
            .split(',')
            .map(|run| {
                let v: Vec<&str> = run.split(':').collect();
                (
                    v[0].parse().unwrap(),
                    v[1].parse().unwrap(),
                    v[2].parse().unwrap(),
                )
            })
            .collect();
    }
    let mut runs = Vec::new();
    for think in [0.0, 5.0, 50.0] {
        for (c, k) in [(1, 1), (1, 4), (1, 16), (4, 1), (4, 4), (16, 1), (16, 4)] {
            runs.push((c, k, think));
        }
    }
    runs
}

/// The table in `docs/inflight.md`.
fn measure_grpc_inflight() {
    let server = Server::start(SERVICE_MS);
    println!(
        "| connections | calls per connection | think ms | true in-flight | count | \
         mean error | mean abs error | min(true, connections) | max count | correlation |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (channels, callers, think) in runs() {
        let load = server.load(channels, callers, think, 60.0);
        let points = measure(
            &server,
            Duration::from_secs(1),
            1500,
            Duration::from_millis(3),
        );
        let s = stats(&points);
        println!(
            "| {channels} | {callers} | {think} | {:.2} | {:.2} | {:+.2} | {:.2} | {:.2} | {} | {:.2} |",
            s.mean_truth,
            s.mean_owed,
            s.mean_error,
            s.mean_abs_error,
            s.mean_ceiling,
            s.max_owed,
            s.correlation
        );
        drop(load);
        // Let the previous load's connections close before the next run.
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One sample's cost through netlink sock_diag with `tcp_info`, the shipped path.
fn sample_cost() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let mut src = TcpInflight::open(vec![addr.port()]).expect("in-flight source");
    let mut conns = Vec::new();
    println!("| matching connections | per sample |");
    println!("|---:|---:|");
    for want in [0usize, 100, 1000] {
        while conns.len() < want {
            let client = std::net::TcpStream::connect(addr).expect("connect");
            let (server, _) = listener.accept().expect("accept");
            conns.push((client, server));
        }
        let start = std::time::Instant::now();
        for _ in 0..1000 {
            src.sample().expect("sample");
        }
        println!("| {want} | {:?} |", start.elapsed() / 1000);
    }
}

fn main() {
    sample_cost();
    measure_grpc_inflight();
}
