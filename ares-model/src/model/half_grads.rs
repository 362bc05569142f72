//! Gradients stored in bf16 ([`GradDtype::Bf16`], `trainer.grad_dtype: bf16`): the decoder's
//! linear weight gradients (q, k, v, o, gate, up, down of every layer — nearly all of a
//! model's parameters) kept as bf16 stacks, half the bytes of f32; the embedding's, the LM
//! head's, the norms' and the biases' stay f32, as do LoRA pairs' (a vision tower's linear
//! ones follow the same way: `vision/half_grads.rs`).
//!
//! A backward pass writes a layer's weight gradients, as before, with the f32 ops, into a
//! one-layer f32 scratch per stack (zeroed first), then folds each into its bf16 stack with
//! [`Backend::accumulate_bf16_stochastic`]: `g ← SR(g + Δ)`, rounded **stochastically** so
//! that the accumulation over micro-batches is unbiased — rounding to nearest would drop a
//! micro-batch's part wherever it is below half a bf16 ulp of the running sum. The keys
//! follow from the optimizer's rounding seed, its step, the pass since
//! [`Grads::set_rounding`](super::Grads::set_rounding), the stack and the layer: a resumed run draws the same bits.
//! The gradient norm reads the bf16 stacks as they are ([`Backend::sums_of_squares`]) and
//! [`AdamW`](super::AdamW) reads them as stored too: its update widens each element as it
//! reads it (the AdamW ops take the gradient as a [`Stored`](crate::backend::Stored) view).

use super::ModelError;
use super::optim::rounding_key;
use super::weights::{DeviceWeights, HalfStack};
use crate::backend::{Backend, DeviceBuffer, View, ViewMut};

/// How a model's gradients are stored ([`Model::grads_in`](super::Model::grads_in)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum GradDtype {
    /// Every gradient in f32.
    #[default]
    F32,
    /// The decoder's linear weight gradients in bf16 (accumulated with stochastic
    /// rounding), the others in f32.
    Bf16,
}

impl GradDtype {
    /// The configuration name: `f32` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// The rounding keys' domain of the decoder's stacks.
const DECODER_DOMAIN: usize = usize::MAX;

/// The bf16 gradient stacks of a `Grads` and the scratch a backward pass writes first.
pub(crate) struct HalfGrads<B: Backend> {
    /// q, k, v, o, gate, up, down: `[layers, out, in]`, as the weights.
    stacks: Vec<HalfStack<B>>,
    /// Where each stack lies among the gradients' buffers (`Grads::buffers` order; their
    /// f32 stacks are released).
    buffers: [usize; 7],
    /// One layer of each stack in f32: where a layer's backward writes its weight gradients.
    scratch: Vec<B::Buffer>,
    /// The rounding keys (`Grads::set_rounding`, `Grads::set_rounding_pass`).
    pub(crate) keys: PassKeys,
}

/// The keys of the stochastic rounding with which gradients accumulate in bf16: the
/// optimizer's rounding seed and step and the backward pass, then a domain (the decoder's
/// stacks, a vision tower's slots), the stack and the layer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PassKeys {
    seed: u64,
    step: u64,
    pass: u64,
}

impl PassKeys {
    /// The key of layer `layer` of stack `stack` of `domain` in the current pass.
    pub(crate) fn key(&self, domain: usize, stack: usize, layer: usize) -> u64 {
        let pass = rounding_key(self.seed, self.step, domain, self.pass as usize);
        rounding_key(pass, 0, stack, layer)
    }

    /// Counts a finished backward pass (the next draws other bits).
    pub(crate) fn end_pass(&mut self) {
        self.pass += 1;
    }

    /// Sets the seed and step; the passes count from 0 again.
    pub(crate) fn set_rounding(&mut self, seed: u64, step: u64) {
        *self = Self {
            seed,
            step,
            pass: 0,
        };
    }

    /// Keys the coming backward pass by `pass` (the ones after it count on).
    pub(crate) fn set_pass(&mut self, pass: u64) {
        self.pass = pass;
    }
}

impl<B: Backend> HalfGrads<B> {
    /// Zeroed bf16 stacks for the linear gradients of `g`, whose f32 stacks are released.
    pub(crate) fn new(be: &B, g: &mut DeviceWeights<B>) -> Result<Self, ModelError> {
        let buffers = g.linear_buffer_indices();
        let (mut stacks, mut scratch) = (Vec::new(), Vec::new());
        for stack in g.linear_stacks_mut() {
            stacks.push(HalfStack::zeros(be, stack.len(), stack.item())?);
            scratch.push(be.alloc(stack.item())?);
            stack.release(be)?;
        }
        Ok(Self {
            stacks,
            buffers,
            scratch,
            keys: PassKeys::default(),
        })
    }

    /// The bf16 stack of the gradients' buffer `buffer`, if it is one.
    pub(crate) fn stack_of(&self, buffer: usize) -> Option<&HalfStack<B>> {
        let k = self.buffers.iter().position(|&b| b == buffer)?;
        self.stacks.get(k)
    }

    /// The buffer index (`Grads::buffers` order) of each stack, in [`Self::stacks_mut`]'
    /// order.
    pub(crate) fn buffer_indices(&self) -> [usize; 7] {
        self.buffers
    }

    /// The stacks, q, k, v, o, gate, up, down.
    pub(crate) fn stacks_mut(&mut self) -> Vec<&mut HalfStack<B>> {
        self.stacks.iter_mut().collect()
    }

    /// Zeroes the stacks.
    pub(crate) fn zero(&mut self, be: &B) -> Result<(), ModelError> {
        for s in &mut self.stacks {
            be.fill_bf16(ViewMut::whole(s.buffer_mut()), 0.0)?;
        }
        Ok(())
    }

    /// The scratch, q, k, v, o, gate, up, down.
    pub(crate) fn scratch_mut(&mut self) -> &mut [B::Buffer] {
        &mut self.scratch
    }

    /// Adds the scratch into layer `layer` of each stack, rounding stochastically.
    pub(crate) fn fold(&mut self, be: &B, layer: usize) -> Result<(), ModelError> {
        for (k, (stack, scratch)) in self.stacks.iter_mut().zip(&self.scratch).enumerate() {
            let key = self.keys.key(DECODER_DOMAIN, k, layer);
            be.accumulate_bf16_stochastic(View::whole(scratch), key, stack.layer_mut(layer)?)?;
        }
        Ok(())
    }

    /// Bytes of the stacks and the scratch.
    pub(crate) fn bytes(&self) -> u64 {
        let halves: u64 = self.stacks.iter().map(|s| 2 * s.len() as u64).sum();
        let scratch: u64 = self.scratch.iter().map(|s| 4 * s.len() as u64).sum();
        halves + scratch
    }
}
