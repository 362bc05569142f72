//! REINFORCE Pro Max: RLOO baseline + adaptive token-level normalisation per prompt
//! (docs/algorithms.md §5, normative; guards from its reference implementation).
//!
//! 1. r̃ = RLOO of each group; with `uniform_scale`, a group of equal rewards (unbiased
//!    std < 1e−8) gets r̃ = r/n instead and skips step 3.
//! 2. Token values: KL folding and return-to-go with γ = 1 (forced).
//! 3. Per group, over its valid tokens: P = {A > 0}, N = {A < 0} (zeros stay 0 and are not
//!    counted), S± = Σ A, Q± = Σ A² over P / N, m = |P| + |N|. If P or N is empty, or
//!    |S⁺| < ε or |S⁻| < ε, the group is left unchanged. Else ρ = S⁺/S⁻,
//!    α = √(m / (Q⁺ + min(ρ²Q⁻, 1e8) + ε)), β = −α·ρ; non-finite α or β → unchanged; α and β
//!    are clamped to [ε, max_scale]; A ← α·A on P, β·A on N. Without clamps this solves
//!    `αS⁺ + βS⁻ = 0` (mean 0) and `α²Q⁺ + β²Q⁻ = m` (population variance 1 over the
//!    nonzero tokens, up to the ε in the denominator).
//!
//! Padded positions are 0 in every output.

use super::rloo::rloo;
use super::token::{
    EMPTY_ROW, broadcast_row, count_row, locate_row_error, suffix_row, token_error,
};
use super::{GroupMoments, ResponseTokens, at, check_group_rewards, group_moments};
use crate::error::{Error, Result};
use crate::lanes::{self, BLOCK, Block, Sum, bad_mask, bad_value, select};
use crate::num::{cast, check_len, check_param};
use crate::{Groups, Shape};
use num_traits::Float;

/// ε of Pro Max: the sum threshold, the denominator stabiliser and the lower clamp of α, β.
pub const PRO_MAX_EPSILON: f64 = 1e-8;
/// Upper clamp of α and β.
pub const PRO_MAX_MAX_SCALE: f64 = 10.0;
/// Cap of the intermediate product ρ²·Q⁻.
pub const PRO_MAX_PRODUCT_CAP: f64 = 1e8;
/// With `uniform_scale`, a group whose rewards' unbiased std is below this is "uniform".
pub const PRO_MAX_UNIFORM_STD: f64 = 1e-8;

const ESTIMATOR: &str = "reinforce_pro_max";

/// Options of REINFORCE Pro Max.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProMaxConfig<F> {
    /// `--uniform_scale`: groups of equal rewards get r/n and skip the normalisation (they
    /// keep a gradient signal). Default false: every group goes through RLOO (equal rewards →
    /// r̃ = 0) and the normalisation.
    pub uniform_scale: bool,
    /// ε (default [`PRO_MAX_EPSILON`]); finite, > 0.
    pub eps: F,
    /// Upper clamp of α and β (default [`PRO_MAX_MAX_SCALE`]); finite, ≥ `eps`.
    pub max_scale: F,
    /// Cap of ρ²Q⁻ (default [`PRO_MAX_PRODUCT_CAP`]); finite, > 0.
    pub product_cap: F,
    /// Uniform-group threshold on the unbiased reward std (default
    /// [`PRO_MAX_UNIFORM_STD`]); finite, ≥ 0.
    pub uniform_std: F,
}

impl<F: Float> Default for ProMaxConfig<F> {
    fn default() -> Self {
        ProMaxConfig {
            uniform_scale: false,
            eps: cast(PRO_MAX_EPSILON),
            max_scale: cast(PRO_MAX_MAX_SCALE),
            product_cap: cast(PRO_MAX_PRODUCT_CAP),
            uniform_std: cast(PRO_MAX_UNIFORM_STD),
        }
    }
}

impl<F: Float> ProMaxConfig<F> {
    /// The defaults with `uniform_scale` set.
    pub fn uniform_scale() -> Self {
        ProMaxConfig {
            uniform_scale: true,
            ..Self::default()
        }
    }

    /// Checks the options (ranges on each field's doc), as every Pro Max function does first.
    ///
    /// Errors: `OutOfRange` naming the option.
    pub fn check(&self) -> Result<()> {
        check_param("pro_max eps", self.eps, self.eps > F::zero(), "> 0")?;
        check_param(
            "pro_max max_scale",
            self.max_scale,
            self.max_scale >= self.eps,
            ">= eps",
        )?;
        check_param(
            "pro_max product_cap",
            self.product_cap,
            self.product_cap > F::zero(),
            "> 0",
        )?;
        check_param(
            "pro_max uniform_std",
            self.uniform_std,
            self.uniform_std >= F::zero(),
            ">= 0",
        )
    }

    /// Whether a group with these reward moments is uniform (only with `uniform_scale`).
    #[inline]
    fn is_uniform(&self, gm: &GroupMoments<F>) -> bool {
        self.uniform_scale && gm.std_unbiased() < self.uniform_std
    }

    /// Step 1 for one sample.
    #[inline]
    fn shaped(&self, gm: &GroupMoments<F>, uniform: bool, r: F) -> F {
        if uniform { r / gm.n } else { rloo(gm, r) }
    }
}

/// What the normalisation did to a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProMaxGroupStatus {
    /// α, β applied; no clamp engaged.
    Normalized,
    /// α, β applied, but a guard engaged (α or β clamped to [ε, max_scale], or ρ²Q⁻ capped):
    /// the mean-0 / variance-1 constraints hold only approximately.
    Clamped,
    /// `uniform_scale` group of equal rewards: skipped by design.
    UniformSkipped,
    /// Fallback: no positive or no negative valid token (includes a group of zeros).
    FallbackSameSign,
    /// Fallback: |S⁺| < ε or |S⁻| < ε.
    FallbackSmallSum,
    /// Fallback: α or β not finite.
    FallbackNonFinite,
}

impl ProMaxGroupStatus {
    /// True when the group was scaled (`Normalized` or `Clamped`).
    pub fn is_normalized(self) -> bool {
        matches!(
            self,
            ProMaxGroupStatus::Normalized | ProMaxGroupStatus::Clamped
        )
    }

