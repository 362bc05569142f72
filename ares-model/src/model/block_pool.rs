//! [`BlockPool`]: the paged KV cache of the rollout engine (vLLM's PagedAttention layout).
//!
//! Keys and values live in blocks of `block_size` token slots, `[layers, blocks,
//! block_size, kv_heads, head_dim]`; a sequence owns a list of blocks (its block table),
//! so its memory grows a block at a time with its tokens and returns to the pool when it
//! ends, whatever the other sequences do. Blocks are reference-counted: the full blocks of
//! a prompt prefilled once are shared by its samples (a sample never writes into them: its
//! next token goes to a block it owns alone).
//!
//! The buffers start small and double when the free blocks run out, up to the budget
//! (`max_blocks`), so memory follows the live tokens rather than `batch × max_len`.

use super::{KvCache, ModelError};
use crate::backend::{
    AttentionDims, Backend, BlockTables, PagedKvView, PagedKvViewMut, Tensor, TensorMut, View,
    ViewMut,
};

/// Reference-counted KV blocks of every layer, grown on demand up to a budget.
#[derive(Debug)]
pub struct BlockPool<B: Backend> {
    block_size: usize,
    kv_dim: usize,
    layers: usize,
    /// The budget: blocks the pool may grow to.
    max_blocks: usize,
    /// Blocks allocated in the buffers.
    capacity: usize,
    /// `[layers, capacity, block_size, kv_dim]`.
    k: B::Buffer,
    v: B::Buffer,
    /// One block's keys or values of one layer, for copies inside the pool.
    scratch: B::Buffer,
    /// Owners of each allocated block (0: free).
    refs: Vec<u32>,
    /// Free block ids, the lowest last (handed out first).
    free: Vec<u32>,
}

