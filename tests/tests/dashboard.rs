//! Scenario: the aggregator's live dashboard (`/ui`) in a real headless Chromium,
//! driven over the DevTools protocol.
//!
//! - A fleet of two services: `shop`, six agents of different speeds in two zones,
//!   and `search`, three agents of which two stop, so that its cycles are skipped
//!   for missing endpoints.
//! - The overview lists both services with the figures the API gives (average load,
//!   max/avg, p95/avg, missing share, endpoints, skipped cycles) and their strategy
//!   mixture; the service page has the same endpoints, states, loads and weights as
//!   the API, its four charts load as images, and its table sorts by a click on a
//!   header.
//! - Draining one agent shows on the open page within seconds, marked and labelled,
//!   without a reload: the page follows the watch feed.
//! - An unknown service gets a 404 page that shows its (hostile) name as text.
//! - No page throws, logs a console error or has a resource refused, at any point
//!   (the harness first shows that it hears an exception and a console error).
//!
//! With `BALLAST_SCREENSHOTS=docs/img` (relative to the workspace root, or absolute)
//! it also writes `dashboard-overview.png` and `dashboard-service.png` there, after
//! letting the charts fill for a while.

use ballast_tests::harness::browser::{Browser, PageError};
use ballast_tests::*;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

const SHOP: &str = "shop";
const SEARCH: &str = "search";

/// The page rounds figures to three decimals.
const ROUNDING: f64 = 0.0005 + 1e-9;

/// The service page's table of endpoints, refreshed first.
const READ_ENDPOINTS: &str = r#"ballastUi.refresh().then(() => {
  const t = document.getElementById("endpoints");
  return {
    cycles: Number(t.dataset.cycles),
    rows: Array.from(t.tBodies[0].rows).map(r => ({
      node: r.dataset.node,
      state: r.dataset.state,
      classes: r.className,
      label: r.querySelector("[data-k=state] .badge").innerText,
      load: Number(r.querySelector("[data-k=load]").textContent),
      weight: Number(r.querySelector("[data-k=weight]").textContent),
    })),
  };
})"#;

/// The overview's table of services, refreshed first.
const READ_SERVICES: &str = r##"ballastUi.refresh().then(() =>
  Array.from(document.querySelectorAll("#services tbody tr")).map(r => {
    const v = k => r.querySelector(`[data-k=${k}]`);
    return {
      name: r.dataset.service,
      cycles: Number(r.dataset.cycles),
      endpoints: Number(v("endpoints").textContent),
      avg: Number(v("avg").textContent),
      max_over_avg: Number(v("max_over_avg").textContent),
      p95_over_avg: Number(v("p95_over_avg").textContent),
      missing_percent: parseFloat(v("missing_share").textContent),
      skipped: parseInt(v("skipped").textContent, 10),
      skipped_text: v("skipped").innerText,
      mixture: v("mixture").innerText,
    };
  }))"##;

fn close(page: f64, api: f64, what: &str) -> Result<(), String> {
    if (page - api).abs() <= ROUNDING {
        Ok(())
    } else {
        Err(format!("{what}: the page shows {page}, the API {api}"))
    }
}

fn state_name(s: EndpointState) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn assert_no_errors(browser: &Browser, when: &str) {
    let errors = browser.errors();
    assert!(errors.is_empty(), "page errors {when}: {errors:#?}");
}

