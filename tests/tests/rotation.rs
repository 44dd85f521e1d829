//! Scenario: certificates renewed while everything runs.
//!
//! - Short-lived node certificates (valid 40 s) are issued again every 10 s for 100 s,
//!   written over the agents' files; half-way the aggregator's server certificate is
//!   replaced too. Each agent moves to a connection made with its new
//!   certificate before closing the old one: no cycle lacks a report, no endpoint is
//!   ever missing, no connection is refused, and no agent reconnects. New handshakes
//!   get the new server certificate within the aggregator's check interval.
//! - A certificate written with a key that is not its own (agent and aggregator
//!   alike) is refused, counted, and the pair in force stays: agents keep reporting.
//! - SPIFFE: agents whose only identity is a SPIFFE ID (X.509-SVIDs as SPIRE issues
//!   them, from a CA that is not Ballast's), granted their service by a policy rule on
//!   the SPIFFE ID, are balanced, and move connections when their SVID is renewed.

use ballast_shared::pki::{Ca, NodeSpec, Pem};
use ballast_tests::harness::api::{parse_metrics, sum_samples};
use ballast_tests::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SERVICE: &str = "web";
const WAIT: Duration = Duration::from_secs(20);
const CYCLE_MS: u64 = 500;

/// Cycles and reports every half second.
fn opts() -> AggregatorOpts {
    AggregatorOpts::default()
        .grace_ms(500)
        .cycle_ms(CYCLE_MS)
        .report_interval_ms(500)
}

fn now_s() -> i64 {
    i64::try_from(ballast_shared::unix_ms() / 1000).expect("time")
}

/// Replaces `path` with `text` at once (a rename), as certificate tools do.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Writes `pem` as `NAME.pem` and `NAME.key` in `dir`, certificate first.
fn install(dir: &Path, name: &str, pem: &Pem) {
    replace(&dir.join(format!("{name}.pem")), &pem.cert);
    replace(&dir.join(format!("{name}.key")), &pem.key);
}

/// A node certificate of `ca` for `node`, serving [`SERVICE`], valid for `validity`.
fn node_cert(ca: &Ca, node: &str, validity: Duration) -> Pem {
    let spec = NodeSpec::new(node, &[SERVICE.to_string()], validity).expect("spec");
    ca.issue_node_with(&spec).expect("issue").pem
}

/// An agent TLS directory of its own for `node`, with a certificate valid `validity`.
fn agent_dir(pki: &Pki, root: &Path, node: &str, validity: Duration) -> PathBuf {
    let dir = root.join(node);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(pki.dir().join("ca.pem"), dir.join("ca.pem")).expect("ca.pem");
    install(&dir, "node", &node_cert(&pki.ca(), node, validity));
    dir
}

fn tls_reloads(agg: &Aggregator, file: &str, result: &str) -> f64 {
    agg.counter(
        "ballast_tls_reloads_total",
        &[("file", file), ("result", result)],
    )
}

fn agent_metric(addr: std::net::SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client")
        .get(format!("http://{addr}/metrics"))
        .send()
        .and_then(|r| r.text())
        .expect("agent metrics");
    sum_samples(&parse_metrics(&text), name, labels)
}

/// The leaf certificate a new handshake with `agg` gets.
fn served_leaf(pki: &Pki, agg: &Aggregator) -> Vec<u8> {
    let client = RawClient::for_node(pki, "probe");
    let conn = client.connect(agg.quic_addr()).expect("handshake");
    conn.server_chain()
        .into_iter()
        .next()
        .expect("a server certificate")
}

fn leaf_der(pem: &Pem) -> Vec<u8> {
    pem.identity("leaf").expect("parse").chain[0].to_vec()
}

/// What one look at the service found: endpoints not fresh.
struct Watch {
    looks: u32,
    missing: Vec<String>,
    max_age_ms: u64,
}

impl Watch {
    fn new() -> Watch {
        Watch {
            looks: 0,
            missing: Vec::new(),
            max_age_ms: 0,
        }
    }

