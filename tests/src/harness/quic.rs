//! A raw QUIC client for protocol-fault tests: it speaks mTLS like an agent but sends
//! whatever bytes the test asks for. Blocking API over its own tokio runtime; every
//! operation is bounded in time.

use super::pki::Pki;
use ballast_shared::frame;
use ballast_shared::wire::{Hello, Message};
use quinn::crypto::rustls::QuicClientConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Bound on connecting and on each exchange.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A client endpoint with its runtime.
pub struct RawClient {
    endpoint: quinn::Endpoint,
    // Last: the endpoint is dropped inside a live runtime.
    rt: Arc<tokio::runtime::Runtime>,
}

/// A QUIC client configuration with the CA of `pki` as trust root and no client
/// certificate at all.
pub fn client_config_without_certificate(pki: &Pki) -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.ca_certs() {
        roots.add(c).expect("add CA root");
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ballast_shared::ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).expect("QUIC crypto");
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(ballast_shared::tls::transport()));
    cfg
}

impl RawClient {
    /// A client presenting node `node`'s certificate from `pki` (which names no
    /// service, if `pki` issues it here).
    pub fn for_node(pki: &Pki, node: &str) -> RawClient {
        Self::with_config(pki.client_config(node))
    }

    /// A client presenting a certificate from `pki` for node `node` that may serve
    /// `services`.
    pub fn for_node_serving(pki: &Pki, node: &str, services: &[&str]) -> RawClient {
        Self::with_config(pki.client_config_from(&pki.node_tls_dir_for(node, services)))
    }

    /// A client with any configuration.
    pub fn with_config(config: quinn::ClientConfig) -> RawClient {
        // A worker thread drives the connection in the background, so that datagrams
        // leave and arrive while the test thread does something else.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let mut endpoint = {
            let _guard = rt.enter();
            quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0)))
                .expect("bind a loopback UDP socket")
        };
        endpoint.set_default_client_config(config);
        RawClient {
            endpoint,
            rt: Arc::new(rt),
        }
    }

    /// Connects to `addr` (server name 127.0.0.1). Err if the handshake fails or the
    /// server closes the connection right after it.
    pub fn connect(&self, addr: SocketAddr) -> Result<RawConn, String> {
        let endpoint = self.endpoint.clone();
        let conn = self.rt.block_on(async move {
            let connecting = endpoint
                .connect(addr, "127.0.0.1")
                .map_err(|e| format!("connect: {e}"))?;
            match tokio::time::timeout(TIMEOUT, connecting).await {
                Err(_) => Err("handshake timed out".to_string()),
                Ok(Err(e)) => Err(format!("handshake: {e}")),
                Ok(Ok(c)) => Ok(c),
            }
        })?;
        Ok(RawConn {
            conn,
            rt: self.rt.clone(),
        })
    }
}

impl Drop for RawClient {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"test done");
    }
}

/// One connection.
pub struct RawConn {
    conn: quinn::Connection,
    rt: Arc<tokio::runtime::Runtime>,
}

impl RawConn {
    /// The certificate the server presented (DER), leaf first.
    pub fn server_chain(&self) -> Vec<Vec<u8>> {
        ballast_shared::tls::peer_chain(&self.conn)
            .map(|chain| chain.iter().map(|c| c.to_vec()).collect())
            .unwrap_or_default()
    }

    /// Runs `fut` on the runtime, failing after [`TIMEOUT`].
    fn bounded<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        self.rt.block_on(async move {
            tokio::time::timeout(TIMEOUT, fut)
                .await
                .unwrap_or_else(|_| Err(format!("{what} timed out after {TIMEOUT:?}")))
        })
    }

    /// Sends `hello` as the first frame on a bidirectional stream and reads the answer
    /// (a `Welcome` or a `Reject`).
    pub fn hello(&self, hello: &Hello) -> Result<Message, String> {
        let conn = self.conn.clone();
        let msg = Message::Hello(hello.clone());
        self.bounded("the hello exchange", async move {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| format!("open: {e}"))?;
            frame::write(&mut send, &msg)
                .await
                .map_err(|e| format!("write hello: {e}"))?;
            let _ = send.finish();
            frame::read(&mut recv)
                .await
                .map_err(|e| format!("read answer: {e}"))
        })
    }

    /// Writes raw bytes as the first thing on a new bidirectional stream, then finishes
    /// it. The answer, if any, is not read.
    pub fn send_stream_bytes(&self, bytes: &[u8]) -> Result<(), String> {
        let conn = self.conn.clone();
        let bytes = bytes.to_vec();
        self.bounded("writing on a stream", async move {
            let (mut send, _recv) = conn.open_bi().await.map_err(|e| format!("open: {e}"))?;
            send.write_all(&bytes)
                .await
                .map_err(|e| format!("write: {e}"))?;
            let _ = send.finish();
            // Keep the stream open until the bytes are out.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(())
        })
    }

    /// Sends one datagram.
    pub fn send_datagram(&self, bytes: &[u8]) -> Result<(), String> {
        let _guard = self.rt.enter();
        self.conn
            .send_datagram(bytes.to_vec().into())
            .map_err(|e| format!("send datagram: {e}"))
    }

    /// The next datagram from the server, if one comes within `timeout`.
    pub fn recv_datagram(&self, timeout: Duration) -> Option<Vec<u8>> {
        let conn = self.conn.clone();
        self.rt.block_on(async move {
            match tokio::time::timeout(timeout, conn.read_datagram()).await {
                Ok(Ok(b)) => Some(b.to_vec()),
                _ => None,
            }
        })
    }

    /// The largest datagram the connection can send now.
    pub fn max_datagram_size(&self) -> Option<usize> {
        self.conn.max_datagram_size()
    }

    /// Waits at most `timeout` for the connection to close; returns why it closed, or
    /// `None` if it is still open.
    pub fn wait_closed(&self, timeout: Duration) -> Option<quinn::ConnectionError> {
        let conn = self.conn.clone();
        self.rt
            .block_on(async move { tokio::time::timeout(timeout, conn.closed()).await.ok() })
    }

    /// Why it closed, if it has.
    pub fn close_reason(&self) -> Option<quinn::ConnectionError> {
        self.conn.close_reason()
    }

    /// Lets the runtime drive the connection for `d` (acks, keep-alives, incoming
    /// datagrams), e.g. after a burst of sends.
    pub fn pump(&self, d: Duration) {
        self.rt.block_on(async move { tokio::time::sleep(d).await });
    }
}

impl Drop for RawConn {
    fn drop(&mut self) {
        self.conn.close(0u32.into(), b"test done");
    }
}
