//! The xDS resources of each service, and the snapshot every stream serves from.
//!
//! Builders are pure functions of a service's name, the load-balancing policy and its
//! endpoints. A [`Snapshot`] holds every service's four resources already packed as
//! `Any`, with a digest of each, so that a thousand streams share one encoding and a
//! response's version is a function of its contents: the same resources always carry
//! the same version, which is what lets a stream tell that nothing changed.
//!
//! # Locality splits
//!
//! A service's ClusterLoadAssignment comes in several versions: the default, which
//! every client gets (one locality per zone, all of weight 1), and one per client zone
//! that the service's locality config splits (`split_of`). A stream picks
//! by its client's `node.locality.zone` ([`Snapshot::select`]). In a split
//! assignment each destination zone's locality weight is its share, and the zone's
//! endpoint weights are the balancer's rescaled to a common total, because gRPC's
//! RING_HASH weighs each endpoint by locality weight × endpoint weight (gRFC A42):
//! only then is a zone's share of the calls its configured share whatever the number
//! of endpoints in it. Locality-first pickers (gRPC's `weighted_target` under
//! ROUND_ROBIN, gRFC A27) give the same shares.
//!
//! Envoy picks a locality by its weight only when the Cluster enables
//! `locality_weighted_lb_config`, and then it does so for every assignment of that
//! cluster. The default assignment's equal locality weights must not be read that
//! way (every zone would get the same share, whatever its endpoints), so the Cluster
//! comes in two versions as well: clients whose zone has a split assignment get the
//! Cluster with locality-weighted load balancing, every other client the plain one
//! ([`ServiceResources::for_zone`]). gRPC ignores the setting.

use super::LbPolicy;
use crate::config::locality::LocalitySplit;
use ballast_balance::publish::{fnv1a as fnv, FNV_OFFSET};
use ballast_balance::{Published, PublishedService};
use cluster::common_lb_config::{LocalityConfigSpecifier, LocalityWeightedLbConfig};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, HealthStatus, Locality, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_action, route_match, Route, RouteAction, RouteConfiguration, RouteMatch,
    VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value, UInt64Value};
use prost::{Message, Name};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

/// The four resource types served, in the order a proxyless gRPC client walks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceType {
    /// LDS: `envoy.config.listener.v3.Listener`.
    Listener,
    /// RDS: `envoy.config.route.v3.RouteConfiguration`.
    Route,
    /// CDS: `envoy.config.cluster.v3.Cluster`.
    Cluster,
    /// EDS: `envoy.config.endpoint.v3.ClusterLoadAssignment`.
    Endpoints,
}

impl ResourceType {
    /// Every type.
    pub const ALL: [ResourceType; 4] = [
        ResourceType::Listener,
        ResourceType::Route,
        ResourceType::Cluster,
        ResourceType::Endpoints,
    ];

    /// The type URL of requests and responses (a test checks them against the
    /// messages' own names).
    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            ResourceType::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            ResourceType::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            ResourceType::Endpoints => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
        }
    }

    /// The type of a type URL; `None` for types this server does not serve.
    pub(crate) fn from_type_url(url: &str) -> Option<ResourceType> {
        Self::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// A short name for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            ResourceType::Listener => "listener",
            ResourceType::Route => "route",
            ResourceType::Cluster => "cluster",
            ResourceType::Endpoints => "endpoints",
        }
    }

    /// Whether an empty subscription means "everything" (LDS and CDS), as the xDS
    /// protocol defines for the legacy wildcard.
    pub(crate) fn allows_wildcard(self) -> bool {
        matches!(self, ResourceType::Listener | ResourceType::Cluster)
    }
}

/// What the builders need of one endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointInput {
    /// The node's identity (for logs).
    pub node: String,
    /// `host:port`; the host must be an IP literal, as EDS requires.
    pub address: String,
    /// Its zone; empty when unknown.
    pub zone: String,
    /// The published weight (mean 1.0).
    pub weight: f64,
    /// Lame duck.
    pub draining: bool,
}

