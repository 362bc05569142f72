//! The RL trainer: ARES's loop and its variants (docs/algorithms.md §§1–9), on any [`Backend`].
//!
//! One step, as data flows (each stage a folder):
//!
//! ```text
//! collect: prompts (graded system prompts) ─► rollout / episodes (n samples, entropies)
//!          ─► grading ─► batch (online filter, [rows, T] tensors)
//!   ─► prepare: HWE/τ · buckets, targets, α · rewards · old/ref log-probs · dynamic KL
//!               · dual ascent · advantages
//!   ─► update: PPO epochs, mini/micro-batches (policy: loss and ∂L/∂logπ) ─► AdamW
//!   ─► run: metrics line (report), checkpoints, resume (controllers: τ, T_d, α_d, λ_d, β)
//! ```
//!
//! [`setup`] builds a run (models, settings, the memory plan, the bootstrap pass);
//! [`run::Trainer`] owns the loop; [`sft`] is the supervised cold start and [`eval`] the
//! accuracy/length report.
//!
//! [`Backend`]: crate::backend::Backend

mod error;

pub mod actor;
pub mod checkpoints;
pub mod collect;
pub mod eval;
pub mod prepare;
pub mod report;
pub mod run;
pub mod setup;
pub mod sft;
pub mod update;

pub use error::TrainError;
pub use run::{RunSummary, Trainer};
