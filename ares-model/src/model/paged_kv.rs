//! [`PagedKv`]: the memory of the rollout engine's paged KV cache — keys and values of
//! every layer in blocks, `[layers, blocks, block_size, kv_heads, head_dim]`, the blocks
//! named by the ids of a [`BlockPool`](super::BlockPool) — in f32 or in bf16
//! ([`KvCacheDtype`]).

use super::{KvCache, ModelError};
use crate::backend::{
    AttentionDims, Backend, BackendError, BlockTables, DType, DeviceBuffer, PagedKvView,
    PagedKvViewMut, Tensor, TensorMut, View, ViewMut,
};

/// The number format of the rollout's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// f32, the model's own keys and values (the default).
    #[default]
    F32,
    /// bf16: each key and value rounded to the nearest bf16 as it is written (half the
    /// memory, so twice the sequences or context in the same pool); the attention widens
    /// them exactly and computes in f32. The sampled tokens then come from a policy a
    /// little off the f32 one that is trained (correct it with `algorithm.rollout_is`).
    Bf16,
}

/// Keys and values of every layer, `[layers, capacity, block_size, kv_dim]` each, and one
/// block's worth of scratch for copies inside them, in the pool's dtype.
enum Pools<B: Backend> {
    F32 {
        k: B::Buffer,
        v: B::Buffer,
        scratch: B::Buffer,
    },
    Bf16 {
        k: B::Half,
        v: B::Half,
        scratch: B::Half,
    },
}

impl<B: Backend> std::fmt::Debug for Pools<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (dtype, len) = match self {
            Self::F32 { k, .. } => ("f32", k.len()),
            Self::Bf16 { k, .. } => ("bf16", k.len()),
        };
        write!(f, "Pools({dtype} × 2 × {len})")
    }
}

impl<B: Backend> Pools<B> {
    /// Pools of `len` elements each (and `scratch` elements of scratch).
    fn alloc(be: &B, dtype: KvCacheDtype, len: usize, scratch: usize) -> Result<Self, ModelError> {
        Ok(match dtype {
            KvCacheDtype::F32 => Self::F32 {
                k: be.alloc(len)?,
                v: be.alloc(len)?,
                scratch: be.alloc(scratch)?,
            },
            KvCacheDtype::Bf16 => Self::Bf16 {
                k: be.alloc_half(len, DType::Bf16)?,
                v: be.alloc_half(len, DType::Bf16)?,
                scratch: be.alloc_half(scratch, DType::Bf16)?,
            },
        })
    }

    /// Copies `n` elements at `from` of `self`'s keys and values to `to` of `dst`'s (which
    /// may be `self`'s own, through the scratch: `dst` `None`).
    fn copy(
        &mut self,
        be: &B,
        dst: Option<&mut Self>,
        from: usize,
        to: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        match (self, dst) {
            (Self::F32 { k, v, .. }, Some(Self::F32 { k: dk, v: dv, .. })) => {
                for (src, dst) in [(&*k, dk), (&*v, dv)] {
                    be.copy(View::new(src, from, n)?, ViewMut::new(dst, to, n)?)?;
                }
            }
            (Self::Bf16 { k, v, .. }, Some(Self::Bf16 { k: dk, v: dv, .. })) => {
                for (src, dst) in [(&*k, dk), (&*v, dv)] {
                    be.copy_bf16(View::new(src, from, n)?, ViewMut::new(dst, to, n)?)?;
                }
            }
            (Self::F32 { k, v, scratch }, None) => {
                for buf in [k, v] {
                    be.copy(View::new(buf, from, n)?, ViewMut::new(scratch, 0, n)?)?;
                    be.copy(View::new(scratch, 0, n)?, ViewMut::new(buf, to, n)?)?;
                }
            }
            (Self::Bf16 { k, v, scratch }, None) => {
                for buf in [k, v] {
                    be.copy_bf16(View::new(buf, from, n)?, ViewMut::new(scratch, 0, n)?)?;
                    be.copy_bf16(View::new(scratch, 0, n)?, ViewMut::new(buf, to, n)?)?;
                }
            }
            (src, Some(dst)) => {
                // (`reserve` allocates the new pools in the old ones' dtype)
                let dtype = |p: &Self| match p {
                    Self::F32 { .. } => DType::F32,
                    Self::Bf16 { .. } => DType::Bf16,
                };
                let (expected, actual) = (dtype(src), dtype(dst));
                return Err(BackendError::DType {
                    op: "copy of KV pools",
                    arg: "dst",
                    expected,
                    actual,
                }
                .into());
            }
        }
        Ok(())
    }
}

/// Keys and values of every layer in blocks, grown (contents kept) to the pool's capacity.
#[derive(Debug)]
pub(crate) struct PagedKv<B: Backend> {
    block_size: usize,
    kv_dim: usize,
    layers: usize,
    dtype: KvCacheDtype,
    /// Blocks allocated in the buffers (the pool's, plus the spare one if any).
    capacity: usize,
    /// One block past the pool's, which padded decode rows write into (`decode_buckets`).
    spare: bool,
    /// How many times the buffers were reallocated (a captured pass reads the current ones).
    generation: u64,
    pools: Pools<B>,
}

