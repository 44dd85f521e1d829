//! A load generator for the benches: many QUIC agent connections in one process, each
//! with its own client certificate, each opening with the real session (hello,
//! welcome) driven by [`ClientSession`], then sending reports at a rate the caller
//! sets and can change. The ingest bench points it at an aggregator or a bare quinn
//! server, the relay bench at a relay or a primary.
//!
//! Every connection is a tokio task on the caller's runtime; the counters in [`Stats`]
//! say what was sent, answered and lost.

use ballast_shared::protocol::{self, Protocol};
use ballast_shared::session::driver::{now, until};
use ballast_shared::session::{
    close, proof, ClientConfig, ClientEvent, ClientSession, Measurement,
};
use ballast_shared::tls::{self, CertificateDer, Identity};
use ballast_shared::wire::Hello;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};
use tokio::time::MissedTickBehavior;

/// The encoded size of the reports the generator sends (`docs/performance.md`).
pub const REPORT_BYTES: usize = 13;
/// Handshakes the generator has in flight at once.
const HANDSHAKES_AT_ONCE: usize = 32;
/// How long one connection may take to be welcomed, handshake included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the generator could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A client socket could not be bound.
    #[error("cannot bind a client socket: {0}")]
    Bind(#[from] std::io::Error),
    /// Fewer identities than connections were asked for.
    #[error("{identities} identities for {connections} connections")]
    Identities {
        /// Identities given.
        identities: usize,
        /// Connections asked for.
        connections: usize,
    },
}

/// What the connections have done so far.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections welcomed.
    pub connected: AtomicUsize,
    /// Connections that failed twice and were given up.
    pub failed: AtomicUsize,
    /// Connections that failed once and were opened again.
    pub retried: AtomicUsize,
    /// Connections lost after their welcome.
    pub lost: AtomicUsize,
    /// Reports sent.
    pub sent: AtomicU64,
    /// Reports that could not be made or sent.
    pub send_errors: AtomicU64,
    /// Reports whose encoding was not [`REPORT_BYTES`] long.
    pub odd_reports: AtomicU64,
    /// Replies the sessions took.
    pub replies: AtomicU64,
    /// The shortest reply, in bytes.
    pub reply_min: AtomicUsize,
    /// The longest reply, in bytes.
    pub reply_max: AtomicUsize,
    /// The first failure, in words.
    pub first_error: Mutex<Option<String>>,
}

impl Stats {
    fn fail(&self, why: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(why);
    }

