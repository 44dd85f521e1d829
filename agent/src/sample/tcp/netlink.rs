#![allow(unsafe_code)]
//! Counting established TCP sockets, and those owed a response, through
//! `NETLINK_SOCK_DIAG`, the interface `ss` uses.
//!
//! Why not `/proc/net/tcp`: the kernel formats every socket of the namespace as text and
//! serves it one page (about 27 sockets) per `read`, each `read` re-entering the
//! established-hash iterator, and each of `tcp` and `tcp6` walks the whole hash. A
//! sock_diag dump walks the hash once, runs a small filter program (built here from the
//! service's ports) on each socket and sends back only the sockets that pass, as
//! binary records of about 120 bytes.
//!
//! What remains is the walk itself: the kernel visits every bucket of the established
//! hash (`tcp_ehash_entries`, sized from RAM at boot), matching sockets or not. That is
//! why the single-walk `TCPDIAG_GETSOCK` request is preferred to one
//! `SOCK_DIAG_BY_FAMILY` request per family.
//!
//! Each request asks for the `INET_DIAG_INFO` extension, so every returned record carries
//! the socket's `struct tcp_info`. Two of its fields, the milliseconds since data was
//! last sent and last received, and the record's `idiag_rqueue` (bytes received that the
//! service has not read) tell whether the service owes the connection a response
//! ([`owes_response`]). The kernel fills `tcp_info` only for the sockets that pass the
//! filter, so the extension adds work per matching socket, not to the walk.
//!
//! Everything the kernel sends is treated as untrusted bytes: [`parse_chunk`] and the
//! attribute walk in [`tcp_times`] check every length against the buffer and never
//! panic.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::TcpCount;
use crate::sample::OwedAges;
use crate::sample::SampleError;

/// `SOCK_DIAG_BY_FAMILY` from `linux/sock_diag.h` (not exported by libc).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `TCPDIAG_GETSOCK` from `linux/inet_diag.h`: the original inet_diag request. The
/// kernel answers it for both address families in one walk of its established hash
/// (`inet_diag_dump_compat` sets `AF_UNSPEC`), where `SOCK_DIAG_BY_FAMILY` needs one
/// request, and one walk, per family. The walk is most of the cost, so this halves it.
const TCPDIAG_GETSOCK: u16 = 18;
/// `INET_DIAG_REQ_BYTECODE` from `linux/inet_diag.h`: the request attribute carrying a
/// filter program.
const INET_DIAG_REQ_BYTECODE: u16 = 1;
/// Filter opcodes from `linux/inet_diag.h`. `S_GE`/`S_LE` exist in every kernel with
/// sock_diag; `S_EQ` only since 4.16, so equality is written as a `GE`/`LE` pair.
const INET_DIAG_BC_JMP: u8 = 1;
const INET_DIAG_BC_S_GE: u8 = 2;
const INET_DIAG_BC_S_LE: u8 = 3;
/// `TCP_ESTABLISHED` from `include/net/tcp_states.h`.
const TCP_ESTABLISHED: u8 = 1;
/// `INET_DIAG_INFO` from `linux/inet_diag.h`: the reply attribute holding `struct
/// tcp_info`, requested by setting bit `INET_DIAG_INFO - 1` of `idiag_ext`.
const INET_DIAG_INFO: u16 = 2;
/// The `idiag_ext` bits this module requests.
const IDIAG_EXT: u8 = 1 << (INET_DIAG_INFO - 1);
/// `NLA_TYPE_MASK` from `linux/netlink.h`: an attribute's type without the nested and
/// byte-order flags.
const NLA_TYPE_MASK: u16 = 0x3fff;

