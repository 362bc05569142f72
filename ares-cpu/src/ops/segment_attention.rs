//! Non-causal multi-head attention restricted to segments (flash-attn's `cu_seqlens`
//! varlen attention), the attention of the Qwen2-VL / Qwen2.5-VL vision tower: the patches
//! of every image (Qwen2-VL, and Qwen2.5-VL's full-attention layers) or of every window
//! (Qwen2.5-VL's windowed layers) attend to each other and to nothing else.
//!
//! Segments are given by offsets `cu_seqlens` of length `segments + 1`: `cu[0] = 0`,
//! non-decreasing, `cu[segments] = tokens`; segment `i` is tokens `[cu[i], cu[i+1])` and
//! may be empty. For query token `t` of segment `i` and head `h`:
//!
//! ```text
//! s_ts = scale · q[t,h,:] · k[s,h,:]                for s ∈ [cu[i], cu[i+1])
//! lse_t = log Σ_s exp(s_ts),  p_ts = exp(s_ts − lse_t)
//! out[t,h,:] = Σ_s p_ts · v[s,h,:]
//! ```
//!
//! Layouts (row-major f32, as the vision tower's fused qkv projection splits them):
//! q, k, v, out `[tokens, heads, head_dim]`, lse `[tokens, heads]`.
//!
//! Every query sees at least one key (its own), so there are no empty rows. A non-finite
//! score makes its query's row NaN (out and lse), as in [`super::attention`].
//!
//! The backward recomputes the probabilities from the saved lse (FlashAttention-style),
//! with `δ_t = dout_t·out_t`, `ds_ts = p_ts·(dout_t·v_s − δ_t)`:
//! `dq_t = scale·Σ_s ds_ts·k_s`, `dk_s = scale·Σ_t ds_ts·q_t`, `dv_s = Σ_t p_ts·dout_t`.
//!
//! Both directions run as blocks of GEMMs (as `attention::blocked`): one rayon task per
//! (segment, block of 64 query or key tokens), looping over heads; per head the scores of
//! the block against its whole segment are one product, the softmax runs over its rows in
//! place and the output is one more product. Scratch: two `[64, segment length]` score
//! matrices per task. Every output element is written by one task in a fixed order, so
//! results do not depend on the thread count.

use crate::Result;
use crate::error::{check_len, product};
use crate::exp::exp_nonpositive;
use crate::isa::Isa;
use crate::ops::matmul::{MatLayout, MatMut, MatRef, MatmulDims, matmul_seq, matmul_seq_rounded};
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Query tokens (forward, dq) or key tokens (dk, dv) per task.
const BLOCK: usize = 64;

/// Sizes of a segment attention call: `tokens` tokens of `heads` heads of `head_dim`
/// features; logits `scale · q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SegmentAttentionShape {
    /// Tokens over all segments.
    pub tokens: usize,
    /// Heads (q, k and v alike).
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Multiplier of the dot products, finite and > 0; `1/√head_dim` from
    /// [`SegmentAttentionShape::new`].
    pub scale: f32,
}

impl SegmentAttentionShape {
    /// A shape with the standard scale `1/√head_dim` (rounded once from f64).
    pub fn new(tokens: usize, heads: usize, head_dim: usize) -> Self {
        Self {
            tokens,
            heads,
            head_dim,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
        }
    }

    /// Validates the shape; returns `(elements of q, elements of lse)`.
    fn lens(&self) -> Result<(usize, usize)> {
        for (what, n) in [("heads", self.heads), ("head_dim", self.head_dim)] {
            if n == 0 {
                return Err(CoreError::OutOfRange {
                    what,
                    value: 0.0,
                    expected: ">= 1",
                }
                .into());
            }
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(CoreError::OutOfRange {
                what: "scale",
                value: f64::from(self.scale),
                expected: "finite and > 0",
            }
            .into());
        }
        let lse_len = product(self.tokens, self.heads)?;
        Ok((product(lse_len, self.head_dim)?, lse_len))
    }
}

/// Checks segment offsets against `tokens`: at least one entry, `cu[0] = 0`,
/// non-decreasing, last entry `tokens`.
///
/// # Errors
/// `Empty` for no entry, `OutOfRange` naming the first entry that breaks a rule.
pub fn check_cu_seqlens(cu_seqlens: &[u32], tokens: usize) -> Result<()> {
    let (Some(&first), Some(&last)) = (cu_seqlens.first(), cu_seqlens.last()) else {
        return Err(CoreError::Empty { what: "cu_seqlens" }.into());
    };
    if first != 0 {
        return Err(CoreError::OutOfRange {
            what: "cu_seqlens[0]",
            value: f64::from(first),
            expected: "0",
        }
        .into());
    }
    if let Some(w) = cu_seqlens.windows(2).find(|w| w[1] < w[0]) {
        return Err(CoreError::OutOfRange {
            what: "cu_seqlens",
            value: f64::from(w[1]),
            expected: "non-decreasing offsets (an entry is below the one before it)",
        }
        .into());
    }
    if last as usize != tokens {
        return Err(CoreError::OutOfRange {
            what: "cu_seqlens (last entry)",
            value: f64::from(last),
            expected: "equal to tokens",
        }
        .into());
    }
    Ok(())
}

