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
