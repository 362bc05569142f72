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
//!
//! A layer reads what the forward pass saved (`a`) and its weights' gradients, each with
//! its weight (`g`), through the per-layer views of `layer.rs`, under the forward pass's
//! names: one line per op, in reverse order of the forward's.

use super::act_dtype::Act;
use super::activations::head_chunks;
use super::layer::LinearGrad;
use super::layer::{StoredQkv, dqkv, qkv as qkv_views};
use super::lora::Target;
use super::unpack::Widths;
use super::{Activations, Grads, HeadMode, Inputs, Model, ModelError};
use crate::backend::GradWrite::{Accumulate, Overwrite};
use crate::backend::{AttentionDims, Backend, DeviceBuffer, Tensor, TensorMut, View, ViewMut};

/// The embedding rows a multimodal forward replaced ([`super::ForwardExtras::embeds`]) and
/// where their gradient goes: the backward writes `∂L/∂embeds` there, and the replaced
/// tokens' embedding rows get no gradient (their token embeddings were not used).
pub struct EmbedGrad<'a, B: Backend> {
    /// The replaced token rows of the flattened `[batch · seq]` input, as in the forward.
    pub rows: &'a B::Ids,
    /// `∂L/∂embeds` `[rows.len(), hidden]`, **overwritten**.
    pub d_embeds: TensorMut<'a, B>,
}

