//! A count that does not follow the weight is not load, through the real daemon.
//!
//! Four real agents report with the shipped in-flight source (the TCP connections on
//! their port that owe a response) and no capacity. Three are busy (their CPU source is
//! a process spinning a core) and owe nothing. The fourth's CPU is idle, and thirteen
//! clients hold connections to its port with a request the service never reads: a
//! count of 13 that no weight can move, like idle connections miscounted or long polls.
//!
//! The aggregator first takes the count at its word and drives that endpoint's weight
//! down; once the weight has fallen eightfold with the count unchanged for five cycles,
//! it sets the count aside: the endpoint API, the service's stats, `/metrics` and the
//! agent's `status` say so, and the endpoint is steered by its CPU again, so its weight
//! climbs back instead of sitting at the floor.

use ballast_tests::harness::agent::{Agent, AgentOpts};
use ballast_tests::harness::aggregator::{Aggregator, AggregatorOpts};
use ballast_tests::harness::pki::Pki;
use ballast_tests::harness::process::Proc;
use ballast_tests::harness::wait::wait_for;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

const SERVICE: &str = "stuck";
const STUCK: usize = 13;

/// The `inflight_estimate` of `node` in the endpoints API, as JSON.
fn estimate(agg: &Aggregator, node: &str) -> Result<(serde_json::Value, f64), String> {
    let eps: serde_json::Value = agg.try_get_json(&format!("/v1/services/{SERVICE}/endpoints"))?;
    let ep = eps
        .as_array()
        .and_then(|a| a.iter().find(|e| e["node"] == node))
        .ok_or_else(|| format!("{node} not in {eps}"))?;
    let weight = ep["weight"]
        .as_f64()
        .ok_or_else(|| format!("no weight in {ep}"))?;
    Ok((ep["inflight_estimate"].clone(), weight))
}

#[test]
fn a_count_the_weight_cannot_move_is_set_aside() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    // One spinning process stands for the busy nodes' CPU, a sleeping one for the idle
    // node's. Both are killed when dropped.
    let logs = tempfile::tempdir().expect("log directory");
    let mut spin = Command::new("sh");
    spin.args(["-c", "while :; do :; done"]);
    let busy = Proc::spawn(spin, "spin", &logs.path().join("spin.log"), 0);
    let mut sleep = Command::new("sleep");
    sleep.arg("300");
    let idle = Proc::spawn(sleep, "sleep", &logs.path().join("sleep.log"), 0);
    let nodes = ["busy-1", "busy-2", "busy-3", "idle-1"];
    pki.issue_nodes(&nodes);
    let listeners: Vec<TcpListener> = nodes
        .iter()
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("listener"))
        .collect();
    // Thirteen requests the idle node's service never reads: owed, and going nowhere.
    let stuck_addr = listeners[3].local_addr().expect("address");
    let _held: Vec<(TcpStream, TcpStream)> = (0..STUCK)
        .map(|_| {
            let mut c = TcpStream::connect(stuck_addr).expect("connect");
            c.write_all(b"GET /poll HTTP/1.1\r\nHost: x\r\n\r\n")
                .expect("send");
            let (s, _) = listeners[3].accept().expect("accept");
            (c, s)
        })
        .collect();
    let agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut o = AgentOpts::new(SERVICE, node)
                .inflight_tcp(listeners[i].local_addr().expect("address").port());
            let pid = if i == 3 { idle.pid() } else { busy.pid() };
            o.cpu = format!("pid:{pid}");
            o.default_capacity = true;
            Agent::start(&pki, &agg, o)
        })
        .collect();

    // First the count is believed: the weight falls well below the mean.
    let low = wait_for(
        Duration::from_secs(30),
        "the stuck node's weight to fall",
        || match estimate(&agg, "idle-1")? {
            (e, w) if w < 0.2 && e["trusted"] == true => Ok(w),
            other => Err(format!("{other:?}")),
        },
    );
    // Then it is set aside, and the node is steered by its idle CPU: up again.
    let (set_aside, _) = wait_for(
        Duration::from_secs(30),
        "the stuck count to be set aside",
        || match estimate(&agg, "idle-1")? {
            (e, w) if e["trusted"] == false => Ok((e, w)),
            other => Err(format!("{other:?}")),
        },
    );
    assert_eq!(set_aside["derivation"], "fleet_relative", "{set_aside}");
    assert!(
        set_aside["smoothed"].as_f64().unwrap_or(0.0) >= 10.0,
        "the count was still stuck: {set_aside}"
    );
    let recovered = wait_for(
        Duration::from_secs(30),
        "the weight to climb back once the count is set aside",
        || match estimate(&agg, "idle-1")? {
            (_, w) if w > 4.0 * low && w > 0.5 => Ok(w),
            other => Err(format!("{other:?}")),
        },
    );
    eprintln!("stuck node: weight {low:.3} while believed, {recovered:.3} after");

    // The service's stats and the metrics count it; the busy nodes were never doubted.
    let detail: serde_json::Value = agg.get_json(&format!("/v1/services/{SERVICE}"));
    assert_eq!(
        detail["stats"]["inflight_distrusts"], 1,
        "{}",
        detail["stats"]
    );
    assert_eq!(
        detail["stats"]["inflight_distrusted"], 1,
        "{}",
        detail["stats"]
    );
    let metrics = agg.metrics();
    assert!(
        metrics.contains(&format!(
            "ballast_service_inflight_distrusts_total{{service=\"{SERVICE}\"}} 1"
        )) && metrics.contains(&format!(
            "ballast_service_inflight_distrusted{{service=\"{SERVICE}\"}} 1"
        )),
        "{metrics}"
    );
    for node in &nodes[..3] {
        let (e, _) = estimate(&agg, node).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e["trusted"], true, "{node}: {e}");
    }
    // The agent is told, and says so.
    let out = agents[3].cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("in-flight count set aside"),
        "the agent's status: {text}"
    );
    drop(agents);
}
