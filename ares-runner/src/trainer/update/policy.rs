//! The actor's loss on one micro-batch (docs/algorithms.md §4, §6, §16), core's
//! [`actor_loss`]: the policy loss chosen by `worker.actor.policy_loss` (PPO clip / dual clip,
//! GSPO, GSPO-token, CISPO, Clip-Cov, KL-Cov) plus, with `use_kl_loss`, the dynamic
//! token-level KL term `agg(β_t·k_t)` and the entropy bonus, returned with `∂L/∂logπ_t` (and
//! `∂L/∂H_t`) per token — the coefficients the model's loss head turns into `dlogits`.
//!
//! Clip-Cov and KL-Cov compute their token covariances and token budget over one
//! micro-batch, as verl does.
//!
//! Micro-batches: a mini-batch's loss is the aggregate over all its rows; every mode of
//! [`LossAggMode`] splits into micro-batch aggregates times a constant `scale` (the
//! micro-batch's share of the mini-batch's valid tokens for `token-mean`, of its non-empty
//! rows for the three `seq-mean` modes — `seq-mean-token-sum-norm` divides by `R·T` and every
//! micro-batch of a step shares `T` — and 1 for `token-sum`), so gradient accumulation
//! reproduces the full-batch gradient exactly.

use ares_core::Shape;
use ares_core::loss::{
    ActorLoss, ClipCovParams, EntropyTerm, KlTerm, LossAggMode, PolicyLossConfig, PolicyLossInput,
    actor_loss,
};

use crate::trainer::TrainError;

/// Which policy loss a micro-batch takes (`worker.actor.policy_loss`), with its own
/// parameters; the clip, aggregation and importance correction come from
/// [`PolicyLossConfig`]. Clip-Cov's `seed` is replaced per micro-batch (see [`micro_loss`]).
pub type Objective = ares_core::loss::Objective<f32>;

/// The KL loss term's setting (`β` per row, the HWE mask of dynamic KL, logπ_ref).
pub type KlLoss<'a> = KlTerm<'a, f32>;

/// The terms a micro-batch's loss adds to its policy loss.
#[derive(Debug, Clone, Copy, Default)]
pub struct Terms<'a> {
    /// The KL loss term (with `use_kl_loss`).
    pub kl: Option<KlLoss<'a>>,
    /// The entropy bonus `−c·agg(H_t)` (docs/algorithms.md §16.2).
    pub entropy: Option<EntropyTerm<'a, f32>>,
}

/// The token tensors of one micro-batch, `[rows, T]`.
#[derive(Debug, Clone, Copy)]
pub struct MicroBatch<'a> {
    /// `[rows, T]`.
    pub shape: Shape,
    /// 0/1 response mask.
    pub mask: &'a [f32],
    /// logπ under the current weights.
    pub logp: &'a [f32],
    /// logπ_old (the policy that made the batch, at training time).
    pub logp_old: &'a [f32],
    /// logπ of the sampler (for the importance correction; `None` when it is off).
    pub logp_rollout: Option<&'a [f32]>,
    /// Token advantages.
    pub advantages: &'a [f32],
    /// Forking-token mask, 1 where the policy gradient is kept (`None`: every token;
    /// docs/algorithms.md §16.1).
    pub forking: Option<&'a [f32]>,
}

/// Loss values and metrics of one micro-batch (already multiplied by `scale`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MicroLoss {
    /// Policy-gradient loss.
    pub pg_loss: f64,
    /// KL loss term (0 without `use_kl_loss`).
    pub kl_loss: f64,
    /// Clip fraction over valid tokens (not scaled).
    pub clipfrac: f64,
    /// Dual-clip fraction over valid tokens (not scaled).
    pub clipfrac_lower: f64,
    /// Mean of `−clamp(logπ − logπ_old)` over valid tokens (not scaled).
    pub ppo_kl: f64,
    /// Fraction of valid tokens selected by Clip-Cov / KL-Cov (not scaled; 0 otherwise).
    pub selected_frac: f64,
    /// Valid tokens.
    pub tokens: usize,
    /// With an entropy bonus: the micro-batch's share of `agg(H)`, `scale·agg(H)` (0
    /// otherwise).
    pub entropy: f64,
    /// With an entropy bonus: its loss term `−c·agg(H)` share (0 otherwise).
    pub entropy_loss: f64,
}

