//! Training attention (forward and backward) as blocks of GEMMs: per sequence and block of
//! query tokens, for each query head, the scores of the block against every key up to its
//! last token are one product `S = scale·Q·Kᵀ`, the masked softmax runs over the rows of
//! `S` in place, and the output is one product `P·V` — the work of the dot-product loops,
//! at the GEMM's rate. The backward pass recomputes `P` from the saved log-sum-exp in two
//! passes, one owning query rows (`dQ = scale·dS·K`) and one owning key rows
//! (`dV = Σ Pᵀ·dO`, `dK = scale·Σ dSᵀ·Q` over the kv head's query heads and the queries at
//! or after the key), with `dP = dO·Vᵀ` and `dS = P∘(dP − δ)`, `δ_t = dO_t·O_t`.
//!
//! Scratch: two `[block, T]` score matrices per task, nothing `[T, T]`. Every output
//! element is written by one task in a fixed order, so results do not depend on the
//! thread count.
//!
//! Masked and future keys inside a block get probability exactly 0; the products still
//! multiply those zeros by their keys and values, so a non-finite value there (which a
//! finite model never produces) would turn rows into NaN instead of being skipped.

use super::{AttentionInputs, Dims};
use crate::Result;
use crate::exp::exp_nonpositive;
use crate::isa::Isa;
use crate::ops::matmul::{MatLayout, MatMut, MatRef, MatmulDims, matmul_seq, matmul_seq_rounded};
use rayon::prelude::*;

/// Query tokens (forward, dQ) or key tokens (dK/dV) per task.
pub(super) const BLOCK: usize = 64;

/// One head's rows in a `[tokens, heads, D]` activation: token `t0 + i`, head `h`.
fn head_rows(t0: usize, heads: usize, d: usize, h: usize) -> MatLayout {
    MatLayout {
        offset: (t0 * heads + h) * d,
        batch_stride: 0,
        row_stride: heads * d,
        col_stride: 1,
    }
}

/// A contiguous row-major `[rows, cols]` scratch matrix.
fn dense(rows: usize, cols: usize) -> MatLayout {
    MatLayout::row_major(rows, cols)
}

/// One sequence of a call, `(first token, tokens)` in the flattened token order: a row of
/// the batch, or one packed segment.
pub(super) type Span = (usize, usize);

/// A task: `rows` tokens of the sequence at `base` (of `len` tokens), from its token `t0`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Task {
    pub base: usize,
    pub len: usize,
    pub t0: usize,
    pub rows: usize,
}

/// The tasks of `block` tokens over `spans`, in token order (the spans cover the tokens
/// in order, so the tasks cut every `[tokens, …]` buffer into consecutive pieces).
pub(super) fn tasks(spans: &[Span], block: usize) -> Vec<Task> {
    let mut out = Vec::new();
    for &(base, len) in spans {
        for t0 in (0..len).step_by(block.max(1)) {
            let rows = block.min(len - t0);
            out.push(Task {
                base,
                len,
                t0,
                rows,
            });
        }
    }
    out
}

/// `buf` cut into the tasks' pieces of `rows · per_token` elements, in order.
pub(super) fn cut<'a>(
    mut buf: &'a mut [f32],
    per_token: usize,
    tasks: &[Task],
) -> Vec<&'a mut [f32]> {
    let mut pieces = Vec::with_capacity(tasks.len());
    for task in tasks {
        let n = (task.rows * per_token).min(buf.len());
        let (piece, rest) = core::mem::take(&mut buf).split_at_mut(n);
        pieces.push(piece);
        buf = rest;
    }
    pieces
}

