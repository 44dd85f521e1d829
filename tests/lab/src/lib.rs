//! Ballast's physical lab: the parts that stand for a real service and its clients.
//!
//! - [`backend`]: an HTTP/1.1 service whose every request burns a fixed amount of CPU
//!   (rounds of a hash), or stalls on a sleep when told to, with a gauge of its
//!   in-flight requests. Run in a cgroup with a CPU quota, it stands for one machine of
//!   a hardware generation.
//! - [`load`]: an open-loop generator. Requests leave at a fixed rate whether or not
//!   earlier ones have been answered, so an overloaded backend shows up as latency and
//!   errors instead of silently slowing the client down, as a closed-loop tool would.
//!   They go over a bounded pool of keep-alive connections, as real clients send them.
//!
//! The orchestration (cgroups, HAProxy, agents, the runs and the report) lives in the
//! integration tests' `lab` module, which reuses their harness.

pub mod backend;
pub mod load;
pub mod work;
