//! The `Backend` trait: tensor storage plus the ops the model is written against, with one
//! implementation per compute crate ([`cpu::CpuBackend`] over `ares-cpu`; `cuda::CudaBackend`
//! over `ares-cuda`, with the default `cuda` feature).
//!
//! # Design
//! - **Opaque, device-resident buffers of a dtype.** [`Backend::Buffer`] (f32),
//!   [`Backend::Ids`] (u32 token ids and positions) and [`Backend::Half`] (bf16 or f16,
//!   tagged at run time) are associated types the model never looks inside: on a
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
//!   host), [`Backend::synchronize`] and the calls that bring a result to the host (a
//!   decode step's [`Backend::pick_tokens`], [`Backend::sums_of_squares`]); [`Counting`]
//!   counts them. Uploads copy from the host slice before they return. Errors an op
//!   reports are argument errors found before launch (shapes, lengths); a CPU backend
//!   reports value errors (an id out of range) too, a GPU one may not.
//! - **Shapes are explicit.** Every op takes its dimensions ([`LinearDims`],
//!   [`AttentionDims`], `dim`, `heads`) rather than inferring them from lengths, and checks
//!   the lengths of its views against them.
//! - **Backward ops** (`linear_backward`, `rmsnorm_backward`, ...) follow the same
//!   conventions; the forward ops save what they need (`rstd` of RMSNorm, `lse` of
//!   attention) in caller-provided views. Each says whether it accumulates into its
//!   gradient outputs (`+=`; zero them with [`Backend::fill`]) or overwrites them.
//! - **Training.** [`Backend::log_prob_backward`] starts the backward pass from ∂L/∂logπ
//!   per token, and [`Backend::entropy_backward`] adds an entropy bonus's ∂L/∂H per token;
//!   [`Backend::sums_of_squares`] and [`Backend::adamw_step`] are the optimizer's
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

mod counting;
mod decode;
mod error;
mod ops;
mod optim;
mod pick;
pub mod profile;
mod shapes;
mod token;
mod view;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod sampling;

pub use counting::{Counting, Counts};
pub use decode::{BlockTables, KvCacheView, KvCacheViewMut, PagedKvView, PagedKvViewMut};
pub use error::BackendError;
pub use optim::{AdamWConfig, AdamWUpdate};
pub use pick::{PickBuffers, PickBuffersOf, PickRule, picked_row};
pub use shapes::{
    Activation, AttentionDims, AttentionGrads, AttentionInputs, GradWrite, GradWrites, LinearDims,
    MatmulPrecision, SegmentAttentionDims,
};
pub use token::{
    ActorLossGrads, ActorLossSpec, ActorLossViews, HweViews, KlSumViews, KlViews, WindowSpec,
};
pub use view::{DType, DeviceBuffer, View, ViewMut};

use ares_cpu::sampler::{SampleKey, Sampler};

use ops::declare_ops;

/// Errors unless `dtype` is a 16-bit float (what [`Backend::alloc_half`] takes).
pub(crate) fn check_half(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_half() {
        Ok(())
    } else {
        Err(BackendError::Op {
            op,
            source: format!("dtype = {dtype}: a 16-bit buffer holds bf16 or f16").into(),
        })
    }
}

/// Results of backend calls.
pub type Result<T> = std::result::Result<T, BackendError>;

/// A read-only f32 view of backend `B`.
pub type Tensor<'a, B> = View<'a, <B as Backend>::Buffer>;
/// A writable f32 view of backend `B`.
pub type TensorMut<'a, B> = ViewMut<'a, <B as Backend>::Buffer>;

