//! The fleet simulator: a deterministic, seeded, discrete-time model of a
//! heterogeneous fleet that compares load balancing strategies on the same fleets and
//! requests, tunes the PID defaults, and writes `docs/balance.md` and its charts.
//!
//! Ballast's weights come from the real [`ballast_balance`] module, driven through
//! [`ballast::BallastAdapter`]; the client-side strategies live in [`strategy`].
//!
//! The modules, in the order data flows through them: [`scenario`] (what happens),
//! [`random`] (seeded streams), [`fleet`] (endpoints, clients, requests), [`strategy`]
//! and [`ballast`] (who picks which endpoint), [`engine`] (one run, recorded per
//! cycle), [`metrics`] (the figures), [`tune`] (the gain sweep), [`step`] (the step
//! response against static weights, with and without the feed-forward first step),
//! [`experiment`] (the evidence for changes to the core), and the outputs: [`chart`],
//! [`report`] with [`headline`] and [`findings`].

pub mod ballast;
pub mod chart;
pub mod engine;
pub mod experiment;
pub mod findings;
pub mod fleet;
pub mod headline;
pub mod metrics;
pub mod random;
pub mod report;
pub mod scenario;
pub mod step;
pub mod strategy;
pub mod tune;

#[cfg(test)]
mod tests;

use ballast_balance::params::ParamsError;
use ballast_balance::{BalanceError, PidGains};
use metrics::Metrics;
use scenario::Scenario;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use strategy::StrategyKind;

/// The command that regenerates `docs/balance.md` and `docs/img/`.
pub const REGENERATE: &str = "cargo run --release -p ballast-sim -- simulate --out docs";

/// What to simulate and where to write it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimOptions {
    /// Seed of every random stream; the same seed gives the same numbers.
    pub seed: u64,
    /// The docs directory: `balance.md` goes here and the charts under `img/`. An
    /// empty path writes nothing.
    pub out_dir: PathBuf,
    /// Shorter runs on smaller fleets, for tests.
    pub quick: bool,
    /// Scenario ids to run (see [`scenario::all`]); `None` runs all of them and the
    /// gain sweep.
    pub scenarios: Option<Vec<String>>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            seed: 1,
            out_dir: PathBuf::new(),
            quick: false,
            scenarios: None,
        }
    }
}

/// Why a simulation failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A scenario id that does not exist.
    #[error("unknown scenario {name:?}; known: {known}")]
    UnknownScenario {
        /// The id asked for.
        name: String,
        /// The ids that exist, comma-separated.
        known: String,
    },
    /// The balancing core refused a simulated registration or report.
    #[error("the balancer refused the simulator: {0}")]
    Balance(#[from] BalanceError),
    /// The PID gains or parameters under test are out of range.
    #[error("invalid balancer parameters: {0}")]
    Params(#[from] ParamsError),
    /// Writing an output failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Drawing a chart failed.
    #[error("drawing {path}: {message}")]
    Chart {
        /// The chart file.
        path: PathBuf,
        /// What the plotting library said.
        message: String,
    },
    /// A worker thread panicked (a bug in the simulator).
    #[error("a simulation worker panicked")]
    Worker,
}

/// One strategy's figures in one scenario.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StrategyResult {
    /// The strategy.
    pub strategy: StrategyKind,
    /// The PID gains, for strategies driven by Ballast.
    pub gains: PidGains,
    /// Whether this row ran with the sweep's gains rather than the shipped defaults.
    pub tuned: bool,
    /// Its figures.
    pub metrics: Metrics,
}

impl StrategyResult {
    /// Label for tables and charts.
    pub fn label(&self) -> String {
        if self.tuned {
            format!("{} (sweep's gains)", self.strategy.label())
        } else {
            self.strategy.label().to_string()
        }
    }
}

/// One scenario's results.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioSummary {
    /// The scenario as run (shortened in quick mode).
    pub scenario: Scenario,
    /// Per strategy, in the scenario's order.
    pub results: Vec<StrategyResult>,
}

impl ScenarioSummary {
    /// The figures of `kind` with the shipped gains, if it ran.
    pub fn get(&self, kind: StrategyKind) -> Option<&Metrics> {
        self.results
            .iter()
            .find(|r| r.strategy == kind && !r.tuned)
            .map(|r| &r.metrics)
    }

    /// The figures of `kind` with the sweep's gains, if they differ from the defaults.
    pub fn tuned(&self, kind: StrategyKind) -> Option<&Metrics> {
        self.results
            .iter()
            .find(|r| r.strategy == kind && r.tuned)
            .map(|r| &r.metrics)
    }
}

/// Everything a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimSummary {
    /// The seed.
    pub seed: u64,
    /// Whether it was a quick run.
    pub quick: bool,
    /// The PID gains Ballast ran with: the shipped defaults.
    pub gains: PidGains,
    /// Per scenario.
    pub scenarios: Vec<ScenarioSummary>,
    /// The gain sweep, when every scenario ran.
    pub sweep: Option<tune::Sweep>,
    /// Experiments behind the recommended core changes, when every scenario ran.
    pub experiments: Vec<experiment::Experiment>,
    /// The step response against static weights, when every scenario ran.
    pub steps: Vec<step::StepResponse>,
    /// Files written.
    pub written: Vec<PathBuf>,
}

