//! The LM head fused with the per-token log-prob and entropy, forward and backward, from the
//! hidden states: what an RL loss needs of the head without ever holding the `[rows, vocab]`
//! logits (the Liger / Cut-Cross-Entropy idea, for log-probs and entropies rather than a
//! cross-entropy loss).
//!
//! With `x` the hidden states `[rows, hidden]`, `W` the head `[vocab, hidden]` (Hugging Face
//! layout) and `z = x·Wᵀ / T`:
//!
//! ```text
//! forward:   logπ_r = log softmax(z_r)[y_r],   H_r = −Σ_v p_v ln p_v,   p = softmax(z_r)
//! backward:  ∂L/∂logits_r = (g_r/T)·(onehot(y_r) − p) + h_r·(−p∘(ln p + H_r)/T)
//!            ∂L/∂x = ∂L/∂logits · W,   ∂L/∂W += ∂L/∂logitsᵀ · x
//! ```
//!
//! for per-row coefficients `g_r = ∂L/∂logπ_r` and `h_r = ∂L/∂H_r`. Rows run `chunk_rows` at a
//! time: one product for the chunk's logits, the fused row kernels of
//! [`crate::log_prob_entropy`], [`super::log_prob_backward`] and [`super::entropy_backward`]
//! on them, and (backward) the two products of [`super::matmul::linear_backward`]. Scratch:
//! one (forward) or two (backward) `[chunk_rows, vocab]` buffers. The backward recomputes the
//! chunk's logits instead of keeping them, so a whole pass holds O(chunk·vocab) memory.

use crate::error::{Result, check_len, product};
use crate::ops::matmul::{MatmulDims, linear_backward, linear_forward};
use crate::{Logits, log_prob_entropy};
use ares_core::Error as CoreError;

/// Sizes of a fused head call: `rows` hidden states of `hidden` features, `vocab` outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    /// Tokens.
    pub rows: usize,
    /// Features of a hidden state (the head's input).
    pub hidden: usize,
    /// Vocabulary size (the head's output).
    pub vocab: usize,
}

impl HeadDims {
    fn check(&self, x: &[f32], w: &[f32], chunk_rows: usize) -> Result<()> {
        for (what, n) in [
            ("hidden", self.hidden),
            ("vocab", self.vocab),
            ("chunk_rows", chunk_rows),
        ] {
            if n == 0 {
                return Err(CoreError::OutOfRange {
                    what,
                    value: 0.0,
                    expected: ">= 1",
                }
                .into());
            }
        }
        check_len("hidden states", product(self.rows, self.hidden)?, x.len())?;
        check_len("weight", product(self.vocab, self.hidden)?, w.len())?;
        Ok(())
    }

    /// The chunk `[r0, r0 + n)` as a linear layer's dims.
    fn chunk(&self, n: usize) -> MatmulDims {
        MatmulDims {
            n,
            k: self.hidden,
            m: self.vocab,
        }
    }
}

/// Rows per chunk so that one `[chunk, vocab]` f32 buffer is about `bytes` (at least 1).
pub fn chunk_rows_for(vocab: usize, bytes: usize) -> usize {
    (bytes / 4 / vocab.max(1)).max(1)
}

/// Forward: writes `entropy[r]` and, with `targets = (ids, log_prob)`, `log_prob[r]` for every
/// row of `x` `[rows, hidden]` under the head `w` `[vocab, hidden]` at `temperature`,
/// `chunk_rows` rows at a time.
///
/// # Errors
/// Sizes that do not match `dims` (`x`, `w`, `entropy`, the targets), a zero size or
/// `chunk_rows`, and every error of [`crate::log_prob_entropy`] on a chunk's logits (a
/// non-finite logit row, a target out of range, a bad temperature). On an error, rows of
/// earlier chunks may already be written.
pub fn linear_log_prob_entropy(
    x: &[f32],
    w: &[f32],
    dims: HeadDims,
    temperature: f32,
    mut targets: Option<(&[u32], &mut [f32])>,
    entropy: &mut [f32],
    chunk_rows: usize,
) -> Result<()> {
    dims.check(x, w, chunk_rows)?;
    check_len("entropy", dims.rows, entropy.len())?;
    if let Some((ids, lp)) = &targets {
        check_len("targets", dims.rows, ids.len())?;
        check_len("log_prob", dims.rows, lp.len())?;
    }
    let (h, v) = (dims.hidden, dims.vocab);
    let mut logits = vec![0.0f32; product(chunk_rows.min(dims.rows), v)?];
    for r0 in (0..dims.rows).step_by(chunk_rows) {
        let n = chunk_rows.min(dims.rows - r0);
        let z = &mut logits[..n * v];
        linear_forward(&x[r0 * h..(r0 + n) * h], w, None, dims.chunk(n), z)?;
        let t = targets
            .as_mut()
            .map(|(ids, lp)| (&ids[r0..r0 + n], &mut lp[r0..r0 + n]));
        log_prob_entropy(Logits::F32(z), v, temperature, t, &mut entropy[r0..r0 + n])?;
    }
    Ok(())
}

