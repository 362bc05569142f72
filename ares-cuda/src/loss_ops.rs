//! The actor's loss on the device (docs/algorithms.md §4, §6, §16): `token_kernels.cu`'s
//! `mask_row_counts` and `policy_loss`, the twin of [`actor_loss`] for its policy losses
//! [`policy_loss`], [`cispo_loss`] and [`gspo_loss`] with the rollout importance correction,
//! the forking-token mask ([`mask_token_gradient`]), the token-level KL term ([`token_kl`]
//! aggregated by [`aggregate_term`]) and the entropy bonus — one loss and one `∂L/∂logπ` per
//! token, in two launches, with nothing read back until the caller wants the numbers
//! ([`LossReport::read`]).
//!
//! [`clip_cov_loss`] and [`kl_cov_loss`] choose their tokens by covariance over the whole
//! micro-batch (a seeded draw, a top-k): a third launch between the two, `cov_select`, one
//! block that finds the k-th smallest selection key by radix selection and marks the chosen
//! tokens in a scratch tensor the loss kernel reads. The means are summed in f64 as core sums
//! them, so the same tokens are chosen as on the CPU.
//!
//! [`actor_loss`]: ares_core::loss::actor_loss
//! [`policy_loss`]: ares_core::loss::policy_loss
//! [`cispo_loss`]: ares_core::loss::cispo_loss
//! [`gspo_loss`]: ares_core::loss::gspo_loss
//! [`clip_cov_loss`]: ares_core::loss::clip_cov_loss
//! [`kl_cov_loss`]: ares_core::loss::kl_cov_loss
//! [`mask_token_gradient`]: ares_core::forking::mask_token_gradient
//! [`token_kl`]: ares_core::kl::token_kl
//! [`aggregate_term`]: ares_core::loss::aggregate_term

use crate::error::{DriverContext, Result};
use crate::launch::{ArgOrNull, bad, check_len, i64_of};
use crate::token_ops::TokenOps;
use ares_core::kl::KlEstimator;
use ares_core::loss::{
    ClipCovParams, GspoLevel, IsMode, KlCovParams, LossAggMode, PolicyLossConfig, PolicyLossOutput,
};
use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Statistics per row and in the totals: policy loss, KL term, `agg(H)`, clipped tokens,
/// dual-clipped tokens, `Σ −clamp(logπ − logπ_old)`, `Σ w`, tokens whose importance weight
/// changed, tokens chosen by covariance, valid tokens (`token_kernels.cu`'s `LOSS_STATS`).
pub const LOSS_STATS: usize = 10;

/// Words of a loss report: the [`LOSS_STATS`] totals, then the two status words' bits
/// ([`LossOutputs::totals`] of this length: one read brings both back).
pub const LOSS_REPORT: usize = LOSS_STATS + 2;

/// Threads per block of the loss kernels (one block per row; `cov_select`: one block).
const LOSS_BLOCK: u32 = 512;

/// The policy losses with a kernel (`worker.actor.policy_loss`): all of core's.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum LossKind {
    /// PPO clip / dual clip ([`ares_core::loss::policy_loss`]).
    #[default]
    Ppo,
    /// CISPO ([`ares_core::loss::cispo_loss`]).
    Cispo,
    /// GSPO at a level ([`ares_core::loss::gspo_loss`]).
    Gspo(GspoLevel),
    /// Clip-Cov ([`ares_core::loss::clip_cov_loss`]; its `seed` picks the tokens).
    ClipCov(ClipCovParams<f32>),
    /// KL-Cov ([`ares_core::loss::kl_cov_loss`]).
    KlCov(KlCovParams<f32>),
}

impl LossKind {
    /// Whether the loss chooses tokens by covariance (a `cov_select` launch and
    /// [`LossOutputs::selected`]).
    pub fn selects_tokens(&self) -> bool {
        matches!(self, LossKind::ClipCov(_) | LossKind::KlCov(_))
    }
}

/// The KL loss term `agg(β_t·k_t)`: the estimator and the weight ratio of HWE tokens
/// (docs/algorithms.md §4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlLossSpec {
    /// The per-token estimator, with its own gradient (`k1+`, `k3+`: k2's).
    pub estimator: KlEstimator,
    /// `β_t = β_row · low_ratio` on HWE tokens, in [0, 1].
    pub low_ratio: f32,
}