/// Forward over `inputs` (checked by the caller) with key validity `mask` `[B, T]`:
/// writes `out` `[B, T, Hq, D]` and `lse` `[B, T, Hq]`, `block` query tokens per task.
pub(super) fn forward(
    dims: &Dims,
    spans: &[Span],
    inputs: AttentionInputs<'_>,
    mask: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    block: usize,
) -> Result<()> {
    let Dims {
        hq,
        hkv,
        d,
        group,
        scale,
        ..
    } = *dims;
    let AttentionInputs { q, k, v, .. } = inputs;
    let q_tok = hq * d;
    let tasks = tasks(spans, block);
    let (outs, lses) = (cut(out, q_tok, &tasks), cut(lse, hq, &tasks));
    tasks.into_par_iter().zip(outs).zip(lses).try_for_each_init(
        Vec::new,
        |scores, ((task, o), l)| {
            let Task { base, t0, rows, .. } = task;
            let keys = t0 + rows; // causal: the block's last query sees keys < t0 + rows
            scores.resize(rows * keys, 0.0);
            let m = mask.get(base..base + keys).unwrap_or_default();
            let (qb, kb) = (base, base);
            for h in 0..hq {
                let g = h / group;
                matmul_seq(
                    MatmulDims {
                        n: rows,
                        k: d,
                        m: keys,
                    },
                    MatRef {
                        data: q,
                        layout: head_rows(qb + t0, hq, d, h),
                    },
                    MatRef {
                        data: k,
                        layout: head_rows(kb, hkv, d, g).t(),
                    },
                    MatMut {
                        data: scores,
                        layout: dense(rows, keys),
                    },
                    scale,
                    0.0,
                )?;
                for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
                    let value = softmax_row(row, m, t0 + r + 1);
                    if let Some(x) = l.get_mut(r * hq + h) {
                        *x = value;
                    }
                }
                matmul_seq(
                    MatmulDims {
                        n: rows,
                        k: keys,
                        m: d,
                    },
                    MatRef {
                        data: scores,
                        layout: dense(rows, keys),
                    },
                    MatRef {
                        data: v,
                        layout: head_rows(kb, hkv, d, g),
                    },
                    MatMut {
                        data: o,
                        layout: head_rows(0, hq, d, h),
                    },
                    1.0,
                    0.0,
                )?;
            }
            Ok(())
        },
    )
}

/// The operands of the backward's products: exact f32, or the tensor-core kernels' bf16
/// (the caller rounds q, k, v and dout; the probabilities and `dS` are rounded here before
/// the products that take them, and `e^x` is the kernels' polynomial without FMA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Operands {
    F32,
    Bf16,
}

/// What the backward pass reads besides the inputs.
pub(super) struct Saved<'a> {
    /// The forward output `[B, T, Hq, D]`.
    pub out: &'a [f32],
    /// The forward log-sum-exp `[B, T, Hq]`.
    pub lse: &'a [f32],
    /// `∂L/∂out` `[B, T, Hq, D]`.
    pub dout: &'a [f32],
}

