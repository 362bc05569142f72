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
//!
//! Layout (vLLM's v1 engine): the [scheduler](scheduler) only decides — each step it plans
//! who decodes, who is preempted, which chunk prefills, who is admitted and which blocks
//! each of them takes, over host bookkeeping alone ([`BlockPool`] ids); the
//! [runner](runner) turns each plan into backend calls ([`PagedKv`](crate::model) memory,
//! forward passes, the device's token picks); [`Engine`] wires them and is the API. A
//! [`Generator`](crate::model::Generator) makes engines (`Engine::new`, in `generate.rs`).

mod runner;
mod scheduler;

use runner::Runner;
use scheduler::Scheduler;

use super::decode_weights::DecodeWeights;
use super::request::{
    GenerateError, GenerateOutput, GenerateRequest, PromptVision, SequenceOutput,
};
use super::sampling::{SampleKey, Sampling};
use super::{BlockPool, KvCacheDtype, Model};
use crate::backend::Backend;

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
    /// Pad each decode pass to a bucket of rows — the next power of two, at most
    /// `max_seqs` — the extra rows decoding a dummy token into a spare KV block, so decode
    /// steps come in a few fixed shapes, each the same ops on the same buffers, and capture
    /// each shape's pass as a graph the second time it runs, replaying it after (CUDA
    /// graphs, by `(rows, block-table width)`, as vLLM captures its batch sizes; a backend
    /// that records no graph — the CPU — runs every pass as it is). The real rows' outputs
    /// are unchanged; the padding costs its compute. Default off.
    pub decode_buckets: bool,
    /// The KV pool's number format: f32 (the default) or bf16 (half the memory).
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_seqs: 256,
            block_size: 16,
            max_blocks: None,
            max_prefill_tokens: 8192,
            decode_buckets: false,
            kv_cache_dtype: KvCacheDtype::F32,
        }
    }
}

impl EngineConfig {
    /// The configuration [`Generator::generate`](crate::model::Generator::generate) uses:
    /// every sequence of `request` admitted in the first step (one decode slot each), an
    /// unbounded pool.
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
    /// With decode buckets: decode passes captured as graphs (CUDA), replayed, and not
    /// capturable (the backend records no graph — the CPU — or refused the pass: it then
    /// runs as it is).
    pub graph_captures: usize,
    /// Decode passes replayed from a graph.
    pub graph_replays: usize,
    /// Decode passes a capture was tried for and failed.
    pub graph_failures: usize,
}

/// The rollout engine over a [`Generator`](crate::model::Generator)'s weights; see the
/// module docs.
pub struct Engine<'a, B: Backend> {
    model: &'a Model<B>,
    sched: Scheduler,
    runner: Runner<'a, B>,
}

impl<'a, B: Backend> Engine<'a, B> {
    /// An engine generating with `model`'s transposed weights `tw` (and the multimodal
    /// inputs of `vision`), nothing submitted yet.
    ///
    /// # Errors
    /// Invalid sizes, or a backend failure.
    pub(crate) fn build(
        model: &'a Model<B>,
        tw: &'a DecodeWeights<B>,
        vision: Option<&'a PromptVision<'a, B>>,
        request: EngineRequest,
        config: EngineConfig,
    ) -> Result<Self, GenerateError> {
        let sched = Scheduler::new(request, config)?;
        let mut runner = Runner::new(model, tw, vision, config)?;
        runner.reserve(&sched)?;
        Ok(Self {
            model,
            sched,
            runner,
        })
    }

    /// Queues a checked text prompt sampling from `stream`; returns its id.
    pub(crate) fn submit_checked(&mut self, prompt: Vec<u32>, stream: (u64, u64)) -> usize {
        self.sched.submit(prompt, stream)
    }

    /// Queues the prompts of a checked multimodal request: `unique` the first prompt of
    /// each prefix group, `of_row[i]` prompt `i`'s group.
    pub(crate) fn submit_grouped(
        &mut self,
        prompts: &[Vec<u32>],
        unique: Vec<usize>,
        of_row: &[usize],
    ) {
        self.sched.submit_grouped(prompts, unique, of_row);
    }

    /// Queues a text prompt; returns its sequence id (0, 1, … in submission order).
    ///
    /// # Errors
    /// An empty prompt, a token id out of range, a prompt plus `max_new_tokens` past the
    /// model's positions, or an engine made for multimodal prompts.
    pub fn submit(&mut self, prompt: Vec<u32>) -> Result<usize, GenerateError> {
        let stream = (self.sched.request().seed, self.sched.len() as u64);
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
        if self.runner.is_multimodal() {
            return Err(GenerateError::Sampling(
                "engine: submit takes text prompts; this engine was made for a multimodal request"
                    .into(),
            ));
        }
        let max_new = self.sched.request().max_new_tokens;
        let prompt = self.checked(prompt, max_new).map_err(|e| match e {
            GenerateError::EmptyPrompt { .. } => GenerateError::EmptyPrompt {
                index: self.sched.len(),
            },
            e => e,
        })?;
        Ok(self.sched.submit(prompt, stream))
    }

