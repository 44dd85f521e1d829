//! xDS request handling: the ADS stream's sans-IO protocol machine fed arbitrary
//! DiscoveryRequests, decoded from protobuf bytes with prost as tonic decodes them
//! (real requests of Envoy and gRPC clients in the seeds), or built field by field
//! from the input (so that nonces and names often match what was sent). Between
//! requests the stream answers as the server does: for each type in push order, the
//! selection from the current snapshot when it should be sent. The input is
//! operations (`ballast_fuzz::ops`): a request in protobuf, a request to build, an
//! answer, a new snapshot.
//!
//! Invariants: nothing panics; an ACK or NACK names the version last sent with its
//! nonce; a stale request changes nothing; a wildcard only for LDS and CDS; rejected
//! or accepted contents are not sent again while nothing changed; nonces are unique;
//! a round of responses ends (at most one per type); a selection's version is the
//! version the stream compared.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use ballast_aggregator::config::LbPolicy;
use ballast_aggregator::feed::xds::resources::{ResourceType, Snapshot};
use ballast_aggregator::fuzzing::{XdsStream, XdsVerdict};
use ballast_balance::publish::LocalitySplit;
use ballast_balance::{Balancer, Params, Published};
use ballast_fuzz::ops;
use envoy_types::pb::envoy::config::core::v3::{Locality, Node};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

const PUSH_ORDER: [ResourceType; 4] = [
    ResourceType::Cluster,
    ResourceType::Endpoints,
    ResourceType::Listener,
    ResourceType::Route,
];

/// Two snapshots of a small fleet: `web` in zones a and b with a locality split for
/// clients in b, and `api`; the second after a drain and a move.
fn snapshots() -> &'static [Snapshot; 2] {
    static SNAPS: OnceLock<[Snapshot; 2]> = OnceLock::new();
    SNAPS.get_or_init(|| {
        let mut b = Balancer::new(Params::default(), 0);
        let now = b.grace_until();
        for (svc, node, addr, zone) in [
            ("web", "w1", "10.0.0.1:80", "a"),
            ("web", "w2", "10.0.0.2:80", "b"),
            ("web", "w3", "[fd00::3]:80", "b"),
            ("api", "a1", "10.0.1.1:90", "a"),
        ] {
            b.register(now, svc, node, addr, zone).expect("register");
        }
        b.cycle(now);
        let split: LocalitySplit =
            toml::from_str("[b]\na = 1\nb = 3\n[c]\nc = 1\n").expect("split");
        let localities: BTreeMap<String, LocalitySplit> = [("web".to_string(), split)].into();
        let publish =
            |b: &Balancer| Published::default().next(b, &BTreeSet::new(), &localities, now);
        let first =
            Snapshot::prepare(&publish(&b), &Snapshot::default()).finish(LbPolicy::RingHash);
        b.register(now, "web", "w2", "10.0.0.9:80", "a")
            .expect("move");
        b.cycle(now + 1000);
        let second = Snapshot::prepare(&publish(&b), &first).finish(LbPolicy::RingHash);
        [first, second]
    })
}

