//! The ARES difficulty-aware entropy reward (docs/algorithms.md §3).
//!
//! Per response, from its correctness, its HWE count `g`, its prompt's bucket `d` and the
//! bucket's target `T = T_d` and coefficient `α = α_d`, with the bucket's constants
//! (margin fraction `f`, Huber `κ`, sigmoid temperature `t`, cap scale `c`, wrong-answer
//! factor `w`):
//!
//! `m = max(1, f·max(T, 1))`, `Δ = g − T`, `cap = α·c`, `D = m + κ`, and
//!
//! | d | correct | wrong |
//! |---|---|---|
//! | easy | `S = −min(cap, huber(Δ − m, κ)/D·cap)` | `S = sig(max(Δ − m, 0), t)·cap·w` |
//! | medium | `S = −min(cap, huber(\|Δ\| − m, κ)/D·cap)` | `S = sig(max(Δ − m, 0), t)·cap·w` |
//! | hard | `Δ ≥ −m`: `S = sig(Δ + m, t)·cap`; else `S = −min(cap, ½·huber(−Δ − m, κ)/D·cap)` | `S = sig(max(Δ − m, 0), t)·cap·w` |
//!
//! Easy prompts answered correctly lose reward for reasoning past the margin; medium ones
//! for straying from the target either way; hard ones gain reward for exploring up to and
//! past the target; wrong answers get a small exploration reward. `S ∈ [−cap, cap]`.
//! The overall reward is `accuracy + S (+ format_weight·format)`.

use crate::difficulty::{Difficulty, PerBucket};
use crate::error::Result;
use crate::num::{cast, check_param};
use num_traits::Float;

/// Smallest sigmoid temperature: `sig(x, t)` divides by `max(t, 1e-6)`.
pub const MIN_SIGMOID_TEMPERATURE: f64 = 1e-6;

/// Huber without validation; `x` may be ±∞ (`-∞ → 0`, `+∞ → +∞`), `kappa > 0`.
#[inline]
fn huber_raw<F: Float>(x: F, kappa: F) -> F {
    let x = x.max(F::zero());
    if x <= kappa {
        // x·(x/κ)/2 rather than x²/(2κ): no overflow, and exactly κ/2 at x = κ
        x * (x / kappa) * cast(0.5)
    } else {
        x - kappa * cast(0.5)
    }
}

/// Sigmoid without validation; `x` may be ±∞, `temperature` any non-NaN value.
#[inline]
fn sigmoid_raw<F: Float>(x: F, temperature: F) -> F {
    let z = x / temperature.max(cast(MIN_SIGMOID_TEMPERATURE));
    // exp of a non-positive number only: never overflows
    if z >= F::zero() {
        F::one() / (F::one() + (-z).exp())
    } else {
        let e = z.exp();
        e / (F::one() + e)
    }
}

/// The Huber penalty on the positive part: with `x⁺ = max(x, 0)`,
/// `huber(x, κ) = x⁺²/(2κ)` if `x⁺ ≤ κ`, else `x⁺ − κ/2`.
///
/// Quadratic near 0, linear far away (slope ≤ 1), continuous and non-decreasing;
/// `huber(x, κ) = 0` for `x ≤ 0`. Computed as `x⁺·(x⁺/κ)/2`, which cannot overflow.
///
/// Errors: `x` not finite, or `kappa` not finite and `> 0` ([`crate::Error::OutOfRange`]).
pub fn huber<F: Float>(x: F, kappa: F) -> Result<F> {
    check_param("x", x, true, "finite")?;
    check_param("kappa", kappa, kappa > F::zero(), "finite and > 0")?;
    Ok(huber_raw(x, kappa))
}

