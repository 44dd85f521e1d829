//! The dashboard's HTML: whole pages and the fragments the page's script swaps in.
//!
//! Every string that came from an agent or a config (service, node, address, zone)
//! goes through [`esc`] before it reaches the page, and through [`path_segment`]
//! before it becomes part of a URL.

use super::charts::Chart;
use ballast_balance::{EndpointState, PublishedService};
use ballast_shared::pki::rfc3339;
use std::fmt::Write as _;

/// `s` escaped for HTML text and quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `s` percent-encoded as one URL path segment, as the operator commands encode it.
pub(crate) use crate::client::encode_segment as path_segment;

/// The dashboard URL of `service`'s page.
pub(crate) fn service_url(service: &str) -> String {
    format!("/ui/services/{}", path_segment(service))
}

/// `v` with `decimals` decimals, or a dash when it is not a number.
fn num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "—".to_string()
    }
}

/// A raw value for a `data-v` attribute, by which tables sort.
fn raw(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "0".to_string()
    }
}

/// A share as a percentage with one decimal.
fn percent(v: f64) -> String {
    if v.is_finite() {
        format!("{:.1} %", v * 100.0)
    } else {
        "—".to_string()
    }
}

/// The API's name of an endpoint state.
pub(crate) fn state_name(s: EndpointState) -> &'static str {
    match s {
        EndpointState::Serving => "serving",
        EndpointState::Warming => "warming",
        EndpointState::Draining => "draining",
        EndpointState::Missing => "missing",
    }
}

/// A whole page around `main`. `live` is the URL of the watch feed the page follows,
/// if it follows one.
pub(crate) fn page(title: &str, crumbs: &str, main: &str, watch: Option<&str>) -> String {
    let watch = watch
        .map(|w| format!(" data-watch=\"{}\"", esc(w)))
        .unwrap_or_default();
    format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{title} · Ballast</title>\n\
         <link rel=\"icon\" href=\"/ui/assets/icon.svg\" type=\"image/svg+xml\">\n\
         <link rel=\"stylesheet\" href=\"/ui/assets/style.css\">\n\
         <script src=\"/ui/assets/app.js\" defer></script>\n</head>\n\
         <body{watch}>\n<header class=\"top\">\n\
         <a class=\"brand\" href=\"/ui\"><img src=\"/ui/assets/icon.svg\" alt=\"\" width=\"20\" height=\"20\">Ballast</a>\n\
         <nav class=\"crumbs\">{crumbs}</nav>\n\
         <a class=\"audit-link\" href=\"/ui/audit\">Audit</a>\n\
         <span id=\"live-status\" class=\"status\">connecting…</span>\n</header>\n\
         <main>\n{main}\n</main>\n\
         <footer>ballast-aggregator {version} · served by the aggregator itself; needs no network</footer>\n\
         </body>\n</html>\n",
        title = esc(title),
        version = env!("CARGO_PKG_VERSION"),
    )
}

/// The sign-in page of a dashboard behind bearer tokens: a form whose token the page's
/// script keeps in memory and sends with every request.
pub(crate) fn login() -> String {
    let main = "<h1>Sign in</h1>\n\
        <p>This aggregator's dashboard needs a credential: a client certificate, or a \
        bearer token with the viewer or operator role. The token stays in this page, \
        never stored: a reload asks for it again.</p>\n\
        <form id=\"login\" class=\"login\" autocomplete=\"off\">\n\
        <label for=\"token\">Token</label>\n\
        <input type=\"password\" id=\"token\" name=\"token\" autocomplete=\"off\" required>\n\
        <button type=\"submit\">Sign in</button>\n\
        <p id=\"login-error\" class=\"error\" role=\"alert\"></p>\n\
        </form>";
    page("Sign in", "", main, None)
}

