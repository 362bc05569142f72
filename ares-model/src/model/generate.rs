//! Batched generation: [`Model::generate`], [`Generator`] and the steps they share.
//!
//! A request runs through the rollout engine ([`Engine`], `engine.rs`): continuous batching
//! over a paged KV cache, each distinct prompt prefilled once for all of its samples, each
//! sequence attending over its own blocks at its own length, and a finished sequence leaving
//! the decode batch at once (its blocks back to the pool). [`Generator::static_batching`]
//! keeps the old static path as the benchmarks' baseline: every prompt on its own row of
//! one left-padded batch, every row decoded until the last sequence ends.
//!
//! The prefill ([`Model::prefill`]) runs the prompts left-padded to the longest (pad id 0,
//! key mask 0, positions counting each prompt's own tokens from 0, so padding changes no
//! valid token's numbers) through one forward pass that fills a contiguous [`KvCache`], and
//! runs the LM head on each prompt's last position only (its final-norm rows gathered into
//! `[batch, C]`, see [`Model::prefill_activations`]). After each forward the next-token
//! logits are picked from ([`Sampling`]; greedy on the device, or one uniform per sequence
//! from its own stream) and the log-prob of the picked token and the entropy of the
//! sampling distribution are computed on the device by [`Backend::log_prob_entropy`].
//!
//! The linear layers run on a transposed copy of the weights made at the start
//! ([`DecodeWeights`]: faster few-row products on the CPU, a second copy of the linear
//! weights in memory while generating).

use super::decode_weights::{DecodeWeights, WeightDtype};
use super::engine::{Engine, EngineConfig, EngineRequest};
use super::kv_cache::StepCache;
use super::picks::Picks;
use super::request::{
    GenerateError, GenerateOutput, GenerateRequest, PromptVision, SequenceOutput,
    unique_vision_prompts,
};
use super::sampling::{SampleKey, sequence_key};
use super::{
    Activations, ForwardExtras, HeadMode, Inputs, KvCache, KvCacheDtype, Model, ModelError,
};
use crate::backend::{Backend, Tensor, View, ViewMut};

/// A model with its linear weights transposed for generation ([`Model::generator`]):
/// batches generated through it share one transpose. Same outputs as [`Model::generate`].
pub struct Generator<'m, B: Backend> {
    model: &'m Model<B>,
    tw: DecodeWeights<B>,
    /// Shared prefill of equal prompts and finished sequences leaving the batch (the
    /// default); off: every prompt prefilled, every row kept to the end.
    batching: bool,
    /// Prompt tokens prefilled per engine step at most (`None`: every prompt in the first).
    max_prefill_tokens: Option<usize>,
    /// [`EngineConfig::decode_buckets`] of the engines it runs.
    decode_buckets: bool,
    /// [`EngineConfig::kv_cache_dtype`] of the engines it runs.
    kv_cache_dtype: KvCacheDtype,
    /// [`EngineConfig::max_blocks`] of the engines it runs.
    max_kv_blocks: Option<usize>,
}

impl<'m, B: Backend> Generator<'m, B> {
    /// Static batching: every prompt prefilled on its own row and every row kept until the
    /// last sequence ends (the outputs are the same; only for measuring what the rollout
    /// engine saves, as the `rollout` bench does).
    pub fn static_batching(mut self) -> Self {
        self.batching = false;
        self
    }

    /// Prefills at most `tokens` prompt tokens per engine step, a longer prompt in chunks
    /// of `tokens` over several steps while the admitted sequences decode
    /// ([`EngineConfig::max_prefill_tokens`]; by default every prompt is prefilled in the
    /// first step). Same tokens; on the CPU a chunked prompt's log-probs and entropies are
    /// within rounding of the one-pass prefill's (the paged attention sums in another order).
    /// 0 is refused when generating.
    pub fn max_prefill_tokens(mut self, tokens: usize) -> Self {
        self.max_prefill_tokens = Some(tokens);
        self
    }

    /// Pads decode passes to buckets of rows and, on a backend that records graphs (CUDA),
    /// replays each bucket's pass as a captured graph ([`EngineConfig::decode_buckets`]).
    /// Same tokens.
    pub fn decode_buckets(mut self, on: bool) -> Self {
        self.decode_buckets = on;
        self
    }

