//! [`Batch`]: a step's kept groups as the rest of the step sees them — prompts,
//! responses, grades, padded token tensors — and the scoring of its responses under a
//! model (old policy, reference) in micro-batches.

use crate::backend::Backend;
use crate::model::Model;

use super::TrainError;
use super::rewards::Grade;
use super::rollout::{PromptItem, Response};
use super::sequences::{Packed, response_log_probs};
use super::tokens::TokenBatch;

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
    /// Assembles a batch; `responses`, `texts` and `grades` are item-major.
    ///
    /// # Errors
    /// Counts that do not match `items.len() · n`.
    pub fn new(
        n: usize,
        items: Vec<PromptItem>,
        responses: Vec<Response>,
        texts: Vec<String>,
        grades: Vec<Grade>,
    ) -> Result<Self, TrainError> {
        let rows = items.len() * n;
        if responses.len() != rows || texts.len() != rows || grades.len() != rows {
            return Err(TrainError::Internal(format!(
                "batch of {} groups × {n}: {} responses, {} texts, {} grades",
                items.len(),
                responses.len(),
                texts.len(),
                grades.len()
            )));
        }
        let lengths: Vec<usize> = responses.iter().map(|r| r.tokens.len()).collect();
        let tokens = TokenBatch::from_lengths(&lengths);
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

    /// Response lengths in tokens.
    pub fn lengths(&self) -> Vec<usize> {
        self.responses.iter().map(|r| r.tokens.len()).collect()
    }

    /// A `[rows, T]` tensor of a per-token field of the responses.
    pub fn padded(&self, field: impl Fn(&Response) -> &[f32]) -> Vec<f32> {
        let rows: Vec<Vec<f32>> = self.responses.iter().map(|r| field(r).to_vec()).collect();
        self.tokens.pad(&rows, 0.0)
    }

    /// Packs `rows` for the model with the batch-wide `P` and `T`.
    ///
    /// # Errors
    /// As [`Packed::new`].
    pub fn pack(&self, rows: &[usize]) -> Result<Packed, TrainError> {
        let prompts: Vec<&[u32]> = rows
            .iter()
            .map(|&r| self.items[self.group_of(r)].train_prompt.as_slice())
            .collect();
        let responses: Vec<&[u32]> = rows
            .iter()
            .map(|&r| self.responses[r].tokens.as_slice())
            .collect();
        Packed::new(&prompts, &responses, self.prompt_cols, self.tokens.cols())
    }

    /// Log-probs `[rows, T]` of every response under `model` at `temperature`, `micro`
    /// rows per forward pass (0 on padding).
    ///
    /// # Errors
    /// The model's.
    pub fn score<B: Backend>(
        &self,
        model: &Model<B>,
        micro: usize,
        temperature: f32,
    ) -> Result<Vec<f32>, TrainError> {
        let t = self.tokens.cols();
        let rows: Vec<usize> = (0..self.rows()).collect();
        let mut out = Vec::with_capacity(self.rows() * t);
        let mut arena: Option<(usize, crate::model::Activations<B>)> = None;
        for chunk in rows.chunks(micro.max(1)) {
            let packed = self.pack(chunk)?;
            let acts = match &mut arena {
                Some((len, a)) if *len == chunk.len() => a,
                _ => {
                    let a = model.activations(chunk.len(), packed.seq())?;
                    &mut arena.insert((chunk.len(), a)).1
                }
            };
            let (logp, _) = response_log_probs(model, acts, &packed, temperature)?;
            out.extend_from_slice(&logp);
        }
        for (v, &m) in out.iter_mut().zip(&self.tokens.mask) {
            if m == 0.0 {
                *v = 0.0;
            }
        }
        Ok(out)
    }
}
