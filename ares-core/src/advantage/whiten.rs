//! Masked whitening of token advantages over the whole batch (REINFORCE++).

use crate::Shape;
use crate::error::{Error, Result};
use crate::lanes::{self, BLOCK, Block, Moments, bad_mask, bad_value, select};
use crate::num::{cast, check_finite, check_mask};
use num_traits::Float;

/// Floor of the variance in the whitening denominator `√max(var, floor)`.
pub const WHITEN_VAR_FLOOR: f64 = 1e-8;

/// The statistics [`masked_whiten`] normalised with, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WhitenStats<F> {
    /// μ: mean over valid tokens.
    pub mean: F,
    /// Population variance over valid tokens (before the floor).
    pub var: F,
    /// Number of valid tokens.
    pub valid_tokens: usize,
}

/// Whitens token values over the whole batch: with μ = masked mean and
/// var = masked mean of (A − μ)² (population), `A ← m·(A − μ)/√max(var, 1e−8)`; padded
/// positions become 0. Returns (μ, var) for metrics.
///
/// Statistics are merged from per-row moments (Chan's update), so they are accurate in `f32`
/// over millions of tokens; the values are read twice and written once.
///
/// Errors: `values`/`mask` ≠ rows × cols → `LengthMismatch`; non-finite value (padded
/// positions included) → `NonFinite`; mask not 0/1 → `InvalidMask`; no valid token →
/// `Empty("mask")`; finite values whose statistics overflow → `OutOfRange`. On error `values`
/// is unchanged.
pub fn masked_whiten<F: Float>(
    shape: Shape,
    values: &mut [F],
    mask: &[F],
) -> Result<WhitenStats<F>> {
    shape.check("values", values.len())?;
    shape.check("mask", mask.len())?;
    let cols = shape.cols;
    let mut acc = Moments::empty();
    let mut ok = true;
    for r in 0..shape.rows {
        let (mo, row_ok) = row_moments(lanes::row(values, cols, r), lanes::row(mask, cols, r));
        ok &= row_ok;
        acc.merge(mo);
    }
    if !ok {
        check_finite("values", values)?;
        check_mask("mask", mask)?;
    }
    finish(acc, values, mask)
}

/// Turns merged moments into the stats and applies the whitening to `values`.
pub(crate) fn finish<F: Float>(
    acc: Moments<F>,
    values: &mut [F],
    mask: &[F],
) -> Result<WhitenStats<F>> {
    if acc.count == 0 {
        return Err(Error::Empty { what: "mask" });
    }
    let var = acc.variance();
    if !(acc.mean.is_finite() && var.is_finite()) {
        return Err(super::token::overflow("whitening statistics"));
    }
    let floor = cast::<F>(WHITEN_VAR_FLOOR);
    let rstd = F::one() / select(var > floor, var, floor).sqrt();
    apply(values, mask, acc.mean, rstd);
    Ok(WhitenStats {
        mean: acc.mean,
        var,
        valid_tokens: acc.count,
    })
}

/// `v = m·(v − μ)·rstd` over the flat tensor.
fn apply<F: Float>(v: &mut [F], m: &[F], mean: F, rstd: F) {
    for (x, &w) in v.iter_mut().zip(m) {
        *x = w * ((*x - mean) * rstd);
    }
}

