//! Causal grouped-query attention (GQA) for Qwen2/Qwen3/Llama, as Hugging Face computes it
//! with `scaled_dot_product_attention`, a causal mask and a padding `attention_mask`:
//! training forward and backward side by side, and forward-only decode over a KV cache.
//!
//! For query token `t` of sequence `b` and query head `h` (kv head `g = h / (Hq/Hkv)`):
//!
//! ```text
//! s_ts  = scale · q[b,t,h,:] · k[b,s,g,:]        for keys s ∈ K(b,t) = { s ≤ t : mask[b,s] = 1 }
//! p_ts  = exp(s_ts − lse_t),  lse_t = log Σ_{s∈K} exp(s_ts)
//! out[b,t,h,:] = Σ_{s∈K} p_ts · v[b,s,g,:]
//! ```
//!
//! Layouts (row-major f32, tokens flattened as the q/k/v projections emit them):
//! q and out `[B, T, Hq, D]`, k and v `[B, T, Hkv, D]`, key mask `[B, T]` (0/1, the
//! `attention_mask` of Hugging Face; `None` = every key valid), lse `[B, T, Hq]`.
//! `scale` defaults to `1/√D`.
//!
//! A query's own mask value does not matter, only which keys it may see, so right padding
//! (training) gives every query a normal row, as in Hugging Face. A query with no valid key
//! (a left-padding position) gets output 0, lse `−∞` and zero gradients, never NaN; Hugging
//! Face returns an arbitrary finite row there. Such positions are discarded by the caller
//! anyway, so the difference is harmless. A NaN or ±∞ score makes its row NaN (PyTorch
//! would propagate it too).
//!
//! Saved for backward: only lse `[B, T, Hq]` (4·B·T·Hq bytes, nothing quadratic in T), plus
//! the forward output the caller keeps anyway for the output projection. Backward
//! recomputes the probabilities (FlashAttention-style): one more `q·k` per (query, key)
//! pair in exchange for not storing `[B, Hq, T, T]`.
//!
//! Training (forward and backward) runs as blocks of GEMMs (see `blocked`): per sequence
//! and block of 64 query (or key) tokens, one task, each writing its own rows. Decode
//! over a KV cache runs per (batch, token, head) row with rayon, so one sequence and one
//! token still runs its heads in parallel; dot products there use eight f32 lanes and
//! softmax denominators eight f64 lanes, so both vectorise.

use crate::Result;
use crate::error::check_len;
use crate::exp::exp_nonpositive;
use crate::isa::Isa;
use crate::ops::stored::{F32Exact, Widen};
use ares_core::{Error as CoreError, Shape};
use rayon::prelude::*;

/// Sizes of an attention call: `batch` sequences of `seq` tokens, `q_heads` query heads
/// and `kv_heads` key/value heads of `head_dim` each; logits are `scale · q·k`.
///
/// For [`attention_decode`] `seq` is the number of new query tokens per sequence, for
/// [`kv_cache_append`] the number of new key/value tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// `B`, sequences in the batch.
    pub batch: usize,
    /// `T`, tokens per sequence (padded length).
    pub seq: usize,
    /// `Hq`, query heads; a multiple of `kv_heads`.
    pub q_heads: usize,
    /// `Hkv`, key/value heads.
    pub kv_heads: usize,
    /// `D`, features per head.
    pub head_dim: usize,
    /// Multiplier of the dot products, finite and > 0; `1/√D` from [`AttentionShape::new`].
    pub scale: f32,
}

impl AttentionShape {
    /// A shape with the standard scale `1/√head_dim` (Hugging Face's `head_dim ** -0.5`).
    pub fn new(batch: usize, seq: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        // Computed in f64 and rounded once, as Python's float is rounded to the tensor dtype.
        let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
        AttentionShape {
            batch,
            seq,
            q_heads,
            kv_heads,
            head_dim,
            scale,
        }
    }

    /// The same shape with another logit scale (e.g. a model's `query_pre_attn_scalar`).
    pub fn with_scale(self, scale: f32) -> Self {
        AttentionShape { scale, ..self }
    }

    /// Elements of q or out, `B·T·Hq·D`.
    pub fn q_len(&self) -> Result<usize> {
        numel(&[self.batch, self.seq, self.q_heads, self.head_dim])
    }

