//! JSON shapes of the API, built from what the last cycle published.

use ballast_balance::service::{HistoryPoint, ServiceStats};
use ballast_balance::{EndpointState, PublishedService, SkipReason};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The body of every error the API answers: the same two fields whatever went wrong,
/// so that a client needs one shape to read them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong, for people.
    pub error: String,
    /// The HTTP status again, for clients that lose it on the way.
    pub status: u16,
}

/// `GET /healthz`: whether the daemon balances, and how its routing store is doing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok` while the cycle loop runs and the store keeps up; `failing` (with status 503)
    /// when the loop is late or the store has been failing for too long.
    pub status: HealthStatus,
    /// Why it is failing, one sentence per cause; empty while it is ok.
    pub failing: Vec<String>,
    /// The routing store, as it names itself.
    pub store: String,
    /// The store's last write error; `null` once a write succeeds.
    pub store_error: Option<String>,
    /// The routing store's background writer.
    pub store_writer: crate::store::StoreHealth,
    /// As one replica of a cluster, what it owns and whether it follows etcd; `null`
    /// for a single aggregator.
    pub cluster: Option<ClusterHealth>,
}

/// A cluster replica's part of `GET /healthz`.
///
/// A replica behind etcd stays `ok`: with etcd down every replica is behind, and a
/// health check that took them all out would refuse new clients the last published
/// weights that each still serves. It says so here, and in
/// `ballast_cluster_feed_behind_seconds`, for an alert or a load balancer that prefers
/// the replicas that follow.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ClusterHealth {
    /// This replica's name.
    pub replica: String,
    /// The buckets of services it owns, and balances, now.
    pub buckets_owned: usize,
    /// Milliseconds since etcd last confirmed that this replica's copy of the stored
    /// services is current (since start, if it never has): how stale what it serves of
    /// the services it does not own may be.
    pub behind_etcd_ms: u64,
    /// Whether it follows etcd: confirmed current at least once, and within the last
    /// 5 s. A replica cut off from etcd turns false, and serves every service as last
    /// published.
    pub following: bool,
}

/// The verdict of `GET /healthz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    /// Balancing.
    Ok,
    /// Not balancing, or not storing what it balances.
    Failing,
}

/// One line per service in `GET /v1/services`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ServiceSummary {
    /// Service name.
    pub name: String,
    /// Known endpoints.
    pub endpoints: usize,
    /// Average load over fresh serving endpoints.
    pub avg: f64,
    /// Max over average.
    pub max_over_avg: f64,
    /// 95th percentile over average.
    pub p95_over_avg: f64,
    /// Share of endpoints missing.
    pub missing_share: f64,
    /// Cycles run.
    pub cycles: u64,
    /// Weight version.
    pub version: u64,
    /// Why the last cycle was skipped, if it was.
    pub last_skip: Option<String>,
    /// Endpoints whose in-flight count is set aside now, because it did not follow
    /// their weight.
    pub inflight_distrusted: usize,
    /// Times an endpoint's in-flight count was set aside.
    pub inflight_distrusts: u64,
    /// Endpoints steered by their CPU above a floor their weight did not move (other
    /// work on the host or in the cgroup).
    pub cpu_floors: usize,
    /// Times such a floor was found.
    pub cpu_floors_found: u64,
    /// Cycles that stepped weights straight to the capacity estimate.
    pub feed_forward_steps: u64,
    /// Endpoints silent for longer than `expire_ms` kept with their last weights,
    /// because too much of the service fell silent at once to believe it.
    pub expiry_held: usize,
}

impl From<ServiceSummary> for crate::metrics::ServiceRow {
    fn from(s: ServiceSummary) -> Self {
        crate::metrics::ServiceRow {
            name: s.name,
            endpoints: s.endpoints,
            avg: s.avg,
            max_over_avg: s.max_over_avg,
            p95_over_avg: s.p95_over_avg,
            missing_share: s.missing_share,
            inflight_distrusted: s.inflight_distrusted,
            inflight_distrusts: s.inflight_distrusts,
            cpu_floors: s.cpu_floors,
            cpu_floors_found: s.cpu_floors_found,
            feed_forward_steps: s.feed_forward_steps,
            expiry_held: s.expiry_held,
        }
    }
}

