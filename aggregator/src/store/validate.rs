//! What a routing store reads back is checked before it reaches the balancer.
//!
//! A stored service is restored only if it is what the aggregator itself could have
//! written: a service snapshot whose names and addresses pass the rules a hello is held
//! to ([`Hello::validate`]), and whose weights are finite and not negative. Anything
//! else (a key put by hand, a truncated value, a file edited badly, an etcd holding
//! another program's keys) is skipped, logged with where it was found, and counted in
//! `ballast_store_corrupt_total{reason}`; the other services load as usual.

use ballast_balance::ServiceSnapshot;
use ballast_shared::wire::{Hello, HelloError};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Longest service name restored: the same bound a hello is held to.
const MAX_SERVICE: usize = 128;

/// What is wrong with a stored service; its [`Defect::label`] is the metric's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Defect {
    /// The value is not a service snapshot (not JSON, or not of that shape).
    Unparseable,
    /// The service name (an etcd key's last part, or a file's entry) is not valid.
    Service,
    /// An endpoint's node name is not valid.
    Node,
    /// An endpoint's address is not `host:port`.
    Address,
    /// An endpoint's zone is not valid.
    Zone,
    /// A weight is not finite, or is negative.
    Weight,
}

impl Defect {
    /// The `reason` label of `ballast_store_corrupt_total`.
    pub fn label(self) -> &'static str {
        match self {
            Defect::Unparseable => "unparseable",
            Defect::Service => "service",
            Defect::Node => "node",
            Defect::Address => "address",
            Defect::Zone => "zone",
            Defect::Weight => "weight",
        }
    }
}

/// A stored service that is not restored: what is wrong, and the details for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct Corrupt {
    /// The kind of defect.
    pub defect: Defect,
    /// What exactly is wrong.
    pub detail: String,
}

impl Corrupt {
    fn new(defect: Defect, detail: impl Into<String>) -> Self {
        Corrupt {
            defect,
            detail: detail.into(),
        }
    }
}

/// Whether `name` is a service name the aggregator could have stored.
pub fn check_service_name(name: &str) -> Result<(), Corrupt> {
    if name.is_empty() || name.len() > MAX_SERVICE || !ballast_shared::wire::is_valid_name(name) {
        return Err(Corrupt::new(
            Defect::Service,
            format!(
                "{name:?} is not a valid service name (1 to {MAX_SERVICE} letters, digits, \
                 '.', '_', '-')"
            ),
        ));
    }
    Ok(())
}

/// Checks a stored snapshot of service `service`: its name, and each endpoint's node,
/// address and zone (by the rules of a hello), weight and strategy weights (finite and
/// at least 0).
pub fn check_snapshot(service: &str, snapshot: &ServiceSnapshot) -> Result<(), Corrupt> {
    check_service_name(service)?;
    for (node, ep) in &snapshot.endpoints {
        let hello = Hello {
            node: node.clone(),
            service: service.to_string(),
            address: ep.address.clone(),
            zone: ep.zone.clone(),
            version: String::new(),
        };
        if let Err(e) = hello.validate() {
            let defect = match &e {
                HelloError::BadAddress(_) => Defect::Address,
                HelloError::Empty(field) | HelloError::BadName(field) => defect_of(field),
                HelloError::TooLong { field, .. } => defect_of(field),
            };
            return Err(Corrupt::new(defect, format!("endpoint {node:?}: {e}")));
        }
        let weights = std::iter::once(("weight".to_string(), ep.weight)).chain(
            ep.strategy_weights
                .iter()
                .map(|(s, w)| (format!("strategy weight {s:?}"), *w)),
        );
        for (what, w) in weights {
            if !w.is_finite() || w < 0.0 {
                return Err(Corrupt::new(
                    Defect::Weight,
                    format!("endpoint {node:?}: {what} {w} is not a finite number >= 0"),
                ));
            }
        }
    }
    Ok(())
}

fn defect_of(field: &str) -> Defect {
    match field {
        "node" => Defect::Node,
        "service" => Defect::Service,
        "address" => Defect::Address,
        _ => Defect::Zone,
    }
}

/// Parses and checks the stored value of service `service`.
pub fn parse_snapshot(service: &str, value: &[u8]) -> Result<ServiceSnapshot, Corrupt> {
    let snapshot: ServiceSnapshot = serde_json::from_slice(value)
        .map_err(|e| Corrupt::new(Defect::Unparseable, format!("not a service snapshot: {e}")))?;
    check_snapshot(service, &snapshot)?;
    Ok(snapshot)
}

/// Like [`parse_snapshot`], for a value already parsed as JSON (an entry of a file).
pub fn snapshot_from_json(
    service: &str,
    value: serde_json::Value,
) -> Result<ServiceSnapshot, Corrupt> {
    let snapshot: ServiceSnapshot = serde_json::from_value(value)
        .map_err(|e| Corrupt::new(Defect::Unparseable, format!("not a service snapshot: {e}")))?;
    check_snapshot(service, &snapshot)?;
    Ok(snapshot)
}

