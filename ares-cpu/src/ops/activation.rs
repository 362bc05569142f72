//! The GELU-family activations of the Qwen2-VL / Qwen2.5-VL vision tower, element-wise,
//! forward and backward:
//!
//! - [`Activation::GeluErf`], torch's exact `nn.GELU()`: `gelu(x) = x·Φ(x)`,
//!   `Φ(x) = ½·(1 + erf(x/√2)) = ½·erfc(−x/√2)` (the patch merger's MLP);
//! - [`Activation::QuickGelu`]: `x·σ(1.702·x)` (Qwen2-VL's vision MLP, `hidden_act:
//!   "quick_gelu"`);
//! - [`Activation::GeluTanh`]: `½·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`
//!   (`"gelu_pytorch_tanh"`).
//!
//! Numerics: each element is evaluated in f64 from its f32 input and rounded once, so the
//! results are within about an ulp of the exact values (and of torch's f32 results to
//! ~1e-6 relative). The forms avoid cancellation: `Φ(x)` as `½·erfc(−x/√2)` (no `1 + erf`
//! near 0 for negative x), `½·(1 + tanh(u))` as `σ(2u)`, and `σ(z)`, `1 − σ(z)` each from
//! a stable form, so the tails of all three are accurate, not just absolutely small.
//!
//! Edge cases: finite inputs give finite outputs and gradients. Non-finite inputs are not
//! rejected (checking would cost a pass); they follow the formulas: `+∞ → +∞`, `−∞ → NaN`
//! (`−∞·0`, as torch's formulas give), NaN → NaN; gradients at ±∞ are NaN or 0·dout.

use crate::Result;
use crate::error::check_len;
use rayon::prelude::*;

/// Elements per rayon task: element-wise work only pays for threads in bulk.
const CHUNK: usize = 1 << 13;

/// An activation of the vision tower (module docs for the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// torch's exact GELU: `x·Φ(x) = ½·x·(1 + erf(x/√2))`.
    GeluErf,
    /// QuickGELU: `x·σ(1.702·x)`.
    QuickGelu,
    /// GELU, tanh approximation: `½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
}

/// QuickGELU's slope.
const QUICK: f64 = 1.702;
/// √(2/π).
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const TANH_CUBIC: f64 = 0.044_715;
/// 1/√(2π).
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `(σ(z), σ(−z)) = (σ(z), 1 − σ(z))`, both without cancellation or overflow.
#[inline]
fn sigmoid_pair(z: f64) -> (f64, f64) {
    if z >= 0.0 {
        let e = (-z).exp();
        let inv = 1.0 / (1.0 + e);
        (inv, e * inv)
    } else {
        let e = z.exp();
        let inv = 1.0 / (1.0 + e);
        (e * inv, inv)
    }
}

impl Activation {
    /// `act(x)` in f64.
    #[inline]
    pub fn value(self, x: f64) -> f64 {
        match self {
            Activation::GeluErf => x * 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2),
            Activation::QuickGelu => x * sigmoid_pair(QUICK * x).0,
            Activation::GeluTanh => {
                let u = SQRT_2_OVER_PI * (x + TANH_CUBIC * x * x * x);
                x * sigmoid_pair(2.0 * u).0
            }
        }
    }

    /// `act'(x)` in f64.
    #[inline]
    pub fn derivative(self, x: f64) -> f64 {
        match self {
            Activation::GeluErf => {
                // Φ(x) + x·φ(x).
                let cdf = 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
                cdf + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
            }
            Activation::QuickGelu => {
                let (s, sm) = sigmoid_pair(QUICK * x);
                s + QUICK * x * s * sm
            }
            Activation::GeluTanh => {
                // d/dx [x·σ(2u)] = σ(2u) + x·σ(2u)·σ(−2u)·2u'.
                let u = SQRT_2_OVER_PI * (x + TANH_CUBIC * x * x * x);
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * x * x);
                let (s, sm) = sigmoid_pair(2.0 * u);
                s + x * s * sm * 2.0 * du
            }
        }
    }
}

