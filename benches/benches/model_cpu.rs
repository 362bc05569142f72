//! The ares-model decoder on the CPU backend beside PyTorch CPU
//! (`scripts/bench_torch_cpu.py`, same shapes): a small Qwen2-shaped model (4 layers,
//! hidden 256, 4 query / 2 KV heads of 64, MLP 704, vocab 8192, tied embeddings, q/k/v
//! biases) with random weights.
//!
//! - **train**: tokens/s of one training step's model work on 8 × 256 tokens — forward,
//!   the loss head (∂L/∂logπ = −1/N per token at T = 1) and the backward pass into zeroed
//!   gradients; the AdamW step is timed on its own; then the same with LoRA pairs (r = 16,
//!   all-linear, the base frozen: `Model::add_lora`).
//! - **ragged**: the RL update's shape — 16 samples of a prompt (16–47 tokens) and a
//!   long-tailed response (8–191), forward + backward from the responses' log-probs — laid
//!   out padded (`[16, P + T]`, prompts left-padded, responses right-padded: the trainer's
//!   layout on CUDA) beside packed (one row back to back with `cu_seqlens` segments: the
//!   trainer's layout on the CPU) and packed with the attention padded by gathers (the
//!   model's path on a backend without segments: CUDA), same run; tokens/s count real
//!   tokens only.
//! - **generate**: new tokens/s of greedy batched generation with a KV cache, 16 prompts of
//!   32 tokens, 128 new tokens each (no EOS, so every sequence runs the full length).
//! - **rollout**: the RL rollout shape, 4 prompts of 100 tokens × n = 8 samples, 32 new
//!   tokens each, sampled: each prompt's 8 copies identical (one shared prefill per prompt)
//!   beside the same batch with the copies made distinct in their first token (32 prefills,
//!   the path without sharing), same run; prints `rollout speedup (shared / distinct)`.
//!
//! A plain `main` (`harness = false`): `cargo bench -p ares-benches --bench model_cpu`
//! prints the best and median of a few runs. Threads: rayon's default (all cores); set
//! `RAYON_NUM_THREADS` to match `torch.set_num_threads` of the PyTorch script.

use std::path::Path;
use std::time::Instant;

use ares_benches::SplitMix;
use ares_benches::model::{
    BENCH_MODEL, best_and_median, env_usize, ragged, random_weights, report,
};
use ares_benches::train_step::TrainBatch;
use ares_model::backend::MatmulPrecision;
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::config::ModelConfig;
use ares_model::hf::lora::LoraConfig;
use ares_model::model::{
    ActivationDtype, AdamW, AdamWConfig, GenerateRequest, GradDtype, Model, Sampling, WeightStorage,
};

const TRAIN_BATCH: usize = 8;
const TRAIN_SEQ: usize = 256;
const GEN_PROMPTS: usize = 16;
const GEN_PROMPT_LEN: usize = 32;
const GEN_NEW: usize = 128;