/// The audit page: operators' actions, newest first; its table is [`audit_table`].
pub(crate) fn audit(records: &[crate::audit::AuditRecord]) -> String {
    let main = format!(
        "<h1>Audit</h1>\n<p class=\"lede\">Every drain, hold and pin taken through the API, \
         and every hold or pin that lapsed: who, from where, and why. The newest {} since \
         the aggregator started; each is also in its log (target <code>audit</code>).</p>\n\
         <div id=\"live\" data-live=\"/ui/fragments/audit\" data-poll=\"2000\">{}</div>",
        crate::audit::DEFAULT_CAPACITY,
        audit_table(records)
    );
    page(
        "Audit",
        "<a href=\"/ui\">Services</a><span class=\"sep\">/</span><span>Audit</span>",
        &main,
        None,
    )
}

/// The audit records as a table, newest first.
pub(crate) fn audit_table(records: &[crate::audit::AuditRecord]) -> String {
    if records.is_empty() {
        return "<p class=\"empty\">No action yet.</p>".to_string();
    }
    let mut rows = String::new();
    for r in records {
        let at = i64::try_from(r.at_ms / 1000).map_or_else(|_| "?".to_string(), rfc3339);
        let what = match (&r.node, r.weight) {
            (Some(node), Some(w)) => format!("{} {node} at {}", r.action, num(w, 3)),
            (Some(node), None) => format!("{} {node}", r.action),
            (None, _) => r.action.clone(),
        };
        let until = r
            .until_ms
            .and_then(|ms| i64::try_from(ms / 1000).ok())
            .map_or_else(String::new, rfc3339);
        let service = format!(
            "<a href=\"{}\">{}</a>",
            esc(&service_url(&r.service)),
            esc(&r.service)
        );
        let _ = writeln!(
            rows,
            "<tr data-seq=\"{}\"><td>{}</td><td class=\"who\">{}</td><td>{}</td><td>{}</td>\
             <td>{service}</td><td class=\"what\">{}</td><td>{}</td><td class=\"reason\">{}</td></tr>",
            r.seq,
            esc(&at),
            esc(&r.who),
            esc(&r.via),
            esc(r.from.as_deref().unwrap_or("")),
            esc(&what),
            esc(&until),
            esc(&r.reason),
        );
    }
    format!(
        "<table class=\"grid\" id=\"audit\"><thead><tr><th>When (UTC)</th><th>Who</th>\
         <th>Via</th><th>From</th><th>Service</th><th>Action</th><th>Until</th><th>Reason</th>\
         </tr></thead>\n<tbody>\n{rows}</tbody></table>\n"
    )
}

/// The services overview page; its table is [`services_table`].
pub(crate) fn overview(services: &[&PublishedService]) -> String {
    let main = format!(
        "<h1>Services</h1>\n<p class=\"lede\">Every service the aggregator balances, as its \
         last cycle left it. Max/avg is what a fleet must be sized for relative to what it \
         uses: 1.00 is perfectly even.</p>\n\
         <div id=\"live\" data-live=\"/ui/fragments/services\" data-poll=\"2000\">{}</div>",
        services_table(services)
    );
    page("Services", "<span>Services</span>", &main, None)
}

