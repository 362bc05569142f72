//! [`Picks`]: one token per row of a logits tensor, picked on the device (greedy or
//! sampled), with its log-prob and the sampling distribution's entropy brought to the host.

use super::sampling::SampleKey;
use super::{GenerateError, Sampling};
use crate::backend::{Backend, Tensor, View, ViewMut};

/// The buffers of one pick of a token per row of a `[rows, vocab]` logits tensor, on the
/// device and on the host, reused across steps (re-planned when the row count changes).
pub(crate) struct Picks<B: Backend> {
    vocab: usize,
    /// Each row's sampling key.
    keys: Vec<SampleKey>,
    /// The backend's pick of each row, `u32::MAX` for a row without a token.
    picked: Vec<u32>,
    targets: B::Ids,
    log_prob: B::Buffer,
    entropy: B::Buffer,
    /// Log-prob of each row's pick under the sampling distribution.
    host_lp: Vec<f32>,
    /// Entropy of each row's sampling distribution.
    host_ent: Vec<f32>,
}

impl<B: Backend> Picks<B> {
    /// Row `r`'s pick: its token (`u32::MAX` for none), log-prob and entropy.
    pub(crate) fn row(&self, r: usize) -> (u32, f32, f32) {
        (self.picked[r], self.host_lp[r], self.host_ent[r])
    }

    /// Buffers for `rows` rows of `vocab` logits.
    pub(crate) fn new(be: &B, rows: usize, vocab: usize) -> Result<Self, GenerateError> {
        Ok(Self {
            vocab,
            keys: vec![SampleKey::default(); rows],
            picked: vec![0; rows],
            targets: be.alloc_ids(rows)?,
            log_prob: be.alloc(rows)?,
            entropy: be.alloc(rows)?,
            host_lp: vec![0.0; rows],
            host_ent: vec![0.0; rows],
        })
    }

    /// Picks a token for each row of `logits` (greedy on the device, or sampled with
    /// `draw(row)`, the key of the row's next draw from its own stream), then computes its
    /// log-prob and
    /// the entropy of the sampling distribution on the device: `picked`, `host_lp` and
    /// `host_ent` hold them, one per row.
    pub(crate) fn pick(
        &mut self,
        be: &B,
        logits: Tensor<'_, B>,
        sampling: Sampling,
        mut draw: impl FnMut(usize) -> SampleKey,
    ) -> Result<(), GenerateError> {
        let rows = logits.len() / self.vocab;
        if rows != self.picked.len() {
            *self = Self::new(be, rows, self.vocab)?;
        }
        if let Some(sampler) = sampling.sampler() {
            // one key per row from its own stream; the backend runs the race (the CUDA
            // backend on the device)
            for (r, k) in self.keys.iter_mut().enumerate() {
                *k = draw(r);
            }
            be.sample_tokens(
                logits,
                self.vocab,
                &sampler,
                &self.keys,
                &mut self.targets,
                &mut self.picked,
            )?;
        } else {
            // on the device: only the picked ids cross to the host, and they are already
            // where the log-prob below needs them
            be.greedy_tokens(logits, self.vocab, &mut self.targets, &mut self.picked)?;
        }
        be.log_prob_entropy(
            logits,
            self.vocab,
            sampling.temperature(),
            &self.targets,
            ViewMut::whole(&mut self.log_prob),
            ViewMut::whole(&mut self.entropy),
        )?;
        be.download(View::whole(&self.log_prob), &mut self.host_lp)?;
        be.download(View::whole(&self.entropy), &mut self.host_ent)?;
        Ok(())
    }
}
