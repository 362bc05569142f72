//! Plots of a metrics file: the key training curves against `step`, one small panel each,
//! written as PNG or SVG (`ares-runner plot metrics.jsonl -o plot.png`).
//!
//! Default panels, in order and only those present: `reward/mean`, `accuracy/mean`,
//! `response_length/mean`, `entropy/mean`, `hwe/count_mean`, `tau`, `kl/mean`,
//! `actor/pg_loss`, `actor/grad_norm`, `actor/clipfrac`, then `alpha`, `target` and `lambda`
//! with one curve per difficulty bucket (easy, medium, hard), then every `eval/accuracy/*` in
//! one panel. A `null` value leaves a gap; a record without the key adds no point (so a curve
//! evaluated every 10 steps is drawn through its own points).

mod axis;
mod draw;
mod font;
mod panels;

use std::fs;
use std::path::{Path, PathBuf};

use plotters::backend::{BitMapBackend, RGBPixel, SVGBackend};
use plotters::prelude::IntoDrawingArea;
use thiserror::Error;

use crate::metrics::{MetricsError, NumberedRecord, read_numbered};

/// Width in pixels of one panel.
pub const PANEL_WIDTH: u32 = 400;
/// Height in pixels of one panel.
pub const PANEL_HEIGHT: u32 = 280;
/// Most panels one plot draws (64 panels make a 1600 × 4480 image).
pub const MAX_PANELS: usize = 64;

/// What went wrong making a plot; names the file, line and key at fault.
#[derive(Debug, Error)]
pub enum PlotError {
    /// The metrics file could not be read or has a malformed line.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The output name ends in something other than `.png` or `.svg`.
    #[error("plot output {}: unknown format {extension:?}; the name must end in .png or .svg", path.display())]
    Extension {
        /// The output path.
        path: PathBuf,
        /// Its extension ("" when it has none).
        extension: String,
    },
    /// A key to plot is empty (or a bare `*`).
    #[error("a key to plot is empty; give names like reward/mean, or prefixes like alpha/*")]
    EmptyKey,
    /// None of the keys to plot has a number in the file.
    #[error("metrics file {}: nothing to plot; looked for {wanted}; {present}", path.display())]
    NothingToPlot {
        /// The metrics file.
        path: PathBuf,
        /// The keys looked for.
        wanted: String,
        /// The keys the file has (or "the file has no records").
        present: String,
    },
    /// A plotted key holds something other than a number or `null`.
    #[error("metrics file {}, line {line}: {key:?} is {found}, expected a number or null", path.display())]
    NotANumber {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// The key.
        key: String,
        /// The value found, as JSON.
        found: String,
    },
    /// A record with a plotted key has no numeric `step`.
    #[error("metrics file {}, line {line}: \"step\" is {found}, expected a number", path.display())]
    BadStep {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// The value found, as JSON, or "missing".
        found: String,
    },
    /// More panels than [`MAX_PANELS`].
    #[error("{count} panels to plot, at most {MAX_PANELS}; give fewer keys")]
    TooManyPanels {
        /// Panels that had data.
        count: usize,
    },
    /// The embedded font could not be loaded (a broken build).
    #[error("the embedded plot font (DejaVu Sans) could not be loaded")]
    Font,
    /// plotters or the PNG encoder failed.
    #[error("drawing plot {}: {message}", path.display())]
    Draw {
        /// The output path.
        path: PathBuf,
        /// The underlying error.
        message: String,
    },
    /// The plot file could not be written.
    #[error("cannot write plot {}: {source}", path.display())]
    Io {
        /// The output path (or its temporary neighbour).
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

/// What [`plot_metrics`] drew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotSummary {
    /// Panel captions, in drawing order (row by row).
    pub panels: Vec<String>,
    /// Requested keys that had no value in the file (empty when drawing the default
    /// panels, of which only those present are drawn).
    pub skipped: Vec<String>,
    /// Image width in pixels (`cols × PANEL_WIDTH`).
    pub width: u32,
    /// Image height in pixels (`rows × PANEL_HEIGHT`).
    pub height: u32,
}

/// Draws the curves of the JSON-lines metrics file `metrics_path` into `out` (PNG when it
/// ends in `.png`, SVG when `.svg`, any case), creating `out`'s directory if needed. The file
/// is written through a temporary neighbour and a rename, so `out` is never half-written.
///
/// `keys`: `None` (or an empty list) draws the default panels (module docs); otherwise one
/// panel per key, a key ending in `*` putting all keys with that prefix in one panel
/// (`alpha/*`). Keys without values are skipped and listed in [`PlotSummary::skipped`]; when
/// nothing is left the error lists the keys the file has.
///
/// Panels are laid out `cols` wide (1–3 panels: one row; 4: 2 × 2; 5–9: 3 wide; more: 4
/// wide), all sharing one step axis.
pub fn plot_metrics(
    metrics_path: &Path,
    out: &Path,
    keys: Option<&[String]>,
) -> Result<PlotSummary, PlotError> {
    let format = Format::of(out)?;
    let user_keys = keys.filter(|k| !k.is_empty());
    let specs = match user_keys {
        Some(keys) => panels::user_specs(keys)?,
        None => panels::default_specs(),
    };
    let records = read_numbered(metrics_path)?;
    let (panels, skipped) = panels::build(&specs, &records, metrics_path)?;
    if panels.is_empty() {
        return Err(nothing_to_plot(metrics_path, &specs, &records));
    }
    if panels.len() > MAX_PANELS {
        return Err(PlotError::TooManyPanels {
            count: panels.len(),
        });
    }
    let (rows, cols) = grid(panels.len());
    // At most 16 rows × 4 columns: the products fit u32 easily.
    let (width, height) = (cols as u32 * PANEL_WIDTH, rows as u32 * PANEL_HEIGHT);
    let (x_lo, x_hi) = panels
        .iter()
        .filter_map(panels::Panel::step_bounds)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (l, h)| {
            (lo.min(l), hi.max(h))
        });
    let x = axis::step_range(x_lo, x_hi);
    if !font::ensure_registered() {
        return Err(PlotError::Font);
    }
    let draw_err = |message: String| PlotError::Draw {
        path: out.to_path_buf(),
        message,
    };
    let bytes = match format {
        Format::Png => {
            let mut rgb = vec![0u8; width as usize * height as usize * 3];
            {
                let backend =
                    BitMapBackend::<RGBPixel>::with_buffer_and_format(&mut rgb, (width, height))
                        .map_err(|e| draw_err(e.to_string()))?;
                let root = backend.into_drawing_area();
                draw::draw_grid(&root, &panels, (rows, cols), x)
                    .map_err(|e| draw_err(e.to_string()))?;
            }
            encode_png(&rgb, width, height).map_err(|e| draw_err(e.to_string()))?
        }
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
                draw::draw_grid(&root, &panels, (rows, cols), x)
                    .map_err(|e| draw_err(e.to_string()))?;
            }
            svg.into_bytes()
        }
    };
    write_atomic(out, &bytes)?;
    Ok(PlotSummary {
        panels: panels.into_iter().map(|p| p.title).collect(),
        skipped: if user_keys.is_some() {
            skipped
        } else {
            Vec::new()
        },
        width,
        height,
    })
}

