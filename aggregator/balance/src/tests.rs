//! Tests of every cycle rule, driven through the public API with an explicit clock.

use super::service::MAX_JUMP_SKIPS;
use super::Strategy;
use super::*;
use proptest::prelude::*;

const SVC: &str = "web";

/// The rules one at a time: no grace period, and no feed-forward step (its own tests
/// below), so that each cycle is one controller update.
fn params() -> Params {
    Params {
        grace_ms: 0,
        feed_forward: false,
        ..Params::default()
    }
}

/// A balancer with `n` registered endpoints `n0..`, at time 0.
fn fleet(n: usize, p: Params) -> Balancer {
    let mut b = Balancer::new(p, 0);
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

fn report_all(b: &mut Balancer, now: Millis, loads: &[f64], skip: &[usize]) {
    for (i, &l) in loads.iter().enumerate() {
        if !skip.contains(&i) {
            b.observe(now, SVC, &format!("n{i}"), obs(l))
                .expect("observes");
        }
    }
}

fn weights(b: &Balancer) -> Vec<f64> {
    b.service(SVC)
        .expect("service")
        .endpoints()
        .values()
        .map(|e| e.weight())
        .collect()
}

/// Closed loop: endpoint i of speed s_i carrying weight w_i of offered load shows
/// load `offered × w_i / s_i`. Returns max/avg after `cycles` cycles.
fn run_plant(b: &mut Balancer, speeds: &[f64], offered: f64, from: Millis, cycles: u64) -> f64 {
    let mut last = 0.0;
    for c in 0..cycles {
        let now = from + c * 1000;
        let w = weights(b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        let loads: Vec<f64> = speeds
            .iter()
            .zip(&w)
            .map(|(s, w)| offered * (w / mean_w) / s)
            .collect();
        report_all(b, now, &loads, &[]);
        last = b.cycle(now)[0].spread.max_over_avg;
    }
    last
}

#[test]
fn fourteen_percent_missing_updates_and_sixteen_does_not() {
    // 50 endpoints: 7 missing is 14 %, 8 missing is 16 %.
    for (missing, updates) in [(7usize, true), (8, false)] {
        let mut b = fleet(50, params());
        let loads: Vec<f64> = (0..50).map(|i| 0.3 + 0.01 * i as f64).collect();
        report_all(&mut b, 0, &loads, &[]);
        b.cycle(0);
        let before = weights(&b);
        let skip: Vec<usize> = (0..missing).collect();
        report_all(&mut b, 10_000, &loads, &skip);
        let r = b.cycle(10_000).remove(0);
        assert_eq!(
            r.skipped.is_none(),
            updates,
            "{missing} missing: {:?}",
            r.skipped
        );
        if !updates {
            assert!(matches!(r.skipped, Some(SkipReason::Missing { .. })));
            assert_eq!(weights(&b), before, "a skipped cycle leaves every weight");
            let svc = b.service(SVC).expect("service");
            assert_eq!(svc.stats.skipped.get("missing"), Some(&1));
            assert!(svc
                .stats
                .last_skip
                .expect("reason")
                .describe()
                .contains("16.0 %"));
        }
    }
}

#[test]
fn missing_endpoints_keep_their_weight() {
    let mut b = fleet(10, params());
    let speeds = [0.6, 1.0, 1.4, 0.6, 1.0, 1.4, 0.6, 1.0, 1.4, 1.0];
    run_plant(&mut b, &speeds, 0.5, 0, 5);
    let held = b
        .service(SVC)
        .expect("svc")
        .endpoint("n0")
        .expect("endpoint")
        .weight();
    let loads: Vec<f64> = (0..10).map(|i| 0.2 + 0.05 * i as f64).collect();
    report_all(&mut b, 10_000, &loads, &[0]);
    let r = b.cycle(10_000).remove(0);
    assert!(r.skipped.is_none());
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoint("n0").expect("endpoint").weight(), held);
    assert_eq!(
        svc.endpoint("n0")
            .expect("endpoint")
            .state(10_000, &svc.params),
        EndpointState::Missing
    );
    // The others still share a mean weight of 1 with it.
    let w = weights(&b);
    assert!((w.iter().sum::<f64>() / 10.0 - 1.0).abs() < 1e-9);
}

#[test]
fn a_lost_report_holds_the_weight_instead_of_repeating_the_last_error() {
    let mut b = fleet(4, params());
    report_all(&mut b, 0, &[0.9, 0.5, 0.5, 0.5], &[]);
    b.cycle(0);
    let after_first = b
        .service(SVC)
        .expect("svc")
        .endpoint("n0")
        .expect("endpoint")
        .weight();
    // n0's next report is lost; it is still fresh (within stale_ms) but has no news.
    report_all(&mut b, 1000, &[0.9, 0.5, 0.5, 0.5], &[0]);
    let r = b.cycle(1000).remove(0);
    assert!(r.skipped.is_none());
    let svc = b.service(SVC).expect("svc");
    assert_eq!(
        svc.endpoint("n0")
            .expect("endpoint")
            .state(1000, &svc.params),
        EndpointState::Serving
    );
    assert_eq!(svc.endpoint("n0").expect("endpoint").weight(), after_first);
}

#[test]
fn heterogeneous_fleet_converges() {
    let speeds = [0.6, 0.6, 1.0, 1.0, 1.0, 1.5, 1.5, 0.6, 1.0, 1.5];
    let mut b = fleet(speeds.len(), params());
    let first = run_plant(&mut b, &speeds, 0.6, 0, 1);
    assert!(first > 1.3, "equal weights start imbalanced: {first}");
    let settled = run_plant(&mut b, &speeds, 0.6, 1000, 20);
    assert!(settled < 1.02, "max/avg after 20 cycles: {settled}");
}

#[test]
fn cold_start_ramps_without_overshoot() {
    let speeds = [1.0; 8];
    let mut b = fleet(7, params());
    run_plant(&mut b, &speeds[..7], 0.6, 0, 5);
    b.register(5000, SVC, "n7", "10.0.0.7:80", "")
        .expect("registers");
    let start = b
        .service(SVC)
        .expect("svc")
        .endpoint("n7")
        .expect("endpoint")
        .weight();
    assert!(start <= 0.11, "newcomer starts low: {start}");
    let mut peak: f64 = 0.0;
    let mut warmed = false;
    for c in 0..30u64 {
        let now = 6000 + c * 1000;
        let w = weights(&b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        let loads: Vec<f64> = w.iter().map(|w| 0.6 * w / mean_w).collect();
        report_all(&mut b, now, &loads, &[]);
        b.cycle(now);
        let svc = b.service(SVC).expect("svc");
        let avg = svc.stats.spread.avg;
        peak = peak.max(loads[7] / avg);
        warmed |= svc
            .endpoint("n7")
            .expect("endpoint")
            .state(now, &svc.params)
            == EndpointState::Serving;
    }
    assert!(warmed, "the newcomer finishes warming");
    assert!(peak <= 1.1, "newcomer overshot to {peak} × average");
    let w = b
        .service(SVC)
        .expect("svc")
        .endpoint("n7")
        .expect("endpoint")
        .weight();
    assert!(
        (w - 1.0).abs() < 0.05,
        "newcomer reaches the mean weight: {w}"
    );
}

#[test]
fn the_first_endpoints_of_a_service_start_equal_and_later_ones_cold() {
    let mut b = fleet(3, params());
    assert_eq!(weights(&b), vec![1.0, 1.0, 1.0]);
    report_all(&mut b, 0, &[0.5; 3], &[]);
    b.cycle(0);
    b.register(1000, SVC, "late", "h:9", "").expect("registers");
    let svc = b.service(SVC).expect("svc");
    assert_eq!(
        svc.endpoint("late").expect("endpoint").weight(),
        params().cold_start_weight
    );
    assert_eq!(
        svc.endpoint("late")
            .expect("endpoint")
            .state(1000, &svc.params),
        EndpointState::Missing
    );
}

#[test]
fn draining_gives_zero_and_undrain_restarts_cold() {
    let mut b = fleet(4, params());
    report_all(&mut b, 0, &[0.5; 4], &[]);
    b.cycle(0);
    let draining = Observation {
        draining: true,
        ..obs(0.5)
    };
    let a = b.observe(1000, SVC, "n2", draining).expect("observes");
    assert_eq!(a.endpoint.weight(), 0.0);
    assert!(a.endpoint.draining());
    report_all(&mut b, 1000, &[0.5, 0.5, 0.5, 0.5], &[2]);
    let r = b.cycle(1000).remove(0);
    assert!(r.changed);
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoint("n2").expect("endpoint").weight(), 0.0);
    // The average is over serving endpoints only.
    assert!((svc.stats.spread.avg - 0.5).abs() < 1e-9);
    b.observe(2000, SVC, "n2", obs(0.0)).expect("observes");
    let w = b
        .service(SVC)
        .expect("svc")
        .endpoint("n2")
        .expect("endpoint")
        .strategy_weights()
        .pid;
    assert_eq!(w, params().cold_start_weight);
}

/// Drains `n3` of a converged fleet of four equal nodes, then undrains it, and follows
/// its published weight: it must come back from the cold-start weight, not jump to
/// its old share, and ramp to the mean without overshoot.
#[test]
fn undrained_endpoint_ramps_up_from_the_cold_start_weight() {
    let speeds = [1.0; 4];
    let mut b = fleet(4, params());
    run_plant(&mut b, &speeds, 0.6, 0, 5);
    let drained = Observation {
        draining: true,
        ..obs(0.0)
    };
    // Drained for five cycles; the other three carry everything.
    for c in 5..10u64 {
        let now = c * 1000;
        b.observe(now, SVC, "n3", drained).expect("observes");
        report_all(&mut b, now, &[0.8, 0.8, 0.8], &[]);
        b.cycle(now);
    }
    assert_eq!(
        b.service(SVC)
            .expect("svc")
            .endpoint("n3")
            .expect("endpoint")
            .weight(),
        0.0
    );

    let cold = params().cold_start_weight;
    let mut ramp = Vec::new();
    for c in 10..40u64 {
        let now = c * 1000;
        let w = weights(&b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        let loads: Vec<f64> = w.iter().map(|w| 0.6 * w / mean_w).collect();
        report_all(&mut b, now, &loads, &[]);
        if c == 10 {
            let ep = &b
                .service(SVC)
                .expect("svc")
                .endpoint("n3")
                .expect("endpoint");
            assert!(!ep.draining());
            assert_eq!(ep.strategy_weights().pid, cold, "restarts cold");
        }
        b.cycle(now);
        let svc = b.service(SVC).expect("svc");
        let ep = &svc.endpoint("n3").expect("endpoint");
        if c == 10 {
            assert_eq!(ep.state(now, &svc.params), EndpointState::Warming);
        }
        ramp.push(ep.weight());
    }
    // One cycle's growth from the cold-start weight, plus the renormalisation of a
    // fleet whose other three shrink to make room.
    let first_limit = cold * params().max_growth * 1.5;
    assert!(
        ramp[0] <= first_limit,
        "the first weight after the undrain is one step up from the cold-start one \
         ({cold}), at most {first_limit}: {ramp:?}"
    );
    assert!(
        ramp.windows(2).take(5).all(|w| w[1] > w[0]),
        "it ramps up: {ramp:?}"
    );
    let last = ramp[ramp.len() - 1];
    assert!((last - 1.0).abs() < 0.05, "it ends at the mean: {ramp:?}");
    assert!(
        ramp.iter().all(|w| *w <= 1.1),
        "no overshoot on the way: {ramp:?}"
    );
}

/// A drained node whose agent was stopped is silent on purpose: the rest of the
/// fleet keeps balancing instead of skipping every cycle for a missing share.
#[test]
fn a_silent_drained_endpoint_is_not_missing() {
    let mut b = fleet(3, params());
    report_all(&mut b, 0, &[0.5; 3], &[]);
    b.cycle(0);
    b.observe(
        1000,
        SVC,
        "n2",
        Observation {
            draining: true,
            ..obs(0.0)
        },
    )
    .expect("observes");
    // n2 falls silent for much longer than the staleness limit.
    for c in 1..10u64 {
        let now = c * 1000;
        // n0 is twice as slow as n1: their CPU follows their weights.
        let w = weights(&b);
        report_all(&mut b, now, &[0.7 * w[0], 0.35 * w[1]], &[]);
        let r = b.cycle(now).remove(0);
        assert_eq!(r.skipped, None, "cycle {c}: {r:?}");
        assert_eq!(r.missing_share, 0.0);
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoint("n2").expect("endpoint").weight(), 0.0);
    assert!(svc.endpoint("n2").expect("endpoint").draining());
    assert!(
        svc.endpoint("n0").expect("endpoint").weight()
            < svc.endpoint("n1").expect("endpoint").weight(),
        "the two serving nodes were balanced meanwhile"
    );
    // A silent node that is not draining is still missing (one of the two serving).
    let r = {
        report_all(&mut b, 20_000, &[0.5], &[]);
        b.cycle(20_000).remove(0)
    };
    assert_eq!(r.missing_share, 0.5, "{r:?}");
}

#[test]
fn drain_takes_effect_even_in_a_skipped_cycle() {
    let mut b = Balancer::new(Params::default(), 0); // 3 s grace
    b.register(0, SVC, "a", "h:1", "").expect("registers");
    b.register(0, SVC, "b", "h:2", "").expect("registers");
    b.observe(
        0,
        SVC,
        "a",
        Observation {
            draining: true,
            ..obs(0.5)
        },
    )
    .expect("observes");
    b.observe(0, SVC, "b", obs(0.5)).expect("observes");
    let r = b.cycle(1000).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::Grace { .. })));
    assert_eq!(
        b.service(SVC)
            .expect("svc")
            .endpoint("a")
            .expect("endpoint")
            .weight(),
        0.0
    );
}

