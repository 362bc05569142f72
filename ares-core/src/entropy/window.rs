//! Window entropy means and the HWE mask, counts and soft cost: the O(tokens) kernels.
//!
//! Both kernels work row by row, so that a row read from memory once stays in cache for
//! the compute. Validation is a branch-free flag per row (a slow path runs only to name the
//! offending index). The inner loops are branch-free (selects, not branches) so they
//! vectorise; window sizes 1–8 get a kernel with the size known at compile time.

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param};
use crate::shape::Shape;
use num_traits::Float;

/// Default `window_size` (`worker.rollout.window_size`, docs/algorithms.md §1).
pub const DEFAULT_WINDOW_SIZE: usize = 4;

/// True when every `mask` value of the row is 0 or 1 and `values` is finite wherever the
/// mask is 1. Branch-free accumulation so the loop vectorises.
#[inline]
fn row_is_clean<F: Float>(values: &[F], mask: &[F]) -> bool {
    let mut bad = false;
    for (&x, &m) in values.iter().zip(mask) {
        let mask_bad = (m != F::zero()) & (m != F::one());
        let value_bad = (m == F::one()) & !x.is_finite();
        bad |= mask_bad | value_bad;
    }
    !bad
}

/// The slow path after [`row_is_clean`] failed: the first offending element of the row,
/// reported with its index in the whole tensor.
#[cold]
fn row_error<F: Float>(
    values: &[F],
    mask: &[F],
    base: usize,
    values_what: &'static str,
    mask_what: &'static str,
) -> Error {
    for (i, (&x, &m)) in values.iter().zip(mask).enumerate() {
        let index = base.saturating_add(i);
        if m != F::zero() && m != F::one() {
            return Error::InvalidMask {
                what: mask_what,
                index,
            };
        }
        if m == F::one() && !x.is_finite() {
            return Error::NonFinite {
                what: values_what,
                index,
            };
        }
    }
    // unreachable when called after `row_is_clean` failed; report the row start
    Error::InvalidMask {
        what: mask_what,
        index: base,
    }
}

