//! An example's images and videos as the model's inputs: [`MediaProcessor`] (the model's
//! image processor with `data.min_pixels` / `data.max_pixels` / `data.video_fps`),
//! [`load_media`] (decode and process, → [`ExampleMedia`] → [`VisionBatch`]),
//! [`vision_token_count`] (the placeholder tokens a prompt expands to, from the sizes alone, for
//! prompt-length filtering) and [`render_prompt`] (a prompt with image content items through a
//! Qwen2-VL chat template).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::{DataError, Result};
use super::example::{Example, Prompt};
use super::keys::MediaKeys;
use super::media::{MediaKind, MediaSource};
use super::template::PromptTemplate;
use crate::config::DataConfig;
use crate::hf::chat::{ChatTemplate, RenderOptions};
use crate::vision::model::VisionBatch;
use crate::vision::processor::{
    ProcessedImage, ProcessedVideo, ProcessorConfig, VideoSampling, VisionError, decode_rgb,
    frame_files, load_rgb, process_image, process_image_file, process_video_files, smart_resize,
};
use crate::vision::video::process_video_path;
use crate::vision::video::{Ffmpeg, probe, sample_indices};

/// The image and video processor of a training run: the model's processor config with the
/// data section's pixel bounds, the video sampling rate, and the media columns (named in
/// errors).
#[derive(Debug, Clone, PartialEq)]
pub struct MediaProcessor {
    /// The processor settings, image pixel bounds already overridden by `data.min_pixels` /
    /// `data.max_pixels`. Video frames keep the model's video bounds.
    pub config: ProcessorConfig,
    /// Frames per second sampled from video files (`data.video_fps`).
    pub video_fps: f64,
    /// The media columns, for messages.
    pub keys: MediaKeys,
}

impl MediaProcessor {
    /// `model` (the model's processor config) with the image pixel bounds overridden where
    /// given (`None` keeps the model's).
    ///
    /// Errors ([`DataError::Processor`]): a bound of 0, `min_pixels > max_pixels` after the
    /// override (e.g. `data.min_pixels` above the model's `max_pixels`), `video_fps` not
    /// positive and finite.
    pub fn new(
        model: ProcessorConfig,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
        video_fps: f64,
        keys: MediaKeys,
    ) -> Result<Self> {
        if !(video_fps > 0.0 && video_fps.is_finite()) {
            return Err(DataError::Processor(format!(
                "data.video_fps = {video_fps} must be positive and finite"
            )));
        }
        let (model_min, model_max) = (model.min_pixels, model.max_pixels);
        let config = model.with_pixels(min_pixels, max_pixels).map_err(|e| {
            DataError::Processor(format!(
                "data.min_pixels = {} / data.max_pixels = {} (the model's: {model_min} / \
                 {model_max}): {e}",
                min_pixels.map_or("null".into(), |v| v.to_string()),
                max_pixels.map_or("null".into(), |v| v.to_string()),
            ))
        })?;
        Ok(Self {
            config,
            video_fps,
            keys,
        })
    }

    /// [`new`](Self::new) with the `data` section's `min_pixels`, `max_pixels`, `video_fps`,
    /// `image_key` and `video_key`.
    pub fn from_config(model: ProcessorConfig, data: &DataConfig) -> Result<Self> {
        Self::new(
            model,
            data.min_pixels,
            data.max_pixels,
            data.video_fps,
            MediaKeys::from_config(data),
        )
    }

    /// The processor of a model directory (`processor_config.json` or
    /// `preprocessor_config.json`, [`ProcessorConfig::from_model_dir`]) with the `data`
    /// section's settings.
    ///
    /// Errors: no or a malformed processor config ([`DataError::Processor`]), and as
    /// [`new`](Self::new).
    pub fn from_model_dir(dir: &Path, data: &DataConfig) -> Result<Self> {
        let model = ProcessorConfig::from_model_dir(dir)
            .map_err(|e| DataError::Processor(format!("{}: {e}", dir.display())))?;
        Self::from_config(model, data)
    }

    /// How a video file is sampled: at `video_fps` of the file's own rate. (A directory or a
    /// list of frames keeps every frame, taken to be recorded at `video_fps`, as
    /// qwen-vl-utils does with frame lists.)
    pub fn file_sampling(&self) -> VideoSampling {
        VideoSampling {
            source_fps: None,
            fps: Some(self.video_fps),
        }
    }

    /// `second_per_grid_ts` of every video: `temporal_patch_size / video_fps`.
    pub fn second_per_grid_t(&self) -> f64 {
        self.config.temporal_patch_size as f64 / self.video_fps
    }

