//! The optimizer's ops: the sum of squares behind the global gradient norm, and the AdamW
//! update, both on the device so parameters, gradients and moments never leave it.

use super::{ArgOrNull, ModelOps, State, bad, check_len, element_cfg, i32_of, i64_of};
use crate::error::{DriverContext, Result};
use cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

/// Elements per block of 8-bit moments (one f32 scale each), as `ares_cpu`'s
/// `optim_int8::BLOCK` and the kernel's `Q8_BLOCK`.
pub const INT8_BLOCK: usize = 2048;
/// Threads per quantisation block (the kernel's `Q8_THREADS`).
const INT8_THREADS: u32 = 256;

/// The scales and maps of 8-bit moments, and the launch shape (one block per scale).
struct Int8Scales<'s, 'm, 'v, 'c> {
    m: &'s mut CudaViewMut<'m, f32>,
    v: &'s mut CudaViewMut<'v, f32>,
    maps: &'s CudaView<'c, f32>,
    cfg: LaunchConfig,
}

/// The parameter an update writes: f32 values, or a weight stored in bf16 (bits) with the
/// key of its stochastic rounding.
enum Target<'a, 'b> {
    /// An f32 parameter, and the key its bf16 moments (if any) round under.
    F32(&'a mut CudaViewMut<'b, f32>, u64),
    /// A bf16 weight and the key it rounds under (its bf16 moments under the same key's
    /// moment streams).
    Bf16(&'a mut CudaViewMut<'b, u16>, u64),
}

impl Target<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Target::F32(p, _) => p.len(),
            Target::Bf16(w, _) => w.len(),
        }
    }
}

/// A tensor as stored, f32 values or bf16 bits: what [`ModelOps::sums_of_squares_of`]
/// sums and the AdamW updates read as the gradient ([`ModelOps::adamw_step`]).
#[derive(Debug, Clone, Copy)]
pub enum StoredView<'a, 'b> {
    /// f32 values.
    F32(&'a CudaView<'b, f32>),
    /// bf16 bits (a gradient stored in bf16).
    Bf16(&'a CudaView<'b, u16>),
}

impl StoredView<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Bf16(x) => x.len(),
        }
    }

    /// The device address, and the guard that keeps it in use.
    fn device_ptr<'s>(
        &'s self,
        stream: &'s cudarc::driver::CudaStream,
    ) -> (u64, cudarc::driver::SyncOnDrop<'s>) {
        match self {
            Self::F32(x) => x.device_ptr(stream),
            Self::Bf16(x) => x.device_ptr(stream),
        }
    }
}

/// Partial sums of a tensor of [`ModelOps::sums_of_squares`] at most (blocks of its first
/// stage).
const MAX_PARTIALS: usize = 1024;
/// Elements per block of the first stage at least.
const MIN_CHUNK: usize = 8192;
/// Threads per block of both stages.
const SUM_BLOCK: u32 = 256;

/// How [`ModelOps::sums_of_squares`] splits a tensor of `len >= 1` elements: `(chunk,
/// blocks)`, each block of its first stage summing `chunk` consecutive elements (the last
/// fewer), `blocks <= 1024`. It depends on `len` alone, so a tensor's sum does too.
pub fn sum_of_squares_partition(len: usize) -> (usize, usize) {
    let chunk = len.div_ceil(MAX_PARTIALS).max(MIN_CHUNK);
    (chunk, len.div_ceil(chunk))
}

/// One AdamW update's hyper-parameters: `torch.optim.AdamW` semantics (decoupled decay
/// `θ ← θ·(1 − lr·wd)` first, then the bias-corrected Adam step with ε added to
/// `√v̂`), the gradient multiplied by `grad_scale` first (global-norm clipping folded in).
/// The twin of `ares_cpu::ops::optim::adamw_step_scaled`, whose per-step f32 constants
/// are computed here the same way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step, finite and `>= 0`.
    pub lr: f64,
    /// β1 in `[0, 1)`.
    pub beta1: f64,
    /// β2 in `[0, 1)`.
    pub beta2: f64,
    /// ε, finite and `> 0`.
    pub eps: f64,
    /// Decoupled weight decay, finite and `>= 0`.
    pub weight_decay: f64,
    /// Update number, 1 for the first (bias corrections `1 − βᵗ`).
    pub step: u64,
    /// Factor on the gradient, finite and `>= 0` (1 = none).
    pub grad_scale: f32,
}