/// The overview's table of services.
pub(crate) fn services_table(services: &[&PublishedService]) -> String {
    if services.is_empty() {
        return "<p class=\"empty\">No services yet. A service appears when its first \
                agent reports.</p>"
            .to_string();
    }
    let mut out = String::from(
        "<table class=\"grid sortable\" id=\"services\">\n<thead><tr>\
         <th data-sort=\"text\">Service</th>\
         <th data-sort=\"num\" class=\"num\">Endpoints</th>\
         <th>States</th>\
         <th data-sort=\"num\" class=\"num\">Avg load</th>\
         <th data-sort=\"num\" class=\"num\">Max/avg</th>\
         <th data-sort=\"num\" class=\"num\">P95/avg</th>\
         <th data-sort=\"num\" class=\"num\">Missing</th>\
         <th data-sort=\"num\" class=\"num\">Skipped cycles</th>\
         <th>Strategy mixture</th>\
         </tr></thead>\n<tbody>\n",
    );
    for svc in services {
        let s = &svc.stats;
        let skipped: u64 = s.skipped.values().sum();
        let _ = writeln!(
            out,
            "<tr data-service=\"{name}\" data-cycles=\"{cycles}\">\
             <td class=\"name\"><a href=\"{url}\">{name}</a></td>\
             <td class=\"num\" data-k=\"endpoints\" data-v=\"{n}\">{n}</td>\
             <td>{states}</td>\
             <td class=\"num\" data-k=\"avg\" data-v=\"{avg_raw}\">{avg}</td>\
             <td class=\"num{moa_class}\" data-k=\"max_over_avg\" data-v=\"{moa_raw}\">{moa}</td>\
             <td class=\"num\" data-k=\"p95_over_avg\" data-v=\"{p95_raw}\">{p95}</td>\
             <td class=\"num{miss_class}\" data-k=\"missing_share\" data-v=\"{miss_raw}\">{miss}</td>\
             <td class=\"num\" data-k=\"skipped\" data-v=\"{skipped}\">{skipped}{why}</td>\
             <td data-k=\"mixture\">{mixture}</td></tr>",
            name = esc(&svc.name),
            url = esc(&service_url(&svc.name)),
            cycles = s.cycles,
            n = svc.endpoints.len(),
            states = state_chips(svc),
            avg_raw = raw(s.spread.avg),
            avg = num(s.spread.avg, 3),
            moa_raw = raw(s.spread.max_over_avg),
            moa = num(s.spread.max_over_avg, 3),
            moa_class = if s.spread.max_over_avg > 1.2 { " warn" } else { "" },
            p95_raw = raw(s.spread.p95_over_avg),
            p95 = num(s.spread.p95_over_avg, 3),
            miss_raw = raw(s.missing_share),
            miss = percent(s.missing_share),
            miss_class = if s.missing_share > svc.params.missing_threshold {
                " bad"
            } else {
                ""
            },
            why = skip_reasons(svc, true),
            mixture = mixture(svc),
        );
    }
    out.push_str("</tbody>\n</table>");
    out
}

