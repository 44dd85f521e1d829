//! Network namespaces for fault tests: a namespace of our own, joined to the test's
//! namespace by a veth pair, where nftables rules drop real packets. The kernel here
//! has no netem, but nftables works inside a namespace, so loss and partitions are
//! real packet drops, not simulations.
//!
//! The namespace (and with it the veth pair and every rule) is deleted on drop, a
//! panicking test included.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::process::run_bounded;

/// How long one `ip` or `nft` command may take.
const CMD_TIMEOUT: Duration = Duration::from_secs(10);

/// Namespaces made by this process, to name each one apart.
static MADE: AtomicU32 = AtomicU32::new(0);

/// A network namespace with one veth link to the test's namespace: the test's side
/// has [`Netns::host_ip`], the namespace's side [`Netns::ip`] and [`Netns::ip2`], on a
/// /29 of their own. The second address lets a test cut off some clients of a server
/// in the namespace and not others: those that dial it.
#[derive(Debug)]
pub struct Netns {
    name: String,
    host_ip: Ipv4Addr,
    ip: Ipv4Addr,
    ip2: Ipv4Addr,
    /// Holds the namespace open for `setns` in children.
    file: File,
}

impl Netns {
    /// Creates the namespace and its link, with loopback up inside. Panics, naming
    /// what failed, when the machine cannot (not root, no `ip`).
    pub fn new() -> Arc<Netns> {
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = format!("ballast-{pid}-{n}");
        // Interface names are at most 15 bytes.
        let tag = format!("{}{}", pid % 100_000, n % 100);
        let (host_if, ns_if) = (format!("bh{tag}"), format!("bn{tag}"));
        // A /29 per namespace, from the pid and the count, in 10.128.0.0/9.
        let slot = (pid % 512) * 32 + (n % 32);
        let base = 0x0A80_0000u32 | (slot << 3);
        let host_ip = Ipv4Addr::from(base | 1);
        let ip = Ipv4Addr::from(base | 2);
        let ip2 = Ipv4Addr::from(base | 3);
        run_ip(&["netns", "add", &name]);
        // From here on, drop deletes it even if a later step fails.
        let file = File::open(format!("/var/run/netns/{name}"))
            .unwrap_or_else(|e| panic!("open /var/run/netns/{name}: {e}"));
        let ns = Netns {
            name,
            host_ip,
            ip,
            ip2,
            file,
        };
        run_ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &ns.name,
        ]);
        run_ip(&["addr", "add", &format!("{host_ip}/29"), "dev", &host_if]);
        run_ip(&["link", "set", &host_if, "up"]);
        ns.ip_in(&["addr", "add", &format!("{ip}/29"), "dev", &ns_if]);
        ns.ip_in(&["addr", "add", &format!("{ip2}/29"), "dev", &ns_if]);
        ns.ip_in(&["link", "set", &ns_if, "up"]);
        ns.ip_in(&["link", "set", "lo", "up"]);
        Arc::new(ns)
    }

    /// The namespace's name (`ip netns list`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's address on the link.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The namespace's second address on the link.
    pub fn ip2(&self) -> Ipv4Addr {
        self.ip2
    }

    /// The test's address on the link, as seen from inside.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.host_ip
    }

    /// Makes `cmd` start inside the namespace.
    pub fn enter(self: &Arc<Self>, cmd: &mut Command) {
        let fd = self.file.as_raw_fd();
        // SAFETY: setns is async-signal-safe; the fd stays open because `self` outlives
        // the spawn (the caller holds the Arc), and the child only changes its own
        // namespace.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    /// Replaces the namespace's nftables ruleset with `rules` (nft syntax, tables
    /// included), e.g. [`Netns::drop_udp_to_port`]'s.
    pub fn set_rules(self: &Arc<Self>, rules: &str) {
        let flush = "flush ruleset\n";
        let mut cmd = Command::new("nft");
        cmd.arg("-f").arg("-").stdin(Stdio::piped());
        self.enter(&mut cmd);
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("nft not runnable ({e}); the test command installs nftables")
            });
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("piped stdin");
            stdin
                .write_all(format!("{flush}{rules}").as_bytes())
                .expect("write the ruleset to nft");
        }
        let out = child.wait_with_output().expect("nft runs");
        assert!(
            out.status.success(),
            "nft -f failed ({}): {}\nruleset:\n{rules}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Removes every rule: the link carries everything again.
    pub fn clear_rules(self: &Arc<Self>) {
        self.set_rules("");
    }

    /// A ruleset that drops `percent` % of the UDP datagrams arriving in the namespace
    /// for `port`, at random (100 drops them all).
    pub fn drop_udp_to_port(port: u16, percent: u32) -> String {
        let some = if percent >= 100 {
            String::new()
        } else {
            format!("numgen random mod 100 < {percent} ")
        };
        format!(
            "table inet ballast_faults {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    udp dport {port} {some}counter drop\n  }}\n}}\n"
        )
    }

    /// A ruleset that drops every TCP segment to and from `port` in the namespace, both
    /// ways: a partition of the server there from its TCP clients.
    pub fn drop_tcp_to_port(port: u16) -> String {
        format!(
            "table inet ballast_faults {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    tcp dport {port} counter drop\n  }}\n  chain output {{\n    type filter hook output priority 0; policy accept;\n    tcp sport {port} counter drop\n  }}\n}}\n"
        )
    }

    /// A ruleset that cuts the namespace off from a TCP server outside it at
    /// `ip`:`port`, both ways.
    pub fn drop_tcp_to(ip: Ipv4Addr, port: u16) -> String {
        format!(
            "table inet ballast_faults {{\n  chain output {{\n    type filter hook output priority 0; policy accept;\n    ip daddr {ip} tcp dport {port} counter drop\n  }}\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    ip saddr {ip} tcp sport {port} counter drop\n  }}\n}}\n"
        )
    }

    /// A ruleset that drops every UDP datagram arriving for `ip`:`port`.
    pub fn drop_udp_to(ip: Ipv4Addr, port: u16) -> String {
        format!(
            "table inet ballast_faults {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    ip daddr {ip} udp dport {port} counter drop\n  }}\n}}\n"
        )
    }

    /// Counts of packets the rules dropped, from `nft list ruleset` (0 with no rule).
    pub fn dropped_packets(self: &Arc<Self>) -> u64 {
        let mut cmd = Command::new("nft");
        cmd.args(["list", "ruleset"]);
        self.enter(&mut cmd);
        let out = run_bounded(cmd, CMD_TIMEOUT);
        String::from_utf8_lossy(&out.stdout)
            .split("counter packets ")
            .skip(1)
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    fn ip_in(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run_ip(&all);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the veth pair, which deletes ours.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs `ip ARGS`, bounded; panics with its error unless it succeeds.
pub fn run_ip(args: &[&str]) {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    let out = run_bounded(cmd, CMD_TIMEOUT);
    assert!(
        out.status.success(),
        "ip {} failed ({}): {} (network namespaces need root and iproute2)",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
