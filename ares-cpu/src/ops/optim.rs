//! The optimizer side of training: AdamW, global gradient norm and clipping, learning-rate
//! schedules.
//!
//! Hyper-parameters are `f64`, as the Python floats of PyTorch and transformers are; the
//! per-element constants derived from them are rounded to `f32` once per step, as PyTorch
//! does when it combines a Python scalar with an `f32` tensor.

use super::precision::{bf16_stochastic, moment_keys, rounding_bits};
use crate::error::check_len;
use ares_core::Error as CoreError;
use rayon::prelude::*;

use crate::Result;

/// Tensors at least this long are processed in parallel chunks of [`CHUNK`] elements.
const PAR_MIN_ELEMS: usize = 1 << 16;
/// Fixed chunk length for parallel passes. Fixed (not derived from the thread count) so that
/// reductions sum in the same order on every machine.
const CHUNK: usize = 1 << 14;

/// AdamW hyper-parameters other than the learning rate, which changes every step (see
/// [`LrSchedule`]) and is passed to [`adamw_step`]. Defaults are PyTorch's
/// `torch.optim.AdamW` defaults: `betas = (0.9, 0.999)`, `eps = 1e-8`, `weight_decay = 0.01`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Decay rate of the first-moment (mean) estimate, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second-moment (uncentred variance) estimate, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator, `> 0`. (PyTorch accepts 0, which turns a zero gradient on a
    /// fresh moment into 0/0 = NaN; refused here.)
    pub eps: f64,
    /// Decoupled weight decay coefficient, `>= 0`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Checks every field; the error names the first bad one.
    ///
    /// # Errors
    /// `OutOfRange` for `beta1` or `beta2` outside `[0, 1)`, `eps` not finite and `> 0`, or
    /// `weight_decay` not finite and `>= 0`.
    pub fn validate(&self) -> Result<()> {
        let unit = |x: f64| (0.0..1.0).contains(&x);
        check("beta1", self.beta1, unit(self.beta1), "in [0, 1)")?;
        check("beta2", self.beta2, unit(self.beta2), "in [0, 1)")?;
        let eps_ok = self.eps.is_finite() && self.eps > 0.0;
        check("eps", self.eps, eps_ok, "finite and > 0")?;
        let wd_ok = self.weight_decay.is_finite() && self.weight_decay >= 0.0;
        check("weight_decay", self.weight_decay, wd_ok, "finite and >= 0")
    }
}

/// One AdamW update of one tensor, in place, with the semantics of PyTorch's
/// `torch.optim.AdamW` (single-tensor path, `amsgrad = False`, `maximize = False`). With
/// `t = step` (1 for the first update) and `lr` this step's learning rate, per element:
///
/// ```text
/// θ ← θ·(1 − lr·wd)                              decoupled decay first, as PyTorch
/// m ← m + (1 − β1)·(g − m)                       = β1·m + (1 − β1)·g (PyTorch's lerp form)
/// v ← β2·v + (1 − β2)·g²
/// θ ← θ − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)
/// ```
///
/// which is `θ ← θ − lr·(m̂/(√v̂ + ε) + wd·θ_old)` with the bias-corrected `m̂`, `v̂`, except
/// that ε is added to `√v̂` exactly where PyTorch adds it. The scalar factors are computed
/// in `f64` and rounded to `f32`, as PyTorch does with Python floats; the element
/// operations run in `f32` in PyTorch's order. (PyTorch's vectorised CPU kernels fuse
/// some multiply-adds, so results agree to `f32` rounding, not bit for bit.)
///
/// `params`, `grads`, `m` (first moment) and `v` (second moment) have the same length; `m`
/// and `v` start at zero and are owned by this tensor.
///
/// # Errors
/// - `LengthMismatch` for `grads`, `m` or `v` not as long as `params`;
/// - `OutOfRange` for `step` 0, `lr` not finite and `>= 0`, or a bad `cfg` field;
/// - `NonFinite` for `grads` at the first NaN or ±∞.
///
/// Everything is checked before anything is written: on error, nothing has changed.
pub fn adamw_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    cfg: &AdamWConfig,
    lr: f64,
) -> Result<()> {
    adamw_step_scaled(params, grads, m, v, step, cfg, lr, 1.0, 0)
}

/// A value stored as f32 itself or as bf16 bits (`u16`), read as f32 — exactly: bf16 is
/// f32's upper half. An AdamW gradient is read through it (gradients kept in bf16 are
/// updated from without a widened copy) and so is a [`Moment`].
pub trait StoredF32: Copy + Send + Sync {
    /// The value in f32.
    fn load(self) -> f32;
    /// The f32 bits of the value (bf16 bits shifted up): finite exactly when
    /// `bits & 0x7fff_ffff <= 0x7f7f_ffff`.
    fn f32_bits(self) -> u32;
}

/// A stored AdamW moment: f32 itself, or bf16 bits widened and rounded stochastically.
pub trait Moment: StoredF32 {
    /// The stored form of `x`, element `index` of a tensor rounded under `key` where the
    /// form rounds (its bits [`rounding_bits`]`(key, index)`).
    fn store(x: f32, key: u64, index: u64) -> Self;
}

impl StoredF32 for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn f32_bits(self) -> u32 {
        self.to_bits()
    }
}

impl Moment for f32 {
    #[inline(always)]
    fn store(x: f32, _key: u64, _index: u64) -> Self {
        x
    }
}

impl StoredF32 for u16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits(self.f32_bits())
    }
    #[inline(always)]
    fn f32_bits(self) -> u32 {
        u32::from(self) << 16
    }
}

impl Moment for u16 {
    /// [`bf16_stochastic`]: unbiased, so a moment whose change a step is under half an ulp
    /// still moves by it on average — rounded to nearest, a second moment at β₂ = 0.999
    /// (0.001 of itself a step, under bf16's half ulp of 2⁻⁹ to 2⁻⁸) could never decay.
    #[inline(always)]
    fn store(x: f32, key: u64, index: u64) -> Self {
        bf16_stochastic(x, rounding_bits(key, index))
    }
}

