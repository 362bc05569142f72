//! Token-level steps: broadcasting a per-sample scalar, folding KL into token rewards,
//! returns-to-go.
//!
//! The γ = 1 return-to-go of a row is a suffix sum, a chain of dependent additions; it runs
//! as four interleaved chains (a distance-4 recurrence the loop vectoriser executes four lanes
//! wide) recombined by a vectorised second pass that also applies the mask and the fused
//! validation.

use super::{GroupMoments, ResponseTokens};
use crate::error::{Error, Result};
use crate::lanes::{self, bad_mask, bad_value};
use crate::num::{check_finite, check_len, check_mask, check_param};
use crate::{Groups, Shape};
use num_traits::Float;

/// The error of a row whose mask has no 1: its sequence reward has no token to sit on.
pub(crate) const EMPTY_ROW: Error = Error::Empty {
    what: "mask row (no valid token to carry the sequence reward)",
};

/// Broadcasts one scalar per row over its tokens: `out[r, t] = per_row[r] · mask[r, t]`.
///
/// Errors: `per_row.len() ≠ rows`, `mask`/`out` ≠ rows × cols → `LengthMismatch`;
/// non-finite `per_row` → `NonFinite`; mask not 0/1 → `InvalidMask`.
pub fn broadcast_to_tokens<F: Float>(
    shape: Shape,
    per_row: &[F],
    mask: &[F],
    out: &mut [F],
) -> Result<()> {
    check_len("per_row", shape.rows, per_row.len())?;
    check_finite("per_row", per_row)?;
    shape.check("mask", mask.len())?;
    shape.check("out", out.len())?;
    let cols = shape.cols;
    let mut ok = true;
    for (r, &a) in per_row.iter().enumerate() {
        ok &= broadcast_row(lanes::row_mut(out, cols, r), lanes::row(mask, cols, r), a).1;
    }
    if ok { Ok(()) } else { check_mask("mask", mask) }
}

/// Folds the sequence reward and the KL penalty into token rewards (docs/algorithms.md §4, KL in reward):
/// `R_t = (−β_t·k_t + [t = last valid token of the row]·score_r) · m_t`, where
/// `weighted_kl` holds `β_t·k_t` (e.g. the `weighted` output of [`crate::kl::token_kl`]) or
/// is `None` for no KL. "Last valid token" is the largest t with `m_t = 1`.
///
/// Errors: lengths (`scores` = rows, the rest rows × cols) → `LengthMismatch`; non-finite
/// `scores`/`weighted_kl` → `NonFinite`; mask not 0/1 → `InvalidMask`; a row whose mask is
/// all 0 → `Empty` (its reward would be lost).
pub fn token_level_rewards<F: Float>(
    shape: Shape,
    scores: &[F],
    mask: &[F],
    weighted_kl: Option<&[F]>,
    out: &mut [F],
) -> Result<()> {
    check_len("scores", shape.rows, scores.len())?;
    check_finite("scores", scores)?;
    let tokens = ResponseTokens {
        shape,
        mask,
        weighted_kl,
    };
    tokens.check(shape.rows, out.len())?;
    for (r, &s) in scores.iter().enumerate() {
        let o = lanes::row_mut(out, shape.cols, r);
        let m = lanes::row(mask, shape.cols, r);
        rewards_row(&tokens, r, s, o, m)?;
    }
    Ok(())
}

