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

/// Moves the element index of a core error raised on a sub-slice (one row) to its position in
/// the whole batch, so the message points at the right element.
pub(crate) fn at_batch_index(e: ares_core::Error, base: usize) -> ares_core::Error {
    use ares_core::Error as E;
    match e {
        E::NonFinite { what, index } => E::NonFinite {
            what,
            index: base + index,
        },
        E::InvalidMask { what, index } => E::InvalidMask {
            what,
            index: base + index,
        },
        other => other,
    }
}

/// Errors with [`ares_core::Error::LengthMismatch`] unless `actual == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(ares_core::Error::LengthMismatch {
            what,
            expected,
            actual,
        }
        .into())
    }
}

/// `a·b`, or an error if the element count does not fit in `usize`.
pub(crate) fn product(a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| {
        ares_core::Error::OutOfRange {
            what: "dims",
            value: a as f64 * b as f64,
            expected: "a product of dimensions that fits in usize",
        }
        .into()
    })
}