    /// [`load_media`] with this processor.
    ///
    /// # Errors
    /// As [`load_media`].
    pub fn load(&self, example: &Example) -> Result<ExampleMedia> {
        load_media(example, self)
    }

    /// [`vision_token_count`] with this processor.
    ///
    /// # Errors
    /// As [`vision_token_count`].
    pub fn token_count(&self, example: &Example) -> Result<usize> {
        vision_token_count(example, self)
    }

    /// The length of `example`'s prompt once its placeholders are expanded: `rendered_len`
    /// (the token count of the rendered prompt, which holds one `<|image_pad|>` /
    /// `<|video_pad|>` per image / video) minus those pads plus [`vision_token_count`]. What
    /// `data.max_prompt_length` is compared with.
    ///
    /// # Errors
    /// As [`vision_token_count`].
    pub fn expanded_prompt_length(&self, example: &Example, rendered_len: usize) -> Result<usize> {
        Ok(self.expanded_prompt(example, rendered_len)?.0)
    }

    /// [`Self::expanded_prompt_length`] and the [`vision_token_count`] in it (0 without
    /// media), from one reading of the media's sizes.
    ///
    /// # Errors
    /// As [`vision_token_count`].
    pub fn expanded_prompt(
        &self,
        example: &Example,
        rendered_len: usize,
    ) -> Result<(usize, usize)> {
        if !example.has_media() {
            return Ok((rendered_len, 0));
        }
        let pads = example.images.len() + example.videos.len();
        let vision = vision_token_count(example, self)?;
        Ok((rendered_len.saturating_sub(pads) + vision, vision))
    }

    fn error(&self, example: &Example, media: MediaKind, i: usize, reason: String) -> DataError {
        let key = match media {
            MediaKind::Image => &self.keys.image,
            MediaKind::Video => &self.keys.video,
        };
        DataError::Example {
            row: example.row,
            global_id: example.global_id.clone(),
            key: key.clone(),
            reason: format!("{} {i}: {reason}", media.noun()),
        }
    }
}

/// An example's images and videos processed, in prompt order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExampleMedia {
    /// One per image (`pixel_values`, `image_grid_thw`).
    pub images: Vec<ProcessedImage>,
    /// One per video (`pixel_values_videos`, `video_grid_thw`, the frames used).
    pub videos: Vec<ProcessedVideo>,
    /// One per video: `temporal_patch_size / video_fps` (Qwen2.5-VL's M-RoPE time step).
    pub second_per_grid_ts: Vec<f64>,
}

impl ExampleMedia {
    /// No image and no video.
    pub fn is_empty(&self) -> bool {
        self.images.is_empty() && self.videos.is_empty()
    }

    /// The batch the vision-language model takes ([`VisionBatch::from_processed`]).
    pub fn vision_batch(&self) -> VisionBatch {
        VisionBatch::from_processed(&self.images, &self.videos, &self.second_per_grid_ts)
    }

    /// Placeholder tokens of the prompt once expanded: `t·h·w / merge_size²` per grid.
    pub fn token_count(&self, merge_size: usize) -> usize {
        let merged = |g: &[usize; 3]| g[0] * g[1] * g[2] / (merge_size * merge_size);
        self.images
            .iter()
            .map(|i| merged(&i.grid_thw))
            .sum::<usize>()
            + self
                .videos
                .iter()
                .map(|v| merged(&v.video_grid_thw))
                .sum::<usize>()
    }
}

/// Decodes and processes `example`'s images ([`process_image_file`], or [`decode_rgb`] +
/// [`process_image`] for inline bytes) and videos ([`process_video_path`] for a video file,
/// sampled at `video_fps`, or a frame directory; [`process_video_files`] for a list of
/// frames, every frame kept; inline video bytes go through a temporary file for ffmpeg).
///
/// Errors ([`DataError::Example`], naming the row, its `global_id`, the column and the
/// image / video): unreadable or corrupt files, unsupported formats, sizes the processor
/// refuses, no ffmpeg for a video file.
pub fn load_media(example: &Example, processor: &MediaProcessor) -> Result<ExampleMedia> {
    let cfg = &processor.config;
    let mut out = ExampleMedia::default();
    for (i, source) in example.images.iter().enumerate() {
        let image = match source {
            MediaSource::Path(p) => process_image_file(p, cfg),
            MediaSource::Bytes(b) => {
                decode_rgb(b, Path::new("<inline bytes>")).and_then(|img| process_image(&img, cfg))
            }
            MediaSource::Frames(_) => Err(VisionError::Argument {
                message: "a list of frames is a video, not an image".into(),
            }),
        }
        .map_err(|e| processor.error(example, MediaKind::Image, i, e.to_string()))?;
        out.images.push(image);
    }
    for (i, source) in example.videos.iter().enumerate() {
        let video = match source {
            MediaSource::Path(p) => process_video_path(p, video_sampling(p, processor), cfg),
            MediaSource::Frames(frames) => {
                process_video_files(frames, VideoSampling::default(), cfg)
            }
            MediaSource::Bytes(b) => {
                with_temp_file(b, |p| process_video_path(p, processor.file_sampling(), cfg))
            }
        }
        .map_err(|e| processor.error(example, MediaKind::Video, i, e.to_string()))?;
        out.videos.push(video);
        out.second_per_grid_ts.push(processor.second_per_grid_t());
    }
    Ok(out)
}

