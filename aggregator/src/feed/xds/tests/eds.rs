//! Endpoint assignments (EDS) as the resource builders make them: zones as localities,
//! weights on Envoy's scale, draining endpoints, addresses.

use super::*;
use crate::feed::xds::resources::{load_assignment, parse_address};
use envoy_types::pb::envoy::config::core::v3::HealthStatus;

#[test]
fn zones_become_localities_and_weights_follow_the_envoy_scale() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "10.0.0.1:80", "a", 0.5, false),
            ep("n2", "10.0.0.2:80", "b", 2.0, false),
            ep("n3", "10.0.0.3:81", "a", 1.0, false),
            ep("n4", "10.0.0.4:80", "", 1.0, false),
        ],
    );
    assert_eq!(cla.cluster_name, "web");
    let zones: Vec<&str> = cla
        .endpoints
        .iter()
        .map(|l| l.locality.as_ref().map_or("?", |l| l.zone.as_str()))
        .collect();
    assert_eq!(zones, ["", "a", "b"], "one locality per zone");
    for loc in &cla.endpoints {
        assert_eq!(loc.load_balancing_weight.map(|w| w.value), Some(1));
        assert_eq!(loc.priority, 0);
    }
    let healthy = HealthStatus::Healthy as i32;
    assert_eq!(
        flatten(&cla),
        vec![
            ("".into(), "10.0.0.4".into(), 80, 1000, healthy),
            ("a".into(), "10.0.0.1".into(), 80, 500, healthy),
            ("a".into(), "10.0.0.3".into(), 81, 1000, healthy),
            ("b".into(), "10.0.0.2".into(), 80, 2000, healthy),
        ]
    );
}

#[test]
fn draining_endpoints_are_draining_with_the_minimum_weight() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "10.0.0.1:80", "a", 0.0, true),
            ep("n2", "10.0.0.2:80", "a", 1.0, false),
        ],
    );
    let eps = flatten(&cla);
    // xDS forbids weight 0: the health status carries the drain.
    assert_eq!(eps[0].3, 1);
    assert_eq!(eps[0].4, HealthStatus::Draining as i32);
    assert_eq!(eps[1].4, HealthStatus::Healthy as i32);
}

#[test]
fn endpoints_without_an_ip_address_are_left_out() {
    let cla = load_assignment(
        "web",
        &[
            ep("n1", "db.example:80", "", 1.0, false),
            ep("n2", "10.0.0.2", "", 1.0, false),
            ep("n3", "[::1]:8080", "", 1.0, false),
            ep("n4", "10.0.0.4:99999", "", 1.0, false),
        ],
    );
    let eps = flatten(&cla);
    assert_eq!(eps.len(), 1, "{eps:?}");
    assert_eq!((eps[0].1.as_str(), eps[0].2), ("::1", 8080));
}

#[test]
fn addresses_parse_as_ip_and_port() {
    assert_eq!(
        parse_address("127.0.0.1:50051"),
        Some(("127.0.0.1".parse().expect("ip"), 50051))
    );
    assert_eq!(
        parse_address("[fe80::1]:1"),
        Some(("fe80::1".parse().expect("ip"), 1))
    );
    for bad in [
        "",
        ":",
        "host:80",
        "1.2.3.4",
        "1.2.3.4:x",
        "1.2.3.4:65536",
        "[::1:80",
    ] {
        assert_eq!(parse_address(bad), None, "{bad:?}");
    }
}
