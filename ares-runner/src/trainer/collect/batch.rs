//! [`Batch`]: a step's kept groups as the rest of the step sees them — prompts,
//! responses, grades, padded token tensors — and the scoring of its responses under a
//! model (old policy, reference) in micro-batches.

use crate::backend::{Backend, View, ViewMut};
use crate::vision::model::VisionBatch;

use crate::parallel::Ranks;
use crate::parallel::wire::{Reader, Writer};
use crate::trainer::TrainError;
use crate::trainer::actor::{Actor, concat_vision};
use crate::trainer::collect::rollout::{PromptItem, Response};
use crate::trainer::collect::tokens::TokenBatch;
use crate::trainer::prepare::rewards::Grade;
use crate::trainer::prepare::sequences::{Layout, Packed, packed_tokens};

/// One prompt and its `n` graded samples, as a round of generation produced them.
#[derive(Debug, Clone)]
pub struct Group {
    /// The prompt.
    pub item: PromptItem,
    /// Its samples.
    pub responses: Vec<Response>,
    /// Their decoded texts.
    pub texts: Vec<String>,
    /// Their grades.
    pub grades: Vec<Grade>,
}

/// The samples of a step: `items.len()` groups of `n` consecutive rows.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Samples per group.
    pub n: usize,
    /// The groups' prompts.
    pub items: Vec<PromptItem>,
    /// One response per row.
    pub responses: Vec<Response>,
    /// Decoded response texts.
    pub texts: Vec<String>,
    /// One grade per row.
    pub grades: Vec<Grade>,
    /// Response mask `[rows, T]`.
    pub tokens: TokenBatch,
    /// Longest training prompt `P`.
    pub prompt_cols: usize,
}

impl Batch {
    /// Assembles a batch from its groups, each with `n` samples.
    ///
    /// # Errors
    /// A group without exactly `n` responses, texts and grades.
    pub fn new(n: usize, groups: Vec<Group>) -> Result<Self, TrainError> {
        let rows = groups.len() * n;
        let (mut items, mut responses, mut texts, mut grades) = (
            Vec::with_capacity(groups.len()),
            Vec::with_capacity(rows),
            Vec::with_capacity(rows),
            Vec::with_capacity(rows),
        );
        for g in groups {
            if g.responses.len() != n || g.texts.len() != n || g.grades.len() != n {
                return Err(TrainError::Internal(format!(
                    "group {:?} of a batch with n = {n}: {} responses, {} texts, {} grades",
                    g.item.global_id,
                    g.responses.len(),
                    g.texts.len(),
                    g.grades.len()
                )));
            }
            items.push(g.item);
            responses.extend(g.responses);
            texts.extend(g.texts);
            grades.extend(g.grades);
        }
        let tokens = TokenBatch::from_responses(&responses);
        let prompt_cols = items
            .iter()
            .map(|i| i.train_prompt.len())
            .max()
            .unwrap_or(1);
        Ok(Self {
            n,
            items,
            responses,
            texts,
            grades,
            tokens,
            prompt_cols,
        })
    }

    /// Rows (samples).
    pub fn rows(&self) -> usize {
        self.responses.len()
    }

    /// Group of row `r`.
    pub fn group_of(&self, r: usize) -> usize {
        r / self.n
    }

    /// Response lengths in tokens: the model's (a multi-turn episode's tool tokens left
    /// out).
    pub fn lengths(&self) -> Vec<usize> {
        self.responses.iter().map(Response::model_len).collect()
    }

    /// A `[rows, T]` tensor of a per-token field of the responses.
    pub fn padded(&self, field: impl Fn(&Response) -> &[f32]) -> Vec<f32> {
        let rows: Vec<Vec<f32>> = self.responses.iter().map(|r| field(r).to_vec()).collect();
        self.tokens.pad(&rows, 0.0)
    }

    /// The layout of `chunks` (each a pass of the model): with `padding_free`, packed to
    /// the longest chunk's tokens; else padded.
    pub fn layout(&self, chunks: &[&[usize]], padding_free: bool) -> Layout {
        if !padding_free {
            return Layout::Padded;
        }
        let tokens = chunks
            .iter()
            .map(|rows| {
                let (p, a) = self.samples(rows);
                packed_tokens(&p, &a)
            })
            .max()
            .unwrap_or(0);
        Layout::Packed { tokens }
    }

    /// The prompts and responses of `rows`.
    fn samples(&self, rows: &[usize]) -> (Vec<&[u32]>, Vec<&[u32]>) {
        let prompts = rows
            .iter()
            .map(|&r| self.items[self.group_of(r)].train_prompt.as_slice())
            .collect();
        let responses = rows
            .iter()
            .map(|&r| self.responses[r].tokens.as_slice())
            .collect();
        (prompts, responses)
    }