/// The sequence score of each row with its KL penalty folded in (docs/algorithms.md §4, KL in reward):
/// `out[r] = score_r − Σ_t m_rt·β_t·k_t`, the whole-row sum of the token rewards of
/// [`token_level_rewards`] (their γ = 1 return at the first token). GRPO and Dr.GRPO take
/// their group statistics over these scores when KL is in the reward, as verl sums
/// `token_level_rewards` per row. With `tokens.weighted_kl = None`, `out = scores`.
///
/// Errors: lengths (`scores`, `out` = rows; mask and KL rows × cols) → `LengthMismatch`;
/// non-finite `scores` or KL at a valid position → `NonFinite`; mask not 0/1 → `InvalidMask`.
/// A row without a valid token keeps its score (it has no KL to subtract).
pub fn kl_folded_scores<F: Float>(
    scores: &[F],
    tokens: ResponseTokens<'_, F>,
    out: &mut [F],
) -> Result<()> {
    let shape = tokens.shape;
    check_len("scores", shape.rows, scores.len())?;
    check_len("out", shape.rows, out.len())?;
    check_finite("scores", scores)?;
    shape.check("mask", tokens.mask.len())?;
    check_mask("mask", tokens.mask)?;
    let Some(kl) = tokens.weighted_kl else {
        out.copy_from_slice(scores);
        return Ok(());
    };
    shape.check("weighted_kl", kl.len())?;
    let cols = shape.cols;
    for (r, (o, &score)) in out.iter_mut().zip(scores).enumerate() {
        let m = lanes::row(tokens.mask, cols, r);
        let k = lanes::row(kl, cols, r);
        let mut sum = F::zero();
        for (t, (&kt, &mt)) in k.iter().zip(m).enumerate() {
            if mt != F::zero() {
                if !kt.is_finite() {
                    return Err(Error::NonFinite {
                        what: "weighted_kl",
                        index: r * cols + t,
                    });
                }
                sum = sum + kt;
            }
        }
        *o = score - sum;
    }
    Ok(())
}

/// Returns-to-go over each row: `G_t = R_t·m_t + γ·G_{t+1}` (G = 0 past the row's end),
/// written as `out_t = G_t · m_t`. Padded positions inside a row pass the return through
/// (discounted by γ) but contribute no reward, as in OpenRLHF's `get_cumulative_returns`.
/// γ = 1 is the undiscounted return of REINFORCE / RLOO / Pro Max.
///
/// Errors: lengths → `LengthMismatch`; non-finite `token_rewards` → `NonFinite`; mask not
/// 0/1 → `InvalidMask`; γ ∉ [0, 1] → `OutOfRange`; finite rewards whose sum overflows →
/// `OutOfRange` on `"returns-to-go"`.
pub fn returns_to_go<F: Float>(
    shape: Shape,
    token_rewards: &[F],
    mask: &[F],
    gamma: F,
    out: &mut [F],
) -> Result<()> {
    shape.check("token_rewards", token_rewards.len())?;
    shape.check("out", out.len())?;
    returns_to_go_inner(
        shape,
        Some(token_rewards),
        out,
        mask,
        gamma,
        "token_rewards",
    )
}

/// [`returns_to_go`] in place: `values` holds the token rewards on entry and the masked
/// returns on exit. Same errors (naming `"values"`); each row is checked before it is
/// overwritten, so an error leaves the rows from the offending one on unchanged.
pub fn returns_to_go_in_place<F: Float>(
    shape: Shape,
    values: &mut [F],
    mask: &[F],
    gamma: F,
) -> Result<()> {
    returns_to_go_inner(shape, None, values, mask, gamma, "values")
}

/// Returns-to-go of `src` (or of `values` itself) into `values`, row by row: each row is
/// copied (if from `src`) and checked while it comes into L1, then processed there.
fn returns_to_go_inner<F: Float>(
    shape: Shape,
    src: Option<&[F]>,
    values: &mut [F],
    mask: &[F],
    gamma: F,
    what: &'static str,
) -> Result<()> {
    shape.check(what, values.len())?;
    shape.check("mask", mask.len())?;
    check_gamma(gamma)?;
    let cols = shape.cols;
    for r in 0..shape.rows {
        let o = lanes::row_mut(values, cols, r);
        let m = lanes::row(mask, cols, r);
        if let Some(src) = src {
            let s = lanes::row(src, cols, r);
            if s.len() == o.len() {
                o.copy_from_slice(s);
            }
        }
        // checked before the row is overwritten (then it is in L1 for the pass itself)
        if !check_row(o, m) {
            return Err(locate_row_error(what, o, m, r.saturating_mul(cols)));
        }
        let ok = if gamma == F::one() {
            suffix_row::<F, true, false>(o, &[], m, F::zero(), gamma).1
        } else {
            suffix_row::<F, true, true>(o, &[], m, F::zero(), gamma).1
        };
        if !ok {
            return Err(overflow("returns-to-go"));
        }
    }
    Ok(())
}

