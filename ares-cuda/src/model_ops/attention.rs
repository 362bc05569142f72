//! Causal grouped-query attention (training forward and backward, decode over a KV cache)
//! and the KV-cache append, the twins of `ares_cpu::ops::attention`.
//!
//! The kernels (`model_ops.cu`) run FlashAttention-style: keys in tiles of 32 through
//! shared memory, online softmax, nothing `[T, T]` stored; the backward recomputes the
//! probabilities from the saved log-sum-exp in a pass over query rows (dq) and one over
//! key rows (dk, dv), each output element written by one warp in a fixed order
//! (deterministic). Heads of up to 256 dims are supported (three kernel variants).

use super::{ArgOrNull, ModelOps, State, bad, check_len, grid, i32_of, i64_of, mul, scratch};
use crate::error::{DriverContext, Result};
use crate::launch::NULL;
use cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};

/// Warps per block of every attention kernel (`NW` in `model_ops.cu`).
const WARPS: usize = 8;
/// Keys per shared-memory tile (`KT`).
const KEY_TILE: usize = 32;
/// Rows per warp (`RW`) of the forward, dq and dk/dv kernels, per head-size class
/// (≤ 64, ≤ 128, ≤ 256): must match the `ATTN_*` instantiations in `model_ops.cu`.
const FWD_ROWS_PER_WARP: [usize; 3] = [2, 2, 1];
const DQ_ROWS_PER_WARP: [usize; 3] = [1, 2, 1];
const DKV_ROWS_PER_WARP: [usize; 3] = [1, 1, 1];
/// Largest head size the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Head sizes of the tensor-core forward, one kernel each (`ATTN_FWD_MMA`); the CPU twin's
/// `ares_cpu::ops::attention::BF16_HEAD_DIMS`, which the model consults.
pub const BF16_HEAD_DIMS: [usize; 3] = [64, 80, 128];
/// Warps per block and query rows per block of the tensor-core forward (`MMA_WARPS`,
/// `MMA_ROWS` in `model_ops.cu`: 16 rows a warp).
pub(super) const MMA_WARPS: usize = 4;
pub(super) const MMA_ROWS: usize = 64;
/// Opt-in limit above which a kernel must be allowed more dynamic shared memory.
const DEFAULT_SMEM: usize = 48 * 1024;

/// Split-K paged decoding (`SPLIT_MIN_KEYS`, `SPLIT_MAX` in model_ops.cu): a sequence's keys
/// are cut into `⌈keys / SPLIT_MIN_KEYS⌉` chunks, at most `SPLIT_MAX`.
const SPLIT_MIN_KEYS: usize = 512;
const SPLIT_MAX: usize = 16;
/// Floats of the split-K workspace (allocated once, never moved, so captured graphs may keep
/// its address); a batch whose chunks' states do not fit is attended in several launches.
const SPLIT_WORKSPACE: usize = 1 << 22;

/// The sizes of an attention call: `batch` sequences of `seq` tokens (for the decode ops:
/// new tokens per sequence), `q_heads` query heads sharing `kv_heads` key/value heads,
/// `head_dim` features per head, logits `scale · q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (queries; new tokens in the decode ops).
    pub seq: usize,
    /// Query heads, a multiple of `kv_heads`.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Features per head, `1..=256`.
    pub head_dim: usize,
    /// Logit multiplier, finite and > 0 (usually `1/√head_dim`).
    pub scale: f32,
}

/// One layer's KV cache to append to: keys and values `[batch, max_len, kv_heads,
/// head_dim]`, slots `0..len` filled in every sequence.
pub struct KvCacheMut<'a, 'b> {
    /// Keys.
    pub k: &'a mut CudaViewMut<'b, f32>,
    /// Values.
    pub v: &'a mut CudaViewMut<'b, f32>,
    /// Slots per sequence.
    pub max_len: usize,
    /// Filled slots; the new tokens go to `len..len + seq`.
    pub len: usize,
}

/// One layer's KV cache to attend over (layout as [`KvCacheMut`]).
pub struct KvCache<'a, 'b> {
    /// Keys.
    pub k: &'a CudaView<'b, f32>,
    /// Values.
    pub v: &'a CudaView<'b, f32>,
    /// Slots per sequence.
    pub max_len: usize,
    /// Filled slots, the new queries' own keys included.
    pub len: usize,
    /// 0/1 validity per slot `[batch, max_len]`; `None`: every filled slot valid.
    pub key_mask: Option<&'a CudaView<'b, f32>>,
}

/// The block tables and lengths of a paged KV cache's sequences (see
/// [`ModelOps::paged_attention_decode`]), on the device with host copies for the checks.
pub struct BlockTablesView<'a, 'b> {
    /// `[batch, max_blocks]` block ids.
    pub tables: &'a CudaView<'b, u32>,
    /// `[batch]` slots filled before the new tokens.
    pub lens: &'a CudaView<'b, u32>,
    /// Host copy of `tables`.
    pub host_tables: &'a [u32],
    /// Host copy of `lens`.
    pub host_lens: &'a [u32],
    /// Token slots per block.
    pub block_size: usize,
    /// Columns of `tables`.
    pub max_blocks: usize,
}

/// One layer's paged KV cache to append to: pools `[blocks, block_size, kv_heads,
/// head_dim]` of `T`: f32, or bf16 bits (`u16`).
pub struct PagedKvCacheMut<'a, 'b, T = f32> {
    /// Keys.
    pub k: &'a mut CudaViewMut<'b, T>,
    /// Values.
    pub v: &'a mut CudaViewMut<'b, T>,
    /// The sequences' blocks and lengths.
    pub blocks: BlockTablesView<'a, 'b>,
}

/// One layer's paged KV cache to attend over (layout and `T` as [`PagedKvCacheMut`]).
pub struct PagedKvCache<'a, 'b, T = f32> {
    /// Keys.
    pub k: &'a CudaView<'b, T>,
    /// Values.
    pub v: &'a CudaView<'b, T>,
    /// The sequences' blocks and lengths (before the new tokens).
    pub blocks: BlockTablesView<'a, 'b>,
}

/// Checks a paged cache against the shape (the twin of the CPU's checks): whole blocks in
/// the pools, one table row and length per sequence, each sequence's slots `..len + seq`
/// inside its table and on blocks of the pool. Returns the pool's block count.
fn check_paged(
    k: &'static str,
    shape: &AttentionShape,
    dims: &Dims,
    k_len: usize,
    v_len: usize,
    b: &BlockTablesView<'_, '_>,
) -> Result<usize> {
    let per_block = mul(
        k,
        "block_size × kv_heads × head_dim",
        b.block_size,
        dims.kv_tok,
    )?;
    if per_block == 0 || !k_len.is_multiple_of(per_block) {
        return Err(bad(
            k,
            format!(
                "k_cache of {k_len} floats is not whole blocks of {per_block} (block_size = {})",
                b.block_size
            ),
        ));
    }
    check_len(k, "v_cache", k_len, v_len)?;
    let blocks = k_len / per_block;
    let rows = mul(k, "batch × max_blocks", shape.batch, b.max_blocks)?;
    check_len(k, "block_tables", rows, b.tables.len())?;
    check_len(k, "block_tables (host)", rows, b.host_tables.len())?;
    check_len(k, "cache_len", shape.batch, b.lens.len())?;
    check_len(k, "cache_len (host)", shape.batch, b.host_lens.len())?;
    for (i, &n) in b.host_lens.iter().enumerate() {
        let end = n as usize + shape.seq;
        if end > b.max_blocks * b.block_size {
            return Err(bad(
                k,
                format!(
                    "sequence {i}: {end} slots exceed its table of {} blocks × {}",
                    b.max_blocks, b.block_size
                ),
            ));
        }
        let row = &b.host_tables[i * b.max_blocks..i * b.max_blocks + end.div_ceil(b.block_size)];
        if let Some(&id) = row.iter().find(|&&id| id as usize >= blocks) {
            return Err(bad(
                k,
                format!("sequence {i}: block id {id} past the pool of {blocks} blocks"),
            ));
        }
    }
    Ok(blocks)
}

/// Validated sizes.
struct Dims {
    /// `batch · seq`.
    tokens: usize,
    /// `kv_heads · head_dim`, elements of one token's keys.
    kv_tok: usize,
    q_len: usize,
    kv_len: usize,
    lse_len: usize,
    /// Head-size class: 0 (≤ 64), 1 (≤ 128), 2 (≤ 256).
    class: usize,
    hq: i32,
    hkv: i32,
    d: i32,
}

