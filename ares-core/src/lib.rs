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
//! The normative formulas are in the repository's `docs/algorithms.md`; each function's doc
//! comment restates the formula it computes and its edge cases.
//!
//! ## Conventions
//! - Token data are padded row-major `[rows, cols]` slices described by a [`Shape`], with a
//!   0/1 `mask` of the same shape (1 on response tokens).
//! - The samples of each prompt form a group, described by [`Groups`]: contiguous or permuted
//!   groups of `n`, or groups of different sizes keyed by offsets or by a uid per row.
//! - Outputs and scratch are caller-provided slices; nothing allocates.
//! - Every function either is total or returns [`Result`]; bad input (wrong lengths,
//!   NaN/∞, masks that are not 0/1, out-of-range parameters, groups of one) is an
//!   [`Error`] naming the argument and the value. No function panics on any input.
//!
//! ## Example
//!
//! ARES rewards for one prompt's four samples, then GRPO and REINFORCE Pro Max advantages:
//!
//! ```
//! use ares_core::advantage::{grpo_advantages, reinforce_pro_max, GrpoConfig, ProMaxConfig, ResponseTokens};
//! use ares_core::difficulty::Difficulty;
//! use ares_core::shaping::{shaped_reward, ShapingConfig};
//! use ares_core::{Error, Groups, Shape};
//!
//! // rollout results: correctness and HWE token counts; the prompt is "easy", target T = 4
//! let correct = [true, true, false, true];
//! let hwe_counts = [12.0, 5.0, 9.0, 4.0];
//! let cfg = ShapingConfig::<f64>::default();
//! let mut rewards = [0.0; 4];
//! for (i, r) in rewards.iter_mut().enumerate() {
//!     let alpha = 0.5;
//!     *r = shaped_reward(Difficulty::Easy, correct[i], hwe_counts[i], 4.0, alpha, 0.0, &cfg)?.overall;
//! }
//! // correct but far over budget is penalised: 1 − 0.5 (the cap)
//! assert!((rewards[0] - 0.5).abs() < 1e-12);
//!
//! let groups = Groups::contiguous(4, 4)?;
//! let mut adv = [0.0; 4];
//! grpo_advantages(&groups, &rewards, &GrpoConfig::default(), &mut adv)?;
//!
//! // Pro Max works on padded token tensors [rows, cols] with a 0/1 mask
//! let mask = [1., 1., 1., 1., 1., 0., 1., 0., 0., 1., 1., 1.];
//! let tokens = ResponseTokens::new(Shape::new(4, 3), &mask[..]);
//! let mut token_adv = [0.0; 12];
//! reinforce_pro_max(&groups, &rewards, tokens, &ProMaxConfig::default(), None, &mut token_adv)?;
//!
//! // bad input is an error that names it
//! let one_per_group = Groups::contiguous(4, 1)?;
//! let err = grpo_advantages(&one_per_group, &rewards, &GrpoConfig::default(), &mut adv).unwrap_err();
//! assert_eq!(err, Error::GroupTooSmall { estimator: "grpo", n: 1 });
//! assert_eq!(err.to_string(), "advantage estimator `grpo` needs at least 2 samples per group, got n = 1");
//! # Ok::<(), Error>(())
//! ```
#![no_std]
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod advantage;
pub mod difficulty;
pub mod entropy;
pub mod entropy_bonus;
mod error;
pub mod filter;
pub mod forking;
mod groups;
pub mod kl;
mod lanes;
pub mod length;
pub mod loss;
mod num;
pub mod overlong;
pub mod rubric;
mod shape;
pub mod shaping;

pub use error::{Error, Result};
pub use groups::Groups;
pub use num::round_half_even;
pub use num_traits::Float;
pub use shape::Shape;
