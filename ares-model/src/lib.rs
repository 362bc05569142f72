//! # ares-model
//!
//! The model runtime of ares, without the trainer: what inference, SFT, scoring and the RL
//! trainer (`ares-runner`) share.
//!
//! - [`hf`]: Hugging Face files in and out — `config.json`, `generation_config.json`,
//!   safetensors (single or sharded; f32/bf16/f16), `tokenizer.json`, chat templates, atomic
//!   checkpoints.
//! - [`backend`]: the `Backend` trait (every op a model needs, on device buffers) with the
//!   CPU implementation over `ares-cpu` and, with the `cuda` feature, the CUDA one over
//!   `ares-cuda`.
//! - [`model`]: Qwen2 / Qwen3 / Llama forward and hand-written backward, the loss head from
//!   `∂L/∂logπ`, AdamW with state files, batched generation with a KV cache.
//!
//! Nothing here depends on the trainer's configuration, data or CLI.

pub mod backend;
pub mod hf;
pub mod model;
pub mod vision;
