//! [`DecodeWeights`]: transposed copies (`[in, out]`) of the linear layers' weights, made
//! once per [`Model::generate`](super::Model::generate) call (or [`Generator`](super::Generator))
//! and used by its forward passes: in f32 stored by [`Backend::pack_decode_f32`] and
//! multiplied by [`Backend::linear_decode_f32`] (on the CPU column tiles: each weight read
//! once per step, every output summed in order whatever the batch), or in bf16
//! ([`WeightDtype::Bf16`], packed by [`Backend::pack_bf16`]) through
//! [`Backend::linear_transposed_bf16`]: half the bytes per decode step, the rollout's
//! sampler then a little off the f32 policy that is trained (correct it with the rollout
//! importance weights, `algorithm.rollout_is`).
//!
//! Why: a decode step multiplies one token per sequence by every weight. A CPU GEMM given
//! the Hugging Face `[out, in]` layout with a row-major output first copies the whole
//! weight into panels — on every call, which for a few rows costs more than the product
//! (half of a decode step). In `[in, out]` layout it reads the weight as it is, so one
//! transpose per generation replaces a repack per step (2.5–3× faster projections on the
//! benchmark model). The price is a second copy of the linear weights (LM head included)
//! while generating.

use super::bf16_weights::Bf16Weights;
use super::lora::{Lora, Target};
use super::weights::{DeviceWeights, HalfStack, Stack};
use super::{ModelError, ModelSpec};
use crate::backend::{Backend, Tensor, View, ViewMut};

/// The number format of the decode weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// f32, the training weights' own values (the default): in the backend's decode layout,
    /// or — where that layout is the training weights' own
    /// ([`Backend::decodes_from_training_weights`]: CUDA) and no LoRA pair is merged — the
    /// training weights themselves, with no copy.
    #[default]
    F32,
    /// bf16 (round to nearest even), products and sums in f32 on the CPU. Where the
    /// training weights' layout is the decode layout (CUDA) and the model keeps bf16 copies
    /// of its weights ([`Model::set_bf16_weights`](super::Model::set_bf16_weights)), with no
    /// LoRA pair to merge: those copies, with no second copy.
    Bf16,
    /// The training weights themselves on any backend: no copy and nothing to refresh
    /// after an optimizer step, at the training product's speed (on the CPU slower than
    /// [`WeightDtype::F32`]'s tiles: its GEMM packs the weights every step). With LoRA
    /// pairs to merge, f32 copies as [`WeightDtype::F32`].
    Training,
}

/// One kind of transposed decode weight, `[layers, in, out]`, in its storage dtype — or
/// none: the training weights multiply.
pub(crate) enum DecodeStack<B: Backend> {
    /// f32, in [`Backend::pack_decode_f32`]'s layout.
    F32(Stack<B>),
    /// bf16, in [`Backend::pack_bf16`]'s layout.
    Bf16(HalfStack<B>),
    /// No copy: [`Backend::linear`] with the training weights.
    Training,
    /// No copy: [`Backend::linear_bf16`] with the model's bf16 copies of the training
    /// weights, at any number of rows.
    TrainingBf16,
}

impl<B: Backend> DecodeStack<B> {
    /// The weight of layer `layer` (`None`: the training weight's).
    pub(crate) fn layer(&self, layer: usize) -> Result<Option<DecodeView<'_, B>>, ModelError> {
        Ok(match self {
            Self::F32(s) => Some(DecodeView::F32(s.layer(layer)?)),
            Self::Bf16(s) => Some(DecodeView::Bf16(s.layer(layer)?)),
            Self::Training => None,
            Self::TrainingBf16 => Some(DecodeView::TrainingBf16),
        })
    }

    /// Every layer at once (the LM head: one layer).
    pub(crate) fn whole(&self) -> Option<DecodeView<'_, B>> {
        match self {
            Self::F32(s) => Some(DecodeView::F32(s.whole())),
            Self::Bf16(s) => Some(DecodeView::Bf16(s.whole())),
            Self::Training => None,
            Self::TrainingBf16 => Some(DecodeView::TrainingBf16),
        }
    }
}

impl<B: Backend> std::fmt::Debug for DecodeStack<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (dtype, len) = match self {
            Self::F32(s) => ("f32", s.len()),
            Self::Bf16(s) => ("bf16", s.len()),
            Self::Training => ("the training weights", 0),
            Self::TrainingBf16 => ("the training weights' bf16 copies", 0),
        };
        write!(f, "DecodeStack({dtype} × {len})")
    }
}

