//! Scenario: an operator drains a node whose agent is wedged, from the control plane,
//! while real load balancers carry live traffic to it.
//!
//! One aggregator (500 ms cycles) publishes two services:
//! - `web`: three HTTP backends behind Debian's HAProxy 2.6 (round robin, `weight 100`),
//!   whose agent-checks go to the aggregator (`--agent-check`), each server named by
//!   `agent-send "web NODE\n"`, not to the nodes' agents;
//! - `api`: three gRPC backends that a proxyless grpcio client reaches through the
//!   aggregator's xDS.
//!
//! Each backend has its agent. Traffic runs the whole time: an HTTP client through
//! HAProxy (about 150 requests a second) and the gRPC client (calls one after another).
//!
//! 1. The agents of `web-2` and `api-2` are frozen (SIGSTOP): their nodes still serve,
//!    but nothing of theirs answers. `ballast-aggregator drain` takes both out.
//!    Within two cycles HAProxy shows `web-2` in DRAIN and no request sent from then
//!    on reaches `web-2` or `api-2`: the backends' own counters stand still, and no
//!    request failed at any point.
//! 2. The aggregator restarts. HAProxy, which cannot reach the agent-check port
//!    meanwhile, keeps `web-2` in DRAIN; the restarted aggregator, which restores the
//!    drain from its routing store, answers `drain` again. Still no request reaches the
//!    drained nodes and none fails.
//! 3. `undrain` (the agents still frozen): within two cycles both nodes take requests
//!    again.
//!
//! Needs Debian's `haproxy` and grpcio in `BALLAST_PYTHON`; fails, naming them, when
//! they are missing.

use ballast_tests::harness::api::{parse_metrics, sum_samples};
use ballast_tests::harness::grpc::{require_grpcio, Backends, XdsClient};
use ballast_tests::harness::haproxy::{request, require_haproxy};
use ballast_tests::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CYCLE_MS: u64 = 500;
/// How soon a drain must hold in every load balancer: two cycles.
const WITHIN: Duration = Duration::from_millis(2 * CYCLE_MS);
/// The HTTP client's pace.
const HTTP_GAP: Duration = Duration::from_millis(7);
/// The most requests the HTTP client sends, whatever happens.
const HTTP_MAX: usize = 20_000;
/// The gRPC client's pace: one round of calls every this long at most.
const GRPC_ROUND: Duration = Duration::from_millis(250);
/// The most gRPC rounds, whatever happens (about ten minutes of them).
const GRPC_MAX_ROUNDS: usize = 2400;

/// One request the HTTP client made: when it was sent, and who answered or why not.
struct Sent {
    at: Instant,
    answer: Result<String, String>,
}

/// One round of gRPC calls: when it started and ended, and what it gave.
struct GrpcRound {
    from: Instant,
    to: Instant,
    counts: BTreeMap<String, u32>,
    errors: BTreeMap<String, u32>,
}

/// The requests sent at or after `from` that `node` answered, and every failure.
fn reached(sent: &[Sent], node: &str, from: Instant) -> (usize, Vec<String>) {
    let to_node = sent
        .iter()
        .filter(|s| s.at >= from && s.answer.as_deref() == Ok(node))
        .count();
    let failed = sent
        .iter()
        .filter_map(|s| s.answer.as_ref().err().cloned())
        .collect();
    (to_node, failed)
}

/// The calls of rounds started at or after `from` that `node` answered.
fn grpc_reached(rounds: &[GrpcRound], node: &str, from: Instant) -> u32 {
    rounds
        .iter()
        .filter(|r| r.from >= from)
        .map(|r| r.counts.get(node).copied().unwrap_or(0))
        .sum()
}

