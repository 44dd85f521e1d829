//! Tests of the operators' actions: drains that hold whatever the agent says, holds
//! that freeze the weights to the bit, pins, their lapse and their storage.

use super::*;
use crate::publish::PublishedService;

const SVC: &str = "web";
const T0: WallMillis = 1_700_000_000_000;

fn params() -> Params {
    Params {
        grace_ms: 0,
        feed_forward: false,
        ..Params::default()
    }
}

fn fleet(n: usize) -> Balancer {
    let mut b = Balancer::new(params(), 0);
    for i in 0..n {
        b.register(0, SVC, &format!("n{i}"), &format!("10.0.0.{i}:80"), "")
            .expect("registers");
    }
    b
}

fn obs(load: f64) -> Observation {
    Observation {
        cpu: load,
        ..Observation::default()
    }
}

fn report(b: &mut Balancer, now: Millis, loads: &[f64], skip: &[usize]) {
    for (i, &l) in loads.iter().enumerate() {
        if !skip.contains(&i) {
            b.observe(now, SVC, &format!("n{i}"), obs(l))
                .expect("observes");
        }
    }
}

fn act(action: Action) -> Act {
    Act {
        action,
        by: "alice".into(),
        reason: "incident 7".into(),
        at: T0,
    }
}

fn drain(node: &str) -> Act {
    act(Action::Drain { node: node.into() })
}

/// Published weights and drain states, as every feed sees them.
fn published(b: &Balancer) -> Vec<(f64, bool)> {
    let svc = b.service(SVC).expect("service");
    svc.endpoints()
        .values()
        .map(|e| svc.published(&e))
        .collect()
}

/// Loads that differ by node and by cycle, so that a running controller moves weights.
fn loads(cycle: u64) -> Vec<f64> {
    (0..4)
        .map(|i| 0.3 + 0.1 * i as f64 + 0.05 * (cycle % 3) as f64)
        .collect()
}

#[test]
fn an_operator_drain_shows_at_once_and_holds_whatever_the_agent_says() {
    let mut b = fleet(4);
    report(&mut b, 0, &loads(0), &[]);
    b.cycle(0);
    let version = b.service(SVC).expect("svc").version;
    b.act(SVC, &drain("n2")).expect("drains");
    // Before any cycle: the published state is draining, in a new version.
    assert_eq!(published(&b)[2], (0.0, true));
    assert!(b.service(SVC).expect("svc").version > version);
    // The agent says it serves; the operator's drain wins, in its reply too.
    let a = b.observe(1000, SVC, "n2", obs(0.5)).expect("observes");
    assert!(a.endpoint.draining());
    assert_eq!(a.endpoint.weight(), 0.0);
    report(&mut b, 1000, &loads(1), &[2]);
    b.cycle(1000);
    assert_eq!(published(&b)[2], (0.0, true));
    // Undrained, it comes back cold, as from its agent's own drain.
    b.act(SVC, &act(Action::Undrain { node: "n2".into() }))
        .expect("undrains");
    let svc = b.service(SVC).expect("svc");
    let e = svc.endpoint("n2").expect("endpoint");
    assert!(!e.draining());
    assert_eq!(e.strategy_weights().pid, params().cold_start_weight);
}

#[test]
fn undrain_leaves_a_node_draining_whose_agent_asks_to() {
    let mut b = fleet(3);
    let draining = Observation {
        draining: true,
        ..obs(0.2)
    };
    b.observe(0, SVC, "n1", draining).expect("observes");
    b.act(SVC, &drain("n1")).expect("drains");
    b.act(SVC, &act(Action::Undrain { node: "n1".into() }))
        .expect("undrains");
    assert!(b
        .service(SVC)
        .expect("svc")
        .endpoint("n1")
        .expect("endpoint")
        .draining());
}

#[test]
fn a_silent_node_drained_by_an_operator_freezes_nothing() {
    // Ten nodes, two silent since their last reports (their agents were stopped):
    // 20 % missing, above the threshold set here. Draining them takes them out of the
    // count.
    let mut b = fleet(10);
    let mut p = params();
    p.missing_threshold = 0.05;
    b.set_params(SVC, p.clone());
    let l = vec![0.5; 10];
    report(&mut b, 0, &l, &[]);
    b.cycle(0);
    let later = p.stale_ms + 1000;
    report(&mut b, later, &l, &[3, 7]);
    let r = b.cycle(later).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::Missing { .. })));
    b.act(SVC, &drain("n3")).expect("drains");
    b.act(SVC, &drain("n7")).expect("drains");
    report(&mut b, later + 1000, &l, &[3, 7]);
    let r = b.cycle(later + 1000).remove(0);
    assert_eq!(r.skipped, None, "the silent drained nodes are not missing");
    assert_eq!(r.missing_share, 0.0);
    assert_eq!(published(&b)[3], (0.0, true));
    assert_eq!(published(&b)[7], (0.0, true));
}

