//! Scenario: the agent against a broken measurement source and other local users.
//!
//! - The in-flight source is a Prometheus endpoint that accepts every other
//!   connection and never answers it. The scrape runs off the agent's runtime thread:
//!   meanwhile the agent-check and the control socket answer at once, reports keep
//!   going to the aggregator from the scrapes that do answer, and each hung scrape is
//!   a counted sample error, after which the next tick scrapes again.
//! - The control socket is created with mode 0600; another user cannot connect to
//!   it, and one that could (the mode widened by hand) is refused by its credentials
//!   (`SO_PEERCRED`), logged and counted, while root is still served.

use ballast_tests::harness::agent::agent_check_reply;
use ballast_tests::harness::api::{parse_metrics, sum_samples};
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SERVICE: &str = "hardened";

/// How long the agent-check and the control socket may take to answer while a
/// scrape hangs. The hung scrape lasts a second: on the runtime thread it would hold
/// every answer up to that.
const PROMPT: Duration = Duration::from_millis(500);

/// A Prometheus endpoint that answers connections 0, 2, 4… with an in-flight gauge
/// and holds 1, 3, 5… open without a byte, until dropped.
struct HalfHungEndpoint {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HalfHungEndpoint {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the endpoint");
        let addr = listener.local_addr().expect("its address");
        listener.set_nonblocking(true).expect("non-blocking accept");
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (accepted, stop) = (accepted.clone(), stop.clone());
            move || {
                let mut hung = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let mut conn = match listener.accept() {
                        Ok((conn, _)) => conn,
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                    };
                    let n = accepted.fetch_add(1, Ordering::SeqCst);
                    if n % 2 == 1 {
                        hung.push(conn);
                        continue;
                    }
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
                    let mut buf = [0u8; 1024];
                    let _ = conn.read(&mut buf);
                    let body = "# TYPE app_inflight gauge\napp_inflight 3\n";
                    let _ = write!(
                        conn,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                }
            }
        });
        HalfHungEndpoint {
            addr,
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for HalfHungEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `GET /metrics` from the agent: the body.
fn scrape(addr: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .ok_or_else(|| format!("no HTTP answer: {out:?}"))
}

#[test]
fn a_hung_scrape_stalls_neither_the_agent_check_nor_the_control_socket_nor_reports() {
    let endpoint = HalfHungEndpoint::start();
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    pki.issue_nodes_for(SERVICE, &["hardened-1"]);
    let check = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
    let mut opts = AgentOpts::new(SERVICE, "hardened-1").agent_check(check);
    opts.inflight = Some(format!(
        "prometheus:http://{}/metrics#app_inflight",
        endpoint.addr
    ));
    let mut agent = Agent::start(&pki, &agg, opts);
    agent.wait_weight(Duration::from_secs(15));
    wait_for(Duration::from_secs(10), "a hung scrape", || {
        let n = endpoint.accepted();
        (n >= 2).then_some(()).ok_or(format!("{n} scrapes"))
    });

    let before = agent.status();
    holds_for(
        Duration::from_secs(4),
        "prompt answers while scrapes hang",
        || {
            let started = Instant::now();
            let reply = agent_check_reply(check, Duration::from_secs(5))?;
            let took = started.elapsed();
            if !reply.starts_with("ready up ") || took > PROMPT {
                return Err(format!("agent-check answered {reply:?} after {took:?}"));
            }
            let started = Instant::now();
            let resp = agent.try_control("status")?;
            let took = started.elapsed();
            if !resp.ok || took > PROMPT {
                return Err(format!("status answered after {took:?}: {resp:?}"));
            }
            Ok(())
        },
    );

    // Each hung scrape was a failed sample, and the ticks after it scraped again and
    // reported.
    let after = wait_for(
        Duration::from_secs(10),
        "hung scrapes counted as sample errors, with reports in between",
        || {
            let s = agent.status();
            let errors = s.sample_errors - before.sample_errors;
            let sent = s.reports_sent - before.reports_sent;
            if errors >= 2 && sent >= 2 && s.connected_to.is_some() {
                Ok(s)
            } else {
                Err(format!(
                    "{errors} sample errors, {sent} reports since: {s:?}"
                ))
            }
        },
    );
    assert!(endpoint.accepted() >= 6, "{} scrapes", endpoint.accepted());
    assert_eq!(after.last_inflight, Some(3), "{after:?}");
    let log = agent.log_tail(200);
    assert!(
        log.contains("sample failed") && log.contains("no complete response"),
        "the hung scrape's error is in the log:\n{log}"
    );
    assert!(agent.is_running(), "{}", agent.log_tail(20));
}

/// `ballast-agent status --json --control SOCKET` as uid and gid 65534 (nobody).
fn status_as_nobody(agent: &Agent) -> std::process::Output {
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(binary(AGENT_BIN))
        .args(["status", "--json", "--control"])
        .arg(agent.control_path())
        .env_remove("BALLAST_CONTROL");
    run_bounded(cmd, Duration::from_secs(20))
}

#[test]
fn the_control_socket_is_private_and_refuses_other_users() {
    require_tool("setpriv", "apt-get install util-linux");
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    pki.issue_nodes_for(SERVICE, &["hardened-2"]);
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
    let agent = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "hardened-2").metrics(metrics),
    );
    let socket = agent.control_path().to_path_buf();
    let mode = std::fs::metadata(&socket)
        .expect("the socket file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode {:o}", mode & 0o777);

    // Another user may reach the directory, but not connect: the kernel refuses.
    std::fs::set_permissions(agent.dir(), std::fs::Permissions::from_mode(0o711))
        .expect("open the agent's directory to others");
    let out = status_as_nobody(&agent);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(stderr.contains("Permission denied"), "{stderr}");

    // With the mode widened by hand, the agent itself refuses by the peer's uid.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))
        .expect("widen the socket's mode");
    let out = status_as_nobody(&agent);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{out:?}");
    let resp: ControlResponse = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "no answer as nobody ({e}): {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(!resp.ok && resp.status.is_none(), "{resp:?}");
    let error = resp.error.unwrap_or_default();
    assert!(
        error.contains("permission denied") && error.contains("uid 65534"),
        "{error}"
    );

    // Root still is served, and the refusal is counted and logged.
    let resp = agent.cli_json("status");
    assert!(resp.status.is_some(), "{resp:?}");
    wait_for(
        Duration::from_secs(10),
        "the refusal in the metrics",
        || {
            let body = scrape(metrics)?;
            let n = sum_samples(
                &parse_metrics(&body),
                "ballast_agent_connections_refused_total",
                &[("listener", "control"), ("reason", "peer")],
            );
            (n == 1.0).then_some(()).ok_or(body)
        },
    );
    let log = agent.log_tail(50);
    assert!(
        log.contains("control connection refused") && log.contains("65534"),
        "{log}"
    );
}
