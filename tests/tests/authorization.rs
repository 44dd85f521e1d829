//! Scenario: a certificate may claim only what it is allowed to.
//!
//! A legitimate `payments` fleet is balanced by an aggregator while an attacker, who
//! stole node `batch-7`'s certificate, tries what a certificate used to allow:
//! - a hello for service `payments` at `10.6.6.6:443`, then load-0 reports (which
//!   would have taken about half of the service's traffic);
//! - a hello for its own service at another address, or at a host name, to repoint
//!   `batch-7`'s traffic.
//!
//! With a policy file, a certificate from a CA that names no service is granted what
//! the policy says and nothing more (an address outside the networks it allows, a
//! service it does not grant), and with a config directory that accepts no unknown
//! services, a service without a file is refused. Each refusal carries its reason on
//! the wire, in the agent's status and in the aggregator's metrics, while the fleet
//! keeps being balanced. A bad policy file stops the start with where and why.

use ballast_shared::wire::{self, Hello, Message, NodeState, RejectReason, Report};
use ballast_tests::*;
use std::time::Duration;

const PAYMENTS: &str = "payments";
const BATCH: &str = "batch";
const WAIT: Duration = Duration::from_secs(20);
/// QUIC application close code of a refused hello.
const CLOSE_REJECTED: u32 = 1;

fn rejected(agg: &Aggregator, reason: &str) -> f64 {
    agg.counter("ballast_reports_rejected_total", &[("reason", reason)])
}

/// Waits until `agent`'s status shows the aggregator's refusal for `reason`.
fn wait_refused(agent: &Agent, reason: &str) -> AgentStatus {
    wait_for(
        WAIT,
        &format!("{}'s refusal ({reason}) in its status", agent.node()),
        || {
            let s = agent.status();
            match &s.rejection {
                Some(r) if r.reason == reason && s.rejections >= 1 => Ok(s),
                _ => Err(format!("{s:?}")),
            }
        },
    )
}

/// Nothing got through for `intruder`: no session, no weight, no report sent.
fn got_nothing(intruder: &Agent) -> Result<(), String> {
    let s = intruder.status();
    if s.weight.is_some() || s.connected_to.is_some() || s.reports_sent > 0 {
        return Err(format!("{} got through: {s:?}", intruder.node()));
    }
    Ok(())
}

/// The agents' default address: loopback, where they connect from.
fn endpoint_address(agg: &Aggregator, service: &str, node: &str) -> Option<String> {
    agg.endpoints(service)
        .into_iter()
        .find(|e| e.node == node)
        .map(|e| e.address)
}

/// Starts a fleet of `service` and waits until it is balanced; returns it with its
/// count of weight updates.
fn balanced_fleet(pki: &Pki, agg: &Aggregator, service: &str) -> (Vec<Agent>, u64) {
    let fleet = start_fleet(pki, agg, service, 4, &[0.7, 1.0, 1.3, 1.0]);
    for a in &fleet {
        a.wait_weight(WAIT);
    }
    let updates = wait_for(WAIT, &format!("the {service} fleet balanced"), || {
        fleet_served(agg, service, &fleet)
    });
    (fleet, updates)
}

