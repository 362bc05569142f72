//! Entropy windows, HWE tokens and per-row percentile thresholds over a `[rows, cols]`
//! batch (docs/algorithms.md §1): the row-parallel twins of `ares-cuda`'s `entropy_windows` and
//! `row_percentile`, with the math of `ares_core::entropy` applied to each row.

use crate::error::{Result, at_batch_index};
use ares_core::{Error as CoreError, Shape, entropy};
use rayon::prelude::*;

/// Rows handed to one rayon task at least: a row of a few thousand tokens is too little
/// work to schedule alone.
const MIN_ROWS_PER_TASK: usize = 8;

/// The window definition (docs/algorithms.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    /// Padded response length (columns).
    pub cols: usize,
    /// Window size w (default 4).
    pub window_size: usize,
    /// `t ..= t+w−1` instead of the following tokens `t+1 ..= t+w`.
    pub includes_self: bool,
}

/// Optional HWE outputs of [`entropy_windows`].
pub struct HweOutputs<'a> {
    /// The threshold τ: HWE iff complete window and `W_t ≥ τ`.
    pub tau: f32,
    /// Optional 0/1 trigger-position mask `[rows, cols]` restricting HWE candidates.
    pub trigger: Option<&'a [f32]>,
    /// 0/1 HWE mask `[rows, cols]`.
    pub hwe_mask: &'a mut [f32],
    /// Per-row HWE count (`high_entropy_token_num`), as f32 like the GPU's.
    pub counts: &'a mut [f32],
    /// Per-row soft cost Σ_HWE (W_t − τ).
    pub soft_cost: &'a mut [f32],
}

