//! What the core's benches share: a service of many endpoints, registered.

use ballast_balance::{Balancer, Limits, Millis, Params};

/// A balancer with one service `svc` of `n` endpoints `node-000000`…, each at an
/// address of its own, registered at time 0 with no grace period; with the nodes'
/// names and the cycle's length.
pub(crate) fn fleet(n: usize) -> (Balancer, Vec<String>, Millis) {
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let cycle_ms = params.cycle_ms;
    let mut b = Balancer::new(params, 0);
    // The shipped limit is 50,000 endpoints a service; the benches go past it.
    b.set_limits(Limits {
        max_endpoints_per_service: usize::MAX,
        ..Limits::default()
    });
    let nodes: Vec<String> = (0..n).map(|i| format!("node-{i:06}")).collect();
    for (i, node) in nodes.iter().enumerate() {
        b.register(
            0,
            "svc",
            node,
            &format!("10.{}.{}.{}:80", i / 65_536, (i / 256) % 256, i % 256),
            "",
        )
        .expect("register");
    }
    (b, nodes, cycle_ms)
}
