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

    /// Parses the language model's fields of a vision-language config, already rewritten as
    /// a Qwen2 `config.json` by [`crate::vision::config`].
    pub(crate) fn from_text_map(path: &Path, raw: Map<String, Value>) -> Result<Self, HfError> {
        Self::from_map(path, raw)
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
        // The byte size of every weight matrix must fit in usize (no overflow later).
        let bytes = |rows: usize, cols: usize| rows.checked_mul(cols)?.checked_mul(4);
        let fits = num_attention_heads
            .checked_mul(head_dim)
            .and_then(|q| bytes(q, hidden_size))
            .and(bytes(vocab_size, hidden_size))
            .and(bytes(intermediate_size, hidden_size))
            .is_some();
        if !fits {
            return Err(f.error(
                "hidden_size",
                format!(
                    "weight matrices overflow usize (hidden_size {hidden_size}, vocab_size \
                     {vocab_size}, intermediate_size {intermediate_size}, heads × head_dim \
                     {num_attention_heads} × {head_dim})"
                ),
            ));
        }
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
    /// `rope_theta`/`rope_scaling` are added when the source only had `rope_parameters`),
    /// and the token ids of this struct (`bos_token_id`, `eos_token_id`, `pad_token_id`),
    /// so edits to them are saved (`None`/empty: `null` where the source had the key).
    pub fn to_json(&self, dtype: &str) -> Value {
        let mut map = self.raw.clone();
        for (key, id) in [
            ("bos_token_id", self.bos_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            match id {
                Some(id) => {
                    map.insert(key.into(), Value::from(id));
                }
                None if map.contains_key(key) => {
                    map.insert(key.into(), Value::Null);
                }
                None => {}
            }
        }
        let eos_was_list = matches!(map.get("eos_token_id"), Some(Value::Array(_)));
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [id] if !eos_was_list => Value::from(*id),
            ids => Value::from(ids.to_vec()),
        };
        if !eos.is_null() || map.contains_key("eos_token_id") {
            map.insert("eos_token_id".into(), eos);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::rope::RopeScaling;

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 10"#;

    fn parse(extra: &str) -> Result<ModelConfig, HfError> {
        let text = format!(
            "{{{BASE}{}{extra}}}",
            if extra.is_empty() { "" } else { ", " }
        );
        ModelConfig::from_json_str(Path::new("dir/config.json"), &text)
    }

    fn err(extra: &str) -> String {
        match parse(extra) {
            Ok(c) => panic!("expected an error for {extra}, got {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_follow_transformers() {
        let c = parse(r#""model_type": "llama""#).unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim), (4, 16));
        assert_eq!(
            (c.rope.theta, &c.rope.scaling),
            (10_000.0, &RopeScaling::Default)
        );
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.mlp_bias && !c.qk_norm);
        assert_eq!((c.rms_norm_eps, c.max_position_embeddings), (1e-6, 2048));
        assert!(c.eos_token_ids.is_empty() && c.bos_token_id.is_none() && c.dtype.is_none());
        let c = parse(r#""model_type": "qwen3""#).unwrap();
        assert_eq!(c.head_dim, 128);
        assert!(c.qk_norm && !c.qkv_bias && !c.o_bias);
        let c = parse(r#""model_type": "qwen2""#).unwrap();
        assert!(c.qkv_bias && !c.o_bias);
        assert_eq!(c.max_position_embeddings, 32768);
    }

    #[test]
    fn bias_flags_and_token_ids() {
        let c = parse(
            r#""model_type": "llama", "attention_bias": true, "mlp_bias": true,
            "eos_token_id": [7, 8], "torch_dtype": "float16", "tie_word_embeddings": true"#,
        )
        .unwrap();
        assert!(c.qkv_bias && c.o_bias && c.mlp_bias && c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![7, 8]);
        assert_eq!(c.dtype.as_deref(), Some("float16"));
        let c = parse(r#""model_type": "qwen3", "attention_bias": true"#).unwrap();
        assert!(c.qkv_bias && c.o_bias && !c.mlp_bias);
    }

    #[test]
    fn edited_token_ids_are_saved_and_unchanged_ones_keep_their_form() {
        let mut c =
            parse(r#""model_type": "llama", "eos_token_id": [7], "bos_token_id": 1"#).unwrap();
        let j = c.to_json("float32");
        assert_eq!(
            (&j["eos_token_id"], &j["bos_token_id"]),
            (&serde_json::json!([7]), &serde_json::json!(1))
        );
        assert!(j.get("pad_token_id").is_none());
        c.eos_token_ids = vec![3, 4];
        c.bos_token_id = None;
        c.pad_token_id = Some(0);
        let j = c.to_json("float32");
        assert_eq!(j["eos_token_id"], serde_json::json!([3, 4]));
        assert!(j["bos_token_id"].is_null());
        assert_eq!(j["pad_token_id"], serde_json::json!(0));
        let c = parse(r#""model_type": "qwen2", "eos_token_id": 2"#).unwrap();
        assert_eq!(c.to_json("float32")["eos_token_id"], serde_json::json!(2));
    }

    #[test]
    fn architecture_from_architectures_or_error() {
        let c = parse(r#""architectures": ["Qwen2ForCausalLM"]"#).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        let e = err(r#""architectures": ["GPT2LMHeadModel"]"#);
        assert!(e.contains("unknown architecture `GPT2LMHeadModel`"), "{e}");
        assert!(e.contains("qwen2, qwen3, llama"), "{e}");
        let e = err("");
        assert_eq!(
            e,
            "dir/config.json: model_type: missing, and no `architectures` either"
        );
    }

    #[test]
    fn invalid_values_are_named() {
        let e = err(r#""model_type": "llama", "num_key_value_heads": 3"#);
        assert!(e.ends_with("num_key_value_heads: 3 does not divide num_attention_heads = 4"));
        let e = err(r#""model_type": "llama", "hidden_act": "gelu""#);
        assert!(e.contains("hidden_act: `gelu` is not supported"), "{e}");
        let e = err(r#""model_type": "llama", "vocab_size": 0"#);
        assert!(e.contains("vocab_size: must be > 0"), "{e}");
        let e = err(r#""model_type": "llama", "num_attention_heads": 5"#);
        assert!(e.contains("5 does not divide hidden_size = 64"), "{e}");
        let e = err(r#""model_type": "llama", "vocab_size": 18446744073709551615"#);
        assert!(
            e.contains("hidden_size: weight matrices overflow usize"),
            "{e}"
        );
        let e = err(r#""model_type": "llama", "rms_norm_eps": -1"#);
        assert!(e.contains("rms_norm_eps: must be > 0, found -1"), "{e}");
        let e = ModelConfig::from_json_str(Path::new("c.json"), r#"{"model_type": "llama"}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "c.json: hidden_size: missing (required)");
        let e = ModelConfig::from_json_str(Path::new("c.json"), "[1]")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "c.json: expected a JSON object, found an array");
    }

    #[test]
    fn sliding_window_is_refused_only_when_used() {
        parse(r#""model_type": "qwen2", "use_sliding_window": false, "sliding_window": 4096"#)
            .unwrap();
        let e = err(
            r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 4096,
            "max_window_layers": 1"#,
        );
        assert!(
            e.contains("use_sliding_window: sliding-window attention is not supported"),
            "{e}"
        );
        let e =
            err(r#""model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]"#);
        assert!(
            e.contains("layer_types: layer 1 is `sliding_attention`"),
            "{e}"
        );
    }

    #[test]
    fn rope_styles() {
        let c = parse(r#""model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}"#)
            .unwrap();
        assert_eq!(c.rope.theta, 5e5);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        let c = parse(
            r#""model_type": "qwen2", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4}"#,
        )
        .unwrap();
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Other {
                rope_type: "yarn".into()
            }
        );
        assert_eq!(c.rope.scaling.rope_type(), "yarn");
        // Saved for transformers 4.x: rope_scaling copied from rope_parameters.
        let saved = c.to_json("float32");
        assert_eq!(
            saved["rope_scaling"],
            serde_json::json!({"rope_type": "yarn", "factor": 4})
        );
        let c = parse(r#""model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}"#)
            .unwrap();
        assert_eq!(c.to_json("bfloat16")["rope_scaling"], Value::Null);
        assert_eq!(c.to_json("bfloat16")["torch_dtype"], "bfloat16");
        let e =
            err(r#""model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8}"#);
        assert!(
            e.contains("rope_scaling.low_freq_factor: missing (required)"),
            "{e}"
        );
        let e =
            err(r#""model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 0}"#);
        assert!(
            e.contains("rope_scaling.factor: must be > 0, found 0"),
            "{e}"
        );
        let e =
            err(r#""model_type": "llama", "rope_theta": 1, "rope_parameters": {"rope_theta": 2}"#);
        assert!(
            e.contains("rope_theta: 1 contradicts rope_parameters.rope_theta = 2"),
            "{e}"
        );
        let e = err(r#""model_type": "llama", "partial_rotary_factor": 0.5"#);
        assert!(
            e.contains("partial_rotary_factor: 0.5 is not supported"),
            "{e}"
        );
        let e = err(r#""model_type": "llama", "rope_scaling": 3"#);
        assert!(
            e.contains("rope_scaling: expected an object, found a number"),
            "{e}"
        );
    }
}
