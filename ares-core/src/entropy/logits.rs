//! Entropy and sampled-token log-probability of one row of logits, in one online pass.

use crate::error::{Error, Result};
use crate::num::check_param;
use num_traits::Float;

/// Running state of the one-pass softmax statistics over `z = logits / temperature`:
/// `max` = largest `z` so far, `rest = Σ e^{z−max} − 1` (the mass of every element but the
/// one maximum, kept apart from its `1` so that peaked rows do not lose their tail to
/// rounding), `weighted = Σ e^{z−max}·(z − max)`.
///
/// Then `logsumexp(z) = max + ln(1 + rest)` and, because
/// `Σ softmax(z)·z = max + weighted/(1 + rest)`, `H = ln_1p(rest) − weighted/(1 + rest)`.
/// Both terms are ≥ 0 (`rest ≥ 0`, `weighted ≤ 0`), so the computed entropy is never
/// negative.
struct Online<F> {
    max: F,
    rest: F,
    weighted: F,
}

impl<F: Float> Online<F> {
    #[inline(always)]
    fn new() -> Self {
        Online {
            max: F::neg_infinity(),
            rest: F::zero(),
            weighted: F::zero(),
        }
    }

    /// Adds one `z` (never NaN or +∞). At most one `exp` per element: a new maximum
    /// rescales the running sums by `c = e^{max_old − z}` and contributes `e^0 = 1` itself.
    #[inline(always)]
    fn push(&mut self, z: F) {
        if z > self.max {
            if self.max == F::neg_infinity() {
                // first element with probability > 0
                self.rest = F::zero();
                self.weighted = F::zero();
            } else {
                let d = self.max - z; // < 0, may be -inf when the logits span > F::MAX
                let c = d.exp();
                if c > F::zero() {
                    // shift every earlier (z_i − max_old) by d: Σ e·(z_i − max_new);
                    // the old maximum's 1 joins the rest as c
                    let sum_old = F::one() + self.rest;
                    self.weighted = c * (self.weighted + sum_old * d);
                    self.rest = c + self.rest * c;
                } else {
                    // e^{d}·d → 0: the earlier mass vanishes at this precision
                    self.rest = F::zero();
                    self.weighted = F::zero();
                }
            }
            self.max = z;
        } else {
            // z = -inf (or an underflowing e) has probability 0 and contributes nothing; the
            // test avoids 0·(−∞) = NaN. (-inf − -inf = NaN also fails `e > 0`.)
            let d = z - self.max;
            let e = d.exp();
            if e > F::zero() {
                self.rest = self.rest + e;
                self.weighted = self.weighted + e * d;
            }
        }
    }
}

impl<F: Float> Online<F> {
    #[inline(always)]
    fn entropy(&self) -> F {
        self.rest.ln_1p() - self.weighted / (F::one() + self.rest)
    }
}

/// Validates the temperature, then runs the online pass; returns the state and `z[target]`.
fn online_pass<F: Float>(
    logits: &[F],
    temperature: F,
    target: Option<usize>,
) -> Result<(Online<F>, F)> {
    check_param(
        "temperature",
        temperature,
        temperature > F::zero(),
        "finite and > 0",
    )?;
    if logits.is_empty() {
        return Err(Error::Empty { what: "logits" });
    }
    if let Some(target) = target {
        if target >= logits.len() {
            return Err(Error::InvalidIndex {
                what: "target",
                position: 0,
                value: target,
                len: logits.len(),
            });
        }
    }
    let mut state = Online::new();
    let mut z_target = F::neg_infinity();
    for (index, &x) in logits.iter().enumerate() {
        if x.is_nan() || x == F::infinity() {
            return Err(Error::NonFinite {
                what: "logits",
                index,
            });
        }
        let z = x / temperature;
        if z == F::infinity() {
            // a finite logit overflowed when divided by a tiny temperature
            return Err(Error::NonFinite {
                what: "logits / temperature",
                index,
            });
        }
        if Some(index) == target {
            z_target = z;
        }
        state.push(z);
    }
    if state.max == F::neg_infinity() {
        return Err(Error::Empty {
            what: "logits (every entry is -inf)",
        });
    }
    Ok((state, z_target))
}

/// Entropy of `softmax(logits / temperature)` in nats, in one pass over the logits.
///
/// With `z = logits / temperature`: `H = logsumexp(z) − Σ softmax(z)·z`, computed with an
/// online max / sum (at most one `exp` per element, softmax never materialised), summed in
/// `F`. The result is ≥ 0; a single logit gives `H = 0`; `V` equal logits give `ln V`.
///
/// `-∞` logits are allowed (probability 0, they contribute nothing).
///
/// Errors: empty `logits` or all `-∞` ([`Error::Empty`]); a NaN or `+∞` logit, or a finite
/// logit that overflows to `+∞` when divided by `temperature` ([`Error::NonFinite`] with
/// its index); `temperature` not finite and `> 0` ([`Error::OutOfRange`]).
pub fn token_entropy<F: Float>(logits: &[F], temperature: F) -> Result<F> {
    let (s, _) = online_pass(logits, temperature, None)?;
    Ok(s.entropy())
}

