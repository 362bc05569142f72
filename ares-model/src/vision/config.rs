//! `config.json` of a Qwen2-VL / Qwen2.5-VL checkpoint: the language model (a Qwen2 decoder
//! with M-RoPE), the vision tower and the placeholder token ids, from either layout
//! transformers writes — the Hub's (language-model fields at the top level, `rope_scaling`
//! `{"type": "mrope", "mrope_section": …}`) and transformers ≥ 5's (`text_config` with
//! `rope_parameters`). Missing vision fields take transformers' defaults.

use std::path::Path;

use serde_json::{Map, Value};

use super::mrope::{MropeConfig, TemporalScale, VisionTokens};
use crate::backend::Activation;
use crate::hf::HfError;
use crate::hf::config::{CONFIG_FILE, ModelConfig};
use crate::hf::json::{self, Fields};

/// The two vision-language families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VlKind {
    /// Qwen2-VL: LayerNorm blocks, QuickGELU MLP (`fc1`/`fc2`), full attention per frame,
    /// LayerNorm before the merger.
    Qwen2Vl,
    /// Qwen2.5-VL: RMSNorm blocks, SwiGLU MLP with biases, window attention except in
    /// `fullatt_block_indexes`, RMSNorm before the merger, temporal positions in seconds.
    Qwen25Vl,
}

impl VlKind {
    /// `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            VlKind::Qwen2Vl => "qwen2_vl",
            VlKind::Qwen25Vl => "qwen2_5_vl",
        }
    }

    /// The kind of a `model_type`, if it is one of the two.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen2_vl" => Some(VlKind::Qwen2Vl),
            "qwen2_5_vl" => Some(VlKind::Qwen25Vl),
            _ => None,
        }
    }
}

/// The vision tower's MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionMlp {
    /// `fc2(act(fc1(x)))` (Qwen2-VL, `act` from `hidden_act`).
    Plain(Activation),
    /// `down(silu(gate(x)) · up(x))`, all with biases (Qwen2.5-VL).
    SwiGlu,
}

/// `vision_config`: the sizes of the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Which family.
    pub kind: VlKind,
    /// ViT blocks.
    pub depth: usize,
    /// Width of the tower (`embed_dim` in Qwen2-VL, `hidden_size` in Qwen2.5-VL).
    pub hidden: usize,
    /// Attention heads (`num_heads`).
    pub heads: usize,
    /// `hidden / heads`, a multiple of 4 (2-D rotary: a quarter of the head per axis).
    pub head_dim: usize,
    /// Width of the MLP (`embed_dim · mlp_ratio`, or `intermediate_size`).
    pub intermediate: usize,
    /// MLP form and activation.
    pub mlp: VisionMlp,
    /// Width of the merger's output: the language model's hidden size.
    pub out_hidden: usize,
    /// Pixels per patch side.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Patches per side of one merged token.
    pub spatial_merge_size: usize,
    /// Colour channels.
    pub in_channels: usize,
    /// Window side in pixels (Qwen2.5-VL).
    pub window_size: usize,
    /// Blocks with full attention (Qwen2.5-VL; every block for Qwen2-VL).
    pub fullatt_block_indexes: Vec<usize>,
    /// Temporal positions per second of video (Qwen2.5-VL).
    pub tokens_per_second: f64,
    /// Base of the 2-D rotary frequencies.
    pub rope_theta: f64,
}

impl VisionConfig {
    /// Features per flattened patch, `in_channels · temporal_patch_size · patch_size²`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Width of the merger's input, `hidden · spatial_merge_size²`.
    pub fn merged_dim(&self) -> usize {
        self.hidden * self.spatial_merge_size * self.spatial_merge_size
    }

    /// Whether block `layer` attends over the whole frame (else within windows).
    pub fn full_attention(&self, layer: usize) -> bool {
        self.kind == VlKind::Qwen2Vl || self.fullatt_block_indexes.contains(&layer)
    }

