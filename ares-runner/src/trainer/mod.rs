//! The RL trainer: ARES's loop and its variants (docs/algorithms.md §§1–9), on any [`Backend`].
//!
//! One step, as data flows (each stage a module):
//!
//! ```text
//! prompts ─► prompts (graded system prompts) ─► rollout (n samples, entropies) ─► grading
//!   ─► prepare: online filter · HWE/τ · buckets, targets, α · rewards · old/ref log-probs
//!               · dynamic KL · dual ascent · advantages
//!   ─► update: PPO epochs, mini/micro-batches (policy: loss and ∂L/∂logπ) ─► AdamW
//!   ─► run: metrics line, checkpoints (checkpoints), resume (controllers: τ, T_d, α_d, λ_d, β)
//! ```
//!
//! [`run::Trainer`] owns the loop; [`sft`] is the supervised cold start and [`eval`] the
//! accuracy/length report.
//!
//! [`Backend`]: crate::backend::Backend

mod error;

pub mod actor;
pub mod advantages;
pub mod batch;
pub mod bootstrap;
pub mod checkpoints;
pub mod controllers;
pub mod device;
pub mod episodes;
pub mod eval;
pub mod grading;
pub mod hwe;
pub mod memory;
pub mod policy;
pub mod prepare;
pub mod prompts;
pub mod report;
pub mod rewards;
pub mod rollout;
pub mod run;
pub mod sequences;
pub mod settings;
pub mod setup;
pub mod sft;
pub mod tokens;
pub mod update;

pub use error::TrainError;
pub use run::{RunSummary, Trainer};
