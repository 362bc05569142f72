//! The ares-model decoder on the CUDA backend (f32 storage; cuBLAS GEMMs in f32, TF32 or
//! bf16 operands; the NVRTC kernels of `ares-cuda`), on a Qwen2.5-0.5B-shaped model with random weights
//! (24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864, vocab 151 936, tied
//! embeddings, q/k/v biases):
//!
//! - **train**: tokens/s of one training step's model work (forward, the loss head with
//!   ∂L/∂logπ = −1/N per token, backward into zeroed gradients) on `ARES_BENCH_BATCH` ×
//!   `ARES_BENCH_SEQ` tokens (default 4 × 512), with the achieved TFLOP/s counted as
//!   6·params·tokens + the attention's 6·layers·hidden·seq·tokens (causal: half of the
//!   12 of a full square); the AdamW step timed on its own;
//! - **generate**: new tokens/s of batched generation, greedy and sampled (T = 1, top-p 1:
//!   tokens picked on the device), 32 prompts of 32 tokens, 64 new tokens each.
//! - **ragged** (in the last mode, bf16 with the weight copies): an RL update's ragged batch
//!   of 16 samples padded beside packed, the packed pass's attention padded by gathers (the
//!   CUDA kernels take no segments yet; `ares_benches::model::ragged`);
//! - **attention**, **decode-attention**, **chunk-attention**: the attention kernels alone
//!   (their functions below say at which shapes);
//! - **fuse**: the q/k/v and gate/up products at this shape, separate beside one product of
//!   the whole width (`ares_benches::fused_products`): what fusing them could gain;
//! - **step** (only when asked): the 0.5B shape's step in the CUDA trainer's default setup
//!   (bf16 storage, `ares_benches::train_step`) on a model of its own, so that under
//!   `ARES_PROFILE=1` the op table is that step's alone;
//! - **scale** (only when asked: `bench-model_cuda scale`): Qwen2.5-1.5B and 3B shapes
//!   (random weights), one training step's model work (forward + backward, then the AdamW
//!   update) on the same `ARES_BENCH_BATCH` × `ARES_BENCH_SEQ` tokens with every tensor in f32
//!   and TF32 products beside the CUDA trainer's bf16 storage, with f32 moments (its
//!   default) and with int8 moments: tokens/s, TFLOP/s and MFU
//!   against the dense bf16 peak (`ares_benches::train_step::dense_bf16_peak`), the bytes the
//!   step holds and the device memory in use, and their bf16 / f32 ratios.
//!
//! One argument picks sections, comma-separated (`bench-model_cuda attention,train`); none
//! runs every section but `step` and `scale`. The modes run with exact f32 GEMMs, then
//! TF32, then bf16 operands (`Model::set_matmul_precision`; f32 sums and f32 storage
//! throughout), then bf16 with the model's bf16 weight copies (`Model::set_bf16_weights`: no conversion of a weight per
//! GEMM; the AdamW step then includes rounding the copies), then with the linear weights
//! stored in bf16 (`Model::set_weight_storage`: no f32 master; the AdamW step widens,
//! updates and rounds each tensor stochastically). Times are wall clock
//! around calls that end with a device synchronisation,
//! best and median of `ARES_BENCH_RUNS` (default 3) after a warm-up. `ARES_BENCH_MODES`
//! (comma-separated `f32`, `tf32`, `bf16`, `bf16-copies`, `bf16-stored`) runs only those
//! modes; under `ARES_PROFILE=1` the run ends with every op's calls and device time (CUDA
//! events). Without a GPU the binary says why and exits 0. A plain `main` (`harness = false`).

use std::path::Path;
use std::time::Instant;

use ares_benches::SplitMix;
use ares_benches::model::{
    QWEN3B_MODEL, QWEN05_MODEL, QWEN15_MODEL, best_and_median, env_usize, ragged, random_weights,
    random_weights_parallel, report,
};
use ares_benches::train_step::{StepSetup, TrainBatch, dense_bf16_peak, train_flops, train_step};
use ares_model::backend::cuda::CudaBackend;
use ares_model::backend::{Backend, MatmulPrecision};
use ares_model::hf::config::ModelConfig;
use ares_model::model::{
    ActivationDtype, AdamW, AdamWConfig, GenerateRequest, GradDtype, Inputs, Model, Sampling,
    WeightStorage,
};

/// The train modes, as `ARES_BENCH_MODES` names them: `(name, precision, bf16 weight copies,
/// weights stored in bf16)`.
const MODES: [(&str, MatmulPrecision, bool, bool); 5] = [
    ("f32", MatmulPrecision::F32, false, false),
    ("tf32", MatmulPrecision::Tf32, false, false),
    ("bf16", MatmulPrecision::Bf16, false, false),
    ("bf16-copies", MatmulPrecision::Bf16, true, false),
    ("bf16-stored", MatmulPrecision::Bf16, true, true),
];