/// What the loss computes: the policy loss and its parameters, the optional KL term and
/// entropy bonus, and the micro-batch's share `scale` of its mini-batch (the gradients are
/// multiplied by it; the statistics are not).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSpec {
    /// Which policy loss.
    pub kind: LossKind,
    /// Clip, aggregation and importance correction.
    pub config: PolicyLossConfig<f32>,
    /// The KL term (needs `logp_ref` and `beta_rows`).
    pub kl: Option<KlLossSpec>,
    /// The entropy bonus `−c·agg(H)` (needs `entropy` and `entropy_grad`).
    pub entropy_coef: Option<f32>,
    /// Multiplies `grad` and `entropy_grad`.
    pub scale: f32,
}

/// The loss kernel's scalar arguments, in its order (after the tensors' shape): the
/// encoding of a [`LossSpec`] for one `[rows, cols]` batch. `#[repr(C)]` so a CPU run of the
/// kernel source (`tests/emulated.rs`) takes the very same values.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalars {
    /// Rows.
    pub rows: i64,
    /// Columns.
    pub cols: i64,
    /// 0 PPO, 1 CISPO, 2 GSPO, 3 GSPO-token, 4 Clip-Cov, 5 KL-Cov.
    pub kind: i32,
    /// ε_low.
    pub clip_lo: f32,
    /// ε_high.
    pub clip_hi: f32,
    /// Dual-clip c (0 = off).
    pub clip_c: f32,
    /// 0 none, 1 tis, 2 icepop, 3 reinforce_pro.
    pub is_mode: i32,
    /// Lower importance-weight threshold.
    pub is_low: f32,
    /// Upper importance-weight threshold.
    pub is_high: f32,
    /// [`LossAggMode`] in declaration order.
    pub agg: i32,
    /// [`KlEstimator`] in declaration order (unused without a KL term).
    pub kl_est: i32,
    /// HWE weight ratio.
    pub low_ratio: f32,
    /// Entropy bonus coefficient (unused without one).
    pub entropy_coef: f32,
    /// Gradient scale.
    pub scale: f32,
    /// KL-Cov's `ppo_kl_coef` (unused by the other losses).
    pub cov_coef: f32,
}

/// `cov_select`'s scalar arguments, in its order (`#[repr(C)]` for the CPU run of the kernel
/// source, as [`LossScalars`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CovScalars {
    /// Tokens (`rows·cols` < 2^32).
    pub n: i64,
    /// 4 Clip-Cov, 5 KL-Cov.
    pub kind: i32,
    /// ε_low (Clip-Cov's candidates are the tokens PPO's clip leaves unclipped).
    pub clip_lo: f32,
    /// ε_high.
    pub clip_hi: f32,
    /// Clip-Cov's `lb` (candidates have `lb < cov < ub`).
    pub lb: f32,
    /// Clip-Cov's `ub`.
    pub ub: f32,
    /// Clip-Cov's selection seed.
    pub seed: u64,
    /// The budget's fraction, widened exactly from f32: `k = max(⌊ratio·N⌋, 1)`.
    pub ratio: f64,
}

impl LossSpec {
    /// Errors unless every parameter is in range (as core's checks: clip, correction,
    /// `low_ratio` ∈ [0, 1], finite `scale` and coefficient).
    ///
    /// # Errors
    /// [`crate::Error::BadArgument`] naming the parameter and value.
    pub fn validate(&self) -> Result<()> {
        const KERNEL: &str = "policy_loss";
        let core = |e: ares_core::Error| bad(KERNEL, e.to_string());
        self.config.clip.validate().map_err(core)?;
        self.config.is_correction.validate().map_err(core)?;
        match self.kind {
            LossKind::ClipCov(p) => p.validate().map_err(core)?,
            LossKind::KlCov(p) => p.validate().map_err(core)?,
            LossKind::Ppo | LossKind::Cispo | LossKind::Gspo(_) => {}
        }
        if let Some(kl) = self.kl
            && !(0.0..=1.0).contains(&kl.low_ratio)
        {
            return Err(bad(
                KERNEL,
                format!("low_ratio = {} must be in [0, 1]", kl.low_ratio),
            ));
        }
        if !self.scale.is_finite() {
            return Err(bad(KERNEL, format!("scale = {} is not finite", self.scale)));
        }
        if let Some(c) = self.entropy_coef.filter(|c| !c.is_finite()) {
            return Err(bad(KERNEL, format!("entropy_coef = {c} is not finite")));
        }
        Ok(())
    }

