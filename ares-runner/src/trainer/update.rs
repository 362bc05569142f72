//! The PPO update of a prepared batch (docs/algorithms.md §6): `ppo_epochs` passes over the batch in
//! mini-batches of `mini_batch` samples (one optimizer step each), each mini-batch in
//! micro-batches of `micro_batch` samples whose gradients accumulate. Per micro-batch the
//! model computes logπ, ares-core the loss and `∂L/∂logπ`, and the model's loss head turns
//! those coefficients into `dlogits` and backpropagates.
//!
//! A mini-batch whose loss or gradient is not finite is skipped and counted: its
//! gradients are dropped and neither the weights nor the optimizer moments change.

use ares_core::loss::LossAggMode;

/// Metrics by name.
pub type Metrics = std::collections::BTreeMap<String, f64>;

use super::TrainError;
use super::batch::Batch;
use super::policy::{KlLoss, MicroBatch, MicroLoss, entropy_bonus, micro_loss, micro_scale};
use super::prepare::Prepared;
use super::settings::StepSettings;
use super::tokens::gather_rows;
use crate::backend::Backend;
use crate::model::{Activations, AdamW, Grads};

use super::actor::{Actor, TowerTraining};

/// What the update did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UpdateReport {
    /// Optimizer steps applied.
    pub applied: usize,
    /// Mini-batches skipped for a non-finite loss or gradient.
    pub skipped: usize,
    /// Averages over the applied mini-batches: `actor/pg_loss`, `actor/kl_loss`,
    /// `actor/grad_norm`, `actor/clipfrac`, `actor/clipfrac_lower`, `actor/ppo_kl`,
    /// `actor/lr`, with Clip-Cov / KL-Cov `actor/selected_frac`, and with an entropy bonus
    /// `actor/entropy` (the aggregated token entropy of the training forward) and
    /// `actor/entropy_loss` (`−c` times it).
    pub metrics: Metrics,
}

/// Valid tokens and non-empty rows of `rows`.
fn count(batch: &Batch, rows: &[usize]) -> (usize, usize) {
    let mut tokens = 0;
    let mut nonempty = 0;
    for &r in rows {
        let len = batch.responses[r].model_len();
        tokens += len;
        nonempty += usize::from(len > 0);
    }
    (tokens, nonempty)
}

/// The optimizer, its gradients and its step counter.
pub struct Optimizer<B: Backend> {
    /// AdamW state.
    pub adamw: AdamW<B>,
    /// Gradient buffers.
    pub grads: Grads<B>,
    /// The vision tower's gradients and moments (`None`: a text model or a frozen tower).
    pub tower: Option<TowerTraining<B>>,
    /// Optimizer steps taken (applied or skipped), the schedule's clock.
    pub steps: u64,
}

