//! Batched generation: [`Model::generate`] and its step [`Model::forward_cached`].
//!
//! The prompts are left-padded to the longest (pad id 0, key mask 0, positions counting
//! each prompt's own tokens from 0, so padding changes no valid token's numbers), run
//! through one forward pass that fills the [`KvCache`], then extended one token per step.
//! The prefill runs the LM head on each prompt's last position only (its final-norm rows
//! gathered into `[batch, C]`, see [`Model::prefill_activations`]), so its logits are
//! `[batch, V]` like a decode step's, not `[batch, width, V]`. After each forward these
//! next-token logits are copied to the host and a token picked ([`Sampling`]); the
//! log-prob of that token and the entropy of the sampling distribution are computed on the
//! device by [`Backend::log_prob_entropy`].
//!
//! Equal text prompts (a rollout group's n samples) share one prefill: each distinct prompt
//! runs through the prefill once, into a cache of the prompt width only, and its keys,
//! values and key mask are copied to every sequence that repeats it
//! ([`KvCache::fill_from_prefix`]), as are its first-token logits; each sequence still
//! samples from its own stream. The prefill work drops n-fold (bench `model_cpu rollout`).
//! Prompts with images or videos are prefilled one row each.
//!
//! The linear layers run on a transposed copy of the weights made at the start
//! ([`DecodeWeights`]: faster few-row products on the CPU, a second copy of the linear
//! weights in memory while generating).
//!
//! Finished sequences (an EOS id produced) stay in the batch, fed their last token, their
//! new tokens ignored, until they are a quarter of it: then the live sequences' keys and
//! values move to a smaller cache and the finished ones leave (each sequence keeps its own
//! sampling stream, so the tokens do not change). The loop ends when every sequence has
//! finished or `max_new_tokens` tokens were produced.

use rand_chacha::ChaCha20Rng;

use super::decode_weights::DecodeWeights;
use super::sampling::{sequence_rng, uniform};
use super::{Activations, ForwardExtras, HeadMode, Inputs, KvCache, Model, ModelError, Sampling};
use crate::backend::{Backend, BackendError, Tensor, View, ViewMut};

/// A generation request: a batch of prompts and how to continue them.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids, unpadded, one or more tokens each (padding is internal).
    pub prompts: Vec<Vec<u32>>,
    /// Tokens to generate at most per prompt (0: return empty outputs).
    pub max_new_tokens: usize,
    /// A sequence ends after producing any of these ids (included in its tokens).
    pub eos_ids: Vec<u32>,
    /// Greedy or sampled decoding.
    pub sampling: Sampling,
    /// Seed of the sampling streams (one per prompt, from the seed and the prompt's index,
    /// so prompt `i` gets the same tokens in any batch at index `i`); unused by greedy.
    pub seed: u64,
}

/// What [`Model::generate`] produced, one entry per prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerateOutput {
    /// New token ids (the prompt excluded), the EOS id included if one ended the sequence.
    pub tokens: Vec<Vec<u32>>,
    /// Log-prob of each new token under the sampling distribution `softmax(logits /
    /// temperature)` (temperature 1 for greedy), before top-k/top-p truncation.
    pub log_probs: Vec<Vec<f32>>,
    /// Entropy (nats) of that distribution at each new token, before truncation.
    pub entropies: Vec<Vec<f32>>,
    /// Whether the sequence ended with an EOS id (else it hit `max_new_tokens`).
    pub finished_by_eos: Vec<bool>,
}