#[test]
fn bounds_hold_under_extreme_loads() {
    let mut b = fleet(5, params());
    for c in 0..200u64 {
        report_all(&mut b, c * 1000, &[100.0, 0.001, 0.5, 0.5, 0.5], &[]);
        b.cycle(c * 1000);
    }
    let w = weights(&b);
    let p = params();
    for x in &w {
        assert!(
            *x >= p.min_weight - 1e-12 && *x <= p.max_weight + 1e-12,
            "{x}"
        );
    }
    assert!((w.iter().sum::<f64>() / 5.0 - 1.0).abs() < 1e-9);
    assert!(
        (w[0] - p.min_weight).abs() < 1e-9,
        "the overloaded one sits at the floor"
    );
}

#[test]
fn zero_and_absent_loads_give_no_nan() {
    let mut b = fleet(3, params());
    for c in 0..10u64 {
        report_all(&mut b, c * 1000, &[0.0, 0.0, 0.0], &[]);
        let r = b.cycle(c * 1000).remove(0);
        assert!(matches!(r.skipped, Some(SkipReason::ThinFeedback { .. })));
    }
    // NaN and negative loads read as idle, infinity as the largest load. From an idle
    // fleet that is a load jump, which may be skipped as any jump is; then the cycle
    // runs on them and moves weight away from the one that reported infinity.
    let mut ran = false;
    for c in 0..=MAX_JUMP_SKIPS {
        let now = 20_000 + u64::from(c) * 1000;
        report_all(&mut b, now, &[f64::NAN, f64::INFINITY, -1.0], &[]);
        let r = b.cycle(now).remove(0);
        match r.skipped {
            None => {
                ran = true;
                break;
            }
            Some(SkipReason::LoadJump { .. }) => {}
            Some(other) => panic!("skipped for {other:?}"),
        }
    }
    assert!(ran, "no cycle ran on the sanitised loads");
    let w = weights(&b);
    for x in &w {
        assert!(x.is_finite() && *x > 0.0, "{w:?}");
    }
    assert!(w[1] < w[0] && w[1] < w[2], "{w:?}");
    // A service where nobody reports at all.
    let mut b = fleet(3, params());
    let r = b.cycle(0).remove(0);
    assert!(r.skipped.is_some());
    assert!(weights(&b).iter().all(|w| w.is_finite()));
}

#[test]
fn thin_feedback_is_reported_not_chased() {
    let mut b = fleet(4, params());
    report_all(&mut b, 0, &[0.001, 0.01, 0.0, 0.005], &[]);
    let r = b.cycle(0).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::ThinFeedback { .. })));
    assert!(b.service(SVC).expect("svc").stats.thin_feedback);
}

#[test]
fn grace_period_holds_weights_after_a_restore() {
    let mut b = fleet(3, params());
    run_plant(&mut b, &[0.5, 1.0, 1.5], 0.6, 0, 15);
    // What the routing store keeps: the published weights of the last version.
    let published =
        crate::Published::default().next(&b, &Default::default(), &Default::default(), 15_000);
    let snap = published.services[SVC].snapshot();
    let before: Vec<f64> = snap.endpoints.values().map(|e| e.weight).collect();

    let mut restarted = Balancer::new(Params::default(), 100_000);
    restarted.restore(100_000, &[(SVC.to_string(), snap)].into());
    assert_eq!(weights(&restarted), before);
    report_all(&mut restarted, 101_000, &[0.9, 0.1, 0.3], &[]);
    let r = restarted.cycle(101_000).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::Grace { .. })));
    assert_eq!(weights(&restarted), before);
    let r = restarted.cycle(103_500).remove(0);
    assert!(r.skipped.is_none());
}

#[test]
fn long_silent_endpoints_expire() {
    let mut b = fleet(2, params());
    report_all(&mut b, 0, &[0.5, 0.5], &[]);
    let expire = params().expire_ms;
    b.observe(expire, SVC, "n0", obs(0.5)).expect("observes");
    let r = b.cycle(expire + 1).remove(0);
    assert_eq!(r.expired, vec!["n1".to_string()]);
    assert_eq!(b.service(SVC).expect("svc").endpoints().len(), 1);
    assert!(b.observe(expire + 2, SVC, "n1", obs(0.5)).is_err());
}