#[test]
fn a_hold_keeps_the_weights_to_the_bit_while_loads_change_and_release_resumes() {
    let mut b = fleet(4);
    for c in 0..5 {
        report(&mut b, c * 1000, &loads(c), &[]);
        b.cycle(c * 1000);
    }
    b.act(SVC, &act(Action::Hold { until_ms: None }))
        .expect("holds");
    let frozen: Vec<u64> = published(&b).iter().map(|(w, _)| w.to_bits()).collect();
    let live: Vec<u64> = weights(&b).iter().map(|w| w.to_bits()).collect();
    for c in 5..15 {
        report(&mut b, c * 1000, &loads(c), &[]);
        let r = b.cycle(c * 1000).remove(0);
        assert_eq!(r.skipped, Some(SkipReason::Held { until_ms: None }));
        let now: Vec<u64> = published(&b).iter().map(|(w, _)| w.to_bits()).collect();
        assert_eq!(now, frozen, "cycle {c}");
        let now: Vec<u64> = weights(&b).iter().map(|w| w.to_bits()).collect();
        assert_eq!(now, live, "cycle {c}");
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.stats.skipped.get("held"), Some(&10));
    b.act(SVC, &act(Action::Release)).expect("releases");
    report(&mut b, 15_000, &loads(15), &[]);
    let r = b.cycle(15_000).remove(0);
    assert_eq!(r.skipped, None);
    let now: Vec<u64> = weights(&b).iter().map(|w| w.to_bits()).collect();
    assert_ne!(now, live, "the first cycle after the release moves weights");
}

fn weights(b: &Balancer) -> Vec<f64> {
    b.service(SVC)
        .expect("service")
        .endpoints()
        .values()
        .map(|e| e.weight())
        .collect()
}

#[test]
fn a_hold_with_an_end_lapses_then_and_not_before() {
    let mut b = fleet(2);
    let until = T0 + 60_000;
    b.act(
        SVC,
        &act(Action::Hold {
            until_ms: Some(until),
        }),
    )
    .expect("holds");
    assert!(b.lapse(until - 1).is_empty());
    assert!(b.service(SVC).expect("svc").actions().hold.is_some());
    let version = b.service(SVC).expect("svc").version;
    let lapsed = b.lapse(until);
    assert_eq!(lapsed.len(), 1);
    assert_eq!(lapsed[0].action, Action::Release);
    assert_eq!(lapsed[0].mark.by, "alice");
    let svc = b.service(SVC).expect("svc");
    assert!(svc.actions().hold.is_none());
    assert!(svc.version > version, "the lapse is stored");
}

#[test]
fn a_pin_fixes_one_weight_and_the_others_share_the_rest() {
    let mut b = fleet(4);
    for c in 0..3 {
        report(&mut b, c * 1000, &loads(c), &[]);
        b.cycle(c * 1000);
    }
    let pin = Action::Pin {
        node: "n0".into(),
        weight: 0.5,
        until_ms: Some(T0 + 10_000),
    };
    b.act(SVC, &act(pin)).expect("pins");
    assert_eq!(published(&b)[0].0, 0.5);
    for c in 3..10 {
        report(&mut b, c * 1000, &loads(c), &[]);
        let r = b.cycle(c * 1000).remove(0);
        assert_eq!(r.skipped, None);
        let w = weights(&b);
        assert_eq!(w[0].to_bits(), 0.5f64.to_bits(), "cycle {c}");
        let rest: f64 = w[1..].iter().sum();
        assert!(
            (rest - 3.5).abs() < 1e-9,
            "the others share the rest: {w:?}"
        );
    }
    let lapsed = b.lapse(T0 + 10_000);
    assert_eq!(lapsed[0].action, Action::Unpin { node: "n0".into() });
    report(&mut b, 10_000, &[0.1, 0.6, 0.6, 0.6], &[]);
    b.cycle(10_000);
    assert_ne!(weights(&b)[0], 0.5, "the controller steers it again");
}

