//! The engine's scheduler: it only decides. Each step it plans the decode (who decodes,
//! which blocks they take, who is preempted when blocks run out) and then the prefill (the
//! next chunk of a long prompt, which waiting sequences are admitted, which prompts are
//! prefilled, which continuations extend their kept blocks). Its state is host bookkeeping
//! — queues, block ids ([`BlockPool`]), each sequence's tokens and sampling stream — so it
//! is tested without a model (tests below); the runner (`runner.rs`) turns each plan into
//! backend calls, and the tokens they pick come back through [`Scheduler::push_decoded`]
//! and [`Scheduler::push_admitted`].

use std::collections::{HashMap, VecDeque};

use super::{EngineConfig, EngineRequest, EngineStats, FinishedSequence};
use crate::model::BlockPool;
use crate::model::request::{GenerateError, SequenceOutput};
use crate::model::sampling::{SampleKey, sequence_key};

/// One sequence's state.
struct Sequence {
    prompt: usize,
    /// The key of its next draw: its stream `(seed, index)` and the draws so far.
    key: SampleKey,
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

/// A finished sequence kept for a continuation: its tokens (prompt and new) and, unless
/// memory ran short, its blocks holding the keys and values of the first `len` of them
/// (all but the last new token, never fed back).
struct Kept {
    ids: Vec<u32>,
    cache: Option<KeptCache>,
}

/// Blocks holding the keys and values of a sequence's first `len` tokens.
struct KeptCache {
    blocks: Vec<u32>,
    len: usize,
}

/// A prompt prefilled once: its blocks (owned by the prefix). Its next-token logits are
/// the runner's.
struct Prefix {
    blocks: Vec<u32>,
    len: usize,
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

/// The next chunk of a prompt prefilled in chunks: tokens `start..start + take` of prompt
/// `prompt` (of prefix group `group`) at those slots of `blocks`, attending to the chunks
/// before it; `last` when it completes the prompt (then its last position gives the
/// prefix's logits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkStep {
    pub group: usize,
    pub prompt: usize,
    pub start: usize,
    pub take: usize,
    pub blocks: Vec<u32>,
    pub last: bool,
}

/// A prompt prefilled in this step's one left-padded pass, written into `blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NewPrefix {
    pub group: usize,
    pub prompt: usize,
    pub blocks: Vec<u32>,
}

/// A continuation in this step's extension pass: its tokens `cached..` (its parent's last
/// token and the appended ones) written at those slots of `blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExtendRow {
    pub id: usize,
    pub blocks: Vec<u32>,
    pub cached: usize,
}

/// The continuations of this step, in one right-padded pass of `width` tokens a row; the
/// padding writes to `scratch` (free again once the pass has run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExtendPass {
    pub rows: Vec<ExtendRow>,
    pub width: usize,
    pub table_width: usize,
    pub scratch: Option<u32>,
}

/// Where an admitted sequence's first-token logits come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FirstLogits {
    /// Its prompt's prefix (prefix group).
    Prefix(usize),
    /// Row `k` of the extension pass.
    Extend(usize),
}

/// A sequence admitted this step: its first logits, and the copy of its prompt's partial
/// last block into a block of its own (`src`, `dst`, slots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Admission {
    pub id: usize,
    pub logits: FirstLogits,
    pub copy: Option<(u32, u32, usize)>,
}

/// The prefill half of a step, in the order the runner carries it out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PrefillPlan {
    pub chunk: Option<ChunkStep>,
    pub prefill: Vec<NewPrefix>,
    pub extend: Option<ExtendPass>,
    pub admitted: Vec<Admission>,
}

