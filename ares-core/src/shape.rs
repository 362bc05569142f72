//! Token tensors: padded row-major `[rows, cols]` slices with a 0/1 mask, the layout the
//! GPU kernels and the runner use.

use crate::error::{Error, Result};
use crate::num::{check_len, check_mask};
use num_traits::Float;

/// The shape of a padded token tensor: `rows` responses of `cols` positions each, stored
/// row-major, so element `(r, t)` is at `r * cols + t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Number of responses (batch rows).
    pub rows: usize,
    /// Padded response length (columns).
    pub cols: usize,
}

impl Shape {
    /// A `[rows, cols]` shape.
    #[inline]
    pub const fn new(rows: usize, cols: usize) -> Self {
        Shape { rows, cols }
    }

    /// `rows * cols`, or an error if it overflows `usize`.
    #[inline]
    pub fn len(&self) -> Result<usize> {
        self.rows.checked_mul(self.cols).ok_or(Error::OutOfRange {
            what: "shape (rows × cols)",
            value: self.rows as f64 * self.cols as f64,
            expected: "rows × cols to fit in usize",
        })
    }

    /// True when the tensor holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// Errors unless `len == rows * cols`.
    #[inline]
    pub fn check(&self, what: &'static str, len: usize) -> Result<()> {
        check_len(what, self.len()?, len)
    }

    /// Errors unless `mask` has this shape and holds only 0 and 1.
    #[inline]
    pub fn check_mask<F: Float>(&self, what: &'static str, mask: &[F]) -> Result<()> {
        self.check(what, mask.len())?;
        check_mask(what, mask)
    }

    /// The half-open element range of row `r` (callers ensure `r < rows`).
    #[inline]
    pub fn row_range(&self, r: usize) -> core::ops::Range<usize> {
        r * self.cols..(r + 1) * self.cols
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_len_and_mask() {
        let s = Shape::new(2, 3);
        assert_eq!(s.len(), Ok(6));
        assert!(s.check("x", 6).is_ok());
        assert_eq!(
            s.check("x", 5),
            Err(Error::LengthMismatch {
                what: "x",
                expected: 6,
                actual: 5
            })
        );
        assert!(
            s.check_mask("m", &[1.0f32, 1.0, 0.0, 1.0, 0.0, 0.0])
                .is_ok()
        );
        assert_eq!(
            s.check_mask("m", &[1.0f32, 0.5, 0.0, 1.0, 0.0, 0.0]),
            Err(Error::InvalidMask {
                what: "m",
                index: 1
            })
        );
        assert!(Shape::new(usize::MAX, 2).len().is_err());
        assert_eq!(s.row_range(1), 3..6);
    }
}