    /// The first failure, if any.
    pub fn first_error(&self) -> Option<String> {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Where the connections go and who they are.
#[derive(Clone)]
pub struct Target {
    /// The server's QUIC address.
    pub server: SocketAddr,
    /// The name its certificate is checked against.
    pub server_name: String,
    /// The CA the server's certificate chains to.
    pub ca: Arc<Vec<CertificateDer<'static>>>,
    /// One client identity per connection, by index; connection `i` is node
    /// `node_name(i)`.
    pub identities: Arc<Vec<Identity>>,
    /// The service of connection `i`: `services[i % services.len()]`.
    pub services: Arc<Vec<String>>,
    /// Whether each connection speaks as today's agent: every protocol version
    /// offered, the hello stream kept open, and a relay's challenges answered with the
    /// certificate's key (a relay admits no agent otherwise). Without it, the
    /// connections speak the previous version, which a bare QUIC server answers too
    /// (the ingest bench compares the two on it).
    pub current: bool,
}

/// The node name of connection `i`, which its certificate must carry.
pub fn node_name(i: usize) -> String {
    format!("load-{i}")
}

/// A running generator.
pub struct Load {
    /// What its connections have done.
    pub stats: Arc<Stats>,
    /// The rate per connection in reports per second (0 pauses); `None` closes every
    /// connection.
    control: watch::Sender<Option<u32>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    endpoints: Vec<quinn::Endpoint>,
    gate: Arc<Semaphore>,
    target: Target,
}

impl Load {
    /// Opens `n` connections to the target, each reporting at `hz` from its welcome
    /// on, and returns once every one is welcomed or has failed.
    pub async fn start(target: Target, n: usize, hz: u32) -> Result<Load, LoadError> {
        let (control, _) = watch::channel(Some(hz));
        // A few client sockets, so that receiving is spread over the runtime's threads.
        let any: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
        let endpoints = (0..(n / 250).clamp(4, 40))
            .map(|_| quinn::Endpoint::client(any))
            .collect::<Result<Vec<_>, _>>()?;
        let mut load = Load {
            stats: Arc::new(Stats {
                reply_min: AtomicUsize::new(usize::MAX),
                ..Stats::default()
            }),
            control,
            tasks: Vec::new(),
            endpoints,
            gate: Arc::new(Semaphore::new(HANDSHAKES_AT_ONCE)),
            target,
        };
        load.grow(n).await?;
        Ok(load)
    }

    /// Opens connections until there are `n`, at the rate in force, and returns once
    /// every one is welcomed or has failed.
    pub async fn grow(&mut self, n: usize) -> Result<(), LoadError> {
        let from = self.tasks.len();
        if from >= n {
            return Ok(());
        }
        if self.target.identities.len() < n || self.target.services.is_empty() {
            return Err(LoadError::Identities {
                identities: self.target.identities.len(),
                connections: n,
            });
        }
        for i in from..n {
            let (Some(endpoint), Some(identity), Some(service)) = (
                self.endpoints.get(i % self.endpoints.len()),
                self.target.identities.get(i),
                self.target.services.get(i % self.target.services.len()),
            ) else {
                continue;
            };
            let agent = Agent {
                index: i,
                endpoint: endpoint.clone(),
                server: self.target.server,
                server_name: self.target.server_name.clone(),
                service: service.clone(),
                identity: identity.clone(),
                ca: self.target.ca.clone(),
                current: self.target.current,
                stats: self.stats.clone(),
            };
            let task = agent.run(self.gate.clone(), self.control.subscribe());
            self.tasks.push(tokio::spawn(task));
        }
        let started = Instant::now();
        let mut said = Instant::now();
        loop {
            let (ok, failed) = self.outcome();
            if ok + failed >= n {
                break;
            }
            if said.elapsed() > Duration::from_secs(5) {
                eprintln!(
                    "  connecting: {ok} of {n} welcomed, {failed} failed, {:.0} s",
                    started.elapsed().as_secs_f64()
                );
                said = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "  {} of {n} connections welcomed ({} new in {:.1} s)",
            self.outcome().0,
            n - from,
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Connections welcomed and failed so far.
    pub fn outcome(&self) -> (usize, usize) {
        (
            self.stats.connected.load(Ordering::Relaxed),
            self.stats.failed.load(Ordering::Relaxed),
        )
    }

    /// How many connections were started.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// The local ports of the generator's client sockets.
    pub fn ports(&self) -> Vec<u16> {
        self.endpoints
            .iter()
            .filter_map(|e| e.local_addr().ok())
            .map(|a| a.port())
            .collect()
    }

    /// Whether none were.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Stops sending reports; the connections stay open.
    pub fn pause(&self) {
        self.control.send_replace(Some(0));
    }

    /// Sends reports again, at `hz` per connection.
    pub fn resume(&self, hz: u32) {
        self.control.send_replace(Some(hz));
    }

    /// Closes every connection and waits, briefly, for the closes to leave.
    pub async fn stop(self) {
        self.control.send_replace(None);
        for mut task in self.tasks {
            if tokio::time::timeout(Duration::from_secs(2), &mut task)
                .await
                .is_err()
            {
                // Still connecting, or its close is stuck: given up.
                task.abort();
            }
        }
        for e in &self.endpoints {
            e.close(close::NORMAL.into(), b"bench done");
        }
        for e in &self.endpoints {
            let _ = tokio::time::timeout(Duration::from_secs(2), e.wait_idle()).await;
        }
    }
}

/// One load connection: what it needs to connect and report.
struct Agent {
    index: usize,
    endpoint: quinn::Endpoint,
    server: SocketAddr,
    server_name: String,
    service: String,
    identity: Identity,
    ca: Arc<Vec<CertificateDer<'static>>>,
    current: bool,
    stats: Arc<Stats>,
}

impl Agent {
    async fn run(self, gate: Arc<Semaphore>, mut control: watch::Receiver<Option<u32>>) {
        // A second attempt when the first fails, as an agent reconnects.
        let mut attempts = 0;
        // The hello stream, held open for the connection's life (today's protocol).
        let (conn, mut session, _hello_stream) = loop {
            attempts += 1;
            let permit = gate.clone().acquire_owned().await;
            let opened = tokio::time::timeout(CONNECT_TIMEOUT, self.connect()).await;
            drop(permit);
            let why = match opened {
                Ok(Ok(c)) => break c,
                Ok(Err(e)) => e,
                Err(_) => format!("not welcomed within {CONNECT_TIMEOUT:?}"),
            };
            if attempts == 2 {
                let node = node_name(self.index);
                return self.stats.fail(format!("{node}: {why} (twice)"));
            }
            self.stats.retried.fetch_add(1, Ordering::Relaxed);
        };
        self.stats.connected.fetch_add(1, Ordering::Relaxed);
        let mut numbered = 0u32;
        let mut ticker = self.schedule(*control.borrow_and_update());
        loop {
            tokio::select! {
                changed = control.changed() => {
                    let rate = *control.borrow_and_update();
                    if changed.is_err() || rate.is_none() {
                        break;
                    }
                    ticker = self.schedule(rate);
                }
                due = tick(&mut ticker) => {
                    for _ in 0..due {
                        self.send(&conn, &mut session, &mut numbered);
                    }
                }
                datagram = conn.read_datagram() => match datagram {
                    Ok(bytes) => {
                        if session.handle_datagram(now(), &bytes).is_ok() {
                            self.stats.replies.fetch_add(1, Ordering::Relaxed);
                            self.stats.reply_min.fetch_min(bytes.len(), Ordering::Relaxed);
                            self.stats.reply_max.fetch_max(bytes.len(), Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        self.stats.lost.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                },
            }
        }
        session.close();
        conn.close(close::NORMAL.into(), b"bench done");
    }

    /// The handshake and the session's hello, as an agent opens them.
    #[allow(clippy::type_complexity)]
    async fn connect(
        &self,
    ) -> Result<
        (
            quinn::Connection,
            ClientSession,
            Option<(quinn::SendStream, quinn::RecvStream)>,
        ),
        String,
    > {
        let client = if self.current {
            tls::client_config_with_alpns(
                self.identity.clone(),
                &self.ca,
                &protocol::alpns(&Protocol::ALL),
            )
        } else {
            tls::client_config(self.identity.clone(), &self.ca)
        }
        .map_err(|e| format!("client config: {e}"))?;
        let conn = self
            .endpoint
            .connect_with(client, self.server, &self.server_name)
            .map_err(|e| format!("connect: {e}"))?
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let hello = Hello {
            node: node_name(self.index),
            service: self.service.clone(),
            address: format!("127.0.0.1:{}", 1 + self.index),
            zone: String::new(),
            version: ballast_shared::VERSION.into(),
        };
        let config = ClientConfig {
            protocol: Protocol::negotiated(&conn).unwrap_or(Protocol::CURRENT),
            ..ClientConfig::default()
        };
        let mut session = ClientSession::new(hello, config, now());
        if self.current {
            let key =
                proof::signing_key(&self.identity.key).map_err(|e| format!("signing key: {e}"))?;
            session = session.with_key(key);
        }
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| format!("stream: {e}"))?;
        let frame = session.hello_frame().map_err(|e| e.to_string())?;
        send.write_all(&frame)
            .await
            .map_err(|e| format!("hello: {e}"))?;
        let keep_open = config.protocol == Protocol::CURRENT;
        if !keep_open {
            let _ = send.finish();
        }
        let mut buf = [0u8; 512];
        loop {
            let read = tokio::select! {
                r = recv.read(&mut buf) => r,
                _ = until(session.poll_timeout()) => {
                    session.handle_timeout(now()).map_err(|e| e.to_string())?;
                    continue;
                }
            };
            let event = match read {
                Ok(Some(n)) => session.handle_stream(now(), buf.get(..n).unwrap_or_default()),
                Ok(None) | Err(_) => session.handle_stream_end().map(|()| None),
            };
            // A relay's challenge answered: the proof goes out on the stream.
            let out = session.take_stream_out();
            if !out.is_empty() {
                send.write_all(&out)
                    .await
                    .map_err(|e| format!("proof: {e}"))?;
            }
            match event {
                Ok(Some(ClientEvent::Welcomed { .. })) => {
                    return Ok((conn, session, keep_open.then_some((send, recv))))
                }
                Ok(_) if session.is_closed() => return Err("no welcome".into()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// One report: numbered by the session, with an in-flight count that keeps the
    /// encoding at [`REPORT_BYTES`] (the sequence number takes 1 byte below 251 and 3
    /// above; so does the count).
    fn send(&self, conn: &quinn::Connection, session: &mut ClientSession, numbered: &mut u32) {
        let seq = numbered.wrapping_add(1);
        let m = Measurement {
            cpu: 0.42,
            inflight: if seq < 251 { 1000 } else { 17 },
            ..Measurement::default()
        };
        let Ok(bytes) = session.report(m) else {
            self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        *numbered = seq;
        if bytes.len() != REPORT_BYTES {
            self.stats.odd_reports.fetch_add(1, Ordering::Relaxed);
        }
        match conn.send_datagram(bytes.into()) {
            Ok(()) => self.stats.sent.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.stats.send_errors.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// A timer for `hz` reports a second: one per tick up to 100 Hz, then several per
    /// 10 ms tick (which QUIC then packs into shared packets). Each connection's ticks
    /// are offset by a golden-ratio step per index, so that the reports of any number
    /// of connections are spread evenly over the period.
    fn schedule(&self, hz: Option<u32>) -> Option<(tokio::time::Interval, u32)> {
        let hz = hz.filter(|&h| h > 0)?;
        let per_tick = hz.div_ceil(100);
        let period = Duration::from_secs_f64(f64::from(per_tick) / f64::from(hz));
        let phase = (self.index as f64 * 0.618_033_988_749_895).fract();
        let offset = period.mul_f64(phase);
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
        t.set_missed_tick_behavior(MissedTickBehavior::Skip);
        Some((t, per_tick))
    }
}

/// Waits for the next tick; forever without a timer.
async fn tick(ticker: &mut Option<(tokio::time::Interval, u32)>) -> u32 {
    match ticker {
        Some((t, per_tick)) => {
            t.tick().await;
            *per_tick
        }
        None => std::future::pending().await,
    }
}
