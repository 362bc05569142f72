//! RMSNorm as in Hugging Face's `Qwen2RMSNorm` / `LlamaRMSNorm`, over rows of width `d`:
//!
//! `y = w ⊙ (x · r)`, with `r = 1 / sqrt(mean(x²) + eps)` per row.
//!
//! The same functions serve Qwen3's per-head q/k norm: view `[tokens, heads, head_dim]` as
//! `[tokens × heads, head_dim]` rows with `d = head_dim` and a `[head_dim]` weight.
//!
//! Numerics follow transformers' f32 path: squares rounded to f32 (torch's `pow(2)`), their
//! sum accumulated in f64 (torch sums f32 pairwise, so both are within about an ulp of the
//! exact sum), rounded to f32 and divided by `d` in f32, `eps` added in f32,
//! `r = 1 / sqrt(·)` in f32 (torch's CPU `rsqrt`; CUDA's is approximate), then `w · (x · r)`
//! in that order. Expect agreement with transformers to about an ulp, not bit-for-bit.

use crate::Result;
use crate::error::check_len;
use crate::ops::stored::{Bf16Bits, Widen};
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Elements per rayon task at least, so small inputs stay on one thread.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

/// At most this many row chunks in the backward: each keeps its own `dweight` partial, and
/// the partials are added in chunk order, so the result does not depend on the thread count.
const MAX_WEIGHT_PARTIALS: usize = 64;

/// Rows per rayon task for rows of width `d`.
fn rows_per_task(d: usize) -> usize {
    (MIN_ELEMS_PER_TASK / d.max(1)).max(1)
}

/// Checks `d ≥ 1` and that `x` (named `what`) holds whole rows; returns the row count.
fn rows_of(what: &'static str, len: usize, d: usize) -> Result<usize> {
    if d == 0 {
        return Err(CoreError::OutOfRange {
            what: "d",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    if !len.is_multiple_of(d) {
        return Err(CoreError::NotDivisible { what, len, n: d }.into());
    }
    Ok(len / d)
}

fn check_eps(eps: f32) -> Result<()> {
    // eps = 0 would turn an all-zero row into 0 · ∞ = NaN.
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(CoreError::OutOfRange {
            what: "eps",
            value: f64::from(eps),
            expected: "finite and > 0",
        }
        .into())
    }
}

/// Accumulator slots of [`sum_squares`]: a slot array updated element-wise is what LLVM
/// vectorises (a single running float sum it never reorders).
const SLOTS: usize = 8;

/// `Σ fl32(xᵢ²)` in f64.
#[inline]
fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; SLOTS];
    let mut blocks = x.chunks_exact(SLOTS);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a += f64::from(v * v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(blocks.remainder()) {
        *a += f64::from(v * v);
    }
    acc.iter().sum()
}

/// `Σ fl32(aᵢ·bᵢ)·cᵢ` in f64.
#[inline]
fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    let mut acc = [0.0f64; SLOTS];
    let (mut ab, mut bb, mut cb) = (
        a.chunks_exact(SLOTS),
        b.chunks_exact(SLOTS),
        c.chunks_exact(SLOTS),
    );
    for ((x, y), z) in (&mut ab).zip(&mut bb).zip(&mut cb) {
        for (((s, &u), &v), &w) in acc.iter_mut().zip(x).zip(y).zip(z) {
            *s += f64::from(u * v) * f64::from(w);
        }
    }
    let tail = ab
        .remainder()
        .iter()
        .zip(bb.remainder())
        .zip(cb.remainder());
    for (s, ((&u, &v), &w)) in acc.iter_mut().zip(tail) {
        *s += f64::from(u * v) * f64::from(w);
    }
    acc.iter().sum()
}

/// Normalises one row into `out`; returns its `r = 1/rms`.
#[inline]
fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> f32 {
    // `x.len() as f32` is exact for any realistic width (< 2^24).
    let mean_sq = (sum_squares(x) as f32) / x.len() as f32;
    let r = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * r);
    }
    r
}

