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

use super::weights::{DeviceWeights, Stack};
use super::{ModelError, ModelSpec};
use crate::backend::{Backend, DeviceBuffer, View, ViewMut};

/// The number format of the decode weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// f32, the training weights' own values (the default).
    #[default]
    F32,
    /// bf16 (round to nearest even), products and sums in f32 on the CPU.
    Bf16,
}

/// The transposed linear weights of a model, `[layers, in, out]` per kind (packed two
/// bf16 to an element in bf16).
#[derive(Debug)]
pub(crate) struct DecodeWeights<B: Backend> {
    pub(crate) dtype: WeightDtype,
    pub(crate) q: Stack<B>,
    pub(crate) k: Stack<B>,
    pub(crate) v: Stack<B>,
    pub(crate) o: Stack<B>,
    pub(crate) gate: Stack<B>,
    pub(crate) up: Stack<B>,
    pub(crate) down: Stack<B>,
    /// `[hidden, vocab]`: the LM head (or tied embedding) transposed.
    pub(crate) lm_head: B::Buffer,
}

impl<B: Backend> DecodeWeights<B> {
    /// Transposes every linear weight of `w` (and packs it into bf16 for
    /// [`WeightDtype::Bf16`]).
    ///
    /// # Errors
    /// A backend failure; bf16 with a matrix of an odd number of elements (layers would not
    /// start on whole elements of the packed buffer).
    pub(crate) fn new(
        backend: &B,
        spec: &ModelSpec,
        w: &DeviceWeights<B>,
        dtype: WeightDtype,
    ) -> Result<Self, ModelError> {
        let (c, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
        let (qd, kvd) = (spec.q_dim(), spec.kv_dim());
        if dtype == WeightDtype::Bf16 && [c * qd, c * kvd, c * i, c * v].iter().any(|n| n % 2 == 1)
        {
            return Err(ModelError::Unsupported {
                what: "bf16 decode weights need matrices of an even number of elements".into(),
            });
        }
        // a stack transposed to [rows, cols], then packed for bf16
        let pack = |t: Stack<B>, rows, cols| -> Result<Stack<B>, ModelError> {
            match dtype {
                WeightDtype::F32 => t.packed_f32(backend, rows, cols),
                WeightDtype::Bf16 => t.packed_bf16(backend, rows, cols),
            }
        };
        let head = w.lm_head();
        let mut lm_head = backend.alloc(head.len())?;
        backend.transpose(head, v, c, ViewMut::whole(&mut lm_head))?;
        let mut packed = backend.alloc(match dtype {
            WeightDtype::F32 => lm_head.len(),
            WeightDtype::Bf16 => lm_head.len().div_ceil(2),
        })?;
        let (src, dst) = (View::whole(&lm_head), ViewMut::whole(&mut packed));
        match dtype {
            WeightDtype::F32 => backend.pack_decode_f32(src, c, v, dst)?,
            WeightDtype::Bf16 => backend.pack_bf16(src, c, v, dst)?,
        }
        lm_head = packed;
        Ok(Self {
            dtype,
            q: pack(w.q.transposed(backend, qd, c)?, c, qd)?,
            k: pack(w.k.transposed(backend, kvd, c)?, c, kvd)?,
            v: pack(w.v.transposed(backend, kvd, c)?, c, kvd)?,
            o: pack(w.o.transposed(backend, c, qd)?, qd, c)?,
            gate: pack(w.gate.transposed(backend, i, c)?, c, i)?,
            up: pack(w.up.transposed(backend, i, c)?, c, i)?,
            down: pack(w.down.transposed(backend, c, i)?, i, c)?,
            lm_head,
        })
    }
}
