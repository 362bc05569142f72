//! Fuzzes the `difficulty` and `shaping` families: bucket classification, per-bucket means,
//! configuration validation, the bucket controller's updates, and the entropy reward with
//! arbitrary (often invalid) inputs and constants. Nothing may panic.
#![no_main]

use ares_core::Groups;
use ares_core::difficulty::{
    AccuracyThresholds, BucketController, BucketState, Difficulty, DifficultyConfig, PerBucket,
    bucket_means, classify_groups,
};
use ares_core::shaping::{
    BucketShaping, ShapingConfig, entropy_reward, huber, margin, overall_reward, shaped_reward,
    sigmoid,
};
use ares_fuzz::Bytes;
use libfuzzer_sys::fuzz_target;

fn difficulty(b: &mut Bytes) -> Difficulty {
    Difficulty::from_index(b.size(2)).unwrap_or(Difficulty::Hard)
}

fn opt(b: &mut Bytes) -> Option<f64> {
    if b.bool() { Some(b.f64()) } else { None }
}

fn per_bucket_opt(b: &mut Bytes) -> PerBucket<Option<f64>> {
    PerBucket::new(opt(b), opt(b), opt(b))
}

/// A configuration that is the default most of the time, with one field perturbed.
fn difficulty_config(b: &mut Bytes) -> DifficultyConfig<f64> {
    let mut c = DifficultyConfig::default();
    let d = difficulty(b);
    match b.u8() % 16 {
        0 => c.target_momentum = b.f64(),
        1 => c.target_scale[d] = b.f64(),
        2 => c.target_update_interval = u64::from(b.u8() % 4),
        3 => c.alpha_init[d] = b.f64(),
        4 => c.alpha_lr = b.f64(),
        5 => c.alpha_min = b.f64(),
        6 => c.alpha_max = b.f64(),
        7 => c.lambda_init[d] = b.f64(),
        8 => c.kl_budget[d] = b.f64(),
        9 => c.lambda_lr = b.f64(),
        10 => c.lambda_max = b.f64(),
        11 => {
            c.accuracy_thresholds = AccuracyThresholds {
                easy: b.f64(),
                medium: b.f64(),
            }
        }
        _ => {}
    }
    c
}

fn shaping_config(b: &mut Bytes) -> ShapingConfig<f64> {
    let mut c = ShapingConfig::default();
    let d = difficulty(b);
    match b.u8() % 8 {
        0 => c.buckets[d] = BucketShaping::new(b.f64(), b.f64(), b.f64(), b.f64(), b.f64()),
        1 => c.buckets[d].huber_kappa = b.f64(),
        2 => c.buckets[d].margin_fraction = b.f64(),
        3 => c.format_weight = b.f64(),
        _ => {}
    }
    c
}

fn classify(b: &mut Bytes) {
    let (c, n) = (b.size(255), b.size(255));
    let _ = Difficulty::from_counts(c, n);
    let _ = Difficulty::from_counts(b.u32() as usize, b.u32() as usize);
    let _ = Difficulty::from_accuracy(b.f64());
    let _ = Difficulty::from_accuracy(b.f32());
    let t = AccuracyThresholds {
        easy: b.f64(),
        medium: b.f64(),
    };
    let _ = t.classify(b.f64());
    let len = b.size(24);
    let d: Vec<Difficulty> = (0..len).map(|_| difficulty(b)).collect();
    let mut v = vec![0.0; b.size(24)];
    b.fill_f64(&mut v);
    let _ = bucket_means(&d, &v);
    let v32: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    let _ = bucket_means(&d, &v32);
    let n = b.size(4);
    let batch = b.size(16);
    let correct: Vec<bool> = (0..b.size(16)).map(|_| b.bool()).collect();
    if let Ok(groups) = Groups::contiguous(batch, n) {
        let mut out = vec![Difficulty::Easy; b.size(8)];
        let thresholds = if b.bool() {
            AccuracyThresholds::default()
        } else {
            AccuracyThresholds {
                easy: b.f64(),
                medium: b.f64(),
            }
        };
        let _ = classify_groups(&correct, &groups, &thresholds, &mut out);
    }
}

fn controller(b: &mut Bytes) {
    let config = difficulty_config(b);
    let _ = config.validate();
    let c = if b.bool() {
        BucketController::new(config)
    } else {
        let s = BucketState {
            target: opt(b),
            alpha: b.f64(),
            lambda: b.f64(),
        };
        BucketController::with_state(config, PerBucket::splat(s))
    };
    let Ok(mut c) = c else { return };
    for step in 0..u64::from(b.u8() % 8) {
        let d = difficulty(b);
        let _ = match b.u8() % 6 {
            0 => c.bootstrap(&per_bucket_opt(b)),
            1 => c.update_alpha(d, b.f64()).map(drop),
            2 => c.update_target(d, b.f64(), step).map(drop),
            3 => c.update_lambda(d, b.f64()).map(drop),
            4 => c.step_bucket(d, b.f64(), opt(b), step),
            _ => c.step(&per_bucket_opt(b), &per_bucket_opt(b), b.u32().into()),
        };
        // the invariants the controller promises after any sequence of calls
        let s = c.state()[d];
        assert!(s.alpha >= c.config().alpha_min && s.alpha <= c.config().alpha_max);
        assert!(s.lambda >= 0.0 && s.lambda <= c.config().lambda_max);
        assert!(s.target.is_none_or(|t| t.is_finite() && t >= 0.0));
    }
}

fn rewards(b: &mut Bytes) {
    let _ = huber(b.f64(), b.f64());
    let _ = huber(b.f32(), b.f32());
    let _ = sigmoid(b.f64(), b.f64());
    let _ = sigmoid(b.f32(), b.f32());
    let _ = margin(b.f64(), b.f64());
    let _ = overall_reward(b.f64(), b.f64(), b.f64(), b.f64());
    let config = shaping_config(b);
    let _ = config.validate();
    let d = difficulty(b);
    let correct = b.bool();
    let (g, t, alpha) = (b.f64(), b.f64(), b.f64());
    if let Ok(s) = entropy_reward(d, correct, g, t, alpha, &config) {
        let cap = alpha * config.buckets[d].cap_scale;
        assert!(s.is_finite() && s >= -cap && s <= cap);
    }
    let _ = shaped_reward(d, correct, g, t, alpha, b.f64(), &config);
    let c32 = ShapingConfig::<f32>::default();
    let _ = shaped_reward(d, correct, b.f32(), b.f32(), b.f32(), b.f32(), &c32);
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    match b.u8() % 3 {
        0 => classify(&mut b),
        1 => controller(&mut b),
        _ => rewards(&mut b),
    }
});
