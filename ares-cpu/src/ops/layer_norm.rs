//! LayerNorm as torch's `nn.LayerNorm(dim, eps)` (the Qwen2-VL / Qwen2.5-VL vision tower's
//! `norm1`/`norm2` and the patch merger's `ln_q`), over rows of width `d`:
//!
//! `y = (x − μ)·r·w + b`, with per row `μ = Σx/d`, the biased variance
//! `σ² = Σ(x − μ)²/d` and `r = 1/sqrt(σ² + eps)`.
//!
//! Numerics: `μ` and `σ²` are two-pass f64 sums (no cancellation however large the mean)
//! and `r` is computed in f64; the normalised value `x̂ = (x − μ)·r` is formed in f64 and
//! rounded once, then `y = x̂·w + b` in f32 (a product and a sum, not fused). So `x̂` is
//! within an ulp of exact even for rows whose mean is large next to their spread (torch's
//! f32 kernel rounds the mean first and can be off by a few ulps of the mean there). `μ`
//! and `r` are saved rounded to f32; the backward recomputes `x̂` from those, which
//! differs from the forward's by at most a rounding of the mean times `r`.
//!
//! Edge cases: `d = 1` gives `x̂ = 0` and `y = b`; a constant row gives `σ² = 0`,
//! `r = 1/sqrt(eps)` and `x̂ = 0`. Non-finite inputs are not rejected; they propagate.

use crate::Result;
use crate::error::check_len;
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Elements per rayon task at least, so small inputs stay on one thread.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

/// At most this many row chunks in the backward: each keeps its own `dweight`/`dbias`
/// partials, added in chunk order, so the result does not depend on the thread count.
const MAX_WEIGHT_PARTIALS: usize = 64;

/// Rows per rayon task for rows of width `d`.
fn rows_per_task(d: usize) -> usize {
    (MIN_ELEMS_PER_TASK / d.max(1)).max(1)
}

/// Checks `d ≥ 1` and that `x` holds whole rows; returns the row count.
fn rows_of(len: usize, d: usize) -> Result<usize> {
    if d == 0 {
        return Err(CoreError::OutOfRange {
            what: "dim",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    if !len.is_multiple_of(d) {
        return Err(CoreError::NotDivisible {
            what: "x",
            len,
            n: d,
        }
        .into());
    }
    Ok(len / d)
}

/// Accumulator slots of the row sums (a slot array updated element-wise vectorises).
const SLOTS: usize = 8;

/// `Σ f(xᵢ)` in f64 over slot accumulators.
#[inline]
fn sum_by(x: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0.0f64; SLOTS];
    let mut blocks = x.chunks_exact(SLOTS);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a += f(f64::from(v));
        }
    }
    for (a, &v) in acc.iter_mut().zip(blocks.remainder()) {
        *a += f(f64::from(v));
    }
    acc.iter().sum()
}

/// `(mean, rstd)` of one row, in f64.
#[inline]
fn row_stats(x: &[f32], eps: f32) -> (f64, f64) {
    let inv_d = 1.0 / x.len() as f64;
    let mean = sum_by(x, |v| v) * inv_d;
    let var = sum_by(x, |v| (v - mean) * (v - mean)) * inv_d;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

/// `x̂ = (x − mean)·rstd` in f64, rounded once.
#[inline(always)]
fn normalise(x: f32, mean: f64, rstd: f64) -> f32 {
    ((f64::from(x) - mean) * rstd) as f32
}

/// LayerNorm forward over `x: [rows, d]`: `out[t, i] = x̂[t, i]·weight[i] + bias[i]` with
/// `x̂ = (x − mean[t])·rstd[t]`, `mean[t]` the row mean and `rstd[t] = 1/sqrt(var[t] + eps)`
/// (biased variance), both saved for [`layer_norm_backward`].
///
/// Shapes: `x`, `out`: `[rows, d]`; `weight`, `bias`: `[d]`; `mean`, `rstd`: `[rows]`.
/// Rows run in parallel.
///
/// # Errors
/// `d == 0` (`dim`), `x` not a whole number of rows, a length mismatch (named), or `eps`
/// not finite and > 0.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    d: usize,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let rows = rows_of(x.len(), d)?;
    check_len("weight", d, weight.len())?;
    check_len("bias", d, bias.len())?;
    check_len("out", x.len(), out.len())?;
    check_len("mean", rows, mean.len())?;
    check_len("rstd", rows, rstd.len())?;
    if !(eps.is_finite() && eps > 0.0) {
        return Err(CoreError::OutOfRange {
            what: "eps",
            value: f64::from(eps),
            expected: "finite and > 0",
        }
        .into());
    }
    x.par_chunks_exact(d)
        .zip(out.par_chunks_exact_mut(d))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .with_min_len(rows_per_task(d))
        .for_each(|((xr, or), (m, r))| {
            let (mu, rs) = row_stats(xr, eps);
            for (((o, &xi), &w), &b) in or.iter_mut().zip(xr).zip(weight).zip(bias) {
                *o = normalise(xi, mu, rs) * w + b;
            }
            (*m, *r) = (mu as f32, rs as f32);
        });
    Ok(())
}

