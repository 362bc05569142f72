//! Policy losses with their exact gradients, the loss aggregation modes, and the rollout
//! importance correction (docs/algorithms.md §6).
//!
//! | loss | per-token objective | function |
//! |---|---|---|
//! | PPO clip / dual clip | `max(−A·r, −A·clip(r))`, capped at `−A·c` for A < 0 | [`policy_loss`] |
//! | GSPO | the same clip on the sequence ratio `s = exp(mean_t ℓ_t)` | [`gspo_loss`] |
//! | CISPO | `−sg(clip(r))·A·logπ` | [`cispo_loss`] |
//! | Clip-Cov | PPO clip; a few high-covariance tokens get no gradient | [`clip_cov_loss`] |
//! | KL-Cov | `−A·r`, plus `coef·|ℓ|` on the top-covariance tokens | [`kl_cov_loss`] |
//!
//! [`actor_loss`] adds the forking mask, the KL term and the entropy bonus to any of them:
//! the whole loss of one micro-batch.
//!
//! Everything here returns `dLoss/dlogπ` next to the loss, so a runtime with a hand-written
//! backward pass (the fused classifier of the runner) needs no autodiff: the gradient with
//! respect to the logits of token `t` is `grad_t · (onehot − softmax)`.
//!
//! Positions whose mask is 0 (padding) are never read for their values: they may hold
//! anything, NaN included, and their gradient outputs are 0.

mod actor;
mod cispo;
mod cov;
mod gspo;

pub use actor::{ActorLoss, ActorLossOutput, EntropyTerm, KlTerm, Objective, actor_loss};
pub use cispo::cispo_loss;
pub use cov::{
    CLIP_COV_LB, CLIP_COV_RATIO, CLIP_COV_UB, ClipCovParams, KL_COV_RATIO, KlCovParams,
    PPO_KL_COEF, clip_cov_loss, kl_cov_loss,
};
pub use gspo::{GSPO_LOG_RATIO_MAX, GspoLevel, gspo_loss};

use crate::error::{Error, Result};
use crate::lanes::{self, BLOCK, Block, bad_value, select};
use crate::num::{cast, check_len, check_param, exp_bounded};
use crate::shape::Shape;
use num_traits::Float;

/// The log-ratio `logπ − logπ_old` is clamped to `[−20, 20]` before `exp`, as in verl, so
/// the ratio stays finite (`e^20 ≈ 4.85e8`).
pub const LOG_RATIO_CLAMP: f64 = 20.0;

/// PPO clip parameters.
///
/// - `clip_ratio_low` = ε_low ∈ [0, 1] (default 0.2): the ratio is clipped below at `1 − ε_low`.
/// - `clip_ratio_high` = ε_high ≥ 0 (default 0.3, the "clip-higher" of DAPO): clipped above
///   at `1 + ε_high`.
/// - `clip_ratio_c` = c, the dual-clip bound (default 3): for `A < 0` the loss is capped at
///   `−A·c`. `0` disables dual clip; otherwise c must be `> 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipParams<F> {
    /// ε_low: lower clip `1 − ε_low`.
    pub clip_ratio_low: F,
    /// ε_high: upper clip `1 + ε_high`.
    pub clip_ratio_high: F,
    /// Dual-clip constant c (0 = off).
    pub clip_ratio_c: F,
}

impl<F: Float> Default for ClipParams<F> {
    fn default() -> Self {
        ClipParams {
            clip_ratio_low: cast(0.2),
            clip_ratio_high: cast(0.3),
            clip_ratio_c: cast(3.0),
        }
    }
}

impl<F: Float> ClipParams<F> {
    /// Validated clip parameters (see [`ClipParams::validate`]).
    pub fn new(clip_ratio_low: F, clip_ratio_high: F, clip_ratio_c: F) -> Result<Self> {
        let p = ClipParams {
            clip_ratio_low,
            clip_ratio_high,
            clip_ratio_c,
        };
        p.validate()?;
        Ok(p)
    }

    /// The clip interval `(1 − ε_low, 1 + ε_high)`.
    fn bounds(&self) -> (F, F) {
        (
            F::one() - self.clip_ratio_low,
            F::one() + self.clip_ratio_high,
        )
    }

    /// Errors ([`Error::OutOfRange`]) unless ε_low ∈ [0, 1], ε_high ≥ 0 (finite) and
    /// c = 0 or c > 1 (finite).
    pub fn validate(&self) -> Result<()> {
        let (lo, hi, c) = (self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c);
        check_param(
            "clip_ratio_low",
            lo,
            lo >= F::zero() && lo <= F::one(),
            "in [0, 1]",
        )?;
        check_param("clip_ratio_high", hi, hi >= F::zero(), ">= 0")?;
        check_param(
            "clip_ratio_c",
            c,
            c == F::zero() || c > F::one(),
            "0 (off) or > 1",
        )
    }
}

/// One token's clipped loss, its derivative and the clip flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLoss<F> {
    /// The loss `L` of the token.
    pub loss: F,
    /// `dL/dlogπ`.
    pub grad: F,
    /// The importance ratio `r = exp(clamp(logπ − logπ_old, −20, 20))`.
    pub ratio: F,
    /// `L2 > L1`: the clipped surrogate was selected (PPO clip active).
    pub clipped: bool,
    /// The dual-clip bound `−A·c` was selected (`A < 0`, dual clip on, `−A·c < max(L1, L2)`).
    pub dual_clipped: bool,
}

/// Constants of the per-token loss, prepared once per call.
#[derive(Clone, Copy)]
struct Clip<F> {
    lo: F,
    hi: F,
    c: F,
    dual: bool,
    bound: F,
}

impl<F: Float> Clip<F> {
    fn new(p: &ClipParams<F>) -> Result<Self> {
        p.validate()?;
        let (lo, hi) = p.bounds();
        Ok(Clip {
            lo,
            hi,
            c: p.clip_ratio_c,
            dual: p.clip_ratio_c > F::zero(),
            bound: cast(LOG_RATIO_CLAMP),
        })
    }

    /// The per-token loss for `d = logπ − logπ_old` (finite) and advantage `a` (finite).
    #[inline(always)]
    fn token(&self, d: F, a: F) -> TokenLoss<F> {
        let neg_a = -a;
        // Live on the closed interval (see the tie convention of `ppo_token_loss`).
        let live = d >= -self.bound && d <= self.bound;
        let ratio = exp_bounded(d.max(-self.bound).min(self.bound));
        let (lc, slope, clipped) = clipped_surrogate(ratio, a, self.lo, self.hi);
        let gc = if live { slope } else { F::zero() };
        let l3 = neg_a * self.c;
        let dual_clipped = self.dual & (a < F::zero()) & (l3 < lc);
        let loss = if dual_clipped { l3 } else { lc };
        let grad = if dual_clipped { F::zero() } else { gc };
        TokenLoss {
            loss,
            grad,
            ratio,
            clipped,
            dual_clipped,
        }
    }
}

/// PPO's clipped surrogate `Lc = max(L1, L2)`, `L1 = −A·r`, `L2 = −A·clamp(r, lo, hi)`, for a
/// ratio `r > 0`: `(Lc, dLc/dlog r, L2 > L1)`. The slope is `L1` (= `−A·r`) where L1 is
/// selected and 0 where the clip is (`L2 > L1` implies the clamp changed r, so the selected
/// constant has zero slope); a tie takes L1.
#[inline(always)]
fn clipped_surrogate<F: Float>(ratio: F, a: F, lo: F, hi: F) -> (F, F, bool) {
    let neg_a = -a;
    let l1 = neg_a * ratio;
    let l2 = neg_a * ratio.max(lo).min(hi);
    let clipped = l2 > l1;
    // Selects rather than branches: the sign of A is data-dependent.
    (
        if clipped { l2 } else { l1 },
        if clipped { F::zero() } else { l1 },
        clipped,
    )
}