/// Window entropy means over a padded `[rows, cols]` tensor; returns the number of complete
/// windows.
///
/// With `w = window_size` and offset `o = 1` (default: "the mean entropy of the following
/// `w` tokens") or `o = 0` (`window_includes_self`, the paper's variant), position `t` of a
/// row has a **complete window** iff `t + o + w − 1 < cols` and the mask is 1 at `t` and at
/// every window position `t+o … t+o+w−1`. Then
///
/// `out_means[t] = (H[t+o] + … + H[t+o+w−1]) / w` (summed left to right, starting from 0)
/// and `out_valid[t] = 1`; elsewhere both are 0. So a position with fewer than `w`
/// following response tokens has no window, and a hole in the mask breaks every window
/// over it.
///
/// `entropies` must be finite wherever `mask` is 1; padded positions (mask 0) are ignored and
/// may hold anything. Entropies are taken as given (they are not required to be ≥ 0).
///
/// Example (spec vector 5): `w = 4`, `H = [0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0]`, all
/// masked: `W = [0.85, 0.625, 0.325, 0.125, –, –, –, –]`, 4 complete windows.
///
/// Errors: `window_size == 0` ([`Error::OutOfRange`]); a slice whose length is not
/// `rows × cols` ([`Error::LengthMismatch`]); a mask value other than 0/1
/// ([`Error::InvalidMask`]); a NaN/±∞ entropy under mask 1 ([`Error::NonFinite`]).
pub fn window_means<F: Float>(
    shape: Shape,
    entropies: &[F],
    mask: &[F],
    window_size: usize,
    window_includes_self: bool,
    out_means: &mut [F],
    out_valid: &mut [F],
) -> Result<usize> {
    if window_size == 0 {
        return Err(Error::OutOfRange {
            what: "window_size",
            value: 0.0,
            expected: ">= 1",
        });
    }
    shape.check("entropies", entropies.len())?;
    shape.check("mask", mask.len())?;
    shape.check("out_means", out_means.len())?;
    shape.check("out_valid", out_valid.len())?;
    let cols = shape.cols;
    if cols == 0 {
        return Ok(0);
    }
    let offset = usize::from(!window_includes_self);
    // positions t + 0 … t + span − 1 must all be response tokens
    let span = window_size.checked_add(offset);
    // number of leading positions whose window fits in the row
    let fits = match span {
        Some(span) if span <= cols => cols - span + 1,
        _ => 0,
    };
    // the fixed-size kernels validate positions span−1 … cols−1 in their own pass
    let kernel = row_kernel::<F>(window_size, offset).filter(|_| fits > 0);
    let prefix = cols - fits;
    let mut total = 0usize;
    let rows = entropies
        .chunks_exact(cols)
        .zip(mask.chunks_exact(cols))
        .zip(
            out_means
                .chunks_exact_mut(cols)
                .zip(out_valid.chunks_exact_mut(cols)),
        );
    for (r, ((h, m), (means, valid))) in rows.enumerate() {
        let (means, means_tail) = means.split_at_mut(fits.min(means.len()));
        let (valid, valid_tail) = valid.split_at_mut(fits.min(valid.len()));
        means_tail.fill(F::zero());
        valid_tail.fill(F::zero());
        let clean = match kernel {
            Some(kernel) => {
                let head_clean = row_is_clean(
                    h.get(..prefix).unwrap_or(&[]),
                    m.get(..prefix).unwrap_or(&[]),
                );
                let (count, rest_clean) = kernel(h, m, means, valid);
                total += count;
                head_clean & rest_clean
            }
            None => {
                let clean = row_is_clean(h, m);
                if clean && fits > 0 {
                    total += window_row_any(h, m, means, valid, window_size, offset);
                }
                clean
            }
        };
        if !clean {
            return Err(row_error(h, m, r.saturating_mul(cols), "entropies", "mask"));
        }
    }
    Ok(total)
}

/// A row kernel of [`window_means`] over the `fits` leading positions:
/// `(entropies, mask, means, valid) -> (complete windows, row clean from span − 1 on)`.
type RowKernel<F> = fn(&[F], &[F], &mut [F], &mut [F]) -> (usize, bool);

/// The fixed-size kernel for `window_size` 1–8, `None` for larger windows.
fn row_kernel<F: Float>(window_size: usize, offset: usize) -> Option<RowKernel<F>> {
    macro_rules! pick {
        ($($w:literal),*) => {
            match (window_size, offset) {
                $(($w, 0) => Some(window_row_fixed::<F, $w, 0> as RowKernel<F>),
                  ($w, _) => Some(window_row_fixed::<F, $w, 1> as RowKernel<F>),)*
                _ => None,
            }
        };
    }
    pick!(1, 2, 3, 4, 5, 6, 7, 8)
}

