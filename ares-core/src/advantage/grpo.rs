//! GRPO and Dr.GRPO: group-normalised outcome advantages.

use super::{GroupMoments, check_group_rewards, per_sample};
use crate::error::Result;
use crate::num::{cast, check_param};
use crate::{Groups, Shape};
use num_traits::Float;

/// GRPO's ε in `(r − mean_g)/(std_g + ε)`.
pub const GRPO_EPSILON: f64 = 1e-6;

/// Options of GRPO.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoConfig<F> {
    /// `true` (default): divide by `std_g + epsilon` (GRPO). `false`: Dr.GRPO, `r − mean_g`.
    pub norm_adv_by_std: bool,
    /// ε added to the standard deviation; finite, ≥ 0 (default [`GRPO_EPSILON`]).
    pub epsilon: F,
}

impl<F: Float> Default for GrpoConfig<F> {
    fn default() -> Self {
        GrpoConfig {
            norm_adv_by_std: true,
            epsilon: cast(GRPO_EPSILON),
        }
    }
}

impl<F: Float> GrpoConfig<F> {
    /// Dr.GRPO: no division by the standard deviation.
    pub fn dr_grpo() -> Self {
        GrpoConfig {
            norm_adv_by_std: false,
            ..Self::default()
        }
    }

    /// The estimator's name in errors: `"grpo"` or `"dr_grpo"`.
    pub fn estimator(&self) -> &'static str {
        if self.norm_adv_by_std {
            "grpo"
        } else {
            "dr_grpo"
        }
    }

    /// Checks ε (finite, ≥ 0), as every GRPO function does first.
    ///
    /// Errors: `OutOfRange` naming `"grpo epsilon"`.
    pub fn check(&self) -> Result<()> {
        check_param(
            "grpo epsilon",
            self.epsilon,
            self.epsilon >= F::zero(),
            ">= 0",
        )
    }

    #[inline]
    fn advantage(&self, gm: &GroupMoments<F>, r: F) -> F {
        if gm.all_equal {
            F::zero()
        } else if self.norm_adv_by_std {
            (r - gm.mean) / (gm.std_unbiased() + self.epsilon)
        } else {
            r - gm.mean
        }
    }
}

/// GRPO outcome advantages, one per sample:
/// `A_i = (r_i − mean_g)/(std_g + ε)` with the unbiased (n − 1) standard deviation of the
/// sample's group, or Dr.GRPO's `A_i = r_i − mean_g` when `cfg.norm_adv_by_std` is false.
///
/// A group whose rewards are all equal gets exactly 0. `out[row]` is the advantage of the
/// sample at `row` (any [`Groups`] layout). Spec vector: r = (1, 0, 0, 1), one group →
/// ±0.5/(√(1/3) + 1e−6) = (0.8660239, −0.8660239, −0.8660239, 0.8660239).
///
/// Errors: n < 2 → `GroupTooSmall` (`"grpo"` / `"dr_grpo"`); `rewards` or `out` not of the
/// batch length → `LengthMismatch`; non-finite reward → `NonFinite`; ε < 0 or not finite →
/// `OutOfRange`.
pub fn grpo_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    cfg: &GrpoConfig<F>,
    out: &mut [F],
) -> Result<()> {
    check_group_rewards(cfg.estimator(), groups, rewards)?;
    cfg.check()?;
    groups.check_batch("out", out.len())?;
    per_sample(groups, rewards, out, |gm, r| cfg.advantage(gm, r));
    Ok(())
}

/// Dr.GRPO outcome advantages `A_i = r_i − mean_g` ([`grpo_advantages`] with
/// `norm_adv_by_std = false`; errors name `"dr_grpo"`).
pub fn dr_grpo_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    out: &mut [F],
) -> Result<()> {
    grpo_advantages(groups, rewards, &GrpoConfig::dr_grpo(), out)
}