impl EndpointInput {
    fn of(node: &str, ep: &ballast_balance::PublishedEndpoint) -> Self {
        EndpointInput {
            node: node.to_string(),
            address: ep.address.to_string(),
            zone: ep.zone.to_string(),
            weight: ep.weight,
            draining: ep.draining,
        }
    }
}

fn ads_source() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn pack<T: Message + Name>(msg: &T) -> Any {
    Any {
        type_url: T::type_url(),
        value: msg.encode_to_vec(),
    }
}

/// Listener `service`: an API listener whose HttpConnectionManager fetches the
/// RouteConfiguration of the same name over ADS. The router filter is the only HTTP
/// filter, and gRPC requires the last one to be a router.
pub fn listener(service: &str) -> Listener {
    let hcm = HttpConnectionManager {
        stat_prefix: service.to_string(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads_source()),
            route_config_name: service.to_string(),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack(
                &Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    Listener {
        name: service.to_string(),
        api_listener: Some(ApiListener {
            api_listener: Some(pack(&hcm)),
        }),
        ..Default::default()
    }
}

/// RouteConfiguration `service`: every authority and every path go to cluster
/// `service`. No hash policy: under RING_HASH, gRPC then hashes each RPC at random.
pub(crate) fn route_configuration(service: &str) -> RouteConfiguration {
    RouteConfiguration {
        name: service.to_string(),
        virtual_hosts: vec![VirtualHost {
            name: service.to_string(),
            domains: vec!["*".to_string()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix(String::new())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                        service.to_string(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The ring size asked of RING_HASH clients. gRPC caps rings at 4096 entries by
/// default; the more entries, the closer each endpoint's share of the hash space is
/// to its weight (the error falls as one over the square root of its entries).
pub(crate) const RING_SIZE: u64 = 4096;

/// Cluster `service`: EDS over ADS, with `policy`; with `locality_weighted`, Envoy's
/// locality-weighted load balancing (`common_lb_config.locality_weighted_lb_config`):
/// Envoy then picks a locality by its `load_balancing_weight` first, and an endpoint
/// inside it by the policy and the endpoint weights. That is what a split assignment
/// needs, and what the default one (all locality weights 1) must not get. gRPC
/// ignores `common_lb_config`.
pub fn cluster(service: &str, policy: LbPolicy, locality_weighted: bool) -> Cluster {
    let (lb_policy, lb_config) = match policy {
        LbPolicy::RingHash => (
            cluster::LbPolicy::RingHash,
            Some(cluster::LbConfig::RingHashLbConfig(
                cluster::RingHashLbConfig {
                    minimum_ring_size: Some(UInt64Value { value: RING_SIZE }),
                    maximum_ring_size: Some(UInt64Value { value: RING_SIZE }),
                    ..Default::default()
                },
            )),
        ),
        LbPolicy::RoundRobin => (cluster::LbPolicy::RoundRobin, None),
        LbPolicy::LeastRequest => (cluster::LbPolicy::LeastRequest, None),
    };
    Cluster {
        name: service.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads_source()),
            service_name: service.to_string(),
        }),
        lb_policy: lb_policy as i32,
        lb_config,
        common_lb_config: locality_weighted.then(|| cluster::CommonLbConfig {
            locality_config_specifier: Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(
                LocalityWeightedLbConfig {},
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Splits `host:port` (or `[v6]:port`) into an IP literal and a port. EDS carries
/// socket addresses, not names: gRPC rejects a whole assignment with a host name in it.
pub(crate) fn parse_address(address: &str) -> Option<(IpAddr, u16)> {
    let (host, port) = address.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Some((host.parse().ok()?, port.parse().ok()?))
}

/// An endpoint whose address is an `IP:port`, as EDS needs it.
struct Addressed<'a> {
    ep: &'a EndpointInput,
    ip: IpAddr,
    port: u16,
}

/// The endpoints that can go into an assignment. Those whose address is not
/// `IP:port` are left out, with a warning: one bad address must not make clients
/// reject the rest.
fn addressable<'a>(service: &str, endpoints: &'a [EndpointInput]) -> Vec<Addressed<'a>> {
    endpoints
        .iter()
        .filter_map(|ep| match parse_address(&ep.address) {
            Some((ip, port)) => Some(Addressed { ep, ip, port }),
            None => {
                tracing::warn!(service, node = %ep.node, address = %ep.address,
                    "endpoint left out of xDS: its address is not IP:port");
                None
            }
        })
        .collect()
}

/// One `LbEndpoint`. A draining endpoint is DRAINING with weight 1, because xDS
/// forbids weight 0.
fn lb_endpoint(a: &Addressed<'_>, weight: u32) -> LbEndpoint {
    let (health, weight) = if a.ep.draining {
        (HealthStatus::Draining, 1)
    } else {
        (HealthStatus::Healthy, weight.max(1))
    };
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(Address {
                address: Some(address::Address::SocketAddress(SocketAddress {
                    address: a.ip.to_string(),
                    port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                        a.port,
                    ))),
                    ..Default::default()
                })),
            }),
            ..Default::default()
        })),
        health_status: health as i32,
        load_balancing_weight: Some(UInt32Value { value: weight }),
        ..Default::default()
    }
}