impl AttentionShape {
    fn dims(&self, k: &'static str) -> Result<Dims> {
        for (what, n) in [
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if n == 0 {
                return Err(bad(k, format!("{what} = 0 must be >= 1")));
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(bad(
                k,
                format!(
                    "q_heads = {} is not a multiple of kv_heads = {}",
                    self.q_heads, self.kv_heads
                ),
            ));
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(bad(
                k,
                format!(
                    "head_dim = {} exceeds the CUDA kernels' limit {MAX_HEAD_DIM}",
                    self.head_dim
                ),
            ));
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(bad(
                k,
                format!("scale = {} must be finite and > 0", self.scale),
            ));
        }
        let tokens = mul(k, "batch × seq", self.batch, self.seq)?;
        // head_dim <= 256, so these products fit whenever the head counts do.
        let q_tok = mul(k, "q_heads × head_dim", self.q_heads, self.head_dim)?;
        let kv_tok = mul(k, "kv_heads × head_dim", self.kv_heads, self.head_dim)?;
        mul(k, "batch × kv_heads", self.batch, self.kv_heads)?;
        Ok(Dims {
            tokens,
            kv_tok,
            q_len: mul(k, "q elements", tokens, q_tok)?,
            kv_len: mul(k, "k/v elements", tokens, kv_tok)?,
            lse_len: mul(k, "lse elements", tokens, self.q_heads)?,
            class: match self.head_dim {
                0..=64 => 0,
                65..=128 => 1,
                _ => 2,
            },
            hq: i32_of(k, "q_heads", self.q_heads)?,
            hkv: i32_of(k, "kv_heads", self.kv_heads)?,
            d: i32_of(k, "head_dim", self.head_dim)?,
        })
    }
}

/// The launch of a row-tiled attention kernel: `units` tiles per (sequence, kv head),
/// `smem` bytes of dynamic shared memory (raising the kernel's limit past 48 KiB).
pub(super) fn attention_cfg(
    ops: &ModelOps,
    k: &'static str,
    func: &CudaFunction,
    blocks: usize,
    smem: usize,
) -> Result<LaunchConfig> {
    if smem > ops.info.max_shared_per_block {
        return Err(bad(
            k,
            format!(
                "needs {smem} bytes of shared memory; this device allows {}",
                ops.info.max_shared_per_block
            ),
        ));
    }
    if smem > DEFAULT_SMEM {
        func.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .during(format!("{k}: raising the shared memory limit"))?;
    }
    Ok(LaunchConfig {
        grid_dim: (grid(blocks), 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    })
}

/// Checks the lengths of a KV cache of `max_len` slots per sequence (keys `k_len`,
/// values `v_len` elements); returns the slots, `batch · max_len`.
fn check_cache(
    k: &'static str,
    shape: &AttentionShape,
    dims: &Dims,
    max_len: usize,
    k_len: usize,
    v_len: usize,
) -> Result<usize> {
    let slots = mul(k, "batch × max_len", shape.batch, max_len)?;
    let cache_len = mul(k, "cache elements", slots, dims.kv_tok)?;
    check_len(k, "k_cache", cache_len, k_len)?;
    check_len(k, "v_cache", cache_len, v_len)?;
    Ok(slots)
}

/// Blocks of a row-tiled kernel: per (sequence, kv head), `rows` rows in tiles of `tile`.
fn tiled_blocks(
    k: &'static str,
    shape: &AttentionShape,
    rows: usize,
    tile: usize,
) -> Result<usize> {
    let blocks = mul(
        k,
        "attention blocks",
        shape.batch * shape.kv_heads,
        rows.div_ceil(tile),
    )?;
    // the forward splits its block index in 32 bits
    if blocks > u32::MAX as usize {
        return Err(bad(
            k,
            format!("{blocks} attention blocks exceed 2^32 - 1: split the batch"),
        ));
    }
    Ok(blocks)
}

/// Query rows per (sequence, kv head): the tokens times the query heads of the group.
fn query_rows(k: &'static str, shape: &AttentionShape) -> Result<usize> {
    mul(k, "seq × group", shape.seq, shape.q_heads / shape.kv_heads)
}

/// Rows of a tile of the tensor-core backward (`MMA_BWD_TILE`: keys of the dq kernel's
/// tiles, query rows of the dk/dv kernel's).
const MMA_BWD_TILE: usize = 32;

/// Bytes of dynamic shared memory of the tensor-core dk/dv kernel at head size `d`: the
/// block's keys and values `[MMA_ROWS][d + 8]`, a row tile's q and dout `[tile][d + 8]` and
/// transposed `[d][tile + 8]`, all bf16.
pub(super) fn dkv_mma_smem(d: usize) -> usize {
    2 * (2 * MMA_ROWS * (d + 8) + 2 * MMA_BWD_TILE * (d + 8) + 2 * d * (MMA_BWD_TILE + 8))
}

/// Packed sequences (flash-attn's `cu_seqlens`, the CPU's `segments`): the offsets on the
/// device and their count. The kernels attend each segment as a causal sequence of its own
/// (`seq_span` in `model_ops.cu`) and flag offsets out of order in the status word.
#[derive(Clone, Copy)]
struct Packed<'a, 'b> {
    cu: &'a CudaView<'b, u32>,
    segments: i32,
}

/// The packed layout of a training call: `None` without segments; with them, batch 1 and
/// `segments + 1 ≥ 1` offsets.
fn packed<'a, 'b>(
    k: &'static str,
    shape: &AttentionShape,
    segments: Option<&'a CudaView<'b, u32>>,
) -> Result<Option<Packed<'a, 'b>>> {
    let Some(cu) = segments else {
        return Ok(None);
    };
    if shape.batch != 1 {
        return Err(bad(
            k,
            format!(
                "packed segments (cu_seqlens) are one row: batch = {}, expected 1",
                shape.batch
            ),
        ));
    }
    let Some(count) = cu.len().checked_sub(1) else {
        return Err(bad(
            k,
            "cu_seqlens is empty: it holds segments + 1 offsets, from 0 to seq".to_string(),
        ));
    };
    if count == 0 && shape.seq > 0 {
        return Err(bad(
            k,
            format!(
                "0 segments cannot hold seq = {} (cu_seqlens must end at seq)",
                shape.seq
            ),
        ));
    }
    Ok(Some(Packed {
        cu,
        segments: i32_of(k, "segments", count)?,
    }))
}

/// Blocks of a causal kernel taking `tile` of the `rows` rows (query rows or keys) of each
/// (sequence, kv head): [`tiled_blocks`], and with packed segments enough for every
/// segment's own tiles (each rounds up once more: one tile a segment and kv head more at
/// most). The kernels stride over their blocks, so the count sets the parallelism only;
/// their index space with segments, segments × kv heads × the longest segment's tiles, is
/// at most `segments` times the unpacked one and must stay below 2³² (the f32 forward
/// splits its block index in 32 bits).
fn causal_blocks(
    k: &'static str,
    shape: &AttentionShape,
    rows: usize,
    tile: usize,
    packed: Option<Packed<'_, '_>>,
) -> Result<usize> {
    let blocks = tiled_blocks(k, shape, rows, tile)?;
    match packed {
        None => Ok(blocks),
        Some(p) => {
            let segments = p.segments as usize;
            if blocks.saturating_mul(segments) > u32::MAX as usize {
                return Err(bad(
                    k,
                    format!(
                        "{segments} segments × {blocks} tiles exceed 2^32 - 1 attention blocks: \
                         split the packed row"
                    ),
                ));
            }
            let more = mul(k, "segment tiles", shape.kv_heads, segments)?;
            Ok(blocks.saturating_add(more))
        }
    }
}

/// Pushes the packed-segment arguments every causal training kernel ends with.
fn push_packed<'l>(l: &mut LaunchArgs<'l>, packed: &'l Option<Packed<'l, '_>>, none: &'l i32) {
    match packed {
        Some(p) => l.arg(p.cu).arg(&p.segments),
        None => l.arg(&NULL).arg(none),
    };
}

/// Bytes of dynamic shared memory of the forward and dq kernels: two key tiles (padded
/// rows) and `row_tiles` `[rows, d]` row buffers.
fn rows_smem(d: usize, rows: usize, row_buffers: usize) -> usize {
    4 * (2 * KEY_TILE * (d + 1) + row_buffers * rows * d)
}

impl ModelOps {
    /// Causal GQA forward (twin of `ares_cpu::ops::attention::attention_forward`): q `[B,
    /// T, Hq, D]`, k/v `[B, T, Hkv, D]`, key mask `[B, T]` (0/1; `None`: all valid); writes
    /// `out` like q and the log-sum-exp `lse` `[B, T, Hq]`. Queries without a visible key
    /// get 0 and lse −∞; a visible non-finite score makes the row NaN. A mask value other
    /// than 0/1 counts as 0 and is reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Invalid head counts, head size or scale, lengths that do not match.
    pub fn attention(
        &self,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_>,
        segments: Option<&CudaView<'_, u32>>,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "attention";
        let packed = packed(K, &shape, segments)?;
        let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
        let key_mask = inputs.key_mask.as_ref();
        let dims = shape.dims(K)?;
        check_len(K, "q", dims.q_len, q.len())?;
        check_len(K, "k", dims.kv_len, k.len())?;
        check_len(K, "v", dims.kv_len, v.len())?;
        check_len(K, "out", dims.q_len, out.len())?;
        check_len(K, "lse", dims.lse_len, lse.len())?;
        if let Some(m) = key_mask {
            check_len(K, "key_mask", dims.tokens, m.len())?;
        }
        if dims.q_len == 0 {
            return Ok(());
        }
        if let Some(p) = packed {
            return self.attend_packed(shape, &dims, inputs, p, out, lse);
        }
        self.attend(
            K,
            shape,
            &dims,
            Attend {
                q,
                k,
                v,
                key_mask,
                kv_seq: shape.seq,
                pos0: 0,
            },
            out,
            Some(lse),
        )
    }

