//! Advantages of a step (docs/algorithms.md §5), by estimator, as `[rows, T]` token values.

use ares_core::Groups;
use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ResponseTokens, grpo_token_advantages, kl_folded_scores,
    reinforce_pp_advantages, reinforce_pp_baseline_advantages, reinforce_pro_max,
    rloo_token_advantages,
};

use crate::trainer::TrainError;
use crate::trainer::collect::tokens::TokenBatch;

/// The advantage estimator and its options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Estimator {
    /// GRPO (`norm_by_std`) or Dr.GRPO.
    Grpo {
        /// Divide by the group's std (GRPO) or not (Dr.GRPO).
        norm_by_std: bool,
    },
    /// RLOO.
    Rloo,
    /// REINFORCE++: return-to-go with γ and batch whitening.
    Reinforce {
        /// Discount γ.
        gamma: f32,
    },
    /// REINFORCE++-baseline: group mean baseline, then as REINFORCE++.
    ReinforceBaseline {
        /// Discount γ.
        gamma: f32,
    },
    /// REINFORCE Pro Max (γ is 1 by definition).
    ProMax(ProMaxConfig<f32>),
}

/// Token advantages and their statistics over valid tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// `[rows, T]`, 0 on padding.
    pub values: Vec<f32>,
    /// Mean over valid tokens.
    pub mean: f64,
    /// Population std over valid tokens.
    pub std: f64,
}

/// Advantages of `rewards` (one per row; rows `g·n … g·n + n − 1` form group `g`) over the
/// response tokens of `tokens`. `weighted_kl` (`β_t·k_t`, `[rows, T]`) folds the KL into the
/// rewards (`use_kl_loss = false`): per token for the token-level estimators, as its row sum
/// subtracted from the reward for GRPO.
///
/// # Errors
/// n = 1 with a group estimator, non-finite rewards, empty responses where a reward needs a
/// token to sit on, shape mismatches.
pub fn compute(
    estimator: Estimator,
    n: usize,
    rewards: &[f32],
    tokens: &TokenBatch,
    weighted_kl: Option<&[f32]>,
) -> Result<Advantages, TrainError> {
    let rows = tokens.rows();
    let mut values = vec![0.0f32; rows * tokens.cols()];
    let mut resp = ResponseTokens::new(tokens.shape, &tokens.mask);
    if let Some(kl) = weighted_kl {
        resp = resp.with_kl(kl);
    }
    let groups = || Groups::contiguous(rows, n);
    match estimator {
        Estimator::Grpo { norm_by_std } => {
            let cfg = if norm_by_std {
                GrpoConfig::default()
            } else {
                GrpoConfig::dr_grpo()
            };
            // with KL in the reward, the group statistics see r − Σ_t β_t·k_t
            let mut scores = vec![0.0f32; rows];
            kl_folded_scores(rewards, resp, &mut scores)?;
            let rewards = scores;
            grpo_token_advantages(
                &groups()?,
                &rewards,
                tokens.shape,
                &tokens.mask,
                &cfg,
                &mut values,
            )?;
        }
        Estimator::Rloo => rloo_token_advantages(&groups()?, rewards, resp, &mut values)?,
        Estimator::Reinforce { gamma } => {
            reinforce_pp_advantages(rewards, resp, gamma, &mut values)?;
        }
        Estimator::ReinforceBaseline { gamma } => {
            reinforce_pp_baseline_advantages(&groups()?, rewards, resp, gamma, &mut values)?;
        }
        Estimator::ProMax(cfg) => {
            reinforce_pro_max(&groups()?, rewards, resp, &cfg, None, &mut values)?;
        }
    }
    let (mut s, mut s2, mut k) = (0.0f64, 0.0f64, 0usize);
    for (&a, &m) in values.iter().zip(&tokens.mask) {
        if m != 0.0 {
            s += f64::from(a);
            s2 += f64::from(a) * f64::from(a);
            k += 1;
        }
    }
    let mean = if k > 0 { s / k as f64 } else { 0.0 };
    let std = if k > 0 {
        (s2 / k as f64 - mean * mean).max(0.0).sqrt()
    } else {
        0.0
    };
    Ok(Advantages { values, mean, std })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn grpo_spec_vector_7() {
        let t = TokenBatch::from_lengths(&[1, 1, 1, 1]);
        let a = compute(
            Estimator::Grpo { norm_by_std: true },
            4,
            &[1.0, 0.0, 0.0, 1.0],
            &t,
            None,
        )
        .unwrap();
        close(&a.values, &[0.8660239, -0.8660239, -0.8660239, 0.8660239]);
    }

    #[test]
    fn rloo_and_pro_max_spec_vectors() {
        let t = TokenBatch::from_lengths(&[1, 1, 1, 1]);
        let a = compute(Estimator::Rloo, 4, &[1.0, 0.0, 0.0, 0.0], &t, None).unwrap();
        close(&a.values, &[1.0, -1.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0]);
        let t = TokenBatch::from_lengths(&[2, 3]);
        let a = compute(
            Estimator::ProMax(ProMaxConfig::default()),
            2,
            &[1.0, 0.0],
            &t,
            None,
        )
        .unwrap();
        close(
            &a.values,
            &[
                1.2247449, 1.2247449, 0.0, -0.8164966, -0.8164966, -0.8164966,
            ],
        );
    }

    #[test]
    fn one_sample_groups_are_an_error_naming_the_estimator() {
        let t = TokenBatch::from_lengths(&[1, 1]);
        let e = compute(Estimator::Rloo, 1, &[1.0, 0.0], &t, None).unwrap_err();
        assert!(e.to_string().contains("rloo"), "{e}");
    }

    #[test]
    fn grpo_folds_kl_into_the_reward() {
        let t = TokenBatch::from_lengths(&[1, 1]);
        let with = compute(
            Estimator::Grpo { norm_by_std: false },
            2,
            &[1.0, 1.0],
            &t,
            Some(&[0.5, 0.0]),
        )
        .unwrap();
        close(&with.values, &[-0.25, 0.25]);
    }
}