/// One row for a window of `W` tokens at offset `O`, both known at compile time: every
/// output is independent, so the loop vectorises across positions. `means` and `valid`
/// hold exactly the positions whose span fits in the row.
///
/// Validation is fused: the last element of each window, `(mask, H)` at `t + W + O − 1`,
/// is checked, which covers positions `W + O − 1 … cols − 1`; the caller checks the prefix.
/// Blocks of 2^20 positions let the count be a `u32` (a `usize` counter halves the vector
/// width next to `f32` data).
#[inline(never)]
fn window_row_fixed<F: Float, const W: usize, const O: usize>(
    h: &[F],
    m: &[F],
    means: &mut [F],
    valid: &mut [F],
) -> (usize, bool) {
    const BLOCK: usize = 1 << 20;
    let w: F = cast(W as f64);
    // for a power of two, x·(1/w) is exactly x/w and a multiply is much cheaper
    let inv_w = F::one() / w;
    let h = h.get(O..).unwrap_or(&[]);
    let mut count = 0usize;
    let mut bad = false;
    let blocks = means.chunks_mut(BLOCK).zip(valid.chunks_mut(BLOCK));
    for (i, (means, valid)) in blocks.enumerate() {
        let start = i.saturating_mul(BLOCK);
        let m = m.get(start..).unwrap_or(&[]);
        let h = h.get(start..).unwrap_or(&[]);
        let mut block_count = 0u32;
        let outs = means.iter_mut().zip(valid.iter_mut());
        for ((s, v), (wm, wh)) in outs.zip(m.windows(W + O).zip(h.windows(W))) {
            let (last_m, last_h) = (
                wm.last().copied().unwrap_or(F::zero()),
                wh.last().copied().unwrap_or(F::zero()),
            );
            let is_one = last_m == F::one();
            bad |= (!is_one & (last_m != F::zero())) | (is_one & !last_h.is_finite());
            // 0/1 products are exact; the sum runs left to right from 0
            let p = wm.iter().fold(F::one(), |p, &x| p * x);
            let sum = wh.iter().fold(F::zero(), |a, &x| a + x);
            let complete = p == F::one();
            *v = p;
            // a select, not a multiply: padded entropies may be NaN and NaN·0 = NaN
            let mean = if W.is_power_of_two() {
                sum * inv_w
            } else {
                sum / w
            };
            *s = if complete { mean } else { F::zero() };
            block_count += u32::from(complete);
        }
        count += block_count as usize;
    }
    (count, !bad)
}

/// One row for any window size (the `fits ≥ 1` leading positions), in blocks of 1024
/// positions that stay in L1: per block, `window_size + offset` shifted multiply passes
/// build the validity, `window_size` shifted add passes the sums (each pass vectorises),
/// then one select pass divides or zeroes.
#[inline(never)]
fn window_row_any<F: Float>(
    h: &[F],
    m: &[F],
    means: &mut [F],
    valid: &mut [F],
    window_size: usize,
    offset: usize,
) -> usize {
    const BLOCK: usize = 1024;
    // here window_size + offset ≤ cols, so the pass counts are bounded by the row
    let span = window_size.saturating_add(offset);
    let h = h.get(offset..).unwrap_or(&[]);
    let w: F = cast(window_size as f64);
    let mut count = 0usize;
    let blocks = means.chunks_mut(BLOCK).zip(valid.chunks_mut(BLOCK));
    for (i, (means, valid)) in blocks.enumerate() {
        let start = i.saturating_mul(BLOCK);
        let m = m.get(start..).unwrap_or(&[]);
        let h = h.get(start..).unwrap_or(&[]);
        valid.fill(F::one());
        for k in 0..span {
            for (v, &x) in valid.iter_mut().zip(m.get(k..).unwrap_or(&[])) {
                *v = *v * x;
            }
        }
        means.fill(F::zero());
        for k in 0..window_size {
            for (s, &x) in means.iter_mut().zip(h.get(k..).unwrap_or(&[])) {
                *s = *s + x;
            }
        }
        let mut block_count = 0u32;
        for (s, &v) in means.iter_mut().zip(valid.iter()) {
            let complete = v == F::one();
            *s = if complete { *s / w } else { F::zero() };
            block_count += u32::from(complete);
        }
        count += block_count as usize;
    }
    count
}

