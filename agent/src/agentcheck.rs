//! The HAProxy agent-check responder.
//!
//! HAProxy connects to this port every `agent-inter`, reads one line and closes. The
//! line carries the weight the aggregator last gave this node, as a percentage of the
//! server's configured weight where 100 % is the fleet's mean weight, or `drain` while
//! the node is a lame duck.
//!
//! When the agent has no recent weight (the aggregator is unreachable), it answers
//! `ready up 100%`: the mean weight. An unreachable control plane must never drain or
//! down a whole fleet; falling back to plain round robin is the safe default.

use crate::counters::{AgentCheckReply, Refused};
use crate::shared::{accept, Shared};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;

/// A weight older than this many report intervals is stale.
pub(crate) const STALE_INTERVALS: u64 = 5;

/// Connections answered at once. The answer is one short line written at once, so a
/// connection holds its place for microseconds; only a flood reaches this, and the
/// connections past it are closed unanswered (HAProxy then keeps the server's last
/// state), so that a flood cannot grow the agent.
pub(crate) const MAX_CONNECTIONS: usize = 64;

/// How long one connection may take to have its line written and be closed.
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// The line to send now.
pub(crate) fn reply(shared: &Shared) -> String {
    reply_at(shared, Instant::now())
}

/// The line to send at `now`, on the monotonic clock: the weight counts as fresh by
/// its age on that clock, so a change of the wall clock cannot revive a stale one.
pub(crate) fn reply_at(shared: &Shared, now: Instant) -> String {
    let draining = shared.draining.load(Ordering::Relaxed);
    let status = shared.status();
    let max_age = Duration::from_millis(u64::from(shared.config.interval_ms) * STALE_INTERVALS);
    let weight = status.fresh_weight(now, max_age);
    shared.metrics.agentcheck_reply(match (draining, weight) {
        (true, _) => AgentCheckReply::Drain,
        (false, Some(_)) => AgentCheckReply::Weight,
        (false, None) => AgentCheckReply::Mean,
    });
    ballast_balance::load::haproxy_agent_reply(weight, draining)
}

/// Binds the responder's port; a bad address is an error at start.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Answers every connection with one line, then closes it; at most
/// [`MAX_CONNECTIONS`] at once, each within [`ANSWER_TIMEOUT`].
pub(crate) async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    serve_with(listener, shared, Arc::new(Semaphore::new(MAX_CONNECTIONS))).await
}

/// [`serve`] with the connections' places in `slots`: one permit per connection.
async fn serve_with(listener: tokio::net::TcpListener, shared: Arc<Shared>, slots: Arc<Semaphore>) {
    loop {
        let mut stream = accept(&listener).await;
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            shared.metrics.count_refusal(Refused::AgentCheckConnections);
            tracing::debug!("agent-check connection closed unanswered: {MAX_CONNECTIONS} open");
            continue; // dropped: closed unanswered
        };
        let line = reply(&shared);
        let shared = shared.clone();
        tokio::spawn(async move {
            let answered = tokio::time::timeout(ANSWER_TIMEOUT, async {
                let _ = stream.write_all(line.as_bytes()).await;
                let _ = stream.shutdown().await;
            })
            .await;
            if answered.is_err() {
                shared.metrics.count_refusal(Refused::AgentCheckTimeout);
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AgentConfig;
    use tokio::io::AsyncReadExt;

    fn shared() -> Arc<Shared> {
        Arc::new(Shared::new(AgentConfig::default()))
    }

    /// An assignment of `weight`, as a reply carries it.
    fn assignment(weight: f64) -> ballast_shared::session::Assignment {
        ballast_shared::session::Assignment {
            weight,
            cycle: 1,
            draining: false,
            load: 0.5,
            inflight_trusted: true,
        }
    }

    #[test]
    fn replies_follow_weight_drain_and_staleness() {
        let sh = shared();
        assert_eq!(reply(&sh), "ready up 100%\n", "no weight yet: the mean");
        sh.publish_assignment(assignment(1.5));
        assert_eq!(reply(&sh), "ready up 150%\n");
        sh.draining.store(true, Ordering::Relaxed);
        assert_eq!(reply(&sh), "drain\n");
        sh.draining.store(false, Ordering::Relaxed);
        // Five intervals of the default 1 s later, and a little more.
        let later = Instant::now() + Duration::from_millis(5_100);
        assert_eq!(
            reply_at(&sh, later),
            "ready up 100%\n",
            "a stale weight falls back to the mean"
        );
    }

    /// The wall clock jumps after the weight arrived: set back, the weight's stamp
    /// lies in the future and would look brand new; set forward, it would look
    /// ancient. The answer follows the monotonic age alone.
    #[test]
    fn a_wall_clock_jump_neither_revives_nor_expires_the_weight() {
        let sh = shared();
        let arrived = Instant::now();
        let hour = 3_600_000;
        for stamp in [0, ballast_shared::unix_ms() + hour, u64::MAX] {
            sh.publish_assignment(assignment(1.5));
            sh.update(|s| {
                s.weight_unix_ms = Some(stamp);
                s.weight_at = Some(arrived);
            });
            assert_eq!(
                reply_at(&sh, arrived + Duration::from_secs(60)),
                "ready up 100%\n",
                "a minute-old weight is stale, whatever its wall-clock stamp ({stamp})"
            );
            assert_eq!(
                reply_at(&sh, arrived + Duration::from_millis(500)),
                "ready up 150%\n",
                "a fresh weight is fresh, whatever its wall-clock stamp ({stamp})"
            );
        }
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_unanswered_and_counted() {
        let sh = shared();
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let slots = Arc::new(Semaphore::new(2));
        tokio::spawn(serve_with(listener, sh.clone(), slots.clone()));
        let read = |addr| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let mut line = String::new();
            let _ = s.read_to_string(&mut line).await;
            line
        };
        // Both places taken, as by two connections still being answered.
        let held = slots.clone().acquire_many_owned(2).await.expect("permits");
        assert_eq!(read(addr).await, "", "closed unanswered");
        assert_eq!(sh.metrics.refusals(Refused::AgentCheckConnections), 1);
        drop(held);
        assert_eq!(read(addr).await, "ready up 100%\n");
        assert_eq!(sh.metrics.refusals(Refused::AgentCheckConnections), 1);
    }

    #[tokio::test]
    async fn answers_one_line_per_connection() {
        let sh = shared();
        sh.publish_assignment(assignment(0.42));
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(serve(listener, sh));
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let mut line = String::new();
            s.read_to_string(&mut line).await.expect("read");
            assert_eq!(line, "ready up 42%\n");
        }
    }
}