/// Backward: overwrites `dq`, `dk`, `dv` (shapes of q, k, v), `block` tokens per task.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dims: &Dims,
    spans: &[Span],
    inputs: AttentionInputs<'_>,
    mask: &[f32],
    saved: Saved<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    block: usize,
    operands: Operands,
) -> Result<()> {
    let Dims {
        hq,
        hkv,
        d,
        group,
        scale,
        ..
    } = *dims;
    let AttentionInputs { q, k, v, .. } = inputs;
    let Saved { out, lse, dout } = saved;
    let bf16 = operands == Operands::Bf16;
    let probs = |row: &mut [f32], mask: &[f32], causal: usize, lse: f32| {
        if bf16 {
            probs_row_unfused(row, mask, causal, lse);
        } else {
            probs_row(row, mask, causal, lse);
        }
    };
    let round = |x: &mut [f32]| {
        if bf16 {
            crate::ops::precision::round_bf16_in_place(x);
        }
    };
    let (q_tok, kv_tok) = (hq * d, hkv * d);

    // δ_t = dout_t · out_t: the softmax Jacobian's shared term, per (token, head).
    let mut delta = Vec::with_capacity(lse.len());
    dout.par_chunks(d)
        .zip(out.par_chunks(d))
        .map(|(g, o)| g.iter().zip(o).map(|(x, y)| x * y).sum::<f32>())
        .collect_into_vec(&mut delta);
    let delta = delta.as_slice();

    let tasks = tasks(spans, block);

    // Pass 1, query blocks: dQ_h = scale · dS · K_g.
    let dqs = cut(dq, q_tok, &tasks);
    tasks.par_iter().zip(dqs).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), (task, dq_blk)| {
            let Task { base, t0, rows, .. } = *task;
            let keys = t0 + rows;
            p.resize(rows * keys, 0.0);
            dp.resize(rows * keys, 0.0);
            let m = mask.get(base..base + keys).unwrap_or_default();
            for h in 0..hq {
                let g = h / group;
                let (qrows, krows) = (head_rows(base + t0, hq, d, h), head_rows(base, hkv, d, g));
                let sk = MatmulDims {
                    n: rows,
                    k: d,
                    m: keys,
                };
                matmul_seq_rounded(
                    bf16,
                    sk,
                    MatRef {
                        data: q,
                        layout: qrows,
                    },
                    MatRef {
                        data: k,
                        layout: krows.t(),
                    },
                    MatMut {
                        data: p,
                        layout: dense(rows, keys),
                    },
                    scale,
                    0.0,
                )?;
                matmul_seq_rounded(
                    bf16,
                    sk,
                    MatRef {
                        data: dout,
                        layout: qrows,
                    },
                    MatRef {
                        data: v,
                        layout: krows.t(),
                    },
                    MatMut {
                        data: dp,
                        layout: dense(rows, keys),
                    },
                    1.0,
                    0.0,
                )?;
                for (r, (p_row, dp_row)) in p
                    .chunks_exact_mut(keys)
                    .zip(dp.chunks_exact_mut(keys))
                    .enumerate()
                {
                    let at = (base + t0 + r) * hq + h;
                    let (l, dl) = (
                        lse.get(at).copied().unwrap_or(f32::NAN),
                        delta.get(at).copied().unwrap_or(f32::NAN),
                    );
                    probs(p_row, m, t0 + r + 1, l);
                    ds_row(p_row, dp_row, dl);
                }
                round(dp);
                matmul_seq_rounded(
                    bf16,
                    MatmulDims {
                        n: rows,
                        k: keys,
                        m: d,
                    },
                    MatRef {
                        data: dp,
                        layout: dense(rows, keys),
                    },
                    MatRef {
                        data: k,
                        layout: krows,
                    },
                    MatMut {
                        data: dq_blk,
                        layout: head_rows(0, hq, d, h),
                    },
                    scale,
                    0.0,
                )?;
            }
            Ok::<(), crate::Error>(())
        },
    )?;

    // Pass 2, key blocks: per kv head, sums over its query heads and the queries t ≥ s.
    let (dks, dvs) = (cut(dk, kv_tok, &tasks), cut(dv, kv_tok, &tasks));
    tasks.par_iter().zip(dks).zip(dvs).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), ((task, dk_blk), dv_blk)| {
            let Task {
                base,
                len,
                t0: s0,
                rows: cols, // keys s0..s0 + cols
            } = *task;
            let queries = len - s0; // queries s0..len of the sequence see them
            p.resize(queries * cols, 0.0);
            dp.resize(queries * cols, 0.0);
            let m = mask.get(base + s0..base + s0 + cols).unwrap_or_default();
            for g in 0..hkv {
                let krows = head_rows(base + s0, hkv, d, g);
                for (n_h, h) in (g * group..(g + 1) * group).enumerate() {
                    let qrows = head_rows(base + s0, hq, d, h);
                    let sk = MatmulDims {
                        n: queries,
                        k: d,
                        m: cols,
                    };
                    matmul_seq_rounded(
                        bf16,
                        sk,
                        MatRef {
                            data: q,
                            layout: qrows,
                        },
                        MatRef {
                            data: k,
                            layout: krows.t(),
                        },
                        MatMut {
                            data: p,
                            layout: dense(queries, cols),
                        },
                        scale,
                        0.0,
                    )?;
                    matmul_seq_rounded(
                        bf16,
                        sk,
                        MatRef {
                            data: dout,
                            layout: qrows,
                        },
                        MatRef {
                            data: v,
                            layout: krows.t(),
                        },
                        MatMut {
                            data: dp,
                            layout: dense(queries, cols),
                        },
                        1.0,
                        0.0,
                    )?;
                    for (r, p_row) in p.chunks_exact_mut(cols).enumerate() {
                        let l = lse
                            .get((base + s0 + r) * hq + h)
                            .copied()
                            .unwrap_or(f32::NAN);
                        // Query s0 + r sees keys s0..=s0 + r of this block.
                        probs(p_row, m, r + 1, l);
                    }
                    for (r, (p_row, dp_row)) in p
                        .chunks_exact_mut(cols)
                        .zip(dp.chunks_exact_mut(cols))
                        .enumerate()
                    {
                        let at = (base + s0 + r) * hq + h;
                        ds_row(p_row, dp_row, delta.get(at).copied().unwrap_or(f32::NAN));
                    }
                    round(p);
                    round(dp);
                    let beta = if n_h == 0 { 0.0 } else { 1.0 };
                    let kv_out = head_rows(0, hkv, d, g);
                    matmul_seq_rounded(
                        bf16,
                        MatmulDims {
                            n: cols,
                            k: queries,
                            m: d,
                        },
                        MatRef {
                            data: p,
                            layout: dense(queries, cols).t(),
                        },
                        MatRef {
                            data: dout,
                            layout: qrows,
                        },
                        MatMut {
                            data: dv_blk,
                            layout: kv_out,
                        },
                        1.0,
                        beta,
                    )?;
                    matmul_seq_rounded(
                        bf16,
                        MatmulDims {
                            n: cols,
                            k: queries,
                            m: d,
                        },
                        MatRef {
                            data: dp,
                            layout: dense(queries, cols).t(),
                        },
                        MatRef {
                            data: q,
                            layout: qrows,
                        },
                        MatMut {
                            data: dk_blk,
                            layout: kv_out,
                        },
                        scale,
                        beta,
                    )?;
                }
            }
            Ok::<(), crate::Error>(())
        },
    )
}

