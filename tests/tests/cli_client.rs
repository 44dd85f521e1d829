//! Scenario: an operator reads a running aggregator with `ballast-aggregator`'s client
//! commands.
//!
//! A real aggregator (400 ms cycles) and three real agents of different speeds, so the
//! weights move while the controllers converge. The real binary runs with
//! `--url http://<the API>`:
//!
//! - `services`, `endpoints NAME` and `service NAME` print tables whose rows are the
//!   API's figures, as of the same publication (the API is read before and after the
//!   command; when both reads agree, the command saw that publication too);
//! - with `--json` they print the API's JSON itself;
//! - `BALLAST_URL` stands in for `--url`;
//! - `watch NAME --json` prints one weight set per line, at least two versions,
//!   increasing; `watch NAME` prints `version=… cycle=… node=weight…` lines;
//! - an unknown service, an aggregator nobody listens for, and an answer that is not
//!   JSON each exit non-zero with a message saying so.

use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SERVICE: &str = "ops";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];
const RUN: Duration = Duration::from_secs(20);

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `ballast-aggregator ARGS --url URL`.
fn cli(url: &str, args: &[&str]) -> Output {
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(args).args(["--url", url]);
    run_bounded(cmd, RUN)
}

/// Runs the command and reads `path` from the API before and after, until both reads
/// agree: the command's output then comes from that same publication. Returns the
/// output and the API's JSON.
fn consistent(
    agg: &Aggregator,
    url: &str,
    args: &[&str],
    path: &str,
) -> (Output, serde_json::Value) {
    wait_for(
        Duration::from_secs(20),
        "a run within one publication",
        || {
            let before: serde_json::Value = agg.try_get_json(path)?;
            let out = cli(url, args);
            let after: serde_json::Value = agg.try_get_json(path)?;
            if !out.status.success() {
                panic!("{args:?} failed: {out:?}");
            }
            if before == after {
                Ok((out, after))
            } else {
                Err("the API changed during the run".to_string())
            }
        },
    )
}

/// The data rows of a table, split on whitespace, after checking its header.
fn rows(table: &str, header: &[&str]) -> Vec<Vec<String>> {
    let mut lines = table.lines();
    let first = lines.next().unwrap_or_default();
    let mut at = 0;
    for h in header {
        let i = first[at..]
            .find(h)
            .unwrap_or_else(|| panic!("no column {h:?} in order in {first:?}"));
        at += i + h.len();
    }
    lines
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

fn f3(v: f64) -> String {
    format!("{v:.3}")
}

fn start() -> (Pki, Aggregator, Vec<Agent>, String) {
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .cycle_ms(400)
            .report_interval_ms(400)
            .grace_ms(1200),
    );
    let agents = start_fleet(&pki, &agg, SERVICE, SPEEDS.len(), &SPEEDS);
    wait_for(Duration::from_secs(20), "three endpoints serving", || {
        let eps: Vec<EndpointView> =
            agg.try_get_json(&format!("/v1/services/{SERVICE}/endpoints"))?;
        let serving = eps
            .iter()
            .filter(|e| e.state == EndpointState::Serving)
            .count();
        if serving == SPEEDS.len() {
            Ok(())
        } else {
            Err(format!("{eps:?}"))
        }
    });
    let url = format!("http://{}", agg.http_addr());
    (pki, agg, agents, url)
}

