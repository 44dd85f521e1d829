//! SVG charts in the style of Robinhood's quantile charts: max, p95, average and p5
//! utilization over time, one panel per strategy, and max/avg over time with every
//! strategy on one chart.

use super::{ScenarioSummary, SimError};
use ballast_charts::{Frame, QuantileChart, Quantiles};
pub use ballast_charts::{Line, LineChart, CLIP};
use std::path::Path;

fn chart_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Chart {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Writes a drawn chart to `path`.
fn write(path: &Path, svg: Result<String, ballast_charts::ChartError>) -> Result<(), SimError> {
    let svg = svg.map_err(|e| chart_err(path, e))?;
    std::fs::write(path, svg).map_err(|e| chart_err(path, e))
}

/// Max, p95, average and p5 utilization (5 s trailing means) per strategy.
pub fn quantiles(path: &Path, s: &ScenarioSummary) -> Result<(), SimError> {
    let per_cycle = |values: &[f64]| -> Vec<(f64, f64)> {
        values
            .iter()
            .enumerate()
            .map(|(c, v)| (c as f64 + 1.0, *v))
            .collect()
    };
    let panels = s
        .results
        .iter()
        .map(|r| {
            let m = &r.metrics.series;
            Quantiles {
                caption: r.label(),
                max: per_cycle(&m.max),
                p95: per_cycle(&m.p95),
                avg: per_cycle(&m.avg),
                p5: per_cycle(&m.p5),
            }
        })
        .collect();
    let title = format!(
        "{}: load per endpoint (5 s means), max / p95 / avg / p5",
        s.scenario.title
    );
    let chart = QuantileChart {
        title: &title,
        x_desc: "seconds",
        x_min: 0.0,
        x_max: s.scenario.cycles as f64,
        marker: (s.scenario.disturbance > 0).then_some(f64::from(s.scenario.disturbance)),
        panels,
        panel_size: (380, 250),
        columns: None,
        whole_x_labels: false,
    };
    write(path, ballast_charts::quantile_chart_svg(&chart))
}

/// One line per strategy over time: `values(result)` gives the per-cycle values
/// and `from` the cycle of the first value.
fn lines(
    path: &Path,
    s: &ScenarioSummary,
    title: &str,
    y_desc: &str,
    y_floor: f64,
    from: u32,
    values: impl Fn(&super::StrategyResult) -> Vec<f64>,
) -> Result<(), SimError> {
    let lines = s
        .results
        .iter()
        .map(|r| Line {
            label: r.label(),
            points: values(r)
                .iter()
                .enumerate()
                .map(|(c, v)| (f64::from(from) + c as f64 + 1.0, *v))
                .collect(),
        })
        .collect();
    line_chart(
        path,
        &LineChart {
            title,
            x_desc: "seconds",
            y_desc,
            x_max: f64::from(s.scenario.cycles),
            y_floor,
            lines,
            markers: Vec::new(),
        },
    )
}

/// Draws `c` as a 760×380 SVG at `path`. Used by the simulator's charts and by the
/// physical lab's (`tests/src/lab`), so both look alike; the aggregator's dashboard
/// draws with the same [`ballast_charts`].
pub fn line_chart(path: &Path, c: &LineChart) -> Result<(), SimError> {
    write(path, ballast_charts::line_chart_svg(c, Frame::default()))
}

/// Max/avg (5 s means) over time, every strategy on one chart.
pub fn max_over_avg(path: &Path, s: &ScenarioSummary) -> Result<(), SimError> {
    let title = format!("{}: max/avg load (5 s means)", s.scenario.title);
    // max/avg is never below 1: start the axis just under it.
    lines(path, s, &title, "max / avg", 0.9, 0, |r| {
        r.metrics.ratio.iter().map(|v| v.max(0.9)).collect()
    })
}

/// The watched endpoint's load over the average (3-cycle means) from the
/// disturbance on, every strategy on one chart.
pub fn watched(path: &Path, s: &ScenarioSummary, what: &str) -> Result<(), SimError> {
    let title = format!("{}: {what} load / fleet average", s.scenario.title);
    lines(
        path,
        s,
        &title,
        "load / avg",
        0.0,
        s.scenario.disturbance,
        |r| {
            r.metrics
                .watched
                .as_ref()
                .map(|w| w.curve.clone())
                .unwrap_or_default()
        },
    )
}

/// The step response: max/avg of the load the weights imply (averaged over seeds) of
/// every arm, with the 5 % band above the static oracle, up to
/// [`super::step::SHOWN`] cycles after the disturbance.
pub fn step_response(path: &Path, r: &super::step::StepResponse) -> Result<(), SimError> {
    let end = r
        .arms
        .iter()
        .map(|a| a.curve.len())
        .min()
        .unwrap_or(0)
        .min(r.disturbance as usize + super::step::SHOWN);
    let curve = |c: &[f64]| -> Vec<(f64, f64)> {
        c.iter()
            .take(end)
            .enumerate()
            .map(|(i, v)| (i as f64 + 1.0, v.max(0.9)))
            .collect()
    };
    let mut lines: Vec<Line> = r
        .arms
        .iter()
        .map(|a| Line {
            label: a.label(),
            points: curve(&a.curve),
        })
        .collect();
    lines.push(Line {
        label: "static weights + 5 %".to_string(),
        points: (0..(r.disturbance as usize).min(end))
            .map(|i| {
                (
                    i as f64 + 1.0,
                    r.oracle_before * (1.0 + super::step::WITHIN),
                )
            })
            .collect(),
    });
    let title = format!(
        "{}: max/avg of the load the weights imply (mean of {} seeds)",
        r.title, r.seeds
    );
    line_chart(
        path,
        &LineChart {
            title: &title,
            x_desc: "seconds",
            y_desc: "max / avg",
            x_max: end as f64,
            y_floor: 0.9,
            lines,
            markers: vec![f64::from(r.disturbance)],
        },
    )
}