/// Backward: from per-row coefficients `grad_log_prob` (`∂L/∂logπ`, with `targets`) and
/// `grad_entropy` (`∂L/∂H`), **overwrites** `grad_x` `[rows, hidden]` with `∂L/∂x` and **adds**
/// `∂L/∂W` into `grad_w` `[vocab, hidden]` (a head shared with the embedding, or several
/// micro-batches, add up). At least one of the two coefficient sets must be given. Rows whose
/// coefficients are all 0 contribute nothing and their logits are not checked.
///
/// # Errors
/// As [`linear_log_prob_entropy`], plus lengths of the coefficients and gradients, and the
/// errors of [`super::log_prob_backward`] / [`super::entropy_backward`]. On an error,
/// `grad_x` and `grad_w` may be partly written.
#[allow(clippy::too_many_arguments)]
pub fn linear_log_prob_entropy_backward(
    x: &[f32],
    w: &[f32],
    dims: HeadDims,
    temperature: f32,
    log_prob: Option<(&[u32], &[f32])>,
    grad_entropy: Option<&[f32]>,
    grad_x: &mut [f32],
    grad_w: &mut [f32],
    chunk_rows: usize,
) -> Result<()> {
    dims.check(x, w, chunk_rows)?;
    check_len("grad_x", dims.rows * dims.hidden, grad_x.len())?;
    check_len("grad_w", dims.vocab * dims.hidden, grad_w.len())?;
    if let Some((ids, g)) = log_prob {
        check_len("targets", dims.rows, ids.len())?;
        check_len("grad_log_prob", dims.rows, g.len())?;
    }
    if let Some(g) = grad_entropy {
        check_len("grad_entropy", dims.rows, g.len())?;
    }
    if log_prob.is_none() && grad_entropy.is_none() {
        return Err(CoreError::Empty {
            what: "gradients (neither grad_log_prob nor grad_entropy given)",
        }
        .into());
    }
    let (h, v) = (dims.hidden, dims.vocab);
    let cap = product(chunk_rows.min(dims.rows), v)?;
    let (mut logits, mut dlogits) = (vec![0.0f32; cap], vec![0.0f32; cap]);
    for r0 in (0..dims.rows).step_by(chunk_rows) {
        let n = chunk_rows.min(dims.rows - r0);
        let xs = &x[r0 * h..(r0 + n) * h];
        let (z, dz) = (&mut logits[..n * v], &mut dlogits[..n * v]);
        linear_forward(xs, w, None, dims.chunk(n), z)?;
        match log_prob {
            Some((ids, g)) => super::log_prob_backward::log_prob_backward(
                z,
                v,
                temperature,
                &ids[r0..r0 + n],
                &g[r0..r0 + n],
                dz,
            )?,
            None => dz.fill(0.0),
        }
        if let Some(g) = grad_entropy {
            super::entropy_backward::entropy_backward(z, v, temperature, &g[r0..r0 + n], dz)?;
        }
        let gx = &mut grad_x[r0 * h..(r0 + n) * h];
        gx.fill(0.0);
        linear_backward(dz, xs, w, dims.chunk(n), Some(gx), Some(grad_w), None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::rand_vec;

    fn values(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        rand_vec(n, seed)
            .into_iter()
            .map(|v| v * scale / 2.0)
            .collect()
    }

    /// float64 reference of the forward and both gradients, whole logits.
    fn reference(
        x: &[f32],
        w: &[f32],
        d: HeadDims,
        t: f64,
        ids: &[u32],
        g: &[f32],
        gh: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (h, v) = (d.hidden, d.vocab);
        let (mut lp, mut ent) = (vec![0.0; d.rows], vec![0.0; d.rows]);
        let (mut gx, mut gw) = (vec![0.0; d.rows * h], vec![0.0; v * h]);
        for r in 0..d.rows {
            let z: Vec<f64> = (0..v)
                .map(|j| {
                    (0..h)
                        .map(|k| f64::from(x[r * h + k]) * f64::from(w[j * h + k]))
                        .sum::<f64>()
                        / t
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|q| (q - m).exp()).sum::<f64>().ln();
            let p: Vec<f64> = z.iter().map(|q| (q - lse).exp()).collect();
            lp[r] = z[ids[r] as usize] - lse;
            ent[r] = -p.iter().zip(&z).map(|(p, q)| p * (q - lse)).sum::<f64>();
            for j in 0..v {
                let onehot = if j == ids[r] as usize { 1.0 } else { 0.0 };
                let dz = f64::from(g[r]) / t * (onehot - p[j])
                    + f64::from(gh[r]) * (-p[j] * ((z[j] - lse) + ent[r]) / t);
                for k in 0..h {
                    gx[r * h + k] += dz * f64::from(w[j * h + k]);
                    gw[j * h + k] += dz * f64::from(x[r * h + k]);
                }
            }
        }
        (lp, ent, gx, gw)
    }

    fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-30);
        for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(a) - b).abs() <= tol * scale,
                "{what}[{i}]: {a} vs {b}"
            );
        }
    }

    #[test]
    fn equals_the_whole_logits_reference_for_any_chunk() {
        let d = HeadDims {
            rows: 13,
            hidden: 24,
            vocab: 37,
        };
        let (x, w) = (
            values(d.rows * d.hidden, 2.0, 1),
            values(d.vocab * d.hidden, 1.0, 2),
        );
        let ids: Vec<u32> = (0..d.rows as u32)
            .map(|r| (r * 7) % d.vocab as u32)
            .collect();
        let (g, gh) = (values(d.rows, 2.0, 3), values(d.rows, 2.0, 4));
        let t = 0.7f32;
        let (lp_want, ent_want, gx_want, gw_want) =
            reference(&x, &w, d, f64::from(t), &ids, &g, &gh);
        for chunk in [1, 4, 13, 100] {
            let (mut lp, mut ent) = (vec![0.0; d.rows], vec![0.0; d.rows]);
            linear_log_prob_entropy(&x, &w, d, t, Some((&ids, &mut lp)), &mut ent, chunk).unwrap();
            close(&lp, &lp_want, 2e-6, "log_prob");
            close(&ent, &ent_want, 2e-6, "entropy");
            let mut gx = vec![f32::NAN; d.rows * d.hidden]; // overwritten
            let mut gw = vec![1.0f32; d.vocab * d.hidden]; // added into
            linear_log_prob_entropy_backward(
                &x,
                &w,
                d,
                t,
                Some((&ids, &g)),
                Some(&gh),
                &mut gx,
                &mut gw,
                chunk,
            )
            .unwrap();
            close(&gx, &gx_want, 2e-5, "grad_x");
            let gw_plus: Vec<f64> = gw_want.iter().map(|v| v + 1.0).collect();
            close(&gw, &gw_plus, 2e-5, "grad_w");
        }
    }

    #[test]
    fn entropy_only_and_log_prob_only_backward() {
        let d = HeadDims {
            rows: 5,
            hidden: 8,
            vocab: 11,
        };
        let (x, w) = (
            values(d.rows * d.hidden, 2.0, 5),
            values(d.vocab * d.hidden, 1.0, 6),
        );
        let ids = vec![1u32, 2, 3, 4, 5];
        let zero = vec![0.0f32; d.rows];
        let g = values(d.rows, 2.0, 7);
        for (lp, gh) in [(Some(&g), None), (None, Some(&g))] {
            let (_, _, gx_want, gw_want) = reference(
                &x,
                &w,
                d,
                1.0,
                &ids,
                lp.unwrap_or(&zero),
                gh.unwrap_or(&zero),
            );
            let (mut gx, mut gw) = (vec![0.0; d.rows * d.hidden], vec![0.0; d.vocab * d.hidden]);
            let log_prob = lp.map(|g| (ids.as_slice(), g.as_slice()));
            linear_log_prob_entropy_backward(
                &x,
                &w,
                d,
                1.0,
                log_prob,
                gh.map(|g| g.as_slice()),
                &mut gx,
                &mut gw,
                2,
            )
            .unwrap();
            close(&gx, &gx_want, 2e-5, "grad_x");
            close(&gw, &gw_want, 2e-5, "grad_w");
        }
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let d = HeadDims {
            rows: 2,
            hidden: 3,
            vocab: 4,
        };
        let (x, w) = (vec![0.0; 6], vec![0.0; 12]);
        let mut ent = vec![0.0; 2];
        let e = linear_log_prob_entropy(&x, &w[..11], d, 1.0, None, &mut ent, 1).unwrap_err();
        assert!(e.to_string().contains("weight"), "{e}");
        let e = linear_log_prob_entropy(&x, &w, d, 1.0, None, &mut ent, 0).unwrap_err();
        assert!(e.to_string().contains("chunk_rows"), "{e}");
        let mut lp = vec![0.0; 2];
        let e = linear_log_prob_entropy(&x, &w, d, 1.0, Some((&[0, 4], &mut lp)), &mut ent, 1)
            .unwrap_err();
        assert!(e.to_string().to_lowercase().contains("target"), "{e}");
        let (mut gx, mut gw) = (vec![0.0; 6], vec![0.0; 12]);
        let e = linear_log_prob_entropy_backward(&x, &w, d, 1.0, None, None, &mut gx, &mut gw, 1)
            .unwrap_err();
        assert!(e.to_string().contains("neither"), "{e}");
        let nan = vec![f32::NAN; 6];
        let e = linear_log_prob_entropy(&nan, &w, d, 1.0, None, &mut ent, 1).unwrap_err();
        assert!(!e.to_string().is_empty());
    }
}
