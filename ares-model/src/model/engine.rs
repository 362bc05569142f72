//! [`Engine`]: the rollout engine — continuous batching over a paged KV cache, with each
//! prompt prefilled once for all of its samples.
//!
//! Sequences are [`Engine::submit`]ted (a prompt each) and wait in a queue. Each
//! [`Engine::step`]:
//!
//! 1. **decodes** one token for every running sequence in one batch (each sequence at its
//!    own length, attention over its own blocks: no padding). A sequence whose newest slot
//!    starts a block gets one from the [`BlockPool`]; when the budget is used up the most
//!    recently admitted sequence is **preempted** (its blocks freed, it goes back to the
//!    front of the queue and later starts again from its prompt with its stream reset, so
//!    its tokens do not change);
//! 2. **prefills one chunk** of a prompt longer than `max_prefill_tokens` (chunked
//!    prefill): the chunk's tokens run as one sequence over the prompt's own blocks, each
//!    attending to the chunks before it in the paged cache (a multimodal chunk with its
//!    image/video rows and its span of the M-RoPE tables), so a long prompt takes several
//!    steps and the running sequences keep decoding meanwhile;
//! 3. **admits** waiting sequences in order while a decode slot (`max_seqs`) and blocks are
//!    free, **prefilling** the prompts not cached yet in one left-padded pass (at most
//!    `max_prefill_tokens` prompt tokens a step, counting this step's chunk, so decoding is
//!    not starved; a longer prompt starts a chunked prefill and the queue waits for it),
//!    and picks each admitted sequence's first token from its prompt's logits.
//!
//! Shared prefill: a prompt's keys and values are written once into blocks; each sample
//! shares its full blocks (reference counts) and gets its own copy of the last, partial
//! one, so samples never write into a shared block. The cached prompt lives while samples
//! of it still wait. Two prompts are the same when their ids are (text), or their ids,
//! embeddings, M-RoPE tables and deltas are (multimodal, see [`PromptVision`]).
//!
//! Multi-turn continuations ([`Engine::keep_finished`], [`Engine::continue_with`]): a
//! finished sequence can keep its blocks, and its next turn — its tokens, then the tokens
//! a tool's answer appended — prefills only its last token and the appended ones over
//! them. Continuations admitted in one step share one right-padded pass (padding writes go
//! to a scratch block and no real query attends to them). When blocks run short, kept
//! blocks are freed before anything is preempted, and a continuation without them
//! prefills its whole conversation.
//!
//! Determinism: sequence `i` samples from its own stream (`seed`, `i`), and on the CPU every
//! row's numbers are independent of the other rows of a pass (the decode products are
//! batch-invariant), so its tokens do not depend on which sequences share a step; they
//! equal one-by-one generation (tests in `tests/model_generate.rs`). A chunked prompt's
//! numbers depend on its chunk size only (the paged attention sums in another order than
//! the one-pass prefill): the same tokens in any batch, log-probs within rounding of an
//! unchunked prefill.

use std::collections::{HashMap, VecDeque};

use rand_chacha::ChaCha20Rng;

use super::decode_weights::DecodeWeights;
use super::generate::{Picks, SequenceOutput, unique_vision_prompts};
use super::kv_cache::StepCache;
use super::sampling::{sequence_rng, uniform};
use super::{
    Activations, BlockPool, ForwardExtras, GenerateError, GenerateOutput, GenerateRequest,
    Generator, Inputs, Model, PromptVision, Sampling,
};
use crate::backend::{Backend, BlockTables, View, ViewMut};

/// Sizes of the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Sequences decoded together at most (vLLM's `max_num_seqs`).
    pub max_seqs: usize,
    /// Token slots per KV block (vLLM's default is 16).
    pub block_size: usize,
    /// KV blocks at most (the cache's memory budget, shared by all layers); `None`: the
    /// pool grows as needed and nothing is preempted.
    pub max_blocks: Option<usize>,
    /// Prompt tokens prefilled per step at most (≥ 1): a prompt longer than this is
    /// prefilled in chunks of this many tokens, one chunk a step.
    pub max_prefill_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_seqs: 256,
            block_size: 16,
            max_blocks: None,
            max_prefill_tokens: 8192,
        }
    }
}

impl EngineConfig {
    /// The configuration [`Generator::generate`] uses: every sequence of `request`
    /// admitted in the first step (one decode slot each), an unbounded pool.
    pub(crate) fn for_request(request: &GenerateRequest, _kv_dim: usize) -> Self {
        let tokens: usize = request.prompts.iter().map(Vec::len).sum();
        Self {
            max_seqs: request.prompts.len(),
            max_prefill_tokens: tokens.max(1),
            ..Self::default()
        }
    }

    fn check(&self) -> Result<(), GenerateError> {
        let bad = |what: &str| GenerateError::Sampling(format!("engine config: {what}"));
        if self.max_seqs == 0 {
            return Err(bad("max_seqs must be > 0"));
        }
        if self.block_size == 0 || self.block_size > u32::MAX as usize {
            return Err(bad("block_size must be > 0"));
        }
        if self.max_blocks == Some(0) {
            return Err(bad("max_blocks must be > 0"));
        }
        if self.max_prefill_tokens == 0 {
            return Err(bad("max_prefill_tokens must be > 0"));
        }
        Ok(())
    }
}

/// How the engine generates: the same for every sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    /// Tokens to generate at most per sequence (≥ 1).
    pub max_new_tokens: usize,
    /// A sequence ends after producing any of these ids (included in its tokens).
    pub eos_ids: Vec<u32>,
    /// Greedy or sampled decoding.
    pub sampling: Sampling,
    /// Seed of the sampling streams: sequence `i` (the `i`-th submitted) draws from stream
    /// `(seed, i)`, as prompt `i` of a [`GenerateRequest`] does.
    pub seed: u64,
}

