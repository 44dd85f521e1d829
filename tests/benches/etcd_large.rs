//! What a large service costs in etcd: a real aggregator (release build) on a real
//! etcd, with one service of 100,000 endpoints (by default) whose value changes every
//! cycle, measured for the bytes each write puts, the time one write takes (the
//! store's own `ballast_store_write_seconds`: every chunk and the fenced manifest), and
//! how fast etcd's database grows under it.
//!
//! The service is put in etcd beforehand in the store's chunked format, as an earlier
//! run of the aggregator would have left it; the aggregator restores it, and one agent
//! of the service drains and undrains every two cycles, so that every cycle publishes
//! a new value of the whole service, as a service of reporting endpoints does.
//!
//! ```sh
//! cargo build --release --workspace --bins --features ballast-aggregator/etcd
//! cargo bench -p ballast-tests --features ballast-aggregator/etcd --bench etcd_large
//! # -- --endpoints N --seconds S to change the run
//! ```
//!
//! It prints one line of figures, `etcd large service:`, which `docs/scale.md` keeps
//! with the date, and exits non-zero if a write failed or no write was measured.

use ballast_aggregator::store::chunks::{self, Manifest};
use ballast_tests::*;
use std::time::{Duration, Instant};

const PREFIX: &str = "/ballast-bench";
const SERVICE: &str = "big";

/// etcd's database size in bytes, as `etcdctl endpoint status` says.
fn db_size(etcd: &Etcd) -> u64 {
    let out = etcd
        .try_ctl(&["endpoint", "status", "-w", "json"])
        .unwrap_or_else(|e| panic!("{e}"));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v[0]["Status"]["dbSize"]
        .as_u64()
        .unwrap_or_else(|| panic!("no dbSize in {out}"))
}

fn main() {
    let endpoints = usize::try_from(bench_arg("--endpoints", 100_000)).unwrap_or(100_000);
    let seconds = bench_arg("--seconds", 30);
    require_etcd();
    let etcd = Etcd::start();

    // The service as a previous run stored it: chunks, then the manifest.
    let value = snapshot_value(endpoints, 7);
    let generation = "seed";
    let mut count = 0;
    for (i, piece) in chunks::split(&value).enumerate() {
        etcd.put_large(&chunks::chunk_key(PREFIX, SERVICE, generation, i), piece);
        count += 1;
    }
    etcd.put_large(
        &format!("{PREFIX}/services/{SERVICE}"),
        &Manifest::new(generation, count, value.len()).to_vec(),
    );

    let pki = Pki::new();
    // The shipped limit is 50,000 endpoints a service; this service is larger.
    let opts = AggregatorOpts {
        cycle_ms: 1000,
        report_interval_ms: 1000,
        config_toml: Some(format!(
            "[limits]\nmax_endpoints_per_service = {}\n",
            endpoints + 10
        )),
        ..AggregatorOpts::default()
    }
    .etcd(&etcd.endpoint(), PREFIX);
    let started = Instant::now();
    let agg = Aggregator::start(&pki, opts);
    wait_for(Duration::from_secs(120), "the service restored", || {
        let w = agg.try_weights(SERVICE)?;
        (w.weights.len() == endpoints)
            .then_some(())
            .ok_or(format!("{} endpoints", w.weights.len()))
    });
    let restored = started.elapsed();

    pki.issue_nodes_for(SERVICE, &["big-agent"]);
    let agent = Agent::start(&pki, &agg, AgentOpts::new(SERVICE, "big-agent"));
    agent.wait_weight(Duration::from_secs(30));
    let sum0 = agg.counter("ballast_store_write_seconds_sum", &[]);
    let count0 = agg.counter("ballast_store_write_seconds_count", &[]);
    let db0 = db_size(&etcd);
    let measuring = Instant::now();
    let mut draining = false;
    while measuring.elapsed() < Duration::from_secs(seconds) {
        let ok = if draining {
            agent.undrain().ok
        } else {
            agent.drain().ok
        };
        assert!(ok, "the agent refused a drain or undrain");
        draining = !draining;
        std::thread::sleep(Duration::from_secs(2));
    }
    let elapsed = measuring.elapsed().as_secs_f64();
    let writes = agg.counter("ballast_store_write_seconds_count", &[]) - count0;
    let write_s = agg.counter("ballast_store_write_seconds_sum", &[]) - sum0;
    let failed = agg.counter("ballast_store_writes_total", &[("reason", "error")]);
    let db1 = db_size(&etcd);
    let stored = etcd
        .get(&format!("{PREFIX}/services/{SERVICE}"))
        .and_then(|v| Manifest::parse(v.as_bytes()))
        .expect("the service's key holds a manifest");
    assert!(writes >= 1.0, "no write measured in {elapsed:.0} s");
    assert_eq!(failed, 0.0, "writes failed: see the aggregator's log");
    let growth = (db1.saturating_sub(db0)) as f64 / elapsed;
    println!(
        "etcd large service: {} endpoints, {} bytes a value in {} chunks; restored in \
         {:.1} s; {writes:.0} writes in {elapsed:.0} s ({:.2} a second), {:.0} ms a write \
         on average; etcd's database grew {:.1} MB/s (from {:.0} to {:.0} MB), so the \
         default 2 GiB quota would fill in {:.0} s without compaction",
        endpoints + 1,
        stored.bytes,
        stored.chunks,
        restored.as_secs_f64(),
        writes / elapsed,
        1000.0 * write_s / writes,
        growth / 1e6,
        db0 as f64 / 1e6,
        db1 as f64 / 1e6,
        if growth > 0.0 {
            (2u64 << 30) as f64 / growth
        } else {
            f64::INFINITY
        },
    );
}
