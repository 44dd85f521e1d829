//! The TCP in-flight count against a gRPC server whose true in-flight count is known.
//!
//! `tests/grpc/inflight_server.py` serves a unary method whose handler sleeps, and keeps
//! the number of calls inside the handler in a small mmap'd file; a load generator in a
//! second process makes K concurrent calls over each of C connections. The tests sample
//! the agent's [`TcpInflight`] against the server's port and read the true count just
//! before and just after each sample.
//!
//! HTTP/2 multiplexes every call of a channel on one connection, and the agent counts
//! connections owed a response, so each connection contributes at most 1: with one
//! caller per connection the count follows the truth, and with K callers per
//! connection it saturates at the number of connections. The short tests assert both;
//! the bench `cargo bench -p ballast-agent --bench inflight` (`tests/grpc/measure`)
//! prints the table in `docs/inflight.md`.
//!
//! Needs the tests' Python with `grpcio` (`tests/.venv`, made by `bash tests/run`, or
//! `BALLAST_PYTHON`); the tests fail, naming the
//! package, without it.

#[path = "support/grpc.rs"]
mod support;

use std::time::Duration;
use support::*;

/// One connection carrying 8 concurrent callers counts at most 1, and 1 for part of
/// the time while calls are outstanding.
#[test]
fn one_grpc_connection_counts_at_most_one() {
    let server = Server::start(SERVICE_MS);
    let _load = server.load(1, 8, THINK_MS, 20.0);
    let points = measure(
        &server,
        Duration::from_millis(500),
        400,
        Duration::from_millis(5),
    );
    let s = stats(&points);
    eprintln!("1 connection, 8 callers: {s:?}");
    assert_eq!(s.connections, 1, "{s:?}");
    assert!(s.max_owed <= 1, "{s:?}");
    assert!(s.mean_truth > 1.0, "the load did not run: {s:?}");
    assert!(s.mean_owed >= 0.1, "{s:?}");
    // Never above the truth by more than the sampling skew allows.
    assert!(
        points.iter().all(|p| f64::from(p.owed) <= p.truth + 1.0),
        "{s:?}"
    );
}

/// With one caller per connection, the count follows the true in-flight closely; with
/// several, it is a lower bound, never above the number of connections.
#[test]
fn n_grpc_connections_follow_the_true_count() {
    const N: u32 = 6;
    let server = Server::start(SERVICE_MS);
    {
        let _load = server.load(N, 1, THINK_MS, 20.0);
        let points = measure(
            &server,
            Duration::from_millis(500),
            400,
            Duration::from_millis(5),
        );
        let s = stats(&points);
        eprintln!("{N} connections, 1 caller each: {s:?}");
        assert_eq!(s.connections, N, "{s:?}");
        assert!(s.mean_truth > 1.0, "the load did not run: {s:?}");
        assert!(s.mean_error.abs() <= 0.5, "{s:?}");
        assert!(s.mean_abs_error <= 0.75, "{s:?}");
        assert!(s.correlation >= 0.7, "{s:?}");
    }
    let _load = server.load(N, 4, THINK_MS, 20.0);
    let points = measure(
        &server,
        Duration::from_millis(500),
        400,
        Duration::from_millis(5),
    );
    let s = stats(&points);
    eprintln!("{N} connections, 4 callers each: {s:?}");
    assert!(s.max_owed <= N, "{s:?}");
    assert!(s.mean_owed <= s.mean_truth, "{s:?}");
    assert!(s.mean_owed >= 0.2 * s.mean_ceiling, "{s:?}");
}