/// Checks a discount γ ∈ [0, 1], as every returns-to-go function does first.
///
/// Errors: `OutOfRange` naming `"gamma"`.
pub fn check_gamma<F: Float>(gamma: F) -> Result<()> {
    check_param(
        "gamma",
        gamma,
        gamma >= F::zero() && gamma <= F::one(),
        "in [0, 1]",
    )
}

/// Finite inputs whose result overflowed.
#[cold]
pub(crate) fn overflow(what: &'static str) -> Error {
    Error::OutOfRange {
        what,
        value: f64::INFINITY,
        expected: "finite (the inputs are too large: the result overflows)",
    }
}

/// The first bad element of a row: non-finite value first, then bad mask entry.
#[cold]
pub(crate) fn locate_row_error<F: Float>(
    what: &'static str,
    v: &[F],
    m: &[F],
    offset: usize,
) -> Error {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Error::NonFinite {
            what,
            index: offset + i,
        };
    }
    match m.iter().position(|&x| x != F::zero() && x != F::one()) {
        Some(i) => Error::InvalidMask {
            what: "mask",
            index: offset + i,
        },
        None => overflow(what),
    }
}

/// Re-checks the token inputs after a fused check failed; if they are fine, the result
/// overflowed.
#[cold]
pub(crate) fn token_error<F: Float>(tokens: &ResponseTokens<'_, F>, what: &'static str) -> Error {
    if let Err(e) = check_mask("mask", tokens.mask) {
        return e;
    }
    if let Some(k) = tokens.weighted_kl {
        if let Err(e) = check_finite("weighted_kl", k) {
            return e;
        }
    }
    overflow(what)
}

/// Row `row` of `out` = the γ-return of `score` at the last valid token and `−β_t·k_t`
/// per token, masked. Validates the row's mask/KL and that it has a valid token.
pub(crate) fn fold_rtg_row<F: Float>(
    tokens: &ResponseTokens<'_, F>,
    row: usize,
    score: F,
    gamma: F,
    out: &mut [F],
) -> Result<()> {
    let cols = tokens.shape.cols;
    let o = lanes::row_mut(out, cols, row);
    let m = lanes::row(tokens.mask, cols, row);
    if gamma == F::one() {
        let (cnt, ok) = match tokens.weighted_kl {
            None => broadcast_row(o, m, score),
            Some(k) => suffix_row::<F, false, false>(o, lanes::row(k, cols, row), m, score, gamma),
        };
        if !ok {
            return Err(token_error(tokens, "token advantages"));
        }
        if cnt == 0 {
            return Err(EMPTY_ROW);
        }
        Ok(())
    } else {
        rewards_row(tokens, row, score, o, m)?;
        if suffix_row::<F, true, true>(o, &[], m, F::zero(), gamma).1 {
            Ok(())
        } else {
            Err(overflow("returns-to-go"))
        }
    }
}

/// `o = (−β_t·k_t + [t = last]·score)·m`.
fn rewards_row<F: Float>(
    tokens: &ResponseTokens<'_, F>,
    row: usize,
    score: F,
    o: &mut [F],
    m: &[F],
) -> Result<()> {
    let ok = match tokens.weighted_kl {
        None => broadcast_row(o, m, F::zero()).1,
        Some(k) => neg_masked_row(o, lanes::row(k, tokens.shape.cols, row), m),
    };
    if !ok {
        return Err(token_error(tokens, "token rewards"));
    }
    let last = m.iter().rposition(|&x| x != F::zero()).ok_or(EMPTY_ROW)?;
    if let Some(x) = o.get_mut(last) {
        *x = *x + score;
    }
    Ok(())
}