    /// True for the three fallbacks (group left unchanged although it was eligible).
    pub fn is_fallback(self) -> bool {
        matches!(
            self,
            ProMaxGroupStatus::FallbackSameSign
                | ProMaxGroupStatus::FallbackSmallSum
                | ProMaxGroupStatus::FallbackNonFinite
        )
    }

    /// A short name for logs.
    pub fn name(self) -> &'static str {
        match self {
            ProMaxGroupStatus::Normalized => "normalized",
            ProMaxGroupStatus::Clamped => "clamped",
            ProMaxGroupStatus::UniformSkipped => "uniform_skipped",
            ProMaxGroupStatus::FallbackSameSign => "fallback_same_sign",
            ProMaxGroupStatus::FallbackSmallSum => "fallback_small_sum",
            ProMaxGroupStatus::FallbackNonFinite => "fallback_non_finite",
        }
    }
}

/// Per-group outcome and metrics of the normalisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProMaxGroupReport<F> {
    /// What happened.
    pub status: ProMaxGroupStatus,
    /// Factor applied to positive tokens (1 when unchanged).
    pub alpha: F,
    /// Factor applied to negative tokens (1 when unchanged).
    pub beta: F,
    /// |P|: valid tokens with A > 0.
    pub positive_tokens: usize,
    /// |N|: valid tokens with A < 0.
    pub negative_tokens: usize,
    /// Mean of the output over the group's nonzero valid tokens (0 if none).
    pub mean: F,
    /// Population std of the output over the group's nonzero valid tokens (0 if none).
    pub std: F,
}

impl<F: Float> Default for ProMaxGroupReport<F> {
    fn default() -> Self {
        ProMaxGroupReport {
            status: ProMaxGroupStatus::FallbackSameSign,
            alpha: F::one(),
            beta: F::one(),
            positive_tokens: 0,
            negative_tokens: 0,
            mean: F::zero(),
            std: F::zero(),
        }
    }
}

/// Batch metrics of the normalisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProMaxSummary<F> {
    /// Mean of the output advantages over all nonzero valid tokens (`advantage_mean`).
    pub mean: F,
    /// Their population std (`advantage_std`), from Σx²/n − mean² in the same pass: its
    /// absolute error is about √ε·rms(x), so a std below that (≈1e-8·rms in f64) reads as 0.
    pub std: F,
    /// Number of nonzero valid tokens.
    pub nonzero_tokens: usize,
    /// Groups scaled (`Normalized` + `Clamped`).
    pub normalized: usize,
    /// Of those, groups where a guard engaged.
    pub clamped: usize,
    /// Groups skipped as uniform.
    pub uniform_skipped: usize,
    /// Groups left unchanged by a fallback.
    pub fallback: usize,
}

/// Pro Max step 1: the shaped reward r̃ per sample — RLOO `r − (Σ_g r − r)/(n − 1)` for every
/// group, except, with `cfg.uniform_scale`, groups whose rewards all (nearly) equal (unbiased
/// std < `cfg.uniform_std`), which get `r/n`. Writes `shaped[row]`, and
/// `uniform_groups[g]` (optional, one per group) marks the groups that must skip step 3.
/// Returns the number of uniform groups.
///
/// Errors: n < 2 → `GroupTooSmall("reinforce_pro_max")`; lengths → `LengthMismatch`;
/// non-finite reward → `NonFinite`; bad config → `OutOfRange`.
pub fn pro_max_shaped_rewards<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    cfg: &ProMaxConfig<F>,
    shaped: &mut [F],
    mut uniform_groups: Option<&mut [bool]>,
) -> Result<usize> {
    check_group_rewards(ESTIMATOR, groups, rewards)?;
    cfg.check()?;
    groups.check_batch("shaped (output)", shaped.len())?;
    if let Some(u) = &uniform_groups {
        check_len("uniform_groups (output)", groups.count(), u.len())?;
    }
    let mut count = 0;
    for g in 0..groups.count() {
        let gm = group_moments(groups, g, rewards);
        let uniform = cfg.is_uniform(&gm);
        count += usize::from(uniform);
        if let Some(u) = uniform_groups.as_deref_mut().and_then(|u| u.get_mut(g)) {
            *u = uniform;
        }
        for row in groups.rows_of(g) {
            if let Some(o) = shaped.get_mut(row) {
                *o = cfg.shaped(&gm, uniform, at(rewards, row));
            }
        }
    }
    Ok(count)
}

/// Pro Max step 3: the adaptive α/β normalisation of token values (module docs), per group,
/// in place over `[rows, cols]` `advantages` (rows = batch, any [`Groups`] layout). Groups
/// with `skip_groups[g]` set (the `uniform_groups` of [`pro_max_shaped_rewards`]) are left
/// unchanged. Padded positions become 0. Per-group outcomes go to `report` (optional, one
/// per group); returns the batch metrics.
///
/// Errors: n < 2 → `GroupTooSmall("reinforce_pro_max")`; lengths (`shape.rows` = batch,
/// `skip_groups`/`report` = groups) → `LengthMismatch`; non-finite value → `NonFinite`; mask not
/// 0/1 → `InvalidMask`; bad config → `OutOfRange`. Groups are processed in order, so on error
/// the groups before the offending one are already normalised and the others unchanged.
pub fn pro_max_normalize<F: Float>(
    shape: Shape,
    groups: &Groups<'_>,
    advantages: &mut [F],
    mask: &[F],
    skip_groups: Option<&[bool]>,
    cfg: &ProMaxConfig<F>,
    mut report: Option<&mut [ProMaxGroupReport<F>]>,
) -> Result<ProMaxSummary<F>> {
    groups.require_pairs(ESTIMATOR)?;
    cfg.check()?;
    check_len("shape.rows", groups.batch(), shape.rows)?;
    shape.check("advantages", advantages.len())?;
    shape.check("mask", mask.len())?;
    if let Some(s) = skip_groups {
        check_len("skip_groups", groups.count(), s.len())?;
    }
    if let Some(r) = &report {
        check_len("report (output)", groups.count(), r.len())?;
    }
    let mut total = Totals::new();
    for g in 0..groups.count() {
        let skip = skip_groups.and_then(|s| s.get(g).copied()).unwrap_or(false);
        let rep = normalize_group(shape.cols, groups, g, advantages, mask, skip, cfg)?;
        total.add(rep, &mut report, g);
    }
    Ok(total.finish())
}

