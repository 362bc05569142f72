//! Backward of the per-token log-prob: the gradient of a loss that depends on the logits
//! only through `logπ_t = log softmax(x_t / T)[y_t]`, fused over the rows of the logits.
//!
//! With `z = x / T`, `p = softmax(z)` and `g_t = ∂L/∂logπ_t` (the caller's per-token
//! coefficient, e.g. `−A_t·ratio_t / n` of a policy-gradient loss):
//!
//! ```text
//! ∂logπ_t/∂x_t,v = (1/T)·([v = y_t] − p_v)
//! ∂L/∂x_t,v      = (g_t/T)·([v = y_t] − p_v)
//! ```
//!
//! so no `[rows, vocab]` log-softmax is kept between the forward and the backward pass: the
//! row is read once for its max, once for `Σ e^{z−max}` (the exponentials are written into
//! the output as they are computed), and the output is scaled in place. The exponentials use
//! the same base-2 scaling as [`crate::log_prob_entropy`], so the probabilities are the ones
//! its log-probs come from.
//!
//! Rows with `g_t = 0` (tokens the loss ignores: prompt, padding) are zero and their logits
//! are not read, so meaningless logits at padding positions never raise an error.

use crate::error::{Error, Result, check_len, product};
use crate::exp::{EXP2_UNDERFLOW, exp2_nonpositive, scaled_row_max};
use crate::isa::Isa;
use ares_core::Error as CoreError;
use rayon::prelude::*;

const LOG2E: f32 = core::f32::consts::LOG2_E;
/// Accumulator slots of the inner loops (the vectoriser maps them onto SIMD lanes).
const LANES: usize = 16;

/// Writes `dlogits[r, :] = coeffs[r]/T · (onehot(targets[r]) − softmax(logits[r, :]/T))`
/// for every row `r` of `logits` `[rows, vocab]` (rows = `targets.len()`), overwriting
/// `dlogits`. Rows run in parallel (rayon); no temporary beyond the output.
///
/// # Errors
/// - `OutOfRange` for `vocab == 0` or a temperature not finite and > 0;
/// - `LengthMismatch` for `logits`/`dlogits` not `rows · vocab` or `coeffs` not `rows` long;
/// - `NonFinite` for `coeffs` at the first NaN or ±∞ (checked before anything is written);
/// - [`Error::TargetOutOfRange`] for a target `>= vocab` of a row with a nonzero coefficient;
/// - [`Error::BadLogitsRow`] for a row with a nonzero coefficient holding NaN or +∞, or −∞
///   everywhere; [`Error::ImpossibleTarget`] when its target's logit is −∞ (log-prob −∞).
///
/// On a row error the other rows may already be written.
pub fn log_prob_backward(
    logits: &[f32],
    vocab: usize,
    temperature: f32,
    targets: &[u32],
    coeffs: &[f32],
    dlogits: &mut [f32],
) -> Result<()> {
    let rows = targets.len();
    check_len("coeffs", rows, coeffs.len())?;
    let inv_t = check_head_backward(logits, vocab, temperature, coeffs, dlogits)?;
    logits
        .par_chunks_exact(vocab)
        .zip(dlogits.par_chunks_exact_mut(vocab))
        .zip(targets.par_iter().zip(coeffs.par_iter()))
        .enumerate()
        .try_for_each(|(r, ((x, out), (&id, &c)))| {
            if c == 0.0 {
                out.fill(0.0);
                return Ok(());
            }
            let target = id as usize;
            if target >= vocab {
                return Err(Error::TargetOutOfRange { row: r, id, vocab });
            }
            match row_grad(x, out, inv_t, target, c * inv_t) {
                RowOutcome::Ok => Ok(()),
                RowOutcome::Bad => Err(Error::BadLogitsRow { row: r }),
                RowOutcome::Impossible => Err(Error::ImpossibleTarget { row: r, id }),
            }
        })
}

