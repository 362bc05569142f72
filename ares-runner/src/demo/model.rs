//! The demo's tiny model: a randomly initialised Qwen2 decoder written as a Hugging Face
//! directory (`config.json`, `model.safetensors`, `generation_config.json`) that
//! [`crate::hf::checkpoint::Checkpoint::load`] and transformers' `Qwen2ForCausalLM` load.
//!
//! Initialisation as GPT-2 / transformers' `_init_weights` for these models: every matrix
//! (embedding, q/k/v, gate/up) ~ N(0, σ²) with σ = [`TinyModelSpec::init_std`] (0.02),
//! the residual output projections (`o_proj`, `down_proj`) ~ N(0, σ²/(2·layers)) so that the
//! residual stream's variance does not grow with depth, biases 0, RMSNorm weights 1. Normal
//! draws come from a seeded ChaCha20 stream in checkpoint order: the same seed gives the
//! same bytes on every machine.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};

use super::error::DemoError;
use super::rng::{self, Stream};
use super::task::write_text;
use crate::hf::config::{CONFIG_FILE, ModelConfig};
use crate::hf::generation::{GENERATION_CONFIG_FILE, GenerationConfig};
use crate::hf::tensor_files::{SINGLE_FILE, SaveDtype};
use crate::hf::weights::{ModelWeights, Tensor, expected_tensors};

/// Sizes and settings of the tiny Qwen2 model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads (`num_attention_heads`); divides `hidden`, head width even (RoPE).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`); divides `heads`.
    pub kv_heads: usize,
    /// Width of the SwiGLU MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Longest context (`max_position_embeddings`).
    pub max_positions: usize,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// Standard deviation σ of the normal initialisation (`initializer_range`).
    pub init_std: f64,
    /// Whether the LM head reuses the embedding (`tie_word_embeddings`).
    pub tie_embeddings: bool,
}

