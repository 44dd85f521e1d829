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

use ballast_ingest::metrics::IngestMetrics;
pub use ballast_ingest::metrics::{ProtocolLabel, Reason, TlsReloadLabels};

/// A label set with a `service` and a `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceReason {
    /// The service.
    pub service: String,
    /// Why.
    pub reason: String,
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

/// The xDS feed's counters: the part of [`Metrics`] the feed is given.
#[derive(Debug, Default)]
pub struct XdsMetrics {
    /// xDS responses sent, by resource type.
    pub pushes: Family<XdsResource, Counter>,
    /// xDS responses clients rejected (NACK), by resource type.
    pub nacks: Family<XdsResource, Counter>,
    /// xDS streams open now.
    pub streams: Gauge,
    /// xDS streams and requests refused for a limit, by reason.
    pub refused: Family<Reason, Counter>,
    /// TCP connections to the xDS listener open now, TLS handshakes included.
    pub connections: Gauge,
    /// Bytes the open xDS streams keep for their subscriptions and clients' nodes, as
    /// `xds_max_stream_bytes` counts them.
    pub stream_bytes: Gauge,
    /// NACK warnings left out of the log by its rate limit (every NACK is still
    /// counted in `nacks`).
    pub nack_logs_suppressed: Counter,
}

