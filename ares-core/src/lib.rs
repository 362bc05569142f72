//! # ares-core
//!
//! The exact math of four RL methods for reasoning LLMs, as `no_std`, allocation-free,
//! panic-free functions over slices, generic over [`num_traits::Float`] (`f32`, `f64`):
//!
//! - **ARES / AEPO**: window entropy and high-window-entropy (HWE) tokens ([`entropy`]),
//!   difficulty buckets, targets, adaptive α and dual-ascent λ ([`difficulty`]), the
//!   difficulty-aware entropy reward ([`shaping`]), dynamic token-level KL ([`kl`]).
//! - **GRPO-λ**: top-λ group selection and length-penalty rewards ([`length`]).
//! - **Graded system prompts**: rubric reveal ratios, subsets and messages ([`rubric`]).
//! - **REINFORCE Pro Max** and the other advantage estimators ([`advantage`]).
//! - Shared pieces: PPO clip / dual-clip loss with its gradient ([`loss`]), online group
//!   filtering ([`filter`]).
//!
//! The normative formulas are in the project's `spec/algorithms.md`; each function's doc
//! comment restates the formula it computes and its edge cases.
//!
//! ## Conventions
//! - Token data are padded row-major `[rows, cols]` slices described by a [`Shape`], with a
//!   0/1 `mask` of the same shape (1 on response tokens).
//! - Groups of `n` samples per prompt are described by [`Groups`] (contiguous or permuted).
//! - Outputs and scratch are caller-provided slices; nothing allocates.
//! - Every function either is total or returns [`Result`]; bad input (wrong lengths,
//!   NaN/∞, masks that are not 0/1, out-of-range parameters, groups of one) is an
//!   [`Error`] naming the argument and the value. No function panics on any input.
#![no_std]
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod advantage;
pub mod difficulty;
pub mod entropy;
mod error;
pub mod filter;
mod groups;
pub mod kl;
mod lanes;
pub mod length;
pub mod loss;
mod num;
pub mod rubric;
mod shape;
pub mod shaping;

pub use error::{Error, Result};
pub use groups::Groups;
pub use num::round_half_even;
pub use num_traits::Float;
pub use shape::Shape;
