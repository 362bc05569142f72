//! The advantage estimators on device buffers (docs/algorithms.md §5), the twins of
//! ares-core's `advantage` functions: GRPO / Dr.GRPO, RLOO, REINFORCE++(-baseline), REINFORCE
//! Pro Max and batch whitening, over f32 rewards `[B]` and `[B, T]` token tensors.
//!
//! Each call is a few launches of `token_kernels.cu`'s advantage kernels on the device's
//! stream: the per-group scores (summed in core's order: they equal core's bit for bit), the
//! token pass (broadcast, or KL folding + returns-to-go), the whitening statistics and the
//! Pro Max α/β. The group layout is core's [`Groups`] (checked on the host with the
//! estimator's name, as core does, and uploaded as row lists: `B + G + 1` integers). Bad data
//! is flagged by the kernels and read back at the end of the call (which waits for the
//! stream): the error is core's (`NonFinite`, `InvalidMask`, `Empty`, …) in
//! [`Error::Invalid`]. Token values other than broadcast ones differ from core's in the last
//! bits (another order of summation); `tests/emulated.rs` bounds the difference.

use crate::device::Cuda;
use crate::error::{DriverContext, Error, Result};
use crate::launch::{ArgOrNull, bad, check_len, grid, i32_of, i64_of};
use crate::token_ops::{grid_rows, shape};
use ares_core::Groups;
use ares_core::advantage::{GrpoConfig, ProMaxConfig, WHITEN_VAR_FLOOR, WhitenStats, check_gamma};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Threads per block of the per-group score kernel (one thread per group).
const GROUP_BLOCK: u32 = 128;
/// Threads per block of the row kernels.
const ROW_BLOCK: u32 = 256;

/// Status bits of the advantage kernels (`token_kernels.cu`, `ADV_*`).
const BAD_REWARD: u32 = 1;
const BAD_MASK: u32 = 2;
const BAD_KL: u32 = 4;
const EMPTY_ROW: u32 = 8;
const BAD_VALUE: u32 = 16;
const OVERFLOW: u32 = 32;
const EMPTY_MASK: u32 = 64;

/// A per-sample estimator ([`Cuda::sample_advantages`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SampleEstimator {
    /// GRPO, or Dr.GRPO with `norm_adv_by_std = false` (core's `grpo_advantages`).
    Grpo(GrpoConfig<f32>),
    /// RLOO (core's `rloo_advantages`).
    Rloo,
    /// REINFORCE++-baseline's `r − mean_g` (core's `reinforce_baseline_advantages`).
    ReinforceBaseline,
}

/// A token-level estimator ([`Cuda::token_advantages`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenEstimator {
    /// GRPO / Dr.GRPO broadcast over each row (core's `grpo_token_advantages`; no KL).
    Grpo(GrpoConfig<f32>),
    /// RLOO with KL folding, γ = 1 (core's `rloo_token_advantages`).
    Rloo,
    /// REINFORCE++ (core's `reinforce_pp_advantages`): no groups.
    ReinforcePp {
        /// Discount γ in [0, 1].
        gamma: f32,
    },
    /// REINFORCE++-baseline (core's `reinforce_pp_baseline_advantages`).
    ReinforcePpBaseline {
        /// Discount γ in [0, 1].
        gamma: f32,
    },
    /// REINFORCE Pro Max (core's `reinforce_pro_max`).
    ProMax(ProMaxConfig<f32>),
}

impl SampleEstimator {
    /// The estimator's name in core's errors (`GroupTooSmall`).
    pub fn name(&self) -> &'static str {
        match self {
            SampleEstimator::Grpo(c) => c.estimator(),
            SampleEstimator::Rloo => "rloo",
            SampleEstimator::ReinforceBaseline => "reinforce_baseline",
        }
    }
}

impl TokenEstimator {
    /// The estimator's name in core's errors (`GroupTooSmall`).
    pub fn name(&self) -> &'static str {
        match self {
            TokenEstimator::Grpo(c) => c.estimator(),
            TokenEstimator::Rloo => "rloo",
            TokenEstimator::ReinforcePp { .. } => "reinforce_pp",
            TokenEstimator::ReinforcePpBaseline { .. } => "reinforce_baseline",
            TokenEstimator::ProMax(_) => "reinforce_pro_max",
        }
    }
}

