//! The forward pass, top to bottom as in llm.c's `gpt2_forward`: upload the batch, embed,
//! then per layer `RMSNorm → q/k/v (→ q/k RMSNorm) → RoPE → attention → o_proj → residual
//! → RMSNorm → gate/up → SwiGLU → down → residual`, final RMSNorm, LM head.

use super::activations::head_chunks;
use super::decode_weights::DecodeWeights;
use super::log_prob_grad::check_targets;
use super::weights::{Stack, layer_of};
use super::{Activations, HeadMode, Inputs, KvCache, Model, ModelError};
use crate::backend::{
    AttentionDims, AttentionInputs, Backend, LinearDims, Tensor, TensorMut, View, ViewMut,
};

/// Layer `l` of a transposed stack, when there is one.
fn tw_layer<B: Backend>(
    stack: Option<&Stack<B>>,
    l: usize,
) -> Result<Option<Tensor<'_, B>>, ModelError> {
    stack.map(|s| s.layer(l)).transpose()
}

impl<B: Backend> Model<B> {
    /// Runs the model on `inputs`, leaving every activation and the logits `[batch, seq,
    /// vocab]` in `acts` ([`Activations::logits`]). Logits at padding positions are
    /// computed but meaningless (a left-padding query with no valid key attends to
    /// nothing); callers read valid positions only. With a chunked LM head
    /// ([`HeadMode::Chunked`]) the pass stops at the final norm: the logits are computed
    /// chunk by chunk by [`Model::log_prob_entropy`] and
    /// [`Model::backward_from_log_prob_grads`].
    ///
    /// # Errors
    /// Invalid inputs (see [`Inputs::check`]), `acts` planned for another `(batch, seq)`,
    /// or a backend failure.
    pub fn forward(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
    ) -> Result<(), ModelError> {
        self.forward_impl(inputs, acts, None, None)
    }

    /// A linear layer from the weight `w` (`[out, in]`), or from its transposed copy `wt`
    /// when the caller has one ([`DecodeWeights`], generation).
    fn project(
        &self,
        x: Tensor<'_, B>,
        w: Tensor<'_, B>,
        wt: Option<Tensor<'_, B>>,
        bias: Option<Tensor<'_, B>>,
        dims: LinearDims,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        match wt {
            Some(wt) => self.backend.linear_transposed(x, wt, bias, dims, out)?,
            None => self.backend.linear(x, w, bias, dims, out)?,
        }
        Ok(())
    }

