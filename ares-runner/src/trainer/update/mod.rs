//! The PPO update of a prepared batch (docs/algorithms.md §6): `ppo_epochs` passes over the batch in
//! mini-batches of `mini_batch` samples (one optimizer step each), each mini-batch in
//! micro-batches of `micro_batch` samples whose gradients accumulate. Per micro-batch the
//! model computes logπ, ares-core the loss and `∂L/∂logπ`, and the model's loss head turns
//! those coefficients into `dlogits` and backpropagates.
//!
//! A mini-batch whose loss or gradient is not finite is skipped and counted: its
//! gradients are dropped and neither the weights nor the optimizer moments change.

mod device;
mod overlap;
pub mod policy;
pub mod zero;

use ares_core::loss::EntropyTerm;

/// Metrics by name.
pub type Metrics = std::collections::BTreeMap<String, f64>;

use crate::backend::{Backend, Stored};
use crate::config::GradientSum;
use crate::model::{Activations, AdamW, Grads, TrainableMut};
use crate::parallel::wire::{Reader, Writer};
use crate::parallel::{Holder, Ranks};
use crate::trainer::TrainError;
use crate::trainer::collect::batch::Batch;
use crate::trainer::collect::tokens::gather_rows;
use crate::trainer::prepare::Prepared;
use crate::trainer::prepare::sequences::Layout;
use crate::trainer::setup::settings::StepSettings;
use policy::{KlLoss, MicroBatch, MicroLoss, Terms, micro_loss, micro_scale};

use crate::trainer::actor::{Actor, TowerTraining};

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
    let minis: Vec<&[usize]> = rows.chunks(settings.mini_batch.max(1)).collect();
    let total = minis.len() * settings.ppo_epochs;
    let micros: Vec<&[usize]> = minis
        .iter()
        .flat_map(|m| m.chunks(settings.micro_batch.max(1)))
        .collect();
    let mut update = Update {
        inputs: Inputs {
            settings,
            batch,
            prep,
        },
        layout: batch.layout(&micros, settings.padding_free),
        arena: None,
    };
    let mut report = UpdateReport::default();
    let mut sums = Metrics::new();
    let mut done = 0;
    for _epoch in 0..settings.ppo_epochs {
        for mini in &minis {
            done += 1;
            match update.mini_batch(mini, actor, opt)? {
                // no valid token in the mini-batch: nothing to learn from
                MiniBatch::Empty => {}
                MiniBatch::Learned(acc) => match update.optimizer_step(actor, opt, true)? {
                    Some((grad_norm, lr)) => {
                        report.applied += 1;
                        update.add_metrics(&mut sums, &acc, grad_norm, lr);
                    }
                    None => report.skipped += 1,
                },
                MiniBatch::NonFinite => {
                    update.optimizer_step(actor, opt, false)?;
                    report.skipped += 1;
                }
            }
            on_mini(done, total);
        }
    }
    let k = report.applied.max(1) as f64;
    report.metrics = sums.into_iter().map(|(key, v)| (key, v / k)).collect();
    Ok(report)
}

/// Adds micro-batch `loss` to its mini-batch's `acc` (of `mini_tokens` valid tokens): the
/// losses as they are (each already scaled to its share), the fractions weighted by the
/// micro-batch's tokens.
fn add_micro(acc: &mut MicroLoss, loss: &MicroLoss, mini_tokens: usize) {
    acc.pg_loss += loss.pg_loss;
    acc.kl_loss += loss.kl_loss;
    let w = loss.tokens as f64 / mini_tokens as f64;
    acc.clipfrac += loss.clipfrac * w;
    acc.clipfrac_lower += loss.clipfrac_lower * w;
    acc.ppo_kl += loss.ppo_kl * w;
    acc.selected_frac += loss.selected_frac * w;
    acc.entropy += loss.entropy;
    acc.entropy_loss += loss.entropy_loss;
}

