//! Prompt + response sequences laid out for the model, and the per-token log-probs of the
//! responses under a model.
//!
//! Two layouts of a batch of `rows` samples:
//! - **padded** (`Packed::new`), `P` = the longest prompt, `T` = the longest response:
//!   `[pad … prompt | response … pad]` per row, prompts left-padded to `P` and responses
//!   right-padded to `T`, so that response token `j` of every row sits at column `P + j`
//!   and its log-prob comes from the logits at column `P + j − 1`;
//! - **packed** (`Packed::unpadded`, flash-attn's "remove padding"): one row of the samples'
//!   `prompt | response` back to back, then padding up to a fixed length, with their
//!   offsets (`cu_seqlens`) for an attention that stays within each — no work on padding
//!   but the tail's.
//!
//! Positions count each sample's own tokens from 0 in both (left padding does not shift
//! them), as in generation, so the log-probs computed here are those of the tokens the
//! sampler produced. Either way the responses come back as `[rows, T]` tensors.

use crate::backend::Backend;
use crate::model::{Activations, ForwardExtras, Inputs, Model};

use crate::trainer::TrainError;

/// A batch laid out for the model: `[rows, P + T]` row-major (padded), or one row of the
/// samples back to back (packed, [`Packed::segments`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Samples.
    pub rows: usize,
    /// Prompt columns `P` (padded; packed: the longest prompt, for the vision layout).
    pub prompt_cols: usize,
    /// Response columns `T` of the `[rows, T]` tensors.
    pub response_cols: usize,
    /// Token ids (0 on padding).
    pub input_ids: Vec<u32>,
    /// 1 on prompt and response tokens.
    pub attention_mask: Vec<u32>,
    /// Each sample's own token positions from 0.
    pub position_ids: Vec<u32>,
    /// `targets[c]` = `input_ids[c + 1]` within a sample (0 at its last token and on
    /// padding): what logits row `c` predicts.
    pub targets: Vec<u32>,
    /// Packed: the samples' offsets in the row, then the tail's (`cu_seqlens`).
    segments: Option<Vec<u32>>,
    /// Per sample, the flat index predicting its response token 0 (`P − 1` of its row, or
    /// its prompt's last token in the packed row) and its response length.
    responses: Vec<(usize, usize)>,
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
        // every row's T columns, padding included (the caller masks it)
        let responses = (0..rows)
            .map(|r| (r * seq + prompt_cols - 1, response_cols))
            .collect();
        Ok(Self {
            rows,
            prompt_cols,
            response_cols,
            input_ids,
            attention_mask,
            position_ids,
            targets,
            segments: None,
            responses,
        })
    }

    /// The packed layout of `prompts[i] ++ responses[i]`: one row of `tokens` (at least
    /// their total; the rest a padding segment, so that micro-batches of one step share one
    /// shape and one activation arena), `response_cols ≥` every response.
    ///
    /// # Errors
    /// An empty prompt, a response longer than `response_cols`, more tokens than `tokens`
    /// or than the offsets can count.
    pub fn unpadded(
        prompts: &[&[u32]],
        responses: &[&[u32]],
        response_cols: usize,
        tokens: usize,
    ) -> Result<Self, TrainError> {
        let rows = prompts.len();
        if responses.len() != rows {
            return Err(TrainError::Internal(format!(
                "pack: {rows} prompts and {} responses",
                responses.len()
            )));
        }
        let total = packed_tokens(prompts, responses);
        if total > tokens || u32::try_from(tokens).is_err() {
            return Err(TrainError::Internal(format!(
                "pack: {total} tokens in a packed row of {tokens}"
            )));
        }
        let mut p = Self {
            rows,
            prompt_cols: prompts.iter().map(|p| p.len()).max().unwrap_or(0),
            response_cols,
            input_ids: Vec::with_capacity(tokens),
            attention_mask: Vec::with_capacity(tokens),
            position_ids: Vec::with_capacity(tokens),
            targets: Vec::with_capacity(tokens),
            segments: Some(vec![0]),
            responses: Vec::with_capacity(rows),
        };
        for (r, (pr, a)) in prompts.iter().zip(responses).enumerate() {
            if pr.is_empty() || a.len() > response_cols {
                return Err(TrainError::Internal(format!(
                    "pack: row {r} has a prompt of {} tokens and a response of {} (columns \
                     {response_cols})",
                    pr.len(),
                    a.len()
                )));
            }
            let start = p.input_ids.len();
            p.responses.push((start + pr.len() - 1, a.len()));
            let sample: Vec<u32> = pr.iter().chain(a.iter()).copied().collect();
            for (k, &id) in sample.iter().enumerate() {
                p.input_ids.push(id);
                p.attention_mask.push(1);
                p.position_ids.push(k as u32);
                p.targets.push(sample.get(k + 1).copied().unwrap_or(0));
            }
            p.push_offset();
        }
        let pad = tokens - p.input_ids.len();
        for v in [
            &mut p.input_ids,
            &mut p.attention_mask,
            &mut p.position_ids,
            &mut p.targets,
        ] {
            v.resize(tokens, 0);
        }
        if pad > 0 {
            p.push_offset();
        }
        Ok(p)
    }

    /// Closes a segment at the current end of the row (fits in u32: checked by the caller).
    fn push_offset(&mut self) {
        let end = self.input_ids.len() as u32;
        if let Some(cu) = self.segments.as_mut() {
            cu.push(end);
        }
    }

    /// Columns per row: `P + T`, or the packed row's tokens.
    pub fn seq(&self) -> usize {
        match &self.segments {
            Some(_) => self.input_ids.len(),
            None => self.prompt_cols + self.response_cols,
        }
    }

    /// Rows of the model's input: the samples, or 1 when packed.
    pub fn batch(&self) -> usize {
        match &self.segments {
            Some(_) => 1,
            None => self.rows,
        }
    }

    /// The packed layout's offsets (`cu_seqlens`, the tail's segment last); `None` when
    /// padded.
    pub fn segments(&self) -> Option<&[u32]> {
        self.segments.as_deref()
    }

    /// A packed batch's samples as padded rows (`[rows, P + T]`: each prompt right-aligned
    /// to `P`, its response after it, as [`Packed::new`] lays them out) with, for each
    /// packed token, the padded token it is (`None`: the padding segment). A vision-language
    /// model computes its M-RoPE layout on these rows and moves it to the packed tokens
    /// (`MultimodalLayout::packed`). `None` when padded.
    pub fn padded_view(&self) -> Option<PaddedView> {
        let cu = self.segments.as_deref()?;
        let (p, width) = (self.prompt_cols, self.prompt_cols + self.response_cols);
        let mut v = PaddedView {
            rows: self.rows,
            cols: width,
            input_ids: vec![0; self.rows * width],
            attention_mask: vec![0; self.rows * width],
            from: vec![None; self.input_ids.len()],
        };
        for (r, (w, &(last, len))) in cu.windows(2).zip(&self.responses).enumerate() {
            let (start, prompt) = (w[0] as usize, last + 1 - w[0] as usize);
            let first = r * width + p - prompt;
            for k in 0..prompt + len {
                v.input_ids[first + k] = self.input_ids[start + k];
                v.attention_mask[first + k] = 1;
                v.from[start + k] = Some(first + k);
            }
        }
        Some(v)
    }

    /// Where sample `row`'s response is predicted: the flat index of the logits of its
    /// token 0 and its length (padded: `T`, padding included).
    pub fn response_span(&self, row: usize) -> (usize, usize) {
        self.responses.get(row).copied().unwrap_or((0, 0))
    }

    /// The model inputs.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch(),
            seq: self.seq(),
            input_ids: &self.input_ids,
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
        }
    }

    /// Extracts the responses `[rows, T]` of a per-position tensor (e.g. the log-probs of
    /// the targets): response token `j` of a sample is read where it is predicted (padded:
    /// column `P − 1 + j`). Packed, the columns past a response are 0.
    pub fn response_part(&self, per_position: &[f32]) -> Vec<f32> {
        let t = self.response_cols;
        let mut out = vec![0.0f32; self.rows * t];
        for (dst, &(at, len)) in out.chunks_exact_mut(t).zip(&self.responses) {
            if let Some(src) = per_position.get(at..at + len) {
                dst[..len].copy_from_slice(src);
            }
        }
        out
    }

    /// The model position of each `[rows, T]` response entry, `None` past a response: where
    /// [`Packed::response_part`] reads and [`Packed::spread_response`] writes.
    pub fn response_positions(&self) -> Vec<Option<usize>> {
        let t = self.response_cols;
        let mut out = vec![None; self.rows * t];
        for (dst, &(at, len)) in out.chunks_exact_mut(t).zip(&self.responses) {
            for (j, d) in dst.iter_mut().take(len).enumerate() {
                *d = Some(at + j);
            }
        }
        out
    }

    /// Spreads `[rows, T]` response values to the model's positions (0 elsewhere): the
    /// inverse of [`Packed::response_part`], for the loss coefficients.
    pub fn spread_response(&self, response: &[f32]) -> Vec<f32> {
        let t = self.response_cols;
        let mut out = vec![0.0f32; self.input_ids.len()];
        for (src, &(at, len)) in response.chunks_exact(t).zip(&self.responses) {
            if let Some(dst) = out.get_mut(at..at + len) {
                dst.copy_from_slice(&src[..len]);
            }
        }
        out
    }
}

