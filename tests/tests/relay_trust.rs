//! What a relay's certificate can and cannot do at a real aggregator. The relay here
//! is driven by hand (harness `RawTrunk`), as a hostile relay would be: it holds a
//! valid relay certificate, and a copy of a node's `node.pem`, which is no secret.
//! It cannot attach that node, because it cannot sign the primary's challenge with
//! the node's key; agents really behind it, which sign, are admitted. A relay the
//! policy does not list is refused, and so is a relay whose open names another relay
//! than its certificate. A relay reads its cluster's routes from etcd with a user of
//! its own that may only read them: it routes, and etcd refuses that user's writes.

use ballast_aggregator::cluster::{cluster_prefix, owner_key};
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

#[test]
fn a_relay_routes_with_a_read_only_etcd_user_whose_writes_etcd_refuses() {
    require_etcd();
    const PREFIX: &str = "/ballast-ro";
    const CLUSTER: &str = "edge";
    const READER: (&str, &str) = ("relay", "relay-reads-only");
    let mut etcd = Etcd::start();
    etcd.enable_auth("root-password");
    // The replicas' user writes the whole prefix; the relay's reads the cluster's keys.
    etcd.add_user("ballast", "replicas-write", PREFIX);
    etcd.add_reader(READER.0, READER.1, &cluster_prefix(PREFIX, CLUSTER));
    let dir = etcd.scratch_dir().to_path_buf();
    let replicas_password = password_file(&dir, "ballast.password", "replicas-write");
    let relays_password = password_file(&dir, "relay.password", READER.1);

    let pki = Pki::new();
    let replica = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_toml: Some(format!(
                "[store.etcd]\nuser = \"ballast\"\npassword_file = {replicas_password:?}\n"
            )),
            ..AggregatorOpts::default()
        }
        .etcd(&etcd.endpoint(), PREFIX)
        .cluster(CLUSTER, "r0")
        .relays(&["relay-*"]),
    );
    // The relay's file has its own table and no [store.etcd]: --etcd and
    // --etcd-prefix amend [relay.etcd].
    let relay = Relay::start(
        &pki,
        RelayOpts::new("relay-a", &etcd.endpoint(), PREFIX, CLUSTER).config(&format!(
            "[relay.etcd]\nuser = {:?}\npassword_file = {relays_password:?}\n",
            READER.0
        )),
    );
    let agents = cluster::fleet(
        &pki,
        &replica,
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
    assert_eq!(replica.counter("ballast_trunk_slots", &[]), 1.0);

    // What the relay can do with its credentials: read the owners, and nothing more.
    let owners = format!("{PREFIX}/cluster/{CLUSTER}/owners/");
    let read = etcd.try_ctl_as(READER.0, READER.1, &["get", "--prefix", &owners]);
    assert!(
        read.is_ok_and(|out| out.contains("r0")),
        "the relay cannot read the owners"
    );
    for args in [
        vec!["put", &owner_key(PREFIX, CLUSTER, 0), "relay-a"],
        vec!["put", &format!("{PREFIX}/services/web"), "{}"],
        vec!["get", &format!("{PREFIX}/services/web")],
    ] {
        match etcd.try_ctl_as(READER.0, READER.1, &args) {
            Err(e) => assert!(e.contains("permission denied"), "{args:?}: {e}"),
            Ok(out) => panic!("etcd let the relay's user {args:?}: {out}"),
        }
    }
}