/// `sizeof(struct nlmsghdr)`.
const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct inet_diag_sockid)`: ports, addresses, interface, cookie.
const SOCKID_LEN: usize = 48;
/// `sizeof(struct inet_diag_req_v2)`: family, protocol, ext, pad, states, sockid.
const INET_DIAG_REQ_V2_LEN: usize = 8 + SOCKID_LEN;
/// `sizeof(struct inet_diag_req)`: family, src_len, dst_len, ext, sockid, states, dbs.
const INET_DIAG_REQ_LEN: usize = 4 + SOCKID_LEN + 8;
/// `sizeof(struct inet_diag_msg)`: the fixed part of each reply record.
const INET_DIAG_MSG_LEN: usize = 72;
/// `sizeof(struct nlattr)`.
const NLA_HDRLEN: usize = 4;
/// Offsets inside `struct inet_diag_msg`.
const MSG_STATE: usize = 1;
const MSG_SPORT: usize = 4;
/// `idiag_rqueue`: for an established socket, bytes received and not yet read.
const MSG_RQUEUE: usize = 56;
/// Offsets inside `struct tcp_info` (`linux/tcp.h`), both `__u32` milliseconds since
/// the event, counted in jiffies (4 ms steps at `HZ=250`).
const TCPI_LAST_DATA_SENT: usize = 44;
const TCPI_LAST_DATA_RECV: usize = 52;
/// `tcpi_data_segs_in` and `tcpi_data_segs_out` (Linux 4.6 and later): segments that
/// carried data, each way, since the connection began.
const TCPI_DATA_SEGS_IN: usize = 152;
const TCPI_DATA_SEGS_OUT: usize = 156;

/// The receive buffer. The kernel sizes its dump chunks to the largest buffer a socket
/// has received into (capped near 32 KiB), so 64 KiB always holds a whole chunk: an
/// answer takes one `recv` when nothing matches, and two otherwise (the records, then
/// `NLMSG_DONE` on its own) until a chunk's worth (about 250 sockets) match.
const RECV_BUF_BYTES: usize = 64 * 1024;
/// How long a `recv` may wait: the kernel answers at once, so a silent socket is broken,
/// and the sampling thread must not hang on it.
const RECV_TIMEOUT_SECS: libc::time_t = 2;
/// Above this many disjoint port ranges the filter program is not sent and ports are
/// matched in user space only; it keeps the program's jump offsets far inside `u16`.
const MAX_FILTER_RANGES: usize = 128;
/// How errors name this source.
const WHAT: &str = "netlink sock_diag";

/// A prebuilt dump request; only its sequence number changes between samples.
#[derive(Debug)]
struct Request {
    bytes: Vec<u8>,
    /// The `nlmsg_type` of the request, which the kernel reuses for its records.
    kind: u16,
}

/// How a dump ended, short of a broken socket or a malformed answer.
enum Dump {
    /// `NLMSG_DONE`: the matching sockets.
    Counted(TcpCount),
    /// The kernel refused the request with this errno (`NLMSG_ERROR`).
    Refused(i32),
}

/// Counts established TCP sockets, IPv4 and IPv6, whose local port is in a set, and
/// those of them owed a response, over one reusable netlink socket.
#[derive(Debug)]
pub(super) struct DiagCounter {
    /// Sorted and deduplicated, for `binary_search`.
    ports: Vec<u16>,
    /// `TCPDIAG_GETSOCK` for both families in one walk: tried first.
    both: Request,
    /// `SOCK_DIAG_BY_FAMILY` for `AF_INET` and `AF_INET6`: used if the kernel refuses
    /// `both` (a kernel or sandbox without the old request type).
    per_family: [Request; 2],
    /// Whether to send `both`; cleared for good when the kernel refuses it.
    use_both: bool,
    /// Opened lazily and dropped after any error, so that the next sample starts on a
    /// fresh socket with no half-read dump queued.
    sock: Option<OwnedFd>,
    seq: u32,
    buf: Vec<u8>,
    /// Sockets the kernel returned in the last sample, before the user-space port
    /// check: lets tests see that the kernel-side filter works.
    pub(super) last_returned: u32,
    /// The ages of the requests owed in the last sample.
    pub(super) ages: OwedAges,
}

impl DiagCounter {
    /// A counter for local ports `ports`. Opens nothing yet: [`DiagCounter::count`] does.
    pub(super) fn new(ports: &[u16]) -> Self {
        let ranges = port_ranges(ports);
        let filter = port_filter(&ranges);
        Self::with_filter(ports, filter.as_deref())
    }

    /// A counter sending `filter` as the requests' bytecode (tests pass a bad one).
    pub(super) fn with_filter(ports: &[u16], filter: Option<&[u8]>) -> Self {
        let mut ports = ports.to_vec();
        ports.sort_unstable();
        ports.dedup();
        let family = |f: libc::c_int| u8::try_from(f).unwrap_or(0);
        DiagCounter {
            ports,
            both: build_request(TCPDIAG_GETSOCK, family(libc::AF_UNSPEC), filter),
            per_family: [
                build_request(SOCK_DIAG_BY_FAMILY, family(libc::AF_INET), filter),
                build_request(SOCK_DIAG_BY_FAMILY, family(libc::AF_INET6), filter),
            ],
            use_both: true,
            sock: None,
            seq: 0,
            buf: vec![0; RECV_BUF_BYTES],
            last_returned: 0,
            ages: OwedAges::default(),
        }
    }

    /// The same counter, sending only the per-family requests (to test that path).
    #[cfg(test)]
    pub(super) fn per_family_only(mut self) -> Self {
        self.use_both = false;
        self
    }

    /// The established sockets on the ports, both families, and how many of them are
    /// owed a response.
    ///
    /// A failure on a socket kept from an earlier sample is retried once on a new
    /// socket, since a stale socket (a dump left half-read) is the likeliest cause.
    pub(super) fn count(&mut self) -> Result<TcpCount, SampleError> {
        let reused = self.sock.is_some();
        match self.count_once() {
            Ok(n) => Ok(n),
            Err(_) if reused => self.count_once(),
            Err(e) => Err(e),
        }
    }

    fn count_once(&mut self) -> Result<TcpCount, SampleError> {
        let result = self.dump_all();
        if result.is_err() {
            self.sock = None;
        }
        result
    }

    fn dump_all(&mut self) -> Result<TcpCount, SampleError> {
        let fd = match self.sock.take() {
            Some(fd) => fd,
            None => open_socket().map_err(|e| SampleError::io(WHAT, e))?,
        };
        let raw = fd.as_raw_fd();
        self.sock = Some(fd);
        self.last_returned = 0;
        self.ages = OwedAges::default();
        if self.use_both {
            match self.dump(raw, None)? {
                Dump::Counted(n) => return Ok(n),
                // A refusal is a complete answer, so the socket can go on.
                Dump::Refused(errno) => {
                    tracing::debug!(
                        error = %io::Error::from_raw_os_error(errno),
                        "TCPDIAG_GETSOCK refused; using SOCK_DIAG_BY_FAMILY per family"
                    );
                    self.use_both = false;
                    self.last_returned = 0;
                    self.ages = OwedAges::default();
                }
            }
        }
        let mut total = TcpCount::default();
        for family in 0..self.per_family.len() {
            match self.dump(raw, Some(family))? {
                Dump::Counted(n) => total = total.plus(n),
                Dump::Refused(errno) => {
                    return Err(SampleError::io(WHAT, io::Error::from_raw_os_error(errno)))
                }
            }
        }
        Ok(total)
    }

    /// One dump: sends the request (`both`, or `per_family[i]` for `Some(i)`) and reads
    /// chunks until the kernel ends the answer.
    fn dump(&mut self, fd: libc::c_int, family: Option<usize>) -> Result<Dump, SampleError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let req = match family {
            None => &mut self.both,
            Some(i) => match self.per_family.get_mut(i) {
                Some(req) => req,
                None => return Ok(Dump::Counted(TcpCount::default())),
            },
        };
        if let Some(field) = req.bytes.get_mut(8..12) {
            field.copy_from_slice(&seq.to_ne_bytes());
        }
        send_to_kernel(fd, &req.bytes).map_err(|e| SampleError::io(WHAT, e))?;
        let kind = req.kind;
        let mut matched = TcpCount::default();
        loop {
            let n = recv(fd, &mut self.buf).map_err(|e| SampleError::io(WHAT, e))?;
            let data = match n {
                0 => return Err(SampleError::parse(WHAT, "empty datagram before NLMSG_DONE")),
                n if n > self.buf.len() => {
                    // MSG_TRUNC reported the real size: part of the dump is lost.
                    return Err(SampleError::parse(
                        WHAT,
                        format!("{n}-byte datagram truncated to {}", self.buf.len()),
                    ));
                }
                n => &self.buf[..n],
            };
            let chunk = parse_chunk(data, seq, kind, &self.ports)?;
            matched = matched.plus(TcpCount {
                owed: chunk.owed,
                established: chunk.established,
            });
            self.ages = self.ages.plus(chunk.ages);
            self.last_returned = self.last_returned.saturating_add(chunk.sockets);
            if let Some(errno) = chunk.refused {
                return Ok(Dump::Refused(errno));
            }
            if chunk.done {
                return Ok(Dump::Counted(matched));
            }
        }
    }
}

/// What one received datagram held.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Socket records for this request.
    pub(crate) sockets: u32,
    /// Of those, established sockets whose local port is in the set.
    pub(crate) established: u32,
    /// Of those, the sockets owed a response ([`owes_response`]).
    pub(crate) owed: u32,
    /// The ages of the owed requests whose `tcp_info` was there: each one's
    /// `tcpi_last_data_recv`, the time since its request last received data.
    pub(crate) ages: OwedAges,
    /// `NLMSG_DONE` (or an `NLMSG_ERROR`) ended the answer.
    pub(crate) done: bool,
    /// The errno of an `NLMSG_ERROR`: the kernel refused the request.
    pub(crate) refused: Option<i32>,
}

/// Parses one datagram of a dump answering request `seq`, whose socket records have
/// message type `kind`, counting the established sockets whose local port is in
/// `ports` (sorted), and those of them owed a response.
///
/// Messages with another sequence number are skipped (leftovers of an earlier request).
/// An `NLMSG_ERROR` is reported in [`Chunk::refused`]; `NLMSG_DONE` carrying a negative
/// errno (a dump that failed midway) becomes [`SampleError::Io`]; a length that does not
/// fit the buffer, a record shorter than `struct inet_diag_msg`, or a matching record
/// whose attributes are malformed ([`tcp_times`]) becomes [`SampleError::Parse`]. Never
/// panics.
pub(crate) fn parse_chunk(
    buf: &[u8],
    seq: u32,
    kind: u16,
    ports: &[u16],
) -> Result<Chunk, SampleError> {
    let bad = |detail: String| SampleError::parse(format!("{WHAT} reply"), detail);
    let mut chunk = Chunk::default();
    let mut rest = buf;
    while !rest.is_empty() {
        let offset = buf.len() - rest.len();
        let (Some(len), Some(msg_kind), Some(msg_seq)) =
            (ne_u32(rest, 0), ne_u16(rest, 4), ne_u32(rest, 8))
        else {
            return Err(bad(format!(
                "{} bytes at offset {offset}: shorter than a message header",
                rest.len()
            )));
        };
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let Some(payload) = rest.get(NLMSG_HDRLEN..len) else {
            return Err(bad(format!(
                "message at offset {offset} claims {len} bytes, {} available",
                rest.len()
            )));
        };
        // Messages are padded to 4 bytes; the last one's padding may be absent.
        let next = len.saturating_add(3) & !3;
        rest = rest.get(next..).unwrap_or_default();
        if msg_seq != seq {
            continue;
        }
        match i32::from(msg_kind) {
            libc::NLMSG_DONE => {
                // Since 4.x the payload is the dump's final status; older kernels send 0.
                if let Some(errno) = ne_i32(payload, 0).filter(|&e| e < 0) {
                    return Err(SampleError::io(
                        WHAT,
                        io::Error::from_raw_os_error(errno.saturating_neg()),
                    ));
                }
                chunk.done = true;
                return Ok(chunk);
            }
            libc::NLMSG_ERROR => {
                let errno = ne_i32(payload, 0)
                    .ok_or_else(|| bad(format!("short NLMSG_ERROR at offset {offset}")))?;
                // Error 0 is an acknowledgement: nothing more will come either way.
                chunk.done = true;
                if errno != 0 {
                    chunk.refused = Some(errno.saturating_neg());
                }
                return Ok(chunk);
            }
            libc::NLMSG_OVERRUN => {
                return Err(bad(format!("NLMSG_OVERRUN at offset {offset}")));
            }
            _ if msg_kind == kind => {
                let (Some(&state), Some(sport)) =
                    (payload.get(MSG_STATE), be_u16(payload, MSG_SPORT))
                else {
                    return Err(bad(format!("short socket record at offset {offset}")));
                };
                if payload.len() < INET_DIAG_MSG_LEN {
                    return Err(bad(format!(
                        "socket record at offset {offset} has {} bytes, expected {INET_DIAG_MSG_LEN}",
                        payload.len()
                    )));
                }
                chunk.sockets = chunk.sockets.saturating_add(1);
                // The kernel already filtered on state (and on port when the filter was
                // sent); checking again keeps the count right without the filter.
                if state == TCP_ESTABLISHED && ports.binary_search(&sport).is_ok() {
                    chunk.established = chunk.established.saturating_add(1);
                    let rqueue = ne_u32(payload, MSG_RQUEUE).unwrap_or(0);
                    let attrs = payload.get(INET_DIAG_MSG_LEN..).unwrap_or_default();
                    let times = tcp_times(attrs).map_err(|detail| {
                        bad(format!("socket record at offset {offset}: {detail}"))
                    })?;
                    if owes_response(rqueue, times) {
                        chunk.owed = chunk.owed.saturating_add(1);
                        if let Some(t) = times {
                            chunk.ages.add(t.last_data_recv_ms);
                        }
                    }
                }
            }
            // NLMSG_NOOP and types this code does not know carry nothing to count.
            _ => {}
        }
    }
    Ok(chunk)
}

/// The two ages this module reads from a socket's `struct tcp_info`, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TcpTimes {
    /// `tcpi_last_data_sent`: since the socket last sent data.
    pub(super) last_data_sent_ms: u32,
    /// `tcpi_last_data_recv`: since the socket last received data.
    pub(super) last_data_recv_ms: u32,
    /// Whether the socket has received data but never sent any (`tcpi_data_segs_in >
    /// 0`, `tcpi_data_segs_out == 0`); false on kernels whose `tcp_info` lacks them.
    pub(super) never_answered: bool,
}