    /// Looks at the service's endpoints once: each of `nodes` listed and not missing.
    fn look(&mut self, agg: &Aggregator, nodes: &[&str], at: Duration) {
        let eps: serde_json::Value = agg.get_json(&format!("/v1/services/{SERVICE}/endpoints"));
        let eps = eps.as_array().cloned().unwrap_or_default();
        self.looks += 1;
        for node in nodes {
            match eps.iter().find(|e| e["node"] == *node) {
                Some(e) if e["state"] == "missing" => self
                    .missing
                    .push(format!("{node} missing at {:.1} s", at.as_secs_f64())),
                Some(e) => {
                    let age = e["report_age_ms"].as_u64().unwrap_or(0);
                    self.max_age_ms = self.max_age_ms.max(age);
                }
                None => self
                    .missing
                    .push(format!("{node} not listed at {:.1} s", at.as_secs_f64())),
            }
        }
    }
}

fn skipped_missing(agg: &Aggregator) -> f64 {
    agg.counter(
        "ballast_cycles_skipped_total",
        &[("service", SERVICE), ("reason", "missing")],
    )
}

/// Connections the aggregator refused or closed, but for those that sent no hello in
/// time: the probes of [`served_leaf`], which hang up without one (the agents always
/// send theirs).
fn refused_total(agg: &Aggregator) -> f64 {
    agg.counter("ballast_connections_rejected_total", &[])
        - agg.counter(
            "ballast_connections_rejected_total",
            &[("reason", "hello_timeout")],
        )
}

#[test]
fn certificates_renewed_every_10_s_move_connections_without_a_missed_report() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, opts());
    let root = tempfile::tempdir().expect("tempdir");
    let nodes = ["web-1", "web-2", "web-3"];
    let validity = Duration::from_secs(40);
    let agents: Vec<Agent> = nodes
        .iter()
        .map(|n| {
            let dir = agent_dir(&pki, root.path(), n, validity);
            Agent::start(&pki, &agg, AgentOpts::new(SERVICE, n).tls_dir(dir))
        })
        .collect();
    for a in &agents {
        a.wait_weight(WAIT);
    }
    agg.wait_for_endpoints(SERVICE, nodes.len(), WAIT);
    let skipped_before = skipped_missing(&agg);
    let refused_before = refused_total(&agg);

    let ca = pki.ca();
    let run = Duration::from_secs(100);
    let every = Duration::from_secs(10);
    let started = Instant::now();
    let mut next_renewal = every;
    let mut renewals = 0;
    let mut server_swap: Option<(Vec<u8>, Instant)> = None;
    let mut server_taken_after = None;
    let mut watch = Watch::new();
    while started.elapsed() < run {
        let at = started.elapsed();
        if at >= next_renewal {
            for n in nodes {
                install(&root.path().join(n), "node", &node_cert(&ca, n, validity));
            }
            renewals += 1;
            next_renewal += every;
        }
        if server_swap.is_none() && at >= run / 2 {
            let names = ["localhost".to_string(), "127.0.0.1".to_string()];
            let server = ca.issue_server(&names).expect("server certificate");
            install(pki.dir(), "server", &server);
            server_swap = Some((leaf_der(&server), Instant::now()));
        }
        if let (Some((leaf, written)), None) = (&server_swap, server_taken_after) {
            if served_leaf(&pki, &agg) == *leaf {
                server_taken_after = Some(written.elapsed());
            }
        }
        watch.look(&agg, &nodes, at);
        std::thread::sleep(Duration::from_millis(200));
    }

    let taken = server_taken_after.expect("the new server certificate was never served");
    eprintln!(
        "renewals: {renewals}; looks: {}; oldest report seen: {} ms; new server \
         certificate served {} ms after it was written",
        watch.looks,
        watch.max_age_ms,
        taken.as_millis()
    );
    assert!(renewals >= 8, "{renewals}");
    assert!(
        taken < Duration::from_millis(2500),
        "the new server certificate took {taken:?}"
    );
    assert!(watch.missing.is_empty(), "{:?}", watch.missing);
    assert_eq!(
        skipped_missing(&agg) - skipped_before,
        0.0,
        "cycles skipped"
    );
    assert_eq!(
        refused_total(&agg) - refused_before,
        0.0,
        "connections refused:\n{}",
        agg.metrics()
    );
    assert_eq!(tls_reloads(&agg, "certificate", "applied"), 1.0);
    for a in &agents {
        let st = a.status();
        assert_eq!(st.connections, 1, "{}: reconnected: {st:?}", a.node());
        assert_eq!(st.rejections, 0, "{}: refused: {st:?}", a.node());
        assert!(
            st.certificate_moves >= renewals - 1,
            "{}: {} moves for {renewals} renewals",
            a.node(),
            st.certificate_moves
        );
        assert!(st.connected_to.is_some(), "{}", a.node());
        // The certificate in force is the last one issued (40 s from a renewal).
        let expires = st.certificate_expires_unix_ms.expect("expiry") / 1000;
        let expires = i64::try_from(expires).expect("time");
        assert!(
            expires > now_s() + 20,
            "{}: expires in {} s",
            a.node(),
            expires - now_s()
        );
    }
}

