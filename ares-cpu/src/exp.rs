//! `exp` for non-positive arguments, written so the compiler vectorises it: range
//! reduction `x = n·ln2 + r` with `n` from the round-to-nearest magic-number trick, a
//! degree-6 minimax polynomial for `e^r` on |r| ≤ ln2/2 (Cephes `expf` coefficients,
//! ≈ 1 ulp), and `2^n` built from the exponent bits. Every step is a plain arithmetic or
//! bit operation — no calls, no branches — so a loop over a slice becomes SIMD code.

const LOG2E: f32 = core::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2²³: adding it rounds a float of magnitude < 2²² to an integer held in the low
/// mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Below this `e^x` is under the smallest normal f32; the result is flushed to 0.
pub(crate) const EXP_UNDERFLOW: f32 = -87.0;

/// `a·b + c`: one fused instruction where the caller's target has FMA (`FMA = true`, only
/// inside `#[target_feature(enable = "fma")]` code), else a multiply and an add — on a
/// target without FMA `mul_add` would be a slow library call.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `e^x` for `x ≤ 0` (relative error ≈ 1.2e−7). `x < −87` returns 0; `x = −∞` returns 0;
/// NaN returns an unspecified finite value (callers detect NaN inputs separately).
#[inline(always)]
pub(crate) fn exp_nonpositive<const FMA: bool>(x: f32) -> f32 {
    let xc = x.max(EXP_UNDERFLOW);
    let k = madd::<FMA>(xc, LOG2E, ROUND_MAGIC);
    let n = k - ROUND_MAGIC;
    let n_int = k.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc));
    let mut p = 1.987_569_1e-4_f32;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 1.666_666_5e-1);
    p = madd::<FMA>(p, r, 0.5);
    let er = madd::<FMA>(p, r * r, r + 1.0);
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < EXP_UNDERFLOW { 0.0 } else { er * scale }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_std_exp_on_the_whole_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            for got in [exp_nonpositive::<false>(x), exp_nonpositive::<true>(x)] {
                worst = worst.max(((f64::from(got) - want) / want).abs());
            }
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive::<false>(0.0), 1.0);
        assert_eq!(exp_nonpositive::<false>(-100.0), 0.0);
        assert_eq!(exp_nonpositive::<true>(f32::NEG_INFINITY), 0.0);
    }
}
