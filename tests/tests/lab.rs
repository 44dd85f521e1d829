//! The physical lab, short: the same four runs as the full lab (`bash tests/lab/run`,
//! which writes `docs/lab.md`), a few seconds each, with assertions on the direction
//! of every result rather than on the full lab's targets, because the test suite
//! shares a two-core machine with whatever else runs.
//!
//! Six CPU-bound backends in cgroups with quotas of 10–30 % of a core behind Debian's
//! HAProxy 2.6, an open-loop load at 60 % of their calibrated capacity:
//! 1. round robin saturates the smallest quotas;
//! 2. Ballast (real agents on the cgroups, a real aggregator, HAProxy's agent-check)
//!    brings max/avg down, and the p99 latency with it;
//! 3. a backend that stalls on I/O (a sleep: low CPU, piling-up requests) loses its
//!    traffic instead of being flooded;
//! 4. a backend drained, stopped, started again and undrained under load costs no
//!    request.
//!
//! A second test makes a run fail part way (a stall the backend refuses) and checks that
//! the lab's processes and cgroups are gone after the panic.
//!
//! Needs root (cgroups) and Debian's `haproxy`; fails, naming what is missing, without
//! them. The tests take turns (one lock), so that neither competes with the other for
//! the CPU.

use ballast_tests::lab::{run, Plan};
use std::sync::Mutex;
use std::time::Duration;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Children of this process whose command is the lab's backend.
fn backend_children() -> Vec<u32> {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`; comm is cut to 15 bytes.
            let Some((comm, rest)) = stat.split_once(") ") else {
                return false;
            };
            comm.ends_with("ballast-lab-bac") && rest.split_whitespace().nth(1) == Some(me.as_str())
        })
        .collect()
}

/// The lab's cgroup directories of this process, in every hierarchy.
fn own_cgroups() -> Vec<String> {
    let name = format!("ballast-lab-{}", std::process::id());
    let mut found = Vec::new();
    for root in ["/sys/fs/cgroup".to_string()].into_iter().chain(
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().display().to_string()),
    ) {
        let dir = format!("{root}/{name}");
        if std::path::Path::new(&dir).exists() {
            found.push(dir);
        }
    }
    found
}

#[test]
fn a_failing_run_leaves_no_process_and_no_cgroup() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let plan = Plan {
        calibrate: Duration::from_secs(1),
        rr: (Duration::from_secs(2), Duration::ZERO),
        ballast: (Duration::from_secs(3), Duration::from_secs(1)),
        degraded: (
            Duration::from_secs(3),
            Duration::from_secs(1),
            Duration::from_secs(1),
        ),
        // Above the backend's limit: it answers 400 and run 3 fails with everything up.
        stall_ms: ballast_lab::backend::MAX_STALL_MS + 1,
        ..Plan::short()
    };
    let failed = std::panic::catch_unwind(|| run(&plan));
    let msg = match &failed {
        Ok(_) => panic!("the lab accepted a stall the backend refuses"),
        Err(e) => e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    };
    assert!(
        msg.contains("stall web-"),
        "failed for another reason: {msg}"
    );
    assert_eq!(
        backend_children(),
        Vec::<u32>::new(),
        "backends outlived the failed lab"
    );
    assert_eq!(
        own_cgroups(),
        Vec::<String>::new(),
        "cgroups outlived the failed lab"
    );
}

#[test]
fn lab_short() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let plan = Plan::short();
    let r = run(&plan);
    let rr = r.run("rr");
    let ba = r.run("ballast");
    let table = ballast_tests::lab::report::markdown(
        &r,
        "cargo test -p ballast-tests --test lab",
        "this test",
    );
    eprintln!("{table}");

    // Calibration: the quotas hold (capacity follows the quota) and nothing failed.
    let per_quota: Vec<f64> = r
        .calibration
        .saturated
        .iter()
        .zip(&plan.quotas)
        .map(|(c, q)| c / q)
        .collect();
    let mut sorted = per_quota.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    assert!(median > 0.0, "no backend served anything: {per_quota:?}");
    for (i, v) in per_quota.iter().enumerate() {
        assert!(
            (v / median - 1.0).abs() < 0.35,
            "{}: capacity per core {v:.0} is far from the others' {median:.0}: is the quota \
             enforced? {per_quota:?}",
            r.names[i]
        );
    }

    // 1. Round robin: the smallest quotas near saturation, a clear imbalance.
    let small = plan.quotas.iter().copied().fold(f64::INFINITY, f64::min);
    for (i, u) in rr.util.iter().enumerate() {
        if (plan.quotas[i] - small).abs() < 1e-9 {
            assert!(
                *u >= 0.8,
                "{} at {u:.2} under round robin: not near saturation",
                r.names[i]
            );
        }
    }
    assert!(
        rr.spread.max_over_avg >= 1.2,
        "round robin max/avg {:.3}: the quotas made no imbalance",
        rr.spread.max_over_avg
    );

    // 2. Ballast: balanced, clearly better than round robin, and faster.
    assert!(
        ba.spread.max_over_avg <= 1.12,
        "Ballast's steady max/avg {:.3} (utilization {:?})",
        ba.spread.max_over_avg,
        ba.util
    );
    assert!(
        rr.spread.max_over_avg - ba.spread.max_over_avg >= 0.1,
        "Ballast {:.3} is not clearly below round robin {:.3}",
        ba.spread.max_over_avg,
        rr.spread.max_over_avg
    );
    assert!(
        ba.load.p99_ms < rr.load.p99_ms,
        "p99 under Ballast {:.0} ms, under round robin {:.0} ms",
        ba.load.p99_ms,
        rr.load.p99_ms
    );
    assert_eq!(
        ba.whole.errors, 0,
        "run 2 errors: {:?}",
        ba.whole.errors_by_kind
    );
    assert!(
        r.converged_after.is_some(),
        "run 2 never reached max/avg 1.10 in a 5 s window"
    );

    // 3. The stalled backend is not flooded: its share falls and its in-flight stays
    //    within its capacity.
    let d = &r.degraded;
    assert!(
        d.share.1 < d.share.0 * 0.6,
        "{}'s share {:.3} before the stall, {:.3} after: not steered away",
        r.names[d.backend],
        d.share.0,
        d.share.1
    );
    assert!(
        d.inflight_max_late <= 2 * plan.capacity,
        "{} reached {} requests in flight after the controller had reacted (capacity {})",
        r.names[d.backend],
        d.inflight_max_late,
        plan.capacity
    );
    assert!(
        d.inflight_mean.1 <= f64::from(plan.capacity),
        "{} holds {:.1} requests in flight on average after the stall (capacity {})",
        r.names[d.backend],
        d.inflight_mean.1,
        plan.capacity
    );

    // 4. Drain, stop, restart, undrain: no request lost, none sent while drained, and
    //    traffic comes back.
    let x = &r.restart;
    let rs = r.run("restart");
    assert_eq!(
        rs.whole.errors, 0,
        "run 4 errors: {:?}",
        rs.whole.errors_by_kind
    );
    assert_eq!(
        x.served_while_drained, 0,
        "{} served while drained",
        r.names[x.backend]
    );
    assert!(
        x.served_after > 0,
        "{} got no traffic after the undrain",
        r.names[x.backend]
    );
}
