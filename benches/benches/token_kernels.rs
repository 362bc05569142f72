//! Token kernels of ares-cpu against a same-run, same-buffer read-only baseline.
//!
//! Fused log-prob + entropy over `[rows, 151 936]` logits (Qwen2 vocabulary), f32 and
//! bf16, on all threads rayon is given (`RAYON_NUM_THREADS`). The ratio to the baseline
//! says how close the kernel runs to the memory bandwidth one read of the logits needs.

use ares_benches::{SplitMix, par_read_baseline_f32, par_read_baseline_u16};
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

criterion_group!(benches, fused_log_prob_entropy);
criterion_main!(benches);
