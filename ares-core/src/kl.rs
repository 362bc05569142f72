//! KL penalties between the policy π and the reference policy π_ref (docs/algorithms.md §4).
//!
//! Per token, with δ = logπ − logπ_ref:
//!
//! | estimator | k(δ) | dk/dlogπ |
//! |---|---|---|
//! | [`KlEstimator::K1`] | δ | 1 |
//! | [`KlEstimator::Abs`] | \|δ\| | sign(δ), 0 at δ = 0 |
//! | [`KlEstimator::K2`] | δ²/2 | δ |
//! | [`KlEstimator::K3`] (`low_var_kl`) | x = clamp(−δ, −20, 20), k = clamp(eˣ − x − 1, −10, 10) | 1 − eˣ, 0 where a clamp is active |
//! | [`KlEstimator::K1Plus`] (`k1+`) | k1's δ | k2's δ |
//! | [`KlEstimator::K3Plus`] (`k3+`) | k3's value | k2's δ |
//!
//! The `+` estimators are straight-through (verl's `k1+` / `k3+`): k1 and k3 are unbiased
//! estimates of the KL's *value*, but their expected gradient is not the KL's gradient; k2's
//! is (for samples from π). So the loss reports k1 or k3 while its gradient is k2's, δ,
//! which has no clamp.
//!
//! **Dynamic token-level KL** (ARES, `dynamic_kl`): token t of row r is weighted by
//! `β_t = β_r · (hwe_t ? low_ratio : 1)`, where `β_r` is the sample's coefficient (its
//! difficulty bucket's dual-ascent λ_d, or one fixed/adaptive β for every row) and `hwe_t`
//! marks high-window-entropy tokens. [`token_kl`] computes everything the trainer needs from
//! one pass over `[rows, cols]` token tensors: per-token `k_t`, `β_t·k_t` and its gradient,
//! per-row weighted sums and mean KL, batch totals.
//!
//! Controllers of the coefficient: [`KlController::Fixed`] and the adaptive controller
//! [`AdaptiveKlController`] (`e = clip(KL/target − 1, ±0.2)`, `β ← β·(1 + e·N/horizon)`).
//!
//! `eˣ` is evaluated by a branch-free polynomial kernel (accurate to a few ulp in `f32` and
//! `f64`) instead of `libm`, so the token loops vectorise; `eˣ − x − 1` is formed without
//! cancellation near x = 0, where k3 is O(x²).

use crate::Shape;
use crate::error::{Error, Result};
use crate::lanes::{self, BLOCK, Block, Sum, bad_mask, bad_value, select};
use crate::num::{LN2_HI, LN2_LO, cast, check_finite, check_len, check_mask, check_param, to_f64};
use num_traits::Float;

/// k3 clamps its exponent x = −δ to `[−K3_EXPONENT_CLAMP, K3_EXPONENT_CLAMP]`.
pub const K3_EXPONENT_CLAMP: f64 = 20.0;
/// k3 clamps its value to `[−K3_VALUE_CLAMP, K3_VALUE_CLAMP]`.
pub const K3_VALUE_CLAMP: f64 = 10.0;
/// Default weight factor of high-window-entropy tokens in dynamic token-level KL.
pub const DEFAULT_LOW_RATIO: f64 = 0.5;
/// Default KL target of the adaptive controller.
pub const ADAPTIVE_KL_TARGET: f64 = 0.1;
/// Default horizon (in samples) of the adaptive controller.
pub const ADAPTIVE_KL_HORIZON: f64 = 10000.0;
/// The adaptive controller clips its proportional error to `±ADAPTIVE_KL_ERROR_CLIP`.
pub const ADAPTIVE_KL_ERROR_CLIP: f64 = 0.2;

/// A per-token estimator of KL(π ‖ π_ref) from the two log-probabilities of the sampled token.
///
/// With the `serde` feature it is read from any name [`KlEstimator::from_name`] accepts and
/// written as verl's `kl_penalty` names: `kl`, `abs`, `mse`, `low_var_kl`, `k1+`, `k3+`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum KlEstimator {
    /// `k1 = δ`: unbiased, high variance, can be negative.
    #[cfg_attr(feature = "serde", serde(rename = "kl", alias = "k1"))]
    K1,
    /// `|δ|`.
    #[cfg_attr(feature = "serde", serde(rename = "abs"))]
    Abs,
    /// `k2 = δ²/2` (`mse`).
    #[cfg_attr(feature = "serde", serde(rename = "mse", alias = "k2"))]
    K2,
    /// `k3 = eˣ − x − 1` with x = −δ (`low_var_kl`), clamped as in the module table; ≥ 0.
    /// The default: the estimator of the KL loss term.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "low_var_kl", alias = "k3"))]
    K3,
    /// `k1+`: the value of k1 with the gradient of k2 (straight-through).
    #[cfg_attr(feature = "serde", serde(rename = "k1+", alias = "kl+"))]
    K1Plus,
    /// `k3+`: the value of k3 with the gradient of k2 (straight-through).
    #[cfg_attr(feature = "serde", serde(rename = "k3+", alias = "low_var_kl+"))]
    K3Plus,
}

impl KlEstimator {
    /// Every estimator, in declaration order.
    pub const ALL: [KlEstimator; 6] = [
        KlEstimator::K1,
        KlEstimator::Abs,
        KlEstimator::K2,
        KlEstimator::K3,
        KlEstimator::K1Plus,
        KlEstimator::K3Plus,
    ];

    /// The configuration name: `"k1"`, `"abs"`, `"k2"`, `"k3"`, `"k1+"`, `"k3+"`.
    pub fn name(self) -> &'static str {
        match self {
            KlEstimator::K1 => "k1",
            KlEstimator::Abs => "abs",
            KlEstimator::K2 => "k2",
            KlEstimator::K3 => "k3",
            KlEstimator::K1Plus => "k1+",
            KlEstimator::K3Plus => "k3+",
        }
    }

    /// The estimator whose *value* this one reports: k1 for `k1+`, k3 for `k3+`, itself
    /// otherwise (a value-only kernel needs nothing else).
    pub fn value_estimator(self) -> KlEstimator {
        match self {
            KlEstimator::K1Plus => KlEstimator::K1,
            KlEstimator::K3Plus => KlEstimator::K3,
            other => other,
        }
    }

    /// Parses a configuration name: [`name`](Self::name)'s output or the verl/OpenRLHF
    /// aliases `"kl"` (k1), `"mse"` (k2), `"low_var_kl"` (k3). `None` for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "k1" | "kl" => Some(KlEstimator::K1),
            "abs" => Some(KlEstimator::Abs),
            "k2" | "mse" => Some(KlEstimator::K2),
            "k3" | "low_var_kl" => Some(KlEstimator::K3),
            "k1+" | "kl+" => Some(KlEstimator::K1Plus),
            "k3+" | "low_var_kl+" => Some(KlEstimator::K3Plus),
            _ => None,
        }
    }

    /// `k(logπ − logπ_ref)`; see [`kl_penalty`].
    #[inline]
    pub fn penalty<F: Float>(self, logp: F, logp_ref: F) -> F {
        kl_penalty(logp, logp_ref, self)
    }

    /// `(k, dk/dlogπ)`; see [`kl_penalty_and_grad`].
    #[inline]
    pub fn penalty_and_grad<F: Float>(self, logp: F, logp_ref: F) -> (F, F) {
        kl_penalty_and_grad(logp, logp_ref, self)
    }
}

/// The per-token KL penalty `k(δ)`, δ = `logp − logp_ref`, of `estimator` (formulas in the
/// [module table](self)).
///
/// Total: NaN in either input gives NaN (k1, abs, k2, k3); ±∞ gives ±∞ for k1/abs/k2 and the
/// clamped value 10 for k3. k3 is never negative (its lower clamp −10 cannot engage because
/// eˣ − x − 1 ≥ 0). Spec vector: k3(−1.0, −1.5) = e^−0.5 − 0.5 = 0.1065307,
/// k3(−2, −1) = e − 2 = 0.7182818.
#[inline]
pub fn kl_penalty<F: Float>(logp: F, logp_ref: F, estimator: KlEstimator) -> F {
    kl_penalty_and_grad(logp, logp_ref, estimator).0
}