/// The saturating sigmoid `sig(x, t) = 1/(1 + exp(−x/max(t, 1e−6)))`, in the stable form
/// (`e^{z}/(1 + e^{z})` for negative `z`), so it never overflows: the result is in
/// `[0, 1]` for every finite input, `sig(0, t) = 1/2`.
///
/// Errors: `x` or `temperature` not finite ([`crate::Error::OutOfRange`]). A temperature
/// `≤ 1e-6` (zero or negative included) is used as `1e-6`, as in the spec.
pub fn sigmoid<F: Float>(x: F, temperature: F) -> Result<F> {
    check_param("x", x, true, "finite")?;
    check_param("temperature", temperature, true, "finite")?;
    Ok(sigmoid_raw(x, temperature))
}

/// The tolerance band `m = max(1, f·max(T, 1))` around a target `T` with margin fraction
/// `f`: at least one token, else the fraction `f` of the target.
///
/// Errors: `fraction` or `target` not finite, or negative ([`crate::Error::OutOfRange`]).
pub fn margin<F: Float>(fraction: F, target: F) -> Result<F> {
    check_param("margin_fraction", fraction, fraction >= F::zero(), ">= 0")?;
    check_param("target", target, target >= F::zero(), "finite and >= 0")?;
    Ok(margin_raw(fraction, target))
}

#[inline]
fn margin_raw<F: Float>(fraction: F, target: F) -> F {
    (fraction * target.max(F::one())).max(F::one())
}

/// The shaping constants of one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketShaping<F> {
    /// Margin fraction `f` in `[0, 1]`: `m = max(1, f·max(T, 1))`.
    pub margin_fraction: F,
    /// Huber `κ` > 0: where the penalty turns from quadratic to linear.
    pub huber_kappa: F,
    /// Sigmoid temperature `t` > 0.
    pub sigmoid_temperature: F,
    /// Cap scale `c` ≥ 0: `cap = α·c`.
    pub cap_scale: F,
    /// Wrong-answer factor `w` in `[0, 1]`: the exploration reward of a wrong answer is at
    /// most `cap·w` (so `S` stays within `[−cap, cap]`).
    pub wrong_factor: F,
}

impl<F: Float> BucketShaping<F> {
    /// `(f, κ, t, c, w)`.
    pub fn new(
        margin_fraction: F,
        huber_kappa: F,
        sigmoid_temperature: F,
        cap_scale: F,
        wrong_factor: F,
    ) -> Self {
        BucketShaping {
            margin_fraction,
            huber_kappa,
            sigmoid_temperature,
            cap_scale,
            wrong_factor,
        }
    }

    /// Checks the fields; `names` are the field names as reported in errors.
    fn validate_named(&self, names: &[&'static str; 5]) -> Result<()> {
        let [f, kappa, t, c, w] = *names;
        let (zero, one) = (F::zero(), F::one());
        let x = self.margin_fraction;
        check_param(f, x, x >= zero && x <= one, "in [0, 1]")?;
        let x = self.huber_kappa;
        check_param(kappa, x, x > zero, "finite and > 0")?;
        let x = self.sigmoid_temperature;
        check_param(t, x, x > zero, "finite and > 0")?;
        let x = self.cap_scale;
        check_param(c, x, x >= zero, "finite and >= 0")?;
        let x = self.wrong_factor;
        check_param(w, x, x >= zero && x <= one, "in [0, 1]")
    }
}

/// Field names of each bucket's constants, for error messages.
const FIELD_NAMES: PerBucket<[&str; 5]> = PerBucket::new(
    [
        "shaping.easy.margin_fraction",
        "shaping.easy.huber_kappa",
        "shaping.easy.sigmoid_temperature",
        "shaping.easy.cap_scale",
        "shaping.easy.wrong_factor",
    ],
    [
        "shaping.medium.margin_fraction",
        "shaping.medium.huber_kappa",
        "shaping.medium.sigmoid_temperature",
        "shaping.medium.cap_scale",
        "shaping.medium.wrong_factor",
    ],
    [
        "shaping.hard.margin_fraction",
        "shaping.hard.huber_kappa",
        "shaping.hard.sigmoid_temperature",
        "shaping.hard.cap_scale",
        "shaping.hard.wrong_factor",
    ],
);

/// The shaping configuration: per-bucket constants and the format-reward weight.
///
/// Defaults (docs/algorithms.md §3):
///
/// | d | f | κ | t | c | w |
/// |---|---|---|---|---|---|
/// | easy | 0.15 | 2.0 | 2.0 | 1.0 | 0.6 |
/// | medium | 0.25 | 3.0 | 2.5 | 1.0 | 0.8 |
/// | hard | 0.35 | 4.0 | 3.0 | 1.2 | 1.0 |
///
/// and `format_weight = 0` (the format reward is reported but not added).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapingConfig<F> {
    /// Constants of each bucket.
    pub buckets: PerBucket<BucketShaping<F>>,
    /// Weight of the format reward in the overall reward (default 0).
    pub format_weight: F,
}

