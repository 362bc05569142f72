//! Video files decoded through ffmpeg (`vision::video`) against transformers 5.24's
//! `Qwen2VLVideoProcessor` on frames decoded by PyAV (transformers' default video backend).
//!
//! Fixtures: `scripts/make_video_fixtures.py` writes into `tests/fixtures/vision/video/` a
//! lossless RGB H.264 mp4 (16 frames of 64×48 at 10 fps), a lossless RGB VP9 webm (15 frames at
//! 12 fps) and a lossy 4:2:0 H.264 mp4 (16 frames at 10 fps), and into `video.safetensors`
//! transformers' sampled frame indices, grids and `pixel_values_videos` (as f32 for the mp4, as
//! the pixel levels they normalise for the webm, to stay small) and PyAV's RGB frames of the
//! 4:2:0 video.
//!
//! Measured (ffmpeg 9.0.2 from imageio-ffmpeg 0.8.1, PyAV 18.1.0, transformers 5.24.0): frame
//! counts, rates, sampled indices and grids equal; `pixel_values_videos` equal exactly (max
//! |Δ| = 0, asserted ≤ [`PIXEL_TOL`] as in `vision_processor.rs`); the 4:2:0 video's RGB frames
//! equal PyAV's (0 levels; asserted ≤ [`YUV420_LEVELS`], as other ffmpeg builds may round the
//! YUV → RGB conversion differently).
//!
//! Without ffmpeg (`$ARES_FFMPEG`, else `ffmpeg` on `PATH`) the decoding tests are skipped with a
//! note, unless `ARES_REQUIRE_FFMPEG=1` (CI sets it), which turns the skip into a failure.

use std::path::{Path, PathBuf};

use ares_model::vision::processor::{
    ProcessorConfig, RgbImage, VideoSampling, VisionError, process_video_frames,
};
use ares_model::vision::video::process_video_path;
use ares_model::vision::video::{
    Ffmpeg, VideoInfo, decode_frames, probe, process_video_file_with, sample_indices,
};
use safetensors::SafeTensors;
use serde_json::Value;

/// Largest |Δ| allowed between our `pixel_values_videos` and transformers' (measured: 0).
const PIXEL_TOL: f32 = 1e-6;
/// Largest per-sample difference between ffmpeg's and PyAV's RGB of the 4:2:0 video (measured:
/// 0 with ffmpeg 9.0.2 against PyAV 18.1.0).
const YUV420_LEVELS: u8 = 2;

fn video_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/video")
}

/// The ffmpeg the processor would use, or `None` (with a note) when there is none and
/// `ARES_REQUIRE_FFMPEG` is not `1`.
fn ffmpeg_or_skip() -> Option<Ffmpeg> {
    let ffmpeg = Ffmpeg::from_env();
    match ffmpeg.version() {
        Ok(v) => {
            eprintln!("{v} ({})", ffmpeg.describe());
            Some(ffmpeg)
        }
        Err(why) => {
            let required = std::env::var("ARES_REQUIRE_FFMPEG").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_FFMPEG=1 but {why}");
            eprintln!(
                "skipped: {why} ({})",
                ares_model::vision::video::INSTALL_HINT
            );
            None
        }
    }
}

struct Fixture {
    bytes: Vec<u8>,
    meta: Value,
}

impl Fixture {
    fn load() -> Self {
        let dir = video_dir();
        let bytes = std::fs::read(dir.join("video.safetensors")).expect("video.safetensors");
        let meta = serde_json::from_str(&std::fs::read_to_string(dir.join("video.json")).unwrap())
            .unwrap();
        Fixture { bytes, meta }
    }

    fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.bytes)
            .unwrap()
            .names()
            .contains(&name)
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

    fn u8s(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), safetensors::Dtype::U8);
        (t.shape().to_vec(), t.data().to_vec())
    }

    fn i64s(&self, name: &str) -> Vec<usize> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), safetensors::Dtype::I64);
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect()
    }

    fn cfg(&self) -> ProcessorConfig {
        let px = |k: &str| self.meta[k].as_u64().unwrap() as usize;
        let cfg = ProcessorConfig::default()
            .with_video_pixels(Some(px("video_min_pixels")), Some(px("video_max_pixels")))
            .unwrap();
        assert_eq!(
            (cfg.video.min_frames, cfg.video.max_frames),
            (px("min_frames"), px("max_frames"))
        );
        cfg
    }

    /// transformers' `pixel_values_videos` of a case: stored as f32, or as pixel levels whose
    /// normalisation (in f32, as the torchvision backend computes it) the generator checked to
    /// be transformers' values exactly.
    fn expected_values(&self, case: &str, cfg: &ProcessorConfig) -> Option<(Vec<usize>, Vec<f32>)> {
        let f32_name = format!("{case}.pixel_values_videos");
        if self.has(&f32_name) {
            return Some(self.f32s(&f32_name));
        }
        let levels_name = format!("{case}.levels");
        if !self.has(&levels_name) {
            return None;
        }
        let (shape, levels) = self.u8s(&levels_name);
        let inv = (1.0 / cfg.rescale_factor) as f32;
        let per_channel = levels.len() / shape[0] / 3;
        let values = levels
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let c = (i % (3 * per_channel)) / per_channel;
                (f32::from(x) - cfg.image_mean[c] * inv) / (cfg.image_std[c] * inv)
            })
            .collect();
        Some((shape, values))
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_level_diff(a: &[u8], b: &[u8]) -> u8 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap()
}

fn at_fps(fps: f64) -> VideoSampling {
    VideoSampling {
        source_fps: None,
        fps: Some(fps),
    }
}

#[test]
fn fixture_sizes_and_versions() {
    let fx = Fixture::load();
    assert_eq!(fx.meta["transformers"], "5.24.0");
    let total: u64 = std::fs::read_dir(video_dir())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(total < 300_000, "video fixtures take {total} bytes");
}

#[test]
fn probe_reads_size_rate_and_frame_count() {
    let Some(ffmpeg) = ffmpeg_or_skip() else {
        return;
    };
    let fx = Fixture::load();
    for (name, v) in fx.meta["videos"].as_object().unwrap() {
        let info = probe(&ffmpeg, &video_dir().join(name)).unwrap();
        eprintln!("{name}: {info:?}");
        assert_eq!(info.frames as u64, v["frames"].as_u64().unwrap(), "{name}");
        assert_eq!(info.height as u64, v["height"].as_u64().unwrap(), "{name}");
        assert_eq!(info.width as u64, v["width"].as_u64().unwrap(), "{name}");
        assert_eq!(info.fps, v["fps"].as_f64(), "{name}");
        let codec = if name.ends_with(".webm") {
            "vp9"
        } else {
            "h264"
        };
        assert_eq!(info.codec, codec, "{name}");
    }
}

