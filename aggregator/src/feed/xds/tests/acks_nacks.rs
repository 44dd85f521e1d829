//! ACK and NACK: the protocol state machine (subscriptions, nonces, stale requests,
//! wildcards), a NACK over a socket, and the NACK warnings' rate limit.

use super::harness::*;
use super::*;
use crate::feed::xds::protocol::{StreamState, Verdict};
use crate::feed::xds::resources::ResourceType;
use crate::metrics::XdsResource;
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc;
use std::collections::BTreeSet;
use std::time::Duration;

#[test]
fn first_request_subscribes_and_an_ack_records_the_version() {
    let mut s = StreamState::new();
    assert!(!s.should_send(EDS, "v1"), "nothing subscribed yet");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "", None),
        Verdict::Subscribe
    );
    assert!(s.should_send(EDS, "v1"));
    let n1 = s.record_sent(EDS, "v1");
    assert!(!s.should_send(EDS, "v1"), "already sent");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), &n1, None),
        Verdict::Ack {
            version: "v1".into()
        }
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(st.acked.as_deref(), Some("v1"));
    assert_eq!(st.subscription.names, set(&["web"]));
    assert!(
        !s.should_send(EDS, "v1"),
        "an ACK of the same contents asks for nothing"
    );
    assert!(s.should_send(EDS, "v2"), "new contents are pushed");
}

#[test]
fn a_nack_keeps_the_acked_version_and_the_rejected_one_is_not_resent() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web"]), &n1, None);
    let n2 = s.record_sent(EDS, "v2");
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), &n2, Some("bad weight")),
        Verdict::Nack {
            version: "v2".into(),
            message: "bad weight".into()
        }
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(st.acked.as_deref(), Some("v1"));
    assert_eq!(st.nacked.as_deref(), Some("v2"));
    assert!(
        !s.should_send(EDS, "v2"),
        "the rejected contents are not sent again"
    );
    assert!(s.should_send(EDS, "v3"), "changed contents are");
    let n3 = s.record_sent(EDS, "v3");
    s.on_request(EDS, &names(&["web"]), &n3, None);
    let st = s.get(EDS).expect("state");
    assert_eq!(
        (st.acked.as_deref(), st.nacked.as_deref()),
        (Some("v3"), None)
    );
}

#[test]
fn stale_nonces_are_ignored_whole() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    let _n2 = s.record_sent(EDS, "v2");
    assert_eq!(
        s.on_request(EDS, &names(&["web", "api"]), &n1, Some("late")),
        Verdict::Stale
    );
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "no-such-nonce", None),
        Verdict::Stale
    );
    let st = s.get(EDS).expect("state");
    assert_eq!(
        st.subscription.names,
        set(&["web"]),
        "subscription untouched"
    );
    assert_eq!((st.acked.as_deref(), st.nacked.as_deref()), (None, None));
    assert!(!s.should_send(EDS, "v2"));
}

#[test]
fn a_changed_subscription_is_answered_even_with_the_same_contents() {
    let mut s = StreamState::new();
    s.on_request(EDS, &names(&["web"]), "", None);
    let n1 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web", "api"]), &n1, None);
    assert!(s.should_send(EDS, "v1"));
    let n2 = s.record_sent(EDS, "v1");
    s.on_request(EDS, &names(&["web", "api"]), &n2, Some("nope"));
    // Unsubscribing after a NACK is a new subscription: answered.
    s.on_request(EDS, &names(&["api"]), &n2, None);
    assert!(s.should_send(EDS, "v1"));
}

#[test]
fn wildcards_follow_the_legacy_rules() {
    let lds = ResourceType::Listener;
    let cds = ResourceType::Cluster;
    let mut s = StreamState::new();
    s.on_request(lds, &[], "", None);
    assert!(s.get(lds).expect("lds").subscription.wildcard);
    let n = s.record_sent(lds, "v1");
    s.on_request(lds, &[], &n, None);
    assert!(
        s.get(lds).expect("lds").subscription.wildcard,
        "an empty list keeps a wildcard"
    );

    s.on_request(cds, &names(&["web"]), "", None);
    assert!(!s.get(cds).expect("cds").subscription.wildcard);
    let n = s.record_sent(cds, "v1");
    s.on_request(cds, &[], &n, None);
    let sub = &s.get(cds).expect("cds").subscription;
    assert!(
        !sub.wildcard && sub.names.is_empty(),
        "emptied names unsubscribe"
    );
    let n = s.record_sent(cds, "v2");
    s.on_request(cds, &names(&["*", "web"]), &n, None);
    let sub = &s.get(cds).expect("cds").subscription;
    assert!(sub.wildcard && sub.names == set(&["web"]));

    // RDS and EDS have no wildcard.
    s.on_request(EDS, &[], "", None);
    assert!(!s.get(EDS).expect("eds").subscription.wildcard);
}

#[test]
fn a_first_request_with_a_foreign_nonce_still_subscribes() {
    let mut s = StreamState::new();
    assert_eq!(
        s.on_request(EDS, &names(&["web"]), "42", None),
        Verdict::Subscribe
    );
    assert!(s.should_send(EDS, "v1"));
}

