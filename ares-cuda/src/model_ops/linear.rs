//! Linear layers with Hugging Face `[out, in]` weights: cuBLAS GEMMs (see
//! [`crate::gemm`]) plus the bias add and the bias gradient (a deterministic column sum).
//!
//! In [`GemmPrecision::Bf16`] each product's operands are first rounded into bf16 copies
//! (one conversion kernel each, freed in stream order after the GEMM). Weights stay f32 and
//! are converted on every call: ~6 bytes of traffic per weight element, small beside a
//! product over many tokens; few-token products are kept in f32 by the caller's rule
//! (`MatmulPrecision::for_rows` in ares-cpu).

use super::{ModelOps, check_len};
use crate::error::Result;
use crate::gemm::{GemmDims, GemmPrecision, Operand};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

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
            let (xb, wb) = (
                self.bf16_copy(x, d.precision)?,
                self.bf16_copy(w, d.precision)?,
            );
            let (x, w) = (operand(x, &xb), operand(w, &wb));
            if transposed {
                self.blas.linear_t(&d, x, w, out)?;
            } else {
                self.blas.linear(&d, x, w, out)?;
            }
        }
        match bias {
            Some(b) => self.bias_add(out, b, dims.rows),
            None => Ok(()),
        }
    }

    /// Backward of [`ModelOps::linear`] from `dout` `[rows, out]`; all three gradients
    /// **accumulate**: `dx += dout · w` (skipped if `None`), `dw += doutᵀ · x`,
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
        dw: &mut CudaViewMut<'_, f32>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        const K: &str = "linear_backward";
        let d = dims.blas(K)?;
        check_len(K, "dout", d.y_len, dout.len())?;
        check_len(K, "x", d.x_len, x.len())?;
        check_len(K, "w", d.w_len, w.len())?;
        check_len(K, "dw", d.w_len, dw.len())?;
        if let Some(g) = &dx {
            check_len(K, "dx", d.x_len, g.len())?;
        }
        if let Some(g) = &dbias {
            check_len(K, "dbias", dims.out_features, g.len())?;
        }
        // With rows, in or out zero every product is empty or adds nothing.
        if d.x_len != 0 && d.w_len != 0 && dims.rows != 0 {
            let p = d.precision;
            let doutb = self.bf16_copy(dout, p)?;
            if let Some(dx) = dx {
                let wb = self.bf16_copy(w, p)?;
                self.blas
                    .backward_dx(&d, operand(dout, &doutb), operand(w, &wb), dx)?;
            }
            let xb = self.bf16_copy(x, p)?;
            self.blas
                .backward_dw(&d, operand(dout, &doutb), operand(x, &xb), dw)?;
        }
        match dbias {
            Some(db) => self.column_sum_plain(K, dout, dims.rows, db),
            None => Ok(()),
        }
    }
}

impl ModelOps {
    /// A bf16 copy of `x` when `precision` is bf16, else nothing (the GEMM reads `x`).
    fn bf16_copy(
        &self,
        x: &CudaView<'_, f32>,
        precision: GemmPrecision,
    ) -> Result<Option<CudaSlice<u16>>> {
        match precision {
            GemmPrecision::Bf16 => self.to_bf16(x).map(Some),
            GemmPrecision::F32 | GemmPrecision::Tf32 => Ok(None),
        }
    }
}

/// The GEMM operand: the bf16 copy when there is one, else the f32 view.
fn operand<'a, 'b>(x: &'a CudaView<'b, f32>, copy: &'a Option<CudaSlice<u16>>) -> Operand<'a, 'b> {
    match copy {
        Some(c) => Operand::Bf16(c),
        None => Operand::F32(x),
    }
}
