//! # ares-runner
//!
//! The trainer of ares, as a library behind the `ares-runner` binary. Built so far: the
//! Hugging Face file formats ([`hf`]), the [`backend::Backend`] trait with its CPU
//! implementation, and the decoder [`model`] (forward pass) written against it. Rollout,
//! trainer and CLI are the next milestones (see the README's status table).

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
