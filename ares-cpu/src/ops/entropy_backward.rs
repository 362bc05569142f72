//! Backward of the per-token entropy: the gradient of a loss that depends on the logits
//! through `H_t = −Σ_v p_v ln p_v` of `p = softmax(x_t / T)` (an entropy bonus
//! `L = −c·agg(H_t)`, docs/algorithms.md §16), fused over the rows of the logits.
//!
//! With `z = x / T`, `p = softmax(z)` and `g_t = ∂L/∂H_t` (the caller's per-token
//! coefficient):
//!
//! ```text
//! ∂H_t/∂x_t,v = −p_v·(ln p_v + H_t) / T
//! ∂L/∂x_t,v  += g_t · ∂H_t/∂x_t,v
//! ```
//!
//! (the formula of [`ares_core::entropy_bonus::entropy_grad_logits`], which is the reference).
//! It is **added** to the gradient buffer because it runs after the log-prob backward, which
//! overwrote it. In base 2, with `y = x·log₂e/T`, `d_v = y_v − max y` and `S = Σ 2^{d_v}`:
//! `ln p_v + H = ln 2·(d_v − d̄)` where `d̄ = Σ 2^{d_v}·d_v / S` is the mean of `d` under `p`,
//! so a row is read three times — its max (and a NaN/+∞ check), then `S` and `Σ 2^d·d`, then
//! the update recomputing `2^d` — and nothing is allocated. The exponentials use the same
//! base-2 scaling as [`crate::log_prob_entropy`], so the probabilities are the ones its
//! entropies come from.
//!
//! Edge cases: a −∞ logit (probability 0) gets gradient 0; a row with one finite logit or
//! equal logits has `H` at its extreme and gradient 0. Rows with `g_t = 0` (tokens the loss
//! ignores: prompt, padding) are left as they are and their logits are not read, so
//! meaningless logits at padding positions never raise an error.

use super::log_prob_backward::check_head_backward;
use crate::error::{Error, Result};
use crate::exp::{EXP2_UNDERFLOW, exp2_nonpositive, scaled_row_max};
use crate::isa::Isa;
use ares_core::Error as CoreError;
use rayon::prelude::*;

const LOG2E: f32 = core::f32::consts::LOG2_E;
const LN2: f64 = core::f64::consts::LN_2;
/// Accumulator slots of the inner loops (the vectoriser maps them onto SIMD lanes).
const LANES: usize = 16;
/// Elements per block of f32 sums before they are added into the f64 totals.
const BLOCK: usize = 1024;
/// `d` is clamped here (below the underflow of `2^d`): a −∞ logit then contributes
/// `0·finite = 0` to every sum and to its gradient instead of `0·(−∞) = NaN`.
const D_FLOOR: f32 = EXP2_UNDERFLOW - 1.0;

/// Adds `coeffs[r] · ∂H_r/∂logits[r, :]` to `dlogits[r, :]`, where `H_r` is the entropy of
/// `softmax(logits[r, :] / temperature)` and `∂H/∂x_v = −p_v·(ln p_v + H)/T`, for every row
/// `r` of `logits` `[rows, vocab]` (rows = `coeffs.len()`). **Accumulates** into `dlogits`;
/// rows with `coeffs[r] = 0` are untouched and their logits are not read. A −∞ logit gets 0.
/// Rows run in parallel (rayon); no temporary beyond the output.
///
/// # Errors
/// - `OutOfRange` for `vocab == 0` or a temperature not finite and > 0;
/// - `LengthMismatch` for `logits`/`dlogits` not `rows · vocab` or `coeffs` not `rows` long;
/// - `NonFinite` for `coeffs` at the first NaN or ±∞ (checked before anything is written);
/// - [`Error::BadLogitsRow`] for a row with a nonzero coefficient holding NaN or +∞, or −∞
///   everywhere;
/// - `NonFinite` on `"entropy gradient"` (index: the row) when `coeffs[r]/T` is so large
///   (a subnormal-scale temperature) that the row's gradient would overflow f32; that row
///   is left unchanged.
///
/// On a row error the other rows may already be updated.
pub fn entropy_backward(
    logits: &[f32],
    vocab: usize,
    temperature: f32,
    coeffs: &[f32],
    dlogits: &mut [f32],
) -> Result<()> {
    let inv_t = check_head_backward(logits, vocab, temperature, coeffs, dlogits)?;
    logits
        .par_chunks_exact(vocab)
        .zip(dlogits.par_chunks_exact_mut(vocab))
        .zip(coeffs.par_iter())
        .enumerate()
        .try_for_each(|(r, ((x, out), &c))| {
            if c == 0.0 {
                return Ok(());
            }
            match row_grad(x, out, inv_t, c) {
                RowOutcome::Ok => Ok(()),
                RowOutcome::Bad => Err(Error::BadLogitsRow { row: r }),
                RowOutcome::Overflow => Err(CoreError::NonFinite {
                    what: "entropy gradient",
                    index: r,
                }
                .into()),
            }
        })
}

