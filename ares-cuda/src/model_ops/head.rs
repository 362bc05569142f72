//! The LM head fused with the per-token log-prob and entropy, forward and backward, from the
//! hidden states — the twin of `ares_cpu::ops::linear_head` (its formulas and chunking): an
//! RL loss gets `logπ` and `H` per token, and `∂L/∂x`, `∂L/∂W`, without the `[rows, vocab]`
//! logits ever being held. Each chunk of `chunk_rows` rows is one cuBLAS product into a
//! `[chunk, vocab]` f32 scratch, then the row kernels already used by the trainer
//! ([`ModelOps::log_prob_entropy`]; backward [`ModelOps::log_prob_backward`] and
//! [`ModelOps::entropy_backward`] into a second scratch, then the two products of
//! [`ModelOps::linear_backward`]); the backward recomputes each chunk's logits.
//!
//! Operands are f32 or bf16 (what a PyTorch model holds), both of one kind: f32 multiplies
//! in f32 or TF32 ([`GemmPrecision`]), bf16 on bf16 tensor cores with f32 sums — the
//! gradient `∂L/∂z` of a chunk is then rounded to bf16 for its two products, as the
//! trainer's bf16 linear layers round theirs.

use super::{ModelOps, check_len};
use crate::error::{Error, Result};
use crate::gemm::{GemmDims, GemmPrecision, Operand};
use crate::launch::bad;
use cudarc::driver::{CudaView, CudaViewMut};

/// Sizes and precision of a fused head call: `rows` hidden states of `hidden` features,
/// `vocab` outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    /// Tokens.
    pub rows: usize,
    /// Features of a hidden state (the head's input).
    pub hidden: usize,
    /// Vocabulary size (the head's output).
    pub vocab: usize,
    /// How the products multiply: `F32` or `Tf32` for f32 operands, `Bf16` for bf16 ones.
    pub precision: GemmPrecision,
}

impl HeadDims {
    /// Checks sizes, operand kinds and the chunk; the rows of the first chunk.
    fn check(
        &self,
        k: &'static str,
        x: &Operand<'_, '_>,
        w: &Operand<'_, '_>,
        chunk_rows: usize,
    ) -> Result<usize> {
        for (what, n) in [
            ("hidden", self.hidden),
            ("vocab", self.vocab),
            ("chunk_rows", chunk_rows),
        ] {
            if n == 0 {
                return Err(bad(k, format!("`{what}` must be >= 1")));
            }
        }
        let bf16 = |o: &Operand<'_, '_>| matches!(o, Operand::Bf16(_));
        let want_bf16 = self.precision == GemmPrecision::Bf16;
        if bf16(x) != bf16(w) || bf16(x) != want_bf16 {
            return Err(bad(
                k,
                format!(
                    "hidden states ({}) and weight ({}) must both be bf16 for precision Bf16, \
                     both f32 otherwise (precision {:?})",
                    if bf16(x) { "bf16" } else { "f32" },
                    if bf16(w) { "bf16" } else { "f32" },
                    self.precision
                ),
            ));
        }
        let prod = |what: &str, a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| bad(k, format!("{what} = {a} × {b} overflows")))
        };
        check_len(
            k,
            "hidden states",
            prod("rows × hidden", self.rows, self.hidden)?,
            x.len(),
        )?;
        check_len(
            k,
            "weight",
            prod("vocab × hidden", self.vocab, self.hidden)?,
            w.len(),
        )?;
        prod("chunk_rows × vocab", chunk_rows.min(self.rows), self.vocab)?;
        Ok(chunk_rows.min(self.rows))
    }

    /// Chunk `[r0, r0 + n)` as a linear layer's dims.
    fn chunk(&self, n: usize) -> GemmDims {
        GemmDims {
            rows: n,
            in_features: self.hidden,
            out_features: self.vocab,
            precision: self.precision,
        }
    }
}

