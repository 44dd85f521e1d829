//! Scenario: the aggregator's HTTP API against its own OpenAPI document.
//!
//! A real aggregator (300 ms cycles, a config directory with one service file and one
//! refused file) and three real agents. Then:
//!
//! 1. `GET /v1/openapi.json` is an OpenAPI 3.1 document that `openapi-spec-validator`
//!    accepts, and `GET /openapi.json` answers the same document.
//! 2. Every GET of the API, answered for real (200s of a balancing service, the 404s of
//!    an unknown service and an unknown path, the config with a refused file), is valid
//!    against the schema the document gives for its status and content type, with every
//!    object closed: a field the document does not name fails, and so does one it names
//!    that is missing. The first event of the weight watch stream is valid against the
//!    event's schema, and its data against the weight set's.
//! 3. The harness reads the API through the product's own types; each of them reads
//!    those same answers, and what it holds, written back as JSON, is valid against the
//!    same schemas, so the tests' view of the API cannot drift from the document.
//! 4. Schemathesis fuzzes every operation of the live API from the document (every
//!    check: no 5xx, statuses, content types and bodies as documented, invalid input
//!    refused with a 4xx), with the service's real name as well as random ones, and
//!    the watch stream cut after its first event. Bounded in examples and time. It
//!    runs against the API as it leaves the host: HTTPS, and an operator's token, so
//!    that the acting routes are reached as an operator reaches them, and a request
//!    sent without the token must be refused (`ignored_auth`).
//!
//! Needs Python's `openapi-spec-validator` and `schemathesis` (`tests/run` installs
//! them); the test fails, naming the package, when one is missing.

use ballast_tests::harness::aggregator::ApiAccess;
use ballast_tests::harness::api::{parse_metrics, token_entry};
use ballast_tests::harness::grpc::python;
use ballast_tests::*;
use serde::Serialize;
use serde_json::{json, Value};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SERVICE: &str = "described";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];
const WAIT: Duration = Duration::from_secs(20);
/// Schemathesis' test cases per operation and phase.
const MAX_EXAMPLES: u32 = 150;
/// The longest Schemathesis may run before it is killed and the test fails.
const SCHEMATHESIS_BUDGET: Duration = Duration::from_secs(100);

/// Fails, naming the PyPI package, unless the tests' Python can import `module`.
fn require_python_module(module: &str, package: &str) {
    let out = Command::new(python())
        .args(["-c", &format!("import {module}")])
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "the OpenAPI test needs the Python module {module}, which does not import: \
             install the PyPI package `{package}` into {} (`bash tests/run` does):\n{}",
            python().display(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "the OpenAPI test needs {}, which does not run: {e}",
            python().display()
        ),
    }
}

/// An aggregator with a config directory (one service file, one refused file) and a
/// fleet of `SERVICE` that has published weights.
struct Setup {
    agg: Aggregator,
    _agents: Vec<Agent>,
    _config: tempfile::TempDir,
    _pki: Pki,
}

/// The operator's token of [`start_secured`]'s aggregator.
const OPERATOR_TOKEN: &str = "operator-token-0123456789abcdef";

fn start() -> Setup {
    start_with(None)
}

/// The aggregator of [`start`], its API served over HTTPS to tokens only: a viewer's
/// and an operator's, the harness reading with the operator's.
fn start_secured() -> Setup {
    let pki = Pki::new();
    let tokens = pki.dir().join("api-tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "{}\n{}",
            token_entry("grafana", "viewer", "viewer-token-0123456789abcdef"),
            token_entry("oncall", "operator", OPERATOR_TOKEN)
        ),
    )
    .expect("write the token file");
    let tls = pki.server_tls_dir();
    let config = format!(
        "[http_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\n[http_auth]\ntokens = {tokens:?}\n",
        tls.join("ca.pem"),
        tls.join("server.pem"),
        tls.join("server.key"),
    );
    let access = ApiAccess {
        ca: pki.dir().join("ca.pem"),
        token: Some(OPERATOR_TOKEN.to_string()),
    };
    start_with(Some((pki, config, access)))
}

