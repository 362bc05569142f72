//! Fused log-prob + entropy over logits, from one read of the logits.
//!
//! For a row of logits `x` and temperature `T`, with `z = x / T`:
//!
//! - `lse = log Σ_v e^{z_v}`
//! - `log_prob = z_target − lse`
//! - `H = lse − Σ_v softmax(z)_v · z_v = ln S − U / S`, where, relative to the running max
//!   `m`, `S = Σ e^{z−m}` and `U = Σ e^{z−m}·(z − m)`.
//!
//! One pass with an online max: the row is read in blocks of [`BLOCK`] elements (converted
//! to f32 in a stack buffer, so bf16/f16 cost no extra memory traffic); when a block raises
//! the max from `m` to `m'`, the running sums are rescaled with `c = e^{m−m'}`:
//! `S ← c·S`, `U ← c·(U + (m − m')·S)`. Each element costs one `exp`. Per-lane sums of a
//! block are f32; they are added into f64 lane totals once per block, which keeps the
//! result accurate for V in the hundreds of thousands.
//!
//! Edge cases: −∞ logits are allowed (probability 0, no contribution); NaN or +∞ anywhere
//! in a row, or a row that is −∞ everywhere, is an error naming the row; V = 1 gives
//! `H = 0`, `log_prob = 0`.

use crate::error::check_len;
use crate::error::{Error, Result};
use crate::exp::{EXP2_UNDERFLOW, exp2_nonpositive, madd};
use crate::isa::Isa;
use crate::logits::{Logit, Logits};
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Accumulator slots: the inner loops update slot i from element i of each LANES-long
/// chunk, an element-wise loop the loop vectoriser turns into SIMD code at any width (a
/// 16-slot version is fully unrolled instead and left scalar).
const LANES: usize = 64;
/// Elements per block: the unit of online-max rescaling and of f32 → f64 accumulation.
pub(crate) const BLOCK: usize = 1024;

/// Log-prob of the target (when one was asked for) and entropy of one row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogProbEntropy {
    /// `log softmax(z)[target]`, or `None` without a target.
    pub log_prob: Option<f32>,
    /// `H(softmax(z))` in nats.
    pub entropy: f32,
}

impl LogProbEntropy {
    /// Computes one row (`temperature` finite and > 0; `target < row.len()`).
    pub fn of_row<L: Logit>(row: &[L], temperature: f32, target: Option<u32>) -> Result<Self> {
        let inv_t = inverse_temperature(temperature)?;
        if row.is_empty() {
            return Err(CoreError::Empty { what: "logits row" }.into());
        }
        row_result(row, inv_t, target, 0)
    }
}

