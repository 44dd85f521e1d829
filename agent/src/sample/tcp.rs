//! In-flight requests as established TCP connections to the service's ports.
//!
//! Needs no change to the service, which is why it is the default. It counts
//! connections, not requests, so it suits services with one request per connection or
//! short keep-alive; behind a pooling proxy, use the Prometheus gauge instead.
//!
//! Two ways to count, both seeing the agent's network namespace (the agent must share
//! the service's: run on the host network, or as a sidecar in its pod):
//!
//! - a `NETLINK_SOCK_DIAG` dump (the private `netlink` submodule), where the kernel
//!   filters on state and port and returns only the matching sockets. This is the
//!   normal path: one walk of the established hash, a send and one or two receives,
//!   instead of formatting the whole TCP table as text. The walk still visits every
//!   hash bucket, so its cost follows `net.ipv4.tcp_ehash_entries` (sized from RAM at
//!   boot).
//! - `/proc/net/tcp` and `/proc/net/tcp6`, parsed here. Used when netlink sock_diag is
//!   unavailable (some sandboxes and restricted containers), and for tables named
//!   explicitly with [`TcpInflight::open_at`]. The kernel formats every socket of the
//!   namespace (TIME_WAIT included) and serves one page, about 27 sockets, per `read`,
//!   and each `read` walks the established hash again: the cost grows with both the
//!   table and the hash size, which is what makes this path slow on a big host.

mod netlink;

use std::fs::File;
use std::io::{BufRead, ErrorKind, Read};
use std::path::PathBuf;

use super::{InflightSource, SampleError};
use netlink::DiagCounter;

/// The kernel's `TCP_ESTABLISHED` in the `st` column.
const ESTABLISHED: u8 = 0x01;

/// The reusable read buffer for `/proc` tables, allocated on first use of that path
/// and kept, so a sample allocates nothing. The kernel returns at most one page per
/// `read` of these files whatever the buffer size (measured: 4050 bytes), so size does
/// not save reads; it only has to hold a page plus a partial line.
const PROC_BUF_BYTES: usize = 256 * 1024;
/// A table line longer than this is garbage (kernel lines are about 150 bytes); it
/// bounds the buffer when a file is not what it should be.
const MAX_LINE_BYTES: usize = 1024 * 1024;
/// After netlink fails, how many samples use `/proc` before netlink is tried again: a
/// transient failure should not leave the agent on the expensive path for good, and a
/// permanent one costs only a failed `socket(2)` every few minutes.
const NETLINK_RETRY_SAMPLES: u32 = 300;

/// Counts the ESTABLISHED sockets whose local port is one of `ports` in `/proc/net/tcp`
/// or `/proc/net/tcp6` text. `what` names the source in errors.
///
/// Matching the local port counts the connections clients made to the service and
/// ignores the service's own outgoing connections, whose local ports are ephemeral.
pub fn count_established<R: BufRead>(
    reader: R,
    ports: &[u16],
    what: &str,
) -> Result<u32, SampleError> {
    count_table(reader, &mut Vec::new(), ports, what)
}

/// [`count_established`] on a string, for fixtures.
pub fn count_established_str(text: &str, ports: &[u16]) -> Result<u32, SampleError> {
    count_established(text.as_bytes(), ports, "tcp table")
}

/// [`count_established`] reading through `buf`, which keeps its size between calls
/// (it grows only if one line does not fit, up to [`MAX_LINE_BYTES`]).
fn count_table<R: Read>(
    mut reader: R,
    buf: &mut Vec<u8>,
    ports: &[u16],
    what: &str,
) -> Result<u32, SampleError> {
    if buf.is_empty() {
        buf.resize(8 * 1024, 0);
    }
    let mut count = 0u32;
    let mut line_no = 0usize;
    // buf[..end] holds read bytes; complete lines are consumed from the front.
    let mut end = 0usize;
    loop {
        if end == buf.len() {
            if buf.len() >= MAX_LINE_BYTES {
                return Err(SampleError::parse(
                    what,
                    format!("line {}: longer than {MAX_LINE_BYTES} bytes", line_no + 1),
                ));
            }
            let grown = (buf.len() * 2).min(MAX_LINE_BYTES);
            buf.resize(grown, 0);
        }
        let n = match reader.read(&mut buf[end..]) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(SampleError::parse(what, format!("read: {e}"))),
        };
        let eof = n == 0;
        end += n;
        let mut start = 0usize;
        while let Some(nl) = buf[start..end].iter().position(|&b| b == b'\n') {
            line_no += 1;
            count =
                count.saturating_add(count_line(&buf[start..start + nl], ports, what, line_no)?);
            start += nl + 1;
        }
        if eof {
            if start < end {
                line_no += 1;
                count = count.saturating_add(count_line(&buf[start..end], ports, what, line_no)?);
            }
            return Ok(count);
        }
        // Keep the partial last line for the next read.
        buf.copy_within(start..end, 0);
        end -= start;
    }
}