/// Output format, from the file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Png,
    Svg,
}

impl Format {
    fn of(path: &Path) -> Result<Self, PlotError> {
        let extension = path
            .extension()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        match extension.to_ascii_lowercase().as_str() {
            "png" => Ok(Format::Png),
            "svg" => Ok(Format::Svg),
            _ => Err(PlotError::Extension {
                path: path.to_path_buf(),
                extension,
            }),
        }
    }
}

/// `(rows, cols)` for `n ≥ 1` panels.
fn grid(n: usize) -> (usize, usize) {
    let cols = match n {
        0..=3 => n.max(1),
        4 => 2,
        5..=9 => 3,
        _ => 4,
    };
    (n.div_ceil(cols), cols)
}

/// An 8-bit RGB PNG of the `width × height` pixels in `rgb`.
fn encode_png(rgb: &[u8], width: u32, height: u32) -> Result<Vec<u8>, png::EncodingError> {
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(bytes)
}

/// Writes `bytes` to `<out>.tmp`, then renames it onto `out`.
fn write_atomic(out: &Path, bytes: &[u8]) -> Result<(), PlotError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PlotError::Io { path, source }
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut name = out
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".tmp");
    let tmp = out.with_file_name(name);
    fs::write(&tmp, bytes).map_err(io(&tmp))?;
    fs::rename(&tmp, out).map_err(io(out))
}

/// The error for a file without any plottable key: what was looked for, what is there.
fn nothing_to_plot(path: &Path, specs: &[panels::Spec], records: &[NumberedRecord]) -> PlotError {
    let wanted = specs
        .iter()
        .map(panels::Spec::describe)
        .collect::<Vec<_>>()
        .join(", ");
    let keys = panels::present_keys(records);
    const SHOWN: usize = 30;
    let present = if records.is_empty() {
        "the file has no records".to_string()
    } else if keys.len() > SHOWN {
        format!(
            "the file has {}, ... ({} more)",
            keys[..SHOWN].join(", "),
            keys.len() - SHOWN
        )
    } else {
        format!(
            "the file has {} (with values null or absent)",
            keys.join(", ")
        )
    };
    PlotError::NothingToPlot {
        path: path.to_path_buf(),
        wanted,
        present,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_shapes() {
        assert_eq!(grid(1), (1, 1));
        assert_eq!(grid(3), (1, 3));
        assert_eq!(grid(4), (2, 2));
        assert_eq!(grid(5), (2, 3));
        assert_eq!(grid(9), (3, 3));
        assert_eq!(grid(10), (3, 4));
        assert_eq!(grid(14), (4, 4));
        assert_eq!(grid(MAX_PANELS), (16, 4));
    }

    #[test]
    fn format_from_extension() {
        assert_eq!(Format::of(Path::new("a/b.png")).ok(), Some(Format::Png));
        assert_eq!(Format::of(Path::new("b.SVG")).ok(), Some(Format::Svg));
        let err = Format::of(Path::new("plot.jpg")).unwrap_err();
        assert!(err.to_string().contains("\"jpg\""), "{err}");
        assert!(Format::of(Path::new("plot")).is_err());
    }
}
