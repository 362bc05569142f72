//! CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1, arXiv
//! 2506.13585): REINFORCE with a clipped, stop-gradient importance weight, so no token's
//! gradient is dropped by the clip.

use super::{
    Acc, Checked, LOG_RATIO_CLAMP, PolicyLossConfig, PolicyLossInput, PolicyLossOutput, check_all,
    row_valid,
};
use crate::error::Result;
use crate::num::{cast, exp_bounded};
use num_traits::Float;

/// The CISPO loss over `[rows, cols]` with its gradient `∂loss/∂logπ_t`.
///
/// Per valid token: `ℓ = clamp(logπ − logπ_old, −20, 20)`, `r = eˡ`,
/// `ŵ = sg(clamp(r, 1 − ε_low, 1 + ε_high))` (ε from `config.clip`) and
/// `L = −ŵ·A·logπ`, so `dL/dlogπ = −ŵ·A` everywhere (the clipped weight is a constant).
/// Times the rollout importance weight, aggregated by `config.agg`, as in
/// [`super::policy_loss`].
///
/// The loss *value* contains logπ itself (it is a surrogate whose gradient is the CISPO
/// estimator; only the gradient is meaningful). `clipfrac` counts valid tokens where the
/// clamp changed r (`r < 1 − ε_low` or `r > 1 + ε_high`); `clipfrac_lower` is 0;
/// `clip_ratio_c` is validated but not used.
///
/// Errors: as [`super::policy_loss`].
pub fn cispo_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    config: &PolicyLossConfig<F>,
    grad: &mut [F],
) -> Result<PolicyLossOutput<F>> {
    let Checked { plan, streams, is } = check_all(input, config, grad.len())?;
    let cols = plan.cols;
    let (lo, hi) = config.clip.bounds();
    let bound: F = cast(LOG_RATIO_CLAMP);
    let mut acc = Acc::new();
    for (r, g_row) in grad.chunks_exact_mut(cols).enumerate() {
        let at = r * cols;
        let m = &streams.mask[at..at + cols];
        let weight = plan.row_weight(row_valid(m));
        for (t, g) in g_row.iter_mut().enumerate() {
            let i = at + t;
            if m[t] == F::zero() {
                *g = F::zero();
                continue;
            }
            let (lp, lo_old, a) = (streams.logp[i], streams.logp_old[i], streams.advantages[i]);
            let l = (lp - lo_old).max(-bound).min(bound);
            let ratio = exp_bounded(l);
            let clipped_ratio = ratio.max(lo).min(hi);
            let (w, changed) = is.weight(lo_old - streams.rollout[i], bound);
            let slope = -(clipped_ratio * a);
            acc.loss = acc.loss + weight * w * slope * lp;
            acc.token(l, (w, changed), clipped_ratio != ratio);
            *g = weight * w * slope;
        }
    }
    Ok(acc.output(&plan))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::super::LossAggMode;
    use super::*;
    use crate::Shape;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    #[test]
    fn hand_checked() {
        // t0: r = 2 → ŵ = 1.3 (clipped), A = 1, logπ = −0.5: L = 0.65, dL/dlogπ = −1.3
        // t1: r = 1 → ŵ = 1, A = −2, logπ = −1: L = −2, dL/dlogπ = 2; t2 padding
        let logp = [-0.5, -1.0, f64::NAN];
        let old = [-0.5 - 2f64.ln(), -1.0, 0.0];
        let input = PolicyLossInput {
            shape: Shape::new(1, 3),
            logp: &logp,
            logp_old: &old,
            advantages: &[1.0, -2.0, 0.0],
            mask: &[1.0, 1.0, 0.0],
            logp_rollout: None,
        };
        let mut g = [9.0; 3];
        let out = cispo_loss(&input, &PolicyLossConfig::default(), &mut g).unwrap();
        assert!(
            (out.loss - (0.65 - 2.0) / 2.0).abs() < 1e-12,
            "{}",
            out.loss
        );
        assert!((g[0] + 0.65).abs() < 1e-12 && (g[1] - 1.0).abs() < 1e-12 && g[2] == 0.0);
        assert_eq!((out.clipfrac, out.clipfrac_lower), (0.5, 0.0));
        let bad = PolicyLossConfig {
            clip: super::super::ClipParams {
                clip_ratio_low: 2.0,
                ..Default::default()
            },
            ..PolicyLossConfig::default()
        };
        assert!(cispo_loss(&input, &bad, &mut g).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The gradient is that of the loss with the clipped weight held constant: moving
        /// logπ and logπ_old together by h keeps every ratio, so the central difference of
        /// the loss along that direction is the stop-gradient derivative.
        #[test]
        fn gradient_is_the_stop_gradient_derivative(
            (rows, cols) in (1usize..4, 1usize..6),
            seed in proptest::collection::vec((-3.0f64..0.0, -0.8f64..0.8, -2.0f64..2.0, any::<bool>()), 24),
            agg in proptest::sample::select(&LossAggMode::ALL[..]),
        ) {
            let n = rows * cols;
            let logp: Vec<f64> = seed[..n].iter().map(|s| s.0).collect();
            let shift: Vec<f64> = seed[..n].iter().map(|s| s.1).collect();
            let adv: Vec<f64> = seed[..n].iter().map(|s| s.2).collect();
            let mut mask: Vec<f64> = seed[..n].iter().map(|s| f64::from(u8::from(s.3))).collect();
            mask[0] = 1.0;
            let cfg = PolicyLossConfig { agg, ..PolicyLossConfig::default() };
            let loss_at = |lp: &[f64], old: &[f64]| {
                let inp = PolicyLossInput { shape: Shape::new(rows, cols), logp: lp, logp_old: old, advantages: &adv, mask: &mask, logp_rollout: None };
                let mut g = vec![0.0; n];
                (cispo_loss(&inp, &cfg, &mut g).unwrap().loss, g)
            };
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let (_, grad) = loss_at(&logp, &old);
            let h = 1e-6;
            for t in 0..n {
                let (mut p, mut o) = (logp.clone(), old.clone());
                p[t] += h;
                o[t] += h;
                let (fp, _) = loss_at(&p, &o);
                p[t] -= 2.0 * h;
                o[t] -= 2.0 * h;
                let (fm, _) = loss_at(&p, &o);
                let fd = (fp - fm) / (2.0 * h);
                prop_assert!((fd - grad[t]).abs() <= 1e-6 * (1.0 + grad[t].abs()), "t={} fd={} grad={}", t, fd, grad[t]);
                // never zero where A ≠ 0: CISPO keeps every token's gradient
                if mask[t] != 0.0 && adv[t] != 0.0 {
                    prop_assert!(grad[t] != 0.0);
                }
            }
        }
    }
}