impl<F: Float> Default for ShapingConfig<F> {
    fn default() -> Self {
        let b = |f: f64, k: f64, t: f64, c: f64, w: f64| {
            BucketShaping::new(cast(f), cast(k), cast(t), cast(c), cast(w))
        };
        ShapingConfig {
            buckets: PerBucket::new(
                b(0.15, 2.0, 2.0, 1.0, 0.6),
                b(0.25, 3.0, 2.5, 1.0, 0.8),
                b(0.35, 4.0, 3.0, 1.2, 1.0),
            ),
            format_weight: F::zero(),
        }
    }
}

impl<F: Float> ShapingConfig<F> {
    /// Checks every field; the error names the first bad one, e.g.
    /// `"shaping.hard.huber_kappa"` ([`crate::Error::OutOfRange`]).
    pub fn validate(&self) -> Result<()> {
        for d in Difficulty::ALL {
            self.buckets[d].validate_named(&FIELD_NAMES[d])?;
        }
        check_param("format_weight", self.format_weight, true, "finite")
    }
}

/// The entropy reward `S` of one response (the table in the module docs).
///
/// - `difficulty`: the prompt's bucket `d`; `correct`: whether the answer is right;
/// - `hwe_count`: `g`, the response's number of HWE tokens (≥ 0);
/// - `target`: `T = T_d` (≥ 0); `alpha`: `α = α_d` (≥ 0).
///
/// `S ∈ [−α·c, α·c]`; `S = 0` when `α = 0`.
///
/// Errors: `hwe_count`, `target` or `alpha` not finite or negative, the bucket's constants
/// invalid (see [`ShapingConfig::validate`]), or `α·c` overflowing
/// ([`crate::Error::OutOfRange`]).
pub fn entropy_reward<F: Float>(
    difficulty: Difficulty,
    correct: bool,
    hwe_count: F,
    target: F,
    alpha: F,
    config: &ShapingConfig<F>,
) -> Result<F> {
    let zero = F::zero();
    check_param("hwe_count", hwe_count, hwe_count >= zero, "finite and >= 0")?;
    check_param("target", target, target >= zero, "finite and >= 0")?;
    check_param("alpha", alpha, alpha >= zero, "finite and >= 0")?;
    let p = &config.buckets[difficulty];
    p.validate_named(&FIELD_NAMES[difficulty])?;

    let kappa = p.huber_kappa;
    let m = margin_raw(p.margin_fraction, target);
    let delta = hwe_count - target;
    let cap = alpha * p.cap_scale;
    check_param("alpha * cap_scale (cap)", cap, true, "finite")?;
    // D may overflow to +∞ for huge m and κ: the penalty ratio then rounds to 0
    let d = m + kappa;
    let half = cast::<F>(0.5);
    // −min(cap, scale·huber(x, κ)/D·cap)
    let penalty = |x: F, scale: F| -> F { -(scale * huber_raw(x, kappa) / d * cap).min(cap) };

    if !correct {
        let excess = (delta - m).max(zero);
        return Ok(sigmoid_raw(excess, p.sigmoid_temperature) * cap * p.wrong_factor);
    }
    Ok(match difficulty {
        Difficulty::Easy => penalty(delta - m, F::one()),
        Difficulty::Medium => penalty(delta.abs() - m, F::one()),
        Difficulty::Hard => {
            if delta >= -m {
                sigmoid_raw(delta + m, p.sigmoid_temperature) * cap
            } else {
                penalty(-delta - m, half)
            }
        }
    })
}