/// RMSNorm forward over `x: [rows, d]`: `out[t, i] = weight[i] · (x[t, i] · rstd[t])` with
/// `rstd[t] = 1 / sqrt(Σᵢ x[t, i]² / d + eps)`, saved for [`rmsnorm_backward`].
///
/// Shapes: `x`, `out`: `[rows, d]`; `weight`: `[d]`; `rstd`: `[rows]`. Rows run in parallel.
/// Non-finite inputs are not rejected (checking would cost a pass); they propagate.
///
/// # Errors
/// `d == 0`, `x` not a whole number of rows, a length mismatch (named), or `eps` not finite
/// and > 0.
pub fn rmsnorm_forward(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    d: usize,
    out: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of("x", x.len(), d)?;
    check_len("weight", d, weight.len())?;
    check_len("out", x.len(), out.len())?;
    check_len("rstd", rows, rstd.len())?;
    check_eps(eps)?;
    x.par_chunks_exact(d)
        .zip(out.par_chunks_exact_mut(d))
        .zip(rstd.par_iter_mut())
        .with_min_len(rows_per_task(d))
        .for_each(|((xr, or), r)| *r = norm_row(xr, weight, eps, or));
    Ok(())
}

/// Residual add fused with the next RMSNorm (the pre-norm block boundary):
/// `sum = a + b`, then `out = rmsnorm(sum)` as in [`rmsnorm_forward`], `rstd` saved — the
/// bits of an add followed by [`rmsnorm_forward`] (the sum is rounded to f32 before
/// normalising, as transformers does: `hidden = residual + hidden; norm(hidden)`), in one
/// pass over the rows. `sum` is the residual stream onward and the `x` of
/// [`rmsnorm_backward`].
///
/// Shapes: `a`, `b`, `sum`, `out`: `[rows, d]`; `weight`: `[d]`; `rstd`: `[rows]`.
///
/// # Errors
/// As [`rmsnorm_forward`], with `a` as the row-count source and `b`, `sum` checked too.
#[allow(clippy::too_many_arguments)] // the two outputs of the norm and the sum
pub fn add_rmsnorm_forward(
    a: &[f32],
    b: &[f32],
    weight: &[f32],
    eps: f32,
    d: usize,
    sum: &mut [f32],
    out: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of("a", a.len(), d)?;
    check_len("b", a.len(), b.len())?;
    check_len("weight", d, weight.len())?;
    check_len("sum", a.len(), sum.len())?;
    check_len("out", a.len(), out.len())?;
    check_len("rstd", rows, rstd.len())?;
    check_eps(eps)?;
    sum.par_chunks_exact_mut(d)
        .zip(a.par_chunks_exact(d).zip(b.par_chunks_exact(d)))
        .zip(out.par_chunks_exact_mut(d).zip(rstd.par_iter_mut()))
        .with_min_len(rows_per_task(d))
        .for_each(|((sr, (ar, br)), (or, r))| {
            for ((s, &x), &y) in sr.iter_mut().zip(ar).zip(br) {
                *s = x + y;
            }
            *r = norm_row(sr, weight, eps, or);
        });
    Ok(())
}

/// [`add_rmsnorm_forward`] with the norm's output stored in bf16: `sum` and `rstd` as
/// there (f32, the bits), each element of `out` rounded to the nearest bf16 (ties to even)
/// into `out16` — the input of the MLP's projections stored as the bf16 they multiply.
///
/// # Errors
/// As [`add_rmsnorm_forward`] (`out16` for `out`).
#[allow(clippy::too_many_arguments)] // the two outputs of the norm and the sum
pub fn add_rmsnorm_forward_bf16(
    a: &[f32],
    b: &[f32],
    weight: &[f32],
    eps: f32,
    d: usize,
    sum: &mut [f32],
    out16: &mut [u16],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of("a", a.len(), d)?;
    check_len("b", a.len(), b.len())?;
    check_len("weight", d, weight.len())?;
    check_len("sum", a.len(), sum.len())?;
    check_len("out", a.len(), out16.len())?;
    check_len("rstd", rows, rstd.len())?;
    check_eps(eps)?;
    sum.par_chunks_exact_mut(d)
        .zip(a.par_chunks_exact(d).zip(b.par_chunks_exact(d)))
        .zip(out16.par_chunks_exact_mut(d).zip(rstd.par_iter_mut()))
        .with_min_len(rows_per_task(d))
        .for_each_init(
            || vec![0.0f32; d],
            |row, ((sr, (ar, br)), (or, r))| {
                for ((s, &x), &y) in sr.iter_mut().zip(ar).zip(br) {
                    *s = x + y;
                }
                *r = norm_row(sr, weight, eps, row);
                for (o, &v) in or.iter_mut().zip(row.iter()) {
                    *o = Bf16Bits::narrow(v);
                }
            },
        );
    Ok(())
}