/// One locality. gRPC drops localities without a weight, so one is always set.
fn locality(zone: &str, weight: u32, lb_endpoints: Vec<LbEndpoint>) -> LocalityLbEndpoints {
    LocalityLbEndpoints {
        locality: Some(Locality {
            zone: zone.to_string(),
            ..Default::default()
        }),
        lb_endpoints,
        load_balancing_weight: Some(UInt32Value { value: weight }),
        ..Default::default()
    }
}

/// ClusterLoadAssignment `service` as every client gets it unless its zone has a
/// split: one locality per zone, all of weight 1; endpoints weighted by
/// [`ballast_balance::load::envoy_weight`], draining ones DRAINING. Endpoints whose
/// address is not `IP:port` are left out, with a warning.
#[cfg(test)]
pub(crate) fn load_assignment(service: &str, endpoints: &[EndpointInput]) -> ClusterLoadAssignment {
    default_assignment(service, &addressable(service, endpoints))
}

fn default_assignment(service: &str, eps: &[Addressed<'_>]) -> ClusterLoadAssignment {
    let mut zones: BTreeMap<&str, Vec<LbEndpoint>> = BTreeMap::new();
    for a in eps {
        let weight = ballast_balance::load::envoy_weight(a.ep.weight);
        zones
            .entry(a.ep.zone.as_str())
            .or_default()
            .push(lb_endpoint(a, weight));
    }
    ClusterLoadAssignment {
        cluster_name: service.to_string(),
        // Equal locality weights: under RING_HASH the product with the endpoint
        // weights is then the endpoint weights alone, so calls follow the balancer
        // across the whole fleet.
        endpoints: zones
            .into_iter()
            .map(|(zone, lbs)| locality(zone, 1, lbs))
            .collect(),
        ..Default::default()
    }
}

/// What the serving endpoints' weights of one locality add up to in a split
/// assignment. gRPC's RING_HASH sizes each endpoint's part of the ring by locality
/// weight × endpoint weight (gRFC A42), so a locality's share of the calls is its
/// weight times the sum of its endpoint weights: with the same sum in every
/// locality, the shares are the locality weights, whatever the number of endpoints
/// in each zone. 100,000 keeps a per-mille resolution up to 100 endpoints a zone.
pub(crate) const ZONE_WEIGHT_TOTAL: u32 = 100_000;

/// The largest sum of locality weights in a split assignment. gRPC multiplies
/// locality and endpoint weights in 32 bits; with at most 10,000 × 100,000 = 10⁹
/// the products, and their sum, stay below 2³¹.
pub(crate) const LOCALITY_WEIGHT_TOTAL: u32 = 10_000;

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The locality weights of `shares`: reduced by their greatest common divisor (the
/// seed's `50/50` becomes `1/1`), and scaled down to [`LOCALITY_WEIGHT_TOTAL`] only
/// if they still add up to more, keeping every share at least 1.
pub(crate) fn locality_weights(shares: &BTreeMap<&str, u32>) -> BTreeMap<String, u32> {
    let divisor = shares.values().fold(0, |g, s| gcd(g, *s)).max(1);
    let reduced: BTreeMap<&str, u32> = shares.iter().map(|(z, s)| (*z, s / divisor)).collect();
    let sum: u64 = reduced.values().map(|s| u64::from(*s)).sum();
    reduced
        .into_iter()
        .map(|(zone, s)| {
            let w = if sum > u64::from(LOCALITY_WEIGHT_TOTAL) {
                let scaled = u64::from(s) * u64::from(LOCALITY_WEIGHT_TOTAL) / sum;
                u32::try_from(scaled)
                    .unwrap_or(LOCALITY_WEIGHT_TOTAL)
                    .max(1)
            } else {
                s
            };
            (zone.to_string(), w)
        })
        .collect()
}

/// ClusterLoadAssignment `service` for clients whose zone splits its calls by
/// `shares` (destination zone → relative share): one locality per destination zone
/// with a share above 0 and at least one serving (not draining) endpoint, weighted
/// by [`locality_weights`]; inside each, the endpoints' balancer weights rescaled to
/// add up to [`ZONE_WEIGHT_TOTAL`], so both locality-first pickers (gRPC's
/// `weighted_target`, Envoy's locality-weighted LB) and RING_HASH's product give each
/// zone its share. Zones outside the split, or at share 0, are left out: their
/// endpoints get none of these clients' calls.
///
/// `None` when no zone of the split has a serving endpoint: the caller then serves
/// the default assignment, so that clients never get an empty one.
#[cfg(test)]
pub(crate) fn split_assignment(
    service: &str,
    endpoints: &[EndpointInput],
    shares: &BTreeMap<String, u32>,
) -> Option<ClusterLoadAssignment> {
    split_of(service, &addressable(service, endpoints), shares)
}

fn split_of(
    service: &str,
    eps: &[Addressed<'_>],
    shares: &BTreeMap<String, u32>,
) -> Option<ClusterLoadAssignment> {
    let served: BTreeMap<&str, u32> = shares
        .iter()
        .filter(|(zone, share)| {
            **share > 0 && eps.iter().any(|a| a.ep.zone == **zone && !a.ep.draining)
        })
        .map(|(zone, share)| (zone.as_str(), *share))
        .collect();
    if served.is_empty() {
        return None;
    }
    let weights = locality_weights(&served);
    let endpoints = weights
        .iter()
        .map(|(zone, lw)| {
            let members: Vec<&Addressed<'_>> = eps.iter().filter(|a| a.ep.zone == *zone).collect();
            let serving: Vec<f64> = members
                .iter()
                .filter(|a| !a.ep.draining)
                .map(|a| a.ep.weight.max(0.0))
                .collect();
            let total: f64 = serving.iter().sum();
            let count = serving.len() as f64;
            let lbs = members
                .iter()
                .map(|a| {
                    // A zone whose weights are all 0 (not something the balancer
                    // publishes) spreads evenly rather than divide by zero.
                    let part = if total > 0.0 {
                        a.ep.weight.max(0.0) / total
                    } else {
                        1.0 / count
                    };
                    // `as` saturates; the part is within [0, 1].
                    let w = (part * f64::from(ZONE_WEIGHT_TOTAL)).round() as u32;
                    lb_endpoint(a, w)
                })
                .collect();
            locality(zone, *lw, lbs)
        })
        .collect();
    Some(ClusterLoadAssignment {
        cluster_name: service.to_string(),
        endpoints,
        ..Default::default()
    })
}

/// One packed resource and the digest of its name and bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    /// The resource, packed.
    pub any: Any,
    digest: u64,
}

impl Resource {
    fn new<T: Message + Name>(name: &str, msg: &T) -> Self {
        let any = pack(msg);
        let digest = fnv(fnv(FNV_OFFSET, name.as_bytes()), &any.value);
        Resource { any, digest }
    }
}

/// One service's four resources, and its ClusterLoadAssignment for each client zone
/// that has a split.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceResources {
    /// The weights version they were built from.
    pub version: u64,
    /// Digest of what, besides the version, the assignment was built from (addresses,
    /// zones, drains), so a re-registration at a new address is noticed.
    key: u64,
    /// The locality split they were built from, so a config reload is noticed.
    split: Option<LocalitySplit>,
    resources: [Resource; 4],
    /// Client zone → its ClusterLoadAssignment. A configured zone none of whose
    /// destinations has a serving endpoint has no entry: it gets the default.
    zonal: BTreeMap<String, Resource>,
    /// The Cluster with locality-weighted load balancing, which the zones in `zonal`
    /// get; `None` when `zonal` is empty.
    weighted_cluster: Option<Resource>,
    /// The configured client zones that have no entry in `zonal`.
    fallen_back: BTreeSet<String>,
}

impl ServiceResources {
    /// Builds all four resources of `service`, and a ClusterLoadAssignment per client
    /// zone of `split`.
    pub fn build(
        service: &str,
        version: u64,
        policy: LbPolicy,
        endpoints: &[EndpointInput],
        split: Option<&LocalitySplit>,
    ) -> Self {
        let key = ballast_balance::publish::change_digest(
            version,
            endpoints.iter().map(|e| {
                (
                    ballast_balance::publish::names_digest(&e.node, &e.address, &e.zone),
                    e.draining,
                )
            }),
        );
        let eps = addressable(service, endpoints);
        let mut zonal = BTreeMap::new();
        let mut fallen_back = BTreeSet::new();
        for (client, shares) in split.into_iter().flatten() {
            match split_of(service, &eps, shares) {
                Some(cla) => {
                    zonal.insert(client.clone(), Resource::new(service, &cla));
                }
                None => {
                    fallen_back.insert(client.clone());
                }
            }
        }
        let weighted_cluster =
            (!zonal.is_empty()).then(|| Resource::new(service, &cluster(service, policy, true)));
        ServiceResources {
            version,
            key,
            split: split.cloned(),
            resources: [
                Resource::new(service, &listener(service)),
                Resource::new(service, &route_configuration(service)),
                Resource::new(service, &cluster(service, policy, false)),
                Resource::new(service, &default_assignment(service, &eps)),
            ],
            zonal,
            weighted_cluster,
            fallen_back,
        }
    }

    /// The client zones of the split that get the default assignment because none of
    /// their destination zones has a serving endpoint.
    #[cfg(test)]
    pub(crate) fn fallen_back(&self) -> impl Iterator<Item = &str> {
        self.fallen_back.iter().map(String::as_str)
    }

    /// The resource of type `t` as every client gets it (the default assignment for
    /// EDS, the Cluster without locality-weighted load balancing for CDS).
    pub fn get(&self, t: ResourceType) -> &Resource {
        &self.resources[t as usize]
    }

    /// The resource of type `t` for a client in `client_zone`. If its zone has an
    /// assignment of its own: that assignment for EDS, and the Cluster with
    /// locality-weighted load balancing for CDS (Envoy then honours the assignment's
    /// locality weights). Otherwise, and for the other types, what every client gets.
    pub(crate) fn for_zone(&self, t: ResourceType, client_zone: &str) -> &Resource {
        let own = || match t {
            ResourceType::Endpoints => self.zonal.get(client_zone),
            ResourceType::Cluster => self
                .weighted_cluster
                .as_ref()
                .filter(|_| self.zonal.contains_key(client_zone)),
            _ => None,
        };
        own().unwrap_or(self.get(t))
    }

    /// The client zones that have an assignment of their own.
    pub fn zones(&self) -> impl Iterator<Item = &str> {
        self.zonal.keys().map(String::as_str)
    }
}

/// What a response of one type carries for one stream's subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The response's `version_info`: a digest of the resources it carries.
    pub version: String,
    /// The resources, by name.
    pub resources: Vec<Any>,
}