/// LayerNorm backward from `dout`, the forward's input `x`, `weight` and saved `mean`,
/// `rstd`. With `x̂ = (x − mean[t])·rstd[t]` (in f64 from the saved values, rounded) and
/// `g = dout ⊙ weight` per row:
///
/// - `dx[t, i] += rstd[t]·(g[i] − mean(g) − x̂[i]·mean(g ⊙ x̂))` (means over the row, in f64);
/// - `dweight[i] += Σₜ dout[t, i]·x̂[t, i]`;
/// - `dbias[i] += Σₜ dout[t, i]`.
///
/// All three **accumulate** (`+=`; `dx` is the residual stream's gradient). Rows run in
/// parallel in a fixed number of chunks whose `dweight`/`dbias` partials are added in
/// order, so results are deterministic.
///
/// Shapes: `dout`, `x`, `dx`: `[rows, d]`; `weight`, `dweight`, `dbias`: `[d]`; `mean`,
/// `rstd`: `[rows]`.
///
/// # Errors
/// `d == 0` (`dim`), `x` not a whole number of rows, or a length mismatch (named).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    d: usize,
    dx: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
) -> Result<()> {
    let rows = rows_of(x.len(), d)?;
    check_len("dout", x.len(), dout.len())?;
    check_len("weight", d, weight.len())?;
    check_len("mean", rows, mean.len())?;
    check_len("rstd", rows, rstd.len())?;
    check_len("dx", x.len(), dx.len())?;
    check_len("dweight", d, dweight.len())?;
    check_len("dbias", d, dbias.len())?;
    if rows == 0 {
        return Ok(());
    }
    // The chunking depends only on (rows, d), never on the thread count.
    let chunk_rows = rows
        .div_ceil(MAX_WEIGHT_PARTIALS)
        .max(rows_per_task(d).min(rows));
    let n_chunks = rows.div_ceil(chunk_rows);
    // Per chunk: [dweight partial (d), dbias partial (d)].
    let mut partials = vec![0.0f32; n_chunks * 2 * d];
    let chunk = chunk_rows * d;
    let inv_d = 1.0 / d as f64;
    partials
        .par_chunks_exact_mut(2 * d)
        .zip(dout.par_chunks(chunk))
        .zip(x.par_chunks(chunk))
        .zip(mean.par_chunks(chunk_rows).zip(rstd.par_chunks(chunk_rows)))
        .zip(dx.par_chunks_mut(chunk))
        .for_each_init(Vec::new, |xhat, ((((p, dy_c), x_c), (m_c, r_c)), dx_c)| {
            let (dw, db) = p.split_at_mut(d);
            let rows_c = dy_c
                .chunks_exact(d)
                .zip(x_c.chunks_exact(d))
                .zip(m_c.iter().zip(r_c))
                .zip(dx_c.chunks_exact_mut(d));
            for (((dy, xr), (&mu, &rs)), dxr) in rows_c {
                xhat.clear();
                xhat.extend(
                    xr.iter()
                        .map(|&v| normalise(v, f64::from(mu), f64::from(rs))),
                );
                let (mut sg, mut sgx) = (0.0f64, 0.0f64);
                for ((&g, &w), &xh) in dy.iter().zip(weight).zip(xhat.iter()) {
                    let gw = f64::from(g * w);
                    sg += gw;
                    sgx += gw * f64::from(xh);
                }
                let (mg, mgx, r) = (sg * inv_d, sgx * inv_d, f64::from(rs));
                for (((o, &g), &w), &xh) in dxr.iter_mut().zip(dy).zip(weight).zip(xhat.iter()) {
                    let v = r * (f64::from(g * w) - mg - f64::from(xh) * mgx);
                    *o += v as f32;
                }
                for (((pw, pb), &g), &xh) in
                    dw.iter_mut().zip(db.iter_mut()).zip(dy).zip(xhat.iter())
                {
                    *pw += g * xh;
                    *pb += g;
                }
            }
        });
    for p in partials.chunks_exact(2 * d) {
        let (pw, pb) = p.split_at(d);
        for (o, &v) in dweight.iter_mut().zip(pw) {
            *o += v;
        }
        for (o, &v) in dbias.iter_mut().zip(pb) {
            *o += v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// Naive f64 LayerNorm: `(out, mean, rstd)`.
    fn reference(
        x: &[f64],
        w: &[f64],
        b: &[f64],
        eps: f64,
        d: usize,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut out, mut mean, mut rstd) = (Vec::new(), Vec::new(), Vec::new());
        for row in x.chunks(d) {
            let mu = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / d as f64;
            let r = 1.0 / (var + eps).sqrt();
            out.extend(
                row.iter()
                    .zip(w)
                    .zip(b)
                    .map(|((v, wi), bi)| (v - mu) * r * wi + bi),
            );
            mean.push(mu);
            rstd.push(r);
        }
        (out, mean, rstd)
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

    fn forward(x: &[f32], w: &[f32], b: &[f32], eps: f32, d: usize) -> [Vec<f32>; 3] {
        let rows = x.len() / d;
        let (mut out, mut mean, mut rstd) = (
            vec![f32::NAN; x.len()],
            vec![f32::NAN; rows],
            vec![f32::NAN; rows],
        );
        layer_norm_forward(x, w, b, eps, d, &mut out, &mut mean, &mut rstd).unwrap();
        [out, mean, rstd]
    }

    #[test]
    fn hand_checked_values() {
        // Row [1, 2, 3, 6]: μ = 3, σ² = (4 + 1 + 0 + 9)/4 = 3.5, r = 1/sqrt(3.5 + 0.5) = 0.5,
        // x̂ = [−1, −0.5, 0, 1.5]; w = [1, 2, 3, 4], b = [0, 1, 0, −1] → [−1, 0, 0, 5].
        // Row [5, 5, 5, 5]: μ = 5, σ² = 0, r = 1/sqrt(0.5) = 1.41421356, x̂ = 0 → y = b.
        let x = [1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0];
        let (w, b) = ([1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, -1.0]);
        let [out, mean, rstd] = forward(&x, &w, &b, 0.5, 4);
        assert_eq!(out, [-1.0, 0.0, 0.0, 5.0, 0.0, 1.0, 0.0, -1.0]);
        assert_eq!(mean, [3.0, 5.0]);
        assert_eq!(rstd[0], 0.5);
        close(rstd[1], std::f64::consts::SQRT_2, 1e-7, "rstd1");
        // d = 1: x̂ = 0, y = b.
        let [out, _, _] = forward(&[7.0, -3.0], &[2.0], &[0.25], 1e-5, 1);
        assert_eq!(out, [0.25, 0.25]);
    }

    #[test]
    fn matches_f64_reference_with_a_large_mean() {
        let mut rng = Rng(21);
        for &(rows, d, offset) in &[(1, 1, 0.0), (5, 37, 0.0), (3, 1280, 100.0), (300, 70, -7.0)] {
            let x: Vec<f32> = rng
                .vec(rows * d, 3.0)
                .iter()
                .map(|v| v + offset as f32)
                .collect();
            let w = rng.vec(d, 2.0);
            let b = rng.vec(d, 1.0);
            let [out, mean, rstd] = forward(&x, &w, &b, 1e-6, d);
            let (ro, rm, rr) = reference(&to64(&x), &to64(&w), &to64(&b), f64::from(1e-6f32), d);
            for (i, (&g, &e)) in out.iter().zip(&ro).enumerate() {
                close(g, e, 1e-6, &format!("out[{i}] rows={rows} d={d}"));
            }
            for i in 0..rows {
                close(mean[i], rm[i], 1e-7, &format!("mean[{i}]"));
                close(rstd[i], rr[i], 1e-7, &format!("rstd[{i}]"));
            }
        }
    }

    /// Central differences of `L = Σ c·out` through the f64 reference, against the f32
    /// backward; `dx`, `dweight` and `dbias` start non-zero to check that they accumulate.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(22);
        for &(rows, d) in &[(1, 1), (3, 7), (4, 19), (300, 70)] {
            let x = rng.vec(rows * d, 2.0);
            let w = rng.vec(d, 1.5);
            let b = rng.vec(d, 0.5);
            let c = rng.vec(rows * d, 1.0);
            let eps = 1e-5f32;
            let [_, mean, rstd] = forward(&x, &w, &b, eps, d);
            let dx0 = rng.vec(rows * d, 1.0);
            let dw0 = rng.vec(d, 1.0);
            let db0 = rng.vec(d, 1.0);
            let (mut dx, mut dw, mut db) = (dx0.clone(), dw0.clone(), db0.clone());
            layer_norm_backward(&c, &x, &w, &mean, &rstd, d, &mut dx, &mut dw, &mut db).unwrap();

            let (x64, w64, b64, c64) = (to64(&x), to64(&w), to64(&b), to64(&c));
            let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                let (o, _, _) = reference(x, w, b, f64::from(eps), d);
                o.iter().zip(&c64).map(|(a, b)| a * b).sum()
            };
            let h = 1e-6;
            let step = if rows * d > 1000 { 97 } else { 1 };
            for i in (0..rows * d).step_by(step) {
                let (mut p, mut m) = (x64.clone(), x64.clone());
                p[i] += h;
                m[i] -= h;
                let g = (loss(&p, &w64, &b64) - loss(&m, &w64, &b64)) / (2.0 * h);
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
                let g = (loss(&x64, &p, &b64) - loss(&x64, &m, &b64)) / (2.0 * h);
                close(
                    dw[i] - dw0[i],
                    g,
                    1e-4,
                    &format!("dw[{i}] rows={rows} d={d}"),
                );
                let (mut p, mut m) = (b64.clone(), b64.clone());
                p[i] += h;
                m[i] -= h;
                let g = (loss(&x64, &w64, &p) - loss(&x64, &w64, &m)) / (2.0 * h);
                close(
                    db[i] - db0[i],
                    g,
                    1e-4,
                    &format!("db[{i}] rows={rows} d={d}"),
                );
            }
        }
    }

    /// Central differences through the f32 op itself (loss summed in f64), on a few
    /// coordinates.
    #[test]
    fn backward_matches_finite_differences_of_the_f32_forward() {
        let mut rng = Rng(23);
        let (rows, d) = (3, 11);
        let x = rng.vec(rows * d, 2.0);
        let w = rng.vec(d, 1.5);
        let b = rng.vec(d, 0.5);
        let c = rng.vec(rows * d, 1.0);
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            let [o, _, _] = forward(x, w, &b, 1e-5, d);
            o.iter()
                .zip(&c)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        let [_, mean, rstd] = forward(&x, &w, &b, 1e-5, d);
        let (mut dx, mut dw, mut db) = (vec![0.0; rows * d], vec![0.0; d], vec![0.0; d]);
        layer_norm_backward(&c, &x, &w, &mean, &rstd, d, &mut dx, &mut dw, &mut db).unwrap();
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
        let (mut out, mut mean, mut rstd) = ([0.0f32; 6], [0.0f32; 2], [0.0f32; 2]);
        let err = |e: E| Err::<(), _>(crate::Error::Core(e));
        let lm = |what, expected, actual| {
            err(E::LengthMismatch {
                what,
                expected,
                actual,
            })
        };
        assert_eq!(
            layer_norm_forward(&x, &w, &w, 1e-6, 0, &mut out, &mut mean, &mut rstd),
            err(E::OutOfRange {
                what: "dim",
                value: 0.0,
                expected: ">= 1"
            })
        );
        assert_eq!(
            layer_norm_forward(&x, &w, &w, 1e-6, 4, &mut out, &mut mean, &mut rstd),
            err(E::NotDivisible {
                what: "x",
                len: 6,
                n: 4
            })
        );
        assert_eq!(
            layer_norm_forward(&x, &w, &w[..2], 1e-6, 3, &mut out, &mut mean, &mut rstd),
            lm("bias", 3, 2)
        );
        assert_eq!(
            layer_norm_forward(&x, &w, &w, 1e-6, 3, &mut out, &mut mean[..1], &mut rstd),
            lm("mean", 2, 1)
        );
        for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(
                layer_norm_forward(&x, &w, &w, eps, 3, &mut out, &mut mean, &mut rstd).is_err()
            );
        }
        let (mut dx, mut dw, mut db) = ([0.0f32; 6], [0.0f32; 3], [0.0f32; 3]);
        assert_eq!(
            layer_norm_backward(&x, &x, &w, &mean, &rstd, 3, &mut dx, &mut dw, &mut db[..1]),
            lm("dbias", 3, 1)
        );
        assert_eq!(
            layer_norm_backward(&x[..3], &x, &w, &mean, &rstd, 3, &mut dx, &mut dw, &mut db),
            lm("dout", 6, 3)
        );
        assert_eq!(
            layer_norm_backward(&x, &x, &w, &mean, &rstd[..1], 3, &mut dx, &mut dw, &mut db),
            lm("rstd", 2, 1)
        );
        // Empty input is fine.
        assert!(layer_norm_forward(&[], &w, &w, 1e-6, 3, &mut [], &mut [], &mut []).is_ok());
        assert!(layer_norm_backward(&[], &[], &w, &[], &[], 3, &mut [], &mut dw, &mut db).is_ok());
    }
}
