//! What a relay's certificate can and cannot do at a real aggregator. The relay here
//! is driven by hand (harness `RawTrunk`), as a hostile relay would be: it holds a
//! valid relay certificate, and a copy of a node's `node.pem`, which is no secret.
//! It cannot attach that node, because it cannot sign the primary's challenge with
//! the node's key; agents really behind it, which sign, are admitted. A relay the
//! policy does not list is refused, and so is a relay whose open names another relay
//! than its certificate. A relay learns its cluster's routes from the replicas, with
//! no etcd credential at all, and only if the policy lists it.

use ballast_shared::session::trunk::TrunkClientEvent;
use ballast_shared::wire::{Hello, RejectReason};
use ballast_tests::harness::cluster;
use ballast_tests::harness::raw_trunk::{chain_of, key_of};
use ballast_tests::*;
use std::net::IpAddr;
use std::time::Duration;

const LOCALHOST: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

fn hello(node: &str, port: u16) -> Hello {
    Hello {
        node: node.into(),
        service: "web".into(),
        address: format!("127.0.0.1:{port}"),
        zone: String::new(),
        version: "test".into(),
    }
}

fn nodes(agg: &Aggregator) -> Vec<String> {
    agg.try_endpoints("web")
        .map(|eps| eps.into_iter().map(|e| e.node).collect())
        .unwrap_or_default()
}

#[test]
fn a_relay_with_a_copy_of_a_nodes_certificate_cannot_attach_it_but_its_own_agents_can() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().relays(&["relay-*"]));
    let relay_dir = pki.relay_tls_dir("relay-a");
    let mut trunk = RawTrunk::dial(&pki, &relay_dir, "relay-a", agg.quic_addr()).expect("dial");
    trunk.opened().expect("the trunk opens");

    // The victim: payments' node web-1. Its node.pem is world-readable; its key is not.
    let victim = pki.node_tls_dir_for("web-1", &["web"]);
    let copied = chain_of(&victim.join("node.pem"));
    let relays_own = key_of(&relay_dir.join("relay.pem"), &relay_dir.join("relay.key"));
    for (key, reason) in [(Some(&relays_own), "bad_proof"), (None, "unproven")] {
        match trunk
            .attach(&hello("web-1", 9999), copied.clone(), LOCALHOST, key)
            .expect("an answer")
        {
            TrunkClientEvent::Rejected { reject, .. } => {
                assert_eq!(reject.reason, RejectReason::IdentityMismatch);
                assert!(reject.detail.contains("proof of possession"), "{reject:?}");
            }
            other => panic!("the relay attached web-1 without its key: {other:?}"),
        }
        assert_eq!(
            agg.counter("ballast_connections_rejected_total", &[("reason", reason)]),
            1.0,
            "{reason}"
        );
    }

    // An agent really behind the relay signs with its own key, and is admitted.
    let honest = pki.node_tls_dir_for("web-2", &["web"]);
    let key = key_of(&honest.join("node.pem"), &honest.join("node.key"));
    match trunk
        .attach(
            &hello("web-2", 8080),
            chain_of(&honest.join("node.pem")),
            LOCALHOST,
            Some(&key),
        )
        .expect("an answer")
    {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("the honest agent was not attached: {other:?}"),
    }
    wait_for(Duration::from_secs(10), "web-2 registered", || {
        let n = nodes(&agg);
        (n == ["web-2"]).then_some(()).ok_or(format!("{n:?}"))
    });
    assert!(!nodes(&agg).contains(&"web-1".to_string()));
    assert!(
        trunk.closed_within(Duration::from_millis(200)).is_none(),
        "the trunk stays"
    );
}

#[test]
fn an_unlisted_relay_is_refused_by_default() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default());
    let relay_dir = pki.relay_tls_dir("relay-a");
    // Closed once the handshake is done: while the open is sent, or right after.
    let closed = match RawTrunk::dial(&pki, &relay_dir, "relay-a", agg.quic_addr()) {
        Ok(trunk) => trunk
            .closed_within(Duration::from_secs(5))
            .expect("the trunk is closed")
            .to_string(),
        Err(e) => e,
    };
    assert!(
        closed.contains("the policy allows no such relay"),
        "{closed}"
    );
    assert_eq!(
        agg.counter(
            "ballast_connections_rejected_total",
            &[("reason", "relay_not_allowed")]
        ),
        1.0
    );
}