#[test]
fn a_stolen_certificate_claims_neither_another_service_nor_another_address() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(500));
    let (fleet, updates_before) = balanced_fleet(&pki, &agg, PAYMENTS);
    // batch-7 is a real node of batch, reporting from its own address.
    let batch = Agent::start(&pki, &agg, AgentOpts::new(BATCH, "batch-7"));
    batch.wait_weight(WAIT);
    wait_for(WAIT, "batch-7 served", || {
        fleet_served(&agg, BATCH, std::slice::from_ref(&batch))
    });
    let batch_address = batch.address().to_string();
    assert_eq!(
        endpoint_address(&agg, BATCH, "batch-7").as_deref(),
        Some(batch_address.as_str())
    );
    // The attacker holds a copy of its certificate.
    let stolen = pki.node_tls_dir_for("batch-7", &[BATCH]);

    // 1. The scenario on the wire: a hello for payments at 10.6.6.6:443, then load 0.
    let raw = RawClient::with_config(pki.client_config_from(&stolen));
    let conn = raw
        .connect(agg.quic_addr())
        .expect("the certificate itself is valid");
    let hello = Hello {
        node: "batch-7".into(),
        service: PAYMENTS.into(),
        address: "10.6.6.6:443".into(),
        zone: String::new(),
        version: "stolen".into(),
    };
    match conn.hello(&hello) {
        Ok(Message::Reject(r)) => {
            assert_eq!(r.reason, RejectReason::ServiceNotAllowed, "{r:?}");
            assert!(
                r.detail.contains(PAYMENTS) && r.detail.contains(BATCH),
                "the reject says what was asked and what is allowed: {r:?}"
            );
        }
        other => panic!("the stolen certificate's hello for payments got {other:?}"),
    }
    for seq in 1..=5 {
        let zero = Report {
            seq,
            cpu: 0.0,
            inflight: 0,
            inflight_mean: 0.0,
            age: None,
            capacity: 100,
            error_rate: None,
            state: NodeState::Serving,
        };
        let _ = conn.send_datagram(&wire::encode(&Message::Report(zero)).expect("encode"));
    }
    match conn.wait_closed(Duration::from_secs(10)) {
        Some(quinn::ConnectionError::ApplicationClosed(c)) => assert_eq!(
            c.error_code,
            quinn::VarInt::from_u32(CLOSE_REJECTED),
            "closed as refused"
        ),
        other => panic!("the refused connection ended with {other:?}"),
    }

    // 2. The same with a real agent: it sees the refusal, and says why.
    let mut thief_opts = AgentOpts::new(PAYMENTS, "batch-7").tls_dir(stolen.clone());
    thief_opts.address = Some("10.6.6.6:443".into());
    let thief = Agent::start(&pki, &agg, thief_opts);
    let s = wait_refused(&thief, "service_not_allowed");
    let r = s.rejection.expect("refusal");
    assert!(r.detail.contains(PAYMENTS), "{r:?}");
    assert_eq!(r.aggregator, agg.quic_addr().to_string());
    assert!(
        thief.log_tail(50).contains("service_not_allowed"),
        "the agent's log names the refusal:\n{}",
        thief.log_tail(50)
    );

    // 3. Its own service, at another address or a host name: repointing batch-7.
    let mut elsewhere = Vec::new();
    for (i, address) in ["10.6.6.6:443", "payments.internal:443"].iter().enumerate() {
        let mut opts = AgentOpts::new(BATCH, "batch-7").tls_dir(stolen.clone());
        opts.address = Some(address.to_string());
        opts.seed = i as u64;
        let agent = Agent::start(&pki, &agg, opts);
        let s = wait_refused(&agent, "address_not_allowed");
        eprintln!("{address}: {:?}", s.rejection);
        elsewhere.push(agent);
    }
    wait_for(WAIT, "the refusals counted by reason", || {
        let (svc, addr) = (
            rejected(&agg, "service_not_allowed"),
            rejected(&agg, "address_not_allowed"),
        );
        if svc >= 2.0 && addr >= 2.0 {
            Ok(())
        } else {
            Err(format!(
                "service_not_allowed {svc}, address_not_allowed {addr}"
            ))
        }
    });

    // While the attacker keeps retrying, payments is balanced by its own fleet alone,
    // and batch-7's endpoint stays where the real node is.
    holds_for(
        Duration::from_secs(3),
        "the fleet balanced, the attacker refused",
        || {
            fleet_served(&agg, PAYMENTS, &fleet)?;
            fleet_served(&agg, BATCH, std::slice::from_ref(&batch))?;
            let at = endpoint_address(&agg, BATCH, "batch-7");
            if at.as_deref() != Some(batch_address.as_str()) {
                return Err(format!("batch-7 repointed to {at:?}"));
            }
            got_nothing(&thief)?;
            elsewhere.iter().try_for_each(got_nothing)
        },
    );
    let updates_after = fleet_served(&agg, PAYMENTS, &fleet).expect("served");
    assert!(
        updates_after >= updates_before + 4,
        "payments' weights were updated {updates_before} then {updates_after} times"
    );
}

