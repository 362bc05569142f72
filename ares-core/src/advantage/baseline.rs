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
    use super::*;
    use crate::Error;

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
}
