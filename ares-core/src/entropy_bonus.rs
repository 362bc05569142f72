//! The entropy bonus and its target-entropy controller (docs/algorithms.md §16.2).
//!
//! The bonus adds `−c·agg(H_t)` to the minimised loss (verl's `entropy_coeff`, with `agg` the
//! loss aggregation of docs/algorithms.md §6 over the response mask), so a descent step raises
//! the mean token entropy. Its per-token gradient through the logits is
//! [`entropy_grad_logits`]: for one token, `∂(−c·w_t·H_t)/∂x_{t,v} = −c·w_t·∂H_t/∂x_{t,v}`,
//! with `w_t` the token's aggregation weight ([`crate::loss::aggregate_weights`]).
//!
//! [`EntropyCoefController`] adapts `c` to hold the mean token entropy at a target, the
//! "adaptive entropy coefficient" asked for in verl (PR #1234) and TRL (PRs #3628, #6140),
//! after Soft Actor-Critic's automatic temperature (Haarnoja et al. 2018, "Soft Actor-Critic
//! Algorithms and Applications", arXiv 1812.05905, §5) and Skywork-OR1's adaptive entropy
//! control (He et al. 2025, arXiv 2505.22312, §3.2.5).

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param};
use num_traits::Float;

/// Default target mean token entropy (0.2 nats, Skywork-OR1's `tgt-ent`).
pub const DEFAULT_TARGET_ENTROPY: f64 = 0.2;
/// Default controller step `lr` (coefficient per nat of entropy error per update).
pub const DEFAULT_ENTROPY_COEFF_LR: f64 = 1e-3;
/// Default upper bound of the coefficient (5e−3, Skywork-OR1's `max_ent_coef`).
pub const DEFAULT_ENTROPY_COEFF_MAX: f64 = 5e-3;

/// A controller of the entropy-bonus coefficient `c` that holds the batch's mean token
/// entropy `H̄` at `target`: once per optimizer step,
///
/// `c ← clamp(c + lr·(target − H̄), min, max)`.
///
/// Entropy below the target raises the bonus, entropy above lowers it, down to `min`
/// (default 0: no bonus at all while entropy is high enough). Each update moves `c` by at
/// most `lr·|target − H̄|`; `lr = 0` freezes it (a fixed bonus).
///
/// **Why additive (linear) and not in log space.** The update is projected dual ascent on
/// the Lagrange multiplier of the constraint `H̄ ≥ target`, SAC's derivation (§5); SAC runs
/// it on `log α` only to keep α > 0. For an LLM's entropy bonus the additive form is the
/// better fit: (1) the coefficient must be able to reach exactly 0 and leave it again: the
/// bonus should switch off while entropy is above target (Skywork-OR1 clamps to `[0, max]`
/// for the same reason), and a log-space step `log c ← log c + lr·(target − H̄)` can neither
/// reach 0 nor move away from a tiny `c` quickly, since its steps are proportional to `c`;
/// (2) `lr` has a direct meaning, coefficient change per nat of error per step, and the
/// clamp bounds every step, so a burst of low entropy cannot blow `c` up geometrically.
/// Skywork-OR1 (and the verl / TRL requests) use the sign of the error with a fixed step Δ,
/// `c ← clamp(c ± Δ, min, max)`, and apply the bonus only while `H̄ < target`; the rule here
/// is the proportional version of the same integral controller, which moves less when the
/// entropy is already close to the target.
///
/// Fields are public, configuration-like; [`EntropyCoefController::validate`] checks them
/// and [`EntropyCoefController::update`] validates first. The only state that changes is
/// `coef`: [`EntropyCoefController::snapshot`] / [`EntropyCoefController::restore`] save and
/// resume it exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntropyCoefController<F> {
    /// The current coefficient `c` (`entropy_coeff`), in `[min, max]`.
    pub coef: F,
    /// The target mean token entropy in nats (`target_entropy`), ≥ 0.
    pub target: F,
    /// The step size (`entropy_coeff_lr`), ≥ 0.
    pub lr: F,
    /// Lower bound of `c` (`entropy_coeff_min`), ≥ 0.
    pub min: F,
    /// Upper bound of `c` (`entropy_coeff_max`), ≥ `min`.
    pub max: F,
}