/// [`adamw_step`] with the gradient multiplied by `grad_scale` first, in `f32`, as
/// `g ← g·scale` of [`clip_grad_norm`] would leave it: the clipping factor of a global
/// norm folded into the update, so the gradients themselves stay unchanged (the result is
/// bit for bit clipping then stepping). `grad_scale = 1` skips the multiplication.
///
/// The moments are stored as `M`: `f32`, or bf16 bits (`u16`), each widened to f32, updated
/// by the same f32 arithmetic, and rounded back to bf16 **stochastically** after the
/// parameter's update used the f32 values — element `i` of the first and second moment with
/// [`rounding_bits`]`(key_m, i)` and `(key_v, i)`, [`moment_keys`]`(key) = (key_m, key_v)`
/// (`key` is ignored for f32 moments) — half the moments' memory, unbiased: each moment is
/// its f32 update in expectation, within one bf16 ulp of it. The gradient is stored as
/// `G`: `f32`, or bf16 bits read widened (exact), so a gradient kept in bf16 needs no f32
/// copy; the update is the one its widened values would give, bit for bit.
///
/// # Errors
/// As [`adamw_step`], and `OutOfRange` for `grad_scale` not finite and `>= 0`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step_scaled<G: StoredF32, M: Moment>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [M],
    v: &mut [M],
    step: u64,
    cfg: &AdamWConfig,
    lr: f64,
    grad_scale: f32,
    key: u64,
) -> Result<()> {
    let len = params.len();
    check_len("m", len, m.len())?;
    check_len("v", len, v.len())?;
    let k = AdamConsts::checked(grads, len, step, cfg, lr, grad_scale)?;
    let keys = moment_keys(key);
    if len >= PAR_MIN_ELEMS {
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .enumerate()
            .for_each(|(c, ((p, g), (m, v)))| k.update(p, g, m, v, (keys, (c * CHUNK) as u64)));
    } else {
        k.update(params, grads, m, v, (keys, 0));
    }
    Ok(())
}

/// The per-step `f32` factors of an AdamW update.
pub(crate) struct AdamConsts {
    decay: f32,
    apply_decay: bool,
    w1: f32,
    b2: f32,
    w2: f32,
    neg_step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    grad_scale: f32,
}

impl AdamConsts {
    /// The factors of step `step`, after checking everything an update needs but the
    /// moments: `grad_scale` finite and `>= 0`, `grads` as long as the parameters (`len`)
    /// and finite, the config, `step >= 1`, `lr` finite and `>= 0`.
    pub(crate) fn checked<G: StoredF32>(
        grads: &[G],
        len: usize,
        step: u64,
        cfg: &AdamWConfig,
        lr: f64,
        grad_scale: f32,
    ) -> Result<Self> {
        let scale_ok = grad_scale.is_finite() && grad_scale >= 0.0;
        check(
            "grad_scale",
            f64::from(grad_scale),
            scale_ok,
            "finite and >= 0",
        )?;
        check_len("grads", len, grads.len())?;
        cfg.validate()?;
        check("step", step as f64, step >= 1, ">= 1")?;
        check("lr", lr, lr.is_finite() && lr >= 0.0, "finite and >= 0")?;
        if let Some(index) = first_non_finite(grads) {
            return Err(CoreError::NonFinite {
                what: "grads",
                index,
            }
            .into());
        }
        let t = step as f64;
        Ok(Self {
            decay: (1.0 - lr * cfg.weight_decay) as f32,
            apply_decay: cfg.weight_decay != 0.0,
            w1: (1.0 - cfg.beta1) as f32,
            b2: cfg.beta2 as f32,
            w2: (1.0 - cfg.beta2) as f32,
            neg_step_size: (-lr / (1.0 - cfg.beta1.powf(t))) as f32,
            bc2_sqrt: (1.0 - cfg.beta2.powf(t)).sqrt() as f32,
            eps: cfg.eps as f32,
            grad_scale,
        })
    }

    /// The update of one span: parameters, gradients and the two moments as stored; the
    /// span starts at element `first` of the tensor, whose moments round under `keys`
    /// (`(key_m, key_v)`, [`Moment::store`]).
    pub(crate) fn update<G: StoredF32, M: Moment>(
        &self,
        p: &mut [f32],
        g: &[G],
        m: &mut [M],
        v: &mut [M],
        ((key_m, key_v), first): ((u64, u64), u64),
    ) {
        // PyTorch's lerp switches form at weight 0.5 to stay accurate near both ends.
        let low_weight = self.w1 < 0.5;
        let scaled = self.grad_scale != 1.0;
        let spans = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
        for (j, (((p, &g), ms), vs)) in spans.enumerate() {
            let g = g.load();
            let g = if scaled { g * self.grad_scale } else { g };
            if self.apply_decay {
                *p *= self.decay;
            }
            let m = ms.load();
            let m = if low_weight {
                m + self.w1 * (g - m)
            } else {
                g - (g - m) * (1.0 - self.w1)
            };
            let v = vs.load() * self.b2 + self.w2 * g * g;
            let denom = v.sqrt() / self.bc2_sqrt + self.eps;
            *p += self.neg_step_size * (m / denom);
            let index = first + j as u64;
            *ms = M::store(m, key_m, index);
            *vs = M::store(v, key_v, index);
        }
    }
}

/// `Σ x²` of one tensor, accumulated in `f64` in a fixed chunk order (deterministic for
/// any thread count): the per-tensor part of [`global_grad_norm`], for callers that hold
/// their tensors in several places. NaN or ±∞ anywhere gives a non-finite sum.
pub fn sum_of_squares_f64(x: &[f32]) -> f64 {
    sum_of_squares(std::iter::once(x))
}