/// The sections one argument may name.
const SECTIONS: [&str; 9] = [
    "attention",
    "fuse",
    "decode-attention",
    "chunk-attention",
    "train",
    "ragged",
    "generate",
    "step",
    "scale",
];

const GEN_PROMPTS: usize = 32;
const GEN_PROMPT_LEN: usize = 32;
const GEN_NEW: usize = 64;

fn main() {
    // the arguments first: a typo is named before a GPU is looked for
    let runs = env_usize("ARES_BENCH_RUNS", 3);
    let (batch, seq) = (
        env_usize("ARES_BENCH_BATCH", 4),
        env_usize("ARES_BENCH_SEQ", 512),
    );
    // the sections asked for (`attention,train`), all but `step` and `scale` when none are
    let only: Option<Vec<String>> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(|a| a.split(',').map(|s| s.trim().to_string()).collect());
    if let Some(unknown) = only
        .iter()
        .flatten()
        .find(|s| !SECTIONS.contains(&s.as_str()))
    {
        println!("bench-model_cuda: unknown section {unknown:?}; known: {SECTIONS:?}");
        std::process::exit(2);
    }
    let asked = |what: &str| only.as_ref().is_some_and(|o| o.iter().any(|x| x == what));
    let wants = |what: &str| only.is_none() || asked(what);
    let modes = std::env::var("ARES_BENCH_MODES").ok();
    let modes: Vec<&str> = match modes.as_deref() {
        None => MODES.iter().map(|m| m.0).collect(),
        Some(list) => list.split(',').map(str::trim).collect(),
    };
    if let Some(unknown) = modes.iter().find(|m| !MODES.iter().any(|k| k.0 == **m)) {
        let known: Vec<&str> = MODES.iter().map(|m| m.0).collect();
        println!("ARES_BENCH_MODES: unknown mode {unknown:?}; known: {known:?}");
        std::process::exit(2);
    }
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("model_cuda: skipped, no usable GPU: {e}");
            return;
        }
    };
    println!("device: {}", gpu.info());
    if asked("scale") {
        scale(&gpu, runs, (batch, seq));
    }
    if asked("step") {
        step(&gpu, runs, (batch, seq));
    }
    // sections that build their own models: the op profile is theirs alone
    if only
        .as_ref()
        .is_some_and(|o| o.iter().all(|x| x == "scale" || x == "step"))
    {
        print_profile(&gpu);
        return;
    }
    let config = ModelConfig::from_json_str(Path::new("bench/config.json"), QWEN05_MODEL)
        .expect("the bench config parses");
    let mut rng = SplitMix::new(7);
    let w = random_weights(&config, &mut rng);
    let params: usize = w.tensors().iter().map(|(_, t)| t.data.len()).sum();
    let start = Instant::now();
    let mut model = Model::new(gpu.clone(), &config, &w).expect("the bench model builds");
    gpu.synchronize().expect("upload");
    println!(
        "model: Qwen2.5-0.5B shape ({:.1} M parameters, f32); Model::new {:.0} ms",
        params as f64 / 1e6,
        start.elapsed().as_secs_f64() * 1e3,
    );
    if wants("attention") {
        attention(&gpu, runs);
    }
    if wants("decode-attention") {
        decode_attention(&gpu, runs);
    }
    if wants("chunk-attention") {
        chunk_attention(&gpu, runs);
    }
    if wants("fuse") {
        fuse(&gpu, runs, batch * seq);
    }

    let chosen = MODES.into_iter().filter(|m| modes.contains(&m.0));
    for (_, precision, copies, stored) in chosen {
        model.set_matmul_precision(precision);
        model.set_bf16_weights(copies).expect("bf16 weight copies");
        let storage = if stored {
            WeightStorage::Bf16
        } else {
            WeightStorage::F32
        };
        model.set_weight_storage(storage).expect("weight storage");
        let mode = match (copies, stored) {
            (_, true) => "bf16, linear weights stored in bf16 (no f32 master)",
            (true, false) => "bf16, stored bf16 weights",
            (false, false) => precision.name(),
        };
        println!(
            "[{mode}] weights on the device: {:.1} MiB",
            model.weight_bytes() as f64 / (1u64 << 20) as f64
        );
        if wants("train") {
            let train = TrainBatch::random(&mut rng, batch, seq, 151_936);
            let (n, inputs) = (train.tokens(), train.inputs());
            let (targets, coeffs) = (&train.targets, &train.coeffs);
            let mut acts = model.activations(batch, seq).expect("activations");
            let mut grads = model.grads().expect("grads");
            let t = best_and_median(runs, || {
                grads.zero(&gpu).expect("zero");
                model.forward(&inputs, &mut acts).expect("forward");
                model
                    .backward_from_log_prob_grads(
                        &inputs, &mut acts, targets, coeffs, 1.0, &mut grads,
                    )
                    .expect("backward");
                gpu.synchronize().expect("sync");
            });
            let flops = train_flops(&config, params, n, seq);
            report(
                &format!("[{mode}] train forward+backward ({batch} × {seq})"),
                n,
                "tokens",
                t,
            );
            println!(
                "  = {:.1} TFLOP/s (best), {:.2} GFLOP per step",
                flops / t.0.as_secs_f64() / 1e12,
                flops / 1e9
            );
            let t = best_and_median(runs, || {
                model.forward(&inputs, &mut acts).expect("forward");
                gpu.synchronize().expect("sync");
            });
            report("  of which forward", n, "tokens", t);
            if stored {
                // the whole bf16 storage: the gradients and the MLP's activations too
                model.set_activation_dtype(ActivationDtype::Bf16);
                let mut acts16 = model.activations(batch, seq).expect("activations");
                let mut g16 = model.grads_in(GradDtype::Bf16).expect("grads");
                let t = best_and_median(runs, || {
                    g16.zero(&gpu).expect("zero");
                    model.forward(&inputs, &mut acts16).expect("forward");
                    model
                        .backward_from_log_prob_grads(
                            &inputs,
                            &mut acts16,
                            targets,
                            coeffs,
                            1.0,
                            &mut g16,
                        )
                        .expect("backward");
                    gpu.synchronize().expect("sync");
                });
                model.set_activation_dtype(ActivationDtype::F32);
                report(
                    "[bf16 storage] train forward+backward, bf16 gradients and activations",
                    n,
                    "tokens",
                    t,
                );
                let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
                println!(
                    "  arena {:.1} MiB (f32 activations {:.1} MiB), gradients {:.1} MiB (f32 {:.1})",
                    mib(acts16.elements().bytes()),
                    mib(acts.elements().bytes()),
                    mib(g16.bytes()),
                    mib(grads.bytes()),
                );
            }
            if precision == MatmulPrecision::Bf16 && !stored {
                // activation checkpointing: one layer's activations kept, recomputed
                model.set_gradient_checkpointing(true);
                let mut ckpt = model.activations(batch, seq).expect("activations");
                let t = best_and_median(runs, || {
                    grads.zero(&gpu).expect("zero");
                    model.forward(&inputs, &mut ckpt).expect("forward");
                    model
                        .backward_from_log_prob_grads(
                            &inputs, &mut ckpt, targets, coeffs, 1.0, &mut grads,
                        )
                        .expect("backward");
                    gpu.synchronize().expect("sync");
                });
                model.set_gradient_checkpointing(false);
                report("  checkpointed forward+backward", n, "tokens", t);
                lora_step(&gpu, &config, &w, &inputs, targets, coeffs, runs);
            }
            let mut opt = AdamW::new(&model, AdamWConfig::default()).expect("adamw");
            let t = best_and_median(runs, || {
                opt.step(&mut model, &grads, 1e-7, Some(1.0)).expect("step");
                gpu.synchronize().expect("sync");
            });
            report(
                &format!("[{mode}] AdamW step (norm + clip + update)"),
                1,
                "steps",
                t,
            );
        }

        // a ragged RL batch padded beside packed (the attention padded by gathers: the
        // CUDA kernels take no segments yet), in bf16 with the weight copies
        if copies && !stored && wants("ragged") {
            println!("[{mode}] ragged batch:");
            ragged(&mut model, &mut rng, runs, 151_936, || {
                gpu.synchronize().expect("sync")
            });
        }

        // (generation's few-token decode products run in f32 under bf16 either way)
        if !copies && wants("generate") {
            let prompts: Vec<Vec<u32>> = (0..GEN_PROMPTS)
                .map(|_| {
                    (0..GEN_PROMPT_LEN)
                        .map(|_| (rng.next_u64() % 151_936) as u32)
                        .collect()
                })
                .collect();
            for (label, sampling) in [
                ("greedy", Sampling::Greedy),
                (
                    "sampled (T = 1, top-p 1)",
                    Sampling::Sample {
                        temperature: 1.0,
                        top_k: None,
                        top_p: 1.0,
                        min_p: 0.0,
                    },
                ),
            ] {
                let request = GenerateRequest {
                    prompts: prompts.clone(),
                    max_new_tokens: GEN_NEW,
                    eos_ids: Vec::new(),
                    sampling,
                    seed: 0,
                };
                let t = best_and_median(runs.min(3), || {
                    let out = model.generate(&request).expect("generate");
                    assert!(out.tokens.iter().all(|t| t.len() == GEN_NEW));
                });
                report(
                    &format!(
                        "[{mode}] generate {label} ({GEN_PROMPTS} × {GEN_NEW} new, prompts of {GEN_PROMPT_LEN})"
                    ),
                    GEN_PROMPTS * GEN_NEW,
                    "tokens",
                    t,
                );
            }
        }
    }
    // the q/k/v biases added in cuBLASLt's epilogue (`ARES_CUBLASLT=0`: a GEMM and a pass)
    println!(
        "biased products with cuBLASLt's bias epilogue: {}",
        gpu.ops()
            .bias_epilogues()
            .map_or("none (cuBLASLt not in use)".into(), |n| n.to_string())
    );
    print_profile(&gpu);
}

