//! [`AdamW`] over a [`Model`]'s parameters: the global gradient norm, a skipped step when
//! it is not finite, clipping, and PyTorch's AdamW update, every tensor updated on the
//! device by [`Backend::adamw_step`] (or its bf16 / 8-bit twin, as the moments'
//! [`StateDtype`] says). The model's f32 buffers are the master weights.

use super::moments::{Moments, StateDtype, int8_maps};
use super::{Grads, Model, ModelError, TrainableMut};
use crate::backend::{AdamWUpdate, Backend, DeviceBuffer, Stored, ViewMut};

pub use crate::backend::AdamWConfig;

/// A parameter outside the model's decoder that [`AdamW::step_with`] updates with it: the
/// parameter, its gradient and its AdamW moments (all the same length).
pub struct ExtraParam<'a, B: Backend> {
    /// The parameter: f32, or a weight stored in bf16 (updated with stochastic rounding).
    pub param: TrainableMut<'a, B>,
    /// Its accumulated gradient, as stored (f32, or bf16 bits the update reads widened).
    pub grad: Stored<'a, B>,
    /// Its two moments.
    pub moments: &'a mut Moments<B>,
}

/// What one [`AdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradients before clipping, `√(Σ_params Σ g²)` (NaN or +∞ when
    /// a gradient is).
    pub grad_norm: f32,
    /// Whether the update was applied; `false` exactly when `grad_norm` is not finite.
    pub applied: bool,
}

/// The AdamW optimizer (Loshchilov & Hutter's decoupled weight decay, with PyTorch's
/// `torch.optim.AdamW` arithmetic): per parameter, first and second moments laid out like
/// the weights, on the model's backend.
///
/// One [`AdamW::step`], with `g` the accumulated gradient and `t` the step number:
///
/// ```text
/// norm = √(Σ g²)                          over every parameter (f64 sum)
/// norm not finite → skip: nothing changes, t does not advance
/// s    = min(1, max_grad_norm / (norm + 1e-6))     (1 without clipping)
/// g    ← s·g
/// θ    ← θ·(1 − lr·wd)
/// m    ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²
/// θ    ← θ − lr/(1 − β1ᵗ) · m / (√v/√(1 − β2ᵗ) + ε)
/// ```
///
/// Weight decay applies to every parameter (norms and biases included), as
/// `torch.optim.AdamW(model.parameters())` does. Tied embeddings are one parameter.
///
/// The moments are stored as the [`StateDtype`] says: f32, or rounded to bf16, or 8-bit
/// block-wise codes; the update itself is the f32 arithmetic above in every case, on the
/// moments as read back.
pub struct AdamW<B: Backend> {
    pub(crate) config: AdamWConfig,
    /// Updates applied so far.
    pub(crate) step: u64,
    /// How the moments are stored.
    pub(crate) state_dtype: StateDtype,
    /// The moments of each of the model's weight buffers, in `DeviceWeights::buffers` order.
    pub(crate) moments: Vec<Moments<B>>,
    /// Which of those buffers this optimizer updates (`None`: all). Under ZeRO-1 a rank
    /// updates its share and holds no moments for the others ([`AdamW::shard`]).
    pub(crate) owned: Option<Vec<bool>>,
    /// The 8-bit dynamic maps on the device (read by 8-bit moments only).
    pub(crate) maps: B::Buffer,
    /// The seed of the stochastic rounding of weights stored in bf16 ([`AdamW::set_rounding_seed`]).
    pub(crate) rounding_seed: u64,
}

impl<B: Backend> std::fmt::Debug for AdamW<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("step", &self.step)
            .field("state_dtype", &self.state_dtype)
            .finish_non_exhaustive()
    }
}

/// Checks `config` (β in `[0, 1)`, ε finite and > 0, decay finite and >= 0).
pub(crate) fn check_config(config: &AdamWConfig) -> Result<(), ModelError> {
    config.validate().map_err(ModelError::AdamWConfig)
}

impl<B: Backend> AdamW<B> {
    /// A fresh optimizer for `model` with f32 moments: zero moments, no step taken.
    ///
    /// # Errors
    /// [`ModelError::AdamWConfig`] for a bad `config` field, or a backend allocation
    /// failure.
    pub fn new(model: &Model<B>, config: AdamWConfig) -> Result<Self, ModelError> {
        Self::with_state_dtype(model, config, StateDtype::F32)
    }