/// Every service's resources at one moment. Immutable; shared by all streams.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    services: BTreeMap<String, Arc<ServiceResources>>,
}

impl Snapshot {
    /// A snapshot of a publication's services, each under its locality split. A
    /// service whose weights version, addresses, zones, drains and split are those of
    /// `previous` keeps its resources from there: weights drift a little every cycle,
    /// and only a material change (a new version) is worth a push. Only changed
    /// services are copied out; [`Pending::finish`] builds their resources.
    pub fn prepare(published: &Published, previous: &Snapshot) -> Pending {
        let mut kept = BTreeMap::new();
        let mut changed = Vec::new();
        for (name, svc) in &published.services {
            let split = Some(&svc.locality).filter(|l| !l.is_empty());
            match previous.services.get(name) {
                Some(r) if r.key == svc.digest && r.split.as_ref() == split => {
                    kept.insert(name.clone(), r.clone());
                }
                before => changed.push(Self::copy(svc, split, before.cloned())),
            }
        }
        Pending { kept, changed }
    }

    fn copy(
        svc: &PublishedService,
        split: Option<&LocalitySplit>,
        before: Option<Arc<ServiceResources>>,
    ) -> Changed {
        Changed {
            name: svc.name.clone(),
            version: svc.version,
            endpoints: svc
                .endpoints
                .iter()
                .map(|(node, e)| EndpointInput::of(node, e))
                .collect(),
            split: split.cloned(),
            before,
        }
    }