    /// Whether the norms are LayerNorm (with biases) rather than RMSNorm.
    pub fn layer_norm(&self) -> bool {
        self.kind == VlKind::Qwen2Vl
    }
}

/// A validated Qwen2-VL / Qwen2.5-VL `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct VlConfig {
    /// The language model as a Qwen2 decoder (its RoPE the unscaled table M-RoPE splits).
    pub text: ModelConfig,
    /// The vision tower.
    pub vision: VisionConfig,
    /// `mrope_section`: frequencies per axis (temporal, height, width), summing to
    /// `head_dim / 2`.
    pub mrope_section: [usize; 3],
    /// `<|image_pad|>`, `<|video_pad|>`.
    pub tokens: VisionTokens,
    /// `<|vision_start|>`.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`.
    pub vision_end_token_id: u32,
    raw: Map<String, Value>,
}

impl VlConfig {
    /// Reads `<dir>/config.json`.
    ///
    /// # Errors
    /// A missing or malformed file, a `model_type` other than `qwen2_vl` / `qwen2_5_vl`, or
    /// invalid sizes (each error names the field).
    pub fn from_dir(dir: &Path) -> Result<Self, HfError> {
        let path = dir.join(CONFIG_FILE);
        let map = json::read_object(&path, "the model's config.json")?;
        Self::from_map(&path, map)
    }