    /// The bf16 forward on tensor cores (twin of
    /// `ares_cpu::ops::attention::attention_forward_bf16`): [`ModelOps::attention`] with q,
    /// k, v and each key tile's probabilities rounded to bf16, f32 sums and softmax state.
    /// Head sizes of [`BF16_HEAD_DIMS`] (64, 80, 128), devices of
    /// compute capability 8.0 or later (`mma.sync` with bf16).
    ///
    /// # Errors
    /// As [`ModelOps::attention`]; another head size; an older device.
    pub fn attention_bf16(
        &self,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_>,
        segments: Option<&CudaView<'_, u32>>,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
        let mask = inputs.key_mask.as_ref();
        let qkv = Operands::F32(q, k, v);
        let out = OutMut::F32(out);
        self.attention_mma("attention_bf16", shape, (qkv, mask), segments, out, lse)
    }

    /// [`ModelOps::attention_bf16`] over q, k, v stored in bf16 (activations kept in bf16):
    /// the kernels read the bits as stored where they round f32 ones as they load — the same
    /// bits for the same values.
    ///
    /// # Errors
    /// As [`ModelOps::attention_bf16`].
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, as the CPU's
    pub fn attention_bf16_stored<'o>(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, u16>,
        k: &CudaView<'_, u16>,
        v: &CudaView<'_, u16>,
        key_mask: Option<&CudaView<'_, f32>>,
        segments: Option<&CudaView<'_, u32>>,
        out: Option<&mut CudaViewMut<'o, f32>>,
        out16: Option<&mut CudaViewMut<'o, u16>>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let qkv = Operands::Bf16(q, k, v);
        let op = "attention_bf16_stored";
        let out = match (out, out16) {
            (Some(o), None) => OutMut::F32(o),
            (None, Some(o)) => OutMut::Bf16(o),
            _ => return Err(bad(op, "exactly one of out (f32) and out16 (bf16)".into())),
        };
        self.attention_mma(op, shape, (qkv, key_mask), segments, out, lse)
    }

