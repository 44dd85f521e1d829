//! The report loop: connect to an aggregator, run a session with it, and publish what
//! it assigns this node.
//!
//! The session's rules (the hello, the welcome or reject, report numbering, replies,
//! interval changes, giving up on a silent aggregator) are the sans-IO
//! [`ClientSession`], shared with the aggregator's side of the protocol; this module is
//! its async driver: the QUIC connection, the timers, the sampler, and the status and
//! assignment the session's events update.
//!
//! Aggregators are tried in order; a failed or lost connection moves on to the next
//! after a jittered exponential backoff, so a restarted aggregator is found again and
//! a fleet of agents does not reconnect in lockstep.

use crate::sample::{Sample, SampleError, Sampler};
use crate::shared::Shared;
use ballast_shared::protocol::Protocol;
use ballast_shared::reconnect::{host_part, Backoff};
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::{
    self, Assignment, ClientConfig, ClientError, ClientEvent, ClientSession, Measurement,
};
use ballast_shared::tls::live::LiveTls;
use rand::SeedableRng;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a connection attempt may take. Short, because a dead aggregator first in
/// the list delays failover by this much.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one sample may take. Samples run on a blocking thread, so a slow one (a
/// Prometheus scrape whose DNS lookup hangs, a stuck netlink socket) never stalls the
/// agent-check, the control socket or QUIC; past this it counts as a failed sample.
/// Longer than the Prometheus scrape's own budgets (a second to connect, a second for
/// the response), so that its more precise error comes first when it applies.
pub(crate) const SAMPLE_TIMEOUT: Duration = Duration::from_secs(3);

/// The sampler, shared with the blocking thread that runs it. Its lock is held by a
/// sample in progress; a tick that finds it held skips its sample, so a stuck source
/// ties up one thread, not one per tick.
pub(crate) type SharedSampler = Arc<tokio::sync::Mutex<Sampler>>;

/// Why a sample gave no measurement.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MeasureError {
    /// A source failed.
    #[error(transparent)]
    Sample(#[from] SampleError),
    /// The sample did not finish in time; it goes on in the background.
    #[error("timed out after {} s (a source is stuck; samples are skipped until it returns)", .0.as_secs_f64())]
    TimedOut(Duration),
    /// The previous sample, which timed out, has not returned yet.
    #[error("skipped: the previous sample, which timed out, has not returned yet")]
    Busy,
    /// The sampling thread panicked or was cancelled.
    #[error("the sampling thread failed: {0}")]
    Thread(String),
}

