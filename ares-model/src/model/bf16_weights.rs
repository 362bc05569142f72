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
//!
//! **Weights stored in bf16** ([`Model::set_weight_storage`], [`WeightStorage::Bf16`]): the
//! copies of the seven linear stacks and of the LM head become the weights, an untied
//! embedding gets a bf16 copy that becomes its weight, and their f32 buffers are freed — 2
//! bytes a weight instead of 4 (+ 2). The norms and the biases keep f32. Every product of a
//! linear layer and of the head then reads the bf16 weight, whatever its rows, and the
//! embedding lookup gathers bf16 rows ([`Backend::embedding_bf16`]); AdamW updates such a
//! weight in one kernel a tensor ([`Backend::adamw_step_bf16_weight`]) and rounds it
//! **stochastically** — an RL step of 1e-6 is far below bf16's half ulp (2⁻⁹ at 1) and
//! rounding to nearest would drop it every time.

use super::weights::{DeviceWeights, HalfStack, Stack};
use super::{Model, ModelError};
use crate::backend::{Backend, DeviceBuffer, View};

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
    /// `[vocab, hidden]`: an untied embedding stored in bf16 ([`WeightStorage::Bf16`]
    /// only: lookups in f32 need no copy).
    pub(crate) embed: Option<HalfStack<B>>,
    /// The copies are the weights (their f32 stacks released): [`WeightStorage::Bf16`].
    pub(crate) master: bool,
}

/// How a [`Model`] stores its linear layers' weights ([`Model::set_weight_storage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum WeightStorage {
    /// f32 (the optimizer's master), with or without bf16 copies for bf16 products.
    #[default]
    F32,
    /// bf16 only: half the memory of the weight matrices (linear layers, embedding, LM
    /// head), stochastic rounding in the update.
    Bf16,
}