#[test]
fn one_silent_node_of_ten_expires_while_the_rest_report() {
    let mut b = fleet(10, params());
    let expire = params().expire_ms;
    let loads = [0.5; 10];
    let mut now = 0;
    while now <= expire + 1000 {
        report_all(&mut b, now, &loads, if now == 0 { &[] } else { &[3] });
        let r = b.cycle(now).remove(0);
        if now <= expire {
            assert!(r.expired.is_empty(), "at {now}: {r:?}");
        }
        now += 1000;
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoints().len(), 9);
    assert!(!svc.endpoints().contains_key("n3"));
    assert_eq!(svc.stats.expiry_held, 0);
}

#[test]
fn losing_every_report_never_empties_a_service() {
    let mut b = fleet(10, params());
    let loads = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.5, 0.5, 0.5];
    for c in 0..10 {
        report_all(&mut b, c * 1000, &loads, &[]);
        b.cycle(c * 1000);
    }
    let before = weights(&b);
    let version = b.service(SVC).expect("svc").version;
    // Every report is lost, for ten times the expiry period.
    let expire = params().expire_ms;
    let mut now = 10_000;
    while now < 10 * expire {
        let r = b.cycle(now).remove(0);
        assert!(r.expired.is_empty(), "at {now}: {r:?}");
        now += 60_000;
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoints().len(), 10);
    assert_eq!(svc.stats.expiry_held, 10, "{:?}", svc.stats);
    assert!(matches!(
        svc.stats.last_skip,
        Some(SkipReason::Missing { .. })
    ));
    assert_eq!(weights(&b), before, "no weight moves on missing data");
    assert_eq!(svc.version, version, "nothing new is published");

    // The reports come back: the first cycle with them balances again, and the held
    // count clears.
    report_all(&mut b, now, &loads, &[]);
    let r = b.cycle(now).remove(0);
    assert!(r.skipped.is_none(), "{r:?}");
    assert_eq!(b.service(SVC).expect("svc").stats.expiry_held, 0);
}

#[test]
fn a_large_share_falling_silent_at_once_does_not_expire() {
    // Three of ten go silent together, as when a zone is cut off from the aggregator:
    // 2 of the 9 others silent (22 %) is over the 15 % threshold, so nothing expires,
    // even though seven still report.
    let mut b = fleet(10, params());
    let expire = params().expire_ms;
    let loads = [0.5; 10];
    report_all(&mut b, 0, &loads, &[]);
    let mut now = 1000;
    while now <= 2 * expire {
        report_all(&mut b, now, &loads, &[1, 4, 7]);
        let r = b.cycle(now).remove(0);
        assert!(r.expired.is_empty(), "at {now}: {r:?}");
        now += 5000;
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.endpoints().len(), 10);
    assert_eq!(svc.stats.expiry_held, 3);
}

#[test]
fn the_last_endpoint_of_a_service_never_expires() {
    let mut b = fleet(1, params());
    report_all(&mut b, 0, &[0.5], &[]);
    let r = b.cycle(10 * params().expire_ms).remove(0);
    assert!(r.expired.is_empty());
    assert_eq!(b.service(SVC).expect("svc").endpoints().len(), 1);
}

#[test]
fn a_silent_drained_endpoint_expires_even_when_the_rest_is_silent() {
    let mut b = fleet(2, params());
    report_all(&mut b, 0, &[0.5, 0.5], &[]);
    let drained = Observation {
        draining: true,
        ..obs(0.0)
    };
    b.observe(1, SVC, "n0", drained).expect("observes");
    let r = b.cycle(params().expire_ms + 2).remove(0);
    assert_eq!(r.expired, vec!["n0".to_string()]);
    assert_eq!(r.expiry_held, 1, "the serving one is held");
    assert_eq!(b.service(SVC).expect("svc").endpoints().len(), 1);
}

#[test]
fn a_hello_without_reports_is_not_missing() {
    // Five report; a sixth says hello and stays silent. Without the rule it would be
    // 1 of 6 missing (17 %) and skip every cycle for the whole expiry period.
    let mut b = fleet(5, params());
    let loads = [0.2, 0.4, 0.6, 0.8, 0.5];
    report_all(&mut b, 0, &loads, &[]);
    b.register(500, SVC, "quiet", "10.0.0.99:80", "")
        .expect("registers");
    report_all(&mut b, 1000, &loads, &[]);
    let r = b.cycle(1000).remove(0);
    assert!(r.skipped.is_none(), "{r:?}");
    assert_eq!(r.missing_share, 0.0);
    // Once it has reported, its silence counts: 1 of 6 (17 %). One silent endpoint
    // alone does not hold the other five, or a node that reports once and goes quiet
    // would freeze a small service until it expires.
    b.observe(1500, SVC, "quiet", obs(0.5)).expect("observes");
    report_all(&mut b, 9000, &loads, &[]);
    let r = b.cycle(9000).remove(0);
    assert!(r.skipped.is_none(), "{r:?}");
    assert!((r.missing_share - 1.0 / 6.0).abs() < 1e-9, "{r:?}");
    // A second silent one does (2 of 6, 33 %).
    report_all(&mut b, 10_000, &loads, &[4]);
    report_all(&mut b, 13_500, &loads, &[4]);
    let r = b.cycle(13_500).remove(0);
    assert!(
        matches!(r.skipped, Some(SkipReason::Missing { .. })),
        "{r:?}"
    );
}

#[test]
fn one_silent_endpoint_does_not_freeze_a_small_service() {
    // Services of two to six endpoints, where one silent endpoint is above the 15 %
    // threshold by itself: the others are still steered.
    for n in 2..=6usize {
        let mut b = fleet(n, params());
        let loads: Vec<f64> = (0..n).map(|i| 0.3 + 0.1 * i as f64).collect();
        report_all(&mut b, 0, &loads, &[]);
        b.cycle(0);
        let before = weights(&b);
        // n0 goes quiet; the others report a level like the last.
        report_all(&mut b, 5000, &loads, &[0]);
        let r = b.cycle(5000).remove(0);
        assert!(r.skipped.is_none(), "{n} endpoints, one silent: {r:?}");
        let after = weights(&b);
        assert_eq!(after[0], before[0], "the silent one keeps its weight");
        if n > 2 {
            assert_ne!(after, before, "{n} endpoints: the others were steered");
        }
    }
}

#[test]
fn one_endpoint_swinging_its_load_in_a_small_service_holds_it_rarely() {
    // Three endpoints, one of which reports 0 and 100 % in turn: too few for the level
    // to leave it out, so the level jumps every cycle. A run of jump skips is followed
    // by a rest, so it holds the service at most three cycles in twelve.
    let mut b = fleet(3, params());
    let cycles = 48u64;
    let mut skipped = 0;
    for c in 0..cycles {
        let loads = [0.5, 0.5, if c % 2 == 0 { 0.0 } else { 1.0 }];
        report_all(&mut b, c * 1000, &loads, &[]);
        let r = b.cycle(c * 1000).remove(0);
        skipped += u32::from(matches!(r.skipped, Some(SkipReason::LoadJump { .. })));
    }
    // Three in twelve, and one run more for where the window cuts; without the rest it
    // was three in four (36 of 48).
    let bound = cycles as u32 * 3 / 12 + MAX_JUMP_SKIPS;
    assert!(
        skipped <= bound,
        "{skipped} of {cycles} cycles held for a jump (at most {bound})"
    );
}

#[test]
fn restored_endpoints_that_stay_silent_do_not_freeze_the_rest() {
    // A store older than the expiry period, and a fleet that lost 3 of its 10 nodes
    // while the aggregator was down.
    let mut b = fleet(10, params());
    let speeds = [0.5, 1.0, 1.5, 1.0, 0.8, 1.2, 1.0, 0.9, 1.1, 1.0];
    run_plant(&mut b, &speeds, 0.6, 0, 15);
    let published =
        crate::Published::default().next(&b, &Default::default(), &Default::default(), 15_000);
    let snap = published.services[SVC].snapshot();
    let stored: Vec<f64> = snap.endpoints.values().map(|e| e.weight).collect();

    let start = 15_000 + 2 * params().expire_ms;
    let p = Params {
        grace_ms: 3000,
        ..params()
    };
    let mut restarted = Balancer::new(p, start);
    restarted.restore(start, &[(SVC.to_string(), snap)].into());
    // Served as stored at once, before any report.
    assert_eq!(weights(&restarted), stored);
    let dead = [2, 5, 8];
    let loads: Vec<f64> = speeds.iter().map(|s| 0.6 / s).collect();
    let mut now = start;
    let mut updates = 0;
    for _ in 0..10 {
        now += 1000;
        report_all(&mut restarted, now, &loads, &dead);
        let r = restarted.cycle(now).remove(0);
        if now > start + 3000 {
            assert!(
                r.skipped.is_none()
                    || matches!(
                        r.skipped,
                        Some(SkipReason::LoadJump { .. } | SkipReason::Settling)
                    ),
                "at {now}: {r:?}"
            );
            updates += u32::from(r.skipped.is_none());
        }
    }
    assert!(
        updates >= 5,
        "the live nodes are balanced after the grace period"
    );
    let svc = restarted.service(SVC).expect("svc");
    assert_eq!(
        svc.endpoints().len(),
        10,
        "the silent ones are held, with their weights"
    );
    for i in dead {
        let e = &svc.endpoint(&format!("n{i}")).expect("endpoint");
        assert_eq!(e.weight(), stored[i], "n{i} keeps its stored weight");
    }
}

