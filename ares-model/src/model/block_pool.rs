//! [`BlockPool`]: the block ids of the rollout engine's paged KV cache (vLLM's
//! PagedAttention layout), apart from the memory they name ([`PagedKv`]).
//!
//! Keys and values live in blocks of `block_size` token slots; a sequence owns a list of
//! blocks (its block table), so its memory grows a block at a time with its tokens and
//! returns to the pool when it ends, whatever the other sequences do. Blocks are
//! reference-counted: the full blocks of a prompt prefilled once are shared by its samples
//! (a sample never writes into them: its next token goes to a block it owns alone).
//!
//! The pool starts small and doubles when the free blocks run out, up to the budget
//! (`max_blocks`), so memory follows the live tokens rather than `batch × max_len`; the
//! engine's runner grows the device buffers ([`PagedKv::reserve`]) to [`BlockPool::capacity`]
//! before it runs a step. The pool is host bookkeeping only: the scheduler decides with it
//! without touching a device.
//!
//! [`PagedKv`]: super::paged_kv::PagedKv
//! [`PagedKv::reserve`]: super::paged_kv::PagedKv::reserve

use super::ModelError;

/// Reference-counted KV block ids, grown on demand up to a budget.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    /// The budget: blocks the pool may grow to.
    max_blocks: usize,
    /// Blocks allocated (ids `0..capacity`).
    capacity: usize,
    /// Owners of each allocated block (0: free).
    refs: Vec<u32>,
    /// Free block ids, the lowest last (handed out first).
    free: Vec<u32>,
}

impl BlockPool {
    /// A pool of `initial` blocks (at least 1) of `block_size` slots, growing up to
    /// `max_blocks`.
    ///
    /// # Errors
    /// `block_size` 0, `max_blocks < initial`, or ids past `u32`.
    pub fn new(block_size: usize, initial: usize, max_blocks: usize) -> Result<Self, ModelError> {
        let initial = initial.max(1);
        if block_size == 0 || max_blocks < initial || max_blocks > u32::MAX as usize {
            return Err(ModelError::BatchShape {
                batch: max_blocks,
                seq: block_size,
            });
        }
        let mut pool = Self {
            block_size,
            max_blocks,
            capacity: 0,
            refs: Vec::new(),
            free: Vec::new(),
        };
        pool.grow(initial);
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

    /// Blocks allocated (the memory held).
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

    /// Grows to `blocks` blocks (no-op if that many exist).
    fn grow(&mut self, blocks: usize) {
        if blocks <= self.capacity {
            return;
        }
        // new ids pushed highest first, so the lowest is handed out next
        self.free
            .extend((self.capacity as u32..blocks as u32).rev());
        self.refs.resize(blocks, 0);
        self.capacity = blocks;
    }

    /// A free block for one owner, growing the pool (doubling, up to the budget) when none
    /// is free; `None` when the budget is used up.
    pub fn alloc(&mut self) -> Option<u32> {
        if self.free.is_empty() && self.capacity < self.max_blocks {
            let target = (self.capacity * 2).clamp(self.capacity + 1, self.max_blocks);
            self.grow(target);
        }
        self.free.pop().inspect(|&id| self.refs[id as usize] = 1)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 000 random cycles of taking, sharing and returning blocks: every block is owned
    /// exactly as often as the test holds it, the pool never passes its budget, and at the
    /// end every block is free again.
    #[test]
    fn block_accounting_has_no_leak_over_1000_cycles() {
        let mut pool = BlockPool::new(4, 2, 64).unwrap();
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
                        match pool.alloc() {
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

    /// The pool doubles when it runs out, up to the budget, and refuses bad sizes.
    #[test]
    fn growth_doubles_up_to_the_budget() {
        let mut pool = BlockPool::new(2, 1, 6).unwrap();
        let ids: Vec<u32> = (0..6).map_while(|_| pool.alloc()).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5], "lowest id first");
        assert_eq!(pool.capacity(), 6);
        assert_eq!(pool.alloc(), None);
        assert!(BlockPool::new(0, 1, 8).is_err());
        assert!(BlockPool::new(4, 9, 8).is_err());
    }
}
