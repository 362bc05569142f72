//! The `Backend` trait: tensor storage plus the ops the model is written against, with one
//! implementation per compute crate ([`cpu::CpuBackend`] over `ares-cpu`; `cuda::CudaBackend`
//! over `ares-cuda`, with the default `cuda` feature).
//!
//! # Design
//! - **Opaque, device-resident buffers.** [`Backend::Buffer`] (f32) and [`Backend::Ids`]
//!   (u32 token ids and positions) are associated types the model never looks inside: on a
//!   GPU they are device allocations, on the CPU plain vectors. The host reaches their
//!   contents only through [`Backend::upload`] / [`Backend::upload_ids`] (weights at load
//!   time, a batch's inputs) and [`Backend::download`] (results). Every op reads and writes
//!   buffers in place, so a forward pass has no host round trip between its ops.
//! - **Views, so one allocation holds many tensors.** Ops take [`View`] / [`ViewMut`]
//!   windows `[offset, offset + len)` of a buffer, checked against the buffer when made.
//!   The model keeps, llm.c style, one buffer per kind of tensor stacked over layers
//!   (`q_proj` weights `[layers, q_dim, hidden]`, activations `[layers, tokens, ...]`) and
//!   hands out per-layer views. An op's inputs and outputs are distinct borrows, so an
//!   output never aliases an input (Rust's borrow rules enforce what kernels assume).
//! - **Who owns memory.** The caller: buffers are allocated with [`Backend::alloc`] /
//!   [`Backend::alloc_ids`], owned by whoever holds them (the model's weights, an
//!   activation arena planned up front for a batch shape) and freed on drop. Ops never
//!   allocate their outputs; the CPU attention kernel keeps an O(seq) scratch row per thread.
//! - **Synchronisation.** Ops may be asynchronous (queued on a stream): the only calls that
//!   may wait for the device are [`Backend::download`] (returns once the data is on the
//!   host) and [`Backend::synchronize`]. Uploads copy from the host slice before they
//!   return. Errors an op reports are argument errors found before launch (shapes, lengths);
//!   a CPU backend reports value errors (an id out of range) too, a GPU one may not.
//! - **Shapes are explicit.** Every op takes its dimensions ([`LinearDims`],
//!   [`AttentionDims`], `dim`, `heads`) rather than inferring them from lengths, and checks
//!   the lengths of its views against them.
//! - **Backward ops** (`linear_backward`, `rmsnorm_backward`, ...) follow the same
//!   conventions; the forward ops save what they need (`rstd` of RMSNorm, `lse` of
//!   attention) in caller-provided views. Each says whether it accumulates into its
//!   gradient outputs (`+=`; zero them with [`Backend::fill`]) or overwrites them.
//! - **Training.** [`Backend::log_prob_backward`] starts the backward pass from ∂L/∂logπ
//!   per token, and [`Backend::entropy_backward`] adds an entropy bonus's ∂L/∂H per token; [`Backend::sum_of_squares`] and [`Backend::adamw_step`] are the optimizer's
//!   ops, so parameters, gradients and moments never leave the device.
//! - **ARES token ops.** [`Backend::entropy_windows`], [`Backend::row_percentile`] and
//!   [`Backend::masked_dynamic_kl`] find a step's high-window-entropy tokens and its
//!   dynamic KL on the device, so only per-row sums cross to the host.
//! - **Generation.** [`Backend::kv_cache_append`] and [`Backend::attention_decode`] keep
//!   a KV cache in device buffers ([`KvCacheView`] for the layout) and attend new tokens
//!   over it, so a decode step has no host round trip either.
//! - **Vision tower** (Qwen2-VL / Qwen2.5-VL): [`Backend::layer_norm`],
//!   [`Backend::activation`] (the GELU family), [`Backend::segment_attention`] (non-causal
//!   attention within `cu_seqlens` segments) with their backward ops, and
//!   [`Backend::scatter_rows`], which places image embeddings among a sequence's token
//!   embeddings.

mod decode;
mod error;
mod optim;
mod shapes;
mod token;
mod view;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod sampling;

