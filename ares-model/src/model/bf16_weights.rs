//! [`Bf16Weights`]: bf16 copies of the linear layers' weights (and the LM head), kept beside
//! the f32 weights when the model multiplies in bf16 ([`Model::set_bf16_weights`]).
//!
//! Why: a bf16 product over f32 weights rounds the weight on every call — on a GPU a
//! conversion kernel reading 4 and writing 2 bytes per weight element before each GEMM, the
//! 136 M-element LM head of a Qwen2.5-0.5B about twenty times a step. The copy is rounded
//! once per optimizer step instead and every bf16 product reads it as it is
//! ([`Backend::linear_bf16`], [`Backend::linear_backward_bf16`]). The numbers do not change:
//! rounding once and widening gives the operand the per-product rounding gives, so on the
//! CPU the logits, gradients and updates are the same bits with or without the copy. The
//! f32 weights stay the master the optimizer updates (a 1e-6 step rounds away in bf16).
//!
//! Whatever writes the f32 weights refreshes the copy before the next product reads it:
//! [`AdamW::step`](super::AdamW::step), [`Model::write_trainable`], [`Model::merge_lora`].

use super::weights::{DeviceWeights, HalfStack, Stack};
use super::{Model, ModelError};
use crate::backend::{Backend, View};

/// The bf16 copies, one per linear weight stack, `[layers, out, in]` as the f32 stack.
pub(crate) struct Bf16Weights<B: Backend> {
    pub(crate) q: HalfStack<B>,
    pub(crate) k: HalfStack<B>,
    pub(crate) v: HalfStack<B>,
    pub(crate) o: HalfStack<B>,
    pub(crate) gate: HalfStack<B>,
    pub(crate) up: HalfStack<B>,
    pub(crate) down: HalfStack<B>,
    /// `[vocab, hidden]`: the LM head, or the embedding it is tied to (one layer).
    pub(crate) lm_head: HalfStack<B>,
}

impl<B: Backend> Bf16Weights<B> {
    /// Rounds every linear weight of `w` to bf16 into new copies.
    pub(crate) fn new(be: &B, w: &DeviceWeights<B>) -> Result<Self, ModelError> {
        let copy = |s: &Stack<B>| HalfStack::rounded(be, s.whole(), s.item());
        let head = w.lm_head();
        Ok(Self {
            q: copy(&w.q)?,
            k: copy(&w.k)?,
            v: copy(&w.v)?,
            o: copy(&w.o)?,
            gate: copy(&w.gate)?,
            up: copy(&w.up)?,
            down: copy(&w.down)?,
            lm_head: HalfStack::rounded(be, head, head.len())?,
        })
    }

    /// Rounds the f32 weights of `w` into the copies again: all of them, or with `only` the
    /// copy of that one buffer (none if it has no copy: a norm, a bias).
    pub(crate) fn refresh(
        &mut self,
        be: &B,
        w: &DeviceWeights<B>,
        only: Option<&B::Buffer>,
    ) -> Result<(), ModelError> {
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        let pairs = [
            (w.q.buffer(), &mut self.q),
            (w.k.buffer(), &mut self.k),
            (w.v.buffer(), &mut self.v),
            (w.o.buffer(), &mut self.o),
            (w.gate.buffer(), &mut self.gate),
            (w.up.buffer(), &mut self.up),
            (w.down.buffer(), &mut self.down),
            (head, &mut self.lm_head),
        ];
        for (src, copy) in pairs {
            if only.is_none_or(|o| std::ptr::eq(o, src)) {
                copy.round_from(be, View::whole(src))?;
            }
        }
        Ok(())
    }

    /// Bytes of the copies.
    /// For each of `w`'s buffers ([`DeviceWeights::buffers`] order), the index of its copy
    /// in [`Bf16Weights::copies_mut`] (`None`: no copy, e.g. the norms).
    pub(crate) fn copy_indices(&self, w: &DeviceWeights<B>) -> Vec<Option<usize>> {
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        let sources = [
            w.q.buffer(),
            w.k.buffer(),
            w.v.buffer(),
            w.o.buffer(),
            w.gate.buffer(),
            w.up.buffer(),
            w.down.buffer(),
            head,
        ];
        w.buffers()
            .into_iter()
            .map(|b| sources.iter().position(|s| std::ptr::eq(*s, b)))
            .collect()
    }

    /// The copies' bits, writable, in [`Bf16Weights::copy_indices`]'s numbering.
    pub(crate) fn copies_mut(&mut self) -> Vec<&mut B::Half> {
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
            &mut self.lm_head,
        ]
        .into_iter()
        .map(HalfStack::buffer_mut)
        .collect()
    }

    pub(crate) fn bytes(&self) -> u64 {
        [
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.gate,
            &self.up,
            &self.down,
            &self.lm_head,
        ]
        .iter()
        .map(|s| 2 * s.len() as u64)
        .sum()
    }
}

impl<B: Backend> std::fmt::Debug for Bf16Weights<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bf16Weights({} bytes)", self.bytes())
    }
}

impl<B: Backend> Model<B> {
    /// Keeps bf16 copies of the linear layers' weights and the LM head (`on`), or drops them.
    /// With them, every product that runs in bf16 ([`Model::set_matmul_precision`] bf16, at
    /// `BF16_MIN_ROWS` tokens or more) reads the copy instead of rounding the f32 weight on
    /// each call: the same numbers (on the CPU, the same bits), one rounding per optimizer
    /// step instead of one per product, for 2 more bytes per linear weight. Products in f32
    /// or TF32 do not use them.
    ///
    /// # Errors
    /// A backend failure (the copies could not be allocated).
    pub fn set_bf16_weights(&mut self, on: bool) -> Result<(), ModelError> {
        self.bf16_weights = if on {
            Some(Bf16Weights::new(&self.backend, &self.weights)?)
        } else {
            None
        };
        Ok(())
    }

    /// Bytes held by the bf16 weight copies (0 without them: [`Model::set_bf16_weights`]).
    pub fn bf16_weight_bytes(&self) -> u64 {
        self.bf16_weights.as_ref().map_or(0, Bf16Weights::bytes)
    }

    /// Rounds the f32 weights into the bf16 copies again after they changed (all, or one
    /// buffer of [`Model::trainable`]); nothing without copies, nor for a buffer under LoRA
    /// (a pair).
    pub(crate) fn refresh_bf16_weights(&mut self, only: Option<usize>) -> Result<(), ModelError> {
        let Some(copies) = self.bf16_weights.as_mut() else {
            return Ok(());
        };
        if only.is_some() && self.lora.is_some() {
            return Ok(()); // the trainable buffers are LoRA pairs, which have no copies
        }
        let buffers = self.weights.buffers();
        let only = match only {
            Some(i) => Some(*buffers.get(i).ok_or(ModelError::LayoutMismatch {
                what: "trainable buffer index",
            })?),
            None => None,
        };
        copies.refresh(&self.backend, &self.weights, only)
    }
}
