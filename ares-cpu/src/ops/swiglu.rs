//! SwiGLU, the gated activation of the Qwen2/Qwen3/Llama MLP
//! (`down_proj(silu(gate_proj(x)) * up_proj(x))`): element-wise on `[tokens, intermediate]`,
//!
//! `out = silu(gate) · up`, `silu(g) = g · σ(g) = g / (1 + e^(−g))`.
//!
//! `g / (1 + e^(−g))` is the form torch evaluates in f32, and it is already stable: for very
//! negative `g`, `e^(−g)` overflows to +∞ and the quotient is −0 (no ∞/∞); for very
//! positive `g`, `e^(−g)` underflows to 0 and the result is `g`.

use crate::Result;
use crate::error::check_len;
use rayon::prelude::*;

/// Elements per rayon task: element-wise work this cheap only pays for threads in bulk.
const CHUNK: usize = 1 << 14;

/// `1 / (1 + e^(−g))` in f32; 0 (not NaN) for very negative `g`.
#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `silu(g) = g / (1 + e^(−g))` in f32, as torch computes it.
#[inline(always)]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
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
        .for_each(|(o, (g, u))| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(g) * u;
            }
        });
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
        .for_each(|(((dg, du), dy), (g, u))| {
            for ((((dg, du), &dy), &g), &u) in dg.iter_mut().zip(du).zip(dy).zip(g).zip(u) {
                let s = sigmoid(g);
                *dg = ((dy * u) * s) * (1.0 + g * (1.0 - s));
                *du = dy * silu(g);
            }
        });
    Ok(())
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
            let s = sigmoid(g[i]);
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
