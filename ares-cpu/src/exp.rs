//! `2^x` for non-positive arguments, written so the compiler vectorises it: `n` from the
//! round-to-nearest magic-number trick, a polynomial for `2^r` on |r| ≤ ½, and `2^n` built
//! from the exponent bits. Every step is a plain arithmetic or bit operation — no calls, no
//! branches — so a loop over a slice becomes SIMD code. Kernels work in base 2 (inputs
//! scaled by log₂e once), which makes the range reduction exact.

/// 1.5·2²³: adding it rounds a float of magnitude < 2²² to an integer held in the low
/// mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `a·b + c`: one fused instruction where the caller's target has FMA (`FMA = true`, only
/// inside `#[target_feature(enable = "fma")]` code), else a multiply and an add — on a
/// target without FMA `mul_add` would be a slow library call.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `2^r` on |r| ≤ ½: the degree-6 Taylor coefficients `(ln 2)^k / k!`, highest degree
/// first (Horner). Shared by every kernel that must give the same numbers.
pub(crate) const EXP2_POLY: [f32; 7] = [
    1.540_353e-4,
    1.333_355_8e-3,
    9.618_129e-3,
    5.550_411e-2,
    2.402_265e-1,
    6.931_472e-1,
    1.0,
];

/// Below this `2^x` is under the smallest normal f32; the result is flushed to 0.
pub(crate) const EXP2_UNDERFLOW: f32 = -126.0;

/// `2^x` for `x ≤ 0` (relative error ≈ 1.5e−7): `x = n + r` with `n = round(x)` (exact, so
/// unlike base e there is no Cody–Waite split), `2^r` by its degree-6 Taylor polynomial on
/// |r| ≤ ½, `2^n` from the exponent bits. `x < −126` and `x = −∞` give 0; NaN gives an
/// unspecified finite value (callers detect NaN inputs separately).
#[inline(always)]
pub(crate) fn exp2_nonpositive<const FMA: bool>(x: f32) -> f32 {
    let xc = x.max(EXP2_UNDERFLOW);
    let k = xc + ROUND_MAGIC;
    let n = k - ROUND_MAGIC;
    let n_int = k.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = xc - n;
    let mut p = EXP2_POLY[0];
    for &c in &EXP2_POLY[1..] {
        p = madd::<FMA>(p, r, c);
    }
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < EXP2_UNDERFLOW { 0.0 } else { p * scale }
}

/// `e^x` for `x ≤ 0` as `2^(x·log₂e)`: relative error ≈ 1.5e−7 + |x|·6e−8 (the rounding of
/// the product), negligible where softmax weights are concerned. `x < −87.3` gives 0.
#[inline(always)]
pub(crate) fn exp_nonpositive<const FMA: bool>(x: f32) -> f32 {
    exp2_nonpositive::<FMA>(x * core::f32::consts::LOG2_E)
}

/// Accumulator slots of [`scaled_row_max`]'s loop (the vectoriser maps them onto SIMD lanes).
const MAX_LANES: usize = 16;

/// `max_v x_v·scale` of a logits row, or `None` for a row the softmax kernels reject: a NaN
/// or `+∞` (after scaling) anywhere, or `−∞` everywhere. Written as per-lane compare-selects
/// so it vectorises in the caller's `target_feature` context (`f32::max`'s NaN rule does not).
#[inline(always)]
pub(crate) fn scaled_row_max(x: &[f32], scale: f32) -> Option<f32> {
    let (mut mx, mut bad) = ([f32::NEG_INFINITY; MAX_LANES], [0u32; MAX_LANES]);
    let mut chunks = x.chunks_exact(MAX_LANES);
    let lane = |v: f32, m: &mut f32, b: &mut u32| {
        let y = v * scale;
        *m = if y > *m { y } else { *m };
        // `y < +∞` is false exactly for NaN and +∞.
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // the NaN case is the point
        let not_below_inf = !(y < f32::INFINITY);
        *b |= u32::from(not_below_inf);
    };
    for ch in &mut chunks {
        for ((&v, m), b) in ch.iter().zip(&mut mx).zip(&mut bad) {
            lane(v, m, b);
        }
    }
    for ((&v, m), b) in chunks.remainder().iter().zip(&mut mx).zip(&mut bad) {
        lane(v, m, b);
    }
    let m = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    (bad.iter().all(|&b| b == 0) && m != f32::NEG_INFINITY).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_matches_std_on_the_whole_range() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp2();
            for got in [exp2_nonpositive::<false>(x), exp2_nonpositive::<true>(x)] {
                worst = worst.max(((f64::from(got) - want) / want).abs());
            }
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_nonpositive::<false>(0.0), 1.0);
        assert_eq!(exp2_nonpositive::<true>(-1.0), 0.5);
        assert_eq!(exp2_nonpositive::<false>(-200.0), 0.0);
        assert_eq!(exp2_nonpositive::<true>(f32::NEG_INFINITY), 0.0);
    }
}
