//! The Qwen2-VL image / video processor against transformers 5.24 (torchvision backend).
//!
//! Fixtures: `scripts/make_vision_fixtures.py` (run with transformers 5.24, torch 2.15,
//! torchvision 0.29) writes small synthetic PNG images and frame directories into
//! `tests/fixtures/vision/`, transformers' `pixel_values` / `image_grid_thw` /
//! `pixel_values_videos` / `video_grid_thw` into `processor.safetensors`, and PIL's decoding of a
//! JPEG and a lossless WebP.
//!
//! Measured (all fixtures, transformers 5.24.0, torch 2.15.0, torchvision 0.29.2, AVX-512 CPU):
//! the resize is bit-faithful to torchvision's `uint8` bicubic antialias path — every resized
//! pixel equal — so `pixel_values` and `pixel_values_videos` equal transformers' exactly
//! (max |Δ| = 0 on all 6 images and both videos; asserted as ≤ [`PIXEL_TOL`] = 1e-6), and every
//! grid is equal. Decoding: PNG and lossless WebP equal PIL's; JPEG (the `image` crate's
//! zune-jpeg vs PIL's libjpeg-turbo) differs by at most 6 levels, mean 0.41, with 4:2:0 chroma
//! (the upsampling of the halved chroma planes differs) and at most 2 levels, mean 0.03, with
//! 4:4:4 ([`JPEG_420_LEVELS`], [`JPEG_444_LEVELS`]); these differences then pass through the
//! resize and normalisation (1 level = 1/(255·std) ≈ 0.015 in `pixel_values`).

use std::path::{Path, PathBuf};

use ares_model::vision::processor::{
    ProcessorConfig, RgbImage, VideoSampling, VisionError, decode_rgb, load_rgb, process_image,
    process_image_file, process_video_files, process_video_frames, sample_frame_indices,
    smart_resize,
};
use ares_model::vision::video::process_video_path;
use safetensors::SafeTensors;
use serde_json::Value;

/// Largest |Δ| allowed between our `pixel_values` and transformers' (measured: 0).
const PIXEL_TOL: f32 = 1e-6;
/// Largest per-sample difference between our decoding of a 4:2:0 JPEG and PIL's (measured).
const JPEG_420_LEVELS: u8 = 6;
/// The same for a 4:4:4 JPEG (measured).
const JPEG_444_LEVELS: u8 = 2;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision")
}

struct Fixture {
    bytes: Vec<u8>,
    meta: Value,
}

