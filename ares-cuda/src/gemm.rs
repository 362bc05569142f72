//! Row-major f32 GEMMs of the linear layers through cuBLAS (loaded at run time).
//!
//! cuBLAS is column-major; a row-major `[r, c]` matrix is the column-major `[c, r]` one,
//! i.e. its transpose, so each product below is written for the transposes:
//!
//! - `linear`: `Y[rows, out] = X[rows, in] · W[out, in]ᵀ` ⇔ `Yᵀ = W · Xᵀ`:
//!   `sgemm(T, N, m = out, n = rows, k = in, A = W (lda = in), B = X (ldb = in), ldc = out)`.
//! - `linear_t` (`Wt = Wᵀ` stored `[in, out]`): `Yᵀ = Wtᵀ · Xᵀ`:
//!   `sgemm(N, N, m = out, n = rows, k = in, A = Wt (lda = out), B = X (ldb = in))`.
//! - `dX[rows, in] += dY[rows, out] · W[out, in]` ⇔ `dXᵀ += Wᵀ · dYᵀ`:
//!   `sgemm(N, N, m = in, n = rows, k = out, A = W (lda = in), B = dY (ldb = out), β = 1)`.
//! - `dW[out, in] += dYᵀ · X` ⇔ `dWᵀ += Xᵀ · dY`:
//!   `sgemm(N, T, m = in, n = out, k = rows, A = X (lda = in), B = dY (ldb = out), β = 1)`.
//!
//! Precision: the handle runs in `CUBLAS_DEFAULT_MATH`, true f32 products and sums (no
//! TF32), so results match the CPU backend to f32 rounding; [`Blas::set_tf32`] switches
//! to TF32 tensor cores (10-bit mantissa inputs, ~1e-3 relative error, several times
//! faster). The fast path for training is bf16 inputs with f32 accumulation
//! (`cublasGemmEx` / cuBLASLt), which needs bf16 weights and activations: not done yet.

use crate::error::{Error, Result};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut};
use std::ffi::c_int;
use std::sync::{Arc, Mutex};

/// True when cuBLAS (`libcublas.so`, with its `libcublasLt.so`) can be loaded.
pub fn cublas_available() -> bool {
    // SAFETY: only tries to dlopen the library; no cuBLAS function is called.
    unsafe { sys::is_culib_present() }
}

/// Sizes of a linear layer: `out[rows, out_features] = x[rows, in_features] ·
/// w[out_features, in_features]ᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmDims {
    /// Rows of `x` and `out` (tokens).
    pub rows: usize,
    /// Columns of `x`.
    pub in_features: usize,
    /// Columns of `out`.
    pub out_features: usize,
}

/// Validated cuBLAS sizes of a [`GemmDims`].
pub(crate) struct BlasDims {
    pub rows: c_int,
    pub inp: c_int,
    pub out: c_int,
    /// `rows · in`, `out · in`, `rows · out` elements.
    pub x_len: usize,
    pub w_len: usize,
    pub y_len: usize,
}

impl GemmDims {
    /// Checks that every size fits cuBLAS's `int` and the element counts fit `usize`.
    pub(crate) fn blas(&self, kernel: &'static str) -> Result<BlasDims> {
        let int = |what: &str, n: usize| {
            c_int::try_from(n).map_err(|_| Error::BadArgument {
                kernel,
                message: format!("{what} = {n} exceeds cuBLAS's limit 2^31 - 1"),
            })
        };
        let prod = |what: &str, a: usize, b: usize| {
            a.checked_mul(b).ok_or_else(|| Error::BadArgument {
                kernel,
                message: format!("{what} = {a} × {b} overflows"),
            })
        };
        Ok(BlasDims {
            rows: int("rows", self.rows)?,
            inp: int("in_features", self.in_features)?,
            out: int("out_features", self.out_features)?,
            x_len: prod("rows × in_features", self.rows, self.in_features)?,
            w_len: prod(
                "out_features × in_features",
                self.out_features,
                self.in_features,
            )?,
            y_len: prod("rows × out_features", self.rows, self.out_features)?,
        })
    }
}