/// Where the backward pass starts: the gradient of the LM head's output.
pub(crate) enum HeadGrad<'a, B: Backend> {
    /// The caller's ∂L/∂logits `[N, V]` (arenas with whole logits only).
    Dlogits(Tensor<'a, B>),
    /// Per-token ∂L/∂logπ at `temperature`, already in the arena (its `coeffs` and
    /// per-chunk `targets`), and with `entropy` per-token ∂L/∂H (its `entropy_coeffs`);
    /// ∂L/∂logits is made on the device, one head chunk at a time. Chunks with
    /// `active[k] == false` (all coefficients zero) contribute nothing and are skipped.
    LogProb {
        /// The temperature of the log-probs (and entropies).
        temperature: f32,
        /// Per head chunk, whether any of its log-prob or entropy coefficients is nonzero.
        active: &'a [bool],
        /// Whether the arena's `entropy_coeffs` hold an entropy term to add.
        entropy: bool,
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
        self.backward_impl(inputs, acts, HeadGrad::Dlogits(dlogits), grads, None)
    }

    /// [`Model::backward`] after a forward with replaced embedding rows
    /// ([`Model::forward_with`]): also writes their gradient into `embeds.d_embeds` (the
    /// vision tower's output gradient).
    ///
    /// # Errors
    /// As [`Model::backward`], and `d_embeds` not a whole number of rows.
    pub fn backward_with(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        dlogits: Tensor<'_, B>,
        embeds: EmbedGrad<'_, B>,
        grads: &mut Grads<B>,
    ) -> Result<(), ModelError> {
        self.backward_impl(
            inputs,
            acts,
            HeadGrad::Dlogits(dlogits),
            grads,
            Some(embeds),
        )
    }

    /// [`Model::backward`] from the gradient of the LM head's output given by `head`.
    pub(crate) fn backward_impl(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        head: HeadGrad<'_, B>,
        grads: &mut Grads<B>,
        embeds: Option<EmbedGrad<'_, B>>,
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
        let (c, v, d) = (s.hidden, s.vocab, s.head_dim);
        let (hq, hkv) = (s.q_heads, s.kv_heads);
        if !self.fits_grads(grads) {
            return Err(ModelError::LayoutMismatch { what: "gradients" });
        }
        // under LoRA the adapters must have run forward: they are all there is to train
        let lora_on = acts.lora.as_ref().is_some_and(|l| l.applied);
        if self.lora.is_some() && !lora_on {
            return Err(ModelError::Lora {
                message: "backward after a forward pass with the adapters off: there is \
                          nothing to train"
                    .into(),
            });
        }
        if let HeadGrad::Dlogits(dlogits) = &head {
            acts.require_full("backward with explicit dlogits")?;
            if dlogits.len() != n * v {
                return Err(ModelError::InputLength {
                    what: "dlogits",
                    expected: n * v,
                    actual: dlogits.len(),
                });
            }
        }
        let super::Grads {
            g: base,
            lora: lora_grads,
            watch,
            half,
        } = grads;
        let mut grads = base.as_mut();

        // LM head: dlnf = dlogits · W; dW += dlogitsᵀ · lnf (tied: into the embedding).
        be.fill(acts.scratch.dln.w(), 0.0)?;
        match head {
            HeadGrad::Dlogits(dlogits) => {
                let g = LinearGrad {
                    param: self.lm_head(n, None),
                    dw: head_grad(grads.as_deref_mut()),
                    dw_write: Accumulate,
                    dbias: None,
                };
                let dln = acts.scratch.dln.w();
                self.matmul_backward(dlogits, View::whole(&acts.lnf), g, Accumulate, dln)?;
            }
            HeadGrad::LogProb {
                temperature,
                active,
                entropy,
            } => {
                // Per head chunk (one of N rows with whole logits): its logits (recomputed
                // when chunked), ∂L/∂logits of its rows, and their part of dlnf and dW.
                let chunks = head_chunks(n, acts.chunk_rows)
                    .zip(&acts.targets)
                    .zip(active);
                for (((start, rows), ids), &active) in chunks {
                    if !active {
                        continue;
                    }
                    if acts.head != HeadMode::Full {
                        self.head_chunk_logits(&acts.lnf, start, rows, &mut acts.logits)?;
                    }
                    be.log_prob_backward(
                        View::new(&acts.logits, 0, rows * v)?,
                        v,
                        temperature,
                        ids,
                        View::new(&acts.coeffs, start, rows)?,
                        ViewMut::new(&mut acts.dlogits, 0, rows * v)?,
                    )?;
                    if entropy {
                        // Adds ∂L/∂H·∂H/∂logits to what log_prob_backward just wrote.
                        be.entropy_backward(
                            View::new(&acts.logits, 0, rows * v)?,
                            v,
                            temperature,
                            View::new(&acts.entropy_coeffs, start, rows)?,
                            ViewMut::new(&mut acts.dlogits, 0, rows * v)?,
                        )?;
                    }
                    let g = LinearGrad {
                        param: self.lm_head(rows, None),
                        dw: head_grad(grads.as_deref_mut()),
                        dw_write: Accumulate,
                        dbias: None,
                    };
                    self.matmul_backward(
                        View::new(&acts.dlogits, 0, rows * v)?,
                        View::new(&acts.lnf, start * c, rows * c)?,
                        g,
                        Accumulate,
                        ViewMut::new(&mut acts.scratch.dln.0, start * c, rows * c)?,
                    )?;
                }
            }
        }
        let sc = &mut acts.scratch;
        // the adapters and their intermediates, when they ran forward
        let mut lora = match (&self.lora, acts.lora.as_mut(), lora_grads.as_mut()) {
            (Some(l), Some(la), Some(lg)) if lora_on => Some(((l, la), lg)),
            _ => None,
        };

        // Final norm: the residual stream's gradient starts here.
        be.fill(sc.dresidual.w(), 0.0)?;
        be.rmsnorm_backward(
            sc.dln.r(),
            acts.layers.output()?,
            View::whole(&w.norm),
            View::whole(&acts.lnf_rstd),
            c,
            sc.dresidual.w(),
            grads.as_deref_mut().map(|g| ViewMut::whole(&mut g.norm)),
        )?;

        let (cos, sin) = (View::whole(&acts.cos), View::whole(&acts.sin));
        let mask = View::whole(&acts.mask);
        let segments = acts.segments.as_ref();
        let mut unpack = acts.unpack.as_mut();
        let attn = AttentionDims::new(inputs.batch, inputs.seq, hq, hkv, d);
        for l in (0..s.layers).rev() {
            if acts.layers.checkpointed {
                // not kept: layer l's forward again, from its input
                let rope = (cos, sin);
                let la = lora.as_mut().map(|((_, la), _)| &mut **la);
                self.layer_forward(
                    l,
                    n,
                    None,
                    &mut acts.layers,
                    la,
                    rope,
                    (mask, segments, unpack.as_deref_mut()),
                    attn,
                    &mut None,
                )?;
            } else {
                // `act`, `ln1` and `ln2` are kept for the layer last run: layer l's again,
                // from its gate and up and from the norms' saved inputs (the forward's ops,
                // so the same bits; the last layer's too, so a second backward of one
                // forward reads the right ones)
                self.recompute_act(&mut acts.layers, l)?;
                self.recompute_ln1(&mut acts.layers, l)?;
                self.recompute_ln2(&mut acts.layers, l)?;
            }
            // Layer l's saved activations (`a.input`: the residual stream entering it) and
            // its weights' gradients, each with its weight.
            let slot = acts.layers.slot_of(l);
            let a = acts.layers.at(l)?;
            // gradients in bf16: the linear ones are written over an f32 scratch first (one
            // product each: `β = 0`, no zero fill), then folded into their bf16 stacks
            let scratch = half.as_mut().map(|h| h.scratch_mut());
            let g = self.layer_grads(l, n, grads.as_deref_mut(), scratch)?;
            // a LoRA pair's backward after its frozen layer's: `(target, dy, x, dx)`
            let mut pair = |t: Target,
                            dy: Tensor<'_, B>,
                            x: Act<'_, B>,
                            dx: TensorMut<'_, B>|
             -> Result<(), ModelError> {
                match lora.as_mut() {
                    Some(((l_, la), lg)) => {
                        self.lora_backward((*l_, &mut **la), lg, t, l, slot, n, dy, x, dx)
                    }
                    None => Ok(()),
                }
            };

            // MLP block; `dresidual` is ∂L/∂resid_out[l] = ∂L/∂mlp_out[l]. The first product
            // into each scratch gradient overwrites it (no zero fill), the others add.
            let dresidual = sc.dresidual.r();
            self.matmul_backward_stored(dresidual, a.act, g.down, Overwrite, sc.dact.w())?;
            pair(Target::Down, sc.dresidual.r(), a.act, sc.dact.w())?;
            self.swiglu_backward(sc.dact.r(), (a.gate, a.up), sc.dgate.w(), sc.dup.w())?;
            self.matmul_backward_stored(sc.dgate.r(), a.ln2, g.gate, Overwrite, sc.dln.w())?;
            pair(Target::Gate, sc.dgate.r(), a.ln2, sc.dln.w())?;
            self.matmul_backward_stored(sc.dup.r(), a.ln2, g.up, Accumulate, sc.dln.w())?;
            pair(Target::Up, sc.dup.r(), a.ln2, sc.dln.w())?;
            // ∂L/∂resid_mid = dresidual (skip) + the norm's input gradient.
            self.rmsnorm_backward(sc.dln.r(), a.resid_mid, a.ln2_rstd, g.ln2, sc.dresidual.w())?;

            // Attention block; `dresidual` is ∂L/∂resid_mid[l] = ∂L/∂att_proj[l].
            self.matmul_backward_stored(sc.dresidual.r(), a.att, g.o, Overwrite, sc.datt.w())?;
            pair(Target::O, sc.dresidual.r(), a.att, sc.datt.w())?;
            let dqkv = dqkv(&mut sc.dq, &mut sc.dk, &mut sc.dv);
            let bf16 = self.attention_in_bf16(attn.batch * attn.seq);
            let qkv = StoredQkv::of(a.q, a.k, a.v)?;
            const F32_ONLY: &str = "an attention backward over padded rows (q, k, v in bf16)";
            const F32_OUT: &str = "an attention backward over f32 q, k, v (its output in bf16)";
            let (lse, dout) = (a.lse, sc.datt.r());
            match (unpack.as_deref_mut(), qkv) {
                (Some(u), qkv) => {
                    let w = Widths { hq, hkv, d };
                    let (qkv, out) = (qkv.f32(F32_ONLY)?, a.att.f32(F32_OUT)?);
                    u.backward(be, (attn, bf16, w), qkv, (out, lse, dout), dqkv)?;
                }
                (None, StoredQkv::Bf16(q, k, v)) => {
                    let (out, out16) = match a.att {
                        Act::F32(o) => (Some(o), None),
                        Act::Bf16(o) => (None, Some(o)),
                    };
                    let mask = Some(mask);
                    be.attention_backward_bf16_stored(
                        attn, q, k, v, mask, segments, out, out16, lse, dout, dqkv,
                    )?;
                }
                (None, StoredQkv::F32(q, k, v)) if bf16 => {
                    let (inputs, out) = (qkv_views(q, k, v, mask), a.att.f32(F32_OUT)?);
                    be.attention_backward_bf16(attn, inputs, segments, out, lse, dout, dqkv)?;
                }
                (None, StoredQkv::F32(q, k, v)) => {
                    let (inputs, out) = (qkv_views(q, k, v, mask), a.att.f32(F32_OUT)?);
                    be.attention_backward(attn, inputs, segments, out, lse, dout, dqkv)?;
                }
            }
            be.rope_backward(sc.dq.w(), cos, sin, hq, d)?;
            be.rope_backward(sc.dk.w(), cos, sin, hkv, d)?;
            // The gradients of the q/k projections' outputs.
            let (dq_proj, dk_proj) = if s.qk_norm {
                let (q_norm, k_norm) = g.qk_norm.get()?;
                be.fill(sc.dq_raw.w(), 0.0)?;
                be.fill(sc.dk_raw.w(), 0.0)?;
                self.rmsnorm_backward(sc.dq.r(), a.q_raw, a.q_rstd, q_norm, sc.dq_raw.w())?;
                self.rmsnorm_backward(sc.dk.r(), a.k_raw, a.k_rstd, k_norm, sc.dk_raw.w())?;
                (sc.dq_raw.r(), sc.dk_raw.r())
            } else {
                (sc.dq.r(), sc.dk.r())
            };
            self.matmul_backward_stored(dq_proj, a.ln1, g.q, Overwrite, sc.dln.w())?;
            pair(Target::Q, dq_proj, a.ln1, sc.dln.w())?;
            self.matmul_backward_stored(dk_proj, a.ln1, g.k, Accumulate, sc.dln.w())?;
            pair(Target::K, dk_proj, a.ln1, sc.dln.w())?;
            self.matmul_backward_stored(sc.dv.r(), a.ln1, g.v, Accumulate, sc.dln.w())?;
            pair(Target::V, sc.dv.r(), a.ln1, sc.dln.w())?;
            // ∂L/∂input = ∂L/∂resid_mid (skip) + the input norm's input gradient.
            self.rmsnorm_backward(sc.dln.r(), a.input, a.ln1_rstd, g.ln1, sc.dresidual.w())?;
            if let Some(h) = half.as_mut() {
                h.fold(be, l)?;
            }
            // layer l's gradients are complete: a watcher may start their sum over ranks
            if let Some(watch) = watch.as_mut() {
                let lg = lora.as_ref().map(|(_, lg)| &**lg);
                let views = super::grads::layer_views(grads.as_deref(), lg, half.as_ref(), l)?;
                watch(be, l, &views);
            }
        }

        // Replaced rows (image / video embeddings): their gradient goes to the caller, none
        // to the token embeddings they replaced.
        if let Some(EmbedGrad { rows, d_embeds }) = embeds {
            let k = rows.len();
            if d_embeds.len() != k * c {
                return Err(ModelError::InputLength {
                    what: "d_embeds",
                    expected: k * c,
                    actual: d_embeds.len(),
                });
            }
            be.embedding(rows, sc.dresidual.r(), n, c, d_embeds)?;
            let zeros = be.alloc(k * c)?;
            be.scatter_rows(View::whole(&zeros), rows, n, c, sc.dresidual.w())?;
        }

        // Token embeddings (frozen under LoRA).
        if let Some(g) = grads {
            be.embedding_backward(
                &acts.ids,
                sc.dresidual.r(),
                v,
                c,
                ViewMut::whole(g.embed.buffer_mut()),
            )?;
        }
        if let Some(h) = half.as_mut() {
            h.keys.end_pass();
        }
        Ok(())
    }
}

/// The LM head's weight gradient: its own, or the tied embedding's (`None`: frozen).
fn head_grad<B: Backend>(
    grads: Option<&mut super::weights::DeviceWeights<B>>,
) -> Option<crate::backend::TensorMut<'_, B>> {
    grads.map(|g| match g.lm_head.as_mut() {
        Some(h) => ViewMut::whole(h.buffer_mut()),
        None => ViewMut::whole(g.embed.buffer_mut()),
    })
}