/// One head's rows in a `[tokens, heads, D]` activation: token `t0 + i`, head `h`.
fn head_rows(t0: usize, heads: usize, d: usize, h: usize) -> MatLayout {
    MatLayout {
        offset: (t0 * heads + h) * d,
        batch_stride: 0,
        row_stride: heads * d,
        col_stride: 1,
    }
}

/// A task: tokens `[t0, t1)` of the segment `[s0, s1)`.
#[derive(Clone, Copy)]
struct Block {
    s0: usize,
    s1: usize,
    t0: usize,
    t1: usize,
}

/// The blocks of at most [`BLOCK`] tokens of every segment, in token order (they tile
/// `[0, tokens)`: offsets were checked).
fn blocks(cu: &[u32]) -> Vec<Block> {
    let mut out = Vec::new();
    for w in cu.windows(2) {
        let (s0, s1) = (w[0] as usize, w[1] as usize);
        for t0 in (s0..s1).step_by(BLOCK) {
            out.push(Block {
                s0,
                s1,
                t0,
                t1: (t0 + BLOCK).min(s1),
            });
        }
    }
    out
}

/// Splits `data` into consecutive pieces of `(t1 − t0)·per_token` elements, one per block.
fn split_by_blocks<'a>(
    mut data: &'a mut [f32],
    blocks: &[Block],
    per_token: usize,
) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        let n = ((b.t1 - b.t0) * per_token).min(data.len());
        let (head, rest) = std::mem::take(&mut data).split_at_mut(n);
        out.push(head);
        data = rest;
    }
    out
}

/// Segment attention forward: writes `out` `[tokens, heads, head_dim]` and the
/// log-sum-exp of the scaled logits `lse` `[tokens, heads]` (module docs for the formula).
///
/// # Errors
/// `heads` or `head_dim` 0, a scale not finite and > 0, offsets `cu_seqlens` that are not
/// valid ([`check_cu_seqlens`]), or a length not matching the shape (named).
pub fn segment_attention_forward(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    check_forward(shape, cu_seqlens, [q, k, v], out, lse)?;
    let (h, d, scale) = (shape.heads, shape.head_dim, shape.scale);
    let blocks = blocks(cu_seqlens);
    let outs = split_by_blocks(out, &blocks, h * d);
    let lses = split_by_blocks(lse, &blocks, h);
    blocks
        .into_par_iter()
        .zip(outs)
        .zip(lses)
        .try_for_each_init(Vec::new, |scores, ((b, o), l)| {
            let (rows, keys) = (b.t1 - b.t0, b.s1 - b.s0);
            scores.resize(rows * keys, 0.0);
            for hh in 0..h {
                matmul_seq(
                    MatmulDims {
                        n: rows,
                        k: d,
                        m: keys,
                    },
                    MatRef {
                        data: q,
                        layout: head_rows(b.t0, h, d, hh),
                    },
                    MatRef {
                        data: k,
                        layout: head_rows(b.s0, h, d, hh).t(),
                    },
                    MatMut {
                        data: scores,
                        layout: MatLayout::row_major(rows, keys),
                    },
                    scale,
                    0.0,
                )?;
                for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
                    let value = softmax_row(row);
                    if let Some(x) = l.get_mut(r * h + hh) {
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
                        layout: MatLayout::row_major(rows, keys),
                    },
                    MatRef {
                        data: v,
                        layout: head_rows(b.s0, h, d, hh),
                    },
                    MatMut {
                        data: o,
                        layout: head_rows(0, h, d, hh),
                    },
                    1.0,
                    0.0,
                )?;
            }
            Ok(())
        })
}

/// The checks of a forward call.
fn check_forward(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    [q, k, v]: [&[f32]; 3],
    out: &[f32],
    lse: &[f32],
) -> Result<()> {
    let (q_len, lse_len) = shape.lens()?;
    check_cu_seqlens(cu_seqlens, shape.tokens)?;
    check_len("q", q_len, q.len())?;
    check_len("k", q_len, k.len())?;
    check_len("v", q_len, v.len())?;
    check_len("out", q_len, out.len())?;
    check_len("lse", lse_len, lse.len())
}