/// 1 if `line` is an established socket on one of `ports`, 0 for other sockets and
/// the header.
fn count_line(line: &[u8], ports: &[u16], what: &str, line_no: usize) -> Result<u32, SampleError> {
    let mut fields = line
        .split(|b| b.is_ascii_whitespace())
        .filter(|f| !f.is_empty());
    // The header's first field is `sl`; every socket line starts with `N:`.
    match fields.next() {
        Some(sl) if sl.ends_with(b":") => {}
        _ => return Ok(0),
    }
    let bad = |why: &str| {
        SampleError::parse(
            what,
            format!("line {line_no}: {why}: {:?}", String::from_utf8_lossy(line)),
        )
    };
    let local = fields.next().ok_or_else(|| bad("no local address"))?;
    let state = fields.nth(1).ok_or_else(|| bad("no state"))?;
    let port = local
        .iter()
        .rposition(|&b| b == b':')
        .and_then(|colon| hex(&local[colon + 1..]))
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| bad("bad local address"))?;
    let state = hex(state)
        .and_then(|s| u8::try_from(s).ok())
        .ok_or_else(|| bad("bad state"))?;
    Ok(u32::from(state == ESTABLISHED && ports.contains(&port)))
}

/// A hexadecimal field; `None` if empty, not hex, or beyond `u32`.
fn hex(digits: &[u8]) -> Option<u32> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = char::from(d).to_digit(16)?;
        acc.checked_mul(16)?.checked_add(v)
    })
}

/// `/proc` TCP tables and the buffer they are read through.
#[derive(Debug)]
struct ProcTables {
    files: Vec<PathBuf>,
    buf: Vec<u8>,
}

impl ProcTables {
    fn new(files: Vec<PathBuf>) -> Self {
        ProcTables {
            files,
            buf: Vec::new(),
        }
    }

    /// The sum over the tables. Missing tables are skipped, but at least one must exist.
    fn count(&mut self, ports: &[u16]) -> Result<u32, SampleError> {
        if self.buf.len() < PROC_BUF_BYTES {
            self.buf.resize(PROC_BUF_BYTES, 0);
        }
        let mut total = 0u32;
        let mut first_missing = None;
        let mut read_any = false;
        for path in &self.files {
            // Opened afresh each time: a kept descriptor would go on reading a table
            // that was replaced or removed.
            let file = match File::open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    first_missing.get_or_insert((path, e));
                    continue;
                }
                Err(e) => return Err(SampleError::io(path, e)),
            };
            read_any = true;
            let what = path.display().to_string();
            total = total.saturating_add(count_table(file, &mut self.buf, ports, &what)?);
        }
        match first_missing {
            Some((path, e)) if !read_any => Err(SampleError::io(path, e)),
            _ => Ok(total),
        }
    }

    fn describe(&self) -> String {
        let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
        files.join(", ")
    }
}

/// Which way [`TcpInflight`] counts now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Netlink,
    /// `/proc`, trying netlink again (if there is a netlink counter) when this reaches 0.
    Proc {
        netlink_retry_in: u32,
    },
}

/// Established connections to the service's ports, IPv4 and IPv6.
#[derive(Debug)]
pub struct TcpInflight {
    ports: Vec<u16>,
    /// `None` when counting named tables, which netlink cannot stand in for (they may
    /// belong to another network namespace).
    netlink: Option<DiagCounter>,
    proc: ProcTables,
    path: Path,
}