/// Whether the service owes a connection a response: it has bytes the service has not
/// read (`rqueue > 0`), or it received data more recently than it sent any.
///
/// Both ages are whole jiffies, so a request that arrives in the tick its predecessor's
/// response left reads as equal; equal means "answered" (the safe reading for an idle
/// pooled connection), unless the connection has received data and never sent any: a
/// fresh connection's send time is set when it is accepted, and a client that sends its
/// request at once (every proxy does) lands in that same tick. Without `tcp_info`
/// (`times` is `None`), only unread bytes count.
pub(super) fn owes_response(rqueue: u32, times: Option<TcpTimes>) -> bool {
    rqueue > 0
        || times.is_some_and(|t| {
            t.last_data_recv_ms < t.last_data_sent_ms
                || (t.last_data_recv_ms == t.last_data_sent_ms && t.never_answered)
        })
}

/// Finds `INET_DIAG_INFO` among the netlink attributes that follow a record's `struct
/// inet_diag_msg` and reads the two ages from it; `Ok(None)` if it is absent.
///
/// Each attribute is a `struct nlattr` (`u16` length including the 4-byte header, `u16`
/// type), padded to 4 bytes; the last one's padding may be absent. An attribute whose
/// length does not fit, or an `INET_DIAG_INFO` too short to hold the two fields, is an
/// error (a description of it). Never panics.
pub(super) fn tcp_times(attrs: &[u8]) -> Result<Option<TcpTimes>, String> {
    let mut rest = attrs;
    while !rest.is_empty() {
        let at = attrs.len() - rest.len();
        let (Some(len), Some(kind)) = (ne_u16(rest, 0), ne_u16(rest, 2)) else {
            return Err(format!(
                "{} bytes at attribute offset {at}: shorter than an attribute header",
                rest.len()
            ));
        };
        let len = usize::from(len);
        let Some(value) = rest.get(NLA_HDRLEN..len) else {
            return Err(format!(
                "attribute at offset {at} claims {len} bytes, {} available",
                rest.len()
            ));
        };
        if kind & NLA_TYPE_MASK == INET_DIAG_INFO {
            let (Some(sent), Some(recv)) = (
                ne_u32(value, TCPI_LAST_DATA_SENT),
                ne_u32(value, TCPI_LAST_DATA_RECV),
            ) else {
                return Err(format!(
                    "INET_DIAG_INFO of {} bytes, too short for tcp_info's times",
                    value.len()
                ));
            };
            let never_answered = matches!(
                (
                    ne_u32(value, TCPI_DATA_SEGS_IN),
                    ne_u32(value, TCPI_DATA_SEGS_OUT)
                ),
                (Some(segs_in), Some(0)) if segs_in > 0
            );
            return Ok(Some(TcpTimes {
                last_data_sent_ms: sent,
                last_data_recv_ms: recv,
                never_answered,
            }));
        }
        let next = (len + 3) & !3;
        rest = rest.get(next..).unwrap_or_default();
    }
    Ok(None)
}

