//! [`Activations`]: every intermediate tensor of one forward pass, planned up front for a
//! batch shape `(batch, seq)` and reused across calls (llm.c's `ActivationTensors`).
//!
//! Per-layer tensors are one buffer `[layers, tokens, ...]` each, so the backward pass
//! finds every layer's inputs, `rstd` and `lse` where the forward left them. With `N = batch · seq` tokens, `C` hidden, `I` intermediate, `V` vocab, `Hq`/`Hkv`
//! heads of `D`, the arena holds about `L · N · (6C + 3·Hq·D + 4·Hkv·D + 3I) + 2·N·V` floats
//! (logits and their gradient), plus the backward scratch. Buffers a call never touches
//! (the gradients during generation) cost address space only: fresh allocations are
//! zero pages until written.

use super::backward::BackwardScratch;
use super::{ModelError, ModelSpec};
use crate::backend::{Backend, Tensor, View};

/// The activation arena of a model for a fixed `(batch, seq)`.
#[derive(Debug)]
pub struct Activations<B: Backend> {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    /// `[N]` token ids, uploaded per call.
    pub(crate) ids: B::Ids,
    /// `[N]` positions, uploaded per call.
    pub(crate) positions: B::Ids,
    /// `[N]` key mask (0/1), uploaded per call.
    pub(crate) mask: B::Buffer,
    /// Host staging of the mask as f32, `[N]`.
    pub(crate) host_mask: Vec<f32>,
    /// `[N, D/2]` RoPE cos and sin of each token's position.
    pub(crate) cos: B::Buffer,
    pub(crate) sin: B::Buffer,
    /// `[N, C]` token embeddings (input of layer 0).
    pub(crate) encoded: B::Buffer,
    /// `[L, N, C]` input RMSNorm output, and `[L, N]` its rstd.
    pub(crate) ln1: B::Buffer,
    pub(crate) ln1_rstd: B::Buffer,
    /// `[L, N, Hq·D]`, `[L, N, Hkv·D]` q/k projections before their RMSNorm (Qwen3 only,
    /// else empty), and `[L, N·Hq]`, `[L, N·Hkv]` their rstd.
    pub(crate) q_raw: B::Buffer,
    pub(crate) k_raw: B::Buffer,
    pub(crate) q_rstd: B::Buffer,
    pub(crate) k_rstd: B::Buffer,
    /// `[L, N, Hq·D]`, `[L, N, Hkv·D]` q, k (after RoPE) and v.
    pub(crate) q: B::Buffer,
    pub(crate) k: B::Buffer,
    pub(crate) v: B::Buffer,
    /// `[L, N, Hq·D]` attention output and `[L, N·Hq]` its log-sum-exp.
    pub(crate) att: B::Buffer,
    pub(crate) lse: B::Buffer,
    /// `[L, N, C]` output projection.
    pub(crate) att_proj: B::Buffer,
    /// `[L, N, C]` residual stream after attention.
    pub(crate) resid_mid: B::Buffer,
    /// `[L, N, C]` post-attention RMSNorm output, and `[L, N]` its rstd.
    pub(crate) ln2: B::Buffer,
    pub(crate) ln2_rstd: B::Buffer,
    /// `[L, N, I]` gate and up projections, and `silu(gate) · up`.
    pub(crate) gate: B::Buffer,
    pub(crate) up: B::Buffer,
    pub(crate) act: B::Buffer,
    /// `[L, N, C]` down projection.
    pub(crate) mlp_out: B::Buffer,
    /// `[L, N, C]` residual stream after the MLP (input of the next layer).
    pub(crate) resid_out: B::Buffer,
    /// `[N, C]` final RMSNorm output, and `[N]` its rstd.
    pub(crate) lnf: B::Buffer,
    pub(crate) lnf_rstd: B::Buffer,
    /// `[N, V]` logits.
    pub(crate) logits: B::Buffer,
    /// `[N]` target ids, and the log-prob and entropy of each row of the logits.
    pub(crate) targets: B::Ids,
    pub(crate) log_prob: B::Buffer,
    pub(crate) entropy: B::Buffer,
    /// `[N]` ∂L/∂logπ per token and `[N, V]` the ∂L/∂logits they imply, written by
    /// [`Model::backward_from_log_prob_grads`](super::Model::backward_from_log_prob_grads).
    pub(crate) coeffs: B::Buffer,
    pub(crate) dlogits: B::Buffer,
    /// Per-layer intermediates of the backward pass, reused by every layer.
    pub(crate) scratch: BackwardScratch<B>,
}

