//! The service page's charts, drawn server-side as SVG with the simulator's chart code
//! ([`ballast_charts`]). Time runs along x in seconds before now.

use super::history::Tracked;
use ballast_balance::{Millis, PublishedService};
use ballast_charts::{ChartError, Frame, Line, LineChart, QuantileChart, Quantiles};

/// Width and height of the dashboard's charts.
pub(crate) const SIZE: (u32, u32) = (600, 320);
/// The x axis covers at least this much, in seconds, so that a young history does
/// not stretch across the chart.
const MIN_WINDOW_S: f64 = 60.0;
/// Weights above this are drawn at it.
const WEIGHT_CLIP: f64 = 3.0;
/// Longest legend label, in characters.
const LABEL_CHARS: usize = 28;

/// Which chart of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chart {
    /// Max/avg and p95/avg over the core's history.
    Spread,
    /// Max, p95, average and p5 load over the core's history.
    Quantiles,
    /// Each charted endpoint's load.
    Load,
    /// Each charted endpoint's weight.
    Weight,
}

impl Chart {
    /// Every chart, in page order.
    pub(crate) const ALL: [Chart; 4] =
        [Chart::Spread, Chart::Quantiles, Chart::Load, Chart::Weight];

    /// The chart's file name under `/ui/services/{name}/charts/`.
    pub(crate) fn file(self) -> &'static str {
        match self {
            Chart::Spread => "spread.svg",
            Chart::Quantiles => "quantiles.svg",
            Chart::Load => "load.svg",
            Chart::Weight => "weight.svg",
        }
    }

    /// The chart named `file`.
    pub(crate) fn of_file(file: &str) -> Option<Chart> {
        Chart::ALL.into_iter().find(|c| c.file() == file)
    }

    /// What it shows, for its `alt` text and heading.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Chart::Spread => "Max/avg and p95/avg load",
            Chart::Quantiles => "Load quantiles: max, p95, average, p5",
            Chart::Load => "Load per endpoint",
            Chart::Weight => "Weight per endpoint",
        }
    }

    /// Draws the chart of `svc` at `now`; `tracked` is its per-endpoint history.
    pub(crate) fn draw(
        self,
        svc: &PublishedService,
        tracked: &Tracked,
        now: Millis,
    ) -> Result<String, ChartError> {
        let ago = |at: Millis| -(now.saturating_sub(at) as f64 / 1000.0);
        match self {
            Chart::Spread => {
                let pick = |f: fn(&ballast_balance::service::HistoryPoint) -> f64| {
                    svc.history
                        .iter()
                        .map(|p| (ago(p.at), f(p)))
                        .collect::<Vec<_>>()
                };
                let lines = vec![
                    Line {
                        label: "max / avg".to_string(),
                        points: pick(|p| p.spread.max_over_avg),
                    },
                    Line {
                        label: "p95 / avg".to_string(),
                        points: pick(|p| p.spread.p95_over_avg),
                    },
                ];
                let low = lines
                    .iter()
                    .flat_map(|l| l.points.iter().map(|p| p.1))
                    .filter(|v| v.is_finite())
                    .fold(1.0f64, f64::min);
                let markers = svc
                    .history
                    .iter()
                    .filter(|p| p.skipped)
                    .map(|p| ago(p.at))
                    .take(200)
                    .collect();
                let chart = LineChart {
                    title: "Max/avg and p95/avg (grey lines: skipped cycles)",
                    x_desc: "seconds ago",
                    y_desc: "ratio to the average",
                    x_max: 0.0,
                    y_floor: ((low - 0.1) * 10.0).floor().max(0.0) / 10.0,
                    lines,
                    markers,
                };
                ballast_charts::line_chart_svg(
                    &chart,
                    frame(
                        window(svc.history.first().map(|p| p.at), now),
                        ballast_charts::CLIP,
                    ),
                )
            }
            Chart::Quantiles => {
                let band = |f: fn(&ballast_balance::Spread) -> f64| {
                    svc.history
                        .iter()
                        .map(|p| (ago(p.at), f(&p.spread)))
                        .collect::<Vec<_>>()
                };
                let panel = Quantiles {
                    caption: "load of the fresh serving endpoints".to_string(),
                    max: band(|s| s.max),
                    p95: band(|s| s.p95_over_avg * s.avg),
                    avg: band(|s| s.avg),
                    p5: band(|s| s.p5_over_avg * s.avg),
                };
                let x_min = window(svc.history.first().map(|p| p.at), now);
                ballast_charts::quantile_chart_svg(&QuantileChart {
                    title: "Load: max / p95 / avg / p5",
                    x_desc: "seconds ago",
                    x_min,
                    x_max: 0.0,
                    marker: None,
                    panels: vec![panel],
                    panel_size: (SIZE.0, SIZE.1 - 40),
                    columns: Some(1),
                    whole_x_labels: true,
                })
            }
            Chart::Load | Chart::Weight => {
                let weight = self == Chart::Weight;
                let lines = tracked
                    .endpoints
                    .iter()
                    .map(|(node, points)| Line {
                        label: label(node),
                        points: points
                            .iter()
                            .map(|p| (ago(p.at), f64::from(if weight { p.weight } else { p.load })))
                            .collect(),
                    })
                    .collect();
                let shown = if tracked.total > tracked.endpoints.len() {
                    format!(
                        " ({} of {} endpoints)",
                        tracked.endpoints.len(),
                        tracked.total
                    )
                } else {
                    String::new()
                };
                let title = format!("{}{shown}", self.describe());
                let oldest = tracked
                    .endpoints
                    .iter()
                    .filter_map(|(_, p)| p.first().map(|p| p.at))
                    .min();
                let chart = LineChart {
                    title: &title,
                    x_desc: "seconds ago",
                    y_desc: if weight { "weight (mean 1)" } else { "load" },
                    x_max: 0.0,
                    y_floor: 0.0,
                    lines,
                    markers: Vec::new(),
                };
                let clip = if weight {
                    WEIGHT_CLIP
                } else {
                    ballast_charts::CLIP
                };
                ballast_charts::line_chart_svg(&chart, frame(window(oldest, now), clip))
            }
        }
    }
}

/// Where the x axis starts: the oldest point's age, at least [`MIN_WINDOW_S`].
fn window(oldest: Option<Millis>, now: Millis) -> f64 {
    let age = oldest.map_or(0.0, |at| now.saturating_sub(at) as f64 / 1000.0);
    -age.max(MIN_WINDOW_S).ceil()
}

fn frame(x_min: f64, clip: f64) -> Frame {
    Frame {
        size: SIZE,
        x_min,
        clip,
        whole_x_labels: true,
    }
}

/// A node name fit for a legend: control characters replaced, at most
/// [`LABEL_CHARS`] characters. (The SVG backend escapes markup.)
pub(crate) fn label(name: &str) -> String {
    let mut out: String = name
        .chars()
        .take(LABEL_CHARS)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if name.chars().count() > LABEL_CHARS {
        out.push('…');
    }
    out
}
