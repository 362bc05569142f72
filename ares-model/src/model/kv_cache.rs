//! [`KvCache`]: the keys and values of every layer for a batch of sequences, kept in
//! backend buffers between generation steps.

use super::paged_kv::PagedKv;
use super::{ModelError, ModelSpec};
use crate::backend::{
    AttentionDims, Backend, BlockTables, KvCacheView, KvCacheViewMut, Tensor, TensorMut, View,
    ViewMut,
};

/// The KV cache a cached forward pass attends over: a left-padded contiguous batch (the
/// prefill, and static batching) or the rollout engine's paged pool with this step's
/// block tables.
pub(crate) enum StepCache<'c, B: Backend> {
    /// Every sequence at the same filled length.
    Contiguous(&'c mut KvCache<B>),
    /// Each sequence its own blocks and length.
    Paged(&'c mut PagedKv<B>, BlockTables<'c, B::Ids>),
}

impl<B: Backend> StepCache<'_, B> {
    /// Layer `layer`'s attention step: append the new keys and values, attend `q` — over a
    /// paged pool with bf16 operands on tensor cores when `tensor_cores`
    /// ([`Backend::paged_attention_prefill_bf16`]: a prefill chunk in bf16).
    #[allow(clippy::too_many_arguments)] // mirrors Backend::attention's q, k, v, out
    pub(crate) fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        tensor_cores: bool,
        dims: AttentionDims,
        q: Tensor<'_, B>,
        k_new: Tensor<'_, B>,
        v_new: Tensor<'_, B>,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        match self {
            Self::Contiguous(c) => c.attend(backend, layer, dims, q, k_new, v_new, out),
            Self::Paged(kv, tables) => {
                let step = (layer, tensor_cores);
                kv.attend(backend, step, dims, q, k_new, v_new, *tables, out)
            }
        }
    }

    /// The contiguous cache of a prefill from slot 0: its new keys see only each other,
    /// so [`KvCache::append`] then the training attention over them with the pass's key
    /// mask is this step's attention (the tensor-core forward can take it).
    pub(crate) fn fresh(&mut self) -> Option<&mut KvCache<B>> {
        match self {
            Self::Contiguous(c) if c.len == 0 => Some(c),
            _ => None,
        }
    }
}

/// Per-layer KV cache of `batch` sequences of up to `max_len` tokens: keys and values
/// `[layers, batch, max_len, kv_heads, head_dim]` (each layer's slab is the
/// `[batch, max_len, kv_heads, head_dim]` layout of [`KvCacheView`]) and a key mask
/// `[batch, max_len]` (0 for padding slots). All sequences share one filled length
/// [`KvCache::len`]; prompts of different lengths are left-padded.
#[derive(Debug)]
pub struct KvCache<B: Backend> {
    pub(crate) batch: usize,
    pub(crate) max_len: usize,
    pub(crate) len: usize,
    /// Elements of one layer's keys (or values), `batch · max_len · kv_heads · head_dim`.
    layer_len: usize,
    k: B::Buffer,
    v: B::Buffer,
    /// `[batch, max_len]` 0/1 slot validity, and its host copy.
    mask: B::Buffer,
    pub(crate) host_mask: Vec<f32>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `batch` sequences of up to `max_len` tokens of a model with
    /// `spec`.
    ///
    /// # Errors
    /// [`ModelError::BatchShape`] if `batch` or `max_len` is 0 or the size overflows;
    /// backend allocation failures.
    pub fn new(
        backend: &B,
        spec: &ModelSpec,
        batch: usize,
        max_len: usize,
    ) -> Result<Self, ModelError> {
        let shape = ModelError::BatchShape {
            batch,
            seq: max_len,
        };
        if batch == 0 || max_len == 0 {
            return Err(shape);
        }
        let slots = batch.checked_mul(max_len).ok_or(ModelError::BatchShape {
            batch,
            seq: max_len,
        })?;
        let layer_len = slots
            .checked_mul(spec.kv_dim())
            .ok_or(ModelError::BatchShape {
                batch,
                seq: max_len,
            })?;
        let total = layer_len.checked_mul(spec.layers).ok_or(shape)?;
        Ok(Self {
            batch,
            max_len,
            len: 0,
            layer_len,
            k: backend.alloc(total)?,
            v: backend.alloc(total)?,
            mask: backend.alloc(slots)?,
            host_mask: vec![0.0; slots],
        })
    }

    /// Sequences in the cache.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Slots per sequence.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Slots filled in every sequence (padding included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is filled yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys of every layer, `[layers, batch, max_len, kv_heads, head_dim]`.
    pub(crate) fn keys(&self) -> &B::Buffer {
        &self.k
    }

    /// Values, as [`KvCache::keys`].
    pub(crate) fn values(&self) -> &B::Buffer {
        &self.v
    }

    /// Elements of one layer's keys (or values).
    pub(crate) fn layer_len(&self) -> usize {
        self.layer_len
    }

    /// Empties the cache for reuse (the buffers are kept; stale slots are never read).
    pub fn clear(&mut self) {
        self.len = 0;
        self.host_mask.iter_mut().for_each(|m| *m = 0.0);
    }

    /// Uploads the host copy of the key mask.
    pub(crate) fn upload_mask(&mut self, backend: &B) -> Result<(), ModelError> {
        Ok(backend.upload(&self.host_mask, ViewMut::whole(&mut self.mask))?)
    }

    /// Appends layer `layer`'s new keys and values `k_new`, `v_new` `[batch, seq,
    /// kv_heads, head_dim]` at slots `len..len + seq` (without advancing [`KvCache::len`]).
    pub(crate) fn append(
        &mut self,
        backend: &B,
        layer: usize,
        dims: AttentionDims,
        k_new: Tensor<'_, B>,
        v_new: Tensor<'_, B>,
    ) -> Result<(), ModelError> {
        let n = self.layer_len;
        backend.kv_cache_append(
            dims,
            k_new,
            v_new,
            KvCacheViewMut {
                k: ViewMut::item(&mut self.k, layer, n)?,
                v: ViewMut::item(&mut self.v, layer, n)?,
                max_len: self.max_len,
                len: self.len,
            },
        )?;
        Ok(())
    }

    /// Layer `layer`'s attention step: appends the new keys and values `k_new`, `v_new`
    /// `[batch, seq, kv_heads, head_dim]` at slots `len..len + seq`, then attends `q` over
    /// slots `..len + seq` into `out`. Does not advance [`KvCache::len`]: every layer of a
    /// step writes the same slots, the caller advances it once after the last layer.
    #[allow(clippy::too_many_arguments)] // mirrors Backend::attention's q, k, v, out
    pub(crate) fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        dims: AttentionDims,
        q: Tensor<'_, B>,
        k_new: Tensor<'_, B>,
        v_new: Tensor<'_, B>,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        self.append(backend, layer, dims, k_new, v_new)?;
        let n = self.layer_len;
        backend.attention_decode(
            dims,
            q,
            KvCacheView {
                k: View::item(&self.k, layer, n)?,
                v: View::item(&self.v, layer, n)?,
                max_len: self.max_len,
                len: self.len + dims.seq,
                key_mask: Some(View::whole(&self.mask)),
            },
            out,
        )?;
        Ok(())
    }
}