/// The PPO clip / dual-clip loss of one token and its exact derivative.
///
/// ℓ = clamp(logπ − logπ_old, −20, 20), r = eˡ, L1 = −A·r,
/// L2 = −A·clamp(r, 1 − ε_low, 1 + ε_high), Lc = max(L1, L2);
/// for A < 0 with dual clip on, L = min(Lc, −A·c), else L = Lc.
///
/// `dL/dlogπ` is the exact piecewise derivative: `−A·r` where L = L1 and the ℓ clamp is
/// live, 0 where a clamp or clip selects a constant.
///
/// Ties (a set of measure zero, where the loss has a kink) take the derivative of the branch
/// that holds on the open side: the ℓ clamp is live on the closed interval `[−20, 20]`;
/// `L1 = L2` takes L1 (slope `−A·r`); `Lc = −A·c` keeps Lc (not dual-clipped). So `clipped`
/// means `L2 > L1` strictly (verl's clipfrac) and `dual_clipped` means `−A·c < Lc` strictly.
/// Autograd in torch 2.15 differs only at these points: `torch.clamp` passes a zero gradient
/// at its bounds (x = −20, 20, 1 − ε_low or 1 + ε_high exactly), and `torch.maximum` splits
/// a tie's gradient equally, so verl gets 0 at ℓ = ±20 and `−A·r/2` at r = 1 + ε_high
/// (A > 0) or r = 1 − ε_low (A < 0).
///
/// Errors: non-finite `logp`, `logp_old` or `advantage` ([`Error::NonFinite`], index 0);
/// invalid `clip` ([`ClipParams::validate`]).
pub fn ppo_token_loss<F: Float>(
    logp: F,
    logp_old: F,
    advantage: F,
    clip: &ClipParams<F>,
) -> Result<TokenLoss<F>> {
    let clip = Clip::new(clip)?;
    for (what, x) in [
        ("logp", logp),
        ("logp_old", logp_old),
        ("advantage", advantage),
    ] {
        if !x.is_finite() {
            return Err(Error::NonFinite { what, index: 0 });
        }
    }
    Ok(clip.token(logp - logp_old, advantage))
}

/// How per-token losses `L_t` over `[rows, cols]` with mask `m` become one scalar
/// (verl's `loss_agg_mode`). `n_r = Σ_t m_rt` is the number of valid tokens of row r, `R` the
/// number of rows with `n_r > 0` and `T = cols` the padded length.
///
/// Rows without a valid token are skipped by the seq-mean modes (they count neither in the
/// numerator nor in `R`), as current verl does. A batch with no valid token at all is an
/// error ([`Error::Empty`] for `"mask"`) in every mode, even where the value would be 0.
///
/// With the `serde` feature a mode is written as its [`name`](Self::name) and read from it or
/// from the same name with underscores (`token_mean`, as some configs spell it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum LossAggMode {
    /// `token-mean`: `Σ m·L / Σ m`. Weight of a valid token: `1 / Σ m`.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "token-mean", alias = "token_mean"))]
    TokenMean,
    /// `token-sum`: `Σ m·L`. Weight: 1.
    #[cfg_attr(feature = "serde", serde(rename = "token-sum", alias = "token_sum"))]
    TokenSum,
    /// `seq-mean-token-sum`: `(1/R) Σ_r Σ_t m·L`. Weight: `1 / R`.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "seq-mean-token-sum", alias = "seq_mean_token_sum")
    )]
    SeqMeanTokenSum,
    /// `seq-mean-token-mean`: `(1/R) Σ_r (Σ_t m·L / n_r)`. Weight: `1 / (R·n_r)`.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "seq-mean-token-mean", alias = "seq_mean_token_mean")
    )]
    SeqMeanTokenMean,
    /// `seq-mean-token-sum-norm` (Dr.GRPO's constant normaliser): `Σ m·L / (R·T)`.
    /// Weight: `1 / (R·T)`. verl ≥ 0.8 divides by `R·T`; verl 0.5–0.7 divided by `T` alone,
    /// which is `R` times larger (docs/algorithms.md §6).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "seq-mean-token-sum-norm", alias = "seq_mean_token_sum_norm")
    )]
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// Every mode, in declaration order.
    pub const ALL: [LossAggMode; 5] = [
        LossAggMode::TokenMean,
        LossAggMode::TokenSum,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ];

    /// The mode named as in the configuration (`"token-mean"`, `"token-sum"`,
    /// `"seq-mean-token-sum"`, `"seq-mean-token-mean"`, `"seq-mean-token-sum-norm"`); `None`
    /// for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "token-mean" => Some(LossAggMode::TokenMean),
            "token-sum" => Some(LossAggMode::TokenSum),
            "seq-mean-token-sum" => Some(LossAggMode::SeqMeanTokenSum),
            "seq-mean-token-mean" => Some(LossAggMode::SeqMeanTokenMean),
            "seq-mean-token-sum-norm" => Some(LossAggMode::SeqMeanTokenSumNorm),
            _ => None,
        }
    }

    /// The configuration name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::TokenSum => "token-sum",
            LossAggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }
}

/// The normalisation of an aggregation over one validated mask.
#[derive(Clone, Copy)]
struct AggPlan<F> {
    mode: LossAggMode,
    cols: usize,
    valid: usize,
    inv_total: F,
    inv_rows: F,
    inv_rows_cols: F,
}

impl<F: Float> AggPlan<F> {
    /// Validates `mask` against `shape` (length, 0/1) and counts valid tokens and rows.
    /// Errors with [`Error::Empty`] when no token is valid, so `cols > 0` afterwards.
    fn new(mask: &[F], shape: Shape, mode: LossAggMode) -> Result<Self> {
        shape.check_mask("mask", mask)?;
        let (mut valid, mut rows) = (0usize, 0usize);
        if shape.cols > 0 {
            for row in mask.chunks_exact(shape.cols) {
                let n_r = row_valid(row);
                valid += n_r;
                rows += usize::from(n_r > 0);
            }
        }
        if valid == 0 {
            return Err(Error::Empty { what: "mask" });
        }
        Ok(AggPlan {
            mode,
            cols: shape.cols,
            valid,
            inv_total: F::one() / cast::<F>(valid as f64),
            inv_rows: F::one() / cast::<F>(rows as f64),
            // R·T formed in f64: exact below 2^53, where usize·usize could overflow
            inv_rows_cols: F::one() / cast::<F>(rows as f64 * shape.cols as f64),
        })
    }

    /// The weight `∂agg/∂L_t` of every valid token of a row with `n_r` valid tokens
    /// (unused when `n_r = 0`).
    #[inline]
    fn row_weight(&self, n_r: usize) -> F {
        match self.mode {
            LossAggMode::TokenMean => self.inv_total,
            LossAggMode::TokenSum => F::one(),
            LossAggMode::SeqMeanTokenSum => self.inv_rows,
            LossAggMode::SeqMeanTokenMean => self.inv_rows / cast::<F>(n_r.max(1) as f64),
            LossAggMode::SeqMeanTokenSumNorm => self.inv_rows_cols,
        }
    }
}

#[inline]
fn row_valid<F: Float>(mask_row: &[F]) -> usize {
    mask_row.iter().filter(|&&m| m != F::zero()).count()
}

/// Aggregates per-token `values` over `[rows, cols]` with `mask` by `mode`
/// (see [`LossAggMode`] for the formulas and the empty-row rule).
///
/// Errors: lengths ≠ `rows·cols`, mask not 0/1, no valid token ([`Error::Empty`]),
/// a non-finite value at a valid position.
pub fn aggregate<F: Float>(shape: Shape, values: &[F], mask: &[F], mode: LossAggMode) -> Result<F> {
    shape.check("values", values.len())?;
    let plan = AggPlan::new(mask, shape, mode)?;
    let mut total = F::zero();
    for (r, (v_row, m_row)) in values
        .chunks_exact(plan.cols)
        .zip(mask.chunks_exact(plan.cols))
        .enumerate()
    {
        let mut s = F::zero();
        let mut n_r = 0usize;
        for (t, (&v, &m)) in v_row.iter().zip(m_row).enumerate() {
            if m != F::zero() {
                if !v.is_finite() {
                    return Err(Error::NonFinite {
                        what: "values",
                        index: r * plan.cols + t,
                    });
                }
                s = s + v;
                n_r += 1;
            }
        }
        if n_r > 0 {
            total = total + s * plan.row_weight(n_r);
        }
    }
    Ok(total)
}

