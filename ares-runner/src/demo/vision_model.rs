//! The vision demo's tiny model: a randomly initialised Qwen2.5-VL-style model written as a
//! Hugging Face directory that [`crate::vision::checkpoint::VlCheckpoint::load`] loads, with
//! the text demo's character tokenizer extended by the Qwen2-VL vision tokens.
//!
//! - `config.json` in the Hub layout of `Qwen/Qwen2.5-VL-*` (`model_type` `qwen2_5_vl`,
//!   language-model fields at the top level, `rope_scaling` `{"type": "mrope",
//!   "mrope_section"}`, `vision_config` with `in_chans`, `window_size`,
//!   `fullatt_block_indexes`), float32.
//! - `model.safetensors` with the Hub's tensor names: `visual.*` (tower), `model.*`
//!   (language model) and, untied, `lm_head.weight`.
//! - The language model is the text demo's ([`TinyModelSpec`], initialised exactly as
//!   [`super::model::write_random_model`] does: the same seed and sizes give the same
//!   tensors); the tower is [`VisionWeights::random`] (N(0, σ²) matrices, zero biases, unit
//!   norms) with [`TinyVisionSpec`]'s sizes: depth 2, width 64, 2 heads, SwiGLU 128, patch 14,
//!   merge 2, window attention in block 0 (56-pixel windows: 2 × 2 merged tokens) and full
//!   attention in block 1.
//! - `preprocessor_config.json` (Hub layout, `Qwen2VLImageProcessor`) with `min_pixels` 56²
//!   and `max_pixels` [`IMAGE_SIZE`]², so the demo's 84 × 84 pictures keep their size.
//! - `generation_config.json` as the text demo's.
//! - The tokenizer ([`write_vl_tokenizer`]): the text demo's [`VOCAB_SIZE`] ids, then
//!   [`VISION_START`], [`VISION_END`], [`IMAGE_PAD`], [`VIDEO_PAD`] ([`VL_VOCAB_SIZE`] ids in
//!   all), and a ChatML template that renders image content items as
//!   `<|vision_start|><|image_pad|><|vision_end|>` (video items with `<|video_pad|>`), as
//!   Qwen2-VL's does, without its default system turn.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::error::DemoError;
use super::model::{TinyModelSpec, write_json};
use super::rng::{self, Stream};
use super::tokenizer::{self, ENDOFTEXT, IM_END, IM_START, VOCAB_SIZE};
use super::vision_task::IMAGE_SIZE;
use crate::hf::config::CONFIG_FILE;
use crate::hf::generation::{GENERATION_CONFIG_FILE, GenerationConfig};
use crate::hf::tensor_files::{NamedTensor, SINGLE_FILE, SaveDtype, write_safetensors};
use crate::hf::weights::{ModelWeights, Tensor, expected_tensors};
use crate::vision::checkpoint::{VlCheckpoint, WeightLayout};
use crate::vision::config::VlConfig;
use crate::vision::processor::ProcessorConfig;
use crate::vision::weights::VisionWeights;

/// Start of a vision block.
pub const VISION_START: &str = "<|vision_start|>";
/// End of a vision block.
pub const VISION_END: &str = "<|vision_end|>";
/// The image placeholder a chat template writes once per image; the runtime repeats it once
/// per merged patch.
pub const IMAGE_PAD: &str = "<|image_pad|>";
/// The video placeholder.
pub const VIDEO_PAD: &str = "<|video_pad|>";
/// The vision tokens, in id order after the text demo's vocabulary.
pub const VISION_SPECIALS: [&str; 4] = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD];
/// Number of ids: the text demo's [`VOCAB_SIZE`] plus the four vision tokens.
pub const VL_VOCAB_SIZE: usize = VOCAB_SIZE + VISION_SPECIALS.len();
const _: () = assert!(VL_VOCAB_SIZE == 63);

/// Name of the image processor's config file written into the model directory.
pub const PREPROCESSOR_CONFIG_FILE: &str = "preprocessor_config.json";

