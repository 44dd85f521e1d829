//! Scenario: lame duck, end to end, under steady load through a real HAProxy.
//!
//! A real aggregator (500 ms cycles), three real HTTP backends that hold each request
//! for 20 ms, and for each a real `ballast-agent` that counts established TCP
//! connections to its backend as in flight (`--inflight tcp:PORT`) and answers
//! HAProxy's agent-check. Debian's HAProxy 2.6 balances round robin over them with
//! agent-checks and TCP health checks every 500 ms, `option http-server-close` (so a
//! server connection lives as long as its request and the in-flight count means
//! requests) and no `retries` or `redispatch`: nothing hides a failed request.
//!
//! While an open-loop client sends 200 requests/s (bounded: 34 s, 6800 requests):
//!
//! 1. `ballast-agent drain` on one node: within a few cycles every feed has it —
//!    HAProxy's server in DRAIN, the agent-check answering `drain`, weight 0 and
//!    `draining` in the API's weights and endpoints and in the routing store file,
//!    and DRAINING in the EDS an xDS client (a raw ADS stream) receives;
//! 2. its in-flight count, above 0 before the drain, falls to 0 and `status` says
//!    "safe to stop";
//! 3. its backend and agent stop; HAProxy marks the server down while it stays in
//!    DRAIN, and the other two keep being balanced (a silent lame duck is not
//!    "missing");
//! 4. backend and agent start again: the agent comes back drained (the drain file)
//!    and HAProxy sees the server up but still in DRAIN;
//! 5. `ballast-agent undrain`: the node returns at a cold-start weight that ramps up,
//!    and takes requests again.
//!
//! Every request of the run is answered 200, and no request due after HAProxy showed
//! the drain went to the drained backend until the undrain.
//!
//! Needs Debian's `haproxy` package; the test fails, naming it, when it is missing.

use ballast_lab::load::{self, LoadSpec, Mode};
use ballast_tests::harness::haproxy::OP_RUNNING;
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const SERVICE: &str = "duck";
const NODES: usize = 3;
/// How long a backend holds each request: with ~67 requests/s each, about 1.3 are in
/// flight, so the in-flight count is a real one that a drain must bring to 0.
const HOLD: Duration = Duration::from_millis(20);
/// The client's rate and the run's bounds.
const RATE: f64 = 200.0;
const RUN: Duration = Duration::from_secs(34);
/// Quiet period after the drain before stopping is safe: above HAProxy's 500 ms
/// agent-inter, as the operations guide asks.
const QUIET_MS: u64 = 1500;
/// The core's material change, in units of the mean weight: less is not published.
use ballast_balance::MATERIAL_CHANGE;

/// The health status of `addr` in the latest EDS response the xDS client got.
/// Panics, naming the client, if it stopped.
fn xds_health(eds: &EdsWatch, addr: SocketAddr) -> Result<HealthStatus, String> {
    let last = eds.latest().ok_or("no EDS response yet")?;
    let endpoints = last.endpoints()?;
    let code = endpoints
        .get(&addr.to_string())
        .ok_or_else(|| format!("{addr} not in the EDS: {:?}", endpoints.keys()))?
        .health_status;
    HealthStatus::try_from(code).map_err(|_| format!("unknown health status {code}"))
}

/// The agent-check's answer, read straight from the agent's port.
fn agent_check(addr: SocketAddr) -> Result<String, String> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    s.take(256)
        .read_to_string(&mut line)
        .map_err(|e| format!("read {addr}: {e}"))?;
    Ok(line)
}

/// `(weight, draining)` of `node` in the routing store file.
fn stored(agg: &Aggregator, node: &str) -> Result<(f64, bool), String> {
    let text = std::fs::read_to_string(agg.store_path()).map_err(|e| e.to_string())?;
    let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let e = &doc["services"][SERVICE]["endpoints"][node];
    match (e["weight"].as_f64(), e["draining"].as_bool()) {
        (Some(w), Some(d)) => Ok((w, d)),
        _ => Err(format!("no stored entry for {node}: {e}")),
    }
}