    /// Elements of k or v, `B·T·Hkv·D`.
    pub fn kv_len(&self) -> Result<usize> {
        numel(&[self.batch, self.seq, self.kv_heads, self.head_dim])
    }

    /// Elements of the saved lse, `B·T·Hq`.
    pub fn lse_len(&self) -> Result<usize> {
        numel(&[self.batch, self.seq, self.q_heads])
    }

    /// Validates the head configuration and computes the derived sizes.
    fn dims(&self) -> Result<Dims> {
        for (what, n) in [
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if n == 0 {
                return Err(CoreError::OutOfRange {
                    what,
                    value: 0.0,
                    expected: ">= 1",
                }
                .into());
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(CoreError::NotDivisible {
                what: "q_heads",
                len: self.q_heads,
                n: self.kv_heads,
            }
            .into());
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(CoreError::OutOfRange {
                what: "scale",
                value: f64::from(self.scale),
                expected: "finite and > 0",
            }
            .into());
        }
        Ok(Dims {
            b: self.batch,
            t: self.seq,
            hq: self.q_heads,
            hkv: self.kv_heads,
            d: self.head_dim,
            group: self.q_heads / self.kv_heads,
            scale: self.scale,
            q_len: self.q_len()?,
            kv_len: self.kv_len()?,
            lse_len: self.lse_len()?,
        })
    }
}

/// Validated sizes, shorthand for the kernels.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// Query heads per kv head.
    group: usize,
    scale: f32,
    q_len: usize,
    kv_len: usize,
    lse_len: usize,
}

/// The inputs of [`attention_forward`] and [`attention_backward`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionInputs<'a> {
    /// Queries `[B, T, Hq, D]` (after RoPE).
    pub q: &'a [f32],
    /// Keys `[B, T, Hkv, D]` (after RoPE).
    pub k: &'a [f32],
    /// Values `[B, T, Hkv, D]`.
    pub v: &'a [f32],
    /// 0/1 key validity `[B, T]` (Hugging Face's `attention_mask`); `None`: all valid.
    pub key_mask: Option<&'a [f32]>,
    /// Packed sequences (flash-attn's `cu_seqlens`, batch 1): offsets of length
    /// `segments + 1` from 0 to `T`, non-decreasing; query `t` of segment `i` sees the keys
    /// `cu[i] ≤ s ≤ t` (and the key mask), so each segment is attended as a sequence of its
    /// own with no padding between. `None`: the batch's rows are the sequences.
    pub segments: Option<&'a [u32]>,
}

impl AttentionInputs<'_> {
    fn check(&self, dims: &Dims) -> Result<()> {
        check_len("q", dims.q_len, self.q.len())?;
        check_len("k", dims.kv_len, self.k.len())?;
        check_len("v", dims.kv_len, self.v.len())?;
        if let Some(m) = self.key_mask {
            Shape::new(dims.b, dims.t).check_mask("key_mask", m)?;
        }
        if let Some(cu) = self.segments {
            if dims.b != 1 {
                return Err(CoreError::OutOfRange {
                    what: "batch (packed segments)",
                    value: dims.b as f64,
                    expected: "1: packed sequences are one row",
                }
                .into());
            }
            crate::ops::segment_attention::check_cu_seqlens(cu, dims.t)?;
        }
        Ok(())
    }

    /// The sequences attended: each packed segment, or each row of the batch.
    fn spans(&self, dims: &Dims) -> Vec<blocked::Span> {
        match self.segments {
            Some(cu) => cu
                .windows(2)
                .map(|w| (w[0] as usize, (w[1] - w[0]) as usize))
                .collect(),
            None => (0..dims.b).map(|b| (b * dims.t, dims.t)).collect(),
        }
    }
}

/// The gradients written by [`attention_backward`], shaped like q, k and v.
#[derive(Debug)]
pub struct AttentionGrads<'a> {
    /// `∂L/∂q`, `[B, T, Hq, D]`.
    pub dq: &'a mut [f32],
    /// `∂L/∂k`, `[B, T, Hkv, D]`, summed over the query heads of each kv head.
    pub dk: &'a mut [f32],
    /// `∂L/∂v`, `[B, T, Hkv, D]`, summed over the query heads of each kv head.
    pub dv: &'a mut [f32],
}

