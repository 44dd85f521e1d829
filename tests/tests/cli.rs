//! Scenario: an operator at the agent's CLI.
//!
//! - `sample --json` measures once without a daemon and prints finite figures, the
//!   host's CPU at least the core this test keeps busy meanwhile;
//! - `check` validates flags and TLS files;
//! - `status` talks to the running daemon over its control socket;
//! - `drain` gets the node weight 0 within two cycles, the daemon learns the drain was
//!   acknowledged and, once nothing is in flight, that it is safe to stop;
//! - `undrain` brings it back with a weight above 0.

use ballast_tests::*;
use std::time::{Duration, Instant};

const SERVICE: &str = "api";

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn finite(v: &serde_json::Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"));
    assert!(x.is_finite(), "{key} = {x} in {v}");
    x
}

#[test]
fn sample_and_check_need_no_daemon() {
    // Host CPU only, while a thread of this test keeps one core busy: the sample must
    // see at least half of that core, so that a sampler stuck at 0 fails.
    let cores = std::fs::read_to_string("/proc/stat")
        .expect("/proc/stat")
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count();
    assert!(cores > 0, "/proc/stat lists no CPU");
    let spinning = std::sync::atomic::AtomicBool::new(true);
    let mut cmd = command(AGENT_BIN);
    cmd.args(["sample", "--json", "--window", "0.2", "--cpu", "host"]);
    let started = Instant::now();
    let out = std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut x = 0u64;
            while spinning.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        });
        let out = run_bounded(cmd, Duration::from_secs(20));
        spinning.store(false, std::sync::atomic::Ordering::Relaxed);
        out
    });
    assert!(out.status.success(), "sample failed: {out:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "the CPU delta needs the whole window"
    );
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim())
        .unwrap_or_else(|e| panic!("sample --json printed no JSON: {e}: {}", stdout(&out)));
    let cpu = finite(&v, "cpu");
    let load = finite(&v, "load");
    assert!(
        cpu >= 0.5 / cores as f64 && load >= cpu - 1e-9,
        "host CPU {cpu:.3} while one of {cores} cores was kept busy: {v}"
    );

    // Host CPU and the synthetic in-flight model: load = max(cpu, inflight/capacity).
    let mut cmd = command(AGENT_BIN);
    cmd.args([
        "sample",
        "--json",
        "--window",
        "0.2",
        "--cpu",
        "host",
        "--inflight",
        "synthetic:speed=1,offered=0.6,noise=0,seed=1",
        "--capacity",
        "200",
    ]);
    let out = run_bounded(cmd, Duration::from_secs(20));
    assert!(out.status.success(), "sample failed: {out:?}");
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("JSON");
    let cpu = finite(&v, "cpu");
    let load = finite(&v, "load");
    assert_eq!(v["inflight"], 120, "0.6 of capacity 200: {v}");
    assert_eq!(v["capacity"], 200, "{v}");
    assert!(
        (load - cpu.max(0.6)).abs() < 1e-6,
        "load {load} is not max(cpu {cpu}, 0.6): {v}"
    );
    assert!(
        v["sources"].as_str().unwrap_or("").contains("synthetic"),
        "{v}"
    );

    // The shipped TCP source with no capacity: a connection whose request the service
    // has not answered counts, an idle one does not, and the JSON and the human form
    // both say how the count was made.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = listener.local_addr().expect("address").port();
    let mut busy = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _idle = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    std::io::Write::write_all(&mut busy, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let (_a, _) = listener.accept().expect("accept");
    let (_b, _) = listener.accept().expect("accept");
    let tcp = format!("tcp:{port}");
    let mut cmd = command(AGENT_BIN);
    cmd.args([
        "sample",
        "--json",
        "--window",
        "0.1",
        "--cpu",
        "none",
        "--inflight",
        &tcp,
    ]);
    let out = run_bounded(cmd, Duration::from_secs(20));
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("JSON");
    assert_eq!(
        v["inflight"], 1,
        "one of two connections owes a response: {v}"
    );
    assert_eq!(v["capacity"], 0, "no capacity by default: {v}");
    assert_eq!(
        v["inflight_detail"], "1 of 2 connections owe a response",
        "{v}"
    );
    let mut cmd = command(AGENT_BIN);
    cmd.args([
        "sample",
        "--window",
        "0.1",
        "--cpu",
        "none",
        "--inflight",
        &tcp,
    ]);
    let out = run_bounded(cmd, Duration::from_secs(20));
    let text = stdout(&out);
    assert!(
        text.contains("1 of 2 connections owe a response") && text.contains("aggregator adds"),
        "{text}"
    );

    // The human format says the same in words.
    let mut cmd = command(AGENT_BIN);
    cmd.args(["sample", "--window", "0.1", "--cpu", "none"]);
    let out = run_bounded(cmd, Duration::from_secs(20));
    assert!(out.status.success(), "{out:?}");
    assert!(stdout(&out).contains("load"), "{}", stdout(&out));

    // `check` accepts a complete configuration and refuses a bad one.
    let pki = Pki::new();
    let tls = pki.node_tls_dir("checked");
    let base = |aggregator: &str| {
        let mut cmd = command(AGENT_BIN);
        cmd.args(["check", "--service", SERVICE, "--node", "checked"])
            .args(["--address", "127.0.0.1:8080", "--aggregator", aggregator])
            .args(["--cpu", "none", "--inflight", "synthetic"])
            .arg("--tls-dir")
            .arg(&tls);
        cmd
    };
    let out = run_bounded(base("127.0.0.1:7400"), Duration::from_secs(20));
    assert!(out.status.success(), "check refused a good config: {out:?}");
    assert!(stdout(&out).starts_with("ok:"), "{}", stdout(&out));
    let out = run_bounded(base("no-port"), Duration::from_secs(20));
    assert!(
        !out.status.success(),
        "check accepted aggregator \"no-port\""
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no-port"),
        "the error names the bad value: {out:?}"
    );
}