/// High-window-entropy tokens: mask, per-response counts and soft costs; returns the total
/// number of HWE tokens.
///
/// Position `t` is an HWE **candidate** iff `window_valid[t] = 1` (a complete window, from
/// [`window_means`]) and, when `trigger_mask` is given, `trigger_mask[t] = 1` (its token is
/// a trigger word). It is an **HWE token** iff it is a candidate and `W_t ≥ τ`. Per row:
///
/// - `out_hwe_mask[t]` = 1 on HWE tokens, else 0;
/// - `out_counts[r]` = number of HWE tokens (`high_entropy_token_num`);
/// - `out_soft_cost[r]` = `Σ_candidates max(0, W_t − τ)`, i.e. the sum of `W_t − τ` over the
///   HWE tokens (summed in 8 interleaved lanes, so it may differ from a left-to-right sum in
///   the last bits).
///
/// `window_means` must be finite where `window_valid` is 1 (elsewhere it is ignored).
///
/// Errors: `tau` not finite ([`Error::OutOfRange`]); a token slice whose length is not
/// `rows × cols`, or `out_counts` / `out_soft_cost` not of length `rows`
/// ([`Error::LengthMismatch`]); `window_valid` or `trigger_mask` not 0/1
/// ([`Error::InvalidMask`]); a non-finite window mean under a valid window
/// ([`Error::NonFinite`]).
#[allow(clippy::too_many_arguments)]
pub fn hwe<F: Float>(
    shape: Shape,
    window_means: &[F],
    window_valid: &[F],
    tau: F,
    trigger_mask: Option<&[F]>,
    out_hwe_mask: &mut [F],
    out_counts: &mut [usize],
    out_soft_cost: &mut [F],
) -> Result<usize> {
    check_param("tau", tau, true, "finite")?;
    shape.check("window_means", window_means.len())?;
    shape.check("window_valid", window_valid.len())?;
    if let Some(trigger) = trigger_mask {
        shape.check_mask("trigger_mask", trigger)?;
    }
    shape.check("out_hwe_mask", out_hwe_mask.len())?;
    check_len("out_counts", shape.rows, out_counts.len())?;
    check_len("out_soft_cost", shape.rows, out_soft_cost.len())?;
    let cols = shape.cols;
    if cols == 0 {
        out_counts.fill(0);
        out_soft_cost.fill(F::zero());
        return Ok(0);
    }
    let mut total = 0usize;
    let mut trigger_rows = trigger_mask.map(|t| t.chunks_exact(cols));
    let rows = window_means
        .chunks_exact(cols)
        .zip(window_valid.chunks_exact(cols))
        .zip(out_hwe_mask.chunks_exact_mut(cols))
        .zip(out_counts.iter_mut().zip(out_soft_cost.iter_mut()));
    for (r, (((means, valid), out), (count, cost))) in rows.enumerate() {
        // without trigger words every valid window is a candidate: pass `valid` twice
        let trigger = trigger_rows
            .as_mut()
            .and_then(Iterator::next)
            .unwrap_or(valid);
        let (c, s, clean) = hwe_row(means, valid, trigger, out, tau);
        if !clean {
            return Err(row_error(
                means,
                valid,
                r.saturating_mul(cols),
                "window_means",
                "window_valid",
            ));
        }
        *count = c;
        *cost = s;
        total += c;
    }
    Ok(total)
}