/// The per-token KL penalty and its exact derivative with respect to `logp` (logπ), for a
/// hand-written backward pass: `(k, dk/dlogπ)`.
///
/// - k1: `(δ, 1)`; k2: `(δ²/2, δ)`;
/// - abs: `(|δ|, sign δ)`, with the subgradient 0 chosen at δ = 0;
/// - k3: `(k, 1 − eˣ)` with x = −δ, and derivative 0 wherever either clamp is active
///   (|δ| > 20 or eˣ − x − 1 > 10, i.e. roughly δ < −2.6 or δ > 11);
/// - k1+: `(δ, δ)`; k3+: `(k3's k, δ)` (straight-through: k2's gradient, no clamp).
///
/// Total; NaN inputs give a NaN value (see [`kl_penalty`]).
#[inline]
pub fn kl_penalty_and_grad<F: Float>(logp: F, logp_ref: F, estimator: KlEstimator) -> (F, F) {
    let delta = logp - logp_ref;
    match estimator {
        KlEstimator::K1 => K1::eval(delta),
        KlEstimator::Abs => Abs::eval(delta),
        KlEstimator::K2 => K2::eval(delta),
        KlEstimator::K3 => K3::eval(delta),
        KlEstimator::K1Plus => K1Plus::eval(delta),
        KlEstimator::K3Plus => K3Plus::eval(delta),
    }
}

/// The dynamic token-level KL weight `β_t = beta · (hwe ? low_ratio : 1)`: high-window-entropy
/// tokens (reasoning forks) are held to the reference less tightly. Total (no validation;
/// [`token_kl`] validates its inputs).
#[inline]
pub fn dynamic_kl_weight<F: Float>(beta: F, hwe: bool, low_ratio: F) -> F {
    if hwe { beta * low_ratio } else { beta }
}

// ---------------------------------------------------------------------------------------------
// Per-token kernels. Zero-sized types so the token loops are monomorphised per estimator.

trait Estimate {
    /// `(k(δ), dk/dδ)`; dk/dlogπ = dk/dδ.
    fn eval<F: Float>(delta: F) -> (F, F);
}

struct K1;
struct Abs;
struct K2;
struct K3;
struct K1Plus;
struct K3Plus;

impl Estimate for K1 {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        (d, F::one())
    }
}

impl Estimate for Abs {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        let g = select(
            d > F::zero(),
            F::one(),
            select(d < F::zero(), -F::one(), F::zero()),
        );
        (d.abs(), g)
    }
}

impl Estimate for K2 {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        (d * d * cast::<F>(0.5), d)
    }
}

impl Estimate for K3 {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        // Outside [−12, 3], eˣ − x − 1 > 10.9, so the value clamp is active and the result
        // is 10 with derivative 0 whatever x is; clamping x there first keeps the
        // exponential kernel on a short range (and covers the ±20 exponent clamp). The
        // comparisons are written so NaN passes through.
        let x = -d;
        let x = select(x > cast(3.0), cast(3.0), x);
        let x = select(x < cast(-12.0), cast(-12.0), x);
        let (k, em1) = exp_m1_minus_x(x);
        let hi = cast::<F>(K3_VALUE_CLAMP);
        let clamped = k > hi;
        (select(clamped, hi, k), select(clamped, F::zero(), -em1))
    }
}

impl Estimate for K1Plus {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        (d, d)
    }
}

impl Estimate for K3Plus {
    #[inline(always)]
    fn eval<F: Float>(d: F) -> (F, F) {
        (K3::eval(d).0, d)
    }
}

/// `(eˣ − 1 − x, eˣ − 1)` for x ∈ [−12, 3], branch-free.
///
/// x = n·ln2 + r with n = round(x·log₂e), |r| ≤ ln2/2; `eʳ − 1 = r + r²·h(r)` by a Taylor
/// polynomial (degree 13 for `f64`, 7 for `f32`: truncation below half an ulp); `2ⁿ` by five
/// masked multiplies. For n = 0 (|x| ≲ 0.35) `eˣ − 1 − x = r²·h(r)` exactly in form, so k3
/// keeps full relative precision where it is O(x²).
#[inline(always)]
fn exp_m1_minus_x<F: Float>(x: F) -> (F, F) {
    let one = F::one();
    // round to nearest by the 1.5·2^p shifter trick (no libm call, vectorises)
    let shifter = cast::<F>(1.5) / F::epsilon();
    let n = (x * cast(core::f64::consts::LOG2_E) + shifter) - shifter;
    let r = (x - n * cast(LN2_HI)) - n * cast(LN2_LO);
    // h(r) = Σ r^k / (k+2)!
    let h = if F::epsilon() > cast(1e-10) {
        let mut h = cast::<F>(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5] {
            h = h * r + cast(c);
        }
        h
    } else {
        let mut h = cast::<F>(1.0 / 6_227_020_800.0);
        for c in [
            1.0 / 479_001_600.0,
            1.0 / 39_916_800.0,
            1.0 / 3_628_800.0,
            1.0 / 362_880.0,
            1.0 / 40_320.0,
            1.0 / 5040.0,
            1.0 / 720.0,
            1.0 / 120.0,
            1.0 / 24.0,
            1.0 / 6.0,
            0.5,
        ] {
            h = h * r + cast(c);
        }
        h
    };
    let r2h = r * r * h;
    let q = r + r2h; // eʳ − 1
    // 2ⁿ for n ∈ [−17, 4]: k = n + 17 ∈ [0, 21], five bits
    let mut k = n + cast(17.0);
    let mut s = cast::<F>(1.0 / 131_072.0);
    for (bit, pow) in [
        (16.0, 65536.0),
        (8.0, 256.0),
        (4.0, 16.0),
        (2.0, 4.0),
        (1.0, 2.0),
    ] {
        let take = k >= cast(bit);
        // selects against zero compile to a single AND each
        k = k - select(take, cast(bit), F::zero());
        s = s * (F::one() + select(take, cast::<F>(pow - 1.0), F::zero()));
    }
    let em1 = s * q + (s - one);
    // for n = 0, eˣ − 1 − x is r²h exactly in form (no cancellation of x against eˣ − 1)
    let near = n == F::zero();
    (select(near, r2h, em1 - x), em1)
}

// ---------------------------------------------------------------------------------------------
// Fused token pass.

/// The KL coefficient β_r of each row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlCoefficient<'a, F> {
    /// One β for every row (fixed or adaptive controller).
    Uniform(F),
    /// β per row, e.g. the dual-ascent λ_d of each sample's difficulty bucket; length `rows`.
    PerRow(&'a [F]),
}

/// What [`token_kl`] computes: the estimator, the per-row coefficient and the dynamic
/// (HWE) weighting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenKlConfig<'a, F> {
    /// The per-token estimator.
    pub estimator: KlEstimator,
    /// β_r per row; must be finite and ≥ 0.
    pub coefficient: KlCoefficient<'a, F>,
    /// Optional 0/1 `[rows, cols]` mask of high-window-entropy tokens; `None` = no token is HWE
    /// (plain token-level KL).
    pub hwe_mask: Option<&'a [F]>,
    /// Weight factor of HWE tokens, in [0, 1] (default [`DEFAULT_LOW_RATIO`]).
    pub low_ratio: F,
}

impl<'a, F: Float> TokenKlConfig<'a, F> {
    /// Plain token-level KL: no HWE mask, `low_ratio` = 0.5.
    pub fn new(estimator: KlEstimator, coefficient: KlCoefficient<'a, F>) -> Self {
        TokenKlConfig {
            estimator,
            coefficient,
            hwe_mask: None,
            low_ratio: cast(DEFAULT_LOW_RATIO),
        }
    }

    /// Dynamic token-level KL: HWE tokens weighted by `low_ratio`.
    pub fn with_hwe(mut self, hwe_mask: &'a [F], low_ratio: F) -> Self {
        self.hwe_mask = Some(hwe_mask);
        self.low_ratio = low_ratio;
        self
    }
}

