//! In-flight requests as the TCP connections to the service's ports that are owed a
//! response.
//!
//! Needs no change to the service, which is why it is the default. It counts requests,
//! not connections: a pooling proxy (HAProxy with connection reuse, Envoy) keeps idle
//! connections open, and an idle connection counts 0. A connection counts 1 when the
//! service owes it a response:
//!
//! - it received data more recently than it sent any (`tcp_info`'s
//!   `tcpi_last_data_recv` < `tcpi_last_data_sent`): a request arrived, and no response
//!   has started since; or
//! - it holds bytes the service has not read yet (`idiag_rqueue`, `rx_queue`).
//!
//! Both ages are whole jiffies (4 ms at `HZ=250`): equal ages read as "answered", so a
//! fresh connection with no data is not in flight, and a request arriving in the very
//! tick its predecessor's response left is missed until the next one on that
//! connection, unless it is still unread.
//!
//! What it cannot see: a connection carries at most one count, so an HTTP/2 or gRPC
//! connection with several outstanding streams counts 1, and counts 0 from the moment
//! one of its responses is sent until the next request arrives on it. For multiplexed
//! clients the count is a lower bound that saturates at the number of connections
//! (`docs/inflight.md` has the measurements); the aggregator compares it across the
//! fleet, so its scale does not matter, but a fleet with few connections per backend
//! sees a coarse signal. A service that pushes data without being asked (server
//! streaming, WebSocket) looks answered while it sends.
//!
//! Two ways to count, both seeing the agent's network namespace (the agent must share
//! the service's: run on the host network, or as a sidecar in its pod):
//!
//! - a `NETLINK_SOCK_DIAG` dump (the private `netlink` submodule), where the kernel
//!   filters on state and port and returns only the matching sockets, each with its
//!   `tcp_info`. This is the normal path: one walk of the established hash, a send and
//!   one or two receives, instead of formatting the whole TCP table as text. The walk
//!   still visits every hash bucket, so its cost follows `net.ipv4.tcp_ehash_entries`
//!   (sized from RAM at boot).
//! - `/proc/net/tcp` and `/proc/net/tcp6`, parsed here. Used when netlink sock_diag is
//!   unavailable (some sandboxes and restricted containers), and for the fixture
//!   tables the tests name. These tables have no last-send or
//!   last-receive times, so this path counts only the connections with unread bytes
//!   (`rx_queue > 0`), the one piece of "owed" evidence they hold: a lower bound, which
//!   misses every request the service has read and not yet answered. (`tx_queue` is
//!   response bytes on their way out, evidence of the opposite.) The kernel formats
//!   every socket of the namespace (TIME_WAIT included) and serves one page, about 27
//!   sockets, per `read`, and each `read` walks the established hash again: the cost
//!   grows with both the table and the hash size, which is what makes this path slow
//!   on a big host.

pub(crate) mod netlink;

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::PathBuf;

use super::{InflightSource, OwedAges, SampleError};
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

/// The TCP connections to the service's ports in one sample.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TcpCount {
    /// Connections owed a response: the in-flight count. Through `/proc`, only those
    /// with unread bytes.
    pub owed: u32,
    /// All established connections, idle ones included.
    pub established: u32,
}

impl TcpCount {
    /// Both counts summed, saturating.
    fn plus(self, other: TcpCount) -> TcpCount {
        TcpCount {
            owed: self.owed.saturating_add(other.owed),
            established: self.established.saturating_add(other.established),
        }
    }
}

/// Counts the ESTABLISHED sockets whose local port is one of `ports` in `/proc/net/tcp`
/// or `/proc/net/tcp6` text, and those of them with unread bytes (`rx_queue > 0`, the
/// only sign of an owed response these tables carry). `what` names the source in errors.
///
/// Matching the local port counts the connections clients made to the service and
/// ignores the service's own outgoing connections, whose local ports are ephemeral.
#[cfg(test)]
pub(crate) fn count_connections<R: std::io::BufRead>(
    reader: R,
    ports: &[u16],
    what: &str,
) -> Result<TcpCount, SampleError> {
    count_table(reader, &mut Vec::new(), ports, what)
}