    /// Whether `<dir>/config.json` names a vision-language model (`model_type` `qwen2_vl` or
    /// `qwen2_5_vl`); `false` when it cannot be read (the text loader reports that).
    pub fn is_vl_dir(dir: &Path) -> bool {
        json::read_object(&dir.join(CONFIG_FILE), "config.json")
            .ok()
            .and_then(|m| {
                m.get("model_type")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .is_some_and(|t| VlKind::from_model_type(&t).is_some())
    }

    /// Parses the contents of `path`.
    ///
    /// # Errors
    /// As [`VlConfig::from_dir`].
    pub fn from_map(path: &Path, raw: Map<String, Value>) -> Result<Self, HfError> {
        let f = Fields::new(path, &raw);
        let model_type: String = f.req("model_type")?;
        let kind = VlKind::from_model_type(&model_type).ok_or_else(|| {
            f.error(
                "model_type",
                format!("`{model_type}` is not a vision-language model (qwen2_vl, qwen2_5_vl)"),
            )
        })?;
        let (text_map, mrope_section) = text_map(&f, &raw)?;
        let text = ModelConfig::from_text_map(path, text_map)?;
        let half = text.head_dim / 2;
        if mrope_section.iter().sum::<usize>() != half || text.head_dim % 2 != 0 {
            return Err(f.error(
                "mrope_section",
                format!("{mrope_section:?} must sum to head_dim / 2 = {half}"),
            ));
        }
        let vf = f
            .object("vision_config")?
            .ok_or_else(|| f.error("vision_config", "missing"))?;
        let vision = vision_config(kind, &vf, text.hidden_size)?;
        let id = |key: &str, default: u32| -> Result<u32, HfError> {
            Ok(f.opt::<u32>(key)?.unwrap_or(default))
        };
        let tokens = VisionTokens {
            image_pad: id("image_token_id", 151_655)?,
            video_pad: id("video_token_id", 151_656)?,
        };
        let vision_start_token_id = id("vision_start_token_id", 151_652)?;
        let vision_end_token_id = id("vision_end_token_id", 151_653)?;
        for (key, v) in [
            ("image_token_id", tokens.image_pad),
            ("video_token_id", tokens.video_pad),
            ("vision_start_token_id", vision_start_token_id),
            ("vision_end_token_id", vision_end_token_id),
        ] {
            if v as usize >= text.vocab_size {
                return Err(f.error(
                    key,
                    format!("{v} is not below vocab_size {}", text.vocab_size),
                ));
            }
        }
        if tokens.image_pad == tokens.video_pad {
            return Err(f.error("video_token_id", "equals image_token_id"));
        }
        Ok(Self {
            text,
            vision,
            mrope_section,
            tokens,
            vision_start_token_id,
            vision_end_token_id,
            raw,
        })
    }

    /// The family.
    pub fn kind(&self) -> VlKind {
        self.vision.kind
    }

    /// What [`rope_index`](super::mrope::rope_index) needs.
    pub fn mrope(&self) -> MropeConfig {
        MropeConfig {
            tokens: self.tokens,
            spatial_merge_size: self.vision.spatial_merge_size,
            temporal: match self.kind() {
                VlKind::Qwen2Vl => TemporalScale::Index,
                VlKind::Qwen25Vl => TemporalScale::PerSecond {
                    tokens_per_second: self.vision.tokens_per_second,
                },
            },
        }
    }

    /// A tokenized prompt with one `<|image_pad|>` / `<|video_pad|>` per image / video (as a
    /// chat template renders them) expanded to each grid's token count, the `i`-th
    /// placeholder of a kind taking the `i`-th grid of that kind.
    ///
    /// # Errors
    /// More or fewer placeholders than grids; an invalid grid.
    pub fn expand_prompt(
        &self,
        ids: &[u32],
        image_grids: &[[usize; 3]],
        video_grids: &[[usize; 3]],
    ) -> Result<Vec<u32>, super::mrope::MropeError> {
        super::mrope::expand_placeholders(
            ids,
            self.tokens,
            image_grids,
            video_grids,
            self.vision.spatial_merge_size,
        )
    }

    /// The JSON object this config was read from, unchanged (written back on save).
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }
}

/// The language model's fields as a Qwen2 `config.json` (`text_config` merged over the top
/// level, or the top level itself), with M-RoPE's `mrope_section` taken out of the RoPE
/// settings: M-RoPE uses the default frequencies, split by axis.
fn text_map(
    f: &Fields<'_>,
    raw: &Map<String, Value>,
) -> Result<(Map<String, Value>, [usize; 3]), HfError> {
    let mut map = raw.clone();
    map.remove("vision_config");
    if let Some(Value::Object(text)) = raw.get("text_config") {
        map.remove("text_config");
        for (k, v) in text {
            map.insert(k.clone(), v.clone());
        }
    }
    map.insert("model_type".into(), Value::from("qwen2"));
    map.remove("architectures");
    let mut section = None;
    for key in ["rope_scaling", "rope_parameters"] {
        if let Some(Value::Object(rope)) = map.get_mut(key) {
            if let Some(s) = rope.remove("mrope_section") {
                let s: Vec<usize> = serde_json::from_value(s)
                    .map_err(|e| f.error(&format!("{key}.mrope_section"), e.to_string()))?;
                let s: [usize; 3] = s.try_into().map_err(|s: Vec<usize>| {
                    f.error(
                        &format!("{key}.mrope_section"),
                        format!("expected 3 values, found {}", s.len()),
                    )
                })?;
                section = Some(s);
            }
            let is_mrope = |k: &str| rope.get(k).and_then(Value::as_str) == Some("mrope");
            if is_mrope("type") || is_mrope("rope_type") {
                rope.remove("type");
                rope.insert("rope_type".into(), Value::from("default"));
            }
        }
    }
    // transformers' default when a config gives none
    Ok((map, section.unwrap_or([16, 24, 24])))
}

fn vision_config(
    kind: VlKind,
    f: &Fields<'_>,
    text_hidden: usize,
) -> Result<VisionConfig, HfError> {
    let size = |key: &str, default: usize| -> Result<usize, HfError> {
        match f.opt::<usize>(key)? {
            Some(0) => Err(f.error(key, "must be > 0, found 0")),
            Some(v) => Ok(v),
            None => Ok(default),
        }
    };
    let depth = size("depth", 32)?;
    let heads = size("num_heads", 16)?;
    let (hidden, intermediate, out_hidden, mlp) = match kind {
        VlKind::Qwen2Vl => {
            let hidden = size("embed_dim", 1280)?;
            let ratio = f.opt::<f64>("mlp_ratio")?.unwrap_or(4.0);
            if !(ratio.is_finite() && ratio > 0.0) {
                return Err(f.error("mlp_ratio", format!("must be > 0, found {ratio}")));
            }
            let act: String = f.opt("hidden_act")?.unwrap_or_else(|| "quick_gelu".into());
            let act = match act.as_str() {
                "quick_gelu" => Activation::QuickGelu,
                "gelu" => Activation::GeluErf,
                "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
                other => {
                    return Err(f.error(
                        "hidden_act",
                        format!("`{other}` is not supported (quick_gelu, gelu, gelu_pytorch_tanh)"),
                    ));
                }
            };
            // int(embed_dim * mlp_ratio), as transformers computes it
            let intermediate = (hidden as f64 * ratio) as usize;
            (
                hidden,
                intermediate,
                size("hidden_size", text_hidden)?,
                VisionMlp::Plain(act),
            )
        }
        VlKind::Qwen25Vl => {
            let act: String = f.opt("hidden_act")?.unwrap_or_else(|| "silu".into());
            if act != "silu" {
                return Err(f.error(
                    "hidden_act",
                    format!("`{act}` is not supported (Qwen2.5-VL's vision MLP is SwiGLU: silu)"),
                ));
            }
            (
                size("hidden_size", 3584)?,
                size("intermediate_size", 3420)?,
                size("out_hidden_size", text_hidden)?,
                VisionMlp::SwiGlu,
            )
        }
    };
    if out_hidden != text_hidden {
        let key = if kind == VlKind::Qwen2Vl {
            "hidden_size"
        } else {
            "out_hidden_size"
        };
        return Err(f.error(
            key,
            format!("{out_hidden} differs from the language model's hidden_size {text_hidden}"),
        ));
    }
    if hidden % heads != 0 || (hidden / heads) % 4 != 0 {
        return Err(f.error(
            "num_heads",
            format!("{heads} heads of a width {hidden}: head_dim must be a multiple of 4"),
        ));
    }
    let rope_theta = match f.object("rope_parameters")? {
        Some(p) => p.opt::<f64>("rope_theta")?.unwrap_or(10_000.0),
        None => f.opt::<f64>("rope_theta")?.unwrap_or(10_000.0),
    };
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(f.error("rope_theta", format!("must be > 0, found {rope_theta}")));
    }
    let patch_size = size("patch_size", 14)?;
    let spatial_merge_size = size("spatial_merge_size", 2)?;
    let window_size = size("window_size", 112)?;
    if kind == VlKind::Qwen25Vl && window_size % (spatial_merge_size * patch_size) != 0 {
        return Err(f.error(
            "window_size",
            format!(
                "{window_size} is not a multiple of patch_size · spatial_merge_size = {}",
                patch_size * spatial_merge_size
            ),
        ));
    }
    let fullatt_block_indexes: Vec<usize> = match kind {
        VlKind::Qwen2Vl => (0..depth).collect(),
        VlKind::Qwen25Vl => f
            .opt("fullatt_block_indexes")?
            .unwrap_or_else(|| vec![7, 15, 23, 31]),
    };
    let tokens_per_second = f.opt::<f64>("tokens_per_second")?.unwrap_or(4.0);
    if !(tokens_per_second.is_finite() && tokens_per_second >= 0.0) {
        return Err(f.error(
            "tokens_per_second",
            format!("must be finite and >= 0, found {tokens_per_second}"),
        ));
    }
    Ok(VisionConfig {
        kind,
        depth,
        hidden,
        heads,
        head_dim: hidden / heads,
        intermediate,
        mlp,
        out_hidden,
        patch_size,
        temporal_patch_size: size("temporal_patch_size", 2)?,
        spatial_merge_size,
        // the Hub's Qwen2-VL configs spell it `in_chans`
        in_channels: match f.opt::<usize>("in_chans")? {
            Some(c) => c,
            None => size("in_channels", 3)?,
        },
        window_size,
        fullatt_block_indexes,
        tokens_per_second,
        rope_theta,
    })
}
