//! `ares` for Python: ares-core over numpy arrays (pyo3 + the `numpy` crate, abi3 wheel).
//!
//! Conventions of every function:
//! - float inputs are numpy arrays of `float32` or `float64`; every float array of a call has
//!   the dtype of the first one, and the outputs have it too (no silent conversion);
//! - inputs must be C-contiguous: they are read in place, never copied (a strided view is an
//!   error rather than a hidden copy); outputs are allocated once, by numpy, and filled by
//!   ares-core with the GIL released;
//! - groups are `n=` (consecutive groups of n rows) or `uid=` (one key per row, integers or
//!   any hashable values such as verl's string `index`; groups may differ in size);
//! - bad input raises `ValueError` carrying ares-core's message, which names the argument.

mod args;
mod controllers;
mod cuda;
mod curriculum;
mod extras;
mod funcs;
mod kernels;
mod loss;

use pyo3::prelude::*;

/// The native module `ares._ares`; the `ares` package re-exports it.
#[pymodule]
fn _ares(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GRPO_EPSILON", ares_core::advantage::GRPO_EPSILON)?;
    funcs::register(m)?;
    loss::register(m)?;
    controllers::register(m)?;
    extras::register(m)?;
    curriculum::register(m)?;
    cuda::register(m)?;
    kernels::register(m)
}