/// Token advantages `f(group moments, r)` broadcast over each row (GRPO and friends).
pub(crate) fn broadcast_groups<F: Float>(
    groups: &Groups<'_>,
    rewards: &[F],
    tokens: &ResponseTokens<'_, F>,
    out: &mut [F],
    f: impl Fn(&GroupMoments<F>, F) -> F,
) -> Result<()> {
    let cols = tokens.shape.cols;
    let mut ok = true;
    for g in 0..groups.count() {
        let gm = super::group_moments(groups, g, rewards);
        for row in groups.rows_of(g) {
            let a = f(&gm, super::at(rewards, row));
            ok &= broadcast_row(
                lanes::row_mut(out, cols, row),
                lanes::row(tokens.mask, cols, row),
                a,
            )
            .1;
        }
    }
    if ok {
        Ok(())
    } else {
        Err(token_error(tokens, "token advantages"))
    }
}

// ---------------------------------------------------------------------------------------------
// Row kernels. Each returns whether its fused check passed (every mask entry 0 or 1, every
// value it produced finite) and, where useful, the number of valid tokens. Counts and checks
// are integer / boolean reductions, which LLVM vectorises in registers.

/// Rows are walked in chunks of this many tokens so per-chunk `u32` counts cannot overflow.
const CHUNK: usize = 1 << 16;

/// `o = a·m`; returns `(Σm, ok)`.
pub(crate) fn broadcast_row<F: Float>(o: &mut [F], m: &[F], a: F) -> (usize, bool) {
    map_row(o, None, m, |_, _, w| a * w)
}

/// `o = −k·m`; returns ok.
fn neg_masked_row<F: Float>(o: &mut [F], k: &[F], m: &[F]) -> bool {
    map_row(o, Some(k), m, |_, kk, w| -(kk * w)).1
}

/// `o_t = f(o_t, k_t, m_t)` over a row (k = 0 when absent); returns `(Σm, ok)` where the
/// check covers the mask and the outputs.
#[inline(always)]
fn map_row<F: Float>(
    o: &mut [F],
    k: Option<&[F]>,
    m: &[F],
    f: impl Fn(F, F, F) -> F,
) -> (usize, bool) {
    // without k the kernel reads zeros; `m` only stands in to keep one loop
    let (kz, use_k) = match k {
        Some(k) => (k, true),
        None => (m, false),
    };
    let mut cnt = 0usize;
    let mut bad = false;
    for ((ob, kb), mb) in o
        .chunks_mut(CHUNK)
        .zip(kz.chunks(CHUNK))
        .zip(m.chunks(CHUNK))
    {
        // an indexed loop over slices of one known length: bounds checks fold away and the
        // loop vectorises (deeply zipped iterators do not)
        let n = ob.len().min(kb.len()).min(mb.len());
        let (Some(ob), Some(kb), Some(mb)) = (ob.get_mut(..n), kb.get(..n), mb.get(..n)) else {
            continue;
        };
        let mut c = 0u32;
        for i in 0..n {
            let w = mb[i];
            let kv = if use_k { kb[i] } else { F::zero() };
            let v = f(ob[i], kv, w);
            ob[i] = v;
            c += u32::from(w != F::zero());
            bad |= bad_mask(w) | bad_value(v);
        }
        cnt += c as usize;
    }
    (cnt, !bad)
}

/// Whether a row of values and its mask are valid (values finite, mask 0/1).
pub(crate) fn check_row<F: Float>(v: &[F], m: &[F]) -> bool {
    let n = v.len().min(m.len());
    let (Some(v), Some(m)) = (v.get(..n), m.get(..n)) else {
        return false;
    };
    let mut bad = false;
    for i in 0..n {
        bad |= bad_value(v[i]) | bad_mask(m[i]);
    }
    !bad
}

