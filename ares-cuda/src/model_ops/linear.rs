//! Linear layers with Hugging Face `[out, in]` weights: cuBLAS GEMMs (see
//! [`crate::gemm`]) plus the bias add and the bias gradient (a deterministic column sum).
//!
//! In [`GemmPrecision::Bf16`] each product's operands are first rounded into bf16 copies in
//! a scratch buffer that grows on demand and is reused (one conversion kernel per operand).
//! Weights stay f32 and are converted on every call: ~6 bytes of traffic per weight element, small beside a
//! product over many tokens; few-token products are kept in f32 by the caller's rule
//! (`MatmulPrecision::for_rows` in ares-cpu).

use super::{ModelOps, check_len};
use crate::error::DriverContext;
use crate::error::Result;
use crate::gemm::{GemmDims, GemmPrecision, Operand};
use cudarc::driver::{CudaView, CudaViewMut};

impl ModelOps {
    /// `out = x · wᵀ (+ bias)` with `x` `[rows, in]`, `w` `[out, in]`, `bias` `[out]`,
    /// `out` `[rows, out]` overwritten (twin of `ares_cpu::ops::matmul::linear_forward`).
    ///
    /// # Errors
    /// Lengths that do not match `dims`, sizes past cuBLAS's `int`.
    pub fn linear(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.linear_any("linear", x, w, bias, dims, out, false)
    }

    /// `out = x · wt (+ bias)` with the weight stored transposed, `wt` `[in, out]` (twin of
    /// `ares_cpu::ops::matmul::linear_forward_t`).
    ///
    /// # Errors
    /// As [`ModelOps::linear`].
    pub fn linear_transposed(
        &self,
        x: &CudaView<'_, f32>,
        wt: &CudaView<'_, f32>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.linear_any("linear_transposed", x, wt, bias, dims, out, true)
    }

