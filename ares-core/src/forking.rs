//! Forking-token policy gradient (docs/algorithms.md §16.1): keep the policy-gradient term
//! only on the batch's highest-entropy response tokens.
//!
//! Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
//! Reinforcement Learning for LLM Reasoning" (arXiv 2506.01939, §5): in chain-of-thought
//! only a minority of tokens are generated with high entropy; they are the "forks" where the
//! reasoning path is decided. Restricting the policy gradient to the top ρ = 20 % of a batch's
//! response tokens by entropy matches full-gradient training on Qwen3-8B and beats it on 14B
//! and 32B. The paper's objective (DAPO's, with an indicator per token):
//!
//! ```text
//! J = E[ 1/Σ_i|o_i| · Σ_i Σ_t 1[H_{i,t} ≥ τ_ρ^B] · min(r_{i,t}·Â_{i,t}, clip(r_{i,t})·Â_{i,t}) ]
//! ```
//!
//! where `τ_ρ^B` is the entropy above which the top ρ fraction of batch B's tokens lie.
//! [`forking_token_mask`] computes that indicator with an exact count and a deterministic tie
//! rule; [`mask_token_gradient`] applies it to a loss's per-token gradient.
//!
//! ## How it composes with the loss
//!
//! Every policy loss here returns `g_t = ∂loss/∂logπ_t`, the per-token policy-gradient
//! coefficient, already multiplied by its aggregation weight (docs/algorithms.md §6). The
//! forking mask `k_t` multiplies those coefficients before the backward pass:
//! `g_t ← k_t·g_t` ([`mask_token_gradient`]). Everything in the forward pass (ratios, clips,
//! GSPO's sequence ratio, Clip-Cov / KL-Cov selection, the aggregation weights and the
//! metrics) still sees every response token; only the gradient is restricted. This works with
//! every advantage estimator and every loss mode, because the mask never touches the
//! advantages or the loss's inputs.
//!
//! **Normalisation: we recommend the paper's**, i.e. the aggregation weights stay those of the
//! full response mask (for `token-mean`, `1/Σ_i|o_i|` over *all* response tokens, exactly the
//! `1/Σ_{i}|o^i|` of the objective above), and the forking mask enters only as the indicator.
//! Reasons: (1) it is the objective the paper writes down and analyses; (2) a kept token's
//! gradient is then exactly what it would be in full-gradient training, so ρ = 1 reproduces
//! the baseline bit for bit and runs at different ρ differ only by which tokens learn; (3) the
//! normaliser does not depend on the mask, so the trainer's micro-batch scaling (each
//! micro-batch scaled by its share of valid tokens) stays exact. The authors' released code
//! (a verl fork, `compute_policy_loss_vanilla`) instead aggregates with
//! `loss_mask = response_mask · entropy_top_mask`, i.e. `token-mean` over the *kept* tokens,
//! which scales the gradient by about `1/ρ` (5× at ρ = 0.2); under Adam that mostly cancels,
//! but it changes gradient clipping. A trainer that wants that variant passes the product
//! mask as the aggregation mask instead; it is not the default here.
//!
//! Which batch: the paper's B is the training batch; the released code computes the mask per
//! micro-batch from the current policy's entropies in the training forward pass. Either works
//! with [`forking_token_mask`], which sees only the slices it is given.

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param, check_scratch, to_f64};
use core::cmp::Ordering;
use num_traits::Float;

/// Default fraction ρ of the batch's response tokens that keep their policy gradient (0.2,
/// the paper's main setting).
pub const DEFAULT_FORKING_RHO: f64 = 0.2;

/// What [`forking_token_mask`] selected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForkingStats<F> {
    /// Tokens kept: `k = min(N, max(1, ⌈ρ·N⌉))` ([`forking_token_count`]), 0 when N = 0.
    pub kept: usize,
    /// N, the number of valid (response) tokens.
    pub valid: usize,
    /// `kept / valid`, the kept fraction (0 when N = 0). At least ρ, and below `ρ + 1/N`
    /// unless the floor of one token applies.
    pub fraction: F,
    /// The entropy threshold τ: the k-th largest entropy among the valid tokens (every kept
    /// token has `H ≥ τ`, every dropped valid token `H ≤ τ`); `None` when N = 0.
    pub threshold: Option<F>,
}

