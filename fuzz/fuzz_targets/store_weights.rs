//! The routing store's file (`weights.json`) read back after corruption: the input
//! (real store files in the seeds, which the fuzzer flips, cuts and splices) is
//! written where the store reads, loaded as the aggregator loads it at start, then
//! restored into a balancer and published.
//!
//! Invariants: nothing panics; every weight read back is finite and not negative, and
//! so is every weight published from it; what was read writes back and reads again as
//! the same (decode∘encode round-trips).

#![no_main]

use ballast_aggregator::store::file::FileStore;
use ballast_aggregator::store::RoutingStore;
use ballast_balance::{Balancer, Params, Published};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;

struct Env {
    rt: tokio::runtime::Runtime,
    dir: PathBuf,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("ballast-fuzz-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        Env { rt, dir }
    })
}

fn check_weight(w: f64, what: &str) {
    assert!(w.is_finite() && w >= 0.0, "{what}: weight {w} read back");
}

fuzz_target!(|bytes: &[u8]| {
    let env = env();
    let path = env.dir.join("weights.json");
    std::fs::write(&path, bytes).expect("write the store file");
    let Ok(services) = env.rt.block_on(FileStore::new(&path).load()) else {
        return;
    };
    for (name, svc) in &services {
        for (node, ep) in &svc.endpoints {
            check_weight(ep.weight, &format!("{name}/{node}"));
            for (s, w) in &ep.strategy_weights {
                check_weight(*w, &format!("{name}/{node} {s:?}"));
            }
        }
    }
    // Written back, and read again: the same.
    let again = env.dir.join("again.json");
    let _ = std::fs::remove_file(&again);
    let store = FileStore::new(&again);
    env.rt
        .block_on(store.put(&services))
        .expect("what was read writes back");
    let back = env
        .rt
        .block_on(FileStore::new(&again).load())
        .expect("what was written reads");
    assert_eq!(back, services);
    // Restored and published, as at start.
    let mut b = Balancer::new(Params::default(), 0);
    b.restore(0, &services);
    let published = Published::default().next(&b, &BTreeSet::new(), &Default::default(), 0);
    for (name, svc) in &published.services {
        for (node, ep) in &svc.endpoints {
            check_weight(ep.weight, &format!("published {name}/{node}"));
        }
    }
});
