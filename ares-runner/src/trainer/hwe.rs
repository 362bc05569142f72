//! High-window-entropy (HWE) tokens of a batch of responses (docs/algorithms.md §1): window means of the
//! sampled tokens' entropies, per-response thresholds, the batch median `m` that moves the
//! global threshold τ, and the HWE mask and counts under the τ in force.

use ares_core::Shape;
use ares_core::entropy::{
    ThresholdEma, batch_median_threshold, hwe, response_thresholds, window_means,
};

use super::TrainError;

/// How windows and thresholds are formed (the `algorithm.entropy_reward` and
/// `worker.rollout.window_size` keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HweParams {
    /// `w`, tokens per window.
    pub window_size: usize,
    /// Window `H_t … H_{t+w−1}` instead of the following `w` tokens.
    pub window_includes_self: bool,
    /// Percentile of a response's window means that is its threshold.
    pub percentile: f64,
}

/// The HWE view of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct HwePass {
    /// `[rows, cols]` 1 on HWE tokens.
    pub mask: Vec<f32>,
    /// HWE tokens per response (`high_entropy_token_num`).
    pub counts: Vec<usize>,
    /// Σ over HWE tokens of `W_t − τ`, per response.
    pub soft_cost: Vec<f32>,
    /// The batch's threshold candidate `m` (median of the per-response thresholds), `None`
    /// when no response has a complete window.
    pub batch_threshold: Option<f64>,
    /// The τ the tokens were counted with.
    pub tau: f64,
}

/// Window means, thresholds and HWE tokens of `entropies` under `mask` (`[rows, cols]`),
/// counted with `tau` — or, when no τ exists yet (no bootstrap, first batch), with the
/// batch's own candidate `m` (docs/algorithms.md §1). `trigger` optionally restricts candidates to
/// positions whose token is a trigger word. τ itself is not updated here: the caller folds
/// `batch_threshold` into its [`ThresholdEma`] after counting.
///
/// # Errors
/// Shapes, non-finite entropies under the mask, an invalid percentile or window size.
pub fn hwe_pass(
    shape: Shape,
    entropies: &[f32],
    mask: &[f32],
    trigger: Option<&[f32]>,
    params: &HweParams,
    tau: Option<f64>,
) -> Result<HwePass, TrainError> {
    let len = shape.rows * shape.cols;
    let mut means = vec![0.0f32; len];
    let mut valid = vec![0.0f32; len];
    window_means(
        shape,
        entropies,
        mask,
        params.window_size,
        params.window_includes_self,
        &mut means,
        &mut valid,
    )?;
    let mut scratch = vec![0.0f32; shape.cols.max(shape.rows)];
    let mut thresholds = vec![0.0f32; shape.rows];
    let mut has = vec![0.0f32; shape.rows];
    response_thresholds(
        shape,
        &means,
        &valid,
        params.percentile as f32,
        &mut scratch,
        &mut thresholds,
        &mut has,
    )?;
    let m = batch_median_threshold(&thresholds, &has, &mut scratch)?.map(f64::from);
    // No τ and no window anywhere: nothing can be HWE; +∞ would be rejected, so any τ works
    // because every window is invalid.
    let tau = tau.or(m).unwrap_or(0.0);
    let mut out_mask = vec![0.0f32; len];
    let mut counts = vec![0usize; shape.rows];
    let mut soft_cost = vec![0.0f32; shape.rows];
    hwe(
        shape,
        &means,
        &valid,
        tau as f32,
        trigger,
        &mut out_mask,
        &mut counts,
        &mut soft_cost,
    )?;
    Ok(HwePass {
        mask: out_mask,
        counts,
        soft_cost,
        batch_threshold: m,
        tau,
    })
}

/// Folds a batch's candidate into τ (no-op without one); returns τ after the update.
///
/// # Errors
/// A non-finite candidate.
pub fn update_tau(ema: &mut ThresholdEma<f64>, pass: &HwePass) -> Result<Option<f64>, TrainError> {
    if let Some(m) = pass.batch_threshold {
        ema.update(m)?;
    }
    Ok(ema.tau())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_vector_5_counts_the_first_position() {
        let h = [0.2f32, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];
        let mask = [1.0f32; 8];
        let shape = Shape { rows: 1, cols: 8 };
        let params = HweParams {
            window_size: 4,
            window_includes_self: false,
            percentile: 95.0,
        };
        let pass = hwe_pass(shape, &h, &mask, None, &params, Some(0.6)).unwrap();
        // W = [0.85, 0.625, 0.325, 0.125]: two windows ≥ 0.6
        assert_eq!(pass.counts, [2]);
        assert_eq!(&pass.mask[..4], &[1.0, 1.0, 0.0, 0.0]);
        assert_eq!(pass.tau, 0.6);
        // the response's p95 of [0.85, 0.625, 0.325, 0.125]
        let m = pass.batch_threshold.unwrap();
        assert!((m - 0.81625).abs() < 1e-6, "{m}");
    }

    #[test]
    fn without_tau_the_batch_threshold_counts() {
        let h = [0.2f32, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];
        let shape = Shape { rows: 1, cols: 8 };
        let params = HweParams {
            window_size: 4,
            window_includes_self: false,
            percentile: 95.0,
        };
        let pass = hwe_pass(shape, &h, &[1.0; 8], None, &params, None).unwrap();
        assert_eq!(pass.counts, [1]);
        let mut ema = ThresholdEma::new(0.99).unwrap();
        assert!((update_tau(&mut ema, &pass).unwrap().unwrap() - 0.81625).abs() < 1e-6);
    }

    #[test]
    fn short_responses_have_no_window() {
        let shape = Shape { rows: 2, cols: 3 };
        let params = HweParams {
            window_size: 4,
            window_includes_self: false,
            percentile: 95.0,
        };
        let pass = hwe_pass(shape, &[1.0; 6], &[1.0; 6], None, &params, None).unwrap();
        assert_eq!(pass.counts, [0, 0]);
        assert_eq!(pass.batch_threshold, None);
    }
}