/// Why a session with an aggregator ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    /// The address did not resolve.
    #[error("cannot resolve {0}")]
    Resolve(String),
    /// The local socket could not be made.
    #[error("local socket: {0}")]
    Socket(std::io::Error),
    /// QUIC could not start the connection.
    #[error("connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    /// The connection failed or was closed.
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// The hello could not be written.
    #[error("hello: {0}")]
    Write(#[from] quinn::WriteError),
    /// The answer to the hello could not be read.
    #[error("hello: {0}")]
    Read(#[from] quinn::ReadError),
    /// The session ended by its own rules: refused, timed out, silent, or a protocol
    /// fault.
    #[error(transparent)]
    Session(#[from] ClientError),
    /// The connection was not up in time.
    #[error("timed out")]
    Timeout,
}

/// The agent's TLS: the QUIC client configuration, which presents the certificate in
/// force at each handshake, and the files it comes from, which say when a new one is.
pub(crate) struct Tls {
    /// The client configuration.
    pub(crate) client: quinn::ClientConfig,
    /// The watched files; none for a configuration made in memory.
    pub(crate) live: Option<Arc<LiveTls>>,
    /// The certificate's key when no files are watched, if known: proofs to a
    /// relay's primary are signed with it.
    pub(crate) key: Option<Arc<dyn ballast_shared::session::proof::SigningKey>>,
}

impl Tls {
    /// The key of the certificate in force, to prove it through a relay.
    fn signing_key(&self) -> Option<Arc<dyn ballast_shared::session::proof::SigningKey>> {
        match &self.live {
            Some(live) => Some(live.signing_key()),
            None => self.key.clone(),
        }
    }
}

/// The session's stream, open both ways while the connection lasts: a relay sends its
/// primaries' challenges on it, and the agent its proofs.
struct HelloStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    /// Whether the aggregator's side is still open.
    reading: bool,
}

impl HelloStream {
    /// Writes what the session has for the stream (proofs).
    async fn flush(&mut self, s: &mut ClientSession) -> Result<(), SessionError> {
        let out = s.take_stream_out();
        if !out.is_empty() {
            self.send.write_all(&out).await?;
        }
        Ok(())
    }
}

/// Runs until `shutdown` turns true.
pub(crate) async fn run(
    shared: Arc<Shared>,
    sampler: Sampler,
    tls: Tls,
    mut shutdown: watch::Receiver<bool>,
) {
    let sampler: SharedSampler = Arc::new(tokio::sync::Mutex::new(sampler));
    let cfg = shared.config.clone();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut rng = rand::rngs::SmallRng::from_entropy();
    let mut next = 0usize;
    while !*shutdown.borrow() {
        let target = &cfg.aggregators[next % cfg.aggregators.len()];
        next = next.wrapping_add(1);
        let outcome = session(&shared, &sampler, &tls, target, &mut shutdown).await;
        shared.update(|s| s.connected_to = None);
        match outcome {
            Ok(true) => backoff.reset(),
            Ok(false) => {}
            Err(SessionError::Session(ClientError::Rejected(r)))
                if r.reason == ballast_shared::wire::RejectReason::NotOwner =>
            {
                // A cluster replica that does not serve this node's service: the next
                // aggregator in the list may. Routine, so no error and no rejection
                // in the status; the backoff still grows, so that a cluster with no
                // owner yet is not hammered.
                tracing::info!(aggregator = %target, detail = %r.detail,
                    "this aggregator serves another part of the cluster: trying the next");
            }
            Err(e) => {
                let rejection = rejection_of(&e, target);
                match &rejection {
                    Some(r) => tracing::error!(aggregator = %target, reason = %r.reason,
                        detail = %r.detail, "the aggregator refused this node"),
                    None => {
                        tracing::warn!(aggregator = %target, error = %e, "aggregator session failed")
                    }
                }
                shared.update(|s| {
                    s.connect_failures += 1;
                    s.last_error = Some(format!("{target}: {e}"));
                    if let Some(r) = rejection {
                        s.rejections += 1;
                        s.rejection = Some(r);
                    }
                });
            }
        }
        if *shutdown.borrow() {
            break;
        }
        let wait = backoff.next_delay(&mut rng);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => {}
        }
    }
}

async fn resolve(target: &str) -> Result<SocketAddr, SessionError> {
    tokio::net::lookup_host(target)
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .ok_or_else(|| SessionError::Resolve(target.to_string()))
}

/// A connection to `addr`, its hello sent and welcomed: the connection, its session
/// and the report interval the aggregator asked for.
async fn open(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    hello: ballast_shared::wire::Hello,
    tls: &Tls,
) -> Result<(quinn::Connection, ClientSession, Duration, HelloStream), SessionError> {
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect(addr, server_name)?)
        .await
        .map_err(|_| SessionError::Timeout)??;
    // The codec of the version the handshake chose; the rest of the agent sees
    // today's messages whatever the aggregator speaks.
    let config = ClientConfig {
        protocol: Protocol::negotiated(&conn).unwrap_or(Protocol::CURRENT),
        ..ClientConfig::default()
    };
    let mut s = ClientSession::new(hello, config, now());
    if let Some(key) = tls.signing_key() {
        s = s.with_key(key);
    }
    let (mut send, recv) = conn.open_bi().await?;
    send.write_all(&s.hello_frame()?).await?;
    if config.protocol != Protocol::CURRENT {
        // The previous protocol has nothing more to say on the stream.
        let _ = send.finish();
    }
    let mut stream = HelloStream {
        send,
        recv,
        reading: true,
    };
    let interval = welcome(&mut s, &mut stream).await?;
    Ok((conn, s, interval, stream))
}

