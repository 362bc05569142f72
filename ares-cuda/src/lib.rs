//! # ares-cuda
//!
//! The CUDA backend of ares: CUDA C kernels compiled by NVRTC at run time and loaded with
//! the CUDA libraries found at run time, so building needs no CUDA toolkit.
//!
//! **Not built yet.** This crate holds no API so far (see the README's status table).
