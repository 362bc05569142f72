//! `config.json`: the architecture and sizes of a Qwen2/Qwen2.5, Qwen3 or Llama checkpoint,
//! read and validated once, with the per-architecture defaults transformers applies.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::HfError;
use super::json::{self, Fields};
use super::rope::Rope;

/// The name of the model config file in a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";

/// The decoder families this runner implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen2 / Qwen2.5 (`model_type: "qwen2"`): q/k/v biases, no o bias.
    Qwen2,
    /// Qwen3 (`model_type: "qwen3"`): RMSNorm on q and k per head, explicit `head_dim`.
    Qwen3,
    /// Llama (`model_type: "llama"`): optional `attention_bias` and `mlp_bias`.
    Llama,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: [Arch; 3] = [Arch::Qwen2, Arch::Qwen3, Arch::Llama];

    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
        }
    }

    /// The transformers class (`architectures[0]`) that loads this model.
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }

    fn from_model_type(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == s)
    }

    fn from_class(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.causal_lm_class() == s)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}

/// A validated `config.json`. The sizes are what the model needs; the original JSON is
/// kept (key order included) so that saving writes back every field the source had.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The decoder family.
    pub arch: Arch,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one head: `head_dim` if given, else `hidden_size / num_attention_heads`
    /// (Qwen3 defaults to 128 as transformers does).
    pub head_dim: usize,
    /// Rows of the embedding and of `lm_head`.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Longest context the model was configured for.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` reuses `embed_tokens` (then the checkpoint has no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Whether q, k and v projections have biases (Qwen2 always; Llama/Qwen3 `attention_bias`).
    pub qkv_bias: bool,
    /// Whether the output projection has a bias (Llama/Qwen3 `attention_bias`; never Qwen2).
    pub o_bias: bool,
    /// Whether gate/up/down projections have biases (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Whether q and k get a per-head RMSNorm before RoPE (Qwen3).
    pub qk_norm: bool,
    /// RoPE base and scaling, from either config style.
    pub rope: Rope,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (`eos_token_id` may be one id or a list); empty if none.
    pub eos_token_ids: Vec<u32>,
    /// Padding token, if the config names one.
    pub pad_token_id: Option<u32>,
    /// The dtype the checkpoint was saved in (`dtype`, or the older `torch_dtype`).
    pub dtype: Option<String>,
    raw: Map<String, Value>,
}