/// A sequence that has ended.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedSequence {
    /// Its id (the order of [`Engine::submit`], from 0).
    pub id: usize,
    /// New token ids, the EOS id included if one ended it.
    pub tokens: Vec<u32>,
    /// Log-prob of each new token under the sampling distribution (as [`GenerateOutput`]).
    pub log_probs: Vec<f32>,
    /// Entropy of the sampling distribution at each new token.
    pub entropies: Vec<f32>,
    /// Whether an EOS id ended it (else `max_new_tokens`).
    pub finished_by_eos: bool,
}

/// What the engine has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: usize,
    /// Decode forward passes and the sequence rows they carried.
    pub decode_passes: usize,
    /// Sum over decode passes of their rows.
    pub decode_rows: usize,
    /// Prefill passes and the prompts and prompt tokens they carried.
    pub prefill_passes: usize,
    /// Prompts prefilled.
    pub prefill_prompts: usize,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Continuation passes ([`Engine::continue_with`]) and the tokens they prefilled
    /// (each continuation's new tokens only: its conversation so far stays in its kept
    /// blocks).
    pub extend_passes: usize,
    /// Tokens prefilled by continuation passes.
    pub extend_tokens: usize,
    /// Sequences preempted (restarted later).
    pub preemptions: usize,
    /// The most KV blocks in use at once.
    pub peak_blocks: usize,
    /// The most KV blocks allocated at once (the memory held).
    pub peak_capacity: usize,
}

/// One sequence's state.
struct Sequence {
    prompt: usize,
    /// Its sampling stream `(seed, index)`, and the stream itself.
    stream: (u64, u64),
    rng: ChaCha20Rng,
    /// Its blocks, in order.
    blocks: Vec<u32>,
    /// Filled slots (its prompt and the tokens fed back so far).
    len: usize,
    out: SequenceOutput,
    /// Its new tokens at most.
    max_new: usize,
    /// Order of admission (preemption takes the latest).
    admitted: usize,
}

/// A finished sequence kept for [`Engine::continue_with`]: its tokens (prompt and new)
/// and, unless memory ran short, its blocks holding the keys and values of the first
/// `len` of them (all but the last new token, never fed back).
struct Kept {
    ids: Vec<u32>,
    cache: Option<KeptCache>,
}

/// Blocks holding the keys and values of a sequence's first `len` tokens.
struct KeptCache {
    blocks: Vec<u32>,
    len: usize,
}

/// A prompt prefilled once: its blocks (owned by the prefix) and next-token logits.
struct Prefix<B: Backend> {
    blocks: Vec<u32>,
    len: usize,
    logits: B::Buffer,
}

/// A prompt prefilled over several steps, at most `max_prefill_tokens` of it a step,
/// into blocks it owns until its last chunk makes it a [`Prefix`].
struct ChunkedPrefill {
    group: usize,
    /// The first sequence waiting for it (named in errors).
    first: usize,
    blocks: Vec<u32>,
    /// Prompt tokens in the blocks so far.
    done: usize,
}

