//! Scenario: a watcher follows a service's weights over HTTP.
//!
//! A real aggregator (300 ms cycles) and three real agents with speeds 0.6, 1.0 and
//! 1.5, so the weights change cycle after cycle while the controllers converge. A real
//! HTTP client, `curl -N` (no buffering, bounded by `--max-time`), holds
//! `GET /v1/services/watched/weights?watch=true` open:
//!
//! 1. the answer is `200` with `Content-Type: text/event-stream`;
//! 2. the first event is the current weight set: its version lies between the plain
//!    GETs just before and just after it arrived;
//! 3. every event is `event: weights` with `id: <version>` and `data:` the weight set
//!    as JSON (the same shape as the plain GET, each sink's integer consistent with the
//!    weight); the ids strictly increase;
//! 4. at least three new versions arrive within a bounded time, each promptly after
//!    the plain GET shows it, and the event for a version is the set the plain GET
//!    returns for that version (identical from the same cycle; from a later cycle the
//!    GET may show weights drifted by less than a material change, 0.01);
//! 5. the plain GET (no `watch`) answers `application/json`;
//! 6. `ballast-agent drain` on one node reaches the watcher at once, as a new version
//!    with that node draining, weight 0 and HAProxy percentage 0;
//! 7. when the aggregator stops, the stream ends, and the open watch does not hold
//!    up the aggregator's graceful shutdown.
//!
//! And `?watch=true` on an unknown service answers a JSON 404, not a stream.
//!
//! Needs `curl`; the test fails, naming the package, when it is missing.

use ballast_tests::*;
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SERVICE: &str = "watched";
const SPEEDS: [f64; 3] = [0.6, 1.0, 1.5];
/// The longest any watch may stay open (curl's own `--max-time`).
const CURL_MAX_TIME: Duration = Duration::from_secs(40);
/// New versions the watch must deliver after the first event.
const NEW_VERSIONS: usize = 3;
/// How long they may take: the grace period and a few 300 ms cycles, with room.
const EVENTS_WITHIN: Duration = Duration::from_secs(20);
/// How soon after the plain GET shows a version the stream must carry it.
const PROMPT: Duration = Duration::from_secs(3);

/// Fails, naming the package, unless curl runs.
fn require_curl() {
    match Command::new("curl").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        other => panic!(
            "the watch test uses the real HTTP client curl, which does not run ({other:?}): \
             install Debian's package `curl` (`apt-get install curl`)"
        ),
    }
}

/// One server-sent event.
#[derive(Debug, Clone)]
struct Event {
    event: Option<String>,
    id: Option<String>,
    data: String,
}

/// `curl -N -s -i` on a URL: the status line and headers, then the body line by line.
/// Killed on drop; curl's `--max-time` bounds it too.
struct Curl {
    child: Child,
    lines: mpsc::Receiver<String>,
    url: String,
}

impl Curl {
    fn get(url: &str, max_time: Duration) -> Curl {
        let mut child = Command::new("curl")
            .args(["-N", "-s", "-i", "--no-progress-meter"])
            .args(["--max-time", &max_time.as_secs().to_string()])
            .args(["--noproxy", "*"])
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start curl: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let lines = ballast_tests::harness::process::lines_of(stdout);
        Curl {
            child,
            lines,
            url: url.to_string(),
        }
    }