/// The engine's queues, sequences and block ids; see the module docs.
pub(crate) struct Scheduler {
    config: EngineConfig,
    request: EngineRequest,
    pool: BlockPool,
    /// Prompts by index, and the prefix group of each.
    prompts: Vec<Vec<u32>>,
    group_of: Vec<usize>,
    /// Per prompt, the submitted prompt its conversation started from (itself, or a
    /// continuation's first turn's: a multimodal prompt's images and M-RoPE positions).
    origin: Vec<usize>,
    /// The first prompt of each group, and its sequences waiting for admission.
    group_prompt: Vec<usize>,
    waiting: Vec<usize>,
    text_groups: HashMap<Vec<u32>, usize>,
    prefixes: HashMap<usize, Prefix>,
    /// The prompt being prefilled in chunks.
    chunked: Option<ChunkedPrefill>,
    seqs: Vec<Option<Sequence>>,
    pending: VecDeque<usize>,
    /// Running sequences in admission order.
    running: Vec<usize>,
    admissions: usize,
    stats: EngineStats,
    /// Whether finished sequences keep their blocks for a continuation.
    keep_finished: bool,
    /// Finished sequences kept, by id.
    kept: HashMap<usize, Kept>,
    /// Continuations waiting for admission, by id: the blocks they extend.
    extend: HashMap<usize, KeptCache>,
}

impl Scheduler {
    /// A scheduler for `request` with the sizes of `config` (checked), nothing queued.
    ///
    /// # Errors
    /// Invalid sizes.
    pub(crate) fn new(request: EngineRequest, config: EngineConfig) -> Result<Self, GenerateError> {
        config.check()?;
        let budget = config.max_blocks.unwrap_or(u32::MAX as usize);
        let initial = (4 * config.max_seqs).min(budget);
        let pool = BlockPool::new(config.block_size, initial, budget)?;
        Ok(Self {
            config,
            request,
            pool,
            prompts: Vec::new(),
            group_of: Vec::new(),
            origin: Vec::new(),
            group_prompt: Vec::new(),
            waiting: Vec::new(),
            text_groups: HashMap::new(),
            prefixes: HashMap::new(),
            chunked: None,
            seqs: Vec::new(),
            pending: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
            stats: EngineStats::default(),
            keep_finished: false,
            kept: HashMap::new(),
            extend: HashMap::new(),
        })
    }

    // ----- Queueing. -----

    /// Sequences submitted so far (the next one's id).
    pub(crate) fn len(&self) -> usize {
        self.seqs.len()
    }

    /// The request every sequence follows.
    pub(crate) fn request(&self) -> &EngineRequest {
        &self.request
    }

    /// Prompt `index` (a sequence's prompt, or a continuation's whole conversation).
    pub(crate) fn prompts(&self) -> &[Vec<u32>] {
        &self.prompts
    }

    /// The submitted prompt whose conversation prompt `index` continues (`index` itself
    /// for a submitted prompt).
    pub(crate) fn origin(&self, index: usize) -> usize {
        self.origin[index]
    }

    /// Queues a text prompt sampling from `stream`; equal prompts share one prefix group.
    /// Returns its sequence id.
    pub(crate) fn submit(&mut self, prompt: Vec<u32>, stream: (u64, u64)) -> usize {
        let next = self.group_prompt.len();
        let group = *self.text_groups.entry(prompt.clone()).or_insert(next);
        if group == next {
            self.group_prompt.push(self.prompts.len());
            self.waiting.push(0);
        }
        self.enqueue(prompt, group, stream)
    }

    /// Queues multimodal prompts: `unique` are the first prompts of the prefix groups,
    /// `of_row[i]` the group of prompt `i` (sequence `i` samples from stream `(seed, i)`).
    pub(crate) fn submit_grouped(
        &mut self,
        prompts: &[Vec<u32>],
        unique: Vec<usize>,
        of_row: &[usize],
    ) {
        self.group_prompt = unique;
        self.waiting = vec![0; self.group_prompt.len()];
        for (i, p) in prompts.iter().enumerate() {
            let stream = (self.request.seed, self.seqs.len() as u64);
            self.enqueue(p.clone(), of_row[i], stream);
        }
    }

    fn enqueue(&mut self, prompt: Vec<u32>, group: usize, stream: (u64, u64)) -> usize {
        let id = self.seqs.len();
        self.prompts.push(prompt);
        self.group_of.push(group);
        self.origin.push(id);
        self.waiting[group] += 1;
        let max_new = self.request.max_new_tokens;
        self.seqs.push(Some(fresh(id, stream, max_new)));
        self.pending.push_back(id);
        id
    }