/// Global L2 norm of a set of gradient tensors, `√(Σ_tensors Σ_i g_i²)`, accumulated in
/// `f64` in a fixed order (deterministic for any thread count), returned as `f32`.
///
/// A NaN or ±∞ in any tensor gives a NaN or +∞ norm (as `torch.nn.utils.clip_grad_norm_`
/// reports it), which callers can log or use to skip a step.
pub fn global_grad_norm(grads: &[&[f32]]) -> f32 {
    sum_of_squares(grads.iter().copied()).sqrt() as f32
}

/// Scales all gradients together so that their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_(params, max_norm)` (L2, `foreach` or not):
///
/// ```text
/// norm  = √(Σ g²)                        (f64 accumulation, rounded to f32)
/// scale = min(1, max_norm / (norm + 1e-6))   in f32
/// g    ← g · scale                        only when scale < 1 (×1 changes nothing)
/// ```
///
/// Returns `(norm, scale)`: the norm before clipping and the factor applied (1 if none).
///
/// # Errors
/// - `OutOfRange` for `max_norm` not finite and `>= 0`;
/// - `NonFinite` for `grads` if any element is NaN or ±∞, with `index` counted over the
///   tensors concatenated in order (PyTorch's `error_if_nonfinite = True`; scaling by a NaN
///   factor would silently ruin every gradient). Nothing is written then.
pub fn clip_grad_norm(grads: &mut [&mut [f32]], max_norm: f32) -> Result<(f32, f32)> {
    let ok = max_norm.is_finite() && max_norm >= 0.0;
    check("max_norm", f64::from(max_norm), ok, "finite and >= 0")?;
    let total = sum_of_squares(grads.iter().map(|g| &**g));
    if !total.is_finite() {
        // A sum of f32 squares (each < 1.2e77) overflows f64 only through a NaN or ±∞ input.
        let mut base = 0usize;
        for g in grads.iter() {
            if let Some(i) = first_non_finite(g) {
                return Err(CoreError::NonFinite {
                    what: "grads",
                    index: base + i,
                }
                .into());
            }
            base += g.len();
        }
    }
    let norm = total.sqrt() as f32;
    // In f32 like PyTorch (its norm is an f32 tensor); an f32-overflowing norm gives 0.
    let scale = (max_norm / (norm + 1e-6)).min(1.0);
    if scale < 1.0 {
        for g in grads.iter_mut() {
            if g.len() >= PAR_MIN_ELEMS {
                g.par_chunks_mut(CHUNK)
                    .for_each(|c| scale_in_place(c, scale));
            } else {
                scale_in_place(g, scale);
            }
        }
    }
    Ok((norm, if scale < 1.0 { scale } else { 1.0 }))
}

fn scale_in_place(xs: &mut [f32], s: f32) {
    for x in xs {
        *x *= s;
    }
}

/// `Σ g²` over all tensors in `f64`, summed chunk by chunk in a fixed order.
fn sum_of_squares<'a>(tensors: impl Iterator<Item = &'a [f32]>) -> f64 {
    let mut total = 0.0f64;
    for g in tensors {
        total += sum_of_squares_as(g, |x| x);
    }
    total
}

/// `Σ x²` of one tensor of elements read as f32 by `wide`, chunk by chunk in a fixed order.
fn sum_of_squares_as<T: Copy + Sync>(g: &[T], wide: impl Fn(T) -> f32 + Sync) -> f64 {
    let chunk = |xs: &[T]| chunk_sum_of_squares(xs, &wide);
    if g.len() >= PAR_MIN_ELEMS {
        // Partial sums come back in chunk order and are added serially: deterministic.
        let partials: Vec<f64> = g.par_chunks(CHUNK).map(chunk).collect();
        partials.iter().sum::<f64>()
    } else {
        g.chunks(CHUNK).map(chunk).sum::<f64>()
    }
}

/// [`sum_of_squares_f64`] of a tensor stored in bf16 (`bits`), each element widened
/// (exact): equal to [`sum_of_squares_f64`] of the widened values, bit for bit — the part
/// of the global gradient norm of a gradient stored in bf16.
pub fn sum_of_squares_bf16(bits: &[u16]) -> f64 {
    // 0 + …: an empty tensor's sum is +0, as sum_of_squares_f64's (an empty f64 sum is −0)
    0.0 + sum_of_squares_as(bits, |b| f32::from_bits(u32::from(b) << 16))
}

/// `Σ x²` in `f64` with eight independent accumulators, so the loop vectorises (a single
/// accumulator would chain every addition).
fn chunk_sum_of_squares<T: Copy>(xs: &[T], wide: impl Fn(T) -> f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut lanes = xs.chunks_exact(8);
    for c in &mut lanes {
        for (a, &x) in acc.iter_mut().zip(c) {
            let x = f64::from(wide(x));
            *a += x * x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(lanes.remainder()) {
        let x = f64::from(wide(x));
        *a += x * x;
    }
    acc.iter().sum()
}

/// Index of the first NaN or ±∞ in `xs` (f32 values or bf16 bits).
fn first_non_finite<G: StoredF32>(xs: &[G]) -> Option<usize> {
    // Finite f32s have |bits| <= 0x7f7f_ffff; an integer max over a chunk vectorises,
    // and only a chunk that fails is searched element by element.
    let bad = |c: &[G]| {
        c.iter()
            .fold(0u32, |a, x| a.max(x.f32_bits() & 0x7fff_ffff))
            > 0x7f7f_ffff
    };
    let chunk = if xs.len() >= PAR_MIN_ELEMS {
        xs.par_chunks(CHUNK).position_first(bad)?
    } else {
        xs.chunks(CHUNK).position(bad)?
    };
    let start = chunk * CHUNK;
    xs.get(start..)?
        .iter()
        .position(|x| !x.load().is_finite())
        .map(|i| start + i)
}

/// How the learning rate behaves after the linear warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrDecay {
    /// Stay at the peak (transformers' `get_constant_schedule_with_warmup`).
    Constant,
    /// Half a cosine from the peak down to `min_lr_ratio · peak` at `total_steps`
    /// (transformers' `get_cosine_schedule_with_warmup`, `num_cycles = 0.5`, which is the
    /// case `min_lr_ratio = 0`; a positive ratio is its `get_cosine_with_min_lr_schedule_with_warmup`
    /// with `min_lr_rate`).
    Cosine {
        /// Final learning rate as a fraction of the peak, in `[0, 1]`.
        min_lr_ratio: f64,
    },
}

/// A learning-rate schedule: linear warm-up from 0, then constant or cosine decay.
///
/// `lr(s)` is the learning rate after `s` scheduler steps, matching the `LambdaLR` schedules
/// of Hugging Face transformers, for which the optimizer update number `t` (1-based, the
/// `step` of [`adamw_step`]) uses `lr(t − 1)` — so the first update of a warm-up runs at
/// `lr = 0`, as it does there. With warm-up `W`, total `N` and peak `η`:
///
/// ```text
/// s < W:             η · s / max(1, W)
/// constant, s >= W:  η
/// cosine,   s >= W:  η · max(0, r + (1 − r) · ½(1 + cos(π · p))),  p = (s − W) / max(1, N − W)
/// ```
///
/// As in transformers `p` is not clamped: past `N` the cosine rises again (trainers stop at
/// `N`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    peak_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
    decay: LrDecay,
}