/// The per-step f32 factors of an update, as the CPU twin derives them: the AdamW kernels'
/// scalar arguments after `grad_scale`, in their order (`#[repr(C)]`, so a CPU run of the
/// kernel source, `tests/emulated.rs`, takes the very same values).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 − lr·weight_decay`.
    pub decay: f32,
    /// 1 when the weight decays.
    pub apply_decay: i32,
    /// `1 − β1`.
    pub w1: f32,
    /// `1 − w1`.
    pub one_minus_w1: f32,
    /// β2.
    pub b2: f32,
    /// `1 − β2`.
    pub w2: f32,
    /// `−lr / (1 − β1ᵗ)`.
    pub neg_step_size: f32,
    /// `√(1 − β2ᵗ)`.
    pub bc2_sqrt: f32,
    /// ε.
    pub eps: f32,
}

impl AdamWStep {
    /// The kernels' per-step factors; checks every field first.
    ///
    /// # Errors
    /// A field out of range, named.
    pub fn scalars(&self) -> Result<AdamWScalars> {
        const K: &str = "adamw_step";
        let unit = |x: f64| (0.0..1.0).contains(&x);
        let checks = [
            ("beta1", self.beta1, unit(self.beta1), "in [0, 1)"),
            ("beta2", self.beta2, unit(self.beta2), "in [0, 1)"),
            (
                "eps",
                self.eps,
                self.eps.is_finite() && self.eps > 0.0,
                "finite and > 0",
            ),
            (
                "weight_decay",
                self.weight_decay,
                self.weight_decay.is_finite() && self.weight_decay >= 0.0,
                "finite and >= 0",
            ),
            (
                "lr",
                self.lr,
                self.lr.is_finite() && self.lr >= 0.0,
                "finite and >= 0",
            ),
            (
                "grad_scale",
                f64::from(self.grad_scale),
                self.grad_scale.is_finite() && self.grad_scale >= 0.0,
                "finite and >= 0",
            ),
        ];
        if let Some((what, value, _, expected)) = checks.iter().find(|c| !c.2) {
            return Err(bad(K, format!("{what} = {value} must be {expected}")));
        }
        if self.step == 0 {
            return Err(bad(K, "step = 0 must be >= 1".into()));
        }
        let t = self.step as f64;
        let w1 = (1.0 - self.beta1) as f32;
        Ok(AdamWScalars {
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            apply_decay: i32::from(self.weight_decay != 0.0),
            w1,
            one_minus_w1: 1.0 - w1,
            b2: self.beta2 as f32,
            w2: (1.0 - self.beta2) as f32,
            neg_step_size: (-self.lr / (1.0 - self.beta1.powf(t))) as f32,
            bc2_sqrt: (1.0 - self.beta2.powf(t)).sqrt() as f32,
            eps: self.eps as f32,
        })
    }
}

impl ModelOps {
    /// `Σ x²` accumulated in f64, deterministic (a fixed partition of `x` into at most
    /// 1024 chunks, each summed by one block with a fixed tree, then the partials in one
    /// block), returned to the host: **waits** for the queued ops, then reports bad values
    /// they met ([`ModelOps::check_status`]). NaN or ±∞ anywhere gives a non-finite sum.
    /// Twin of `ares_cpu::ops::optim::sum_of_squares_f64` (equal up to summation order).
    /// [`ModelOps::sums_of_squares`] of one tensor.
    ///
    /// # Errors
    /// A driver failure, [`crate::Error::DeviceStatus`].
    pub fn sum_of_squares(&self, x: &CudaView<'_, f32>) -> Result<f64> {
        let mut total = [0.0f64];
        self.sums_of_squares(&[x], &mut total)?;
        Ok(total[0])
    }