    /// See `Engine::keep_finished`.
    pub(crate) fn keep_finished(&mut self, keep: bool) {
        self.keep_finished = keep;
    }

    /// The tokens (prompt and new) of finished sequence `parent` when it is kept.
    pub(crate) fn kept_tokens(&self, parent: usize) -> Option<&[u32]> {
        self.kept.get(&parent).map(|k| &k.ids[..])
    }

    /// Queues `prompt` (kept sequence `parent`'s tokens and what follows them) as a
    /// continuation over `parent`'s blocks, in a prefix group of its own; `None` when
    /// `parent` is not kept.
    pub(crate) fn continue_with(
        &mut self,
        parent: usize,
        prompt: Vec<u32>,
        stream: (u64, u64),
        max_new_tokens: usize,
    ) -> Option<usize> {
        let kept = self.kept.remove(&parent)?;
        let group = self.group_prompt.len();
        self.group_prompt.push(self.prompts.len());
        self.waiting.push(0);
        let id = self.enqueue(prompt, group, stream);
        self.origin[id] = self.origin[parent]; // (a sequence's prompt index is its id)
        self.seq_mut(id).max_new = max_new_tokens;
        if let Some(cache) = kept.cache {
            self.extend.insert(id, cache);
        }
        Some(id)
    }

    /// Frees the blocks of kept finished sequence `id` (nothing if it is not kept).
    pub(crate) fn release(&mut self, id: usize) {
        if let Some(cache) = self.kept.remove(&id).and_then(|k| k.cache) {
            cache.blocks.iter().for_each(|&b| self.pool.release(b));
        }
    }