impl SimSummary {
    /// A scenario's results by id.
    pub fn scenario(&self, id: &str) -> Option<&ScenarioSummary> {
        self.scenarios.iter().find(|s| s.scenario.id == id)
    }
}

/// Runs the sweep (when all scenarios run), then every scenario with the shipped
/// gains — and Ballast once more with the sweep's gains where they differ — and
/// writes the outputs.
pub fn run(opts: &SimOptions) -> Result<SimSummary, SimError> {
    let scenarios = select(opts)?;
    let gains = PidGains::default();
    let sweep = if opts.scenarios.is_none() {
        Some(tune::sweep(opts.seed, opts.quick)?)
    } else {
        None
    };
    let tuned = sweep
        .as_ref()
        .and_then(tune::Sweep::chosen_gains)
        .filter(|g| *g != gains);
    let results = run_scenarios(&scenarios, opts.seed, gains, tuned)?;
    let experiments = if opts.scenarios.is_none() {
        experiment::run_all(opts.seed, tuned.unwrap_or(gains), opts.quick)?
    } else {
        Vec::new()
    };
    let steps = if opts.scenarios.is_none() {
        step::run(opts.seed, gains, opts.quick)?
    } else {
        Vec::new()
    };
    let mut summary = SimSummary {
        seed: opts.seed,
        quick: opts.quick,
        gains,
        scenarios: results,
        sweep,
        experiments,
        steps,
        written: Vec::new(),
    };
    if !opts.out_dir.as_os_str().is_empty() {
        summary.written = report::write(&opts.out_dir, &summary)?;
    }
    Ok(summary)
}

/// The scenarios `opts` asks for, shortened in quick mode.
pub fn select(opts: &SimOptions) -> Result<Vec<Scenario>, SimError> {
    let all = scenario::all();
    let chosen = match &opts.scenarios {
        None => all,
        Some(ids) => {
            let mut out = Vec::new();
            for id in ids {
                let found = all.iter().find(|s| s.id == id.as_str()).ok_or_else(|| {
                    SimError::UnknownScenario {
                        name: id.clone(),
                        known: all.iter().map(|s| s.id).collect::<Vec<_>>().join(", "),
                    }
                })?;
                out.push(found.clone());
            }
            out
        }
    };
    Ok(if opts.quick {
        chosen.iter().map(Scenario::quick).collect()
    } else {
        chosen
    })
}

/// Runs every strategy of every scenario with `gains`, in parallel; with `tuned`,
/// Ballast runs once more with those gains in every scenario.
pub fn run_scenarios(
    scenarios: &[Scenario],
    seed: u64,
    gains: PidGains,
    tuned: Option<PidGains>,
) -> Result<Vec<ScenarioSummary>, SimError> {
    let mut jobs: Vec<(usize, StrategyKind, Option<PidGains>)> = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        for k in &s.strategies {
            jobs.push((i, *k, None));
            if *k == StrategyKind::Ballast && tuned.is_some() {
                jobs.push((i, *k, tuned));
            }
        }
    }
    let metrics = parallel(jobs.len(), |j| {
        let (i, kind, t) = jobs[j];
        let rec = engine::simulate(&scenarios[i], kind, seed, t.unwrap_or(gains))?;
        Ok(metrics::measure(&scenarios[i], &rec))
    })?;
    let mut out: Vec<ScenarioSummary> = scenarios
        .iter()
        .map(|s| ScenarioSummary {
            scenario: s.clone(),
            results: Vec::new(),
        })
        .collect();
    for ((i, kind, t), m) in jobs.into_iter().zip(metrics) {
        out[i].results.push(StrategyResult {
            strategy: kind,
            gains: t.unwrap_or(gains),
            tuned: t.is_some(),
            metrics: m,
        });
    }
    Ok(out)
}

/// Runs `f(0..n)` on as many threads as the machine has cores, returning the results
/// in index order, so that the output does not depend on scheduling.
pub fn parallel<T, F>(n: usize, f: F) -> Result<Vec<T>, SimError>
where
    T: Send,
    F: Fn(usize) -> Result<T, SimError> + Sync,
{
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(n.max(1));
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<T, SimError>>>> = Mutex::new((0..n).map(|_| None).collect());
    let panicked = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= n {
                        break;
                    }
                    let r = f(j);
                    if let Ok(mut s) = slots.lock() {
                        s[j] = Some(r);
                    }
                })
            })
            .collect();
        handles.into_iter().any(|h| h.join().is_err())
    });
    if panicked {
        return Err(SimError::Worker);
    }
    let slots = slots.into_inner().map_err(|_| SimError::Worker)?;
    slots
        .into_iter()
        .map(|s| s.unwrap_or(Err(SimError::Worker)))
        .collect()
}