/// [`segment_attention_forward`] with bf16 operands, as the CUDA tensor-core kernel computes
/// it (its twin): q, k, v rounded to bf16, keys in tiles of
/// [`crate::ops::attention::tensor_core::KEY_TILE`] at multiples of it in token order (a
/// tile reaching outside the query's segment counts only the keys inside), the online
/// softmax and rounded probabilities of `attention::attention_forward_bf16`.
///
/// # Errors
/// As [`segment_attention_forward`].
pub fn segment_attention_forward_bf16(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    use crate::ops::attention::tensor_core::{FRESH, KEY_TILE, finish_row, online_tile};
    check_forward(shape, cu_seqlens, [q, k, v], out, lse)?;
    let (h, d, scale) = (shape.heads, shape.head_dim, shape.scale);
    let bf16 = crate::ops::precision::MatmulPrecision::Bf16;
    let (q, k, v) = (bf16.rounded(q), bf16.rounded(k), bf16.rounded(v));
    let (q, k, v) = (&*q, &*k, &*v);
    let ones = [1.0f32; KEY_TILE];
    let blocks = blocks(cu_seqlens);
    let outs = split_by_blocks(out, &blocks, h * d);
    let lses = split_by_blocks(lse, &blocks, h);
    blocks
        .into_par_iter()
        .zip(outs)
        .zip(lses)
        .try_for_each_init(
            || (Vec::new(), Vec::new()),
            |(tile, state), ((b, o), l)| {
                let rows = b.t1 - b.t0;
                o.fill(0.0);
                for hh in 0..h {
                    state.clear();
                    state.resize(rows, FRESH);
                    for k0 in (b.s0 / KEY_TILE * KEY_TILE..b.s1).step_by(KEY_TILE) {
                        let (ka, kz) = (k0.max(b.s0), (k0 + KEY_TILE).min(b.s1));
                        let kn = kz - ka;
                        tile.resize(rows * kn, 0.0);
                        matmul_seq_rounded(
                            true,
                            MatmulDims {
                                n: rows,
                                k: d,
                                m: kn,
                            },
                            MatRef {
                                data: q,
                                layout: head_rows(b.t0, h, d, hh),
                            },
                            MatRef {
                                data: k,
                                layout: head_rows(ka, h, d, hh).t(),
                            },
                            MatMut {
                                data: tile,
                                layout: MatLayout::row_major(rows, kn),
                            },
                            scale,
                            0.0,
                        )?;
                        for (r, (row, st)) in
                            tile.chunks_exact_mut(kn).zip(state.iter_mut()).enumerate()
                        {
                            let alpha = online_tile(row, &ones, kn, st);
                            for x in o
                                .get_mut((r * h + hh) * d..(r * h + hh + 1) * d)
                                .into_iter()
                                .flatten()
                            {
                                *x *= alpha;
                            }
                        }
                        matmul_seq_rounded(
                            true,
                            MatmulDims {
                                n: rows,
                                k: kn,
                                m: d,
                            },
                            MatRef {
                                data: tile,
                                layout: MatLayout::row_major(rows, kn),
                            },
                            MatRef {
                                data: v,
                                layout: head_rows(ka, h, d, hh),
                            },
                            MatMut {
                                data: o,
                                layout: head_rows(0, h, d, hh),
                            },
                            1.0,
                            1.0,
                        )?;
                    }
                    for (r, st) in state.iter().enumerate() {
                        let o_row = o.get_mut((r * h + hh) * d..(r * h + hh + 1) * d);
                        finish_row(st, o_row, l.get_mut(r * h + hh));
                    }
                }
                Ok(())
            },
        )
}

/// What [`segment_attention_backward`] reads besides q, k and v.
#[derive(Debug, Clone, Copy)]
pub struct SegmentAttentionSaved<'a> {
    /// The forward output `[tokens, heads, head_dim]`.
    pub out: &'a [f32],
    /// The forward log-sum-exp `[tokens, heads]`.
    pub lse: &'a [f32],
    /// `∂L/∂out` `[tokens, heads, head_dim]`.
    pub dout: &'a [f32],
}

/// Segment attention backward: from `saved.dout` **overwrites** `dq`, `dk`, `dv` (shapes
/// of q; module docs for the formulas). `saved.out` and `saved.lse` are what
/// [`segment_attention_forward`] wrote for the same inputs. Two passes, one over query
/// blocks (dq) and one over key blocks (dk, dv), so no two tasks write one element.
///
/// # Errors
/// As [`segment_attention_forward`], and for the lengths of `out`, `lse`, `dout`, `dq`,
/// `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub fn segment_attention_backward(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    saved: SegmentAttentionSaved<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    backward_with(shape, cu_seqlens, [q, k, v], saved, [dq, dk, dv], false)
}

/// The backward of [`segment_attention_forward_bf16`] as the CUDA tensor-core kernels
/// compute it (their twin): [`segment_attention_backward`] with q, k, v and `dout` rounded
/// to bf16 (δ from the rounded `dout`), `p = e^(min(s − lse, 0))` by the kernels' `exp`, and
/// `p` and `dS` rounded to bf16 for the products that take them; f32 sums.
///
/// # Errors
/// As [`segment_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn segment_attention_backward_bf16(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    saved: SegmentAttentionSaved<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    let bf16 = crate::ops::precision::MatmulPrecision::Bf16;
    let (q, k, v, dout) = (
        bf16.rounded(q),
        bf16.rounded(k),
        bf16.rounded(v),
        bf16.rounded(saved.dout),
    );
    let saved = SegmentAttentionSaved {
        dout: &dout,
        ..saved
    };
    backward_with(shape, cu_seqlens, [&q, &k, &v], saved, [dq, dk, dv], true)
}

