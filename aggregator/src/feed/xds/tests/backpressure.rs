//! A stalled client: no queue of versions per stream, the newest when it reads again.

use super::harness::*;
use super::*;
use crate::feed::xds::resources::{ResourceType, Snapshot};
use crate::feed::xds::LbPolicy;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use std::collections::{BTreeMap, BTreeSet};

/// The HTTP/2 window the stalled client grants its stream: less than one response, so
/// that the server can have at most one response on the wire to it while it stalls.
const STALLED_WINDOW: u32 = 1024;

/// What the stall test's clients subscribe to, with the names each type asks for:
/// every listener and cluster, and `web`'s assignment.
const SUBSCRIPTIONS: [(ResourceType, &[&str]); 3] = [
    (ResourceType::Cluster, &[]),
    (ResourceType::Endpoints, &["web"]),
    (ResourceType::Listener, &[]),
];

fn names_for(t: ResourceType) -> &'static [&'static str] {
    SUBSCRIPTIONS
        .iter()
        .find(|(s, _)| *s == t)
        .map_or(&[], |(_, n)| n)
}

fn type_of(resp: &DiscoveryResponse) -> ResourceType {
    ResourceType::from_type_url(&resp.type_url).expect("a type served")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_is_not_queued_versions_and_gets_the_newest_when_it_reads_again() {
    // 150 endpoints: an assignment of several KiB, more than the stalled client's
    // window, so a response to it cannot be on the wire whole while it stalls.
    let endpoints: Vec<(String, String)> = (0..150)
        .map(|i| (format!("w{i}"), format!("127.0.0.1:{}", 10_000 + i)))
        .collect();
    let refs: Vec<(&str, &str)> = endpoints
        .iter()
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect();
    let h = Harness::start(&refs).await;
    let mut fast = Client::connect(&h.server, "fast").await;
    let mut stalled = Client::open(&h.server, "stalled", None, Some(STALLED_WINDOW)).await;
    for c in [&mut fast, &mut stalled] {
        for (t, names) in SUBSCRIPTIONS {
            c.send(t, names, "", "", None).await;
        }
        let mut first = BTreeSet::new();
        while first.len() < SUBSCRIPTIONS.len() {
            let r = c.recv().await;
            c.ack(&r, names_for(type_of(&r))).await;
            first.insert(type_of(&r));
        }
    }
    let cla = stalled_cla_bytes(&h);
    assert!(
        cla > STALLED_WINDOW as usize * 3,
        "the assignment ({cla} bytes) must exceed the stalled client's window"
    );

    // The stalled client reads nothing from here on. Twenty changes of every type it
    // subscribed to; the fast client on its own connection gets each one.
    let before: BTreeMap<ResourceType, u64> = SUBSCRIPTIONS
        .iter()
        .map(|(t, _)| (*t, h.pushes(*t)))
        .collect();
    let mut to_fast: BTreeMap<ResourceType, u64> = BTreeMap::new();
    let mut newest: BTreeMap<ResourceType, String> = BTreeMap::new();
    const CHANGES: u16 = 20;
    for k in 1..=CHANGES {
        h.change(k);
        let mut got = BTreeSet::new();
        while got.len() < SUBSCRIPTIONS.len() {
            let r = fast.recv().await;
            let t = type_of(&r);
            assert!(got.insert(t), "change {k}: two {t:?} responses");
            assert_ne!(newest.get(&t), Some(&r.version_info), "change {k}: {t:?}");
            *to_fast.entry(t).or_default() += 1;
            newest.insert(t, r.version_info.clone());
            fast.ack(&r, names_for(t)).await;
        }
    }
    // Handed to the stalled stream while it stalled: per type, the response the
    // transport is writing (it cannot finish: the window is smaller) and at most one
    // more waiting for window; not one per version.
    for (t, _) in SUBSCRIPTIONS {
        let to_stalled = h.pushes(t) - before[&t] - to_fast[&t];
        assert!(
            to_stalled <= 2,
            "{t:?}: {to_stalled} responses for a client that stalled over {CHANGES} versions"
        );
    }

    // It reads again: what was on its way, then the newest version of each type, and
    // nothing in between.
    let mut last: BTreeMap<ResourceType, String> = BTreeMap::new();
    let mut received: BTreeMap<ResourceType, u64> = BTreeMap::new();
    let mut last_eds = None;
    while last != newest {
        let r = stalled.recv().await;
        let t = type_of(&r);
        *received.entry(t).or_default() += 1;
        assert!(
            received[&t] <= 3,
            "{t:?}: more than two stale responses before the newest: {received:?}"
        );
        last.insert(t, r.version_info.clone());
        stalled.ack(&r, names_for(t)).await;
        if t == EDS {
            last_eds = Some(r);
        }
    }
    let eps = endpoints_of(&last_eds.expect("an assignment"));
    assert_eq!(eps.len(), 150);
    assert!(
        eps.iter().any(|e| e.2 == 20_000 + u32::from(CHANGES)),
        "the newest assignment has w0 at its last port: {eps:?}"
    );
    stalled.quiet().await;
    fast.quiet().await;
    assert_eq!(h.nacks(), 0);
    h.server.stop().await;
}

/// The size of `web`'s default assignment as the server holds it.
fn stalled_cla_bytes(h: &Harness) -> usize {
    latest_eds(h).resources.iter().map(|a| a.value.len()).sum()
}

/// `web`'s default assignment from the snapshot of the last publication.
fn latest_eds(h: &Harness) -> DiscoveryResponse {
    let snap =
        Snapshot::prepare(&h.state.published(), &Snapshot::default()).finish(LbPolicy::RingHash);
    let sel = snap.select(ResourceType::Endpoints, false, &set(&["web"]), "");
    DiscoveryResponse {
        version_info: sel.version,
        resources: sel.resources,
        type_url: ResourceType::Endpoints.type_url().to_string(),
        ..Default::default()
    }
}