impl TcpInflight {
    /// Counts the agent's network namespace through netlink sock_diag, falling back to
    /// `/proc/net/tcp` and `/proc/net/tcp6` when netlink fails. Samples once, so a
    /// problem shows now; fails only if both ways fail.
    pub fn open(ports: Vec<u16>) -> Result<Self, SampleError> {
        Self::check_ports(&ports)?;
        let mut src = TcpInflight {
            netlink: Some(DiagCounter::new(&ports)),
            proc: ProcTables::new(vec!["/proc/net/tcp".into(), "/proc/net/tcp6".into()]),
            ports,
            path: Path::Netlink,
        };
        src.sample()?;
        Ok(src)
    }

    /// Counts from other tables, such as `/proc/PID/net/tcp` to see into another
    /// process's network namespace. Missing tables are skipped (a host without IPv6 has
    /// no `tcp6`), but at least one must exist. Reads them once, so a problem shows now.
    pub fn open_at(files: Vec<PathBuf>, ports: Vec<u16>) -> Result<Self, SampleError> {
        Self::check_ports(&ports)?;
        let mut src = TcpInflight {
            ports,
            netlink: None,
            proc: ProcTables::new(files),
            path: Path::Proc {
                netlink_retry_in: 0,
            },
        };
        src.sample()?;
        Ok(src)
    }

    fn check_ports(ports: &[u16]) -> Result<(), SampleError> {
        if ports.is_empty() {
            return Err(SampleError::InvalidSpec(
                "tcp: at least one port is needed".into(),
            ));
        }
        Ok(())
    }

    /// Counts through netlink if the current path (or a due retry) says so; `None`
    /// means "use /proc".
    fn sample_netlink(&mut self) -> Option<u32> {
        let counter = self.netlink.as_mut()?;
        match &mut self.path {
            Path::Netlink => match counter.count() {
                Ok(n) => return Some(n),
                Err(e) => tracing::warn!(
                    error = %e,
                    "netlink sock_diag failed; counting TCP connections from /proc (slower)"
                ),
            },
            Path::Proc { netlink_retry_in } if *netlink_retry_in > 0 => {
                *netlink_retry_in -= 1;
                return None;
            }
            Path::Proc { .. } => match counter.count() {
                Ok(n) => {
                    tracing::info!(
                        "netlink sock_diag works again; counting TCP connections through it"
                    );
                    self.path = Path::Netlink;
                    return Some(n);
                }
                Err(e) => tracing::debug!(error = %e, "netlink sock_diag still failing"),
            },
        }
        self.path = Path::Proc {
            netlink_retry_in: NETLINK_RETRY_SAMPLES,
        };
        None
    }
}

