//! The token operations on device buffers: argument checks, launch shapes, and error
//! reporting. Semantics are those of the CPU twins named on each function.

use crate::device::Cuda;
use crate::error::{DriverContext, Error, Result};
use crate::launch::{ArgOrNull, NULL, bad, check_len};
use ares_core::kl::KlEstimator;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use half::{bf16, f16};
use std::sync::Arc;

/// Logit element types with a fused log-prob + entropy kernel.
pub trait LogitElem: DeviceRepr {
    /// The kernel for this element type.
    const KERNEL: &'static str;
}
impl LogitElem for f32 {
    const KERNEL: &'static str = "log_prob_entropy_f32";
}
impl LogitElem for bf16 {
    const KERNEL: &'static str = "log_prob_entropy_bf16";
}
impl LogitElem for f16 {
    const KERNEL: &'static str = "log_prob_entropy_f16";
}

/// Threads per block of the row kernels (one block per row).
const ROW_BLOCK: u32 = 512;
/// Threads per block of the per-token window kernel.
const TOKEN_BLOCK: u32 = 256;

pub(crate) fn grid_rows(kernel: &'static str, rows: usize) -> Result<u32> {
    u32::try_from(rows)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or_else(|| {
            bad(
                kernel,
                format!("{rows} rows exceed the grid limit 2^31 - 1"),
            )
        })
}

pub(crate) fn shape(kernel: &'static str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 {
        return Err(bad(kernel, "`cols` must be >= 1".into()));
    }
    if !len.is_multiple_of(cols) {
        return Err(bad(
            kernel,
            format!("{len} elements are not a multiple of cols = {cols}"),
        ));
    }
    Ok(len / cols)
}

impl Cuda {
    /// Fused log-prob + entropy, the twin of `ares_cpu::log_prob_entropy`: per row of
    /// `logits` (`[rows, vocab]`, f32/bf16/f16; rows = `out_entropy.len()`), the entropy of
    /// `softmax(logits / temperature)` and, with `targets = (ids, out_log_prob)`, the
    /// log-prob of `ids[row]`. One block per row reads the row once with 16-byte loads.
    /// Errors name the kernel: bad lengths or temperature, NaN/+∞ or all −∞ rows, target
    /// ids out of range or with logit −∞.
    pub fn log_prob_entropy<T: LogitElem>(
        &mut self,
        logits: &CudaSlice<T>,
        vocab: usize,
        temperature: f32,
        targets: Option<(&CudaSlice<u32>, &mut CudaSlice<f32>)>,
        out_entropy: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let kernel = T::KERNEL;
        if vocab == 0 || vocab > u32::MAX as usize {
            return Err(bad(
                kernel,
                format!("vocab = {vocab} must be in 1..=2^32-1"),
            ));
        }
        let inv_t = 1.0 / temperature;
        if !(temperature.is_finite() && temperature > 0.0 && inv_t.is_finite()) {
            return Err(bad(
                kernel,
                format!("temperature = {temperature} must be finite and > 0"),
            ));
        }
        let rows = out_entropy.len();
        check_len(kernel, "logits", rows.saturating_mul(vocab), logits.len())?;
        if let Some((ids, out)) = &targets {
            check_len(kernel, "targets", rows, ids.len())?;
            check_len(kernel, "out_log_prob", rows, out.len())?;
        }
        if rows == 0 {
            return Ok(());
        }
        let grid = grid_rows(kernel, rows)?;
        self.clear_status(kernel)?;
        let func = match kernel {
            "log_prob_entropy_f32" => &self.functions.log_prob_entropy_f32,
            "log_prob_entropy_bf16" => &self.functions.log_prob_entropy_bf16,
            _ => &self.functions.log_prob_entropy_f16,
        };
        let vocab_i64 = vocab as i64;
        let mut launch = self.stream.launch_builder(func);
        launch.arg(logits).arg(&vocab_i64).arg(&inv_t);
        let (ids, out_lp) = match targets {
            Some((ids, out)) => (Some(ids), Some(out)),
            None => (None, None),
        };
        launch
            .arg_or_null(ids)
            .arg_or_null(out_lp)
            .arg(out_entropy)
            .arg(&mut self.status);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match the kernel signature in token_kernels.cu;
        // every buffer length was checked above.
        unsafe { launch.launch(cfg) }.during(format!("launch {kernel}"))?;
        match self.read_status(kernel)? {
            0 => Ok(()),
            s if s & 1 != 0 => Err(Error::BadData {
                kernel,
                message: "a logits row holds NaN or +inf, or every entry is -inf",
            }),
            _ => Err(Error::BadData {
                kernel,
                message: "a target id is >= vocab or has logit -inf",
            }),
        }
    }
}