    /// `prompt` when the model can take it with `max_new_tokens` after it (ids in range,
    /// within its positions; [`Model::check_request`]).
    fn checked(&self, prompt: Vec<u32>, max_new_tokens: usize) -> Result<Vec<u32>, GenerateError> {
        let check = GenerateRequest {
            prompts: vec![prompt],
            max_new_tokens,
            eos_ids: Vec::new(),
            sampling: self.sched.request().sampling,
            seed: 0,
        };
        self.model.check_request(&check)?;
        let [prompt] = <[Vec<u32>; 1]>::try_from(check.prompts).unwrap_or_else(|_| unreachable!());
        Ok(prompt)
    }

    /// Whether finished sequences keep their KV blocks so that [`Engine::continue_with`]
    /// prefills only what follows them (off by default). Kept blocks count against the
    /// budget until continued or [`Engine::release`]d; when blocks run short they are
    /// freed first, and their continuations prefill the whole conversation instead (the
    /// same tokens, log-probs within rounding).
    pub fn keep_finished(&mut self, keep: bool) {
        self.sched.keep_finished(keep);
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
    /// plus `max_new_tokens` past the model's positions (a multimodal conversation's text
    /// positions, `rope_delta` from its length). On error `parent` stays kept.
    ///
    /// A multimodal conversation keeps its first turn's images and M-RoPE positions; what
    /// follows them is text, at `len + rope_delta` on all three axes (transformers' rule),
    /// so a continuation equals generating after the whole conversation with the images.
    pub fn continue_with(
        &mut self,
        parent: usize,
        appended: &[u32],
        stream: (u64, u64),
        max_new_tokens: usize,
    ) -> Result<usize, GenerateError> {
        let Some(kept) = self.sched.kept_tokens(parent) else {
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
        let mut prompt = Vec::with_capacity(kept.len() + appended.len());
        prompt.extend_from_slice(kept);
        prompt.extend_from_slice(appended);
        let prompt = self.checked(prompt, max_new_tokens)?;
        // a multimodal conversation decodes at text positions `delta` from its length
        let delta = self.runner.delta(&self.sched, parent);
        let last = (prompt.len() + max_new_tokens) as i64 + delta;
        if delta != 0 && last > self.model.spec.max_positions as i64 {
            return Err(GenerateError::TooLong {
                index: parent,
                prompt_len: prompt.len(),
                max_new_tokens,
                max_len: (self.model.spec.max_positions as i64 - delta).max(0) as usize,
            });
        }
        let id = self
            .sched
            .continue_with(parent, prompt, stream, max_new_tokens);
        Ok(id.unwrap_or_else(|| unreachable!("sequence {parent} is kept")))
    }

    /// Frees the blocks of finished sequence `id` kept for [`Engine::continue_with`]
    /// (nothing if it is not kept).
    pub fn release(&mut self, id: usize) {
        self.sched.release(id);
    }

    /// Whether every submitted sequence has finished.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// Sequences waiting for admission and running.
    pub fn counts(&self) -> (usize, usize) {
        self.sched.counts()
    }

    /// The KV block pool (blocks in use, capacity, budget).
    pub fn pool(&self) -> &BlockPool {
        self.sched.pool()
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> EngineStats {
        let g = self.runner.graph_stats();
        EngineStats {
            graph_captures: g.captures,
            graph_replays: g.replays,
            graph_failures: g.failures,
            ..self.sched.stats()
        }
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
        let sampling = self.sched.request().sampling;
        // 1. decode the running sequences
        let rows = self.sched.schedule_decode()?;
        if !rows.is_empty() {
            self.runner.reserve(&self.sched)?;
            self.runner.decode(&self.sched, &rows)?;
            let sched = &mut self.sched;
            // a padded row's key is any key: its token is thrown away
            self.runner.pick_decoded(sampling, |r| {
                rows.get(r)
                    .map_or_else(SampleKey::default, |&id| sched.next_key(id))
            })?;
            let picks = self.runner.decoded(rows.len());
            self.sched
                .push_decoded(&rows, &picks, on_token, &mut finished)?;
        }
        // 2. a chunk of a long prompt, then admissions with their prefill
        let plan = self.sched.schedule_prefill()?;
        self.runner.reserve(&self.sched)?;
        if let Some(logits) = self.runner.prefill(&self.sched, &plan)? {
            let sched = &mut self.sched;
            let admitted = &plan.admitted;
            self.runner
                .pick(&logits, sampling, |r| sched.next_key(admitted[r].id))?;
            let picks = self.runner.picked(admitted.len());
            self.sched
                .push_admitted(&plan, &picks, on_token, &mut finished)?;
        }
        self.runner.forget_prefixes(&self.sched);
        self.sched.end_step();
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
        let mut outs = vec![SequenceOutput::default(); self.sched.len()];
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
}
