//! Reduced-precision GEMM operands: what a GPU's tensor cores multiply when a linear layer
//! runs in TF32 or bf16, reproduced on the CPU so the CPU backend is the reference of
//! those modes too.
//!
//! A tensor-core GEMM rounds each operand element to the narrow format, multiplies the
//! narrow values exactly (an 8- or 11-bit by 8- or 11-bit significand product fits an f32)
//! and accumulates in f32. Rounding the operands here and running the f32 GEMM gives the
//! same products; only the order of the f32 sums differs from the GPU's.
//!
//! - [`MatmulPrecision::F32`]: no rounding (exact f32 products).
//! - [`MatmulPrecision::Tf32`]: 10 explicit significand bits (`x` rounded to nearest, ties
//!   to even). cuBLAS does not document how it rounds to TF32; its results may differ from
//!   these in the last TF32 bit of an operand (relative 2⁻¹¹).
//! - [`MatmulPrecision::Bf16`]: 7 explicit significand bits, round to nearest even, as
//!   `__float2bfloat16_rn` and the CUDA backend's conversion kernel.
//!
//! Both roundings keep ±0, ±∞ and NaN (as a quiet NaN); a finite value past the narrow
//! format's largest rounds to ∞ as IEEE rounding does.

use crate::isa::Isa;
use crate::ops::stored::{Bf16Bits, Widen};
use rayon::prelude::*;
use std::borrow::Cow;

/// How the linear layers' matrix products treat their f32 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MatmulPrecision {
    /// Exact f32 products (the default; what the transformers fixtures are checked with).
    #[default]
    F32,
    /// Operands rounded to TF32 (1 + 8 + 10 bits), f32 sums.
    Tf32,
    /// Operands rounded to bf16 (1 + 8 + 7 bits), f32 sums; only for products of at least
    /// [`BF16_MIN_ROWS`] rows (see [`MatmulPrecision::for_rows`]).
    Bf16,
}

/// Products with fewer rows (tokens) than this run in f32 even under
/// [`MatmulPrecision::Bf16`]. With f32-stored weights a bf16 product first converts the
/// weight, which costs more memory traffic than a few-row product (a decode step) saves;
/// such products are bound by reading the weight, not by arithmetic.
pub const BF16_MIN_ROWS: usize = 64;

impl MatmulPrecision {
    /// The precision a linear layer with `rows` rows (tokens) actually uses: `self`, except
    /// `Bf16` below [`BF16_MIN_ROWS`] rows, which is `F32`. Forward and both backward
    /// products of one layer call use the same answer (`rows` is the layer's token count).
    pub const fn for_rows(self, rows: usize) -> Self {
        match self {
            Self::Bf16 if rows < BF16_MIN_ROWS => Self::F32,
            p => p,
        }
    }

    /// The configuration name: `"f32"`, `"tf32"`, `"bf16"`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Tf32 => "tf32",
            Self::Bf16 => "bf16",
        }
    }

    /// `x` rounded to this precision's operand format.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Self::F32 => x,
            Self::Tf32 => round_to_bits(x, 13),
            Self::Bf16 => round_to_bits(x, 16),
        }
    }

    /// `src` with every element [`MatmulPrecision::round`]ed: borrowed for `F32`, a rounded
    /// copy otherwise (in parallel for large slices).
    pub fn rounded(self, src: &[f32]) -> Cow<'_, [f32]> {
        if self == Self::F32 {
            return Cow::Borrowed(src);
        }
        let mut out = vec![0.0f32; src.len()];
        match self {
            Self::Bf16 => {
                const PAR_MIN: usize = 1 << 16;
                if src.len() >= PAR_MIN {
                    out.par_chunks_mut(PAR_MIN)
                        .zip(src.par_chunks(PAR_MIN))
                        .for_each(|(d, s)| round_bf16_into(s, d));
                } else {
                    round_bf16_into(src, &mut out);
                }
            }
            _ => map_elements(src, &mut out, |s| self.round(s)),
        }
        Cow::Owned(out)
    }
}