/// Count, mean and M2 of a row's valid values (two passes; the row stays in L1), and whether
/// the values are finite and the mask 0/1.
pub(crate) fn row_moments<F: Float>(v: &[F], m: &[F]) -> (Moments<F>, bool) {
    let mut s: Block<F> = lanes::zeros();
    let mut count = 0usize;
    let mut bad = false;
    for (vb, mb) in v.chunks(BLOCK).zip(m.chunks(BLOCK)) {
        // indexed loop over a block of known length ≤ BLOCK: it vectorises
        let n = vb.len().min(mb.len()).min(BLOCK);
        let (Some(vb), Some(mb)) = (vb.get(..n), mb.get(..n)) else {
            continue;
        };
        let mut c = 0u32;
        for i in 0..n {
            let (x, w) = (vb[i], mb[i]);
            let on = w != F::zero();
            s[i] = s[i] + select(on, x, F::zero());
            c += u32::from(on);
            bad |= bad_value(x) | bad_mask(w);
        }
        count += c as usize;
    }
    if count == 0 || bad {
        return (Moments::empty(), !bad);
    }
    let mean = lanes::total(&s) / cast(count as f64);
    let mut q: Block<F> = lanes::zeros();
    for (vb, mb) in v.chunks(BLOCK).zip(m.chunks(BLOCK)) {
        let n = vb.len().min(mb.len()).min(BLOCK);
        let (Some(vb), Some(mb)) = (vb.get(..n), mb.get(..n)) else {
            continue;
        };
        for i in 0..n {
            let d = select(mb[i] != F::zero(), vb[i] - mean, F::zero());
            q[i] = q[i] + d * d;
        }
    }
    (
        Moments {
            count,
            mean,
            m2: lanes::total(&q),
        },
        true,
    )
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec;

    #[test]
    fn hand_checked() {
        // valid values 1, 2, 3, 6: μ = 3, var = (4 + 1 + 0 + 9)/4 = 3.5
        let shape = Shape::new(2, 3);
        let mut v = [1.0, 2.0, 100.0, 3.0, 6.0, -7.0];
        let m = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0];
        let st = masked_whiten(shape, &mut v, &m).unwrap();
        assert_eq!((st.mean, st.var, st.valid_tokens), (3.0, 3.5, 4));
        let s = 3.5f64.sqrt();
        let want = [-2.0 / s, -1.0 / s, 0.0, 0.0, 3.0 / s, 0.0];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-15);
        }
        // constant values: var 0 → floor 1e−8, output 0
        let mut c = [2.0f32; 4];
        let st = masked_whiten(Shape::new(1, 4), &mut c, &[1.0; 4]).unwrap();
        assert_eq!((st.mean, st.var), (2.0, 0.0));
        assert_eq!(c, [0.0; 4]);
    }

    #[test]
    fn errors() {
        let shape = Shape::new(1, 3);
        let mut v = [1.0, f64::NAN, 3.0];
        assert_eq!(
            masked_whiten(shape, &mut v, &[1.0, 0.0, 1.0]),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        let mut v = [1.0, 2.0, 3.0];
        assert_eq!(
            masked_whiten(shape, &mut v, &[0.0; 3]),
            Err(Error::Empty { what: "mask" })
        );
        assert_eq!(
            masked_whiten(shape, &mut v, &[1.0, -1.0, 0.0]),
            Err(Error::InvalidMask {
                what: "mask",
                index: 1
            })
        );
        assert_eq!(v, [1.0, 2.0, 3.0]);
        assert!(matches!(
            masked_whiten(Shape::new(1, 2), &mut [f64::MAX, -f64::MAX], &[1.0, 1.0]),
            Err(Error::OutOfRange { .. })
        ));
    }

    proptest! {
        #[test]
        fn whitened_mean_zero_var_one(
            rows in 1usize..5,
            cols in 1usize..70,
            seed in proptest::collection::vec((-50.0f64..50.0, 0u8..3), 350),
        ) {
            let shape = Shape::new(rows, cols);
            let n = rows * cols;
            let mut v: Vec<f64> = seed.iter().cycle().take(n).map(|s| s.0).collect();
            let m: Vec<f64> = seed.iter().cycle().take(n).map(|s| (s.1 != 0) as u8 as f64).collect();
            let valid: Vec<f64> = v.iter().zip(&m).filter(|p| *p.1 == 1.0).map(|p| *p.0).collect();
            prop_assume!(!valid.is_empty());
            let mu = valid.iter().sum::<f64>() / valid.len() as f64;
            let var = valid.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / valid.len() as f64;
            let st = masked_whiten(shape, &mut v, &m).unwrap();
            prop_assert!((st.mean - mu).abs() < 1e-9 && (st.var - var).abs() < 1e-7 * (1.0 + var));
            let out: Vec<f64> = v.iter().zip(&m).filter(|p| *p.1 == 1.0).map(|p| *p.0).collect();
            let om = out.iter().sum::<f64>() / out.len() as f64;
            prop_assert!(om.abs() < 1e-9);
            if var > 1e-6 {
                let ov = out.iter().map(|x| (x - om).powi(2)).sum::<f64>() / out.len() as f64;
                prop_assert!((ov - 1.0).abs() < 1e-9);
            }
            for (x, w) in v.iter().zip(&m) {
                if *w == 0.0 { prop_assert_eq!(*x, 0.0); }
            }
        }
    }
}
