//! The aggregator's Prometheus metrics.
//!
//! Counters live here; figures that are properties of a service (max/avg, missing
//! share) are read from the balancer when `/metrics` is scraped, so the two can never
//! disagree.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

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

/// A label set with a `service` and a `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceReason {
    /// The service.
    pub service: String,
    /// Why.
    pub reason: String,
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

/// A label set with one `service`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabel {
    /// The service.
    pub service: String,
}

/// A label set with one xDS `resource` type (listener, route, cluster, endpoints).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XdsResource {
    /// The resource type.
    pub resource: String,
}

impl XdsResource {
    /// The label set of `resource`.
    pub fn of(resource: &str) -> Self {
        XdsResource {
            resource: resource.to_string(),
        }
    }
}

/// Every counter the daemon keeps.
pub struct Metrics {
    registry: Registry,
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
    /// Reloads of the TLS files (certificate and key, CA bundle), by file and result.
    pub tls_reloads: Family<TlsReloadLabels, Counter>,
    /// Cycles run, by service.
    pub cycles: Family<ServiceLabel, Counter>,
    /// Cycles that changed nothing, by service and reason.
    pub cycles_skipped: Family<ServiceReason, Counter>,
    /// Endpoints forgotten after a silence longer than `expire_ms`, by service.
    pub endpoints_expired: Family<ServiceLabel, Counter>,
    /// Endpoints forgotten because their node moved: it said hello to another service
    /// and stopped reporting here, or another node took its address after it stopped
    /// reporting; by service.
    pub endpoints_moved: Family<ServiceLabel, Counter>,
    /// Wall time of one cycle over all services, in seconds.
    pub cycle_duration: Histogram,
    /// Routing-store writes, by outcome.
    pub store_writes: Family<Reason, Counter>,
    /// Wall time of one routing-store write, in seconds: a slow store shows here
    /// before it falls behind.
    pub store_write_seconds: Histogram,
    /// Services whose latest change the routing store does not hold yet.
    pub store_pending: Gauge,
    /// Age of the oldest change the routing store does not hold yet, in seconds; 0
    /// when it holds every one. A hung or failing store makes it grow.
    pub store_lag_seconds: Gauge<f64, AtomicU64>,
    /// Stored services skipped when read back because they are not valid snapshots,
    /// by defect (`unparseable`, `service`, `node`, `address`, `zone`, `weight`).
    pub store_corrupt: Family<Reason, Counter>,
    /// Service values the routing store refused to write, by reason (`too_large`: over
    /// etcd's request limit).
    pub store_refused: Family<Reason, Counter>,
    /// Services whose latest value is too large for the routing store, kept there at
    /// their last value that fitted.
    pub store_too_large: Gauge,
    /// xDS responses sent, by resource type.
    pub xds_pushes: Family<XdsResource, Counter>,
    /// xDS responses clients rejected (NACK), by resource type.
    pub xds_nacks: Family<XdsResource, Counter>,
    /// xDS streams open now.
    pub xds_streams: Gauge,
    /// xDS streams and requests refused for a limit, by reason.
    pub xds_refused: Family<Reason, Counter>,
    /// TCP connections to the xDS listener open now, TLS handshakes included.
    pub xds_connections: Gauge,
    /// Bytes the open xDS streams keep for their subscriptions and clients' nodes, as
    /// `xds_max_stream_bytes` counts them.
    pub xds_stream_bytes: Gauge,
    /// NACK warnings left out of the log by its rate limit (every NACK is still
    /// counted in `xds_nacks`).
    pub xds_nack_logs_suppressed: Counter,
    /// HTTP connections and watch streams refused or cut off for a limit, by reason.
    pub http_refused: Family<Reason, Counter>,
    /// HTTP requests and TLS handshakes refused for their credential, by reason
    /// (`missing`, `bad_token`, `bad_cert`, `forbidden`).
    pub http_auth_failures: Family<Reason, Counter>,
    /// Changes of the HTTP API's token file, by outcome (`applied`, `invalid`).
    pub http_token_reloads: Family<Reason, Counter>,
    /// HTTP watch (server-sent) events sent, by service.
    pub watch_events: Family<ServiceLabel, Counter>,
    /// HTTP watch streams open now.
    pub watch_streams: Gauge,
    /// Config-directory reloads, by outcome (`applied`, `unchanged`, `error`).
    pub config_reloads: Family<Reason, Counter>,
    /// As a cluster replica: the buckets of services this replica owns now.
    pub cluster_buckets_owned: Gauge,
    /// As a cluster replica: buckets taken over, their services restored from etcd.
    pub cluster_takeovers: Counter,
    /// As a cluster replica: lease sessions that ended (etcd unreachable, the lease
    /// lapsed), each giving up every bucket the replica held.
    pub cluster_sessions_lost: Counter,
    /// As a cluster replica: seconds since etcd last confirmed its copy of the stored
    /// services current. Set when scraped.
    pub cluster_feed_behind_seconds: Gauge<f64, AtomicU64>,
    /// Service files refused (parse or validation), by file.
    pub config_rejected: Family<FileLabel, Counter>,
    /// The per-service families, filled for the length of one scrape.
    service_families: ServiceFamilies,
    /// One scrape with per-service families at a time, so that each encodes its own.
    scrape: Mutex<()>,
}

