//! The CUDA C sources, embedded in the binary, and the kernels each one defines: one table
//! per source names each kernel once, and gives both the list NVRTC's checks walk
//! ([`KernelSource::kernels`]) and the struct of loaded functions the ops launch.

use crate::error::{DriverContext, Result};
use cudarc::driver::{CudaFunction, CudaModule};
use std::sync::Arc;

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

/// Kernel `name` of a loaded module.
pub(crate) fn load_function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction> {
    module
        .load_function(name)
        .during(format!("loading kernel {name}"))
}

/// `&[…]` of every kernel name of a table's entries, in order (a field names one kernel, a
/// per-class field an array of them).
macro_rules! kernel_names {
    ([$($acc:literal),*]) => { &[$($acc),*] };
    ([$($acc:literal),*] $k:literal $(, $($rest:tt)*)?) => {
        kernel_names!([$($acc,)* $k] $($($rest)*)?)
    };
    ([$($acc:literal),*] [$($ks:literal),+] $(, $($rest:tt)*)?) => {
        kernel_names!([$($acc,)* $($ks),+] $($($rest)*)?)
    };
}

/// A field's type: one function, or one per class.
macro_rules! kernel_field {
    ($k:literal) => { CudaFunction };
    ([$($ks:literal),+]) => { [CudaFunction; [$($ks),+].len()] };
}

/// A field loaded from module `$m`.
macro_rules! kernel_load {
    ($m:ident, $k:literal) => { load_function($m, $k)? };
    ($m:ident, [$($ks:literal),+]) => { [$(load_function($m, $ks)?),+] };
}

