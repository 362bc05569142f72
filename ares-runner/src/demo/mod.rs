//! The built-in demo's assets: what `ares-runner train` with no arguments trains on.
//!
//! The demo must show, on two CPU cores in minutes, that ARES makes a model more accurate
//! and shorter on easy problems. It needs a task whose answers are checked exactly and
//! whose solutions carry removable redundancy, and a model small enough to learn it quickly:
//!
//! - [`task`]: integer arithmetic in three difficulty levels (`23+7`; `3+4+5`, `6*7`;
//!   `3+4+5+6`, `(3+4)*5`), graded by the integer in `\boxed{}`; worked solutions with 0–3
//!   redundant `check …` lines; fixed train/eval split; SFT examples; verl-style JSONL.
//! - [`tokenizer`]: a 59-token character-level Hugging Face tokenizer with a ChatML template.
//! - [`model`]: a randomly initialised Qwen2 decoder of about 0.56 M parameters.
//! - [`write_demo_assets`]: all of it as files under one directory, loaded by the trainer
//!   through the same code paths as a user's model and data.
//!
//! The vision demo's are in [`vision_task`], [`vision_model`] and [`vision_assets`]; the
//! tool-use demo's (a calculator the model learns when to call) in [`tools_task`].

mod assets;
mod error;
pub mod model;
mod rng;
pub mod task;
pub mod tokenizer;
pub mod tools_task;
pub mod vision_assets;
pub mod vision_model;
pub mod vision_task;

pub use assets::{DemoAssets, DemoOptions, write_demo_assets, write_demo_assets_with};
pub use error::DemoError;
