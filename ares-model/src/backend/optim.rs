//! Argument group of [`Backend::adamw_step`](super::Backend::adamw_step): one step's AdamW
//! hyper-parameters, learning rate, step number and gradient-clipping factor.

pub use ares_cpu::ops::optim::AdamWConfig;

/// What one AdamW update of a parameter tensor needs besides the tensors: PyTorch's
/// `torch.optim.AdamW` semantics (decoupled decay `θ ← θ·(1 − lr·wd)` first, then the
/// bias-corrected Adam step; see `ares_cpu::ops::optim::adamw_step`), with the gradient
/// multiplied by `grad_scale` first (the global-norm clipping factor; 1 = none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWUpdate {
    /// β1, β2, ε and the weight decay.
    pub config: AdamWConfig,
    /// This step's learning rate, finite and `>= 0`.
    pub lr: f64,
    /// The update number, 1 for the first (bias corrections `1 − βᵗ`).
    pub step: u64,
    /// Factor on the gradient, finite and `>= 0` (`min(1, max_norm / (norm + 1e-6))`).
    pub grad_scale: f32,
}
