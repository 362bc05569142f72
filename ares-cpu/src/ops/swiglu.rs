//! SwiGLU, the gated activation of the Qwen2/Qwen3/Llama MLP
//! (`down_proj(silu(gate_proj(x)) * up_proj(x))`): element-wise on `[tokens, intermediate]`,
//!
//! `out = silu(gate) · up`, `silu(g) = g · σ(g) = g / (1 + e^(−g))`.
//!
//! Evaluated from `t = e^(−|g|) ≤ 1`, which never overflows: `silu(g) = g / (1 + t)` for
//! `g ≥ 0` (torch's form `g / (1 + e^(−g))`) and `g·t / (1 + t)` below; `σ(g)` likewise
//! `1 / (1 + t)` or `t / (1 + t)`. Very negative `g` gives −0, very positive `g` gives `g`.
//! `t` comes from the crate's base-2 exponential polynomial (relative error ≈ 1.5e−7 +
//! |g|·6e−8, the one the softmax kernels use)
//! rather than libm's `expf`, so the loops vectorise; its multiplies and adds are not fused
//! on any path, so every instruction-set path gives the same bits (and the CUDA kernels
//! `swiglu_fwd` / `swiglu_bwd`, written with the same operations, too).

use crate::Result;
use crate::error::check_len;
use crate::exp::exp_nonpositive;
use crate::isa::Isa;
use crate::ops::stored::{Bf16Bits, Widen};
use rayon::prelude::*;

/// Elements per rayon task: element-wise work this cheap only pays for threads in bulk.
const CHUNK: usize = 1 << 14;

/// `(σ(g), silu(g))` from one exponential `t = e^(−|g|)` (see the module docs); NaN `g`
/// gives NaN for `silu`.
#[inline(always)]
fn sigmoid_silu(g: f32) -> (f32, f32) {
    // mul and add unfused (`false`): the same bits on every path
    let t = exp_nonpositive::<false>(-g.abs());
    let d = 1.0 + t;
    let (s, silu) = if g >= 0.0 { (1.0, g) } else { (t, g * t) };
    (s / d, silu / d)
}

/// `silu(g) = g·σ(g)` in f32 (see the module docs for how it is evaluated).
#[inline(always)]
pub fn silu(g: f32) -> f32 {
    sigmoid_silu(g).1
}