/// `scale` of a micro-batch (see the module docs): its valid tokens and non-empty rows
/// against the mini-batch's.
pub fn micro_scale(
    mode: LossAggMode,
    micro_tokens: usize,
    mini_tokens: usize,
    micro_rows: usize,
    mini_rows: usize,
) -> f32 {
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f32 / b as f32 };
    match mode {
        LossAggMode::TokenMean => ratio(micro_tokens, mini_tokens),
        LossAggMode::TokenSum => 1.0,
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenMean
        | LossAggMode::SeqMeanTokenSumNorm => ratio(micro_rows, mini_rows),
    }
}

/// Loss of one micro-batch (core's [`actor_loss`]): `coeffs[t] = scale · ∂L/∂logπ_t` and,
/// with an entropy bonus, `entropy_grad[t] = scale · ∂L/∂H_t` (`[rows, T]`, 0 on padding).
/// `seed` picks Clip-Cov's tokens (the caller derives it from the optimizer step and the
/// micro-batch, so a resumed run selects the same tokens). `entropy_loss` is left 0 (the
/// caller knows the coefficient at full precision).
///
/// # Errors
/// Non-finite inputs under the mask, a micro-batch without a valid token, bad parameters.
pub fn micro_loss(
    batch: &MicroBatch<'_>,
    config: &PolicyLossConfig<f32>,
    objective: &Objective,
    seed: u64,
    terms: Terms<'_>,
    scale: f32,
    (coeffs, entropy_grad): (&mut [f32], Option<&mut [f32]>),
) -> Result<MicroLoss, TrainError> {
    let input = PolicyLossInput {
        shape: batch.shape,
        logp: batch.logp,
        logp_old: batch.logp_old,
        advantages: batch.advantages,
        mask: batch.mask,
        logp_rollout: batch.logp_rollout,
    };
    let objective = match *objective {
        Objective::ClipCov(params) => Objective::ClipCov(ClipCovParams { seed, ..params }),
        other => other,
    };
    let loss = ActorLoss {
        objective,
        config: *config,
        keep: batch.forking,
        kl: terms.kl,
        entropy: terms.entropy,
        scale,
    };
    let n = coeffs.len();
    let mut scratch = vec![0.0f32; if terms.kl.is_some() { 2 * n } else { 0 }];
    let mut index_scratch = vec![0usize; if objective.selects_tokens() { n } else { 0 }];
    let out = actor_loss(
        &input,
        &loss,
        coeffs,
        entropy_grad,
        &mut scratch,
        &mut index_scratch,
    )?;
    Ok(MicroLoss::scaled(&out, scale))
}

