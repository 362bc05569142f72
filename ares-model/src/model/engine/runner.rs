//! The engine's runner: it turns the scheduler's plans into backend calls — the forward
//! passes over the paged KV cache ([`PagedKv`]), the prefill's writes into blocks, the
//! copies of partial blocks — and picks the next tokens on the device ([`Picks`]). It
//! decides nothing: which rows, blocks and chunks come from the plan.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::scheduler::{ChunkStep, ExtendPass, FirstLogits, NewPrefix, PrefillPlan, Scheduler};
use crate::backend::{Backend, BlockTables, Tensor, View, ViewMut};
use crate::model::decode_weights::DecodeWeights;
use crate::model::kv_cache::StepCache;
use crate::model::paged_kv::PagedKv;
use crate::model::picks::Picks;
use crate::model::request::{GenerateError, PromptVision};
use crate::model::sampling::SampleKey;
use crate::model::{Activations, EngineConfig, ForwardExtras, Inputs, Model, Sampling};

/// A decode pass of one shape: seen once (its buffers planned), captured, or not
/// capturable (the backend records no graph, or refused this pass).
enum Captured<G> {
    Seen,
    Graph(G),
    Failed,
}

/// How many decode passes were captured, replayed, or could not be captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GraphStats {
    pub(crate) captures: usize,
    pub(crate) replays: usize,
    pub(crate) failures: usize,
}

/// Decode buckets (`EngineConfig::decode_buckets`): passes padded to at most `max_rows`
/// rows, and the captured passes of the KV buffers' generation `kv`.
struct Buckets<G> {
    max_rows: usize,
    kv: u64,
    by_shape: HashMap<(usize, usize), Captured<G>>,
    stats: GraphStats,
}

/// The device side of the engine; see the module docs.
pub(crate) struct Runner<'a, B: Backend> {
    model: &'a Model<B>,
    tw: &'a DecodeWeights<B>,
    vision: Option<&'a PromptVision<'a, B>>,
    kv: PagedKv<B>,
    /// The picks of prefills' first tokens, and of decode passes (apart, so that neither
    /// re-plans the other's buffers).
    picks: Picks<B>,
    decode_picks: Picks<B>,
    /// The decode passes' arenas by rows.
    acts: HashMap<usize, Activations<B>>,
    /// The rows of the last decode pass (its arena holds its logits).
    decode_rows: usize,
    /// The decode passes' block tables `[rows, width]` and lengths `[rows]` on the device,
    /// by `(rows, width)` (the width grows by doubling): a decode step of a shape seen
    /// before allocates nothing.
    decode_tables: HashMap<(usize, usize), (B::Ids, B::Ids)>,
    /// With decode buckets: their size, and the passes captured as graphs by `(rows, width)`
    /// (the padding decodes into the spare KV block).
    buckets: Option<Buckets<B::Graph>>,
    /// The chunked prefill's arena.
    chunk_acts: Option<Activations<B>>,
    /// The next-token logits of each cached prompt, by prefix group.
    prefix_logits: HashMap<usize, B::Buffer>,
}

impl<'a, B: Backend> Runner<'a, B> {
    /// A runner generating with `model`'s transposed weights `tw` and, for multimodal
    /// prompts, `vision`; KV blocks and decode buckets as `config` says.
    ///
    /// # Errors
    /// A backend failure.
    pub(crate) fn new(
        model: &'a Model<B>,
        tw: &'a DecodeWeights<B>,
        vision: Option<&'a PromptVision<'a, B>>,
        config: EngineConfig,
    ) -> Result<Self, GenerateError> {
        let be = &model.backend;
        let spec = &model.spec;
        let spare = config.decode_buckets;
        Ok(Self {
            model,
            tw,
            vision,
            kv: PagedKv::new(
                be,
                spec.layers,
                spec.kv_dim(),
                config.block_size,
                spare,
                config.kv_cache_dtype,
            )?,
            picks: Picks::new(be, 1, spec.vocab)?,
            decode_picks: Picks::new(be, 1, spec.vocab)?,
            acts: HashMap::new(),
            decode_rows: 0,
            decode_tables: HashMap::new(),
            buckets: spare.then(|| Buckets {
                max_rows: config.max_seqs,
                kv: 0,
                by_shape: HashMap::new(),
                stats: GraphStats::default(),
            }),
            chunk_acts: None,
            prefix_logits: HashMap::new(),
        })
    }

