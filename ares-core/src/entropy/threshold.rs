//! Percentiles, medians, per-response thresholds and the EMA of the global threshold τ.

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param, check_scratch};
use crate::shape::Shape;
use core::cmp::Ordering;
use num_traits::Float;

/// Default percentile of the per-response threshold (95).
pub const DEFAULT_PERCENTILE: f64 = 95.0;

/// Default EMA factor `ρ` of the global threshold (0.99).
pub const DEFAULT_EMA_RHO: f64 = 0.99;

/// Order of finite values (callers have rejected NaN, so `partial_cmp` always answers).
#[inline]
fn order<F: Float>(a: &F, b: &F) -> Ordering {
    a.partial_cmp(b).unwrap_or(Ordering::Equal)
}

/// Smallest element (finite, non-empty input; `+∞` for an empty one).
#[inline]
fn min_of<F: Float>(xs: &[F]) -> F {
    xs.iter().fold(F::infinity(), |m, &x| m.min(x))
}

/// Copies `values` into the front of `scratch`, rejecting NaN/±∞; returns that prefix.
fn copy_finite<'s, F: Float>(
    values: &[F],
    scratch: &'s mut [F],
    what: &'static str,
) -> Result<&'s mut [F]> {
    if values.is_empty() {
        return Err(Error::Empty { what });
    }
    check_scratch("scratch", values.len(), scratch.len())?;
    let buf = scratch.get_mut(..values.len()).unwrap_or(&mut []);
    for (index, (s, &v)) in buf.iter_mut().zip(values).enumerate() {
        if !v.is_finite() {
            return Err(Error::NonFinite { what, index });
        }
        *s = v;
    }
    Ok(buf)
}

/// Percentile of a non-empty buffer of finite values, reordering it; `q` in `[0, 100]`.
fn percentile_in_place<F: Float>(buf: &mut [F], q: F) -> F {
    let n = buf.len();
    if n == 0 {
        return F::nan();
    }
    // numpy "linear": virtual index h = (n − 1)·(q/100), lerp between order statistics
    let h = cast::<F>((n - 1) as f64) * (q / cast(100.0));
    let lo_f = h.floor();
    let t = h - lo_f;
    let lo = lo_f.to_usize().unwrap_or(0).min(n - 1);
    let (_, a, right) = buf.select_nth_unstable_by(lo, order);
    let a = *a;
    if t == F::zero() || right.is_empty() {
        return a;
    }
    let b = min_of(right);
    lerp(a, b, t)
}

/// `a + (b − a)·t` clamped to `[a, b]` (`a ≤ b`, `t` in `[0, 1)`). Monotone in `t`, and
/// meets the next interval's start exactly, so the percentile is monotone in `q`; within
/// an ulp or two of numpy's two-sided lerp. Falls back to `a(1−t) + bt` when `b − a`
/// overflows.
#[inline]
fn lerp<F: Float>(a: F, b: F, t: F) -> F {
    let d = b - a;
    let v = if d.is_finite() {
        a + d * t
    } else {
        a * (F::one() - t) + b * t
    };
    v.max(a).min(b)
}

/// The `q`-th percentile of `values` with linear interpolation, numpy's default
/// (`np.percentile(values, q)`).
///
/// With the values sorted `x_(0) ≤ … ≤ x_(n−1)`: `h = (n−1)·q/100`, `i = ⌊h⌋`, `t = h − i`,
/// result `x_(i) + t·(x_(i+1) − x_(i))` (clamped to `[x_(i), x_(i+1)]`, which keeps it
/// monotone in `q`). `q = 0` gives the minimum, `q = 100` the maximum, one value gives
/// itself. Example (spec vector 6): p95 of `[1, 2, 3, 4]` = 3.85.
///
/// `scratch` (at least `values.len()` elements) receives a reordered copy: `values` is left
/// untouched. O(n) expected time (quickselect), no allocation.
///
/// Errors: `q` outside `[0, 100]` or NaN ([`Error::OutOfRange`]); empty `values`
/// ([`Error::Empty`]); a NaN/±∞ value ([`Error::NonFinite`]); `scratch` too short
/// ([`Error::ScratchTooSmall`]).
pub fn percentile<F: Float>(values: &[F], q: F, scratch: &mut [F]) -> Result<F> {
    check_param(
        "q (percentile)",
        q,
        q >= F::zero() && q <= cast(100.0),
        "in [0, 100]",
    )?;
    let buf = copy_finite(values, scratch, "values")?;
    Ok(percentile_in_place(buf, q))
}

