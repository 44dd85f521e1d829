//! The agent's session machine (`ClientSession`): the aggregator's answer on the hello
//! stream in any chunks (real welcome and reject frames in the seeds), reply datagrams
//! (real replies in the seeds), reports asked for and the passing of time, in any
//! order. The input is a 5-byte header (welcome timeout, replies that may be missed,
//! silence slack) and operations (`ballast_fuzz::ops`).
//!
//! Invariants: nothing panics; the interval stays within its bounds; a reply's
//! assignment is the one the session keeps; reports are numbered 1, 2, 3, … and
//! decode to what was measured; a reject, a timeout or silence close the session, and
//! a closed session stays closed and takes nothing more.

#![no_main]

use arbitrary::Unstructured;
use ballast_fuzz::{header, ops};
use ballast_shared::session::{
    Assignment, ClientConfig, ClientError, ClientEvent, ClientSession, Measurement,
};
use ballast_shared::wire::{self, Hello, Message, NodeState};
use libfuzzer_sys::fuzz_target;
use std::time::{Duration, Instant};

/// Operation tags (modulo 6).
const STREAM: u8 = 0;
const STREAM_END: u8 = 1;
const DATAGRAM: u8 = 2;
const REPORT: u8 = 3;
const WAIT: u8 = 4;
const CLOSE: u8 = 5;

fn same(a: &Assignment, b: &Assignment) -> bool {
    a.weight.to_bits() == b.weight.to_bits()
        && a.load.to_bits() == b.load.to_bits()
        && a.cycle == b.cycle
        && a.draining == b.draining
        && a.inflight_trusted == b.inflight_trusted
}

fuzz_target!(|data: &[u8]| {
    let ([w0, w1, missed, s0, s1], rest) = header::<5>(data);
    let mut now = Instant::now();
    let hello = Hello {
        node: "web-1".into(),
        service: "web".into(),
        address: "10.0.0.1:8080".into(),
        zone: "z1".into(),
        version: "0.1.0".into(),
    };
    let config = ClientConfig {
        welcome_timeout: Duration::from_millis(u64::from(u16::from_be_bytes([w0, w1]))),
        missed_replies: u32::from(missed),
        silence_slack: Duration::from_millis(u64::from(u16::from_be_bytes([s0, s1]))),
        // The previous version's codec has its own target (wire_v2).
        ..ClientConfig::default()
    };
    let mut s = ClientSession::new(hello.clone(), config, now);
    let sent = s.hello_frame().expect("the hello frames");
    assert_eq!(
        wire::decode(&sent[2..]).expect("the hello decodes"),
        Message::Hello(hello)
    );
    let mut next_seq: u32 = 1;
    for (tag, payload) in ops(rest).take(64) {
        let tag = tag % 6;
        let was_closed = s.is_closed();
        let mut called = tag != WAIT && tag != CLOSE;
        let result: Result<(), ClientError> = match tag {
            STREAM => s.handle_stream(now, payload).map(|e| on_stream(&s, e)),
            STREAM_END => s.handle_stream_end(),
            DATAGRAM => {
                let r = s.handle_datagram(now, payload);
                if let (Ok(ClientEvent::Assigned { assignment, .. }), Ok(Message::Reply(reply))) =
                    (&r, wire::decode(payload))
                {
                    assert_eq!(assignment.cycle, reply.cycle);
                    assert_eq!(
                        assignment.weight.to_bits(),
                        f64::from(reply.weight).to_bits()
                    );
                }
                on_datagram(&s, r)
            }
            REPORT => {
                let mut u = Unstructured::new(payload);
                let m = Measurement {
                    cpu: u.arbitrary().unwrap_or(0.5),
                    inflight: u.arbitrary().unwrap_or(3),
                    inflight_mean: u.arbitrary().unwrap_or(3.0),
                    age: u
                        .arbitrary::<Option<(u32, u32)>>()
                        .unwrap_or(None)
                        .map(|(mean_ms, oldest_ms)| wire::RequestAge { mean_ms, oldest_ms }),
                    capacity: u.arbitrary().unwrap_or(0),
                    error_rate: u.arbitrary().unwrap_or(None),
                    draining: u.arbitrary().unwrap_or(false),
                };
                s.report(m).map(|bytes| {
                    match wire::decode(&bytes) {
                        Ok(Message::Report(r)) => {
                            assert_eq!(r.seq, next_seq, "reports are numbered in order");
                            assert_eq!(r.inflight, m.inflight);
                            assert_eq!(r.capacity, m.capacity);
                            assert_eq!(r.state == NodeState::Draining, m.draining);
                        }
                        other => panic!("report() encoded {other:?}"),
                    }
                    next_seq = next_seq.wrapping_add(1);
                })
            }
            WAIT => {
                let ms: u16 = Unstructured::new(payload).arbitrary().unwrap_or(1000);
                now += Duration::from_millis(u64::from(ms));
                match s.poll_timeout() {
                    Some(deadline) if now >= deadline => {
                        called = true;
                        match s.handle_timeout(now) {
                            Ok(Some(ClientEvent::ReportDue)) => {
                                let next = s.poll_timeout().expect("an open session has a timeout");
                                assert!(next > now, "a report due again at once");
                                Ok(())
                            }
                            Ok(Some(other)) => panic!("a timeout yielded {other:?}"),
                            Ok(None) => Ok(()),
                            Err(e) => {
                                assert!(s.is_closed(), "{e} left the session open");
                                Err(e)
                            }
                        }
                    }
                    _ => Ok(()),
                }
            }
            _ => {
                s.close();
                Ok(())
            }
        };
        let i = s.interval();
        assert!(
            i >= Duration::from_millis(100) && i <= Duration::from_secs(60),
            "interval {i:?} out of bounds"
        );
        if let Err(
            ClientError::Rejected(_) | ClientError::WelcomeTimeout(_) | ClientError::Silent { .. },
        ) = &result
        {
            assert!(s.is_closed());
        }
        if was_closed {
            assert!(s.is_closed(), "a closed session reopened");
            if called {
                assert!(result.is_err(), "a closed session took operation {tag}");
            }
        }
        if s.is_closed() {
            assert!(!s.is_established());
            assert!(s.poll_timeout().is_none());
        }
    }
});

fn on_stream(s: &ClientSession, e: Option<ClientEvent>) {
    match e {
        None => {}
        Some(ClientEvent::Welcomed { interval }) => {
            assert!(s.is_established());
            assert_eq!(interval, s.interval());
        }
        Some(other) => panic!("the hello stream yielded {other:?}"),
    }
}

fn on_datagram(s: &ClientSession, r: Result<ClientEvent, ClientError>) -> Result<(), ClientError> {
    match r {
        Ok(ClientEvent::Assigned {
            assignment,
            new_interval,
        }) => {
            let kept = s.assignment().expect("an assignment is kept");
            assert!(same(&kept, &assignment));
            if let Some(i) = new_interval {
                assert_eq!(i, s.interval());
            }
            Ok(())
        }
        Ok(other) => panic!("a datagram yielded {other:?}"),
        Err(ClientError::Protocol(p)) => {
            assert!(s.is_established(), "one bad datagram cost the session: {p}");
            Err(ClientError::Protocol(p))
        }
        Err(e) => Err(e),
    }
}
