//! Linear layers with Hugging Face `[out, in]` weights: cuBLAS GEMMs (see
//! [`crate::gemm`]) plus the bias add and the bias gradient (a deterministic column sum).
//!
//! In [`GemmPrecision::Bf16`] each product's f32 operands are first rounded into bf16 copies
//! in a scratch buffer that grows on demand and is reused (one conversion kernel per
//! operand). An f32 weight is converted on every call (~6 bytes of traffic per weight
//! element); [`ModelOps::linear_bf16`] and [`ModelOps::linear_backward_bf16`] take the
//! weight already in bf16 (a model's copy, rounded once per optimizer step), so only the
//! activations are converted. Few-token products are kept in f32 by the caller's rule
//! (`MatmulPrecision::for_rows` in ares-cpu).

use super::{ModelOps, check_len};
use crate::error::DriverContext;
use crate::error::Result;
use crate::gemm::{GemmDims, GemmPrecision, Operand, Output, Overwrite};
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
        self.linear_any(
            "linear",
            Operand::F32(x),
            Operand::F32(w),
            bias,
            dims,
            out,
            false,
        )
    }

    /// [`ModelOps::linear`] with the weight `w` `[out, in]` already in bf16 (bits): `x` is
    /// rounded to bf16 into the scratch buffer, `w` read as it is, bf16 tensor cores with f32
    /// sums (`dims.precision` is ignored: always bf16). The twin of
    /// `ares_cpu::ops::matmul::linear_forward_bf16`.
    ///
    /// # Errors
    /// As [`ModelOps::linear`].
    pub fn linear_bf16(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, u16>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let x = Operand::F32(x);
        self.linear_any("linear_bf16", x, Operand::Bf16(w), bias, dims, out, false)
    }

    /// [`ModelOps::linear_bf16`] with `x` stored in bf16 too (an activation kept in bf16):
    /// both operands read as they are, no conversion (twin of
    /// `ares_cpu::ops::matmul::linear_forward_bf16_x`).
    ///
    /// # Errors
    /// As [`ModelOps::linear`].
    pub fn linear_bf16_x(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let (x, w) = (Operand::Bf16(x), Operand::Bf16(w));
        self.linear_any("linear_bf16_x", x, w, bias, dims, out, false)
    }

    /// [`ModelOps::linear_bf16_x`] with the output stored in bf16 too: each f32 sum (with
    /// the bias) rounded once to nearest even — the GEMM writes bf16 itself, or with a bias
    /// an f32 result is rounded after the bias add (twin of
    /// `ares_cpu::ops::matmul::linear_forward_bf16_io`).
    ///
    /// # Errors
    /// As [`ModelOps::linear`].
    pub fn linear_bf16_io(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        bias: Option<&CudaView<'_, f32>>,
        dims: GemmDims,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        const K: &str = "linear_bf16_io";
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let d = dims.blas(K)?;
        check_len(K, "x", d.x_len, x.len())?;
        check_len(K, "w", d.w_len, w.len())?;
        check_len(K, "out", d.y_len, out.len())?;
        if let Some(b) = bias {
            // the bias joins the sum before its one rounding: an f32 result first (from the
            // stream-ordered pool, which keeps freed memory: no driver call a product)
            // SAFETY: `linear_any` writes every element (a β = 0 GEMM or the k = 0 fill)
            // before the rounding reads it.
            let mut y = unsafe { self.stream.alloc::<f32>(d.y_len) }
                .during(format!("{K}: the f32 result before rounding"))?;
            let (x, w) = (Operand::Bf16(x), Operand::Bf16(w));
            self.linear_any(K, x, w, Some(b), dims, &mut y.slice_mut(..), false)?;
            return self.to_bf16(&y.slice(..), out);
        }
        if d.y_len == 0 {
            return Ok(());
        }
        if dims.in_features == 0 {
            // an empty sum (cuBLAS is not asked for k = 0): +0.0, whose bf16 bits are 0
            return self
                .stream
                .memset_zeros(out)
                .during(format!("{K}: zeroing out"));
        }
        let (x, w) = (Operand::Bf16(x), Operand::Bf16(w));
        self.blas.linear(&d, x, w, Output::Bf16(out))
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
        self.linear_any(
            "linear_transposed",
            Operand::F32(x),
            Operand::F32(wt),
            bias,
            dims,
            out,
            true,
        )
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
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        self.linear_any(
            "linear_transposed_bf16",
            Operand::F32(x),
            Operand::Bf16(wt),
            bias,
            dims,
            out,
            true,
        )
    }

    /// `out = x · wᵀ` (or `x · wt`) with `x` and `w` each f32 or bf16 (an f32 operand is
    /// rounded to a bf16 copy when `dims.precision` is bf16; a bf16 one needs bf16).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_any(
        &self,
        k: &'static str,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
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
        // with a bias, cuBLASLt adds it in the GEMM's epilogue where it can (`gemm_lt.rs`)
        let mut bias_added = false;
        if dims.in_features == 0 {
            // An empty sum: cuBLAS is not asked for k = 0.
            self.fill(out, 0.0)?;
        } else {
            self.with_operands(d.precision, [x, w], |[x, w]| {
                if let Some(b) = bias {
                    bias_added = self.blas.linear_bias(&d, x, w, b, out, transposed)?;
                }
                match (bias_added, transposed) {
                    (true, _) => Ok(()),
                    (false, true) => self.blas.linear_t(&d, x, w, out),
                    (false, false) => self.blas.linear(&d, x, w, Output::F32(out)),
                }
            })?;
        }
        match bias {
            Some(b) if !bias_added => self.bias_add(out, b, dims.rows),
            _ => Ok(()),
        }
    }

    /// Biased products that ran with the bias in cuBLASLt's epilogue so far (`None`:
    /// cuBLASLt not in use — not loadable, or `ARES_CUBLASLT=0`).
    pub fn bias_epilogues(&self) -> Option<u64> {
        self.blas.bias_epilogues()
    }

    /// Backward of [`ModelOps::linear`] from `dout` `[rows, out]`: `dx (+)= dout · w`
    /// (skipped if `None`) and `dw (+)= doutᵀ · x` (skipped if `None`: a frozen weight),
    /// each written over (cuBLAS's `β = 0`) or added into as `overwrite` says, and
    /// `dbias += Σ_rows dout` (skipped if `None`; a deterministic column sum). Twin of
    /// `ares_cpu::ops::matmul::linear_backward_in`.
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
        overwrite: Overwrite,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        dw: Option<&mut CudaViewMut<'_, f32>>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let k = "linear_backward";
        let (x, w) = (Operand::F32(x), Operand::F32(w));
        self.linear_backward_any(k, dout, x, w, dims, overwrite, dx, dw, dbias)
    }

    /// Backward of [`ModelOps::linear_bf16`]: [`ModelOps::linear_backward`] with `dout` and
    /// `x` rounded to bf16 and the bf16 weight `w` read as it is (always bf16). Twin of
    /// `ares_cpu::ops::matmul::linear_backward_bf16`.
    ///
    /// # Errors
    /// As [`ModelOps::linear_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_bf16(
        &self,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, u16>,
        dims: GemmDims,
        overwrite: Overwrite,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        dw: Option<&mut CudaViewMut<'_, f32>>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let k = "linear_backward_bf16";
        let (x, w) = (Operand::F32(x), Operand::Bf16(w));
        self.linear_backward_any(k, dout, x, w, dims, overwrite, dx, dw, dbias)
    }

    /// [`ModelOps::linear_backward_bf16`] with the forward's `x` stored in bf16 (as
    /// [`ModelOps::linear_bf16_x`]), read as it is; `dout` rounded to bf16. Twin of
    /// `ares_cpu::ops::matmul::linear_backward_bf16_x`.
    ///
    /// # Errors
    /// As [`ModelOps::linear_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_bf16_x(
        &self,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        dims: GemmDims,
        overwrite: Overwrite,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        dw: Option<&mut CudaViewMut<'_, f32>>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let dims = GemmDims {
            precision: GemmPrecision::Bf16,
            ..dims
        };
        let k = "linear_backward_bf16_x";
        let (x, w) = (Operand::Bf16(x), Operand::Bf16(w));
        self.linear_backward_any(k, dout, x, w, dims, overwrite, dx, dw, dbias)
    }

    /// [`ModelOps::linear_backward`] with `x` and `w` each f32 or bf16 (see
    /// [`ModelOps::linear_any`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_backward_any(
        &self,
        k: &'static str,
        dout: &CudaView<'_, f32>,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
        dims: GemmDims,
        overwrite: Overwrite,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        dw: Option<&mut CudaViewMut<'_, f32>>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let d = dims.blas(k)?;
        check_len(k, "dout", d.y_len, dout.len())?;
        check_len(k, "x", d.x_len, x.len())?;
        check_len(k, "w", d.w_len, w.len())?;
        if let Some(g) = &dw {
            check_len(k, "dw", d.w_len, g.len())?;
        }
        if let Some(g) = &dx {
            check_len(k, "dx", d.x_len, g.len())?;
        }
        if let Some(g) = &dbias {
            check_len(k, "dbias", dims.out_features, g.len())?;
        }
        // With rows, in or out zero every product is empty or adds nothing; an overwritten
        // `dx` of an empty product (out = 0) is zero, and so is an overwritten `dw` of one
        // (rows = 0).
        let (mut dx, mut dw) = (dx, dw);
        if overwrite.dx
            && d.w_len == 0
            && let Some(g) = dx.as_deref_mut()
        {
            self.stream
                .memset_zeros(g)
                .during(format!("{k}: zeroing dx"))?;
        }
        if overwrite.dw
            && dims.rows == 0
            && let Some(g) = dw.as_deref_mut()
        {
            self.stream
                .memset_zeros(g)
                .during(format!("{k}: zeroing dw"))?;
        }
        let (beta, dw_beta) = (f32::from(!overwrite.dx), f32::from(!overwrite.dw));
        if d.x_len != 0 && d.w_len != 0 && dims.rows != 0 {
            match (dx, dw) {
                (Some(dx), Some(dw)) => {
                    let srcs = [Operand::F32(dout), w, x];
                    self.with_operands(d.precision, srcs, |[dout, w, x]| {
                        self.blas.backward_dx(&d, dout, w, beta, dx)?;
                        self.blas.backward_dw(&d, dout, x, dw_beta, dw)
                    })?
                }
                (Some(dx), None) => {
                    let srcs = [Operand::F32(dout), w];
                    self.with_operands(d.precision, srcs, |[dout, w]| {
                        self.blas.backward_dx(&d, dout, w, beta, dx)
                    })?
                }
                (None, Some(dw)) => {
                    let srcs = [Operand::F32(dout), x];
                    self.with_operands(d.precision, srcs, |[dout, x]| {
                        self.blas.backward_dw(&d, dout, x, dw_beta, dw)
                    })?
                }
                (None, None) => {}
            }
        }
        match dbias {
            Some(db) => self.column_sum_plain(k, dout, dims.rows, db),
            None => Ok(()),
        }
    }
}

