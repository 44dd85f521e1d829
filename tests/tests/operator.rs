//! Scenario: operators act on a fleet from the control plane, off the host.
//!
//! An aggregator in a network namespace of the test's own serves its API on the
//! namespace's 10.x address over TLS, with a token file holding a viewer and an
//! operator, to three agents on the host.
//!
//! 1. **Roles.** A drain without a credential is 401; with the viewer's token 403;
//!    with the operator's but no reason 400, counted. The viewer reads the audit trail.
//! 2. **A central drain of a wedged node.** The agent of `web-2` is frozen (SIGSTOP);
//!    the operator drains it with `ballast-aggregator drain` over https:// with a
//!    token file. Within one cycle the API has it draining at weight 0; the audit
//!    trail says who (the token's name), from which address, and why. The agent let
//!    go again says it serves; the operator's drain still holds. The dashboard's
//!    service page shows the drain and who set it. It holds after the
//!    aggregator restarts too (kept in the routing store with the service).
//! 3. **A hold.** `ballast-aggregator hold web --for 30m`: while the agents' loads
//!    change, every published weight stays the same to the bit and the service says
//!    `held`; `release` lets the controllers steer within one cycle.

use ballast_tests::harness::aggregator::ApiAccess;
use ballast_tests::harness::api::{parse_metrics, sum_samples, token_entry};
use ballast_tests::harness::netns::Netns;
use ballast_tests::*;
use std::path::Path;
use std::time::{Duration, Instant};

const SERVICE: &str = "web";
const VIEWER_TOKEN: &str = "viewer-0b6f3c1d9e2a4f7b8c5d6e0a";
const OPERATOR_TOKEN: &str = "operator-7e2d9a4c1b8f0e3d6a5c2b9f";
const CYCLE_MS: u64 = 500;

/// [`Aggregator::cli`] with `--ca` and `--token-file`.
fn cli(agg: &Aggregator, ca: &Path, token_file: &Path, args: &[&str]) -> String {
    let (ca, token_file) = (ca.to_string_lossy(), token_file.to_string_lossy());
    let mut args = args.to_vec();
    args.extend(["--ca", &ca, "--token-file", &token_file]);
    agg.cli(&args)
}

/// The published weight and draining flag of `node`, as `/v1/published` has them.
fn published(agg: &Aggregator, node: &str) -> Option<(f64, bool)> {
    let p = agg.published();
    let e = p.services.get(SERVICE)?.endpoints.get(node)?.clone();
    Some((e.weight, e.draining))
}