    /// [`Model::forward`], or with `cache` the same pass with attention over the KV cache
    /// (the new keys and values appended to it, no log-sum-exp saved; the caller has put
    /// the new tokens' key mask in the cache and advances its length afterwards). With
    /// `tw`, the linear layers multiply by its transposed weights (generation). A chunked
    /// arena stops at the final norm here too (the generation prefill runs the head on the
    /// rows it needs, [`Model::generate`]).
    pub(crate) fn forward_impl(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        mut cache: Option<&mut KvCache<B>>,
        tw: Option<&DecodeWeights<B>>,
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
        let a = acts;

        // Inputs: the only host → device copies of the pass.
        be.upload_ids(inputs.input_ids, &mut a.ids)?;
        be.upload_ids(inputs.position_ids, &mut a.positions)?;
        for (m, &x) in a.host_mask.iter_mut().zip(inputs.attention_mask) {
            *m = x as f32;
        }
        be.upload(&a.host_mask, ViewMut::whole(&mut a.mask))?;

        // Token embeddings, and each token's RoPE cos/sin gathered from the tables by position.
        be.embedding(
            &a.ids,
            View::whole(&w.embed),
            v,
            c,
            ViewMut::whole(&mut a.encoded),
        )?;
        let half = d / 2;
        let table = self.rope_rows;
        be.embedding(
            &a.positions,
            View::whole(&self.rope_cos),
            table,
            half,
            ViewMut::whole(&mut a.cos),
        )?;
        be.embedding(
            &a.positions,
            View::whole(&self.rope_sin),
            table,
            half,
            ViewMut::whole(&mut a.sin),
        )?;
        let (cos, sin) = (View::whole(&a.cos), View::whole(&a.sin));
        let mask = View::whole(&a.mask);

        let lin =
            |rows, in_features, out_features| self.linear_dims(rows, in_features, out_features);
        let attn = AttentionDims::new(inputs.batch, inputs.seq, hq, hkv, d);
        for l in 0..s.layers {
            // The residual stream entering layer l.
            let x = if l == 0 {
                View::whole(&a.encoded)
            } else {
                View::item(&a.resid_out, l - 1, n * c)?
            };

            // Attention block.
            be.rmsnorm(
                x,
                w.ln1.layer(l)?,
                s.eps,
                c,
                ViewMut::item(&mut a.ln1, l, n * c)?,
                ViewMut::item(&mut a.ln1_rstd, l, n)?,
            )?;
            let ln1 = View::item(&a.ln1, l, n * c)?;
            if s.qk_norm {
                // Qwen3: project, then RMSNorm every head over head_dim, then RoPE.
                self.project(
                    ln1,
                    w.q.layer(l)?,
                    tw_layer(tw.map(|t| &t.q), l)?,
                    layer_of(&w.q_bias, l)?,
                    lin(n, c, qd),
                    ViewMut::item(&mut a.q_raw, l, n * qd)?,
                )?;
                self.project(
                    ln1,
                    w.k.layer(l)?,
                    tw_layer(tw.map(|t| &t.k), l)?,
                    layer_of(&w.k_bias, l)?,
                    lin(n, c, kvd),
                    ViewMut::item(&mut a.k_raw, l, n * kvd)?,
                )?;
                let (q_norm, k_norm) = match (layer_of(&w.q_norm, l)?, layer_of(&w.k_norm, l)?) {
                    (Some(q), Some(k)) => (q, k),
                    _ => {
                        return Err(ModelError::MissingWeight {
                            name: format!("model.layers.{l}.self_attn.q_norm/k_norm.weight"),
                        });
                    }
                };
                be.rmsnorm(
                    View::item(&a.q_raw, l, n * qd)?,
                    q_norm,
                    s.eps,
                    d,
                    ViewMut::item(&mut a.q, l, n * qd)?,
                    ViewMut::item(&mut a.q_rstd, l, n * hq)?,
                )?;
                be.rmsnorm(
                    View::item(&a.k_raw, l, n * kvd)?,
                    k_norm,
                    s.eps,
                    d,
                    ViewMut::item(&mut a.k, l, n * kvd)?,
                    ViewMut::item(&mut a.k_rstd, l, n * hkv)?,
                )?;
            } else {
                self.project(
                    ln1,
                    w.q.layer(l)?,
                    tw_layer(tw.map(|t| &t.q), l)?,
                    layer_of(&w.q_bias, l)?,
                    lin(n, c, qd),
                    ViewMut::item(&mut a.q, l, n * qd)?,
                )?;
                self.project(
                    ln1,
                    w.k.layer(l)?,
                    tw_layer(tw.map(|t| &t.k), l)?,
                    layer_of(&w.k_bias, l)?,
                    lin(n, c, kvd),
                    ViewMut::item(&mut a.k, l, n * kvd)?,
                )?;
            }
            self.project(
                ln1,
                w.v.layer(l)?,
                tw_layer(tw.map(|t| &t.v), l)?,
                layer_of(&w.v_bias, l)?,
                lin(n, c, kvd),
                ViewMut::item(&mut a.v, l, n * kvd)?,
            )?;
            be.rope(ViewMut::item(&mut a.q, l, n * qd)?, cos, sin, hq, d)?;
            be.rope(ViewMut::item(&mut a.k, l, n * kvd)?, cos, sin, hkv, d)?;
            match cache.as_deref_mut() {
                None => be.attention(
                    attn,
                    AttentionInputs {
                        q: View::item(&a.q, l, n * qd)?,
                        k: View::item(&a.k, l, n * kvd)?,
                        v: View::item(&a.v, l, n * kvd)?,
                        key_mask: Some(mask),
                    },
                    ViewMut::item(&mut a.att, l, n * qd)?,
                    ViewMut::item(&mut a.lse, l, n * hq)?,
                )?,
                Some(cache) => cache.attend(
                    be,
                    l,
                    attn,
                    View::item(&a.q, l, n * qd)?,
                    View::item(&a.k, l, n * kvd)?,
                    View::item(&a.v, l, n * kvd)?,
                    ViewMut::item(&mut a.att, l, n * qd)?,
                )?,
            }
            self.project(
                View::item(&a.att, l, n * qd)?,
                w.o.layer(l)?,
                tw_layer(tw.map(|t| &t.o), l)?,
                layer_of(&w.o_bias, l)?,
                lin(n, qd, c),
                ViewMut::item(&mut a.att_proj, l, n * c)?,
            )?;
            be.add(
                x,
                View::item(&a.att_proj, l, n * c)?,
                ViewMut::item(&mut a.resid_mid, l, n * c)?,
            )?;

            // MLP block.
            let mid = View::item(&a.resid_mid, l, n * c)?;
            be.rmsnorm(
                mid,
                w.ln2.layer(l)?,
                s.eps,
                c,
                ViewMut::item(&mut a.ln2, l, n * c)?,
                ViewMut::item(&mut a.ln2_rstd, l, n)?,
            )?;
            let ln2 = View::item(&a.ln2, l, n * c)?;
            self.project(
                ln2,
                w.gate.layer(l)?,
                tw_layer(tw.map(|t| &t.gate), l)?,
                layer_of(&w.gate_bias, l)?,
                lin(n, c, i),
                ViewMut::item(&mut a.gate, l, n * i)?,
            )?;
            self.project(
                ln2,
                w.up.layer(l)?,
                tw_layer(tw.map(|t| &t.up), l)?,
                layer_of(&w.up_bias, l)?,
                lin(n, c, i),
                ViewMut::item(&mut a.up, l, n * i)?,
            )?;
            be.swiglu(
                View::item(&a.gate, l, n * i)?,
                View::item(&a.up, l, n * i)?,
                ViewMut::item(&mut a.act, l, n * i)?,
            )?;
            self.project(
                View::item(&a.act, l, n * i)?,
                w.down.layer(l)?,
                tw_layer(tw.map(|t| &t.down), l)?,
                layer_of(&w.down_bias, l)?,
                lin(n, i, c),
                ViewMut::item(&mut a.mlp_out, l, n * c)?,
            )?;
            be.add(
                mid,
                View::item(&a.mlp_out, l, n * c)?,
                ViewMut::item(&mut a.resid_out, l, n * c)?,
            )?;
        }

        // Final norm and (whole logits) LM head.
        let last = match s.layers.checked_sub(1) {
            Some(l) => View::item(&a.resid_out, l, n * c)?,
            None => View::whole(&a.encoded),
        };
        be.rmsnorm(
            last,
            View::whole(&w.norm),
            s.eps,
            c,
            ViewMut::whole(&mut a.lnf),
            ViewMut::whole(&mut a.lnf_rstd),
        )?;
        if a.head == HeadMode::Full {
            self.project(
                View::whole(&a.lnf),
                w.lm_head(),
                tw.map(|t| View::whole(&t.lm_head)),
                None,
                lin(n, c, v),
                ViewMut::whole(&mut a.logits),
            )?;
        }
        Ok(())
    }