#[test]
fn one_endpoint_swinging_its_load_cannot_hold_the_service() {
    // Nine steady endpoints and one that reports 0 and 100 % in turn, as a broken or
    // hostile agent would: the mean jumps every cycle, the level does not.
    let mut b = fleet(10, params());
    let mut skipped = 0;
    for c in 0..20u64 {
        let mut loads = [0.5; 10];
        loads[4] = if c % 2 == 0 { 0.0 } else { 5.0 };
        report_all(&mut b, c * 1000, &loads, &[]);
        let r = b.cycle(c * 1000).remove(0);
        skipped += u32::from(matches!(r.skipped, Some(SkipReason::LoadJump { .. })));
    }
    assert_eq!(skipped, 0, "no cycle held for a jump");
    // A real change of level, on every endpoint, is still held for.
    report_all(&mut b, 20_000, &[1.0; 10], &[]);
    let r = b.cycle(20_000).remove(0);
    assert!(
        matches!(r.skipped, Some(SkipReason::LoadJump { .. })),
        "{r:?}"
    );
}

#[test]
fn registrations_stop_at_the_limits_and_known_endpoints_still_come_back() {
    let mut b = Balancer::new(params(), 0);
    b.set_limits(Limits {
        max_services: 2,
        max_endpoints_per_service: 3,
        ..Limits::default()
    });
    for i in 0..3 {
        b.register(0, "a", &format!("n{i}"), &format!("10.0.0.{i}:80"), "")
            .expect("within the limit");
    }
    assert_eq!(
        b.register(0, "a", "n3", "10.0.0.3:80", ""),
        Err(BalanceError::Limit {
            what: "endpoints in this service",
            limit: 3
        })
    );
    // A known endpoint's hello is a refresh, not a new endpoint.
    assert_eq!(b.register(1, "a", "n2", "10.0.0.1:81", ""), Ok(()));
    b.register(0, "b", "n0", "10.0.0.1:80", "")
        .expect("a second service");
    assert!(matches!(
        b.register(0, "c", "n0", "10.0.0.1:80", ""),
        Err(BalanceError::Limit {
            what: "services",
            ..
        })
    ));
    assert_eq!(b.services().count(), 2);
}

/// With the default limits (a node may serve any number of services), a node that
/// moves to another service is forgotten by the one it left once its reports there
/// stop, instead of being waited for as missing: a quarter of the service missing
/// would skip every cycle, and fail-static would hold it so.
#[test]
fn a_node_that_moves_to_another_service_does_not_freeze_the_one_it_left() {
    let mut b = fleet(4, params());
    for c in 0..3u64 {
        report_all(&mut b, c * 1000, &[0.5; 4], &[]);
        b.cycle(c * 1000);
    }
    // n3 says hello to "other" while its last report to "web" is still fresh.
    b.register(3000, "other", "n3", "10.0.0.3:81", "")
        .expect("registers elsewhere");
    assert!(b.service(SVC).expect("svc").endpoints().contains_key("n3"));
    let mut moved = Vec::new();
    for c in 3..12u64 {
        let now = c * 1000;
        report_all(&mut b, now, &[0.5; 3], &[]);
        b.observe(now, "other", "n3", obs(0.5)).expect("observes");
        for r in b.cycle(now) {
            if r.service == SVC {
                assert_ne!(
                    r.skipped.map(|s| s.label()),
                    Some("missing"),
                    "at {now}: {r:?}"
                );
                moved.extend(r.moved);
            }
        }
    }
    assert_eq!(moved, ["n3"], "forgotten once, as moved");
    let web = b.service(SVC).expect("svc");
    assert!(!web.endpoints().contains_key("n3"));
    assert_eq!(web.stats.missing_share, 0.0);
    assert!(b
        .service("other")
        .expect("other")
        .endpoints()
        .contains_key("n3"));
}

/// A node that serves two services at once reports to both: a hello to one does not
/// take it from the other.
#[test]
fn a_node_serving_two_services_stays_in_both() {
    let mut b = fleet(4, params());
    b.register(0, "other", "n3", "10.0.0.3:81", "")
        .expect("registers in a second service");
    for c in 0..12u64 {
        let now = c * 1000;
        report_all(&mut b, now, &[0.5; 4], &[]);
        b.observe(now, "other", "n3", obs(0.5)).expect("observes");
        if c == 5 {
            // Its agent for "other" reconnects: a new hello.
            b.register(now, "other", "n3", "10.0.0.3:81", "")
                .expect("hello again");
        }
        for r in b.cycle(now) {
            assert!(r.moved.is_empty(), "{r:?}");
        }
    }
    assert!(b.service(SVC).expect("svc").endpoints().contains_key("n3"));
    assert!(b
        .service("other")
        .expect("other")
        .endpoints()
        .contains_key("n3"));
}

/// Two endpoints never share an address: a second node claiming the address of one
/// still reporting is refused; once the first is stale it was replaced (a host
/// renamed), and the newcomer takes the address while the old one is forgotten.
#[test]
fn two_nodes_never_share_an_address() {
    let mut b = fleet(3, params());
    report_all(&mut b, 0, &[0.5; 3], &[]);
    assert_eq!(
        b.register(1000, SVC, "renamed", "10.0.0.0:80", ""),
        Err(BalanceError::AddressInUse {
            address: "10.0.0.0:80".to_string(),
            holder: "n0".to_string(),
        })
    );
    assert!(!b
        .service(SVC)
        .expect("svc")
        .endpoints()
        .contains_key("renamed"));
    // n0 goes silent past stale_ms: the claim succeeds and n0 is forgotten.
    let later = params().stale_ms + 1000;
    report_all(&mut b, later, &[0.5; 3], &[0]);
    b.register(later, SVC, "renamed", "10.0.0.0:80", "")
        .expect("takes the address of a stale node");
    let svc = b.service(SVC).expect("svc");
    assert!(!svc.endpoints().contains_key("n0"));
    assert_eq!(
        svc.endpoint("renamed").expect("endpoint").address(),
        "10.0.0.0:80"
    );
    let moved: Vec<String> = b.cycle(later).into_iter().flat_map(|r| r.moved).collect();
    assert_eq!(moved, ["n0"]);
    // A node changing its own address is no conflict.
    b.register(later, SVC, "n1", "10.0.0.9:80", "")
        .expect("a node moves to a new address");
}

#[test]
fn a_node_serves_one_service_at_a_time_and_may_move() {
    let mut b = Balancer::new(params(), 0);
    b.set_limits(Limits {
        services_per_node: 1,
        ..Limits::default()
    });
    b.register(0, "a", "n0", "10.0.0.1:80", "")
        .expect("first service");
    b.observe(0, "a", "n0", obs(0.5)).expect("observes");
    // Still reporting to "a": a second service is refused.
    assert_eq!(
        b.register(1000, "b", "n0", "10.0.0.1:81", ""),
        Err(BalanceError::Limit {
            what: "services for this node",
            limit: 1
        })
    );
    // Once its registration in "a" has gone stale, the node moves: "a" forgets it
    // instead of waiting for it as missing.
    let later = params().stale_ms + 1000;
    b.register(later, "b", "n0", "10.0.0.1:81", "")
        .expect("the node moves");
    assert!(
        b.service("a").is_none(),
        "the service it left empty is gone"
    );
    assert!(b.service("b").expect("b").endpoints().contains_key("n0"));
    // Hopping from service to service leaves one service, not a trail of them.
    for i in 0..100 {
        b.register(later + 1, &format!("s{i}"), "n0", "10.0.0.1:81", "")
            .expect("hellos without reports are never fresh");
    }
    assert_eq!(b.services().count(), 1);
}

#[test]
fn empty_services_without_config_are_forgotten_after_the_ttl() {
    let ttl = 60_000;
    let mut b = Balancer::new(params(), 0);
    b.set_limits(Limits {
        empty_service_ttl_ms: ttl,
        ..Limits::default()
    });
    b.set_params("configured", params());
    for svc in ["configured", "adhoc", "busy"] {
        b.register(0, svc, "n0", "10.0.0.1:80", "")
            .expect("registers");
        let drained = Observation {
            draining: svc != "busy",
            ..obs(0.5)
        };
        b.observe(0, svc, "n0", drained).expect("observes");
    }
    // The drained endpoints expire; "busy" keeps reporting.
    let expire = params().expire_ms;
    let mut now = 0;
    while now <= expire + 2 * ttl {
        b.observe(now, "busy", "n0", obs(0.5)).expect("observes");
        b.cycle(now);
        let gone = b.sweep_empty(now);
        if now <= expire + ttl {
            assert!(gone.is_empty(), "at {now}: {gone:?}");
        }
        now += 10_000;
    }
    let names: Vec<&str> = b.services().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["busy", "configured"],
        "the one with a config file stays"
    );
    // It can come back, as a new service.
    b.register(now, "adhoc", "n0", "10.0.0.1:80", "")
        .expect("registers again");
}