impl Fixture {
    fn load() -> Self {
        let dir = fixture_dir();
        let bytes =
            std::fs::read(dir.join("processor.safetensors")).expect("processor.safetensors");
        let meta =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        Fixture { bytes, meta }
    }

    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        let v = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (t.shape().to_vec(), v)
    }

    fn grid(&self, name: &str) -> [usize; 3] {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::I64);
        let v: Vec<usize> = t
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        assert_eq!(v.len(), 3, "{name}: one grid");
        [v[0], v[1], v[2]]
    }

    fn u8s(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::U8);
        (t.shape().to_vec(), t.data().to_vec())
    }

    fn pixels(&self, key: &str) -> usize {
        self.meta[key].as_u64().unwrap() as usize
    }

    fn image_cfg(&self) -> ProcessorConfig {
        ProcessorConfig::default()
            .with_pixels(
                Some(self.pixels("min_pixels")),
                Some(self.pixels("max_pixels")),
            )
            .unwrap()
            .with_video_pixels(
                Some(self.pixels("video_min_pixels")),
                Some(self.pixels("video_max_pixels")),
            )
            .unwrap()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fixture_was_made_with_the_torchvision_backend() {
    let fx = Fixture::load();
    assert_eq!(fx.meta["image_processor_backend"], "TorchvisionBackend");
    assert_eq!(fx.meta["transformers"], "5.24.0");
}

#[test]
fn smart_resize_hand_checked() {
    let big = 12_845_056;
    // Round half to even: 126/28 = 4.5 -> 4, 70/28 = 2.5 -> 2.
    assert_eq!(smart_resize(126, 70, 28, 3136, big).unwrap(), (112, 56));
    // 1.5 -> 2, 2.5 -> 2, 3.5 -> 4.
    assert_eq!(smart_resize(42, 70, 28, 784, big).unwrap(), (56, 56));
    assert_eq!(smart_resize(98, 98, 28, 784, big).unwrap(), (112, 112));
    // Already multiples: unchanged.
    assert_eq!(smart_resize(56, 56, 28, 3136, big).unwrap(), (56, 56));
    // Above max_pixels 6272: beta = sqrt(29100 / 6272) = 2.154; 300/2.154/28 = 4.97 -> 4,
    // 97/2.154/28 = 1.61 -> 1.
    assert_eq!(smart_resize(300, 97, 28, 3136, 6272).unwrap(), (112, 28));
    // Above max_pixels with the max(factor, .) clamp: 20x400 -> 28x336 (area 9408 > 6272).
    assert_eq!(smart_resize(20, 400, 28, 3136, 6272).unwrap(), (28, 336));
    // Below min_pixels: beta = sqrt(3136 / 1200) = 1.617; ceil(30*1.617/28) = 2, ceil(40*1.617/28) = 3.
    assert_eq!(smart_resize(30, 40, 28, 3136, 6272).unwrap(), (56, 84));
    // Tiny images are scaled up (transformers 5.x no longer rejects them).
    assert_eq!(smart_resize(1, 1, 28, 3136, 6272).unwrap(), (56, 56));
    // Scaling up ignores max_pixels: 1x200 -> 28x812 (transformers gives grid 2x58).
    assert_eq!(smart_resize(1, 200, 28, 3136, 6272).unwrap(), (28, 812));
    // Qwen2.5-VL defaults on a 1080p frame: 1078x1918 -> rounds to 38.5 -> 38, 68.5 -> 68.
    assert_eq!(
        smart_resize(1080, 1920, 28, 3136, big).unwrap(),
        (1092, 1932)
    );
    assert_eq!(
        smart_resize(1078, 1918, 28, 3136, big).unwrap(),
        (1064, 1904)
    );
}

#[test]
fn smart_resize_errors_instead_of_panicking() {
    for (h, w) in [(1, 201), (300, 1), (0, 10), (10, 0)] {
        let e = smart_resize(h, w, 28, 3136, 6272).unwrap_err();
        assert!(matches!(e, VisionError::ImageSize { .. }), "{h}x{w}: {e}");
    }
    assert!(
        smart_resize(1, 200, 28, 3136, 6272).is_ok(),
        "200 exactly is allowed"
    );
    assert!(smart_resize(10, 10, 0, 3136, 6272).is_err());
    let msg = smart_resize(1, 201, 28, 3136, 6272)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("aspect ratio") && msg.contains("200"), "{msg}");
}

#[test]
fn images_match_transformers() {
    let fx = Fixture::load();
    let cfg = fx.image_cfg();
    let images = fx.meta["images"].as_object().unwrap();
    let mut n = 0;
    for (name, info) in images {
        let key = format!("image.{name}.pixel_values");
        if !fx.bytes.windows(key.len()).any(|w| w == key.as_bytes()) {
            continue; // decoding-only fixtures
        }
        let file = fixture_dir().join(info["file"].as_str().unwrap());
        let out = process_image_file(&file, &cfg).unwrap();
        let grid = fx.grid(&format!("image.{name}.grid_thw"));
        assert_eq!(out.grid_thw, grid, "{name}: grid");
        let (shape, want) = fx.f32s(&key);
        assert_eq!(
            shape,
            vec![out.n_patches(), cfg.patch_dim()],
            "{name}: shape"
        );
        let d = max_abs_diff(&out.pixel_values, &want);
        eprintln!("{name}: grid {grid:?}, max |Δ pixel_values| = {d:e}");
        assert!(d <= PIXEL_TOL, "{name}: max |Δ| {d:e} > {PIXEL_TOL:e}");
        n += 1;
    }
    assert_eq!(n, 6);
}

