//! The bias add folded into the GEMM's epilogue through cuBLASLt (loaded at run time, as
//! cuBLAS is): `Y = X·Wᵀ + b` is one kernel instead of a GEMM and a pass over `Y` — on a
//! Qwen2.5 decoder three fewer launches a layer (q, k, v), on a vision tower five a block
//! (qkv, proj, the MLP's three).
//!
//! The epilogue adds the bias to each f32 sum and writes the result once, the arithmetic of
//! the GEMM followed by `bias_add` (both round `Σ + b` once in f32). Only f32 outputs take
//! it: the bias is then f32 as cuBLASLt's default bias type (the output's) says, with no
//! mixed-type bias asked for.
//!
//! A plan (descriptor, layouts, the algorithm cuBLASLt's heuristic picks) is made once per
//! shape, precision and operand alignment and kept; a shape the heuristic has no algorithm
//! for is remembered as such and its products keep the GEMM + bias pass. The alignments
//! told to the heuristic are the operands' own (views at any element offset reach here),
//! and a bias not on a 16-byte boundary keeps the two-pass path too.
//!
//! `ARES_CUBLASLT=0` turns the epilogue off (every biased product then takes the two
//! passes), for comparing the two on a GPU.

use crate::error::{Error, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUdeviceptr;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that turns the epilogue off (`0`, `off`, `false`).
pub const DISABLE_VAR: &str = "ARES_CUBLASLT";

/// Whether `ARES_CUBLASLT` asks for the epilogue to stay off.
fn disabled_by_env() -> bool {
    std::env::var(DISABLE_VAR).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "off" | "false"
        )
    })
}

fn lt_err(step: impl Into<String>) -> impl FnOnce(lt::CublasError) -> Error {
    let step = step.into();
    move |source| Error::BlasLt { step, source }
}

/// The largest power of two (≤ 256) dividing a device address: what cuBLASLt may assume
/// of an operand's alignment.
fn alignment(ptr: CUdeviceptr) -> u32 {
    match ptr {
        0 => 256,
        p => 1u32 << p.trailing_zeros().min(8),
    }
}

/// How a product multiplies, in cuBLASLt's terms: the operands' type (f32 or bf16) and
/// the compute type (f32, or f32 with TF32 tensor cores). `gemm.rs` maps its precisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LtTypes {
    pub operands: sys::cudaDataType_t,
    pub compute: sys::cublasComputeType_t,
}

impl LtTypes {
    /// f32 operands, true f32 products.
    pub const F32: Self = Self {
        operands: sys::cudaDataType_t::CUDA_R_32F,
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    /// f32 operands rounded to TF32 by the tensor cores.
    pub const TF32: Self = Self {
        operands: sys::cudaDataType_t::CUDA_R_32F,
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
    };
    /// bf16 operands, f32 sums.
    pub const BF16: Self = Self {
        operands: sys::cudaDataType_t::CUDA_R_16BF,
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
}

/// A biased product with f32 output, in cuBLAS's column-major terms (see `gemm.rs`):
/// `D[m, n] = op(A)[m, k] · B[k, n] + bias[m]` broadcast over the columns, every operand
/// packed. `transa`: `A` is stored `[k, m]` (a `[out, in]` weight) rather than `[m, k]`.
pub(crate) struct BiasGemm {
    pub transa: bool,
    pub m: c_int,
    pub n: c_int,
    pub k: c_int,
    pub types: LtTypes,
    pub a: CUdeviceptr,
    pub b: CUdeviceptr,
    pub d: CUdeviceptr,
    pub bias: CUdeviceptr,
}

/// What picks a plan: the shape, the precision and the operands' alignments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    transa: bool,
    m: c_int,
    n: c_int,
    k: c_int,
    types: LtTypes,
    /// Alignments of `A`, `B` and `D` (`C` is `D`).
    align: [u32; 3],
}

/// A descriptor, the layouts of `A`, `B` and `D`, and the algorithm for them.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: made by this plan's constructor and destroyed once, here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

struct State {
    handle: sys::cublasLtHandle_t,
    /// `None`: the heuristic has no algorithm for that key (the two-pass path runs).
    plans: HashMap<Key, Option<Plan>>,
}

// SAFETY: the handle and the plans' descriptors are plain host objects that cuBLASLt lets
// any thread use, one at a time; `Lt` keeps them behind a mutex.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `Lt::new`, destroyed once, after every plan made with it.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// A cuBLASLt handle with its plans; products queue on the stream they are given.
pub(crate) struct Lt {
    state: Mutex<State>,
    /// Products run with the epilogue (for tests and reports: the path is taken).
    calls: AtomicU64,
}

impl Lt {
    /// A handle, or `None` when libcublasLt cannot be loaded, `ARES_CUBLASLT=0` says so,
    /// or the handle cannot be made (the two-pass path then serves every product).
    pub(crate) fn new() -> Option<Self> {
        // SAFETY: only tries to dlopen the library.
        if disabled_by_env() || !unsafe { sys::is_culib_present() } {
            return None;
        }
        let handle = lt::create_handle().ok()?;
        Some(Self {
            state: Mutex::new(State {
                handle,
                plans: HashMap::new(),
            }),
            calls: AtomicU64::new(0),
        })
    }