impl<B: Backend> PagedKv<B> {
    /// Empty buffers of `dtype` for blocks of `block_size` slots of `layers` layers of
    /// `kv_dim` key (and value) features per token; with `spare`, one block more than the
    /// pool's.
    ///
    /// # Errors
    /// A size that overflows, or a backend allocation failure.
    pub(crate) fn new(
        backend: &B,
        layers: usize,
        kv_dim: usize,
        block_size: usize,
        spare: bool,
        dtype: KvCacheDtype,
    ) -> Result<Self, ModelError> {
        let block_len = block_size
            .checked_mul(kv_dim)
            .ok_or(ModelError::BatchShape {
                batch: layers,
                seq: block_size,
            })?;
        Ok(Self {
            block_size,
            kv_dim,
            layers,
            dtype,
            capacity: 0,
            spare,
            generation: 0,
            pools: Pools::alloc(backend, dtype, 0, block_len)?,
        })
    }

    /// Elements of one layer's keys (or values).
    fn layer_len(&self) -> usize {
        self.capacity * self.block_size * self.kv_dim
    }

    /// Grows the buffers to `blocks` blocks (no-op if they are that big), keeping every
    /// block's contents.
    ///
    /// # Errors
    /// A size that overflows, or a backend failure.
    pub(crate) fn reserve(&mut self, be: &B, blocks: usize) -> Result<(), ModelError> {
        // the spare block moves to the end as the pool grows: its old slot becomes a pool
        // block whose slots are written before they are read, as any reused block's
        let blocks = blocks + usize::from(self.spare);
        if blocks <= self.capacity {
            return Ok(());
        }
        let per_block = self.block_size * self.kv_dim;
        let layer_len = blocks * per_block;
        let total = layer_len
            .checked_mul(self.layers)
            .ok_or(ModelError::BatchShape {
                batch: blocks,
                seq: self.block_size,
            })?;
        let mut grown = Pools::alloc(be, self.dtype, total, per_block)?;
        let old = self.layer_len();
        if old > 0 {
            for layer in 0..self.layers {
                self.pools
                    .copy(be, Some(&mut grown), layer * old, layer * layer_len, old)?;
            }
        }
        self.pools = grown;
        self.capacity = blocks;
        self.generation += 1;
        Ok(())
    }

    /// How many times the buffers were reallocated.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The spare block's id (the last block of the buffers), if there is one and the
    /// buffers hold it.
    pub(crate) fn spare_block(&self) -> Option<u32> {
        if self.spare && self.capacity > 0 {
            u32::try_from(self.capacity - 1).ok()
        } else {
            None
        }
    }

    /// Copies the first `slots` slots of block `src` into block `dst`, every layer.
    ///
    /// # Errors
    /// A block id past the pool, `slots > block_size`, or a backend failure.
    pub(crate) fn copy_block(
        &mut self,
        be: &B,
        src: u32,
        dst: u32,
        slots: usize,
    ) -> Result<(), ModelError> {
        let n = slots * self.kv_dim;
        let per_block = self.block_size * self.kv_dim;
        let layer_len = self.layer_len();
        for layer in 0..self.layers {
            let at = |id: u32| layer * layer_len + id as usize * per_block;
            self.pools.copy(be, None, at(src), at(dst), n)?;
        }
        Ok(())
    }