    /// Keeps the engines' KV cache in `dtype` ([`EngineConfig::kv_cache_dtype`]): bf16
    /// halves its memory, the tokens then come from keys and values rounded to bf16.
    pub fn kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.kv_cache_dtype = dtype;
        self
    }

    /// Caps the engines' KV pool at `blocks` blocks ([`EngineConfig::max_blocks`]; `None`,
    /// the default: it grows as the sequences need): sequences beyond it wait for blocks or
    /// are preempted and restarted, with the same tokens. The memory plan sets it when a
    /// run's rollout would not fit otherwise.
    pub fn max_kv_blocks(mut self, blocks: Option<usize>) -> Self {
        self.max_kv_blocks = blocks;
        self
    }

    /// The model these weights were transposed from.
    pub fn model(&self) -> &'m Model<B> {
        self.model
    }

    /// [`Model::generate`] without its transpose.
    ///
    /// # Errors
    /// As [`Model::generate`].
    pub fn generate(&self, request: &GenerateRequest) -> Result<GenerateOutput, GenerateError> {
        self.run(request, None, &mut |_, _| {})
    }

    /// [`Generator::generate`], calling `on_token(sequence, token)` as each new token is
    /// picked (in order; the EOS id that ends a sequence included), for streaming output.
    /// Same outputs as [`Generator::generate`].
    ///
    /// # Errors
    /// As [`Model::generate`].
    pub fn generate_streaming(
        &self,
        request: &GenerateRequest,
        mut on_token: impl FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        self.run(request, None, &mut on_token)
    }

    /// [`Generator::generate_streaming`] for prompts with images or videos: `vision` gives
    /// the embeddings that replace their placeholder tokens and their M-RoPE positions
    /// (made by [`crate::vision::model::VlGenerator::generate`]).
    ///
    /// # Errors
    /// As [`Model::generate`], and `vision` not matching the prompts.
    pub fn generate_vision(
        &self,
        request: &GenerateRequest,
        vision: &PromptVision<'_, B>,
        mut on_token: impl FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        self.run(request, Some(vision), &mut on_token)
    }

    /// Several text requests through one rollout engine of `max_seqs` decode slots (the
    /// KV memory bound): their sequences are queued in order and each takes a slot as soon
    /// as one frees, instead of each request waiting for the previous one's longest
    /// sequence. Sequence `i` of every request samples from stream `(request.seed, i)`, so
    /// the outputs equal [`Generator::generate`] of each request. `on_finished(count)`
    /// reports the sequences finished so far.
    ///
    /// # Errors
    /// As [`Model::generate`] for each request; requests that differ in `max_new_tokens`,
    /// `eos_ids` or `sampling`.
    pub fn generate_many(
        &self,
        requests: &[GenerateRequest],
        max_seqs: usize,
        mut on_finished: impl FnMut(usize),
    ) -> Result<Vec<GenerateOutput>, GenerateError> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        for r in requests {
            self.model.check_request(r)?;
            if (r.max_new_tokens, &r.eos_ids, r.sampling)
                != (first.max_new_tokens, &first.eos_ids, first.sampling)
            {
                return Err(GenerateError::Sampling(
                    "generate_many: the requests differ in max_new_tokens, eos_ids or sampling"
                        .into(),
                ));
            }
        }
        if first.max_new_tokens == 0 {
            return Ok(requests
                .iter()
                .map(|r| {
                    GenerateOutput::from_sequences(vec![SequenceOutput::default(); r.prompts.len()])
                })
                .collect());
        }
        let request = EngineRequest {
            max_new_tokens: first.max_new_tokens,
            eos_ids: first.eos_ids.clone(),
            sampling: first.sampling,
            seed: first.seed,
        };
        let config = self.with_options(EngineConfig {
            max_seqs: max_seqs.max(1),
            ..EngineConfig::default()
        });
        let mut engine = Engine::new(self, request, config)?;
        let mut slots = Vec::new(); // (request, index) of each sequence id
        for (k, r) in requests.iter().enumerate() {
            for (i, p) in r.prompts.iter().enumerate() {
                engine.submit_with_stream(p.clone(), (r.seed, i as u64))?;
                slots.push((k, i));
            }
        }
        let mut outs: Vec<Vec<SequenceOutput>> = requests
            .iter()
            .map(|r| vec![SequenceOutput::default(); r.prompts.len()])
            .collect();
        let mut done = 0;
        while !engine.is_idle() {
            let finished = engine.step()?;
            done += finished.len();
            for f in finished {
                let (k, i) = slots[f.id];
                outs[k][i] = SequenceOutput {
                    tokens: f.tokens,
                    log_probs: f.log_probs,
                    entropies: f.entropies,
                    finished_by_eos: f.finished_by_eos,
                };
            }
            on_finished(done);
        }
        Ok(outs
            .into_iter()
            .map(GenerateOutput::from_sequences)
            .collect())
    }

    /// A request through the rollout engine (every sequence admitted at once, the KV pool
    /// unbounded: nothing is ever preempted), or statically batched.
    fn run(
        &self,
        request: &GenerateRequest,
        vision: Option<&PromptVision<'_, B>>,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        if !self.batching {
            return self
                .model
                .generate_static(request, &self.tw, vision, on_token);
        }
        self.model.check_request(request)?;
        if let Some(v) = vision {
            self.model.check_vision(request, v)?;
        }
        if request.max_new_tokens == 0 {
            let empty = vec![SequenceOutput::default(); request.prompts.len()];
            return Ok(GenerateOutput::from_sequences(empty));
        }
        let config = self.engine_config(request);
        let mut engine = Engine::with_prompts(self, request, vision, config)?;
        engine.run_to_end(on_token)
    }

    /// The engine sizes of `request` ([`EngineConfig::for_request`]) with this
    /// generator's prefill chunk and options.
    pub(crate) fn engine_config(&self, request: &GenerateRequest) -> EngineConfig {
        let mut config = EngineConfig::for_request(request, self.model.spec.kv_dim());
        if let Some(tokens) = self.max_prefill_tokens {
            config.max_prefill_tokens = tokens;
        }
        self.with_options(config)
    }

    /// `config` with the options set on this generator: decode buckets, the KV cache's
    /// dtype and its cap.
    fn with_options(&self, config: EngineConfig) -> EngineConfig {
        EngineConfig {
            decode_buckets: self.decode_buckets,
            kv_cache_dtype: self.kv_cache_dtype,
            max_blocks: self.max_kv_blocks,
            ..config
        }
    }
}