/// The rollout engine over a [`Generator`]'s weights; see the module docs.
pub struct Engine<'a, B: Backend> {
    model: &'a Model<B>,
    tw: &'a DecodeWeights<B>,
    vision: Option<&'a PromptVision<'a, B>>,
    request: EngineRequest,
    config: EngineConfig,
    pool: BlockPool<B>,
    /// Prompts by index, and the prefix group of each.
    prompts: Vec<Vec<u32>>,
    group_of: Vec<usize>,
    /// The first prompt of each group, and its sequences waiting for admission.
    group_prompt: Vec<usize>,
    waiting: Vec<usize>,
    text_groups: HashMap<Vec<u32>, usize>,
    prefixes: HashMap<usize, Prefix<B>>,
    /// The prompt being prefilled in chunks, and its pass's arena.
    chunked: Option<ChunkedPrefill>,
    chunk_acts: Option<Activations<B>>,
    seqs: Vec<Option<Sequence>>,
    pending: VecDeque<usize>,
    /// Running sequences in admission order.
    running: Vec<usize>,
    admissions: usize,
    picks: Picks<B>,
    acts: Option<Activations<B>>,
    stats: EngineStats,
    /// Whether finished sequences keep their blocks for [`Engine::continue_with`].
    keep_finished: bool,
    /// Finished sequences kept, by id.
    kept: HashMap<usize, Kept>,
    /// Continuations waiting for admission, by id: the blocks they extend.
    extend: HashMap<usize, KeptCache>,
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
        Self::build(generator, None, request, config)
    }

    fn build(
        generator: &'a Generator<'a, B>,
        vision: Option<&'a PromptVision<'a, B>>,
        request: EngineRequest,
        config: EngineConfig,
    ) -> Result<Self, GenerateError> {
        config.check()?;
        let model = generator.model();
        let be = &model.backend;
        let budget = config.max_blocks.unwrap_or(u32::MAX as usize);
        let initial = (4 * config.max_seqs).min(budget);
        let pool = BlockPool::new(
            be,
            model.spec.layers,
            model.spec.kv_dim(),
            config.block_size,
            initial,
            budget,
        )?;
        Ok(Self {
            model,
            tw: generator.weights(),
            vision,
            request,
            config,
            pool,
            prompts: Vec::new(),
            group_of: Vec::new(),
            group_prompt: Vec::new(),
            waiting: Vec::new(),
            text_groups: HashMap::new(),
            prefixes: HashMap::new(),
            chunked: None,
            chunk_acts: None,
            seqs: Vec::new(),
            pending: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
            picks: Picks::new(be, 1, model.spec.vocab)?,
            acts: None,
            stats: EngineStats::default(),
            keep_finished: false,
            kept: HashMap::new(),
            extend: HashMap::new(),
        })
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
        let mut engine = Self::build(generator, vision, engine_request, config)?;
        match vision {
            None => {
                for (i, p) in request.prompts.iter().enumerate() {
                    engine.submit_unchecked(p.clone(), (request.seed, i as u64));
                }
            }
            Some(v) => {
                let (unique, of_row) = unique_vision_prompts(&request.prompts, v);
                engine.group_prompt = unique;
                engine.waiting = vec![0; engine.group_prompt.len()];
                for (i, p) in request.prompts.iter().enumerate() {
                    engine.enqueue(p.clone(), of_row[i]);
                }
            }
        }
        Ok(engine)
    }

    /// Queues a text prompt; returns its sequence id (0, 1, … in submission order).
    ///
    /// # Errors
    /// An empty prompt, a token id out of range, a prompt plus `max_new_tokens` past the
    /// model's positions, or an engine made for multimodal prompts.
    pub fn submit(&mut self, prompt: Vec<u32>) -> Result<usize, GenerateError> {
        let stream = (self.request.seed, self.seqs.len() as u64);
        self.submit_with_stream(prompt, stream)
    }

    /// [`Engine::submit`] sampling from stream `(seed, index)` instead of `(request seed,
    /// id)`: the tokens prompt `index` of a [`GenerateRequest`] with that seed gets, so
    /// several requests can share one engine and keep their tokens.
    ///
    /// # Errors
    /// As [`Engine::submit`].
    pub fn submit_with_stream(
        &mut self,
        prompt: Vec<u32>,
        stream: (u64, u64),
    ) -> Result<usize, GenerateError> {
        if self.vision.is_some() {
            return Err(GenerateError::Sampling(
                "engine: submit takes text prompts; this engine was made for a multimodal request"
                    .into(),
            ));
        }
        let prompt = self
            .checked(prompt, self.request.max_new_tokens)
            .map_err(|e| match e {
                GenerateError::EmptyPrompt { .. } => GenerateError::EmptyPrompt {
                    index: self.seqs.len(),
                },
                e => e,
            })?;
        Ok(self.submit_unchecked(prompt, stream))
    }

    /// `prompt` when the model can take it with `max_new_tokens` after it (ids in range,
    /// within its positions; [`Model::check_request`]).
    fn checked(&self, prompt: Vec<u32>, max_new_tokens: usize) -> Result<Vec<u32>, GenerateError> {
        let check = GenerateRequest {
            prompts: vec![prompt],
            max_new_tokens,
            eos_ids: Vec::new(),
            sampling: self.request.sampling,
            seed: 0,
        };
        self.model.check_request(&check)?;
        let [prompt] = <[Vec<u32>; 1]>::try_from(check.prompts).unwrap_or_else(|_| unreachable!());
        Ok(prompt)
    }

    fn submit_unchecked(&mut self, prompt: Vec<u32>, stream: (u64, u64)) -> usize {
        let next = self.group_prompt.len();
        let group = *self.text_groups.entry(prompt.clone()).or_insert(next);
        if group == next {
            self.group_prompt.push(self.prompts.len());
            self.waiting.push(0);
        }
        self.enqueue_stream(prompt, group, stream)
    }

    fn enqueue(&mut self, prompt: Vec<u32>, group: usize) -> usize {
        let id = self.seqs.len();
        self.enqueue_stream(prompt, group, (self.request.seed, id as u64))
    }

    fn enqueue_stream(&mut self, prompt: Vec<u32>, group: usize, stream: (u64, u64)) -> usize {
        let id = self.seqs.len();
        self.prompts.push(prompt);
        self.group_of.push(group);
        self.waiting[group] += 1;
        let max_new = self.request.max_new_tokens;
        self.seqs.push(Some(Self::fresh(id, stream, max_new)));
        self.pending.push_back(id);
        id
    }

    /// Sequence `id` of stream `(seed, index)` before its first token.
    fn fresh(id: usize, stream: (u64, u64), max_new: usize) -> Sequence {
        Sequence {
            prompt: id,
            stream,
            rng: sequence_rng(stream.0, stream.1),
            blocks: Vec::new(),
            len: 0,
            out: SequenceOutput::default(),
            max_new,
            admitted: 0,
        }
    }

    /// Whether finished sequences keep their KV blocks so that [`Engine::continue_with`]
    /// prefills only what follows them (off by default). Kept blocks count against the
    /// budget until continued or [`Engine::release`]d; when blocks run short they are
    /// freed first, and their continuations prefill the whole conversation instead (the
    /// same tokens, log-probs within rounding).
    pub fn keep_finished(&mut self, keep: bool) {
        self.keep_finished = keep;
    }

    /// Queues the next turn of finished sequence `parent` (kept, see
    /// [`Engine::keep_finished`]): its prompt is `parent`'s prompt and new tokens followed
    /// by `appended` (a tool's answer as the chat template writes it), generated from
    /// stream `stream` with at most `max_new_tokens` new tokens. Only `parent`'s last
    /// token and `appended` are prefilled, over `parent`'s blocks, which pass to the new
    /// sequence. Returns its id.
    ///
    /// # Errors
    /// `parent` not a kept finished sequence (still running, continued or released
    /// already, or not kept), `max_new_tokens` 0, a token id out of range, the conversation
    /// plus `max_new_tokens` past the model's positions, or an engine made for multimodal
    /// prompts. On error `parent` stays kept.
    pub fn continue_with(
        &mut self,
        parent: usize,
        appended: &[u32],
        stream: (u64, u64),
        max_new_tokens: usize,
    ) -> Result<usize, GenerateError> {
        if self.vision.is_some() {
            return Err(GenerateError::Sampling(
                "engine: continue_with takes text conversations; this engine was made for a \
                 multimodal request"
                    .into(),
            ));
        }
        let Some(kept) = self.kept.get(&parent) else {
            return Err(GenerateError::Sampling(format!(
                "engine: sequence {parent} is not a finished sequence kept for continuing \
                 (still running, continued or released already, or keep_finished is off)"
            )));
        };
        if max_new_tokens == 0 {
            return Err(GenerateError::Sampling(
                "engine: continue_with needs max_new_tokens > 0".into(),
            ));
        }
        let mut prompt = Vec::with_capacity(kept.ids.len() + appended.len());
        prompt.extend_from_slice(&kept.ids);
        prompt.extend_from_slice(appended);
        let prompt = self.checked(prompt, max_new_tokens)?;
        let kept = self.kept.remove(&parent).unwrap_or_else(|| unreachable!());
        // a group of its own: no other prompt shares its blocks
        let group = self.group_prompt.len();
        self.group_prompt.push(self.prompts.len());
        self.waiting.push(0);
        let id = self.enqueue_stream(prompt, group, stream);
        self.seq_mut(id).max_new = max_new_tokens;
        if let Some(cache) = kept.cache {
            self.extend.insert(id, cache);
        }
        Ok(id)
    }

    /// Frees the blocks of finished sequence `id` kept for [`Engine::continue_with`]
    /// (nothing if it is not kept).
    pub fn release(&mut self, id: usize) {
        if let Some(cache) = self.kept.remove(&id).and_then(|k| k.cache) {
            cache.blocks.iter().for_each(|&b| self.pool.release(b));
        }
    }

    /// Whether every submitted sequence has finished.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.running.is_empty()
    }

    /// Sequences waiting for admission and running.
    pub fn counts(&self) -> (usize, usize) {
        (self.pending.len(), self.running.len())
    }

    /// The KV block pool (blocks in use, capacity, budget).
    pub fn pool(&self) -> &BlockPool<B> {
        &self.pool
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// One step (a decode of the running sequences, a chunk of a long prompt, then
    /// admissions with their prefill); returns the sequences that ended in it.
    ///
    /// # Errors
    /// Non-finite logits, a budget too small for one sequence, or a model failure.
    pub fn step(&mut self) -> Result<Vec<FinishedSequence>, GenerateError> {
        self.step_with(&mut |_, _| {})
    }

    /// [`Engine::step`], calling `on_token(sequence, token)` for each new token (a
    /// preempted sequence later repeats its tokens).
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn step_with(
        &mut self,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<FinishedSequence>, GenerateError> {
        let mut finished = Vec::new();
        self.decode(&mut finished, on_token)?;
        let chunk = self.prefill_chunk()?;
        self.admit(chunk, &mut finished, on_token)?;
        self.stats.steps += 1;
        self.stats.peak_blocks = self.stats.peak_blocks.max(self.pool.in_use());
        self.stats.peak_capacity = self.stats.peak_capacity.max(self.pool.capacity());
        Ok(finished)
    }

    /// Steps until every submitted sequence has ended; the outputs by sequence id.
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn run_to_end(
        &mut self,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        let mut outs = vec![SequenceOutput::default(); self.seqs.len()];
        while !self.is_idle() {
            for f in self.step_with(on_token)? {
                outs[f.id] = SequenceOutput {
                    tokens: f.tokens,
                    log_probs: f.log_probs,
                    entropies: f.entropies,
                    finished_by_eos: f.finished_by_eos,
                };
            }
        }
        Ok(GenerateOutput::from_sequences(outs))
    }

    fn seq(&self, id: usize) -> &Sequence {
        self.seqs[id]
            .as_ref()
            .unwrap_or_else(|| unreachable!("sequence {id} has ended"))
    }

    fn seq_mut(&mut self, id: usize) -> &mut Sequence {
        self.seqs[id]
            .as_mut()
            .unwrap_or_else(|| unreachable!("sequence {id} has ended"))
    }

    /// Frees sequence `id`'s blocks, resets it and puts it first in the queue.
    fn preempt(&mut self, id: usize) {
        let s = self.seqs[id].take().unwrap_or_else(|| unreachable!());
        s.blocks.iter().for_each(|&b| self.pool.release(b));
        self.running.retain(|&r| r != id);
        self.seqs[id] = Some(Self::fresh(id, s.stream, s.max_new));
        self.waiting[self.group_of[id]] += 1;
        self.pending.push_front(id);
        self.stats.preemptions += 1;
    }

    /// Ends sequence `id`: frees its blocks (or keeps them, see [`Engine::keep_finished`])
    /// and reports its output.
    fn finish(&mut self, id: usize, finished: &mut Vec<FinishedSequence>) {
        let s = self.seqs[id].take().unwrap_or_else(|| unreachable!());
        if self.keep_finished {
            let mut ids = self.prompts[s.prompt].clone();
            ids.extend_from_slice(&s.out.tokens);
            let cache = KeptCache {
                blocks: s.blocks,
                len: s.len,
            };
            self.kept.insert(
                id,
                Kept {
                    ids,
                    cache: Some(cache),
                },
            );
        } else {
            s.blocks.iter().for_each(|&b| self.pool.release(b));
        }
        self.running.retain(|&r| r != id);
        finished.push(FinishedSequence {
            id,
            tokens: s.out.tokens,
            log_probs: s.out.log_probs,
            entropies: s.out.entropies,
            finished_by_eos: s.out.finished_by_eos,
        });
    }

    fn budget_error(&self, id: usize, slots: usize) -> GenerateError {
        GenerateError::KvBudget {
            sequence: id,
            slots,
            budget: self.pool.max_blocks(),
            block_size: self.pool.block_size(),
        }
    }

    /// The decode step of the running sequences.
    fn decode(
        &mut self,
        finished: &mut Vec<FinishedSequence>,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<(), GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let bs = self.pool.block_size();
        // Room for each sequence's newest slot; preempt the latest admitted when none.
        let mut rows = self.running.clone();
        let mut r = 0;
        while r < rows.len() {
            let id = rows[r];
            let s = self.seq(id);
            if s.len < s.blocks.len() * bs {
                r += 1;
                continue;
            }
            if let Some(block) = self.pool.alloc(be)? {
                self.seq_mut(id).blocks.push(block);
                r += 1;
                continue;
            }
            // Out of blocks: first drop the cached prompts (their waiting samples prefill
            // again when admitted) and a chunked prefill under way (it starts again), then
            // preempt the latest admitted sequence.
            if self.drop_prefill_caches() {
                continue;
            }
            let victim = *self
                .running
                .iter()
                .max_by_key(|&&v| self.seq(v).admitted)
                .unwrap_or(&id);
            if victim == id && self.running.len() == 1 {
                return Err(self.budget_error(id, self.seq(id).len + 1));
            }
            self.preempt(victim);
            if let Some(p) = rows.iter().position(|&x| x == victim) {
                rows.remove(p);
                if p < r {
                    r -= 1;
                }
            }
        }
        let n = rows.len();
        if n == 0 {
            return Ok(());
        }
        // This step's inputs and block tables.
        let width = rows
            .iter()
            .map(|&id| self.seq(id).blocks.len())
            .max()
            .unwrap_or(1);
        let mut host_tables = vec![0u32; n * width];
        let mut host_len = vec![0u32; n];
        let mut ids = vec![0u32; n];
        let mut positions = vec![0u32; n];
        for (r, &id) in rows.iter().enumerate() {
            let s = self.seq(id);
            host_tables[r * width..r * width + s.blocks.len()].copy_from_slice(&s.blocks);
            host_len[r] = s.len as u32;
            ids[r] = s.out.tokens.last().copied().unwrap_or(0);
            let delta = self.vision.map_or(0, |v| v.rope_deltas[s.prompt]);
            // check_vision (or the prompt check) has bounded every decode position
            positions[r] = (s.len as i64 + delta) as u32;
        }
        let mut tables = be.alloc_ids(n * width)?;
        be.upload_ids(&host_tables, &mut tables)?;
        let mut lens = be.alloc_ids(n)?;
        be.upload_ids(&host_len, &mut lens)?;
        if self.acts.as_ref().is_none_or(|a| a.shape() != (n, 1)) {
            self.acts = None; // the old arena is freed before the new one is planned
            self.acts = Some(self.model.activations_full(n, 1)?);
        }
        let acts = self.acts.as_mut().unwrap_or_else(|| unreachable!());
        let ones = vec![1u32; n];
        let inputs = Inputs {
            batch: n,
            seq: 1,
            input_ids: &ids,
            attention_mask: &ones,
            position_ids: &positions,
        };
        let step_tables = BlockTables {
            block_size: bs,
            max_blocks: width,
            tables: &tables,
            len: &lens,
            host_tables: &host_tables,
            host_len: &host_len,
        };
        let cache = StepCache::Paged(&mut self.pool, step_tables);
        self.model.forward_extras(
            &inputs,
            &ForwardExtras::default(),
            acts,
            Some(cache),
            Some(self.tw),
        )?;
        self.stats.decode_passes += 1;
        self.stats.decode_rows += n;
        let seqs = &mut self.seqs;
        self.picks
            .pick(be, acts.logits(), self.request.sampling, |r| {
                seqs[rows[r]].as_mut().map_or(0.0, |s| uniform(&mut s.rng))
            })?;
        let mut ended = Vec::new();
        for (r, &id) in rows.iter().enumerate() {
            let s = self.seqs[id].as_mut().unwrap_or_else(|| unreachable!());
            s.len += 1;
            let req = (&self.request.eos_ids[..], s.max_new);
            if s.out.push(&self.picks, r, req, id, on_token)? {
                ended.push(id);
            }
        }
        for id in ended {
            self.finish(id, finished);
        }
        Ok(())
    }

    /// Frees the blocks of the cached prompts, of a chunked prefill under way and of the
    /// kept sequences and waiting continuations (which then prefill their whole
    /// conversation); whether there were any.
    fn drop_prefill_caches(&mut self) -> bool {
        let any = !self.prefixes.is_empty() || self.chunked.is_some();
        for (_, p) in self.prefixes.drain() {
            p.blocks.iter().for_each(|&b| self.pool.release(b));
        }
        if let Some(c) = self.chunked.take() {
            c.blocks.iter().for_each(|&b| self.pool.release(b));
        }
        self.drop_kept_and_waiting() || any
    }

    /// [`Engine::drop_kept`], and the blocks of the continuations still waiting; whether
    /// there were any.
    fn drop_kept_and_waiting(&mut self) -> bool {
        let kept = self.drop_kept();
        self.drop_waiting(None) || kept
    }

    /// Frees the blocks of the continuations waiting, but `except`'s (they will prefill
    /// their whole conversation); whether there were any.
    fn drop_waiting(&mut self, except: Option<usize>) -> bool {
        let ids: Vec<usize> = self
            .extend
            .keys()
            .copied()
            .filter(|&id| Some(id) != except)
            .collect();
        for id in &ids {
            if let Some(c) = self.extend.remove(id) {
                c.blocks.iter().for_each(|&b| self.pool.release(b));
            }
        }
        !ids.is_empty()
    }

    /// Frees the blocks of the kept sequences (their continuations will prefill their
    /// whole conversation); whether there were any.
    fn drop_kept(&mut self) -> bool {
        let mut any = false;
        for kept in self.kept.values_mut() {
            if let Some(c) = kept.cache.take() {
                any = true;
                c.blocks.iter().for_each(|&b| self.pool.release(b));
            }
        }
        any
    }

    /// Prefills the next chunk of the prompt being prefilled in chunks, if any: its
    /// tokens as one sequence of `seq` = chunk tokens at slots `done..`, attending over the
    /// prompt's blocks ([`Backend::paged_attention_decode`]: each query sees the slots up to
    /// its own). The last chunk's final position gives the prompt's logits and the prompt
    /// becomes a cached [`Prefix`]. Returns the prompt tokens prefilled (0 when it waits
    /// for blocks that running sequences hold).
    fn prefill_chunk(&mut self) -> Result<usize, GenerateError> {
        let Some(mut c) = self.chunked.take() else {
            return Ok(0);
        };
        let model = self.model;
        let be = &model.backend;
        let bs = self.pool.block_size();
        let len = self.prompts[self.group_prompt[c.group]].len();
        let take = self.config.max_prefill_tokens.min(len - c.done);
        while c.blocks.len() * bs < c.done + take {
            if let Some(b) = self.pool.alloc(be)? {
                c.blocks.push(b);
                continue;
            }
            // (the chunked prefill is out of `self`: this drops the cached prompts only)
            if self.drop_prefill_caches() {
                continue;
            }
            if self.running.is_empty() {
                c.blocks.iter().for_each(|&b| self.pool.release(b));
                return Err(self.budget_error(c.first, len + 1));
            }
            // running sequences hold the blocks: wait for them to end
            self.chunked = Some(c);
            return Ok(0);
        }
        let prompt = self.group_prompt[c.group];
        let ids = &self.prompts[prompt][c.done..c.done + take];
        let positions: Vec<u32> = (c.done..c.done + take).map(|p| p as u32).collect();
        // a multimodal chunk: its image/video rows and its span of the M-RoPE tables
        let (rows, rope) = match self.vision {
            Some(v) => {
                let rows = chunk_vision_rows(be, v, prompt, c.done, take, model.spec.hidden)?;
                let half = model.spec.head_dim / 2;
                let (cos, sin) = &v.rope[prompt];
                let span = c.done * half..(c.done + take) * half;
                (rows, Some((&cos[span.clone()], &sin[span])))
            }
            None => (None, None),
        };
        let extras = ForwardExtras {
            embeds: rows.as_ref().map(|(ids, e)| (ids, View::whole(e))),
            rope,
        };
        let ones = vec![1u32; take];
        let inputs = Inputs {
            batch: 1,
            seq: take,
            input_ids: ids,
            attention_mask: &ones,
            position_ids: &positions,
        };
        let host_len = [c.done as u32];
        let mut tables = be.alloc_ids(c.blocks.len())?;
        be.upload_ids(&c.blocks, &mut tables)?;
        let mut lens = be.alloc_ids(1)?;
        be.upload_ids(&host_len, &mut lens)?;
        if self
            .chunk_acts
            .as_ref()
            .is_none_or(|a| a.shape() != (1, take))
        {
            self.chunk_acts = None; // the old arena is freed before the new one is planned
            self.chunk_acts = Some(model.prefill_activations(1, take)?);
        }
        let acts = self.chunk_acts.as_mut().unwrap_or_else(|| unreachable!());
        let step_tables = BlockTables {
            block_size: bs,
            max_blocks: c.blocks.len(),
            tables: &tables,
            len: &lens,
            host_tables: &c.blocks,
            host_len: &host_len,
        };
        model.forward_extras(
            &inputs,
            &extras,
            acts,
            Some(StepCache::Paged(&mut self.pool, step_tables)),
            Some(self.tw),
        )?;
        c.done += take;
        self.stats.prefill_passes += 1;
        self.stats.prefill_tokens += take;
        if c.done < len {
            self.chunked = Some(c);
            return Ok(take);
        }
        // the chunk's last row is the prompt's last position
        let head = model.prefill_head(acts, self.tw)?;
        let mut logits = be.alloc(model.spec.vocab)?;
        be.copy(head, ViewMut::whole(&mut logits))?;
        self.stats.prefill_prompts += 1;
        self.prefixes.insert(
            c.group,
            Prefix {
                blocks: c.blocks,
                len,
                logits,
            },
        );
        Ok(take)
    }

    /// Admits waiting sequences, prefills their new prompts and picks their first tokens;
    /// `chunk` prompt tokens were prefilled this step already.
    fn admit(
        &mut self,
        chunk: usize,
        finished: &mut Vec<FinishedSequence>,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<(), GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let bs = self.pool.block_size();
        let mut admitted = Vec::new();
        let mut to_prefill: Vec<usize> = Vec::new(); // groups
        let (mut tokens, mut reserved) = (chunk, 0usize);
        // continuations, and the padded width of their pass
        let (mut extending, mut ext_width) = (Vec::new(), 0usize);
        while let Some(&id) = self.pending.front() {
            if self.running.len() + admitted.len() >= self.config.max_seqs {
                break;
            }
            let group = self.group_of[id];
            let plen = self.prompts[id].len();
            let nothing_else = self.running.is_empty() && admitted.is_empty();
            if let Some(c) = self.extend.get(&id) {
                // its new slots and first decode slot, and once the padding's scratch block
                let need = (plen + 1).div_ceil(bs).saturating_sub(c.blocks.len())
                    + usize::from(extending.is_empty());
                let width = ext_width.max(plen - c.len);
                if tokens + (extending.len() + 1) * width > self.config.max_prefill_tokens
                    && (tokens > 0 || !extending.is_empty())
                {
                    break;
                }
                if self.pool.available() < reserved + need {
                    // (the other continuations waiting give theirs up before this one)
                    if nothing_else && (self.drop_kept() || self.drop_waiting(Some(id))) {
                        continue;
                    }
                    if nothing_else {
                        return Err(self.budget_error(id, plen + 1));
                    }
                    break;
                }
                reserved += need;
                ext_width = width;
                self.pending.pop_front();
                admitted.push(id);
                extending.push(id);
                continue;
            }
            let used = tokens + extending.len() * ext_width;
            let new_prefix = !self.prefixes.contains_key(&group) && !to_prefill.contains(&group);
            let chunked = new_prefix && plen > self.config.max_prefill_tokens;
            if chunked && self.chunked.is_some() {
                break; // its prompt (or one before it) is being prefilled in chunks
            }
            // blocks: the prompt's (once), the sample's partial copy, its first decode block
            let need = if new_prefix { plen.div_ceil(bs) } else { 0 } + 2;
            if self.pool.available() < reserved + need {
                if nothing_else && self.drop_kept_and_waiting() {
                    continue;
                }
                if nothing_else {
                    return Err(self.budget_error(id, plen + 1));
                }
                break;
            }
            if chunked {
                // prefilled over the next steps; the queue waits behind it
                self.chunked = Some(ChunkedPrefill {
                    group,
                    first: id,
                    blocks: Vec::new(),
                    done: 0,
                });
                break;
            }
            if new_prefix {
                if used > 0 && used + plen > self.config.max_prefill_tokens {
                    break;
                }
                tokens += plen;
                to_prefill.push(group);
            }
            reserved += need;
            self.pending.pop_front();
            admitted.push(id);
        }
        if admitted.is_empty() {
            return Ok(());
        }
        // Prefill the new prompts in one pass; write each into blocks of its own.
        if !to_prefill.is_empty() {
            let members: Vec<usize> = to_prefill.iter().map(|&g| self.group_prompt[g]).collect();
            let prefill = self
                .model
                .prefill(&self.prompts, &members, self.vision, 0, self.tw)?;
            let v = self.model.spec.vocab;
            for (k, (&g, &p)) in to_prefill.iter().zip(&members).enumerate() {
                let len = self.prompts[p].len();
                let mut blocks = Vec::with_capacity(len.div_ceil(bs));
                for _ in 0..len.div_ceil(bs) {
                    let b = self
                        .pool
                        .alloc(be)?
                        .ok_or_else(|| self.budget_error(p, len))?;
                    blocks.push(b);
                }
                let from = prefill.width - len;
                self.pool
                    .write_from(be, &prefill.cache, k, from, len, &blocks)?;
                let mut logits = be.alloc(v)?;
                be.copy(
                    View::new(&prefill.logits, k * v, v)?,
                    ViewMut::whole(&mut logits),
                )?;
                self.prefixes.insert(
                    g,
                    Prefix {
                        blocks,
                        len,
                        logits,
                    },
                );
            }
            self.stats.prefill_passes += 1;
            self.stats.prefill_prompts += members.len();
            self.stats.prefill_tokens += members
                .iter()
                .map(|&p| self.prompts[p].len())
                .sum::<usize>();
        }
        let ext_logits = if extending.is_empty() {
            None
        } else {
            Some(self.extend_pass(&extending)?)
        };
        // Each admitted sequence: the prompt's full blocks shared, its partial block copied,
        // its first-token logits gathered.
        let v = self.model.spec.vocab;
        let mut logits = be.alloc(admitted.len() * v)?;
        for (r, &id) in admitted.iter().enumerate() {
            let group = self.group_of[id];
            if let Some(k) = extending.iter().position(|&e| e == id) {
                // a continuation: its blocks and length set by the extension pass
                let ext = ext_logits.as_ref().unwrap_or_else(|| unreachable!());
                be.copy(
                    View::new(ext, k * v, v)?,
                    ViewMut::new(&mut logits, r * v, v)?,
                )?;
                self.admissions += 1;
                self.seq_mut(id).admitted = self.admissions;
                self.running.push(id);
                self.waiting[group] -= 1;
                continue;
            }
            let prefix = self.prefixes.get(&group).unwrap_or_else(|| unreachable!());
            let (full, rest) = (prefix.len / bs, prefix.len % bs);
            let mut blocks: Vec<u32> = prefix.blocks[..full].to_vec();
            let partial = (rest > 0).then(|| prefix.blocks[full]);
            let len = prefix.len;
            be.copy(
                View::whole(&prefix.logits),
                ViewMut::new(&mut logits, r * v, v)?,
            )?;
            blocks.iter().for_each(|&b| self.pool.retain(b));
            if let Some(src) = partial {
                let dst = self
                    .pool
                    .alloc(be)?
                    .ok_or_else(|| self.budget_error(id, len))?;
                self.pool.copy_block(be, src, dst, rest)?;
                blocks.push(dst);
            }
            self.admissions += 1;
            let admitted_at = self.admissions;
            let s = self.seq_mut(id);
            s.blocks = blocks;
            s.len = len;
            s.admitted = admitted_at;
            self.running.push(id);
            self.waiting[group] -= 1;
            if self.waiting[group] == 0
                && let Some(p) = self.prefixes.remove(&group)
            {
                p.blocks.iter().for_each(|&b| self.pool.release(b));
            }
        }
        // First tokens.
        let seqs = &mut self.seqs;
        self.picks
            .pick(be, View::whole(&logits), self.request.sampling, |r| {
                seqs[admitted[r]]
                    .as_mut()
                    .map_or(0.0, |s| uniform(&mut s.rng))
            })?;
        let mut ended = Vec::new();
        for (r, &id) in admitted.iter().enumerate() {
            let s = self.seqs[id].as_mut().unwrap_or_else(|| unreachable!());
            let req = (&self.request.eos_ids[..], s.max_new);
            if s.out.push(&self.picks, r, req, id, on_token)? {
                ended.push(id);
            }
        }
        for id in ended {
            self.finish(id, finished);
        }
        Ok(())
    }
}

impl<B: Backend> Engine<'_, B> {
    /// Prefills the continuations `rows` (admitted sequences with kept blocks) in one
    /// pass: row `b`'s new tokens (its parent's last token and the appended ones) at its
    /// slots `len_b..`, right-padded to the longest row. Padding slots past a row's own
    /// blocks go to a scratch block freed after the pass; a query sees only the slots up to its own, so no
    /// real token attends to padding. Sets each row's blocks and length; returns the
    /// next-token logits `[rows, vocab]`.
    fn extend_pass(&mut self, rows: &[usize]) -> Result<B::Buffer, GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let bs = self.pool.block_size();
        let mut caches = Vec::with_capacity(rows.len());
        for &id in rows {
            let mut c = self.extend.remove(&id).unwrap_or_else(|| unreachable!());
            let end = self.prompts[id].len() + 1; // its tokens and its first decode slot
            while c.blocks.len() * bs < end {
                let b = self.pool.alloc(be)?;
                c.blocks.push(b.ok_or_else(|| self.budget_error(id, end))?);
            }
            caches.push(c);
        }
        let news: Vec<usize> = rows
            .iter()
            .zip(&caches)
            .map(|(&id, c)| self.prompts[id].len() - c.len)
            .collect();
        let (n, width) = (rows.len(), news.iter().copied().max().unwrap_or(1));
        // a block for the padding to write to, for this pass
        let scratch = if news.iter().any(|&k| k < width) {
            let b = self.pool.alloc(be)?;
            Some(b.ok_or_else(|| self.budget_error(rows[0], width))?)
        } else {
            None
        };
        let table_width = caches
            .iter()
            .map(|c| c.blocks.len().max((c.len + width).div_ceil(bs)))
            .max()
            .unwrap_or(1);
        let mut host_tables = vec![scratch.unwrap_or(0); n * table_width];
        let mut host_len = Vec::with_capacity(n);
        let mut ids = vec![0u32; n * width];
        let mut positions = vec![0u32; n * width];
        let mut last = Vec::with_capacity(n);
        for (b, ((&id, c), &k)) in rows.iter().zip(&caches).zip(&news).enumerate() {
            host_tables[b * table_width..b * table_width + c.blocks.len()]
                .copy_from_slice(&c.blocks);
            host_len.push(c.len as u32);
            ids[b * width..b * width + k].copy_from_slice(&self.prompts[id][c.len..]);
            // (a padding token takes the row's last position: any valid one will do)
            for (i, p) in positions[b * width..(b + 1) * width].iter_mut().enumerate() {
                *p = (c.len + i.min(k - 1)) as u32;
            }
            last.push((b * width + k - 1) as u32);
        }
        let mut tables = be.alloc_ids(host_tables.len())?;
        be.upload_ids(&host_tables, &mut tables)?;
        let mut lens = be.alloc_ids(n)?;
        be.upload_ids(&host_len, &mut lens)?;
        let mut acts = model.prefill_activations(n, width)?;
        let ones = vec![1u32; n * width];
        let inputs = Inputs {
            batch: n,
            seq: width,
            input_ids: &ids,
            attention_mask: &ones,
            position_ids: &positions,
        };
        let step_tables = BlockTables {
            block_size: bs,
            max_blocks: table_width,
            tables: &tables,
            len: &lens,
            host_tables: &host_tables,
            host_len: &host_len,
        };
        model.forward_extras(
            &inputs,
            &ForwardExtras::default(),
            &mut acts,
            Some(StepCache::Paged(&mut self.pool, step_tables)),
            Some(self.tw),
        )?;
        if let Some(b) = scratch {
            self.pool.release(b);
        }
        let head = model.prefill_head_rows(&mut acts, self.tw, &last)?;
        let mut logits = be.alloc(n * model.spec.vocab)?;
        be.copy(head, ViewMut::whole(&mut logits))?;
        for ((&id, c), &k) in rows.iter().zip(caches).zip(&news) {
            let s = self.seq_mut(id);
            s.len = c.len + k;
            s.blocks = c.blocks;
        }
        self.stats.extend_passes += 1;
        self.stats.extend_tokens += news.iter().sum::<usize>();
        Ok(logits)
    }
}