/// Causal GQA forward: `out[b,t,h] = Σ_{s ≤ t, mask[b,s]=1} softmax_s(scale·q·k_s) · v_s`
/// (module docs for the full formula and layouts).
///
/// Writes `out` `[B, T, Hq, D]` and the row log-sum-exp `lse` `[B, T, Hq]` that
/// [`attention_backward`] needs. Rows without a valid key get `out = 0`, `lse = −∞`.
///
/// # Errors
/// A zero head count or head size, `q_heads` not a multiple of `kv_heads`, a scale that is
/// not finite and positive, a length not matching the shape (named after the argument),
/// or a key mask value other than 0 and 1.
pub fn attention_forward(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    forward_with(shape, inputs, out, lse, blocked::Operands::F32)
}

/// The forward in either operand format (checks shared).
fn forward_with(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
    operands: blocked::Operands,
) -> Result<()> {
    let dims = shape.dims()?;
    inputs.check(&dims)?;
    check_len("out", dims.q_len, out.len())?;
    check_len("lse", dims.lse_len, lse.len())?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let ones;
    let mask = match inputs.key_mask {
        Some(m) => m,
        None => {
            ones = vec![1.0f32; dims.b * dims.t];
            &ones
        }
    };
    let spans = inputs.spans(&dims);
    match operands {
        blocked::Operands::F32 => {
            blocked::forward(&dims, &spans, inputs, mask, out, lse, blocked::BLOCK)
        }
        blocked::Operands::Bf16 => {
            let bf16 = crate::ops::precision::MatmulPrecision::Bf16;
            let (q, k, v) = (
                bf16.rounded(inputs.q),
                bf16.rounded(inputs.k),
                bf16.rounded(inputs.v),
            );
            let rounded = AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
                ..inputs
            };
            tensor_core::forward(&dims, &spans, rounded, mask, out, lse)
        }
    }
}

/// Head sizes the CUDA tensor-core forward is instantiated for (multiples of 16): the
/// model takes [`attention_forward_bf16`] at these and [`attention_forward`] elsewhere.
pub const BF16_HEAD_DIMS: [usize; 3] = [64, 80, 128];

/// [`attention_forward`] with bf16 operands, as the CUDA tensor-core kernel computes it
/// (its twin): q, k, v and the probabilities of each key tile rounded to bf16, f32 sums and
/// softmax state, keys in tiles of [`tensor_core::KEY_TILE`] (the `tensor_core` module
/// states the arithmetic). Any head size; the kernel takes [`BF16_HEAD_DIMS`]. Its
/// backward is [`attention_backward_bf16`].
///
/// # Errors
/// As [`attention_forward`].
pub fn attention_forward_bf16(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    forward_with(shape, inputs, out, lse, blocked::Operands::Bf16)
}

/// Causal GQA backward: from `dout = ∂L/∂out` writes `dq`, `dk`, `dv`.
///
/// With `p_ts` recomputed as `exp(scale·q_t·k_s − lse_t)` and `δ_t = dout_t · out_t`:
/// `ds_ts = p_ts·(dout_t·v_s − δ_t)`, `dq_t = scale·Σ_s ds_ts·k_s`,
/// `dk_s = scale·Σ_{h in group, t ≥ s} ds_ts·q_t`, `dv_s = Σ_{h in group, t ≥ s} p_ts·dout_t`.
///
/// `out` and `lse` are what [`attention_forward`] wrote for the same inputs. The
/// gradients are written, not accumulated: each of q, k and v feeds attention only, so
/// there is nothing to add to and no buffer to zero first. Rows with `lse = −∞` (no valid
/// key) and masked keys get zero gradients. Runs in two row-parallel passes, one over
/// query rows (dq) and one over key rows (dk, dv), so no two threads write one element.
///
/// # Errors
/// As [`attention_forward`], and for `out`, `lse`, `dout`, `dq`, `dk`, `dv` lengths.
pub fn attention_backward(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    grads: AttentionGrads<'_>,
) -> Result<()> {
    let saved = blocked::Saved { out, lse, dout };
    backward_with(shape, inputs, saved, grads, blocked::Operands::F32)
}

