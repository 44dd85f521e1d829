//! Scenario: the xDS port's TLS modes.
//!
//! 1. **`--xds-tls tls`.** A real aggregator serves ADS over TLS with its server
//!    certificate and asks no client certificate. A client that speaks plaintext, or that
//!    trusts another CA (an attacker's server would need a certificate from it), gets
//!    no endpoint; a client that trusts the aggregator's CA gets the service's
//!    ClusterLoadAssignment, and so does a proxyless `grpcio` client bootstrapped with
//!    `channel_creds` of type `tls` and the CA file: its calls reach every backend.
//! 2. **`--xds-tls mutual`** (the shipped default). A client without a certificate is
//!    refused; a `grpcio`
//!    client with a certificate from the aggregator's CA
//!    (`certificate_file`/`private_key_file` in its bootstrap) is served.
//! 3. **`--xds-tls plaintext`**, asked for explicitly, serves plaintext clients.

use ballast_tests::harness::ads::{xds_aggregator_opts, EdsWatch, OPEN_FAILED};
use ballast_tests::harness::aggregator::{XdsTarget, XdsTls};
use ballast_tests::harness::converge::{node_names, start_speeds};
use ballast_tests::harness::grpc::{require_grpcio, Backends, XdsClient};
use ballast_tests::*;
use std::time::Duration;

const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];

/// How [`served`]'s error starts when the client gave up, followed by why.
const STOPPED: &str = "the client stopped";

/// Whether `target` gets the service's endpoints within 15 s, or why not.
fn served(target: XdsTarget, service: &str) -> Result<usize, String> {
    let watch = EdsWatch::start(target, service);
    // Generous for the client that is served; one that is refused stops at once.
    let got = wait_for_result(Duration::from_secs(15), || {
        if let Some(why) = watch.ended() {
            return Err(format!("{STOPPED}: {why}"));
        }
        let resp = watch.latest().ok_or("no response yet")?;
        Ok(resp.endpoints()?.len())
    });
    drop(watch);
    got
}

