//! The messages whose encoded sizes `docs/protocol.md` tables: what the figures bench
//! (`cargo bench -p ballast-sim --bench figures`) prints and the documentation's
//! consistency test checks, defined once here.

use super::{Hello, NodeState, Reply, Report};

/// A typical report: a busy node with a few requests in flight.
pub fn typical_report() -> Report {
    Report {
        seq: 3600,
        cpu: 0.42,
        inflight: 17,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    }
}

/// A report with every variable-length field at its maximum.
pub fn largest_report() -> Report {
    Report {
        seq: u32::MAX,
        inflight: u32::MAX,
        capacity: u32::MAX,
        error_rate: Some(0.5),
        state: NodeState::Draining,
        ..typical_report()
    }
}

/// A reply at `cycle` telling the agent to report every `interval_ms`: its cycle and
/// interval are variable-length integers, the rest has one size.
pub fn reply(cycle: u64, interval_ms: u32) -> Reply {
    Reply {
        weight: 1.23,
        cycle,
        interval_ms,
        draining: false,
        load: 0.42,
        inflight_trusted: true,
    }
}

/// The reply of the table: a day of 1 s cycles.
pub fn documented_reply() -> Reply {
    reply(86_400, 1000)
}

/// A hello with names of a usual length.
pub fn hello() -> Hello {
    Hello {
        node: "web-042.dc1.example.com".into(),
        service: "web-frontend".into(),
        address: "10.1.2.3:8080".into(),
        zone: "dc1-a".into(),
        version: crate::VERSION.into(),
    }
}
