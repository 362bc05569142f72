//! [`PagedKv`]: the memory of the rollout engine's paged KV cache — keys and values of
//! every layer in blocks, `[layers, blocks, block_size, kv_heads, head_dim]`, the blocks
//! named by the ids of a [`BlockPool`](super::BlockPool).

use super::{KvCache, ModelError};
use crate::backend::{
    AttentionDims, Backend, BlockTables, PagedKvView, PagedKvViewMut, Tensor, TensorMut, View,
    ViewMut,
};

/// Keys and values of every layer in blocks, grown (contents kept) to the pool's capacity.
#[derive(Debug)]
pub(crate) struct PagedKv<B: Backend> {
    block_size: usize,
    kv_dim: usize,
    layers: usize,
    /// Blocks allocated in the buffers (the pool's, plus the spare one if any).
    capacity: usize,
    /// One block past the pool's, which padded decode rows write into (`decode_buckets`).
    spare: bool,
    /// How many times the buffers were reallocated (a captured pass reads the current ones).
    generation: u64,
    /// `[layers, capacity, block_size, kv_dim]`.
    k: B::Buffer,
    v: B::Buffer,
    /// One block's keys or values of one layer, for copies inside the buffers.
    scratch: B::Buffer,
}

impl<B: Backend> PagedKv<B> {
    /// Empty buffers for blocks of `block_size` slots of `layers` layers of `kv_dim` key
    /// (and value) features per token; with `spare`, one block more than the pool's.
    ///
    /// # Errors
    /// A size that overflows, or a backend allocation failure.
    pub(crate) fn new(
        backend: &B,
        layers: usize,
        kv_dim: usize,
        block_size: usize,
        spare: bool,
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
            capacity: 0,
            spare,
            generation: 0,
            k: backend.alloc(0)?,
            v: backend.alloc(0)?,
            scratch: backend.alloc(block_len)?,
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
        let (mut k, mut v) = (be.alloc(total)?, be.alloc(total)?);
        let old = self.layer_len();
        if old > 0 {
            for layer in 0..self.layers {
                for (src, dst) in [(&self.k, &mut k), (&self.v, &mut v)] {
                    be.copy(
                        View::new(src, layer * old, old)?,
                        ViewMut::new(dst, layer * layer_len, old)?,
                    )?;
                }
            }
        }
        self.k = k;
        self.v = v;
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
            for buf in [&mut self.k, &mut self.v] {
                be.copy(
                    View::new(buf, at(src), n)?,
                    ViewMut::new(&mut self.scratch, 0, n)?,
                )?;
                be.copy(
                    View::new(&self.scratch, 0, n)?,
                    ViewMut::new(buf, at(dst), n)?,
                )?;
            }
        }
        Ok(())
    }

    /// Copies slots `from..from + count` of sequence `row` of the contiguous `cache` (a
    /// prefill's) into slots `0..count` of the blocks `table`, every layer.
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
        for layer in 0..self.layers {
            for (src, dst) in [(cache.keys(), &mut self.k), (cache.values(), &mut self.v)] {
                let src_layer = layer * cache.layer_len() + row * cache.max_len * kv;
                for (c, &id) in table.iter().enumerate() {
                    let start = c * self.block_size;
                    if start >= count {
                        break;
                    }
                    let n = (count - start).min(self.block_size) * kv;
                    be.copy(
                        View::new(src, src_layer + (from + start) * kv, n)?,
                        ViewMut::new(dst, layer * layer_len + id as usize * per_block, n)?,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Layer `layer`'s attention step over the pool (the paged twin of
    /// [`KvCache::attend`]): appends the new keys and values at each sequence's slots
    /// `len[b]..len[b] + seq` (given by `tables`), then attends `q` over its slots.
    #[allow(clippy::too_many_arguments)] // mirrors Backend::attention's q, k, v, out
    pub(crate) fn attend(
        &mut self,
        be: &B,
        layer: usize,
        dims: AttentionDims,
        q: Tensor<'_, B>,
        k_new: Tensor<'_, B>,
        v_new: Tensor<'_, B>,
        tables: BlockTables<'_, B::Ids>,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let n = self.layer_len();
        be.paged_kv_cache_append(
            dims,
            k_new,
            v_new,
            PagedKvViewMut {
                k: ViewMut::item(&mut self.k, layer, n)?,
                v: ViewMut::item(&mut self.v, layer, n)?,
                blocks: tables,
            },
        )?;
        be.paged_attention_decode(
            dims,
            q,
            PagedKvView {
                k: View::item(&self.k, layer, n)?,
                v: View::item(&self.v, layer, n)?,
                blocks: tables,
            },
            out,
        )?;
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

    /// Growing keeps every block's contents, and copies between blocks land where asked.
    #[test]
    fn growing_and_copying_keep_contents() {
        let be = CpuBackend;
        let mut kv = PagedKv::new(&be, LAYERS, KV, 2, false).unwrap();
        kv.reserve(&be, 1).unwrap();
        let (a, c) = (0u32, 3u32);
        let per_block = 2 * KV;
        for l in 0..LAYERS {
            let at = l * kv.layer_len() + a as usize * per_block;
            for (i, x) in kv.k[at..at + per_block].iter_mut().enumerate() {
                *x = (l * 1000 + i) as f32;
            }
        }
        kv.reserve(&be, 2).unwrap();
        kv.reserve(&be, 4).unwrap();
        kv.copy_block(&be, a, c, 1).unwrap();
        for l in 0..LAYERS {
            let base = l * kv.layer_len();
            let ka = &kv.k[base + a as usize * per_block..][..per_block];
            assert_eq!(ka[1], (l * 1000 + 1) as f32, "layer {l} kept");
            let kc = &kv.k[base + c as usize * per_block..][..per_block];
            assert_eq!(kc[..KV], ka[..KV], "layer {l} first slot copied");
            assert!(kc[KV..].iter().all(|&x| x == 0.0), "only one slot copied");
        }
    }
}
