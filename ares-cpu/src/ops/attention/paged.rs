//! Decode attention over a paged (block) KV cache, as vLLM's PagedAttention lays it out:
//! one pool of `blocks` blocks of `block_size` token slots per layer, keys and values
//! `[blocks, block_size, Hkv, D]`, and per sequence a block table (its blocks in order) and
//! a length. Slot `s` of sequence `b` is row `table[b][s / block_size] · block_size +
//! s % block_size` of the pool. Sequences of any lengths share one call without padding,
//! and a prompt's full blocks can be shared by its samples (the caller copies a shared
//! block before writing into it).
//!
//! The arithmetic is [`attention_decode`](super::attention_decode)'s over the same slots in
//! the same order, so a sequence gets the same output bits paged or contiguous.
//!
//! The pool may hold bf16 instead of f32 ([`paged_kv_cache_append_bf16`],
//! [`paged_attention_decode_bf16`]: half the memory of the rollout's KV cache): new keys and
//! values are rounded to the nearest bf16 (ties to even) as they are written and widened
//! (exactly) as they are read, so the output is the f32 kernel's over the rounded keys and
//! values, bit for bit.

use super::{AttentionShape, Dims, HEADS_AT_ONCE, KeySeq, attend};
use crate::Result;
use crate::error::check_len;
use crate::ops::stored::{Bf16Bits, F32Exact, Widen};
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// One layer's paged KV cache for [`paged_attention_decode`], elements `E`: f32, or bf16
/// bits (`u16`) for [`paged_attention_decode_bf16`].
#[derive(Debug, Clone, Copy)]
pub struct PagedKvCache<'a, E = f32> {
    /// Keys `[blocks, block_size, Hkv, D]`.
    pub k: &'a [E],
    /// Values `[blocks, block_size, Hkv, D]`.
    pub v: &'a [E],
    /// Token slots per block, > 0.
    pub block_size: usize,
    /// Block ids `[B, max_blocks]`: sequence `b`'s blocks in order (entries past its
    /// length are not read).
    pub block_tables: &'a [u32],
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Filled slots per sequence `[B]`, the new queries' keys included.
    pub len: &'a [u32],
}

/// One layer's paged KV cache for [`paged_kv_cache_append`] (f32) or
/// [`paged_kv_cache_append_bf16`] (`E = u16`: bf16 bits); layout as [`PagedKvCache`].
#[derive(Debug)]
pub struct PagedKvCacheMut<'a, E = f32> {
    /// Keys `[blocks, block_size, Hkv, D]`.
    pub k: &'a mut [E],
    /// Values `[blocks, block_size, Hkv, D]`.
    pub v: &'a mut [E],
    /// Token slots per block, > 0.
    pub block_size: usize,
    /// Block ids `[B, max_blocks]`, as [`PagedKvCache::block_tables`].
    pub block_tables: &'a [u32],
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Filled slots per sequence `[B]` before the append: the new tokens go to slots
    /// `len[b]..len[b] + seq` (the caller advances its lengths).
    pub len: &'a [u32],
}

/// Checks a paged cache against the shape: pool lengths a whole number of blocks, one
/// table row and one length per sequence, every slot `..len[b] + extra` inside the table
/// and on a block of the pool. Returns the pool's block count.
#[allow(clippy::too_many_arguments)] // the fields of both cache structs
fn check_paged(
    dims: &Dims,
    k: usize,
    v: usize,
    block_size: usize,
    tables: &[u32],
    max_blocks: usize,
    len: &[u32],
    extra: usize,
) -> Result<usize> {
    let tok = dims.hkv * dims.d;
    let per_block =
        block_size
            .checked_mul(tok)
            .filter(|&n| n > 0)
            .ok_or(CoreError::OutOfRange {
                what: "block_size",
                value: block_size as f64,
                expected: "> 0",
            })?;
    let blocks = k / per_block;
    check_len("k_cache", blocks * per_block, k)?;
    check_len("v_cache", k, v)?;
    check_len("block_tables", dims.b * max_blocks, tables.len())?;
    check_len("cache_len", dims.b, len.len())?;
    for (b, &n) in len.iter().enumerate() {
        let end = n as usize + extra;
        if end > max_blocks * block_size {
            return Err(CoreError::OutOfRange {
                what: "cache_len",
                value: end as f64,
                expected: "within the sequence's block table (max_blocks · block_size slots)",
            }
            .into());
        }
        let used = end.div_ceil(block_size);
        if let Some(&id) = tables[b * max_blocks..b * max_blocks + used]
            .iter()
            .find(|&&id| id as usize >= blocks)
        {
            return Err(CoreError::OutOfRange {
                what: "block_tables",
                value: f64::from(id),
                expected: "a block id below the pool's block count",
            }
            .into());
        }
    }
    Ok(blocks)
}