/// The controller's state for a checkpoint: plain data, restored exactly by
/// [`EntropyCoefController::restore`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntropyCoefState<F> {
    /// The coefficient after the last update.
    pub coef: F,
}

impl<F: Float> Default for EntropyCoefController<F> {
    /// `coef` 0, `target` 0.2, `lr` 1e−3, `min` 0, `max` 5e−3: starting points from
    /// Skywork-OR1's settings, not tuned values.
    fn default() -> Self {
        EntropyCoefController {
            coef: F::zero(),
            target: cast(DEFAULT_TARGET_ENTROPY),
            lr: cast(DEFAULT_ENTROPY_COEFF_LR),
            min: F::zero(),
            max: cast(DEFAULT_ENTROPY_COEFF_MAX),
        }
    }
}

impl<F: Float> EntropyCoefController<F> {
    /// A validated controller starting at `coef`.
    ///
    /// Errors: as [`EntropyCoefController::validate`].
    pub fn new(coef: F, target: F, lr: F, min: F, max: F) -> Result<Self> {
        let c = EntropyCoefController {
            coef,
            target,
            lr,
            min,
            max,
        };
        c.validate()?;
        Ok(c)
    }

    /// Errors ([`Error::OutOfRange`] naming the key) unless every field is finite and
    /// `target ≥ 0` (`"target_entropy"`), `lr ≥ 0` (`"entropy_coeff_lr"`), `min ≥ 0`
    /// (`"entropy_coeff_min"`), `max ≥ min` (`"entropy_coeff_max"`) and
    /// `min ≤ coef ≤ max` (`"entropy_coeff"`), checked in that order.
    pub fn validate(&self) -> Result<()> {
        check_param(
            "target_entropy",
            self.target,
            self.target >= F::zero(),
            ">= 0",
        )?;
        check_param("entropy_coeff_lr", self.lr, self.lr >= F::zero(), ">= 0")?;
        check_param("entropy_coeff_min", self.min, self.min >= F::zero(), ">= 0")?;
        check_param(
            "entropy_coeff_max",
            self.max,
            self.max >= self.min,
            ">= entropy_coeff_min",
        )?;
        check_param(
            "entropy_coeff",
            self.coef,
            self.coef >= self.min && self.coef <= self.max,
            "in [entropy_coeff_min, entropy_coeff_max]",
        )
    }

    /// Folds one step's mean token entropy `H̄` (nats, over the step's response tokens) in:
    /// `c ← clamp(c + lr·(target − H̄), min, max)`; returns the new `c`, the coefficient of
    /// the *next* step's bonus.
    ///
    /// A step whose `lr·(target − H̄)` overflows clamps to the bound it overflowed toward.
    ///
    /// Errors (`coef` unchanged): invalid fields (as [`EntropyCoefController::validate`]);
    /// `mean_entropy` not finite and ≥ 0 ([`Error::OutOfRange`] on `"mean_entropy"`).
    pub fn update(&mut self, mean_entropy: F) -> Result<F> {
        self.validate()?;
        check_param(
            "mean_entropy",
            mean_entropy,
            mean_entropy >= F::zero(),
            "finite and >= 0",
        )?;
        let step = self.lr * (self.target - mean_entropy);
        let next = self.coef + step; // finite or ±∞, never NaN (every term is finite)
        self.coef = next.max(self.min).min(self.max);
        Ok(self.coef)
    }

    /// The state to save in a checkpoint.
    #[inline]
    pub fn snapshot(&self) -> EntropyCoefState<F> {
        EntropyCoefState { coef: self.coef }
    }

    /// Resumes from a checkpoint's state (the bounds, target and step come from the
    /// configuration; the coefficient from the checkpoint).
    ///
    /// Errors (nothing changed): a state coefficient that is not finite or lies outside
    /// `[min, max]` ([`Error::OutOfRange`] on `"entropy_coeff"`), or invalid fields.
    pub fn restore(&mut self, state: EntropyCoefState<F>) -> Result<()> {
        let resumed = EntropyCoefController {
            coef: state.coef,
            ..*self
        };
        resumed.validate()?;
        *self = resumed;
        Ok(())
    }
}