    /// Checks and launches the tensor-core training forward on `qkv` as stored.
    fn attention_mma(
        &self,
        op: &'static str,
        shape: AttentionShape,
        (qkv, key_mask): (Operands<'_, '_>, Option<&CudaView<'_, f32>>),
        segments: Option<&CudaView<'_, u32>>,
        out: OutMut<'_, '_>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let packed = packed(op, &shape, segments)?;
        let dims = shape.dims(op)?;
        let variant = self.tensor_core_head(op, shape.head_dim)?;
        qkv.check(op, &dims)?;
        check_len(op, "out", dims.q_len, out.len())?;
        check_len(op, "lse", dims.lse_len, lse.len())?;
        if let Some(m) = key_mask {
            check_len(op, "key_mask", dims.tokens, m.len())?;
        }
        if dims.q_len == 0 {
            return Ok(());
        }
        let blocks = causal_blocks(op, &shape, query_rows(op, &shape)?, MMA_ROWS, packed)?;
        let func = &self.f.attention_fwd_mma[variant];
        let cfg = LaunchConfig {
            grid_dim: (grid(blocks), 1, 1),
            block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (b64, t64) = (
            i64_of(op, "batch", shape.batch)?,
            i64_of(op, "seq", shape.seq)?,
        );
        let pos0 = 0i64;
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        qkv.push_f32(&mut l)
            .arg_or_null(key_mask)
            .arg(&b64)
            .arg(&t64)
            .arg(&t64)
            .arg(&pos0)
            .arg(&dims.hq)
            .arg(&dims.hkv)
            .arg(&shape.scale);
        let (o32, o16) = match out {
            OutMut::F32(o) => (Some(o), None),
            OutMut::Bf16(o) => (None, Some(o)),
        };
        l.arg_or_null(o32).arg(lse).arg(&mut state.status);
        let none = 0i32;
        push_packed(&mut l, &packed, &none);
        qkv.push_bf16(&mut l);
        l.arg_or_null(o16);
        // SAFETY: argument order as `ATTN_FWD_MMA`; lengths checked against the shape above
        // (segments by `packed`), the head size is the variant's, shared memory is static.
        unsafe { l.launch(cfg) }.during(op)?;
        Ok(())
    }

    /// Attention of `shape.seq` new queries per sequence over a KV cache that already
    /// holds their keys (twin of `ares_cpu::ops::attention::attention_decode` with one
    /// shared `len`): query `i` sits at slot `len − seq + i` and attends the valid slots at
    /// or before it. Forward only; a query without a valid slot gets 0.
    ///
    /// # Errors
    /// As [`ModelOps::attention`]; `cache.len` outside `[seq, max_len]`, cache lengths.
    pub fn attention_decode(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        cache: KvCache<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "attention_decode";
        let dims = shape.dims(K)?;
        check_len(K, "q", dims.q_len, q.len())?;
        check_len(K, "out", dims.q_len, out.len())?;
        let slots = check_cache(
            K,
            &shape,
            &dims,
            cache.max_len,
            cache.k.len(),
            cache.v.len(),
        )?;
        if let Some(m) = cache.key_mask {
            check_len(K, "key_mask", slots, m.len())?;
        }
        if cache.len < shape.seq || cache.len > cache.max_len {
            return Err(bad(
                K,
                format!(
                    "cache len = {} must be in [seq = {}, max_len = {}] (append the new keys first)",
                    cache.len, shape.seq, cache.max_len
                ),
            ));
        }
        if dims.q_len == 0 {
            return Ok(());
        }
        self.attend(
            K,
            shape,
            &dims,
            Attend {
                q,
                k: cache.k,
                v: cache.v,
                key_mask: cache.key_mask,
                kv_seq: cache.max_len,
                pos0: cache.len - shape.seq,
            },
            out,
            None,
        )
    }

    /// Launches the f32 forward over packed segments (`packed_attention_fwd_*`: each segment
    /// a causal sequence of its own), lengths checked by the caller.
    fn attend_packed(
        &self,
        shape: AttentionShape,
        dims: &Dims,
        inputs: &AttentionInputs<'_>,
        packed: Packed<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "attention";
        let rows = WARPS * FWD_ROWS_PER_WARP[dims.class];
        let blocks = causal_blocks(K, &shape, query_rows(K, &shape)?, rows, Some(packed))?;
        let func = &self.f.packed_attention_fwd[dims.class];
        let cfg = attention_cfg(self, K, func, blocks, rows_smem(shape.head_dim, rows, 1))?;
        let t64 = i64_of(K, "seq", shape.seq)?;
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        l.arg(&inputs.q)
            .arg(&inputs.k)
            .arg(&inputs.v)
            .arg_or_null(inputs.key_mask.as_ref())
            .arg(&t64)
            .arg(&dims.hq)
            .arg(&dims.hkv)
            .arg(&dims.d)
            .arg(&shape.scale)
            .arg(out)
            .arg(lse)
            .arg(&mut state.status)
            .arg(packed.cu)
            .arg(&packed.segments);
        // SAFETY: argument order as `ATTN_FWD`'s packed kernel; lengths checked against the
        // shape by the caller, segments by `packed`; grid and shared memory as the variant's.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// Launches the forward kernel.
    fn attend(
        &self,
        k: &'static str,
        shape: AttentionShape,
        dims: &Dims,
        a: Attend<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
        lse: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let rows = WARPS * FWD_ROWS_PER_WARP[dims.class];
        let blocks = tiled_blocks(k, &shape, query_rows(k, &shape)?, rows)?;
        let func = &self.f.attention_fwd[dims.class];
        let cfg = attention_cfg(self, k, func, blocks, rows_smem(shape.head_dim, rows, 1))?;
        let (b64, qs64, ks64, p64) = (
            i64_of(k, "batch", shape.batch)?,
            i64_of(k, "seq", shape.seq)?,
            i64_of(k, "kv slots", a.kv_seq)?,
            i64_of(k, "pos0", a.pos0)?,
        );
        let zero = 0i64; // block_size, max_blocks, pool blocks: contiguous k/v
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        l.arg(a.q)
            .arg(a.k)
            .arg(a.v)
            .arg_or_null(a.key_mask)
            .arg(&b64)
            .arg(&qs64)
            .arg(&ks64)
            .arg(&p64)
            .arg(&dims.hq)
            .arg(&dims.hkv)
            .arg(&dims.d)
            .arg(&shape.scale)
            .arg(&NULL)
            .arg(&NULL)
            .arg(&zero)
            .arg(&zero)
            .arg(&zero)
            .arg(out)
            .arg_or_null(lse)
            .arg(&mut state.status)
            .arg_or_null(None::<&CudaView<'_, f32>>);
        // SAFETY: argument order as the `ATTN_FWD` kernels; every length was checked
        // against the shape by the caller, and the grid/shared memory match the variant.
        unsafe { l.launch(cfg) }.during(k)?;
        Ok(())
    }

    /// Causal GQA backward (twin of `ares_cpu::ops::attention::attention_backward`) from
    /// `dout` and the forward's `out` and `lse`: **overwrites** `dq`, `dk`, `dv` (dk and dv
    /// summed over each kv head's query heads). Rows without a visible key and masked
    /// keys get zero gradients.
    ///
    /// # Errors
    /// As [`ModelOps::attention`], and lengths of `out`, `lse`, `dout` and the gradients.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, as the CPU's
    pub fn attention_backward(
        &self,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_>,
        segments: Option<&CudaView<'_, u32>>,
        out: &CudaView<'_, f32>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        grads: &mut AttentionGrads<'_>,
    ) -> Result<()> {
        const K: &str = "attention_backward";
        let packed = packed(K, &shape, segments)?;
        let out = OutView::F32(out);
        let saved = AttentionSaved { out, lse, dout };
        let qkv = Operands::F32(&inputs.q, &inputs.k, &inputs.v);
        let inputs = (qkv, inputs.key_mask.as_ref(), packed);
        self.backward_with(K, shape, inputs, saved, grads, None)
    }

    /// The bf16 backward on tensor cores (twin of
    /// `ares_cpu::ops::attention::attention_backward_bf16`) of
    /// [`ModelOps::attention_bf16`]'s `out` and `lse`: q, k, v and `dout` rounded to bf16,
    /// the probabilities and `dS` rounded for the products that take them, f32 sums.
    /// Head sizes and devices as [`ModelOps::attention_bf16`].
    ///
    /// # Errors
    /// As [`ModelOps::attention_backward`]; another head size; an older device.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, as the CPU's
    pub fn attention_backward_bf16(
        &self,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_>,
        segments: Option<&CudaView<'_, u32>>,
        out: &CudaView<'_, f32>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        grads: &mut AttentionGrads<'_>,
    ) -> Result<()> {
        const K: &str = "attention_backward_bf16";
        let packed = packed(K, &shape, segments)?;
        let variant = self.tensor_core_head(K, shape.head_dim)?;
        let out = OutView::F32(out);
        let saved = AttentionSaved { out, lse, dout };
        let qkv = Operands::F32(&inputs.q, &inputs.k, &inputs.v);
        let inputs = (qkv, inputs.key_mask.as_ref(), packed);
        self.backward_with(K, shape, inputs, saved, grads, Some(variant))
    }

    /// [`ModelOps::attention_backward_bf16`] over q, k, v stored in bf16, read as stored
    /// ([`ModelOps::attention_bf16_stored`]): the same bits for the same values.
    ///
    /// # Errors
    /// As [`ModelOps::attention_backward_bf16`].
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, as the CPU's
    pub fn attention_backward_bf16_stored<'o>(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, u16>,
        k: &CudaView<'_, u16>,
        v: &CudaView<'_, u16>,
        key_mask: Option<&CudaView<'_, f32>>,
        segments: Option<&CudaView<'_, u32>>,
        out: Option<&CudaView<'o, f32>>,
        out16: Option<&CudaView<'o, u16>>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        grads: &mut AttentionGrads<'_>,
    ) -> Result<()> {
        const K: &str = "attention_backward_bf16_stored";
        let packed = packed(K, &shape, segments)?;
        let variant = self.tensor_core_head(K, shape.head_dim)?;
        let out = match (out, out16) {
            (Some(o), None) => OutView::F32(o),
            (None, Some(o)) => OutView::Bf16(o),
            _ => return Err(bad(K, "exactly one of out (f32) and out16 (bf16)".into())),
        };
        let saved = AttentionSaved { out, lse, dout };
        let inputs = (Operands::Bf16(q, k, v), key_mask, packed);
        self.backward_with(K, shape, inputs, saved, grads, Some(variant))
    }

    /// The index of `head_dim` in [`BF16_HEAD_DIMS`], on a device with bf16 `mma.sync`;
    /// else the error naming what is missing.
    pub(super) fn tensor_core_head(&self, k: &'static str, head_dim: usize) -> Result<usize> {
        let Some(variant) = BF16_HEAD_DIMS.iter().position(|&d| d == head_dim) else {
            return Err(bad(
                k,
                format!(
                    "head_dim = {head_dim}: the tensor-core attention takes {BF16_HEAD_DIMS:?}"
                ),
            ));
        };
        if self.info.arch < 80 {
            return Err(bad(
                k,
                format!(
                    "bf16 tensor-core attention needs compute capability 8.0 or later; \
                     this device is sm_{} (set trainer.precision: f32 or tf32)",
                    self.info.arch
                ),
            ));
        }
        Ok(variant)
    }

    /// The backward on the f32 kernels, or on the tensor-core kernels of head-size variant
    /// `tensor_core`.
    fn backward_with(
        &self,
        op: &'static str,
        shape: AttentionShape,
        (qkv, key_mask, packed): (
            Operands<'_, '_>,
            Option<&CudaView<'_, f32>>,
            Option<Packed<'_, '_>>,
        ),
        saved: AttentionSaved<'_, '_>,
        grads: &mut AttentionGrads<'_>,
        tensor_core: Option<usize>,
    ) -> Result<()> {
        let grads = AttentionGradsMut {
            dq: &mut grads.dq,
            dk: &mut grads.dk,
            dv: &mut grads.dv,
        };
        let dims = shape.dims(op)?;
        qkv.check(op, &dims)?;
        if tensor_core.is_none()
            && (matches!(qkv, Operands::Bf16(..)) || matches!(saved.out, OutView::Bf16(_)))
        {
            let why = "activations stored in bf16 need the tensor-core kernels";
            return Err(bad(op, why.into()));
        }
        if let Some(m) = key_mask {
            check_len(op, "key_mask", dims.tokens, m.len())?;
        }
        check_len(op, "out", dims.q_len, saved.out.len())?;
        check_len(op, "lse", dims.lse_len, saved.lse.len())?;
        check_len(op, "dout", dims.q_len, saved.dout.len())?;
        check_len(op, "dq", dims.q_len, grads.dq.len())?;
        check_len(op, "dk", dims.kv_len, grads.dk.len())?;
        check_len(op, "dv", dims.kv_len, grads.dv.len())?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let (b64, s64) = (
            i64_of(op, "batch", shape.batch)?,
            i64_of(op, "seq", shape.seq)?,
        );
        let rows64 = i64_of(op, "lse rows", dims.lse_len)?;
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut delta = scratch(&mut state.scratch, &self.stream, dims.lse_len)?;
        {
            // δ = Σ dout·out per (token, head) row (bf16: the rounded dout); one warp per row.
            let func = match tensor_core {
                None => &self.f.attention_bwd_delta,
                Some(_) => &self.f.attention_bwd_delta_bf16,
            };
            let mut l = self.stream.launch_builder(func);
            l.arg(saved.dout);
            match saved.out {
                OutView::F32(o) => l.arg(o),
                OutView::Bf16(_) => l.arg(&NULL),
            };
            l.arg(&rows64).arg(&dims.d).arg(&mut delta);
            if tensor_core.is_some() {
                match saved.out {
                    OutView::F32(_) => l.arg(&NULL),
                    OutView::Bf16(o) => l.arg(o),
                };
            }
            let cfg = LaunchConfig {
                grid_dim: (grid(dims.lse_len.div_ceil(WARPS)), 1, 1),
                block_dim: ((WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `attention_bwd_delta`; dout/out hold rows × d,
            // delta rows.
            unsafe { l.launch(cfg) }.during(format!("{op}: delta"))?;
        }
        let delta = delta.as_view();
        let status = &mut state.status;
        let none = 0i32;
        let inputs = BackwardInputs {
            qkv,
            key_mask,
            batch: b64,
            seq: s64,
            dims: &dims,
            scale: shape.scale,
            lse: saved.lse,
            delta: &delta,
            dout: saved.dout,
        };
        if let Some(variant) = tensor_core {
            let threads = ((MMA_WARPS * 32) as u32, 1, 1);
            let blocks = causal_blocks(op, &shape, query_rows(op, &shape)?, MMA_ROWS, packed)?;
            let func = &self.f.attention_bwd_dq_mma[variant];
            let cfg = LaunchConfig {
                block_dim: threads,
                ..attention_cfg(self, op, func, blocks, 0)?
            };
            let mut l = self.stream.launch_builder(func);
            inputs.push(&mut l).arg(grads.dq).arg(&mut *status);
            push_packed(&mut l, &packed, &none);
            qkv.push_bf16(&mut l);
            // SAFETY: argument order as `ATTN_BWD_MMA`'s dq kernel; lengths checked above,
            // the head size is the variant's, its shared memory static.
            unsafe { l.launch(cfg) }.during(format!("{op}: dq"))?;
            let blocks = causal_blocks(op, &shape, shape.seq, MMA_ROWS, packed)?;
            let func = &self.f.attention_bwd_dkv_mma[variant];
            let cfg = LaunchConfig {
                block_dim: threads,
                ..attention_cfg(self, op, func, blocks, dkv_mma_smem(shape.head_dim))?
            };
            let mut l = self.stream.launch_builder(func);
            inputs.push(&mut l).arg(grads.dk).arg(grads.dv).arg(status);
            push_packed(&mut l, &packed, &none);
            qkv.push_bf16(&mut l);
            // SAFETY: argument order as `ATTN_BWD_MMA`'s dk/dv kernel; lengths checked
            // above, dynamic shared memory as `dkv_mma_smem` computes the kernel's layout.
            unsafe { l.launch(cfg) }.during(format!("{op}: dk, dv"))?;
            return Ok(());
        }
        {
            let rows = WARPS * DQ_ROWS_PER_WARP[dims.class];
            let blocks = causal_blocks(op, &shape, query_rows(op, &shape)?, rows, packed)?;
            let func = match packed {
                None => &self.f.attention_bwd_dq[dims.class],
                Some(_) => &self.f.packed_attention_bwd_dq[dims.class],
            };
            let cfg = attention_cfg(self, op, func, blocks, rows_smem(shape.head_dim, rows, 2))?;
            let mut l = self.stream.launch_builder(func);
            inputs.push(&mut l).arg(grads.dq).arg(&mut *status);
            if packed.is_some() {
                push_packed(&mut l, &packed, &none);
            }
            // SAFETY: argument order as the `ATTN_BWD_DQ` kernels (packed: the segments
            // last); lengths checked above.
            unsafe { l.launch(cfg) }.during(format!("{op}: dq"))?;
        }
        let key_rows = WARPS * DKV_ROWS_PER_WARP[dims.class];
        let blocks = causal_blocks(op, &shape, shape.seq, key_rows, packed)?;
        let func = match packed {
            None => &self.f.attention_bwd_dkv[dims.class],
            Some(_) => &self.f.packed_attention_bwd_dkv[dims.class],
        };
        let d = shape.head_dim;
        let smem = 4 * (2 * 32 * (d + 1) + 2 * key_rows * d);
        let cfg = attention_cfg(self, op, func, blocks, smem)?;
        let mut l = self.stream.launch_builder(func);
        inputs.push(&mut l).arg(grads.dk).arg(grads.dv).arg(status);
        if packed.is_some() {
            push_packed(&mut l, &packed, &none);
        }
        // SAFETY: argument order as the `ATTN_BWD_DKV` kernels (packed: the segments last);
        // lengths checked above.
        unsafe { l.launch(cfg) }.during(format!("{op}: dk, dv"))?;
        Ok(())
    }

    /// Attention of `shape.seq` new queries per sequence over a paged KV cache holding their
    /// keys already (twin of `ares_cpu::ops::attention::paged_attention_decode`): query `i`
    /// of sequence `b` sits at slot `lens[b] + i` and attends every slot at or before it.
    ///
    /// # Errors
    /// As [`ModelOps::attention`]; pool, table and length sizes, a slot past a table or a
    /// block id past the pool.
    pub fn paged_attention_decode(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        cache: PagedKvCache<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "paged_attention_decode";
        let dims = shape.dims(K)?;
        check_len(K, "q", dims.q_len, q.len())?;
        check_len(K, "out", dims.q_len, out.len())?;
        let blocks = check_paged(
            K,
            &shape,
            &dims,
            cache.k.len(),
            cache.v.len(),
            &cache.blocks,
        )?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let pools = Pools::F32(cache.k, cache.v);
        self.paged_decode(K, shape, &dims, q, pools, &cache.blocks, blocks, out)
    }

    /// [`ModelOps::paged_attention_decode`] over bf16 pools (twin of
    /// `ares_cpu::ops::attention::paged_attention_decode_bf16`): each key and value widened
    /// (exactly) as it is staged, so the output is the f32 kernel's over the rounded values.
    ///
    /// # Errors
    /// As [`ModelOps::paged_attention_decode`].
    pub fn paged_attention_decode_bf16(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        cache: PagedKvCache<'_, '_, u16>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "paged_attention_decode_bf16";
        let dims = shape.dims(K)?;
        check_len(K, "q", dims.q_len, q.len())?;
        check_len(K, "out", dims.q_len, out.len())?;
        let b = &cache.blocks;
        let blocks = check_paged(K, &shape, &dims, cache.k.len(), cache.v.len(), b)?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let pools = Pools::Bf16(cache.k, cache.v);
        self.paged_decode(K, shape, &dims, q, pools, b, blocks, out)
    }

    /// A prefill chunk over a paged cache on tensor cores (twin of
    /// `ares_cpu::ops::attention::paged_attention_prefill_bf16`): [`ModelOps::paged_attention_decode`]
    /// with q and each key and value rounded to bf16 and the tensor-core forward's
    /// arithmetic (`paged_attention_fwd_mma_*`). Head sizes and devices as
    /// [`ModelOps::attention_bf16`].
    ///
    /// # Errors
    /// As [`ModelOps::paged_attention_decode`] and [`ModelOps::attention_bf16`].
    pub fn paged_attention_prefill_bf16(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        cache: PagedKvCache<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let pools = Pools::F32(cache.k, cache.v);
        self.paged_prefill(
            "paged_attention_prefill_bf16",
            shape,
            q,
            pools,
            &cache.blocks,
            out,
        )
    }

    /// [`ModelOps::paged_attention_prefill_bf16`] over bf16 pools (twin of
    /// `ares_cpu::ops::attention::paged_attention_prefill_bf16_kv16`): the pools' values
    /// are the operands as they are.
    ///
    /// # Errors
    /// As [`ModelOps::paged_attention_prefill_bf16`].
    pub fn paged_attention_prefill_bf16_kv16(
        &self,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        cache: PagedKvCache<'_, '_, u16>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let pools = Pools::Bf16(cache.k, cache.v);
        let k = "paged_attention_prefill_bf16_kv16";
        self.paged_prefill(k, shape, q, pools, &cache.blocks, out)
    }

    /// Checks and launches `paged_attention_fwd_mma_*` for either pool dtype.
    fn paged_prefill(
        &self,
        k: &'static str,
        shape: AttentionShape,
        q: &CudaView<'_, f32>,
        pools: Pools<'_, '_>,
        b: &BlockTablesView<'_, '_>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dims = shape.dims(k)?;
        let variant = self.tensor_core_head(k, shape.head_dim)?;
        check_len(k, "q", dims.q_len, q.len())?;
        check_len(k, "out", dims.q_len, out.len())?;
        let (kl, vl) = match pools {
            Pools::F32(kp, vp) => (kp.len(), vp.len()),
            Pools::Bf16(kp, vp) => (kp.len(), vp.len()),
        };
        let pool_blocks = check_paged(k, &shape, &dims, kl, vl, b)?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let blocks = causal_blocks(k, &shape, query_rows(k, &shape)?, MMA_ROWS, None)?;
        let cfg = LaunchConfig {
            grid_dim: (grid(blocks), 1, 1),
            block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = &self.f.paged_attention_fwd_mma[variant];
        let ints = [
            i64_of(k, "batch", shape.batch)?,
            i64_of(k, "seq", shape.seq)?,
            i64_of(k, "block_size", b.block_size)?,
            i64_of(k, "max_blocks", b.max_blocks)?,
            i64_of(k, "pool blocks", pool_blocks)?,
        ];
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        l.arg(q);
        match pools {
            Pools::F32(kp, vp) => l.arg(kp).arg(vp).arg(&NULL).arg(&NULL),
            Pools::Bf16(kp, vp) => l.arg(&NULL).arg(&NULL).arg(kp).arg(vp),
        };
        l.arg(&ints[0])
            .arg(&ints[1])
            .arg(&dims.hq)
            .arg(&dims.hkv)
            .arg(&shape.scale)
            .arg(b.tables)
            .arg(b.lens)
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(out)
            .arg(&mut state.status);
        // SAFETY: argument order as `ATTN_FWD_MMA`'s paged kernel; lengths, tables and
        // pool checked above (`check_paged`), the head size is the variant's, shared memory
        // is static.
        unsafe { l.launch(cfg) }.during(k)?;
        Ok(())
    }

    /// The paged forward (`ATTN_FWD` / `ATTN_FWD_KV16`) of checked arguments. Decoding
    /// steps (one query a sequence) whose tables can hold more than `SPLIT_MIN_KEYS` keys run
    /// split-K: each sequence's keys in up to `SPLIT_MAX` chunks, a block each, merged by
    /// `attention_split_combine` — the plan a function of the sequence's own length, and one
    /// chunk the unsplit kernel to the bit, so a sequence's output does not depend on its
    /// batch (nor on whether the table's width chose this path). The decision rests on the
    /// width, not the lengths, so a captured graph stays right as the sequences grow. The
    /// batch goes in as many launches as the workspace needs.
    #[allow(clippy::too_many_arguments)] // the checked pieces of both callers
    fn paged_decode(
        &self,
        k: &'static str,
        shape: AttentionShape,
        dims: &Dims,
        q: &CudaView<'_, f32>,
        pools: Pools<'_, '_>,
        b: &BlockTablesView<'_, '_>,
        pool_blocks: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let split = shape.seq == 1 && b.max_blocks.saturating_mul(b.block_size) > SPLIT_MIN_KEYS;
        let per_seq = shape.seq * shape.q_heads * shape.head_dim;
        let chunk = if split {
            let state = SPLIT_MAX * shape.q_heads * (shape.head_dim + 2);
            (SPLIT_WORKSPACE / state).max(1)
        } else {
            shape.batch
        };
        let rows = WARPS * FWD_ROWS_PER_WARP[dims.class];
        let func = match pools {
            Pools::F32(..) => &self.f.attention_fwd[dims.class],
            Pools::Bf16(..) => &self.f.attention_fwd_kv16[dims.class],
        };
        let smem = rows_smem(shape.head_dim, rows, 1);
        let paged = [
            i64_of(k, "block_size", b.block_size)?,
            i64_of(k, "max_blocks", b.max_blocks)?,
            i64_of(k, "pool blocks", pool_blocks)?,
        ];
        let zero = 0i64;
        let mut b0 = 0;
        while b0 < shape.batch {
            let b1 = (b0 + chunk).min(shape.batch);
            let part = AttentionShape {
                batch: b1 - b0,
                ..shape
            };
            let mut grid = tiled_blocks(k, &part, query_rows(k, &part)?, rows)?;
            if split {
                grid = mul(k, "split-K blocks", grid, SPLIT_MAX)?;
            }
            let cfg = attention_cfg(self, k, func, grid, smem)?;
            let q = q.slice(b0 * per_seq..b1 * per_seq);
            let mut out = out.slice_mut(b0 * per_seq..b1 * per_seq);
            let tables = b.tables.slice(b0 * b.max_blocks..b1 * b.max_blocks);
            let lens = b.lens.slice(b0..b1);
            let (b64, qs64) = (
                i64_of(k, "batch", part.batch)?,
                i64_of(k, "seq", shape.seq)?,
            );
            let mut state = self.lock();
            if split && state.split_ws.is_none() {
                state.split_ws = Some(
                    self.stream
                        .alloc_zeros::<f32>(SPLIT_WORKSPACE)
                        .during("allocating the split-K workspace")?,
                );
            }
            let State {
                status, split_ws, ..
            } = &mut *state;
            let mut ws = split_ws.as_mut().filter(|_| split);
            let mut l = self.stream.launch_builder(func);
            match pools {
                Pools::F32(kp, vp) => {
                    l.arg(&q).arg(kp).arg(vp).arg(&NULL).arg(&b64).arg(&qs64);
                    l.arg(&paged[2]).arg(&zero);
                }
                Pools::Bf16(kp, vp) => {
                    l.arg(&q).arg(kp).arg(vp).arg(&b64).arg(&qs64);
                }
            }
            l.arg(&dims.hq)
                .arg(&dims.hkv)
                .arg(&dims.d)
                .arg(&shape.scale)
                .arg(&tables)
                .arg(&lens);
            for a in &paged {
                l.arg(a);
            }
            l.arg(&mut out);
            if let Pools::F32(..) = pools {
                l.arg(&NULL); // no lse
            }
            l.arg(&mut *status);
            match ws.as_mut() {
                Some(w) => l.arg(&mut **w),
                None => l.arg(&NULL),
            };

            // SAFETY: argument order as the `ATTN_FWD` / `ATTN_FWD_KV16` kernels (F32: the
            // paged kernel reads no mask, kv_seq = pool blocks, pos0 unused); lengths
            // checked by the callers, the slices cut at whole sequences; the workspace holds
            // SPLIT_MAX states of every row of the part (`chunk`).
            unsafe { l.launch(cfg) }.during(k)?;
            if let Some(w) = ws {
                let warps = 8usize;
                let cfg = LaunchConfig {
                    grid_dim: (
                        grid_of(mul(k, "rows", part.batch, shape.q_heads)?, warps),
                        1,
                        1,
                    ),
                    block_dim: ((warps * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = self.stream.launch_builder(&self.f.attention_split_combine);
                l.arg(&*w)
                    .arg(&lens)
                    .arg(&b64)
                    .arg(&dims.hq)
                    .arg(&dims.d)
                    .arg(&mut out);
                // SAFETY: argument order as `attention_split_combine`; the workspace was
                // written by the launch above for these rows.
                unsafe { l.launch(cfg) }.during(format!("{k}: split-K combine"))?;
            }
            b0 = b1;
        }
        Ok(())
    }

    /// Appends `shape.seq` new tokens per sequence to a paged KV cache (twin of
    /// `ares_cpu::ops::attention::paged_kv_cache_append`): token `i` of sequence `b` goes to
    /// slot `lens[b] + i`. The caller advances the lengths.
    ///
    /// # Errors
    /// As [`ModelOps::paged_attention_decode`].
    pub fn paged_kv_cache_append(
        &self,
        shape: AttentionShape,
        k_new: &CudaView<'_, f32>,
        v_new: &CudaView<'_, f32>,
        cache: PagedKvCacheMut<'_, '_>,
    ) -> Result<()> {
        let f = &self.f.paged_kv_append;
        self.paged_append("paged_kv_cache_append", f, shape, k_new, v_new, cache)
    }

    /// [`ModelOps::paged_kv_cache_append`] into bf16 pools (twin of
    /// `ares_cpu::ops::attention::paged_kv_cache_append_bf16`): each new key and value
    /// rounded to the nearest bf16, ties to even.
    ///
    /// # Errors
    /// As [`ModelOps::paged_kv_cache_append`].
    pub fn paged_kv_cache_append_bf16(
        &self,
        shape: AttentionShape,
        k_new: &CudaView<'_, f32>,
        v_new: &CudaView<'_, f32>,
        cache: PagedKvCacheMut<'_, '_, u16>,
    ) -> Result<()> {
        let f = &self.f.paged_kv_append_bf16;
        self.paged_append("paged_kv_cache_append_bf16", f, shape, k_new, v_new, cache)
    }

    /// Launches `func` (`paged_kv_append` or its bf16 twin, which share their arguments).
    fn paged_append<T: DeviceRepr>(
        &self,
        k: &'static str,
        func: &CudaFunction,
        shape: AttentionShape,
        k_new: &CudaView<'_, f32>,
        v_new: &CudaView<'_, f32>,
        cache: PagedKvCacheMut<'_, '_, T>,
    ) -> Result<()> {
        let dims = shape.dims(k)?;
        check_len(k, "k_new", dims.kv_len, k_new.len())?;
        check_len(k, "v_new", dims.kv_len, v_new.len())?;
        let blocks = check_paged(
            k,
            &shape,
            &dims,
            cache.k.len(),
            cache.v.len(),
            &cache.blocks,
        )?;
        if dims.kv_len == 0 {
            return Ok(());
        }
        let b = &cache.blocks;
        let args = [
            i64_of(k, "batch", shape.batch)?,
            i64_of(k, "seq", shape.seq)?,
            i64_of(k, "kv_heads × head_dim", dims.kv_tok)?,
        ];
        let paged = [
            i64_of(k, "block_size", b.block_size)?,
            i64_of(k, "max_blocks", b.max_blocks)?,
            i64_of(k, "pool blocks", blocks)?,
        ];
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        l.arg(k_new).arg(v_new);
        for a in &args {
            l.arg(a);
        }
        l.arg(b.tables).arg(b.lens);
        for a in &paged {
            l.arg(a);
        }
        l.arg(cache.k).arg(cache.v).arg(&mut state.status);
        // SAFETY: argument order as `PAGED_KV_APPEND`, the pools of the kernel's type;
        // lengths, tables and room checked above.
        unsafe { l.launch(super::element_cfg(dims.kv_len)) }.during(k)?;
        Ok(())
    }

    /// Appends `shape.seq` new tokens per sequence to one layer's KV cache (twin of
    /// `ares_cpu::ops::attention::kv_cache_append` with one shared `len`):
    /// `cache.k[b, len + i] = k_new[b, i]` (and v), `k_new`, `v_new` `[batch, seq,
    /// kv_heads, head_dim]`. The caller advances `len`.
    ///
    /// # Errors
    /// Invalid head counts, lengths that do not match, `len + seq > max_len`.
    pub fn kv_cache_append(
        &self,
        shape: AttentionShape,
        k_new: &CudaView<'_, f32>,
        v_new: &CudaView<'_, f32>,
        cache: KvCacheMut<'_, '_>,
    ) -> Result<()> {
        const K: &str = "kv_cache_append";
        let dims = shape.dims(K)?;
        check_len(K, "k_new", dims.kv_len, k_new.len())?;
        check_len(K, "v_new", dims.kv_len, v_new.len())?;
        let tok = dims.kv_tok;
        check_cache(
            K,
            &shape,
            &dims,
            cache.max_len,
            cache.k.len(),
            cache.v.len(),
        )?;
        if cache.len > cache.max_len.saturating_sub(shape.seq) {
            return Err(bad(
                K,
                format!(
                    "cache len = {} + {} new tokens exceeds max_len = {} (the cache is full)",
                    cache.len, shape.seq, cache.max_len
                ),
            ));
        }
        if dims.kv_len == 0 {
            return Ok(());
        }
        let args = [
            i64_of(K, "batch", shape.batch)?,
            i64_of(K, "seq", shape.seq)?,
            i64_of(K, "kv_heads × head_dim", tok)?,
            i64_of(K, "max_len", cache.max_len)?,
            i64_of(K, "len", cache.len)?,
        ];
        let mut l = self.stream.launch_builder(&self.f.kv_append);
        l.arg(k_new).arg(v_new);
        for a in &args {
            l.arg(a);
        }
        l.arg(cache.k).arg(cache.v);
        // SAFETY: argument order as `kv_append`; lengths and the free room checked above.
        unsafe { l.launch(super::element_cfg(dims.kv_len)) }.during(K)?;
        Ok(())
    }
}

/// Inputs of the forward launch.
/// A paged cache's pools as the forward kernels take them.
#[derive(Clone, Copy)]
enum Pools<'a, 'b> {
    F32(&'a CudaView<'b, f32>, &'a CudaView<'b, f32>),
    Bf16(&'a CudaView<'b, u16>, &'a CudaView<'b, u16>),
}

/// Blocks of `per_block` rows covering `rows` rows.
fn grid_of(rows: usize, per_block: usize) -> u32 {
    grid(rows.div_ceil(per_block))
}

struct Attend<'a, 'b> {
    q: &'a CudaView<'b, f32>,
    k: &'a CudaView<'b, f32>,
    v: &'a CudaView<'b, f32>,
    key_mask: Option<&'a CudaView<'b, f32>>,
    /// Token slots per sequence in k/v (seq in training, max_len in decoding).
    kv_seq: usize,
    /// Slot of the first query.
    pos0: usize,
}

/// The arguments the dq and dk/dv kernels share, in their order (`ATTN_BWD_*`).
struct BackwardInputs<'a, 'b> {
    qkv: Operands<'a, 'b>,
    key_mask: Option<&'a CudaView<'b, f32>>,
    batch: i64,
    seq: i64,
    dims: &'a Dims,
    scale: f32,
    lse: &'a CudaView<'b, f32>,
    /// `δ = Σ dout·out` per (token, head) row.
    delta: &'a CudaView<'a, f32>,
    dout: &'a CudaView<'b, f32>,
}

impl BackwardInputs<'_, '_> {
    /// Pushes the shared arguments; the caller pushes the kernel's outputs after them.
    fn push<'r, 'l>(&'l self, l: &'r mut LaunchArgs<'l>) -> &'r mut LaunchArgs<'l> {
        self.qkv
            .push_f32(l)
            .arg_or_null(self.key_mask)
            .arg(&self.batch)
            .arg(&self.seq)
            .arg(&self.dims.hq)
            .arg(&self.dims.hkv)
            .arg(&self.dims.d)
            .arg(&self.scale)
            .arg(self.lse)
            .arg(self.delta)
            .arg(self.dout)
    }
}

/// What [`ModelOps::attention_backward`] reads besides the inputs.
pub(crate) struct AttentionSaved<'a, 'b> {
    /// The forward output `[B, T, Hq, D]`, f32 or stored in bf16.
    pub out: OutView<'a, 'b>,
    /// The forward log-sum-exp `[B, T, Hq]`.
    pub lse: &'a CudaView<'b, f32>,
    /// `∂L/∂out` `[B, T, Hq, D]`.
    pub dout: &'a CudaView<'b, f32>,
}

/// The query, key and value views of an attention call, and its key mask (`None`: every key
/// valid).
pub struct AttentionInputs<'a> {
    /// `[B, T, Hq, D]`.
    pub q: CudaView<'a, f32>,
    /// `[B, T, Hkv, D]`.
    pub k: CudaView<'a, f32>,
    /// `[B, T, Hkv, D]`.
    pub v: CudaView<'a, f32>,
    /// `[B, T]`, 0/1.
    pub key_mask: Option<CudaView<'a, f32>>,
}

/// The attention's output as the forward writes it: f32, or rounded to bf16 (activations
/// stored in bf16).
pub(super) enum OutMut<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    Bf16(&'a mut CudaViewMut<'b, u16>),
}

impl OutMut<'_, '_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(o) => o.len(),
            Self::Bf16(o) => o.len(),
        }
    }
}

/// The attention's output as the backward reads it (see [`OutMut`]).
#[derive(Clone, Copy)]
pub(crate) enum OutView<'a, 'b> {
    F32(&'a CudaView<'b, f32>),
    Bf16(&'a CudaView<'b, u16>),
}

impl OutView<'_, '_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(o) => o.len(),
            Self::Bf16(o) => o.len(),
        }
    }
}

/// q, k, v as a launch passes them: f32 values (the tensor-core kernels round them as they
/// load) or bf16 bits as stored. The tensor-core training kernels take both pointer sets,
/// the unused one null; the f32 kernels take f32 only.
#[derive(Clone, Copy)]
pub(super) enum Operands<'a, 'b> {
    F32(
        &'a CudaView<'b, f32>,
        &'a CudaView<'b, f32>,
        &'a CudaView<'b, f32>,
    ),
    Bf16(
        &'a CudaView<'b, u16>,
        &'a CudaView<'b, u16>,
        &'a CudaView<'b, u16>,
    ),
}

impl Operands<'_, '_> {
    /// The lengths of q, k, v.
    pub(super) fn lens(&self) -> [usize; 3] {
        match self {
            Self::F32(q, k, v) => [q.len(), k.len(), v.len()],
            Self::Bf16(q, k, v) => [q.len(), k.len(), v.len()],
        }
    }

    /// Errors unless q, k, v have the lengths of `dims`.
    fn check(&self, op: &'static str, dims: &Dims) -> Result<()> {
        let lens = self.lens();
        check_len(op, "q", dims.q_len, lens[0])?;
        check_len(op, "k", dims.kv_len, lens[1])?;
        check_len(op, "v", dims.kv_len, lens[2])
    }

    /// Pushes the f32 q, k, v (null for bf16 ones).
    pub(super) fn push_f32<'r, 'l>(&'l self, l: &'r mut LaunchArgs<'l>) -> &'r mut LaunchArgs<'l> {
        match self {
            Self::F32(q, k, v) => l.arg(*q).arg(*k).arg(*v),
            Self::Bf16(..) => l.arg(&NULL).arg(&NULL).arg(&NULL),
        }
    }

    /// Pushes the bf16 q16, k16, v16 of the tensor-core kernels (null for f32 ones).
    pub(super) fn push_bf16<'r, 'l>(&'l self, l: &'r mut LaunchArgs<'l>) -> &'r mut LaunchArgs<'l> {
        match self {
            Self::F32(..) => l.arg(&NULL).arg(&NULL).arg(&NULL),
            Self::Bf16(q, k, v) => l.arg(*q).arg(*k).arg(*v),
        }
    }
}

/// The gradients of q, k and v that [`ModelOps::attention_backward`] overwrites.
pub struct AttentionGrads<'a> {
    /// `∂L/∂q` `[B, T, Hq, D]`.
    pub dq: CudaViewMut<'a, f32>,
    /// `∂L/∂k` `[B, T, Hkv, D]`.
    pub dk: CudaViewMut<'a, f32>,
    /// `∂L/∂v` `[B, T, Hkv, D]`.
    pub dv: CudaViewMut<'a, f32>,
}

/// The gradients the backward kernels write (overwritten).
pub(crate) struct AttentionGradsMut<'a, 'b> {
    /// `∂L/∂q` `[B, T, Hq, D]`.
    pub dq: &'a mut CudaViewMut<'b, f32>,
    /// `∂L/∂k` `[B, T, Hkv, D]`.
    pub dk: &'a mut CudaViewMut<'b, f32>,
    /// `∂L/∂v` `[B, T, Hkv, D]`.
    pub dv: &'a mut CudaViewMut<'b, f32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::MODEL_OPS;