/// Returns-to-go of one row: `o_t = m_t · (add + Σ_{u ≥ t} γ^{u−t}·x_u)` with `x_u = o_u·m_u`
/// when `INPLACE`, else `x_u = −k_u·m_u` (the KL folding, `k` = β·k tokens); `DISCOUNT` false
/// means γ = 1. Returns `(Σm, ok)`.
///
/// The recurrence `G_t = x_t + γ·G_{t+1}` is a chain of dependent operations. Here it runs as
/// four interleaved chains, one per position modulo 4, `y_t = x_t + γ⁴·y_{t+4}` (four lanes of
/// one SIMD register), and a second, fully vectorised pass recombines them:
/// `G_t = y_t + γ·y_{t+1} + γ²·y_{t+2} + γ³·y_{t+3}`.
pub(crate) fn suffix_row<F: Float, const INPLACE: bool, const DISCOUNT: bool>(
    o: &mut [F],
    k: &[F],
    m: &[F],
    add: F,
    gamma: F,
) -> (usize, bool) {
    // without INPLACE, `k` must match the row; with it, `k` is unused
    let k: &[F] = if INPLACE { m } else { k };
    let n = o.len().min(m.len()).min(k.len());
    let (Some(o), Some(k), Some(m)) = (o.get_mut(..n), k.get(..n), m.get(..n)) else {
        return (0, false);
    };
    let g1 = if DISCOUNT { gamma } else { F::one() };
    let (g2, g3) = (g1 * g1, g1 * g1 * g1);
    let g4 = g2 * g2;
    if n < 8 {
        let mut g = F::zero();
        for ((x, &kk), &w) in o.iter_mut().zip(k).zip(m).rev() {
            g = term::<F, INPLACE>(*x, kk, w) + if DISCOUNT { g1 * g } else { g };
            *x = g;
        }
        return finish_row(o, m, add);
    }
    // pass 1: y_t = x_t + γ⁴·y_{t+4}, with y = 0 past the end. Walked in 4-element chunks from
    // the end with the four chains in a register array (no store-to-load round trip).
    let mut y = [F::zero(); 4];
    let head = n % 4;
    let (Some((oh, ot)), Some((kh, kt)), Some((mh, mt))) = (
        o.split_at_mut_checked(head),
        k.split_at_checked(head),
        m.split_at_checked(head),
    ) else {
        return (0, false);
    };
    for ((oc, kc), mc) in ot
        .rchunks_exact_mut(4)
        .zip(kt.rchunks_exact(4))
        .zip(mt.rchunks_exact(4))
    {
        if let (Some(oc), Some(kc), Some(mc)) = (
            oc.first_chunk_mut::<4>(),
            kc.first_chunk::<4>(),
            mc.first_chunk::<4>(),
        ) {
            for j in 0..4 {
                let carried = if DISCOUNT { g4 * y[j] } else { y[j] };
                y[j] = term::<F, INPLACE>(oc[j], kc[j], mc[j]) + carried;
                oc[j] = y[j];
            }
        }
    }
    // the first `head` (< 4) positions continue the chain of the position 4 after them
    for t in (0..head).rev() {
        let next = y[(t + 4 - head) % 4];
        let carried = if DISCOUNT { g4 * next } else { next };
        oh[t] = term::<F, INPLACE>(oh[t], kh[t], mh[t]) + carried;
    }
    // pass 2 (ascending, so o[t+1..t+4] still hold y when o[t] is overwritten)
    let mut cnt = 0u32;
    let mut bad = false;
    for t in 0..n - 3 {
        let w = m[t];
        let s = if DISCOUNT {
            (o[t] + g1 * o[t + 1]) + (g2 * o[t + 2] + g3 * o[t + 3])
        } else {
            (o[t] + o[t + 1]) + (o[t + 2] + o[t + 3])
        };
        let v = w * (s + add);
        o[t] = v;
        cnt += u32::from(w != F::zero());
        bad |= bad_mask(w) | bad_value(v);
    }
    let (y1, y2, y3) = (o[n - 3], o[n - 2], o[n - 1]);
    let tail = [
        (n - 3, y1 + g1 * y2 + g2 * y3),
        (n - 2, y2 + g1 * y3),
        (n - 1, y3),
    ];
    for (t, s) in tail {
        let w = m[t];
        let v = w * (s + add);
        o[t] = v;
        cnt += u32::from(w != F::zero());
        bad |= bad_mask(w) | bad_value(v);
    }
    (cnt as usize, !bad)
}

/// The summand of the suffix sum at one token: `x·m` in place, `−k·m` for KL folding.
#[inline(always)]
fn term<F: Float, const INPLACE: bool>(x: F, k: F, m: F) -> F {
    if INPLACE { x * m } else { -(k * m) }
}

