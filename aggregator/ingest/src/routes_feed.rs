//! The replica's side of a relay's routes connection ([`ROUTES_ALPN`]): it tells the
//! relay where each service is served, as this replica last read the cluster's keys.
//!
//! The relay is admitted as a trunk is: a certificate with the relay role, a name the
//! policy's `relays` list allows, a place among its identity's connections, and a
//! certificate that stays unrevoked and unexpired (checked again whenever the
//! revocation list changes, and at its expiry). The relay opens one bidirectional
//! stream and sends its open; from then on it only reads. Each new reading that
//! changes the routes is sent at once; an unchanged one at most every
//! [`ROUTES_CONFIRM`], which is what tells the relay that its routes are current. A
//! replica that reads nothing (etcd is away) sends nothing, and the relay sees its
//! routes fall behind.

use super::quic::{close, close_for, expires_in};
use super::revocation::Verdict;
use super::upstream::{Replica, Trunk};
use super::IngestMetrics;
use ballast_shared::trunk::routes::{RouteTable, RoutesMessage, ROUTES_ALPN, ROUTES_CONFIRM};
use ballast_shared::trunk::{encode_control, ControlReader, ToPrimary, MAX_CONTROL_FRAME};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long a relay has to open its stream and send its open.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a write may wait for the relay to read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a refused relay has to read why before its connection is closed.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

/// One reading of the cluster's keys, and when it was made.
#[derive(Debug, Clone)]
pub struct Reading {
    /// What the reading says.
    pub table: Arc<RouteTable>,
    /// When it was made.
    pub at: std::time::Instant,
}

/// The routes a replica serves: its readings of the cluster, `None` before the first
/// and whenever it is no member (its lease lost, or never granted).
pub type RoutesReceiver = watch::Receiver<Option<Reading>>;

/// A reading older than this is not sent: a replica that has read nothing for that long
/// (etcd is away) has nothing current to tell, and a relay that hears nothing moves on
/// to another.
const STALE_AFTER: std::time::Duration = ROUTES_CONFIRM.saturating_mul(2);

/// Why a routes connection ended.
type End = &'static str;

/// Whether `conn` negotiated the routes protocol.
pub(crate) fn is_routes(conn: &quinn::Connection) -> bool {
    ballast_shared::protocol::negotiated_alpn(conn).is_some_and(|a| a == ROUTES_ALPN)
}

/// Serves a relay's routes connection until it ends.
pub async fn serve<R: Replica>(replica: &R, trunk: Trunk<'_>) -> Result<(), End> {
    let Trunk {
        conn,
        metrics,
        ingest,
        place,
    } = trunk;
    let (chain, info, mut revocations) =
        super::primary_trunk::admit_relay_connection(conn, metrics, ingest, place, "routes")?;
    let (mut send, mut recv) = match tokio::time::timeout(OPEN_TIMEOUT, conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => return Err("closed before the open"),
        Err(_) => {
            metrics.reject_connection("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no routes stream");
            return Err("no routes stream");
        }
    };
    let mut buf = vec![0u8; MAX_CONTROL_FRAME];
    let mut reader = ControlReader::<ToPrimary>::new();
    let opened = tokio::time::timeout(OPEN_TIMEOUT, async {
        loop {
            match recv.read(&mut buf).await {
                Ok(Some(n)) => match reader.push(buf.get(..n).unwrap_or_default()) {
                    Ok(msgs) => {
                        if let Some(first) = msgs.into_iter().next() {
                            return Ok(first);
                        }
                    }
                    Err(e) => return Err(e.label()),
                },
                Ok(None) | Err(_) => return Err("closed"),
            }
        }
    })
    .await;
    match opened {
        Ok(Ok(ToPrimary::Open { relay, .. })) if relay == info.identity => {}
        Ok(Ok(ToPrimary::Open { relay, .. })) => {
            tracing::warn!(certificate = %info.identity, named = %relay, "routes refused: the relay names itself otherwise than its certificate");
            metrics.reject_connection("relay_name_mismatch");
            return refuse(conn, &mut send, "the relay's name is not its certificate's").await;
        }
        Ok(Ok(_)) => {
            metrics.reject_connection("unexpected_message");
            conn.close(
                close::PROTOCOL.into(),
                b"a routes stream starts with an open",
            );
            return Err("no open");
        }
        Ok(Err("closed")) => return Err("closed before the open"),
        Ok(Err(reason)) => {
            metrics.reject_connection(reason);
            conn.close(close::PROTOCOL.into(), b"a malformed open");
            return Err("a malformed open");
        }
        Err(_) => {
            metrics.reject_connection("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no open");
            return Err("no open");
        }
    }
    let Some(mut routes) = replica.cluster_routes() else {
        metrics.reject_connection("routes_not_served");
        return refuse(
            conn,
            &mut send,
            "this aggregator is no cluster member: it has no routes to give",
        )
        .await;
    };
    tracing::info!(relay = %info.identity, "a relay follows the routes");
    metrics.routes_feeds_open.inc();
    let result = Feed {
        conn,
        send: &mut send,
        metrics,
        last: None,
        too_large: false,
    }
    .run(&mut routes, &mut recv, &mut revocations, || {
        if expires_in(info.not_after_unix_s).is_zero() {
            return Some(Verdict::Expired);
        }
        match ingest.revocation.verdict(&chain) {
            Verdict::Valid => None,
            v => Some(v),
        }
    })
    .await;
    metrics.routes_feeds_open.dec();
    match result {
        Err(Ending::Credentials(v)) => Err(close_for(conn, metrics, &info.identity, v)),
        Err(Ending::Other(reason)) => Err(reason),
        Ok(()) => Ok(()),
    }
}

