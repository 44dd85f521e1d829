//! Scenario: the relay's HTTP port (`/metrics`, `/healthz`) leaves the host safely, by
//! the aggregator's rules.
//!
//! 1. **Refused off loopback.** In a network namespace of the test's own, a relay
//!    whose HTTP port is on the namespace's 10.x address, without TLS and credentials,
//!    refuses to start, and its message says what to add (`[http_tls]`, a token file
//!    with a `scrape` entry or `[http_auth.cert_roles] scrape`, or `insecure_http`);
//!    with TLS alone it still refuses, for the credential.
//! 2. **TLS, a scrape token and a scrape certificate.** The same relay with
//!    `[http_tls]` (the harness's server certificate, which names the namespace's
//!    address) and `[http_auth]` (a token file of argon2 hashes, and client
//!    certificates named `prom-*` as scrapers) starts there, and:
//!    - plain HTTP gets no answer;
//!    - `/healthz` is open (200, `"role": "relay"`);
//!    - `/metrics` without a credential is 401 with `WWW-Authenticate: Bearer`, with a
//!      wrong token 401, with the scrape token 200, with a client certificate named
//!      `prom-1` 200, with one of the CA that holds no role 403;
//!    - each refusal is counted by reason in `ballast_relay_http_auth_failures_total`.
//!
//! The relay needs no etcd to serve these: its routes follower retries in the
//! background (the endpoint given is closed).

use ballast_tests::harness::api::{parse_metrics, sum_samples, token_entry};
use ballast_tests::harness::netns::Netns;
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::harness::process::{Proc, RELAY_BIN};
use ballast_tests::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

const SCRAPE_TOKEN: &str = "scrape-7d2e4f6a8b0c1d3e5f7a9b1c";
const RELAY: &str = "relay-a";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `ballast-relay` in `ns`, its HTTP port on `http`, with `config` as its file.
fn relay(pki: &Pki, ns: &std::sync::Arc<Netns>, http: &str, config: &Path) -> Command {
    let mut cmd = command(RELAY_BIN);
    cmd.args(["--quic", &format!("{}:0", ns.ip()), "--http", http])
        .arg("--tls-dir")
        .arg(pki.server_tls_dir())
        .arg("--relay-tls-dir")
        .arg(pki.relay_tls_dir(RELAY))
        .args(["--replica", "127.0.0.1:9", "--name", RELAY])
        .arg("--config")
        .arg(config);
    ns.enter(&mut cmd);
    cmd
}

/// A client trusting the harness's CA, presenting the certificate of TLS directory
/// `identity` if given.
fn client(pki: &Pki, identity: Option<&Path>) -> reqwest::blocking::Client {
    let ca = std::fs::read(pki.dir().join("ca.pem")).expect("ca.pem");
    let mut b = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).expect("CA"));
    if let Some(dir) = identity {
        let mut pem = std::fs::read(dir.join("node.pem")).expect("node.pem");
        pem.extend(std::fs::read(dir.join("node.key")).expect("node.key"));
        b = b.identity(reqwest::Identity::from_pem(&pem).expect("identity"));
    }
    b.build().expect("client")
}

/// GET `url` with `token` if given: the status, the challenge and the body.
fn get(
    c: &reqwest::blocking::Client,
    url: &str,
    token: Option<&str>,
) -> Result<(u16, Option<String>, String), String> {
    let mut req = c.get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    Ok((status, challenge, resp.text().map_err(|e| e.to_string())?))
}

