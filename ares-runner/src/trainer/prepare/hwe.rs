//! High-window-entropy (HWE) tokens of a batch of responses (docs/algorithms.md §1), on the
//! backend's device: window means of the sampled tokens' entropies, per-response percentile
//! thresholds, the batch median `m` that moves the global threshold τ, and the HWE mask and
//! counts under the τ in force. The mask stays on the device (the KL reads it there); only
//! per-row numbers — thresholds, counts, soft costs — cross to the host.

use ares_core::Shape;
use ares_core::entropy::{ThresholdEma, batch_median_threshold};

use crate::backend::{Backend, HweViews, Tensor, View, ViewMut, WindowSpec};
use crate::trainer::TrainError;
use crate::trainer::prepare::device::{Downloads, alloc, download, upload};

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
#[derive(Debug)]
pub struct HwePass<B: Backend> {
    /// `[rows, cols]` 1 on HWE tokens, on the device.
    pub mask: B::Buffer,
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

/// Window means, thresholds and HWE tokens of `entropies` under `mask` (`[rows, cols]`
/// device tensors), counted with `tau` — or, when no τ exists yet (no bootstrap, first
/// batch), with the batch's own candidate `m` (docs/algorithms.md §1). `trigger` optionally
/// restricts candidates to positions whose token is a trigger word. τ itself is not updated
/// here: the caller folds `batch_threshold` into its [`ThresholdEma`] after counting.
/// Downloads (four per-row vectors) are counted in `downloads`.
///
/// # Errors
/// Shapes, non-finite entropies under the mask, an invalid percentile or window size.
#[allow(clippy::too_many_arguments)] // the pass's tensors and its parameters
pub fn hwe_pass<B: Backend>(
    be: &B,
    shape: Shape,
    entropies: Tensor<'_, B>,
    mask: Tensor<'_, B>,
    trigger: Option<Tensor<'_, B>>,
    params: &HweParams,
    tau: Option<f64>,
    downloads: &mut Downloads,
) -> Result<HwePass<B>, TrainError> {
    let (rows, len) = (shape.rows, shape.rows * shape.cols);
    let spec = WindowSpec {
        cols: shape.cols,
        window_size: params.window_size,
        includes_self: params.window_includes_self,
    };
    let (mut means, mut valid) = (alloc(be, len)?, alloc(be, len)?);
    be.entropy_windows(
        entropies,
        mask,
        spec,
        None,
        ViewMut::whole(&mut means),
        ViewMut::whole(&mut valid),
    )?;
    let (mut thresholds, mut has) = (alloc(be, rows)?, alloc(be, rows)?);
    be.row_percentile(
        View::whole(&means),
        View::whole(&valid),
        shape.cols,
        params.percentile as f32,
        ViewMut::whole(&mut thresholds),
        ViewMut::whole(&mut has),
    )?;
    let thresholds = download(be, &thresholds, downloads)?;
    let has = download(be, &has, downloads)?;
    let mut scratch = vec![0.0f32; rows];
    let m = batch_median_threshold(&thresholds, &has, &mut scratch)?.map(f64::from);
    // No τ and no window anywhere: nothing can be HWE; any finite τ works because every
    // window is invalid.
    let tau = tau.or(m).unwrap_or(0.0);
    let mut hwe_mask = alloc(be, len)?;
    let (mut counts, mut soft_cost) = (alloc(be, rows)?, alloc(be, rows)?);
    be.entropy_windows(
        entropies,
        mask,
        spec,
        Some(HweViews {
            tau: tau as f32,
            trigger,
            hwe_mask: ViewMut::whole(&mut hwe_mask),
            counts: ViewMut::whole(&mut counts),
            soft_cost: ViewMut::whole(&mut soft_cost),
        }),
        ViewMut::whole(&mut means),
        ViewMut::whole(&mut valid),
    )?;
    // counts are whole numbers far below 2^24, exact in f32
    let counts = download(be, &counts, downloads)?
        .into_iter()
        .map(|c| c as usize)
        .collect();
    Ok(HwePass {
        mask: hwe_mask,
        counts,
        soft_cost: download(be, &soft_cost, downloads)?,
        batch_threshold: m,
        tau,
    })
}

/// HWE tokens of host tensors (uploaded here): [`hwe_pass`] for the callers that hold the
/// entropies on the host (online filtering and the bootstrap grade rollouts whose
/// entropies the sampler returned).
///
/// # Errors
/// As [`hwe_pass`].
pub fn hwe_pass_host<B: Backend>(
    be: &B,
    shape: Shape,
    entropies: &[f32],
    mask: &[f32],
    params: &HweParams,
    tau: Option<f64>,
) -> Result<HwePass<B>, TrainError> {
    let (entropies, mask) = (upload(be, entropies)?, upload(be, mask)?);
    hwe_pass(
        be,
        shape,
        View::whole(&entropies),
        View::whole(&mask),
        None,
        params,
        tau,
        &mut Downloads::default(),
    )
}

/// Folds a batch's candidate into τ (no-op without one); returns τ after the update.
///
/// # Errors
/// A non-finite candidate.
pub fn update_tau<B: Backend>(
    ema: &mut ThresholdEma<f64>,
    pass: &HwePass<B>,
) -> Result<Option<f64>, TrainError> {
    if let Some(m) = pass.batch_threshold {
        ema.update(m)?;
    }
    Ok(ema.tau())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use ares_core::entropy::{hwe, response_thresholds, window_means};

    fn params(window_size: usize, window_includes_self: bool, percentile: f64) -> HweParams {
        HweParams {
            window_size,
            window_includes_self,
            percentile,
        }
    }

    fn pass(
        h: &[f32],
        mask: &[f32],
        shape: Shape,
        p: &HweParams,
        tau: Option<f64>,
    ) -> HwePass<CpuBackend> {
        hwe_pass_host(&CpuBackend, shape, h, mask, p, tau).unwrap()
    }

    #[test]
    fn spec_vector_5_counts_the_first_position() {
        let h = [0.2f32, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];
        let shape = Shape { rows: 1, cols: 8 };
        let p = pass(&h, &[1.0; 8], shape, &params(4, false, 95.0), Some(0.6));
        // W = [0.85, 0.625, 0.325, 0.125]: two windows ≥ 0.6
        assert_eq!(p.counts, [2]);
        assert_eq!(&p.mask[..4], &[1.0, 1.0, 0.0, 0.0]);
        assert_eq!(p.tau, 0.6);
        // the response's p95 of [0.85, 0.625, 0.325, 0.125]
        let m = p.batch_threshold.unwrap();
        assert!((m - 0.81625).abs() < 1e-6, "{m}");
    }

    #[test]
    fn without_tau_the_batch_threshold_counts() {
        let h = [0.2f32, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];
        let shape = Shape { rows: 1, cols: 8 };
        let p = pass(&h, &[1.0; 8], shape, &params(4, false, 95.0), None);
        assert_eq!(p.counts, [1]);
        let mut ema = ThresholdEma::new(0.99).unwrap();
        assert!((update_tau(&mut ema, &p).unwrap().unwrap() - 0.81625).abs() < 1e-6);
    }

    #[test]
    fn short_responses_have_no_window() {
        let shape = Shape { rows: 2, cols: 3 };
        let p = pass(&[1.0; 6], &[1.0; 6], shape, &params(4, false, 95.0), None);
        assert_eq!(p.counts, [0, 0]);
        assert_eq!(p.batch_threshold, None);
    }

    #[test]
    fn bad_parameters_are_errors_not_panics() {
        let shape = Shape { rows: 1, cols: 4 };
        let e = hwe_pass_host(
            &CpuBackend,
            shape,
            &[1.0; 4],
            &[1.0; 4],
            &params(0, false, 95.0),
            None,
        );
        assert!(e.is_err());
        let e = hwe_pass_host(
            &CpuBackend,
            shape,
            &[1.0; 4],
            &[1.0; 4],
            &params(2, false, 101.0),
            None,
        );
        assert!(e.is_err());
        let e = hwe_pass_host(
            &CpuBackend,
            shape,
            &[f32::NAN; 4],
            &[1.0; 4],
            &params(2, false, 95.0),
            None,
        );
        assert!(e.is_err());
    }

    /// The pass as ares-core computes it on the host over the whole batch at once.
    fn host_reference(
        shape: Shape,
        h: &[f32],
        mask: &[f32],
        trigger: Option<&[f32]>,
        p: &HweParams,
        tau: Option<f64>,
    ) -> (Vec<f32>, Vec<usize>, Vec<f32>, Option<f64>, f64) {
        let len = shape.rows * shape.cols;
        let (mut means, mut valid) = (vec![0.0f32; len], vec![0.0f32; len]);
        window_means(
            shape,
            h,
            mask,
            p.window_size,
            p.window_includes_self,
            &mut means,
            &mut valid,
        )
        .unwrap();
        let mut scratch = vec![0.0f32; shape.cols.max(shape.rows)];
        let (mut thr, mut has) = (vec![0.0f32; shape.rows], vec![0.0f32; shape.rows]);
        response_thresholds(
            shape,
            &means,
            &valid,
            p.percentile as f32,
            &mut scratch,
            &mut thr,
            &mut has,
        )
        .unwrap();
        let m = batch_median_threshold(&thr, &has, &mut scratch)
            .unwrap()
            .map(f64::from);
        let tau = tau.or(m).unwrap_or(0.0);
        let mut out = vec![0.0f32; len];
        let (mut counts, mut cost) = (vec![0usize; shape.rows], vec![0.0f32; shape.rows]);
        hwe(
            shape,
            &means,
            &valid,
            tau as f32,
            trigger,
            &mut out,
            &mut counts,
            &mut cost,
        )
        .unwrap();
        (out, counts, cost, m, tau)
    }

    #[test]
    fn the_backend_pass_equals_the_host_computation_on_random_batches() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as f32 / (1u64 << 31) as f32
        };
        for case in 0..40 {
            let rows = 1 + case % 7;
            let cols = 1 + (case * 5) % 23;
            let shape = Shape { rows, cols };
            let lengths: Vec<usize> = (0..rows)
                .map(|_| (next() * (cols + 1) as f32) as usize)
                .collect();
            let mut mask = vec![0.0f32; rows * cols];
            for (r, &l) in lengths.iter().enumerate() {
                mask[r * cols..r * cols + l.min(cols)].fill(1.0);
            }
            let h: Vec<f32> = (0..rows * cols).map(|_| 3.0 * next()).collect();
            let trigger: Vec<f32> = (0..rows * cols).map(|_| f32::from(next() < 0.5)).collect();
            let p = params(
                1 + case % 5,
                case % 2 == 0,
                [50.0, 80.0, 95.0, 100.0][case % 4],
            );
            let tau = (case % 3 != 0).then(|| f64::from(next()));
            let use_trigger = case % 4 == 1;
            let want = host_reference(
                shape,
                &h,
                &mask,
                use_trigger.then_some(trigger.as_slice()),
                &p,
                tau,
            );
            let be = CpuBackend;
            let (dh, dm, dt) = (
                upload(&be, &h).unwrap(),
                upload(&be, &mask).unwrap(),
                upload(&be, &trigger).unwrap(),
            );
            let mut downloads = Downloads::default();
            let got = hwe_pass(
                &be,
                shape,
                View::whole(&dh),
                View::whole(&dm),
                use_trigger.then(|| View::whole(&dt)),
                &p,
                tau,
                &mut downloads,
            )
            .unwrap();
            assert_eq!(got.mask, want.0, "case {case}: mask");
            assert_eq!(got.counts, want.1, "case {case}: counts");
            assert_eq!(got.soft_cost, want.2, "case {case}: soft cost");
            assert_eq!(got.batch_threshold, want.3, "case {case}: m");
            assert_eq!(got.tau, want.4, "case {case}: tau");
            // only per-row numbers crossed: thresholds, has, counts, soft costs
            assert_eq!(downloads.bytes, 4 * rows * 4, "case {case}");
        }
    }
}
