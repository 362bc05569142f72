//! The backward pass, bottom to top as in llm.c's `gpt2_backward`: LM head → final RMSNorm
//! → per layer, last to first: down → SwiGLU → gate/up → post-attention RMSNorm → o_proj →
//! attention → RoPE⁻¹ on dq/dk → (Qwen3) q/k RMSNorm → q/k/v projections (with biases) →
//! input RMSNorm; then the embedding.
//!
//! One buffer `dresidual` `[N, C]` carries the gradient of the residual stream down the
//! layers: each block's RMSNorm backward adds its input gradient into it (the residual
//! branch passes the gradient through unchanged). The per-layer intermediates live in a
//! `BackwardScratch` planned up front with the [`Activations`] (in `activations.rs`, which owns the
//! memory plan) and reused by every layer.

use super::activations::head_chunks;
use super::weights::{layer_of, layer_of_mut};
use super::{Activations, Grads, HeadMode, Inputs, Model, ModelError};
use crate::backend::{
    AttentionDims, AttentionGrads, AttentionInputs, Backend, Tensor, View, ViewMut,
};

/// Where the backward pass starts: the gradient of the LM head's output.
pub(crate) enum HeadGrad<'a, B: Backend> {
    /// The caller's ∂L/∂logits `[N, V]` (arenas with whole logits only).
    Dlogits(Tensor<'a, B>),
    /// Per-token ∂L/∂logπ at `temperature`, already in the arena (its `coeffs` and
    /// per-chunk `targets`); ∂L/∂logits is made on the device, one head chunk at a time.
    /// Chunks with `active[k] == false` (all coefficients zero) contribute nothing and
    /// are skipped.
    LogProb {
        /// The temperature of the log-probs.
        temperature: f32,
        /// Per head chunk, whether any of its coefficients is nonzero.
        active: &'a [bool],
    },
}

impl<B: Backend> Model<B> {
    /// Backpropagates `dlogits` = ∂L/∂logits `[batch, seq, vocab]` (from the caller's
    /// loss) through the forward pass that filled `acts` (run it first, on the same
    /// `inputs`), **adding** ∂L/∂θ into `grads` ([`Grads::zero`] them between steps).
    /// Positions the loss ignores should carry zero rows in `dlogits`. Uses only device
    /// buffers planned up front (the activations and their backward scratch).
    ///
    /// Needs an arena with whole logits ([`HeadMode::Full`]); with a chunked LM head use
    /// [`Model::backward_from_log_prob_grads`].
    ///
    /// # Errors
    /// Invalid inputs, `acts` planned for another `(batch, seq)` or with a chunked LM head
    /// ([`ModelError::ChunkedLogits`]), `dlogits` not `batch · seq · vocab` long, `grads`
    /// made for another model ([`ModelError::LayoutMismatch`]), or a backend failure.
    /// Argument errors are found before anything is added to `grads`.
    pub fn backward(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        dlogits: Tensor<'_, B>,
        grads: &mut Grads<B>,
    ) -> Result<(), ModelError> {
        self.backward_impl(inputs, acts, HeadGrad::Dlogits(dlogits), grads)
    }