/// How many stored services a store skipped, by defect, since the counts were last
/// taken: a store reads before the metrics exist (at start), so it counts here and the
/// routing store's writer moves the counts into `ballast_store_corrupt_total`.
#[derive(Debug, Default)]
pub struct SkipCounts {
    counts: Mutex<BTreeMap<Defect, u64>>,
}

impl SkipCounts {
    /// Counts one skipped service.
    pub fn record(&self, defect: Defect) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(defect).or_default() += 1;
    }

    /// The counts since the last call, which start again from zero.
    pub fn take(&self) -> BTreeMap<Defect, u64> {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_balance::{EndpointSnapshot, Strategy};

    fn endpoint(address: &str, weight: f64) -> EndpointSnapshot {
        EndpointSnapshot {
            address: address.into(),
            zone: "z1".into(),
            draining: false,
            weight,
            strategy_weights: [(Strategy::Pid, weight)].into(),
        }
    }

    fn snapshot(node: &str, ep: EndpointSnapshot) -> ServiceSnapshot {
        ServiceSnapshot {
            version: 4,
            cycle: 9,
            endpoints: [(node.to_string(), ep)].into(),
            operator: Default::default(),
        }
    }

    fn defect(service: &str, s: &ServiceSnapshot) -> Option<Defect> {
        check_snapshot(service, s).err().map(|c| c.defect)
    }

    #[test]
    fn what_the_aggregator_writes_passes() {
        let s = snapshot("n1", endpoint("10.0.0.1:80", 1.5));
        assert_eq!(defect("web", &s), None);
        assert_eq!(
            defect("web", &snapshot("n1", endpoint("[::1]:80", 0.0))),
            None
        );
        assert_eq!(
            defect("web", &snapshot("n1", endpoint("db.internal:5432", 2.0))),
            None
        );
        let bytes = serde_json::to_vec(&s).expect("json");
        assert_eq!(parse_snapshot("web", &bytes), Ok(s));
    }

    #[test]
    fn each_defect_is_named() {
        let good = endpoint("10.0.0.1:80", 1.0);
        assert_eq!(
            defect("", &snapshot("n1", good.clone())),
            Some(Defect::Service)
        );
        assert_eq!(
            defect("a/b", &snapshot("n1", good.clone())),
            Some(Defect::Service)
        );
        assert_eq!(
            defect(&"s".repeat(129), &snapshot("n1", good.clone())),
            Some(Defect::Service)
        );
        assert_eq!(
            defect("web", &snapshot("n 1", good.clone())),
            Some(Defect::Node)
        );
        assert_eq!(
            defect("web", &snapshot("", good.clone())),
            Some(Defect::Node)
        );
        for address in [
            "",
            "10.0.0.1",
            "10.0.0.1:0",
            "10.0.0.1:99999",
            ":80",
            "a b:80",
        ] {
            assert_eq!(
                defect("web", &snapshot("n1", endpoint(address, 1.0))),
                Some(Defect::Address),
                "{address:?}"
            );
        }
        let mut zone = good.clone();
        zone.zone = "eu west".into();
        assert_eq!(defect("web", &snapshot("n1", zone)), Some(Defect::Zone));
        for w in [-0.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                defect("web", &snapshot("n1", endpoint("h:1", w))),
                Some(Defect::Weight),
                "{w}"
            );
        }
        let mut strategy = good;
        strategy.strategy_weights.insert(Strategy::RoundRobin, -1.0);
        assert_eq!(
            defect("web", &snapshot("n1", strategy)),
            Some(Defect::Weight)
        );
    }

    #[test]
    fn unparseable_values_are_named() {
        for value in [
            &b"{not json"[..],
            b"",
            b"[]",
            b"{\"version\":1}",
            b"\xff\xfe",
        ] {
            let err = parse_snapshot("web", value).expect_err("corrupt");
            assert_eq!(err.defect, Defect::Unparseable, "{value:?}: {err}");
        }
        // A weight too large for f64 is not a number JSON can give back.
        let huge = br#"{"version":1,"cycle":1,"endpoints":{"n":{"address":"h:1","weight":1e999}}}"#;
        assert!(parse_snapshot("web", huge).is_err());
    }

    #[test]
    fn counts_are_taken_once() {
        let counts = SkipCounts::default();
        counts.record(Defect::Weight);
        counts.record(Defect::Weight);
        counts.record(Defect::Unparseable);
        let taken = counts.take();
        assert_eq!(taken[&Defect::Weight], 2);
        assert_eq!(taken[&Defect::Unparseable], 1);
        assert!(counts.take().is_empty());
    }
}
