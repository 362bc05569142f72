//! Advantage estimators and REINFORCE Pro Max (docs/algorithms.md §5).
//!
//! Scalar, group-relative estimators over per-sample rewards `r` (one per batch row), with
//! groups of `n ≥ 2` samples per prompt described by [`Groups`] (contiguous, permuted, or of
//! different sizes keyed by uid; `n` is then each group's own size):
//!
//! | estimator | advantage of sample i of group g | function |
//! |---|---|---|
//! | GRPO | `(r − mean_g)/(std_g + 1e−6)`, unbiased std | [`grpo_advantages`] |
//! | Dr.GRPO (`norm_adv_by_std = false`) | `r − mean_g` | [`grpo_advantages`] |
//! | RLOO | `r − (Σ_g r − r)/(n − 1)` | [`rloo_advantages`] |
//! | REINFORCE++-baseline | `r − mean_g` | [`reinforce_baseline_advantages`] |
//! | Pro Max step 1 | RLOO, or `r/n` for uniform groups | [`pro_max_shaped_rewards`] |
//!
//! Token-level steps over padded `[rows, cols]` tensors with a 0/1 mask:
//! [`broadcast_to_tokens`], [`token_level_rewards`] (KL folding:
//! `R_t = −β_t·k_t + [t = last valid token]·r̃`), [`returns_to_go`] (`G_t = R_t + γ·G_{t+1}`),
//! [`masked_whiten`] (batch whitening), [`pro_max_normalize`] (per-group adaptive α/β).
//!
//! One call per estimator from per-sample rewards (plus optional weighted KL tokens) to token
//! advantages: [`grpo_token_advantages`], [`rloo_token_advantages`],
//! [`reinforce_pp_advantages`], [`reinforce_pp_baseline_advantages`], [`reinforce_pro_max`].
//! They need no scratch: each works group by group (or row by row) while the data are in
//! cache, and the whitening ones merge per-row moments so the batch is read once and written
//! twice.
//!
//! Conventions shared by every function here:
//! - a group whose rewards are all exactly equal gets exactly 0 from GRPO, Dr.GRPO, RLOO and
//!   REINFORCE++-baseline (no rounding residue of the mean is amplified by `1/(std + ε)`);
//! - padded positions (mask 0) of every token output are 0; every position of every input
//!   (padded ones too) must be finite;
//! - `n = 1` is [`Error::GroupTooSmall`](crate::Error::GroupTooSmall) naming the estimator
//!   ([`Error::RaggedGroupTooSmall`](crate::Error::RaggedGroupTooSmall) with the group and its
//!   uid for a ragged layout);
//! - on error, outputs hold unspecified values.
//!
//! Shuffled batches: build the layout with [`Groups::permuted`] (which rejects index arrays
//! that are not permutations) and check that every group holds one prompt with
//! [`Groups::check_same_prompt`]; the results equal those of the contiguous layout on the
//! un-shuffled data.

mod baseline;
mod grpo;

mod pro_max;
mod reinforce;
mod rloo;
mod token;
mod whiten;

pub use baseline::reinforce_baseline_advantages;
pub use grpo::{
    GRPO_EPSILON, GrpoConfig, dr_grpo_advantages, grpo_advantages, grpo_token_advantages,
};
pub use pro_max::{
    PRO_MAX_EPSILON, PRO_MAX_MAX_SCALE, PRO_MAX_PRODUCT_CAP, PRO_MAX_UNIFORM_STD, ProMaxConfig,
    ProMaxGroupReport, ProMaxGroupStatus, ProMaxSummary, pro_max_normalize, pro_max_shaped_rewards,
    reinforce_pro_max,
};
pub use reinforce::{reinforce_pp_advantages, reinforce_pp_baseline_advantages};
pub use rloo::{rloo_advantages, rloo_token_advantages};
pub use token::{
    broadcast_to_tokens, check_gamma, kl_folded_scores, returns_to_go, returns_to_go_in_place,
    token_level_rewards,
};
pub use whiten::{WHITEN_VAR_FLOOR, WhitenStats, masked_whiten};

use crate::error::Result;
use crate::num::{check_finite, check_len};
use crate::{Groups, Shape};
use num_traits::Float;

