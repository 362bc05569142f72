//! The race sampler: a token drawn from `softmax(logits / T)`, optionally restricted by
//! top-k, top-p and min-p, from counter-based random numbers, as the exponential race
//! (Gumbel-max) — the arithmetic of the CUDA kernel `sample_race` (`ares-cuda`), bit for
//! bit, so a GPU and a CPU pick the same tokens from the same logits.
//!
//! **Randomness.** Token `i` of a row keyed by `(seed, sequence, step)` gets 32 random bits:
//! word `i mod 4` of Philox4x32-10 (Salmon et al., SC'11; Random123's known-answer vectors
//! are among the tests) with key `(seed lo, seed hi)` and counter `(⌊i/4⌋, step, sequence
//! lo, sequence hi)`. A sequence's draws depend only on its key, never on its batch or on
//! the order the work is done in.
//!
//! **The race.** With `z_i = x_i · (1/T)` and `g_i = −ln E_i`, `E_i = −ln(1 − V_i)` an
//! exponential draw (`V_i` from the bits, in `[2⁻³³, 1 − 2⁻²⁴]`), the token is
//! `argmax_i z_i + g_i` over the candidates, the lowest index among equal scores: `g_i` is
//! Gumbel, so this is a draw from the candidates' softmax (Gumbel-max). One read of the
//! row suffices without filters; no sum over the vocabulary, so no rounding order to
//! agree on. `ln` and `log1p` are written here from correctly rounded `+ − × ÷` only (no
//! fused multiply-add: the CUDA twin spells each as an `__f*_rn` intrinsic), so both sides
//! compute the same bits. `g ∈ [−2.82, 22.88]`, so a token with `z_i + 23 < z_max − 3` can
//! never win; the host also passes over a token whose score, bounded through the top byte
//! of its random bits, cannot reach the best so far — without its logarithms (the result is
//! the same; the GPU draws every token).
//!
//! **Filters** (transformers' order: top-k, then top-p over the top-k, then min-p). The
//! candidates are a prefix of the row in key order (descending logit, ascending id; −0 =
//! +0), cut where a count or a mass reaches a threshold. Masses are fixed-point integers —
//! `W_i = ⌊w_i · 2³²⌋` with `w_i = 2^((x_i − m)·(1/T)·log₂e)` (`m` the row max; the
//! polynomial `exp2` of the log-prob kernels, without FMA) — so sums are exact in any
//! order and the cut is the same whatever algorithm finds it: a radix select over the
//! 64-bit key, 8 bits a pass, here as on the GPU.
//! - top-k (`k ≥ 1`; 0 = off): the `k` first keys;
//! - top-p (`(0, 1]`): the shortest prefix of the top-k whose mass reaches
//!   `P = ⌈top_p · total⌉` (f64 product, `total` the top-k's mass);
//! - min-p (`[0, 1]`; 0 = off): tokens with `w_i ≥ min_p` (probability at least `min_p`
//!   times the most likely token's).
//!
//! The most likely token is always a candidate. Tokens with `W_i = 0` (`w_i < 2⁻³²`) weigh
//! nothing in top-p's mass (at most `V · 2⁻³²` of it).
//!
//! Edge cases: a row with NaN or +∞ anywhere, or −∞ everywhere, has no token (`None`); −∞
//! logits are never picked.

use crate::exp::exp_nonpositive;
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// The key of one row's draws: the request's seed, the sequence's index in the request and
/// how many tokens the sequence has drawn before this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SampleKey {
    /// The request's seed.
    pub seed: u64,
    /// The sequence's index in its request.
    pub sequence: u64,
    /// The sequence's draws so far.
    pub step: u32,
}

impl SampleKey {
    /// The number of words of [`SampleKey::words`].
    pub const WORDS: usize = 5;

    /// The five words a device kernel reads: seed lo, seed hi, sequence lo, sequence hi,
    /// step.
    pub fn words(&self) -> [u32; Self::WORDS] {
        [
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.sequence as u32,
            (self.sequence >> 32) as u32,
            self.step,
        ]
    }