/// Appends `seq` new tokens per sequence to a paged KV cache: `k_new[b, i]` (and v) goes
/// to slot `len[b] + i` of sequence `b`. `k_new`, `v_new` are `[B, seq, Hkv, D]`. Two
/// sequences must not own the same block at the slots written (the caller copies a shared
/// block first).
///
/// # Errors
/// As [`attention_decode`](super::attention_decode) for the shape; `block_size` 0; pool,
/// table and length sizes; a slot past the table or a block id past the pool. Nothing is
/// written on error.
pub fn paged_kv_cache_append(
    shape: &AttentionShape,
    k_new: &[f32],
    v_new: &[f32],
    cache: PagedKvCacheMut<'_>,
) -> Result<()> {
    append::<F32Exact>(shape, k_new, v_new, cache)
}

/// [`paged_kv_cache_append`] into a bf16 pool: each new key and value rounded to the
/// nearest bf16 (ties to even, as `torch.Tensor.bfloat16`).
///
/// # Errors
/// As [`paged_kv_cache_append`].
pub fn paged_kv_cache_append_bf16(
    shape: &AttentionShape,
    k_new: &[f32],
    v_new: &[f32],
    cache: PagedKvCacheMut<'_, u16>,
) -> Result<()> {
    append::<Bf16Bits>(shape, k_new, v_new, cache)
}

fn append<W: Widen>(
    shape: &AttentionShape,
    k_new: &[f32],
    v_new: &[f32],
    cache: PagedKvCacheMut<'_, W::Elem>,
) -> Result<()> {
    let dims = shape.dims()?;
    check_len("k_new", dims.kv_len, k_new.len())?;
    check_len("v_new", dims.kv_len, v_new.len())?;
    let PagedKvCacheMut {
        k,
        v,
        block_size,
        block_tables,
        max_blocks,
        len,
    } = cache;
    check_paged(
        &dims,
        k.len(),
        v.len(),
        block_size,
        block_tables,
        max_blocks,
        len,
        dims.t,
    )?;
    let tok = dims.hkv * dims.d;
    for (b, &n) in len.iter().enumerate() {
        let table = &block_tables[b * max_blocks..(b + 1) * max_blocks];
        for i in 0..dims.t {
            let s = n as usize + i;
            let row = table[s / block_size] as usize * block_size + s % block_size;
            let src = (b * dims.t + i) * tok;
            for (dst, new) in [(&mut *k, k_new), (&mut *v, v_new)] {
                for (d, &x) in dst[row * tok..(row + 1) * tok]
                    .iter_mut()
                    .zip(&new[src..src + tok])
                {
                    *d = W::narrow(x);
                }
            }
        }
    }
    Ok(())
}

/// Attention of `seq` new queries per sequence over a paged KV cache that holds their keys
/// already ([`paged_kv_cache_append`] first): query `i` of sequence `b` sits at slot
/// `len[b] − seq + i` and attends every slot at or before it. `q` and `out` are `[B, seq,
/// Hq, D]`. Equals [`attention_decode`](super::attention_decode) over the same keys laid
/// out contiguously, bit for bit.
///
/// # Errors
/// As [`paged_kv_cache_append`], and a `len[b]` below `seq`.
pub fn paged_attention_decode(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_>,
    out: &mut [f32],
) -> Result<()> {
    decode::<F32Exact>(shape, q, cache, out)
}