/// Every feed's view of `node`, in one line; Ok when all say drained.
fn all_feeds_drained(
    agg: &Aggregator,
    hap: &Haproxy,
    eds: &EdsWatch,
    node: &str,
    (addr, check): (SocketAddr, SocketAddr),
) -> Result<(), String> {
    let hap_state = hap.show_servers_state();
    let hap_ok = hap_state.get(node).is_some_and(|s| s.draining());
    let reply = agent_check(check)?;
    let w = agg.weights(SERVICE);
    let api = w.weights.get(node).map(|e| (e.weight, e.draining));
    let ep = agg
        .endpoints(SERVICE)
        .into_iter()
        .find(|e| e.node == node)
        .map(|e| (e.weight, e.state));
    let store = stored(agg, node);
    let xds = xds_health(eds, addr);
    let ok = hap_ok
        && xds == Ok(HealthStatus::Draining)
        && reply == "drain\n"
        && api == Some((0.0, true))
        && ep
            .as_ref()
            .is_some_and(|(w, s)| *w == 0.0 && *s == EndpointState::Draining)
        && store == Ok((0.0, true));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "HAProxy {:?}; agent-check {reply:?}; API weights {api:?}; endpoints {ep:?}; \
             store {store:?}; xDS {xds:?}",
            hap_state.get(node)
        ))
    }
}