/// Writes `weights[t] = ∂agg/∂L_t` for `mode` over `mask`: the constant of
/// [`LossAggMode`] on valid tokens, 0 on padding. `Σ_t weights[t]·L_t` is the aggregate.
///
/// Errors: lengths, mask not 0/1, no valid token.
pub fn aggregate_weights<F: Float>(
    shape: Shape,
    mask: &[F],
    mode: LossAggMode,
    weights: &mut [F],
) -> Result<()> {
    shape.check("weights", weights.len())?;
    let plan = AggPlan::new(mask, shape, mode)?;
    for (w_row, m_row) in weights
        .chunks_exact_mut(plan.cols)
        .zip(mask.chunks_exact(plan.cols))
    {
        let w = plan.row_weight(row_valid(m_row));
        for (o, &m) in w_row.iter_mut().zip(m_row) {
            *o = if m != F::zero() { w } else { F::zero() };
        }
    }
    Ok(())
}

/// Aggregates a per-token term with its gradient, e.g. the KL loss term
/// `kl_coef_term = agg(β_t·k_t)`.
///
/// `values[t]` is the term `v_t`; `grad[t]` holds `∂v_t/∂logπ_t` on entry and
/// `∂agg/∂logπ_t = weight_t · ∂v_t/∂logπ_t` on exit (0 on padding). Returns `agg(v)`.
/// Updating in place spares the caller a second `[rows, cols]` buffer.
///
/// Errors: lengths, mask not 0/1, no valid token, non-finite `values` or `grad` at a valid
/// position (then `grad` is left partly scaled).
pub fn aggregate_term<F: Float>(
    shape: Shape,
    values: &[F],
    grad: &mut [F],
    mask: &[F],
    mode: LossAggMode,
) -> Result<F> {
    shape.check("values", values.len())?;
    shape.check("grad", grad.len())?;
    let plan = AggPlan::new(mask, shape, mode)?;
    let mut total = F::zero();
    for (r, ((v_row, g_row), m_row)) in values
        .chunks_exact(plan.cols)
        .zip(grad.chunks_exact_mut(plan.cols))
        .zip(mask.chunks_exact(plan.cols))
        .enumerate()
    {
        let n_r = row_valid(m_row);
        let w = plan.row_weight(n_r);
        let mut s = F::zero();
        for (t, ((&v, g), &m)) in v_row.iter().zip(g_row.iter_mut()).zip(m_row).enumerate() {
            if m != F::zero() {
                let index = r * plan.cols + t;
                if !v.is_finite() {
                    return Err(Error::NonFinite {
                        what: "values",
                        index,
                    });
                }
                if !g.is_finite() {
                    return Err(Error::NonFinite {
                        what: "grad",
                        index,
                    });
                }
                s = s + v;
                *g = *g * w;
            } else {
                *g = F::zero();
            }
        }
        if n_r > 0 {
            total = total + s * w;
        }
    }
    Ok(total)
}

/// Rollout importance correction mode (`is_correction`): how the weight
/// `w = exp(clamp(logπ_old − logπ_rollout, −20, 20))` between the training-time old policy
/// and the sampler's policy is bounded.
///
/// With the `serde` feature a mode is read and written as its [`name`](Self::name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum IsMode {
    /// `none`: w = 1 (no correction; `logp_rollout` is not read).
    #[default]
    None,
    /// `tis` (truncated importance sampling): w ← min(w, high).
    Tis,
    /// `icepop`: w ← w if low ≤ w ≤ high, else 0 (the token is masked out of the loss).
    Icepop,
    /// `reinforce_pro`: w ← clamp(w, low, high).
    ReinforcePro,
}

impl IsMode {
    /// The mode named as in the configuration (`"none"`, `"tis"`, `"icepop"`,
    /// `"reinforce_pro"`); `None` for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(IsMode::None),
            "tis" => Some(IsMode::Tis),
            "icepop" => Some(IsMode::Icepop),
            "reinforce_pro" => Some(IsMode::ReinforcePro),
            _ => None,
        }
    }

    /// The configuration name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            IsMode::None => "none",
            IsMode::Tis => "tis",
            IsMode::Icepop => "icepop",
            IsMode::ReinforcePro => "reinforce_pro",
        }
    }
}

/// Rollout importance correction: mode and thresholds `[low, high]` (defaults
/// `none`, 0.5, 5.0). Valid when `0 ≤ low ≤ high` (finite).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsCorrection<F> {
    /// The bounding rule.
    pub mode: IsMode,
    /// Lower threshold (icepop, reinforce_pro).
    pub low: F,
    /// Upper threshold.
    pub high: F,
}

impl<F: Float> Default for IsCorrection<F> {
    fn default() -> Self {
        IsCorrection {
            mode: IsMode::None,
            low: cast(0.5),
            high: cast(5.0),
        }
    }
}

impl<F: Float> IsCorrection<F> {
    /// Errors ([`Error::OutOfRange`]) unless `0 ≤ low ≤ high`, both finite.
    pub fn validate(&self) -> Result<()> {
        check_param("is_threshold_low", self.low, self.low >= F::zero(), ">= 0")?;
        check_param(
            "is_threshold_high",
            self.high,
            self.high >= self.low,
            ">= is_threshold_low",
        )
    }

    /// The bounded weight for `d = logπ_old − logπ_rollout` (finite) and whether the rule
    /// changed it (truncated, clamped or masked).
    #[inline(always)]
    fn weight(&self, d: F, bound: F) -> (F, bool) {
        let raw = || exp_bounded(d.max(-bound).min(bound));
        match self.mode {
            IsMode::None => (F::one(), false),
            IsMode::Tis => {
                let w = raw();
                if w > self.high {
                    (self.high, true)
                } else {
                    (w, false)
                }
            }
            IsMode::Icepop => {
                let w = raw();
                if w >= self.low && w <= self.high {
                    (w, false)
                } else {
                    (F::zero(), true)
                }
            }
            IsMode::ReinforcePro => {
                let w = raw();
                if w < self.low {
                    (self.low, true)
                } else if w > self.high {
                    (self.high, true)
                } else {
                    (w, false)
                }
            }
        }
    }
}

/// The rollout importance weight of one token:
/// `w = exp(clamp(logπ_old − logπ_rollout, −20, 20))`, bounded by `correction.mode`
/// (see [`IsMode`]). Returns `(w, changed)` where `changed` says the rule truncated,
/// clamped or masked the raw weight. With [`IsMode::None`] it is `(1, false)`.
///
/// Errors: invalid thresholds; non-finite inputs ([`Error::NonFinite`], index 0).
pub fn is_weight<F: Float>(
    logp_old: F,
    logp_rollout: F,
    correction: &IsCorrection<F>,
) -> Result<(F, bool)> {
    correction.validate()?;
    if !logp_old.is_finite() {
        return Err(Error::NonFinite {
            what: "logp_old",
            index: 0,
        });
    }
    if !logp_rollout.is_finite() {
        return Err(Error::NonFinite {
            what: "logp_rollout",
            index: 0,
        });
    }
    Ok(correction.weight(logp_old - logp_rollout, cast(LOG_RATIO_CLAMP)))
}

/// Token tensors of one policy-loss call, all `[rows, cols]` row-major.
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInput<'a, F> {
    /// `[rows, cols]`.
    pub shape: Shape,
    /// logπ of the sampled tokens under the current policy (the differentiated input).
    pub logp: &'a [F],
    /// logπ_old: the training-time log-probs of the policy that produced the batch.
    pub logp_old: &'a [F],
    /// Token advantages A (already broadcast over the response).
    pub advantages: &'a [F],
    /// 0/1 response mask.
    pub mask: &'a [F],
    /// logπ_rollout: the sampler's log-probs, needed unless the correction is `none`.
    pub logp_rollout: Option<&'a [F]>,
}

/// Configuration of [`policy_loss`] (defaults: clip 0.2/0.3/3, `token-mean`, no correction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossConfig<F> {
    /// Clip / dual clip.
    pub clip: ClipParams<F>,
    /// Aggregation mode.
    pub agg: LossAggMode,
    /// Rollout importance correction.
    pub is_correction: IsCorrection<F>,
}

impl<F: Float> Default for PolicyLossConfig<F> {
    fn default() -> Self {
        PolicyLossConfig {
            clip: ClipParams::default(),
            agg: LossAggMode::default(),
            is_correction: IsCorrection::default(),
        }
    }
}