/// One decode weight matrix, as [`Model::matmul`](super::Model::matmul) multiplies by it
/// ([`Backend::linear_decode_f32`] or [`Backend::linear_transposed_bf16`]).
pub(crate) enum DecodeView<'a, B: Backend> {
    F32(Tensor<'a, B>),
    Bf16(View<'a, B::Half>),
    /// The layer's own bf16 copy ([`Linear::w16`](super::layer::Linear)), in bf16 at any
    /// number of rows.
    TrainingBf16,
}

impl<B: Backend> Clone for DecodeView<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for DecodeView<'_, B> {}

/// The transposed linear weights of a model, `[layers, in, out]` per kind.
#[derive(Debug)]
pub(crate) struct DecodeWeights<B: Backend> {
    pub(crate) q: DecodeStack<B>,
    pub(crate) k: DecodeStack<B>,
    pub(crate) v: DecodeStack<B>,
    pub(crate) o: DecodeStack<B>,
    pub(crate) gate: DecodeStack<B>,
    pub(crate) up: DecodeStack<B>,
    pub(crate) down: DecodeStack<B>,
    /// `[hidden, vocab]`: the LM head (or tied embedding) transposed (one layer).
    pub(crate) lm_head: DecodeStack<B>,
}

impl<B: Backend> DecodeWeights<B> {
    /// Transposes every linear weight of `w` (and rounds it to bf16 for
    /// [`WeightDtype::Bf16`]), with `lora`'s pairs merged in when given (`Wᵀ + s·Aᵀ·Bᵀ`,
    /// layer by layer): generation runs the adapted model at the base model's cost. No
    /// copy where the backend multiplies the training layout as fast
    /// ([`Backend::decodes_from_training_weights`]) and nothing is merged: in f32 the
    /// training weights, in bf16 their copies when the model keeps them (`copies`). Weights
    /// stored in bf16 ([`WeightStorage::Bf16`](super::WeightStorage::Bf16)) are widened
    /// from their copies, a stack at a time.
    ///
    /// # Errors
    /// A backend failure.
    pub(crate) fn new(
        backend: &B,
        spec: &ModelSpec,
        w: &DeviceWeights<B>,
        lora: Option<&Lora<B>>,
        dtype: WeightDtype,
        copies: Option<&Bf16Weights<B>>,
    ) -> Result<Self, ModelError> {
        let bf16_copies = copies.is_some();
        let fast = backend.decodes_from_training_weights();
        // Some(in bf16): no copy
        let shared = match dtype {
            _ if lora.is_some() => None,
            WeightDtype::Training => Some(false),
            WeightDtype::F32 if fast => Some(false),
            WeightDtype::Bf16 if fast && bf16_copies => Some(true),
            WeightDtype::F32 | WeightDtype::Bf16 => None,
        };
        if let Some(bf16) = shared {
            let t = || match bf16 {
                true => DecodeStack::TrainingBf16,
                false => DecodeStack::Training,
            };
            return Ok(Self {
                q: t(),
                k: t(),
                v: t(),
                o: t(),
                gate: t(),
                up: t(),
                down: t(),
                lm_head: t(),
            });
        }
        let (c, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
        let (qd, kvd) = (spec.q_dim(), spec.kv_dim());
        // a stack transposed to [rows, cols], then packed in `dtype`
        let pack = |t: Stack<B>, rows, cols| -> Result<DecodeStack<B>, ModelError> {
            Ok(match dtype {
                WeightDtype::F32 | WeightDtype::Training => {
                    DecodeStack::F32(t.packed_f32(backend, rows, cols)?)
                }
                WeightDtype::Bf16 => DecodeStack::Bf16(t.packed_bf16(backend, rows, cols)?),
            })
        };
        let mut lm_head = backend.alloc(v * c)?;
        match copies.filter(|_| w.head_stack().is_released()) {
            // stored in bf16: widened first (exact)
            Some(c16) => {
                let head = c16.lm_head.widened(backend)?;
                backend.transpose(head.whole(), v, c, ViewMut::whole(&mut lm_head))?;
            }
            None => backend.transpose(w.lm_head(), v, c, ViewMut::whole(&mut lm_head))?,
        }
        let lm_head = Stack::new(lm_head, c * v);
        // `[out, in]` weights of `target` transposed, the pairs added
        let t = |target: Target, stack: &Stack<B>, out, inp| -> Result<Stack<B>, ModelError> {
            let mut wt = match copies.filter(|_| stack.is_released()) {
                // stored in bf16: widened first (exact)
                Some(c) => {
                    let w = c.by_index(target as usize)?.widened(backend)?;
                    w.transposed(backend, out, inp)?
                }
                None => stack.transposed(backend, out, inp)?,
            };
            if let Some(lora) = lora {
                lora.add_delta(backend, spec, target, &mut wt, true)?;
            }
            Ok(wt)
        };
        Ok(Self {
            q: pack(t(Target::Q, &w.q, qd, c)?, c, qd)?,
            k: pack(t(Target::K, &w.k, kvd, c)?, c, kvd)?,
            v: pack(t(Target::V, &w.v, kvd, c)?, c, kvd)?,
            o: pack(t(Target::O, &w.o, c, qd)?, qd, c)?,
            gate: pack(t(Target::Gate, &w.gate, i, c)?, c, i)?,
            up: pack(t(Target::Up, &w.up, i, c)?, c, i)?,
            down: pack(t(Target::Down, &w.down, c, i)?, i, c)?,
            lm_head: pack(lm_head, c, v)?,
        })
    }
}
