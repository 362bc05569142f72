//! # ares-runner
//!
//! The trainer of ares, as a library behind the `ares-runner` binary. Built so far: the
//! Hugging Face file formats ([`hf`]). The model runtime, rollout, trainer and CLI are the
//! next milestones (see the README's status table).

pub mod hf;