/// Sampling of a video path: a directory of frames keeps every frame, a file is sampled.
fn video_sampling(path: &Path, processor: &MediaProcessor) -> VideoSampling {
    if path.is_dir() {
        VideoSampling::default()
    } else {
        processor.file_sampling()
    }
}

/// The number of placeholder tokens `example`'s prompt expands to: `t·h·w / merge_size²` for
/// each image and video grid, as [`load_media`] would produce them. Computed from the sizes
/// alone: a PNG's size is read from its header, other images are decoded; a video file is
/// probed with ffmpeg (frame count, rate and size), a frame directory or list gives its frame
/// count and first frame's size. 0 for a text example.
///
/// Errors: as [`load_media`].
pub fn vision_token_count(example: &Example, processor: &MediaProcessor) -> Result<usize> {
    let cfg = &processor.config;
    let (p, m) = (cfg.patch_size, cfg.merge_size);
    let tokens = |t: usize, h: usize, w: usize| t * (h / p) * (w / p) / (m * m);
    let mut total = 0;
    for (i, source) in example.images.iter().enumerate() {
        let n = image_size(source)
            .and_then(|(h, w)| smart_resize(h, w, cfg.factor(), cfg.min_pixels, cfg.max_pixels))
            .map(|(h, w)| tokens(1, h, w))
            .map_err(|e| processor.error(example, MediaKind::Image, i, e.to_string()))?;
        total += n;
    }
    for (i, source) in example.videos.iter().enumerate() {
        let n = video_shape(source, processor)
            .and_then(|(frames, h, w)| {
                let (h, w) = smart_resize(
                    h,
                    w,
                    cfg.factor(),
                    cfg.video.min_pixels,
                    cfg.video.max_pixels,
                )?;
                Ok(tokens(frames.div_ceil(cfg.temporal_patch_size), h, w))
            })
            .map_err(|e| processor.error(example, MediaKind::Video, i, e.to_string()))?;
        total += n;
    }
    Ok(total)
}

/// `(height, width)` of an image source.
fn image_size(source: &MediaSource) -> std::result::Result<(usize, usize), VisionError> {
    match source {
        MediaSource::Path(p) => image_file_size(p),
        MediaSource::Bytes(b) => match png_size(b) {
            Some(size) => Ok(size),
            None => decode_rgb(b, Path::new("<inline bytes>")).map(|i| (i.height, i.width)),
        },
        MediaSource::Frames(_) => Err(VisionError::Argument {
            message: "a list of frames is a video, not an image".into(),
        }),
    }
}

/// `(height, width)` of an image file: the PNG header when it is a PNG, else decoded.
fn image_file_size(path: &Path) -> std::result::Result<(usize, usize), VisionError> {
    let mut head = [0u8; 24];
    let read = std::fs::File::open(path).and_then(|mut f| {
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..])? {
                0 => break,
                k => n += k,
            }
        }
        Ok(n)
    });
    match read {
        Ok(n) => match png_size(&head[..n]) {
            Some(size) => Ok(size),
            None => load_rgb(path).map(|i| (i.height, i.width)),
        },
        Err(e) => Err(VisionError::Io {
            file: path.to_path_buf(),
            source: e,
        }),
    }
}

/// `(height, width)` from a PNG's IHDR chunk; `None` when `bytes` does not start like a PNG
/// (or gives a zero side, left to the decoder to report).
fn png_size(bytes: &[u8]) -> Option<(usize, usize)> {
    const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];
    if bytes.len() < 24 || bytes[..8] != SIGNATURE || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let be = |s: &[u8]| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize;
    let (w, h) = (be(&bytes[16..20]), be(&bytes[20..24]));
    (w > 0 && h > 0).then_some((h, w))
}

