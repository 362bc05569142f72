#![no_main]
//! Fuzzes `ares_core::loss`: every public function (PPO, GSPO at both levels, CISPO,
//! Clip-Cov, KL-Cov, aggregation, importance weights) with arbitrary shapes, mismatched
//! lengths, NaN/∞, invalid masks, parameters and scratch. Results are ignored; nothing may
//! panic.

use ares_core::Shape;
use ares_core::loss::{
    ClipCovParams, ClipParams, GspoLevel, IsCorrection, IsMode, KlCovParams, LossAggMode,
    PolicyLossConfig, PolicyLossInput, aggregate, aggregate_term, aggregate_weights, cispo_loss,
    clip_cov_loss, gspo_loss, is_weight, kl_cov_loss, policy_loss, ppo_token_loss,
};
use ares_fuzz::Bytes;

const MODES: [LossAggMode; 5] = LossAggMode::ALL;
const IS_MODES: [IsMode; 4] = [
    IsMode::None,
    IsMode::Tis,
    IsMode::Icepop,
    IsMode::ReinforcePro,
];

/// A length: usually `len`, sometimes off.
fn len_near(b: &mut Bytes, len: usize) -> usize {
    if b.u8() % 16 == 0 {
        b.size(len + 2)
    } else {
        len
    }
}

fn vec_f64(b: &mut Bytes, len: usize) -> Vec<f64> {
    let mut v = vec![0.0; len_near(b, len)];
    b.fill_f64(&mut v);
    v
}

fn clip(b: &mut Bytes) -> ClipParams<f64> {
    if b.bool() {
        ClipParams::default()
    } else {
        ClipParams {
            clip_ratio_low: b.f64(),
            clip_ratio_high: b.f64(),
            clip_ratio_c: b.f64(),
        }
    }
}

fn correction(b: &mut Bytes) -> IsCorrection<f64> {
    let mode = IS_MODES[b.size(3)];
    if b.bool() {
        IsCorrection {
            mode,
            ..IsCorrection::default()
        }
    } else {
        IsCorrection {
            mode,
            low: b.f64(),
            high: b.f64(),
        }
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let shape = if b.u8() % 32 == 0 {
        Shape::new(usize::MAX, b.size(3))
    } else {
        Shape::new(b.size(6), b.size(9))
    };
    let len = shape.rows.saturating_mul(shape.cols).min(64);
    let logp = vec_f64(&mut b, len);
    let logp_old = vec_f64(&mut b, len);
    let adv = vec_f64(&mut b, len);
    let mut mask = vec![0.0; len_near(&mut b, len)];
    b.fill_mask(&mut mask);
    let rollout = vec_f64(&mut b, len);
    let mut grad = vec![0.0; len_near(&mut b, len)];
    let config = PolicyLossConfig {
        clip: clip(&mut b),
        agg: MODES[b.size(4)],
        is_correction: correction(&mut b),
    };
    let input = PolicyLossInput {
        shape,
        logp: &logp,
        logp_old: &logp_old,
        advantages: &adv,
        mask: &mask,
        logp_rollout: if b.bool() { Some(&rollout) } else { None },
    };
    let _ = policy_loss(&input, &config, &mut grad);
    let level = if b.bool() {
        GspoLevel::Sequence
    } else {
        GspoLevel::Token
    };
    let _ = gspo_loss(&input, &config, level, &mut grad);
    let _ = cispo_loss(&input, &config, &mut grad);
    let mut scratch = vec![0usize; len_near(&mut b, len)];
    let clip_cov = if b.bool() {
        ClipCovParams::default()
    } else {
        ClipCovParams {
            ratio: b.f64(),
            lb: b.f64(),
            ub: b.f64(),
            seed: u64::from(b.u32()),
        }
    };
    let _ = clip_cov_loss(&input, &config, &clip_cov, &mut scratch, &mut grad);
    let kl_cov = KlCovParams {
        ratio: b.f64(),
        coef: b.f64(),
    };
    let _ = kl_cov_loss(&input, &config, &kl_cov, &mut scratch, &mut grad);

    let mode = MODES[b.size(4)];
    let _ = aggregate(shape, &logp, &mask, mode);
    let _ = aggregate_weights(shape, &mask, mode, &mut grad);
    let mut g2 = adv.clone();
    let _ = aggregate_term(shape, &logp, &mut g2, &mask, mode);

    let c = clip(&mut b);
    let _ = ppo_token_loss(b.f64(), b.f64(), b.f64(), &c);
    let corr = correction(&mut b);
    let _ = is_weight(b.f64(), b.f64(), &corr);
    let _ = c.validate();
    let _ = ClipParams::new(b.f64(), b.f64(), b.f64());

    // f32 path
    let (lp32, lo32, a32, m32, r32) = (
        to_f32(&logp),
        to_f32(&logp_old),
        to_f32(&adv),
        to_f32(&mask),
        to_f32(&rollout),
    );
    let mut g32 = vec![0f32; grad.len()];
    let input32 = PolicyLossInput {
        shape,
        logp: &lp32,
        logp_old: &lo32,
        advantages: &a32,
        mask: &m32,
        logp_rollout: Some(&r32),
    };
    let config32 = PolicyLossConfig {
        clip: ClipParams {
            clip_ratio_low: config.clip.clip_ratio_low as f32,
            clip_ratio_high: config.clip.clip_ratio_high as f32,
            clip_ratio_c: config.clip.clip_ratio_c as f32,
        },
        agg: mode,
        is_correction: IsCorrection {
            mode: config.is_correction.mode,
            low: config.is_correction.low as f32,
            high: config.is_correction.high as f32,
        },
    };
    let _ = policy_loss(&input32, &config32, &mut g32);
    let _ = gspo_loss(&input32, &config32, level, &mut g32);
    let _ = cispo_loss(&input32, &config32, &mut g32);
    let clip_cov32 = ClipCovParams {
        ratio: clip_cov.ratio as f32,
        lb: clip_cov.lb as f32,
        ub: clip_cov.ub as f32,
        seed: clip_cov.seed,
    };
    let _ = clip_cov_loss(&input32, &config32, &clip_cov32, &mut scratch, &mut g32);
    let kl_cov32 = KlCovParams {
        ratio: kl_cov.ratio as f32,
        coef: kl_cov.coef as f32,
    };
    let _ = kl_cov_loss(&input32, &config32, &kl_cov32, &mut scratch, &mut g32);
    let _ = aggregate(shape, &lp32, &m32, mode);

    // names
    let name = core::str::from_utf8(data).unwrap_or("token-mean");
    let _ = LossAggMode::from_name(name).map(LossAggMode::name);
    let _ = IsMode::from_name(name).map(IsMode::name);
});
