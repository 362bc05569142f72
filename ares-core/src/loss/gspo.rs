//! GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), the PPO
//! clip applied to a per-sequence importance ratio.

use super::{
    Acc, Checked, LOG_RATIO_CLAMP, PolicyLossConfig, PolicyLossInput, PolicyLossOutput, check_all,
    clipped_surrogate, row_valid,
};
use crate::error::Result;
use crate::num::cast;
use num_traits::Float;

/// The sequence log-ratio is clamped above at `10` before `exp` (as verl does), so
/// `s ≤ e^10 ≈ 2.2e4`; there is no lower clamp (`s → 0` is harmless).
pub const GSPO_LOG_RATIO_MAX: f64 = 10.0;

/// Where GSPO's clip applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GspoLevel {
    /// `gspo`: one clipped loss per sequence with the sequence's advantage (the paper's
    /// objective). The gradient reaches every token of the row through the mean log-ratio.
    #[default]
    Sequence,
    /// `gspo_token` (GSPO-token): the sequence ratio with a straight-through per-token
    /// factor, `s_t = sg(s)·π_t/sg(π_t)`, clipped per token with the token's advantage
    /// (verl's `gspo`). Equal to [`GspoLevel::Sequence`] in value and gradient when the
    /// advantage is constant over each row and the aggregation is `seq-mean-token-mean`.
    Token,
}

impl GspoLevel {
    /// The configuration name: `"gspo"` or `"gspo_token"`.
    pub fn name(self) -> &'static str {
        match self {
            GspoLevel::Sequence => "gspo",
            GspoLevel::Token => "gspo_token",
        }
    }
}

