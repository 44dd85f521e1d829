//! Ingest's Prometheus families: agents' connections and reports, relays' trunks as a
//! primary sees them, and the reloads of the files ingest watches (TLS, revocation
//! list). A process registers them into its own registry ([`IngestMetrics::register`]):
//! the aggregator beside its balancer's, a relay beside its trunks'.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// A label set with one `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// Why.
    pub reason: String,
}

/// The labels of a TLS file reload: which file, and what came of it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsReloadLabels {
    /// `certificate` (with its key) or `ca`; `relay_` before either for a relay's
    /// trunk files.
    pub file: String,
    /// `applied`, or why refused.
    pub result: String,
}

/// A label set with one agent `protocol` version (its ALPN name, `ballast/2`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabel {
    /// The version.
    pub protocol: String,
}

impl ProtocolLabel {
    /// The label set of `protocol`.
    pub fn of(protocol: ballast_shared::protocol::Protocol) -> Self {
        ProtocolLabel {
            protocol: protocol.name().to_string(),
        }
    }
}

/// Every counter ingest keeps.
#[derive(Debug, Default)]
pub struct IngestMetrics {
    /// Reports accepted into the balancer.
    pub reports_accepted: Counter,
    /// Reports and hellos refused, by reason.
    pub reports_rejected: Family<Reason, Counter>,
    /// Connections refused or closed for a protocol fault, by reason.
    pub connections_rejected: Family<Reason, Counter>,
    /// Agent connections open now.
    pub connections_open: Gauge,
    /// Agent connections open now, by the protocol version they negotiated: when the
    /// previous version's stays at 0, no agent of the previous release is left.
    pub agent_connections: Family<ProtocolLabel, Gauge>,
    /// Agent connections accepted, by the protocol version they negotiated.
    pub agent_connections_accepted: Family<ProtocolLabel, Counter>,
    /// Trunks from relays open now.
    pub trunks_open: Gauge,
    /// Agents attached through trunks now (slots welcomed and not yet detached).
    pub trunk_slots: Gauge,
    /// Relays following the cluster's routes from this replica now.
    pub routes_feeds_open: Gauge,
    /// Route tables sent to relays (changes and confirmations).
    pub routes_sent: Counter,
    /// Slots the primary detached, or lost with their trunk, by reason (`moved`,
    /// `revoked`, `expired`, `no_reports`, `protocol`, `relay_gone`).
    pub trunk_detached: Family<Reason, Counter>,
    /// Agents admitted through a relay without a proof of their key
    /// (`admit_unproven_relayed_agents`, during an upgrade).
    pub trunk_unproven: Counter,
    /// Batches of reports received on trunks.
    pub trunk_batches: Counter,
    /// Reports received in trunks' batches: divided by `trunk_batches`, the entries per
    /// batch.
    pub trunk_reports: Counter,
    /// Certificate revocation list reloads, by outcome (`applied`, `error`).
    pub crl_reloads: Family<Reason, Counter>,
    /// Reloads of the HTTP listener's own certificate revocation list
    /// (`http_auth.crl`), by outcome (`applied`, `error`). Not registered here: each
    /// process registers it under the name of its HTTP port's families.
    pub http_crl_reloads: Family<Reason, Counter>,
    /// Reloads of the TLS files (certificate and key, CA bundle), by file and result.
    pub tls_reloads: Family<TlsReloadLabels, Counter>,
}

impl IngestMetrics {
    /// New families, at 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the families into `registry` (whose prefix is `ballast`), every agent
    /// protocol version shown at 0 until an agent speaks it.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "reports_accepted",
            "Reports accepted",
            self.reports_accepted.clone(),
        );
        registry.register(
            "reports_rejected",
            "Reports and hellos rejected, by reason",
            self.reports_rejected.clone(),
        );
        registry.register(
            "connections_rejected",
            "Agent connections refused or closed, by reason",
            self.connections_rejected.clone(),
        );
        registry.register(
            "connections_open",
            "Agent connections open",
            self.connections_open.clone(),
        );
        registry.register(
            "agent_connections",
            "Agent connections open, by the protocol version they negotiated",
            self.agent_connections.clone(),
        );
        registry.register(
            "agent_connections_accepted",
            "Agent connections accepted, by the protocol version they negotiated",
            self.agent_connections_accepted.clone(),
        );
        // Every version shows, at 0 until an agent speaks it: a scrape tells "none
        // left" from "not counted".
        for p in ballast_shared::protocol::Protocol::ALL {
            let _ = self.agent_connections.get_or_create(&ProtocolLabel::of(p));
            let _ = self
                .agent_connections_accepted
                .get_or_create(&ProtocolLabel::of(p));
        }
        registry.register(
            "trunks_open",
            "Trunks from relays open",
            self.trunks_open.clone(),
        );
        registry.register(
            "trunk_slots",
            "Agents attached through trunks from relays",
            self.trunk_slots.clone(),
        );
        registry.register(
            "routes_feeds_open",
            "Relays following the cluster's routes from this replica",
            self.routes_feeds_open.clone(),
        );
        registry.register(
            "routes_sent",
            "Route tables sent to relays (changes and confirmations)",
            self.routes_sent.clone(),
        );
        registry.register(
            "trunk_detached",
            "Agents behind relays detached by this aggregator or lost with their trunk, by reason",
            self.trunk_detached.clone(),
        );
        registry.register(
            "trunk_unproven_admitted",
            "Agents admitted through a relay without a proof of their key (admit_unproven_relayed_agents)",
            self.trunk_unproven.clone(),
        );
        registry.register(
            "trunk_batches",
            "Batches of reports received on trunks",
            self.trunk_batches.clone(),
        );
        registry.register(
            "trunk_reports",
            "Reports received in trunks' batches",
            self.trunk_reports.clone(),
        );
        registry.register(
            "crl_reloads",
            "Certificate revocation list reloads, by outcome",
            self.crl_reloads.clone(),
        );
        registry.register(
            "tls_reloads",
            "Reloads of changed TLS files (certificate with its key, CA bundle), by file \
             and result (applied, or why refused)",
            self.tls_reloads.clone(),
        );
    }

    /// Counts an agent connection that negotiated `protocol`; the gauge of those open
    /// now, for the caller to raise and lower around the connection.
    pub fn agent_connections(&self, protocol: ballast_shared::protocol::Protocol) -> Gauge {
        let label = ProtocolLabel::of(protocol);
        self.agent_connections_accepted.get_or_create(&label).inc();
        self.agent_connections.get_or_create(&label).clone()
    }

    /// Counts a rejected report or hello.
    pub fn reject(&self, reason: &str) {
        self.reports_rejected
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a refused or faulty connection.
    pub fn reject_connection(&self, reason: &str) {
        self.connections_rejected
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a slot of a trunk detached for `reason`.
    pub fn detach_slot(&self, reason: &str) {
        self.trunk_detached
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// A counter of TLS file reloads for [`ballast_shared::tls::live::LiveTls::watch`],
/// into `metrics`, its `file` label prefixed with `prefix` (`""` for the files of
/// `tls`, `"relay_"` for those of `relay.tls`).
pub fn tls_reload_counter(
    metrics: &Arc<IngestMetrics>,
    prefix: &'static str,
) -> ballast_shared::tls::live::ReloadCounter {
    let metrics = metrics.clone();
    Arc::new(move |file, result| {
        metrics
            .tls_reloads
            .get_or_create(&TlsReloadLabels {
                file: format!("{prefix}{}", file.label()),
                result: result.label().to_string(),
            })
            .inc();
    })
}