/// The overview's rows compared with the API, once both show the same cycle of every
/// service.
fn overview_matches(browser: &mut Browser, agg: &Aggregator) -> Result<(), String> {
    let before = agg.services();
    let page = browser.eval(READ_SERVICES)?;
    let after = agg.services();
    let rows = page.as_array().ok_or("no rows")?;
    if rows.len() != before.len() {
        return Err(format!("{} rows for {} services", rows.len(), before.len()));
    }
    for row in rows {
        let name = row["name"].as_str().unwrap_or_default();
        let cycles = row["cycles"].as_u64().unwrap_or_default();
        let api = before
            .iter()
            .chain(&after)
            .find(|s| s.name == name && s.cycles == cycles)
            .ok_or_else(|| format!("{name}: cycle {cycles} is not the API's"))?;
        let num = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        close(num("avg"), api.avg, "avg")?;
        close(num("max_over_avg"), api.max_over_avg, "max/avg")?;
        close(num("p95_over_avg"), api.p95_over_avg, "p95/avg")?;
        if (num("missing_percent") - api.missing_share * 100.0).abs() > 0.05 + 1e-9 {
            return Err(format!("{name}: missing {row} vs {}", api.missing_share));
        }
        if row["endpoints"].as_u64() != Some(api.endpoints as u64) {
            return Err(format!("{name}: endpoints {row} vs {}", api.endpoints));
        }
        let detail = agg.service(name);
        if detail.stats.cycles == cycles {
            let skipped: u64 = detail.stats.skipped.values().sum();
            if row["skipped"].as_u64() != Some(skipped) {
                return Err(format!("{name}: skipped {row} vs {skipped}"));
            }
        }
        let mixture = row["mixture"].as_str().unwrap_or_default();
        for g in &detail.params.strategies {
            if !mixture.contains(g.strategy.name()) {
                return Err(format!(
                    "{name}: mixture {mixture:?} lacks {:?}",
                    g.strategy
                ));
            }
        }
    }
    Ok(())
}

/// The service page's endpoints compared with the API's, at the same cycle.
fn endpoints_match(browser: &mut Browser, agg: &Aggregator, service: &str) -> Result<(), String> {
    let page = browser.eval(READ_ENDPOINTS)?;
    let d1 = agg.service(service);
    let eps = agg.endpoints(service);
    let d2 = agg.service(service);
    let cycles = page["cycles"].as_u64().unwrap_or_default();
    if d1.stats.cycles != d2.stats.cycles || cycles != d1.stats.cycles {
        return Err(format!(
            "the page shows cycle {cycles}, the API {}..{}",
            d1.stats.cycles, d2.stats.cycles
        ));
    }
    let rows = page["rows"].as_array().ok_or("no rows")?;
    if rows.len() != eps.len() {
        return Err(format!("{} rows for {} endpoints", rows.len(), eps.len()));
    }
    for e in &eps {
        let row = rows
            .iter()
            .find(|r| r["node"] == e.node.as_str())
            .ok_or_else(|| format!("no row for {}", e.node))?;
        let state = state_name(e.state);
        if row["state"] != state.as_str() || row["label"] != state.as_str() {
            return Err(format!("{}: {row} vs state {state}", e.node));
        }
        close(row["load"].as_f64().unwrap_or(f64::NAN), e.load, "load")?;
        close(
            row["weight"].as_f64().unwrap_or(f64::NAN),
            e.weight,
            "weight",
        )?;
    }
    Ok(())
}

/// Whether the service page's four charts have loaded as images.
fn charts_loaded(browser: &mut Browser) -> Result<(), String> {
    let loaded = browser.eval(
        "Array.from(document.querySelectorAll('img[data-chart]'))\
         .filter(i => i.complete && i.naturalWidth > 0).length",
    )?;
    (loaded == 4)
        .then_some(())
        .ok_or(format!("{loaded} of 4 charts loaded"))
}

/// Where screenshots go, if they are wanted.
fn screenshot_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("BALLAST_SCREENSHOTS")?);
    Some(if dir.is_absolute() {
        dir
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(dir)
    })
}

