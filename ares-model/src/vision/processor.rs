//! The Qwen2-VL image and video processor: decoded pixels → patch rows (`pixel_values`) and
//! patch grids (`grid_thw`), equal to transformers 5.24's `Qwen2VLImageProcessor` /
//! `Qwen2VLVideoProcessor` with their default (torchvision) backend. Qwen2.5-VL uses the same
//! processor.
//!
//! # Pipeline
//!
//! 1. **Decode** (PNG / JPEG / WebP, [`load_rgb`]) and convert to RGB the way PIL's
//!    `convert("RGB")` does: grey `L` → `(L, L, L)`, alpha dropped (not composited onto white).
//!    verl's data pipeline hands transformers images converted this way. transformers itself,
//!    given an RGBA `PIL.Image`, composites it onto white; convert before comparing.
//! 2. **Target size** with [`smart_resize`]`(h, w, factor = patch·merge, min_pixels, max_pixels)`:
//!    - error if `max(h, w) / min(h, w) > 200` (transformers' limit) or a side is 0;
//!    - `h̄ = round(h / factor)·factor`, `w̄ = round(w / factor)·factor`, `round` half to even
//!      (Python's): 126×70 → 4.5, 2.5 → 112×56;
//!    - if `h̄·w̄ > max_pixels`: `β = √(h·w / max_pixels)`, `h̄ = max(factor, ⌊h / β / factor⌋·factor)`
//!      (same for `w̄`) — the `max(factor, ·)` clamp can leave the area above `max_pixels`;
//!    - else if `h̄·w̄ < min_pixels`: `β = √(min_pixels / (h·w))`, `h̄ = ⌈h·β / factor⌉·factor`
//!      (same for `w̄`) — no check against `max_pixels` afterwards (1×200 at 3136..6272 gives
//!      28×812);
//!    - transformers 5.x no longer rejects images smaller than the factor (a 1×1 image becomes
//!      56×56 at `min_pixels` 3136); older releases did.
//! 3. **Resize** ([`resize_bicubic_aa`]) as torchvision's CPU `uint8` path (which transformers'
//!    torchvision backend takes for bicubic): separable antialiased bicubic, kernel
//!    `a = −0.5` (Keys / Pillow), support `2·max(scale, 1)` input pixels, taps centred at
//!    `scale·(i + ½)`; the weights of each output pixel are normalised to sum 1, then turned into
//!    16-bit fixed point with the largest precision `p ≤ 22` for which `round(w_max·2^(p+1)) < 2^15`
//!    (`w_max` the largest weight of that axis), rounded half away from zero. The horizontal pass
//!    runs first, each output is `(2^(p−1) + Σ wᵢ·xᵢ) >> p` (arithmetic shift) clamped to
//!    `0..=255`, so the intermediate image is `u8`; an axis whose size does not change is
//!    skipped.
//! 4. **Rescale and normalise**, fused as the torchvision backend does, in `f32`:
//!    `(x − m) / s` with `m = f32(mean)·f32(1 / rescale_factor)` and
//!    `s = f32(std)·f32(1 / rescale_factor)` (`1 / rescale_factor` = 255).
//! 5. **Patchify**: frames are grouped by `temporal_patch_size` (`tp`); a still image is one
//!    frame repeated `tp` times (grid `t = 1`); a video with a frame count not a multiple of
//!    `tp` repeats its last frame. Rows are ordered (t, block row, block column, row in the
//!    `merge×merge` block, column in the block); each row holds `3·tp·p·p` values ordered
//!    (channel, frame in the temporal patch, row, column). `grid_thw = (t, h / p, w / p)`.
//!
//! # Video
//!
//! Frames come as images (a list of files or a directory, sorted by file name), or as a video
//! file (mp4, webm, mkv, mov, …) that [`process_video_path`](super::video::process_video_path) decodes with the system `ffmpeg`
//! (module [`video`](super::video): found as `$ARES_FFMPEG` or on `PATH`, else
//! [`VisionError::VideoFileNeedsDecoder`]; only the sampled frames are decoded and kept, `T` is
//! the decoded frame count and `source_fps` the file's average rate). With a sampling
//! rate ([`VideoSampling`]), frames are chosen as transformers' `Qwen2VLVideoProcessor.sample_frames`
//! does for `T` frames recorded at `source_fps`:
//! `n = T / source_fps · fps`, clamped to `[min_frames, ⌊min(max_frames, T) / tp⌋·tp]` and to `T`,
//! floored to a multiple of `tp`; with `step = T / n` the indices are
//! `trunc(f32(i·step))` for `i < n` (torch's `float32` `arange`; where rounding gives that
//! `arange` one more element, index `T`, transformers fails on it and we keep the first `n`). Without a rate every
//! frame is kept (transformers' default `do_sample_frames = False`). All frames must share one
//! size; they are resized to `smart_resize` of it with the video pixel bounds (no
//! `cap_pixels_per_frame`, transformers 5.24's default).

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The CLIP mean the Qwen2-VL processors default to.
#[allow(clippy::excessive_precision)]
pub const OPENAI_CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// The CLIP standard deviation the Qwen2-VL processors default to.
// Digits as the configs write them; the f32 rounding is the same.
#[allow(clippy::excessive_precision)]
pub const OPENAI_CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// transformers' default `min_pixels` (`size.shortest_edge`) of the image processor: 56·56.
pub const DEFAULT_MIN_PIXELS: usize = 56 * 56;
/// transformers' default `max_pixels` (`size.longest_edge`) of the image processor: 28·28·1280.
pub const DEFAULT_MAX_PIXELS: usize = 28 * 28 * 1280;
/// The largest `max(h, w) / min(h, w)` transformers accepts.
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// File extensions taken as frames when a directory of frames is read.
pub(crate) const FRAME_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "webp"];
/// File extensions recognised as video containers (decoded by ffmpeg, never as images).
const VIDEO_EXTENSIONS: [&str; 8] = ["mp4", "webm", "mkv", "avi", "mov", "m4v", "gif", "mpeg"];

