//! Lane-split kernels shared by the O(tokens) passes of [`crate::advantage`] and
//! [`crate::kl`].
//!
//! Floating-point addition is not associative, so LLVM never vectorises a plain running sum.
//! Keeping `LANES` independent partial sums (one per position modulo `LANES`) lets it keep
//! them in SIMD registers; the partials are added pairwise at the end, which is also more
//! accurate than one long chain. Tails shorter than `LANES` are padded with zeros (and a zero
//! mask), so one kernel body serves every element.
//!
//! Validation is fused into the same passes: each kernel also accumulates a "check" value that
//! is exactly 0 when every input is finite and every mask entry is 0 or 1 (`x − x` is 0 for a
//! finite `x` and NaN otherwise; `|m − m²|` is 0 only for m ∈ {0, 1}). Only when a check is not
//! 0 do the callers rescan the inputs to name the offending argument and index.

use crate::num::cast;
use num_traits::Float;

/// Width of the lane split: two SSE / one AVX register of `f32`, enough independent chains to
/// hide the add latency.
pub(crate) const LANES: usize = 8;

/// One partial value per lane.
pub(crate) type Lanes<F> = [F; LANES];

/// All-zero lanes.
#[inline(always)]
pub(crate) fn zeros<F: Float>() -> Lanes<F> {
    [F::zero(); LANES]
}

/// Pairwise sum of the lanes.
#[inline(always)]
pub(crate) fn hsum<F: Float>(a: &Lanes<F>) -> F {
    let [a0, a1, a2, a3, a4, a5, a6, a7] = *a;
    ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
}

/// Copies `xs` (at most `LANES` elements) into zero-padded lanes.
#[inline(always)]
pub(crate) fn padded<F: Float>(xs: &[F]) -> Lanes<F> {
    let mut t = zeros();
    for (d, s) in t.iter_mut().zip(xs) {
        *d = *s;
    }
    t
}

/// `|m − m²| + (x − x)`-style check term of a mask entry: 0 iff `m` is 0 or 1.
#[inline(always)]
pub(crate) fn mask_check<F: Float>(m: F) -> F {
    (m - m * m).abs()
}

/// `x − x`: 0 for finite `x`, NaN for NaN or ±∞.
#[inline(always)]
#[allow(clippy::eq_op)] // `x − x` is the point: it is NaN exactly when x is not finite
pub(crate) fn finite_check<F: Float>(x: F) -> F {
    x - x
}

/// True when a fused check found nothing wrong.
#[inline(always)]
pub(crate) fn check_ok<F: Float>(chk: F) -> bool {
    chk == F::zero()
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

/// Converts a lane-summed 0/1 count to `usize` (exact while a row has fewer than
/// `LANES · 2^mantissa` tokens: 2^27 in `f32`).
#[inline]
pub(crate) fn count_of<F: Float>(c: F) -> usize {
    c.to_usize().unwrap_or(0)
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
