//! The row statistics of [`super::row_stats_portable`] written with AVX-512 intrinsics.
//!
//! Same arithmetic, same results bit for bit (a test holds them to it), fewer
//! instructions: the portable loop, vectorised by the compiler, converts each block into a
//! scaled f32 buffer and spends ~12 instructions on the exponential's range reduction and
//! flush to zero. Here the block is read twice from L1 (max, then sums) without a buffer,
//! `2^n` is one `vscalefps` whose zero-masking does the underflow flush, and rounding is one
//! `vrndscaleps`.
//!
//! Per element the sums see exactly what the portable kernel computes: `y = x·scale`
//! (rounded), `d = max(y − m, −127)`, `e = 2^d` by the degree-6 polynomial of
//! [`crate::exp`] (0 below 2⁻¹²⁶), slot `i mod 64` of each block accumulating in f32 and
//! added into its f64 slot once per block. NaN propagates into the sums instead of being
//! flagged while reading; +∞ shows up as an infinite max.

use core::arch::x86_64::*;

use super::{BLOCK, LANES, LN2, LOG2E, RowStats};
use crate::exp::{EXP2_POLY, EXP2_UNDERFLOW};
use crate::logits::{Logit, LogitKind};

// Four accumulators of 16 lanes take vectors `v mod 4` of a block: the portable kernel's
// slot `i mod 64`.
const _: () = assert!(LANES == 64 && BLOCK.is_multiple_of(64));

/// 16 logits from `p` as f32.
///
/// # Safety
/// 16 elements readable at `p`; AVX-512F available.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load16<L: Logit>(p: *const L) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements of L (64 or 32 bytes).
    unsafe {
        match L::KIND {
            LogitKind::F32 => _mm512_loadu_ps(p.cast()),
            // bf16 is the upper half of an f32
            LogitKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
            LogitKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        }
    }
}

/// The 16 elements of `row` from `at`, the ones past its end as −∞ (the last vector of a
/// row whose length is not a multiple of 16).
#[target_feature(enable = "avx512f")]
#[inline]
fn padded<L: Logit>(row: &[L], at: usize) -> __m512 {
    let mut pad = [f32::NEG_INFINITY; 16];
    for (p, x) in pad.iter_mut().zip(row.get(at..).unwrap_or(&[])) {
        *p = x.to_f32();
    }
    // SAFETY: `pad` holds 16 f32.
    unsafe { _mm512_loadu_ps(pad.as_ptr()) }
}

/// One vector into a pair of accumulators: `s += 2^d`, `u += 2^d·d` with
/// `d = max(x·scale − m, −127)`.
#[target_feature(enable = "avx512f")]
#[inline]
fn accumulate(x: __m512, scale: __m512, m: __m512, s: &mut __m512, u: &mut __m512) {
    let clamp = _mm512_set1_ps(EXP2_UNDERFLOW - 1.0);
    // max(clamp, ·) returns its second operand for NaN, which keeps NaN
    let d = _mm512_max_ps(clamp, _mm512_sub_ps(_mm512_mul_ps(x, scale), m));
    let e = exp2(d);
    *s = _mm512_add_ps(*s, e);
    *u = _mm512_fmadd_ps(e, d, *u);
}

/// `2^d` for `d ≥ −127` (NaN stays NaN), 0 where `d < −126`: the portable
/// `exp2_nonpositive` with the same polynomial and rounding.
#[target_feature(enable = "avx512f")]
#[inline]
fn exp2(d: __m512) -> __m512 {
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(d);
    let r = _mm512_sub_ps(d, n);
    let mut p = _mm512_set1_ps(EXP2_POLY[0]);
    for &c in &EXP2_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    // "not less than", unordered true: NaN keeps its lane (and stays NaN)
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, _mm512_set1_ps(EXP2_UNDERFLOW));
    _mm512_maskz_scalef_ps(keep, p, n)
}