/// The number of tokens kept out of `valid`: `min(N, max(1, ⌈ρ·N⌉))`, 0 when N = 0.
///
/// The ceiling ignores float noise below a relative `max(1e−9, 4·ε_F)` (as GRPO-λ's
/// [`crate::length::top_group_count`]), so ρ = 0.2 of 10 tokens is 2 in `f32` too
/// (`0.2f32·10 = 2.0000000298`), and ρ = 0.3 of 10 is 3, not 4.
///
/// Errors: ρ outside (0, 1] or not finite ([`Error::OutOfRange`] on `"rho"`).
pub fn forking_token_count<F: Float>(rho: F, valid: usize) -> Result<usize> {
    check_param("rho", rho, rho > F::zero() && rho <= F::one(), "in (0, 1]")?;
    if valid == 0 {
        return Ok(0);
    }
    let x = to_f64(rho) * valid as f64;
    let tol = 1e-9f64.max(4.0 * to_f64(F::epsilon())) * x.max(1.0);
    // x ≤ valid, so the ceiling fits in usize; `as` saturates anyway.
    let k = libm::ceil(x - tol).max(0.0) as usize;
    Ok(k.clamp(1, valid))
}

/// Order of finite values (NaN was rejected, so `partial_cmp` always answers).
#[inline]
fn order<F: Float>(a: &F, b: &F) -> Ordering {
    a.partial_cmp(b).unwrap_or(Ordering::Equal)
}