/// `dst[i]` = `src[i]` rounded to the nearest bf16 (ties to even; NaN stays a quiet NaN), as
/// f32 — [`MatmulPrecision::round`] over equal-length slices (a shorter one bounds both), in
/// the widest registers the CPU path has: the same bits on every path.
pub fn round_bf16_into(src: &[f32], dst: &mut [f32]) {
    #[inline(always)]
    fn run(src: &[f32], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = round_to_bits(s, 16);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    fn avx512(src: &[f32], dst: &mut [f32]) {
        run(src, dst);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2(src: &[f32], dst: &mut [f32]) {
        run(src, dst);
    }
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { avx512(src, dst) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2(src, dst) },
        _ => run(src, dst),
    }
}

/// [`round_bf16_into`] in place.
pub fn round_bf16_in_place(x: &mut [f32]) {
    #[inline(always)]
    fn run(x: &mut [f32]) {
        for x in x.iter_mut() {
            *x = round_to_bits(*x, 16);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    fn avx512(x: &mut [f32]) {
        run(x);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2(x: &mut [f32]) {
        run(x);
    }
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { avx512(x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2(x) },
        _ => run(x),
    }
}

/// `dst[i] = f(src[i])` (equal lengths), in parallel for large slices (a weight matrix
/// converted whole).
pub(crate) fn map_elements<S: Copy + Sync, D: Send>(
    src: &[S],
    dst: &mut [D],
    f: impl Fn(S) -> D + Sync,
) {
    const PAR_MIN: usize = 1 << 16;
    let fill = |(d, s): (&mut [D], &[S])| {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = f(s);
        }
    };
    if src.len() >= PAR_MIN {
        dst.par_chunks_mut(PAR_MIN)
            .zip(src.par_chunks(PAR_MIN))
            .for_each(fill);
    } else {
        fill((dst, src));
    }
}

/// Each element of `src` rounded to the nearest bf16 (ties to even; NaN stays NaN), its bits
/// into `dst`: what a kernel that stores bf16 (a KV page) writes.
///
/// # Errors
/// `dst` of another length than `src`.
pub fn round_to_bf16(src: &[f32], dst: &mut [u16]) -> crate::Result<()> {
    crate::error::check_len("dst", src.len(), dst.len())?;
    // (in parallel for a model's bf16 weight copy, refreshed every step)
    map_elements(src, dst, Bf16Bits::narrow);
    Ok(())
}

/// Each bf16 element of `src` (bits) widened to f32 into `dst`: exact.
///
/// # Errors
/// `dst` of another length than `src`.
pub fn widen_bf16(src: &[u16], dst: &mut [f32]) -> crate::Result<()> {
    crate::error::check_len("dst", src.len(), dst.len())?;
    map_elements(src, dst, |b| f32::from_bits(u32::from(b) << 16));
    Ok(())
}

/// The 16 random bits that [`bf16_stochastic`] adds to element `index` of a tensor rounded
/// under `key`: SplitMix64's output function of `key ⊕ index·φ` (φ = 0x9E37_79B9_7F4A_7C15),
/// low 16 bits. A counter-based generator: any element's bits follow from `(key, index)`
/// alone, so a kernel may round the elements in any order or split, and a run resumed from
/// a checkpoint draws what the uninterrupted run drew.
#[inline]
pub const fn rounding_bits(key: u64, index: u64) -> u32 {
    let mut z = key ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) & 0xffff) as u32
}

/// The keys under which AdamW's first and second moments, stored in bf16, round
/// stochastically in an update keyed `key` (element `i` of each drawing
/// [`rounding_bits`]`(key_m, i)` and `(key_v, i)`): streams apart from the one a bf16 weight
/// rounds with under the same key, `rounding_bits(key, i)`.
#[inline]
pub const fn moment_keys(key: u64) -> (u64, u64) {
    (key ^ 0x6D5F_6D6F_6D65_6E74, key ^ 0x765F_6D6F_6D65_6E74)
}

/// `x` rounded to bf16 **stochastically** with the random bits `r` (< 2¹⁶): its magnitude
/// rounds away from zero with probability (dropped bits)/2¹⁶, toward zero otherwise, so the
/// rounding is unbiased (`E[bf16] = x` for uniform `r`) where round-to-nearest always drops
/// an update smaller than half an ulp — AdamW's step at a learning rate of 1e-6 on a weight
/// near 1 is ~1e-6, against bf16's half ulp of 2⁻⁹ ≈ 2e-3 (`docs/training.md`, bf16
/// weights). bf16 values come back unchanged; ±∞ stays; NaN stays a quiet NaN; the largest
/// finite values may round to ∞, as their upward neighbour is.
#[inline]
pub const fn bf16_stochastic(x: f32, r: u32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits | 0x0040_0000) >> 16) as u16;
    }
    // |x| + r·2⁻¹⁶ ulp, truncated: the carry reaches the kept bits with the dropped bits'
    // probability; the sign bit is never reached (∞ + r is below 0x7f81_0000)
    (bits.wrapping_add(r & 0xffff) >> 16) as u16
}

