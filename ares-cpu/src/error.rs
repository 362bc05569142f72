//! Errors of the CPU kernels.

/// What can be wrong with the input of an `ares-cpu` kernel.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The math library rejected an input (shapes, NaN, ranges, …).
    #[error(transparent)]
    Core(#[from] ares_core::Error),
    /// A logits row holds NaN or +∞, or only −∞ (no token has probability > 0).
    #[error("logits row {row} holds NaN or +inf, or every entry is -inf")]
    BadLogitsRow {
        /// The row.
        row: usize,
    },
    /// A target token id is not below the vocabulary size.
    #[error("target id {id} of row {row} is out of range for vocabulary size {vocab}")]
    TargetOutOfRange {
        /// The row.
        row: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The target token's logit is −∞: its log-prob would be −∞.
    #[error("target id {id} of row {row} has logit -inf (probability 0)")]
    ImpossibleTarget {
        /// The row.
        row: usize,
        /// The id.
        id: u32,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