/// Log-probability of the sampled token `target` and the entropy of
/// `softmax(logits / temperature)`, from the same single pass; returns `(log_prob, entropy)`.
///
/// `log_prob = z[target] − logsumexp(z)` (≤ 0) and `entropy` as in [`token_entropy`].
/// A single logit gives `(0, 0)`.
///
/// Errors: those of [`token_entropy`]; `target ≥ logits.len()` ([`Error::InvalidIndex`]);
/// a `-∞` logit at `target` ([`Error::NonFinite`] on `"logits[target]"`): the sampled token
/// had probability 0, which means the sampler and this computation disagree, and a `-∞`
/// log-prob would poison the loss.
pub fn token_log_prob_and_entropy<F: Float>(
    logits: &[F],
    target: usize,
    temperature: F,
) -> Result<(F, F)> {
    let (s, z_target) = online_pass(logits, temperature, Some(target))?;
    if z_target == F::neg_infinity() {
        return Err(Error::NonFinite {
            what: "logits[target]",
            index: target,
        });
    }
    let log_prob = (z_target - s.max) - s.rest.ln_1p();
    Ok((log_prob, s.entropy()))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    /// Naive two-pass reference in f64: softmax materialised.
    fn naive(logits: &[f64], t: f64) -> (f64, Vec<f64>) {
        let z: Vec<f64> = logits.iter().map(|x| x / t).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|z| (z - m).exp()).sum();
        let lse = m + s.ln();
        // H = −Σ p·ln p with ln p = z − lse (no cancellation between lse and Σ p·z)
        let h = -z
            .iter()
            .filter(|z| z.is_finite())
            .map(|z| (z - lse).exp() * (z - lse))
            .sum::<f64>();
        let lp = z.iter().map(|z| z - lse).collect();
        (h, lp)
    }

    #[test]
    fn vector_14() {
        // p = softmax(1,2,3) = (0.0900306, 0.2447285, 0.6652410);
        // H = −Σ p ln p = 0.2168 + 0.3445 + 0.2711 = 0.8323956
        let h = token_entropy(&[1.0f64, 2.0, 3.0], 1.0).unwrap();
        assert!((h - 0.8323956).abs() < 1e-7, "{h}");
        let h = token_entropy(&[0.0f64, 0.0], 1.0).unwrap();
        assert!((h - core::f64::consts::LN_2).abs() < 1e-15);
        let h32 = token_entropy(&[1.0f32, 2.0, 3.0], 1.0).unwrap();
        assert!((h32 - 0.8323956).abs() < 1e-6);
        // log p(3) = 3 − logsumexp = 3 − 3.4076059 = −0.4076059
        let (lp, h) = token_log_prob_and_entropy(&[1.0f64, 2.0, 3.0], 2, 1.0).unwrap();
        assert!((lp + 0.4076059).abs() < 1e-7, "{lp}");
        assert!((h - 0.8323956).abs() < 1e-7);
    }

    #[test]
    fn temperature_scales_logits() {
        // (2, 4, 6) / 2 = (1, 2, 3)
        let h = token_entropy(&[2.0f64, 4.0, 6.0], 2.0).unwrap();
        assert!((h - 0.8323956).abs() < 1e-7);
    }

    #[test]
    fn single_logit_and_uniform() {
        assert_eq!(
            token_log_prob_and_entropy(&[5.0f64], 0, 1.0),
            Ok((0.0, 0.0))
        );
        assert_eq!(
            token_log_prob_and_entropy(&[-1e30f32], 0, 0.7),
            Ok((0.0, 0.0))
        );
        let v = [3.25f64; 1000];
        let (lp, h) = token_log_prob_and_entropy(&v, 17, 1.0).unwrap();
        assert!((h - 1000f64.ln()).abs() < 1e-12);
        assert!((lp + 1000f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn neg_infinity_logits_have_zero_probability() {
        let ninf = f64::NEG_INFINITY;
        let h = token_entropy(&[ninf, 0.0, ninf, 0.0, ninf], 1.0).unwrap();
        assert!((h - core::f64::consts::LN_2).abs() < 1e-15);
        // leading −∞ before any finite value
        let (lp, h) = token_log_prob_and_entropy(&[ninf, 7.0], 1, 1.0).unwrap();
        assert_eq!((lp, h), (0.0, 0.0));
        assert_eq!(
            token_log_prob_and_entropy(&[ninf, 7.0], 0, 1.0),
            Err(Error::NonFinite {
                what: "logits[target]",
                index: 0
            })
        );
    }

    #[test]
    fn peaked_row_regression() {
        // H = 2.0906124351218526e-5 (60-digit arithmetic); lse − Σ p·z cancels at 1e-11
        let l = [47.6451847547447, 0.0, 49.401190966851914, 47.96021058901003];
        let h = token_entropy(&l, 0.10665037384954451f64).unwrap();
        assert!((h - 2.0906124351218526e-5).abs() < 1e-12 * 2.1e-5, "{h}");
    }

    #[test]
    fn extreme_logits() {
        // ±1e4: the +1e4 entries carry all the mass
        let l = [1e4f64, -1e4, 1e4, 0.0, -1e4];
        let h = token_entropy(&l, 1.0).unwrap();
        assert!((h - core::f64::consts::LN_2).abs() < 1e-12);
        let h32 = token_entropy(&[1e4f32, -1e4, 1e4, 0.0, -1e4], 1.0).unwrap();
        assert!((h32 - core::f32::consts::LN_2).abs() < 1e-6);
        // rising maxima force a rescale at each step
        let rising: Vec<f64> = (0..50).map(|i| i as f64 * 300.0).collect();
        let (lp, h) = token_log_prob_and_entropy(&rising, 49, 1.0).unwrap();
        assert!((0.0..1e-100).contains(&h), "{h}");
        assert!(lp.abs() < 1e-100);
        // the span exceeds f64::MAX: max − z overflows to −∞ in the rescale
        let (lp, h) = token_log_prob_and_entropy(&[-1e308f64, 1e308], 1, 1.0).unwrap();
        assert_eq!((lp, h), (0.0, 0.0));
        let (lp, h) = token_log_prob_and_entropy(&[1e308f64, -1e308], 0, 1.0).unwrap();
        assert_eq!((lp, h), (0.0, 0.0));
    }

    #[test]
    fn one_hot_like_rows() {
        // one logit 30 above 999 zeros: p_other = e^{-30}/(1 + 999e^{-30})
        let mut l = vec![0.0f64; 1000];
        l[123] = 30.0;
        let (_, lp_ref) = naive(&l, 1.0);
        let (lp, h) = token_log_prob_and_entropy(&l, 123, 1.0).unwrap();
        // x = 999e^{-30}: H = ln(1+x) + 30x/(1+x) = 2.8979622569535740e-9 (50-digit
        // arithmetic); the naive lse − Σpz cancels to 2.8953e-9, a plain running sum to
        // 2.89788e-9
        assert!((h - 2.897962256953574e-9).abs() < 1e-12 * 2.9e-9, "{h}");
        // log p = −ln(1+x) = −9.3482653454343841e-11
        assert!(
            (lp + 9.348265345434384e-11).abs() < 1e-12 * 9.35e-11,
            "{lp}"
        );
        assert!(h > 0.0);
        let (lp, _) = token_log_prob_and_entropy(&l, 5, 1.0).unwrap();
        assert!((lp - lp_ref[5]).abs() < 1e-12);
    }

    #[test]
    fn errors() {
        assert_eq!(
            token_entropy::<f64>(&[], 1.0),
            Err(Error::Empty { what: "logits" })
        );
        assert_eq!(
            token_entropy(&[f64::NEG_INFINITY; 3], 1.0),
            Err(Error::Empty {
                what: "logits (every entry is -inf)"
            })
        );
        assert_eq!(
            token_entropy(&[0.0, f64::NAN], 1.0),
            Err(Error::NonFinite {
                what: "logits",
                index: 1
            })
        );
        assert_eq!(
            token_entropy(&[f32::INFINITY], 1.0),
            Err(Error::NonFinite {
                what: "logits",
                index: 0
            })
        );
        assert_eq!(
            token_entropy(&[1.0, 1e300f64], 1e-10),
            Err(Error::NonFinite {
                what: "logits / temperature",
                index: 1
            })
        );
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                token_entropy(&[1.0f64], t),
                Err(Error::OutOfRange {
                    what: "temperature",
                    ..
                })
            ));
        }
        assert_eq!(
            token_log_prob_and_entropy(&[1.0f64, 2.0], 2, 1.0),
            Err(Error::InvalidIndex {
                what: "target",
                position: 0,
                value: 2,
                len: 2
            })
        );
    }

    proptest! {
        #[test]
        fn matches_naive_two_pass(
            logits in prop::collection::vec(-50.0f64..50.0, 1..200),
            t in 0.1f64..4.0,
            pick in any::<prop::sample::Index>(),
        ) {
            let target = pick.index(logits.len());
            let (h_ref, lp_ref) = naive(&logits, t);
            let (lp, h) = token_log_prob_and_entropy(&logits, target, t).unwrap();
            prop_assert!((h - h_ref).abs() <= 1e-11 * (1.0 + h_ref.abs()), "{} vs {}", h, h_ref);
            prop_assert!((lp - lp_ref[target]).abs() <= 1e-11 * (1.0 + lp_ref[target].abs()));
            prop_assert!(h >= 0.0 && h <= (logits.len() as f64).ln() + 1e-12);
            prop_assert!(lp <= 0.0);
            // f32 agrees with f64 to f32 precision
            let l32: Vec<f32> = logits.iter().map(|&x| x as f32).collect();
            let h32 = token_entropy(&l32, t as f32).unwrap();
            prop_assert!((f64::from(h32) - h_ref).abs() < 1e-4 * (1.0 + h_ref));
        }
    }
}