fn start_with(secured: Option<(Pki, String, ApiAccess)>) -> Setup {
    let (pki, http_config, api) = match secured {
        Some((pki, config, access)) => (pki, config, Some(access)),
        None => (Pki::new(), String::new(), None),
    };
    let config = tempfile::tempdir().expect("config dir");
    std::fs::write(
        config.path().join(format!("{SERVICE}.toml")),
        "[balance]\nmissing_threshold = 0.2\n\n[locality.zone_1]\nzone_1 = 3\nzone_2 = 1\n",
    )
    .expect("write service file");
    std::fs::write(
        config.path().join("refused.toml"),
        "[balance]\n# a typo\nmissing_treshold = 0.3\n",
    )
    .expect("write refused file");
    let opts = AggregatorOpts {
        config_toml: Some(format!(
            "[service_config]\nrescan_ms = 200\n\n{http_config}"
        )),
        api,
        ..AggregatorOpts::default()
            .cycle_ms(300)
            .report_interval_ms(300)
            .grace_ms(300)
            .config_dir(config.path())
    };
    let agg = Aggregator::start(&pki, opts);
    let agents = start_fleet(&pki, &agg, SERVICE, SPEEDS.len(), &SPEEDS);
    wait_until(WAIT, "weights published from a few cycles", || {
        let svc = agg.try_service(SERVICE).ok()?;
        (svc.stats.updates >= 2 && agg.endpoints(SERVICE).len() == SPEEDS.len()).then_some(())
    });
    wait_until(WAIT, "refused.toml refused", || {
        let config = agg.config();
        config
            .errors
            .iter()
            .any(|e| e.file == "refused.toml")
            .then_some(())
    });
    Setup {
        agg,
        _agents: agents,
        _config: config,
        _pki: pki,
    }
}

/// The served document.
fn document(agg: &Aggregator) -> (String, Value) {
    let (status, text) = agg.get("/v1/openapi.json");
    assert_eq!(status, 200, "GET /v1/openapi.json: {text}");
    let doc: Value = serde_json::from_str(&text).expect("the document is JSON");
    (text, doc)
}

/// Closes every object schema of `schema` and within it: a property it does not name
/// is an error (`additionalProperties: false` unless the schema says otherwise).
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            if map.get("properties").is_some_and(Value::is_object)
                && !map.contains_key("additionalProperties")
            {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            map.values_mut().for_each(close_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// The document's schemas, closed, to validate instances against.
struct Schemas {
    doc: Value,
    components: Value,
}

impl Schemas {
    fn new(doc: &Value) -> Schemas {
        let mut components = doc["components"].clone();
        assert!(components["schemas"].is_object(), "no component schemas");
        close_objects(&mut components);
        Schemas {
            doc: doc.clone(),
            components,
        }
    }

    /// The schema of the `status` answer of `GET template` in `media`.
    fn response(&self, template: &str, status: u16, media: &str) -> Value {
        let response = &self.doc["paths"][template]["get"]["responses"][status.to_string()];
        let schema = &response["content"][media]["schema"];
        assert!(
            schema.is_object(),
            "the document gives no {media} schema for {status} of GET {template}: {response}"
        );
        schema.clone()
    }

    /// A component schema by name.
    fn component(&self, name: &str) -> Value {
        assert!(
            self.components["schemas"][name].is_object(),
            "the document has no schema {name}"
        );
        json!({ "$ref": format!("#/components/schemas/{name}") })
    }

    /// Panics, listing every error, unless `instance` is valid against `schema`.
    fn check(&self, what: &str, schema: &Value, instance: &Value) {
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.components,
            "allOf": [schema],
        });
        let validator = jsonschema::draft202012::new(&root)
            .unwrap_or_else(|e| panic!("{what}: the schema does not compile: {e}: {schema}"));
        let errors: Vec<String> = validator
            .iter_errors(instance)
            .map(|e| format!("at {:?}: {e}", e.instance_path.to_string()))
            .collect();
        assert!(
            errors.is_empty(),
            "{what} is not valid against the document's schema {schema}:\n{}\ninstance: {instance:#}",
            errors.join("\n")
        );
    }

    /// Checks a value the harness holds, written back as JSON, against the component
    /// schema `name`.
    fn check_typed<T: Serialize>(&self, what: &str, name: &str, value: &T) {
        let instance = serde_json::to_value(value).expect("serialises");
        self.check(what, &self.component(name), &instance);
    }
}