#[test]
fn reordered_reports_are_ignored() {
    let mut b = fleet(1, params());
    let o = |seq, load| Observation {
        seq: Some(seq),
        ..obs(load)
    };
    assert!(b.observe(0, SVC, "n0", o(5, 0.5)).expect("ok").accepted);
    assert!(!b.observe(1, SVC, "n0", o(4, 0.9)).expect("ok").accepted);
    assert_eq!(
        b.service(SVC)
            .expect("svc")
            .endpoint("n0")
            .expect("endpoint")
            .load(),
        0.5
    );
    // A new session (a fresh hello) starts numbering again.
    b.register(2, SVC, "n0", "10.0.0.0:80", "")
        .expect("registers");
    assert!(b.observe(3, SVC, "n0", o(1, 0.7)).expect("ok").accepted);
}

#[test]
fn allow_list_refuses_unknown_services() {
    let mut b = Balancer::new(params(), 0);
    b.restrict_services(Some(["web".to_string()].into()));
    assert_eq!(
        b.register(0, "other", "n", "h:1", ""),
        Err(BalanceError::UnknownService("other".into()))
    );
    assert!(b.register(0, "web", "n", "h:1", "").is_ok());
}

#[test]
fn mixture_with_round_robin_gates_the_weights() {
    let p = Params {
        strategies: vec![
            Gate {
                strategy: Strategy::Pid,
                gate: 0.3,
            },
            Gate {
                strategy: Strategy::RoundRobin,
                gate: 0.7,
            },
        ],
        ..params()
    };
    let mut b = fleet(2, p);
    run_plant(&mut b, &[0.5, 1.5], 0.6, 0, 30);
    let svc = b.service(SVC).expect("svc");
    for e in svc.endpoints().iter() {
        let pid = e.strategy_weights().pid;
        assert!((e.weight() - (0.3 * pid + 0.7)).abs() < 1e-9);
    }
}

#[test]
fn material_change_only_on_real_moves() {
    let mut b = fleet(3, params());
    run_plant(&mut b, &[1.0, 1.0, 1.0], 0.6, 0, 3);
    let v = b.service(SVC).expect("svc").version;
    report_all(&mut b, 10_000, &[0.6, 0.6, 0.6], &[]);
    let r = b.cycle(10_000).remove(0);
    assert!(!r.changed);
    assert_eq!(b.service(SVC).expect("svc").version, v);
}

proptest! {
    #[test]
    fn any_report_sequence_keeps_weights_finite_positive_and_normalised(
        steps in proptest::collection::vec(
            (proptest::collection::vec(prop_oneof![Just(f64::NAN), 0.0f64..5.0, Just(1e9)], 6),
             proptest::collection::vec(any::<bool>(), 6),
             proptest::collection::vec(0u8..10, 6)),
            1..40)
    ) {
        let mut b = fleet(6, params());
        for (c, (loads, drains, silent)) in steps.iter().enumerate() {
            let now = c as u64 * 1000;
            for i in 0..6 {
                if silent[i] == 0 { continue; }
                let o = Observation { draining: drains[i] && i > 0, ..obs(loads[i]) };
                b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
            }
            let r = b.cycle(now).remove(0);
            let svc = b.service(SVC).expect("svc");
            let p = &svc.params;
            let serving: Vec<f64> = svc.endpoints().iter().filter(|e| !e.draining()).map(|e| e.weight()).collect();
            for e in svc.endpoints().iter() {
                prop_assert!(e.weight().is_finite());
                if e.draining() {
                    prop_assert_eq!(e.weight(), 0.0);
                } else {
                    prop_assert!(e.weight() >= p.min_weight * 0.999 && e.weight() <= p.max_weight * 1.001, "{}", e.weight());
                }
            }
            if r.skipped.is_none() && !serving.is_empty() {
                let mean = serving.iter().sum::<f64>() / serving.len() as f64;
                prop_assert!((mean - 1.0).abs() < 1e-6, "mean weight {}", mean);
            }
        }
    }
}

#[test]
fn a_cycle_straddling_a_load_jump_is_skipped_once() {
    let mut b = fleet(3, params());
    run_plant(&mut b, &[0.6, 1.0, 1.5], 0.6, 0, 30);
    let before = weights(&b);
    // Traffic falls 50×; half the nodes have reported the new level, half the old.
    report_all(&mut b, 30_000, &[0.9, 0.012, 0.006], &[]);
    let r = b.cycle(30_000).remove(0);
    assert!(
        matches!(r.skipped, Some(SkipReason::LoadJump { .. })),
        "{:?}",
        r.skipped
    );
    assert_eq!(weights(&b), before, "the straddling cycle moves nothing");
    // Reports still straddle: still held.
    report_all(&mut b, 31_000, &[0.2, 0.012, 0.006], &[]);
    let r = b.cycle(31_000).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::LoadJump { .. })));
    // The next cycle sees the new level whole: thin feedback holds the good weights.
    report_all(&mut b, 32_000, &[0.02, 0.012, 0.006], &[]);
    let r = b.cycle(32_000).remove(0);
    assert!(
        matches!(r.skipped, Some(SkipReason::ThinFeedback { .. })),
        "{:?}",
        r.skipped
    );
    assert_eq!(weights(&b), before);
}

#[test]
fn a_real_new_level_is_steered_by_after_one_skipped_cycle() {
    let mut b = fleet(3, params());
    report_all(&mut b, 0, &[0.3, 0.3, 0.3], &[]);
    assert!(b.cycle(0).remove(0).skipped.is_none());
    // +50 % and uneven: one cycle held, then the controllers act on the new level.
    report_all(&mut b, 1000, &[0.9, 0.4, 0.2], &[]);
    let r = b.cycle(1000).remove(0);
    assert!(matches!(r.skipped, Some(SkipReason::LoadJump { .. })));
    report_all(&mut b, 2000, &[0.9, 0.4, 0.2], &[]);
    let r = b.cycle(2000).remove(0);
    assert!(r.skipped.is_none(), "{:?}", r.skipped);
    let w = weights(&b);
    assert!(w[0] < w[1] && w[1] < w[2], "{w:?}");

    // A load that keeps climbing is a trend: steered by after at most three skips.
    let mut b = fleet(3, params());
    let mut level = 0.05;
    let mut skipped = 0;
    for c in 0..6u64 {
        report_all(&mut b, c * 1000, &[level * 1.5, level, level * 0.5], &[]);
        let r = b.cycle(c * 1000).remove(0);
        if matches!(r.skipped, Some(SkipReason::LoadJump { .. })) {
            skipped += 1;
        } else if c > 0 {
            break;
        }
        level *= 1.6;
    }
    assert_eq!(skipped, MAX_JUMP_SKIPS);

    // The rule can be turned off.
    let mut b = fleet(
        3,
        Params {
            jump_threshold: 0.0,
            ..params()
        },
    );
    report_all(&mut b, 0, &[0.3, 0.3, 0.3], &[]);
    b.cycle(0);
    report_all(&mut b, 1000, &[0.9, 0.4, 0.2], &[]);
    assert!(b.cycle(1000).remove(0).skipped.is_none());
}

/// From equal weights, one feed-forward step puts a fleet of three speeds within a few
/// per cent of balance; the two cycles after it hold while the load balancers apply it, and
/// the controllers trim from there.
#[test]
fn feed_forward_steps_to_the_capacity_estimate() {
    let speeds = [0.6, 0.6, 1.0, 1.0, 1.0, 1.5, 1.5, 0.6, 1.0, 1.5];
    let mut b = fleet(
        speeds.len(),
        Params {
            grace_ms: 0,
            ..Params::default()
        },
    );
    let first = run_plant(&mut b, &speeds, 0.6, 0, 1);
    assert!(first > 1.3, "equal weights start imbalanced: {first}");
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.stats.feed_forward_steps, 1);
    // Weights in proportion to speed after one step: the plant is linear.
    let w = weights(&b);
    for (wi, si) in w.iter().zip(&speeds) {
        let mean_speed = speeds.iter().sum::<f64>() / speeds.len() as f64;
        assert!((wi - si / mean_speed).abs() < 1e-9, "{w:?}");
    }
    let r = {
        report_all(&mut b, 1000, &[0.6; 10], &[]);
        b.cycle(1000).remove(0)
    };
    assert_eq!(r.skipped, Some(SkipReason::Settling));
    let r = {
        report_all(&mut b, 2000, &[0.6; 10], &[]);
        b.cycle(2000).remove(0)
    };
    assert_eq!(r.skipped, Some(SkipReason::Settling));
    let settled = run_plant(&mut b, &speeds, 0.6, 3000, 2);
    assert!(
        settled < 1.001,
        "max/avg two cycles after the step: {settled}"
    );
    // The controllers trim from here; no second step within the hold-off.
    run_plant(&mut b, &speeds, 0.6, 4000, 5);
    assert_eq!(b.service(SVC).expect("svc").stats.feed_forward_steps, 1);
}