/// [`RowStats`] of one row, or `None` for NaN/+∞ entries (or a product `x·scale` that
/// overflows) or an all −∞ row.
#[target_feature(enable = "avx512f")]
pub(super) fn row_stats<L: Logit>(row: &[L], inv_t: f32) -> Option<RowStats> {
    let scale = inv_t * LOG2E;
    let scale_v = _mm512_set1_ps(scale);
    let mut m = f32::NEG_INFINITY; // running max of y = x·scale
    let mut s = [0.0f64; LANES];
    let mut u = [0.0f64; LANES];
    for start in (0..row.len()).step_by(BLOCK) {
        let len = (row.len() - start).min(BLOCK);
        let (full, vectors) = (len / 16, len.div_ceil(16));
        let base = row[start..].as_ptr();
        // Vector v of the block: `full` whole ones read in place, then a padded last one.
        // The four accumulators are named, not indexed, so they stay in registers.
        // SAFETY (loads below): v < full, so 16 elements at base + 16·v are in the row.
        let load = |v: usize| unsafe { load16(base.add(16 * v)) };

        // Pass 1: the block's max (vmaxps returns its second operand for a NaN first).
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1, mut m2, mut m3) = (neg_inf, neg_inf, neg_inf, neg_inf);
        let mut v = 0;
        while v + 4 <= full {
            m0 = _mm512_max_ps(load(v), m0);
            m1 = _mm512_max_ps(load(v + 1), m1);
            m2 = _mm512_max_ps(load(v + 2), m2);
            m3 = _mm512_max_ps(load(v + 3), m3);
            v += 4;
        }
        while v < vectors {
            let x = if v < full {
                load(v)
            } else {
                padded(row, start + 16 * v)
            };
            m0 = _mm512_max_ps(x, m0);
            v += 1;
        }
        let raw_max =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
        // Rounding is monotone, so this is the max of the rounded products.
        let bm = raw_max * scale;
        if bm == f32::INFINITY {
            return None;
        }
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
        if m == f32::NEG_INFINITY {
            // all −∞ so far: nothing to add, but a NaN must not slip through
            for v in 0..vectors {
                let x = if v < full {
                    load(v)
                } else {
                    padded(row, start + 16 * v)
                };
                if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x) != 0 {
                    return None;
                }
            }
            continue;
        }

        // Pass 2: Σ 2^d and Σ 2^d·d, vector v into accumulator v mod 4.
        let m_v = _mm512_set1_ps(m);
        let zero = _mm512_setzero_ps();
        let mut sb = [zero; 4];
        let mut ub = [zero; 4];
        {
            let [s0, s1, s2, s3] = &mut sb;
            let [u0, u1, u2, u3] = &mut ub;
            let mut v = 0;
            while v + 4 <= full {
                accumulate(load(v), scale_v, m_v, s0, u0);
                accumulate(load(v + 1), scale_v, m_v, s1, u1);
                accumulate(load(v + 2), scale_v, m_v, s2, u2);
                accumulate(load(v + 3), scale_v, m_v, s3, u3);
                v += 4;
            }
            // the rest (up to three whole and a padded one), accumulators 0, 1, 2, 3 in
            // turn: v is a multiple of 4 here
            let rest = [(s0, u0), (s1, u1), (s2, u2), (s3, u3)];
            for (k, (sk, uk)) in rest.into_iter().enumerate() {
                let w = v + k;
                if w < vectors {
                    let x = if w < full {
                        load(w)
                    } else {
                        padded(row, start + 16 * w)
                    };
                    accumulate(x, scale_v, m_v, sk, uk);
                }
            }
        }
        let mut sf = [0.0f32; LANES];
        let mut uf = [0.0f32; LANES];
        for k in 0..4 {
            // SAFETY: each slice holds 16 f32 at 16·k.
            unsafe {
                _mm512_storeu_ps(sf[16 * k..].as_mut_ptr(), sb[k]);
                _mm512_storeu_ps(uf[16 * k..].as_mut_ptr(), ub[k]);
            }
        }
        for (((sl, ul), b_s), b_u) in s.iter_mut().zip(&mut u).zip(&sf).zip(&uf) {
            *sl += f64::from(*b_s);
            *ul += f64::from(*b_u);
        }
    }
    if m == f32::NEG_INFINITY {
        return None;
    }
    let s_total: f64 = s.iter().sum();
    let u_total: f64 = u.iter().sum();
    if !(s_total.is_finite() && u_total.is_finite()) {
        return None; // a NaN entry
    }
    let ln_sum = s_total.ln();
    let entropy = (ln_sum - LN2 * u_total / s_total).max(0.0) as f32;
    Some(RowStats {
        max2: m,
        ln_sum,
        entropy,
    })
}
