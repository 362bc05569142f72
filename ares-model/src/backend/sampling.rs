//! Greedy decoding's pick on the host, shared by generation and the CPU backend's
//! [`Backend::greedy_tokens`](super::Backend::greedy_tokens) (the CUDA kernel `argmax_rows`
//! is its twin). Sampling is the race sampler of `ares_cpu::sampler`, on every backend.

/// The index of the largest logit of `row`, the lowest among equal maxima; `None` when a
/// logit is NaN or +∞ or every logit is −∞ (greedy decoding, host and CPU backend).
pub(crate) fn greedy_row(row: &[f32]) -> Option<u32> {
    ares_cpu::argmax(row).and_then(|i| u32::try_from(i).ok())
}