/// The aggregated loss and its metrics. Fractions and means are over valid tokens
/// (token-mean, whatever the aggregation mode, as verl logs them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossOutput<F> {
    /// The aggregated policy loss.
    pub loss: F,
    /// `pg_clipfrac`: fraction of valid tokens with `L2 > L1`.
    pub clipfrac: F,
    /// `pg_clipfrac_lower`: fraction of valid tokens where the dual clip is active.
    pub clipfrac_lower: F,
    /// `ppo_kl`: mean over valid tokens of `−ℓ = −clamp(logπ − logπ_old, −20, 20)`.
    pub approx_kl: F,
    /// Mean rollout importance weight after bounding (1 with `none`).
    pub is_weight_mean: F,
    /// Fraction of valid tokens whose importance weight was truncated, clamped or masked.
    pub is_changed_frac: F,
    /// Fraction of valid tokens selected by covariance ([`clip_cov_loss`]: gradient removed;
    /// [`kl_cov_loss`]: KL penalty added); 0 for the other losses.
    pub selected_frac: F,
    /// Number of valid tokens.
    pub valid_tokens: usize,
}

/// The full PPO policy loss over `[rows, cols]` with its gradient.
///
/// Per valid token: `L_t` from [`ppo_token_loss`], times the rollout importance weight
/// `w_t` ([`is_weight`]; a constant, not differentiated; icepop's w = 0 removes the token's
/// loss and gradient but it still counts in the normalisation and the metrics). The loss is
/// `agg(w_t·L_t)` by `config.agg`, and `grad[t] = ∂loss/∂logπ_t = weight_t · w_t · dL_t/dlogπ_t`
/// with `weight_t` from [`aggregate_weights`]; `grad` is 0 on padding.
///
/// One pass over the token data (plus a count over the mask), simple inner loops.
///
/// Errors: any input length ≠ `rows·cols` (also `grad`), mask not 0/1, no valid token
/// ([`Error::Empty`]), a non-finite `logp` / `logp_old` / `advantages` / `logp_rollout` at a
/// valid position ([`Error::NonFinite`] with the flat index), invalid clip or correction
/// parameters, `logp_rollout` missing while the correction is not `none`
/// ([`Error::LengthMismatch`] with actual 0). On error `grad` holds unspecified values.
pub fn policy_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    config: &PolicyLossConfig<F>,
    grad: &mut [F],
) -> Result<PolicyLossOutput<F>> {
    let clip = Clip::new(&config.clip)?;
    let Checked { plan, streams, is } = check_input(input, config, grad.len())?;
    // One monomorphised loop per correction mode keeps the mode out of the inner loop.
    let bound: F = cast(LOG_RATIO_CLAMP);
    let acc = match is.mode {
        IsMode::None => loss_rows(&clip, &plan, &streams, grad, false, |_| (F::one(), false)),
        _ => loss_rows(&clip, &plan, &streams, grad, true, |d| is.weight(d, bound)),
    }?;
    Ok(acc.output(&plan))
}

/// The validated inputs of a policy loss: aggregation plan, token streams, correction.
struct Checked<'a, F> {
    plan: AggPlan<F>,
    streams: Streams<'a, F>,
    is: IsCorrection<F>,
}

/// The checks every policy loss starts with: lengths (`grad` too), the correction and its
/// rollout stream, the mask (0/1, at least one valid token). Finiteness is checked by the
/// caller's token loop (or [`Streams::check_finite`]).
fn check_input<'a, F: Float>(
    input: &PolicyLossInput<'a, F>,
    config: &PolicyLossConfig<F>,
    grad_len: usize,
) -> Result<Checked<'a, F>> {
    let shape = input.shape;
    let is = config.is_correction;
    is.validate()?;
    let len = shape.len()?;
    check_len("logp", len, input.logp.len())?;
    check_len("logp_old", len, input.logp_old.len())?;
    check_len("advantages", len, input.advantages.len())?;
    check_len("grad", len, grad_len)?;
    // With no correction the rollout stream is never read; logp_old stands in for it.
    let rollout = match (is.mode, input.logp_rollout) {
        (IsMode::None, _) => input.logp_old,
        (_, Some(r)) => r,
        (_, None) => {
            return Err(Error::LengthMismatch {
                what: "logp_rollout",
                expected: len,
                actual: 0,
            });
        }
    };
    check_len("logp_rollout", len, rollout.len())?;
    let plan = AggPlan::new(input.mask, shape, config.agg)?;
    let streams = Streams {
        logp: input.logp,
        logp_old: input.logp_old,
        advantages: input.advantages,
        mask: input.mask,
        rollout,
    };
    Ok(Checked { plan, streams, is })
}

/// [`check_input`] plus what the losses beside PPO check up front: the clip parameters and
/// finite inputs at every valid position (PPO's vectorised loop checks finiteness as it goes).
fn check_all<'a, F: Float>(
    input: &PolicyLossInput<'a, F>,
    config: &PolicyLossConfig<F>,
    grad_len: usize,
) -> Result<Checked<'a, F>> {
    config.clip.validate()?;
    let checked = check_input(input, config, grad_len)?;
    checked
        .streams
        .check_finite(checked.plan.cols, &checked.is)?;
    Ok(checked)
}

/// The validated token streams of a policy loss.
struct Streams<'a, F> {
    logp: &'a [F],
    logp_old: &'a [F],
    advantages: &'a [F],
    mask: &'a [F],
    rollout: &'a [F],
}

impl<F: Float> Streams<'_, F> {
    /// Errors ([`Error::NonFinite`]) at the first valid position holding a non-finite
    /// `logp`, `logp_old`, `advantages` or (when read) `logp_rollout`.
    fn check_finite(&self, cols: usize, is: &IsCorrection<F>) -> Result<()> {
        let check_rollout = is.mode != IsMode::None;
        for (i, &m) in self.mask.iter().enumerate() {
            let bad = |x: &[F]| x.get(i).is_some_and(|v| !v.is_finite());
            if m != F::zero()
                && (bad(self.logp)
                    || bad(self.logp_old)
                    || bad(self.advantages)
                    || (check_rollout && bad(self.rollout)))
            {
                return Err(first_bad(self, i / cols.max(1), cols, check_rollout));
            }
        }
        Ok(())
    }
}

/// Sums of a policy loss over valid tokens.
struct Acc<F> {
    loss: F,
    kl: F,
    w: F,
    clipped: usize,
    dual_clipped: usize,
    changed: usize,
    selected: usize,
}

impl<F: Float> Acc<F> {
    fn new() -> Self {
        Acc {
            loss: F::zero(),
            kl: F::zero(),
            w: F::zero(),
            clipped: 0,
            dual_clipped: 0,
            changed: 0,
            selected: 0,
        }
    }

    /// Adds one valid token's metrics: clamped log-ratio `l`, importance weight `(w, changed)`.
    #[inline]
    fn token(&mut self, l: F, (w, changed): (F, bool), clipped: bool) {
        self.kl = self.kl - l;
        self.w = self.w + w;
        self.changed += usize::from(changed);
        self.clipped += usize::from(clipped);
    }

    /// The loss and the metrics as fractions and means over the plan's valid tokens.
    fn output(&self, plan: &AggPlan<F>) -> PolicyLossOutput<F> {
        let inv = plan.inv_total;
        let frac = |n: usize| cast::<F>(n as f64) * inv;
        PolicyLossOutput {
            loss: self.loss,
            clipfrac: frac(self.clipped),
            clipfrac_lower: frac(self.dual_clipped),
            approx_kl: self.kl * inv,
            is_weight_mean: self.w * inv,
            is_changed_frac: frac(self.changed),
            selected_frac: frac(self.selected),
            valid_tokens: plan.valid,
        }
    }
}

/// The first non-finite input at a valid position of row `r` (`rollout` only when read).
#[cold]
fn first_bad<F: Float>(s: &Streams<'_, F>, r: usize, cols: usize, check_rollout: bool) -> Error {
    let base = r * cols;
    for t in 0..cols {
        let at = |x: &[F]| x.get(base + t).copied().unwrap_or(F::zero());
        if at(s.mask) == F::zero() {
            continue;
        }
        let what = if !at(s.logp).is_finite() {
            "logp"
        } else if !at(s.logp_old).is_finite() {
            "logp_old"
        } else if !at(s.advantages).is_finite() {
            "advantages"
        } else if check_rollout && !at(s.rollout).is_finite() {
            "logp_rollout"
        } else {
            continue;
        };
        return Error::NonFinite {
            what,
            index: base + t,
        };
    }
    Error::NonFinite {
        what: "logp",
        index: base,
    }
}

