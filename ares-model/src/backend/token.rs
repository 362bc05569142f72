//! Argument groups of the ARES token ops ([`Backend::entropy_windows`],
//! [`Backend::masked_dynamic_kl`]): the step's `[rows, cols]` token tensors (entropies,
//! log-probs, masks) as views of device buffers, so the HWE tokens and the dynamic KL of a
//! step are computed where the log-probs are, and only per-row sums reach the host.
//!
//! [`Backend::entropy_windows`]: super::Backend::entropy_windows
//! [`Backend::masked_dynamic_kl`]: super::Backend::masked_dynamic_kl

use super::{View, ViewMut};
use ares_core::kl::KlEstimator;

pub use ares_cpu::WindowSpec;

/// The HWE outputs of [`Backend::entropy_windows`] (docs/algorithms.md §1), views of
/// buffers `T`.
///
/// [`Backend::entropy_windows`]: super::Backend::entropy_windows
#[derive(Debug)]
pub struct HweViews<'a, T: ?Sized> {
    /// The threshold τ: a token is HWE iff its window is complete and `W_t ≥ τ`.
    pub tau: f32,
    /// Optional 0/1 trigger-position mask `[rows, cols]` restricting the candidates.
    pub trigger: Option<View<'a, T>>,
    /// 0/1 HWE mask `[rows, cols]` (written).
    pub hwe_mask: ViewMut<'a, T>,
    /// HWE tokens per row, as f32 (written).
    pub counts: ViewMut<'a, T>,
    /// Σ over the row's HWE tokens of `W_t − τ` (written).
    pub soft_cost: ViewMut<'a, T>,
}

/// The inputs of [`Backend::masked_dynamic_kl`] (docs/algorithms.md §4); token tensors are
/// `[rows, cols]`.
///
/// [`Backend::masked_dynamic_kl`]: super::Backend::masked_dynamic_kl
#[derive(Debug)]
pub struct KlViews<'a, T: ?Sized> {
    /// log π of the sampled tokens.
    pub logp: View<'a, T>,
    /// log π_ref of the same tokens.
    pub ref_logp: View<'a, T>,
    /// 0/1 response mask.
    pub mask: View<'a, T>,
    /// Optional 0/1 HWE mask: HWE tokens get weight β·`low_ratio`.
    pub hwe_mask: Option<View<'a, T>>,
    /// β per row `[rows]`.
    pub beta_rows: View<'a, T>,
    /// Weight ratio on HWE tokens, in [0, 1].
    pub low_ratio: f32,
    /// The per-token estimator (value only: `k1+`/`k3+` give the values of k1/k3).
    pub estimator: KlEstimator,
    /// Columns.
    pub cols: usize,
}

/// The outputs of [`Backend::masked_dynamic_kl`].
///
/// [`Backend::masked_dynamic_kl`]: super::Backend::masked_dynamic_kl
#[derive(Debug)]
pub struct KlSumViews<'a, T: ?Sized> {
    /// Optional per-token `β_t·k_t` `[rows, cols]` (0 on padding).
    pub weighted: Option<ViewMut<'a, T>>,
    /// Per-row `Σ_t β_t·k_t` `[rows]`.
    pub row_weighted_sum: ViewMut<'a, T>,
    /// Per-row mean of `k_t` over the row's valid tokens (0 for a row without one).
    pub row_mean_kl: ViewMut<'a, T>,
}

/// What [`Backend::actor_loss`] computes: `ares_core::loss::actor_loss`'s setting without its
/// tensors.
///
/// [`Backend::actor_loss`]: super::Backend::actor_loss
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActorLossSpec {
    /// The policy loss (Clip-Cov's `seed` included).
    pub objective: ares_core::loss::Objective<f32>,
    /// Clip, aggregation, importance correction.
    pub config: ares_core::loss::PolicyLossConfig<f32>,
    /// The KL loss term's estimator and HWE weight ratio (with `logp_ref` and `beta_rows`).
    pub kl: Option<(KlEstimator, f32)>,
    /// The entropy bonus's coefficient (with `entropy` and `entropy_grad`).
    pub entropy_coef: Option<f32>,
    /// Multiplies both gradients.
    pub scale: f32,
}

/// The token tensors of [`Backend::actor_loss`], `[rows, cols]` (β: `[rows]`).
///
/// [`Backend::actor_loss`]: super::Backend::actor_loss
#[derive(Debug)]
pub struct ActorLossViews<'a, T: ?Sized> {
    /// logπ under the current weights.
    pub logp: View<'a, T>,
    /// logπ_old.
    pub logp_old: View<'a, T>,
    /// Token advantages.
    pub advantages: View<'a, T>,
    /// 0/1 response mask.
    pub mask: View<'a, T>,
    /// The sampler's logπ (with an importance correction).
    pub logp_rollout: Option<View<'a, T>>,
    /// Forking-token mask (the policy gradient kept where 1).
    pub keep: Option<View<'a, T>>,
    /// logπ_ref (with a KL term).
    pub logp_ref: Option<View<'a, T>>,
    /// β per row (with a KL term).
    pub beta_rows: Option<View<'a, T>>,
    /// 0/1 HWE mask of the dynamic KL.
    pub hwe_mask: Option<View<'a, T>>,
    /// Token entropies (with an entropy bonus).
    pub entropy: Option<View<'a, T>>,
    /// Columns.
    pub cols: usize,
}

/// The gradients [`Backend::actor_loss`] writes, `[rows, cols]`.
///
/// [`Backend::actor_loss`]: super::Backend::actor_loss
#[derive(Debug)]
pub struct ActorLossGrads<'a, T: ?Sized> {
    /// `scale · ∂L/∂logπ`.
    pub grad: ViewMut<'a, T>,
    /// `scale · ∂L/∂H` (with an entropy bonus).
    pub entropy_grad: Option<ViewMut<'a, T>>,
}