#[test]
fn a_relay_must_name_itself_as_its_certificate_does() {
    let pki = Pki::new();
    let agg = Aggregator::start(&pki, AggregatorOpts::default().relays(&["relay-*"]));
    let relay_dir = pki.relay_tls_dir("relay-a");
    let mut trunk = RawTrunk::dial(&pki, &relay_dir, "relay-b", agg.quic_addr()).expect("dial");
    match trunk.events().expect("an answer").as_slice() {
        [TrunkClientEvent::Closed(reject)] => {
            assert!(
                reject.detail.contains("relay-b") && reject.detail.contains("relay-a"),
                "{reject:?}"
            )
        }
        other => panic!("the trunk was not refused: {other:?}"),
    }
    assert!(trunk.closed_within(Duration::from_secs(5)).is_some());
    assert_eq!(
        agg.counter(
            "ballast_connections_rejected_total",
            &[("reason", "relay_name_mismatch")]
        ),
        1.0
    );
}

/// A password file in `dir` holding `password`, readable by its owner only.
fn password_file(dir: &std::path::Path, name: &str, password: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("{password}\n")).expect("write the password file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the password file");
    path
}

/// A relay's `/healthz` routes: members, owned buckets, and how far behind.
fn routes_health(relay: &Relay) -> (u64, u64, Option<u64>) {
    let h = relay.healthz();
    let r = &h["routes"];
    (
        r["members"].as_u64().unwrap_or(0),
        r["owned_buckets"].as_u64().unwrap_or(0),
        r["behind_ms"].as_u64(),
    )
}