/// Under `ARES_PROFILE=1`: every op's calls and device time over the whole run (all
/// sections, all runs; CUDA events around each op).
fn print_profile(gpu: &CudaBackend) {
    match gpu.op_profile() {
        Ok(Some(table)) => println!("{table}"),
        Ok(None) => {}
        Err(e) => println!("op profile: {e}"),
    }
}

/// `bench-model_cuda fuse`: the layer's q/k/v products (with their biases) and gate/up
/// products on `rows` tokens, separate beside fused, forward and backward.
fn fuse(gpu: &CudaBackend, runs: usize, rows: usize) {
    let (c, i, qd, kvd) = (896, 4864, 896, 128);
    for (what, outs, bias) in [
        ("q|k|v", &[qd, kvd, kvd][..], true),
        ("gate|up", &[i, i][..], false),
    ] {
        let label = format!("[fuse {what}, {rows} × {c} → {outs:?}]");
        let f =
            match ares_benches::fused_products::products(gpu, (rows, c), outs, bias, runs.max(5)) {
                Ok(f) => f,
                Err(e) => {
                    println!("{label} did not run: {e}");
                    continue;
                }
            };
        let ms = |t: std::time::Duration| t.as_secs_f64() * 1e3;
        for (dir, sep, one) in [
            ("forward", f.separate_forward, f.fused_forward),
            ("backward", f.separate_backward, f.fused_backward),
        ] {
            println!(
                "{label} {dir}: separate {:.3} ms, fused {:.3} ms (best; {:.2}× the time)",
                ms(sep.0),
                ms(one.0),
                one.0.as_secs_f64() / sep.0.as_secs_f64().max(1e-12)
            );
        }
        println!(
            "  largest output difference, fused − separate: {:.2e}",
            f.forward_difference
        );
    }
}

