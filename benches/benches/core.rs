//! ares-core's O(tokens) functions at a realistic size (512 prompts × 8 samples × 4096
//! tokens = 16.8 M tokens, f32, one core), each in a group with a baseline that reads the
//! same input bytes (a plain sum). Throughput is reported per input byte, so
//! `GB/s(function) / GB/s(baseline)` is the fraction of one-core read bandwidth reached.
//! `scripts/bench-report.py` prints that table from criterion's results.

use ares_benches::{COLS, N, ROWS, TokenBatch, read_baseline};
use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ResponseTokens, grpo_token_advantages, masked_whiten,
    pro_max_normalize, reinforce_pro_max, returns_to_go,
};
use ares_core::entropy::{hwe, response_thresholds, window_means};
use ares_core::kl::{KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs, token_kl};
use ares_core::loss::{
    ClipCovParams, GspoLevel, KlCovParams, PolicyLossConfig, PolicyLossInput, cispo_loss,
    clip_cov_loss, gspo_loss, kl_cov_loss, policy_loss,
};
use ares_core::{Groups, Shape};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

struct Data {
    shape: Shape,
    batch: TokenBatch,
    entropy: Vec<f32>,
    logp: Vec<f32>,
    logp_ref: Vec<f32>,
    hwe_mask: Vec<f32>,
    advantages: Vec<f32>,
    rewards: Vec<f32>,
    beta: Vec<f32>,
}

fn data() -> Data {
    let batch = TokenBatch::new(ROWS, COLS, 7);
    let entropy = batch.values(0.0, 2.5, 1);
    let logp = batch.values(-4.0, 0.0, 2);
    let noise = batch.values(-0.1, 0.1, 3);
    let logp_ref = logp.iter().zip(&noise).map(|(l, e)| l + e).collect();
    let hwe_mask = batch
        .values(0.0, 1.0, 4)
        .iter()
        .map(|&u| if u < 0.1 { 1.0 } else { 0.0 })
        .collect();
    let advantages = batch.values(-1.5, 1.5, 5);
    let rewards = (0..ROWS)
        .map(|r| ((r * 2_654_435_761) % 3 == 0) as u8 as f32)
        .collect();
    Data {
        shape: Shape::new(ROWS, COLS),
        batch,
        entropy,
        logp,
        logp_ref,
        hwe_mask,
        advantages,
        rewards,
        beta: vec![0.001; ROWS],
    }
}

fn group<'a>(c: &'a mut Criterion, name: &str, inputs: &[&[f32]]) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let bytes: usize = inputs.iter().map(|x| std::mem::size_of_val(*x)).sum();
    g.throughput(Throughput::Bytes(bytes as u64));
    g
}