/// The backward in either operand format (checks shared).
fn backward_with(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    saved: blocked::Saved<'_>,
    grads: AttentionGrads<'_>,
    operands: blocked::Operands,
) -> Result<()> {
    let dims = shape.dims()?;
    inputs.check(&dims)?;
    check_len("out", dims.q_len, saved.out.len())?;
    check_len("lse", dims.lse_len, saved.lse.len())?;
    check_len("dout", dims.q_len, saved.dout.len())?;
    let AttentionGrads { dq, dk, dv } = grads;
    check_len("dq", dims.q_len, dq.len())?;
    check_len("dk", dims.kv_len, dk.len())?;
    check_len("dv", dims.kv_len, dv.len())?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let ones;
    let mask = match inputs.key_mask {
        Some(m) => m,
        None => {
            ones = vec![1.0f32; dims.b * dims.t];
            &ones
        }
    };
    let block = blocked::BLOCK;
    let spans = inputs.spans(&dims);
    if operands == blocked::Operands::F32 {
        return blocked::backward(
            &dims, &spans, inputs, mask, saved, dq, dk, dv, block, operands,
        );
    }
    let bf16 = crate::ops::precision::MatmulPrecision::Bf16;
    let (q, k, v, dout) = (
        bf16.rounded(inputs.q),
        bf16.rounded(inputs.k),
        bf16.rounded(inputs.v),
        bf16.rounded(saved.dout),
    );
    let rounded = AttentionInputs {
        q: &q,
        k: &k,
        v: &v,
        ..inputs
    };
    let saved = blocked::Saved {
        dout: &dout,
        ..saved
    };
    blocked::backward(
        &dims, &spans, rounded, mask, saved, dq, dk, dv, block, operands,
    )
}

/// The backward of [`attention_forward_bf16`] as the CUDA tensor-core kernels compute it
/// (their twin): [`attention_backward`] with q, k, v and `dout` rounded to bf16 (δ =
/// `dout·out` from the rounded `dout`), the scores recomputed from the rounded q and k,
/// `p = e^(s − lse)` by the kernels' `exp`, and the probabilities and `dS = p∘(dP − δ)`
/// rounded to bf16 for the products that take them (`dV = P̃ᵀ·dÕ`, `dK = scale·dS̃ᵀ·q̃`,
/// `dQ = scale·dS̃·k̃`); f32 sums. `out` and `lse` are the bf16 forward's.
///
/// # Errors
/// As [`attention_backward`].
pub fn attention_backward_bf16(
    shape: &AttentionShape,
    inputs: AttentionInputs<'_>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    grads: AttentionGrads<'_>,
) -> Result<()> {
    let saved = blocked::Saved { out, lse, dout };
    backward_with(shape, inputs, saved, grads, blocked::Operands::Bf16)
}

/// A KV cache view for [`attention_decode`]: per-sequence contiguous
/// `[B, max_len, Hkv, D]` keys and values, sequence `b` holding `len[b]` filled slots
/// `0..len[b]` in token order.
#[derive(Debug, Clone, Copy)]
pub struct KvCache<'a> {
    /// Keys `[B, max_len, Hkv, D]`.
    pub k: &'a [f32],
    /// Values `[B, max_len, Hkv, D]`.
    pub v: &'a [f32],
    /// Slots per sequence.
    pub max_len: usize,
    /// Filled slots per sequence `[B]`, each in `[seq, max_len]`: the new queries' keys
    /// must already be appended.
    pub len: &'a [usize],
    /// Optional 0/1 validity per slot `[B, max_len]` (Hugging Face's `attention_mask`
    /// over cache positions, for left-padded prompts); `None`: all filled slots valid.
    /// Slots at or past `len[b]` are never read, whatever their mask.
    pub key_mask: Option<&'a [f32]>,
}

/// A mutable KV cache for [`kv_cache_append`]; layout as [`KvCache`].
#[derive(Debug)]
pub struct KvCacheMut<'a> {
    /// Keys `[B, max_len, Hkv, D]`.
    pub k: &'a mut [f32],
    /// Values `[B, max_len, Hkv, D]`.
    pub v: &'a mut [f32],
    /// Slots per sequence.
    pub max_len: usize,
    /// Filled slots per sequence `[B]`, advanced by the number of appended tokens.
    pub len: &'a mut [usize],
}

