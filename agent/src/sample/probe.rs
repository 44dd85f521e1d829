//! What `ballast-agent check --inflight auto[:METRICS_URL]` looks at to suggest an
//! in-flight source: whether the service's port speaks HTTP/2 (it answers the HTTP/2
//! connection preface of a connection the agent makes itself), and which presets'
//! series a metrics URL has.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::expr::{Expr, Preset};
use super::nginx::StubStatus;
use super::prometheus::{evaluate, http_get, HttpUrl, TIMEOUT};
use super::SampleError;

/// The client's HTTP/2 connection preface and an empty SETTINGS frame (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// What a port answered the HTTP/2 preface with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Speaks {
    /// A SETTINGS frame: HTTP/2 with prior knowledge, which every gRPC server speaks.
    Http2,
    /// An HTTP/1.x status line: the preface was taken for a bad HTTP/1 request. Or an
    /// HTML error page with no status line: an HTTP/1 server that answers a version
    /// it does not know in HTTP/0.9's manner (Python's `http.server` does).
    Http1,
    /// Something else, said in words.
    Other(String),
}

/// Sends the preface to `127.0.0.1:port` and reads the first frame header or line.
pub fn port_protocol(port: u16) -> Result<Speaks, SampleError> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let err = |e: std::io::Error| SampleError::Http(format!("probing {addr}: {e}"));
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(err)?;
    s.set_write_timeout(Some(TIMEOUT)).map_err(err)?;
    s.write_all(PREFACE).map_err(err)?;
    let deadline = Instant::now() + TIMEOUT;
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while got.len() < 9 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(err)?;
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    Ok(classify(&got))
}

/// Names what the first bytes of an answer to the preface are.
fn classify(got: &[u8]) -> Speaks {
    if got.starts_with(b"HTTP/1.") || is_html(got) {
        Speaks::Http1
    } else if got.len() >= 9 && got[3] == 0x04 && got[5..9] == [0, 0, 0, 0] {
        Speaks::Http2
    } else if got.is_empty() {
        Speaks::Other("no answer to the HTTP/2 preface within 1 s".into())
    } else if got[0] == 0x15 || got[0] == 0x16 {
        Speaks::Other("a TLS record: the port speaks TLS".into())
    } else {
        let head = String::from_utf8_lossy(&got[..got.len().min(24)]).into_owned();
        Speaks::Other(format!(
            "an answer that is neither HTTP/1 nor HTTP/2: {head:?}"
        ))
    }
}

/// Whether an answer is the start of an HTML page (white space aside).
fn is_html(got: &[u8]) -> bool {
    let start = got
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(got.len());
    let head = &got[start..];
    [&b"<!doctype html"[..], b"<html"]
        .iter()
        .any(|tag| head.len() >= tag.len() && head[..tag.len()].eq_ignore_ascii_case(tag))
}

/// Whether a page has a preset's series: how it derives its count, or why not.
pub type Finding = Result<String, String>;

/// Scrapes `url` once and says, for each preset, whether the page has its series:
/// `Ok(derivation)` when it evaluates with at least one series (or, for `nginx`, when
/// the page is a `stub_status` page), else why not.
pub fn presets_on(url: &str) -> Result<Vec<(Preset, Finding)>, SampleError> {
    let body = http_get(&HttpUrl::parse(url)?, url)?;
    let text = String::from_utf8_lossy(&body);
    Ok(Preset::ALL
        .into_iter()
        .map(|p| {
            let found = match p.expression(None) {
                None => StubStatus::parse(&text)
                    .map(|s| format!("stub_status Writing {}", s.writing))
                    .map_err(|e| e.to_string()),
                Some(src) => Expr::parse(&src)
                    .and_then(|e| evaluate(&text, &e))
                    .map_err(|e| e.to_string())
                    .and_then(|e| {
                        if e.terms.iter().any(|t| t.count > 0) {
                            Ok(e.derivation())
                        } else {
                            Err("declared, but no series yet".into())
                        }
                    }),
            };
            (p, found)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_to_the_preface() {
        assert_eq!(classify(b"HTTP/1.1 400 Bad Request\r\n"), Speaks::Http1);
        // A server's SETTINGS frame: length 18, type 4, flags 0, stream 0.
        assert_eq!(
            classify(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03"),
            Speaks::Http2
        );
        assert!(matches!(classify(b""), Speaks::Other(_)));
        assert!(matches!(classify(b"\x15\x03\x03\x00\x02"), Speaks::Other(w) if w.contains("TLS")));
        assert!(matches!(classify(b"SSH-2.0-x\r\n"), Speaks::Other(_)));
        // Python's http.server answers the preface's "HTTP/2.0" with its error page
        // alone, no status line.
        assert_eq!(
            classify(b"<!DOCTYPE HTML>\n<html lang=\"en\">\n    <head>"),
            Speaks::Http1
        );
        assert_eq!(
            classify(b"\r\n<html><body>400</body></html>"),
            Speaks::Http1
        );
        assert!(matches!(classify(b"<?xml version"), Speaks::Other(_)));
    }

    #[test]
    fn an_http1_server_on_a_real_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut b = [0u8; 64];
            let _ = c.read(&mut b);
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n");
        });
        assert_eq!(port_protocol(port).unwrap(), Speaks::Http1);
        server.join().unwrap();
    }
}