impl<'a, B: Backend> Engine<'a, B> {
    /// An engine generating with `generator`'s weights, nothing submitted yet.
    ///
    /// # Errors
    /// `max_new_tokens` 0, an EOS id out of range, invalid sampling or sizes, or a backend
    /// failure.
    pub fn new(
        generator: &'a Generator<'a, B>,
        request: EngineRequest,
        config: EngineConfig,
    ) -> Result<Self, GenerateError> {
        let check = GenerateRequest {
            prompts: vec![vec![0]],
            max_new_tokens: request.max_new_tokens,
            eos_ids: request.eos_ids.clone(),
            sampling: request.sampling,
            seed: request.seed,
        };
        generator.model().check_request(&check)?;
        if request.max_new_tokens == 0 {
            return Err(GenerateError::Sampling(
                "engine: max_new_tokens must be > 0".into(),
            ));
        }
        Self::build(generator.model, &generator.tw, None, request, config)
    }

    /// An engine holding every prompt of a checked `request` (sequence `i` = prompt `i`),
    /// with the multimodal inputs of `vision`.
    pub(crate) fn with_prompts(
        generator: &'a Generator<'a, B>,
        request: &GenerateRequest,
        vision: Option<&'a PromptVision<'a, B>>,
        config: EngineConfig,
    ) -> Result<Self, GenerateError> {
        let engine_request = EngineRequest {
            max_new_tokens: request.max_new_tokens,
            eos_ids: request.eos_ids.clone(),
            sampling: request.sampling,
            seed: request.seed,
        };
        let (model, tw) = (generator.model, &generator.tw);
        let mut engine = Self::build(model, tw, vision, engine_request, config)?;
        match vision {
            None => {
                for (i, p) in request.prompts.iter().enumerate() {
                    engine.submit_checked(p.clone(), (request.seed, i as u64));
                }
            }
            Some(v) => {
                let (unique, of_row) = unique_vision_prompts(&request.prompts, v);
                engine.submit_grouped(&request.prompts, unique, &of_row);
            }
        }
        Ok(engine)
    }
}