/// The forking-token mask of one batch: `out[t] = 1` on exactly the top
/// `k = min(N, max(1, ⌈ρ·N⌉))` valid tokens by entropy, 0 elsewhere (and on every invalid
/// token). N is the number of valid tokens (`mask[t] = 1`); `k` is [`forking_token_count`].
///
/// **Tie rule** (deterministic): with the valid tokens ordered by entropy descending and,
/// among equal entropies, by index ascending, the first k are kept. Equivalently, with
/// `τ` = the k-th largest valid entropy (the returned threshold), every valid token with
/// `H > τ` is kept, then tokens with `H = τ` in index order until k are kept. So the count is
/// always exactly k (`torch.topk` in the authors' code leaves the choice among ties
/// unspecified; TRL's `entropy ≥ quantile` keeps every tie and so may keep more), and the
/// masks are nested: a larger ρ keeps a superset.
///
/// `entropies` and `mask` are the batch's token tensors flattened in one fixed order (the
/// trainer's padded `[rows, cols]` row-major layout); "index" is the position in them.
/// Entropies are read only where `mask` is 1 (padding may hold anything, NaN included).
/// Any finite entropy is accepted (a token entropy is ≥ 0; negative values are ranked like
/// any other; −0 and +0 are equal). `scratch` needs at least N elements (`entropies.len()`
/// always suffices) and receives a reordered copy of the valid entropies. O(len) expected
/// time, no allocation.
///
/// A batch without valid tokens is not an error: `out` is all 0 and the stats are
/// `kept = valid = 0`, `fraction = 0`, `threshold = None`.
///
/// Example (flat, `·` = padding): entropies `[0.9, 0.1, 0.5, 0.5, ·, 0.5, 2.0, 0.0, 0.3, 0.7]`,
/// N = 9. ρ = 0.2: k = ⌈1.8⌉ = 2, τ = 0.9, kept indices {0, 6}. ρ = 0.5: k = ⌈4.5⌉ = 5,
/// τ = 0.5; 2.0, 0.9, 0.7 are above τ and two of the three 0.5s are needed: indices 2 and 3
/// are kept, 5 is not.
///
/// Errors: `mask` or `out` of another length than `entropies` ([`Error::LengthMismatch`]);
/// ρ outside (0, 1] or not finite ([`Error::OutOfRange`] on `"rho"`); `mask` not 0/1
/// ([`Error::InvalidMask`]); a NaN or ±∞ entropy at a valid token ([`Error::NonFinite`] on
/// `"entropies"` with its index); `scratch` shorter than N ([`Error::ScratchTooSmall`]).
/// On error `out` holds unspecified values.
pub fn forking_token_mask<F: Float>(
    entropies: &[F],
    mask: &[F],
    rho: F,
    scratch: &mut [F],
    out: &mut [F],
) -> Result<ForkingStats<F>> {
    check_len("mask", entropies.len(), mask.len())?;
    check_len("out", entropies.len(), out.len())?;
    check_param("rho", rho, rho > F::zero() && rho <= F::one(), "in (0, 1]")?;
    let mut valid = 0usize;
    for (index, (&h, &m)) in entropies.iter().zip(mask).enumerate() {
        if m == F::one() {
            if !h.is_finite() {
                return Err(Error::NonFinite {
                    what: "entropies",
                    index,
                });
            }
            valid += 1;
        } else if m != F::zero() {
            return Err(Error::InvalidMask {
                what: "mask",
                index,
            });
        }
    }
    if valid == 0 {
        out.fill(F::zero());
        return Ok(ForkingStats {
            kept: 0,
            valid: 0,
            fraction: F::zero(),
            threshold: None,
        });
    }
    check_scratch("scratch", valid, scratch.len())?;
    let k = forking_token_count(rho, valid)?;

    // τ = the k-th largest valid entropy = the (N − k)-th smallest (0-based).
    let buf = scratch.get_mut(..valid).unwrap_or(&mut []);
    let valid_entropies = entropies
        .iter()
        .zip(mask)
        .filter(|&(_, &m)| m == F::one())
        .map(|(&h, _)| h);
    for (s, h) in buf.iter_mut().zip(valid_entropies) {
        *s = h;
    }
    let tau = match buf.len().checked_sub(k) {
        Some(at) if at < buf.len() => *buf.select_nth_unstable_by(at, order).1,
        _ => F::nan(), // unreachable: 1 ≤ k ≤ N = buf.len()
    };

    // Tokens strictly above τ are all kept (fewer than k of them); ties fill the rest in
    // index order.
    let above = entropies
        .iter()
        .zip(mask)
        .filter(|&(&h, &m)| m == F::one() && h > tau)
        .count();
    let mut ties_left = k.saturating_sub(above);
    for ((o, &h), &m) in out.iter_mut().zip(entropies).zip(mask) {
        let keep = if m != F::one() {
            false
        } else if h > tau {
            true
        } else if h == tau && ties_left > 0 {
            ties_left -= 1;
            true
        } else {
            false
        };
        *o = if keep { F::one() } else { F::zero() };
    }
    Ok(ForkingStats {
        kept: k,
        valid,
        fraction: cast::<F>(k as f64) / cast::<F>(valid as f64),
        threshold: Some(tau),
    })
}