impl WeightStorage {
    /// The configuration name: `f32` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
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
            embed: None,
            master: false,
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
        let sources = Self::sources(w);
        for (src, copy) in sources.into_iter().zip(self.stacks_mut()) {
            // a released stack's copy is the weight itself: nothing to round from
            let released = src.is_empty() && copy.len() != 0;
            if !released && only.is_none_or(|o| std::ptr::eq(o, src)) {
                copy.round_from(be, View::whole(src))?;
            }
        }
        Ok(())
    }

    /// For each of `w`'s buffers ([`DeviceWeights::buffers`] order), the index of its copy
    /// in [`Bf16Weights::copies_mut`] (`None`: no copy, e.g. the norms).
    pub(crate) fn copy_indices(&self, w: &DeviceWeights<B>) -> Vec<Option<usize>> {
        let sources = Self::sources(w);
        let copies = self.stacks().len();
        w.buffers()
            .into_iter()
            .map(|b| sources[..copies].iter().position(|s| std::ptr::eq(*s, b)))
            .collect()
    }

    /// The f32 buffer of each copy in [`Bf16Weights::stacks`]' order: the seven linear
    /// stacks, the LM head (or the embedding it is tied to), the embedding (used only when
    /// it has a copy).
    fn sources(w: &DeviceWeights<B>) -> [&B::Buffer; 9] {
        [
            w.q.buffer(),
            w.k.buffer(),
            w.v.buffer(),
            w.o.buffer(),
            w.gate.buffer(),
            w.up.buffer(),
            w.down.buffer(),
            w.head_stack().buffer(),
            w.embed.buffer(),
        ]
    }

    /// Every copy, in [`Bf16Weights::copy_indices`]' numbering: q, k, v, o, gate, up, down,
    /// the LM head, then the untied embedding's when it has one.
    fn stacks(&self) -> Vec<&HalfStack<B>> {
        let mut out = vec![
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.gate,
            &self.up,
            &self.down,
            &self.lm_head,
        ];
        out.extend(self.embed.as_ref());
        out
    }

    /// [`Bf16Weights::stacks`], writable.
    fn stacks_mut(&mut self) -> Vec<&mut HalfStack<B>> {
        let mut out = vec![
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
            &mut self.lm_head,
        ];
        out.extend(self.embed.as_mut());
        out
    }

    /// Copy `k` in [`Bf16Weights::copy_indices`]' numbering.
    pub(crate) fn by_index(&self, k: usize) -> Result<&HalfStack<B>, ModelError> {
        self.stacks()
            .get(k)
            .copied()
            .ok_or(ModelError::LayoutMismatch {
                what: "bf16 weight copy index",
            })
    }

    /// Copy `k`, writable.
    pub(crate) fn by_index_mut(&mut self, k: usize) -> Result<&mut HalfStack<B>, ModelError> {
        self.stacks_mut()
            .into_iter()
            .nth(k)
            .ok_or(ModelError::LayoutMismatch {
                what: "bf16 weight copy index",
            })
    }

    /// The copies' bits, writable, in [`Bf16Weights::copy_indices`]' numbering.
    pub(crate) fn copies_mut(&mut self) -> Vec<&mut B::Half> {
        self.stacks_mut()
            .into_iter()
            .map(HalfStack::buffer_mut)
            .collect()
    }

    /// Bytes of the copies.
    pub(crate) fn bytes(&self) -> u64 {
        self.stacks().iter().map(|s| 2 * s.len() as u64).sum()
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
        if self.weight_storage() == WeightStorage::Bf16 {
            return match on {
                true => Ok(()),
                false => Err(ModelError::Bf16Weights {
                    what: "dropping the bf16 weight copies",
                }),
            };
        }
        self.bf16_weights = if on {
            Some(Bf16Weights::new(&self.backend, &self.weights)?)
        } else {
            None
        };
        Ok(())
    }

    /// Stores the weight matrices — the linear layers' (q, k, v, o, gate, up, down of every
    /// layer), the embedding and the LM head — in `storage`. [`WeightStorage::Bf16`] rounds
    /// them to bf16 (nearest, ties to even) as the weights and frees their f32 buffers: half
    /// their memory, and no f32 master — every product of those layers and of the head
    /// reads the bf16 weight (at any number of rows, whatever
    /// [`Model::set_matmul_precision`] says), the embedding lookup gathers bf16 rows, and
    /// [`AdamW`](super::AdamW) updates them with stochastic rounding. Norms and biases stay
    /// f32. Generation, export ([`Model::to_weights`]: the bf16 values widened, exact), LoRA
    /// and the data-parallel host exchange read them widened. [`WeightStorage::F32`] widens
    /// them back (exact) into f32 weights, keeping the copies the bf16 products read.
    ///
    /// # Errors
    /// A backend failure (the copies or the f32 buffers could not be allocated).
    pub fn set_weight_storage(&mut self, storage: WeightStorage) -> Result<(), ModelError> {
        if storage == self.weight_storage() {
            return Ok(());
        }
        match storage {
            WeightStorage::Bf16 => {
                if self.bf16_weights.is_none() {
                    self.set_bf16_weights(true)?;
                }
                let (be, w) = (&self.backend, &mut self.weights);
                let copies = self
                    .bf16_weights
                    .as_mut()
                    .ok_or(ModelError::LayoutMismatch {
                        what: "bf16 weight copies",
                    })?;
                // an untied embedding is looked up, not multiplied: its copy starts here
                if w.lm_head.is_some() && copies.embed.is_none() {
                    let embed = HalfStack::rounded(be, w.embed.whole(), w.embed.item())?;
                    copies.embed = Some(embed);
                }
                for stack in w.stored_stacks_mut() {
                    stack.release(be)?;
                }
                copies.master = true;
            }
            WeightStorage::F32 => {
                let be = &self.backend;
                let Some(copies) = self.bf16_weights.as_mut() else {
                    return Ok(());
                };
                let stacks = self.weights.stored_stacks_mut();
                for (stack, copy) in stacks.into_iter().zip(copies.stacks()) {
                    let widened = copy.widened(be)?;
                    stack.restore(widened.into_buffer())?;
                }
                copies.embed = None;
                copies.master = false;
            }
        }
        Ok(())
    }

    /// The bf16 weight of the base weights' buffer `buffer` (in [`DeviceWeights::buffers`]
    /// order) when the model stores it in bf16 only.
    pub(crate) fn stored_bf16(&self, buffer: usize) -> Option<&HalfStack<B>> {
        let k = self.stored_bf16_index(buffer)?;
        self.bf16_weights.as_ref().and_then(|c| c.by_index(k).ok())
    }

    /// [`Model::stored_bf16`]'s copy index (in [`Bf16Weights::copy_indices`]' numbering).
    pub(crate) fn stored_bf16_index(&self, buffer: usize) -> Option<usize> {
        let copies = self.bf16_weights.as_ref().filter(|c| c.master)?;
        let k = copies
            .copy_indices(&self.weights)
            .get(buffer)
            .copied()
            .flatten()?;
        let released = self.weights.buffers().get(buffer)?.is_empty();
        released.then_some(k)
    }

    /// How the weight matrices are stored ([`Model::set_weight_storage`]).
    pub fn weight_storage(&self) -> WeightStorage {
        match self.bf16_weights.as_ref().is_some_and(|c| c.master) {
            true => WeightStorage::Bf16,
            false => WeightStorage::F32,
        }
    }

    /// Bytes the model's weights hold on the device: the f32 buffers (none for weights
    /// stored in bf16) and the bf16 copies or weights (LoRA pairs not counted).
    pub fn weight_bytes(&self) -> u64 {
        let f32s: u64 = self.weights.buffers().iter().map(|b| b.len() as u64).sum();
        4 * f32s + self.bf16_weight_bytes()
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
