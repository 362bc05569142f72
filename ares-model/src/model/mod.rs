//! The Qwen2 / Qwen2.5 / Qwen3 / Llama decoder, written once against the
//! [`Backend`] trait.
//!
//! - [`ModelSpec`]: sizes and switches from `config.json` (q/k/v biases for Qwen2, q/k
//!   RMSNorm for Qwen3, llama3 RoPE scaling, tied or untied LM head); unsupported configs
//!   are rejected when the model is built.
//! - [`Model`]: the spec, the weights uploaded once into backend buffers (one buffer per
//!   kind of tensor stacked over layers), and the RoPE cos/sin tables for every position
//!   `< max_position_embeddings` (computed once on the host with `ares-cpu`'s
//!   [`RopeTable`], transformers' f32 numerics, and gathered per token on the device).
//! - [`Activations`]: the activation arena, planned up front for a `(batch, seq)` and
//!   reused across calls; every layer's intermediates are kept for the backward pass. Its
//!   LM head keeps the whole logits or runs in row chunks ([`HeadMode`]; chosen by size
//!   in [`Model::activations`]), so a real vocabulary never needs `[tokens, vocab]`
//!   buffers for training and scoring.
//! - [`Model::forward`]: `input_ids`, `attention_mask`, `position_ids` `[batch, seq]` →
//!   logits `[batch, seq, vocab]` in the arena (a chunked arena: up to the final norm).
//!   The host copies per call are the inputs in and whatever the caller downloads.
//! - [`Model::log_prob_entropy`]: after a forward pass, each token's log-prob of a target
//!   and entropy at a temperature, fused over the logits rows on the device (chunk by
//!   chunk in a chunked arena).
//!
//! - [`Model::backward`]: from ∂L/∂logits (the caller's loss; whole-logits arenas only),
//!   the manual backward pass (llm.c style, per layer, scratch planned with the
//!   activations) accumulating every parameter's gradient into [`Grads`] (same layout as the weights; tied embeddings
//!   share one gradient).
//! - [`Model::backward_from_log_prob_grads`]: the loss head of training, from ∂L/∂logπ
//!   per token (what the policy losses return) through the fused log-prob backward on the
//!   device to the LM head's backward (chunk by chunk, recomputing each chunk's logits, in
//!   a chunked arena) and the rest of [`Model::backward`].
//! - [`AdamW`]: the optimizer over the model's parameters (global gradient norm, skip on a
//!   non-finite norm, clipping, decoupled weight decay), its moments on the device, saved
//!   to and loaded from a safetensors file.
//! - [`Model::generate`]: batched generation with a [`KvCache`] (greedy or seeded
//!   sampling, see [`GenerateRequest`]); [`Model::forward_cached`] is a prefill/decode
//!   step with whole logits (generation's own prefill computes the last position's only).

mod act_dtype;
mod activations;
mod backward;
mod bf16_weights;
mod block_pool;
mod decode_weights;
mod engine;
mod error;
mod export;
mod forward;
mod generate;
mod grads;
mod half_grads;
mod inputs;
mod kv_cache;
mod layer;
mod log_prob_grad;
pub(crate) mod lora;
mod moments;
mod optim;
pub(crate) mod optim_file;
mod paged_kv;
mod picks;
mod request;
mod sampling;
mod spec;
mod unpack;
pub(crate) mod weights;

use ares_cpu::ops::rope::RopeTable;

pub(crate) use act_dtype::{Act, ActMut, ActStack};
pub use act_dtype::{ActLayout, ActivationDtype};

/// Whether a pass over `rows` tokens of a model of `spec` at `precision` runs its attention
/// in bf16 on the tensor cores (on the CPU their twin): bf16 products at those rows and a
/// head size of the tensor-core kernels (`ares_cpu::ops::attention::BF16_HEAD_DIMS`).
pub fn tensor_core_attention(spec: &ModelSpec, precision: MatmulPrecision, rows: usize) -> bool {
    precision.for_rows(rows) == MatmulPrecision::Bf16
        && ares_cpu::ops::attention::BF16_HEAD_DIMS.contains(&spec.head_dim)
}
pub use activations::{Activations, ArenaElements, HeadMode, LossBuffers, arena_elements};
pub use backward::EmbedGrad;
pub use bf16_weights::WeightStorage;
pub use block_pool::BlockPool;
pub use decode_weights::WeightDtype;
pub use engine::{Engine, EngineConfig, EngineRequest, EngineStats, FinishedSequence};
pub use error::ModelError;
pub use generate::Generator;
pub use grads::{Grads, LayerWatch, TrainableMut};
pub use half_grads::GradDtype;
pub(crate) use half_grads::PassKeys;
pub use inputs::{ForwardExtras, Inputs};
pub use kv_cache::KvCache;
pub use lora::{AdaptersOff, lora_arena_elements};
pub use moments::{HostMoment, Moments, StateDtype};
pub use optim::{AdamW, AdamWConfig, ExtraParam, StepReport};
pub use paged_kv::KvCacheDtype;
pub use request::{GenerateError, GenerateOutput, GenerateRequest, PromptVision};
pub use sampling::{SampleKey, Sampling};
pub use spec::{MAX_ROPE_POSITIONS, ModelSpec};

