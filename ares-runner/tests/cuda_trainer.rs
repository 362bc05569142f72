//! The trainer on the GPU against the CPU (the backend's ops are tested one by one in
//! `ares-model/tests/cuda_backend.rs`). Needs a GPU: without one the test is skipped with
//! a message, unless `ARES_REQUIRE_GPU=1` (set by `scripts/gpu-bundle.sh`'s runner).

#![cfg(feature = "cuda")]

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::backend::cuda::CudaBackend;

fn gpu_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(be) => {
            eprintln!("GPU: {}", be.info());
            Some(be)
        }
        Err(e) => {
            let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_GPU=1 but no usable GPU: {e}");
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

/// The demo's task with a tiny random model (hidden 64, 2 layers) in `dir`.
fn tiny_assets(dir: &std::path::Path) -> ares_runner::demo::DemoAssets {
    use ares_runner::demo::model::TinyModelSpec;
    use ares_runner::demo::{DemoOptions, write_demo_assets_with};
    write_demo_assets_with(
        dir,
        &DemoOptions {
            seed: 5,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                intermediate: 128,
                ..TinyModelSpec::default()
            },
            ..DemoOptions::default()
        },
    )
    .unwrap()
}

/// The trainer's whole loop on the GPU: 2 ARES steps (bootstrap, filtering off) of the
/// demo's task on a tiny random model give the same metrics as on the CPU. Sampling happens
/// on the host from downloaded logits with the same seeds, so the rollouts are identical
/// unless a logit difference of ~1e-6 moves a draw across a token boundary (not seen in
/// practice); losses, KL and gradient norms then agree to f32 reduction-order noise.
#[test]
fn trainer_steps_on_the_gpu_match_the_cpu() {
    gpu_steps_match_cpu("");
}

/// [`trainer_steps_on_the_gpu_match_the_cpu`] with LoRA pairs on every linear layer (the
/// base frozen, the reference the base with the adapters off).
#[test]
fn lora_trainer_steps_on_the_gpu_match_the_cpu() {
    gpu_steps_match_cpu(", model: {lora: {rank: 4, alpha: 8}}, optim: {lr: 1.0e-3}");
}

/// Two steps of a tiny run on the GPU and on the CPU, `actor` appended to the
/// `worker.actor` flow map, both in f32 (given: bf16 is CUDA's default).
fn gpu_steps_match_cpu(actor: &str) {
    use ares_runner::config::Config;
    use ares_runner::metrics::read_metrics;
    use ares_runner::trainer::Trainer;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    let Some(gpu) = gpu_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let a = tiny_assets(&dir.path().join("assets"));
    let run = |name: &str, device: &str| -> Vec<serde_json::Map<String, serde_json::Value>> {
        let yaml = format!(
            "data: {{train_files: {}, max_response_length: 16, rollout_batch_size: 2, bootstrap: true}}\n\
             algorithm: {{online_filtering: false}}\n\
             worker: {{actor: {{model_path: {}, global_batch_size: 2, micro_batch_size_per_device_for_update: 4{actor}}}, rollout: {{n: 4}}}}\n\
             trainer: {{save_checkpoint_path: {}, max_steps: 2, device: {device}, precision: f32}}\n",
            a.train.display(),
            a.model_dir.display(),
            dir.path().join(name).display()
        );
        let cfg = Config::from_yaml_str(&yaml, name).unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let summary = if device == "cuda" {
            Trainer::new(cfg, gpu.clone(), flag).unwrap().run().unwrap()
        } else {
            Trainer::new(cfg, CpuBackend, flag).unwrap().run().unwrap()
        };
        read_metrics(&summary.metrics).unwrap()
    };
    let cpu = run("cpu", "cpu");
    let gpu_lines = run("gpu", "cuda");
    for (c, g) in cpu.iter().zip(&gpu_lines) {
        // token-level results: exact (same sampled tokens)
        for key in ["accuracy/mean", "response_length/mean"] {
            assert_eq!(c[key], g[key], "{key}");
        }
        for key in [
            "reward/mean",
            "kl/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "tau",
            "advantage/std",
        ] {
            let (x, y) = (c[key].as_f64().unwrap(), g[key].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-3 * x.abs().max(1e-2),
                "{key}: cpu {x} gpu {y}"
            );
        }
    }
}

