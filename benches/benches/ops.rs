//! ares-cpu transformer ops at the sizes of a small Qwen2-shaped model (hidden 896, MLP
//! 4864, 14 query / 2 KV heads of 64 — Qwen2.5-0.5B's layer — on 512 tokens), on all
//! threads. GEMMs report GFLOP/s (criterion's "elements" are FLOPs); the element-wise ops
//! report bytes read and sit beside a same-bytes read baseline.

use ares_benches::{centered_values as values, par_read_baseline_f32, read_baseline};
use ares_cpu::ops::attention::{
    AttentionGrads, AttentionInputs, AttentionShape, attention_backward, attention_backward_bf16,
    attention_forward, attention_forward_bf16,
};
use ares_cpu::ops::matmul::{
    MatmulDims, linear_backward, linear_forward, linear_forward_t_in, transpose,
};
use ares_cpu::ops::matmul_tiles::{
    linear_forward_t_bf16, linear_forward_t_tiles, pack_bf16_tiles, pack_f32_tiles,
};
use ares_cpu::ops::precision::MatmulPrecision;
use ares_cpu::ops::rmsnorm::{add_rmsnorm_forward, rmsnorm_forward};
use ares_cpu::ops::swiglu::swiglu_forward;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

const TOKENS: usize = 512;
const HIDDEN: usize = 896;
const MLP: usize = 4864;
const Q_HEADS: usize = 14;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;