/// The token side of [`Cuda::token_advantages`]: `[rows, cols]` 0/1 mask and optional
/// weighted KL `β_t·k_t` folded into the rewards (every position finite).
pub struct DeviceTokens<'a> {
    /// 0/1 response mask.
    pub mask: CudaView<'a, f32>,
    /// `β_t·k_t` per token, or `None`.
    pub weighted_kl: Option<CudaView<'a, f32>>,
    /// Columns (padded response length).
    pub cols: usize,
}

/// The group layout on the device: group g is `rows[offsets[g] .. offsets[g + 1]]`.
struct DeviceGroups {
    rows: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    count: i32,
}

/// What the kernels flagged, as core's error; `Ok` when nothing was.
fn read_status(kernel: &'static str, [index, bits, reward_row]: [u32; 3]) -> Result<()> {
    let index = index as usize;
    let err = if bits & BAD_REWARD != 0 {
        ares_core::Error::NonFinite {
            what: "rewards",
            index: reward_row as usize,
        }
    } else if bits & BAD_VALUE != 0 {
        ares_core::Error::NonFinite {
            what: "values",
            index,
        }
    } else if bits & BAD_MASK != 0 {
        ares_core::Error::InvalidMask {
            what: "mask",
            index,
        }
    } else if bits & BAD_KL != 0 {
        ares_core::Error::NonFinite {
            what: "weighted_kl",
            index,
        }
    } else if bits & EMPTY_ROW != 0 {
        ares_core::Error::Empty {
            what: "mask row (no valid token to carry the sequence reward)",
        }
    } else if bits & EMPTY_MASK != 0 {
        ares_core::Error::Empty { what: "mask" }
    } else if bits & OVERFLOW != 0 {
        ares_core::Error::OutOfRange {
            what: "token advantages",
            value: f64::INFINITY,
            expected: "finite (the inputs are too large: the result overflows)",
        }
    } else {
        return Ok(());
    };
    Err(Error::Invalid {
        kernel,
        source: err,
    })
}

impl Cuda {
    /// `groups` as device row lists, after core's check that every group has ≥ 2 samples;
    /// `None` for an empty batch (nothing to compute, no empty buffer to allocate).
    fn upload_groups(
        &self,
        kernel: &'static str,
        estimator: &'static str,
        groups: &Groups<'_>,
    ) -> Result<Option<DeviceGroups>> {
        groups
            .require_pairs(estimator)
            .map_err(|source| Error::Invalid { kernel, source })?;
        if groups.batch() == 0 {
            return Ok(None);
        }
        i32_of(kernel, "batch", groups.batch())?;
        let mut rows = Vec::with_capacity(groups.batch());
        let mut offsets = Vec::with_capacity(groups.count() + 1);
        offsets.push(0i32);
        for g in 0..groups.count() {
            rows.extend(groups.rows_of(g).map(|r| r as i32));
            offsets.push(rows.len() as i32);
        }
        Ok(Some(DeviceGroups {
            rows: self
                .stream
                .clone_htod(&rows)
                .during("uploading the group rows")?,
            offsets: self
                .stream
                .clone_htod(&offsets)
                .during("uploading the group offsets")?,
            count: i32_of(kernel, "groups", groups.count())?,
        }))
    }

