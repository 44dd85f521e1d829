//! SVG charts in the style of Robinhood's quantile charts: max, p95, average and p5
//! utilization over time, one panel per strategy, and max/avg over time with every
//! strategy on one chart.

use super::{ScenarioSummary, SimError};
use plotters::prelude::*;
use std::path::Path;

/// Values above this are drawn at it: a runaway queue (load 40 and climbing) would
/// otherwise flatten every other line into the axis.
pub const CLIP: f64 = 2.0;

const ORANGE: RGBColor = RGBColor(230, 140, 0);
const PALETTE: [RGBColor; 7] = [
    RGBColor(120, 120, 120),
    RGBColor(0, 90, 200),
    RGBColor(200, 30, 30),
    RGBColor(0, 150, 70),
    RGBColor(150, 60, 170),
    RGBColor(230, 140, 0),
    RGBColor(0, 170, 190),
];

fn chart_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Chart {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn clip(v: f64) -> f64 {
    if v.is_finite() {
        v.min(CLIP)
    } else {
        CLIP
    }
}

/// Max, p95, average and p5 utilization (5 s trailing means) per strategy.
pub fn quantiles(path: &Path, s: &ScenarioSummary) -> Result<(), SimError> {
    let n = s.results.len().max(1);
    let cols = if n <= 4 { 2 } else { 3 };
    let rows = n.div_ceil(cols);
    let (w, h) = (cols as u32 * 380, rows as u32 * 250 + 40);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let clipped = s
        .results
        .iter()
        .any(|r| r.metrics.series.max.iter().any(|v| *v > CLIP));
    let title = format!(
        "{}: load per endpoint (5 s means), max / p95 / avg / p5{}",
        s.scenario.title,
        if clipped { " (clipped at 2)" } else { "" }
    );
    let root = root
        .titled(&title, ("sans-serif", 18))
        .map_err(|e| chart_err(path, e))?;
    let cycles = s.scenario.cycles as f64;
    let top = s
        .results
        .iter()
        .flat_map(|r| r.metrics.series.max.iter().copied())
        .fold(1.0f64, f64::max)
        .min(CLIP)
        * 1.05;
    let panels = root.split_evenly((rows, cols));
    for (panel, r) in panels.iter().zip(&s.results) {
        let mut chart = ChartBuilder::on(panel)
            .caption(r.label(), ("sans-serif", 14))
            .margin(6)
            .x_label_area_size(24)
            .y_label_area_size(36)
            .build_cartesian_2d(0f64..cycles, 0f64..top)
            .map_err(|e| chart_err(path, e))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .x_labels(6)
            .y_labels(6)
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| chart_err(path, e))?;
        if s.scenario.disturbance > 0 {
            let x = f64::from(s.scenario.disturbance);
            chart
                .draw_series(LineSeries::new(
                    vec![(x, 0.0), (x, top)],
                    RGBColor(180, 180, 180).stroke_width(1),
                ))
                .map_err(|e| chart_err(path, e))?;
        }
        let m = &r.metrics.series;
        for (values, color, name) in [
            (&m.max, RED, "max"),
            (&m.p95, ORANGE, "p95"),
            (&m.avg, BLACK, "avg"),
            (&m.p5, BLUE, "p5"),
        ] {
            let pts: Vec<(f64, f64)> = values
                .iter()
                .enumerate()
                .map(|(c, v)| (c as f64 + 1.0, clip(*v)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(|e| chart_err(path, e))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(|e| chart_err(path, e))?;
    }
    root.present().map_err(|e| chart_err(path, e))
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

/// One labelled line of a [`LineChart`].
#[derive(Debug, Clone)]
pub struct Line {
    /// Legend text.
    pub label: String,
    /// (x, y) points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// Lines over time on one chart, each in its own colour, y clipped at [`CLIP`].
#[derive(Debug, Clone)]
pub struct LineChart<'a> {
    /// Title; "(clipped at 2)" is appended when a value was clipped.
    pub title: &'a str,
    /// X axis label.
    pub x_desc: &'a str,
    /// Y axis label.
    pub y_desc: &'a str,
    /// The x axis runs from 0 to this.
    pub x_max: f64,
    /// The y axis starts here; it ends just above the highest value (at least 1).
    pub y_floor: f64,
    /// The lines.
    pub lines: Vec<Line>,
    /// X positions of events, drawn as thin dark grey vertical lines.
    pub markers: Vec<f64>,
}

/// Draws `c` as a 760×380 SVG at `path`. Used by the simulator's charts and by the
/// physical lab's (`tests/src/lab`), so both look alike.
pub fn line_chart(path: &Path, c: &LineChart) -> Result<(), SimError> {
    let root = SVGBackend::new(path, (760, 380)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let ys = || c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let top = ys().fold(1.0f64, f64::max).min(CLIP) * 1.05;
    let title = if ys().any(|v| v > CLIP) {
        format!("{} (clipped at {CLIP})", c.title)
    } else {
        c.title.to_string()
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(&title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(44)
        .build_cartesian_2d(0f64..c.x_max, c.y_floor..top)
        .map_err(|e| chart_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc(c.x_desc)
        .y_desc(c.y_desc)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| chart_err(path, e))?;
    for x in &c.markers {
        chart
            .draw_series(LineSeries::new(
                vec![(*x, c.y_floor), (*x, top)],
                RGBColor(90, 90, 90).stroke_width(1),
            ))
            .map_err(|e| chart_err(path, e))?;
    }
    for (i, line) in c.lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = line.points.iter().map(|&(x, y)| (x, clip(y))).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| chart_err(path, e))?
            .label(line.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(|e| chart_err(path, e))?;
    root.present().map_err(|e| chart_err(path, e))
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
