use super::history::{History, CHARTED, POINTS};
use super::html::{esc, path_segment};
use super::*;
use crate::clock::Clock;
use crate::store::file::FileStore;
use ballast_balance::{Balancer, Observation, Params};
use std::net::SocketAddr;

/// Names no agent could send over the wire (its hello is validated), which the
/// balancer's maps still accept: the pages must escape them all the same.
const SERVICE: &str = "svc<b>\"'&";
const NODE: &str = "<script>alert(1)</script>";
const ZONE: &str = "\"><img src=x onerror=alert(2)>";

fn state() -> Arc<State> {
    let clock = Clock::start();
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let balancer = Balancer::new(params, clock.now());
    let store = Arc::new(FileStore::new(
        std::env::temp_dir().join("ballast-ui-never-written.json"),
    ));
    Arc::new(State::new(balancer, store, clock, 1000))
}

fn fill(state: &State, service: &str, nodes: usize, cycles: u64) {
    let now = state.clock.now();
    state.write_balancer(|b| {
        for i in 0..nodes {
            let node = if i == 0 {
                NODE.to_string()
            } else {
                format!("n{i:03}")
            };
            b.register(now, service, &node, &format!("10.0.0.{i}:80"), ZONE)
                .expect("registers");
            b.observe(
                now,
                service,
                &node,
                Observation {
                    cpu: 0.3 + i as f64 * 0.01,
                    ..Observation::default()
                },
            )
            .expect("observes");
        }
    });
    for c in 1..=cycles {
        state.cycle(now + c * 1000);
    }
}

/// A raw HTTP/1.0 GET: status code, head and body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let out = crate::test_http::raw_get(addr, path).await;
    let (head, body) = out.split_once("\r\n\r\n").expect("a head");
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status");
    (code, head.to_ascii_lowercase(), body.to_string())
}

async fn serve(state: Arc<State>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let app = crate::api::router(state);
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[test]
fn strings_are_escaped_and_encoded() {
    assert_eq!(
        esc("<a href=\"x\">'&'</a>"),
        "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
    );
    assert_eq!(esc("a\u{1}b"), "a\u{fffd}b");
    assert_eq!(path_segment("web-1.a_b~"), "web-1.a_b~");
    assert_eq!(path_segment("a/b c?<"), "a%2Fb%20c%3F%3C");
    assert_eq!(path_segment("é"), "%C3%A9");
}

#[tokio::test]
async fn pages_fragments_and_charts_escape_what_agents_sent() {
    let state = state();
    fill(&state, SERVICE, 3, 3);
    let addr = serve(state.clone()).await;
    let url = format!("/ui/services/{}", path_segment(SERVICE));
    let pages = [
        "/ui".to_string(),
        "/ui/fragments/services".to_string(),
        url.clone(),
        format!("{url}/live"),
    ];
    for path in &pages {
        let (code, head, body) = get(addr, path).await;
        assert_eq!(code, 200, "{path}: {body}");
        assert!(head.contains("content-type: text/html"), "{path}: {head}");
        assert!(
            head.contains("content-security-policy: default-src 'none'"),
            "{head}"
        );
        for raw in [SERVICE, NODE, ZONE, "<script>alert", "<img src=x", "svc<b>"] {
            assert!(!body.contains(raw), "{path} has {raw:?} unescaped:\n{body}");
        }
        assert!(
            path.ends_with("/live") || body.contains(&esc(SERVICE)),
            "{path}: {body}"
        );
    }
    let (_, _, live) = get(addr, &format!("{url}/live")).await;
    assert!(
        live.contains(&esc(NODE)) && live.contains(&esc(ZONE)),
        "{live}"
    );
    assert_eq!(live.matches("<tr class=\"ep ").count(), 3, "{live}");
    for chart in Chart::ALL {
        let (code, head, svg) = get(addr, &format!("{url}/charts/{}", chart.file())).await;
        assert_eq!(code, 200, "{}: {svg}", chart.file());
        assert!(head.contains("content-type: image/svg+xml"), "{head}");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(
            !svg.contains("<script") && !svg.contains("<img src=x"),
            "{svg}"
        );
    }
}

#[tokio::test]
async fn unknown_services_and_charts_are_a_clear_404_page() {
    let state = state();
    fill(&state, "web", 2, 2);
    let addr = serve(state).await;
    for path in [
        "/ui/services/nope",
        "/ui/services/nope/live",
        "/ui/services/nope/charts/load.svg",
        "/ui/services/web/charts/nope.svg",
        "/ui/services/%3Cscript%3Ealert(1)%3C%2Fscript%3E",
    ] {
        let (code, head, body) = get(addr, path).await;
        assert_eq!(code, 404, "{path}");
        assert!(head.contains("content-type: text/html"), "{path}: {head}");
        assert!(!body.contains("<script>"), "{body}");
        assert!(body.contains("<h1>"), "{body}");
    }
    let (_, _, body) = get(addr, "/ui/services/%3Cscript%3E").await;
    assert!(
        body.contains("Unknown service") && body.contains("&lt;script&gt;"),
        "{body}"
    );
    let (code, head, _) = get(addr, "/").await;
    assert_eq!(code, 303);
    assert!(head.contains("location: /ui"), "{head}");
    for (asset, kind) in [
        ("/ui/assets/app.js", "text/javascript"),
        ("/ui/assets/style.css", "text/css"),
        ("/ui/assets/icon.svg", "image/svg+xml"),
    ] {
        let (code, head, _) = get(addr, asset).await;
        assert_eq!(code, 200, "{asset}");
        assert!(head.contains(kind), "{head}");
    }
    // The API's own 404 is untouched.
    let (code, _, body) = get(addr, "/v1/nope").await;
    assert_eq!(code, 404);
    assert!(body.contains("\"error\""), "{body}");
}

#[test]
fn the_endpoint_history_is_bounded() {
    let state = state();
    fill(&state, "big", CHARTED + 8, 1);
    let history = History::default();
    let start = state.clock.now() + 10_000;
    for c in 0..(POINTS as u64 + 50) {
        history.record(&state.cycle(start + c * 1000));
    }
    // A publication whose services did not cycle adds nothing.
    history.record(&state.published());
    let tracked = history.of("big");
    assert_eq!(tracked.total, CHARTED + 8);
    assert_eq!(tracked.endpoints.len(), CHARTED);
    for (node, points) in &tracked.endpoints {
        assert_eq!(points.len(), POINTS, "{node}");
        assert!(points.windows(2).all(|w| w[0].at < w[1].at), "{node}");
    }
    assert!(history.of("unknown").endpoints.is_empty());
}