    /// A snapshot of the given services, by name.
    #[cfg(test)]
    pub(crate) fn from_services(
        services: impl IntoIterator<Item = (String, ServiceResources)>,
    ) -> Self {
        Snapshot {
            services: services
                .into_iter()
                .map(|(n, r)| (n, Arc::new(r)))
                .collect(),
        }
    }

    /// Whether both hold the same services with the same resources, by digest.
    pub(crate) fn same_as(&self, other: &Snapshot) -> bool {
        self.services.len() == other.services.len()
            && self
                .services
                .iter()
                .zip(&other.services)
                .all(|((a, ra), (b, rb))| {
                    a == b
                        && ra
                            .resources
                            .iter()
                            .zip(&rb.resources)
                            .all(|(x, y)| x.digest == y.digest)
                        && ra.weighted_cluster.as_ref().map(|r| r.digest)
                            == rb.weighted_cluster.as_ref().map(|r| r.digest)
                        && ra.zonal.len() == rb.zonal.len()
                        && ra
                            .zonal
                            .iter()
                            .zip(&rb.zonal)
                            .all(|((za, x), (zb, y))| za == zb && x.digest == y.digest)
                })
    }

    /// The services' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.services.keys().map(String::as_str)
    }

    /// One service's resources.
    pub fn service(&self, name: &str) -> Option<&ServiceResources> {
        self.services.get(name).map(Arc::as_ref)
    }

    /// The resources of type `t` for a subscription of a client in `client_zone`:
    /// every service for a wildcard, else those of the names asked that exist; for
    /// EDS, each service's assignment for that zone. Names that do not exist are left
    /// out: for LDS and CDS that tells the client they do not exist, for RDS and EDS
    /// its does-not-exist timer does. The version is a digest of what is selected, so
    /// a client whose zone's split changed sees a new version, and one whose did not
    /// does not.
    pub fn select(
        &self,
        t: ResourceType,
        wildcard: bool,
        names: &BTreeSet<String>,
        client_zone: &str,
    ) -> Selection {
        let chosen = self.chosen(t, wildcard, names, client_zone);
        Selection {
            version: digest(&chosen),
            resources: chosen.iter().map(|r| r.any.clone()).collect(),
        }
    }

    /// The version [`Snapshot::select`] would give, without copying the resources:
    /// what a stream compares with what it last sent before it builds a response.
    pub fn version(
        &self,
        t: ResourceType,
        wildcard: bool,
        names: &BTreeSet<String>,
        client_zone: &str,
    ) -> String {
        digest(&self.chosen(t, wildcard, names, client_zone))
    }

    fn chosen(
        &self,
        t: ResourceType,
        wildcard: bool,
        names: &BTreeSet<String>,
        client_zone: &str,
    ) -> Vec<&Resource> {
        // Both ways give the services in name order. The shorter is walked, so that a
        // stream's version costs at most one look-up per service the snapshot has,
        // however many names the client asked for: a subscription to thousands of
        // names that do not exist costs what the existing services do.
        let services: Vec<&ServiceResources> = if wildcard {
            self.services.values().map(Arc::as_ref).collect()
        } else if names.len() <= self.services.len() {
            names.iter().filter_map(|n| self.service(n)).collect()
        } else {
            self.services
                .iter()
                .filter(|(n, _)| names.contains(*n))
                .map(|(_, s)| s.as_ref())
                .collect()
        };
        services
            .into_iter()
            .map(|s| s.for_zone(t, client_zone))
            .collect()
    }
}

