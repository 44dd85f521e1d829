//! The soak: a real aggregator and a fleet of real agents (200 by default) for a long
//! run (30 minutes by default) under steady synthetic load, with the churn of a real
//! fleet: a few agents restarted every minute, drains and undrains, a config reload
//! every five minutes, and one graceful restart of the aggregator halfway.
//!
//! It samples the resident memory and open descriptors of the aggregator and of one
//! agent that is never restarted, the balance (max/avg of the last cycle), cycles run
//! and skipped by reason, and reports accepted and refused; then writes the figures
//! between the soak markers of `docs/reliability.md` and two charts in `docs/img/`,
//! and exits non-zero if memory or descriptors grew past their bound.
//!
//! `cargo bench -p ballast-tests --bench soak --profile dev --features ballast-aggregator/etcd`
//! (`-- --minutes M --agents N` to change the run); `bash tests/soak` builds the
//! binaries it runs and runs it.

use ballast_sim::simulate::chart::{line_chart, Line, LineChart};
use ballast_tests::harness::converge::node_names;
use ballast_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SERVICE: &str = "soak";
/// How often the figures are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// Growth allowed after the warm-up (the first fifth of the run), relative to the
/// warm-up's level: allocators settle, buffers grow to their working size, then
/// nothing should grow with time.
const RSS_GROWTH_BOUND: f64 = 0.15;
/// Open descriptors allowed above the warm-up's level.
const FD_GROWTH_BOUND: i64 = 16;

struct Args {
    minutes: u64,
    agents: usize,
}

