//! The gain sweep (placeholder until measured).
use super::SimError;

/// The sweep's results.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sweep {}

/// Runs the sweep.
pub fn sweep(_seed: u64, _quick: bool) -> Result<Sweep, SimError> {
    Ok(Sweep {})
}