#[test]
fn bad_actions_are_refused_with_their_reason_and_change_nothing() {
    let mut b = fleet(2);
    let version = b.service(SVC).expect("svc").version;
    let mut no_reason = drain("n0");
    no_reason.reason = "  ".into();
    assert_eq!(b.act(SVC, &no_reason), Err(ActError::NoReason));
    let mut long = drain("n0");
    long.reason = "x".repeat(operator::MAX_REASON + 1);
    assert_eq!(b.act(SVC, &long), Err(ActError::ReasonTooLong));
    assert!(matches!(
        b.act("nope", &drain("n0")),
        Err(ActError::UnknownService(_))
    ));
    assert!(matches!(
        b.act(SVC, &drain("n9")),
        Err(ActError::UnknownEndpoint { .. })
    ));
    for weight in [0.0, -1.0, f64::NAN, f64::INFINITY, 11.0] {
        let pin = Action::Pin {
            node: "n0".into(),
            weight,
            until_ms: None,
        };
        assert!(
            matches!(b.act(SVC, &act(pin)), Err(ActError::BadWeight { .. })),
            "{weight}"
        );
    }
    let past = Action::Hold {
        until_ms: Some(T0 - 1),
    };
    assert!(matches!(
        b.act(SVC, &act(past)),
        Err(ActError::UntilPast { .. })
    ));
    for lift in [
        Action::Release,
        Action::Undrain { node: "n0".into() },
        Action::Unpin { node: "n0".into() },
    ] {
        assert!(matches!(
            b.act(SVC, &act(lift)),
            Err(ActError::NotInForce(_))
        ));
    }
    let svc = b.service(SVC).expect("svc");
    assert!(svc.actions().is_empty());
    assert_eq!(svc.version, version);
}

#[test]
fn actions_are_stored_with_the_service_and_hold_after_a_restore() {
    let mut b = fleet(3);
    report(&mut b, 0, &[0.5; 3], &[]);
    b.cycle(0);
    b.act(SVC, &drain("n1")).expect("drains");
    b.act(
        SVC,
        &act(Action::Hold {
            until_ms: Some(T0 + 5),
        }),
    )
    .expect("holds");
    let pin = Action::Pin {
        node: "n2".into(),
        weight: 2.0,
        until_ms: None,
    };
    b.act(SVC, &act(pin)).expect("pins");
    let published = PublishedService::of(b.service(SVC).expect("svc"), 0, Default::default());
    let snapshot = published.snapshot();
    let json = serde_json::to_string(&snapshot).expect("serializes");
    let stored: ServiceSnapshot = serde_json::from_str(&json).expect("parses");
    assert_eq!(stored, snapshot);
    assert_eq!(stored.operator, *b.service(SVC).expect("svc").actions());

    // A new aggregator restores it.
    let mut after = Balancer::new(params(), 0);
    after.restore(0, &[(SVC.to_string(), stored)].into_iter().collect());
    let svc = after.service(SVC).expect("restored");
    assert_eq!(svc.actions().drains["n1"].by, "alice");
    // The drained node's agent says it serves: still drained.
    let a = after.observe(100, SVC, "n1", obs(0.5)).expect("observes");
    assert!(a.endpoint.draining());
    let r = after.cycle(100).remove(0);
    assert_eq!(
        r.skipped,
        Some(SkipReason::Held {
            until_ms: Some(T0 + 5)
        })
    );
    let svc = after.service(SVC).expect("svc");
    assert_eq!(svc.endpoint("n2").expect("endpoint").weight(), 2.0);

    // A snapshot from before operators could act has none.
    let old = r#"{"version":1,"cycle":1,"endpoints":{}}"#;
    let old: ServiceSnapshot = serde_json::from_str(old).expect("parses");
    assert!(old.operator.is_empty());
}

#[test]
fn a_drained_node_that_expired_comes_back_drained() {
    let mut b = fleet(3);
    report(&mut b, 0, &[0.5; 3], &[]);
    b.cycle(0);
    b.act(SVC, &drain("n0")).expect("drains");
    let late = params().expire_ms + 10_000;
    report(&mut b, late, &[0.5; 3], &[0]);
    let r = b.cycle(late).remove(0);
    assert_eq!(r.expired, vec!["n0".to_string()]);
    b.register(late + 1, SVC, "n0", "10.0.0.0:80", "")
        .expect("registers");
    let a = b.observe(late + 2, SVC, "n0", obs(0.1)).expect("observes");
    assert!(a.endpoint.draining(), "the operator's drain still holds");
}