/// No step while a newcomer ramps up, while a report is missing or held, near balance,
/// or with too little traffic to estimate from.
#[test]
fn feed_forward_waits_for_trustworthy_loads() {
    let ff = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let steps = |b: &Balancer| b.service(SVC).expect("svc").stats.feed_forward_steps;
    // Too little traffic: average 0.05.
    let mut b = fleet(4, ff.clone());
    report_all(&mut b, 0, &[0.02, 0.08, 0.05, 0.05], &[]);
    b.cycle(0);
    assert_eq!(steps(&b), 0);
    // Near balance: 10 % apart.
    let mut b = fleet(4, ff.clone());
    report_all(&mut b, 0, &[0.55, 0.6, 0.65, 0.6], &[]);
    b.cycle(0);
    assert_eq!(steps(&b), 0);
    // One report lost: its weight is held, so nothing steps.
    let mut b = fleet(4, ff.clone());
    report_all(&mut b, 0, &[0.5, 0.5, 0.5, 0.5], &[]);
    b.cycle(0);
    report_all(&mut b, 1000, &[0.9, 0.3, 0.5, 0.5], &[3]);
    b.cycle(1000);
    assert_eq!(steps(&b), 0);
    // A newcomer ramping up from the cold-start weight.
    let mut b = fleet(4, ff);
    run_plant(&mut b, &[1.0; 4], 0.6, 0, 3);
    b.register(3000, SVC, "n4", "10.0.0.4:80", "")
        .expect("registers");
    report_all(&mut b, 4000, &[0.9, 0.6, 0.3, 0.6, 0.06], &[]);
    b.cycle(4000);
    assert_eq!(steps(&b), 0);
}

fn inflight_obs(cpu: f64, inflight: u32) -> Observation {
    Observation {
        cpu,
        inflight,
        ..Observation::default()
    }
}

/// A node stalled on I/O (idle CPU, requests held ten times longer than elsewhere)
/// loses weight under the default capacity-free in-flight term and keeps losing it
/// while the stall lasts; the healthy nodes stay balanced by CPU.
#[test]
fn a_stalled_node_loses_weight_without_a_capacity() {
    let mut b = fleet(6, params());
    for c in 0..15u64 {
        let now = c * 1000;
        let w = weights(&b);
        for (i, wi) in w.iter().enumerate() {
            // Healthy: 2 requests per unit of weight at 0.6 CPU; the stalled n5: 20
            // per unit of weight (ten times the latency) at 2 % CPU.
            let (cpu, per_weight) = if i == 5 { (0.02, 20.0) } else { (0.6, 2.0) };
            let n = (per_weight * wi).round() as u32;
            b.observe(now, SVC, &format!("n{i}"), inflight_obs(cpu, n))
                .expect("observes");
        }
        b.cycle(now);
    }
    let svc = b.service(SVC).expect("svc");
    let stalled = &svc.endpoint("n5").expect("endpoint");
    assert!(
        stalled.weight() < 0.1,
        "stalled weight {}",
        stalled.weight()
    );
    assert!(
        stalled.inflight().estimate.trusted,
        "its count follows its weight"
    );
    assert_eq!(svc.stats.inflight_distrusts, 0);
    assert_eq!(
        stalled.inflight().estimate.derivation,
        inflight::Derivation::FleetRelative
    );
    for i in 0..5 {
        let e = &svc.endpoint(&format!("n{i}")).expect("endpoint");
        assert!(!e.inflight().estimate.binding, "n{i} is steered by CPU");
    }
}

/// Thirteen idle connections counted as in flight on a node with no CPU: the term drives
/// its weight to the floor, the count does not follow, and after a few cycles it is
/// distrusted (counted in the stats) and the node is balanced by its CPU again.
#[test]
fn a_count_that_ignores_the_weight_is_distrusted_and_the_weight_recovers() {
    let mut b = fleet(6, params());
    let mut floor_seen = false;
    for c in 0..40u64 {
        let now = c * 1000;
        let w = weights(&b);
        for (i, wi) in w.iter().enumerate() {
            let o = if i == 5 {
                // CPU follows the traffic it gets; the count is stuck at 13.
                inflight_obs(0.6 * wi, 13)
            } else {
                inflight_obs(0.6 * wi, 1)
            };
            b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
        }
        b.cycle(now);
        let svc = b.service(SVC).expect("svc");
        floor_seen |= svc.endpoint("n5").expect("endpoint").weight() < 0.05;
    }
    let svc = b.service(SVC).expect("svc");
    assert!(floor_seen, "the stuck count first drove the weight down");
    assert_eq!(svc.stats.inflight_distrusts, 1);
    assert_eq!(svc.stats.inflight_distrusted, 1);
    let e = &svc.endpoint("n5").expect("endpoint");
    assert!(!e.inflight().estimate.trusted);
    assert!(e.weight() > 0.9, "balanced by CPU again: {}", e.weight());
}

/// One cycle at `now` in which every node reports the CPU `cpu(node, its weight)` and
/// two requests in flight per unit of weight (a count that follows the weight).
fn cycle_with_cpu(b: &mut Balancer, now: Millis, cpu: impl Fn(usize, f64) -> f64) {
    for (i, wi) in weights(b).iter().enumerate() {
        let o = inflight_obs(cpu(i, *wi), (2.0 * wi).round() as u32);
        b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
    }
    b.cycle(now);
}

/// A neighbour takes half of n5's capacity from cycle 5 to 65, and the agent's CPU
/// counts it: n5 reads `0.5 + 0.5 × weight` where the others read `0.5 × weight`. The
/// weight the CPU does not follow is found, n5 is steered by its CPU above that floor
/// to about its fair share of what the neighbour leaves (half the others' weight), and
/// once the neighbour is gone the floor goes too and n5 is balanced as the others.
#[test]
fn a_neighbour_s_part_of_the_cpu_is_set_aside_and_the_node_keeps_its_fair_share() {
    let mut b = fleet(6, params());
    let run = |b: &mut Balancer, cycles: std::ops::Range<u64>, neighbour: bool| {
        for c in cycles {
            cycle_with_cpu(b, c * 1000, |i, w| {
                if i == 5 && neighbour {
                    (0.5 + 0.5 * w).min(1.0)
                } else {
                    0.5 * w
                }
            });
        }
    };
    run(&mut b, 0..5, false);
    run(&mut b, 5..65, true);
    let svc = b.service(SVC).expect("svc");
    let n5 = svc.endpoint("n5").expect("endpoint");
    let other = svc.endpoint("n0").expect("endpoint").weight();
    // Fair: n5's CPU above the floor, over the half the neighbour leaves, equal to the
    // others' CPU: 0.5 × w5 / 0.5 = 0.5 × w_other.
    let fair = 0.5 * other;
    assert!(
        (0.75..=1.25).contains(&(n5.weight() / fair)),
        "n5 weight {} against a fair {fair}",
        n5.weight()
    );
    let floor = n5.cpu_floor().floor().expect("a floor");
    assert!((floor - 0.5).abs() < 0.05, "floor {floor}");
    assert_eq!(svc.stats.cpu_floors, 1);
    assert_eq!(svc.stats.cpu_floors_found, 1);
    // A cycle that finds no new report still counts the floor it holds.
    b.cycle(65_000);
    assert_eq!(b.service(SVC).expect("svc").stats.cpu_floors, 1);
    run(&mut b, 66..106, false);
    let svc = b.service(SVC).expect("svc");
    let n5 = svc.endpoint("n5").expect("endpoint");
    assert_eq!(n5.cpu_floor().floor(), None);
    assert_eq!(svc.stats.cpu_floors, 0);
    assert!(n5.weight() > 0.9, "balanced again: {}", n5.weight());
}

/// A node whose reading is 0.9 whatever its weight (a source reading another cgroup):
/// its weight falls, a floor is found, its load reads 0 and its weight grows back, but
/// the reading never rises above the floor, so the floor is disproved and the node is
/// steered by its reading again, as it was before the rule: down to the floor.
#[test]
fn a_reading_that_follows_nothing_loses_its_floor_for_good() {
    let mut b = fleet(6, params());
    let mut found_at = None;
    for c in 0..60u64 {
        cycle_with_cpu(&mut b, c * 1000, |i, w| if i == 5 { 0.9 } else { 0.5 * w });
        let svc = b.service(SVC).expect("svc");
        if found_at.is_none() && svc.stats.cpu_floors == 1 {
            found_at = Some(c);
        }
    }
    let svc = b.service(SVC).expect("svc");
    assert!(found_at.is_some(), "a floor was found first");
    assert_eq!(svc.stats.cpu_floors_found, 1, "and never again");
    assert_eq!(svc.stats.cpu_floors, 0);
    let w5 = svc.endpoint("n5").expect("endpoint").weight();
    assert!(w5 < 0.05, "steered by its reading: {w5}");
}

/// A node whose CPU follows its weight is never given a floor, however far the
/// controller moves it: twice as slow as the others, it sits at half their weight.
#[test]
fn a_cpu_that_follows_the_weight_keeps_no_floor() {
    let mut b = fleet(6, params());
    for c in 0..60u64 {
        cycle_with_cpu(
            &mut b,
            c * 1000,
            |i, w| {
                if i == 5 {
                    w.min(1.0)
                } else {
                    0.5 * w
                }
            },
        );
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.stats.cpu_floors_found, 0);
    let w5 = svc.endpoint("n5").expect("endpoint").weight();
    assert!((w5 - 0.545).abs() < 0.1, "{w5}");
}

