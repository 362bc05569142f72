//! # ares-runner
//!
//! The libtorch-free trainer of ares, as a library behind the `ares-runner` binary.
//!
//! - Model runtime, re-exported from the `ares-model` crate: [`hf`] (Hugging Face files in
//!   and out), [`backend`] (the `Backend` trait and its CPU and CUDA implementations),
//!   [`model`] (Qwen2/Qwen3/Llama forward, backward, loss head, AdamW, generation).
//! - Training: [`config`] (YAML + overrides), [`data`] (datasets, templates, sampler),
//!   [`reward`] (math grading, format, rubric graders), [`trainer`] (the RL step and loop,
//!   SFT, evaluation), [`metrics`], [`plot`], [`progress`].
//! - [`commands`]: the subcommands of the binary; [`demo`]: the built-in demo's task,
//!   tokenizer and tiny model.

pub use ares_model::{backend, hf, model, vision};

pub mod commands;
pub mod config;
pub mod data;
pub mod demo;
pub mod host_memory;
pub mod metrics;
pub mod parallel;
pub mod plot;
pub mod progress;
pub mod reward;
pub mod tools;
pub mod trainer;
