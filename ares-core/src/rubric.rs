//! Graded system prompts (docs/algorithms.md §9): per-sample rubric reveal ratios, the number
//! of criteria shown, an unbiased random subset of them, the system message, and the
//! rubric reward.
//!
//! Sample k (0-based) of the n samples of a prompt sees a fraction of the prompt's rubric
//! criteria in its system message: all of them for k = 0, fewer for later samples, none for
//! the last, so one group holds answers of graded quality. Only the rollout sees the
//! message; training uses the original prompt.

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param, check_scratch, round_half_even, to_f64};
use core::fmt::Write;
use num_traits::Float;

/// The in-group reveal rule (`graded_system_prompt_rule` / `group_decay_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RevealRule {
    /// `linear` (default): ratio `max(0, (n−1−k)/(n−1))`: 1, (n−2)/(n−1), …, 0.
    #[default]
    Linear,
    /// `binary`: ratio 1 for the first `full_reveal_count` samples (default 1), else 0.
    Binary {
        /// Number of samples that see every criterion.
        full_reveal_count: usize,
    },
}

/// The step schedule factor `s(step)` that multiplies the in-group ratio. With
/// `x = clip((step − 1)/(T − 1), 0, 1)` (T = total training steps, steps counted from 1;
/// for T ≤ 1 there is no decay and s = 1), each factor is clipped to [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum StepRule<F> {
    /// No step decay: s = 1 (plain `linear` / `binary`).
    #[default]
    Constant,
    /// `step_linear`: s = 1 − x = (T − step)/(T − 1).
    StepLinear,
    /// `step_power`: s = (1 − x)^p, p ≥ 0 (`step_power_n`, default 1).
    StepPower {
        /// The exponent p.
        power: F,
    },
    /// `step_sigmoid`: s = 1/(1 + e^{(x − x0)·k}) (`start_point` x0, default 0.3;
    /// `steepness` k, default 10).
    StepSigmoid {
        /// x0: the progress at which s = 1/2.
        start_point: F,
        /// k: how fast s falls around x0.
        steepness: F,
    },
}

impl<F: Float> StepRule<F> {
    /// `step_sigmoid` with the defaults x0 = 0.3, k = 10.
    pub fn step_sigmoid() -> Self {
        StepRule::StepSigmoid {
            start_point: cast(0.3),
            steepness: cast(10.0),
        }
    }

    /// `step_power` with the default p = 1.
    pub fn step_power() -> Self {
        StepRule::StepPower { power: F::one() }
    }
}

/// Errors unless `n ≥ 2` and `k < n`.
fn check_sample(k: usize, n: usize) -> Result<()> {
    if n < 2 {
        return Err(Error::GroupTooSmall {
            estimator: "graded_system_prompt",
            n,
        });
    }
    if k >= n {
        return Err(Error::InvalidIndex {
            what: "k (sample index)",
            position: 0,
            value: k,
            len: n,
        });
    }
    Ok(())
}

/// The in-group reveal ratio of sample `k` of `n` (see [`RevealRule`]):
/// `linear` `(n−1−k)/(n−1)`, `binary` `[k < full_reveal_count]`.
///
/// Errors: `n < 2` ([`Error::GroupTooSmall`]: the feature is off for n = 1), `k ≥ n`
/// ([`Error::InvalidIndex`]).
pub fn reveal_ratio<F: Float>(rule: RevealRule, k: usize, n: usize) -> Result<F> {
    check_sample(k, n)?;
    Ok(match rule {
        RevealRule::Linear => cast::<F>((n - 1 - k) as f64) / cast::<F>((n - 1) as f64),
        RevealRule::Binary { full_reveal_count } => {
            if k < full_reveal_count {
                F::one()
            } else {
                F::zero()
            }
        }
    })
}

/// The step schedule factor `s(step) ∈ [0, 1]` of [`StepRule`] at training step `step`
/// (1-based) of `total_steps`. `total_steps ≤ 1` gives 1 (no decay), as the reference does;
/// steps before 1 or after T are clipped to x = 0 or 1.
///
/// Errors ([`Error::OutOfRange`]): a non-finite parameter, or `power < 0`.
pub fn step_factor<F: Float>(rule: &StepRule<F>, step: u64, total_steps: u64) -> Result<F> {
    match *rule {
        StepRule::Constant | StepRule::StepLinear => {}
        StepRule::StepPower { power } => {
            check_param("step_power_n", power, power >= F::zero(), ">= 0")?
        }
        StepRule::StepSigmoid {
            start_point,
            steepness,
        } => {
            check_param("step_sigmoid_start_point", start_point, true, "finite")?;
            check_param("step_sigmoid_steepness", steepness, true, "finite")?;
        }
    }
    if total_steps <= 1 {
        return Ok(F::one());
    }
    let x = (step.saturating_sub(1) as f64 / (total_steps - 1) as f64).min(1.0);
    let x: F = cast(x);
    let s = match *rule {
        StepRule::Constant => F::one(),
        StepRule::StepLinear => F::one() - x,
        StepRule::StepPower { power } => (F::one() - x).powf(power),
        StepRule::StepSigmoid {
            start_point,
            steepness,
        } => F::one() / (F::one() + ((x - start_point) * steepness).exp()),
    };
    // NaN cannot arise from validated inputs; max/min would map it to 0 anyway.
    Ok(s.max(F::zero()).min(F::one()))
}

