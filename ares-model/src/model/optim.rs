//! [`AdamW`] over a [`Model`]'s parameters: the global gradient norm, a skipped step when
//! it is not finite, clipping, and PyTorch's AdamW update, every tensor updated on the
//! device by [`Backend::adamw_step`]. The model's f32 buffers are the master weights.

use super::weights::DeviceWeights;
use super::{Grads, Model, ModelError};
use crate::backend::{AdamWUpdate, Backend, DeviceBuffer, View, ViewMut};

pub use crate::backend::AdamWConfig;

/// A parameter outside the model's decoder that [`AdamW::step_with`] updates with it: the
/// parameter, its gradient and its AdamW moments (all the same length).
pub struct ExtraParam<'a, B: Backend> {
    /// The parameter.
    pub param: &'a mut B::Buffer,
    /// Its accumulated gradient.
    pub grad: &'a B::Buffer,
    /// First moment.
    pub exp_avg: &'a mut B::Buffer,
    /// Second moment.
    pub exp_avg_sq: &'a mut B::Buffer,
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
pub struct AdamW<B: Backend> {
    pub(crate) config: AdamWConfig,
    /// Updates applied so far.
    pub(crate) step: u64,
    pub(crate) exp_avg: DeviceWeights<B>,
    pub(crate) exp_avg_sq: DeviceWeights<B>,
}

impl<B: Backend> std::fmt::Debug for AdamW<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

/// Checks `config` (β in `[0, 1)`, ε finite and > 0, decay finite and >= 0).
pub(crate) fn check_config(config: &AdamWConfig) -> Result<(), ModelError> {
    config.validate().map_err(ModelError::AdamWConfig)
}

impl<B: Backend> AdamW<B> {
    /// A fresh optimizer for `model`: zero moments, no step taken.
    ///
    /// # Errors
    /// [`ModelError::AdamWConfig`] for a bad `config` field, or a backend allocation
    /// failure.
    pub fn new(model: &Model<B>, config: AdamWConfig) -> Result<Self, ModelError> {
        check_config(&config)?;
        Ok(Self {
            config,
            step: 0,
            exp_avg: model.weights.zeros_like(&model.backend)?,
            exp_avg_sq: model.weights.zeros_like(&model.backend)?,
        })
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
        let w = &mut model.weights;
        if !w.same_layout(&grads.g) {
            return Err(ModelError::LayoutMismatch { what: "gradients" });
        }
        if !w.same_layout(&self.exp_avg) || !w.same_layout(&self.exp_avg_sq) {
            return Err(ModelError::LayoutMismatch {
                what: "optimizer moments",
            });
        }
        let be = &model.backend;
        let g = grads.g.buffers();
        let mut total = 0.0f64;
        for buffer in &g {
            total += be.sum_of_squares(View::whole(*buffer))?;
        }
        for (i, e) in extra.iter().enumerate() {
            let n = e.param.len();
            if e.grad.len() != n || e.exp_avg.len() != n || e.exp_avg_sq.len() != n {
                return Err(ModelError::LayoutMismatch {
                    what: if i == 0 {
                        "extra parameter 0"
                    } else {
                        "extra parameters"
                    },
                });
            }
            total += be.sum_of_squares(View::whole(e.grad))?;
        }
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
        let params = w.buffers_mut();
        let moments = self
            .exp_avg
            .buffers_mut()
            .into_iter()
            .zip(self.exp_avg_sq.buffers_mut());
        for ((p, g), (m, v)) in params.into_iter().zip(g).zip(moments) {
            be.adamw_step(
                ViewMut::whole(p),
                View::whole(g),
                ViewMut::whole(m),
                ViewMut::whole(v),
                &update,
            )?;
        }
        for e in extra.iter_mut() {
            be.adamw_step(
                ViewMut::whole(&mut *e.param),
                View::whole(e.grad),
                ViewMut::whole(&mut *e.exp_avg),
                ViewMut::whole(&mut *e.exp_avg_sq),
                &update,
            )?;
        }
        self.step += 1;
        Ok(StepReport {
            grad_norm,
            applied: true,
        })
    }
}