/// A restore over endpoints the service already has starts them afresh from the
/// snapshot in place, adds the others in node order, and keeps every lookup right.
#[test]
fn a_restore_over_known_endpoints_replaces_them_in_place() {
    let mut b = fleet(3, params());
    report_all(&mut b, 1_000, &[0.5, 0.5, 0.5], &[]);
    let snapshot = service::ServiceSnapshot {
        version: 7,
        cycle: 3,
        endpoints: [("n1", 1.4), ("a", 0.6)]
            .into_iter()
            .map(|(node, weight)| {
                (
                    node.to_string(),
                    EndpointSnapshot {
                        address: format!("10.9.0.{}:80", node.len()),
                        zone: "z".to_string(),
                        draining: false,
                        weight,
                        strategy_weights: BTreeMap::new(),
                    },
                )
            })
            .collect(),
        operator: Default::default(),
    };
    let mut svc = b.service(SVC).expect("svc").clone();
    svc.restore(2_000, &snapshot);
    let nodes: Vec<&str> = svc.endpoints().keys().collect();
    assert_eq!(nodes, ["a", "n0", "n1", "n2"]);
    let n1 = svc.endpoint("n1").expect("n1");
    assert_eq!(n1.weight(), 1.4);
    assert_eq!(n1.address(), "10.9.0.2:80");
    assert_eq!(n1.zone(), "z");
    assert_eq!(n1.last_report(), None, "restored afresh");
    assert_eq!(svc.endpoint("n0").expect("n0").last_report(), Some(1_000));
    assert_eq!(svc.endpoint("a").expect("a").weight(), 0.6);
}