fn main() {
    let config = ModelConfig::from_json_str(Path::new("bench/config.json"), BENCH_MODEL)
        .expect("the bench config parses");
    let mut rng = SplitMix::new(7);
    let w = random_weights(&config, &mut rng);
    let start = Instant::now();
    let mut model = Model::new(CpuBackend, &config, &w).expect("the bench model builds");
    println!(
        "model: 4 layers, hidden 256, 4/2 heads, MLP 704, vocab 8192 ({:.1} M parameters); Model::new {:.1} ms; {} threads; CPU path {} (ARES_CPU_ISA; the CPU has {})",
        w.tensors().iter().map(|(_, t)| t.data.len()).sum::<usize>() as f64 / 1e6,
        start.elapsed().as_secs_f64() * 1e3,
        rayon::current_num_threads(),
        ares_cpu::Isa::active(),
        ares_cpu::Isa::detected(),
    );
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let runs = env_usize("ARES_BENCH_RUNS", 5);

    if only.as_deref().is_none_or(|o| o.starts_with("train")) {
        let train = TrainBatch::random(&mut rng, TRAIN_BATCH, TRAIN_SEQ, 8192);
        let (n, inputs) = (train.tokens(), train.inputs());
        let (targets, coeffs) = (&train.targets, &train.coeffs);
        let be = CpuBackend;
        // `train-bf16`: the bf16 step alone
        let mut t_train = None;
        if only.as_deref() != Some("train-bf16") {
            let mut acts = model
                .activations(TRAIN_BATCH, TRAIN_SEQ)
                .expect("activations");
            let mut grads = model.grads().expect("grads");
            let t = best_and_median(runs, || {
                grads.zero(&be).expect("zero");
                model.forward(&inputs, &mut acts).expect("forward");
                model
                    .backward_from_log_prob_grads(
                        &inputs, &mut acts, targets, coeffs, 1.0, &mut grads,
                    )
                    .expect("backward");
            });
            report("train forward+backward (8 × 256)", n, "tokens", t);
            let t_f32 = t;
            t_train = Some(t);
            let t = best_and_median(runs, || {
                model.forward(&inputs, &mut acts).expect("forward");
            });
            report("  of which forward", n, "tokens", t);
            // activation checkpointing: one layer's activations kept, recomputed in the backward
            model.set_gradient_checkpointing(true);
            let mut ckpt = model
                .activations(TRAIN_BATCH, TRAIN_SEQ)
                .expect("activations");
            let tc = best_and_median(runs, || {
                grads.zero(&be).expect("zero");
                model.forward(&inputs, &mut ckpt).expect("forward");
                model
                    .backward_from_log_prob_grads(
                        &inputs, &mut ckpt, targets, coeffs, 1.0, &mut grads,
                    )
                    .expect("backward");
            });
            model.set_gradient_checkpointing(false);
            report("train forward+backward, checkpointed", n, "tokens", tc);
            // the layers' activations per token (f32): ln1, q, k, v, att, lse, att_proj,
            // resid_mid, ln2, gate, up, act, mlp_out, resid_out and two rstd
            let (c, i, qd, kvd, hq) = (256usize, 704usize, 256usize, 128usize, 4usize);
            let per_layer = 6 * c + 2 + 2 * qd + 2 * kvd + hq + 3 * i;
            let layers = 4usize;
            let mib = |floats: usize| (floats * n * 4) as f64 / (1 << 20) as f64;
            println!(
                "  layer activations: stored {:.1} MiB, checkpointed {:.1} MiB; time ratio checkpointed / stored {:.2}",
                mib(layers * per_layer),
                mib(per_layer + (layers - 1) * c),
                tc.0.as_secs_f64() / t_f32.0.as_secs_f64(),
            );
            let mut opt = AdamW::new(&model, AdamWConfig::default()).expect("adamw");
            let t = best_and_median(runs, || {
                opt.step(&mut model, &grads, 1e-6, Some(1.0)).expect("step");
            });
            report("AdamW step (clip + update)", 1, "steps", t);

            // LoRA r = 16 on every linear layer (PEFT's all-linear), the base frozen: the
            // same step on a second copy of the model, its pairs' gradients only
            let mut lora_model =
                Model::new(CpuBackend, &config, &w).expect("the bench model builds");
            let lora = LoraConfig::all_linear(16, 32.0);
            lora_model.add_lora(&lora, 1).expect("adapters");
            let mut acts = lora_model
                .activations(TRAIN_BATCH, TRAIN_SEQ)
                .expect("activations");
            let mut grads = lora_model.grads().expect("grads");
            let t = best_and_median(runs, || {
                grads.zero(&be).expect("zero");
                lora_model.forward(&inputs, &mut acts).expect("forward");
                lora_model
                    .backward_from_log_prob_grads(
                        &inputs, &mut acts, targets, coeffs, 1.0, &mut grads,
                    )
                    .expect("backward");
            });
            report(
                "train forward+backward, LoRA r=16 all-linear",
                n,
                "tokens",
                t,
            );
            println!(
                "  time ratio LoRA / full {:.2}",
                t.0.as_secs_f64() / t_f32.0.as_secs_f64()
            );
            let mut opt = AdamW::new(&lora_model, AdamWConfig::default()).expect("adamw");
            let t = best_and_median(runs, || {
                opt.step(&mut lora_model, &grads, 1e-6, Some(1.0))
                    .expect("step");
            });
            report("AdamW step, LoRA pairs", 1, "steps", t);
        }

        // bf16 storage (issue 26's CPU goal): the linear weights stored in bf16 (no f32
        // master), every product of at least BF16_MIN_ROWS rows in bf16 with f32 sums —
        // the LM head and the attention too; the same step on a third copy of the model
        let mut bf16_model = Model::new(CpuBackend, &config, &w).expect("the bench model builds");
        bf16_model.set_matmul_precision(MatmulPrecision::Bf16);
        bf16_model
            .set_weight_storage(WeightStorage::Bf16)
            .expect("bf16 weights");
        // with f32 gradients, then with the linear layers' gradients in bf16 too, then with
        // the MLP's activations in bf16 as well
        let mut t_f32_grads = None;
        for (dtype, act) in [
            (GradDtype::F32, ActivationDtype::F32),
            (GradDtype::Bf16, ActivationDtype::F32),
            (GradDtype::Bf16, ActivationDtype::Bf16),
        ] {
            bf16_model.set_activation_dtype(act);
            let mut acts = bf16_model
                .activations(TRAIN_BATCH, TRAIN_SEQ)
                .expect("activations");
            let mut grads = bf16_model.grads_in(dtype).expect("grads");
            let t = best_and_median(runs, || {
                grads.zero(&be).expect("zero");
                bf16_model.forward(&inputs, &mut acts).expect("forward");
                bf16_model
                    .backward_from_log_prob_grads(
                        &inputs, &mut acts, targets, coeffs, 1.0, &mut grads,
                    )
                    .expect("backward");
            });
            let what = format!(
                "train forward+backward, bf16 weights and products, {} gradients, {} MLP \
                 activations ({:.1} MiB arena)",
                dtype.name(),
                act.name(),
                acts.elements().bytes() as f64 / (1u64 << 20) as f64
            );
            report(&what, n, "tokens", t);
            if let Some(t_f32) = t_train {
                println!(
                    "  time ratio bf16 / f32 {:.2}",
                    t.0.as_secs_f64() / t_f32.0.as_secs_f64()
                );
            }
            match t_f32_grads {
                None => t_f32_grads = Some(t),
                Some(t32) => println!(
                    "  time ratio to the f32 gradients' and activations' step {:.2}",
                    t.0.as_secs_f64() / t32.0.as_secs_f64()
                ),
            }
        }
    }

    if only.as_deref().is_none_or(|o| o == "ragged") {
        ragged(&mut model, &mut rng, runs, 8192, || ());
    }

    if only.as_deref().is_none_or(|o| o == "rollout") {
        let (groups, n, len, new) = (4usize, 8usize, 100usize, 32usize);
        let base: Vec<Vec<u32>> = (0..groups)
            .map(|_| (0..len).map(|_| (rng.next_u64() % 8192) as u32).collect())
            .collect();
        let shared: Vec<Vec<u32>> = base
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), n))
            .collect();
        let distinct: Vec<Vec<u32>> = shared
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut p = p.clone();
                p[0] = (i % 8192) as u32;
                p
            })
            .collect();
        let sampling = Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        };
        let time = |prompts: Vec<Vec<u32>>, what: &str| {
            let request = GenerateRequest {
                prompts,
                max_new_tokens: new,
                eos_ids: Vec::new(),
                sampling,
                seed: 1,
            };
            let generator = model.generator().expect("generator");
            let t = best_and_median(runs.min(3), || {
                let out = generator.generate(&request).expect("generate");
                assert!(out.tokens.iter().all(|t| t.len() == new));
            });
            report(what, groups * n * new, "tokens", t);
            t.0
        };
        let d = time(
            distinct,
            "rollout, copies distinct (4 × 8, prompts of 100, 32 new)",
        );
        let s = time(
            shared,
            "rollout, copies shared  (4 × 8, prompts of 100, 32 new)",
        );
        println!(
            "rollout speedup (shared / distinct): {:.2}",
            d.as_secs_f64() / s.as_secs_f64()
        );
    }

    if only.as_deref().is_none_or(|o| o == "generate") {
        let prompts: Vec<Vec<u32>> = (0..GEN_PROMPTS)
            .map(|_| {
                (0..GEN_PROMPT_LEN)
                    .map(|_| (rng.next_u64() % 8192) as u32)
                    .collect()
            })
            .collect();
        let request = GenerateRequest {
            prompts,
            max_new_tokens: GEN_NEW,
            eos_ids: Vec::new(),
            sampling: Sampling::Greedy,
            seed: 0,
        };
        let t = best_and_median(runs.min(3), || {
            let out = model.generate(&request).expect("generate");
            assert!(out.tokens.iter().all(|t| t.len() == GEN_NEW));
        });
        report(
            "generate greedy (16 × 128 new, prompts of 32)",
            GEN_PROMPTS * GEN_NEW,
            "tokens",
            t,
        );
    }
    // ARES_PROFILE=1: every op's calls and time over the whole run (all sections, all runs)
    use ares_model::backend::Backend;
    if let Some(table) = CpuBackend.op_profile().expect("op profile") {
        println!("{table}");
    }
}