/// How many criteria a sample sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reveal {
    /// Ratio ≥ 1: every criterion, in the original order.
    All,
    /// Ratio < 1: a uniformly random subset of this many criteria, in random order
    /// (0 = none).
    Subset(usize),
}

impl Reveal {
    /// The number of criteria shown out of `total`.
    pub fn count(self, total: usize) -> usize {
        match self {
            Reveal::All => total,
            Reveal::Subset(c) => c.min(total),
        }
    }
}

/// The reveal for a ratio: ratio ≥ 1 → [`Reveal::All`]; else
/// `c = round_half_even(N·ratio)` clamped to [0, N] → [`Reveal::Subset`]`(c)`.
///
/// No "at least one criterion" rule: a small positive ratio may show none (the spec's
/// rounding; an older reference forced one).
///
/// Errors: non-finite `ratio` ([`Error::NonFinite`], index 0).
pub fn reveal_count<F: Float>(ratio: F, criteria: usize) -> Result<Reveal> {
    if !ratio.is_finite() {
        return Err(Error::NonFinite {
            what: "ratio",
            index: 0,
        });
    }
    if ratio >= F::one() {
        return Ok(Reveal::All);
    }
    let c = to_f64(round_half_even(cast::<F>(criteria as f64) * ratio));
    // `as` saturates; NaN (unreachable here) would give 0.
    Ok(Reveal::Subset((c.max(0.0) as usize).min(criteria)))
}

/// The exact reveal of the default `linear` rule: `N·(n−1−k)/(n−1)` rounded half to even in
/// integer arithmetic, so float noise cannot flip a .5 case (n = 5, N = 5, k = 2: 2.5 → 2).
/// k = 0 → [`Reveal::All`].
///
/// Errors: `n < 2`, `k ≥ n` (see [`reveal_ratio`]).
pub fn linear_reveal_count(k: usize, n: usize, criteria: usize) -> Result<Reveal> {
    check_sample(k, n)?;
    if k == 0 {
        return Ok(Reveal::All);
    }
    let num = criteria as u128 * (n - 1 - k) as u128;
    let den = (n - 1) as u128;
    let (q, r) = (num / den, num % den);
    let up = 2 * r > den || (2 * r == den && q % 2 == 1);
    let c = q + u128::from(up);
    // c ≤ N because (n−1−k)/(n−1) < 1.
    Ok(Reveal::Subset(
        usize::try_from(c).unwrap_or(criteria).min(criteria),
    ))
}

/// The graded schedule: the in-group rule times the step factor.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GradedSchedule<F> {
    /// In-group rule.
    pub reveal: RevealRule,
    /// Step factor.
    pub step: StepRule<F>,
}

impl<F: Float> GradedSchedule<F> {
    /// The reveal ratio of sample `k` of `n` at `step` of `total_steps`:
    /// [`reveal_ratio`] · [`step_factor`].
    pub fn ratio(&self, k: usize, n: usize, step: u64, total_steps: u64) -> Result<F> {
        let r: F = reveal_ratio(self.reveal, k, n)?;
        Ok(r * step_factor(&self.step, step, total_steps)?)
    }

    /// How many of `criteria` criteria sample `k` of `n` sees. When the step factor is
    /// exactly 1 the count is exact ([`linear_reveal_count`]; binary gives all or none);
    /// otherwise it is [`reveal_count`] of [`GradedSchedule::ratio`].
    pub fn reveal(
        &self,
        k: usize,
        n: usize,
        step: u64,
        total_steps: u64,
        criteria: usize,
    ) -> Result<Reveal> {
        check_sample(k, n)?;
        let s: F = step_factor(&self.step, step, total_steps)?;
        if s == F::one() {
            return match self.reveal {
                RevealRule::Linear => linear_reveal_count(k, n, criteria),
                RevealRule::Binary { full_reveal_count } => Ok(if k < full_reveal_count {
                    Reveal::All
                } else {
                    Reveal::Subset(0)
                }),
            };
        }
        let r: F = reveal_ratio(self.reveal, k, n)?;
        reveal_count(r * s, criteria)
    }
}

