//! Collect: a step's prompts rendered (graded system prompts), `n` samples each generated
//! through the rollout engine (single turns in [`rollout`], tool-using episodes in
//! [`episodes`]), graded ([`grading`]), and padded into the step's `[rows, T]` batch
//! ([`tokens`], [`batch`]).

pub mod batch;
pub mod episodes;
pub mod grading;
pub mod prompts;
pub mod rollout;
pub mod tokens;
