//! GRPO-λ (docs/algorithms.md §8): batch-level top-λ group selection and the length-penalty
//! reward for the most accurate groups, 0/1 for the rest.
//!
//! The formula is normative, not the reference sample code; where they differ we follow the
//! formula and the tests show it: incorrect samples of a top group get 0 (the sample code
//! gave them the length reward), a top group with no correct sample falls back to 0/1 (the
//! sample code raised `KeyError`), a single correct sample or equal correct lengths give
//! z = 0 (the sample code divided by 0.0001 or by 0).
//!
//! Only the rewards are produced here; the GRPO advantage over them is
//! [`crate::advantage`]'s job.

use crate::error::{Error, Result};
use crate::groups::Groups;
use crate::num::{cast, check_finite, check_param, check_scratch, to_f64};
use num_traits::Float;

/// GRPO-λ parameters: `lambda_` = λ ∈ [0, 1], the fraction of groups that are
/// efficiency-priority (default 0.2); `alpha` = α ∈ [0, 1], the length-penalty strength
/// (default 0.6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoLambda<F> {
    /// λ: fraction of the batch's groups, by accuracy, that get the length penalty.
    pub lambda_: F,
    /// α: length-penalty strength; correct rewards lie in `[1 − α, 1]`.
    pub alpha: F,
}

impl<F: Float> Default for GrpoLambda<F> {
    fn default() -> Self {
        GrpoLambda {
            lambda_: cast(0.2),
            alpha: cast(0.6),
        }
    }
}

impl<F: Float> GrpoLambda<F> {
    /// Errors ([`Error::OutOfRange`]) unless λ ∈ [0, 1] and α ∈ [0, 1].
    pub fn validate(&self) -> Result<()> {
        let unit = |x: F| x >= F::zero() && x <= F::one();
        check_param("lambda_", self.lambda_, unit(self.lambda_), "in [0, 1]")?;
        check_param("alpha", self.alpha, unit(self.alpha), "in [0, 1]")
    }
}

/// The number of efficiency-priority groups: `min(G, max(1, ⌈λ·G⌉))` (0 when G = 0).
///
/// The ceiling ignores float noise below a relative `max(1e−9, 4·ε_F)`, so λ = 0.3 with
/// G = 10 gives 3 (0.3·10 = 3.0000000000000004 in f64), not 4, in f32 as in f64.
///
/// Errors: λ outside [0, 1] or non-finite.
pub fn top_group_count<F: Float>(lambda_: F, groups: usize) -> Result<usize> {
    check_param(
        "lambda_",
        lambda_,
        lambda_ >= F::zero() && lambda_ <= F::one(),
        "in [0, 1]",
    )?;
    if groups == 0 {
        return Ok(0);
    }
    let x = to_f64(lambda_) * groups as f64;
    let tol = 1e-9f64.max(4.0 * to_f64(F::epsilon())) * x.max(1.0);
    // x ≤ groups, so the ceiling fits in usize; `as` saturates anyway.
    let k = libm::ceil(x - tol).max(0.0) as usize;
    Ok(k.clamp(1, groups))
}

/// Numerically stable logistic `1/(1 + e^{−z})`.
#[inline]
fn sigmoid<F: Float>(z: F) -> F {
    if z >= F::zero() {
        F::one() / (F::one() + (-z).exp())
    } else {
        let e = z.exp();
        e / (F::one() + e)
    }
}