/// Why a generation request or cached forward pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// The request has no prompt.
    #[error("generate: no prompts")]
    NoPrompts,
    /// A prompt has no token.
    #[error("generate: prompt {index} is empty")]
    EmptyPrompt {
        /// Index of the prompt.
        index: usize,
    },
    /// A prompt or EOS token id is not below the vocabulary size.
    #[error("generate: {what} id {id} is out of range for vocab_size {vocab}")]
    TokenOutOfRange {
        /// Which id (`prompt 3 token 5`, `eos_ids[0]`).
        what: String,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A prompt plus the new tokens would need positions past the model's
    /// `max_position_embeddings` (the RoPE table), or more memory than can be addressed.
    #[error(
        "generate: prompt {index} of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the maximum sequence length {max_len}"
    )]
    TooLong {
        /// Index of the prompt.
        index: usize,
        /// Its length.
        prompt_len: usize,
        /// The requested new tokens.
        max_new_tokens: usize,
        /// The longest sequence the model supports.
        max_len: usize,
    },
    /// Invalid sampling parameters.
    #[error("generate: invalid sampling: {0}")]
    Sampling(String),
    /// No token can be picked from a row of logits (NaN, +∞, or all −∞).
    #[error("generate: sequence {sequence}, new token {step}: logits are not finite")]
    NonFiniteLogits {
        /// Index of the sequence.
        sequence: usize,
        /// Index of the new token.
        step: usize,
    },
    /// The cache holds another number of sequences than the input.
    #[error("KV cache holds {cache} sequences, the input has {input}")]
    CacheBatch {
        /// Sequences in the cache.
        cache: usize,
        /// Sequences in the input.
        input: usize,
    },
    /// The new tokens do not fit in the cache.
    #[error("KV cache of {max_len} slots holds {len}, {new} new tokens do not fit")]
    CacheFull {
        /// Filled slots.
        len: usize,
        /// New tokens per sequence.
        new: usize,
        /// Slots per sequence.
        max_len: usize,
    },
    /// The model or backend failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<BackendError> for GenerateError {
    fn from(e: BackendError) -> Self {
        Self::Model(e.into())
    }
}

/// The multimodal side of a generation request (Qwen2-VL family): the embeddings that
/// replace prompt tokens, and M-RoPE positions in place of `0..len`.
pub struct PromptVision<'a, B: Backend> {
    /// Embeddings `[k, hidden]` replacing prompt tokens (image / video placeholders).
    pub embeds: Tensor<'a, B>,
    /// For each row of `embeds`, `(prompt, token index in that prompt)`.
    pub rows: &'a [(usize, usize)],
    /// Per prompt, the M-RoPE cos and sin `[len, head_dim/2]` of its tokens.
    pub rope: &'a [(Vec<f32>, Vec<f32>)],
    /// Per prompt, `rope_delta`: new token `k` (from 0) sits at position `len + k +
    /// rope_delta` on all three axes (a text position).
    pub rope_deltas: &'a [i64],
    /// Per prompt, the first prompt whose embedding rows are the same values (itself when
    /// none before is; `usize::MAX` for a prompt without embedding rows), as the caller knows it (the VL generator runs the tower once per
    /// image set); `None`: no sharing. Prompts equal in ids, embeddings, M-RoPE tables and
    /// delta then share one prefill.
    pub same_embeds: Option<&'a [usize]>,
}

/// A model with its linear weights transposed for generation ([`Model::generator`]):
/// batches generated through it share one transpose. Same outputs as [`Model::generate`].
pub struct Generator<'m, B: Backend> {
    model: &'m Model<B>,
    tw: DecodeWeights<B>,
    /// Shared prefill of equal prompts and finished sequences leaving the batch (the
    /// default); off: every prompt prefilled, every row kept to the end.
    batching: bool,
}

impl<B: Backend> Generator<'_, B> {
    /// Static batching: every prompt prefilled on its own row and every row kept until the
    /// last sequence ends (the outputs are the same; only for measuring what shared prefill
    /// and compaction save, as the `rollout` bench does).
    pub fn static_batching(mut self) -> Self {
        self.batching = false;
        self
    }

    /// [`Model::generate`] without its transpose.
    ///
    /// # Errors
    /// As [`Model::generate`].
    pub fn generate(&self, request: &GenerateRequest) -> Result<GenerateOutput, GenerateError> {
        self.model
            .generate_with(request, &self.tw, None, self.batching, &mut |_, _| {})
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
        self.model
            .generate_with(request, &self.tw, None, self.batching, &mut on_token)
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
        self.model.generate_with(
            request,
            &self.tw,
            Some(vision),
            self.batching,
            &mut on_token,
        )
    }
}

