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

/// Model kernels: the decoder's element-wise, normalisation, RoPE, embedding, attention
/// (forward, backward, decode) and KV-cache ops, the log-prob and entropy backward, and the optimizer's
/// sum of squares and AdamW (what `ares-runner`'s CUDA backend launches besides cuBLAS).
pub const MODEL_OPS: KernelSource = KernelSource {
    name: "model_ops.cu",
    code: include_str!("../kernels/model_ops.cu"),
    kernels: &[
        "fill_f32",
        "add_f32",
        "scale_f32",
        "f32_to_bf16",
        "bias_add",
        "swiglu_fwd",
        "swiglu_bwd",
        "embedding_fwd",
        "embedding_bwd",
        "rmsnorm_fwd",
        "rmsnorm_bwd_dx",
        "col_partials",
        "col_reduce",
        "rope",
        "transpose_f32",
        "log_prob_bwd",
        "entropy_bwd",
        "argmax_rows",
        "sample_rows",
        "sum_sq_partial",
        "sum_sq_final",
        "adamw_check",
        "adamw_update",
        "kv_append",
        "attention_fwd_d64",
        "attention_fwd_d128",
        "attention_fwd_d256",
        "attention_bwd_delta",
        "attention_bwd_dq_d64",
        "attention_bwd_dq_d128",
        "attention_bwd_dq_d256",
        "attention_bwd_dkv_d64",
        "attention_bwd_dkv_d128",
        "attention_bwd_dkv_d256",
    ],
};

/// Vision tower kernels (Qwen2-VL / Qwen2.5-VL): LayerNorm, the GELU-family activations,
/// attention within `cu_seqlens` segments, and the row scatter of image embeddings.
pub const VISION_OPS: KernelSource = KernelSource {
    name: "vision_ops.cu",
    code: include_str!("../kernels/vision_ops.cu"),
    kernels: &[
        "layer_norm_fwd",
        "layer_norm_bwd_dx",
        "layer_norm_col_partials",
        "activation_fwd",
        "activation_bwd",
        "scatter_rows",
        "segment_attention_fwd_d64",
        "segment_attention_fwd_d128",
        "segment_attention_bwd_dq_d64",
        "segment_attention_bwd_dq_d128",
        "segment_attention_bwd_dkv_d64",
        "segment_attention_bwd_dkv_d128",
    ],
};

/// Every kernel source of the crate (what CI compiles with NVRTC).
pub const ALL: &[KernelSource] = &[TOKEN_KERNELS, MODEL_OPS, VISION_OPS];
