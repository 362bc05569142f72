//! The bf16 training forward as the CUDA tensor-core kernel computes it
//! (`attention_fwd_mma_*` in ares-cuda's `model_ops.cu`): its CPU twin.
//!
//! The kernel multiplies with bf16 operands and f32 sums: q, k and v are rounded to bf16
//! (nearest even) as they are loaded, and the keys come in tiles of [`KEY_TILE`] from key
//! 0. Each tile updates a row's running max `m` and sum `l` in f32 (online softmax): with
//! the tile's scores `s = scale·q̃·k̃ᵀ`, `m' = max(m, max s)`, `α = e^(m − m')` and
//! `p = e^(s − m')`, it sets `l ← α·l + Σ p` and `o ← α·o + bf16(p)·ṽ` — the probabilities
//! are rounded for the second product only, the sum keeps them in f32. At the end
//! `out = o·(1/l)` and `lse = m + ln l`. `e^x` is `2^(x·log₂e)` by the same polynomial and
//! roundings on both sides, so given the same scores the kernel and the twin round every
//! probability alike; what the twin cannot copy is the order of the tensor cores' f32
//! sums, so the two agree to f32 rounding of the same bf16 operands, not bit for bit.
//!
//! A row never sees another row's numbers, so how the kernel groups rows into blocks does
//! not change them; the twin takes blocks of 64 query tokens per task, the product of each
//! key tile as one GEMM. Visibility, empty and non-finite rows are
//! [`super::attention_forward`]'s.

use super::blocked::{Span, Task, cut, tasks};
use super::{AttentionInputs, Dims};
use crate::Result;
use crate::exp::exp_nonpositive;
use crate::ops::matmul::{MatLayout, MatMut, MatRef, MatmulDims, matmul_seq_rounded};
use rayon::prelude::*;

/// Keys per tile (`MMA_KEYS` in `model_ops.cu`): the step of the online softmax.
pub const KEY_TILE: usize = 64;
/// Query tokens per CPU task (any value gives the same numbers).
const QUERY_BLOCK: usize = 64;

/// One head's rows in a `[tokens, heads, D]` activation: token `t0 + i`, head `h`.
fn head_rows(t0: usize, heads: usize, d: usize, h: usize) -> MatLayout {
    MatLayout {
        offset: (t0 * heads + h) * d,
        batch_stride: 0,
        row_stride: heads * d,
        col_stride: 1,
    }
}

/// A row's softmax state across key tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowState {
    /// Running max of the visible scores (−∞ before the first).
    max: f32,
    /// Running sum of `e^(s − max)`.
    sum: f32,
    /// A visible score was not finite.
    bad: bool,
}

pub(crate) const FRESH: RowState = RowState {
    max: f32::NEG_INFINITY,
    sum: 0.0,
    bad: false,
};

/// One tile of a row: `row` holds the tile's scores, keys `j < visible_by_position` with
/// `mask[j] = 1` are visible. Updates `state`, turns `row` into `bf16(p)` (0 for keys not
/// seen) and returns `α`, the factor of the row's output so far.
pub(crate) fn online_tile(
    row: &mut [f32],
    mask: &[f32],
    visible_by_position: usize,
    st: &mut RowState,
) -> f32 {
    let mut tile_max = f32::NEG_INFINITY;
    for (j, x) in row.iter_mut().enumerate() {
        let visible = j < visible_by_position && mask.get(j) == Some(&1.0);
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must count as not finite
        let finite = *x > f32::NEG_INFINITY && *x < f32::INFINITY;
        st.bad |= visible && !finite;
        *x = if visible && finite {
            *x
        } else {
            f32::NEG_INFINITY
        };
        tile_max = tile_max.max(*x);
    }
    if tile_max == f32::NEG_INFINITY {
        row.fill(0.0);
        return 1.0;
    }
    let max = st.max.max(tile_max);
    let alpha = exp_nonpositive::<false>(st.max - max);
    // p in wide registers, summed in key order, then rounded (the kernel's bits)
    exp_shifted(row, max);
    let mut sum = 0.0f32;
    for &p in row.iter() {
        sum += p;
    }
    crate::ops::precision::round_bf16_in_place(row);
    st.sum = st.sum * alpha + sum;
    st.max = max;
    alpha
}

