#![no_main]
//! Fuzzes `ares_core::loss`: every public function with arbitrary shapes, mismatched
//! lengths, NaN/∞, invalid masks and parameters. Results are ignored; nothing may panic.

use ares_core::Shape;
use ares_core::loss::{
    ClipParams, IsCorrection, IsMode, LossAggMode, PolicyLossConfig, PolicyLossInput, aggregate,
    aggregate_term, aggregate_weights, is_weight, policy_loss, ppo_token_loss,
};
use ares_fuzz::Bytes;

const MODES: [LossAggMode; 4] = [
    LossAggMode::TokenMean,
    LossAggMode::SeqMeanTokenSum,
    LossAggMode::SeqMeanTokenMean,
    LossAggMode::SeqMeanTokenSumNorm,
];
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
        agg: MODES[b.size(3)],
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

    let mode = MODES[b.size(3)];
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
    let _ = aggregate(shape, &lp32, &m32, mode);

    // names
    let name = core::str::from_utf8(data).unwrap_or("token-mean");
    let _ = LossAggMode::from_name(name).map(LossAggMode::name);
    let _ = IsMode::from_name(name).map(IsMode::name);
});