/// The vision demo's chat template: the text demo's ChatML with list contents rendered item
/// by item (see the module docs).
pub const VL_CHAT_TEMPLATE: &str = "{%- for message in messages %}\n\
{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n\
{{- raise_exception('the demo chat template has the roles system, user and assistant, not ' + message['role']) }}\n\
{%- endif %}\n\
{{- '<|im_start|>' + message['role'] + '\\n' }}\n\
{%- if message['content'] is string %}\n\
{{- message['content'] }}\n\
{%- else %}\n\
{%- for content in message['content'] %}\n\
{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}\n\
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}\n\
{%- elif content['type'] == 'video' or 'video' in content %}\n\
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}\n\
{%- elif 'text' in content %}\n\
{{- content['text'] }}\n\
{%- endif %}\n\
{%- endfor %}\n\
{%- endif %}\n\
{{- '<|im_end|>\\n' }}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}\n";

/// Every token in id order: the text demo's [`tokenizer::vocabulary`], then
/// [`VISION_SPECIALS`].
pub fn vl_vocabulary() -> Vec<String> {
    let mut v = tokenizer::vocabulary();
    v.extend(VISION_SPECIALS.iter().map(|s| s.to_string()));
    v
}

/// The ids of the special tokens of the vision tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VlSpecialIds {
    /// [`ENDOFTEXT`], the padding token (56).
    pub endoftext: u32,
    /// [`IM_START`] (57).
    pub im_start: u32,
    /// [`IM_END`], the end-of-sequence token (58).
    pub im_end: u32,
    /// [`VISION_START`] (59).
    pub vision_start: u32,
    /// [`VISION_END`] (60).
    pub vision_end: u32,
    /// [`IMAGE_PAD`] (61).
    pub image_pad: u32,
    /// [`VIDEO_PAD`] (62).
    pub video_pad: u32,
}

/// The ids of the special tokens (the text demo's three keep theirs).
pub fn vl_special_ids() -> VlSpecialIds {
    let text = tokenizer::special_ids();
    let base = VOCAB_SIZE as u32;
    VlSpecialIds {
        endoftext: text.endoftext,
        im_start: text.im_start,
        im_end: text.im_end,
        vision_start: base,
        vision_end: base + 1,
        image_pad: base + 2,
        video_pad: base + 3,
    }
}

/// The tokenizer as a `tokenizers` object: the text demo's (character `WordLevel`,
/// `Lowercase`, one piece per character, `Fuse`) with seven special tokens.
fn build_tokenizer(path: &Path) -> Result<Tokenizer, DemoError> {
    let specials: Vec<&str> = tokenizer::SPECIALS
        .iter()
        .chain(VISION_SPECIALS.iter())
        .copied()
        .collect();
    tokenizer::build_with(path, vl_vocabulary(), &specials)
}

/// `tokenizer_config.json` of the vision tokenizer.
fn tokenizer_config() -> Value {
    let ids = vl_special_ids();
    tokenizer::config_with(
        &[
            (ids.endoftext, ENDOFTEXT),
            (ids.im_start, IM_START),
            (ids.im_end, IM_END),
            (ids.vision_start, VISION_START),
            (ids.vision_end, VISION_END),
            (ids.image_pad, IMAGE_PAD),
            (ids.video_pad, VIDEO_PAD),
        ],
        &[
            IM_START,
            IM_END,
            VISION_START,
            VISION_END,
            IMAGE_PAD,
            VIDEO_PAD,
        ],
        VL_CHAT_TEMPLATE,
    )
}

/// Writes the vision tokenizer's `tokenizer.json` and `tokenizer_config.json` into `dir`
/// (created if missing; other files there are left alone).
///
/// # Errors
/// [`DemoError::Io`] or [`DemoError::Tokenizer`] when a file cannot be written.
pub fn write_vl_tokenizer(dir: &Path) -> Result<(), DemoError> {
    tokenizer::write_files(dir, build_tokenizer, &tokenizer_config())
}

