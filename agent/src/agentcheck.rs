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

use crate::counters::AgentCheckReply;
use crate::shared::{accept, Shared};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// A weight older than this many report intervals is stale.
pub(crate) const STALE_INTERVALS: u64 = 5;

/// The line to send now.
pub(crate) fn reply(shared: &Shared) -> String {
    let draining = shared.draining.load(Ordering::Relaxed);
    let status = shared.status();
    let max_age = u64::from(shared.config.interval_ms) * STALE_INTERVALS;
    let weight = status.fresh_weight(ballast_shared::unix_ms(), max_age);
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

/// Answers every connection with one line, then closes it.
pub(crate) async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    loop {
        let mut stream = accept(&listener).await;
        let line = reply(&shared);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                let _ = stream.write_all(line.as_bytes()).await;
                let _ = stream.shutdown().await;
            })
            .await;
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

    #[test]
    fn replies_follow_weight_drain_and_staleness() {
        let sh = shared();
        assert_eq!(reply(&sh), "ready up 100%\n", "no weight yet: the mean");
        sh.update(|s| {
            s.weight = Some(1.5);
            s.weight_unix_ms = Some(ballast_shared::unix_ms());
        });
        assert_eq!(reply(&sh), "ready up 150%\n");
        sh.draining.store(true, Ordering::Relaxed);
        assert_eq!(reply(&sh), "drain\n");
        sh.draining.store(false, Ordering::Relaxed);
        sh.update(|s| s.weight_unix_ms = Some(0));
        assert_eq!(
            reply(&sh),
            "ready up 100%\n",
            "a stale weight falls back to the mean"
        );
    }

    #[tokio::test]
    async fn answers_one_line_per_connection() {
        let sh = shared();
        sh.update(|s| {
            s.weight = Some(0.42);
            s.weight_unix_ms = Some(ballast_shared::unix_ms());
        });
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