/// A prefill's result: the KV cache of the left-padded prompts (`width` slots each, plus
/// the room asked for) and each prompt's next-token logits `[prompts, vocab]`.
pub(crate) struct Prefill<B: Backend> {
    pub(crate) cache: KvCache<B>,
    pub(crate) logits: B::Buffer,
    pub(crate) width: usize,
}

impl<B: Backend> Model<B> {
    /// A forward pass over `inputs` `[batch, seq]` (the next `seq` tokens of every
    /// sequence in `cache`) with attention over the cache: appends the new tokens' keys,
    /// values and `attention_mask` at slots `cache.len()..+seq`, advances the cache and
    /// leaves the logits `[batch, seq, vocab]` in `acts` like [`Model::forward`]. A prompt
    /// batch at once is the prefill, one token per sequence a decode step. Positions are
    /// the caller's (`inputs.position_ids`). Unlike [`Model::forward`], the attention
    /// log-sum-exp is not saved (no backward through a cached pass).
    ///
    /// # Errors
    /// As [`Model::forward`]; the cache planned for another batch or too short;
    /// [`ModelError::ChunkedLogits`] for `acts` without whole logits (plan them with
    /// [`Model::activations_full`]). On a backend error the cache's contents past its length may have changed, its length not.
    pub fn forward_cached(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        cache: &mut KvCache<B>,
    ) -> Result<(), GenerateError> {
        acts.require_full("forward_cached")?;
        self.forward_cached_with(inputs, &ForwardExtras::default(), acts, cache, None)
    }

    /// The activation arena [`Model::generate`] plans for the prefill of `batch` prompts
    /// left-padded to `width` tokens: one layer's activations of the `batch · width` tokens
    /// (a forward pass into a KV cache has no backward to keep the others for: the
    /// checkpointed layout of [`Activations::planned`]) and an LM head of `batch` rows
    /// ([`HeadMode::Chunked`] with `rows = batch`, so [`Activations::logits_buffer_len`]
    /// is `batch · vocab`): generation needs the logits of each prompt's last position
    /// only, which the prefill computes from those rows of the final-norm output.
    ///
    /// # Errors
    /// As [`Activations::with_head`].
    pub fn prefill_activations(
        &self,
        batch: usize,
        width: usize,
    ) -> Result<Activations<B>, ModelError> {
        let head = HeadMode::Chunked { rows: batch };
        let f32 = super::ActLayout::F32;
        Activations::planned(&self.backend, &self.spec, batch, width, head, true, f32)
    }

    /// [`Model::forward_cached`] without the whole-logits check (a chunked arena stops at
    /// the final norm), with the linear layers on the transposed weights `tw` when given.
    fn forward_cached_with(
        &self,
        inputs: &Inputs<'_>,
        extras: &ForwardExtras<'_, B>,
        acts: &mut Activations<B>,
        cache: &mut KvCache<B>,
        tw: Option<&DecodeWeights<B>>,
    ) -> Result<(), GenerateError> {
        inputs.check(&self.spec)?;
        if cache.batch != inputs.batch {
            return Err(GenerateError::CacheBatch {
                cache: cache.batch,
                input: inputs.batch,
            });
        }
        let (len, new, max_len) = (cache.len, inputs.seq, cache.max_len);
        if new > max_len - len {
            return Err(GenerateError::CacheFull { len, new, max_len });
        }
        for (b, row) in inputs.attention_mask.chunks(new).enumerate() {
            let start = b * max_len + len;
            if let Some(slots) = cache.host_mask.get_mut(start..start + new) {
                for (slot, &m) in slots.iter_mut().zip(row) {
                    *slot = m as f32;
                }
            }
        }
        cache.upload_mask(&self.backend)?;
        self.forward_extras(inputs, extras, acts, Some(StepCache::Contiguous(cache)), tw)?;
        cache.len += new;
        Ok(())
    }

