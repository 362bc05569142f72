//! [`Sampling`]: how the next token is picked from a row of logits, with portable seeded
//! randomness.
//!
//! Randomness: each sampled token of sequence `i` of a request with `seed` is drawn with the
//! key `(seed, i, step)` — `step` the sequence's draws so far — by the race sampler
//! (`ares_cpu::sampler`: Philox4x32-10 words per token, the Gumbel-max race, exact filter
//! cuts), on the host and bit for bit on a GPU. A sequence's tokens depend on its key only,
//! never on what else is in the batch, on the platform or on a library version.

pub use ares_cpu::sampler::SampleKey;
use ares_cpu::sampler::Sampler;

/// How to pick each new token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id on ties); log-probs and entropies are those of
    /// `softmax(logits)` (temperature 1).
    Greedy,
    /// A random draw from `softmax(logits / temperature)`, restricted to the `top_k` most
    /// likely tokens (if set), then to the smallest most-likely set of probability mass
    /// `>= top_p`, then to the tokens at least `min_p` times as likely as the most likely,
    /// renormalised (transformers' order: temperature, top-k, top-p, min-p).
    Sample {
        /// Divides the logits; finite and > 0.
        temperature: f32,
        /// Keep only the `k` most likely tokens (`k >= 1`); `None`: no limit.
        top_k: Option<usize>,
        /// Nucleus mass in `(0, 1]`; `1.0` keeps every token.
        top_p: f32,
        /// Relative probability floor in `[0, 1]`; `0.0` keeps every token.
        min_p: f32,
    },
}

impl Sampling {
    /// The temperature of the sampling distribution (1 for greedy).
    pub fn temperature(&self) -> f32 {
        match *self {
            Sampling::Greedy => 1.0,
            Sampling::Sample { temperature, .. } => temperature,
        }
    }

    /// Checks the parameters; returns what is wrong (the ranges are the race sampler's own
    /// check; `top_k: Some(0)` is this type's, 0 meaning "off" there).
    pub(crate) fn check(&self) -> Result<(), String> {
        if let Sampling::Sample { top_k: Some(0), .. } = *self {
            return Err("top_k 0 keeps no token (use None for no limit)".into());
        }
        self.sampler()
            .map_or(Ok(()), |s| s.check())
            .map_err(|e| e.to_string())
    }

    /// Plain sampling at `temperature`: no top-k, top-p or min-p.
    pub fn with_temperature(temperature: f32) -> Self {
        Sampling::Sample {
            temperature,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    /// The race sampler's parameters; `None` for greedy.
    pub(crate) fn sampler(&self) -> Option<Sampler> {
        match *self {
            Sampling::Greedy => None,
            Sampling::Sample {
                temperature,
                top_k,
                top_p,
                min_p,
            } => Some(Sampler {
                temperature,
                // a limit beyond any vocabulary (< 2³² ids) keeps every token
                top_k: top_k.map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
                top_p,
                min_p,
            }),
        }
    }
}

/// The first key of sequence `index` of a request with `seed`.
pub(crate) fn sequence_key(seed: u64, index: u64) -> SampleKey {
    SampleKey {
        seed,
        sequence: index,
        step: 0,
    }
}