/// `bench-model_cuda step`: the 0.5B shape's training step in the CUDA trainer's default
/// setup (bf16 storage) alone, its model built here: under `ARES_PROFILE=1` the op table is
/// this step's (warm-up and `ARES_BENCH_RUNS` runs).
fn step(gpu: &CudaBackend, runs: usize, (batch, seq): (usize, usize)) {
    let config = ModelConfig::from_json_str(Path::new("bench/config.json"), QWEN05_MODEL)
        .expect("the bench config parses");
    let w = random_weights_parallel(&config, 7);
    let params: usize = w.tensors().iter().map(|(_, t)| t.data.len()).sum();
    let train = TrainBatch::random(&mut SplitMix::new(5), batch, seq, 151_936);
    let flops = train_flops(&config, params, train.tokens(), seq);
    let setup = StepSetup::BF16;
    let label = format!("[Qwen2.5-0.5B, {}]", setup.name);
    match train_step(gpu, (&config, &w), &setup, &train, runs) {
        Ok(f) => print_step(gpu, &label, &train, flops, &f),
        Err(e) => println!("{label} did not run: {e}"),
    }
}

/// The lines of one [`train_step`]: tokens/s, TFLOP/s and MFU, the update, the bytes.
fn print_step(
    gpu: &CudaBackend,
    label: &str,
    train: &TrainBatch,
    flops: f64,
    f: &ares_benches::train_step::StepFigures,
) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let (batch, seq) = (train.batch, train.seq);
    let what = format!("{label} train forward+backward ({batch} × {seq})");
    report(&what, train.tokens(), "tokens", f.fwd_bwd);
    let tflops = flops / f.fwd_bwd.0.as_secs_f64() / 1e12;
    let mfu =
        dense_bf16_peak(&gpu.info().name).map_or("MFU: set ARES_BENCH_PEAK_TFLOPS".into(), |p| {
            format!(
                "MFU {:.1} % of the dense bf16 peak ({p:.0})",
                100.0 * tflops / p
            )
        });
    println!("  = {tflops:.1} TFLOP/s (best), {mfu}");
    report(&format!("{label} AdamW update"), 1, "steps", f.update);
    println!(
        "  held {:.2} GiB: weights {:.2}, gradients {:.2}, arena {:.2}, moments {:.2}; \
         device memory in use at the phases' ends {}",
        gib(f.held()),
        gib(f.weights),
        gib(f.grads),
        gib(f.arena),
        gib(f.moments),
        f.device_peak.map_or("unknown".into(), |b| format!(
            "{:.2} GiB (cuMemGetInfo)",
            gib(b)
        )),
    );
}

