//! RLOO: the leave-one-out baseline.

use super::{GroupMoments, ResponseTokens, check_group_rewards, per_sample};
use crate::Groups;
use crate::error::Result;
use num_traits::Float;

/// RLOO advantage of one sample, `r − (Σ_g r − r)/(n − 1)`, computed as the algebraically
/// equal `(r − mean_g)·n/(n − 1)`, whose group sum cancels to rounding; exactly 0 for a group
/// of equal rewards.
#[inline]
pub(crate) fn rloo<F: Float>(gm: &GroupMoments<F>, r: F) -> F {
    if gm.all_equal {
        F::zero()
    } else {
        (r - gm.mean) * (gm.n / (gm.n - F::one()))
    }
}

/// RLOO advantages, one per sample: `A_i = r_i − (Σ_{j∈g} r_j − r_i)/(n − 1)`, the reward
/// minus the mean of the other samples of its group. They sum to 0 over each group. A group
/// of equal rewards gets exactly 0.
///
/// Spec vector: r = (1, 0, 0, 0) → (1 − 0, 0 − 1/3, …) = (1.0, −1/3, −1/3, −1/3).
///
/// Errors: n < 2 → `GroupTooSmall("rloo")`; `rewards`/`out` not of the batch length →
/// `LengthMismatch`; non-finite reward → `NonFinite`.
pub fn rloo_advantages<F: Float>(groups: &Groups<'_>, rewards: &[F], out: &mut [F]) -> Result<()> {
    check_group_rewards("rloo", groups, rewards)?;
    groups.check_batch("out", out.len())?;
    per_sample(groups, rewards, out, rloo);
    Ok(())
}

/// RLOO token advantages (OpenRLHF's `rloo`): the RLOO advantage r̃ of each sample is folded
/// with the optional weighted KL into token rewards `R_t = −β_t·k_t + [t = last]·r̃` and
/// turned into returns-to-go with γ = 1: `A_t = m_t·(r̃ + Σ_{u ≥ t} −β_u·k_u·m_u)`. Without KL
/// this is r̃ on every valid token up to the row's last one. No whitening.
///
/// Errors: as [`rloo_advantages`], plus shape/mask/KL/out lengths (`LengthMismatch`), mask not
/// 0/1, non-finite KL, and a row without valid token (`Empty`: its reward has no token to
/// sit on).
pub fn rloo_token_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    tokens: ResponseTokens<'_, F>,
    out: &mut [F],
) -> Result<()> {
    check_group_rewards("rloo", groups, rewards)?;
    tokens.check(groups.batch(), out.len())?;
    for g in 0..groups.count() {
        let gm = super::group_moments(groups, g, rewards);
        for row in groups.rows_of(g) {
            let score = rloo(&gm, super::at(rewards, row));
            super::token::fold_rtg_row(&tokens, row, score, F::one(), out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::{Error, Shape};
    use proptest::prelude::*;
    use std::vec;

    #[test]
    fn spec_vector_7_rloo() {
        // baselines (0, 1/3, 1/3, 1/3): 1 − 0 = 1, 0 − 1/3
        let g = Groups::contiguous(4, 4).unwrap();
        let mut out = [0.0; 4];
        rloo_advantages(&g, &[1.0, 0.0, 0.0, 0.0], &mut out).unwrap();
        let third = 1.0 / 3.0;
        for (a, w) in out.iter().zip([1.0, -third, -third, -third]) {
            assert!((a - w).abs() < 1e-15, "{a} vs {w}");
        }
    }

    #[test]
    fn token_level_with_kl() {
        // one group of 2, r = (1, 0) → r̃ = (1, −1); row 0 has KL 0.1 at t = 1 (valid
        // t = 0, 1): A = (1 − 0.1, 1 − 0.1, 0); row 1 valid t = 0: A = −1
        let g = Groups::contiguous(2, 2).unwrap();
        let shape = Shape::new(2, 3);
        let mask = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let wk = [0.0, 0.1, 0.0, 0.0, 0.0, 0.0];
        let mut out = [9.0; 6];
        rloo_token_advantages(
            &g,
            &[1.0, 0.0],
            ResponseTokens::new(shape, &mask).with_kl(&wk),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0.9, 0.9, 0.0, -1.0, 0.0, 0.0]);
        assert_eq!(
            rloo_token_advantages(
                &g,
                &[1.0, 0.0],
                ResponseTokens::new(shape, &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
                &mut out,
            ),
            Err(Error::Empty {
                what: "mask row (no valid token to carry the sequence reward)"
            })
        );
        assert_eq!(
            rloo_advantages(
                &Groups::contiguous(2, 1).unwrap(),
                &[1.0, 0.0],
                &mut [0.0; 2]
            ),
            Err(Error::GroupTooSmall {
                estimator: "rloo",
                n: 1
            })
        );
    }

    proptest! {
        #[test]
        fn rloo_sums_to_zero_per_group(
            r in proptest::collection::vec(-10.0f64..10.0, 12),
            n in prop::sample::select(vec![2usize, 3, 4, 6, 12]),
        ) {
            let g = Groups::contiguous(12, n).unwrap();
            let mut out = [0.0; 12];
            rloo_advantages(&g, &r, &mut out).unwrap();
            for (c, rc) in out.chunks(n).zip(r.chunks(n)) {
                prop_assert!(c.iter().sum::<f64>().abs() < 1e-9);
                // the literal formula r − (Σ − r)/(n − 1)
                let s: f64 = rc.iter().sum();
                for (a, x) in c.iter().zip(rc) {
                    let lit = x - (s - x) / (n as f64 - 1.0);
                    prop_assert!((a - lit).abs() < 1e-9, "{} vs {}", a, lit);
                }
            }
        }
    }
}
