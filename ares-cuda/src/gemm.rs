//! Row-major GEMMs of the linear layers through cuBLAS (loaded at run time).
//!
//! cuBLAS is column-major; a row-major `[r, c]` matrix is the column-major `[c, r]` one,
//! i.e. its transpose, so each product below is written for the transposes:
//!
//! - `linear`: `Y[rows, out] = X[rows, in] · W[out, in]ᵀ` ⇔ `Yᵀ = W · Xᵀ`:
//!   `gemm(T, N, m = out, n = rows, k = in, A = W (lda = in), B = X (ldb = in), ldc = out)`.
//! - `linear_t` (`Wt = Wᵀ` stored `[in, out]`): `Yᵀ = Wtᵀ · Xᵀ`:
//!   `gemm(N, N, m = out, n = rows, k = in, A = Wt (lda = out), B = X (ldb = in))`.
//! - `dX[rows, in] += dY[rows, out] · W[out, in]` ⇔ `dXᵀ += Wᵀ · dYᵀ`:
//!   `gemm(N, N, m = in, n = rows, k = out, A = W (lda = in), B = dY (ldb = out), β = 1)`.
//! - `dW[out, in] += dYᵀ · X` ⇔ `dWᵀ += Xᵀ · dY`:
//!   `gemm(N, T, m = in, n = out, k = rows, A = X (lda = in), B = dY (ldb = out), β = 1)`.
//!
//! Precision, per call ([`GemmPrecision`]); every product is one `cublasGemmEx` with f32
//! output and f32 accumulation:
//! - `F32`: f32 operands, `CUBLAS_COMPUTE_32F` on a handle in `CUBLAS_DEFAULT_MATH`: true
//!   f32 products (no TF32), matching the CPU backend to f32 rounding;
//! - `Tf32`: f32 operands, `CUBLAS_COMPUTE_32F_FAST_TF32`: tensor cores round them to TF32;
//! - `Bf16`: bf16 operands (the callers convert them into a scratch buffer, see
//!   `model_ops/linear.rs`),
//!   `CUDA_R_16BF` inputs with `CUBLAS_COMPUTE_32F`: bf16 tensor cores, f32 sums.

use crate::error::{Error, Result};
use crate::gemm_lt::{BiasGemm, Lt, LtTypes};
use cudarc::cublas::{CudaBlas, result as blas_result, sys};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

/// True when cuBLAS (`libcublas.so`, with its `libcublasLt.so`) can be loaded.
pub fn cublas_available() -> bool {
    // SAFETY: only tries to dlopen the library; no cuBLAS function is called.
    unsafe { sys::is_culib_present() }
}

/// How a GEMM multiplies (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmPrecision {
    /// True f32 products.
    #[default]
    F32,
    /// f32 operands rounded to TF32 by the tensor cores.
    Tf32,
    /// bf16 operands (converted by the caller), f32 sums.
    Bf16,
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
    /// How the products multiply.
    pub precision: GemmPrecision,
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
    pub precision: GemmPrecision,
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
            precision: self.precision,
        })
    }
}

/// A cuBLAS handle on one stream. Calls are serialised (a handle must not be used by two
/// threads at once).
pub struct Blas {
    blas: Mutex<CudaBlas>,
    stream: Arc<CudaStream>,
    /// cuBLAS's workspace, ours: a GEMM in a captured CUDA graph must not allocate one.
    /// cuBLASLt's products are given it too (they queue on the same stream).
    workspace: cudarc::driver::CudaSlice<u8>,
    /// cuBLASLt, for the bias epilogue (`None`: not loadable or turned off).
    lt: Option<Lt>,
}

/// Bytes of cuBLAS's workspace (what NVIDIA's documentation asks for on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").finish_non_exhaustive()
    }
}

fn blas_err(step: impl Into<String>) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
    let step = step.into();
    move |source| Error::Blas { step, source }
}

