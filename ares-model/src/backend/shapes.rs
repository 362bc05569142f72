//! Argument shapes and argument groups of the backend ops, spelled out so a call site
//! reads like its math.

use super::{View, ViewMut};
pub use ares_cpu::ops::precision::MatmulPrecision;

/// A linear layer `out[rows, out_features] = x[rows, in_features] · w[out_features,
/// in_features]ᵀ (+ bias[out_features])`; `w` in the Hugging Face `[out, in]` layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDims {
    /// Rows of `x` and `out` (tokens).
    pub rows: usize,
    /// Columns of `x`, columns of `w`.
    pub in_features: usize,
    /// Columns of `out`, rows of `w` and length of the bias.
    pub out_features: usize,
    /// How the products treat their operands (the layer's forward and both backward
    /// products alike); the backend applies [`MatmulPrecision::for_rows`] with `rows`.
    pub precision: MatmulPrecision,
}

/// How a backward op writes an input gradient: added to what the buffer holds (a gradient
/// that several products sum into), or in its place (the first product into a scratch
/// buffer — the zero fill before it is then not needed; on a GPU `β = 0` in the GEMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `d += …`.
    Accumulate,
    /// `d = …`: the buffer's old contents are not read (they may be anything, NaN included).
    Overwrite,
}

/// How a linear backward writes its input and weight gradients, each as its [`GradWrite`]
/// says (the bias gradient always adds): a weight gradient written over is a layer's
/// scratch that one product fills (gradients stored in bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradWrites {
    /// The input gradient `dx`.
    pub dx: GradWrite,
    /// The weight gradient `dw`.
    pub dw: GradWrite,
}

impl GradWrites {
    /// Both added into.
    pub const ACCUMULATE: Self = Self {
        dx: GradWrite::Accumulate,
        dw: GradWrite::Accumulate,
    };

    /// `dx` written as given, `dw` added into.
    pub const fn dx(dx: GradWrite) -> Self {
        Self {
            dx,
            dw: GradWrite::Accumulate,
        }
    }
}

/// A causal grouped-query attention call: `batch` sequences of `seq` tokens, q `[batch,
/// seq, q_heads, head_dim]`, k and v `[batch, seq, kv_heads, head_dim]`, key mask `[batch,
/// seq]`, logits `scale · q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence (padded length).
    pub seq: usize,
    /// Query heads, a multiple of `kv_heads`.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Multiplier of the dot products.
    pub scale: f32,
}

impl AttentionDims {
    /// Dims with the standard scale `1/√head_dim` (rounded once from f64, as transformers'
    /// `head_dim ** -0.5`).
    pub fn new(batch: usize, seq: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            batch,
            seq,
            q_heads,
            kv_heads,
            head_dim,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
        }
    }
}

/// The inputs of [`Backend::attention`](super::Backend::attention), views of buffers `T`.
#[derive(Debug)]
pub struct AttentionInputs<'a, T: ?Sized> {
    /// Queries `[batch, seq, q_heads, head_dim]`, after RoPE.
    pub q: View<'a, T>,
    /// Keys `[batch, seq, kv_heads, head_dim]`, after RoPE.
    pub k: View<'a, T>,
    /// Values `[batch, seq, kv_heads, head_dim]`.
    pub v: View<'a, T>,
    /// 0/1 key validity `[batch, seq]` (the `attention_mask`); `None`: every key valid.
    pub key_mask: Option<View<'a, T>>,
}

/// The gradients [`Backend::attention_backward`](super::Backend::attention_backward)
/// writes, views of buffers `T` (overwritten).
#[derive(Debug)]
pub struct AttentionGrads<'a, T: ?Sized> {
    /// `∂L/∂q` `[batch, seq, q_heads, head_dim]`.
    pub dq: ViewMut<'a, T>,
    /// `∂L/∂k` `[batch, seq, kv_heads, head_dim]`, summed over each kv head's query heads.
    pub dk: ViewMut<'a, T>,
    /// `∂L/∂v` `[batch, seq, kv_heads, head_dim]`, summed over each kv head's query heads.
    pub dv: ViewMut<'a, T>,
}

/// GELU family activations of the vision tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// torch.nn.GELU() exact: `0.5·x·(1 + erf(x/√2))` (Qwen2-VL/2.5-VL patch merger).
    GeluErf,
    /// QuickGELU: `x·sigmoid(1.702·x)` (Qwen2-VL vision MLP, `hidden_act: "quick_gelu"`).
    QuickGelu,
    /// tanh approximation `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`hidden_act:
    /// "gelu_pytorch_tanh"`).
    GeluTanh,
}

/// A [`Backend::segment_attention`](super::Backend::segment_attention) call: `tokens`
/// tokens split into `segments` segments by `cu_seqlens`, q, k, v and out `[tokens, heads,
/// head_dim]`, logits `scale · q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SegmentAttentionDims {
    /// Tokens over all segments.
    pub tokens: usize,
    /// Segments (`cu_seqlens` holds `segments + 1` offsets).
    pub segments: usize,
    /// Heads (q, k and v alike).
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Multiplier of the dot products.
    pub scale: f32,
}

impl SegmentAttentionDims {
    /// Dims with the standard scale `1/√head_dim` (rounded once from f64, as transformers'
    /// `head_dim ** -0.5`).
    pub fn new(tokens: usize, segments: usize, heads: usize, head_dim: usize) -> Self {
        Self {
            tokens,
            segments,
            heads,
            head_dim,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
        }
    }
}
