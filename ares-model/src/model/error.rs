//! The error of building and running a [`Model`](super::Model).

use crate::backend::BackendError;

/// What went wrong building a model from a checkpoint or running it on a batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The config asks for something this model does not implement.
    #[error("unsupported model config: {what}")]
    Unsupported {
        /// What, and what is supported instead.
        what: String,
    },
    /// A tensor the config implies is not in the weights.
    #[error("weights: {name} is missing")]
    MissingWeight {
        /// The Hugging Face tensor name.
        name: String,
    },
    /// A tensor name (Hugging Face style) that names no parameter of this model.
    #[error("no parameter named {name} in this model ({why})")]
    UnknownParameter {
        /// The name asked for.
        name: String,
        /// Why it does not resolve (tied embeddings, no such layer, ...).
        why: String,
    },
    /// A weight tensor has the wrong number of elements for the config.
    #[error("weights: {name} has {actual} elements, the config implies {expected}")]
    WeightShape {
        /// The Hugging Face tensor name.
        name: String,
        /// Elements the config implies.
        expected: usize,
        /// Elements found.
        actual: usize,
    },
    /// An input is not `batch × seq` long, or the batch shape is empty or overflows.
    #[error("input {what}: expected {expected} elements (batch × seq), found {actual}")]
    InputLength {
        /// The input (`input_ids`, `attention_mask`, `position_ids`).
        what: &'static str,
        /// `batch · seq`.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// `batch` or `seq` is 0, or their product overflows.
    #[error("batch shape {batch} × {seq} is empty or too large")]
    BatchShape {
        /// Sequences.
        batch: usize,
        /// Tokens per sequence.
        seq: usize,
    },
    /// A token id is not below the vocabulary size.
    #[error("{what}[{index}] = {id} is out of range for vocab_size {vocab}")]
    TokenOutOfRange {
        /// The input (`input_ids`, `targets`).
        what: &'static str,
        /// Flat index `b·seq + t`.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A position is not below the RoPE table's length (`max_position_embeddings`, at most
    /// `MAX_ROPE_POSITIONS`).
    #[error(
        "position_ids[{index}] = {position} is not below the RoPE table's {max} positions \
         (max_position_embeddings, at most 262144)"
    )]
    PositionOutOfRange {
        /// Flat index `b·seq + t`.
        index: usize,
        /// The position.
        position: u32,
        /// The table length.
        max: usize,
    },
    /// An attention mask value is neither 0 nor 1.
    #[error("attention_mask[{index}] = {value}, expected 0 or 1")]
    InvalidMask {
        /// Flat index `b·seq + t`.
        index: usize,
        /// The value.
        value: u32,
    },
    /// The activations were planned for another batch shape.
    #[error("activations are planned for batch {planned:?} (batch, seq), the input is {actual:?}")]
    ActivationShape {
        /// `(batch, seq)` of the activations.
        planned: (usize, usize),
        /// `(batch, seq)` of the input.
        actual: (usize, usize),
    },
    /// A call that needs the whole logits `[batch·seq, vocab]` was given an arena planned
    /// with a chunked LM head, which keeps none.
    #[error(
        "{what} needs the whole logits, but the activations were planned with a chunked LM \
         head ({rows} rows per chunk); plan them with Model::activations_full"
    )]
    ChunkedLogits {
        /// The call (`download_logits`, `backward with explicit dlogits`, `forward_cached`).
        what: &'static str,
        /// Rows per chunk of the arena.
        rows: usize,
    },
    /// Gradients or optimizer moments whose buffers do not match this model's parameters.
    #[error("{what} do not match this model's parameters (made for another model?)")]
    LayoutMismatch {
        /// What was given (`gradients`, `optimizer moments`).
        what: &'static str,
    },
    /// A scalar argument or one element of a per-token argument is outside its domain.
    #[error("{what} = {value} is invalid: expected {expected}")]
    InvalidValue {
        /// The argument, with the index for an element (`coeffs[12]`, `temperature`).
        what: String,
        /// The value given.
        value: f64,
        /// What is allowed.
        expected: &'static str,
    },
    /// An AdamW hyper-parameter is out of range (the error names it).
    #[error("AdamW config: {0}")]
    AdamWConfig(#[source] ares_cpu::Error),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An optimizer state file is malformed or does not belong to this model.
    #[error("optimizer state {path}: {message}")]
    OptimizerState {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, naming the tensor or metadata key.
        message: String,
    },
    /// A config given to save the model with describes another architecture.
    #[error("the config does not describe this model ({difference})")]
    ConfigMismatch {
        /// The first field that differs, with both values.
        difference: String,
    },
    /// Images or videos that do not fit the prompt or the model (grid, placeholder count,
    /// pixel values), with what was found.
    #[error("vision input: {message}")]
    VisionInput {
        /// What is wrong.
        message: String,
    },
    /// LoRA adapters that do not fit the model, or a LoRA call out of place.
    #[error("LoRA: {message}")]
    Lora {
        /// What is wrong, naming the field or tensor.
        message: String,
    },
    /// An f32 use of a linear weight that the model stores in bf16 only
    /// ([`Model::set_weight_storage`](super::Model::set_weight_storage)).
    #[error(
        "{what}: the model's linear weights are stored in bf16 only (weight storage bf16), \
         without f32 values"
    )]
    Bf16Weights {
        /// The use.
        what: &'static str,
    },
    /// An f32 use of a linear weight gradient stored in bf16
    /// ([`Model::grads_in`](super::Model::grads_in)).
    #[error(
        "{what}: the linear weight gradients are stored in bf16 (grad dtype bf16); read them \
         widened (Grads::download)"
    )]
    Bf16Grads {
        /// The use.
        what: &'static str,
    },
    /// Something that needs f32 activations met activations stored in bf16
    /// ([`Model::set_activation_dtype`](super::Model::set_activation_dtype)).
    #[error(
        "{what} (activations are stored in bf16: activation dtype bf16; \
         Model::set_activation_dtype)"
    )]
    Bf16Activations {
        /// The use.
        what: &'static str,
    },
    /// Converting to or writing the Hugging Face checkpoint failed.
    #[error(transparent)]
    Hf(#[from] crate::hf::HfError),
    /// A backend call failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
