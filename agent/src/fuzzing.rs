//! Entry points for the fuzz targets in `fuzz/`: each parser of untrusted input that
//! is private to this crate, behind a thin public function. Not a stable API; nothing
//! in the agent calls it.

use crate::config::AgentConfig;
use crate::sample::host::CpuTimes;
use crate::sample::process::ProcStat;
use crate::sample::tcp::TcpCount;
use crate::sample::SampleError;
use crate::shared::Shared;
use ballast_shared::session::Assignment;

/// The metrics server's routing of a request head: `Ok` for `GET` or `HEAD
/// /metrics`, else the status line it answers with.
pub fn metrics_route(head: &[u8]) -> Result<(), &'static str> {
    crate::metrics::route(head).map_err(|r| r.status_line())
}

/// The shared state of an agent with the default configuration, as the agent-check
/// and the control socket read it.
pub fn shared() -> Shared {
    Shared::new(AgentConfig::default())
}

/// Records an assignment as the report loop does when a reply arrives.
pub fn assigned(shared: &Shared, assignment: Assignment) {
    crate::report::assigned(shared, assignment);
}

/// The line the agent-check answers with now.
pub fn agent_check_reply(shared: &Shared) -> String {
    crate::agentcheck::reply(shared)
}

/// The control socket's answer to one request line.
pub fn control_answer(shared: &Shared, line: &str) -> crate::control::Response {
    crate::control::answer(shared, line)
}

/// The body of a raw HTTP/1.x response to a Prometheus scrape (status, headers,
/// `Content-Length`, chunked transfer coding).
pub fn http_response(raw: &[u8]) -> Result<Vec<u8>, SampleError> {
    crate::sample::prometheus::parse_http_response(raw, "http://fuzz/metrics")
}

/// What one netlink `sock_diag` datagram held, as [`netlink_chunk`] parses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetlinkChunk {
    /// Socket records for the request.
    pub sockets: u32,
    /// Of those, established sockets on one of the ports.
    pub established: u32,
    /// Of those, the sockets owed a response.
    pub owed: u32,
    /// The dump ended.
    pub done: bool,
    /// The errno of an `NLMSG_ERROR`.
    pub refused: Option<i32>,
}

/// Parses one `sock_diag` dump datagram answering request `seq`, whose records have
/// message type `kind`, counting sockets on `ports` (sorted).
pub fn netlink_chunk(
    buf: &[u8],
    seq: u32,
    kind: u16,
    ports: &[u16],
) -> Result<NetlinkChunk, SampleError> {
    crate::sample::tcp::netlink::parse_chunk(buf, seq, kind, ports).map(|c| NetlinkChunk {
        sockets: c.sockets,
        established: c.established,
        owed: c.owed,
        done: c.done,
        refused: c.refused,
    })
}

/// Parses one `/proc/PID/stat` line.
pub fn proc_pid_stat(text: &str) -> Result<ProcStat, String> {
    crate::sample::process::parse_stat(text)
}

/// Parses the aggregate `cpu ` line of `/proc/stat`.
pub fn proc_stat(text: &str) -> Result<CpuTimes, SampleError> {
    crate::sample::host::parse_proc_stat(text)
}

/// Counts the connections on `ports` in `/proc/net/tcp` or `/proc/net/tcp6` bytes.
pub fn proc_net_tcp(bytes: &[u8], ports: &[u16]) -> Result<TcpCount, SampleError> {
    crate::sample::tcp::count_table(bytes, &mut Vec::new(), ports, "tcp table")
}

/// A cgroup v2 `cpu.max` as cores; `None` when unlimited.
pub fn cgroup_cpu_max(text: &str) -> Result<Option<f64>, String> {
    crate::sample::cgroup::parse_cpu_max(text)
}

/// A cgroup v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` as cores; `None` when
/// unlimited.
pub fn cgroup_cfs_quota(quota: &str, period: &str) -> Result<Option<f64>, String> {
    crate::sample::cgroup::parse_cfs_quota(quota, period)
}

/// `nr_periods` and `nr_throttled` of a `cpu.stat`.
pub fn cgroup_throttling(text: &str) -> Option<(u64, u64)> {
    crate::sample::cgroup::parse_throttling(text)
}

/// The `usage_usec` of a cgroup v2 `cpu.stat`.
pub fn cgroup_v2_usage_usec(text: &str) -> Option<u64> {
    crate::sample::cgroup::parse_v2_usage_usec(text)
}

/// The number of CPUs in a kernel CPU list such as `0-3,6`.
pub fn cpu_list(text: &str) -> Option<usize> {
    crate::sample::cgroup::parse_cpu_list(text)
}