#[test]
fn a_central_drain_takes_a_wedged_node_out_of_haproxy_and_grpc_with_live_traffic() {
    require_haproxy();
    require_grpcio();
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            xds: true,
            agent_check: true,
            ..AggregatorOpts::default().cycle_ms(CYCLE_MS)
        },
    );

    // `web` behind HAProxy, asking the aggregator for every server's weight.
    let web: Vec<String> = (1..=3).map(|i| format!("web-{i}")).collect();
    let backends: Vec<Backend> = web.iter().map(|n| Backend::start(n)).collect();
    let mut agents: Vec<Agent> = web
        .iter()
        .zip(&backends)
        .map(|(node, b)| {
            let opts = AgentOpts {
                address: Some(b.addr.to_string()),
                noise: 0.05,
                ..AgentOpts::new("web", node)
            };
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    // `api` through xDS.
    let api: Vec<String> = (1..=3).map(|i| format!("api-{i}")).collect();
    let api_refs: Vec<&str> = api.iter().map(String::as_str).collect();
    let grpc = Backends::start(&api_refs, dir.path());
    agents.extend(api.iter().map(|node| {
        let opts = AgentOpts {
            address: Some(grpc.address(node)),
            noise: 0.05,
            ..AgentOpts::new("api", node)
        };
        Agent::start(&pki, &agg, opts)
    }));
    agg.wait_for_endpoints("web", 3, Duration::from_secs(20));
    agg.wait_for_endpoints("api", 3, Duration::from_secs(20));

    // A fourth server, `web-9`, that no agent reports for: the aggregator has no
    // answer for it.
    let stray = Backend::start("web-9");
    let mut servers: Vec<(&str, std::net::SocketAddr, std::net::SocketAddr)> = web
        .iter()
        .zip(&backends)
        .map(|(n, b)| (n.as_str(), b.addr, agg.agent_check_addr()))
        .collect();
    servers.push(("web-9", stray.addr, agg.agent_check_addr()));
    let hap = Haproxy::start(
        0,
        &servers,
        &HaproxyOpts {
            agent_send: Some("web".to_string()),
            ..HaproxyOpts::default()
        },
    );
    // HAProxy takes each server's weight from the aggregator's answer for it.
    wait_for(
        Duration::from_secs(15),
        "HAProxy's weights from the aggregator",
        || {
            let answered = sum_samples(
                &parse_metrics(&agg.metrics()),
                "ballast_haproxy_agent_replies_total",
                &[("reason", "weight")],
            );
            if answered < 6.0 {
                return Err(format!("{answered} agent-checks answered"));
            }
            let w = agg.try_weights("web")?;
            let s = hap.try_show_servers_state()?;
            let mut diffs = Vec::new();
            for node in &web {
                let want = w.weights[node.as_str()].haproxy_percent.min(256);
                let got = s.get(node.as_str()).map(|s| s.uweight);
                if got.is_none_or(|g| g.abs_diff(want) > 2 || !s[node.as_str()].ready()) {
                    diffs.push(format!("{node}: HAProxy {got:?}, aggregator {want}"));
                }
            }
            if diffs.is_empty() {
                Ok(())
            } else {
                Err(diffs.join(", "))
            }
        },
    );
    // A server the aggregator does not know stays as HAProxy has it: drained here by
    // hand on the runtime API, it stays drained (an answer of `ready` would undo it).
    hap.command("set server be/web-9 state drain");
    let unknown = || {
        sum_samples(
            &parse_metrics(&agg.metrics()),
            "ballast_haproxy_agent_replies_total",
            &[("reason", "unknown")],
        )
    };
    let before = unknown();
    wait_for(Duration::from_secs(10), "four checks of web-9", || {
        let n = unknown() - before;
        if n >= 4.0 {
            Ok(())
        } else {
            Err(format!("{n} unanswered checks"))
        }
    });
    let state = hap.show_servers_state();
    assert!(
        state["web-9"].draining(),
        "a node the aggregator does not know was undrained: {:?}",
        state["web-9"]
    );

    // Live traffic, each side in a thread of its own, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(Mutex::new(Vec::<Sent>::new()));
    let frontend = hap.frontend();
    let http = {
        let (stop, sent) = (Arc::clone(&stop), Arc::clone(&sent));
        std::thread::spawn(move || {
            for _ in 0..HTTP_MAX {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let at = Instant::now();
                let answer = request(frontend);
                sent.lock().expect("lock").push(Sent { at, answer });
                std::thread::sleep(HTTP_GAP);
            }
        })
    };
    let mut client = XdsClient::start(&agg.xds(), "api", "central-drain", None, dir.path());
    let first = client.round(20, Duration::from_secs(10));
    assert_eq!(
        first.errors,
        BTreeMap::new(),
        "the gRPC client's first calls"
    );
    let rounds = Arc::new(Mutex::new(Vec::<GrpcRound>::new()));
    let grpc_thread = {
        let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
        std::thread::spawn(move || {
            for _ in 0..GRPC_MAX_ROUNDS {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let from = Instant::now();
                let r = client.round(20, Duration::from_millis(200));
                rounds.lock().expect("lock").push(GrpcRound {
                    from,
                    to: Instant::now(),
                    counts: r.counts,
                    errors: r.errors,
                });
                std::thread::sleep((from + GRPC_ROUND).saturating_duration_since(Instant::now()));
            }
            client
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    {
        let sent = sent.lock().expect("lock");
        let since = Instant::now() - Duration::from_secs(2);
        assert!(
            reached(&sent, "web-2", since).0 > 0,
            "web-2 serves HAProxy's traffic before the drain"
        );
        let rounds = rounds.lock().expect("lock");
        assert!(
            grpc_reached(&rounds, "api-2", since) > 0,
            "api-2 serves the gRPC client before the drain"
        );
    }

    // 1. The two agents wedge; the operator drains their nodes centrally.
    let web2 = 1;
    let api2 = 4;
    agents[web2].pause();
    agents[api2].pause();
    let asked = Instant::now();
    // When each drain was in force: as its command returned.
    let mut done = Vec::new();
    for (node, service) in [("web-2", "web"), ("api-2", "api")] {
        let said = agg.cli(&[
            "drain",
            node,
            "--service",
            service,
            "--reason",
            "agent wedged",
        ]);
        assert!(said.contains(node), "{said}");
        done.push(Instant::now());
    }
    // Two cycles from each drain's command; the later of the two for what both share.
    let (web_deadline, api_deadline) = (done[0] + WITHIN, done[1] + WITHIN);
    let deadline = api_deadline.max(web_deadline);
    wait_for(WITHIN, "HAProxy has web-2 in DRAIN", || {
        let s = hap.try_show_servers_state()?;
        match s.get("web-2") {
            Some(st) if st.draining() => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    eprintln!(
        "HAProxy had web-2 in DRAIN {} ms after the CLI started, {} ms after it returned",
        asked.elapsed().as_millis(),
        done[0].elapsed().as_millis()
    );
    std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
    let web2_count = backends[web2].requests();
    std::thread::sleep(Duration::from_secs(3));
    {
        let sent = sent.lock().expect("lock");
        let (to_web2, failed) = reached(&sent, "web-2", web_deadline);
        assert_eq!(to_web2, 0, "requests sent to web-2 after the drain held");
        assert!(failed.is_empty(), "failed requests: {failed:?}");
        let rounds = rounds.lock().expect("lock");
        assert_eq!(
            grpc_reached(&rounds, "api-2", api_deadline),
            0,
            "gRPC calls to api-2 after the drain held"
        );
    }
    assert_eq!(
        backends[web2].requests(),
        web2_count,
        "web-2's own count moved after the drain held"
    );

    // 2. The aggregator restarts; the drain holds throughout.
    let restarted_at = Instant::now();
    agg.restart();
    agg.wait_for_endpoints("web", 3, Duration::from_secs(20));
    wait_for(
        Duration::from_secs(10),
        "the restored drain answered again",
        || {
            let m = parse_metrics(&agg.metrics());
            let drains = sum_samples(
                &m,
                "ballast_haproxy_agent_replies_total",
                &[("reason", "drain")],
            );
            if drains >= 1.0 {
                Ok(())
            } else {
                Err(format!("drain answers since the restart: {drains}"))
            }
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    let state = hap.show_servers_state();
    assert!(state["web-2"].draining(), "after the restart: {state:?}");
    assert_eq!(
        backends[web2].requests(),
        web2_count,
        "web-2 was sent requests across the aggregator's restart"
    );
    {
        let sent = sent.lock().expect("lock");
        let (to_web2, failed) = reached(&sent, "web-2", deadline);
        assert_eq!(to_web2, 0, "requests to web-2 across the restart");
        assert!(failed.is_empty(), "failed requests: {failed:?}");
        let rounds = rounds.lock().expect("lock");
        assert_eq!(
            grpc_reached(&rounds, "api-2", deadline),
            0,
            "gRPC calls to api-2 across the restart"
        );
        let errors: Vec<_> = rounds
            .iter()
            .filter(|r| !r.errors.is_empty())
            .map(|r| (r.from.duration_since(restarted_at), &r.errors))
            .collect();
        assert!(errors.is_empty(), "gRPC calls failed: {errors:?}");
    }

    // 3. Undrained, the agents still frozen: both nodes take requests again.
    let undrained = Instant::now();
    for (node, service) in [("web-2", "web"), ("api-2", "api")] {
        agg.cli(&[
            "undrain",
            node,
            "--service",
            service,
            "--reason",
            "agent back",
        ]);
    }
    wait_for(WITHIN, "HAProxy has web-2 ready again", || {
        let s = hap.try_show_servers_state()?;
        match s.get("web-2") {
            Some(st) if st.ready() => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    // Back cold (a tenth of the mean weight), so a few per cent of the traffic: wait
    // for some of it.
    wait_for(
        Duration::from_secs(15),
        "both nodes take requests again",
        || {
            let sent = sent.lock().expect("lock");
            let rounds = rounds.lock().expect("lock");
            let since = undrained + WITHIN;
            let (web2, api2) = (
                reached(&sent, "web-2", since).0,
                grpc_reached(&rounds, "api-2", since),
            );
            if web2 > 0 && api2 > 0 {
                Ok(())
            } else {
                let recent: Vec<_> = rounds.iter().rev().take(3).map(|r| &r.counts).collect();
                Err(format!(
                "web-2 {web2} requests, api-2 {api2} calls; {} rounds, the last {recent:?}; xDS {:?}",
                rounds.len(),
                agg.weights("api").weights.get("api-2")
            ))
            }
        },
    );
    stop.store(true, Ordering::Relaxed);
    http.join().expect("the HTTP client");
    let _client = grpc_thread.join().expect("the gRPC client");
    let sent = sent.lock().expect("lock");
    let (_, failed) = reached(&sent, "web-2", undrained);
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let rounds = rounds.lock().expect("lock");
    let errors: Vec<_> = rounds
        .iter()
        .filter(|r| !r.errors.is_empty())
        .map(|r| &r.errors)
        .collect();
    assert!(errors.is_empty(), "gRPC calls failed: {errors:?}");
    let last = rounds.last().map(|r| r.to.duration_since(r.from));
    eprintln!(
        "{} HTTP requests and {} gRPC rounds (the last {last:?}), none failed",
        sent.len(),
        rounds.len()
    );
    for a in &agents {
        a.resume();
    }
}
