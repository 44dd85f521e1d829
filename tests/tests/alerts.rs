//! Scenario: the shipped Prometheus rules and Grafana dashboard, against Debian's real
//! `promtool` and `prometheus` and real Ballast processes.
//!
//! - `promtool check rules` accepts `packaging/prometheus/ballast-rules.yml` and finds
//!   every rule in it; `promtool test rules` passes its unit tests on synthetic series,
//!   which show every alert both firing and not firing.
//! - The Grafana dashboard `packaging/grafana/ballast.json` is valid JSON: unique panel
//!   ids, panels inside the 24-column grid without overlap, every panel on the
//!   `datasource` variable with PromQL targets naming raw metrics only. The operations
//!   guide names every alert and every panel.
//! - A real Prometheus, scraping and evaluating every second, scrapes a running
//!   aggregator and an agent (`--metrics`): both targets are up with no scrape error,
//!   so every line of both expositions parses, and every sample name of both reaches
//!   its storage. The rules load and evaluate without error. Every metric name in the
//!   rules and the dashboard is in the live expositions, and every dashboard expression
//!   is a query Prometheus accepts. On a balanced fleet no alert fires or is pending.
//!   Two of three agents stop: the agents-stale, missing-share and expiry-held alerts
//!   fire for the service, and the surviving agent's disconnected alert is not even
//!   pending. The rules loaded there are the shipped file with `for: 2s` instead of
//!   minutes on the first two, and nothing else changed, so that the test takes
//!   seconds.

use ballast_tests::harness::api::parse_metrics;
use ballast_tests::harness::ports::free_tcp;
use ballast_tests::harness::process::Proc;
use ballast_tests::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const SERVICE: &str = "alerting";
const RULES: &str = "packaging/prometheus/ballast-rules.yml";
const RULE_TESTS: &str = "packaging/prometheus/ballast-rules.test.yml";
const DASHBOARD: &str = "packaging/grafana/ballast.json";
const OPERATIONS: &str = "docs/operations.md";
/// The alerts the live test makes fire, whose `for` it shortens.
const FAST: &[&str] = &["BallastAgentsStale", "BallastMissingShareOverThreshold"];
/// Their `for` in the live test.
const SHORT_FOR: &str = "2s";
/// The grid width of a Grafana dashboard.
const GRID: u64 = 24;

/// The path of `name` on PATH (or in /usr/bin); fails loudly when it is not installed.
fn require(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} not found: the alerting tests run the real one. Install Debian's \
                 prometheus package (`apt-get install prometheus`, which brings promtool; \
                 tests/run does)."
            )
        })
}

fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every rule of a rules file as (`alert` or `record`, name), in file order.
fn rule_names(rules: &str) -> Vec<(&'static str, String)> {
    rules
        .lines()
        .filter_map(|l| {
            let t = l.trim_start();
            if let Some(n) = t.strip_prefix("- alert: ") {
                Some(("alert", n.trim().to_string()))
            } else {
                t.strip_prefix("- record: ")
                    .map(|n| ("record", n.trim().to_string()))
            }
        })
        .collect()
}

fn alert_names(rules: &str) -> Vec<String> {
    rule_names(rules)
        .into_iter()
        .filter(|(kind, _)| *kind == "alert")
        .map(|(_, n)| n)
        .collect()
}

