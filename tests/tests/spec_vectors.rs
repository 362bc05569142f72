//! Every test vector of the spec (`docs/algorithms.md` §11), through the public APIs, in
//! f64 and, where the type matters, f32. These are a floor: each module's own tests go
//! further.

use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ResponseTokens, grpo_advantages, reinforce_pro_max, rloo_advantages,
};
use ares_core::difficulty::Difficulty;
use ares_core::entropy::{hwe, percentile, token_entropy, window_means};
use ares_core::kl::{KlEstimator, kl_penalty};
use ares_core::length::{GrpoLambda, grpo_lambda_rewards};
use ares_core::loss::{ClipParams, LossAggMode, aggregate, ppo_token_loss};
use ares_core::rubric::{GradedSchedule, RevealRule, StepRule, linear_reveal_count, reveal_ratio};
use ares_core::shaping::{ShapingConfig, shaped_reward};
use ares_core::{Float, Groups, Shape};

fn close<F: Float>(got: F, want: f64, tol: f64, what: &str) {
    let g = got.to_f64().unwrap_or(f64::NAN);
    assert!((g - want).abs() <= tol, "{what}: got {g}, want {want}");
}

fn c<F: Float>(x: f64) -> F {
    F::from(x).unwrap_or_else(F::nan)
}

/// Vectors 1–4: the ARES entropy reward, `overall` = acc + S, α = 0.5.
fn shaping<F: Float>(tol: f64) {
    use Difficulty::*;
    let cfg = ShapingConfig::<F>::default();
    let cases = [
        (Easy, true, 10.0, 4.0, 0.5),
        (Easy, true, 6.0, 4.0, 0.958_333_3),
        (Easy, true, 5.0, 4.0, 1.0),
        (Easy, false, 5.0, 4.0, 0.15),
        (Easy, false, 9.0, 4.0, 0.264_239_1),
        (Medium, true, 27.0, 20.0, 0.958_333_3),
        (Medium, true, 25.0, 20.0, 1.0),
        (Medium, false, 0.0, 20.0, 0.2),
        (Hard, true, 20.0, 20.0, 1.546_960_2),
        (Hard, false, 0.0, 0.0, 0.3),
    ];
    for (d, correct, g, t, want) in cases {
        let r = shaped_reward(d, correct, c::<F>(g), c(t), c(0.5), F::zero(), &cfg).unwrap();
        close(
            r.overall,
            want,
            tol,
            &format!("vectors 1-4: {d} correct={correct} g={g} T={t}"),
        );
    }
}

#[test]
fn vectors_1_to_4_entropy_reward() {
    shaping::<f64>(1e-6);
    shaping::<f32>(2e-6);
}