/// A step taken while the smallest nodes are saturated is judged only once their
/// queues have drained: while the hottest node's in-flight term binds, its load reads
/// the queue built before the step, not what the step did, and the judgment waits.
#[test]
fn a_feed_forward_step_is_not_undone_while_a_saturated_node_drains() {
    let speeds = [0.5, 0.5, 1.0, 1.0, 1.5, 1.5];
    let mut b = fleet(
        speeds.len(),
        Params {
            grace_ms: 0,
            ..Params::default()
        },
    );
    // Equal weights at 0.75 of the mean speed: the two slow nodes saturate (CPU 1,
    // twenty requests queued) while the others answer at once.
    let offered = 0.75;
    let cycle = |b: &mut Balancer, now: Millis, queued: bool| {
        let w = weights(b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        for (i, (s, wi)) in speeds.iter().zip(&w).enumerate() {
            let cpu = (offered * (wi / mean_w) / s).min(1.0);
            let inflight = if queued && *s < 1.0 { 20 } else { 1 };
            b.observe(now, SVC, &format!("n{i}"), inflight_obs(cpu, inflight))
                .expect("observes");
        }
        b.cycle(now).remove(0)
    };
    cycle(&mut b, 0, true);
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.stats.feed_forward_steps, 1, "the step is taken");
    let stepped = weights(&b);
    // The queues drain over the two settling cycles and two more.
    for c in 1..=4u64 {
        cycle(&mut b, c * 1000, true);
    }
    for c in 5..=8u64 {
        cycle(&mut b, c * 1000, false);
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(
        svc.stats.feed_forward_undone,
        0,
        "a right step was undone while the queues drained: {:?} -> {:?}",
        stepped,
        weights(&b)
    );
    let w = weights(&b);
    assert!(
        w[0] < w[2] && w[2] < w[4],
        "the weights follow the speeds: {w:?}"
    );
}

/// A count drawn as a real count is: the requests in flight at the moment of a report,
/// Poisson around the expected number (rate times latency). Deterministic, seeded.
struct PointCounts(u64);

impl PointCounts {
    fn uniform(&mut self) -> f64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn draw(&mut self, mean: f64) -> u32 {
        let limit = (-mean).exp();
        let mut product = self.uniform();
        let mut n = 0;
        while product > limit && n < 1000 {
            n += 1;
            product *= self.uniform();
        }
        n
    }
}

/// A stalled node at a small weight has a small count, mostly 0 at the moment of a
/// report: a few requests in flight at once however long each is held. Its weight must
/// stay down for as long as the stall lasts, not grow back whenever a few reports in a
/// row happen to find nothing in flight; and once the stall ends it must grow back.
/// Twenty seeded runs, judged by their medians: the counts are drawn, so any one run
/// may be unlucky. Before the hold was weighed by evidence (three steps after the last
/// stalled verdict, with the others' shrink handed to the held node) the medians were
/// a mean share of 1.0 % and a largest of 3.1 %, regrown in 13 cycles (at most 21);
/// with the probe at half a request 0.68 % and 1.4 %, regrown in 20 (at most 42); with
/// it at most 1 % of the requests, 0.68 % and 1.15 %, regrown in 21 (at most 27); at
/// most 0.6 %, 0.57 % and 0.69 %, regrown in 23 (at most 38); brought down to that
/// share in the first steps of a hold too, 0.54 % and 0.69 %, regrown in 26 (at most
/// 38): a node that has recovered at a small weight waits for the evidence a stalled
/// one would have given, and the smaller the weight the longer that takes.
#[test]
fn a_stalled_node_stays_down_though_its_small_count_often_reads_zero() {
    let n = 4;
    let (mut means, mut largest, mut regrown) = (Vec::new(), Vec::new(), Vec::new());
    for seed in 1..=20u64 {
        let mut b = fleet(n, params());
        let mut counts = PointCounts(0x9e37_79b9_7f4a_7c15 ^ seed);
        // Healthy: one request in flight per unit of weight, CPU following the weight.
        // Stalled from cycle 10 to 70: ten per unit of weight (ten times the latency)
        // at an idle CPU.
        let mut shares = Vec::new();
        let mut recovered_after = None;
        for c in 0..120u64 {
            let now = c * 1000;
            let w = weights(&b);
            let total: f64 = w.iter().sum();
            let stalled = (10..70).contains(&c);
            for (i, wi) in w.iter().enumerate() {
                let (cpu, per_weight) = if i == 0 && stalled {
                    (0.002, 10.0)
                } else {
                    (0.3 * wi, 1.0)
                };
                let o = inflight_obs(cpu, counts.draw(per_weight * wi));
                b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
            }
            b.cycle(now);
            // The share of the weight from 20 cycles into the stall to its end.
            if (30..70).contains(&c) {
                shares.push(w[0] / total);
            }
            if c >= 70 && recovered_after.is_none() && weights(&b)[0] >= 0.8 {
                recovered_after = Some(c - 70);
            }
        }
        means.push(shares.iter().sum::<f64>() / shares.len() as f64);
        largest.push(shares.iter().copied().fold(0.0, f64::max));
        regrown.push(recovered_after.unwrap_or(u64::MAX));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    regrown.sort_unstable();
    let (mean, large) = (median(&mut means), median(&mut largest));
    let summary =
        format!("medians: mean share {mean:.4}, largest {large:.4}; cycles to regrow {regrown:?}");
    eprintln!("{summary}");
    assert!(
        mean <= 0.008 && large <= 0.02,
        "the stalled node's share of the weight: {summary}"
    );
    assert!(
        regrown[regrown.len() / 2] <= 27 && regrown[regrown.len() - 1] <= 60,
        "the weight grows back to 0.8 too late after the stall: {summary}"
    );
}

/// A stall at a low request rate, as in the lab at 47 requests a second: the healthy
/// nodes hold a third of a request per unit of weight (under the typical count's floor
/// of half a request), the stalled one five times as many, a request and a half, while
/// its CPU per unit of weight falls to a tenth of theirs. Its count per unit of weight
/// stands out by two or three times the floor, and judged above three times the term
/// read below the average: the stalled node gained weight for as long as the stall
/// lasted. Its idle hands (its count per unit of CPU fifty times the typical one) have
/// it judged against the typical count itself; two such reports in a row with a request
/// in flight have it shed at the shrink bound and held, at a probe of at most 0.6 % of
/// the requests. Twenty seeded runs, judged by the medians of the stalled node's mean
/// share of the weight from 10 to 19 cycles into the stall and from 20 on: measured
/// 0.65 % and 0.57 %; 0.85 % and 0.61 % while a confirmed stall was left above the probe
/// in the first steps of its hold; 1.2 % and 1.3 % with the probe at 1 %, 3.5 % and
/// 2.4 % when an idle-handed node shed in proportional steps and was held at half a
/// request, and 62 % from 20 cycles on without the idle-hands rule (the original share
/// was 17 %). The bound is 1 %, below the 2 % the stall target allows: a service's p99
/// lets 1 % of its requests be slow, and a stalled node that keeps 1 % sets it.
#[test]
fn a_stalled_node_sheds_its_weight_at_a_low_request_rate() {
    let n = 6;
    // Each run's mean share of the weight over cycles 10 to 19 of the stall, and over
    // cycles 20 to 49.
    let (mut early, mut late) = (Vec::new(), Vec::new());
    for seed in 1..=20u64 {
        let mut b = fleet(n, params());
        let mut counts = PointCounts(0x5851_f42d_4c95_7f2d ^ seed);
        let (mut e, mut l) = (Vec::new(), Vec::new());
        for c in 0..60u64 {
            let now = c * 1000;
            let w = weights(&b);
            let total: f64 = w.iter().sum();
            let stalled = c >= 10;
            for (i, wi) in w.iter().enumerate() {
                let (cpu, per_weight) = if i == 0 && stalled {
                    (0.025 * wi, 1.5)
                } else {
                    (0.25 * wi, 0.3)
                };
                let o = inflight_obs(cpu, counts.draw(per_weight * wi));
                b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
            }
            b.cycle(now);
            match c {
                20..=29 => e.push(w[0] / total),
                30.. => l.push(w[0] / total),
                _ => {}
            }
        }
        early.push(e.iter().sum::<f64>() / e.len() as f64);
        late.push(l.iter().sum::<f64>() / l.len() as f64);
    }
    for v in [&mut early, &mut late] {
        v.sort_by(f64::total_cmp);
    }
    let (e, l) = (early[early.len() / 2], late[late.len() / 2]);
    eprintln!(
        "the stalled node's mean share of the weight, median of 20 runs: {e:.4} from 10 \
         cycles into the stall, {l:.4} from 20"
    );
    assert!(
        e <= 0.01 && l <= 0.01,
        "the stalled node kept {e:.4} of the weight from 10 cycles into the stall ({early:.3?}) \
         and {l:.4} from 20 ({late:.3?})"
    );
}

/// No feed-forward step while a stalled node is held: reports that find none of its few
/// requests in flight leave its term unbound, and its idle CPU read as spare capacity
/// would double its weight and hand it its calls back.
#[test]
fn feed_forward_does_not_step_a_held_stalled_node_up() {
    let ff = Params {
        grace_ms: 0,
        ..Params::default()
    };
    let mut b = fleet(4, ff.clone());
    let steps = |b: &Balancer| b.service(SVC).expect("svc").stats.feed_forward_steps;
    let report = |b: &mut Balancer, c: u64, stalled_count: Option<u32>| {
        let now = c * 1000;
        let w = weights(b);
        for (i, wi) in w.iter().enumerate() {
            let o = match stalled_count {
                Some(n) if i == 0 => inflight_obs(0.002, n),
                _ => inflight_obs(0.4 * wi, 1),
            };
            b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
        }
        b.cycle(now);
    };
    for c in 0..3 {
        report(&mut b, c, None);
    }
    // The stall: ten requests per unit of weight, then none in flight at one report.
    for c in 3..20 {
        let n = (10.0 * weights(&b)[0]).round().max(1.0) as u32;
        report(&mut b, c, Some(n));
    }
    let before = (steps(&b), weights(&b)[0]);
    assert!(before.1 < 0.05, "the stall cut the weight: {}", before.1);
    // Two reports find none: the first cycle after the last cut, and one with the
    // weights steady, when a step could be due.
    report(&mut b, 20, Some(0));
    report(&mut b, 21, Some(0));
    let after = (steps(&b), weights(&b)[0]);
    assert_eq!(
        after.0, before.0,
        "a step was taken: {before:?} -> {after:?}"
    );
    assert!(after.1 <= before.1 * 1.01, "{before:?} -> {after:?}");
    // The same loads from a node that was never stalled (idle, nothing in flight) do
    // bring a step: the hold withheld it, not the loads.
    let mut b = fleet(4, ff);
    for c in 0..3 {
        report(&mut b, c, None);
    }
    for c in 3..8 {
        report(&mut b, c, Some(0));
    }
    assert!(
        steps(&b) >= 1,
        "no step for an idle node: {:?}",
        weights(&b)
    );
}

/// A node that stalls just after a feed-forward step sheds its weight at once: the
/// settling cycles after the step, and a load jump the stall itself makes, wait for
/// queues to drain and loads to settle, and a stalled node's neither drains nor
/// settles while it is kept.
#[test]
fn a_stall_just_after_a_feed_forward_step_is_shed_at_once() {
    let mut b = fleet(
        6,
        Params {
            grace_ms: 0,
            ..Params::default()
        },
    );
    let speeds = [0.6, 1.0, 1.0, 1.0, 1.5, 1.0];
    let mut shed = Vec::new();
    for c in 0..6u64 {
        let now = c * 1000;
        let w = weights(&b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        for (i, wi) in w.iter().enumerate() {
            // The stall from the cycle after the step: n5's requests are held ten times
            // longer and its CPU idles.
            let o = if i == 5 && c >= 1 {
                inflight_obs(0.02, (20.0 * wi).round() as u32)
            } else {
                inflight_obs(0.6 * (wi / mean_w) / speeds[i], (2.0 * wi).round() as u32)
            };
            b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
        }
        let r = b.cycle(now).remove(0);
        if c >= 1 {
            shed.push((r.skipped, weights(&b)[5]));
        }
    }
    let svc = b.service(SVC).expect("svc");
    assert_eq!(svc.stats.feed_forward_steps, 1, "the step was taken");
    // Each cycle of the stall halves n5's weight: no cycle waits.
    for (skipped, w) in &shed {
        assert_eq!(*skipped, None, "{shed:?}");
        assert!(*w < 0.6, "{shed:?}");
    }
    assert!(shed[shed.len() - 1].1 < 0.05, "{shed:?}");
    // The stall, not the step, moved the loads: the step stays.
    assert_eq!(svc.stats.feed_forward_undone, 0);
}

/// A stalled node whose CPU still goes on what arrives: a gRPC server decodes each call,
/// starts its handler and switches between the threads that wait, so at its old share
/// of the calls its CPU stays at two thirds of the others' while it holds ten times
/// their requests. That is above a quarter of the average, but its hands are idle for
/// what it holds (its count per unit of CPU fifteen times the typical one once the
/// smoothed count has caught up): it sheds at the shrink bound from the second report
/// of the stall. Judged by its CPU alone it shed by a quarter a cycle until its CPU fell
/// below the quarter (0.84, 0.61, 0.45, then halving).
#[test]
fn a_stalled_node_whose_cpu_goes_on_its_arrivals_sheds_at_the_bound() {
    let mut b = fleet(
        6,
        Params {
            grace_ms: 0,
            ..Params::default()
        },
    );
    let stall_from = 12u64;
    let mut stalled = Vec::new();
    for c in 0..stall_from + 6 {
        let now = c * 1000;
        let w = weights(&b);
        let mean_w = w.iter().sum::<f64>() / w.len() as f64;
        for (i, wi) in w.iter().enumerate() {
            let share = wi / mean_w;
            let o = if i == 5 && c >= stall_from {
                inflight_obs(0.6 * share * 2.0 / 3.0, (20.0 * wi).round() as u32)
            } else {
                inflight_obs(0.6 * share, (2.0 * wi).round() as u32)
            };
            b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
        }
        b.cycle(now);
        if c >= stall_from {
            stalled.push(weights(&b)[5]);
        }
    }
    // The count is smoothed: the first stalled report lifts it from 2 to 9.2, 4.6 times
    // the typical count per unit of weight but 6.9 times per unit of CPU, and its CPU
    // is above a quarter of the average: a proportional step. From the second on, each
    // cycle halves the weight (normalisation hands the others' part back: a little
    // above half).
    for pair in stalled.windows(2) {
        assert!(pair[1] <= pair[0] * 0.56, "{stalled:?}");
    }
    assert!(stalled[stalled.len() - 1] < 0.05, "{stalled:?}");
}

/// A node confirmed stalled is trusted with the probe's share at most, from the first
/// steps of its hold: a few reports that find nothing in flight at the weight its last
/// verdict cut it to do not leave it there. Three reports of a stall (ten times the
/// requests per unit of weight, idle CPU) cut n0 by half each; then three reports find
/// nothing in flight, which a node still stalled at that weight (1.3 requests a report)
/// gives one time in fifty, and far too few for the hold to let it go. Left where the
/// last verdict cut it, it kept 3.3 % of the weight for those three steps; now it goes
/// on falling, within the shrink bound, towards the probe's 0.6 % (3.5 %, 1.8 %, 1.0 %,
/// 0.7 %).
#[test]
fn a_confirmed_stall_is_brought_to_the_probe_while_its_count_reads_nothing() {
    let n = 4;
    let mut b = fleet(n, params());
    let mut after = Vec::new();
    for c in 0..16u64 {
        let now = c * 1000;
        let w = weights(&b);
        for (i, wi) in w.iter().enumerate() {
            let o = match (i, c) {
                (0, 10..=12) => inflight_obs(0.002, (10.0 * wi).round() as u32),
                (0, 13..) => inflight_obs(0.002, 0),
                _ => inflight_obs(0.3 * wi, wi.round() as u32),
            };
            b.observe(now, SVC, &format!("n{i}"), o).expect("observes");
        }
        b.cycle(now);
        if c >= 12 {
            let w = weights(&b);
            after.push(w[0] / w.iter().sum::<f64>());
        }
    }
    // Each held step moves the share down by up to the shrink bound (the weight lags
    // the share by a cycle, and normalisation adds a little while the others' weights
    // move), until it is the probe's.
    let probe = inflight::PROBE_SHARE * 1.25;
    for pair in after.windows(2) {
        assert!(pair[1] <= (pair[0] * 0.65).max(probe), "{after:?}");
    }
    assert!(after[after.len() - 1] <= 0.008, "{after:?}");
}