    /// This key, then the next step's: a sequence's stream of draws.
    pub fn advance(&mut self) -> Self {
        let now = *self;
        self.step = self.step.wrapping_add(1);
        now
    }
}

/// What a sampled token is drawn from: `softmax(logits / temperature)`, restricted by the
/// filters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// Divides the logits; finite and > 0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the shortest most-likely prefix holding this much of the mass, in `(0, 1]`;
    /// 1 keeps all.
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely, in `[0, 1]`; 0
    /// keeps all.
    pub min_p: f32,
}

impl Sampler {
    /// Plain sampling at `temperature`: no filter.
    pub fn with_temperature(temperature: f32) -> Self {
        Self {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    /// Errors naming the first parameter out of range.
    pub fn check(&self) -> Result<(), CoreError> {
        let bad = |what, value: f32, expected| {
            Err(CoreError::OutOfRange {
                what,
                value: f64::from(value),
                expected,
            })
        };
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return bad("temperature", self.temperature, "finite and > 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        Ok(())
    }

    /// Whether a filter restricts the candidates (top-k, top-p or min-p).
    fn filters(&self) -> bool {
        self.top_k != 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

// ----- Counter-based random numbers -----

/// Philox4x32's multipliers and Weyl key increments.
const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32-10: four 32-bit words from a 128-bit counter and a 64-bit key.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [
                k[0].wrapping_add(PHILOX_W[0]),
                k[1].wrapping_add(PHILOX_W[1]),
            ];
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The four tokens `4q … 4q + 3` of a row keyed by `key` get the four words of this block.
pub fn random_bits(key: SampleKey, quad: u32) -> [u32; 4] {
    philox4x32_10(
        [
            quad,
            key.step,
            key.sequence as u32,
            (key.sequence >> 32) as u32,
        ],
        [key.seed as u32, (key.seed >> 32) as u32],
    )
}

/// `1 − 2⁻²⁴`, the largest f32 below 1.
const BELOW_ONE: f32 = 1.0 - 1.0 / 16_777_216.0;
/// `2⁻³²` and `2⁻³³`.
const TWO_M32: f32 = 1.0 / 4_294_967_296.0;
const TWO_M33: f32 = 1.0 / 8_589_934_592.0;

/// The Gumbel draw of 32 random bits: `V = min(b·2⁻³² + 2⁻³³, 1 − 2⁻²⁴)`, `E = −log1p(−V)`,
/// `g = −ln E` — fine-grained near `V = 0`, where `E` is small and `g` large (the draws that
/// let an unlikely token win).
pub fn gumbel(bits: u32) -> f32 {
    let v = (bits as f32 * TWO_M32 + TWO_M33).min(BELOW_ONE);
    let e = -log1p(-v);
    -ln(e)
}

/// Bounds of [`gumbel`] over every input (checked by a test): `g ∈ [GUMBEL_MIN, GUMBEL_MAX]`.
const GUMBEL_MIN: f32 = -3.0;
const GUMBEL_MAX: f32 = 23.0;

/// Per top byte of the random bits, a bound on [`gumbel`] of any bits with that byte: its
/// value at the byte's smallest bits (`g` falls as the bits grow) plus a margin for the
/// last-ulp wobble of the polynomial `ln`. Lets the host pass over a token whose best score
/// cannot reach the best so far without taking two logarithms (the GPU draws every token;
/// the winner is the same).
fn gumbel_bounds() -> &'static [f32; 256] {
    static BOUNDS: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    BOUNDS.get_or_init(|| core::array::from_fn(|k| gumbel((k as u32) << 24) + 1e-3))
}

/// `ln 2` split so that `e · LN2_HI` is exact for |e| < 2⁹.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `ln x` for a positive normal `x` (callers pass `[2⁻³³, 17]`), from `+ − × ÷` alone:
/// `x = 2^e · m` with `m ∈ [√½, √2)`, `s = (m − 1)/(m + 1)`, `ln m = 2s + s·R(s²)` with
/// `R` the atanh series `2s²/3 + 2s⁴/5 + 2s⁶/7 + 2s⁸/9 + 2s¹⁰/11` (|s| ≤ 0.172, so the
/// truncation is below 2⁻²⁸). Within 2 ulp of `ln` (tested).
pub fn ln(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xFF) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007F_FFFF) | 0x3F80_0000);
    if m > core::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let s2 = s * s;
    let r = s2 * (2.0 / 3.0 + s2 * (0.4 + s2 * (2.0 / 7.0 + s2 * (2.0 / 9.0 + s2 * (2.0 / 11.0)))));
    let ef = e as f32;
    ef * LN2_HI + ((s + s) + (s * r + ef * LN2_LO))
}

/// `ln(1 + y)` for `y ∈ [−1 + 2⁻²⁴, 0]`: below −½, `1 + y` is exact (Sterbenz) and [`ln`]
/// takes it; above, `u = 1 + y` rounds and `ln u · y/(u − 1)` corrects it (`u − 1` exact).
pub fn log1p(y: f32) -> f32 {
    if y < -0.5 {
        return ln(1.0 + y);
    }
    let u = 1.0 + y;
    if u == 1.0 { y } else { ln(u) * (y / (u - 1.0)) }
}

// ----- The filters' cut -----

/// The sort key of logit `x` (not NaN) at index `i` (< 2³²): ascending keys are
/// descending logits, lower index first among equal logits (−0 and +0 are equal).
pub fn descending_key(x: f32, i: u32) -> u64 {
    let x = if x == 0.0 { 0.0 } else { x };
    let bits = x.to_bits();
    // flips the float order into the unsigned order of the bits
    let ascending = if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | u64::from(i)
}

/// The smallest key `K` with `Σ_{key ≤ K} weight ≥ need` over the items `each` visits
/// (`(key, weight)` pairs), or `None` when the whole sum falls short. A radix select, 8
/// bits of the key a pass from the top, as the CUDA kernel does it: each pass sums the
/// weights of the keys under the prefix fixed so far by their next byte, then fixes the
/// byte where the running sum reaches `need`. Integer sums: any visiting order gives the
/// same key. `need` ≥ 1 (with 0 every key qualifies and the answer is 0).
pub fn radix_select(each: impl Fn(&mut dyn FnMut(u64, u64)), need: u64) -> Option<u64> {
    let (mut prefix, mut before) = (0u64, 0u64);
    for pass in 0..8u32 {
        let shift = 56 - 8 * pass;
        let mut sums = [0u64; 256];
        each(&mut |key, weight| {
            // the bits above this byte equal the prefix (none on the first pass)
            if pass == 0 || (key ^ prefix) >> (shift + 8) == 0 {
                sums[((key >> shift) & 0xFF) as usize] += weight;
            }
        });
        let mut byte = None;
        for (b, &w) in sums.iter().enumerate() {
            if before + w >= need {
                byte = Some(b as u64);
                break;
            }
            before += w;
        }
        prefix |= byte? << shift;
    }
    Some(prefix)
}

/// The fixed-point weight `⌊w · 2³²⌋` of `w ∈ [0, 1]` (exact scaling, truncation).
fn fixed_weight(w: f32) -> u64 {
    (w * 4_294_967_296.0) as u64
}

/// The relative weight `w = e^{(x − m)/T}` of logit `x` in a row of maximum `m`, as the
/// filters compute it (no FMA, so it is the same bits on the GPU).
pub fn relative_weight(x: f32, max: f32, inv_t: f32) -> f32 {
    exp_nonpositive::<false>((x - max) * inv_t)
}

/// The last key kept by top-k and top-p (`u64::MAX` when they keep everything), for a row
/// of maximum `max` holding no NaN or +∞.
fn filter_cut(row: &[f32], max: f32, inv_t: f32, sampler: &Sampler) -> u64 {
    let keys = |f: &mut dyn FnMut(u64, u64)| {
        for (i, &x) in row.iter().enumerate() {
            if x > f32::NEG_INFINITY {
                f(descending_key(x, i as u32), 1);
            }
        }
    };
    let mut cut = u64::MAX;
    if sampler.top_k != 0 {
        cut = radix_select(keys, u64::from(sampler.top_k)).unwrap_or(u64::MAX);
    }
    if sampler.top_p < 1.0 {
        // only tokens of some weight take part: W = 0 changes no sum
        let weighted: Vec<(u64, u64)> = row
            .iter()
            .enumerate()
            .filter(|&(_, &x)| x > f32::NEG_INFINITY)
            .map(|(i, &x)| {
                let w = fixed_weight(relative_weight(x, max, inv_t));
                (descending_key(x, i as u32), w)
            })
            .filter(|&(k, w)| w > 0 && k <= cut)
            .collect();
        let total: u64 = weighted.iter().map(|&(_, w)| w).sum();
        let need = (f64::from(sampler.top_p) * total as f64).ceil() as u64;
        let each = |f: &mut dyn FnMut(u64, u64)| {
            for &(k, w) in &weighted {
                f(k, w);
            }
        };
        cut = cut.min(radix_select(each, need).unwrap_or(u64::MAX));
    }
    cut
}

// ----- The race -----

/// The token `sampler` draws from `row` with the draws of `key`, or `None` for a row with
/// NaN or +∞ anywhere, or −∞ everywhere. See the module docs for the exact arithmetic.
pub fn sample_row(row: &[f32], sampler: &Sampler, key: SampleKey) -> Option<u32> {
    let max = crate::argmax(row).map(|i| row[i])?;
    let inv_t = 1.0 / sampler.temperature;
    let cut = if sampler.top_k != 0 || sampler.top_p < 1.0 {
        filter_cut(row, max, inv_t, sampler)
    } else {
        u64::MAX
    };
    // the most likely token scores at least this, and the winner at least the best score so
    // far: a token whose best possible score is below `bar` cannot win
    let mut bar = max * inv_t + GUMBEL_MIN;
    let bounds = gumbel_bounds();
    let (mut best, mut best_i) = (f32::NEG_INFINITY, None);
    let mut quad = (u32::MAX, [0u32; 4]);
    let filters = sampler.filters();
    for (i, &x) in row.iter().enumerate() {
        let z = x * inv_t;
        if !(x > f32::NEG_INFINITY && z + GUMBEL_MAX >= bar) {
            continue;
        }
        let i = i as u32;
        if filters {
            if cut != u64::MAX && descending_key(x, i) > cut {
                continue;
            }
            if sampler.min_p > 0.0 && relative_weight(x, max, inv_t) < sampler.min_p {
                continue;
            }
        }
        if quad.0 != i / 4 {
            quad = (i / 4, random_bits(key, i / 4));
        }
        let bits = quad.1[(i % 4) as usize];
        if z + bounds[(bits >> 24) as usize] < bar {
            continue;
        }
        let s = z + gumbel(bits);
        if s > best || best_i.is_none() {
            (best, best_i) = (s, Some(i));
            bar = bar.max(s);
        }
    }
    best_i
}

/// For every row of `logits` (`[rows, vocab]`, rows = `out.len()`), the token `sampler`
/// draws with `keys[row]` ([`sample_row`]), `u32::MAX` for a row without one. Rows run in
/// parallel.
///
/// Errors: `vocab` 0 or ≥ 2³², lengths that do not match, a parameter out of range.
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    sampler: &Sampler,
    keys: &[SampleKey],
    out: &mut [u32],
) -> crate::Result<()> {
    if vocab == 0 || vocab >= u32::MAX as usize {
        return Err(CoreError::OutOfRange {
            what: "vocab",
            value: vocab as f64,
            expected: "in 1..2^32-1",
        }
        .into());
    }
    sampler.check()?;
    crate::error::check_len("keys", out.len(), keys.len())?;
    crate::error::check_len("logits", out.len().saturating_mul(vocab), logits.len())?;
    // rows in parallel, in tasks of at least 64 Ki logits (a small vocabulary's rows are
    // too short to be a task each)
    out.par_iter_mut()
        .zip(logits.par_chunks(vocab))
        .zip(keys)
        .with_min_len((1 << 16) / vocab)
        .for_each(|((o, row), &key)| *o = sample_row(row, sampler, key).unwrap_or(u32::MAX));
    Ok(())
}

#[cfg(test)]
mod tests;