/// The backward in f32, or with the tensor-core kernels' bf16 rounding of `p` and `dS` (the
/// caller rounds the inputs).
fn backward_with(
    shape: &SegmentAttentionShape,
    cu_seqlens: &[u32],
    [q, k, v]: [&[f32]; 3],
    saved: SegmentAttentionSaved<'_>,
    [dq, dk, dv]: [&mut [f32]; 3],
    bf16: bool,
) -> Result<()> {
    let probs = |row: &mut [f32], lse: f32| {
        if bf16 {
            probs_row_unfused(row, lse);
        } else {
            probs_row(row, lse);
        }
    };
    let round = |x: &mut [f32]| {
        if bf16 {
            crate::ops::precision::round_bf16_in_place(x);
        }
    };
    let (q_len, lse_len) = shape.lens()?;
    check_cu_seqlens(cu_seqlens, shape.tokens)?;
    let SegmentAttentionSaved { out, lse, dout } = saved;
    check_len("q", q_len, q.len())?;
    check_len("k", q_len, k.len())?;
    check_len("v", q_len, v.len())?;
    check_len("out", q_len, out.len())?;
    check_len("lse", lse_len, lse.len())?;
    check_len("dout", q_len, dout.len())?;
    check_len("dq", q_len, dq.len())?;
    check_len("dk", q_len, dk.len())?;
    check_len("dv", q_len, dv.len())?;
    let (h, d, scale) = (shape.heads, shape.head_dim, shape.scale);

    // δ = dout · out per (token, head).
    let mut delta = Vec::with_capacity(lse_len);
    dout.par_chunks(d)
        .zip(out.par_chunks(d))
        .map(|(g, o)| g.iter().zip(o).map(|(x, y)| x * y).sum::<f32>())
        .collect_into_vec(&mut delta);
    let delta = delta.as_slice();
    let blocks = blocks(cu_seqlens);

    // Pass 1, query blocks: dQ = scale · dS · K.
    let dqs = split_by_blocks(dq, &blocks, h * d);
    blocks.par_iter().zip(dqs).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), (b, dq_blk)| {
            let (rows, keys) = (b.t1 - b.t0, b.s1 - b.s0);
            p.resize(rows * keys, 0.0);
            dp.resize(rows * keys, 0.0);
            let dense = MatLayout::row_major(rows, keys);
            for hh in 0..h {
                let (qrows, krows) = (head_rows(b.t0, h, d, hh), head_rows(b.s0, h, d, hh));
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
                        layout: dense,
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
                        layout: dense,
                    },
                    1.0,
                    0.0,
                )?;
                for (r, (p_row, dp_row)) in p
                    .chunks_exact_mut(keys)
                    .zip(dp.chunks_exact_mut(keys))
                    .enumerate()
                {
                    let at = (b.t0 + r) * h + hh;
                    probs(p_row, lse.get(at).copied().unwrap_or(f32::NAN));
                    ds_row(p_row, dp_row, delta.get(at).copied().unwrap_or(f32::NAN));
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
                        layout: dense,
                    },
                    MatRef {
                        data: k,
                        layout: krows,
                    },
                    MatMut {
                        data: dq_blk,
                        layout: head_rows(0, h, d, hh),
                    },
                    scale,
                    0.0,
                )?;
            }
            Ok::<(), crate::Error>(())
        },
    )?;

    // Pass 2, key blocks: dV = Pᵀ · dO and dK = scale · dSᵀ · Q over the segment's queries.
    let dks = split_by_blocks(dk, &blocks, h * d);
    let dvs = split_by_blocks(dv, &blocks, h * d);
    blocks.par_iter().zip(dks).zip(dvs).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), ((b, dk_blk), dv_blk)| {
            // Keys t0..t1 (the block), queries s0..s1 (the whole segment).
            let (cols, queries) = (b.t1 - b.t0, b.s1 - b.s0);
            p.resize(queries * cols, 0.0);
            dp.resize(queries * cols, 0.0);
            let dense = MatLayout::row_major(queries, cols);
            for hh in 0..h {
                let (qrows, krows) = (head_rows(b.s0, h, d, hh), head_rows(b.t0, h, d, hh));
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
                        layout: dense,
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
                        layout: dense,
                    },
                    1.0,
                    0.0,
                )?;
                for (r, (p_row, dp_row)) in p
                    .chunks_exact_mut(cols)
                    .zip(dp.chunks_exact_mut(cols))
                    .enumerate()
                {
                    let at = (b.s0 + r) * h + hh;
                    probs(p_row, lse.get(at).copied().unwrap_or(f32::NAN));
                    ds_row(p_row, dp_row, delta.get(at).copied().unwrap_or(f32::NAN));
                }
                round(p);
                round(dp);
                let kv_out = head_rows(0, h, d, hh);
                let back = MatmulDims {
                    n: cols,
                    k: queries,
                    m: d,
                };
                matmul_seq_rounded(
                    bf16,
                    back,
                    MatRef {
                        data: p,
                        layout: dense.t(),
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
                    0.0,
                )?;
                matmul_seq_rounded(
                    bf16,
                    back,
                    MatRef {
                        data: dp,
                        layout: dense.t(),
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
                    0.0,
                )?;
            }
            Ok::<(), crate::Error>(())
        },
    )
}

/// Lanes of the element-wise loops (they vectorise at any width).
const LANES: usize = 16;

