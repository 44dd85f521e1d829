//! A tiny real HTTP/1.1 backend for the load-balancer tests: it answers every request
//! with `200` and a body naming itself, so a client can count where each request went.
//!
//! Standard library only: a `TcpListener` on 127.0.0.1 and one thread per connection,
//! at most [`MAX_CONNECTIONS`] at once. Keep-alive is supported (HAProxy reuses server
//! connections); connections that close without a request, like TCP health checks, are
//! not counted. Stopped on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 128;
/// How long a connection may sit idle between requests.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a blocked reader looks at the stop flag.
const READ_TICK: Duration = Duration::from_millis(200);
/// The longest request head accepted.
const MAX_HEAD: usize = 16 * 1024;

/// A running backend. Stopped on drop.
pub struct Backend {
    /// Its name, the body of every answer.
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

struct Ctx {
    name: String,
    burn: Duration,
    delay: Duration,
    requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    open: AtomicUsize,
}

impl Backend {
    /// A backend named `name` on a free loopback port.
    pub fn start(name: &str) -> Backend {
        Self::start_burning(name, Duration::ZERO)
    }

    /// A backend that also spins the CPU for `burn` on every request.
    pub fn start_burning(name: &str, burn: Duration) -> Backend {
        Self::spawn(
            name,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            burn,
            Duration::ZERO,
        )
    }

    /// A backend on `addr` (port 0: a free one) that sleeps `delay` before each
    /// answer, so that requests stay in flight for a while; use the same address to
    /// start a stopped backend again.
    pub fn start_at(name: &str, addr: SocketAddr, delay: Duration) -> Backend {
        Self::spawn(name, addr, Duration::ZERO, delay)
    }

    fn spawn(name: &str, addr: SocketAddr, burn: Duration, delay: Duration) -> Backend {
        assert!(addr.ip().is_loopback(), "loopback only: {addr}");
        let listener = TcpListener::bind(addr)
            .unwrap_or_else(|e| panic!("bind a loopback backend on {addr}: {e}"));
        let addr = listener.local_addr().expect("backend address");
        let requests = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = Arc::new(Ctx {
            name: name.to_string(),
            burn,
            delay,
            requests: requests.clone(),
            stop: stop.clone(),
            open: AtomicUsize::new(0),
        });
        let acceptor = std::thread::Builder::new()
            .name(format!("backend-{name}"))
            .spawn(move || accept_loop(listener, ctx))
            .expect("spawn the backend's acceptor");
        Backend {
            name: name.to_string(),
            addr,
            requests,
            stop,
            acceptor: Some(acceptor),
        }
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocked accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(handle) = self.acceptor.take() {
            let _ = handle.join();
        }
        // Connection threads see the flag within READ_TICK and end on their own.
    }
}

fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>) {
    for stream in listener.incoming() {
        if ctx.stop.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if ctx.open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            ctx.open.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed at once
        }
        let c = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("backend-{}-conn", ctx.name))
            .spawn(move || {
                serve(stream, &c);
                c.open.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            ctx.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Reads one line, waiting at most the idle timeout and no longer than a stop.
/// `None` at end of stream, on error, timeout or stop.
fn read_line(reader: &mut BufReader<TcpStream>, ctx: &Ctx, line: &mut Vec<u8>) -> Option<()> {
    let started = Instant::now();
    loop {
        if ctx.stop.load(Ordering::Relaxed) || started.elapsed() > IDLE_TIMEOUT {
            return None;
        }
        match reader.read_until(b'\n', line) {
            Ok(0) => return None,
            Ok(_) if line.ends_with(b"\n") => return Some(()),
            Ok(_) => return None, // end of stream inside a line
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if line.len() > MAX_HEAD {
                    return None;
                }
            }
            Err(_) => return None,
        }
    }
}

/// Reads and discards `n` bytes, bounded like [`read_line`].
fn skip(reader: &mut BufReader<TcpStream>, ctx: &Ctx, mut n: usize) -> Option<()> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    while n > 0 {
        if ctx.stop.load(Ordering::Relaxed) || started.elapsed() > IDLE_TIMEOUT {
            return None;
        }
        match reader.read(&mut buf[..n.min(4096)]) {
            Ok(0) => return None,
            Ok(k) => n -= k,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    Some(())
}

fn serve(stream: TcpStream, ctx: &Ctx) {
    if stream.set_read_timeout(Some(READ_TICK)).is_err()
        || stream
            .set_write_timeout(Some(Duration::from_secs(5)))
            .is_err()
    {
        return;
    }
    let _ = stream.set_nodelay(true);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        // The request head: request line and headers, up to the blank line.
        let mut head_len = 0;
        let mut close = false;
        let mut content_length = 0usize;
        let mut http10 = false;
        let mut first = true;
        loop {
            let mut line = Vec::new();
            if read_line(&mut reader, ctx, &mut line).is_none() {
                return;
            }
            head_len += line.len();
            if head_len > MAX_HEAD {
                return;
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end();
            if first {
                if text.is_empty() {
                    continue; // tolerated stray CRLF between requests
                }
                http10 = text.ends_with("HTTP/1.0");
                first = false;
                continue;
            }
            if text.is_empty() {
                break;
            }
            if let Some((k, v)) = text.split_once(':') {
                let (k, v) = (k.trim(), v.trim());
                if k.eq_ignore_ascii_case("connection") {
                    close = v.eq_ignore_ascii_case("close");
                    if http10 && v.eq_ignore_ascii_case("keep-alive") {
                        http10 = false;
                    }
                } else if k.eq_ignore_ascii_case("content-length") {
                    content_length = v.parse().unwrap_or(0);
                }
            }
        }
        close |= http10;
        // Skip a request body, if any (bounded).
        if content_length > 1 << 20 || skip(&mut reader, ctx, content_length).is_none() {
            return;
        }
        if !ctx.burn.is_zero() {
            let until = Instant::now() + ctx.burn;
            let mut x = 0u64;
            while Instant::now() < until {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        if !ctx.delay.is_zero() {
            std::thread::sleep(ctx.delay);
        }
        let body = format!("{}\n", ctx.name);
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
             X-Backend: {}\r\nConnection: {}\r\n\r\n{body}",
            body.len(),
            ctx.name,
            if close { "close" } else { "keep-alive" }
        );
        if writer.write_all(resp.as_bytes()).is_err() {
            return;
        }
        ctx.requests.fetch_add(1, Ordering::Relaxed);
        if close {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_with_its_name_and_counts_requests() {
        let b = Backend::start("b-1");
        // A connection without a request (a health check) is not a request.
        drop(TcpStream::connect(b.addr).expect("connect"));
        let mut s = TcpStream::connect(b.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("read");
        assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
        assert!(text.ends_with("\r\n\r\nb-1\n"), "{text}");
        assert_eq!(b.requests(), 2);
    }
}