#[derive(Arbitrary, Debug)]
enum Name {
    Web,
    Api,
    Star,
    Missing,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Nonce {
    Empty,
    /// The nonce of the last response of a type.
    Last(u8),
    /// One of the earlier nonces of the stream.
    Earlier(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
struct Request {
    /// 0-3 one of the four types; else `other_type`.
    type_index: u8,
    other_type: String,
    names: Vec<Name>,
    nonce: Nonce,
    version_info: String,
    error: Option<String>,
    node: Option<(String, Option<String>)>,
}

/// Operation tags (modulo 4).
const RAW: u8 = 0;
const BUILT: u8 = 1;
const RESPOND: u8 = 2;

fn type_of(i: u8) -> ResourceType {
    ResourceType::ALL[usize::from(i) % 4]
}

fn build(r: &Request, stream: &XdsStream, nonces: &[String]) -> DiscoveryRequest {
    let type_url = if r.type_index < 4 {
        type_of(r.type_index).type_url().to_string()
    } else {
        r.other_type.clone()
    };
    let response_nonce = match &r.nonce {
        Nonce::Empty => String::new(),
        Nonce::Last(t) => stream
            .view(type_of(*t))
            .and_then(|v| v.sent)
            .map(|s| s.nonce)
            .unwrap_or_default(),
        Nonce::Earlier(i) if !nonces.is_empty() => nonces[usize::from(*i) % nonces.len()].clone(),
        Nonce::Earlier(_) => String::new(),
        Nonce::Other(s) => s.clone(),
    };
    DiscoveryRequest {
        version_info: r.version_info.clone(),
        node: r.node.as_ref().map(|(id, zone)| Node {
            id: id.clone(),
            locality: zone.as_ref().map(|z| Locality {
                zone: z.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        resource_names: r
            .names
            .iter()
            .map(|n| match n {
                Name::Web => "web".to_string(),
                Name::Api => "api".to_string(),
                Name::Star => "*".to_string(),
                Name::Missing => "gone".to_string(),
                Name::Other(s) => s.clone(),
            })
            .collect(),
        type_url,
        response_nonce,
        error_detail: r.error.as_ref().map(|m| Status {
            code: 3,
            message: m.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `owed`: the types a request asked an answer of (a subscription, new or changed)
/// that no response has answered yet.
fn apply(stream: &mut XdsStream, req: &DiscoveryRequest, owed: &mut BTreeSet<ResourceType>) {
    let t = ResourceType::ALL
        .into_iter()
        .find(|t| t.type_url() == req.type_url);
    let before = t.and_then(|t| stream.view(t));
    let verdict = stream.request(req);
    let Some(t) = t else {
        assert_eq!(verdict, XdsVerdict::Ignored);
        return;
    };
    let after = stream.view(t);
    let sent = before.as_ref().and_then(|b| b.sent.clone());
    match &verdict {
        XdsVerdict::Ignored => panic!("a served type was ignored"),
        XdsVerdict::Stale => {
            assert_eq!(before, after, "a stale request changed the stream");
            let sent = sent.expect("only an answer can be stale");
            assert!(!req.response_nonce.is_empty() && req.response_nonce != sent.nonce);
        }
        XdsVerdict::Subscribe => {
            assert!(
                sent.is_none() || req.response_nonce.is_empty(),
                "a request answering a response was taken for a subscription"
            );
        }
        XdsVerdict::Ack(v) | XdsVerdict::Nack(v) => {
            let sent = sent.expect("an answer to something sent");
            assert_eq!(sent.nonce, req.response_nonce);
            assert_eq!(&sent.version, v);
            let after = after.as_ref().expect("state kept");
            let unchanged = before
                .as_ref()
                .is_some_and(|b| b.wildcard == after.wildcard && b.names == after.names);
            if matches!(verdict, XdsVerdict::Ack(_)) {
                assert!(req.error_detail.is_none());
                assert_eq!(after.acked.as_ref(), Some(v));
                assert_eq!(after.nacked, None);
            } else {
                assert!(req.error_detail.is_some());
                assert_eq!(after.nacked.as_ref(), Some(v));
                assert_eq!(after.acked, before.as_ref().and_then(|b| b.acked.clone()));
            }
            if unchanged && !owed.contains(&t) {
                assert!(
                    !stream.should_send(t, v),
                    "contents answered with an unchanged subscription would be sent again"
                );
            }
        }
    }
    if verdict != XdsVerdict::Stale {
        let after = after.expect("a subscription is kept");
        let changed = before
            .as_ref()
            .is_none_or(|b| b.wildcard != after.wildcard || b.names != after.names);
        if verdict == XdsVerdict::Subscribe || changed {
            owed.insert(t);
        }
        if after.wildcard {
            assert!(matches!(t, ResourceType::Listener | ResourceType::Cluster));
        }
        let asked: BTreeSet<String> = req
            .resource_names
            .iter()
            .filter(|n| *n != "*")
            .cloned()
            .collect();
        assert_eq!(after.names, asked);
    }
}

fn respond(
    stream: &mut XdsStream,
    snap: &Snapshot,
    nonces: &mut Vec<String>,
    owed: &mut BTreeSet<ResourceType>,
) {
    let mut sent = 0;
    loop {
        let zone = stream.zone().to_string();
        let mut any = false;
        for t in PUSH_ORDER {
            let Some(view) = stream.view(t) else {
                continue;
            };
            let version = snap.version(t, view.wildcard, &view.names, &zone);
            if !stream.should_send(t, &version) {
                continue;
            }
            let sel = snap.select(t, view.wildcard, &view.names, &zone);
            assert_eq!(sel.version, version);
            let most = if view.wildcard {
                snap.names().count()
            } else {
                view.names.len()
            };
            assert!(sel.resources.len() <= most);
            for r in &sel.resources {
                assert_eq!(r.type_url, t.type_url());
            }
            let nonce = stream.record_sent(t, &sel.version);
            owed.remove(&t);
            assert!(!nonces.contains(&nonce), "nonce {nonce} reused");
            nonces.push(nonce);
            assert!(!stream.should_send(t, &sel.version), "sent, and still due");
            sent += 1;
            any = true;
            break;
        }
        if !any {
            break;
        }
        assert!(sent <= 4, "a round sent {sent} responses");
    }
}

fuzz_target!(|data: &[u8]| {
    let snaps = snapshots();
    let mut current = 0;
    let mut stream = XdsStream::new();
    let mut nonces: Vec<String> = Vec::new();
    let mut owed = BTreeSet::new();
    for (tag, payload) in ops(data).take(64) {
        match tag % 4 {
            RAW => {
                if let Ok(req) = DiscoveryRequest::decode(payload) {
                    apply(&mut stream, &req, &mut owed);
                }
            }
            BUILT => {
                let Ok(r) = Unstructured::new(payload).arbitrary::<Request>() else {
                    continue;
                };
                let req = build(&r, &stream, &nonces);
                // What tonic decodes is what was encoded.
                let again = DiscoveryRequest::decode(req.encode_to_vec().as_slice())
                    .expect("an encoded request decodes");
                assert_eq!(again, req);
                apply(&mut stream, &req, &mut owed);
            }
            RESPOND => respond(&mut stream, &snaps[current], &mut nonces, &mut owed),
            _ => current = (current + 1) % 2,
        }
    }
});