    /// Whether every submitted sequence has finished.
    pub(crate) fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.running.is_empty()
    }

    /// Sequences waiting for admission and running.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.pending.len(), self.running.len())
    }

    /// The block ids.
    pub(crate) fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// What the engine has done so far.
    pub(crate) fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Counts a step and the blocks it held.
    pub(crate) fn end_step(&mut self) {
        self.stats.steps += 1;
        self.stats.peak_blocks = self.stats.peak_blocks.max(self.pool.in_use());
        self.stats.peak_capacity = self.stats.peak_capacity.max(self.pool.capacity());
    }

    // ----- What the runner reads. -----

    /// Running sequence `id`: its prompt index, blocks, filled slots and last token.
    pub(crate) fn decode_row(&self, id: usize) -> (usize, &[u32], usize, u32) {
        let s = self.seq(id);
        let last = s.out.tokens.last().copied().unwrap_or(0);
        (s.prompt, &s.blocks, s.len, last)
    }

    /// The key of sequence `id`'s next draw (its stream advances).
    pub(crate) fn next_key(&mut self, id: usize) -> SampleKey {
        self.seqs[id]
            .as_mut()
            .map_or(SampleKey::default(), |s| s.key.advance())
    }

    // ----- The decode half of a step. -----

    /// Plans the decode of the running sequences: a slot for each one's next token (a new
    /// block when its last is full; when the budget is used up, first the cached prompts
    /// and kept blocks go, then the latest admitted sequence is preempted). Returns the
    /// sequences decoded, in order.
    ///
    /// # Errors
    /// A budget too small for one sequence.
    pub(crate) fn schedule_decode(&mut self) -> Result<Vec<usize>, GenerateError> {
        let bs = self.pool.block_size();
        let mut rows = self.running.clone();
        let mut r = 0;
        while r < rows.len() {
            let id = rows[r];
            let s = self.seq(id);
            if s.len < s.blocks.len() * bs {
                r += 1;
                continue;
            }
            if let Some(block) = self.pool.alloc() {
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
        if !rows.is_empty() {
            self.stats.decode_passes += 1;
            self.stats.decode_rows += rows.len();
        }
        Ok(rows)
    }

    /// The decoded tokens: `picks[r]` (token, log-prob, entropy) for sequence `rows[r]`,
    /// appended after the slot the decode filled; the sequences that end are `finished`.
    ///
    /// # Errors
    /// A row without a token (non-finite logits).
    pub(crate) fn push_decoded(
        &mut self,
        rows: &[usize],
        picks: &[(u32, f32, f32)],
        on_token: &mut dyn FnMut(usize, u32),
        finished: &mut Vec<FinishedSequence>,
    ) -> Result<(), GenerateError> {
        self.push(rows, picks, 1, on_token, finished)
    }

    /// The first tokens of the sequences admitted by [`Scheduler::schedule_prefill`], as
    /// [`Scheduler::push_decoded`].
    ///
    /// # Errors
    /// As [`Scheduler::push_decoded`].
    pub(crate) fn push_admitted(
        &mut self,
        plan: &PrefillPlan,
        picks: &[(u32, f32, f32)],
        on_token: &mut dyn FnMut(usize, u32),
        finished: &mut Vec<FinishedSequence>,
    ) -> Result<(), GenerateError> {
        let rows: Vec<usize> = plan.admitted.iter().map(|a| a.id).collect();
        self.push(&rows, picks, 0, on_token, finished)
    }

    fn push(
        &mut self,
        rows: &[usize],
        picks: &[(u32, f32, f32)],
        filled: usize,
        on_token: &mut dyn FnMut(usize, u32),
        finished: &mut Vec<FinishedSequence>,
    ) -> Result<(), GenerateError> {
        let mut ended = Vec::new();
        for (&id, &pick) in rows.iter().zip(picks) {
            let s = self.seqs[id]
                .as_mut()
                .unwrap_or_else(|| unreachable!("sequence {id} has ended"));
            s.len += filled;
            let request = (&self.request.eos_ids[..], s.max_new);
            if s.out.push(pick, request, id, on_token)? {
                ended.push(id);
            }
        }
        for id in ended {
            self.finish(id, finished);
        }
        Ok(())
    }

    // ----- The prefill half of a step. -----

    /// Plans the prefill: the next chunk of a prompt prefilled in chunks, then admissions
    /// in queue order while a decode slot (`max_seqs`) and blocks are free, at most
    /// `max_prefill_tokens` prompt tokens in all (a longer prompt starts a chunked prefill
    /// and the queue waits for it); their new prompts' and continuations' blocks; each
    /// admitted sequence's shared blocks and the copy of its partial one.
    ///
    /// # Errors
    /// A budget too small for one sequence.
    pub(crate) fn schedule_prefill(&mut self) -> Result<PrefillPlan, GenerateError> {
        let chunk = self.schedule_chunk()?;
        let chunk_tokens = chunk.as_ref().map_or(0, |c| c.take);
        let mut plan = self.schedule_admissions(chunk_tokens)?;
        plan.chunk = chunk;
        Ok(plan)
    }

    /// The next chunk of the prompt prefilled in chunks, if any and if blocks allow (it
    /// waits while running sequences hold them).
    fn schedule_chunk(&mut self) -> Result<Option<ChunkStep>, GenerateError> {
        let Some(mut c) = self.chunked.take() else {
            return Ok(None);
        };
        let bs = self.pool.block_size();
        let prompt = self.group_prompt[c.group];
        let len = self.prompts[prompt].len();
        let take = self.config.max_prefill_tokens.min(len - c.done);
        while c.blocks.len() * bs < c.done + take {
            if let Some(b) = self.pool.alloc() {
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
            return Ok(None);
        }
        let step = ChunkStep {
            group: c.group,
            prompt,
            start: c.done,
            take,
            blocks: c.blocks.clone(),
            last: c.done + take == len,
        };
        c.done += take;
        self.stats.prefill_passes += 1;
        self.stats.prefill_tokens += take;
        if step.last {
            self.stats.prefill_prompts += 1;
            let prefix = Prefix {
                blocks: c.blocks,
                len,
            };
            self.prefixes.insert(c.group, prefix);
        } else {
            self.chunked = Some(c);
        }
        Ok(Some(step))
    }

    /// Admissions after `chunk` prompt tokens of this step (see
    /// [`Scheduler::schedule_prefill`]).
    fn schedule_admissions(&mut self, chunk: usize) -> Result<PrefillPlan, GenerateError> {
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
        let mut plan = PrefillPlan::default();
        if admitted.is_empty() {
            return Ok(plan);
        }
        plan.prefill = self.plan_new_prefixes(&to_prefill)?;
        if !extending.is_empty() {
            plan.extend = Some(self.plan_extend(&extending)?);
        }
        plan.admitted = self.plan_admitted(&admitted, &extending)?;
        Ok(plan)
    }

    /// Blocks for the new prompts of groups `groups`, prefilled together in one pass.
    fn plan_new_prefixes(&mut self, groups: &[usize]) -> Result<Vec<NewPrefix>, GenerateError> {
        let bs = self.pool.block_size();
        let mut out = Vec::with_capacity(groups.len());
        for &group in groups {
            let prompt = self.group_prompt[group];
            let len = self.prompts[prompt].len();
            let mut blocks = Vec::with_capacity(len.div_ceil(bs));
            for _ in 0..len.div_ceil(bs) {
                let b = self.pool.alloc();
                blocks.push(b.ok_or_else(|| self.budget_error(prompt, len))?);
            }
            let prefix = Prefix {
                blocks: blocks.clone(),
                len,
            };
            self.prefixes.insert(group, prefix);
            out.push(NewPrefix {
                group,
                prompt,
                blocks,
            });
        }
        if !out.is_empty() {
            self.stats.prefill_passes += 1;
            self.stats.prefill_prompts += out.len();
            self.stats.prefill_tokens += out
                .iter()
                .map(|p| self.prompts[p.prompt].len())
                .sum::<usize>();
        }
        Ok(out)
    }

    /// The extension pass of continuations `rows` (admitted, with kept blocks): blocks for
    /// each one's new tokens and first decode slot, and a scratch block for the padding of
    /// rows shorter than the longest. Sets each row's blocks and length.
    fn plan_extend(&mut self, rows: &[usize]) -> Result<ExtendPass, GenerateError> {
        let bs = self.pool.block_size();
        let mut caches = Vec::with_capacity(rows.len());
        for &id in rows {
            let mut c = self.extend.remove(&id).unwrap_or_else(|| unreachable!());
            let end = self.prompts[id].len() + 1; // its tokens and its first decode slot
            while c.blocks.len() * bs < end {
                let b = self.pool.alloc();
                c.blocks.push(b.ok_or_else(|| self.budget_error(id, end))?);
            }
            caches.push(c);
        }
        let news: Vec<usize> = rows
            .iter()
            .zip(&caches)
            .map(|(&id, c)| self.prompts[id].len() - c.len)
            .collect();
        let width = news.iter().copied().max().unwrap_or(1);
        // a block for the padding to write to, for this pass
        let scratch = if news.iter().any(|&k| k < width) {
            let b = self.pool.alloc();
            Some(b.ok_or_else(|| self.budget_error(rows[0], width))?)
        } else {
            None
        };
        let table_width = caches
            .iter()
            .map(|c| c.blocks.len().max((c.len + width).div_ceil(bs)))
            .max()
            .unwrap_or(1);
        if let Some(b) = scratch {
            self.pool.release(b); // free again after the pass, before later allocations
        }
        let mut out = Vec::with_capacity(rows.len());
        for ((&id, c), &k) in rows.iter().zip(caches).zip(&news) {
            let s = self.seq_mut(id);
            s.len = c.len + k;
            s.blocks = c.blocks.clone();
            out.push(ExtendRow {
                id,
                blocks: c.blocks,
                cached: c.len,
            });
        }
        self.stats.extend_passes += 1;
        self.stats.extend_tokens += news.iter().sum::<usize>();
        Ok(ExtendPass {
            rows: out,
            width,
            table_width,
            scratch,
        })
    }

    /// Each admitted sequence: a continuation takes its row of the extension pass; any
    /// other shares its prompt's full blocks and gets a copy of the partial one; a prompt
    /// whose last waiting sample is admitted gives its blocks up.
    fn plan_admitted(
        &mut self,
        admitted: &[usize],
        extending: &[usize],
    ) -> Result<Vec<Admission>, GenerateError> {
        let bs = self.pool.block_size();
        let mut out = Vec::with_capacity(admitted.len());
        for &id in admitted {
            let group = self.group_of[id];
            self.admissions += 1;
            let admitted_at = self.admissions;
            if let Some(k) = extending.iter().position(|&e| e == id) {
                // a continuation: its blocks and length set by the extension pass
                self.seq_mut(id).admitted = admitted_at;
                self.running.push(id);
                self.waiting[group] -= 1;
                out.push(Admission {
                    id,
                    logits: FirstLogits::Extend(k),
                    copy: None,
                });
                continue;
            }
            let prefix = self.prefixes.get(&group).unwrap_or_else(|| unreachable!());
            let (full, rest) = (prefix.len / bs, prefix.len % bs);
            let blocks: Vec<u32> = prefix.blocks[..full].to_vec();
            let partial = (rest > 0).then(|| prefix.blocks[full]);
            let len = prefix.len;
            blocks.iter().for_each(|&b| self.pool.retain(b));
            let mut s_blocks = blocks;
            let copy = match partial {
                Some(src) => {
                    let dst = self.pool.alloc();
                    let dst = dst.ok_or_else(|| self.budget_error(id, len))?;
                    s_blocks.push(dst);
                    Some((src, dst, rest))
                }
                None => None,
            };
            let s = self.seq_mut(id);
            s.blocks = s_blocks;
            s.len = len;
            s.admitted = admitted_at;
            self.running.push(id);
            self.waiting[group] -= 1;
            out.push(Admission {
                id,
                logits: FirstLogits::Prefix(group),
                copy,
            });
            if self.waiting[group] == 0
                && let Some(p) = self.prefixes.remove(&group)
            {
                p.blocks.iter().for_each(|&b| self.pool.release(b));
            }
        }
        Ok(out)
    }

    /// Whether prefix group `group`'s prompt is cached (its logits are still needed).
    pub(crate) fn has_prefix(&self, group: usize) -> bool {
        self.prefixes.contains_key(&group)
    }

    // ----- Freeing. -----

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
        // a restart draws its stream from the start: the same tokens
        self.seqs[id] = Some(fresh(id, (s.key.seed, s.key.sequence), s.max_new));
        self.waiting[self.group_of[id]] += 1;
        self.pending.push_front(id);
        self.stats.preemptions += 1;
    }

    /// Ends sequence `id`: frees its blocks (or keeps them, see `keep_finished`) and
    /// reports its output.
    fn finish(&mut self, id: usize, finished: &mut Vec<FinishedSequence>) {
        let s = self.seqs[id].take().unwrap_or_else(|| unreachable!());
        if self.keep_finished {
            let mut ids = self.prompts[s.prompt].clone();
            ids.extend_from_slice(&s.out.tokens);
            let cache = KeptCache {
                blocks: s.blocks,
                len: s.len,
            };
            let kept = Kept {
                ids,
                cache: Some(cache),
            };
            self.kept.insert(id, kept);
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

    /// [`Scheduler::drop_kept`], and the blocks of the continuations still waiting;
    /// whether there were any.
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
}

/// Sequence `id` of stream `(seed, index)` before its first token.
fn fresh(id: usize, stream: (u64, u64), max_new: usize) -> Sequence {
    Sequence {
        prompt: id,
        key: sequence_key(stream.0, stream.1),
        blocks: Vec::new(),
        len: 0,
        out: SequenceOutput::default(),
        max_new,
        admitted: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Sampling;

    const EOS: u32 = 99;

    fn scheduler(max_seqs: usize, block_size: usize, max_blocks: Option<usize>) -> Scheduler {
        let request = EngineRequest {
            max_new_tokens: 10,
            eos_ids: vec![EOS],
            sampling: Sampling::Greedy,
            seed: 0,
        };
        let config = EngineConfig {
            max_seqs,
            block_size,
            max_blocks,
            max_prefill_tokens: 8192,
            ..EngineConfig::default()
        };
        Scheduler::new(request, config).unwrap()
    }

    /// One engine step without a model: `token(id)` is what sequence `id` picks. Returns
    /// the decoded rows, the prefill plan and the sequences that ended.
    fn step(
        s: &mut Scheduler,
        token: impl Fn(usize) -> u32,
    ) -> (Vec<usize>, PrefillPlan, Vec<usize>) {
        let mut finished = Vec::new();
        let rows = s.schedule_decode().unwrap();
        let picks: Vec<_> = rows.iter().map(|&id| (token(id), 0.0, 0.0)).collect();
        s.push_decoded(&rows, &picks, &mut |_, _| {}, &mut finished)
            .unwrap();
        let plan = s.schedule_prefill().unwrap();
        let picks: Vec<_> = plan
            .admitted
            .iter()
            .map(|a| (token(a.id), 0.0, 0.0))
            .collect();
        s.push_admitted(&plan, &picks, &mut |_, _| {}, &mut finished)
            .unwrap();
        s.end_step();
        let ended = finished.iter().map(|f| f.id).collect();
        (rows, plan, ended)
    }

    /// Samples of one prompt share its prefill: one prefix written once, its full block
    /// shared by every sample, its partial block copied into each; the prefix's blocks go
    /// when its last sample is admitted, and each sample's blocks when it ends.
    #[test]
    fn shared_prompts_prefill_once_and_free_their_slots_at_eos() {
        let mut s = scheduler(8, 4, None);
        for _ in 0..3 {
            s.submit(vec![1, 2, 3, 4, 5], (0, 0));
        }
        let (rows, plan, _) = step(&mut s, |_| 7);
        assert!(rows.is_empty());
        assert_eq!(plan.prefill.len(), 1, "one prefill for three samples");
        assert_eq!(plan.prefill[0].blocks, [0, 1]);
        let ids: Vec<usize> = plan.admitted.iter().map(|a| a.id).collect();
        assert_eq!(ids, [0, 1, 2]);
        for (a, dst) in plan.admitted.iter().zip([2, 3, 4]) {
            assert_eq!(a.logits, FirstLogits::Prefix(0));
            assert_eq!(a.copy, Some((1, dst, 1)), "the partial block copied");
        }
        assert_eq!(s.pool().refs(0), 3, "the full block shared by the samples");
        assert_eq!(s.pool().refs(1), 0, "the prefix's partial block freed");
        assert_eq!(s.pool().in_use(), 4);
        // sequence 1 ends at EOS: its own block frees, the shared one loses an owner
        let (rows, _, ended) = step(&mut s, |id| if id == 1 { EOS } else { 7 });
        assert_eq!((rows, ended), (vec![0, 1, 2], vec![1]));
        assert_eq!((s.pool().refs(0), s.pool().refs(3)), (2, 0));
        while !s.is_idle() {
            step(&mut s, |_| 7);
        }
        assert_eq!(s.pool().in_use(), 0, "every block back at the end");
        let stats = s.stats();
        assert_eq!((stats.prefill_passes, stats.prefill_prompts), (1, 1));
        assert_eq!(stats.prefill_tokens, 5);
    }

    /// Out of blocks, the latest admitted sequence is preempted: its blocks free, it goes
    /// first in the queue, and it is admitted again only when blocks allow.
    #[test]
    fn preemption_takes_the_latest_admitted() {
        let mut s = scheduler(4, 2, Some(6));
        s.submit(vec![1, 2], (0, 0));
        s.submit(vec![3, 4], (0, 1));
        step(&mut s, |_| 7); // both admitted, one block each
        assert_eq!(s.pool().in_use(), 2);
        for _ in 0..4 {
            step(&mut s, |_| 7); // two more blocks each
        }
        assert_eq!((s.pool().in_use(), s.stats().preemptions), (6, 0));
        let (rows, plan, _) = step(&mut s, |_| 7);
        assert_eq!(rows, [0], "sequence 1 preempted for sequence 0's block");
        assert!(plan.admitted.is_empty(), "no room to re-admit it yet");
        assert_eq!(s.stats().preemptions, 1);
        assert_eq!(s.counts(), (1, 1));
        assert_eq!(s.pool().in_use(), 4);
        while !s.is_idle() {
            step(&mut s, |_| 7);
        }
        assert_eq!(s.pool().in_use(), 0);
    }

    /// A prompt longer than `max_prefill_tokens` is prefilled a chunk a step into its own
    /// blocks; the queue waits behind it; its last chunk makes it a prefix and its
    /// sequence is admitted in that step, with a short prompt that still fits the budget.
    #[test]
    fn chunked_prefill_takes_one_chunk_a_step() {
        let mut s = scheduler(8, 4, None);
        s.config.max_prefill_tokens = 4;
        s.submit((1..=10).collect(), (0, 0));
        s.submit(vec![1, 2], (0, 1));
        let (_, plan, _) = step(&mut s, |_| 7);
        assert_eq!(
            plan,
            PrefillPlan::default(),
            "the chunked prefill starts next step"
        );
        let mut chunks = Vec::new();
        let plan = loop {
            let (_, plan, _) = step(&mut s, |_| 7);
            let c = plan.chunk.clone().expect("a chunk each step");
            chunks.push((c.start, c.take, c.blocks.len()));
            if c.last {
                break plan;
            }
            assert!(
                plan.admitted.is_empty(),
                "the queue waits behind the chunks"
            );
        };
        assert_eq!(chunks, [(0, 4, 1), (4, 4, 2), (8, 2, 3)]);
        let ids: Vec<usize> = plan.admitted.iter().map(|a| a.id).collect();
        assert_eq!(ids, [0, 1]);
        assert_eq!(plan.admitted[0].logits, FirstLogits::Prefix(0));
        assert_eq!(plan.admitted[0].copy.map(|c| c.2), Some(2));
        assert_eq!(plan.prefill.len(), 1, "the short prompt in the same step");
        let stats = s.stats();
        assert_eq!((stats.prefill_passes, stats.prefill_tokens), (4, 12));
    }

    /// Admissions stop at `max_seqs` decode slots and at `max_prefill_tokens` prompt
    /// tokens a step; a sequence that cannot fit even alone is a budget error.
    #[test]
    fn budgets_bound_admissions() {
        let mut s = scheduler(2, 4, None);
        for p in 0..3 {
            s.submit(vec![p + 1; 4], (0, p as u64));
        }
        step(&mut s, |_| 7);
        assert_eq!(s.counts(), (1, 2), "two decode slots");

        let mut s = scheduler(8, 4, None);
        s.config.max_prefill_tokens = 8;
        for p in 0..3 {
            s.submit(vec![p + 1; 4], (0, p as u64));
        }
        let (_, plan, _) = step(&mut s, |_| 7);
        assert_eq!(plan.prefill.len(), 2, "8 prompt tokens a step");
        assert_eq!(s.counts(), (1, 2));

        let mut s = scheduler(1, 2, Some(1));
        s.submit(vec![1, 2, 3], (0, 0));
        let e = s.schedule_prefill().unwrap_err();
        assert!(
            matches!(e, GenerateError::KvBudget { sequence: 0, .. }),
            "{e}"
        );
    }

    /// A kept sequence's continuation extends its blocks: only its new tokens are
    /// prefilled, in the extension pass, from the parent's filled slots.
    #[test]
    fn continuations_extend_their_kept_blocks() {
        let mut s = scheduler(4, 4, None);
        s.keep_finished(true);
        s.submit(vec![1, 2, 3], (0, 0));
        step(&mut s, |_| 7);
        let (_, _, ended) = step(&mut s, |_| EOS);
        assert_eq!(ended, [0]);
        let held = s.pool().in_use();
        assert!(held > 0, "the finished sequence keeps its blocks");
        let mut prompt = s.kept_tokens(0).unwrap().to_vec();
        assert_eq!(prompt, [1, 2, 3, 7, EOS]);
        prompt.extend([5, 6]);
        let id = s.continue_with(0, prompt, (0, 9), 3).unwrap();
        let (_, plan, _) = step(&mut s, |_| 7);
        let pass = plan.extend.expect("an extension pass");
        assert_eq!(pass.rows.len(), 1);
        assert_eq!((pass.rows[0].id, pass.rows[0].cached), (id, 4));
        assert_eq!(plan.admitted[0].logits, FirstLogits::Extend(0));
        assert!(plan.prefill.is_empty(), "nothing prefilled from scratch");
        assert_eq!(
            s.stats().extend_tokens,
            3,
            "the parent's last token and two more"
        );
        s.release(0); // not kept any more: nothing to free
        while !s.is_idle() {
            step(&mut s, |_| 7);
        }
        s.release(id);
        assert_eq!(s.pool().in_use(), 0);
    }
}
