//! A relay's trunk against the QUIC server in-process, this aggregator's balancer
//! behind it ([`Local`]): attaches, replies, refusals.

use super::*;
use crate::state::State;
use ballast_balance::Balancer;
use ballast_ingest::metrics::{IngestMetrics as Metrics, Reason};
use ballast_ingest::quic::{close, serve};
use ballast_shared::pki::{Ca, RelaySpec};
use ballast_shared::session::trunk::{TrunkClientConfig, TrunkClientEvent};
use ballast_shared::session::TrunkClient;
use ballast_shared::tls::CertInfo;
use ballast_shared::tls::CertificateDer;
use ballast_shared::trunk::TrunkProtocol;
use ballast_shared::trunk::RELAY_ALPN;
use ballast_shared::wire::{Hello, Message, NodeState, Report};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LOCALHOST: [u8; 4] = [127, 0, 0, 1];
const WAIT: Duration = Duration::from_secs(5);

/// The keys of the certificates the tests issued, by their leaf (DER): the agents'
/// proofs are made with them.
static KEYS: std::sync::Mutex<Vec<(Vec<u8>, Key)>> = std::sync::Mutex::new(Vec::new());

/// A certificate's signing key.
type Key = Arc<dyn ballast_shared::session::proof::SigningKey>;

/// The chain of `pem`, leaf first (DER), its key kept for the agent's proofs.
fn chain_from(pem: &ballast_shared::pki::Pem) -> Vec<Vec<u8>> {
    let identity = pem.identity("test").expect("identity");
    let key = ballast_shared::session::proof::signing_key(&identity.key).expect("key");
    let chain: Vec<Vec<u8>> = identity.chain.iter().map(|c| c.to_vec()).collect();
    if let Some(leaf) = chain.first() {
        KEYS.lock().expect("keys").push((leaf.clone(), key));
    }
    chain
}

/// The key of the certificate whose leaf is `leaf`.
fn key_of(leaf: &[u8]) -> Option<Key> {
    let keys = KEYS.lock().expect("keys");
    keys.iter().find(|(l, _)| l == leaf).map(|(_, k)| k.clone())
}

/// A policy file that accepts the relays `relay-*`, and `extra`.
fn policy(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("policy.toml");
    std::fs::write(&path, format!("relays = [\"relay-*\"]\n{extra}")).expect("policy");
    path
}

/// An aggregator's QUIC server on a port of its own, serving its own balancer.
struct Primary {
    _dir: tempfile::TempDir,
    ca: Ca,
    ca_certs: Vec<CertificateDer<'static>>,
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    endpoint: quinn::Endpoint,
}

impl Primary {
    async fn start() -> Primary {
        Primary::start_with(crate::config::Config::default(), 1000).await
    }

    /// A primary with `cfg`, asking its agents for a report every `interval_ms`.
    async fn start_with(cfg: crate::config::Config, interval_ms: u32) -> Primary {
        Primary::start_from(Ca::generate("test CA").expect("CA"), cfg, interval_ms).await
    }

    /// A primary whose certificates come from `ca`.
    async fn start_from(ca: Ca, mut cfg: crate::config::Config, interval_ms: u32) -> Primary {
        let dir = tempfile::tempdir().expect("temporary directory");
        if cfg.authorization.policy.is_none() {
            cfg.authorization.policy = Some(policy(dir.path(), ""));
        }
        let server = ca
            .issue_server(&["localhost".to_string()])
            .expect("server certificate");
        let ca_certs = ballast_shared::tls::certs_from_pem(&ca.pem().cert, "CA").expect("CA");
        let (server_config, ingest) = crate::ingest::setup(
            &cfg,
            server.identity("server").expect("identity"),
            &ca_certs,
        )
        .expect("ingest");
        let endpoint = quinn::Endpoint::server(server_config, SocketAddr::from((LOCALHOST, 0)))
            .expect("server endpoint");
        let ingest = Arc::new(ingest);
        let metrics = Arc::new(Metrics::new());
        // The revocation list's file watched, as the daemon's QUIC threads watch it.
        tokio::spawn(ingest.revocation().watch(metrics.clone()));
        let addr = endpoint.local_addr().expect("address");
        let clock = crate::clock::Clock::start();
        let balancer = Balancer::new(ballast_balance::Params::default(), clock.now());
        let store = Arc::new(crate::store::file::FileStore::new(
            std::env::temp_dir().join("ballast-trunk-test-never-written.json"),
        ));
        let state = Arc::new(State::new(balancer, store, clock, interval_ms));
        let local = Arc::new(Local::new(state, &ingest));
        tokio::spawn(serve(endpoint.clone(), metrics.clone(), ingest, local));
        Primary {
            _dir: dir,
            ca,
            ca_certs,
            addr,
            metrics,
            endpoint,
        }
    }

    /// A connection with `identity`, asking for `alpn`: the handshake's outcome.
    async fn connect(
        &self,
        identity: ballast_shared::tls::Identity,
        alpn: &[u8],
    ) -> Result<quinn::Connection, quinn::ConnectionError> {
        let config =
            ballast_shared::tls::client_config_with_alpns(identity, &self.ca_certs, &[alpn])
                .expect("client config");
        let mut client = quinn::Endpoint::client(SocketAddr::from((LOCALHOST, 0))).expect("client");
        client.set_default_client_config(config);
        client
            .connect(self.addr, "localhost")
            .expect("connect")
            .await
    }

