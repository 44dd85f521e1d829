//! Scenario: the aggregator's HTTP API leaves the host safely.
//!
//! 1. **Refused off loopback.** In a network namespace of the test's own, an
//!    aggregator whose HTTP listener is on the namespace's 10.x address, without TLS
//!    and credentials, refuses to start, and its message says what to add; with
//!    `--insecure-http` it starts and serves there.
//! 2. **TLS and tokens.** A real aggregator serves its API over TLS
//!    (`[http_tls]`, the harness's server certificate) with a token file of argon2
//!    hashes written by `ballast-aggregator token hash`, and client certificates of
//!    the CA named `ops-*` as viewers:
//!    - plain HTTP gets no answer; `/healthz` is open; no credential is 401 with
//!      `WWW-Authenticate: Bearer`, a wrong token 401 too;
//!    - the viewer's token reads `/v1/services`, the dashboard and `/metrics`; the
//!      scrape token reads `/metrics` and is refused (403) everything else;
//!    - a client certificate of the CA named `ops-alice` reads; one of the CA named
//!      `node-1` holds no role (403); one of another CA is refused at the handshake,
//!      and so is one revoked while the aggregator runs (`[authorization] crl`);
//!    - the OpenAPI document served names the bearer and mutualTLS schemes;
//!    - `ballast-aggregator services --url https://… --ca … --token-file …` lists the
//!      service, and `--cert/--key` does too; without a credential it fails with 401;
//!    - the viewer's entry removed from the token file while the aggregator runs, its
//!      token (verified and cached before) is refused within 2 s, no restart;
//!    - every refusal is counted by reason, and no token appears in the log.
//! 3. **A CA of its own, and its revocation list.** The HTTP listener on the
//!    certificate and CA of an operators' PKI, not the agents' (`[http_tls]` on other
//!    files), with that CA's revocation list (`[http_auth] crl`):
//!    - a client certificate the list names when the aggregator starts is refused at
//!      the handshake, while one it does not name reads;
//!    - that one revoked while the aggregator runs (`certs revoke` rewrites the list):
//!      a new connection with it is refused at the handshake within 5 s, and a
//!      connection it made before is answered 401, "revoked", on its next request;
//!    - the refusals are counted as `revoked`, and the list's reload as `applied`.
//! 4. **A CA rotated out.** The listener's CA file replaced while the aggregator runs:
//!    a connection kept alive from before, with a certificate of the old CA, is
//!    answered 403 on its next request (`bad_cert`).
//! 5. **A certificate expired.** A client certificate that expires while a connection
//!    it made is kept alive: that connection is answered 401 on its next request
//!    (`expired`).

use ballast_tests::harness::aggregator::ApiAccess;
use ballast_tests::harness::api::token_entry;
use ballast_tests::harness::netns::Netns;
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::*;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

const SERVICE: &str = "web";
const VIEWER_TOKEN: &str = "viewer-9f1c2e7a5b3d4c6e8a0b1c2d";
const SCRAPE_TOKEN: &str = "scrape-4a8b2c6d0e1f3a5b7c9d1e2f";
const OPERATOR_TOKEN: &str = "operator-6c1d3e5f7a9b0c2d4e6f8a1b";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Writes `text` to `path` in one step (a new file renamed over the old).
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// A client of the API trusting the harness's CA, with `identity` (a TLS directory
/// holding node.pem and node.key) if given, and no token.
fn client(pki: &Pki, identity: Option<&Path>) -> reqwest::blocking::Client {
    let mut b = ApiAccess {
        ca: pki.dir().join("ca.pem"),
        token: None,
    }
    .builder();
    if let Some(dir) = identity {
        let mut pem = std::fs::read(dir.join("node.pem")).expect("node.pem");
        pem.extend(std::fs::read(dir.join("node.key")).expect("node.key"));
        b = b.identity(reqwest::Identity::from_pem(&pem).expect("identity"));
    }
    b.build().expect("client")
}

