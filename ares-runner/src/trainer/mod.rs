//! The RL trainer: one step of seed 001 §3.2 and its variants (spec §§1–9).

mod error;

pub mod advantages;
pub mod batch;
pub mod checkpoints;
pub mod hwe;
pub mod policy;
pub mod prepare;
pub mod resolve;
pub mod rewards;
pub mod rollout;
pub mod sequences;
pub mod settings;
pub mod state;
pub mod tokens;

pub use error::TrainError;
