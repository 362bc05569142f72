//! The forward pass, top to bottom as in llm.c's `gpt2_forward`: upload the batch, embed,
//! then per layer `RMSNorm → q/k/v (→ q/k RMSNorm) → RoPE → attention → o_proj → residual
//! → RMSNorm → gate/up → SwiGLU → down → residual`, final RMSNorm, LM head.
//!
//! A layer reads its weights `p` and its activations `a` through the per-layer views of
//! `layer.rs`, one line per op; the backward pass uses the same names (and `g` for the
//! gradients), so the two read side by side.

use super::act_dtype::{Act, ActMut};
use super::activations::{LayerBuffers, head_chunks};
use super::decode_weights::DecodeWeights;
use super::kv_cache::StepCache;
use super::layer::{StoredQkv, qkv as qkv_views};
use super::log_prob_grad::check_targets;
use super::lora::{LoraActs, Target};
use super::unpack::{Unpack, Widths};
use super::{Activations, ForwardExtras, HeadMode, Inputs, KvCache, Model, ModelError};
use crate::backend::{AttentionDims, Backend, Tensor, View, ViewMut};

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
        cache: Option<&mut KvCache<B>>,
        tw: Option<&DecodeWeights<B>>,
    ) -> Result<(), ModelError> {
        let cache = cache.map(StepCache::Contiguous);
        self.forward_extras(inputs, &ForwardExtras::default(), acts, cache, tw)
    }

    /// [`Model::forward`] with the multimodal [`ForwardExtras`]: replaced embedding rows
    /// and M-RoPE tables.
    ///
    /// # Errors
    /// As [`Model::forward`], and extras of the wrong length.
    pub fn forward_with(
        &self,
        inputs: &Inputs<'_>,
        extras: &ForwardExtras<'_, B>,
        acts: &mut Activations<B>,
    ) -> Result<(), ModelError> {
        self.forward_extras(inputs, extras, acts, None, None)
    }

    /// [`Model::forward_impl`] with extras: [`Model::stage_inputs`], then
    /// [`Model::forward_staged`].
    pub(crate) fn forward_extras(
        &self,
        inputs: &Inputs<'_>,
        extras: &ForwardExtras<'_, B>,
        acts: &mut Activations<B>,
        cache: Option<StepCache<'_, B>>,
        tw: Option<&DecodeWeights<B>>,
    ) -> Result<(), ModelError> {
        if extras.segments.is_some() && cache.is_some() {
            return Err(ModelError::Unsupported {
                what: "packed sequences with a KV cache (generation pads or runs ragged rows)"
                    .into(),
            });
        }
        self.stage_inputs(inputs, extras, acts)?;
        self.forward_staged(inputs, extras, acts, cache, tw)
    }

    /// The pass's host → device copies, into `acts`: the ids, positions and key mask, and
    /// the M-RoPE tables when `extras` gives them. Checks the inputs against `acts`.
    ///
    /// # Errors
    /// Invalid inputs, `acts` planned for another shape, a backend failure.
    pub(crate) fn stage_inputs(
        &self,
        inputs: &Inputs<'_>,
        extras: &ForwardExtras<'_, B>,
        acts: &mut Activations<B>,
    ) -> Result<(), ModelError> {
        let n = inputs.check(&self.spec)?;
        check_arena(inputs, acts)?;
        let be = &self.backend;
        be.upload_ids(inputs.input_ids, &mut acts.ids)?;
        be.upload_ids(inputs.position_ids, &mut acts.positions)?;
        for (m, &x) in acts.host_mask.iter_mut().zip(inputs.attention_mask) {
            *m = x as f32;
        }
        be.upload(&acts.host_mask, ViewMut::whole(&mut acts.mask))?;
        // the gathered attention's scratch stays in the arena for the next packed pass
        let prev = acts.unpack.take();
        acts.segments = None;
        if let Some(cu) = extras.segments {
            check_segments(inputs, cu)?;
            if self.native_packing {
                let mut ids = be.alloc_ids(cu.len())?;
                be.upload_ids(cu, &mut ids)?;
                acts.segments = Some(ids);
            } else {
                let w = Widths {
                    hq: self.spec.q_heads,
                    hkv: self.spec.kv_heads,
                    d: self.spec.head_dim,
                };
                acts.unpack = Some(Unpack::stage(prev, be, cu, inputs.attention_mask, w)?);
            }
        }
        if let Some((cos, sin)) = extras.rope {
            let half = self.spec.head_dim / 2;
            for (what, t) in [("rope cos", cos), ("rope sin", sin)] {
                if t.len() != n * half {
                    return Err(ModelError::InputLength {
                        what,
                        expected: n * half,
                        actual: t.len(),
                    });
                }
            }
            be.upload(cos, ViewMut::whole(&mut acts.cos))?;
            be.upload(sin, ViewMut::whole(&mut acts.sin))?;
        }
        Ok(())
    }

    /// The pass's ops, on inputs [`Model::stage_inputs`] checked and put in `acts`: no
    /// transfer and no allocation, so the same inputs' next values can replay it (a CUDA
    /// graph of a decode step).
    ///
    /// # Errors
    /// `acts` planned for another shape, or a backend failure.
    pub(crate) fn forward_staged(
        &self,
        inputs: &Inputs<'_>,
        extras: &ForwardExtras<'_, B>,
        acts: &mut Activations<B>,
        mut cache: Option<StepCache<'_, B>>,
        tw: Option<&DecodeWeights<B>>,
    ) -> Result<(), ModelError> {
        // the inputs' values were checked when staged; only the shape is needed here
        check_arena(inputs, acts)?;
        let n = inputs.batch * inputs.seq;
        let be = &self.backend;
        let s = &self.spec;
        let w = &self.weights;
        let (c, v, d) = (s.hidden, s.vocab, s.head_dim);
        let (hq, hkv) = (s.q_heads, s.kv_heads);

        // Token embeddings (image/video rows replaced), and each token's RoPE cos/sin:
        // gathered from the tables by position, or M-RoPE's given per token.
        let encoded = ViewMut::whole(&mut acts.layers.encoded);
        match self.stored_bf16(0) {
            Some(table) => be.embedding_bf16(&acts.ids, table.whole(), v, c, encoded)?,
            None => be.embedding(&acts.ids, w.embed.whole(), v, c, encoded)?,
        }
        if let Some((rows, embeds)) = extras.embeds {
            be.scatter_rows(embeds, rows, n, c, ViewMut::whole(&mut acts.layers.encoded))?;
        }
        let half = d / 2;
        if extras.rope.is_none() {
            // RoPE from the tables (M-RoPE's were staged with the inputs)
            let table = self.rope_rows;
            be.embedding(
                &acts.positions,
                View::whole(&self.rope_cos),
                table,
                half,
                ViewMut::whole(&mut acts.cos),
            )?;
            be.embedding(
                &acts.positions,
                View::whole(&self.rope_sin),
                table,
                half,
                ViewMut::whole(&mut acts.sin),
            )?;
        }
        let (cos, sin) = (View::whole(&acts.cos), View::whole(&acts.sin));
        let mask = View::whole(&acts.mask);
        let segments = acts.segments.as_ref();

        let attn = AttentionDims::new(inputs.batch, inputs.seq, hq, hkv, d);
        for l in 0..s.layers {
            self.layer_forward(
                l,
                n,
                tw,
                &mut acts.layers,
                acts.lora.as_mut(),
                (cos, sin),
                (mask, segments, acts.unpack.as_mut()),
                attn,
                &mut cache,
            )?;
        }

        // Final norm and (whole logits) LM head.
        be.rmsnorm(
            acts.layers.output()?,
            View::whole(&w.norm),
            s.eps,
            c,
            ViewMut::whole(&mut acts.lnf),
            ViewMut::whole(&mut acts.lnf_rstd),
        )?;
        if acts.head == HeadMode::Full {
            let (lnf, logits) = (View::whole(&acts.lnf), ViewMut::whole(&mut acts.logits));
            self.matmul(lnf, self.lm_head(n, tw), logits)?;
        }
        Ok(())
    }

    /// Decoder layer `l`'s forward pass: reads its input (the embeddings, or layer `l −
    /// 1`'s output) from `layers` and writes its activations and output there, with the
    /// pass's RoPE tables `(cos, sin)`, key mask and packed segments; with `cache`, attention over the KV
    /// cache; with `lora`, the adapters' intermediates (the adapters apply when they are
    /// on and the weights are not the decode copies `tw`, which have them merged). The
    /// backward pass calls it again for a layer whose activations were not kept
    /// (activation checkpointing): the same ops on the same input give the same bits.
    #[allow(clippy::too_many_arguments)] // the pass's shared inputs, as in the loop
    pub(crate) fn layer_forward(
        &self,
        l: usize,
        n: usize,
        tw: Option<&DecodeWeights<B>>,
        layers: &mut LayerBuffers<B>,
        lora: Option<&mut LoraActs<B>>,
        (cos, sin): (Tensor<'_, B>, Tensor<'_, B>),
        (mask, segments, unpack): Keys<'_, B>,
        attn: AttentionDims,
        cache: &mut Option<StepCache<'_, B>>,
    ) -> Result<(), ModelError> {
        let be = &self.backend;
        let s = &self.spec;
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        // Layer l's weights and activations (`a.resid`: the residual stream in and out).
        let p = self.layer_params(l, n, tw)?;
        let slot = layers.slot_of(l);
        let mut a = layers.at_mut(l);
        // a LoRA pair's forward after its frozen layer's: `(target, x, y)`
        let mut lora = self.active_lora(lora, tw.is_some())?;
        let mut pair = |t: Target, x: Act<'_, B>, y: ActMut<'_, B>| -> Result<(), ModelError> {
            match lora.as_mut() {
                Some((l_, la)) => self.lora_forward((*l_, &mut **la), t, l, slot, n, x, y),
                None => Ok(()),
            }
        };

        // Attention block. ln1, q, k, v are stored as the arena's layout says: one in bf16
        // is made in f32 in the staging buffer, then rounded into its stack — the bits the
        // bf16 products and the tensor-core attention take of the f32 one.
        let stage = &mut *a.stage;
        let mut ln1 = a.ln1.w()?;
        let ln1_f32 = ln1.f32_or(stage)?;
        self.rmsnorm(a.resid.input()?, p.ln1, ln1_f32, a.ln1_rstd.w()?)?;
        ln1.round_staged(be, stage)?;
        let x = a.ln1.r()?;
        let mut q = a.q.w()?;
        let mut k = a.k.w()?;
        if s.qk_norm {
            // Qwen3: project, then RMSNorm every head over head_dim, then RoPE.
            self.matmul_stored(x, p.q, ActMut::F32(a.q_raw.w()?))?;
            pair(Target::Q, x, ActMut::F32(a.q_raw.w()?))?;
            self.matmul_stored(x, p.k, ActMut::F32(a.k_raw.w()?))?;
            pair(Target::K, x, ActMut::F32(a.k_raw.w()?))?;
            let (q_norm, k_norm) = p.qk_norm.get()?;
            self.rmsnorm(a.q_raw.r()?, q_norm, q.f32_or(stage)?, a.q_rstd.w()?)?;
            q.rope_staged(be, stage, (cos, sin), (hq, d))?;
            self.rmsnorm(a.k_raw.r()?, k_norm, k.f32_or(stage)?, a.k_rstd.w()?)?;
            k.rope_staged(be, stage, (cos, sin), (hkv, d))?;
        } else {
            self.matmul_stored(x, p.q, ActMut::F32(q.f32_or(stage)?))?;
            pair(Target::Q, x, ActMut::F32(q.f32_or(stage)?))?;
            q.rope_staged(be, stage, (cos, sin), (hq, d))?;
            self.matmul_stored(x, p.k, ActMut::F32(k.f32_or(stage)?))?;
            pair(Target::K, x, ActMut::F32(k.f32_or(stage)?))?;
            k.rope_staged(be, stage, (cos, sin), (hkv, d))?;
        }
        let mut v = a.v.w()?;
        self.matmul_stored(x, p.v, ActMut::F32(v.f32_or(stage)?))?;
        pair(Target::V, x, ActMut::F32(v.f32_or(stage)?))?;
        v.round_staged(be, stage)?;
        let qkv = StoredQkv::of(a.q.r()?, a.k.r()?, a.v.r()?)?;
        // the attentions without a form over q, k, v stored in bf16 (an arena plans them in
        // bf16 only where the tensor-core attention runs over the backend's packed rows)
        const F32_ONLY: &str = "an attention over padded rows or a KV cache (q, k, v in bf16)";
        const F32_OUT: &str = "an attention over padded rows or a KV cache (its output in bf16)";
        match cache {
            None if unpack.is_some() => {
                let (q, k, v) = qkv.f32(F32_ONLY)?;
                let bf16 = self.attention_in_bf16(attn.batch * attn.seq);
                let (out, lse) = (a.att.w()?.f32(F32_OUT)?, a.lse.w()?);
                let w = Widths { hq, hkv, d };
                if let Some(u) = unpack {
                    u.forward(be, (attn, bf16, w), (q, k, v), out, lse)?;
                }
            }
            None if self.attention_in_bf16(attn.batch * attn.seq) => {
                let lse = a.lse.w()?;
                match (qkv, a.att.w()?) {
                    (StoredQkv::F32(q, k, v), out) => {
                        let (inputs, out) = (qkv_views(q, k, v, mask), out.f32(F32_OUT)?);
                        be.attention_bf16(attn, inputs, segments, out, lse)?
                    }
                    (StoredQkv::Bf16(q, k, v), out) => {
                        let (out, out16) = match out {
                            ActMut::F32(o) => (Some(o), None),
                            ActMut::Bf16(o) => (None, Some(o)),
                        };
                        let mask = Some(mask);
                        be.attention_bf16_stored(attn, q, k, v, mask, segments, out, out16, lse)?
                    }
                }
            }
            None => {
                let (q, k, v) = qkv.f32(F32_ONLY)?;
                let (out, lse) = (a.att.w()?.f32(F32_OUT)?, a.lse.w()?);
                be.attention(attn, qkv_views(q, k, v, mask), segments, out, lse)?
            }
            Some(cache) => {
                let (q, k, v) = qkv.f32(F32_ONLY)?;
                // a prefill from slot 0 in bf16: its tokens see only each other, so the
                // tensor-core training forward over them is the step's attention; a later
                // chunk of ≥ 64 tokens a sequence over a paged pool: its tensor-core twin
                let bf16 = self.attention_in_bf16(attn.batch * attn.seq);
                match cache.fresh().filter(|_| bf16) {
                    Some(fresh) => {
                        fresh.append(be, l, attn, k, v)?;
                        let (out, lse) = (a.att.w()?.f32(F32_OUT)?, a.lse.w()?);
                        be.attention_bf16(attn, qkv_views(q, k, v, mask), None, out, lse)?
                    }
                    None => {
                        let chunk = self.attention_in_bf16(attn.seq);
                        cache.attend(be, l, chunk, attn, q, k, v, a.att.w()?.f32(F32_OUT)?)?
                    }
                }
            }
        }
        self.matmul_stored(a.att.r()?, p.o, ActMut::F32(a.att_proj.w()?))?;
        pair(Target::O, a.att.r()?, ActMut::F32(a.att_proj.w()?))?;
        // The residual add and the MLP block's norm, fused: the bits of add then rmsnorm.
        let (mid, ln2_out, ln2_rstd) = (a.resid_mid.w()?, a.ln2.w()?, a.ln2_rstd.w()?);
        let added = (a.resid.input()?, a.att_proj.r()?);
        self.add_rmsnorm(added, p.ln2, mid, ln2_out, ln2_rstd)?;

        // MLP block (its activations f32 or bf16, as the arena stores them).
        self.matmul_stored(a.ln2.r()?, p.gate, a.gate.w()?)?;
        pair(Target::Gate, a.ln2.r()?, a.gate.w()?)?;
        self.matmul_stored(a.ln2.r()?, p.up, a.up.w()?)?;
        pair(Target::Up, a.ln2.r()?, a.up.w()?)?;
        self.swiglu(a.gate.r()?, a.up.r()?, a.act.w()?)?;
        self.matmul_stored(a.act.r()?, p.down, ActMut::F32(a.mlp_out.w()?))?;
        pair(Target::Down, a.act.r()?, ActMut::F32(a.mlp_out.w()?))?;
        be.add(a.resid_mid.r()?, a.mlp_out.r()?, a.resid.output()?)?;
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
        self.matmul(
            View::new(lnf, start * c, rows * c)?,
            self.lm_head(rows, None),
            ViewMut::new(logits, 0, rows * v)?,
        )
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

/// Errors unless `acts` was planned for the inputs' `(batch, seq)`.
/// The keys a layer's attention sees: the key mask, and packed sequences' offsets on the
/// backend or their padded layout ([`Unpack`]).
pub(crate) type Keys<'a, B> = (
    Tensor<'a, B>,
    Option<&'a <B as Backend>::Ids>,
    Option<&'a mut Unpack<B>>,
);

/// Packed `segments` of `inputs`: one row, offsets from 0 to `seq` in order.
fn check_segments(inputs: &Inputs<'_>, cu: &[u32]) -> Result<(), ModelError> {
    if inputs.batch != 1 {
        return Err(ModelError::InvalidValue {
            what: "batch (packed sequences)".into(),
            value: inputs.batch as f64,
            expected: "1: packed sequences are one row",
        });
    }
    ares_cpu::ops::segment_attention::check_cu_seqlens(cu, inputs.seq).map_err(|e| {
        ModelError::InvalidValue {
            what: format!("segments (cu_seqlens): {e}"),
            value: cu.len() as f64,
            expected: "offsets from 0 to seq, non-decreasing",
        }
    })
}

fn check_arena<B: Backend>(inputs: &Inputs<'_>, acts: &Activations<B>) -> Result<(), ModelError> {
    if acts.shape() == (inputs.batch, inputs.seq) {
        return Ok(());
    }
    Err(ModelError::ActivationShape {
        planned: acts.shape(),
        actual: (inputs.batch, inputs.seq),
    })
}