/// Runs the PPO epochs of `batch` on `actor`. `on_mini` is called after each mini-batch
/// with (done, total).
///
/// # Errors
/// Model and core errors other than non-finite values (those skip the mini-batch).
pub fn ppo_update<B: Backend>(
    settings: &StepSettings,
    batch: &Batch,
    prep: &Prepared,
    actor: &mut Actor<B>,
    opt: &mut Optimizer<B>,
    mut on_mini: impl FnMut(usize, usize),
) -> Result<UpdateReport, TrainError> {
    let rows: Vec<usize> = (0..batch.rows()).collect();
    let t = batch.tokens.cols();
    let temperature = settings.sampling.temperature();
    let agg: LossAggMode = settings.policy.agg;
    let minis: Vec<&[usize]> = rows.chunks(settings.mini_batch.max(1)).collect();
    let total = minis.len() * settings.ppo_epochs;
    let mut report = UpdateReport::default();
    let mut sums = Metrics::new();
    let mut arena: Option<(usize, Activations<B>)> = None;
    let mut done = 0;
    for _epoch in 0..settings.ppo_epochs {
        for mini in &minis {
            let (mini_tokens, mini_rows) = count(batch, mini);
            let mut acc = MicroLoss::default();
            let mut finite = true;
            let mut micros = 0usize;
            opt.grads.zero(actor.backend())?;
            if let Some(t) = &mut opt.tower {
                t.zero_grads(actor.backend())?;
            }
            if mini_tokens > 0 {
                for (micro_index, micro) in mini.chunks(settings.micro_batch.max(1)).enumerate() {
                    let (micro_tokens, micro_rows) = count(batch, micro);
                    if micro_tokens == 0 {
                        continue;
                    }
                    let packed = batch.pack(micro)?;
                    let acts = match &mut arena {
                        Some((len, a)) if *len == micro.len() => a,
                        _ => {
                            let a = actor.lm().activations(micro.len(), packed.seq())?;
                            &mut arena.insert((micro.len(), a)).1
                        }
                    };
                    let vision = batch.vision(micro);
                    let mut pass = actor.forward(
                        &packed.inputs(),
                        vision.as_ref(),
                        packed.prompt_cols,
                        acts,
                        opt.tower.is_some(),
                    )?;
                    let (logp, entropy) = super::sequences::response_log_probs_after_forward(
                        actor.lm(),
                        acts,
                        &packed,
                        temperature,
                    )?;
                    let g = |v: &[f32]| gather_rows(v, t, micro);
                    let mask = g(&batch.tokens.mask);
                    let old = g(&prep.scored.old_logp);
                    let adv = g(&prep.advantages.values);
                    let forking = prep.forking.as_ref().map(|f| g(&f.keep));
                    let rollout = settings
                        .uses_rollout_log_probs
                        .then(|| g(&prep.rollout_logp));
                    let shape = ares_core::Shape {
                        rows: micro.len(),
                        cols: t,
                    };
                    let input = MicroBatch {
                        shape,
                        mask: &mask,
                        logp: &logp,
                        logp_old: &old,
                        logp_rollout: rollout.as_deref(),
                        advantages: &adv,
                        forking: forking.as_deref(),
                    };
                    let ref_rows = prep.scored.ref_logp.as_ref().map(|r| g(r));
                    let hwe_rows = prep.scored.hwe_mask.as_ref().map(|h| g(h));
                    let beta_rows: Vec<f32> = micro.iter().map(|&r| prep.scored.beta[r]).collect();
                    let kl = match (&ref_rows, settings.kl.use_kl_loss) {
                        (Some(logp_ref), true) => Some(KlLoss {
                            estimator: settings.kl.estimator,
                            beta: &beta_rows,
                            hwe_mask: hwe_rows.as_deref(),
                            low_ratio: settings.kl.low_ratio as f32,
                            logp_ref,
                        }),
                        _ => None,
                    };
                    let scale = micro_scale(agg, micro_tokens, mini_tokens, micro_rows, mini_rows);
                    let mut coeffs = vec![0.0f32; micro.len() * t];
                    // Clip-Cov's selection: fixed by the run's seed, the optimizer step and
                    // the micro-batch, so a resumed run selects the same tokens.
                    let seed = settings
                        .rollout_seed
                        .wrapping_add(opt.steps.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                        .wrapping_add(micro_index as u64);
                    let loss = match micro_loss(
                        &input,
                        &settings.policy,
                        &settings.objective,
                        seed,
                        kl.as_ref(),
                        scale,
                        &mut coeffs,
                    ) {
                        Ok(l) => l,
                        Err(TrainError::Core(ares_core::Error::NonFinite { .. })) => {
                            finite = false;
                            break;
                        }
                        Err(e) => return Err(e),
                    };
                    if !(loss.pg_loss.is_finite() && loss.kl_loss.is_finite()) {
                        finite = false;
                        break;
                    }
                    let spread = packed.spread_response(&coeffs);
                    // the entropy bonus −c·agg(H_t) (docs/algorithms.md §16.2): its gradient
                    // goes to the loss head as ∂L/∂H_t, beside ∂L/∂logπ_t
                    let entropy_grad = match prep.entropy_coef {
                        Some(c) if c != 0.0 => {
                            let mut d = vec![0.0f32; micro.len() * t];
                            match entropy_bonus(
                                shape, &entropy, &mask, agg, c as f32, scale, &mut d,
                            ) {
                                Ok(h) => {
                                    acc.entropy += h;
                                    acc.entropy_loss -= c * h;
                                    Some(packed.spread_response(&d))
                                }
                                // a non-finite entropy skips the mini-batch, as a
                                // non-finite loss does
                                Err(TrainError::Core(ares_core::Error::NonFinite { .. })) => {
                                    finite = false;
                                    break;
                                }
                                Err(e) => return Err(e),
                            }
                        }
                        _ => None,
                    };
                    actor.backward_from_log_prob_grads(
                        &packed.inputs(),
                        acts,
                        &mut pass,
                        &packed.targets,
                        &spread,
                        temperature,
                        &mut opt.grads,
                        opt.tower.as_mut(),
                        entropy_grad.as_deref(),
                    )?;
                    acc.pg_loss += loss.pg_loss;
                    acc.kl_loss += loss.kl_loss;
                    let w = loss.tokens as f64 / mini_tokens as f64;
                    acc.clipfrac += loss.clipfrac * w;
                    acc.clipfrac_lower += loss.clipfrac_lower * w;
                    acc.ppo_kl += loss.ppo_kl * w;
                    acc.selected_frac += loss.selected_frac * w;
                    micros += 1;
                }
            }
            done += 1;
            if micros == 0 && finite {
                // no valid token in the mini-batch: nothing to learn from
                on_mini(done, total);
                continue;
            }
            let lr = settings.optim.lr_at(opt.steps);
            opt.steps += 1;
            let stepped = if finite {
                Some(actor.optimizer_step(
                    &mut opt.adamw,
                    &opt.grads,
                    opt.tower.as_mut(),
                    lr,
                    settings.optim.max_grad_norm,
                )?)
            } else {
                None
            };
            match stepped {
                Some(r) if r.applied => {
                    report.applied += 1;
                    for (k, v) in [
                        ("actor/pg_loss", acc.pg_loss),
                        ("actor/kl_loss", acc.kl_loss),
                        ("actor/clipfrac", acc.clipfrac),
                        ("actor/clipfrac_lower", acc.clipfrac_lower),
                        ("actor/ppo_kl", acc.ppo_kl),
                        ("actor/grad_norm", f64::from(r.grad_norm)),
                        ("actor/lr", lr),
                    ] {
                        *sums.entry(k.into()).or_default() += v;
                    }
                    if prep.entropy_coef.is_some() {
                        *sums.entry("actor/entropy".into()).or_default() += acc.entropy;
                        *sums.entry("actor/entropy_loss".into()).or_default() += acc.entropy_loss;
                    }
                    if settings.objective.selects_tokens() {
                        *sums.entry("actor/selected_frac".into()).or_default() += acc.selected_frac;
                    }
                }
                _ => report.skipped += 1,
            }
            on_mini(done, total);
        }
    }
    let k = report.applied.max(1) as f64;
    report.metrics = sums.into_iter().map(|(key, v)| (key, v / k)).collect();
    Ok(report)
}