#[test]
fn drain_stop_restart_undrain_loses_no_request() {
    require_haproxy();
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            xds: true,
            ..AggregatorOpts::default()
        },
    );
    let nodes: Vec<String> = (0..NODES).map(|i| format!("{SERVICE}-{i}")).collect();
    pki.issue_nodes(&nodes.iter().map(String::as_str).collect::<Vec<_>>());
    let mut backends: Vec<Option<Backend>> = nodes
        .iter()
        .map(|n| {
            Some(Backend::start_at(
                n,
                SocketAddr::from(([127, 0, 0, 1], 0)),
                HOLD,
            ))
        })
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().flatten().map(|b| b.addr).collect();
    let checks: Vec<SocketAddr> = nodes
        .iter()
        .map(|_| SocketAddr::from(([127, 0, 0, 1], free_tcp())))
        .collect();
    let mut agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut opts = AgentOpts::new(SERVICE, node)
                .agent_check(checks[i])
                .inflight_tcp(addrs[i].port())
                .drain_quiet_ms(QUIET_MS);
            // 10 in flight is fully busy: ~1.3 in flight is a load of ~0.13.
            opts.capacity = 10;
            opts.address = Some(addrs[i].to_string());
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    let servers: Vec<(&str, SocketAddr, SocketAddr)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), addrs[i], checks[i]))
        .collect();
    let hap = Haproxy::start(
        0,
        &servers,
        &HaproxyOpts {
            backend_lines: vec!["option http-server-close".into()],
            ..HaproxyOpts::default()
        },
    );
    assert!(
        !hap.config().contains("retries") && !hap.config().contains("redispatch"),
        "nothing may retry a failed request:\n{}",
        hap.config()
    );
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    let eds = EdsWatch::start(agg.xds(), SERVICE);
    wait_for(
        Duration::from_secs(10),
        "the xDS client to see every endpoint healthy",
        || {
            addrs
                .iter()
                .map(|a| match xds_health(&eds, *a) {
                    Ok(HealthStatus::Healthy) => Ok(()),
                    other => Err(format!("{a}: {other:?}")),
                })
                .collect::<Result<Vec<()>, String>>()
        },
    );
    wait_for(
        Duration::from_secs(10),
        "HAProxy to see every server ready",
        || {
            let s = hap.show_servers_state();
            if s.len() == NODES && s.values().all(|st| st.ready()) {
                Ok(())
            } else {
                Err(format!("{s:?}"))
            }
        },
    );

    let d = 1;
    let drained = nodes[d].clone();
    let load = load::spawn(LoadSpec {
        target: hap.frontend(),
        path: "/".into(),
        mode: Mode::Open { rate: RATE },
        duration: RUN,
        max_requests: (RATE * RUN.as_secs_f64()) as u64,
        timeout: Duration::from_secs(5),
        max_outstanding: 200,
    })
    .expect("the load generator starts");
    let t0 = load.started();
    let secs = |t: Instant| t.saturating_duration_since(t0).as_secs_f64();
    let backend = |b: &Option<Backend>| b.as_ref().map_or(0, Backend::requests);

    // Before the drain, the node has real work in flight now and then.
    std::thread::sleep(Duration::from_secs(3));
    let busy = wait_until(
        Duration::from_secs(5),
        "the node to count requests in flight",
        || agents[d].status().last_inflight.filter(|n| *n > 0),
    );
    eprintln!("{drained}: {busy} in flight before the drain");

    // 1. Drain: every feed has it within a few cycles.
    let asked = Instant::now();
    let resp = agents[d].drain();
    assert!(resp.status.as_ref().is_some_and(|s| s.draining), "{resp:?}");
    assert_eq!(
        resp.safe_to_stop,
        Some(false),
        "not safe the moment it drains"
    );
    let drain_seen = wait_for(
        Duration::from_secs(5),
        "HAProxy to put the drained server in DRAIN",
        || match hap.show_servers_state().get(&drained) {
            Some(s) if s.draining() => Ok(Instant::now()),
            other => Err(format!("{other:?}")),
        },
    );
    wait_for(
        Duration::from_secs(4),
        "every feed to show the drain",
        || all_feeds_drained(&agg, &hap, &eds, &drained, (addrs[d], checks[d])),
    );
    let feeds_took = asked.elapsed();
    eprintln!(
        "drain asked at {:.2} s; HAProxy in DRAIN after {:.2} s; every feed after {:.2} s",
        secs(asked),
        (drain_seen - asked).as_secs_f64(),
        feeds_took.as_secs_f64()
    );

    // 2. In flight falls to 0; `status` says when stopping is safe, with why.
    let safe = wait_for(
        Duration::from_secs(15),
        "status to say safe to stop",
        || {
            let r = agents[d].cli_json("status");
            match r.safe_to_stop {
                Some(true) => Ok(r),
                _ => Err(format!("{:?}", r.stop_reason)),
            }
        },
    );
    let st = safe.status.expect("status");
    assert!(
        st.drain_acknowledged && st.last_inflight == Some(0),
        "{st:?}"
    );
    let safe_at = Instant::now();
    assert!(
        safe_at - asked >= Duration::from_millis(QUIET_MS),
        "safe only after the quiet period"
    );
    let human = agents[d].cli(&["status"]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("safe to stop: drained, acknowledged by the aggregator, 0 in flight for"),
        "{text}"
    );
    eprintln!(
        "safe to stop {:.2} s after the drain:\n{text}",
        (safe_at - asked).as_secs_f64()
    );

    // 3. Stop the service and its agent. HAProxy's health check marks the server
    //    down; it stays in DRAIN, and the aggregator keeps it at weight 0.
    let served_before_stop = backend(&backends[d]);
    drop(backends[d].take());
    let (status, killed) = agents[d].stop(Duration::from_secs(5));
    assert!(status.success() && !killed, "agent stop: {status}");
    let at_stop = agg.service(SERVICE).stats;
    let skipped_missing = at_stop.skipped.get("missing").copied();
    wait_for(
        Duration::from_secs(10),
        "HAProxy to mark the stopped server down",
        || match hap.show_servers_state().get(&drained) {
            Some(s) if s.op_state != OP_RUNNING && s.draining() => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    // Past the aggregator's 3 s staleness limit, with cycles run since: the silent
    // node is not missing, and the others go on being balanced.
    let detail = wait_for(
        Duration::from_secs(15),
        "cycles past the stopped node's staleness",
        || {
            let d = agg.service(SERVICE);
            let age = agg
                .endpoints(SERVICE)
                .into_iter()
                .find(|e| e.node == drained)
                .and_then(|e| e.report_age_ms)
                .unwrap_or(0);
            if age > 3000 && d.stats.updates >= at_stop.updates + 3 {
                Ok(d)
            } else {
                Err(format!("report age {age} ms, {:?}", d.stats))
            }
        },
    );
    assert_eq!(
        detail.stats.skipped.get("missing").copied(),
        skipped_missing,
        "a stopped lame duck made cycles skip: {:?}",
        detail.last_skip
    );
    // Nor is it counted as missing at all (one missing endpoint alone would not skip a
    // cycle, so the skips above say less than this).
    assert_eq!(
        detail.stats.missing_share, 0.0,
        "a stopped lame duck counted as missing"
    );
    assert_eq!(stored(&agg, &drained), Ok((0.0, true)));
    assert!(agg.weights(SERVICE).weights[&drained].draining);

    // 4. Start both again: the agent comes back drained, HAProxy sees the server up
    //    but keeps it in DRAIN.
    backends[d] = Some(Backend::start_at(&drained, addrs[d], HOLD));
    agents[d].restart(&pki, &agg);
    let st = agents[d].status();
    assert!(st.draining, "a restarted agent keeps the drain: {st:?}");
    assert_eq!(agent_check(checks[d]).as_deref(), Ok("drain\n"));
    wait_for(
        Duration::from_secs(10),
        "HAProxy to see the restarted server up",
        || match hap.show_servers_state().get(&drained) {
            Some(s) if s.op_state == OP_RUNNING && s.draining() => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    agents[d].wait_weight(Duration::from_secs(10));
    assert!(agg.weights(SERVICE).weights[&drained].draining);

    // 5. Undrain: back through the cold-start ramp.
    let undrain_asked = Instant::now();
    assert_eq!(
        backend(&backends[d]),
        0,
        "the restarted backend got requests while drained"
    );
    let before = agg.weights(SERVICE);
    assert!(before.weights[&drained].draining);
    let resp = agents[d].undrain();
    assert!(
        resp.status.as_ref().is_some_and(|s| !s.draining),
        "{resp:?}"
    );
    // Follow the publications (each a new version: the version moves by one with every
    // material change, at most once a cycle): the last one with the node draining, then
    // the first without. The poll is fast beside the 500 ms cycle, so it sees each one.
    let mut last_drained_version = before.version;
    let first = wait_for_polling(
        Duration::from_secs(5),
        Duration::from_millis(10),
        "the undrain to be published",
        || {
            let set = agg.weights(SERVICE);
            match set.weights.get(&drained) {
                Some(e) if !e.draining && e.weight > 0.0 => Ok(set),
                Some(e) if e.draining => {
                    last_drained_version = last_drained_version.max(set.version);
                    Err(format!("still draining at version {}", set.version))
                }
                other => Err(format!("{other:?}")),
            }
        },
    );
    // The node restarts at the cold-start weight, a tenth of the others' mean. Each
    // cycle since then grows it by `max_growth` (1.5) at most, and the others shrink
    // to make room, which the unit test of the ramp bounds by another 1.5: so against
    // the others' mean it is at most 0.1 × 2.25 a cycle. Cycles that publish nothing
    // moved no weight by the material change (0.01 of the mean) since the last
    // version, so each version passed allows one step of (w + 0.01) × 2.25. A jump
    // back to its old share (1.0) is far outside while at most two versions passed
    // (0.58); past that the bound would admit it, so the poll must not have
    // missed more. At 10 ms beside a 500 ms cycle that takes a stall of the test over
    // a second.
    let steps = first.version.saturating_sub(last_drained_version).max(1);
    assert!(
        steps <= 2,
        "the poll missed the undrain's first publications: it saw version \
         {last_drained_version} draining, then version {} undrained, too far apart to \
         tell a ramp from a jump",
        first.version
    );
    let w = first.weights[&drained].weight;
    let others: Vec<f64> = first
        .weights
        .iter()
        .filter(|(n, _)| **n != drained)
        .map(|(_, e)| e.weight)
        .collect();
    let ratio = w / (others.iter().sum::<f64>() / others.len() as f64);
    // The aggregator runs with the shipped parameters.
    let cold_start = ballast_balance::Params::default().cold_start_weight;
    let limit = (0..steps).fold(cold_start, |w, _| (w + MATERIAL_CHANGE) * 2.25);
    assert!(
        ratio <= limit + 0.005,
        "the node came back at {w:.3} ({ratio:.3} of the others' mean) {steps} version(s) \
         after the last drained publication, not from the cold-start weight \
         ({cold_start} of the mean, at most {limit:.3} by then)"
    );
    eprintln!(
        "undrained: first published weight {w:.3}, {ratio:.3} of the others' mean, \
         {steps} version(s) after the last drained publication"
    );
    wait_for(
        Duration::from_secs(5),
        "the xDS client to see it healthy",
        || match xds_health(&eds, addrs[d]) {
            Ok(HealthStatus::Healthy) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    wait_for(
        Duration::from_secs(5),
        "HAProxy to take the server back",
        || match hap.show_servers_state().get(&drained) {
            Some(s) if s.ready() && s.uweight > 0 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let ramped = wait_for(Duration::from_secs(15), "the weight to ramp up", || {
        let w = agg.weights(SERVICE).weights[&drained].weight;
        if w >= 0.5 {
            Ok(w)
        } else {
            Err(format!("weight {w}"))
        }
    });
    eprintln!(
        "undrained at {:.2} s: first weight {w:.3}, {ramped:.3} {:.1} s later",
        secs(undrain_asked),
        undrain_asked.elapsed().as_secs_f64()
    );
    let sequence_done = Instant::now();

    // The whole run: no failure, and nothing for the drained node while drained.
    let run = load.join().expect("the load run");
    assert!(
        secs(sequence_done) + 2.0 < RUN.as_secs_f64(),
        "the sequence ({:.1} s) did not fit in the run ({RUN:?}): lengthen RUN",
        secs(sequence_done)
    );
    let summary = load::summarize(&run.outcomes);
    eprintln!(
        "{} requests: {} ok, {} errors {:?}; p99 {:.1} ms, max {:.1} ms; by backend {:?}",
        summary.requests,
        summary.ok,
        summary.errors,
        summary.errors_by_kind,
        summary.p99_ms,
        summary.max_ms,
        summary.by_backend
    );
    assert_eq!(
        summary.requests,
        (RATE * RUN.as_secs_f64()) as u64,
        "the client did not send the whole run"
    );
    let failed: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.failure.is_some())
        .take(10)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed; first: {failed:?}",
        summary.errors,
        summary.requests
    );
    // Due times count from the run's own start.
    let at = |t: Instant| t.saturating_duration_since(run.started).as_secs_f64();
    let (from, to) = (at(drain_seen), at(undrain_asked));
    let leaked: Vec<f64> = run
        .outcomes
        .iter()
        .filter(|o| o.backend.as_deref() == Some(drained.as_str()) && o.at >= from && o.at < to)
        .map(|o| o.at)
        .collect();
    assert!(
        leaked.is_empty(),
        "{} requests due between the drain ({from:.2} s) and the undrain ({to:.2} s) went to \
         {drained}, at {leaked:?}",
        leaked.len()
    );
    let after = run
        .outcomes
        .iter()
        .filter(|o| o.backend.as_deref() == Some(drained.as_str()) && o.at >= to)
        .count();
    assert!(after > 0, "{drained} took no request after the undrain");
    eprintln!(
        "{drained}: {served_before_stop} requests before the stop, {after} after the undrain, \
         none in between"
    );
}
