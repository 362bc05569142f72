//! REINFORCE++ and REINFORCE++-baseline: token rewards → returns-to-go → batch whitening.

use super::token::{check_gamma, fold_rtg_row};
use super::whiten::{WhitenStats, finish, row_moments};
use super::{ResponseTokens, at, baseline::baseline, check_group_rewards, group_moments};
use crate::Groups;
use crate::error::Result;
use crate::lanes::{self, Moments};
use crate::num::{check_finite, check_len};
use num_traits::Float;

/// REINFORCE++ token advantages (docs/algorithms.md §5): token rewards
/// `R_t = −β_t·k_t + [t = last valid]·r` (KL from `tokens.weighted_kl`, if any), returns-to-go
/// `G_t = R_t + γ·G_{t+1}`, then [`masked_whiten`](super::masked_whiten) over the whole batch.
/// `out` is `[rows, cols]`; returns the whitening statistics (of the returns).
///
/// Errors: `rewards.len() ≠ rows`, token lengths → `LengthMismatch`; non-finite reward or KL
/// → `NonFinite`; mask not 0/1 → `InvalidMask`; γ ∉ [0, 1] → `OutOfRange`; a row without
/// valid token → `Empty` (its reward has no token to sit on).
pub fn reinforce_pp_advantages<F: Float>(
    rewards: &[F],
    tokens: ResponseTokens<'_, F>,
    gamma: F,
    out: &mut [F],
) -> Result<WhitenStats<F>> {
    check_len("rewards", tokens.shape.rows, rewards.len())?;
    check_finite("rewards", rewards)?;
    tokens.check(tokens.shape.rows, out.len())?;
    check_gamma(gamma)?;
    let mut acc = Moments::empty();
    for (row, &r) in rewards.iter().enumerate() {
        acc.merge(fold_row(&tokens, row, r, gamma, out)?);
    }
    finish(acc, out, tokens.mask)
}

/// REINFORCE++-baseline token advantages (docs/algorithms.md §5): the group-mean baseline `r − mean_g`
/// ([`reinforce_baseline_advantages`](super::reinforce_baseline_advantages)), then the
/// REINFORCE++ pipeline of [`reinforce_pp_advantages`]: KL folding, returns-to-go with γ, batch
/// whitening. Works on any [`Groups`] layout.
///
/// Errors: as [`reinforce_pp_advantages`], plus n < 2 → `GroupTooSmall("reinforce_baseline")`
/// and `shape.rows` ≠ batch → `LengthMismatch`.
pub fn reinforce_pp_baseline_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    tokens: ResponseTokens<'_, F>,
    gamma: F,
    out: &mut [F],
) -> Result<WhitenStats<F>> {
    check_group_rewards("reinforce_baseline", groups, rewards)?;
    tokens.check(groups.batch(), out.len())?;
    check_gamma(gamma)?;
    let mut acc = Moments::empty();
    for g in 0..groups.count() {
        let gm = group_moments(groups, g, rewards);
        for row in groups.rows_of(g) {
            let score = baseline(&gm, at(rewards, row));
            acc.merge(fold_row(&tokens, row, score, gamma, out)?);
        }
    }
    finish(acc, out, tokens.mask)
}