/// Sizes and settings of the tiny Qwen2.5-VL vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyVisionSpec {
    /// ViT blocks (`depth`).
    pub depth: usize,
    /// Width of the tower (`hidden_size`); `hidden / heads` a multiple of 4.
    pub hidden: usize,
    /// Attention heads (`num_heads`).
    pub heads: usize,
    /// Width of the SwiGLU MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Pixels per patch side (`patch_size`).
    pub patch_size: usize,
    /// Frames per patch (`temporal_patch_size`).
    pub temporal_patch_size: usize,
    /// Patches per side of one merged token (`spatial_merge_size`).
    pub spatial_merge_size: usize,
    /// Window side in pixels (`window_size`), a multiple of `patch_size · spatial_merge_size`.
    pub window_size: usize,
    /// Blocks with full attention; the others attend within windows.
    pub fullatt_block_indexes: Vec<usize>,
    /// Temporal positions per second of video (`tokens_per_second`).
    pub tokens_per_second: usize,
    /// Standard deviation of the tower's normal initialisation.
    pub init_std: f64,
}

impl Default for TinyVisionSpec {
    /// Depth 2, width 64, 2 heads of 32, SwiGLU 128, patch 14, temporal patch 2, merge 2,
    /// 56-pixel windows, full attention in block 1, 2 tokens per second, σ 0.02: about
    /// 0.25 M parameters with the default language model (hidden 128).
    fn default() -> Self {
        Self {
            depth: 2,
            hidden: 64,
            heads: 2,
            intermediate: 128,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: 56,
            fullatt_block_indexes: vec![1],
            tokens_per_second: 2,
            init_std: 0.02,
        }
    }
}