    /// The kernel's scalars for a `[rows, cols]` batch.
    pub fn scalars(&self, rows: i64, cols: i64) -> LossScalars {
        let clip = self.config.clip;
        let is = self.config.is_correction;
        LossScalars {
            rows,
            cols,
            kind: match self.kind {
                LossKind::Ppo => 0,
                LossKind::Cispo => 1,
                LossKind::Gspo(GspoLevel::Sequence) => 2,
                LossKind::Gspo(GspoLevel::Token) => 3,
                LossKind::ClipCov(_) => 4,
                LossKind::KlCov(_) => 5,
            },
            clip_lo: clip.clip_ratio_low,
            clip_hi: clip.clip_ratio_high,
            clip_c: clip.clip_ratio_c,
            is_mode: match is.mode {
                IsMode::None => 0,
                IsMode::Tis => 1,
                IsMode::Icepop => 2,
                IsMode::ReinforcePro => 3,
            },
            is_low: is.low,
            is_high: is.high,
            agg: match self.config.agg {
                LossAggMode::TokenMean => 0,
                LossAggMode::TokenSum => 1,
                LossAggMode::SeqMeanTokenSum => 2,
                LossAggMode::SeqMeanTokenMean => 3,
                LossAggMode::SeqMeanTokenSumNorm => 4,
            },
            kl_est: match self.kl.map(|k| k.estimator) {
                None | Some(KlEstimator::K1) => 0,
                Some(KlEstimator::Abs) => 1,
                Some(KlEstimator::K2) => 2,
                Some(KlEstimator::K3) => 3,
                Some(KlEstimator::K1Plus) => 4,
                Some(KlEstimator::K3Plus) => 5,
            },
            low_ratio: self.kl.map_or(1.0, |k| k.low_ratio),
            entropy_coef: self.entropy_coef.unwrap_or(0.0),
            scale: self.scale,
            cov_coef: match self.kind {
                LossKind::KlCov(p) => p.coef,
                _ => 0.0,
            },
        }
    }

    /// `cov_select`'s scalars for `n` tokens (`None` for a loss that chooses none).
    pub fn cov_scalars(&self, n: i64) -> Option<CovScalars> {
        let clip = self.config.clip;
        let (kind, lb, ub, seed, ratio) = match self.kind {
            LossKind::ClipCov(p) => (4, p.lb, p.ub, p.seed, p.ratio),
            LossKind::KlCov(p) => (5, 0.0, 0.0, 0, p.ratio),
            LossKind::Ppo | LossKind::Cispo | LossKind::Gspo(_) => return None,
        };
        Some(CovScalars {
            n,
            kind,
            clip_lo: clip.clip_ratio_low,
            clip_hi: clip.clip_ratio_high,
            lb,
            ub,
            seed,
            ratio: f64::from(ratio),
        })
    }
}

/// The token tensors of [`TokenOps::policy_loss`], all `[rows, cols]` but `beta_rows`
/// (`[rows]`).
pub struct LossInputs<'a> {
    /// logπ under the current weights.
    pub logp: CudaView<'a, f32>,
    /// logπ_old.
    pub logp_old: CudaView<'a, f32>,
    /// Token advantages.
    pub advantages: CudaView<'a, f32>,
    /// 0/1 response mask.
    pub mask: CudaView<'a, f32>,
    /// The sampler's logπ (required unless the correction is `none`).
    pub logp_rollout: Option<CudaView<'a, f32>>,
    /// Forking-token mask: 0/1, the policy gradient kept where 1.
    pub keep: Option<CudaView<'a, f32>>,
    /// logπ_ref (required with a KL term).
    pub logp_ref: Option<CudaView<'a, f32>>,
    /// β per row (required with a KL term).
    pub beta_rows: Option<CudaView<'a, f32>>,
    /// 0/1 HWE mask of the dynamic KL (optional with a KL term).
    pub hwe: Option<CudaView<'a, f32>>,
    /// Token entropies (required with an entropy bonus).
    pub entropy: Option<CudaView<'a, f32>>,
    /// Columns.
    pub cols: usize,
}