/// The distinct prompts of `prompts` (indices of their first occurrences, in order) and,
/// for every prompt, the index of its distinct prompt in that list.
fn unique_prompts(prompts: &[Vec<u32>]) -> (Vec<usize>, Vec<usize>) {
    let mut first: std::collections::HashMap<&[u32], usize> = std::collections::HashMap::new();
    let mut unique = Vec::new();
    let of_row = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            *first.entry(p.as_slice()).or_insert_with(|| {
                unique.push(i);
                unique.len() - 1
            })
        })
        .collect();
    (unique, of_row)
}

/// [`unique_prompts`] for multimodal prompts: two prompts are equal when their ids, their
/// embedding rows (by the caller's `same_embeds`), M-RoPE tables and deltas are; without
/// `same_embeds` every prompt is its own.
fn unique_vision_prompts<B: Backend>(
    prompts: &[Vec<u32>],
    v: &PromptVision<'_, B>,
) -> (Vec<usize>, Vec<usize>) {
    let Some(same) = v.same_embeds else {
        return ((0..prompts.len()).collect(), (0..prompts.len()).collect());
    };
    let mut unique: Vec<usize> = Vec::new();
    let mut of_row = Vec::with_capacity(prompts.len());
    for b in 0..prompts.len() {
        let equal = |&a: &usize| {
            prompts[a] == prompts[b]
                && same.get(a) == same.get(b)
                && v.rope_deltas[a] == v.rope_deltas[b]
                && v.rope[a] == v.rope[b]
        };
        match unique.iter().position(equal) {
            Some(k) => of_row.push(k),
            None => {
                of_row.push(unique.len());
                unique.push(b);
            }
        }
    }
    (unique, of_row)
}

/// The per-token state of a generation: each sequence's sampling stream, newest token and
/// whether it has finished, with the host and device buffers of one pick.
struct Picker<'r, B: Backend> {
    request: &'r GenerateRequest,
    vocab: usize,
    rngs: Vec<ChaCha20Rng>,
    /// The sequence of each row of the logits (all sequences, in order, until finished
    /// ones leave the batch).
    rows: Vec<usize>,
    /// This step's uniform draw of each row (sampling).
    uniforms: Vec<f64>,
    /// The backend's pick of each row, `u32::MAX` for a row without a token.
    picked: Vec<u32>,
    /// The token each sequence picked last (fed to the next decode step).
    next: Vec<u32>,
    targets: B::Ids,
    log_prob: B::Buffer,
    entropy: B::Buffer,
    host_lp: Vec<f32>,
    host_ent: Vec<f32>,
    /// Whether each sequence has produced an EOS id.
    done: Vec<bool>,
}

impl<'r, B: Backend> Picker<'r, B> {
    /// The state before the first token of `request`'s prompts.
    fn new(be: &B, request: &'r GenerateRequest, vocab: usize) -> Result<Self, GenerateError> {
        let batch = request.prompts.len();
        Ok(Self {
            request,
            vocab,
            rngs: (0..batch as u64)
                .map(|i| sequence_rng(request.seed, i))
                .collect(),
            rows: (0..batch).collect(),
            uniforms: vec![0.0; batch],
            picked: vec![0; batch],
            next: vec![0; batch],
            targets: be.alloc_ids(batch)?,
            log_prob: be.alloc(batch)?,
            entropy: be.alloc(batch)?,
            host_lp: vec![0.0; batch],
            host_ent: vec![0.0; batch],
            done: vec![false; batch],
        })
    }

    /// Keeps rows `keep` (indices into the current rows) and drops the others: the buffers
    /// of one pick shrink to the new row count.
    fn compact(&mut self, be: &B, keep: &[usize]) -> Result<(), GenerateError> {
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        let n = self.rows.len();
        self.uniforms.truncate(n);
        self.picked.truncate(n);
        self.host_lp.truncate(n);
        self.host_ent.truncate(n);
        self.targets = be.alloc_ids(n)?;
        self.log_prob = be.alloc(n)?;
        self.entropy = be.alloc(n)?;
        Ok(())
    }