/// Masked softmax of one query's scores in place. `row` holds `scale·q·k_s` for keys
/// `s < row.len()`; keys `s < causal` with `mask[s] = 1` are kept, the rest get 0. Returns
/// the log-sum-exp of the kept scores: `−∞` with an all-zero row when none is kept, NaN
/// with an all-NaN row when a kept score is not finite.
fn softmax_row(row: &mut [f32], mask: &[f32], causal: usize) -> f32 {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { softmax_row_avx512(row, mask, causal) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { softmax_row_avx2(row, mask, causal) },
        _ => softmax_row_portable::<false>(row, mask, causal),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn softmax_row_avx512(row: &mut [f32], mask: &[f32], causal: usize) -> f32 {
    softmax_row_portable::<true>(row, mask, causal)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_row_avx2(row: &mut [f32], mask: &[f32], causal: usize) -> f32 {
    softmax_row_portable::<true>(row, mask, causal)
}

/// Lanes of the element-wise loops (they vectorise at any width).
const LANES: usize = 16;

#[inline(always)]
fn softmax_row_portable<const FMA: bool>(row: &mut [f32], mask: &[f32], causal: usize) -> f32 {
    let causal = causal.min(row.len()).min(mask.len());
    let (kept, rest) = row.split_at_mut(causal);
    rest.fill(0.0);
    let mask = mask.get(..causal).unwrap_or_default();
    // Pass 1: drop masked keys (−∞), the max and a flag for non-finite kept scores.
    let (mut mx, mut bad) = ([f32::NEG_INFINITY; LANES], [0u32; LANES]);
    for (i, (x, &m)) in kept.iter_mut().zip(mask).enumerate() {
        let keep = m == 1.0;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must count as not finite
        let finite = *x > f32::NEG_INFINITY && *x < f32::INFINITY;
        bad[i % LANES] |= u32::from(keep && !finite);
        *x = if keep { *x } else { f32::NEG_INFINITY };
        let lane = &mut mx[i % LANES];
        *lane = if *x > *lane { *x } else { *lane };
    }
    if bad.iter().any(|&b| b != 0) {
        kept.fill(f32::NAN);
        return f32::NAN;
    }
    let max = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if max == f32::NEG_INFINITY {
        kept.fill(0.0);
        return f32::NEG_INFINITY;
    }
    // Pass 2: e = exp(x − max) (masked: exactly 0), summed in f32 lanes, then f64.
    let mut sum = [0.0f32; LANES];
    for (i, x) in kept.iter_mut().enumerate() {
        let e = exp_nonpositive::<FMA>(*x - max);
        *x = e;
        sum[i % LANES] += e;
    }
    let total: f64 = sum.iter().map(|&s| f64::from(s)).sum();
    let inv = (1.0 / total) as f32;
    for x in kept.iter_mut() {
        *x *= inv;
    }
    (f64::from(max) + total.ln()) as f32
}

/// Probabilities of one query from its scores `row` (`scale·q·k_s`) and its log-sum-exp
/// `lse`: `p_s = exp(x_s − lse)` for kept keys (`s < causal`, `mask[s] = 1`), else 0; a
/// row with `lse = −∞` (no valid key) is all 0, one with a NaN `lse` all NaN.
fn probs_row(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { probs_row_avx512(row, mask, causal, lse) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { probs_row_avx2(row, mask, causal, lse) },
        _ => probs_row_portable::<false>(row, mask, causal, lse),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn probs_row_avx512(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    probs_row_portable::<true>(row, mask, causal, lse);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn probs_row_avx2(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    probs_row_portable::<true>(row, mask, causal, lse);
}

/// [`probs_row`] with the CUDA kernels' `exp` (no fused multiply-adds: the bf16 twin's
/// rounding), vectorised on the wide paths — the same bits on every path.
fn probs_row_unfused(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { probs_row_unfused_avx512(row, mask, causal, lse) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { probs_row_unfused_avx2(row, mask, causal, lse) },
        _ => probs_row_portable::<false>(row, mask, causal, lse),
    }
}

// The unfused `exp` in wider registers: Rust never contracts a·b + c into an FMA, so these
// are the portable bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
fn probs_row_unfused_avx512(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    probs_row_portable::<false>(row, mask, causal, lse);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn probs_row_unfused_avx2(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    probs_row_portable::<false>(row, mask, causal, lse);
}

#[inline(always)]
fn probs_row_portable<const FMA: bool>(row: &mut [f32], mask: &[f32], causal: usize, lse: f32) {
    if lse.is_nan() {
        row.fill(f32::NAN);
        return;
    }
    let causal = causal.min(row.len()).min(mask.len());
    let (kept, rest) = row.split_at_mut(causal);
    rest.fill(0.0);
    if lse == f32::NEG_INFINITY {
        kept.fill(0.0);
        return;
    }
    for (x, &m) in kept.iter_mut().zip(mask) {
        // min(0): the recomputed score may round a hair above the forward's lse.
        let e = exp_nonpositive::<FMA>((*x - lse).min(0.0));
        *x = if m == 1.0 { e } else { 0.0 };
    }
}

/// `dS = P∘(dP − δ)` of one query row, into `dp` (`p` unchanged).
#[inline]
fn ds_row(p: &[f32], dp: &mut [f32], delta: f32) {
    for (g, &p) in dp.iter_mut().zip(p) {
        *g = p * (*g - delta);
    }
}