/// `bench-model_cuda scale`: one training step's model work at the Qwen2.5-1.5B and 3B
/// shapes in today's f32 beside bf16 storage (the MFU and peak-memory goals).
fn scale(gpu: &CudaBackend, runs: usize, (batch, seq): (usize, usize)) {
    for (name, json) in [("Qwen2.5-1.5B", QWEN15_MODEL), ("Qwen2.5-3B", QWEN3B_MODEL)] {
        let config = ModelConfig::from_json_str(Path::new("bench/config.json"), json)
            .expect("the bench config parses");
        let start = Instant::now();
        let w = random_weights_parallel(&config, 7);
        let params: usize = w.tensors().iter().map(|(_, t)| t.data.len()).sum();
        println!(
            "[{name}] {:.2} B parameters (random weights in {:.1} s)",
            params as f64 / 1e9,
            start.elapsed().as_secs_f64()
        );
        let train = TrainBatch::random(&mut SplitMix::new(5), batch, seq, 151_936);
        let flops = train_flops(&config, params, train.tokens(), seq);
        let mut f32_peak = None;
        let setups = [
            StepSetup::F32,
            StepSetup::BF16,
            StepSetup::BF16_INT8_MOMENTS,
        ];
        for (i, setup) in setups.into_iter().enumerate() {
            let label = format!("[{name}, {}]", setup.name);
            let f = match train_step(gpu, (&config, &w), &setup, &train, runs) {
                Ok(f) => f,
                Err(e) => {
                    println!("{label} did not run: {e}");
                    continue;
                }
            };
            print_step(gpu, &label, &train, flops, &f);
            if i == 0 {
                f32_peak = Some((f.held(), f.device_peak));
            }
            // the ratios to the f32 setup's, when it ran
            let Some((h32, d32)) = f32_peak.filter(|_| i > 0) else {
                continue;
            };
            let ratio = |a: u64, b: u64| a as f64 / b.max(1) as f64;
            let device = (f.device_peak.zip(d32))
                .map_or("unknown".into(), |(a, b)| format!("{:.2}×", ratio(a, b)));
            println!(
                "  / f32 storage: held {:.2}×, device memory {device} (goal ≤ 0.6×)",
                ratio(f.held(), h32)
            );
        }
    }
}

/// LoRA r = 16 on every linear layer of a second copy of the model (bf16 operands,
/// checkpointed, the base frozen): the step's tokens/s and the device memory it took
/// (`scripts/bench_torch_gpu.py` runs the same step with peft).
fn lora_step(
    gpu: &CudaBackend,
    config: &ModelConfig,
    w: &ares_model::hf::weights::ModelWeights,
    inputs: &Inputs<'_>,
    targets: &[u32],
    coeffs: &[f32],
    runs: usize,
) {
    use ares_model::hf::lora::LoraConfig;
    let used = || gpu.memory_info().map(|(free, total)| total - free);
    let before = used();
    let mut model = Model::new(gpu.clone(), config, w).expect("the bench model builds");
    model.set_matmul_precision(MatmulPrecision::Bf16);
    model.set_gradient_checkpointing(true);
    let lora = LoraConfig::all_linear(16, 32.0);
    model.add_lora(&lora, 1).expect("adapters");
    let mut acts = model
        .activations(inputs.batch, inputs.seq)
        .expect("activations");
    let mut grads = model.grads().expect("grads");
    let n = inputs.batch * inputs.seq;
    let t = best_and_median(runs, || {
        grads.zero(gpu).expect("zero");
        model.forward(inputs, &mut acts).expect("forward");
        model
            .backward_from_log_prob_grads(inputs, &mut acts, targets, coeffs, 1.0, &mut grads)
            .expect("backward");
        gpu.synchronize().expect("sync");
    });
    report(
        &format!(
            "[bf16] LoRA r=16 all-linear, checkpointed ({} × {})",
            inputs.batch, inputs.seq
        ),
        n,
        "tokens",
        t,
    );
    if let (Some(a), Some(b)) = (before, used()) {
        println!(
            "  device memory of the LoRA model, arena and gradients: {:.2} GiB (cuMemGetInfo)",
            (b.saturating_sub(a)) as f64 / (1u64 << 30) as f64
        );
    }
}