/// The entropy `H` of `p = softmax(logits / T)` and its gradient with respect to the logits:
/// `out[v] = ∂H/∂x_v = −p_v·(ln p_v + H)/T`; returns `H`.
///
/// Derivation: with `z = x/T`, `∂p_i/∂z_v = p_i(δ_iv − p_v)` and `∂H/∂p_i = −(ln p_i + 1)`, so
/// `∂H/∂z_v = −p_v(ln p_v + 1) + p_v·Σ_i p_i(ln p_i + 1) = −p_v(ln p_v + H)`, and the chain
/// rule through `z = x/T` divides by T. The gradient sums to 0 (H is invariant to adding a
/// constant to every logit), is 0 everywhere for equal logits (maximum entropy), raises the
/// logits of tokens with `ln p_v < −H` (the unlikely ones) and lowers the likely ones. A `−∞`
/// logit (probability 0) gets gradient 0.
///
/// `H` comes from [`crate::entropy::token_entropy`] (the same value the ARES pipeline uses);
/// `ln p_v = z_v − logsumexp(z)` from a max-shifted sum. Three passes, no allocation. For the
/// bonus term `−c·w_t·H_t` of the loss, multiply `out` by `−c·w_t`.
///
/// Example: logits `(0, ln 2)`, T = 1: `p = (1/3, 2/3)`, `H = ln 3 − (2/3)·ln 2 = 0.6365142`,
/// gradient `±(2/9)·ln 2 = (0.1540327, −0.1540327)`; logits `(0, 2·ln 2)` at T = 2 give the same
/// H and half the gradient.
///
/// Errors: as [`crate::entropy::token_entropy`] (empty or all `−∞` logits, a NaN or `+∞`
/// logit, `temperature` not finite and `> 0`, a logit that overflows when divided by T);
/// `out` of another length than `logits` ([`Error::LengthMismatch`]); both leave `out`
/// unchanged. A gradient that overflows (a temperature so small, e.g. subnormal, that
/// `p_v·(ln p_v + H)/T` exceeds the float range) is [`Error::NonFinite`] on
/// `"entropy gradient"`, with `out` then holding unspecified values.
pub fn entropy_grad_logits<F: Float>(logits: &[F], temperature: F, out: &mut [F]) -> Result<F> {
    let h = crate::entropy::token_entropy(logits, temperature)?;
    check_len("out", logits.len(), out.len())?;
    // token_entropy validated: T finite > 0, no NaN/+∞, some finite z, no overflow of x/T.
    let max = logits
        .iter()
        .map(|&x| x / temperature)
        .fold(F::neg_infinity(), |m, z| m.max(z));
    let sum = logits
        .iter()
        .map(|&x| x / temperature - max)
        .filter(|&d| d > F::neg_infinity())
        .fold(F::zero(), |s, d| s + d.exp());
    let lse = max + sum.ln();
    for (o, &x) in out.iter_mut().zip(logits) {
        let z = x / temperature;
        *o = if z == F::neg_infinity() {
            F::zero()
        } else {
            let log_p = z - lse;
            let p = log_p.exp();
            -p * (log_p + h) / temperature
        };
    }
    if out.iter().any(|g| !g.is_finite()) {
        // only a subnormal-scale temperature gets here: −p(ln p + H)/T overflowed
        return Err(Error::NonFinite {
            what: "entropy gradient",
            index: out.iter().position(|g| !g.is_finite()).unwrap_or(0),
        });
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::entropy::token_entropy;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    fn ctl(coef: f64, target: f64, lr: f64, min: f64, max: f64) -> EntropyCoefController<f64> {
        EntropyCoefController::new(coef, target, lr, min, max).unwrap()
    }

    #[test]
    fn controller_hand_values() {
        // target 0.5, lr 0.01, bounds [0, 0.005], start 0.001
        let mut c = ctl(0.001, 0.5, 0.01, 0.0, 0.005);
        // H̄ = 0.3 < target: +0.01·0.2 = +0.002 per step, capped at 0.005
        assert!((c.update(0.3).unwrap() - 0.003).abs() < 1e-15);
        assert!((c.update(0.3).unwrap() - 0.005).abs() < 1e-15);
        assert_eq!(c.update(0.3), Ok(0.005)); // 0.007 clamps to max
        // H̄ = 1.0 > target: −0.005 per step, floored at 0
        assert_eq!(c.update(1.0), Ok(0.0));
        assert_eq!(c.update(1.0), Ok(0.0));
        // H̄ = target: no move
        let mut c = ctl(0.002, 0.5, 0.01, 0.0, 0.005);
        assert_eq!(c.update(0.5), Ok(0.002));
        // lr = 0 is a fixed coefficient
        let mut c = ctl(0.004, 0.5, 0.0, 0.0, 0.005);
        assert_eq!(c.update(0.0), Ok(0.004));
        // an overflowing step clamps to the bound it goes toward
        let mut c = ctl(1.0, 0.0, f64::MAX, 0.5, 2.0);
        assert_eq!(c.update(10.0), Ok(0.5));
        let mut c = ctl(1.0, 10.0, f64::MAX, 0.5, 2.0);
        assert_eq!(c.update(0.0), Ok(2.0));
        // f32
        let mut c = EntropyCoefController::new(0.0f32, 0.2, 1e-3, 0.0, 5e-3).unwrap();
        assert!((c.update(0.1).unwrap() - 1e-4).abs() < 1e-9);
        assert_eq!(EntropyCoefController::<f32>::default().validate(), Ok(()));
    }

    #[test]
    fn controller_errors_name_the_key() {
        let key = |r: Result<EntropyCoefController<f64>>| match r {
            Err(Error::OutOfRange { what, .. }) => what,
            other => panic!("expected OutOfRange, got {other:?}"),
        };
        let n = EntropyCoefController::new;
        assert_eq!(key(n(0.0, -0.1, 0.1, 0.0, 1.0)), "target_entropy");
        assert_eq!(key(n(0.0, f64::NAN, 0.1, 0.0, 1.0)), "target_entropy");
        assert_eq!(key(n(0.0, 0.2, -1.0, 0.0, 1.0)), "entropy_coeff_lr");
        assert_eq!(
            key(n(0.0, 0.2, f64::INFINITY, 0.0, 1.0)),
            "entropy_coeff_lr"
        );
        assert_eq!(key(n(0.0, 0.2, 0.1, -0.1, 1.0)), "entropy_coeff_min");
        assert_eq!(key(n(0.5, 0.2, 0.1, 0.5, 0.4)), "entropy_coeff_max");
        assert_eq!(
            key(n(0.5, 0.2, 0.1, 0.0, f64::INFINITY)),
            "entropy_coeff_max"
        );
        assert_eq!(key(n(1.5, 0.2, 0.1, 0.0, 1.0)), "entropy_coeff");
        assert_eq!(key(n(0.05, 0.2, 0.1, 0.1, 1.0)), "entropy_coeff");
        // update validates the (public) fields and the entropy; coef is then unchanged
        let mut c = ctl(0.001, 0.2, 0.01, 0.0, 0.005);
        for bad in [f64::NAN, -0.1, f64::INFINITY] {
            assert!(matches!(
                c.update(bad),
                Err(Error::OutOfRange {
                    what: "mean_entropy",
                    ..
                })
            ));
        }
        assert_eq!(c.coef, 0.001);
        c.max = 0.0005;
        assert!(matches!(
            c.update(0.1),
            Err(Error::OutOfRange {
                what: "entropy_coeff",
                ..
            })
        ));
        assert_eq!(c.coef, 0.001);
    }

    #[test]
    fn snapshot_restore_resumes_exactly() {
        let entropies = [0.05, 0.1, 0.4, 0.15, 0.0, 0.3, 0.19];
        let mut a = ctl(0.0, 0.2, 0.003, 0.0, 0.005);
        for &h in &entropies {
            a.update(h).unwrap();
        }
        // 3 steps, checkpoint, a fresh controller from the config, restore, 4 steps
        let mut b = ctl(0.0, 0.2, 0.003, 0.0, 0.005);
        for &h in &entropies[..3] {
            b.update(h).unwrap();
        }
        let saved = b.snapshot();
        let mut c = ctl(0.0, 0.2, 0.003, 0.0, 0.005);
        c.restore(saved).unwrap();
        for &h in &entropies[3..] {
            c.update(h).unwrap();
        }
        assert_eq!(c, a); // bit-identical
        // a state outside the configured bounds is refused, nothing changes
        let before = c;
        assert!(matches!(
            c.restore(EntropyCoefState { coef: 0.01 }),
            Err(Error::OutOfRange {
                what: "entropy_coeff",
                ..
            })
        ));
        assert!(c.restore(EntropyCoefState { coef: f64::NAN }).is_err());
        assert_eq!(c, before);
    }

    #[test]
    fn gradient_hand_values() {
        let ln2 = core::f64::consts::LN_2;
        let mut g = [0.0; 2];
        let h = entropy_grad_logits(&[0.0, ln2], 1.0, &mut g).unwrap();
        let want_h = 3f64.ln() - 2.0 / 3.0 * ln2; // 0.6365141682948128
        assert!((h - want_h).abs() < 1e-15 && (h - 0.6365142).abs() < 1e-7);
        let want = 2.0 / 9.0 * ln2; // 0.15403270...
        assert!(
            (g[0] - want).abs() < 1e-15 && (g[1] + want).abs() < 1e-15,
            "{g:?}"
        );
        // same distribution at T = 2: same H, half the gradient
        let h2 = entropy_grad_logits(&[0.0, 2.0 * ln2], 2.0, &mut g).unwrap();
        assert!((h2 - want_h).abs() < 1e-15);
        assert!((g[0] - want / 2.0).abs() < 1e-15 && (g[1] + want / 2.0).abs() < 1e-15);
        // equal logits: maximum entropy ln V, zero gradient
        let mut g5 = [1.0; 5];
        let h = entropy_grad_logits(&[3.0; 5], 0.7, &mut g5).unwrap();
        assert!((h - 5f64.ln()).abs() < 1e-12);
        assert!(g5.iter().all(|&x| x.abs() < 1e-15), "{g5:?}");
        // one logit: H = 0, gradient 0; −∞ logits get 0
        let mut g1 = [1.0];
        assert_eq!(entropy_grad_logits(&[4.0], 1.0, &mut g1), Ok(0.0));
        assert_eq!(g1, [0.0]);
        let mut g3 = [9.0; 3];
        let h = entropy_grad_logits(&[0.0, f64::NEG_INFINITY, ln2], 1.0, &mut g3).unwrap();
        assert!((h - want_h).abs() < 1e-15);
        assert_eq!(g3[1], 0.0);
        assert!((g3[0] - want).abs() < 1e-15);
        // f32
        let mut g32 = [0f32; 2];
        let h32 = entropy_grad_logits(&[0.0f32, ln2 as f32], 1.0, &mut g32).unwrap();
        assert!((f64::from(h32) - want_h).abs() < 1e-6);
        assert!((f64::from(g32[0]) - want).abs() < 1e-6);
    }

    #[test]
    fn gradient_errors() {
        let mut g = [0.0; 3];
        assert!(matches!(
            entropy_grad_logits(&[0.0, 1.0, 2.0], 0.0, &mut g),
            Err(Error::OutOfRange {
                what: "temperature",
                ..
            })
        ));
        assert_eq!(
            entropy_grad_logits(&[0.0, f64::NAN, 2.0], 1.0, &mut g),
            Err(Error::NonFinite {
                what: "logits",
                index: 1
            })
        );
        assert!(matches!(
            entropy_grad_logits::<f64>(&[], 1.0, &mut []),
            Err(Error::Empty { .. })
        ));
        assert!(matches!(
            entropy_grad_logits(&[0.0, 1.0], 1.0, &mut g),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        assert_eq!(g, [0.0; 3]);
        // z = (0, 1) is fine, but dividing the O(0.1) gradient by T = 1e−310 overflows
        let mut g2 = [0.0; 2];
        assert_eq!(
            entropy_grad_logits(&[0.0, 1e-310], 1e-310, &mut g2),
            Err(Error::NonFinite {
                what: "entropy gradient",
                index: 0
            })
        );
    }

    /// Central finite differences of `token_entropy` in each logit.
    fn finite_difference(logits: &[f64], t: f64, eps: f64) -> Vec<f64> {
        (0..logits.len())
            .map(|v| {
                let mut up = logits.to_vec();
                let mut down = logits.to_vec();
                up[v] += eps;
                down[v] -= eps;
                (token_entropy(&up, t).unwrap() - token_entropy(&down, t).unwrap()) / (2.0 * eps)
            })
            .collect()
    }

    #[test]
    fn gradient_matches_finite_differences() {
        // sign and the 1/T factor: a fixed row at several temperatures
        let logits = [1.3, -0.4, 2.2, 0.0, -3.1, 0.9, 2.15];
        for t in [0.3, 0.7, 1.0, 1.6] {
            let mut g = [0.0; 7];
            entropy_grad_logits(&logits, t, &mut g).unwrap();
            let fd = finite_difference(&logits, t, 1e-6);
            for (a, b) in g.iter().zip(&fd) {
                assert!(
                    (a - b).abs() < 1e-7,
                    "T = {t}: {a} vs finite difference {b}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn gradient_properties(
            logits in proptest::collection::vec(-8.0f64..8.0, 1..24),
            t in 0.25f64..3.0,
            shift in -50.0f64..50.0,
        ) {
            let mut g = vec![0.0; logits.len()];
            let h = entropy_grad_logits(&logits, t, &mut g).unwrap();
            prop_assert!(h >= 0.0 && h <= (logits.len() as f64).ln() + 1e-12);
            // sums to 0
            let s: f64 = g.iter().sum();
            let scale: f64 = g.iter().map(|x| x.abs()).sum::<f64>() + 1e-300;
            prop_assert!(s.abs() <= 1e-12 * scale.max(1.0), "sum {}", s);
            // matches finite differences
            let fd = finite_difference(&logits, t, 1e-5);
            for (a, b) in g.iter().zip(&fd) {
                prop_assert!((a - b).abs() < 1e-6, "{} vs {}", a, b);
            }
            // invariant to a common shift of the logits
            let shifted: Vec<f64> = logits.iter().map(|x| x + shift).collect();
            let mut g2 = vec![0.0; logits.len()];
            let h2 = entropy_grad_logits(&shifted, t, &mut g2).unwrap();
            prop_assert!((h - h2).abs() < 1e-9);
            for (a, b) in g.iter().zip(&g2) {
                prop_assert!((a - b).abs() < 1e-9);
            }
        }

        #[test]
        fn controller_moves_the_right_way_and_stays_in_bounds(
            min in 0.0f64..0.01,
            width in 0.0f64..0.01,
            start in 0.0f64..=1.0,
            target in 0.0f64..3.0,
            lr in 0.0f64..0.1,
            hs in proptest::collection::vec(0.0f64..5.0, 1..30),
        ) {
            let max = min + width;
            let mut c = ctl(min + start * width, target, lr, min, max);
            for h in hs {
                let before = c.coef;
                let after = c.update(h).unwrap();
                prop_assert!(min <= after && after <= max);
                if h < target {
                    prop_assert!(after >= before);
                } else {
                    prop_assert!(after <= before);
                }
                let bound = lr * (target - h).abs() * (1.0 + 1e-12) + 1e-15;
                prop_assert!((after - before).abs() <= bound);
                // from the same state, a lower entropy never gives a smaller coefficient
                let mut lower = EntropyCoefController { coef: before, ..c };
                prop_assert!(lower.update(h * 0.5).unwrap() >= after);
            }
        }
    }
}