/// REINFORCE Pro Max from per-sample rewards to token advantages, in one call (steps 1–3 of
/// the module docs): per group, r̃ (RLOO or, with `uniform_scale`, r/n for uniform groups),
/// KL folding (`tokens.weighted_kl` = β_t·k_t, or none) and return-to-go with γ = 1 (forced:
/// callers configured with another γ should warn), then the adaptive normalisation. Works
/// group by group while the group's tokens are in cache; needs no scratch. `report`
/// (optional, one per group) receives each group's outcome; returns the batch metrics.
///
/// Spec vectors: n = 2, r = (1, 0), lengths (2, 3), no KL → r̃ = (1, −1), P = 2 tokens of 1,
/// N = 3 of −1, ρ = −2/3, α = √(5/(2 + 4/9·3)) = √(15/10) = 1.2247449, β = 0.8164966:
/// [1.2247449 ×2 | −0.8164966 ×3]. n = 4, r = (1, 0, 0, 0), one token each → r̃ = (1, −⅓ ×3),
/// α = √(4/(1 + 1/3)) = √3 = 1.7320508, β = √3/3: (1.7320508, −0.5773503 ×3). An all-correct
/// group gives zeros, or 0.25 per token with `uniform_scale` (n = 4).
///
/// Errors: as [`pro_max_shaped_rewards`] and [`pro_max_normalize`], plus KL non-finite →
/// `NonFinite` and a row without valid token → `Empty` (its reward has no token to sit on).
pub fn reinforce_pro_max<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    tokens: ResponseTokens<'_, F>,
    cfg: &ProMaxConfig<F>,
    mut report: Option<&mut [ProMaxGroupReport<F>]>,
    out: &mut [F],
) -> Result<ProMaxSummary<F>> {
    check_group_rewards(ESTIMATOR, groups, rewards)?;
    cfg.check()?;
    tokens.check(groups.batch(), out.len())?;
    if let Some(r) = &report {
        check_len("report (output)", groups.count(), r.len())?;
    }
    let mut total = Totals::new();
    let cols = tokens.shape.cols;
    for g in 0..groups.count() {
        let gm = group_moments(groups, g, rewards);
        let uniform = cfg.is_uniform(&gm);
        let mut st = SignSums::zero();
        match tokens.weighted_kl {
            None => {
                // without KL every valid token of a row holds its r̃: the sums are r̃ times the
                // row's count, and one broadcast pass writes the scaled result
                for row in groups.rows_of(g) {
                    let score = cfg.shaped(&gm, uniform, at(rewards, row));
                    let (cnt, ok) = count_row(lanes::row(tokens.mask, cols, row));
                    if !ok {
                        return Err(token_error(&tokens, "token advantages"));
                    }
                    if cnt == 0 {
                        return Err(EMPTY_ROW);
                    }
                    add_constant(&mut st, score, cnt);
                }
                let (status, alpha, beta) = decide(&st, uniform, cfg);
                for row in groups.rows_of(g) {
                    let score = cfg.shaped(&gm, uniform, at(rewards, row));
                    let a = score * select(score > F::zero(), alpha, beta);
                    let (_, ok) = broadcast_row(
                        lanes::row_mut(out, cols, row),
                        lanes::row(tokens.mask, cols, row),
                        a,
                    );
                    if !ok {
                        return Err(token_error(&tokens, "token advantages"));
                    }
                }
                total.add(report_of(&st, status, alpha, beta), &mut report, g);
            }
            Some(kl) => {
                // fold + return-to-go, then the sign sums while the row is in cache
                for row in groups.rows_of(g) {
                    let score = cfg.shaped(&gm, uniform, at(rewards, row));
                    let o = lanes::row_mut(out, cols, row);
                    let (cnt, ok) = suffix_row::<F, false, false>(
                        o,
                        lanes::row(kl, cols, row),
                        lanes::row(tokens.mask, cols, row),
                        score,
                        F::one(),
                    );
                    if !ok {
                        return Err(token_error(&tokens, "token advantages"));
                    }
                    if cnt == 0 {
                        return Err(EMPTY_ROW);
                    }
                    // the row is in L1 now; its values are masked and checked
                    st.merge(&sign_sums_row::<F, false>(o, &[]).0);
                }
                let (status, alpha, beta) = decide(&st, uniform, cfg);
                if status.is_normalized() {
                    for row in groups.rows_of(g) {
                        scale_row::<F, false>(lanes::row_mut(out, cols, row), &[], alpha, beta);
                    }
                }
                total.add(report_of(&st, status, alpha, beta), &mut report, g);
            }
        }
    }
    Ok(total.finish())
}

/// Sums of a set of token values by sign: S⁺ = Σ A and Q⁺ = Σ A² over A > 0, S⁻ and Q⁻ over
/// A < 0, with the counts |P| and |N| (zeros are not counted).
#[derive(Debug, Clone, Copy)]
struct SignSums<F> {
    sp: F,
    sn: F,
    qp: F,
    qn: F,
    np: usize,
    nn: usize,
}

impl<F: Float> SignSums<F> {
    fn zero() -> Self {
        SignSums {
            sp: F::zero(),
            sn: F::zero(),
            qp: F::zero(),
            qn: F::zero(),
            np: 0,
            nn: 0,
        }
    }

    fn merge(&mut self, s: &SignSums<F>) {
        self.sp = self.sp + s.sp;
        self.sn = self.sn + s.sn;
        self.qp = self.qp + s.qp;
        self.qn = self.qn + s.qn;
        self.np = self.np.saturating_add(s.np);
        self.nn = self.nn.saturating_add(s.nn);
    }
}

/// `cnt` tokens all holding `a`, added to `st`.
fn add_constant<F: Float>(st: &mut SignSums<F>, a: F, cnt: usize) {
    let c = cast::<F>(cnt as f64);
    if a > F::zero() {
        st.sp = st.sp + a * c;
        st.qp = st.qp + a * a * c;
        st.np = st.np.saturating_add(cnt);
    } else if a < F::zero() {
        st.sn = st.sn + a * c;
        st.qn = st.qn + a * a * c;
        st.nn = st.nn.saturating_add(cnt);
    }
}

