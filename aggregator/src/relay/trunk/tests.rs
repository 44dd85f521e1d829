//! A relay's trunk against a scripted primary: real QUIC and mutual TLS on loopback,
//! the primary's side written frame by frame, so that it can answer late, go away, or
//! name itself wrongly.

use super::*;
use ballast_shared::pki::{Ca, RelaySpec};
use ballast_shared::tls::{CertificateDer, ClientVerifier};
use ballast_shared::trunk::{encode_control, ControlReader, ToPrimary, ToRelay, RELAY_ALPN};
use ballast_shared::wire::{Message, Welcome};

const LOCALHOST: [u8; 4] = [127, 0, 0, 1];
const WAIT: Duration = Duration::from_secs(5);

/// How the scripted primary behaves.
#[derive(Clone)]
struct Script {
    /// The name it gives in `Opened`.
    replica: String,
    /// How long it waits before `Opened`, on its first connection.
    open_delay: Duration,
    /// Whether it closes its first connection after its first attach.
    drop_first: bool,
}

/// What the scripted primary saw.
#[derive(Debug, PartialEq)]
enum Seen {
    /// A connection's `Open`.
    Open,
    /// An attach, with its slot.
    Attach(Slot),
    /// A detach, with its slot.
    Detach(Slot),
}

/// A scripted primary on a port of its own, and the relay's trunks to it under the
/// name `a`.
struct Rig {
    trunks: Arc<Trunks>,
    seen: mpsc::UnboundedReceiver<Seen>,
    _routes: watch::Sender<Arc<Routes>>,
}

impl Rig {
    async fn start(script: Script) -> Rig {
        let ca = Ca::generate("test CA").expect("CA");
        let ca_certs: Vec<CertificateDer<'static>> =
            ballast_shared::tls::certs_from_pem(&ca.pem().cert, "CA").expect("CA");
        let primary = primary_endpoint(&ca, &ca_certs, &[RELAY_ALPN]);
        let addr = primary.local_addr().expect("address");
        let (tx, seen) = mpsc::unbounded_channel();
        tokio::spawn(primary_script(primary, script, tx));

        let spec = RelaySpec::new("relay-1", Duration::from_secs(3600)).expect("spec");
        let relay = ca.issue_relay(&spec).expect("relay certificate");
        let client = ballast_shared::tls::client_config_with_alpns(
            relay.pem.identity("relay").expect("identity"),
            &ca_certs,
            &[RELAY_ALPN],
        )
        .expect("client config");
        let endpoint = quinn::Endpoint::client(SocketAddr::from((LOCALHOST, 0))).expect("client");
        let mut routes = Routes::default();
        routes.members.insert("a".into(), addr.to_string());
        let (routes_tx, routes_rx) = watch::channel(Arc::new(routes));
        let trunks = Trunks::new(Dialer {
            relay: "relay-1".into(),
            endpoint,
            client,
            server_name: Some("localhost".into()),
            batch_delay: Duration::from_millis(5),
            attach_timeout: Duration::from_secs(3),
            routes: routes_rx,
            metrics: Arc::new(RelayMetrics::new()),
        });
        tokio::spawn(trunks.clone().run());
        Rig {
            trunks,
            seen,
            _routes: routes_tx,
        }
    }

    async fn next_seen(&mut self) -> Seen {
        tokio::time::timeout(WAIT, self.seen.recv())
            .await
            .expect("the primary saw something in time")
            .expect("the primary runs")
    }

    /// Asks trunk `a` to attach an agent: the answer, and the slot's channel.
    async fn attach(&self) -> (Result<Attached, AttachError>, mpsc::UnboundedReceiver<Down>) {
        let commands = self.trunks.commands("a").expect("trunk a");
        let (down, down_rx) = mpsc::unbounded_channel();
        let (answer, answer_rx) = oneshot::channel();
        commands
            .send(Command::Attach {
                hello: vec![1, 2, 3],
                chain: vec![vec![0x30; 8]],
                source: IpAddr::from(LOCALHOST),
                down,
                answer,
                // This primary challenges no attach.
                prover: crate::ingest::upstream::Prover::new().0,
            })
            .await
            .expect("the trunk takes commands");
        let answer = tokio::time::timeout(WAIT, answer_rx)
            .await
            .expect("an answer in time")
            .expect("answered");
        (answer, down_rx)
    }
}