/// Causal attention alone at FlashAttention's benchmark shape, 4 × 2 048 tokens, MHA with
/// 2 048 features (16 heads of 128, 32 of 64): the f32 forward and backward (scalar FMAs)
/// and the bf16 forward and backward on tensor cores — from f32 q, k, v, and as bf16
/// training runs them, q, k, v and the output stored in bf16 — in TFLOP/s of the causal products — the
/// forward 4·B·T²·H·D/2, the backward 2.5 times that (FlashAttention's count). PyTorch's
/// SDPA at the same shapes: `bench_torch_gpu.py` (`--only attention`).
fn attention(gpu: &CudaBackend, runs: usize) {
    use ares_model::backend::{
        AttentionDims, AttentionGrads, AttentionInputs, DType, View, ViewMut,
    };
    let (batch, seq) = (4usize, 2048usize);
    for (heads, d) in [(16usize, 128usize), (32, 64)] {
        let dims = AttentionDims::new(batch, seq, heads, heads, d);
        let n = batch * seq * heads * d;
        let mut rng = SplitMix::new(11);
        let mut up = |scale: f32| {
            let host: Vec<f32> = (0..n).map(|_| scale * (rng.unit() * 2.0 - 1.0)).collect();
            let mut b = gpu.alloc(n).expect("alloc");
            gpu.upload(&host, ViewMut::whole(&mut b)).expect("upload");
            b
        };
        let (q, k, v, dout) = (up(2.0), up(2.0), up(1.0), up(1.0));
        let (mut out, mut lse) = (
            gpu.alloc(n).expect("alloc"),
            gpu.alloc(n / d).expect("alloc"),
        );
        let (mut dq, mut dk, mut dv) = (
            gpu.alloc(n).expect("alloc"),
            gpu.alloc(n).expect("alloc"),
            gpu.alloc(n).expect("alloc"),
        );
        let inputs = || AttentionInputs {
            q: View::whole(&q),
            k: View::whole(&k),
            v: View::whole(&v),
            key_mask: None,
        };
        let fwd_flops = 4.0 * (batch * seq * seq * heads * d) as f64 / 2.0;
        let show = |what: &str,
                    flops: f64,
                    (best, median): (std::time::Duration, std::time::Duration)| {
            println!(
                "[attention {batch} × {seq}, {heads} heads of {d}] {what}: {:.1} TFLOP/s best ({:.2} ms), median {:.2} ms",
                flops / best.as_secs_f64() / 1e12,
                best.as_secs_f64() * 1e3,
                median.as_secs_f64() * 1e3,
            );
        };
        let t = best_and_median(runs.max(5), || {
            gpu.attention(
                dims,
                inputs(),
                None,
                ViewMut::whole(&mut out),
                ViewMut::whole(&mut lse),
            )
            .expect("attention");
            gpu.synchronize().expect("sync");
        });
        show("f32 forward (scalar FMAs)", fwd_flops, t);
        let t = best_and_median(runs.max(5), || {
            gpu.attention_bf16(
                dims,
                inputs(),
                None,
                ViewMut::whole(&mut out),
                ViewMut::whole(&mut lse),
            )
            .expect("attention_bf16");
            gpu.synchronize().expect("sync");
        });
        show("bf16 forward (tensor cores)", fwd_flops, t);
        let t = best_and_median(runs.max(5), || {
            let grads = AttentionGrads {
                dq: ViewMut::whole(&mut dq),
                dk: ViewMut::whole(&mut dk),
                dv: ViewMut::whole(&mut dv),
            };
            gpu.attention_backward(
                dims,
                inputs(),
                None,
                View::whole(&out),
                View::whole(&lse),
                View::whole(&dout),
                grads,
            )
            .expect("attention_backward");
            gpu.synchronize().expect("sync");
        });
        show("f32 backward (scalar FMAs)", 2.5 * fwd_flops, t);
        gpu.attention_bf16(
            dims,
            inputs(),
            None,
            ViewMut::whole(&mut out),
            ViewMut::whole(&mut lse),
        )
        .expect("attention_bf16");
        let t = best_and_median(runs.max(5), || {
            let grads = AttentionGrads {
                dq: ViewMut::whole(&mut dq),
                dk: ViewMut::whole(&mut dk),
                dv: ViewMut::whole(&mut dv),
            };
            gpu.attention_backward_bf16(
                dims,
                inputs(),
                None,
                View::whole(&out),
                View::whole(&lse),
                View::whole(&dout),
                grads,
            )
            .expect("attention_backward_bf16");
            gpu.synchronize().expect("sync");
        });
        show("bf16 backward (tensor cores)", 2.5 * fwd_flops, t);

        // q, k, v and the output stored in bf16 (bf16 activations): no conversion passes
        let half = |src: &<CudaBackend as Backend>::Buffer| {
            let mut h = gpu.alloc_half(n, DType::Bf16).expect("alloc");
            gpu.round_bf16(View::whole(src), ViewMut::whole(&mut h))
                .expect("round");
            h
        };
        let (q16, k16, v16) = (half(&q), half(&k), half(&v));
        let mut out16 = gpu.alloc_half(n, DType::Bf16).expect("alloc");
        let t = best_and_median(runs.max(5), || {
            let (q, k, v) = (View::whole(&q16), View::whole(&k16), View::whole(&v16));
            let out16 = Some(ViewMut::whole(&mut out16));
            let lse = ViewMut::whole(&mut lse);
            gpu.attention_bf16_stored(dims, q, k, v, None, None, None, out16, lse)
                .expect("attention_bf16_stored");
            gpu.synchronize().expect("sync");
        });
        show("bf16 stored forward (tensor cores)", fwd_flops, t);
        let t = best_and_median(runs.max(5), || {
            let grads = AttentionGrads {
                dq: ViewMut::whole(&mut dq),
                dk: ViewMut::whole(&mut dk),
                dv: ViewMut::whole(&mut dv),
            };
            let (q, k, v) = (View::whole(&q16), View::whole(&k16), View::whole(&v16));
            let (out16, lse, dout) = (
                Some(View::whole(&out16)),
                View::whole(&lse),
                View::whole(&dout),
            );
            gpu.attention_backward_bf16_stored(
                dims, q, k, v, None, None, None, out16, lse, dout, grads,
            )
            .expect("attention_backward_bf16_stored");
            gpu.synchronize().expect("sync");
        });
        show("bf16 stored backward (tensor cores)", 2.5 * fwd_flops, t);
    }
}