impl KvCache<'_> {
    fn check(&self, dims: &Dims) -> Result<()> {
        let kv_len = numel(&[dims.b, self.max_len, dims.hkv, dims.d])?;
        check_len("k_cache", kv_len, self.k.len())?;
        check_len("v_cache", kv_len, self.v.len())?;
        check_len("cache_len", dims.b, self.len.len())?;
        if let Some(m) = self.key_mask {
            Shape::new(dims.b, self.max_len).check_mask("key_mask", m)?;
        }
        match self.len.iter().find(|&&n| n < dims.t || n > self.max_len) {
            Some(&n) => Err(CoreError::OutOfRange {
                what: "cache_len",
                value: n as f64,
                expected: "in [queries per sequence, max_len] (append the new keys first)",
            }
            .into()),
            None => Ok(()),
        }
    }
}

/// Appends `seq` new tokens per sequence to a KV cache:
/// `cache.k[b, len[b] + i] = k_new[b, i]` (and v) for `i < seq`, then `len[b] += seq`.
///
/// `k_new`, `v_new` are `[B, seq, Hkv, D]` (shape's `batch`, `seq`, `kv_heads`,
/// `head_dim`), the k/v projection output for the new tokens after RoPE. Sequences of
/// different lengths can be filled one at a time through a batch-1 view of their
/// contiguous slab `[max_len, Hkv, D]`.
///
/// # Errors
/// As [`attention_forward`] for the shape; lengths of `k_new`, `v_new`, `k_cache`,
/// `v_cache`, `cache_len`; `cache_len` past `max_len − seq`. Nothing is written on error.
pub fn kv_cache_append(
    shape: &AttentionShape,
    k_new: &[f32],
    v_new: &[f32],
    cache: KvCacheMut<'_>,
) -> Result<()> {
    let dims = shape.dims()?;
    check_len("k_new", dims.kv_len, k_new.len())?;
    check_len("v_new", dims.kv_len, v_new.len())?;
    let KvCacheMut { k, v, max_len, len } = cache;
    let kv_len = numel(&[dims.b, max_len, dims.hkv, dims.d])?;
    check_len("k_cache", kv_len, k.len())?;
    check_len("v_cache", kv_len, v.len())?;
    check_len("cache_len", dims.b, len.len())?;
    if let Some(&n) = len.iter().find(|&&n| n > max_len.saturating_sub(dims.t)) {
        return Err(CoreError::OutOfRange {
            what: "cache_len",
            value: n as f64,
            expected: "<= max_len - new tokens (the cache is full)",
        }
        .into());
    }
    let tok = dims.hkv * dims.d;
    let (chunk, slab) = (dims.t * tok, max_len * tok);
    for (b, n) in len.iter_mut().enumerate() {
        let start = b * slab + *n * tok;
        for (cache, new) in [(&mut *k, k_new), (&mut *v, v_new)] {
            let dst = cache.get_mut(start..start + chunk).unwrap_or_default();
            dst.iter_mut()
                .zip(block(new, b, chunk))
                .for_each(|(d, s)| *d = *s);
        }
        *n += dims.t;
    }
    Ok(())
}

/// Attention of new query tokens over a KV cache, forward only (generation).
///
/// `q` and `out` are `[B, seq, Hq, D]`. Query `i` of sequence `b` sits at cache slot
/// `len[b] − seq + i` and attends the valid slots at or before it, so after
/// [`kv_cache_append`] of the same tokens this equals the rows of [`attention_forward`]
/// over the whole sequence: `seq = 1` is one decode step, `seq > 1` a prefill chunk.
/// Queries with no valid slot get 0.
///
/// Two cache layouts work: Hugging Face's left-padded batch (equal `len`, padding slots
/// masked by `key_mask`) and ragged unpadded sequences (own `len` each, no mask). RoPE
/// positions are the caller's: with left padding they count valid tokens only.
///
/// # Errors
/// As [`attention_forward`] for the shape; lengths of `q`, `out`, `k_cache`, `v_cache`,
/// `cache_len`, `key_mask`; a mask value other than 0/1; `cache_len` outside
/// `[seq, max_len]`.
pub fn attention_decode(
    shape: &AttentionShape,
    q: &[f32],
    cache: KvCache<'_>,
    out: &mut [f32],
) -> Result<()> {
    let dims = shape.dims()?;
    check_len("q", dims.q_len, q.len())?;
    check_len("out", dims.q_len, out.len())?;
    cache.check(&dims)?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let mask = cache.key_mask;
    let Dims {
        t, hkv, d, group, ..
    } = dims;
    // one task per position and kv head: its `group` query heads share one pass over the keys
    out.par_chunks_mut(group * d)
        .zip(q.par_chunks(group * d))
        .enumerate()
        .for_each_init(
            || vec![0.0f32; group.min(HEADS_AT_ONCE) * cache.max_len],
            |scores, (i, (o, qs))| {
                let (row, g) = (i / hkv, i % hkv);
                let (b, j) = (row / t, row % t);
                let n = cache.len.get(b).map_or(0, |&n| n + j + 1 - t);
                let keys = KeySeq::new(&dims, cache.k, cache.v, mask, b, cache.max_len);
                attend(qs, keys, g, n, dims.scale, scores, o);
            },
        );
    Ok(())
}

