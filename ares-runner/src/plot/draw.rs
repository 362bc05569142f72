//! Drawing the panels on any plotters backend (bitmap or SVG).

use plotters::coord::Shift;
use plotters::prelude::*;

use super::axis::{format_tick, value_range};
use super::font::FAMILY;
use super::panels::Panel;

/// Curve colours, in order (the "tab10" set: distinct and readable on white).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draws `panels` row by row in a `rows × cols` grid over the whole of `root`, all against
/// the same step range `x`, and presents the result.
pub(super) fn draw_grid<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    panels: &[Panel],
    (rows, cols): (usize, usize),
    x: (f64, f64),
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    for (panel, area) in panels.iter().zip(root.split_evenly((rows, cols)).iter()) {
        draw_panel(area, panel, x)?;
    }
    root.present()
}

/// One panel: caption, grid with tick labels, one line per curve (a dot for a point between
/// gaps), and a legend when there are several curves.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    (x0, x1): (f64, f64),
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    // Panels are built with at least one value; the fallback only keeps this total.
    let (lo, hi) = panel.value_bounds().unwrap_or((0.0, 0.0));
    let (y0, y1) = value_range(lo, hi);
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FAMILY, 20))
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let (x_span, y_span) = (x1 - x0, y1 - y0);
    let x_label = move |v: &f64| format_tick(*v, x_span);
    let y_label = move |v: &f64| format_tick(*v, y_span);
    chart
        .configure_mesh()
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&x_label)
        .y_label_formatter(&y_label)
        .label_style((FAMILY, 15))
        .light_line_style(RGBColor(238, 238, 238))
        .draw()?;

    // Only values beyond ±1e300 lie outside the axes (see `value_range`); they are drawn on
    // the edge, because plotters' pixel arithmetic overflows for points far outside.
    let clamp = |(x, y): (f64, f64)| (x.clamp(x0, x1), y.clamp(y0, y1));
    let legend = panel.series.len() > 1;
    for (i, series) in panel.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let line = color.stroke_width(2);
        for mut segment in series.segments() {
            segment.iter_mut().for_each(|p| *p = clamp(*p));
            match segment.as_slice() {
                [point] => {
                    chart.draw_series(std::iter::once(Circle::new(*point, 3, color.filled())))?;
                }
                _ => {
                    chart.draw_series(LineSeries::new(segment, line))?;
                }
            }
        }
        if legend {
            // An empty series carries the legend entry, whatever the segments look like.
            chart
                .draw_series(LineSeries::new(Vec::<(f64, f64)>::new(), line))?
                .label(series.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], line));
        }
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.4))
            .draw()?;
    }
    Ok(())
}