    /// New token `step` of every unfinished sequence from `logits` `[batch, vocab]` (each
    /// sequence's next-token logits): picks it, computes its log-prob and the entropy of
    /// the sampling distribution on the device, appends all three to `out` and marks
    /// sequences that produced an EOS id. `on_token(sequence, token)` sees each new token.
    fn step(
        &mut self,
        be: &B,
        logits: Tensor<'_, B>,
        step: usize,
        out: &mut GenerateOutput,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<(), GenerateError> {
        let request = self.request;
        if request.sampling == Sampling::Greedy {
            // on the device: only the picked ids cross to the host, and they are already
            // where the log-prob below needs them
            be.greedy_tokens(logits, self.vocab, &mut self.targets, &mut self.picked)?;
        } else if let Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } = request.sampling
        {
            // one draw per unfinished sequence from its own stream, then the backend walks
            // the candidates (the CUDA backend on the device)
            for (u, &b) in self.uniforms.iter_mut().zip(&self.rows) {
                *u = if self.done[b] {
                    0.0
                } else {
                    uniform(&mut self.rngs[b])
                };
            }
            be.sample_tokens(
                logits,
                self.vocab,
                temperature,
                top_k,
                top_p,
                &self.uniforms,
                &mut self.targets,
                &mut self.picked,
            )?;
        }
        for (&b, &id) in self.rows.iter().zip(&self.picked) {
            if !self.done[b] {
                if id == u32::MAX {
                    return Err(GenerateError::NonFiniteLogits { sequence: b, step });
                }
                self.next[b] = id;
            }
        }
        be.log_prob_entropy(
            logits,
            self.vocab,
            request.sampling.temperature(),
            &self.targets,
            ViewMut::whole(&mut self.log_prob),
            ViewMut::whole(&mut self.entropy),
        )?;
        be.download(View::whole(&self.log_prob), &mut self.host_lp)?;
        be.download(View::whole(&self.entropy), &mut self.host_ent)?;
        for (r, &b) in self.rows.iter().enumerate() {
            if self.done[b] {
                continue;
            }
            out.tokens[b].push(self.next[b]);
            on_token(b, self.next[b]);
            out.log_probs[b].push(self.host_lp[r]);
            out.entropies[b].push(self.host_ent[r]);
            if request.eos_ids.contains(&self.next[b]) {
                self.done[b] = true;
                out.finished_by_eos[b] = true;
            }
        }
        Ok(())
    }
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
    /// left-padded to `width` tokens: every per-token activation of the `batch · width`
    /// tokens, but an LM head of `batch` rows ([`HeadMode::Chunked`] with `rows = batch`,
    /// so [`Activations::logits_buffer_len`] is `batch · vocab`): generation needs the
    /// logits of each prompt's last position only, which the prefill computes from those
    /// rows of the final-norm output.
    ///
    /// # Errors
    /// As [`Activations::with_head`].
    pub fn prefill_activations(
        &self,
        batch: usize,
        width: usize,
    ) -> Result<Activations<B>, ModelError> {
        let head = HeadMode::Chunked { rows: batch };
        Activations::with_head(&self.backend, &self.spec, batch, width, head)
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
        self.forward_extras(inputs, extras, acts, Some(cache), tw)?;
        cache.len += new;
        Ok(())
    }