/// Product of `dims`, or a [`ModelError::BatchShape`] on overflow.
fn numel(batch: usize, seq: usize, dims: &[usize]) -> Result<usize, ModelError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(ModelError::BatchShape { batch, seq })
}

impl<B: Backend> Activations<B> {
    /// Allocates the arena for `batch` sequences of `seq` tokens of a model with `spec`.
    ///
    /// # Errors
    /// [`ModelError::BatchShape`] for an empty or overflowing shape; backend allocation
    /// failures.
    pub fn new(
        backend: &B,
        spec: &ModelSpec,
        batch: usize,
        seq: usize,
    ) -> Result<Self, ModelError> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::BatchShape { batch, seq });
        }
        let n = numel(batch, seq, &[batch, seq])?;
        let l = spec.layers;
        let (c, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
        let (qd, kvd) = (spec.q_dim(), spec.kv_dim());
        let (hq, hkv) = (spec.q_heads, spec.kv_heads);
        let alloc = |dims: &[usize]| -> Result<B::Buffer, ModelError> {
            Ok(backend.alloc(numel(batch, seq, dims)?)?)
        };
        let qk_raw = usize::from(spec.qk_norm);
        Ok(Self {
            batch,
            seq,
            ids: backend.alloc_ids(n)?,
            positions: backend.alloc_ids(n)?,
            mask: alloc(&[n])?,
            host_mask: vec![0.0; n],
            cos: alloc(&[n, spec.head_dim / 2])?,
            sin: alloc(&[n, spec.head_dim / 2])?,
            encoded: alloc(&[n, c])?,
            ln1: alloc(&[l, n, c])?,
            ln1_rstd: alloc(&[l, n])?,
            q_raw: alloc(&[qk_raw, l, n, qd])?,
            k_raw: alloc(&[qk_raw, l, n, kvd])?,
            q_rstd: alloc(&[qk_raw, l, n, hq])?,
            k_rstd: alloc(&[qk_raw, l, n, hkv])?,
            q: alloc(&[l, n, qd])?,
            k: alloc(&[l, n, kvd])?,
            v: alloc(&[l, n, kvd])?,
            att: alloc(&[l, n, qd])?,
            lse: alloc(&[l, n, hq])?,
            att_proj: alloc(&[l, n, c])?,
            resid_mid: alloc(&[l, n, c])?,
            ln2: alloc(&[l, n, c])?,
            ln2_rstd: alloc(&[l, n])?,
            gate: alloc(&[l, n, i])?,
            up: alloc(&[l, n, i])?,
            act: alloc(&[l, n, i])?,
            mlp_out: alloc(&[l, n, c])?,
            resid_out: alloc(&[l, n, c])?,
            lnf: alloc(&[n, c])?,
            lnf_rstd: alloc(&[n])?,
            logits: alloc(&[n, v])?,
            targets: backend.alloc_ids(n)?,
            log_prob: alloc(&[n])?,
            entropy: alloc(&[n])?,
            coeffs: alloc(&[n])?,
            dlogits: alloc(&[n, v])?,
            scratch: BackwardScratch::new(backend, spec, n)?,
        })
    }

    /// `(batch, seq)` this arena was planned for.
    pub fn shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// The logits `[batch, seq, vocab]` of the last forward pass (zeros before the first).
    pub fn logits(&self) -> Tensor<'_, B> {
        View::whole(&self.logits)
    }

    /// The per-token log-probs `[batch, seq]` of the last
    /// [`Model::log_prob_entropy`](super::Model::log_prob_entropy) (zeros before the first).
    pub fn log_probs(&self) -> Tensor<'_, B> {
        View::whole(&self.log_prob)
    }

    /// The per-token entropies `[batch, seq]` of the last
    /// [`Model::log_prob_entropy`](super::Model::log_prob_entropy) (zeros before the first).
    pub fn entropies(&self) -> Tensor<'_, B> {
        View::whole(&self.entropy)
    }
}