    /// Products that ran with the epilogue so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Queues `g` on `stream` with `workspace` (device address and bytes); `false` when it
    /// did not (a bias off a 16-byte boundary, no algorithm for the shape, a plan
    /// or a call cuBLASLt refused — said once on stderr): the caller then runs the GEMM
    /// and the bias pass.
    ///
    /// # Safety
    /// Every address in `g` points at a live device buffer of the size `g`'s shape
    /// describes (packed), the workspace is live and only used on `stream`, and the
    /// context of `stream` is current on this thread.
    pub(crate) unsafe fn matmul_bias(
        &self,
        stream: &CudaStream,
        workspace: (CUdeviceptr, usize),
        g: &BiasGemm,
    ) -> bool {
        if !g.bias.is_multiple_of(16) || g.m <= 0 || g.n <= 0 || g.k <= 0 {
            return false;
        }
        let key = Key {
            transa: g.transa,
            m: g.m,
            n: g.n,
            k: g.k,
            types: g.types,
            align: [alignment(g.a), alignment(g.b), alignment(g.d)],
        };
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = state.handle;
        let plan = match state.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            // a plan cuBLASLt refuses to make is no plan: the two passes serve the shape
            std::collections::hash_map::Entry::Vacant(e) => e.insert(
                plan(handle, &key, workspace.1)
                    .inspect_err(|err| fell_back(&key, err))
                    .ok()
                    .flatten(),
            ),
        };
        let Some(plan) = plan.as_ref() else {
            return false;
        };
        let bias = g.bias as *const c_void;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [la, lb, ld] = plan.layouts;
        // SAFETY: the descriptor is live (the plan's) and the attribute a device pointer;
        // the caller's contract covers the addresses and the stream; the plan was made for
        // exactly these shapes, types and alignments; C is D with β = 0.
        let run = unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&raw const bias).cast(),
                size_of::<*const c_void>(),
            )
            .and_then(|()| {
                lt::matmul(
                    handle,
                    plan.desc,
                    (&raw const alpha).cast(),
                    (&raw const beta).cast(),
                    g.a as *const c_void,
                    la,
                    g.b as *const c_void,
                    lb,
                    g.d as *const c_void,
                    ld,
                    g.d as *mut c_void,
                    ld,
                    &plan.algo,
                    workspace.0 as *mut c_void,
                    workspace.1,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })
        };
        if let Err(source) = run {
            // refused before anything was queued (cuBLASLt checks its arguments first):
            // the shape keeps the two passes from now on
            let err = lt_err("cublasLtMatmul with the bias epilogue")(source);
            fell_back(&key, &err);
            state.plans.insert(key, None);
            return false;
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Says once per shape why its products keep the GEMM and the bias pass.
fn fell_back(key: &Key, err: &Error) {
    eprintln!(
        "cuBLASLt: the bias epilogue is not used for {:?} m={} n={} k={} ({err}); the bias \
         is added by a pass of its own",
        key.types, key.m, key.n, key.k
    );
}

/// The plan for `key`, or `None` when the heuristic has no algorithm for it.
fn plan(handle: sys::cublasLtHandle_t, key: &Key, workspace: usize) -> Result<Option<Plan>> {
    use sys::cudaDataType_t::CUDA_R_32F;
    let (in_type, compute) = (key.types.operands, key.types.compute);
    let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
    let desc =
        lt::create_matmul_desc(compute, CUDA_R_32F).map_err(lt_err("cublasLtMatmulDescCreate"))?;
    // From here on the plan owns what is made, so an early return frees it.
    let mut made = Plan {
        desc,
        layouts: [std::ptr::null_mut(); 3],
        algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
    };
    let (a_rows, a_cols) = if key.transa { (k, m) } else { (m, k) };
    let shapes = [
        (in_type, a_rows, a_cols),
        (in_type, k, n),
        (CUDA_R_32F, m, n),
    ];
    for (slot, (ty, rows, cols)) in made.layouts.iter_mut().zip(shapes) {
        *slot = lt::create_matrix_layout(ty, rows, cols, rows as i64)
            .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
    }
    // cublasOperation_t: 1 transposes, 0 does not
    let transa = i32::from(key.transa);
    let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
    use sys::cublasLtMatmulDescAttributes_t as D;
    // SAFETY: the descriptor is live; each value is the attribute's type.
    unsafe {
        lt::set_matmul_desc_attribute(
            made.desc,
            D::CUBLASLT_MATMUL_DESC_TRANSA,
            (&raw const transa).cast(),
            size_of_val(&transa),
        )
        .and_then(|()| {
            lt::set_matmul_desc_attribute(
                made.desc,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&raw const epilogue).cast(),
                size_of_val(&epilogue),
            )
        })
    }
    .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
    let pref = lt::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
    let ws = workspace as u64;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let [aa, ab, ad] = key.align;
    let prefs: [(P, &u32); 4] = [
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad),
    ];
    // SAFETY: the preference is live until destroyed below; each value is the attribute's
    // type (u64 bytes, u32 alignments).
    let found = unsafe {
        let set = lt::set_matmul_pref_attribute(
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&raw const ws).cast(),
            size_of::<u64>(),
        )
        .and_then(|()| {
            prefs.iter().try_for_each(|(attr, v)| {
                lt::set_matmul_pref_attribute(pref, *attr, (*v as *const u32).cast(), 4)
            })
        });
        let [la, lb, ld] = made.layouts;
        let found =
            set.map(|()| lt::get_matmul_algo_heuristic(handle, made.desc, la, lb, ld, ld, pref));
        let _ = lt::destroy_matmul_pref(pref);
        found.map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?
    };
    match found {
        Ok(h) if h.workspaceSize <= workspace => {
            made.algo = h.algo;
            Ok(Some(made))
        }
        // no algorithm (NOT_SUPPORTED) or one wanting more workspace: the two passes
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x7f00_0000_0100), 256);
        assert_eq!(alignment(0x1080), 128);
        assert_eq!(alignment(0x1004), 4);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1001), 1);
        // a view 45 f32 into a 256-aligned buffer
        assert_eq!(alignment(0x2000 + 45 * 4), 4);
    }
}
