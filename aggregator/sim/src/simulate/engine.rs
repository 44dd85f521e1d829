//! One scenario under one strategy: the loop that advances the fleet, delivers (or
//! loses) the agents' reports, runs the strategy's cycles, and records each cycle.

use super::fleet::{Fault, Fleet, Neighbour, CYCLE_MS, TICKS_PER_CYCLE, TICK_MS};
use super::random::{stream, Stream};
use super::scenario::{EventKind, Loss, Scenario};
use super::strategy::{AgentConfig, Strategy, StrategyKind};
use super::SimError;
use ballast_balance::inflight::InflightEstimate;
use ballast_balance::{Params, PidGains};
use rand::rngs::SmallRng;
use rand::Rng;

/// Everything recorded about one run, cycle by cycle.
#[derive(Debug, Clone)]
pub struct Recording {
    /// The strategy.
    pub kind: StrategyKind,
    /// True load per endpoint per cycle, `max(cpu, mean requests in flight /
    /// SCORE_CAPACITY)`; endpoints that have not joined yet are absent (shorter rows).
    pub load: Vec<Vec<f64>>,
    /// CPU utilization per endpoint per cycle.
    pub cpu: Vec<Vec<f64>>,
    /// Requests that arrived per endpoint per cycle.
    pub arrivals: Vec<Vec<u32>>,
    /// The weights in force after each cycle, for strategies that have weights.
    pub weights: Vec<Option<Vec<f64>>>,
    /// Why Ballast skipped each cycle's update, if it did.
    pub skipped: Vec<Option<&'static str>>,
    /// Requests completed per cycle.
    pub completions: Vec<u64>,
    /// Requests failed per cycle.
    pub errors: Vec<u64>,
    /// The endpoint the scenario watches (the newcomer, the degraded or failing one).
    pub watched: Option<usize>,
    /// Its in-flight count at the end of each cycle.
    pub watched_inflight: Vec<u32>,
    /// 99th percentile latency of requests completed from the disturbance on, in ms.
    pub p99_latency_ms: f64,
    /// Each endpoint's cores × speed, by index, at the end of the run: the cores a
    /// greedy neighbour leaves the service.
    pub capacities: Vec<f64>,
    /// Per cycle, max/avg of the load the weights in force imply (see
    /// `Fleet::implied_max_over_avg`): the imbalance the weights cause, without
    /// request noise.
    pub implied: Vec<f64>,
    /// Per cycle, how many endpoints' loads Ballast set by their in-flight term.
    pub inflight_binding: Vec<u32>,
    /// Per cycle, how many endpoints' in-flight counts Ballast distrusted.
    pub inflight_distrusted: Vec<u32>,
    /// Ballast's feed-forward steps over the run.
    pub feed_forward_steps: u64,
    /// The watched endpoint's in-flight verdict after each cycle, from Ballast.
    pub watched_estimate: Vec<Option<InflightEstimate>>,
}

/// Gilbert–Elliott loss: each endpoint's report path is good or bad, and bad paths
/// lose every report.
struct LossModel {
    bad: Vec<bool>,
    to_bad: f64,
    to_good: f64,
}

impl LossModel {
    fn new(loss: Loss) -> Self {
        let share = loss.share.clamp(0.0, 0.95);
        let to_good = 1.0 / loss.mean_burst.max(1.0);
        LossModel {
            bad: Vec::new(),
            to_bad: share * to_good / (1.0 - share),
            to_good,
        }
    }

    /// Whether endpoint `idx`'s next report arrives.
    fn delivered(&mut self, idx: usize, rng: &mut SmallRng) -> bool {
        if self.to_bad <= 0.0 {
            return true;
        }
        if self.bad.len() <= idx {
            self.bad.resize(idx + 1, false);
        }
        let u: f64 = rng.gen();
        let bad = &mut self.bad[idx];
        *bad = if *bad {
            u >= self.to_good
        } else {
            u < self.to_bad
        };
        !*bad
    }
}