/// Per-slot partial sums of one row of [`policy_loss`] (see [`crate::lanes`]: element-wise
/// updates of accumulator arrays are what the loop vectoriser turns into SIMD code).
struct Slots<F> {
    loss: Block<F>,
    kl: Block<F>,
    w: Block<F>,
    clipped: [u32; BLOCK],
    dual_clipped: [u32; BLOCK],
    changed: [u32; BLOCK],
    bad: [u32; BLOCK],
}

impl<F: Float> Slots<F> {
    fn new() -> Self {
        Slots {
            loss: lanes::zeros(),
            kl: lanes::zeros(),
            w: lanes::zeros(),
            clipped: [0; BLOCK],
            dual_clipped: [0; BLOCK],
            changed: [0; BLOCK],
            bad: [0; BLOCK],
        }
    }
}

/// One block of each token stream: logπ, logπ_old, advantages, mask, logπ_rollout.
type TokenBlock<'a, F> = (
    &'a [F; BLOCK],
    &'a [F; BLOCK],
    &'a [F; BLOCK],
    &'a [F; BLOCK],
    &'a [F; BLOCK],
);

/// One block of [`BLOCK`] tokens of [`policy_loss`], token i into slot i; writes each
/// token's `dL/dlogπ` times the row weight. Fixed-size arrays let the compiler see every
/// index is in range, so the loop vectorises. Padding (mask 0) is computed on whatever it
/// holds and discarded by selects.
#[inline(always)]
fn block_into<F: Float, W: Fn(F) -> (F, bool)>(
    clip: &Clip<F>,
    is_weight: &W,
    check_rollout: bool,
    weight: F,
    slots: &mut Slots<F>,
    (lp, lo, a, m, lr): TokenBlock<'_, F>,
    g: &mut [F; BLOCK],
) {
    let zero = F::zero();
    for i in 0..BLOCK {
        let valid = m[i] != zero;
        let bad = bad_value(lp[i])
            | bad_value(lo[i])
            | bad_value(a[i])
            | (check_rollout & bad_value(lr[i]));
        let d = lp[i] - lo[i];
        let tok = clip.token(d, a[i]);
        let (w, changed) = is_weight(lo[i] - lr[i]);
        slots.loss[i] = slots.loss[i] + select(valid, w * tok.loss, zero);
        slots.kl[i] = slots.kl[i] - select(valid, d.max(-clip.bound).min(clip.bound), zero);
        slots.w[i] = slots.w[i] + select(valid, w, zero);
        slots.clipped[i] += u32::from(valid & tok.clipped);
        slots.dual_clipped[i] += u32::from(valid & tok.dual_clipped);
        slots.changed[i] += u32::from(valid & changed);
        slots.bad[i] |= u32::from(valid & bad);
        g[i] = weight * select(valid, w * tok.grad, zero);
    }
}

/// The per-row loop of [`policy_loss`]. Each row is processed up to its last valid token
/// (trailing padding is only zero-filled) in blocks of [`BLOCK`] tokens, each token into its
/// own accumulator slot, without data-dependent branches; finiteness is accumulated per row
/// and located only when it fails.
#[inline(always)]
fn loss_rows<F: Float, W: Fn(F) -> (F, bool)>(
    clip: &Clip<F>,
    plan: &AggPlan<F>,
    s: &Streams<'_, F>,
    grad: &mut [F],
    check_rollout: bool,
    is_weight: W,
) -> Result<Acc<F>> {
    let cols = plan.cols;
    let zero = F::zero();
    let mut acc = Acc::new();
    let rows = s
        .logp
        .chunks_exact(cols)
        .zip(s.logp_old.chunks_exact(cols))
        .zip(s.advantages.chunks_exact(cols))
        .zip(s.mask.chunks_exact(cols))
        .zip(s.rollout.chunks_exact(cols))
        .zip(grad.chunks_exact_mut(cols));
    for (r, (((((lp, lo), adv), m), lr), g)) in rows.enumerate() {
        let end = m.iter().rposition(|&x| x != zero).map_or(0, |t| t + 1);
        let (g, g_pad) = g.split_at_mut(end);
        g_pad.fill(zero);
        if end == 0 {
            continue;
        }
        let weight = plan.row_weight(row_valid(m));
        let mut slots = Slots::new();
        let (lp, lo, adv, m, lr) = (&lp[..end], &lo[..end], &adv[..end], &m[..end], &lr[..end]);
        // whole blocks in place, then the tail copied into a block padded with mask 0
        let whole = end - end % BLOCK;
        let blocks = lp[..whole]
            .chunks_exact(BLOCK)
            .zip(lo[..whole].chunks_exact(BLOCK))
            .zip(adv[..whole].chunks_exact(BLOCK))
            .zip(m[..whole].chunks_exact(BLOCK))
            .zip(lr[..whole].chunks_exact(BLOCK))
            .zip(g[..whole].chunks_exact_mut(BLOCK));
        for (((((lp, lo), a), m), lr), g) in blocks {
            let arrays = (
                <&[F; BLOCK]>::try_from(lp),
                <&[F; BLOCK]>::try_from(lo),
                <&[F; BLOCK]>::try_from(a),
                <&[F; BLOCK]>::try_from(m),
                <&[F; BLOCK]>::try_from(lr),
                <&mut [F; BLOCK]>::try_from(g),
            );
            if let (Ok(lp), Ok(lo), Ok(a), Ok(m), Ok(lr), Ok(g)) = arrays {
                block_into(
                    clip,
                    &is_weight,
                    check_rollout,
                    weight,
                    &mut slots,
                    (lp, lo, a, m, lr),
                    g,
                );
            }
        }
        if whole < end {
            let n = end - whole;
            let mut tail = [[zero; BLOCK]; 5];
            for (buf, src) in tail.iter_mut().zip([lp, lo, adv, m, lr]) {
                buf[..n].copy_from_slice(&src[whole..end]);
            }
            let mut g_tail = [zero; BLOCK];
            let [tlp, tlo, ta, tm, tlr] = &tail;
            block_into(
                clip,
                &is_weight,
                check_rollout,
                weight,
                &mut slots,
                (tlp, tlo, ta, tm, tlr),
                &mut g_tail,
            );
            g[whole..end].copy_from_slice(&g_tail[..n]);
        }
        if slots.bad.iter().any(|&b| b != 0) {
            return Err(first_bad(s, r, cols, check_rollout));
        }
        let count = |c: &[u32; BLOCK]| c.iter().map(|&x| x as usize).sum::<usize>();
        acc.loss = acc.loss + lanes::total(&slots.loss) * weight;
        acc.kl = acc.kl + lanes::total(&slots.kl);
        acc.w = acc.w + lanes::total(&slots.w);
        acc.clipped += count(&slots.clipped);
        acc.dual_clipped += count(&slots.dual_clipped);
        acc.changed += count(&slots.changed);
    }
    Ok(acc)
}

/// Token data shared by the loss modules' property tests.
#[cfg(test)]
mod testing {
    extern crate std;
    use crate::Shape;
    use proptest::prelude::*;
    use std::vec::Vec;