    /// `split_count` and `split_chunk` of model_ops.cu, line for line.
    fn split_plan(key_end: u32) -> (u32, u32) {
        let n = key_end
            .div_ceil(SPLIT_MIN_KEYS as u32)
            .clamp(1, SPLIT_MAX as u32);
        let chunk = key_end.div_ceil(n).div_ceil(KEY_TILE as u32) * KEY_TILE as u32;
        (n, chunk)
    }

    /// The split-K plan: its constants are the kernel's; for every length the chunks are
    /// whole key tiles (the unsplit kernel's tiles), cover the keys once, none empty; one
    /// chunk up to `SPLIT_MIN_KEYS` keys, at most `SPLIT_MAX`.
    #[test]
    fn split_k_chunks_cover_the_keys_once_in_whole_tiles() {
        let src = MODEL_OPS.code;
        assert!(src.contains(&format!("#define SPLIT_MIN_KEYS {SPLIT_MIN_KEYS}\n")));
        assert!(src.contains(&format!("#define SPLIT_MAX {SPLIT_MAX}\n")));
        for key_end in 1..=40_000u32 {
            let (n, chunk) = split_plan(key_end);
            assert!((1..=SPLIT_MAX as u32).contains(&n));
            assert_eq!(n == 1, key_end as usize <= SPLIT_MIN_KEYS, "{key_end}");
            assert_eq!(chunk % KEY_TILE as u32, 0);
            // chunks [i·chunk, min((i+1)·chunk, key_end)) for i < n
            assert!(n * chunk >= key_end, "{key_end}: keys left over");
            assert!((n - 1) * chunk < key_end, "{key_end}: an empty chunk");
        }
    }

