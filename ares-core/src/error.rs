//! The one error type of `ares-core`.
//!
//! Every variant names the input that was wrong (`what`) and the offending value, so a
//! caller can turn it into a message a user can act on without extra context.

use core::fmt;

/// Everything that can be wrong with the input of an `ares-core` function.
///
/// `what` is the name of the argument or configuration field, in the papers' words
/// (`"rewards"`, `"mask"`, `"clip_ratio_low"`, …).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// An input does not have the length its shape or its companions require.
    LengthMismatch {
        /// The argument whose length is wrong.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// A caller-provided scratch buffer is shorter than the function needs.
    ScratchTooSmall {
        /// The scratch argument.
        what: &'static str,
        /// The length the function needs.
        needed: usize,
        /// The length it was given.
        actual: usize,
    },
    /// A group-relative estimator was given groups of fewer than two samples.
    GroupTooSmall {
        /// The estimator, e.g. `"grpo"`, `"rloo"`, `"reinforce_pro_max"`.
        estimator: &'static str,
        /// The group size it was given.
        n: usize,
    },
    /// A group-relative estimator was given a layout with groups of different sizes, one of
    /// which has fewer than two samples.
    RaggedGroupTooSmall {
        /// The estimator.
        estimator: &'static str,
        /// The first such group (in the layout's numbering).
        group: usize,
        /// Its uid, for a layout keyed by uid.
        uid: Option<u64>,
        /// Its size.
        n: usize,
    },
    /// A batch of `len` samples cannot be split into groups of `n`.
    NotDivisible {
        /// The batched argument.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The group size.
        n: usize,
    },
    /// An input holds NaN or ±∞ at `index`.
    NonFinite {
        /// The argument holding the value.
        what: &'static str,
        /// Position of the first non-finite element.
        index: usize,
    },
    /// A 0/1 mask holds something other than 0 or 1 at `index`.
    InvalidMask {
        /// The mask argument.
        what: &'static str,
        /// Position of the first invalid element.
        index: usize,
    },
    /// A parameter lies outside its accepted range.
    OutOfRange {
        /// The parameter, named as in the configuration.
        what: &'static str,
        /// The value it was given (converted to `f64` for the message).
        value: f64,
        /// The accepted range, in words, e.g. `"in [0, 100]"`, `"> 0"`.
        expected: &'static str,
    },
    /// An index array that must be a permutation of `0..len` is not one.
    NotAPermutation {
        /// Position in the index array of the offending entry.
        position: usize,
        /// The entry: out of range, or a repeat of an earlier one.
        value: usize,
        /// The batch size the permutation must cover.
        len: usize,
    },
    /// Rows placed in one group do not share the same prompt key.
    MixedGroup {
        /// The group.
        group: usize,
        /// The first row whose key differs from the group's first row.
        row: usize,
    },
    /// An input must hold at least one element (or one valid element) and holds none.
    Empty {
        /// The argument that is empty.
        what: &'static str,
    },
    /// An index into another input is out of range (or repeated where it must be unique).
    InvalidIndex {
        /// The index argument.
        what: &'static str,
        /// Position of the offending entry in that argument.
        position: usize,
        /// The entry.
        value: usize,
        /// The length it indexes into.
        len: usize,
    },
    /// The `core::fmt::Write` sink refused the output.
    Format,
}

/// `Result` with [`Error`].
pub type Result<T> = core::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::LengthMismatch {
                what,
                expected,
                actual,
            } => {
                write!(f, "`{what}` has {actual} elements, expected {expected}")
            }
            Error::ScratchTooSmall {
                what,
                needed,
                actual,
            } => {
                write!(
                    f,
                    "scratch `{what}` has {actual} elements, needs at least {needed}"
                )
            }
            Error::GroupTooSmall { estimator, n } => write!(
                f,
                "advantage estimator `{estimator}` needs at least 2 samples per group, got n = {n}"
            ),
            Error::RaggedGroupTooSmall {
                estimator,
                group,
                uid,
                n,
            } => {
                write!(
                    f,
                    "advantage estimator `{estimator}` needs at least 2 samples per group; group {group}"
                )?;
                if let Some(uid) = uid {
                    write!(f, " (uid {uid})")?;
                }
                write!(f, " has {n}")
            }
            Error::NotDivisible { what, len, n } => write!(
                f,
                "`{what}` has {len} samples, which is not a multiple of the group size {n}"
            ),
            Error::NonFinite { what, index } => {
                write!(
                    f,
                    "`{what}` holds a non-finite value (NaN or ±inf) at index {index}"
                )
            }
            Error::InvalidMask { what, index } => {
                write!(
                    f,
                    "mask `{what}` holds a value other than 0 or 1 at index {index}"
                )
            }
            Error::OutOfRange {
                what,
                value,
                expected,
            } => {
                write!(f, "`{what}` = {value} is out of range: expected {expected}")
            }
            Error::NotAPermutation {
                position,
                value,
                len,
            } => write!(
                f,
                "index array is not a permutation of 0..{len}: entry {value} at position {position} is out of range or repeated"
            ),
            Error::MixedGroup { group, row } => write!(
                f,
                "group {group} mixes prompts: row {row} has a different prompt from the group's first row"
            ),
            Error::Empty { what } => {
                write!(f, "`{what}` is empty (needs at least one valid element)")
            }
            Error::InvalidIndex {
                what,
                position,
                value,
                len,
            } => write!(
                f,
                "`{what}` entry {value} at position {position} is out of range for length {len} or repeated"
            ),
            Error::Format => write!(f, "the output writer failed"),
        }
    }
}

impl core::error::Error for Error {}

impl From<core::fmt::Error> for Error {
    fn from(_: core::fmt::Error) -> Self {
        Error::Format
    }
}