/// `x ← e^(x − max)` by the kernels' unfused `exp` (a −∞ score gives 0), in the widest
/// registers the CPU path has: the same bits on every path.
fn exp_shifted(row: &mut [f32], max: f32) {
    #[inline(always)]
    fn run(row: &mut [f32], max: f32) {
        for x in row.iter_mut() {
            *x = if *x == f32::NEG_INFINITY {
                0.0
            } else {
                exp_nonpositive::<false>(*x - max)
            };
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    fn avx512(row: &mut [f32], max: f32) {
        run(row, max);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2(row: &mut [f32], max: f32) {
        run(row, max);
    }
    match crate::isa::Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx512 | crate::isa::Isa::Amx => unsafe { avx512(row, max) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx2 => unsafe { avx2(row, max) },
        _ => run(row, max),
    }
}

/// The end of a row: `out = o·(1/l)` and `lse = m + ln l`; a row without a visible key 0
/// and −∞, one with a non-finite visible score NaN.
pub(crate) fn finish_row(st: &RowState, o_row: Option<&mut [f32]>, lse: Option<&mut f32>) {
    let empty = st.max == f32::NEG_INFINITY;
    let inv = if empty || st.bad { 0.0 } else { 1.0 / st.sum };
    for x in o_row.into_iter().flatten() {
        *x = if st.bad { f32::NAN } else { *x * inv };
    }
    if let Some(x) = lse {
        *x = if st.bad {
            f32::NAN
        } else if empty {
            f32::NEG_INFINITY
        } else {
            st.max + st.sum.ln()
        };
    }
}

/// Forward over rounded `inputs` (checked by the caller) with key validity `mask` `[B, T]`:
/// writes `out` `[B, T, Hq, D]` and `lse` `[B, T, Hq]`.
pub(super) fn forward(
    dims: &Dims,
    spans: &[Span],
    inputs: AttentionInputs<'_>,
    mask: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let AttentionInputs { q, k, v, .. } = inputs;
    let tasks = tasks(spans, QUERY_BLOCK);
    let (outs, lses) = (
        cut(out, dims.hq * dims.d, &tasks),
        cut(lse, dims.hq, &tasks),
    );
    tasks.into_par_iter().zip(outs).zip(lses).try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(tile, state), ((task, o), l)| {
            let Task { base, t0, rows, .. } = task;
            // causal: the block's last query sees keys < t0 + rows
            let m = mask.get(base..base + t0 + rows).unwrap_or_default();
            let keys = Keys { k, v, at: base };
            let queries = Queries {
                q,
                at: base + t0,
                rows,
                pos: t0,
            };
            rows_forward(dims, queries, keys, m, (tile, state), o, l)
        },
    )
}

/// The query rows of one task: `rows` tokens of `q` (`[tokens, Hq, D]`, rounded) from
/// token `at`, at positions `pos..pos + rows` of their sequence.
#[derive(Clone, Copy)]
pub(super) struct Queries<'a> {
    pub(super) q: &'a [f32],
    pub(super) at: usize,
    pub(super) rows: usize,
    pub(super) pos: usize,
}

/// The sequence's keys and values (`[tokens, Hkv, D]`, rounded), its position 0 at token
/// `at`.
#[derive(Clone, Copy)]
pub(super) struct Keys<'a> {
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) at: usize,
}

/// One task of the twin: every head of `queries` over the keys at positions up to each
/// row's own (those with `mask[s] = 1`; `mask` holds at least `pos + rows` entries), key
/// tiles of [`KEY_TILE`] from position 0. Writes `o` `[rows, Hq, D]` and `l` `[rows, Hq]`
/// (empty: no lse wanted); `scratch` is the tile and row states, reused between tasks.
pub(super) fn rows_forward(
    dims: &Dims,
    queries: Queries<'_>,
    keys: Keys<'_>,
    mask: &[f32],
    scratch: (&mut Vec<f32>, &mut Vec<RowState>),
    o: &mut [f32],
    l: &mut [f32],
) -> Result<()> {
    let Dims {
        hq,
        hkv,
        d,
        group,
        scale,
        ..
    } = *dims;
    let (tile, state) = scratch;
    let Queries { q, at, rows, pos } = queries;
    let q_tok = hq * d;
    let n_keys = pos + rows;
    o.fill(0.0);
    for h in 0..hq {
        let g = h / group;
        state.clear();
        state.resize(rows, FRESH);
        for k0 in (0..n_keys).step_by(KEY_TILE) {
            let kn = KEY_TILE.min(n_keys - k0);
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
                    layout: head_rows(at, hq, d, h),
                },
                MatRef {
                    data: keys.k,
                    layout: head_rows(keys.at + k0, hkv, d, g).t(),
                },
                MatMut {
                    data: tile,
                    layout: MatLayout::row_major(rows, kn),
                },
                scale,
                0.0,
            )?;
            let tile_mask = mask.get(k0..k0 + kn).unwrap_or_default();
            for (r, (row, st)) in tile.chunks_exact_mut(kn).zip(state.iter_mut()).enumerate() {
                let by_position = (pos + r + 1).saturating_sub(k0);
                let alpha = online_tile(row, tile_mask, by_position, st);
                let o_row = o.get_mut(r * q_tok + h * d..r * q_tok + (h + 1) * d);
                for x in o_row.into_iter().flatten() {
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
                    data: keys.v,
                    layout: head_rows(keys.at + k0, hkv, d, g),
                },
                MatMut {
                    data: o,
                    layout: head_rows(0, hq, d, h),
                },
                1.0,
                1.0,
            )?;
        }
        for (r, st) in state.iter().enumerate() {
            let o_row = o.get_mut(r * q_tok + h * d..r * q_tok + (h + 1) * d);
            finish_row(st, o_row, l.get_mut(r * hq + h));
        }
    }
    Ok(())
}

#[cfg(test)]
mod wide_tests {
    use super::*;
    use crate::test_rng::rand_vec;

    /// The softmax pieces the bf16 twin runs in wide registers give the scalar loop's bits:
    /// `e^(x − max)` by the unfused `exp` (−∞ → 0), and the probabilities of the backward.
    #[test]
    fn wide_exponentials_are_the_scalar_bits() {
        for n in [1usize, 7, 16, 33, 64, 1000] {
            let mut x: Vec<f32> = rand_vec(n, n as u64).iter().map(|v| v * 30.0).collect();
            x[n / 2] = f32::NEG_INFINITY;
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<u32> = x
                .iter()
                .map(|&v| {
                    let e = if v == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp_nonpositive::<false>(v - max)
                    };
                    e.to_bits()
                })
                .collect();
            let mut got = x.clone();
            exp_shifted(&mut got, max);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "{n}"
            );
        }
    }
}