/// Paged decode attention at the Qwen2.5-0.5B head shape (14 query / 2 KV heads of 64,
/// 16-slot blocks), one query a sequence: a few long sequences (split-K: 16 and 5 chunks a
/// sequence) and many short ones (one chunk each), f32 and bf16 pools, in GB/s of keys and
/// values read and as a fraction of the device's copy bandwidth measured in the same run
/// (bytes read + written by a 1 GiB device-to-device copy: the memory roofline a decode
/// step's attention can reach).
fn decode_attention(gpu: &CudaBackend, runs: usize) {
    use ares_model::backend::{AttentionDims, View, ViewMut};
    let copy_gbs = {
        let n = 1usize << 28; // 1 GiB of f32
        let src = gpu.ops().alloc(n).expect("alloc");
        let mut dst = gpu.ops().alloc(n).expect("alloc");
        let (best, _) = best_and_median(runs.max(5), || {
            gpu.ops()
                .stream()
                .memcpy_dtod(&src, &mut dst)
                .expect("copy");
            gpu.synchronize().expect("sync");
        });
        2.0 * (n * 4) as f64 / best.as_secs_f64() / 1e9
    };
    println!("[decode attention] device copy bandwidth: {copy_gbs:.0} GB/s (read + write)");
    let (hq, hkv, d, bs) = (14usize, 2usize, 64usize, 16usize);
    let mut rng = SplitMix::new(13);
    for (batch, len) in [(4usize, 8192usize), (16, 2048), (128, 500)] {
        let width = (len + 1).div_ceil(bs);
        let shape = (batch, width, len, 1);
        let (pools, q, mut out) = paged_bench(gpu, &mut rng, shape, (hq, hkv, d, bs));
        let dims = AttentionDims::new(batch, 1, hq, hkv, d);
        let keys = batch * (len + 1) * hkv * d * 2;
        let plan = if width * bs > 512 {
            format!(
                "split-K, {} chunks a sequence",
                (len + 1).div_ceil(512).min(16)
            )
        } else {
            "one chunk a sequence".to_string()
        };
        for bf16 in [false, true] {
            let (best, median) = best_and_median(runs.max(5), || {
                let (q, o) = (View::whole(&q), ViewMut::whole(&mut out));
                if bf16 {
                    gpu.paged_attention_decode_bf16(dims, q, pools.half_cache(), o)
                        .expect("paged_attention_decode_bf16");
                } else {
                    gpu.paged_attention_decode(dims, q, pools.f32_cache(), o)
                        .expect("paged_attention_decode");
                }
                gpu.synchronize().expect("sync");
            });
            let bytes = keys * if bf16 { 2 } else { 4 };
            let gbs = bytes as f64 / best.as_secs_f64() / 1e9;
            println!(
                "[decode attention {batch} × {len} keys, {plan}] {} pools: {:.1} µs best, median {:.1} µs; {gbs:.0} GB/s of keys and values = {:.2} of the copy bandwidth",
                if bf16 { "bf16" } else { "f32" },
                best.as_secs_f64() * 1e6,
                median.as_secs_f64() * 1e6,
                gbs / copy_gbs,
            );
        }
    }
}

type CudaBuffer = <CudaBackend as ares_model::backend::Backend>::Buffer;
type CudaHalf = <CudaBackend as ares_model::backend::Backend>::Half;
type CudaIds = <CudaBackend as ares_model::backend::Backend>::Ids;

/// Random f32 and bf16 pools with their block tables, for the paged benches.
struct PagedPools {
    kv: CudaBuffer,
    kv16: CudaHalf,
    tables: Vec<u32>,
    lens: Vec<u32>,
    gt: CudaIds,
    gl: CudaIds,
    block_size: usize,
    width: usize,
}

impl PagedPools {
    /// The block tables, as the paged ops read them.
    fn tables(&self) -> ares_model::backend::BlockTables<'_, CudaIds> {
        ares_model::backend::BlockTables {
            block_size: self.block_size,
            max_blocks: self.width,
            tables: &self.gt,
            len: &self.gl,
            host_tables: &self.tables,
            host_len: &self.lens,
        }
    }

    /// The f32 pool as keys and values.
    fn f32_cache(&self) -> ares_model::backend::PagedKvView<'_, CudaBuffer, CudaIds> {
        use ares_model::backend::View;
        let (k, v) = (View::whole(&self.kv), View::whole(&self.kv));
        ares_model::backend::PagedKvView {
            k,
            v,
            blocks: self.tables(),
        }
    }

    /// The bf16 pool as keys and values.
    fn half_cache(&self) -> ares_model::backend::PagedKvView<'_, CudaHalf, CudaIds> {
        use ares_model::backend::View;
        let (k, v) = (View::whole(&self.kv16), View::whole(&self.kv16));
        ares_model::backend::PagedKvView {
            k,
            v,
            blocks: self.tables(),
        }
    }
}

