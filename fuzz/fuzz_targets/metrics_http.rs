//! The agent's metrics server: the request head any local client may send, routed as
//! `answer` routes it.
//!
//! Invariants: routing never panics; only a well-formed `GET` or `HEAD` request line
//! for `/metrics` (a query allowed) over HTTP/1.x is served; every refusal has a status
//! line of its own.

#![no_main]

use ballast_agent::fuzzing::metrics_route;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|head: &[u8]| {
    match metrics_route(head) {
        Ok(()) => {
            let text = std::str::from_utf8(head).expect("a served head is UTF-8");
            let line = text
                .lines()
                .next()
                .expect("a served head has a request line");
            let mut parts = line.split(' ');
            let method = parts.next().expect("method");
            let target = parts.next().expect("target");
            let version = parts.next().expect("version");
            assert!(parts.next().is_none());
            assert!(method == "GET" || method == "HEAD", "served {method:?}");
            assert_eq!(target.split('?').next(), Some("/metrics"));
            assert!(version.starts_with("HTTP/1."));
        }
        Err(status) => {
            let code: u16 = status[..3].parse().expect("a status code");
            assert!((400..500).contains(&code), "refused with {status}");
        }
    }
});
