//! Scenario: identity is the certificate.
//!
//! Two good agents report to an aggregator. Then three intruders try:
//! - an agent whose certificate comes from another CA (it trusts the aggregator, but
//!   the aggregator must not trust it): refused in the handshake, counted as
//!   `unknown_ca`;
//! - an agent with a valid certificate for node `node-a` that claims `--node node-b`:
//!   its hello is rejected and counted as `identity_mismatch`;
//! - a client with no certificate at all: refused in the handshake, counted as
//!   `no_certificate`, apart from the foreign certificate's retries.
//!
//! None of them ever gets a weight or an endpoint, and the good agents are served
//! throughout.

use ballast_tests::*;
use std::time::Duration;

const SERVICE: &str = "web";
const UNKNOWN_CA: (&str, &str) = ("reason", "unknown_ca");
const NO_CERTIFICATE: (&str, &str) = ("reason", "no_certificate");
const MISMATCH: (&str, &str) = ("reason", "identity_mismatch");

fn good_agents_are_served(agg: &Aggregator, good: &[Agent]) -> Result<(), String> {
    let eps = agg.endpoints(SERVICE);
    for a in good {
        let e = eps
            .iter()
            .find(|e| e.node == a.node())
            .ok_or_else(|| format!("{} has no endpoint", a.node()))?;
        if !matches!(e.state, EndpointState::Serving | EndpointState::Warming) || e.weight <= 0.0 {
            return Err(format!(
                "{} is {:?} with weight {}",
                e.node, e.state, e.weight
            ));
        }
        match e.report_age_ms {
            Some(age) if age <= 2000 => {}
            age => return Err(format!("{} last reported {age:?} ms ago", e.node)),
        }
        let s = a.status();
        if s.connected_to.is_none() || s.weight.is_none() {
            return Err(format!("{} lost its link: {s:?}", a.node()));
        }
    }
    Ok(())
}

#[test]
fn foreign_ca_impostor_and_anonymous_clients_are_refused() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().grace_ms(500));
    let good: Vec<Agent> = ["good-1", "good-2"]
        .iter()
        .map(|n| Agent::start(&pki, &agg, AgentOpts::new(SERVICE, n)))
        .collect();
    for a in &good {
        a.wait_weight(Duration::from_secs(15));
    }
    wait_for(Duration::from_secs(10), "good agents served", || {
        good_agents_are_served(&agg, &good)
    });
    let unknown_ca_before = agg.counter("ballast_connections_rejected_total", &[UNKNOWN_CA]);
    let no_cert_before = agg.counter("ballast_connections_rejected_total", &[NO_CERTIFICATE]);
    let mismatch_before = agg.counter("ballast_reports_rejected_total", &[MISMATCH]);
    let accepted_before = agg.counter("ballast_reports_accepted_total", &[]);
    let sent_before: Vec<u64> = good.iter().map(|a| a.status().reports_sent).collect();

    // A certificate from another CA.
    let rogue = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "rogue").tls_dir(pki.foreign_node_tls_dir("rogue")),
    );
    // A valid certificate for node-a, claiming node-b.
    let impostor = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "node-b").tls_dir(pki.node_tls_dir("node-a")),
    );

    let handshakes = wait_for(
        Duration::from_secs(15),
        "the foreign certificate to be refused in the handshake",
        || {
            let n = agg.counter("ballast_connections_rejected_total", &[UNKNOWN_CA]);
            if n > unknown_ca_before {
                Ok(n)
            } else {
                Err(format!("unknown_ca rejections {n}"))
            }
        },
    );
    let mismatches = wait_for(
        Duration::from_secs(15),
        "identity_mismatch in /metrics",
        || {
            let n = agg.counter("ballast_reports_rejected_total", &[MISMATCH]);
            if n >= mismatch_before + 1.0 {
                Ok(n)
            } else {
                Err(format!("identity_mismatch {n}"))
            }
        },
    );
    assert_eq!(mismatch_before, 0.0, "no mismatch before the impostor came");
    eprintln!("unknown_ca rejections {handshakes}, identity mismatches {mismatches}");

    // The intruders see their failures and never a weight.
    let rogue_status = wait_for(Duration::from_secs(15), "rogue's connect failures", || {
        let s = rogue.status();
        if s.connect_failures >= 1 {
            Ok(s)
        } else {
            Err(format!("{s:?}"))
        }
    });
    assert!(rogue_status.last_error.is_some(), "{rogue_status:?}");
    let impostor_status = wait_for(
        Duration::from_secs(15),
        "impostor's rejection in its status",
        || {
            let s = impostor.status();
            match &s.last_error {
                Some(e) if s.connect_failures >= 1 && e.contains("identity_mismatch") => Ok(s),
                _ => Err(format!("{s:?}")),
            }
        },
    );
    eprintln!("impostor: {:?}", impostor_status.last_error);

    // A client with no certificate at all.
    let anon = RawClient::with_config(client_config_without_certificate(&pki));
    let outcome = anon.connect(agg.quic_addr()).and_then(|conn| {
        // With TLS 1.3 the client may finish its side of the handshake before the
        // server checks the certificate: then the server closes the connection.
        match conn.wait_closed(Duration::from_secs(5)) {
            Some(e) => Err(format!("closed: {e}")),
            None => Ok(()),
        }
    });
    assert!(
        outcome.is_err(),
        "a client without a certificate stayed connected"
    );
    wait_for(
        Duration::from_secs(10),
        "the anonymous client counted as no_certificate",
        || {
            let n = agg.counter("ballast_connections_rejected_total", &[NO_CERTIFICATE]);
            if n == no_cert_before + 1.0 {
                Ok(())
            } else {
                Err(format!("no_certificate rejections {n}"))
            }
        },
    );

    // While the intruders keep retrying, the good agents are served, the intruders get
    // nothing, and only the good nodes are known.
    holds_for(
        Duration::from_secs(3),
        "good agents served, intruders refused",
        || {
            good_agents_are_served(&agg, &good)?;
            for intruder in [&rogue, &impostor] {
                let s = intruder.status();
                if s.weight.is_some() || s.connected_to.is_some() || s.reports_sent > 0 {
                    return Err(format!("{} got through: {s:?}", intruder.node()));
                }
            }
            Ok(())
        },
    );
    let mut nodes: Vec<String> = agg.endpoints(SERVICE).into_iter().map(|e| e.node).collect();
    nodes.sort();
    assert_eq!(nodes, ["good-1", "good-2"]);
    let services: Vec<serde_json::Value> = agg.get_json("/v1/services");
    assert_eq!(services.len(), 1, "only {SERVICE} exists: {services:?}");

    // The good agents kept reporting all along.
    for (a, before) in good.iter().zip(sent_before) {
        let after = a.status().reports_sent;
        assert!(
            after >= before + 4,
            "{} sent {before} then {after} reports",
            a.node()
        );
    }
    let accepted_after = agg.counter("ballast_reports_accepted_total", &[]);
    assert!(
        accepted_after >= accepted_before + 8.0,
        "reports accepted went from {accepted_before} to {accepted_after}"
    );
}