/// [`PagedPools`] of `(batch, width, len, queries)`: `batch` sequences of `width` blocks
/// each (in order), `len` slots filled before `queries` new ones a sequence, at head shape
/// `(hq, hkv, d, block_size)` — with the queries and an output of their size.
fn paged_bench(
    gpu: &CudaBackend,
    rng: &mut SplitMix,
    (batch, width, len, queries): (usize, usize, usize, usize),
    (hq, hkv, d, bs): (usize, usize, usize, usize),
) -> (PagedPools, CudaBuffer, CudaBuffer) {
    use ares_model::backend::{DType, ViewMut};
    let blocks = batch * width;
    let pool = blocks * bs * hkv * d;
    let host: Vec<f32> = (0..pool).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let bits: Vec<u16> = host
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect();
    let mut kv = gpu.alloc(pool).expect("alloc");
    gpu.upload(&host, ViewMut::whole(&mut kv)).expect("upload");
    let mut kv16 = gpu.alloc_half(pool, DType::Bf16).expect("alloc");
    gpu.upload_half(&bits, ViewMut::whole(&mut kv16))
        .expect("upload");
    let tables: Vec<u32> = (0..blocks as u32).collect();
    let lens = vec![len as u32; batch];
    let (mut gt, mut gl) = (
        gpu.alloc_ids(tables.len()).expect("alloc"),
        gpu.alloc_ids(batch).expect("alloc"),
    );
    gpu.upload_ids(&tables, &mut gt).expect("upload");
    gpu.upload_ids(&lens, &mut gl).expect("upload");
    let q_host: Vec<f32> = (0..batch * queries * hq * d).map(|_| rng.unit()).collect();
    let mut q = gpu.alloc(q_host.len()).expect("alloc");
    gpu.upload(&q_host, ViewMut::whole(&mut q)).expect("upload");
    let out = gpu.alloc(q_host.len()).expect("alloc");
    let pools = PagedPools {
        kv,
        kv16,
        tables,
        lens,
        gt,
        gl,
        block_size: bs,
        width,
    };
    (pools, q, out)
}

/// A chunked prefill's later chunk over the paged pool at the Qwen2.5-0.5B head shape (14
/// query / 2 KV heads of 64, 16-slot blocks, f32 and bf16 pools): the scalar paged kernel
/// (`paged_attention_decode`, what such a chunk ran on before) beside the tensor-core one
/// (`paged_attention_prefill_bf16` / `_kv16`), in TFLOP/s of the causal products
/// (4 · queries · visible keys · head_dim · heads).
fn chunk_attention(gpu: &CudaBackend, runs: usize) {
    use ares_model::backend::{AttentionDims, View, ViewMut};
    let (hq, hkv, d, bs) = (14usize, 2usize, 64usize, 16usize);
    let mut rng = SplitMix::new(17);
    for (batch, before, chunk) in [(1usize, 2048usize, 512usize), (4, 1024, 256)] {
        let width = (before + chunk).div_ceil(bs);
        let shape = (batch, width, before, chunk);
        let (pools, q, mut out) = paged_bench(gpu, &mut rng, shape, (hq, hkv, d, bs));
        let dims = AttentionDims::new(batch, chunk, hq, hkv, d);
        // each query sees `before + i + 1` keys
        let visible = (chunk * before + chunk * (chunk + 1) / 2) as f64;
        let flops = 4.0 * batch as f64 * visible * (d * hq) as f64;
        for (kernel, bf16_pool) in [
            ("scalar", false),
            ("tensor cores", false),
            ("scalar", true),
            ("tensor cores", true),
        ] {
            let (best, median) = best_and_median(runs.max(5), || {
                let q = View::whole(&q);
                let o = ViewMut::whole(&mut out);
                match (kernel == "tensor cores", bf16_pool) {
                    (false, false) => gpu.paged_attention_decode(dims, q, pools.f32_cache(), o),
                    (true, false) => {
                        gpu.paged_attention_prefill_bf16(dims, q, pools.f32_cache(), o)
                    }
                    (false, true) => {
                        gpu.paged_attention_decode_bf16(dims, q, pools.half_cache(), o)
                    }
                    (true, true) => {
                        gpu.paged_attention_prefill_bf16_kv16(dims, q, pools.half_cache(), o)
                    }
                }
                .expect(kernel);
                gpu.synchronize().expect("sync");
            });
            println!(
                "[chunk attention {batch} × {chunk} queries after {before} slots] {kernel}, {} pools: {:.1} µs best, median {:.1} µs; {:.1} TFLOP/s",
                if bf16_pool { "bf16" } else { "f32" },
                best.as_secs_f64() * 1e6,
                median.as_secs_f64() * 1e6,
                flops / best.as_secs_f64() / 1e12,
            );
        }
    }
}
