//! DAPO's soft overlong punishment (docs/algorithms.md §16.3): a length penalty that ramps
//! linearly over the last `overlong_buffer_len` tokens before `max_response_length`.
//!
//! Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv
//! 2503.14476, §3.4 "Overlong Reward Shaping", Eq. 13), with `L_max` the maximum response
//! length and `L_cache` the punishment buffer:
//!
//! ```text
//! R_length(y) = 0                                 |y| ≤ L_max − L_cache
//!             = ((L_max − L_cache) − |y|)/L_cache  L_max − L_cache < |y| ≤ L_max
//!             = −1                                L_max < |y|
//! ```
//!
//! added to the correctness reward. verl's DAPO reward manager (`DAPORewardManager`) scales it
//! by `penalty_factor`, computing `min(−(|y| − (L_max − L_cache))/L_cache·penalty_factor, 0)`,
//! the same on `|y| ≤ L_max` (verl never sees a longer response). [`overlong_penalty`] equals
//! it exactly there (up to the sign of a zero) and is `−penalty_factor` beyond. The paper's
//! run uses `L_max = 20480`, `L_cache = 4096`, factor 1.
//!
//! **Penalise length only when correct.** [`overlong_penalties`] takes an optional `correct`
//! flag per sample; with it, only correct samples are penalised (incorrect ones get 0), so the
//! penalty orders correct answers by length and never pushes a wrong answer to be shorter.
//! With `penalty_factor ≤ 1` and 0/1 accuracy a correct answer then always out-scores an
//! incorrect one. The other length rewards need no such switch, because they already act on
//! correct samples only: GRPO-λ ([`crate::length`], docs/algorithms.md §8) gives correct samples
//! of its top groups `1 − α·sig(z)` and incorrect ones 0 (the reference sample code gave the
//! incorrect ones the length reward too; ares follows the formula), and ARES's shaping
//! ([`crate::shaping`], §3) penalises reasoning length (HWE tokens) only for correct answers
//! while wrong answers get a small exploration reward, never a length penalty.

use crate::error::{Error, Result};
use crate::num::{cast, check_len, check_param};
use num_traits::Float;

/// Validates the overlong-buffer parameters (see [`overlong_penalty`]).
fn check_params<F: Float>(max_len: usize, buffer_len: usize, penalty_factor: F) -> Result<()> {
    if max_len == 0 {
        return Err(Error::OutOfRange {
            what: "max_response_length",
            value: 0.0,
            expected: ">= 1",
        });
    }
    if buffer_len == 0 {
        return Err(Error::OutOfRange {
            what: "overlong_buffer_len",
            value: 0.0,
            expected: ">= 1 (disable the overlong penalty rather than set a zero buffer)",
        });
    }
    if buffer_len > max_len {
        return Err(Error::OutOfRange {
            what: "overlong_buffer_len",
            value: buffer_len as f64,
            expected: "<= max_response_length",
        });
    }
    check_param(
        "penalty_factor",
        penalty_factor,
        penalty_factor >= F::zero(),
        "finite and >= 0",
    )
}

/// The penalty without validation (parameters checked by the caller).
#[inline]
fn penalty_raw<F: Float>(length: usize, max_len: usize, buffer_len: usize, factor: F) -> F {
    let expected = max_len - buffer_len; // buffer_len ≤ max_len
    if length <= expected {
        return F::zero();
    }
    // 1 ≤ exceed ≤ buffer_len: the ramp, capped at the full penalty beyond max_len
    let exceed = (length - expected).min(buffer_len);
    let p = cast::<F>(exceed as f64) / cast::<F>(buffer_len as f64) * factor;
    if p == F::zero() { F::zero() } else { -p }
}

/// DAPO's soft overlong penalty of one response of `length` tokens, with
/// `L_max = max_len` (`max_response_length`), `L_cache = buffer_len` (`overlong_buffer_len`)
/// and `f = penalty_factor`:
///
/// - `0` when `L ≤ L_max − L_cache`;
/// - `−(L − (L_max − L_cache))/L_cache · f` when `L_max − L_cache < L ≤ L_max`, falling
///   linearly by `f/L_cache` per token down to `−f` at `L = L_max`;
/// - `−f` when `L > L_max`.
///
/// The result lies in `[−f, 0]` and is non-increasing in L. It is added to the sample's
/// reward. Example (`L_max = 20480`, `L_cache = 4096`, f = 1): L = 16384 → 0, 16385 →
/// −1/4096, 18432 → −0.5, 20480 → −1, 30000 → −1.
///
/// A zero buffer is an error, not a hard cutoff: the formula divides by `L_cache`, verl
/// raises on it, and with responses truncated at `L_max` a zero buffer would penalise
/// nothing; turn the penalty off instead.
///
/// Errors ([`Error::OutOfRange`] naming the key): `max_len = 0` (`"max_response_length"`);
/// `buffer_len = 0` or `buffer_len > max_len` (`"overlong_buffer_len"`); `penalty_factor`
/// negative or not finite (`"penalty_factor"`).
pub fn overlong_penalty<F: Float>(
    length: usize,
    max_len: usize,
    buffer_len: usize,
    penalty_factor: F,
) -> Result<F> {
    check_params(max_len, buffer_len, penalty_factor)?;
    Ok(penalty_raw(length, max_len, buffer_len, penalty_factor))
}