impl InflightSource for TcpInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        match self.sample_netlink() {
            Some(n) => Ok(n),
            None => self.proc.count(&self.ports),
        }
    }

    /// The ports and the way they are counted now, e.g.
    /// `tcp established to port 80,443 via netlink sock_diag`.
    fn describe(&self) -> String {
        let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
        let via = match self.path {
            Path::Netlink => "netlink sock_diag".to_string(),
            Path::Proc { .. } => self.proc.describe(),
        };
        format!("tcp established to port {} via {via}", ports.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1151 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1152 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:D432 01 00000000:00000000 00:00000000 00000000     0        0 1153 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 1154 1 0000000000000000 20 4 30 10 -1
   4: 0100007F:1F90 0100007F:D433 06 00000000:00000000 03:00000F9E 00000000     0        0 0 3 0000000000000000
   5: 0A00000A:20FB 0A000001:C350 01 00000000:00000000 00:00000000 00000000     0        0 1155 1 0000000000000000 20 4 30 10 -1
   6: 0A00000A:0050 0A000001:C351 01 00000000:00000000 00:00000000 00000000     0        0 1156 1 0000000000000000 20 4 30 10 -1
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:E001 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 20 4 30 10 -1
   2: 0000000000000000FFFF00000100007F:20FB 0000000000000000FFFF00000100007F:E002 01 00000000:00000000 00:00000000 00000000     0        0 2003 1 0000000000000000 20 4 30 10 -1
";

    #[test]
    fn counts_established_on_local_ports_only() {
        // 8080 = 1F90: two established inbound; the listener (0A), the TIME_WAIT (06)
        // and the outgoing socket *to* 8080 (remote port) do not count.
        assert_eq!(count_established_str(TCP, &[8080]).unwrap(), 2);
        // 8443 = 20FB on 10.0.0.10.
        assert_eq!(count_established_str(TCP, &[8080, 8443]).unwrap(), 3);
        assert_eq!(count_established_str(TCP, &[80]).unwrap(), 1);
        assert_eq!(count_established_str(TCP, &[9999]).unwrap(), 0);
        assert_eq!(count_established_str(TCP6, &[8080]).unwrap(), 1);
        assert_eq!(count_established_str(TCP6, &[8080, 8443]).unwrap(), 2);
        assert_eq!(count_established_str("", &[8080]).unwrap(), 0);
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "   0: 0100007F 0100007F:D431 01",
            "   0: 0100007F:XYZ1 0100007F:D431 01",
            "   0: 0100007F:1F90 0100007F:D431 ZZ",
            "   0: 0100007F:1F90",
        ] {
            let err = count_established_str(bad, &[8080]).unwrap_err();
            assert!(err.to_string().contains("line 1"), "{err}");
        }
    }

    #[test]
    fn source_sums_both_tables_and_skips_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let (v4, v6) = (dir.path().join("tcp"), dir.path().join("tcp6"));
        std::fs::write(&v4, TCP).unwrap();
        std::fs::write(&v6, TCP6).unwrap();
        let mut src = TcpInflight::open_at(vec![v4.clone(), v6.clone()], vec![8080]).unwrap();
        assert_eq!(src.sample().unwrap(), 3);
        assert_eq!(
            src.describe(),
            format!(
                "tcp established to port 8080 via {}, {}",
                v4.display(),
                v6.display()
            )
        );
        std::fs::remove_file(&v6).unwrap();
        assert_eq!(src.sample().unwrap(), 2);
        std::fs::remove_file(&v4).unwrap();
        let err = src.sample().unwrap_err();
        assert!(err.to_string().contains("tcp"), "{err}");
        assert!(TcpInflight::open_at(vec![v4], vec![]).is_err());
    }

    /// A real connection on this machine shows up in the real `/proc/net/tcp`.
    #[test]
    fn real_proc_net_tcp_sees_a_local_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut src = TcpInflight::open(vec![port]).unwrap();
        assert_eq!(src.sample().unwrap(), 0);
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert_eq!(src.sample().unwrap(), 1);
        // The client's side has the port as its remote port and must not count; a second
        // connection does.
        let client2 = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server2, _) = listener.accept().unwrap();
        assert_eq!(src.sample().unwrap(), 2);
        drop((client, server, client2, server2));
    }

    #[test]
    fn long_tables_split_across_reads_and_odd_endings() {
        // Many lines through a small buffer: lines straddle reads; no final newline.
        let line = "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1152 1\n";
        let text = format!("{}{}", line.repeat(500), line.trim_end());
        let mut buf = vec![0; 64];
        let n = count_table(text.as_bytes(), &mut buf, &[8080], "t").unwrap();
        assert_eq!(n, 501);
        assert_eq!(buf.len(), 128, "grows only to fit a line");
        // CRLF and blank lines are harmless; a line too long for any buffer is an error.
        assert_eq!(
            count_established_str(&format!("\r\n{}\r\n\n", line.trim_end()), &[8080]).unwrap(),
            1
        );
        let long = format!("   1: {}", "A".repeat(MAX_LINE_BYTES));
        let err = count_established_str(&long, &[8080]).unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
        // Not UTF-8 outside the fields that matter: still counted; inside them: an error.
        let mut bytes = line.as_bytes().to_vec();
        bytes.extend_from_slice(b"   2: 0100007F:1F90 0100007F:D431 01 \xff\xfe\n");
        assert_eq!(count_established(&bytes[..], &[8080], "t").unwrap(), 2);
        assert!(count_established(&b"   2: 0100007F:1F\xff 0 01\n"[..], &[8080], "t").is_err());
    }

    /// Waits up to 2 s for `src` to count `want`: closed sockets leave ESTABLISHED as the
    /// peer processes the FIN, which is quick but not synchronous.
    fn wait_for(src: &mut TcpInflight, want: u32) -> u32 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            let n = src.sample().unwrap();
            if n == want || std::time::Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// `n` accepted connections to `listener`, as (client, server) pairs.
    fn connect_n(
        listener: &std::net::TcpListener,
        n: usize,
    ) -> Vec<(std::net::TcpStream, std::net::TcpStream)> {
        let addr = listener.local_addr().unwrap();
        (0..n)
            .map(|_| {
                let client = std::net::TcpStream::connect(addr).unwrap();
                let (server, _) = listener.accept().unwrap();
                (client, server)
            })
            .collect()
    }

    /// Real sockets, counted by both paths: the server side of N connections, not the
    /// client side, not another port's connections, and none once they are closed.
    fn check_real_connections(bind: &str) {
        const N: usize = 5;
        let listener = std::net::TcpListener::bind(bind).unwrap();
        let port = listener.local_addr().unwrap().port();
        // Noise: connections to another port, whose clients have ephemeral local ports.
        let other = std::net::TcpListener::bind(bind).unwrap();
        let noise = connect_n(&other, 3);

        let mut netlink = TcpInflight::open(vec![port]).unwrap();
        assert_eq!(netlink.path, Path::Netlink, "{}", netlink.describe());
        assert_eq!(
            netlink.describe(),
            format!("tcp established to port {port} via netlink sock_diag")
        );
        let mut proc = TcpInflight::open_at(
            vec!["/proc/net/tcp".into(), "/proc/net/tcp6".into()],
            vec![port],
        )
        .unwrap();
        assert!(proc
            .describe()
            .ends_with("via /proc/net/tcp, /proc/net/tcp6"));
        assert_eq!(netlink.sample().unwrap(), 0);
        assert_eq!(proc.sample().unwrap(), 0);

        let conns = connect_n(&listener, N);
        assert_eq!(netlink.sample().unwrap(), N as u32);
        // The kernel-side filter returned only these sockets, not the noise.
        assert_eq!(netlink.netlink.as_ref().unwrap().last_returned, N as u32);
        assert_eq!(proc.sample().unwrap(), N as u32);
        // The per-family requests, used where the single-walk one is refused, agree.
        let mut per_family = DiagCounter::new(&[port]).per_family_only();
        assert_eq!(per_family.count().unwrap(), N as u32);
        assert_eq!(per_family.last_returned, N as u32);

        drop(conns);
        assert_eq!(wait_for(&mut netlink, 0), 0);
        assert_eq!(wait_for(&mut proc, 0), 0);
        assert_eq!(per_family.count().unwrap(), 0);
        drop(noise);
    }

    #[test]
    fn netlink_and_proc_count_real_ipv4_connections() {
        check_real_connections("127.0.0.1:0");
    }

    #[test]
    fn netlink_and_proc_count_real_ipv6_connections() {
        if std::net::TcpListener::bind("[::1]:0").is_err() {
            eprintln!("no IPv6 loopback; skipped");
            return;
        }
        check_real_connections("[::1]:0");
    }

    /// A failing netlink dump falls back to /proc for the same sample, and netlink is
    /// tried again after [`NETLINK_RETRY_SAMPLES`].
    #[test]
    fn falls_back_to_proc_when_netlink_fails_and_retries_later() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let conns = connect_n(&listener, 2);
        let mut src = TcpInflight::open(vec![port]).unwrap();
        assert_eq!(src.path, Path::Netlink);
        // An invalid filter opcode: the kernel's audit answers EINVAL.
        src.netlink = Some(DiagCounter::with_filter(&[port], Some(&[0xff, 4, 8, 0])));
        assert_eq!(src.sample().unwrap(), 2);
        assert!(
            src.describe()
                .ends_with("via /proc/net/tcp, /proc/net/tcp6"),
            "{}",
            src.describe()
        );
        assert_eq!(
            src.path,
            Path::Proc {
                netlink_retry_in: NETLINK_RETRY_SAMPLES
            }
        );
        // Still broken at the retry: stays on /proc and counts.
        src.path = Path::Proc {
            netlink_retry_in: 1,
        };
        assert_eq!(src.sample().unwrap(), 2);
        assert_eq!(
            src.path,
            Path::Proc {
                netlink_retry_in: 0
            }
        );
        assert_eq!(src.sample().unwrap(), 2);
        assert_eq!(
            src.path,
            Path::Proc {
                netlink_retry_in: NETLINK_RETRY_SAMPLES
            }
        );
        // Repaired: the retry switches back.
        src.netlink = Some(DiagCounter::new(&[port]));
        src.path = Path::Proc {
            netlink_retry_in: 0,
        };
        assert_eq!(src.sample().unwrap(), 2);
        assert_eq!(src.path, Path::Netlink);
        drop(conns);
    }
}
