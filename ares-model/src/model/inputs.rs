//! [`Inputs`]: one batch of token sequences as the host hands it to the model, checked
//! before anything is uploaded.

use super::{ModelError, ModelSpec};
use crate::backend::{Backend, Tensor};

/// What a multimodal forward pass adds to [`Inputs`] (Qwen2-VL family): embeddings that
/// replace the token embeddings at some rows (the image and video placeholders), and
/// per-token rotary tables (M-RoPE) used instead of the lookup by `position_ids`.
pub struct ForwardExtras<'a, B: Backend> {
    /// `(rows, embeds)`: token `rows[i]` of the flattened `[batch · seq]` input gets
    /// embedding row `i` of `embeds` `[rows.len(), hidden]`.
    pub embeds: Option<(&'a B::Ids, Tensor<'a, B>)>,
    /// `(cos, sin)`, each `[batch · seq, head_dim / 2]` in [`crate::backend::Backend::rope`]'s
    /// layout.
    pub rope: Option<(&'a [f32], &'a [f32])>,
    /// Packed sequences (flash-attn's `cu_seqlens`): the inputs are one row (`batch` 1) of
    /// several sequences back to back, sequence `i` at tokens `cu[i]..cu[i + 1]` with its
    /// own positions from 0; attention stays within each (no padding between them). Offsets
    /// from 0 to `seq`, non-decreasing; backends with [`Backend::packs_sequences`] only.
    pub segments: Option<&'a [u32]>,
}

impl<B: Backend> Default for ForwardExtras<'_, B> {
    fn default() -> Self {
        Self {
            embeds: None,
            rope: None,
            segments: None,
        }
    }
}

/// A batch of `batch` sequences of `seq` tokens, row-major `[batch, seq]` like Hugging
/// Face's `input_ids`, `attention_mask` and `position_ids`.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (padded length).
    pub seq: usize,
    /// Token ids, each below the vocabulary size.
    pub input_ids: &'a [u32],
    /// 1 for a real token, 0 for padding (left or right).
    pub attention_mask: &'a [u32],
    /// Position of each token, e.g. `0..seq` for right padding, `cumsum(mask) − 1` for
    /// left padding.
    pub position_ids: &'a [u32],
}

impl Inputs<'_> {
    /// Checks lengths and values against `spec`; returns the token count `batch · seq`.
    ///
    /// # Errors
    /// An empty or overflowing shape, a length that is not `batch · seq`, an id `>=
    /// vocab`, a mask value other than 0/1, a position `>= max_positions`.
    pub fn check(&self, spec: &ModelSpec) -> Result<usize, ModelError> {
        let (batch, seq) = (self.batch, self.seq);
        let n = match batch.checked_mul(seq) {
            Some(n) if n > 0 => n,
            _ => return Err(ModelError::BatchShape { batch, seq }),
        };
        for (what, actual) in [
            ("input_ids", self.input_ids.len()),
            ("attention_mask", self.attention_mask.len()),
            ("position_ids", self.position_ids.len()),
        ] {
            if actual != n {
                return Err(ModelError::InputLength {
                    what,
                    expected: n,
                    actual,
                });
            }
        }
        if let Some((index, &id)) = self
            .input_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= spec.vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                what: "input_ids",
                index,
                id,
                vocab: spec.vocab,
            });
        }
        if let Some((index, &value)) = self
            .attention_mask
            .iter()
            .enumerate()
            .find(|&(_, &m)| m > 1)
        {
            return Err(ModelError::InvalidMask { index, value });
        }
        if let Some((index, &position)) = self
            .position_ids
            .iter()
            .enumerate()
            .find(|&(_, &p)| p as usize >= spec.max_positions)
        {
            return Err(ModelError::PositionOutOfRange {
                index,
                position,
                max: spec.max_positions,
            });
        }
        Ok(n)
    }
}