/// A uniform integer in `[0, bound)` from a 64-bit generator, by rejection: draws below
/// `2^64 mod bound` are rejected so every residue is equally likely. After 64 rejections
/// (probability < 2^−64 for any working generator) it falls back to the plain residue, so
/// a broken generator cannot hang the caller. `bound = 0` returns 0.
pub fn uniform_below<R: FnMut() -> u64>(bound: u64, rng: &mut R) -> u64 {
    if bound == 0 {
        return 0;
    }
    let threshold = bound.wrapping_neg() % bound;
    let mut x = rng();
    for _ in 0..64 {
        if x >= threshold {
            break;
        }
        x = rng();
    }
    x % bound
}

/// A uniformly random subset of `count` of the indices `0..total` in uniformly random
/// order, by a partial Fisher–Yates shuffle: afterwards `shown[..count]` holds it
/// (`shown[..total]` is a permutation of `0..total`). Returns `count`.
///
/// Errors: `shown` shorter than `total` ([`Error::ScratchTooSmall`]), `count > total`
/// ([`Error::OutOfRange`]).
pub fn sample_criteria<R: FnMut() -> u64>(
    count: usize,
    total: usize,
    rng: &mut R,
    shown: &mut [usize],
) -> Result<usize> {
    check_scratch("shown", total, shown.len())?;
    if count > total {
        return Err(Error::OutOfRange {
            what: "count (criteria shown)",
            value: count as f64,
            expected: "<= number of criteria",
        });
    }
    let shown = &mut shown[..total];
    for (i, s) in shown.iter_mut().enumerate() {
        *s = i;
    }
    for i in 0..count {
        // j ∈ [i, total): u < total − i
        let j = i + uniform_below((total - i) as u64, rng) as usize;
        shown.swap(i, j);
    }
    Ok(count)
}

/// The criteria a sample sees: [`Reveal::All`] → `0..total` in the original order (the
/// generator is not called); [`Reveal::Subset`]`(c)` → [`sample_criteria`]. The result is
/// `shown[..returned count]`.
///
/// Errors: as [`sample_criteria`].
pub fn select_criteria<R: FnMut() -> u64>(
    reveal: Reveal,
    total: usize,
    rng: &mut R,
    shown: &mut [usize],
) -> Result<usize> {
    match reveal {
        Reveal::All => {
            check_scratch("shown", total, shown.len())?;
            for (i, s) in shown.iter_mut().take(total).enumerate() {
                *s = i;
            }
            Ok(total)
        }
        Reveal::Subset(c) => sample_criteria(c, total, rng, shown),
    }
}

/// Default intro line of the rubric system message.
pub const DEFAULT_INTRO: &str = "You are a helpful assistant. For this question, please consider the following evaluation criteria:";
/// Header of the positive-points section.
pub const DEFAULT_INCLUDE_HEADER: &str =
    "IMPORTANT POINTS TO INCLUDE (you should aim to address these):";
/// Header of the negative-points section.
pub const DEFAULT_AVOID_HEADER: &str = "IMPORTANT POINTS TO AVOID (you should not do these):";
/// Default closing request.
pub const DEFAULT_CLOSING: &str = "Please provide a comprehensive and helpful response that addresses the user's concerns while following the above guidelines.";
/// Default instruction not to mention the criteria.
pub const DEFAULT_HIDE_INSTRUCTION: &str = "IMPORTANT: Do not mention or reference these evaluation criteria in your response. Do not indicate that you have seen any scoring rubric or evaluation guidelines. Your response should appear natural and spontaneous. Revealing that you have access to evaluation criteria would be considered cheating and is strictly prohibited.";
/// Default base message written when no criterion is shown and `add_base_when_zero` is on.
pub const DEFAULT_BASE: &str = "You are a helpful assistant.";

/// The texts of the rubric system message. The layout (that of the RuscaRL reference):
///
/// ```text
/// {intro}
///
/// {include_header}
/// Criterion 1: {text} (worth {p} points)
/// …
///
/// {avoid_header}
/// Criterion 1: {text} (penalty: {|p|} points)
/// …
///
/// {closing}
///
/// {hide_instruction}
/// ```
///
/// A section appears only when it has a criterion. Criteria are numbered from 1 within
/// each section, in the order shown (the reference's numbering). The message ends with
/// the hide instruction, or with `closing` and a blank line when it is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RubricPrompt<'a> {
    /// First line.
    pub intro: &'a str,
    /// Header before the positive criteria.
    pub include_header: &'a str,
    /// Header before the negative criteria.
    pub avoid_header: &'a str,
    /// Request after the criteria.
    pub closing: &'a str,
    /// Instruction not to mention the criteria (`None` = off; default on).
    pub hide_instruction: Option<&'a str>,
    /// The message written instead when no criterion is printed and `add_base_when_zero`.
    pub base: &'a str,
    /// With no criterion printed: write `base` (true) or no message at all (false,
    /// default).
    pub add_base_when_zero: bool,
}