/// Optional outputs of [`token_kl`]; each one that is `Some` must have the stated length and
/// is overwritten. Padded positions (mask 0) receive 0.
#[derive(Debug)]
pub struct TokenKlOutputs<'a, F> {
    /// `k_t · m_t`, `[rows, cols]`.
    pub kl: Option<&'a mut [F]>,
    /// `β_t · k_t · m_t`, `[rows, cols]`: the KL term folded into token rewards or
    /// aggregated into the loss.
    pub weighted: Option<&'a mut [F]>,
    /// `β_t · m_t · dk_t/dlogπ_t` = ∂(weighted_t)/∂logπ_t, `[rows, cols]`.
    pub grad: Option<&'a mut [F]>,
    /// `Σ_t β_t · k_t · m_t` per row, `[rows]`.
    pub row_weighted_sum: Option<&'a mut [F]>,
    /// Mean of `k_t` over the row's valid tokens (0 for a row without valid token), `[rows]`:
    /// the "mean per-sequence KL" of dual ascent.
    pub row_mean_kl: Option<&'a mut [F]>,
}

impl<F> Default for TokenKlOutputs<'_, F> {
    fn default() -> Self {
        TokenKlOutputs {
            kl: None,
            weighted: None,
            grad: None,
            row_weighted_sum: None,
            row_mean_kl: None,
        }
    }
}

/// Batch totals returned by [`token_kl`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenKlSummary<F> {
    /// `Σ_{r,t} β_t · k_t · m_t`.
    pub weighted_sum: F,
    /// `Σ_{r,t} k_t · m_t`.
    pub kl_sum: F,
    /// `Σ m`: number of valid tokens.
    pub valid_tokens: usize,
    /// Rows with at least one valid token.
    pub nonempty_rows: usize,
    /// `kl_sum / valid_tokens` (0 without valid token).
    pub token_mean_kl: F,
    /// Mean over non-empty rows of the row's mean KL (0 without such a row).
    pub seq_mean_kl: F,
}

/// The fused dynamic token-level KL pass (docs/algorithms.md §4) over padded `[rows, cols]` tensors: for
/// every token, δ = logp − logp_ref, `k_t` by `cfg.estimator`, `β_t = β_r·(hwe_t ?
/// low_ratio : 1)`; writes the requested [`TokenKlOutputs`] and returns the
/// [`TokenKlSummary`]. One pass over the inputs; validation is fused into it.
///
/// All positions (padded ones too) of `logp` and `logp_ref` must be finite; `mask` and
/// `hwe_mask` must hold only 0 and 1. This is the fused op a GPU kernel mirrors.
///
/// Errors: a length differing from `rows × cols` (or `rows` for per-row inputs/outputs)
/// → [`Error::LengthMismatch`]; NaN/±∞ → [`Error::NonFinite`] (first offending argument in
/// argument order within the first offending row, with its flat index); a mask value other
/// than 0/1 → [`Error::InvalidMask`]; β < 0 or not
/// finite, `low_ratio` ∉ [0, 1] → [`Error::OutOfRange`]; finite inputs whose penalty
/// overflows (k2 of |δ| ≳ 1e154, or 1e19 in `f32`) → [`Error::OutOfRange`] on
/// `"kl penalty"`. On error the outputs hold unspecified values.
pub fn token_kl<F: Float>(
    shape: Shape,
    logp: &[F],
    logp_ref: &[F],
    mask: &[F],
    cfg: &TokenKlConfig<'_, F>,
    out: TokenKlOutputs<'_, F>,
) -> Result<TokenKlSummary<F>> {
    shape.check("logp", logp.len())?;
    shape.check("logp_ref", logp_ref.len())?;
    shape.check("mask", mask.len())?;
    if let Some(h) = cfg.hwe_mask {
        shape.check("hwe_mask", h.len())?;
    }
    let len = shape.len()?;
    for (what, o) in [
        ("kl (output)", &out.kl),
        ("weighted (output)", &out.weighted),
        ("grad (output)", &out.grad),
    ] {
        if let Some(o) = o {
            check_len(what, len, o.len())?;
        }
    }
    if let Some(o) = &out.row_weighted_sum {
        check_len("row_weighted_sum (output)", shape.rows, o.len())?;
    }
    if let Some(o) = &out.row_mean_kl {
        check_len("row_mean_kl (output)", shape.rows, o.len())?;
    }
    check_weighting(shape, cfg.coefficient, cfg.low_ratio)?;
    let args = Args {
        shape,
        logp,
        logp_ref,
        mask,
        cfg,
    };
    match (cfg.estimator, cfg.hwe_mask) {
        (KlEstimator::K1, None) => run::<F, K1, false>(&args, out),
        (KlEstimator::K1, Some(_)) => run::<F, K1, true>(&args, out),
        (KlEstimator::Abs, None) => run::<F, Abs, false>(&args, out),
        (KlEstimator::Abs, Some(_)) => run::<F, Abs, true>(&args, out),
        (KlEstimator::K2, None) => run::<F, K2, false>(&args, out),
        (KlEstimator::K2, Some(_)) => run::<F, K2, true>(&args, out),
        (KlEstimator::K3, None) => run::<F, K3, false>(&args, out),
        (KlEstimator::K3, Some(_)) => run::<F, K3, true>(&args, out),
        (KlEstimator::K1Plus, None) => run::<F, K1Plus, false>(&args, out),
        (KlEstimator::K1Plus, Some(_)) => run::<F, K1Plus, true>(&args, out),
        (KlEstimator::K3Plus, None) => run::<F, K3Plus, false>(&args, out),
        (KlEstimator::K3Plus, Some(_)) => run::<F, K3Plus, true>(&args, out),
    }
}

/// `low_ratio` in [0, 1]; β (one, or one per row of `shape`) finite and ≥ 0.
fn check_weighting<F: Float>(
    shape: Shape,
    coefficient: KlCoefficient<'_, F>,
    low_ratio: F,
) -> Result<()> {
    check_param(
        "low_ratio",
        low_ratio,
        low_ratio >= F::zero() && low_ratio <= F::one(),
        "in [0, 1]",
    )?;
    match coefficient {
        KlCoefficient::Uniform(b) => check_param("kl_coef (β)", b, b >= F::zero(), ">= 0"),
        KlCoefficient::PerRow(bs) => {
            check_len("kl_coef (β per row)", shape.rows, bs.len())?;
            check_finite("kl_coef (β per row)", bs)?;
            match bs.iter().position(|&b| b < F::zero()) {
                None => Ok(()),
                Some(index) => Err(Error::OutOfRange {
                    what: "kl_coef (β per row)",
                    value: to_f64(bs.get(index).copied().unwrap_or_else(F::nan)),
                    expected: ">= 0",
                }),
            }
        }
    }
}

/// The weight each token's KL carries, `β_t·m_t` with `β_t =`
/// [`dynamic_kl_weight`]`(β_r, hwe_t, low_ratio)`, written into `out` (`[rows, cols]`; 0 on
/// padded tokens): what [`token_kl`] multiplies `k_t` by, for a trainer that charges the KL
/// elsewhere — e.g. in an actor's loss in another process, which then needs only these
/// weights, the log-probabilities and the estimator.
///
/// Errors: a length differing from `rows × cols` (or `rows` for β per row) →
/// [`Error::LengthMismatch`]; a `mask` or `hwe_mask` value other than 0/1 →
/// [`Error::InvalidMask`]; β < 0 or not finite, `low_ratio` ∉ [0, 1] → [`Error::OutOfRange`]
/// (as [`token_kl`]). On error `out` is unchanged.
pub fn dynamic_kl_weights<F: Float>(
    shape: Shape,
    coefficient: KlCoefficient<'_, F>,
    mask: &[F],
    hwe_mask: Option<&[F]>,
    low_ratio: F,
    out: &mut [F],
) -> Result<()> {
    shape.check("mask", mask.len())?;
    check_len("weights (output)", shape.len()?, out.len())?;
    check_mask("mask", mask)?;
    if let Some(h) = hwe_mask {
        shape.check("hwe_mask", h.len())?;
        check_mask("hwe_mask", h)?;
    }
    check_weighting(shape, coefficient, low_ratio)?;
    if shape.cols == 0 {
        return Ok(());
    }
    for (r, (o, m)) in out
        .chunks_exact_mut(shape.cols)
        .zip(mask.chunks_exact(shape.cols))
        .enumerate()
    {
        let beta = match coefficient {
            KlCoefficient::Uniform(b) => b,
            KlCoefficient::PerRow(bs) => bs.get(r).copied().unwrap_or_else(F::zero),
        };
        let h = hwe_mask.map(|h| lanes::row(h, shape.cols, r));
        for (t, (o, &m)) in o.iter_mut().zip(m).enumerate() {
            let hwe = h.and_then(|h| h.get(t)).is_some_and(|&x| x != F::zero());
            *o = select(
                m != F::zero(),
                dynamic_kl_weight(beta, hwe, low_ratio),
                F::zero(),
            );
        }
    }
    Ok(())
}