#[test]
fn operators_drain_a_wedged_node_and_hold_a_service_off_the_host() {
    let ns = Netns::new();
    let ip = ns.ip().to_string();
    let pki = Pki::with_server_names(&[&ip]);
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("api-tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "{}\n{}",
            token_entry("grafana", "viewer", VIEWER_TOKEN),
            token_entry("oncall-alice", "operator", OPERATOR_TOKEN)
        ),
    )
    .expect("write the token file");
    let operator_token = dir.path().join("operator.token");
    std::fs::write(&operator_token, format!("{OPERATOR_TOKEN}\n")).expect("write");
    let tls = pki.server_tls_dir();
    let config = format!(
        "[http_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\n[http_auth]\ntokens = {tokens:?}\n",
        tls.join("ca.pem"),
        tls.join("server.pem"),
        tls.join("server.key"),
    );
    let ca = pki.dir().join("ca.pem");
    let viewer = ApiAccess {
        ca: ca.clone(),
        token: Some(VIEWER_TOKEN.to_string()),
    };
    let mut agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(config),
            api: Some(viewer.clone()),
            ..AggregatorOpts::default().cycle_ms(CYCLE_MS).netns(&ns)
        },
    );
    assert!(agg.base_url().starts_with(&format!("https://{ip}:")));
    let agents: Vec<Agent> = (1..=3)
        .map(|i| {
            let opts = AgentOpts {
                noise: 0.1,
                ..AgentOpts::new(SERVICE, &format!("web-{i}"))
            };
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    for a in &agents {
        a.wait_weight(Duration::from_secs(20));
    }
    agg.wait_for_endpoints(SERVICE, 3, Duration::from_secs(20));

    // 1. Roles, and a reason.
    let drain_url = format!(
        "{}/v1/services/{SERVICE}/endpoints/web-2/drain",
        agg.base_url()
    );
    let anonymous = ApiAccess {
        ca: ca.clone(),
        token: None,
    }
    .client();
    let body = serde_json::json!({ "reason": "disk full on web-2" });
    let status = |c: &reqwest::blocking::Client, body: &serde_json::Value| {
        c.post(&drain_url)
            .json(body)
            .send()
            .expect("POST drain")
            .status()
            .as_u16()
    };
    assert_eq!(status(&anonymous, &body), 401);
    assert_eq!(status(&viewer.client(), &body), 403);
    let operator = ApiAccess {
        ca: ca.clone(),
        token: Some(OPERATOR_TOKEN.to_string()),
    }
    .client();
    assert_eq!(status(&operator, &serde_json::json!({})), 400);
    assert_eq!(
        status(&operator, &serde_json::json!({ "reason": " " })),
        400
    );
    assert_eq!(published(&agg, "web-2").map(|p| p.1), Some(false));
    let refused = sum_samples(
        &parse_metrics(&agg.metrics()),
        "ballast_operator_actions_total",
        &[("action", "drain")],
    );
    assert_eq!(refused, 2.0, "both refusals counted");

    // 2. The node's agent wedges; the operator drains it from the control plane.
    agents[1].pause();
    let asked = Instant::now();
    let said = cli(
        &agg,
        &ca,
        &operator_token,
        &[
            "drain",
            "web-2",
            "--service",
            SERVICE,
            "--reason",
            "disk full on web-2",
        ],
    );
    assert!(said.contains("oncall-alice"), "{said}");
    wait_for(
        Duration::from_millis(CYCLE_MS),
        "web-2 drained in the published weights",
        || match published(&agg, "web-2") {
            Some((0.0, true)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    eprintln!(
        "drain of a wedged node published {} ms after the CLI started",
        asked.elapsed().as_millis()
    );
    let detail = agg.service(SERVICE);
    assert_eq!(detail.operator.drains["web-2"].by, "oncall-alice");
    let audit: Vec<ballast_aggregator::audit::AuditRecord> = agg.get_json("/v1/audit");
    let record = audit.first().expect("an audit record");
    assert_eq!(
        (
            record.who.as_str(),
            record.via.as_str(),
            record.action.as_str(),
            record.node.as_deref(),
            record.reason.as_str()
        ),
        (
            "oncall-alice",
            "token",
            "drain",
            Some("web-2"),
            "disk full on web-2"
        )
    );
    let (code, page) = agg.get(&format!("/ui/services/{SERVICE}/live"));
    assert_eq!(code, 200);
    for what in [
        "Operator actions",
        "drain web-2",
        "oncall-alice",
        "disk full on web-2",
    ] {
        assert!(page.contains(what), "the dashboard does not show {what:?}");
    }
    let from = record.from.as_deref().unwrap_or_default();
    assert!(from.starts_with(&ns.host_ip().to_string()), "from {from}");

    // Let go, its agent says it serves: the operator's drain holds.
    agents[1].resume();
    holds_for(
        Duration::from_millis(4 * CYCLE_MS),
        "web-2 stays drained while its agent reports",
        || match published(&agg, "web-2") {
            Some((0.0, true)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    // And across a restart.
    agg.restart();
    wait_for(
        Duration::from_secs(10),
        "the restarted aggregator to serve web-2",
        || published(&agg, "web-2").ok_or("not yet".to_string()),
    );
    holds_for(
        Duration::from_millis(6 * CYCLE_MS),
        "web-2 drained after the restart",
        || match published(&agg, "web-2") {
            Some((0.0, true)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    cli(
        &agg,
        &ca,
        &operator_token,
        &[
            "undrain",
            "web-2",
            "--service",
            SERVICE,
            "--reason",
            "disk cleaned",
        ],
    );
    wait_for(Duration::from_secs(3), "web-2 back", || {
        match published(&agg, "web-2") {
            Some((w, false)) if w > 0.0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });

    // 3. A hold: weights to the bit while the loads move.
    cli(
        &agg,
        &ca,
        &operator_token,
        &["hold", SERVICE, "--for", "30m", "--reason", "risky deploy"],
    );
    let frozen = |agg: &Aggregator| -> Vec<(String, u64)> {
        let p = agg.published();
        p.services[SERVICE]
            .endpoints
            .iter()
            .map(|(n, e)| (n.to_string(), e.weight.to_bits()))
            .collect()
    };
    let at_hold = frozen(&agg);
    let cycles_before = agg.service(SERVICE).stats.cycles;
    holds_for(
        Duration::from_millis(8 * CYCLE_MS),
        "weights frozen to the bit",
        || {
            let now = frozen(&agg);
            (now == at_hold)
                .then_some(())
                .ok_or(format!("{now:?} != {at_hold:?}"))
        },
    );
    let detail = agg.service(SERVICE);
    assert!(
        detail.stats.cycles >= cycles_before + 6,
        "cycles ran meanwhile"
    );
    assert_eq!(
        detail.last_skip.map(|s| s.label()),
        Some("held"),
        "{:?}",
        detail.last_skip_reason
    );
    assert!(detail.operator.hold.is_some_and(|h| h.until_ms.is_some()));
    let updates = detail.stats.updates;
    cli(
        &agg,
        &ca,
        &operator_token,
        &["release", SERVICE, "--reason", "deploy done"],
    );
    let released = Instant::now();
    wait_for(
        Duration::from_millis(2 * CYCLE_MS),
        "a controller update after the release",
        || {
            let s = agg.service(SERVICE);
            (s.stats.updates > updates)
                .then_some(())
                .ok_or(format!("{:?}", s.last_skip_reason))
        },
    );
    eprintln!(
        "first update {} ms after the release",
        released.elapsed().as_millis()
    );
    let audit: Vec<ballast_aggregator::audit::AuditRecord> = agg.get_json("/v1/audit");
    let actions: Vec<&str> = audit.iter().map(|r| r.action.as_str()).collect();
    // The trail in memory starts with the restarted process; the drain before it is
    // in the first process's log.
    assert_eq!(actions, ["release", "hold", "undrain"]);
}