    /// [`Model::backward`] from the gradient of the LM head's output given by `head`.
    pub(crate) fn backward_impl(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        head: HeadGrad<'_, B>,
        grads: &mut Grads<B>,
    ) -> Result<(), ModelError> {
        let n = inputs.check(&self.spec)?;
        if acts.shape() != (inputs.batch, inputs.seq) {
            return Err(ModelError::ActivationShape {
                planned: acts.shape(),
                actual: (inputs.batch, inputs.seq),
            });
        }
        let be = &self.backend;
        let s = &self.spec;
        let w = &self.weights;
        let (c, i, v, d) = (s.hidden, s.intermediate, s.vocab, s.head_dim);
        let (qd, kvd, hq, hkv) = (s.q_dim(), s.kv_dim(), s.q_heads, s.kv_heads);
        if !self.weights.same_layout(&grads.g) {
            return Err(ModelError::LayoutMismatch { what: "gradients" });
        }
        let a = acts;
        if let HeadGrad::Dlogits(dlogits) = &head {
            a.require_full("backward with explicit dlogits")?;
            if dlogits.len() != n * v {
                return Err(ModelError::InputLength {
                    what: "dlogits",
                    expected: n * v,
                    actual: dlogits.len(),
                });
            }
        }
        let g = &mut grads.g;
        let lin =
            |rows, in_features, out_features| self.linear_dims(rows, in_features, out_features);

        // LM head: dlnf = dlogits · W; dW += dlogitsᵀ · lnf (tied: into the embedding).
        be.fill(ViewMut::whole(&mut a.scratch.dln), 0.0)?;
        match head {
            HeadGrad::Dlogits(dlogits) => {
                let dhead = match g.lm_head.as_mut() {
                    Some(h) => ViewMut::whole(h),
                    None => ViewMut::whole(&mut g.embed),
                };
                be.linear_backward(
                    dlogits,
                    View::whole(&a.lnf),
                    w.lm_head(),
                    lin(n, c, v),
                    Some(ViewMut::whole(&mut a.scratch.dln)),
                    dhead,
                    None,
                )?;
            }
            HeadGrad::LogProb {
                temperature,
                active,
            } => {
                // Per head chunk (one of N rows with whole logits): its logits (recomputed
                // when chunked), ∂L/∂logits of its rows, and their part of dlnf and dW.
                let chunks = head_chunks(n, a.chunk_rows).zip(&a.targets).zip(active);
                for (((start, rows), ids), &active) in chunks {
                    if !active {
                        continue;
                    }
                    if a.head != HeadMode::Full {
                        self.head_chunk_logits(&a.lnf, start, rows, &mut a.logits)?;
                    }
                    be.log_prob_backward(
                        View::new(&a.logits, 0, rows * v)?,
                        v,
                        temperature,
                        ids,
                        View::new(&a.coeffs, start, rows)?,
                        ViewMut::new(&mut a.dlogits, 0, rows * v)?,
                    )?;
                    let dhead = match g.lm_head.as_mut() {
                        Some(h) => ViewMut::whole(h),
                        None => ViewMut::whole(&mut g.embed),
                    };
                    be.linear_backward(
                        View::new(&a.dlogits, 0, rows * v)?,
                        View::new(&a.lnf, start * c, rows * c)?,
                        w.lm_head(),
                        lin(rows, c, v),
                        Some(ViewMut::new(&mut a.scratch.dln, start * c, rows * c)?),
                        dhead,
                        None,
                    )?;
                }
            }
        }
        let sc = &mut a.scratch;

        // Final norm: the residual stream's gradient starts here.
        let last = match s.layers.checked_sub(1) {
            Some(l) => View::item(&a.resid_out, l, n * c)?,
            None => View::whole(&a.encoded),
        };
        be.fill(ViewMut::whole(&mut sc.dresidual), 0.0)?;
        be.rmsnorm_backward(
            View::whole(&sc.dln),
            last,
            View::whole(&w.norm),
            View::whole(&a.lnf_rstd),
            c,
            ViewMut::whole(&mut sc.dresidual),
            ViewMut::whole(&mut g.norm),
        )?;

        let (cos, sin) = (View::whole(&a.cos), View::whole(&a.sin));
        let mask = View::whole(&a.mask);
        let attn = AttentionDims::new(inputs.batch, inputs.seq, hq, hkv, d);
        for l in (0..s.layers).rev() {
            let x = if l == 0 {
                View::whole(&a.encoded)
            } else {
                View::item(&a.resid_out, l - 1, n * c)?
            };

            // MLP block; `dresidual` is ∂L/∂resid_out[l] = ∂L/∂mlp_out[l].
            be.fill(ViewMut::whole(&mut sc.dact), 0.0)?;
            be.linear_backward(
                View::whole(&sc.dresidual),
                View::item(&a.act, l, n * i)?,
                w.down.layer(l)?,
                lin(n, i, c),
                Some(ViewMut::whole(&mut sc.dact)),
                g.down.layer_mut(l)?,
                layer_of_mut(&mut g.down_bias, l)?,
            )?;
            be.swiglu_backward(
                View::whole(&sc.dact),
                View::item(&a.gate, l, n * i)?,
                View::item(&a.up, l, n * i)?,
                ViewMut::whole(&mut sc.dgate),
                ViewMut::whole(&mut sc.dup),
            )?;
            let ln2 = View::item(&a.ln2, l, n * c)?;
            be.fill(ViewMut::whole(&mut sc.dln), 0.0)?;
            be.linear_backward(
                View::whole(&sc.dgate),
                ln2,
                w.gate.layer(l)?,
                lin(n, c, i),
                Some(ViewMut::whole(&mut sc.dln)),
                g.gate.layer_mut(l)?,
                layer_of_mut(&mut g.gate_bias, l)?,
            )?;
            be.linear_backward(
                View::whole(&sc.dup),
                ln2,
                w.up.layer(l)?,
                lin(n, c, i),
                Some(ViewMut::whole(&mut sc.dln)),
                g.up.layer_mut(l)?,
                layer_of_mut(&mut g.up_bias, l)?,
            )?;
            // ∂L/∂resid_mid = dresidual (skip) + the norm's input gradient.
            be.rmsnorm_backward(
                View::whole(&sc.dln),
                View::item(&a.resid_mid, l, n * c)?,
                w.ln2.layer(l)?,
                View::item(&a.ln2_rstd, l, n)?,
                c,
                ViewMut::whole(&mut sc.dresidual),
                g.ln2.layer_mut(l)?,
            )?;

            // Attention block; `dresidual` is ∂L/∂resid_mid[l] = ∂L/∂att_proj[l].
            be.fill(ViewMut::whole(&mut sc.datt), 0.0)?;
            be.linear_backward(
                View::whole(&sc.dresidual),
                View::item(&a.att, l, n * qd)?,
                w.o.layer(l)?,
                lin(n, qd, c),
                Some(ViewMut::whole(&mut sc.datt)),
                g.o.layer_mut(l)?,
                layer_of_mut(&mut g.o_bias, l)?,
            )?;
            be.attention_backward(
                attn,
                AttentionInputs {
                    q: View::item(&a.q, l, n * qd)?,
                    k: View::item(&a.k, l, n * kvd)?,
                    v: View::item(&a.v, l, n * kvd)?,
                    key_mask: Some(mask),
                },
                View::item(&a.att, l, n * qd)?,
                View::item(&a.lse, l, n * hq)?,
                View::whole(&sc.datt),
                AttentionGrads {
                    dq: ViewMut::whole(&mut sc.dq),
                    dk: ViewMut::whole(&mut sc.dk),
                    dv: ViewMut::whole(&mut sc.dv),
                },
            )?;
            be.rope_backward(ViewMut::whole(&mut sc.dq), cos, sin, hq, d)?;
            be.rope_backward(ViewMut::whole(&mut sc.dk), cos, sin, hkv, d)?;
            // The gradients of the q/k projections' outputs.
            let (dq_proj, dk_proj) = if s.qk_norm {
                let (q_norm, k_norm) = match (layer_of(&w.q_norm, l)?, layer_of(&w.k_norm, l)?) {
                    (Some(q), Some(k)) => (q, k),
                    _ => {
                        return Err(ModelError::MissingWeight {
                            name: format!("model.layers.{l}.self_attn.q_norm/k_norm.weight"),
                        });
                    }
                };
                let (dq_norm, dk_norm) = match (
                    layer_of_mut(&mut g.q_norm, l)?,
                    layer_of_mut(&mut g.k_norm, l)?,
                ) {
                    (Some(q), Some(k)) => (q, k),
                    _ => {
                        return Err(ModelError::UnknownParameter {
                            name: format!("model.layers.{l}.self_attn.q_norm/k_norm.weight"),
                            why: "the gradients were made for a model without q/k norm".into(),
                        });
                    }
                };
                be.fill(ViewMut::whole(&mut sc.dq_raw), 0.0)?;
                be.fill(ViewMut::whole(&mut sc.dk_raw), 0.0)?;
                be.rmsnorm_backward(
                    View::whole(&sc.dq),
                    View::item(&a.q_raw, l, n * qd)?,
                    q_norm,
                    View::item(&a.q_rstd, l, n * hq)?,
                    d,
                    ViewMut::whole(&mut sc.dq_raw),
                    dq_norm,
                )?;
                be.rmsnorm_backward(
                    View::whole(&sc.dk),
                    View::item(&a.k_raw, l, n * kvd)?,
                    k_norm,
                    View::item(&a.k_rstd, l, n * hkv)?,
                    d,
                    ViewMut::whole(&mut sc.dk_raw),
                    dk_norm,
                )?;
                (View::whole(&sc.dq_raw), View::whole(&sc.dk_raw))
            } else {
                (View::whole(&sc.dq), View::whole(&sc.dk))
            };
            let ln1 = View::item(&a.ln1, l, n * c)?;
            be.fill(ViewMut::whole(&mut sc.dln), 0.0)?;
            for (dout, wt, dw, db, out_features) in [
                (dq_proj, w.q.layer(l)?, &mut g.q, &mut g.q_bias, qd),
                (dk_proj, w.k.layer(l)?, &mut g.k, &mut g.k_bias, kvd),
                (
                    View::whole(&sc.dv),
                    w.v.layer(l)?,
                    &mut g.v,
                    &mut g.v_bias,
                    kvd,
                ),
            ] {
                be.linear_backward(
                    dout,
                    ln1,
                    wt,
                    lin(n, c, out_features),
                    Some(ViewMut::whole(&mut sc.dln)),
                    dw.layer_mut(l)?,
                    layer_of_mut(db, l)?,
                )?;
            }
            // ∂L/∂x = ∂L/∂resid_mid (skip) + the input norm's input gradient.
            be.rmsnorm_backward(
                View::whole(&sc.dln),
                x,
                w.ln1.layer(l)?,
                View::item(&a.ln1_rstd, l, n)?,
                c,
                ViewMut::whole(&mut sc.dresidual),
                g.ln1.layer_mut(l)?,
            )?;
        }

        // Token embeddings.
        be.embedding_backward(
            &a.ids,
            View::whole(&sc.dresidual),
            v,
            c,
            ViewMut::whole(&mut g.embed),
        )?;
        Ok(())
    }
}
