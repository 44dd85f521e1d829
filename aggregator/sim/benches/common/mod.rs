//! What the benches share: where the release binaries are, and a process's CPU and
//! memory from `/proc` (`ballast_sim::procstat`).

use std::path::{Path, PathBuf};

/// The folder of the release binaries the benches start: a bench runs from
/// `target/release/deps/NAME-HASH`.
pub(crate) fn release_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().and_then(Path::parent).map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/release"))
}

/// The release binary `name`, or an exit with what to build first.
pub(crate) fn release_binary(name: &str) -> PathBuf {
    let path = release_dir().join(name);
    if !path.exists() {
        eprintln!(
            "{} is missing: run `cargo build --release --bins` first",
            path.display()
        );
        std::process::exit(1);
    }
    path
}

pub(crate) use ballast_sim::procstat::{cpu_seconds, status_mib};