    /// The next line, without its line end; `None` at the end of the output or when
    /// `deadline` passes.
    fn line(&mut self, deadline: Instant) -> Option<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.lines
            .recv_timeout(left)
            .ok()
            .map(|l| l.trim_end_matches('\r').to_string())
    }

    /// The status code and the headers (names lowercased), within `timeout`.
    fn head(&mut self, timeout: Duration) -> (u16, BTreeMap<String, String>) {
        let deadline = Instant::now() + timeout;
        let status_line = self
            .line(deadline)
            .unwrap_or_else(|| panic!("curl {}: no answer within {timeout:?}", self.url));
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("curl {}: bad status line {status_line:?}", self.url));
        let mut headers = BTreeMap::new();
        loop {
            let line = self
                .line(deadline)
                .unwrap_or_else(|| panic!("curl {}: headers cut short", self.url));
            if line.is_empty() {
                return (status, headers);
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
    }

    /// The rest of the body, until curl ends or `deadline`.
    fn body(&mut self, deadline: Instant) -> String {
        let mut body = String::new();
        while let Some(line) = self.line(deadline) {
            body.push_str(&line);
            body.push('\n');
        }
        body
    }

    /// The next event, skipping comments (keep-alives); `None` if none completes
    /// before `deadline` or the stream ends.
    fn event(&mut self, deadline: Instant) -> Option<Event> {
        let mut ev = Event {
            event: None,
            id: None,
            data: String::new(),
        };
        let mut data_lines = 0;
        loop {
            let line = self.line(deadline)?;
            if line.is_empty() {
                if data_lines > 0 || ev.event.is_some() || ev.id.is_some() {
                    return Some(ev);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((&line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value).to_string();
            match field {
                "event" => ev.event = Some(value),
                "id" => ev.id = Some(value),
                "data" => {
                    if data_lines > 0 {
                        ev.data.push('\n');
                    }
                    ev.data.push_str(&value);
                    data_lines += 1;
                }
                _ => {}
            }
        }
    }
}

impl Drop for Curl {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Checks an event's shape and returns its version and data as JSON.
fn check_event(ev: &Event) -> (u64, serde_json::Value) {
    assert_eq!(ev.event.as_deref(), Some("weights"), "event type of {ev:?}");
    let id: u64 = ev
        .id
        .as_deref()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("event without a numeric id: {ev:?}"));
    let value: serde_json::Value = serde_json::from_str(&ev.data)
        .unwrap_or_else(|e| panic!("event data is not JSON ({e}): {ev:?}"));
    let set: WeightSet = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("event data is not a weight set ({e}): {ev:?}"));
    assert_eq!(set.service, SERVICE, "{ev:?}");
    assert_eq!(set.version, id, "the id is the version: {ev:?}");
    for (node, e) in &set.weights {
        let envoy = ((e.weight * 1000.0).round() as u32).max(1);
        let percent = if e.draining {
            0
        } else {
            ((e.weight * 100.0).round() as u32).max(1)
        };
        assert!(
            e.envoy == envoy && e.haproxy_percent == percent,
            "{node}: weight {} maps to envoy {envoy} and {percent}%, the event says {} and {}%",
            e.weight,
            e.envoy,
            e.haproxy_percent
        );
    }
    (id, value)
}

/// How far a weight may move without a new version.
use ballast_balance::MATERIAL_CHANGE;

/// An event and a plain GET of the same version must be the same set: identical if
/// they come from the same cycle; from a later cycle, the GET may show weights that
/// drifted by less than a material change, and nothing else may differ.
fn same_version(event: &serde_json::Value, get: &serde_json::Value) -> Result<(), String> {
    if event == get {
        return Ok(());
    }
    let (ec, gc) = (event["cycle"].as_u64(), get["cycle"].as_u64());
    if ec == gc {
        return Err(format!("same version and cycle {ec:?}, different content"));
    }
    if gc < ec {
        return Err(format!(
            "the GET's cycle {gc:?} is older than the event's {ec:?}"
        ));
    }
    let (ew, gw) = (
        event["weights"]
            .as_object()
            .ok_or("event without weights")?,
        get["weights"].as_object().ok_or("GET without weights")?,
    );
    if ew.keys().ne(gw.keys()) {
        return Err("different endpoints".to_string());
    }
    for (node, e) in ew {
        let g = &gw[node];
        for field in ["address", "zone", "draining"] {
            if e[field] != g[field] {
                return Err(format!("{node}: {field} {} vs {}", e[field], g[field]));
            }
        }
        let (a, b) = (
            e["weight"].as_f64().unwrap_or(f64::NAN),
            g["weight"].as_f64().unwrap_or(f64::NAN),
        );
        // Not `<`: the aggregator's test is `≥ MATERIAL_CHANGE` against the weight at
        // the last version, which is the event's.
        if (a - b).abs() >= MATERIAL_CHANGE + 1e-9 || a.is_nan() || b.is_nan() {
            return Err(format!(
                "{node}: weight {a} vs {b}, a material change without a new version"
            ));
        }
    }
    Ok(())
}

#[test]
fn a_watcher_gets_the_current_set_then_each_new_version() {
    require_curl();
    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .cycle_ms(300)
            .report_interval_ms(300)
            .grace_ms(1500),
    );
    let agents = start_fleet(&pki, &agg, SERVICE, SPEEDS.len(), &SPEEDS);
    let path = format!("/v1/services/{SERVICE}/weights");
    let url = format!("http://{}{path}", agg.http_addr());

    // The service exists once its endpoints report.
    let before = wait_for(Duration::from_secs(15), "the service's weights", || {
        let w: WeightSet = agg.try_get_json(&path)?;
        if w.weights.len() == SPEEDS.len() {
            Ok(w)
        } else {
            Err(format!("{} endpoints", w.weights.len()))
        }
    });

    // The plain GET is JSON.
    let mut plain = Curl::get(&url, Duration::from_secs(10));
    let (status, headers) = plain.head(Duration::from_secs(10));
    let body = plain.body(Instant::now() + Duration::from_secs(10));
    assert_eq!(status, 200, "plain GET: {headers:?} {body}");
    assert!(
        headers
            .get("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "plain GET: content type {headers:?}"
    );
    let _: WeightSet = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("plain GET is not a weight set ({e}): {body}"));
    drop(plain);

    // The watch.
    let started = Instant::now();
    let mut watch = Curl::get(&format!("{url}?watch=true"), CURL_MAX_TIME);
    let (status, headers) = watch.head(Duration::from_secs(10));
    assert_eq!(status, 200, "watch: {headers:?}");
    let content_type = headers.get("content-type").cloned().unwrap_or_default();
    assert!(
        content_type.starts_with("text/event-stream"),
        "GET {path}?watch=true must stream server-sent events (text/event-stream), \
         but answered content type {content_type:?}: the watch query is not served. Body: {}",
        watch.body(Instant::now() + Duration::from_secs(2))
    );

    // 2. The first event is the current set.
    let first = watch
        .event(Instant::now() + Duration::from_secs(5))
        .expect("the current set as the first event within 5 s");
    let after: WeightSet = agg.get_json(&path);
    let (first_id, first_data) = check_event(&first);
    assert!(
        before.version <= first_id && first_id <= after.version,
        "the first event's version {first_id} is not the current one: the GETs around it \
         saw {} and {}",
        before.version,
        after.version
    );
    eprintln!(
        "first event: version {first_id} (GETs around it: {} and {}) after {:?}",
        before.version,
        after.version,
        started.elapsed()
    );
    let now: serde_json::Value = agg.get_json(&path);
    if now["version"] == first_data["version"] {
        same_version(&first_data, &now).unwrap_or_else(|e| {
            panic!("the first event is not the current set: {e}\nevent: {first_data}\nGET:   {now}")
        });
    }

    // 3 and 4. New versions arrive, in order, promptly, equal to the plain GET.
    let mut ids = vec![first_id];
    let mut matched = 0;
    let mut identical = 0;
    let deadline = started + EVENTS_WITHIN;
    while ids.len() <= NEW_VERSIONS || matched == 0 {
        assert!(
            Instant::now() < deadline,
            "within {EVENTS_WITHIN:?} the watch delivered versions {ids:?} \
             ({matched} compared with the plain GET); the GET is at version {}",
            agg.weights(SERVICE).version
        );
        // Whatever the plain GET shows now must come down the stream promptly.
        let get: serde_json::Value = agg.get_json(&path);
        let want = get["version"].as_u64().expect("version in the GET");
        let by = Instant::now() + PROMPT;
        while ids.last().is_some_and(|&last| last < want) {
            let ev = watch.event(by).unwrap_or_else(|| {
                panic!(
                    "version {want} was published but not streamed within {PROMPT:?}; \
                     the watch delivered {ids:?}"
                )
            });
            let (id, data) = check_event(&ev);
            let last = *ids.last().expect("first id");
            assert!(
                id > last,
                "versions must strictly increase: {id} after {ids:?}"
            );
            ids.push(id);
            if id == want {
                same_version(&data, &get).unwrap_or_else(|e| {
                    panic!(
                        "the event for version {id} differs from the plain GET of that \
                         version: {e}\nevent: {data}\nGET:   {get}"
                    )
                });
                if data == get {
                    identical += 1;
                }
                matched += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    eprintln!(
        "watch delivered versions {ids:?} in {:?}; {matched} compared with the plain GET of \
         the same version, {identical} of them byte for byte",
        started.elapsed()
    );

    // 6. A drain is an operator action: the watcher sees it at once, as a new version
    //    with the node draining and its HAProxy percentage 0.
    let drained = agents[0].node().to_string();
    agents[0].drain();
    let by = Instant::now() + PROMPT;
    let ev = loop {
        let ev = watch.event(by).unwrap_or_else(|| {
            panic!("no event showed {drained} draining within {PROMPT:?}; versions {ids:?}")
        });
        let (id, data) = check_event(&ev);
        assert!(
            id > *ids.last().expect("ids"),
            "versions must strictly increase"
        );
        ids.push(id);
        if data["weights"][&drained]["draining"] == true {
            break data;
        }
    };
    assert_eq!(ev["weights"][&drained]["haproxy_percent"], 0, "{ev}");
    assert_eq!(ev["weights"][&drained]["weight"], 0.0, "{ev}");

    // 7. The stream ends with the aggregator, and does not hold up its shutdown.
    let mut agg = agg;
    let (status, killed) = agg.stop();
    assert!(
        !killed,
        "the aggregator had to be killed: an open watch held up its shutdown"
    );
    assert!(status.success(), "the aggregator exited with {status}");
    let by = Instant::now() + Duration::from_secs(5);
    while let Some(ev) = watch.event(by) {
        check_event(&ev);
    }
    assert!(
        Instant::now() < by,
        "the watch stayed open after the aggregator stopped"
    );
    drop(watch);
    drop(agents);
}

#[test]
fn watching_an_unknown_service_is_a_json_404() {
    require_curl();
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let path = "/v1/services/no-such-service/weights?watch=true";
    let mut curl = Curl::get(
        &format!("http://{}{path}", agg.http_addr()),
        Duration::from_secs(10),
    );
    let (status, headers) = curl.head(Duration::from_secs(10));
    let body = curl.body(Instant::now() + Duration::from_secs(10));
    assert_eq!(status, 404, "{headers:?} {body}");
    assert!(
        headers
            .get("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "a 404 is JSON, not a stream: {headers:?}"
    );
    let err: ErrorBody =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("not the JSON error ({e}): {body}"));
    assert_eq!(err.status, 404);
    assert!(
        err.error.contains("no-such-service"),
        "the error names the service: {err:?}"
    );
    // And the harness's own client agrees.
    agg.get_error(path, 404);
}
