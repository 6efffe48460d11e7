//! The handoff-gap histogram (SVG): one panel per contended scenario, one step line per
//! driver, log-spaced bins.

use std::path::Path;

use plotters::prelude::*;

use crate::stats::Sorted;
use crate::BenchError;

/// Bins per decade of the log-spaced histogram, from 10 µs to 1 s.
const PER_DECADE: usize = 10;
const LO_US: f64 = 10.0;
const HI_US: f64 = 1_000_000.0;

/// One panel: a title and (driver, handoff samples) series.
pub(crate) struct Panel<'a> {
    pub(crate) title: String,
    pub(crate) series: Vec<(&'static str, &'a Sorted)>,
}

fn color(driver: &str) -> RGBColor {
    match driver {
        "dlock" => RGBColor(31, 119, 180),
        "rslock" => RGBColor(214, 39, 40),
        _ => RGBColor(90, 90, 90),
    }
}

/// Percent of samples per log-spaced bin, as (left edge, right edge, percent).
fn histogram(s: &Sorted) -> Vec<(f64, f64, f64)> {
    let decades = (HI_US / LO_US).log10().round() as usize;
    let bins = decades * PER_DECADE;
    let edge = |i: usize| LO_US * 10f64.powf(i as f64 / PER_DECADE as f64);
    let mut counts = vec![0usize; bins];
    for &ns in s.ns() {
        let x = (ns as f64 / 1e3).clamp(LO_US, HI_US * 0.999_999);
        let i = ((x / LO_US).log10() * PER_DECADE as f64).floor() as usize;
        counts[i.min(bins - 1)] += 1;
    }
    let n = s.len().max(1) as f64;
    (0..bins)
        .map(|i| (edge(i), edge(i + 1), 100.0 * counts[i] as f64 / n))
        .collect()
}

fn err(e: impl std::fmt::Display) -> BenchError {
    format!("plot: {e}").into()
}

/// Draws `panels` stacked vertically into an SVG at `path`.
pub(crate) fn handoff_svg(path: &Path, panels: &[Panel<'_>]) -> Result<(), BenchError> {
    let height = 360 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (960, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (area, panel) in areas.iter().zip(panels) {
        let hists: Vec<_> = panel
            .series
            .iter()
            .map(|(name, s)| (*name, histogram(s), *s))
            .collect();
        let ymax = hists
            .iter()
            .flat_map(|(_, h, _)| h.iter().map(|b| b.2))
            .fold(1.0f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 18))
            .margin(12)
            .margin_right(36)
            .x_label_area_size(42)
            .y_label_area_size(56)
            .build_cartesian_2d((LO_US..HI_US).log_scale(), 0.0..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("handoff gap: release called → next acquire returned (µs, log scale)")
            .y_desc("% of handoffs")
            .x_label_formatter(&|x| {
                if *x >= 1e6 {
                    format!("{} s", x / 1e6)
                } else if *x >= 1000.0 {
                    format!("{} ms", x / 1000.0)
                } else {
                    format!("{x} µs")
                }
            })
            .draw()
            .map_err(err)?;
        for (name, h, s) in hists {
            let c = color(name);
            let mut pts = vec![(LO_US, 0.0)];
            for (l, r, p) in h {
                pts.push((l, p));
                pts.push((r, p));
            }
            pts.push((HI_US, 0.0));
            let label = format!(
                "{name}: p50 {:.0} µs, p99 {:.0} µs (n = {})",
                s.median().as_secs_f64() * 1e6,
                s.pct(99.0).as_secs_f64() * 1e6,
                s.len()
            );
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