#[test]
fn a_certificate_with_another_key_is_refused_and_the_pair_in_force_stays() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, opts());
    let root = tempfile::tempdir().expect("tempdir");
    let dir = agent_dir(&pki, root.path(), "web-1", Duration::from_secs(3600));
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], harness::ports::free_tcp()));
    let agent = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "web-1")
            .tls_dir(dir.clone())
            .metrics(metrics),
    );
    agent.wait_weight(WAIT);
    let served_before = served_leaf(&pki, &agg);
    let ca = pki.ca();

    // The agent: a new certificate whose key file is left as it was.
    let fresh = node_cert(&ca, "web-1", Duration::from_secs(3600));
    replace(&dir.join("node.pem"), &fresh.cert);
    // The aggregator: a new server certificate with another certificate's key.
    let names = ["localhost".to_string(), "127.0.0.1".to_string()];
    let server = ca.issue_server(&names).expect("server certificate");
    replace(&pki.dir().join("server.pem"), &server.cert);
    replace(&pki.dir().join("server.key"), &fresh.key);

    let mismatch = [("file", "certificate"), ("result", "key_mismatch")];
    let once = |n: f64| {
        if n == 1.0 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    };
    wait_for(WAIT, "the agent refuses the pair", || {
        once(agent_metric(
            metrics,
            "ballast_agent_tls_reloads_total",
            &mismatch,
        ))
    });
    wait_for(WAIT, "the aggregator refuses the pair", || {
        once(tls_reloads(&agg, "certificate", "key_mismatch"))
    });
    let sent = agent.status().reports_sent;
    // Counted once, however long the files stay so.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        agent_metric(metrics, "ballast_agent_tls_reloads_total", &mismatch),
        1.0
    );
    assert_eq!(tls_reloads(&agg, "certificate", "key_mismatch"), 1.0);
    assert_eq!(tls_reloads(&agg, "certificate", "applied"), 0.0);
    assert_eq!(
        served_leaf(&pki, &agg),
        served_before,
        "the old pair is served"
    );
    let st = agent.status();
    assert!(
        st.reports_sent >= sent + 4,
        "reports go on: {sent} -> {}",
        st.reports_sent
    );
    assert_eq!((st.connections, st.certificate_moves), (1, 0), "{st:?}");
    let log = agent.log_tail(200);
    assert!(
        log.contains("new TLS file refused") && log.contains("does not match"),
        "{log}"
    );

    // The matching key follows: both take the new pair.
    replace(&dir.join("node.key"), &fresh.key);
    replace(&pki.dir().join("server.key"), &server.key);
    let applied = [("file", "certificate"), ("result", "applied")];
    wait_for(WAIT, "the agent moves to the new pair", || {
        match agent.status().certificate_moves {
            1 => Ok(()),
            n => Err(format!("{n} moves")),
        }
    });
    assert_eq!(
        agent_metric(metrics, "ballast_agent_tls_reloads_total", &applied),
        1.0
    );
    wait_for(WAIT, "the new server certificate served", || {
        if served_leaf(&pki, &agg) == leaf_der(&server) {
            Ok(())
        } else {
            Err("the old one".to_string())
        }
    });
    assert_eq!(agent.status().connections, 1);
}

