//! [`ModelSpec`]: the sizes and switches of the decoder, read from a Hugging Face
//! `config.json` and checked for what this model implements.

use ares_cpu::ops::rope::{RopeConfig, RopeScaling as CpuRopeScaling};

use super::ModelError;
use crate::hf::config::{Arch, ModelConfig};
use crate::hf::rope::RopeScaling;

/// The most positions the precomputed RoPE tables hold (262 144: 128 MiB of cos and sin at
/// a head_dim of 128), whatever `max_position_embeddings` a downloaded config declares — a
/// table sized by a config of 4 × 10⁹ positions would take 16 GB before any check. Longer
/// sequences are refused with the limit named.
pub const MAX_ROPE_POSITIONS: usize = 1 << 18;

/// Everything the forward pass needs to know about the architecture.
///
/// Qwen2: q/k/v biases. Qwen3: q/k RMSNorm per head before RoPE, no biases. Llama: no
/// biases (unless `attention_bias` / `mlp_bias`), RoPE possibly llama3-scaled. All: SwiGLU
/// MLP, pre-norm RMSNorm blocks, tied or untied LM head.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The architecture family.
    pub arch: Arch,
    /// Decoder layers.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP.
    pub intermediate: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding, columns of the logits).
    pub vocab: usize,
    /// RMSNorm epsilon, rounded to f32 as torch adds it to an f32 tensor.
    pub eps: f32,
    /// Biases on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// RMSNorm of q and k per head (Qwen3).
    pub qk_norm: bool,
    /// The LM head is the token embedding.
    pub tied_embeddings: bool,
    /// Rows of the RoPE cos/sin table: positions must be below this.
    /// `max_position_embeddings`, at most [`MAX_ROPE_POSITIONS`].
    pub max_positions: usize,
    /// RoPE frequencies.
    pub rope: RopeConfig,
}

impl ModelSpec {
    /// The spec of `config`.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for a RoPE type other than default, linear and llama3.
    /// (`config.json` was already checked for `hidden_act = silu`, head counts and sizes.)
    pub fn from_config(config: &ModelConfig) -> Result<Self, ModelError> {
        let scaling = match &config.rope.scaling {
            RopeScaling::Default => CpuRopeScaling::None,
            RopeScaling::Linear { factor } => CpuRopeScaling::Linear { factor: *factor },
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => CpuRopeScaling::Llama3 {
                factor: *factor,
                low_freq_factor: *low_freq_factor,
                high_freq_factor: *high_freq_factor,
                original_max_position_embeddings: u32::try_from(*original_max_position_embeddings)
                    .map_err(|_| ModelError::Unsupported {
                        what: format!(
                            "rope_scaling.original_max_position_embeddings = \
                             {original_max_position_embeddings} does not fit in u32"
                        ),
                    })?,
            },
            RopeScaling::Other { rope_type } => {
                return Err(ModelError::Unsupported {
                    what: format!("rope_type `{rope_type}` (supported: default, linear, llama3)"),
                });
            }
        };
        Ok(Self {
            arch: config.arch,
            layers: config.num_hidden_layers,
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            q_heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            vocab: config.vocab_size,
            eps: config.rms_norm_eps as f32,
            qkv_bias: config.qkv_bias,
            o_bias: config.o_bias,
            mlp_bias: config.mlp_bias,
            qk_norm: config.qk_norm,
            tied_embeddings: config.tie_word_embeddings,
            // the table is precomputed: a config from a downloaded folder may not size it
            max_positions: config.max_position_embeddings.min(MAX_ROPE_POSITIONS),
            rope: RopeConfig {
                head_dim: config.head_dim,
                theta: config.rope.theta,
                scaling,
            },
        })
    }

    /// Width of the query projection, `q_heads · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Width of the key and value projections, `kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