fn ops(c: &mut Criterion) {
    // linear: the MLP up projection, [512, 896] · [4864, 896]ᵀ
    let dims = MatmulDims {
        n: TOKENS,
        k: HIDDEN,
        m: MLP,
    };
    let (x, w) = (values(TOKENS * HIDDEN, 1), values(MLP * HIDDEN, 2));
    let mut y = vec![0.0f32; TOKENS * MLP];
    let (mut dx, mut dw) = (vec![0.0f32; TOKENS * HIDDEN], vec![0.0f32; MLP * HIDDEN]);
    let flops = (2 * TOKENS * HIDDEN * MLP) as u64;
    let mut g = c.benchmark_group("linear_512x896x4864");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(flops));
    g.bench_function("forward", |b| {
        b.iter(|| linear_forward(&x, &w, None, dims, &mut y).expect("forward"))
    });
    g.throughput(Throughput::Elements(2 * flops));
    g.bench_function("backward_dx_dw", |b| {
        b.iter(|| {
            linear_backward(&y, &x, &w, dims, Some(&mut dx), Some(&mut dw), None).expect("backward")
        })
    });
    g.finish();

    // decode products: a few rows (one token per sequence) times the MLP up projection
    // stored [in, out] as generation keeps it — row-major for the GEMM crate, column tiles in
    // f32 and bf16 — beside a plain read of the f32 weight's bytes (the memory limit of f32)
    let wt = values(HIDDEN * MLP, 6);
    let mut tiles = vec![0.0f32; wt.len()];
    pack_f32_tiles(&wt, HIDDEN, MLP, &mut tiles).expect("pack");
    let mut tiles16 = vec![0u16; wt.len()];
    pack_bf16_tiles(&wt, HIDDEN, MLP, &mut tiles16).expect("pack");
    for rows in [1, 8, 64] {
        let dims = MatmulDims {
            n: rows,
            k: HIDDEN,
            m: MLP,
        };
        let x = values(rows * HIDDEN, 7);
        let mut y = vec![0.0f32; rows * MLP];
        let mut g = c.benchmark_group(format!("decode_linear_{rows}x896x4864"));
        g.sample_size(20).measurement_time(Duration::from_secs(3));
        g.throughput(Throughput::Bytes((wt.len() * 4) as u64));
        g.bench_function("baseline_read_f32", |b| {
            b.iter(|| par_read_baseline_f32(&wt, wt.len().div_ceil(rayon::current_num_threads())))
        });
        g.bench_function("gemm_row_major_f32", |b| {
            b.iter(|| {
                linear_forward_t_in(MatmulPrecision::F32, &x, &wt, None, dims, &mut y)
                    .expect("gemm")
            })
        });
        g.bench_function("tiles_f32", |b| {
            b.iter(|| {
                linear_forward_t_tiles(MatmulPrecision::F32, &x, &tiles, None, dims, &mut y)
                    .expect("tiles")
            })
        });
        g.bench_function("tiles_bf16", |b| {
            b.iter(|| linear_forward_t_bf16(&x, &tiles16, None, dims, &mut y).expect("bf16"))
        });
        g.finish();
    }

    // causal GQA attention on one 512-token sequence
    let shape = AttentionShape::new(1, TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM);
    let q = values(TOKENS * Q_HEADS * HEAD_DIM, 3);
    let k = values(TOKENS * KV_HEADS * HEAD_DIM, 4);
    let v = values(TOKENS * KV_HEADS * HEAD_DIM, 5);
    let mut out = vec![0.0f32; q.len()];
    let mut lse = vec![0.0f32; TOKENS * Q_HEADS];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; q.len()],
        vec![0.0f32; k.len()],
        vec![0.0f32; v.len()],
    );
    // causal: about half of the T² scores, 2 FLOPs per multiply-add, for QKᵀ and PV
    let attn_flops = (2 * 2 * Q_HEADS * HEAD_DIM * TOKENS * (TOKENS + 1) / 2) as u64;
    let mut g = c.benchmark_group("attention_gqa_512");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(attn_flops));
    let inputs = AttentionInputs {
        q: &q,
        k: &k,
        v: &v,
        key_mask: None,
        segments: None,
    };
    g.bench_function("forward", |b| {
        b.iter(|| attention_forward(&shape, inputs, &mut out, &mut lse).expect("fwd"))
    });
    g.throughput(Throughput::Elements(2 * attn_flops));
    g.bench_function("backward", |b| {
        b.iter(|| {
            let grads = AttentionGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            attention_backward(&shape, inputs, &out, &lse, &out, grads).expect("bwd")
        })
    });
    // the bf16 twin of the GPU's tensor-core kernels (what CPU bf16 training runs)
    g.throughput(Throughput::Elements(attn_flops));
    g.bench_function("forward_bf16", |b| {
        b.iter(|| attention_forward_bf16(&shape, inputs, &mut out, &mut lse).expect("fwd"))
    });
    g.throughput(Throughput::Elements(2 * attn_flops));
    g.bench_function("backward_bf16", |b| {
        b.iter(|| {
            let grads = AttentionGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            attention_backward_bf16(&shape, inputs, &out, &lse, &out, grads).expect("bwd")
        })
    });
    g.finish();

    // element-wise: RMSNorm over [512, 896] and SwiGLU over [512, 4864]
    let weight = values(HIDDEN, 6);
    let (mut normed, mut rstd) = (vec![0.0f32; x.len()], vec![0.0f32; TOKENS]);
    let mut g = c.benchmark_group("rmsnorm_512x896");
    g.sample_size(20)
        .throughput(Throughput::Bytes((x.len() * 4) as u64));
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&x])))
    });
    g.bench_function("forward", |b| {
        b.iter(|| {
            rmsnorm_forward(&x, &weight, 1e-6, HIDDEN, &mut normed, &mut rstd).expect("rmsnorm")
        })
    });
    // the residual add and the norm: two passes, or fused in one (the same bits)
    let delta = values(x.len(), 9);
    let mut sum = vec![0.0f32; x.len()];
    g.bench_function("add_then_forward", |b| {
        b.iter(|| {
            for ((s, &a), &d) in sum.iter_mut().zip(&x).zip(&delta) {
                *s = a + d;
            }
            rmsnorm_forward(&sum, &weight, 1e-6, HIDDEN, &mut normed, &mut rstd).expect("rmsnorm")
        })
    });
    g.bench_function("add_rmsnorm", |b| {
        b.iter(|| {
            add_rmsnorm_forward(
                &x,
                &delta,
                &weight,
                1e-6,
                HIDDEN,
                &mut sum,
                &mut normed,
                &mut rstd,
            )
            .expect("add_rmsnorm")
        })
    });
    g.finish();
    let (gate, up) = (values(TOKENS * MLP, 7), values(TOKENS * MLP, 8));
    let mut act = vec![0.0f32; gate.len()];
    let mut g = c.benchmark_group("swiglu_512x4864");
    g.sample_size(20)
        .throughput(Throughput::Bytes((gate.len() * 8) as u64));
    g.bench_function("baseline_read", |b| {
        b.iter(|| black_box(read_baseline(&[&gate, &up])))
    });
    g.bench_function("forward", |b| {
        b.iter(|| swiglu_forward(&gate, &up, &mut act).expect("swiglu"))
    });
    g.finish();

    // transpose of the LM head [151936, 896] (generation's one-time copy of the weights),
    // against a copy of the same bytes
    let (rows, cols) = (151_936, HIDDEN);
    let head = values(rows * cols, 9);
    let mut out = vec![0.0f32; head.len()];
    let mut g = c.benchmark_group("transpose_151936x896");
    g.sample_size(10)
        .throughput(Throughput::Bytes((head.len() * 8) as u64));
    g.bench_function("baseline_copy", |b| {
        b.iter(|| out.copy_from_slice(black_box(&head)))
    });
    g.bench_function("transpose", |b| {
        b.iter(|| transpose(&head, rows, cols, &mut out).expect("transpose"))
    });
    g.finish();
}

criterion_group!(benches, ops);
criterion_main!(benches);