/// The outputs (and scratch) of [`TokenOps::policy_loss`].
pub struct LossOutputs<'a> {
    /// `scale · ∂L/∂logπ` `[rows, cols]`, 0 on padding.
    pub grad: CudaViewMut<'a, f32>,
    /// `scale · ∂L/∂H` `[rows, cols]` (required with an entropy bonus).
    pub entropy_grad: Option<CudaViewMut<'a, f32>>,
    /// Scratch `[rows]`: valid tokens per row.
    pub row_counts: CudaViewMut<'a, f32>,
    /// `[rows, LOSS_STATS]` per-row statistics.
    pub row_stats: CudaViewMut<'a, f32>,
    /// `[LOSS_STATS]` totals over rows, summed in row order: read them with
    /// [`LossReport::read`]; or `[LOSS_REPORT]`, the status words' bits after them: read
    /// them with [`LossReport::from_report`].
    pub totals: CudaViewMut<'a, f32>,
    /// `[2]` status words: the first bad token's flat index and what was bad.
    pub status: CudaViewMut<'a, u32>,
    /// Scratch `[rows, cols]` for Clip-Cov and KL-Cov (required by them): 1 where a token
    /// was chosen, else 0.
    pub selected: Option<CudaViewMut<'a, f32>>,
}

/// Status bits of the loss kernel, with the input each names.
const STATUS_BITS: [(u32, &str); 10] = [
    (1, "logp"),
    (2, "logp_old"),
    (4, "advantages"),
    (8, "logp_rollout"),
    (16, "logp_ref"),
    (32, "entropy"),
    (64, "mask"),
    (128, "keep"),
    (256, "hwe_mask"),
    (512, "kl_coef (β per row)"),
];

/// A loss's values read back from [`LossOutputs::totals`] and [`LossOutputs::status`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossReport {
    /// The policy loss and its metrics, as core's functions return them.
    pub policy: PolicyLossOutput<f32>,
    /// The KL term `agg(β_t·k_t)` (0 without one).
    pub kl_loss: f32,
    /// `agg(H)` (0 without an entropy bonus).
    pub entropy: f32,
}

impl LossReport {
    /// The report of `totals` and `status` as downloaded, or core's error for what the
    /// kernel flagged: a mask, keep or HWE value not 0/1 ([`ares_core::Error::InvalidMask`]),
    /// a negative or non-finite β ([`ares_core::Error::OutOfRange`]), a non-finite input at a
    /// valid token ([`ares_core::Error::NonFinite`], naming the input and the first flagged
    /// flat index), no valid token ([`ares_core::Error::Empty`]).
    ///
    /// # Errors
    /// As above.
    pub fn read(
        totals: &[f32; LOSS_STATS],
        status: [u32; 2],
    ) -> std::result::Result<Self, ares_core::Error> {
        let [index, bits] = status;
        let index = index as usize;
        let flagged = |bit: u32| bits & bit != 0;
        let name = |mask: u32| {
            STATUS_BITS
                .iter()
                .find(|(b, _)| mask & b != 0)
                .map_or("input", |(_, n)| *n)
        };
        if bits & (64 | 128 | 256) != 0 {
            return Err(ares_core::Error::InvalidMask {
                what: name(bits & (64 | 128 | 256)),
                index,
            });
        }
        if flagged(512) {
            return Err(ares_core::Error::OutOfRange {
                what: "kl_coef (β per row)",
                value: f64::NAN,
                expected: "finite and >= 0",
            });
        }
        if bits != 0 {
            return Err(ares_core::Error::NonFinite {
                what: name(bits),
                index,
            });
        }
        let valid = totals[9];
        if valid < 1.0 {
            return Err(ares_core::Error::Empty { what: "mask" });
        }
        let inv = 1.0 / valid;
        Ok(LossReport {
            policy: PolicyLossOutput {
                loss: totals[0],
                clipfrac: totals[3] * inv,
                clipfrac_lower: totals[4] * inv,
                approx_kl: totals[5] * inv,
                is_weight_mean: totals[6] * inv,
                is_changed_frac: totals[7] * inv,
                selected_frac: totals[8] * inv,
                valid_tokens: valid as usize,
            },
            kl_loss: totals[1],
            entropy: totals[2],
        })
    }