/// [`count_connections`] on a string, for fixtures.
#[cfg(test)]
pub(crate) fn count_connections_str(text: &str, ports: &[u16]) -> Result<TcpCount, SampleError> {
    count_connections(text.as_bytes(), ports, "tcp table")
}

/// [`count_connections`] reading through `buf`, which keeps its size between calls
/// (it grows only if one line does not fit, up to [`MAX_LINE_BYTES`]).
pub(crate) fn count_table<R: Read>(
    mut reader: R,
    buf: &mut Vec<u8>,
    ports: &[u16],
    what: &str,
) -> Result<TcpCount, SampleError> {
    if buf.is_empty() {
        buf.resize(8 * 1024, 0);
    }
    let mut count = TcpCount::default();
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
            count = count.plus(count_line(&buf[start..start + nl], ports, what, line_no)?);
            start += nl + 1;
        }
        if eof {
            if start < end {
                line_no += 1;
                count = count.plus(count_line(&buf[start..end], ports, what, line_no)?);
            }
            return Ok(count);
        }
        // Keep the partial last line for the next read.
        buf.copy_within(start..end, 0);
        end -= start;
    }
}

/// One established socket on one of `ports` (owed if its `rx_queue` is not empty), or
/// nothing for other sockets and the header.
fn count_line(
    line: &[u8],
    ports: &[u16],
    what: &str,
    line_no: usize,
) -> Result<TcpCount, SampleError> {
    let mut fields = line
        .split(|b| b.is_ascii_whitespace())
        .filter(|f| !f.is_empty());
    // The header's first field is `sl`; every socket line starts with `N:`.
    match fields.next() {
        Some(sl) if sl.ends_with(b":") => {}
        _ => return Ok(TcpCount::default()),
    }
    let bad = |why: &str| {
        SampleError::parse(
            what,
            format!("line {line_no}: {why}: {:?}", String::from_utf8_lossy(line)),
        )
    };
    let local = fields.next().ok_or_else(|| bad("no local address"))?;
    let state = fields.nth(1).ok_or_else(|| bad("no state"))?;
    let queues = fields.next();
    let port = local
        .iter()
        .rposition(|&b| b == b':')
        .and_then(|colon| hex(&local[colon + 1..]))
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| bad("bad local address"))?;
    let state = hex(state)
        .and_then(|s| u8::try_from(s).ok())
        .ok_or_else(|| bad("bad state"))?;
    if state != ESTABLISHED || !ports.contains(&port) {
        return Ok(TcpCount::default());
    }
    // `tx_queue:rx_queue`; for an established socket `rx_queue` is the bytes received
    // and not yet read.
    let rx_queue = queues
        .and_then(|q| q.iter().position(|&b| b == b':').map(|c| &q[c + 1..]))
        .and_then(hex)
        .ok_or_else(|| bad("bad tx_queue:rx_queue"))?;
    Ok(TcpCount {
        owed: u32::from(rx_queue > 0),
        established: 1,
    })
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
    fn count(&mut self, ports: &[u16]) -> Result<TcpCount, SampleError> {
        if self.buf.len() < PROC_BUF_BYTES {
            self.buf.resize(PROC_BUF_BYTES, 0);
        }
        let mut total = TcpCount::default();
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
            total = total.plus(count_table(file, &mut self.buf, ports, &what)?);
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

/// The connections to the service's ports, IPv4 and IPv6, that are owed a response
/// (see the module documentation), and all established ones.
#[derive(Debug)]
pub struct TcpInflight {
    ports: Vec<u16>,
    /// `None` when counting named tables, which netlink cannot stand in for (they may
    /// belong to another network namespace).
    netlink: Option<DiagCounter>,
    proc: ProcTables,
    path: Path,
    /// The last successful sample, and the path that took it.
    last: Option<(TcpCount, Path)>,
    /// The ages of the requests owed in the last sample, when it went through netlink
    /// (the `/proc` tables carry no times).
    last_ages: Option<OwedAges>,
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
            last: None,
            last_ages: None,
        };
        src.sample()?;
        Ok(src)
    }

    /// Counts from other tables, such as `/proc/PID/net/tcp` to see into another
    /// process's network namespace. Missing tables are skipped (a host without IPv6 has
    /// no `tcp6`), but at least one must exist. Reads them once, so a problem shows now.
    #[cfg(test)]
    pub(crate) fn open_at(files: Vec<PathBuf>, ports: Vec<u16>) -> Result<Self, SampleError> {
        Self::check_ports(&ports)?;
        let mut src = TcpInflight {
            ports,
            netlink: None,
            proc: ProcTables::new(files),
            path: Path::Proc {
                netlink_retry_in: 0,
            },
            last: None,
            last_ages: None,
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

    /// Samples both counts. [`InflightSource::sample`] returns the owed one.
    pub fn sample_count(&mut self) -> Result<TcpCount, SampleError> {
        let count = match self.sample_netlink() {
            Some(n) => {
                self.last_ages = self.netlink.as_ref().map(|c| c.ages);
                n
            }
            None => {
                self.last_ages = None;
                self.proc.count(&self.ports)?
            }
        };
        self.last = Some((count, self.path));
        Ok(count)
    }

    /// The counts of the last successful sample (zeros before any).
    #[cfg(test)]
    pub(crate) fn last_count(&self) -> TcpCount {
        self.last.map(|(count, _)| count).unwrap_or_default()
    }

    /// Counts through netlink if the current path (or a due retry) says so; `None`
    /// means "use /proc".
    fn sample_netlink(&mut self) -> Option<TcpCount> {
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
    /// The connections owed a response.
    fn sample(&mut self) -> Result<u32, SampleError> {
        Ok(self.sample_count()?.owed)
    }

    /// The ages of the owed requests, through netlink; `None` through `/proc`.
    fn ages(&self) -> Option<OwedAges> {
        self.last_ages
    }

    /// The ports and the way they are counted now, e.g.
    /// `tcp connections owed a response on port 80,443 via netlink sock_diag (tcp_info)`,
    /// or through `/proc`,
    /// `... via /proc/net/tcp, /proc/net/tcp6 (counts only connections with unread
    /// bytes; a lower bound)`.
    fn describe(&self) -> String {
        let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
        let via = match self.path {
            Path::Netlink => "netlink sock_diag (tcp_info)".to_string(),
            Path::Proc { .. } => format!(
                "{} (counts only connections with unread bytes; a lower bound)",
                self.proc.describe()
            ),
        };
        format!(
            "tcp connections owed a response on port {} via {via}",
            ports.join(",")
        )
    }

    /// The last sample's two counts, e.g. `3 of 12 connections owe a response`, or
    /// through `/proc`, `3 of 12 connections have unread bytes`.
    fn detail(&self) -> Option<String> {
        let (count, path) = self.last?;
        let what = match path {
            Path::Netlink => "owe a response",
            Path::Proc { .. } => "have unread bytes",
        };
        Some(format!(
            "{} of {} connections {what}",
            count.owed, count.established
        ))
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
   7: 0100007F:1F90 0100007F:D434 01 00000000:000001A2 00:00000000 00000000     0        0 1157 1 0000000000000000 20 4 30 10 -1
   8: 0100007F:1F90 0100007F:D435 01 00000F00:00000000 00:00000000 00000000     0        0 1158 1 0000000000000000 20 4 30 10 -1
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:E001 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 20 4 30 10 -1
   2: 0000000000000000FFFF00000100007F:20FB 0000000000000000FFFF00000100007F:E002 01 00000000:00000000 00:00000000 00000000     0        0 2003 1 0000000000000000 20 4 30 10 -1
";

    /// The established count of a fixture.
    fn established(text: &str, ports: &[u16]) -> u32 {
        count_connections_str(text, ports).unwrap().established
    }

    #[test]
    fn counts_established_on_local_ports_only() {
        // 8080 = 1F90: four established inbound; the listener (0A), the TIME_WAIT (06)
        // and the outgoing socket *to* 8080 (remote port) do not count.
        assert_eq!(established(TCP, &[8080]), 4);
        // 8443 = 20FB on 10.0.0.10.
        assert_eq!(established(TCP, &[8080, 8443]), 5);
        assert_eq!(established(TCP, &[80]), 1);
        assert_eq!(established(TCP, &[9999]), 0);
        assert_eq!(established(TCP6, &[8080]), 1);
        assert_eq!(established(TCP6, &[8080, 8443]), 2);
        assert_eq!(established("", &[8080]), 0);
    }

    /// Through `/proc`, a connection is owed a response only with unread bytes
    /// (`rx_queue`); a response on its way out (`tx_queue`) is not.
    #[test]
    fn proc_counts_connections_with_unread_bytes_as_owed() {
        assert_eq!(
            count_connections_str(TCP, &[8080]).unwrap(),
            TcpCount {
                owed: 1,
                established: 4
            }
        );
        assert_eq!(count_connections_str(TCP6, &[8080]).unwrap().owed, 0);
        // The queue field is read only where it matters, and must then be hex.
        for bad in [
            "   0: 0100007F:1F90 0100007F:D431 01",
            "   0: 0100007F:1F90 0100007F:D431 01 00000000",
            "   0: 0100007F:1F90 0100007F:D431 01 00000000:",
            "   0: 0100007F:1F90 0100007F:D431 01 00000000:0000000G",
        ] {
            let err = count_connections_str(bad, &[8080]).unwrap_err();
            assert!(err.to_string().contains("rx_queue"), "{err}");
        }
        assert_eq!(
            count_connections_str("   0: 0100007F:1F90 0100007F:D431 0A", &[8080]).unwrap(),
            TcpCount::default()
        );
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "   0: 0100007F 0100007F:D431 01",
            "   0: 0100007F:XYZ1 0100007F:D431 01",
            "   0: 0100007F:1F90 0100007F:D431 ZZ",
            "   0: 0100007F:1F90",
        ] {
            let err = count_connections_str(bad, &[8080]).unwrap_err();
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
        assert_eq!(src.sample().unwrap(), 1);
        assert_eq!(
            src.last_count(),
            TcpCount {
                owed: 1,
                established: 5
            }
        );
        assert_eq!(
            src.describe(),
            format!(
                "tcp connections owed a response on port 8080 via {}, {} \
                 (counts only connections with unread bytes; a lower bound)",
                v4.display(),
                v6.display()
            )
        );
        assert_eq!(
            src.detail().as_deref(),
            Some("1 of 5 connections have unread bytes")
        );
        std::fs::remove_file(&v6).unwrap();
        assert_eq!(src.sample_count().unwrap().established, 4);
        std::fs::remove_file(&v4).unwrap();
        let err = src.sample().unwrap_err();
        assert!(err.to_string().contains("tcp"), "{err}");
        assert!(TcpInflight::open_at(vec![v4], vec![]).is_err());
    }

    /// A real connection on this machine shows up in the agent's count.
    #[test]
    fn real_connections_are_counted_established() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut src = TcpInflight::open(vec![port]).unwrap();
        assert_eq!(src.sample_count().unwrap(), TcpCount::default());
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert_eq!(src.sample_count().unwrap().established, 1);
        // The client's side has the port as its remote port and must not count; a second
        // connection does.
        let client2 = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server2, _) = listener.accept().unwrap();
        assert_eq!(src.sample_count().unwrap().established, 2);
        drop((client, server, client2, server2));
    }

    #[test]
    fn long_tables_split_across_reads_and_odd_endings() {
        // Many lines through a small buffer: lines straddle reads; no final newline.
        let line = "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1152 1\n";
        let text = format!("{}{}", line.repeat(500), line.trim_end());
        let mut buf = vec![0; 64];
        let n = count_table(text.as_bytes(), &mut buf, &[8080], "t").unwrap();
        assert_eq!(n.established, 501);
        assert_eq!(buf.len(), 128, "grows only to fit a line");
        // CRLF and blank lines are harmless; a line too long for any buffer is an error.
        assert_eq!(
            established(&format!("\r\n{}\r\n\n", line.trim_end()), &[8080]),
            1
        );
        let long = format!("   1: {}", "A".repeat(MAX_LINE_BYTES));
        let err = count_connections_str(&long, &[8080]).unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
        // Not UTF-8 outside the fields that matter: still counted; inside them: an error.
        let mut bytes = line.as_bytes().to_vec();
        bytes.extend_from_slice(b"   2: 0100007F:1F90 0100007F:D431 01 0:0 \xff\xfe\n");
        assert_eq!(
            count_connections(&bytes[..], &[8080], "t")
                .unwrap()
                .established,
            2
        );
        assert!(count_connections(&b"   2: 0100007F:1F\xff 0 01\n"[..], &[8080], "t").is_err());
    }

    use std::io::Write as _;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    /// Waits up to 10 s for `src` to count `want`, sampling every 5 ms, and returns the
    /// last count. Socket state follows the peer's actions quickly on loopback but not
    /// synchronously (a FIN, a segment in flight), so tests wait for a condition instead
    /// of sleeping a fixed time.
    fn wait_for(src: &mut TcpInflight, want: TcpCount) -> TcpCount {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = src.sample_count().unwrap();
            if n == want || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lets the kernel's clock tick at least once. `tcp_info`'s ages are whole jiffies
    /// (10 ms at the smallest `HZ`, 100), and a request received in the same tick as the
    /// connection's last send reads as answered, so a test that wants "received after
    /// sent" must not send in that tick. A lower bound on elapsed time, not a race.
    fn cross_tick() {
        std::thread::sleep(Duration::from_millis(25));
    }

    /// `n` accepted connections to `listener`, as (client, server) pairs.
    fn connect_n(listener: &TcpListener, n: usize) -> Vec<(TcpStream, TcpStream)> {
        let addr = listener.local_addr().unwrap();
        (0..n)
            .map(|_| {
                let client = TcpStream::connect(addr).unwrap();
                let (server, _) = listener.accept().unwrap();
                (client, server)
            })
            .collect()
    }

    /// The counts `owed` of `established`.
    fn tc(owed: u32, established: u32) -> TcpCount {
        TcpCount { owed, established }
    }

    /// The server reads exactly `n` bytes of a request.
    fn read_request(server: &mut TcpStream, n: usize) {
        let mut buf = vec![0u8; n];
        server.read_exact(&mut buf).unwrap();
    }

    /// Both sources on `port`: netlink (checked to be on that path) and `/proc`.
    fn both_sources(port: u16) -> (TcpInflight, TcpInflight) {
        let netlink = TcpInflight::open(vec![port]).unwrap();
        assert_eq!(netlink.path, Path::Netlink, "{}", netlink.describe());
        let proc = TcpInflight::open_at(
            vec!["/proc/net/tcp".into(), "/proc/net/tcp6".into()],
            vec![port],
        )
        .unwrap();
        (netlink, proc)
    }

    /// Real sockets, counted by both paths: the server side of N connections, not the
    /// client side, not another port's connections, and none once they are closed.
    fn check_real_connections(bind: &str) {
        const N: usize = 5;
        let listener = TcpListener::bind(bind).unwrap();
        let port = listener.local_addr().unwrap().port();
        // Noise: connections to another port, whose clients have ephemeral local ports.
        let other = TcpListener::bind(bind).unwrap();
        let noise = connect_n(&other, 3);

        let (mut netlink, mut proc) = both_sources(port);
        assert_eq!(
            netlink.describe(),
            format!(
                "tcp connections owed a response on port {port} via netlink sock_diag (tcp_info)"
            )
        );
        assert!(proc.describe().ends_with(
            "via /proc/net/tcp, /proc/net/tcp6 \
             (counts only connections with unread bytes; a lower bound)"
        ));
        assert_eq!(netlink.sample_count().unwrap(), tc(0, 0));
        assert_eq!(proc.sample_count().unwrap(), tc(0, 0));

        // Fresh connections with no data are established and owe nothing.
        let conns = connect_n(&listener, N);
        assert_eq!(netlink.sample_count().unwrap(), tc(0, N as u32));
        assert_eq!(
            netlink.detail().as_deref(),
            Some("0 of 5 connections owe a response")
        );
        // The kernel-side filter returned only these sockets, not the noise.
        assert_eq!(netlink.netlink.as_ref().unwrap().last_returned, N as u32);
        assert_eq!(proc.sample_count().unwrap(), tc(0, N as u32));
        // The per-family requests, used where the single-walk one is refused, agree.
        let mut per_family = DiagCounter::new(&[port]).per_family_only();
        assert_eq!(per_family.count().unwrap(), tc(0, N as u32));
        assert_eq!(per_family.last_returned, N as u32);

        drop(conns);
        assert_eq!(wait_for(&mut netlink, tc(0, 0)), tc(0, 0));
        assert_eq!(wait_for(&mut proc, tc(0, 0)), tc(0, 0));
        assert_eq!(per_family.count().unwrap(), tc(0, 0));
        drop(noise);
    }

    /// One connection through a request's life: idle, unread, read and unanswered,
    /// answered, and a second request; netlink sees each, `/proc` only the unread one.
    fn check_request_lifecycle(bind: &str) {
        let listener = TcpListener::bind(bind).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mut netlink, mut proc) = both_sources(port);
        let mut conns = connect_n(&listener, 1);
        let (client, server) = &mut conns[0];

        // An idle accepted connection.
        cross_tick();
        assert_eq!(netlink.sample_count().unwrap(), tc(0, 1));
        assert_eq!(proc.sample_count().unwrap(), tc(0, 1));

        for round in 0..2 {
            // A request the server has not read: unread bytes, seen by both paths.
            client.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            assert_eq!(wait_for(&mut netlink, tc(1, 1)), tc(1, 1), "round {round}");
            assert_eq!(wait_for(&mut proc, tc(1, 1)), tc(1, 1), "round {round}");
            assert_eq!(
                netlink.detail().as_deref(),
                Some("1 of 1 connections owe a response")
            );

            // Read but not answered: netlink still counts it; /proc cannot (its lower
            // bound).
            read_request(server, 18);
            assert_eq!(wait_for(&mut netlink, tc(1, 1)), tc(1, 1), "round {round}");
            assert_eq!(wait_for(&mut proc, tc(0, 1)), tc(0, 1), "round {round}");
            // And stays counted while the service works, ageing: its age is the
            // time since the request arrived (whole jiffies, so a tick less at most).
            std::thread::sleep(Duration::from_millis(80));
            assert_eq!(netlink.sample_count().unwrap(), tc(1, 1), "round {round}");
            let ages = netlink.ages().unwrap();
            assert_eq!(ages.requests, 1, "round {round}");
            assert!(ages.oldest_ms >= 70, "round {round}: {ages:?}");
            assert_eq!(ages.mean_ms(), ages.oldest_ms, "round {round}");
            assert_eq!(proc.ages(), None, "/proc carries no times");

            // Answered: counts 0 again, and the client reading it changes nothing.
            server.write_all(b"HTTP/1.1 200 OK\r\n\r\n").unwrap();
            assert_eq!(wait_for(&mut netlink, tc(0, 1)), tc(0, 1), "round {round}");
            read_request(client, 19);
            cross_tick();
            assert_eq!(netlink.sample_count().unwrap(), tc(0, 1), "round {round}");
            assert_eq!(netlink.ages().map(|a| a.requests), Some(0), "round {round}");
            assert_eq!(proc.sample_count().unwrap(), tc(0, 1), "round {round}");
        }
    }

    /// Several connections in each state at once.
    fn check_mixed_connections(bind: &str) {
        let listener = TcpListener::bind(bind).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mut netlink, mut proc) = both_sources(port);
        // 3 idle, 2 unread, 4 read and unanswered, 3 answered.
        let (idle, unread, read, answered) = (3, 2, 4, 3);
        let mut conns = connect_n(&listener, idle + unread + read + answered);
        let total = conns.len() as u32;
        cross_tick();
        for (i, (client, server)) in conns.iter_mut().enumerate().skip(idle) {
            client.write_all(b"ping").unwrap();
            if i >= idle + unread {
                read_request(server, 4);
            }
            if i >= idle + unread + read {
                server.write_all(b"pong").unwrap();
            }
        }
        let owed = (unread + read) as u32;
        assert_eq!(wait_for(&mut netlink, tc(owed, total)), tc(owed, total));
        assert_eq!(
            netlink.detail(),
            Some(format!("{owed} of {total} connections owe a response"))
        );
        assert_eq!(
            wait_for(&mut proc, tc(unread as u32, total)),
            tc(unread as u32, total)
        );
        // Answer every request: nothing is owed.
        for (_, server) in conns.iter_mut().skip(idle).take(unread) {
            read_request(server, 4);
        }
        for (_, server) in conns.iter_mut().skip(idle).take(unread + read) {
            server.write_all(b"pong").unwrap();
        }
        assert_eq!(wait_for(&mut netlink, tc(0, total)), tc(0, total));
        assert_eq!(wait_for(&mut proc, tc(0, total)), tc(0, total));
    }

    #[test]
    fn netlink_and_proc_count_real_ipv4_connections() {
        check_real_connections("127.0.0.1:0");
    }

    #[test]
    fn netlink_and_proc_count_real_ipv6_connections() {
        check_real_connections(IPV6);
    }

    #[test]
    fn a_request_is_owed_until_answered_ipv4() {
        check_request_lifecycle("127.0.0.1:0");
    }

    #[test]
    fn a_request_is_owed_until_answered_ipv6() {
        check_request_lifecycle(IPV6);
    }

    #[test]
    fn mixed_connections_ipv4() {
        check_mixed_connections("127.0.0.1:0");
    }

    #[test]
    fn mixed_connections_ipv6() {
        check_mixed_connections(IPV6);
    }

    /// IPv6 loopback, which these tests require rather than skip: without it the IPv6
    /// path would go untested and the suite would still pass.
    const IPV6: &str = "[::1]:0";

    #[test]
    fn ipv6_loopback_is_available() {
        if let Err(e) = TcpListener::bind(IPV6) {
            panic!(
                "cannot bind {IPV6} ({e}): the IPv6 tests need IPv6 loopback \
                 (`ip -6 addr show lo` should list ::1; check net.ipv6.conf.lo.disable_ipv6)"
            );
        }
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
        assert_eq!(src.sample_count().unwrap(), tc(0, 2));
        assert!(
            src.describe().ends_with(
                "via /proc/net/tcp, /proc/net/tcp6 \
                 (counts only connections with unread bytes; a lower bound)"
            ),
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
        assert_eq!(src.sample_count().unwrap(), tc(0, 2));
        assert_eq!(
            src.path,
            Path::Proc {
                netlink_retry_in: 0
            }
        );
        assert_eq!(src.sample_count().unwrap(), tc(0, 2));
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
        assert_eq!(src.sample_count().unwrap(), tc(0, 2));
        assert_eq!(src.path, Path::Netlink);
        drop(conns);
    }
}
