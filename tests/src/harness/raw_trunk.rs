//! A relay driven by hand: it opens a trunk to an aggregator with a relay's
//! certificate and attaches whatever agents the test says, with whatever proofs, as a
//! hostile relay would. Blocking API over its own tokio runtime; every exchange is
//! bounded in time.

use super::pki::Pki;
use ballast_shared::session::proof::{self, SigningKey};
use ballast_shared::session::trunk::{TrunkClientConfig, TrunkClientEvent};
use ballast_shared::session::TrunkClient;
use ballast_shared::tls::{self, Identity};
use ballast_shared::trunk::TrunkProtocol;
use ballast_shared::wire::{Hello, Message};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bound on connecting and on each answer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A trunk opened by hand.
pub struct RawTrunk {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    client: TrunkClient,
    endpoint: quinn::Endpoint,
    // Last: the connection is dropped inside a live runtime.
    rt: tokio::runtime::Runtime,
}

/// A certificate's chain (DER, leaf first) as `pem` holds it: what a relay forwards
/// for an agent, and anyone can copy.
pub fn chain_of(pem: &Path) -> Vec<Vec<u8>> {
    let text = tls::read(pem).expect("read the certificate");
    tls::certs_from_pem(&text, "certificate")
        .expect("a certificate")
        .into_iter()
        .map(|c| c.to_vec())
        .collect()
}

/// The signing key in the key file `key` (of `cert`).
pub fn key_of(cert: &Path, key: &Path) -> Arc<dyn SigningKey> {
    let identity = Identity::load(cert, key).expect("the identity");
    proof::signing_key(&identity.key).expect("a key proofs take")
}

impl RawTrunk {
    /// Dials `addr` with the relay certificate in `relay_dir` (`relay.pem`,
    /// `relay.key`), offering the current trunk version, and sends an open that names
    /// the relay `name`. Err if the handshake fails.
    pub fn dial(
        pki: &Pki,
        relay_dir: &Path,
        name: &str,
        addr: SocketAddr,
    ) -> Result<RawTrunk, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let identity = Identity::load(&relay_dir.join("relay.pem"), &relay_dir.join("relay.key"))
            .expect("the relay's identity");
        let config = tls::client_config_with_alpns(
            identity,
            &pki.ca_certs(),
            &[TrunkProtocol::CURRENT.alpn()],
        )
        .expect("client config");
        let mut endpoint = {
            let _guard = rt.enter();
            quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).expect("UDP socket")
        };
        endpoint.set_default_client_config(config);
        let client = TrunkClient::new(TrunkClientConfig::new(name));
        let open = client.open_frame().expect("the open frame");
        let ep = endpoint.clone();
        let (conn, send, recv) = rt.block_on(async move {
            let connecting = ep.connect(addr, "127.0.0.1").map_err(|e| e.to_string())?;
            let conn = tokio::time::timeout(TIMEOUT, connecting)
                .await
                .map_err(|_| "handshake timed out".to_string())?
                .map_err(|e| format!("handshake: {e}"))?;
            let (mut send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(&open).await.map_err(|e| e.to_string())?;
            Ok::<_, String>((conn, send, recv))
        })?;
        Ok(RawTrunk {
            conn,
            send,
            recv,
            client,
            endpoint,
            rt,
        })
    }

    /// The primary's next control events; an error once the trunk or its
    /// connection is over.
    pub fn events(&mut self) -> Result<Vec<TrunkClientEvent>, String> {
        let recv = &mut self.recv;
        let client = &mut self.client;
        self.rt.block_on(async {
            let mut buf = [0u8; 4096];
            loop {
                let n = tokio::time::timeout(TIMEOUT, recv.read(&mut buf))
                    .await
                    .map_err(|_| "no frame in time".to_string())?
                    .map_err(|e| format!("read: {e}"))?
                    .ok_or("the control stream ended")?;
                let events = client
                    .handle_control(buf.get(..n).unwrap_or_default())
                    .map_err(|e| e.to_string())?;
                if !events.is_empty() {
                    return Ok(events);
                }
            }
        })
    }

    /// Waits for the primary's `Opened`.
    pub fn opened(&mut self) -> Result<(), String> {
        match self.events()?.as_slice() {
            [TrunkClientEvent::Opened { .. }] => Ok(()),
            other => Err(format!("not opened: {other:?}")),
        }
    }

    /// Attaches an agent saying `hello`, with `chain`, from `source`; the primary's
    /// challenge is answered with a proof signed by `key` over `hello` (none: no
    /// proof). The primary's final answer.
    pub fn attach(
        &mut self,
        hello: &Hello,
        chain: Vec<Vec<u8>>,
        source: IpAddr,
        key: Option<&Arc<dyn SigningKey>>,
    ) -> Result<TrunkClientEvent, String> {
        let framed = ballast_shared::frame::encode(&Message::Hello(hello.clone()))
            .map_err(|e| e.to_string())?;
        let (_, frame) = self
            .client
            .attach(Instant::now(), &framed, chain, source)
            .map_err(|e| e.to_string())?;
        self.write(&frame)?;
        loop {
            let mut events = self.events()?;
            if events.len() != 1 {
                return Err(format!("one answer expected: {events:?}"));
            }
            match events.remove(0) {
                TrunkClientEvent::Challenged { slot, challenge } => {
                    let proof = key
                        .map(|k| proof::sign(k.as_ref(), &challenge, hello))
                        .transpose()
                        .map_err(|e| e.to_string())?;
                    let frame = self.client.prove(slot, proof).map_err(|e| e.to_string())?;
                    self.write(&frame)?;
                }
                other => return Ok(other),
            }
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        let send = &mut self.send;
        self.rt.block_on(async {
            tokio::time::timeout(TIMEOUT, send.write_all(bytes))
                .await
                .map_err(|_| "write timed out".to_string())?
                .map_err(|e| e.to_string())
        })
    }

    /// Why the connection was closed, if it was, waiting up to `within`.
    pub fn closed_within(&self, within: Duration) -> Option<quinn::ConnectionError> {
        let conn = self.conn.clone();
        self.rt
            .block_on(async move { tokio::time::timeout(within, conn.closed()).await.ok() })
    }
}

impl Drop for RawTrunk {
    fn drop(&mut self) {
        self.conn.close(0u32.into(), b"test done");
        self.endpoint.close(0u32.into(), b"test done");
    }
}
