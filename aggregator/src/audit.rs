//! The audit trail of operators' actions: who did what, when, from where and why.
//!
//! Every action taken through the API, and every hold or pin that lapses at its end
//! time, is one record: written to the log (target `audit`) and kept in memory, the
//! newest [`Audit::capacity`] of them, for `GET /v1/audit` and the dashboard.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Records kept in memory by default.
pub const DEFAULT_CAPACITY: usize = 1000;

/// One action, as the audit trail keeps it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AuditRecord {
    /// Increases by one with every record since the aggregator started.
    pub seq: u64,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Who: the bearer token's name or the client certificate's identity; `expiry` for
    /// a hold or pin that lapsed at its end time.
    pub who: String,
    /// How they were recognised: `token`, `certificate`, `open` (no credential is
    /// configured), or `expiry`.
    pub via: String,
    /// The address the request came from; absent for a lapse.
    pub from: Option<String>,
    /// What: `drain`, `undrain`, `hold`, `release`, `pin` or `unpin`.
    pub action: String,
    /// The service.
    pub service: String,
    /// The node, for an action on one endpoint.
    pub node: Option<String>,
    /// The pinned weight, for a pin.
    pub weight: Option<f64>,
    /// When a hold or pin lapses by itself, in milliseconds since the Unix epoch.
    pub until_ms: Option<u64>,
    /// The reason the operator gave.
    pub reason: String,
    /// In a cluster: the replica whose API received the request.
    #[serde(default)]
    pub received_by: Option<String>,
    /// In a cluster: the replica that applied the action, the service's owner (the
    /// receiving replica itself, or the owner it handed the action to); absent while
    /// the action is only accepted for an owner, and outside a cluster.
    #[serde(default)]
    pub applied_by: Option<String>,
}

/// The records kept in memory, bounded.
#[derive(Debug)]
pub struct Audit {
    capacity: usize,
    records: Mutex<(u64, VecDeque<AuditRecord>)>,
}

impl Default for Audit {
    fn default() -> Self {
        Audit::new(DEFAULT_CAPACITY)
    }
}

impl Audit {
    /// An empty trail keeping the newest `capacity` records (at least one).
    pub fn new(capacity: usize) -> Self {
        Audit {
            capacity: capacity.max(1),
            records: Mutex::new((0, VecDeque::new())),
        }
    }

    /// How many records are kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Logs `record` and keeps it, numbered; the oldest goes past the capacity.
    pub fn record(&self, mut record: AuditRecord) -> AuditRecord {
        let mut guard = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let (seq, records) = &mut *guard;
        *seq += 1;
        record.seq = *seq;
        tracing::info!(
            target: "audit",
            seq = record.seq,
            who = %record.who,
            via = %record.via,
            from = record.from.as_deref().unwrap_or("-"),
            action = %record.action,
            service = %record.service,
            node = record.node.as_deref().unwrap_or("-"),
            weight = record.weight,
            until_ms = record.until_ms,
            reason = %record.reason,
            received_by = record.received_by.as_deref().unwrap_or("-"),
            applied_by = record.applied_by.as_deref().unwrap_or("-"),
            "operator action"
        );
        if records.len() == self.capacity {
            records.pop_front();
        }
        records.push_back(record.clone());
        record
    }

    /// The records kept, newest first.
    pub fn newest_first(&self) -> Vec<AuditRecord> {
        let guard = self.records.lock().unwrap_or_else(|p| p.into_inner());
        guard.1.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(reason: &str) -> AuditRecord {
        AuditRecord {
            seq: 0,
            at_ms: 1,
            who: "alice".into(),
            via: "token".into(),
            from: Some("10.0.0.1:5000".into()),
            action: "drain".into(),
            service: "web".into(),
            node: Some("n1".into()),
            weight: None,
            until_ms: None,
            reason: reason.into(),
            received_by: None,
            applied_by: None,
        }
    }

    #[test]
    fn the_trail_keeps_the_newest_records_numbered_and_no_more() {
        let audit = Audit::new(3);
        for i in 0..5 {
            audit.record(record(&format!("r{i}")));
        }
        let kept = audit.newest_first();
        let reasons: Vec<&str> = kept.iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(reasons, ["r4", "r3", "r2"]);
        assert_eq!(kept[0].seq, 5);
    }
}