    /// The combine's merge of chunk states (m, l, unnormalised sums) is the softmax over all
    /// keys: emulated in f32 with the kernel's steps against an f64 reference.
    #[test]
    fn split_k_merge_is_the_whole_softmax() {
        let mut seed = 7u64;
        let mut unit = || {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for key_end in [513u32, 1000, 3000, 9000] {
            let scores: Vec<f32> = (0..key_end).map(|_| 8.0 * unit()).collect();
            let values: Vec<f32> = (0..key_end).map(|_| unit()).collect();
            let (n, chunk) = split_plan(key_end);
            // each chunk's online state, as the forward leaves it (m, l, Σ p·v)
            let states: Vec<(f32, f32, f32)> = (0..n)
                .map(|i| {
                    let (lo, hi) = (i * chunk, ((i + 1) * chunk).min(key_end));
                    let m = scores[lo as usize..hi as usize]
                        .iter()
                        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let (mut l, mut acc) = (0.0f32, 0.0f32);
                    for s in lo..hi {
                        let p = (scores[s as usize] - m).exp();
                        l += p;
                        acc = p.mul_add(values[s as usize], acc);
                    }
                    (m, l, acc)
                })
                .collect();
            let big = states.iter().fold(f32::NEG_INFINITY, |a, s| a.max(s.0));
            let (mut total, mut acc) = (0.0f32, 0.0f32);
            for &(m, l, a) in &states {
                let w = (m - big).exp();
                total = w.mul_add(l, total);
                acc = w.mul_add(a, acc);
            }
            let got = acc * (1.0 / total);
            let m64 = scores
                .iter()
                .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
            let (mut l64, mut a64) = (0.0f64, 0.0f64);
            for (s, v) in scores.iter().zip(&values) {
                let p = (f64::from(*s) - m64).exp();
                l64 += p;
                a64 += p * f64::from(*v);
            }
            let want = a64 / l64;
            assert!(
                (f64::from(got) - want).abs() <= 1e-5 * want.abs().max(1e-2),
                "{key_end} keys: {got} vs {want}"
            );
        }
    }

    /// The launch geometry here must be the one the kernels were instantiated with.
    #[test]
    fn launch_constants_match_the_kernel_source() {
        let src = MODEL_OPS.code;
        assert!(src.contains(&format!("#define NW {WARPS}\n")), "NW");
        assert!(src.contains(&format!("#define KT {KEY_TILE}\n")), "KT");
        for line in [
            format!("#define MMA_WARPS {MMA_WARPS}\n"),
            format!("#define MMA_ROWS {MMA_ROWS}\n"),
            format!(
                "#define MMA_KEYS {}\n",
                ares_cpu::ops::attention::tensor_core::KEY_TILE
            ),
        ] {
            assert!(src.contains(&line), "missing `{line}` in model_ops.cu");
        }
        assert_eq!(MMA_ROWS, 16 * MMA_WARPS, "16 query rows a warp");
        assert_eq!(BF16_HEAD_DIMS, ares_cpu::ops::attention::BF16_HEAD_DIMS);
        assert!(src.contains(&format!("#define MMA_BWD_TILE {MMA_BWD_TILE}\n")));
        for d in BF16_HEAD_DIMS {
            assert!(
                src.contains(&format!("ATTN_BWD_MMA({d})\n")),
                "ATTN_BWD_MMA({d})"
            );
        }
        // the kernel's carve-up of its dynamic shared memory, in bf16 elements
        for line in [
            "unsigned short* Vb = Kb + MMA_ROWS * KP;",
            "unsigned short* Qs = Vb + MMA_ROWS * KP;",
            "unsigned short* Os = Qs + MMA_BWD_TILE * KP;",
            "unsigned short* Qt = Os + MMA_BWD_TILE * KP;",
            "unsigned short* Ot = Qt + D * RP;",
            "constexpr int KP = D + 8, RP = MMA_BWD_TILE + 8;",
        ] {
            assert!(src.contains(line), "missing `{line}` in model_ops.cu");
        }
        assert_eq!(
            dkv_mma_smem(128),
            2 * (2 * 64 * 136 + 2 * 32 * 136 + 2 * 128 * 40)
        );
        for d in BF16_HEAD_DIMS {
            let line = format!("ATTN_FWD_MMA(attention_fwd_mma_d{d}, {d})");
            assert!(src.contains(&line), "missing `{line}` in model_ops.cu");
        }
        let dpl = [2, 4, 8];
        for (class, d) in [64, 128, 256].iter().enumerate() {
            for (mac, kernel, rw) in [
                ("ATTN_FWD", "attention_fwd", FWD_ROWS_PER_WARP[class]),
                ("ATTN_BWD_DQ", "attention_bwd_dq", DQ_ROWS_PER_WARP[class]),
                (
                    "ATTN_BWD_DKV",
                    "attention_bwd_dkv",
                    DKV_ROWS_PER_WARP[class],
                ),
            ] {
                let line = format!("{mac}({kernel}_d{d}, {}, {rw})", dpl[class]);
                assert!(src.contains(&line), "missing `{line}` in model_ops.cu");
            }
        }
    }

    #[test]
    fn shapes_are_checked_with_named_errors() {
        let ok = AttentionShape {
            batch: 2,
            seq: 3,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.5,
        };
        let d = ok.dims("t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.q_len, d.kv_len, d.lse_len, d.class), (192, 96, 24, 0));
        let msg = |s: AttentionShape| s.dims("t").err().map(|e| e.to_string());
        let bad_group = AttentionShape { kv_heads: 3, ..ok };
        assert!(msg(bad_group).is_some_and(|m| m.contains("not a multiple of kv_heads = 3")));
        let too_wide = AttentionShape {
            head_dim: 320,
            ..ok
        };
        assert!(msg(too_wide).is_some_and(|m| m.contains("head_dim = 320")));
        let no_scale = AttentionShape {
            scale: f32::NAN,
            ..ok
        };
        assert!(msg(no_scale).is_some_and(|m| m.contains("scale")));
        let zero = AttentionShape { q_heads: 0, ..ok };
        assert!(msg(zero).is_some_and(|m| m.contains("q_heads = 0")));
        let huge = AttentionShape {
            batch: usize::MAX,
            ..ok
        };
        assert!(msg(huge).is_some_and(|m| m.contains("overflows")));
        assert_eq!(rows_smem(64, 16, 1), 4 * (2 * 32 * 65 + 16 * 64));
    }
}