pub use decode::{BlockTables, KvCacheView, KvCacheViewMut, PagedKvView, PagedKvViewMut};
pub use error::BackendError;
pub use optim::{AdamWConfig, AdamWUpdate};
pub use shapes::{
    Activation, AttentionDims, AttentionGrads, AttentionInputs, LinearDims, MatmulPrecision,
    SegmentAttentionDims,
};
pub use token::{HweViews, KlSumViews, KlViews, WindowSpec};
pub use view::{DeviceBuffer, View, ViewMut};

/// Results of backend calls.
pub type Result<T> = std::result::Result<T, BackendError>;

/// A read-only f32 view of backend `B`.
pub type Tensor<'a, B> = View<'a, <B as Backend>::Buffer>;
/// A writable f32 view of backend `B`.
pub type TensorMut<'a, B> = ViewMut<'a, <B as Backend>::Buffer>;

/// Tensor storage and the forward ops of a Qwen2/Qwen3/Llama decoder (see the module docs
/// for ownership and synchronisation). All tensors are row-major f32.
pub trait Backend {
    /// An f32 allocation.
    type Buffer: DeviceBuffer;
    /// A u32 allocation (token ids, positions).
    type Ids: DeviceBuffer;

    /// A human-readable name of the device (`"cpu"`).
    fn name(&self) -> &str;