fn ne_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn ne_i32(b: &[u8], at: usize) -> Option<i32> {
    ne_u32(b, at).map(|v| i32::from_ne_bytes(v.to_ne_bytes()))
}

fn ne_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn be_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

/// `ports` as sorted, disjoint, non-adjacent inclusive ranges: one filter block each.
pub(super) fn port_ranges(ports: &[u16]) -> Vec<(u16, u16)> {
    let mut sorted = ports.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<(u16, u16)> = Vec::new();
    for p in sorted {
        match ranges.last_mut() {
            Some((_, hi)) if hi.checked_add(1) == Some(p) => *hi = p,
            _ => ranges.push((p, p)),
        }
    }
    ranges
}

/// An `inet_diag` filter program accepting the sockets whose local port is in one of
/// `ranges`; `None` when there are no ranges or too many.
///
/// The kernel runs it per socket: an op's `yes`/`no` is the byte offset to jump by;
/// landing exactly on the end accepts, jumping 4 bytes past it rejects. Per range:
///
/// ```text
/// S_GE lo (yes: next op, no: next range)   ; 8 bytes, the port is in a follow-on op
/// S_LE hi (yes: next op, no: next range)   ; 8 bytes
/// JMP     (no: the end = accept)           ; 4 bytes, omitted after the last range
/// ```
///
/// where "next range" after the last one is end + 4 (reject). The kernel's audit walks
/// the `yes` chain, so every `yes` must land on an op, which this layout guarantees.
pub(super) fn port_filter(ranges: &[(u16, u16)]) -> Option<Vec<u8>> {
    const BLOCK: usize = 16;
    const JMP: usize = 4;
    if ranges.is_empty() || ranges.len() > MAX_FILTER_RANGES {
        return None;
    }
    let total = ranges.len() * (BLOCK + JMP) - JMP;
    let mut bc = Vec::with_capacity(total);
    // struct inet_diag_bc_op { u8 code; u8 yes; u16 no; }, native endian.
    fn op(bc: &mut Vec<u8>, code: u8, yes: u8, no: usize) -> Option<()> {
        bc.extend_from_slice(&[code, yes]);
        bc.extend_from_slice(&u16::try_from(no).ok()?.to_ne_bytes());
        Some(())
    }
    for (i, &(lo, hi)) in ranges.iter().enumerate() {
        let start = bc.len();
        // The next range's first op, or end + 4 after the last range.
        let next = start + BLOCK + JMP;
        op(&mut bc, INET_DIAG_BC_S_GE, 8, next - start)?;
        op(&mut bc, 0, 0, usize::from(lo))?;
        op(&mut bc, INET_DIAG_BC_S_LE, 8, next - (start + 8))?;
        op(&mut bc, 0, 0, usize::from(hi))?;
        if i + 1 < ranges.len() {
            let here = bc.len();
            op(&mut bc, INET_DIAG_BC_JMP, 4, total - here)?;
        }
    }
    Some(bc)
}

/// A dump request of type `kind` (`SOCK_DIAG_BY_FAMILY` or `TCPDIAG_GETSOCK`) for
/// established TCP sockets of `family` with their `tcp_info` (`INET_DIAG_INFO`), with
/// `filter` as its bytecode attribute. The sequence number (bytes 8..12) is zero.
fn build_request(kind: u16, family: u8, filter: Option<&[u8]>) -> Request {
    build_request_ext(kind, family, filter, IDIAG_EXT)
}

