//! Hugging Face formats in and out: what users already have on disk is what the runner
//! loads, and what it saves loads back into `transformers`.
//!
//! Errors name the file and the field or tensor (`config.json: num_key_value_heads = 3 does
//! not divide num_attention_heads = 14`), so a user can fix the input without reading code.
//!
//! A model directory is read with [`checkpoint::Checkpoint::load`]: [`config::ModelConfig`]
//! (`config.json`), [`generation::GenerationConfig`] (`generation_config.json`, optional)
//! and [`weights::ModelWeights`] (`model.safetensors` or sharded, via
//! [`tensor_files::TensorFiles`]); [`checkpoint::Checkpoint::save`] writes it back.
//! Text goes through [`tokenizer::Tokenizer`] (`tokenizer.json`, `tokenizer_config.json`)
//! and [`chat::ChatTemplate`] (the model's chat template, inline or `chat_template.jinja`).

mod error;
pub(crate) mod json;

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod generation;
pub mod lora;
pub mod rope;
pub mod tensor_files;
pub mod tokenizer;
pub mod weights;

pub use error::HfError;