/// When the certificate `live` has in force expires, in milliseconds since the Unix
/// epoch.
fn expiry_of(live: &LiveTls) -> Option<u64> {
    let chain = live.chain();
    let info = ballast_shared::tls::CertInfo::parse(chain.first()?).ok()?;
    u64::try_from(info.not_after_unix_s).ok()?.checked_mul(1000)
}

/// One connection's life. `Ok(true)`: it was established and then ended; `Ok(false)`:
/// shutdown was asked for.
///
/// A renewed certificate moves the session, make-before-break: a new connection is
/// made with it and welcomed while reports still go out on the old one; then the
/// reports go on, on the new connection's schedule taken over from the old, and the
/// old connection is closed. A move that fails leaves the old connection as it was.
async fn session(
    shared: &Shared,
    sampler: &SharedSampler,
    tls: &Tls,
    target: &str,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<bool, SessionError> {
    let addr = resolve(target).await?;
    let bind: SocketAddr = if addr.is_ipv6() {
        "[::]:0"
            .parse()
            .map_err(|_| SessionError::Resolve(target.into()))?
    } else {
        "0.0.0.0:0"
            .parse()
            .map_err(|_| SessionError::Resolve(target.into()))?
    };
    let mut endpoint = quinn::Endpoint::client(bind).map_err(SessionError::Socket)?;
    endpoint.set_default_client_config(tls.client.clone());
    let server_name = shared
        .config
        .server_name
        .clone()
        .unwrap_or_else(|| host_part(target).to_string());
    // Subscribed before the handshake: a certificate renewed during it moves the
    // session once it is up.
    let (mut renewed, mut renewals) = match &tls.live {
        Some(live) => (live.subscribe(), true),
        None => (watch::channel(0).1, false),
    };
    renewed.borrow_and_update();
    let (mut conn, mut s, interval, mut stream) =
        open(&endpoint, addr, &server_name, shared.config.hello(), tls).await?;
    let mut buf = [0u8; 512];
    let protocol = Protocol::negotiated(&conn).unwrap_or(Protocol::CURRENT);
    tracing::info!(aggregator = %target, interval_ms = interval.as_millis(), %protocol, "connected");
    shared.update(|st| {
        st.connected_to = Some(target.to_string());
        st.connections += 1;
        st.last_error = None;
        st.rejection = None;
    });
    let mut moving = None;

    loop {
        tokio::select! {
            _ = until(s.poll_timeout()) => match s.handle_timeout(now()) {
                Ok(Some(ClientEvent::ReportDue)) => {
                    // The sample runs off this thread; only a stop cuts the wait short.
                    let measured = tokio::select! {
                        m = measure(shared, sampler, SAMPLE_TIMEOUT) => m,
                        _ = shutdown.changed() => {
                            s.close();
                            conn.close(session::close::NORMAL.into(), b"agent stopping");
                            endpoint.wait_idle().await;
                            return Ok(false);
                        }
                    };
                    if let Some(m) = measured {
                        send_report(shared, m, &mut s, &conn);
                    }
                }
                Ok(_) => {}
                Err(ClientError::Silent { missed }) => {
                    tracing::info!(aggregator = %target, "no reply to {missed} reports: reconnecting");
                    conn.close(session::close::NORMAL.into(), b"no replies");
                    return Ok(true);
                }
                Err(e) => return Err(e.into()),
            },
            read = stream.recv.read(&mut buf), if stream.reading => match read {
                // A relay moving the agent to another primary: a challenge to answer.
                Ok(Some(n)) => {
                    s.handle_stream(now(), buf.get(..n).unwrap_or_default())?;
                    stream.flush(&mut s).await?;
                }
                // Finished (the aggregator has nothing more to say), or gone with the
                // connection, which the datagrams' end tells.
                Ok(None) | Err(_) => stream.reading = false,
            },
            datagram = conn.read_datagram() => {
                let bytes = match datagram {
                    Ok(b) => b,
                    Err(e) => return match e {
                        quinn::ConnectionError::LocallyClosed => Ok(false),
                        quinn::ConnectionError::ApplicationClosed(ref c)
                            if c.error_code.into_inner() == u64::from(session::close::MOVED) =>
                        {
                            tracing::info!(aggregator = %target,
                                "the service moved to another replica of the cluster: trying the next aggregator");
                            Ok(true)
                        }
                        // Closed over this node's certificate: a refusal to report.
                        quinn::ConnectionError::ApplicationClosed(ref c)
                            if close_reason(c.error_code.into_inner()).is_some() =>
                        {
                            Err(SessionError::Connection(e))
                        }
                        other => {
                            tracing::info!(aggregator = %target, error = %other, "connection lost");
                            Ok(true)
                        }
                    },
                };
                match s.handle_datagram(now(), &bytes) {
                    Ok(ClientEvent::Assigned { assignment, new_interval }) => {
                        assigned(shared, assignment);
                        if let Some(i) = new_interval {
                            tracing::info!(aggregator = %target, interval_ms = i.as_millis(), "report interval changed");
                        }
                    }
                    Ok(_) => {}
                    // One bad datagram is dropped; it does not cost the connection.
                    Err(e) => tracing::debug!(aggregator = %target, error = %e, "datagram dropped"),
                }
            }
            changed = renewed.changed(), if renewals && moving.is_none() => {
                if changed.is_err() {
                    // The watcher is gone: no certificate changes any more.
                    renewals = false;
                    continue;
                }
                tracing::info!(aggregator = %target,
                    "certificate renewed: opening a connection with it");
                moving = Some(Box::pin(open(&endpoint, addr, &server_name, shared.config.hello(), tls)));
            }
            moved = async {
                match moving.as_mut() {
                    Some(m) => m.await,
                    None => std::future::pending().await,
                }
            }, if moving.is_some() => {
                moving = None;
                match moved {
                    Ok((new_conn, mut new_s, _, new_stream)) => {
                        new_s.take_over(&s);
                        s.close();
                        s = new_s;
                        stream = new_stream;
                        let old = std::mem::replace(&mut conn, new_conn);
                        old.close(session::close::NORMAL.into(), b"certificate renewed");
                        tracing::info!(aggregator = %target,
                            "moved to the connection made with the renewed certificate");
                        let expires = tls.live.as_deref().and_then(expiry_of);
                        shared.update(|st| {
                            st.certificate_moves += 1;
                            st.certificate_expires_unix_ms = expires;
                        });
                    }
                    Err(e) => {
                        tracing::warn!(aggregator = %target, error = %e,
                            "could not move to a connection with the renewed certificate: \
                             the connection in force stays");
                        shared
                            .metrics
                            .certificate_move_failures
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            _ = shutdown.changed() => {
                s.close();
                conn.close(session::close::NORMAL.into(), b"agent stopping");
                endpoint.wait_idle().await;
                return Ok(false);
            }
        }
    }
}

/// Reads the aggregator's answer to the hello into the session until it welcomes the
/// node (the report interval), refuses it, breaks the protocol or runs out of time.
async fn welcome(
    s: &mut ClientSession,
    stream: &mut HelloStream,
) -> Result<Duration, SessionError> {
    let mut buf = [0u8; 512];
    loop {
        let read = tokio::select! {
            r = stream.recv.read(&mut buf) => r?,
            _ = until(s.poll_timeout()) => {
                s.handle_timeout(now())?;
                continue;
            }
        };
        let event = match read {
            Some(n) => s.handle_stream(now(), buf.get(..n).unwrap_or_default())?,
            None => {
                s.handle_stream_end()?;
                None
            }
        };
        // A relay's challenge comes before its welcome: the proof goes out now.
        stream.flush(s).await?;
        if let Some(ClientEvent::Welcomed { interval }) = event {
            return Ok(interval);
        }
        if read.is_none() {
            // Ended after a whole answer that was not a welcome: the session says why.
            return Err(ClientError::Closed.into());
        }
    }
}

/// The metric and status code of a connection the aggregator closed with `code`,
/// when it closed it over this node's hello or certificate.
fn close_reason(code: u64) -> Option<&'static str> {
    match u32::try_from(code).ok()? {
        session::close::REJECTED => Some("rejected"),
        session::close::REVOKED => Some("revoked"),
        session::close::EXPIRED => Some("expired"),
        _ => None,
    }
}

/// What a TLS alert that ended the handshake says about this node's certificate, or
/// about the protocol versions it offered.
fn alert_reason(alert: u8) -> (&'static str, &'static str) {
    match alert {
        120 => (
            "no_common_protocol",
            "the aggregator speaks none of the protocol versions this agent offers: the two \
             are more than one release apart; upgrade the older",
        ),
        44 => (
            "revoked",
            "the aggregator refused this node's certificate: it is revoked",
        ),
        45 => (
            "expired",
            "the aggregator refused this node's certificate: it has expired or is not valid yet",
        ),
        _ => (
            "certificate_refused",
            "the aggregator refused this node's certificate (not signed by a CA it trusts, \
             or unusable)",
        ),
    }
}

/// The refusal a failed session amounts to, if it was one: a reject of the hello, a
/// connection closed over the certificate, or a handshake the aggregator ended over
/// the certificate.
fn rejection_of(e: &SessionError, target: &str) -> Option<crate::status::Rejection> {
    let (reason, detail) = match e {
        SessionError::Session(ClientError::Rejected(r)) => (r.reason.to_string(), r.detail.clone()),
        SessionError::Connection(c)
        | SessionError::Write(quinn::WriteError::ConnectionLost(c))
        | SessionError::Read(quinn::ReadError::ConnectionLost(c)) => match c {
            quinn::ConnectionError::ApplicationClosed(close) => {
                let reason = close_reason(close.error_code.into_inner())?;
                // A reject's own reason came in its frame; this is a close without one.
                (
                    reason.to_string(),
                    String::from_utf8_lossy(&close.reason).into_owned(),
                )
            }
            quinn::ConnectionError::ConnectionClosed(close) => {
                let code = u64::from(close.error_code);
                if !(0x100..0x200).contains(&code) {
                    return None;
                }
                let (reason, words) = alert_reason(u8::try_from(code & 0xff).unwrap_or(0));
                (reason.to_string(), words.to_string())
            }
            _ => return None,
        },
        _ => return None,
    };
    Some(crate::status::Rejection {
        reason,
        detail,
        aggregator: target.to_string(),
        unix_ms: ballast_shared::unix_ms(),
    })
}

/// Keeps what the aggregator assigned, published to every subscriber (the status
/// shows it; the synthetic source follows its weight).
pub(crate) fn assigned(shared: &Shared, a: Assignment) {
    shared.publish_assignment(a);
}

/// Sends the session's next report, of measurement `m`. A failed sample sends
/// nothing (see [`measure`]): a missing report is handled by the aggregator, while a
/// made-up zero would look like idleness.
fn send_report(shared: &Shared, m: Measurement, s: &mut ClientSession, conn: &quinn::Connection) {
    #[cfg(feature = "gate-probe")]
    ballast_shared::gate_probe::spin("agent");
    let ok = match s.report(m) {
        Ok(bytes) => conn.send_datagram(bytes.into()).is_ok(),
        Err(e) => {
            tracing::warn!(error = %e, "report not sent");
            false
        }
    };
    shared.update(|st| {
        if ok {
            st.reports_sent += 1
        } else {
            st.reports_failed += 1
        }
    });
}

/// Takes one sample on a blocking thread, within `timeout`: the sample and the
/// in-flight detail it leaves. A sample still running from an earlier tick (it timed
/// out, its source is stuck) holds the sampler: this one is then skipped rather than
/// queued behind it.
pub(crate) async fn sample_off_thread(
    sampler: &SharedSampler,
    timeout: Duration,
) -> Result<(Sample, Option<String>), MeasureError> {
    let Ok(mut guard) = sampler.clone().try_lock_owned() else {
        return Err(MeasureError::Busy);
    };
    let task = tokio::task::spawn_blocking(move || {
        let sample = guard.sample()?;
        Ok((sample, guard.inflight_detail()))
    });
    match tokio::time::timeout(timeout, task).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(MeasureError::Thread(e.to_string())),
        Err(_) => Err(MeasureError::TimedOut(timeout)),
    }
}

/// Takes one sample (see [`sample_off_thread`]) and records it in the status; `None`
/// when it failed, timed out or was skipped, which counts as a failed sample.
pub(crate) async fn measure(
    shared: &Shared,
    sampler: &SharedSampler,
    timeout: Duration,
) -> Option<Measurement> {
    let started = Instant::now();
    let result = sample_off_thread(sampler, timeout).await;
    if !matches!(result, Err(MeasureError::Busy)) {
        shared.metrics.observe_sample(started.elapsed());
    }
    let (sample, detail) = match result {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "sample failed");
            shared.update(|s| {
                s.sample_errors += 1;
                s.last_error = Some(format!("sample: {e}"));
            });
            return None;
        }
    };
    let now_ms = ballast_shared::unix_ms();
    let now = Instant::now();
    shared.update(|s| {
        s.last_load = Some(sample.load);
        s.last_cpu = Some(sample.cpu);
        s.last_inflight = Some(sample.inflight);
        s.inflight_detail = detail;
        s.last_report_unix_ms = Some(now_ms);
        s.last_report_at = Some(now);
        if sample.inflight == 0 {
            s.inflight_zero_since_unix_ms = s.inflight_zero_since_unix_ms.or(Some(now_ms));
            s.inflight_zero_since = s.inflight_zero_since.or(Some(now));
        } else {
            s.inflight_zero_since_unix_ms = None;
            s.inflight_zero_since = None;
        }
    });
    Some(Measurement {
        cpu: sample.cpu,
        inflight: sample.inflight,
        capacity: sample.capacity,
        error_rate: sample.error_rate,
        draining: shared.draining.load(Ordering::Relaxed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-flight source that blocks, like a scrape whose DNS lookup hangs, until
    /// the test sends it a count.
    struct Stuck {
        counts: std::sync::mpsc::Receiver<u32>,
        calls: Arc<std::sync::atomic::AtomicU32>,
    }

    impl crate::sample::InflightSource for Stuck {
        fn sample(&mut self) -> Result<u32, SampleError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.counts
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| SampleError::NotFound("no count".into()))
        }
        fn describe(&self) -> String {
            "stuck".into()
        }
    }

    #[tokio::test]
    async fn a_stuck_sample_stalls_nothing_times_out_and_does_not_pile_up() {
        let shared = Shared::new(crate::config::AgentConfig::default());
        let (release, counts) = std::sync::mpsc::channel();
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let source = Stuck {
            counts,
            calls: calls.clone(),
        };
        let sampler: SharedSampler = Arc::new(tokio::sync::Mutex::new(Sampler::new(
            None,
            Some(Box::new(source)),
            10,
        )));
        // A task on the same (single) runtime thread keeps running meanwhile, as the
        // agent-check and the control socket must.
        let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = ticks.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    ticks.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        assert!(measure(&shared, &sampler, timeout).await.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "bounded by the timeout"
        );
        assert!(
            ticks.load(Ordering::SeqCst) >= 10,
            "the runtime ran other tasks during the sample: {} ticks",
            ticks.load(Ordering::SeqCst)
        );
        let st = shared.status();
        assert_eq!(st.sample_errors, 1);
        let err = st.last_error.unwrap_or_default();
        assert!(err.contains("timed out after 0.3 s"), "{err}");

        // The next tick finds the stuck sample still running: skipped at once, and no
        // second thread is spent on the stuck source.
        let started = Instant::now();
        assert!(measure(&shared, &sampler, timeout).await.is_none());
        assert!(started.elapsed() < Duration::from_millis(200));
        let st = shared.status();
        assert_eq!(st.sample_errors, 2);
        assert!(
            st.last_error
                .unwrap_or_default()
                .contains("has not returned yet"),
            "skipped"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        // Once the source returns, the ticks after it sample again.
        release.send(4).expect("the stuck sample is listening");
        release.send(2).expect("queued for the next sample");
        let deadline = Instant::now() + Duration::from_secs(5);
        let m = loop {
            if let Some(m) = measure(&shared, &sampler, timeout).await {
                break m;
            }
            assert!(Instant::now() < deadline, "never sampled again");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(m.inflight, 2);
        assert_eq!(shared.status().last_inflight, Some(2));
        assert!(shared.status().last_report_at.is_some());
        ticker.abort();
    }
}