/// [`overlong_penalty`] for a batch: `out[i]` = the penalty of `lengths[i]`; returns how many
/// samples are penalised (`out[i] < 0`, verl's `overlong` flag).
///
/// `correct` switches on "penalise length only when correct": with `Some(flags)`, a sample
/// with `flags[i] = false` gets 0 whatever its length (see the module docs); with `None`
/// every sample is penalised (DAPO, verl).
///
/// Errors: as [`overlong_penalty`]; `correct` or `out` of another length than `lengths`
/// ([`Error::LengthMismatch`]). On error `out` is unchanged.
pub fn overlong_penalties<F: Float>(
    lengths: &[usize],
    max_len: usize,
    buffer_len: usize,
    penalty_factor: F,
    correct: Option<&[bool]>,
    out: &mut [F],
) -> Result<usize> {
    check_params(max_len, buffer_len, penalty_factor)?;
    if let Some(c) = correct {
        check_len("correct", lengths.len(), c.len())?;
    }
    check_len("out", lengths.len(), out.len())?;
    let mut penalised = 0usize;
    for (i, (o, &len)) in out.iter_mut().zip(lengths).enumerate() {
        let applies = correct.is_none_or(|c| c.get(i).copied().unwrap_or(false));
        *o = if applies {
            penalty_raw(len, max_len, buffer_len, penalty_factor)
        } else {
            F::zero()
        };
        if *o < F::zero() {
            penalised += 1;
        }
    }
    Ok(penalised)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    /// verl's `min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)` in f64.
    fn verl(len: usize, max: usize, buf: usize, f: f64) -> f64 {
        let exceed = len as f64 - (max - buf) as f64;
        (-exceed / buf as f64 * f).min(0.0)
    }

    #[test]
    fn paper_setting() {
        let p = |l| overlong_penalty(l, 20480, 4096, 1.0f64).unwrap();
        assert_eq!(p(0), 0.0);
        assert_eq!(p(16384), 0.0);
        assert_eq!(p(16385), -1.0 / 4096.0); // −0.000244140625
        assert_eq!(p(18432), -0.5);
        assert_eq!(p(20479), -4095.0 / 4096.0);
        assert_eq!(p(20480), -1.0);
        assert_eq!(p(20481), -1.0);
        assert_eq!(p(usize::MAX), -1.0);
        assert_eq!(overlong_penalty(18432, 20480, 4096, 0.5f64), Ok(-0.25));
        assert_eq!(overlong_penalty(18432, 20480, 4096, 0.5f32), Ok(-0.25f32));
        // a zero factor gives +0, not −0
        let z = overlong_penalty(20480, 20480, 4096, 0.0f64).unwrap();
        assert!(z == 0.0 && z.is_sign_positive());
    }

    #[test]
    fn small_ramp() {
        // L_max 10, L_cache 4: 0 up to 6, then −0.25 per token to −1 at 10
        let want = [
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0,
        ];
        for (l, &w) in want.iter().enumerate() {
            assert_eq!(overlong_penalty(l, 10, 4, 1.0f64), Ok(w), "L = {l}");
        }
        // buffer = max: the ramp starts at L = 0
        assert_eq!(overlong_penalty(0, 8, 8, 2.0f64), Ok(0.0));
        assert_eq!(overlong_penalty(2, 8, 8, 2.0f64), Ok(-0.5));
        assert_eq!(overlong_penalty(8, 8, 8, 2.0f64), Ok(-2.0));
    }

    #[test]
    fn batch_and_only_correct() {
        let lengths = [3, 7, 9, 10, 12, 5];
        let mut out = [f64::NAN; 6];
        assert_eq!(
            overlong_penalties(&lengths, 10, 4, 1.0, None, &mut out),
            Ok(4)
        );
        assert_eq!(out, [0.0, -0.25, -0.75, -1.0, -1.0, 0.0]);
        let correct = [true, false, true, false, true, true];
        assert_eq!(
            overlong_penalties(&lengths, 10, 4, 1.0, Some(&correct), &mut out),
            Ok(2)
        );
        assert_eq!(out, [0.0, 0.0, -0.75, 0.0, -1.0, 0.0]);
        // empty batch
        assert_eq!(
            overlong_penalties::<f64>(&[], 10, 4, 1.0, None, &mut []),
            Ok(0)
        );
    }

    #[test]
    fn errors_name_the_key() {
        let key = |r: Result<f64>| match r {
            Err(Error::OutOfRange { what, .. }) => what,
            other => panic!("expected OutOfRange, got {other:?}"),
        };
        assert_eq!(key(overlong_penalty(5, 10, 11, 1.0)), "overlong_buffer_len");
        assert_eq!(key(overlong_penalty(5, 10, 0, 1.0)), "overlong_buffer_len");
        assert_eq!(key(overlong_penalty(5, 0, 0, 1.0)), "max_response_length");
        assert_eq!(key(overlong_penalty(5, 10, 4, -0.1)), "penalty_factor");
        assert_eq!(key(overlong_penalty(5, 10, 4, f64::NAN)), "penalty_factor");
        assert_eq!(
            key(overlong_penalty(5, 10, 4, f64::INFINITY)),
            "penalty_factor"
        );
        assert!(matches!(
            overlong_penalty(5, 10, 11, 1.0f64),
            Err(Error::OutOfRange { value, .. }) if value == 11.0
        ));
        let mut out = [7.0; 3];
        assert!(matches!(
            overlong_penalties(&[1, 2, 3], 10, 4, 1.0, Some(&[true, false]), &mut out),
            Err(Error::LengthMismatch {
                what: "correct",
                ..
            })
        ));
        assert!(matches!(
            overlong_penalties(&[1, 2, 3], 10, 4, 1.0, None, &mut out[..2]),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        assert!(matches!(
            overlong_penalties(&[1, 2, 3], 10, 40, 1.0, None, &mut out),
            Err(Error::OutOfRange {
                what: "overlong_buffer_len",
                ..
            })
        ));
        assert_eq!(out, [7.0; 3]);
    }

    proptest! {
        #[test]
        fn shape_of_the_penalty(
            max in 1usize..5000,
            buf_frac in 0.0f64..=1.0,
            f in 0.0f64..4.0,
            l1 in 0usize..6000,
            l2 in 0usize..6000,
        ) {
            let buf = ((buf_frac * max as f64) as usize).clamp(1, max);
            let p1 = overlong_penalty(l1, max, buf, f).unwrap();
            let p2 = overlong_penalty(l2, max, buf, f).unwrap();
            for (l, p) in [(l1, p1), (l2, p2)] {
                prop_assert!(-f <= p && p <= 0.0);
                prop_assert_eq!(p == 0.0, l <= max - buf || f == 0.0);
                if l <= max {
                    // verl's formula, exactly (−0 == 0)
                    prop_assert_eq!(p, verl(l, max, buf, f));
                } else {
                    prop_assert_eq!(p, -f);
                }
            }
            // non-increasing in the length
            if l1 <= l2 {
                prop_assert!(p1 >= p2);
            }
            // f32 agrees to rounding
            let p32 = overlong_penalty(l1, max, buf, f as f32).unwrap();
            prop_assert!((f64::from(p32) - p1).abs() <= 1e-6 * (1.0 + f));
        }

        #[test]
        fn only_correct_zeroes_exactly_the_incorrect(
            rows in proptest::collection::vec((0usize..40, any::<bool>()), 0..30),
            f in 0.0f64..2.0,
        ) {
            let lengths: Vec<usize> = rows.iter().map(|r| r.0).collect();
            let correct: Vec<bool> = rows.iter().map(|r| r.1).collect();
            let (mut all, mut only) = (vec![0.0; rows.len()], vec![0.0; rows.len()]);
            let n_all = overlong_penalties(&lengths, 32, 8, f, None, &mut all).unwrap();
            let n_only = overlong_penalties(&lengths, 32, 8, f, Some(&correct), &mut only).unwrap();
            prop_assert!(n_only <= n_all);
            prop_assert_eq!(n_all, all.iter().filter(|&&x| x < 0.0).count());
            for i in 0..rows.len() {
                prop_assert_eq!(all[i], overlong_penalty(lengths[i], 32, 8, f).unwrap());
                prop_assert_eq!(only[i], if correct[i] { all[i] } else { 0.0 });
            }
        }
    }
}