/// The media type of a `Content-Type` value, without parameters.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// `GET path`: status, media type and body, with a client of our own for the headers.
fn get(agg: &Aggregator, path: &str) -> (u16, String, String) {
    let url = format!("http://{}{path}", agg.http_addr());
    let resp = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
        .get(&url)
        .send()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let media = media_type(
        resp.headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default(),
    );
    let body = resp
        .text()
        .unwrap_or_else(|e| panic!("GET {url}: body: {e}"));
    (status, media, body)
}

/// The first event of the weight watch stream, as an event-stream parser reads it.
fn first_watch_event(agg: &Aggregator) -> (String, Value) {
    let url = format!(
        "http://{}/v1/services/{SERVICE}/weights?watch=true",
        agg.http_addr()
    );
    let mut resp = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
        .get(&url)
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .send()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(resp.status().as_u16(), 200, "GET {url}");
    let media = media_type(
        resp.headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default(),
    );
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    while !text.contains("\n\n") {
        let n = resp
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("reading the watch stream: {e}; so far: {text:?}"));
        assert!(n > 0, "the watch stream ended before an event: {text:?}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
        assert!(text.len() < 1 << 20, "no end of event in 1 MiB");
    }
    let block = text.split("\n\n").next().unwrap_or_default();
    let mut event = serde_json::Map::new();
    let mut data = Vec::new();
    for line in block.lines().filter(|l| !l.starts_with(':')) {
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => data.push(value),
            "event" | "id" => {
                event.insert(field.into(), Value::String(value.into()));
            }
            other => panic!("unexpected field {other:?} in the event {block:?}"),
        }
    }
    event.insert("data".into(), Value::String(data.join("\n")));
    (media, Value::Object(event))
}