#[test]
fn a_relay_learns_its_routes_from_the_replicas_and_holds_no_etcd_credential() {
    require_etcd();
    const PREFIX: &str = "/ballast-routes";
    const CLUSTER: &str = "edge";
    // etcd takes only the replicas' user: nothing the relay could present.
    let mut etcd = Etcd::start();
    etcd.enable_auth("root-password");
    etcd.add_user("ballast", "replicas-write", PREFIX);
    let dir = etcd.scratch_dir().to_path_buf();
    let password = password_file(&dir, "ballast.password", "replicas-write");
    let pki = Pki::new();
    let start = |name: &str, protocol: Option<&str>| {
        let opts = AggregatorOpts {
            config_toml: Some(format!(
                "[store.etcd]\nuser = \"ballast\"\npassword_file = {password:?}\n"
            )),
            ..AggregatorOpts::default()
        }
        .etcd(&etcd.endpoint(), PREFIX)
        .cluster(CLUSTER, name)
        .relays(&["relay-*"]);
        let opts = match protocol {
            Some(p) => opts.protocol(p),
            None => opts,
        };
        Aggregator::start(&pki, opts)
    };
    let r0 = start("r0", None);
    let relay = Relay::start(&pki, RelayOpts::new("relay-a", &[&r0]));
    let agents = cluster::fleet(
        &pki,
        &r0,
        &[relay.quic_addr().to_string()],
        &["web"],
        1,
        |_| None,
    );
    let status = agents[0].wait_weight(Duration::from_secs(20));
    assert_eq!(
        status.connected_to,
        Some(relay.quic_addr().to_string()),
        "{status:?}"
    );
    assert_eq!(r0.counter("ballast_trunk_slots", &[]), 1.0);
    // The replica told it the whole cluster, and keeps confirming it.
    let (members, owned, behind) = routes_health(&relay);
    assert_eq!((members, owned), (1, 64), "{}", relay.healthz());
    assert!(behind.is_some_and(|ms| ms < 3_000), "{}", relay.healthz());
    assert_eq!(r0.counter("ballast_routes_feeds_open", &[]), 1.0);
    // An unchanged table is confirmed about every second (once a second has passed
    // since the last, at the next reading, each half second or later on a busy
    // machine): two more come.
    let sent = r0.counter("ballast_routes_sent_total", &[]);
    wait_for(
        Duration::from_secs(10),
        "two confirmations of an unchanged table",
        || {
            let more = r0.counter("ballast_routes_sent_total", &[]) - sent;
            (more >= 2.0).then_some(()).ok_or(format!("{more} more"))
        },
    );
    // The count alone also grows while the first readings still change the table; what
    // only confirmations give is routes that never fall behind while nothing changes:
    // over 6 s the relay never goes 5 s without a table (the silence after which it
    // leaves a replica).
    let watch = std::time::Instant::now();
    while watch.elapsed() < Duration::from_secs(6) {
        let (_, _, behind) = routes_health(&relay);
        assert!(
            behind.is_some_and(|ms| ms < 5_000),
            "the routes fell behind with nothing changed: {}",
            relay.healthz()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A second replica joins: the relay, told only of r0, learns of it and its
    // buckets from r0.
    let r1 = start("r1", None);
    wait_for(Duration::from_secs(20), "the relay learns of r1", || {
        let (members, owned, _) = routes_health(&relay);
        (members == 2 && owned == 64)
            .then_some(())
            .ok_or(format!("{}", relay.healthz()))
    });
    // r0 stops for good: the relay follows the routes from r1, which it learned of
    // from r0 alone, and they name r1 the owner of everything.
    drop(r0);
    wait_for(
        Duration::from_secs(30),
        "the relay follows r1's routes",
        || {
            let (members, owned, behind) = routes_health(&relay);
            (members == 1 && owned == 64 && behind.is_some_and(|ms| ms < 3_000))
                .then_some(())
                .ok_or(format!("{}", relay.healthz()))
        },
    );
    assert!(r1.counter("ballast_routes_feeds_open", &[]) >= 1.0);
    let status = agents[0].wait_weight(Duration::from_secs(30));
    assert_eq!(status.connected_to, Some(relay.quic_addr().to_string()));

    // A replica standing for the previous release speaks no routes protocol: a relay
    // told only of it says so, and counts it.
    let old = start("r-old", Some("previous"));
    let lonely = Relay::start(&pki, RelayOpts::new("relay-b", &[&old]));
    wait_for(
        Duration::from_secs(20),
        "the old replica is named as such",
        || {
            let n = lonely.counter(
                "ballast_relay_routes_failures_total",
                &[("reason", "no_routes_protocol")],
            );
            (n >= 1.0)
                .then_some(())
                .ok_or(format!("{n}: {}", lonely.log_tail(5)))
        },
    );
    assert!(
        lonely
            .log_tail(50)
            .contains("upgrade the replicas before the relays"),
        "{}",
        lonely.log_tail(20)
    );
    assert_eq!(routes_health(&lonely).0, 0);
}

#[test]
fn a_relay_the_policy_does_not_list_learns_no_routes() {
    require_etcd();
    let etcd = Etcd::start();
    let pki = Pki::new();
    let replica = Aggregator::start(
        &pki,
        AggregatorOpts::default()
            .etcd(&etcd.endpoint(), "/ballast-unlisted")
            .cluster("edge", "r0")
            .relays(&["relay-*"]),
    );
    let outsider = Relay::start(&pki, RelayOpts::new("edge-x", &[&replica]));
    wait_for(
        Duration::from_secs(20),
        "the replica refuses the relay",
        || {
            let n = replica.counter(
                "ballast_connections_rejected_total",
                &[("reason", "relay_not_allowed")],
            );
            (n >= 1.0).then_some(()).ok_or(format!("{n}"))
        },
    );
    assert_eq!(replica.counter("ballast_routes_feeds_open", &[]), 0.0);
    assert_eq!(
        outsider.counter("ballast_relay_routes_received_total", &[]),
        0.0
    );
    assert_eq!(routes_health(&outsider).0, 0);
    // A lone aggregator (no cluster) has no routes to give, and says so.
    let lone = Aggregator::start(&pki, AggregatorOpts::default().relays(&["relay-*"]));
    let relay = Relay::start(&pki, RelayOpts::new("relay-c", &[&lone]));
    wait_for(
        Duration::from_secs(20),
        "the lone aggregator refuses",
        || {
            let n = relay.counter(
                "ballast_relay_routes_failures_total",
                &[("reason", "refused")],
            );
            (n >= 1.0)
                .then_some(())
                .ok_or(format!("{n}: {}", relay.log_tail(5)))
        },
    );
    assert!(
        lone.counter(
            "ballast_connections_rejected_total",
            &[("reason", "routes_not_served")]
        ) >= 1.0
    );
}