/// A data-parallel micro-batch's status: no valid token, a non-finite loss, learned.
/// A micro-batch's loss: known at once (the host loss), or queued on the device with its
/// report still to read ([`device::QueuedLoss`]).
enum PendingLoss<B: Backend> {
    Known(MicroLoss),
    Queued(device::QueuedLoss<B>),
}

impl<B: Backend> PendingLoss<B> {
    /// The values (a queued loss's report read back: a wait), `None` when a loss or an
    /// input was not finite.
    fn read(self, be: &B) -> Result<Option<MicroLoss>, TrainError> {
        match self {
            Self::Known(loss) => Ok(Some(loss)),
            Self::Queued(queued) => queued.read(be),
        }
    }
}

const SLICE_EMPTY: u8 = 0;
const SLICE_NON_FINITE: u8 = 1;
const SLICE_LEARNED: u8 = 2;

/// The length of every gradient buffer of `opt`: the model's (one stored in bf16 too, in
/// [`Grads::buffers`]' order), then the vision tower's.
///
/// [`Grads::buffers`]: crate::model::Grads::buffers
fn grad_lens<B: Backend>(opt: &Optimizer<B>) -> Vec<usize> {
    let mut all = opt.grads.lens();
    if let Some(t) = &opt.tower {
        all.extend(t.grads.lens());
    }
    all
}

/// The number of gradient values of `opt`.
fn grads_len<B: Backend>(opt: &Optimizer<B>) -> usize {
    grad_lens(opt).iter().sum()
}

/// Every gradient buffer of `opt` as stored ([`grad_lens`]' order): the model's f32 or
/// bf16 ones, then the tower's.
fn stored_grads<B: Backend>(opt: &Optimizer<B>) -> Vec<Stored<'_, B>> {
    let mut all = opt.grads.stored();
    if let Some(t) = &opt.tower {
        all.extend(t.grads.stored());
    }
    all
}

/// Copies `out.len()` values of gradient buffer `buffer` ([`grad_lens`]' order) from
/// `offset` to the host, a bf16 gradient widened (exact).
fn read_grads<B: Backend>(
    be: &B,
    opt: &Optimizer<B>,
    (buffer, offset): (usize, usize),
    out: &mut [f32],
) -> Result<(), TrainError> {
    let lm = opt.grads.lens().len();
    match (buffer.checked_sub(lm), &opt.tower) {
        (None, _) => opt.grads.read_values(be, buffer, offset, out)?,
        (Some(t), Some(tower)) => {
            let b = tower_buffer(tower.grads.stored(), t)?;
            b.slice(offset, out.len())?.download(be, out)?
        }
        (Some(t), None) => return Err(no_tower_buffer(t)),
    }
    Ok(())
}

/// Writes `values` into gradient buffer `buffer` ([`grad_lens`]' order) from `offset`,
/// rounded to nearest into a gradient stored in bf16 (one rounding of the ranks' f32 sum).
fn write_grads<B: Backend>(
    be: &B,
    opt: &mut Optimizer<B>,
    (buffer, offset): (usize, usize),
    values: &[f32],
) -> Result<(), TrainError> {
    let lm = opt.grads.lens().len();
    match (buffer.checked_sub(lm), &mut opt.tower) {
        (None, _) => opt.grads.write_values(be, buffer, offset, values)?,
        (Some(t), Some(tower)) => {
            let b = tower_buffer(tower.grads.stored_mut(), t)?;
            b.write_values(be, offset, values)?
        }
        (Some(t), None) => return Err(no_tower_buffer(t)),
    }
    Ok(())
}

/// The tower's gradient buffer `t` among `buffers`.
fn tower_buffer<T>(mut buffers: Vec<T>, t: usize) -> Result<T, TrainError> {
    if t < buffers.len() {
        Ok(buffers.swap_remove(t))
    } else {
        Err(no_tower_buffer(t))
    }
}

/// No vision-tower gradient buffer `t`.
fn no_tower_buffer(t: usize) -> TrainError {
    TrainError::Internal(format!("no vision-tower gradient buffer {t}"))
}