#[test]
fn spiffe_identities_from_another_ca_are_balanced_and_renewed_live() {
    let pki = Pki::new();
    let spire = Ca::generate("SPIRE test CA").expect("spire CA");
    let domain = "spiffe://prod.example/ns/web/sa";
    // The aggregator trusts both CAs for clients; agents trust both (the server's
    // certificate is Ballast's, their own SPIRE's).
    let bundle = format!(
        "{}{}",
        std::fs::read_to_string(pki.dir().join("ca.pem")).expect("ca.pem"),
        spire.pem().cert
    );
    let policy = pki.dir().join("policy.toml");
    std::fs::write(
        &policy,
        format!(
            "certificate_services = false\n[[rule]]\nspiffe_ids = [\"{domain}/*\"]\n\
             services = [\"{SERVICE}\"]\n"
        ),
    )
    .expect("policy");
    let root = tempfile::tempdir().expect("tempdir");
    let svid = |node: &str| {
        let now = now_s();
        // SPIRE's default: an hour, backdated a little.
        spire
            .issue_svid(&format!("{domain}/{node}"), (now - 10, now + 3600))
            .expect("svid")
    };
    let nodes = ["web-1", "web-2"];
    let dirs: Vec<PathBuf> = nodes
        .iter()
        .map(|n| {
            let dir = root.path().join(n);
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join("ca.pem"), &bundle).expect("bundle");
            install(&dir, "node", &svid(n));
            dir
        })
        .collect();
    // The client CA bundle is taken from the aggregator's CA file.
    std::fs::write(pki.dir().join("ca.pem"), &bundle).expect("bundle");
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(format!("[authorization]\npolicy = {policy:?}\n")),
            ..opts()
        },
    );
    let agents: Vec<Agent> = nodes
        .iter()
        .zip(&dirs)
        .map(|(n, d)| Agent::start(&pki, &agg, AgentOpts::new(SERVICE, n).tls_dir(d.clone())))
        .collect();
    for a in &agents {
        a.wait_weight(WAIT);
    }
    agg.wait_for_endpoints(SERVICE, nodes.len(), WAIT);
    let skipped_before = skipped_missing(&agg);

    // SVIDs renewed every 10 s for 40 s (SPIRE renews at half the lifetime; faster
    // here).
    let started = Instant::now();
    let mut watch = Watch::new();
    let mut next = Duration::from_secs(10);
    let mut renewals = 0;
    while started.elapsed() < Duration::from_secs(40) {
        let at = started.elapsed();
        if at >= next {
            for (n, d) in nodes.iter().zip(&dirs) {
                install(d, "node", &svid(n));
            }
            renewals += 1;
            next += Duration::from_secs(10);
        }
        watch.look(&agg, &nodes, at);
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(watch.missing.is_empty(), "{:?}", watch.missing);
    assert_eq!(skipped_missing(&agg) - skipped_before, 0.0);
    assert_eq!(refused_total(&agg), 0.0, "{}", agg.metrics());
    for a in &agents {
        let st = a.status();
        assert_eq!(st.connections, 1, "{}: {st:?}", a.node());
        assert_eq!(st.rejections, 0, "{}: {st:?}", a.node());
        assert_eq!(st.certificate_moves, renewals, "{}: {st:?}", a.node());
    }

    // An SVID of another namespace, with the same last segment, is granted nothing.
    let stranger = root.path().join("stranger");
    std::fs::create_dir_all(&stranger).expect("mkdir");
    std::fs::write(stranger.join("ca.pem"), &bundle).expect("bundle");
    let now = now_s();
    let other = spire
        .issue_svid(
            "spiffe://prod.example/ns/batch/sa/web-9",
            (now - 10, now + 3600),
        )
        .expect("svid");
    install(&stranger, "node", &other);
    let refused = Agent::start(
        &pki,
        &agg,
        AgentOpts::new(SERVICE, "web-9").tls_dir(stranger),
    );
    let reason = wait_for(WAIT, "the stranger refused", || {
        refused
            .status()
            .rejection
            .map(|r| r.reason)
            .ok_or_else(|| "not yet".to_string())
    });
    assert_eq!(reason, "service_not_allowed");
}