/// The `version_info` of a response carrying `chosen`: 16 hex digits of a digest of
/// their digests, in order.
fn digest(chosen: &[&Resource]) -> String {
    let h = chosen
        .iter()
        .fold(FNV_OFFSET, |h, r| fnv(h, &r.digest.to_le_bytes()));
    format!("{h:016x}")
}

/// A changed service, copied out of the publication.
#[derive(Debug)]
struct Changed {
    name: String,
    version: u64,
    endpoints: Vec<EndpointInput>,
    split: Option<LocalitySplit>,
    /// Its resources in the previous snapshot, to log fallbacks once, when they begin
    /// and end, rather than at every rebuild.
    before: Option<Arc<ServiceResources>>,
}

/// A snapshot half built: what could be kept, and copies of what changed.
#[derive(Debug)]
pub struct Pending {
    kept: BTreeMap<String, Arc<ServiceResources>>,
    changed: Vec<Changed>,
}

impl Pending {
    /// The services that changed, whose resources [`Pending::finish`] builds.
    #[cfg(test)]
    pub(crate) fn changed(&self) -> Vec<&str> {
        self.changed.iter().map(|c| c.name.as_str()).collect()
    }

    /// Builds the changed services' resources.
    pub fn finish(self, policy: LbPolicy) -> Snapshot {
        let mut services = self.kept;
        for c in self.changed {
            let r =
                ServiceResources::build(&c.name, c.version, policy, &c.endpoints, c.split.as_ref());
            let was = c.before.as_ref().map(|b| &b.fallen_back);
            for zone in r
                .fallen_back
                .iter()
                .filter(|z| !was.is_some_and(|w| w.contains(*z)))
            {
                let destinations: Vec<&String> = c
                    .split
                    .as_ref()
                    .and_then(|s| s.get(zone))
                    .map(|d| d.keys().collect())
                    .unwrap_or_default();
                tracing::warn!(service = %c.name, client_zone = %zone, ?destinations,
                    "no destination zone of the locality split has a serving endpoint; \
                     its clients get the default assignment (every zone)");
            }
            for zone in was
                .into_iter()
                .flatten()
                .filter(|z| r.zonal.contains_key(*z))
            {
                tracing::info!(service = %c.name, client_zone = %zone,
                    "the locality split has serving endpoints again; its clients follow it");
            }
            services.insert(c.name, Arc::new(r));
        }
        Snapshot { services }
    }
}
