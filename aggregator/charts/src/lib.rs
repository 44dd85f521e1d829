//! SVG charts in the style of Robinhood's quantile charts, drawn with plotters: lines
//! over time on one chart ([`line_chart_svg`]) and max / p95 / avg / p5 bands, one
//! panel each ([`quantile_chart_svg`]).
//!
//! The fleet simulator draws `docs/balance.md`'s charts with them and the aggregator's
//! dashboard its live ones, so both look alike. Every function returns the SVG text;
//! writing it somewhere is the caller's business. Labels are escaped by plotters' SVG
//! backend, so names taken from the network may go in titles and legends.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// Values above this are drawn at it, unless a chart says otherwise: a runaway queue
/// (load 40 and climbing) would otherwise flatten every other line into the axis.
pub const CLIP: f64 = 2.0;

const ORANGE: RGBColor = RGBColor(230, 140, 0);

/// The colours of successive lines.
pub const PALETTE: [RGBColor; 7] = [
    RGBColor(120, 120, 120),
    RGBColor(0, 90, 200),
    RGBColor(200, 30, 30),
    RGBColor(0, 150, 70),
    RGBColor(150, 60, 170),
    RGBColor(230, 140, 0),
    RGBColor(0, 170, 190),
];

/// Drawing failed: what the plotting library said.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ChartError(String);

fn err(e: impl std::fmt::Display) -> ChartError {
    ChartError(e.to_string())
}

/// `v`, drawn at `limit` when above it (or not a number).
fn clip_at(v: f64, limit: f64) -> f64 {
    if v.is_finite() {
        v.min(limit)
    } else {
        limit
    }
}

/// A chart's drawing area with its axes.
type Plot<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws `points`, clipped at `limit`, as a line in `color` with `label` in the legend.
fn series(
    chart: &mut Plot,
    points: &[(f64, f64)],
    limit: f64,
    color: RGBColor,
    label: &str,
) -> Result<(), ChartError> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .map(|&(x, y)| (x, clip_at(y, limit)))
        .collect();
    chart
        .draw_series(LineSeries::new(pts, color.stroke_width(2)))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color));
    Ok(())
}

/// Draws the legend of the series drawn so far at `position`, on a white background
/// of `opacity`.
fn legend<'a, 'b: 'a>(
    chart: &mut Plot<'a, 'b>,
    position: SeriesLabelPosition,
    opacity: f64,
) -> Result<(), ChartError> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(opacity))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(err)
}

/// One labelled line of a [`LineChart`].
#[derive(Debug, Clone)]
pub struct Line {
    /// Legend text.
    pub label: String,
    /// (x, y) points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// Lines over time on one chart, each in its own colour, y clipped at [`CLIP`] (or
/// [`Frame::clip`]).
#[derive(Debug, Clone)]
pub struct LineChart<'a> {
    /// Title; "(clipped at 2)" is appended when a value was clipped.
    pub title: &'a str,
    /// X axis label.
    pub x_desc: &'a str,
    /// Y axis label.
    pub y_desc: &'a str,
    /// The x axis runs from [`Frame::x_min`] (0 by default) to this.
    pub x_max: f64,
    /// The y axis starts here; it ends just above the highest value (at least 1).
    pub y_floor: f64,
    /// The lines.
    pub lines: Vec<Line>,
    /// X positions of events, drawn as thin dark grey vertical lines.
    pub markers: Vec<f64>,
}

/// How a [`LineChart`] is framed: its size, where its x axis starts and where its
/// values are clipped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Frame {
    /// Width and height in pixels.
    pub size: (u32, u32),
    /// Where the x axis starts.
    pub x_min: f64,
    /// Values above this are drawn at it.
    pub clip: f64,
    /// Label the x axis with whole numbers ("-60", not "-60.0").
    pub whole_x_labels: bool,
}

impl Default for Frame {
    /// 760×380, from x = 0, clipped at [`CLIP`]: the report's charts.
    fn default() -> Self {
        Frame {
            size: (760, 380),
            x_min: 0.0,
            clip: CLIP,
            whole_x_labels: false,
        }
    }
}

