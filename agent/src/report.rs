//! The report loop: connect to an aggregator, say hello, then send one report per
//! interval as a QUIC datagram and keep the weight each reply carries.
//!
//! Aggregators are tried in order; a failed or lost connection moves on to the next
//! after a jittered exponential backoff, so a restarted aggregator is found again and
//! a fleet of agents does not reconnect in lockstep.

use crate::daemon::Shared;
use crate::sample::Sampler;
use ballast_shared::frame;
use ballast_shared::wire::{self, Message, NodeState, Reject, Report};
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long a connection attempt or the hello exchange may take. Short, because a
/// dead aggregator first in the list delays failover by this much.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Replies missed in a row before the connection counts as dead. QUIC's idle timeout
/// would notice too, but only after 10 s of lost reports; the replies say sooner.
const MISSED_REPLIES: u32 = 3;

/// Why a session with an aggregator ended.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
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
    /// The hello exchange failed.
    #[error("hello: {0}")]
    Frame(#[from] frame::FrameError),
    /// The aggregator refused this node.
    #[error("rejected: {} ({})", .0.reason, .0.detail)]
    Rejected(Reject),
    /// The aggregator answered the hello with something else.
    #[error("unexpected answer to hello")]
    Unexpected,
    /// Nothing came back in time.
    #[error("timed out")]
    Timeout,
}

/// Jittered exponential backoff ("full jitter"): each wait is uniform between zero and
/// a ceiling that doubles per failure up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    /// A backoff starting at `base` and capped at `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            failures: 0,
        }
    }

    /// The next wait.
    pub fn next_delay(&mut self, rng: &mut impl Rng) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.failures.min(16))
            .min(self.max);
        self.failures = self.failures.saturating_add(1);
        ceiling.mul_f64(rng.gen_range(0.0..=1.0))
    }

    /// Back to the shortest wait, after a good session.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// Runs until `shutdown` turns true.
