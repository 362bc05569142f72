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

/// `ln 2` split so that `n · LN2_HI` is exact for |n| < 2^7 in `f32` and `f64`
/// (LN2_HI has 16 significant bits).
pub(crate) const LN2_HI: f64 = 0.693_145_751_953_125;
pub(crate) const LN2_LO: f64 = 1.428_606_820_309_417_3e-6;

/// `eˣ` for `|x| ≤ 40` (callers clamp), branch-free and call-free so loops over it
/// vectorise, unlike libm's `exp`.
///
/// x = n·ln2 + r with n = round(x·log₂e) by the 1.5·2^p shifter, |r| ≤ ln2/2 (Cody–Waite
/// split of ln2); `eʳ` by its Taylor polynomial (degree 8 for `f32`, 14 for `f64`:
/// truncation below half an ulp); `2ⁿ` by seven masked multiplies of powers of two (exact).
/// Relative error ≈ 2 ulp. NaN in gives NaN out.
#[inline(always)]
pub(crate) fn exp_bounded<F: Float>(x: F) -> F {
    let shifter = cast::<F>(1.5) / F::epsilon();
    let n = (x * cast(core::f64::consts::LOG2_E) + shifter) - shifter;
    let r = (x - n * cast(LN2_HI)) - n * cast(LN2_LO);
    // Horner from the highest term: p = Σ_{k ≤ degree} r^k / k!
    const INV_FACT_DESC: [f64; 15] = [
        1.1470745597729725e-11,
        1.6059043836821613e-10,
        2.08767569878681e-09,
        2.505210838544172e-08,
        2.755731922398589e-07,
        2.7557319223985893e-06,
        2.48015873015873e-05,
        0.0001984126984126984,
        0.001388888888888889,
        0.008333333333333333,
        0.041666666666666664,
        0.16666666666666666,
        0.5,
        1.0,
        1.0,
    ];
    let skip = if F::epsilon() > cast(1e-10) { 6 } else { 0 }; // degree 8 for f32
    let mut p = F::zero();
    for &c in &INV_FACT_DESC[skip..] {
        p = p * r + cast(c);
    }
    // 2ⁿ for n ∈ [−58, 58]: k = n + 64 ∈ [6, 122], seven bits, starting from 2^−64
    let mut k = n + cast(64.0);
    let mut scale = cast::<F>(1.0 / 18_446_744_073_709_551_616.0);
    for (bit, pow) in [
        (64.0, 18_446_744_073_709_551_616.0),
        (32.0, 4_294_967_296.0),
        (16.0, 65_536.0),
        (8.0, 256.0),
        (4.0, 16.0),
        (2.0, 4.0),
        (1.0, 2.0),
    ] {
        let take = k >= cast(bit);
        k = k - if take { cast(bit) } else { F::zero() };
        scale = scale * if take { cast(pow) } else { F::one() };
    }
    p * scale
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

    #[test]
    fn exp_bounded_matches_libm() {
        let mut worst32 = 0.0f64;
        let mut worst64 = 0.0f64;
        // the documented domain |x| ≤ 40
        let mut x = -40.0;
        while x <= 40.0 {
            let want = libm::exp(x);
            worst64 = worst64.max(((exp_bounded(x) - want) / want).abs());
            let x32 = x as f32;
            let want32 = libm::exp(f64::from(x32));
            worst32 = worst32.max(((f64::from(exp_bounded(x32)) - want32) / want32).abs());
            x += 0.000_731;
        }
        assert!(
            worst64 < 4.0 * f64::EPSILON,
            "f64 worst relative error {worst64:e}"
        );
        assert!(
            worst32 < 4.0 * f64::from(f32::EPSILON),
            "f32 worst relative error {worst32:e}"
        );
        assert_eq!(exp_bounded(0.0f64), 1.0);
        assert_eq!(exp_bounded(0.0f32), 1.0);
        assert!(exp_bounded(f64::NAN).is_nan());
    }
}