    /// Chunked LM head: the logits of tokens `start..start + rows` from the final-norm
    /// output `lnf` `[N, C]`, into the first `rows · V` elements of `logits`.
    pub(crate) fn head_chunk_logits(
        &self,
        lnf: &B::Buffer,
        start: usize,
        rows: usize,
        logits: &mut B::Buffer,
    ) -> Result<(), ModelError> {
        let (c, v) = (self.spec.hidden, self.spec.vocab);
        self.backend.linear(
            View::new(lnf, start * c, rows * c)?,
            self.weights.lm_head(),
            None,
            self.linear_dims(rows, c, v),
            ViewMut::new(logits, 0, rows * v)?,
        )?;
        Ok(())
    }

    /// After [`Model::forward`] on `acts`: the log-prob of `targets[b, t]` and the entropy
    /// of `softmax(logits[b, t] / temperature)` for every token, left in `acts`
    /// ([`Activations::log_probs`], [`Activations::entropies`]) without a host copy of the
    /// logits. `targets` is `[batch, seq]` (e.g. the next token at each position; any id
    /// `< vocab` at positions the caller ignores). With a chunked LM head the logits are
    /// computed here, chunk by chunk, each chunk's rows then reduced by the same op as
    /// whole logits are.
    ///
    /// # Errors
    /// `targets` not `batch · seq` long or an id `>= vocab`, a temperature not finite and
    /// > 0, non-finite logits, or a backend failure.
    pub fn log_prob_entropy(
        &self,
        acts: &mut Activations<B>,
        targets: &[u32],
        temperature: f32,
    ) -> Result<(), ModelError> {
        let vocab = self.spec.vocab;
        let n = acts.batch * acts.seq;
        check_targets(targets, n, vocab)?;
        let be = &self.backend;
        let a = acts;
        for ((start, rows), ids) in head_chunks(n, a.chunk_rows).zip(&mut a.targets) {
            be.upload_ids(&targets[start..start + rows], ids)?;
        }
        for ((start, rows), ids) in head_chunks(n, a.chunk_rows).zip(&a.targets) {
            if a.head != HeadMode::Full {
                self.head_chunk_logits(&a.lnf, start, rows, &mut a.logits)?;
            }
            be.log_prob_entropy(
                View::new(&a.logits, 0, rows * vocab)?,
                vocab,
                temperature,
                ids,
                ViewMut::new(&mut a.log_prob, start, rows)?,
                ViewMut::new(&mut a.entropy, start, rows)?,
            )?;
        }
        Ok(())
    }
}