/// [`build_request`] asking for the extensions `ext` (tests measure the cost of none).
fn build_request_ext(kind: u16, family: u8, filter: Option<&[u8]>, ext: u8) -> Request {
    let filter = filter.filter(|bc| NLA_HDRLEN + bc.len() <= usize::from(u16::MAX) - 3);
    let attr_len = filter.map_or(0, |bc| NLA_HDRLEN + bc.len());
    let body_len = if kind == SOCK_DIAG_BY_FAMILY {
        INET_DIAG_REQ_V2_LEN
    } else {
        INET_DIAG_REQ_LEN
    };
    let len = NLMSG_HDRLEN + body_len + attr_len;
    let flags = u16::try_from(libc::NLM_F_REQUEST | libc::NLM_F_DUMP).unwrap_or(0x301);
    let states = (1u32 << TCP_ESTABLISHED).to_ne_bytes();
    let mut req = Vec::with_capacity(len);
    // struct nlmsghdr
    req.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    req.extend_from_slice(&kind.to_ne_bytes());
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_seq, set per request
    req.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel fills it in
    if kind == SOCK_DIAG_BY_FAMILY {
        // struct inet_diag_req_v2: family, protocol, extensions, pad, states, then the
        // sockid, which a dump ignores.
        let tcp = u8::try_from(libc::IPPROTO_TCP).unwrap_or(6);
        req.extend_from_slice(&[family, tcp, ext, 0]);
        req.extend_from_slice(&states);
        req.extend_from_slice(&[0; SOCKID_LEN]);
    } else {
        // struct inet_diag_req: family (ignored by a dump), no address prefixes, the
        // extensions, the sockid, states, and the unused table mask. The message type
        // says TCP.
        req.extend_from_slice(&[family, 0, 0, ext]);
        req.extend_from_slice(&[0; SOCKID_LEN]);
        req.extend_from_slice(&states);
        req.extend_from_slice(&0u32.to_ne_bytes());
    }
    if let Some(bc) = filter {
        let attr_len = u16::try_from(NLA_HDRLEN + bc.len()).unwrap_or(u16::MAX);
        req.extend_from_slice(&attr_len.to_ne_bytes());
        req.extend_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
        req.extend_from_slice(bc);
    }
    Request { bytes: req, kind }
}

/// A `NETLINK_SOCK_DIAG` socket with a receive timeout.
fn open_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns; OwnedFd closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let timeout = libc::timeval {
        tv_sec: RECV_TIMEOUT_SECS,
        tv_usec: 0,
    };
    // SAFETY: the option value points to a live timeval of the length passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::from_ref(&timeout).cast(),
            socklen_of::<libc::timeval>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn socklen_of<T>() -> libc::socklen_t {
    libc::socklen_t::try_from(std::mem::size_of::<T>()).unwrap_or(libc::socklen_t::MAX)
}

