//! # ares-cpu
//!
//! CPU token kernels of ares, the reference every CUDA kernel of `ares-cuda` is tested
//! against, and fast in their own right (rayon over rows, SIMD-friendly inner loops with
//! run-time dispatch to AVX2/AVX-512 on x86-64).
//!
//! The instruction-set path is picked at run time and can be forced with `ARES_CPU_ISA`
//! ([`isa`]).
//!
//! - [`log_prob_entropy`]: per row of logits `[rows, V]` (f32, bf16 or f16), the log-prob of
//!   a target token and the exact entropy of `softmax(z / temperature)`, from one read of
//!   the logits with an online max/sum — no `[rows, V]` temporary.
//!
//! - [`argmax`]: greedy decoding's pick, the first index of a row's largest logit.
//! - [`sampler`]: sampling's pick — the exponential race over counter-based random numbers
//!   with temperature, top-k, top-p and min-p, bit for bit the CUDA kernel's.
//! - [`entropy_windows`], [`row_percentile`]: window means, HWE masks, per-row counts, soft
//!   costs and percentile thresholds (docs/algorithms.md §1), row-parallel over `ares_core::entropy`.
//! - [`masked_dynamic_kl`]: per-token KL, HWE-aware weights, per-row and total weighted
//!   sums in one pass (docs/algorithms.md §4), row-parallel over `ares_core::kl::token_kl`.

mod argmax;
mod error;
mod exp;
pub mod isa;
mod kl;
mod log_prob_entropy;
mod logits;
pub mod ops;
pub mod sampler;
#[cfg(test)]
mod test_rng;
mod windows;

pub use argmax::argmax;
pub use error::{Error, Result};
pub use isa::Isa;
pub use kl::{MaskedKlInputs, MaskedKlOutputs, masked_dynamic_kl};
pub use log_prob_entropy::{LogProbEntropy, log_prob_entropy};
pub use logits::{Logit, LogitKind, Logits};
pub use windows::{HweOutputs, WindowSpec, entropy_windows, row_percentile};