    /// The prefill's LM head, after a forward pass on an arena of
    /// [`Model::prefill_activations`]: gathers the final-norm output row of each
    /// sequence's last prompt position (token `b · width + width − 1`: the prompts are
    /// left-padded) into a `[batch, C]` buffer and multiplies it by the head, leaving the
    /// `[batch, V]` logits in the arena's logits buffer, whose view this returns.
    fn prefill_head<'a>(
        &self,
        acts: &'a mut Activations<B>,
        tw: &DecodeWeights<B>,
    ) -> Result<Tensor<'a, B>, GenerateError> {
        let (batch, width) = acts.shape();
        let (c, v) = (self.spec.hidden, self.spec.vocab);
        let be = &self.backend;
        // u32 row ids: `generate` has checked that `batch · width` fits.
        let last: Vec<u32> = (0..batch).map(|b| ((b + 1) * width - 1) as u32).collect();
        let mut row_ids = be.alloc_ids(batch)?;
        be.upload_ids(&last, &mut row_ids)?;
        let mut hidden = be.alloc(batch * c)?;
        be.embedding(
            &row_ids,
            View::whole(&acts.lnf),
            batch * width,
            c,
            ViewMut::whole(&mut hidden),
        )?;
        be.linear_transposed(
            View::whole(&hidden),
            View::whole(&tw.lm_head),
            None,
            self.linear_dims(batch, c, v),
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
        Ok(Generator {
            model: self,
            tw: DecodeWeights::new(&self.backend, &self.spec, &self.weights)?,
            batching: true,
        })
    }

    /// [`Model::generate`] with the transposed weights `tw` of this model's weights,
    /// calling `on_token(sequence, token)` for each new token.
    fn generate_with(
        &self,
        request: &GenerateRequest,
        tw: &DecodeWeights<B>,
        vision: Option<&PromptVision<'_, B>>,
        batching: bool,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        let (prompts, max_new) = (&request.prompts, request.max_new_tokens);
        self.check_request(request)?;
        if let Some(v) = vision {
            self.check_vision(request, v)?;
        }
        let batch = prompts.len();
        let mut out = GenerateOutput {
            tokens: vec![Vec::new(); batch],
            log_probs: vec![Vec::new(); batch],
            entropies: vec![Vec::new(); batch],
            finished_by_eos: vec![false; batch],
        };
        if max_new == 0 {
            return Ok(out);
        }
        let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let max_len = width + max_new;
        let too_long = |index: usize| GenerateError::TooLong {
            index,
            prompt_len: prompts.get(index).map_or(0, Vec::len),
            max_new_tokens: max_new,
            max_len: u32::MAX as usize,
        };
        // Row gather of the last prompt position of each sequence needs u32 row indices.
        if batch
            .checked_mul(width)
            .is_none_or(|n| n > u32::MAX as usize)
        {
            return Err(too_long(0));
        }

        // Shared prefill: equal text prompts (a rollout group's n samples) are prefilled
        // once and their keys and values copied to each sequence; multimodal prompts are
        // prefilled one row each.
        let (unique, of_row) = match vision {
            _ if !batching => ((0..batch).collect(), (0..batch).collect()),
            None => unique_prompts(prompts),
            Some(v) => unique_vision_prompts(prompts, v),
        };
        let u = unique.len();
        // Prefill: the left-padded (unique) prompts in one pass.
        let mut ids = vec![0u32; u * width];
        let mut mask = vec![0u32; u * width];
        let mut positions = vec![0u32; u * width];
        for (b, p) in unique.iter().map(|&i| &prompts[i]).enumerate() {
            let pad = width - p.len();
            let row = b * width + pad..(b + 1) * width;
            ids[row.clone()].copy_from_slice(p);
            mask[row.clone()].iter_mut().for_each(|m| *m = 1);
            for (pos, i) in positions[row].iter_mut().zip(0u32..) {
                *pos = i;
            }
        }
        // Multimodal prompts: the replaced rows (of the prefilled prompts, their embeddings
        // gathered when some prompts are shared) and the M-RoPE tables in the padded layout
        // (padding keeps position 0's cos 1, sin 0; its keys are masked anyway).
        let half = self.spec.head_dim / 2;
        let hidden = self.spec.hidden;
        let mut rows = None;
        let mut rope = None;
        let mut gathered = None;
        if let Some(v) = vision {
            let mut flat: Vec<u32> = Vec::with_capacity(v.rows.len());
            let mut segments = Vec::new();
            for (k, &b) in unique.iter().enumerate() {
                let start = v.rows.iter().position(|&(p, _)| p == b);
                let count = v.rows.iter().filter(|&&(p, _)| p == b).count();
                if let Some(start) = start {
                    segments.push((start, count));
                }
                for &(_, t) in v.rows.iter().filter(|&&(p, _)| p == b) {
                    flat.push((k * width + width - prompts[b].len() + t) as u32);
                }
            }
            if u < batch {
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
            for (k, &b) in unique.iter().enumerate() {
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
        };
        let mut picker = Picker::new(&self.backend, request, self.spec.vocab)?;
        let mut cache;
        {
            let mut prefill = self.prefill_activations(u, width)?;
            let inputs = Inputs {
                batch: u,
                seq: width,
                input_ids: &ids,
                attention_mask: &mask,
                position_ids: &positions,
            };
            if u == batch {
                cache = KvCache::new(&self.backend, &self.spec, batch, max_len)?;
                self.forward_cached_with(&inputs, &extras, &mut prefill, &mut cache, Some(tw))?;
                let logits = self.prefill_head(&mut prefill, tw)?;
                picker.step(&self.backend, logits, 0, &mut out, on_token)?;
            } else {
                let mut shared = KvCache::new(&self.backend, &self.spec, u, width)?;
                self.forward_cached_with(&inputs, &extras, &mut prefill, &mut shared, Some(tw))?;
                cache = KvCache::new(&self.backend, &self.spec, batch, max_len)?;
                cache.fill_from_prefix(&self.backend, &shared, &of_row)?;
                drop(shared);
                // each sequence's first-token logits: its prompt's row
                let v = self.spec.vocab;
                let unique_logits = self.prefill_head(&mut prefill, tw)?;
                let mut logits = self.backend.alloc(batch * v)?;
                for (b, &r) in of_row.iter().enumerate() {
                    self.backend.copy(
                        View::new(unique_logits.buffer(), unique_logits.offset() + r * v, v)?,
                        ViewMut::new(&mut logits, b * v, v)?,
                    )?;
                }
                picker.step(&self.backend, View::whole(&logits), 0, &mut out, on_token)?;
            }
            // The prefill arena is freed before the decode arena is planned.
        }

        let mut step_acts = self.activations_full(batch, 1)?;
        let mut step_mask = vec![1u32; batch];
        let mut step_ids = vec![0u32; batch];
        let mut step_positions = vec![0u32; batch];
        for step in 1..max_new {
            if picker.done.iter().all(|&d| d) {
                break;
            }
            // Finished sequences leave the batch once they are a quarter of it: the live
            // rows' keys and values move to a smaller cache, so later steps do less work.
            let finished = picker.rows.iter().filter(|&&b| picker.done[b]).count();
            if batching && finished > 0 && finished * 4 >= picker.rows.len() {
                let keep: Vec<usize> = (0..picker.rows.len())
                    .filter(|&r| !picker.done[picker.rows[r]])
                    .collect();
                let mut live = KvCache::new(&self.backend, &self.spec, keep.len(), max_len)?;
                live.fill_from_prefix(&self.backend, &cache, &keep)?;
                cache = live;
                picker.compact(&self.backend, &keep)?;
                let n = keep.len();
                step_acts = self.activations_full(n, 1)?;
                step_mask.truncate(n);
                step_ids.truncate(n);
                step_positions.truncate(n);
            }
            // Decode step: each row's newest token at its next position (a finished
            // sequence still in the batch repeats its last token; its outputs are ignored).
            for (r, &b) in picker.rows.iter().enumerate() {
                let delta = vision.map_or(0, |v| v.rope_deltas[b]);
                // check_vision has bounded every decode position
                step_positions[r] = (prompts[b].len() as i64 + step as i64 - 1 + delta) as u32;
                step_ids[r] = picker.next[b];
            }
            let inputs = Inputs {
                batch: picker.rows.len(),
                seq: 1,
                input_ids: &step_ids,
                attention_mask: &step_mask,
                position_ids: &step_positions,
            };
            let none = ForwardExtras::default();
            self.forward_cached_with(&inputs, &none, &mut step_acts, &mut cache, Some(tw))?;
            picker.step(&self.backend, step_acts.logits(), step, &mut out, on_token)?;
        }
        Ok(out)
    }

    /// Checks that `vision` fits `request`'s prompts: one M-RoPE table and delta per prompt,
    /// rows inside their prompts, and every decode position in `[0, max_positions)`.
    fn check_vision(
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
    fn check_request(&self, request: &GenerateRequest) -> Result<(), GenerateError> {
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
