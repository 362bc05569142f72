//! Prompt + response sequences laid out for the model, and the per-token log-probs of the
//! responses under a model.
//!
//! Layout of a batch of `rows` samples, `P` = the longest prompt, `T` = the longest
//! response: `[pad … prompt | response … pad]`, prompts left-padded to `P` and responses
//! right-padded to `T`, so that response token `j` of every row sits at column `P + j` and
//! its log-prob comes from the logits at column `P + j − 1`. Positions count each row's own
//! tokens from 0 (left padding does not shift them), as in generation, so the log-probs
//! computed here are those of the tokens the sampler produced.

use crate::backend::Backend;
use crate::model::{Activations, Inputs, Model};

use crate::trainer::TrainError;

/// A packed batch, `[rows, P + T]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Rows.
    pub rows: usize,
    /// Prompt columns `P`.
    pub prompt_cols: usize,
    /// Response columns `T`.
    pub response_cols: usize,
    /// Token ids (0 on padding).
    pub input_ids: Vec<u32>,
    /// 1 on prompt and response tokens.
    pub attention_mask: Vec<u32>,
    /// Each row's own token positions from 0.
    pub position_ids: Vec<u32>,
    /// `targets[c]` = `input_ids[c + 1]` (0 in the last column): what logits row `c`
    /// predicts.
    pub targets: Vec<u32>,
}

impl Packed {
    /// Packs `prompts[i] ++ responses[i]` with `prompt_cols ≥` every prompt and
    /// `response_cols ≥` every response (use the step's maxima so every micro-batch has
    /// one shape and one activation arena).
    ///
    /// # Errors
    /// A prompt or response longer than its columns, or an empty prompt.
    pub fn new(
        prompts: &[&[u32]],
        responses: &[&[u32]],
        prompt_cols: usize,
        response_cols: usize,
    ) -> Result<Self, TrainError> {
        let rows = prompts.len();
        if responses.len() != rows {
            return Err(TrainError::Internal(format!(
                "pack: {rows} prompts and {} responses",
                responses.len()
            )));
        }
        let seq = prompt_cols + response_cols;
        let mut input_ids = vec![0u32; rows * seq];
        let mut attention_mask = vec![0u32; rows * seq];
        let mut position_ids = vec![0u32; rows * seq];
        for (r, (p, a)) in prompts.iter().zip(responses).enumerate() {
            if p.is_empty() || p.len() > prompt_cols || a.len() > response_cols {
                return Err(TrainError::Internal(format!(
                    "pack: row {r} has a prompt of {} tokens (columns {prompt_cols}) and a \
                     response of {} (columns {response_cols})",
                    p.len(),
                    a.len()
                )));
            }
            let row = r * seq;
            let start = prompt_cols - p.len();
            for (k, &id) in p.iter().chain(a.iter()).enumerate() {
                let c = row + start + k;
                input_ids[c] = id;
                attention_mask[c] = 1;
                position_ids[c] = k as u32;
            }
        }
        let mut targets = vec![0u32; rows * seq];
        for (t, ids) in targets
            .chunks_exact_mut(seq)
            .zip(input_ids.chunks_exact(seq))
        {
            t[..seq - 1].copy_from_slice(&ids[1..]);
        }
        Ok(Self {
            rows,
            prompt_cols,
            response_cols,
            input_ids,
            attention_mask,
            position_ids,
            targets,
        })
    }

    /// Columns per row, `P + T`.
    pub fn seq(&self) -> usize {
        self.prompt_cols + self.response_cols
    }

    /// The model inputs.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.rows,
            seq: self.seq(),
            input_ids: &self.input_ids,
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
        }
    }

    /// Extracts the response part `[rows, T]` of a per-position tensor `[rows, P + T]`
    /// (e.g. the log-probs of the targets): column `P − 1 + j` holds response token `j`.
    pub fn response_part(&self, per_position: &[f32]) -> Vec<f32> {
        let (seq, t) = (self.seq(), self.response_cols);
        let mut out = Vec::with_capacity(self.rows * t);
        for row in per_position.chunks_exact(seq) {
            out.extend_from_slice(&row[self.prompt_cols - 1..self.prompt_cols - 1 + t]);
        }
        out
    }

    /// Spreads `[rows, T]` response values to `[rows, P + T]` (0 elsewhere): the inverse
    /// of [`Packed::response_part`], for the loss coefficients.
    pub fn spread_response(&self, response: &[f32]) -> Vec<f32> {
        let (seq, t) = (self.seq(), self.response_cols);
        let mut out = vec![0.0f32; self.rows * seq];
        for (dst, src) in out.chunks_exact_mut(seq).zip(response.chunks_exact(t)) {
            dst[self.prompt_cols - 1..self.prompt_cols - 1 + t].copy_from_slice(src);
        }
        out
    }
}

/// Log-probs and entropies `[rows, T]` of the packed responses under `model` at
/// `temperature` (padding positions hold whatever the model computed there; mask them).
///
/// # Errors
/// The model's.
pub fn response_log_probs<B: Backend>(
    model: &Model<B>,
    acts: &mut Activations<B>,
    packed: &Packed,
    temperature: f32,
) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
    model.forward(&packed.inputs(), acts)?;
    response_log_probs_after_forward(model, acts, packed, temperature)
}

/// [`response_log_probs`] after the forward pass already ran on `acts` (a
/// vision-language model's, [`crate::trainer::actor::Actor::forward`]).
///
/// # Errors
/// The model's.
pub fn response_log_probs_after_forward<B: Backend>(
    model: &Model<B>,
    acts: &mut Activations<B>,
    packed: &Packed,
    temperature: f32,
) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
    model.log_prob_entropy(acts, &packed.targets, temperature)?;
    let n = packed.rows * packed.seq();
    let mut logp = vec![0.0f32; n];
    let mut ent = vec![0.0f32; n];
    let b = model.backend();
    b.download(acts.log_probs(), &mut logp)
        .map_err(crate::model::ModelError::from)?;
    b.download(acts.entropies(), &mut ent)
        .map_err(crate::model::ModelError::from)?;
    Ok((packed.response_part(&logp), packed.response_part(&ent)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_aligns_responses() {
        let p = Packed::new(&[&[5, 6], &[7]], &[&[1], &[2, 3]], 2, 2).unwrap();
        assert_eq!(p.input_ids, [5, 6, 1, 0, 0, 7, 2, 3]);
        assert_eq!(p.attention_mask, [1, 1, 1, 0, 0, 1, 1, 1]);
        assert_eq!(p.position_ids, [0, 1, 2, 0, 0, 0, 1, 2]);
        assert_eq!(p.targets, [6, 1, 0, 0, 7, 2, 3, 0]);
        // target at column P−1+j is response token j
        let per_pos: Vec<f32> = (0..8).map(|x| x as f32).collect();
        assert_eq!(p.response_part(&per_pos), [1.0, 2.0, 5.0, 6.0]);
        assert_eq!(
            p.spread_response(&[1.0, 2.0, 5.0, 6.0]),
            [0.0, 1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 0.0]
        );
    }

    #[test]
    fn too_long_rows_are_rejected() {
        assert!(Packed::new(&[&[1, 2, 3]], &[&[1]], 2, 2).is_err());
        assert!(Packed::new(&[&[]], &[&[1]], 2, 2).is_err());
    }
}