/// [`paged_attention_decode`] over a bf16 pool ([`paged_kv_cache_append_bf16`]): the
/// bits of the f32 kernel over the same (rounded) keys and values.
///
/// # Errors
/// As [`paged_attention_decode`].
pub fn paged_attention_decode_bf16(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_, u16>,
    out: &mut [f32],
) -> Result<()> {
    decode::<Bf16Bits>(shape, q, cache, out)
}

/// [`paged_attention_decode`] with bf16 operands, as the CUDA tensor-core kernel computes
/// a prefill chunk over a paged cache (`paged_attention_fwd_mma_*` in `model_ops.cu`): the
/// twin of [`super::attention_forward_bf16`] for queries at slots `len[b] − seq ..` over
/// every slot up to their own. q and every key and value are rounded to bf16 (nearest
/// even; an f32 pool's as they are read), keys in tiles of
/// [`KEY_TILE`](super::tensor_core::KEY_TILE) from slot 0, the arithmetic of
/// [`super::tensor_core`]: a query row's numbers are those of the same row in the training
/// forward over the whole sequence (`attention_forward_bf16`), bit for bit.
///
/// # Errors
/// As [`paged_attention_decode`].
pub fn paged_attention_prefill_bf16(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_>,
    out: &mut [f32],
) -> Result<()> {
    prefill::<F32Exact>(shape, q, cache, out)
}

/// [`paged_attention_prefill_bf16`] over a bf16 pool ([`paged_kv_cache_append_bf16`]): its
/// keys and values are bf16 already, so the rounding leaves them as they are.
///
/// # Errors
/// As [`paged_attention_decode`].
pub fn paged_attention_prefill_bf16_kv16(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_, u16>,
    out: &mut [f32],
) -> Result<()> {
    prefill::<Bf16Bits>(shape, q, cache, out)
}

/// The checks both paged attentions make: the shape, `q` and `out`, the cache, and every
/// length at least the queries a sequence (their keys appended first).
fn check_attend<E>(dims: &Dims, q: &[f32], cache: &PagedKvCache<'_, E>, out: &[f32]) -> Result<()> {
    check_len("q", dims.q_len, q.len())?;
    check_len("out", dims.q_len, out.len())?;
    let c = cache;
    let (k, v) = (c.k.len(), c.v.len());
    check_paged(
        dims,
        k,
        v,
        c.block_size,
        c.block_tables,
        c.max_blocks,
        c.len,
        0,
    )?;
    if let Some(&n) = c.len.iter().find(|&&n| (n as usize) < dims.t) {
        return Err(CoreError::OutOfRange {
            what: "cache_len",
            value: f64::from(n),
            expected: ">= queries per sequence (append the new keys first)",
        }
        .into());
    }
    Ok(())
}

fn prefill<W: Widen>(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_, W::Elem>,
    out: &mut [f32],
) -> Result<()> {
    use super::tensor_core::{Keys, Queries, rows_forward};
    let dims = shape.dims()?;
    check_attend(&dims, q, &cache, out)?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let Dims { t, hkv, d, hq, .. } = dims;
    let tok = hkv * d;
    let bf16 = crate::ops::precision::MatmulPrecision::Bf16;
    let q = bf16.rounded(q);
    // each sequence's slots, in order and rounded: the key rows the kernel stages
    let gathered: Vec<(Vec<f32>, Vec<f32>)> = (0..dims.b)
        .into_par_iter()
        .map(|b| {
            let n = cache.len[b] as usize;
            let table = &cache.block_tables[b * cache.max_blocks..(b + 1) * cache.max_blocks];
            let (mut k, mut v) = (Vec::with_capacity(n * tok), Vec::with_capacity(n * tok));
            for s in 0..n {
                let row =
                    table[s / cache.block_size] as usize * cache.block_size + s % cache.block_size;
                let (from, to) = (row * tok, (row + 1) * tok);
                k.extend(cache.k[from..to].iter().map(|&e| W::widen(e)));
                v.extend(cache.v[from..to].iter().map(|&e| W::widen(e)));
            }
            (bf16.rounded(&k).into_owned(), bf16.rounded(&v).into_owned())
        })
        .collect();
    let ones = vec![
        1.0f32;
        gathered
            .iter()
            .map(|g| g.0.len() / tok.max(1))
            .max()
            .unwrap_or(0)
    ];
    // tasks of up to 64 queries of one sequence, in the order of `out`
    let block = super::tensor_core::KEY_TILE;
    let tasks: Vec<(usize, usize)> = (0..dims.b)
        .flat_map(|b| (0..t).step_by(block).map(move |t0| (b, t0)))
        .collect();
    let mut pieces = Vec::with_capacity(tasks.len());
    let mut rest = &mut out[..];
    for &(_, t0) in &tasks {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(block.min(t - t0) * hq * d);
        pieces.push(piece);
        rest = tail;
    }
    tasks.into_par_iter().zip(pieces).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(tile, state), ((b, t0), o)| {
            let (k, v) = (&gathered[b].0, &gathered[b].1);
            let rows = block.min(t - t0);
            let queries = Queries {
                q: &q,
                at: b * t + t0,
                rows,
                pos: cache.len[b] as usize - t + t0,
            };
            let keys = Keys { k, v, at: 0 };
            rows_forward(&dims, queries, keys, &ones, (tile, state), o, &mut [])
        },
    )
}