/// Folds and accumulates one row; its moments are taken while the row is in cache.
fn fold_row<F: Float>(
    tokens: &ResponseTokens<'_, F>,
    row: usize,
    score: F,
    gamma: F,
    out: &mut [F],
) -> Result<Moments<F>> {
    fold_rtg_row(tokens, row, score, gamma, out)?;
    let cols = tokens.shape.cols;
    Ok(row_moments(
        lanes::row(out, cols, row),
        lanes::row(tokens.mask, cols, row),
    )
    .0)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::advantage::{
        masked_whiten, reinforce_baseline_advantages, returns_to_go_in_place, token_level_rewards,
    };
    use crate::{Error, Shape};
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    #[test]
    fn reinforce_pp_hand_checked() {
        // rows: r = (1, 0), lengths (2, 1), no KL, γ = 1 → returns (1, 1 | 0):
        // μ = 2/3, var = (2·(1/3)² + (2/3)²)/3 = 2/9; A = (±…)/√(2/9)
        let shape = Shape::new(2, 2);
        let mask = [1.0, 1.0, 1.0, 0.0];
        let mut out = [9.0; 4];
        let st = reinforce_pp_advantages(
            &[1.0, 0.0],
            ResponseTokens::new(shape, &mask),
            1.0,
            &mut out,
        )
        .unwrap();
        assert!((st.mean - 2.0 / 3.0).abs() < 1e-15 && (st.var - 2.0 / 9.0).abs() < 1e-15);
        let s = (2.0f64 / 9.0).sqrt();
        let want = [(1.0 / 3.0) / s, (1.0 / 3.0) / s, (-2.0 / 3.0) / s, 0.0];
        for (a, b) in out.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        assert_eq!(
            reinforce_pp_advantages(&[1.0], ResponseTokens::new(shape, &mask), 1.0, &mut out),
            Err(Error::LengthMismatch {
                what: "rewards",
                expected: 2,
                actual: 1
            })
        );
        assert_eq!(
            reinforce_pp_baseline_advantages(
                &Groups::contiguous(2, 1).unwrap(),
                &[1.0, 0.0],
                ResponseTokens::new(shape, &mask),
                1.0,
                &mut out
            ),
            Err(Error::GroupTooSmall {
                estimator: "reinforce_baseline",
                n: 1
            })
        );
    }

    proptest! {
        /// The composed calls equal the separate steps.
        #[test]
        fn composed_equals_steps(
            cols in 1usize..90,
            gamma in prop::sample::select(vec![1.0f64, 0.95]),
            with_kl in any::<bool>(),
            seed in proptest::collection::vec((0.0f64..0.3, 0u8..4), 360),
            r in proptest::collection::vec(-1.0f64..1.0, 4),
        ) {
            let rows = 4;
            let shape = Shape::new(rows, cols);
            let n = rows * cols;
            let wk: Vec<f64> = seed.iter().cycle().take(n).map(|s| s.0).collect();
            let mut m: Vec<f64> = seed.iter().cycle().take(n).map(|s| (s.1 != 0) as u8 as f64).collect();
            for row in 0..rows { m[row * cols] = 1.0; }
            let toks = if with_kl { ResponseTokens::new(shape, &m).with_kl(&wk) } else { ResponseTokens::new(shape, &m) };
            let groups = Groups::contiguous(rows, 2).unwrap();
            // baseline
            let mut out = vec![0.0; n];
            let st = reinforce_pp_baseline_advantages(&groups, &r, toks, gamma, &mut out).unwrap();
            let mut scores = [0.0; 4];
            reinforce_baseline_advantages(&groups, &r, &mut scores).unwrap();
            let mut want = vec![0.0; n];
            token_level_rewards(shape, &scores, &m, toks.weighted_kl, &mut want).unwrap();
            returns_to_go_in_place(shape, &mut want, &m, gamma).unwrap();
            let st2 = masked_whiten(shape, &mut want, &m).unwrap();
            prop_assert!((st.mean - st2.mean).abs() < 1e-12 && (st.var - st2.var).abs() < 1e-10);
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() < 1e-6, "{} vs {}", a, b);
            }
            // plain REINFORCE++
            reinforce_pp_advantages(&r, toks, gamma, &mut out).unwrap();
            token_level_rewards(shape, &r, &m, toks.weighted_kl, &mut want).unwrap();
            returns_to_go_in_place(shape, &mut want, &m, gamma).unwrap();
            masked_whiten(shape, &mut want, &m).unwrap();
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() < 1e-6, "{} vs {}", a, b);
            }
        }
    }
}