/// Endpoints by state, as small labels.
fn state_chips(svc: &PublishedService) -> String {
    let states = svc.states();
    if states.is_empty() {
        return "<span class=\"muted\">none</span>".to_string();
    }
    states
        .iter()
        .map(|(state, n)| {
            let name = state_name(*state);
            format!("<span class=\"badge {name}\">{n} {name}</span>")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Skipped cycles by reason, and the last skip if the last cycle was skipped; `short`
/// gives the reason's label with the sentence as a tooltip.
fn skip_reasons(svc: &PublishedService, short: bool) -> String {
    let s = &svc.stats;
    let mut out = String::new();
    if !s.skipped.is_empty() {
        let by = s
            .skipped
            .iter()
            .map(|(reason, n)| format!("{} {n}", esc(&reason.replace('_', " "))))
            .collect::<Vec<_>>()
            .join(" · ");
        let _ = write!(out, "<div class=\"sub\">{by}</div>");
    }
    if let Some(last) = &s.last_skip {
        if short {
            let _ = write!(
                out,
                "<div class=\"sub warn\" title=\"{}\">now: {}</div>",
                esc(&last.describe()),
                esc(&last.label().replace('_', " "))
            );
        } else {
            let _ = write!(
                out,
                "<div class=\"sub warn\">last cycle skipped: {}</div>",
                esc(&last.describe())
            );
        }
    }
    out
}

/// The strategies in force with their normalised gates.
fn mixture(svc: &PublishedService) -> String {
    let gates = &svc.params.strategies;
    let total: f64 = gates.iter().map(|g| g.gate).sum();
    if gates.is_empty() || total.is_nan() || total <= 0.0 {
        return "<span class=\"muted\">none</span>".to_string();
    }
    gates
        .iter()
        .map(|g| {
            format!(
                "<span class=\"mix\"><b>{}</b> {:.0} %</span>",
                esc(g.strategy.name()),
                g.gate / total * 100.0
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A service's page: the live part ([`service_live`]) and its charts.
pub(crate) fn service(svc: &PublishedService, live: &str) -> String {
    let url = service_url(&svc.name);
    let charts: String = Chart::ALL
        .iter()
        .map(|c| {
            let src = esc(&format!("{url}/charts/{}", c.file()));
            format!(
                "<figure class=\"chart\"><img data-chart=\"{src}\" src=\"{src}\" alt=\"{alt}\" \
                 width=\"{w}\" height=\"{h}\"></figure>\n",
                alt = c.describe(),
                w = super::charts::SIZE.0,
                h = super::charts::SIZE.1,
            )
        })
        .collect();
    let main = format!(
        "<h1>{name}</h1>\n\
         <div id=\"live\" data-live=\"{live_url}\">{live}</div>\n\
         <h2>Over time</h2>\n<section class=\"charts\">\n{charts}</section>",
        name = esc(&svc.name),
        live_url = esc(&format!("{url}/live")),
    );
    let crumbs = format!(
        "<a href=\"/ui\">Services</a><span class=\"sep\">/</span><span>{}</span>",
        esc(&svc.name)
    );
    let watch = format!(
        "/v1/services/{}/weights?watch=true",
        path_segment(&svc.name)
    );
    page(&svc.name, &crumbs, &main, Some(&watch))
}

/// The part of a service's page that each refresh replaces: its figures and its
/// table of endpoints.
pub(crate) fn service_live(svc: &PublishedService) -> String {
    let s = &svc.stats;
    let skipped: u64 = s.skipped.values().sum();
    let mut out = format!(
        "<p class=\"lede\">Weights version <span data-k=\"version\">{version}</span> \
         from cycle {wcycle} · {cycles} cycles run · {n} endpoints</p>\n",
        version = svc.version,
        wcycle = svc.weights_cycle,
        cycles = s.cycles,
        n = svc.endpoints.len(),
    );
    if let Some(last) = &s.last_skip {
        let _ = writeln!(
            out,
            "<p class=\"notice\">Last cycle skipped: {}</p>",
            esc(&last.describe())
        );
    }
    let cards = [
        (
            "Average load",
            "avg",
            s.spread.avg,
            num(s.spread.avg, 3),
            String::new(),
        ),
        (
            "Max/avg",
            "max_over_avg",
            s.spread.max_over_avg,
            num(s.spread.max_over_avg, 3),
            String::new(),
        ),
        (
            "P95/avg",
            "p95_over_avg",
            s.spread.p95_over_avg,
            num(s.spread.p95_over_avg, 3),
            String::new(),
        ),
        (
            "Missing",
            "missing_share",
            s.missing_share,
            percent(s.missing_share),
            format!(
                "<div class=\"sub\">skip above {}</div>",
                percent(svc.params.missing_threshold)
            ),
        ),
        (
            "Skipped cycles",
            "skipped",
            skipped as f64,
            skipped.to_string(),
            skip_reasons(svc, false),
        ),
    ];
    out.push_str("<div class=\"cards\">\n");
    for (title, key, value, shown, sub) in cards {
        let _ = writeln!(
            out,
            "<div class=\"card\"><div class=\"label\">{title}</div>\
             <div class=\"value\" data-k=\"{key}\" data-v=\"{}\">{shown}</div>{sub}</div>",
            raw(value)
        );
    }
    let _ = writeln!(
        out,
        "<div class=\"card wide\"><div class=\"label\">Endpoints</div>\
         <div class=\"value\">{}</div><div class=\"sub\">{}</div></div>\n\
         <div class=\"card wide\"><div class=\"label\">Strategy mixture</div>\
         <div class=\"value small\">{}</div></div>\n</div>",
        svc.endpoints.len(),
        state_chips(svc),
        mixture(svc)
    );
    out.push_str(&operator_actions(svc));
    out.push_str(&endpoints_table(svc));
    out
}

/// What operators set on the service, with who, why and since when; nothing when
/// no action is in force.
fn operator_actions(svc: &PublishedService) -> String {
    let a = &svc.operator;
    if a.is_empty() {
        return String::new();
    }
    let mut rows = String::new();
    let mut row = |what: String, m: &ballast_balance::Mark| {
        let until = m
            .until_ms
            .map_or_else(|| "until lifted".to_string(), |u| format!("until {u} ms"));
        let _ = writeln!(
            rows,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} ms</td><td>{}</td></tr>",
            esc(&what),
            esc(&m.by),
            esc(&m.reason),
            m.since_ms,
            esc(&until)
        );
    };
    if let Some(hold) = &a.hold {
        row("hold: weights frozen".to_string(), hold);
    }
    for (node, m) in &a.drains {
        row(format!("drain {node}"), m);
    }
    for (node, p) in &a.pins {
        row(format!("pin {node} at {}", num(p.weight, 3)), &p.mark);
    }
    format!(
        "<h2>Operator actions</h2>\n<table class=\"operator\"><thead><tr><th>action</th>\
         <th>by</th><th>reason</th><th>since (Unix)</th><th>ends</th></tr></thead>\n\
         <tbody>\n{rows}</tbody></table>\n"
    )
}

/// A service's endpoints, sortable, draining and missing ones marked.
fn endpoints_table(svc: &PublishedService) -> String {
    let mut out = format!(
        "<h2>Endpoints</h2>\n<table class=\"grid sortable\" id=\"endpoints\" \
         data-version=\"{}\" data-cycles=\"{}\">\n<thead><tr>\
         <th data-sort=\"text\">Node</th>\
         <th data-sort=\"text\">Address</th>\
         <th data-sort=\"text\">Zone</th>\
         <th data-sort=\"text\">State</th>\
         <th data-sort=\"num\" class=\"num\">Load</th>\
         <th data-sort=\"num\" class=\"num\">Weight</th>\
         <th data-sort=\"num\" class=\"num\">Report age</th>\
         </tr></thead>\n<tbody>\n",
        svc.version, svc.stats.cycles
    );
    if svc.endpoints.is_empty() {
        out.push_str("<tr><td colspan=\"7\" class=\"empty\">No endpoints.</td></tr>\n");
    }
    for (node, e) in &svc.endpoints {
        let state = state_name(e.state);
        let flagged = matches!(e.state, EndpointState::Draining | EndpointState::Missing);
        let (age_raw, age) = match e.report_age_ms {
            Some(ms) => (ms as f64, format!("{:.1} s", ms as f64 / 1000.0)),
            None => (f64::MAX, "—".to_string()),
        };
        let _ = writeln!(
            out,
            "<tr class=\"ep st-{state}{flag}\" data-node=\"{node}\" data-state=\"{state}\">\
             <td class=\"name\">{node}</td>\
             <td class=\"mono\">{address}</td>\
             <td>{zone}</td>\
             <td data-k=\"state\"><span class=\"badge {state}\">{state}</span></td>\
             <td class=\"num\" data-k=\"load\" data-v=\"{load_raw}\">{load}</td>\
             <td class=\"num\" data-k=\"weight\" data-v=\"{weight_raw}\">{weight}</td>\
             <td class=\"num\" data-k=\"report_age\" data-v=\"{age_raw}\">{age}</td></tr>",
            flag = if flagged { " flagged" } else { "" },
            node = esc(node),
            address = esc(&e.address),
            zone = if e.zone.is_empty() {
                "<span class=\"muted\">—</span>".to_string()
            } else {
                esc(&e.zone)
            },
            load_raw = raw(e.load),
            load = num(e.load, 3),
            weight_raw = raw(e.weight),
            weight = num(e.weight, 3),
            age_raw = raw(age_raw),
        );
    }
    out.push_str("</tbody>\n</table>");
    out
}

/// The page for a service the aggregator does not know.
pub(crate) fn unknown_service(name: &str) -> String {
    let main = format!(
        "<h1>Unknown service</h1>\n<p class=\"notice\">The aggregator balances no service \
         named <b>{}</b>. A service appears when its first agent reports, and goes away \
         when its endpoints have all expired.</p>\n\
         <p><a href=\"/ui\">All services</a></p>",
        esc(name)
    );
    page(
        "Unknown service",
        "<a href=\"/ui\">Services</a>",
        &main,
        None,
    )
}