    /// `out = x · wt (+ bias)` with `wt` `[in, out]` already in bf16 (bits, e.g. the
    /// generation's decode weights packed once): `x` is rounded to bf16 into the scratch
    /// buffer, the product runs on bf16 tensor cores with f32 sums (`dims.precision` is
    /// ignored: always bf16). The twin of `ares_cpu::ops::matmul_tiles::linear_forward_t_bf16`,
    /// which keeps `x` in f32.
    ///
    /// # Errors
    /// As [`ModelOps::linear`].
    pub fn linear_transposed_bf16(
        &self,
        x: &CudaView<'_, f32>,
        wt: &CudaView<'_, u16>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "linear_transposed_bf16";
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let d = dims.blas(K)?;
        check_len(K, "x", d.x_len, x.len())?;
        check_len(K, "wt", d.w_len, wt.len())?;
        check_len(K, "out", d.y_len, out.len())?;
        if let Some(b) = bias {
            check_len(K, "bias", dims.out_features, b.len())?;
        }
        if d.y_len == 0 {
            return Ok(());
        }
        if dims.in_features == 0 {
            self.fill(out, 0.0)?;
        } else {
            let mut state = self.lock();
            if state.bf16.len() < x.len() {
                // SAFETY: every element the GEMM reads is written by the conversion below.
                state.bf16 = unsafe { self.stream.alloc::<u16>(x.len().next_power_of_two()) }
                    .during(format!("growing the bf16 scratch to {} elements", x.len()))?;
            }
            self.to_bf16(x, &mut state.bf16.slice_mut(0..x.len()))?;
            let x16 = state.bf16.slice(0..x.len());
            self.blas
                .linear_t(&d, Operand::Bf16(&x16), Operand::Bf16(wt), out)?;
        }
        match bias {
            Some(b) => self.bias_add(out, b, dims.rows),
            None => Ok(()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn linear_any(
        &self,
        k: &'static str,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
        transposed: bool,
    ) -> Result<()> {
        let d = dims.blas(k)?;
        check_len(k, "x", d.x_len, x.len())?;
        check_len(k, if transposed { "wt" } else { "w" }, d.w_len, w.len())?;
        check_len(k, "out", d.y_len, out.len())?;
        if let Some(b) = bias {
            check_len(k, "bias", dims.out_features, b.len())?;
        }
        if d.y_len == 0 {
            return Ok(());
        }
        if dims.in_features == 0 {
            // An empty sum: cuBLAS is not asked for k = 0.
            self.fill(out, 0.0)?;
        } else {
            self.with_operands(d.precision, [x, w], |[x, w]| {
                if transposed {
                    self.blas.linear_t(&d, x, w, out)
                } else {
                    self.blas.linear(&d, x, w, out)
                }
            })?;
        }
        match bias {
            Some(b) => self.bias_add(out, b, dims.rows),
            None => Ok(()),
        }
    }

    /// Backward of [`ModelOps::linear`] from `dout` `[rows, out]`; all three gradients
    /// **accumulate**: `dx += dout · w` (skipped if `None`), `dw += doutᵀ · x` (skipped if
    /// `None`: a frozen weight),
    /// `dbias += Σ_rows dout` (skipped if `None`; a deterministic column sum). Twin of
    /// `ares_cpu::ops::matmul::linear_backward`.
    ///
    /// # Errors
    /// Lengths that do not match `dims`, sizes past cuBLAS's `int`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward(
        &self,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        dims: GemmDims,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        dw: Option<&mut CudaViewMut<'_, f32>>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        const K: &str = "linear_backward";
        let d = dims.blas(K)?;
        check_len(K, "dout", d.y_len, dout.len())?;
        check_len(K, "x", d.x_len, x.len())?;
        check_len(K, "w", d.w_len, w.len())?;
        if let Some(g) = &dw {
            check_len(K, "dw", d.w_len, g.len())?;
        }
        if let Some(g) = &dx {
            check_len(K, "dx", d.x_len, g.len())?;
        }
        if let Some(g) = &dbias {
            check_len(K, "dbias", dims.out_features, g.len())?;
        }
        // With rows, in or out zero every product is empty or adds nothing.
        if d.x_len != 0 && d.w_len != 0 && dims.rows != 0 {
            match (dx, dw) {
                (Some(dx), Some(dw)) => {
                    self.with_operands(d.precision, [dout, w, x], |[dout, w, x]| {
                        self.blas.backward_dx(&d, dout, w, dx)?;
                        self.blas.backward_dw(&d, dout, x, dw)
                    })?
                }
                (Some(dx), None) => self.with_operands(d.precision, [dout, w], |[dout, w]| {
                    self.blas.backward_dx(&d, dout, w, dx)
                })?,
                (None, Some(dw)) => self.with_operands(d.precision, [dout, x], |[dout, x]| {
                    self.blas.backward_dw(&d, dout, x, dw)
                })?,
                (None, None) => {}
            }
        }
        match dbias {
            Some(db) => self.column_sum_plain(K, dout, dims.rows, db),
            None => Ok(()),
        }
    }
}

impl ModelOps {
    /// Calls `gemms` with `srcs` as GEMM operands: the f32 views themselves, or in bf16
    /// their bf16 copies in the scratch buffer, converted first. The scratch stays locked
    /// until the GEMMs are queued; the next user's conversion queues after them on the one
    /// stream, so reusing it is safe.
    fn with_operands<const N: usize>(
        &self,
        precision: GemmPrecision,
        srcs: [&CudaView<'_, f32>; N],
        gemms: impl FnOnce([Operand<'_, '_>; N]) -> Result<()>,
    ) -> Result<()> {
        if precision != GemmPrecision::Bf16 {
            return gemms(srcs.map(Operand::F32));
        }
        // Each copy starts on a 256-byte boundary (cuBLAS picks its fastest tensor-core
        // kernels for aligned operands); the buffer itself comes aligned from the driver.
        const ALIGN: usize = 128;
        let mut state = self.lock();
        let total: usize = srcs.iter().map(|s| s.len().next_multiple_of(ALIGN)).sum();
        if state.bf16.len() < total {
            // SAFETY: every element a GEMM reads is written by a conversion below first.
            state.bf16 = unsafe { self.stream.alloc::<u16>(total.next_power_of_two()) }
                .during(format!("growing the bf16 scratch to {total} elements"))?;
        }
        let mut ranges = [(0usize, 0usize); N];
        let mut at = 0;
        for (src, range) in srcs.iter().zip(&mut ranges) {
            *range = (at, at + src.len());
            self.to_bf16(src, &mut state.bf16.slice_mut(at..at + src.len()))?;
            at += src.len().next_multiple_of(ALIGN);
        }
        let views = ranges.map(|(a, b)| state.bf16.slice(a..b));
        gemms(std::array::from_fn(|i| Operand::Bf16(&views[i])))
    }
}
