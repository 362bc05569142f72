//! Transformer ops for the runner's model, forward and backward side by side (llm.c
//! style): plain functions over row-major f32 slices, with shapes passed explicitly and
//! checked, outputs and saved activations in caller-provided buffers, gradients
//! accumulated with `+=` where several uses of one tensor meet (residual stream, tied
//! embeddings), so a model can be written once against them.
//!
//! Conventions:
//! - Activations are `[tokens, features]` row-major (tokens = batch × sequence, flattened).
//! - Linear weights are `[out_features, in_features]` (the Hugging Face layout), so a
//!   linear layer computes `y = x · Wᵀ + b`.
//! - Every op validates lengths and returns [`crate::Result`]; none panics on bad input.
//! - Every backward is checked against central finite differences of its forward in the
//!   op's tests.

pub mod activation;
pub mod attention;
pub mod axpy;
pub mod embedding;
pub mod entropy_backward;
pub mod layer_norm;
pub mod linear_head;
pub mod log_prob_backward;
pub mod matmul;
pub(crate) mod matmul_amx;
pub mod matmul_tiles;
pub mod optim;
pub mod optim_int8;
pub mod precision;
pub mod rmsnorm;
pub mod rope;
pub mod scatter;
pub mod segment_attention;
pub(crate) mod stored;
pub mod swiglu;