/// Zeroes `opt`'s gradients (the model's and the tower's) before an accumulation, whose
/// stochastic rounding of gradients stored in bf16 is keyed by the optimizer's seed and
/// step (the same bits in a resumed run).
pub(crate) fn zero_grads<B: Backend>(be: &B, opt: &mut Optimizer<B>) -> Result<(), TrainError> {
    opt.grads.zero(be)?;
    opt.grads.set_rounding(opt.adamw.rounding_seed(), opt.steps);
    if let Some(t) = &mut opt.tower {
        t.grads.zero(be)?;
        t.grads.set_rounding(opt.adamw.rounding_seed(), opt.steps);
    }
    Ok(())
}

/// `opt`'s gradients as one host vector, buffer after buffer (bf16 ones widened).
fn grads_to_host<B: Backend>(be: &B, opt: &Optimizer<B>) -> Result<Vec<f32>, TrainError> {
    let lens = grad_lens(opt);
    let mut out = vec![0.0f32; lens.iter().sum()];
    let mut at = 0;
    for (i, len) in lens.into_iter().enumerate() {
        read_grads(be, opt, (i, 0), &mut out[at..at + len])?;
        at += len;
    }
    Ok(out)
}

/// Writes `host` (laid out as [`grads_to_host`] reads) into `opt`'s gradients (into bf16
/// ones rounded to nearest).
fn grads_from_host<B: Backend>(
    be: &B,
    opt: &mut Optimizer<B>,
    host: &[f32],
) -> Result<(), TrainError> {
    let mut at = 0;
    for (i, len) in grad_lens(opt).into_iter().enumerate() {
        write_grads(be, opt, (i, 0), &host[at..at + len])?;
        at += len;
    }
    Ok(())
}

/// Sums `opt`'s gradients over `ranks` on the device when the transport can (NCCL on
/// GPUs), in one group: each buffer to every rank, or under ZeRO-1 (`spans`) to its owner
/// alone; `false` when it cannot, and nothing was summed.
fn sum_on_device<B: Backend>(
    ranks: &Ranks,
    be: &B,
    opt: &mut Optimizer<B>,
    spans: Option<&[(usize, Holder)]>,
) -> Result<bool, TrainError> {
    let mut all = opt.grads.stored_mut();
    if let Some(t) = &mut opt.tower {
        all.extend(t.grads.stored_mut());
    }
    let mut items: Vec<(TrainableMut<'_, B>, Option<usize>)> = all
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let root = match spans.and_then(|s| s.get(i)) {
                Some(&(_, Holder::Rank(r))) => Some(r),
                _ => None,
            };
            (b, root)
        })
        .collect();
    // the backward's kernels first (NCCL runs on its own stream)
    be.synchronize()?;
    match ranks.sum_device(&mut items) {
        Some(r) => {
            r?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// What one mini-batch's forward and backward passes gave.
enum MiniBatch {
    /// No valid token: no optimizer step.
    Empty,
    /// A loss or gradient not finite: the step is counted and skipped.
    NonFinite,
    /// Gradients accumulated, and the mini-batch's losses and metrics.
    Learned(MicroLoss),
}

/// A micro-batch's rows of the prepared batch's per-token tensors.
struct Rows {
    mask: Vec<f32>,
    old: Vec<f32>,
    advantages: Vec<f32>,
    forking: Option<Vec<f32>>,
    rollout: Option<Vec<f32>>,
    reference: Option<Vec<f32>>,
    hwe: Option<Vec<f32>>,
    beta: Vec<f32>,
}

impl Rows {
    /// Rows `micro` of `batch` and `prep`.
    fn gather(batch: &Batch, prep: &Prepared, settings: &StepSettings, micro: &[usize]) -> Self {
        let g = |v: &[f32]| gather_rows(v, batch.tokens.cols(), micro);
        Self {
            mask: g(&batch.tokens.mask),
            old: g(&prep.scored.old_logp),
            advantages: g(&prep.advantages.values),
            forking: prep.forking.as_ref().map(|f| g(&f.keep)),
            rollout: settings
                .uses_rollout_log_probs
                .then(|| g(&prep.rollout_logp)),
            reference: prep.scored.ref_logp.as_ref().map(|r| g(r)),
            hwe: prep.scored.hwe_mask.as_ref().map(|h| g(h)),
            beta: micro.iter().map(|&r| prep.scored.beta[r]).collect(),
        }
    }

    /// The policy loss's inputs for log-probs `logp`, and the KL loss's when the run has
    /// one.
    fn loss_inputs<'a>(
        &'a self,
        shape: ares_core::Shape,
        logp: &'a [f32],
        settings: &StepSettings,
    ) -> (MicroBatch<'a>, Option<KlLoss<'a>>) {
        let input = MicroBatch {
            shape,
            mask: &self.mask,
            logp,
            logp_old: &self.old,
            logp_rollout: self.rollout.as_deref(),
            advantages: &self.advantages,
            forking: self.forking.as_deref(),
        };
        let kl = match (&self.reference, settings.kl.use_kl_loss) {
            (Some(logp_ref), true) => Some(KlLoss {
                estimator: settings.kl.estimator,
                beta: &self.beta,
                hwe_mask: self.hwe.as_deref(),
                low_ratio: settings.kl.low_ratio as f32,
                logp_ref,
            }),
            _ => None,
        };
        (input, kl)
    }
}

/// One update's inputs, and the activation arena its micro-batches reuse.
struct Update<'a, B: Backend> {
    inputs: Inputs<'a>,
    /// How every micro-batch is laid out (one shape: one arena).
    layout: Layout,
    /// Planned for the micro-batches' shape (the last, shorter one of a padded layout
    /// gets its own).
    arena: Option<Activations<B>>,
}