#[test]
fn videos_match_transformers() {
    let Some(ffmpeg) = ffmpeg_or_skip() else {
        return;
    };
    let fx = Fixture::load();
    let cfg = fx.cfg();
    let mut compared = 0;
    for (case, c) in fx.meta["cases"].as_object().unwrap() {
        let file = video_dir().join(c["file"].as_str().unwrap());
        let sampling = at_fps(c["fps"].as_f64().unwrap());
        let out = process_video_path(&file, sampling, &cfg).unwrap();
        assert_eq!(
            out,
            process_video_file_with(&ffmpeg, &file, sampling, &cfg).unwrap()
        );
        let indices = fx.i64s(&format!("{case}.frame_indices"));
        let grid = fx.i64s(&format!("{case}.grid_thw"));
        assert_eq!(out.frame_indices, indices, "{case}: frame indices");
        assert_eq!(out.video_grid_thw.to_vec(), grid, "{case}: grid");
        if let Some((shape, want)) = fx.expected_values(case, &cfg) {
            assert_eq!(
                shape,
                vec![grid.iter().product::<usize>(), cfg.patch_dim()],
                "{case}: shape"
            );
            let d = max_abs_diff(&out.pixel_values_videos, &want);
            eprintln!("{case}: frames {indices:?}, grid {grid:?}, max |Δ| = {d:e}");
            assert!(d <= PIXEL_TOL, "{case}: max |Δ| {d:e} > {PIXEL_TOL:e}");
            compared += 1;
        }
        let decoded_name = format!("{case}.decoded");
        if fx.has(&decoded_name) {
            // The lossy 4:2:0 video: our RGB frames against PyAV's.
            let (shape, want) = fx.u8s(&decoded_name);
            let info = probe(&ffmpeg, &file).unwrap();
            let frames = decode_frames(&ffmpeg, &file, &info, &indices).unwrap();
            assert_eq!(shape, vec![indices.len(), info.height, info.width, 3]);
            let ours: Vec<u8> = frames.iter().flat_map(|f| f.pixels.clone()).collect();
            let d = max_level_diff(&ours, &want);
            eprintln!("{case}: RGB vs PyAV max |Δ| = {d} level(s)");
            assert!(d <= YUV420_LEVELS, "{case}: {d} levels > {YUV420_LEVELS}");
            // And the processor output from PyAV's frames (the pipeline transformers runs).
            let pyav: Vec<RgbImage> = want
                .chunks_exact(info.height * info.width * 3)
                .map(|p| RgbImage::new(info.height, info.width, p.to_vec()).unwrap())
                .collect();
            let from_pyav = process_video_frames(&pyav, VideoSampling::default(), &cfg).unwrap();
            assert_eq!(from_pyav.video_grid_thw, out.video_grid_thw);
            if d == 0 {
                assert_eq!(from_pyav.pixel_values_videos, out.pixel_values_videos);
            }
        }
    }
    assert_eq!(compared, 2, "two cases hold transformers' values");
}

#[test]
fn every_frame_without_a_rate_and_only_the_chosen_ones_with_one() {
    let Some(ffmpeg) = ffmpeg_or_skip() else {
        return;
    };
    let fx = Fixture::load();
    let cfg = fx.cfg();
    let file = video_dir().join("moving_rgb_10fps.mp4");
    // No rate: all 16 frames (transformers' default do_sample_frames = False).
    let all = process_video_path(&file, VideoSampling::default(), &cfg).unwrap();
    assert_eq!(all.frame_indices, (0..16).collect::<Vec<_>>());
    assert_eq!(all.video_grid_thw, [8, 4, 4]);
    // The chosen frames decoded alone equal the same frames decoded with all the others.
    let info = probe(&ffmpeg, &file).unwrap();
    let every = decode_frames(&ffmpeg, &file, &info, &all.frame_indices).unwrap();
    let chosen = [0usize, 4, 8, 12];
    let some = decode_frames(&ffmpeg, &file, &info, &chosen).unwrap();
    for (k, &i) in chosen.iter().enumerate() {
        assert_eq!(some[k], every[i], "frame {i}");
    }
    // Those frames are transformers' case rgb_mp4_fps3 (sampled at 3 fps).
    let (_, want) = fx.f32s("rgb_mp4_fps3.pixel_values_videos");
    let out = process_video_frames(&some, VideoSampling::default(), &cfg).unwrap();
    assert_eq!(max_abs_diff(&out.pixel_values_videos, &want), 0.0);
    // The last frame alone, and a frame past the end.
    assert_eq!(
        decode_frames(&ffmpeg, &file, &info, &[15]).unwrap()[0],
        every[15]
    );
    let e = decode_frames(&ffmpeg, &file, &info, &[3, 16]).unwrap_err();
    assert!(e.to_string().contains("16 frames"), "{e}");
    assert!(decode_frames(&ffmpeg, &file, &info, &[4, 4]).is_err());
    // The file's own rate wins over a caller's source_fps (used only when the file has none).
    let sampling = VideoSampling {
        source_fps: Some(1.0),
        fps: Some(3.0),
    };
    assert_eq!(
        process_video_path(&file, sampling, &cfg)
            .unwrap()
            .frame_indices,
        vec![0, 4, 8, 12]
    );
}

