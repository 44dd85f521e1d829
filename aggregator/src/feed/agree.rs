//! The three feeds that follow a service's changes, the xDS resources, the routing
//! store's writes and the HTTP watch's events, agree on when it changed: each follows
//! the service's one digest ([`ballast_balance::PublishedService::digest`]).

use super::watch::WatchFeed;
use super::xds::resources::Snapshot;
use crate::clock::Clock;
use crate::config::LbPolicy;
use crate::state::State;
use ballast_balance::{Balancer, Observation, Params, Published};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// What each feed makes of the publication `next` after `previous`, for service
/// `web`: whether xDS rebuilds its resources, whether the store writes it, and whether
/// the watch sends an event.
struct Verdicts {
    xds: bool,
    store: bool,
    watch: bool,
}

impl Verdicts {
    /// Asserts that every feed saw a change, or that none did.
    fn all(&self, changed: bool) {
        assert!(
            [self.xds, self.store, self.watch] == [changed; 3],
            "changed: {changed}; xds {} store {} watch {}",
            self.xds,
            self.store,
            self.watch
        );
    }
}

async fn verdicts(
    previous: &Published,
    next: &Published,
    sets: &mut (impl futures_util::Stream<Item = (u64, Arc<str>)> + Unpin),
) -> Verdicts {
    let built = Snapshot::prepare(previous, &Snapshot::default()).finish(LbPolicy::default());
    let xds = Snapshot::prepare(next, &built).changed().contains(&"web");
    let store = crate::store::differs(&previous.services["web"], &next.services["web"]);
    let watch = match tokio::time::timeout(Duration::from_millis(300), sets.next()).await {
        Ok(Some((version, json))) => {
            assert_eq!(version, next.services["web"].version);
            assert!(json.contains(&format!("\"version\":{version}")), "{json}");
            true
        }
        Ok(None) => panic!("the watch ended"),
        Err(_) => false,
    };
    Verdicts { xds, store, watch }
}

#[tokio::test]
async fn one_change_of_a_service_is_one_change_for_every_feed() {
    let clock = Clock::start();
    let params = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let store = Arc::new(crate::store::file::FileStore::new(
        std::env::temp_dir().join("ballast-feeds-agree-never-written.json"),
    ));
    let state = Arc::new(State::new(
        Balancer::new(params, clock.now()),
        store,
        clock,
        1000,
    ));
    let now = state.clock.now();
    state.write_balancer(|b| {
        for node in ["a", "b"] {
            b.register(now, "web", node, &format!("{node}:80"), "z1")
                .expect("registers");
            let obs = Observation {
                cpu: 0.5,
                ..Observation::default()
            };
            b.observe(now, "web", node, obs).expect("observes");
        }
    });
    let first = state.cycle(now);
    let feed = Arc::new(WatchFeed::new(
        state.subscribe(),
        state.metrics.watch.clone(),
    ));
    let mut sets = Box::pin(feed.sets("web".to_string()).expect("web is published"));
    let (version, _) = sets.next().await.expect("the current set at once");
    assert_eq!(version, first.services["web"].version);

    // A cycle that changes nothing material: a new publication, the same digest.
    let same = state.cycle(now);
    assert_ne!(same.version, first.version);
    assert_eq!(same.services["web"].digest, first.services["web"].digest);
    let v = verdicts(&first, &same, &mut sets).await;
    v.all(false);

    // One change that leaves the weights' version as it was: node b moves to zone z2.
    state.write_balancer(|b| {
        b.register(now, "web", "b", "b:80", "z2")
            .expect("registers");
    });
    let rezoned = state.cycle(now);
    assert_eq!(
        rezoned.services["web"].version,
        same.services["web"].version
    );
    assert_ne!(rezoned.services["web"].digest, same.services["web"].digest);
    let v = verdicts(&same, &rezoned, &mut sets).await;
    v.all(true);
    let same = rezoned;

    // Another: node b drains.
    state.write_balancer(|b| {
        let obs = Observation {
            draining: true,
            ..Observation::default()
        };
        b.observe(now, "web", "b", obs).expect("observes");
    });
    let drained = state.cycle(now);
    assert_ne!(drained.services["web"].digest, same.services["web"].digest);
    let v = verdicts(&same, &drained, &mut sets).await;
    v.all(true);

    // Every watcher of that change shares one encoding of it.
    let again = feed.encoded(&drained.services["web"]);
    let mut other = Box::pin(feed.sets("web".to_string()).expect("web is published"));
    let (_, json) = other.next().await.expect("the current set");
    assert!(Arc::ptr_eq(&again, &json));
}