/// The window definition of [`TokenOps::entropy_windows`] (docs/algorithms.md §1).
#[derive(Debug, Clone, Copy)]
pub struct WindowSpec {
    /// Padded response length (columns of the `[rows, cols]` tensors).
    pub cols: usize,
    /// Window size w (default 4).
    pub window_size: usize,
    /// `t ..= t+w−1` instead of the following tokens `t+1 ..= t+w`.
    pub includes_self: bool,
}

/// Optional HWE outputs of [`TokenOps::entropy_windows`].
pub struct HweOutputs<'a> {
    /// The threshold τ: HWE iff complete window and `W_t ≥ τ`.
    pub tau: f32,
    /// Optional 0/1 trigger-position mask `[rows, cols]` restricting HWE candidates.
    pub trigger: Option<CudaView<'a, f32>>,
    /// 0/1 HWE mask `[rows, cols]`.
    pub hwe_mask: CudaViewMut<'a, f32>,
    /// Per-row HWE count (`high_entropy_token_num`).
    pub counts: CudaViewMut<'a, f32>,
    /// Per-row soft cost Σ_HWE (W_t − τ).
    pub soft_cost: CudaViewMut<'a, f32>,
}

/// Inputs of [`TokenOps::masked_dynamic_kl`]; all token tensors are `[rows, cols]`.
pub struct MaskedKlInputs<'a> {
    /// log π of the sampled tokens.
    pub logp: CudaView<'a, f32>,
    /// log π_ref of the same tokens.
    pub ref_logp: CudaView<'a, f32>,
    /// 0/1 response mask.
    pub mask: CudaView<'a, f32>,
    /// Optional 0/1 HWE mask: HWE tokens get weight β·low_ratio.
    pub hwe_mask: Option<CudaView<'a, f32>>,
    /// β per row (the bucket's λ_d under dual ascent, or the fixed/adaptive coefficient).
    pub beta_rows: CudaView<'a, f32>,
    /// Weight ratio on HWE tokens (default 0.5), in [0, 1].
    pub low_ratio: f32,
    /// The per-token estimator.
    pub estimator: KlEstimator,
    /// Columns.
    pub cols: usize,
}

/// Outputs of [`TokenOps::masked_dynamic_kl`].
pub struct MaskedKlOutputs<'a> {
    /// Optional per-token k_t (0 on padding).
    pub kl: Option<CudaViewMut<'a, f32>>,
    /// Optional per-token β_t·k_t (0 on padding).
    pub weighted: Option<CudaViewMut<'a, f32>>,
    /// Per-row Σ_t β_t·k_t.
    pub row_weighted_sum: CudaViewMut<'a, f32>,
    /// Per-row mean of k_t over valid tokens (0 for a row without one).
    pub row_mean_kl: CudaViewMut<'a, f32>,
    /// One element: Σ over rows of `row_weighted_sum`, summed in row order.
    pub total: CudaViewMut<'a, f32>,
}

/// The ARES token ops on cudarc views, lent by whichever device holds the kernels —
/// [`Cuda::token_ops`] or [`crate::ModelOps`] (the model backend) — so each launch is
/// written once. Ops are queued on `stream` and return without waiting.
pub struct TokenOps<'a> {
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) entropy_windows: &'a CudaFunction,
    pub(crate) row_percentile: &'a CudaFunction,
    pub(crate) masked_dynamic_kl: &'a CudaFunction,
    pub(crate) mask_row_counts: &'a CudaFunction,
    pub(crate) policy_loss: &'a CudaFunction,
    pub(crate) cov_select: &'a CudaFunction,
    /// Blocks-finished counter of the last-block reduction; the kernel resets it to 0.
    pub(crate) blocks_done: &'a mut CudaSlice<u32>,
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub(crate) max_shared_per_block: usize,
}

impl Cuda {
    /// The token ops of this device.
    pub fn token_ops(&mut self) -> TokenOps<'_> {
        let max_shared_per_block = self.info().max_shared_per_block;
        TokenOps {
            stream: &self.stream,
            entropy_windows: &self.functions.entropy_windows,
            row_percentile: &self.functions.row_percentile,
            masked_dynamic_kl: &self.functions.masked_dynamic_kl,
            mask_row_counts: &self.functions.mask_row_counts,
            policy_loss: &self.functions.policy_loss,
            cov_select: &self.functions.cov_select,
            blocks_done: &mut self.blocks_done,
            max_shared_per_block,
        }
    }
}

