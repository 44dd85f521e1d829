//! Scenario: an established agent connection ends when what admitted it ends, even
//! though the agent would go on reporting.
//!
//! - A node certificate valid for a few seconds: the agent connects and is balanced;
//!   when the certificate expires, the aggregator closes the live connection (counted
//!   as `expired`), and the agent, which keeps its expired certificate, cannot come
//!   back: its last report ages while the other node's stay fresh.
//! - An agent frozen (SIGSTOP) with its connection open: the aggregator closes the
//!   connection once `quic_report_timeout_ms` passes without a report (counted as
//!   `no_reports`), and keeps serving the others; thawed, the agent connects again.

use ballast_shared::pki::{NodeSpec, Pem};
use ballast_tests::*;
use std::path::Path;
use std::time::{Duration, Instant};

const SERVICE: &str = "web";
const WAIT: Duration = Duration::from_secs(20);

fn rejected(agg: &Aggregator, reason: &str) -> f64 {
    agg.counter("ballast_connections_rejected_total", &[("reason", reason)])
}

fn install(dir: &Path, name: &str, pem: &Pem) {
    std::fs::write(dir.join(format!("{name}.pem")), &pem.cert).expect("write cert");
    std::fs::write(dir.join(format!("{name}.key")), &pem.key).expect("write key");
}

fn signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid");
    // SAFETY: kill(2) with a pid of a child this test started.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

#[test]
fn a_live_connection_is_closed_when_its_certificate_expires() {
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .grace_ms(500)
            .cycle_ms(500)
            .report_interval_ms(500),
    );
    // Long enough for the aggregator's handshake and a balanced cycle on a loaded
    // machine; the certificate's times are whole seconds.
    let validity = Duration::from_secs(8);
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("web-1");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(pki.dir().join("ca.pem"), dir.join("ca.pem")).expect("ca.pem");
    let spec = NodeSpec::new("web-1", &[SERVICE.to_string()], validity).expect("spec");
    let issued = Instant::now();
    install(
        &dir,
        "node",
        &pki.ca().issue_node_with(&spec).expect("issue").pem,
    );
    pki.issue_nodes(&["web-2"]);
    let short = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-1").tls_dir(dir));
    let other = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-2"));
    short.wait_weight(WAIT);
    other.wait_weight(WAIT);
    assert!(
        issued.elapsed() < validity,
        "the agent took {:?} to connect: the test cannot see a live connection expire",
        issued.elapsed()
    );
    assert_eq!(
        rejected(&agg, "expired"),
        0.0,
        "a connection was refused as expired before the certificate expired"
    );

    // The connection stays open and the agent reports: only the aggregator can end
    // it. It must, within its expiry timer's resolution after `not_after`.
    let closed = wait_for(
        validity + WAIT,
        "the expired connection to be closed",
        || match rejected(&agg, "expired") {
            n if n > 0.0 => Ok(issued.elapsed()),
            _ => Err(format!(
                "still open {:?} after issue: {}",
                issued.elapsed(),
                agg.log_tail(5)
            )),
        },
    );
    assert!(
        closed >= validity - Duration::from_secs(1),
        "closed {closed:?} after issue, before the certificate's {validity:?} ran out"
    );
    // Its reports stop: the aggregator holds its last report, ageing (fail-static keeps
    // the endpoint until the service's expiry), while the other node's stay fresh.
    let age = |node: &str| {
        agg.endpoints(SERVICE)
            .into_iter()
            .find(|e| e.node == node)
            .and_then(|e| e.report_age_ms)
            .unwrap_or(u64::MAX)
    };
    wait_for(WAIT, "the expired node's last report to age", || {
        match (age("web-1"), age("web-2")) {
            (old, fresh) if old >= 3_000 && fresh < 2_000 => Ok(()),
            ages => Err(format!("report ages {ages:?} ms")),
        }
    });
    assert!(
        other.status().connected_to.is_some(),
        "the node with a valid certificate lost its connection"
    );
}

#[test]
fn a_silent_connection_is_closed_after_the_report_timeout() {
    let pki = Pki::new();
    // Five report intervals is the floor of the timeout: 2.5 s.
    let timeout_ms = 2_500;
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(format!("[limits]\nquic_report_timeout_ms = {timeout_ms}\n")),
            ..AggregatorOpts::default()
                .grace_ms(500)
                .cycle_ms(500)
                .report_interval_ms(500)
        },
    );
    pki.issue_nodes(&["web-1", "web-2"]);
    let frozen = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-1"));
    let other = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-2"));
    frozen.wait_weight(WAIT);
    other.wait_weight(WAIT);
    assert_eq!(
        rejected(&agg, "no_reports"),
        0.0,
        "closed before any silence"
    );

    let pid = frozen.pid().expect("the agent runs");
    signal(pid, libc::SIGSTOP);
    let stopped = Instant::now();
    let closed = wait_for(
        WAIT,
        "the silent connection to be closed",
        || match rejected(&agg, "no_reports") {
            n if n > 0.0 => Ok(stopped.elapsed()),
            _ => Err(format!("still open after {:?}", stopped.elapsed())),
        },
    );
    let sent_before = other.status().reports_sent;
    signal(pid, libc::SIGCONT);
    // Not before the timeout (less the report in flight when the agent froze), and not
    // long after it: the timer is reset by each report, not polled.
    let timeout = Duration::from_millis(timeout_ms);
    assert!(
        closed + Duration::from_millis(500) >= timeout && closed <= timeout * 3,
        "closed {closed:?} after the agent froze, with a timeout of {timeout:?}"
    );
    // The others were served meanwhile, and the thawed agent comes back.
    wait_for(WAIT, "the other agent to go on reporting", || {
        match other.status().reports_sent {
            n if n > sent_before => Ok(()),
            n => Err(format!("{n} reports")),
        }
    });
    wait_for(WAIT, "the thawed agent to connect again", || {
        match frozen.status().connected_to {
            Some(to) => Ok(to),
            None => Err("not connected".into()),
        }
    });
    frozen.wait_weight(WAIT);
}