#[test]
fn nonces_are_unique_across_types() {
    let mut s = StreamState::new();
    let mut seen = BTreeSet::new();
    for t in ResourceType::ALL {
        s.on_request(t, &[], "", None);
        for v in ["a", "b"] {
            assert!(seen.insert(s.record_sent(t, v)));
        }
    }
    // A nonce of another type is not an answer to this one.
    let lds_nonce = s.get(ResourceType::Listener).expect("lds").sent.clone();
    let nonce = lds_nonce.expect("sent").nonce;
    assert_eq!(s.on_request(EDS, &[], &nonce, None), Verdict::Stale);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_is_counted_the_client_keeps_its_version_and_the_next_one_is_served() {
    let h = Harness::start(&[("w1", "127.0.0.1:1001"), ("w2", "127.0.0.1:1002")]).await;
    let mut a = Client::connect(&h.server, "client-a").await;
    let mut b = Client::connect(&h.server, "client-b").await;

    // A subscribes to an existing and an unknown name: the answer has the one.
    a.send(EDS, &["web", "nope"], "", "", None).await;
    let r1 = a.recv().await;
    assert_eq!(r1.resources.len(), 1);
    let eps = endpoints_of(&r1);
    assert_eq!(eps.len(), 2);
    assert!(eps
        .iter()
        .all(|e| e.4 == HealthStatus::Healthy as i32 && e.3 == 1000));
    // B, with its own subscription, ACKs.
    b.send(EDS, &["web"], "", "", None).await;
    let rb = b.recv().await;
    assert_eq!(
        rb.version_info, r1.version_info,
        "same contents, same version"
    );
    b.send(EDS, &["web"], &rb.version_info, &rb.nonce, None)
        .await;

    // A rejects: counted, and the same contents are not sent again.
    assert_eq!(h.nacks(), 0);
    a.send(
        EDS,
        &["web", "nope"],
        "",
        &r1.nonce,
        Some("weights look wrong"),
    )
    .await;
    a.quiet().await;
    assert_eq!(h.nacks(), 1);
    // A stale or garbled request changes nothing and breaks nothing.
    a.send(EDS, &["other"], "", "not-a-nonce", Some("stale"))
        .await;
    a.send(ResourceType::Route, &[], "", "", None).await;
    let routes = a.recv().await;
    assert!(routes.resources.is_empty(), "RDS has no wildcard");
    assert_eq!(h.nacks(), 1);

    // Garbage of a valid shape: no type, odd names, an error without a nonce.
    let junk = DiscoveryRequest {
        resource_names: vec!["\0\u{ffff}".repeat(3); 1000],
        error_detail: Some(rpc::Status::default()),
        ..Default::default()
    };
    a.tx.send(junk).await.expect("send");
    a.send(EDS, &["web"], "", "", Some("no nonce")).await;
    let again = a.recv().await;
    assert_eq!(
        again.version_info, r1.version_info,
        "a resubscription is answered"
    );
    a.send(EDS, &["web", "nope"], "", &again.nonce, None).await;
    let back = a.recv().await;
    assert_eq!(back.version_info, r1.version_info);
    assert_eq!(h.nacks(), 1, "an error without a nonce answers nothing");

    // The weights change: both clients get the new version.
    h.drain("w1");
    let r2 = a.recv().await;
    assert_ne!(r2.version_info, r1.version_info);
    let eps = endpoints_of(&r2);
    assert_eq!(eps[0].4, HealthStatus::Draining as i32, "{eps:?}");
    assert_eq!(eps[1].4, HealthStatus::Healthy as i32);
    let rb2 = b.recv().await;
    assert_eq!(rb2.version_info, r2.version_info);
    a.send(EDS, &["web", "nope"], &r2.version_info, &r2.nonce, None)
        .await;
    a.quiet().await;
    assert_eq!(h.nacks(), 1);

    // Wildcard LDS on the same stream; the server is alive and answers.
    a.send(ResourceType::Listener, &[], "", "", None).await;
    let l = a.recv().await;
    assert_eq!(l.resources.len(), 1);
    let pushes = h
        .state
        .metrics
        .xds
        .pushes
        .get_or_create(&XdsResource::of("endpoints"))
        .get();
    assert_eq!(pushes, 6, "r1, rb, again, back, r2, rb2");
    assert!(h
        .state
        .metrics
        .encode()
        .contains("ballast_xds_nacks_total{resource=\"endpoints\"} 1"));

    // Shutdown ends the streams promptly.
    let started = std::time::Instant::now();
    h.server.stop().await;
    assert!(started.elapsed() < Duration::from_secs(3));
    let end = tokio::time::timeout(Duration::from_secs(3), a.rx.message())
        .await
        .expect("the stream ends");
    assert!(!matches!(end, Ok(Some(_))), "{end:?}");
}

#[test]
fn nack_warnings_are_rate_limited_and_say_how_many_were_left_out() {
    let mut log = crate::feed::xds::server::NackLog::default();
    let t0 = std::time::Instant::now();
    for _ in 0..10 {
        assert_eq!(log.admit(t0), Some(0));
    }
    for _ in 0..5 {
        assert_eq!(log.admit(t0 + Duration::from_secs(30)), None);
    }
    assert_eq!(log.admit(t0 + Duration::from_secs(60)), Some(5));
    assert_eq!(log.admit(t0 + Duration::from_secs(61)), Some(0));
}
