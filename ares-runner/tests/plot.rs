//! `plot_metrics` end to end: a metrics file written by `MetricsWriter` is drawn to PNG and
//! SVG; the PNG decodes to the promised size and has curves in the panel colours; bad inputs
//! are clear errors and write nothing.

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use ares_runner::metrics::{MetricsWriter, Record};
use ares_runner::plot::{PANEL_HEIGHT, PANEL_WIDTH, PlotError, plot_metrics};

/// Eight steps of a plausible run: reward up, length down, a NaN KL at step 3 (written as
/// null), constant τ, α per bucket, and one eval accuracy at step 8 only.
fn write_run(dir: &Path) -> PathBuf {
    let path = dir.join("metrics.jsonl");
    let mut writer = MetricsWriter::create(&path, false).unwrap();
    for step in 1..=8u64 {
        let s = step as f64;
        let mut r = Record::with_step(step);
        r.insert("reward/mean", 0.1 * s)
            .insert("response_length/mean", 400.0 - 20.0 * s)
            .insert("kl/mean", if step == 3 { f64::NAN } else { 0.001 * s })
            .insert("tau", 0.5)
            .insert("alpha/easy", 1.0 + 0.1 * s)
            .insert("alpha/medium", 1.0)
            .insert("alpha/hard", 1.0 - 0.05 * s);
        if step == 8 {
            r.insert("eval/accuracy/easy", 0.9);
        }
        writer.write(&r).unwrap();
    }
    path
}

/// (width, height, RGB bytes) of a PNG file.
fn decode_png(path: &Path) -> (u32, u32, Vec<u8>) {
    let bytes = fs::read(path).unwrap();
    let decoder = png::Decoder::new(Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

#[test]
fn default_panels_to_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = write_run(dir.path());

    let png_path = dir.path().join("out/plot.png");
    let summary = plot_metrics(&metrics, &png_path, None).unwrap();
    // Default order; absent defaults (accuracy, entropy, ...) are left out.
    assert_eq!(
        summary.panels,
        [
            "reward/mean",
            "response_length/mean",
            "tau",
            "kl/mean",
            "alpha",
            // One eval curve, so no legend: the caption is the whole key.
            "eval/accuracy/easy"
        ]
    );
    assert!(summary.skipped.is_empty());
    // 6 panels: 3 wide, 2 high.
    assert_eq!(
        (summary.width, summary.height),
        (3 * PANEL_WIDTH, 2 * PANEL_HEIGHT)
    );
    let (w, h, rgb) = decode_png(&png_path);
    assert_eq!((w, h), (1200, 560));
    // White background, black text/axes, and the first curve colour (31, 119, 180) drawn.
    let pixels: Vec<&[u8]> = rgb.chunks(3).collect();
    let count = |c: [u8; 3]| pixels.iter().filter(|p| **p == c).count();
    assert!(count([255, 255, 255]) > pixels.len() / 2);
    assert!(count([31, 119, 180]) > 100, "no curve pixels");
    assert!(
        pixels.iter().any(|p| p[0] < 80 && p[1] < 80 && p[2] < 80),
        "no text"
    );
    assert!(!png_path.with_file_name("plot.png.tmp").exists());

    let svg_path = dir.path().join("plot.svg");
    let summary = plot_metrics(&metrics, &svg_path, None).unwrap();
    let svg = fs::read_to_string(&svg_path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
    assert!(svg.contains(r#"width="1200""#) && svg.contains(r#"height="560""#));
    for title in &summary.panels {
        assert!(svg.contains(title.as_str()), "caption {title} missing");
    }
    // Legend labels of the grouped panel.
    for label in ["easy", "medium", "hard"] {
        assert!(
            svg.contains(&format!("\n{label}\n</text>")),
            "legend {label} missing"
        );
    }
}

#[test]
fn chosen_keys_prefixes_and_skips() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = write_run(dir.path());
    let keys: Vec<String> = ["tau", "alpha/*", "accuracy/mean"]
        .iter()
        .map(|k| k.to_string())
        .collect();
    let out = dir.path().join("chosen.PNG");
    let summary = plot_metrics(&metrics, &out, Some(&keys)).unwrap();
    assert_eq!(summary.panels, ["tau", "alpha"]);
    assert_eq!(summary.skipped, ["accuracy/mean"]);
    assert_eq!(
        (summary.width, summary.height),
        (2 * PANEL_WIDTH, PANEL_HEIGHT)
    );
    assert_eq!(decode_png(&out).0, 800);
}

#[test]
fn single_point_and_constant_series_draw() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    fs::write(&path, "{\"step\":5,\"reward/mean\":0.0,\"tau\":1e-320}\n").unwrap();
    let out = dir.path().join("p.png");
    let summary = plot_metrics(&path, &out, None).unwrap();
    assert_eq!(summary.panels, ["reward/mean", "tau"]);
    let (w, h, _) = decode_png(&out);
    assert_eq!((w, h), (2 * PANEL_WIDTH, PANEL_HEIGHT));
}

#[test]
fn huge_values_draw() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    fs::write(
        &path,
        "{\"step\":1,\"actor/grad_norm\":-1.7e308}\n{\"step\":2,\"actor/grad_norm\":1.7e308}\n",
    )
    .unwrap();
    plot_metrics(&path, &dir.path().join("p.svg"), None).unwrap();
}

#[test]
fn nothing_to_plot_lists_what_the_file_has() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    fs::write(&path, "{\"step\":1,\"loss\":0.5,\"reward/mean\":null}\n").unwrap();
    let out = dir.path().join("p.png");
    let err = plot_metrics(&path, &out, None).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, PlotError::NothingToPlot { .. }), "{text}");
    assert!(
        text.contains("reward/mean") && text.contains("loss"),
        "{text}"
    );
    assert!(!out.exists());

    fs::write(&path, "").unwrap();
    let err = plot_metrics(&path, &out, None).unwrap_err();
    assert!(err.to_string().contains("no records"), "{err}");
}

#[test]
fn bad_extension_is_named_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    // The metrics file does not even exist: the output name is checked first.
    let err = plot_metrics(
        &dir.path().join("absent.jsonl"),
        &dir.path().join("p.jpeg"),
        None,
    )
    .unwrap_err();
    assert!(matches!(err, PlotError::Extension { .. }), "{err}");
    assert!(err.to_string().contains("\"jpeg\""), "{err}");
}

#[test]
fn malformed_metrics_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    fs::write(&path, "{\"step\":1,\"tau\":1}\n{\"step\":2,\"tau\":}\n").unwrap();
    let err = plot_metrics(&path, &dir.path().join("p.svg"), None).unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
}
