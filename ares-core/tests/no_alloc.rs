//! Proves the public functions of `ares-core` allocate nothing: a counting global allocator
//! records every allocation made on the calling thread while a check is armed, and each
//! function family runs under it on realistic inputs prepared beforehand.

use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ProMaxGroupReport, ResponseTokens, broadcast_to_tokens,
    dr_grpo_advantages, grpo_advantages, grpo_token_advantages, masked_whiten, pro_max_normalize,
    pro_max_shaped_rewards, reinforce_baseline_advantages, reinforce_pp_advantages,
    reinforce_pp_baseline_advantages, reinforce_pro_max, returns_to_go, returns_to_go_in_place,
    rloo_advantages, rloo_token_advantages, token_level_rewards,
};
use ares_core::difficulty::{
    BucketController, Difficulty, DifficultyConfig, bucket_means, classify_groups,
};
use ares_core::entropy::{
    ThresholdEma, batch_median_threshold, hwe, median, percentile, response_thresholds,
    token_entropy, token_log_prob_and_entropy, window_means,
};
use ares_core::entropy_bonus::{EntropyCoefController, entropy_grad_logits};
use ares_core::filter::{FilterParams, expand_keep, filter_groups, group_means, solved_streak};
use ares_core::forking::{forking_token_count, forking_token_mask, mask_token_gradient};
use ares_core::kl::{
    AdaptiveKlController, KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs,
    kl_penalty_and_grad, masked_kl, token_kl,
};
use ares_core::length::{GrpoLambda, grpo_lambda_rewards};
use ares_core::loss::{
    ClipCovParams, GspoLevel, KlCovParams, LossAggMode, PolicyLossConfig, PolicyLossInput,
    aggregate, aggregate_term, aggregate_weights, cispo_loss, clip_cov_loss, gspo_loss,
    kl_cov_loss, policy_loss, ppo_token_loss,
};
use ares_core::overlong::{overlong_penalties, overlong_penalty};
use ares_core::rubric::{
    GradedSchedule, RevealRule, RubricPrompt, StepRule, rubric_score, select_criteria,
    write_rubric_message,
};
use ares_core::shaping::{ShapingConfig, shaped_reward};
use ares_core::{Groups, Shape};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only bumps a thread-local counter besides.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn note() {
    // try_with: the thread-locals may be gone while a thread shuts down
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` with the counter armed and fails if it allocated.
fn assert_no_alloc<R>(name: &str, f: impl FnOnce() -> R) -> R {
    COUNT.with(|c| c.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    let n = COUNT.with(Cell::get);
    assert_eq!(n, 0, "{name} allocated {n} times");
    r
}

const P: usize = 16; // prompts
const N: usize = 8; // samples per prompt
const ROWS: usize = P * N;
const COLS: usize = 256;

struct Batch {
    shape: Shape,
    mask: Vec<f64>,
    entropy: Vec<f64>,
    logp: Vec<f64>,
    logp_ref: Vec<f64>,
    rewards: Vec<f64>,
    correct: Vec<bool>,
    lengths: Vec<f64>,
}

fn batch() -> Batch {
    let mut s = 12345u64;
    let mut unit = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut mask = vec![0.0; ROWS * COLS];
    let mut lengths = Vec::with_capacity(ROWS);
    for row in mask.chunks_exact_mut(COLS) {
        let len = 16 + (unit() * (COLS - 16) as f64) as usize;
        row[..len].fill(1.0);
        lengths.push(len as f64);
    }
    let entropy = (0..ROWS * COLS).map(|_| 2.0 * unit()).collect();
    let logp: Vec<f64> = (0..ROWS * COLS).map(|_| -3.0 * unit()).collect();
    let logp_ref = logp.iter().map(|l| l + 0.2 * (unit() - 0.5)).collect();
    let correct: Vec<bool> = (0..ROWS).map(|_| unit() < 0.5).collect();
    let rewards = correct.iter().map(|&c| if c { 1.0 } else { 0.0 }).collect();
    Batch {
        shape: Shape::new(ROWS, COLS),
        mask,
        entropy,
        logp,
        logp_ref,
        rewards,
        correct,
        lengths,
    }
}

#[test]
fn entropy_difficulty_shaping_allocate_nothing() {
    let b = batch();
    let logits: Vec<f64> = (0..1000).map(|i| (i as f64 * 0.37).sin() * 5.0).collect();
    let (mut means, mut valid, mut hwe_mask) = (
        vec![0.0; ROWS * COLS],
        vec![0.0; ROWS * COLS],
        vec![0.0; ROWS * COLS],
    );
    let (mut counts, mut cost) = (vec![0usize; ROWS], vec![0.0; ROWS]);
    let (mut thr, mut has, mut scratch) =
        (vec![0.0; ROWS], vec![0.0; ROWS], vec![0.0; COLS.max(ROWS)]);
    let mut buckets = vec![Difficulty::Easy; P];
    let groups = Groups::contiguous(ROWS, N).unwrap();
    let config = ShapingConfig::<f64>::default();
    let per_prompt = [3.0; P];
    assert_no_alloc("entropy", || {
        token_entropy(&logits, 0.7).unwrap();
        token_log_prob_and_entropy(&logits, 17, 1.0).unwrap();
        window_means(
            b.shape, &b.entropy, &b.mask, 4, false, &mut means, &mut valid,
        )
        .unwrap();
        response_thresholds(
            b.shape,
            &means,
            &valid,
            95.0,
            &mut scratch,
            &mut thr,
            &mut has,
        )
        .unwrap();
        let m = batch_median_threshold(&thr, &has, &mut scratch)
            .unwrap()
            .unwrap();
        let mut ema = ThresholdEma::new(0.99).unwrap();
        let tau = ema.update(m).unwrap();
        hwe(
            b.shape,
            &means,
            &valid,
            tau,
            None,
            &mut hwe_mask,
            &mut counts,
            &mut cost,
        )
        .unwrap();
        percentile(&thr, 50.0, &mut scratch).unwrap();
        median(&thr, &mut scratch).unwrap();
    });
    assert_no_alloc("difficulty", || {
        let th = ares_core::difficulty::AccuracyThresholds::<f64>::default();
        classify_groups(&b.correct, &groups, &th, &mut buckets).unwrap();
        let h = bucket_means(&buckets, &per_prompt).unwrap();
        let mut ctl = BucketController::new(DifficultyConfig::<f64>::default()).unwrap();
        ctl.bootstrap(&h).unwrap();
        ctl.step(&h, &h, 1).unwrap();
    });
    assert_no_alloc("shaping", || {
        for d in Difficulty::ALL {
            for correct in [true, false] {
                shaped_reward(d, correct, 7.0, 4.0, 0.5, 0.0, &config).unwrap();
            }
        }
    });
}

#[test]
fn kl_and_advantages_allocate_nothing() {
    let b = batch();
    let groups = Groups::contiguous(ROWS, N).unwrap();
    let index: Vec<usize> = (0..ROWS).rev().collect();
    let mut inverse = vec![0usize; ROWS];
    let beta = vec![0.001; ROWS];
    let hwe_mask: Vec<f64> = (0..ROWS * COLS)
        .map(|i| f64::from(u8::from(i % 7 == 0)))
        .collect();
    let n = ROWS * COLS;
    let (mut kl, mut weighted, mut grad) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let (mut row_sum, mut row_mean) = (vec![0.0; ROWS], vec![0.0; ROWS]);
    let (mut scalar, mut tokens, mut tokens2) = (vec![0.0; ROWS], vec![0.0; n], vec![0.0; n]);
    let mut uniform = vec![false; P];
    let mut report = vec![ProMaxGroupReport::default(); P];
    // groups of different sizes, keyed by uid, rows interleaved
    let uids: Vec<u64> = (0..ROWS as u64).map(|r| (r * 7) % (P as u64 + 3)).collect();
    let mut uid_scratch = vec![0usize; 2 * ROWS + 1];
    let offsets: Vec<usize> = (0..=ROWS / 4).map(|g| g * 4).collect();
    assert_no_alloc("kl", || {
        kl_penalty_and_grad(-1.0, -1.5, KlEstimator::K3);
        let cfg = TokenKlConfig::new(KlEstimator::K3, KlCoefficient::PerRow(&beta))
            .with_hwe(&hwe_mask, 0.5);
        let out = TokenKlOutputs {
            kl: Some(&mut kl),
            weighted: Some(&mut weighted),
            grad: Some(&mut grad),
            row_weighted_sum: Some(&mut row_sum),
            row_mean_kl: Some(&mut row_mean),
        };
        token_kl(b.shape, &b.logp, &b.logp_ref, &b.mask, &cfg, out).unwrap();
        masked_kl(
            b.shape,
            &b.logp,
            &b.logp_ref,
            &b.mask,
            KlEstimator::K1,
            &mut kl,
        )
        .unwrap();
        let mut ctl = AdaptiveKlController::new(0.001, 0.1, 10000.0).unwrap();
        ctl.update(0.05, ROWS).unwrap();
    });
    assert_no_alloc("advantage", || {
        let by_uid = Groups::by_uid(&uids, &mut uid_scratch).unwrap();
        grpo_advantages(&by_uid, &b.rewards, &GrpoConfig::default(), &mut scalar).unwrap();
        let ragged = Groups::from_offsets(&offsets).unwrap();
        rloo_advantages(
            &ragged,
            &b.rewards[..ragged.batch()],
            &mut scalar[..ragged.batch()],
        )
        .unwrap();
        let permuted = Groups::permuted(&index, N, &mut inverse).unwrap();
        grpo_advantages(&permuted, &b.rewards, &GrpoConfig::default(), &mut scalar).unwrap();
        dr_grpo_advantages(&groups, &b.rewards, &mut scalar).unwrap();
        rloo_advantages(&groups, &b.rewards, &mut scalar).unwrap();
        reinforce_baseline_advantages(&groups, &b.rewards, &mut scalar).unwrap();
        broadcast_to_tokens(b.shape, &scalar, &b.mask, &mut tokens).unwrap();
        grpo_token_advantages(
            &groups,
            &b.rewards,
            b.shape,
            &b.mask,
            &GrpoConfig::default(),
            &mut tokens,
        )
        .unwrap();
        token_level_rewards(b.shape, &b.rewards, &b.mask, Some(&weighted), &mut tokens).unwrap();
        returns_to_go(b.shape, &tokens, &b.mask, 0.99, &mut tokens2).unwrap();
        returns_to_go_in_place(b.shape, &mut tokens2, &b.mask, 1.0).unwrap();
        masked_whiten(b.shape, &mut tokens2, &b.mask).unwrap();
        let t = ResponseTokens::new(b.shape, &b.mask).with_kl(&weighted);
        rloo_token_advantages(&groups, &b.rewards, t, &mut tokens).unwrap();
        reinforce_pp_advantages(&b.rewards, t, 1.0, &mut tokens).unwrap();
        reinforce_pp_baseline_advantages(&groups, &b.rewards, t, 1.0, &mut tokens).unwrap();
        let cfg = ProMaxConfig {
            uniform_scale: true,
            ..ProMaxConfig::default()
        };
        pro_max_shaped_rewards(&groups, &b.rewards, &cfg, &mut scalar, Some(&mut uniform)).unwrap();
        token_level_rewards(b.shape, &scalar, &b.mask, None, &mut tokens).unwrap();
        returns_to_go_in_place(b.shape, &mut tokens, &b.mask, 1.0).unwrap();
        pro_max_normalize(
            b.shape,
            &groups,
            &mut tokens,
            &b.mask,
            Some(&uniform),
            &cfg,
            Some(&mut report),
        )
        .unwrap();
        reinforce_pro_max(&groups, &b.rewards, t, &cfg, Some(&mut report), &mut tokens).unwrap();
    });
}

/// A fixed-capacity `fmt::Write` sink, so writing a message needs no heap.
struct FixedBuf {
    bytes: [u8; 8192],
    len: usize,
}

impl std::fmt::Write for FixedBuf {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        self.bytes
            .get_mut(self.len..end)
            .ok_or(std::fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[test]
fn loss_length_filter_rubric_allocate_nothing() {
    let b = batch();
    let groups = Groups::contiguous(ROWS, N).unwrap();
    let advantages: Vec<f64> = (0..ROWS * COLS)
        .map(|i| ((i % 5) as f64 - 2.0) * 0.5)
        .collect();
    let logp_old: Vec<f64> = b.logp.iter().map(|l| l + 0.01).collect();
    let (mut grad, mut weights) = (vec![0.0; ROWS * COLS], vec![0.0; ROWS * COLS]);
    let mut scratch = vec![0usize; ROWS * COLS];
    let (mut order, mut top, mut rewards) = (vec![0usize; P], vec![false; P], vec![0.0; ROWS]);
    let (mut means, mut keep, mut keep_rows) = (vec![0.0; P], vec![false; P], vec![false; ROWS]);
    let criteria: Vec<(&str, f64)> = (0..10)
        .map(|i| {
            (
                ["be precise", "cite the rule", "avoid guessing"][i % 3],
                i as f64 - 3.0,
            )
        })
        .collect();
    let mut shown = vec![0usize; criteria.len()];
    let met: Vec<bool> = (0..criteria.len()).map(|i| i % 2 == 0).collect();
    let points: Vec<f64> = criteria.iter().map(|c| c.1).collect();
    let mut sink = FixedBuf {
        bytes: [0; 8192],
        len: 0,
    };
    assert_no_alloc("loss", || {
        ppo_token_loss(-1.0, -1.2, 1.0, &Default::default()).unwrap();
        for mode in LossAggMode::ALL {
            aggregate(b.shape, &advantages, &b.mask, mode).unwrap();
            aggregate_weights(b.shape, &b.mask, mode, &mut weights).unwrap();
            aggregate_term(b.shape, &advantages, &mut weights, &b.mask, mode).unwrap();
        }
        let input = PolicyLossInput {
            shape: b.shape,
            logp: &b.logp,
            logp_old: &logp_old,
            advantages: &advantages,
            mask: &b.mask,
            logp_rollout: None,
        };
        let cfg = PolicyLossConfig::default();
        policy_loss(&input, &cfg, &mut grad).unwrap();
        for level in [GspoLevel::Sequence, GspoLevel::Token] {
            gspo_loss(&input, &cfg, level, &mut grad).unwrap();
        }
        cispo_loss(&input, &cfg, &mut grad).unwrap();
        let clip_cov = ClipCovParams {
            ratio: 0.3,
            lb: -1.0,
            ub: 1.0,
            seed: 3,
        };
        clip_cov_loss(&input, &cfg, &clip_cov, &mut scratch, &mut grad).unwrap();
        let kl_cov = KlCovParams {
            ratio: 0.3,
            coef: 1.0,
        };
        kl_cov_loss(&input, &cfg, &kl_cov, &mut scratch, &mut grad).unwrap();
    });
    assert_no_alloc("length", || {
        let params = GrpoLambda::default();
        grpo_lambda_rewards(
            &groups,
            &b.correct,
            &b.lengths,
            &params,
            &mut order,
            &mut top,
            &mut rewards,
        )
        .unwrap();
    });
    assert_no_alloc("filter", || {
        group_means(&groups, &b.rewards, &mut means).unwrap();
        filter_groups(&groups, &b.rewards, &FilterParams::default(), &mut keep).unwrap();
        expand_keep(&groups, &keep, &mut keep_rows).unwrap();
        solved_streak(2, true, 0.1, 0.3).unwrap();
    });
    assert_no_alloc("rubric", || {
        let mut state = 7u64;
        let mut rng = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            state
        };
        let schedule = GradedSchedule::<f64> {
            reveal: RevealRule::Linear,
            step: StepRule::step_sigmoid(),
        };
        for k in 0..N {
            let reveal = schedule.reveal(k, N, 3, 100, criteria.len()).unwrap();
            let c = select_criteria(reveal, criteria.len(), &mut rng, &mut shown).unwrap();
            sink.len = 0;
            write_rubric_message(&criteria, &shown[..c], &RubricPrompt::default(), &mut sink)
                .unwrap();
        }
        rubric_score(&points, &met).unwrap();
    });
}

#[test]
fn entropy_and_length_controls_allocate_nothing() {
    let b = batch();
    let n = ROWS * COLS;
    let (mut scratch, mut keep, mut grad) = (vec![0.0; n], vec![0.0; n], vec![0.5; n]);
    let logits: Vec<f64> = (0..1000).map(|i| (i as f64 * 0.37).sin() * 5.0).collect();
    let mut dlogits = vec![0.0; logits.len()];
    let lengths: Vec<usize> = b.lengths.iter().map(|&l| l as usize).collect();
    let mut penalties = vec![0.0; ROWS];
    assert_no_alloc("forking", || {
        let stats = forking_token_mask(&b.entropy, &b.mask, 0.2, &mut scratch, &mut keep).unwrap();
        assert_eq!(stats.kept, forking_token_count(0.2, stats.valid).unwrap());
        mask_token_gradient(&mut grad, &keep).unwrap();
    });
    assert_no_alloc("entropy_bonus", || {
        let h = entropy_grad_logits(&logits, 0.7, &mut dlogits).unwrap();
        let mut ctl = EntropyCoefController::<f64>::default();
        ctl.update(h).unwrap();
        let saved = ctl.snapshot();
        ctl.restore(saved).unwrap();
    });
    assert_no_alloc("overlong", || {
        overlong_penalty(200, 256, 64, 1.0f64).unwrap();
        overlong_penalties(&lengths, 256, 64, 1.0, None, &mut penalties).unwrap();
        overlong_penalties(&lengths, 256, 64, 1.0, Some(&b.correct), &mut penalties).unwrap();
    });
}

#[test]
fn the_counter_sees_allocations() {
    // guards against a counter that cannot fail
    COUNT.with(|c| c.set(0));
    ARMED.with(|a| a.set(true));
    let v: Vec<u8> = Vec::with_capacity(64);
    ARMED.with(|a| a.set(false));
    drop(v);
    assert_eq!(COUNT.with(Cell::get), 1);
}