    /// `(shape, logπ, logπ − logπ_old, advantages, mask)` over `[1..4, 1..max_cols]`: logπ in
    /// [−3, 0), log-ratios in [−0.8, 0.8) (clipped and unclipped tokens), advantages in
    /// [−2, 2), a 0/1 mask whose first token is valid.
    pub(super) type TokenBatch = (Shape, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

    pub(super) fn token_batch(max_cols: usize) -> impl Strategy<Value = TokenBatch> {
        (1usize..4, 1usize..max_cols).prop_flat_map(|(rows, cols)| {
            let n = rows * cols;
            (
                Just(Shape::new(rows, cols)),
                proptest::collection::vec(-3.0f64..0.0, n),
                proptest::collection::vec(-0.8f64..0.8, n),
                proptest::collection::vec(-2.0f64..2.0, n),
                proptest::collection::vec(prop_oneof![Just(0.0), Just(1.0), Just(1.0)], n)
                    .prop_map(|mut m| {
                        m[0] = 1.0;
                        m
                    }),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    const MODES: [LossAggMode; 5] = LossAggMode::ALL;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn vector_9_token_losses() {
        let clip = ClipParams::new(0.2, 0.2, 3.0).unwrap();
        // (A, r) → (L, dL/dlogπ, clipped, dual)
        let cases = [
            // L1 = 5, L2 = 1.2, Lc = 5, −A·c = 3 < 5 → dual clip, slope 0
            (-1.0, 5.0, 3.0, 0.0, false, true),
            // L1 = 2, L2 = 1.2, Lc = 2 < 3 → L1 live, slope −A·r = 2
            (-1.0, 2.0, 2.0, 2.0, false, false),
            // L1 = −5, L2 = −1.2 > L1 → clipped, slope 0
            (1.0, 5.0, -1.2, 0.0, true, false),
            // L1 = −0.5, L2 = −0.8 < L1 → L1, slope −A·r = −0.5
            (1.0, 0.5, -0.5, -0.5, false, false),
        ];
        for (a, r, want, dwant, clipped, dual) in cases {
            let t = ppo_token_loss(f64::ln(r), 0.0, a, &clip).unwrap();
            assert!(close(t.loss, want, 1e-12), "A={a} r={r}: {}", t.loss);
            assert!(close(t.grad, dwant, 1e-12), "A={a} r={r}: {}", t.grad);
            assert_eq!((t.clipped, t.dual_clipped), (clipped, dual), "A={a} r={r}");
            let t32 = ppo_token_loss(
                (r as f32).ln(),
                0.0f32,
                a as f32,
                &ClipParams::new(0.2f32, 0.2, 3.0).unwrap(),
            )
            .unwrap();
            assert!((f64::from(t32.loss) - want).abs() < 1e-5);
        }
    }

    #[test]
    fn token_loss_ties_and_clamp() {
        let clip = ClipParams::<f64>::default();
        // A > 0, r = e^20 ≫ 1.3 → clipped at 1.3, slope 0
        let t = ppo_token_loss(20.0, 0.0, 1e-12, &clip).unwrap();
        assert!(t.clipped && t.grad == 0.0);
        // Beyond the ℓ clamp with an unclipped branch: A < 0, dual off, r = e^20 fixed.
        let nodual = ClipParams::new(0.2, 0.3, 0.0).unwrap();
        let at = ppo_token_loss(20.0, 0.0, -1.0, &nodual).unwrap();
        let past = ppo_token_loss(25.0, 0.0, -1.0, &nodual).unwrap();
        assert_eq!(at.loss, past.loss);
        assert_eq!(at.grad, at.loss); // live at the boundary: −A·r
        assert_eq!(past.grad, 0.0); // clamped: constant
        // A = 0: loss 0, slope 0, never clipped
        let z = ppo_token_loss(1.0, 0.0, 0.0, &clip).unwrap();
        assert_eq!(
            (z.loss, z.grad, z.clipped, z.dual_clipped),
            (0.0, 0.0, false, false)
        );
        // r = 1 exactly on the clip bound 1 + ε_high (ε_high = 0): L1 = L2 = −1 → L1
        // branch, slope −A·r = −1
        let on = ppo_token_loss(0.0, 0.0, 1.0, &ClipParams::new(0.2, 0.0, 3.0).unwrap()).unwrap();
        assert!(!on.clipped && on.grad == -1.0 && on.loss == -1.0);
        // Lc = −A·c exactly (A = −1, r = 3 via ε_high = 2 so L2 = L1): not dual-clipped
        let tie = ppo_token_loss(
            3f64.ln(),
            0.0,
            -1.0,
            &ClipParams::new(0.2, 5.0, 3.0).unwrap(),
        )
        .unwrap();
        assert!(close(tie.loss, 3.0, 1e-12));
    }

    #[test]
    fn token_loss_errors() {
        let clip = ClipParams::<f64>::default();
        assert_eq!(
            ppo_token_loss(f64::NAN, 0.0, 1.0, &clip),
            Err(Error::NonFinite {
                what: "logp",
                index: 0
            })
        );
        assert_eq!(
            ppo_token_loss(0.0, 0.0, f64::INFINITY, &clip),
            Err(Error::NonFinite {
                what: "advantage",
                index: 0
            })
        );
        assert!(matches!(
            ClipParams::new(-0.1, 0.2, 3.0),
            Err(Error::OutOfRange {
                what: "clip_ratio_low",
                ..
            })
        ));
        assert!(matches!(
            ClipParams::new(0.2, f64::NAN, 3.0),
            Err(Error::OutOfRange {
                what: "clip_ratio_high",
                ..
            })
        ));
        assert!(matches!(
            ClipParams::new(0.2, 0.2, 1.0),
            Err(Error::OutOfRange { what: "clip_ratio_c", value, .. }) if value == 1.0
        ));
        assert!(ClipParams::new(0.2, 0.2, 0.0).is_ok());
        let bad = ClipParams {
            clip_ratio_low: 1.5,
            ..clip
        };
        assert!(ppo_token_loss(0.0, 0.0, 1.0, &bad).is_err());
    }

    #[test]
    fn vector_10_aggregation() {
        let s = Shape::new(2, 3);
        let l = [1.0, 2.0, 3.0, 4.0, 0.0, 0.0];
        let m = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0];
        // spec vector 10: 10/4; 10; (6 + 4)/2; (6/3 + 4/1)/2; 10/(2·3)
        let want = [2.5, 10.0, 5.0, 3.0, 10.0 / 6.0];
        for (mode, want) in MODES.into_iter().zip(want) {
            let got = aggregate(s, &l, &m, mode).unwrap();
            assert!(close(got, want, 1e-12), "{}: {got}", mode.name());
            assert!(close(
                f64::from(aggregate(s, &l.map(|x| x as f32), &m.map(|x| x as f32), mode).unwrap()),
                want,
                1e-6
            ));
            let mut w = [0.0; 6];
            aggregate_weights(s, &m, mode, &mut w).unwrap();
            let dot: f64 = w.iter().zip(&l).map(|(w, l)| w * l).sum();
            assert!(close(dot, want, 1e-12));
            assert_eq!(LossAggMode::from_name(mode.name()), Some(mode));
        }
        assert_eq!(LossAggMode::from_name("seq-mean"), None);
    }

    #[test]
    fn empty_rows_are_skipped_and_all_empty_is_an_error() {
        let s = Shape::new(2, 2);
        // row 1 has no valid token and holds NaN padding: ignored
        let l = [1.0, 2.0, f64::NAN, f64::NAN];
        let m = [1.0, 1.0, 0.0, 0.0];
        assert_eq!(aggregate(s, &l, &m, LossAggMode::SeqMeanTokenSum), Ok(3.0));
        assert_eq!(aggregate(s, &l, &m, LossAggMode::SeqMeanTokenMean), Ok(1.5));
        assert_eq!(aggregate(s, &l, &m, LossAggMode::TokenMean), Ok(1.5));
        for mode in MODES {
            assert_eq!(
                aggregate(s, &l, &[0.0; 4], mode),
                Err(Error::Empty { what: "mask" })
            );
        }
        assert_eq!(
            aggregate::<f64>(Shape::new(3, 0), &[], &[], LossAggMode::TokenMean),
            Err(Error::Empty { what: "mask" })
        );
        assert_eq!(
            aggregate(s, &l, &[1.0, 1.0, 1.0, 0.0], LossAggMode::TokenMean),
            Err(Error::NonFinite {
                what: "values",
                index: 2
            })
        );
        assert_eq!(
            aggregate(s, &l, &[1.0, 0.5, 0.0, 0.0], LossAggMode::TokenMean),
            Err(Error::InvalidMask {
                what: "mask",
                index: 1
            })
        );
        assert_eq!(
            aggregate(s, &l[..3], &m, LossAggMode::TokenMean),
            Err(Error::LengthMismatch {
                what: "values",
                expected: 4,
                actual: 3
            })
        );
        let mut w = [0.0; 3];
        assert!(matches!(
            aggregate_weights(s, &m, LossAggMode::TokenMean, &mut w),
            Err(Error::LengthMismatch {
                what: "weights",
                ..
            })
        ));
    }

    #[test]
    fn aggregate_term_scales_grad() {
        // KL term: values β·k, grad ∂(β·k)/∂logπ; seq-mean-token-mean weights 1/(2·3), 1/(2·1)
        let s = Shape::new(2, 3);
        let v = [1.0, 2.0, 3.0, 4.0, 9.0, 9.0];
        let mut g = [1.0, 1.0, 1.0, 6.0, 7.0, 7.0];
        let m = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0];
        let agg = aggregate_term(s, &v, &mut g, &m, LossAggMode::SeqMeanTokenMean).unwrap();
        assert!(close(agg, 3.0, 1e-12));
        let want = [1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0, 3.0, 0.0, 0.0];
        for (g, w) in g.iter().zip(want) {
            assert!(close(*g, w, 1e-12));
        }
        let mut g = [f64::NAN, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(
            aggregate_term(s, &v, &mut g, &m, LossAggMode::TokenMean),
            Err(Error::NonFinite {
                what: "grad",
                index: 0
            })
        );
    }

    #[test]
    fn importance_weights() {
        let corr = |mode| IsCorrection {
            mode,
            ..IsCorrection::<f64>::default()
        };
        let ln10 = 10f64.ln();
        let ln_q = 0.25f64.ln();
        // w = 10 > high 5; w = 0.25 < low 0.5; w = 2 inside
        let cases = [
            (IsMode::None, (1.0, false), (1.0, false), (1.0, false)),
            (IsMode::Tis, (5.0, true), (0.25, false), (2.0, false)),
            (IsMode::Icepop, (0.0, true), (0.0, true), (2.0, false)),
            (IsMode::ReinforcePro, (5.0, true), (0.5, true), (2.0, false)),
        ];
        for (mode, hi, lo, mid) in cases {
            let c = corr(mode);
            let (w, ch) = is_weight(ln10, 0.0, &c).unwrap();
            assert!(close(w, hi.0, 1e-12) && ch == hi.1, "{}", mode.name());
            let (w, ch) = is_weight(ln_q, 0.0, &c).unwrap();
            assert!(close(w, lo.0, 1e-12) && ch == lo.1, "{}", mode.name());
            let (w, ch) = is_weight(0.0, -(2f64.ln()), &c).unwrap();
            assert!(close(w, mid.0, 1e-12) && ch == mid.1, "{}", mode.name());
            assert_eq!(IsMode::from_name(mode.name()), Some(mode));
        }
        let bad = IsCorrection {
            mode: IsMode::Tis,
            low: 2.0,
            high: 1.0,
        };
        assert!(matches!(
            is_weight(0.0, 0.0, &bad),
            Err(Error::OutOfRange {
                what: "is_threshold_high",
                ..
            })
        ));
        let neg = IsCorrection {
            mode: IsMode::Tis,
            low: -1.0,
            high: 1.0,
        };
        assert!(is_weight(0.0, 0.0, &neg).is_err());
        assert!(is_weight(0.0, f64::NAN, &corr(IsMode::Tis)).is_err());
    }

    #[test]
    fn policy_loss_hand_checked() {
        // 2 rows × 2 cols; row 1 has one valid token. Default clip (0.2, 0.3, c 3).
        // t0: d = ln 2, A = 1 → L1 = −2, L2 = −1.3 > L1 → clipped, L = −1.3, g = 0
        // t1: d = 0,    A = −1 → L = 1, g = −A·r = 1
        // t2: d = ln 5, A = −1 → L1 = 5, L2 = 1.3, Lc = 5, −A·c = 3 → dual, L = 3, g = 0
        // t3: padding (NaN everywhere)
        let s = Shape::new(2, 2);
        let logp = [2f64.ln(), 0.0, 5f64.ln(), f64::NAN];
        let logp_old = [0.0, 0.0, 0.0, f64::NAN];
        let adv = [1.0, -1.0, -1.0, f64::NAN];
        let mask = [1.0, 1.0, 1.0, 0.0];
        let input = PolicyLossInput {
            shape: s,
            logp: &logp,
            logp_old: &logp_old,
            advantages: &adv,
            mask: &mask,
            logp_rollout: None,
        };
        let mut grad = [9.0; 4];
        let out = policy_loss(&input, &PolicyLossConfig::default(), &mut grad).unwrap();
        // token-mean: (−1.3 + 1 + 3)/3 = 0.9
        assert!(close(out.loss, 0.9, 1e-12), "{}", out.loss);
        assert!(close(grad[1], 1.0 / 3.0, 1e-12));
        assert_eq!((grad[0], grad[2], grad[3]), (0.0, 0.0, 0.0));
        assert!(close(out.clipfrac, 1.0 / 3.0, 1e-12));
        assert!(close(out.clipfrac_lower, 1.0 / 3.0, 1e-12));
        // approx KL = mean(−d) = −(ln 2 + ln 5)/3
        assert!(close(out.approx_kl, -(10f64.ln()) / 3.0, 1e-12));
        assert_eq!(
            (out.is_weight_mean, out.is_changed_frac, out.valid_tokens),
            (1.0, 0.0, 3)
        );

        // seq-mean-token-sum: ((−1.3 + 1) + 3)/2 = 1.35, weights 1/2
        let cfg = PolicyLossConfig {
            agg: LossAggMode::SeqMeanTokenSum,
            ..PolicyLossConfig::default()
        };
        let out = policy_loss(&input, &cfg, &mut grad).unwrap();
        assert!(close(out.loss, 1.35, 1e-12));
        assert!(close(grad[1], 0.5, 1e-12));

        // tis with rollout weights w = (10 → 5, 1, 1): (5·(−1.3) + 1 + 3)/3
        let rollout = [-(10f64.ln()), 0.0, 0.0, f64::NAN];
        let input_is = PolicyLossInput {
            logp_rollout: Some(&rollout),
            ..input
        };
        let cfg = PolicyLossConfig {
            is_correction: IsCorrection {
                mode: IsMode::Tis,
                ..IsCorrection::default()
            },
            ..PolicyLossConfig::default()
        };
        let out = policy_loss(&input_is, &cfg, &mut grad).unwrap();
        assert!(close(out.loss, (5.0 * -1.3 + 4.0) / 3.0, 1e-12));
        assert!(close(out.is_weight_mean, 7.0 / 3.0, 1e-12));
        assert!(close(out.is_changed_frac, 1.0 / 3.0, 1e-12));
        // icepop masks t0: (0 + 1 + 3)/3, and its gradient is 0 anyway
        let cfg_ice = PolicyLossConfig {
            is_correction: IsCorrection {
                mode: IsMode::Icepop,
                ..IsCorrection::default()
            },
            ..PolicyLossConfig::default()
        };
        let out = policy_loss(&input_is, &cfg_ice, &mut grad).unwrap();
        assert!(close(out.loss, 4.0 / 3.0, 1e-12));
        // missing rollout log-probs
        assert_eq!(
            policy_loss(&input, &cfg, &mut grad),
            Err(Error::LengthMismatch {
                what: "logp_rollout",
                expected: 4,
                actual: 0
            })
        );
    }

    #[test]
    fn policy_loss_errors() {
        let s = Shape::new(1, 3);
        let z = [0.0f64; 3];
        let m = [1.0, 1.0, 0.0];
        let nan = [0.0, f64::NAN, 0.0];
        let mk = |logp, adv, mask| PolicyLossInput {
            shape: s,
            logp,
            logp_old: &z,
            advantages: adv,
            mask,
            logp_rollout: None,
        };
        let cfg = PolicyLossConfig::default();
        let mut g = [0.0; 3];
        assert_eq!(
            policy_loss(&mk(&nan, &z, &m), &cfg, &mut g),
            Err(Error::NonFinite {
                what: "logp",
                index: 1
            })
        );
        assert_eq!(
            policy_loss(&mk(&z, &nan, &m), &cfg, &mut g),
            Err(Error::NonFinite {
                what: "advantages",
                index: 1
            })
        );
        // NaN under padding is fine
        let pad_nan = [0.0, 0.0, f64::NAN];
        assert!(policy_loss(&mk(&pad_nan, &pad_nan, &m), &cfg, &mut g).is_ok());
        // … also inside a row (a hole in the mask), whose gradient is 0
        let hole = [1.0, 0.0, 1.0];
        let mid_nan = [0.0, f64::NAN, 0.0];
        let adv = [1.0, f64::NAN, 1.0];
        g = [7.0; 3];
        // r = 1, A = 1: L = −1, slope −1, token-mean weight 1/2
        let out = policy_loss(&mk(&mid_nan, &adv, &hole), &cfg, &mut g).unwrap();
        assert_eq!((out.loss, g), (-1.0, [-0.5, 0.0, -0.5]));
        assert_eq!(
            policy_loss(&mk(&z, &z, &[0.0; 3]), &cfg, &mut g),
            Err(Error::Empty { what: "mask" })
        );
        assert_eq!(
            policy_loss(&mk(&z[..2], &z, &m), &cfg, &mut g),
            Err(Error::LengthMismatch {
                what: "logp",
                expected: 3,
                actual: 2
            })
        );
        let mut short = [0.0; 2];
        assert!(matches!(
            policy_loss(&mk(&z, &z, &m), &cfg, &mut short),
            Err(Error::LengthMismatch { what: "grad", .. })
        ));
        let bad_mask = [1.0, 2.0, 0.0];
        assert_eq!(
            policy_loss(&mk(&z, &z, &bad_mask), &cfg, &mut g),
            Err(Error::InvalidMask {
                what: "mask",
                index: 1
            })
        );
        let huge = PolicyLossInput {
            shape: Shape::new(usize::MAX, 2),
            ..mk(&z, &z, &m)
        };
        assert!(matches!(
            policy_loss(&huge, &cfg, &mut g),
            Err(Error::OutOfRange { .. })
        ));
        let bad_clip = PolicyLossConfig {
            clip: ClipParams {
                clip_ratio_c: 0.5,
                ..ClipParams::default()
            },
            ..cfg
        };
        assert!(policy_loss(&mk(&z, &z, &m), &bad_clip, &mut g).is_err());
    }

    /// `rows × cols` token data with finite values and a mask with at least one 1.
    fn batch() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>)> {
        (1usize..4, 1usize..6).prop_flat_map(|(rows, cols)| {
            let n = rows * cols;
            (
                Just(rows),
                Just(cols),
                proptest::collection::vec(-3.0f64..3.0, n),
                proptest::collection::vec(-3.0f64..3.0, n),
                proptest::collection::vec(-2.0f64..2.0, n),
                proptest::collection::vec(prop_oneof![Just(0.0), Just(1.0), Just(1.0)], n)
                    .prop_map(|mut m| {
                        m[0] = 1.0;
                        m
                    }),
            )
        })
    }

    fn mode() -> impl Strategy<Value = LossAggMode> {
        proptest::sample::select(&LossAggMode::ALL[..])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// dLoss/dlogπ matches central finite differences away from the clip kinks.
        #[test]
        fn gradient_matches_finite_differences(
            (rows, cols, logp, logp_old, adv, mask) in batch(),
            agg in mode(),
            lo in 0.05f64..0.4,
            hi in 0.05f64..0.5,
            dual in any::<bool>(),
        ) {
            let cfg = PolicyLossConfig {
                clip: ClipParams::new(lo, hi, if dual { 3.0 } else { 0.0 }).unwrap(),
                agg,
                is_correction: IsCorrection::default(),
            };
            let s = Shape::new(rows, cols);
            let loss_at = |lp: &[f64]| {
                let input = PolicyLossInput { shape: s, logp: lp, logp_old: &logp_old, advantages: &adv, mask: &mask, logp_rollout: None };
                let mut g = vec![0.0; lp.len()];
                let out = policy_loss(&input, &cfg, &mut g).unwrap();
                (out.loss, g)
            };
            let (_, grad) = loss_at(&logp);
            let h = 1e-6;
            for t in 0..logp.len() {
                let r = (logp[t] - logp_old[t]).exp();
                let kinks = [1.0 - lo, 1.0 + hi, 3.0];
                if kinks.iter().any(|k| (r - k).abs() < 1e-3 * k) {
                    continue;
                }
                let mut p = logp.clone();
                p[t] += h;
                let (fp, _) = loss_at(&p);
                p[t] -= 2.0 * h;
                let (fm, _) = loss_at(&p);
                let fd = (fp - fm) / (2.0 * h);
                prop_assert!((fd - grad[t]).abs() <= 1e-5 * (1.0 + grad[t].abs()), "t={t} fd={fd} grad={}", grad[t]);
            }
        }

        /// The aggregated loss and gradient equal Σ weight_t · (token loss, token grad).
        #[test]
        fn policy_loss_is_weighted_token_sum(
            (rows, cols, logp, logp_old, adv, mask) in batch(),
            agg in mode(),
        ) {
            let s = Shape::new(rows, cols);
            let clip = ClipParams::default();
            let cfg = PolicyLossConfig { clip, agg, ..PolicyLossConfig::default() };
            let input = PolicyLossInput { shape: s, logp: &logp, logp_old: &logp_old, advantages: &adv, mask: &mask, logp_rollout: None };
            let mut g = vec![0.0; logp.len()];
            let out = policy_loss(&input, &cfg, &mut g).unwrap();
            let mut w = vec![0.0; logp.len()];
            aggregate_weights(s, &mask, agg, &mut w).unwrap();
            let mut want = 0.0;
            for t in 0..logp.len() {
                let tok = ppo_token_loss(logp[t], logp_old[t], adv[t], &clip).unwrap();
                want += w[t] * tok.loss;
                prop_assert!((g[t] - w[t] * tok.grad).abs() < 1e-12);
            }
            prop_assert!((out.loss - want).abs() < 1e-9 * (1.0 + want.abs()));
            prop_assert!(out.clipfrac >= 0.0 && out.clipfrac <= 1.0);
            prop_assert!(out.clipfrac_lower >= 0.0 && out.clipfrac_lower <= 1.0);
        }

        /// Mean modes return the constant; weights sum as their formulas say.
        #[test]
        fn aggregation_invariants(
            (rows, cols, _a, _b, _c, mask) in batch(),
            c in -5.0f64..5.0,
        ) {
            let s = Shape::new(rows, cols);
            let v = vec![c; mask.len()];
            for agg in [LossAggMode::TokenMean, LossAggMode::SeqMeanTokenMean] {
                let got = aggregate(s, &v, &mask, agg).unwrap();
                prop_assert!((got - c).abs() < 1e-12);
                let mut w = vec![0.0; mask.len()];
                aggregate_weights(s, &mask, agg, &mut w).unwrap();
                prop_assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            }
            let valid: f64 = mask.iter().sum();
            let nonempty = mask.chunks(cols).filter(|r| r.contains(&1.0)).count() as f64;
            let mut w = vec![0.0; mask.len()];
            aggregate_weights(s, &mask, LossAggMode::SeqMeanTokenSum, &mut w).unwrap();
            prop_assert!((w.iter().sum::<f64>() - valid / nonempty).abs() < 1e-12);
            aggregate_weights(s, &mask, LossAggMode::SeqMeanTokenSumNorm, &mut w).unwrap();
            prop_assert!((w.iter().sum::<f64>() - valid / (nonempty * cols as f64)).abs() < 1e-12);
            aggregate_weights(s, &mask, LossAggMode::TokenSum, &mut w).unwrap();
            prop_assert!((w.iter().sum::<f64>() - valid).abs() < 1e-12);
            // token-sum is token-mean times the valid count; sum-norm is seq-mean-token-sum / T
            let v: Vec<f64> = (0..mask.len()).map(|i| c + i as f64).collect();
            let sum = aggregate(s, &v, &mask, LossAggMode::TokenSum).unwrap();
            let mean = aggregate(s, &v, &mask, LossAggMode::TokenMean).unwrap();
            prop_assert!((sum - mean * valid).abs() < 1e-9 * (1.0 + sum.abs()));
            let seq = aggregate(s, &v, &mask, LossAggMode::SeqMeanTokenSum).unwrap();
            let norm = aggregate(s, &v, &mask, LossAggMode::SeqMeanTokenSumNorm).unwrap();
            prop_assert!((norm * cols as f64 - seq).abs() < 1e-9 * (1.0 + seq.abs()));
        }
    }
}