/// A packed batch seen as padded rows ([`Packed::padded_view`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedView {
    /// Samples.
    pub rows: usize,
    /// `P + T`.
    pub cols: usize,
    /// `[rows, cols]` token ids (0 on padding).
    pub input_ids: Vec<u32>,
    /// `[rows, cols]`, 1 on the samples' tokens.
    pub attention_mask: Vec<u32>,
    /// Per packed token, its flat index in the padded rows (`None`: the padding segment).
    pub from: Vec<Option<usize>>,
}

/// How a batch's chunks are laid out for the model: one shape for all of a pass's chunks,
/// so they share one activation arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[rows, P + T]` ([`Packed::new`]): the vision-language model, and backends without
    /// packed attention.
    Padded,
    /// One row of `tokens` ([`Packed::unpadded`]): the longest chunk's prompts and responses.
    Packed {
        /// The packed row's length.
        tokens: usize,
    },
}

/// Tokens of the packed layout of these samples (prompts and responses back to back).
pub fn packed_tokens(prompts: &[&[u32]], responses: &[&[u32]]) -> usize {
    prompts.iter().chain(responses).map(|x| x.len()).sum()
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
    let extras = ForwardExtras {
        segments: packed.segments(),
        ..ForwardExtras::default()
    };
    model.forward_with(&packed.inputs(), &extras, acts)?;
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
    let n = packed.batch() * packed.seq();
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
        assert_eq!(p.response_positions(), [Some(1), Some(2), Some(5), Some(6)]);
        assert_eq!(
            p.spread_response(&[1.0, 2.0, 5.0, 6.0]),
            [0.0, 1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 0.0]
        );
    }

    #[test]
    fn packed_layout_puts_samples_back_to_back() {
        let p = Packed::unpadded(&[&[5, 6], &[7]], &[&[1], &[2, 3]], 2, 8).unwrap();
        assert_eq!((p.batch(), p.seq()), (1, 8));
        assert_eq!(p.input_ids, [5, 6, 1, 7, 2, 3, 0, 0]);
        assert_eq!(p.attention_mask, [1, 1, 1, 1, 1, 1, 0, 0]);
        assert_eq!(p.position_ids, [0, 1, 2, 0, 1, 2, 0, 0]);
        // no target across a sample's end
        assert_eq!(p.targets, [6, 1, 0, 2, 3, 0, 0, 0]);
        assert_eq!(p.segments(), Some(&[0, 3, 6, 8][..]));
        let per_pos: Vec<f32> = (0..8).map(|x| x as f32).collect();
        // sample 0's response token 0 predicted at 1; sample 1's tokens at 3 and 4
        assert_eq!(p.response_part(&per_pos), [1.0, 0.0, 3.0, 4.0]);
        assert_eq!(p.response_positions(), [Some(1), None, Some(3), Some(4)]);
        assert_eq!(
            p.spread_response(&[1.0, 9.0, 5.0, 6.0]),
            [0.0, 1.0, 0.0, 5.0, 6.0, 0.0, 0.0, 0.0]
        );
        // exactly full: no tail segment
        let full = Packed::unpadded(&[&[5, 6], &[7]], &[&[1], &[2, 3]], 2, 6).unwrap();
        assert_eq!(full.segments(), Some(&[0, 3, 6][..]));
        assert!(Packed::unpadded(&[&[5, 6], &[7]], &[&[1], &[2, 3]], 2, 5).is_err());
        assert!(Packed::unpadded(&[&[5, 6]], &[&[1, 2, 3]], 2, 8).is_err());
        assert!(Packed::unpadded(&[&[]], &[&[1]], 2, 8).is_err());
    }

    #[test]
    fn too_long_rows_are_rejected() {
        assert!(Packed::new(&[&[1, 2, 3]], &[&[1]], 2, 2).is_err());
        assert!(Packed::new(&[&[]], &[&[1]], 2, 2).is_err());
    }
}
