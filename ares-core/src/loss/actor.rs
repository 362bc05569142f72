//! The actor's loss of one micro-batch (docs/algorithms.md §4, §6, §16): a policy loss
//! (`worker.actor.policy_loss`), the forking-token mask on its gradient, the dynamic
//! token-level KL term `agg(β_t·k_t)` and the entropy bonus `−c·agg(H_t)`, each aggregated by
//! the same `loss_agg_mode`, with `scale · ∂L/∂logπ_t` and `scale · ∂L/∂H_t` per token — what
//! a trainer's loss head turns into `∂L/∂logits`. `scale` is the micro-batch's share of its
//! mini-batch (see `ares-runner`'s `micro_scale`), so accumulated micro-batches give the
//! mini-batch's gradient.
//!
//! This is the composition the runner trains with and the device kernel
//! (`ares-cuda`'s `policy_loss`) is the twin of.

use super::{
    ClipCovParams, GspoLevel, KlCovParams, PolicyLossConfig, PolicyLossInput, PolicyLossOutput,
    aggregate_term, cispo_loss, clip_cov_loss, gspo_loss, kl_cov_loss, policy_loss,
};
use crate::error::{Error, Result};
use crate::kl::{KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs, token_kl};
use crate::num::{check_len, check_param, check_scratch};
use num_traits::Float;

/// The policy loss of [`ActorLoss`], with its own parameters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Objective<F> {
    /// [`policy_loss`]: PPO clip / dual clip.
    #[default]
    Ppo,
    /// [`gspo_loss`] at a level.
    Gspo(GspoLevel),
    /// [`cispo_loss`].
    Cispo,
    /// [`clip_cov_loss`] (its `seed` picks the tokens).
    ClipCov(ClipCovParams<F>),
    /// [`kl_cov_loss`].
    KlCov(KlCovParams<F>),
}

impl<F> Objective<F> {
    /// Whether the loss selects tokens by covariance (Clip-Cov, KL-Cov): these need
    /// [`actor_loss`]'s index scratch.
    pub fn selects_tokens(&self) -> bool {
        matches!(self, Objective::ClipCov(_) | Objective::KlCov(_))
    }
}

/// The KL loss term `agg(β_t·k_t)` with `β_t = β_row·(hwe_t ? low_ratio : 1)`
/// ([`token_kl`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlTerm<'a, F> {
    /// The per-token estimator (its gradient: `k1+`/`k3+` take k2's).
    pub estimator: KlEstimator,
    /// β per row (the bucket's λ under dual ascent, else the controller's value).
    pub beta: &'a [F],
    /// HWE mask `[rows, cols]` of the dynamic KL (`None`: plain token-level KL).
    pub hwe_mask: Option<&'a [F]>,
    /// Weight ratio of HWE tokens, in [0, 1].
    pub low_ratio: F,
    /// logπ_ref `[rows, cols]`.
    pub logp_ref: &'a [F],
}

/// The entropy bonus `−coef·agg(H_t)` (docs/algorithms.md §16.2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntropyTerm<'a, F> {
    /// `c` (finite).
    pub coef: F,
    /// Token entropies `[rows, cols]`.
    pub entropy: &'a [F],
}

/// What [`actor_loss`] adds up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActorLoss<'a, F> {
    /// The policy loss.
    pub objective: Objective<F>,
    /// Clip, aggregation, importance correction.
    pub config: PolicyLossConfig<F>,
    /// Forking-token mask: the policy gradient is kept where 1 (docs/algorithms.md §16.1);
    /// the loss value, the metrics and the KL term see every token.
    pub keep: Option<&'a [F]>,
    /// The KL loss term.
    pub kl: Option<KlTerm<'a, F>>,
    /// The entropy bonus.
    pub entropy: Option<EntropyTerm<'a, F>>,
    /// Multiplies both gradients (finite); not the returned values.
    pub scale: F,
}