/// GET `path` with `token` if given: the status and the `WWW-Authenticate` header, or
/// the transport error.
fn get(
    c: &reqwest::blocking::Client,
    agg: &Aggregator,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, Option<String>, String), String> {
    let mut req = c.get(format!("{}{path}", agg.base_url()));
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
    let body = resp.text().map_err(|e| e.to_string())?;
    Ok((status, challenge, body))
}

fn status(c: &reqwest::blocking::Client, agg: &Aggregator, path: &str, token: Option<&str>) -> u16 {
    get(c, agg, path, token)
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .0
}

#[test]
fn an_unprotected_api_off_loopback_refuses_to_start() {
    let pki = Pki::new();
    let ns = Netns::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let http = format!("{}:{}", ns.ip(), free_tcp());
    let run = |extra: &[&str]| {
        let mut cmd = command(AGGREGATOR_BIN);
        cmd.args(["run", "--quic", &format!("{}:0", ns.ip()), "--http", &http])
            .arg("--tls-dir")
            .arg(pki.dir())
            .arg("--store")
            .arg(dir.path().join("weights.json"))
            .args(extra);
        ns.enter(&mut cmd);
        cmd
    };
    let out = run_bounded(run(&[]), Duration::from_secs(20));
    let said = text(&out);
    assert!(!out.status.success(), "it started: {said}");
    for what in [
        http.as_str(),
        "not a loopback address",
        "[http_tls]",
        "[http_auth]",
        "tokens =",
        "insecure_http = true",
    ] {
        assert!(
            said.contains(what),
            "the refusal does not say {what:?}: {said}"
        );
    }

    // Asked for, the unprotected listener starts, on the namespace's address.
    let log = dir.path().join("insecure.log");
    let mut proc = ballast_tests::harness::process::Proc::spawn(
        run(&["--insecure-http"]),
        "ballast-aggregator",
        &log,
        20,
    );
    let c = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .no_proxy()
        .build()
        .expect("client");
    wait_for(
        Duration::from_secs(20),
        "the insecure API answering",
        || {
            if let Some(s) = proc.exit_status() {
                panic!("exited {s}: {}", proc.log_tail(20));
            }
            let r = c
                .get(format!("http://{http}/v1/services"))
                .send()
                .map_err(|e| e.to_string())?;
            (r.status().as_u16() == 200)
                .then_some(())
                .ok_or_else(|| format!("status {}", r.status()))
        },
    );
    proc.terminate(Duration::from_secs(10));
}

struct Setup {
    pki: Pki,
    agg: Aggregator,
    _agent: Agent,
    tokens: PathBuf,
    viewer_entry: String,
    scrape_entry: String,
    _dir: tempfile::TempDir,
}

fn start() -> Setup {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let viewer_entry = token_entry("grafana", "viewer", VIEWER_TOKEN);
    let scrape_entry = token_entry("prometheus", "scrape", SCRAPE_TOKEN);
    let tokens = dir.path().join("api-tokens.toml");
    write_atomically(&tokens, &format!("{viewer_entry}\n{scrape_entry}"));
    let tls = pki.server_tls_dir();
    let config = format!(
        "[http_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\n\
         [http_auth]\ntokens = {tokens:?}\ntokens_check_ms = 200\n\n\
         [http_auth.cert_roles]\nviewer = [\"ops-*\"]\n\n\
         [authorization]\ncrl = {:?}\ncrl_check_ms = 200\n",
        tls.join("ca.pem"),
        tls.join("server.pem"),
        tls.join("server.key"),
        pki.crl_path(),
    );
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(config),
            api: Some(ApiAccess {
                ca: pki.dir().join("ca.pem"),
                token: Some(VIEWER_TOKEN.to_string()),
            }),
            ..AggregatorOpts::default()
        },
    );
    let agent = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-1"));
    agent.wait_weight(Duration::from_secs(15));
    Setup {
        pki,
        agg,
        _agent: agent,
        tokens,
        viewer_entry,
        scrape_entry,
        _dir: dir,
    }
}

