use super::*;

#[test]
#[ignore]
fn print_numbers() {
    let ids: Option<Vec<String>> = std::env::var("SIM_SCENARIOS")
        .ok()
        .map(|s| s.split(',').map(String::from).collect());
    let quick = std::env::var("SIM_QUICK").is_ok();
    let t = std::time::Instant::now();
    let s = run(&SimOptions {
        seed: 1,
        out_dir: PathBuf::new(),
        quick,
        scenarios: ids.or(Some(vec!["steady".into()])),
    })
    .unwrap();
    for sc in &s.scenarios {
        println!("== {}", sc.scenario.id);
        for r in &sc.results {
            let m = &r.metrics;
            println!("{:22} max/avg {:.3} p95 {:.3} p5 {:.3} 5s {:.3} settle {:?} over {:?} noise {:.3} churn {:?} overl {:.4} err {:.4} p99 {:.0} skip {:?} watched {:?} init_rms {:.3} cyc_noise {:.3}",
                r.strategy.name(), m.max_over_avg, m.p95_over_avg, m.p5_over_avg, m.max_over_avg_5s, m.settle_cycles, m.overshoot.map(|x| (x*1000.0).round()/1000.0), m.transient_noise, m.churn.map(|x| (x*1000.0).round()/1000.0), m.overloaded_share, m.error_share, m.p99_latency_ms, m.skipped, m.watched, m.transient.initial_rms, m.transient.cycle_noise);
        }
    }
    println!("elapsed {:?}", t.elapsed());
}