/// Each element `i` of `src` rounded to bf16 by [`bf16_stochastic`] with
/// [`rounding_bits`]`(key, i)`, its bits into `dst`: a weight stored in bf16 written by its
/// optimizer step (`ares_model`'s bf16 weights).
///
/// # Errors
/// `dst` of another length than `src`.
pub fn round_to_bf16_stochastic(src: &[f32], key: u64, dst: &mut [u16]) -> crate::Result<()> {
    keyed_bf16(src, key, dst, |s, _, r| bf16_stochastic(s, r))
}

/// `dst[i] ← f(src[i], dst[i], rounding_bits(key, i))` over chunks in parallel (element `i`
/// draws its bits whatever chunk it falls in).
fn keyed_bf16(
    src: &[f32],
    key: u64,
    dst: &mut [u16],
    f: impl Fn(f32, u16, u32) -> u16 + Sync,
) -> crate::Result<()> {
    crate::error::check_len("dst", src.len(), dst.len())?;
    const CHUNK: usize = 1 << 16;
    let each = |(c, (d, s)): (usize, (&mut [u16], &[f32]))| {
        let first = (c * CHUNK) as u64;
        for (j, (d, &s)) in d.iter_mut().zip(s).enumerate() {
            *d = f(s, *d, rounding_bits(key, first + j as u64));
        }
    };
    if src.len() >= CHUNK {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .enumerate()
            .for_each(each);
    } else {
        each((0, (dst, src)));
    }
    Ok(())
}

/// `dst[i] ← bf16_stochastic(widen(dst[i]) + src[i], rounding_bits(key, i))`: an f32
/// contribution added to a tensor stored in bf16, the sum rounded **stochastically** — a
/// gradient stored in bf16 (`trainer.grad_dtype: bf16`) taking one layer's part of a
/// backward pass. Unbiased: `E[widen(dst')] = widen(dst) + src` (the f32 sum, itself exact
/// to half an f32 ulp), where rounding to nearest would drop every contribution below half
/// a bf16 ulp of the running sum — a long accumulation would stall. NaN and ±∞ propagate.
///
/// # Errors
/// `dst` of another length than `src`.
pub fn accumulate_bf16_stochastic(src: &[f32], key: u64, dst: &mut [u16]) -> crate::Result<()> {
    keyed_bf16(src, key, dst, |s, d, r| {
        bf16_stochastic(f32::from_bits(u32::from(d) << 16) + s, r)
    })
}

/// Every element of `dst` set to `value` rounded to the nearest bf16 (`0.0`: zeroes a
/// gradient stored in bf16).
pub fn fill_bf16(dst: &mut [u16], value: f32) {
    dst.fill(Bf16Bits::narrow(value));
}

