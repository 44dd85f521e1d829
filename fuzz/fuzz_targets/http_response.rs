//! The HTTP/1.x response of a Prometheus scrape: status line, headers,
//! `Content-Length` and the chunked transfer coding, on the input as a response (real
//! responses in the seeds); and a body drawn from the input, sent in chunks of sizes
//! drawn from it too, which must decode to itself.
//!
//! Invariants: nothing panics; a body is never larger than the 4 MiB limit nor than
//! what was received; chunked encoding round-trips (with chunk extensions); an
//! explicit `Content-Length` is honoured.

#![no_main]

use arbitrary::Unstructured;
use ballast_agent::fuzzing::http_response;
use ballast_agent::sample::prometheus::HttpUrl;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = http_response(data) {
        assert!(body.len() <= 4 << 20);
        assert!(body.len() <= data.len(), "a body larger than the response");
    }
    let mut u = Unstructured::new(data);
    let body: Vec<u8> = u.arbitrary().unwrap_or_default();
    let cuts: Vec<u8> = u.arbitrary().unwrap_or_default();
    let extension: bool = u.arbitrary().unwrap_or(false);
    let url: String = u.arbitrary().unwrap_or_default();
    // The body in chunks of the given sizes.
    let mut wire =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    let mut rest = body.as_slice();
    let mut cuts = cuts.iter();
    while !rest.is_empty() {
        let n = usize::from(cuts.next().copied().unwrap_or(u8::MAX)).clamp(1, rest.len());
        let (chunk, tail) = rest.split_at(n);
        wire.extend_from_slice(format!("{n:x}").as_bytes());
        if extension {
            wire.extend_from_slice(b";name=value");
        }
        wire.extend_from_slice(b"\r\n");
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
        rest = tail;
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(
        http_response(&wire).expect("a well-formed chunked body"),
        body
    );
    // The same body with its length.
    let mut plain =
        format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
    plain.extend_from_slice(&body);
    plain.extend_from_slice(b"trailing garbage");
    assert_eq!(http_response(&plain).expect("a body with its length"), body);
    // The scrape URL an operator configures.
    if let Ok(url) = HttpUrl::parse(&url) {
        assert!(url.port > 0 && !url.host.is_empty() && url.path.starts_with('/'));
    }
});