    fn relay_identity(&self, name: &str) -> ballast_shared::tls::Identity {
        let spec = RelaySpec::new(name, Duration::from_secs(3600)).expect("spec");
        let relay = self.ca.issue_relay(&spec).expect("relay certificate");
        relay.pem.identity("relay").expect("relay identity")
    }

    fn detached(&self, reason: &str) -> u64 {
        self.metrics
            .trunk_detached
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .get()
    }

    fn rejected(&self, reason: &str) -> u64 {
        self.metrics
            .connections_rejected
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .get()
    }
}

/// The leaf of node `node`'s certificate from `ca`, for service `web` (DER).
fn chain_of(ca: &Ca, node: &str) -> Vec<Vec<u8>> {
    let issued = ca.issue_node(node, &["web".to_string()]).expect("node");
    chain_from(&issued.pem)
}

fn hello(node: &str, port: u16) -> Vec<u8> {
    hello_in(node, port, "")
}

/// The hello of `node` at `port`, in `zone`.
fn hello_in(node: &str, port: u16, zone: &str) -> Vec<u8> {
    ballast_shared::frame::encode(&Message::Hello(Hello {
        node: node.into(),
        service: "web".into(),
        address: format!("127.0.0.1:{port}"),
        zone: zone.into(),
        version: "test".into(),
    }))
    .expect("hello")
}

fn report(seq: u32) -> Vec<u8> {
    ballast_shared::wire::encode(&Message::Report(Report {
        seq,
        cpu: 0.5,
        inflight: 3,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    }))
    .expect("report")
}

/// A relay's end of an open trunk.
struct Relay {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    client: TrunkClient,
    /// The most slots the primary said it takes.
    max_slots: u32,
}

impl Relay {
    async fn open(primary: &Primary) -> Relay {
        Relay::open_as(primary, RELAY_ALPN).await
    }

    /// A trunk of version `alpn`, opened by relay-1.
    async fn open_as(primary: &Primary, alpn: &[u8]) -> Relay {
        let (conn, send, recv, client) = Relay::dial(primary, "relay-1", alpn).await;
        let mut relay = Relay {
            conn,
            send,
            recv,
            client,
            max_slots: 0,
        };
        match &relay.events().await[..] {
            [TrunkClientEvent::Opened {
                replica, max_slots, ..
            }] => {
                assert_eq!(replica, "aggregator");
                relay.max_slots = *max_slots;
            }
            other => panic!("not opened: {other:?}"),
        }
        relay
    }

    /// A connection with relay-1's certificate, and its open sent naming it `name`.
    async fn dial(
        primary: &Primary,
        name: &str,
        alpn: &[u8],
    ) -> (
        quinn::Connection,
        quinn::SendStream,
        quinn::RecvStream,
        TrunkClient,
    ) {
        let conn = primary
            .connect(primary.relay_identity("relay-1"), alpn)
            .await
            .expect("handshake");
        let (mut send, recv) = conn.open_bi().await.expect("control stream");
        let client = TrunkClient::new(TrunkClientConfig {
            protocol: TrunkProtocol::from_alpn(alpn).expect("a trunk version"),
            ..TrunkClientConfig::new(name)
        });
        send.write_all(&client.open_frame().expect("open"))
            .await
            .expect("sent");
        (conn, send, recv, client)
    }

    /// The next control events.
    async fn events(&mut self) -> Vec<TrunkClientEvent> {
        let mut buf = [0u8; 4096];
        loop {
            let n = tokio::time::timeout(WAIT, self.recv.read(&mut buf))
                .await
                .expect("a frame in time")
                .expect("read")
                .expect("the stream is open");
            let events = self
                .client
                .handle_control(buf.get(..n).expect("read"))
                .expect("frames");
            if !events.is_empty() {
                return events;
            }
        }
    }

    /// Attaches an agent whose proof is made with its own key, as an honest relay
    /// hands it on: what the primary answered.
    async fn attach(&mut self, hello: &[u8], chain: Vec<Vec<u8>>) -> TrunkClientEvent {
        let key = chain.first().and_then(|leaf| key_of(leaf));
        self.attach_signed(hello, chain, key).await
    }

    /// Attaches an agent of `hello` and `chain`, the primary's challenge answered
    /// with a proof by `key` (none: no proof): what the primary answered at last.
    async fn attach_signed(
        &mut self,
        hello: &[u8],
        chain: Vec<Vec<u8>>,
        key: Option<Key>,
    ) -> TrunkClientEvent {
        let (_, frame) = self
            .client
            .attach(Instant::now(), hello, chain, IpAddr::from(LOCALHOST))
            .expect("attach");
        self.send.write_all(&frame).await.expect("sent");
        loop {
            let mut events = self.events().await;
            assert_eq!(events.len(), 1, "{events:?}");
            match events.remove(0) {
                TrunkClientEvent::Challenged { slot, challenge } => {
                    let said = match ballast_shared::wire::decode(hello.get(2..).expect("framed")) {
                        Ok(Message::Hello(h)) => h,
                        other => panic!("not a hello: {other:?}"),
                    };
                    let proof = key.as_ref().map(|k| {
                        ballast_shared::session::proof::sign(k.as_ref(), &challenge, &said)
                            .expect("signs")
                    });
                    let frame = self.client.prove(slot, proof).expect("proof frame");
                    self.send.write_all(&frame).await.expect("sent");
                }
                other => return other,
            }
        }
    }
}