    /// Queues `group_scores`: one score per row of `rewards` into `scores` (kind as in the
    /// kernel), and the uniform flags of Pro Max.
    #[allow(clippy::too_many_arguments)]
    fn group_scores(
        &self,
        groups: &DeviceGroups,
        rewards: &CudaView<'_, f32>,
        kind: i32,
        eps: f32,
        uniform_std: f32,
        scores: &mut CudaViewMut<'_, f32>,
        uniform: Option<&mut CudaSlice<u8>>,
        status: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let mut launch = self.stream.launch_builder(&self.functions.group_scores);
        launch
            .arg(rewards)
            .arg(&groups.rows)
            .arg(&groups.offsets)
            .arg(&groups.count)
            .arg(&kind)
            .arg(&eps)
            .arg(&uniform_std)
            .arg(scores)
            .arg_or_null(uniform)
            .arg(status);
        let cfg = LaunchConfig {
            grid_dim: ((groups.count as u32).div_ceil(GROUP_BLOCK).max(1), 1, 1),
            block_dim: (GROUP_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match `group_scores`; the caller checked lengths.
        unsafe { launch.launch(cfg) }.during("launch group_scores")?;
        Ok(())
    }

    /// A cleared status: `[first bad token, bits, first bad reward row]` (indices start at
    /// `u32::MAX`).
    fn new_status(&self) -> Result<CudaSlice<u32>> {
        self.stream
            .clone_htod(&[u32::MAX, 0, u32::MAX])
            .during("allocating the advantage status")
    }

    /// Waits for the stream and turns the status into core's error.
    fn finish_status(&self, kernel: &'static str, status: &CudaSlice<u32>) -> Result<()> {
        let s = self
            .stream
            .clone_dtoh(status)
            .during(format!("reading the status of {kernel}"))?;
        read_status(kernel, [s[0], s[1], s[2]])
    }

    /// Per-sample advantages `[B]` from rewards `[B]` (GRPO, Dr.GRPO, RLOO,
    /// REINFORCE++-baseline), equal to core's bit for bit. Waits for the stream (it reads the
    /// status).
    ///
    /// # Errors
    /// Core's errors in [`Error::Invalid`]: a group of one, a non-finite reward, a bad
    /// ε; lengths in [`Error::BadArgument`].
    pub fn sample_advantages(
        &mut self,
        groups: &Groups<'_>,
        rewards: &CudaView<'_, f32>,
        estimator: SampleEstimator,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const KERNEL: &str = "group_scores";
        let (kind, eps) = match estimator {
            SampleEstimator::Grpo(c) => {
                c.check().map_err(|source| Error::Invalid {
                    kernel: KERNEL,
                    source,
                })?;
                (grpo_kind(&c), c.epsilon)
            }
            SampleEstimator::Rloo => (2, 0.0),
            SampleEstimator::ReinforceBaseline => (1, 0.0),
        };
        check_len(KERNEL, "rewards", groups.batch(), rewards.len())?;
        check_len(KERNEL, "out", groups.batch(), out.len())?;
        let Some(layout) = self.upload_groups(KERNEL, estimator.name(), groups)? else {
            return Ok(());
        };
        let mut status = self.new_status()?;
        self.group_scores(&layout, rewards, kind, eps, 0.0, out, None, &mut status)?;
        self.finish_status(KERNEL, &status)
    }

    /// Token advantages `[rows, cols]` from rewards `[rows]` by `estimator` (groups: any
    /// layout of core's, `None` only for REINFORCE++), the whitening statistics for the
    /// REINFORCE++ pair. Waits for the stream (it reads the status).
    ///
    /// # Errors
    /// Core's errors in [`Error::Invalid`] (a group of one, a non-finite reward or KL, a mask
    /// entry not 0/1, a row without valid token where the reward needs one, γ or a Pro Max
    /// option out of range); lengths or a missing layout in [`Error::BadArgument`].
    pub fn token_advantages(
        &mut self,
        groups: Option<&Groups<'_>>,
        rewards: &CudaView<'_, f32>,
        tokens: DeviceTokens<'_>,
        estimator: TokenEstimator,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<Option<WhitenStats<f32>>> {
        const KERNEL: &str = "token_returns";
        let rows = rewards.len();
        let cols = tokens.cols;
        if cols == 0 {
            return Err(bad(KERNEL, "`cols` must be >= 1".into()));
        }
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| bad(KERNEL, format!("{rows} × {cols} tokens overflow")))?;
        check_len(KERNEL, "mask", n, tokens.mask.len())?;
        if let Some(k) = &tokens.weighted_kl {
            check_len(KERNEL, "weighted_kl", n, k.len())?;
        }
        check_len(KERNEL, "out", n, out.len())?;
        let invalid = |source| Error::Invalid {
            kernel: KERNEL,
            source,
        };
        // kind of `group_scores`, its ε / uniform threshold, γ, mode of `token_returns`
        let (kind, eps, uniform_std, gamma, mode) = match estimator {
            TokenEstimator::Grpo(c) => {
                c.check().map_err(invalid)?;
                if tokens.weighted_kl.is_some() {
                    return Err(bad(
                        KERNEL,
                        "GRPO keeps KL out of the reward: fold it into the rewards first".into(),
                    ));
                }
                (grpo_kind(&c), c.epsilon, 0.0, 1.0, 0)
            }
            TokenEstimator::Rloo => (2, 0.0, 0.0, 1.0, 1),
            TokenEstimator::ReinforcePp { gamma }
            | TokenEstimator::ReinforcePpBaseline { gamma } => {
                check_gamma(gamma).map_err(invalid)?;
                (1, 0.0, 0.0, gamma, 1)
            }
            TokenEstimator::ProMax(c) => {
                c.check().map_err(invalid)?;
                (
                    if c.uniform_scale { 3 } else { 2 },
                    0.0,
                    c.uniform_std,
                    1.0,
                    1,
                )
            }
        };
        let layout = match (estimator, groups) {
            (TokenEstimator::ReinforcePp { .. }, _) => None,
            (_, Some(g)) => {
                check_len(KERNEL, "rewards", g.batch(), rows)?;
                self.upload_groups(KERNEL, estimator.name(), g)?
            }
            (_, None) => {
                return Err(bad(
                    KERNEL,
                    format!("`{}` needs the group layout", estimator.name()),
                ));
            }
        };
        let whiten = matches!(
            estimator,
            TokenEstimator::ReinforcePp { .. } | TokenEstimator::ReinforcePpBaseline { .. }
        );
        if rows == 0 {
            // core's whitening of an empty batch has no valid token
            return match whiten {
                true => Err(invalid(ares_core::Error::Empty { what: "mask" })),
                false => Ok(None),
            };
        }
        let grid = grid_rows(KERNEL, rows)?;
        let mut status = self.new_status()?;
        let mut scores = self.stream.alloc_zeros::<f32>(rows).during("scores")?;
        let mut uniform = match (&layout, estimator) {
            (Some(l), TokenEstimator::ProMax(c)) if c.uniform_scale => Some(
                self.stream
                    .alloc_zeros::<u8>(l.count as usize)
                    .during("uniform flags")?,
            ),
            _ => None,
        };
        match &layout {
            Some(l) => self.group_scores(
                l,
                rewards,
                kind,
                eps,
                uniform_std,
                &mut scores.as_view_mut(),
                uniform.as_mut(),
                &mut status,
            )?,
            None => self
                .stream
                .memcpy_dtod(rewards, &mut scores)
                .during("copying the rewards")?,
        }
        let mut moments = if whiten {
            Some(
                self.stream
                    .alloc_zeros::<f32>(3 * rows)
                    .during("row moments")?,
            )
        } else {
            None
        };
        let cols_i64 = i64_of(KERNEL, "cols", cols)?;
        let check_scores = i32::from(layout.is_none());
        {
            let mut launch = self.stream.launch_builder(&self.functions.token_returns);
            launch
                .arg(&scores)
                .arg(&tokens.mask)
                .arg_or_null(tokens.weighted_kl.as_ref())
                .arg(&cols_i64)
                .arg(&gamma)
                .arg(&mode)
                .arg(&check_scores)
                .arg(&mut *out)
                .arg_or_null(moments.as_mut())
                .arg(&mut status);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (ROW_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match `token_returns`; lengths checked above.
            unsafe { launch.launch(cfg) }.during("launch token_returns")?;
        }
        let stats = match &moments {
            Some(m) => Some(self.whiten_in_place(out, &tokens.mask, m, rows, &mut status)?),
            None => None,
        };
        if let (Some(l), TokenEstimator::ProMax(c)) = (&layout, estimator) {
            let mut launch = self
                .stream
                .launch_builder(&self.functions.pro_max_normalize);
            launch
                .arg(&mut *out)
                .arg(&cols_i64)
                .arg(&l.rows)
                .arg(&l.offsets)
                .arg_or_null(uniform.as_ref())
                .arg(&c.eps)
                .arg(&c.max_scale)
                .arg(&c.product_cap);
            let cfg = LaunchConfig {
                grid_dim: (l.count as u32, 1, 1),
                block_dim: (ROW_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match `pro_max_normalize`; `out` is rows ×
            // cols and every row index of the layout is < rows.
            unsafe { launch.launch(cfg) }.during("launch pro_max_normalize")?;
        }
        self.finish_status(KERNEL, &status)?;
        stats.map(|s| self.read_stats(&s)).transpose()
    }

    /// Whitens `values` `[rows, cols]` in place over the valid tokens of `mask` (core's
    /// `masked_whiten`: `A ← m·(A − μ)/√max(var, 1e−8)`), returning (μ, var, valid tokens).
    /// Waits for the stream. On error `values` is unchanged.
    ///
    /// # Errors
    /// A non-finite value, a mask entry not 0/1, no valid token or statistics that overflow
    /// (core's errors, in [`Error::Invalid`]); lengths in [`Error::BadArgument`].
    pub fn masked_whiten(
        &mut self,
        values: &mut CudaViewMut<'_, f32>,
        mask: &CudaView<'_, f32>,
        cols: usize,
    ) -> Result<WhitenStats<f32>> {
        const KERNEL: &str = "masked_row_moments";
        let rows = shape(KERNEL, values.len(), cols)?;
        check_len(KERNEL, "mask", values.len(), mask.len())?;
        if rows == 0 {
            return Err(Error::Invalid {
                kernel: KERNEL,
                source: ares_core::Error::Empty { what: "mask" },
            });
        }
        let grid = grid_rows(KERNEL, rows)?;
        let mut status = self.new_status()?;
        let mut moments = self
            .stream
            .alloc_zeros::<f32>(3 * rows)
            .during("row moments")?;
        let cols_i64 = i64_of(KERNEL, "cols", cols)?;
        {
            let mut launch = self
                .stream
                .launch_builder(&self.functions.masked_row_moments);
            launch
                .arg(&mut *values)
                .arg(mask)
                .arg(&cols_i64)
                .arg(&mut moments)
                .arg(&mut status);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (ROW_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match `masked_row_moments`; lengths checked.
            unsafe { launch.launch(cfg) }.during("launch masked_row_moments")?;
        }
        // `whiten_stats` applies nothing after a flag: on error the values stay as they were
        let stats = self.whiten_in_place(values, mask, &moments, rows, &mut status)?;
        self.finish_status(KERNEL, &status)?;
        self.read_stats(&stats)
    }

    /// Queues `whiten_stats` and `whiten_apply` over `values` from per-row `moments`.
    fn whiten_in_place(
        &self,
        values: &mut CudaViewMut<'_, f32>,
        mask: &CudaView<'_, f32>,
        moments: &CudaSlice<f32>,
        rows: usize,
        status: &mut CudaSlice<u32>,
    ) -> Result<CudaSlice<f32>> {
        const KERNEL: &str = "whiten_stats";
        let mut stats = self
            .stream
            .alloc_zeros::<f32>(4)
            .during("whitening stats")?;
        let rows_i64 = i64_of(KERNEL, "rows", rows)?;
        let floor = WHITEN_VAR_FLOOR as f32;
        {
            let mut launch = self.stream.launch_builder(&self.functions.whiten_stats);
            launch
                .arg(moments)
                .arg(&rows_i64)
                .arg(&floor)
                .arg(&mut stats)
                .arg(status);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match `whiten_stats` (256 threads, as its
            // shared arrays); `moments` holds 3 · rows values.
            unsafe { launch.launch(cfg) }.during("launch whiten_stats")?;
        }
        let n = i64_of(KERNEL, "tokens", values.len())?;
        let blocks = grid(values.len().div_ceil(ROW_BLOCK as usize));
        let mut launch = self.stream.launch_builder(&self.functions.whiten_apply);
        launch.arg(&mut *values).arg(mask).arg(&n).arg(&stats);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match `whiten_apply`; `mask` has n elements.
        unsafe { launch.launch(cfg) }.during("launch whiten_apply")?;
        Ok(stats)
    }

    /// The whitening statistics `whiten_in_place` left on the device.
    fn read_stats(&self, stats: &CudaSlice<f32>) -> Result<WhitenStats<f32>> {
        let s = self
            .stream
            .clone_dtoh(stats)
            .during("reading the whitening stats")?;
        Ok(WhitenStats {
            mean: s[0],
            var: s[1],
            valid_tokens: s[3] as usize,
        })
    }
}

/// `group_scores`' kind of a GRPO configuration: 0 divides by the std, 1 is Dr.GRPO.
fn grpo_kind(c: &GrpoConfig<f32>) -> i32 {
    i32::from(!c.norm_adv_by_std)
}
