//! Scenario: nodes that move, with a real aggregator and real agents.
//!
//! - A node of a four-node service is moved to another service (its agent stopped and
//!   started again for the other one, with a certificate that names both). The service
//!   it left forgets it and goes on balancing its three: it does not wait for it as
//!   missing, which would skip every cycle (a quarter missing is over the 15 %
//!   threshold) and, failing static, hold it so. The move is counted in
//!   `ballast_endpoints_moved_total`.
//! - A node that claims the address of another node still reporting is refused
//!   (`address_not_allowed`, counted), and the holder keeps its place. Once the holder
//!   stops, the newcomer, retrying, takes the address and the holder is forgotten.

use ballast_tests::*;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WAIT: Duration = Duration::from_secs(20);

fn moved(agg: &Aggregator, service: &str) -> f64 {
    agg.counter("ballast_endpoints_moved_total", &[("service", service)])
}

/// The nodes `service` has, sorted.
fn nodes_of(agg: &Aggregator, service: &str) -> Result<Vec<String>, String> {
    let mut nodes: Vec<String> = agg
        .try_endpoints(service)?
        .into_iter()
        .map(|e| e.node)
        .collect();
    nodes.sort();
    Ok(nodes)
}

#[test]
fn a_node_that_moves_leaves_its_service_balancing_and_no_two_nodes_share_an_address() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let mut web = start_fleet(&pki, &agg, "web", 4, &[0.6, 1.0, 1.5]);
    wait_for(WAIT, "web to be balanced", || {
        fleet_served(&agg, "web", &web)
    });

    // 1. web-03 moves to "api".
    let mut mover = web.pop().expect("four agents");
    let node = mover.node().to_string();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64;
    let both = pki.node_tls_dir_valid(&node, &["web", "api"], now - 3600, now + 86_400);
    let (status, killed) = mover.stop(Duration::from_secs(5));
    assert!(status.success() && !killed, "agent stop: {status}");
    let moved_agent = Agent::start(&pki, &agg, AgentOpts::new("api", &node).tls_dir(both));
    moved_agent.wait_weight(WAIT);
    wait_for(WAIT, "api to serve the moved node", || {
        match nodes_of(&agg, "api")? {
            n if n == [node.clone()] => Ok(()),
            n => Err(format!("api has {n:?}")),
        }
    });
    // web forgets it, and goes on updating its weights with the other three.
    let updates = wait_for(WAIT, "web to forget the moved node", || {
        fleet_served(&agg, "web", &web)
    });
    wait_for(WAIT, "web to keep balancing its three", || {
        let now = fleet_served(&agg, "web", &web)?;
        if now >= updates + 4 {
            Ok(())
        } else {
            Err(format!("{} updates since the move", now - updates))
        }
    });
    let detail = agg.service("web");
    assert_eq!(detail.stats.missing_share, 0.0, "{:?}", detail.stats);
    assert_eq!(moved(&agg, "web"), 1.0, "the move is counted once");
    assert!(
        agg.log().contains("their nodes moved"),
        "the move is logged"
    );

    // 2. A second node claims web-00's address while web-00 reports: refused.
    let holder = web.remove(0);
    pki.issue_nodes_for("web", &["web-clone"]);
    let mut opts = AgentOpts::new("web", "web-clone");
    opts.address = Some(holder.address().to_string());
    let clone = Agent::start(&pki, &agg, opts);
    let refused = wait_for(WAIT, "the clone's refusal in its status", || {
        let s = clone.status();
        match &s.rejection {
            Some(r) if r.reason == "address_not_allowed" => Ok(r.detail.clone()),
            _ => Err(format!("{s:?}")),
        }
    });
    assert!(
        refused.contains(holder.node()) && refused.contains(holder.address()),
        "the refusal names the address and its holder: {refused}"
    );
    assert!(
        agg.counter(
            "ballast_reports_rejected_total",
            &[("reason", "address_not_allowed")]
        ) >= 1.0
    );
    let mut fleet = vec![holder];
    fleet.extend(web);
    wait_for(WAIT, "web to keep its fleet, without the clone", || {
        fleet_served(&agg, "web", &fleet)
    });

    // 3. The holder stops: once it is stale, the clone (retrying) takes the address.
    let mut holder = fleet.remove(0);
    let (status, killed) = holder.stop(Duration::from_secs(5));
    assert!(status.success() && !killed, "agent stop: {status}");
    clone.wait_weight(Duration::from_secs(30));
    fleet.push(clone);
    wait_for(WAIT, "web to have the clone in the holder's place", || {
        fleet_served(&agg, "web", &fleet)
    });
    let endpoints = agg.endpoints("web");
    let at_address: Vec<&str> = endpoints
        .iter()
        .filter(|e| e.address == holder.address())
        .map(|e| e.node.as_str())
        .collect();
    assert_eq!(at_address, ["web-clone"]);
    assert_eq!(moved(&agg, "web"), 2.0, "the replaced holder is counted");
}