    /// [`LossReport::read`] of a report read back whole ([`LOSS_REPORT`] words: the totals,
    /// then the status words' bits).
    ///
    /// # Errors
    /// As [`LossReport::read`].
    pub fn from_report(report: &[f32; LOSS_REPORT]) -> std::result::Result<Self, ares_core::Error> {
        let mut totals = [0.0f32; LOSS_STATS];
        totals.copy_from_slice(&report[..LOSS_STATS]);
        let status = [
            report[LOSS_STATS].to_bits(),
            report[LOSS_STATS + 1].to_bits(),
        ];
        Self::read(&totals, status)
    }
}

impl TokenOps<'_> {
    /// The actor's loss of one `[rows, cols]` micro-batch (see the module docs), queued on
    /// the stream: `grad`, `entropy_grad`, the per-row statistics and their totals, and the
    /// status words; [`LossReport::read`] turns the downloaded totals and status into the
    /// loss and its metrics, or core's error. A report the caller refuses — a flagged input,
    /// or a loss, KL or entropy total that is not finite — comes with `grad` and
    /// `entropy_grad` all 0, so a backward queued before the report is read changes nothing.
    ///
    /// # Errors
    /// Lengths that do not match, a missing tensor the spec needs, parameters out of range
    /// ([`LossSpec::validate`]), a failed launch.
    pub fn policy_loss(
        &mut self,
        spec: &LossSpec,
        inputs: LossInputs<'_>,
        outputs: LossOutputs<'_>,
    ) -> Result<()> {
        const KERNEL: &str = "policy_loss";
        spec.validate()?;
        let LossInputs {
            logp,
            logp_old,
            advantages,
            mask,
            logp_rollout,
            keep,
            logp_ref,
            beta_rows,
            hwe,
            entropy,
            cols,
        } = inputs;
        let n = logp.len();
        if cols == 0 {
            return Err(bad(KERNEL, "`cols` must be >= 1".into()));
        }
        if !n.is_multiple_of(cols) {
            return Err(bad(
                KERNEL,
                format!("{n} elements are not a multiple of cols = {cols}"),
            ));
        }
        let rows = n / cols;
        for (what, v) in [
            ("logp_old", Some(&logp_old)),
            ("advantages", Some(&advantages)),
            ("mask", Some(&mask)),
            ("logp_rollout", logp_rollout.as_ref()),
            ("keep", keep.as_ref()),
            ("logp_ref", logp_ref.as_ref()),
            ("hwe_mask", hwe.as_ref()),
            ("entropy", entropy.as_ref()),
        ] {
            if let Some(v) = v {
                check_len(KERNEL, what, n, v.len())?;
            }
        }
        if let Some(b) = &beta_rows {
            check_len(KERNEL, "beta_rows", rows, b.len())?;
        }
        let need = |what: &str, present: bool, why: &str| {
            if present {
                Ok(())
            } else {
                Err(bad(KERNEL, format!("`{what}` is required {why}")))
            }
        };
        if spec.config.is_correction.mode != IsMode::None {
            need(
                "logp_rollout",
                logp_rollout.is_some(),
                "by the importance correction",
            )?;
        }
        if spec.kl.is_some() {
            need("logp_ref", logp_ref.is_some(), "by the KL term")?;
            need("beta_rows", beta_rows.is_some(), "by the KL term")?;
        }
        let LossOutputs {
            mut grad,
            mut entropy_grad,
            mut row_counts,
            mut row_stats,
            mut totals,
            mut status,
            mut selected,
        } = outputs;
        if spec.entropy_coef.is_some() {
            need("entropy", entropy.is_some(), "by the entropy bonus")?;
            need(
                "entropy_grad",
                entropy_grad.is_some(),
                "by the entropy bonus",
            )?;
        }
        check_len(KERNEL, "grad", n, grad.len())?;
        if let Some(e) = &entropy_grad {
            check_len(KERNEL, "entropy_grad", n, e.len())?;
        }
        check_len(KERNEL, "row_counts", rows, row_counts.len())?;
        check_len(KERNEL, "row_stats", rows * LOSS_STATS, row_stats.len())?;
        let report = i32::from(totals.len() == LOSS_REPORT);
        if report == 0 {
            check_len(KERNEL, "totals", LOSS_STATS, totals.len())?;
        }
        check_len(KERNEL, "status", 2, status.len())?;
        let cov = spec.cov_scalars(i64_of(KERNEL, "tokens", n)?);
        if cov.is_some() {
            match &selected {
                Some(v) => check_len(KERNEL, "selected", n, v.len())?,
                None => need("selected", false, "by Clip-Cov and KL-Cov")?,
            }
            if u32::try_from(n).is_err() {
                return Err(bad(
                    KERNEL,
                    format!(
                        "{n} tokens: Clip-Cov and KL-Cov choose among at most 2^32 - 1 tokens \
                         of a micro-batch"
                    ),
                ));
            }
        }
        if rows == 0 {
            // no row: an empty mask, which the report names
            self.stream
                .memset_zeros(&mut totals)
                .during("zeroing the loss totals")?;
            return self
                .stream
                .memset_zeros(&mut status)
                .during("zeroing the loss status");
        }
        let grid = u32::try_from(rows)
            .ok()
            .filter(|&r| r <= i32::MAX as u32)
            .ok_or_else(|| {
                bad(
                    KERNEL,
                    format!("{rows} rows exceed the grid limit 2^31 - 1"),
                )
            })?;
        let s = spec.scalars(i64_of(KERNEL, "rows", rows)?, i64_of(KERNEL, "cols", cols)?);
        // the KL and entropy tensors are passed only when the spec uses them
        let (logp_ref, beta_rows, hwe) = match spec.kl {
            Some(_) => (logp_ref, beta_rows, hwe),
            None => (None, None, None),
        };
        let (entropy, entropy_grad_arg) = match spec.entropy_coef {
            Some(_) => (entropy, entropy_grad.as_mut()),
            None => (None, None),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (LOSS_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(self.mask_row_counts);
        launch
            .arg(&mask)
            .arg(&s.cols)
            .arg(&mut row_counts)
            .arg(&mut status);
        // SAFETY: argument order and types match `mask_row_counts`; lengths checked above.
        unsafe { launch.launch(cfg) }.during("launch mask_row_counts")?;
        if let (Some(c), Some(sel)) = (cov, selected.as_mut()) {
            let mut launch = self.stream.launch_builder(self.cov_select);
            launch
                .arg(&logp)
                .arg(&logp_old)
                .arg(&advantages)
                .arg(&mask)
                .arg(&c.n)
                .arg(&c.kind)
                .arg(&c.clip_lo)
                .arg(&c.clip_hi)
                .arg(&c.lb)
                .arg(&c.ub)
                .arg(&c.seed)
                .arg(&c.ratio)
                .arg(&mut *sel);
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (LOSS_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match `cov_select`; `selected` holds the n
            // tokens (checked above), n < 2^32.
            unsafe { launch.launch(one) }.during("launch cov_select")?;
        }
        let mut launch = self.stream.launch_builder(self.policy_loss);
        launch
            .arg(&logp)
            .arg(&logp_old)
            .arg(&advantages)
            .arg(&mask)
            .arg_or_null(match spec.config.is_correction.mode {
                IsMode::None => None,
                _ => logp_rollout.as_ref(),
            })
            .arg_or_null(keep.as_ref())
            .arg_or_null(logp_ref.as_ref())
            .arg_or_null(hwe.as_ref())
            .arg_or_null(beta_rows.as_ref())
            .arg_or_null(entropy.as_ref())
            // read only (mutable views are what the caller lent)
            .arg_or_null(if cov.is_some() {
                selected.as_mut()
            } else {
                None
            })
            .arg(&mut row_counts)
            .arg(&s.rows)
            .arg(&s.cols)
            .arg(&s.kind)
            .arg(&s.clip_lo)
            .arg(&s.clip_hi)
            .arg(&s.clip_c)
            .arg(&s.is_mode)
            .arg(&s.is_low)
            .arg(&s.is_high)
            .arg(&s.agg)
            .arg(&s.kl_est)
            .arg(&s.low_ratio)
            .arg(&s.entropy_coef)
            .arg(&s.scale)
            .arg(&s.cov_coef)
            .arg(&mut grad)
            .arg_or_null(entropy_grad_arg)
            .arg(&mut row_stats)
            .arg(&mut totals)
            .arg(&report)
            .arg(&mut status)
            .arg(&mut *self.blocks_done);
        // SAFETY: argument order and types match `policy_loss`; lengths checked above, the
        // optional tensors the spec reads are present.
        unsafe { launch.launch(cfg) }.during(format!("launch {KERNEL}"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(valid: f32) -> [f32; LOSS_STATS] {
        [0.5, 0.25, 2.0, 1.0, 0.0, -0.5, 4.0, 2.0, 1.0, valid]
    }

    #[test]
    fn report_reads_the_totals() {
        let r = LossReport::read(&totals(4.0), [u32::MAX, 0]).unwrap();
        assert_eq!(r.policy.loss, 0.5);
        assert_eq!(r.policy.clipfrac, 0.25);
        assert_eq!(r.policy.approx_kl, -0.125);
        assert_eq!(r.policy.is_weight_mean, 1.0);
        assert_eq!(r.policy.is_changed_frac, 0.5);
        assert_eq!(r.policy.selected_frac, 0.25);
        assert_eq!(r.policy.valid_tokens, 4);
        assert_eq!((r.kl_loss, r.entropy), (0.25, 2.0));
    }

    #[test]
    fn report_names_what_the_kernel_flagged() {
        let t = totals(4.0);
        let e = LossReport::read(&t, [17, 2]).unwrap_err();
        assert_eq!(
            e,
            ares_core::Error::NonFinite {
                what: "logp_old",
                index: 17
            }
        );
        // a mask error wins over a value error: core checks masks first
        let e = LossReport::read(&t, [3, 1 | 64]).unwrap_err();
        assert_eq!(
            e,
            ares_core::Error::InvalidMask {
                what: "mask",
                index: 3
            }
        );
        assert!(matches!(
            LossReport::read(&t, [0, 512]),
            Err(ares_core::Error::OutOfRange { .. })
        ));
        assert_eq!(
            LossReport::read(&totals(0.0), [u32::MAX, 0]).unwrap_err(),
            ares_core::Error::Empty { what: "mask" }
        );
    }

    #[test]
    fn spec_encodes_every_mode_and_checks_its_parameters() {
        let mut spec = LossSpec {
            kind: LossKind::Gspo(GspoLevel::Token),
            config: PolicyLossConfig {
                agg: LossAggMode::SeqMeanTokenSumNorm,
                ..PolicyLossConfig::default()
            },
            kl: Some(KlLossSpec {
                estimator: KlEstimator::K3Plus,
                low_ratio: 0.5,
            }),
            entropy_coef: Some(0.01),
            scale: 0.5,
        };
        spec.config.is_correction.mode = IsMode::ReinforcePro;
        let s = spec.scalars(3, 7);
        assert_eq!(
            (s.rows, s.cols, s.kind, s.is_mode, s.agg, s.kl_est),
            (3, 7, 3, 3, 4, 5)
        );
        assert_eq!((s.low_ratio, s.entropy_coef, s.scale), (0.5, 0.01, 0.5));
        assert!(spec.validate().is_ok());
        spec.scale = f32::NAN;
        assert!(spec.validate().unwrap_err().to_string().contains("scale"));
        spec.scale = 1.0;
        spec.kl = Some(KlLossSpec {
            estimator: KlEstimator::K1,
            low_ratio: 1.5,
        });
        assert!(
            spec.validate()
                .unwrap_err()
                .to_string()
                .contains("low_ratio")
        );
        spec.kl = None;
        spec.config.clip.clip_ratio_c = 0.5;
        assert!(
            spec.validate()
                .unwrap_err()
                .to_string()
                .contains("clip_ratio_c")
        );
    }
}