/// Polls `f` until it is `Ok` or `within` passes; its last error otherwise.
fn wait_for_result<T>(
    within: Duration,
    mut f: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = std::time::Instant::now() + within;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(e) if e.starts_with(STOPPED) => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn fleet(pki: &Pki, agg: &Aggregator, service: &str, backends: &Backends) -> Vec<Agent> {
    let nodes = node_names(service, SPEEDS.len());
    start_speeds(pki, agg, service, &nodes, &SPEEDS, |_, o| {
        o.address = Some(backends.address(&o.node));
    })
}

#[test]
fn the_xds_port_with_tls_checks_the_server() {
    const SERVICE: &str = "xdstls";
    require_grpcio();
    let dir = tempfile::tempdir().expect("temporary directory");
    let pki = Pki::new();
    let opts = AggregatorOpts {
        xds_tls: XdsTls::Tls,
        ..xds_aggregator_opts()
    };
    let agg = Aggregator::start(&pki, opts);
    let nodes = node_names(SERVICE, SPEEDS.len());
    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let backends = Backends::start(&names, dir.path());
    let _agents = fleet(&pki, &agg, SERVICE, &backends);
    agg.wait_for_endpoints(SERVICE, SPEEDS.len(), Duration::from_secs(15));

    let good = agg.xds();
    assert!(good.ca.is_some(), "TLS: the client checks the server");
    assert_eq!(served(good.clone(), SERVICE), Ok(SPEEDS.len()));

    let plaintext = XdsTarget {
        ca: None,
        ..good.clone()
    };
    let why =
        served(plaintext, SERVICE).expect_err("a plaintext client was served by the TLS port");
    eprintln!("plaintext: {why}");
    assert!(
        // Which error follows is a race: under TLS 1.3 the client's side of the
        // handshake ends before the server has read its bytes or checked its
        // certificate, so a refused client sees the server's alert, a closed
        // connection, a broken pipe or an HTTP/2 error, whichever comes first.
        why.starts_with(&format!("{STOPPED}: {OPEN_FAILED}")),
        "the TLS port closes on a plaintext client before any response: {why}"
    );
    let other = Pki::new();
    let wrong_ca = XdsTarget {
        ca: Some(other.dir().join("ca.pem")),
        ..good.clone()
    };
    let why =
        served(wrong_ca, SERVICE).expect_err("a client that trusts another CA accepted the server");
    eprintln!("wrong_ca: {why}");
    assert!(
        why.starts_with(STOPPED) && why.contains("InvalidCertificate"),
        "the client refuses a server certificate from another CA: {why}"
    );

    let mut client = XdsClient::start(&good, SERVICE, "tls-client", None, dir.path());
    let round = client.round(200, Duration::from_secs(30));
    assert!(
        round.errors.is_empty() && round.counts.len() == SPEEDS.len(),
        "grpcio over TLS: {round:?}\n{}",
        client.stderr_tail()
    );
}

#[test]
fn mutual_tls_serves_only_clients_with_a_certificate_from_the_ca() {
    const SERVICE: &str = "xdsmtls";
    require_grpcio();
    let dir = tempfile::tempdir().expect("temporary directory");
    let pki = Pki::new();
    let opts = AggregatorOpts {
        xds_tls: XdsTls::Mutual,
        ..xds_aggregator_opts()
    };
    let agg = Aggregator::start(&pki, opts);
    let nodes = node_names(SERVICE, SPEEDS.len());
    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let backends = Backends::start(&names, dir.path());
    let _agents = fleet(&pki, &agg, SERVICE, &backends);
    agg.wait_for_endpoints(SERVICE, SPEEDS.len(), Duration::from_secs(15));

    let anonymous = agg.xds();
    let why = served(anonymous.clone(), SERVICE)
        .expect_err("a client without a certificate was served under mutual TLS");
    eprintln!("anonymous: {why}");
    assert!(
        why.starts_with(&format!("{STOPPED}: {OPEN_FAILED}")),
        "the server asks for a client certificate and gets none: {why}"
    );
    let client_dir = pki.node_tls_dir("proxy-1");
    let known = XdsTarget {
        client: Some((client_dir.join("node.pem"), client_dir.join("node.key"))),
        ..anonymous
    };
    assert_eq!(served(known.clone(), SERVICE), Ok(SPEEDS.len()));
    let mut client = XdsClient::start(&known, SERVICE, "mtls-client", None, dir.path());
    let round = client.round(200, Duration::from_secs(30));
    assert!(
        round.errors.is_empty() && round.counts.len() == SPEEDS.len(),
        "grpcio with a client certificate: {round:?}\n{}",
        client.stderr_tail()
    );
}

#[test]
fn plaintext_is_served_when_asked_for() {
    const SERVICE: &str = "xdsplain";
    let pki = Pki::new();
    let opts = AggregatorOpts {
        xds_tls: XdsTls::Plaintext,
        ..xds_aggregator_opts()
    };
    let agg = Aggregator::start(&pki, opts);
    let _agents = start_fleet(&pki, &agg, SERVICE, 2, &[1.0]);
    agg.wait_for_endpoints(SERVICE, 2, Duration::from_secs(15));
    let target = agg.xds();
    assert!(target.ca.is_none());
    assert_eq!(served(target, SERVICE), Ok(2));
}

#[test]
fn mutual_tls_checks_the_revocation_list_and_closes_revoked_clients() {
    const SERVICE: &str = "xdscrl";
    let pki = Pki::new();
    // The list exists before the start: revoke a certificate nobody uses.
    pki.node_tls_dir("nobody");
    pki.revoke("nobody");
    let opts = AggregatorOpts {
        xds_tls: XdsTls::Mutual,
        config_toml: Some(format!(
            "[authorization]\ncrl = {:?}\ncrl_check_ms = 200\n",
            pki.crl_path()
        )),
        ..xds_aggregator_opts()
    };
    let agg = Aggregator::start(&pki, opts);
    let _agents = start_fleet(&pki, &agg, SERVICE, 2, &[1.0]);
    agg.wait_for_endpoints(SERVICE, 2, Duration::from_secs(15));
    let with = |id: &str| {
        let dir = pki.node_tls_dir(id);
        XdsTarget {
            client: Some((dir.join("node.pem"), dir.join("node.key"))),
            ..agg.xds()
        }
    };
    let watch = EdsWatch::start(with("proxy-1"), SERVICE);
    wait_for(Duration::from_secs(15), "proxy-1 served", || {
        watch
            .latest()
            .map(|_| ())
            .ok_or_else(|| "no response yet".to_string())
    });
    pki.revoke("proxy-1");
    wait_for(
        Duration::from_secs(10),
        "proxy-1's live stream closed",
        || match watch.ended() {
            Some(_) => Ok(()),
            None => Err("still open".to_string()),
        },
    );
    assert_eq!(
        agg.counter("ballast_xds_refused_total", &[("reason", "revoked")]),
        1.0
    );
    let why = served(with("proxy-1"), SERVICE).expect_err("a revoked client was served");
    assert!(why.starts_with(STOPPED), "{why}");
    assert!(agg.counter("ballast_xds_refused_total", &[("reason", "tls")]) >= 1.0);
    assert_eq!(served(with("proxy-2"), SERVICE), Ok(2));
}