/// The overall reward `base + entropy_reward + format_weight·format_reward`.
///
/// `base` is the task reward the entropy shaping is added to: the accuracy (1 or 0) in ARES
/// (docs/algorithms.md §3), or a graded rubric score, or GRPO-λ's length-penalised reward when those
/// methods replace it.
///
/// Errors: any input not finite, or a non-finite sum ([`crate::Error::OutOfRange`]).
pub fn overall_reward<F: Float>(
    base: F,
    entropy_reward: F,
    format_reward: F,
    format_weight: F,
) -> Result<F> {
    check_param("base reward", base, true, "finite")?;
    check_param("entropy_reward", entropy_reward, true, "finite")?;
    check_param("format_reward", format_reward, true, "finite")?;
    check_param("format_weight", format_weight, true, "finite")?;
    let overall = base + entropy_reward + format_weight * format_reward;
    check_param("overall reward", overall, true, "finite")?;
    Ok(overall)
}

/// The parts of one response's ARES reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapedReward<F> {
    /// 1 if correct, else 0.
    pub accuracy: F,
    /// The entropy reward `S` ([`entropy_reward`]).
    pub entropy: F,
    /// The format reward as given (reported; added with `format_weight`).
    pub format: F,
    /// `accuracy + S + format_weight·format`.
    pub overall: F,
}