/// The token side of a batch: its padded shape, 0/1 response mask and, when KL is folded into
/// the rewards, the weighted per-token KL `β_t·k_t` (e.g. the `weighted` output of
/// [`crate::kl::token_kl`]; `None` = no KL in the reward).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResponseTokens<'a, F> {
    /// `[rows, cols]`, rows = batch size.
    pub shape: Shape,
    /// 0/1 response mask, `rows × cols`.
    pub mask: &'a [F],
    /// `β_t·k_t` per token, `rows × cols`, or `None`.
    pub weighted_kl: Option<&'a [F]>,
}

impl<'a, F> ResponseTokens<'a, F> {
    /// Tokens without KL in the reward.
    pub fn new(shape: Shape, mask: &'a [F]) -> Self {
        ResponseTokens {
            shape,
            mask,
            weighted_kl: None,
        }
    }

    /// The same tokens with the weighted per-token KL folded into the rewards.
    pub fn with_kl(mut self, weighted_kl: &'a [F]) -> Self {
        self.weighted_kl = Some(weighted_kl);
        self
    }

    /// Checks the lengths of the mask, the KL and an output against `shape`, and that the
    /// shape has `rows` rows.
    pub(crate) fn check(&self, rows: usize, out_len: usize) -> Result<()> {
        check_len("shape.rows", rows, self.shape.rows)?;
        self.shape.check("mask", self.mask.len())?;
        if let Some(k) = self.weighted_kl {
            self.shape.check("weighted_kl", k.len())?;
        }
        self.shape.check("out", out_len)
    }
}

/// Moments of one group's rewards.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupMoments<F> {
    /// `n` as `F`.
    pub(crate) n: F,
    /// Σ r / n.
    pub(crate) mean: F,
    /// Σ (r − mean)² (two-pass, so no cancellation).
    pub(crate) m2: F,
    /// Every reward equals the first one exactly.
    pub(crate) all_equal: bool,
}

impl<F: Float> GroupMoments<F> {
    /// Unbiased standard deviation `√(m2/(n − 1))` (callers guarantee n ≥ 2).
    #[inline]
    pub(crate) fn std_unbiased(&self) -> F {
        (self.m2 / (self.n - F::one())).sqrt()
    }
}

/// `rewards[row]` (NaN if out of range, which validation rules out).
#[inline]
pub(crate) fn at<F: Float>(xs: &[F], i: usize) -> F {
    xs.get(i).copied().unwrap_or_else(F::nan)
}

/// Moments of group `g`.
pub(crate) fn group_moments<F: Float>(
    groups: &Groups<'_>,
    g: usize,
    rewards: &[F],
) -> GroupMoments<F> {
    let first = at(rewards, groups.row(g, 0));
    let mut sum = F::zero();
    let mut all_equal = true;
    for row in groups.rows_of(g) {
        let r = at(rewards, row);
        sum = sum + r;
        all_equal &= r == first;
    }
    let n = crate::num::cast::<F>(groups.size(g) as f64);
    let mean = sum / n;
    let mut m2 = F::zero();
    for row in groups.rows_of(g) {
        let d = at(rewards, row) - mean;
        m2 = m2 + d * d;
    }
    GroupMoments {
        n,
        mean,
        m2,
        all_equal,
    }
}

/// The checks every group estimator starts with: `n ≥ 2`, lengths, finite rewards.
pub(crate) fn check_group_rewards<F: Float>(
    estimator: &'static str,
    groups: &Groups<'_>,
    rewards: &[F],
) -> Result<()> {
    groups.require_pairs(estimator)?;
    groups.check_batch("rewards", rewards.len())?;
    check_finite("rewards", rewards)
}

/// Applies `f(moments, r)` to every sample, writing the per-sample advantage to `out[row]`.
pub(crate) fn per_sample<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    out: &mut [F],
    f: impl Fn(&GroupMoments<F>, F) -> F,
) {
    for g in 0..groups.count() {
        let gm = group_moments(groups, g, rewards);
        for row in groups.rows_of(g) {
            if let Some(o) = out.get_mut(row) {
                *o = f(&gm, at(rewards, row));
            }
        }
    }
}
