//! What a client that dials a server and dials again after losing it needs: the name
//! its TLS handshake checks the server's certificate against, and the jittered wait
//! between tries. The agent uses both towards its aggregators.

use rand::Rng;
use std::time::Duration;

/// Jittered exponential backoff ("full jitter"): each wait is uniform between zero and
/// a ceiling that doubles per failure up to `max`, so that a fleet of clients that lost
/// their server together does not come back in lockstep.
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

/// The host of a `host:port` address (brackets taken off an IPv6 literal): the server
/// name a certificate is checked against when none is configured.
pub fn host_part(target: &str) -> &str {
    let host = target.rsplit_once(':').map(|(h, _)| h).unwrap_or(target);
    host.trim_start_matches('[').trim_end_matches(']')
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
