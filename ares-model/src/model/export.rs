//! The model's weights back on the host: [`Model::to_weights`] downloads every parameter
//! under its Hugging Face name and shape, [`Model::save_pretrained`] writes a checkpoint
//! directory `transformers.AutoModelForCausalLM.from_pretrained` loads.

use std::collections::HashMap;
use std::path::Path;

use super::weights::HalfStack;
use super::{Model, ModelError, ModelSpec};
use crate::backend::Backend;
use crate::hf::checkpoint::Checkpoint;
use crate::hf::config::ModelConfig;
use crate::hf::generation::GenerationConfig;
use crate::hf::tensor_files::SaveDtype;
use crate::hf::weights::{ModelWeights, Tensor, expected_tensors};

/// The first field in which two specs differ, as `field: a vs b`.
fn spec_difference(a: &ModelSpec, b: &ModelSpec) -> Option<String> {
    let fields: [(&str, String, String); 16] = [
        (
            "architecture",
            format!("{:?}", a.arch),
            format!("{:?}", b.arch),
        ),
        (
            "num_hidden_layers",
            a.layers.to_string(),
            b.layers.to_string(),
        ),
        ("hidden_size", a.hidden.to_string(), b.hidden.to_string()),
        (
            "intermediate_size",
            a.intermediate.to_string(),
            b.intermediate.to_string(),
        ),
        (
            "num_attention_heads",
            a.q_heads.to_string(),
            b.q_heads.to_string(),
        ),
        (
            "num_key_value_heads",
            a.kv_heads.to_string(),
            b.kv_heads.to_string(),
        ),
        ("head_dim", a.head_dim.to_string(), b.head_dim.to_string()),
        ("vocab_size", a.vocab.to_string(), b.vocab.to_string()),
        ("rms_norm_eps", a.eps.to_string(), b.eps.to_string()),
        (
            "attention bias (q/k/v)",
            a.qkv_bias.to_string(),
            b.qkv_bias.to_string(),
        ),
        ("o_proj bias", a.o_bias.to_string(), b.o_bias.to_string()),
        ("mlp_bias", a.mlp_bias.to_string(), b.mlp_bias.to_string()),
        ("q/k norm", a.qk_norm.to_string(), b.qk_norm.to_string()),
        (
            "tie_word_embeddings",
            a.tied_embeddings.to_string(),
            b.tied_embeddings.to_string(),
        ),
        (
            "max_position_embeddings",
            a.max_positions.to_string(),
            b.max_positions.to_string(),
        ),
        ("rope", format!("{:?}", a.rope), format!("{:?}", b.rope)),
    ];
    fields
        .into_iter()
        .find(|(_, x, y)| x != y)
        .map(|(name, x, y)| format!("{name}: {x} in the config, {y} in the model"))
}

impl<B: Backend> Model<B> {
    /// Every parameter copied to the host as [`ModelWeights`] (f32, the master copy, so a
    /// model loaded from bf16 comes back as the f32 values it computes with; tied
    /// embeddings come back as `embed_tokens` only).
    ///
    /// # Errors
    /// A backend failure.
    pub fn to_weights(&self) -> Result<ModelWeights, ModelError> {
        let mut map = HashMap::new();
        for (name, shape) in expected_tensors(&self.config) {
            let data = self.download_parameter(&name)?;
            map.insert(name, Tensor { shape, data });
        }
        Ok(ModelWeights::from_map(&self.config, map)?)
    }

    /// The parameter with Hugging Face name `name` on the host, in f32 (a weight stored in
    /// bf16 widened, exact).
    ///
    /// # Errors
    /// An unknown name; a backend failure.
    pub(crate) fn download_parameter(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (buffer, layer) = self.weights.buffer_item(name)?;
        if let Some(c) = self.stored_bf16(buffer) {
            return HalfStack::download_widened(&self.backend, c.layer(layer)?);
        }
        let t = self.weights.tensor(name)?;
        let mut data = vec![0.0f32; t.len()];
        self.backend.download(t, &mut data)?;
        Ok(data)
    }

    /// Writes this model as a Hugging Face checkpoint directory `dir`: `model.safetensors`
    /// (in `dtype`; [`SaveDtype::F32`] is exact), `config.json` from `config` (its `dtype`
    /// set to match), and `generation_config.json` when `generation` is given — atomically,
    /// as [`Checkpoint::save`] (the old directory stays until the new one is complete).
    ///
    /// `config` is normally [`Model::config`]; a config with other token ids or metadata
    /// is fine, but it must describe this architecture.
    ///
    /// # Errors
    /// [`ModelError::ConfigMismatch`] when `config` describes another architecture (sizes,
    /// biases, RoPE, tying), a backend failure, or [`ModelError::Hf`] for a file error.
    pub fn save_pretrained(
        &self,
        dir: &Path,
        config: &ModelConfig,
        generation: Option<&GenerationConfig>,
        dtype: SaveDtype,
    ) -> Result<(), ModelError> {
        let spec = ModelSpec::from_config(config)?;
        if let Some(difference) = spec_difference(&spec, &self.spec) {
            return Err(ModelError::ConfigMismatch { difference });
        }
        let checkpoint = Checkpoint {
            config: config.clone(),
            generation: generation.cloned(),
            weights: self.to_weights()?,
        };
        Ok(checkpoint.save(dir, dtype)?)
    }
}