#[test]
fn status_drain_and_undrain_through_the_daemon() {
    let pki = Pki::new();
    let opts = AggregatorOpts::default().grace_ms(500);
    let (cycle_ms, interval_ms) = (opts.cycle_ms, u64::from(opts.report_interval_ms));
    let agg = Aggregator::start(&pki, opts);
    let agents = start_fleet(&pki, &agg, SERVICE, 4, &[1.0]);
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    let node = &agents[0];
    let name = node.node().to_string();
    // Let cycles run until everyone is an established, serving endpoint whose reported
    // load the publication carries: a node registered but not yet published with a
    // report is served too, at load 0.
    wait_for(
        Duration::from_secs(15),
        "all four serving and reported",
        || {
            let eps = agg.try_endpoints(SERVICE)?;
            let ready = eps
                .iter()
                .filter(|e| e.state == EndpointState::Serving && e.report_age_ms.is_some())
                .filter(|e| e.load > 0.1)
                .count();
            if ready == 4 {
                Ok(())
            } else {
                Err(format!("{eps:?}"))
            }
        },
    );

    // status --json: connected, with a weight.
    let st = node.cli_json("status");
    let s = st.status.expect("status");
    assert_eq!(s.node, name);
    assert_eq!(s.service, SERVICE);
    assert_eq!(
        s.connected_to.as_deref(),
        Some(agg.quic_addr().to_string().as_str())
    );
    let w = s.weight.expect("a weight");
    assert!(w.is_finite() && w > 0.0, "weight {w}");
    assert!(s.reports_sent > 0 && !s.draining, "{s:?}");
    assert_eq!(st.safe_to_stop, Some(false));
    // The reply also says how the aggregator sees the node: the load it steers by and
    // whether it trusts the in-flight count (these agents' synthetic counts follow
    // their weights, so it does).
    // The agent hears that view in the reply to its next report after the publication.
    let raw = wait_for(
        Duration::from_secs(15),
        "the aggregator's view in the agent's status",
        || {
            let out = node.cli(&["status", "--json"]);
            if !out.status.success() {
                return Err(format!("{out:?}"));
            }
            let raw: serde_json::Value = serde_json::from_str(stdout(&out).trim())
                .map_err(|e| format!("status --json printed no JSON: {e}: {}", stdout(&out)))?;
            if raw["status"]["aggregator_load"]
                .as_f64()
                .is_some_and(|l| l > 0.0)
            {
                Ok(raw)
            } else {
                Err(raw.to_string())
            }
        },
    );
    let status = &raw["status"];
    assert_eq!(
        status["inflight_trusted"],
        serde_json::Value::Bool(true),
        "{raw}"
    );
    let seen = finite(status, "aggregator_load");
    assert!(
        seen > 0.1 && seen < 2.0,
        "the aggregator's load {seen}: {raw}"
    );
    // The human form names the aggregator, the weight and the aggregator's view.
    let out = node.cli(&["status"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(
        text.contains(&agg.quic_addr().to_string())
            && text.contains("weight")
            && text.contains("in-flight count trusted"),
        "{text}"
    );

    // drain: weight 0 and state draining by the first cycle after the agent's next
    // report. Counted in the aggregator's cycles, not in wall time, so that a loaded
    // machine that runs everything late does not fail it: the report interval is one
    // cycle here, so the drain reaches the aggregator within one or two cycles and is
    // published at the next; one cycle more for a report sent just before the drain.
    let cycles_before = agg.service(SERVICE).stats.cycles;
    let drained = node.drain();
    let since = Instant::now();
    assert!(
        drained.status.as_ref().is_some_and(|s| s.draining),
        "{drained:?}"
    );
    let max_cycles = 2 + interval_ms.div_ceil(cycle_ms) + 1;
    let (ep, cycles) = wait_for(Duration::from_secs(15), "weight 0 in the API", || {
        let cycles = agg.service(SERVICE).stats.cycles;
        let eps = agg.endpoints(SERVICE);
        let e = eps
            .iter()
            .find(|e| e.node == name)
            .cloned()
            .expect("endpoint");
        if e.state == EndpointState::Draining && e.weight == 0.0 {
            Ok((e, cycles - cycles_before))
        } else {
            Err(format!(
                "{:?} weight {} after {} cycles",
                e.state,
                e.weight,
                cycles - cycles_before
            ))
        }
    });
    let took = since.elapsed();
    assert!(
        cycles <= max_cycles,
        "weight 0 took {cycles} cycles ({took:?}), more than {max_cycles}"
    );
    eprintln!(
        "drained to weight 0 in {cycles} cycles, {took:?} ({:?})",
        ep.state
    );
    // The published set (what feeds serve) takes the drain at the next cycle.
    let entry = wait_for(
        Duration::from_secs(2),
        "the published weights show the drain",
        || {
            let ws = agg.weights(SERVICE);
            let entry = ws.weights[&name].clone();
            if entry.draining && entry.weight == 0.0 {
                Ok(entry)
            } else {
                Err(format!("{entry:?}"))
            }
        },
    );
    assert_eq!(entry.haproxy_percent, 0, "{entry:?}");

    // The others share the traffic: after a cycle, mean weight 1 among them.
    wait_for(Duration::from_secs(5), "the rest renormalised", || {
        let ws = agg.weights(SERVICE);
        let rest: Vec<f64> = ws
            .weights
            .iter()
            .filter(|(n, _)| **n != name)
            .map(|(_, w)| w.weight)
            .collect();
        let mean = rest.iter().sum::<f64>() / rest.len() as f64;
        if (mean - 1.0).abs() < 0.02 && rest.iter().all(|w| *w > 0.0) {
            Ok(())
        } else {
            Err(format!("weights of the others {rest:?}"))
        }
    });

    // The agent learns the drain was acknowledged, then, with nothing in flight at
    // weight 0, that stopping is safe.
    let resp = wait_for(Duration::from_secs(10), "safe_to_stop", || {
        let r = node.cli_json("status");
        let s = r.status.clone().expect("status");
        if s.drain_acknowledged && r.safe_to_stop == Some(true) {
            Ok(r)
        } else {
            Err(format!("{r:?}"))
        }
    });
    let s = resp.status.expect("status");
    assert_eq!(s.weight, Some(0.0), "{s:?}");
    assert_eq!(s.last_inflight, Some(0), "{s:?}");
    let out = node.cli(&["status"]);
    assert!(stdout(&out).contains("safe to stop"), "{}", stdout(&out));

    // undrain: back to warming or serving with a weight above 0, here and there.
    let resp = node.undrain();
    assert!(
        resp.status.as_ref().is_some_and(|s| !s.draining),
        "{resp:?}"
    );
    wait_for(Duration::from_secs(10), "back in rotation", || {
        let eps = agg.endpoints(SERVICE);
        let e = eps
            .iter()
            .find(|e| e.node == name)
            .cloned()
            .expect("endpoint");
        let s = node.status();
        let ok = matches!(e.state, EndpointState::Serving | EndpointState::Warming)
            && e.weight > 0.0
            && s.weight.is_some_and(|w| w > 0.0)
            && !s.drain_acknowledged;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "API {:?} weight {}; agent {s:?}",
                e.state, e.weight
            ))
        }
    });
    let r = node.cli_json("status");
    assert_eq!(r.safe_to_stop, Some(false), "{r:?}");
    assert!(!agg.weights(SERVICE).weights[&name].draining);
}

#[test]
fn status_without_a_daemon_fails_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = command(AGENT_BIN);
    cmd.args(["status", "--json", "--control"])
        .arg(dir.path().join("nobody.sock"));
    let out = run_bounded(cmd, Duration::from_secs(20));
    assert!(!out.status.success(), "status without a daemon succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nobody.sock"),
        "the error names the socket: {err}"
    );
}
