//! Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
//! Reasoning Language Models", arXiv 2505.22617): entropy collapse is driven by tokens whose
//! log-probability and advantage co-vary strongly, so these losses act on a small fraction of
//! the highest-covariance tokens only.
//!
//! The per-token covariance over the valid tokens of one call (a micro-batch, as in verl) is
//! `cov_t = (A_t − Ā)·(logπ_t − mean logπ)`, both means over valid tokens.

use super::{
    Acc, AggPlan, Checked, Clip, ClipParams, LOG_RATIO_CLAMP, PolicyLossConfig, PolicyLossInput,
    PolicyLossOutput, Streams, check_all, row_valid,
};
use crate::error::Result;
use crate::kl::KlEstimator;
use crate::num::{cast, check_param, check_scratch, exp_bounded, to_f64};
use num_traits::Float;

/// Default fraction of valid tokens Clip-Cov may clip (`clip_cov_ratio`).
pub const CLIP_COV_RATIO: f64 = 2e-4;
/// Default lower covariance bound of Clip-Cov's candidates (`clip_cov_lb`).
pub const CLIP_COV_LB: f64 = 1.0;
/// Default upper covariance bound of Clip-Cov's candidates (`clip_cov_ub`).
pub const CLIP_COV_UB: f64 = 5.0;
/// Default fraction of valid tokens KL-Cov penalises (`kl_cov_ratio`).
pub const KL_COV_RATIO: f64 = 2e-4;
/// Default KL-Cov penalty coefficient (`ppo_kl_coef`).
pub const PPO_KL_COEF: f64 = 1.0;

/// Clip-Cov parameters (defaults 2e-4, 1, 5, seed 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipCovParams<F> {
    /// `clip_cov_ratio` ∈ (0, 1]: at most `max(⌊ratio·N⌋, 1)` of the N valid tokens are clipped.
    pub ratio: F,
    /// `clip_cov_lb`: candidates have `lb < cov < ub`.
    pub lb: F,
    /// `clip_cov_ub` (> lb).
    pub ub: F,
    /// Seed of the selection among candidates (the same seed and inputs select the same
    /// tokens on every machine).
    pub seed: u64,
}

impl<F: Float> Default for ClipCovParams<F> {
    fn default() -> Self {
        ClipCovParams {
            ratio: cast(CLIP_COV_RATIO),
            lb: cast(CLIP_COV_LB),
            ub: cast(CLIP_COV_UB),
            seed: 0,
        }
    }
}

impl<F: Float> ClipCovParams<F> {
    /// Errors ([`Error::OutOfRange`](crate::Error::OutOfRange)) unless `ratio ∈ (0, 1]` and `lb < ub`, both finite.
    pub fn validate(&self) -> Result<()> {
        check_ratio("clip_cov_ratio", self.ratio)?;
        check_param("clip_cov_lb", self.lb, self.lb.is_finite(), "finite")?;
        check_param(
            "clip_cov_ub",
            self.ub,
            self.ub > self.lb,
            "> clip_cov_lb (finite)",
        )
    }
}

/// KL-Cov parameters (defaults 2e-4, 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlCovParams<F> {
    /// `kl_cov_ratio` ∈ (0, 1]: the top `max(⌊ratio·N⌋, 1)` tokens by covariance are penalised.
    pub ratio: F,
    /// `ppo_kl_coef` ≥ 0: the weight of `|ℓ|` on the selected tokens.
    pub coef: F,
}

impl<F: Float> Default for KlCovParams<F> {
    fn default() -> Self {
        KlCovParams {
            ratio: cast(KL_COV_RATIO),
            coef: cast(PPO_KL_COEF),
        }
    }
}

impl<F: Float> KlCovParams<F> {
    /// Errors ([`Error::OutOfRange`](crate::Error::OutOfRange)) unless `ratio ∈ (0, 1]` and `coef ≥ 0`, both finite.
    pub fn validate(&self) -> Result<()> {
        check_ratio("kl_cov_ratio", self.ratio)?;
        check_param("ppo_kl_coef", self.coef, self.coef >= F::zero(), ">= 0")
    }
}