impl Default for RubricPrompt<'_> {
    fn default() -> Self {
        RubricPrompt {
            intro: DEFAULT_INTRO,
            include_header: DEFAULT_INCLUDE_HEADER,
            avoid_header: DEFAULT_AVOID_HEADER,
            closing: DEFAULT_CLOSING,
            hide_instruction: Some(DEFAULT_HIDE_INSTRUCTION),
            base: DEFAULT_BASE,
            add_base_when_zero: false,
        }
    }
}

/// Writes a point value as Python prints the reference's numbers: integral values without a
/// fraction (`8`, not `8.0`), others in shortest round-trip form (`2.5`). `f32` values are
/// printed as `f32` so `0.1f32` reads `0.1`.
fn write_points<F: Float, W: Write>(out: &mut W, p: F) -> core::fmt::Result {
    let is_f32 = to_f64(F::epsilon()) == f64::from(f32::EPSILON);
    match (is_f32, p.to_f32()) {
        (true, Some(x)) => write!(out, "{x}"),
        _ => write!(out, "{}", to_f64(p)),
    }
}

/// Writes the rubric system message for the criteria `shown` (indices into `criteria`, in
/// display order; `criteria` are `(text, points)` pairs) into `out`, laid out as
/// [`RubricPrompt`] says: positive points under the include header as
/// `Criterion i: text (worth p points)`, negative points under the avoid header as
/// `Criterion i: text (penalty: |p| points)`; zero-point criteria are not printed.
///
/// Returns `true` when a message was written. When no shown criterion has non-zero points
/// (in particular when `shown` is empty) no message is written (`false`), unless
/// `add_base_when_zero`, which writes `prompt.base` (`true`).
///
/// Errors, checked before anything is written: an entry of `shown` out of range or
/// repeated ([`Error::InvalidIndex`]); non-finite points ([`Error::NonFinite`], criterion
/// index); the writer failing ([`Error::Format`]).
pub fn write_rubric_message<F: Float, W: Write>(
    criteria: &[(&str, F)],
    shown: &[usize],
    prompt: &RubricPrompt<'_>,
    out: &mut W,
) -> Result<bool> {
    for (position, &i) in shown.iter().enumerate() {
        let repeated = shown.iter().take(position).any(|&j| j == i);
        match criteria.get(i) {
            Some(&(_, p)) if !repeated => {
                if !p.is_finite() {
                    return Err(Error::NonFinite {
                        what: "criteria points",
                        index: i,
                    });
                }
            }
            _ => {
                return Err(Error::InvalidIndex {
                    what: "shown",
                    position,
                    value: i,
                    len: criteria.len(),
                });
            }
        }
    }
    let picked = || shown.iter().filter_map(|&i| criteria.get(i).copied());
    let positives = picked().filter(|&(_, p)| p > F::zero()).count();
    let negatives = picked().filter(|&(_, p)| p < F::zero()).count();
    if positives + negatives == 0 {
        if prompt.add_base_when_zero {
            out.write_str(prompt.base)?;
            return Ok(true);
        }
        return Ok(false);
    }
    write!(out, "{}\n\n", prompt.intro)?;
    if positives > 0 {
        writeln!(out, "{}", prompt.include_header)?;
        for (i, (text, p)) in picked().filter(|&(_, p)| p > F::zero()).enumerate() {
            write!(out, "Criterion {}: {} (worth ", i + 1, text)?;
            write_points(out, p)?;
            out.write_str(" points)\n")?;
        }
        out.write_str("\n")?;
    }
    if negatives > 0 {
        writeln!(out, "{}", prompt.avoid_header)?;
        for (i, (text, p)) in picked().filter(|&(_, p)| p < F::zero()).enumerate() {
            write!(out, "Criterion {}: {} (penalty: ", i + 1, text)?;
            write_points(out, p.abs())?;
            out.write_str(" points)\n")?;
        }
        out.write_str("\n")?;
    }
    write!(out, "{}\n\n", prompt.closing)?;
    if let Some(hide) = prompt.hide_instruction {
        out.write_str(hide)?;
    }
    Ok(true)
}