/// GRPO / Dr.GRPO token advantages: the per-sample advantage of [`grpo_advantages`]
/// broadcast over the sample's row, `A_{r,t} = A_r · m_{r,t}` (`out` is `[rows, cols]`,
/// rows = batch).
///
/// GRPO keeps KL out of the reward (it is a loss term); to fold a KL penalty in verl's way,
/// subtract the per-row `row_weighted_sum` of [`crate::kl::token_kl`] from the rewards first.
///
/// Errors: as [`grpo_advantages`], plus `shape.rows` ≠ batch or `mask`/`out` ≠ rows × cols →
/// `LengthMismatch`, mask not 0/1 → `InvalidMask`.
pub fn grpo_token_advantages<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    shape: Shape,
    mask: &[F],
    cfg: &GrpoConfig<F>,
    out: &mut [F],
) -> Result<()> {
    check_group_rewards(cfg.estimator(), groups, rewards)?;
    cfg.check()?;
    let tokens = super::ResponseTokens::new(shape, mask);
    tokens.check(groups.batch(), out.len())?;
    super::token::broadcast_groups(groups, rewards, &tokens, out, |gm, r| cfg.advantage(gm, r))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::Error;
    use proptest::prelude::*;
    use std::vec;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn spec_vector_7_grpo() {
        // mean 0.5, unbiased std √((4·0.25)/3) = 0.5773503; 0.5/(0.5773503 + 1e−6) = 0.8660239
        let g = Groups::contiguous(4, 4).unwrap();
        let mut out = [0.0; 4];
        grpo_advantages(&g, &[1.0, 0.0, 0.0, 1.0], &GrpoConfig::default(), &mut out).unwrap();
        for (a, w) in out
            .iter()
            .zip([0.8660239, -0.8660239, -0.8660239, 0.8660239])
        {
            assert!(close(*a, w, 5e-8), "{a} vs {w}");
        }
        let mut out32 = [0.0f32; 4];
        grpo_advantages(
            &g,
            &[1.0f32, 0.0, 0.0, 1.0],
            &GrpoConfig::default(),
            &mut out32,
        )
        .unwrap();
        assert!(close(out32[0] as f64, 0.8660239, 1e-6));
    }

    #[test]
    fn dr_grpo_and_constant_groups() {
        // group 0: mean 2 → (−1, 1); group 1 constant 0.1 → exactly 0 (no 1/ε blow-up)
        let g = Groups::contiguous(4, 2).unwrap();
        let r = [1.0, 3.0, 0.1, 0.1];
        let mut out = [9.0; 4];
        dr_grpo_advantages(&g, &r, &mut out).unwrap();
        assert_eq!(out, [-1.0, 1.0, 0.0, 0.0]);
        let r32 = [0.7f32, 0.7, 0.7, 0.7];
        let mut o32 = [9.0f32; 4];
        grpo_advantages(
            &Groups::contiguous(4, 4).unwrap(),
            &r32,
            &GrpoConfig::default(),
            &mut o32,
        )
        .unwrap();
        assert_eq!(o32, [0.0; 4]);
    }

    #[test]
    fn errors() {
        let g1 = Groups::contiguous(3, 1).unwrap();
        let mut out = [0.0; 3];
        assert_eq!(
            grpo_advantages(&g1, &[1.0, 2.0, 3.0], &GrpoConfig::default(), &mut out),
            Err(Error::GroupTooSmall {
                estimator: "grpo",
                n: 1
            })
        );
        assert_eq!(
            dr_grpo_advantages(&g1, &[1.0, 2.0, 3.0], &mut out),
            Err(Error::GroupTooSmall {
                estimator: "dr_grpo",
                n: 1
            })
        );
        let g = Groups::contiguous(4, 2).unwrap();
        assert_eq!(
            grpo_advantages(&g, &[1.0, 2.0, 3.0], &GrpoConfig::default(), &mut [0.0; 4]),
            Err(Error::LengthMismatch {
                what: "rewards",
                expected: 4,
                actual: 3
            })
        );
        assert_eq!(
            grpo_advantages(
                &g,
                &[1.0, f64::NAN, 3.0, 0.0],
                &GrpoConfig::default(),
                &mut [0.0; 4]
            ),
            Err(Error::NonFinite {
                what: "rewards",
                index: 1
            })
        );
        let bad = GrpoConfig {
            norm_adv_by_std: true,
            epsilon: -1.0,
        };
        assert!(matches!(
            grpo_advantages(&g, &[1.0, 2.0, 3.0, 0.0], &bad, &mut [0.0; 4]),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            grpo_advantages(
                &g,
                &[1.0, 2.0, 3.0, 0.0],
                &GrpoConfig::default(),
                &mut [0.0; 3]
            ),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
    }

    #[test]
    fn token_broadcast() {
        // A = (0.7071057, −0.7071057) for r = (1, 0): 0.5/(√0.5 + 1e−6)
        let g = Groups::contiguous(2, 2).unwrap();
        let shape = Shape::new(2, 3);
        let mask = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let mut out = [9.0; 6];
        grpo_token_advantages(
            &g,
            &[1.0, 0.0],
            shape,
            &mask,
            &GrpoConfig::default(),
            &mut out,
        )
        .unwrap();
        let a = 0.5 / (0.5f64.sqrt() + 1e-6);
        assert_eq!(out, [a, a, 0.0, -a, 0.0, 0.0]);
        assert!(matches!(
            grpo_token_advantages(
                &g,
                &[1.0, 0.0],
                shape,
                &[1.0, 0.5, 0.0, 1.0, 0.0, 0.0],
                &GrpoConfig::default(),
                &mut out
            ),
            Err(Error::InvalidMask {
                what: "mask",
                index: 1
            })
        ));
    }

    proptest! {
        #[test]
        fn grpo_mean_zero_per_nonconstant_group(
            r in proptest::collection::vec(-5.0f64..5.0, 12),
            n in prop::sample::select(vec![2usize, 3, 4, 6]),
        ) {
            let g = Groups::contiguous(12, n).unwrap();
            let mut out = [0.0; 12];
            grpo_advantages(&g, &r, &GrpoConfig::default(), &mut out).unwrap();
            for c in out.chunks(n) {
                let s: f64 = c.iter().sum();
                prop_assert!(s.abs() < 1e-9, "group sum {}", s);
            }
            // Dr.GRPO too
            dr_grpo_advantages(&g, &r, &mut out).unwrap();
            for c in out.chunks(n) {
                prop_assert!(c.iter().sum::<f64>().abs() < 1e-9);
            }
        }
    }
}