/// More chosen frames than ffmpeg's expression parser takes in a flat sum (100): a 300-frame
/// lossless video (each frame different) made here by ffmpeg itself, 200 frames sampled.
#[test]
fn hundreds_of_chosen_frames() {
    let Some(ffmpeg) = ffmpeg_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("long.mkv");
    let made = std::process::Command::new(ffmpeg.program())
        .args([
            "-nostdin",
            "-hide_banner",
            "-loglevel",
            "error",
            "-f",
            "lavfi",
            "-i",
        ])
        .arg("nullsrc=size=32x24:rate=30,geq=lum='mod(3*N+X,256)':cb=128:cr=128")
        .args(["-frames:v", "300", "-c:v", "ffv1"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let cfg = ProcessorConfig::default()
        .with_video_pixels(Some(784), Some(784))
        .unwrap();
    // 300 frames at 30 fps sampled at 20 fps: 200 frames, step 1.5.
    let out = process_video_path(&file, at_fps(20.0), &cfg).unwrap();
    assert_eq!(out.frame_indices.len(), 200);
    assert_eq!(out.video_grid_thw, [100, 2, 2]);
    let info = probe(&ffmpeg, &file).unwrap();
    assert_eq!((info.frames, info.fps), (300, Some(30.0)));
    let every = decode_frames(&ffmpeg, &file, &info, &(0..300).collect::<Vec<_>>()).unwrap();
    let chosen: Vec<RgbImage> = out
        .frame_indices
        .iter()
        .map(|&i| every[i].clone())
        .collect();
    let want = process_video_frames(&chosen, VideoSampling::default(), &cfg).unwrap();
    assert_eq!(want.pixel_values_videos, out.pixel_values_videos);
    // Frames differ from one to the next, so a wrong pick would show.
    assert!(every.windows(2).all(|w| w[0] != w[1]));
}

#[test]
fn sampling_needs_a_rate() {
    let cfg = ProcessorConfig::default();
    let file = Path::new("/videos/no_rate.mkv");
    let info = VideoInfo {
        height: 48,
        width: 64,
        fps: None,
        frames: 20,
        codec: "ffv1".into(),
    };
    let e = sample_indices(file, &info, at_fps(2.0), &cfg).unwrap_err();
    assert!(matches!(e, VisionError::VideoFile { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("no_rate.mkv") && msg.contains("no frame rate") && msg.contains("source_fps"),
        "{msg}"
    );
    // The caller's rate when the file has none: 20 frames at 10 fps, 2 fps -> 4 frames.
    let sampling = VideoSampling {
        source_fps: Some(10.0),
        fps: Some(2.0),
    };
    assert_eq!(
        sample_indices(file, &info, sampling, &cfg).unwrap(),
        vec![0, 5, 10, 15]
    );
    // Without a rate to sample by, every frame.
    assert_eq!(
        sample_indices(file, &info, VideoSampling::default(), &cfg)
            .unwrap()
            .len(),
        20
    );
    // One frame cannot fill a temporal patch: the error names the file.
    let one = VideoInfo {
        frames: 1,
        fps: Some(10.0),
        ..info
    };
    let msg = sample_indices(file, &one, at_fps(2.0), &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("no_rate.mkv") && msg.contains("temporal_patch_size"),
        "{msg}"
    );
}

#[test]
fn missing_ffmpeg_is_a_clear_error() {
    let cfg = ProcessorConfig::default();
    let file = video_dir().join("moving_rgb_10fps.mp4");
    let cases = [
        (
            Ffmpeg::locate(Some("/nonexistent/ares/ffmpeg".into())),
            "ARES_FFMPEG=/nonexistent/ares/ffmpeg does not exist",
        ),
        (
            Ffmpeg::at("ares-no-such-ffmpeg"),
            "no `ares-no-such-ffmpeg` on PATH",
        ),
        // A file that is not executable.
        (
            Ffmpeg::locate(Some(video_dir().join("video.json").into())),
            "cannot be run",
        ),
    ];
    for (ffmpeg, want) in cases {
        let e =
            process_video_file_with(&ffmpeg, &file, VideoSampling::default(), &cfg).unwrap_err();
        assert!(
            matches!(e, VisionError::VideoFileNeedsDecoder { .. }),
            "{e:?}"
        );
        let msg = e.to_string();
        eprintln!("{msg}");
        assert!(
            msg.contains("moving_rgb_10fps.mp4")
                && msg.contains(want)
                && msg.contains("apt install ffmpeg")
                && msg.contains("pip install imageio-ffmpeg")
                && msg.contains("ARES_FFMPEG"),
            "{msg}"
        );
        assert!(ffmpeg.version().unwrap_err().contains(want));
    }
}

/// `ARES_FFMPEG` as the processor reads it from the environment: this test re-runs the test
/// binary with it pointing nowhere, and the child (the test below) checks the error.
#[test]
fn ares_ffmpeg_pointing_nowhere() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "env_child_bad_ares_ffmpeg", "--nocapture"])
        .env("ARES_FFMPEG", "/nonexistent/ares/ffmpeg")
        .env("ARES_VIDEO_ENV_CHILD", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    assert!(text.contains("child saw"), "{text}");
}

#[test]
fn env_child_bad_ares_ffmpeg() {
    if std::env::var_os("ARES_VIDEO_ENV_CHILD").is_none() {
        return; // run by ares_ffmpeg_pointing_nowhere
    }
    let file = video_dir().join("moving_rgb_10fps.mp4");
    let e = process_video_path(&file, VideoSampling::default(), &ProcessorConfig::default())
        .unwrap_err();
    assert!(
        matches!(e, VisionError::VideoFileNeedsDecoder { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("moving_rgb_10fps.mp4")
            && msg.contains("ARES_FFMPEG=/nonexistent/ares/ffmpeg does not exist")
            && msg.contains("apt install ffmpeg"),
        "{msg}"
    );
    eprintln!("child saw: {msg}");
}

#[test]
fn missing_file_and_directories() {
    let cfg = ProcessorConfig::default();
    let tmp = tempfile::tempdir().unwrap();
    // A missing video file: an I/O error naming it, with or without ffmpeg.
    for name in ["gone.mp4", "gone.webm", "gone"] {
        let e =
            process_video_path(&tmp.path().join(name), VideoSampling::default(), &cfg).unwrap_err();
        assert!(matches!(e, VisionError::Io { .. }), "{e:?}");
        assert!(e.to_string().contains(name), "{e}");
    }
    let e = probe(&Ffmpeg::from_env(), &tmp.path().join("gone.mkv")).unwrap_err();
    assert!(e.to_string().contains("gone.mkv"), "{e}");
    let e = probe(&Ffmpeg::from_env(), tmp.path()).unwrap_err();
    assert!(matches!(e, VisionError::Io { .. }), "{e:?}");
}

#[test]
fn corrupt_and_non_video_files() {
    let Some(ffmpeg) = ffmpeg_or_skip() else {
        return;
    };
    let cfg = ProcessorConfig::default();
    let tmp = tempfile::tempdir().unwrap();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    let good = std::fs::read(video_dir().join("moving_rgb_10fps.mp4")).unwrap();
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("random.mp4", random.clone()),
        ("random.webm", random),
        ("empty.mkv", Vec::new()),
        ("notes.mov", b"just some text, not a video".to_vec()),
        // An mp4 cut in half: its index (moov, written last) is gone.
        ("cut.mp4", good[..good.len() / 2].to_vec()),
        // An ftyp box and nothing else.
        ("header.mp4", b"\0\0\0\x18ftypmp42\0\0\0\0mp42isom".to_vec()),
    ];
    // Audio only: a valid WAV, no video stream.
    let mut wav = Vec::new();
    let samples = 800u32;
    wav.extend_from_slice(b"RIFF");
    wav.extend_from_slice(&(36 + 2 * samples).to_le_bytes());
    wav.extend_from_slice(b"WAVEfmt ");
    wav.extend_from_slice(&16u32.to_le_bytes());
    wav.extend_from_slice(&1u16.to_le_bytes()); // PCM
    wav.extend_from_slice(&1u16.to_le_bytes()); // mono
    wav.extend_from_slice(&8000u32.to_le_bytes());
    wav.extend_from_slice(&16000u32.to_le_bytes());
    wav.extend_from_slice(&2u16.to_le_bytes());
    wav.extend_from_slice(&16u16.to_le_bytes());
    wav.extend_from_slice(b"data");
    wav.extend_from_slice(&(2 * samples).to_le_bytes());
    wav.extend(std::iter::repeat_n(0u8, 2 * samples as usize));
    cases.push(("sound.wav", wav));
    for (name, bytes) in &cases {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let e = process_video_file_with(&ffmpeg, &path, at_fps(2.0), &cfg).unwrap_err();
        assert!(matches!(e, VisionError::VideoFile { .. }), "{name}: {e:?}");
        let msg = e.to_string();
        eprintln!("{name}: {msg}\n");
        assert!(
            msg.contains(name) && msg.contains("ffmpeg said"),
            "{name}: {msg}"
        );
        // The same through the processor's entry point.
        let msg2 = process_video_path(&path, at_fps(2.0), &cfg)
            .unwrap_err()
            .to_string();
        assert!(msg2.contains(name), "{name}: {msg2}");
    }
    // A webm cut short still has frames before the cut: decoded or a clear error, never a
    // panic.
    let webm = std::fs::read(video_dir().join("moving_rgb_12fps.webm")).unwrap();
    let path = tmp.path().join("cut.webm");
    std::fs::write(&path, &webm[..webm.len() * 2 / 3]).unwrap();
    match process_video_file_with(&ffmpeg, &path, VideoSampling::default(), &cfg) {
        Ok(v) => eprintln!("cut.webm: {} frames decoded", v.frame_indices.len()),
        Err(e) => assert!(e.to_string().contains("cut.webm"), "{e}"),
    }
}

/// Fake ffmpeg executables (shell scripts) for what a real one rarely does: no frames, no rate,
/// an old ffmpeg without `-fps_mode`, output cut short, a crash.
#[cfg(unix)]
#[test]
fn odd_ffmpeg_behaviour_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let video = tmp.path().join("clip.mp4");
    std::fs::write(&video, b"not read by the fake ffmpeg").unwrap();
    // mode: zero | nofps | old | short | crash
    let script = |mode: &str| {
        format!(
            r#"#!/bin/sh
mode={mode}
frames=0; decode=0; prev=
for a in "$@"; do
  [ "$prev" = "-frames:v" ] && frames=$a
  [ "$a" = "-version" ] && {{ echo "ffmpeg version fake"; exit 0; }}
  [ "$a" = "-fps_mode" ] && [ $mode = old ] && {{ echo "Unrecognized option 'fps_mode'." >&2; echo "Error splitting the argument list: Option not found" >&2; exit 8; }}
  [ "$a" = "rawvideo" ] && decode=1
  prev=$a
done
[ $mode = crash ] && {{ echo "[in#0] something broke" >&2; exit 1; }}
if [ $decode = 1 ]; then
  n=$frames; [ $mode = short ] && n=$((n - 1))
  head -c $((8 * 6 * 3 * n)) /dev/zero
  exit 0
fi
rate="10 fps, 10 tbr, "; [ $mode = nofps ] && rate=""
count=12; [ $mode = zero ] && count=0
cat >&2 <<EOF
Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'file:clip.mp4':
  Stream #0:0[0x1](und): Video: h264 (High) (avc1 / 0x31637661), yuv420p(progressive), 6x8, 5 kb/s, ${{rate}}10240 tbn (default)
Stream mapping:
  Stream #0:0 -> #0:0 (h264 (native) -> wrapped_avframe (native))
Output #0, null, to 'pipe:':
  Stream #0:0(und): Video: wrapped_avframe, yuv420p(progressive), 6x8, q=2-31, 200 kb/s, 10240 tbn (default)
EOF
echo "frame=$count"
echo "progress=end"
"#
        )
    };
    let modes = ["zero", "nofps", "old", "short", "crash"];
    let fakes: Vec<Ffmpeg> = modes
        .iter()
        .map(|mode| {
            let path = tmp.path().join(format!("ffmpeg-{mode}"));
            write_executable(&path, &script(mode));
            Ffmpeg::at(path)
        })
        .collect();
    let cfg = ProcessorConfig::default();
    let run = |k: usize, sampling| process_video_file_with(&fakes[k], &video, sampling, &cfg);
    let err = |k: usize, sampling| run(k, sampling).unwrap_err().to_string();

    let msg = err(0, VideoSampling::default());
    assert!(
        msg.contains("clip.mp4") && msg.contains("no frames"),
        "{msg}"
    );

    let msg = err(1, at_fps(2.0));
    assert!(
        msg.contains("clip.mp4") && msg.contains("no frame rate"),
        "{msg}"
    );
    // With the caller's rate: 12 frames at 4 fps sampled at 2 fps -> 6 frames, decoded.
    let sampling = VideoSampling {
        source_fps: Some(4.0),
        fps: Some(2.0),
    };
    let out = run(1, sampling).unwrap();
    assert_eq!(out.frame_indices, vec![0, 2, 4, 6, 8, 10]);

    // An ffmpeg without -fps_mode gets -vsync: 12 frames at 10 fps, 2 fps -> min_frames 4.
    let out = run(2, at_fps(2.0)).unwrap();
    assert_eq!(out.frame_indices, vec![0, 3, 6, 9]);
    assert_eq!(
        probe(&fakes[2], &video).unwrap(),
        VideoInfo {
            height: 8,
            width: 6,
            fps: Some(10.0),
            frames: 12,
            codec: "h264".into(),
        }
    );

    let msg = err(3, at_fps(2.0));
    assert!(
        msg.contains("clip.mp4") && msg.contains("ended after 3 whole frame(s) of 8×6"),
        "{msg}"
    );

    let msg = err(4, at_fps(2.0));
    assert!(
        msg.contains("clip.mp4") && msg.contains("something broke"),
        "{msg}"
    );
}

/// The size a video file declares bounds what decoding would allocate before ffmpeg runs:
/// frames past the image limit, or more frames than 4 GiB of RGB, are refused (ffmpeg is
/// not even started: this ffmpeg does not exist).
#[test]
fn declared_video_sizes_are_bounded_before_decoding() {
    // the frames declared are 30 GB and 12 GB: neither may be reserved
    let Some(_peak) = ares_tests::bounded::rerun(
        "declared_video_sizes_are_bounded_before_decoding",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 16,
        },
    ) else {
        return;
    };
    let ffmpeg = Ffmpeg::at("ares-no-such-ffmpeg");
    let info = |height, width| VideoInfo {
        height,
        width,
        fps: Some(30.0),
        frames: 10_000,
        codec: "h264".into(),
    };
    let path = Path::new("bomb.mp4");
    let e = decode_frames(&ffmpeg, path, &info(100_000, 100_000), &[0, 1])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bomb.mp4") && e.contains("before decoding"),
        "{e}"
    );
    let many: Vec<usize> = (0..2000).collect();
    let e = decode_frames(&ffmpeg, path, &info(1080, 1920), &many)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2000 frames of 1080×1920") && e.contains("4096 MiB"),
        "{e}"
    );
}