/// A chunk's replaced rows (indices in the chunk) and their embeddings `[rows, hidden]`.
type ChunkRows<B> = Option<(<B as Backend>::Ids, <B as Backend>::Buffer)>;

/// The replaced rows of prompt `prompt` that fall in its chunk `done..done + take`: their
/// indices in the chunk and their embedding rows gathered (runs of consecutive rows copied
/// at once); `None` when the chunk has none.
fn chunk_vision_rows<B: Backend>(
    be: &B,
    v: &PromptVision<'_, B>,
    prompt: usize,
    done: usize,
    take: usize,
    hidden: usize,
) -> Result<ChunkRows<B>, GenerateError> {
    let inside: Vec<(usize, u32)> = v
        .rows
        .iter()
        .enumerate()
        .filter(|&(_, &(p, t))| p == prompt && (done..done + take).contains(&t))
        .map(|(i, &(_, t))| (i, (t - done) as u32))
        .collect();
    if inside.is_empty() {
        return Ok(None);
    }
    let mut buf = be.alloc(inside.len() * hidden)?;
    let mut at = 0;
    for run in inside.chunk_by(|a, b| b.0 == a.0 + 1) {
        let n = run.len() * hidden;
        be.copy(
            View::new(v.embeds.buffer(), v.embeds.offset() + run[0].0 * hidden, n)?,
            ViewMut::new(&mut buf, at, n)?,
        )?;
        at += n;
    }
    let flat: Vec<u32> = inside.iter().map(|&(_, t)| t).collect();
    let mut ids = be.alloc_ids(flat.len())?;
    be.upload_ids(&flat, &mut ids)?;
    Ok(Some((ids, buf)))
}
