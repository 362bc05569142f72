//! The CUDA C sources, embedded in the binary, and the kernels each one defines.

/// One kernel source file.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name (used in errors and cache keys).
    pub name: &'static str,
    /// CUDA C text.
    pub code: &'static str,
    /// `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Token kernels: fused log-prob + entropy, entropy windows / HWE, row percentile, masked
/// dynamic KL.
pub const TOKEN_KERNELS: KernelSource = KernelSource {
    name: "token_kernels.cu",
    code: include_str!("../kernels/token_kernels.cu"),
    kernels: &[
        "log_prob_entropy_f32",
        "log_prob_entropy_bf16",
        "log_prob_entropy_f16",
        "entropy_windows",
        "row_percentile",
        "masked_dynamic_kl",
    ],
};

/// Every kernel source of the crate (what CI compiles with NVRTC).
pub const ALL: &[KernelSource] = &[TOKEN_KERNELS];
