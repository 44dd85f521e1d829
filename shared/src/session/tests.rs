//! Both machines, driven against each other and against hostile bytes. Time is a base
//! instant plus offsets, so every test is deterministic.

use super::*;
use crate::wire::{self, Hello, NodeState, Reject, RejectReason, Report, Welcome, WIRE_VERSION};
use proptest::prelude::*;
use std::time::{Duration, Instant};

fn hello(node: &str) -> Hello {
    Hello {
        node: node.into(),
        service: "web".into(),
        address: "10.0.0.1:8080".into(),
        zone: "z1".into(),
        version: "1.2.3".into(),
    }
}

/// The source address of the test connections: the address [`hello`] advertises.
const SOURCE: [u8; 4] = [10, 0, 0, 1];

/// A peer whose certificate names `node` and the service `web`, connecting from the
/// address its hello advertises.
fn peer(node: &str) -> Peer {
    Peer {
        identity: node.into(),
        source: SOURCE.into(),
        grant: Grant {
            services: vec!["web".into()],
            ..Grant::default()
        },
    }
}

/// What `server` answers to `hello`: the hello back when it is taken, or the reject.
fn admit(server: &mut ServerSession, hello: &Hello, t0: Instant) -> Result<Hello, Reject> {
    let frame = framed(&Message::Hello(hello.clone()));
    match server.handle_stream(t0, &frame) {
        Ok(Some(ServerEvent::Hello(h))) => Ok(h),
        Ok(Some(ServerEvent::Refused { reject, frame })) => {
            assert_eq!(server.close_code(), Some(close::REJECTED));
            assert_eq!(
                wire::decode(&frame[2..]),
                Ok(Message::Reject(reject.clone())),
                "the frame carries the reject"
            );
            Err(reject)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_stolen_certificate_claims_only_its_own_service_and_address() {
    let t0 = Instant::now();
    let batch = Peer {
        identity: "batch-7".into(),
        source: SOURCE.into(),
        grant: Grant {
            services: vec!["batch".into()],
            ..Grant::default()
        },
    };
    let own = Hello {
        node: "batch-7".into(),
        service: "batch".into(),
        ..hello("batch-7")
    };
    let mut server = ServerSession::new(batch.clone(), ServerConfig::new(1000), t0);
    assert_eq!(admit(&mut server, &own, t0), Ok(own.clone()));

    // Another service.
    let payments = Hello {
        service: "payments".into(),
        ..own.clone()
    };
    let mut server = ServerSession::new(batch.clone(), ServerConfig::new(1000), t0);
    let r = admit(&mut server, &payments, t0).expect_err("another service");
    assert_eq!(r.reason, RejectReason::ServiceNotAllowed);
    assert!(
        r.detail.contains("payments") && r.detail.contains("batch"),
        "{r:?}"
    );
    assert!(server.hello().is_none());

    // Another address, as an IP and as a host name.
    for address in ["10.6.6.6:443", "payments.internal:443", "[fd00::6]:443"] {
        let elsewhere = Hello {
            address: address.into(),
            ..own.clone()
        };
        let mut server = ServerSession::new(batch.clone(), ServerConfig::new(1000), t0);
        let r = admit(&mut server, &elsewhere, t0).expect_err(address);
        assert_eq!(r.reason, RejectReason::AddressNotAllowed, "{address}");
    }

    // Both at once: the service is what is reported.
    let both = Hello {
        address: "10.6.6.6:443".into(),
        ..payments
    };
    let mut server = ServerSession::new(batch, ServerConfig::new(1000), t0);
    let r = admit(&mut server, &both, t0).expect_err("both");
    assert_eq!(r.reason, RejectReason::ServiceNotAllowed);
}

#[test]
fn a_certificate_without_services_may_serve_none() {
    let t0 = Instant::now();
    let unscoped = Peer {
        grant: Grant::default(),
        ..peer("web-1")
    };
    let mut server = ServerSession::new(unscoped, ServerConfig::new(1000), t0);
    let r = admit(&mut server, &hello("web-1"), t0).expect_err("no service");
    assert_eq!(r.reason, RejectReason::ServiceNotAllowed);
    assert!(r.detail.contains("names none"), "{r:?}");
}

#[test]
fn identity_is_checked_before_what_the_identity_may_claim() {
    let t0 = Instant::now();
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let other = Hello {
        service: "payments".into(),
        address: "10.6.6.6:1".into(),
        ..hello("web-2")
    };
    let r = admit(&mut server, &other, t0).expect_err("another node");
    assert_eq!(r.reason, RejectReason::IdentityMismatch);
}

#[test]
fn a_grant_admits_networks_host_names_and_service_patterns() {
    let t0 = Instant::now();
    let natted = Peer {
        identity: "edge-1".into(),
        source: [192, 0, 2, 10].into(),
        grant: Grant {
            services: vec!["edge-*".into()],
            networks: vec!["10.20.0.0/16".parse().expect("cidr")],
            hostnames: vec!["*.edge.example".into()],
        },
    };
    for (service, address, ok) in [
        ("edge-eu", "10.20.3.4:443", true),
        ("edge-us", "n1.edge.example:443", true),
        ("edge-eu", "192.0.2.10:443", true),
        ("edge-eu", "10.21.0.1:443", false),
        ("edge-eu", "n1.core.example:443", false),
        ("core", "10.20.3.4:443", false),
    ] {
        let h = Hello {
            node: "edge-1".into(),
            service: service.into(),
            address: address.into(),
            ..hello("edge-1")
        };
        let mut server = ServerSession::new(natted.clone(), ServerConfig::new(1000), t0);
        assert_eq!(
            admit(&mut server, &h, t0).is_ok(),
            ok,
            "{service} at {address}"
        );
    }
    // A peer trusted with anything is the old behaviour: identity alone.
    let mut server = ServerSession::new(
        Peer::trusted("web-1", [127, 0, 0, 1].into()),
        ServerConfig::new(1000),
        t0,
    );
    let h = Hello {
        service: "payments".into(),
        address: "10.6.6.6:443".into(),
        ..hello("web-1")
    };
    assert!(admit(&mut server, &h, t0).is_ok());
}

fn ms(t0: Instant, ms: u64) -> Instant {
    t0 + Duration::from_millis(ms)
}

fn assignment(weight: f64, cycle: u64) -> Assignment {
    Assignment {
        weight,
        cycle,
        draining: false,
        load: 0.5,
        inflight_trusted: true,
    }
}

fn measurement() -> Measurement {
    Measurement {
        cpu: 0.25,
        inflight: 7,
        inflight_mean: 7.5,
        age: Some(wire::RequestAge {
            mean_ms: 30,
            oldest_ms: 120,
        }),
        capacity: 0,
        error_rate: None,
        draining: false,
    }
}

fn framed(msg: &Message) -> Vec<u8> {
    crate::frame::encode(msg).expect("encodes")
}

fn datagram(msg: &Message) -> Vec<u8> {
    wire::encode(msg).expect("encodes")
}

fn report(seq: u32) -> Vec<u8> {
    datagram(&Message::Report(Report {
        seq,
        cpu: 0.1,
        inflight: 1,
        inflight_mean: 1.0,
        age: None,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    }))
}

/// A client and a server that have exchanged hello and welcome at `t0`.
fn established(t0: Instant) -> (ClientSession, ServerSession) {
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let frame = client.hello_frame().expect("hello encodes");
    match server.handle_stream(t0, &frame) {
        Ok(Some(ServerEvent::Hello(h))) => assert_eq!(h, hello("web-1")),
        other => panic!("expected the hello, got {other:?}"),
    }
    assert!(server.handle_stream_end().is_ok());
    let welcome = server.welcome().expect("welcome");
    assert!(server.is_established());
    match client.handle_stream(t0, &welcome) {
        Ok(Some(ClientEvent::Welcomed { interval })) => {
            assert_eq!(interval, Duration::from_secs(1))
        }
        other => panic!("expected the welcome, got {other:?}"),
    }
    assert!(client.handle_stream_end().is_ok());
    (client, server)
}

#[test]
fn happy_path_hello_welcome_report_reply() {
    let t0 = Instant::now();
    let (mut client, mut server) = established(t0);
    assert!(client.is_established());
    assert_eq!(server.hello().map(|h| h.version.as_str()), Some("1.2.3"));
    assert_eq!(
        client.poll_timeout(),
        Some(t0),
        "the first report is due at once"
    );

    for (i, at) in [0u64, 1000, 2000].into_iter().enumerate() {
        let now = ms(t0, at);
        assert_eq!(
            client.handle_timeout(now).expect("open"),
            Some(ClientEvent::ReportDue)
        );
        assert_eq!(client.poll_timeout(), Some(ms(t0, at + 1000)));
        assert_eq!(client.handle_timeout(now).expect("open"), None, "once only");
        let bytes = client.report(measurement()).expect("report");
        let report = match server.handle_datagram(&bytes) {
            Ok(ServerEvent::Report(r)) => r,
            other => panic!("expected a report, got {other:?}"),
        };
        assert_eq!(report.seq, i as u32 + 1, "reports are numbered from 1");
        assert_eq!((report.cpu, report.inflight), (0.25, 7));
        assert_eq!(
            (report.inflight_mean, report.age),
            (
                7.5,
                Some(wire::RequestAge {
                    mean_ms: 30,
                    oldest_ms: 120
                })
            )
        );
        assert_eq!(report.state, NodeState::Serving);
        let reply = server
            .reply(&assignment(1.5, i as u64))
            .expect("reply encodes");
        match client.handle_datagram(now, &reply) {
            Ok(ClientEvent::Assigned {
                assignment: a,
                new_interval,
            }) => {
                assert_eq!(a, assignment(1.5, i as u64));
                assert_eq!(new_interval, None);
            }
            other => panic!("expected an assignment, got {other:?}"),
        }
    }
    assert_eq!(client.assignment(), Some(assignment(1.5, 2)));
}

/// A session of the previous protocol on both ends: the same exchange, every message
/// in `ballast/2` on the wire, today's messages on either side of it.
#[test]
fn a_session_of_the_previous_version_runs_end_to_end() {
    use crate::protocol::Protocol;
    let t0 = Instant::now();
    let cc = ClientConfig {
        protocol: Protocol::PREVIOUS,
        ..ClientConfig::default()
    };
    let sc = ServerConfig {
        protocol: Protocol::PREVIOUS,
        ..ServerConfig::new(1000)
    };
    let mut client = ClientSession::new(hello("web-1"), cc, t0);
    let mut server = ServerSession::new(peer("web-1"), sc, t0);
    let frame = client.hello_frame().expect("hello encodes");
    assert_eq!(frame[2], crate::wire::v2::WIRE_VERSION);
    assert!(matches!(
        server.handle_stream(t0, &frame),
        Ok(Some(ServerEvent::Hello(_)))
    ));
    let welcome = server.welcome().expect("welcome");
    assert_eq!(welcome[2], crate::wire::v2::WIRE_VERSION);
    assert!(matches!(
        client.handle_stream(t0, &welcome),
        Ok(Some(ClientEvent::Welcomed { .. }))
    ));
    assert_eq!(
        client.handle_timeout(t0).expect("open"),
        Some(ClientEvent::ReportDue)
    );
    let bytes = client.report(measurement()).expect("report");
    assert_eq!(bytes[0], crate::wire::v2::WIRE_VERSION);
    let report = match server.handle_datagram(&bytes) {
        Ok(ServerEvent::Report(r)) => r,
        other => panic!("expected a report, got {other:?}"),
    };
    assert_eq!((report.seq, report.cpu, report.inflight), (1, 0.25, 7));
    let reply = server.reply(&assignment(1.5, 4)).expect("reply");
    assert_eq!(reply[0], crate::wire::v2::WIRE_VERSION);
    let Ok(ClientEvent::Assigned { assignment: a, .. }) = client.handle_datagram(t0, &reply) else {
        panic!("expected an assignment");
    };
    // The previous version's reply is today's.
    assert_eq!((a.weight, a.cycle, a.draining), (1.5, 4, false));
    // Its report has no mean: the mean is its count, and no age is known.
    assert_eq!((report.inflight_mean, report.age), (7.0, None));

    // A current-version datagram on a previous-version session is refused by its
    // version byte, and costs only itself.
    let current = wire::encode(&Message::Report(Report {
        seq: 2,
        cpu: 0.1,
        inflight: 0,
        inflight_mean: 0.0,
        age: None,
        capacity: 0,
        error_rate: None,
        state: NodeState::Serving,
    }))
    .expect("encodes");
    assert!(matches!(
        server.handle_datagram(&current),
        Err(ServerError::Protocol(ProtocolError::Decode(
            DecodeError::UnknownVersion(WIRE_VERSION)
        )))
    ));
    assert!(server.is_established());
}

#[test]
fn a_session_that_takes_over_goes_on_with_the_numbering_and_the_schedule() {
    let t0 = Instant::now();
    let (mut old, mut server) = established(t0);
    for at in [0u64, 1000] {
        assert_eq!(
            old.handle_timeout(ms(t0, at)).expect("open"),
            Some(ClientEvent::ReportDue)
        );
        let bytes = old.report(measurement()).expect("report");
        assert!(matches!(
            server.handle_datagram(&bytes),
            Ok(ServerEvent::Report(_))
        ));
    }
    // A new connection, welcomed half-way through the interval.
    let (mut new, mut new_server) = established(ms(t0, 1500));
    assert_eq!(new.poll_timeout(), Some(ms(t0, 1500)), "alone: due at once");
    new.take_over(&old);
    assert_eq!(
        new.poll_timeout(),
        Some(ms(t0, 2000)),
        "due when the old session's next report was"
    );
    assert_eq!(new.handle_timeout(ms(t0, 1500)).expect("open"), None);
    assert_eq!(
        new.handle_timeout(ms(t0, 2000)).expect("open"),
        Some(ClientEvent::ReportDue)
    );
    let bytes = new.report(measurement()).expect("report");
    match new_server.handle_datagram(&bytes) {
        Ok(ServerEvent::Report(r)) => assert_eq!(r.seq, 3, "numbered after the old session's"),
        other => panic!("expected a report, got {other:?}"),
    }
}

#[test]
fn a_draining_measurement_reports_draining() {
    let t0 = Instant::now();
    let (mut client, mut server) = established(t0);
    let bytes = client
        .report(Measurement {
            draining: true,
            error_rate: Some(0.5),
            capacity: 40,
            ..measurement()
        })
        .expect("report");
    match server.handle_datagram(&bytes) {
        Ok(ServerEvent::Report(r)) => {
            assert_eq!(r.state, NodeState::Draining);
            assert_eq!((r.error_rate, r.capacity), (Some(0.5), 40));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_server_refuses_another_nodes_hello_and_an_invalid_one() {
    let t0 = Instant::now();
    for (claimed, reason) in [
        (hello("web-2"), RejectReason::IdentityMismatch),
        (
            Hello {
                service: "no/slashes".into(),
                ..hello("web-1")
            },
            RejectReason::InvalidHello,
        ),
        (
            Hello {
                address: "nohost".into(),
                ..hello("web-1")
            },
            RejectReason::InvalidHello,
        ),
    ] {
        let mut client = ClientSession::new(claimed.clone(), ClientConfig::default(), t0);
        let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
        let frame = client.hello_frame().expect("encodes");
        let (reject, answer) = match server.handle_stream(t0, &frame) {
            Ok(Some(ServerEvent::Refused { reject, frame })) => (reject, frame),
            other => panic!("{claimed:?}: expected a refusal, got {other:?}"),
        };
        assert_eq!(reject.reason, reason, "{reject:?}");
        assert_eq!(server.close_code(), Some(close::REJECTED));
        assert!(server.hello().is_none(), "a refused hello is not kept");
        match client.handle_stream(t0, &answer) {
            Err(ClientError::Rejected(r)) => assert_eq!(r, reject),
            other => panic!("expected the reject, got {other:?}"),
        }
        assert!(client.is_closed());
        assert!(matches!(
            client.report(measurement()),
            Err(ClientError::Closed)
        ));
        assert!(matches!(
            server.handle_datagram(&report(1)),
            Err(ServerError::Closed)
        ));
    }
}

#[test]
fn the_driver_rejects_what_only_it_can_judge() {
    let t0 = Instant::now();
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let frame = client.hello_frame().expect("encodes");
    assert!(matches!(
        server.handle_stream(t0, &frame),
        Ok(Some(ServerEvent::Hello(_)))
    ));
    let answer = server
        .reject(RejectReason::UnknownService, "x".repeat(5000))
        .expect("a long detail is cut, not an error");
    assert_eq!(server.close_code(), Some(close::REJECTED));
    assert!(matches!(server.welcome(), Err(ServerError::NotAdmitting)));
    match client.handle_stream(t0, &answer) {
        Err(ClientError::Rejected(r)) => {
            assert_eq!(r.reason, RejectReason::UnknownService);
            assert!(r.detail.len() <= 256, "{}", r.detail.len());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn welcome_and_reject_need_a_waiting_hello() {
    let t0 = Instant::now();
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    assert!(matches!(server.welcome(), Err(ServerError::NotAdmitting)));
    assert!(matches!(
        server.reject(RejectReason::NoHello, String::new()),
        Err(ServerError::NotAdmitting)
    ));
    assert!(matches!(
        server.reply(&assignment(1.0, 1)),
        Err(ServerError::BeforeWelcome)
    ));
    assert_eq!(
        server.close_code(),
        None,
        "a driver's mistake closes nothing"
    );
}

#[test]
fn old_and_repeated_reports_are_dropped_by_sequence_number() {
    let t0 = Instant::now();
    let (_, mut server) = established(t0);
    let seqs = |server: &mut ServerSession, seq: u32| server.handle_datagram(&report(seq));
    assert!(matches!(seqs(&mut server, 5), Ok(ServerEvent::Report(r)) if r.seq == 5));
    assert!(matches!(
        seqs(&mut server, 3),
        Ok(ServerEvent::Reordered { seq: 3, last: 5 })
    ));
    assert!(matches!(
        seqs(&mut server, 5),
        Ok(ServerEvent::Reordered { seq: 5, last: 5 })
    ));
    assert!(matches!(seqs(&mut server, 6), Ok(ServerEvent::Report(r)) if r.seq == 6));
    // Numbering wraps: after u32::MAX, 0 is newer and u32::MAX - 1 is older.
    assert!(matches!(
        seqs(&mut server, 1 << 31),
        Ok(ServerEvent::Report(_))
    ));
    assert!(matches!(
        seqs(&mut server, u32::MAX),
        Ok(ServerEvent::Report(_))
    ));
    assert!(matches!(seqs(&mut server, 0), Ok(ServerEvent::Report(r)) if r.seq == 0));
    assert!(matches!(
        seqs(&mut server, u32::MAX - 1),
        Ok(ServerEvent::Reordered { .. })
    ));
    // Reordered reports are not faults: they never close the session.
    for _ in 0..100 {
        assert!(matches!(
            seqs(&mut server, 0),
            Ok(ServerEvent::Reordered { .. })
        ));
    }
    assert!(server.is_established());
}

#[test]
fn client_numbers_reports_consecutively_and_wraps() {
    let t0 = Instant::now();
    let (mut client, _) = established(t0);
    client.next_seq = u32::MAX;
    let seq = |bytes: Vec<u8>| match wire::decode(&bytes) {
        Ok(Message::Report(r)) => r.seq,
        other => panic!("{other:?}"),
    };
    assert_eq!(seq(client.report(measurement()).expect("report")), u32::MAX);
    assert_eq!(seq(client.report(measurement()).expect("report")), 0);
    assert_eq!(seq(client.report(measurement()).expect("report")), 1);
}

#[test]
fn the_server_pushes_an_interval_change_with_its_replies() {
    let t0 = Instant::now();
    let (mut client, mut server) = established(t0);
    assert_eq!(
        client.handle_timeout(t0).expect("open"),
        Some(ClientEvent::ReportDue)
    );
    assert_eq!(server.set_interval_ms(250), 250);
    let reply = server.reply(&assignment(1.0, 1)).expect("reply");
    let at = ms(t0, 100);
    match client.handle_datagram(at, &reply) {
        Ok(ClientEvent::Assigned { new_interval, .. }) => {
            assert_eq!(new_interval, Some(Duration::from_millis(250)))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(client.interval(), Duration::from_millis(250));
    assert_eq!(
        client.poll_timeout(),
        Some(ms(t0, 350)),
        "one new interval on"
    );
    assert_eq!(client.handle_timeout(ms(t0, 349)).expect("open"), None);
    assert_eq!(
        client.handle_timeout(ms(t0, 350)).expect("open"),
        Some(ClientEvent::ReportDue)
    );
    // The same interval again is no change.
    match client.handle_datagram(ms(t0, 400), &reply) {
        Ok(ClientEvent::Assigned { new_interval, .. }) => assert_eq!(new_interval, None),
        other => panic!("{other:?}"),
    }
    // Out of range either way: the nearest bound.
    assert_eq!(server.set_interval_ms(0), MIN_INTERVAL_MS);
    assert_eq!(server.set_interval_ms(u32::MAX), MAX_INTERVAL_MS);
    let reply = server.reply(&assignment(1.0, 2)).expect("reply");
    match client.handle_datagram(ms(t0, 500), &reply) {
        Ok(ClientEvent::Assigned { new_interval, .. }) => {
            assert_eq!(new_interval, Some(Duration::from_secs(60)))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_welcome_with_an_absurd_interval_is_clamped() {
    let t0 = Instant::now();
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    let welcome = framed(&Message::Welcome(Welcome { interval_ms: 0 }));
    assert_eq!(
        client.handle_stream(t0, &welcome).expect("welcomed"),
        Some(ClientEvent::Welcomed {
            interval: Duration::from_millis(u64::from(MIN_INTERVAL_MS))
        })
    );
}

#[test]
fn the_client_gives_up_when_replies_stop() {
    let t0 = Instant::now();
    let (mut client, _) = established(t0);
    // Interval 1 s, three replies missed, 1 s of slack: silent from 4 s.
    let mut due = 0;
    let mut at = 0;
    let err = loop {
        match client.handle_timeout(ms(t0, at)) {
            Ok(Some(ClientEvent::ReportDue)) => due += 1,
            Ok(_) => {}
            Err(e) => break e,
        }
        at += 100;
    };
    assert!(matches!(err, ClientError::Silent { missed: 3 }), "{err}");
    assert_eq!(at, 4000);
    assert_eq!(due, 4, "reports at 0, 1, 2 and 3 s");
    assert!(client.is_closed());
    assert_eq!(client.poll_timeout(), None);

    // A reply resets the count.
    let (mut client, server) = established(t0);
    let reply = server.reply(&assignment(1.0, 1)).expect("reply");
    client.handle_datagram(ms(t0, 3500), &reply).expect("reply");
    assert!(client.handle_timeout(ms(t0, 7000)).is_ok());
    assert!(matches!(
        client.handle_timeout(ms(t0, 7500)),
        Err(ClientError::Silent { .. })
    ));
}

#[test]
fn a_late_client_starts_its_schedule_again() {
    let t0 = Instant::now();
    let (mut client, server) = established(t0);
    let reply = server.reply(&assignment(1.0, 1)).expect("reply");
    assert!(client.handle_timeout(t0).is_ok());
    client.handle_datagram(ms(t0, 2400), &reply).expect("reply");
    // Woken 1.5 s late: one report now, the next an interval later, not a burst.
    assert_eq!(
        client.handle_timeout(ms(t0, 2500)).expect("open"),
        Some(ClientEvent::ReportDue)
    );
    assert_eq!(client.poll_timeout(), Some(ms(t0, 3500)));
}

#[test]
fn timeouts_before_the_exchange_close_both_sides() {
    let t0 = Instant::now();
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    assert_eq!(server.poll_timeout(), Some(ms(t0, 5000)));
    assert!(server.handle_timeout(ms(t0, 4999)).is_ok());
    let err = server.handle_timeout(ms(t0, 5000)).expect_err("timed out");
    assert!(matches!(err, ServerError::HelloTimeout(_)), "{err}");
    assert_eq!(err.label(), "hello_timeout");
    assert_eq!(server.close_code(), Some(close::PROTOCOL));

    // A hello finished after the deadline is too late too.
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let frame = framed(&Message::Hello(hello("web-1")));
    assert!(matches!(
        server.handle_stream(ms(t0, 6000), &frame),
        Err(ServerError::HelloTimeout(_))
    ));

    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    assert_eq!(client.poll_timeout(), Some(ms(t0, 3000)));
    assert!(client.handle_timeout(ms(t0, 2999)).expect("open").is_none());
    assert!(matches!(
        client.handle_timeout(ms(t0, 3000)),
        Err(ClientError::WelcomeTimeout(_))
    ));
    assert!(client.is_closed());
}

#[test]
fn frames_split_anywhere_reassemble() {
    let t0 = Instant::now();
    let frame = framed(&Message::Hello(hello("web-1")));
    for cut in 0..=frame.len() {
        let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
        let (a, b) = frame.split_at(cut);
        let first = server.handle_stream(t0, a).expect("first part");
        let second = server.handle_stream(t0, b).expect("second part");
        let got = first.or(second);
        assert!(
            matches!(got, Some(ServerEvent::Hello(_))),
            "cut {cut}: {got:?}"
        );
    }
    // One byte at a time.
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let mut got = None;
    for b in &frame {
        if let Some(e) = server
            .handle_stream(t0, std::slice::from_ref(b))
            .expect("byte")
        {
            got = Some(e);
        }
    }
    assert!(matches!(got, Some(ServerEvent::Hello(_))));
}

#[test]
fn bad_hello_streams_close_the_session_with_a_label() {
    let t0 = Instant::now();
    let hello_bytes = datagram(&Message::Hello(hello("web-1")));
    let mut old_version = hello_bytes.clone();
    old_version[0] = 1;
    let with_prefix = |body: &[u8]| {
        let mut f = (body.len() as u16).to_be_bytes().to_vec();
        f.extend_from_slice(body);
        f
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0x08, 0x00], "oversized"),
        (with_prefix(&old_version), "unknown_version"),
        (with_prefix(&[WIRE_VERSION, 0xff, 0xfe]), "malformed"),
        (with_prefix(&[]), "malformed"),
        (
            [framed(&Message::Hello(hello("web-1"))), vec![0]].concat(),
            "malformed",
        ),
        (
            framed(&Message::Welcome(Welcome { interval_ms: 1 })),
            "unexpected_message",
        ),
    ];
    for (bytes, label) in cases {
        let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
        let err = server.handle_stream(t0, &bytes).expect_err("refused");
        assert_eq!(err.label(), label, "{bytes:?}: {err}");
        assert_eq!(server.close_code(), Some(close::PROTOCOL), "{bytes:?}");
        assert!(matches!(
            server.handle_stream(t0, &bytes),
            Err(ServerError::Closed)
        ));
    }
    // A stream that ends early.
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    assert!(server
        .handle_stream(t0, &[0x00])
        .expect("partial")
        .is_none());
    let err = server.handle_stream_end().expect_err("ended early");
    assert_eq!(err.label(), "stream");
    assert_eq!(server.close_code(), Some(close::PROTOCOL));
}

#[test]
fn bad_answers_to_the_hello_close_the_client() {
    let t0 = Instant::now();
    let cases: Vec<Vec<u8>> = vec![
        vec![0xff, 0xff],
        framed(&Message::Hello(hello("web-1"))),
        [
            framed(&Message::Welcome(Welcome { interval_ms: 1000 })),
            framed(&Message::Welcome(Welcome { interval_ms: 1000 })),
        ]
        .concat(),
        (3u16.to_be_bytes().iter().copied().chain([9, 9, 9])).collect(),
    ];
    for bytes in cases {
        let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
        let err = client.handle_stream(t0, &bytes).expect_err("refused");
        assert!(matches!(err, ClientError::Protocol(_)), "{bytes:?}: {err}");
        assert!(client.is_closed());
    }
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    assert!(matches!(
        client.handle_stream_end(),
        Err(ClientError::Protocol(ProtocolError::StreamEnded))
    ));
}

#[test]
fn bad_datagrams_are_dropped_until_too_many_close_the_server() {
    let t0 = Instant::now();
    let (_, mut server) = established(t0);
    let mut old = report(1);
    old[0] = 1;
    let faults: [(Vec<u8>, &str); 4] = [
        (vec![WIRE_VERSION, 0xff], "malformed"),
        (old, "unknown_version"),
        (vec![WIRE_VERSION; 2000], "oversized"),
        (
            datagram(&Message::Hello(hello("web-1"))),
            "unexpected_message",
        ),
    ];
    for i in 0..15 {
        let (bytes, label) = &faults[i % faults.len()];
        let err = server.handle_datagram(bytes).expect_err("dropped");
        assert_eq!(err.label(), *label);
        assert!(matches!(err, ServerError::Protocol(_)), "{err}");
        assert_eq!(server.close_code(), None, "one bad datagram costs nothing");
    }
    // Good reports in between still pass.
    assert!(matches!(
        server.handle_datagram(&report(1)),
        Ok(ServerEvent::Report(_))
    ));
    let err = server.handle_datagram(&[]).expect_err("the sixteenth");
    assert!(
        matches!(err, ServerError::TooManyBadDatagrams { count: 16, .. }),
        "{err}"
    );
    assert_eq!(err.label(), "malformed");
    assert_eq!(server.close_code(), Some(close::PROTOCOL));
}

#[test]
fn bad_datagrams_never_close_the_client() {
    let t0 = Instant::now();
    let (mut client, server) = established(t0);
    for bytes in [
        vec![],
        vec![WIRE_VERSION, 0xff],
        report(3),
        vec![0; 5000],
        datagram(&Message::Reject(Reject {
            reason: RejectReason::NoHello,
            detail: String::new(),
        })),
    ] {
        assert!(matches!(
            client.handle_datagram(t0, &bytes),
            Err(ClientError::Protocol(_))
        ));
        assert!(client.is_established());
    }
    let reply = server.reply(&assignment(0.7, 9)).expect("reply");
    assert!(client.handle_datagram(t0, &reply).is_ok());
}

#[test]
fn datagrams_before_the_welcome_are_dropped() {
    let t0 = Instant::now();
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    let err = server
        .handle_datagram(&report(1))
        .expect_err("no hello yet");
    assert_eq!(err.label(), "no_hello");
    assert_eq!(server.close_code(), None);
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    let reply = datagram(&Message::Reply(crate::wire::Reply {
        weight: 1.0,
        cycle: 1,
        interval_ms: 1000,
        draining: false,
        load: 0.1,
        inflight_trusted: true,
    }));
    assert!(matches!(
        client.handle_datagram(t0, &reply),
        Err(ClientError::NotEstablished)
    ));
    assert!(matches!(
        client.report(measurement()),
        Err(ClientError::NotEstablished)
    ));
    assert!(!client.is_closed());
}

/// What a fuzzed peer can do to a machine.
#[derive(Debug, Clone)]
enum Input {
    Stream(Vec<u8>),
    StreamEnd,
    Datagram(Vec<u8>),
    Timeout(u64),
    /// Valid bytes, so that fuzzing reaches past the hello.
    Valid,
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..1500).prop_map(Input::Stream),
        Just(Input::StreamEnd),
        proptest::collection::vec(any::<u8>(), 0..1500).prop_map(Input::Datagram),
        (0u64..10_000).prop_map(Input::Timeout),
        Just(Input::Valid),
    ]
}

proptest! {
    #[test]
    fn arbitrary_input_never_panics_the_server(inputs in proptest::collection::vec(input(), 0..24)) {
        let t0 = Instant::now();
        let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
        let mut now = t0;
        let mut seq = 0u32;
        for i in inputs {
            match i {
                Input::Stream(b) => {
                    if let Ok(Some(ServerEvent::Hello(_))) = server.handle_stream(now, &b) {
                        let _ = server.welcome();
                    }
                }
                Input::StreamEnd => { let _ = server.handle_stream_end(); }
                Input::Datagram(b) => {
                    if let Ok(ServerEvent::Report(_)) = server.handle_datagram(&b) {
                        prop_assert!(server.reply(&assignment(1.0, 1)).is_ok());
                    }
                }
                Input::Timeout(d) => {
                    now += Duration::from_millis(d);
                    let _ = server.handle_timeout(now);
                }
                Input::Valid => {
                    if server.is_established() {
                        seq = seq.wrapping_add(1);
                        let _ = server.handle_datagram(&report(seq));
                    } else if let Ok(Some(ServerEvent::Hello(_))) =
                        server.handle_stream(now, &framed(&Message::Hello(hello("web-1"))))
                    {
                        let _ = server.welcome();
                    }
                }
            }
            let _ = (server.poll_timeout(), server.close_code(), server.hello());
        }
    }

    #[test]
    fn arbitrary_input_never_panics_the_client(inputs in proptest::collection::vec(input(), 0..24)) {
        let t0 = Instant::now();
        let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
        let mut now = t0;
        for i in inputs {
            match i {
                Input::Stream(b) => { let _ = client.handle_stream(now, &b); }
                Input::StreamEnd => { let _ = client.handle_stream_end(); }
                Input::Datagram(b) => { let _ = client.handle_datagram(now, &b); }
                Input::Timeout(d) => {
                    now += Duration::from_millis(d);
                    if let Ok(Some(ClientEvent::ReportDue)) = client.handle_timeout(now) {
                        prop_assert!(client.report(measurement()).is_ok());
                    }
                }
                Input::Valid => {
                    let welcome = framed(&Message::Welcome(Welcome { interval_ms: 500 }));
                    if client.handle_stream(now, &welcome).is_err() && client.is_established() {
                        let reply = datagram(&Message::Reply(crate::wire::Reply {
                            weight: 2.0, cycle: 3, interval_ms: 300, draining: true,
                            load: 0.9, inflight_trusted: false,
                        }));
                        prop_assert!(client.handle_datagram(now, &reply).is_ok());
                    }
                }
            }
            let _ = (client.poll_timeout(), client.assignment(), client.interval());
            if let Some(t) = client.poll_timeout() {
                prop_assert!(t >= t0);
            }
        }
    }

    #[test]
    fn mutated_hellos_never_panic_the_server(flip in 0usize..128, val in any::<u8>(), cut in 0usize..128) {
        let t0 = Instant::now();
        let mut bytes = framed(&Message::Hello(hello("web-1")));
        let i = flip % bytes.len();
        bytes[i] = val;
        let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
        let (a, b) = bytes.split_at(cut.min(bytes.len()));
        let _ = server.handle_stream(t0, a);
        let _ = server.handle_stream(t0, b);
        let _ = server.handle_stream_end();
    }
}

#[test]
fn the_client_answers_a_relays_challenges_before_and_after_the_welcome() {
    let t0 = Instant::now();
    let (cert, key) = proof::test_identity("web-1", &rcgen::PKCS_ECDSA_P256_SHA256);
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0).with_key(key);
    let mut server = ServerSession::new(peer("web-1"), ServerConfig::new(1000), t0);
    for nonce in [1u8, 2] {
        let challenge = wire::Challenge {
            nonce: [nonce; wire::NONCE_LEN],
            primary: "r1".into(),
        };
        let frame = server.challenge_frame(&challenge).expect("frames");
        assert_eq!(client.handle_stream(t0, &frame).expect("answered"), None);
        let proofs = server
            .handle_proofs(&client.take_stream_out())
            .expect("proofs");
        let [proof] = &proofs[..] else {
            panic!("one proof: {proofs:?}");
        };
        assert_eq!(
            proof::verify(&cert, &challenge, &hello("web-1"), proof),
            Ok(())
        );
        assert!(client.take_stream_out().is_empty());
        if nonce == 1 {
            // Then the welcome; the next challenge (a move to another primary) comes
            // after it.
            let welcome = framed(&Message::Welcome(Welcome { interval_ms: 1000 }));
            assert!(matches!(
                client.handle_stream(t0, &welcome),
                Ok(Some(ClientEvent::Welcomed { .. }))
            ));
        }
    }
    assert!(client.is_established());
    // After the welcome, anything but a challenge breaks the protocol.
    let reply = framed(&Message::Welcome(Welcome { interval_ms: 1000 }));
    assert!(matches!(
        client.handle_stream(t0, &reply),
        Err(ClientError::Protocol(ProtocolError::Unexpected { .. }))
    ));
    // And on the server's side, anything but a proof.
    assert!(server.handle_proofs(&reply).is_err());
}

#[test]
fn a_client_without_its_key_cannot_answer() {
    let t0 = Instant::now();
    let mut client = ClientSession::new(hello("web-1"), ClientConfig::default(), t0);
    let challenge = wire::Challenge {
        nonce: [1; wire::NONCE_LEN],
        primary: "r1".into(),
    };
    let frame = framed(&Message::Challenge(challenge.clone()));
    assert!(matches!(
        client.handle_stream(t0, &frame),
        Err(ClientError::Proof(proof::ProofError::UnsupportedKey))
    ));
    assert!(client.is_closed());
}
