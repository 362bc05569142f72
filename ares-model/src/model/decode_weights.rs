//! [`DecodeWeights`]: transposed copies (`[in, out]`) of the linear layers' weights, made
//! once per [`Model::generate`](super::Model::generate) call and used by its forward passes
//! through [`Backend::linear_transposed`].
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
use crate::backend::{Backend, ViewMut};

/// The transposed linear weights of a model, `[layers, in, out]` per kind.
#[derive(Debug)]
pub(crate) struct DecodeWeights<B: Backend> {
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
    /// Transposes every linear weight of `w`.
    pub(crate) fn new(
        backend: &B,
        spec: &ModelSpec,
        w: &DeviceWeights<B>,
    ) -> Result<Self, ModelError> {
        let (c, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
        let (qd, kvd) = (spec.q_dim(), spec.kv_dim());
        let head = w.lm_head();
        let mut lm_head = backend.alloc(head.len())?;
        backend.transpose(head, v, c, ViewMut::whole(&mut lm_head))?;
        Ok(Self {
            q: w.q.transposed(backend, qd, c)?,
            k: w.k.transposed(backend, kvd, c)?,
            v: w.v.transposed(backend, kvd, c)?,
            o: w.o.transposed(backend, c, qd)?,
            gate: w.gate.transposed(backend, i, c)?,
            up: w.up.transposed(backend, i, c)?,
            down: w.down.transposed(backend, c, i)?,
            lm_head,
        })
    }
}
