//! Small numeric helpers shared by the modules: constant conversion without panics and
//! input validation that reports the first offending index.

use crate::error::{Error, Result};
use num_traits::Float;

/// Converts an `f64` constant into `F`. For `f32`/`f64` this never fails; for an exotic
/// `Float` that cannot represent the value the result is NaN, which the callers' finiteness
/// checks turn into an error rather than a panic.
#[inline(always)]
pub(crate) fn cast<F: Float>(x: f64) -> F {
    F::from(x).unwrap_or_else(F::nan)
}

/// `F` → `f64` for error messages (NaN when not representable).
#[inline]
pub(crate) fn to_f64<F: Float>(x: F) -> f64 {
    x.to_f64().unwrap_or(f64::NAN)
}

/// Errors unless `actual == expected`.
#[inline]
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// Errors unless the scratch buffer holds at least `needed` elements.
#[inline]
pub(crate) fn check_scratch(what: &'static str, needed: usize, actual: usize) -> Result<()> {
    if actual >= needed {
        Ok(())
    } else {
        Err(Error::ScratchTooSmall {
            what,
            needed,
            actual,
        })
    }
}

/// Errors at the first NaN or ±∞ of `xs`.
#[inline]
pub(crate) fn check_finite<F: Float>(what: &'static str, xs: &[F]) -> Result<()> {
    match xs.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(index) => Err(Error::NonFinite { what, index }),
    }
}

/// Errors at the first element of `mask` that is neither 0 nor 1.
#[inline]
pub(crate) fn check_mask<F: Float>(what: &'static str, mask: &[F]) -> Result<()> {
    match mask.iter().position(|&m| m != F::zero() && m != F::one()) {
        None => Ok(()),
        Some(index) => Err(Error::InvalidMask { what, index }),
    }
}

/// Errors unless the scalar parameter is finite and `ok` holds for it.
#[inline]
pub(crate) fn check_param<F: Float>(
    what: &'static str,
    value: F,
    ok: bool,
    expected: &'static str,
) -> Result<()> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(Error::OutOfRange {
            what,
            value: to_f64(value),
            expected,
        })
    }
}

/// Round half to even (banker's rounding), the rounding of the spec ("Round means
/// round-half-to-even unless stated") and of numpy/Python's `round`.
/// Non-finite input is returned unchanged.
#[inline]
pub fn round_half_even<F: Float>(x: F) -> F {
    let r = x.round(); // halfway cases go away from zero
    if (r - x).abs() == cast::<F>(0.5) && (r * cast::<F>(0.5)).fract() != F::zero() {
        // halfway and `r` is odd: the even neighbour is one step back toward zero
        r - x.signum()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_half_even_matches_python() {
        let cases = [
            (0.5, 0.0),
            (1.5, 2.0),
            (2.5, 2.0),
            (-0.5, 0.0),
            (-1.5, -2.0),
            (-2.5, -2.0),
            (2.4, 2.0),
            (2.6, 3.0),
            (7.0, 7.0),
            (3.5, 4.0),
        ];
        for (x, want) in cases {
            assert_eq!(round_half_even(x), want, "round_half_even({x})");
            assert_eq!(
                round_half_even(x as f32),
                want as f32,
                "round_half_even({x}f32)"
            );
        }
    }
}