    /// [`ModelOps::sum_of_squares`] of each of `xs` into `out`, in two launches and **one
    /// wait** for all of them (the status word travels in the same read): the global
    /// gradient norm of a model's tensors. A tensor's sum is the one `sum_of_squares` gives
    /// it alone, bit for bit (its partition depends on its own length only); an empty
    /// tensor's is 0.
    ///
    /// # Errors
    /// `out` not as long as `xs`, a driver failure, [`crate::Error::DeviceStatus`] (bad
    /// values an earlier op met).
    pub fn sums_of_squares(&self, xs: &[&CudaView<'_, f32>], out: &mut [f64]) -> Result<()> {
        let xs: Vec<StoredView<'_, '_>> = xs.iter().map(|x| StoredView::F32(x)).collect();
        self.sums_of_squares_of(&xs, out)
    }

    /// [`ModelOps::sums_of_squares`] of tensors stored as f32 or as bf16 (widened exactly),
    /// in the same two launches and one wait: the norm of gradients some of which are
    /// stored in bf16. A bf16 tensor's sum is its widened values' sum as an f32 tensor's.
    ///
    /// # Errors
    /// As [`ModelOps::sums_of_squares`].
    pub fn sums_of_squares_of(&self, xs: &[StoredView<'_, '_>], out: &mut [f64]) -> Result<()> {
        const K: &str = "sums_of_squares";
        check_len(K, "out", xs.len(), out.len())?;
        // the non-empty tensors' table (the kernel's `SumSqTensor`: pointer, length, chunk,
        // first partial) and where each one's sum goes
        let mut table = Vec::with_capacity(5 * xs.len());
        let mut slots = Vec::with_capacity(xs.len());
        let mut guards = Vec::with_capacity(xs.len());
        let mut partials = 0usize;
        for (i, x) in xs.iter().enumerate() {
            out[i] = 0.0;
            let n = x.len();
            if n == 0 {
                continue;
            }
            let (chunk, blocks) = sum_of_squares_partition(n);
            let (ptr, guard) = x.device_ptr(&self.stream);
            guards.push(guard);
            let bf16 = u64::from(matches!(x, StoredView::Bf16(_)));
            table.extend([ptr, n as u64, chunk as u64, partials as u64, bf16]);
            partials += blocks;
            slots.push(i);
        }
        if slots.is_empty() {
            return self.check_status();
        }
        let count = slots.len();
        let (blocks, c32) = (
            i32_of(K, "blocks", partials)? as u32,
            i32_of(K, "tensors", count)?,
        );
        let mut totals = vec![0.0f64; count + 1];
        {
            let mut state = self.lock();
            let State {
                sums,
                sum_table,
                status,
                ..
            } = &mut *state;
            let mut tensors = super::scratch(sum_table, &self.stream, table.len())?;
            self.upload(&table, &mut tensors)?;
            let tensors = tensors.as_view();
            let mut sums = super::scratch(sums, &self.stream, partials + count + 1)?;
            let (mut part, mut rest) = sums.split_at_mut(partials);
            {
                let mut l = self.stream.launch_builder(&self.f.sum_sq_multi_partial);
                l.arg(&tensors).arg(&c32).arg(&mut part);
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (SUM_BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: argument order as `sum_sq_multi_partial`; the table holds `count`
                // tensors of live buffers (their pointers' guards held), ascending first
                // partials below `blocks`, `part` one slot per block.
                unsafe { l.launch(cfg) }.during(format!("{K}: partials"))?;
            }
            let part = part.as_view();
            let mut l = self.stream.launch_builder(&self.f.sum_sq_multi_final);
            l.arg(&tensors)
                .arg(&c32)
                .arg(&part)
                .arg(&mut *status)
                .arg(&mut rest);
            let cfg = LaunchConfig {
                grid_dim: (count as u32, 1, 1),
                block_dim: (SUM_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `sum_sq_multi_final`; `rest` holds `count + 1` f64.
            unsafe { l.launch(cfg) }.during(format!("{K}: totals"))?;
            drop(l);
            self.staging()
                .download(&self.stream, &rest.as_view(), &mut totals)?;
        }
        drop(guards);
        for (&i, &t) in slots.iter().zip(&totals) {
            out[i] = t;
        }
        match totals[count] as u32 {
            0 => Ok(()),
            word => super::status_result(word),
        }
    }

    /// One AdamW update in place (see [`AdamWStep`]). `param`, `grad`, `exp_avg` (first
    /// moment) and `exp_avg_sq` (second moment) have the same length; `copy` (as long, bf16
    /// bits) receives the updated parameter rounded to the nearest bf16 in the same pass (a
    /// model's bf16 weight copy). A gradient stored in bf16 is read widened (exact) as the
    /// kernels load it — the update of its widened values, without an f32 copy of them. A non-finite gradient anywhere leaves all of them
    /// untouched (checked on the device before the update) and is reported at the next
    /// [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that differ, a hyper-parameter out of range (named).
    pub fn adamw_step(
        &self,
        param: &mut CudaViewMut<'_, f32>,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, f32>,
        exp_avg_sq: &mut CudaViewMut<'_, f32>,
        step: &AdamWStep,
        copy: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<()> {
        let kernel = &self.f.adamw_update;
        let k = "adamw_step";
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::F32(param, 0));
        self.adamw_step_with(k, kernel, p, grad, m, v, None, step, copy)
    }

    /// [`ModelOps::adamw_step`] with both moments stored in bf16 (their bits): widened,
    /// updated in f32 as there, rounded back to bf16 stochastically — element `i` with
    /// `rounding_bits(key ⊕ M_STREAM / V_STREAM, i)`, `ares_cpu::ops::precision::moment_keys`
    /// (twin of `ares_cpu::ops::optim::adamw_step_scaled` on bf16 moments).
    ///
    /// # Errors
    /// As [`ModelOps::adamw_step`].
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn adamw_step_bf16(
        &self,
        param: &mut CudaViewMut<'_, f32>,
        key: u64,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, u16>,
        exp_avg_sq: &mut CudaViewMut<'_, u16>,
        step: &AdamWStep,
        copy: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<()> {
        let kernel = &self.f.adamw_update_bf16;
        let k = "adamw_step_bf16";
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::F32(param, key));
        self.adamw_step_with(k, kernel, p, grad, m, v, None, step, copy)
    }

    /// [`ModelOps::adamw_step`] with both moments stored in 8 bits, block-wise (twin of
    /// `ares_cpu::ops::optim_int8::adamw_step_int8`): `exp_avg`/`exp_avg_sq` one code per
    /// element, `exp_avg_absmax`/`exp_avg_sq_absmax` one scale per block of
    /// 2 048 elements (`INT8_BLOCK`), `maps` the signed then the unsigned dynamic map (512
    /// ascending values, read as given).
    ///
    /// # Errors
    /// As [`ModelOps::adamw_step`]; scales not `⌈len / INT8_BLOCK⌉` long, `maps` not 512.
    #[allow(clippy::too_many_arguments)] // the moments' codes and scales, each checked
    pub fn adamw_step_int8(
        &self,
        param: &mut CudaViewMut<'_, f32>,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, u8>,
        exp_avg_sq: &mut CudaViewMut<'_, u8>,
        exp_avg_absmax: &mut CudaViewMut<'_, f32>,
        exp_avg_sq_absmax: &mut CudaViewMut<'_, f32>,
        maps: &CudaView<'_, f32>,
        step: &AdamWStep,
        copy: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<()> {
        const K: &str = "adamw_step_int8";
        let (am, av) = (exp_avg_absmax, exp_avg_sq_absmax);
        let scales = self.int8_scales(K, param.len(), am, av, maps)?;
        let kernel = &self.f.adamw_update_int8;
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::F32(param, 0));
        self.adamw_step_with(K, kernel, p, grad, m, v, Some(scales), step, copy)
    }

    /// One AdamW update of a weight **stored in bf16** (`weight`, its bits) with f32
    /// moments, in one pass: each element widened, updated in f32 as
    /// [`ModelOps::adamw_step`] updates an f32 parameter, and written back rounded
    /// stochastically with the 16 random bits of `(key, i)` — the bits of
    /// [`ModelOps::from_bf16`], the f32 update and [`ModelOps::to_bf16_stochastic`] in turn,
    /// which take three passes over the weight and an f32 copy of it. A non-finite gradient
    /// leaves everything untouched, as there.
    ///
    /// # Errors
    /// As [`ModelOps::adamw_step`].
    pub fn adamw_step_bf16_weight(
        &self,
        weight: &mut CudaViewMut<'_, u16>,
        key: u64,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, f32>,
        exp_avg_sq: &mut CudaViewMut<'_, f32>,
        step: &AdamWStep,
    ) -> Result<()> {
        const K: &str = "adamw_step_bf16_weight";
        let kernel = &self.f.adamw_update;
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::Bf16(weight, key));
        self.adamw_step_with(K, kernel, p, grad, m, v, None, step, None)
    }

    /// [`ModelOps::adamw_step_bf16_weight`] with bf16 moments (as
    /// [`ModelOps::adamw_step_bf16`]).
    ///
    /// # Errors
    /// As [`ModelOps::adamw_step`].
    pub fn adamw_step_bf16_weight_bf16(
        &self,
        weight: &mut CudaViewMut<'_, u16>,
        key: u64,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, u16>,
        exp_avg_sq: &mut CudaViewMut<'_, u16>,
        step: &AdamWStep,
    ) -> Result<()> {
        const K: &str = "adamw_step_bf16_weight_bf16";
        let kernel = &self.f.adamw_update_bf16;
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::Bf16(weight, key));
        self.adamw_step_with(K, kernel, p, grad, m, v, None, step, None)
    }

    /// [`ModelOps::adamw_step_bf16_weight`] with 8-bit moments (as
    /// [`ModelOps::adamw_step_int8`]).
    ///
    /// # Errors
    /// As [`ModelOps::adamw_step_int8`].
    #[allow(clippy::too_many_arguments)] // the moments' codes and scales, each checked
    pub fn adamw_step_bf16_weight_int8(
        &self,
        weight: &mut CudaViewMut<'_, u16>,
        key: u64,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, u8>,
        exp_avg_sq: &mut CudaViewMut<'_, u8>,
        exp_avg_absmax: &mut CudaViewMut<'_, f32>,
        exp_avg_sq_absmax: &mut CudaViewMut<'_, f32>,
        maps: &CudaView<'_, f32>,
        step: &AdamWStep,
    ) -> Result<()> {
        const K: &str = "adamw_step_bf16_weight_int8";
        let (am, av) = (exp_avg_absmax, exp_avg_sq_absmax);
        let scales = self.int8_scales(K, weight.len(), am, av, maps)?;
        let kernel = &self.f.adamw_update_int8;
        let (m, v, p) = (exp_avg, exp_avg_sq, Target::Bf16(weight, key));
        self.adamw_step_with(K, kernel, p, grad, m, v, Some(scales), step, None)
    }

    /// The scales and launch shape of 8-bit moments of `n` elements, checked.
    fn int8_scales<'s, 'm, 'v, 'c>(
        &self,
        name: &'static str,
        n: usize,
        exp_avg_absmax: &'s mut CudaViewMut<'m, f32>,
        exp_avg_sq_absmax: &'s mut CudaViewMut<'v, f32>,
        maps: &'s CudaView<'c, f32>,
    ) -> Result<Int8Scales<'s, 'm, 'v, 'c>> {
        let blocks = n.div_ceil(INT8_BLOCK);
        check_len(name, "exp_avg_absmax", blocks, exp_avg_absmax.len())?;
        check_len(name, "exp_avg_sq_absmax", blocks, exp_avg_sq_absmax.len())?;
        check_len(name, "maps", 512, maps.len())?;
        let grid = i32_of(name, "blocks", blocks)?;
        let cfg = LaunchConfig {
            grid_dim: (grid.max(1) as u32, 1, 1),
            block_dim: (INT8_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(Int8Scales {
            m: exp_avg_absmax,
            v: exp_avg_sq_absmax,
            maps,
            cfg,
        })
    }

    /// The finiteness check, then `kernel`'s update of moments stored as `M` (8-bit ones
    /// with their scales and maps after them, and their own launch shape).
    #[allow(clippy::too_many_arguments)] // private: the three public entries' arguments
    fn adamw_step_with<M: DeviceRepr>(
        &self,
        name: &'static str,
        kernel: &CudaFunction,
        param: Target<'_, '_>,
        grad: StoredView<'_, '_>,
        exp_avg: &mut CudaViewMut<'_, M>,
        exp_avg_sq: &mut CudaViewMut<'_, M>,
        int8: Option<Int8Scales<'_, '_, '_, '_>>,
        step: &AdamWStep,
        copy: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<()> {
        let c = step.scalars()?;
        let n = param.len();
        check_len(name, "grad", n, grad.len())?;
        let (grad, grad_bf16) = match grad {
            StoredView::F32(g) => (Some(g), None),
            StoredView::Bf16(g) => (None, Some(g)),
        };
        check_len(name, "exp_avg", n, exp_avg.len())?;
        check_len(name, "exp_avg_sq", n, exp_avg_sq.len())?;
        if let Some(c) = &copy {
            check_len(name, "copy", n, c.len())?;
        }
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(name, "len", n)?;
        let mut guard = self.lock();
        let state = &mut *guard;
        self.stream
            .memset_zeros(&mut state.guard)
            .during(format!("{name}: clearing the guard"))?;
        {
            let mut l = self.stream.launch_builder(&self.f.adamw_check);
            l.arg_or_null(grad)
                .arg(&n64)
                .arg(&mut state.guard)
                .arg(&mut state.status)
                .arg_or_null(grad_bf16);
            // SAFETY: argument order as `adamw_check`.
            unsafe { l.launch(element_cfg(n)) }.during(format!("{name}: check"))?;
        }
        let scale = step.grad_scale;
        let mut l = self.stream.launch_builder(kernel);
        let (param, weight, key) = match param {
            Target::F32(p, key) => (Some(p), None, key),
            Target::Bf16(w, key) => (None, Some(w), key),
        };
        l.arg_or_null(param)
            .arg_or_null(grad)
            .arg(exp_avg)
            .arg(exp_avg_sq);
        let cfg = match int8 {
            Some(s) => {
                l.arg(s.m).arg(s.v).arg(s.maps);
                s.cfg
            }
            None => element_cfg(n),
        };
        l.arg(&n64)
            .arg(&scale)
            .arg(&c.decay)
            .arg(&c.apply_decay)
            .arg(&c.w1)
            .arg(&c.one_minus_w1)
            .arg(&c.b2)
            .arg(&c.w2)
            .arg(&c.neg_step_size)
            .arg(&c.bc2_sqrt)
            .arg(&c.eps)
            .arg(&state.guard)
            .arg_or_null(copy)
            .arg_or_null(weight)
            .arg(&key)
            .arg_or_null(grad_bf16);
        // SAFETY: argument order as `adamw_update` / `adamw_update_bf16` (moments of `M`, the
        // kernel's storage type) / `adamw_update_int8` (codes, then their scales and maps:
        // lengths checked by `adamw_step_int8`); lengths checked above.
        unsafe { l.launch(cfg) }.during(format!("{name}: update"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn torch_defaults(step: u64) -> AdamWStep {
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
            grad_scale: 1.0,
        }
    }

    #[test]
    fn per_step_constants_are_the_cpu_twins() {
        // step 2: bias corrections 1 − 0.9² = 0.19 and √(1 − 0.999²) = √0.001999.
        let c = torch_defaults(2)
            .scalars()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.decay, (1.0 - 1e-3 * 0.01) as f32);
        assert_eq!(c.apply_decay, 1);
        assert_eq!(c.w1, 0.1f64 as f32);
        assert_eq!(c.one_minus_w1, 1.0 - 0.1f64 as f32);
        assert_eq!(c.b2, 0.999f32);
        assert_eq!(c.w2, (1.0 - 0.999f64) as f32);
        assert_eq!(c.neg_step_size, (-1e-3 / 0.19f64) as f32);
        assert_eq!(c.bc2_sqrt, 0.001999f64.sqrt() as f32);
        assert_eq!(c.eps, 1e-8f32);
        let no_decay = AdamWStep {
            weight_decay: 0.0,
            ..torch_defaults(1)
        };
        assert_eq!(no_decay.scalars().map(|c| c.apply_decay).ok(), Some(0));
    }

    #[test]
    fn bad_hyper_parameters_are_named() {
        let msg = |s: AdamWStep| s.scalars().err().map(|e| e.to_string()).unwrap_or_default();
        let d = torch_defaults(1);
        assert!(msg(AdamWStep { beta1: 1.0, ..d }).contains("beta1 = 1"));
        assert!(msg(AdamWStep { beta2: -0.1, ..d }).contains("beta2"));
        assert!(msg(AdamWStep { eps: 0.0, ..d }).contains("eps = 0"));
        let wd = AdamWStep {
            weight_decay: f64::NAN,
            ..d
        };
        assert!(msg(wd).contains("weight_decay"));
        assert!(msg(AdamWStep { lr: -1.0, ..d }).contains("lr = -1"));
        let scale = AdamWStep {
            grad_scale: f32::INFINITY,
            ..d
        };
        assert!(msg(scale).contains("grad_scale"));
        assert!(msg(AdamWStep { step: 0, ..d }).contains("step = 0"));
    }
}