impl LrSchedule {
    /// Linear warm-up over `warmup_steps`, then `peak_lr` for ever.
    ///
    /// # Errors
    /// `OutOfRange` for `peak_lr` not finite and `>= 0`.
    pub fn constant_with_warmup(peak_lr: f64, warmup_steps: u64) -> Result<Self> {
        check_peak(peak_lr)?;
        Ok(Self {
            peak_lr,
            warmup_steps,
            total_steps: u64::MAX,
            decay: LrDecay::Constant,
        })
    }

    /// Linear warm-up over `warmup_steps`, then half a cosine down to `min_lr_ratio · peak_lr`
    /// at `total_steps`.
    ///
    /// # Errors
    /// `OutOfRange` for `peak_lr` not finite and `>= 0`, `min_lr_ratio` outside `[0, 1]`,
    /// `total_steps` 0, or `warmup_steps > total_steps`.
    pub fn cosine_with_warmup(
        peak_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
        min_lr_ratio: f64,
    ) -> Result<Self> {
        check_peak(peak_lr)?;
        let r_ok = (0.0..=1.0).contains(&min_lr_ratio);
        check("min_lr_ratio", min_lr_ratio, r_ok, "in [0, 1]")?;
        check("total_steps", total_steps as f64, total_steps >= 1, ">= 1")?;
        let w_ok = warmup_steps <= total_steps;
        check("warmup_steps", warmup_steps as f64, w_ok, "<= total_steps")?;
        Ok(Self {
            peak_lr,
            warmup_steps,
            total_steps,
            decay: LrDecay::Cosine { min_lr_ratio },
        })
    }

    /// The learning rate after `step` scheduler steps: `peak_lr · multiplier(step)`.
    pub fn lr(&self, step: u64) -> f64 {
        self.peak_lr * self.multiplier(step)
    }

    /// The factor on the peak learning rate after `step` scheduler steps (the `lr_lambda`
    /// of transformers' schedules).
    pub fn multiplier(&self, step: u64) -> f64 {
        let w = self.warmup_steps;
        if step < w {
            return step as f64 / w.max(1) as f64;
        }
        match self.decay {
            LrDecay::Constant => 1.0,
            LrDecay::Cosine { min_lr_ratio: r } => {
                let progress = (step - w) as f64 / (self.total_steps - w).max(1) as f64;
                // transformers writes π·num_cycles·2·p with num_cycles = 0.5: exactly π·p.
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (cosine * (1.0 - r) + r).max(0.0)
            }
        }
    }

    /// The peak learning rate.
    pub fn peak_lr(&self) -> f64 {
        self.peak_lr
    }

    /// Warm-up length in steps.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// What follows the warm-up.
    pub fn decay(&self) -> LrDecay {
        self.decay
    }
}

/// Warm-up steps for a warm-up given as a fraction of the run: `⌈total_steps · ratio⌉`, in
/// `f64` as transformers' `TrainingArguments.get_warmup_steps` (so `100 · 0.07 =
/// 7.000000000000001` gives 8 there and here).
///
/// # Errors
/// `OutOfRange` for `ratio` outside `[0, 1]`.
pub fn warmup_steps_from_ratio(ratio: f64, total_steps: u64) -> Result<u64> {
    check(
        "warmup_ratio",
        ratio,
        (0.0..=1.0).contains(&ratio),
        "in [0, 1]",
    )?;
    // In [0, total_steps] since ratio <= 1, so the cast is exact for any realistic run.
    Ok((total_steps as f64 * ratio).ceil() as u64)
}

fn check_peak(peak_lr: f64) -> Result<()> {
    let ok = peak_lr.is_finite() && peak_lr >= 0.0;
    check("peak_lr", peak_lr, ok, "finite and >= 0")
}

fn check(what: &'static str, value: f64, ok: bool, expected: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CoreError::OutOfRange {
            what,
            value,
            expected,
        }
        .into())
    }
}