#[test]
fn the_relays_metrics_off_loopback_take_tls_and_a_scrape_credential() {
    let ns = Netns::new();
    let pki = Pki::with_server_names(&[&ns.ip().to_string()]);
    let dir = tempfile::tempdir().expect("tempdir");
    let http = format!("{}:{}", ns.ip(), free_tcp());
    let config = dir.path().join("relay.toml");

    // Unprotected: refused, saying what to add.
    std::fs::write(&config, "").expect("write the config");
    let out = run_bounded(relay(&pki, &ns, &http, &config), Duration::from_secs(20));
    let said = text(&out);
    assert!(!out.status.success(), "it started: {said}");
    for what in [
        http.as_str(),
        "not a loopback address",
        "/metrics",
        "[http_tls]",
        "[http_auth]",
        "tokens =",
        "scrape",
        "insecure_http = true",
    ] {
        assert!(
            said.contains(what),
            "the refusal does not say {what:?}: {said}"
        );
    }
    // TLS without a credential: refused still, for the credential alone.
    let tls = pki.server_tls_dir();
    let http_tls = format!(
        "[http_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        tls.join("ca.pem"),
        tls.join("server.pem"),
        tls.join("server.key"),
    );
    std::fs::write(&config, &http_tls).expect("write the config");
    let out = run_bounded(relay(&pki, &ns, &http, &config), Duration::from_secs(20));
    let said = text(&out);
    assert!(!out.status.success(), "it started with TLS alone: {said}");
    assert!(
        said.contains("[http_auth]") && !said.contains("TLS: [http_tls]"),
        "the refusal asks for the credential only: {said}"
    );

    // TLS and credentials: it starts there.
    let tokens = dir.path().join("relay-tokens.toml");
    std::fs::write(&tokens, token_entry("prometheus", "scrape", SCRAPE_TOKEN))
        .expect("write the tokens");
    std::fs::write(
        &config,
        format!(
            "{http_tls}\n[http_auth]\ntokens = {tokens:?}\n\n\
             [http_auth.cert_roles]\nscrape = [\"prom-*\"]\n"
        ),
    )
    .expect("write the config");
    let log = dir.path().join("relay.log");
    let mut proc = Proc::spawn(relay(&pki, &ns, &http, &config), "ballast-relay", &log, 30);
    let base = format!("https://{http}");
    let anyone = client(&pki, None);
    wait_for(
        Duration::from_secs(20),
        "the relay's /healthz over TLS",
        || {
            if let Some(s) = proc.exit_status() {
                panic!("the relay exited ({s}): {}", proc.log_tail(30));
            }
            let (code, _, body) = get(&anyone, &format!("{base}/healthz"), None)?;
            (code == 200 && body.contains("\"relay\""))
                .then_some(())
                .ok_or_else(|| format!("{code}: {body}"))
        },
    );

    // Plain HTTP gets no metrics.
    let plain = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(3))
        .no_proxy()
        .build()
        .expect("client");
    let r = plain.get(format!("http://{http}/metrics")).send();
    assert!(
        r.as_ref().map_or(true, |r| r.status().as_u16() != 200),
        "plain HTTP was served: {r:?}"
    );

    // No credential, a wrong one: 401 with the challenge.
    let metrics = format!("{base}/metrics");
    let (code, challenge, body) = get(&anyone, &metrics, None).expect("GET /metrics");
    assert_eq!(code, 401, "{body}");
    assert!(
        challenge
            .as_deref()
            .is_some_and(|c| c.starts_with("Bearer")),
        "{challenge:?}"
    );
    let (code, _, _) = get(&anyone, &metrics, Some("not-a-token-at-all")).expect("GET");
    assert_eq!(code, 401);
    // The scrape token, a scrape certificate: the metrics.
    let (code, _, body) = get(&anyone, &metrics, Some(SCRAPE_TOKEN)).expect("GET");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("ballast_relay_trunks_open"), "{body}");
    let prom = client(&pki, Some(&pki.node_tls_dir("prom-1")));
    let (code, _, body) = get(&prom, &metrics, None).expect("GET as prom-1");
    assert_eq!(code, 200, "{body}");
    // A certificate of the CA with no role.
    let node = client(&pki, Some(&pki.node_tls_dir("node-1")));
    let (code, _, body) = get(&node, &metrics, None).expect("GET as node-1");
    assert_eq!(code, 403, "{body}");
    // /healthz stays open to a client with no credential.
    assert_eq!(
        get(&anyone, &format!("{base}/healthz"), None)
            .expect("healthz")
            .0,
        200
    );

    // Each refusal counted by reason; no token in the log.
    let (_, _, body) = get(&anyone, &metrics, Some(SCRAPE_TOKEN)).expect("GET");
    let samples = parse_metrics(&body);
    for reason in ["missing", "bad_token", "bad_cert"] {
        let n = sum_samples(
            &samples,
            "ballast_relay_http_auth_failures_total",
            &[("reason", reason)],
        );
        assert!(n >= 1.0, "no {reason} refusal counted:\n{body}");
    }
    let (status, _) = proc.terminate(Duration::from_secs(10));
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!log.contains(SCRAPE_TOKEN), "the log holds the token");
    assert!(
        !log.contains("not-a-token-at-all"),
        "the log holds the token"
    );
    eprintln!("the relay stopped: {status}");
}
