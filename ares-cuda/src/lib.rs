//! # ares-cuda
//!
//! CUDA kernels of ares: the token kernels of the RL losses ([`Cuda`]) and the model's
//! forward/backward/optimizer ops with cuBLAS GEMMs ([`ModelOps`], what `ares-runner`'s
//! CUDA backend runs on). Kernel sources are CUDA C compiled at run time by NVRTC
//! (CUBIN for the device's architecture, PTX as fallback, cached on disk), and every CUDA
//! library is loaded at run time (cudarc's dynamic loading), so building this crate needs
//! no CUDA toolkit and a machine without CUDA gets an error, not a crash.
//!
//! Each kernel has a CPU twin with the same semantics (`ares-cpu`, `ares-core`) and is
//! tested against it on a GPU (`tests/gpu.rs`); without a GPU, CI still compiles every
//! kernel source with NVRTC (`tests/nvrtc.rs`).

mod advantage_ops;
mod error;
pub mod kernels;
pub mod nccl;
pub mod nvrtc;

pub use error::{Error, Result};
mod device;
pub mod external;
pub mod gemm;
mod gemm_lt;
mod launch;
mod loss_ops;
pub mod mma;
pub mod model_ops;
mod staging;
mod token_ops;

pub use advantage_ops::{DeviceTokens, SampleEstimator, TokenEstimator};
/// The cudarc this crate is built on (its slices and views are the ops' arguments).
pub use cudarc;
pub use device::{Cuda, DeviceInfo, cuda_available, device_count};
pub use gemm::{GemmDims, GemmPrecision, Operand, cublas_available};
pub use loss_ops::{
    CovScalars, KlLossSpec, LOSS_REPORT, LOSS_STATS, LossInputs, LossKind, LossOutputs, LossReport,
    LossScalars, LossSpec,
};
pub use model_ops::{
    AdamWScalars, AdamWStep, AttentionShape, DecodeGraph, HeadDims, ModelOps,
    sum_of_squares_partition,
};
pub use token_ops::{HweOutputs, LogitElem, MaskedKlInputs, MaskedKlOutputs, TokenOps, WindowSpec};
