//! Scenario: certificates that are no longer good.
//!
//! A legitimate `web` fleet is balanced by an aggregator given the revocation list
//! `certs init` wrote. Then:
//! - an attacker tries a certificate of this CA that expired yesterday: refused at the
//!   handshake, counted as `expired`, and the agent says so;
//! - node `web-07`'s certificate is revoked with `certs revoke` while it is connected:
//!   the aggregator reloads the list, closes the live connection within one cycle of
//!   the reload, and refuses the node's next handshakes as `revoked`;
//! - a revocation list signed by another CA is refused, and the list in force stays;
//! - so does a list whose file goes missing, or comes back unreadable.
//!
//! The rest of the fleet keeps being balanced throughout: one node of eight gone
//! silent is under the missing-share threshold, so its cycles go on.

use ballast_shared::pki::Ca;
use ballast_tests::*;
use std::time::{Duration, Instant};

const SERVICE: &str = "web";
const WAIT: Duration = Duration::from_secs(20);
const CYCLE_MS: u64 = 500;
/// How often the aggregator checks the revocation list's file.
const CRL_CHECK_MS: u64 = 200;

fn connections_rejected(agg: &Aggregator, reason: &str) -> f64 {
    agg.counter("ballast_connections_rejected_total", &[("reason", reason)])
}

fn crl_reloads(agg: &Aggregator, outcome: &str) -> f64 {
    agg.counter("ballast_crl_reloads_total", &[("reason", outcome)])
}

/// Waits until `counter` exceeds `before`; returns its value.
fn wait_above(what: &str, before: f64, mut counter: impl FnMut() -> f64) -> f64 {
    wait_for(WAIT, what, || {
        let n = counter();
        if n > before {
            Ok(n)
        } else {
            Err(format!("{n}"))
        }
    })
}

fn now_s() -> i64 {
    i64::try_from(ballast_shared::unix_ms() / 1000).expect("time")
}