/// Writes a shell script and marks it executable, from a child `sh` rather than this
/// process: a file this (multi-threaded) test process held open for writing could be
/// inherited by a child another test thread forks at that moment, and executing it then
/// fails with ETXTBSY ("Text file busy") until that child has exec'd.
fn write_executable(path: &Path, text: &str) {
    let status = std::process::Command::new("sh")
        .args([
            "-c",
            "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"",
            "sh",
            text,
        ])
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "writing {}: {status}", path.display());
}

/// An ffmpeg run that does not end (a hostile file, or a stuck decoder) is killed at the
/// time limit, counting frames and decoding them alike.
#[test]
fn a_hanging_ffmpeg_is_stopped_at_its_time_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("ffmpeg");
    write_executable(&script, "#!/bin/sh\nexec sleep 60\n");
    let video = tmp.path().join("v.mp4");
    std::fs::write(&video, b"not really a video").unwrap();
    let ffmpeg = Ffmpeg::at(&script).with_timeout(std::time::Duration::from_millis(300));
    let t = std::time::Instant::now();
    let e = probe(&ffmpeg, &video).unwrap_err().to_string();
    assert!(e.contains("ran past 0.3 s counting the frames"), "{e}");
    let info = VideoInfo {
        height: 4,
        width: 4,
        fps: Some(1.0),
        frames: 2,
        codec: "h264".into(),
    };
    let e = decode_frames(&ffmpeg, &video, &info, &[0, 1])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ran past 0.3 s decoding the sampled frames"),
        "{e}"
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
}