/// One row of [`hwe`] with its validation fused in: returns `(count, soft cost, clean)`.
/// Works in blocks so the 32-bit lane counters cannot overflow; 8 lanes of costs, counts
/// and error flags keep every reduction vectorisable. Not inlined: inlined into the row
/// loop it stops vectorising.
#[inline(never)]
fn hwe_row<F: Float>(
    means: &[F],
    valid: &[F],
    trigger: &[F],
    out: &mut [F],
    tau: F,
) -> (usize, F, bool) {
    const LANES: usize = 8;
    const BLOCK: usize = LANES << 16;
    #[inline(always)]
    fn step<F: Float>(w: F, v: F, g: F, o: &mut F, tau: F) -> (F, u32, u32) {
        let is_valid = v == F::one();
        let bad = (is_valid & !w.is_finite()) | (!is_valid & (v != F::zero()));
        let is_hwe = is_valid & (g == F::one()) & (w >= tau);
        *o = if is_hwe { F::one() } else { F::zero() };
        // select, not multiply: a mean under window_valid = 0 may be NaN
        let excess = if is_hwe { w - tau } else { F::zero() };
        (excess, u32::from(is_hwe), u32::from(bad))
    }
    let mut count = 0usize;
    let mut cost = F::zero();
    let mut bad = false;
    let blocks = means
        .chunks(BLOCK)
        .zip(valid.chunks(BLOCK))
        .zip(trigger.chunks(BLOCK))
        .zip(out.chunks_mut(BLOCK));
    for (((means, valid), trigger), out) in blocks {
        let mut lane_cost = [F::zero(); LANES];
        let mut lane_count = [0u32; LANES];
        let mut lane_bad = [0u32; LANES];
        let mut mc = means.chunks_exact(LANES);
        let mut vc = valid.chunks_exact(LANES);
        let mut gc = trigger.chunks_exact(LANES);
        let mut oc = out.chunks_exact_mut(LANES);
        let chunks = (&mut mc).zip(&mut vc).zip(&mut gc).zip(&mut oc);
        for (((mw, vw), gw), ow) in chunks {
            let lanes = lane_cost
                .iter_mut()
                .zip(lane_count.iter_mut())
                .zip(lane_bad.iter_mut());
            let items = mw.iter().zip(vw).zip(gw).zip(ow.iter_mut());
            for (((c, n), b), (((&w, &v), &g), o)) in lanes.zip(items) {
                let (dc, dn, db) = step(w, v, g, o, tau);
                *c = *c + dc;
                *n += dn;
                *b |= db;
            }
        }
        let tail = mc
            .remainder()
            .iter()
            .zip(vc.remainder())
            .zip(gc.remainder())
            .zip(oc.into_remainder());
        for (((&w, &v), &g), o) in tail {
            let (dc, dn, db) = step(w, v, g, o, tau);
            cost = cost + dc;
            count += dn as usize;
            bad |= db != 0;
        }
        // pairwise fold of the lanes
        let [a, b, c, d, e, f, g, h] = lane_cost;
        cost = cost + (((a + b) + (c + d)) + ((e + f) + (g + h)));
        count += lane_count.iter().map(|&n| n as usize).sum::<usize>();
        bad |= lane_bad.iter().any(|&b| b != 0);
    }
    (count, cost, !bad)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    /// Straightforward reference: per position, check the span and average the window.
    fn naive(h: &[f64], m: &[f64], cols: usize, w: usize, incl: bool) -> (Vec<f64>, Vec<f64>) {
        let o = usize::from(!incl);
        let mut means = vec![0.0; h.len()];
        let mut valid = vec![0.0; h.len()];
        for (r, (hr, mr)) in h.chunks(cols).zip(m.chunks(cols)).enumerate() {
            for t in 0..cols {
                if t + o + w > cols || (0..o + w).any(|k| mr[t + k] != 1.0) {
                    continue;
                }
                let s = (0..w).fold(0.0, |s, k| s + hr[t + o + k]);
                means[r * cols + t] = s / w as f64;
                valid[r * cols + t] = 1.0;
            }
        }
        (means, valid)
    }

    const H5: [f64; 8] = [0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];

    #[test]
    fn vector_5() {
        let mask = [1.0; 8];
        let (mut means, mut valid) = ([9.0; 8], [9.0; 8]);
        let n = window_means(
            Shape::new(1, 8),
            &H5,
            &mask,
            4,
            false,
            &mut means,
            &mut valid,
        )
        .unwrap();
        // W_0 = (1.0+1.2+0.8+0.4)/4 = 0.85, W_1 = (1.2+0.8+0.4+0.1)/4 = 0.625,
        // W_2 = (0.8+0.4+0.1+0)/4 = 0.325, W_3 = (0.4+0.1+0+0)/4 = 0.125; t ≥ 4: no window
        assert_eq!(n, 4);
        let want = [0.85, 0.625, 0.325, 0.125, 0.0, 0.0, 0.0, 0.0];
        for (a, b) in means.iter().zip(want) {
            assert!((a - b).abs() < 1e-15, "{means:?}");
        }
        assert_eq!(valid, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);

        // τ = 0.6: t = 0 (0.85) and t = 1 (0.625) are HWE; soft cost 0.25 + 0.025 = 0.275
        let mut hwe_mask = [9.0; 8];
        let (mut counts, mut cost) = ([9usize], [9.0]);
        let total = hwe(
            Shape::new(1, 8),
            &means,
            &valid,
            0.6,
            None,
            &mut hwe_mask,
            &mut counts,
            &mut cost,
        )
        .unwrap();
        assert_eq!(total, 2);
        assert_eq!(counts, [2]);
        assert!((cost[0] - 0.275).abs() < 1e-15);
        assert_eq!(hwe_mask, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);

        // a trigger mask keeping only t = 1
        let trig = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let total = hwe(
            Shape::new(1, 8),
            &means,
            &valid,
            0.6,
            Some(&trig[..]),
            &mut hwe_mask,
            &mut counts,
            &mut cost,
        )
        .unwrap();
        assert_eq!(total, 1);
        assert!((cost[0] - 0.025).abs() < 1e-15);
        assert_eq!(hwe_mask, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn includes_self_and_masks() {
        // includes_self: W_t = mean(H[t..t+4]); W_0 = (0.2+1+1.2+0.8)/4 = 0.8, t ≤ 4
        let mask = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0];
        let (mut means, mut valid) = ([0.0; 8], [0.0; 8]);
        let n = window_means(
            Shape::new(1, 8),
            &H5,
            &mask,
            4,
            true,
            &mut means,
            &mut valid,
        )
        .unwrap();
        // response is 7 tokens: t = 0..=3 fit (t + 3 ≤ 6)
        assert_eq!(n, 4);
        assert!((means[0] - 0.8).abs() < 1e-15);
        assert_eq!(valid, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        // a padding NaN outside the mask is ignored
        let mut h = H5;
        h[7] = f64::NAN;
        let n2 =
            window_means(Shape::new(1, 8), &h, &mask, 4, true, &mut means, &mut valid).unwrap();
        assert_eq!(n2, 4);
        assert!(means.iter().all(|x| x.is_finite()));
        // a hole at t = 3 breaks every window over it (default offset 1: t − 4 … t − 1)
        let mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let n = window_means(
            Shape::new(1, 8),
            &H5,
            &mask,
            2,
            false,
            &mut means,
            &mut valid,
        )
        .unwrap();
        // complete: t = 0 (1,2), t = 4 (5,6), t = 5 (6,7)
        assert_eq!(n, 3);
        assert_eq!(valid, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        // window larger than the row, and usize::MAX (offset overflow)
        for w in [8, usize::MAX] {
            let n = window_means(
                Shape::new(1, 8),
                &H5,
                &[1.0; 8],
                w,
                false,
                &mut means,
                &mut valid,
            )
            .unwrap();
            assert_eq!(n, 0);
            assert!(means.iter().chain(&valid).all(|&x| x == 0.0));
        }
        // w = 1 with self: every masked position
        let n = window_means(
            Shape::new(1, 8),
            &H5,
            &[1.0; 8],
            1,
            true,
            &mut means,
            &mut valid,
        )
        .unwrap();
        assert_eq!(n, 8);
        assert_eq!(means, H5);
    }

    #[test]
    fn two_rows_f32() {
        let h: Vec<f32> = [0.5f32, 1.5, 2.5, 0.0, 3.0, 1.0, 1.0, 1.0].to_vec();
        let m = [1.0f32, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let (mut means, mut valid) = ([0.0f32; 8], [0.0f32; 8]);
        let n = window_means(Shape::new(2, 4), &h, &m, 2, false, &mut means, &mut valid).unwrap();
        // row 0: response of 3 tokens, t = 0 → (1.5 + 2.5)/2 = 2; row 1: t = 0, 1 → 1, 1
        assert_eq!(n, 3);
        assert_eq!(means, [2.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        let mut hm = [0.0f32; 8];
        let (mut c, mut s) = ([0usize; 2], [0.0f32; 2]);
        let total = hwe(
            Shape::new(2, 4),
            &means,
            &valid,
            1.0,
            None,
            &mut hm,
            &mut c,
            &mut s,
        )
        .unwrap();
        // W ≥ 1 at row 0 t 0 (excess 1) and row 1 t 0, 1 (excess 0)
        assert_eq!((total, c, s), (3, [1, 2], [1.0, 0.0]));
    }

    #[test]
    fn empty_shapes() {
        let (mut a, mut b) = ([0.0f64; 0], [0.0f64; 0]);
        assert_eq!(
            window_means(Shape::new(3, 0), &[], &[], 4, false, &mut a, &mut b),
            Ok(0)
        );
        assert_eq!(
            window_means(Shape::new(0, 5), &[], &[], 4, false, &mut a, &mut b),
            Ok(0)
        );
        let (mut c, mut s) = ([7usize; 3], [7.0; 3]);
        assert_eq!(
            hwe(
                Shape::new(3, 0),
                &[],
                &[],
                0.5,
                None,
                &mut a,
                &mut c,
                &mut s
            ),
            Ok(0)
        );
        assert_eq!((c, s), ([0; 3], [0.0; 3]));
    }

    #[test]
    fn errors() {
        let s = Shape::new(2, 4);
        let h = [0.5f64; 8];
        let m = [1.0f64; 8];
        let (mut a, mut b) = ([0.0; 8], [0.0; 8]);
        assert!(matches!(
            window_means(s, &h, &m, 0, false, &mut a, &mut b),
            Err(Error::OutOfRange {
                what: "window_size",
                ..
            })
        ));
        assert_eq!(
            window_means(s, &h[..7], &m, 2, false, &mut a, &mut b),
            Err(Error::LengthMismatch {
                what: "entropies",
                expected: 8,
                actual: 7
            })
        );
        assert_eq!(
            window_means(s, &h, &m, 2, false, &mut a, &mut b[..3]),
            Err(Error::LengthMismatch {
                what: "out_valid",
                expected: 8,
                actual: 3
            })
        );
        let mut bad_m = m;
        bad_m[6] = 0.5;
        assert_eq!(
            window_means(s, &h, &bad_m, 2, false, &mut a, &mut b),
            Err(Error::InvalidMask {
                what: "mask",
                index: 6
            })
        );
        let mut bad_h = h;
        bad_h[5] = f64::INFINITY;
        assert_eq!(
            window_means(s, &bad_h, &m, 2, false, &mut a, &mut b),
            Err(Error::NonFinite {
                what: "entropies",
                index: 5
            })
        );
        let (mut c, mut sc) = ([0usize; 2], [0.0; 2]);
        assert!(matches!(
            hwe(s, &h, &m, f64::NAN, None, &mut a, &mut c, &mut sc),
            Err(Error::OutOfRange { what: "tau", .. })
        ));
        assert_eq!(
            hwe(s, &h, &m, 0.1, None, &mut a, &mut c[..1], &mut sc),
            Err(Error::LengthMismatch {
                what: "out_counts",
                expected: 2,
                actual: 1
            })
        );
        assert_eq!(
            hwe(s, &h, &m, 0.1, Some(&bad_m[..]), &mut a, &mut c, &mut sc),
            Err(Error::InvalidMask {
                what: "trigger_mask",
                index: 6
            })
        );
        assert_eq!(
            hwe(s, &h, &bad_m, 0.1, None, &mut a, &mut c, &mut sc),
            Err(Error::InvalidMask {
                what: "window_valid",
                index: 6
            })
        );
        assert_eq!(
            hwe(s, &bad_h, &m, 0.1, None, &mut a, &mut c, &mut sc),
            Err(Error::NonFinite {
                what: "window_means",
                index: 5
            })
        );
        // a non-finite mean under window_valid = 0 is ignored
        let mut v0 = m;
        v0[5] = 0.0;
        assert!(hwe(s, &bad_h, &v0, 0.1, None, &mut a, &mut c, &mut sc).is_ok());
    }

    fn batch() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>)> {
        (1usize..5, 1usize..40).prop_flat_map(|(rows, cols)| {
            let n = rows * cols;
            (
                Just(rows),
                Just(cols),
                prop::collection::vec(0.0f64..5.0, n),
                prop::collection::vec(prop::bool::weighted(0.85), n)
                    .prop_map(|v| v.into_iter().map(|b| if b { 1.0 } else { 0.0 }).collect()),
            )
        })
    }

    proptest! {
        #[test]
        fn window_means_match_reference(
            (rows, cols, h, m) in batch(), w in 1usize..12, incl in any::<bool>(),
        ) {
            let shape = Shape::new(rows, cols);
            let (mut means, mut valid) = (vec![f64::NAN; h.len()], vec![f64::NAN; h.len()]);
            let n = window_means(shape, &h, &m, w, incl, &mut means, &mut valid).unwrap();
            let (rm, rv) = naive(&h, &m, cols, w, incl);
            prop_assert_eq!(&means, &rm);
            prop_assert_eq!(&valid, &rv);
            prop_assert_eq!(n, rv.iter().filter(|&&v| v == 1.0).count());
            // at most one complete window per position that has w (+1) tokens after it
            let o = usize::from(!incl);
            prop_assert!(n <= rows * (cols + 1).saturating_sub(w + o));
            // each mean lies within [min, max] of its window
            for (i, (&mu, &v)) in means.iter().zip(&valid).enumerate() {
                if v == 1.0 {
                    let win = &h[i + o..i + o + w];
                    let lo = win.iter().cloned().fold(f64::INFINITY, f64::min);
                    let hi = win.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    prop_assert!(lo <= mu && mu <= hi);
                }
            }
        }

        #[test]
        fn hwe_matches_reference(
            (rows, cols, h, m) in batch(), w in 1usize..5, tau in 0.0f64..4.0,
            trig in any::<bool>(),
        ) {
            let shape = Shape::new(rows, cols);
            let (mut means, mut valid) = (vec![0.0; h.len()], vec![0.0; h.len()]);
            let windows = window_means(shape, &h, &m, w, false, &mut means, &mut valid).unwrap();
            // reuse the token mask as a trigger mask
            let trigger = if trig { Some(&m[..]) } else { None };
            let mut out = vec![f64::NAN; h.len()];
            let (mut c, mut s) = (vec![9; rows], vec![f64::NAN; rows]);
            let total = hwe(shape, &means, &valid, tau, trigger, &mut out, &mut c, &mut s).unwrap();
            prop_assert!(total <= windows);
            prop_assert_eq!(total, c.iter().sum::<usize>());
            for r in 0..rows {
                let mut cnt = 0;
                let mut cost = 0.0;
                for t in 0..cols {
                    let i = r * cols + t;
                    let cand = valid[i] == 1.0 && trigger.is_none_or(|g| g[i] == 1.0);
                    let is = cand && means[i] >= tau;
                    prop_assert_eq!(out[i], if is { 1.0 } else { 0.0 });
                    if is { cnt += 1; }
                    if cand { cost += (means[i] - tau).max(0.0); }
                }
                prop_assert_eq!(c[r], cnt);
                prop_assert!((s[r] - cost).abs() < 1e-12);
                prop_assert!(s[r] >= 0.0);
            }
        }
    }
}