/// Runs `scenario` under `kind` with Ballast's `gains` (and otherwise the default
/// parameters, without the start-up grace period).
pub fn simulate(
    scenario: &Scenario,
    kind: StrategyKind,
    seed: u64,
    gains: PidGains,
) -> Result<Recording, SimError> {
    let params = Params {
        // The fleet starts with the balancer: no restart to wait out.
        grace_ms: 0,
        pid: gains,
        ..Params::default()
    };
    simulate_with(scenario, kind, seed, &params)
}

/// Runs `scenario` under `kind` with Ballast's parameters `params`.
pub fn simulate_with(
    scenario: &Scenario,
    kind: StrategyKind,
    seed: u64,
    params: &Params,
) -> Result<Recording, SimError> {
    let mut fleet_rng = stream(seed, scenario.id, Stream::Fleet);
    let mut arrivals = stream(seed, scenario.id, Stream::Arrivals);
    let mut picker = stream(seed, scenario.id, Stream::Picker);
    let mut reports = stream(seed, scenario.id, Stream::Reports);

    let mut fleet = Fleet::new(&scenario.fleet, &mut fleet_rng, &mut arrivals);
    params.validate()?;
    let capacities: Vec<f64> = fleet.endpoints.iter().map(|e| e.cores * e.speed).collect();
    let agent = AgentConfig::of(&scenario.fleet);
    let mut strategy = Strategy::new(kind, params, &capacities, 0, agent)?;
    strategy.publish(&mut fleet.clients, &mut picker);
    let mut loss = LossModel::new(scenario.loss);
    let initial_clients = fleet.clients.len();

    // Faults hit a mid-generation endpoint, so that speed does not confound them.
    let mut watched = None;
    let speed_one = fleet
        .endpoints
        .iter()
        .position(|e| (e.speed - 1.0).abs() < 1e-9)
        .unwrap_or(0);

    let cycles = scenario.cycles as usize;
    let mut rec = Recording {
        kind,
        load: Vec::with_capacity(cycles),
        cpu: Vec::with_capacity(cycles),
        arrivals: Vec::with_capacity(cycles),
        weights: Vec::with_capacity(cycles),
        skipped: Vec::with_capacity(cycles),
        completions: Vec::with_capacity(cycles),
        errors: Vec::with_capacity(cycles),
        watched: None,
        watched_inflight: Vec::with_capacity(cycles),
        p99_latency_ms: 0.0,
        capacities: Vec::new(),
        implied: Vec::with_capacity(cycles),
        inflight_binding: Vec::with_capacity(cycles),
        inflight_distrusted: Vec::with_capacity(cycles),
        feed_forward_steps: 0,
        watched_estimate: Vec::with_capacity(cycles),
    };

    for cycle in 0..scenario.cycles {
        let start = u64::from(cycle) * CYCLE_MS;
        for ev in scenario.events.iter().filter(|e| e.cycle == cycle) {
            match ev.kind {
                EventKind::AddClients { share, clients } => {
                    let rate = fleet.offered_rate() * share;
                    let count = clients.max(1).min(initial_clients.max(1) * 10);
                    fleet.add_clients(count, rate, &mut fleet_rng);
                    fleet.restart_arrivals(start, &mut arrivals);
                    strategy.invalidate();
                }
                EventKind::ScaleTraffic { factor } => {
                    fleet.scale_traffic(factor);
                    fleet.restart_arrivals(start, &mut arrivals);
                }
                EventKind::Join { speed } => {
                    let idx = fleet.join(speed, start, &mut fleet_rng);
                    let e = &fleet.endpoints[idx];
                    strategy.join(start, idx, e.cores * e.speed)?;
                    watched = Some(idx);
                }
                EventKind::DegradeIo { share } => {
                    let rate_per_ms = fleet.fair_rate(speed_one) * share;
                    fleet.endpoints[speed_one].fault = Fault::DegradedIo { rate_per_ms };
                    watched = Some(speed_one);
                }
                EventKind::FailFast => {
                    fleet.endpoints[speed_one].fault = Fault::FailFast;
                    watched = Some(speed_one);
                }
                EventKind::Neighbour { cores_share, niced } => {
                    let e = &mut fleet.endpoints[speed_one];
                    e.neighbour = Some(Neighbour {
                        threads: e.cores * cores_share,
                        niced,
                    });
                    watched = Some(speed_one);
                }
            }
        }
        strategy.publish(&mut fleet.clients, &mut picker);
        rec.implied.push(fleet.implied_max_over_avg());
        if cycle == scenario.disturbance {
            fleet.reset_latency();
        }

        for t in 0..TICKS_PER_CYCLE {
            let now = start + t * TICK_MS;
            fleet.tick(now, &strategy, &mut arrivals, &mut picker);
            let end = now + TICK_MS;
            for idx in 0..fleet.endpoints.len() {
                if fleet.endpoints[idx].phase != t {
                    continue;
                }
                let noise = scenario.fleet.cpu_noise;
                let m = fleet.endpoints[idx].take_report(end, noise, &mut reports);
                let delivered = loss.delivered(idx, &mut reports);
                strategy.report(end, idx, &m, delivered)?;
            }
        }

        let end = start + CYCLE_MS;
        let mut load = Vec::with_capacity(fleet.endpoints.len());
        let mut cpu = Vec::with_capacity(fleet.endpoints.len());
        let mut arr = Vec::with_capacity(fleet.endpoints.len());
        let (mut completions, mut errors) = (0u64, 0u64);
        for e in &mut fleet.endpoints {
            let (l, c, w) = e.take_metric(end);
            load.push(l);
            cpu.push(c);
            arr.push(w.arrivals);
            completions += u64::from(w.completions);
            errors += u64::from(w.errors);
        }
        rec.load.push(load);
        rec.cpu.push(cpu);
        rec.arrivals.push(arr);
        rec.completions.push(completions);
        rec.errors.push(errors);
        rec.watched_inflight.push(
            watched
                .and_then(|w| fleet.endpoints.get(w))
                .map_or(0, |e| u32::try_from(e.inflight()).unwrap_or(u32::MAX)),
        );

        let outcome = strategy.cycle(end);
        strategy.publish(&mut fleet.clients, &mut picker);
        rec.skipped.push(outcome.skipped);
        let v = strategy.inflight_verdicts().unwrap_or_default();
        rec.inflight_binding.push(v.binding);
        rec.inflight_distrusted.push(v.distrusted);
        rec.feed_forward_steps = v.feed_forward_steps;
        rec.watched_estimate
            .push(watched.and_then(|w| strategy.inflight_estimate(w)));
        rec.weights.push(strategy.weights().map(<[f64]>::to_vec));
    }
    rec.watched = watched;
    rec.p99_latency_ms = fleet.latency.quantile(0.99);
    rec.capacities = fleet
        .endpoints
        .iter()
        .map(|e| e.available_cores() * e.speed)
        .collect();
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_model_loses_its_share_in_bursts() {
        let mut m = LossModel::new(Loss {
            share: 0.2,
            mean_burst: 5.0,
        });
        let mut rng = stream(1, "loss", Stream::Reports);
        let n = 200_000;
        let (mut lost, mut bursts, mut prev) = (0, 0, true);
        for _ in 0..n {
            let ok = m.delivered(0, &mut rng);
            if !ok {
                lost += 1;
                if prev {
                    bursts += 1;
                }
            }
            prev = ok;
        }
        let share = f64::from(lost) / f64::from(n);
        let mean_burst = f64::from(lost) / f64::from(bursts);
        assert!((share - 0.2).abs() < 0.01, "share {share}");
        assert!((mean_burst - 5.0).abs() < 0.3, "burst {mean_burst}");
        let mut none = LossModel::new(Loss::NONE);
        assert!((0..1000).all(|_| none.delivered(3, &mut rng)));
    }
}