    /// Whether the engine was made for multimodal prompts.
    pub(crate) fn is_multimodal(&self) -> bool {
        self.vision.is_some()
    }

    /// The M-RoPE `rope_delta` of prompt `prompt`'s conversation (0 for text): new token
    /// `k` after a conversation of `n` tokens sits at `n + k + delta` on all three axes.
    pub(crate) fn delta(&self, sched: &Scheduler, prompt: usize) -> i64 {
        self.vision
            .map_or(0, |v| v.rope_deltas[sched.origin(prompt)])
    }

    /// The multimodal inputs of `members`' prefill when one of them continues a
    /// conversation (its whole conversation prefilled: its kept blocks were freed, or it
    /// was preempted): each member's images are its first turn's — the engine's rows of
    /// that turn, renamed — and its M-RoPE table that turn's followed by text positions;
    /// `None` when every member is a submitted prompt (the engine's own inputs serve).
    fn continued_vision(
        &self,
        sched: &Scheduler,
        members: &[usize],
    ) -> Result<Option<ContinuedVision<'a, B>>, GenerateError> {
        let Some(v) = self.vision else {
            return Ok(None);
        };
        if members.iter().all(|&m| sched.origin(m) == m) {
            return Ok(None);
        }
        let model = self.model;
        let half = model.spec.head_dim / 2;
        let n = sched.prompts().len();
        let mut out = ContinuedVision {
            embeds: v.embeds,
            rows: Vec::new(),
            rope: vec![(Vec::new(), Vec::new()); n],
            deltas: vec![0; n],
        };
        // a conversation has one live sequence at a time, so a pass holds at most one
        // member per first turn, and that turn's rows can be renamed to it
        let mut member_of = HashMap::new();
        for &m in members {
            let o = sched.origin(m);
            if member_of.insert(o, m).is_some() {
                return Err(GenerateError::Sampling(format!(
                    "engine: two sequences of one conversation (prompt {o}) prefilled together"
                )));
            }
            let delta = v.rope_deltas[o];
            out.deltas[m] = delta;
            let (cos, sin) = &v.rope[o];
            let turn = cos.len() / half;
            let rest = sched.prompts()[m].len() - turn;
            let (tc, ts) = model.text_rope(turn as i64 + delta, rest)?;
            out.rope[m] = ([&cos[..], &tc].concat(), [&sin[..], &ts].concat());
        }
        // (the rows of prompts outside the pass keep their index: no member has it)
        out.rows = v
            .rows
            .iter()
            .map(|&(p, t)| (member_of.get(&p).copied().unwrap_or(p), t))
            .collect();
        Ok(Some(out))
    }

    /// Grows the KV buffers to the blocks the scheduler may hand out now.
    ///
    /// # Errors
    /// A backend failure.
    pub(crate) fn reserve(&mut self, sched: &Scheduler) -> Result<(), GenerateError> {
        let be = &self.model.backend;
        Ok(self.kv.reserve(be, sched.pool().capacity())?)
    }

    /// The picks of the last [`Runner::prefill`], one per admitted row.
    pub(crate) fn picked(&self, rows: usize) -> Vec<(u32, f32, f32)> {
        (0..rows).map(|r| self.picks.row(r)).collect()
    }

    /// The picks of the last [`Runner::decode`]'s first `rows` rows (the real ones).
    pub(crate) fn decoded(&self, rows: usize) -> Vec<(u32, f32, f32)> {
        (0..rows).map(|r| self.decode_picks.row(r)).collect()
    }

    /// The decode pass of sequences `rows`: one token each, at its own length, attending
    /// over its own blocks. Its logits wait for [`Runner::pick_decoded`].
    ///
    /// # Errors
    /// A model or backend failure.
    pub(crate) fn decode(
        &mut self,
        sched: &Scheduler,
        rows: &[usize],
    ) -> Result<(), GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let bs = sched.pool().block_size();
        // rows past the real ones pad the pass to its bucket: a dummy token at position 0
        // of the spare block, attending over itself
        let spare = self.kv.spare_block();
        let n = match (&self.buckets, spare) {
            (Some(b), Some(_)) => rows
                .len()
                .next_power_of_two()
                .min(b.max_rows.max(rows.len())),
            _ => rows.len(),
        };
        // This step's inputs and block tables; the width is a power of two (entries past a
        // row's blocks are never read: its length bounds its attention), so the device
        // tables change size only when the longest row's blocks double.
        let width = rows
            .iter()
            .map(|&id| sched.decode_row(id).1.len())
            .max()
            .unwrap_or(1)
            .max(1)
            .next_power_of_two();
        let mut host_tables = vec![0u32; n * width];
        let mut host_len = vec![0u32; n];
        let mut ids = vec![0u32; n];
        let mut positions = vec![0u32; n];
        for (r, &id) in rows.iter().enumerate() {
            let (prompt, blocks, len, last) = sched.decode_row(id);
            host_tables[r * width..r * width + blocks.len()].copy_from_slice(blocks);
            host_len[r] = len as u32;
            ids[r] = last;
            let delta = self.delta(sched, prompt);
            // check_vision (or the prompt check) has bounded every decode position
            positions[r] = (len as i64 + delta) as u32;
        }
        if let Some(spare) = spare {
            for r in rows.len()..n {
                host_tables[r * width] = spare;
            }
        }
        // the device tables and the arena of this shape: kept per shape with buckets (a
        // captured graph reads them), else only the current one
        if self.buckets.is_none() {
            self.decode_tables.retain(|&k, _| k == (n, width));
            self.acts.retain(|&k, _| k == n);
        }
        self.decode_rows = n;
        let Self {
            kv,
            decode_tables,
            acts,
            buckets,
            tw,
            ..
        } = self;
        let (tables, lens) = match decode_tables.entry((n, width)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert((be.alloc_ids(n * width)?, be.alloc_ids(n)?)),
        };
        let acts = match acts.entry(n) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(model.activations_full(n, 1)?),
        };
        be.upload_ids(&host_tables, tables)?;
        be.upload_ids(&host_len, lens)?;
        let ones = vec![1u32; n];
        let inputs = Inputs {
            batch: n,
            seq: 1,
            input_ids: &ids,
            attention_mask: &ones,
            position_ids: &positions,
        };
        let extras = ForwardExtras::default();
        model.stage_inputs(&inputs, &extras, acts)?;
        let step_tables = BlockTables {
            block_size: bs,
            max_blocks: width,
            tables: &*tables,
            len: &*lens,
            host_tables: &host_tables,
            host_len: &host_len,
        };
        let tw = Some(*tw);
        let run = |kv: &mut PagedKv<B>, acts: &mut Activations<B>| {
            let cache = StepCache::Paged(kv, step_tables);
            model.forward_staged(&inputs, &extras, acts, Some(cache), tw)
        };
        // a captured pass is replayed on the staged inputs; a shape seen once is captured
        // the next time (its first pass planned its buffers); the KV buffers' reallocation
        // retires every graph (they read the old ones)
        let Some(graphs) = buckets.as_mut() else {
            run(kv, acts)?;
            return Ok(());
        };
        if graphs.kv != kv.generation() {
            graphs.by_shape.clear();
            graphs.kv = kv.generation();
        }
        let key = (n, width);
        match graphs.by_shape.get(&key) {
            Some(Captured::Graph(g)) => {
                be.replay(g)?;
                graphs.stats.replays += 1;
            }
            Some(Captured::Seen) => {
                let captured = if be.begin_capture()? {
                    let ran = run(kv, acts);
                    let graph = be.end_capture()?;
                    match (ran, graph) {
                        (Ok(()), Some(g)) => Some(g),
                        _ => None,
                    }
                } else {
                    None
                };
                match captured {
                    Some(g) => {
                        be.replay(&g)?;
                        graphs.stats.captures += 1;
                        graphs.by_shape.insert(key, Captured::Graph(g));
                    }
                    None => {
                        // nothing ran: run the pass as it is, and never capture this shape
                        graphs.stats.failures += 1;
                        graphs.by_shape.insert(key, Captured::Failed);
                        run(kv, acts)?;
                    }
                }
            }
            Some(Captured::Failed) => run(kv, acts)?,
            None => {
                graphs.by_shape.insert(key, Captured::Seen);
                run(kv, acts)?;
            }
        }
        Ok(())
    }

    /// The graphs' counts so far (zeros without decode buckets).
    pub(crate) fn graph_stats(&self) -> GraphStats {
        self.buckets.as_ref().map(|g| g.stats).unwrap_or_default()
    }

    /// A token per row of the last decode pass's logits, `draw(r)` row `r`'s sampling key.
    ///
    /// # Errors
    /// A backend failure.
    pub(crate) fn pick_decoded(
        &mut self,
        sampling: Sampling,
        draw: impl FnMut(usize) -> SampleKey,
    ) -> Result<(), GenerateError> {
        let acts = self
            .acts
            .get(&self.decode_rows)
            .unwrap_or_else(|| unreachable!("a decode pass ran"));
        self.decode_picks
            .pick(&self.model.backend, acts.logits(), sampling, draw)
    }

    /// A token per row of `logits` (the admitted rows' first-token logits).
    ///
    /// # Errors
    /// A backend failure.
    pub(crate) fn pick(
        &mut self,
        logits: &B::Buffer,
        sampling: Sampling,
        draw: impl FnMut(usize) -> SampleKey,
    ) -> Result<(), GenerateError> {
        self.picks
            .pick(&self.model.backend, View::whole(logits), sampling, draw)
    }

    /// The prefill half of a step as `plan` lays it out — the chunk, the new prompts' pass
    /// and their writes into blocks, the continuations' pass — then the admitted sequences'
    /// partial-block copies; returns their first-token logits `[admitted, vocab]` (`None`
    /// when none is admitted).
    ///
    /// # Errors
    /// A model or backend failure.
    pub(crate) fn prefill(
        &mut self,
        sched: &Scheduler,
        plan: &PrefillPlan,
    ) -> Result<Option<B::Buffer>, GenerateError> {
        if let Some(chunk) = &plan.chunk {
            self.chunk(sched, chunk)?;
        }
        if !plan.prefill.is_empty() {
            self.new_prefixes(sched, &plan.prefill)?;
        }
        let ext_logits = match &plan.extend {
            Some(pass) => Some(self.extend(sched, pass)?),
            None => None,
        };
        if plan.admitted.is_empty() {
            return Ok(None);
        }
        // Each admitted sequence: its first-token logits gathered, its partial block copied.
        let be = &self.model.backend;
        let v = self.model.spec.vocab;
        let mut logits = be.alloc(plan.admitted.len() * v)?;
        for (r, a) in plan.admitted.iter().enumerate() {
            let src = match a.logits {
                FirstLogits::Prefix(group) => {
                    let l = self.prefix_logits.get(&group);
                    View::whole(l.unwrap_or_else(|| unreachable!("prefix {group} has logits")))
                }
                FirstLogits::Extend(k) => {
                    let ext = ext_logits.as_ref().unwrap_or_else(|| unreachable!());
                    View::new(ext, k * v, v)?
                }
            };
            be.copy(src, ViewMut::new(&mut logits, r * v, v)?)?;
            if let Some((src, dst, slots)) = a.copy {
                self.kv.copy_block(be, src, dst, slots)?;
            }
        }
        Ok(Some(logits))
    }

    /// Drops the logits of prompts the scheduler no longer caches.
    pub(crate) fn forget_prefixes(&mut self, sched: &Scheduler) {
        self.prefix_logits.retain(|&g, _| sched.has_prefix(g));
    }

    /// The chunk's tokens as one sequence at slots `start..`, attending over the prompt's
    /// blocks ([`Backend::paged_attention_decode`]: each query sees the slots up to its
    /// own). The last chunk's final position gives the prompt's logits.
    fn chunk(&mut self, sched: &Scheduler, c: &ChunkStep) -> Result<(), GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let (start, take) = (c.start, c.take);
        let ids = &sched.prompts()[c.prompt][start..start + take];
        let positions: Vec<u32> = (start..start + take).map(|p| p as u32).collect();
        // a multimodal chunk: its image/video rows and its span of the M-RoPE tables (a
        // continued conversation's, when it is one)
        let continued = self.continued_vision(sched, &[c.prompt])?;
        let view = continued.as_ref().map(ContinuedVision::view);
        let (rows, rope) = match view.as_ref().or(self.vision) {
            Some(v) => {
                let rows = chunk_vision_rows(be, v, c.prompt, start, take, model.spec.hidden)?;
                let half = model.spec.head_dim / 2;
                let (cos, sin) = &v.rope[c.prompt];
                let span = start * half..(start + take) * half;
                (rows, Some((&cos[span.clone()], &sin[span])))
            }
            None => (None, None),
        };
        let extras = ForwardExtras {
            embeds: rows.as_ref().map(|(ids, e)| (ids, View::whole(e))),
            rope,
            segments: None,
        };
        let ones = vec![1u32; take];
        let inputs = Inputs {
            batch: 1,
            seq: take,
            input_ids: ids,
            attention_mask: &ones,
            position_ids: &positions,
        };
        let host_len = [start as u32];
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
            block_size: sched.pool().block_size(),
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
            Some(StepCache::Paged(&mut self.kv, step_tables)),
            Some(self.tw),
        )?;
        if c.last {
            // the chunk's last row is the prompt's last position
            let head = model.prefill_head(acts, self.tw)?;
            let mut logits = be.alloc(model.spec.vocab)?;
            be.copy(head, ViewMut::whole(&mut logits))?;
            self.prefix_logits.insert(c.group, logits);
        }
        Ok(())
    }

    /// The new prompts in one left-padded pass, each written into its own blocks.
    fn new_prefixes(&mut self, sched: &Scheduler, news: &[NewPrefix]) -> Result<(), GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let members: Vec<usize> = news.iter().map(|p| p.prompt).collect();
        let prompts = sched.prompts();
        let continued = self.continued_vision(sched, &members)?;
        let view = continued.as_ref().map(ContinuedVision::view);
        let vision = view.as_ref().or(self.vision);
        let prefill = model.prefill(prompts, &members, vision, 0, self.tw)?;
        let v = model.spec.vocab;
        for (k, p) in news.iter().enumerate() {
            let len = prompts[p.prompt].len();
            let from = prefill.width - len;
            self.kv
                .write_from(be, &prefill.cache, k, from, len, &p.blocks)?;
            let mut logits = be.alloc(v)?;
            be.copy(
                View::new(&prefill.logits, k * v, v)?,
                ViewMut::whole(&mut logits),
            )?;
            self.prefix_logits.insert(p.group, logits);
        }
        Ok(())
    }

    /// The continuations of `pass` in one pass: row `b`'s new tokens (its parent's last
    /// token and the appended ones) at its slots `cached..`, right-padded to the longest
    /// row. Padding slots past a row's own blocks go to the scratch block; a query sees
    /// only the slots up to its own, so no real token attends to padding. Returns the
    /// next-token logits `[rows, vocab]`.
    fn extend(&mut self, sched: &Scheduler, pass: &ExtendPass) -> Result<B::Buffer, GenerateError> {
        let model = self.model;
        let be = &model.backend;
        let prompts = sched.prompts();
        let (n, width, table_width) = (pass.rows.len(), pass.width, pass.table_width);
        let mut host_tables = vec![pass.scratch.unwrap_or(0); n * table_width];
        let mut host_len = Vec::with_capacity(n);
        let mut ids = vec![0u32; n * width];
        let mut positions = vec![0u32; n * width];
        let mut last = Vec::with_capacity(n);
        for (b, row) in pass.rows.iter().enumerate() {
            let new = &prompts[row.id][row.cached..];
            let k = new.len();
            // a multimodal conversation's text positions run `delta` from its slots
            let delta = self.delta(sched, row.id);
            host_tables[b * table_width..b * table_width + row.blocks.len()]
                .copy_from_slice(&row.blocks);
            host_len.push(row.cached as u32);
            ids[b * width..b * width + k].copy_from_slice(new);
            // (a padding token takes the row's last position: any valid one will do)
            for (i, p) in positions[b * width..(b + 1) * width].iter_mut().enumerate() {
                *p = ((row.cached + i.min(k - 1)) as i64 + delta) as u32;
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
            block_size: sched.pool().block_size(),
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
            Some(StepCache::Paged(&mut self.kv, step_tables)),
            Some(self.tw),
        )?;
        let head = model.prefill_head_rows(&mut acts, self.tw, &last)?;
        let mut logits = be.alloc(n * model.spec.vocab)?;
        be.copy(head, ViewMut::whole(&mut logits))?;
        Ok(logits)
    }
}

/// The multimodal inputs of a prefill that holds continued conversations (see
/// [`Runner::continued_vision`]), indexed by prompt like the engine's own: its embeddings,
/// their rows renamed to the members, and the members' M-RoPE tables and deltas (empty
/// for the other prompts).
struct ContinuedVision<'a, B: Backend> {
    embeds: Tensor<'a, B>,
    rows: Vec<(usize, usize)>,
    rope: Vec<(Vec<f32>, Vec<f32>)>,
    deltas: Vec<i64>,
}

impl<B: Backend> ContinuedVision<'_, B> {
    fn view(&self) -> PromptVision<'_, B> {
        PromptVision {
            embeds: self.embeds,
            rows: &self.rows,
            rope: &self.rope,
            rope_deltas: &self.deltas,
            same_embeds: None,
        }
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