/// For every row of `logits` (`[rows, vocab]`, rows = `out_entropy.len()`), writes the
/// entropy of `softmax(logits / temperature)` to `out_entropy` and, when `targets` is
/// given as `(ids, out_log_prob)`, the log-prob of `ids[row]` to `out_log_prob[row]`.
/// Rows run in parallel (rayon); extra memory is O(1) per thread.
///
/// Errors: `vocab == 0`, lengths that do not match, temperature not finite and > 0, a row
/// with NaN/+∞ or only −∞, a target id ≥ vocab or whose logit is −∞.
pub fn log_prob_entropy(
    logits: Logits<'_>,
    vocab: usize,
    temperature: f32,
    targets: Option<(&[u32], &mut [f32])>,
    out_entropy: &mut [f32],
) -> Result<()> {
    if vocab == 0 {
        return Err(CoreError::OutOfRange {
            what: "vocab",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    let inv_t = inverse_temperature(temperature)?;
    let rows = out_entropy.len();
    let expected = rows.checked_mul(vocab).ok_or(CoreError::OutOfRange {
        what: "rows × vocab",
        value: rows as f64 * vocab as f64,
        expected: "to fit in usize",
    })?;
    check_len("logits", expected, logits.len())?;
    if let Some((ids, out)) = &targets {
        check_len("targets", rows, ids.len())?;
        check_len("out_log_prob", rows, out.len())?;
    }
    match logits {
        Logits::F32(x) => run(x, vocab, inv_t, targets, out_entropy),
        Logits::Bf16(x) => run(x, vocab, inv_t, targets, out_entropy),
        Logits::F16(x) => run(x, vocab, inv_t, targets, out_entropy),
    }
}

fn inverse_temperature(temperature: f32) -> Result<f32> {
    if temperature.is_finite() && temperature > 0.0 && (1.0 / temperature).is_finite() {
        Ok(1.0 / temperature)
    } else {
        Err(CoreError::OutOfRange {
            what: "temperature",
            value: f64::from(temperature),
            expected: "finite and > 0",
        }
        .into())
    }
}

fn run<L: Logit>(
    logits: &[L],
    vocab: usize,
    inv_t: f32,
    targets: Option<(&[u32], &mut [f32])>,
    out_entropy: &mut [f32],
) -> Result<()> {
    let rows = logits.par_chunks_exact(vocab);
    match targets {
        None => rows
            .zip(out_entropy.par_iter_mut())
            .enumerate()
            .try_for_each(|(r, (row, h))| {
                *h = row_result(row, inv_t, None, r)?.entropy;
                Ok(())
            }),
        Some((ids, out_lp)) => rows
            .zip(out_entropy.par_iter_mut())
            .zip(ids.par_iter().zip(out_lp.par_iter_mut()))
            .enumerate()
            .try_for_each(|(r, ((row, h), (&id, lp)))| {
                let res = row_result(row, inv_t, Some(id), r)?;
                *h = res.entropy;
                *lp = res.log_prob.unwrap_or(f32::NAN);
                Ok(())
            }),
    }
}

fn row_result<L: Logit>(
    row: &[L],
    inv_t: f32,
    target: Option<u32>,
    r: usize,
) -> Result<LogProbEntropy> {
    let stats = row_stats(row, inv_t).ok_or(Error::BadLogitsRow { row: r })?;
    let log_prob = match target {
        None => None,
        Some(id) => {
            // the same f32 product the kernel formed, in base-2 units
            let y = row
                .get(id as usize)
                .ok_or(Error::TargetOutOfRange {
                    row: r,
                    id,
                    vocab: row.len(),
                })?
                .to_f32()
                * (inv_t * LOG2E);
            if y == f32::NEG_INFINITY {
                return Err(Error::ImpossibleTarget { row: r, id });
            }
            // (y − m) first: both are large for big logits and their difference is exact,
            // where z − lse would round lse to the ulp of |z|.
            Some((LN2 * (f64::from(y) - f64::from(stats.max2)) - stats.ln_sum) as f32)
        }
    };
    Ok(LogProbEntropy {
        log_prob,
        entropy: stats.entropy,
    })
}

/// Row statistics in base-2 units `y = z·log₂e`: `lse = ln 2·max2 + ln_sum`.
#[derive(Clone, Copy)]
struct RowStats {
    max2: f32,
    ln_sum: f64,
    entropy: f32,
}

const LOG2E: f32 = core::f32::consts::LOG2_E;
const LN2: f64 = core::f64::consts::LN_2;

/// The [`RowStats`] of one row, or `None` for NaN/+∞ entries or an all −∞ row. Picks the
/// widest SIMD the CPU has at run time: AVX-512 intrinsics ([`avx512`]), else the portable
/// loop compiled for AVX2+FMA or the base target; all give the same bits (FMA or not aside).
fn row_stats<L: Logit>(row: &[L], inv_t: f32) -> Option<RowStats> {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { avx512::row_stats(row, inv_t) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { row_stats_avx2(row, inv_t) },
        _ => row_stats_portable::<L, false>(row, inv_t),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_stats_avx2<L: Logit>(row: &[L], inv_t: f32) -> Option<RowStats> {
    row_stats_portable::<L, true>(row, inv_t)
}

#[inline(always)]
fn row_stats_portable<L: Logit, const FMA: bool>(row: &[L], inv_t: f32) -> Option<RowStats> {
    let mut m = f32::NEG_INFINITY; // running max of y = z·log₂e
    let mut s = [0.0f64; LANES]; // Σ 2^{y−m}
    let mut u = [0.0f64; LANES]; // Σ 2^{y−m}·(y−m)
    let mut bad = [0u32; LANES]; // nonzero once NaN or +∞ was seen
    let mut buf = [0.0f32; BLOCK];
    for chunk in row.chunks(BLOCK) {
        let (head, tail) = buf.split_at_mut(chunk.len());
        // base 2 (y = z·log₂e): the exponential becomes 2^(y−m), whose range reduction is exact
        L::load_scaled(chunk, head, inv_t * LOG2E);
        // Padding with −∞ keeps every block full-width: −∞ adds nothing to S or U.
        tail.fill(f32::NEG_INFINITY);

        let mut block_max = [f32::NEG_INFINITY; LANES];
        for lanes in buf.chunks_exact(LANES) {
            for ((z, mx), b) in lanes.iter().zip(&mut block_max).zip(&mut bad) {
                // A plain compare-select vectorises (f32::max's NaN rule does not); NaN is
                // caught by the flag: `z < +∞` is false exactly for NaN and +∞.
                *mx = if *z > *mx { *z } else { *mx };
                #[allow(clippy::neg_cmp_op_on_partial_ord)] // the NaN case is the point
                let not_below_inf = !(*z < f32::INFINITY);
                *b |= u32::from(not_below_inf);
            }
        }
        let bm = block_max.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        if bm > m {
            if m > f32::NEG_INFINITY {
                let shift = f64::from(m) - f64::from(bm);
                let c = shift.exp2();
                for (sl, ul) in s.iter_mut().zip(&mut u) {
                    *ul = c * (*ul + shift * *sl);
                    *sl *= c;
                }
            }
            m = bm;
        }

        let mut sb = [0.0f32; LANES];
        let mut ub = [0.0f32; LANES];
        for lanes in buf.chunks_exact(LANES) {
            for ((z, sl), ul) in lanes.iter().zip(&mut sb).zip(&mut ub) {
                // Clamping keeps d finite for −∞ logits (and for m = −∞), so e·d = 0·d = 0.
                let d = (*z - m).max(EXP2_UNDERFLOW - 1.0);
                let e = exp2_nonpositive::<FMA>(d);
                *sl += e;
                *ul = madd::<FMA>(e, d, *ul);
            }
        }
        for (((sl, ul), b_s), b_u) in s.iter_mut().zip(&mut u).zip(&sb).zip(&ub) {
            *sl += f64::from(*b_s);
            *ul += f64::from(*b_u);
        }
    }
    if bad.iter().any(|&b| b != 0) || m == f32::NEG_INFINITY {
        return None;
    }
    let s_total: f64 = s.iter().sum();
    let u_total: f64 = u.iter().sum();
    let ln_sum = s_total.ln();
    // H = ln S − ln 2·U/S (U is in base-2 units). True entropy is ≥ 0; rounding can leave
    // −1e−9 on one-hot rows.
    let entropy = (ln_sum - LN2 * u_total / s_total).max(0.0) as f32;
    Some(RowStats {
        max2: m,
        ln_sum,
        entropy,
    })
}

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