#[cfg(test)]
mod tests {
    /// bf16 moments: the same f32 arithmetic on the widened moments, the parameter updated
    /// from the f32 values, the moments rounded stochastically, element `i` with the bits
    /// of `(moment_keys(key), i)` (over sizes across the parallel threshold, with clipping
    /// and decay).
    #[test]
    fn bf16_moments_step_as_f32_then_round() {
        use half::bf16;
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        for len in [7usize, (1 << 16) + 3] {
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            };
            let p0: Vec<f32> = (0..len).map(|_| next()).collect();
            let g: Vec<f32> = (0..len).map(|_| next()).collect();
            let m0: Vec<u16> = (0..len)
                .map(|_| bf16::from_f32(next() * 0.1).to_bits())
                .collect();
            let v0: Vec<u16> = (0..len)
                .map(|_| bf16::from_f32(next().abs() * 0.01).to_bits())
                .collect();
            let (mut p16, mut m16, mut v16) = (p0.clone(), m0.clone(), v0.clone());
            let key = 0xA5A5_0123_4567_89AB;
            adamw_step_scaled(&mut p16, &g, &mut m16, &mut v16, 3, &cfg, 1e-3, 0.5, key).unwrap();
            let widen = |b: &[u16]| -> Vec<f32> {
                b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect()
            };
            let (mut p32, mut m32, mut v32) = (p0.clone(), widen(&m0), widen(&v0));
            adamw_step_scaled(&mut p32, &g, &mut m32, &mut v32, 3, &cfg, 1e-3, 0.5, 0).unwrap();
            assert_eq!(p16, p32, "parameters as the f32 step");
            let (key_m, key_v) = moment_keys(key);
            let round = |x: &[f32], key| -> Vec<u16> {
                let bits = |i: usize| rounding_bits(key, i as u64);
                x.iter()
                    .enumerate()
                    .map(|(i, &x)| bf16_stochastic(x, bits(i)))
                    .collect()
            };
            assert_eq!(m16, round(&m32, key_m));
            assert_eq!(v16, round(&v32, key_v));
            // each a bf16 neighbour of its f32 value
            let near = |b: u16, x: f32| (bf16::from_bits(b).to_f32() - x).abs() <= x.abs() / 128.0;
            assert!(m16.iter().zip(&m32).all(|(&b, &x)| near(b, x)));
            assert!(v16.iter().zip(&v32).all(|(&b, &x)| near(b, x)));
        }
        // a NaN gradient changes nothing, as in f32
        let (mut p, mut m, mut v) = (vec![1.0f32; 3], vec![0u16; 3], vec![0u16; 3]);
        let e = adamw_step_scaled(
            &mut p,
            &[0.0, f32::NAN, 0.0],
            &mut m,
            &mut v,
            1,
            &cfg,
            1e-3,
            1.0,
            7,
        );
        assert!(e.is_err());
        assert_eq!((p, m, v), (vec![1.0; 3], vec![0; 3], vec![0; 3]));
    }

    use super::*;
    use crate::Error;
    use crate::test_rng::Rng;

    #[test]
    fn bf16_sums_of_squares_are_the_widened_values_sums() {
        use crate::ops::precision::{round_to_bf16, widen_bf16};
        for n in [0usize, 7, 5000, 300_000] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let mut bits = vec![0u16; n];
            round_to_bf16(&x, &mut bits).unwrap();
            let mut wide = vec![0.0f32; n];
            widen_bf16(&bits, &mut wide).unwrap();
            assert_eq!(
                sum_of_squares_bf16(&bits).to_bits(),
                sum_of_squares_f64(&wide).to_bits(),
                "n = {n}"
            );
        }
    }

    /// The second moment at β₂ = 0.999 under zero gradients, stored in bf16: rounded to
    /// nearest it would stay where it was (0.001 of itself is under half a bf16 ulp);
    /// rounded stochastically it decays as the f32 moment does: on average within 1 %
    /// after 1 000 steps.
    #[test]
    fn bf16_second_moments_decay_as_f32_ones() {
        let cfg = AdamWConfig::default();
        let n = 4096;
        let start = half::bf16::from_f32(1e-4).to_bits();
        let (mut p, g) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (mut m, mut v) = (vec![0u16; n], vec![start; n]);
        let mut v32 = 1e-4f64;
        for step in 1..=1000u64 {
            let key = step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            adamw_step_scaled(&mut p, &g, &mut m, &mut v, step, &cfg, 1e-6, 1.0, key).unwrap();
            v32 *= 0.999;
        }
        let vals: Vec<f64> = v
            .iter()
            .map(|&b| f64::from(half::bf16::from_bits(b).to_f32()))
            .collect();
        let mean = vals.iter().sum::<f64>() / n as f64;
        assert!((mean / v32 - 1.0).abs() < 0.01, "mean {mean} against {v32}");
        // each element a random walk of half-ulp steps: ~9 % spread after 1 000 steps
        let worst = vals
            .iter()
            .map(|x| (x / v32 - 1.0).abs())
            .fold(0.0, f64::max);
        assert!(worst < 0.5, "an element {worst} away");
        // rounded to nearest it does not move at all
        let r = half::bf16::from_f32(1e-4).to_f32();
        assert_eq!(half::bf16::from_f32(0.999 * r).to_bits(), start);
    }

    fn near(got: f64, want: f64, tol: f64) -> bool {
        (got - want).abs() <= tol * (1.0 + want.abs())
    }

    #[test]
    fn adamw_first_two_steps_by_hand() {
        // lr = 0.1, β = (0.9, 0.999), ε = 1e-8, wd = 0.01, θ = 1, m = v = 0.
        // Step 1, g = 0.5:
        //   θ = 1·(1 − 0.1·0.01)                      = 0.999
        //   m = 0 + 0.1·(0.5 − 0)                     = 0.05
        //   v = 0.999·0 + 0.001·0.25                  = 0.00025
        //   step size = 0.1/(1 − 0.9)                 = 1
        //   denom = √0.00025/√0.001 + 1e-8            = 0.5 + 1e-8
        //   θ = 0.999 − 1·0.05/0.50000001             = 0.899000002
        // Step 2, g = −0.25:
        //   θ = 0.899000002·0.999                     = 0.898101002
        //   m = 0.05 + 0.1·(−0.25 − 0.05)             = 0.02
        //   v = 0.999·0.00025 + 0.001·0.0625          = 0.00031225
        //   step size = 0.1/(1 − 0.81)                = 0.526315789
        //   denom = √0.00031225/√0.001999 + 1e-8      = 0.395225391
        //   θ = 0.898101002 − 0.526315789·0.050604036 = 0.871467299
        let cfg = AdamWConfig::default();
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adamw_step(&mut p, &[0.5], &mut m, &mut v, 1, &cfg, 0.1).unwrap();
        assert!(near(f64::from(p[0]), 0.899000002, 1e-6), "{}", p[0]);
        assert!(near(f64::from(m[0]), 0.05, 1e-6));
        assert!(near(f64::from(v[0]), 0.00025, 1e-6));
        adamw_step(&mut p, &[-0.25], &mut m, &mut v, 2, &cfg, 0.1).unwrap();
        assert!(near(f64::from(p[0]), 0.871467299, 1e-6), "{}", p[0]);
        assert!(near(f64::from(m[0]), 0.02, 1e-6));
        assert!(near(f64::from(v[0]), 0.00031225, 1e-6));
    }

    #[test]
    fn adamw_zero_gradient_only_decays() {
        // m = v = 0 stay 0, so the Adam term is 0/(0 + ε) = 0: θ·(1 − lr·wd) is all.
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let mut p = [2.0f32, -4.0];
        let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
        adamw_step(&mut p, &[0.0, 0.0], &mut m, &mut v, 1, &cfg, 0.5).unwrap();
        assert_eq!(p, [2.0 * 0.95, -4.0 * 0.95]);
    }

    #[test]
    fn adamw_converges_on_a_quadratic() {
        // f(θ) = ½ Σ a_i (θ_i − c_i)², ∇f = a ⊙ (θ − c); cosine schedule to 0 lets the
        // iterate settle on the minimum instead of orbiting it at the step size.
        let a = [1.0f32, 10.0, 0.1, 3.0];
        let c = [0.5f32, -1.0, 2.0, 0.0];
        let mut theta = [0.0f32; 4];
        let (mut m, mut v) = ([0.0f32; 4], [0.0f32; 4]);
        let cfg = AdamWConfig {
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let total = 2000;
        let sched = LrSchedule::cosine_with_warmup(0.05, 20, total, 0.0).unwrap();
        for t in 1..=total {
            let g: Vec<f32> = (0..4).map(|i| a[i] * (theta[i] - c[i])).collect();
            adamw_step(&mut theta, &g, &mut m, &mut v, t, &cfg, sched.lr(t - 1)).unwrap();
        }
        for i in 0..4 {
            assert!(
                (theta[i] - c[i]).abs() < 1e-2,
                "θ{i} = {} vs {}",
                theta[i],
                c[i]
            );
        }
    }

    #[test]
    fn adamw_parallel_path_matches_element_by_element() {
        let n = PAR_MIN_ELEMS + 1234;
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let mut p: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut m: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.01).collect();
        let mut v: Vec<f32> = (0..n).map(|i| (i % 3) as f32 * 0.001).collect();
        let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
        let cfg = AdamWConfig::default();
        adamw_step(&mut p, &g, &mut m, &mut v, 3, &cfg, 1e-3).unwrap();
        for i in (0..n).step_by(97) {
            let (pi, mi, vi) = (&mut p1[i..=i], &mut m1[i..=i], &mut v1[i..=i]);
            adamw_step(pi, &g[i..=i], mi, vi, 3, &cfg, 1e-3).unwrap();
            assert_eq!((p[i], m[i], v[i]), (p1[i], m1[i], v1[i]));
        }
    }

    #[test]
    fn adamw_reads_bf16_gradients_as_their_widened_values() {
        // a gradient kept in bf16 steps as an f32 gradient holding the same values, bit for
        // bit, with f32, bf16 and 8-bit moments (both sides of the parallel threshold)
        use super::super::optim_int8::{adamw_step_int8, blocks, dynamic_map};
        let cfg = AdamWConfig::default();
        let mut maps = dynamic_map(true).to_vec();
        maps.extend(dynamic_map(false));
        for n in [77, PAR_MIN_ELEMS + 1234] {
            let g16: Vec<u16> = (0..n)
                .map(|i| half::bf16::from_f32(((i * 37 % 101) as f32 - 50.0) * 0.013).to_bits())
                .collect();
            let g32: Vec<f32> = g16
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect();
            let p0: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for step in 1..=2 {
                let (mut pa, mut pb) = (p0.clone(), p0.clone());
                let (mut ma, mut va) = (vec![0.0f32; n], vec![0.0f32; n]);
                let (mut mb, mut vb) = (ma.clone(), va.clone());
                adamw_step_scaled(&mut pa, &g16, &mut ma, &mut va, step, &cfg, 1e-3, 0.5, 0)
                    .unwrap();
                adamw_step_scaled(&mut pb, &g32, &mut mb, &mut vb, step, &cfg, 1e-3, 0.5, 0)
                    .unwrap();
                assert_eq!(
                    (bits(&pa), bits(&ma)),
                    (bits(&pb), bits(&mb)),
                    "f32 moments"
                );
                assert_eq!(bits(&va), bits(&vb));
                let (mut pa, mut pb) = (p0.clone(), p0.clone());
                let (mut ma, mut va) = (vec![0u16; n], vec![0u16; n]);
                let (mut mb, mut vb) = (ma.clone(), va.clone());
                adamw_step_scaled(&mut pa, &g16, &mut ma, &mut va, step, &cfg, 1e-3, 1.0, 0)
                    .unwrap();
                adamw_step_scaled(&mut pb, &g32, &mut mb, &mut vb, step, &cfg, 1e-3, 1.0, 0)
                    .unwrap();
                assert_eq!((bits(&pa), ma, va), (bits(&pb), mb, vb), "bf16 moments");
                let (mut pa, mut pb) = (p0.clone(), p0.clone());
                let (mut ma, mut va) = (vec![0u8; n], vec![0u8; n]);
                let (mut mb, mut vb) = (ma.clone(), va.clone());
                let b = blocks(n);
                let (mut aa, mut ab) = (vec![0.0f32; b], vec![0.0f32; b]);
                let (mut ba, mut bb) = (aa.clone(), ab.clone());
                let (ma_, va_) = (&mut ma, &mut va);
                adamw_step_int8(
                    &mut pa, &g16, ma_, va_, &mut aa, &mut ab, &maps, step, &cfg, 1e-3, 1.0,
                )
                .unwrap();
                let (mb_, vb_) = (&mut mb, &mut vb);
                adamw_step_int8(
                    &mut pb, &g32, mb_, vb_, &mut ba, &mut bb, &maps, step, &cfg, 1e-3, 1.0,
                )
                .unwrap();
                assert_eq!((bits(&pa), ma, va), (bits(&pb), mb, vb), "8-bit moments");
                assert_eq!((bits(&aa), bits(&ab)), (bits(&ba), bits(&bb)));
            }
        }
        // a bf16 NaN or ±∞ is refused at its index, nothing written
        let (mut p, mut m, mut v) = ([1.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
        for (bad, at) in [(0x7fc0u16, 2usize), (0xff80, 1), (0x7f80, 3)] {
            let mut g = [0x3f80u16; 4];
            g[at] = bad;
            let err = adamw_step_scaled(&mut p, &g, &mut m, &mut v, 1, &cfg, 1e-3, 1.0, 0);
            assert_eq!(
                err,
                Err(Error::Core(CoreError::NonFinite {
                    what: "grads",
                    index: at
                }))
            );
        }
        assert_eq!((p, m, v), ([1.0; 4], [0.0; 4], [0.0; 4]));
        // the largest finite bf16 is finite
        let g = [0x7f7fu16, 0xff7f, 0, 0x8000];
        adamw_step_scaled(&mut p, &g, &mut m, &mut v, 1, &cfg, 1e-3, 1.0, 0).unwrap();
    }

    #[test]
    fn adamw_rejects_bad_input_without_writing() {
        let cfg = AdamWConfig::default();
        let (mut p, mut m, mut v) = ([1.0f32; 5], [0.0f32; 5], [0.0f32; 5]);
        let g = [0.1, 0.2, 0.3, f32::NAN, f32::INFINITY];
        let err = adamw_step(&mut p, &g, &mut m, &mut v, 1, &cfg, 1e-3);
        assert_eq!(
            err,
            Err(Error::Core(CoreError::NonFinite {
                what: "grads",
                index: 3
            }))
        );
        assert_eq!((p, m, v), ([1.0; 5], [0.0; 5], [0.0; 5]));

        let what = |r: Result<()>| match r {
            Err(Error::Core(CoreError::OutOfRange { what, .. }))
            | Err(Error::Core(CoreError::LengthMismatch { what, .. })) => what,
            other => panic!("expected an error, got {other:?}"),
        };
        let g = [0.0f32; 5];
        assert_eq!(
            what(adamw_step(&mut p, &g, &mut m, &mut v, 0, &cfg, 1e-3)),
            "step"
        );
        assert_eq!(
            what(adamw_step(&mut p, &g, &mut m, &mut v, 1, &cfg, -1.0)),
            "lr"
        );
        assert_eq!(
            what(adamw_step(&mut p, &g[..4], &mut m, &mut v, 1, &cfg, 1.0)),
            "grads"
        );
        assert_eq!(
            what(adamw_step(&mut p, &g, &mut m[..4], &mut v, 1, &cfg, 1.0)),
            "m"
        );
        assert_eq!(
            what(adamw_step(&mut p, &g, &mut m, &mut v[..4], 1, &cfg, 1.0)),
            "v"
        );
        for (bad, name) in [
            (AdamWConfig { beta1: 1.0, ..cfg }, "beta1"),
            (AdamWConfig { beta2: -0.1, ..cfg }, "beta2"),
            (AdamWConfig { eps: 0.0, ..cfg }, "eps"),
            (
                AdamWConfig {
                    weight_decay: f64::NAN,
                    ..cfg
                },
                "weight_decay",
            ),
        ] {
            assert_eq!(what(bad.validate()), name);
            assert_eq!(
                what(adamw_step(&mut p, &g, &mut m, &mut v, 1, &bad, 1.0)),
                name
            );
        }
        assert_eq!((p, m, v), ([1.0; 5], [0.0; 5], [0.0; 5]));
    }

    #[test]
    fn scaled_step_is_clipping_then_stepping_bit_for_bit() {
        let cfg = AdamWConfig::default();
        let g0 = Rng(3).vec(300, 2.0);
        let p0 = Rng(4).vec(300, 1.0);
        let (mut pa, mut pb) = (p0.clone(), p0);
        let (mut ma, mut va) = (vec![0.1f32; 300], vec![0.2f32; 300]);
        let (mut mb, mut vb) = (ma.clone(), va.clone());
        let mut clipped = g0.clone();
        let (norm, scale) = clip_grad_norm(&mut [&mut clipped], 1.5).unwrap();
        assert!(scale < 1.0);
        assert_eq!(
            f64::from(norm),
            sum_of_squares_f64(&g0).sqrt() as f32 as f64
        );
        adamw_step(&mut pa, &clipped, &mut ma, &mut va, 3, &cfg, 1e-2).unwrap();
        adamw_step_scaled(&mut pb, &g0, &mut mb, &mut vb, 3, &cfg, 1e-2, scale, 0).unwrap();
        assert_eq!((pa, ma, va), (pb, mb, vb));
        let mut p = [1.0f32];
        let bad = adamw_step_scaled(
            &mut p,
            &[1.0],
            &mut [0.0],
            &mut [0.0],
            1,
            &cfg,
            0.1,
            -1.0,
            0,
        );
        assert!(bad.is_err() && p == [1.0]);
    }

    #[test]
    fn grad_norm_and_clipping_by_hand() {
        // Two tensors [3, 4] and [0]: norm √(9 + 16) = 5.
        let (mut a, mut b) = ([3.0f32, 4.0], [0.0f32]);
        assert_eq!(global_grad_norm(&[&a, &b]), 5.0);

        // max_norm 10 ≥ 5: scale 10/5.000001 > 1 → clamped to 1, nothing changes.
        let (norm, scale) = clip_grad_norm(&mut [&mut a, &mut b], 10.0).unwrap();
        assert_eq!((norm, scale, a), (5.0, 1.0, [3.0, 4.0]));

        // max_norm 1: scale = 1/(5 + 1e-6) = 0.19999996, so g ≈ [0.6, 0.8].
        let (norm, scale) = clip_grad_norm(&mut [&mut a, &mut b], 1.0).unwrap();
        assert_eq!(norm, 5.0);
        assert_eq!(scale, 1.0 / (5.0 + 1e-6f32));
        assert!((a[0] - 0.6).abs() < 1e-6 && (a[1] - 0.8).abs() < 1e-6);
        assert!((global_grad_norm(&[&a, &b]) - 1.0).abs() < 1e-6);

        // No gradients at all: norm 0, nothing to scale.
        assert_eq!(clip_grad_norm(&mut [], 1.0).unwrap(), (0.0, 1.0));
    }

    #[test]
    fn grad_norm_of_large_tensors_is_exact_and_deterministic() {
        // 3·PAR_MIN_ELEMS + 5 elements of 0.5: Σ g² = n/4 exactly in f64.
        let n = 3 * PAR_MIN_ELEMS + 5;
        let g = vec![0.5f32; n];
        let want = ((n as f64) / 4.0).sqrt() as f32;
        assert_eq!(global_grad_norm(&[&g]), want);
        assert_eq!(global_grad_norm(&[&g[..7], &g[7..]]), want);
    }

    #[test]
    fn clipping_rejects_non_finite_gradients() {
        let (mut a, mut b) = ([1.0f32, 2.0], [3.0f32, f32::NAN]);
        assert!(global_grad_norm(&[&a, &b]).is_nan());
        let err = clip_grad_norm(&mut [&mut a, &mut b], 1.0);
        assert_eq!(
            err,
            Err(Error::Core(CoreError::NonFinite {
                what: "grads",
                index: 3
            }))
        );
        assert_eq!(a, [1.0, 2.0]);
        let err = clip_grad_norm(&mut [&mut a], -1.0);
        assert!(matches!(
            err,
            Err(Error::Core(CoreError::OutOfRange {
                what: "max_norm",
                ..
            }))
        ));
    }

    #[test]
    fn first_non_finite_finds_the_first_one_in_a_large_slice() {
        let mut x = vec![1.0f32; 5 * CHUNK];
        assert_eq!(first_non_finite(&x), None);
        x[3 * CHUNK + 17] = f32::NEG_INFINITY;
        x[4 * CHUNK] = f32::NAN;
        assert_eq!(first_non_finite(&x), Some(3 * CHUNK + 17));
        x[2] = f32::MAX; // the largest finite value is fine
        assert_eq!(first_non_finite(&x), Some(3 * CHUNK + 17));
    }

    #[test]
    fn constant_schedule_with_warmup() {
        let s = LrSchedule::constant_with_warmup(1e-3, 10).unwrap();
        // s/10 during warm-up, then the peak.
        assert_eq!(s.lr(0), 0.0);
        assert!(near(s.lr(5), 0.5e-3, 1e-15));
        assert_eq!(s.lr(10), 1e-3);
        assert_eq!(s.lr(1_000_000), 1e-3);
        let no_warmup = LrSchedule::constant_with_warmup(1e-3, 0).unwrap();
        assert_eq!(no_warmup.lr(0), 1e-3);
    }

    #[test]
    fn cosine_schedule_with_warmup() {
        // W = 10, N = 110, r = 0.1: p = (s − 10)/100, factor = 0.1 + 0.9·½(1 + cos πp).
        let s = LrSchedule::cosine_with_warmup(2.0, 10, 110, 0.1).unwrap();
        assert_eq!(s.lr(0), 0.0); // step 0: 0/10
        assert_eq!(s.lr(5), 1.0); // half-way up: 2·5/10
        assert_eq!(s.lr(10), 2.0); // warm-up end: p = 0, cos 0 = 1
        assert!(near(s.lr(60), 2.0 * 0.55, 1e-12)); // middle: p = ½, cos = 0 → 0.1 + 0.45
        assert!(near(
            s.lr(35),
            2.0 * (0.1 + 0.45 * (1.0 + 0.5f64.sqrt())),
            1e-12
        )); // p = ¼
        assert!(near(s.lr(110), 0.2, 1e-12)); // end: cos π = −1 → r
        // transformers' plain cosine is r = 0: ends at 0.
        let plain = LrSchedule::cosine_with_warmup(1.0, 0, 100, 0.0).unwrap();
        assert_eq!(plain.lr(0), 1.0);
        assert!(plain.lr(100).abs() < 1e-15);
        assert!(near(plain.lr(50), 0.5, 1e-12));
    }

    #[test]
    fn schedule_arguments_are_checked() {
        let what = |r: Result<LrSchedule>| match r {
            Err(Error::Core(CoreError::OutOfRange { what, .. })) => what,
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(
            what(LrSchedule::constant_with_warmup(f64::NAN, 1)),
            "peak_lr"
        );
        assert_eq!(
            what(LrSchedule::cosine_with_warmup(1.0, 1, 10, 1.5)),
            "min_lr_ratio"
        );
        assert_eq!(
            what(LrSchedule::cosine_with_warmup(1.0, 0, 0, 0.0)),
            "total_steps"
        );
        assert_eq!(
            what(LrSchedule::cosine_with_warmup(1.0, 11, 10, 0.0)),
            "warmup_steps"
        );
        assert!(warmup_steps_from_ratio(1.1, 10).is_err());
    }

    #[test]
    fn warmup_ratio_rounds_up_like_transformers() {
        assert_eq!(warmup_steps_from_ratio(0.03, 1000).unwrap(), 30);
        assert_eq!(warmup_steps_from_ratio(0.1, 15).unwrap(), 2); // ⌈1.5⌉
        assert_eq!(warmup_steps_from_ratio(0.07, 100).unwrap(), 8); // ⌈7.000000000000001⌉
        assert_eq!(warmup_steps_from_ratio(0.0, 100).unwrap(), 0);
    }
}