/// A kernel source (`const`) and the functions it defines (`struct` with `load`), from one
/// list of `field: "kernel"` (or `field: ["kernel per class", …]`) entries; a source
/// written `"file.cu" after "header.cuh"` is compiled with the header's text in front.
macro_rules! kernel_table {
    (
        $(#[$meta:meta])*
        pub const $source:ident = $file:literal $(after $prelude:literal)?;
        $(#[$smeta:meta])*
        pub(crate) struct $functions:ident {
            $($(#[$fmeta:meta])* $field:ident: $kernels:tt),* $(,)?
        }
    ) => {
        $(#[$meta])*
        pub const $source: KernelSource = KernelSource {
            name: $file,
            code: concat!(
                $(include_str!(concat!("../kernels/", $prelude)),)?
                include_str!(concat!("../kernels/", $file))
            ),
            kernels: kernel_names!([] $($kernels),*),
        };

        $(#[$smeta])*
        pub(crate) struct $functions {
            $($(#[$fmeta])* pub(crate) $field: kernel_field!($kernels),)*
        }

        impl $functions {
            #[doc = concat!("The kernels of the loaded module of `", $file, "`.")]
            pub(crate) fn load(m: &Arc<CudaModule>) -> Result<Self> {
                Ok(Self { $($field: kernel_load!(m, $kernels),)* })
            }
        }
    };
}

kernel_table! {
    /// Token kernels: fused log-prob + entropy, entropy windows / HWE, row percentile, masked
    /// dynamic KL, the actor's loss (policy loss, KL term, entropy bonus) and the advantage
    /// estimators.
    pub const TOKEN_KERNELS = "token_kernels.cu" after "online_softmax.cuh";
    /// The loaded kernels of `token_kernels.cu`.
    pub(crate) struct TokenFunctions {
        log_prob_entropy_f32: "log_prob_entropy_f32",
        log_prob_entropy_bf16: "log_prob_entropy_bf16",
        log_prob_entropy_f16: "log_prob_entropy_f16",
        entropy_windows: "entropy_windows",
        row_percentile: "row_percentile",
        masked_dynamic_kl: "masked_dynamic_kl",
        mask_row_counts: "mask_row_counts",
        policy_loss: "policy_loss",
        cov_select: "cov_select",
        group_scores: "group_scores",
        token_returns: "token_returns",
        masked_row_moments: "masked_row_moments",
        whiten_stats: "whiten_stats",
        whiten_apply: "whiten_apply",
        pro_max_normalize: "pro_max_normalize",
    }
}

kernel_table! {
    /// Model kernels: the decoder's element-wise, normalisation, RoPE, embedding, attention
    /// (forward, backward, decode) and KV-cache ops, the log-prob and entropy backward, and the
    /// optimizer's sum of squares and AdamW (what `ares-runner`'s CUDA backend launches besides
    /// cuBLAS).
    pub const MODEL_OPS = "model_ops.cu" after "online_softmax.cuh";
    /// The loaded kernels of `model_ops.cu`.
    pub(crate) struct ModelFunctions {
        fill: "fill_f32",
        add: "add_f32",
        scale: "scale_f32",
        axpy: "axpy_f32",
        to_bf16: "f32_to_bf16",
        to_bf16_stochastic: "f32_to_bf16_stochastic",
        accumulate_bf16_stochastic: "accumulate_bf16_stochastic",
        fill_bf16: "fill_bf16",
        from_bf16: "bf16_to_f32",
        bias_add: "bias_add",
        swiglu_fwd: "swiglu_fwd",
        swiglu_bwd: "swiglu_bwd",
        swiglu_fwd_bf16: "swiglu_fwd_bf16",
        swiglu_bwd_bf16: "swiglu_bwd_bf16",
        embedding_fwd: "embedding_fwd",
        embedding_fwd_bf16: "embedding_fwd_bf16",
        embedding_bwd: "embedding_bwd",
        rmsnorm_fwd: "rmsnorm_fwd",
        add_rmsnorm_fwd: "add_rmsnorm_fwd",
        add_rmsnorm_fwd_bf16: "add_rmsnorm_fwd_bf16",
        rmsnorm_bwd_dx: "rmsnorm_bwd_dx",
        col_partials: "col_partials",
        col_reduce: "col_reduce",
        rope: "rope",
        rope_fwd_bf16: "rope_fwd_bf16",
        transpose: "transpose_f32",
        log_prob_bwd: "log_prob_bwd",
        entropy_bwd: "entropy_bwd",
        log_prob_entropy_bwd_bf16: "log_prob_entropy_bwd_bf16",
        log_prob_entropy_bwd_f16: "log_prob_entropy_bwd_f16",
        argmax_rows: "argmax_rows",
        sample_race: "sample_race",
        race_draws: "race_draws",
        pick_rows: "pick_rows",
        sum_sq_multi_partial: "sum_sq_multi_partial",
        sum_sq_multi_final: "sum_sq_multi_final",
        adamw_check: "adamw_check",
        adamw_update: "adamw_update",
        adamw_update_bf16: "adamw_update_bf16",
        adamw_update_int8: "adamw_update_int8",
        kv_append: "kv_append",
        paged_kv_append: "paged_kv_append",
        paged_kv_append_bf16: "paged_kv_append_bf16",
        /// Per head-size class (≤ 64, ≤ 128, ≤ 256).
        attention_fwd: ["attention_fwd_d64", "attention_fwd_d128", "attention_fwd_d256"],
        /// The training forward over packed segments (`cu_seqlens`), per head-size class.
        packed_attention_fwd: [
            "packed_attention_fwd_d64",
            "packed_attention_fwd_d128",
            "packed_attention_fwd_d256"
        ],
        /// Paged decoding over bf16 pools, per head-size class.
        attention_fwd_kv16: [
            "attention_fwd_kv16_d64",
            "attention_fwd_kv16_d128",
            "attention_fwd_kv16_d256"
        ],
        /// The tensor-core bf16 forward, per head size of
        /// `ares_cpu::ops::attention::BF16_HEAD_DIMS` (64, 80, 128).
        attention_fwd_mma: [
            "attention_fwd_mma_d64",
            "attention_fwd_mma_d80",
            "attention_fwd_mma_d128"
        ],
        /// The same forward over a paged cache (a prefill chunk), per head size.
        paged_attention_fwd_mma: [
            "paged_attention_fwd_mma_d64",
            "paged_attention_fwd_mma_d80",
            "paged_attention_fwd_mma_d128"
        ],
        attention_split_combine: "attention_split_combine",
        attention_bwd_delta: "attention_bwd_delta",
        attention_bwd_delta_bf16: "attention_bwd_delta_bf16",
        /// The tensor-core bf16 backward, per head size (64, 80, 128).
        attention_bwd_dq_mma: [
            "attention_bwd_dq_mma_d64",
            "attention_bwd_dq_mma_d80",
            "attention_bwd_dq_mma_d128"
        ],
        attention_bwd_dkv_mma: [
            "attention_bwd_dkv_mma_d64",
            "attention_bwd_dkv_mma_d80",
            "attention_bwd_dkv_mma_d128"
        ],
        /// The same kernels over cu_seqlens segments (the vision tower), per head size.
        segment_fwd_mma: [
            "segment_attention_fwd_mma_d64",
            "segment_attention_fwd_mma_d80",
            "segment_attention_fwd_mma_d128"
        ],
        segment_bwd_dq_mma: [
            "segment_attention_bwd_dq_mma_d64",
            "segment_attention_bwd_dq_mma_d80",
            "segment_attention_bwd_dq_mma_d128"
        ],
        segment_bwd_dkv_mma: [
            "segment_attention_bwd_dkv_mma_d64",
            "segment_attention_bwd_dkv_mma_d80",
            "segment_attention_bwd_dkv_mma_d128"
        ],
        attention_bwd_dq: [
            "attention_bwd_dq_d64",
            "attention_bwd_dq_d128",
            "attention_bwd_dq_d256"
        ],
        attention_bwd_dkv: [
            "attention_bwd_dkv_d64",
            "attention_bwd_dkv_d128",
            "attention_bwd_dkv_d256"
        ],
        /// The f32 backward over packed segments, per head-size class.
        packed_attention_bwd_dq: [
            "packed_attention_bwd_dq_d64",
            "packed_attention_bwd_dq_d128",
            "packed_attention_bwd_dq_d256"
        ],
        packed_attention_bwd_dkv: [
            "packed_attention_bwd_dkv_d64",
            "packed_attention_bwd_dkv_d128",
            "packed_attention_bwd_dkv_d256"
        ],
    }
}

kernel_table! {
    /// Vision tower kernels (Qwen2-VL / Qwen2.5-VL): LayerNorm, the GELU-family activations,
    /// attention within `cu_seqlens` segments, and the row scatter of image embeddings.
    pub const VISION_OPS = "vision_ops.cu";
    /// The loaded kernels of `vision_ops.cu`.
    pub(crate) struct VisionFunctions {
        layer_norm_fwd: "layer_norm_fwd",
        layer_norm_bwd_dx: "layer_norm_bwd_dx",
        layer_norm_col_partials: "layer_norm_col_partials",
        activation_fwd: "activation_fwd",
        activation_bwd: "activation_bwd",
        scatter_rows: "scatter_rows",
        /// Per head-size class (≤ 64, ≤ 128).
        segment_fwd: ["segment_attention_fwd_d64", "segment_attention_fwd_d128"],
        segment_bwd_dq: ["segment_attention_bwd_dq_d64", "segment_attention_bwd_dq_d128"],
        segment_bwd_dkv: ["segment_attention_bwd_dkv_d64", "segment_attention_bwd_dkv_d128"],
    }
}

/// Every kernel source of the crate (what CI compiles with NVRTC).
pub const ALL: &[KernelSource] = &[TOKEN_KERNELS, MODEL_OPS, VISION_OPS];