/// `x` rounded to nearest (ties to even) with its low `drop` bits cleared; NaN stays a
/// (quiet) NaN.
#[inline]
pub(crate) fn round_to_bits(x: f32, drop: u32) -> f32 {
    let bits = x.to_bits();
    let low = (1u32 << drop) - 1;
    let half = (low >> 1) + ((bits >> drop) & 1);
    // A carry out of the significand bumps the exponent: the correct rounding, up to ∞.
    let rounded = bits.wrapping_add(half) & !low;
    // NaN: keep sign and payload's top, force the quiet bit
    let quiet = (bits | 0x0040_0000) & !low;
    // both computed and one selected, without a branch: a loop of it vectorises
    f32::from_bits(if bits & 0x7fff_ffff > 0x7f80_0000 {
        quiet
    } else {
        rounded
    })
}

#[cfg(test)]
mod tests {
    /// The wide rounding gives `round_to_bits`' bits on every path, specials included.
    #[test]
    fn wide_bf16_rounding_is_the_scalar_bits() {
        let mut x: Vec<f32> = crate::test_rng::rand_vec(1037, 5)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        x.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::MAX,
            1.0 + f32::EPSILON * 128.0,
            -0.0,
            1e-40,
        ]);
        let want: Vec<u32> = x.iter().map(|&v| round_to_bits(v, 16).to_bits()).collect();
        let mut into = vec![0.0f32; x.len()];
        round_bf16_into(&x, &mut into);
        let mut place = x.clone();
        round_bf16_in_place(&mut place);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&into), want);
        assert_eq!(bits(&place), want);
        assert_eq!(bits(&MatmulPrecision::Bf16.rounded(&x)), want);
    }

    use super::MatmulPrecision::{Bf16, F32, Tf32};
    use super::*;

    #[test]
    fn rounding_by_hand() {
        // 1 + 2⁻⁹: below bf16's half ulp at 1 (2⁻⁸), a TF32 value (ulp 2⁻¹⁰)
        let x = 1.0 + 2f32.powi(-9);
        assert_eq!(Bf16.round(x), 1.0);
        assert_eq!(Tf32.round(x), x);
        assert_eq!(F32.round(x), x);
        // ties go to the even neighbour: 1 + 2⁻⁸ → 1; 1 + 3·2⁻⁸ → 1 + 2⁻⁶
        assert_eq!(Bf16.round(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(Bf16.round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        // just above a tie rounds up
        assert_eq!(
            Bf16.round(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(Tf32.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(Tf32.round(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
        // sign is kept
        assert_eq!(Bf16.round(-3.0 - 2f32.powi(-10)), -3.0);
        // the largest f32 is past bf16's largest finite value: it rounds to ∞
        assert_eq!(Bf16.round(f32::MAX), f32::INFINITY);
        assert_eq!(Bf16.round(f32::MIN), f32::NEG_INFINITY);
    }

    #[test]
    fn special_values_survive() {
        for p in [F32, Tf32, Bf16] {
            assert_eq!(p.round(0.0).to_bits(), 0);
            assert_eq!(p.round(-0.0).to_bits(), (-0.0f32).to_bits());
            assert_eq!(p.round(f32::INFINITY), f32::INFINITY);
            assert_eq!(p.round(f32::NEG_INFINITY), f32::NEG_INFINITY);
            assert!(p.round(f32::NAN).is_nan());
            // a NaN whose payload lies only in the dropped bits must not become ∞
            assert!(p.round(f32::from_bits(0x7f80_0001)).is_nan());
        }
    }

    #[test]
    fn bf16_matches_the_half_crate() {
        // half's conversion is round-to-nearest-even; every 97th f32 bit pattern
        let mut bits = 0u32;
        while let Some(next) = bits.checked_add(97 * 65_537) {
            let x = f32::from_bits(bits);
            let want = half::bf16::from_f32(x).to_f32();
            let got = Bf16.round(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({bits:#x}): {got:e} vs {want:e}"
            );
            bits = next;
        }
    }

    #[test]
    fn rounding_error_is_within_half_an_ulp() {
        let mut x = 1.0e-30f32;
        while x < 1.0e30 {
            for (p, eps) in [(Tf32, 2f64.powi(-11)), (Bf16, 2f64.powi(-8))] {
                let r = f64::from(p.round(x));
                let err = (r - f64::from(x)).abs() / f64::from(x);
                assert!(err <= eps, "{p:?} {x:e}: relative error {err:e}");
            }
            x *= 1.37;
        }
    }

    #[test]
    fn stochastic_rounding_by_hand() {
        // 1 + 2⁻⁹ lies a quarter of the way from 1 to 1 + 2⁻⁷: its dropped bits are 0x4000
        let x = 1.0 + 2f32.powi(-9);
        let (lo, hi) = (0x3f80u16, 0x3f81u16);
        assert_eq!(bf16_stochastic(x, 0), lo);
        assert_eq!(bf16_stochastic(x, 0xbfff), lo);
        assert_eq!(bf16_stochastic(x, 0xc000), hi);
        assert_eq!(bf16_stochastic(x, 0xffff), hi);
        // the sign is kept and the magnitude rounds alike
        assert_eq!(bf16_stochastic(-x, 0xc000), hi | 0x8000);
        // a bf16 value is never moved, whatever the bits
        for r in [0, 1, 0x8000, 0xffff] {
            assert_eq!(bf16_stochastic(1.5, r), 0x3fc0);
            assert_eq!(bf16_stochastic(0.0, r), 0);
            assert_eq!(bf16_stochastic(-0.0, r), 0x8000);
            assert_eq!(bf16_stochastic(f32::INFINITY, r), 0x7f80);
            assert_eq!(bf16_stochastic(f32::NEG_INFINITY, r), 0xff80);
            // a NaN whose payload lies only in the dropped bits stays a NaN
            let nan = bf16_stochastic(f32::from_bits(0x7f80_0001), r);
            assert!(f32::from_bits(u32::from(nan) << 16).is_nan());
        }
        // only bits below 2¹⁶ count
        assert_eq!(bf16_stochastic(x, 0x1_0000), lo);
        // past the largest finite bf16, up is ∞
        assert_eq!(bf16_stochastic(f32::MAX, 0xffff), 0x7f80);
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        // many draws of a value between two bf16 neighbours average to the value, where
        // round-to-nearest is off by its distance to the nearer one
        let key = 0x5eed;
        for x in [1.0 + 2f32.powi(-9), 1.0 + 1e-6, -3.0e-5, 7.0e3 + 1.0] {
            let n = 1u64 << 16;
            let mean = (0..n)
                .map(|i| {
                    let b = bf16_stochastic(x, rounding_bits(key, i));
                    f64::from(f32::from_bits(u32::from(b) << 16))
                })
                .sum::<f64>()
                / n as f64;
            let ulp = f64::from(f32::from_bits((x.abs().to_bits() & 0xffff_0000) + 0x1_0000))
                - f64::from(f32::from_bits(x.abs().to_bits() & 0xffff_0000));
            // the mean of n Bernoulli draws: ±4σ ≤ 4·ulp/(2√n)
            let tol = 2.0 * ulp / (n as f64).sqrt();
            assert!(
                (mean - f64::from(x)).abs() <= tol,
                "{x:e}: mean {mean:e}, tolerance {tol:e}"
            );
        }
    }

    #[test]
    fn rounding_bits_are_uniform_and_keyed() {
        // 16 bins of the top 4 bits over 2¹⁶ indices: each within 5 % of its share
        let mut bins = [0u32; 16];
        for i in 0..1u64 << 16 {
            bins[(rounding_bits(42, i) >> 12) as usize] += 1;
        }
        assert!(bins.iter().all(|&b| (3891..=4301).contains(&b)), "{bins:?}");
        // another key draws other bits
        let same = (0..1000u64)
            .filter(|&i| rounding_bits(42, i) == rounding_bits(43, i))
            .count();
        assert!(same < 10, "{same} of 1000 equal");
    }

    #[test]
    fn slices_round_and_widen() {
        let src: Vec<f32> = (0..200_000).map(|i| 1.0 + i as f32 * 1e-7).collect();
        let mut bits = vec![0u16; src.len()];
        round_to_bf16_stochastic(&src, 9, &mut bits).unwrap();
        // element i uses rounding_bits(9, i) whatever the chunk it falls in
        for i in [0, 1, 65_535, 65_536, 199_999] {
            assert_eq!(bits[i], bf16_stochastic(src[i], rounding_bits(9, i as u64)));
        }
        let mut back = vec![0.0f32; src.len()];
        widen_bf16(&bits, &mut back).unwrap();
        assert!(
            src.iter()
                .zip(&back)
                .all(|(&x, &y)| (x - y).abs() <= 2f32.powi(-7))
        );
        // widening then rounding a bf16 value gives it back, under any key
        let mut again = vec![0u16; src.len()];
        round_to_bf16_stochastic(&back, 77, &mut again).unwrap();
        assert_eq!(again, bits);
        assert!(round_to_bf16_stochastic(&src, 0, &mut again[..3]).is_err());
        assert!(widen_bf16(&bits[..2], &mut back).is_err());
    }

    #[test]
    fn stochastic_accumulation_is_unbiased_where_nearest_stalls() {
        // 4 096 contributions of 1e-4 onto 1.0: each is below half a bf16 ulp (2⁻⁸), so
        // rounding each sum to nearest never moves the total; stochastic rounding keeps it
        // at 1.4096 on average (σ of the sum ≈ ulp·√(n·p(1−p)), here well below 0.02)
        let n = 4096;
        let mut acc = vec![0x3f80u16; 64];
        let mut nearest = vec![0x3f80u16; 64];
        for step in 0..n {
            accumulate_bf16_stochastic(&[1e-4; 64], 0xACC ^ step, &mut acc).unwrap();
            let sums: Vec<f32> = nearest
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16) + 1e-4)
                .collect();
            round_to_bf16(&sums, &mut nearest).unwrap();
        }
        assert!(nearest.iter().all(|&b| b == 0x3f80), "nearest stalls at 1");
        let mean = acc
            .iter()
            .map(|&b| f64::from(f32::from_bits(u32::from(b) << 16)))
            .sum::<f64>()
            / 64.0;
        assert!((mean - 1.4096).abs() < 0.01, "mean {mean}");
        // by hand: element i draws rounding_bits(key, i); a bf16 sum is exact
        let src = [1.0 + 2f32.powi(-9) - 1.0, 0.5, f32::NAN, -2.0];
        let mut dst = [0x3f80u16, 0x3f80, 0x3f80, 0x3f80];
        accumulate_bf16_stochastic(&src, 5, &mut dst).unwrap();
        assert_eq!(
            dst[0],
            bf16_stochastic(1.0 + 2f32.powi(-9), rounding_bits(5, 0))
        );
        assert_eq!(dst[1], 0x3fc0);
        assert!(f32::from_bits(u32::from(dst[2]) << 16).is_nan());
        assert_eq!(dst[3], 0xbf80);
        assert!(accumulate_bf16_stochastic(&src, 5, &mut dst[..2]).is_err());
        // filled with the nearest bf16
        fill_bf16(&mut dst, 0.0);
        assert_eq!(dst, [0; 4]);
        fill_bf16(&mut dst, 1.0 + 2f32.powi(-9));
        assert_eq!(dst, [0x3f80; 4]);
    }

    #[test]
    fn bf16_only_for_enough_rows() {
        assert_eq!(Bf16.for_rows(BF16_MIN_ROWS - 1), F32);
        assert_eq!(Bf16.for_rows(BF16_MIN_ROWS), Bf16);
        assert_eq!(Tf32.for_rows(1), Tf32);
        assert_eq!(F32.for_rows(1 << 20), F32);
    }

    #[test]
    fn rounded_borrows_for_f32_and_copies_otherwise() {
        let v: Vec<f32> = (0..100_000).map(|i| 1.0 + i as f32 * 1e-6).collect();
        assert!(matches!(F32.rounded(&v), Cow::Borrowed(_)));
        let r = Bf16.rounded(&v);
        assert_eq!(r.len(), v.len());
        assert!(r.iter().zip(&v).all(|(&r, &x)| r == Bf16.round(x)));
    }
}