/// The GSPO loss over `[rows, cols]` with its gradient `∂loss/∂logπ_t`.
///
/// Per row i with `n_i` valid tokens: `ℓ̄_i = Σ_t m·(logπ − logπ_old) / n_i` (the log of the
/// geometric mean of the token ratios), `s_i = exp(min(ℓ̄_i, 10))`, and with ε from
/// `config.clip` the clipped surrogate `L(s, A) = max(−A·s, −A·clamp(s, 1 − ε_low, 1 + ε_high))`.
///
/// - [`GspoLevel::Sequence`]: `A_i` = the mean advantage over the row's valid tokens and
///   `L_i = L(s_i, A_i)`; every valid token of the row carries `L_i`, so the aggregate is
///   `Σ_i W_i·L_i` with `W_i = Σ_t weight_t·w_t` (aggregation weights × rollout importance
///   weights), and `∂loss/∂logπ_t = W_i · ∂L_i/∂log s_i / n_i` (`∂L/∂log s = −A·s` where
///   unclipped, 0 where clipped).
/// - [`GspoLevel::Token`]: token t carries `L(s_i, A_t)` and
///   `∂loss/∂logπ_t = weight_t·w_t·∂L/∂log s` (the straight-through factor has slope 1 in
///   logπ_t and stops the gradient through the other tokens).
///
/// Where `ℓ̄_i > 10` the clamp holds s constant: gradient 0 (at exactly 10 the slope is
/// kept; torch passes 0 there). There is no dual clip: `config.clip.clip_ratio_c` is
/// validated but not used, and `clipfrac_lower` is 0. `clipfrac` counts valid tokens whose
/// surrogate is clipped (`L2 > L1`); `approx_kl` is the mean of `−clamp(logπ − logπ_old, ±20)`
/// as for [`super::policy_loss`]. The sequence ratio itself uses the unclamped token
/// log-ratios, as verl does.
///
/// Rows without a valid token contribute nothing (gradient 0). Errors: as
/// [`super::policy_loss`] (lengths, mask, empty mask, non-finite inputs at valid positions,
/// bad clip or correction parameters).
pub fn gspo_loss<F: Float>(
    input: &PolicyLossInput<'_, F>,
    config: &PolicyLossConfig<F>,
    level: GspoLevel,
    grad: &mut [F],
) -> Result<PolicyLossOutput<F>> {
    let Checked { plan, streams, is } = check_all(input, config, grad.len())?;
    let cols = plan.cols;
    let (lo, hi) = config.clip.bounds();
    let bound: F = cast(LOG_RATIO_CLAMP);
    let cap: F = cast(GSPO_LOG_RATIO_MAX);
    let mut acc = Acc::new();
    for (r, g_row) in grad.chunks_exact_mut(cols).enumerate() {
        let at = r * cols;
        let m = &streams.mask[at..at + cols];
        let (lp, lo_old) = (
            &streams.logp[at..at + cols],
            &streams.logp_old[at..at + cols],
        );
        let (adv, lr) = (
            &streams.advantages[at..at + cols],
            &streams.rollout[at..at + cols],
        );
        g_row.fill(F::zero());
        let n = row_valid(m);
        if n == 0 {
            continue;
        }
        let weight = plan.row_weight(n);
        let inv_n = F::one() / cast::<F>(n as f64);
        let (mut sum_d, mut sum_a) = (F::zero(), F::zero());
        for t in (0..cols).filter(|&t| m[t] != F::zero()) {
            sum_d = sum_d + (lp[t] - lo_old[t]);
            sum_a = sum_a + adv[t];
        }
        let mean_log_ratio = sum_d * inv_n;
        // Closed interval, as the token clamps of `ppo_token_loss`.
        let live = mean_log_ratio <= cap;
        let s = mean_log_ratio.min(cap).exp();
        let seq = clipped_surrogate(s, sum_a * inv_n, lo, hi);
        // Sequence level: W_i = Σ_t weight·w_t, gathered while the token loop runs.
        let mut row_w = F::zero();
        for t in (0..cols).filter(|&t| m[t] != F::zero()) {
            let d = lp[t] - lo_old[t];
            let (w, changed) = is.weight(lo_old[t] - lr[t], bound);
            let (loss, slope, clipped) = match level {
                GspoLevel::Sequence => seq,
                GspoLevel::Token => clipped_surrogate(s, adv[t], lo, hi),
            };
            acc.loss = acc.loss + weight * w * loss;
            acc.token(d.max(-bound).min(bound), (w, changed), clipped);
            row_w = row_w + weight * w;
            if level == GspoLevel::Token && live {
                g_row[t] = weight * w * slope;
            }
        }
        if level == GspoLevel::Sequence && live {
            let g = row_w * seq.1 * inv_n;
            for (o, _) in g_row.iter_mut().zip(m).filter(|(_, m)| **m != F::zero()) {
                *o = g;
            }
        }
    }
    Ok(acc.output(&plan))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::super::testing::token_batch;
    use super::super::{ClipParams, LossAggMode, policy_loss};
    use super::*;
    use crate::Shape;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    fn input<'a>(
        shape: Shape,
        logp: &'a [f64],
        logp_old: &'a [f64],
        advantages: &'a [f64],
        mask: &'a [f64],
    ) -> PolicyLossInput<'a, f64> {
        PolicyLossInput {
            shape,
            logp,
            logp_old,
            advantages,
            mask,
            logp_rollout: None,
        }
    }

    #[test]
    fn hand_checked() {
        // one row, ℓ = (ln 2, 0, pad): ℓ̄ = ln2/2, s = √2; ε 0.2/0.3 → clamp(s) = 1.3
        let s2 = 2f64.sqrt();
        let shape = Shape::new(1, 3);
        let logp = [2f64.ln() - 1.0, -1.0, f64::NAN];
        let old = [-1.0, -1.0, f64::NAN];
        let mask = [1.0, 1.0, 0.0];
        let cfg = PolicyLossConfig::default();
        let mut g = [9.0; 3];
        // A = +1: L1 = −√2 < L2 = −1.3 → clipped, L = −1.3, no gradient
        let out = gspo_loss(
            &input(shape, &logp, &old, &[1.0, 1.0, 0.0], &mask),
            &cfg,
            GspoLevel::Sequence,
            &mut g,
        )
        .unwrap();
        assert!((out.loss + 1.3).abs() < 1e-12 && g == [0.0; 3] && out.clipfrac == 1.0);
        // A = −1: L = √2 unclipped; slope −A·s = √2 spread over n = 2 tokens with W = 1
        let adv = [-1.0, -1.0, 0.0];
        for level in [GspoLevel::Sequence, GspoLevel::Token] {
            let out =
                gspo_loss(&input(shape, &logp, &old, &adv, &mask), &cfg, level, &mut g).unwrap();
            assert!((out.loss - s2).abs() < 1e-12, "{}", level.name());
            assert!((g[0] - s2 / 2.0).abs() < 1e-12 && g[0] == g[1] && g[2] == 0.0);
            assert_eq!((out.clipfrac, out.clipfrac_lower), (0.0, 0.0));
        }
        // A = (1, −1): the sequence sees Ā = 0 (L = 0, no gradient); the token level clips
        // token 0 (L = −1.3) and not token 1 (L = √2, slope √2 with weight 1/2)
        let adv = [1.0, -1.0, 0.0];
        let seq = gspo_loss(
            &input(shape, &logp, &old, &adv, &mask),
            &cfg,
            GspoLevel::Sequence,
            &mut g,
        )
        .unwrap();
        assert!(seq.loss == 0.0 && g == [0.0; 3]);
        let tok = gspo_loss(
            &input(shape, &logp, &old, &adv, &mask),
            &cfg,
            GspoLevel::Token,
            &mut g,
        )
        .unwrap();
        assert!((tok.loss - (s2 - 1.3) / 2.0).abs() < 1e-12);
        assert!(g[0] == 0.0 && (g[1] - s2 / 2.0).abs() < 1e-12);
        assert_eq!(tok.clipfrac, 0.5);
        // ℓ̄ > 10: s is held at e^10, gradient 0
        let big = [30.0, 0.0];
        let out = gspo_loss(
            &input(
                Shape::new(1, 2),
                &big,
                &[0.0, 0.0],
                &[-1.0, -1.0],
                &[1.0, 1.0],
            ),
            &cfg,
            GspoLevel::Sequence,
            &mut g[..2],
        )
        .unwrap();
        assert!((out.loss - 10f64.exp()).abs() < 1e-9 && g[..2] == [0.0, 0.0]);
    }

    #[test]
    fn errors() {
        let shape = Shape::new(1, 2);
        let cfg = PolicyLossConfig::default();
        let mut g = [0.0; 2];
        let nan = [f64::NAN, 0.0];
        let z = [0.0; 2];
        let m = [1.0, 1.0];
        assert_eq!(
            gspo_loss(
                &input(shape, &z, &nan, &z, &m),
                &cfg,
                GspoLevel::Token,
                &mut g
            ),
            Err(crate::Error::NonFinite {
                what: "logp_old",
                index: 0
            })
        );
        assert_eq!(
            gspo_loss(
                &input(shape, &z, &z, &z, &[0.0; 2]),
                &cfg,
                GspoLevel::Token,
                &mut g
            ),
            Err(crate::Error::Empty { what: "mask" })
        );
        assert!(matches!(
            gspo_loss(
                &input(shape, &z, &z, &z, &m),
                &cfg,
                GspoLevel::Token,
                &mut g[..1]
            ),
            Err(crate::Error::LengthMismatch { what: "grad", .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The sequence level is the true gradient of its loss (central differences away
        /// from the clip kinks).
        #[test]
        fn sequence_gradient_matches_finite_differences(
            (shape, logp, shift, adv, mask) in token_batch(6),
            agg in proptest::sample::select(&LossAggMode::ALL[..]),
        ) {
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let cfg = PolicyLossConfig { agg, ..PolicyLossConfig::default() };
            let loss_at = |lp: &[f64]| {
                let mut g = vec![0.0; lp.len()];
                let out = gspo_loss(&input(shape, lp, &old, &adv, &mask), &cfg, GspoLevel::Sequence, &mut g).unwrap();
                (out.loss, g)
            };
            let (_, grad) = loss_at(&logp);
            // the kinks are per row, at s = 0.8 and s = 1.3
            for r in 0..shape.rows {
                let range = r * shape.cols..(r + 1) * shape.cols;
                let n = mask[range.clone()].iter().sum::<f64>();
                if n == 0.0 { continue; }
                let lbar: f64 = range.clone().map(|i| mask[i] * shift[i]).sum::<f64>() / n;
                let s = lbar.exp();
                prop_assume!((s - 0.8).abs() > 1e-4 && (s - 1.3).abs() > 1e-4);
            }
            let h = 1e-6;
            for t in 0..logp.len() {
                let mut p = logp.clone();
                p[t] += h;
                let (fp, _) = loss_at(&p);
                p[t] -= 2.0 * h;
                let (fm, _) = loss_at(&p);
                let fd = (fp - fm) / (2.0 * h);
                prop_assert!((fd - grad[t]).abs() <= 1e-6 * (1.0 + grad[t].abs()), "t={} fd={} grad={}", t, fd, grad[t]);
            }
        }

        /// With a per-row constant advantage and `seq-mean-token-mean`, GSPO-token equals
        /// GSPO in value and gradient (the paper's identity).
        #[test]
        fn token_level_equals_sequence_level_for_sequence_advantages(
            (shape, logp, shift, adv, mask) in token_batch(6),
        ) {
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let row_adv: Vec<f64> = (0..adv.len()).map(|i| adv[i - i % shape.cols]).collect();
            let cfg = PolicyLossConfig { agg: LossAggMode::SeqMeanTokenMean, ..PolicyLossConfig::default() };
            let inp = input(shape, &logp, &old, &row_adv, &mask);
            let (mut gs, mut gt) = (vec![0.0; adv.len()], vec![0.0; adv.len()]);
            let s = gspo_loss(&inp, &cfg, GspoLevel::Sequence, &mut gs).unwrap();
            let t = gspo_loss(&inp, &cfg, GspoLevel::Token, &mut gt).unwrap();
            prop_assert!((s.loss - t.loss).abs() < 1e-12);
            prop_assert!((s.clipfrac - t.clipfrac).abs() < 1e-12);
            for (a, b) in gs.iter().zip(&gt) {
                prop_assert!((a - b).abs() < 1e-12);
            }
        }

        /// With one valid token per row the sequence ratio is the token ratio: GSPO (either
        /// level) is PPO without dual clip.
        #[test]
        fn one_token_rows_are_ppo(
            (shape, logp, shift, adv, _mask) in token_batch(6),
            agg in proptest::sample::select(&LossAggMode::ALL[..]),
        ) {
            let mask: Vec<f64> = (0..adv.len()).map(|i| f64::from(u8::from(i % shape.cols == 0))).collect();
            let old: Vec<f64> = logp.iter().zip(&shift).map(|(l, s)| l - s).collect();
            let cfg = PolicyLossConfig { agg, clip: ClipParams::new(0.2, 0.3, 0.0).unwrap(), ..PolicyLossConfig::default() };
            let inp = input(shape, &logp, &old, &adv, &mask);
            let mut want = vec![0.0; adv.len()];
            let ppo = policy_loss(&inp, &cfg, &mut want).unwrap();
            for level in [GspoLevel::Sequence, GspoLevel::Token] {
                let mut g = vec![0.0; adv.len()];
                let out = gspo_loss(&inp, &cfg, level, &mut g).unwrap();
                prop_assert!((out.loss - ppo.loss).abs() < 1e-12 * (1.0 + ppo.loss.abs()));
                prop_assert_eq!(out.clipfrac, ppo.clipfrac);
                for (a, b) in g.iter().zip(&want) {
                    prop_assert!((a - b).abs() < 1e-12 * (1.0 + b.abs()));
                }
            }
        }
    }
}
