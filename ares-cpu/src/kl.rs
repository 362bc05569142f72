//! Masked dynamic KL over a `[rows, cols]` batch (docs/algorithms.md §4): the row-parallel twin of
//! `ares-cuda`'s `masked_dynamic_kl`, with the math of `ares_core::kl::token_kl` per row.

use crate::error::{Result, at_batch_index};
use ares_core::kl::{KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs, token_kl};
use ares_core::{Error as CoreError, Shape};
use rayon::prelude::*;

/// Inputs of [`masked_dynamic_kl`]; token tensors are `[rows, cols]`.
#[derive(Debug, Clone, Copy)]
pub struct MaskedKlInputs<'a> {
    /// log π of the sampled tokens.
    pub logp: &'a [f32],
    /// log π_ref of the same tokens.
    pub ref_logp: &'a [f32],
    /// 0/1 response mask.
    pub mask: &'a [f32],
    /// Optional 0/1 HWE mask: HWE tokens get weight β·low_ratio.
    pub hwe_mask: Option<&'a [f32]>,
    /// β per row (the bucket's λ_d under dual ascent, or the fixed/adaptive coefficient).
    pub beta_rows: &'a [f32],
    /// Weight ratio on HWE tokens (default 0.5), in [0, 1].
    pub low_ratio: f32,
    /// The per-token estimator.
    pub estimator: KlEstimator,
    /// Columns.
    pub cols: usize,
}

/// Outputs of [`masked_dynamic_kl`].
#[derive(Debug)]
pub struct MaskedKlOutputs<'a> {
    /// Optional per-token `k_t` (0 on padding).
    pub kl: Option<&'a mut [f32]>,
    /// Optional per-token `β_t·k_t` (0 on padding).
    pub weighted: Option<&'a mut [f32]>,
    /// Per-row `Σ_t β_t·k_t`.
    pub row_weighted_sum: &'a mut [f32],
    /// Per-row mean of `k_t` over valid tokens (0 for a row without one).
    pub row_mean_kl: &'a mut [f32],
}