    /// Copies slots `from..from + count` of sequence `row` of the contiguous f32 `cache` (a
    /// prefill's) into slots `0..count` of the blocks `table`, every layer (rounded to bf16
    /// for a bf16 pool).
    ///
    /// # Errors
    /// A table too short for `count` slots, a cache of another model, or a backend failure.
    pub(crate) fn write_from(
        &mut self,
        be: &B,
        cache: &KvCache<B>,
        row: usize,
        from: usize,
        count: usize,
        table: &[u32],
    ) -> Result<(), ModelError> {
        if count > table.len() * self.block_size || from + count > cache.max_len {
            return Err(ModelError::BatchShape {
                batch: table.len(),
                seq: count,
            });
        }
        let kv = self.kv_dim;
        let layer_len = self.layer_len();
        let per_block = self.block_size * kv;
        let srcs = [cache.keys(), cache.values()];
        for layer in 0..self.layers {
            let src_layer = layer * cache.layer_len() + row * cache.max_len * kv;
            for (c, &id) in table.iter().enumerate() {
                let start = c * self.block_size;
                if start >= count {
                    break;
                }
                let n = (count - start).min(self.block_size) * kv;
                let (from_at, to_at) = (
                    src_layer + (from + start) * kv,
                    layer * layer_len + id as usize * per_block,
                );
                match &mut self.pools {
                    Pools::F32 { k, v, .. } => {
                        for (src, dst) in srcs.into_iter().zip([k, v]) {
                            be.copy(View::new(src, from_at, n)?, ViewMut::new(dst, to_at, n)?)?;
                        }
                    }
                    Pools::Bf16 { k, v, .. } => {
                        for (src, dst) in srcs.into_iter().zip([k, v]) {
                            let dst = ViewMut::new(dst, to_at, n)?;
                            be.round_bf16(View::new(src, from_at, n)?, dst)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Layer `layer`'s attention step over the pool (the paged twin of
    /// [`KvCache::attend`]): appends the new keys and values at each sequence's slots
    /// `len[b]..len[b] + seq` (given by `tables`), then attends `q` over its slots — with
    /// bf16 operands on tensor cores when `tensor_cores` (a prefill chunk in bf16).
    #[allow(clippy::too_many_arguments)] // mirrors Backend::attention's q, k, v, out
    pub(crate) fn attend(
        &mut self,
        be: &B,
        (layer, tensor_cores): (usize, bool),
        dims: AttentionDims,
        q: Tensor<'_, B>,
        k_new: Tensor<'_, B>,
        v_new: Tensor<'_, B>,
        tables: BlockTables<'_, B::Ids>,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let n = self.layer_len();
        // the same two steps in either dtype, through that dtype's pair of ops
        macro_rules! append_then_attend {
            ($k:expr, $v:expr, $append:ident, $attend:ident) => {{
                let (k, v) = ($k, $v);
                let append = PagedKvViewMut {
                    k: ViewMut::item(k, layer, n)?,
                    v: ViewMut::item(v, layer, n)?,
                    blocks: tables,
                };
                be.$append(dims, k_new, v_new, append)?;
                let cache = PagedKvView {
                    k: View::item(k, layer, n)?,
                    v: View::item(v, layer, n)?,
                    blocks: tables,
                };
                be.$attend(dims, q, cache, out)?;
            }};
        }
        match &mut self.pools {
            Pools::F32 { k, v, .. } if tensor_cores => {
                append_then_attend!(k, v, paged_kv_cache_append, paged_attention_prefill_bf16)
            }
            Pools::F32 { k, v, .. } => {
                append_then_attend!(k, v, paged_kv_cache_append, paged_attention_decode)
            }
            Pools::Bf16 { k, v, .. } if tensor_cores => append_then_attend!(
                k,
                v,
                paged_kv_cache_append_bf16,
                paged_attention_prefill_bf16_kv16
            ),
            Pools::Bf16 { k, v, .. } => append_then_attend!(
                k,
                v,
                paged_kv_cache_append_bf16,
                paged_attention_decode_bf16
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// Layers and kv features of the test buffers.
    const LAYERS: usize = 2;
    const KV: usize = 8;

    /// Reads `n` keys at `at` (as f32).
    fn keys(kv: &PagedKv<CpuBackend>, be: &CpuBackend, at: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n];
        match &kv.pools {
            Pools::F32 { k, .. } => be.download(View::new(k, at, n).unwrap(), &mut out).unwrap(),
            Pools::Bf16 { k, .. } => {
                let mut bits = vec![0u16; n];
                be.download_half(View::new(k, at, n).unwrap(), &mut bits)
                    .unwrap();
                for (o, b) in out.iter_mut().zip(bits) {
                    *o = f32::from_bits(u32::from(b) << 16);
                }
            }
        }
        out
    }

    /// Growing keeps every block's contents, and copies between blocks land where asked, in
    /// either dtype (the values are exact in bf16).
    #[test]
    fn growing_and_copying_keep_contents() {
        let be = CpuBackend;
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
            let mut kv = PagedKv::new(&be, LAYERS, KV, 2, false, dtype).unwrap();
            kv.reserve(&be, 1).unwrap();
            let (a, c) = (0u32, 3u32);
            let per_block = 2 * KV;
            for l in 0..LAYERS {
                let at = l * kv.layer_len() + a as usize * per_block;
                let block: Vec<f32> = (0..per_block).map(|i| (l * 64 + i) as f32).collect();
                match &mut kv.pools {
                    Pools::F32 { k, .. } => be
                        .upload(&block, ViewMut::new(k, at, per_block).unwrap())
                        .unwrap(),
                    Pools::Bf16 { k, .. } => {
                        let bits: Vec<u16> =
                            block.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
                        be.upload_half(&bits, ViewMut::new(k, at, per_block).unwrap())
                            .unwrap();
                    }
                }
            }
            kv.reserve(&be, 2).unwrap();
            kv.reserve(&be, 4).unwrap();
            kv.copy_block(&be, a, c, 1).unwrap();
            for l in 0..LAYERS {
                let base = l * kv.layer_len();
                let ka = keys(&kv, &be, base + a as usize * per_block, per_block);
                assert_eq!(ka[1], (l * 64 + 1) as f32, "{dtype:?} layer {l} kept");
                let kc = keys(&kv, &be, base + c as usize * per_block, per_block);
                assert_eq!(kc[..KV], ka[..KV], "{dtype:?} layer {l} first slot copied");
                assert!(kc[KV..].iter().all(|&x| x == 0.0), "only one slot copied");
            }
        }
    }
}