impl ModelOps {
    /// Forward: `log_prob[r]` and `entropy[r]` of `softmax(x_r·wᵀ / temperature)` for every
    /// row of `x` `[rows, hidden]` under the head `w` `[vocab, hidden]`, with `targets`
    /// `[rows]`, `chunk_rows` rows at a time (one `[chunk, vocab]` f32 scratch, allocated
    /// here). Bad rows (a non-finite logit, a target out of range) give NaN and are reported
    /// at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Sizes that do not match `dims`, a zero size or `chunk_rows`, operands not both of the
    /// precision's kind, a temperature not finite and > 0, a failed launch or allocation.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_log_prob_entropy(
        &self,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
        dims: HeadDims,
        temperature: f32,
        targets: &CudaView<'_, u32>,
        log_prob: &mut CudaViewMut<'_, f32>,
        entropy: &mut CudaViewMut<'_, f32>,
        chunk_rows: usize,
    ) -> Result<()> {
        const K: &str = "linear_log_prob_entropy";
        let first = dims.check(K, &x, &w, chunk_rows)?;
        check_len(K, "targets", dims.rows, targets.len())?;
        check_len(K, "log_prob", dims.rows, log_prob.len())?;
        check_len(K, "entropy", dims.rows, entropy.len())?;
        if dims.rows == 0 {
            return Ok(());
        }
        let v = dims.vocab;
        let mut logits = self.alloc(first * v)?;
        for r0 in (0..dims.rows).step_by(chunk_rows) {
            let n = chunk_rows.min(dims.rows - r0);
            let range = r0 * dims.hidden..(r0 + n) * dims.hidden;
            let (xf, xb);
            let xs = match x {
                Operand::F32(all) => Operand::F32({
                    xf = all.slice(range);
                    &xf
                }),
                Operand::Bf16(all) => Operand::Bf16({
                    xb = all.slice(range);
                    &xb
                }),
            };
            let mut z = logits.slice_mut(..n * v);
            self.linear_any(K, xs, w, None, dims.chunk(n), &mut z, false)?;
            self.log_prob_entropy(
                &z.as_view(),
                v,
                temperature,
                &targets.slice(r0..r0 + n),
                &mut log_prob.slice_mut(r0..r0 + n),
                &mut entropy.slice_mut(r0..r0 + n),
            )?;
        }
        Ok(())
    }

    /// Backward: from per-row coefficients `grad_log_prob` = `(targets, ∂L/∂logπ)` and
    /// `grad_entropy` = `∂L/∂H` (at least one), **overwrites** `grad_x` `[rows, hidden]` with
    /// `∂L/∂x` and **adds** `∂L/∂W` into `grad_w` `[vocab, hidden]`, both f32, recomputing each
    /// chunk's logits (two `[chunk, vocab]` f32 scratches, allocated here). Rows whose
    /// coefficients are 0 contribute nothing. Bad rows give NaN gradients, reported at the
    /// next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// As [`ModelOps::linear_log_prob_entropy`], the coefficients' and gradients' lengths,
    /// neither coefficient given.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_log_prob_entropy_backward(
        &self,
        x: Operand<'_, '_>,
        w: Operand<'_, '_>,
        dims: HeadDims,
        temperature: f32,
        grad_log_prob: Option<(&CudaView<'_, u32>, &CudaView<'_, f32>)>,
        grad_entropy: Option<&CudaView<'_, f32>>,
        grad_x: &mut CudaViewMut<'_, f32>,
        grad_w: &mut CudaViewMut<'_, f32>,
        chunk_rows: usize,
    ) -> Result<()> {
        const K: &str = "linear_log_prob_entropy_backward";
        let first = dims.check(K, &x, &w, chunk_rows)?;
        check_len(K, "grad_x", dims.rows * dims.hidden, grad_x.len())?;
        check_len(K, "grad_w", dims.vocab * dims.hidden, grad_w.len())?;
        if let Some((ids, g)) = grad_log_prob {
            check_len(K, "targets", dims.rows, ids.len())?;
            check_len(K, "grad_log_prob", dims.rows, g.len())?;
        }
        if let Some(g) = grad_entropy {
            check_len(K, "grad_entropy", dims.rows, g.len())?;
        }
        if grad_log_prob.is_none() && grad_entropy.is_none() {
            return Err(Error::BadArgument {
                kernel: K,
                message: "neither grad_log_prob nor grad_entropy given".into(),
            });
        }
        if dims.rows == 0 {
            return Ok(());
        }
        let (h, v) = (dims.hidden, dims.vocab);
        let (mut logits, mut dlogits) = (self.alloc(first * v)?, self.alloc(first * v)?);
        for r0 in (0..dims.rows).step_by(chunk_rows) {
            let n = chunk_rows.min(dims.rows - r0);
            let (xf, xb);
            let xs = match x {
                Operand::F32(all) => Operand::F32({
                    xf = all.slice(r0 * h..(r0 + n) * h);
                    &xf
                }),
                Operand::Bf16(all) => Operand::Bf16({
                    xb = all.slice(r0 * h..(r0 + n) * h);
                    &xb
                }),
            };
            let mut z = logits.slice_mut(..n * v);
            self.linear_any(K, xs, w, None, dims.chunk(n), &mut z, false)?;
            let z = z.as_view();
            let mut dz = dlogits.slice_mut(..n * v);
            match grad_log_prob {
                Some((ids, g)) => self.log_prob_backward(
                    &z,
                    v,
                    temperature,
                    &ids.slice(r0..r0 + n),
                    &g.slice(r0..r0 + n),
                    &mut dz,
                )?,
                None => self.fill(&mut dz, 0.0)?,
            }
            if let Some(g) = grad_entropy {
                self.entropy_backward(&z, v, temperature, &g.slice(r0..r0 + n), &mut dz)?;
            }
            let mut gx = grad_x.slice_mut(r0 * h..(r0 + n) * h);
            self.linear_backward_any(
                K,
                &dz.as_view(),
                xs,
                w,
                dims.chunk(n),
                crate::gemm::Overwrite {
                    dx: true,
                    dw: false,
                },
                Some(&mut gx),
                Some(grad_w),
                None,
            )?;
        }
        Ok(())
    }
}