impl XdsMetrics {
    /// Counts an xDS refusal for `reason`.
    pub fn refuse(&self, reason: &str) {
        self.refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// The HTTP watch feed's counters: the part of [`Metrics`] the feed is given.
#[derive(Debug, Default)]
pub struct WatchMetrics {
    /// Watch events sent, by service.
    pub events: Family<ServiceLabel, Counter>,
    /// Watch streams open now.
    pub streams: Gauge,
}

/// The HAProxy agent-check feed's counters: the part of [`Metrics`] the feed is given.
#[derive(Debug, Default)]
pub struct HaproxyMetrics {
    /// Agent-checks answered, by what the answer said (`weight`, `drain`, `unknown`).
    pub replies: Family<Reason, Counter>,
    /// Agent-check connections closed unanswered, by reason (`malformed`, `too_long`,
    /// `timeout`, `io`, `connections`, `accept`).
    pub refused: Family<Reason, Counter>,
}

impl HaproxyMetrics {
    /// Counts an answer that said `what`.
    pub fn reply(&self, what: &str) {
        self.replies
            .get_or_create(&Reason {
                reason: what.to_string(),
            })
            .inc();
    }

    /// Counts a connection closed unanswered for `reason`.
    pub fn refuse(&self, reason: &str) {
        self.refused
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// Every counter the daemon keeps.
pub struct Metrics {
    registry: Registry,
    /// Ingest's families: agents' connections and reports, relays' trunks, TLS and
    /// revocation list reloads.
    pub ingest: Arc<IngestMetrics>,
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
    /// The xDS feed's counters, all it gets of these.
    pub xds: Arc<XdsMetrics>,
    /// HTTP connections and watch streams refused or cut off for a limit, by reason.
    pub http_refused: Family<Reason, Counter>,
    /// HTTP requests and TLS handshakes refused for their credential, by reason
    /// (`missing`, `bad_token`, `bad_cert`, `revoked`, `expired`, `forbidden`).
    pub http_auth_failures: Family<Reason, Counter>,
    /// Operators' actions through the API, by action and outcome (`applied`, or why
    /// it was refused: `no_reason`, `bad_body`, `unknown_endpoint`...).
    pub operator_actions: Family<ActionOutcome, Counter>,
    /// Changes of the HTTP API's token file, by outcome (`applied`, `invalid`).
    pub http_token_reloads: Family<Reason, Counter>,
    /// The HTTP watch feed's.
    pub watch: Arc<WatchMetrics>,
    /// The HAProxy agent-check feed's.
    pub haproxy: Arc<HaproxyMetrics>,
    /// Config-directory reloads, by outcome (`applied`, `unchanged`, `error`).
    pub config_reloads: Family<Reason, Counter>,
    /// As a cluster replica: the buckets of services this replica owns now.
    pub cluster_buckets_owned: Gauge,
    /// As a cluster replica: buckets taken over, their services restored from etcd.
    pub cluster_takeovers: Counter,
    /// As a cluster replica: lease sessions that ended (etcd unreachable, the lease
    /// lapsed), each giving up every bucket the replica held.
    pub cluster_sessions_lost: Counter,
    /// As a cluster replica: operators' actions other replicas handed on through etcd,
    /// as this replica dealt with them, by outcome (`applied`, `refused`,
    /// `left_for_owner`, `claimed_unanswered`, `claim_lost`, `outcome_write_failed`,
    /// `refused_forged`, `refused_too_large`, `unparseable`, `queue_full`,
    /// `scan_failed`...; docs/operations.md lists them all).
    pub cluster_action_requests: Family<RequestOutcome, Counter>,
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

/// An operator's action and its outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionOutcome {
    /// `drain`, `undrain`, `hold`, `release`, `pin` or `unpin`.
    pub action: String,
    /// `applied`, or why it was refused.
    pub outcome: String,
}

/// What became of a request for an operator's action handed on through etcd.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestOutcome {
    /// `applied`, `refused`, or why it was not answered (see
    /// [`Metrics::cluster_action_requests`]).
    pub outcome: String,
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

    /// Counts an operator's `action` by its `outcome`.
    pub fn act(&self, action: &str, outcome: &str) {
        self.operator_actions
            .get_or_create(&ActionOutcome {
                action: action.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts a request for an operator's action handed on through etcd, by `outcome`.
    pub fn action_request(&self, outcome: &str) {
        self.cluster_action_requests
            .get_or_create(&RequestOutcome {
                outcome: outcome.to_string(),
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
            ingest: Arc::new(IngestMetrics::new()),
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
            xds: Arc::new(XdsMetrics::default()),
            http_refused: Family::default(),
            http_auth_failures: Family::default(),
            http_token_reloads: Family::default(),
            operator_actions: Family::default(),
            watch: Arc::new(WatchMetrics::default()),
            haproxy: Arc::new(HaproxyMetrics::default()),
            config_reloads: Family::default(),
            config_rejected: Family::default(),
            cluster_buckets_owned: Gauge::default(),
            cluster_takeovers: Counter::default(),
            cluster_feed_behind_seconds: Gauge::default(),
            cluster_sessions_lost: Counter::default(),
            cluster_action_requests: Family::default(),
            service_families: ServiceFamilies::default(),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        m.ingest.register(&mut registry);
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
            "cluster_action_requests",
            "Operators' actions handed on by other cluster replicas, by what became of them here",
            m.cluster_action_requests.clone(),
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
            m.xds.pushes.clone(),
        );
        registry.register(
            "xds_nacks",
            "xDS responses rejected by clients (NACK), by resource type",
            m.xds.nacks.clone(),
        );
        registry.register("xds_streams", "xDS streams open", m.xds.streams.clone());
        registry.register(
            "xds_refused",
            "xDS streams and requests refused for a limit, by reason",
            m.xds.refused.clone(),
        );
        registry.register(
            "xds_connections",
            "TCP connections to the xDS listener open, TLS handshakes included",
            m.xds.connections.clone(),
        );
        registry.register(
            "xds_stream_bytes",
            "Bytes the open xDS streams keep for subscriptions and client nodes",
            m.xds.stream_bytes.clone(),
        );
        registry.register(
            "xds_nack_logs_suppressed",
            "NACK warnings left out of the log by its rate limit",
            m.xds.nack_logs_suppressed.clone(),
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
            "operator_actions",
            "Operators' actions through the API, by action and outcome",
            m.operator_actions.clone(),
        );
        registry.register(
            "http_crl_reloads",
            "Reloads of the HTTP listener's own certificate revocation list (http_auth.crl), by outcome",
            m.ingest.http_crl_reloads.clone(),
        );
        registry.register(
            "http_token_reloads",
            "Changes of the HTTP API's token file, by outcome",
            m.http_token_reloads.clone(),
        );
        registry.register(
            "watch_events",
            "HTTP watch events sent (one per weight version), by service",
            m.watch.events.clone(),
        );
        registry.register(
            "watch_streams",
            "HTTP watch streams open",
            m.watch.streams.clone(),
        );
        registry.register(
            "haproxy_agent_replies",
            "HAProxy agent-checks answered by the aggregator, by what the answer said",
            m.haproxy.replies.clone(),
        );
        registry.register(
            "haproxy_agent_refused",
            "HAProxy agent-check connections closed unanswered, by reason",
            m.haproxy.refused.clone(),
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
    /// Endpoints steered by their CPU above a floor their weight did not move.
    pub cpu_floors: usize,
    /// Times such a floor was found.
    pub cpu_floors_found: u64,
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
const SERVICE_COUNTS: [ServiceGauge<i64>; 4] = [
    ("service_endpoints", "Known endpoints.", |s| {
        i64::try_from(s.endpoints).unwrap_or(i64::MAX)
    }),
    (
        "service_inflight_distrusted",
        "Endpoints whose in-flight count does not follow their weight and is set aside.",
        |s| i64::try_from(s.inflight_distrusted).unwrap_or(i64::MAX),
    ),
    (
        "service_cpu_floors",
        "Endpoints steered by their CPU above a floor their weight did not move (other \
         work on the host or in the cgroup).",
        |s| i64::try_from(s.cpu_floors).unwrap_or(i64::MAX),
    ),
    (
        "service_expiry_held",
        "Endpoints silent past expire_ms kept with their last weights, because too \
         much of the service fell silent at once.",
        |s| i64::try_from(s.expiry_held).unwrap_or(i64::MAX),
    ),
];

/// The per-service counters (`_total` is added by the encoder).
const SERVICE_COUNTERS: [ServiceGauge<u64>; 3] = [
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
    (
        "service_cpu_floors_found",
        "Times an endpoint's CPU was found to keep a floor its weight did not move.",
        |s| s.cpu_floors_found,
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
            cpu_floors: 1,
            cpu_floors_found: 3,
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
            format!("ballast_service_cpu_floors{label} 1"),
            format!("ballast_service_cpu_floors_found_total{label} 3"),
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
            "ballast_service_cpu_floors gauge",
            "ballast_service_inflight_distrusts counter",
            "ballast_service_cpu_floors_found counter",
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