pub async fn run(
    shared: Arc<Shared>,
    mut sampler: Sampler,
    client: quinn::ClientConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let cfg = shared.config.clone();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut rng = rand::rngs::SmallRng::from_entropy();
    let mut next = 0usize;
    while !*shutdown.borrow() {
        let target = &cfg.aggregators[next % cfg.aggregators.len()];
        next = next.wrapping_add(1);
        let outcome = session(&shared, &mut sampler, &client, target, &mut shutdown).await;
        shared.update(|s| s.connected_to = None);
        match outcome {
            Ok(true) => backoff.reset(),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(aggregator = %target, error = %e, "aggregator session failed");
                shared.update(|s| {
                    s.connect_failures += 1;
                    s.last_error = Some(format!("{target}: {e}"));
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

fn host_part(target: &str) -> &str {
    let host = target.rsplit_once(':').map(|(h, _)| h).unwrap_or(target);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// One connection's life. `Ok(true)`: it was established and then ended; `Ok(false)`:
/// shutdown was asked for.
async fn session(
    shared: &Shared,
    sampler: &mut Sampler,
    client: &quinn::ClientConfig,
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
    endpoint.set_default_client_config(client.clone());
    let server_name = shared
        .config
        .server_name
        .clone()
        .unwrap_or_else(|| host_part(target).to_string());
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect(addr, &server_name)?)
        .await
        .map_err(|_| SessionError::Timeout)??;
    let (mut send, mut recv) = conn.open_bi().await?;
    frame::write(&mut send, &Message::Hello(shared.config.hello())).await?;
    let _ = send.finish();
    let mut interval_ms = match tokio::time::timeout(CONNECT_TIMEOUT, frame::read(&mut recv)).await
    {
        Err(_) => return Err(SessionError::Timeout),
        Ok(Ok(Message::Welcome(w))) => w.interval_ms,
        Ok(Ok(Message::Reject(r))) => return Err(SessionError::Rejected(r)),
        Ok(Ok(_)) => return Err(SessionError::Unexpected),
        Ok(Err(e)) => return Err(e.into()),
    };
    tracing::info!(aggregator = %target, interval_ms, "connected");
    shared.update(|s| {
        s.connected_to = Some(target.to_string());
        s.connections += 1;
        s.last_error = None;
    });

    let mut seq = 0u32;
    let mut tick = ticker(interval_ms);
    let mut last_reply = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let silence = Duration::from_millis(u64::from(interval_ms) * u64::from(MISSED_REPLIES));
                if last_reply.elapsed() > silence + Duration::from_secs(1) {
                    tracing::info!(aggregator = %target, "no reply to {MISSED_REPLIES} reports: reconnecting");
                    conn.close(0u32.into(), b"no replies");
                    return Ok(true);
                }
                seq = seq.wrapping_add(1);
                if let Some(bytes) = build_report(shared, sampler, seq) {
                    let ok = conn.send_datagram(bytes.into()).is_ok();
                    shared.update(|s| if ok { s.reports_sent += 1 } else { s.reports_failed += 1 });
                }
            }
            datagram = conn.read_datagram() => {
                let bytes = match datagram {
                    Ok(b) => b,
                    Err(e) => return match e {
                        quinn::ConnectionError::LocallyClosed => Ok(false),
                        other => {
                            tracing::info!(aggregator = %target, error = %other, "connection lost");
                            Ok(true)
                        }
                    },
                };
                if let Ok(Message::Reply(r)) = wire::decode(&bytes) {
                    last_reply = tokio::time::Instant::now();
                    shared.synthetic.set_weight(f64::from(r.weight));
                    shared.update(|s| {
                        s.weight = Some(f64::from(r.weight));
                        s.weight_cycle = Some(r.cycle);
                        s.weight_unix_ms = Some(ballast_shared::unix_ms());
                        s.drain_acknowledged = r.draining;
                        s.aggregator_load = Some(f64::from(r.load));
                        s.inflight_trusted = Some(r.inflight_trusted);
                    });
                    if r.interval_ms != interval_ms && (100..=60_000).contains(&r.interval_ms) {
                        interval_ms = r.interval_ms;
                        tick = ticker(interval_ms);
                    }
                }
            }
            _ = shutdown.changed() => {
                conn.close(0u32.into(), b"agent stopping");
                endpoint.wait_idle().await;
                return Ok(false);
            }
        }
    }
}

fn ticker(interval_ms: u32) -> tokio::time::Interval {
    let mut t = tokio::time::interval(Duration::from_millis(u64::from(interval_ms)));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// Samples and encodes one report. A failed sample sends nothing: a missing report is
/// handled by the aggregator, while a made-up zero would look like idleness.
fn build_report(shared: &Shared, sampler: &mut Sampler, seq: u32) -> Option<Vec<u8>> {
    let started = std::time::Instant::now();
    let result = sampler.sample();
    shared.metrics.observe_sample(started.elapsed());
    let sample = match result {
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
    let draining = shared.draining.load(Ordering::Relaxed);
    let now_ms = ballast_shared::unix_ms();
    let report = Report {
        seq,
        cpu: sample.cpu as f32,
        inflight: sample.inflight,
        capacity: sample.capacity,
        error_rate: sample.error_rate.map(|e| e as f32),
        state: if draining {
            NodeState::Draining
        } else {
            NodeState::Serving
        },
    };
    shared.update(|s| {
        s.last_load = Some(sample.load);
        s.last_cpu = Some(sample.cpu);
        s.last_inflight = Some(sample.inflight);
        s.inflight_detail = sampler.inflight_detail();
        s.last_report_unix_ms = Some(now_ms);
        s.inflight_zero_since_unix_ms = if sample.inflight == 0 {
            s.inflight_zero_since_unix_ms.or(Some(now_ms))
        } else {
            None
        };
    });
    wire::encode(&Message::Report(report)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn backoff_grows_caps_and_resets() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let waits: Vec<Duration> = (0..20).map(|_| b.next_delay(&mut rng)).collect();
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(5)));
        assert!(waits[0] <= Duration::from_millis(100));
        assert!(
            waits[10..].iter().any(|w| *w > Duration::from_secs(1)),
            "{waits:?}"
        );
        b.reset();
        assert!(b.next_delay(&mut rng) <= Duration::from_millis(100));
    }

    #[test]
    fn server_name_is_the_host_part() {
        assert_eq!(host_part("agg.example:7400"), "agg.example");
        assert_eq!(host_part("[::1]:7400"), "::1");
        assert_eq!(host_part("127.0.0.1:7400"), "127.0.0.1");
    }
}