#[test]
fn a_policy_grants_what_certificates_do_not_name_and_nothing_more() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        "[[rule]]\nnodes = [\"edge-*\"]\nservices = [\"edge\"]\nnetworks = [\"10.20.0.0/16\"]\n",
    )
    .expect("write the policy");
    let opts = AggregatorOpts {
        config_toml: Some(format!("[authorization]\npolicy = {:?}\n", policy)),
        ..AggregatorOpts::default().grace_ms(500)
    };
    let agg = Aggregator::start(&pki, opts);
    let (fleet, updates_before) = balanced_fleet(&pki, &agg, PAYMENTS);

    // Certificates that name no service, as another CA's would.
    let agent = |service: &str, node: &str, address: &str| {
        let mut o = AgentOpts::new(service, node).tls_dir(pki.node_tls_dir(node));
        o.address = Some(address.into());
        Agent::start(&pki, &agg, o)
    };
    // Behind NAT, in the network the policy allows: served.
    let natted = agent("edge", "edge-1", "10.20.3.4:8080");
    natted.wait_weight(WAIT);
    wait_for(WAIT, "edge-1 served", || {
        fleet_served(&agg, "edge", std::slice::from_ref(&natted))
    });
    assert_eq!(
        endpoint_address(&agg, "edge", "edge-1").as_deref(),
        Some("10.20.3.4:8080")
    );
    // Outside it: refused.
    let outside = agent("edge", "edge-2", "10.21.0.1:8080");
    wait_refused(&outside, "address_not_allowed");
    // A service the rule does not grant.
    let greedy = agent(PAYMENTS, "edge-3", "127.0.0.1:8080");
    wait_refused(&greedy, "service_not_allowed");
    // An identity no rule matches, with a certificate that names no service.
    let stray = agent("edge", "stray-1", "127.0.0.1:8081");
    let s = wait_refused(&stray, "service_not_allowed");
    let why = s.rejection.expect("refusal").detail;
    assert!(why.contains("names none"), "{why}");

    holds_for(Duration::from_secs(2), "the fleets served", || {
        fleet_served(&agg, PAYMENTS, &fleet)?;
        fleet_served(&agg, "edge", std::slice::from_ref(&natted))?;
        [&outside, &greedy, &stray]
            .into_iter()
            .try_for_each(got_nothing)
    });
    let updates_after = fleet_served(&agg, PAYMENTS, &fleet).expect("served");
    assert!(
        updates_after > updates_before,
        "payments kept being balanced"
    );
}

#[test]
fn a_bad_policy_file_stops_the_start_with_where_and_why() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("bad-policy.toml");
    std::fs::write(
        &policy,
        "[[rule]]\nnodes = [\"a-*\"]\nservices = [\"a\"]\n\n[[rule]]\nnodes = [\"b-*\"]\nnetworks = [\"10.0.0.0/40\"]\n",
    )
    .expect("write");
    let mut cmd = command(AGGREGATOR_BIN);
    cmd.args(["run", "--quic", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .arg("--tls-dir")
        .arg(pki.dir())
        .arg("--store")
        .arg(dir.path().join("weights.json"))
        .arg("--policy")
        .arg(&policy);
    let out = run_bounded(cmd, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with a bad policy: {stderr}");
    for what in ["bad-policy.toml", "rule 2", "networks", "10.0.0.0/40"] {
        assert!(
            stderr.contains(what),
            "the error does not name {what:?}: {stderr}"
        );
    }
}

#[test]
fn without_unknown_services_only_services_with_a_file_register() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(format!("{PAYMENTS}.toml")), "").expect("write");
    let opts = AggregatorOpts {
        config_toml: Some("[service_config]\naccept_unknown_services = false\n".into()),
        ..AggregatorOpts::default()
            .grace_ms(500)
            .config_dir(dir.path())
    };
    let agg = Aggregator::start(&pki, opts);
    let (fleet, updates_before) = balanced_fleet(&pki, &agg, PAYMENTS);
    let unknown_before = rejected(&agg, "unknown_service");

    // Its certificate allows `ghost`, but no file configures it.
    let ghost = Agent::start(&pki, &agg, AgentOpts::new("ghost", "ghost-1"));
    let s = wait_refused(&ghost, "unknown_service");
    let why = s.rejection.expect("refusal").detail;
    assert!(why.contains("ghost.toml"), "{why}");
    wait_for(WAIT, "unknown_service counted", || {
        let n = rejected(&agg, "unknown_service");
        if n > unknown_before {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
    holds_for(Duration::from_secs(2), "ghost kept out", || {
        fleet_served(&agg, PAYMENTS, &fleet)?;
        got_nothing(&ghost)?;
        let services: Vec<String> = agg.services().into_iter().map(|s| s.name).collect();
        if services.iter().any(|s| s == "ghost") {
            return Err(format!("ghost exists: {services:?}"));
        }
        Ok(())
    });

    // Its team adds the file: it registers at its next attempt, without a restart.
    std::fs::write(dir.path().join("ghost.toml"), "").expect("write");
    ghost.wait_weight(WAIT);
    let updates_after = fleet_served(&agg, PAYMENTS, &fleet).expect("served");
    assert!(
        updates_after > updates_before,
        "payments kept being balanced"
    );
}