#[test]
fn the_dashboard_shows_the_fleet_live_in_a_browser() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let fleet = [
        (SHOP, "shop-01", 0.6, "eu-west-1a"),
        (SHOP, "shop-02", 0.8, "eu-west-1a"),
        (SHOP, "shop-03", 1.0, "eu-west-1a"),
        (SHOP, "shop-04", 1.0, "eu-west-1b"),
        (SHOP, "shop-05", 1.3, "eu-west-1b"),
        (SHOP, "shop-06", 1.6, "eu-west-1b"),
        (SEARCH, "search-01", 0.8, "eu-west-1a"),
        (SEARCH, "search-02", 1.0, "eu-west-1b"),
        (SEARCH, "search-03", 1.2, "eu-west-1b"),
    ];
    for service in [SHOP, SEARCH] {
        let nodes: Vec<&str> = fleet
            .iter()
            .filter(|f| f.0 == service)
            .map(|f| f.1)
            .collect();
        pki.issue_nodes_for(service, &nodes);
    }
    let mut agents: Vec<Agent> = fleet
        .iter()
        .enumerate()
        .map(|(i, (service, node, speed, zone))| {
            let mut opts = AgentOpts::new(service, node).speed(*speed).seed(i as u64);
            opts.zone = Some(zone.to_string());
            Agent::start(&pki, &agg, opts)
        })
        .collect();
    let (shop, search) = agents.split_at_mut(6);
    wait_for(Duration::from_secs(20), "both fleets balanced", || {
        fleet_served(&agg, SHOP, shop)?;
        fleet_served(&agg, SEARCH, search).map(|_| ())
    });
    // Two of search's three stop: missing, two thirds of the service (one alone
    // would not hold the other two), so its cycles are skipped, and the pages say so.
    search[1].stop(Duration::from_secs(5));
    search[2].stop(Duration::from_secs(5));
    wait_for(
        Duration::from_secs(10),
        "search-02 and search-03 missing",
        || {
            let s = agg.service(SEARCH);
            match s.last_skip_reason {
                Some(why) if s.states.get("missing") == Some(&2) => Ok(why),
                _ => Err(format!("{:?} {:?}", s.states, s.last_skip_reason)),
            }
        },
    );

    let mut browser = Browser::launch(1280, 900);
    // The harness hears what a page throws and logs: an empty list later means
    // something.
    browser
        .eval("setTimeout(() => { throw new Error('thrown on purpose') }); console.error('logged on purpose')")
        .expect("a page that fails on purpose");
    wait_for(Duration::from_secs(5), "the harness to see both", || {
        let errors = browser.errors();
        let seen = |kind: &str, text: &str| {
            errors
                .iter()
                .any(|e| e.kind == kind && e.text.contains(text))
        };
        (seen("exception", "thrown on purpose") && seen("console", "logged on purpose"))
            .then_some(())
            .ok_or(format!("{errors:?}"))
    });
    browser.clear_errors();
    let base = format!("http://{}", agg.http_addr());

    // The root leads to the overview.
    browser.navigate(&format!("{base}/"));
    let path = browser.eval("location.pathname").expect("a location");
    assert_eq!(path, Value::from("/ui"));
    assert_no_errors(&browser, "on the overview");
    wait_for(
        Duration::from_secs(10),
        "the overview to match the API",
        || overview_matches(&mut browser, &agg),
    );
    let search_row = browser
        .eval(r#"document.querySelector('tr[data-service="search"] [data-k=skipped]').innerText"#)
        .expect("search's skipped cycles");
    assert!(
        search_row.as_str().is_some_and(|t| t.contains("missing")),
        "the overview says why search skips: {search_row}"
    );
    if let Some(dir) = screenshot_dir() {
        // Let the charts fill before they are shown.
        std::thread::sleep(Duration::from_secs(40));
        browser.eval("ballastUi.refresh()").expect("a refresh");
        browser.screenshot(&dir.join("dashboard-overview.png"));
    }

    // Click through to the service's page.
    browser
        .eval(r#"document.querySelector('tr[data-service="shop"] a').click()"#)
        .expect("click");
    wait_for(Duration::from_secs(10), "the shop page", || {
        match browser.eval("location.pathname + ' ' + document.readyState") {
            Ok(Value::String(s)) if s == "/ui/services/shop complete" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    wait_for(Duration::from_secs(10), "the four charts to load", || {
        charts_loaded(&mut browser)
    });
    assert_no_errors(&browser, "on the service page");
    wait_for(
        Duration::from_secs(10),
        "the endpoints to match the API",
        || endpoints_match(&mut browser, &agg, SHOP),
    );

    // Sorting: by load, ascending, then descending.
    for (clicks, ascending) in [(1, true), (2, false)] {
        let loads = browser
            .eval(
                "(() => { document.querySelectorAll('#endpoints th')[4].click(); \
                 return Array.from(document.querySelectorAll('#endpoints tbody tr')) \
                 .map(r => Number(r.querySelector('[data-k=load]').dataset.v)); })()",
            )
            .expect("sorted loads");
        let loads: Vec<f64> = serde_json::from_value(loads).expect("numbers");
        let sorted = loads.windows(2).all(|w| {
            if ascending {
                w[0] <= w[1]
            } else {
                w[0] >= w[1]
            }
        });
        assert!(sorted, "loads after {clicks} clicks: {loads:?}");
    }

    // Drain one agent: the open page shows it, without a reload.
    browser
        .eval("window.testMarker = 'same page'")
        .expect("a marker");
    let navigations = browser.navigations();
    let events_before = browser.eval("ballastUi.events").expect("events");
    let drained = shop[1].node().to_string();
    let resp = shop[1].drain();
    assert!(resp.status.as_ref().is_some_and(|s| s.draining), "{resp:?}");
    let read_row = format!(
        r#"(() => {{
          const r = document.querySelector('#endpoints tr[data-node="{drained}"]');
          const b = r && r.querySelector('[data-k=state] .badge');
          return r && {{ classes: r.className, label: b.innerText, visible: b.offsetParent !== null }};
        }})()"#
    );
    wait_for(Duration::from_secs(5), "the page to show the drain", || {
        let row = browser.eval(&read_row)?;
        let marked = row["classes"]
            .as_str()
            .is_some_and(|c| c.split(' ').any(|c| c == "st-draining"));
        if marked && row["label"] == "draining" && row["visible"] == true {
            Ok(())
        } else {
            Err(row.to_string())
        }
    });
    assert_eq!(
        browser.eval("window.testMarker").expect("the marker"),
        Value::from("same page"),
        "the page was reloaded"
    );
    assert_eq!(browser.navigations(), navigations, "the page navigated");
    let events_after = browser.eval("ballastUi.events").expect("events");
    assert!(
        events_after.as_u64() > events_before.as_u64(),
        "the drain came through the watch feed: {events_before} -> {events_after}"
    );
    let api = agg.endpoints(SHOP);
    let e = api.iter().find(|e| e.node == drained).expect("drained");
    assert_eq!(e.state, EndpointState::Draining);
    wait_for(
        Duration::from_secs(10),
        "the endpoints to match the API",
        || endpoints_match(&mut browser, &agg, SHOP),
    );
    assert_no_errors(&browser, "after the drain");
    if let Some(dir) = screenshot_dir() {
        browser.eval("ballastUi.refresh()").expect("a refresh");
        wait_for(Duration::from_secs(10), "the charts to reload", || {
            charts_loaded(&mut browser)
        });
        browser.screenshot(&dir.join("dashboard-service.png"));
    }

    // An unknown service: a 404 page naming it, as text.
    let hostile = "<script>alert(1)</script>";
    browser.clear_errors();
    browser.navigate(&format!(
        "{base}/ui/services/%3Cscript%3Ealert(1)%3C%2Fscript%3E"
    ));
    let shown = browser
        .eval("document.querySelector('h1').innerText + '|' + document.querySelector('main').innerText")
        .expect("the 404 page");
    let shown = shown.as_str().unwrap_or_default();
    assert!(
        shown.starts_with("Unknown service|") && shown.contains(hostile),
        "{shown}"
    );
    let scripts = browser
        .eval("document.querySelectorAll('main script').length")
        .expect("scripts");
    assert_eq!(scripts, Value::from(0));
    // The browser logs the 404 of the document itself; nothing else may fail.
    let unexpected: Vec<PageError> = browser
        .errors()
        .into_iter()
        .filter(|e| !(e.kind == "network" && e.text.contains("404")))
        .collect();
    assert!(unexpected.is_empty(), "{unexpected:#?}");
}