use crate::backend::{Backend, LinearDims, MatmulPrecision, ViewMut};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::config::ModelConfig;
use crate::hf::weights::ModelWeights;
use weights::DeviceWeights;

/// A decoder model on backend `B`: spec, weights and RoPE tables, all device-resident.
#[derive(Debug)]
pub struct Model<B: Backend> {
    backend: B,
    /// The `config.json` the model was built from (names and shapes of its tensors).
    config: ModelConfig,
    spec: ModelSpec,
    weights: DeviceWeights<B>,
    /// Rows of the RoPE tables (positions `0..rope_rows`).
    rope_rows: usize,
    /// `[rope_rows, head_dim/2]` cos and sin of `position · inv_freq`.
    rope_cos: B::Buffer,
    rope_sin: B::Buffer,
    /// How the linear layers (and the LM head) multiply (default exact f32).
    matmul_precision: MatmulPrecision,
    /// Whether new arenas keep one layer's activations ([`Model::set_gradient_checkpointing`]).
    gradient_checkpointing: bool,
    /// How new training arenas store the MLP block's activations
    /// ([`Model::set_activation_dtype`]).
    activation_dtype: ActivationDtype,
    /// Whether packed sequences' attention runs on the backend's segments
    /// ([`Model::set_native_packed_attention`]).
    native_packing: bool,
    /// LoRA adapters ([`Model::add_lora`]): with them the base weights are frozen.
    lora: Option<lora::Lora<B>>,
    /// bf16 copies of the linear weights the bf16 products read
    /// ([`Model::set_bf16_weights`]).
    bf16_weights: Option<bf16_weights::Bf16Weights<B>>,
}

impl<B: Backend> Model<B> {
    /// Builds the model of a loaded Hugging Face checkpoint on `backend`.
    ///
    /// # Errors
    /// As [`Model::new`].
    pub fn from_checkpoint(backend: B, checkpoint: &Checkpoint) -> Result<Self, ModelError> {
        Self::new(backend, &checkpoint.config, &checkpoint.weights)
    }

    /// Builds the model of `config` with `weights`, uploading them to `backend`.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for a config this model does not implement (RoPE types
    /// other than default/linear/llama3, an odd head_dim), a weight missing or of the wrong
    /// size, or a backend failure.
    pub fn new(
        backend: B,
        config: &ModelConfig,
        weights: &ModelWeights,
    ) -> Result<Self, ModelError> {
        let spec = ModelSpec::from_config(config)?;
        let table = RopeTable::new(&spec.rope).map_err(|e| ModelError::Unsupported {
            what: format!("rope: {e}"),
        })?;
        let rope_rows = spec.max_positions;
        let positions = u32::try_from(rope_rows)
            .map(|rows| (0..rows).collect::<Vec<u32>>())
            .map_err(|_| ModelError::Unsupported {
                what: format!("max_position_embeddings = {rope_rows} does not fit in u32"),
            })?;
        let half = spec.head_dim / 2;
        let len = rope_rows
            .checked_mul(half)
            .ok_or_else(|| ModelError::Unsupported {
                what: format!("RoPE table of {rope_rows} × {half} overflows"),
            })?;
        let (mut cos, mut sin) = (vec![0.0f32; len], vec![0.0f32; len]);
        table
            .cos_sin(&positions, &mut cos, &mut sin)
            .map_err(|e| ModelError::Unsupported {
                what: format!("rope table: {e}"),
            })?;
        let mut rope_cos = backend.alloc(len)?;
        let mut rope_sin = backend.alloc(len)?;
        backend.upload(&cos, ViewMut::whole(&mut rope_cos))?;
        backend.upload(&sin, ViewMut::whole(&mut rope_sin))?;
        let weights = DeviceWeights::upload(&backend, &spec, weights)?;
        let native_packing = backend.packs_sequences();
        Ok(Self {
            backend,
            config: config.clone(),
            spec,
            weights,
            rope_rows,
            rope_cos,
            rope_sin,
            matmul_precision: MatmulPrecision::F32,
            gradient_checkpointing: false,
            activation_dtype: ActivationDtype::F32,
            native_packing,
            lora: None,
            bf16_weights: None,
        })
    }