/// One sequence's keys and values and the validity of its slots: contiguous slots
/// `[S, Hkv, D]` with an optional key mask `[S]`, or slots scattered over the blocks of a
/// paged cache (`table`: the sequence's block ids; slot `s` lives at row
/// `table[s / bs]·bs + s % bs` of the pool, every slot valid). Keys and values are stored
/// as `W` says (f32, or bf16 in a paged cache) and widened as they are read.
struct KeySeq<'a, W: Widen> {
    k: &'a [W::Elem],
    v: &'a [W::Elem],
    mask: Option<&'a [f32]>,
    table: Option<(&'a [u32], usize)>,
    hkv: usize,
    d: usize,
}

impl<W: Widen> Clone for KeySeq<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W: Widen> Copy for KeySeq<'_, W> {}

impl<'a> KeySeq<'a, F32Exact> {
    /// Sequence `b` of buffers holding `s` token slots per sequence.
    fn new(
        dims: &Dims,
        k: &'a [f32],
        v: &'a [f32],
        mask: Option<&'a [f32]>,
        b: usize,
        s: usize,
    ) -> Self {
        let slab = s * dims.hkv * dims.d;
        KeySeq {
            k: block(k, b, slab),
            v: block(v, b, slab),
            mask: mask.map(|m| block(m, b, s)),
            table: None,
            hkv: dims.hkv,
            d: dims.d,
        }
    }
}

impl<'a, W: Widen> KeySeq<'a, W> {
    /// A sequence whose slots are the blocks `table` (of `block_size` slots each) of the
    /// pools `k`, `v` `[blocks, block_size, Hkv, D]`.
    fn paged(
        dims: &Dims,
        k: &'a [W::Elem],
        v: &'a [W::Elem],
        table: &'a [u32],
        block_size: usize,
    ) -> Self {
        KeySeq {
            k,
            v,
            mask: None,
            table: Some((table, block_size)),
            hkv: dims.hkv,
            d: dims.d,
        }
    }

    /// Key and value vectors of kv head `g` and validity of the first `n` slots.
    #[inline(always)]
    fn rows(
        self,
        g: usize,
        n: usize,
    ) -> impl Iterator<Item = (&'a [W::Elem], &'a [W::Elem], bool)> {
        let (tok, d) = (self.hkv * self.d, self.d);
        (0..n).map(move |s| {
            let row = match self.table {
                None => s,
                Some((t, bs)) => t
                    .get(s / bs)
                    .map_or(usize::MAX, |&p| p as usize * bs + s % bs),
            };
            let valid = self.mask.is_none_or(|m| m.get(s) == Some(&1.0));
            let (k, v) = (block(self.k, row, tok), block(self.v, row, tok));
            (block(k, g, d), block(v, g, d), valid)
        })
    }
}