/// How to get ffmpeg, for error messages.
pub const INSTALL_HINT: &str = "install ffmpeg (`apt install ffmpeg`), or `pip install \
     imageio-ffmpeg` and set ARES_FFMPEG to the binary it ships (`python -c 'import \
     imageio_ffmpeg; print(imageio_ffmpeg.get_ffmpeg_exe())'`)";

/// Errors of the processor. Errors about a file name the file.
#[derive(Debug)]
pub enum VisionError {
    /// A processor config file is unreadable, not JSON, or has a field of the wrong type or value.
    Config {
        /// The config file.
        file: PathBuf,
        /// The field (dotted path), empty when the whole file is at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// An image (or frame) file could not be read (missing, permissions, …).
    Io {
        /// The file.
        file: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file's format is not one the processor decodes (PNG, JPEG, WebP).
    UnsupportedFormat {
        /// The file.
        file: PathBuf,
        /// What the decoder said.
        message: String,
    },
    /// The file is a PNG / JPEG / WebP but cannot be decoded (truncated, corrupt).
    Decode {
        /// The file.
        file: PathBuf,
        /// What the decoder said.
        message: String,
    },
    /// An image size the processor cannot handle (a zero side, an aspect ratio above 200).
    ImageSize {
        /// Height in pixels.
        height: usize,
        /// Width in pixels.
        width: usize,
        /// What is wrong.
        message: String,
    },
    /// Pixel buffer and dimensions disagree.
    Buffer {
        /// What is wrong.
        message: String,
    },
    /// A bad argument (pixel bounds, sampling rates, patch sizes).
    Argument {
        /// What is wrong.
        message: String,
    },
    /// A video cannot be processed (no frames, frames of different sizes, nothing to sample).
    Video {
        /// What is wrong.
        message: String,
    },
    /// A video file needs ffmpeg to be decoded and none could be run (`$ARES_FFMPEG`, else
    /// `ffmpeg` on `PATH`); the message says how to install it.
    VideoFileNeedsDecoder {
        /// The video file.
        file: PathBuf,
        /// The ffmpeg looked for and why it failed (for example: none on `PATH`, or
        /// `ARES_FFMPEG` naming a file that does not exist).
        tried: String,
    },
    /// A video file that ffmpeg cannot decode (corrupt, not a video, no video stream), or whose
    /// decoding gives nothing usable (no frames, no frame rate to sample by); the message quotes
    /// ffmpeg where it said something.
    VideoFile {
        /// The video file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An error about one file's contents (for example its size), with the file named.
    InFile {
        /// The file.
        file: PathBuf,
        /// The error.
        source: Box<VisionError>,
    },
}

impl fmt::Display for VisionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VisionError::Config {
                file,
                field,
                message,
            } if field.is_empty() => {
                write!(f, "{}: {message}", file.display())
            }
            VisionError::Config {
                file,
                field,
                message,
            } => {
                write!(f, "{}: field `{field}`: {message}", file.display())
            }
            VisionError::Io { file, source } => {
                write!(f, "{}: cannot read image: {source}", file.display())
            }
            VisionError::UnsupportedFormat { file, message } => write!(
                f,
                "{}: unsupported image format (PNG, JPEG and WebP are decoded): {message}",
                file.display()
            ),
            VisionError::Decode { file, message } => {
                write!(f, "{}: corrupt image: {message}", file.display())
            }
            VisionError::ImageSize {
                height,
                width,
                message,
            } => {
                write!(f, "image of {height}×{width} (h×w): {message}")
            }
            VisionError::Buffer { message }
            | VisionError::Argument { message }
            | VisionError::Video { message } => f.write_str(message),
            VisionError::VideoFileNeedsDecoder { file, tried } => write!(
                f,
                "{}: decoding a video file needs ffmpeg, and none could be run ({tried}); {}",
                file.display(),
                INSTALL_HINT
            ),
            VisionError::VideoFile { file, message } => write!(f, "{}: {message}", file.display()),
            VisionError::InFile { file, source } => write!(f, "{}: {source}", file.display()),
        }
    }
}

