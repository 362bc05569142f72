//! The products of `model_cpu`'s training step (8 × 256 tokens of the bench model: hidden
//! 256, 4 / 2 heads of 64, MLP 704, vocab 8192, 4 layers) one by one, beside this core's
//! multiply-add peak: how much of a step only the GEMM library decides.
//!
//! For each linear layer shape: the forward product, and the backward (`dx` and `dw`); the
//! attention forward and backward as whole ops (their products are `[64, 64]`-row blocks
//! of GEMMs). Each line gives GFLOP/s and the fraction of the peak, measured here by a
//! loop of independent vector multiply-adds of the active path's width (12 chains of
//! 8 lanes on AVX2, 16 on AVX-512; 2 FLOPs each). The last lines sum a whole step's
//! products as `model_cpu` runs them and say what share of a measured step they are.
//!
//! `RAYON_NUM_THREADS=1 cargo bench -p ares-benches --bench train_gemms [linear|attention]`
//! (one thread, as the
//! PyTorch comparison runs); `ARES_CPU_ISA` picks the path.

use ares_benches::centered_values as values;
use ares_benches::model::{best_and_median, env_usize};
use ares_cpu::Isa;
use ares_cpu::ops::attention::{
    AttentionGrads, AttentionInputs, AttentionShape, attention_backward, attention_forward,
};
use ares_cpu::ops::matmul::{MatmulDims, linear_backward, linear_forward};
use std::hint::black_box;
use std::time::Duration;

const TOKENS: usize = 8 * 256;
const BATCH: usize = 8;
const SEQ: usize = 256;
const HIDDEN: usize = 256;
const MLP: usize = 704;
const VOCAB: usize = 8192;
const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const LAYERS: usize = 4;

/// Best of `runs` timings of `f` after one warm-up call.
fn best(runs: usize, f: impl FnMut()) -> Duration {
    best_and_median(runs, f).0
}