#[tokio::test]
async fn a_relay_attaches_agents_and_hears_their_weights_and_bad_attaches_are_refused() {
    let primary = Primary::start().await;
    let mut relay = Relay::open(&primary).await;
    let mut slots = Vec::new();
    for (i, node) in ["n1", "n2", "n3"].into_iter().enumerate() {
        let port = 8080 + u16::try_from(i).expect("small");
        match relay
            .attach(&hello(node, port), chain_of(&primary.ca, node))
            .await
        {
            TrunkClientEvent::Attached { slot, welcome } => {
                assert_eq!(welcome.interval_ms, 1000);
                slots.push(slot);
            }
            other => panic!("{node} not attached: {other:?}"),
        }
    }
    assert_eq!(primary.metrics.trunks_open.get(), 1);
    assert_eq!(primary.metrics.trunk_slots.get(), 3);

    // One batch of three reports; one batch of three replies back.
    let now = Instant::now();
    for slot in &slots {
        assert!(relay
            .client
            .push_report(now, *slot, &report(1))
            .expect("push")
            .is_none());
    }
    let batch = relay.client.flush().expect("a batch");
    relay.conn.send_datagram(batch.into()).expect("sent");
    let replies = tokio::time::timeout(WAIT, relay.conn.read_datagram())
        .await
        .expect("replies in time")
        .expect("replies");
    let entries = relay.client.handle_datagram(&replies).expect("replies");
    assert_eq!(
        entries.iter().map(|e| e.slot).collect::<Vec<_>>(),
        slots,
        "one reply per report, in one batch"
    );
    for entry in entries {
        match ballast_shared::wire::decode(entry.message).expect("a reply") {
            Message::Reply(r) => assert!(r.weight > 0.0, "{r:?}"),
            other => panic!("not a reply: {other:?}"),
        }
    }
    assert_eq!(primary.metrics.trunk_batches.get(), 1);
    assert_eq!(primary.metrics.trunk_reports.get(), 3);
    assert_eq!(primary.metrics.reports_accepted.get(), 3);

    // A hello that claims another node than its chain: the slot is rejected.
    match relay
        .attach(&hello("n9", 8090), chain_of(&primary.ca, "n4"))
        .await
    {
        TrunkClientEvent::Rejected { reject, .. } => {
            assert_eq!(reject.reason, RejectReason::IdentityMismatch)
        }
        other => panic!("not rejected: {other:?}"),
    }
    // A chain from another CA: rejected too.
    let foreign = Ca::generate("foreign CA").expect("CA");
    match relay
        .attach(&hello("n5", 8091), chain_of(&foreign, "n5"))
        .await
    {
        TrunkClientEvent::Rejected { reject, .. } => {
            assert!(reject.detail.contains("certificate refused"), "{reject:?}")
        }
        other => panic!("not rejected: {other:?}"),
    }
    assert_eq!(primary.rejected("unknown_ca"), 1);
    // A relay's certificate is no agent's.
    let relay_chain = {
        let spec = RelaySpec::new("relay-2", Duration::from_secs(3600)).expect("spec");
        let issued = primary.ca.issue_relay(&spec).expect("relay");
        chain_from(&issued.pem)
    };
    match relay.attach(&hello("relay-2", 8092), relay_chain).await {
        TrunkClientEvent::Rejected { .. } => {}
        other => panic!("not rejected: {other:?}"),
    }
    assert_eq!(primary.rejected("relay_as_agent"), 1);
    // The trunk stays open, its agents attached.
    assert!(relay.client.is_open());
    assert_eq!(primary.metrics.trunk_slots.get(), 3);
    assert!(relay.conn.close_reason().is_none());

    // The relay goes: its agents go with it.
    relay.conn.close(0u32.into(), b"bye");
    for _ in 0..50 {
        if primary.metrics.trunks_open.get() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(primary.metrics.trunks_open.get(), 0);
    assert_eq!(primary.metrics.trunk_slots.get(), 0);
    assert_eq!(
        primary
            .metrics
            .trunk_detached
            .get_or_create(&Reason {
                reason: "relay_gone".into()
            })
            .get(),
        3
    );
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_full_trunk_refuses_attaches_and_a_silent_slot_is_detached() {
    let mut cfg = crate::config::Config::default();
    cfg.limits.trunk_max_slots = 1;
    // The silence rule's floor, five report intervals, decides: one second.
    cfg.limits.quic_report_timeout_ms = 1;
    let primary = Primary::start_with(cfg, 200).await;
    let mut relay = Relay::open(&primary).await;
    assert_eq!(
        relay.max_slots, 1,
        "the trunk's limit as the primary told it"
    );
    let slot = match relay
        .attach(&hello("n1", 8080), chain_of(&primary.ca, "n1"))
        .await
    {
        TrunkClientEvent::Attached { slot, welcome } => {
            assert_eq!(welcome.interval_ms, 200);
            slot
        }
        other => panic!("n1 not attached: {other:?}"),
    };
    // The relay's own machine holds to the limit it was told...
    assert!(matches!(
        relay.client.attach(
            Instant::now(),
            &hello("n2", 8081),
            chain_of(&primary.ca, "n2"),
            IpAddr::from(LOCALHOST)
        ),
        Err(ballast_shared::session::trunk::TrunkClientError::SlotsFull(
            1
        ))
    ));
    // ...and a relay that does not is refused the slot, not the trunk.
    let attach = ballast_shared::trunk::encode_control(&ballast_shared::trunk::ToPrimary::Attach(
        ballast_shared::trunk::Attach {
            slot: slot + 1,
            hello: hello("n2", 8081),
            chain: chain_of(&primary.ca, "n2"),
            source: IpAddr::from(LOCALHOST),
        },
    ))
    .expect("attach frame");
    relay.send.write_all(&attach).await.expect("sent");
    let mut reader = ballast_shared::trunk::ControlReader::<ballast_shared::trunk::ToRelay>::new();
    let mut buf = [0u8; 4096];
    let answer = loop {
        let n = tokio::time::timeout(WAIT, relay.recv.read(&mut buf))
            .await
            .expect("an answer in time")
            .expect("read")
            .expect("the stream is open");
        let mut frames = reader.push(buf.get(..n).expect("read")).expect("frames");
        if !frames.is_empty() {
            assert_eq!(frames.len(), 1, "{frames:?}");
            break frames.remove(0);
        }
    };
    match answer {
        ballast_shared::trunk::ToRelay::Rejected { slot: s, reject } => {
            assert_eq!(s, slot + 1);
            assert_eq!(reject.reason, RejectReason::LimitReached);
        }
        other => panic!("the attach over the limit was not refused: {other:?}"),
    }
    assert_eq!(
        primary
            .metrics
            .reports_rejected
            .get_or_create(&Reason {
                reason: "limit_reached".into()
            })
            .get(),
        1
    );
    assert_eq!(primary.metrics.trunk_slots.get(), 1);
    assert!(relay.conn.close_reason().is_none(), "the trunk stays open");

    // n1 never reports: a second (five intervals) later, its slot is detached as a
    // direct agent's connection would be closed.
    match &relay.events().await[..] {
        [TrunkClientEvent::Detached { slot: s, code, .. }] => {
            assert_eq!(*s, slot);
            assert_eq!(*code, close::NORMAL);
        }
        other => panic!("the silent slot was not detached: {other:?}"),
    }
    assert_eq!(primary.detached("no_reports"), 1);
    assert_eq!(primary.metrics.trunk_slots.get(), 0);
    assert!(relay.conn.close_reason().is_none(), "the trunk stays open");
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_revoked_agent_is_detached_from_the_trunk_and_the_others_stay() {
    let ca = Ca::generate("test CA").expect("CA");
    let dir = std::env::temp_dir().join(format!("ballast-trunk-crl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("directory");
    let crl = dir.join("crl.pem");
    std::fs::write(&crl, ca.revocation_list(&[], 1).expect("empty list")).expect("written");
    let mut cfg = crate::config::Config::default();
    cfg.authorization.crl = Some(crl.clone());
    cfg.authorization.crl_check_ms = 100;
    let primary = Primary::start_from(ca, cfg, 1000).await;
    let mut relay = Relay::open(&primary).await;
    let mut slots = Vec::new();
    let mut chains = Vec::new();
    for (i, node) in ["n1", "n2"].into_iter().enumerate() {
        let chain = chain_of(&primary.ca, node);
        chains.push(chain.clone());
        let port = 8080 + u16::try_from(i).expect("small");
        match relay.attach(&hello(node, port), chain).await {
            TrunkClientEvent::Attached { slot, .. } => slots.push(slot),
            other => panic!("{node} not attached: {other:?}"),
        }
    }
    let first = chains.first().and_then(|c| c.first()).expect("n1's leaf");
    let serial = CertInfo::parse(&CertificateDer::from(first.clone()))
        .expect("n1's certificate")
        .serial;
    let revoked = ballast_shared::pki::Revoked {
        serial,
        revoked_unix_s: i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_secs(),
        )
        .expect("in range"),
    };
    let list = primary.ca.revocation_list(&[revoked], 2).expect("list");
    std::fs::write(&crl, list).expect("written");

    match &relay.events().await[..] {
        [TrunkClientEvent::Detached { slot, code, .. }] => {
            assert_eq!(Some(slot), slots.first(), "n1's slot");
            assert_eq!(*code, close::REVOKED);
        }
        other => panic!("the revoked agent was not detached: {other:?}"),
    }
    assert_eq!(primary.detached("revoked"), 1);
    assert_eq!(primary.metrics.trunk_slots.get(), 1, "n2 stays attached");
    assert!(relay.conn.close_reason().is_none(), "the trunk stays open");
    // n1 cannot come back through the trunk: its attach is refused as revoked.
    match relay
        .attach(&hello("n1", 8080), chains.first().cloned().expect("n1"))
        .await
    {
        TrunkClientEvent::Detached { code, .. } => assert_eq!(code, close::REVOKED),
        other => panic!("a revoked agent attached again: {other:?}"),
    }
    primary.endpoint.close(0u32.into(), b"done");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits for `conn` to be closed as refused.
async fn refused(conn: &quinn::Connection) {
    let closed = tokio::time::timeout(WAIT, conn.closed())
        .await
        .expect("closed in time");
    assert!(
        matches!(&closed, quinn::ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(close::REJECTED)),
        "{closed}"
    );
}

#[tokio::test]
async fn a_node_cannot_open_a_trunk_nor_a_relay_connect_as_an_agent() {
    let primary = Primary::start().await;
    let node = primary
        .ca
        .issue_node("n1", &["web".to_string()])
        .expect("node");
    let conn = primary
        .connect(node.pem.identity("node").expect("identity"), RELAY_ALPN)
        .await
        .expect("handshake");
    refused(&conn).await;
    assert_eq!(primary.rejected("not_relay"), 1);

    let conn = primary
        .connect(primary.relay_identity("relay-1"), ballast_shared::ALPN)
        .await
        .expect("handshake");
    refused(&conn).await;
    assert_eq!(primary.rejected("relay_as_agent"), 1);
    assert_eq!(primary.metrics.trunks_open.get(), 0);
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_relay_that_shares_no_trunk_version_with_the_primary_is_refused_and_counted() {
    let primary = Primary::start().await;
    // Every version this build speaks is taken as a trunk.
    for version in ballast_shared::trunk::TrunkProtocol::ALL {
        let conn = primary
            .connect(primary.relay_identity("relay-1"), version.alpn())
            .await
            .expect("handshake");
        assert_eq!(
            ballast_shared::trunk::TrunkProtocol::negotiated(&conn),
            Some(version)
        );
        conn.close(0u32.into(), b"done");
    }
    // A relay of a release that speaks only a version this one does not (one gone
    // before, or one to come) fails the handshake, which the primary counts.
    for unknown in [&b"ballast-relay/0"[..], b"ballast-relay/3"] {
        let err = primary
            .connect(primary.relay_identity("relay-1"), unknown)
            .await
            .expect_err("refused");
        // The TLS alert no_application_protocol (120).
        assert!(
            matches!(&err, quinn::ConnectionError::ConnectionClosed(c)
                if c.error_code == quinn::TransportErrorCode::crypto(120)),
            "{err}"
        );
    }
    // The server counts the failure when its side of the handshake ends.
    let deadline = tokio::time::Instant::now() + WAIT;
    while primary.rejected("no_common_protocol") < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(primary.rejected("no_common_protocol"), 2);
    assert_eq!(primary.metrics.trunks_open.get(), 0);
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_relay_with_only_a_nodes_public_certificate_cannot_attach_it() {
    let primary = Primary::start().await;
    let mut relay = Relay::open(&primary).await;
    // An agent really behind the relay is admitted.
    match relay
        .attach(&hello("n1", 8080), chain_of(&primary.ca, "n1"))
        .await
    {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("not attached: {other:?}"),
    }
    // n2's node.pem is no secret; its key is. The relay signs with its own key.
    let victim = chain_of(&primary.ca, "n2");
    let own = {
        let identity = primary.relay_identity("relay-1");
        ballast_shared::session::proof::signing_key(&identity.key).expect("key")
    };
    for (key, reason) in [(Some(own), "bad_proof"), (None, "unproven")] {
        match relay
            .attach_signed(&hello("n2", 9999), victim.clone(), key)
            .await
        {
            TrunkClientEvent::Rejected { reject, .. } => {
                assert_eq!(reject.reason, RejectReason::IdentityMismatch);
                assert!(reject.detail.contains("proof of possession"), "{reject:?}");
            }
            other => panic!("the forged attach was taken: {other:?}"),
        }
        assert_eq!(primary.rejected(reason), 1, "{reason}");
    }
    // The agent that proved is attached still, and the trunk open.
    assert_eq!(primary.metrics.trunk_slots.get(), 1);
    assert!(relay.client.is_open() && relay.conn.close_reason().is_none());
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn unlisted_relays_and_relays_naming_themselves_falsely_are_refused() {
    // A policy without `relays`: no relay is accepted.
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("none.toml");
    std::fs::write(&path, "certificate_services = true\n").expect("policy");
    let mut cfg = crate::config::Config::default();
    cfg.authorization.policy = Some(path);
    let primary = Primary::start_with(cfg, 1000).await;
    let (conn, ..) = Relay::dial(&primary, "relay-1", RELAY_ALPN).await;
    refused(&conn).await;
    assert_eq!(primary.rejected("relay_not_allowed"), 1);
    primary.endpoint.close(0u32.into(), b"done");

    // A listed relay's certificate, and an open that names another relay.
    let primary = Primary::start().await;
    let (conn, _send, mut recv, mut client) = Relay::dial(&primary, "relay-9", RELAY_ALPN).await;
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(WAIT, recv.read(&mut buf))
        .await
        .expect("in time")
        .expect("read")
        .expect("a frame");
    match &client
        .handle_control(buf.get(..n).expect("read"))
        .expect("frames")[..]
    {
        [TrunkClientEvent::Closed(reject)] => {
            assert!(reject.detail.contains("relay-9"), "{reject:?}")
        }
        other => panic!("not closed: {other:?}"),
    }
    refused(&conn).await;
    assert_eq!(primary.rejected("relay_name_mismatch"), 1);
    assert_eq!(primary.metrics.trunks_open.get(), 0);
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_trunk_of_the_previous_version_admits_agents_only_when_the_policy_says_so() {
    for admit in [false, true] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut cfg = crate::config::Config::default();
        cfg.authorization.policy = Some(policy(
            dir.path(),
            &format!("admit_unproven_relayed_agents = {admit}\n"),
        ));
        let primary = Primary::start_with(cfg, 1000).await;
        let mut relay = Relay::open_as(&primary, TrunkProtocol::V1.alpn()).await;
        let event = relay
            .attach(&hello("n1", 8080), chain_of(&primary.ca, "n1"))
            .await;
        match (admit, event) {
            (true, TrunkClientEvent::Attached { .. }) => {
                assert_eq!(primary.metrics.trunk_unproven.get(), 1);
            }
            (false, TrunkClientEvent::Rejected { reject, .. }) => {
                assert!(reject.detail.contains("ballast-relay/1"), "{reject:?}");
                assert_eq!(primary.rejected("unproven"), 1);
            }
            (_, other) => panic!("admit_unproven {admit}: {other:?}"),
        }
        primary.endpoint.close(0u32.into(), b"done");
    }
}

/// What a primary whose policy has the `[[relay]]` table `table` answers relay-1's
/// attach of n1 (from 127.0.0.1, for service web); and how many it counted as
/// `relay_scope`.
async fn scoped_attach(table: &str) -> (TrunkClientEvent, u64) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut cfg = crate::config::Config::default();
    cfg.authorization.policy = Some(policy(dir.path(), table));
    let primary = Primary::start_with(cfg, 1000).await;
    let mut relay = Relay::open(&primary).await;
    let event = relay
        .attach(&hello("n1", 8080), chain_of(&primary.ca, "n1"))
        .await;
    let counted = primary.rejected("relay_scope");
    primary.endpoint.close(0u32.into(), b"done");
    (event, counted)
}

#[tokio::test]
async fn a_relay_table_bounds_the_networks_and_services_of_its_agents() {
    let cases = [
        (
            "[[relay]]\nnames = [\"relay-1\"]\nnetworks = [\"10.0.0.0/8\"]\n",
            Some(RejectReason::AddressNotAllowed),
        ),
        (
            "[[relay]]\nnames = [\"relay-1\"]\nservices = [\"api\"]\nnetworks = [\"127.0.0.0/8\"]\n",
            Some(RejectReason::ServiceNotAllowed),
        ),
        (
            "[[relay]]\nnames = [\"relay-1\"]\nservices = [\"web\"]\nnetworks = [\"127.0.0.0/8\"]\n",
            None,
        ),
    ];
    for (table, refused) in cases {
        match (scoped_attach(table).await, refused) {
            ((TrunkClientEvent::Rejected { reject, .. }, 1), Some(reason)) => {
                assert_eq!(reject.reason, reason, "{table}: {reject:?}")
            }
            ((TrunkClientEvent::Attached { .. }, 0), None) => {}
            (other, _) => panic!("{table}: {other:?}"),
        }
    }
}

/// Waits until `done` holds, for [`WAIT`] at most.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "not in time: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_nodes_sessions_are_capped_across_trunks_and_direct_connections() {
    let mut cfg = crate::config::Config::default();
    cfg.limits.quic_max_connections_per_identity = 2;
    let primary = Primary::start_with(cfg, 1000).await;
    let issued = primary
        .ca
        .issue_node("n1", &["web".to_string()])
        .expect("node");
    let chain = chain_from(&issued.pem);
    let mut first = Relay::open(&primary).await;
    let mut second = Relay::open(&primary).await;
    // n1 through the first trunk, and straight to the primary: two sessions.
    match first.attach(&hello("n1", 8080), chain.clone()).await {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("n1 not attached: {other:?}"),
    }
    let direct = primary
        .connect(
            issued.pem.identity("n1").expect("identity"),
            ballast_shared::protocol::Protocol::CURRENT.alpn(),
        )
        .await
        .expect("handshake");
    until("the direct connection counted", || {
        primary.metrics.connections_open.get() == 1
    })
    .await;
    // A third, through the other trunk or the same one: refused, the trunks open.
    for relay in [&mut second, &mut first] {
        match relay.attach(&hello("n1", 8080), chain.clone()).await {
            TrunkClientEvent::Rejected { reject, .. } => {
                assert_eq!(reject.reason, RejectReason::LimitReached);
                assert!(reject.detail.contains("2 sessions already"), "{reject:?}");
            }
            other => panic!("a third session of n1 attached: {other:?}"),
        }
        assert!(relay.conn.close_reason().is_none(), "the trunk stays open");
    }
    assert_eq!(primary.rejected("identity_connections"), 2);
    assert_eq!(primary.metrics.trunk_slots.get(), 1);
    // Another node is not held back by n1's sessions.
    match second
        .attach(&hello("n2", 8081), chain_of(&primary.ca, "n2"))
        .await
    {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("n2 not attached: {other:?}"),
    }
    // The direct connection goes: its place is n1's again, through the other trunk.
    direct.close(0u32.into(), b"bye");
    until("the direct connection let go", || {
        primary.metrics.connections_open.get() == 0
    })
    .await;
    match second.attach(&hello("n1", 8080), chain).await {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("n1 not attached once its place was free: {other:?}"),
    }
    assert_eq!(primary.metrics.trunk_slots.get(), 3);
    primary.endpoint.close(0u32.into(), b"done");
}

#[tokio::test]
async fn a_trunk_that_attaches_faster_than_its_rate_is_refused_the_excess() {
    let mut cfg = crate::config::Config::default();
    cfg.limits.trunk_attach_rate = 1;
    cfg.limits.trunk_attach_burst = 2;
    let primary = Primary::start_with(cfg, 1000).await;
    let mut relay = Relay::open(&primary).await;
    for (i, node) in ["n1", "n2"].into_iter().enumerate() {
        let port = 8080 + u16::try_from(i).expect("small");
        match relay
            .attach(&hello(node, port), chain_of(&primary.ca, node))
            .await
        {
            TrunkClientEvent::Attached { .. } => {}
            other => panic!("{node} not attached within the burst: {other:?}"),
        }
    }
    let n3 = chain_of(&primary.ca, "n3");
    match relay.attach(&hello("n3", 8082), n3.clone()).await {
        TrunkClientEvent::Rejected { reject, .. } => {
            assert_eq!(reject.reason, RejectReason::LimitReached);
            assert!(
                reject.detail.contains("faster than 1 a second"),
                "{reject:?}"
            );
        }
        other => panic!("an attach over the burst went through: {other:?}"),
    }
    assert_eq!(primary.rejected("attach_rate"), 1);
    assert_eq!(
        primary.rejected("bad_proof") + primary.rejected("unproven"),
        0,
        "refused before its proof was looked at"
    );
    assert!(relay.conn.close_reason().is_none(), "the trunk stays open");
    // A second on, the bucket holds one more.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    match relay.attach(&hello("n3", 8082), n3).await {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("n3 not attached a second later: {other:?}"),
    }
    assert_eq!(primary.metrics.trunk_slots.get(), 3);
    primary.endpoint.close(0u32.into(), b"done");
}

/// How often the probe's agent reports.
const PROBE_EVERY: Duration = Duration::from_millis(5);

/// The probe's agent: reports of `slot`, one every [`PROBE_EVERY`], each in a batch of
/// its own, until `done` holds or `limit` has passed: the latest any reply came after
/// its report was due (or, when the probe is behind its schedule, after the previous
/// reply), and how many reports went. The probe shares the primary's thread: a thread
/// kept busy by anything else makes a reply late whether it held the report, its
/// answer or the probe.
async fn probe(
    relay: &mut Relay,
    slot: ballast_shared::trunk::Slot,
    seq: &mut u32,
    limit: Duration,
    done: impl Fn() -> bool,
) -> (Duration, u32) {
    let start = tokio::time::Instant::now();
    let mut due = start;
    let mut worst = Duration::ZERO;
    let mut sent = 0;
    let mut answered = start;
    while !done() && start.elapsed() < limit {
        due += PROBE_EVERY;
        tokio::time::sleep_until(due).await;
        *seq += 1;
        sent += 1;
        round_trip(relay, slot, *seq).await;
        // Behind its schedule, the probe counts from its previous reply: a backlog of
        // its own is no stall.
        worst = worst.max(due.max(answered).elapsed());
        answered = tokio::time::Instant::now();
    }
    (worst, sent)
}

/// Sends one report of `slot` in a batch of its own and waits for its reply.
async fn round_trip(relay: &mut Relay, slot: ballast_shared::trunk::Slot, seq: u32) {
    let sent = Instant::now();
    assert!(relay
        .client
        .push_report(sent, slot, &report(seq))
        .expect("push")
        .is_none());
    let batch = relay.client.flush().expect("a batch");
    relay.conn.send_datagram(batch.into()).expect("sent");
    let replies = tokio::time::timeout(WAIT, relay.conn.read_datagram())
        .await
        .expect("a reply in time")
        .expect("a reply");
    let entries = relay.client.handle_datagram(&replies).expect("replies");
    assert_eq!(entries.len(), 1, "one reply");
}

/// Agents attached through the trunk whose slots are checked again.
const MANY: usize = 1000;

#[tokio::test]
async fn a_revocation_list_change_over_many_slots_does_not_stall_other_sessions() {
    let ca = Ca::generate("test CA").expect("CA");
    let dir = tempfile::tempdir().expect("directory");
    let crl = dir.path().join("crl.pem");
    std::fs::write(&crl, ca.revocation_list(&[], 1).expect("empty list")).expect("written");
    let mut cfg = crate::config::Config::default();
    cfg.authorization.crl = Some(crl.clone());
    cfg.authorization.crl_check_ms = 100;
    // The probe below reports every few milliseconds.
    cfg.limits.quic_max_datagrams_per_second = 10_000;
    // The many agents send no report while the others attach.
    cfg.limits.quic_report_timeout_ms = 600_000;
    let primary = Primary::start_from(ca, cfg, 1000).await;

    // One trunk with many agents; all but the last are revoked below.
    let mut many = Relay::open(&primary).await;
    let mut revoked = Vec::new();
    let mut serials = Vec::new();
    let mut kept = None;
    let attaching = Instant::now();
    for i in 0..MANY {
        let node = format!("m{i}");
        let chain = chain_of(&primary.ca, &node);
        let leaf = CertificateDer::from(chain.first().expect("a leaf").clone());
        let serial = CertInfo::parse(&leaf).expect("certificate").serial;
        let port = 10_000 + u16::try_from(i).expect("small");
        let slot = match many.attach(&hello(&node, port), chain).await {
            TrunkClientEvent::Attached { slot, .. } => slot,
            other => panic!("{node} not attached: {other:?}"),
        };
        if i + 1 < MANY {
            revoked.push(slot);
            serials.push(serial);
        } else {
            kept = Some(slot);
        }
    }
    eprintln!(
        "{MANY} attaches in {:?} ({:?} each, certificates issued and proofs made here included)",
        attaching.elapsed(),
        attaching.elapsed() / u32::try_from(MANY).expect("small")
    );

    // Another trunk, one agent: its reports' round trips are what must not stall.
    let mut other = Relay::open(&primary).await;
    let slot = match other
        .attach(&hello("probe", 9000), chain_of(&primary.ca, "probe"))
        .await
    {
        TrunkClientEvent::Attached { slot, .. } => slot,
        other => panic!("the probe not attached: {other:?}"),
    };
    let mut seq = 0u32;
    let (baseline, _) = probe(&mut other, slot, &mut seq, Duration::from_secs(1), || false).await;

    // The many agents' relay reads its detaches while the probe goes on.
    let expected = revoked.len();
    let reader = tokio::spawn(async move {
        let mut gone = std::collections::HashSet::new();
        while gone.len() < expected {
            for event in many.events().await {
                match event {
                    TrunkClientEvent::Detached { slot, code, .. } => {
                        assert_eq!(code, close::REVOKED, "slot {slot}");
                        gone.insert(slot);
                    }
                    other => panic!("not a detach: {other:?}"),
                }
            }
        }
        (many, gone)
    });
    let now_s = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs(),
    )
    .expect("in range");
    let list: Vec<ballast_shared::pki::Revoked> = serials
        .into_iter()
        .map(|serial| ballast_shared::pki::Revoked {
            serial,
            revoked_unix_s: now_s,
        })
        .collect();
    let changed = Instant::now();
    std::fs::write(&crl, primary.ca.revocation_list(&list, 2).expect("list")).expect("written");
    let (during, probes) = probe(&mut other, slot, &mut seq, Duration::from_secs(60), || {
        reader.is_finished()
    })
    .await;
    let took = changed.elapsed();
    assert!(
        reader.is_finished(),
        "the revoked slots were not all detached in {took:?}"
    );
    let (many, gone) = reader.await.expect("the reader");
    // Every revoked slot is cut off, and only those.
    assert_eq!(
        gone,
        revoked.iter().copied().collect(),
        "the revoked slots detached"
    );
    assert!(!gone.contains(&kept.expect("the last slot")));
    assert_eq!(
        primary.detached("revoked"),
        u64::try_from(expected).expect("small")
    );
    assert_eq!(
        primary.metrics.trunk_slots.get(),
        2,
        "the last agent and the probe"
    );
    assert!(many.conn.close_reason().is_none(), "the trunk stays open");
    // The other trunk's reports were answered all along, none later than the worst of
    // the baseline and a margin: one pass of checks is a few milliseconds, where all
    // the slots in one pass stalled them for the whole list.
    let bound = baseline * 2 + Duration::from_millis(50);
    eprintln!(
        "revocation of {expected} slots: all detached {took:?} after the change; the other \
         trunk's replies, latest after their report was due: {baseline:?} before, {during:?} \
         during ({probes} reports), bound {bound:?}"
    );
    assert!(
        during <= bound,
        "the other trunk's reports stalled {during:?} while the slots were checked (baseline {baseline:?})"
    );
    primary.endpoint.close(0u32.into(), b"done");
}

/// Sends `hello` on a direct agent connection of `identity`: the answer on the hello
/// stream.
async fn direct_hello(
    primary: &Primary,
    identity: ballast_shared::tls::Identity,
    hello: &[u8],
) -> Message {
    let conn = primary
        .connect(identity, ballast_shared::protocol::Protocol::CURRENT.alpn())
        .await
        .expect("handshake");
    let (mut send, mut recv) = conn.open_bi().await.expect("hello stream");
    send.write_all(hello).await.expect("sent");
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(WAIT, recv.read(&mut buf))
            .await
            .expect("an answer in time")
            .expect("read");
        match n {
            Some(n) => answer.extend_from_slice(buf.get(..n).expect("read")),
            None => break,
        }
        if let Some(&[hi, lo]) = answer.get(..2) {
            if answer.len() >= 2 + usize::from(u16::from_be_bytes([hi, lo])) {
                break;
            }
        }
    }
    ballast_shared::wire::decode(answer.get(2..).expect("framed")).expect("a message")
}

#[tokio::test]
async fn a_hello_naming_a_zone_its_policy_does_not_allow_is_refused() {
    let dir = tempfile::tempdir().expect("directory");
    let mut cfg = crate::config::Config::default();
    cfg.authorization.policy = Some(policy(
        dir.path(),
        "[[rule]]\nnodes = [\"z*\"]\nzones = [\"eu-1*\"]\n",
    ));
    let primary = Primary::start_with(cfg, 1000).await;
    let zone_refusals = || {
        primary
            .metrics
            .reports_rejected
            .get_or_create(&Reason {
                reason: "zone_not_allowed".into(),
            })
            .get()
    };
    // Through a relay: refused in another zone, attached in its own.
    let mut relay = Relay::open(&primary).await;
    let z1 = chain_of(&primary.ca, "z1");
    match relay
        .attach(&hello_in("z1", 8080, "us-1"), z1.clone())
        .await
    {
        TrunkClientEvent::Rejected { reject, .. } => {
            assert_eq!(reject.reason, RejectReason::ServiceNotAllowed);
            assert!(reject.detail.contains("zone \"us-1\""), "{reject:?}");
        }
        other => panic!("z1 attached in a zone its policy does not allow: {other:?}"),
    }
    assert_eq!(zone_refusals(), 1);
    match relay.attach(&hello_in("z1", 8080, "eu-1a"), z1).await {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("z1 not attached in its own zone: {other:?}"),
    }
    // A node no zone rule names may say any.
    match relay
        .attach(&hello_in("n1", 8081, "us-1"), chain_of(&primary.ca, "n1"))
        .await
    {
        TrunkClientEvent::Attached { .. } => {}
        other => panic!("n1 not attached: {other:?}"),
    }
    // Straight to the primary: the same.
    let z2 = primary
        .ca
        .issue_node("z2", &["web".to_string()])
        .expect("node");
    match direct_hello(
        &primary,
        z2.pem.identity("z2").expect("identity"),
        &hello_in("z2", 8082, "us-1"),
    )
    .await
    {
        Message::Reject(r) => {
            assert_eq!(r.reason, RejectReason::ServiceNotAllowed);
            assert!(r.detail.contains("zone \"us-1\""), "{r:?}");
        }
        other => panic!("z2 welcomed in a zone its policy does not allow: {other:?}"),
    }
    assert_eq!(zone_refusals(), 2);
    match direct_hello(
        &primary,
        z2.pem.identity("z2").expect("identity"),
        &hello_in("z2", 8082, "eu-1b"),
    )
    .await
    {
        Message::Welcome(_) => {}
        other => panic!("z2 not welcomed in its own zone: {other:?}"),
    }
    assert_eq!(zone_refusals(), 2);
    primary.endpoint.close(0u32.into(), b"done");
}
