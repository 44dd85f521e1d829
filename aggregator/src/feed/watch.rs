//! The HTTP watch feed: `GET /v1/services/{name}/weights?watch=true` streams each new
//! weight set as a server-sent event whose id is the weight version.
//!
//! A watcher gets the current set at once, then one event each time the service's
//! [`PublishedService::digest`] changes (a material change of its weights, or an
//! endpoint added, removed, moved, rezoned, drained or undrained): the digest the xDS
//! feed and the routing store follow too. It never sees a half-applied cycle: each
//! event is one service's whole set. Each set is encoded once, by the first stream
//! that sends it, and its JSON shared by every other.

use crate::metrics::{ServiceLabel, WatchMetrics};
use axum::response::sse::{Event, KeepAlive, Sse};
use ballast_balance::{Published, PublishedService};
use futures_util::stream::{self, Stream, StreamExt};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The HTTP watch feed of one daemon: the publications, its counters, and each
/// service's last set as JSON.
pub struct WatchFeed {
    publications: watch::Receiver<Arc<Published>>,
    metrics: Arc<WatchMetrics>,
    /// Service → the digest of the last set encoded, and that set as JSON.
    encoded: Mutex<BTreeMap<String, (u64, Arc<str>)>>,
}

impl WatchFeed {
    /// The feed of `publications`, counted in `metrics`.
    pub fn new(publications: watch::Receiver<Arc<Published>>, metrics: Arc<WatchMetrics>) -> Self {
        WatchFeed {
            publications,
            metrics,
            encoded: Mutex::new(BTreeMap::new()),
        }
    }

    /// The weight set of `svc` as JSON: encoded by the first stream that sends this
    /// digest of the service, shared by the others.
    pub(crate) fn encoded(&self, svc: &PublishedService) -> Arc<str> {
        let lock = || self.encoded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((digest, json)) = lock().get(&svc.name) {
            if *digest == svc.digest {
                return Arc::clone(json);
            }
        }
        // Encoded without the lock held: two streams may both encode a new set, once.
        let json: Arc<str> = serde_json::to_string(&WeightSet::of(svc))
            .unwrap_or_else(|_| "{}".to_string())
            .into();
        lock().insert(svc.name.clone(), (svc.digest, Arc::clone(&json)));
        json
    }

    /// The sets to send a watcher of `service`, as (version, JSON): the current one at
    /// once, then one per new digest, until the service expires or the daemon stops.
    /// `None` when there is no such service.
    pub(crate) fn sets(
        self: &Arc<Self>,
        service: String,
    ) -> Option<impl Stream<Item = (u64, Arc<str>)> + Send + 'static> {
        // Marked as seen with the read: no publication falls between the two.
        let mut changes = self.publications.clone();
        let current = changes.borrow_and_update().services.get(&service)?.clone();
        let open = Open::new(Arc::clone(self));
        let seed = (open, service, changes, None::<u64>, Some(current));
        Some(stream::unfold(
            seed,
            |(open, service, mut changes, sent, mut next)| async move {
                loop {
                    if let Some(svc) = next.take() {
                        if sent != Some(svc.digest) {
                            let feed = &open.0;
                            feed.metrics
                                .events
                                .get_or_create(&ServiceLabel {
                                    service: service.clone(),
                                })
                                .inc();
                            let item = (svc.version, feed.encoded(&svc));
                            return Some((item, (open, service, changes, Some(svc.digest), None)));
                        }
                    }
                    // The sender lives as long as the daemon; its end ends the stream.
                    changes.changed().await.ok()?;
                    let published = changes.borrow_and_update().clone();
                    // A service that expired while watched ends the stream.
                    next = Some(published.services.get(&service)?.clone());
                }
            },
        ))
    }
}

/// Holds one place in the open-streams gauge for as long as its stream lives.
struct Open(Arc<WatchFeed>);

impl Open {
    fn new(feed: Arc<WatchFeed>) -> Self {
        feed.metrics.streams.inc();
        Open(feed)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.metrics.streams.dec();
    }
}

/// The event stream for one watcher of `service`; `None` when there is no such service.
pub fn stream(
    feed: &Arc<WatchFeed>,
    service: String,
) -> Option<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let events = feed.sets(service)?.map(|(version, json)| {
        Ok(Event::default()
            .event("weights")
            .id(version.to_string())
            .data(&*json))
    });
    Some(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
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