#[test]
fn vector_5_window_entropy() {
    let h = [0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0];
    let m = [1.0; 8];
    let shape = Shape::new(1, 8);
    let (mut means, mut valid) = ([0.0; 8], [0.0; 8]);
    window_means(shape, &h, &m, 4, false, &mut means, &mut valid).unwrap();
    close(means[1], 0.625, 1e-12, "vector 5: W_1");
    assert_eq!(
        valid,
        [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        "vector 5: positions >= 4 have no window"
    );
    let (mut hwe_mask, mut counts, mut cost) = ([0.0; 8], [0usize; 1], [0.0; 1]);
    hwe(
        shape,
        &means,
        &valid,
        0.6,
        None,
        &mut hwe_mask,
        &mut counts,
        &mut cost,
    )
    .unwrap();
    assert_eq!(
        hwe_mask[1], 1.0,
        "vector 5: W_1 = 0.625 >= tau = 0.6 is HWE"
    );
}

#[test]
fn vector_6_percentile() {
    let mut scratch = [0.0; 4];
    close(
        percentile(&[1.0, 2.0, 3.0, 4.0], 95.0, &mut scratch).unwrap(),
        3.85,
        1e-12,
        "vector 6",
    );
    // numpy: np.percentile([0.75, 0.8, 1.25], 95) = 1.205
    close(
        percentile(&[0.75, 0.8, 1.25], 95.0, &mut scratch).unwrap(),
        1.205,
        1e-12,
        "vector 6",
    );
    let mut scratch32 = [0.0f32; 4];
    let p = percentile(&[4.0f32, 1.0, 3.0, 2.0], 95.0, &mut scratch32).unwrap();
    close(p, 3.85, 1e-6, "vector 6 f32");
}

#[test]
fn vector_7_grpo_and_rloo() {
    let groups = Groups::contiguous(4, 4).unwrap();
    let mut out = [0.0; 4];
    grpo_advantages(
        &groups,
        &[1.0, 0.0, 0.0, 1.0],
        &GrpoConfig::default(),
        &mut out,
    )
    .unwrap();
    for (g, w) in out
        .iter()
        .zip([0.866_023_9, -0.866_023_9, -0.866_023_9, 0.866_023_9])
    {
        close(*g, w, 1e-7, "vector 7: GRPO");
    }
    rloo_advantages(&groups, &[1.0, 0.0, 0.0, 0.0], &mut out).unwrap();
    for (g, w) in out.iter().zip([1.0, -1.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0]) {
        close(*g, w, 1e-12, "vector 7: RLOO");
    }
}

#[test]
fn vector_8_k3() {
    close(
        kl_penalty(-1.0, -1.5, KlEstimator::K3),
        0.106_530_7,
        1e-7,
        "vector 8",
    );
    close(
        kl_penalty(-2.0, -1.0, KlEstimator::K3),
        0.718_281_8,
        1e-7,
        "vector 8",
    );
    close(
        kl_penalty(-2.0f32, -1.0, KlEstimator::K3),
        0.718_281_8,
        1e-6,
        "vector 8 f32",
    );
}

#[test]
fn vector_9_ppo_dual_clip() {
    let clip = ClipParams::new(0.2, 0.2, 3.0).unwrap();
    // (A, r, loss) with r = exp(logp − logp_old), logp_old = 0
    for (a, r, want) in [
        (-1.0, 5.0, 3.0),
        (-1.0, 2.0, 2.0),
        (1.0, 5.0, -1.2),
        (1.0, 0.5, -0.5),
    ] {
        let t = ppo_token_loss(f64::ln(r), 0.0, a, &clip).unwrap();
        close(t.loss, want, 1e-12, &format!("vector 9: A={a} r={r}"));
    }
}

#[test]
fn vector_10_aggregation() {
    let l = [1.0, 2.0, 3.0, 4.0, 0.0, 0.0];
    let m = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0];
    let s = Shape::new(2, 3);
    for (mode, want) in [
        (LossAggMode::TokenMean, 2.5),
        (LossAggMode::TokenSum, 10.0),
        (LossAggMode::SeqMeanTokenSum, 5.0),
        (LossAggMode::SeqMeanTokenMean, 3.0),
        (LossAggMode::SeqMeanTokenSumNorm, 1.666_666_7),
    ] {
        let got = aggregate(s, &l, &m, mode).unwrap();
        close(got, want, 1e-7, &format!("vector 10: {}", mode.name()));
    }
}

#[test]
fn vector_11_pro_max() {
    // n = 2, r = (1, 0), lengths (2, 3), no KL
    let groups = Groups::contiguous(2, 2).unwrap();
    let mask = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
    let tokens = ResponseTokens::new(Shape::new(2, 3), &mask[..]);
    let mut out = [0.0; 6];
    let cfg = ProMaxConfig::default();
    reinforce_pro_max(&groups, &[1.0, 0.0], tokens, &cfg, None, &mut out).unwrap();
    let want = [
        1.224_744_9,
        1.224_744_9,
        0.0,
        -0.816_496_6,
        -0.816_496_6,
        -0.816_496_6,
    ];
    for (g, w) in out.iter().zip(want) {
        close(*g, w, 1e-7, "vector 11: n = 2");
    }
    // n = 4, r = (1,0,0,0), one token each
    let groups = Groups::contiguous(4, 4).unwrap();
    let mask = [1.0; 4];
    let tokens = ResponseTokens::new(Shape::new(4, 1), &mask[..]);
    let out4 = &mut out[..4];
    reinforce_pro_max(&groups, &[1.0, 0.0, 0.0, 0.0], tokens, &cfg, None, out4).unwrap();
    for (g, w) in out4
        .iter()
        .zip([1.732_050_8, -0.577_350_3, -0.577_350_3, -0.577_350_3])
    {
        close(*g, w, 1e-7, "vector 11: n = 4");
    }
    // an all-correct group: zeros without uniform_scale, r/n = 0.25 with it
    reinforce_pro_max(&groups, &[1.0; 4], tokens, &cfg, None, out4).unwrap();
    assert_eq!(out4, &[0.0; 4], "vector 11: all correct, no uniform_scale");
    let uniform = ProMaxConfig {
        uniform_scale: true,
        ..ProMaxConfig::default()
    };
    reinforce_pro_max(&groups, &[1.0; 4], tokens, &uniform, None, out4).unwrap();
    for g in out4.iter() {
        close(*g, 0.25, 1e-12, "vector 11: uniform_scale");
    }
}

