//! In-flight requests as established TCP connections to the service's ports.
//!
//! Needs no change to the service, which is why it is the default. It counts
//! connections, not requests, so it suits services with one request per connection or
//! short keep-alive; behind a pooling proxy, use the Prometheus gauge instead.
//!
//! `/proc/net/tcp` shows the agent's network namespace: the agent must share the
//! service's (run on the host network, or as a sidecar in its pod).

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind};
use std::path::PathBuf;

use super::{InflightSource, SampleError};

/// The kernel's `TCP_ESTABLISHED` in the `st` column.
const ESTABLISHED: u8 = 0x01;

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
    let mut count = 0u32;
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| SampleError::parse(what, format!("line {}: {e}", i + 1)))?;
        let mut fields = line.split_whitespace();
        // The header's first field is `sl`; every socket line starts with `N:`.
        match fields.next() {
            Some(sl) if sl.ends_with(':') => {}
            _ => continue,
        }
        let bad = |why: &str| SampleError::parse(what, format!("line {}: {why}: {line:?}", i + 1));
        let local = fields.next().ok_or_else(|| bad("no local address"))?;
        let state = fields.nth(1).ok_or_else(|| bad("no state"))?;
        let port = local
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            .ok_or_else(|| bad("bad local address"))?;
        let state = u8::from_str_radix(state, 16).map_err(|_| bad("bad state"))?;
        if state == ESTABLISHED && ports.contains(&port) {
            count = count.saturating_add(1);
        }
    }
    Ok(count)
}

/// [`count_established`] on a string, for fixtures.
pub fn count_established_str(text: &str, ports: &[u16]) -> Result<u32, SampleError> {
    count_established(text.as_bytes(), ports, "tcp table")
}

/// Established connections to the service's ports, IPv4 and IPv6.
#[derive(Debug)]
pub struct TcpInflight {
    ports: Vec<u16>,
    files: Vec<PathBuf>,
}

impl TcpInflight {
    /// Counts from `/proc/net/tcp` and `/proc/net/tcp6`.
    pub fn open(ports: Vec<u16>) -> Result<Self, SampleError> {
        Self::open_at(vec!["/proc/net/tcp".into(), "/proc/net/tcp6".into()], ports)
    }

    /// Counts from other tables, such as `/proc/PID/net/tcp` to see into another
    /// process's network namespace. Missing tables are skipped (a host without IPv6 has
    /// no `tcp6`), but at least one must exist. Reads them once, so a problem shows now.
    pub fn open_at(files: Vec<PathBuf>, ports: Vec<u16>) -> Result<Self, SampleError> {
        if ports.is_empty() {
            return Err(SampleError::InvalidSpec(
                "tcp: at least one port is needed".into(),
            ));
        }
        let mut src = TcpInflight { ports, files };
        src.sample()?;
        Ok(src)
    }
}

impl InflightSource for TcpInflight {
    fn sample(&mut self) -> Result<u32, SampleError> {
        let mut total = 0u32;
        let mut first_missing = None;
        let mut read_any = false;
        for path in &self.files {
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
            total =
                total.saturating_add(count_established(BufReader::new(file), &self.ports, &what)?);
        }
        match first_missing {
            Some((path, e)) if !read_any => Err(SampleError::io(path, e)),
            _ => Ok(total),
        }
    }

    fn describe(&self) -> String {
        let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
        format!("tcp established to port {}", ports.join(","))
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
        assert_eq!(src.describe(), "tcp established to port 8080");
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
}