/// Per-token KL `k_t · m_t` of `estimator` over a `[rows, cols]` tensor into `kl_out`, with
/// the batch totals (`weighted_sum` = `kl_sum`: β = 1). Shorthand for [`token_kl`] with
/// `KlCoefficient::Uniform(1)`, no HWE mask and only the `kl` output; same errors.
pub fn masked_kl<F: Float>(
    shape: Shape,
    logp: &[F],
    logp_ref: &[F],
    mask: &[F],
    estimator: KlEstimator,
    kl_out: &mut [F],
) -> Result<TokenKlSummary<F>> {
    let cfg = TokenKlConfig::new(estimator, KlCoefficient::Uniform(F::one()));
    token_kl(
        shape,
        logp,
        logp_ref,
        mask,
        &cfg,
        TokenKlOutputs {
            kl: Some(kl_out),
            ..TokenKlOutputs::default()
        },
    )
}

struct Args<'x, 'c, F> {
    shape: Shape,
    logp: &'x [F],
    logp_ref: &'x [F],
    mask: &'x [F],
    cfg: &'x TokenKlConfig<'c, F>,
}

/// Accumulators of one row: block slots for the float sums, an exact count, a "bad" flag.
struct Acc<F> {
    k: Block<F>,
    wk: Block<F>,
    count: usize,
    bad: bool,
}

/// Output slices of one block (scratch where an output is not requested).
struct BlockOut<'o, F> {
    k: &'o mut [F],
    wk: &'o mut [F],
    g: &'o mut [F],
}

/// Inputs of one block.
struct BlockIn<'i, F> {
    lp: &'i [F],
    lr: &'i [F],
    m: &'i [F],
    h: &'i [F],
}

/// One block of a row: an element-wise loop over the block (so it vectorises) that writes
/// the token outputs and adds into the accumulator slots.
#[inline(always)]
fn block<F: Float, E: Estimate, const HWE: bool>(
    x: BlockIn<'_, F>,
    beta: F,
    beta_lo: F,
    acc: &mut Acc<F>,
    o: BlockOut<'_, F>,
) {
    // indexed loop over a block of known length ≤ BLOCK: bounds checks fold away and the
    // loop vectorises (deeply zipped iterators do not)
    let n = (x.lp.len().min(x.lr.len()).min(x.m.len()).min(x.h.len()))
        .min(o.k.len().min(o.wk.len()).min(o.g.len()))
        .min(BLOCK);
    let (Some(lp), Some(lr), Some(m), Some(h)) =
        (x.lp.get(..n), x.lr.get(..n), x.m.get(..n), x.h.get(..n))
    else {
        return;
    };
    let (Some(ok), Some(owk), Some(og)) = (o.k.get_mut(..n), o.wk.get_mut(..n), o.g.get_mut(..n))
    else {
        return;
    };
    let mut count = 0u32;
    let mut bad = false;
    for i in 0..n {
        let (lp, lr, m, h) = (lp[i], lr[i], m[i], h[i]);
        let d = lp - lr;
        let (k, g) = E::eval(d);
        // select, not multiply: a k of ±∞ (k1/k2 of a huge δ) on a padded token stays out
        let on = m != F::zero();
        let k = select(on, k, F::zero());
        let g = select(on, g, F::zero());
        let w = if HWE {
            select(h != F::zero(), beta_lo, beta)
        } else {
            beta
        };
        let wk = w * k;
        ok[i] = k;
        owk[i] = wk;
        og[i] = w * g;
        acc.k[i] = acc.k[i] + k;
        acc.wk[i] = acc.wk[i] + wk;
        count += u32::from(on);
        // δ is finite iff both log-probs are (or it overflowed: the rescan sorts that out)
        bad |= bad_value(d) | bad_mask(m);
        if HWE {
            bad |= bad_mask(h);
        }
    }
    acc.count += count as usize;
    acc.bad |= bad;
}

/// The next output block of an optional output, or the matching part of a scratch block.
#[inline(always)]
fn out_block<'x, 's: 'x, F>(
    it: &mut Option<core::slice::ChunksMut<'s, F>>,
    scratch: &'x mut [F],
    n: usize,
) -> &'x mut [F] {
    match it.as_mut().and_then(|it| it.next()) {
        Some(o) => o,
        None => scratch.get_mut(..n).unwrap_or(&mut []),
    }
}

fn run<F: Float, E: Estimate, const HWE: bool>(
    a: &Args<'_, '_, F>,
    out: TokenKlOutputs<'_, F>,
) -> Result<TokenKlSummary<F>> {
    let Shape { rows, cols } = a.shape;
    let TokenKlOutputs {
        mut kl,
        mut weighted,
        mut grad,
        mut row_weighted_sum,
        mut row_mean_kl,
    } = out;
    // without an HWE mask the kernel ignores `h`; any slice of the right length will do
    let hwe = a.cfg.hwe_mask.unwrap_or(a.mask);
    let (mut sk, mut swk, mut sg): (Block<F>, Block<F>, Block<F>) =
        (lanes::zeros(), lanes::zeros(), lanes::zeros());
    let mut total_wk = Sum::new();
    let mut total_k = Sum::new();
    let mut seq_mean = Sum::new();
    let mut valid = 0usize;
    let mut nonempty = 0usize;
    for r in 0..rows {
        let beta = match a.cfg.coefficient {
            KlCoefficient::Uniform(b) => b,
            KlCoefficient::PerRow(bs) => bs.get(r).copied().unwrap_or_else(F::zero),
        };
        let beta_lo = beta * a.cfg.low_ratio;
        let mut acc = Acc {
            k: lanes::zeros(),
            wk: lanes::zeros(),
            count: 0,
            bad: false,
        };
        let mut o_k = kl
            .as_deref_mut()
            .map(|s| lanes::row_mut(s, cols, r).chunks_mut(BLOCK));
        let mut o_wk = weighted
            .as_deref_mut()
            .map(|s| lanes::row_mut(s, cols, r).chunks_mut(BLOCK));
        let mut o_g = grad
            .as_deref_mut()
            .map(|s| lanes::row_mut(s, cols, r).chunks_mut(BLOCK));
        let ins = (lanes::row(a.logp, cols, r).chunks(BLOCK))
            .zip(lanes::row(a.logp_ref, cols, r).chunks(BLOCK))
            .zip(
                (lanes::row(a.mask, cols, r).chunks(BLOCK))
                    .zip(lanes::row(hwe, cols, r).chunks(BLOCK)),
            );
        for ((lp, lr), (m, h)) in ins {
            let n = lp.len();
            let o = BlockOut {
                k: out_block(&mut o_k, &mut sk, n),
                wk: out_block(&mut o_wk, &mut swk, n),
                g: out_block(&mut o_g, &mut sg, n),
            };
            block::<F, E, HWE>(BlockIn { lp, lr, m, h }, beta, beta_lo, &mut acc, o);
        }
        if acc.bad {
            revalidate_row(a, r)?;
        }
        let (k, wk, cnt_u) = (lanes::total(&acc.k), lanes::total(&acc.wk), acc.count);
        let row_mean = if cnt_u > 0 {
            k / cast(cnt_u as f64)
        } else {
            F::zero()
        };
        if let Some(o) = row_weighted_sum.as_deref_mut().and_then(|s| s.get_mut(r)) {
            *o = wk;
        }
        if let Some(o) = row_mean_kl.as_deref_mut().and_then(|s| s.get_mut(r)) {
            *o = row_mean;
        }
        total_wk.add(wk);
        total_k.add(k);
        if cnt_u > 0 {
            nonempty += 1;
            valid = valid.saturating_add(cnt_u);
            seq_mean.add(row_mean);
        }
    }
    let (weighted_sum, kl_sum) = (total_wk.value(), total_k.value());
    for v in [weighted_sum, kl_sum] {
        if !v.is_finite() {
            return Err(Error::OutOfRange {
                what: "kl penalty (sum over tokens)",
                value: to_f64(v),
                expected: "finite (|logp − logp_ref| too large for the estimator)",
            });
        }
    }
    Ok(TokenKlSummary {
        weighted_sum,
        kl_sum,
        valid_tokens: valid,
        nonempty_rows: nonempty,
        token_mean_kl: if valid > 0 {
            kl_sum / cast(valid as f64)
        } else {
            F::zero()
        },
        seq_mean_kl: if nonempty > 0 {
            seq_mean.value() / cast(nonempty as f64)
        } else {
            F::zero()
        },
    })
}