#[test]
fn expired_and_revoked_certificates_are_refused_and_a_revoked_node_is_cut_off() {
    let pki = Pki::new();
    let opts = AggregatorOpts {
        config_toml: Some(format!(
            "[authorization]\ncrl = {:?}\ncrl_check_ms = {CRL_CHECK_MS}\n",
            pki.crl_path()
        )),
        ..AggregatorOpts::default()
            .grace_ms(500)
            .cycle_ms(CYCLE_MS)
            .report_interval_ms(500)
    };
    let agg = Aggregator::start(&pki, opts);
    let mut fleet = start_fleet(&pki, &agg, SERVICE, 8, &[0.7, 1.0, 1.3, 1.0]);
    for a in &fleet {
        a.wait_weight(WAIT);
    }
    let updates_before = wait_for(WAIT, "the fleet balanced", || {
        fleet_served(&agg, SERVICE, &fleet)
    });
    let revoked = fleet.pop().expect("web-07");
    assert_eq!(revoked.node(), "web-07");

    // 1. A certificate of this CA, for this service, that expired yesterday.
    let expired_before = connections_rejected(&agg, "expired");
    let day = 86_400;
    let old = pki.node_tls_dir_valid("web-99", &[SERVICE], now_s() - 30 * day, now_s() - day);
    let expired = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-99").tls_dir(old));
    wait_above(
        "the expired certificate refused as expired",
        expired_before,
        || connections_rejected(&agg, "expired"),
    );
    let s = wait_for(
        WAIT,
        "the agent's own word on its expired certificate",
        || {
            let s = expired.status();
            match &s.rejection {
                Some(r) if r.reason == "expired" => Ok(s),
                _ => Err(format!("{s:?}")),
            }
        },
    );
    assert!(
        s.certificate_expires_unix_ms
            .is_some_and(|at| at < ballast_shared::unix_ms()),
        "the status carries the certificate's expiry: {s:?}"
    );
    assert!(s.weight.is_none() && s.reports_sent == 0, "{s:?}");

    // 2. web-07 is revoked while connected.
    assert!(revoked.status().connected_to.is_some());
    let applied_before = crl_reloads(&agg, "applied");
    let revoked_before = connections_rejected(&agg, "revoked");
    let updates_at_revocation = agg.service(SERVICE).stats.updates;
    let said = pki.revoke("web-07");
    assert!(
        said.contains("web-07") && said.contains("revoked"),
        "{said}"
    );
    wait_above("the new list put in force", applied_before, || {
        crl_reloads(&agg, "applied")
    });
    // The reload closes the live connection at once: within one cycle of it.
    let reloaded = Instant::now();
    let closed = wait_above("web-07's live connection closed", revoked_before, || {
        connections_rejected(&agg, "revoked")
    });
    let took = reloaded.elapsed();
    assert!(
        took <= Duration::from_millis(CYCLE_MS),
        "the connection was closed {took:?} after the reload was seen"
    );
    let s = wait_for(WAIT, "web-07 told why", || {
        let s = revoked.status();
        match &s.rejection {
            Some(r) if r.reason == "revoked" && s.connected_to.is_none() => Ok(s),
            _ => Err(format!("{s:?}")),
        }
    });
    eprintln!("web-07: {:?}", s.rejection);
    // Its next handshakes are refused too, and it reports no more.
    wait_above("web-07's next handshake refused as revoked", closed, || {
        connections_rejected(&agg, "revoked")
    });
    wait_for(WAIT, "web-07 silent", || {
        let age = agg
            .endpoints(SERVICE)
            .into_iter()
            .find(|e| e.node == "web-07")
            .and_then(|e| e.report_age_ms);
        match age {
            Some(a) if a > 2000 => Ok(()),
            other => Err(format!("web-07's last report {other:?} ms ago")),
        }
    });
    wait_for(WAIT, "a handshake of web-07 refused as revoked", || {
        let log = agg.log();
        let refused = log
            .lines()
            .any(|l| l.contains("agent handshake failed") && l.contains("reason=\"revoked\""));
        if refused {
            Ok(())
        } else {
            Err(agg.log_tail(5))
        }
    });

    // 3. A list signed by another CA of the same name is refused; the list in force
    //    stays, so web-07 stays out.
    let errors_before = crl_reloads(&agg, "error");
    let applied_before_forgery = crl_reloads(&agg, "applied");
    let impostor = Ca::generate("Ballast CA").expect("CA");
    let forged = impostor.revocation_list(&[], 99).expect("CRL");
    let tmp = pki.dir().join(".forged.tmp");
    std::fs::write(&tmp, forged).expect("write");
    std::fs::rename(&tmp, pki.crl_path()).expect("replace the list");
    wait_above("the forged list refused", errors_before, || {
        crl_reloads(&agg, "error")
    });
    // web-07 keeps trying, with its backoff (up to 5 s): its next handshake after the
    // forged list must still be refused as revoked, however long that takes.
    let refused_at_forgery = connections_rejected(&agg, "revoked");
    wait_above(
        "web-07's next handshake after the forged list refused as revoked",
        refused_at_forgery,
        || connections_rejected(&agg, "revoked"),
    );

    // 4. The list's file goes missing (a botched deploy, a volume not mounted), then
    //    comes back as something that is no list at all: neither is an empty list,
    //    and the list in force stays, so web-07 stays out.
    let errors_before = crl_reloads(&agg, "error");
    std::fs::remove_file(pki.crl_path()).expect("remove the list");
    wait_above("the missing list counted", errors_before, || {
        crl_reloads(&agg, "error")
    });
    let refused_while_missing = connections_rejected(&agg, "revoked");
    wait_above(
        "web-07's next handshake with the list missing refused as revoked",
        refused_while_missing,
        || connections_rejected(&agg, "revoked"),
    );
    let tmp = pki.dir().join(".garbage.tmp");
    std::fs::write(
        &tmp,
        "-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n",
    )
    .expect("write");
    std::fs::rename(&tmp, pki.crl_path()).expect("replace the list");
    let refused_with_garbage = connections_rejected(&agg, "revoked");
    wait_above(
        "web-07's next handshake with an unreadable list refused as revoked",
        refused_with_garbage,
        || connections_rejected(&agg, "revoked"),
    );
    assert_eq!(
        crl_reloads(&agg, "applied"),
        applied_before_forgery,
        "a missing or unreadable list was applied"
    );

    // The rest of the fleet was balanced all along, and web-07 never came back.
    holds_for(
        Duration::from_secs(2),
        "the fleet served, web-07 out",
        || {
            let s = revoked.status();
            if s.connected_to.is_some() {
                return Err(format!("web-07 reconnected: {s:?}"));
            }
            let s = expired.status();
            if s.connected_to.is_some() || s.weight.is_some() {
                return Err(format!("web-99 got through: {s:?}"));
            }
            let live: Vec<String> = agg
                .endpoints(SERVICE)
                .into_iter()
                .filter(|e| e.report_age_ms.is_some_and(|a| a <= 2000))
                .map(|e| e.node)
                .collect();
            if live.len() != fleet.len() {
                return Err(format!("reporting: {live:?}"));
            }
            if live.iter().any(|n| n == "web-07" || n == "web-99") {
                return Err(format!("reporting: {live:?}"));
            }
            fleet.iter().try_for_each(|a| match a.status().weight {
                Some(_) if a.status().connected_to.is_some() => Ok(()),
                _ => Err(format!("{} lost its link", a.node())),
            })
        },
    );
    let updates_after = agg.service(SERVICE).stats.updates;
    assert!(
        updates_after >= updates_at_revocation + 3 && updates_at_revocation >= updates_before,
        "web was balanced: {updates_before}, {updates_at_revocation} at the revocation, then \
         {updates_after} updates"
    );
}