/// GFLOP/s of this core's multiply-adds on the active path: 12 independent chains (enough
/// to cover the FMA latency on two pipes), best of 5 runs of 50 M iterations.
fn fma_peak() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        let lanes = match Isa::active() {
            Isa::Avx512 | Isa::Amx => 16,
            Isa::Avx2 => 8,
            Isa::Portable => return f64::NAN,
        };
        let iters = 50_000_000u64;
        let t = best(5, || {
            // SAFETY: the active path is at least AVX2 + FMA (checked by `Isa`), and AVX-512F
            // is only run when the active path is AVX-512.
            unsafe {
                if lanes == 16 {
                    black_box(fma_chains_512(iters));
                } else {
                    black_box(fma_chains_256(iters));
                }
            }
        });
        (iters * 12 * lanes * 2) as f64 / t.as_secs_f64() / 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    f64::NAN
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_chains_256(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let b = _mm256_set1_ps(1.000_000_1);
    let c = _mm256_set1_ps(1e-7);
    let mut a = [_mm256_setzero_ps(); 12];
    for _ in 0..iters {
        for x in &mut a {
            *x = _mm256_fmadd_ps(*x, b, c);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in a {
        s = _mm256_add_ps(s, x);
    }
    _mm256_cvtss_f32(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_chains_512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let b = _mm512_set1_ps(1.000_000_1);
    let c = _mm512_set1_ps(1e-7);
    let mut a = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for x in &mut a {
            *x = _mm512_fmadd_ps(*x, b, c);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in a {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

fn main() {
    let runs = env_usize("ARES_BENCH_RUNS", 7);
    let peak = fma_peak();
    println!(
        "CPU path {} (the CPU has {}), {} threads; multiply-add peak {peak:.1} GFLOP/s per thread",
        Isa::active(),
        Isa::detected(),
        rayon::current_num_threads(),
    );
    let threads = rayon::current_num_threads() as f64;
    let line = |what: &str, flops: f64, t: Duration| {
        let rate = flops / t.as_secs_f64() / 1e9;
        println!(
            "{what:<34} {:>8.2} ms {rate:>7.1} GFLOP/s {:>5.0} % of peak",
            t.as_secs_f64() * 1e3,
            100.0 * rate / (peak * threads),
        );
    };

    // (name, in, out, times per step): q, k, v, o, gate, up, down per layer; the tied LM head.
    let q_dim = Q_HEADS * HEAD_DIM;
    let kv_dim = KV_HEADS * HEAD_DIM;
    let shapes = [
        ("q / o (256 → 256)", HIDDEN, q_dim, 2 * LAYERS),
        ("k / v (256 → 128)", HIDDEN, kv_dim, 2 * LAYERS),
        ("gate / up (256 → 704)", HIDDEN, MLP, 2 * LAYERS),
        ("down (704 → 256)", MLP, HIDDEN, LAYERS),
        ("LM head (256 → 8192)", HIDDEN, VOCAB, 1),
    ];
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let run = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let mut step = Duration::ZERO;
    let mut step_flops = 0.0;
    for (name, k, m, times) in shapes.into_iter().filter(|_| run("linear")) {
        let dims = MatmulDims { n: TOKENS, k, m };
        let x = values(TOKENS * k, 1);
        let w = values(m * k, 2);
        let dout = values(TOKENS * m, 3);
        let mut out = vec![0.0f32; TOKENS * m];
        let (mut dx, mut dw) = (vec![0.0f32; TOKENS * k], vec![0.0f32; m * k]);
        let flops = 2.0 * (TOKENS * k * m) as f64;
        let fwd = best(runs, || {
            linear_forward(&x, &w, None, dims, &mut out).expect("forward");
            black_box(&out);
        });
        let bwd = best(runs, || {
            linear_backward(&dout, &x, &w, dims, Some(&mut dx), Some(&mut dw), None)
                .expect("backward");
            black_box((&dx, &dw));
        });
        let dw_only = best(runs, || {
            linear_backward(&dout, &x, &w, dims, None, Some(&mut dw), None).expect("backward");
            black_box(&dw);
        });
        line(&format!("{name} forward"), flops, fwd);
        line(&format!("{name} backward dw"), flops, dw_only);
        line(&format!("{name} backward (dx, dw)"), 2.0 * flops, bwd);
        step += (fwd + bwd) * times as u32;
        step_flops += 3.0 * flops * times as f64;
    }

    if run("attention") {
        attention(runs, &line, &mut step, &mut step_flops);
    }

    line("a step's products and attention", step_flops, step);
    println!(
        "at the peak these would take {:.1} ms; compare with model_cpu's train step on the same path",
        step_flops / (peak * threads * 1e9) * 1e3
    );
}

/// The attention forward and backward of one layer, `LAYERS` times a step.
fn attention(
    runs: usize,
    line: &dyn Fn(&str, f64, Duration),
    step: &mut Duration,
    step_flops: &mut f64,
) {
    let (q_dim, kv_dim) = (Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    // Attention: the FLOPs its blocked products do (blocks of 64 query or key tokens, each
    // against every key up to the block's last): forward S = QKᵀ and P·V; backward S and
    // dP = dO·Vᵀ twice (once per pass), dQ, dK, dV.
    let shape = AttentionShape::new(BATCH, SEQ, Q_HEADS, KV_HEADS, HEAD_DIM);
    let (q, k, v) = (
        values(TOKENS * q_dim, 4),
        values(TOKENS * kv_dim, 5),
        values(TOKENS * kv_dim, 6),
    );
    let mask = vec![1.0f32; TOKENS];
    let inputs = AttentionInputs {
        q: &q,
        k: &k,
        v: &v,
        key_mask: Some(&mask),
        segments: None,
    };
    let mut out = vec![0.0f32; TOKENS * q_dim];
    let mut lse = vec![0.0f32; TOKENS * Q_HEADS];
    let block_keys: usize = (0..SEQ / 64).map(|i| 64 * (i + 1)).sum();
    let pair = 2.0 * (BATCH * Q_HEADS * 64 * block_keys * HEAD_DIM) as f64; // one product
    let fwd = best(runs, || {
        attention_forward(&shape, inputs, &mut out, &mut lse).expect("attention forward");
        black_box(&out);
    });
    let dout = values(TOKENS * q_dim, 7);
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; TOKENS * q_dim],
        vec![0.0f32; TOKENS * kv_dim],
        vec![0.0f32; TOKENS * kv_dim],
    );
    let bwd = best(runs, || {
        attention_backward(
            &shape,
            inputs,
            &out,
            &lse,
            &dout,
            AttentionGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            },
        )
        .expect("attention backward");
        black_box((&dq, &dk, &dv));
    });
    line("attention forward", 2.0 * pair, fwd);
    line("attention backward", 7.0 * pair, bwd);
    *step += (fwd + bwd) * LAYERS as u32;
    *step_flops += 9.0 * pair * LAYERS as f64;
}
