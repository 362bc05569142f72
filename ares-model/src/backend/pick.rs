//! What [`Backend::pick_tokens`](super::Backend::pick_tokens) takes: how each row's token is
//! chosen, and the device buffers a pick reuses step after step.

use super::{Backend, Result};
use ares_cpu::sampler::{SampleKey, Sampler};

/// How [`Backend::pick_tokens`](super::Backend::pick_tokens) chooses each row's token.
#[derive(Debug, Clone, Copy)]
pub enum PickRule<'a> {
    /// The largest logit, the lowest index among equal maxima.
    Greedy,
    /// The race sampler of `ares_cpu::sampler` with row `r`'s random numbers from
    /// `keys[r]`: the same token on every backend.
    Sample {
        /// Temperature and filters.
        sampler: &'a Sampler,
        /// One key per row.
        keys: &'a [SampleKey],
    },
}

/// The device buffers of a pick of one token per row, for a fixed number of rows:
/// allocated once and reused every step, so a decode step allocates nothing here. Generic
/// over a backend's id and f32 buffer types ([`PickBuffersOf`] names them for a backend).
pub struct PickBuffers<Ids, Buf> {
    /// The picked ids, `[rows]`: left on the device, where the next step's input needs them.
    pub targets: Ids,
    /// The sampling keys' words, `[rows · SampleKey::WORDS]` (uploaded each sampled step).
    pub keys: Ids,
    /// Log-prob of each pick, `[rows]`.
    pub log_prob: Buf,
    /// Entropy of each row's distribution, `[rows]`.
    pub entropy: Buf,
    /// What crosses to the host: [`PickBuffers::host_len`] words.
    pub packed: Ids,
    rows: usize,
}

/// The [`PickBuffers`] of backend `B`.
pub type PickBuffersOf<B> = PickBuffers<<B as Backend>::Ids, <B as Backend>::Buffer>;

impl<Ids, Buf> PickBuffers<Ids, Buf> {
    /// Buffers for `rows` rows.
    ///
    /// # Errors
    /// The device is out of memory.
    pub fn new<B: Backend<Ids = Ids, Buffer = Buf> + ?Sized>(be: &B, rows: usize) -> Result<Self> {
        Ok(Self {
            targets: be.alloc_ids(rows)?,
            keys: be.alloc_ids(rows * SampleKey::WORDS)?,
            log_prob: be.alloc(rows)?,
            entropy: be.alloc(rows)?,
            packed: be.alloc_ids(Self::host_len(rows))?,
            rows,
        })
    }

    /// The number of rows these buffers are for.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The words a pick of `rows` rows brings to the host: `rows` ids, `rows` log-prob
    /// bits, `rows` entropy bits, and one status word (a backend's device-side error flags,
    /// fetched in the same transfer; 0 when all went well).
    pub fn host_len(rows: usize) -> usize {
        3 * rows + 1
    }
}

/// Row `r` of a pick's host words (see [`PickBuffers::host_len`]): its token (`u32::MAX`
/// for a row without one), log-prob and entropy.
pub fn picked_row(host: &[u32], rows: usize, r: usize) -> (u32, f32, f32) {
    let word = |i: usize| host.get(i).copied().unwrap_or(0);
    (
        word(r),
        f32::from_bits(word(rows + r)),
        f32::from_bits(word(2 * rows + r)),
    )
}
