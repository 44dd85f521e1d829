//! The HTTP watch feed: `GET /v1/services/{name}/weights?watch=true` streams each new
//! weight set as a server-sent event whose id is the weight version.
//!
//! A watcher gets the current set at once, then one event per material change. It
//! never sees a half-applied cycle: each event is one service's whole set.

use crate::metrics::ServiceLabel;
use crate::state::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use ballast_balance::PublishedService;
use futures_util::stream::{self, Stream};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

/// Holds one place in the open-streams gauge for as long as its stream lives.
struct Open(Arc<State>);

impl Open {
    fn new(state: Arc<State>) -> Self {
        state.metrics.watch_streams.inc();
        Open(state)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.metrics.watch_streams.dec();
    }
}

/// Counts one event sent for `service`.
fn sent(state: &State, service: &str) {
    state
        .metrics
        .watch_events
        .get_or_create(&ServiceLabel {
            service: service.to_string(),
        })
        .inc();
}

fn event(set: &WeightSet) -> Event {
    let data = serde_json::to_string(set).unwrap_or_else(|_| "{}".to_string());
    Event::default()
        .event("weights")
        .id(set.version.to_string())
        .data(data)
}

/// The event stream for one service, starting with `current`, which the caller read from
/// `changes` after subscribing, so that no publication falls between the two.
pub fn stream(
    state: Arc<State>,
    service: String,
    changes: tokio::sync::watch::Receiver<Arc<ballast_balance::Published>>,
    current: WeightSet,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let first = event(&current);
    let open = Open::new(state.clone());
    let seed = (open, service, changes, current.version, Some(first));
    let events = stream::unfold(
        seed,
        |(open, service, mut changes, version, first)| async move {
            let state = &open.0;
            if let Some(ev) = first {
                sent(state, &service);
                return Some((Ok(ev), (open, service, changes, version, None)));
            }
            loop {
                // The sender lives as long as the daemon; its end ends the stream.
                changes.changed().await.ok()?;
                let set = {
                    let published = changes.borrow_and_update().clone();
                    // A service that expired while watched ends the stream.
                    WeightSet::of(published.service(&service)?)
                };
                if set.version != version {
                    let v = set.version;
                    sent(state, &service);
                    return Some((Ok(event(&set)), (open, service, changes, v, None)));
                }
            }
        },
    );
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// `GET /v1/services/{name}/weights`: the published weight set with its version.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WeightSet {
    /// Service name.
    pub service: String,
    /// Increases with every material change.
    pub version: u64,
    /// The cycle the weights came from.
    pub cycle: u64,
    /// Weights by node.
    pub weights: BTreeMap<String, WeightEntry>,
}

/// One endpoint's published weight, with each sink's integer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WeightEntry {
    /// `host:port`.
    pub address: String,
    /// Zone.
    pub zone: String,
    /// Weight, mean 1.0.
    pub weight: f64,
    /// Whether draining.
    pub draining: bool,
    /// Envoy / gRPC `load_balancing_weight`.
    pub envoy: u32,
    /// HAProxy agent-check percentage.
    pub haproxy_percent: u32,
}

impl WeightSet {
    /// The weights of `svc`.
    pub fn of(svc: &PublishedService) -> Self {
        use ballast_balance::load::{envoy_weight, haproxy_percent};
        WeightSet {
            service: svc.name.clone(),
            version: svc.version,
            cycle: svc.cycle,
            weights: svc
                .endpoints
                .iter()
                .map(|(node, e)| {
                    (
                        node.to_string(),
                        WeightEntry {
                            address: e.address.to_string(),
                            zone: e.zone.to_string(),
                            weight: e.weight,
                            draining: e.draining,
                            envoy: envoy_weight(e.weight),
                            haproxy_percent: if e.draining {
                                0
                            } else {
                                haproxy_percent(e.weight)
                            },
                        },
                    )
                })
                .collect(),
        }
    }
}