impl ServiceSummary {
    /// The summary of `svc`.
    pub fn of(svc: &PublishedService) -> Self {
        let s = &svc.stats;
        ServiceSummary {
            name: svc.name.clone(),
            endpoints: svc.endpoints.len(),
            avg: s.spread.avg,
            max_over_avg: s.spread.max_over_avg,
            p95_over_avg: s.spread.p95_over_avg,
            missing_share: s.missing_share,
            cycles: s.cycles,
            version: svc.version,
            last_skip: s.last_skip.map(|r| r.describe()),
            inflight_distrusted: s.inflight_distrusted,
            inflight_distrusts: s.inflight_distrusts,
            cpu_floors: s.cpu_floors,
            cpu_floors_found: s.cpu_floors_found,
            feed_forward_steps: s.feed_forward_steps,
            expiry_held: s.expiry_held,
        }
    }
}

/// `GET /v1/services/{name}`: cycle statistics.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ServiceDetail {
    /// Service name.
    pub name: String,
    /// Endpoints by state.
    pub states: BTreeMap<String, usize>,
    /// Counters and the last cycle's figures.
    pub stats: ServiceStats,
    /// The last skip, in words.
    pub last_skip_reason: Option<String>,
    /// The last skip, as data.
    pub last_skip: Option<SkipReason>,
    /// Weight version.
    pub version: u64,
    /// The cycle the published weights came from.
    pub weights_cycle: u64,
    /// The parameters in force.
    pub params: ballast_balance::Params,
    /// Recent cycles, oldest first.
    pub history: Vec<HistoryPoint>,
    /// What operators set on the service: drains, a hold, pins, each with who, why
    /// and since when.
    #[serde(default)]
    pub operator: ballast_balance::Actions,
}

impl ServiceDetail {
    /// The detail of `svc`.
    pub fn of(svc: &PublishedService) -> Self {
        ServiceDetail {
            name: svc.name.clone(),
            states: svc
                .states()
                .into_iter()
                .map(|(state, n)| (state_name(state).to_string(), n))
                .collect(),
            stats: svc.stats.clone(),
            last_skip_reason: svc.stats.last_skip.map(|r| r.describe()),
            last_skip: svc.stats.last_skip,
            version: svc.version,
            weights_cycle: svc.weights_cycle,
            params: svc.params.clone(),
            history: svc.history.clone(),
            operator: svc.operator.clone(),
        }
    }
}

fn state_name(s: EndpointState) -> &'static str {
    match s {
        EndpointState::Serving => "serving",
        EndpointState::Warming => "warming",
        EndpointState::Draining => "draining",
        EndpointState::Missing => "missing",
    }
}

/// One endpoint in `GET /v1/services/{name}/endpoints`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EndpointView {
    /// Node identity.
    pub node: String,
    /// `host:port`.
    pub address: String,
    /// Zone.
    pub zone: String,
    /// The load the balancer steers by.
    pub load: f64,
    /// Reported CPU utilization.
    pub cpu: f64,
    /// Reported in-flight requests.
    pub inflight: u32,
    /// Reported capacity; 0 means none configured (judged against the fleet).
    pub capacity: u32,
    /// What the last cycle made of the in-flight count: how it was derived, its
    /// smoothed value, its ratio to the service's typical count per unit of weight,
    /// whether it set the load, and whether it is trusted.
    pub inflight_estimate: ballast_balance::inflight::InflightEstimate,
    /// The part of its CPU that did not fall when its weight did (other work on its
    /// host or in its cgroup), as a share of the capacity; `null` when none was found.
    /// Its load is then its CPU above that floor, over what the floor leaves.
    pub cpu_floor: Option<f64>,
    /// Published weight, mean 1.0.
    pub weight: f64,
    /// State.
    pub state: EndpointState,
    /// Milliseconds since the last report; `null` if none since registration.
    pub report_age_ms: Option<u64>,
}