/// `c` as an SVG document, framed by `frame`.
pub fn line_chart_svg(c: &LineChart, frame: Frame) -> Result<String, ChartError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, frame.size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let ys = || c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
        let limit = frame.clip;
        let top = ys().fold(1.0f64, f64::max).min(limit) * 1.05;
        let title = if ys().any(|v| v > limit) {
            format!("{} (clipped at {limit})", c.title)
        } else {
            c.title.to_string()
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(&title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(44)
            .build_cartesian_2d(frame.x_min..c.x_max, c.y_floor..top)
            .map_err(err)?;
        let whole = |x: &f64| format!("{x:.0}");
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(c.x_desc)
            .y_desc(c.y_desc)
            .light_line_style(WHITE);
        if frame.whole_x_labels {
            mesh.x_label_formatter(&whole);
        }
        mesh.draw().map_err(err)?;
        for x in &c.markers {
            chart
                .draw_series(LineSeries::new(
                    vec![(*x, c.y_floor), (*x, top)],
                    RGBColor(90, 90, 90).stroke_width(1),
                ))
                .map_err(err)?;
        }
        for (i, line) in c.lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            series(&mut chart, &line.points, limit, color, &line.label)?;
        }
        if !c.lines.is_empty() {
            legend(&mut chart, SeriesLabelPosition::UpperRight, 0.85)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// One panel of a [`QuantileChart`]: the max, p95, average and p5 of a load over time,
/// each as (x, y) points in x order.
#[derive(Debug, Clone, Default)]
pub struct Quantiles {
    /// The panel's caption.
    pub caption: String,
    /// The highest value.
    pub max: Vec<(f64, f64)>,
    /// The 95th percentile.
    pub p95: Vec<(f64, f64)>,
    /// The mean.
    pub avg: Vec<(f64, f64)>,
    /// The 5th percentile.
    pub p5: Vec<(f64, f64)>,
}

/// Quantile panels side by side (two or three columns by default), on one shared y axis that is
/// clipped at [`CLIP`].
#[derive(Debug, Clone)]
pub struct QuantileChart<'a> {
    /// Title; "(clipped at 2)" is appended when a value was clipped.
    pub title: &'a str,
    /// X axis label.
    pub x_desc: &'a str,
    /// The x axis runs from `x_min` to `x_max`.
    pub x_min: f64,
    /// See `x_min`.
    pub x_max: f64,
    /// The x position of an event, drawn as a thin light grey vertical line.
    pub marker: Option<f64>,
    /// The panels.
    pub panels: Vec<Quantiles>,
    /// Each panel's width and height in pixels.
    pub panel_size: (u32, u32),
    /// Panels per row; by default two up to four panels, three beyond.
    pub columns: Option<usize>,
    /// Label the x axis with whole numbers ("-60", not "-60.0").
    pub whole_x_labels: bool,
}

/// `c` as an SVG document.
pub fn quantile_chart_svg(c: &QuantileChart) -> Result<String, ChartError> {
    let n = c.panels.len().max(1);
    let cols = c.columns.unwrap_or(if n <= 4 { 2 } else { 3 }).max(1);
    let rows = n.div_ceil(cols);
    let (pw, ph) = c.panel_size;
    let size = (cols as u32 * pw, rows as u32 * ph + 40);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let highest = || c.panels.iter().flat_map(|p| p.max.iter().map(|v| v.1));
        let clipped = highest().any(|v| v > CLIP);
        let title = format!(
            "{}{}",
            c.title,
            if clipped { " (clipped at 2)" } else { "" }
        );
        let root = root.titled(&title, ("sans-serif", 18)).map_err(err)?;
        let top = highest().fold(1.0f64, f64::max).min(CLIP) * 1.05;
        let areas = root.split_evenly((rows, cols));
        for (area, p) in areas.iter().zip(&c.panels) {
            let mut chart = ChartBuilder::on(area)
                .caption(&p.caption, ("sans-serif", 14))
                .margin(6)
                .x_label_area_size(24)
                .y_label_area_size(36)
                .build_cartesian_2d(c.x_min..c.x_max, 0f64..top)
                .map_err(err)?;
            let whole = |x: &f64| format!("{x:.0}");
            let mut mesh = chart.configure_mesh();
            mesh.x_desc(c.x_desc)
                .x_labels(6)
                .y_labels(6)
                .light_line_style(WHITE);
            if c.whole_x_labels {
                mesh.x_label_formatter(&whole);
            }
            mesh.draw().map_err(err)?;
            if let Some(x) = c.marker {
                chart
                    .draw_series(LineSeries::new(
                        vec![(x, 0.0), (x, top)],
                        RGBColor(180, 180, 180).stroke_width(1),
                    ))
                    .map_err(err)?;
            }
            for (values, color, name) in [
                (&p.max, RED, "max"),
                (&p.p95, ORANGE, "p95"),
                (&p.avg, BLACK, "avg"),
                (&p.p5, BLUE, "p5"),
            ] {
                series(&mut chart, values, CLIP, color, name)?;
            }
            legend(&mut chart, SeriesLabelPosition::LowerRight, 0.8)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_labels_are_escaped() {
        let svg = line_chart_svg(
            &LineChart {
                title: "<script>alert(1)</script>",
                x_desc: "s",
                y_desc: "load",
                x_max: 10.0,
                y_floor: 0.0,
                lines: vec![Line {
                    label: "a\"><img src=x>".to_string(),
                    points: vec![(0.0, 0.5), (10.0, 3.0)],
                }],
                markers: vec![5.0],
            },
            Frame::default(),
        )
        .expect("draws");
        assert!(!svg.contains("<script>") && !svg.contains("<img"), "{svg}");
        assert!(svg.contains("clipped at 2"));
    }

    #[test]
    fn quantile_panels_draw_with_and_without_data() {
        let band = Quantiles {
            caption: "pid".to_string(),
            max: vec![(1.0, 1.2), (2.0, 1.1)],
            p95: vec![(1.0, 1.1), (2.0, 1.05)],
            avg: vec![(1.0, 1.0), (2.0, 1.0)],
            p5: vec![(1.0, 0.9), (2.0, 0.95)],
        };
        for panels in [vec![], vec![band.clone()], vec![band; 5]] {
            let svg = quantile_chart_svg(&QuantileChart {
                title: "t",
                x_desc: "seconds",
                x_min: 0.0,
                x_max: 2.0,
                marker: Some(1.0),
                panels,
                panel_size: (380, 250),
                columns: None,
                whole_x_labels: true,
            })
            .expect("draws");
            assert!(svg.starts_with("<svg"), "{svg}");
        }
    }
}
