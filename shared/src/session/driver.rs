//! What both async drivers of the session machines need of tokio: the machines' idea
//! of now, and a sleep until their next deadline. Kept apart from the machines, which
//! take the time as an argument and never read a clock.

use std::time::Instant;

/// The time now, in the machines' terms. Read from tokio's clock, so that it follows a
/// paused runtime in tests.
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Sleeps until `deadline`; forever when there is none, so that a `select!` arm on it
/// never fires.
pub async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