/// Sends `msg` to the kernel (netlink port id 0). The socket binds itself on first send.
fn send_to_kernel(fd: libc::c_int, msg: &[u8]) -> io::Result<()> {
    // SAFETY: sockaddr_nl is plain integers, for which all-zero is valid.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::sa_family_t::try_from(libc::AF_NETLINK).unwrap_or(16);
    loop {
        // SAFETY: `msg` and `kernel` are live for the call and their lengths are passed.
        let sent = unsafe {
            libc::sendto(
                fd,
                msg.as_ptr().cast(),
                msg.len(),
                0,
                std::ptr::from_ref(&kernel).cast(),
                socklen_of::<libc::sockaddr_nl>(),
            )
        };
        match usize::try_from(sent) {
            Ok(n) if n == msg.len() => return Ok(()),
            Ok(n) => return Err(io::Error::other(format!("sent {n} of {} bytes", msg.len()))),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Receives one datagram into `buf`. Returns its full length, which exceeds
/// `buf.len()` if it was truncated (`MSG_TRUNC`).
fn recv(fd: libc::c_int, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is live and writable for `buf.len()` bytes.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        match usize::try_from(n) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("no answer from the kernel in {RECV_TIMEOUT_SECS} s"),
                        ))
                    }
                    _ => return Err(e),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One netlink message: header plus payload, padded to 4 bytes.
    fn msg(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let len = NLMSG_HDRLEN + payload.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&2u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&4242u32.to_ne_bytes());
        m.extend_from_slice(payload);
        m.resize((m.len() + 3) & !3, 0);
        m
    }

    /// One netlink attribute, padded to 4 bytes.
    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((NLA_HDRLEN + value.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(value);
        a.resize((a.len() + 3) & !3, 0);
        a
    }

    /// A `struct tcp_info` of the kernel's current size with the two ages set.
    fn tcp_info(sent_ms: u32, recv_ms: u32) -> Vec<u8> {
        let mut info = vec![0u8; 232];
        info[TCPI_LAST_DATA_SENT..TCPI_LAST_DATA_SENT + 4].copy_from_slice(&sent_ms.to_ne_bytes());
        info[TCPI_LAST_DATA_RECV..TCPI_LAST_DATA_RECV + 4].copy_from_slice(&recv_ms.to_ne_bytes());
        info
    }

    /// The payload of an `inet_diag_msg` record followed by `attrs`.
    fn record(state: u8, sport: u16, rqueue: u32, attrs: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; INET_DIAG_MSG_LEN];
        p[0] = 2;
        p[MSG_STATE] = state;
        p[MSG_SPORT..MSG_SPORT + 2].copy_from_slice(&sport.to_be_bytes());
        p[MSG_RQUEUE..MSG_RQUEUE + 4].copy_from_slice(&rqueue.to_ne_bytes());
        p.extend_from_slice(attrs);
        p
    }

    /// A record as the kernel sends it for an idle socket: `INET_DIAG_INFO` (equal ages)
    /// and `INET_DIAG_SHUTDOWN`.
    fn socket(state: u8, sport: u16) -> Vec<u8> {
        owed_socket(state, sport, 0, Some((500, 500)))
    }

    /// A record with `rqueue` unread bytes and, if given, `tcp_info` with the ages
    /// (sent, received).
    fn owed_socket(state: u8, sport: u16, rqueue: u32, times: Option<(u32, u32)>) -> Vec<u8> {
        let mut attrs = Vec::new();
        if let Some((sent, recv)) = times {
            attrs.extend(attr(INET_DIAG_INFO, &tcp_info(sent, recv)));
        }
        attrs.extend(attr(8, &[0])); // INET_DIAG_SHUTDOWN
        msg(
            SOCK_DIAG_BY_FAMILY,
            7,
            &record(state, sport, rqueue, &attrs),
        )
    }

    fn done(seq: u32, status: i32) -> Vec<u8> {
        msg(libc::NLMSG_DONE as u16, seq, &status.to_ne_bytes())
    }

    /// `parse_chunk` for `SOCK_DIAG_BY_FAMILY` records.
    fn parse(buf: &[u8], seq: u32, ports: &[u16]) -> Result<Chunk, SampleError> {
        parse_chunk(buf, seq, SOCK_DIAG_BY_FAMILY, ports)
    }

    #[test]
    fn counts_matching_established_records_until_done() {
        let mut buf = Vec::new();
        buf.extend(socket(TCP_ESTABLISHED, 8080));
        buf.extend(socket(TCP_ESTABLISHED, 8443));
        buf.extend(socket(TCP_ESTABLISHED, 9999)); // unfiltered: wrong port
        buf.extend(socket(8, 8080)); // CLOSE_WAIT
        buf.extend(msg(SOCK_DIAG_BY_FAMILY, 6, &socket(1, 8080)[16..])); // stale seq
        buf.extend(msg(TCPDIAG_GETSOCK, 7, &socket(1, 8080)[16..])); // not our type
        buf.extend(msg(libc::NLMSG_NOOP as u16, 7, &[]));
        let ports = [8080, 8443];
        let chunk = parse(&buf, 7, &ports).unwrap();
        let want = Chunk {
            sockets: 4,
            established: 2,
            ..Chunk::default()
        };
        assert_eq!(chunk, want);
        buf.extend(done(7, 0));
        buf.extend(socket(TCP_ESTABLISHED, 8080)); // after DONE: ignored
        let chunk = parse(&buf, 7, &ports).unwrap();
        assert_eq!(chunk, Chunk { done: true, ..want });
        // The same records answer a TCPDIAG_GETSOCK request only if typed so.
        assert_eq!(
            parse_chunk(&buf, 7, TCPDIAG_GETSOCK, &ports)
                .unwrap()
                .established,
            1
        );
        // A DONE for another request does not end this one.
        assert!(!parse(&done(6, 0), 7, &ports).unwrap().done);
        assert_eq!(parse(&[], 7, &ports).unwrap(), Chunk::default());
    }

    #[test]
    fn kernel_errors_are_refusals_or_io_errors() {
        let ebusy = msg(libc::NLMSG_ERROR as u16, 3, &(-libc::EBUSY).to_ne_bytes());
        let chunk = parse(&ebusy, 3, &[80]).unwrap();
        assert_eq!((chunk.done, chunk.refused), (true, Some(libc::EBUSY)));
        let ack = msg(libc::NLMSG_ERROR as u16, 3, &0i32.to_ne_bytes());
        assert_eq!(
            parse(&ack, 3, &[80]).unwrap(),
            Chunk {
                done: true,
                ..Chunk::default()
            }
        );
        match parse(&done(3, -libc::ENOBUFS), 3, &[80]) {
            Err(SampleError::Io { source, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOBUFS))
            }
            other => panic!("{other:?}"),
        }
        // i32::MIN must not overflow when negated.
        assert!(parse(&done(3, i32::MIN), 3, &[80]).is_err());
        let min = msg(libc::NLMSG_ERROR as u16, 3, &i32::MIN.to_ne_bytes());
        assert_eq!(parse(&min, 3, &[80]).unwrap().refused, Some(i32::MAX));
        // A DONE without payload (very old kernels) is still the end.
        assert!(parse(&msg(3, 3, &[]), 3, &[80]).unwrap().done);
    }

    #[test]
    fn truncated_and_garbage_buffers_are_errors_not_panics() {
        let mut good = socket(TCP_ESTABLISHED, 80);
        good.extend(done(7, 0));
        // Every prefix cut inside a message is an error; cuts on a boundary parse
        // (without `done` before the DONE message is whole).
        for cut in 0..good.len() {
            match parse(&good[..cut], 7, &[80]) {
                Ok(chunk) => assert!(
                    !chunk.done && (cut == 0 || cut == good.len() - 20),
                    "cut {cut}"
                ),
                Err(SampleError::Parse { .. }) => {}
                Err(e) => panic!("cut {cut}: {e}"),
            }
        }
        assert_eq!(parse(&good, 7, &[80]).unwrap().established, 1);
        let mut short_len = good.clone();
        short_len[0..4].copy_from_slice(&8u32.to_ne_bytes()); // shorter than a header
        assert!(parse(&short_len, 7, &[80]).is_err());
        let mut huge_len = good.clone();
        huge_len[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(parse(&huge_len, 7, &[80]).is_err());
        let short_record = msg(SOCK_DIAG_BY_FAMILY, 7, &[0, 1, 0, 0, 0, 80]);
        assert!(parse(&short_record, 7, &[80]).is_err());
        let tiny_record = msg(SOCK_DIAG_BY_FAMILY, 7, &[0]);
        assert!(parse(&tiny_record, 7, &[80]).is_err());
        let short_error = msg(libc::NLMSG_ERROR as u16, 7, &[1, 2]);
        assert!(parse(&short_error, 7, &[80]).is_err());
        let overrun = msg(libc::NLMSG_OVERRUN as u16, 7, &[]);
        assert!(parse(&overrun, 7, &[80]).is_err());
        // An unpadded last message is accepted.
        let mut unpadded = msg(libc::NLMSG_DONE as u16, 7, &[0, 0, 0, 0, 9]);
        unpadded[0..4].copy_from_slice(&21u32.to_ne_bytes());
        unpadded.truncate(21);
        assert!(parse(&unpadded, 7, &[80]).unwrap().done);
    }

    #[test]
    fn owed_when_received_after_last_send_or_unread() {
        let mut buf = Vec::new();
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 0, Some((500, 500)))); // idle: equal
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 0, Some((900, 40)))); // read, unanswered
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 0, Some((40, 900)))); // answered
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 12, Some((40, 900)))); // unread
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 0, None)); // no tcp_info: 0
        buf.extend(owed_socket(TCP_ESTABLISHED, 80, 3, None)); // no tcp_info, unread
        buf.extend(owed_socket(TCP_ESTABLISHED, 81, 3, Some((9, 1)))); // other port
        buf.extend(owed_socket(8, 80, 3, Some((9, 1)))); // CLOSE_WAIT
        let chunk = parse(&buf, 7, &[80]).unwrap();
        assert_eq!((chunk.sockets, chunk.established, chunk.owed), (8, 6, 3));

        // INET_DIAG_INFO anywhere among the attributes, with the type's flag bits set,
        // or as the last attribute without padding.
        let info = attr(INET_DIAG_INFO | 0x8000, &tcp_info(7, 3));
        let mut attrs = attr(4, b"cubic\0");
        attrs.extend(&info);
        attrs.extend(attr(8, &[0]));
        let rec = msg(SOCK_DIAG_BY_FAMILY, 7, &record(1, 80, 0, &attrs));
        assert_eq!(parse(&rec, 7, &[80]).unwrap().owed, 1);
        let mut odd = attr(4, b"cubic\0");
        odd.extend(attr(INET_DIAG_INFO, &tcp_info(7, 3)[..57]));
        odd.truncate(odd.len() - 3);
        assert_eq!(
            tcp_times(&odd).unwrap(),
            Some(TcpTimes {
                last_data_sent_ms: 7,
                last_data_recv_ms: 3,
                never_answered: false,
            })
        );
        assert_eq!(tcp_times(&[]).unwrap(), None);

        // Equal ages: answered, unless data came in and none ever went out (a fresh
        // connection whose request arrived in the tick it was accepted).
        let mut fresh = tcp_info(500, 500);
        fresh[TCPI_DATA_SEGS_IN..TCPI_DATA_SEGS_IN + 4].copy_from_slice(&1u32.to_ne_bytes());
        let rec = msg(
            SOCK_DIAG_BY_FAMILY,
            7,
            &record(1, 80, 0, &attr(INET_DIAG_INFO, &fresh)),
        );
        assert_eq!(parse(&rec, 7, &[80]).unwrap().owed, 1);
        fresh[TCPI_DATA_SEGS_OUT..TCPI_DATA_SEGS_OUT + 4].copy_from_slice(&1u32.to_ne_bytes());
        let rec = msg(
            SOCK_DIAG_BY_FAMILY,
            7,
            &record(1, 80, 0, &attr(INET_DIAG_INFO, &fresh)),
        );
        assert_eq!(parse(&rec, 7, &[80]).unwrap().owed, 0);
    }

    #[test]
    fn malformed_attributes_are_errors_not_panics() {
        let good = attr(INET_DIAG_INFO, &tcp_info(7, 3));
        // Every cut inside the attribute is an error.
        for cut in 1..good.len() {
            assert!(tcp_times(&good[..cut]).is_err(), "cut {cut}");
        }
        // A length below the header, or beyond the buffer.
        for len in [0u16, 1, 3, good.len() as u16 + 1, u16::MAX] {
            let mut bad = good.clone();
            bad[0..2].copy_from_slice(&len.to_ne_bytes());
            assert!(tcp_times(&bad).is_err(), "len {len}");
        }
        // INET_DIAG_INFO too short for the receive time (at 52..56).
        assert!(tcp_times(&attr(INET_DIAG_INFO, &[0; 55])).is_err());
        assert!(tcp_times(&attr(INET_DIAG_INFO, &[0; 56])).is_ok());
        // A malformed attribute in a matching record fails the chunk; in a record the
        // port check drops, it is not read.
        let mut attrs = attr(8, &[0]);
        attrs.extend_from_slice(&[9, 9]);
        let rec = msg(SOCK_DIAG_BY_FAMILY, 7, &record(1, 80, 0, &attrs));
        match parse(&rec, 7, &[80]) {
            Err(SampleError::Parse { detail, .. }) => {
                assert!(detail.contains("attribute"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(parse(&rec, 7, &[81]).unwrap().sockets, 1);
    }

    proptest! {
        /// The attribute walk on arbitrary bytes.
        #[test]
        fn arbitrary_attributes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            let _ = tcp_times(&bytes);
        }

        /// `INET_DIAG_INFO` among arbitrary other attributes is found, with its values;
        /// a corrupted length somewhere is an error or a result, never a panic.
        #[test]
        fn info_is_found_among_other_attributes(
            before in proptest::collection::vec(
                (0u16..=20, proptest::collection::vec(any::<u8>(), 0..40)), 0..5),
            after in proptest::collection::vec(
                (0u16..=20, proptest::collection::vec(any::<u8>(), 0..40)), 0..5),
            sent in any::<u32>(),
            recv in any::<u32>(),
            info_len in 56usize..300,
            corrupt_at in any::<prop::sample::Index>(),
            corrupt_len in any::<u16>(),
        ) {
            let mut attrs = Vec::new();
            for (kind, value) in &before {
                let kind = if *kind == INET_DIAG_INFO { 1 } else { *kind };
                attrs.extend(attr(kind, value));
            }
            let mut info = tcp_info(sent, recv);
            info.resize(info_len, 0);
            attrs.extend(attr(INET_DIAG_INFO, &info));
            for (kind, value) in &after {
                attrs.extend(attr(*kind, value));
            }
            let want = TcpTimes { last_data_sent_ms: sent, last_data_recv_ms: recv, never_answered: false };
            prop_assert_eq!(tcp_times(&attrs), Ok(Some(want)));
            let rec = msg(SOCK_DIAG_BY_FAMILY, 1, &record(1, 80, 0, &attrs));
            let chunk = parse(&rec, 1, &[80]).unwrap();
            prop_assert_eq!(chunk.owed, u32::from(recv < sent));

            // Corrupt one 4-byte-aligned position's length field.
            if !attrs.is_empty() {
                let at = corrupt_at.index(attrs.len() / 4) * 4;
                if at + 2 <= attrs.len() {
                    attrs[at..at + 2].copy_from_slice(&corrupt_len.to_ne_bytes());
                }
                let _ = tcp_times(&attrs);
                let rec = msg(SOCK_DIAG_BY_FAMILY, 1, &record(1, 80, 0, &attrs));
                let _ = parse(&rec, 1, &[80]);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            seq in 0u32..3,
        ) {
            let _ = parse(&bytes, seq, &[0, 80, 8080]);
        }

        /// Well-formed headers with arbitrary payloads and corrupted lengths.
        #[test]
        fn corrupted_lengths_never_panic(
            payload in proptest::collection::vec(any::<u8>(), 0..200),
            kind in prop_oneof![Just(1u16), Just(2), Just(3), Just(4), Just(18), Just(20), any::<u16>()],
            len in prop_oneof![0u32..200, any::<u32>()],
        ) {
            let mut m = msg(kind, 1, &payload);
            m[0..4].copy_from_slice(&len.to_ne_bytes());
            let _ = parse(&m, 1, &[80]);
            let _ = parse_chunk(&m, 1, TCPDIAG_GETSOCK, &[80]);
        }
    }

    /// The kernel's `inet_diag_bc_run`, for the port opcodes this module emits.
    fn run(bc: &[u8], sport: u16) -> bool {
        let mut at = 0usize;
        let mut len = bc.len() as isize;
        while len > 0 {
            let op = &bc[at..at + 4];
            let (code, yes, no) = (op[0], op[1], u16::from_ne_bytes([op[2], op[3]]));
            let arg = || u16::from_ne_bytes([bc[at + 6], bc[at + 7]]);
            let ok = match code {
                INET_DIAG_BC_JMP => false,
                INET_DIAG_BC_S_GE => sport >= arg(),
                INET_DIAG_BC_S_LE => sport <= arg(),
                other => panic!("unexpected opcode {other}"),
            };
            let step = if ok {
                usize::from(yes)
            } else {
                usize::from(no)
            };
            at += step;
            len -= step as isize;
        }
        len == 0
    }

    /// The kernel's `inet_diag_bc_audit` checks for these opcodes.
    fn audit(bc: &[u8]) -> bool {
        let valid_cc = |mut at: usize, cc: isize| {
            let mut len = bc.len() as isize;
            while len >= 0 {
                if cc > len {
                    return false;
                }
                if cc == len {
                    return true;
                }
                let yes = bc[at + 1] as isize;
                if yes < 4 || yes & 3 != 0 {
                    return false;
                }
                len -= yes;
                at += yes as usize;
            }
            false
        };
        let mut at = 0usize;
        let mut len = bc.len() as isize;
        while len > 0 {
            let op = &bc[at..at + 4];
            let (code, yes, no) = (
                op[0],
                op[1] as isize,
                u16::from_ne_bytes([op[2], op[3]]) as isize,
            );
            let min_len = match code {
                INET_DIAG_BC_S_GE | INET_DIAG_BC_S_LE => 8,
                INET_DIAG_BC_JMP => 4,
                _ => return false,
            };
            if len < min_len || no < min_len || no > len + 4 || no & 3 != 0 {
                return false;
            }
            if no < len && !valid_cc(0, len - no) {
                return false;
            }
            if yes < min_len || yes > len + 4 || yes & 3 != 0 {
                return false;
            }
            at += yes as usize;
            len -= yes;
        }
        len == 0
    }

    #[test]
    fn filter_program_accepts_exactly_the_ports() {
        let sets: [&[u16]; 7] = [
            &[8080],
            &[0],
            &[65535],
            &[80, 443],
            &[443, 80, 80, 81, 82, 8080, 8443, 65535],
            &[1, 3, 5, 7, 9, 11],
            &[0, 65535],
        ];
        for ports in sets {
            let bc = port_filter(&port_ranges(ports)).unwrap();
            assert!(audit(&bc), "{ports:?}: the kernel would reject the program");
            for sport in 0..=u16::MAX {
                assert_eq!(
                    run(&bc, sport),
                    ports.contains(&sport),
                    "{ports:?} at {sport}"
                );
            }
        }
        assert_eq!(port_ranges(&[81, 80, 82, 90]), vec![(80, 82), (90, 90)]);
        assert!(port_filter(&[]).is_none());
        let many: Vec<u16> = (0..=MAX_FILTER_RANGES as u16).map(|p| p * 2).collect();
        assert!(port_filter(&port_ranges(&many)).is_none());
        let most: Vec<u16> = (1..=MAX_FILTER_RANGES as u16).map(|p| p * 2).collect();
        let bc = port_filter(&port_ranges(&most)).unwrap();
        assert!(audit(&bc));
        assert!(run(&bc, 2) && run(&bc, 256) && !run(&bc, 3) && !run(&bc, 258));
    }

    #[test]
    fn request_layouts() {
        let bc = port_filter(&[(80, 80)]).unwrap();
        let v2 = build_request(SOCK_DIAG_BY_FAMILY, 2, Some(&bc)).bytes;
        assert_eq!(v2.len(), 16 + 56 + 4 + 16);
        assert_eq!(ne_u32(&v2, 0), Some(v2.len() as u32));
        assert_eq!(ne_u16(&v2, 4), Some(SOCK_DIAG_BY_FAMILY));
        assert_eq!(ne_u16(&v2, 6), Some(0x301)); // NLM_F_REQUEST | NLM_F_DUMP
        assert_eq!(&v2[16..20], &[2, 6, 1 << (INET_DIAG_INFO - 1), 0]);
        assert_eq!(ne_u32(&v2, 20), Some(1 << TCP_ESTABLISHED));
        assert_eq!(ne_u16(&v2, 72), Some(20));
        assert_eq!(ne_u16(&v2, 74), Some(INET_DIAG_REQ_BYTECODE));
        assert_eq!(&v2[76..], &bc[..]);
        assert_eq!(build_request(SOCK_DIAG_BY_FAMILY, 10, None).bytes.len(), 72);

        let compat = build_request(TCPDIAG_GETSOCK, 0, Some(&bc)).bytes;
        assert_eq!(compat.len(), 16 + 60 + 4 + 16);
        assert_eq!(ne_u16(&compat, 4), Some(TCPDIAG_GETSOCK));
        assert_eq!(&compat[16..20], &[0, 0, 0, 1 << (INET_DIAG_INFO - 1)]);
        assert_eq!(ne_u32(&compat, 16 + 52), Some(1 << TCP_ESTABLISHED));
        assert_eq!(ne_u16(&compat, 76), Some(20));
        assert_eq!(ne_u16(&compat, 78), Some(INET_DIAG_REQ_BYTECODE));
    }

    /// Both request types count the same real sockets; tcp.rs tests the counts.
    #[test]
    fn kernel_answers_both_request_types() {
        let mut both = DiagCounter::new(&[9]);
        assert_eq!(both.count().unwrap(), TcpCount::default());
        assert!(both.use_both, "the kernel refused TCPDIAG_GETSOCK");
        let mut per_family = DiagCounter::new(&[9]).per_family_only();
        assert_eq!(per_family.count().unwrap(), TcpCount::default());
    }

    /// A kernel refusing the single-walk request is asked per family instead.
    #[test]
    fn a_refused_single_walk_request_falls_back_to_per_family() {
        let mut counter = DiagCounter::new(&[9]);
        // An invalid filter opcode in that request only: the kernel answers EINVAL.
        counter.both = build_request(TCPDIAG_GETSOCK, 0, Some(&[0xff, 4, 8, 0]));
        assert_eq!(counter.count().unwrap(), TcpCount::default());
        assert!(!counter.use_both);
        assert_eq!(counter.count().unwrap(), TcpCount::default());
    }

    /// A socket closed under the counter is replaced on the next sample.
    #[test]
    fn netlink_reopens_a_broken_socket() {
        let mut counter = DiagCounter::new(&[9]);
        assert_eq!(counter.count().unwrap(), TcpCount::default());
        assert!(counter.sock.is_some());
        // Replace the socket by one that is not netlink: every call on it fails.
        counter.sock = Some(std::fs::File::open("/dev/null").unwrap().into());
        assert_eq!(counter.count().unwrap(), TcpCount::default());
    }
}