/// GRPO-λ rewards for a batch laid out by `groups`.
///
/// Per group k: `c_k = #correct / n_k` (`n_k` its size). Groups are ordered by `c_k` descending, stably (ties
/// keep batch order), and the first [`top_group_count`]`(λ, G)` are efficiency-priority
/// ("top"). In a top group with at least one correct sample, with `mean_c` and `std_c` the
/// mean and population standard deviation of the group's correct lengths:
///
/// - correct: `r = 1 − α·sig((L − mean_c)/std_c)`, with z = 0 (so `r = 1 − α/2`) when the
///   group has a single correct sample or all its correct lengths are equal (std_c = 0);
/// - incorrect: `r = 0`.
///
/// A top group with no correct sample falls back to 0/1 (all 0). Other groups: 0/1.
///
/// Inputs by batch row: `correct[row]`, `lengths[row]` (response length in tokens, finite,
/// ≥ 0). Outputs: `rewards[row]`; `top[g]` for each group; `order[..G]` receives the group
/// indices by accuracy, best first (stable), and is the sort's scratch (≥ G entries).
/// Returns the number of top groups. An empty batch (G = 0) returns 0.
///
/// Works for every [`Groups`] layout (contiguous, permuted, ragged); groups of one are
/// allowed (the reward needs no pair; the GRPO advantage after it does).
///
/// Errors: lengths of `correct`, `lengths`, `rewards` ≠ batch or of `top` ≠ G
/// ([`Error::LengthMismatch`]); `order` shorter than G ([`Error::ScratchTooSmall`]);
/// a non-finite length ([`Error::NonFinite`]) or a negative one ([`Error::OutOfRange`]);
/// invalid `params`.
pub fn grpo_lambda_rewards<F: Float>(
    groups: &Groups<'_>,
    correct: &[bool],
    lengths: &[F],
    params: &GrpoLambda<F>,
    order: &mut [usize],
    top: &mut [bool],
    rewards: &mut [F],
) -> Result<usize> {
    params.validate()?;
    groups.check_batch("correct", correct.len())?;
    groups.check_batch("lengths", lengths.len())?;
    groups.check_batch("rewards", rewards.len())?;
    let g_count = groups.count();
    crate::num::check_len("top", g_count, top.len())?;
    check_scratch("order", g_count, order.len())?;
    check_finite("lengths", lengths)?;
    if let Some(&l) = lengths.iter().find(|&&l| l < F::zero()) {
        return Err(Error::OutOfRange {
            what: "lengths",
            value: to_f64(l),
            expected: ">= 0",
        });
    }
    let is_correct = |row: usize| correct.get(row).copied().unwrap_or(false);
    let length = |row: usize| lengths.get(row).copied().unwrap_or(F::zero());

    // Accuracy descending, then batch order: a total order, so an unstable sort is stable.
    // Accuracies hits/n are compared exactly by cross-multiplying (groups may differ in size).
    let hits = |g: usize| groups.rows_of(g).filter(|&row| is_correct(row)).count() as u128;
    let order = &mut order[..g_count];
    for (g, slot) in order.iter_mut().enumerate() {
        *slot = g;
    }
    order.sort_unstable_by(|&a, &b| {
        let (na, nb) = (groups.size(a) as u128, groups.size(b) as u128);
        (hits(b) * na).cmp(&(hits(a) * nb)).then(a.cmp(&b))
    });

    let k = top_group_count(params.lambda_, g_count)?;
    top.fill(false);
    for &g in order.iter().take(k) {
        if let Some(t) = top.get_mut(g) {
            *t = true;
        }
    }

    let half: F = cast(0.5);
    for (g, &is_top) in top.iter().enumerate() {
        // 0/1 everywhere first; top groups with a correct sample then get the penalty.
        for row in groups.rows_of(g) {
            if let Some(r) = rewards.get_mut(row) {
                *r = if is_correct(row) { F::one() } else { F::zero() };
            }
        }
        if !is_top {
            continue;
        }
        let (mut m, mut sum) = (0usize, F::zero());
        let (mut lo, mut hi) = (F::infinity(), F::neg_infinity());
        for row in groups.rows_of(g).filter(|&row| is_correct(row)) {
            let l = length(row);
            m += 1;
            sum = sum + l;
            lo = lo.min(l);
            hi = hi.max(l);
        }
        if m == 0 {
            continue; // no correct sample: the 0/1 fallback (all 0) stays
        }
        let mean = sum / cast::<F>(m as f64);
        let var = groups
            .rows_of(g)
            .filter(|&row| is_correct(row))
            .map(|row| {
                let d = length(row) - mean;
                d * d
            })
            .fold(F::zero(), |a, b| a + b)
            / cast::<F>(m as f64);
        let std = var.sqrt();
        // Equal lengths are std = 0 even when rounding leaves a tiny variance; a sum that
        // overflows (lengths near F::MAX) also falls back to z = 0 so rewards stay finite.
        let flat = m == 1 || lo == hi || std == F::zero() || !(mean.is_finite() && std.is_finite());
        for row in groups.rows_of(g) {
            if let Some(r) = rewards.get_mut(row) {
                *r = if !is_correct(row) {
                    F::zero()
                } else if flat {
                    F::one() - params.alpha * half
                } else {
                    F::one() - params.alpha * sigmoid((length(row) - mean) / std)
                };
            }
        }
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-7
    }

    /// Runs GRPO-λ over contiguous groups of `n`; returns (rewards, top, order, k).
    fn run(
        n: usize,
        correct: &[bool],
        lengths: &[f64],
        lambda_: f64,
        alpha: f64,
    ) -> (Vec<f64>, Vec<bool>, Vec<usize>, usize) {
        let groups = Groups::contiguous(correct.len(), n).unwrap();
        let mut order = vec![0; groups.count()];
        let mut top = vec![false; groups.count()];
        let mut rewards = vec![0.0; correct.len()];
        let params = GrpoLambda { lambda_, alpha };
        let k = grpo_lambda_rewards(
            &groups,
            correct,
            lengths,
            &params,
            &mut order,
            &mut top,
            &mut rewards,
        )
        .unwrap();
        (rewards, top, order, k)
    }

    #[test]
    fn vector_12() {
        // mean 250, population std √12500 = 111.80340; z = ∓1.3416408, ∓0.4472136
        // 1 − 0.6·sig(−1.3416408) = 1 − 0.6·0.2072404 = 0.8756558, …
        let (r, top, _, k) = run(4, &[true; 4], &[100.0, 200.0, 300.0, 400.0], 0.2, 0.6);
        let want = [0.8756558, 0.7659859, 0.6340141, 0.5243442];
        for (r, w) in r.iter().zip(want) {
            assert!(close(*r, w), "{r} vs {w}");
        }
        assert_eq!((top, k), (vec![true], 1));
        // f32
        let groups = Groups::contiguous(4, 4).unwrap();
        let (mut order, mut top, mut rew) = ([0usize; 1], [false; 1], [0f32; 4]);
        grpo_lambda_rewards(
            &groups,
            &[true; 4],
            &[100f32, 200.0, 300.0, 400.0],
            &GrpoLambda {
                lambda_: 0.2f32,
                alpha: 0.6,
            },
            &mut order,
            &mut top,
            &mut rew,
        )
        .unwrap();
        for (r, w) in rew.iter().zip(want) {
            assert!((f64::from(*r) - w).abs() < 1e-6);
        }
    }

    #[test]
    fn top_count_rounding() {
        assert_eq!(top_group_count(0.3f64, 10), Ok(3)); // 0.3·10 = 3.0000000000000004
        assert_eq!(top_group_count(0.3f32, 10), Ok(3)); // 0.3f32 = 0.30000001
        assert_eq!(top_group_count(0.7f64, 10), Ok(7));
        assert_eq!(top_group_count(0.2f64, 10), Ok(2));
        assert_eq!(top_group_count(0.25f64, 10), Ok(3)); // ⌈2.5⌉
        assert_eq!(top_group_count(0.2f64, 11), Ok(3)); // ⌈2.2⌉
        assert_eq!(top_group_count(0.0f64, 10), Ok(1)); // max(1, ·)
        assert_eq!(top_group_count(1.0f64, 7), Ok(7));
        assert_eq!(top_group_count(0.5f64, 0), Ok(0));
        assert!(matches!(
            top_group_count(1.5f64, 3),
            Err(Error::OutOfRange {
                what: "lambda_",
                ..
            })
        ));
        assert!(top_group_count(f64::NAN, 3).is_err());
    }

    #[test]
    fn incorrect_samples_in_top_group_get_zero() {
        // Correct lengths 100, 300: mean 200, std 100, z = ∓1.
        // 1 − 0.6·sig(−1) = 1 − 0.6·0.2689414 = 0.8386352; 1 − 0.6·0.7310586 = 0.5613648.
        // The reference sample code would give the incorrect ones the length reward too
        // (e.g. L = 50: z = −1.5 → 0.8907...); the formula gives them 0.
        let (r, _, _, _) = run(
            4,
            &[true, true, false, false],
            &[100.0, 300.0, 50.0, 1000.0],
            0.2,
            0.6,
        );
        assert!(close(r[0], 0.8386352) && close(r[1], 0.5613648));
        assert_eq!((r[2], r[3]), (0.0, 0.0));
    }

    #[test]
    fn top_group_without_correct_sample_falls_back_to_zero_one() {
        // λ = 1: every group is top; group 1 has no correct sample (the reference sample code
        // raises KeyError on `group_length_stats[group]`).
        let (r, top, _, k) = run(
            2,
            &[true, false, false, false],
            &[10.0, 20.0, 30.0, 40.0],
            1.0,
            0.6,
        );
        assert_eq!((k, top), (2, vec![true, true]));
        assert!(close(r[0], 0.7)); // single correct → z = 0
        assert_eq!(&r[1..], &[0.0, 0.0, 0.0]);
    }

    #[test]
    fn single_correct_and_equal_lengths_give_half_penalty() {
        // Single correct sample: z = 0 → 1 − 0.6/2 = 0.7 (the sample code divides by 0.0001, which
        // also gives z = 0 for it but sends its incorrect peers to 0.4 or 1.0).
        let (r, _, _, _) = run(3, &[false, true, false], &[5.0, 900.0, 7.0], 0.2, 0.6);
        assert_eq!(r[0], 0.0);
        assert!(close(r[1], 0.7));
        assert_eq!(r[2], 0.0);
        // Equal correct lengths, std = 0 (the sample code divides by 0): z = 0 for all.
        let (r, _, _, _) = run(3, &[true, true, true], &[0.1, 0.1, 0.1], 0.2, 0.5);
        assert!(r.iter().all(|&x| close(x, 0.75)));
    }

    #[test]
    fn ties_keep_batch_order_and_others_get_zero_one() {
        // accuracies (1/2, 1, 1/2, 1): order 1, 3, 0, 2
        let correct = [true, false, true, true, false, true, true, true];
        let lengths = [1.0, 2.0, 10.0, 30.0, 4.0, 5.0, 20.0, 20.0];
        let (r, top, order, k) = run(2, &correct, &lengths, 0.5, 0.6);
        assert_eq!(order, vec![1, 3, 0, 2]);
        assert_eq!((k, top), (2, vec![false, true, false, true]));
        // group 0, 2 are 0/1
        assert_eq!((r[0], r[1], r[4], r[5]), (1.0, 0.0, 0.0, 1.0));
        // group 1: lengths 10, 30 → z = ∓1; group 3: equal → 0.7
        assert!(close(r[2], 0.8386352) && close(r[3], 0.5613648));
        assert!(close(r[6], 0.7) && close(r[7], 0.7));
        // λ = 0.75 → ⌈3⌉ = 3: the first of the tied 1/2 groups (group 0) joins
        let (_, top, _, k) = run(2, &correct, &lengths, 0.75, 0.6);
        assert_eq!((k, top), (3, vec![true, true, false, true]));
    }

    #[test]
    fn permuted_layout_matches_contiguous() {
        // Original positions: group 0 = (T 100, T 300), group 1 = (F 50, T 70).
        // Shuffled rows hold positions [3, 0, 2, 1].
        let index = [3usize, 0, 2, 1];
        let orig_correct = [true, true, false, true];
        let orig_len = [100.0, 300.0, 50.0, 70.0];
        let correct: Vec<bool> = index.iter().map(|&p| orig_correct[p]).collect();
        let lengths: Vec<f64> = index.iter().map(|&p| orig_len[p]).collect();
        let mut inv = [0usize; 4];
        let groups = Groups::permuted(&index, 2, &mut inv).unwrap();
        let (mut order, mut top, mut rew) = ([0usize; 2], [false; 2], [0.0; 4]);
        let params = GrpoLambda {
            lambda_: 0.2,
            alpha: 0.6,
        };
        grpo_lambda_rewards(
            &groups, &correct, &lengths, &params, &mut order, &mut top, &mut rew,
        )
        .unwrap();
        let (want, want_top, _, _) = run(2, &orig_correct, &orig_len, 0.2, 0.6);
        for (row, &p) in index.iter().enumerate() {
            assert_eq!(rew[row], want[p]);
        }
        assert_eq!(top.to_vec(), want_top);
    }

    #[test]
    fn errors() {
        let g = Groups::contiguous(4, 2).unwrap();
        let p = GrpoLambda::<f64>::default();
        let (mut order, mut top, mut rew) = ([0usize; 2], [false; 2], [0.0; 4]);
        let c = [true; 4];
        let l = [1.0; 4];
        assert_eq!(
            grpo_lambda_rewards(
                &g,
                &c,
                &[1.0, f64::NAN, 1.0, 1.0],
                &p,
                &mut order,
                &mut top,
                &mut rew
            ),
            Err(Error::NonFinite {
                what: "lengths",
                index: 1
            })
        );
        assert!(matches!(
            grpo_lambda_rewards(&g, &c, &[1.0, -1.0, 1.0, 1.0], &p, &mut order, &mut top, &mut rew),
            Err(Error::OutOfRange { what: "lengths", value, .. }) if value == -1.0
        ));
        assert!(matches!(
            grpo_lambda_rewards(&g, &c[..3], &l, &p, &mut order, &mut top, &mut rew),
            Err(Error::LengthMismatch {
                what: "correct",
                ..
            })
        ));
        assert!(matches!(
            grpo_lambda_rewards(&g, &c, &l, &p, &mut order[..1], &mut top, &mut rew),
            Err(Error::ScratchTooSmall {
                what: "order",
                needed: 2,
                actual: 1
            })
        ));
        assert!(matches!(
            grpo_lambda_rewards(&g, &c, &l, &p, &mut order, &mut top[..1], &mut rew),
            Err(Error::LengthMismatch { what: "top", .. })
        ));
        let bad = GrpoLambda {
            lambda_: 0.2,
            alpha: 1.5,
        };
        assert!(matches!(
            grpo_lambda_rewards(&g, &c, &l, &bad, &mut order, &mut top, &mut rew),
            Err(Error::OutOfRange { what: "alpha", .. })
        ));
        // empty batch
        let e = Groups::contiguous(0, 2).unwrap();
        assert_eq!(
            grpo_lambda_rewards::<f64>(&e, &[], &[], &p, &mut [], &mut [], &mut []),
            Ok(0)
        );
    }

    fn batch() -> impl Strategy<Value = (usize, Vec<bool>, Vec<f64>)> {
        (1usize..9, 1usize..12).prop_flat_map(|(n, g)| {
            (
                Just(n),
                proptest::collection::vec(any::<bool>(), n * g),
                proptest::collection::vec(prop_oneof![0.0f64..4096.0, Just(128.0)], n * g),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn reward_invariants(
            (n, correct, lengths) in batch(),
            lambda_ in 0.0f64..=1.0,
            alpha in 0.01f64..=1.0,
        ) {
            let (r, top, order, k) = run(n, &correct, &lengths, lambda_, alpha);
            let gcount = correct.len() / n;
            prop_assert_eq!(k, top_group_count(lambda_, gcount).unwrap());
            prop_assert_eq!(top.iter().filter(|&&t| t).count(), k);
            let mut seen = order.clone();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..gcount).collect::<Vec<_>>());
            let acc = |g: usize| correct[g * n..(g + 1) * n].iter().filter(|&&c| c).count();
            for w in order.windows(2) {
                // accuracy descending, ties in batch order
                prop_assert!(acc(w[0]) > acc(w[1]) || (acc(w[0]) == acc(w[1]) && w[0] < w[1]));
            }
            for g in 0..gcount {
                let rows = g * n..(g + 1) * n;
                if top[g] {
                    // top groups dominate in accuracy
                    for h in (0..gcount).filter(|&h| !top[h]) {
                        prop_assert!(acc(g) >= acc(h));
                    }
                    for i in rows.clone() {
                        if correct[i] {
                            prop_assert!(r[i] > 1.0 - alpha && r[i] <= 1.0, "r = {}", r[i]);
                        } else {
                            prop_assert_eq!(r[i], 0.0);
                        }
                        // shorter correct answers never earn less
                        for j in rows.clone() {
                            if correct[i] && correct[j] && lengths[i] < lengths[j] {
                                prop_assert!(r[i] >= r[j]);
                            }
                        }
                    }
                } else {
                    for i in rows {
                        prop_assert_eq!(r[i], if correct[i] { 1.0 } else { 0.0 });
                    }
                }
            }
        }
    }
}
