//! [`Sampling`]: how the next token is picked from a row of logits, with portable seeded
//! randomness.
//!
//! Randomness: one ChaCha20 stream per sequence, keyed by the request's seed (its 8
//! little-endian bytes, then zeros) with the sequence's index in the batch as the stream
//! number, so a sequence draws the same numbers whatever else is in the batch. ChaCha's
//! output is fully specified, and the conversion to a token is ours (53 random bits to a
//! uniform in `[0, 1)`, then a walk of the cumulative weights in a fixed order), so results
//! do not change with platforms or `rand` versions.

use rand_chacha::ChaCha20Rng;

use crate::backend::cpu::greedy_row;
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
fn uniform(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The sort key of logit `x` (not NaN) at index `i` (< 2³²): ascending keys are
/// descending logits, lower index first among equal logits (−0 and +0 are equal).
fn descending_key(x: f32, i: usize) -> u64 {
    let x = if x == 0.0 { 0.0 } else { x };
    let bits = x.to_bits();
    // flips the float order into the unsigned order of the bits
    let ascending = if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | i as u64
}

/// Sorts keys made by [`descending_key`] in index order: a stable LSD radix sort of the
/// logit half, 8 bits a pass (a full comparison sort of a 152 k vocabulary was 15 ms per
/// token; this is ~1 ms). Short rows use the standard sort.
fn radix_sort_by_logit(keys: &mut Vec<u64>) {
    if keys.len() < 2048 {
        keys.sort_unstable();
        return;
    }
    let mut spare = vec![0u64; keys.len()];
    for shift in [32, 40, 48, 56] {
        let digit = |k: u64| ((k >> shift) & 0xFF) as usize;
        let mut start = [0usize; 256];
        for &k in keys.iter() {
            start[digit(k)] += 1;
        }
        if start.contains(&keys.len()) {
            continue; // one digit value: this pass would not move anything
        }
        let mut sum = 0;
        for c in start.iter_mut() {
            (*c, sum) = (sum, sum + *c);
        }
        for &k in keys.iter() {
            let slot = &mut start[digit(k)];
            spare[*slot] = k;
            *slot += 1;
        }
        std::mem::swap(keys, &mut spare);
    }
}

/// The candidates of a sampled token: ids of logits above −∞ by decreasing logit, lower
/// id first among equal logits, only the `top_k` first when given. With a top-k only the
/// k first are selected and sorted.
fn candidate_order(logits: &[f32], top_k: Option<usize>) -> Vec<usize> {
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .filter(|(_, x)| **x > f32::NEG_INFINITY)
        .map(|(i, &x)| descending_key(x, i))
        .collect();
    match top_k {
        Some(k) if k < keys.len() => {
            keys.select_nth_unstable(k.saturating_sub(1));
            keys.truncate(k);
            keys.sort_unstable();
        }
        _ => radix_sort_by_logit(&mut keys),
    }
    keys.iter().map(|k| (k & 0xFFFF_FFFF) as usize).collect()
}

/// Picks a token from one row of logits. `None` if no token can be picked: a NaN or +∞
/// logit, or every logit −∞. Greedy draws no random number.
pub(crate) fn pick(logits: &[f32], sampling: &Sampling, rng: &mut ChaCha20Rng) -> Option<u32> {
    if logits.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return None;
    }
    match *sampling {
        Sampling::Greedy => greedy_row(logits),
        Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } => {
            let t = f64::from(temperature);
            let order = candidate_order(logits, top_k);
            let max = f64::from(*logits.get(*order.first()?)?);
            let weights: Vec<f64> = order
                .iter()
                .map(|&i| {
                    logits
                        .get(i)
                        .map_or(0.0, |&x| ((f64::from(x) - max) / t).exp())
                })
                .collect();
            let total: f64 = weights.iter().sum();
            // Nucleus: the shortest prefix holding at least top_p of the mass.
            let mut kept = weights.len();
            let mut cum = 0.0;
            for (j, w) in weights.iter().enumerate() {
                cum += w;
                if cum >= f64::from(top_p) * total {
                    kept = j + 1;
                    break;
                }
            }
            let weights = weights.get(..kept)?;
            let target = uniform(rng) * weights.iter().sum::<f64>();
            let mut cum = 0.0;
            let mut chosen = *order.get(kept - 1)?;
            for (&i, w) in order.iter().zip(weights) {
                cum += w;
                if cum > target {
                    chosen = i;
                    break;
                }
            }
            u32::try_from(chosen).ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The candidate order by comparison sort (the first implementation): decreasing
    /// logit, lower id first on ties, −∞ left out, truncated to `top_k`.
    fn reference_order(logits: &[f32], top_k: Option<usize>) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .collect();
        order.sort_by(|&a, &b| {
            logits[b]
                .partial_cmp(&logits[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        if let Some(k) = top_k {
            order.truncate(k);
        }
        order
    }

    #[test]
    fn key_order_is_descending_logit_then_ascending_id() {
        let xs = [
            f32::MAX,
            3.5,
            1.0,
            f32::MIN_POSITIVE,
            0.0,
            -0.0,
            -f32::MIN_POSITIVE,
            -1.0,
            f32::MIN,
        ];
        for w in xs.windows(2) {
            let (a, b) = (descending_key(w[0], 7), descending_key(w[1], 3));
            if w[0] == w[1] {
                assert!(a > b, "{w:?}: equal logits, lower id first");
            } else {
                assert!(a < b, "{w:?}");
            }
        }
    }

    #[test]
    fn fast_order_equals_the_comparison_sort() {
        let mut rng = sequence_rng(5, 0);
        for trial in 0..400 {
            // long rows take the radix path, short ones the standard sort
            let vocab = [1usize, 2, 17, 2047, 2048, 5000, 151_936][trial % 7];
            let row: Vec<f32> = (0..vocab)
                .map(|_| match rng.next_u64() % 12 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::NEG_INFINITY,
                    3 => 1.5, // ties
                    4 => -1e30,
                    _ => (uniform(&mut rng) as f32 - 0.5) * 16.0,
                })
                .collect();
            for top_k in [None, Some(1), Some(3), Some(vocab), Some(vocab + 4)] {
                assert_eq!(
                    candidate_order(&row, top_k),
                    reference_order(&row, top_k),
                    "trial {trial}, V {vocab}, top_k {top_k:?}"
                );
            }
        }
    }
}