#[test]
fn tables_and_json_match_the_api() {
    let (_pki, agg, _agents, url) = start();

    // services: one row per service with the API's figures.
    let (out, api) = consistent(&agg, &url, &["services"], "/v1/services");
    let api: Vec<ServiceSummary> = serde_json::from_value(api).unwrap();
    let table = stdout(&out);
    let got = rows(
        &table,
        &[
            "NAME",
            "ENDPOINTS",
            "AVG LOAD",
            "MAX/AVG",
            "P95/AVG",
            "MISSING",
            "VERSION",
            "LAST SKIP",
        ],
    );
    assert_eq!(got.len(), api.len(), "{table}");
    let s = api.iter().find(|s| s.name == SERVICE).unwrap();
    let row = got
        .iter()
        .find(|r| r[0] == SERVICE)
        .unwrap_or_else(|| panic!("{table}"));
    assert_eq!(
        row[1..7],
        [
            s.endpoints.to_string(),
            f3(s.avg),
            f3(s.max_over_avg),
            f3(s.p95_over_avg),
            format!("{:.0}%", s.missing_share * 100.0),
            s.version.to_string(),
        ],
        "{table}"
    );

    // endpoints NAME: one row per node.
    let path = format!("/v1/services/{SERVICE}/endpoints");
    let (out, api) = consistent(&agg, &url, &["endpoints", SERVICE], &path);
    let api: Vec<EndpointView> = serde_json::from_value(api).unwrap();
    let table = stdout(&out);
    let got = rows(
        &table,
        &[
            "NODE",
            "ADDRESS",
            "ZONE",
            "STATE",
            "LOAD",
            "WEIGHT",
            "REPORT AGE",
        ],
    );
    assert_eq!(got.len(), SPEEDS.len(), "{table}");
    for e in &api {
        let row = got
            .iter()
            .find(|r| r[0] == e.node)
            .unwrap_or_else(|| panic!("no {} in {table}", e.node));
        assert_eq!(row[1], e.address, "{table}");
        assert_eq!(row[3], "serving", "{table}");
        assert_eq!(row[4], f3(e.load), "{table}");
        assert_eq!(row[5], f3(e.weight), "{table}");
        assert_ne!(row[6], "-", "a serving endpoint has a report age: {table}");
    }

    // service NAME: the summary and the recent cycles.
    let path = format!("/v1/services/{SERVICE}");
    let (out, api) = consistent(&agg, &url, &["service", SERVICE], &path);
    let api: ServiceDetail = serde_json::from_value(api).unwrap();
    let text = stdout(&out);
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {key:?} in {text}"))
            .to_string()
    };
    assert_eq!(field("Name"), SERVICE);
    assert!(
        field("Version").starts_with(&format!(
            "{} (weights of cycle {})",
            api.version, api.weights_cycle
        )),
        "{text}"
    );
    assert!(
        field("Cycles").starts_with(&api.stats.cycles.to_string()),
        "{text}"
    );
    assert_eq!(field("Endpoints"), "serving=3", "{text}");
    assert_eq!(field("Avg load"), f3(api.stats.spread.avg), "{text}");
    let recent = text
        .split_once("Recent cycles:\n")
        .unwrap_or_else(|| panic!("no recent cycles in {text}"))
        .1;
    let cycles = rows(
        recent,
        &["CYCLE", "AVG LOAD", "MAX/AVG", "P95/AVG", "SKIPPED"],
    );
    let last = api.history.last().expect("a history");
    assert_eq!(
        cycles.last().map(|r| r[0].clone()),
        Some(last.cycle.to_string()),
        "{text}"
    );
    assert_eq!(cycles.len(), api.history.len().min(10), "{text}");

    // --json: the API's own document.
    for (args, path) in [
        (vec!["services", "--json"], "/v1/services".to_string()),
        (
            vec!["service", SERVICE, "--json"],
            format!("/v1/services/{SERVICE}"),
        ),
        (
            vec!["endpoints", SERVICE, "--json"],
            format!("/v1/services/{SERVICE}/endpoints"),
        ),
    ] {
        let (out, api) = consistent(&agg, &url, &args, &path);
        let printed: serde_json::Value = serde_json::from_str(stdout(&out).trim())
            .unwrap_or_else(|e| panic!("{args:?} printed no JSON: {e}: {}", stdout(&out)));
        assert_eq!(printed, api, "{args:?}");
        assert_eq!(
            stdout(&out).trim().lines().count(),
            1,
            "one document: {args:?}"
        );
    }

    // BALLAST_URL instead of --url.
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(["services"]).env("BALLAST_URL", &url);
    let out = run_bounded(cmd, RUN);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).lines().any(|l| l.starts_with(SERVICE)),
        "{out:?}"
    );
}