/// A label set with one config `file`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabel {
    /// The file's name within the config directory.
    pub file: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts an xDS refusal for `reason`.
    pub fn refuse_xds(&self, reason: &str) {
        self.xds_refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts an HTTP refusal for `reason`.
    pub fn refuse_http(&self, reason: &str) {
        self.http_refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts an HTTP request or handshake refused for its credential, for `reason`.
    pub fn fail_http_auth(&self, reason: &str) {
        self.http_auth_failures
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a change of the token file, by `result`.
    pub fn reload_tokens(&self, result: &str) {
        self.http_token_reloads
            .get_or_create(&Reason {
                reason: result.to_string(),
            })
            .inc();
    }

    /// Registers every metric under the `ballast` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ballast");
        let m = Metrics {
            reports_accepted: Counter::default(),
            reports_rejected: Family::default(),
            connections_rejected: Family::default(),
            connections_open: Gauge::default(),
            agent_connections: Family::default(),
            agent_connections_accepted: Family::default(),
            trunks_open: Gauge::default(),
            trunk_slots: Gauge::default(),
            trunk_detached: Family::default(),
            trunk_unproven: Counter::default(),
            trunk_batches: Counter::default(),
            trunk_reports: Counter::default(),
            crl_reloads: Family::default(),
            tls_reloads: Family::default(),
            cycles: Family::default(),
            cycles_skipped: Family::default(),
            endpoints_expired: Family::default(),
            endpoints_moved: Family::default(),
            cycle_duration: Histogram::new(
                [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0].into_iter(),
            ),
            store_writes: Family::default(),
            store_write_seconds: Histogram::new(
                [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0].into_iter(),
            ),
            store_pending: Gauge::default(),
            store_lag_seconds: Gauge::default(),
            store_corrupt: Family::default(),
            store_refused: Family::default(),
            store_too_large: Gauge::default(),
            xds_pushes: Family::default(),
            xds_nacks: Family::default(),
            xds_streams: Gauge::default(),
            xds_refused: Family::default(),
            xds_connections: Gauge::default(),
            xds_stream_bytes: Gauge::default(),
            xds_nack_logs_suppressed: Counter::default(),
            http_refused: Family::default(),
            http_auth_failures: Family::default(),
            http_token_reloads: Family::default(),
            watch_events: Family::default(),
            watch_streams: Gauge::default(),
            config_reloads: Family::default(),
            config_rejected: Family::default(),
            cluster_buckets_owned: Gauge::default(),
            cluster_takeovers: Counter::default(),
            cluster_feed_behind_seconds: Gauge::default(),
            cluster_sessions_lost: Counter::default(),
            service_families: ServiceFamilies::default(),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        registry.register(
            "reports_accepted",
            "Reports accepted",
            m.reports_accepted.clone(),
        );
        registry.register(
            "reports_rejected",
            "Reports and hellos rejected, by reason",
            m.reports_rejected.clone(),
        );
        registry.register(
            "connections_rejected",
            "Agent connections refused or closed, by reason",
            m.connections_rejected.clone(),
        );
        registry.register(
            "connections_open",
            "Agent connections open",
            m.connections_open.clone(),
        );
        registry.register(
            "agent_connections",
            "Agent connections open, by the protocol version they negotiated",
            m.agent_connections.clone(),
        );
        registry.register(
            "agent_connections_accepted",
            "Agent connections accepted, by the protocol version they negotiated",
            m.agent_connections_accepted.clone(),
        );
        // Every version shows, at 0 until an agent speaks it: a scrape tells "none
        // left" from "not counted".
        for p in ballast_shared::protocol::Protocol::ALL {
            let _ = m.agent_connections.get_or_create(&ProtocolLabel::of(p));
            let _ = m
                .agent_connections_accepted
                .get_or_create(&ProtocolLabel::of(p));
        }
        registry.register(
            "trunks_open",
            "Trunks from relays open",
            m.trunks_open.clone(),
        );
        registry.register(
            "trunk_slots",
            "Agents attached through trunks from relays",
            m.trunk_slots.clone(),
        );
        registry.register(
            "trunk_detached",
            "Agents behind relays detached by this aggregator or lost with their trunk, by reason",
            m.trunk_detached.clone(),
        );
        registry.register(
            "trunk_unproven_admitted",
            "Agents admitted through a relay without a proof of their key (admit_unproven_relayed_agents)",
            m.trunk_unproven.clone(),
        );
        registry.register(
            "trunk_batches",
            "Batches of reports received on trunks",
            m.trunk_batches.clone(),
        );
        registry.register(
            "trunk_reports",
            "Reports received in trunks' batches",
            m.trunk_reports.clone(),
        );
        registry.register(
            "crl_reloads",
            "Certificate revocation list reloads, by outcome",
            m.crl_reloads.clone(),
        );
        registry.register(
            "tls_reloads",
            "Reloads of changed TLS files (certificate with its key, CA bundle), by file \
             and result (applied, or why refused)",
            m.tls_reloads.clone(),
        );
        registry.register("cycles", "Balancing cycles run", m.cycles.clone());
        registry.register(
            "cluster_buckets_owned",
            "Buckets of services this cluster replica owns",
            m.cluster_buckets_owned.clone(),
        );
        registry.register(
            "cluster_takeovers",
            "Buckets this cluster replica took over, restored from etcd",
            m.cluster_takeovers.clone(),
        );
        registry.register(
            "cluster_feed_behind_seconds",
            "Seconds since etcd last confirmed this cluster replica's copy of the stored services",
            m.cluster_feed_behind_seconds.clone(),
        );
        registry.register(
            "cluster_sessions_lost",
            "Cluster lease sessions that ended, giving up every bucket held",
            m.cluster_sessions_lost.clone(),
        );
        registry.register(
            "cycles_skipped",
            "Balancing cycles that changed no weight, by reason",
            m.cycles_skipped.clone(),
        );
        registry.register(
            "endpoints_expired",
            "Endpoints forgotten after a silence longer than expire_ms, by service",
            m.endpoints_expired.clone(),
        );
        registry.register(
            "endpoints_moved",
            "Endpoints forgotten because their node moved to another service or address",
            m.endpoints_moved.clone(),
        );
        registry.register(
            "cycle_duration_seconds",
            "Wall time of one balancing cycle over all services",
            m.cycle_duration.clone(),
        );
        registry.register(
            "store_writes",
            "Routing store writes, by outcome",
            m.store_writes.clone(),
        );
        registry.register(
            "store_write_seconds",
            "Wall time of one routing store write",
            m.store_write_seconds.clone(),
        );
        registry.register(
            "store_pending",
            "Services whose latest change the routing store does not hold yet",
            m.store_pending.clone(),
        );
        registry.register(
            "store_lag_seconds",
            "Age of the oldest change the routing store does not hold yet",
            m.store_lag_seconds.clone(),
        );
        registry.register(
            "store_corrupt",
            "Stored services skipped when read back as corrupt, by reason",
            m.store_corrupt.clone(),
        );
        registry.register(
            "store_refused",
            "Service values the routing store refused to write, by reason",
            m.store_refused.clone(),
        );
        registry.register(
            "store_too_large",
            "Services too large for the routing store, kept there at their last value",
            m.store_too_large.clone(),
        );
        registry.register(
            "xds_pushes",
            "xDS responses sent, by resource type",
            m.xds_pushes.clone(),
        );
        registry.register(
            "xds_nacks",
            "xDS responses rejected by clients (NACK), by resource type",
            m.xds_nacks.clone(),
        );
        registry.register("xds_streams", "xDS streams open", m.xds_streams.clone());
        registry.register(
            "xds_refused",
            "xDS streams and requests refused for a limit, by reason",
            m.xds_refused.clone(),
        );
        registry.register(
            "xds_connections",
            "TCP connections to the xDS listener open, TLS handshakes included",
            m.xds_connections.clone(),
        );
        registry.register(
            "xds_stream_bytes",
            "Bytes the open xDS streams keep for subscriptions and client nodes",
            m.xds_stream_bytes.clone(),
        );
        registry.register(
            "xds_nack_logs_suppressed",
            "NACK warnings left out of the log by its rate limit",
            m.xds_nack_logs_suppressed.clone(),
        );
        registry.register(
            "http_refused",
            "HTTP connections and watch streams refused or cut off for a limit, by reason",
            m.http_refused.clone(),
        );
        registry.register(
            "http_auth_failures",
            "HTTP requests and TLS handshakes refused for their credential, by reason",
            m.http_auth_failures.clone(),
        );
        registry.register(
            "http_token_reloads",
            "Changes of the HTTP API's token file, by outcome",
            m.http_token_reloads.clone(),
        );
        registry.register(
            "watch_events",
            "HTTP watch events sent (one per weight version), by service",
            m.watch_events.clone(),
        );
        registry.register(
            "watch_streams",
            "HTTP watch streams open",
            m.watch_streams.clone(),
        );
        registry.register(
            "config_reloads",
            "Config directory reloads, by outcome",
            m.config_reloads.clone(),
        );
        registry.register(
            "config_rejected",
            "Service config files refused, by file",
            m.config_rejected.clone(),
        );
        registry.register_collector(Box::new(m.service_families.clone()));
        Metrics { registry, ..m }
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
    pub(crate) fn reject_connection(&self, reason: &str) {
        self.connections_rejected
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a slot of a trunk detached for `reason`.
    pub(crate) fn detach_slot(&self, reason: &str) {
        self.trunk_detached
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The registry in Prometheus text format, without the per-service families.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The registry in Prometheus text format with the per-service families of
    /// `services` (as of their last cycle), as `/metrics` serves it.
    pub fn encode_with_services(&self, services: Vec<ServiceRow>) -> String {
        let _one = self.scrape.lock().unwrap_or_else(PoisonError::into_inner);
        self.service_families.set(Some(services));
        let out = self.encode();
        self.service_families.set(None);
        out
    }
}

/// A label value escaped as the text format wants it: `\`, `"` and line feed as
/// `\\`, `\"` and `\n`. prometheus-client (0.22) writes label values as given.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl EncodeLabelValue for Escaped<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// One service's figures for its `ballast_service_*` series, as of its last cycle
/// (the API builds them from the same summary it serves).
#[derive(Debug, Clone, Default)]
pub struct ServiceRow {
    /// The service.
    pub name: String,
    /// Known endpoints.
    pub endpoints: usize,
    /// Average load of fresh serving endpoints.
    pub avg: f64,
    /// Max over average load.
    pub max_over_avg: f64,
    /// 95th percentile over average load.
    pub p95_over_avg: f64,
    /// Share of endpoints not draining whose reports are stale.
    pub missing_share: f64,
    /// Endpoints whose in-flight count is set aside now.
    pub inflight_distrusted: usize,
    /// Times an endpoint's in-flight count was set aside.
    pub inflight_distrusts: u64,
    /// Cycles that stepped weights straight to the capacity estimate.
    pub feed_forward_steps: u64,
    /// Endpoints silent past `expire_ms` kept with their last weights.
    pub expiry_held: usize,
}

/// A per-service gauge: its name (after `ballast_`), help, and value.
type ServiceGauge<T> = (&'static str, &'static str, fn(&ServiceRow) -> T);

/// The per-service gauges with fractional values.
const SERVICE_RATIOS: [ServiceGauge<f64>; 4] = [
    (
        "service_max_over_avg",
        "Max over average load of fresh serving endpoints.",
        |s| s.max_over_avg,
    ),
    (
        "service_p95_over_avg",
        "95th percentile over average load.",
        |s| s.p95_over_avg,
    ),
    (
        "service_avg_load",
        "Average load of fresh serving endpoints.",
        |s| s.avg,
    ),
    (
        "service_missing_share",
        "Share of endpoints not draining whose reports are stale.",
        |s| s.missing_share,
    ),
];

/// The per-service gauges that count endpoints.
const SERVICE_COUNTS: [ServiceGauge<i64>; 3] = [
    ("service_endpoints", "Known endpoints.", |s| {
        i64::try_from(s.endpoints).unwrap_or(i64::MAX)
    }),
    (
        "service_inflight_distrusted",
        "Endpoints whose in-flight count does not follow their weight and is set aside.",
        |s| i64::try_from(s.inflight_distrusted).unwrap_or(i64::MAX),
    ),
    (
        "service_expiry_held",
        "Endpoints silent past expire_ms kept with their last weights, because too \
         much of the service fell silent at once.",
        |s| i64::try_from(s.expiry_held).unwrap_or(i64::MAX),
    ),
];

/// The per-service counters (`_total` is added by the encoder).
const SERVICE_COUNTERS: [ServiceGauge<u64>; 2] = [
    (
        "service_inflight_distrusts",
        "Times an endpoint's in-flight count was set aside for not following its weight.",
        |s| s.inflight_distrusts,
    ),
    (
        "service_feed_forward_steps",
        "Cycles that stepped weights straight to the capacity estimate.",
        |s| s.feed_forward_steps,
    ),
];

/// The families whose series are services (`ballast_service_*{service}`): figures read
/// from the published weights when `/metrics` is scraped, so that they never disagree
/// with the API. Empty (not even described) outside such a scrape.
#[derive(Debug, Clone, Default)]
struct ServiceFamilies {
    services: Arc<Mutex<Option<Vec<ServiceRow>>>>,
}

impl ServiceFamilies {
    fn set(&self, services: Option<Vec<ServiceRow>>) {
        *self.services.lock().unwrap_or_else(PoisonError::into_inner) = services;
    }
}

impl Collector for ServiceFamilies {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let services = self.services.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(services) = services.as_ref() else {
            return Ok(());
        };
        for (name, help, value) in SERVICE_RATIOS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for s in services {
                let labels = [("service", Escaped(&s.name))];
                ConstGauge::new(value(s)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, value) in SERVICE_COUNTS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for s in services {
                let labels = [("service", Escaped(&s.name))];
                ConstGauge::new(value(s)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, value) in SERVICE_COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in services {
                let labels = [("service", Escaped(&s.name))];
                ConstCounter::new(value(s)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// A counter of TLS file reloads for [`ballast_shared::tls::live::LiveTls::watch`],
/// into `metrics`, its `file` label prefixed with `prefix` (`""` for the files of
/// `tls`, `"relay_"` for those of `relay.tls`).
pub fn tls_reload_counter(
    metrics: &std::sync::Arc<Metrics>,
    prefix: &'static str,
) -> ballast_shared::tls::live::ReloadCounter {
    let metrics = metrics.clone();
    std::sync::Arc::new(move |file, result| {
        metrics
            .tls_reloads
            .get_or_create(&TlsReloadLabels {
                file: format!("{prefix}{}", file.label()),
                result: result.label().to_string(),
            })
            .inc();
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(name: &str) -> ServiceRow {
        ServiceRow {
            name: name.to_string(),
            endpoints: 3,
            avg: 0.5,
            max_over_avg: 1.25,
            p95_over_avg: 1.125,
            missing_share: 0.0,
            inflight_distrusted: 1,
            inflight_distrusts: 2,
            feed_forward_steps: 0,
            expiry_held: 0,
        }
    }

    #[test]
    fn service_label_values_are_escaped() {
        let m = Metrics::new();
        let text = m.encode_with_services(vec![summary("a\"b\\c\nd")]);
        let label = r#"{service="a\"b\\c\nd"}"#;
        for line in [
            format!("ballast_service_max_over_avg{label} 1.25"),
            format!("ballast_service_endpoints{label} 3"),
            format!("ballast_service_inflight_distrusted{label} 1"),
            format!("ballast_service_inflight_distrusts_total{label} 2"),
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // Every sample is one line: the raw line feed never reaches the output.
        assert!(!text.lines().any(|l| l.starts_with("d\"}")), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    }

    #[test]
    fn service_families_are_described_once_each_and_only_in_a_scrape() {
        let m = Metrics::new();
        let text = m.encode_with_services(vec![summary("web"), summary("api")]);
        for family in [
            "ballast_service_max_over_avg gauge",
            "ballast_service_p95_over_avg gauge",
            "ballast_service_avg_load gauge",
            "ballast_service_missing_share gauge",
            "ballast_service_endpoints gauge",
            "ballast_service_inflight_distrusted gauge",
            "ballast_service_expiry_held gauge",
            "ballast_service_inflight_distrusts counter",
            "ballast_service_feed_forward_steps counter",
        ] {
            assert_eq!(
                text.matches(&format!("# TYPE {family}\n")).count(),
                1,
                "{family}"
            );
        }
        assert!(text.contains("ballast_service_avg_load{service=\"api\"} 0.5\n"));
        assert!(text.contains("ballast_service_feed_forward_steps_total{service=\"web\"} 0\n"));
        // Outside a scrape of /metrics (the relay's exposition), no per-service family.
        assert!(!m.encode().contains("ballast_service_"));
    }
}