/// Normalises group `g` of raw values in place (mask applied and inputs validated here).
fn normalize_group<F: Float>(
    cols: usize,
    groups: &Groups<'_>,
    g: usize,
    vals: &mut [F],
    mask: &[F],
    skip: bool,
    cfg: &ProMaxConfig<F>,
) -> Result<(ProMaxGroupReport<F>, F, F)> {
    let mut st = SignSums::zero();
    let mut ok = true;
    for row in groups.rows_of(g) {
        let v = lanes::row(vals, cols, row);
        let m = lanes::row(mask, cols, row);
        let (s, row_ok) = sign_sums_row::<F, true>(v, m);
        ok &= row_ok;
        st.merge(&s);
    }
    if !ok {
        return Err(group_error(cols, groups, g, vals, mask));
    }
    let (status, alpha, beta) = decide(&st, skip, cfg);
    // also for unchanged groups: this pass zeroes the padded positions
    for row in groups.rows_of(g) {
        scale_row::<F, true>(
            lanes::row_mut(vals, cols, row),
            lanes::row(mask, cols, row),
            alpha,
            beta,
        );
    }
    Ok(report_of(&st, status, alpha, beta))
}

/// A group's report, with the Σx and Σx² of its output over the nonzero valid tokens
/// (Σ = αS⁺ + βS⁻, Σ² = α²Q⁺ + β²Q⁻: no extra pass over the data).
fn report_of<F: Float>(
    st: &SignSums<F>,
    status: ProMaxGroupStatus,
    alpha: F,
    beta: F,
) -> (ProMaxGroupReport<F>, F, F) {
    let cnt = st.np.saturating_add(st.nn);
    let (s1, s2) = (
        alpha * st.sp + beta * st.sn,
        alpha * alpha * st.qp + beta * beta * st.qn,
    );
    let (mean, std) = mean_std(s1, s2, cnt);
    let rep = ProMaxGroupReport {
        status,
        alpha,
        beta,
        positive_tokens: st.np,
        negative_tokens: st.nn,
        mean,
        std,
    };
    (rep, s1, s2)
}

/// The α/β decision of step 3.
fn decide<F: Float>(
    st: &SignSums<F>,
    skip: bool,
    cfg: &ProMaxConfig<F>,
) -> (ProMaxGroupStatus, F, F) {
    let one = F::one();
    if skip {
        return (ProMaxGroupStatus::UniformSkipped, one, one);
    }
    if st.np == 0 || st.nn == 0 {
        return (ProMaxGroupStatus::FallbackSameSign, one, one);
    }
    let eps = cfg.eps;
    if st.sp.abs() < eps || st.sn.abs() < eps {
        return (ProMaxGroupStatus::FallbackSmallSum, one, one);
    }
    let rho = st.sp / st.sn; // < 0
    let prod = rho * rho * st.qn;
    let capped = prod > cfg.product_cap;
    let prod = select(capped, cfg.product_cap, prod);
    let m = cast::<F>(st.np.saturating_add(st.nn) as f64);
    let alpha = (m / (st.qp + prod + eps)).sqrt();
    let beta = -alpha * rho;
    if !(alpha.is_finite() && beta.is_finite()) {
        return (ProMaxGroupStatus::FallbackNonFinite, one, one);
    }
    let lo = eps;
    let hi = cfg.max_scale;
    let out_of = |x: F| x < lo || x > hi;
    let clamped = capped || out_of(alpha) || out_of(beta);
    let clamp = |x: F| select(x < lo, lo, select(x > hi, hi, x));
    let status = if clamped {
        ProMaxGroupStatus::Clamped
    } else {
        ProMaxGroupStatus::Normalized
    };
    (status, clamp(alpha), clamp(beta))
}

/// Mean and population std from Σx, Σx², n (0, 0 when n = 0).
fn mean_std<F: Float>(s1: F, s2: F, n: usize) -> (F, F) {
    if n == 0 {
        return (F::zero(), F::zero());
    }
    let nf = cast::<F>(n as f64);
    let mean = s1 / nf;
    let var = s2 / nf - mean * mean;
    (mean, select(var > F::zero(), var, F::zero()).sqrt())
}

/// Batch totals over the groups' reports.
struct Totals<F> {
    s1: Sum<F>,
    s2: Sum<F>,
    n: usize,
    sum: ProMaxSummary<F>,
}

impl<F: Float> Totals<F> {
    fn new() -> Self {
        Totals {
            s1: Sum::new(),
            s2: Sum::new(),
            n: 0,
            sum: ProMaxSummary {
                mean: F::zero(),
                std: F::zero(),
                nonzero_tokens: 0,
                normalized: 0,
                clamped: 0,
                uniform_skipped: 0,
                fallback: 0,
            },
        }
    }

    /// Adds group `g`'s report to the totals and stores it in `report[g]` if asked.
    fn add(
        &mut self,
        (r, s1, s2): (ProMaxGroupReport<F>, F, F),
        report: &mut Option<&mut [ProMaxGroupReport<F>]>,
        g: usize,
    ) {
        if let Some(o) = report.as_deref_mut().and_then(|rep| rep.get_mut(g)) {
            *o = r;
        }
        let n = r.positive_tokens.saturating_add(r.negative_tokens);
        self.s1.add(s1);
        self.s2.add(s2);
        self.n = self.n.saturating_add(n);
        let s = &mut self.sum;
        s.normalized += usize::from(r.status.is_normalized());
        s.clamped += usize::from(r.status == ProMaxGroupStatus::Clamped);
        s.uniform_skipped += usize::from(r.status == ProMaxGroupStatus::UniformSkipped);
        s.fallback += usize::from(r.status.is_fallback());
    }

    fn finish(mut self) -> ProMaxSummary<F> {
        let (mean, std) = mean_std(self.s1.value(), self.s2.value(), self.n);
        self.sum.mean = mean;
        self.sum.std = std;
        self.sum.nonzero_tokens = self.n;
        self.sum
    }
}