/// Activation forward: `out[k] = act(x[k])` (formulas in the module docs).
///
/// Shapes: `x`, `out` of equal length (any layout: the op is element-wise). Large inputs
/// run in parallel.
///
/// # Errors
/// `out` not as long as `x`.
pub fn activation_forward(kind: Activation, x: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("out", x.len(), out.len())?;
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = kind.value(f64::from(x)) as f32;
            }
        });
    Ok(())
}

/// Activation backward: `dx[k] = dout[k] · act'(x[k])`, **overwriting** `dx` (the
/// activation's input feeds it alone). `act'` is evaluated in f64 and the product rounded
/// once.
///
/// # Errors
/// `x` or `dx` not as long as `dout`.
pub fn activation_backward(
    kind: Activation,
    dout: &[f32],
    x: &[f32],
    dx: &mut [f32],
) -> Result<()> {
    check_len("x", dout.len(), x.len())?;
    check_len("dx", dout.len(), dx.len())?;
    dx.par_chunks_mut(CHUNK)
        .zip(dout.par_chunks(CHUNK).zip(x.par_chunks(CHUNK)))
        .for_each(|(dx, (dy, x))| {
            for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
                *dx = (f64::from(dy) * kind.derivative(f64::from(x))) as f32;
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    const ALL: [Activation; 3] = [
        Activation::GeluErf,
        Activation::QuickGelu,
        Activation::GeluTanh,
    ];

    fn close(got: f32, want: f64, rel: f64, what: &str) {
        let tol = rel * want.abs().max(1.0);
        assert!(
            (f64::from(got) - want).abs() <= tol,
            "{what}: got {got}, want {want}"
        );
    }

    fn fwd(kind: Activation, x: &[f32]) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len()];
        activation_forward(kind, x, &mut out).unwrap();
        out
    }

    #[test]
    fn hand_checked_values() {
        // GeluErf: Φ(1) = 0.841344746, Φ(−1) = 0.158655254, Φ(2) = 0.977249868,
        // Φ(−3) = 0.001349898 → x·Φ(x).
        let x = [0.0, 1.0, -1.0, 2.0, -3.0];
        let want_erf = [
            0.0,
            0.841_344_746_068_543,
            -0.158_655_253_931_457,
            1.954_499_736_103_642,
            -0.004_049_694_094_890,
        ];
        // QuickGelu: σ(1.702) = 0.845795766, σ(−1.702) = 0.154204234,
        // σ(3.404) = 0.967829312, σ(−5.106) = 0.006023770 → x·σ(1.702·x).
        let want_quick = [
            0.0,
            0.845_795_765_932_821,
            -0.154_204_234_067_179,
            1.935_658_623_144_208,
            -0.018_071_309_707_786,
        ];
        // GeluTanh: u(1) = 0.7978846·1.044715 = 0.8335620, ½(1 + tanh u) = 0.8411920;
        // u(2) = 0.7978846·2.35772 = 1.8811884, ½(1 + tanh u) = 0.9772988;
        // u(−3) = −0.7978846·4.207305 = −3.3569437, ½(1 + tanh u) = 0.0012125.
        let want_tanh = [
            0.0,
            0.841_191_990,
            -0.158_808_010,
            1.954_597_694,
            -0.003_637_392,
        ];
        for (kind, want) in [
            (Activation::GeluErf, want_erf),
            (Activation::QuickGelu, want_quick),
            (Activation::GeluTanh, want_tanh),
        ] {
            let got = fwd(kind, &x);
            // f32 rounding of the exact values: within 1e-7 relative.
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                close(g, w, 1e-7, &format!("{kind:?}({})", x[i]));
            }
            // act(0) = 0 exactly; act'(0) = ½ for all three.
            assert_eq!(got[0], 0.0);
            assert_eq!(kind.derivative(0.0), 0.5);
        }
    }

    #[test]
    fn tails_are_relatively_accurate_and_infinities_follow_the_formulas() {
        // Far left: x·Φ(x) with Φ(−6) = 9.8658765e−10: no cancellation in 1 + erf.
        let got = fwd(Activation::GeluErf, &[-6.0])[0];
        close(got / -6.0, 9.865_876_450_377e-10, 1e-6 * 9.87e-10, "Φ(−6)");
        for kind in ALL {
            let got = fwd(
                kind,
                &[-200.0, 200.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
            );
            assert_eq!(got[0], 0.0, "{kind:?}(−200)");
            assert_eq!(got[1], 200.0, "{kind:?}(200)");
            assert_eq!(got[2], f32::INFINITY, "{kind:?}(+inf)");
            assert!(got[3].is_nan() && got[4].is_nan(), "{kind:?}: {got:?}");
            let mut dx = [f32::NAN; 2];
            activation_backward(kind, &[1.0, 1.0], &[-200.0, 200.0], &mut dx).unwrap();
            assert_eq!(dx, [0.0, 1.0], "{kind:?}' at ∓200");
        }
    }

    #[test]
    fn backward_matches_finite_differences_and_overwrites() {
        let mut rng = Rng(11);
        let n = 3000;
        let x: Vec<f32> = rng.vec(n, 6.0);
        let dout = rng.vec(n, 2.0);
        for kind in ALL {
            let mut dx = vec![123.0f32; n];
            activation_backward(kind, &dout, &x, &mut dx).unwrap();
            let h = 1e-5;
            for i in (0..n).step_by(7) {
                let xi = f64::from(x[i]);
                let g = (kind.value(xi + h) - kind.value(xi - h)) / (2.0 * h);
                close(
                    dx[i],
                    f64::from(dout[i]) * g,
                    1e-6,
                    &format!("{kind:?}'[{i}]"),
                );
            }
            // Finite differences of the f32 op itself, on a few points.
            for &xi in &[-2.5f32, -0.3, 0.7, 1.9] {
                let h = 1e-2f32;
                let (p, m) = (fwd(kind, &[xi + h])[0], fwd(kind, &[xi - h])[0]);
                let g = f64::from(p - m) / f64::from((xi + h) - (xi - h));
                let mut d = [0.0f32];
                activation_backward(kind, &[1.0], &[xi], &mut d).unwrap();
                close(d[0], g, 2e-4, &format!("{kind:?}' f32 at {xi}"));
            }
        }
    }

    #[test]
    fn large_inputs_match_elementwise_evaluation() {
        let mut rng = Rng(12);
        let x = rng.vec(50_000, 8.0);
        for kind in ALL {
            let out = fwd(kind, &x);
            for (i, (&o, &xi)) in out.iter().zip(&x).enumerate().step_by(101) {
                assert_eq!(o, kind.value(f64::from(xi)) as f32, "{kind:?}[{i}]");
            }
        }
    }

    #[test]
    fn rejects_length_mismatches() {
        use ares_core::Error as E;
        let err = |what, expected, actual| {
            Err::<(), _>(crate::Error::Core(E::LengthMismatch {
                what,
                expected,
                actual,
            }))
        };
        let mut out = [0.0f32; 2];
        assert_eq!(
            activation_forward(Activation::GeluErf, &[1.0; 3], &mut out),
            err("out", 3, 2)
        );
        assert_eq!(
            activation_backward(Activation::QuickGelu, &[1.0; 2], &[1.0; 3], &mut out),
            err("x", 2, 3)
        );
        assert_eq!(
            activation_backward(Activation::GeluTanh, &[1.0; 3], &[1.0; 3], &mut out),
            err("dx", 3, 2)
        );
        assert!(activation_forward(Activation::GeluTanh, &[], &mut []).is_ok());
    }
}
