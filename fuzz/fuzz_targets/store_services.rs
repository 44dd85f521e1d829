//! The persisted merged service config (`services.json`, and its backups) read back
//! after corruption: the input (real files in the seeds, which the fuzzer flips, cuts
//! and splices) read as the aggregator reads it at start and turned into the configs
//! in force.
//!
//! Invariants: nothing panics; every service read back has a name a scan of the
//! config directory could have taken, valid, finite, non-negative parameters and a
//! valid locality table, before and after its source is parsed again
//! against the defaults; what was read round-trips through JSON.

#![no_main]

use ballast_aggregator::config::dir::{Merged, ServiceConfigs};
use ballast_aggregator::config::locality;
use ballast_aggregator::fuzzing::services_file;
use ballast_balance::Params;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("ballast-fuzz-services-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    })
}

fuzz_target!(|bytes: &[u8]| {
    let path = scratch().join("services.json");
    std::fs::write(&path, bytes).expect("write the file");
    let Ok(merged) = services_file(&path) else {
        return;
    };
    for (name, entry) in &merged.services {
        // A name a scan of the directory could have taken: `restore` writes a file by
        // it.
        assert!(
            !name.is_empty() && name.len() <= 64 && ballast_shared::wire::is_valid_name(name),
            "service {name:?} read back"
        );
        ballast_fuzz::assert_params_sane(&entry.config.params, name);
        assert_eq!(locality::validate(&entry.config.locality), Ok(()));
    }
    let json = serde_json::to_vec(&merged).expect("serialises");
    let back: Merged = serde_json::from_slice(&json).expect("reads back");
    assert_eq!(back, merged);
    let defaults = Params::default();
    let configs = ServiceConfigs::new(merged, &defaults, 3 * 24 * 3600 * 1000);
    for (name, entry) in &configs.merged().services {
        ballast_fuzz::assert_params_sane(&entry.config.params, name);
        assert_eq!(locality::validate(&entry.config.locality), Ok(()));
        assert_eq!(configs.params(name), Some(&entry.config.params));
    }
});