/// The precise error of a group whose fused check failed (its rows are still unchanged).
#[cold]
fn group_error<F: Float>(cols: usize, groups: &Groups<'_>, g: usize, v: &[F], m: &[F]) -> Error {
    // report the offending row with the smallest index
    let mut best: Option<(usize, Error)> = None;
    for row in groups.rows_of(g) {
        let vr = lanes::row(v, cols, row);
        let mr = lanes::row(m, cols, row);
        if !super::token::check_row(vr, mr) {
            let e = locate_row_error("advantages", vr, mr, row.saturating_mul(cols));
            if best.as_ref().is_none_or(|(r, _)| row < *r) {
                best = Some((row, e));
            }
        }
    }
    best.map(|(_, e)| e)
        .unwrap_or(super::token::overflow("pro max statistics"))
}

/// Sign sums of one row (block accumulators), and whether its values are finite and its
/// mask 0/1 (always true when not `MASKED`: those rows were checked when they were made).
fn sign_sums_row<F: Float, const MASKED: bool>(v: &[F], m: &[F]) -> (SignSums<F>, bool) {
    let mut sp: Block<F> = lanes::zeros();
    let mut sn: Block<F> = lanes::zeros();
    let mut qp: Block<F> = lanes::zeros();
    let mut qn: Block<F> = lanes::zeros();
    let (mut np, mut nn) = (0usize, 0usize);
    let mut bad = false;
    // unmasked: `v` stands in for the mask, which is not read
    let m: &[F] = if MASKED { m } else { v };
    let z = F::zero();
    // the contribution of one value: (S⁺, S⁻, Q⁺, Q⁻ terms, positive, negative, bad)
    let one = |x: F, w: F| {
        let a = if MASKED { select(w != z, x, z) } else { x };
        let (pos, neg) = (a > z, a < z);
        let bad = MASKED && (bad_value(x) | bad_mask(w));
        (
            select(pos, a, z),
            select(neg, a, z),
            select(pos, a * a, z),
            select(neg, a * a, z),
            u32::from(pos),
            u32::from(neg),
            bad,
        )
    };
    // Pairs of blocks: each accumulator slot takes the sum of two values per update, which
    // halves the accumulator loads and stores (the bottleneck of this pass); indexed loops
    // over known-length slices, so no bounds checks remain and they vectorise.
    let mut vc = v.chunks_exact(2 * BLOCK);
    let mut mc = m.chunks_exact(2 * BLOCK);
    for (vb, mb) in vc.by_ref().zip(mc.by_ref()) {
        let (Some((v0, v1)), Some((m0, m1))) =
            (vb.split_at_checked(BLOCK), mb.split_at_checked(BLOCK))
        else {
            continue;
        };
        let (Some(v0), Some(v1), Some(m0), Some(m1)) = (
            v0.get(..BLOCK),
            v1.get(..BLOCK),
            m0.get(..BLOCK),
            m1.get(..BLOCK),
        ) else {
            continue;
        };
        let (mut cp, mut cn) = (0u32, 0u32);
        for i in 0..BLOCK {
            let (a0, b0, c0, d0, p0, n0, e0) = one(v0[i], m0[i]);
            let (a1, b1, c1, d1, p1, n1, e1) = one(v1[i], m1[i]);
            sp[i] = sp[i] + (a0 + a1);
            sn[i] = sn[i] + (b0 + b1);
            qp[i] = qp[i] + (c0 + c1);
            qn[i] = qn[i] + (d0 + d1);
            cp += p0 + p1;
            cn += n0 + n1;
            bad |= e0 | e1;
        }
        np += cp as usize;
        nn += cn as usize;
    }
    for (vb, mb) in vc
        .remainder()
        .chunks(BLOCK)
        .zip(mc.remainder().chunks(BLOCK))
    {
        let n = vb.len().min(mb.len()).min(BLOCK);
        let (Some(vb), Some(mb)) = (vb.get(..n), mb.get(..n)) else {
            continue;
        };
        let (mut cp, mut cn) = (0u32, 0u32);
        for i in 0..n {
            let (a, b, c, d, p, q, e) = one(vb[i], mb[i]);
            sp[i] = sp[i] + a;
            sn[i] = sn[i] + b;
            qp[i] = qp[i] + c;
            qn[i] = qn[i] + d;
            cp += p;
            cn += q;
            bad |= e;
        }
        np += cp as usize;
        nn += cn as usize;
    }
    (
        SignSums {
            sp: lanes::total(&sp),
            sn: lanes::total(&sn),
            qp: lanes::total(&qp),
            qn: lanes::total(&qn),
            np,
            nn,
        },
        !bad,
    )
}