/// Sends why the relay is refused, waits a moment for it to read, and closes.
async fn refuse(
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    why: &str,
) -> Result<(), End> {
    if let Ok(frame) = encode_control(&RoutesMessage::Closed(why.to_string())) {
        let _ = tokio::time::timeout(WRITE_TIMEOUT, send.write_all(&frame)).await;
        let _ = send.finish();
        let _ = tokio::time::timeout(REFUSAL_GRACE, conn.closed()).await;
    }
    conn.close(close::REJECTED.into(), why.as_bytes());
    Err("refused")
}

/// How a feed ended badly.
enum Ending {
    /// The relay's certificate was revoked or expired.
    Credentials(Verdict),
    /// Anything else, for the log.
    Other(End),
}

/// One relay's feed of routes.
struct Feed<'a> {
    conn: &'a quinn::Connection,
    send: &'a mut quinn::SendStream,
    metrics: &'a IngestMetrics,
    /// The last table sent, and when.
    last: Option<(Arc<RouteTable>, Instant)>,
    /// Whether a table too large for the protocol was counted already.
    too_large: bool,
}

impl Feed<'_> {
    async fn run(
        &mut self,
        routes: &mut RoutesReceiver,
        recv: &mut quinn::RecvStream,
        revocations: &mut watch::Receiver<u64>,
        credentials: impl Fn() -> Option<Verdict>,
    ) -> Result<(), Ending> {
        let mut watching = true;
        let mut check = tokio::time::interval(Duration::from_secs(1));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sink = [0u8; 64];
        routes.mark_changed();
        loop {
            tokio::select! {
                changed = routes.changed() => {
                    if changed.is_err() {
                        // The replica is stopping.
                        self.conn.close(close::NORMAL.into(), b"shutting down");
                        return Ok(());
                    }
                    let reading = routes.borrow_and_update().clone();
                    if let Some(reading) = reading.filter(|r| r.at.elapsed() < STALE_AFTER) {
                        self.offer(reading.table).await?;
                    }
                }
                read = recv.read(&mut sink) => match read {
                    // The relay sends nothing after its open: bytes break the protocol.
                    Ok(Some(_)) => {
                        self.metrics.reject_connection("unexpected_message");
                        self.conn.close(close::PROTOCOL.into(), b"nothing follows the open");
                        return Err(Ending::Other("bytes after the open"));
                    }
                    Ok(None) | Err(_) => {
                        self.conn.close(close::NORMAL.into(), b"routes stream ended");
                        return Ok(());
                    }
                },
                changed = revocations.changed(), if watching => {
                    if changed.is_err() {
                        watching = false;
                        continue;
                    }
                    if let Some(v) = credentials() {
                        return Err(Ending::Credentials(v));
                    }
                }
                _ = check.tick() => {
                    if let Some(Verdict::Expired) = credentials() {
                        return Err(Ending::Credentials(Verdict::Expired));
                    }
                }
            }
        }
    }

    /// Sends `table` if it changes the routes, or if the last was sent a confirmation
    /// period ago.
    async fn offer(&mut self, table: Arc<RouteTable>) -> Result<(), Ending> {
        let due = match &self.last {
            None => true,
            Some((last, at)) => !last.same_routes(&table) || at.elapsed() >= ROUTES_CONFIRM,
        };
        if !due {
            return Ok(());
        }
        let frame = match encode_control(&RoutesMessage::Routes((*table).clone())) {
            Ok(f) => f,
            Err(e) => {
                // A cluster past the protocol's limits: the relay keeps what it had
                // and sees it fall behind.
                if !self.too_large {
                    tracing::error!(error = %e, "the cluster's routes do not fit the routes protocol");
                    self.metrics.reject_connection("routes_too_large");
                    self.too_large = true;
                }
                return Ok(());
            }
        };
        match tokio::time::timeout(WRITE_TIMEOUT, self.send.write_all(&frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Ending::Other("routes stream closed")),
            Err(_) => {
                self.metrics.reject_connection("trunk_stalled");
                self.conn
                    .close(close::PROTOCOL.into(), b"the relay stopped reading");
                return Err(Ending::Other("the relay stopped reading"));
            }
        }
        self.metrics.routes_sent.inc();
        self.last = Some((table, Instant::now()));
        Ok(())
    }
}