/// Softmax of one query's scores in place; returns their log-sum-exp. A row holding a
/// non-finite score becomes all NaN and returns NaN. `row` is not empty.
fn softmax_row(row: &mut [f32]) -> f32 {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { softmax_row_avx512(row) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { softmax_row_avx2(row) },
        _ => softmax_row_portable::<false>(row),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn softmax_row_avx512(row: &mut [f32]) -> f32 {
    softmax_row_portable::<true>(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_row_avx2(row: &mut [f32]) -> f32 {
    softmax_row_portable::<true>(row)
}

#[inline(always)]
fn softmax_row_portable<const FMA: bool>(row: &mut [f32]) -> f32 {
    // Pass 1: the max, and a flag for non-finite scores.
    let (mut mx, mut bad) = ([f32::NEG_INFINITY; LANES], [0u32; LANES]);
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for ((m, b), &x) in mx.iter_mut().zip(bad.iter_mut()).zip(c) {
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must count as not finite
            let finite = x > f32::NEG_INFINITY && x < f32::INFINITY;
            *b |= u32::from(!finite);
            *m = if x > *m { x } else { *m };
        }
    }
    for ((m, b), &x) in mx.iter_mut().zip(bad.iter_mut()).zip(chunks.remainder()) {
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let finite = x > f32::NEG_INFINITY && x < f32::INFINITY;
        *b |= u32::from(!finite);
        *m = if x > *m { x } else { *m };
    }
    if bad.iter().any(|&b| b != 0) || row.is_empty() {
        row.fill(f32::NAN);
        return f32::NAN;
    }
    let max = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    // Pass 2: e = exp(x − max), summed in f32 lanes, then f64.
    let mut sum = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, x) in sum.iter_mut().zip(c.iter_mut()) {
            *x = exp_nonpositive::<FMA>(*x - max);
            *s += *x;
        }
    }
    for (s, x) in sum.iter_mut().zip(chunks.into_remainder()) {
        *x = exp_nonpositive::<FMA>(*x - max);
        *s += *x;
    }
    let total: f64 = sum.iter().map(|&s| f64::from(s)).sum();
    let inv = (1.0 / total) as f32;
    for x in row.iter_mut() {
        *x *= inv;
    }
    (f64::from(max) + total.ln()) as f32
}

/// Probabilities of one query from its scores `row` and its log-sum-exp:
/// `p_s = exp(x_s − lse)` (clamped at 1: a recomputed score may round a hair above lse);
/// all NaN for a NaN `lse` (the forward's row was NaN).
fn probs_row(row: &mut [f32], lse: f32) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { probs_row_avx512(row, lse) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { probs_row_avx2(row, lse) },
        _ => probs_row_portable::<false>(row, lse),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn probs_row_avx512(row: &mut [f32], lse: f32) {
    probs_row_portable::<true>(row, lse);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn probs_row_avx2(row: &mut [f32], lse: f32) {
    probs_row_portable::<true>(row, lse);
}

/// [`probs_row`] with the CUDA kernels' `exp` (no fused multiply-adds: the bf16 twin's
/// rounding), vectorised on the wide paths — the same bits on every path.
fn probs_row_unfused(row: &mut [f32], lse: f32) {
    match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { probs_row_unfused_avx512(row, lse) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { probs_row_unfused_avx2(row, lse) },
        _ => probs_row_portable::<false>(row, lse),
    }
}

// The unfused `exp` in wider registers: Rust never contracts a·b + c into an FMA, so these
// are the portable bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
fn probs_row_unfused_avx512(row: &mut [f32], lse: f32) {
    probs_row_portable::<false>(row, lse);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn probs_row_unfused_avx2(row: &mut [f32], lse: f32) {
    probs_row_portable::<false>(row, lse);
}

#[inline(always)]
fn probs_row_portable<const FMA: bool>(row: &mut [f32], lse: f32) {
    if !lse.is_finite() {
        row.fill(f32::NAN);
        return;
    }
    for x in row.iter_mut() {
        *x = exp_nonpositive::<FMA>((*x - lse).min(0.0));
    }
}

/// `dS = P∘(dP − δ)` of one query row, into `dp` (`p` unchanged).
#[inline]
fn ds_row(p: &[f32], dp: &mut [f32], delta: f32) {
    for (g, &p) in dp.iter_mut().zip(p) {
        *g = p * (*g - delta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// Naive f64 segment attention: `(out, lse)`.
    fn reference(
        shape: &SegmentAttentionShape,
        cu: &[u32],
        q: &[f64],
        k: &[f64],
        v: &[f64],
    ) -> (Vec<f64>, Vec<f64>) {
        let (h, d) = (shape.heads, shape.head_dim);
        let scale = f64::from(shape.scale);
        let mut out = vec![0.0; shape.tokens * h * d];
        let mut lse = vec![0.0; shape.tokens * h];
        for w in cu.windows(2) {
            let (s0, s1) = (w[0] as usize, w[1] as usize);
            for t in s0..s1 {
                for hh in 0..h {
                    let qr = &q[(t * h + hh) * d..][..d];
                    let scores: Vec<f64> = (s0..s1)
                        .map(|s| {
                            let kr = &k[(s * h + hh) * d..][..d];
                            scale * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    lse[t * h + hh] = m + z.ln();
                    for (j, s) in (s0..s1).enumerate() {
                        let p = (scores[j] - m).exp() / z;
                        for c in 0..d {
                            out[(t * h + hh) * d + c] += p * v[(s * h + hh) * d + c];
                        }
                    }
                }
            }
        }
        (out, lse)
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

    fn forward(shape: &SegmentAttentionShape, cu: &[u32], qkv: [&[f32]; 3]) -> [Vec<f32>; 2] {
        let n = shape.tokens * shape.heads;
        let (mut out, mut lse) = (vec![f32::NAN; n * shape.head_dim], vec![f32::NAN; n]);
        segment_attention_forward(shape, cu, qkv[0], qkv[1], qkv[2], &mut out, &mut lse).unwrap();
        [out, lse]
    }

    #[test]
    fn hand_checked_values() {
        // One head of dim 2, scale 1; segments {0, 1} and {2}.
        // Token 0: q = (1, 0), keys (1, 0), (0, 1) → scores (1, 0),
        // p = (e/(e+1), 1/(e+1)) = (0.7310586, 0.2689414), lse = ln(e + 1) = 1.3132617;
        // v = (2, 4), (6, 8) → out = (2·0.7310586 + 6·0.2689414, 4·0.7310586 + 8·0.2689414)
        // = (3.0757656, 5.0757656).
        // Token 1: q = (0, 0) → scores (0, 0), p = (½, ½), lse = ln 2, out = (4, 6).
        // Token 2 (alone): p = 1, lse = q·k = 3·1 + 1·(−1) = 2, out = v = (−1, 5).
        let shape = SegmentAttentionShape {
            tokens: 3,
            heads: 1,
            head_dim: 2,
            scale: 1.0,
        };
        let q = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0];
        let k = [1.0, 0.0, 0.0, 1.0, 1.0, -1.0];
        let v = [2.0, 4.0, 6.0, 8.0, -1.0, 5.0];
        let [out, lse] = forward(&shape, &[0, 2, 2, 3], [&q, &k, &v]);
        let want = [3.075_765_6, 5.075_765_6, 4.0, 6.0, -1.0, 5.0];
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            close(g, w, 1e-6, &format!("out[{i}]"));
        }
        close(lse[0], 1.313_261_687_518_223, 1e-6, "lse0");
        close(lse[1], std::f64::consts::LN_2, 1e-6, "lse1");
        close(lse[2], 2.0, 1e-6, "lse2");
    }

    #[test]
    fn matches_f64_reference_with_empty_and_long_segments() {
        let mut rng = Rng(41);
        // Segments: 0, 5, 0, 70 (two blocks), 1, 130 (three blocks), 0.
        let cu = [0u32, 0, 5, 5, 75, 76, 206, 206];
        let shape = SegmentAttentionShape::new(206, 3, 16);
        let n = shape.tokens * shape.heads * shape.head_dim;
        let (q, k, v) = (rng.vec(n, 2.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let [out, lse] = forward(&shape, &cu, [&q, &k, &v]);
        let (ro, rl) = reference(&shape, &cu, &to64(&q), &to64(&k), &to64(&v));
        for (i, (&g, &e)) in out.iter().zip(&ro).enumerate() {
            close(g, e, 2e-6, &format!("out[{i}]"));
        }
        for (i, (&g, &e)) in lse.iter().zip(&rl).enumerate() {
            close(g, e, 2e-6, &format!("lse[{i}]"));
        }
    }

    #[test]
    fn a_non_finite_score_makes_its_row_nan_only() {
        let shape = SegmentAttentionShape::new(4, 1, 2);
        let q = [1.0, 0.0, f32::INFINITY, 0.0, 1.0, 1.0, 0.5, 0.5];
        let k = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 2.0, 2.0];
        let v = [1.0; 8];
        // Segments {0, 1}, {2, 3}: token 1's scores are ±inf·… → NaN row; token 0 fine.
        let [out, lse] = forward(&shape, &[0, 2, 4], [&q, &k, &v]);
        assert!(out[2].is_nan() && out[3].is_nan() && lse[1].is_nan());
        for i in [0, 1, 4, 5, 6, 7] {
            close(out[i], 1.0, 1e-6, &format!("out[{i}]"));
        }
    }

    /// Central differences of `L = Σ c·out` through the f64 reference, against the f32
    /// backward, which must overwrite (the gradients start as garbage).
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(42);
        for (cu, heads, d) in [(vec![0u32, 3, 3, 7], 2, 4), (vec![0u32, 70, 71, 100], 2, 3)] {
            let tokens = *cu.last().unwrap() as usize;
            let shape = SegmentAttentionShape::new(tokens, heads, d);
            let n = tokens * heads * d;
            let (q, k, v) = (rng.vec(n, 1.5), rng.vec(n, 1.5), rng.vec(n, 1.0));
            let c = rng.vec(n, 1.0);
            let [out, lse] = forward(&shape, &cu, [&q, &k, &v]);
            let (mut dq, mut dk, mut dv) = (vec![7.0; n], vec![7.0; n], vec![7.0; n]);
            let saved = SegmentAttentionSaved {
                out: &out,
                lse: &lse,
                dout: &c,
            };
            segment_attention_backward(&shape, &cu, &q, &k, &v, saved, &mut dq, &mut dk, &mut dv)
                .unwrap();
            let qkv64 = [to64(&q), to64(&k), to64(&v)];
            let c64 = to64(&c);
            let loss = |x: &[Vec<f64>; 3]| -> f64 {
                let (o, _) = reference(&shape, &cu, &x[0], &x[1], &x[2]);
                o.iter().zip(&c64).map(|(a, b)| a * b).sum()
            };
            let h = 1e-6;
            let step = if n > 200 { 13 } else { 1 };
            for i in (0..n).step_by(step) {
                for (which, grad) in [&dq, &dk, &dv].into_iter().enumerate() {
                    let (mut p, mut m) = (qkv64.clone(), qkv64.clone());
                    p[which][i] += h;
                    m[which][i] -= h;
                    let g = (loss(&p) - loss(&m)) / (2.0 * h);
                    let name = ["dq", "dk", "dv"][which];
                    close(grad[i], g, 1e-4, &format!("{name}[{i}] cu={cu:?}"));
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let mut rng = Rng(43);
        let cu = [0u32, 150, 300];
        let shape = SegmentAttentionShape::new(300, 2, 8);
        let n = 300 * 2 * 8;
        let (q, k, v, c) = (
            rng.vec(n, 1.0),
            rng.vec(n, 1.0),
            rng.vec(n, 1.0),
            rng.vec(n, 1.0),
        );
        let run = || {
            let [out, lse] = forward(&shape, &cu, [&q, &k, &v]);
            let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let saved = SegmentAttentionSaved {
                out: &out,
                lse: &lse,
                dout: &c,
            };
            segment_attention_backward(&shape, &cu, &q, &k, &v, saved, &mut dq, &mut dk, &mut dv)
                .unwrap();
            (out, lse, dq, dk, dv)
        };
        let many = run();
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(run);
        assert!(many == one);
    }

    #[test]
    fn rejects_bad_shapes_and_offsets() {
        use ares_core::Error as E;
        let shape = SegmentAttentionShape::new(3, 2, 2);
        let x = [0.5f32; 12];
        let (mut out, mut lse) = ([0.0f32; 12], [0.0f32; 6]);
        let mut run = |shape: SegmentAttentionShape, cu: &[u32], q: &[f32]| {
            segment_attention_forward(&shape, cu, q, &x, &x, &mut out, &mut lse)
        };
        assert!(run(shape, &[0, 3], &x).is_ok());
        assert!(run(shape, &[0, 0, 3, 3], &x).is_ok());
        let err = |e: E| Err::<(), _>(crate::Error::Core(e));
        assert_eq!(
            run(shape, &[0, 3], &x[..11]),
            err(E::LengthMismatch {
                what: "q",
                expected: 12,
                actual: 11
            })
        );
        assert_eq!(run(shape, &[], &x), err(E::Empty { what: "cu_seqlens" }));
        for cu in [&[1u32, 3][..], &[0, 2, 1, 3][..], &[0, 2][..], &[0, 4][..]] {
            assert!(run(shape, cu, &x).is_err(), "{cu:?}");
        }
        for bad in [
            SegmentAttentionShape { heads: 0, ..shape },
            SegmentAttentionShape {
                head_dim: 0,
                ..shape
            },
            SegmentAttentionShape {
                scale: f32::NAN,
                ..shape
            },
            SegmentAttentionShape {
                scale: 0.0,
                ..shape
            },
        ] {
            assert!(run(bad, &[0, 3], &x).is_err(), "{bad:?}");
        }
        let (mut dq, mut dk, mut dv) = ([0.0f32; 12], [0.0f32; 12], [0.0f32; 12]);
        let saved = SegmentAttentionSaved {
            out: &x,
            lse: &x[..6],
            dout: &x,
        };
        assert_eq!(
            segment_attention_backward(
                &shape,
                &[0, 3],
                &x,
                &x,
                &x,
                saved,
                &mut dq,
                &mut dk,
                &mut dv[..3]
            ),
            err(E::LengthMismatch {
                what: "dv",
                expected: 12,
                actual: 3
            })
        );
        // No token at all.
        let empty = SegmentAttentionShape::new(0, 2, 2);
        assert!(segment_attention_forward(&empty, &[0], &[], &[], &[], &mut [], &mut []).is_ok());
    }

    /// The tensor-core kernels' arithmetic over segments in plain loops (the twin's
    /// definition): `(out, lse, [dq, dk, dv])`.
    #[allow(clippy::type_complexity)]
    fn bf16_reference(
        shape: &SegmentAttentionShape,
        cu: &[u32],
        [q, k, v]: [&[f32]; 3],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, [Vec<f32>; 3]) {
        use crate::ops::attention::tensor_core::KEY_TILE;
        let r = |x: f32| crate::ops::precision::MatmulPrecision::Bf16.round(x);
        let exp = |x: f32| crate::exp::exp_nonpositive::<false>(x);
        let (h, d, scale) = (shape.heads, shape.head_dim, shape.scale);
        let at = |t: usize, hh: usize| (t * h + hh) * d;
        let dot = |a: &[f32], i: usize, b: &[f32], j: usize| {
            (0..d).fold(0.0f32, |acc, e| acc + r(a[i + e]) * r(b[j + e]))
        };
        let mut out = vec![0.0f32; q.len()];
        let mut lse = vec![0.0f32; shape.tokens * h];
        for w in cu.windows(2) {
            let (lo, hi) = (w[0] as usize, w[1] as usize);
            for t in lo..hi {
                for hh in 0..h {
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                    let mut o = vec![0.0f32; d];
                    for k0 in (lo / KEY_TILE * KEY_TILE..hi).step_by(KEY_TILE) {
                        let keys: Vec<usize> = (k0.max(lo)..(k0 + KEY_TILE).min(hi)).collect();
                        let sc: Vec<f32> = keys
                            .iter()
                            .map(|&s| scale * dot(q, at(t, hh), k, at(s, hh)))
                            .collect();
                        let m_new = sc.iter().fold(m, |a, &b| a.max(b));
                        let alpha = exp(m - m_new);
                        let p: Vec<f32> = sc.iter().map(|&x| exp(x - m_new)).collect();
                        l = l * alpha + p.iter().sum::<f32>();
                        for (e, o) in o.iter_mut().enumerate() {
                            let pv = keys
                                .iter()
                                .zip(&p)
                                .fold(0.0f32, |a, (&s, &p)| a + r(p) * r(v[at(s, hh) + e]));
                            *o = *o * alpha + pv;
                        }
                        m = m_new;
                    }
                    for (e, o) in o.iter().enumerate() {
                        out[at(t, hh) + e] = o * (1.0 / l);
                    }
                    lse[t * h + hh] = m + l.ln();
                }
            }
        }
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f32; q.len()],
            vec![0.0f32; q.len()],
            vec![0.0f32; q.len()],
        );
        for w in cu.windows(2) {
            let (lo, hi) = (w[0] as usize, w[1] as usize);
            for t in lo..hi {
                for hh in 0..h {
                    let (qi, ls) = (at(t, hh), lse[t * h + hh]);
                    let delta: f32 = (0..d).map(|e| r(dout[qi + e]) * out[qi + e]).sum();
                    for s in lo..hi {
                        let ki = at(s, hh);
                        let p = exp((scale * dot(q, qi, k, ki) - ls).min(0.0));
                        let ds = r(p * (dot(dout, qi, v, ki) - delta));
                        for e in 0..d {
                            dq[qi + e] += scale * ds * r(k[ki + e]);
                            dk[ki + e] += scale * ds * r(q[qi + e]);
                            dv[ki + e] += r(p) * r(dout[qi + e]);
                        }
                    }
                }
            }
        }
        (out, lse, [dq, dk, dv])
    }

    /// On dyadic operands every score and `dÕ·ṽ` is exact in any order, so the twin's GEMM
    /// tiles and the plain loops round every probability and `dS` alike: lse to the bit,
    /// the rest to f32 sum order. Segments cross tile boundaries (64, 128) and one is empty;
    /// tiles not at multiples of 64, or unrounded `p` or `dS`, fail it.
    #[test]
    fn bf16_twin_is_the_kernels_arithmetic_over_segments() {
        let shape = SegmentAttentionShape {
            scale: 0.125,
            ..SegmentAttentionShape::new(200, 2, 16)
        };
        let cu = [0u32, 50, 50, 180, 200];
        let n = shape.tokens * shape.heads * shape.head_dim;
        let mut rng = Rng(41);
        let mut grid = |step: f32| -> Vec<f32> {
            rng.vec(n, 1.0)
                .iter()
                .map(|x| (x * 4.0).round() / step)
                .collect()
        };
        let (q, k, v, dout) = (grid(8.0), grid(8.0), grid(16.0), grid(16.0));
        let (mut out, mut lse) = (
            vec![f32::NAN; n],
            vec![f32::NAN; shape.tokens * shape.heads],
        );
        segment_attention_forward_bf16(&shape, &cu, &q, &k, &v, &mut out, &mut lse).unwrap();
        let (want_out, want_lse, want_grads) = bf16_reference(&shape, &cu, [&q, &k, &v], &dout);
        for (i, (g, w)) in lse.iter().zip(&want_lse).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "lse[{i}]: {g} vs {w}");
        }
        for (i, (g, w)) in out.iter().zip(&want_out).enumerate() {
            assert!((g - w).abs() <= 1e-5, "out[{i}]: {g} vs {w}");
        }
        let (mut dq, mut dk, mut dv) = (vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]);
        let saved = SegmentAttentionSaved {
            out: &out,
            lse: &lse,
            dout: &dout,
        };
        segment_attention_backward_bf16(&shape, &cu, &q, &k, &v, saved, &mut dq, &mut dk, &mut dv)
            .unwrap();
        for (name, (g, w)) in ["dq", "dk", "dv"]
            .iter()
            .zip([&dq, &dk, &dv].into_iter().zip(&want_grads))
        {
            let scale = w.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-6 * scale.max(1.0),
                    "{name}[{i}]: {g} vs {w}"
                );
            }
        }
    }

    /// Against exact f32 segment attention, forward and backward: bf16's differences.
    #[test]
    fn bf16_twin_is_f32_segment_attention_to_bf16_rounding() {
        let shape = SegmentAttentionShape::new(150, 3, 16);
        let cu = [0u32, 70, 150];
        let n = shape.tokens * shape.heads * shape.head_dim;
        let mut rng = Rng(42);
        let (q, k, v, dout) = (
            rng.vec(n, 2.0),
            rng.vec(n, 2.0),
            rng.vec(n, 1.0),
            rng.vec(n, 1.0),
        );
        let lse_n = shape.tokens * shape.heads;
        let run = |bf16: bool| {
            let (mut out, mut lse) = (vec![0.0f32; n], vec![0.0f32; lse_n]);
            let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
            let fwd = if bf16 {
                segment_attention_forward_bf16
            } else {
                segment_attention_forward
            };
            fwd(&shape, &cu, &q, &k, &v, &mut out, &mut lse).unwrap();
            let saved = SegmentAttentionSaved {
                out: &out,
                lse: &lse,
                dout: &dout,
            };
            let bwd = if bf16 {
                segment_attention_backward_bf16
            } else {
                segment_attention_backward
            };
            bwd(&shape, &cu, &q, &k, &v, saved, &mut dq, &mut dk, &mut dv).unwrap();
            [out, dq, dk, dv]
        };
        let (got, want) = (run(true), run(false));
        for (name, (g, w)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let scale = w.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            let worst = g
                .iter()
                .zip(w)
                .fold(0.0f32, |a, (g, w)| a.max((g - w).abs()));
            assert!(
                worst > 0.0 && worst <= 3e-2 * scale,
                "{name}: worst {worst} of {scale}"
            );
        }
    }
}