/// `v = a·(a > 0 ? α : β)` with `a = v` (or `v` where `m ≠ 0`, else 0, when `MASKED`); zeros
/// stay 0.
fn scale_row<F: Float, const MASKED: bool>(v: &mut [F], m: &[F], alpha: F, beta: F) {
    let z = F::zero();
    if MASKED {
        for (x, &w) in v.iter_mut().zip(m) {
            let a = select(w != z, *x, z);
            *x = a * select(a > z, alpha, beta);
        }
    } else {
        for x in v.iter_mut() {
            *x = *x * select(*x > z, alpha, beta);
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::{vec, vec::Vec};

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn spec_vector_11_two_samples() {
        // r̃ = (1, −1); P: 2 tokens of 1, N: 3 of −1; ρ = 2/−3; Q⁺ = 2, ρ²Q⁻ = 4/9·3 = 4/3;
        // α = √(5/(10/3)) = √1.5 = 1.2247449, β = α·2/3 = 0.8164966
        let g = Groups::contiguous(2, 2).unwrap();
        let shape = Shape::new(2, 4);
        let mask = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0];
        let mut out = [9.0; 8];
        let mut rep = [ProMaxGroupReport::default()];
        let s = reinforce_pro_max(
            &g,
            &[1.0, 0.0],
            ResponseTokens::new(shape, &mask),
            &ProMaxConfig::default(),
            Some(&mut rep),
            &mut out,
        )
        .unwrap();
        let (a, b) = (1.2247449, -0.8164966);
        let want = [a, a, 0.0, 0.0, b, b, b, 0.0];
        for (x, w) in out.iter().zip(want) {
            assert!(close(*x, w, 1e-7), "{x} vs {w}");
        }
        assert_eq!(rep[0].status, ProMaxGroupStatus::Normalized);
        assert_eq!((rep[0].positive_tokens, rep[0].negative_tokens), (2, 3));
        assert!(close(rep[0].mean, 0.0, 1e-12) && close(rep[0].std, 1.0, 1e-8));
        assert_eq!(
            (s.normalized, s.clamped, s.fallback, s.nonzero_tokens),
            (1, 0, 0, 5)
        );
        // f32
        let m32 = mask.map(|x| x as f32);
        let mut o32 = [9.0f32; 8];
        reinforce_pro_max(
            &g,
            &[1.0f32, 0.0],
            ResponseTokens::new(shape, &m32),
            &ProMaxConfig::default(),
            None,
            &mut o32,
        )
        .unwrap();
        for (x, w) in o32.iter().zip(want) {
            assert!(close(*x as f64, w, 1e-6));
        }
    }

    #[test]
    fn spec_vector_11_four_samples_and_uniform() {
        // r̃ = (1, −1/3 ×3); ρ = −1; α = √(4/(1 + 1/3)) = √3, β = √3 / 3
        let g = Groups::contiguous(8, 4).unwrap();
        let shape = Shape::new(8, 1);
        let mask = [1.0; 8];
        // group 0: (1, 0, 0, 0); group 1: all correct
        let r = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [9.0; 8];
        let mut rep = [ProMaxGroupReport::default(); 2];
        let s = reinforce_pro_max(
            &g,
            &r,
            ResponseTokens::new(shape, &mask),
            &ProMaxConfig::default(),
            Some(&mut rep),
            &mut out,
        )
        .unwrap();
        let (a, b) = (1.7320508, -0.5773503);
        for (x, w) in out.iter().zip([a, b, b, b, 0.0, 0.0, 0.0, 0.0]) {
            assert!(close(*x, w, 1e-7), "{x} vs {w}");
        }
        assert_eq!(rep[1].status, ProMaxGroupStatus::FallbackSameSign);
        assert_eq!((s.normalized, s.fallback, s.uniform_skipped), (1, 1, 0));
        // uniform_scale: the all-correct group keeps r/n = 0.25 and skips step 3
        reinforce_pro_max(
            &g,
            &r,
            ResponseTokens::new(shape, &mask),
            &ProMaxConfig::uniform_scale(),
            Some(&mut rep),
            &mut out,
        )
        .unwrap();
        assert_eq!(out[4..], [0.25; 4]);
        assert_eq!(rep[1].status, ProMaxGroupStatus::UniformSkipped);
        assert!(close(out[0], a, 1e-7));
        // the separate steps agree
        let mut shaped = [0.0; 8];
        let mut uni = [false; 2];
        let k = pro_max_shaped_rewards(
            &g,
            &r,
            &ProMaxConfig::uniform_scale(),
            &mut shaped,
            Some(&mut uni),
        )
        .unwrap();
        assert_eq!((k, uni), (1, [false, true]));
        assert_eq!(shaped[4..], [0.25; 4]);
        let mut adv = [0.0; 8];
        crate::advantage::token_level_rewards(shape, &shaped, &mask, None, &mut adv).unwrap();
        pro_max_normalize(
            shape,
            &g,
            &mut adv,
            &mask,
            Some(&uni),
            &ProMaxConfig::uniform_scale(),
            None,
        )
        .unwrap();
        assert_eq!(adv, out);
    }

    #[test]
    fn guards_follow_the_reference() {
        let g1 = |n| Groups::contiguous(n, n).unwrap();
        // stabiliser: [1, −2, 0 | pad 123], eps 0.1: α = √(2/(1 + ¼·4 + 0.1)) = √(20/21),
        // β = α/2; the valid zero stays 0, the padded 123 becomes 0
        let cfg = ProMaxConfig {
            eps: 0.1,
            ..ProMaxConfig::default()
        };
        let mut v = [1.0, -2.0, 0.0, 123.0, 0.0, 0.0, 0.0, 0.0];
        let m = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let mut rep = [ProMaxGroupReport::default()];
        pro_max_normalize(
            Shape::new(2, 4),
            &g1(2),
            &mut v,
            &m,
            None,
            &cfg,
            Some(&mut rep),
        )
        .unwrap();
        let a = (20.0f64 / 21.0).sqrt();
        assert!(close(v[0], a, 1e-15) && close(v[1], -a, 1e-15));
        assert_eq!(v[2..], [0.0; 6]);
        assert_eq!(rep[0].status, ProMaxGroupStatus::Normalized);
        // lower clamp: [100, −200], eps 0.1 → α, β ≈ 0.01, 0.005 → both 0.1: [10, −20]
        let mut v = [100.0, -200.0];
        pro_max_normalize(
            Shape::new(2, 1),
            &g1(2),
            &mut v,
            &[1.0, 1.0],
            None,
            &cfg,
            Some(&mut rep),
        )
        .unwrap();
        assert_eq!(v, [10.0, -20.0]);
        assert_eq!(rep[0].status, ProMaxGroupStatus::Clamped);
        // upper clamp: [1e−4, −1e−3] → both factors 10
        let mut v = [1e-4, -1e-3];
        let d = ProMaxConfig::default();
        pro_max_normalize(
            Shape::new(2, 1),
            &g1(2),
            &mut v,
            &[1.0, 1.0],
            None,
            &d,
            Some(&mut rep),
        )
        .unwrap();
        assert!(close(v[0], 1e-3, 1e-18) && close(v[1], -1e-2, 1e-17));
        assert_eq!((rep[0].alpha, rep[0].beta), (10.0, 10.0));
        // product cap: [20000, −20000] → ρ²Q⁻ = 4e8 capped at 1e8, status Clamped
        let mut v = [20000.0, -20000.0];
        pro_max_normalize(
            Shape::new(2, 1),
            &g1(2),
            &mut v,
            &[1.0, 1.0],
            None,
            &d,
            Some(&mut rep),
        )
        .unwrap();
        assert_eq!(rep[0].status, ProMaxGroupStatus::Clamped);
        // small sum: |S⁻| = 1e−9 < ε → unchanged
        let mut v = [1.0, -1e-9];
        pro_max_normalize(
            Shape::new(2, 1),
            &g1(2),
            &mut v,
            &[1.0, 1.0],
            None,
            &d,
            Some(&mut rep),
        )
        .unwrap();
        assert_eq!(
            (v, rep[0].status),
            ([1.0, -1e-9], ProMaxGroupStatus::FallbackSmallSum)
        );
        // non-finite: S⁺ overflows → ρ = −∞ → β = −0·(−∞) = NaN → unchanged
        let mut v = [1e308, 1e308, -1.0, 0.0];
        pro_max_normalize(
            Shape::new(4, 1),
            &g1(4),
            &mut v,
            &[1.0; 4],
            None,
            &d,
            Some(&mut rep),
        )
        .unwrap();
        assert_eq!(v, [1e308, 1e308, -1.0, 0.0]);
        assert_eq!(rep[0].status, ProMaxGroupStatus::FallbackNonFinite);
    }

    #[test]
    fn errors() {
        let shape = Shape::new(2, 2);
        let mask = [1.0, 0.0, 1.0, 1.0];
        let mut out = [0.0; 4];
        let d = ProMaxConfig::default();
        assert_eq!(
            reinforce_pro_max(
                &Groups::contiguous(2, 1).unwrap(),
                &[1.0, 0.0],
                ResponseTokens::new(shape, &mask),
                &d,
                None,
                &mut out
            ),
            Err(Error::GroupTooSmall {
                estimator: "reinforce_pro_max",
                n: 1
            })
        );
        let g = Groups::contiguous(2, 2).unwrap();
        assert_eq!(
            reinforce_pro_max(
                &g,
                &[1.0, 0.0],
                ResponseTokens::new(shape, &[1.0, 0.0, 0.0, 0.0]),
                &d,
                None,
                &mut out
            ),
            Err(crate::advantage::token::EMPTY_ROW)
        );
        assert_eq!(
            reinforce_pro_max(
                &g,
                &[1.0, 0.0],
                ResponseTokens::new(shape, &mask).with_kl(&[0.0, f64::NAN, 0.0, 0.0]),
                &d,
                None,
                &mut out
            ),
            Err(Error::NonFinite {
                what: "weighted_kl",
                index: 1
            })
        );
        assert!(matches!(
            reinforce_pro_max(
                &g,
                &[1.0, 0.0],
                ResponseTokens::new(shape, &mask),
                &d,
                Some(&mut [ProMaxGroupReport::default(); 2]),
                &mut out
            ),
            Err(Error::LengthMismatch { .. })
        ));
        let bad = ProMaxConfig {
            max_scale: 0.0,
            ..d
        };
        assert!(matches!(
            reinforce_pro_max(
                &g,
                &[1.0, 0.0],
                ResponseTokens::new(shape, &mask),
                &bad,
                None,
                &mut out
            ),
            Err(Error::OutOfRange { .. })
        ));
        // permuted layout: rows 1, 0 hold group 0; the NaN at row 1, t = 1 is reported with
        // its flat index
        let mut inv = [0; 2];
        let pg = Groups::permuted(&[1, 0], 2, &mut inv).unwrap();
        let mut v = [1.0, 0.0, -1.0, f64::NAN];
        assert_eq!(
            pro_max_normalize(shape, &pg, &mut v, &mask, None, &d, None),
            Err(Error::NonFinite {
                what: "advantages",
                index: 3
            })
        );
        let mut v = [1.0, 0.0, -1.0, 0.0];
        assert_eq!(
            pro_max_normalize(shape, &pg, &mut v, &[1.0, 0.0, 0.5, 1.0], None, &d, None),
            Err(Error::InvalidMask {
                what: "mask",
                index: 2
            })
        );
        assert!(matches!(
            pro_max_normalize(shape, &pg, &mut v, &mask, Some(&[true, false]), &d, None),
            Err(Error::LengthMismatch {
                what: "skip_groups",
                ..
            })
        ));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Valid tokens' values of group `g` (contiguous, n rows) of a flat `[rows, cols]` tensor.
        fn group_vals(v: &[f64], m: &[f64], cols: usize, n: usize, g: usize) -> Vec<f64> {
            let r = g * n * cols..(g + 1) * n * cols;
            v[r.clone()]
                .iter()
                .zip(&m[r])
                .filter(|p| *p.1 == 1.0)
                .map(|p| *p.0)
                .collect()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            /// Mean 0 and population variance 1 over the nonzero valid tokens of every group
            /// normalised without clamp (variance exactly D/(D + ε), D = Q⁺ + ρ²Q⁻, by the
            /// ε-stabilised denominator of docs/algorithms.md §5).
            #[test]
            fn normalised_groups_have_mean_0_var_1(
                n in 2usize..6,
                cols in 1usize..40,
                raw in proptest::collection::vec((-3.0f64..3.0, 0u8..5), 1..600),
            ) {
                let groups = 2;
                let rows = n * groups;
                let len = rows * cols;
                let v0: Vec<f64> = raw.iter().cycle().take(len).map(|p| p.0).collect();
                let m: Vec<f64> = raw.iter().cycle().take(len).map(|p| (p.1 != 0) as u8 as f64).collect();
                let mut v = v0.clone();
                let g = Groups::contiguous(rows, n).unwrap();
                let mut rep = vec![ProMaxGroupReport::default(); groups];
                let cfg = ProMaxConfig::default();
                pro_max_normalize(Shape::new(rows, cols), &g, &mut v, &m, None, &cfg, Some(&mut rep)).unwrap();
                for (gi, r) in rep.iter().enumerate() {
                    let before = group_vals(&v0, &m, cols, n, gi);
                    let after = group_vals(&v, &m, cols, n, gi);
                    if r.status != ProMaxGroupStatus::Normalized {
                        if !r.status.is_normalized() {
                            prop_assert_eq!(&before, &after);
                        }
                        continue;
                    }
                    let nz: Vec<f64> = after.iter().copied().filter(|x| *x != 0.0).collect();
                    let k = nz.len() as f64;
                    let mean = nz.iter().sum::<f64>() / k;
                    let var = nz.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / k;
                    let (sp, sn): (f64, f64) = (before.iter().filter(|x| **x > 0.0).sum(), before.iter().filter(|x| **x < 0.0).sum());
                    let qp: f64 = before.iter().filter(|x| **x > 0.0).map(|x| x * x).sum();
                    let qn: f64 = before.iter().filter(|x| **x < 0.0).map(|x| x * x).sum();
                    let dd = qp + (sp / sn).powi(2) * qn;
                    prop_assert!(mean.abs() < 1e-9, "mean {}", mean);
                    prop_assert!((var - dd / (dd + 1e-8)).abs() < 1e-9, "var {}", var);
                    prop_assert!((r.mean - mean).abs() < 1e-9 && (r.std - var.sqrt()).abs() < 1e-7);
                    // signs and zeros preserved
                    for (b, a) in before.iter().zip(&after) {
                        prop_assert_eq!(b.signum() * (*b != 0.0) as u8 as f64, a.signum() * (*a != 0.0) as u8 as f64);
                    }
                }
                for (x, w) in v.iter().zip(&m) {
                    if *w == 0.0 { prop_assert_eq!(*x, 0.0); }
                }
            }

            /// A shuffled batch with its permutation gives the contiguous result, row for row;
            /// and the one-call estimator equals the separate steps.
            #[test]
            fn permuted_equals_contiguous(
                n in 2usize..5,
                cols in 1usize..80,
                uniform in any::<bool>(),
                with_kl in any::<bool>(),
                rewards in proptest::collection::vec(prop::sample::select(vec![0.0f64, 1.0, 0.5]), 12),
                raw in proptest::collection::vec((0.0f64..0.05, 0u8..5), 1..400),
                shuffle in Just(()).prop_perturb(|_, mut rng| {
                    let mut p: Vec<usize> = (0..12).collect();
                    for i in (1..p.len()).rev() { p.swap(i, rng.random_range(0..=i)); }
                    p
                }),
            ) {
                let groups = 12 / n;
                let rows = groups * n;
                let shape = Shape::new(rows, cols);
                let len = rows * cols;
                let wk: Vec<f64> = raw.iter().cycle().take(len).map(|p| p.0).collect();
                let mut m: Vec<f64> = raw.iter().cycle().take(len).map(|p| (p.1 != 0) as u8 as f64).collect();
                for r in 0..rows { m[r * cols] = 1.0; }
                let r = &rewards[..rows];
                let cfg = if uniform { ProMaxConfig::uniform_scale() } else { ProMaxConfig::default() };
                let g = Groups::contiguous(rows, n).unwrap();
                fn mk<'a>(shape: Shape, m: &'a [f64], k: &'a [f64], kl: bool) -> ResponseTokens<'a, f64> {
                    let t = ResponseTokens::new(shape, m);
                    if kl { t.with_kl(k) } else { t }
                }
                let toks = |m, k| mk(shape, m, k, with_kl);
                let mut out = vec![0.0; len];
                let mut rep = vec![ProMaxGroupReport::default(); groups];
                let s = reinforce_pro_max(&g, r, toks(&m, &wk), &cfg, Some(&mut rep), &mut out).unwrap();
                // separate steps
                let mut shaped = vec![0.0; rows];
                let mut uni = vec![false; groups];
                pro_max_shaped_rewards(&g, r, &cfg, &mut shaped, Some(&mut uni)).unwrap();
                let mut steps = vec![0.0; len];
                crate::advantage::token_level_rewards(shape, &shaped, &m, toks(&m, &wk).weighted_kl, &mut steps).unwrap();
                crate::advantage::returns_to_go_in_place(shape, &mut steps, &m, 1.0).unwrap();
                let mut rep2 = vec![ProMaxGroupReport::default(); groups];
                let s2 = pro_max_normalize(shape, &g, &mut steps, &m, Some(&uni), &cfg, Some(&mut rep2)).unwrap();
                prop_assert_eq!(s.nonzero_tokens, s2.nonzero_tokens);
                // the summary's variance is Σx²/n − mean² (one pass): its rounding error is a few ulp of
                // E[x²], so compare variances on that scale (a std near 0 is only good to √ε·rms)
                let ex2 = 1.0 + s.mean.powi(2) + s.std.powi(2);
                prop_assert!((s.mean - s2.mean).abs() < 1e-9, "{:?} vs {:?}", s, s2);
                prop_assert!((s.std.powi(2) - s2.std.powi(2)).abs() < 1e-12 * ex2, "{:?} vs {:?}", s, s2);
                for (a, b) in out.iter().zip(&steps) {
                    prop_assert!((a - b).abs() < 1e-9, "{} vs {}", a, b);
                }
                for (a, b) in rep.iter().zip(&rep2) {
                    prop_assert_eq!(a.status, b.status);
                }
                // shuffle: the sample at original position p moves to row `row` with index[row] = p
                let index: Vec<usize> = shuffle[..rows].iter().copied().filter(|&p| p < rows).collect();
                prop_assume!(index.len() == rows);
                let mut inv = vec![0; rows];
                let pg = Groups::permuted(&index, n, &mut inv).unwrap();
                let mut pr = vec![0.0; rows];
                let mut pm = vec![0.0; len];
                let mut pk = vec![0.0; len];
                for (row, &p) in index.iter().enumerate() {
                    pr[row] = r[p];
                    pm[row * cols..(row + 1) * cols].copy_from_slice(&m[p * cols..(p + 1) * cols]);
                    pk[row * cols..(row + 1) * cols].copy_from_slice(&wk[p * cols..(p + 1) * cols]);
                }
                let mut pout = vec![0.0; len];
                let mut prep = vec![ProMaxGroupReport::default(); groups];
                reinforce_pro_max(&pg, &pr, toks(&pm, &pk), &cfg, Some(&mut prep), &mut pout).unwrap();
                for (row, &p) in index.iter().enumerate() {
                    for t in 0..cols {
                        let (a, b) = (pout[row * cols + t], out[p * cols + t]);
                        prop_assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{} vs {}", a, b);
                    }
                }
                prop_assert_eq!(prep, rep);
            }
        }
    }
}