/// How one row went.
enum RowOutcome {
    Ok,
    /// NaN or +∞ in the row, or −∞ everywhere.
    Bad,
    /// `c/T` too large for an f32 gradient.
    Overflow,
}

/// One row: `out += c·∂H/∂x` at `inv_t = 1/T`. Picks the widest SIMD the CPU has at run
/// time; every variant runs the same code.
fn row_grad(x: &[f32], out: &mut [f32], inv_t: f32, c: f32) -> RowOutcome {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { row_grad_avx512(x, out, inv_t, c) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { row_grad_avx2(x, out, inv_t, c) },
        _ => row_grad_portable::<false>(x, out, inv_t, c),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn row_grad_avx512(x: &[f32], out: &mut [f32], inv_t: f32, c: f32) -> RowOutcome {
    row_grad_portable::<true>(x, out, inv_t, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_grad_avx2(x: &[f32], out: &mut [f32], inv_t: f32, c: f32) -> RowOutcome {
    row_grad_portable::<true>(x, out, inv_t, c)
}

/// `(d, 2^d)` of one logit: `d = y − m` clamped at [`D_FLOOR`] (so `2^d` is exactly 0 there).
#[inline(always)]
fn d_and_exp<const FMA: bool>(v: f32, scale: f32, m: f32) -> (f32, f32) {
    let d = (v * scale - m).max(D_FLOOR);
    (d, exp2_nonpositive::<FMA>(d))
}

#[inline(always)]
fn row_grad_portable<const FMA: bool>(
    x: &[f32],
    out: &mut [f32],
    inv_t: f32,
    c: f32,
) -> RowOutcome {
    // Base 2: y = x·(log₂e/T), so e^{z−max z} = 2^{y−max y} with an exact range reduction.
    let scale = inv_t * LOG2E;
    let Some(m) = scaled_row_max(x, scale) else {
        return RowOutcome::Bad;
    };

    // S = Σ 2^d and U = Σ 2^d·d, per lane in f32 and per block in f64.
    let (mut s_total, mut u_total) = (0.0f64, 0.0f64);
    for xb in x.chunks(BLOCK) {
        let (mut s_acc, mut u_acc) = ([0.0f32; LANES], [0.0f32; LANES]);
        let mut xc = xb.chunks_exact(LANES);
        for xs in &mut xc {
            for ((&v, s), u) in xs.iter().zip(&mut s_acc).zip(&mut u_acc) {
                let (d, e) = d_and_exp::<FMA>(v, scale, m);
                *s += e;
                *u += e * d;
            }
        }
        for ((&v, s), u) in xc.remainder().iter().zip(&mut s_acc).zip(&mut u_acc) {
            let (d, e) = d_and_exp::<FMA>(v, scale, m);
            *s += e;
            *u += e * d;
        }
        s_total += s_acc.iter().map(|&a| f64::from(a)).sum::<f64>();
        u_total += u_acc.iter().map(|&a| f64::from(a)).sum::<f64>();
    }
    // s_total >= 1 (the max's own term), so both quotients are finite.
    let mean_d = (u_total / s_total) as f32;
    // out_v += c·(−p_v·ln 2·(d_v − d̄)/T) = k·2^{d_v}·(d_v − d̄).
    let k = -f64::from(c) * LN2 * f64::from(inv_t) / s_total;
    // |2^d·(d − d̄)| ≤ 127 (d, d̄ ∈ [−127, 0]): refuse a factor that could overflow (k is
    // finite in f64: c and 1/T are finite f32, S ≥ 1).
    if k.abs() * 128.0 > f64::from(f32::MAX) {
        return RowOutcome::Overflow;
    }
    let k = k as f32;
    let mut xc = x.chunks_exact(LANES);
    let mut oc = out.chunks_exact_mut(LANES);
    for (xs, os) in (&mut xc).zip(&mut oc) {
        for (&v, o) in xs.iter().zip(os.iter_mut()) {
            let (d, e) = d_and_exp::<FMA>(v, scale, m);
            *o += k * e * (d - mean_d);
        }
    }
    for (&v, o) in xc.remainder().iter().zip(oc.into_remainder().iter_mut()) {
        let (d, e) = d_and_exp::<FMA>(v, scale, m);
        *o += k * e * (d - mean_d);
    }
    RowOutcome::Ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_prob_entropy;
    use crate::logits::Logits;
    use crate::test_rng::Rng;
    use ares_core::entropy::token_entropy;
    use ares_core::entropy_bonus::entropy_grad_logits;

    /// `c·∂H/∂x` of one row by the f64 reference of ares-core.
    fn reference(x: &[f32], t: f32, c: f32) -> Vec<f64> {
        let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let mut g = vec![0.0; x.len()];
        entropy_grad_logits(&x, f64::from(t), &mut g).unwrap();
        g.iter().map(|v| v * f64::from(c)).collect()
    }

    #[test]
    fn hand_checked_values() {
        // p = (1/3, 2/3): H = ln 3 − (2/3)·ln 2 = 0.6365142, ∂H/∂x = ±(2/9)·ln 2.
        let ln2 = core::f32::consts::LN_2;
        let mut out = [0.0f32; 2];
        entropy_backward(&[0.0, ln2], 2, 1.0, &[1.0], &mut out).unwrap();
        let want = [0.154_032_7f32, -0.154_032_7];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{out:?}");
        }
        // The same distribution at T = 2 halves the gradient; coefficient −3 scales it.
        let mut out = [0.0f32; 2];
        entropy_backward(&[0.0, 2.0 * ln2], 2, 2.0, &[-3.0], &mut out).unwrap();
        for (o, w) in out.iter().zip(want) {
            assert!((o - (-1.5 * w)).abs() < 1e-6, "{out:?}");
        }
        // Equal logits (maximum entropy) and a single finite logit: gradient 0; a −∞ logit
        // gets exactly 0.
        let mut out = [0.0f32; 4];
        entropy_backward(&[2.5; 4], 4, 0.7, &[1.0], &mut out).unwrap();
        assert!(out.iter().all(|&g| g.abs() < 1e-7), "{out:?}");
        let mut out = [0.0f32; 3];
        let x = [f32::NEG_INFINITY, 0.0, ln2];
        entropy_backward(&x, 3, 1.0, &[1.0], &mut out).unwrap();
        assert_eq!(out[0], 0.0);
        assert!((out[1] - want[0]).abs() < 1e-6 && (out[2] - want[1]).abs() < 1e-6);
        let mut out = [0.0f32; 3];
        let x = [f32::NEG_INFINITY, 4.0, f32::NEG_INFINITY];
        entropy_backward(&x, 3, 1.0, &[1.0], &mut out).unwrap();
        assert_eq!(out, [0.0; 3]);
    }

    #[test]
    fn accumulates_into_dlogits() {
        let mut rng = Rng(3);
        let (rows, vocab) = (3, 37);
        let x = rng.vec(rows * vocab, 4.0);
        let coeffs = [0.9f32, -0.4, 1.7];
        let base = rng.vec(rows * vocab, 1.0);
        let mut alone = vec![0.0f32; rows * vocab];
        entropy_backward(&x, vocab, 0.8, &coeffs, &mut alone).unwrap();
        let mut acc = base.clone();
        entropy_backward(&x, vocab, 0.8, &coeffs, &mut acc).unwrap();
        for ((a, b), g) in acc.iter().zip(&base).zip(&alone) {
            assert!((a - (b + g)).abs() < 1e-6);
        }
        // Twice is double.
        let mut twice = alone.clone();
        entropy_backward(&x, vocab, 0.8, &coeffs, &mut twice).unwrap();
        for (t, g) in twice.iter().zip(&alone) {
            assert!((t - 2.0 * g).abs() < 1e-6);
        }
    }

    #[test]
    fn zero_coefficient_rows_are_untouched_and_not_read() {
        let x = [
            f32::NAN,
            f32::INFINITY,
            1.0,
            2.0,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut out = [7.0f32, -3.0, 0.5, 0.5, 9.0, 9.0];
        entropy_backward(&x, 2, 1.0, &[0.0, 1.0, 0.0], &mut out).unwrap();
        assert_eq!(out[..2], [7.0, -3.0]);
        assert_eq!(out[4..], [9.0, 9.0]);
        // Row 1: softmax(1, 2) has H > 0; the gradient lowers the likely logit.
        assert!(out[2] > 0.5 && out[3] < 0.5);
        assert!((out[2] - 0.5 + out[3] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn matches_the_reference_on_random_rows() {
        let mut rng = Rng(7);
        for (rows, vocab) in [(3, 1), (5, 17), (4, 1000), (2, 5000)] {
            let x = rng.vec(rows * vocab, 8.0);
            let coeffs: Vec<f32> = (0..rows).map(|r| [0.7, -1.3, 0.0, 2.0][r % 4]).collect();
            for t in [1.0f32, 0.6, 1.7] {
                let mut out = vec![0.0f32; rows * vocab];
                entropy_backward(&x, vocab, t, &coeffs, &mut out).unwrap();
                for r in 0..rows {
                    let want = reference(&x[r * vocab..(r + 1) * vocab], t, coeffs[r]);
                    let got = &out[r * vocab..(r + 1) * vocab];
                    for (o, w) in got.iter().zip(&want) {
                        assert!(
                            (f64::from(*o) - w).abs() < 2e-6,
                            "{rows}x{vocab} T {t} row {r}: {o} vs {w}"
                        );
                    }
                    // The gradient of a shift-invariant function sums to 0.
                    let sum: f64 = got.iter().map(|&g| f64::from(g)).sum();
                    assert!(sum.abs() < 1e-5, "{rows}x{vocab} T {t} row {r}: sum {sum}");
                }
            }
        }
    }

    /// `Σ_r c_r·H_r` in f64 from ares-core's entropy of the f32 logits.
    fn weighted_entropy(x: &[f32], vocab: usize, t: f32, coeffs: &[f32]) -> f64 {
        x.chunks_exact(vocab)
            .zip(coeffs)
            .map(|(row, &c)| {
                let row: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
                f64::from(c) * token_entropy(&row, f64::from(t)).unwrap()
            })
            .sum()
    }

    #[test]
    fn is_the_derivative_of_the_weighted_entropy() {
        let mut rng = Rng(11);
        let (rows, vocab) = (3, 40);
        let x = rng.vec(rows * vocab, 3.0);
        let coeffs = [-1.7f32, 0.6, 2.3];
        for t in [0.5f32, 0.8, 1.0, 1.9] {
            let mut out = vec![0.0f32; rows * vocab];
            entropy_backward(&x, vocab, t, &coeffs, &mut out).unwrap();
            for i in [0, 13, 27, 41, 79, 80, 119] {
                // Central differences of the f64 entropy (the logits perturbed in f64).
                let h = 1e-3f32;
                let (mut a, mut b) = (x.clone(), x.clone());
                a[i] += h;
                b[i] -= h;
                let step = f64::from(a[i]) - f64::from(b[i]);
                let numeric = (weighted_entropy(&a, vocab, t, &coeffs)
                    - weighted_entropy(&b, vocab, t, &coeffs))
                    / step;
                let got = f64::from(out[i]);
                assert!(
                    (numeric - got).abs() < 1e-5 * numeric.abs().max(1.0),
                    "T {t} i {i}: {got} vs {numeric}"
                );
            }
        }
    }

    #[test]
    fn is_the_derivative_of_the_forward_kernels_entropy() {
        // The model's forward computes H with `log_prob_entropy`: differences of it (in f32,
        // so a coarse step and tolerance) agree with the op too.
        let mut rng = Rng(5);
        let vocab = 64;
        let x = rng.vec(vocab, 3.0);
        let (t, c) = (0.7f32, 1.3f32);
        let mut out = vec![0.0f32; vocab];
        entropy_backward(&x, vocab, t, &[c], &mut out).unwrap();
        let ent = |x: &[f32]| {
            let mut h = [0.0f32];
            log_prob_entropy(Logits::F32(x), vocab, t, None, &mut h).unwrap();
            f64::from(c) * f64::from(h[0])
        };
        for v in [0, 9, 33, 63] {
            let h = 1e-2f32;
            let (mut a, mut b) = (x.clone(), x.clone());
            a[v] += h;
            b[v] -= h;
            let numeric = (ent(&a) - ent(&b)) / (2.0 * f64::from(h));
            let got = f64::from(out[v]);
            assert!((numeric - got).abs() < 1e-3, "v {v}: {got} vs {numeric}");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let x = [0.0f32, 1.0, 2.0, 3.0];
        let mut out = [0.0f32; 4];
        let run = |x: &[f32], t: f32, c: &[f32], out: &mut [f32]| entropy_backward(x, 2, t, c, out);
        for t in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-45] {
            assert!(
                matches!(
                    run(&x, t, &[1.0, 1.0], &mut out),
                    Err(Error::Core(CoreError::OutOfRange {
                        what: "temperature",
                        ..
                    }))
                ),
                "T {t}"
            );
        }
        assert!(matches!(
            run(&x, 1.0, &[1.0], &mut out),
            Err(Error::Core(CoreError::LengthMismatch {
                what: "logits",
                ..
            }))
        ));
        assert!(matches!(
            run(&x, 1.0, &[1.0, 1.0], &mut out[..3]),
            Err(Error::Core(CoreError::LengthMismatch {
                what: "dlogits",
                ..
            }))
        ));
        assert!(matches!(
            run(&x, 1.0, &[1.0, f32::INFINITY], &mut out),
            Err(Error::Core(CoreError::NonFinite {
                what: "coeffs",
                index: 1
            }))
        ));
        assert!(matches!(
            run(&x, 1.0, &[f32::NAN, 1.0], &mut out),
            Err(Error::Core(CoreError::NonFinite {
                what: "coeffs",
                index: 0
            }))
        ));
        assert_eq!(out, [0.0; 4], "nothing written by argument errors");
        let nan = [0.0f32, 1.0, f32::NAN, 3.0];
        assert_eq!(
            run(&nan, 1.0, &[1.0, 1.0], &mut out),
            Err(Error::BadLogitsRow { row: 1 })
        );
        let inf = [0.0f32, 1.0, f32::INFINITY, 3.0];
        assert_eq!(
            run(&inf, 1.0, &[1.0, 1.0], &mut out),
            Err(Error::BadLogitsRow { row: 1 })
        );
        let none = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 1.0];
        assert_eq!(
            run(&none, 1.0, &[1.0, 1.0], &mut out),
            Err(Error::BadLogitsRow { row: 0 })
        );
        // c/T beyond f32: refused, the row unchanged.
        let mut out = [0.0f32; 4];
        assert_eq!(
            entropy_backward(&[0.0, 1e-37], 2, 1e-37, &[1e4], &mut out[..2]),
            Err(Error::Core(CoreError::NonFinite {
                what: "entropy gradient",
                index: 0
            }))
        );
        assert_eq!(out, [0.0; 4]);
        assert!(entropy_backward(&x, 0, 1.0, &[], &mut []).is_err());
        // No rows: nothing to do.
        entropy_backward(&[], 5, 1.0, &[], &mut []).unwrap();
    }
}