/// Median of a non-empty buffer of finite values, reordering it.
fn median_in_place<F: Float>(buf: &mut [F]) -> F {
    let n = buf.len();
    if n == 0 {
        return F::nan();
    }
    let mid = n / 2;
    if n % 2 == 1 {
        let (_, m, _) = buf.select_nth_unstable_by(mid, order);
        return *m;
    }
    let (_, a, right) = buf.select_nth_unstable_by(mid - 1, order);
    let a = *a;
    let b = min_of(right);
    let two = cast::<F>(2.0);
    let s = a + b;
    // numpy: (a + b)/2; halve first only when the sum overflows
    if s.is_finite() {
        s / two
    } else {
        a / two + b / two
    }
}

/// The median of `values`, as `np.median`: the middle order statistic for odd length, the
/// mean of the two middle ones for even length.
///
/// `scratch` (at least `values.len()` elements) receives a reordered copy.
///
/// Errors: empty `values` ([`Error::Empty`]); a NaN/±∞ value ([`Error::NonFinite`]);
/// `scratch` too short ([`Error::ScratchTooSmall`]).
pub fn median<F: Float>(values: &[F], scratch: &mut [F]) -> Result<F> {
    let buf = copy_finite(values, scratch, "values")?;
    Ok(median_in_place(buf))
}

/// Per-response thresholds: for each row, the `percentile_q`-th percentile ([`percentile`])
/// of the means of its complete windows; returns the number of rows that have one.
///
/// A row with at least one complete window gets `out_thresholds[r]` = that percentile and
/// `out_has_threshold[r] = 1`; a row with none gets `0` and `0` (it contributes no threshold).
/// `window_means` / `window_valid` are the outputs of [`super::window_means`]; means are
/// read only where `window_valid` is 1.
///
/// `scratch` needs at least `cols` elements.
///
/// Errors: `percentile_q` outside `[0, 100]` ([`Error::OutOfRange`]); lengths
/// ([`Error::LengthMismatch`], rows-long outputs); `window_valid` not 0/1
/// ([`Error::InvalidMask`]); a non-finite mean under a valid window ([`Error::NonFinite`]);
/// `scratch` shorter than `cols` ([`Error::ScratchTooSmall`]).
pub fn response_thresholds<F: Float>(
    shape: Shape,
    window_means: &[F],
    window_valid: &[F],
    percentile_q: F,
    scratch: &mut [F],
    out_thresholds: &mut [F],
    out_has_threshold: &mut [F],
) -> Result<usize> {
    check_param(
        "percentile",
        percentile_q,
        percentile_q >= F::zero() && percentile_q <= cast(100.0),
        "in [0, 100]",
    )?;
    shape.check("window_means", window_means.len())?;
    shape.check("window_valid", window_valid.len())?;
    check_len("out_thresholds", shape.rows, out_thresholds.len())?;
    check_len("out_has_threshold", shape.rows, out_has_threshold.len())?;
    let cols = shape.cols;
    check_scratch("scratch", cols, scratch.len())?;
    if cols == 0 {
        out_thresholds.fill(F::zero());
        out_has_threshold.fill(F::zero());
        return Ok(0);
    }
    let mut with_threshold = 0usize;
    let rows = window_means
        .chunks_exact(cols)
        .zip(window_valid.chunks_exact(cols))
        .zip(out_thresholds.iter_mut().zip(out_has_threshold.iter_mut()));
    for (r, ((means, valid), (thr, has))) in rows.enumerate() {
        let mut k = 0usize;
        for (i, (&w, &v)) in means.iter().zip(valid).enumerate() {
            let index = r.saturating_mul(cols).saturating_add(i);
            if v == F::one() {
                if !w.is_finite() {
                    return Err(Error::NonFinite {
                        what: "window_means",
                        index,
                    });
                }
                if let Some(slot) = scratch.get_mut(k) {
                    *slot = w;
                }
                k += 1;
            } else if v != F::zero() {
                return Err(Error::InvalidMask {
                    what: "window_valid",
                    index,
                });
            }
        }
        match scratch.get_mut(..k) {
            Some(buf) if k > 0 => {
                *thr = percentile_in_place(buf, percentile_q);
                *has = F::one();
                with_threshold += 1;
            }
            _ => {
                *thr = F::zero();
                *has = F::zero();
            }
        }
    }
    Ok(with_threshold)
}