impl MicroLoss {
    /// A micro-batch's values from its [`actor_loss`] output: the losses and `agg(H)` times
    /// `scale`, the metrics as they are; `entropy_loss` 0 (the caller knows the coefficient
    /// at full precision).
    pub fn scaled(out: &ares_core::loss::ActorLossOutput<f32>, scale: f32) -> Self {
        let s = f64::from(scale);
        let p = &out.policy;
        MicroLoss {
            pg_loss: f64::from(p.loss) * s,
            kl_loss: f64::from(out.kl_loss) * s,
            clipfrac: f64::from(p.clipfrac),
            clipfrac_lower: f64::from(p.clipfrac_lower),
            ppo_kl: f64::from(p.approx_kl),
            selected_frac: f64::from(p.selected_frac),
            tokens: p.valid_tokens,
            entropy: f64::from(out.entropy) * s,
            entropy_loss: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ares_core::kl::KlEstimator;
    use ares_core::loss::GspoLevel;

    #[test]
    fn on_policy_gradient_is_minus_advantage_over_tokens() {
        // r = 1 everywhere: dL/dlogπ = −A, token-mean over 3 valid tokens
        let shape = Shape { rows: 2, cols: 2 };
        let mask = [1.0, 1.0, 1.0, 0.0];
        let logp = [-1.0, -2.0, -0.5, 0.0];
        let adv = [1.0, 1.0, -2.0, 0.0];
        let batch = MicroBatch {
            shape,
            mask: &mask,
            logp: &logp,
            logp_old: &logp,
            logp_rollout: None,
            advantages: &adv,
            forking: None,
        };
        let mut c = [0.0f32; 4];
        let out = micro_loss(
            &batch,
            &PolicyLossConfig::default(),
            &Objective::Ppo,
            0,
            Terms::default(),
            0.5,
            (&mut c, None),
        )
        .unwrap();
        let third = 1.0 / 3.0;
        for (got, want) in c.iter().zip([-0.5 * third, -0.5 * third, 1.0 * third, 0.0]) {
            assert!((got - want).abs() < 1e-6, "{c:?}");
        }
        // L = −A·1 averaged: (−1 −1 +2)/3 = 0
        assert!(out.pg_loss.abs() < 1e-7);
        assert_eq!(out.tokens, 3);
    }

    #[test]
    fn kl_term_adds_its_gradient() {
        let shape = Shape { rows: 1, cols: 1 };
        let logp = [-1.0f32];
        let refp = [-1.5f32];
        let batch = MicroBatch {
            shape,
            mask: &[1.0],
            logp: &logp,
            logp_old: &logp,
            logp_rollout: None,
            advantages: &[0.0],
            forking: None,
        };
        let kl = KlLoss {
            estimator: KlEstimator::K3,
            beta: &[2.0],
            hwe_mask: None,
            low_ratio: 0.5,
            logp_ref: &refp,
        };
        let mut c = [0.0f32];
        let out = micro_loss(
            &batch,
            &PolicyLossConfig::default(),
            &Objective::Ppo,
            0,
            Terms {
                kl: Some(kl),
                entropy: None,
            },
            1.0,
            (&mut c, None),
        )
        .unwrap();
        // spec vector 8: k3 = 0.1065307, β = 2
        assert!((out.kl_loss - 0.2130614).abs() < 1e-5, "{}", out.kl_loss);
        // d k3/d logπ = 1 − e^{ref − logπ} = 1 − e^{−0.5}
        let want = 2.0 * (1.0 - (-0.5f32).exp());
        assert!((c[0] - want).abs() < 1e-5, "{c:?} vs {want}");
    }

    #[test]
    fn forking_mask_drops_the_policy_gradient_but_not_the_kl() {
        // two tokens, on-policy: without the mask dL/dlogπ = −A/2 + KL gradient on each
        let shape = Shape { rows: 1, cols: 2 };
        let logp = [-1.0f32, -2.0];
        let refp = [-1.5f32, -2.0];
        let keep = [0.0f32, 1.0];
        let batch = |forking| MicroBatch {
            shape,
            mask: &[1.0, 1.0],
            logp: &logp,
            logp_old: &logp,
            logp_rollout: None,
            advantages: &[1.0, 1.0],
            forking,
        };
        let kl = KlLoss {
            estimator: KlEstimator::K3,
            beta: &[2.0],
            hwe_mask: None,
            low_ratio: 0.5,
            logp_ref: &refp,
        };
        let run = |forking| {
            let mut c = [0.0f32; 2];
            let out = micro_loss(
                &batch(forking),
                &PolicyLossConfig::default(),
                &Objective::Ppo,
                0,
                Terms {
                    kl: Some(kl),
                    entropy: None,
                },
                1.0,
                (&mut c, None),
            )
            .unwrap();
            (c, out)
        };
        let (full, full_out) = run(None);
        let (kept, kept_out) = run(Some(&keep));
        // token 0 keeps only its KL gradient: β·(1 − e^{ref − logπ})/2 (token-mean over 2)
        let kl0 = 2.0 * (1.0 - (-0.5f32).exp()) / 2.0;
        assert!((kept[0] - kl0).abs() < 1e-6, "{kept:?}");
        assert!((full[0] - (kl0 - 0.5)).abs() < 1e-6, "{full:?}");
        // token 1 (kept, no KL since ref = logπ) is unchanged
        assert_eq!(kept[1], full[1]);
        assert!((kept[1] + 0.5).abs() < 1e-6);
        // the loss values still see every token
        assert_eq!(kept_out.pg_loss, full_out.pg_loss);
        assert_eq!(kept_out.kl_loss, full_out.kl_loss);
    }

    #[test]
    fn entropy_bonus_is_minus_coef_over_tokens() {
        // token-mean over 3 valid tokens: ∂(−c·mean H)/∂H_t = −c/3, scaled by the share 0.5
        let shape = Shape { rows: 2, cols: 2 };
        let h = [0.6f32, 0.3, 0.9, f32::NAN];
        let mask = [1.0, 1.0, 1.0, 0.0];
        let zeros = [0.0f32; 4];
        let batch = MicroBatch {
            shape,
            mask: &mask,
            logp: &zeros,
            logp_old: &zeros,
            logp_rollout: None,
            advantages: &zeros,
            forking: None,
        };
        let run = |agg, entropy: &[f32], scale, g: &mut [f32]| {
            let cfg = PolicyLossConfig {
                agg,
                ..PolicyLossConfig::default()
            };
            let terms = Terms {
                kl: None,
                entropy: Some(EntropyTerm {
                    coef: 0.01,
                    entropy,
                }),
            };
            let mut c = [0.0f32; 4];
            micro_loss(
                &batch,
                &cfg,
                &Objective::Ppo,
                0,
                terms,
                scale,
                (&mut c, Some(g)),
            )
            .map(|l| l.entropy)
        };
        let mut g = [7.0f32; 4];
        let mean = run(LossAggMode::TokenMean, &h, 0.5, &mut g).unwrap();
        assert!((mean - 0.5 * 0.6).abs() < 1e-6, "{mean}");
        for (got, want) in g.iter().zip([-0.01 / 6.0, -0.01 / 6.0, -0.01 / 6.0, 0.0]) {
            assert!((got - want).abs() < 1e-9, "{g:?}");
        }
        // seq-mean-token-mean: row 0 has 2 tokens, row 1 one; each row weighs 1/2
        let mean = run(LossAggMode::SeqMeanTokenMean, &h, 1.0, &mut g).unwrap();
        assert!((mean - (0.45 + 0.9) / 2.0).abs() < 1e-6, "{mean}");
        assert!((g[0] + 0.01 / 4.0).abs() < 1e-9 && (g[2] + 0.01 / 2.0).abs() < 1e-9);
        // a NaN entropy at a valid token is an error
        let bad = [0.6f32, f32::NAN, 0.9, 0.0];
        assert!(run(LossAggMode::TokenMean, &bad, 1.0, &mut g).is_err());
    }

    #[test]
    fn micro_scales_sum_to_one() {
        let m = LossAggMode::TokenMean;
        assert_eq!(
            micro_scale(m, 3, 12, 1, 4) + micro_scale(m, 9, 12, 3, 4),
            1.0
        );
        let m = LossAggMode::SeqMeanTokenMean;
        assert_eq!(micro_scale(m, 3, 12, 1, 4), 0.25);
        assert_eq!(
            micro_scale(LossAggMode::SeqMeanTokenSumNorm, 3, 12, 1, 4),
            0.25
        );
        assert_eq!(micro_scale(LossAggMode::TokenSum, 3, 12, 1, 4), 1.0);
    }

    /// Every mode: the scaled micro-batch losses and coefficients of a split mini-batch sum to
    /// the whole mini-batch's (rows of different lengths, one row without a response token).
    #[test]
    fn micro_batches_reproduce_the_mini_batch() {
        let cols = 3;
        let mask = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0];
        let logp = [
            -1.0, -0.5, -2.0, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0, -1.2, -0.7, 0.0,
        ];
        let old = [
            -1.1, -0.4, -2.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -0.7, 0.0,
        ];
        let adv = [1.0, 1.0, 1.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0];
        let rows_of = |r: std::ops::Range<usize>| {
            let s = r.start * cols..r.end * cols;
            let m = &mask[s.clone()];
            (
                MicroBatch {
                    shape: Shape {
                        rows: r.len(),
                        cols,
                    },
                    mask: m,
                    logp: &logp[s.clone()],
                    logp_old: &old[s.clone()],
                    logp_rollout: None,
                    advantages: &adv[s],
                    forking: None,
                },
                m.iter().filter(|&&x| x != 0.0).count(),
                m.chunks(cols).filter(|r| r.contains(&1.0)).count(),
            )
        };
        // the row-separable losses (Clip-Cov and KL-Cov select within a micro-batch)
        let objectives = [
            Objective::Ppo,
            Objective::Gspo(GspoLevel::Sequence),
            Objective::Gspo(GspoLevel::Token),
            Objective::Cispo,
        ];
        for (mode, objective) in LossAggMode::ALL
            .into_iter()
            .flat_map(|m| objectives.map(|o| (m, o)))
        {
            let cfg = PolicyLossConfig {
                agg: mode,
                ..PolicyLossConfig::default()
            };
            let (whole, tokens, rows) = rows_of(0..4);
            let mut want = [0.0f32; 12];
            let full = micro_loss(
                &whole,
                &cfg,
                &objective,
                0,
                Terms::default(),
                1.0,
                (&mut want, None),
            )
            .unwrap();
            let mut got = [0.0f32; 12];
            let mut loss = 0.0;
            for (split, at) in [(0..2, 0), (2..4, 6)] {
                let (micro, t, r) = rows_of(split);
                let scale = micro_scale(mode, t, tokens, r, rows);
                loss += micro_loss(
                    &micro,
                    &cfg,
                    &objective,
                    0,
                    Terms::default(),
                    scale,
                    (&mut got[at..at + 6], None),
                )
                .unwrap()
                .pg_loss;
            }
            let what = format!("{} {objective:?}", mode.name());
            assert!((loss - full.pg_loss).abs() < 1e-6, "{what}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-6, "{what}: {got:?} vs {want:?}");
            }
        }
    }
}
