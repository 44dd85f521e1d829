//! The one place the daemon reads time; the balancing core only ever receives it.

use ballast_balance::Millis;
use std::time::Instant;

/// Milliseconds since the daemon started, on a monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        Clock {
            start: Instant::now(),
        }
    }

    /// Milliseconds since start.
    pub fn now(&self) -> Millis {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Milliseconds since the Unix epoch, on the wall clock: for what must mean the
    /// same after a restart (the end of an operator's hold).
    pub fn wall(&self) -> ballast_balance::WallMillis {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}