/// A tensor as it is stored: f32 values, or the bits of a bf16 one — what
/// [`Backend::sums_of_squares`] reads (gradients kept in bf16 among f32 ones).
pub enum Stored<'a, B: Backend + ?Sized> {
    /// f32 values.
    F32(Tensor<'a, B>),
    /// bf16 bits (checked to be bf16 where read).
    Bf16(View<'a, B::Half>),
}

impl<B: Backend + ?Sized> Clone for Stored<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for Stored<'_, B> {}

impl<B: Backend + ?Sized> Stored<'_, B> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + len` of the view, stored alike.
    ///
    /// # Errors
    /// A range past the view's end.
    pub fn slice(&self, start: usize, len: usize) -> Result<Self> {
        Ok(match self {
            Self::F32(v) => Self::F32(v.slice(start, len)?),
            Self::Bf16(v) => Self::Bf16(v.slice(start, len)?),
        })
    }

    /// Copies the values to `dst` on the host, bf16 ones widened to f32 (exact: the bits
    /// shifted up). Returns once the copy has landed.
    ///
    /// # Errors
    /// `dst` of another length; a backend failure.
    pub fn download(self, backend: &B, dst: &mut [f32]) -> Result<()> {
        match self {
            Self::F32(v) => backend.download(v, dst),
            Self::Bf16(v) => {
                BackendError::check_len("download's destination", v.len(), dst.len())?;
                let mut bits = vec![0u16; v.len()];
                backend.download_half(v, &mut bits)?;
                for (d, b) in dst.iter_mut().zip(bits) {
                    *d = f32::from_bits(u32::from(b) << 16);
                }
                Ok(())
            }
        }
    }
}

/// Words of a [`Backend::actor_loss`] report (CUDA: the loss kernel's ten totals and its two
/// status words; the CPU: core's values).
pub const ACTOR_LOSS_REPORT: usize = 12;

/// Tensor storage and the forward ops of a Qwen2/Qwen3/Llama decoder (see the module docs
/// for ownership and synchronisation). All tensors are row-major f32.
pub trait Backend {
    /// An f32 allocation.
    type Buffer: DeviceBuffer;
    /// A u32 allocation (token ids, positions).
    type Ids: DeviceBuffer;
    /// A 16-bit float allocation, bf16 or f16 as its [`DeviceBuffer::dtype`] says (bf16
    /// decode weights).
    type Half: DeviceBuffer;
    /// A byte allocation (8-bit codes: AdamW moments in `int8`).
    type Bytes: DeviceBuffer;
    /// A recorded sequence of ops ([`Backend::begin_capture`]), replayed by
    /// [`Backend::replay`]: a CUDA graph; `()` where nothing is recorded.
    type Graph;

    /// A human-readable name of the device (`"cpu"`).
    fn name(&self) -> &str;

