//! Listeners (LDS), routes (RDS) and clusters (CDS) as the resource builders make them,
//! the configured policy, and the resource types' URLs.

use crate::feed::xds::resources::{
    cluster, listener, route_configuration, ResourceType, RING_SIZE,
};
use crate::feed::xds::LbPolicy;
use envoy_types::pb::envoy::config::cluster::v3::cluster;
use envoy_types::pb::envoy::config::core::v3::config_source;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::{route, route_action, route_match};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager,
};
use prost::{Message, Name};

#[test]
fn the_listener_fetches_its_route_over_ads_and_ends_with_the_router() {
    let l = listener("web");
    assert_eq!(l.name, "web");
    let any = l
        .api_listener
        .and_then(|a| a.api_listener)
        .expect("an api_listener");
    assert_eq!(any.type_url, HttpConnectionManager::type_url());
    let hcm = HttpConnectionManager::decode(any.value.as_slice()).expect("decodes");
    let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = hcm.route_specifier else {
        panic!("no RDS: {hcm:?}");
    };
    assert_eq!(rds.route_config_name, "web");
    let src = rds.config_source.expect("config source");
    assert!(matches!(
        src.config_source_specifier,
        Some(config_source::ConfigSourceSpecifier::Ads(_))
    ));
    let last = hcm.http_filters.last().expect("an HTTP filter");
    let Some(http_filter::ConfigType::TypedConfig(cfg)) = &last.config_type else {
        panic!("router without typed config");
    };
    assert_eq!(cfg.type_url, Router::type_url());
}

#[test]
fn the_route_sends_every_call_to_the_cluster_without_a_hash_policy() {
    let rc = route_configuration("web");
    assert_eq!(rc.name, "web");
    assert_eq!(rc.virtual_hosts.len(), 1);
    let vh = &rc.virtual_hosts[0];
    assert_eq!(vh.domains, ["*"]);
    assert_eq!(vh.routes.len(), 1);
    let r = &vh.routes[0];
    assert_eq!(
        r.r#match.as_ref().and_then(|m| m.path_specifier.clone()),
        Some(route_match::PathSpecifier::Prefix(String::new()))
    );
    let Some(route::Action::Route(action)) = &r.action else {
        panic!("not a route action");
    };
    assert_eq!(
        action.cluster_specifier,
        Some(route_action::ClusterSpecifier::Cluster("web".into()))
    );
    // A hash policy would pin calls to endpoints; none gives each call a random hash.
    assert!(action.hash_policy.is_empty());
}

#[test]
fn clusters_use_eds_over_ads_with_the_configured_policy() {
    let c = cluster("web", LbPolicy::RingHash, false);
    assert_eq!(c.name, "web");
    // Without a split, Envoy must not pick localities by their (equal) weights.
    assert!(c.common_lb_config.is_none());
    assert_eq!(
        c.cluster_discovery_type,
        Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32
        ))
    );
    let eds = c.eds_cluster_config.expect("EDS config");
    assert_eq!(eds.service_name, "web");
    assert!(matches!(
        eds.eds_config.and_then(|s| s.config_source_specifier),
        Some(config_source::ConfigSourceSpecifier::Ads(_))
    ));
    assert_eq!(c.lb_policy, cluster::LbPolicy::RingHash as i32);
    let Some(cluster::LbConfig::RingHashLbConfig(rh)) = c.lb_config else {
        panic!("no ring hash config");
    };
    assert_eq!(rh.minimum_ring_size.map(|v| v.value), Some(RING_SIZE));
    let rr = cluster("web", LbPolicy::RoundRobin, false);
    assert_eq!(rr.lb_policy, cluster::LbPolicy::RoundRobin as i32);
    assert!(rr.lb_config.is_none());
    let lr = cluster("web", LbPolicy::LeastRequest, false);
    assert_eq!(lr.lb_policy, cluster::LbPolicy::LeastRequest as i32);
}

#[test]
fn lb_policy_reads_from_the_config_file() {
    let cfg = crate::config::Config::parse(
        "xds = \"127.0.0.1:7402\"\nxds_lb_policy = \"least_request\"\n",
        "t",
    )
    .expect("parses");
    assert_eq!(cfg.xds, Some("127.0.0.1:7402".parse().expect("addr")));
    assert_eq!(cfg.xds_lb_policy, LbPolicy::LeastRequest);
    let cfg = crate::config::Config::parse("", "t").expect("parses");
    assert_eq!((cfg.xds, cfg.xds_lb_policy), (None, LbPolicy::RingHash));
    assert!(crate::config::Config::parse("xds_lb_policy = \"maglev\"\n", "t").is_err());
}

#[test]
fn type_urls_round_trip() {
    for t in ResourceType::ALL {
        assert_eq!(ResourceType::from_type_url(t.type_url()), Some(t));
    }
    assert_eq!(ResourceType::Listener.type_url(), Listener::type_url());
    assert_eq!(
        ResourceType::Route.type_url(),
        envoy_types::pb::envoy::config::route::v3::RouteConfiguration::type_url()
    );
    assert_eq!(
        ResourceType::Cluster.type_url(),
        envoy_types::pb::envoy::config::cluster::v3::Cluster::type_url()
    );
    assert_eq!(
        ResourceType::Endpoints.type_url(),
        ClusterLoadAssignment::type_url()
    );
    assert_eq!(
        ResourceType::from_type_url("type.googleapis.com/envoy.config.listener.v3.Listener"),
        Some(ResourceType::Listener)
    );
    assert_eq!(ResourceType::from_type_url("type.googleapis.com/x.Y"), None);
    assert_eq!(ResourceType::from_type_url(""), None);
}
