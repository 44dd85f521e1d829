//! What one agent connection, or one node, may cost: connections in all, sessions per
//! node (its direct connections and its attaches through relays' trunks together), and
//! datagrams or attaches per second. The checks are plain values the QUIC driver and
//! the trunks consult, so that a flood is dropped before it reaches the balancer's
//! lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Open connections in all, and sessions per node: a node's direct connections and
/// its agents attached through relays count together.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    total: AtomicUsize,
    per_node: Mutex<HashMap<String, usize>>,
}

/// One connection's place among the open ones; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    owner: Arc<Connections>,
    node: Option<NodePlace>,
}

/// One session's place among those of its node (a direct connection's, or an agent's
/// attached through a trunk); given back when dropped.
#[derive(Debug)]
pub(crate) struct NodePlace {
    owner: Arc<Connections>,
    node: String,
}

impl Connections {
    /// A place for a new connection, if fewer than `max` are open.
    pub(crate) fn open(self: &Arc<Self>, max: usize) -> Option<Slot> {
        self.total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(Slot {
            owner: self.clone(),
            node: None,
        })
    }

    /// A place among `node`'s sessions, if it holds fewer than `max`.
    pub(crate) fn claim(self: &Arc<Self>, node: &str, max: usize) -> Option<NodePlace> {
        let mut per = self.per_node();
        let n = per.entry(node.to_string()).or_insert(0);
        if *n >= max {
            if *n == 0 {
                per.remove(node);
            }
            return None;
        }
        *n += 1;
        Some(NodePlace {
            owner: self.clone(),
            node: node.to_string(),
        })
    }

    /// Connections open now, handshakes included.
    pub(crate) fn total(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    fn per_node(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // Plain counts, updated in single statements: a panic cannot leave them torn.
        self.per_node.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Slot {
    /// Counts this connection as `node`'s, if `node` holds fewer than `max`.
    pub(crate) fn claim(&mut self, node: &str, max: usize) -> bool {
        self.node = self.owner.claim(node, max);
        self.node.is_some()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.node = None;
        self.owner.total.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for NodePlace {
    fn drop(&mut self) {
        let mut per = self.owner.per_node();
        if let Some(n) = per.get_mut(&self.node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per.remove(&self.node);
            }
        }
    }
}

/// A token bucket: `rate` a second sustained, `burst` at once (`2 × rate` for a
/// connection's datagrams).
#[derive(Debug)]
pub(crate) struct Rate {
    tokens: f64,
    rate: f64,
    burst: f64,
    last: Instant,
}

impl Rate {
    /// Full, at `now`: `per_second` sustained, twice that in a burst.
    pub(crate) fn new(per_second: u32, now: Instant) -> Self {
        Rate::with_burst(per_second, per_second.saturating_mul(2), now)
    }

    /// Full, at `now`: `per_second` sustained, `burst` at once.
    pub(crate) fn with_burst(per_second: u32, burst: u32, now: Instant) -> Self {
        let rate = f64::from(per_second.max(1));
        let burst = f64::from(burst.max(1));
        Rate {
            tokens: burst,
            rate,
            burst,
            last: now,
        }
    }

    /// Whether one more datagram may be taken at `now`.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last);
        self.last = now;
        self.tokens = (self.tokens + dt.as_secs_f64() * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// How long an established connection may go without a report: the configured
/// timeout, and never less than five report intervals.
pub(crate) fn report_timeout(configured_ms: u64, interval_ms: u32) -> Duration {
    Duration::from_millis(configured_ms.max(5 * u64::from(interval_ms)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_capped_in_all_and_per_node_and_given_back() {
        let c = Arc::new(Connections::default());
        let mut a = c.open(3).expect("first");
        let mut b = c.open(3).expect("second");
        let third = c.open(3).expect("third");
        assert!(c.open(3).is_none(), "a fourth is over the cap");
        assert!(a.claim("web-1", 1));
        assert!(!b.claim("web-1", 1), "one per node");
        assert!(b.claim("web-2", 1));
        drop(third);
        assert_eq!(c.total(), 2);
        drop(a);
        let mut again = c.open(3).expect("a place is free again");
        assert!(again.claim("web-1", 1), "web-1's place was given back");
        drop((b, again));
        assert_eq!(c.total(), 0);
        assert!(c.per_node().is_empty());
    }

    #[test]
    fn a_nodes_sessions_count_together_whatever_carries_them() {
        let c = Arc::new(Connections::default());
        let mut direct = c.open(10).expect("a connection");
        assert!(direct.claim("web-1", 3));
        let relayed = c.claim("web-1", 3).expect("a relayed attach");
        let again = c.claim("web-1", 3).expect("another");
        assert!(
            c.claim("web-1", 3).is_none(),
            "a fourth session is over the cap"
        );
        let mut second = c.open(10).expect("a connection");
        assert!(
            !second.claim("web-1", 3),
            "direct ones count with relayed ones"
        );
        assert_eq!(c.total(), 2, "relayed attaches hold no connection");
        drop(relayed);
        assert!(second.claim("web-1", 3), "a place given back by an attach");
        drop((direct, second, again));
        assert!(c.per_node().is_empty());
        assert_eq!(c.total(), 0);
    }

    #[test]
    fn a_bucket_of_its_own_burst() {
        let t0 = Instant::now();
        let mut r = Rate::with_burst(100, 1000, t0);
        assert_eq!((0..5000).filter(|_| r.take(t0)).count(), 1000);
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!((0..5000).filter(|_| r.take(t1)).count(), 50);
    }

    #[test]
    fn the_bucket_allows_a_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut r = Rate::new(10, t0);
        let burst = (0..100).filter(|_| r.take(t0)).count();
        assert_eq!(burst, 20);
        // One second later: ten more.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!((0..100).filter(|_| r.take(t1)).count(), 10);
    }

    #[test]
    fn the_report_timeout_allows_five_intervals() {
        assert_eq!(report_timeout(30_000, 1000), Duration::from_secs(30));
        assert_eq!(report_timeout(30_000, 60_000), Duration::from_secs(300));
    }
}