/// Data parallelism on the GPU: two ranks (threads, each with its own backend on GPU 0,
/// the second with ZeRO-1) against one. The CPU's tests hold the world size to the bit
/// (`tests/data_parallel.rs`); here the decode batches' makeup differs between the worlds
/// and cuBLAS may pick other kernels for other batch sizes, so the ranks must agree with
/// one rank as the GPU agrees with the CPU: the same tokens, losses to f32 noise.
#[test]
fn data_parallel_ranks_on_the_gpu_match_one_rank() {
    use ares_runner::config::Config;
    use ares_runner::metrics::read_metrics;
    use ares_runner::parallel::Ranks;
    use ares_runner::parallel::threads::ThreadGroup;
    use ares_runner::trainer::Trainer;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    if gpu_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = tiny_assets(&dir.path().join("assets"));
    let run = |world: usize, zero: u8, precision: &str| {
        let name = format!("world{world}-{precision}");
        let yaml = format!(
            "data: {{train_files: {}, max_response_length: 16, rollout_batch_size: 4, bootstrap: true}}\n\
             algorithm: {{online_filtering: false}}\n\
             worker: {{actor: {{model_path: {}, global_batch_size: 2, micro_batch_size_per_device_for_update: 2}}, rollout: {{n: 4}}}}\n\
             trainer: {{save_checkpoint_path: {}, max_steps: 2, device: cuda, precision: {precision}, zero_stage: {zero}}}\n",
            a.train.display(),
            a.model_dir.display(),
            dir.path().join(&name).display()
        );
        let cfg = Config::from_yaml_str(&yaml, &name).unwrap();
        let ranks = ThreadGroup::ranks(world, std::time::Duration::from_secs(300));
        let mut summaries: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|rank| {
                    let cfg = cfg.clone();
                    s.spawn(move || {
                        let gpu = CudaBackend::new(0).unwrap();
                        let flag = Arc::new(AtomicBool::new(false));
                        let mut t = Trainer::new(cfg, gpu, flag).unwrap();
                        t.settings.rollout_chunk = 4;
                        t.join(Ranks::new(Arc::new(rank))).unwrap();
                        t.run().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        read_metrics(&summaries.remove(0).metrics).unwrap()
    };
    // f32, and bf16 (the weights, gradients and MLP activations in bf16: the ranks' sums
    // of bf16 gradients through the host)
    for precision in ["f32", "bf16"] {
        let one = run(1, 0, precision);
        let two = run(2, 1, precision);
        let exact = close_metrics(&one, &two);
        eprintln!(
            "{precision}: two ranks equal one rank {}",
            if exact { "to the bit" } else { "to f32 noise" }
        );
    }
}

/// Whether the metrics of `one` and `two` agree exactly (the tokens must, the losses to f32
/// noise: asserted).
fn close_metrics(
    one: &[serde_json::Map<String, serde_json::Value>],
    two: &[serde_json::Map<String, serde_json::Value>],
) -> bool {
    let mut exact = true;
    for (x, y) in one.iter().zip(two) {
        for key in ["accuracy/mean", "response_length/mean"] {
            assert_eq!(x[key], y[key], "{key}");
        }
        for key in [
            "reward/mean",
            "kl/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "tau",
        ] {
            let (p, q) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            exact &= p == q;
            assert!(
                (p - q).abs() <= 1e-3 * p.abs().max(1e-2),
                "{key}: one rank {p}, two ranks {q}"
            );
        }
    }
    exact
}