#[test]
fn decoding_matches_pil() {
    let fx = Fixture::load();
    for (name, ext, levels) in [
        ("photo_40x48", "jpg", JPEG_420_LEVELS),
        ("photo444_40x48", "jpg", JPEG_444_LEVELS),
        ("lossless_36x44", "webp", 0),
    ] {
        let img = load_rgb(&fixture_dir().join(format!("{name}.{ext}"))).unwrap();
        let (shape, want) = fx.u8s(&format!("decoded.{name}"));
        assert_eq!(shape, vec![img.height, img.width, 3], "{name}");
        let diffs: Vec<u8> = img
            .pixels
            .iter()
            .zip(&want)
            .map(|(a, b)| a.abs_diff(*b))
            .collect();
        let d = diffs.iter().copied().max().unwrap();
        let mean = diffs.iter().map(|&x| f64::from(x)).sum::<f64>() / diffs.len() as f64;
        eprintln!("{name}: vs PIL max |Δ| = {d} level(s), mean {mean:.3}");
        assert!(d <= levels, "{name}: {d} levels > {levels}");
    }
    // Grey and RGBA PNGs: PIL's convert("RGB") (grey replicated, alpha dropped).
    let grey = load_rgb(&fixture_dir().join("gray_30x40.png")).unwrap();
    assert!(
        grey.pixels
            .chunks_exact(3)
            .all(|p| p[0] == p[1] && p[1] == p[2])
    );
    let rgba = load_rgb(&fixture_dir().join("rgba_50x60.png")).unwrap();
    assert_eq!(
        (rgba.height, rgba.width, rgba.pixels.len()),
        (50, 60, 50 * 60 * 3)
    );
}

fn video_sampling(info: &Value) -> VideoSampling {
    VideoSampling {
        source_fps: info["source_fps"].as_f64(),
        fps: info["fps"].as_f64(),
    }
}

#[test]
fn videos_match_transformers() {
    let fx = Fixture::load();
    let cfg = fx.image_cfg();
    let videos = fx.meta["videos"].as_object().unwrap();
    assert_eq!(videos.len(), 2);
    for (name, info) in videos {
        let dir = fixture_dir().join(info["dir"].as_str().unwrap());
        let sampling = video_sampling(info);
        let out = process_video_path(&dir, sampling, &cfg).unwrap();
        let grid = fx.grid(&format!("video.{name}.grid_thw"));
        assert_eq!(out.video_grid_thw, grid, "{name}: grid");
        let (shape, want) = fx.f32s(&format!("video.{name}.pixel_values_videos"));
        assert_eq!(
            shape,
            vec![grid.iter().product::<usize>(), cfg.patch_dim()],
            "{name}: shape"
        );
        let d = max_abs_diff(&out.pixel_values_videos, &want);
        eprintln!(
            "{name}: frames {:?}, grid {grid:?}, max |Δ| = {d:e}",
            out.frame_indices
        );
        assert!(d <= PIXEL_TOL, "{name}: max |Δ| {d:e}");
        // The same from decoded frames.
        let frames: Vec<RgbImage> = ares_model::vision::processor::frame_files(&dir)
            .unwrap()
            .iter()
            .map(|p| load_rgb(p).unwrap())
            .collect();
        assert_eq!(frames.len(), info["frames"].as_u64().unwrap() as usize);
        assert_eq!(process_video_frames(&frames, sampling, &cfg).unwrap(), out);
    }
}

#[test]
fn frame_sampling_rule() {
    let cfg = ProcessorConfig::default();
    let s = |total, src, fps| {
        sample_frame_indices(
            total,
            VideoSampling {
                source_fps: Some(src),
                fps: Some(fps),
            },
            &cfg,
        )
        .unwrap()
    };
    // 9 frames at 6 fps, 3 fps wanted: 4.5 -> 4 frames, step 2.25.
    assert_eq!(s(9, 6.0, 3.0), vec![0, 2, 4, 6]);
    // 10 frames, 1 fps wanted at 10 fps: 1 -> min_frames 4, step 2.5.
    assert_eq!(s(10, 10.0, 1.0), vec![0, 2, 5, 7]);
    // Enough frames: 60 frames at 30 fps, 2 fps -> 4 frames, step 15.
    assert_eq!(s(60, 30.0, 2.0), vec![0, 15, 30, 45]);
    // Fewer frames than min_frames: capped at the frame count floored to tp: 3 -> 2.
    assert_eq!(s(3, 24.0, 2.0), vec![0, 1]);
    // Odd counts are floored to a multiple of tp = 2: 7 frames at 1:1 -> 6, step 7/6.
    assert_eq!(s(7, 1.0, 1.0), vec![0, 1, 2, 3, 4, 5]);
    // No rate: every frame.
    assert_eq!(
        sample_frame_indices(5, VideoSampling::default(), &cfg).unwrap(),
        vec![0, 1, 2, 3, 4]
    );
    // One frame cannot be sampled into a temporal patch of 2.
    let e = sample_frame_indices(
        1,
        VideoSampling {
            source_fps: Some(1.0),
            fps: Some(1.0),
        },
        &cfg,
    )
    .unwrap_err();
    assert!(e.to_string().contains("temporal_patch_size"), "{e}");
    // A rate without the source rate, and bad rates.
    assert!(
        sample_frame_indices(
            5,
            VideoSampling {
                source_fps: None,
                fps: Some(2.0)
            },
            &cfg
        )
        .is_err()
    );
    assert!(
        sample_frame_indices(
            5,
            VideoSampling {
                source_fps: Some(0.0),
                fps: Some(2.0)
            },
            &cfg
        )
        .is_err()
    );
    assert!(sample_frame_indices(0, VideoSampling::default(), &cfg).is_err());
}