/// A cuBLAS handle on one stream. Calls are serialised (a handle must not be used by two
/// threads at once).
pub struct Blas {
    blas: Mutex<CudaBlas>,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").finish_non_exhaustive()
    }
}

fn blas_err(step: impl Into<String>) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
    let step = step.into();
    move |source| Error::Blas { step, source }
}

/// One `C = α·op(A)·op(B) + β·C` call.
struct Call<'a, 'b> {
    transa: bool,
    transb: bool,
    m: c_int,
    n: c_int,
    k: c_int,
    a: &'a CudaView<'b, f32>,
    lda: c_int,
    b: &'a CudaView<'b, f32>,
    ldb: c_int,
    beta: f32,
    ldc: c_int,
}

impl Blas {
    /// A cuBLAS handle queuing on `stream`, in exact f32 mode.
    ///
    /// # Errors
    /// [`Error::LibraryMissing`] without libcublas, a cuBLAS failure.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        if !cublas_available() {
            return Err(Error::LibraryMissing {
                library: "libcublas.so (cuBLAS)",
            });
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err("creating the cuBLAS handle"))?;
        let this = Self {
            blas: Mutex::new(blas),
            stream,
        };
        this.set_tf32(false)?;
        Ok(this)
    }

    /// TF32 tensor cores for f32 GEMMs (`true`), or exact f32 (`false`, the default).
    ///
    /// # Errors
    /// A cuBLAS failure.
    pub fn set_tf32(&self, on: bool) -> Result<()> {
        let mode = if on {
            sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        let blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle is live (owned by `blas`).
        unsafe { sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .map_err(blas_err("cublasSetMathMode"))
    }

    fn sgemm(
        &self,
        step: &'static str,
        call: Call<'_, '_>,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(call.transa),
            transb: op(call.transb),
            m: call.m,
            n: call.n,
            k: call.k,
            alpha: 1.0f32,
            lda: call.lda,
            ldb: call.ldb,
            beta: call.beta,
            ldc: call.ldc,
        };
        let blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        // cuBLAS runs in the context current on this thread.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|source| Error::Driver {
                step: format!("{step}: binding the context"),
                source,
            })?;
        // SAFETY: the callers check every view's length against (m, n, k) and the leading
        // dimensions, so cuBLAS reads and writes inside the views.
        unsafe { blas.gemm(cfg, call.a, call.b, c) }.map_err(blas_err(format!("{step}: sgemm")))
    }

    /// `y = x · wᵀ` (overwrites `y`), `w` `[out, in]`.
    pub(crate) fn linear(
        &self,
        d: &BlasDims,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: true,
            transb: false,
            m: d.out,
            n: d.rows,
            k: d.inp,
            a: w,
            lda: d.inp,
            b: x,
            ldb: d.inp,
            beta: 0.0,
            ldc: d.out,
        };
        self.sgemm("linear", call, y)
    }

    /// `y = x · wt` (overwrites `y`), `wt` `[in, out]`.
    pub(crate) fn linear_t(
        &self,
        d: &BlasDims,
        x: &CudaView<'_, f32>,
        wt: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: false,
            m: d.out,
            n: d.rows,
            k: d.inp,
            a: wt,
            lda: d.out,
            b: x,
            ldb: d.inp,
            beta: 0.0,
            ldc: d.out,
        };
        self.sgemm("linear_transposed", call, y)
    }

    /// `dx += dy · w`.
    pub(crate) fn backward_dx(
        &self,
        d: &BlasDims,
        dy: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: false,
            m: d.inp,
            n: d.rows,
            k: d.out,
            a: w,
            lda: d.inp,
            b: dy,
            ldb: d.out,
            beta: 1.0,
            ldc: d.inp,
        };
        self.sgemm("linear_backward dx", call, dx)
    }

    /// `dw += dyᵀ · x`.
    pub(crate) fn backward_dw(
        &self,
        d: &BlasDims,
        dy: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        dw: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: true,
            m: d.inp,
            n: d.out,
            k: d.rows,
            a: x,
            lda: d.inp,
            b: dy,
            ldb: d.out,
            beta: 1.0,
            ldc: d.inp,
        };
        self.sgemm("linear_backward dw", call, dw)
    }
}