/// The rubric reward: `score = Σ_{met} points / Σ_{points > 0} points`. Met criteria with
/// negative points subtract; the score is not clipped (it lies in
/// `[Σ negative / Σ positive, 1]`). Which criteria are met is the grader's call.
///
/// Errors: `met.len()` ≠ `points.len()` ([`Error::LengthMismatch`]), non-finite points
/// ([`Error::NonFinite`]), no positive points ([`Error::OutOfRange`] on
/// `"total positive points"`).
pub fn rubric_score<F: Float>(points: &[F], met: &[bool]) -> Result<F> {
    check_len("met", points.len(), met.len())?;
    if let Some(index) = points.iter().position(|p| !p.is_finite()) {
        return Err(Error::NonFinite {
            what: "points",
            index,
        });
    }
    let total = points
        .iter()
        .filter(|&&p| p > F::zero())
        .fold(F::zero(), |a, &p| a + p);
    check_param("total positive points", total, total > F::zero(), "> 0")?;
    let achieved = points
        .iter()
        .zip(met)
        .filter(|&(_, &m)| m)
        .fold(F::zero(), |a, (&p, _)| a + p);
    Ok(achieved / total)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{string::String, vec, vec::Vec};

    /// SplitMix64: a small deterministic generator for the tests.
    fn splitmix(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    fn counts(n: usize, criteria: usize) -> Vec<usize> {
        let sched = GradedSchedule::<f64>::default();
        (0..n)
            .map(|k| sched.reveal(k, n, 1, 1, criteria).unwrap().count(criteria))
            .collect()
    }

    #[test]
    fn vector_13_ratios_and_counts() {
        for k in 0..8 {
            let r: f64 = reveal_ratio(RevealRule::Linear, k, 8).unwrap();
            assert!((r - (7 - k) as f64 / 7.0).abs() < 1e-15);
        }
        // 10·(6/7) = 8.57 → 9, 50/7 = 7.14 → 7, 40/7 = 5.71 → 6, 30/7 = 4.29 → 4,
        // 20/7 = 2.86 → 3, 10/7 = 1.43 → 1, 0
        assert_eq!(counts(8, 10), vec![10, 9, 7, 6, 4, 3, 1, 0]);
        // 5·3/4 = 3.75 → 4, 2.5 → 2 (half to even), 1.25 → 1, 0
        assert_eq!(counts(5, 5), vec![5, 4, 2, 1, 0]);
        assert_eq!(linear_reveal_count(0, 8, 10), Ok(Reveal::All));
        assert_eq!(linear_reveal_count(7, 8, 10), Ok(Reveal::Subset(0)));
        // the float path agrees on these
        for (n, total, want) in [(8, 10, counts(8, 10)), (5, 5, counts(5, 5))] {
            for (k, &w) in want.iter().enumerate() {
                let r: f64 = reveal_ratio(RevealRule::Linear, k, n).unwrap();
                assert_eq!(reveal_count(r, total).unwrap().count(total), w);
                let r32: f32 = reveal_ratio(RevealRule::Linear, k, n).unwrap();
                assert_eq!(reveal_count(r32, total).unwrap().count(total), w);
            }
        }
    }

    #[test]
    fn binary_rule() {
        let rule = RevealRule::Binary {
            full_reveal_count: 3,
        };
        let r: Vec<f64> = (0..5).map(|k| reveal_ratio(rule, k, 5).unwrap()).collect();
        assert_eq!(r, vec![1.0, 1.0, 1.0, 0.0, 0.0]);
        let sched = GradedSchedule::<f64> {
            reveal: rule,
            step: StepRule::Constant,
        };
        assert_eq!(sched.reveal(2, 5, 1, 100, 7), Ok(Reveal::All));
        assert_eq!(sched.reveal(3, 5, 1, 100, 7), Ok(Reveal::Subset(0)));
        let all: Vec<f64> = (0..4)
            .map(|k| {
                reveal_ratio(
                    RevealRule::Binary {
                        full_reveal_count: 9,
                    },
                    k,
                    4,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(all, vec![1.0; 4]);
    }

    #[test]
    fn sample_index_errors() {
        assert_eq!(
            reveal_ratio::<f64>(RevealRule::Linear, 0, 1),
            Err(Error::GroupTooSmall {
                estimator: "graded_system_prompt",
                n: 1
            })
        );
        assert_eq!(
            linear_reveal_count(8, 8, 10),
            Err(Error::InvalidIndex {
                what: "k (sample index)",
                position: 0,
                value: 8,
                len: 8
            })
        );
        assert!(
            GradedSchedule::<f64>::default()
                .reveal(0, 0, 1, 1, 3)
                .is_err()
        );
    }

    #[test]
    fn step_factors() {
        let f = |rule: StepRule<f64>, step| step_factor(&rule, step, 11).unwrap();
        // x = (step − 1)/10
        assert_eq!(f(StepRule::StepLinear, 1), 1.0);
        assert!((f(StepRule::StepLinear, 6) - 0.5).abs() < 1e-15);
        assert_eq!(f(StepRule::StepLinear, 11), 0.0);
        assert_eq!(f(StepRule::StepLinear, 50), 0.0); // clipped past T
        assert_eq!(f(StepRule::StepLinear, 0), 1.0); // clipped before 1
        // (1 − 0.5)² = 0.25
        assert!((f(StepRule::StepPower { power: 2.0 }, 6) - 0.25).abs() < 1e-15);
        assert_eq!(f(StepRule::StepPower { power: 0.0 }, 11), 1.0); // 0^0 = 1
        assert_eq!(f(StepRule::step_power(), 11), 0.0);
        // sigmoid x0 0.3, k 10: x = 0 → 1/(1 + e^−3) = 0.9525741; x = 0.3 → 0.5;
        // x = 1 → 1/(1 + e^7) = 0.000911
        let sig = StepRule::step_sigmoid();
        assert!((f(sig, 1) - 0.9525741268).abs() < 1e-9);
        assert!((f(sig, 4) - 0.5).abs() < 1e-12);
        assert!((f(sig, 11) - 0.0009110512).abs() < 1e-9);
        // T ≤ 1: no decay
        assert_eq!(step_factor(&sig, 5, 1), Ok(1.0));
        assert_eq!(step_factor(&StepRule::StepLinear, 5, 0), Ok(1.0));
        // huge steepness saturates without NaN
        let steep = StepRule::StepSigmoid {
            start_point: 0.0,
            steepness: 1e300,
        };
        assert_eq!(step_factor(&steep, 11, 11), Ok(0.0));
        assert!(step_factor(&StepRule::StepPower { power: -1.0 }, 1, 5).is_err());
        assert!(
            step_factor(
                &StepRule::StepSigmoid {
                    start_point: f64::NAN,
                    steepness: 1.0
                },
                1,
                5
            )
            .is_err()
        );
        // combined: k = 1 of 8 at step 6 of 11, step_linear: (6/7)·0.5 = 3/7; 10·3/7 = 4.29 → 4
        let sched = GradedSchedule::<f64> {
            reveal: RevealRule::Linear,
            step: StepRule::StepLinear,
        };
        assert!((sched.ratio(1, 8, 6, 11).unwrap() - 3.0 / 7.0).abs() < 1e-15);
        assert_eq!(sched.reveal(1, 8, 6, 11, 10), Ok(Reveal::Subset(4)));
        // k = 0 under a step factor < 1 is a subset, not "all"
        assert_eq!(sched.reveal(0, 8, 6, 11, 10), Ok(Reveal::Subset(5)));
        assert_eq!(sched.reveal(0, 8, 1, 11, 10), Ok(Reveal::All));
    }

    #[test]
    fn reveal_count_rounding() {
        assert_eq!(reveal_count(1.0, 7), Ok(Reveal::All));
        assert_eq!(reveal_count(1.5, 7), Ok(Reveal::All));
        assert_eq!(reveal_count(0.0, 7), Ok(Reveal::Subset(0)));
        assert_eq!(reveal_count(0.25, 10), Ok(Reveal::Subset(2))); // 2.5 → 2
        assert_eq!(reveal_count(0.35, 10), Ok(Reveal::Subset(4))); // 3.5 → 4
        assert_eq!(reveal_count(0.1, 3), Ok(Reveal::Subset(0))); // 0.3 → 0, no forced 1
        assert_eq!(reveal_count(-0.5, 3), Ok(Reveal::Subset(0)));
        assert_eq!(reveal_count(0.5, 0), Ok(Reveal::Subset(0)));
        assert_eq!(
            reveal_count(f64::NAN, 3),
            Err(Error::NonFinite {
                what: "ratio",
                index: 0
            })
        );
        assert_eq!(Reveal::Subset(9).count(3), 3);
    }

    #[test]
    fn uniform_below_rejects_the_biased_zone() {
        // 2^64 mod 3 = 1: the draw 0 is rejected, then 5 % 3 = 2
        let mut draws = [0u64, 5].into_iter();
        assert_eq!(uniform_below(3, &mut || draws.next().unwrap_or(0)), 2);
        // a constant broken generator terminates
        assert_eq!(uniform_below(3, &mut || 0), 0);
        assert_eq!(uniform_below(0, &mut || 7), 0);
        assert_eq!(uniform_below(1, &mut || u64::MAX), 0);
    }

    #[test]
    fn sampling_is_uniform_over_ordered_picks() {
        // 2 of 3 in order: 6 outcomes, 6000 draws → ≈1000 each
        let mut rng = splitmix(42);
        let mut hist = [0usize; 9];
        let mut shown = [0usize; 3];
        for _ in 0..6000 {
            assert_eq!(sample_criteria(2, 3, &mut rng, &mut shown), Ok(2));
            hist[shown[0] * 3 + shown[1]] += 1;
        }
        for (cell, &h) in hist.iter().enumerate() {
            if cell / 3 == cell % 3 {
                assert_eq!(h, 0);
            } else {
                assert!((850..1150).contains(&h), "cell {cell}: {h}");
            }
        }
    }

    #[test]
    fn select_all_keeps_order_and_errors() {
        let mut shown = [9usize; 5];
        let mut no_rng = || -> u64 { panic!("the generator must not be called") };
        assert_eq!(
            select_criteria(Reveal::All, 4, &mut no_rng, &mut shown),
            Ok(4)
        );
        assert_eq!(&shown[..4], &[0, 1, 2, 3]);
        assert_eq!(
            select_criteria(Reveal::Subset(0), 4, &mut no_rng, &mut shown),
            Ok(0)
        );
        let mut rng = splitmix(1);
        assert_eq!(
            select_criteria(Reveal::All, 6, &mut rng, &mut shown),
            Err(Error::ScratchTooSmall {
                what: "shown",
                needed: 6,
                actual: 5
            })
        );
        assert!(matches!(
            sample_criteria(5, 4, &mut rng, &mut shown),
            Err(Error::OutOfRange {
                what: "count (criteria shown)",
                ..
            })
        ));
    }

    const CRITERIA: [(&str, f64); 5] = [
        ("Identifies the symptoms", 8.0),
        ("Suggests a prescription drug", -2.0),
        ("Mentions the weather", 0.0),
        ("Gives self-care advice", 2.5),
        ("Recommends surgery", -10.0),
    ];

    #[test]
    fn message_layout() {
        let mut s = String::new();
        let wrote = write_rubric_message(
            &CRITERIA,
            &[3, 1, 2, 0, 4],
            &RubricPrompt::default(),
            &mut s,
        )
        .unwrap();
        assert!(wrote);
        let want = std::format!(
            "{DEFAULT_INTRO}\n\n\
             {DEFAULT_INCLUDE_HEADER}\n\
             Criterion 1: Gives self-care advice (worth 2.5 points)\n\
             Criterion 2: Identifies the symptoms (worth 8 points)\n\n\
             {DEFAULT_AVOID_HEADER}\n\
             Criterion 1: Suggests a prescription drug (penalty: 2 points)\n\
             Criterion 2: Recommends surgery (penalty: 10 points)\n\n\
             {DEFAULT_CLOSING}\n\n\
             {DEFAULT_HIDE_INSTRUCTION}"
        );
        assert_eq!(s, want);
        // only negatives, no hide instruction
        let mut s = String::new();
        let p = RubricPrompt {
            hide_instruction: None,
            ..RubricPrompt::default()
        };
        assert_eq!(write_rubric_message(&CRITERIA, &[1], &p, &mut s), Ok(true));
        assert_eq!(
            s,
            std::format!(
                "{DEFAULT_INTRO}\n\n{DEFAULT_AVOID_HEADER}\n\
                 Criterion 1: Suggests a prescription drug (penalty: 2 points)\n\n{DEFAULT_CLOSING}\n\n"
            )
        );
        // f32 points print in f32's shortest form
        let mut s = String::new();
        write_rubric_message(&[("x", 0.1f32)], &[0], &p, &mut s).unwrap();
        assert!(s.contains("Criterion 1: x (worth 0.1 points)"), "{s}");
    }

    #[test]
    fn no_criterion_shown() {
        let mut s = String::new();
        assert_eq!(
            write_rubric_message(&CRITERIA, &[], &RubricPrompt::default(), &mut s),
            Ok(false)
        );
        // only a zero-point criterion: nothing printed either
        assert_eq!(
            write_rubric_message(&CRITERIA, &[2], &RubricPrompt::default(), &mut s),
            Ok(false)
        );
        assert!(s.is_empty());
        let p = RubricPrompt {
            add_base_when_zero: true,
            ..RubricPrompt::default()
        };
        assert_eq!(write_rubric_message(&CRITERIA, &[], &p, &mut s), Ok(true));
        assert_eq!(s, DEFAULT_BASE);
    }

    #[test]
    fn message_errors() {
        let mut s = String::new();
        let p = RubricPrompt::default();
        assert_eq!(
            write_rubric_message(&CRITERIA, &[0, 5], &p, &mut s),
            Err(Error::InvalidIndex {
                what: "shown",
                position: 1,
                value: 5,
                len: 5
            })
        );
        assert_eq!(
            write_rubric_message(&CRITERIA, &[0, 3, 0], &p, &mut s),
            Err(Error::InvalidIndex {
                what: "shown",
                position: 2,
                value: 0,
                len: 5
            })
        );
        assert_eq!(
            write_rubric_message(&[("a", 1.0), ("b", f64::NAN)], &[1], &p, &mut s),
            Err(Error::NonFinite {
                what: "criteria points",
                index: 1
            })
        );
        assert!(s.is_empty());
        struct Full;
        impl Write for Full {
            fn write_str(&mut self, _: &str) -> core::fmt::Result {
                Err(core::fmt::Error)
            }
        }
        assert_eq!(
            write_rubric_message(&CRITERIA, &[0], &p, &mut Full),
            Err(Error::Format)
        );
    }

    #[test]
    fn rubric_scores() {
        // (8 − 2)/(8 + 6) = 0.4285714
        let s = rubric_score(&[8.0, 6.0, -2.0], &[true, false, true]).unwrap();
        assert!((s - 6.0 / 14.0).abs() < 1e-15);
        assert_eq!(rubric_score(&[8.0f32, 6.0], &[true, true]), Ok(1.0));
        assert_eq!(rubric_score(&[8.0, -6.0], &[false, true]), Ok(-0.75));
        assert!(matches!(
            rubric_score(&[0.0, -1.0], &[true, true]),
            Err(Error::OutOfRange {
                what: "total positive points",
                ..
            })
        ));
        assert!(matches!(
            rubric_score::<f64>(&[], &[]),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            rubric_score(&[1.0], &[true, false]),
            Err(Error::LengthMismatch { what: "met", .. })
        ));
        assert_eq!(
            rubric_score(&[1.0, f64::INFINITY], &[true, false]),
            Err(Error::NonFinite {
                what: "points",
                index: 1
            })
        );
    }

    fn step_rule() -> impl Strategy<Value = StepRule<f64>> {
        prop_oneof![
            Just(StepRule::Constant),
            Just(StepRule::StepLinear),
            (0.0f64..4.0).prop_map(|power| StepRule::StepPower { power }),
            (0.0f64..1.0, 0.0f64..50.0).prop_map(|(start_point, steepness)| {
                StepRule::StepSigmoid {
                    start_point,
                    steepness,
                }
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Ratios and counts are non-increasing in k and within [0, 1] / [0, N].
        #[test]
        fn non_increasing_in_k(
            n in 2usize..17,
            full in 0usize..5,
            binary in any::<bool>(),
            step_rule in step_rule(),
            step in 0u64..120,
            total_steps in 0u64..100,
            criteria in 0usize..40,
        ) {
            let reveal = if binary { RevealRule::Binary { full_reveal_count: full } } else { RevealRule::Linear };
            let sched = GradedSchedule { reveal, step: step_rule };
            let mut prev = (f64::INFINITY, usize::MAX);
            for k in 0..n {
                let r = sched.ratio(k, n, step, total_steps).unwrap();
                let c = sched.reveal(k, n, step, total_steps, criteria).unwrap().count(criteria);
                prop_assert!((0.0..=1.0).contains(&r));
                prop_assert!(c <= criteria);
                prop_assert!(r <= prev.0 && c <= prev.1, "k={k}: {r} {c} after {prev:?}");
                prev = (r, c);
            }
        }

        /// The exact linear count is N·(n−1−k)/(n−1) rounded half to even.
        #[test]
        fn exact_linear_count(n in 2usize..50, k_frac in 0.0f64..1.0, criteria in 0usize..200) {
            let k = ((n as f64 * k_frac) as usize).min(n - 1);
            let c = linear_reveal_count(k, n, criteria).unwrap().count(criteria);
            let (num, den) = (criteria * (n - 1 - k), n - 1);
            let dist2 = (2 * c * den).abs_diff(2 * num); // 2·|c − num/den|·den
            prop_assert!(dist2 <= den);
            if dist2 == den {
                prop_assert!(c % 2 == 0);
            }
        }

        /// A subset is `count` distinct indices below `total`.
        #[test]
        fn subset_is_distinct(seed in any::<u64>(), total in 0usize..30, frac in 0.0f64..=1.0) {
            let count = ((total as f64) * frac) as usize;
            let mut shown = vec![usize::MAX; total + 2];
            let mut rng = splitmix(seed);
            let got = sample_criteria(count, total, &mut rng, &mut shown).unwrap();
            prop_assert_eq!(got, count);
            let mut picked = shown[..count].to_vec();
            prop_assert!(picked.iter().all(|&i| i < total));
            picked.sort_unstable();
            picked.dedup();
            prop_assert_eq!(picked.len(), count);
            let mut all = shown[..total].to_vec();
            all.sort_unstable();
            prop_assert_eq!(all, (0..total).collect::<Vec<_>>());
        }
    }
}