    /// `(free, total)` bytes of the device's own memory where the backend has one (a GPU);
    /// `None` for the host (see `available_host_memory` in ares-runner).
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }

    /// Starts recording the ops called from now on into a graph instead of running them
    /// (CUDA stream capture); `Ok(false)` when this backend records nothing (the CPU: the
    /// ops then run as called). Until [`Backend::end_capture`] only ops may be called: no
    /// allocation, transfer or wait — they would fail the capture.
    ///
    /// # Errors
    /// A device failure.
    fn begin_capture(&self) -> Result<bool> {
        Ok(false)
    }

    /// Ends a capture: the graph of the ops called since [`Backend::begin_capture`], which
    /// did not run, or `None` when the capture failed (an op the device cannot record): the
    /// caller then calls them again to run them.
    ///
    /// # Errors
    /// A device failure.
    fn end_capture(&self) -> Result<Option<Self::Graph>> {
        Ok(None)
    }

    /// Runs the ops of `graph` again, on its buffers' current contents.
    ///
    /// # Errors
    /// A device failure; a backend that records no graph.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;

    /// Whether generating in f32 should multiply by the training weights themselves rather
    /// than a copy in [`Backend::pack_decode_f32`]'s layout: true where that layout is the
    /// training weights' own and the product reads them as fast (CUDA: cuBLAS either way),
    /// so a copy would only cost memory; false on the CPU, whose decode product needs its
    /// column tiles.
    fn decodes_from_training_weights(&self) -> bool {
        false
    }

    /// Whether a model multiplying in bf16 should keep bf16 copies of its weights
    /// (`Model::set_bf16_weights`): true where a bf16 product over f32 weights pays for
    /// converting them on each call (CUDA: a conversion kernel before every GEMM); false on
    /// the CPU, whose products round or widen the weight on each call either way, so a copy
    /// would only cost memory.
    fn keeps_bf16_weights(&self) -> bool {
        false
    }

    /// Whether the training attention takes packed sequences (`segments` of
    /// [`Backend::attention`] and [`Backend::attention_bf16`]): true on the CPU and CUDA;
    /// where false, the model runs a packed pass's attention padded by gathers
    /// ([`Model::set_native_packed_attention`](crate::model::Model::set_native_packed_attention)).
    fn packs_sequences(&self) -> bool {
        false
    }

    /// The time of every op so far, summed per op, as a table, when `ARES_PROFILE=1`
    /// ([`profile`]); `None` otherwise (and on a backend that times nothing).
    ///
    /// # Errors
    /// A device failure while reading the timings back.
    fn op_profile(&self) -> Result<Option<String>> {
        Ok(None)
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

    /// A new buffer of `len` zeroed elements of the 16-bit float `dtype`.
    ///
    /// # Errors
    /// `dtype` not bf16 or f16 ([`BackendError::DType`]); as [`Backend::alloc`].
    fn alloc_half(&self, len: usize, dtype: DType) -> Result<Self::Half>;

    /// A new buffer of `len` zero bytes.
    ///
    /// # Errors
    /// As [`Backend::alloc`].
    fn alloc_bytes(&self, len: usize) -> Result<Self::Bytes>;

    /// Copies `src` into `dst` (a `Bytes` buffer); returns once `src` may be reused.
    ///
    /// # Errors
    /// `src.len() != dst.len()`.
    fn upload_bytes(&self, src: &[u8], dst: ViewMut<'_, Self::Bytes>) -> Result<()>;

    /// Copies the bytes `src` to the host, after every op queued before it has finished.
    ///
    /// # Errors
    /// As [`Backend::download`].
    fn download_bytes(&self, src: View<'_, Self::Bytes>, dst: &mut [u8]) -> Result<()>;

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

    /// Copies the 16-bit float bits `src` into `dst` (a `Half` buffer); returns once `src`
    /// may be reused.
    ///
    /// # Errors
    /// `src.len() != dst.len()`.
    fn upload_half(&self, src: &[u16], dst: ViewMut<'_, Self::Half>) -> Result<()>;

    /// Copies the bits of the 16-bit floats `src` to the host, after every op queued before
    /// it has finished.
    ///
    /// # Errors
    /// As [`Backend::download`].
    fn download_half(&self, src: View<'_, Self::Half>, dst: &mut [u16]) -> Result<()>;

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

    // The ops declared once in `ops.rs`, implemented by both backends from there. Backward
    // ops (llm.c style) either **accumulate** into their gradient outputs (`+=`, so shared
    // weights and residual branches add up; zero them first with [`Backend::fill`]) or
    // **overwrite** them, as each op says.
    ops::declared_ops!(declare_ops);

    // ----- Ops written out in each backend (arguments that are structs of views, host
    // outputs, a default implementation). -----

    /// Residual add, element-wise: `out = a + b`.
    ///
    /// # Errors
    /// Lengths that differ.
    fn add(&self, a: Tensor<'_, Self>, b: Tensor<'_, Self>, out: TensorMut<'_, Self>)
    -> Result<()>;

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

    /// Sampling: per row of `logits` `[rows, vocab]` (rows = `ids.len()`), the token
    /// `sampler` draws with the random numbers of `keys[row]` — the race sampler of
    /// `ares_cpu::sampler`, the same token on every backend — written to `ids` on the device
    /// and to `host`; `u32::MAX` for a row with no token (NaN or +∞ anywhere, or only −∞).
    /// **Waits** for the queued ops.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³², a temperature not finite and > 0,
    /// `top_p` outside (0, 1], `min_p` outside [0, 1].
    fn sample_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        sampler: &Sampler,
        keys: &[SampleKey],
        ids: &mut Self::Ids,
        host: &mut [u32],
    ) -> Result<()>;

    /// A token per row of `logits` `[rows, vocab]` (rows = `bufs.rows()`) by `rule`, with
    /// its log-prob and the entropy of `softmax(logits / temperature)` (as
    /// [`Backend::log_prob_entropy`]): the ids stay in `bufs.targets` on the device, and
    /// `host` ([`PickBuffers::host_len`] words; read them with [`picked_row`]) receives the
    /// ids (`u32::MAX` for a row without a token), the log-probs, the entropies and the
    /// backend's status word. **Waits** for the queued ops: a decode step's one host
    /// synchronisation. The CUDA backend brings all of it over in one transfer, its
    /// bad-value flags included; this default composes the backend's own ops (on the CPU,
    /// copies).
    ///
    /// # Errors
    /// As [`Backend::greedy_tokens`] / [`Backend::sample_tokens`] and
    /// [`Backend::log_prob_entropy`]; `host` or `keys` of the wrong length.
    fn pick_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        rule: PickRule<'_>,
        temperature: f32,
        bufs: &mut PickBuffersOf<Self>,
        host: &mut [u32],
    ) -> Result<()> {
        let rows = bufs.rows();
        BackendError::check_len(
            "pick_tokens host",
            PickBuffersOf::<Self>::host_len(rows),
            host.len(),
        )?;
        let (ids, rest) = host.split_at_mut(rows);
        match rule {
            PickRule::Greedy => self.greedy_tokens(logits, vocab, &mut bufs.targets, ids)?,
            PickRule::Sample { sampler, keys } => {
                self.sample_tokens(logits, vocab, sampler, keys, &mut bufs.targets, ids)?;
            }
        }
        self.log_prob_entropy(
            logits,
            vocab,
            temperature,
            &bufs.targets,
            ViewMut::whole(&mut bufs.log_prob),
            ViewMut::whole(&mut bufs.entropy),
        )?;
        let mut values = vec![0f32; 2 * rows];
        let (lp, ent) = values.split_at_mut(rows);
        self.download(View::whole(&bufs.log_prob), lp)?;
        self.download(View::whole(&bufs.entropy), ent)?;
        for (w, v) in rest.iter_mut().zip(&values) {
            *w = v.to_bits();
        }
        if let Some(status) = rest.last_mut() {
            *status = 0;
        }
        Ok(())
    }

    // ----- Optimizer ops. -----

    /// `Σ x²` over each of `xs` into `out` (as long), accumulated in f64 in a fixed order
    /// that depends on the tensor alone (so deterministic, and a tensor's sum is the same
    /// whatever else is summed with it), returned to the host: the per-tensor parts of the
    /// global gradient norm. **Waits** once for all of them (CUDA: one multi-tensor kernel
    /// pair and one read; the caller decides on the host whether to step). NaN or ±∞ in a
    /// tensor gives that tensor a non-finite sum; an empty tensor's is 0. A bf16 tensor is
    /// summed as its widened values (exact), in the same wait.
    ///
    /// # Errors
    /// `out` not as long as `xs`; a bf16 view of another dtype; a failure of a queued op
    /// reported now.
    fn sums_of_squares(&self, xs: &[Stored<'_, Self>], out: &mut [f64]) -> Result<()>;

    /// [`Backend::sums_of_squares`] of one f32 tensor.
    ///
    /// # Errors
    /// As [`Backend::sums_of_squares`].
    fn sum_of_squares(&self, x: Tensor<'_, Self>) -> Result<f64> {
        let mut total = [0.0];
        self.sums_of_squares(&[Stored::F32(x)], &mut total)?;
        Ok(total[0])
    }

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

    /// [`Backend::paged_kv_cache_append`] into bf16 pools (a rollout's KV cache in half the
    /// memory): each new key and value rounded to the nearest bf16, ties to even.
    ///
    /// # Errors
    /// As [`Backend::paged_kv_cache_append`]; pools that are not bf16.
    fn paged_kv_cache_append_bf16(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, Self::Half, Self::Ids>,
    ) -> Result<()>;

    /// [`Backend::paged_attention_decode`] over bf16 pools
    /// ([`Backend::paged_kv_cache_append_bf16`]): keys and values are widened exactly, so
    /// the output is the f32 op's over the rounded keys and values (the CPU: bit for bit).
    ///
    /// # Errors
    /// As [`Backend::paged_attention_decode`]; pools that are not bf16.
    fn paged_attention_decode_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Half, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// [`Backend::paged_attention_decode`] with bf16 operands, on tensor cores: a prefill
    /// chunk's queries over a paged cache with [`Backend::attention_bf16`]'s arithmetic — q
    /// and every key and value rounded to bf16, keys in tiles of 64 from slot 0, f32 sums
    /// and softmax — so a query's output is the training forward's for the same row of the
    /// whole sequence (the CPU: `ares_cpu`'s twin, bit for bit). Head sizes 64, 80, 128.
    ///
    /// # Errors
    /// As [`Backend::paged_attention_decode`]; another head size; on CUDA an older device.
    fn paged_attention_prefill_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Buffer, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()>;

    /// [`Backend::paged_attention_prefill_bf16`] over bf16 pools
    /// ([`Backend::paged_kv_cache_append_bf16`]): their values are the operands as stored.
    ///
    /// # Errors
    /// As [`Backend::paged_attention_prefill_bf16`]; pools that are not bf16.
    fn paged_attention_prefill_bf16_kv16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Half, Self::Ids>,
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

    /// The actor's loss of one micro-batch (`ares_core::loss::actor_loss`: the policy loss,
    /// the forking mask, the KL term, the entropy bonus, `scale` times their per-token
    /// gradients), **queued**: writes `grads` and its values into `report`
    /// ([`ACTOR_LOSS_REPORT`] words in the backend's own layout), which the caller reads
    /// back whenever it likes — after queueing the backward, with other reports — and turns
    /// into the values with [`Backend::actor_loss_output`]. Nothing waits. A report that
    /// will be refused (core's error for the data: a non-finite input at a valid token, a
    /// mask not 0/1, no valid token; or a loss, KL or entropy term that is not finite) comes
    /// with `grads` all 0, so a backward queued before the report is read changes nothing.
    /// A backend that finds core's error at once may return it here (the CPU runs core's
    /// function, and returns its error); CUDA runs ares-cuda's `policy_loss` kernel (its
    /// twin; Clip-Cov and KL-Cov choose their tokens with `cov_select` first), whose errors
    /// come with the report. The outer error is the backend's.
    ///
    /// # Errors
    /// Lengths (`report` not [`ACTOR_LOSS_REPORT`] long), a missing tensor the spec needs,
    /// a device failure.
    fn actor_loss(
        &self,
        spec: &ActorLossSpec,
        inputs: ActorLossViews<'_, Self::Buffer>,
        grads: ActorLossGrads<'_, Self::Buffer>,
        report: TensorMut<'_, Self>,
    ) -> Result<std::result::Result<(), ares_core::Error>>;

    /// The values of a [`Backend::actor_loss`] report read back to the host, or core's
    /// error for the data it flagged.
    ///
    /// # Errors
    /// Core's, as [`Backend::actor_loss`] describes.
    fn actor_loss_output(
        &self,
        report: &[f32; ACTOR_LOSS_REPORT],
    ) -> std::result::Result<ares_core::loss::ActorLossOutput<f32>, ares_core::Error>;

    /// Whether a trainer should compute `objective`'s loss with [`Backend::actor_loss`]
    /// rather than download the log-probs and compute it on the host: yes for every
    /// objective on the CPU and on CUDA (a wrapper may answer no to run the host path, as
    /// the counting backend does when asked).
    fn has_actor_loss(&self, _objective: &ares_core::loss::Objective<f32>) -> bool {
        true
    }
}
