//! Bounded waiting. Every wait in the suite goes through here, so none is unbounded and
//! each timeout names what it was waiting for.

use std::time::{Duration, Instant};

/// How often conditions are polled.
pub const POLL: Duration = Duration::from_millis(100);

/// Polls `f` until it returns `Some`, for at most `timeout`. Panics on timeout with
/// `what` in the message.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    wait_for(timeout, what, || f().ok_or_else(String::new))
}

/// Polls `f` until it returns `Ok`, for at most `timeout`. On timeout, panics with
/// `what` and the last `Err` text, which should describe what was seen instead.
pub fn wait_for<T>(timeout: Duration, what: &str, f: impl FnMut() -> Result<T, String>) -> T {
    wait_for_polling(timeout, POLL, what, f)
}

/// [`wait_for`], polling every `poll`: for a wait that must see each step of
/// something that changes faster than [`POLL`].
pub fn wait_for_polling<T>(
    timeout: Duration,
    poll: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        let last = match f() {
            Ok(v) => return v,
            Err(e) => e,
        };
        if start.elapsed() >= timeout {
            if last.is_empty() {
                panic!("timed out after {timeout:?} waiting for {what}");
            }
            panic!("timed out after {timeout:?} waiting for {what}; last seen: {last}");
        }
        std::thread::sleep(poll);
    }
}

/// Checks `f` repeatedly for `duration`: it must hold every time. Panics with `what`
/// and the failure text as soon as it does not.
pub fn holds_for(duration: Duration, what: &str, mut f: impl FnMut() -> Result<(), String>) {
    let start = Instant::now();
    loop {
        if let Err(e) = f() {
            panic!("{what} stopped holding after {:?}: {e}", start.elapsed());
        }
        if start.elapsed() >= duration {
            return;
        }
        std::thread::sleep(POLL);
    }
}