#[test]
fn vector_12_grpo_lambda() {
    let groups = Groups::contiguous(4, 4).unwrap();
    let params = GrpoLambda {
        lambda_: 0.2,
        alpha: 0.6,
    };
    let (mut order, mut top, mut rewards) = ([0usize; 1], [false; 1], [0.0; 4]);
    let lengths = [100.0, 200.0, 300.0, 400.0];
    let correct = [true; 4];
    grpo_lambda_rewards(
        &groups,
        &correct,
        &lengths,
        &params,
        &mut order,
        &mut top,
        &mut rewards,
    )
    .unwrap();
    assert!(top[0], "vector 12: the only group is a top group");
    for (g, w) in rewards
        .iter()
        .zip([0.875_655_8, 0.765_985_9, 0.634_014_1, 0.524_344_2])
    {
        close(*g, w, 1e-7, "vector 12");
    }
}

#[test]
fn vector_13_graded_ratios_and_counts() {
    for k in 0..8 {
        let r: f64 = reveal_ratio(RevealRule::Linear, k, 8).unwrap();
        close(r, (7 - k) as f64 / 7.0, 1e-15, "vector 13: ratio");
    }
    let count = |k, n, criteria| linear_reveal_count(k, n, criteria).unwrap().count(criteria);
    let counts: Vec<usize> = (0..8).map(|k| count(k, 8, 10)).collect();
    assert_eq!(
        counts,
        [10, 9, 7, 6, 4, 3, 1, 0],
        "vector 13: n = 8, 10 criteria"
    );
    let counts: Vec<usize> = (0..5).map(|k| count(k, 5, 5)).collect();
    assert_eq!(counts, [5, 4, 2, 1, 0], "vector 13: n = 5, 5 criteria");
    // the same counts through the schedule (no step factor) in f32
    let schedule = GradedSchedule::<f32> {
        reveal: RevealRule::Linear,
        step: StepRule::Constant,
    };
    let counts: Vec<usize> = (0..8)
        .map(|k| schedule.reveal(k, 8, 1, 1, 10).unwrap().count(10))
        .collect();
    assert_eq!(
        counts,
        [10, 9, 7, 6, 4, 3, 1, 0],
        "vector 13 via GradedSchedule"
    );
}

#[test]
fn vector_14_entropy_of_logits_in_core_and_in_the_cpu_kernel() {
    close(
        token_entropy(&[1.0, 2.0, 3.0], 1.0).unwrap(),
        0.832_395_6,
        1e-7,
        "vector 14",
    );
    close(
        token_entropy(&[0.0, 0.0], 1.0).unwrap(),
        std::f64::consts::LN_2,
        1e-15,
        "vector 14",
    );
    let mut h = [0.0f32; 2];
    let logits = [1.0f32, 2.0, 3.0, 0.0, 0.0, f32::NEG_INFINITY];
    ares_cpu::log_prob_entropy(ares_cpu::Logits::F32(&logits), 3, 1.0, None, &mut h).unwrap();
    close(h[0], 0.832_395_6, 1e-6, "vector 14 ares-cpu");
    close(
        h[1],
        std::f64::consts::LN_2,
        1e-6,
        "vector 14 ares-cpu (with a -inf logit)",
    );
}