/// The batch's global threshold candidate `m`: the median ([`median`]) of the per-response
/// thresholds that exist (`has_threshold[r] = 1`, from [`response_thresholds`]).
///
/// Returns `Ok(None)` when no response has a threshold (every response shorter than its
/// window): that is not an error, the caller keeps its previous τ.
///
/// `scratch` needs at least `thresholds.len()` elements.
///
/// Errors: `has_threshold` of another length ([`Error::LengthMismatch`]) or not 0/1
/// ([`Error::InvalidMask`]); a non-finite threshold where `has_threshold` is 1
/// ([`Error::NonFinite`]); `scratch` too short ([`Error::ScratchTooSmall`]).
pub fn batch_median_threshold<F: Float>(
    thresholds: &[F],
    has_threshold: &[F],
    scratch: &mut [F],
) -> Result<Option<F>> {
    check_len("has_threshold", thresholds.len(), has_threshold.len())?;
    check_scratch("scratch", thresholds.len(), scratch.len())?;
    let mut k = 0usize;
    for (index, (&x, &h)) in thresholds.iter().zip(has_threshold).enumerate() {
        if h == F::one() {
            if !x.is_finite() {
                return Err(Error::NonFinite {
                    what: "thresholds",
                    index,
                });
            }
            if let Some(slot) = scratch.get_mut(k) {
                *slot = x;
            }
            k += 1;
        } else if h != F::zero() {
            return Err(Error::InvalidMask {
                what: "has_threshold",
                index,
            });
        }
    }
    Ok(match scratch.get_mut(..k) {
        Some(buf) if k > 0 => Some(median_in_place(buf)),
        _ => None,
    })
}

/// The global HWE threshold `τ`, an exponential moving average of the batch candidates `m`.
///
/// `τ ← m` at the first update, then `τ ← ρ·τ + (1−ρ)·m` (default `ρ` = 0.99). The result
/// is clamped to `[min(τ, m), max(τ, m)]`, so rounding can never take it outside.
///
/// Spec order: the τ used to count a step's HWE tokens is the one from *before* that step's
/// update. Before any update τ comes from the bootstrap pass ([`ThresholdEma::restore`]) or,
/// with no bootstrap, from the first batch's own `m` (call [`ThresholdEma::update`] first
/// when [`ThresholdEma::tau`] is `None`, then count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThresholdEma<F> {
    rho: F,
    tau: Option<F>,
}

impl<F: Float> Default for ThresholdEma<F> {
    /// `ρ = 0.99`, no τ yet.
    fn default() -> Self {
        ThresholdEma {
            rho: cast(DEFAULT_EMA_RHO),
            tau: None,
        }
    }
}

impl<F: Float> ThresholdEma<F> {
    /// An EMA with factor `rho` and no τ yet.
    ///
    /// Errors: `rho` outside `[0, 1]` ([`Error::OutOfRange`] on `"rho"`).
    pub fn new(rho: F) -> Result<Self> {
        check_param("rho", rho, rho >= F::zero() && rho <= F::one(), "in [0, 1]")?;
        Ok(ThresholdEma { rho, tau: None })
    }

    /// An EMA with factor `rho` resumed at `tau` (a checkpoint or the bootstrap pass).
    ///
    /// Errors: as [`ThresholdEma::new`]; a non-finite `tau` ([`Error::OutOfRange`] on
    /// `"tau"`).
    pub fn with_tau(rho: F, tau: F) -> Result<Self> {
        let mut ema = Self::new(rho)?;
        ema.restore(Some(tau))?;
        Ok(ema)
    }

    /// The factor `ρ`.
    #[inline]
    pub fn rho(&self) -> F {
        self.rho
    }

