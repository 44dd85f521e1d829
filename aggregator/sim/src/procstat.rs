//! A process's CPU time and memory from `/proc`, as the benches measure them.

/// CPU seconds a process has used, summed over its threads from the scheduler's
/// nanosecond account (`/proc/PID/task/*/schedstat`): the 10 ms ticks of
/// `/proc/PID/stat` are too coarse for an agent that uses about a millisecond per
/// second. NaN when the process is gone. (Threads that have exited are not counted;
/// none do in these runs.)
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return f64::NAN;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum();
    ns as f64 / 1e9
}

/// A memory figure of `/proc/PID/status` (`field` with its colon, such as `VmRSS:`) in
/// MiB; NaN when the process is gone.
pub fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}
