//! The actor's loss of a micro-batch where its log-probs are (docs/algorithms.md §6):
//! `Backend::actor_loss` — on CUDA ares-cuda's loss kernel, on the CPU ares-core's
//! `actor_loss`, the host path's function — reading the forward's log-probs and entropies
//! gathered on the device and writing the loss head's coefficients there. Only the batch's
//! own tensors go up (mask, logπ_old, advantages, …) and twelve words come back — read once
//! the mini-batch is queued ([`QueuedLoss::read`]), so the device does not wait for the host
//! between a loss and its backward — where the
//! host path downloads two `[rows, T]` tensors and uploads two more.

use ares_core::Shape;
use ares_core::loss::Objective;

use super::policy::MicroLoss;
use super::{Inputs, Rows};
use crate::backend::{
    ACTOR_LOSS_REPORT, ActorLossGrads, ActorLossSpec, ActorLossViews, Backend, View, ViewMut,
};
use crate::model::{Activations, Model, ModelError};
use crate::trainer::TrainError;
use crate::trainer::prepare::sequences::Packed;

/// A view of the whole of an optional buffer.
fn whole<B: Backend>(b: &Option<B::Buffer>) -> Option<View<'_, B::Buffer>> {
    b.as_ref().map(View::whole)
}

/// A shorter-lived view of all of `v`.
fn reborrow<'s, B: Backend>(
    v: &'s mut crate::backend::TensorMut<'_, B>,
) -> Result<crate::backend::TensorMut<'s, B>, TrainError> {
    let len = v.len();
    v.slice_mut(0, len).map_err(backend)
}

/// A backend error as the trainer's.
fn backend(e: crate::backend::BackendError) -> TrainError {
    ModelError::from(e).into()
}