#[test]
fn tls_tokens_and_client_certificates_admit_by_role() {
    let s = start();
    let (pki, agg) = (&s.pki, &s.agg);
    let c = client(pki, None);

    // Plain HTTP to the TLS port gets no API.
    let plain = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(3))
        .no_proxy()
        .build()
        .expect("client");
    let r = plain
        .get(format!("http://{}/v1/services", agg.http_addr()))
        .send();
    assert!(
        r.as_ref().map_or(true, |r| r.status().as_u16() != 200),
        "plain HTTP was served: {r:?}"
    );

    // Open, missing, wrong.
    assert_eq!(status(&c, agg, "/healthz", None), 200);
    let (code, challenge, _) = get(&c, agg, "/v1/services", None).expect("GET");
    assert_eq!(code, 401);
    assert!(
        challenge
            .as_deref()
            .is_some_and(|c| c.starts_with("Bearer")),
        "{challenge:?}"
    );
    assert_eq!(
        status(&c, agg, "/v1/services", Some("not-a-token-at-all")),
        401
    );
    assert_eq!(status(&c, agg, "/metrics", None), 401);

    // The viewer reads everything.
    let (code, _, body) = get(&c, agg, "/v1/services", Some(VIEWER_TOKEN)).expect("GET");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(SERVICE), "{body}");
    for path in [
        "/ui",
        "/metrics",
        &format!("/v1/services/{SERVICE}/endpoints"),
    ] {
        assert_eq!(status(&c, agg, path, Some(VIEWER_TOKEN)), 200, "{path}");
    }
    // The scraper reads the metrics only.
    assert_eq!(status(&c, agg, "/metrics", Some(SCRAPE_TOKEN)), 200);
    for path in ["/v1/services", "/ui", "/v1/published"] {
        assert_eq!(status(&c, agg, path, Some(SCRAPE_TOKEN)), 403, "{path}");
    }

    // Client certificates: of the CA and named as a viewer; of the CA with no role;
    // of another CA.
    let alice = client(pki, Some(&pki.node_tls_dir("ops-alice")));
    assert_eq!(status(&alice, agg, "/v1/services", None), 200);
    let node = client(pki, Some(&pki.node_tls_dir("node-1")));
    assert_eq!(status(&node, agg, "/v1/services", None), 403);
    let foreign = client(pki, Some(&pki.foreign_node_tls_dir("ops-mallory")));
    let refused = get(&foreign, agg, "/v1/services", None);
    assert!(
        refused.is_err(),
        "a certificate of another CA was served: {refused:?}"
    );
    // A certificate revoked (`certs revoke`, the list of [authorization] crl) fails its
    // next handshake.
    let bob = pki.node_tls_dir("ops-bob");
    assert_eq!(
        status(&client(pki, Some(&bob)), agg, "/v1/services", None),
        200
    );
    pki.revoke("ops-bob");
    wait_for(
        Duration::from_secs(5),
        "the revoked certificate refused",
        || match get(&client(pki, Some(&bob)), agg, "/v1/services", None) {
            Err(_) => Ok(()),
            Ok((code, _, _)) => Err(format!("status {code}")),
        },
    );

    // The document says how to authenticate.
    let doc: serde_json::Value = agg.get_json("/v1/openapi.json");
    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["bearer"]["scheme"], "bearer", "{schemes}");
    assert_eq!(schemes["mutualTLS"]["type"], "mutualTLS", "{schemes}");
    assert_eq!(
        doc["paths"]["/healthz"]["get"]["security"],
        serde_json::json!([])
    );

    // The operator CLI over https://.
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{VIEWER_TOKEN}\n")).expect("write token");
    let url = agg.base_url();
    let ca = pki.dir().join("ca.pem");
    let cli = |extra: &[&std::ffi::OsStr]| {
        let mut cmd = command(AGGREGATOR_BIN);
        cmd.args(["services", "--url", &url, "--ca"])
            .arg(&ca)
            .args(extra);
        run_bounded(cmd, Duration::from_secs(20))
    };
    let out = cli(&["--token-file".as_ref(), token_file.as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(SERVICE), "{}", text(&out));
    let alice_dir = pki.node_tls_dir("ops-alice");
    let out = cli(&[
        "--cert".as_ref(),
        alice_dir.join("node.pem").as_os_str(),
        "--key".as_ref(),
        alice_dir.join("node.key").as_os_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(SERVICE), "{}", text(&out));
    let out = cli(&[]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("401"), "{}", text(&out));

    // A token removed from the file is refused without a restart, though verified and
    // cached before.
    assert_eq!(status(&c, agg, "/v1/services", Some(VIEWER_TOKEN)), 200);
    write_atomically(&s.tokens, &s.scrape_entry);
    let removed = Instant::now();
    wait_for(
        Duration::from_secs(2),
        "the removed token refused",
        || match status(&c, agg, "/v1/services", Some(VIEWER_TOKEN)) {
            401 => Ok(()),
            other => Err(format!("status {other}")),
        },
    );
    eprintln!("removed token refused after {:?}", removed.elapsed());
    assert_eq!(status(&c, agg, "/metrics", Some(SCRAPE_TOKEN)), 200);
    // Put back, it reads again.
    write_atomically(
        &s.tokens,
        &format!("{}\n{}", s.viewer_entry, s.scrape_entry),
    );
    wait_for(Duration::from_secs(2), "the token back", || {
        match status(&c, agg, "/v1/services", Some(VIEWER_TOKEN)) {
            200 => Ok(()),
            other => Err(format!("status {other}")),
        }
    });

    // Every refusal counted by reason; no token in the log.
    let (_, _, metrics) = get(&c, agg, "/metrics", Some(SCRAPE_TOKEN)).expect("metrics");
    let samples = ballast_tests::harness::api::parse_metrics(&metrics);
    for reason in ["missing", "bad_token", "bad_cert", "forbidden"] {
        let n = ballast_tests::harness::api::sum_samples(
            &samples,
            "ballast_http_auth_failures_total",
            &[("reason", reason)],
        );
        assert!(n >= 1.0, "no {reason} refusal counted:\n{metrics}");
    }
    let log = agg.log();
    for token in [VIEWER_TOKEN, SCRAPE_TOKEN, "not-a-token-at-all"] {
        assert!(!log.contains(token), "the log holds a token");
    }
}

/// The dashboard behind bearer tokens, in a real browser: the sign-in form, the token
/// kept in memory only, pages, charts and the watch feed all carrying it; then an
/// operator's drain shows on the service page as it happens, and the audit page says
/// who took it, and why.
#[test]
fn the_dashboard_signs_in_with_a_token_kept_in_memory_and_shows_who_drained() {
    use ballast_tests::harness::browser::Browser;
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("api-tokens.toml");
    write_atomically(
        &tokens,
        &format!(
            "{}\n{}",
            token_entry("grafana", "viewer", VIEWER_TOKEN),
            token_entry("oncall-alice", "operator", OPERATOR_TOKEN)
        ),
    );
    // Tokens without TLS: allowed on loopback, and the browser needs no CA.
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(format!("[http_auth]\ntokens = {tokens:?}\n")),
            cycle_ms: 400,
            report_interval_ms: 400,
            ..AggregatorOpts::default()
        },
    );
    // The harness's own requests are anonymous here: /healthz only.
    let agent = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "web-1"));
    agent.wait_weight(Duration::from_secs(15));
    let base = format!("http://{}", agg.http_addr());
    let mut browser = Browser::launch(1200, 900);
    browser.navigate(&format!("{base}/ui"));
    assert_eq!(
        browser
            .eval("!!document.getElementById('login')")
            .expect("eval"),
        true,
        "no sign-in form"
    );
    let submit = |b: &mut Browser, token: &str| {
        b.eval(&format!(
            "document.getElementById('token').value = {token:?}; \
             document.querySelector('#login button').click(); true"
        ))
        .expect("submit");
    };
    // A wrong token: the form says so.
    submit(&mut browser, "not-a-token-at-all");
    wait_for(
        Duration::from_secs(10),
        "the refusal shown",
        || match browser.eval("document.getElementById('login-error').textContent") {
            Ok(serde_json::Value::String(s)) if s.contains("refused") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    // The 401s of the sign-in page and the wrong token are expected.
    browser.clear_errors();
    let navigations = browser.navigations();
    submit(&mut browser, VIEWER_TOKEN);
    wait_for(Duration::from_secs(10), "the overview", || {
        match browser.eval(&format!(
            "!!document.querySelector('tr[data-service=\"{SERVICE}\"] a')"
        )) {
            Ok(serde_json::Value::Bool(true)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    // To the service page: swapped in place, its charts and watch feed with the token.
    browser
        .eval(&format!(
            "document.querySelector('tr[data-service=\"{SERVICE}\"] a').click(); true"
        ))
        .expect("click");
    wait_for(Duration::from_secs(15), "the service page live", || {
        let v = browser
            .eval(
                "[location.pathname, ballastUi.events, \
                  Array.from(document.querySelectorAll('img[data-chart]')) \
                    .every(i => i.complete && i.naturalWidth > 0), \
                  document.querySelectorAll('img[data-chart]').length]",
            )
            .map_err(|e| e.to_string())?;
        let ok = v[0] == format!("/ui/services/{SERVICE}")
            && v[1].as_u64().unwrap_or(0) >= 1
            && v[2] == true
            && v[3].as_u64().unwrap_or(0) >= 1;
        ok.then_some(()).ok_or_else(|| format!("{v}"))
    });
    assert_eq!(
        browser.navigations(),
        navigations,
        "the page navigated: the token would be lost"
    );
    let stored = browser
        .eval("[localStorage.length, sessionStorage.length, document.cookie]")
        .expect("storage");
    assert_eq!(
        stored,
        serde_json::json!([0, 0, ""]),
        "the token was stored"
    );
    assert_eq!(browser.errors(), Vec::new(), "the page reported errors");

    // An operator drains web-1 from elsewhere: the viewer's page shows it live, the
    // endpoint draining and the action with its author.
    let reason = "disk <full> on web-1";
    let drained = reqwest::blocking::Client::new()
        .post(format!(
            "{base}/v1/services/{SERVICE}/endpoints/web-1/drain"
        ))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&serde_json::json!({ "reason": reason }))
        .send()
        .expect("drain");
    assert_eq!(drained.status().as_u16(), 200, "{:?}", drained.text());
    wait_for(
        Duration::from_secs(10),
        "the drain on the service page",
        || {
            let v = browser
                .eval(
                    "[Array.from(document.querySelectorAll('#endpoints tbody tr')) \
                   .map(r => r.textContent), \
                  Array.from(document.querySelectorAll('table.operator tbody tr')) \
                   .map(r => r.textContent)]",
                )
                .map_err(|e| e.to_string())?;
            let row_has = |i: usize, words: &[&str]| {
                v[i].as_array().is_some_and(|rows| {
                    rows.iter().any(|r| {
                        r.as_str()
                            .is_some_and(|t| words.iter().all(|w| t.contains(w)))
                    })
                })
            };
            (row_has(0, &["web-1", "draining"])
                && row_has(1, &["drain web-1", "oncall-alice", reason]))
            .then_some(())
            .ok_or_else(|| format!("{v}"))
        },
    );
    // The audit page, reached by its link: swapped in place with the token.
    browser
        .eval("document.querySelector('a.audit-link').click(); true")
        .expect("click");
    wait_for(Duration::from_secs(10), "the audit page", || {
        let v = browser
            .eval(
                "[location.pathname, Array.from(document.querySelectorAll('#audit tbody tr')) \
                   .map(r => [r.querySelector('.who').textContent, \
                              r.querySelector('.what').textContent, \
                              r.querySelector('.reason').textContent])]",
            )
            .map_err(|e| e.to_string())?;
        let want = serde_json::json!(["oncall-alice", "drain web-1", reason]);
        (v[0] == "/ui/audit" && v[1].as_array().is_some_and(|rows| rows.contains(&want)))
            .then_some(())
            .ok_or_else(|| format!("{v}"))
    });
    assert_eq!(
        browser.navigations(),
        navigations,
        "the page navigated: the token would be lost"
    );
    assert_eq!(browser.errors(), Vec::new(), "the page reported errors");
    drop(agent);
}

/// An aggregator whose HTTP listener presents the server certificate of `ops` (the
/// operators' PKI, not the agents') and checks client certificates against the CA file
/// `ca`, `ops-*` ones as viewers, with the viewer's token in a token file of `dir` and
/// the `[http_auth]` lines `extra` (its revocation list, say).
fn start_on_operators_ca(pki: &Pki, ops: &Pki, dir: &Path, ca: &Path, extra: &str) -> Aggregator {
    let tokens = dir.join("api-tokens.toml");
    write_atomically(&tokens, &token_entry("grafana", "viewer", VIEWER_TOKEN));
    let tls = ops.server_tls_dir();
    let config = format!(
        "[http_tls]\nca = {ca:?}\ncert = {:?}\nkey = {:?}\n\n\
         [http_auth]\ntokens = {tokens:?}\n{extra}\n\
         [http_auth.cert_roles]\nviewer = [\"ops-*\"]\n",
        tls.join("server.pem"),
        tls.join("server.key"),
    );
    Aggregator::start(
        pki,
        AggregatorOpts {
            config_toml: Some(config),
            api: Some(ApiAccess {
                ca: ops.dir().join("ca.pem"),
                token: Some(VIEWER_TOKEN.to_string()),
            }),
            ..AggregatorOpts::default()
        },
    )
}

/// Waits up to `within` for a new connection with the certificate in `identity` (of
/// `ops`) to be refused at the handshake, `what` saying why it should be; then the
/// answer to `kept`, a client whose connection was made before, on its next request.
fn refused_anew_then_kept(
    ops: &Pki,
    identity: &Path,
    agg: &Aggregator,
    kept: &reqwest::blocking::Client,
    within: Duration,
    what: &str,
) -> (u16, Option<String>, String) {
    wait_for(within, what, || {
        match get(&client(ops, Some(identity)), agg, "/v1/services", None) {
            Err(_) => Ok(()),
            Ok((code, _, _)) => Err(format!("status {code}")),
        }
    });
    get(kept, agg, "/v1/services", None).expect("the kept connection answered")
}

/// Asserts that the samples of `name` labelled `reason` on the aggregator's /metrics
/// add up to `at_least` or more.
fn assert_counted(agg: &Aggregator, name: &str, reason: &str, at_least: f64) {
    let metrics = agg.metrics();
    let samples = ballast_tests::harness::api::parse_metrics(&metrics);
    let sum = ballast_tests::harness::api::sum_samples(&samples, name, &[("reason", reason)]);
    assert!(
        sum >= at_least,
        "{name}{{reason=\"{reason}\"}} is {sum}, below {at_least}:\n{metrics}"
    );
}

#[test]
fn the_http_listeners_own_ca_has_its_revocation_list_honoured_and_reloaded() {
    let pki = Pki::new();
    // The operators' PKI: the HTTP listener's certificate, and its clients'.
    let ops = Pki::new();
    let carol = ops.node_tls_dir("ops-carol");
    let bob = ops.node_tls_dir("ops-bob");
    ops.revoke("ops-carol");
    let dir = tempfile::tempdir().expect("tempdir");
    let crl = format!("crl = {:?}\ncrl_check_ms = 200\n", ops.crl_path());
    let agg = start_on_operators_ca(&pki, &ops, dir.path(), &ops.dir().join("ca.pem"), &crl);

    // Revoked before the start: refused at the handshake. Not revoked: reads.
    let refused = get(&client(&ops, Some(&carol)), &agg, "/v1/services", None);
    assert!(
        refused.is_err(),
        "a certificate the revocation list names was served: {refused:?}"
    );
    let kept = client(&ops, Some(&bob));
    assert_eq!(status(&kept, &agg, "/v1/services", None), 200);

    // Revoked while it runs: a new connection is refused at the handshake...
    ops.revoke("ops-bob");
    let revoked = std::time::Instant::now();
    let (code, challenge, body) = refused_anew_then_kept(
        &ops,
        &bob,
        &agg,
        &kept,
        Duration::from_secs(5),
        "a new connection with the revoked certificate refused",
    );
    eprintln!("revoked certificate refused after {:?}", revoked.elapsed());
    // ...and the connection made before is answered 401, saying why.
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("revoked"), "{body}");
    assert!(challenge.is_some(), "a 401 says how to authenticate");

    assert_counted(&agg, "ballast_http_auth_failures_total", "revoked", 3.0);
    assert_counted(&agg, "ballast_http_crl_reloads_total", "applied", 1.0);
}

/// The HTTP listener's CA file replaced while the aggregator runs by another PKI's: a
/// new connection with a certificate of the old CA is refused at the handshake, and a
/// connection it made before is answered 403 ("no longer verifies") on its next
/// request, counted as `bad_cert`.
#[test]
fn a_kept_alive_connection_from_a_ca_rotated_out_is_refused_on_its_next_request() {
    let pki = Pki::new();
    let ops = Pki::new();
    let other = Pki::new();
    let bob = ops.node_tls_dir("ops-bob");
    let dir = tempfile::tempdir().expect("tempdir");
    // The CA bundle the listener checks client certificates against, a file of its own
    // so that it can be rotated without touching the server's certificate.
    let client_ca = dir.path().join("client-ca.pem");
    let ops_ca = std::fs::read_to_string(ops.dir().join("ca.pem")).expect("ops ca.pem");
    write_atomically(&client_ca, &ops_ca);
    let agg = start_on_operators_ca(&pki, &ops, dir.path(), &client_ca, "");
    let kept = client(&ops, Some(&bob));
    assert_eq!(status(&kept, &agg, "/v1/services", None), 200);

    // The operators' CA rotated out: only the other PKI's CA is trusted now.
    let other_ca = std::fs::read_to_string(other.dir().join("ca.pem")).expect("other ca.pem");
    write_atomically(&client_ca, &other_ca);
    let (code, _, body) = refused_anew_then_kept(
        &ops,
        &bob,
        &agg,
        &kept,
        Duration::from_secs(10),
        "a new connection with a certificate of the rotated-out CA refused",
    );
    // The connection made before the rotation is refused on its next request.
    assert_eq!(
        code, 403,
        "a certificate of a rotated-out CA was served: {body}"
    );
    assert!(body.contains("no longer verifies"), "{body}");

    // The new connection's handshake, and the kept connection's request.
    assert_counted(&agg, "ballast_http_auth_failures_total", "bad_cert", 2.0);
}

/// A client certificate that expires while a connection it made is kept alive: the
/// connection's next request is answered 401 ("expired"), counted as `expired`.
#[test]
fn a_kept_alive_connection_whose_certificate_expired_is_refused_on_its_next_request() {
    let pki = Pki::new();
    let ops = Pki::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    // Valid for 3 s more: long enough for the first request, not for the second.
    let dana = ops.node_tls_dir_valid("ops-dana", &[], now - 60, now + 3);
    let dir = tempfile::tempdir().expect("tempdir");
    let agg = start_on_operators_ca(&pki, &ops, dir.path(), &ops.dir().join("ca.pem"), "");
    let kept = client(&ops, Some(&dana));
    assert_eq!(status(&kept, &agg, "/v1/services", None), 200);

    let (code, challenge, body) = refused_anew_then_kept(
        &ops,
        &dana,
        &agg,
        &kept,
        Duration::from_secs(10),
        "a new connection with the expired certificate refused",
    );
    assert_eq!(code, 401, "an expired certificate was served: {body}");
    assert!(body.contains("expired"), "{body}");
    assert!(challenge.is_some(), "a 401 says how to authenticate");
    assert_counted(&agg, "ballast_http_auth_failures_total", "expired", 1.0);
}
