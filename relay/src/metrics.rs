//! The relay's Prometheus metrics, in a registry of its own: the agent-facing ingest's
//! families (`ballast_connections_open`, `ballast_connections_rejected_total`,
//! `ballast_reports_rejected_total`, ...), and the relay's, under `ballast_relay_`.
//! Nothing of the aggregator's (cycles, store, xDS, cluster) is served by a relay.

use ballast_ingest::metrics::{IngestMetrics, Reason};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// Every counter the relay keeps: ingest's, and its own.
pub struct RelayMetrics {
    registry: Registry,
    /// The agent-facing ingest's (connections, reports, the trunk files' reloads).
    pub ingest: Arc<IngestMetrics>,
    /// Connections the HTTP listener refused or cut off, by reason.
    pub http_refused: Family<Reason, Counter>,
    /// HTTP requests and TLS handshakes refused for their credential, by reason
    /// (`missing`, `bad_token`, `bad_cert`, `revoked`, `expired`, `forbidden`).
    pub http_auth_failures: Family<Reason, Counter>,
    /// Changes of the HTTP port's token file, by outcome (`applied`, `invalid`).
    pub http_token_reloads: Family<Reason, Counter>,
    /// Agents' reports handed to a trunk.
    pub reports_forwarded: Counter,
    /// Agents' reports not handed on, by reason (`failover`: a newer one replaced it
    /// while its agent was rehoming; `stale`: too old once the new owner took the
    /// agent; `no_owner`; `trunk_full`).
    pub reports_dropped: Family<Reason, Counter>,
    /// Replies from the primaries sent on to agents.
    pub replies_forwarded: Counter,
    /// Replies sent to agents from their last reply while they were rehoming.
    pub replies_cached: Counter,
    /// Agents moved to another replica without their connection ending.
    pub rehomed: Counter,
    /// Agents the relay could not attach to an owner, by reason (`no_owner`,
    /// `trunk_down`, `timeout`, `slots_full`, or the primary's reject reason).
    pub attach_refused: Family<Reason, Counter>,
    /// Trunks open now.
    pub trunks_open: Gauge,
    /// Route tables received from replicas (changes and confirmations).
    pub routes_received: Counter,
    /// Routes connections to replicas that failed or ended, by reason (`unreachable`,
    /// `no_routes_protocol`: a replica of a release before this one, `refused`,
    /// `silent`: no table within the confirmation window, `malformed`, `lost`).
    pub routes_failures: Family<Reason, Counter>,
}

impl Default for RelayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RelayMetrics {
    /// Registers ingest's families under the `ballast` prefix, and the relay's under
    /// `ballast_relay`.
    pub fn new() -> Self {
        let mut top = Registry::with_prefix("ballast");
        let m = RelayMetrics {
            registry: Registry::default(),
            ingest: Arc::new(IngestMetrics::new()),
            http_refused: Family::default(),
            http_auth_failures: Family::default(),
            http_token_reloads: Family::default(),
            reports_forwarded: Counter::default(),
            reports_dropped: Family::default(),
            replies_forwarded: Counter::default(),
            replies_cached: Counter::default(),
            rehomed: Counter::default(),
            attach_refused: Family::default(),
            trunks_open: Gauge::default(),
            routes_received: Counter::default(),
            routes_failures: Family::default(),
        };
        m.ingest.register(&mut top);
        let registry = top.sub_registry_with_prefix("relay");
        registry.register(
            "http_refused",
            "HTTP connections refused or cut off, by reason",
            m.http_refused.clone(),
        );
        registry.register(
            "http_auth_failures",
            "HTTP requests and TLS handshakes refused for their credential, by reason",
            m.http_auth_failures.clone(),
        );
        registry.register(
            "http_token_reloads",
            "Changes of the HTTP port's token file, by outcome",
            m.http_token_reloads.clone(),
        );
        registry.register(
            "http_crl_reloads",
            "Reloads of the HTTP port's own certificate revocation list (http_auth.crl), by outcome",
            m.ingest.http_crl_reloads.clone(),
        );
        registry.register(
            "reports_forwarded",
            "Agents' reports handed to a trunk",
            m.reports_forwarded.clone(),
        );
        registry.register(
            "reports_dropped",
            "Agents' reports not handed on, by reason",
            m.reports_dropped.clone(),
        );
        registry.register(
            "replies_forwarded",
            "Primaries' replies sent on to agents",
            m.replies_forwarded.clone(),
        );
        registry.register(
            "replies_cached",
            "Replies sent to rehoming agents from their last reply",
            m.replies_cached.clone(),
        );
        registry.register(
            "rehomed",
            "Agents moved to another replica without their connection ending",
            m.rehomed.clone(),
        );
        registry.register(
            "attach_refused",
            "Agents not attached to an owner, by reason",
            m.attach_refused.clone(),
        );
        registry.register("trunks_open", "Trunks open now", m.trunks_open.clone());
        registry.register(
            "routes_received",
            "Route tables received from replicas (changes and confirmations)",
            m.routes_received.clone(),
        );
        registry.register(
            "routes_failures",
            "Routes connections to replicas that failed or ended, by reason",
            m.routes_failures.clone(),
        );
        RelayMetrics { registry: top, ..m }
    }

    /// Counts a report dropped for `reason`.
    pub fn drop_report(&self, reason: &str) {
        self.reports_dropped
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a routes connection that failed or ended for `reason`.
    pub fn routes_failed(&self, reason: &str) {
        self.routes_failures
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts an attach refused for `reason`.
    pub fn refuse_attach(&self, reason: &str) {
        self.attach_refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The registry in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The HTTP listener counts its refusals here.
impl ballast_ingest::http_listener::HttpCounts for RelayMetrics {
    fn refuse(&self, reason: &str) {
        self.http_refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    fn refuse_cert(&self, reason: &str) {
        ballast_http_auth::AuthCounts::auth_failure(self, reason);
    }
}

/// The HTTP port's credentials count their refusals and token file reloads here.
impl ballast_http_auth::AuthCounts for RelayMetrics {
    fn auth_failure(&self, reason: &str) {
        self.http_auth_failures
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    fn tokens_reload(&self, outcome: &str) {
        self.http_token_reloads
            .get_or_create(&Reason {
                reason: outcome.to_string(),
            })
            .inc();
    }
}