/// `out = silu(gate)·up` over a chunk, on the [`Isa::active`] path (the same code compiled
/// for each; the same bits).
fn forward_chunk(o: &mut [f32], g: &[f32], u: &[f32]) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { forward_avx512(o, g, u) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { forward_avx2(o, g, u) },
        _ => forward_portable(o, g, u),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn forward_avx512(o: &mut [f32], g: &[f32], u: &[f32]) {
    forward_portable(o, g, u);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn forward_avx2(o: &mut [f32], g: &[f32], u: &[f32]) {
    forward_portable(o, g, u);
}

#[inline(always)]
fn forward_portable(o: &mut [f32], g: &[f32], u: &[f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = silu(g) * u;
    }
}

/// The backward of a chunk (see [`swiglu_backward`]), on the [`Isa::active`] path.
fn backward_chunk(dg: &mut [f32], du: &mut [f32], dy: &[f32], g: &[f32], u: &[f32]) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { backward_avx512(dg, du, dy, g, u) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { backward_avx2(dg, du, dy, g, u) },
        _ => backward_portable(dg, du, dy, g, u),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn backward_avx512(dg: &mut [f32], du: &mut [f32], dy: &[f32], g: &[f32], u: &[f32]) {
    backward_portable(dg, du, dy, g, u);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn backward_avx2(dg: &mut [f32], du: &mut [f32], dy: &[f32], g: &[f32], u: &[f32]) {
    backward_portable(dg, du, dy, g, u);
}

#[inline(always)]
fn backward_portable(dg: &mut [f32], du: &mut [f32], dy: &[f32], g: &[f32], u: &[f32]) {
    for ((((dg, du), &dy), &g), &u) in dg.iter_mut().zip(du).zip(dy).zip(g).zip(u) {
        let (s, silu) = sigmoid_silu(g);
        *dg = ((dy * u) * s) * (1.0 + g * (1.0 - s));
        *du = dy * silu;
    }
}

/// SwiGLU forward: `out[k] = silu(gate[k]) · up[k]`.
///
/// Shapes: `gate`, `up`, `out`: `[tokens, intermediate]` (any equal lengths: the op is
/// element-wise). Large inputs run in parallel.
///
/// # Errors
/// `up` or `out` not as long as `gate`.
pub fn swiglu_forward(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("up", gate.len(), up.len())?;
    check_len("out", gate.len(), out.len())?;
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| forward_chunk(o, g, u));
    Ok(())
}

/// SwiGLU backward. With `σ = σ(gate[k])`:
///
/// - `dgate[k] = dout[k] · up[k] · σ · (1 + gate[k] · (1 − σ))` (the derivative of silu),
/// - `dup[k] = dout[k] · silu(gate[k])`.
///
/// Both are overwritten (`=`), not accumulated: gate and up are fresh outputs of their
/// projections, used only here. Evaluated in torch's order (`((dout·up)·σ)·(1 + g·(1−σ))`).
///
/// Shapes: all `[tokens, intermediate]`, equal lengths.
///
/// # Errors
/// Any argument not as long as `gate`.
pub fn swiglu_backward(
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> Result<()> {
    let n = gate.len();
    check_len("dout", n, dout.len())?;
    check_len("up", n, up.len())?;
    check_len("dgate", n, dgate.len())?;
    check_len("dup", n, dup.len())?;
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(dout.par_chunks(CHUNK))
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(((dg, du), dy), (g, u))| backward_chunk(dg, du, dy, g, u));
    Ok(())
}

/// [`swiglu_forward`] over `gate16`, `up16` stored in bf16 (bits, widened exactly), each
/// output rounded to the nearest bf16 (ties to even) into `out16`: the bits of
/// [`swiglu_forward`] over the widened inputs, rounded — the MLP's activations stored in
/// bf16.
///
/// # Errors
/// `up16` or `out16` not as long as `gate16`.
pub fn swiglu_forward_bf16(gate16: &[u16], up16: &[u16], out16: &mut [u16]) -> Result<()> {
    check_len("up", gate16.len(), up16.len())?;
    check_len("out", gate16.len(), out16.len())?;
    out16
        .par_chunks_mut(CHUNK)
        .zip(gate16.par_chunks(CHUNK).zip(up16.par_chunks(CHUNK)))
        .for_each(|(o16, (g16, u16))| {
            let (g, u) = (widened(g16), widened(u16));
            let mut o = vec![0.0f32; o16.len()];
            forward_chunk(&mut o, &g, &u);
            for (d, &x) in o16.iter_mut().zip(&o) {
                *d = Bf16Bits::narrow(x);
            }
        });
    Ok(())
}

/// [`swiglu_backward`] with `gate16`, `up16` stored in bf16 (the forward's inputs of
/// [`swiglu_forward_bf16`]): the bits of [`swiglu_backward`] over the widened values;
/// `dout`, `dgate`, `dup` f32, both gradients overwritten.
///
/// # Errors
/// Any argument not as long as `gate16`.
pub fn swiglu_backward_bf16(
    dout: &[f32],
    gate16: &[u16],
    up16: &[u16],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> Result<()> {
    let n = gate16.len();
    check_len("dout", n, dout.len())?;
    check_len("up", n, up16.len())?;
    check_len("dgate", n, dgate.len())?;
    check_len("dup", n, dup.len())?;
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(dout.par_chunks(CHUNK))
        .zip(gate16.par_chunks(CHUNK).zip(up16.par_chunks(CHUNK)))
        .for_each(|(((dg, du), dy), (g16, u16))| {
            backward_chunk(dg, du, dy, &widened(g16), &widened(u16));
        });
    Ok(())
}

/// bf16 bits widened to f32 (exact).
fn widened(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| Bf16Bits::widen(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_rng::Rng;

    fn silu64(g: f64) -> f64 {
        g / (1.0 + (-g).exp())
    }

    fn close(got: f32, want: f64, rel: f64, what: &str) {
        let tol = rel * want.abs().max(1.0);
        assert!(
            (f64::from(got) - want).abs() <= tol,
            "{what}: got {got}, want {want}"
        );
    }

    #[test]
    fn bf16_storage_is_the_f32_op_on_widened_values_rounded() {
        let mut rng = Rng(7);
        let n = 40_000; // several chunks
        let bf = |x: f32| half::bf16::from_f32(x).to_bits();
        let g16: Vec<u16> = rng.vec(n, 8.0).into_iter().map(bf).collect();
        let u16_: Vec<u16> = rng.vec(n, 3.0).into_iter().map(bf).collect();
        let (g, u) = (widened(&g16), widened(&u16_));
        let mut want = vec![0.0f32; n];
        swiglu_forward(&g, &u, &mut want).unwrap();
        let mut got = vec![0u16; n];
        swiglu_forward_bf16(&g16, &u16_, &mut got).unwrap();
        let want16: Vec<u16> = want.iter().map(|&x| bf(x)).collect();
        assert_eq!(got, want16);
        let dy = rng.vec(n, 1.0);
        let (mut dg, mut du) = (vec![0.0f32; n], vec![0.0f32; n]);
        swiglu_backward(&dy, &g, &u, &mut dg, &mut du).unwrap();
        let (mut dg16, mut du16) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        swiglu_backward_bf16(&dy, &g16, &u16_, &mut dg16, &mut du16).unwrap();
        assert_eq!(
            dg.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            dg16.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            du.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            du16.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(swiglu_forward_bf16(&g16, &u16_[1..], &mut got).is_err());
        assert!(swiglu_backward_bf16(&dy[1..], &g16, &u16_, &mut dg16, &mut du16).is_err());
    }

    #[test]
    fn hand_checked_values() {
        // silu(0) = 0; silu(1) = 1/(1 + e⁻¹) = 0.73105858; silu(−1) = −1/(1 + e) = −0.26894142;
        // silu(3) = 3/(1 + e⁻³) = 2.85772238. silu'(g) = σ(1 + g(1 − σ)):
        // 0.5, 0.92767051, 0.07232949, 1.08810411.
        let g = [0.0, 1.0, -1.0, 3.0];
        let up = [2.0, 2.0, -3.0, 0.5];
        let mut out = [f32::NAN; 4];
        swiglu_forward(&g, &up, &mut out).unwrap();
        let want = [
            0.0,
            2.0 * 0.7310585786,
            3.0 * 0.2689414214,
            0.5 * 2.8577223805,
        ];
        for i in 0..4 {
            close(out[i], want[i], 1e-6, "out");
        }
        let dy = [1.0, 1.0, 1.0, 2.0];
        let (mut dg, mut du) = ([f32::NAN; 4], [f32::NAN; 4]);
        swiglu_backward(&dy, &g, &up, &mut dg, &mut du).unwrap();
        let want_dg = [
            2.0 * 0.5,
            2.0 * 0.9276705119,
            -3.0 * 0.0723294881,
            1.0881041060,
        ];
        let want_du = [0.0, 0.7310585786, -0.2689414214, 2.0 * 2.8577223805];
        for i in 0..4 {
            close(dg[i], want_dg[i], 1e-6, "dgate");
            close(du[i], want_du[i], 1e-6, "dup");
        }
    }

    /// Every instruction-set path the CPU has gives the portable loop's bits (unfused
    /// multiplies and adds everywhere), over the full range of `g` and its special values.
    #[test]
    fn every_path_gives_the_same_bits() {
        let mut rng = Rng(12);
        let n = 1000;
        let mut g = rng.vec(n, 40.0);
        g.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            87.0,
            -87.0,
            -88.0,
            1e4,
            -1e4,
            f32::MAX,
            f32::MIN,
        ]);
        g.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        let n = g.len();
        let (up, dy) = (rng.vec(n, 2.0), rng.vec(n, 1.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let run = |fwd: &dyn Fn(&mut [f32]), bwd: &dyn Fn(&mut [f32], &mut [f32])| {
            let (mut o, mut dg, mut du) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            fwd(&mut o);
            bwd(&mut dg, &mut du);
            (bits(&o), bits(&dg), bits(&du))
        };
        let want = run(&|o| forward_portable(o, &g, &up), &|dg, du| {
            backward_portable(dg, du, &dy, &g, &up)
        });
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::detected() >= Isa::Avx2 {
                // SAFETY: the CPU has AVX2 and FMA.
                let got = run(&|o| unsafe { forward_avx2(o, &g, &up) }, &|dg, du| unsafe {
                    backward_avx2(dg, du, &dy, &g, &up)
                });
                assert!(got == want, "avx2");
            }
            if Isa::detected() >= Isa::Avx512 {
                // SAFETY: the CPU has AVX-512F.
                let got = run(
                    &|o| unsafe { forward_avx512(o, &g, &up) },
                    &|dg, du| unsafe { backward_avx512(dg, du, &dy, &g, &up) },
                );
                assert!(got == want, "avx512");
            }
        }
        // and the special values as the module docs say
        let mut o = vec![0.0; 3];
        forward_portable(
            &mut o,
            &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
            &[1.0; 3],
        );
        assert_eq!(o[0], f32::INFINITY);
        assert!(o[1].is_nan() && o[2].is_nan(), "{o:?}");
    }

    #[test]
    fn large_magnitudes_stay_finite() {
        let g = [-1e4, -100.0, -88.0, 88.0, 100.0, 1e4, f32::MAX, f32::MIN];
        let up = [1.0; 8];
        let mut out = [f32::NAN; 8];
        swiglu_forward(&g, &up, &mut out).unwrap();
        let (mut dg, mut du) = ([f32::NAN; 8], [f32::NAN; 8]);
        swiglu_backward(&[1.0; 8], &g, &up, &mut dg, &mut du).unwrap();
        for i in 0..8 {
            assert!(out[i].is_finite() && dg[i].is_finite(), "g = {}", g[i]);
        }
        // Very negative: silu → −0, silu' → 0; very positive: silu → g, silu' → 1.
        assert!(out[0] == 0.0 && out[1].abs() < 1e-30 && dg[0] == 0.0);
        assert_eq!((out[5], dg[5]), (1e4, 1.0));
        assert_eq!((out[6], dg[6], out[7]), (f32::MAX, 1.0, 0.0));
    }

    #[test]
    fn matches_f64_reference_on_odd_sizes() {
        let mut rng = Rng(9);
        let n = 7 * 45;
        let g = rng.vec(n, 8.0);
        let up = rng.vec(n, 2.0);
        let mut out = vec![f32::NAN; n];
        swiglu_forward(&g, &up, &mut out).unwrap();
        for i in 0..n {
            let want = silu64(f64::from(g[i])) * f64::from(up[i]);
            close(out[i], want, 1e-6, &format!("out[{i}]"));
        }
    }

    #[test]
    fn parallel_chunks_match_serial() {
        // Longer than one rayon chunk, with a ragged tail.
        let mut rng = Rng(10);
        let n = 2 * CHUNK + 17;
        let (g, up, dy) = (rng.vec(n, 6.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let mut out = vec![0.0; n];
        swiglu_forward(&g, &up, &mut out).unwrap();
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu_backward(&dy, &g, &up, &mut dg, &mut du).unwrap();
        for i in (0..n).step_by(101).chain([n - 1]) {
            assert_eq!(out[i], silu(g[i]) * up[i]);
            assert_eq!(du[i], dy[i] * silu(g[i]));
            let s = sigmoid_silu(g[i]).0;
            assert_eq!(dg[i], ((dy[i] * up[i]) * s) * (1.0 + g[i] * (1.0 - s)));
        }
    }

    /// Central differences of `L = Σ c·out`, through the f64 reference (every coordinate,
    /// tight) and through the f32 op (a few coordinates, coarse).
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(11);
        let n = 3 * 13;
        let g = rng.vec(n, 6.0);
        let up = rng.vec(n, 2.0);
        let c = rng.vec(n, 1.0);
        let (mut dg, mut du) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        swiglu_backward(&c, &g, &up, &mut dg, &mut du).unwrap();
        let h = 1e-6;
        for i in 0..n {
            // L depends on (g[i], up[i]) only through c[i]·silu(g[i])·up[i].
            let (gi, ui, ci) = (f64::from(g[i]), f64::from(up[i]), f64::from(c[i]));
            let l = |g: f64, u: f64| ci * silu64(g) * u;
            let want_dg = (l(gi + h, ui) - l(gi - h, ui)) / (2.0 * h);
            let want_du = (l(gi, ui + h) - l(gi, ui - h)) / (2.0 * h);
            close(dg[i], want_dg, 1e-5, &format!("dgate[{i}]"));
            close(du[i], want_du, 1e-5, &format!("dup[{i}]"));
        }
        let loss = |g: &[f32], u: &[f32]| -> f64 {
            let mut o = vec![0.0; n];
            swiglu_forward(g, u, &mut o).unwrap();
            o.iter()
                .zip(&c)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        let hf = 1e-2f32;
        for i in [0, 7, 20, 38] {
            let (mut p, mut m) = (g.clone(), g.clone());
            p[i] += hf;
            m[i] -= hf;
            let want = (loss(&p, &up) - loss(&m, &up)) / f64::from(p[i] - m[i]);
            close(dg[i], want, 3e-3, &format!("f32 dgate[{i}]"));
            let (mut p, mut m) = (up.clone(), up.clone());
            p[i] += hf;
            m[i] -= hf;
            let want = (loss(&g, &p) - loss(&g, &m)) / f64::from(p[i] - m[i]);
            close(du[i], want, 3e-3, &format!("f32 dup[{i}]"));
        }
    }

    #[test]
    fn rejects_length_mismatches() {
        use ares_core::Error as E;
        let a = [0.0f32; 4];
        let mut o = [0.0f32; 4];
        let mut o2 = [0.0f32; 4];
        let mismatch = |what, actual| {
            Err::<(), _>(crate::Error::Core(E::LengthMismatch {
                what,
                expected: 4,
                actual,
            }))
        };
        assert_eq!(swiglu_forward(&a, &a[..3], &mut o), mismatch("up", 3));
        assert_eq!(swiglu_forward(&a, &a, &mut o[..2]), mismatch("out", 2));
        assert_eq!(
            swiglu_backward(&a[..1], &a, &a, &mut o, &mut o2),
            mismatch("dout", 1)
        );
        assert_eq!(
            swiglu_backward(&a, &a, &a, &mut o[..3], &mut o2),
            mismatch("dgate", 3)
        );
        assert_eq!(
            swiglu_backward(&a, &a, &a, &mut o, &mut o2[..0]),
            mismatch("dup", 0)
        );
        assert!(swiglu_forward(&[], &[], &mut []).is_ok());
    }
}