fn benches(c: &mut Criterion) {
    let d = data();
    let mask = &d.batch.mask;
    let n = ROWS * COLS;
    let groups = Groups::contiguous(ROWS, N).expect("groups");
    let (mut out, mut out2) = (vec![0.0f32; n], vec![0.0f32; n]);

    // Pro Max: the one call (RLOO → token values → adaptive normalisation), no KL
    let mut g = group(c, "pro_max", &[&d.rewards, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.rewards, mask])))
    });
    let cfg = ProMaxConfig::default();
    g.bench_function("reinforce_pro_max", |b| {
        b.iter(|| {
            let t = ResponseTokens::new(d.shape, &mask[..]);
            reinforce_pro_max(&groups, &d.rewards, t, &cfg, None, &mut out).expect("pro max")
        })
    });
    g.finish();

    // Pro Max normalisation alone, on token advantages
    let mut g = group(c, "pro_max_normalize", &[&d.advantages, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.advantages, mask])))
    });
    // in place: normalising already-normalised values does the same work every time
    out.copy_from_slice(&d.advantages);
    g.bench_function("pro_max_normalize", |b| {
        b.iter(|| {
            pro_max_normalize(d.shape, &groups, &mut out, mask, None, &cfg, None)
                .expect("normalize")
        })
    });
    g.finish();

    // masked dynamic KL: k3, per-row β, HWE weights, weighted output + row sums
    let inputs: [&[f32]; 4] = [&d.logp, &d.logp_ref, mask, &d.hwe_mask];
    let mut g = group(c, "masked_dynamic_kl", &inputs);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&inputs)))
    });
    let mut row_sum = vec![0.0f32; ROWS];
    for est in [KlEstimator::K3, KlEstimator::K1] {
        g.bench_function(format!("token_kl_{}", est.name()), |b| {
            b.iter(|| {
                let cfg = TokenKlConfig::new(est, KlCoefficient::PerRow(&d.beta))
                    .with_hwe(&d.hwe_mask, 0.5);
                let outs = TokenKlOutputs {
                    weighted: Some(&mut out),
                    row_weighted_sum: Some(&mut row_sum),
                    ..TokenKlOutputs::default()
                };
                token_kl(d.shape, &d.logp, &d.logp_ref, mask, &cfg, outs).expect("kl")
            })
        });
    }
    g.finish();

    // window means (w = 4)
    let mut g = group(c, "window_means", &[&d.entropy, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.entropy, mask])))
    });
    g.bench_function("window_means_w4", |b| {
        b.iter(|| {
            window_means(d.shape, &d.entropy, mask, 4, false, &mut out, &mut out2).expect("windows")
        })
    });
    g.finish();
    let (means, valid) = (out.clone(), out2.clone());

    // per-response p95 thresholds over the complete windows
    let mut g = group(c, "percentile", &[&means, &valid]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&means, &valid])))
    });
    let (mut scratch, mut thr, mut has) =
        (vec![0.0f32; COLS], vec![0.0f32; ROWS], vec![0.0f32; ROWS]);
    g.bench_function("response_thresholds_p95", |b| {
        b.iter(|| {
            response_thresholds(
                d.shape,
                &means,
                &valid,
                95.0,
                &mut scratch,
                &mut thr,
                &mut has,
            )
            .expect("thresholds")
        })
    });
    g.finish();

    // HWE mask, counts and soft costs against τ
    let mut g = group(c, "hwe", &[&means, &valid]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&means, &valid])))
    });
    let (mut counts, mut cost) = (vec![0usize; ROWS], vec![0.0f32; ROWS]);
    g.bench_function("hwe", |b| {
        b.iter(|| {
            hwe(
                d.shape,
                &means,
                &valid,
                1.2,
                None,
                &mut out,
                &mut counts,
                &mut cost,
            )
            .expect("hwe")
        })
    });
    g.finish();

    // GRPO broadcast to tokens, REINFORCE return-to-go, whitening
    let mut g = group(c, "grpo_tokens", &[&d.rewards, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.rewards, mask])))
    });
    g.bench_function("grpo_token_advantages", |b| {
        b.iter(|| {
            grpo_token_advantages(
                &groups,
                &d.rewards,
                d.shape,
                mask,
                &GrpoConfig::default(),
                &mut out,
            )
            .expect("grpo")
        })
    });
    g.finish();
    let mut g = group(c, "returns_to_go", &[&d.advantages, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.advantages, mask])))
    });
    g.bench_function("returns_to_go_g0.99", |b| {
        b.iter(|| returns_to_go(d.shape, &d.advantages, mask, 0.99, &mut out).expect("rtg"))
    });
    g.finish();
    let mut g = group(c, "masked_whiten", &[&d.advantages, mask]);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&d.advantages, mask])))
    });
    out.copy_from_slice(&d.advantages);
    g.bench_function("masked_whiten", |b| {
        b.iter(|| masked_whiten(d.shape, &mut out, mask).expect("whiten"))
    });
    g.finish();

    // PPO clip / dual-clip loss with dL/dlogπ, token-mean
    let logp_old: Vec<f32> = d.logp_ref.clone();
    let inputs: [&[f32]; 4] = [&d.logp, &logp_old, &d.advantages, mask];
    let mut g = group(c, "policy_loss", &inputs);
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&inputs)))
    });
    let input = PolicyLossInput {
        shape: d.shape,
        logp: &d.logp,
        logp_old: &logp_old,
        advantages: &d.advantages,
        mask,
        logp_rollout: None,
    };
    let cfg = PolicyLossConfig::default();
    g.bench_function("policy_loss_token_mean", |b| {
        b.iter(|| policy_loss(&input, &cfg, &mut out).expect("loss"))
    });
    // the losses beside PPO: same inputs and output, plus the covariance losses' scratch
    g.bench_function("gspo_sequence", |b| {
        b.iter(|| gspo_loss(&input, &cfg, GspoLevel::Sequence, &mut out).expect("gspo"))
    });
    g.bench_function("gspo_token", |b| {
        b.iter(|| gspo_loss(&input, &cfg, GspoLevel::Token, &mut out).expect("gspo"))
    });
    g.bench_function("cispo", |b| {
        b.iter(|| cispo_loss(&input, &cfg, &mut out).expect("cispo"))
    });
    let mut scratch = vec![0usize; out.len()];
    g.bench_function("clip_cov", |b| {
        b.iter(|| {
            clip_cov_loss(
                &input,
                &cfg,
                &ClipCovParams::default(),
                &mut scratch,
                &mut out,
            )
            .expect("clip_cov")
        })
    });
    g.bench_function("kl_cov", |b| {
        b.iter(|| {
            kl_cov_loss(
                &input,
                &cfg,
                &KlCovParams::default(),
                &mut scratch,
                &mut out,
            )
            .expect("kl_cov")
        })
    });
    g.finish();
}

criterion_group!(core, benches);
criterion_main!(core);