fn rows_of(what: &'static str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 {
        return Err(CoreError::OutOfRange {
            what: "cols",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    if !len.is_multiple_of(cols) {
        return Err(CoreError::NotDivisible { what, len, n: cols }.into());
    }
    Ok(len / cols)
}

/// Window means `W_t` and their 0/1 validity for every position of a `[rows, cols]` batch
/// of token entropies with a 0/1 mask (see `ares_core::entropy::window_means`), and, with
/// `hwe`, the HWE mask, per-row HWE counts and soft costs against τ (see
/// `ares_core::entropy::hwe`). Rows run in parallel.
pub fn entropy_windows(
    entropy: &[f32],
    mask: &[f32],
    spec: WindowSpec,
    hwe: Option<HweOutputs<'_>>,
    out_means: &mut [f32],
    out_valid: &mut [f32],
) -> Result<()> {
    let WindowSpec {
        cols,
        window_size,
        includes_self,
    } = spec;
    let rows = rows_of("entropy", entropy.len(), cols)?;
    let shape = Shape::new(rows, cols);
    shape.check("mask", mask.len())?;
    shape.check("out_means", out_means.len())?;
    shape.check("out_valid", out_valid.len())?;
    let row_shape = Shape::new(1, cols);
    let windows = |r: usize, means: &mut [f32], valid: &mut [f32]| -> Result<()> {
        let span = r * cols..(r + 1) * cols;
        entropy::window_means(
            row_shape,
            &entropy[span.clone()],
            &mask[span],
            window_size,
            includes_self,
            means,
            valid,
        )
        .map(|_| ())
        .map_err(|e| at_batch_index(e, r * cols).into())
    };
    let outputs = out_means
        .par_chunks_exact_mut(cols)
        .zip(out_valid.par_chunks_exact_mut(cols));
    let Some(h) = hwe else {
        return outputs
            .with_min_len(MIN_ROWS_PER_TASK)
            .enumerate()
            .try_for_each(|(r, (means, valid))| windows(r, means, valid));
    };
    shape.check("hwe_mask", h.hwe_mask.len())?;
    if let Some(t) = h.trigger {
        shape.check("trigger", t.len())?;
    }
    ares_core::Shape::new(1, rows).check("counts", h.counts.len())?;
    ares_core::Shape::new(1, rows).check("soft_cost", h.soft_cost.len())?;
    let (tau, trigger) = (h.tau, h.trigger);
    outputs
        .zip(h.hwe_mask.par_chunks_exact_mut(cols))
        .zip(h.counts.par_iter_mut().zip(h.soft_cost.par_iter_mut()))
        .with_min_len(MIN_ROWS_PER_TASK)
        .enumerate()
        .try_for_each(|(r, (((means, valid), hwe_row), (count, cost)))| {
            windows(r, means, valid)?;
            let trig = trigger.map(|t| &t[r * cols..(r + 1) * cols]);
            let (mut c, mut s) = ([0usize], [0.0f32]);
            entropy::hwe(row_shape, means, valid, tau, trig, hwe_row, &mut c, &mut s)
                .map_err(|e| at_batch_index(e, r * cols))?;
            *count = c[0] as f32;
            *cost = s[0];
            Ok(())
        })
}

/// Per-row `q`-th percentile (numpy linear interpolation) of the window means whose
/// `valid` is 1 (see `ares_core::entropy::response_thresholds`); rows without a complete
/// window get threshold 0 and `has` 0. Rows run in parallel, each thread with its own
/// scratch row.
pub fn row_percentile(
    means: &[f32],
    valid: &[f32],
    cols: usize,
    q: f32,
    out_threshold: &mut [f32],
    out_has: &mut [f32],
) -> Result<()> {
    let rows = rows_of("means", means.len(), cols)?;
    Shape::new(rows, cols).check("valid", valid.len())?;
    Shape::new(1, rows).check("out_threshold", out_threshold.len())?;
    Shape::new(1, rows).check("out_has", out_has.len())?;
    let row_shape = Shape::new(1, cols);
    out_threshold
        .par_iter_mut()
        .zip(out_has.par_iter_mut())
        .with_min_len(MIN_ROWS_PER_TASK)
        .enumerate()
        .try_for_each_init(
            || vec![0.0f32; cols],
            |scratch, (r, (thr, has))| {
                let span = r * cols..(r + 1) * cols;
                let (mut t, mut h) = ([0.0f32], [0.0f32]);
                entropy::response_thresholds(
                    row_shape,
                    &means[span.clone()],
                    &valid[span],
                    q,
                    scratch,
                    &mut t,
                    &mut h,
                )
                .map_err(|e| at_batch_index(e, r * cols))?;
                (*thr, *has) = (t[0], h[0]);
                Ok(())
            },
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> (Vec<f32>, Vec<f32>) {
        // docs/algorithms.md §11 vector 5 as row 0; a shorter response as row 1
        let h = vec![
            0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0, //
            0.5, 0.9, 0.7, 0.3, 0.6, 0.2, 0.0, 0.0,
        ];
        let m = vec![
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, //
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0,
        ];
        (h, m)
    }

    #[test]
    fn windows_and_hwe_match_the_spec_vector() {
        let (h, m) = batch();
        let spec = WindowSpec {
            cols: 8,
            window_size: 4,
            includes_self: false,
        };
        let (mut means, mut valid) = (vec![f32::NAN; 16], vec![f32::NAN; 16]);
        let (mut hwe, mut counts, mut cost) =
            (vec![f32::NAN; 16], vec![f32::NAN; 2], vec![f32::NAN; 2]);
        let outs = HweOutputs {
            tau: 0.6,
            trigger: None,
            hwe_mask: &mut hwe,
            counts: &mut counts,
            soft_cost: &mut cost,
        };
        entropy_windows(&h, &m, spec, Some(outs), &mut means, &mut valid).unwrap();
        // row 0: W_1 = (1.2+0.8+0.4+0.1)/4 = 0.625; positions >= 4 have no window
        assert!((means[1] - 0.625).abs() < 1e-6);
        assert_eq!(&valid[..8], &[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        // W_0 = (1.0+1.2+0.8+0.4)/4 = 0.85 ≥ 0.6, W_1 = 0.625 ≥ 0.6, W_2 = 0.325, W_3 = 0.125
        assert_eq!(&hwe[..8], &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(counts[0], 2.0);
        assert!((cost[0] - (0.25 + 0.025)).abs() < 1e-6);
        // row 1: length 6, so only t = 0, 1 have complete windows
        assert_eq!(&valid[8..], &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        // W_0 = (0.9+0.7+0.3+0.6)/4 = 0.625, W_1 = (0.7+0.3+0.6+0.2)/4 = 0.45
        assert_eq!(counts[1], 1.0);
    }

    #[test]
    fn percentile_per_row() {
        let (h, m) = batch();
        let spec = WindowSpec {
            cols: 8,
            window_size: 4,
            includes_self: false,
        };
        let (mut means, mut valid) = (vec![0.0f32; 16], vec![0.0f32; 16]);
        entropy_windows(&h, &m, spec, None, &mut means, &mut valid).unwrap();
        let (mut thr, mut has) = ([0.0f32; 2], [0.0f32; 2]);
        row_percentile(&means, &valid, 8, 50.0, &mut thr, &mut has).unwrap();
        // row 0 windows: 0.85, 0.625, 0.325, 0.125 → median 0.475
        assert!((thr[0] - 0.475).abs() < 1e-6, "{thr:?}");
        // row 1 windows: 0.625, 0.45 → median 0.5375
        assert!((thr[1] - 0.5375).abs() < 1e-6);
        assert_eq!(has, [1.0, 1.0]);
    }

    #[test]
    fn errors_name_the_batch_position() {
        let (mut h, m) = batch();
        h[10] = f32::NAN;
        let spec = WindowSpec {
            cols: 8,
            window_size: 4,
            includes_self: false,
        };
        let (mut means, mut valid) = (vec![0.0f32; 16], vec![0.0f32; 16]);
        let err = entropy_windows(&h, &m, spec, None, &mut means, &mut valid).unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::Core(CoreError::NonFinite { index: 10, .. })
            ),
            "{err:?}"
        );
        let err = entropy_windows(&h[..15], &m, spec, None, &mut means, &mut valid).unwrap_err();
        assert!(
            matches!(err, crate::Error::Core(CoreError::NotDivisible { .. })),
            "{err:?}"
        );
    }
}