/// Spawns `ballast-aggregator ARGS`, its stdout read line by line on a thread.
fn spawn_lines(args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start ballast-aggregator watch");
    let out = child.stdout.take().expect("its stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Lines until `enough` says so, or a panic at the deadline.
fn lines_until(
    rx: &mpsc::Receiver<String>,
    within: Duration,
    what: &str,
    mut enough: impl FnMut(&[String]) -> bool,
) -> Vec<String> {
    let deadline = Instant::now() + within;
    let mut lines = Vec::new();
    while !enough(&lines) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(e) => panic!("{what}: {e:?} after {lines:?}"),
        }
    }
    lines
}

#[test]
fn watch_prints_each_new_version() {
    let (_pki, _agg, _agents, url) = start();

    let (mut child, rx) = spawn_lines(&["watch", SERVICE, "--json", "--url", &url]);
    let lines = lines_until(&rx, Duration::from_secs(30), "two versions", |lines| {
        lines.len() >= 2
    });
    let _ = child.kill();
    let _ = child.wait();
    let sets: Vec<WeightSet> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    for s in &sets {
        assert_eq!(s.service, SERVICE);
        assert_eq!(s.weights.len(), SPEEDS.len(), "{s:?}");
    }
    assert!(sets[1].version > sets[0].version, "{lines:?}");

    let (mut child, rx) = spawn_lines(&["watch", SERVICE, "--url", &url]);
    let lines = lines_until(&rx, Duration::from_secs(30), "two human lines", |lines| {
        lines.len() >= 2
    });
    let _ = child.kill();
    let _ = child.wait();
    let mut versions = Vec::new();
    for l in &lines {
        let mut words = l.split(' ');
        let version: u64 = words
            .next()
            .and_then(|w| w.strip_prefix("version="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{l}"));
        assert!(words.next().is_some_and(|w| w.starts_with("cycle=")), "{l}");
        let pairs: Vec<&str> = words.collect();
        assert_eq!(pairs.len(), SPEEDS.len(), "{l}");
        for p in pairs {
            let (node, w) = p.split_once('=').unwrap_or_else(|| panic!("{l}"));
            assert!(node.starts_with(SERVICE), "{l}");
            assert!(w.parse::<f64>().is_ok_and(|w| w > 0.0), "{l}");
        }
        versions.push(version);
    }
    assert!(versions[1] > versions[0], "{lines:?}");
}

#[test]
fn errors_are_clear_and_exit_non_zero() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let url = format!("http://{}", agg.http_addr());

    for args in [
        ["service", "nosuch"],
        ["endpoints", "nosuch"],
        ["watch", "nosuch"],
    ] {
        let out = cli(&url, &args);
        assert!(!out.status.success(), "{args:?}: {out:?}");
        assert!(
            stderr(&out).contains("unknown service \"nosuch\""),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{args:?}: {out:?}");
    }

    // Nobody listens on this port.
    let dead = format!("http://127.0.0.1:{}", free_tcp());
    for args in [&["services"][..], &["watch", SERVICE][..]] {
        let out = cli(&dead, args);
        assert!(!out.status.success(), "{out:?}");
        assert!(
            stderr(&out).contains(&format!("cannot reach the aggregator at {dead}: ")),
            "{}",
            stderr(&out)
        );
    }

    // A server that answers 200 with something that is not JSON.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake = format!("http://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!")
            .unwrap();
    });
    let out = cli(&fake, &["services"]);
    server.join().unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr(&out).contains(&format!("bad JSON from the aggregator at {fake}")),
        "{}",
        stderr(&out)
    );
}