/// A primary's QUIC endpoint on a port of its own, with a server certificate from
/// `ca`, taking relays' certificates from `ca_certs`, offering `alpns`.
fn primary_endpoint(
    ca: &Ca,
    ca_certs: &[CertificateDer<'static>],
    alpns: &[&[u8]],
) -> quinn::Endpoint {
    let server = ca
        .issue_server(&["localhost".to_string()])
        .expect("server certificate");
    let verifier = ClientVerifier::new(ca_certs, Vec::new()).expect("verifier");
    let server_config = ballast_shared::tls::server_config_for(
        server.identity("server").expect("identity"),
        Arc::new(verifier),
        alpns,
    )
    .expect("server config");
    quinn::Endpoint::server(server_config, SocketAddr::from((LOCALHOST, 0)))
        .expect("primary endpoint")
}

/// Serves connections as `script` says, telling `seen` what came.
async fn primary_script(
    endpoint: quinn::Endpoint,
    script: Script,
    seen: mpsc::UnboundedSender<Seen>,
) {
    let mut first = true;
    while let Some(incoming) = endpoint.accept().await {
        let Ok(conn) = incoming.await else { continue };
        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
            continue;
        };
        let mut reader = ControlReader::<ToPrimary>::new();
        let mut buf = vec![0u8; 16 * 1024];
        let mut attaches = 0;
        'frames: while let Ok(Some(n)) = recv.read(&mut buf).await {
            let Ok(msgs) = reader.push(buf.get(..n).unwrap_or_default()) else {
                break;
            };
            for msg in msgs {
                let reply = match msg {
                    ToPrimary::Open { .. } => {
                        let _ = seen.send(Seen::Open);
                        if first {
                            tokio::time::sleep(script.open_delay).await;
                        }
                        ToRelay::Opened {
                            replica: script.replica.clone(),
                            max_slots: 100,
                            max_batch_bytes: 1200,
                        }
                    }
                    ToPrimary::Attach(a) => {
                        let _ = seen.send(Seen::Attach(a.slot));
                        attaches += 1;
                        let welcome = ballast_shared::frame::encode(&Message::Welcome(Welcome {
                            interval_ms: 1000,
                        }))
                        .expect("welcome");
                        ToRelay::Attached {
                            slot: a.slot,
                            welcome,
                        }
                    }
                    ToPrimary::Detach { slot } => {
                        let _ = seen.send(Seen::Detach(slot));
                        continue;
                    }
                    ToPrimary::Proof { .. } => continue,
                };
                let frame = encode_control(&reply).expect("frame");
                if send.write_all(&frame).await.is_err() {
                    break 'frames;
                }
                if first && script.drop_first && attaches == 1 {
                    // Let the frame leave, then go away.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    conn.close(0u32.into(), b"gone");
                    break 'frames;
                }
            }
        }
        first = false;
    }
}

#[tokio::test]
async fn attaches_wait_for_the_open_and_slots_rise_across_connections() {
    let mut rig = Rig::start(Script {
        replica: "a".into(),
        open_delay: Duration::from_millis(300),
        drop_first: true,
    })
    .await;
    assert_eq!(rig.next_seen().await, Seen::Open);
    // The trunk is dialled and its open not yet answered: the attach waits for it.
    let (first, mut first_down) = rig.attach().await;
    let first = first.expect("attached once the trunk opened");
    assert_eq!(first.slot, 0);
    assert_eq!(rig.next_seen().await, Seen::Attach(0));
    // The primary goes: the slot is lost with its connection, and the trunk is
    // dialled again.
    let lost = tokio::time::timeout(WAIT, first_down.recv())
        .await
        .expect("told in time");
    assert_eq!(lost, Some(Down::Lost));
    assert_eq!(rig.next_seen().await, Seen::Open);
    // The next connection goes on numbering: slot 0 can name no new agent.
    let mut attached = None;
    for _ in 0..50 {
        match rig.attach().await {
            (Ok(a), down) => {
                attached = Some((a, down));
                break;
            }
            // Between the open and the primary's answer, or still dialling.
            (Err(AttachError::TrunkDown), _) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (Err(e), _) => panic!("not attached: {e}"),
        }
    }
    let (second, _down) = attached.expect("attached on the second connection");
    assert_eq!(second.slot, 1);
    assert_eq!(rig.next_seen().await, Seen::Attach(1));
}

#[tokio::test]
async fn a_primary_that_names_another_replica_gets_no_agent() {
    let mut rig = Rig::start(Script {
        replica: "b".into(),
        open_delay: Duration::from_millis(300),
        drop_first: false,
    })
    .await;
    assert_eq!(rig.next_seen().await, Seen::Open);
    let started = std::time::Instant::now();
    let (answer, _down) = rig.attach().await;
    assert_eq!(answer.map(|a| a.slot), Err(AttachError::TrunkDown));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused when the primary named itself, not at the attach's timeout: {:?}",
        started.elapsed()
    );
    // The agent never reached it.
    while let Ok(seen) = rig.seen.try_recv() {
        assert_eq!(seen, Seen::Open, "the primary was handed an agent");
    }
}

#[tokio::test]
async fn a_replica_that_shares_no_trunk_version_is_named_in_the_dial_error() {
    let ca = Ca::generate("test CA").expect("CA");
    let ca_certs: Vec<CertificateDer<'static>> =
        ballast_shared::tls::certs_from_pem(&ca.pem().cert, "CA").expect("CA");
    // A primary of a release that speaks only a trunk version this relay does not.
    let primary = primary_endpoint(&ca, &ca_certs, &[b"ballast-relay/4"]);
    let addr = primary.local_addr().expect("address");
    tokio::spawn(async move {
        while let Some(incoming) = primary.accept().await {
            let _ = incoming.await;
        }
    });
    let spec = RelaySpec::new("relay-1", Duration::from_secs(3600)).expect("spec");
    let relay = ca.issue_relay(&spec).expect("relay certificate");
    let client = ballast_shared::tls::client_config_with_alpns(
        relay.pem.identity("relay").expect("identity"),
        &ca_certs,
        &trunk_alpns().expect("the trunk versions"),
    )
    .expect("client config");
    let endpoint = quinn::Endpoint::client(SocketAddr::from((LOCALHOST, 0))).expect("client");
    let err = endpoint
        .connect_with(client, addr, "localhost")
        .expect("dial")
        .await
        .expect_err("no common trunk version");
    let text = dial_error(addr, &err);
    assert!(
        text.contains("speaks none of the trunk protocols this relay offers (ballast-relay/3, ballast-relay/2)"),
        "{text}"
    );
}
