//! REINFORCE++-baseline: the group mean as baseline.

use super::{check_group_rewards, per_sample};
use crate::Groups;
use crate::error::Result;
use num_traits::Float;

/// REINFORCE++-baseline scalar advantages `A_i = r_i − mean_g` (exactly 0 for a group of
/// equal rewards); the token-level estimator then folds KL, takes returns-to-go and whitens
/// the batch ([`super::reinforce_pp_baseline_advantages`]).
///
/// Errors: n < 2 → `GroupTooSmall("reinforce_baseline")`; `rewards`/`out` not of the batch
/// length → `LengthMismatch`; non-finite reward → `NonFinite`.
pub fn reinforce_baseline_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    out: &mut [F],
) -> Result<()> {
    check_group_rewards("reinforce_baseline", groups, rewards)?;
    groups.check_batch("out", out.len())?;
    per_sample(groups, rewards, out, baseline);
    Ok(())
}

/// `r − mean_g`, exactly 0 for a group of equal rewards.
#[inline]
pub(crate) fn baseline<F: Float>(gm: &super::GroupMoments<F>, r: F) -> F {
    if gm.all_equal { F::zero() } else { r - gm.mean }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::advantage::{
        GrpoConfig, ResponseTokens, grpo_advantages, reinforce_pp_baseline_advantages,
        rloo_advantages,
    };
    use crate::{Error, Shape};
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    #[test]
    fn mean_baseline() {
        // means 0.5 and 2: (0.5, −0.5 | −1, 1)
        let g = Groups::contiguous(4, 2).unwrap();
        let mut out = [0.0; 4];
        reinforce_baseline_advantages(&g, &[1.0, 0.0, 1.0, 3.0], &mut out).unwrap();
        assert_eq!(out, [0.5, -0.5, -1.0, 1.0]);
        assert_eq!(
            reinforce_baseline_advantages(
                &Groups::contiguous(2, 1).unwrap(),
                &[1.0, 0.0],
                &mut out[..2]
            ),
            Err(Error::GroupTooSmall {
                estimator: "reinforce_baseline",
                n: 1
            })
        );
    }

    /// A random permutation of `0..n` from proptest's RNG.
    fn shuffled(n: usize) -> impl Strategy<Value = Vec<usize>> {
        Just(()).prop_perturb(move |_, mut rng| {
            let mut p: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                p.swap(i, rng.random_range(0..=i));
            }
            p
        })
    }

    proptest! {
        /// Every scalar group estimator, and REINFORCE++-baseline at token level, gives on a
        /// shuffled batch (with its index) the contiguous result of the un-shuffled batch.
        #[test]
        fn permuted_layout_equals_contiguous(
            n in 2usize..5,
            rewards in proptest::collection::vec(-2.0f64..2.0, 12),
            index in shuffled(12),
        ) {
            let rows = 12 / n * n;
            let index: Vec<usize> = index.into_iter().filter(|&p| p < rows).collect();
            let r = &rewards[..rows];
            let g = Groups::contiguous(rows, n).unwrap();
            let mut inv = vec![0; rows];
            let pg = Groups::permuted(&index, n, &mut inv).unwrap();
            // row `row` of the shuffled batch holds original sample index[row]
            let pr: Vec<f64> = index.iter().map(|&p| r[p]).collect();
            type Scalar = fn(&Groups<'_>, &[f64], &mut [f64]) -> crate::Result<()>;
            let grpo: Scalar = |g, r, o| grpo_advantages(g, r, &GrpoConfig::default(), o);
            for f in [grpo, rloo_advantages, reinforce_baseline_advantages] {
                let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
                f(&g, r, &mut a).unwrap();
                f(&pg, &pr, &mut b).unwrap();
                for (row, &p) in index.iter().enumerate() {
                    prop_assert_eq!(b[row], a[p]);
                }
            }
            // token level, 3 tokens per row, the last one padded
            let shape = Shape::new(rows, 3);
            let mask: Vec<f64> = (0..rows * 3).map(|i| (i % 3 != 2) as u8 as f64).collect();
            let (mut a, mut b) = (vec![0.0; rows * 3], vec![0.0; rows * 3]);
            let sa = reinforce_pp_baseline_advantages(&g, r, ResponseTokens::new(shape, &mask), 1.0, &mut a);
            let sb = reinforce_pp_baseline_advantages(&pg, &pr, ResponseTokens::new(shape, &mask), 1.0, &mut b);
            prop_assert_eq!(sa.is_ok(), sb.is_ok());
            if let (Ok(sa), Ok(sb)) = (sa, sb) {
                prop_assert!((sa.mean - sb.mean).abs() < 1e-12 && (sa.var - sb.var).abs() < 1e-12);
                for (row, &p) in index.iter().enumerate() {
                    for t in 0..3 {
                        prop_assert!((b[row * 3 + t] - a[p * 3 + t]).abs() < 1e-9);
                    }
                }
            }
        }
    }
}