impl EndpointView {
    /// Every endpoint of `svc`, as of its last cycle.
    pub fn all(svc: &PublishedService) -> Vec<Self> {
        svc.endpoints
            .iter()
            .map(|(node, e)| EndpointView {
                node: node.to_string(),
                address: e.address.to_string(),
                zone: e.zone.to_string(),
                load: e.load,
                cpu: e.cpu,
                inflight: e.inflight,
                capacity: e.capacity,
                inflight_estimate: e.inflight_estimate,
                cpu_floor: e.cpu_floor,
                weight: e.weight,
                state: e.state,
                report_age_ms: e.report_age_ms,
            })
            .collect()
    }
}

pub use crate::feed::watch::{WeightEntry, WeightSet};

/// `GET /v1/config`: the per-service config directory as merged.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ConfigView {
    /// The directory; `None` when the aggregator runs without one.
    pub dir: Option<String>,
    /// When it was last scanned, in Unix milliseconds.
    pub last_scan_unix_ms: Option<u64>,
    /// Why the last scan failed, if it did.
    pub scan_error: Option<String>,
    /// How long a tombstone lasts, in seconds.
    pub tombstone_ttl_s: Option<u64>,
    /// Every configured service, tombstones included.
    pub services: Vec<ServiceConfigView>,
    /// Files refused now; their services keep their last good version.
    pub errors: Vec<crate::config::service::FileError>,
}

/// One service's config in force.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ServiceConfigView {
    /// The service.
    pub name: String,
    /// `active`, or `tombstone` once its file is deleted.
    pub status: String,
    /// Its file.
    pub file: String,
    /// When the version in force was loaded, in Unix milliseconds.
    pub loaded_unix_ms: u64,
    /// When the file was found deleted.
    pub deleted_unix_ms: Option<u64>,
    /// When the tombstone expires and the service falls back to the defaults.
    pub expires_unix_ms: Option<u64>,
    /// Whether the file on disk is refused now (the version in force is older).
    pub file_refused: bool,
    /// The parameters in force.
    pub params: ballast_balance::Params,
    /// The locality split in force: client zone → destination zone → relative share.
    #[schema(value_type = BTreeMap<String, BTreeMap<String, u32>>)]
    pub locality: crate::config::locality::LocalitySplit,
}

impl ConfigView {
    /// The view of the config directory's status, or of its absence.
    pub fn of(status: Option<&crate::config::dir::ConfigDirStatus>) -> Self {
        let Some(s) = status else {
            return ConfigView {
                dir: None,
                last_scan_unix_ms: None,
                scan_error: None,
                tombstone_ttl_s: None,
                services: Vec::new(),
                errors: Vec::new(),
            };
        };
        let ttl = s.configs.tombstone_ttl_ms();
        let errors = s.configs.errors();
        ConfigView {
            dir: Some(s.dir.display().to_string()),
            last_scan_unix_ms: Some(s.last_scan_unix_ms),
            scan_error: s.scan_error.clone(),
            tombstone_ttl_s: Some(ttl / 1000),
            services: s
                .configs
                .merged()
                .services
                .iter()
                .map(|(name, e)| {
                    let file = crate::config::dir::file_name(name);
                    ServiceConfigView {
                        name: name.clone(),
                        status: if e.deleted_unix_ms.is_some() {
                            "tombstone"
                        } else {
                            "active"
                        }
                        .to_string(),
                        file_refused: errors.contains_key(&file),
                        file,
                        loaded_unix_ms: e.loaded_unix_ms,
                        deleted_unix_ms: e.deleted_unix_ms,
                        expires_unix_ms: e.deleted_unix_ms.map(|d| d.saturating_add(ttl)),
                        params: e.config.params.clone(),
                        locality: e.config.locality.clone(),
                    }
                })
                .collect(),
            errors: errors.values().cloned().collect(),
        }
    }
}
