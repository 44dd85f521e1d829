//! The agent's control socket: one request line from any local user who can open the
//! socket, answered as the daemon answers it (`status`, `drain`, `undrain`).
//!
//! Invariants: nothing panics; a line that is not a request is refused with an error
//! and changes nothing; the answer serialises to one JSON line that reads back; the
//! drain flag follows the last request taken.

#![no_main]

use ballast_agent::control::{Request, Response};
use ballast_agent::fuzzing::{control_answer, shared};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering;

fuzz_target!(|data: &[u8]| {
    // The daemon reads one UTF-8 line of at most 4096 bytes; anything else is refused
    // before it is parsed.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let sh = shared();
    let mut draining = false;
    for line in text.lines().take(8) {
        if line.len() > 4096 {
            continue;
        }
        let parsed: Option<Request> = serde_json::from_str(line.trim()).ok();
        let resp: Response = control_answer(&sh, line);
        assert_eq!(resp.ok, parsed.is_some(), "{line:?} answered {resp:?}");
        match parsed {
            Some(Request::Drain) => draining = true,
            Some(Request::Undrain) => draining = false,
            Some(Request::Status) => {}
            None => {
                assert!(resp.error.is_some() && resp.status.is_none());
            }
        }
        if resp.ok {
            let status = resp.status.as_ref().expect("an answer carries the status");
            assert_eq!(status.draining, draining);
            assert!(resp.safe_to_stop.is_some());
        }
        assert_eq!(sh.draining.load(Ordering::Relaxed), draining);
        let json = serde_json::to_string(&resp).expect("the answer serialises");
        assert!(!json.contains('\n'), "one line");
        let back: Response = serde_json::from_str(&json).expect("the answer reads back");
        assert_eq!(back.ok, resp.ok);
        assert_eq!(back.error, resp.error);
    }
});
