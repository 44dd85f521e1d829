//! The aggregator's config file (`aggregator.toml`): `Config::parse` on arbitrary
//! text, as `ballast-aggregator check` and start-up read it.
//!
//! Invariants: nothing panics; an accepted config validates; it round-trips through
//! TOML (what the API shows and `check` prints parses back to the same config); its
//! strategy mixture of any weights within the weight bounds is finite and within them.

#![no_main]

use ballast_aggregator::config::Config;
use ballast_balance::mixture::mix;
use ballast_balance::Strategy;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::parse(text, "fuzz.toml") else {
        return;
    };
    assert_eq!(cfg.validate(), Ok(()));
    let p = &cfg.balance;
    ballast_fuzz::assert_params_sane(p, "aggregator.toml [balance]");
    for (pid, rr) in [
        (p.min_weight, p.max_weight),
        (p.max_weight, p.min_weight),
        (1.0, 1.0),
    ] {
        let w = mix(&p.strategies, |s| match s {
            Strategy::Pid => pid,
            Strategy::RoundRobin => rr,
        });
        assert!(
            w.is_finite() && w >= p.min_weight * (1.0 - 1e-12) && w <= p.max_weight * (1.0 + 1e-12),
            "mixture {w} out of [{}, {}]",
            p.min_weight,
            p.max_weight
        );
    }
    let again = toml::to_string(&cfg).expect("an accepted config serialises");
    let back = Config::parse(&again, "again.toml").expect("a serialised config parses");
    assert_eq!(back, cfg, "round trip through:\n{again}");
});