    /// How the linear layers and the LM head multiply from now on: exact f32 (the default),
    /// or operands rounded to TF32 or bf16 with f32 sums (what tensor cores do; see
    /// [`MatmulPrecision`]). Weights, activations, gradients and optimizer state stay f32
    /// in every mode; norms and the loss head are f32 too, and attention is, except that a
    /// bf16 training pass at a head size of the tensor-core kernels multiplies in bf16 as
    /// well (`Backend::attention_bf16`, `Backend::attention_backward_bf16`).
    pub fn set_matmul_precision(&mut self, precision: MatmulPrecision) {
        self.matmul_precision = precision;
    }

    /// Activation checkpointing per decoder layer for the arenas planned from now on
    /// ([`Model::activations`] and the others; off by default): an arena keeps the residual
    /// stream of every layer and the other activations of one, and the backward pass
    /// recomputes each layer's forward from its input before its gradients — the same
    /// gradients, bit for bit, in far less memory, for one more forward pass of the layers
    /// ([`Activations::planned`]).
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// How the attention of packed sequences ([`ForwardExtras::segments`]) runs: `true` on
    /// the backend's segments (the default where [`Backend::packs_sequences`]), `false`
    /// padded — each pass gathers q, k and v into `[segments, longest]` rows, segments
    /// right-aligned, attends with the padded layout's mask and gathers the results back,
    /// while every other op still runs on the packed tokens (the default on a backend
    /// without segments; the CPU and CUDA take them).
    /// The same numbers up to summation order. `true` on a backend without segments makes
    /// packed passes fail.
    pub fn set_native_packed_attention(&mut self, on: bool) {
        self.native_packing = on;
    }

    /// How the arenas of [`Model::activations`] and [`Model::activations_chunked`] planned
    /// from now on store the MLP block's activations (f32 by default): with
    /// [`ActivationDtype::Bf16`] the post-attention norm's output, gate, up and their SwiGLU
    /// in bf16 — `N·(C + 3I)` of a layer's floats halved — and the MLP's products in bf16
    /// whatever the row count, reading and writing them as stored; where the pass's
    /// attention runs on the tensor cores the attention block's input-norm output, q, k and
    /// v too, with the same numbers ([`Model::act_layout`], `act_dtype.rs`). Needs the
    /// weights in bf16 for the products (bf16 copies, [`Model::set_bf16_weights`], or bf16
    /// storage), and no LoRA pair on gate, up or down: planning refuses otherwise
    /// ([`ModelError::Bf16Activations`]). [`Model::activations_full`] (generation, logits)
    /// keeps f32.
    pub fn set_activation_dtype(&mut self, dtype: ActivationDtype) {
        self.activation_dtype = dtype;
    }

    /// How new training arenas store the MLP block's activations
    /// ([`Model::set_activation_dtype`]).
    pub fn activation_dtype(&self) -> ActivationDtype {
        self.activation_dtype
    }

    /// Whether new arenas are checkpointed ([`Model::set_gradient_checkpointing`]).
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// Whether a training pass of `rows` tokens runs attention's two products in bf16
    /// ([`Backend::attention_bf16`]): the bf16 precision at those rows, at a head size the
    /// tensor-core kernel takes (`ares_cpu::ops::attention::BF16_HEAD_DIMS`).
    pub(crate) fn attention_in_bf16(&self, rows: usize) -> bool {
        tensor_core_attention(&self.spec, self.matmul_precision, rows)
    }

    /// The precision of the linear layers ([`Model::set_matmul_precision`]).
    pub fn matmul_precision(&self) -> MatmulPrecision {
        self.matmul_precision
    }

    /// The sizes of a linear layer over `rows` tokens, in this model's precision.
    pub(crate) fn linear_dims(
        &self,
        rows: usize,
        in_features: usize,
        out_features: usize,
    ) -> LinearDims {
        LinearDims {
            rows,
            in_features,
            out_features,
            precision: self.matmul_precision,
        }
    }

    /// The `config.json` this model was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The architecture's sizes and switches.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A new activation arena for `batch` sequences of `seq` tokens, with whole logits
    /// while they take at most 256 MiB and a chunked LM head above ([`HeadMode::auto`]).
    /// Training and scoring work with either; for the whole logits (download, generation)
    /// use [`Model::activations_full`].
    ///
    /// # Errors
    /// As [`Activations::new`].
    pub fn activations(&self, batch: usize, seq: usize) -> Result<Activations<B>, ModelError> {
        let head = HeadMode::auto(batch.saturating_mul(seq), self.spec.vocab);
        self.plan(batch, seq, head, self.activation_dtype)
    }