fn check_ratio<F: Float>(what: &'static str, ratio: F) -> Result<()> {
    check_param(
        what,
        ratio,
        ratio > F::zero() && ratio <= F::one(),
        "in (0, 1]",
    )
}

/// `max(⌊ratio·n⌋, 1)` with the product in `f64`, as Python's `int(ratio * n)`.
fn token_budget<F: Float>(ratio: F, n: usize) -> usize {
    ((to_f64(ratio) * n as f64) as usize).max(1)
}

/// The per-token covariance `cov_t` of the module docs, from the masked means of A and logπ.
struct Covariance<'s, 'a, F> {
    s: &'s Streams<'a, F>,
    mean_a: F,
    mean_logp: F,
}

impl<'s, 'a, F: Float> Covariance<'s, 'a, F> {
    /// The means are summed in f64 and rounded once: for f32 inputs the sum is then (nearly
    /// always) independent of the order of summation, so ares-cuda's `cov_select`, which sums
    /// in a block's order, takes the same means and selects the same tokens.
    fn new(s: &'s Streams<'a, F>, plan: &AggPlan<F>) -> Self {
        let (mut sa, mut sl) = (0.0f64, 0.0f64);
        for ((&m, &a), &l) in s.mask.iter().zip(s.advantages).zip(s.logp) {
            if m != F::zero() {
                sa += to_f64(a);
                sl += to_f64(l);
            }
        }
        let n = plan.valid as f64;
        Covariance {
            s,
            mean_a: cast(sa / n),
            mean_logp: cast(sl / n),
        }
    }

    #[inline]
    fn at(&self, i: usize) -> F {
        let a = self.s.advantages.get(i).copied().unwrap_or_else(F::nan);
        let l = self.s.logp.get(i).copied().unwrap_or_else(F::nan);
        (a - self.mean_a) * (l - self.mean_logp)
    }
}