impl ModelOps {
    /// Calls `gemms` with `srcs` as GEMM operands: f32 views themselves, or in bf16 their
    /// bf16 copies in the scratch buffer, converted first; bf16 views (stored weights) as
    /// they are, in bf16 only. The scratch stays locked until the GEMMs are queued; the next
    /// user's conversion queues after them on the one stream, so reusing it is safe.
    fn with_operands<const N: usize>(
        &self,
        precision: GemmPrecision,
        srcs: [Operand<'_, '_>; N],
        gemms: impl FnOnce([Operand<'_, '_>; N]) -> Result<()>,
    ) -> Result<()> {
        if precision != GemmPrecision::Bf16 {
            // (a bf16 operand here is refused by the GEMM: it checks operands and precision)
            return gemms(srcs);
        }
        // Each copy starts on a 256-byte boundary (cuBLAS picks its fastest tensor-core
        // kernels for aligned operands); the buffer itself comes aligned from the driver.
        const ALIGN: usize = 128;
        let mut state = self.lock();
        let converted = |s: &Operand<'_, '_>| match s {
            Operand::F32(v) => v.len().next_multiple_of(ALIGN),
            Operand::Bf16(_) => 0,
        };
        let total: usize = srcs.iter().map(converted).sum();
        if state.bf16.len() < total {
            // SAFETY: every element a GEMM reads is written by a conversion below first.
            state.bf16 = unsafe { self.stream.alloc::<u16>(total.next_power_of_two()) }
                .during(format!("growing the bf16 scratch to {total} elements"))?;
        }
        let mut ranges = [None; N];
        let mut at = 0;
        for (src, range) in srcs.iter().zip(&mut ranges) {
            if let Operand::F32(v) = src {
                *range = Some((at, at + v.len()));
                self.to_bf16(v, &mut state.bf16.slice_mut(at..at + v.len()))?;
                at += converted(src);
            }
        }
        let views = ranges.map(|r| r.map(|(a, b)| state.bf16.slice(a..b)));
        gemms(std::array::from_fn(|i| match (&srcs[i], &views[i]) {
            (_, Some(copy)) => Operand::Bf16(copy),
            (Operand::Bf16(v), None) => Operand::Bf16(v),
            // not reached (every f32 source has a copy); the GEMM refuses mixed operands
            (Operand::F32(v), None) => Operand::F32(v),
        }))
    }
}
