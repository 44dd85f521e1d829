//! A bounded per-endpoint history of load and weight, for the dashboard's charts.
//!
//! The balancing core keeps a history of each service's spread, not of its endpoints;
//! this records what every publication shows of them. Memory is bounded: at most
//! [`SERVICES`] services, [`CHARTED`] endpoints of each (the first by node name, kept
//! while they stay published) and [`POINTS`] points per endpoint.

use ballast_balance::{Millis, Published};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Points kept per endpoint: five minutes at the default one-second cycle.
pub(crate) const POINTS: usize = 300;
/// Endpoints charted per service.
pub(crate) const CHARTED: usize = 12;
/// Services tracked.
pub(crate) const SERVICES: usize = 256;

/// One endpoint at one cycle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Point {
    /// When the cycle ran, on the daemon's clock.
    pub(crate) at: Millis,
    /// The load the balancer steered by.
    pub(crate) load: f32,
    /// The published weight.
    pub(crate) weight: f32,
}

#[derive(Debug, Default)]
struct Track {
    /// When the service's last recorded cycle ran.
    at: Option<Millis>,
    /// Endpoints in the service, charted or not.
    total: usize,
    endpoints: BTreeMap<Arc<str>, VecDeque<Point>>,
}

/// The charted endpoints of one service, oldest point first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tracked {
    /// Endpoints in the service, charted or not.
    pub(crate) total: usize,
    /// Node → points.
    pub(crate) endpoints: Vec<(Arc<str>, Vec<Point>)>,
}

/// Every tracked service.
#[derive(Debug, Default)]
pub(crate) struct History {
    services: Mutex<BTreeMap<String, Track>>,
}

impl History {
    /// Records one publication: a point for each charted endpoint of each service
    /// whose cycle ran since the last one recorded.
    pub(crate) fn record(&self, published: &Published) {
        let mut services = self.services.lock().unwrap_or_else(|p| p.into_inner());
        services.retain(|name, _| published.services.contains_key(name));
        for (name, svc) in &published.services {
            if !services.contains_key(name) && services.len() >= SERVICES {
                continue;
            }
            let track = services.entry(name.clone()).or_default();
            if track.at == Some(svc.at) {
                continue;
            }
            track.at = Some(svc.at);
            track.total = svc.endpoints.len();
            track
                .endpoints
                .retain(|node, _| svc.endpoints.contains_key(node));
            for node in svc.endpoints.keys() {
                if track.endpoints.len() >= CHARTED {
                    break;
                }
                track.endpoints.entry(Arc::clone(node)).or_default();
            }
            for (node, points) in &mut track.endpoints {
                let Some(e) = svc.endpoints.get(node) else {
                    continue;
                };
                if points.len() >= POINTS {
                    points.pop_front();
                }
                points.push_back(Point {
                    at: svc.at,
                    load: e.load as f32,
                    weight: e.weight as f32,
                });
            }
        }
    }

    /// A copy of what is kept of `service`.
    pub(crate) fn of(&self, service: &str) -> Tracked {
        let services = self.services.lock().unwrap_or_else(|p| p.into_inner());
        services
            .get(service)
            .map(|t| Tracked {
                total: t.total,
                endpoints: t
                    .endpoints
                    .iter()
                    .map(|(node, points)| (Arc::clone(node), points.iter().copied().collect()))
                    .collect(),
            })
            .unwrap_or_default()
    }

    /// Records every publication of `state` from now on, in a task that ends with the
    /// daemon's publisher; nothing is recorded outside a Tokio runtime.
    pub(crate) fn follow(self: &Arc<Self>, state: &crate::state::State) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut changes = state.subscribe();
        self.record(&changes.borrow_and_update());
        let history = Arc::clone(self);
        runtime.spawn(async move {
            while changes.changed().await.is_ok() {
                let published = changes.borrow_and_update().clone();
                history.record(&published);
            }
        });
    }
}