/// The SplitMix64 output for `seed + i·φ`: a fixed, well-mixed pseudo-random key per token.
#[inline]
fn selection_key(seed: u64, i: usize) -> u64 {
    let mut z = seed.wrapping_add(
        (i as u64)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The first `k` of `pool` in the total order `order` (all of it if `k ≥ len`), sorted by
/// index for [`walk`]: a partial selection, O(len), then a sort of the k.
fn first_k(
    pool: &mut [usize],
    k: usize,
    order: impl FnMut(&usize, &usize) -> core::cmp::Ordering,
) -> &mut [usize] {
    let k = k.min(pool.len());
    if k < pool.len() {
        pool.select_nth_unstable_by(k, order);
    }
    let selected = &mut pool[..k];
    selected.sort_unstable();
    selected
}

/// Walks valid tokens with a sorted list of selected flat indices (`selected[..]` ascending):
/// calls `f(flat index, row weight, is selected, grad slot)`; zeroes padding gradients.
fn walk<F: Float>(
    plan: &AggPlan<F>,
    mask: &[F],
    grad: &mut [F],
    selected: &[usize],
    mut f: impl FnMut(usize, F, bool, &mut F),
) {
    let cols = plan.cols;
    let mut next = selected.iter().copied().peekable();
    for (r, g_row) in grad.chunks_exact_mut(cols).enumerate() {
        let at = r * cols;
        let m = &mask[at..at + cols];
        let weight = plan.row_weight(row_valid(m));
        for (t, g) in g_row.iter_mut().enumerate() {
            if m[t] == F::zero() {
                *g = F::zero();
                continue;
            }
            let i = at + t;
            let chosen = next.next_if_eq(&i).is_some();
            f(i, weight, chosen, g);
        }
    }
}

/// The Clip-Cov loss over `[rows, cols]` with its gradient `∂loss/∂logπ_t`.
///
/// Per valid token, PPO's clipped surrogate without dual clip:
/// `ℓ = clamp(logπ − logπ_old, ±20)`, `r = eˡ`, `L = max(−A·r, −A·clamp(r, 1 − ε_low, 1 + ε_high))`
/// (ε from `config.clip`; `clip_ratio_c` is validated but not used). The candidates are the
/// valid tokens that the PPO clip did not clip (`L2 ≤ L1`) with `lb < cov_t < ub`; up to
/// `k = max(⌊ratio·N⌋, 1)` of them (N valid tokens) are selected and contribute neither
/// loss nor gradient (`L·0`, as verl multiplies by its `corr` mask). The rest is as
/// [`super::policy_loss`]: rollout importance weights, aggregation by `config.agg`.
///
/// Selection is seeded and deterministic: with more than k candidates, the k whose
/// [SplitMix64] key of `params.seed + (t + 1)·φ` (t the flat index) is smallest, ties by
/// index; verl draws them with `torch.randperm` instead. `scratch` must hold at least N
/// entries. Metrics: `clipfrac` = PPO-clipped fraction, `selected_frac` = selected fraction
/// (verl logs the latter as `pg_clipfrac`). verl does not clamp ℓ; the two agree for
/// `|ℓ| ≤ 20`.
///
/// [SplitMix64]: https://prng.di.unimi.it/splitmix64.c
///
/// Errors: as [`super::policy_loss`], invalid `params`, `scratch` shorter than N
/// ([`Error::ScratchTooSmall`](crate::Error::ScratchTooSmall)).
pub fn clip_cov_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    config: &PolicyLossConfig<F>,
    params: &ClipCovParams<F>,
    scratch: &mut [usize],
    grad: &mut [F],
) -> Result<PolicyLossOutput<F>> {
    params.validate()?;
    let Checked { plan, streams, is } = check_all(input, config, grad.len())?;
    check_scratch("scratch", plan.valid, scratch.len())?;
    let clip = Clip::new(&ClipParams {
        clip_ratio_c: F::zero(),
        ..config.clip
    })?;
    let cov = Covariance::new(&streams, &plan);
    let mut candidates = 0;
    for (i, &m) in streams.mask.iter().enumerate() {
        if m == F::zero() {
            continue;
        }
        let c = cov.at(i);
        let clipped = clip
            .token(streams.logp[i] - streams.logp_old[i], streams.advantages[i])
            .clipped;
        if !clipped && c > params.lb && c < params.ub {
            scratch[candidates] = i;
            candidates += 1;
        }
    }
    let key = |i: &usize| (selection_key(params.seed, *i), *i);
    let selected = first_k(
        &mut scratch[..candidates],
        token_budget(params.ratio, plan.valid),
        |a, b| key(a).cmp(&key(b)),
    );
    let bound: F = cast(LOG_RATIO_CLAMP);
    let mut acc = Acc::new();
    walk(
        &plan,
        streams.mask,
        grad,
        selected,
        |i, weight, chosen, g| {
            let (lo_old, lr) = (streams.logp_old[i], streams.rollout[i]);
            let d = streams.logp[i] - lo_old;
            let tok = clip.token(d, streams.advantages[i]);
            let (w, changed) = is.weight(lo_old - lr, bound);
            let keep = if chosen { F::zero() } else { F::one() };
            acc.loss = acc.loss + weight * w * keep * tok.loss;
            acc.token(d.max(-bound).min(bound), (w, changed), tok.clipped);
            acc.selected += usize::from(chosen);
            *g = weight * w * keep * tok.grad;
        },
    );
    Ok(acc.output(&plan))
}

/// The KL-Cov loss over `[rows, cols]` with its gradient `∂loss/∂logπ_t`.
///
/// Per valid token, `ℓ = clamp(logπ − logπ_old, ±20)`, `r = eˡ` and the unclipped
/// `L = −A·r` (slope `−A·r`); the top `k = max(⌊ratio·N⌋, 1)` valid tokens by `cov_t`
/// (ties by the lower flat index) get `L = −A·r + coef·|ℓ|` (slope `−A·r + coef·sign ℓ`,
/// 0 for `ℓ = 0`). No PPO clip applies (`config.clip` is validated but not used; `clipfrac`
/// and `clipfrac_lower` are 0). Rollout importance weights and aggregation as
/// [`super::policy_loss`]. `scratch` must hold at least N entries.
///
/// verl uses the unclamped log-ratio (the two agree for `|ℓ| ≤ 20`), picks the top k with
/// `torch.topk` (whose order among equal covariances is unspecified), and logs the mean
/// `|ℓ|` as `ppo_kl`; here `approx_kl` stays the mean of `−ℓ` and `selected_frac` = k/N.
///
/// Errors: as [`super::policy_loss`], invalid `params`, `scratch` shorter than N.
pub fn kl_cov_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    config: &PolicyLossConfig<F>,
    params: &KlCovParams<F>,
    scratch: &mut [usize],
    grad: &mut [F],
) -> Result<PolicyLossOutput<F>> {
    params.validate()?;
    let Checked { plan, streams, is } = check_all(input, config, grad.len())?;
    check_scratch("scratch", plan.valid, scratch.len())?;
    let cov = Covariance::new(&streams, &plan);
    let pool = &mut scratch[..plan.valid];
    let valid = streams
        .mask
        .iter()
        .enumerate()
        .filter(|(_, m)| **m != F::zero());
    for (slot, (i, _)) in pool.iter_mut().zip(valid) {
        *slot = i;
    }
    // descending covariance, then ascending index: a total order, so the top k are unique
    let selected = first_k(pool, token_budget(params.ratio, plan.valid), |a, b| {
        to_f64(cov.at(*b))
            .total_cmp(&to_f64(cov.at(*a)))
            .then(a.cmp(b))
    });
    let bound: F = cast(LOG_RATIO_CLAMP);
    let mut acc = Acc::new();
    walk(
        &plan,
        streams.mask,
        grad,
        selected,
        |i, weight, chosen, g| {
            let (lo_old, lr) = (streams.logp_old[i], streams.rollout[i]);
            let d = streams.logp[i] - lo_old;
            // Closed interval, as the token clamps of `ppo_token_loss`.
            let live = d >= -bound && d <= bound;
            let l = d.max(-bound).min(bound);
            let neg_a_r = -streams.advantages[i] * exp_bounded(l);
            let (mut loss, mut slope) = (neg_a_r, if live { neg_a_r } else { F::zero() });
            if chosen {
                // |ℓ| and its slope sign ℓ (0 at ℓ = 0): the `abs` KL estimator
                let (abs, sign) = KlEstimator::Abs.penalty_and_grad(l, F::zero());
                loss = loss + params.coef * abs;
                slope = slope + if live { params.coef * sign } else { F::zero() };
            }
            let (w, changed) = is.weight(lo_old - lr, bound);
            acc.loss = acc.loss + weight * w * loss;
            acc.token(l, (w, changed), false);
            acc.selected += usize::from(chosen);
            *g = weight * w * slope;
        },
    );
    Ok(acc.output(&plan))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::super::LossAggMode;
    use super::super::testing::token_batch;
    use super::*;
    use crate::{Error, Shape};
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    // one row of 4 tokens, r = 1 except token 0: A = (3, 1, 0, 0) → Ā = 1;
    // logπ = (−1, −2, −3, −2) → mean −2; cov = (2·1, 0·0, (−1)·(−1), (−1)·0) = (2, 0, 1, 0)
    const LOGP: [f64; 4] = [-1.0, -2.0, -3.0, -2.0];
    const ADV: [f64; 4] = [3.0, 1.0, 0.0, 0.0];
    const MASK: [f64; 4] = [1.0; 4];

    fn input<'a>(logp_old: &'a [f64]) -> PolicyLossInput<'a, f64> {
        PolicyLossInput {
            shape: Shape::new(1, 4),
            logp: &LOGP,
            logp_old,
            advantages: &ADV,
            mask: &MASK,
            logp_rollout: None,
        }
    }

    #[test]
    fn clip_cov_hand_checked() {
        let cfg = PolicyLossConfig::default();
        let mut scratch = [0usize; 4];
        let mut g = [9.0; 4];
        // candidates: cov in (0.5, 5) → tokens 0 and 2; ratio 0.5 → k = 2: both
        let params = ClipCovParams {
            ratio: 0.5,
            lb: 0.5,
            ub: 5.0,
            seed: 7,
        };
        let out = clip_cov_loss(&input(&LOGP), &cfg, &params, &mut scratch, &mut g).unwrap();
        // L = −A·1 = (−3, −1, 0, 0), tokens 0 and 2 removed: token-mean −1/4
        assert!((out.loss + 0.25).abs() < 1e-12, "{}", out.loss);
        assert_eq!(g, [0.0, -0.25, 0.0, 0.0]);
        assert_eq!((out.selected_frac, out.clipfrac), (0.5, 0.0));
        // ratio 0.25 → k = 1: one of the two, fixed by the seed; every seed picks one of them
        let mut seen = [false; 4];
        for seed in 0..32 {
            let p = ClipCovParams {
                ratio: 0.25,
                seed,
                ..params
            };
            let out = clip_cov_loss(&input(&LOGP), &cfg, &p, &mut scratch, &mut g).unwrap();
            assert_eq!(out.selected_frac, 0.25);
            let picked: Vec<usize> = (0..4)
                .filter(|&t| t != 1 && g[t] == 0.0 && ADV[t] != 0.0)
                .collect();
            let again =
                clip_cov_loss(&input(&LOGP), &cfg, &p, &mut scratch, &mut [0.0; 4]).unwrap();
            assert_eq!(again, out);
            if g[0] == 0.0 {
                seen[0] = true;
            } else {
                seen[2] = true;
                assert!(picked.is_empty());
            }
        }
        assert!(seen[0] && seen[2], "both candidates are drawn by some seed");
        // a PPO-clipped token is never a candidate: token 0 at r = 2 with A = 3 is clipped
        let old = [-1.0 - 2f64.ln(), -2.0, -3.0, -2.0];
        let out = clip_cov_loss(&input(&old), &cfg, &params, &mut scratch, &mut g).unwrap();
        assert_eq!((out.selected_frac, out.clipfrac), (0.25, 0.25));
        // no candidate in (5, 6): nothing selected, plain PPO clip without dual clip
        let none = ClipCovParams {
            lb: 5.0,
            ub: 6.0,
            ..params
        };
        let out = clip_cov_loss(&input(&LOGP), &cfg, &none, &mut scratch, &mut g).unwrap();
        assert!((out.loss + 1.0).abs() < 1e-12 && out.selected_frac == 0.0);
    }

    #[test]
    fn kl_cov_hand_checked() {
        // token 0: ℓ = 0.1, top covariance (2) → L = −3·e^0.1 + 0.1, slope −3·e^0.1 + 1
        let old = [-1.1, -2.0, -3.0, -2.0];
        let params = KlCovParams {
            ratio: 0.25,
            coef: 1.0,
        };
        let mut scratch = [0usize; 4];
        let mut g = [9.0; 4];
        let cfg = PolicyLossConfig::default();
        let out = kl_cov_loss(&input(&old), &cfg, &params, &mut scratch, &mut g).unwrap();
        let e = 0.1f64.exp();
        assert!(
            (out.loss - (-3.0 * e + 0.1 - 1.0) / 4.0).abs() < 1e-12,
            "{}",
            out.loss
        );
        assert!((g[0] - (-3.0 * e + 1.0) / 4.0).abs() < 1e-12);
        assert_eq!(g[1..], [-0.25, 0.0, 0.0]);
        assert_eq!((out.selected_frac, out.clipfrac), (0.25, 0.0));
        // k = max(⌊0.1·4⌋, 1) = 1 too; ratio 1 selects every token
        let all = KlCovParams {
            ratio: 1.0,
            coef: 2.0,
        };
        let out = kl_cov_loss(&input(&old), &cfg, &all, &mut scratch, &mut g).unwrap();
        assert_eq!(out.selected_frac, 1.0);
        assert!((out.loss - (-3.0 * e + 0.2 - 1.0) / 4.0).abs() < 1e-12);
    }

    #[test]
    fn errors() {
        let cfg = PolicyLossConfig::default();
        let mut g = [0.0; 4];
        let mut short = [0usize; 3];
        assert_eq!(
            clip_cov_loss(
                &input(&LOGP),
                &cfg,
                &ClipCovParams::default(),
                &mut short,
                &mut g
            ),
            Err(Error::ScratchTooSmall {
                what: "scratch",
                needed: 4,
                actual: 3
            })
        );
        let mut scratch = [0usize; 4];
        for (p, what) in [
            (
                ClipCovParams {
                    ratio: 0.0,
                    ..Default::default()
                },
                "clip_cov_ratio",
            ),
            (
                ClipCovParams {
                    ratio: 1.5,
                    ..Default::default()
                },
                "clip_cov_ratio",
            ),
            (
                ClipCovParams {
                    lb: f64::NAN,
                    ..Default::default()
                },
                "clip_cov_lb",
            ),
            (
                ClipCovParams {
                    ub: 1.0,
                    ..Default::default()
                },
                "clip_cov_ub",
            ),
        ] {
            assert!(matches!(
                clip_cov_loss(&input(&LOGP), &cfg, &p, &mut scratch, &mut g),
                Err(Error::OutOfRange { what: w, .. }) if w == what
            ));
        }
        for (p, what) in [
            (
                KlCovParams {
                    ratio: f64::NAN,
                    coef: 1.0,
                },
                "kl_cov_ratio",
            ),
            (
                KlCovParams {
                    ratio: 0.1,
                    coef: -1.0,
                },
                "ppo_kl_coef",
            ),
        ] {
            assert!(matches!(
                kl_cov_loss(&input(&LOGP), &cfg, &p, &mut scratch, &mut g),
                Err(Error::OutOfRange { what: w, .. }) if w == what
            ));
        }
        let nan = [-1.0, f64::NAN, -3.0, -2.0];
        assert_eq!(
            kl_cov_loss(
                &input(&nan),
                &cfg,
                &KlCovParams::default(),
                &mut scratch,
                &mut g
            ),
            Err(Error::NonFinite {
                what: "logp_old",
                index: 1
            })
        );
    }

    /// Central differences of `loss` at every token; `skip(t)` leaves out kinks.
    fn check_fd(
        logp: &[f64],
        grad: &[f64],
        loss: impl Fn(&[f64]) -> f64,
    ) -> core::result::Result<(), TestCaseError> {
        let h = 1e-6;
        for t in 0..logp.len() {
            let mut p = logp.to_vec();
            p[t] += h;
            let fp = loss(&p);
            p[t] -= 2.0 * h;
            let fm = loss(&p);
            let fd = (fp - fm) / (2.0 * h);
            prop_assert!(
                (fd - grad[t]).abs() <= 1e-6 * (1.0 + grad[t].abs()),
                "t={} fd={} grad={}",
                t,
                fd,
                grad[t]
            );
        }
        Ok(())
    }

    /// Covariances and the valid-token count, as the module docs define them.
    fn covariances(logp: &[f64], adv: &[f64], mask: &[f64]) -> (Vec<f64>, usize) {
        let n = mask.iter().filter(|&&m| m != 0.0).count();
        let mean = |x: &[f64]| x.iter().zip(mask).map(|(v, m)| v * m).sum::<f64>() / n as f64;
        let (ma, ml) = (mean(adv), mean(logp));
        (
            (0..mask.len())
                .map(|i| (adv[i] - ma) * (logp[i] - ml))
                .collect(),
            n,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Clip-Cov: FD gradient away from selection and clip boundaries; selected tokens
        /// have zero gradient; the selected count is min(k, candidates).
        #[test]
        fn clip_cov_gradient_and_selection(
            (shape, logp, shift, adv, mask) in token_batch(7),
            agg in proptest::sample::select(&LossAggMode::ALL[..]),
            ratio in 0.05f64..1.0,
            lb in -0.5f64..0.5,
            seed in any::<u64>(),
        ) {
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let cfg = PolicyLossConfig { agg, ..PolicyLossConfig::default() };
            let params = ClipCovParams { ratio, lb, ub: lb + 1.0, seed };
            let n_all = logp.len();
            let run = |lp: &[f64]| {
                let inp = PolicyLossInput { shape, logp: lp, logp_old: &old, advantages: &adv, mask: &mask, logp_rollout: None };
                let mut g = vec![0.0; n_all];
                let mut scratch = vec![0usize; n_all];
                (clip_cov_loss(&inp, &cfg, &params, &mut scratch, &mut g).unwrap(), g)
            };
            let (out, grad) = run(&logp);
            let (cov, n) = covariances(&logp, &adv, &mask);
            let candidates = (0..n_all).filter(|&i| {
                let r = shift[i].exp();
                let clipped = -adv[i] * r.clamp(0.8, 1.3) > -adv[i] * r;
                mask[i] != 0.0 && !clipped && cov[i] > lb && cov[i] < lb + 1.0
            }).count();
            let k = (((ratio * n as f64) as usize).max(1)).min(candidates);
            prop_assert!((out.selected_frac * n as f64 - k as f64).abs() < 1e-9);
            for i in 0..n_all {
                let r = shift[i].exp();
                prop_assume!((r - 0.8).abs() > 1e-4 && (r - 1.3).abs() > 1e-4);
                prop_assume!((cov[i] - lb).abs() > 1e-4 && (cov[i] - lb - 1.0).abs() > 1e-4);
            }
            check_fd(&logp, &grad, |lp| run(lp).0.loss)?;
        }

        /// KL-Cov: FD gradient away from the top-k boundary and ℓ = 0; exactly k tokens are
        /// selected, and they are the k largest covariances.
        #[test]
        fn kl_cov_gradient_and_selection(
            (shape, logp, shift, adv, mask) in token_batch(7),
            agg in proptest::sample::select(&LossAggMode::ALL[..]),
            ratio in 0.05f64..1.0,
            coef in 0.0f64..2.0,
        ) {
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let cfg = PolicyLossConfig { agg, ..PolicyLossConfig::default() };
            let params = KlCovParams { ratio, coef };
            let n_all = logp.len();
            let run = |lp: &[f64]| {
                let inp = PolicyLossInput { shape, logp: lp, logp_old: &old, advantages: &adv, mask: &mask, logp_rollout: None };
                let mut g = vec![0.0; n_all];
                let mut scratch = vec![0usize; n_all];
                (kl_cov_loss(&inp, &cfg, &params, &mut scratch, &mut g).unwrap(), g)
            };
            let (out, grad) = run(&logp);
            let (cov, n) = covariances(&logp, &adv, &mask);
            let k = ((ratio * n as f64) as usize).max(1).min(n);
            prop_assert!((out.selected_frac * n as f64 - k as f64).abs() < 1e-9);
            let mut sorted: Vec<f64> = (0..n_all).filter(|&i| mask[i] != 0.0).map(|i| cov[i]).collect();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if k < n {
                prop_assume!(sorted[k - 1] - sorted[k] > 1e-4);
            }
            prop_assume!(shift.iter().all(|s| s.abs() > 1e-4));
            // the loss is the unclipped one plus coef·|ℓ| on the top k
            let mut w = vec![0.0; n_all];
            super::super::aggregate_weights(shape, &mask, agg, &mut w).unwrap();
            let want: f64 = (0..n_all).filter(|&i| mask[i] != 0.0).map(|i| {
                let top = cov[i] >= sorted[k - 1];
                w[i] * (-adv[i] * shift[i].exp() + if top { coef * shift[i].abs() } else { 0.0 })
            }).sum();
            prop_assert!((out.loss - want).abs() < 1e-9 * (1.0 + want.abs()));
            check_fd(&logp, &grad, |lp| run(lp).0.loss)?;
        }
    }
}
