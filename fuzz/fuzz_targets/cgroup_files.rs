//! The cgroup files the agent's cgroup CPU source reads: v2 `cpu.max` and `cpu.stat`,
//! v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us`, and the kernel's CPU lists
//! (`/sys/devices/system/cpu/online`), each on the input (real files in the seeds)
//! and on text rendered from values drawn from it.
//!
//! Invariants: nothing panics; a quota in cores is finite and above 0 (the source
//! divides by it); a CPU count is above 0; rendered files parse back to their values.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use ballast_agent::fuzzing::{
    cgroup_cfs_quota, cgroup_cpu_max, cgroup_throttling, cgroup_v2_usage_usec, cpu_list,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    quota: u64,
    period: u64,
    usage: u64,
    /// `nr_periods` and `nr_throttled`.
    periods: (u64, u64),
    /// CPU list ranges: (first, count).
    ranges: Vec<(u16, u8)>,
}

fn cores_ok(c: Option<f64>) {
    if let Some(c) = c {
        assert!(c.is_finite() && c > 0.0, "{c} cores");
    }
}

fuzz_target!(|data: &[u8]| {
    // The input as each file; for v1, its first line is the quota and the rest the
    // period.
    let text = String::from_utf8_lossy(data);
    if let Ok(c) = cgroup_cpu_max(&text) {
        cores_ok(c);
    }
    let (quota, period) = text.split_once('\n').unwrap_or((&text, ""));
    if let Ok(c) = cgroup_cfs_quota(quota, period) {
        cores_ok(c);
    }
    let _ = cgroup_v2_usage_usec(&text);
    let _ = cgroup_throttling(&text);
    if let Some(n) = cpu_list(&text) {
        assert!(n > 0);
    }
    // Files rendered from values drawn from the input.
    let Ok(input) = Unstructured::new(data).arbitrary::<Input>() else {
        return;
    };

    let (q, p) = (input.quota, input.period);
    let want = (q > 0 && p > 0).then(|| q as f64 / p as f64);
    let got = cgroup_cpu_max(&format!("{q} {p}\n")).ok().flatten();
    assert_eq!(got, want);
    assert_eq!(cgroup_cpu_max(&format!("max {p}\n")), Ok(None));
    if let Ok(q) = i64::try_from(q) {
        let got = cgroup_cfs_quota(&format!("{q}\n"), &format!("{p}\n"))
            .ok()
            .flatten();
        assert_eq!(got, want);
    }
    assert_eq!(cgroup_cfs_quota("-1\n", &format!("{p}\n")), Ok(None));

    let stat = format!(
        "usage_usec {}\nuser_usec 1\nsystem_usec 2\nnr_periods {}\nnr_throttled {}\nthrottled_usec 0\n",
        input.usage, input.periods.0, input.periods.1
    );
    assert_eq!(cgroup_v2_usage_usec(&stat), Some(input.usage));
    assert_eq!(cgroup_throttling(&stat), Some(input.periods));

    let mut list = Vec::new();
    let mut count = 0usize;
    for &(first, n) in input.ranges.iter().take(32) {
        let first = usize::from(first);
        match n {
            0 => {
                list.push(first.to_string());
                count += 1;
            }
            n => {
                list.push(format!("{first}-{}", first + usize::from(n)));
                count += usize::from(n) + 1;
            }
        }
    }
    let text = format!("{}\n", list.join(","));
    assert_eq!(cpu_list(&text), (count > 0).then_some(count), "{text:?}");
});