/// Restricts a per-token gradient to the kept tokens: `grad[t] ← grad[t]` where `keep[t] = 1`,
/// exactly 0 where `keep[t] = 0` (so a non-finite gradient at a dropped token cannot leak).
///
/// `grad` is a loss's `∂loss/∂logπ_t` (or any per-token coefficient, already weighted by the
/// aggregation); `keep` is the mask of [`forking_token_mask`]. See the module docs for why the
/// aggregation weights are left as they are.
///
/// Errors: `keep` of another length than `grad` ([`Error::LengthMismatch`]); `keep` not 0/1
/// ([`Error::InvalidMask`]; `grad` is then unchanged).
pub fn mask_token_gradient<F: Float>(grad: &mut [F], keep: &[F]) -> Result<()> {
    check_len("keep", grad.len(), keep.len())?;
    crate::num::check_mask("keep", keep)?;
    for (g, &k) in grad.iter_mut().zip(keep) {
        if k == F::zero() {
            *g = F::zero();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    const NAN: f64 = f64::NAN;
    /// The module's example batch: 10 positions, index 4 is padding.
    const H: [f64; 10] = [0.9, 0.1, 0.5, 0.5, NAN, 0.5, 2.0, 0.0, 0.3, 0.7];
    const M: [f64; 10] = [1., 1., 1., 1., 0., 1., 1., 1., 1., 1.];

    fn run(h: &[f64], m: &[f64], rho: f64) -> (Vec<f64>, ForkingStats<f64>) {
        let mut scratch = vec![0.0; h.len()];
        let mut out = vec![-1.0; h.len()];
        let stats = forking_token_mask(h, m, rho, &mut scratch, &mut out).unwrap();
        (out, stats)
    }

    fn kept(out: &[f64]) -> Vec<usize> {
        (0..out.len()).filter(|&i| out[i] == 1.0).collect()
    }

    #[test]
    fn hand_made_batch() {
        // N = 9; sorted descending: 2.0, 0.9, 0.7, 0.5, 0.5, 0.5, 0.3, 0.1, 0.0
        let (out, s) = run(&H, &M, 0.2); // k = ⌈1.8⌉ = 2
        assert_eq!(kept(&out), vec![0, 6]);
        assert_eq!((s.kept, s.valid, s.threshold), (2, 9, Some(0.9)));
        assert!((s.fraction - 2.0 / 9.0).abs() < 1e-15);
        assert!(out.iter().all(|&o| o == 0.0 || o == 1.0));

        // k = ⌈4.5⌉ = 5, τ = 0.5: 2.0, 0.9, 0.7 above; the 0.5s at 2 and 3 fill, 5 does not
        let (out, s) = run(&H, &M, 0.5);
        assert_eq!(kept(&out), vec![0, 2, 3, 6, 9]);
        assert_eq!((s.kept, s.threshold), (5, Some(0.5)));

        // k = 6 takes the third 0.5 as well; k = 7 goes down to 0.3
        assert_eq!(kept(&run(&H, &M, 6.0 / 9.0).0), vec![0, 2, 3, 5, 6, 9]);
        assert_eq!(run(&H, &M, 0.7).1.threshold, Some(0.3));

        // ρ = 1 keeps every valid token (τ = the minimum), never the padding
        let (out, s) = run(&H, &M, 1.0);
        assert_eq!(out, M.to_vec());
        assert_eq!((s.kept, s.fraction, s.threshold), (9, 1.0, Some(0.0)));

        // ρ·N < 1 still keeps one token
        let (out, s) = run(&H, &M, 0.01);
        assert_eq!((kept(&out), s.kept, s.threshold), (vec![6], 1, Some(2.0)));

        // f32 gives the same mask
        let h32: Vec<f32> = H.iter().map(|&x| x as f32).collect();
        let m32: Vec<f32> = M.iter().map(|&x| x as f32).collect();
        let (mut scratch, mut out32) = ([0f32; 10], [0f32; 10]);
        let s = forking_token_mask(&h32, &m32, 0.5f32, &mut scratch, &mut out32).unwrap();
        assert_eq!(s.kept, 5);
        assert_eq!(s.threshold, Some(0.5f32));
        let idx: Vec<usize> = (0..10).filter(|&i| out32[i] == 1.0).collect();
        assert_eq!(idx, vec![0, 2, 3, 6, 9]);
    }

    #[test]
    fn all_ties_keep_the_first_k_in_index_order() {
        let h = [1.0; 7];
        let (out, s) = run(&h, &[1.0; 7], 0.3); // ⌈2.1⌉ = 3
        assert_eq!(kept(&out), vec![0, 1, 2]);
        assert_eq!((s.kept, s.threshold), (3, Some(1.0)));
    }

    #[test]
    fn count_rounding() {
        assert_eq!(forking_token_count(0.2f64, 10), Ok(2));
        assert_eq!(forking_token_count(0.2f32, 10), Ok(2)); // 0.2f32·10 = 2.0000000298
        assert_eq!(forking_token_count(0.3f64, 10), Ok(3)); // 3.0000000000000004
        assert_eq!(forking_token_count(0.2f64, 11), Ok(3)); // ⌈2.2⌉
        assert_eq!(forking_token_count(0.2f32, 1_000_000), Ok(200_000));
        assert_eq!(forking_token_count(1e-9f64, 5), Ok(1));
        assert_eq!(forking_token_count(1.0f64, 5), Ok(5));
        assert_eq!(forking_token_count(0.5f64, 0), Ok(0));
        for rho in [0.0, -0.1, 1.0000001, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(
                    forking_token_count(rho, 3),
                    Err(Error::OutOfRange { what: "rho", .. })
                ),
                "rho = {rho}"
            );
        }
    }

    #[test]
    fn empty_batch_and_errors() {
        // no valid token: all 0, no threshold
        let (out, s) = run(&[NAN, 1.0], &[0.0, 0.0], 0.2);
        assert_eq!(out, vec![0.0, 0.0]);
        assert_eq!(
            s,
            ForkingStats {
                kept: 0,
                valid: 0,
                fraction: 0.0,
                threshold: None
            }
        );
        let (mut scratch, mut out) = ([0.0; 10], [0.0; 10]);
        assert_eq!(
            forking_token_mask::<f64>(&[], &[], 0.2, &mut [], &mut []).map(|s| s.kept),
            Ok(0)
        );
        for rho in [0.0, 1.5, -0.2, f64::NAN] {
            assert!(matches!(
                forking_token_mask(&H, &M, rho, &mut scratch, &mut out),
                Err(Error::OutOfRange { what: "rho", .. })
            ));
        }
        let mut bad = H;
        bad[5] = NAN;
        assert_eq!(
            forking_token_mask(&bad, &M, 0.2, &mut scratch, &mut out),
            Err(Error::NonFinite {
                what: "entropies",
                index: 5
            })
        );
        bad[5] = f64::INFINITY;
        assert!(forking_token_mask(&bad, &M, 0.2, &mut scratch, &mut out).is_err());
        let mut bad_mask = M;
        bad_mask[3] = 0.5;
        assert_eq!(
            forking_token_mask(&H, &bad_mask, 0.2, &mut scratch, &mut out),
            Err(Error::InvalidMask {
                what: "mask",
                index: 3
            })
        );
        assert_eq!(
            forking_token_mask(&H, &M[..9], 0.2, &mut scratch, &mut out),
            Err(Error::LengthMismatch {
                what: "mask",
                expected: 10,
                actual: 9
            })
        );
        assert!(matches!(
            forking_token_mask(&H, &M, 0.2, &mut scratch, &mut out[..9]),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        // scratch needs N = 9, not 10
        assert!(forking_token_mask(&H, &M, 0.2, &mut scratch[..9], &mut out).is_ok());
        assert_eq!(
            forking_token_mask(&H, &M, 0.2, &mut scratch[..8], &mut out),
            Err(Error::ScratchTooSmall {
                what: "scratch",
                needed: 9,
                actual: 8
            })
        );
    }

    #[test]
    fn gradient_mask() {
        let mut g = [1.5, f64::NAN, -2.0, 0.25];
        mask_token_gradient(&mut g, &[1.0, 0.0, 1.0, 0.0]).unwrap();
        assert_eq!(g, [1.5, 0.0, -2.0, 0.0]);
        assert!(matches!(
            mask_token_gradient(&mut g, &[1.0, 0.0, 1.0]),
            Err(Error::LengthMismatch { what: "keep", .. })
        ));
        assert_eq!(
            mask_token_gradient(&mut g, &[1.0, 0.0, 2.0, 0.0]),
            Err(Error::InvalidMask {
                what: "keep",
                index: 2
            })
        );
        assert_eq!(g, [1.5, 0.0, -2.0, 0.0]);
    }

    /// Reference: sort the valid indices by (entropy descending, index ascending), keep k.
    fn reference(h: &[f64], m: &[f64], k: usize) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..h.len()).filter(|&i| m[i] == 1.0).collect();
        idx.sort_by(|&a, &b| h[b].total_cmp(&h[a]).then(a.cmp(&b)));
        let mut out = vec![0.0; h.len()];
        for &i in idx.iter().take(k) {
            out[i] = 1.0;
        }
        out
    }

    fn batch() -> impl Strategy<Value = (Vec<f64>, Vec<f64>)> {
        (0usize..80).prop_flat_map(|n| {
            (
                // few distinct values so ties are common
                proptest::collection::vec(
                    prop_oneof![0.0f64..3.0, (0u8..4).prop_map(|x| f64::from(x) * 0.5)],
                    n,
                ),
                proptest::collection::vec(prop_oneof![3 => Just(1.0f64), 1 => Just(0.0)], n),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn exact_count_ties_and_reference((h, m) in batch(), rho in 0.001f64..=1.0) {
            let (out, s) = run(&h, &m, rho);
            let n = m.iter().filter(|&&x| x == 1.0).count();
            let k = forking_token_count(rho, n).unwrap();
            prop_assert_eq!(s.valid, n);
            prop_assert_eq!(s.kept, k);
            prop_assert_eq!(out.iter().filter(|&&o| o == 1.0).count(), k);
            prop_assert_eq!(&out, &reference(&h, &m, k));
            if n == 0 {
                prop_assert_eq!(s.threshold, None);
                return Ok(());
            }
            prop_assert!(k >= 1 && k <= n);
            prop_assert!(k as f64 >= rho * n as f64 - 1e-9 * n as f64);
            prop_assert!((k as f64) < rho * n as f64 + 1.0 || k == 1);
            prop_assert!((s.fraction - k as f64 / n as f64).abs() < 1e-15);
            let tau = s.threshold.unwrap();
            let mut last_tied_kept = None;
            let mut first_tied_dropped = None;
            for i in 0..h.len() {
                if m[i] == 0.0 {
                    prop_assert_eq!(out[i], 0.0);
                } else if out[i] == 1.0 {
                    prop_assert!(h[i] >= tau);
                    if h[i] == tau { last_tied_kept = Some(i); }
                } else {
                    prop_assert!(h[i] <= tau);
                    if h[i] == tau && first_tied_dropped.is_none() { first_tied_dropped = Some(i); }
                }
            }
            // τ is attained by a kept token, and tied tokens are kept in index order
            prop_assert!(last_tied_kept.is_some());
            if let (Some(a), Some(b)) = (last_tied_kept, first_tied_dropped) {
                prop_assert!(a < b);
            }
        }

        #[test]
        fn nested_in_rho((h, m) in batch(), r1 in 0.001f64..=1.0, r2 in 0.001f64..=1.0) {
            let (lo, hi) = if r1 <= r2 { (r1, r2) } else { (r2, r1) };
            let (a, sa) = run(&h, &m, lo);
            let (b, sb) = run(&h, &m, hi);
            prop_assert!(sa.kept <= sb.kept);
            for (x, y) in a.iter().zip(&b) {
                prop_assert!(*x <= *y, "ρ = {} keeps a token ρ = {} drops", lo, hi);
            }
            if let (Some(ta), Some(tb)) = (sa.threshold, sb.threshold) {
                prop_assert!(ta >= tb);
            }
        }

        #[test]
        fn padding_values_are_never_read(
            (h, m) in batch(),
            rho in 0.001f64..=1.0,
            junk in any::<f64>(),
        ) {
            let (out, s) = run(&h, &m, rho);
            let h2: Vec<f64> = h
                .iter()
                .zip(&m)
                .map(|(&x, &v)| if v == 1.0 { x } else { junk })
                .collect();
            let (out2, s2) = run(&h2, &m, rho);
            prop_assert_eq!(out, out2);
            prop_assert_eq!(s, s2);
        }
    }
}