#[test]
fn image_is_two_identical_temporal_frames_in_patch_order() {
    // A 28x28 image of distinct values: check row order and value order by hand.
    let cfg = ProcessorConfig::default()
        .with_pixels(Some(784), Some(784))
        .unwrap();
    let pixels: Vec<u8> = (0..28 * 28 * 3).map(|i| (i % 251) as u8).collect();
    let img = RgbImage::new(28, 28, pixels.clone()).unwrap();
    let out = process_image(&img, &cfg).unwrap();
    assert_eq!(out.grid_thw, [1, 2, 2]);
    let norm =
        |c: usize, v: u8| (f32::from(v) - cfg.image_mean[c] * 255.0) / (cfg.image_std[c] * 255.0);
    // Row r = (mh, mw) of the single 2x2 block; value (c, t, y, x).
    for r in 0..4 {
        let (y0, x0) = ((r / 2) * 14, (r % 2) * 14);
        let row = &out.pixel_values[r * 1176..(r + 1) * 1176];
        for c in 0..3 {
            for t in 0..2 {
                for y in 0..14 {
                    for x in 0..14 {
                        let v = row[((c * 2 + t) * 14 + y) * 14 + x];
                        let px = pixels[((y0 + y) * 28 + x0 + x) * 3 + c];
                        assert_eq!(v, norm(c, px), "row {r} c {c} t {t} y {y} x {x}");
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_name_the_file() {
    let cfg = ProcessorConfig::default();
    let tmp = tempfile::tempdir().unwrap();

    let missing = tmp.path().join("nope.png");
    let e = process_image_file(&missing, &cfg).unwrap_err();
    assert!(matches!(e, VisionError::Io { .. }));
    assert!(e.to_string().contains("nope.png"), "{e}");

    // A PNG cut short.
    let good = std::fs::read(fixture_dir().join("rgb_56x56.png")).unwrap();
    let corrupt = tmp.path().join("cut.png");
    std::fs::write(&corrupt, &good[..good.len() / 2]).unwrap();
    let e = process_image_file(&corrupt, &cfg).unwrap_err();
    assert!(matches!(e, VisionError::Decode { .. }), "{e:?}");
    assert!(e.to_string().contains("cut.png"), "{e}");

    // A PNG header followed by garbage.
    let garbage = tmp.path().join("garbage.png");
    let mut bytes = good[..8].to_vec();
    bytes.extend(std::iter::repeat_n(0xAB, 64));
    std::fs::write(&garbage, &bytes).unwrap();
    let e = process_image_file(&garbage, &cfg).unwrap_err();
    assert!(e.to_string().contains("garbage.png"), "{e}");

    // Not an image at all.
    let text = tmp.path().join("notes.png");
    std::fs::write(&text, "just text").unwrap();
    let e = process_image_file(&text, &cfg).unwrap_err();
    assert!(matches!(e, VisionError::UnsupportedFormat { .. }), "{e:?}");
    assert!(e.to_string().contains("notes.png"), "{e}");

    // A format the image crate knows but the processor does not decode (BMP magic).
    let bmp = tmp.path().join("pic.bmp");
    std::fs::write(&bmp, b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0").unwrap();
    let e = process_image_file(&bmp, &cfg).unwrap_err();
    assert!(matches!(e, VisionError::UnsupportedFormat { .. }), "{e:?}");
    assert!(e.to_string().contains("pic.bmp"), "{e}");

    // An image too thin for transformers (aspect ratio 300): the error names the file.
    let thin = tmp.path().join("thin.png");
    let encoded = encode_png(1, 300);
    std::fs::write(&thin, encoded).unwrap();
    let e = process_image_file(&thin, &cfg).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("thin.png") && msg.contains("aspect ratio"),
        "{msg}"
    );

    // Empty bytes.
    let e = decode_rgb(&[], Path::new("empty.webp")).unwrap_err();
    assert!(e.to_string().contains("empty.webp"), "{e}");

    // Bad buffer.
    assert!(RgbImage::new(2, 2, vec![0; 11]).is_err());
}

/// A grey PNG of `h × w` made with the `png` encoder of the `image` crate.
fn encode_png(h: u32, w: u32) -> Vec<u8> {
    use image::ImageEncoder;
    let mut out = Vec::new();
    let data = vec![128u8; (h * w) as usize];
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&data, w, h, image::ExtendedColorType::L8)
        .unwrap();
    out
}

#[test]
fn video_errors() {
    let cfg = ProcessorConfig::default();
    let tmp = tempfile::tempdir().unwrap();
    // A video file (a broken one) is decoded with ffmpeg: an error naming it, whether ffmpeg
    // is missing or fails (tests/vision_video.rs covers both). Among frames, or as an image, a
    // video file is an error pointing to process_video_path.
    let mp4 = tmp.path().join("clip.mp4");
    std::fs::write(&mp4, b"\0\0\0\x18ftypmp42").unwrap();
    let e = process_video_path(&mp4, VideoSampling::default(), &cfg).unwrap_err();
    assert!(
        matches!(
            e,
            VisionError::VideoFileNeedsDecoder { .. } | VisionError::VideoFile { .. }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("clip.mp4"), "{e}");
    for e in [
        process_video_files(std::slice::from_ref(&mp4), VideoSampling::default(), &cfg)
            .unwrap_err(),
        load_rgb(&mp4).unwrap_err(),
    ] {
        assert!(matches!(e, VisionError::UnsupportedFormat { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("clip.mp4") && msg.contains("process_video_path"),
            "{msg}"
        );
    }
    // One image passed as a video.
    let e = process_video_path(
        &fixture_dir().join("rgb_56x56.png"),
        VideoSampling::default(),
        &cfg,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("rgb_56x56.png") && e.to_string().contains("not a video"),
        "{e}"
    );
    // A directory without frames.
    let e = process_video_path(tmp.path(), VideoSampling::default(), &cfg).unwrap_err();
    assert!(e.to_string().contains("no frame images"), "{e}");
    // A missing path.
    let e =
        process_video_path(&tmp.path().join("gone"), VideoSampling::default(), &cfg).unwrap_err();
    assert!(e.to_string().contains("gone"), "{e}");
    // Frames of different sizes.
    let a = RgbImage::new(30, 40, vec![0; 30 * 40 * 3]).unwrap();
    let b = RgbImage::new(40, 30, vec![0; 30 * 40 * 3]).unwrap();
    let e = process_video_frames(&[a, b], VideoSampling::default(), &cfg).unwrap_err();
    assert!(e.to_string().contains("one size"), "{e}");
    // A missing frame file among frames.
    let frames = vec![
        fixture_dir().join("clip5_all/frame_000.png"),
        tmp.path().join("frame_001.png"),
    ];
    let e = process_video_files(&frames, VideoSampling::default(), &cfg).unwrap_err();
    assert!(e.to_string().contains("frame_001.png"), "{e}");
}

#[test]
fn config_hub_layout() {
    let dir = fixture_dir().join("config_hub");
    let cfg = ProcessorConfig::from_model_dir(&dir).unwrap();
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (3136, 6272));
    assert_eq!(
        (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size),
        (14, 2, 2)
    );
    assert_eq!(cfg.image_mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
    assert_eq!(
        cfg.image_std,
        ares_model::vision::processor::OPENAI_CLIP_STD
    );
    // No video section: the image bounds.
    assert_eq!((cfg.video.min_pixels, cfg.video.max_pixels), (3136, 6272));

    // A Hub file with top-level min_pixels / max_pixels (Qwen2.5-VL's), which win over `size`.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("preprocessor_config.json");
    std::fs::write(
        &file,
        r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": 1, "longest_edge": 2}, "image_processor_type": "Qwen2VLImageProcessor"}"#,
    )
    .unwrap();
    let cfg = ProcessorConfig::from_model_dir(tmp.path()).unwrap();
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (3136, 12_845_056));
    assert_eq!(cfg.image_mean, [0.5; 3]);
    // Overrides from a training config.
    let cfg = cfg.with_pixels(Some(784), None).unwrap();
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (784, 12_845_056));
    assert!(cfg.clone().with_pixels(Some(100), Some(50)).is_err());
    // Older `size.min_pixels` / `size.max_pixels`.
    std::fs::write(&file, r#"{"size": {"min_pixels": 100, "max_pixels": 200}}"#).unwrap();
    let cfg = ProcessorConfig::from_file(&file).unwrap();
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (100, 200));
    // Defaults: transformers' class defaults.
    std::fs::write(&file, "{}").unwrap();
    assert_eq!(
        ProcessorConfig::from_file(&file).unwrap().max_pixels,
        28 * 28 * 1280
    );
}

#[test]
fn config_transformers5_layout() {
    let dir = fixture_dir().join("config_v5");
    let cfg = ProcessorConfig::from_model_dir(&dir).unwrap();
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (3136, 6272));
    assert_eq!((cfg.video.min_pixels, cfg.video.max_pixels), (784, 3136));
    assert_eq!((cfg.video.min_frames, cfg.video.max_frames), (4, 768));
    // The fixture config reproduces the fixture's settings.
    let fx = Fixture::load();
    assert_eq!(cfg, fx.image_cfg());
}

#[test]
fn config_errors_name_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("preprocessor_config.json");
    let cases: [(&str, &str); 9] = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (r#"{"patch_size": "14"}"#, "field `patch_size`"),
        (r#"{"patch_size": 0}"#, "field `patch_size`"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "field `image_mean`"),
        (
            r#"{"size": {"shortest_edge": -1}}"#,
            "field `size.shortest_edge`",
        ),
        (r#"{"resample": 2}"#, "field `resample`"),
        (
            r#"{"image_processor": {"max_pixels": 1.5}}"#,
            "field `image_processor.max_pixels`",
        ),
        (
            r#"{"min_pixels": 500, "max_pixels": 100}"#,
            "exceeds max_pixels",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&file, text).unwrap();
        let e = ProcessorConfig::from_file(&file).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("preprocessor_config.json") && msg.contains(want),
            "{text}: {msg}"
        );
    }
    // No config file at all.
    let empty = tempfile::tempdir().unwrap();
    let msg = ProcessorConfig::from_model_dir(empty.path())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("preprocessor_config.json"), "{msg}");
}

/// A small file that declares a huge image (a decompression bomb) is refused from its
/// header, before any pixel is decoded or allocated.
#[test]
fn huge_declared_images_are_refused_before_decoding() {
    // 100 000 × 100 000 RGB pixels are 30 GB: the refusal must not reserve them
    let Some(_peak) = ares_tests::bounded::rerun(
        "huge_declared_images_are_refused_before_decoding",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 16,
        },
    ) else {
        return;
    };
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
    let png_header = |w: u32, h: u32| {
        let mut ihdr = b"IHDR".to_vec();
        ihdr.extend_from_slice(&w.to_be_bytes());
        ihdr.extend_from_slice(&h.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        png.extend_from_slice(&13u32.to_be_bytes());
        png.extend_from_slice(&ihdr);
        png.extend_from_slice(&crc32(&ihdr).to_be_bytes());
        // an empty IDAT, where the decoder stops reading the header
        png.extend_from_slice(&0u32.to_be_bytes());
        png.extend_from_slice(b"IDAT");
        png.extend_from_slice(&crc32(b"IDAT").to_be_bytes());
        png
    };
    let bomb = png_header(100_000, 100_000);
    assert!(bomb.len() < 64, "{}", bomb.len());
    let e = ares_model::vision::processor::decode_rgb(&bomb, std::path::Path::new("bomb.png"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bomb.png") && e.contains("100000×100000") && e.contains("before decoding"),
        "{e}"
    );
    // an image under the limit gets as far as its (missing) pixel data
    let e = ares_model::vision::processor::decode_rgb(
        &png_header(64, 64),
        std::path::Path::new("small.png"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("corrupt image"), "{e}");
}