impl ModelConfig {
    /// Reads and validates `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, HfError> {
        Self::from_file(&dir.join(CONFIG_FILE))
    }

    /// Reads and validates a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, HfError> {
        let map = json::read_object(path, "the model's config.json")?;
        Self::from_map(path, map)
    }

    /// Parses and validates `text` as the contents of `path` (used in messages only).
    pub fn from_json_str(path: &Path, text: &str) -> Result<Self, HfError> {
        let map = json::parse_object(path, text)?;
        Self::from_map(path, map)
    }

    fn from_map(path: &Path, raw: Map<String, Value>) -> Result<Self, HfError> {
        let f = Fields::new(path, &raw);
        let arch = arch(path, &f)?;
        let positive = |key: &str| -> Result<usize, HfError> {
            let v: usize = f.req(key)?;
            if v == 0 {
                Err(f.error(key, "must be > 0, found 0"))
            } else {
                Ok(v)
            }
        };
        let hidden_size = positive("hidden_size")?;
        let intermediate_size = positive("intermediate_size")?;
        let num_hidden_layers = positive("num_hidden_layers")?;
        let num_attention_heads = positive("num_attention_heads")?;
        let num_key_value_heads = match f.opt::<usize>("num_key_value_heads")? {
            Some(0) => return Err(f.error("num_key_value_heads", "must be > 0, found 0")),
            Some(n) => n,
            None => num_attention_heads,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.error(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads = {num_attention_heads}"
                ),
            ));
        }
        let head_dim = match (f.opt::<usize>("head_dim")?, arch) {
            (Some(0), _) => return Err(f.error("head_dim", "must be > 0, found 0")),
            (Some(d), _) => d,
            (None, Arch::Qwen3) => 128,
            (None, _) => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.error(
                        "num_attention_heads",
                        format!(
                            "{num_attention_heads} does not divide hidden_size = {hidden_size} \
                             and no head_dim is given"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let vocab_size = positive("vocab_size")?;
        let rms_norm_eps = f.opt::<f64>("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(f.error("rms_norm_eps", format!("must be > 0, found {rms_norm_eps}")));
        }
        let default_max_pos = if arch == Arch::Llama { 2048 } else { 32768 };
        let max_position_embeddings = f
            .opt::<usize>("max_position_embeddings")?
            .unwrap_or(default_max_pos);
        // All three transformers config classes default to untied embeddings.
        let tie_word_embeddings = f.opt::<bool>("tie_word_embeddings")?.unwrap_or(false);
        let attention_bias = f.opt::<bool>("attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match arch {
            Arch::Qwen2 => (true, false, false, false),
            Arch::Qwen3 => (attention_bias, attention_bias, false, true),
            Arch::Llama => (
                attention_bias,
                attention_bias,
                f.opt::<bool>("mlp_bias")?.unwrap_or(false),
                false,
            ),
        };
        let hidden_act = f
            .opt::<String>("hidden_act")?
            .unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(f.error(
                "hidden_act",
                format!("`{hidden_act}` is not supported (only `silu`, the SwiGLU MLP)"),
            ));
        }
        check_sliding_window(&f, num_hidden_layers)?;
        let rope = Rope::from_fields(&f)?;
        let dtype = match f.opt::<String>("dtype")? {
            Some(d) => Some(d),
            None => f.opt::<String>("torch_dtype")?,
        };
        Ok(Self {
            arch,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps,
            max_position_embeddings,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            rope,
            bos_token_id: f.opt("bos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id")?.unwrap_or_default(),
            pad_token_id: f.opt("pad_token_id")?,
            dtype,
            raw,
        })
    }

    /// The JSON object this config was read from, unchanged.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }

    /// The `config.json` to save next to weights stored as `dtype` (`"float32"`,
    /// `"bfloat16"`): the source's fields in their order, with the dtype, the tie flag and
    /// RoPE written so that transformers 4.x and 5.x both read the same model (old-style
    /// `rope_theta`/`rope_scaling` are added when the source only had `rope_parameters`).
    pub fn to_json(&self, dtype: &str) -> Value {
        let mut map = self.raw.clone();
        let dtype_keys: Vec<&str> = ["dtype", "torch_dtype"]
            .into_iter()
            .filter(|k| map.contains_key(*k))
            .collect();
        if dtype_keys.is_empty() {
            map.insert("torch_dtype".into(), Value::from(dtype));
        }
        for k in dtype_keys {
            map.insert(k.into(), Value::from(dtype));
        }
        if !map.contains_key("architectures") {
            map.insert(
                "architectures".into(),
                serde_json::json!([self.arch.causal_lm_class()]),
            );
        }
        map.insert("model_type".into(), Value::from(self.arch.model_type()));
        map.insert(
            "tie_word_embeddings".into(),
            Value::from(self.tie_word_embeddings),
        );
        self.rope.write_legacy(&mut map);
        Value::Object(map)
    }
}

/// The architecture from `model_type`, or from `architectures[0]` when `model_type` is absent.
fn arch(path: &Path, f: &Fields<'_>) -> Result<Arch, HfError> {
    let supported = Arch::ALL.map(Arch::model_type).join(", ");
    let unknown = |found: String| HfError::UnknownArchitecture {
        path: PathBuf::from(path),
        found,
        supported: supported.clone(),
    };
    if let Some(model_type) = f.opt::<String>("model_type")? {
        return Arch::from_model_type(&model_type).ok_or_else(|| unknown(model_type));
    }
    let classes = f.opt::<Vec<String>>("architectures")?.unwrap_or_default();
    match classes.first() {
        Some(class) => Arch::from_class(class).ok_or_else(|| unknown(class.clone())),
        None => Err(f.error("model_type", "missing, and no `architectures` either")),
    }
}

/// Sliding-window attention is not implemented: refuse configs where a layer would use it
/// (transformers' rule: explicit `layer_types`, else `use_sliding_window` with a window and
/// layers from `max_window_layers` on).
fn check_sliding_window(f: &Fields<'_>, layers: usize) -> Result<(), HfError> {
    if let Some(types) = f.opt::<Vec<String>>("layer_types")? {
        if types.len() != layers {
            return Err(f.error(
                "layer_types",
                format!("has {} entries, num_hidden_layers = {layers}", types.len()),
            ));
        }
        if let Some((i, t)) = types
            .iter()
            .enumerate()
            .find(|(_, t)| *t != "full_attention")
        {
            return Err(f.error(
                "layer_types",
                format!("layer {i} is `{t}`; only `full_attention` is supported"),
            ));
        }
        return Ok(());
    }
    let enabled = f.opt::<bool>("use_sliding_window")?.unwrap_or(false);
    let window = f.opt::<usize>("sliding_window")?;
    // transformers defaults max_window_layers to 28 for Qwen2 and Qwen3.
    let first_sliding = f.opt::<usize>("max_window_layers")?.unwrap_or(28);
    if enabled && window.is_some() && first_sliding < layers {
        return Err(f.error(
            "use_sliding_window",
            format!(
                "sliding-window attention is not supported (window {window:?} from layer \
                 {first_sliding} on)"
            ),
        ));
    }
    Ok(())
}