/// `o_t = m_t · (o_t + add)`; returns `(Σm, ok)` (the check covers the mask and the outputs).
fn finish_row<F: Float>(o: &mut [F], m: &[F], add: F) -> (usize, bool) {
    map_row(o, None, m, |x, _, w| w * (x + add))
}

/// Number of valid tokens of a mask row, and whether it holds only 0 and 1.
pub(crate) fn count_row<F: Float>(m: &[F]) -> (usize, bool) {
    let mut cnt = 0usize;
    let mut bad = false;
    for mb in m.chunks(CHUNK) {
        let mut c = 0u32;
        for &w in mb {
            c += u32::from(w != F::zero());
            bad |= bad_mask(w);
        }
        cnt += c as usize;
    }
    (cnt, !bad)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    /// Straightforward reference: R masked, G = R + γG over the whole row, output × mask.
    fn rtg_ref(shape: Shape, r: &[f64], m: &[f64], gamma: f64) -> Vec<f64> {
        let mut out = vec![0.0; r.len()];
        for row in 0..shape.rows {
            let mut g = 0.0;
            for t in (0..shape.cols).rev() {
                let i = row * shape.cols + t;
                g = r[i] * m[i] + gamma * g;
                out[i] = g * m[i];
            }
        }
        out
    }

    #[test]
    fn broadcast() {
        let mut out = [9.0; 6];
        broadcast_to_tokens(
            Shape::new(2, 3),
            &[2.0, -1.0],
            &[1.0, 1.0, 0.0, 0.0, 1.0, 1.0],
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [2.0, 2.0, 0.0, 0.0, -1.0, -1.0]);
        assert_eq!(
            broadcast_to_tokens(
                Shape::new(2, 3),
                &[2.0, -1.0],
                &[1.0, 1.0, 0.0, 0.0, 2.0, 1.0],
                &mut out
            ),
            Err(Error::InvalidMask {
                what: "mask",
                index: 4
            })
        );
        assert_eq!(
            broadcast_to_tokens(Shape::new(2, 3), &[2.0], &[1.0; 6], &mut out),
            Err(Error::LengthMismatch {
                what: "per_row",
                expected: 2,
                actual: 1
            })
        );
        // zero-width rows are fine
        broadcast_to_tokens::<f64>(Shape::new(2, 0), &[1.0, 2.0], &[], &mut []).unwrap();
    }

    #[test]
    fn kl_folding() {
        // row 0: valid t = 0, 1 (last = 1): R = (−0.1, −0.2 + 1, 0)
        // row 1: a hole at t = 1, last valid t = 2: R = (−0.3, 0, −0.5 + 2)
        let shape = Shape::new(2, 3);
        let mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0];
        let wk = [0.1, 0.2, 7.0, 0.3, 0.4, 0.5];
        let mut out = [9.0; 6];
        token_level_rewards(shape, &[1.0, 2.0], &mask, Some(&wk), &mut out).unwrap();
        assert_eq!(out, [-0.1, -0.2 + 1.0, 0.0, -0.3, 0.0, -0.5 + 2.0]);
        token_level_rewards(shape, &[1.0, 2.0], &mask, None, &mut out).unwrap();
        assert_eq!(out, [0.0, 1.0, 0.0, 0.0, 0.0, 2.0]);
        assert_eq!(
            token_level_rewards(
                shape,
                &[1.0, 2.0],
                &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                None,
                &mut out
            ),
            Err(EMPTY_ROW)
        );
        let mut bad = wk;
        bad[2] = f64::INFINITY;
        assert_eq!(
            token_level_rewards(shape, &[1.0, 2.0], &mask, Some(&bad), &mut out),
            Err(Error::NonFinite {
                what: "weighted_kl",
                index: 2
            })
        );
        assert_eq!(
            token_level_rewards(shape, &[1.0, f64::NAN], &mask, None, &mut out),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
    }

    #[test]
    fn returns_hand_checked() {
        // R = (1, 2, 3 | 0, 4, ·) with row 1's t = 2 padded, γ = 0.5:
        // row 0: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
        // row 1: G2 = 0 (masked), G1 = 4, G0 = 0 + 2 = 2
        let shape = Shape::new(2, 3);
        let r = [1.0, 2.0, 3.0, 0.0, 4.0, 9.0];
        let m = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0];
        let mut out = [0.0; 6];
        returns_to_go(shape, &r, &m, 0.5, &mut out).unwrap();
        assert_eq!(out, [2.75, 3.5, 3.0, 2.0, 4.0, 0.0]);
        // γ = 1: suffix sums (6, 5, 3 | 4, 4, 0)
        returns_to_go(shape, &r, &m, 1.0, &mut out).unwrap();
        assert_eq!(out, [6.0, 5.0, 3.0, 4.0, 4.0, 0.0]);
        assert!(matches!(
            returns_to_go(shape, &r, &m, 1.5, &mut out),
            Err(Error::OutOfRange { what: "gamma", .. })
        ));
        let mut v = r;
        v[4] = f64::NAN;
        assert_eq!(
            returns_to_go_in_place(shape, &mut v, &m, 1.0),
            Err(Error::NonFinite {
                what: "values",
                index: 4
            })
        );
        // row 0 was processed, row 1 (the offending one) is untouched
        assert_eq!(v[..3], [6.0, 5.0, 3.0]);
        assert_eq!((v[3], v[5]), (0.0, 9.0));
        assert!(v[4].is_nan());
        assert!(matches!(
            returns_to_go(
                shape,
                &[1e308, 1e308, 1e308, 0.0, 0.0, 0.0],
                &m,
                1.0,
                &mut out
            ),
            Err(Error::OutOfRange { .. })
        ));
    }

    proptest! {
        #[test]
        fn returns_match_reference(
            rows in 1usize..4,
            cols in 0usize..200,
            gamma in prop::sample::select(vec![1.0f64, 0.9, 0.0, 0.5]),
            seed in proptest::collection::vec((-2.0f64..2.0, 0u8..4), 800),
        ) {
            let shape = Shape::new(rows, cols);
            let n = rows * cols;
            let r: Vec<f64> = seed.iter().cycle().take(n).map(|s| s.0).collect();
            let m: Vec<f64> = seed.iter().cycle().take(n).map(|s| (s.1 != 0) as u8 as f64).collect();
            let want = rtg_ref(shape, &r, &m, gamma);
            let mut out = vec![0.0; n];
            returns_to_go(shape, &r, &m, gamma, &mut out).unwrap();
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()), "{} vs {}", a, b);
            }
            let mut v = r.clone();
            returns_to_go_in_place(shape, &mut v, &m, gamma).unwrap();
            prop_assert_eq!(&v, &out);
        }
    }

    #[test]
    fn kl_folded_scores_subtract_the_valid_kl() {
        // row 0: KL 0.1 + 0.2 on valid tokens (0.5 under padding is ignored); row 1: none
        let shape = Shape::new(2, 3);
        let mask = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let kl = [0.1, 0.2, 0.5, 0.3, 0.0, 0.0];
        let mut out = [0.0; 2];
        kl_folded_scores(
            &[1.0, 2.0],
            ResponseTokens::new(shape, &mask).with_kl(&kl),
            &mut out,
        )
        .unwrap();
        assert!((out[0] - 0.7).abs() < 1e-15 && out[1] == 2.0, "{out:?}");
        // equals the γ = 1 return at the first token of token_level_rewards
        let mut r = [0.0; 6];
        token_level_rewards(
            shape,
            &[1.0, 2.0],
            &[1.0, 1.0, 0.0, 1.0, 0.0, 0.0],
            Some(&kl),
            &mut r,
        )
        .unwrap();
        assert!((r[0] + r[1] - out[0]).abs() < 1e-15);
        kl_folded_scores(&[1.0, 2.0], ResponseTokens::new(shape, &mask), &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
        let nan = [f64::NAN, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(
            kl_folded_scores(
                &[1.0, 2.0],
                ResponseTokens::new(shape, &mask).with_kl(&nan),
                &mut out
            ),
            Err(Error::NonFinite {
                what: "weighted_kl",
                index: 0
            })
        );
    }
}