/// The shipped rules with `for: SHORT_FOR` on the alerts of `fast`, and every other line
/// as it is.
fn with_short_for(rules: &str, fast: &[&str]) -> String {
    let mut out = String::new();
    let mut current: Option<&str> = None;
    let mut changed = BTreeSet::new();
    for line in rules.lines() {
        let t = line.trim_start();
        if let Some(name) = t
            .strip_prefix("- alert: ")
            .or_else(|| t.strip_prefix("- record: "))
        {
            current = Some(name.trim());
        }
        match current {
            Some(name) if t.starts_with("for: ") && fast.contains(&name) => {
                let indent = &line[..line.len() - t.len()];
                out.push_str(&format!("{indent}for: {SHORT_FOR}\n"));
                changed.insert(name);
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    let want: BTreeSet<&str> = fast.iter().copied().collect();
    assert_eq!(changed, want, "alerts without a `for` to shorten");
    out
}

/// The metric names in a PromQL expression or a Grafana variable query: identifiers
/// that start with `ballast`, outside string literals. Recorded series (with a colon,
/// `ballast:…`) are in the set too.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'"' || b == b'\'' || b == b'`' {
            // A label value or a string: skip to its closing quote.
            i += 1;
            while i < bytes.len() && bytes[i] != b {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ident(b) {
            let start = i;
            while i < bytes.len() && ident(bytes[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            if word.starts_with("ballast_") || word.starts_with("ballast:") {
                out.insert(word.to_string());
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The sample names an exposition can have: those it has, and for every family it
/// declares (some have no sample until something happens) the names of its type.
fn exposed_names(text: &str) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = parse_metrics(text).into_iter().map(|s| s.name).collect();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            panic!("bad TYPE line {line:?}");
        };
        match kind {
            "counter" => {
                names.insert(format!("{}_total", name.trim_end_matches("_total")));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// Every PromQL expression of the dashboard's panels, with its panel's title.
fn dashboard_exprs(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default();
            out.push((title.to_string(), expr.to_string()));
        }
    }
    out
}

/// The dashboard's variable queries (Grafana's `label_values(…)`, not PromQL).
fn variable_queries(dash: &Value) -> Vec<String> {
    dash["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            v["definition"]
                .as_str()
                .unwrap_or_else(|| panic!("variable without a definition: {v}"))
                .to_string()
        })
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not valid JSON: {e}"))
}

#[test]
fn promtool_checks_the_shipped_rules_and_passes_their_unit_tests() {
    let promtool = require("promtool");
    let dir = repo_root().join("packaging/prometheus");
    let rules = read(RULES);
    let names = rule_names(&rules);
    assert!(names.len() >= 10, "{names:?}");

    let run = |args: &[&str]| {
        let mut cmd = Command::new(&promtool);
        cmd.args(args).current_dir(&dir);
        let out = run_bounded(cmd, Duration::from_secs(60));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
        text
    };
    let checked = run(&["check", "rules", "ballast-rules.yml"]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", names.len())),
        "promtool found another number of rules than the {} in the file:\n{checked}",
        names.len()
    );
    let tested = run(&["test", "rules", "ballast-rules.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");

    // The unit tests show every alert firing and not firing: each `alertname:` is
    // followed by its `exp_alerts`, empty (`[]`) or not.
    let tests = read(RULE_TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for alert in alert_names(&rules) {
        let (mut fires, mut silent) = (false, false);
        for pair in lines.windows(2) {
            if pair[0] == format!("alertname: {alert}") {
                match pair[1] {
                    "exp_alerts: []" => silent = true,
                    "exp_alerts:" => fires = true,
                    other => panic!("{alert}: expected exp_alerts after alertname, got {other}"),
                }
            }
        }
        assert!(fires, "{RULE_TESTS} never shows {alert} firing");
        assert!(silent, "{RULE_TESTS} never shows {alert} not firing");
    }
}

#[test]
fn the_grafana_dashboard_is_valid_json_with_promql_panels_the_docs_describe() {
    let dash = dashboard();
    assert_eq!(dash["uid"], "ballast");
    assert!(dash["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dash["schemaVersion"].is_u64(), "schemaVersion");
    let vars = dash["templating"]["list"]
        .as_array()
        .expect("templating.list");
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus datasource variable"
    );

    let docs = read(OPERATIONS);
    let panels = dash["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(String, [u64; 4])> = Vec::new();
    for p in panels {
        let title = p["title"].as_str().expect("every panel has a title");
        assert!(
            ids.insert(p["id"].as_u64().expect("numeric id")),
            "id of {title} reused"
        );
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| {
            g[k].as_u64()
                .unwrap_or_else(|| panic!("{title}: gridPos.{k}"))
        });
        assert!(w > 0 && h > 0 && x + w <= GRID, "{title}: {g}");
        for (other, [ox, oy, ow, oh]) in &boxes {
            let apart = x + w <= *ox || *ox + ow <= x || y + h <= *oy || *oy + oh <= y;
            assert!(apart, "{title} overlaps {other}");
        }
        boxes.push((title.to_string(), [x, y, w, h]));
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            p["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{title} has no description"
        );
        assert!(
            docs.contains(title),
            "{OPERATIONS} does not describe the panel {title:?}"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(refs.insert(t["refId"].as_str().expect("refId")), "{title}");
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
        }
    }
    for (title, expr) in dashboard_exprs(&dash) {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "{title}: no ballast metric in {expr:?}");
        // Raw metrics only: the dashboard works without the rules loaded.
        assert!(
            names.iter().all(|n| !n.contains(':')),
            "{title}: a recorded series in {expr:?}"
        );
    }
    for alert in alert_names(&read(RULES)) {
        assert!(
            docs.contains(&alert),
            "{OPERATIONS} does not explain {alert}"
        );
    }
}

/// A real Prometheus with its own config, storage and port. Killed on drop.
struct Prometheus {
    addr: SocketAddr,
    http: reqwest::blocking::Client,
    proc: Proc,
    // Last, so that the process is gone before its directory is removed.
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts one loading `rules`, scraping and evaluating every second, with the jobs
    /// `ballast-aggregator` at `aggregator` and `ballast-agent` at `agent`.
    fn start(rules: &str, aggregator: SocketAddr, agent: SocketAddr) -> Prometheus {
        let bin = require("prometheus");
        let dir = tempfile::Builder::new()
            .prefix("ballast-prometheus-")
            .tempdir()
            .expect("temporary directory for Prometheus");
        let rules_path = dir.path().join("ballast-rules.yml");
        std::fs::write(&rules_path, rules).expect("write the rules");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n\
                 \x20 - job_name: ballast-aggregator\n    static_configs:\n      - targets: ['{aggregator}']\n\
                 \x20 - job_name: ballast-agent\n    static_configs:\n      - targets: ['{agent}']\n",
                rules_path.display()
            ),
        )
        .expect("write prometheus.yml");
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(5))
            .no_proxy()
            .build()
            .expect("HTTP client");
        let mut last = String::new();
        for attempt in 0..3 {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
            let storage = dir
                .path()
                .join(format!("data-{attempt}"))
                .display()
                .to_string();
            let mut cmd = Command::new(&bin);
            cmd.arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={storage}"))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn");
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let log = dir.path().join(format!("prometheus-{attempt}.log"));
            let mut proc = Proc::spawn(cmd, "prometheus", &log, 30);
            let ready = wait_for(Duration::from_secs(30), "Prometheus to be ready", || {
                if let Some(status) = proc.exit_status() {
                    return Ok(Err(format!("{status}: {}", proc.log_tail(20))));
                }
                match http.get(format!("http://{addr}/-/ready")).send() {
                    Ok(r) if r.status().is_success() => {}
                    Ok(r) => return Err(format!("/-/ready: {}", r.status())),
                    Err(e) => return Err(e.to_string()),
                }
                // Ours, not another process that took the port: its storage is ours.
                let flags: Value = http
                    .get(format!("http://{addr}/api/v1/status/flags"))
                    .send()
                    .and_then(|r| r.json())
                    .map_err(|e| e.to_string())?;
                if flags["data"]["storage.tsdb.path"] == storage.as_str() {
                    Ok(Ok(()))
                } else {
                    Err(format!("another server answers on {addr}: {flags}"))
                }
            });
            match ready {
                Ok(()) => {
                    return Prometheus {
                        addr,
                        http,
                        proc,
                        _dir: dir,
                    }
                }
                Err(log) if log.contains("address already in use") => last = log,
                Err(log) => panic!("prometheus exited at start: {log}"),
            }
        }
        panic!("prometheus could not bind a free port in 3 attempts; last: {last}");
    }

    /// GET `/api/v1/{path}` with `query`: its `data`, or why not.
    fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        let url = format!("http://{}/api/v1/{path}", self.addr);
        let resp = self
            .http
            .get(&url)
            .query(query)
            .send()
            .map_err(|e| format!("GET {url}: {e}"))?;
        let body: Value = resp.json().map_err(|e| format!("GET {url}: {e}"))?;
        if body["status"] != "success" {
            return Err(format!("GET {url} {query:?}: {body}"));
        }
        Ok(body["data"].clone())
    }

    /// The alerts pending or firing now.
    fn alerts(&self) -> Vec<Value> {
        let data = self.api("alerts", &[]).unwrap_or_else(|e| panic!("{e}"));
        data["alerts"].as_array().cloned().unwrap_or_default()
    }

    /// The end of its log.
    fn log_tail(&self) -> String {
        self.proc.log_tail(30)
    }
}

fn firing(alerts: &[Value], name: &str, service: Option<&str>) -> bool {
    alerts.iter().any(|a| {
        a["state"] == "firing"
            && a["labels"]["alertname"] == name
            && service.is_none_or(|s| a["labels"]["service"] == s)
    })
}

fn summary(alerts: &[Value]) -> String {
    alerts
        .iter()
        .map(|a| {
            format!(
                "{}{{service={}}} {}",
                a["labels"]["alertname"], a["labels"]["service"], a["state"]
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `GET /metrics` from an agent's `--metrics` port.
fn agent_metrics(http: &reqwest::blocking::Client, addr: SocketAddr) -> String {
    let url = format!("http://{addr}/metrics");
    let resp = http
        .get(&url)
        .send()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
    resp.text().expect("the agent's metrics")
}

#[test]
fn prometheus_scrapes_both_binaries_loads_the_rules_and_fires_when_agents_stop() {
    require("prometheus");
    let shipped = read(RULES);
    let rules = with_short_for(&shipped, FAST);
    let changed: Vec<_> = shipped
        .lines()
        .zip(rules.lines())
        .filter(|(a, b)| a != b)
        .collect();
    assert_eq!(changed.len(), FAST.len(), "{changed:?}");

    let pki = Pki::new();
    let agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            // Silence shows after 1.5 s, and is held past expiry after 3 s.
            config_toml: Some("[balance]\nstale_ms = 1500\nexpire_ms = 3000\n".into()),
            ..AggregatorOpts::default().grace_ms(500)
        },
    );
    let nodes = ["alerting-0", "alerting-1", "alerting-2"];
    pki.issue_nodes_for(SERVICE, &nodes);
    let agent_addr = SocketAddr::from(([127, 0, 0, 1], free_tcp()));
    // The first agent serves its metrics and stays; the other two will stop.
    let mut agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let opts = AgentOpts::new(SERVICE, node);
            let opts = if i == 0 {
                opts.metrics(agent_addr)
            } else {
                opts
            };
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    for a in &agents {
        a.wait_weight(Duration::from_secs(15));
    }
    let prom = Prometheus::start(&rules, agg.http_addr(), agent_addr);

    // Both targets up, with no scrape error: every line of both parsed.
    wait_for(Duration::from_secs(15), "both targets up", || {
        let data = prom.api("targets", &[])?;
        let targets = data["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up: BTreeSet<&str> = targets
            .iter()
            .filter(|t| t["health"] == "up" && t["lastError"] == "")
            .filter_map(|t| t["labels"]["job"].as_str())
            .collect();
        if targets.len() == 2 && up == BTreeSet::from(["ballast-aggregator", "ballast-agent"]) {
            Ok(())
        } else {
            Err(format!("{targets:?}"))
        }
    });

    // Every sample name of both expositions reaches Prometheus's storage.
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()
        .expect("HTTP client");
    let agg_text = agg.metrics();
    let agent_text = agent_metrics(&http, agent_addr);
    for (job, text) in [
        ("ballast-aggregator", &agg_text),
        ("ballast-agent", &agent_text),
    ] {
        let want: BTreeSet<String> = parse_metrics(text).into_iter().map(|s| s.name).collect();
        assert!(want.len() >= 10, "{job}: {want:?}");
        let selector = format!("{{job=\"{job}\"}}");
        wait_for(
            Duration::from_secs(10),
            &format!("every sample name of {job} in Prometheus"),
            || {
                let data = prom.api("label/__name__/values", &[("match[]", &selector)])?;
                let have: BTreeSet<String> = data
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect();
                let missing: Vec<_> = want.difference(&have).collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("missing {missing:?}"))
                }
            },
        );
    }

    // The rules load, and every one evaluates without error.
    let shipped_rules = rule_names(&shipped);
    let loaded = wait_for(Duration::from_secs(15), "every rule evaluated ok", || {
        let data = prom.api("rules", &[])?;
        let rules: Vec<Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let bad: Vec<String> = rules
            .iter()
            .filter(|r| {
                r["health"] != "ok" || r["lastError"].as_str().is_some_and(|e| !e.is_empty())
            })
            .map(|r| format!("{} {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        if rules.len() == shipped_rules.len() && bad.is_empty() {
            Ok(rules)
        } else {
            Err(format!("{} rules loaded; not ok: {bad:?}", rules.len()))
        }
    });
    let loaded_names: BTreeSet<String> = loaded
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_string())
        .collect();
    let want_names: BTreeSet<String> = shipped_rules.iter().map(|(_, n)| n.clone()).collect();
    assert_eq!(loaded_names, want_names, "the rules Prometheus loaded");
    for r in &loaded {
        if FAST.contains(&r["name"].as_str().unwrap_or_default()) {
            assert_eq!(r["duration"], 2, "{r}");
        }
    }

    // Every metric name in the rules and the dashboard is in the live expositions.
    let live: BTreeSet<String> = exposed_names(&agg_text)
        .into_iter()
        .chain(exposed_names(&agent_text))
        .collect();
    let recorded: BTreeSet<String> = shipped_rules
        .iter()
        .filter(|(kind, _)| *kind == "record")
        .map(|(_, n)| n.clone())
        .collect();
    for r in &loaded {
        for name in metric_names(r["query"].as_str().unwrap_or_default()) {
            assert!(
                live.contains(&name) || recorded.contains(&name),
                "rule {}: {name} is neither exposed nor recorded; live: {live:?}",
                r["name"]
            );
        }
    }
    let dash = dashboard();
    let mut dash_exprs = dashboard_exprs(&dash);
    dash_exprs.extend(
        variable_queries(&dash)
            .into_iter()
            .map(|q| ("variable".to_string(), q)),
    );
    for (title, expr) in &dash_exprs {
        for name in metric_names(expr) {
            assert!(
                live.contains(&name),
                "panel {title}: {name} is not exposed; live: {live:?}"
            );
        }
    }
    // Every panel's expression is a query Prometheus accepts, the dashboard's
    // variables set to all.
    for (title, expr) in dashboard_exprs(&dash) {
        let query = expr
            .replace("$__rate_interval", "1m")
            .replace("$__range", "5m")
            .replace("$service", ".*")
            .replace("$agent", ".*");
        prom.api("query", &[("query", &query)])
            .unwrap_or_else(|e| panic!("panel {title}: {e}"));
    }

    // A balanced fleet: no alert fires, nor is pending. Most alerts wait minutes
    // (`for`) before they fire, longer than this test, so an alert whose condition
    // holds on a balanced fleet shows as pending here: that is the false alarm.
    let quiet = || {
        let alerts = prom.alerts();
        if alerts
            .iter()
            .any(|a| a["state"] == "firing" || a["state"] == "pending")
        {
            Err(summary(&alerts))
        } else {
            Ok(())
        }
    };
    wait_for(
        Duration::from_secs(20),
        "no alert firing or pending on a balanced fleet",
        quiet,
    );
    holds_for(Duration::from_secs(3), "no alert firing or pending", quiet);

    // Two of three agents stop without draining.
    for a in &mut agents[1..] {
        a.stop(Duration::from_secs(5));
    }
    let alerts = wait_for(
        Duration::from_secs(30),
        "the stale, missing-share and expiry-held alerts to fire",
        || {
            let alerts = prom.alerts();
            let all = [
                "BallastAgentsStale",
                "BallastMissingShareOverThreshold",
                "BallastExpiryHeld",
            ]
            .iter()
            .all(|name| firing(&alerts, name, Some(SERVICE)));
            if all {
                Ok(alerts)
            } else {
                Err(summary(&alerts))
            }
        },
    );
    let stale = alerts
        .iter()
        .find(|a| a["labels"]["alertname"] == "BallastAgentsStale")
        .expect("the stale alert");
    assert_eq!(stale["labels"]["job"], "ballast-aggregator", "{stale}");
    assert_eq!(stale["labels"]["severity"], "warning", "{stale}");
    let share: f64 = stale["value"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("value of {stale}"));
    assert!((share - 2.0 / 3.0).abs() < 1e-9, "missing share {share}");
    // Its `for` is minutes, so the surviving agent's alert would only be pending here.
    assert!(
        !alerts
            .iter()
            .any(|a| a["labels"]["alertname"] == "BallastAgentDisconnected"),
        "the running agent is connected: {}",
        summary(&alerts)
    );

    // The surviving agent is still scraped cleanly.
    let data = prom.api("targets", &[]).unwrap_or_else(|e| panic!("{e}"));
    let agent_target = data["activeTargets"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["labels"]["job"] == "ballast-agent")
        .cloned()
        .unwrap_or_else(|| panic!("no agent target; prometheus log:\n{}", prom.log_tail()));
    assert_eq!(agent_target["health"], "up", "{agent_target}");
}
