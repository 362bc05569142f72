//! Hugging Face formats in and out: what users already have on disk is what the runner
//! loads, and what it saves loads back into `transformers`.
//!
//! Errors name the file and the field or tensor (`config.json: num_key_value_heads = 3 does
//! not divide num_attention_heads = 14`), so a user can fix the input without reading code.

pub mod chat;
pub mod tokenizer;
