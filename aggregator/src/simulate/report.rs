//! Report (placeholder).
use super::{SimError, SimSummary};
use std::path::{Path, PathBuf};

/// Writes the outputs.
pub fn write(_dir: &Path, _s: &SimSummary) -> Result<Vec<PathBuf>, SimError> {
    Ok(Vec::new())
}