/// The checks of a loss-head backward over `coeffs.len()` rows of `logits` `[rows, vocab]`
/// (shared by [`log_prob_backward`] and the entropy backward): `vocab ≥ 1`, a temperature
/// finite and > 0 whose inverse is finite, `logits` and `dlogits` of `rows · vocab`, finite
/// coefficients. Returns `1/temperature`.
pub(crate) fn check_head_backward(
    logits: &[f32],
    vocab: usize,
    temperature: f32,
    coeffs: &[f32],
    dlogits: &[f32],
) -> Result<f32> {
    if vocab == 0 {
        return Err(CoreError::OutOfRange {
            what: "vocab",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    let inv_t = 1.0 / temperature;
    if !(temperature.is_finite() && temperature > 0.0 && inv_t.is_finite()) {
        return Err(CoreError::OutOfRange {
            what: "temperature",
            value: f64::from(temperature),
            expected: "finite and > 0",
        }
        .into());
    }
    let len = product(coeffs.len(), vocab)?;
    check_len("logits", len, logits.len())?;
    check_len("dlogits", len, dlogits.len())?;
    if let Some(index) = coeffs.iter().position(|c| !c.is_finite()) {
        return Err(CoreError::NonFinite {
            what: "coeffs",
            index,
        }
        .into());
    }
    Ok(inv_t)
}

/// How one row went.
enum RowOutcome {
    Ok,
    /// NaN or +∞ in the row, or −∞ everywhere.
    Bad,
    /// The target's logit is −∞.
    Impossible,
}

/// One row: `out = g·(onehot(target) − softmax(x·inv_t))`. Picks the widest SIMD the CPU
/// has at run time; every variant runs the same code.
fn row_grad(x: &[f32], out: &mut [f32], inv_t: f32, target: usize, g: f32) -> RowOutcome {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { row_grad_avx512(x, out, inv_t, target, g) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { row_grad_avx2(x, out, inv_t, target, g) },
        _ => row_grad_portable::<false>(x, out, inv_t, target, g),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn row_grad_avx512(x: &[f32], out: &mut [f32], inv_t: f32, target: usize, g: f32) -> RowOutcome {
    row_grad_portable::<true>(x, out, inv_t, target, g)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_grad_avx2(x: &[f32], out: &mut [f32], inv_t: f32, target: usize, g: f32) -> RowOutcome {
    row_grad_portable::<true>(x, out, inv_t, target, g)
}

#[inline(always)]
fn row_grad_portable<const FMA: bool>(
    x: &[f32],
    out: &mut [f32],
    inv_t: f32,
    target: usize,
    g: f32,
) -> RowOutcome {
    // Base 2: y = x·(log₂e/T), so e^{z−max z} = 2^{y−max y} with an exact range reduction.
    let scale = inv_t * LOG2E;
    let Some(m) = scaled_row_max(x, scale) else {
        return RowOutcome::Bad;
    };
    if x.get(target).is_none_or(|&v| v == f32::NEG_INFINITY) {
        return RowOutcome::Impossible;
    }

    // e_v = 2^{y_v − m} into `out`, summed per lane in f32 and per chunk of 1024 in f64.
    let mut total = 0.0f64;
    for (xb, ob) in x.chunks(1024).zip(out.chunks_mut(1024)) {
        let mut acc = [0.0f32; LANES];
        let mut xc = xb.chunks_exact(LANES);
        let mut oc = ob.chunks_exact_mut(LANES);
        for (xs, os) in (&mut xc).zip(&mut oc) {
            for ((&v, o), a) in xs.iter().zip(os.iter_mut()).zip(&mut acc) {
                // Clamped so a −∞ logit gives 2^(−127) → 0, never NaN.
                let e = exp2_nonpositive::<FMA>((v * scale - m).max(EXP2_UNDERFLOW - 1.0));
                *o = e;
                *a += e;
            }
        }
        for ((&v, o), a) in xc
            .remainder()
            .iter()
            .zip(oc.into_remainder().iter_mut())
            .zip(&mut acc)
        {
            let e = exp2_nonpositive::<FMA>((v * scale - m).max(EXP2_UNDERFLOW - 1.0));
            *o = e;
            *a += e;
        }
        total += acc.iter().map(|&a| f64::from(a)).sum::<f64>();
    }
    // out_v = −g·p_v, then the one-hot term.
    let k = (-f64::from(g) / total) as f32;
    for o in out.iter_mut() {
        *o *= k;
    }
    if let Some(o) = out.get_mut(target) {
        *o += g;
    }
    RowOutcome::Ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_prob_entropy;
    use crate::logits::Logits;
    use crate::test_rng::Rng;

    /// `g/T · (onehot − softmax(x/T))` in f64.
    fn reference(x: &[f32], t: f32, target: usize, c: f32) -> Vec<f64> {
        let z: Vec<f64> = x.iter().map(|&v| f64::from(v) / f64::from(t)).collect();
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|&v| (v - m).exp()).sum();
        let g = f64::from(c) / f64::from(t);
        z.iter()
            .enumerate()
            .map(|(v, &zv)| g * (f64::from(u8::from(v == target)) - (zv - m).exp() / s))
            .collect()
    }

    #[test]
    fn hand_checked_values() {
        // softmax(1, 2, 3) = (0.09003057, 0.24472847, 0.66524096).
        let x = [1.0f32, 2.0, 3.0];
        let mut out = [f32::NAN; 3];
        log_prob_backward(&x, 3, 1.0, &[2], &[1.0], &mut out).unwrap();
        let want = [-0.090_030_57, -0.244_728_47, 0.334_759_04];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{out:?}");
        }
        // T = 2, coefficient 3: z = (0.5, 1, 1.5), softmax = (0.18632372, 0.30719589,
        // 0.50648039), scale 3/2, target 0.
        log_prob_backward(&x, 3, 2.0, &[0], &[3.0], &mut out).unwrap();
        let want = [
            1.5 * (1.0 - 0.186_323_72_f64),
            -1.5 * 0.307_195_89,
            -1.5 * 0.506_480_39,
        ];
        for (o, w) in out.iter().zip(want) {
            assert!((f64::from(*o) - w).abs() < 1e-6, "{out:?}");
        }
        // A row sums to zero (one-hot and probabilities both sum to 1).
        assert!(out.iter().sum::<f32>().abs() < 1e-6);
    }

    #[test]
    fn matches_f64_on_random_rows() {
        let mut rng = Rng(7);
        for (rows, vocab) in [(3, 1), (5, 17), (4, 1000), (2, 5000)] {
            let x = rng.vec(rows * vocab, 8.0);
            let targets: Vec<u32> = (0..rows).map(|r| ((r * 31 + 5) % vocab) as u32).collect();
            let coeffs: Vec<f32> = (0..rows).map(|r| [0.7, -1.3, 0.0, 2.0][r % 4]).collect();
            for t in [1.0f32, 0.6, 1.7] {
                let mut out = vec![f32::NAN; rows * vocab];
                log_prob_backward(&x, vocab, t, &targets, &coeffs, &mut out).unwrap();
                for r in 0..rows {
                    let want = reference(
                        &x[r * vocab..(r + 1) * vocab],
                        t,
                        targets[r] as usize,
                        coeffs[r],
                    );
                    for (o, w) in out[r * vocab..(r + 1) * vocab].iter().zip(&want) {
                        assert!((f64::from(*o) - w).abs() < 2e-6, "{rows}x{vocab} T {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn is_the_derivative_of_the_log_prob() {
        // Central differences of c·logπ computed by the forward kernel.
        let mut rng = Rng(11);
        let vocab = 40;
        let x = rng.vec(vocab, 3.0);
        let (t, c, target) = (0.8f32, -1.7f32, 13u32);
        let mut out = vec![0.0; vocab];
        log_prob_backward(&x, vocab, t, &[target], &[c], &mut out).unwrap();
        let lp = |x: &[f32]| {
            let mut lp = [0.0f32];
            let mut h = [0.0f32];
            log_prob_entropy(Logits::F32(x), vocab, t, Some((&[target], &mut lp)), &mut h).unwrap();
            f64::from(lp[0])
        };
        for v in [0, 13, 27] {
            let h = 1e-2f32;
            let (mut a, mut b) = (x.clone(), x.clone());
            a[v] += h;
            b[v] -= h;
            let numeric = f64::from(c) * (lp(&a) - lp(&b)) / (2.0 * f64::from(h));
            let got = f64::from(out[v]);
            assert!((numeric - got).abs() < 1e-3, "v {v}: {got} vs {numeric}");
        }
    }

    #[test]
    fn ignored_rows_are_zero_and_not_read() {
        let x = [f32::NAN, 1.0, 2.0, 0.5];
        let mut out = [7.0f32; 4];
        log_prob_backward(&x, 2, 1.0, &[9, 0], &[0.0, 1.0], &mut out).unwrap();
        assert_eq!(out[..2], [0.0, 0.0]);
        assert!(out[2] > 0.0 && out[3] < 0.0);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let x = [0.0f32, 1.0, 2.0, 3.0];
        let mut out = [0.0f32; 4];
        let run = |x: &[f32], t: f32, ids: &[u32], c: &[f32], out: &mut [f32]| {
            log_prob_backward(x, 2, t, ids, c, out)
        };
        assert!(run(&x, 0.0, &[0, 0], &[1.0, 1.0], &mut out).is_err());
        assert!(run(&x, f32::NAN, &[0, 0], &[1.0, 1.0], &mut out).is_err());
        assert!(run(&x, 1.0, &[0], &[1.0], &mut out).is_err());
        assert!(run(&x, 1.0, &[0, 0], &[1.0], &mut out).is_err());
        assert!(run(&x, 1.0, &[0, 0], &[1.0, 1.0], &mut out[..3]).is_err());
        assert!(matches!(
            run(&x, 1.0, &[0, 0], &[1.0, f32::INFINITY], &mut out),
            Err(Error::Core(CoreError::NonFinite {
                what: "coeffs",
                index: 1
            }))
        ));
        assert_eq!(
            run(&x, 1.0, &[0, 2], &[1.0, 1.0], &mut out),
            Err(Error::TargetOutOfRange {
                row: 1,
                id: 2,
                vocab: 2
            })
        );
        let nan = [0.0f32, 1.0, f32::NAN, 3.0];
        assert_eq!(
            run(&nan, 1.0, &[0, 0], &[1.0, 1.0], &mut out),
            Err(Error::BadLogitsRow { row: 1 })
        );
        let inf = [f32::NEG_INFINITY, 1.0, 2.0, 3.0];
        assert_eq!(
            run(&inf, 1.0, &[0, 0], &[1.0, 1.0], &mut out),
            Err(Error::ImpossibleTarget { row: 0, id: 0 })
        );
        // −∞ elsewhere is a probability of 0.
        run(&inf, 1.0, &[1, 1], &[1.0, 1.0], &mut out).unwrap();
        assert_eq!(out[..2], [0.0, 0.0]);
        assert!(log_prob_backward(&x, 0, 1.0, &[], &[], &mut []).is_err());
    }
}
