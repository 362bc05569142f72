//! # ares-runner
//!
//! The libtorch-free trainer of ares, as a library behind the `ares-runner` binary.
//!
//! - Model runtime: [`hf`] (Hugging Face files in and out), [`backend`] (the `Backend`
//!   trait and its CPU implementation), [`model`] (Qwen2/Qwen3/Llama forward, backward,
//!   loss head, AdamW, generation).
//! - Training: [`config`] (YAML + overrides), [`data`] (datasets, templates, sampler),
//!   [`reward`] (math grading, format, rubric graders), [`trainer`] (the RL step and loop,
//!   SFT, evaluation), [`metrics`], [`plot`], [`progress`].
//! - [`commands`]: the subcommands of the binary; [`demo`]: the built-in demo's task,
//!   tokenizer and tiny model.

pub mod backend;
pub mod commands;
pub mod config;
pub mod data;
pub mod demo;
pub mod hf;
pub mod metrics;
pub mod model;
pub mod plot;
pub mod progress;
pub mod reward;
pub mod trainer;