    /// `(free, total)` bytes of the device's own memory where the backend has one (a GPU);
    /// `None` for the host (see `available_host_memory` in ares-runner).
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }

    /// A new buffer of `len` f32 elements, zeroed.
    ///
    /// # Errors
    /// The device is out of memory (CPU: never; allocation failure aborts).
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;

    /// A new buffer of `len` u32 elements, zeroed.
    ///
    /// # Errors
    /// As [`Backend::alloc`].
    fn alloc_ids(&self, len: usize) -> Result<Self::Ids>;

    /// Copies `src` into `dst`; returns once `src` may be reused.
    ///
    /// # Errors
    /// `src.len() != dst.len()`.
    fn upload(&self, src: &[f32], dst: TensorMut<'_, Self>) -> Result<()>;

    /// Copies `src` into the whole of `dst`; returns once `src` may be reused.
    ///
    /// # Errors
    /// `src.len() != dst.len()`.
    fn upload_ids(&self, src: &[u32], dst: &mut Self::Ids) -> Result<()>;

    /// Copies `src` to the host, after every op queued before it has finished.
    ///
    /// # Errors
    /// `src.len() != dst.len()`, or a failure of a queued op reported now.
    fn download(&self, src: Tensor<'_, Self>, dst: &mut [f32]) -> Result<()>;

    /// Waits for every queued op (a no-op on the CPU).
    ///
    /// # Errors
    /// A failure of a queued op reported now.
    fn synchronize(&self) -> Result<()>;

    /// Row gather: `out[t, :] = table[ids[t], :]`, with `table` `[rows, dim]` and `out`
    /// `[ids.len(), dim]`. Token embedding, and the per-token RoPE cos/sin from a table
    /// indexed by position.
    ///
    /// # Errors
    /// Lengths that do not match, or (where checked) an id `>= rows`.
    fn embedding(
        &self,
        ids: &Self::Ids,
        table: Tensor<'_, Self>,
        rows: usize,
        dim: usize,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Linear layer `out = x · wᵀ (+ bias)`, shapes in [`LinearDims`]. `out` is
    /// overwritten. The LM head is this op with the head (or tied embedding) as `w`.
    ///
    /// # Errors
    /// Lengths that do not match `dims`.
    fn linear(
        &self,
        x: Tensor<'_, Self>,
        w: Tensor<'_, Self>,
        bias: Option<Tensor<'_, Self>>,
        dims: LinearDims,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Linear layer with the weight stored transposed: `out = x · wt (+ bias)`, `wt`
    /// `[in_features, out_features]` (a [`Backend::transpose`]d copy of a Hugging Face
    /// `[out, in]` weight). The same layer as [`Backend::linear`] up to summation order;
    /// generation keeps such copies because a CPU GEMM multiplies a few rows by this layout
    /// without first repacking the whole weight. `out` is overwritten.
    ///
    /// # Errors
    /// Lengths that do not match `dims`.
    fn linear_transposed(
        &self,
        x: Tensor<'_, Self>,
        wt: Tensor<'_, Self>,
        bias: Option<Tensor<'_, Self>>,
        dims: LinearDims,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// `dst[cols, rows] = src[rows, cols]ᵀ` (row-major both).
    ///
    /// # Errors
    /// `src` or `dst` not `rows · cols` long.
    fn transpose(
        &self,
        src: Tensor<'_, Self>,
        rows: usize,
        cols: usize,
        dst: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// RMSNorm over rows of `dim`: `out = weight · x / sqrt(mean(x²) + eps)`; `x`, `out`
    /// `[rows, dim]`, `weight` `[dim]`, and `rstd` `[rows]` receives `1/sqrt(mean(x²) + eps)`
    /// for the backward pass.
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match, `eps` not finite and > 0.
    fn rmsnorm(
        &self,
        x: Tensor<'_, Self>,
        weight: Tensor<'_, Self>,
        eps: f32,
        dim: usize,
        out: TensorMut<'_, Self>,
        rstd: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Rotary position embedding in place ("rotate_half" layout of Hugging Face) on `x`
    /// `[tokens, heads, head_dim]`, with per-token `cos`, `sin` `[tokens, head_dim/2]`.
    ///
    /// # Errors
    /// `head_dim` odd or 0, `heads == 0`, lengths that do not match.
    fn rope(
        &self,
        x: TensorMut<'_, Self>,
        cos: Tensor<'_, Self>,
        sin: Tensor<'_, Self>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()>;

    /// Causal grouped-query attention (shapes in [`AttentionDims`]): query `t` of sequence
    /// `b` attends to keys `s <= t` with `key_mask[b, s] = 1` (`None`: all keys valid). Writes
    /// `out` `[batch, seq, q_heads, head_dim]` and the softmax log-sum-exp `lse` `[batch,
    /// seq, q_heads]` for the backward pass. A query without a valid key gets `out = 0`.
    ///
    /// # Errors
    /// Invalid head counts or scale, lengths that do not match, a mask value not 0 or 1.
    fn attention(
        &self,
        dims: AttentionDims,
        inputs: AttentionInputs<'_, Self::Buffer>,
        out: TensorMut<'_, Self>,
        lse: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// SwiGLU, element-wise: `out = silu(gate) · up`.
    ///
    /// # Errors
    /// Lengths that differ.
    fn swiglu(
        &self,
        gate: Tensor<'_, Self>,
        up: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Residual add, element-wise: `out = a + b`.
    ///
    /// # Errors
    /// Lengths that differ.
    fn add(&self, a: Tensor<'_, Self>, b: Tensor<'_, Self>, out: TensorMut<'_, Self>)
    -> Result<()>;

    // ----- Backward ops (llm.c style). Gradient outputs either **accumulate** (`+=`, so
    // shared weights and residual branches add up; zero them first with
    // [`Backend::fill`]) or are **overwritten**, as each op says. -----

    /// Sets every element of `dst` to `value` (`0.0` zeroes a gradient before an
    /// accumulating op).
    ///
    /// # Errors
    /// None on the CPU; a device failure where the backend reports one.
    fn fill(&self, dst: TensorMut<'_, Self>, value: f32) -> Result<()>;
    /// `dst = src` (views of equal length, possibly of one buffer but never overlapping,
    /// which the borrow rules already forbid). On a GPU a device-to-device copy.
    ///
    /// # Errors
    /// Lengths that differ.
    fn copy(&self, src: Tensor<'_, Self>, dst: TensorMut<'_, Self>) -> Result<()>;

    /// Backward of [`Backend::embedding`]: `dtable[ids[t], :] += dout[t, :]`, with `dout`
    /// `[ids.len(), dim]` and `dtable` `[rows, dim]`. **Accumulates** (tied embeddings add
    /// the LM head's gradient into the same table).
    ///
    /// # Errors
    /// Lengths that do not match, or (where checked) an id `>= rows`.
    fn embedding_backward(
        &self,
        ids: &Self::Ids,
        dout: Tensor<'_, Self>,
        rows: usize,
        dim: usize,
        dtable: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of [`Backend::linear`] given `dout` `[rows, out_features]`. All three
    /// gradients **accumulate**: `dx[rows, in] += dout · w` (skipped if `None`),
    /// `dw[out, in] += doutᵀ · x`, `dbias[out] += Σ_rows dout` (skipped if `None`).
    ///
    /// # Errors
    /// Lengths that do not match `dims`.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        dout: Tensor<'_, Self>,
        x: Tensor<'_, Self>,
        w: Tensor<'_, Self>,
        dims: LinearDims,
        dx: Option<TensorMut<'_, Self>>,
        dw: TensorMut<'_, Self>,
        dbias: Option<TensorMut<'_, Self>>,
    ) -> Result<()>;

    /// Backward of [`Backend::rmsnorm`] from `dout` `[rows, dim]`, the forward's input `x`,
    /// `weight` and saved `rstd`. Both `dx` `[rows, dim]` and `dweight` `[dim]`
    /// **accumulate** (`dx` is the residual stream's gradient; a q/k norm weight is shared
    /// by every head).
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dout: Tensor<'_, Self>,
        x: Tensor<'_, Self>,
        weight: Tensor<'_, Self>,
        rstd: Tensor<'_, Self>,
        dim: usize,
        dx: TensorMut<'_, Self>,
        dweight: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of [`Backend::rope`], **in place**: `dx` `[tokens, heads, head_dim]` holds
    /// the gradient w.r.t. the rotated tensor and is replaced by the gradient w.r.t. its
    /// input (the inverse rotation).
    ///
    /// # Errors
    /// As [`Backend::rope`].
    fn rope_backward(
        &self,
        dx: TensorMut<'_, Self>,
        cos: Tensor<'_, Self>,
        sin: Tensor<'_, Self>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()>;

    /// Backward of [`Backend::attention`] from `dout` `[batch, seq, q_heads, head_dim]`,
    /// the forward's `inputs`, `out` and `lse`. **Overwrites** `grads` (q, k and v feed
    /// attention only); queries without a valid key and masked keys get zero gradients.
    ///
    /// # Errors
    /// As [`Backend::attention`], and lengths of `out`, `lse`, `dout` and `grads`.
    fn attention_backward(
        &self,
        dims: AttentionDims,
        inputs: AttentionInputs<'_, Self::Buffer>,
        out: Tensor<'_, Self>,
        lse: Tensor<'_, Self>,
        dout: Tensor<'_, Self>,
        grads: AttentionGrads<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Backward of [`Backend::swiglu`] from `dout`: **overwrites** `dgate` and `dup`
    /// (gate and up feed the SwiGLU only).
    ///
    /// # Errors
    /// Lengths that differ.
    fn swiglu_backward(
        &self,
        dout: Tensor<'_, Self>,
        gate: Tensor<'_, Self>,
        up: Tensor<'_, Self>,
        dgate: TensorMut<'_, Self>,
        dup: TensorMut<'_, Self>,
    ) -> Result<()>;

    // ----- End of backward ops. -----

    /// Per row of `logits` `[rows, vocab]`, with `z = logits / temperature`: writes the
    /// entropy of `softmax(z)` to `entropy[row]` and `log softmax(z)[targets[row]]` to
    /// `log_prob[row]`, without a `[rows, vocab]` temporary (rows = `targets.len()`).
    ///
    /// # Errors
    /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, and
    /// (where checked) a target `>= vocab` or a row holding NaN/+∞.
    fn log_prob_entropy(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        temperature: f32,
        targets: &Self::Ids,
        log_prob: TensorMut<'_, Self>,
        entropy: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of the per-token log-prob of [`Backend::log_prob_entropy`]: per row of
    /// `logits` `[rows, vocab]` (rows = `targets.len()`), with `z = logits / temperature`
    /// and `g = coeffs[row]` (∂L/∂logπ of that token),
    /// `dlogits[row, :] = g/temperature · (onehot(targets[row]) − softmax(z))`, without a
    /// `[rows, vocab]` temporary. **Overwrites** `dlogits`; rows with `g = 0` are zero and
    /// their logits are not read.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, a
    /// non-finite coefficient, and (where checked) for rows with `g ≠ 0` a target `>= vocab`
    /// or a row holding NaN/+∞.
    fn log_prob_backward(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        temperature: f32,
        targets: &Self::Ids,
        coeffs: Tensor<'_, Self>,
        dlogits: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of the per-token entropy of [`Backend::log_prob_entropy`]: per row of
    /// `logits` `[rows, vocab]` (rows = `coeffs.len()`), with `z = logits / temperature`,
    /// `p = softmax(z)`, `H = −Σ p ln p` and `c = coeffs[row]` (∂L/∂H of that token),
    /// `dlogits[row, :] += c · ∂H/∂logits = −c · p · (ln p + H) / temperature`, without a
    /// `[rows, vocab]` temporary (`ares_core::entropy_bonus::entropy_grad_logits` is the
    /// formula). **Accumulates** into `dlogits` (it runs after
    /// [`Backend::log_prob_backward`], which overwrites it); a −∞ logit gets 0; rows with
    /// `c = 0` are untouched and their logits are not read.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, a
    /// non-finite coefficient, and (where checked) for rows with `c ≠ 0` a row holding
    /// NaN/+∞ or only −∞, or a coefficient so large against the temperature that the
    /// gradient overflows f32.
    fn entropy_backward(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        temperature: f32,
        coeffs: Tensor<'_, Self>,
        dlogits: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Greedy decoding: per row of `logits` `[rows, vocab]` (rows = `ids.len()`), the index
    /// of the largest logit, the lowest among equal maxima, written to `ids` on the device
    /// and to `host`; `u32::MAX` for a row with no token to pick (NaN or +∞ anywhere, or
    /// only −∞). Only `rows` ids cross to the host, not the logits. **Waits** for the
    /// queued ops.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³².
    fn greedy_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        ids: &mut Self::Ids,
        host: &mut [u32],
    ) -> Result<()>;

    /// Sampling: per row of `logits` `[rows, vocab]` (rows = `ids.len()`), the token the
    /// host's sorted walk picks for the uniform draw `uniforms[row]` ∈ [0, 1) with
    /// `temperature`, `top_k` (`None`: no limit) and `top_p` (see
    /// `backend::sampling::sample_row`), written to `ids` on the device and to `host`;
    /// `u32::MAX` for a row with no token (NaN or +∞ anywhere, or only −∞). A device may
    /// find the same cuts another way: equal to the host up to the order of its f64 sums.
    /// **Waits** for the queued ops.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³², a temperature not finite and > 0,
    /// `top_k` 0, `top_p` outside (0, 1].
    #[allow(clippy::too_many_arguments)] // the sampling parameters, each checked
    fn sample_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        temperature: f32,
        top_k: Option<usize>,
        top_p: f32,
        uniforms: &[f64],
        ids: &mut Self::Ids,
        host: &mut [u32],
    ) -> Result<()>;

    // ----- Optimizer ops. -----

    /// `Σ x²` over `x`, accumulated in f64 (CPU: in a fixed order, so deterministic),
    /// returned to the host: the per-tensor part of the global gradient norm. **Waits** for
    /// the queued ops (the caller decides on the host whether to step). NaN or ±∞ anywhere
    /// gives a non-finite sum.
    ///
    /// # Errors
    /// A failure of a queued op reported now.
    fn sum_of_squares(&self, x: Tensor<'_, Self>) -> Result<f64>;

    /// One AdamW update of one parameter tensor, in place: `param`, `exp_avg` (first
    /// moment) and `exp_avg_sq` (second moment) are updated from `grad · grad_scale` as
    /// [`AdamWUpdate`] says. All four have the same length.
    ///
    /// # Errors
    /// Lengths that differ, `update.step == 0`, a learning rate, scale or config field out
    /// of range, and (where checked) a non-finite gradient; then nothing is written.
    fn adamw_step(
        &self,
        param: TensorMut<'_, Self>,
        grad: Tensor<'_, Self>,
        exp_avg: TensorMut<'_, Self>,
        exp_avg_sq: TensorMut<'_, Self>,
        update: &AdamWUpdate,
    ) -> Result<()>;

    /// Appends `dims.seq` new tokens per sequence to one layer's KV cache:
    /// `cache.k[b, cache.len + i] = k_new[b, i]` (and v) for `i < dims.seq`, with `k_new`,
    /// `v_new` `[batch, seq, kv_heads, head_dim]` (after RoPE). The caller tracks the
    /// filled length (it is the same for every layer of a step).
    ///
    /// # Errors
    /// Invalid head counts, lengths that do not match, `cache.len + seq > max_len`.
    fn kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: KvCacheViewMut<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Attention of `dims.seq` new queries per sequence `q` `[batch, seq, q_heads,
    /// head_dim]` over a KV cache holding their keys already ([`Backend::kv_cache_append`]
    /// first): query `i` sits at slot `cache.len − seq + i` and attends the valid slots at
    /// or before it, so this equals [`Backend::attention`] over the whole sequence
    /// (`seq = 1`: a decode step; `seq > 1`: a prefill). Writes `out` like q; a query
    /// without a valid slot gets 0. Forward only: no log-sum-exp is saved.
    ///
    /// # Errors
    /// Invalid head counts or scale, lengths that do not match, `cache.len` outside
    /// `[seq, max_len]`, a mask value not 0 or 1.
    fn attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: KvCacheView<'_, Self::Buffer>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Copies the `[rows, cols]` weight matrix `src` (an `[in, out]` transposed weight) into
    /// `dst` (same length) in the layout this backend's [`Backend::linear_decode_f32`]
    /// reads: the CPU's column tiles (`ares_cpu::ops::matmul_tiles::pack_f32_tiles`), the
    /// same row-major matrix elsewhere (the default, a copy). The storage of f32 decode
    /// weights.
    ///
    /// # Errors
    /// `src` not `rows · cols` long, `dst` of another length.
    fn pack_decode_f32(
        &self,
        src: Tensor<'_, Self>,
        rows: usize,
        cols: usize,
        dst: TensorMut<'_, Self>,
    ) -> Result<()> {
        BackendError::check_len("pack_decode_f32 src", rows.saturating_mul(cols), src.len())?;
        self.copy(src, dst)
    }

    /// [`Backend::linear_transposed`] with the weight `wt` `[in, out]` as
    /// [`Backend::pack_decode_f32`] stored it: `out = x · wt (+ bias)` in `dims.precision`.
    /// The CPU's column-tile product sums every output in order whatever the batch (a row's
    /// result does not depend on the other rows); elsewhere (the default)
    /// [`Backend::linear_transposed`].
    ///
    /// # Errors
    /// As [`Backend::linear_transposed`].
    fn linear_decode_f32(
        &self,
        x: Tensor<'_, Self>,
        wt: Tensor<'_, Self>,
        bias: Option<Tensor<'_, Self>>,
        dims: LinearDims,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.linear_transposed(x, wt, bias, dims, out)
    }

    /// Rounds the `[rows, cols]` weight matrix `src` to bf16 (nearest even, as
    /// `torch.Tensor.bfloat16`) and packs the bits two to an element of `dst`
    /// (`dst.len() == (rows · cols).div_ceil(2)`), in the layout this backend's
    /// [`Backend::linear_transposed_bf16`] reads: the CPU's column tiles
    /// (`ares_cpu::ops::matmul_tiles::pack_bf16_tiles`), CUDA's row-major. The storage of bf16
    /// decode weights.
    ///
    /// # Errors
    /// `src` not `rows · cols` long, `dst` of another length.
    fn pack_bf16(
        &self,
        src: Tensor<'_, Self>,
        rows: usize,
        cols: usize,
        dst: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// [`Backend::linear_transposed`] with the weight `wt` `[in, out]` in packed bf16
    /// ([`Backend::pack_bf16`]; `wt.len() == (in · out).div_ceil(2)`): `out = x · wt (+
    /// bias)`, half the weight bytes of the f32 product. CPU: the weights widened to f32,
    /// `x`, products and sums in f32. CUDA: `x` rounded to bf16 as well, bf16 tensor cores
    /// with f32 sums. `dims.precision` is not used.
    ///
    /// # Errors
    /// As [`Backend::linear_transposed`].
    fn linear_transposed_bf16(
        &self,
        x: Tensor<'_, Self>,
        wt: Tensor<'_, Self>,
        bias: Option<Tensor<'_, Self>>,
        dims: LinearDims,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// [`Backend::kv_cache_append`] for a paged cache: `k_new[b, i]` (and v) `[batch, seq,
    /// kv_heads, head_dim]` goes to slot `len[b] + i` of sequence `b`'s blocks. The caller
    /// owns each written block alone (a shared block is copied first) and advances the
    /// lengths after the step's last layer.
    ///
    /// # Errors
    /// Invalid head counts, lengths that do not match, a slot past a sequence's table or
    /// a block id past the pool.
    fn paged_kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, Self::Buffer, Self::Ids>,
    ) -> Result<()>;

    /// [`Backend::attention_decode`] over a paged cache holding the new queries' keys
    /// already ([`Backend::paged_kv_cache_append`] first): query `i` of sequence `b` sits at
    /// slot `len[b] + i` and attends every slot at or before it (no key mask: the slots of
    /// a sequence are its own tokens). Each sequence has its own length, so sequences of
    /// any lengths share a step without padding.
    ///
    /// # Errors
    /// As [`Backend::paged_kv_cache_append`].
    fn paged_attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Buffer, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    // ----- ARES token ops (docs/algorithms.md §1, §4). -----

    /// Window means `W_t` and their 0/1 validity for every position of `[rows, cols]`
    /// token entropies `entropy` under the 0/1 `mask` (`spec` says the window), and with
    /// `hwe` the HWE mask, per-row HWE counts and soft costs against its τ (the semantics
    /// of `ares_core::entropy::window_means` and `hwe`). Overwrites every output.
    ///
    /// # Errors
    /// Lengths that do not match `spec.cols` and each other, `window_size` 0, a τ not
    /// finite, and (where checked) non-finite entropies under the mask or a mask value
    /// not 0/1.
    fn entropy_windows(
        &self,
        entropy: Tensor<'_, Self>,
        mask: Tensor<'_, Self>,
        spec: WindowSpec,
        hwe: Option<HweViews<'_, Self::Buffer>>,
        means: TensorMut<'_, Self>,
        valid: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Per row of `[rows, cols]` window means, the `q`-th percentile (numpy's linear
    /// interpolation) of those whose `valid` is 1, written to `threshold[row]` with
    /// `has[row] = 1`; a row without a complete window gets 0 and 0.
    ///
    /// # Errors
    /// Lengths that do not match, `cols` 0, `q` outside [0, 100], and on a GPU a row too
    /// long for one block's shared memory.
    fn row_percentile(
        &self,
        means: Tensor<'_, Self>,
        valid: Tensor<'_, Self>,
        cols: usize,
        q: f32,
        threshold: TensorMut<'_, Self>,
        has: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Masked dynamic KL: per token `k_t` by the estimator, weight
    /// `β_t = β_row·(hwe_t ? low_ratio : 1)·mask_t`, per row `Σ_t β_t·k_t` and the mean
    /// `k_t` over valid tokens (the semantics of `ares_core::kl::token_kl`). Overwrites
    /// every output.
    ///
    /// # Errors
    /// Lengths that do not match, `cols` 0, `low_ratio` outside [0, 1], and (where
    /// checked) non-finite log-probs under the mask or a non-finite β.
    fn masked_dynamic_kl(
        &self,
        inputs: KlViews<'_, Self::Buffer>,
        outputs: KlSumViews<'_, Self::Buffer>,
    ) -> Result<()>;

    // ----- Vision tower ops (Qwen2-VL / Qwen2.5-VL). -----

    /// LayerNorm over rows of `dim` (torch.nn.LayerNorm): `out = (x − mean)·rstd·weight +
    /// bias`, `rstd = 1/sqrt(var + eps)` with the biased variance; `x`, `out` `[rows, dim]`;
    /// `weight`, `bias` `[dim]`; saves `mean` `[rows]` and `rstd` `[rows]` for the backward.
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match, `eps` not finite and > 0.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        x: Tensor<'_, Self>,
        weight: Tensor<'_, Self>,
        bias: Tensor<'_, Self>,
        eps: f32,
        dim: usize,
        out: TensorMut<'_, Self>,
        mean: TensorMut<'_, Self>,
        rstd: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of [`Backend::layer_norm`] from `dout` `[rows, dim]`, the forward's `x`,
    /// `weight` and saved `mean`, `rstd`: `dx` `[rows, dim]`, `dweight` `[dim]` and `dbias`
    /// `[dim]` all **accumulate** (`+=`).
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        dout: Tensor<'_, Self>,
        x: Tensor<'_, Self>,
        weight: Tensor<'_, Self>,
        mean: Tensor<'_, Self>,
        rstd: Tensor<'_, Self>,
        dim: usize,
        dx: TensorMut<'_, Self>,
        dweight: TensorMut<'_, Self>,
        dbias: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Element-wise activation `out = act(x)` ([`Activation`] for the formulas).
    ///
    /// # Errors
    /// Lengths that differ.
    fn activation(
        &self,
        kind: Activation,
        x: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of [`Backend::activation`]: `dx = dout · act'(x)`, **overwrites** `dx`.
    ///
    /// # Errors
    /// Lengths that differ.
    fn activation_backward(
        &self,
        kind: Activation,
        dout: Tensor<'_, Self>,
        x: Tensor<'_, Self>,
        dx: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Non-causal multi-head attention restricted to segments (flash-attn's
    /// `cu_seqlens`): `q`, `k`, `v`, `out` `[tokens, heads, head_dim]`; `cu_seqlens` (length
    /// `segments + 1`) starts at 0, is non-decreasing and ends at `tokens` (empty segments
    /// allowed); a query in segment `i` attends to every key in `[cu[i], cu[i+1])`. Writes
    /// `out` and `lse` `[tokens, heads]` (log-sum-exp of the scaled logits). A non-finite
    /// score makes its query's row NaN.
    ///
    /// # Errors
    /// `heads` or `head_dim` 0, a scale not finite and > 0, lengths that do not match
    /// (`cu_seqlens` included), and (where checked: the CPU) offsets that do not start at 0,
    /// decrease or do not end at `tokens`. A GPU may limit `head_dim`.
    #[allow(clippy::too_many_arguments)]
    fn segment_attention(
        &self,
        dims: SegmentAttentionDims,
        cu_seqlens: &Self::Ids,
        q: Tensor<'_, Self>,
        k: Tensor<'_, Self>,
        v: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
        lse: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Backward of [`Backend::segment_attention`] from `dout` `[tokens, heads, head_dim]`,
    /// the forward's inputs, `out` and `lse`; **overwrites** `dq`, `dk`, `dv`.
    ///
    /// # Errors
    /// As [`Backend::segment_attention`], and lengths of `out`, `lse`, `dout` and the
    /// gradients.
    #[allow(clippy::too_many_arguments)]
    fn segment_attention_backward(
        &self,
        dims: SegmentAttentionDims,
        cu_seqlens: &Self::Ids,
        q: Tensor<'_, Self>,
        k: Tensor<'_, Self>,
        v: Tensor<'_, Self>,
        out: Tensor<'_, Self>,
        lse: Tensor<'_, Self>,
        dout: Tensor<'_, Self>,
        dq: TensorMut<'_, Self>,
        dk: TensorMut<'_, Self>,
        dv: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// Row scatter, **overwriting** the named rows: `dst[index[i], :] = src[i, :]`; `src`
    /// `[index.len(), dim]`, `dst` `[rows, dim]`; other rows of `dst` untouched. Places
    /// image embeddings at the `<|image_pad|>` positions; its backward is the
    /// [`Backend::embedding`] gather with the same `index`.
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match, and (where checked: the CPU) an index `>=
    /// rows` or an index repeated. A GPU reports an index `>= rows` at the next waiting
    /// call (that row is not written) and does not detect repeats (one of the rows wins).
    fn scatter_rows(
        &self,
        src: Tensor<'_, Self>,
        index: &Self::Ids,
        rows: usize,
        dim: usize,
        dst: TensorMut<'_, Self>,
    ) -> Result<()>;
}