/// RMSNorm backward. With `g = dout ⊙ weight` per row and `r = rstd[t]`:
///
/// - `dx[t, i] += r · g[i] − r³ · x[t, i] · (Σⱼ g[j] · x[t, j]) / d`
/// - `dweight[i] += Σₜ dout[t, i] · x[t, i] · r` (skipped if `None`: a frozen weight)
///
/// Both accumulate (`+=`): `dx` is the residual stream's gradient, `dweight` may be shared
/// (Qwen3's q/k norm weight is used by every head). `x` and `rstd` are the forward's input
/// and saved `rstd`. Dot products run in f64. Rows run in parallel in a fixed number of
/// chunks whose `dweight` partials are added in order, so results are deterministic.
///
/// Shapes: `dout`, `x`, `dx`: `[rows, d]`; `weight`, `dweight`: `[d]`; `rstd`: `[rows]`.
///
/// # Errors
/// `d == 0`, `x` not a whole number of rows, or a length mismatch (named).
pub fn rmsnorm_backward(
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    d: usize,
    dx: &mut [f32],
    dweight: Option<&mut [f32]>,
) -> Result<()> {
    let rows = rows_of("x", x.len(), d)?;
    check_len("dout", x.len(), dout.len())?;
    check_len("weight", d, weight.len())?;
    check_len("rstd", rows, rstd.len())?;
    check_len("dx", x.len(), dx.len())?;
    if let Some(dw) = dweight.as_deref() {
        check_len("dweight", d, dw.len())?;
    }
    if rows == 0 {
        return Ok(());
    }
    // The chunking depends only on (rows, d), never on the thread count.
    let chunk_rows = rows
        .div_ceil(MAX_WEIGHT_PARTIALS)
        .max(rows_per_task(d).min(rows));
    let n_chunks = rows.div_ceil(chunk_rows);
    let mut partials = vec![0.0f32; n_chunks * d];
    let chunk = chunk_rows * d;
    let inv_d = 1.0 / d as f64;
    partials
        .par_chunks_exact_mut(d)
        .zip(dout.par_chunks(chunk))
        .zip(x.par_chunks(chunk).zip(rstd.par_chunks(chunk_rows)))
        .zip(dx.par_chunks_mut(chunk))
        .for_each(|(((dw, dy_c), (x_c, r_c)), dx_c)| {
            let rows_c = dy_c
                .chunks_exact(d)
                .zip(x_c.chunks_exact(d))
                .zip(r_c)
                .zip(dx_c.chunks_exact_mut(d));
            for (((dy, xr), &r), dxr) in rows_c {
                // Σ g·x with g = dout·w never materialised.
                let gx = dot3(dy, weight, xr);
                let rf = f64::from(r);
                let c = (rf * rf * rf * gx * inv_d) as f32;
                for (((o, &g), &w), &xi) in dxr.iter_mut().zip(dy).zip(weight).zip(xr) {
                    *o += r * (g * w) - c * xi;
                }
                for ((p, &g), &xi) in dw.iter_mut().zip(dy).zip(xr) {
                    *p += g * (xi * r);
                }
            }
        });
    // (a frozen weight, `None`: its partial sums are dropped)
    let Some(dweight) = dweight else {
        return Ok(());
    };
    for p in partials.chunks_exact(d) {
        for (o, &v) in dweight.iter_mut().zip(p) {
            *o += v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_rng::Rng;

    /// Naive f64 RMSNorm: `(out, rstd)`.
    fn reference(x: &[f64], w: &[f64], eps: f64, d: usize) -> (Vec<f64>, Vec<f64>) {
        let mut out = Vec::new();
        let mut rstd = Vec::new();
        for row in x.chunks(d) {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let r = 1.0 / (ms + eps).sqrt();
            out.extend(row.iter().zip(w).map(|(v, wi)| wi * v * r));
            rstd.push(r);
        }
        (out, rstd)
    }

    fn to64(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
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
        // Row 0 = [3, 4]: mean(x²) = (9 + 16) / 2 = 12.5, r = 1/sqrt(12.5 + 1e-6) = 0.28284270,
        // out = [1·3·r, 2·4·r] = [0.84852810, 2.26274161].
        // Row 1 = [0, 0]: r = 1/sqrt(1e-6) = 1000, out = [0, 0].
        let x = [3.0, 4.0, 0.0, 0.0];
        let w = [1.0, 2.0];
        let (mut out, mut rstd) = ([f32::NAN; 4], [f32::NAN; 2]);
        rmsnorm_forward(&x, &w, 1e-6, 2, &mut out, &mut rstd).unwrap();
        close(rstd[0], 0.2828427011609112, 1e-6, "rstd0");
        close(out[0], 0.8485281034827337, 1e-6, "out0");
        close(out[1], 2.2627416092872896, 1e-6, "out1");
        close(rstd[1], 1000.0, 1e-6, "rstd1");
        assert_eq!(&out[2..], &[0.0, 0.0]);
    }

    #[test]
    fn matches_f64_reference_on_odd_sizes() {
        let mut rng = Rng(1);
        for &(rows, d) in &[(1, 1), (5, 37), (3, 129), (300, 70)] {
            let x = rng.vec(rows * d, 3.0);
            let w = rng.vec(d, 2.0);
            let (mut out, mut rstd) = (vec![f32::NAN; rows * d], vec![f32::NAN; rows]);
            rmsnorm_forward(&x, &w, 1e-5, d, &mut out, &mut rstd).unwrap();
            let (ro, rr) = reference(&to64(&x), &to64(&w), f64::from(1e-5f32), d);
            for (i, (&g, &e)) in out.iter().zip(&ro).enumerate() {
                close(g, e, 1e-5, &format!("out[{i}] rows={rows} d={d}"));
            }
            for (i, (&g, &e)) in rstd.iter().zip(&rr).enumerate() {
                close(g, e, 1e-6, &format!("rstd[{i}]"));
            }
        }
    }

    #[test]
    fn fused_add_matches_add_then_norm() {
        let mut rng = Rng(2);
        let (rows, d) = (7, 33);
        let res = rng.vec(rows * d, 2.0);
        let delta = rng.vec(rows * d, 2.0);
        let w = rng.vec(d, 1.0);
        let summed: Vec<f32> = res.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let (mut o1, mut r1) = (vec![0.0; rows * d], vec![0.0; rows]);
        rmsnorm_forward(&summed, &w, 1e-6, d, &mut o1, &mut r1).unwrap();
        let (mut o2, mut r2) = (vec![0.0; rows * d], vec![0.0; rows]);
        let mut sum = vec![f32::NAN; rows * d];
        add_rmsnorm_forward(&res, &delta, &w, 1e-6, d, &mut sum, &mut o2, &mut r2).unwrap();
        assert_eq!(sum, summed);
        assert_eq!(o1, o2);
        assert_eq!(r1, r2);
        // stored in bf16: the same sum and rstd, the output rounded to nearest even
        let (mut o16, mut r3) = (vec![0u16; rows * d], vec![0.0; rows]);
        let mut sum3 = vec![f32::NAN; rows * d];
        add_rmsnorm_forward_bf16(&res, &delta, &w, 1e-6, d, &mut sum3, &mut o16, &mut r3).unwrap();
        assert_eq!(sum3, summed);
        assert_eq!(r3, r1);
        let want: Vec<u16> = o1
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(o16, want);
        let short = &mut o16[1..];
        let e = add_rmsnorm_forward_bf16(&res, &delta, &w, 1e-6, d, &mut sum3, short, &mut r3);
        assert!(e.is_err());
    }

    #[test]
    fn per_head_norm_normalises_each_head() {
        // Qwen3 q/k norm: [tokens, heads, head_dim] as [tokens·heads, head_dim].
        let mut rng = Rng(3);
        let (t, h, hd) = (3, 4, 8);
        let q = rng.vec(t * h * hd, 2.0);
        let w = rng.vec(hd, 1.0);
        let (mut out, mut rstd) = (vec![0.0; q.len()], vec![0.0; t * h]);
        rmsnorm_forward(&q, &w, 1e-6, hd, &mut out, &mut rstd).unwrap();
        for (k, head) in q.chunks(hd).enumerate() {
            let (mut o, mut r) = (vec![0.0; hd], [0.0]);
            rmsnorm_forward(head, &w, 1e-6, hd, &mut o, &mut r).unwrap();
            assert_eq!(&out[k * hd..(k + 1) * hd], &o[..]);
            assert_eq!(rstd[k], r[0]);
        }
    }

    /// Central differences of `L = Σ c·out` through the f64 reference, against the f32
    /// backward; `dx` and `dweight` start non-zero to check that they accumulate.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(4);
        for &(rows, d) in &[(1, 1), (3, 7), (4, 19), (300, 70)] {
            let x = rng.vec(rows * d, 2.0);
            let w = rng.vec(d, 1.5);
            let c = rng.vec(rows * d, 1.0);
            let eps = 1e-5f32;
            let (mut out, mut rstd) = (vec![0.0; rows * d], vec![0.0; rows]);
            rmsnorm_forward(&x, &w, eps, d, &mut out, &mut rstd).unwrap();
            let dx0 = rng.vec(rows * d, 1.0);
            let dw0 = rng.vec(d, 1.0);
            let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
            rmsnorm_backward(&c, &x, &w, &rstd, d, &mut dx, Some(&mut dw)).unwrap();

            let (x64, w64, c64) = (to64(&x), to64(&w), to64(&c));
            let loss = |x: &[f64], w: &[f64]| -> f64 {
                let (o, _) = reference(x, w, f64::from(eps), d);
                o.iter().zip(&c64).map(|(a, b)| a * b).sum()
            };
            let h = 1e-6;
            // Every coordinate for the small cases, a sample for the large one.
            let step = if rows * d > 1000 { 97 } else { 1 };
            for i in (0..rows * d).step_by(step) {
                let (mut p, mut m) = (x64.clone(), x64.clone());
                p[i] += h;
                m[i] -= h;
                let g = (loss(&p, &w64) - loss(&m, &w64)) / (2.0 * h);
                close(
                    dx[i] - dx0[i],
                    g,
                    1e-4,
                    &format!("dx[{i}] rows={rows} d={d}"),
                );
            }
            for i in 0..d {
                let (mut p, mut m) = (w64.clone(), w64.clone());
                p[i] += h;
                m[i] -= h;
                let g = (loss(&x64, &p) - loss(&x64, &m)) / (2.0 * h);
                close(
                    dw[i] - dw0[i],
                    g,
                    1e-4,
                    &format!("dw[{i}] rows={rows} d={d}"),
                );
            }
        }
    }

    /// Central differences through the f32 op itself (loss summed in f64), on a few
    /// coordinates: a coarser check that the backward is the derivative of this forward.
    #[test]
    fn backward_matches_finite_differences_of_the_f32_forward() {
        let mut rng = Rng(5);
        let (rows, d) = (3, 11);
        let x = rng.vec(rows * d, 2.0);
        let w = rng.vec(d, 1.5);
        let c = rng.vec(rows * d, 1.0);
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            let (mut o, mut r) = (vec![0.0; rows * d], vec![0.0; rows]);
            rmsnorm_forward(x, w, 1e-5, d, &mut o, &mut r).unwrap();
            o.iter()
                .zip(&c)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        let (mut out, mut rstd) = (vec![0.0; rows * d], vec![0.0; rows]);
        rmsnorm_forward(&x, &w, 1e-5, d, &mut out, &mut rstd).unwrap();
        let (mut dx, mut dw) = (vec![0.0; rows * d], vec![0.0; d]);
        rmsnorm_backward(&c, &x, &w, &rstd, d, &mut dx, Some(&mut dw)).unwrap();
        let h = 1e-2f32;
        for i in [0, 5, 17, 32] {
            let (mut p, mut m) = (x.clone(), x.clone());
            p[i] += h;
            m[i] -= h;
            let g = (loss(&p, &w) - loss(&m, &w)) / f64::from(p[i] - m[i]);
            close(dx[i], g, 3e-3, &format!("dx[{i}]"));
        }
        for i in [0, 4, 10] {
            let (mut p, mut m) = (w.clone(), w.clone());
            p[i] += h;
            m[i] -= h;
            let g = (loss(&x, &p) - loss(&x, &m)) / f64::from(p[i] - m[i]);
            close(dw[i], g, 3e-3, &format!("dw[{i}]"));
        }
    }

    #[test]
    fn rejects_bad_shapes_and_eps() {
        use ares_core::Error as E;
        let x = [1.0f32; 6];
        let w = [1.0f32; 3];
        let (mut out, mut rstd) = ([0.0f32; 6], [0.0f32; 2]);
        let err = |e: E| Err::<(), _>(crate::Error::Core(e));
        assert_eq!(
            rmsnorm_forward(&x, &w, 1e-6, 0, &mut out, &mut rstd),
            err(E::OutOfRange {
                what: "d",
                value: 0.0,
                expected: ">= 1"
            })
        );
        assert_eq!(
            rmsnorm_forward(&x, &w, 1e-6, 4, &mut out, &mut rstd),
            err(E::NotDivisible {
                what: "x",
                len: 6,
                n: 4
            })
        );
        assert_eq!(
            rmsnorm_forward(&x, &w[..2], 1e-6, 3, &mut out, &mut rstd),
            err(E::LengthMismatch {
                what: "weight",
                expected: 3,
                actual: 2
            })
        );
        assert_eq!(
            rmsnorm_forward(&x, &w, 1e-6, 3, &mut out[..5], &mut rstd),
            err(E::LengthMismatch {
                what: "out",
                expected: 6,
                actual: 5
            })
        );
        assert_eq!(
            rmsnorm_forward(&x, &w, 1e-6, 3, &mut out, &mut rstd[..1]),
            err(E::LengthMismatch {
                what: "rstd",
                expected: 2,
                actual: 1
            })
        );
        for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(rmsnorm_forward(&x, &w, eps, 3, &mut out, &mut rstd).is_err());
        }
        let mut sum = [0.0f32; 6];
        assert_eq!(
            add_rmsnorm_forward(&x, &x[..3], &w, 1e-6, 3, &mut sum, &mut out, &mut rstd),
            err(E::LengthMismatch {
                what: "b",
                expected: 6,
                actual: 3
            })
        );
        let (mut dx, mut dw) = ([0.0f32; 6], [0.0f32; 3]);
        assert_eq!(
            rmsnorm_backward(&x[..3], &x, &w, &rstd, 3, &mut dx, Some(&mut dw)),
            err(E::LengthMismatch {
                what: "dout",
                expected: 6,
                actual: 3
            })
        );
        assert_eq!(
            rmsnorm_backward(&x, &x, &w, &rstd, 3, &mut dx, Some(&mut dw[..2])),
            err(E::LengthMismatch {
                what: "dweight",
                expected: 3,
                actual: 2
            })
        );
        assert_eq!(
            rmsnorm_backward(&x, &x, &w, &rstd, 3, &mut dx[..1], Some(&mut dw)),
            err(E::LengthMismatch {
                what: "dx",
                expected: 6,
                actual: 1
            })
        );
        // Empty input is fine.
        assert!(rmsnorm_forward(&[], &w, 1e-6, 3, &mut [], &mut []).is_ok());
        assert!(rmsnorm_backward(&[], &[], &w, &[], 3, &mut [], Some(&mut dw)).is_ok());
    }
}
