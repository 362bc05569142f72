//! The error of every [`Backend`](super::Backend) call.

use super::DType;

/// What went wrong in a backend call: a view outside its buffer, lengths that do not
/// match, or an op that rejected its arguments.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// A view `[offset, offset + len)` does not fit in its buffer.
    #[error("view [{offset}, {offset} + {len}) is outside a buffer of {buffer_len} elements")]
    ViewOutOfBounds {
        /// First element of the view.
        offset: usize,
        /// Elements in the view.
        len: usize,
        /// Elements in the buffer.
        buffer_len: usize,
    },
    /// A host slice or buffer does not have the length the call needs.
    #[error("{what}: expected {expected} elements, found {actual}")]
    LengthMismatch {
        /// The argument.
        what: &'static str,
        /// The length the call needs.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// A tensor of another dtype than the op takes there.
    #[error("{op}: `{arg}` holds {actual}, the op takes {expected}")]
    DType {
        /// The backend op.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// The dtype the op takes.
        expected: DType,
        /// The dtype given.
        actual: DType,
    },
    /// A kernel rejected its arguments (shapes, values); `source` is the kernel's reason.
    #[error("{op}: {source}")]
    Op {
        /// The backend op (`linear`, `attention`, ...).
        op: &'static str,
        /// The kernel's error.
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// An op refused its call: a tensor the setting needs is missing, or the backend has no
    /// kernel for the setting.
    #[error("{op}: {message}")]
    Refused {
        /// The backend op.
        op: &'static str,
        /// What is missing or not supported.
        message: String,
    },
}

impl BackendError {
    /// Errors with [`BackendError::DType`] unless `actual == expected`.
    pub fn check_dtype(
        op: &'static str,
        arg: &'static str,
        expected: DType,
        actual: DType,
    ) -> Result<(), Self> {
        if expected == actual {
            Ok(())
        } else {
            Err(Self::DType {
                op,
                arg,
                expected,
                actual,
            })
        }
    }

    /// Errors with [`BackendError::LengthMismatch`] unless `expected == actual`.
    pub fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<(), Self> {
        if expected == actual {
            Ok(())
        } else {
            Err(Self::LengthMismatch {
                what,
                expected,
                actual,
            })
        }
    }
}