/// `(frames kept, height, width)` of a video source, as [`load_media`] samples it.
fn video_shape(
    source: &MediaSource,
    processor: &MediaProcessor,
) -> std::result::Result<(usize, usize, usize), VisionError> {
    let frames_shape = |files: &[PathBuf]| {
        let first = files.first().ok_or_else(|| VisionError::Video {
            message: "the video has no frames".into(),
        })?;
        let (h, w) = image_file_size(first)?;
        Ok((files.len(), h, w))
    };
    match source {
        MediaSource::Path(p) if p.is_dir() => frames_shape(&frame_files(p)?),
        MediaSource::Path(p) => video_file_shape(p, processor),
        MediaSource::Frames(files) => frames_shape(files),
        MediaSource::Bytes(b) => with_temp_file(b, |p| video_file_shape(p, processor)),
    }
}

fn video_file_shape(
    path: &Path,
    processor: &MediaProcessor,
) -> std::result::Result<(usize, usize, usize), VisionError> {
    let info = probe(&Ffmpeg::from_env(), path)?;
    let indices = sample_indices(path, &info, processor.file_sampling(), &processor.config)?;
    Ok((indices.len(), info.height, info.width))
}

/// Runs `f` on a temporary file holding `bytes` (for ffmpeg, which reads files), removed
/// afterwards.
fn with_temp_file<T>(
    bytes: &[u8],
    f: impl FnOnce(&Path) -> std::result::Result<T, VisionError>,
) -> std::result::Result<T, VisionError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let path = std::env::temp_dir().join(format!(
        "ares-video-{}-{}.bin",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, bytes).map_err(|e| VisionError::Io {
        file: path.clone(),
        source: e,
    })?;
    let guard = Remove(path);
    f(&guard.0)
}

/// Renders `example`'s prompt for a vision-language chat template (Qwen2-VL / Qwen2.5-VL):
/// `format` (`data.format_prompt`) applied as for text prompts, the messages of
/// [`Example::chat_messages`] (content lists with `{"type": "image"}` / `{"type": "video"}`
/// where the placeholders are), `system` as the system turn when given, and the generation
/// prompt. A text example renders as its plain messages.
///
/// Errors: the template fails ([`DataError::Template`]), the formatted prompt's placeholders
/// do not match the example's media ([`DataError::Example`]), the chat template fails to
/// render ([`DataError::Example`] on the prompt column `prompt`).
pub fn render_prompt(
    chat: &ChatTemplate,
    example: &Example,
    format: Option<&PromptTemplate>,
    system: Option<&str>,
    keys: &MediaKeys,
) -> Result<String> {
    render_prompt_with(
        chat,
        example,
        format,
        system,
        keys,
        &RenderOptions::generation(),
    )
}

/// [`render_prompt`] with the chat template's `options` (tools, extra variables).
///
/// # Errors
/// As [`render_prompt`].
pub fn render_prompt_with(
    chat: &ChatTemplate,
    example: &Example,
    format: Option<&PromptTemplate>,
    system: Option<&str>,
    keys: &MediaKeys,
    options: &RenderOptions<'_>,
) -> Result<String> {
    let prompt: Prompt = match format {
        Some(t) => t.apply(&example.prompt)?,
        None => example.prompt.clone(),
    };
    let messages = example.chat_messages(&prompt, &keys.image, &keys.video)?;
    match system {
        Some(s) => chat.render_with_system(s, &messages, options),
        None => chat.render(&messages, options),
    }
    .map_err(|e| DataError::Example {
        row: example.row,
        global_id: example.global_id.clone(),
        key: "prompt".into(),
        reason: format!("chat template: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_header() {
        let mut b = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0, 0, 13];
        b.extend_from_slice(b"IHDR");
        b.extend_from_slice(&84u32.to_be_bytes());
        b.extend_from_slice(&56u32.to_be_bytes());
        assert_eq!(png_size(&b), Some((56, 84)));
        assert_eq!(png_size(&b[..23]), None);
        let mut jpeg = b.clone();
        jpeg[0] = 0xff;
        assert_eq!(png_size(&jpeg), None);
    }

    #[test]
    fn processor_settings() {
        let model = ProcessorConfig::default();
        let p = MediaProcessor::new(model.clone(), Some(1024), None, 2.0, MediaKeys::default())
            .unwrap();
        assert_eq!(
            (p.config.min_pixels, p.config.max_pixels),
            (1024, model.max_pixels)
        );
        assert_eq!(p.config.video, model.video);
        assert_eq!(p.second_per_grid_t(), 1.0);
        let e = MediaProcessor::new(
            model.clone(),
            Some(model.max_pixels + 1),
            None,
            2.0,
            MediaKeys::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("image processor: data.min_pixels = "), "{e}");
        let e = MediaProcessor::new(model, None, None, 0.0, MediaKeys::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("data.video_fps = 0"), "{e}");
    }
}
