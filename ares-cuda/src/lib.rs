//! # ares-cuda
//!
//! CUDA token kernels of ares. Kernel sources are CUDA C compiled at run time by NVRTC
//! (CUBIN for the device's architecture, PTX as fallback, cached on disk), and every CUDA
//! library is loaded at run time (cudarc's dynamic loading), so building this crate needs
//! no CUDA toolkit and a machine without CUDA gets an error, not a crash.
//!
//! Each kernel has a CPU twin with the same semantics (`ares-cpu`, `ares-core`) and is
//! tested against it on a GPU (`tests/gpu.rs`); without a GPU, CI still compiles every
//! kernel source with NVRTC (`tests/nvrtc.rs`).

mod error;
pub mod kernels;
pub mod nvrtc;

pub use error::{Error, Result};
mod device;
mod ops;

pub use device::{Cuda, DeviceInfo, cuda_available};
pub use ops::{HweOutputs, LogitElem, MaskedKlInputs, MaskedKlOutputs, WindowSpec};