/// The query rows `qs` (`[heads, d]`, the query heads of kv head `g` at one position) over
/// the first `n` slots of `keys`: writes each head's softmax-weighted sum of values to its
/// row of `out` (zeros when no slot is valid, NaN when a score is not finite). `scores` is
/// scratch of ≥ `min(heads, HEADS_AT_ONCE)·n` elements. Runs on the [`Isa::active`] path;
/// every path runs the same code.
fn attend<W: Widen>(
    qs: &[f32],
    keys: KeySeq<'_, W>,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { attend_avx512::<W>(qs, keys, g, n, scale, scores, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { attend_avx2::<W>(qs, keys, g, n, scale, scores, out) },
        _ => attend_impl::<W, false, false>(qs, keys, g, n, scale, scores, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn attend_avx512<W: Widen>(
    qs: &[f32],
    keys: KeySeq<'_, W>,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_impl::<W, true, true>(qs, keys, g, n, scale, scores, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2<W: Widen>(
    qs: &[f32],
    keys: KeySeq<'_, W>,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_impl::<W, true, true>(qs, keys, g, n, scale, scores, out);
}

/// Query heads [`attend`] takes through one pass over the keys (a group of grouped-query
/// attention shares its keys: Qwen2.5-0.5B 7 heads, Llama 3 8); larger groups go in parts.
const HEADS_AT_ONCE: usize = 8;

/// Each head's arithmetic is the one-head loop's, in the same order (the same bits); only
/// the loops are swapped, so a key and a value row are read once for all heads. `DOT8`
/// (AVX2 and AVX-512 paths): scores of 8 keys at a time by [`dot8_avx2`], the same bits as
/// [`dot`].
#[inline(always)]
fn attend_impl<W: Widen, const FMA: bool, const DOT8: bool>(
    qs: &[f32],
    keys: KeySeq<'_, W>,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = keys.d.max(1);
    for (qs, out) in qs
        .chunks(HEADS_AT_ONCE * d)
        .zip(out.chunks_mut(HEADS_AT_ONCE * d))
    {
        let heads = qs.len() / d;
        let n = n.min(scores.len() / heads.max(1));
        let scores = scores.get_mut(..heads * n).unwrap_or_default();
        // pass 1: every head's scores, its max and whether all are finite
        let mut max = [f32::NEG_INFINITY; HEADS_AT_ONCE];
        let mut finite = [true; HEADS_AT_ONCE];
        // head j's score of slot s from its dot product; `None`: a masked slot (−∞)
        let mut score = |j: usize, s: usize, dot: Option<f32>| {
            scores[j * n + s] = dot.map_or(f32::NEG_INFINITY, |dot| {
                let x = scale * dot;
                finite[j] &= x.is_finite();
                max[j] = max[j].max(x);
                x
            });
        };
        // valid slots wait in a batch of 8 when `DOT8`, else go one by one
        let (mut batch, mut batch_k, mut waiting) = ([0usize; 8], [&[][..]; 8], 0usize);
        for (s, (k, _, valid)) in keys.rows(g, n).enumerate() {
            if !valid {
                for j in 0..heads {
                    score(j, s, None);
                }
                continue;
            }
            if !DOT8 || k.len() != d {
                for (j, q) in qs.chunks_exact(d).enumerate() {
                    score(j, s, Some(dot::<W>(q, k)));
                }
                continue;
            }
            (batch[waiting], batch_k[waiting]) = (s, k);
            waiting += 1;
            if waiting == 8 {
                #[cfg(target_arch = "x86_64")]
                for (j, q) in qs.chunks_exact(d).enumerate() {
                    // SAFETY: `DOT8` only under `attend_avx2` / `attend_avx512` (AVX2
                    // supported); every key of the batch holds `d` values, as `q` does.
                    let dots = unsafe { dot8_avx2::<W>(q, &batch_k) };
                    for (&s, dot) in batch.iter().zip(dots) {
                        score(j, s, Some(dot));
                    }
                }
                waiting = 0;
            }
        }
        for (&s, k) in batch.iter().zip(batch_k).take(waiting) {
            for (j, q) in qs.chunks_exact(d).enumerate() {
                score(j, s, Some(dot::<W>(q, k)));
            }
        }
        // per head: probabilities (masked slots hold −∞ and become exactly 0) and their sum
        out.fill(0.0);
        let mut inv = [0.0f32; HEADS_AT_ONCE];
        let mut live = [false; HEADS_AT_ONCE];
        for (j, (row, o)) in scores
            .chunks_mut(n.max(1))
            .zip(out.chunks_mut(d))
            .enumerate()
        {
            if !finite[j] {
                o.fill(f32::NAN);
            } else if max[j] > f32::NEG_INFINITY {
                let m = max[j];
                row.iter_mut()
                    .for_each(|x| *x = exp_nonpositive::<FMA>(*x - m));
                inv[j] = (1.0 / sum_f64(row)) as f32;
                live[j] = true;
            } // else no valid key (a padding query): zeros
        }
        // pass 2: the weighted values, each value row read once for all heads
        for (s, (_, v, _)) in keys.rows(g, n).enumerate() {
            for (j, o) in out.chunks_exact_mut(d).enumerate() {
                let p = scores[j * n + s];
                if live[j] && p != 0.0 {
                    axpy::<W>(p, v, o);
                }
            }
        }
        for (o, (&inv, &live)) in out.chunks_exact_mut(d).zip(inv.iter().zip(&live)) {
            if live {
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// Element count of a shape, or an error if it overflows `usize`.
fn numel(dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| {
            CoreError::OutOfRange {
                what: "attention shape",
                value: dims.iter().map(|&x| x as f64).product(),
                expected: "element count to fit in usize",
            }
            .into()
        })
}

/// Block `i` of `len` elements of `x`; empty if out of range, which validated shapes rule
/// out (kernels then see no data instead of panicking).
#[inline(always)]
fn block<T>(x: &[T], i: usize, len: usize) -> &[T] {
    x.get(i * len..(i + 1) * len).unwrap_or_default()
}

/// `a·b` over sixteen independent lanes so the loop vectorises, `b` widened from `W`.
#[inline(always)]
fn dot<W: Widen>(a: &[f32], b: &[W::Elem]) -> f32 {
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, &y)| x * W::widen(y))
        .sum();
    let mut acc = [0.0f32; 16];
    for (x, y) in ca.zip(cb) {
        for ((s, x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * W::widen(y);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot`] of `a` with each of 8 rows `b[i]` (all of `a`'s length), the same bits: each
/// key's 16 lanes accumulate as `dot`'s do (a product, then a sum, no FMA), two 8 × 8
/// transposes put lane `l` of the 8 keys in one register, and the lanes are summed in
/// `dot`'s order, 8 keys at once — `dot`'s sequential 16-lane sum was ~30 µops a key.
///
/// # Safety
/// The CPU supports AVX2; every `b[i]` has `a.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot8_avx2<W: Widen>(a: &[f32], b: &[&[W::Elem]; 8]) -> [f32; 8] {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_permute2f128_ps,
        _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_unpackhi_ps,
        _mm256_unpacklo_ps,
    };
    let full = a.len() / 16 * 16;
    // `dot`'s starting value of a sum (the `Sum` of no f32)
    let empty: f32 = [0.0f32; 0].iter().sum();
    let mut total = _mm256_set1_ps(empty);
    for half in [0, 8] {
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (half..full).step_by(16) {
            // SAFETY: `c + 8 ≤ full ≤ a.len() = b[i].len()`.
            let q = unsafe { _mm256_loadu_ps(a.as_ptr().add(c)) };
            for (acc, b) in acc.iter_mut().zip(b) {
                // SAFETY: as above.
                let k = unsafe { W::load8(b.as_ptr().add(c)) };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(q, k));
            }
        }
        // rows: keys, columns: lanes half..half + 8  →  rows: lanes, columns: keys
        let [r0, r1, r2, r3, r4, r5, r6, r7] = acc;
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
        let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let lanes: [__m256; 8] = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for l in lanes {
            total = _mm256_add_ps(total, l);
        }
    }
    let mut sums = [0.0f32; 8];
    // SAFETY: `sums` holds 8 floats.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), total) };
    for (sum, b) in sums.iter_mut().zip(b) {
        let tail: f32 = a[full..]
            .iter()
            .zip(&b[full..])
            .map(|(x, &y)| x * W::widen(y))
            .sum();
        *sum += tail;
    }
    sums
}

/// Σx in f64 over eight lanes: softmax denominators of long rows stay exact to f32.
#[inline(always)]
fn sum_f64(x: &[f32]) -> f64 {
    let c = x.chunks_exact(8);
    let tail: f64 = c.remainder().iter().map(|&v| f64::from(v)).sum();
    let mut acc = [0.0f64; 8];
    for x in c {
        for (s, &v) in acc.iter_mut().zip(x) {
            *s += f64::from(v);
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `y += a·x`, `x` widened from `W`.
#[inline(always)]
fn axpy<W: Widen>(a: f32, x: &[W::Elem], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * W::widen(x);
    }
}

mod blocked;
mod paged;
pub mod tensor_core;
pub use paged::{
    PagedKvCache, PagedKvCacheMut, paged_attention_decode, paged_attention_decode_bf16,
    paged_attention_prefill_bf16, paged_attention_prefill_bf16_kv16, paged_kv_cache_append,
    paged_kv_cache_append_bf16,
};
#[cfg(test)]
mod tests;