#[test]
fn every_answer_of_the_api_is_valid_against_its_openapi_document() {
    require_python_module("openapi_spec_validator", "openapi-spec-validator");
    let setup = start();
    let agg = &setup.agg;

    // 1. A valid OpenAPI 3.1 document, at both addresses.
    let (text, doc) = document(agg);
    assert_eq!(
        doc["openapi"], "3.1.0",
        "not OpenAPI 3.1: {}",
        doc["openapi"]
    );
    let (status, legacy) = agg.get("/openapi.json");
    assert_eq!(status, 200);
    assert_eq!(legacy, text, "/openapi.json differs from /v1/openapi.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, &text).expect("write the document");
    let out = Command::new(python())
        .args(["-m", "openapi_spec_validator"])
        .arg(&file)
        .output()
        .expect("the tests' Python runs");
    assert!(
        out.status.success(),
        "openapi-spec-validator refuses the document ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // 2. Every answer against its schema, objects closed.
    let schemas = Schemas::new(&doc);
    let weights = format!("/v1/services/{SERVICE}/weights");
    let cases: Vec<(String, &str, u16)> = vec![
        ("/healthz".into(), "/healthz", 200),
        ("/v1/services".into(), "/v1/services", 200),
        (
            format!("/v1/services/{SERVICE}"),
            "/v1/services/{name}",
            200,
        ),
        (
            format!("/v1/services/{SERVICE}/endpoints"),
            "/v1/services/{name}/endpoints",
            200,
        ),
        (weights.clone(), "/v1/services/{name}/weights", 200),
        (
            format!("{weights}?watch=false"),
            "/v1/services/{name}/weights",
            200,
        ),
        ("/v1/services/nope".into(), "/v1/services/{name}", 404),
        (
            "/v1/services/nope/endpoints".into(),
            "/v1/services/{name}/endpoints",
            404,
        ),
        (
            "/v1/services/nope/weights".into(),
            "/v1/services/{name}/weights",
            404,
        ),
        (
            "/v1/services/nope/weights?watch=true".into(),
            "/v1/services/{name}/weights",
            404,
        ),
        (
            format!("{weights}?watch=maybe"),
            "/v1/services/{name}/weights",
            400,
        ),
        ("/v1/services/%FF".into(), "/v1/services/{name}", 400),
        (
            "/v1/services/%FF/endpoints".into(),
            "/v1/services/{name}/endpoints",
            400,
        ),
        (
            "/v1/services/%C3%28/weights".into(),
            "/v1/services/{name}/weights",
            400,
        ),
        ("/v1/config".into(), "/v1/config", 200),
        ("/v1/published".into(), "/v1/published", 200),
        ("/v1/openapi.json".into(), "/v1/openapi.json", 200),
        ("/openapi.json".into(), "/openapi.json", 200),
        ("/v1/audit".into(), "/v1/audit", 200),
    ];
    let paths = doc["paths"].as_object().expect("paths");
    // Every route that reads; the acting routes are Schemathesis' below.
    for template in paths
        .iter()
        .filter(|(t, ops)| *t != "/metrics" && ops.get("get").is_some())
        .map(|(t, _)| t)
    {
        assert!(
            cases.iter().any(|(_, t, s)| t == template && *s == 200),
            "no case exercises {template}"
        );
    }
    for (path, template, status) in &cases {
        let (got, media, body) = get(agg, path);
        assert_eq!(got, *status, "GET {path}: {body}");
        let instance: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"));
        let schema = schemas.response(template, *status, &media);
        schemas.check(
            &format!("GET {path} ({status}, {media})"),
            &schema,
            &instance,
        );
    }
    // An unknown path has no operation; its 404 is the documented error all the same.
    let (got, _, body) = get(agg, "/v2/nothing");
    assert_eq!(got, 404, "{body}");
    let instance: Value = serde_json::from_str(&body).expect("JSON");
    schemas.check(
        "GET /v2/nothing (404)",
        &schemas.component("ErrorBody"),
        &instance,
    );
    // Metrics: the documented media type, and a text a scraper parses.
    let (got, media, body) = get(agg, "/metrics");
    assert_eq!(got, 200);
    schemas.response("/metrics", 200, &media);
    assert!(!parse_metrics(&body).is_empty(), "no samples: {body}");
    // The watch stream: its first event, and the weight set it carries.
    let (media, event) = first_watch_event(agg);
    let stream_schema = schemas.response("/v1/services/{name}/weights", 200, &media);
    schemas.check("the first watch event", &stream_schema, &event);
    let data: Value =
        serde_json::from_str(event["data"].as_str().unwrap_or_default()).expect("JSON data");
    let weight_event = &schemas.components["schemas"]["WeightEvent"];
    let content_schema = &weight_event["properties"]["data"]["contentSchema"];
    assert!(
        content_schema.is_object(),
        "the event's data has no contentSchema: {weight_event}"
    );
    schemas.check("the first watch event's data", content_schema, &data);
    assert_eq!(event["id"], data["version"].to_string(), "{event}");

    // 3. The harness's own types read the same answers, and hold nothing else.
    schemas.check_typed(
        "the harness's services",
        "ServiceSummary",
        &agg.services()[0],
    );
    schemas.check_typed(
        "the harness's service",
        "ServiceDetail",
        &agg.service(SERVICE),
    );
    for e in agg.endpoints(SERVICE) {
        schemas.check_typed("the harness's endpoint", "EndpointView", &e);
    }
    schemas.check_typed("the harness's weights", "WeightSet", &agg.weights(SERVICE));
    let config = agg.config();
    assert!(
        !config.services.is_empty() && !config.errors.is_empty(),
        "{config:?}"
    );
    schemas.check_typed("the harness's config", "ConfigView", &config);
    schemas.check_typed("the harness's publication", "Published", &agg.published());
    let error = agg.get_error("/v1/services/nope", 404);
    schemas.check_typed("the harness's error", "ErrorBody", &error);
}

/// Runs `command` for at most `budget`, its output to files in `dir`; kills it past
/// that. Returns whether it succeeded and its output.
fn run_bounded(mut command: Command, dir: &Path, budget: Duration) -> (bool, String, Duration) {
    let out_path = dir.join("stdout.txt");
    let err_path = dir.join("stderr.txt");
    let stdout = std::fs::File::create(&out_path).expect("stdout file");
    let stderr = std::fs::File::create(&err_path).expect("stderr file");
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("the tests' Python runs");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if started.elapsed() > budget {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let output = format!(
        "{}\n{}",
        std::fs::read_to_string(&out_path).unwrap_or_default(),
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    let took = started.elapsed();
    match status {
        Some(s) => (s.success(), format!("({s})\n{output}"), took),
        None => (
            false,
            format!("killed after {budget:?}, still running:\n{output}"),
            took,
        ),
    }
}

#[test]
fn schemathesis_finds_nothing_against_the_live_api() {
    require_python_module("schemathesis", "schemathesis");
    let mut setup = start_secured();
    let agg = &setup.agg;
    let dir = tempfile::tempdir().expect("tempdir");
    // The real service's name in half the generated paths, so that the 200s are
    // fuzzed as well as the 404s; the watch stream is cut after its first event (it
    // sends the current set at once), each request within 5 s.
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(
        &config,
        format!(
            "max-stream-events = 1\n\
             \n\
             [dictionaries.services]\n\
             values = [\"{SERVICE}\"]\n\
             \n\
             [parameters]\n\
             \"path.name\" = {{ dictionary = \"services\", probability = 0.5 }}\n"
        ),
    )
    .expect("write the schemathesis config");
    // The document as served, from a file: loaded from its URL, Schemathesis leaves
    // out the operation that serves it.
    let (text, doc) = document(agg);
    // Operations, not paths: the acting routes have a POST and a DELETE each.
    let operations: usize = doc["paths"].as_object().map_or(0, |p| {
        p.values()
            .filter_map(Value::as_object)
            .map(|ops| {
                ops.keys()
                    .filter(|m| ["get", "post", "put", "delete", "patch"].contains(&m.as_str()))
                    .count()
            })
            .sum()
    });
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, &text).expect("write the document");
    let url = agg.base_url();
    assert!(url.starts_with("https://"), "{url}");
    let ca = setup._pki.dir().join("ca.pem");
    let mut command = Command::new(python());
    command
        .current_dir(dir.path())
        .args(["-m", "schemathesis.cli", "--config-file"])
        .arg(&config)
        .arg("run")
        .arg(&file)
        .args(["--url", &url])
        .arg("--tls-verify")
        .arg(&ca)
        .args([
            "--header",
            &format!("Authorization: Bearer {OPERATOR_TOKEN}"),
        ])
        .args(["--checks", "all"])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--request-timeout", "5"])
        // One worker: with two, the stateful phase's scenarios (a drain, then the
        // endpoint it drained) interleave with each other's acts on the same endpoints,
        // and a run's verdict would depend on their timing. One is also quicker here
        // (23 s against 29 s).
        .args(["--seed", "1"])
        .args(["--workers", "1"])
        .args(["--generation-database", "none"])
        .args(["--no-color"])
        .env("PYTHONUNBUFFERED", "1");
    let (ok, output, took) = run_bounded(command, dir.path(), SCHEMATHESIS_BUDGET);
    eprintln!("schemathesis, in {took:?}: {output}");
    assert!(
        ok,
        "schemathesis found problems with the live API (in {took:?}) {output}\n\
         aggregator log:\n{}",
        agg.log_tail(40)
    );
    // Every operation of the document was exercised.
    assert!(
        output.contains(&format!("Tested: {operations}\n")),
        "schemathesis did not test all {operations} operations:\n{output}"
    );
    assert!(
        setup.agg.is_running(),
        "the aggregator died under the fuzzer"
    );
}