impl TokenOps<'_> {
    /// Entropy windows and HWE tokens, the twin of `ares_core::entropy`'s window means and
    /// HWE mask (docs/algorithms.md §1): for `[rows, cols]` entropies and 0/1 mask, `out_means[t]` = mean
    /// entropy of the window (`t+1 ..= t+w`, or `t ..= t+w−1` with `includes_self`) where
    /// the window is complete (every position inside the row with mask 1, and `mask[t] = 1`),
    /// else 0; `out_valid[t]` = 1/0. With `hwe`, also the HWE mask against τ, per-row counts
    /// and soft costs.
    pub fn entropy_windows(
        &mut self,
        entropy: &CudaView<'_, f32>,
        mask: &CudaView<'_, f32>,
        spec: WindowSpec,
        hwe: Option<HweOutputs<'_>>,
        out_means: &mut CudaViewMut<'_, f32>,
        out_valid: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const KERNEL: &str = "entropy_windows";
        let WindowSpec {
            cols,
            window_size,
            includes_self,
        } = spec;
        let rows = shape(KERNEL, entropy.len(), cols)?;
        let n = entropy.len();
        check_len(KERNEL, "mask", n, mask.len())?;
        check_len(KERNEL, "out_means", n, out_means.len())?;
        check_len(KERNEL, "out_valid", n, out_valid.len())?;
        let window = i32::try_from(window_size)
            .ok()
            .filter(|&w| w >= 1)
            .ok_or_else(|| {
                bad(
                    KERNEL,
                    format!("window_size = {window_size} must be in 1..=2^31-1"),
                )
            })?;
        let col_blocks = u32::try_from(cols.div_ceil(TOKEN_BLOCK as usize))
            .ok()
            .filter(|&b| b <= 65_535)
            .ok_or_else(|| {
                bad(
                    KERNEL,
                    format!("cols = {cols} exceeds {} ", 65_535 * TOKEN_BLOCK),
                )
            })?;
        let grid = grid_rows(KERNEL, rows)?;
        if let Some(h) = &hwe {
            if !h.tau.is_finite() {
                return Err(bad(KERNEL, format!("tau = {} must be finite", h.tau)));
            }
            if let Some(t) = &h.trigger {
                check_len(KERNEL, "trigger", n, t.len())?;
            }
            check_len(KERNEL, "hwe_mask", n, h.hwe_mask.len())?;
            check_len(KERNEL, "counts", rows, h.counts.len())?;
            check_len(KERNEL, "soft_cost", rows, h.soft_cost.len())?;
        }
        if rows == 0 {
            return Ok(());
        }
        let cols_i64 = cols as i64;
        let includes = i32::from(includes_self);
        let tau = hwe.as_ref().map_or(0.0f32, |h| h.tau);
        let (trigger, mut hwe_out) = match hwe {
            Some(h) => (h.trigger, Some((h.hwe_mask, h.counts, h.soft_cost))),
            None => (None, None),
        };
        if let Some((_, counts, soft_cost)) = hwe_out.as_mut() {
            self.stream
                .memset_zeros(counts)
                .during("clearing HWE counts")?;
            self.stream
                .memset_zeros(soft_cost)
                .during("clearing HWE soft costs")?;
        }
        let mut launch = self.stream.launch_builder(self.entropy_windows);
        launch
            .arg(entropy)
            .arg(mask)
            .arg(&cols_i64)
            .arg(&window)
            .arg(&includes)
            .arg(&tau)
            .arg_or_null(trigger.as_ref())
            .arg(out_means)
            .arg(out_valid);
        match hwe_out.as_mut() {
            Some((hwe_mask, counts, soft_cost)) => launch.arg(hwe_mask).arg(counts).arg(soft_cost),
            None => launch.arg(&NULL).arg(&NULL).arg(&NULL),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, col_blocks, 1),
            block_dim: (TOKEN_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match `entropy_windows`; lengths checked above.
        unsafe { launch.launch(cfg) }.during(format!("launch {KERNEL}"))?;
        Ok(())
    }

    /// Per-row percentile thresholds, the twin of `ares_core::entropy`'s response
    /// thresholds: for each row, the `q`-th percentile (numpy linear interpolation) of the
    /// window means whose `valid` is 1; rows without one get threshold 0 and `has` 0.
    /// Rows are sorted in shared memory, so `cols` is limited by the device (32 768 on
    /// Hopper).
    pub fn row_percentile(
        &mut self,
        means: &CudaView<'_, f32>,
        valid: &CudaView<'_, f32>,
        cols: usize,
        q: f32,
        out_threshold: &mut CudaViewMut<'_, f32>,
        out_has: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const KERNEL: &str = "row_percentile";
        let rows = shape(KERNEL, means.len(), cols)?;
        check_len(KERNEL, "valid", means.len(), valid.len())?;
        check_len(KERNEL, "out_threshold", rows, out_threshold.len())?;
        check_len(KERNEL, "out_has", rows, out_has.len())?;
        if !(0.0..=100.0).contains(&q) {
            return Err(bad(KERNEL, format!("q = {q} must be in [0, 100]")));
        }
        let padded = cols.next_power_of_two();
        let smem = padded * std::mem::size_of::<f32>();
        if smem > self.max_shared_per_block {
            return Err(bad(
                KERNEL,
                format!(
                    "cols = {cols} needs {smem} bytes of shared memory; this device allows {}",
                    self.max_shared_per_block
                ),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        let grid = grid_rows(KERNEL, rows)?;
        let func = self.row_percentile;
        if smem > 48 * 1024 {
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .during("raising row_percentile's shared memory limit")?;
        }
        let (cols_i64, padded_i32) = (cols as i64, padded as i32);
        let mut launch = self.stream.launch_builder(func);
        launch
            .arg(means)
            .arg(valid)
            .arg(&cols_i64)
            .arg(&padded_i32)
            .arg(&q);
        launch.arg(out_threshold).arg(out_has);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: argument order and types match `row_percentile`; lengths checked above.
        unsafe { launch.launch(cfg) }.during(format!("launch {KERNEL}"))?;
        Ok(())
    }

    /// Masked dynamic KL in one launch, the twin of `ares_core::kl::token_kl`: per token
    /// `k_t` by the estimator, weight `β_t = β_row·(hwe_t ? low_ratio : 1)·mask_t`, per-row
    /// weighted sums and mean KL, and the deterministic total.
    pub fn masked_dynamic_kl(
        &mut self,
        inputs: MaskedKlInputs<'_>,
        outputs: MaskedKlOutputs<'_>,
    ) -> Result<()> {
        const KERNEL: &str = "masked_dynamic_kl";
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
        let n = logp.len();
        let rows = shape(KERNEL, n, cols)?;
        check_len(KERNEL, "ref_logp", n, ref_logp.len())?;
        check_len(KERNEL, "mask", n, mask.len())?;
        if let Some(h) = &hwe_mask {
            check_len(KERNEL, "hwe_mask", n, h.len())?;
        }
        check_len(KERNEL, "beta_rows", rows, beta_rows.len())?;
        if !(0.0..=1.0).contains(&low_ratio) {
            return Err(bad(
                KERNEL,
                format!("low_ratio = {low_ratio} must be in [0, 1]"),
            ));
        }
        let MaskedKlOutputs {
            mut kl,
            mut weighted,
            mut row_weighted_sum,
            mut row_mean_kl,
            mut total,
        } = outputs;
        if let Some(k) = &kl {
            check_len(KERNEL, "kl", n, k.len())?;
        }
        if let Some(w) = &weighted {
            check_len(KERNEL, "weighted", n, w.len())?;
        }
        check_len(KERNEL, "row_weighted_sum", rows, row_weighted_sum.len())?;
        check_len(KERNEL, "row_mean_kl", rows, row_mean_kl.len())?;
        check_len(KERNEL, "total", 1, total.len())?;
        if rows == 0 {
            return self
                .stream
                .memset_zeros(&mut total)
                .during("zeroing the KL total");
        }
        let grid = grid_rows(KERNEL, rows)?;
        // The kernel computes values only, so `k1+`/`k3+` run as k1/k3.
        let est: i32 = match estimator.value_estimator() {
            KlEstimator::K1 | KlEstimator::K1Plus => 0,
            KlEstimator::Abs => 1,
            KlEstimator::K2 => 2,
            KlEstimator::K3 | KlEstimator::K3Plus => 3,
        };
        let cols_i64 = cols as i64;
        let mut launch = self.stream.launch_builder(self.masked_dynamic_kl);
        launch
            .arg(&logp)
            .arg(&ref_logp)
            .arg(&mask)
            .arg_or_null(hwe_mask.as_ref())
            .arg(&beta_rows)
            .arg(&low_ratio)
            .arg(&est)
            .arg(&cols_i64)
            .arg_or_null(kl.as_mut())
            .arg_or_null(weighted.as_mut())
            .arg(&mut row_weighted_sum)
            .arg(&mut row_mean_kl)
            .arg(&mut total)
            .arg(&mut *self.blocks_done);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match `masked_dynamic_kl`; lengths checked above.
        unsafe { launch.launch(cfg) }.during(format!("launch {KERNEL}"))?;
        Ok(())
    }
}