    /// Lays `rows` out for the model: padded with the batch-wide `P` and `T`, or packed.
    ///
    /// # Errors
    /// As [`Packed::new`] and [`Packed::unpadded`].
    pub fn pack(&self, rows: &[usize], layout: Layout) -> Result<Packed, TrainError> {
        let (prompts, responses) = self.samples(rows);
        match layout {
            Layout::Padded => {
                Packed::new(&prompts, &responses, self.prompt_cols, self.tokens.cols())
            }
            Layout::Packed { tokens } => {
                Packed::unpadded(&prompts, &responses, self.tokens.cols(), tokens)
            }
        }
    }

    /// The images and videos of `rows` (their prompts', in row order), `None` for text.
    pub fn vision(&self, rows: &[usize]) -> Option<VisionBatch> {
        let v: Vec<_> = rows
            .iter()
            .map(|&r| &self.items[self.group_of(r)].vision)
            .collect();
        concat_vision(&v)
    }

    /// Log-probs `[rows, T]` of every response under `model` at `temperature`, `micro`
    /// rows per forward pass, left on the device (padding positions hold whatever the model
    /// computed there: mask them). Each row's response columns are copied device to
    /// device, so nothing crosses to the host here.
    ///
    /// # Errors
    /// The model's.
    pub fn score<B: Backend>(
        &self,
        model: &Actor<B>,
        (micro, padding_free): (usize, bool),
        temperature: f32,
        ranks: Option<&Ranks>,
    ) -> Result<B::Buffer, TrainError> {
        let t = self.tokens.cols();
        let be = model.backend();
        let mut out = be.alloc(self.rows() * t)?;
        let rows: Vec<usize> = (0..self.rows()).collect();
        let chunks: Vec<&[usize]> = rows.chunks(micro.max(1)).collect();
        let layout = self.layout(&chunks, padding_free);
        let mut arena: Option<crate::model::Activations<B>> = None;
        let Some(ranks) = ranks else {
            for chunk in &chunks {
                self.score_rows(model, chunk, layout, temperature, &mut arena, &mut out)?;
            }
            return Ok(out);
        };
        // a data-parallel run: each rank scores its block of micro-batches, which are
        // those of a run without ranks (same rows, same shapes, so the same bits)
        let units = ranks.map_units(chunks.len(), |c| {
            let chunk = chunks[c];
            self.score_rows(model, chunk, layout, temperature, &mut arena, &mut out)?;
            let mut host = vec![0.0f32; chunk.len() * t];
            let first = View::new(&out, chunk[0] * t, chunk.len() * t)?;
            be.download(first, &mut host)?;
            let mut w = Writer::default();
            w.f32s(&host);
            Ok(w.finish())
        })?;
        let mut all = Vec::with_capacity(self.rows() * t);
        for bytes in &units {
            let mut r = Reader::new(bytes);
            all.extend(r.f32s().map_err(|e| e.at(ranks.rank()))?);
            r.end().map_err(|e| e.at(ranks.rank()))?;
        }
        if all.len() != self.rows() * t {
            return Err(TrainError::Internal(format!(
                "scoring gathered {} log-probs for {} rows of {t}",
                all.len(),
                self.rows()
            )));
        }
        be.upload(&all, ViewMut::whole(&mut out))?;
        Ok(out)
    }

    /// Scores the consecutive rows `chunk` into their rows of `out` (see [`Batch::score`]).
    #[allow(clippy::too_many_arguments)]
    fn score_rows<B: Backend>(
        &self,
        model: &Actor<B>,
        chunk: &[usize],
        layout: Layout,
        temperature: f32,
        arena: &mut Option<crate::model::Activations<B>>,
        out: &mut B::Buffer,
    ) -> Result<(), TrainError> {
        let t = self.tokens.cols();
        let be = model.backend();
        let packed = self.pack(chunk, layout)?;
        let shape = (packed.batch(), packed.seq());
        let acts = match arena {
            Some(a) if a.shape() == shape => a,
            // a forward pass only: one layer's activations besides the residual stream
            _ => arena.insert(model.lm().activations_forward(shape.0, shape.1)?),
        };
        let vision = self.vision(chunk);
        model.forward(&packed, vision.as_ref(), acts, false)?;
        model
            .lm()
            .log_prob_entropy(acts, &packed.targets, temperature)?;
        let logp = acts.log_probs();
        for (i, &row) in chunk.iter().enumerate() {
            // response token j is predicted at `at + j` (padded: column P − 1 + j of its row)
            let (at, len) = packed.response_span(i);
            let len = len.min(t);
            let src = View::new(logp.buffer(), logp.offset() + at, len)?;
            be.copy(src, ViewMut::new(out, row * t, len)?)?;
            if len < t {
                be.fill(ViewMut::new(out, row * t + len, t - len)?, 0.0)?;
            }
        }
        Ok(())
    }
}