/// The slow, precise check of row `r`, run only after its fused check failed: names the
/// first offending argument (in argument order) and its flat index. `Ok` when the flag came
/// from a finite δ that overflowed, which is not an error.
#[cold]
fn revalidate_row<F: Float>(a: &Args<'_, '_, F>, r: usize) -> Result<()> {
    let cols = a.shape.cols;
    let offset = r.saturating_mul(cols);
    let at = |e: Error| match e {
        Error::NonFinite { what, index } => Error::NonFinite {
            what,
            index: offset + index,
        },
        Error::InvalidMask { what, index } => Error::InvalidMask {
            what,
            index: offset + index,
        },
        e => e,
    };
    check_finite("logp", lanes::row(a.logp, cols, r)).map_err(at)?;
    check_finite("logp_ref", lanes::row(a.logp_ref, cols, r)).map_err(at)?;
    check_mask("mask", lanes::row(a.mask, cols, r)).map_err(at)?;
    if let Some(h) = a.cfg.hwe_mask {
        check_mask("hwe_mask", lanes::row(h, cols, r)).map_err(at)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Controllers.

/// The adaptive KL controller (Ziegler et al.; verl/OpenRLHF `AdaptiveKLController`):
/// after each step with observed KL and N samples,
/// `e = clip(KL/target − 1, −0.2, 0.2)`, `β ← β·(1 + e·N/horizon)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveKlController<F> {
    value: F,
    target: F,
    horizon: F,
}

impl<F: Float> AdaptiveKlController<F> {
    /// A controller starting at `init_kl_coef` (finite, ≥ 0) steering toward `target`
    /// (finite, > 0; default [`ADAPTIVE_KL_TARGET`]) over `horizon` samples (finite, > 0;
    /// default [`ADAPTIVE_KL_HORIZON`]). Errors: [`Error::OutOfRange`] naming the parameter.
    pub fn new(init_kl_coef: F, target: F, horizon: F) -> Result<Self> {
        check_param(
            "init_kl_coef",
            init_kl_coef,
            init_kl_coef >= F::zero(),
            ">= 0",
        )?;
        check_param("kl_target", target, target > F::zero(), "> 0")?;
        check_param("kl_horizon", horizon, horizon > F::zero(), "> 0")?;
        Ok(AdaptiveKlController {
            value: init_kl_coef,
            target,
            horizon,
        })
    }

    /// The current coefficient β.
    #[inline]
    pub fn value(&self) -> F {
        self.value
    }

    /// The target KL.
    #[inline]
    pub fn target(&self) -> F {
        self.target
    }

    /// The horizon in samples.
    #[inline]
    pub fn horizon(&self) -> F {
        self.horizon
    }

    /// One update from the step's observed KL (`current_kl`, finite) and its number of
    /// samples `n_samples`: `e = clip(current_kl/target − 1, ±0.2)`,
    /// `β ← β·(1 + e·n_samples/horizon)`. Returns the new β.
    ///
    /// Errors (β unchanged): non-finite `current_kl` → [`Error::NonFinite`];
    /// `0.2·n_samples/horizon ≥ 1`, which could drive β to 0 or below →
    /// [`Error::OutOfRange`] on `"n_samples"`; a new β that overflows →
    /// [`Error::OutOfRange`] on `"kl_coef"`.
    pub fn update(&mut self, current_kl: F, n_samples: usize) -> Result<F> {
        if !current_kl.is_finite() {
            return Err(Error::NonFinite {
                what: "current_kl",
                index: 0,
            });
        }
        let clip = cast::<F>(ADAPTIVE_KL_ERROR_CLIP);
        let n = cast::<F>(n_samples as f64);
        let step = n / self.horizon;
        if clip * step >= F::one() {
            return Err(Error::OutOfRange {
                what: "n_samples",
                value: n_samples as f64,
                expected: "< 5 × kl_horizon (else the adaptive step could make β ≤ 0)",
            });
        }
        let e = current_kl / self.target - F::one();
        let e = select(e > clip, clip, select(e < -clip, -clip, e));
        let next = self.value * (F::one() + e * step);
        if !next.is_finite() {
            return Err(Error::OutOfRange {
                what: "kl_coef",
                value: to_f64(next),
                expected: "finite after the adaptive update",
            });
        }
        self.value = next;
        Ok(next)
    }
}

/// A KL coefficient controller: fixed or adaptive. (Dual ascent per difficulty bucket lives
/// in [`crate::difficulty`]; its λ_d feed [`KlCoefficient::PerRow`].)
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlController<F> {
    /// β never changes.
    Fixed(F),
    /// See [`AdaptiveKlController`].
    Adaptive(AdaptiveKlController<F>),
}

impl<F: Float> KlController<F> {
    /// A fixed coefficient (finite, ≥ 0; else [`Error::OutOfRange`] on `"kl_coef"`).
    pub fn fixed(kl_coef: F) -> Result<Self> {
        check_param("kl_coef", kl_coef, kl_coef >= F::zero(), ">= 0")?;
        Ok(KlController::Fixed(kl_coef))
    }

    /// An adaptive controller; see [`AdaptiveKlController::new`].
    pub fn adaptive(init_kl_coef: F, target: F, horizon: F) -> Result<Self> {
        AdaptiveKlController::new(init_kl_coef, target, horizon).map(KlController::Adaptive)
    }

    /// The current coefficient β.
    #[inline]
    pub fn value(&self) -> F {
        match self {
            KlController::Fixed(b) => *b,
            KlController::Adaptive(c) => c.value(),
        }
    }

    /// Feeds one step's observed KL and sample count; returns the new β. A fixed controller
    /// only checks that `current_kl` is finite. Errors as [`AdaptiveKlController::update`].
    pub fn update(&mut self, current_kl: F, n_samples: usize) -> Result<F> {
        match self {
            KlController::Fixed(b) => {
                if current_kl.is_finite() {
                    Ok(*b)
                } else {
                    Err(Error::NonFinite {
                        what: "current_kl",
                        index: 0,
                    })
                }
            }
            KlController::Adaptive(c) => c.update(current_kl, n_samples),
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    /// k3 the textbook way, in f64 with libm.
    fn k3_ref(logp: f64, logp_ref: f64) -> f64 {
        let x = (logp_ref - logp).clamp(-20.0, 20.0);
        (libm::expm1(x) - x).clamp(-10.0, 10.0)
    }

    #[test]
    fn spec_vector_8() {
        // e^−0.5 − (−0.5) − 1 = 0.6065307 − 0.5 = 0.1065307; e − 1 − 1 = 0.7182818
        let a = kl_penalty(-1.0, -1.5, KlEstimator::K3);
        let b = kl_penalty(-2.0, -1.0, KlEstimator::K3);
        assert!((a - 0.1065307).abs() < 5e-8 && (b - 0.7182818).abs() < 5e-8);
        assert!((a - 0.106_530_659_712_633_4).abs() < 1e-15);
        assert!((b - (core::f64::consts::E - 2.0)).abs() < 1e-15);
        let a32 = kl_penalty(-1.0f32, -1.5, KlEstimator::K3);
        assert!((a32 - 0.1065307).abs() < 1e-7);
    }

    #[test]
    fn dynamic_kl_weights_hand_checked_and_equal_token_kls_weighting() {
        // 2 × 3: row 0 β 0.2, row 1 β 0.1; the last token of row 1 padded; (0,1) and (1,0) HWE
        let shape = Shape::new(2, 3);
        let (mask, hwe, beta) = (
            [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
            [0.0, 1.0, 0.0, 1.0, 0.0, 1.0],
            [0.2, 0.1],
        );
        let mut w = [f64::NAN; 6];
        dynamic_kl_weights(
            shape,
            KlCoefficient::PerRow(&beta),
            &mask,
            Some(&hwe),
            0.25,
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0.2, 0.05, 0.2, 0.025, 0.1, 0.0]);
        dynamic_kl_weights(
            shape,
            KlCoefficient::Uniform(0.5),
            &mask,
            None,
            0.25,
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0.5, 0.5, 0.5, 0.5, 0.5, 0.0]);
        // what token_kl charges: weighted = w · kl, token by token
        let (lp, lr) = (
            [-1.0, -0.5, -2.0, -0.1, -3.0, 0.0],
            [-1.2, -0.4, -1.0, -0.3, -2.0, 0.0],
        );
        let cfg =
            TokenKlConfig::new(KlEstimator::K3, KlCoefficient::PerRow(&beta)).with_hwe(&hwe, 0.25);
        let (mut kl, mut wk, mut g) = ([0.0; 6], [0.0; 6], [0.0; 6]);
        let outs = TokenKlOutputs {
            kl: Some(&mut kl),
            weighted: Some(&mut wk),
            grad: Some(&mut g),
            ..Default::default()
        };
        token_kl(shape, &lp, &lr, &mask, &cfg, outs).unwrap();
        dynamic_kl_weights(
            shape,
            KlCoefficient::PerRow(&beta),
            &mask,
            Some(&hwe),
            0.25,
            &mut w,
        )
        .unwrap();
        for t in 0..6 {
            assert_eq!(wk[t], w[t] * kl[t], "token {t}");
            let (_, dk) = kl_penalty_and_grad(lp[t], lr[t], KlEstimator::K3);
            assert_eq!(g[t], w[t] * dk * mask[t], "token {t}");
        }
    }

    #[test]
    fn dynamic_kl_weights_errors_name_the_argument_and_write_nothing() {
        // (the error's kind, the argument it names)
        fn named(e: Error) -> (&'static str, &'static str) {
            match e {
                Error::InvalidMask { what, .. } => ("mask", what),
                Error::OutOfRange { what, .. } => ("range", what),
                Error::LengthMismatch { what, .. } => ("length", what),
                _ => ("other", ""),
            }
        }
        let shape = Shape::new(1, 2);
        let mut w = [7.0f32; 2];
        let uni = KlCoefficient::Uniform(0.1f32);
        let ones = [1.0f32, 1.0];
        let per_row = |b: &'static [f32]| KlCoefficient::PerRow(b);
        let cases: [(Result<()>, (&str, &str)); 5] = [
            (
                dynamic_kl_weights(shape, uni, &[1.0, 0.5], None, 0.5, &mut w),
                ("mask", "mask"),
            ),
            (
                dynamic_kl_weights(shape, uni, &ones, Some(&[2.0, 0.0]), 0.5, &mut w),
                ("mask", "hwe_mask"),
            ),
            (
                dynamic_kl_weights(shape, uni, &ones, None, 1.5, &mut w),
                ("range", "low_ratio"),
            ),
            (
                dynamic_kl_weights(shape, per_row(&[-0.1]), &ones, None, 0.5, &mut w),
                ("range", "kl_coef (β per row)"),
            ),
            (
                dynamic_kl_weights(shape, per_row(&[0.1, 0.2]), &ones, None, 0.5, &mut w),
                ("length", "kl_coef (β per row)"),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(named(got.unwrap_err()), want);
        }
        let short = dynamic_kl_weights(shape, uni, &ones, None, 0.5, &mut [0.0; 3]).unwrap_err();
        assert_eq!(named(short), ("length", "weights (output)"));
        assert_eq!(w, [7.0; 2]);
    }

    #[test]
    fn estimators_hand_checked() {
        // δ = 0.5
        assert_eq!(kl_penalty_and_grad(0.0, -0.5, KlEstimator::K1), (0.5, 1.0));
        assert_eq!(
            kl_penalty_and_grad(-1.0, -0.5, KlEstimator::Abs),
            (0.5, -1.0)
        );
        assert_eq!(kl_penalty_and_grad(0.5, 0.0, KlEstimator::K2), (0.125, 0.5));
        // abs at δ = 0: subgradient 0
        assert_eq!(
            kl_penalty_and_grad(-0.3, -0.3, KlEstimator::Abs),
            (0.0, 0.0)
        );
        // k3 at δ = 0: value and derivative 0
        assert_eq!(kl_penalty_and_grad(-0.3, -0.3, KlEstimator::K3), (0.0, 0.0));
        // k3 clamps: δ = −5 → x = 5, e⁵ − 6 > 10 → (10, 0); δ = 30 → x = −20 clamp → (10, 0)
        assert_eq!(kl_penalty_and_grad(-5.0, 0.0, KlEstimator::K3), (10.0, 0.0));
        assert_eq!(kl_penalty_and_grad(30.0, 0.0, KlEstimator::K3), (10.0, 0.0));
        assert_eq!(
            kl_penalty_and_grad(-1e300, 1e300, KlEstimator::K3),
            (10.0, 0.0)
        );
        // k3 just inside: δ = −2 → x = 2: e² − 3 = 4.389056, d/dlogπ = 1 − e² = −6.389056
        let (k, g) = kl_penalty_and_grad(0.0, 2.0, KlEstimator::K3);
        assert!((k - 4.389_056_098_930_65).abs() < 1e-14);
        assert!((g + 6.389_056_098_930_65).abs() < 1e-14);
        // NaN propagates to the value
        for e in KlEstimator::ALL {
            assert!(kl_penalty(f64::NAN, 0.0, e).is_nan());
            assert!(e.penalty(0.0f32, f32::NAN).is_nan());
        }
        assert_eq!(kl_penalty(f64::INFINITY, 0.0, KlEstimator::K3), 10.0);
    }

    #[test]
    fn names_round_trip() {
        for e in KlEstimator::ALL {
            assert_eq!(KlEstimator::from_name(e.name()), Some(e));
        }
        assert_eq!(KlEstimator::from_name("low_var_kl"), Some(KlEstimator::K3));
        assert_eq!(KlEstimator::from_name("mse"), Some(KlEstimator::K2));
        assert_eq!(KlEstimator::from_name("kl"), Some(KlEstimator::K1));
        assert_eq!(KlEstimator::from_name("full"), None);
        assert_eq!(KlEstimator::default(), KlEstimator::K3);
    }

    #[test]
    fn exp_kernel_accuracy() {
        // eˣ − 1 − x against libm over the kernel's range, relative to the value
        let mut x = -12.0f64;
        while x <= 3.0 {
            let (k, em1) = exp_m1_minus_x(x);
            let want = libm::expm1(x);
            assert!(
                (em1 - want).abs() <= 4.0 * f64::EPSILON * want.abs(),
                "em1({x})"
            );
            let kw = want - x;
            // the reference itself cancels (expm1(x) − x), so measure against |x| too
            let tol = 4.0 * f64::EPSILON * (kw.abs() + x.abs());
            assert!((k - kw).abs() <= tol, "k({x}) {k} vs {kw}");
            let (k32, em32) = exp_m1_minus_x(x as f32);
            let want32 = libm::expm1((x as f32) as f64);
            assert!(
                ((em32 as f64) - want32).abs() <= 4.0 * f32::EPSILON as f64 * want32.abs(),
                "em1_32({x})"
            );
            let kw32 = want32 - (x as f32) as f64;
            let tol32 = 4.0 * f32::EPSILON as f64 * (kw32.abs() + x.abs());
            assert!(((k32 as f64) - kw32).abs() <= tol32, "k32({x})");
            x += 0.000_731;
        }
        // tiny x: O(x²) kept to full relative precision
        for x in [1e-3, -1e-3, 1e-6, -1e-7, 3e-9] {
            let (k, _) = exp_m1_minus_x(x);
            // Σ_{j≥2} x^j / j!
            let (mut want, mut term) = (0.0, x);
            for j in 2..20 {
                term *= x / j as f64;
                want += term;
            }
            assert!((k - want).abs() <= 4.0 * f64::EPSILON * want, "{x}");
        }
    }

    #[test]
    fn weights() {
        assert_eq!(dynamic_kl_weight(0.2, true, 0.5), 0.1);
        assert_eq!(dynamic_kl_weight(0.2, false, 0.5), 0.2);
    }

    /// The fused pass against a per-token reference.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn reference(
        shape: Shape,
        lp: &[f64],
        lr: &[f64],
        m: &[f64],
        h: Option<&[f64]>,
        beta: &[f64],
        low: f64,
        e: KlEstimator,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let n = lp.len();
        let (mut k, mut wk, mut g) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let (mut rs, mut rm) = (vec![0.0; shape.rows], vec![0.0; shape.rows]);
        for r in 0..shape.rows {
            let (mut sk, mut cnt) = (0.0, 0.0);
            for t in 0..shape.cols {
                let i = r * shape.cols + t;
                if m[i] == 0.0 {
                    continue;
                }
                let (kk, gg) = kl_penalty_and_grad(lp[i], lr[i], e);
                let w = dynamic_kl_weight(beta[r], h.is_some_and(|h| h[i] == 1.0), low);
                k[i] = kk;
                wk[i] = w * kk;
                g[i] = w * gg;
                rs[r] += w * kk;
                sk += kk;
                cnt += 1.0;
            }
            rm[r] = if cnt > 0.0 { sk / cnt } else { 0.0 };
        }
        (k, wk, g, rs, rm)
    }

    #[test]
    fn token_kl_hand_checked() {
        // row 0 (β 0.2): δ = (0.5, −1, ·pad) with the second token HWE (weight 0.1);
        // row 1 (β 0.4): one valid token δ = 0 → k3 = 0
        let shape = Shape::new(2, 3);
        let lp = [-1.0, -2.0, 5.0, -0.3, -7.0, -7.0];
        let lr = [-1.5, -1.0, 5.0, -0.3, -1.0, 0.0];
        let m = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let h = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0];
        let beta = [0.2, 0.4];
        let cfg =
            TokenKlConfig::new(KlEstimator::K3, KlCoefficient::PerRow(&beta)).with_hwe(&h, 0.5);
        let (mut k, mut wk, mut g, mut rs, mut rm) =
            ([9.0; 6], [9.0; 6], [9.0; 6], [9.0; 2], [9.0; 2]);
        let s = token_kl(
            shape,
            &lp,
            &lr,
            &m,
            &cfg,
            TokenKlOutputs {
                kl: Some(&mut k),
                weighted: Some(&mut wk),
                grad: Some(&mut g),
                row_weighted_sum: Some(&mut rs),
                row_mean_kl: Some(&mut rm),
            },
        )
        .unwrap();
        let (a, b) = (0.106_530_659_712_633_4, core::f64::consts::E - 2.0);
        let close = |x: f64, y: f64| (x - y).abs() < 1e-15;
        assert!(close(k[0], a) && close(k[1], b) && k[2..] == [0.0; 4]);
        assert!(close(wk[0], 0.2 * a) && close(wk[1], 0.1 * b) && wk[2] == 0.0);
        // dk/dlogπ = 1 − eˣ: x = −0.5 → 1 − e^−0.5; x = 1 → 1 − e
        assert!(close(g[0], 0.2 * (1.0 - (-0.5f64).exp())));
        assert!((g[1] - 0.1 * (1.0 - core::f64::consts::E)).abs() < 1e-15);
        assert!(close(rs[0], 0.2 * a + 0.1 * b) && rs[1] == 0.0);
        assert!(close(rm[0], (a + b) / 2.0) && rm[1] == 0.0);
        assert_eq!((s.valid_tokens, s.nonempty_rows), (3, 2));
        assert!(close(s.kl_sum, a + b) && close(s.weighted_sum, 0.2 * a + 0.1 * b));
        assert!(close(s.token_mean_kl, (a + b) / 3.0));
        assert!(close(s.seq_mean_kl, (a + b) / 4.0));
        // masked_kl: same k, totals with β = 1
        let mut k2 = [0.0; 6];
        let s2 = masked_kl(shape, &lp, &lr, &m, KlEstimator::K3, &mut k2).unwrap();
        assert_eq!(k2, k);
        assert_eq!(s2.weighted_sum, s2.kl_sum);
    }

    #[test]
    fn token_kl_errors() {
        let shape = Shape::new(1, 3);
        let ok = [0.0; 3];
        let m = [1.0, 1.0, 0.0];
        let uni = TokenKlConfig::new(KlEstimator::K3, KlCoefficient::Uniform(0.1));
        let run = |lp: &[f64], m: &[f64], cfg: &TokenKlConfig<'_, f64>| {
            token_kl(shape, lp, &ok, m, cfg, TokenKlOutputs::default())
        };
        assert_eq!(
            run(&[0.0, 0.0], &m, &uni),
            Err(Error::LengthMismatch {
                what: "logp",
                expected: 3,
                actual: 2
            })
        );
        // NaN on a padded position is still an error
        assert_eq!(
            run(&[0.0, 0.0, f64::NAN], &m, &uni),
            Err(Error::NonFinite {
                what: "logp",
                index: 2
            })
        );
        assert_eq!(
            run(&ok, &[1.0, 0.3, 0.0], &uni),
            Err(Error::InvalidMask {
                what: "mask",
                index: 1
            })
        );
        let h = [0.0, 0.0, 2.0];
        assert_eq!(
            run(&ok, &m, &uni.with_hwe(&h, 0.5)),
            Err(Error::InvalidMask {
                what: "hwe_mask",
                index: 2
            })
        );
        let h = [0.0; 3];
        assert!(matches!(
            run(&ok, &m, &uni.with_hwe(&h, 1.5)),
            Err(Error::OutOfRange {
                what: "low_ratio",
                ..
            })
        ));
        let neg = TokenKlConfig::new(KlEstimator::K1, KlCoefficient::Uniform(-0.1));
        assert!(matches!(run(&ok, &m, &neg), Err(Error::OutOfRange { .. })));
        let per = TokenKlConfig::new(KlEstimator::K1, KlCoefficient::PerRow(&[0.1, 0.2]));
        assert!(matches!(
            run(&ok, &m, &per),
            Err(Error::LengthMismatch { .. })
        ));
        let per = TokenKlConfig::new(KlEstimator::K1, KlCoefficient::PerRow(&[f64::NAN]));
        assert!(matches!(run(&ok, &m, &per), Err(Error::NonFinite { .. })));
        let mut short = [0.0; 2];
        assert!(matches!(
            token_kl(
                shape,
                &ok,
                &ok,
                &m,
                &uni,
                TokenKlOutputs {
                    grad: Some(&mut short),
                    ..TokenKlOutputs::default()
                }
            ),
            Err(Error::LengthMismatch {
                what: "grad (output)",
                ..
            })
        ));
        // k2 of finite but huge δ overflows
        let k2 = TokenKlConfig::new(KlEstimator::K2, KlCoefficient::Uniform(1.0));
        assert!(matches!(
            token_kl(
                shape,
                &[1e200, 0.0, 0.0],
                &ok,
                &m,
                &k2,
                TokenKlOutputs::default()
            ),
            Err(Error::OutOfRange { .. })
        ));
        // empty shapes are fine
        let s = token_kl::<f64>(
            Shape::new(0, 5),
            &[],
            &[],
            &[],
            &uni,
            TokenKlOutputs::default(),
        )
        .unwrap();
        assert_eq!(s.valid_tokens, 0);
        let mut rm = [7.0; 2];
        token_kl::<f64>(
            Shape::new(2, 0),
            &[],
            &[],
            &[],
            &uni,
            TokenKlOutputs {
                row_mean_kl: Some(&mut rm),
                ..TokenKlOutputs::default()
            },
        )
        .unwrap();
        assert_eq!(rm, [0.0; 2]);
    }

    #[test]
    fn adaptive_controller() {
        // KL 0.2 vs target 0.1: e = clip(1, ±0.2) = 0.2; N/horizon = 0.1 → β·1.02
        let mut c = AdaptiveKlController::new(0.1, 0.1, 10000.0).unwrap();
        let b = c.update(0.2, 1000).unwrap();
        assert!((b - 0.102).abs() < 1e-15);
        // KL 0.05: e = −0.5 → −0.2: β·0.98
        let b2 = c.update(0.05, 1000).unwrap();
        assert!((b2 - 0.102 * 0.98).abs() < 1e-15);
        // KL 0.11: e = 0.1 (unclipped): β·1.01
        let b3 = c.update(0.11, 1000).unwrap();
        assert!((b3 - b2 * (1.0 + (0.11 / 0.1 - 1.0) * 0.1)).abs() < 1e-15);
        assert!(matches!(
            c.update(f64::NAN, 10),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            c.update(0.1, 50000),
            Err(Error::OutOfRange {
                what: "n_samples",
                ..
            })
        ));
        assert_eq!(c.value(), b3);
        assert!(AdaptiveKlController::new(0.1, 0.0, 1.0).is_err());
        assert!(AdaptiveKlController::new(0.1, 0.1, -1.0).is_err());
        assert!(AdaptiveKlController::new(f64::NAN, 0.1, 1.0).is_err());
        let mut f = KlController::fixed(0.05).unwrap();
        assert_eq!(f.update(3.0, 100), Ok(0.05));
        assert!(KlController::<f64>::fixed(-1.0).is_err());
        let mut a = KlController::adaptive(0.1, 0.1, 10000.0).unwrap();
        assert!((a.update(0.2, 1000).unwrap() - 0.102).abs() < 1e-15);
        assert!((a.value() - 0.102).abs() < 1e-15);
    }

    #[test]
    fn straight_through_estimators() {
        // spec vector 8's pair: k3 = e^−0.5 − 0.5 = 0.1065307, δ = 0.5
        let (v, g) = kl_penalty_and_grad(-1.0, -1.5, KlEstimator::K3Plus);
        assert!((v - 0.106_530_659_712_633_4).abs() < 1e-15 && g == 0.5);
        assert_eq!(
            kl_penalty_and_grad(-1.0, -1.5, KlEstimator::K1Plus),
            (0.5, 0.5)
        );
        // beyond k3's clamps the value is clamped, the gradient is still δ (no clamp)
        assert_eq!(
            kl_penalty_and_grad(-30.0, 0.0, KlEstimator::K3Plus),
            (10.0, -30.0)
        );
        assert_eq!(
            kl_penalty_and_grad(25.0, 0.0, KlEstimator::K3Plus),
            (10.0, 25.0)
        );
        assert_eq!(KlEstimator::from_name("k3+"), Some(KlEstimator::K3Plus));
        assert_eq!(
            KlEstimator::from_name("low_var_kl+"),
            Some(KlEstimator::K3Plus)
        );
        assert_eq!(KlEstimator::from_name("kl+"), Some(KlEstimator::K1Plus));
        assert_eq!(KlEstimator::from_name("k2+"), None);
        for e in KlEstimator::ALL {
            assert_eq!(e.value_estimator().value_estimator(), e.value_estimator());
        }
    }

    proptest! {
        /// `k1+`/`k3+`: the value of k1/k3 and the derivative of k2, everywhere.
        #[test]
        fn plus_is_value_of_base_and_gradient_of_k2(lp in -40.0f64..5.0, lr in -40.0f64..5.0) {
            for (plus, base) in [(KlEstimator::K1Plus, KlEstimator::K1), (KlEstimator::K3Plus, KlEstimator::K3)] {
                let (v, g) = kl_penalty_and_grad(lp, lr, plus);
                prop_assert_eq!(v, kl_penalty(lp, lr, base));
                prop_assert_eq!(g, kl_penalty_and_grad(lp, lr, KlEstimator::K2).1);
                prop_assert_eq!(plus.value_estimator(), base);
            }
        }

        #[test]
        fn k3_nonnegative_and_close_to_reference(lp in -60.0f64..5.0, lr in -60.0f64..5.0) {
            let k = kl_penalty(lp, lr, KlEstimator::K3);
            prop_assert!((0.0..=10.0).contains(&k));
            let want = k3_ref(lp, lr);
            prop_assert!((k - want).abs() <= 1e-13 * (1.0 + want), "{} vs {}", k, want);
            let k32 = kl_penalty(lp as f32, lr as f32, KlEstimator::K3);
            prop_assert!((0.0..=10.0).contains(&k32));
            let want32 = k3_ref((lp as f32) as f64, (lr as f32) as f64);
            prop_assert!(((k32 as f64) - want32).abs() <= 2e-6 * (1.0 + want32));
        }

        #[test]
        fn k3_nonnegative_anywhere(lp in any::<f32>(), lr in any::<f32>()) {
            let k = kl_penalty(lp, lr, KlEstimator::K3);
            prop_assert!(k.is_nan() || (0.0..=10.0).contains(&k));
        }

        /// dk/dlogπ against central finite differences, away from kinks and clamp edges.
        #[test]
        fn grad_matches_finite_differences(lp in -8.0f64..0.0, lr in -8.0f64..0.0, e in 0usize..4) {
            let est = KlEstimator::ALL[e];
            let d = lp - lr;
            prop_assume!(d.abs() > 1e-3);
            // k3's clamp engages where eˣ − x − 1 = 10: x ≈ 2.6123 and x ≈ −10.99998
            prop_assume!(((-d) - 2.6123).abs() > 1e-3);
            let h = 1e-6;
            let (_, g) = kl_penalty_and_grad(lp, lr, est);
            let fd = (kl_penalty(lp + h, lr, est) - kl_penalty(lp - h, lr, est)) / (2.0 * h);
            prop_assert!((g - fd).abs() <= 1e-6 * (1.0 + g.abs()), "{:?}: {} vs {}", est, g, fd);
        }

        #[test]
        fn fused_matches_reference(
            rows in 1usize..4,
            cols in 0usize..40,
            e in 0usize..6,
            hwe in any::<bool>(),
            low in 0.0f64..=1.0,
            raw in proptest::collection::vec((-6.0f64..0.0, -6.0f64..0.0, 0u8..4, any::<bool>()), 1..160),
            beta in proptest::collection::vec(0.0f64..1.0, 3),
        ) {
            let est = KlEstimator::ALL[e];
            let shape = Shape::new(rows, cols);
            let n = rows * cols;
            let it = || raw.iter().cycle().take(n);
            let lp: Vec<f64> = it().map(|p| p.0).collect();
            let lr: Vec<f64> = it().map(|p| p.1).collect();
            let m: Vec<f64> = it().map(|p| (p.2 != 0) as u8 as f64).collect();
            let h: Vec<f64> = it().map(|p| p.3 as u8 as f64).collect();
            let beta = &beta[..rows];
            let mut cfg = TokenKlConfig::new(est, KlCoefficient::PerRow(beta));
            if hwe { cfg = cfg.with_hwe(&h, low); }
            let (mut k, mut wk, mut g, mut rs, mut rm) =
                (vec![9.0; n], vec![9.0; n], vec![9.0; n], vec![9.0; rows], vec![9.0; rows]);
            let s = token_kl(shape, &lp, &lr, &m, &cfg, TokenKlOutputs {
                kl: Some(&mut k), weighted: Some(&mut wk), grad: Some(&mut g),
                row_weighted_sum: Some(&mut rs), row_mean_kl: Some(&mut rm),
            }).unwrap();
            let (k0, wk0, g0, rs0, rm0) =
                reference(shape, &lp, &lr, &m, cfg.hwe_mask, beta, low, est);
            prop_assert_eq!(&k, &k0);
            prop_assert_eq!(&wk, &wk0);
            prop_assert_eq!(&g, &g0);
            for (a, b) in rs.iter().zip(&rs0).chain(rm.iter().zip(&rm0)) {
                prop_assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()));
            }
            let total: f64 = rs0.iter().sum();
            prop_assert!((s.weighted_sum - total).abs() <= 1e-12 * (1.0 + total.abs()));
            prop_assert_eq!(s.valid_tokens, m.iter().filter(|x| **x == 1.0).count());
            // f32 agrees with f64 to f32 precision
            let f = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<f32>>();
            let (lp32, lr32, m32, h32, b32) = (f(&lp), f(&lr), f(&m), f(&h), f(beta));
            let mut cfg32 = TokenKlConfig::new(est, KlCoefficient::PerRow(&b32));
            if hwe { cfg32 = cfg32.with_hwe(&h32, low as f32); }
            let mut k32 = vec![0.0f32; n];
            token_kl(shape, &lp32, &lr32, &m32, &cfg32, TokenKlOutputs { kl: Some(&mut k32), ..TokenKlOutputs::default() }).unwrap();
            for (i, (a, b)) in k32.iter().zip(&k).enumerate() {
                let want = kl_penalty(lp32[i], lr32[i], est) as f64 * m[i];
                prop_assert!(((*a as f64) - want).abs() <= 1e-6 * (1.0 + b.abs()));
            }
        }
    }
}