/// Per token `k_t` by the estimator, weight `β_t = β_row·(hwe_t ? low_ratio : 1)·mask_t`;
/// per row the weighted sum and the mean KL; returns the total weighted sum, added in row
/// order. Rows run in parallel. Errors as `ares_core::kl::token_kl`, with batch-wide
/// indices.
pub fn masked_dynamic_kl(inputs: MaskedKlInputs<'_>, outputs: MaskedKlOutputs<'_>) -> Result<f32> {
    let MaskedKlInputs {
        logp,
        ref_logp,
        mask,
        hwe_mask,
        beta_rows,
        low_ratio,
        estimator,
        cols,
    } = inputs;
    if cols == 0 {
        return Err(CoreError::OutOfRange {
            what: "cols",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    if logp.len() % cols != 0 {
        return Err(CoreError::NotDivisible {
            what: "logp",
            len: logp.len(),
            n: cols,
        }
        .into());
    }
    let rows = logp.len() / cols;
    let shape = Shape::new(rows, cols);
    shape.check("ref_logp", ref_logp.len())?;
    shape.check("mask", mask.len())?;
    if let Some(h) = hwe_mask {
        shape.check("hwe_mask", h.len())?;
    }
    let per_row = Shape::new(1, rows);
    per_row.check("beta_rows", beta_rows.len())?;
    let MaskedKlOutputs {
        kl,
        weighted,
        row_weighted_sum,
        row_mean_kl,
    } = outputs;
    if let Some(k) = &kl {
        shape.check("kl", k.len())?;
    }
    if let Some(w) = &weighted {
        shape.check("weighted", w.len())?;
    }
    per_row.check("row_weighted_sum", row_weighted_sum.len())?;
    per_row.check("row_mean_kl", row_mean_kl.len())?;

    // Optional token outputs become per-row chunk iterators of matching length.
    let mut kl_rows: Vec<Option<&mut [f32]>> = match kl {
        Some(k) => k.chunks_exact_mut(cols).map(Some).collect(),
        None => (0..rows).map(|_| None).collect(),
    };
    let mut weighted_rows: Vec<Option<&mut [f32]>> = match weighted {
        Some(w) => w.chunks_exact_mut(cols).map(Some).collect(),
        None => (0..rows).map(|_| None).collect(),
    };
    let row_shape = Shape::new(1, cols);
    row_weighted_sum
        .par_iter_mut()
        .zip(row_mean_kl.par_iter_mut())
        .zip(kl_rows.par_iter_mut().zip(weighted_rows.par_iter_mut()))
        .enumerate()
        .try_for_each(|(r, ((wsum, mean), (kl_row, w_row)))| {
            let span = r * cols..(r + 1) * cols;
            let mut cfg =
                TokenKlConfig::new(estimator, KlCoefficient::PerRow(&beta_rows[r..r + 1]));
            if let Some(h) = hwe_mask {
                cfg = cfg.with_hwe(&h[span.clone()], low_ratio);
            } else {
                cfg.low_ratio = low_ratio;
            }
            let (mut s, mut m) = ([0.0f32], [0.0f32]);
            let out = TokenKlOutputs {
                kl: kl_row.as_deref_mut(),
                weighted: w_row.as_deref_mut(),
                grad: None,
                row_weighted_sum: Some(&mut s),
                row_mean_kl: Some(&mut m),
            };
            token_kl(
                row_shape,
                &logp[span.clone()],
                &ref_logp[span.clone()],
                &mask[span],
                &cfg,
                out,
            )
            .map_err(|e| at_batch_index(e, r * cols))?;
            (*wsum, *mean) = (s[0], m[0]);
            Ok::<(), crate::Error>(())
        })?;
    Ok(row_weighted_sum.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_hwe_tokens_by_low_ratio_and_sums_rows() {
        // docs/algorithms.md §11 vector 8: k3(-1.0, -1.5) = 0.1065307, k3(-2, -1) = 0.7182818
        let logp = [-1.0f32, -2.0, -1.0, 0.0];
        let ref_logp = [-1.5f32, -1.0, -1.5, 0.0];
        let mask = [1.0f32, 1.0, 1.0, 0.0];
        let hwe = [0.0f32, 1.0, 0.0, 0.0];
        let beta = [0.1f32, 0.2];
        let (mut kl, mut w) = ([f32::NAN; 4], [f32::NAN; 4]);
        let (mut sums, mut means) = ([f32::NAN; 2], [f32::NAN; 2]);
        let total = masked_dynamic_kl(
            MaskedKlInputs {
                logp: &logp,
                ref_logp: &ref_logp,
                mask: &mask,
                hwe_mask: Some(&hwe),
                beta_rows: &beta,
                low_ratio: 0.5,
                estimator: KlEstimator::K3,
                cols: 2,
            },
            MaskedKlOutputs {
                kl: Some(&mut kl),
                weighted: Some(&mut w),
                row_weighted_sum: &mut sums,
                row_mean_kl: &mut means,
            },
        )
        .unwrap();
        let (a, b) = (0.106_530_7f32, 0.718_281_8f32);
        assert!((kl[0] - a).abs() < 1e-6 && (kl[1] - b).abs() < 1e-6 && kl[3] == 0.0);
        // row 0: 0.1·a + 0.1·0.5·b; row 1: 0.2·a (second token is padding)
        assert!((sums[0] - (0.1 * a + 0.05 * b)).abs() < 1e-6);
        assert!((sums[1] - 0.2 * a).abs() < 1e-6);
        assert!((means[0] - (a + b) / 2.0).abs() < 1e-6 && (means[1] - a).abs() < 1e-6);
        assert!((total - (sums[0] + sums[1])).abs() < 1e-7);
        assert_eq!(w[3], 0.0);
    }
}