fn decode<W: Widen>(
    shape: &AttentionShape,
    q: &[f32],
    cache: PagedKvCache<'_, W::Elem>,
    out: &mut [f32],
) -> Result<()> {
    let dims = shape.dims()?;
    check_attend(&dims, q, &cache, out)?;
    let PagedKvCache {
        k,
        v,
        block_size,
        block_tables,
        max_blocks,
        len,
    } = cache;
    if dims.q_len == 0 {
        return Ok(());
    }
    let longest = len.iter().map(|&n| n as usize).max().unwrap_or(0);
    let Dims {
        t, hkv, d, group, ..
    } = dims;
    // one task per position and kv head: its `group` query heads share one pass over the keys
    out.par_chunks_mut(group * d)
        .zip(q.par_chunks(group * d))
        .enumerate()
        .for_each_init(
            || vec![0.0f32; group.min(HEADS_AT_ONCE) * longest],
            |scores, (i, (o, qs))| {
                let (row, g) = (i / hkv, i % hkv);
                let (b, j) = (row / t, row % t);
                let n = len.get(b).map_or(0, |&n| n as usize + j + 1 - t);
                let table = block_tables
                    .get(b * max_blocks..(b + 1) * max_blocks)
                    .unwrap_or_default();
                let keys = KeySeq::<W>::paged(&dims, k, v, table, block_size);
                attend(qs, keys, g, n, dims.scale, scores, o);
            },
        );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{KvCache, KvCacheMut, attention_decode, kv_cache_append};
    use super::*;

    /// A deterministic pseudo-random vector.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The tensor-core twin of a prefill chunk over a paged cache: each query's output is
    /// the bits of the same row of the training twin (`attention_forward_bf16`) over the
    /// whole sequence — two sequences (earlier slots 70 and 3, chunks of 100 queries: several
    /// key tiles, a tile boundary inside the chunk) in a scrambled pool, f32 and bf16 pools
    /// (the bf16 pool holding the rounded keys, which the twin rounds anyway).
    #[test]
    fn paged_prefill_twin_is_the_training_twin_row_for_row() {
        let (hq, hkv, d, bs, chunk) = (4, 2, 16, 16, 100);
        let tok = hkv * d;
        let before = [70usize, 3];
        let total: Vec<usize> = before.iter().map(|&n| n + chunk).collect();
        let max_blocks = 12;
        let blocks = 24;
        // block ids handed out backwards and interleaved between the sequences
        let mut tables = vec![0u32; 2 * max_blocks];
        for c in 0..max_blocks {
            for s in 0..2 {
                tables[s * max_blocks + c] = (blocks - 1 - (2 * c + s)) as u32;
            }
        }
        let whole: Vec<[Vec<f32>; 3]> = (0..2)
            .map(|s| {
                let n = total[s];
                let seed = 40 + 3 * s as u32;
                [
                    values(n * hq * d, seed),
                    values(n * tok, seed + 1),
                    values(n * tok, seed + 2),
                ]
            })
            .collect();
        let mut pk = vec![0.0f32; blocks * bs * tok];
        let mut pv = pk.clone();
        let mut pk16 = vec![0u16; blocks * bs * tok];
        let mut pv16 = pk16.clone();
        let lens: Vec<u32> = total.iter().map(|&n| n as u32).collect();
        let mut q = Vec::new();
        let mut want = Vec::new();
        for (s, [qs, k, v]) in whole.iter().enumerate() {
            let n = total[s];
            let one = AttentionShape::new(1, n, hq, hkv, d);
            let table = &tables[s * max_blocks..(s + 1) * max_blocks];
            let full = PagedKvCacheMut {
                k: &mut pk[..],
                v: &mut pv[..],
                block_size: bs,
                block_tables: table,
                max_blocks,
                len: &[0],
            };
            paged_kv_cache_append(&one, k, v, full).unwrap();
            let half = PagedKvCacheMut {
                k: &mut pk16[..],
                v: &mut pv16[..],
                block_size: bs,
                block_tables: table,
                max_blocks,
                len: &[0],
            };
            paged_kv_cache_append_bf16(&one, k, v, half).unwrap();
            // the training twin over the whole sequence; its last `chunk` rows are wanted
            let mut out = vec![0.0f32; n * hq * d];
            let mut lse = vec![0.0f32; n * hq];
            let inputs = super::super::AttentionInputs {
                q: qs,
                k,
                v,
                key_mask: None,
                segments: None,
            };
            super::super::attention_forward_bf16(&one, inputs, &mut out, &mut lse).unwrap();
            want.extend_from_slice(&out[before[s] * hq * d..]);
            q.extend_from_slice(&qs[before[s] * hq * d..]);
        }
        let shape = AttentionShape::new(2, chunk, hq, hkv, d);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut out = vec![f32::NAN; want.len()];
        let cache = PagedKvCache {
            k: &pk,
            v: &pv,
            block_size: bs,
            block_tables: &tables,
            max_blocks,
            len: &lens,
        };
        paged_attention_prefill_bf16(&shape, &q, cache, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&want), "f32 pool");
        let mut out16 = vec![f32::NAN; want.len()];
        let cache16 = PagedKvCache {
            k: &pk16,
            v: &pv16,
            block_size: bs,
            block_tables: &tables,
            max_blocks,
            len: &lens,
        };
        paged_attention_prefill_bf16_kv16(&shape, &q, cache16, &mut out16).unwrap();
        assert_eq!(bits(&out16), bits(&want), "bf16 pool");
        // a length below the chunk is refused, as the decode refuses it
        let short = [lens[0], 50];
        let bad = PagedKvCache {
            len: &short,
            ..cache
        };
        assert!(paged_attention_prefill_bf16(&shape, &q, bad, &mut out).is_err());
    }

    /// Three sequences of different lengths over a shuffled pool (blocks of 4 slots) give
    /// the bits of the contiguous cache, for one new query and for a chunk of three.
    #[test]
    fn paged_equals_contiguous_bit_for_bit() {
        let (hq, hkv, d, bs) = (4, 2, 8, 4);
        let tok = hkv * d;
        let lens = [5usize, 12, 1];
        let max_len = 16usize;
        for new in [1usize, 3] {
            let b = lens.len();
            let total: Vec<usize> = lens.iter().map(|&n| n + new).collect();
            let max_blocks = max_len.div_ceil(bs);
            // blocks handed out in a scrambled order, as a pool after many cycles would
            let order = [7u32, 2, 9, 0, 11, 4, 1, 10, 3, 6, 5, 8];
            let mut tables = vec![0u32; b * max_blocks];
            let mut next = 0;
            for (s, &n) in total.iter().enumerate() {
                for c in 0..n.div_ceil(bs) {
                    tables[s * max_blocks + c] = order[next];
                    next += 1;
                }
            }
            let blocks = 12;
            let mut pk = vec![0.0f32; blocks * bs * tok];
            let mut pv = pk.clone();
            let mut ck = vec![0.0f32; b * max_len * tok];
            let mut cv = ck.clone();
            // each sequence's history, then the new tokens of all at once
            for (s, &n) in lens.iter().enumerate() {
                let one = AttentionShape::new(1, n, hq, hkv, d);
                let (k, v) = (
                    values(n * tok, 10 + s as u32),
                    values(n * tok, 20 + s as u32),
                );
                let table = &tables[s * max_blocks..(s + 1) * max_blocks];
                paged_kv_cache_append(
                    &one,
                    &k,
                    &v,
                    PagedKvCacheMut {
                        k: &mut pk,
                        v: &mut pv,
                        block_size: bs,
                        block_tables: table,
                        max_blocks,
                        len: &[0],
                    },
                )
                .unwrap();
                let slab = max_len * tok;
                let mut l = [0usize];
                kv_cache_append(
                    &one,
                    &k,
                    &v,
                    KvCacheMut {
                        k: &mut ck[s * slab..(s + 1) * slab],
                        v: &mut cv[s * slab..(s + 1) * slab],
                        max_len,
                        len: &mut l,
                    },
                )
                .unwrap();
            }
            let shape = AttentionShape::new(b, new, hq, hkv, d);
            let (k_new, v_new) = (values(b * new * tok, 3), values(b * new * tok, 4));
            let before: Vec<u32> = lens.iter().map(|&n| n as u32).collect();
            paged_kv_cache_append(
                &shape,
                &k_new,
                &v_new,
                PagedKvCacheMut {
                    k: &mut pk,
                    v: &mut pv,
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &before,
                },
            )
            .unwrap();
            let mut ragged = lens.to_vec();
            kv_cache_append(
                &shape,
                &k_new,
                &v_new,
                KvCacheMut {
                    k: &mut ck,
                    v: &mut cv,
                    max_len,
                    len: &mut ragged,
                },
            )
            .unwrap();
            let q = values(b * new * hq * d, 5);
            let after: Vec<u32> = total.iter().map(|&n| n as u32).collect();
            let mut paged = vec![0.0f32; q.len()];
            paged_attention_decode(
                &shape,
                &q,
                PagedKvCache {
                    k: &pk,
                    v: &pv,
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &after,
                },
                &mut paged,
            )
            .unwrap();
            let mut contiguous = vec![0.0f32; q.len()];
            attention_decode(
                &shape,
                &q,
                KvCache {
                    k: &ck,
                    v: &cv,
                    max_len,
                    len: &total,
                    key_mask: None,
                },
                &mut contiguous,
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&paged), bits(&contiguous), "new = {new}");
            assert!(paged.iter().any(|&x| x != 0.0));
        }
    }

    /// A bf16 pool holds each appended key and value rounded to nearest even, and attends
    /// as the f32 pool holding those rounded values does, bit for bit (one query, and a
    /// chunk of three; heads 64 wide so the 8-key dot products run on AVX2/AVX-512).
    #[test]
    fn bf16_pool_attends_as_f32_over_the_rounded_values() {
        let (hq, hkv, d, bs) = (6, 2, 64, 4);
        let tok = hkv * d;
        let lens = [9usize, 30, 2];
        for new in [1usize, 3] {
            let b = lens.len();
            let max_blocks = 40usize.div_ceil(bs);
            let mut tables = vec![0u32; b * max_blocks];
            let blocks = b * max_blocks;
            // sequence s owns blocks s, s + 3, s + 6, …: interleaved in the pool
            for (s, row) in tables.chunks_exact_mut(max_blocks).enumerate() {
                for (c, id) in row.iter_mut().enumerate() {
                    *id = (c * b + s) as u32;
                }
            }
            let mut f32_pool = [
                vec![0.0f32; blocks * bs * tok],
                vec![0.0f32; blocks * bs * tok],
            ];
            let mut bf16_pool = [vec![0u16; blocks * bs * tok], vec![0u16; blocks * bs * tok]];
            for (step, (n, len)) in [
                (lens.iter().max().copied().unwrap_or(0), None),
                (new, Some(&lens)),
            ]
            .into_iter()
            .enumerate()
            {
                // first every sequence's history (padded to the longest), then the new tokens
                let before: Vec<u32> = match len {
                    None => vec![0; b],
                    Some(l) => l.iter().map(|&n| n as u32).collect(),
                };
                let shape = AttentionShape::new(b, n, hq, hkv, d);
                let mut k_new = values(b * n * tok, 30 + step as u32);
                let v_new = values(b * n * tok, 40 + step as u32);
                k_new[1] = f32::from_bits(0x3f80_8000); // a tie: rounds to even (1.0)
                let rounded = |x: &[f32]| -> Vec<f32> {
                    x.iter()
                        .map(|&v| Bf16Bits::widen(Bf16Bits::narrow(v)))
                        .collect()
                };
                let [fk, fv] = &mut f32_pool;
                paged_kv_cache_append(
                    &shape,
                    &rounded(&k_new),
                    &rounded(&v_new),
                    PagedKvCacheMut {
                        k: fk,
                        v: fv,
                        block_size: bs,
                        block_tables: &tables,
                        max_blocks,
                        len: &before,
                    },
                )
                .unwrap();
                let [hk, hv] = &mut bf16_pool;
                paged_kv_cache_append_bf16(
                    &shape,
                    &k_new,
                    &v_new,
                    PagedKvCacheMut {
                        k: hk,
                        v: hv,
                        block_size: bs,
                        block_tables: &tables,
                        max_blocks,
                        len: &before,
                    },
                )
                .unwrap();
            }
            let widened: Vec<Vec<f32>> = bf16_pool
                .iter()
                .map(|p| p.iter().map(|&x| Bf16Bits::widen(x)).collect())
                .collect();
            assert_eq!(widened[0], f32_pool[0], "keys stored rounded");
            assert_eq!(widened[1], f32_pool[1], "values stored rounded");
            assert!(bf16_pool[0].contains(&0x3f80), "the tie rounded to even");
            let shape = AttentionShape::new(b, new, hq, hkv, d);
            let q = values(b * new * hq * d, 50);
            let after: Vec<u32> = lens.iter().map(|&n| (n + new) as u32).collect();
            let mut want = vec![0.0f32; q.len()];
            paged_attention_decode(
                &shape,
                &q,
                PagedKvCache {
                    k: &f32_pool[0],
                    v: &f32_pool[1],
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &after,
                },
                &mut want,
            )
            .unwrap();
            let mut got = vec![0.0f32; q.len()];
            paged_attention_decode_bf16(
                &shape,
                &q,
                PagedKvCache {
                    k: &bf16_pool[0],
                    v: &bf16_pool[1],
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &after,
                },
                &mut got,
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "new = {new}");
            assert!(got.iter().any(|&x| x != 0.0));
        }
    }

    #[test]
    fn bad_tables_and_lengths_are_named() {
        let shape = AttentionShape::new(1, 1, 2, 1, 4);
        let pool = vec![0.0f32; 2 * 4 * 4]; // two blocks of four slots
        let q = [0.5f32; 8];
        let mut out = [0.0f32; 8];
        let call = |tables: &[u32], len: u32, bs: usize, out: &mut [f32]| {
            paged_attention_decode(
                &shape,
                &q,
                PagedKvCache {
                    k: &pool,
                    v: &pool,
                    block_size: bs,
                    block_tables: tables,
                    max_blocks: 2,
                    len: &[len],
                },
                out,
            )
            .unwrap_err()
            .to_string()
        };
        assert!(call(&[0, 5], 6, 4, &mut out).contains("block_tables"));
        assert!(call(&[0, 1], 9, 4, &mut out).contains("cache_len"));
        assert!(call(&[0, 1], 0, 4, &mut out).contains("cache_len"));
        assert!(call(&[0, 1], 2, 0, &mut out).contains("block_size"));
        assert!(call(&[0], 2, 4, &mut out).contains("block_tables"));
        // the right call works and reads only the first block's two slots
        paged_attention_decode(
            &shape,
            &q,
            PagedKvCache {
                k: &pool,
                v: &pool,
                block_size: 4,
                block_tables: &[1, 7],
                max_blocks: 2,
                len: &[2],
            },
            &mut out,
        )
        .unwrap();
    }
}