/// A micro-batch's loss, ∂L/∂logπ per token, and ∂L/∂H per token with an entropy bonus.
type LossGrads = (MicroLoss, Vec<f32>, Option<Vec<f32>>);

/// What an update reads: its settings, the batch and what `prepare` made of it.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    settings: &'a StepSettings,
    batch: &'a Batch,
    prep: &'a Prepared,
}

impl<B: Backend> Update<'_, B> {
    /// Zeroes the gradients and accumulates those of every micro-batch of `mini`.
    fn mini_batch(
        &mut self,
        mini: &[usize],
        actor: &mut Actor<B>,
        opt: &mut Optimizer<B>,
    ) -> Result<MiniBatch, TrainError> {
        if let Some(ranks) = self.inputs.settings.ranks.clone() {
            return self.mini_batch_ranks(&ranks, mini, actor, opt);
        }
        let mini_size = count(self.inputs.batch, mini);
        zero_grads(actor.backend(), opt)?;
        let mut acc = MicroLoss::default();
        let (mut micros, mut pending) = (0usize, Vec::new());
        if mini_size.0 > 0 {
            for (index, micro) in mini
                .chunks(self.inputs.settings.micro_batch.max(1))
                .enumerate()
            {
                let (micro_tokens, micro_rows) = count(self.inputs.batch, micro);
                if micro_tokens == 0 {
                    continue;
                }
                let agg = self.inputs.settings.policy.agg;
                let scale = micro_scale(agg, micro_tokens, mini_size.0, micro_rows, mini_size.1);
                let Some(loss) = self.micro_batch(micro, index, scale, actor, opt)? else {
                    return Ok(MiniBatch::NonFinite);
                };
                pending.push(loss);
            }
        }
        // the queued losses' reports, read once every micro-batch is queued, in order
        for loss in pending {
            let Some(loss) = loss.read(actor.backend())? else {
                return Ok(MiniBatch::NonFinite);
            };
            add_micro(&mut acc, &loss, mini_size.0);
            micros += 1;
        }
        Ok(if micros == 0 {
            MiniBatch::Empty
        } else {
            MiniBatch::Learned(acc)
        })
    }

    /// [`Update::mini_batch`] in a data-parallel run: each rank computes its block of the
    /// micro-batches and every rank gets every micro-batch's losses. The gradients, by
    /// `trainer.gradient_sum`: `slices` — each micro-batch into zeroed gradients, the
    /// slices summed in micro-batch order, so the result is the same bits at any world
    /// size (see [`crate::parallel`]); `ranks` — each rank's micro-batches accumulated as
    /// without ranks, the ranks' sums added in rank order (after the backward, or layer by
    /// layer during this rank's last one: `overlap.rs`).
    fn mini_batch_ranks(
        &mut self,
        ranks: &Ranks,
        mini: &[usize],
        actor: &mut Actor<B>,
        opt: &mut Optimizer<B>,
    ) -> Result<MiniBatch, TrainError> {
        let mini_size = count(self.inputs.batch, mini);
        let micros: Vec<&[usize]> = mini
            .chunks(self.inputs.settings.micro_batch.max(1))
            .collect();
        // slices: each micro-batch into zeroed gradients; ranks: this rank's micro-batches
        // accumulated in its GEMMs, as a run without ranks does
        let slices_mode = self.inputs.settings.gradient_sum == GradientSum::Slices;
        if !slices_mode {
            zero_grads(actor.backend(), opt)?;
        }
        // ZeRO-1: each rank receives the sums of the buffers it updates (and the tower's)
        let tower: Vec<usize> = opt
            .tower
            .as_ref()
            .map(|t| t.grads.lens())
            .unwrap_or_default();
        let spans = zero::gradient_spans(ranks, &opt.adamw, &opt.grads, &tower);
        // ranks: the sum starts in this rank's last backward, layer by layer (overlap.rs)
        let on_device = (opt.grads.buffers_mut().into_iter())
            .next()
            .is_some_and(|b| ranks.sums_on_device(b));
        let overlapped = !slices_mode
            && ranks.world() > 1
            && mini_size.0 > 0
            && self
                .inputs
                .settings
                .overlap_gradient_sum
                .unwrap_or(on_device);
        let layers = actor.lm().spec().layers;
        let mut overlap = overlapped
            .then(|| overlap::Overlap::start(ranks, opt, layers, spans.as_deref(), on_device));
        let last = (0..micros.len())
            .rev()
            .find(|&i| ranks.owner(i, micros.len()) == ranks.rank());
        if last.is_none()
            && let Some(o) = overlap.take()
        {
            // no micro-batch here: this rank's zeros join the sum
            o.finish(actor.backend(), opt)?;
        }
        let mut slices: Vec<Vec<f32>> = Vec::new();
        let mut context = (actor, opt, &mut slices);
        let units = ranks.map_units_then(
            micros.len(),
            &mut context,
            |(actor, opt, slices), index| {
                let last = Some(index) == last;
                if last && let Some(o) = &overlap {
                    opt.grads.watch_layers(Some(o.watch()));
                }
                let mut unit = (|| {
                    let micro = micros[index];
                    let (micro_tokens, micro_rows) = count(self.inputs.batch, micro);
                    if mini_size.0 == 0 || micro_tokens == 0 {
                        return Ok(None);
                    }
                    if slices_mode {
                        zero_grads(actor.backend(), opt)?;
                    }
                    let agg = self.inputs.settings.policy.agg;
                    let scale =
                        micro_scale(agg, micro_tokens, mini_size.0, micro_rows, mini_size.1);
                    let loss = self.micro_batch(micro, index, scale, actor, opt)?;
                    if slices_mode && loss.is_some() {
                        slices.push(grads_to_host(actor.backend(), opt)?);
                    }
                    Ok(Some(loss))
                })();
                // the sum is completed on every rank, even one whose micro-batch failed
                // (the ranks' operations stay in step; the failure is reported after)
                if (last || unit.is_err())
                    && let Some(o) = overlap.take()
                {
                    let summed = o.finish(actor.backend(), opt);
                    unit = unit.and_then(|u| summed.map(|()| u));
                }
                unit
            },
            // the queued losses' reports, read once this rank's micro-batches are queued
            |(actor, _, _), units| {
                let mut out = Vec::with_capacity(units.len());
                for unit in units {
                    let mut w = Writer::default();
                    // no tokens; a loss found not finite at once; a loss to read
                    let loss = match unit {
                        None => None,
                        Some(None) => Some(None),
                        Some(Some(pending)) => Some(pending.read(actor.backend())?),
                    };
                    match loss {
                        None => w.u8(SLICE_EMPTY),
                        Some(None) => w.u8(SLICE_NON_FINITE),
                        Some(Some(loss)) => {
                            w.u8(SLICE_LEARNED);
                            for v in [
                                loss.pg_loss,
                                loss.kl_loss,
                                loss.clipfrac,
                                loss.clipfrac_lower,
                                loss.ppo_kl,
                                loss.selected_frac,
                                loss.entropy,
                                loss.entropy_loss,
                            ] {
                                w.f64(v);
                            }
                            w.u64(loss.tokens as u64);
                        }
                    }
                    out.push(w.finish());
                }
                Ok(out)
            },
        )?;
        let (actor, opt, _) = context;
        let bad = |e: crate::parallel::wire::WireError| TrainError::from(e.at(ranks.rank()));
        let mut acc = MicroLoss::default();
        let mut micros_learned = 0usize;
        for bytes in &units {
            let mut r = Reader::new(bytes);
            match r.u8().map_err(bad)? {
                SLICE_EMPTY => continue,
                SLICE_NON_FINITE => return Ok(MiniBatch::NonFinite),
                _ => {}
            }
            let mut f = || r.f64().map_err(bad);
            let loss = MicroLoss {
                pg_loss: f()?,
                kl_loss: f()?,
                clipfrac: f()?,
                clipfrac_lower: f()?,
                ppo_kl: f()?,
                selected_frac: f()?,
                entropy: f()?,
                entropy_loss: f()?,
                tokens: usize::try_from(r.u64().map_err(bad)?).unwrap_or(usize::MAX),
            };
            r.end().map_err(bad)?;
            // the sums of the run without ranks, in its order
            add_micro(&mut acc, &loss, mini_size.0);
            micros_learned += 1;
        }
        if micros_learned == 0 {
            return Ok(MiniBatch::Empty);
        }
        if slices_mode {
            let mut total = vec![0.0f32; grads_len(opt)];
            match &spans {
                Some(spans) => ranks.ordered_sum_held(&slices, spans, &mut total)?,
                None => ranks.ordered_sum(&slices, &mut total)?,
            }
            grads_from_host(actor.backend(), opt, &total)?;
        } else if ranks.world() > 1
            && !overlapped
            && !sum_on_device(ranks, actor.backend(), opt, spans.as_deref())?
        {
            let mine = grads_to_host(actor.backend(), opt)?;
            let total = match &spans {
                Some(spans) => {
                    let mut held = vec![0.0f32; mine.len()];
                    ranks.ordered_sum_held(std::slice::from_ref(&mine), spans, &mut held)?;
                    held
                }
                None => {
                    let mut all = mine;
                    ranks.all_reduce_sum(&mut all)?;
                    all
                }
            };
            grads_from_host(actor.backend(), opt, &total)?;
        }
        Ok(MiniBatch::Learned(acc))
    }

    /// Micro-batch `index` (rows `micro`, its share `scale` of the mini-batch, see
    /// [`micro_scale`]): forward, logπ, the loss and ∂L/∂logπ (and an entropy bonus's
    /// ∂L/∂H), backward into the accumulated gradients; the loss as the host computed it,
    /// or queued on the device with its report still to read ([`PendingLoss`]). `None` when
    /// a loss or the entropy was found not finite at once.
    fn micro_batch(
        &mut self,
        micro: &[usize],
        index: usize,
        scale: f32,
        actor: &mut Actor<B>,
        opt: &mut Optimizer<B>,
    ) -> Result<Option<PendingLoss<B>>, TrainError> {
        let read = self.inputs;
        let batch = read.batch;
        let (t, temperature) = (batch.tokens.cols(), read.settings.sampling.temperature());
        // bf16 gradients' stochastic rounding keyed by the micro-batch, not by the rank
        // that runs it or the passes before it there: the same bits at any world size
        opt.grads.set_rounding_pass(index as u64);
        if let Some(t) = &mut opt.tower {
            t.grads.set_rounding_pass(index as u64);
        }
        let packed = batch.pack(micro, self.layout)?;
        let shape = (packed.batch(), packed.seq());
        let acts = match &mut self.arena {
            Some(a) if a.shape() == shape => a,
            _ => self.arena.insert(actor.lm().activations(shape.0, shape.1)?),
        };
        let vision = batch.vision(micro);
        let inputs = packed.inputs();
        let mut pass = actor.forward(&packed, vision.as_ref(), acts, opt.tower.is_some())?;
        let shape = ares_core::Shape {
            rows: micro.len(),
            cols: t,
        };
        let step = (opt.steps, index, scale);
        if actor.backend().has_actor_loss(&read.settings.objective) {
            // the loss where the log-probs are (update/device.rs)
            actor
                .lm()
                .log_prob_entropy(acts, &packed.targets, temperature)?;
            let Some(queued) = read.device_loss(micro, step, shape, &packed, actor.lm(), acts)?
            else {
                return Ok(None);
            };
            let entropy = read.prep.entropy_coef.is_some_and(|c| c != 0.0);
            actor.backward_from_device_log_prob_grads(
                &inputs,
                acts,
                &mut pass,
                &packed.targets,
                temperature,
                &mut opt.grads,
                opt.tower.as_mut(),
                entropy,
            )?;
            // the report is read after the backward (and the next micro-batches) are
            // queued: the device never waits for the host between them
            return Ok(Some(PendingLoss::Queued(queued)));
        }
        let (logp, entropy) = crate::trainer::prepare::sequences::response_log_probs_after_forward(
            actor.lm(),
            acts,
            &packed,
            temperature,
        )?;
        let Some((loss, coeffs, dh)) = read.loss(micro, step, shape, &logp, &entropy)? else {
            return Ok(None);
        };
        let spread = packed.spread_response(&coeffs);
        let entropy_grad = dh.map(|d| packed.spread_response(&d));
        actor.backward_from_log_prob_grads(
            &inputs,
            acts,
            &mut pass,
            &packed.targets,
            &spread,
            temperature,
            &mut opt.grads,
            opt.tower.as_mut(),
            entropy_grad.as_deref(),
        )?;
        Ok(Some(PendingLoss::Known(loss)))
    }

    /// Advances the schedule's clock and, when the gradients are `finite`, steps AdamW;
    /// `(grad_norm, lr)` when the step was applied.
    fn optimizer_step(
        &self,
        actor: &mut Actor<B>,
        opt: &mut Optimizer<B>,
        finite: bool,
    ) -> Result<Option<(f32, f64)>, TrainError> {
        let optim = &self.inputs.settings.optim;
        let lr = optim.lr_at(opt.steps);
        opt.steps += 1;
        if !finite {
            return Ok(None);
        }
        // ZeRO-1: the norm from every rank's share of the summed gradients
        let ranks = self.inputs.settings.ranks.as_ref();
        let sums = match ranks.filter(|r| r.world() > 1 && opt.adamw.owned().is_some()) {
            Some(ranks) => {
                let tower: Vec<Stored<'_, B>> = opt
                    .tower
                    .as_ref()
                    .map(|t| t.grads.stored())
                    .unwrap_or_default();
                Some(zero::gather_grad_sums(
                    ranks,
                    actor.lm(),
                    &opt.adamw,
                    &opt.grads,
                    &tower,
                )?)
            }
            None => None,
        };
        let tower = opt.tower.as_mut();
        let r = actor.optimizer_step(
            &mut opt.adamw,
            &opt.grads,
            tower,
            lr,
            optim.max_grad_norm,
            sums.as_deref(),
        )?;
        // ZeRO-1: this rank updated its share; the ranks swap the updated buffers
        if let (true, Some(ranks), Some(owned)) = (
            r.applied,
            self.inputs
                .settings
                .ranks
                .as_ref()
                .filter(|r| r.world() > 1),
            opt.adamw.owned().map(<[bool]>::to_vec),
        ) {
            zero::share_updated(ranks, actor.lm_mut(), &owned)?;
        }
        Ok(r.applied.then_some((r.grad_norm, lr)))
    }

    /// Adds an applied mini-batch's losses and metrics to `sums`.
    fn add_metrics(&self, sums: &mut Metrics, acc: &MicroLoss, grad_norm: f32, lr: f64) {
        for (k, v) in [
            ("actor/pg_loss", acc.pg_loss),
            ("actor/kl_loss", acc.kl_loss),
            ("actor/clipfrac", acc.clipfrac),
            ("actor/clipfrac_lower", acc.clipfrac_lower),
            ("actor/ppo_kl", acc.ppo_kl),
            ("actor/grad_norm", f64::from(grad_norm)),
            ("actor/lr", lr),
        ] {
            *sums.entry(k.into()).or_default() += v;
        }
        if self.inputs.prep.entropy_coef.is_some() {
            *sums.entry("actor/entropy".into()).or_default() += acc.entropy;
            *sums.entry("actor/entropy_loss".into()).or_default() += acc.entropy_loss;
        }
        if self.inputs.settings.objective.selects_tokens() {
            *sums.entry("actor/selected_frac".into()).or_default() += acc.selected_frac;
        }
    }
}