/// A GEMM operand: f32 (for `F32` and `Tf32`) or bf16 bits (`u16`, for `Bf16`: a stored
/// bf16 tensor, or an f32 operand's bf16 copy).
#[derive(Clone, Copy)]
pub enum Operand<'a, 'b> {
    /// f32 values (multiplied in f32 or TF32, or rounded to a bf16 copy first).
    F32(&'a CudaView<'b, f32>),
    /// bf16 values (their bits), multiplied as they are.
    Bf16(&'a CudaView<'b, u16>),
}

impl Operand<'_, '_> {
    /// The device address, with the guard that records the read on `stream` when dropped.
    fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        match self {
            Operand::F32(v) => v.device_ptr(stream),
            Operand::Bf16(s) => s.device_ptr(stream),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(v) => v.len(),
            Operand::Bf16(s) => s.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which gradients of a linear backward are written over (`β = 0`, the old contents never
/// read) rather than added into (`β = 1`); the bias gradient always adds (twin of
/// `ares_cpu::ops::matmul::Overwrite`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overwrite {
    /// The input gradient `dx`.
    pub dx: bool,
    /// The weight gradient `dw`.
    pub dw: bool,
}

/// A GEMM's output: f32, or bf16 bits (each f32 sum rounded once, to nearest even; only
/// written over, `β = 0`).
pub enum Output<'a, 'b> {
    /// f32 values.
    F32(&'a mut CudaViewMut<'b, f32>),
    /// bf16 bits.
    Bf16(&'a mut CudaViewMut<'b, u16>),
}

impl Output<'_, '_> {
    /// Elements.
    fn len(&self) -> usize {
        match self {
            Output::F32(v) => v.len(),
            Output::Bf16(v) => v.len(),
        }
    }
}

/// One `C = α·op(A)·op(B) + β·C` call, in cuBLAS's column-major terms: `op(A)` is
/// `[m, k]`, `op(B)` `[k, n]`, `C` `[m, n]`. Every operand is packed (its leading
/// dimension is its stored row count), which is what the row-major tensors of the model
/// are when read column-major.
struct Call<'a, 'b> {
    transa: bool,
    transb: bool,
    m: c_int,
    n: c_int,
    k: c_int,
    a: Operand<'a, 'b>,
    b: Operand<'a, 'b>,
    beta: f32,
    precision: GemmPrecision,
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
        // SAFETY: the handle is live (owned by `blas`). Default math: no TF32 unless a
        // call asks for it through its compute type.
        unsafe { sys::cublasSetMathMode(*blas.handle(), sys::cublasMath_t::CUBLAS_DEFAULT_MATH) }
            .result()
            .map_err(blas_err("cublasSetMathMode"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| Error::Driver {
                step: "allocating cuBLAS's workspace".into(),
                source: e,
            })?;
        {
            let (ptr, _guard) = workspace.device_ptr(&stream);
            // SAFETY: the handle is live; the workspace lives as long as `Self` (which owns
            // both) and is only used on `stream`, the handle's.
            unsafe {
                sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, WORKSPACE_BYTES)
            }
            .result()
            .map_err(blas_err("cublasSetWorkspace"))?;
        }
        Ok(Self {
            blas: Mutex::new(blas),
            stream,
            workspace,
            lt: Lt::new(),
        })
    }

    /// Products that ran with the bias in cuBLASLt's epilogue so far (`None`: cuBLASLt is
    /// not in use, see `gemm_lt.rs`).
    pub(crate) fn bias_epilogues(&self) -> Option<u64> {
        self.lt.as_ref().map(Lt::calls)
    }

    /// `y = x · wᵀ + bias` (or `x · wt + bias`, `transposed`) in one cuBLASLt call with the
    /// bias epilogue, overwriting the f32 `y`; `Ok(false)` when it was not run (no
    /// cuBLASLt, an unaligned bias, no algorithm for the shape) and the caller is to
    /// multiply and add the bias itself.
    pub(crate) fn linear_bias(
        &self,
        d: &BlasDims,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
        bias: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        transposed: bool,
    ) -> Result<bool> {
        let Some(lt) = &self.lt else { return Ok(false) };
        let span = |a: c_int, b: c_int| a as usize * b as usize;
        let same_type = matches!(
            (&x, &w, d.precision),
            (Operand::Bf16(_), Operand::Bf16(_), GemmPrecision::Bf16)
                | (
                    Operand::F32(_),
                    Operand::F32(_),
                    GemmPrecision::F32 | GemmPrecision::Tf32
                )
        );
        if !same_type
            || x.len() < span(d.rows, d.inp)
            || w.len() < span(d.out, d.inp)
            || y.len() < span(d.rows, d.out)
            || bias.len() < d.out as usize
        {
            return Err(Error::BadArgument {
                kernel: "linear (bias epilogue)",
                message: format!(
                    "internal: operands ({} and {} elements, bias {}) do not fit rows={} in={} \
                     out={} or precision {:?}",
                    x.len(),
                    w.len(),
                    bias.len(),
                    d.rows,
                    d.inp,
                    d.out,
                    d.precision
                ),
            });
        }
        let _blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        let stream = &self.stream;
        stream
            .context()
            .bind_to_thread()
            .map_err(|source| Error::Driver {
                step: "linear (bias epilogue): binding the context".into(),
                source,
            })?;
        // The guards record the reads and the write on `stream` when they drop, after the
        // call is queued.
        let (a, _ra) = w.device_ptr(stream);
        let (b, _rb) = x.device_ptr(stream);
        let (bp, _rbias) = bias.device_ptr(stream);
        let (dp, _rd) = y.device_ptr_mut(stream);
        let (ws, _rws) = self.workspace.device_ptr(stream);
        let g = BiasGemm {
            transa: !transposed,
            m: d.out,
            n: d.rows,
            k: d.inp,
            types: match d.precision {
                GemmPrecision::F32 => LtTypes::F32,
                GemmPrecision::Tf32 => LtTypes::TF32,
                GemmPrecision::Bf16 => LtTypes::BF16,
            },
            a,
            b,
            d: dp,
            bias: bp,
        };
        // SAFETY: the spans were checked above (the callers check every view against the
        // layer's shape too); the workspace is ours and used on `stream` only, under the
        // handle lock that orders it with cuBLAS's own use; the context is bound.
        Ok(unsafe { lt.matmul_bias(stream, (ws, WORKSPACE_BYTES), &g) })
    }

    fn gemm(&self, step: &'static str, call: Call<'_, '_>, c: Output<'_, '_>) -> Result<()> {
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Stored shapes (rows, cols) of A and B; packed, so the leading dimension of each
        // is its rows and cuBLAS touches rows · cols elements.
        let (ar, ac) = if call.transa {
            (call.k, call.m)
        } else {
            (call.m, call.k)
        };
        let (br, bc) = if call.transb {
            (call.n, call.k)
        } else {
            (call.k, call.n)
        };
        let (lda, ldb, ldc) = (ar, br, call.m);
        let span = |rows: c_int, cols: c_int| rows as usize * cols as usize;
        let spans_ok = call.a.len() >= span(ar, ac)
            && call.b.len() >= span(br, bc)
            && c.len() >= span(call.m, call.n);
        let mixed = matches!(
            (&call.a, &call.b),
            (Operand::F32(_), Operand::Bf16(_)) | (Operand::Bf16(_), Operand::F32(_))
        );
        let bf16_in = matches!(call.a, Operand::Bf16(_));
        let bf16_out = matches!(c, Output::Bf16(_));
        if !spans_ok
            || mixed
            || bf16_in != (call.precision == GemmPrecision::Bf16)
            || (bf16_out && (!bf16_in || call.beta != 0.0))
        {
            return Err(Error::BadArgument {
                kernel: step,
                message: format!(
                    "internal: operands ({} and {} elements) do not fit m={} n={} k={} or \
                     precision {:?}",
                    call.a.len(),
                    call.b.len(),
                    call.m,
                    call.n,
                    call.k,
                    call.precision
                ),
            });
        }
        let (in_type, compute) = match call.precision {
            GemmPrecision::F32 => (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            GemmPrecision::Tf32 => (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            GemmPrecision::Bf16 => (
                sys::cudaDataType_t::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
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
        let stream = &self.stream;
        // The pointers' guards record the reads and the write on `stream` when they drop,
        // after the call is queued.
        let (a, _ra) = call.a.device_ptr(stream);
        let (b, _rb) = call.b.device_ptr(stream);
        let (cp, c_type, _rc) = match c {
            Output::F32(v) => {
                let (p, g) = v.device_ptr_mut(stream);
                (p, sys::cudaDataType_t::CUDA_R_32F, g)
            }
            Output::Bf16(v) => {
                let (p, g) = v.device_ptr_mut(stream);
                (p, sys::cudaDataType_t::CUDA_R_16BF, g)
            }
        };
        let alpha = 1.0f32;
        // SAFETY: the spans were checked above (the callers also check every view against
        // the layer's shape), so cuBLAS reads and writes inside the buffers; alpha and beta
        // are f32 as CUBLAS_COMPUTE_32F* require; the handle is live and bound to `stream`.
        unsafe {
            blas_result::gemm_ex(
                *blas.handle(),
                op(call.transa),
                op(call.transb),
                call.m,
                call.n,
                call.k,
                (&raw const alpha).cast::<c_void>(),
                a as *const c_void,
                in_type,
                lda,
                b as *const c_void,
                in_type,
                ldb,
                (&raw const call.beta).cast::<c_void>(),
                cp as *mut c_void,
                c_type,
                ldc,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err(format!(
            "{step}: cublasGemmEx ({:?})",
            call.precision
        )))
    }

    /// `y = x · wᵀ` (overwrites `y`, f32 or bf16), `w` `[out, in]`.
    pub(crate) fn linear(
        &self,
        d: &BlasDims,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
        y: Output<'_, '_>,
    ) -> Result<()> {
        let call = Call {
            transa: true,
            transb: false,
            m: d.out,
            n: d.rows,
            k: d.inp,
            a: w,
            b: x,
            beta: 0.0,
            precision: d.precision,
        };
        self.gemm("linear", call, y)
    }

    /// `y = x · wt` (overwrites `y`), `wt` `[in, out]`.
    pub(crate) fn linear_t(
        &self,
        d: &BlasDims,
        x: Operand<'_, '_>,
        wt: Operand<'_, '_>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: false,
            m: d.out,
            n: d.rows,
            k: d.inp,
            a: wt,
            b: x,
            beta: 0.0,
            precision: d.precision,
        };
        self.gemm("linear_transposed", call, Output::F32(y))
    }

    /// `dx = β·dx + dy · w` (`β` 1 accumulates; 0 overwrites without reading `dx`).
    pub(crate) fn backward_dx(
        &self,
        d: &BlasDims,
        dy: Operand<'_, '_>,
        w: Operand<'_, '_>,
        beta: f32,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: false,
            m: d.inp,
            n: d.rows,
            k: d.out,
            a: w,
            b: dy,
            beta,
            precision: d.precision,
        };
        self.gemm("linear_backward dx", call, Output::F32(dx))
    }

    /// `dw = β·dw + dyᵀ · x` (`β` 1 accumulates; 0 overwrites without reading `dw`).
    pub(crate) fn backward_dw(
        &self,
        d: &BlasDims,
        dy: Operand<'_, '_>,
        x: Operand<'_, '_>,
        beta: f32,
        dw: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let call = Call {
            transa: false,
            transb: true,
            m: d.inp,
            n: d.out,
            k: d.rows,
            a: x,
            b: dy,
            beta,
            precision: d.precision,
        };
        self.gemm("linear_backward dw", call, Output::F32(dw))
    }
}