    /// An arena for forward passes that run no backward (scoring log-probs): the layout of
    /// activation checkpointing — the residual stream of every layer and the other
    /// activations of one, which each layer's forward overwrites — whatever
    /// [`Model::set_gradient_checkpointing`] says, with [`Model::activations`]' head and
    /// dtype. A forward pass gives the bits of any arena's (the same ops on the same
    /// inputs) in about `(L − 1)·N·(3C + 3·Hq·D + 4·Hkv·D + 3I)` fewer floats; a backward
    /// pass would recompute each layer first, as under checkpointing.
    ///
    /// # Errors
    /// As [`Model::activations`].
    pub fn activations_forward(
        &self,
        batch: usize,
        seq: usize,
    ) -> Result<Activations<B>, ModelError> {
        let head = HeadMode::auto(batch.saturating_mul(seq), self.spec.vocab);
        self.plan_with(batch, seq, head, self.activation_dtype, true)
    }

    /// An arena for `batch × seq` tokens with `head`, checkpointed as the model says, the
    /// MLP block's activations stored as `dtype`.
    fn plan(
        &self,
        batch: usize,
        seq: usize,
        head: HeadMode,
        dtype: ActivationDtype,
    ) -> Result<Activations<B>, ModelError> {
        self.plan_with(batch, seq, head, dtype, self.gradient_checkpointing)
    }

    /// [`Model::plan`], `checkpointed` as given.
    fn plan_with(
        &self,
        batch: usize,
        seq: usize,
        head: HeadMode,
        dtype: ActivationDtype,
        checkpointed: bool,
    ) -> Result<Activations<B>, ModelError> {
        let spec = &self.spec;
        if dtype == ActivationDtype::Bf16 {
            self.check_bf16_activations()?;
        }
        let layout = self.act_layout(batch * seq, dtype);
        let mut acts =
            Activations::planned(&self.backend, spec, batch, seq, head, checkpointed, layout)?;
        let kept = if checkpointed {
            spec.layers.min(1)
        } else {
            spec.layers
        };
        acts.lora = self.lora_acts(batch * seq, kept)?;
        Ok(acts)
    }

    /// A new activation arena for `batch` sequences of `seq` tokens that keeps the whole
    /// logits `[batch, seq, vocab]` ([`HeadMode::Full`]), whatever their size.
    ///
    /// # Errors
    /// As [`Activations::with_head`].
    pub fn activations_full(&self, batch: usize, seq: usize) -> Result<Activations<B>, ModelError> {
        self.plan(batch, seq, HeadMode::Full, ActivationDtype::F32)
    }

    /// A new activation arena for `batch` sequences of `seq` tokens with the LM head run
    /// `chunk_rows` tokens at a time ([`HeadMode::Chunked`]): no buffer larger than
    /// `[chunk_rows, vocab]` for the logits or their gradient.
    ///
    /// # Errors
    /// `chunk_rows == 0`, or as [`Activations::with_head`].
    pub fn activations_chunked(
        &self,
        batch: usize,
        seq: usize,
        chunk_rows: usize,
    ) -> Result<Activations<B>, ModelError> {
        let head = HeadMode::Chunked { rows: chunk_rows };
        self.plan(batch, seq, head, self.activation_dtype)
    }

    /// Copies the logits `[batch, seq, vocab]` of the last forward pass in `acts` to `out`.
    ///
    /// # Errors
    /// [`ModelError::ChunkedLogits`] for an arena with a chunked LM head, `out` not `batch ·
    /// seq · vocab` long, or a backend failure.
    pub fn download_logits(
        &self,
        acts: &Activations<B>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        acts.require_full("download_logits")?;
        Ok(self.backend.download(acts.logits(), out)?)
    }

    /// Convenience: plans an arena for the input's shape, runs [`Model::forward`] and
    /// returns the logits `[batch, seq, vocab]` on the host. Allocates per call; loops
    /// should keep one [`Activations`] and call [`Model::forward`].
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn forward_logits(&self, inputs: &Inputs<'_>) -> Result<Vec<f32>, ModelError> {
        inputs.check(&self.spec)?;
        let mut acts = self.activations_full(inputs.batch, inputs.seq)?;
        self.forward(inputs, &mut acts)?;
        let mut out = vec![0.0; acts.logits().len()];
        self.download_logits(&acts, &mut out)?;
        Ok(out)
    }
}