/// [`entropy_reward`] and [`overall_reward`] together, with accuracy `1` or `0` from
/// `correct` and the configuration's `format_weight`.
///
/// Example (spec vector 1): easy, correct, `g = 10`, `T = 4`, `α = 0.5`: `m = 1`, `Δ = 6`,
/// `huber(5, 2) = 4`, `D = 3`, `S = −min(0.5, 4/3·0.5) = −0.5`, overall `0.5`.
///
/// Errors: those of both functions.
pub fn shaped_reward<F: Float>(
    difficulty: Difficulty,
    correct: bool,
    hwe_count: F,
    target: F,
    alpha: F,
    format_reward: F,
    config: &ShapingConfig<F>,
) -> Result<ShapedReward<F>> {
    let accuracy = if correct { F::one() } else { F::zero() };
    let entropy = entropy_reward(difficulty, correct, hwe_count, target, alpha, config)?;
    let overall = overall_reward(accuracy, entropy, format_reward, config.format_weight)?;
    Ok(ShapedReward {
        accuracy,
        entropy,
        format: format_reward,
        overall,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use Difficulty::*;
    use proptest::prelude::*;

    fn overall(d: Difficulty, correct: bool, g: f64, t: f64) -> f64 {
        shaped_reward(d, correct, g, t, 0.5, 0.0, &ShapingConfig::default())
            .unwrap()
            .overall
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-6
    }

    #[test]
    fn vector_1_easy_correct() {
        // m = max(1, 0.15·4) = 1, cap = 0.5, D = 1 + 2 = 3
        // g 10: Δ = 6, huber(5, 2) = 5 − 1 = 4, 4/3·0.5 = 0.667 → S = −0.5 → 0.5
        assert!(close(overall(Easy, true, 10.0, 4.0), 0.5));
        // g 6: Δ = 2, huber(1, 2) = 1/4, 0.25/3·0.5 = 0.0416667 → 0.9583333
        assert!(close(overall(Easy, true, 6.0, 4.0), 0.9583333));
        // g 5: Δ − m = 0 → S = 0 → 1.0
        assert!(close(overall(Easy, true, 5.0, 4.0), 1.0));
        // within the margin and below target: no penalty
        assert_eq!(overall(Easy, true, 0.0, 4.0), 1.0);
    }

    #[test]
    fn vector_2_easy_wrong() {
        // g 5: max(Δ − m, 0) = 0 → sig = 1/2 → 0.5·0.5·0.6 = 0.15
        assert!(close(overall(Easy, false, 5.0, 4.0), 0.15));
        // g 9: Δ − m = 4, sig(4, 2) = 1/(1 + e^−2) = 0.8807971 → ·0.3 = 0.2642391
        assert!(close(overall(Easy, false, 9.0, 4.0), 0.2642391));
    }

    #[test]
    fn vector_3_medium() {
        // m = max(1, 0.25·20) = 5, D = 8, cap = 0.5
        // g 27: |Δ| − m = 2, huber(2, 3) = 4/6, /8·0.5 = 0.0416667 → 0.9583333
        assert!(close(overall(Medium, true, 27.0, 20.0), 0.9583333));
        // g 13: |Δ| = 7 on the low side: the same penalty
        assert!(close(overall(Medium, true, 13.0, 20.0), 0.9583333));
        // g 25: |Δ| − m = 0 → 1.0
        assert!(close(overall(Medium, true, 25.0, 20.0), 1.0));
        // wrong, g 0: Δ − m < 0 → sig(0) = 1/2 → 0.5·0.5·0.8 = 0.2
        assert!(close(overall(Medium, false, 0.0, 20.0), 0.2));
    }

    #[test]
    fn vector_4_hard() {
        // m = 0.35·20 = 7, cap = 0.5·1.2 = 0.6; g 20: Δ = 0 ≥ −7 →
        // sig(7, 3) = 1/(1 + e^{−7/3}) = 0.9116003 → S = 0.5469602 → 1.5469602
        assert!(close(overall(Hard, true, 20.0, 20.0), 1.5469602));
        // wrong, g 0, T 0: m = 1, max(−1, 0) = 0 → 0.5·0.6·1.0 = 0.3
        assert!(close(overall(Hard, false, 0.0, 0.0), 0.3));
        // far below target: Δ = −20 < −7 → −min(0.6, ½·huber(13, 4)/11·0.6)
        // = −min(0.6, ½·11/11·0.6) = −0.3 → 0.7
        assert!(close(overall(Hard, true, 0.0, 20.0), 0.7));
    }

    #[test]
    fn f32_vectors() {
        let c = ShapingConfig::<f32>::default();
        let s = shaped_reward(Hard, true, 20.0f32, 20.0, 0.5, 0.0, &c).unwrap();
        assert!((s.overall - 1.5469602).abs() < 1e-6);
        let s = shaped_reward(Easy, false, 9.0f32, 4.0, 0.5, 0.0, &c).unwrap();
        assert!((s.overall - 0.2642391).abs() < 1e-6);
    }

    #[test]
    fn format_weight_and_parts() {
        let mut c = ShapingConfig::<f64>::default();
        let s = shaped_reward(Easy, true, 6.0, 4.0, 0.5, 1.0, &c).unwrap();
        assert_eq!((s.accuracy, s.format), (1.0, 1.0));
        assert!(close(s.entropy, -0.0416667));
        assert!(close(s.overall, 0.9583333));
        c.format_weight = 0.5;
        let s = shaped_reward(Easy, true, 6.0, 4.0, 0.5, 1.0, &c).unwrap();
        assert!(close(s.overall, 1.4583333));
        assert_eq!(overall_reward(1.0, -0.25, 3.0, 0.0), Ok(0.75));
        assert!(overall_reward(f64::MAX, f64::MAX, 0.0, 0.0).is_err());
        assert!(overall_reward(1.0, 0.0, f64::NAN, 0.0).is_err());
    }

    #[test]
    fn helpers() {
        assert_eq!(huber(-3.0, 2.0), Ok(0.0));
        assert_eq!(huber(1.0, 2.0), Ok(0.25));
        assert_eq!(huber(2.0, 2.0), Ok(1.0));
        assert_eq!(huber(5.0, 2.0), Ok(4.0));
        assert_eq!(huber(f64::MAX, f64::MAX), Ok(f64::MAX / 2.0));
        assert_eq!(sigmoid(0.0, 2.0), Ok(0.5));
        assert_eq!(sigmoid(1e300, 1e-300), Ok(1.0));
        assert_eq!(sigmoid(-1e300, 0.0), Ok(0.0));
        assert_eq!(sigmoid(-800.0f64, 1.0), Ok(0.0));
        assert!(close(sigmoid(4.0, 2.0).unwrap(), 0.8807971));
        // t ≤ 1e-6 acts as 1e-6: sig(1e-6, 0) = sig(1, 1)
        assert!(close(sigmoid(1e-6, -5.0).unwrap(), 0.7310586));
        assert_eq!(margin(0.15, 4.0), Ok(1.0));
        assert_eq!(margin(0.25, 20.0), Ok(5.0));
        assert_eq!(margin(0.35, 0.0), Ok(1.0));
        assert!(matches!(
            huber(1.0, 0.0),
            Err(Error::OutOfRange { what: "kappa", .. })
        ));
        assert!(matches!(
            huber(f64::NAN, 1.0),
            Err(Error::OutOfRange { what: "x", .. })
        ));
        assert!(matches!(
            sigmoid(1.0, f64::NAN),
            Err(Error::OutOfRange {
                what: "temperature",
                ..
            })
        ));
        assert!(matches!(margin(-0.1, 1.0), Err(Error::OutOfRange { .. })));
        assert!(matches!(
            margin(0.1, -1.0),
            Err(Error::OutOfRange { what: "target", .. })
        ));
    }

    #[test]
    fn errors() {
        let c = ShapingConfig::<f64>::default();
        for (what, g, t, a) in [
            ("hwe_count", -1.0, 4.0, 0.5),
            ("hwe_count", f64::NAN, 4.0, 0.5),
            ("target", 1.0, f64::INFINITY, 0.5),
            ("alpha", 1.0, 4.0, -0.5),
        ] {
            match entropy_reward(Easy, true, g, t, a, &c) {
                Err(Error::OutOfRange { what: w, .. }) => assert_eq!(w, what),
                other => panic!("{what}: {other:?}"),
            }
        }
        let mut bad = c;
        bad.buckets.hard.huber_kappa = 0.0;
        assert!(entropy_reward(Easy, true, 1.0, 4.0, 0.5, &bad).is_ok());
        match entropy_reward(Hard, true, 1.0, 4.0, 0.5, &bad) {
            Err(Error::OutOfRange { what, .. }) => assert_eq!(what, "shaping.hard.huber_kappa"),
            other => panic!("{other:?}"),
        }
        let mut bad = c;
        bad.buckets.medium.wrong_factor = 1.5;
        match bad.validate() {
            Err(Error::OutOfRange { what, .. }) => assert_eq!(what, "shaping.medium.wrong_factor"),
            other => panic!("{other:?}"),
        }
        bad.buckets.medium.wrong_factor = 1.0;
        bad.format_weight = f64::NAN;
        assert!(matches!(
            bad.validate(),
            Err(Error::OutOfRange {
                what: "format_weight",
                ..
            })
        ));
        assert!(c.validate().is_ok());
        // α·c overflows
        let mut big = c;
        big.buckets.easy.cap_scale = f64::MAX;
        assert!(matches!(
            entropy_reward(Easy, true, 1.0, 4.0, 2.0, &big),
            Err(Error::OutOfRange {
                what: "alpha * cap_scale (cap)",
                ..
            })
        ));
    }

    #[test]
    fn extremes_stay_finite() {
        let mut c = ShapingConfig::<f64>::default();
        for d in Difficulty::ALL {
            c.buckets[d].margin_fraction = 1.0;
            c.buckets[d].huber_kappa = f64::MAX;
        }
        for d in Difficulty::ALL {
            for correct in [true, false] {
                for (g, t) in [(f64::MAX, 0.0), (0.0, f64::MAX), (f64::MAX, f64::MAX)] {
                    let s = entropy_reward(d, correct, g, t, 2.0, &c).unwrap();
                    assert!(
                        s.is_finite() && s.abs() <= 2.0 * 1.2,
                        "{d} {correct} {g} {t}: {s}"
                    );
                }
            }
        }
    }

    proptest! {
        #[test]
        fn reward_within_cap(
            d in 0usize..3, correct in any::<bool>(), g in 0.0f64..1e4, t in 0.0f64..1e4,
            alpha in 0.0f64..2.0,
        ) {
            let d = Difficulty::from_index(d).unwrap();
            let c = ShapingConfig::<f64>::default();
            let cap = alpha * c.buckets[d].cap_scale;
            let s = entropy_reward(d, correct, g, t, alpha, &c).unwrap();
            prop_assert!(-cap <= s && s <= cap, "S = {} cap = {}", s, cap);
            let s32 = entropy_reward(d, correct, g as f32, t as f32, alpha as f32,
                &ShapingConfig::<f32>::default()).unwrap();
            let cap32 = alpha as f32 * c.buckets[d].cap_scale as f32;
            prop_assert!(-cap32 <= s32 && s32 <= cap32);
            // wrong answers are never penalised; correct easy/medium never rewarded
            if !correct { prop_assert!(s >= 0.0); }
            if correct && d != Hard { prop_assert!(s <= 0.0); }
        }

        #[test]
        fn huber_monotone_and_continuous(
            x in -1e3f64..1e3, dx in 0.0f64..10.0, kappa in 1e-3f64..100.0,
        ) {
            let a = huber(x, kappa).unwrap();
            let b = huber(x + dx, kappa).unwrap();
            prop_assert!(a <= b, "huber({}) = {} > huber({}) = {}", x, a, x + dx, b);
            // 1-Lipschitz: continuous, no jump at κ
            prop_assert!(b - a <= dx * (1.0 + 1e-12) + 1e-12);
            prop_assert!(a >= 0.0);
            // both branches meet at κ
            let below = huber(kappa * (1.0 - 1e-12), kappa).unwrap();
            let above = huber(kappa * (1.0 + 1e-12), kappa).unwrap();
            prop_assert!((above - below).abs() <= 1e-9 * (1.0 + kappa));
            let h32a = huber(x as f32, kappa as f32).unwrap();
            let h32b = huber((x + dx) as f32, kappa as f32).unwrap();
            prop_assert!(h32a <= h32b);
        }

        #[test]
        fn sigmoid_bounded_monotone(x in -1e4f64..1e4, dx in 0.0f64..10.0, t in -1.0f64..10.0) {
            let a = sigmoid(x, t).unwrap();
            let b = sigmoid(x + dx, t).unwrap();
            prop_assert!((0.0..=1.0).contains(&a) && a <= b);
            prop_assert!((sigmoid(-x, t).unwrap() - (1.0 - a)).abs() < 1e-15);
        }

        #[test]
        fn easy_penalty_grows_with_hwe(g in 0.0f64..200.0, dg in 0.0f64..50.0, t in 0.0f64..100.0) {
            let c = ShapingConfig::<f64>::default();
            let a = entropy_reward(Easy, true, g, t, 0.5, &c).unwrap();
            let b = entropy_reward(Easy, true, g + dg, t, 0.5, &c).unwrap();
            prop_assert!(b <= a);
            let ha = entropy_reward(Hard, false, g, t, 0.5, &c).unwrap();
            let hb = entropy_reward(Hard, false, g + dg, t, 0.5, &c).unwrap();
            prop_assert!(ha <= hb);
        }
    }
}
