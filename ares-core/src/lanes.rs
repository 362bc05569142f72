//! Block-accumulator kernels shared by the O(tokens) passes of [`crate::advantage`],
//! [`crate::kl`] and [`crate::loss`].
//!
//! Floating-point addition is not associative, so LLVM never vectorises a running sum, and
//! its straight-line (SLP) vectoriser handles hand-unrolled multi-accumulator lanes poorly.
//! What it does vectorise reliably is an element-wise loop. So every reduction here keeps an
//! accumulator *array* of `BLOCK` partial sums and walks the data in blocks of `BLOCK`,
//! adding element i of each block into slot i: an element-wise update the loop vectoriser
//! turns into SIMD code. The slots are added pairwise at the end, which is also more
//! accurate than one long chain.
//!
//! Counts and validation are fused into the same passes as integer / boolean reductions,
//! which LLVM does vectorise in registers: a `u32` count of valid tokens, and a "bad" flag
//! ORed over "mask entry not 0/1" and "value not finite" (`x − x ≠ 0`). Only when the flag is
//! set do the callers rescan the inputs to name the offending argument and index.

use crate::num::cast;
use num_traits::Float;

/// Accumulator slots per reduction (and block length of the data walk).
pub(crate) const BLOCK: usize = 64;

/// One partial value per slot.
pub(crate) type Block<F> = [F; BLOCK];

/// All-zero slots.
#[inline(always)]
pub(crate) fn zeros<F: Float>() -> Block<F> {
    [F::zero(); BLOCK]
}

/// Pairwise sum of the slots.
#[inline]
pub(crate) fn total<F: Float>(a: &Block<F>) -> F {
    let mut w = *a;
    let mut n = BLOCK;
    while n > 1 {
        n /= 2;
        let (lo, hi) = w.split_at_mut(n);
        for (x, y) in lo.iter_mut().zip(hi.iter()) {
            *x = *x + *y;
        }
    }
    w.first().copied().unwrap_or_else(F::zero)
}

/// True when a mask entry is neither 0 nor 1 (NaN included).
#[inline(always)]
pub(crate) fn bad_mask<F: Float>(m: F) -> bool {
    !(m == F::zero() || m == F::one())
}

/// True when `x` is NaN or ±∞ (`x − x` is 0 exactly for finite `x`); a compare, so it
/// vectorises where `is_finite` may not.
#[inline(always)]
#[allow(clippy::eq_op)] // `x − x` is the point
pub(crate) fn bad_value<F: Float>(x: F) -> bool {
    !(x - x == F::zero())
}

/// `select(c, a, b)` written so LLVM turns it into a blend.
#[inline(always)]
pub(crate) fn select<F: Float>(c: bool, a: F, b: F) -> F {
    if c { a } else { b }
}

/// Neumaier-compensated running sum, for totals over rows and groups (few terms, each a
/// lane-split partial), so batch-wide statistics keep their precision in `f32`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sum<F> {
    s: F,
    c: F,
}

impl<F: Float> Sum<F> {
    /// Zero.
    #[inline]
    pub(crate) fn new() -> Self {
        Sum {
            s: F::zero(),
            c: F::zero(),
        }
    }

    /// Adds `x`.
    #[inline]
    pub(crate) fn add(&mut self, x: F) {
        let t = self.s + x;
        // the lost low-order part of whichever operand is smaller
        self.c = self.c
            + if self.s.abs() >= x.abs() {
                (self.s - t) + x
            } else {
                (x - t) + self.s
            };
        self.s = t;
    }

    /// The compensated total.
    #[inline]
    pub(crate) fn value(&self) -> F {
        self.s + self.c
    }
}

/// Count, mean and sum of squared deviations of a set of values, merged across rows with
/// Chan et al.'s pairwise update (stable: no `Σx² − n·μ²` cancellation).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Moments<F> {
    pub(crate) count: usize,
    pub(crate) mean: F,
    pub(crate) m2: F,
}

impl<F: Float> Moments<F> {
    /// No values.
    #[inline]
    pub(crate) fn empty() -> Self {
        Moments {
            count: 0,
            mean: F::zero(),
            m2: F::zero(),
        }
    }

    /// Merges `other` into `self`.
    #[inline]
    pub(crate) fn merge(&mut self, other: Moments<F>) {
        if other.count == 0 {
            return;
        }
        if self.count == 0 {
            *self = other;
            return;
        }
        let total = self.count.saturating_add(other.count);
        let (na, nb, n) = (
            cast::<F>(self.count as f64),
            cast::<F>(other.count as f64),
            cast::<F>(total as f64),
        );
        let delta = other.mean - self.mean;
        self.mean = self.mean + delta * (nb / n);
        self.m2 = self.m2 + other.m2 + delta * delta * (na * (nb / n));
        self.count = total;
    }

    /// Population variance `m2 / count` (0 when empty).
    #[inline]
    pub(crate) fn variance(&self) -> F {
        if self.count == 0 {
            F::zero()
        } else {
            self.m2 / cast::<F>(self.count as f64)
        }
    }
}

/// Row `r` of a row-major `[rows, cols]` slice; empty when out of range (callers validate
/// shapes first, so this only keeps the code free of panicking index arithmetic).
#[inline]
pub(crate) fn row<F>(xs: &[F], cols: usize, r: usize) -> &[F] {
    match r
        .checked_mul(cols)
        .and_then(|s| Some(s..s.checked_add(cols)?))
    {
        Some(range) => xs.get(range).unwrap_or(&[]),
        None => &[],
    }
}

/// Mutable row `r`; empty when out of range.
#[inline]
pub(crate) fn row_mut<F>(xs: &mut [F], cols: usize, r: usize) -> &mut [F] {
    match r
        .checked_mul(cols)
        .and_then(|s| Some(s..s.checked_add(cols)?))
    {
        Some(range) => xs.get_mut(range).unwrap_or(&mut []),
        None => &mut [],
    }
}