fn args() -> Args {
    let mut a = Args {
        minutes: 30,
        agents: 200,
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        let value = || {
            argv.get(i + 1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{} needs a number", argv[i]))
        };
        match argv[i].as_str() {
            "--minutes" => {
                a.minutes = value();
                i += 1;
            }
            "--agents" => {
                a.agents = value() as usize;
                i += 1;
            }
            // cargo bench passes --bench.
            _ => {}
        }
        i += 1;
    }
    a
}

/// Resident memory (MB) and open descriptors of `pid`.
fn footprint(pid: u32) -> Option<(f64, i64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as i64;
    Some((kb / 1024.0, fds))
}

#[derive(Debug, Clone)]
struct Sample {
    t: f64,
    agg_rss: f64,
    agg_fds: i64,
    agent_rss: f64,
    agent_fds: i64,
    max_over_avg: f64,
}

fn service_file(dir: &Path, missing_threshold: f64) {
    let text = format!("[balance]\nmissing_threshold = {missing_threshold}\n");
    std::fs::write(dir.join(format!("{SERVICE}.toml")), text).expect("write the service file");
}

fn main() {
    let a = args();
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let work = tempfile::Builder::new()
        .prefix("ballast-soak-")
        .tempdir()
        .expect("temporary directory");
    let config_dir = work.path().join("services.d");
    std::fs::create_dir(&config_dir).expect("config directory");
    service_file(&config_dir, 0.15);

    let pki = Pki::new();
    // The shipped cycle and report interval (1 s each): a soak runs the defaults.
    let mut agg = Aggregator::start(
        &pki,
        AggregatorOpts {
            config_dir: Some(config_dir.clone()),
            ..AggregatorOpts::default()
                .cycle_ms(1000)
                .report_interval_ms(1000)
        },
    );
    let nodes = node_names(SERVICE, a.agents);
    let refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
    pki.issue_nodes_for(SERVICE, &refs);
    let speeds = [0.6, 0.8, 1.0, 1.0, 1.2, 1.5];
    let mut agents: Vec<Agent> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            Agent::start(
                &pki,
                &agg,
                AgentOpts::new(SERVICE, n)
                    .speed(speeds[i % speeds.len()])
                    .seed(i as u64),
            )
        })
        .collect();
    for ag in &agents {
        ag.wait_weight(Duration::from_secs(60));
    }
    eprintln!(
        "soak: {} agents up; running {} minutes",
        a.agents, a.minutes
    );

    let run = Duration::from_secs(a.minutes * 60);
    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_sample = Instant::now();
    let mut next_restart = Instant::now() + Duration::from_secs(60);
    let mut next_reload = Instant::now() + Duration::from_secs(300);
    let mut next_drain = Instant::now() + Duration::from_secs(180);
    let mut undrain_at: Option<(Instant, Vec<usize>)> = None;
    let mut aggregator_restarted = false;
    let (mut restarts, mut reloads, mut drains) = (0u64, 0u64, 0u64);
    let mut turn = 1usize;
    let mut threshold = 0.15;
    let mut markers = Vec::new();
    // Counters carried over the aggregator's restart.
    let mut carried: BTreeMap<String, f64> = BTreeMap::new();
    let counters = |agg: &Aggregator| -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        for s in agg.metric_samples() {
            let keep = [
                "ballast_cycles_total",
                "ballast_cycles_skipped_total",
                "ballast_reports_accepted_total",
                "ballast_reports_rejected_total",
                "ballast_connections_rejected_total",
            ];
            if keep.contains(&s.name.as_str()) {
                let label: Vec<String> = s
                    .labels
                    .iter()
                    .filter(|(k, _)| k.as_str() != "service")
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                let key = if label.is_empty() {
                    s.name.clone()
                } else {
                    format!("{}{{{}}}", s.name, label.join(","))
                };
                *m.entry(key).or_insert(0.0) += s.value;
            }
        }
        m
    };

    while started.elapsed() < run {
        let now = Instant::now();
        if now >= next_sample {
            let t = started.elapsed().as_secs_f64();
            let (agg_rss, agg_fds) = agg.pid().and_then(footprint).unwrap_or((0.0, 0));
            let (agent_rss, agent_fds) = agents[0].pid().and_then(footprint).unwrap_or((0.0, 0));
            let max_over_avg = agg
                .try_service(SERVICE)
                .map(|d| d.stats.spread.max_over_avg)
                .unwrap_or(f64::NAN);
            samples.push(Sample {
                t,
                agg_rss,
                agg_fds,
                agent_rss,
                agent_fds,
                max_over_avg,
            });
            next_sample += SAMPLE_EVERY;
        }
        if now >= next_restart {
            // Five agents restarted, never the one whose footprint is sampled.
            for _ in 0..5 {
                turn = 1 + (turn % (agents.len() - 1).max(1));
                agents[turn].stop(Duration::from_secs(5));
                agents[turn].restart(&pki, &agg);
                restarts += 1;
            }
            next_restart += Duration::from_secs(60);
        }
        if now >= next_drain && undrain_at.is_none() {
            let picked: Vec<usize> = (0..2)
                .map(|k| 1 + ((turn + 50 + k) % (agents.len() - 1).max(1)))
                .collect();
            for &i in &picked {
                let _ = agents[i].drain();
                drains += 1;
            }
            undrain_at = Some((now + Duration::from_secs(60), picked));
            next_drain += Duration::from_secs(180);
        }
        if let Some((at, picked)) = &undrain_at {
            if now >= *at {
                for &i in picked {
                    let _ = agents[i].undrain();
                }
                undrain_at = None;
            }
        }
        if now >= next_reload {
            threshold = if threshold == 0.15 { 0.2 } else { 0.15 };
            service_file(&config_dir, threshold);
            reloads += 1;
            next_reload += Duration::from_secs(300);
        }
        if !aggregator_restarted && started.elapsed() >= run / 2 {
            for (k, v) in counters(&agg) {
                *carried.entry(k).or_insert(0.0) += v;
            }
            markers.push(started.elapsed().as_secs_f64());
            agg.restart();
            aggregator_restarted = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut totals = carried;
    for (k, v) in counters(&agg) {
        *totals.entry(k).or_insert(0.0) += v;
    }
    let lost: u64 = agents.iter().map(|ag| ag.status().reports_failed).sum();
    let sent: u64 = agents.iter().map(|ag| ag.status().reports_sent).sum();
    drop(agents);
    drop(agg);

    // Bounds: after the warm-up, nothing grows.
    let warm = samples.len() / 5;
    let level = |f: &dyn Fn(&Sample) -> f64, from: usize, to: usize| -> f64 {
        let s = &samples[from.min(samples.len())..to.min(samples.len())];
        s.iter().map(f).fold(0.0, f64::max)
    };
    let n = samples.len();
    let agg_warm = level(&|s| s.agg_rss, warm.saturating_sub(1), warm + 1);
    let agg_end = level(&|s| s.agg_rss, n.saturating_sub(3), n);
    let agent_warm = level(&|s| s.agent_rss, warm.saturating_sub(1), warm + 1);
    let agent_end = level(&|s| s.agent_rss, n.saturating_sub(3), n);
    let fds = |f: &dyn Fn(&Sample) -> i64, i: usize| samples.get(i).map_or(0, f);
    let agg_fd_warm = fds(&|s| s.agg_fds, warm);
    let agg_fd_end = fds(&|s| s.agg_fds, n.saturating_sub(1));
    let agent_fd_warm = fds(&|s| s.agent_fds, warm);
    let agent_fd_end = fds(&|s| s.agent_fds, n.saturating_sub(1));
    let mut missed = Vec::new();
    // The aggregator restarted halfway: compare its end with the level after its own
    // warm-up in the second half.
    let second_warm = samples
        .iter()
        .position(|s| markers.first().is_some_and(|m| s.t > m + 120.0))
        .unwrap_or(warm);
    let agg_second = level(&|s| s.agg_rss, second_warm, second_warm + 2);
    let agg_base = if agg_second > 0.0 {
        agg_second
    } else {
        agg_warm
    };
    if agg_end > agg_base * (1.0 + RSS_GROWTH_BOUND) {
        missed.push(format!(
            "aggregator RSS grew from {agg_base:.1} to {agg_end:.1} MB"
        ));
    }
    if agent_end > agent_warm * (1.0 + RSS_GROWTH_BOUND) {
        missed.push(format!(
            "agent RSS grew from {agent_warm:.1} to {agent_end:.1} MB"
        ));
    }
    if agent_fd_end > agent_fd_warm + FD_GROWTH_BOUND {
        missed.push(format!(
            "agent descriptors grew from {agent_fd_warm} to {agent_fd_end}"
        ));
    }
    let agg_fd_second = samples.get(second_warm).map_or(agg_fd_warm, |s| s.agg_fds);
    if agg_fd_end > agg_fd_second + FD_GROWTH_BOUND {
        missed.push(format!(
            "aggregator descriptors grew from {agg_fd_second} to {agg_fd_end}"
        ));
    }

    // Balance over the run.
    let mut ratios: Vec<f64> = samples
        .iter()
        .map(|s| s.max_over_avg)
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        ratios
            .get(((ratios.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };

    let img = docs.join("img");
    let chart = |file: &str, c: LineChart| {
        let path: PathBuf = img.join(file);
        line_chart(&path, &c).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    };
    let rel = |f: &dyn Fn(&Sample) -> f64, base: f64| -> Vec<(f64, f64)> {
        samples
            .iter()
            .map(|s| (s.t / 60.0, if base > 0.0 { f(s) / base } else { 0.0 }))
            .collect()
    };
    let x_max = a.minutes as f64;
    chart(
        "soak-footprint.svg",
        LineChart {
            title: "Soak: footprint relative to the end of the warm-up",
            x_desc: "minutes",
            y_desc: "relative to warm-up",
            x_max,
            y_floor: 0.0,
            lines: vec![
                Line {
                    label: format!("aggregator RSS (1 = {agg_warm:.1} MB)"),
                    points: rel(&|s| s.agg_rss, agg_warm),
                },
                Line {
                    label: format!("agent RSS (1 = {agent_warm:.1} MB)"),
                    points: rel(&|s| s.agent_rss, agent_warm),
                },
                Line {
                    label: format!("aggregator descriptors (1 = {agg_fd_warm})"),
                    points: rel(&|s| s.agg_fds as f64, agg_fd_warm as f64),
                },
                Line {
                    label: format!("agent descriptors (1 = {agent_fd_warm})"),
                    points: rel(&|s| s.agent_fds as f64, agent_fd_warm as f64),
                },
            ],
            markers: markers.iter().map(|m| m / 60.0).collect(),
        },
    );
    chart(
        "soak-balance.svg",
        LineChart {
            title: "Soak: max/avg load of the last cycle",
            x_desc: "minutes",
            y_desc: "max / avg",
            x_max,
            y_floor: 1.0,
            lines: vec![Line {
                label: format!("{} agents under churn", a.agents),
                points: samples
                    .iter()
                    .filter(|s| s.max_over_avg.is_finite())
                    .map(|s| (s.t / 60.0, s.max_over_avg))
                    .collect(),
            }],
            markers: markers.iter().map(|m| m / 60.0).collect(),
        },
    );

    let when = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut md = String::new();
    md.push_str(&format!(
        "Run: {when}, `bash tests/soak --minutes {} --agents {}` \
         on this project's 2-core CI machine kind. {} agents of one service, synthetic load, \
         the shipped 1 s cycle and report interval; every minute 5 agents restarted ({restarts} in all), \
         every 3 minutes 2 drained for a minute ({drains} drains), every 5 minutes a config reload \
         ({reloads}), and one graceful aggregator restart at minute {:.0} (the grey line).\n\n",
        a.minutes,
        a.agents,
        a.agents,
        markers.first().copied().unwrap_or(0.0) / 60.0
    ));
    md.push_str("| figure | after warm-up | at the end | bound |\n|---|---|---|---|\n");
    md.push_str(&format!(
        "| aggregator RSS | {agg_base:.1} MB | {agg_end:.1} MB | +{:.0} % |\n",
        RSS_GROWTH_BOUND * 100.0
    ));
    md.push_str(&format!(
        "| agent RSS (never restarted) | {agent_warm:.1} MB | {agent_end:.1} MB | +{:.0} % |\n",
        RSS_GROWTH_BOUND * 100.0
    ));
    md.push_str(&format!(
        "| aggregator open descriptors | {agg_fd_second} | {agg_fd_end} | +{FD_GROWTH_BOUND} |\n"
    ));
    md.push_str(&format!(
        "| agent open descriptors | {agent_fd_warm} | {agent_fd_end} | +{FD_GROWTH_BOUND} |\n\n"
    ));
    md.push_str(&format!(
        "Balance, max/avg of the last cycle sampled every {} s: median {:.3}, 95th percentile {:.3}, \
         worst {:.3} (restarts and drains included).\n\n",
        SAMPLE_EVERY.as_secs(),
        pct(0.5),
        pct(0.95),
        ratios.last().copied().unwrap_or(f64::NAN)
    ));
    md.push_str(&format!(
        "Reports: {sent} sent by the agents still running at the end, {lost} failed to send \
         (counted by the agents).\n\n| counter (both aggregator runs) | value |\n|---|---|\n"
    ));
    for (k, v) in &totals {
        md.push_str(&format!("| `{k}` | {v:.0} |\n"));
    }
    md.push_str("\n![footprint](img/soak-footprint.svg)\n\n![balance](img/soak-balance.svg)\n\n");
    if missed.is_empty() {
        md.push_str("Every bound held.\n");
    } else {
        md.push_str(&format!("**Missed:** {}.\n", missed.join("; ")));
    }

    let path = docs.join("reliability.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Reliability\n".to_string());
    let (begin, end) = ("<!-- soak:begin -->", "<!-- soak:end -->");
    let section = format!("{begin}\n{md}{end}");
    let new = match (doc.find(begin), doc.find(end)) {
        (Some(b), Some(e)) if e > b => format!("{}{section}{}", &doc[..b], &doc[e + end.len()..]),
        _ => format!("{}\n## Soak\n\n{section}\n", doc.trim_end()),
    };
    std::fs::write(&path, new).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    println!("{md}");
    if !missed.is_empty() {
        eprintln!("the soak missed: {}", missed.join("; "));
        std::process::exit(1);
    }
}