/// [`actor_loss`]'s values, not multiplied by `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActorLossOutput<F> {
    /// The policy loss and its metrics.
    pub policy: PolicyLossOutput<F>,
    /// `agg(β_t·k_t)` (0 without a KL term).
    pub kl_loss: F,
    /// `agg(H_t)` (0 without an entropy bonus); the bonus's loss term is `−coef` times it.
    pub entropy: F,
}

/// The actor's loss of one `[rows, cols]` micro-batch (see the module docs).
///
/// Writes `grad[t] = scale·∂L/∂logπ_t` (policy gradient, zeroed at dropped forking tokens,
/// plus the KL term's) and, with an entropy bonus, `entropy_grad[t] = scale·∂L/∂H_t =
/// −scale·coef·weight_t`; both 0 on padding.
///
/// Scratch: `scratch` holds at least `2·rows·cols` values with a KL term (its weighted
/// values and gradient), `index_scratch` at least the valid tokens for Clip-Cov and KL-Cov.
///
/// Errors: those of the losses ([`policy_loss`] and the others: lengths, mask, no valid
/// token, non-finite inputs at valid positions, parameters), of
/// [`mask_token_gradient`](crate::forking::mask_token_gradient), [`token_kl`] and
/// [`aggregate_term`] (a non-finite entropy at a valid token); a missing or short
/// `entropy_grad` or scratch; a `scale` or `coef` not finite. On error the outputs hold
/// unspecified values.
pub fn actor_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    loss: &ActorLoss<'_, F>,
    grad: &mut [F],
    entropy_grad: Option<&mut [F]>,
    scratch: &mut [F],
    index_scratch: &mut [usize],
) -> Result<ActorLossOutput<F>> {
    check_param("scale", loss.scale, loss.scale.is_finite(), "finite")?;
    let config = &loss.config;
    let policy = match loss.objective {
        Objective::Ppo => policy_loss(input, config, grad)?,
        Objective::Gspo(level) => gspo_loss(input, config, level, grad)?,
        Objective::Cispo => cispo_loss(input, config, grad)?,
        Objective::ClipCov(p) => clip_cov_loss(input, config, &p, index_scratch, grad)?,
        Objective::KlCov(p) => kl_cov_loss(input, config, &p, index_scratch, grad)?,
    };
    if let Some(keep) = loss.keep {
        crate::forking::mask_token_gradient(grad, keep)?;
    }
    let n = grad.len();
    let mut kl_loss = F::zero();
    if let Some(kl) = &loss.kl {
        check_scratch("scratch", 2 * n, scratch.len())?;
        let (weighted, rest) = scratch.split_at_mut(n);
        let kl_grad = &mut rest[..n];
        let mut cfg = TokenKlConfig::new(kl.estimator, KlCoefficient::PerRow(kl.beta));
        if let Some(h) = kl.hwe_mask {
            cfg = cfg.with_hwe(h, kl.low_ratio);
        }
        token_kl(
            input.shape,
            input.logp,
            kl.logp_ref,
            input.mask,
            &cfg,
            TokenKlOutputs {
                weighted: Some(&mut *weighted),
                grad: Some(&mut *kl_grad),
                ..TokenKlOutputs::default()
            },
        )?;
        kl_loss = aggregate_term(input.shape, weighted, kl_grad, input.mask, config.agg)?;
        for (c, &g) in grad.iter_mut().zip(kl_grad.iter()) {
            *c = *c + g;
        }
    }
    for c in grad.iter_mut() {
        *c = *c * loss.scale;
    }
    let mut entropy = F::zero();
    if let Some(term) = &loss.entropy {
        check_param("entropy coef", term.coef, term.coef.is_finite(), "finite")?;
        let Some(eg) = entropy_grad else {
            return Err(Error::LengthMismatch {
                what: "entropy_grad",
                expected: n,
                actual: 0,
            });
        };
        check_len("entropy_grad", n, eg.len())?;
        eg.fill(-term.coef);
        entropy = aggregate_term(input.shape, term.entropy, eg, input.mask, config.agg)?;
        for g in eg.iter_mut() {
            *g = *g * loss.scale;
        }
    }
    Ok(ActorLossOutput {
        policy,
        kl_loss,
        entropy,
    })
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::Shape;

    fn input<'a>(logp: &'a [f64], adv: &'a [f64], mask: &'a [f64]) -> PolicyLossInput<'a, f64> {
        PolicyLossInput {
            shape: Shape::new(1, logp.len()),
            logp,
            logp_old: logp,
            advantages: adv,
            mask,
            logp_rollout: None,
        }
    }

    #[test]
    fn on_policy_gradient_is_minus_advantage_over_tokens() {
        // r = 1: ∂L/∂logπ = −A/3 (token-mean over 3 valid tokens), times scale 0.5
        let (logp, adv, mask) = (
            [-1.0, -2.0, -0.5, 0.0],
            [1.0, 1.0, -2.0, 0.0],
            [1.0, 1.0, 1.0, 0.0],
        );
        let loss = ActorLoss {
            objective: Objective::Ppo,
            config: PolicyLossConfig::default(),
            keep: None,
            kl: None,
            entropy: None,
            scale: 0.5,
        };
        let mut g = [9.0; 4];
        let out = actor_loss(
            &input(&logp, &adv, &mask),
            &loss,
            &mut g,
            None,
            &mut [],
            &mut [],
        )
        .unwrap();
        for (got, want) in g.iter().zip([-0.5 / 3.0, -0.5 / 3.0, 1.0 / 3.0, 0.0]) {
            assert!((got - want).abs() < 1e-15, "{g:?}");
        }
        assert!(out.policy.loss.abs() < 1e-15);
        assert_eq!((out.kl_loss, out.entropy), (0.0, 0.0));
    }

    #[test]
    fn terms_add_their_gradients_and_forking_drops_only_the_policys() {
        // one valid token of two: k3 at δ = 0.5 with β = 2; entropy 1.5 with c = 0.1
        let (logp, adv, mask) = ([-1.0, 0.0], [1.0, 0.0], [1.0, 0.0]);
        let (refp, ent) = ([-1.5, 0.0], [1.5, 0.0]);
        let mut loss = ActorLoss {
            objective: Objective::Ppo,
            config: PolicyLossConfig::default(),
            keep: None,
            kl: Some(KlTerm {
                estimator: KlEstimator::K3,
                beta: &[2.0],
                hwe_mask: None,
                low_ratio: 0.5,
                logp_ref: &refp,
            }),
            entropy: Some(EntropyTerm {
                coef: 0.1,
                entropy: &ent,
            }),
            scale: 1.0,
        };
        let kl_grad = 2.0 * (1.0 - (-0.5f64).exp());
        let (mut g, mut eg, mut s) = ([0.0; 2], [7.0; 2], [0.0; 4]);
        let inp = input(&logp, &adv, &mask);
        let out = actor_loss(&inp, &loss, &mut g, Some(&mut eg), &mut s, &mut []).unwrap();
        assert!(
            (g[0] - (-1.0 + kl_grad)).abs() < 1e-12 && g[1] == 0.0,
            "{g:?}"
        );
        assert_eq!(eg, [-0.1, 0.0]);
        assert!((out.kl_loss - 2.0 * ((-0.5f64).exp() - 0.5)).abs() < 1e-12);
        assert_eq!(out.entropy, 1.5);
        loss.keep = Some(&[0.0, 1.0]);
        actor_loss(&inp, &loss, &mut g, Some(&mut eg), &mut s, &mut []).unwrap();
        assert!((g[0] - kl_grad).abs() < 1e-12, "{g:?}");
        // what the call needs and lacks is named
        let short = actor_loss(&inp, &loss, &mut g, Some(&mut eg), &mut [0.0; 3], &mut []);
        assert!(matches!(
            short,
            Err(Error::ScratchTooSmall {
                what: "scratch",
                ..
            })
        ));
        let none = actor_loss(&inp, &loss, &mut g, None, &mut s, &mut []);
        assert!(matches!(
            none,
            Err(Error::LengthMismatch {
                what: "entropy_grad",
                ..
            })
        ));
        loss.scale = f64::NAN;
        assert!(actor_loss(&inp, &loss, &mut g, Some(&mut eg), &mut s, &mut []).is_err());
    }
}
