//! [`TrainError`]: everything that can stop a training run, each naming what was wrong.

use std::path::PathBuf;

use crate::model::{GenerateError, ModelError};

/// Why training (or a piece of its step) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// An ares-core function rejected its input (the message names the argument).
    #[error(transparent)]
    Core(#[from] ares_core::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A value that must be finite is not.
    #[error("{what} is not finite")]
    NonFinite {
        /// What it is.
        what: String,
    },
    /// The generation rounds of a step could not fill its batch.
    #[error(
        "a step collected {kept} of {wanted} groups in {tries} generation rounds \
         (trainer.max_try_make_batch = {tries}): {}",
        if *filtering {
            "online filtering dropped the others as all-correct or all-wrong; raise \
             max_try_make_batch, widen algorithm.filter_low/filter_high, or turn \
             algorithm.online_filtering off"
        } else {
            "data.mini_rollout_batch_size prompts a round are too few; raise it or \
             max_try_make_batch"
        }
    )]
    FilterExhausted {
        /// Groups kept.
        kept: usize,
        /// Groups wanted (`data.rollout_batch_size`).
        wanted: usize,
        /// Rounds tried.
        tries: usize,
        /// Whether online filtering was on.
        filtering: bool,
    },
    /// The ranks of a data-parallel run lost each other (one stopped or hangs).
    #[error(transparent)]
    Collective(#[from] crate::parallel::CollectiveError),
    /// Another rank of a data-parallel run failed; every rank stops with its message.
    #[error("rank {rank} failed: {what}")]
    OtherRank {
        /// That rank.
        rank: usize,
        /// Its error.
        what: String,
    },
    /// Invalid input or setting found while running (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// A broken internal invariant (a bug: please report it).
    #[error("internal error: {0}")]
    Internal(String),
}

impl TrainError {
    /// An I/O error at `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<crate::parallel::UnitsError<TrainError>> for TrainError {
    fn from(e: crate::parallel::UnitsError<TrainError>) -> Self {
        use crate::parallel::UnitsError;
        match e {
            UnitsError::Unit(e) => e,
            UnitsError::Elsewhere { rank, what } => TrainError::OtherRank { rank, what },
            UnitsError::Collective(e) => TrainError::Collective(e),
        }
    }
}

/// A backend op of the step's own tensors (HWE, KL, scoring) failed: reported as the
/// model's error, which names the op.
impl From<crate::backend::BackendError> for TrainError {
    fn from(e: crate::backend::BackendError) -> Self {
        TrainError::Model(ModelError::from(e))
    }
}