impl std::error::Error for VisionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VisionError::Io { source, .. } => Some(source),
            VisionError::InFile { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

fn in_file(file: &Path, e: VisionError) -> VisionError {
    match e {
        // Already names its file.
        VisionError::Config { .. }
        | VisionError::Io { .. }
        | VisionError::UnsupportedFormat { .. }
        | VisionError::Decode { .. }
        | VisionError::VideoFileNeedsDecoder { .. }
        | VisionError::VideoFile { .. }
        | VisionError::InFile { .. } => e,
        other => VisionError::InFile {
            file: file.to_path_buf(),
            source: Box::new(other),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------

/// Video settings of the processor (transformers' `Qwen2VLVideoProcessor`).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoConfig {
    /// Lower pixel bound of a resized frame (`size.shortest_edge`).
    pub min_pixels: usize,
    /// Upper pixel bound of a resized frame (`size.longest_edge`).
    pub max_pixels: usize,
    /// Fewest frames sampling keeps (default 4).
    pub min_frames: usize,
    /// Most frames sampling keeps (default 768).
    pub max_frames: usize,
}

/// The processor's settings, from `preprocessor_config.json` (Hub layout) or
/// `processor_config.json` (transformers 5.x layout).
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    /// Side of a square patch in pixels (14).
    pub patch_size: usize,
    /// Patches merged per side by the vision tower's merger (2); sizes are multiples of
    /// `patch_size · merge_size`.
    pub merge_size: usize,
    /// Frames per temporal patch (2).
    pub temporal_patch_size: usize,
    /// Lower pixel bound of a resized image.
    pub min_pixels: usize,
    /// Upper pixel bound of a resized image.
    pub max_pixels: usize,
    /// Per-channel mean, in units of the rescaled pixel (0..1).
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation, in units of the rescaled pixel (0..1).
    pub image_std: [f32; 3],
    /// Factor taking `u8` pixels to 0..1 (1/255).
    pub rescale_factor: f64,
    /// Video settings.
    pub video: VideoConfig,
}

impl Default for ProcessorConfig {
    /// transformers 5.24's class defaults.
    fn default() -> Self {
        ProcessorConfig {
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: DEFAULT_MIN_PIXELS,
            max_pixels: DEFAULT_MAX_PIXELS,
            image_mean: OPENAI_CLIP_MEAN,
            image_std: OPENAI_CLIP_STD,
            rescale_factor: 1.0 / 255.0,
            video: VideoConfig {
                min_pixels: 128 * 28 * 28,
                max_pixels: 28 * 28 * 768,
                min_frames: 4,
                max_frames: 768,
            },
        }
    }
}

/// The processor config file names, in the order [`ProcessorConfig::from_model_dir`] tries them.
pub const CONFIG_FILES: [&str; 2] = ["processor_config.json", "preprocessor_config.json"];

impl ProcessorConfig {
    /// Reads the config of a model directory: `processor_config.json` (transformers 5.x, with
    /// `image_processor` / `video_processor` sections) if present, else
    /// `preprocessor_config.json` (Hub); `video_preprocessor_config.json` supplies the video
    /// section when the first file has none. Without any file, an error naming the directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self, VisionError> {
        for name in CONFIG_FILES {
            let file = dir.join(name);
            if file.is_file() {
                let mut cfg = Self::from_file(&file)?;
                let has_video = read_json(&file)?.get("video_processor").is_some();
                let video_file = dir.join("video_preprocessor_config.json");
                if !has_video && video_file.is_file() {
                    let v = read_json(&video_file)?;
                    cfg.video = parse_video(&v, &video_file, "", &cfg)?;
                }
                return Ok(cfg);
            }
        }
        Err(VisionError::Config {
            file: dir.to_path_buf(),
            field: String::new(),
            message: format!(
                "no {} or {} in the model directory",
                CONFIG_FILES[0], CONFIG_FILES[1]
            ),
        })
    }

    /// Reads one config file (either layout).
    pub fn from_file(file: &Path) -> Result<Self, VisionError> {
        let v = read_json(file)?;
        Self::from_json(&v, file)
    }

    /// Parses a config already read; `file` names it in errors.
    ///
    /// Both layouts: top-level `image_processor` / `video_processor` objects (transformers 5.x
    /// `processor_config.json`) or flat keys (`preprocessor_config.json`). Pixel bounds come from
    /// `min_pixels` / `max_pixels` (Hub), which win over `size.shortest_edge` /
    /// `size.longest_edge` (transformers 5.x) and the older `size.min_pixels` / `size.max_pixels`,
    /// as transformers' constructor does. Missing fields take transformers' defaults. The video
    /// section defaults to the image section's pixel bounds (a Hub `preprocessor_config.json`
    /// configures both processors).
    pub fn from_json(v: &Value, file: &Path) -> Result<Self, VisionError> {
        let obj = v.as_object().ok_or_else(|| VisionError::Config {
            file: file.to_path_buf(),
            field: String::new(),
            message: "expected a JSON object".into(),
        })?;
        let (img, prefix) = match obj.get("image_processor") {
            Some(section) => (section, "image_processor."),
            None => (v, ""),
        };
        let d = ProcessorConfig::default();
        let f = Fields {
            v: img,
            file,
            prefix,
        };
        f.expect_object()?;
        for flag in ["do_resize", "do_rescale", "do_normalize"] {
            if f.bool(flag)? == Some(false) {
                return Err(f.err(
                    flag,
                    "must be true (the processor always resizes, rescales and normalises)",
                ));
            }
        }
        if let Some(r) = f.uint("resample")?
            && r != 3
        {
            return Err(f.err(
                "resample",
                format!("{r} is not 3 (bicubic), the only resampling supported"),
            ));
        }
        let (min_pixels, max_pixels) = f.pixel_bounds(d.min_pixels, d.max_pixels)?;
        let mut cfg = ProcessorConfig {
            patch_size: f.uint("patch_size")?.unwrap_or(d.patch_size),
            merge_size: f.uint("merge_size")?.unwrap_or(d.merge_size),
            temporal_patch_size: f
                .uint("temporal_patch_size")?
                .unwrap_or(d.temporal_patch_size),
            min_pixels,
            max_pixels,
            image_mean: f.triple("image_mean")?.unwrap_or(d.image_mean),
            image_std: f.triple("image_std")?.unwrap_or(d.image_std),
            rescale_factor: f.float("rescale_factor")?.unwrap_or(d.rescale_factor),
            video: d.video.clone(),
        };
        for (name, value) in [
            ("patch_size", cfg.patch_size),
            ("merge_size", cfg.merge_size),
            ("temporal_patch_size", cfg.temporal_patch_size),
        ] {
            if value == 0 {
                return Err(f.err(name, "must be positive"));
            }
        }
        if !(cfg.rescale_factor > 0.0 && cfg.rescale_factor.is_finite()) {
            return Err(f.err("rescale_factor", "must be positive and finite"));
        }
        if let Some(i) = cfg
            .image_std
            .iter()
            .position(|&s| s == 0.0 || !s.is_finite())
        {
            return Err(f.err(&format!("image_std[{i}]"), "must be nonzero and finite"));
        }
        cfg.video = match obj.get("video_processor") {
            Some(section) => parse_video(section, file, "video_processor.", &cfg)?,
            None => parse_video(img, file, prefix, &cfg)?,
        };
        if cfg.min_pixels > cfg.max_pixels {
            return Err(f.err(
                "size",
                format!(
                    "min_pixels {} exceeds max_pixels {}",
                    cfg.min_pixels, cfg.max_pixels
                ),
            ));
        }
        Ok(cfg)
    }

    /// The config with its image pixel bounds overridden (`None` keeps a bound), as a training
    /// config's `min_pixels` / `max_pixels` do.
    pub fn with_pixels(
        mut self,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
    ) -> Result<Self, VisionError> {
        self.min_pixels = min_pixels.unwrap_or(self.min_pixels);
        self.max_pixels = max_pixels.unwrap_or(self.max_pixels);
        check_bounds(self.min_pixels, self.max_pixels)?;
        Ok(self)
    }

    /// The config with its video frame pixel bounds overridden (`None` keeps a bound).
    pub fn with_video_pixels(
        mut self,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
    ) -> Result<Self, VisionError> {
        self.video.min_pixels = min_pixels.unwrap_or(self.video.min_pixels);
        self.video.max_pixels = max_pixels.unwrap_or(self.video.max_pixels);
        check_bounds(self.video.min_pixels, self.video.max_pixels)?;
        Ok(self)
    }

    /// `patch_size · merge_size`, the multiple resized sides are rounded to.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Values per patch row: `3 · temporal_patch_size · patch_size²`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

fn check_bounds(min_pixels: usize, max_pixels: usize) -> Result<(), VisionError> {
    if min_pixels == 0 || min_pixels > max_pixels {
        return Err(VisionError::Argument {
            message: format!(
                "pixel bounds must satisfy 0 < min_pixels ≤ max_pixels, got min_pixels {min_pixels}, \
                 max_pixels {max_pixels}"
            ),
        });
    }
    Ok(())
}

fn parse_video(
    v: &Value,
    file: &Path,
    prefix: &str,
    image: &ProcessorConfig,
) -> Result<VideoConfig, VisionError> {
    let f = Fields { v, file, prefix };
    f.expect_object()?;
    let (min_pixels, max_pixels) = f.pixel_bounds(image.min_pixels, image.max_pixels)?;
    let cfg = VideoConfig {
        min_pixels,
        max_pixels,
        min_frames: f.uint("min_frames")?.unwrap_or(4),
        max_frames: f.uint("max_frames")?.unwrap_or(768),
    };
    if cfg.min_pixels > cfg.max_pixels {
        return Err(f.err(
            "size",
            format!(
                "min_pixels {} exceeds max_pixels {}",
                cfg.min_pixels, cfg.max_pixels
            ),
        ));
    }
    Ok(cfg)
}

fn read_json(file: &Path) -> Result<Value, VisionError> {
    let text = std::fs::read_to_string(file).map_err(|e| VisionError::Config {
        file: file.to_path_buf(),
        field: String::new(),
        message: format!("cannot read: {e}"),
    })?;
    serde_json::from_str(&text).map_err(|e| VisionError::Config {
        file: file.to_path_buf(),
        field: String::new(),
        message: format!("not valid JSON: {e}"),
    })
}

/// Typed access to the fields of one config object, with errors naming file and field.
struct Fields<'a> {
    v: &'a Value,
    file: &'a Path,
    prefix: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> VisionError {
        VisionError::Config {
            file: self.file.to_path_buf(),
            field: format!("{}{field}", self.prefix),
            message: message.into(),
        }
    }

    fn expect_object(&self) -> Result<(), VisionError> {
        if self.v.is_object() {
            Ok(())
        } else {
            let field = self.prefix.trim_end_matches('.');
            Err(VisionError::Config {
                file: self.file.to_path_buf(),
                field: field.to_string(),
                message: "expected a JSON object".into(),
            })
        }
    }

    fn get(&self, path: &str) -> Option<&Value> {
        let mut v = self.v;
        for key in path.split('.') {
            v = v.get(key)?;
        }
        (!v.is_null()).then_some(v)
    }

    fn uint(&self, path: &str) -> Result<Option<usize>, VisionError> {
        match self.get(path) {
            None => Ok(None),
            Some(v) => {
                // Integral floats (3136.0) are accepted, as Python would.
                let n = v.as_u64().or_else(|| {
                    v.as_f64()
                        .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x < 2f64.powi(53))
                        .map(|x| x as u64)
                });
                match n.and_then(|n| usize::try_from(n).ok()) {
                    Some(n) => Ok(Some(n)),
                    None => {
                        Err(self.err(path, format!("expected a non-negative integer, got {v}")))
                    }
                }
            }
        }
    }

    fn float(&self, path: &str) -> Result<Option<f64>, VisionError> {
        match self.get(path) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(path, format!("expected a number, got {v}"))),
        }
    }

    fn bool(&self, path: &str) -> Result<Option<bool>, VisionError> {
        match self.get(path) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(path, format!("expected true or false, got {v}"))),
        }
    }

    /// A mean / std: a list of 3 numbers, or one number for all channels.
    fn triple(&self, path: &str) -> Result<Option<[f32; 3]>, VisionError> {
        let Some(v) = self.get(path) else {
            return Ok(None);
        };
        if let Some(x) = v.as_f64() {
            return Ok(Some([x as f32; 3]));
        }
        let bad = || self.err(path, format!("expected a list of 3 numbers, got {v}"));
        let list = v.as_array().ok_or_else(bad)?;
        if list.len() != 3 {
            return Err(bad());
        }
        let mut out = [0f32; 3];
        for (o, x) in out.iter_mut().zip(list) {
            *o = x.as_f64().ok_or_else(bad)? as f32;
        }
        Ok(Some(out))
    }

    /// `(min_pixels, max_pixels)`: top-level keys win over `size.*_edge` and `size.*_pixels`.
    fn pixel_bounds(
        &self,
        min_default: usize,
        max_default: usize,
    ) -> Result<(usize, usize), VisionError> {
        if let Some(size) = self.get("size")
            && !size.is_object()
        {
            return Err(self.err("size", format!("expected an object, got {size}")));
        }
        let pick = |names: [&str; 3], default: usize| -> Result<usize, VisionError> {
            for name in names {
                if let Some(n) = self.uint(name)? {
                    if n == 0 {
                        return Err(self.err(name, "must be positive"));
                    }
                    return Ok(n);
                }
            }
            Ok(default)
        };
        Ok((
            pick(
                ["min_pixels", "size.shortest_edge", "size.min_pixels"],
                min_default,
            )?,
            pick(
                ["max_pixels", "size.longest_edge", "size.max_pixels"],
                max_default,
            )?,
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// smart_resize
// ---------------------------------------------------------------------------------------------

/// The `(height, width)` an image of `height × width` is resized to: multiples of `factor`, area
/// near `[min_pixels, max_pixels]`, aspect ratio kept as closely as possible (formulas in the
/// module docs). Errors on a zero side, a zero factor, or an aspect ratio above 200.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), VisionError> {
    if factor == 0 {
        return Err(VisionError::Argument {
            message: "smart_resize: factor must be positive".into(),
        });
    }
    if height == 0 || width == 0 {
        return Err(VisionError::ImageSize {
            height,
            width,
            message: "the image is empty".into(),
        });
    }
    let (hi, lo) = (height.max(width), height.min(width));
    let ratio = hi as f64 / lo as f64;
    if ratio > MAX_ASPECT_RATIO {
        return Err(VisionError::ImageSize {
            height,
            width,
            message: format!(
                "aspect ratio {ratio} exceeds {MAX_ASPECT_RATIO}, the most transformers accepts"
            ),
        });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    // Python's round(): half to even.
    let mut h_bar = (h / f).round_ties_even() as usize * factor;
    let mut w_bar = (w / f).round_ties_even() as usize * factor;
    // Integer areas in f64 are exact below 2^53; Python's int / int is the correctly rounded
    // quotient, as is the f64 division of the exact operands.
    let area = (height as u128 * width as u128) as f64;
    let bar_area = h_bar as u128 * w_bar as u128;
    if bar_area > max_pixels as u128 {
        let beta = (area / max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if bar_area < min_pixels as u128 {
        let beta = (min_pixels as f64 / area).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

// ---------------------------------------------------------------------------------------------
// Images and resizing
// ---------------------------------------------------------------------------------------------

/// A decoded RGB image, 8 bits per channel, rows top to bottom, pixels interleaved (`RGBRGB…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// `height · width · 3` bytes.
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// An image from interleaved RGB bytes; errors if the length is not `height · width · 3`.
    pub fn new(height: usize, width: usize, pixels: Vec<u8>) -> Result<Self, VisionError> {
        if height.checked_mul(width).and_then(|n| n.checked_mul(3)) != Some(pixels.len()) {
            return Err(VisionError::Buffer {
                message: format!(
                    "an RGB image of {height}×{width} needs {} bytes, got {}",
                    height as u128 * width as u128 * 3,
                    pixels.len()
                ),
            });
        }
        Ok(RgbImage {
            height,
            width,
            pixels,
        })
    }
}

/// The bicubic kernel with `a = −0.5`.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Fixed-point antialiased resampling weights of one axis.
struct AxisWeights {
    /// First input index of each output.
    start: Vec<usize>,
    /// Number of taps of each output.
    len: Vec<usize>,
    /// `ksize` weights per output (the first `len[i]` used).
    weights: Vec<i32>,
    ksize: usize,
    precision: u32,
}

fn axis_weights(in_size: usize, out_size: usize) -> AxisWeights {
    let scale = in_size as f64 / out_size as f64;
    let (support, inv_scale) = if scale >= 1.0 {
        (2.0 * scale, 1.0 / scale)
    } else {
        (2.0, 1.0)
    };
    let ksize = support.ceil() as usize * 2 + 1;
    let mut float_w = vec![0f64; out_size * ksize];
    let mut start = Vec::with_capacity(out_size);
    let mut len = Vec::with_capacity(out_size);
    let mut w_max = 0f64;
    for i in 0..out_size {
        let center = scale * (i as f64 + 0.5);
        // `as i64` truncates toward zero, as the C cast does.
        let lo = ((center - support + 0.5) as i64).max(0);
        let hi = ((center + support + 0.5) as i64).min(in_size as i64);
        let n = (hi - lo).max(0) as usize;
        let row = &mut float_w[i * ksize..i * ksize + ksize];
        let mut total = 0.0;
        for (j, w) in row.iter_mut().take(n).enumerate() {
            *w = bicubic((j as f64 + lo as f64 - center + 0.5) * inv_scale);
            total += *w;
        }
        if total != 0.0 {
            for w in row.iter_mut().take(n) {
                *w /= total;
            }
        }
        for w in row.iter().take(n) {
            w_max = w_max.max(*w);
        }
        start.push(lo as usize);
        len.push(n);
    }
    // The largest precision keeping the largest weight (doubled) inside i16.
    let mut precision = 0u32;
    while precision < 22 {
        let next = (0.5 + w_max * f64::from(1u32 << (precision + 1))) as i64;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let one = f64::from(1u32 << precision);
    let weights = float_w
        .iter()
        .map(|&w| {
            if w < 0.0 {
                (-0.5 + w * one) as i32
            } else {
                (0.5 + w * one) as i32
            }
        })
        .collect();
    AxisWeights {
        start,
        len,
        weights,
        ksize,
        precision,
    }
}

#[inline]
fn fixed_to_u8(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Resizes an RGB image with antialiased bicubic resampling as torchvision's CPU `uint8` path
/// does (horizontal pass first, `u8` intermediate; details in the module docs).
pub fn resize_bicubic_aa(
    img: &RgbImage,
    out_h: usize,
    out_w: usize,
) -> Result<RgbImage, VisionError> {
    if img.height == 0 || img.width == 0 || out_h == 0 || out_w == 0 {
        return Err(VisionError::ImageSize {
            height: img.height,
            width: img.width,
            message: format!("cannot resize to or from an empty image (target {out_h}×{out_w})"),
        });
    }
    if img.pixels.len() != img.height * img.width * 3 {
        return Err(VisionError::Buffer {
            message: format!(
                "an RGB image of {}×{} needs {} bytes, got {}",
                img.height,
                img.width,
                img.height * img.width * 3,
                img.pixels.len()
            ),
        });
    }
    let (in_h, in_w) = (img.height, img.width);
    // Horizontal pass.
    let horizontal = if out_w != in_w {
        let aw = axis_weights(in_w, out_w);
        let half = if aw.precision == 0 {
            0
        } else {
            1i32 << (aw.precision - 1)
        };
        let mut out = vec![0u8; in_h * out_w * 3];
        for y in 0..in_h {
            let src = &img.pixels[y * in_w * 3..(y + 1) * in_w * 3];
            let dst = &mut out[y * out_w * 3..(y + 1) * out_w * 3];
            for x in 0..out_w {
                let ws = &aw.weights[x * aw.ksize..x * aw.ksize + aw.len[x]];
                let s0 = aw.start[x];
                for c in 0..3 {
                    let mut acc = half;
                    for (k, &w) in ws.iter().enumerate() {
                        acc += i32::from(src[(s0 + k) * 3 + c]) * w;
                    }
                    dst[x * 3 + c] = fixed_to_u8(acc, aw.precision);
                }
            }
        }
        RgbImage {
            height: in_h,
            width: out_w,
            pixels: out,
        }
    } else {
        img.clone()
    };
    if out_h == in_h {
        return Ok(horizontal);
    }
    // Vertical pass.
    let aw = axis_weights(in_h, out_h);
    let half = if aw.precision == 0 {
        0
    } else {
        1i32 << (aw.precision - 1)
    };
    let row_len = out_w * 3;
    let mut out = vec![0u8; out_h * row_len];
    let mut acc = vec![0i32; row_len];
    for y in 0..out_h {
        acc.fill(half);
        let ws = &aw.weights[y * aw.ksize..y * aw.ksize + aw.len[y]];
        for (k, &w) in ws.iter().enumerate() {
            let src =
                &horizontal.pixels[(aw.start[y] + k) * row_len..(aw.start[y] + k + 1) * row_len];
            for (a, &p) in acc.iter_mut().zip(src) {
                *a += i32::from(p) * w;
            }
        }
        for (o, &a) in out[y * row_len..(y + 1) * row_len].iter_mut().zip(&acc) {
            *o = fixed_to_u8(a, aw.precision);
        }
    }
    Ok(RgbImage {
        height: out_h,
        width: out_w,
        pixels: out,
    })
}

// ---------------------------------------------------------------------------------------------
// Normalisation and patchify
// ---------------------------------------------------------------------------------------------

/// Processor output for one image.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// `[n_patches, 3·tp·p·p]`, row-major.
    pub pixel_values: Vec<f32>,
    /// `(t, h / p, w / p)`; `t = 1` for an image.
    pub grid_thw: [usize; 3],
}

impl ProcessedImage {
    /// Number of patch rows, `t · h · w` of the grid.
    pub fn n_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }
}

/// Processor output for one video.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedVideo {
    /// `[n_patches, 3·tp·p·p]`, row-major.
    pub pixel_values_videos: Vec<f32>,
    /// `(frames / tp, h / p, w / p)`.
    pub video_grid_thw: [usize; 3],
    /// Indices of the input frames used, in order (before the last is repeated for padding).
    pub frame_indices: Vec<usize>,
}

/// Per-channel `(x − m) / s` constants of the fused rescale + normalise, in `f32` as the
/// torchvision backend computes them.
fn norm_constants(cfg: &ProcessorConfig) -> ([f32; 3], [f32; 3]) {
    let inv = (1.0 / cfg.rescale_factor) as f32;
    let mut m = [0f32; 3];
    let mut s = [0f32; 3];
    for c in 0..3 {
        m[c] = cfg.image_mean[c] * inv;
        s[c] = cfg.image_std[c] * inv;
    }
    (m, s)
}

/// Normalised planes `[3][h·w]` of a resized frame.
fn normalize(img: &RgbImage, cfg: &ProcessorConfig) -> Vec<f32> {
    let (m, s) = norm_constants(cfg);
    let n = img.height * img.width;
    let mut planes = vec![0f32; 3 * n];
    for (i, px) in img.pixels.chunks_exact(3).enumerate() {
        for c in 0..3 {
            planes[c * n + i] = (f32::from(px[c]) - m[c]) / s[c];
        }
    }
    planes
}

/// Patch rows of normalised frames (each `[3][h·w]`; count a multiple of tp).
fn patchify(
    frames: &[Vec<f32>],
    h: usize,
    w: usize,
    cfg: &ProcessorConfig,
) -> (Vec<f32>, [usize; 3]) {
    let (p, m, tp) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    debug_assert!(
        frames.len().is_multiple_of(tp) && h.is_multiple_of(p * m) && w.is_multiple_of(p * m)
    );
    let (gt, gh, gw) = (frames.len() / tp, h / p, w / p);
    let dim = cfg.patch_dim();
    let n = h * w;
    let mut out = Vec::with_capacity(gt * gh * gw * dim);
    for t in 0..gt {
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for frame in &frames[t * tp..(t + 1) * tp] {
                                let plane = &frame[c * n..(c + 1) * n];
                                for y in y0..y0 + p {
                                    out.extend_from_slice(&plane[y * w + x0..y * w + x0 + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    (out, [gt, gh, gw])
}

/// Processes a decoded RGB image: `smart_resize` with the config's image pixel bounds, bicubic
/// resize, normalise, one temporal patch of the image repeated, patchify.
pub fn process_image(img: &RgbImage, cfg: &ProcessorConfig) -> Result<ProcessedImage, VisionError> {
    let (h, w) = smart_resize(
        img.height,
        img.width,
        cfg.factor(),
        cfg.min_pixels,
        cfg.max_pixels,
    )?;
    let resized = resize_bicubic_aa(img, h, w)?;
    let planes = normalize(&resized, cfg);
    let frames = vec![planes; cfg.temporal_patch_size];
    let (pixel_values, grid_thw) = patchify(&frames, h, w, cfg);
    Ok(ProcessedImage {
        pixel_values,
        grid_thw,
    })
}

/// Decodes an image file and processes it; errors name the file.
pub fn process_image_file(
    path: &Path,
    cfg: &ProcessorConfig,
) -> Result<ProcessedImage, VisionError> {
    let img = load_rgb(path)?;
    process_image(&img, cfg).map_err(|e| in_file(path, e))
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

pub(crate) fn has_extension(path: &Path, list: &[&str]) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| list.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

/// Decodes a PNG, JPEG or WebP file (format from its bytes) to RGB as PIL's `convert("RGB")`
/// does: grey replicated, alpha dropped, 16-bit samples reduced to 8. Errors name the file:
/// missing or unreadable, unsupported format (video files included: [`process_video_path`](super::video::process_video_path)
/// decodes those), corrupt data.
pub fn load_rgb(path: &Path) -> Result<RgbImage, VisionError> {
    if has_extension(path, &VIDEO_EXTENSIONS) {
        return Err(video_not_image(path));
    }
    let bytes = std::fs::read(path).map_err(|e| VisionError::Io {
        file: path.to_path_buf(),
        source: e,
    })?;
    decode_rgb(&bytes, path)
}

/// The most pixels an image may have: PIL's decompression-bomb limit (2 × 89 478 485),
/// which transformers' image loading inherits. Checked from the header, before decoding.
pub const MAX_IMAGE_PIXELS: u64 = 178_956_970;

/// Decodes image bytes (PNG, JPEG or WebP); `name` names the source in errors. An image of
/// more than [`MAX_IMAGE_PIXELS`] is refused from its header, before any pixel is decoded.
pub fn decode_rgb(bytes: &[u8], name: &Path) -> Result<RgbImage, VisionError> {
    use image::ImageFormat;
    let file = name.to_path_buf();
    let format = image::guess_format(bytes).map_err(|e| VisionError::UnsupportedFormat {
        file: file.clone(),
        message: format!(
            "{e} (file starts with {:02x?})",
            &bytes[..bytes.len().min(8)]
        ),
    })?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP
    ) {
        return Err(VisionError::UnsupportedFormat {
            file,
            message: format!("{format:?}"),
        });
    }
    // the header's size first: a small file may declare a huge image (a decompression bomb)
    let (w, h) = image::ImageReader::with_format(std::io::Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| VisionError::Decode {
            file: file.clone(),
            message: e.to_string(),
        })?;
    if u64::from(w) * u64::from(h) > MAX_IMAGE_PIXELS {
        return Err(in_file(
            name,
            VisionError::ImageSize {
                height: h as usize,
                width: w as usize,
                message: format!(
                    "more than {MAX_IMAGE_PIXELS} pixels (PIL's decompression-bomb limit, which \
                     transformers inherits); refused before decoding"
                ),
            },
        ));
    }
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    let mut limits = image::Limits::default();
    // RGBA at the pixel limit, and some room for the decoder's own buffers
    limits.max_alloc = Some(MAX_IMAGE_PIXELS * 4 + (64 << 20));
    reader.limits(limits);
    let decoded = reader.decode().map_err(|e| match e {
        image::ImageError::Unsupported(u) => VisionError::UnsupportedFormat {
            file: file.clone(),
            message: u.to_string(),
        },
        image::ImageError::IoError(io) => VisionError::Decode {
            file: file.clone(),
            message: io.to_string(),
        },
        other => VisionError::Decode {
            file: file.clone(),
            message: other.to_string(),
        },
    })?;
    let rgb = decoded.into_rgb8();
    let (w, h) = (rgb.width() as usize, rgb.height() as usize);
    RgbImage::new(h, w, rgb.into_raw()).map_err(|e| in_file(name, e))
}

/// A video file where an image (or a frame image) was expected.
fn video_not_image(path: &Path) -> VisionError {
    VisionError::UnsupportedFormat {
        file: path.to_path_buf(),
        message: "a video file, not an image: pass it alone as the video (process_video_path \
                  decodes it with ffmpeg)"
            .into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Video
// ---------------------------------------------------------------------------------------------

/// How frames of a video are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct VideoSampling {
    /// Frames per second the frames were recorded at.
    pub source_fps: Option<f64>,
    /// Frames per second to keep (`data.video_fps` in training); `None` keeps every frame.
    pub fps: Option<f64>,
}

/// Indices of the frames kept out of `total` (rule in the module docs). With `sampling.fps`
/// unset, every frame. Errors when a rate is not positive, the source rate is missing, or no
/// frame would be kept (fewer than `temporal_patch_size` frames).
pub fn sample_frame_indices(
    total: usize,
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<Vec<usize>, VisionError> {
    if total == 0 {
        return Err(VisionError::Video {
            message: "the video has no frames".into(),
        });
    }
    let Some(fps) = sampling.fps else {
        return Ok((0..total).collect());
    };
    let Some(source_fps) = sampling.source_fps else {
        return Err(VisionError::Argument {
            message: format!("sampling at {fps} fps needs the frames' own rate (source_fps)"),
        });
    };
    if !(fps > 0.0 && fps.is_finite() && source_fps > 0.0 && source_fps.is_finite()) {
        return Err(VisionError::Argument {
            message: format!(
                "frame rates must be positive and finite, got fps {fps}, source_fps {source_fps}"
            ),
        });
    }
    let tp = cfg.temporal_patch_size;
    let max_frames = (cfg.video.max_frames.min(total) / tp * tp) as f64;
    let n = (total as f64 / source_fps * fps)
        .max(cfg.video.min_frames as f64)
        .min(max_frames)
        .min(total as f64);
    let n = (n / tp as f64).floor() * tp as f64;
    if n < 1.0 {
        return Err(VisionError::Video {
            message: format!(
                "cannot sample {total} frame(s) at {fps} fps (source {source_fps} fps): at least \
                 temporal_patch_size = {tp} frames are needed"
            ),
        });
    }
    // torch's float arange(0, T, T / n) has ⌈T / step⌉ elements, which rounding makes n + 1 for
    // some (T, n) (17 frames, n = 14); its extra last index is T, out of range (transformers
    // then fails indexing the video). The first n indices are the same, and are what we keep.
    let step = total as f64 / n;
    Ok((0..n as usize)
        .map(|i| ((i as f64 * step) as f32 as usize).min(total - 1))
        .collect())
}

/// Processes a video given as decoded frames (all of one size): sample, resize each frame to
/// `smart_resize` of the frame size with the video pixel bounds, normalise, repeat the last frame
/// up to a multiple of `temporal_patch_size`, patchify.
pub fn process_video_frames(
    frames: &[RgbImage],
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    let indices = sample_frame_indices(frames.len(), sampling, cfg)?;
    let chosen: Vec<&RgbImage> = indices.iter().map(|&i| &frames[i]).collect();
    process_chosen(&chosen, indices, cfg)
}

/// The frame pipeline shared by frame images and decoded video files: `frames` are the chosen
/// frames, `frame_indices` their numbers in the video.
pub(crate) fn process_chosen(
    frames: &[&RgbImage],
    frame_indices: Vec<usize>,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    let first = frames.first().ok_or_else(|| VisionError::Video {
        message: "the video has no frames".into(),
    })?;
    if let Some((i, f)) = frames
        .iter()
        .enumerate()
        .find(|(_, f)| (f.height, f.width) != (first.height, first.width))
    {
        return Err(VisionError::Video {
            message: format!(
                "all frames of a video must have one size: frame {} is {}×{}, frame {} is {}×{}",
                frame_indices[0], first.height, first.width, frame_indices[i], f.height, f.width
            ),
        });
    }
    let (h, w) = smart_resize(
        first.height,
        first.width,
        cfg.factor(),
        cfg.video.min_pixels,
        cfg.video.max_pixels,
    )?;
    let mut planes = Vec::with_capacity(
        frames.len().div_ceil(cfg.temporal_patch_size) * cfg.temporal_patch_size,
    );
    for f in frames {
        planes.push(normalize(&resize_bicubic_aa(f, h, w)?, cfg));
    }
    while !planes.len().is_multiple_of(cfg.temporal_patch_size) {
        let last = planes[planes.len() - 1].clone();
        planes.push(last);
    }
    let (pixel_values_videos, video_grid_thw) = patchify(&planes, h, w, cfg);
    Ok(ProcessedVideo {
        pixel_values_videos,
        video_grid_thw,
        frame_indices,
    })
}

/// Processes a video given as frame image files, in the order given. Only the sampled frames
/// are decoded; errors name the file at fault. A video file among them is an error
/// ([`process_video_path`](super::video::process_video_path) takes one video file).
pub fn process_video_files(
    paths: &[PathBuf],
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    if let Some(p) = paths.iter().find(|p| has_extension(p, &VIDEO_EXTENSIONS)) {
        return Err(video_not_image(p));
    }
    let indices = sample_frame_indices(paths.len(), sampling, cfg)?;
    let mut frames = Vec::with_capacity(indices.len());
    for &i in &indices {
        frames.push(load_rgb(&paths[i])?);
    }
    let chosen: Vec<&RgbImage> = frames.iter().collect();
    process_chosen(&chosen, indices, cfg).map_err(|e| match e {
        VisionError::Video { message } if message.contains("one size") => VisionError::Video {
            message: format!("{message} (frames {} …)", paths[0].display()),
        },
        other => other,
    })
}

/// The frame files of a directory: files with a PNG / JPEG / WebP extension, sorted by name.
pub fn frame_files(dir: &Path) -> Result<Vec<PathBuf>, VisionError> {
    let entries = std::fs::read_dir(dir).map_err(|e| VisionError::Io {
        file: dir.to_path_buf(),
        source: e,
    })?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| VisionError::Io {
                file: dir.to_path_buf(),
                source: e,
            })?
            .path();
        if path.is_file() && has_extension(&path, &FRAME_EXTENSIONS) {
            files.push(path);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(VisionError::InFile {
            file: dir.to_path_buf(),
            source: Box::new(VisionError::Video {
                message: format!(
                    "no frame images ({}) in the directory",
                    FRAME_EXTENSIONS.join(", ")
                ),
            }),
        });
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_half_even_cases() {
        assert_eq!(
            smart_resize(126, 70, 28, 3136, 12_845_056).unwrap(),
            (112, 56)
        );
        assert_eq!(smart_resize(42, 42, 28, 784, 12_845_056).unwrap(), (56, 56)); // 1.5 -> 2
    }

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(10, 3), (3, 10), (97, 28), (400, 336), (20, 28)] {
            let aw = axis_weights(i, o);
            for x in 0..o {
                let s: i64 = aw.weights[x * aw.ksize..x * aw.ksize + aw.len[x]]
                    .iter()
                    .map(|&w| i64::from(w))
                    .sum();
                let one = 1i64 << aw.precision;
                assert!(
                    (s - one).abs() <= aw.len[x] as i64,
                    "{i}->{o} at {x}: {s} vs {one}"
                );
            }
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let img = RgbImage::new(7, 9, [10u8, 200, 255].repeat(63)).unwrap();
        for (h, w) in [(3, 4), (20, 30), (7, 30), (2, 9)] {
            let r = resize_bicubic_aa(&img, h, w).unwrap();
            assert!(
                r.pixels.chunks_exact(3).all(|p| p == [10, 200, 255]),
                "{h}x{w}"
            );
        }
    }
}