impl Inputs<'_> {
    /// [`Inputs::loss`] on the device (for objectives with `Backend::has_actor_loss`): the
    /// loss of micro-batch `index` (rows `micro`, `[rows, T]` `shape`, laid out as `packed`),
    /// after `model.log_prob_entropy` filled `acts`; writes `scale · ∂L/∂logπ` (and `∂L/∂H`
    /// with an entropy bonus) into the head's coefficient buffers of `acts`, at the response
    /// positions, 0 elsewhere — all queued: the values come with [`QueuedLoss::read`], after
    /// the caller has queued the backward. `None` when the backend found a non-finite input
    /// at once (the host path's rule; the mini-batch is skipped).
    ///
    /// # Errors
    /// A device failure; core's errors for the data other than non-finite values.
    pub(super) fn device_loss<B: Backend>(
        &self,
        micro: &[usize],
        (steps, index, scale): (u64, usize, f32),
        shape: Shape,
        packed: &Packed,
        model: &Model<B>,
        acts: &mut Activations<B>,
    ) -> Result<Option<QueuedLoss<B>>, TrainError> {
        let (settings, prep) = (self.settings, self.prep);
        let be = model.backend();
        let rows = Rows::gather(self.batch, prep, settings, micro);
        let n = shape.rows * shape.cols;
        let positions = packed.response_positions();
        let n_pos = packed.batch() * packed.seq();
        let ids = |v: &[u32]| -> Result<B::Ids, TrainError> {
            let mut b = be.alloc_ids(v.len()).map_err(backend)?;
            be.upload_ids(v, &mut b).map_err(backend)?;
            Ok(b)
        };
        let upload = |v: &[f32]| -> Result<B::Buffer, TrainError> {
            let mut b = be.alloc(v.len()).map_err(backend)?;
            be.upload(v, ViewMut::whole(&mut b)).map_err(backend)?;
            Ok(b)
        };
        // the log-probs (and entropies) of the responses, [rows, T]; past a response the
        // entry reads position 0 (its mask is 0: never used)
        let gather: Vec<u32> = positions
            .iter()
            .map(|p| p.map_or(0, |p| p as u32))
            .collect();
        let gather = ids(&gather)?;
        let coef = prep.entropy_coef.filter(|&c| c != 0.0);
        let (logp, entropy) = {
            let bufs = acts.loss_buffers();
            let mut logp = be.alloc(n).map_err(backend)?;
            be.embedding(&gather, bufs.log_probs, n_pos, 1, ViewMut::whole(&mut logp))
                .map_err(backend)?;
            let entropy = match coef {
                Some(_) => {
                    let mut e = be.alloc(n).map_err(backend)?;
                    be.embedding(&gather, bufs.entropies, n_pos, 1, ViewMut::whole(&mut e))
                        .map_err(backend)?;
                    Some(e)
                }
                None => None,
            };
            (logp, entropy)
        };
        let (mask, old, adv) = (
            upload(&rows.mask)?,
            upload(&rows.old)?,
            upload(&rows.advantages)?,
        );
        let rollout = rows.rollout.as_deref().map(upload).transpose()?;
        let keep = rows.forking.as_deref().map(upload).transpose()?;
        let kl = settings.kl.use_kl_loss && rows.reference.is_some();
        let (refp, beta, hwe) = if kl {
            (
                rows.reference.as_deref().map(upload).transpose()?,
                Some(upload(&rows.beta)?),
                rows.hwe.as_deref().map(upload).transpose()?,
            )
        } else {
            (None, None, None)
        };
        // Clip-Cov's selection seed, as the host path derives it (a backend that takes
        // Clip-Cov here selects the same tokens)
        let seed = settings
            .rollout_seed
            .wrapping_add(steps.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(index as u64);
        let objective = match settings.objective {
            Objective::ClipCov(p) => {
                Objective::ClipCov(ares_core::loss::ClipCovParams { seed, ..p })
            }
            other => other,
        };
        let spec = ActorLossSpec {
            objective,
            config: settings.policy,
            kl: kl.then_some((settings.kl.estimator, settings.kl.low_ratio as f32)),
            entropy_coef: coef.map(|c| c as f32),
            scale,
        };
        let mut grad = be.alloc(n).map_err(backend)?;
        let mut entropy_grad = coef.map(|_| be.alloc(n)).transpose().map_err(backend)?;
        let mut report = be.alloc(ACTOR_LOSS_REPORT).map_err(backend)?;
        let queued = be
            .actor_loss(
                &spec,
                ActorLossViews {
                    logp: View::whole(&logp),
                    logp_old: View::whole(&old),
                    advantages: View::whole(&adv),
                    mask: View::whole(&mask),
                    logp_rollout: whole::<B>(&rollout),
                    keep: whole::<B>(&keep),
                    logp_ref: whole::<B>(&refp),
                    beta_rows: whole::<B>(&beta),
                    hwe_mask: whole::<B>(&hwe),
                    entropy: whole::<B>(&entropy),
                    cols: shape.cols,
                },
                ActorLossGrads {
                    grad: ViewMut::whole(&mut grad),
                    entropy_grad: entropy_grad.as_mut().map(ViewMut::whole),
                },
                ViewMut::whole(&mut report),
            )
            .map_err(backend)?;
        match queued {
            Ok(()) => {}
            // found at once (the CPU): a non-finite input (entropy included) skips the
            // mini-batch before the backward
            Err(ares_core::Error::NonFinite { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        // the coefficients to the head's positions: the response entries gathered compact,
        // then scattered (each position once), every other position 0
        let (src, dst): (Vec<u32>, Vec<u32>) = positions
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.map(|p| (i as u32, p as u32)))
            .unzip();
        let bufs = acts.loss_buffers();
        let (mut coeffs, mut entropy_coeffs) = (bufs.coeffs, bufs.entropy_coeffs);
        be.fill(reborrow::<B>(&mut coeffs)?, 0.0).map_err(backend)?;
        if entropy_grad.is_some() {
            be.fill(reborrow::<B>(&mut entropy_coeffs)?, 0.0)
                .map_err(backend)?;
        }
        if !src.is_empty() {
            let (src, dst_ids) = (ids(&src)?, ids(&dst)?);
            let mut compact = be.alloc(dst.len()).map_err(backend)?;
            let mut spread = |from: &B::Buffer, to: crate::backend::TensorMut<'_, B>| {
                be.embedding(&src, View::whole(from), n, 1, ViewMut::whole(&mut compact))
                    .and_then(|()| be.scatter_rows(View::whole(&compact), &dst_ids, n_pos, 1, to))
                    .map_err(backend)
            };
            spread(&grad, coeffs)?;
            if let Some(eg) = &entropy_grad {
                spread(eg, entropy_coeffs)?;
            }
        }
        Ok(Some(QueuedLoss {
            report,
            scale,
            entropy_coef: coef,
        }))
    }
}

/// A micro-batch's loss queued on the device ([`Inputs::device_loss`]): its report, read
/// back after the backward is queued ([`QueuedLoss::read`]).
#[derive(Debug)]
pub(super) struct QueuedLoss<B: Backend> {
    /// `ACTOR_LOSS_REPORT` words.
    report: B::Buffer,
    /// The micro-batch's share of the mini-batch.
    scale: f32,
    /// The entropy bonus's coefficient, when there is one.
    entropy_coef: Option<f64>,
}

impl<B: Backend> QueuedLoss<B> {
    /// The loss's values (one wait for the report, and for the ops queued before it), or
    /// `None` when a loss or an input is not finite (the mini-batch is skipped; the
    /// backward over the report's zero gradients changed nothing).
    ///
    /// # Errors
    /// A device failure; core's errors for the data other than non-finite values.
    pub(super) fn read(self, be: &B) -> Result<Option<MicroLoss>, TrainError> {
        let mut words = [0.0f32; ACTOR_LOSS_REPORT];
        be.download(View::whole(&self.report), &mut words)
            .map_err(backend)?;
        let out = match be.actor_loss_output(&words) {
            Ok(o) if o.policy.loss.is_finite() && o.kl_loss.is_finite() => o,
            // a non-finite loss or input (entropy included) skips the mini-batch
            Ok(_) | Err(ares_core::Error::NonFinite { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut loss = MicroLoss::scaled(&out, self.scale);
        if let Some(c) = self.entropy_coef {
            loss.entropy_loss = -c * loss.entropy;
        }
        Ok(Some(loss))
    }
}
