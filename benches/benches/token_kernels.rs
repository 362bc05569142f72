//! Token kernels of ares-cpu against a same-run, same-buffer read-only baseline.
//!
//! Fused log-prob + entropy over `[rows, 151 936]` logits (Qwen2 vocabulary), f32 and
//! bf16, on all threads rayon is given (`RAYON_NUM_THREADS`). The ratio to the baseline
//! says how close the kernel runs to the memory bandwidth one read of the logits needs.
//!
//! The race sampler (`ares_cpu::sampler`) on the same shape: T = 1 alone, top-p 0.9, min-p
//! 0.1, on logits spread over ±10 (every token within reach of the Gumbel noise: each
//! draws, the worst case) and ±40 (as a trained model's rows: most tokens too unlikely to
//! draw), beside the same read baseline.

use ares_benches::{SplitMix, par_read_baseline_f32, par_read_baseline_u16};
use ares_cpu::sampler::{SampleKey, Sampler, sample_rows};
use ares_cpu::{Logits, log_prob_entropy};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use std::hint::black_box;

const VOCAB: usize = 151_936;
const ROWS: usize = 128;

fn fused_log_prob_entropy(c: &mut Criterion) {
    let mut rng = SplitMix::new(42);
    let logits: Vec<f32> = (0..ROWS * VOCAB)
        .map(|_| (rng.unit() - 0.5) * 20.0)
        .collect();
    let logits_bf16: Vec<bf16> = logits.iter().map(|&x| bf16::from_f32(x)).collect();
    let bits: Vec<u16> = logits_bf16.iter().map(|x| x.to_bits()).collect();
    let ids: Vec<u32> = (0..ROWS as u32).map(|r| r * 997 % VOCAB as u32).collect();
    let (mut lp, mut h) = (vec![0.0f32; ROWS], vec![0.0f32; ROWS]);

    let mut g = c.benchmark_group("log_prob_entropy_151936");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((ROWS * VOCAB * 4) as u64));
    g.bench_function("f32/baseline_read", |b| {
        b.iter(|| black_box(par_read_baseline_f32(black_box(&logits), VOCAB)))
    });
    g.bench_function("f32/fused", |b| {
        b.iter(|| {
            log_prob_entropy(
                Logits::F32(&logits),
                VOCAB,
                1.0,
                Some((&ids, &mut lp)),
                &mut h,
            )
            .expect("valid input")
        })
    });
    g.throughput(Throughput::Bytes((ROWS * VOCAB * 2) as u64));
    g.bench_function("bf16/baseline_read", |b| {
        b.iter(|| black_box(par_read_baseline_u16(black_box(&bits), VOCAB)))
    });
    g.bench_function("bf16/fused", |b| {
        b.iter(|| {
            log_prob_entropy(
                Logits::Bf16(&logits_bf16),
                VOCAB,
                1.0,
                Some((&ids, &mut lp)),
                &mut h,
            )
            .expect("valid input")
        })
    });
    g.finish();
}

fn race_sampler(c: &mut Criterion) {
    let mut g = c.benchmark_group("sample_rows_151936");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((ROWS * VOCAB * 4) as u64));
    let keys: Vec<SampleKey> = (0..ROWS as u64)
        .map(|r| SampleKey {
            seed: 1,
            sequence: r,
            step: 0,
        })
        .collect();
    let mut out = vec![0u32; ROWS];
    for spread in [20.0f32, 80.0] {
        let mut rng = SplitMix::new(7);
        let logits: Vec<f32> = (0..ROWS * VOCAB)
            .map(|_| (rng.unit() - 0.5) * spread)
            .collect();
        let half = spread / 2.0;
        g.bench_function(format!("pm{half}/baseline_read"), |b| {
            b.iter(|| black_box(par_read_baseline_f32(black_box(&logits), VOCAB)))
        });
        let plain = Sampler::with_temperature(1.0);
        for (name, s) in [
            ("t1", plain),
            (
                "top_p_0.9",
                Sampler {
                    top_p: 0.9,
                    ..plain
                },
            ),
            (
                "min_p_0.1",
                Sampler {
                    min_p: 0.1,
                    ..plain
                },
            ),
        ] {
            g.bench_function(format!("pm{half}/{name}"), |b| {
                b.iter(|| sample_rows(&logits, VOCAB, &s, &keys, &mut out).expect("valid input"))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, fused_log_prob_entropy, race_sampler);
criterion_main!(benches);