impl Inputs<'_> {
    /// The loss of micro-batch `index` (rows `micro`, `[rows, T]` log-probs `logp` and
    /// entropies `entropy`), its share `scale` of the mini-batch, at optimizer step
    /// `steps`: its values, ∂L/∂logπ per token and, with an entropy bonus,
    /// ∂L/∂H per token. `None` when a loss or the entropy is not finite.
    fn loss(
        &self,
        micro: &[usize],
        (steps, index, scale): (u64, usize, f32),
        shape: ares_core::Shape,
        logp: &[f32],
        entropy: &[f32],
    ) -> Result<Option<LossGrads>, TrainError> {
        let (settings, prep) = (self.settings, self.prep);
        let rows = Rows::gather(self.batch, prep, settings, micro);
        let (input, kl) = rows.loss_inputs(shape, logp, settings);
        let n = shape.rows * shape.cols;
        let mut coeffs = vec![0.0f32; n];
        // the entropy bonus −c·agg(H_t) (docs/algorithms.md §16.2): its gradient goes to the
        // loss head as ∂L/∂H_t, beside ∂L/∂logπ_t
        let coef = prep.entropy_coef.filter(|&c| c != 0.0);
        let mut dh = coef.map(|_| vec![0.0f32; n]);
        let terms = Terms {
            kl,
            entropy: coef.map(|c| EntropyTerm {
                coef: c as f32,
                entropy,
            }),
        };
        // Clip-Cov's selection: fixed by the run's seed, the optimizer step and the
        // micro-batch, so a resumed run selects the same tokens.
        let seed = settings
            .rollout_seed
            .wrapping_add(steps.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(index as u64);
        let (policy, objective) = (&settings.policy, &settings.objective);
        let grads = (&mut coeffs[..], dh.as_deref_mut());
        match micro_loss(&input, policy, objective, seed, terms, scale, grads) {
            Ok(mut l) if l.pg_loss.is_finite() && l.kl_loss.is_finite() => {
                if let Some(c) = coef {
                    l.entropy_loss = -c * l.entropy;
                }
                Ok(Some((l, coeffs, dh)))
            }
            // a non-finite loss or input (entropy included) skips the mini-batch
            Ok(_) | Err(TrainError::Core(ares_core::Error::NonFinite { .. })) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