    /// [`AdamW::new`] with the moments stored as `state_dtype` says.
    ///
    /// # Errors
    /// As [`AdamW::new`].
    pub fn with_state_dtype(
        model: &Model<B>,
        config: AdamWConfig,
        state_dtype: StateDtype,
    ) -> Result<Self, ModelError> {
        check_config(&config)?;
        let be = &model.backend;
        let moments = model
            .trainable_lens()
            .into_iter()
            .zip(model.trainable_items())
            .map(|(len, item)| Moments::zeros(be, len, item, state_dtype))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            config,
            step: 0,
            state_dtype,
            moments,
            maps: upload_maps(be)?,
            owned: None,
            rounding_seed: 0,
        })
    }

    /// Seeds the stochastic rounding with which weights stored in bf16 take their updates
    /// ([`Model::set_weight_storage`]; 0 by default). The bits a tensor draws follow from
    /// the seed, the step and the tensor alone, so a resumed run given the same seed
    /// rounds as the uninterrupted one.
    pub fn set_rounding_seed(&mut self, seed: u64) {
        self.rounding_seed = seed;
    }

    /// The seed of the stochastic rounding ([`AdamW::set_rounding_seed`]), which gradients
    /// stored in bf16 also draw from ([`Grads::set_rounding`]).
    pub fn rounding_seed(&self) -> u64 {
        self.rounding_seed
    }

    /// How the moments are stored.
    pub fn state_dtype(&self) -> StateDtype {
        self.state_dtype
    }

    /// Zero moments for an extra parameter group of `len` elements made of tensors of
    /// `item` elements (a vision tower's slot), stored as this optimizer's moments are.
    ///
    /// # Errors
    /// As [`Moments::zeros`].
    pub fn extra_moments(&self, be: &B, len: usize, item: usize) -> Result<Moments<B>, ModelError> {
        Moments::zeros(be, len, item, self.state_dtype)
    }

    /// Bytes the moments of the model's parameters take on the device.
    pub fn moment_bytes(&self) -> u64 {
        self.moments.iter().map(Moments::bytes).sum()
    }

    /// Whether these moments are for buffers of `lens` (the same count, each as long; a
    /// buffer another rank updates holds none).
    pub(crate) fn fits(&self, lens: impl ExactSizeIterator<Item = usize>) -> bool {
        lens.len() == self.moments.len()
            && lens
                .zip(&self.moments)
                .enumerate()
                .all(|(i, (n, m))| m.len() == if self.owns(i) { n } else { 0 })
    }

    /// Whether this optimizer updates the model's trainable buffer `buffer`.
    pub fn owns(&self, buffer: usize) -> bool {
        self.owned
            .as_ref()
            .is_none_or(|o| o.get(buffer) == Some(&true))
    }

    /// Which trainable buffers this optimizer updates (`None`: all of them).
    pub fn owned(&self) -> Option<&[bool]> {
        self.owned.as_deref()
    }

    /// ZeRO-1: from now on this optimizer updates only the trainable buffers marked in
    /// `owned` (one flag per buffer of [`Model::trainable_buffers`]) and drops the others'
    /// moments. The gradient norm is still taken over every buffer, so each rank clips by
    /// the same factor; the caller shares the updated buffers among the ranks.
    ///
    /// # Errors
    /// A flag count other than the buffers'; sharding twice; a backend failure.
    pub fn shard(&mut self, be: &B, owned: Vec<bool>) -> Result<(), ModelError> {
        if owned.len() != self.moments.len() || self.owned.is_some() {
            return Err(ModelError::LayoutMismatch {
                what: "optimizer shard (one flag per trainable buffer, once)",
            });
        }
        for (m, &own) in self.moments.iter_mut().zip(&owned) {
            if !own {
                *m = m.emptied(be)?;
            }
        }
        self.owned = Some(owned);
        Ok(())
    }

    /// Updates applied so far (skipped steps not counted); the next update uses bias
    /// corrections for `step_count() + 1`.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// β1, β2, ε and the weight decay.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// One optimizer step of `model` from `grads` (see [`AdamW`] for the arithmetic) at
    /// learning rate `lr` (e.g. from `ares_cpu::ops::optim::LrSchedule`), clipping the
    /// global gradient norm to `max_grad_norm` when given. `grads` is not modified (the
    /// clipping factor is folded into the update); zero it before the next accumulation.
    ///
    /// A non-finite global norm skips the step: weights, moments and the step count stay
    /// as they were and the report says `applied: false`, so the caller can count skipped
    /// steps.
    ///
    /// # Errors
    /// `lr` not finite and `>= 0`, `max_grad_norm` not finite and `>= 0`
    /// ([`ModelError::InvalidValue`]), `grads` or this optimizer made for another model
    /// ([`ModelError::LayoutMismatch`]) — all found before anything changes — or a
    /// backend failure.
    pub fn step(
        &mut self,
        model: &mut Model<B>,
        grads: &Grads<B>,
        lr: f64,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport, ModelError> {
        self.step_with(model, grads, &mut [], lr, max_grad_norm)
    }

    /// [`AdamW::step`] over the model's parameters and `extra` ones (another module's, such
    /// as a vision tower's, each with its gradient and its two moments): one global
    /// gradient norm over all of them, one clipping scale, one step count.
    ///
    /// # Errors
    /// As [`AdamW::step`]; an extra group whose buffers differ in length.
    pub fn step_with(
        &mut self,
        model: &mut Model<B>,
        grads: &Grads<B>,
        extra: &mut [ExtraParam<'_, B>],
        lr: f64,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport, ModelError> {
        self.step_with_sums(model, grads, extra, lr, max_grad_norm, None)
    }

    /// Each gradient's `Σ g²` in the order the global norm adds them — the model's
    /// trainable buffers, then `extra_grads` — or `None` for a buffer another rank owns
    /// (ZeRO-1), whose summed gradient this rank may not hold: the owners' values complete
    /// the list for [`AdamW::step_with_sums`].
    ///
    /// # Errors
    /// A backend failure.
    pub fn grad_sums(
        &self,
        model: &Model<B>,
        grads: &Grads<B>,
        extra_grads: &[Stored<'_, B>],
    ) -> Result<Vec<Option<f64>>, ModelError> {
        // one multi-tensor read for all of them (the owned ones: a buffer another rank
        // owns may hold a partial sum)
        let stored = grads.stored();
        let owned: Vec<bool> = (0..stored.len()).map(|i| self.owns(i)).collect();
        let views: Vec<Stored<'_, B>> = stored
            .iter()
            .zip(&owned)
            .filter(|(_, own)| **own)
            .map(|(b, _)| *b)
            .chain(extra_grads.iter().copied())
            .collect();
        let mut sums = vec![0.0; views.len()];
        model.backend.sums_of_squares(&views, &mut sums)?;
        let mut sums = sums.into_iter();
        let mut out: Vec<Option<f64>> = owned
            .iter()
            .map(|own| if *own { sums.next() } else { None })
            .collect();
        out.extend(sums.map(Some));
        Ok(out)
    }

    /// [`AdamW::step_with`] with the gradients' `Σ g²` given (`sums`, in
    /// [`AdamW::grad_sums`]'s order; `None`: computed here): a ZeRO-1 rank steps its share
    /// with the norm of every rank's, added in the same order — the unsharded step's bits.
    ///
    /// # Errors
    /// As [`AdamW::step_with`]; `sums` of another length.
    pub fn step_with_sums(
        &mut self,
        model: &mut Model<B>,
        grads: &Grads<B>,
        extra: &mut [ExtraParam<'_, B>],
        lr: f64,
        max_grad_norm: Option<f32>,
        sums: Option<&[f64]>,
    ) -> Result<StepReport, ModelError> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(ModelError::InvalidValue {
                what: "lr".into(),
                value: lr,
                expected: "finite and >= 0",
            });
        }
        if let Some(max) = max_grad_norm
            && !(max.is_finite() && max >= 0.0)
        {
            return Err(ModelError::InvalidValue {
                what: "max_grad_norm".into(),
                value: f64::from(max),
                expected: "finite and >= 0",
            });
        }
        if !model.fits_grads(grads) {
            return Err(ModelError::LayoutMismatch { what: "gradients" });
        }
        if !self.fits(model.trainable_lens().into_iter()) {
            return Err(ModelError::LayoutMismatch {
                what: "optimizer moments",
            });
        }
        let be = &model.backend;
        let g = grads.stored();
        let lens = model.trainable_lens();
        for (i, e) in extra.iter().enumerate() {
            let n = e.param.len();
            if e.grad.len() != n || e.moments.len() != n {
                return Err(ModelError::LayoutMismatch {
                    what: if i == 0 {
                        "extra parameter 0"
                    } else {
                        "extra parameters"
                    },
                });
            }
        }
        if sums.is_some_and(|s| s.len() != g.len() + extra.len()) {
            return Err(ModelError::LayoutMismatch {
                what: "gradient sums (one per trainable buffer and extra parameter)",
            });
        }
        // without `sums`, this rank's own; a sharded optimizer holds only its share of the
        // summed gradients, so it must be given the others' (no silent partial norm)
        let own;
        let sums = match sums {
            Some(s) => s,
            None => {
                let extra_grads: Vec<Stored<'_, B>> = extra.iter().map(|e| e.grad).collect();
                own = self
                    .grad_sums(model, grads, &extra_grads)?
                    .into_iter()
                    .collect::<Option<Vec<f64>>>()
                    .ok_or(ModelError::LayoutMismatch {
                        what: "gradient sums (a sharded optimizer needs every rank's: \
                               step_with_sums)",
                    })?;
                &own
            }
        };
        let mut total = 0.0f64;
        sums.iter().for_each(|s| total += s);
        let grad_norm = total.sqrt() as f32;
        if !total.is_finite() {
            return Ok(StepReport {
                grad_norm,
                applied: false,
            });
        }
        // As torch.nn.utils.clip_grad_norm_: the factor in f32, applied only below 1.
        let grad_scale = max_grad_norm
            .map(|max| (max / (grad_norm + 1e-6)).min(1.0))
            .unwrap_or(1.0);
        let update = AdamWUpdate {
            config: self.config,
            lr,
            step: self.step + 1,
            grad_scale,
        };
        // the bf16 weight copies are written by the update itself (LoRA trains pairs,
        // which have none)
        let copy_of = match (&model.bf16_weights, &model.lora) {
            (Some(c), None) => c.copy_indices(&model.weights),
            _ => Vec::new(),
        };
        let mut copies: Vec<Option<&mut B::Half>> = match &mut model.bf16_weights {
            Some(c) if model.lora.is_none() => c.copies_mut().into_iter().map(Some).collect(),
            _ => Vec::new(),
        };
        let params = match &mut model.lora {
            Some(l) => l.params.buffers_mut(),
            None => model.weights.buffers_mut(),
        };
        let owned = self.owned.clone();
        let updated = |i: usize| owned.as_ref().is_none_or(|o| o[i]);
        let (seed, step) = (self.rounding_seed, update.step);
        // an extra buffer's rounding keys follow the model's buffers' numbering
        let before = g.len();
        for (i, ((p, g), m)) in params.into_iter().zip(g).zip(&mut self.moments).enumerate() {
            if !updated(i) {
                continue;
            }
            let copy = copy_of
                .get(i)
                .copied()
                .flatten()
                .and_then(|k| copies.get_mut(k).and_then(Option::take));
            // a released stack (its copy is the weight) has an empty f32 buffer
            let released = p.is_empty() && lens[i] != 0;
            let key = |t: usize| rounding_key(seed, step, i, t);
            // a gradient kept in bf16 is read as stored: the update widens it
            match copy {
                Some(w16) if released => {
                    m.step_bf16_weight(be, w16, g, &self.maps, &update, key)?;
                }
                copy => m.step(be, p, g, &self.maps, &update, copy, key)?,
            }
        }
        for (j, e) in extra.iter_mut().enumerate() {
            let key = |t: usize| rounding_key(seed, step, before + j, t);
            match &mut e.param {
                TrainableMut::F32(p) => {
                    e.moments
                        .step(be, p, e.grad, &self.maps, &update, None, key)?;
                }
                TrainableMut::Bf16(w16) => {
                    e.moments
                        .step_bf16_weight(be, w16, e.grad, &self.maps, &update, key)?;
                }
            }
        }
        self.step += 1;
        Ok(StepReport {
            grad_norm,
            applied: true,
        })
    }
}

/// The stochastic-rounding key of tensor `tensor` of trainable buffer `buffer` at update
/// `step` under the optimizer's `seed` (SplitMix64's finaliser, chained): every tensor of
/// every step draws its own bits, the same in a resumed run and on any number of ranks.
pub(crate) fn rounding_key(seed: u64, step: u64, buffer: usize, tensor: usize) -> u64 {
    const fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    mix(seed ^ mix(step ^ mix(((buffer as u64) << 32) ^ tensor as u64)))
}

/// [`int8_maps`] on the backend.
pub(crate) fn upload_maps<B: Backend>(be: &B) -> Result<B::Buffer, ModelError> {
    let maps = int8_maps();
    let mut buffer = be.alloc(maps.len())?;
    be.upload(&maps, ViewMut::whole(&mut buffer))?;
    Ok(buffer)
}
