//! Scenario: an agent's failover across several aggregators (`--aggregator A,B`).
//!
//! Two real aggregators of one CA, and three agents that list both, the first first:
//! - they connect to the first and are balanced there;
//! - the first is killed: each agent moves to the second within a few seconds (its
//!   session gives up on the silent aggregator, then the next in the list is tried
//!   after a short jittered backoff), and the second balances the service;
//! - the first is started again on its address, and the second killed: they move back;
//! - an agent whose first aggregator is an address where nothing answers reaches the
//!   second after the connection attempt's timeout.

use ballast_tests::harness::ports::free_udp;
use ballast_tests::*;
use std::time::{Duration, Instant};

const SERVICE: &str = "fo";
/// Generous: a silent aggregator is given up on after a few report intervals, then
/// the agent's backoff and the new handshake; a loaded machine may add seconds.
const MOVE_WITHIN: Duration = Duration::from_secs(30);

fn opts() -> AggregatorOpts {
    AggregatorOpts::default().grace_ms(500)
}

/// Ok when every agent is connected to `agg` with a weight, and `agg` balances them.
fn all_on(agg: &Aggregator, agents: &[Agent]) -> Result<u64, String> {
    let want = agg.quic_addr().to_string();
    for a in agents {
        let s = a.status();
        if s.connected_to.as_deref() != Some(want.as_str()) || s.weight.is_none() {
            return Err(format!(
                "{} connected to {:?}, weight {:?}",
                a.node(),
                s.connected_to,
                s.weight
            ));
        }
    }
    fleet_served(agg, SERVICE, agents)
}

#[test]
fn agents_fail_over_to_the_next_aggregator_and_back() {
    let pki = Pki::new();
    let mut first = Aggregator::start(&pki, opts());
    let mut second = Aggregator::start(&pki, opts());
    let both = vec![
        first.quic_addr().to_string(),
        second.quic_addr().to_string(),
    ];
    let nodes = node_names(SERVICE, 3);
    pki.issue_nodes_for(
        SERVICE,
        &nodes.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let agents: Vec<Agent> = nodes
        .iter()
        .map(|n| {
            let mut o = AgentOpts::new(SERVICE, n);
            o.aggregators = Some(both.clone());
            Agent::start(&pki, &first, o)
        })
        .collect();
    wait_for(MOVE_WITHIN, "the agents on the first aggregator", || {
        all_on(&first, &agents)
    });

    // The first dies: they move to the second, which balances them.
    first.kill();
    let killed = Instant::now();
    let updates = wait_for(MOVE_WITHIN, "the agents on the second aggregator", || {
        all_on(&second, &agents)
    });
    eprintln!(
        "failed over to the second in {:.1} s",
        killed.elapsed().as_secs_f64()
    );
    wait_for(MOVE_WITHIN, "the second to keep balancing", || {
        let now = all_on(&second, &agents)?;
        if now >= updates + 3 {
            Ok(())
        } else {
            Err(format!("{} updates", now - updates))
        }
    });
    for a in &agents {
        let s = a.status();
        assert_eq!(s.connections, 2, "one session on each aggregator: {s:?}");
    }

    // The first comes back on its address, and the second dies: they move back.
    first.restart();
    second.kill();
    let killed = Instant::now();
    wait_for(
        MOVE_WITHIN,
        "the agents back on the first aggregator",
        || all_on(&first, &agents),
    );
    eprintln!(
        "failed back to the first in {:.1} s",
        killed.elapsed().as_secs_f64()
    );

    // An agent whose first aggregator never answers reaches the next one.
    let nowhere = format!("127.0.0.1:{}", free_udp());
    pki.issue_nodes_for(SERVICE, &["fo-late"]);
    let mut o = AgentOpts::new(SERVICE, "fo-late");
    o.aggregators = Some(vec![nowhere, first.quic_addr().to_string()]);
    let started = Instant::now();
    let late = Agent::start(&pki, &first, o);
    late.wait_weight(MOVE_WITHIN);
    let s = late.status();
    assert_eq!(
        s.connected_to.as_deref(),
        Some(first.quic_addr().to_string().as_str()),
        "{s:?}"
    );
    assert!(s.connect_failures >= 1, "the dead address was tried: {s:?}");
    eprintln!(
        "past a dead first address in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