    /// The prefill's LM head, after a forward pass on an arena of
    /// [`Model::prefill_activations`]: gathers the final-norm output row of each
    /// sequence's last prompt position (token `b · width + width − 1`: the prompts are
    /// left-padded) into a `[batch, C]` buffer and multiplies it by the head, leaving the
    /// `[batch, V]` logits in the arena's logits buffer, whose view this returns.
    pub(crate) fn prefill_head<'a>(
        &self,
        acts: &'a mut Activations<B>,
        tw: &DecodeWeights<B>,
    ) -> Result<Tensor<'a, B>, GenerateError> {
        let (batch, width) = acts.shape();
        // u32 row ids: `generate` has checked that `batch · width` fits.
        let last: Vec<u32> = (0..batch).map(|b| ((b + 1) * width - 1) as u32).collect();
        self.prefill_head_rows(acts, tw, &last)
    }

    /// [`Model::prefill_head`] at the given token rows (one per sequence, as `b · width +
    /// position`): the last real token of each right-padded sequence.
    pub(crate) fn prefill_head_rows<'a>(
        &self,
        acts: &'a mut Activations<B>,
        tw: &DecodeWeights<B>,
        last: &[u32],
    ) -> Result<Tensor<'a, B>, GenerateError> {
        let (rows, width) = acts.shape();
        let batch = last.len();
        if batch != rows || last.iter().any(|&r| r as usize >= rows * width) {
            return Err(GenerateError::Sampling(format!(
                "prefill head: {batch} rows {last:?} for an arena of {rows} × {width}"
            )));
        }
        let (c, v) = (self.spec.hidden, self.spec.vocab);
        let be = &self.backend;
        let mut row_ids = be.alloc_ids(batch)?;
        be.upload_ids(last, &mut row_ids)?;
        let mut hidden = be.alloc(batch * c)?;
        be.embedding(
            &row_ids,
            View::whole(&acts.lnf),
            batch * width,
            c,
            ViewMut::whole(&mut hidden),
        )?;
        self.matmul(
            View::whole(&hidden),
            self.lm_head(batch, Some(tw)),
            ViewMut::new(&mut acts.logits, 0, batch * v)?,
        )?;
        Ok(View::new(&acts.logits, 0, batch * v)?)
    }

    /// Generates up to `request.max_new_tokens` tokens after each prompt, batched with a
    /// KV cache (see the module docs of `generate` for padding, positions and finished
    /// sequences). Deterministic: greedy has no randomness, sampling draws from per-prompt
    /// streams of `request.seed`, so the same request gives the same output, and a prompt
    /// gives the same tokens batched or alone (up to float rounding differences between
    /// batch shapes that would flip a near-tie).
    ///
    /// The prompt prefill keeps the activations of every prompt token but computes the LM
    /// head for each prompt's last position only ([`Model::prefill_activations`]): its
    /// logits take `batch · vocab` floats, not `batch · width · vocab`.
    ///
    /// Each call transposes the linear weights first; to generate
    /// several batches with the same weights, make a [`Generator`] once.
    ///
    /// # Errors
    /// No prompts, an empty prompt, a token or EOS id `>= vocab`, a prompt plus
    /// `max_new_tokens` longer than `max_position_embeddings`, invalid sampling
    /// parameters, non-finite logits, or a model/backend failure.
    pub fn generate(&self, request: &GenerateRequest) -> Result<GenerateOutput, GenerateError> {
        // a bad request fails before the weights are transposed
        self.check_request(request)?;
        self.generator()?.generate(request)
    }

    /// A [`Generator`]: the linear weights transposed once for any number of
    /// [`Generator::generate`] calls. It borrows the model, so the weights cannot change
    /// while it exists.
    ///
    /// # Errors
    /// A backend failure (out of memory for the second copy of the linear weights).
    pub fn generator(&self) -> Result<Generator<'_, B>, GenerateError> {
        self.generator_with(WeightDtype::F32)
    }

    /// [`Model::generator`] with the decode weights in `dtype`: [`WeightDtype::Bf16`]
    /// reads half the weight bytes per decode step; its tokens, log-probs and entropies
    /// are those of the bf16-rounded model, a little off the f32 one.
    ///
    /// # Errors
    /// As [`Model::generator`]; bf16 for a model with an odd-sized weight matrix.
    pub fn generator_with(&self, dtype: WeightDtype) -> Result<Generator<'_, B>, GenerateError> {
        Ok(Generator {
            model: self,
            tw: DecodeWeights::new(
                &self.backend,
                &self.spec,
                &self.weights,
                self.active_lora_params(),
                dtype,
                self.bf16_weights.as_ref(),
            )?,
            batching: true,
            max_prefill_tokens: None,
            decode_buckets: false,
            kv_cache_dtype: KvCacheDtype::F32,
            max_kv_blocks: None,
        })
    }

    /// Static batching with the transposed weights `tw` of this model's weights: every
    /// prompt prefilled on its own row of one left-padded batch, every row decoded until the
    /// last sequence ends (a finished row is fed its last token, its outputs ignored).
    /// The baseline the rollout engine is measured against; same outputs.
    fn generate_static(
        &self,
        request: &GenerateRequest,
        tw: &DecodeWeights<B>,
        vision: Option<&PromptVision<'_, B>>,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        let (prompts, max_new) = (&request.prompts, request.max_new_tokens);
        self.check_request(request)?;
        if let Some(v) = vision {
            self.check_vision(request, v)?;
        }
        let batch = prompts.len();
        let mut seqs = vec![SequenceOutput::default(); batch];
        if max_new > 0 {
            let all: Vec<usize> = (0..batch).collect();
            let Prefill {
                mut cache, logits, ..
            } = self.prefill(prompts, &all, vision, max_new, tw)?;
            let mut keys: Vec<_> = (0..batch as u64)
                .map(|i| sequence_key(request.seed, i))
                .collect();
            let mut done = vec![false; batch];
            let mut picks = Picks::new(&self.backend, batch, self.spec.vocab)?;
            let mut acts = self.activations_full(batch, 1)?;
            let mut ids = vec![0u32; batch];
            let mut positions = vec![0u32; batch];
            let ones = vec![1u32; batch];
            for step in 0..max_new {
                if step > 0 {
                    // Decode step: each row's newest token at its next position.
                    for (b, out) in seqs.iter().enumerate() {
                        let delta = vision.map_or(0, |v| v.rope_deltas[b]);
                        // check_vision has bounded every decode position
                        positions[b] = (prompts[b].len() as i64 + step as i64 - 1 + delta) as u32;
                        ids[b] = out.tokens.last().copied().unwrap_or(0);
                    }
                    let inputs = Inputs {
                        batch,
                        seq: 1,
                        input_ids: &ids,
                        attention_mask: &ones,
                        position_ids: &positions,
                    };
                    let none = ForwardExtras::default();
                    self.forward_cached_with(&inputs, &none, &mut acts, &mut cache, Some(tw))?;
                }
                let logits = if step == 0 {
                    View::whole(&logits)
                } else {
                    acts.logits()
                };
                let sampling = request.sampling;
                picks.pick(&self.backend, logits, sampling, |b| {
                    if done[b] {
                        SampleKey::default()
                    } else {
                        keys[b].advance()
                    }
                })?;
                for (b, out) in seqs.iter_mut().enumerate() {
                    if !done[b] {
                        let req = (&request.eos_ids[..], max_new);
                        done[b] = out.push(picks.row(b), req, b, on_token)?;
                    }
                }
                if done.iter().all(|&d| d) {
                    break;
                }
            }
        }
        Ok(GenerateOutput::from_sequences(seqs))
    }

    /// Prefills `members` (indices into `prompts`) in one left-padded pass into a KV cache
    /// of their width plus `room` slots, and computes each one's next-token logits
    /// (the LM head on its last position only). Multimodal prompts get their embedding
    /// rows and M-RoPE tables from `vision` (indexed by prompt).
    pub(crate) fn prefill(
        &self,
        prompts: &[Vec<u32>],
        members: &[usize],
        vision: Option<&PromptVision<'_, B>>,
        room: usize,
        tw: &DecodeWeights<B>,
    ) -> Result<Prefill<B>, GenerateError> {
        let u = members.len();
        let width = members.iter().map(|&i| prompts[i].len()).max().unwrap_or(0);
        let too_long = GenerateError::TooLong {
            index: members.first().copied().unwrap_or(0),
            prompt_len: width,
            max_new_tokens: room,
            max_len: u32::MAX as usize,
        };
        // Row gather of the last prompt position of each sequence needs u32 row indices.
        if u.checked_mul(width).is_none_or(|n| n > u32::MAX as usize) {
            return Err(too_long);
        }
        let max_len = width.checked_add(room).ok_or(too_long)?;
        let mut ids = vec![0u32; u * width];
        let mut mask = vec![0u32; u * width];
        let mut positions = vec![0u32; u * width];
        for (b, p) in members.iter().map(|&i| &prompts[i]).enumerate() {
            let pad = width - p.len();
            let row = b * width + pad..(b + 1) * width;
            ids[row.clone()].copy_from_slice(p);
            mask[row.clone()].iter_mut().for_each(|m| *m = 1);
            for (pos, i) in positions[row].iter_mut().zip(0u32..) {
                *pos = i;
            }
        }
        // Multimodal prompts: the replaced rows of the members (their embeddings gathered
        // unless the members are every prompt in order) and the M-RoPE tables in the padded
        // layout (padding keeps position 0's cos 1, sin 0; its keys are masked anyway).
        let half = self.spec.head_dim / 2;
        let hidden = self.spec.hidden;
        let mut rows = None;
        let mut rope = None;
        let mut gathered = None;
        if let Some(v) = vision {
            let mut flat: Vec<u32> = Vec::with_capacity(v.rows.len());
            let mut segments = Vec::new();
            for (k, &b) in members.iter().enumerate() {
                let start = v.rows.iter().position(|&(p, _)| p == b);
                let count = v.rows.iter().filter(|&&(p, _)| p == b).count();
                if let Some(start) = start {
                    segments.push((start, count));
                }
                for &(_, t) in v.rows.iter().filter(|&&(p, _)| p == b) {
                    flat.push((k * width + width - prompts[b].len() + t) as u32);
                }
            }
            let in_order =
                members.len() == prompts.len() && members.iter().enumerate().all(|(k, &b)| k == b);
            if !in_order {
                let mut buf = self.backend.alloc(flat.len() * hidden)?;
                let mut at = 0;
                for (start, count) in segments {
                    let n = count * hidden;
                    self.backend.copy(
                        View::new(v.embeds.buffer(), v.embeds.offset() + start * hidden, n)?,
                        ViewMut::new(&mut buf, at, n)?,
                    )?;
                    at += n;
                }
                gathered = Some(buf);
            }
            let mut ids = self.backend.alloc_ids(flat.len())?;
            self.backend.upload_ids(&flat, &mut ids)?;
            rows = Some(ids);
            let (mut cos, mut sin) = (
                vec![1.0f32; u * width * half],
                vec![0.0f32; u * width * half],
            );
            for (k, &b) in members.iter().enumerate() {
                let (c, s) = &v.rope[b];
                let start = (k * width + width - prompts[b].len()) * half;
                cos[start..start + c.len()].copy_from_slice(c);
                sin[start..start + s.len()].copy_from_slice(s);
            }
            rope = Some((cos, sin));
        }
        let embeds = match (&gathered, vision) {
            (Some(g), _) => Some(View::whole(g)),
            (None, Some(v)) => Some(v.embeds),
            (None, None) => None,
        };
        let extras = ForwardExtras {
            embeds: rows.as_ref().zip(embeds),
            rope: rope.as_ref().map(|(c, s)| (c.as_slice(), s.as_slice())),
            segments: None,
        };
        let mut cache = KvCache::new(&self.backend, &self.spec, u, max_len)?;
        let mut acts = self.prefill_activations(u, width)?;
        let inputs = Inputs {
            batch: u,
            seq: width,
            input_ids: &ids,
            attention_mask: &mask,
            position_ids: &positions,
        };
        self.forward_cached_with(&inputs, &extras, &mut acts, &mut cache, Some(tw))?;
        let head = self.prefill_head(&mut acts, tw)?;
        let mut logits = self.backend.alloc(head.len())?;
        self.backend.copy(head, ViewMut::whole(&mut logits))?;
        Ok(Prefill {
            cache,
            logits,
            width,
        })
    }

    /// The text RoPE cos and sin `[n, head_dim/2]` of positions `first..first + n` (the
    /// rows of the model's own tables: a multimodal conversation's text tokens, whose three
    /// M-RoPE axes are equal, take exactly these).
    ///
    /// # Errors
    /// Positions outside the tables (`[0, max_positions)`), or a backend failure.
    pub(crate) fn text_rope(
        &self,
        first: i64,
        n: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), GenerateError> {
        let half = self.spec.head_dim / 2;
        let end = first.checked_add(n as i64);
        if first < 0 || end.is_none_or(|e| e > self.rope_rows as i64) {
            return Err(GenerateError::Model(ModelError::VisionInput {
                message: format!(
                    "text positions {first}.. ({n} of them) leave the RoPE tables' [0, {})",
                    self.rope_rows
                ),
            }));
        }
        let (mut cos, mut sin) = (vec![0.0f32; n * half], vec![0.0f32; n * half]);
        if n > 0 {
            let at = first as usize * half;
            let be = &self.backend;
            be.download(View::new(&self.rope_cos, at, n * half)?, &mut cos)?;
            be.download(View::new(&self.rope_sin, at, n * half)?, &mut sin)?;
        }
        Ok((cos, sin))
    }

    /// Checks that `vision` fits `request`'s prompts: one M-RoPE table and delta per prompt,
    /// rows inside their prompts, and every decode position in `[0, max_positions)`.
    pub(crate) fn check_vision(
        &self,
        request: &GenerateRequest,
        v: &PromptVision<'_, B>,
    ) -> Result<(), GenerateError> {
        let bad = |message: String| GenerateError::Model(ModelError::VisionInput { message });
        let (batch, half) = (request.prompts.len(), self.spec.head_dim / 2);
        if v.rope.len() != batch || v.rope_deltas.len() != batch {
            return Err(bad(format!(
                "{} rope tables and {} rope deltas for {batch} prompts",
                v.rope.len(),
                v.rope_deltas.len()
            )));
        }
        if v.rows.len() * self.spec.hidden != v.embeds.len() {
            return Err(bad(format!(
                "{} replaced rows but {} embedding values (hidden {})",
                v.rows.len(),
                v.embeds.len(),
                self.spec.hidden
            )));
        }
        if let Some(&(b, t)) = v
            .rows
            .iter()
            .find(|&&(b, t)| b >= batch || t >= request.prompts[b].len())
        {
            return Err(bad(format!(
                "replaced row (prompt {b}, token {t}) is outside the prompts"
            )));
        }
        for (b, (p, (c, s))) in request.prompts.iter().zip(v.rope).enumerate() {
            if c.len() != p.len() * half || s.len() != p.len() * half {
                return Err(bad(format!(
                    "prompt {b}: rope tables of {} / {} values for {} tokens × {half}",
                    c.len(),
                    s.len(),
                    p.len()
                )));
            }
            let first = p.len() as i64 + v.rope_deltas[b];
            let last = first + request.max_new_tokens as i64;
            if first < 0 || last > self.spec.max_positions as i64 {
                return Err(bad(format!(
                    "prompt {b}: decode positions {first}..{last} (rope_delta {}) leave [0, {})",
                    v.rope_deltas[b], self.spec.max_positions
                )));
            }
        }
        Ok(())
    }

    /// Checks a request's prompts, EOS ids, lengths and sampling parameters.
    pub(crate) fn check_request(&self, request: &GenerateRequest) -> Result<(), GenerateError> {
        let vocab = self.spec.vocab;
        if request.prompts.is_empty() {
            return Err(GenerateError::NoPrompts);
        }
        for (index, p) in request.prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(GenerateError::EmptyPrompt { index });
            }
            if let Some((t, &id)) = p.iter().enumerate().find(|&(_, &id)| id as usize >= vocab) {
                return Err(GenerateError::TokenOutOfRange {
                    what: format!("prompt {index} token {t}"),
                    id,
                    vocab,
                });
            }
            let max_len = self.spec.max_positions;
            if p.len()
                .checked_add(request.max_new_tokens)
                .is_none_or(|n| n > max_len)
            {
                return Err(GenerateError::TooLong {
                    index,
                    prompt_len: p.len(),
                    max_new_tokens: request.max_new_tokens,
                    max_len,
                });
            }
        }
        if let Some((i, &id)) = request
            .eos_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab)
        {
            return Err(GenerateError::TokenOutOfRange {
                what: format!("eos_ids[{i}]"),
                id,
                vocab,
            });
        }
        request.sampling.check().map_err(GenerateError::Sampling)
    }
}