impl Default for TinyModelSpec {
    /// The demo's size: 128 wide, 3 layers of 4 query / 2 key-value heads of width 32, MLP
    /// 352, tied embeddings: about 0.56 M parameters with the demo vocabulary.
    fn default() -> Self {
        Self {
            hidden: 128,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            intermediate: 352,
            max_positions: 512,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            init_std: 0.02,
            tie_embeddings: true,
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

impl TinyModelSpec {
    /// The shape of Qwen2.5-0.5B (24 layers, hidden 896, 14 query / 2 key-value heads of
    /// 64, MLP 4864, RoPE base 10⁶, tied embeddings) for benchmarks with random weights
    /// (`ares-runner demo-data --shape qwen2.5-0.5b --vocab 151936`).
    pub fn qwen2_5_0_5b() -> Self {
        Self {
            hidden: 896,
            layers: 24,
            heads: 14,
            kv_heads: 2,
            intermediate: 4864,
            max_positions: 32_768,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            init_std: 0.02,
            tie_embeddings: true,
        }
    }

    /// Checks the sizes describe a model the runner implements.
    ///
    /// # Errors
    /// [`DemoError::Setting`] naming the first bad field.
    pub fn validate(&self) -> Result<(), DemoError> {
        for (field, v) in [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("max_positions", self.max_positions),
        ] {
            if v == 0 {
                return Err(setting(field, v, "must be > 0"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(setting(
                "heads",
                self.heads,
                &format!("must divide hidden = {}", self.hidden),
            ));
        }
        if !(self.hidden / self.heads).is_multiple_of(2) {
            return Err(setting(
                "heads",
                self.heads,
                &format!(
                    "the head width hidden / heads = {} must be even (RoPE rotates pairs)",
                    self.hidden / self.heads
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(setting(
                "kv_heads",
                self.kv_heads,
                &format!("must divide heads = {}", self.heads),
            ));
        }
        for (field, v) in [
            ("rope_theta", self.rope_theta),
            ("rms_norm_eps", self.rms_norm_eps),
            ("init_std", self.init_std),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(setting(field, v, "must be finite and > 0"));
            }
        }
        Ok(())
    }

    /// Number of parameters with a vocabulary of `vocab_size` (a tied LM head counted once).
    pub fn parameter_count(&self, vocab_size: usize) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        let d = h.checked_div(self.heads).unwrap_or(0);
        let (q, kv) = (self.heads * d, self.kv_heads * d);
        // Norms, q/k/v with biases, o, gate/up/down.
        let layer = 2 * h + (q * h + q) + 2 * (kv * h + kv) + h * q + 3 * h * i;
        let head = if self.tie_embeddings {
            0
        } else {
            vocab_size * h
        };
        vocab_size * h + self.layers * layer + h + head
    }

    /// The `config.json` of this model (Qwen2, float32).
    pub fn config_json(
        &self,
        vocab_size: usize,
        eos_id: u32,
        pad_id: u32,
        bos_id: Option<u32>,
    ) -> Value {
        json!({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "tie_word_embeddings": self.tie_embeddings,
            "use_sliding_window": false,
            "sliding_window": null,
            "max_window_layers": self.layers,
            "attention_dropout": 0.0,
            "initializer_range": self.init_std,
            "use_cache": true,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "torch_dtype": "float32",
        })
    }
}

/// How a tensor is initialised, from its checkpoint name.
fn init_std(name: &str, spec: &TinyModelSpec) -> Option<f64> {
    if name.ends_with("norm.weight") || name.ends_with(".bias") {
        None
    } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        Some(spec.init_std / (2.0 * spec.layers as f64).sqrt())
    } else {
        Some(spec.init_std)
    }
}

/// `value` as pretty JSON with a final newline.
pub(super) fn write_json(path: &Path, value: &Value) -> Result<(), DemoError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| DemoError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_text(path, &(text + "\n"))
}

/// Writes a randomly initialised model (see the module docs) into `dir` (created if
/// missing): `config.json`, `model.safetensors` (float32) and `generation_config.json`
/// (the same special ids). Other files in `dir`, e.g. a tokenizer, are left alone.
///
/// # Errors
/// [`DemoError::Setting`] for a bad spec or a special id `>= vocab_size`; [`DemoError::Hf`]
/// if the config is refused by the runner's own loader; [`DemoError::Io`] on writing.
pub fn write_random_model(
    dir: &Path,
    spec: &TinyModelSpec,
    vocab_size: usize,
    eos_id: u32,
    pad_id: u32,
    bos_id: Option<u32>,
    seed: u64,
) -> Result<(), DemoError> {
    spec.validate()?;
    if vocab_size == 0 {
        return Err(setting("vocab_size", vocab_size, "must be > 0"));
    }
    for (field, id) in [
        ("eos_id", Some(eos_id)),
        ("pad_id", Some(pad_id)),
        ("bos_id", bos_id),
    ] {
        if let Some(id) = id.filter(|&id| id as usize >= vocab_size) {
            return Err(setting(
                field,
                id,
                &format!("must be < vocab_size = {vocab_size}"),
            ));
        }
    }
    let config_json = spec.config_json(vocab_size, eos_id, pad_id, bos_id);
    let config_path = dir.join(CONFIG_FILE);
    // Validate with the runner's own reader before writing anything.
    let config = ModelConfig::from_json_str(&config_path, &config_json.to_string())?;
    let generation_json = json!({
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "do_sample": true,
        "temperature": 1.0,
        "top_p": 1.0,
    });
    GenerationConfig::from_json_str(
        &dir.join(GENERATION_CONFIG_FILE),
        &generation_json.to_string(),
    )?;

    let mut rng = rng::seeded(seed, Stream::Init);
    let mut map = HashMap::new();
    for (name, shape) in expected_tensors(&config) {
        let mut t = Tensor::zeros(&shape);
        match init_std(&name, spec) {
            Some(std) => t
                .data
                .iter_mut()
                .for_each(|x| *x = (std * rng::normal(&mut rng)) as f32),
            None if name.ends_with("norm.weight") => t.data.fill(1.0),
            None => {}
        }
        map.insert(name, t);
    }
    let weights = ModelWeights::from_map(&config, map)?;
    std::fs::create_dir_all(dir).map_err(|e| DemoError::io(dir, e))?;
    weights.write_safetensors(&dir.join(SINGLE_FILE), &config, SaveDtype::F32)?;
    write_json(&config_path, &config_json)?;
    write_json(&dir.join(GENERATION_CONFIG_FILE), &generation_json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::checkpoint::Checkpoint;

    fn tiny() -> TinyModelSpec {
        TinyModelSpec {
            hidden: 16,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 24,
            max_positions: 32,
            ..TinyModelSpec::default()
        }
    }

    #[test]
    fn bad_specs_name_the_field() {
        let cases: [(&str, TinyModelSpec); 6] = [
            (
                "hidden",
                TinyModelSpec {
                    hidden: 0,
                    ..tiny()
                },
            ),
            ("heads", TinyModelSpec { heads: 3, ..tiny() }),
            // 16 / 8 = 2 is even, 24 / 8 = 3 is odd.
            (
                "heads",
                TinyModelSpec {
                    hidden: 24,
                    heads: 8,
                    kv_heads: 8,
                    ..tiny()
                },
            ),
            (
                "kv_heads",
                TinyModelSpec {
                    kv_heads: 3,
                    ..tiny()
                },
            ),
            (
                "init_std",
                TinyModelSpec {
                    init_std: f64::NAN,
                    ..tiny()
                },
            ),
            (
                "rope_theta",
                TinyModelSpec {
                    rope_theta: 0.0,
                    ..tiny()
                },
            ),
        ];
        for (field, spec) in cases {
            let err = spec.validate().unwrap_err();
            assert!(
                matches!(&err, DemoError::Setting { field: f, .. } if *f == field),
                "{field}: {err}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let err = write_random_model(dir.path(), &tiny(), 10, 10, 0, None, 0).unwrap_err();
        assert!(err.to_string().contains("eos_id"), "{err}");
        assert!(!dir.path().join(CONFIG_FILE).exists());
    }

    #[test]
    fn parameter_count_matches_the_written_tensors() {
        for tie in [true, false] {
            let spec = TinyModelSpec {
                tie_embeddings: tie,
                ..tiny()
            };
            let dir = tempfile::tempdir().unwrap();
            write_random_model(dir.path(), &spec, 11, 10, 9, Some(8), 1).unwrap();
            let ckpt = Checkpoint::load(dir.path()).unwrap();
            let n: usize = ckpt
                .weights
                .tensors()
                .iter()
                .map(|(_, t)| t.data.len())
                .sum();
            assert_eq!(spec.parameter_count(11), n);
            assert_eq!(ckpt.config.tie_word_embeddings, tie);
        }
        // The default: 59 × 128 + 3 × (256 + 128·128 + 128 + 2·(64·128 + 64) + 128·128
        // + 3·128·352) + 128.
        assert_eq!(TinyModelSpec::default().parameter_count(59), 562_176);
    }

    #[test]
    fn init_follows_the_documented_scheme() {
        let dir = tempfile::tempdir().unwrap();
        let spec = TinyModelSpec {
            hidden: 64,
            intermediate: 128,
            ..tiny()
        };
        write_random_model(dir.path(), &spec, 40, 39, 38, None, 7).unwrap();
        let ckpt = Checkpoint::load(dir.path()).unwrap();
        assert_eq!(ckpt.config.eos_token_ids, [39]);
        assert_eq!(ckpt.config.pad_token_id, Some(38));
        assert_eq!(ckpt.config.bos_token_id, None);
        assert_eq!(ckpt.config.rope.theta, 10_000.0);
        let generation = ckpt.generation.as_ref().unwrap();
        assert_eq!(generation.eos_token_ids.as_deref(), Some(&[39][..]));
        let std_of = |t: &Tensor| {
            let n = t.data.len() as f64;
            (t.data.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n).sqrt()
        };
        let w = &ckpt.weights;
        let l = &w.layers[1];
        assert!(w.norm.data.iter().all(|&x| x == 1.0));
        assert!(l.input_layernorm.data.iter().all(|&x| x == 1.0));
        assert!(
            l.q_proj_bias
                .as_ref()
                .unwrap()
                .data
                .iter()
                .all(|&x| x == 0.0)
        );
        // 8192 draws each: relative standard error of the std ~0.8 %.
        for t in [&l.q_proj, &l.gate_proj] {
            assert!((std_of(t) / 0.02 - 1.0).abs() < 0.05, "{}", std_of(t));
        }
        for t in [&l.o_proj, &l.down_proj] {
            assert!(
                (std_of(t) / (0.02 / 2.0) - 1.0).abs() < 0.05,
                "{}",
                std_of(t)
            );
        }
        // Same seed, same bytes; another seed, other weights.
        let again = tempfile::tempdir().unwrap();
        write_random_model(again.path(), &spec, 40, 39, 38, None, 7).unwrap();
        let read = |d: &Path| std::fs::read(d.join(SINGLE_FILE)).unwrap();
        assert_eq!(read(dir.path()), read(again.path()));
        write_random_model(again.path(), &spec, 40, 39, 38, None, 8).unwrap();
        assert_ne!(read(dir.path()), read(again.path()));
    }
}
