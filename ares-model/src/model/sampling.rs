//! [`Sampling`]: how the next token is picked from a row of logits, with portable seeded
//! randomness.
//!
//! Randomness: one ChaCha20 stream per sequence, keyed by the request's seed (its 8
//! little-endian bytes, then zeros) with the sequence's index in the batch as the stream
//! number, so a sequence draws the same numbers whatever else is in the batch. ChaCha's
//! output is fully specified, and the conversion to a token is ours (53 random bits to a
//! uniform in `[0, 1)`, then a walk of the cumulative weights in a fixed order, done by the
//! backend: `backend::sampling` on the host, the `sample_rows` kernel on a GPU), so results
//! do not change with platforms or `rand` versions.

use rand_chacha::ChaCha20Rng;

use rand_chacha::rand_core::{Rng, SeedableRng};

/// How to pick each new token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id on ties); log-probs and entropies are those of
    /// `softmax(logits)` (temperature 1).
    Greedy,
    /// A random draw from `softmax(logits / temperature)`, restricted to the `top_k` most
    /// likely tokens (if set) and then to the smallest most-likely set of probability mass
    /// `>= top_p`, renormalised (transformers' order: temperature, top-k, top-p).
    Sample {
        /// Divides the logits; finite and > 0.
        temperature: f32,
        /// Keep only the `k` most likely tokens (`k >= 1`); `None`: no limit.
        top_k: Option<usize>,
        /// Nucleus mass in `(0, 1]`; `1.0` keeps every token.
        top_p: f32,
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

    /// Checks the parameters; returns what is wrong.
    pub(crate) fn check(&self) -> Result<(), String> {
        if let Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } = *self
        {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(format!("temperature {temperature} is not finite and > 0"));
            }
            if top_k == Some(0) {
                return Err("top_k 0 keeps no token (use None for no limit)".into());
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(format!("top_p {top_p} is not in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// The random stream of sequence `index` of a request with `seed`.
pub(crate) fn sequence_rng(seed: u64, index: u64) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = ChaCha20Rng::from_seed(key);
    rng.set_stream(index);
    rng
}

/// A uniform draw in `[0, 1)` from the top 53 bits of one 64-bit output.
pub(crate) fn uniform(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
