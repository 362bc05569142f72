//! Argument groups of the generation ops ([`Backend::kv_cache_append`] and
//! [`Backend::attention_decode`]): one layer's KV cache as views of device buffers.
//!
//! Cache layout: keys and values `[batch, max_len, kv_heads, head_dim]` each, sequence `b`
//! holding its tokens in slots `0..len` in order. Every sequence of a batch has the same
//! filled length `len` (prompts are left-padded, padding slots masked out by a key mask
//! `[batch, max_len]`), so the length is one host-side number rather than a device array.
//!
//! [`Backend::kv_cache_append`]: super::Backend::kv_cache_append
//! [`Backend::attention_decode`]: super::Backend::attention_decode

use super::{View, ViewMut};

/// One layer's KV cache to append to (views of buffers `T`).
#[derive(Debug)]
pub struct KvCacheViewMut<'a, T: ?Sized> {
    /// Keys `[batch, max_len, kv_heads, head_dim]`.
    pub k: ViewMut<'a, T>,
    /// Values `[batch, max_len, kv_heads, head_dim]`.
    pub v: ViewMut<'a, T>,
    /// Slots per sequence.
    pub max_len: usize,
    /// Slots already filled in every sequence; new tokens go to `len..len + seq`.
    pub len: usize,
}

/// One layer's KV cache to attend over (views of buffers `T`).
#[derive(Debug)]
pub struct KvCacheView<'a, T: ?Sized> {
    /// Keys `[batch, max_len, kv_heads, head_dim]`.
    pub k: View<'a, T>,
    /// Values `[batch, max_len, kv_heads, head_dim]`.
    pub v: View<'a, T>,
    /// Slots per sequence.
    pub max_len: usize,
    /// Slots filled in every sequence, the new queries' own keys included.
    pub len: usize,
    /// 0/1 validity of each slot `[batch, max_len]` (padding slots 0); `None`: every
    /// filled slot valid.
    pub key_mask: Option<View<'a, T>>,
}

/// The block tables and lengths of the sequences of a paged KV cache step
/// ([`Backend::paged_kv_cache_append`], [`Backend::paged_attention_decode`]): on the device
/// in id buffers `I`, and the same values on the host (for the checks).
///
/// Layout: one pool per layer of `blocks` blocks of `block_size` token slots, keys and
/// values `[blocks, block_size, kv_heads, head_dim]`; slot `s` of sequence `b` is pool row
/// `tables[b · max_blocks + s / block_size] · block_size + s % block_size`.
///
/// [`Backend::paged_kv_cache_append`]: super::Backend::paged_kv_cache_append
/// [`Backend::paged_attention_decode`]: super::Backend::paged_attention_decode
#[derive(Debug)]
pub struct BlockTables<'a, I: ?Sized> {
    /// Token slots per block.
    pub block_size: usize,
    /// Columns of the tables.
    pub max_blocks: usize,
    /// `[batch, max_blocks]` block ids of each sequence, in order.
    pub tables: &'a I,
    /// `[batch]` slots each sequence filled before this step's new tokens.
    pub len: &'a I,
    /// Host copy of `tables`.
    pub host_tables: &'a [u32],
    /// Host copy of `len`.
    pub host_len: &'a [u32],
}

impl<I: ?Sized> Clone for BlockTables<'_, I> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<I: ?Sized> Copy for BlockTables<'_, I> {}

/// One layer's paged KV cache to append to (views of buffers `T`, tables in `I`).
#[derive(Debug)]
pub struct PagedKvViewMut<'a, T: ?Sized, I: ?Sized> {
    /// Keys `[blocks, block_size, kv_heads, head_dim]`.
    pub k: ViewMut<'a, T>,
    /// Values, as `k`.
    pub v: ViewMut<'a, T>,
    /// The sequences' blocks and lengths.
    pub blocks: BlockTables<'a, I>,
}

/// One layer's paged KV cache to attend over (views of buffers `T`, tables in `I`).
#[derive(Debug)]
pub struct PagedKvView<'a, T: ?Sized, I: ?Sized> {
    /// Keys `[blocks, block_size, kv_heads, head_dim]`.
    pub k: View<'a, T>,
    /// Values, as `k`.
    pub v: View<'a, T>,
    /// The sequences' blocks and lengths (before the new tokens).
    pub blocks: BlockTables<'a, I>,
}