fn setting(field: &'static str, value: impl ToString, reason: &str) -> DemoError {
    DemoError::Setting {
        field,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

impl TinyVisionSpec {
    /// Checks what the config reader does not: the full-attention blocks exist, σ is usable.
    /// (Sizes are checked by [`VlConfig`] when the config is built.)
    ///
    /// # Errors
    /// [`DemoError::Setting`] naming the first bad field.
    pub fn validate(&self) -> Result<(), DemoError> {
        if let Some(&i) = self
            .fullatt_block_indexes
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return Err(setting(
                "vision.fullatt_block_indexes",
                i,
                &format!("must be < depth = {}", self.depth),
            ));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(setting(
                "vision.init_std",
                self.init_std,
                "must be finite and > 0",
            ));
        }
        Ok(())
    }

    /// The `vision_config` object (Hub layout) for a language model of width `out_hidden`.
    pub fn config_json(&self, out_hidden: usize) -> Value {
        json!({
            "depth": self.depth,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_heads": self.heads,
            "in_chans": 3,
            "out_hidden_size": out_hidden,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "spatial_patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "window_size": self.window_size,
            "fullatt_block_indexes": self.fullatt_block_indexes,
            "tokens_per_second": self.tokens_per_second,
        })
    }
}

/// M-RoPE's split of the `head_dim / 2` frequencies over (time, height, width) in Qwen2.5-VL's
/// 1 : 1.5 : 1.5 ratio (`[16, 24, 24]` for head_dim 128; `[4, 6, 6]` for the demo's 32).
pub fn mrope_section(head_dim: usize) -> [usize; 3] {
    let half = head_dim / 2;
    let t = half / 4;
    let h = (half - t) / 2;
    [t, h, half - t - h]
}

/// The `config.json` of the model (Hub layout, see the module docs).
pub fn vl_config_json(spec: &TinyModelSpec, vision: &TinyVisionSpec, vocab_size: usize) -> Value {
    let ids = vl_special_ids();
    let mut config = spec.config_json(vocab_size, ids.im_end, ids.endoftext, None);
    let head_dim = spec.hidden.checked_div(spec.heads).unwrap_or(0);
    if let Value::Object(map) = &mut config {
        map.insert(
            "architectures".into(),
            json!(["Qwen2_5_VLForConditionalGeneration"]),
        );
        map.insert("model_type".into(), json!("qwen2_5_vl"));
        map.insert(
            "rope_scaling".into(),
            json!({"type": "mrope", "mrope_section": mrope_section(head_dim)}),
        );
        for (key, id) in [
            ("vision_start_token_id", ids.vision_start),
            ("vision_end_token_id", ids.vision_end),
            ("image_token_id", ids.image_pad),
            ("video_token_id", ids.video_pad),
        ] {
            map.insert(key.into(), json!(id));
        }
        map.insert("vision_config".into(), vision.config_json(spec.hidden));
    }
    config
}

/// The `preprocessor_config.json` (Hub layout): `min_pixels` 56², `max_pixels`
/// `max_side²`, patch, merge and temporal patch sizes of `vision`, OpenAI CLIP
/// normalisation, bicubic.
pub fn preprocessor_config_json(vision: &TinyVisionSpec, max_side: usize) -> Value {
    json!({
        "min_pixels": 56 * 56,
        "max_pixels": max_side * max_side,
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": true,
        "do_normalize": true,
        "do_rescale": true,
        "do_resize": true,
        "rescale_factor": 0.00392156862745098,
        "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    })
}

/// How a language-model tensor is initialised (the text demo's scheme).
fn text_init_std(name: &str, spec: &TinyModelSpec) -> Option<f64> {
    if name.ends_with("norm.weight") || name.ends_with(".bias") {
        None
    } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        Some(spec.init_std / (2.0 * spec.layers as f64).sqrt())
    } else {
        Some(spec.init_std)
    }
}

/// The tower's seed: SplitMix64 of the demo seed and a constant, apart from every stream
/// the language model or the task draws from.
fn tower_seed(seed: u64) -> u64 {
    let mut z = seed ^ 0x5649_5355_414c_0001;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The random model as an in-memory checkpoint (what [`write_random_vl_model`] writes).
///
/// # Errors
/// As [`write_random_vl_model`].
pub fn random_vl_checkpoint(
    spec: &TinyModelSpec,
    vision: &TinyVisionSpec,
    vocab_size: usize,
    seed: u64,
) -> Result<VlCheckpoint, DemoError> {
    spec.validate()?;
    vision.validate()?;
    if vocab_size < VL_VOCAB_SIZE {
        return Err(setting(
            "vocab_size",
            vocab_size,
            &format!("must be >= {VL_VOCAB_SIZE}, the vision demo tokenizer's size"),
        ));
    }
    let config_json = vl_config_json(spec, vision, vocab_size);
    let Value::Object(map) = config_json else {
        return Err(setting("config", "not an object", "internal error"));
    };
    let config = VlConfig::from_map(Path::new(CONFIG_FILE), map)?;
    let ids = vl_special_ids();
    let generation_json = json!({
        "bos_token_id": null,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
        "do_sample": true,
        "temperature": 1.0,
        "top_p": 1.0,
    });
    let generation = GenerationConfig::from_json_str(
        Path::new(GENERATION_CONFIG_FILE),
        &generation_json.to_string(),
    )?;

    let mut rng = rng::seeded(seed, Stream::Init);
    let mut map = HashMap::new();
    for (name, shape) in expected_tensors(&config.text) {
        let mut t = Tensor::zeros(&shape);
        match text_init_std(&name, spec) {
            Some(std) => t
                .data
                .iter_mut()
                .for_each(|x| *x = (std * rng::normal(&mut rng)) as f32),
            None if name.ends_with("norm.weight") => t.data.fill(1.0),
            None => {}
        }
        map.insert(name, t);
    }
    let text = ModelWeights::from_map(&config.text, map)?;
    let tower = VisionWeights::random(&config.vision, vision.init_std as f32, tower_seed(seed));
    Ok(VlCheckpoint {
        config,
        generation: Some(generation),
        text,
        vision: tower,
        layout: WeightLayout::Hub,
    })
}

/// Writes a randomly initialised Qwen2.5-VL-style model (see the module docs) into `dir`
/// (created if missing): `config.json`, `model.safetensors` (float32, Hub names),
/// `generation_config.json` and `preprocessor_config.json` (pictures up to
/// `max_image_side²` pixels keep their size). Other files in `dir`, e.g. a tokenizer, are
/// left alone. The same arguments give the same bytes.
///
/// # Errors
/// [`DemoError::Setting`] for a bad spec or a vocabulary smaller than [`VL_VOCAB_SIZE`];
/// [`DemoError::Hf`] if the runner's own readers refuse the config (both before anything is
/// written); [`DemoError::Io`] on writing.
pub fn write_random_vl_model(
    dir: &Path,
    spec: &TinyModelSpec,
    vision: &TinyVisionSpec,
    vocab_size: usize,
    max_image_side: usize,
    seed: u64,
) -> Result<(), DemoError> {
    let ck = random_vl_checkpoint(spec, vision, vocab_size, seed)?;
    let preprocessor = preprocessor_config_json(vision, max_image_side);
    let pre_path = dir.join(PREPROCESSOR_CONFIG_FILE);
    ProcessorConfig::from_json(&preprocessor, &pre_path)
        .map_err(|e| setting("max_image_side", max_image_side, &e.to_string()))?;
    std::fs::create_dir_all(dir).map_err(|e| DemoError::io(dir, e))?;
    let named = ck.named(WeightLayout::Hub);
    let list: Vec<NamedTensor<'_>> = named
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.as_slice(), *d))
        .collect();
    write_safetensors(&dir.join(SINGLE_FILE), &list, SaveDtype::F32)?;
    write_json(
        &dir.join(CONFIG_FILE),
        &Value::Object(ck.config.raw().clone()),
    )?;
    let generation = ck.generation.as_ref().map(|g| g.raw().clone());
    write_json(
        &dir.join(GENERATION_CONFIG_FILE),
        &Value::Object(generation.unwrap_or_default()),
    )?;
    write_json(&pre_path, &preprocessor)
}

/// [`write_random_vl_model`] with the vision tokenizer ([`write_vl_tokenizer`]) and
/// pictures up to [`IMAGE_SIZE`]: a complete model directory.
///
/// # Errors
/// As [`write_random_vl_model`] and [`write_vl_tokenizer`].
pub fn write_vl_model_dir(
    dir: &Path,
    spec: &TinyModelSpec,
    vision: &TinyVisionSpec,
    vocab_size: usize,
    seed: u64,
) -> Result<(), DemoError> {
    write_random_vl_model(dir, spec, vision, vocab_size, IMAGE_SIZE, seed)?;
    write_vl_tokenizer(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_section_splits_like_qwen() {
        assert_eq!(mrope_section(128), [16, 24, 24]);
        assert_eq!(mrope_section(32), [4, 6, 6]);
        assert_eq!(mrope_section(16), [2, 3, 3]);
        for d in (4..=256).step_by(2) {
            assert_eq!(mrope_section(d).iter().sum::<usize>(), d / 2);
        }
    }

    #[test]
    fn ids_follow_the_text_vocabulary() {
        let v = vl_vocabulary();
        assert_eq!(v.len(), VL_VOCAB_SIZE);
        assert_eq!(v[..VOCAB_SIZE], tokenizer::vocabulary()[..]);
        let ids = vl_special_ids();
        assert_eq!(
            [
                ids.vision_start,
                ids.vision_end,
                ids.image_pad,
                ids.video_pad
            ],
            [59, 60, 61, 62]
        );
        assert_eq!(v[ids.image_pad as usize], IMAGE_PAD);
        assert_eq!((ids.endoftext, ids.im_start, ids.im_end), (56, 57, 58));
    }

    #[test]
    fn bad_specs_name_the_field_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (
                TinyVisionSpec {
                    fullatt_block_indexes: vec![2],
                    ..TinyVisionSpec::default()
                },
                "fullatt_block_indexes",
            ),
            (
                TinyVisionSpec {
                    window_size: 50,
                    ..TinyVisionSpec::default()
                },
                "window_size",
            ),
            (
                TinyVisionSpec {
                    heads: 3,
                    ..TinyVisionSpec::default()
                },
                "num_heads",
            ),
        ];
        for (vision, needle) in cases {
            let err = write_random_vl_model(
                dir.path(),
                &TinyModelSpec::default(),
                &vision,
                VL_VOCAB_SIZE,
                IMAGE_SIZE,
                1,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        let err = write_random_vl_model(
            dir.path(),
            &TinyModelSpec::default(),
            &TinyVisionSpec::default(),
            VOCAB_SIZE,
            IMAGE_SIZE,
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("vocab_size"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