impl<B: Backend> BlockPool<B> {
    /// A pool of `initial` blocks (at least 1) of `block_size` slots for `layers` layers of
    /// `kv_dim` key (and value) features per token, growing up to `max_blocks`.
    ///
    /// # Errors
    /// `block_size` 0, `max_blocks < initial`, a size that overflows or ids past `u32`, or
    /// a backend allocation failure.
    pub fn new(
        backend: &B,
        layers: usize,
        kv_dim: usize,
        block_size: usize,
        initial: usize,
        max_blocks: usize,
    ) -> Result<Self, ModelError> {
        let initial = initial.max(1);
        if block_size == 0 || max_blocks < initial || max_blocks > u32::MAX as usize {
            return Err(ModelError::BatchShape {
                batch: max_blocks,
                seq: block_size,
            });
        }
        let block_len = block_size
            .checked_mul(kv_dim)
            .ok_or(ModelError::BatchShape {
                batch: max_blocks,
                seq: block_size,
            })?;
        let mut pool = Self {
            block_size,
            kv_dim,
            layers,
            max_blocks,
            capacity: 0,
            k: backend.alloc(0)?,
            v: backend.alloc(0)?,
            scratch: backend.alloc(block_len)?,
            refs: Vec::new(),
            free: Vec::new(),
        };
        pool.grow(backend, initial)?;
        Ok(pool)
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks owned by at least one sequence or prefix.
    pub fn in_use(&self) -> usize {
        self.capacity - self.free.len()
    }

    /// Blocks that can still be handed out (free now, or by growing to the budget).
    pub fn available(&self) -> usize {
        self.free.len() + (self.max_blocks - self.capacity)
    }

    /// Blocks allocated in the buffers (the memory held).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The budget.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Owners of block `id`.
    pub fn refs(&self, id: u32) -> u32 {
        self.refs.get(id as usize).copied().unwrap_or(0)
    }

    /// Elements of one layer's keys (or values).
    fn layer_len(&self) -> usize {
        self.capacity * self.block_size * self.kv_dim
    }

    /// Grows the buffers to `blocks` blocks (no-op if they are that big), keeping every
    /// block's contents.
    fn grow(&mut self, be: &B, blocks: usize) -> Result<(), ModelError> {
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
        // new ids pushed highest first, so the lowest is handed out next
        self.free
            .extend((self.capacity as u32..blocks as u32).rev());
        self.refs.resize(blocks, 0);
        self.capacity = blocks;
        Ok(())
    }

    /// A free block for one owner, growing the buffers (doubling, up to the budget) when
    /// none is free; `None` when the budget is used up.
    ///
    /// # Errors
    /// A backend failure while growing.
    pub fn alloc(&mut self, be: &B) -> Result<Option<u32>, ModelError> {
        if self.free.is_empty() && self.capacity < self.max_blocks {
            let target = (self.capacity * 2).clamp(self.capacity + 1, self.max_blocks);
            self.grow(be, target)?;
        }
        Ok(self.free.pop().inspect(|&id| self.refs[id as usize] = 1))
    }

    /// One more owner of block `id` (a sample sharing its prompt's block).
    pub fn retain(&mut self, id: u32) {
        if let Some(r) = self.refs.get_mut(id as usize) {
            debug_assert!(*r > 0, "retain of free block {id}");
            *r += 1;
        }
    }

    /// One owner fewer of block `id`; the last one returns it to the pool.
    pub fn release(&mut self, id: u32) {
        if let Some(r) = self.refs.get_mut(id as usize) {
            debug_assert!(*r > 0, "release of free block {id}");
            *r = r.saturating_sub(1);
            if *r == 0 {
                self.free.push(id);
            }
        }
    }

    /// Copies the first `slots` slots of block `src` into block `dst`, every layer.
    ///
    /// # Errors
    /// A block id past the pool, `slots > block_size`, or a backend failure.
    pub fn copy_block(
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

    /// Layers and kv features of the test pools.
    const LAYERS: usize = 2;
    const KV: usize = 8;

    /// 1 000 random cycles of taking, sharing and returning blocks: every block is owned
    /// exactly as often as the test holds it, the pool never passes its budget, and at the
    /// end every block is free again.
    #[test]
    fn block_accounting_has_no_leak_over_1000_cycles() {
        let be = CpuBackend;
        let mut pool = BlockPool::new(&be, LAYERS, KV, 4, 2, 64).unwrap();
        let mut held: Vec<Vec<u32>> = Vec::new(); // one entry per owner: its blocks
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..1000 {
            match rand(3) {
                0 => {
                    // a new sequence of 1..6 blocks (if the budget allows)
                    let want = 1 + rand(6) as usize;
                    let mut got = Vec::new();
                    while got.len() < want {
                        match pool.alloc(&be).unwrap() {
                            Some(id) => got.push(id),
                            None => break,
                        }
                    }
                    held.push(got);
                }
                1 if !held.is_empty() => {
                    // a sample sharing another owner's blocks
                    let i = rand(held.len() as u64) as usize;
                    let shared = held[i].clone();
                    shared.iter().for_each(|&id| pool.retain(id));
                    held.push(shared);
                }
                _ if !held.is_empty() => {
                    let i = rand(held.len() as u64) as usize;
                    held.swap_remove(i).iter().for_each(|&id| pool.release(id));
                }
                _ => {}
            }
            assert!(pool.capacity() <= 64);
            let mut owners = vec![0u32; pool.capacity()];
            held.iter()
                .flatten()
                .for_each(|&id| owners[id as usize] += 1);
            for (id, &n) in owners.iter().enumerate() {
                assert_eq!(pool.refs(id as u32), n, "block {id}");
            }
            assert_eq!(pool.in_use(), owners.iter().filter(|&&n| n > 0).count());
        }
        held.drain(..).flatten().for_each(|id| pool.release(id));
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.available(), 64);
    }

    /// Growing keeps every block's contents, and copies between blocks land where asked.
    #[test]
    fn growing_and_copying_keep_contents() {
        let be = CpuBackend;
        let mut pool = BlockPool::new(&be, LAYERS, KV, 2, 1, 8).unwrap();
        let a = pool.alloc(&be).unwrap().unwrap();
        let per_block = 2 * KV;
        let layer = |p: &BlockPool<CpuBackend>| p.layer_len();
        for l in 0..LAYERS {
            let at = l * layer(&pool) + a as usize * per_block;
            for (i, x) in pool.k[at..at + per_block].iter_mut().enumerate() {
                *x = (l * 1000 + i) as f32;
            }
        }
        let b = pool.alloc(&be).unwrap().unwrap(); // grows to 2
        let c = pool.alloc(&be).unwrap().unwrap(); // grows to 4
        assert_eq!(pool.capacity(), 4);
        pool.copy_block(&be, a, c, 1).unwrap();
        for l in 0..LAYERS {
            let base = l * layer(&pool);
            let ka = &pool.k[base + a as usize * per_block..][..per_block];
            assert_eq!(ka[1], (l * 1000 + 1) as f32, "layer {l} kept");
            let kc = &pool.k[base + c as usize * per_block..][..per_block];
            assert_eq!(kc[..KV], ka[..KV], "layer {l} first slot copied");
            assert!(kc[KV..].iter().all(|&x| x == 0.0), "only one slot copied");
        }
        assert_ne!(b, c);
        assert!(BlockPool::<CpuBackend>::new(&be, LAYERS, KV, 0, 1, 8).is_err());
        assert!(BlockPool::<CpuBackend>::new(&be, LAYERS, KV, 4, 9, 8).is_err());
    }
}