    /// The current τ, `None` before the first update or restore.
    #[inline]
    pub fn tau(&self) -> Option<F> {
        self.tau
    }

    /// Sets τ directly (bootstrap or checkpoint); `None` forgets it.
    ///
    /// Errors: a non-finite `tau` ([`Error::OutOfRange`] on `"tau"`); τ is then unchanged.
    pub fn restore(&mut self, tau: Option<F>) -> Result<()> {
        if let Some(t) = tau {
            check_param("tau", t, true, "finite")?;
        }
        self.tau = tau;
        Ok(())
    }

    /// Folds the batch candidate `m` in and returns the new τ.
    ///
    /// Errors: a non-finite `m` ([`Error::OutOfRange`] on `"m (batch threshold)"`); τ is
    /// then unchanged.
    pub fn update(&mut self, m: F) -> Result<F> {
        check_param("m (batch threshold)", m, true, "finite")?;
        let tau = match self.tau {
            None => m,
            Some(old) => {
                let blended = self.rho * old + (F::one() - self.rho) * m;
                blended.max(old.min(m)).min(old.max(m))
            }
        };
        self.tau = Some(tau);
        Ok(tau)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::vec;

    /// numpy's definition, on a sorted copy, with numpy's two-sided lerp.
    fn numpy_percentile(xs: &[f64], q: f64) -> f64 {
        let mut s = xs.to_vec();
        s.sort_by(f64::total_cmp);
        let h = (s.len() - 1) as f64 * (q / 100.0);
        let lo = h.floor() as usize;
        let t = h - h.floor();
        let hi = (lo + 1).min(s.len() - 1);
        let (a, b) = (s[lo], s[hi]);
        let d = b - a;
        if t >= 0.5 {
            b - d * (1.0 - t)
        } else {
            a + d * t
        }
    }

    #[test]
    fn vector_6() {
        let mut scratch = [0.0; 4];
        // h = 3·0.95 = 2.85 → 3 + 0.85·(4 − 3) = 3.85
        let p = percentile(&[4.0, 1.0, 3.0, 2.0], 95.0, &mut scratch).unwrap();
        assert!((p - 3.85).abs() < 1e-12, "{p}");
        let p32 = percentile(&[1.0f32, 2.0, 3.0, 4.0], 95.0, &mut [0.0f32; 4]).unwrap();
        assert!((p32 - 3.85).abs() < 1e-6);
        // window means [0.75, 0.8, 1.25]: h = 2·0.95 = 1.9 → 0.8 + 0.9·0.45 = 1.205
        let p = percentile(&[1.25, 0.75, 0.8], 95.0, &mut scratch).unwrap();
        assert!((p - 1.205).abs() < 1e-12, "{p}");
        // p50 of the same = 0.8, p0 = 0.75, p100 = 1.25, p25: h = 0.5 → 0.775
        for (q, want) in [(50.0, 0.8), (0.0, 0.75), (100.0, 1.25), (25.0, 0.775)] {
            let p = percentile(&[1.25, 0.75, 0.8], q, &mut scratch).unwrap();
            assert!((p - want).abs() < 1e-12, "q {q}: {p}");
        }
        // one value
        assert_eq!(percentile(&[7.5], 33.0, &mut scratch), Ok(7.5));
    }

    #[test]
    fn medians() {
        let mut scratch = [0.0; 8];
        assert_eq!(median(&[3.0, 1.0, 2.0], &mut scratch), Ok(2.0));
        // even: (2 + 3)/2
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0], &mut scratch), Ok(2.5));
        assert_eq!(median(&[-1.0], &mut scratch), Ok(-1.0));
        // the sum overflows: halve first
        assert_eq!(median(&[f64::MAX, f64::MAX], &mut scratch), Ok(f64::MAX));
        assert_eq!(
            median(&[f32::MAX, f32::MAX], &mut [0.0f32; 2]),
            Ok(f32::MAX)
        );
    }

    #[test]
    fn errors() {
        let mut scratch = [0.0; 4];
        assert_eq!(
            percentile::<f64>(&[], 50.0, &mut scratch),
            Err(Error::Empty { what: "values" })
        );
        assert_eq!(
            percentile(&[1.0, f64::NAN], 50.0, &mut scratch),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        for q in [-0.1, 100.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                percentile(&[1.0], q, &mut scratch),
                Err(Error::OutOfRange {
                    what: "q (percentile)",
                    ..
                })
            ));
        }
        assert_eq!(
            percentile(&[1.0; 5], 50.0, &mut scratch),
            Err(Error::ScratchTooSmall {
                what: "scratch",
                needed: 5,
                actual: 4
            })
        );
        assert_eq!(
            median::<f64>(&[], &mut scratch),
            Err(Error::Empty { what: "values" })
        );
        assert_eq!(
            median(&[f64::NEG_INFINITY], &mut scratch),
            Err(Error::NonFinite {
                what: "values",
                index: 0
            })
        );
    }

    #[test]
    fn thresholds_per_response_and_batch() {
        // row 0: vector 5's windows [0.85, 0.625, 0.325, 0.125]: sorted
        // [0.125, 0.325, 0.625, 0.85], h = 2.85 → 0.625 + 0.85·0.225 = 0.81625;
        // row 1: no window; row 2: one window 0.5 → 0.5
        let shape = Shape::new(3, 4);
        let means = [
            0.85, 0.625, 0.325, 0.125, 9.0, 9.0, 9.0, 9.0, 0.0, 0.5, 0.0, 0.0,
        ];
        let valid = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let (mut thr, mut has) = ([7.0; 3], [7.0; 3]);
        let n = response_thresholds(
            shape,
            &means,
            &valid,
            95.0,
            &mut [0.0; 4],
            &mut thr,
            &mut has,
        )
        .unwrap();
        assert_eq!(n, 2);
        assert!((thr[0] - 0.81625).abs() < 1e-12, "{thr:?}");
        assert_eq!((thr[1], thr[2]), (0.0, 0.5));
        assert_eq!(has, [1.0, 0.0, 1.0]);
        // m = median(0.81625, 0.5) = 0.658125
        let m = batch_median_threshold(&thr, &has, &mut [0.0; 3])
            .unwrap()
            .unwrap();
        assert!((m - 0.658125).abs() < 1e-12);
        assert_eq!(
            batch_median_threshold(&thr, &[0.0; 3], &mut [0.0; 3]),
            Ok(None)
        );
        assert_eq!(batch_median_threshold::<f64>(&[], &[], &mut []), Ok(None));

        // errors
        assert_eq!(
            response_thresholds(
                shape,
                &means,
                &valid,
                95.0,
                &mut [0.0; 3],
                &mut thr,
                &mut has
            ),
            Err(Error::ScratchTooSmall {
                what: "scratch",
                needed: 4,
                actual: 3
            })
        );
        assert!(matches!(
            response_thresholds(
                shape,
                &means,
                &valid,
                101.0,
                &mut [0.0; 4],
                &mut thr,
                &mut has
            ),
            Err(Error::OutOfRange {
                what: "percentile",
                ..
            })
        ));
        assert_eq!(
            response_thresholds(
                shape,
                &means,
                &valid,
                95.0,
                &mut [0.0; 4],
                &mut thr[..2],
                &mut has
            ),
            Err(Error::LengthMismatch {
                what: "out_thresholds",
                expected: 3,
                actual: 2
            })
        );
        let mut bad = valid;
        bad[10] = 2.0;
        assert_eq!(
            response_thresholds(shape, &means, &bad, 95.0, &mut [0.0; 4], &mut thr, &mut has),
            Err(Error::InvalidMask {
                what: "window_valid",
                index: 10
            })
        );
        let mut bad = means;
        bad[9] = f64::NAN;
        assert_eq!(
            response_thresholds(shape, &bad, &valid, 95.0, &mut [0.0; 4], &mut thr, &mut has),
            Err(Error::NonFinite {
                what: "window_means",
                index: 9
            })
        );
        assert_eq!(
            batch_median_threshold(&[f64::NAN, 1.0], &[1.0, 1.0], &mut [0.0; 2]),
            Err(Error::NonFinite {
                what: "thresholds",
                index: 0
            })
        );
        assert_eq!(
            batch_median_threshold(&[1.0, 1.0], &[1.0, 0.5], &mut [0.0; 2]),
            Err(Error::InvalidMask {
                what: "has_threshold",
                index: 1
            })
        );
        assert_eq!(
            batch_median_threshold(&[1.0, 1.0], &[1.0], &mut [0.0; 2]),
            Err(Error::LengthMismatch {
                what: "has_threshold",
                expected: 2,
                actual: 1
            })
        );
    }

    #[test]
    fn ema() {
        let mut ema = ThresholdEma::<f64>::default();
        assert_eq!((ema.rho(), ema.tau()), (0.99, None));
        // first update: τ = m; then 0.99·1.0 + 0.01·2.0 = 1.01
        assert_eq!(ema.update(1.0), Ok(1.0));
        let t = ema.update(2.0).unwrap();
        assert!((t - 1.01).abs() < 1e-15);
        assert!(ema.update(f64::NAN).is_err());
        assert_eq!(ema.tau(), Some(t));
        let mut e = ThresholdEma::with_tau(0.5, 4.0f32).unwrap();
        assert_eq!(e.update(2.0), Ok(3.0));
        assert!(e.restore(Some(f32::INFINITY)).is_err());
        assert_eq!(e.tau(), Some(3.0));
        e.restore(None).unwrap();
        assert_eq!(e.update(2.0), Ok(2.0));
        for rho in [-0.1, 1.5, f64::NAN] {
            assert!(matches!(
                ThresholdEma::new(rho),
                Err(Error::OutOfRange { what: "rho", .. })
            ));
        }
        // ρ = 0 follows m, ρ = 1 never moves after the first update
        let mut e0 = ThresholdEma::new(0.0).unwrap();
        e0.update(1.0).unwrap();
        assert_eq!(e0.update(5.0), Ok(5.0));
        let mut e1 = ThresholdEma::new(1.0).unwrap();
        e1.update(1.0).unwrap();
        assert_eq!(e1.update(5.0), Ok(1.0));
    }

    proptest! {
        #[test]
        fn percentile_monotone_and_bounded(
            xs in prop::collection::vec(-1e6f64..1e6, 1..60),
            q1 in 0.0f64..=100.0,
            q2 in 0.0f64..=100.0,
        ) {
            let mut scratch = vec![0.0; xs.len()];
            let (lo_q, hi_q) = if q1 <= q2 { (q1, q2) } else { (q2, q1) };
            let a = percentile(&xs, lo_q, &mut scratch).unwrap();
            let b = percentile(&xs, hi_q, &mut scratch).unwrap();
            prop_assert!(a <= b, "p{} = {} > p{} = {}", lo_q, a, hi_q, b);
            let min = xs.iter().cloned().fold(f64::INFINITY, f64::min);
            let max = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(min <= a && b <= max);
            // agrees with numpy's formula to rounding
            let np = numpy_percentile(&xs, lo_q);
            prop_assert!((a - np).abs() <= 1e-9 * (1.0 + np.abs()), "{} vs numpy {}", a, np);
            prop_assert_eq!(percentile(&xs, 0.0, &mut scratch).unwrap(), min);
            prop_assert_eq!(percentile(&xs, 100.0, &mut scratch).unwrap(), max);
        }

        #[test]
        fn median_matches_sorted(xs in prop::collection::vec(-1e3f64..1e3, 1..40)) {
            let mut s = xs.clone();
            s.sort_by(f64::total_cmp);
            let n = s.len();
            let want = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
            let mut scratch = vec![0.0; n];
            prop_assert_eq!(median(&xs, &mut scratch).unwrap(), want);
        }

        #[test]
        fn ema_stays_between_tau_and_m(
            rho in 0.0f64..=1.0, tau in -1e3f64..1e3, m in -1e3f64..1e3,
        ) {
            let mut e = ThresholdEma::with_tau(rho, tau).unwrap();
            let t = e.update(m).unwrap();
            prop_assert!(tau.min(m) <= t && t <= tau.max(m));
            let t32 = ThresholdEma::with_tau(rho as f32, tau as f32).unwrap().update(m as f32).unwrap();
            prop_assert!((tau as f32).min(m as f32) <= t32 && t32 <= (tau as f32).max(m as f32));
        }
    }
}
