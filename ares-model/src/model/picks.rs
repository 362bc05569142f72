//! [`Picks`]: one token per row of a logits tensor, picked on the device (greedy or
//! sampled), with its log-prob and the sampling distribution's entropy brought to the host.

use super::sampling::SampleKey;
use super::{GenerateError, Sampling};
use crate::backend::{Backend, PickBuffers, PickBuffersOf, PickRule, Tensor, picked_row};

/// The buffers of one pick of a token per row of a `[rows, vocab]` logits tensor, on the
/// device and on the host, reused across steps (re-planned when the row count changes).
pub(crate) struct Picks<B: Backend> {
    vocab: usize,
    /// Each row's sampling key.
    keys: Vec<SampleKey>,
    bufs: PickBuffersOf<B>,
    /// What the backend brought to the host: ids, log-probs, entropies, status
    /// ([`PickBuffers::host_len`]).
    host: Vec<u32>,
}

impl<B: Backend> Picks<B> {
    /// Row `r`'s pick: its token (`u32::MAX` for none), log-prob and entropy.
    pub(crate) fn row(&self, r: usize) -> (u32, f32, f32) {
        picked_row(&self.host, self.bufs.rows(), r)
    }

    /// Buffers for `rows` rows of `vocab` logits.
    pub(crate) fn new(be: &B, rows: usize, vocab: usize) -> Result<Self, GenerateError> {
        Ok(Self {
            vocab,
            keys: vec![SampleKey::default(); rows],
            bufs: PickBuffers::new(be, rows)?,
            host: vec![0; PickBuffersOf::<B>::host_len(rows)],
        })
    }

    /// Picks a token for each row of `logits` (greedy, or sampled with `draw(row)`, the key
    /// of the row's next draw from its own stream) with its log-prob and the entropy of the
    /// sampling distribution, on the device, and brings them to the host in one transfer.
    pub(crate) fn pick(
        &mut self,
        be: &B,
        logits: Tensor<'_, B>,
        sampling: Sampling,
        mut draw: impl FnMut(usize) -> SampleKey,
    ) -> Result<(), GenerateError> {
        let rows = logits.len() / self.vocab;
        if rows != self.bufs.rows() {
            *self = Self::new(be, rows, self.vocab)?;
        }
        let sampler = sampling.sampler();
        let rule = match &sampler {
            Some(sampler) => {
                // one key per row from its own stream
                for (r, k) in self.keys.iter_mut().enumerate() {
                    *k = draw(r);
                }
                PickRule::Sample {
                    sampler,
                    keys: &self.keys,
                }
            }
            None => PickRule::Greedy,
        };
        be.pick_tokens(
            logits,
            self.vocab,
            rule,
            sampling.temperature(),
            &mut self.bufs,
            &mut self.host,
        )?;
        Ok(())
    }
}
