//! The Qwen2.5-VL vision tower on the CPU backend beside transformers
//! (`scripts/bench_torch_vision.py`, same shapes and work): Qwen2.5-VL-3B's tower (hidden
//! 1280, 16 heads of 80, SwiGLU 3420, window 112 px, merger to 2048) on one 448 × 448 image
//! (32 × 32 patches of 14 px, 1024 patches, 256 merged tokens), random weights.
//!
//! - **forward**: the tower alone, activations for inference (one block kept), as in a
//!   multimodal prefill.
//! - **forward+backward**: the forward keeping every block, then the backward from a fixed
//!   ∂L/∂merged into zeroed gradients (the unfrozen tower of a training step).
//!
//! - **rollout** (`vision_cpu rollout`): a small Qwen2.5-VL-shaped model (tower 4 × 128,
//!   LM 2 × 128, vocab 512) generating n = 8 samples of 32 new tokens for one 224 × 224 image
//!   prompt, with the tower output and the prompt's prefill shared by the 8 samples (the
//!   default) and both recomputed for each: new tokens/s of both, side by side.
//!
//! `ARES_BENCH_VISION_DTYPE`: `f32` (the default), `bf16` (products in bf16 over linear
//! weights stored in bf16, f32 activations) or `bf16-acts` (and the activations the tower
//! can keep in bf16 stored so: `tower_act_layout`) — the arena's size and the time of each.
//!
//! The real tower has 32 blocks with full attention in 7, 15, 23, 31; the default here is
//! `ARES_BENCH_VISION_DEPTH=4` blocks with full attention in block 3 (the same 3:1 mix of
//! window and full attention; the time per block is what scales). Set it to 32 for the
//! whole tower. `cargo bench -p ares-benches --bench vision_cpu`; threads: rayon's default,
//! set `RAYON_NUM_THREADS=1` against `--threads 1` of the PyTorch script.

use std::time::Instant;

use ares_benches::SplitMix;
use ares_benches::model::{best_and_median, env_usize, report};
use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, View, ViewMut};
use ares_model::vision::config::{VisionConfig, VisionMlp, VlKind};
use ares_model::vision::tower::{VisionPlan, VisionTower};
use ares_model::vision::weights::VisionWeights;

fn main() {
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    if only.as_deref() == Some("rollout") {
        return rollout();
    }
    let depth = env_usize("ARES_BENCH_VISION_DEPTH", 4);
    let runs = env_usize("ARES_BENCH_RUNS", 3);
    let cfg = VisionConfig {
        kind: VlKind::Qwen25Vl,
        depth,
        hidden: 1280,
        heads: 16,
        head_dim: 80,
        intermediate: 3420,
        mlp: VisionMlp::SwiGlu,
        out_hidden: 2048,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        in_channels: 3,
        window_size: 112,
        fullatt_block_indexes: (0..depth).filter(|l| l % 4 == 3).collect(),
        tokens_per_second: 2.0,
        rope_theta: 10_000.0,
    };
    let be = CpuBackend;
    let weights = VisionWeights::random(&cfg, 0.02, 11);
    let mut tower = VisionTower::new(&be, &cfg, &weights).expect("the bench tower builds");
    let grids = [[1, 32, 32]];
    let plan = VisionPlan::new(&cfg, &grids).expect("plan");
    let dtype = std::env::var("ARES_BENCH_VISION_DTYPE").unwrap_or_else(|_| "f32".into());
    if dtype != "f32" {
        use ares_model::backend::MatmulPrecision;
        use ares_model::model::{ActivationDtype, WeightStorage};
        let acts = match dtype.as_str() {
            "bf16" => ActivationDtype::F32,
            "bf16-acts" => ActivationDtype::Bf16,
            other => panic!("ARES_BENCH_VISION_DTYPE = {other}: expected f32, bf16 or bf16-acts"),
        };
        tower.set_matmul_precision(MatmulPrecision::Bf16);
        tower
            .set_weight_storage(&be, WeightStorage::Bf16)
            .expect("bf16 weights");
        tower.set_activation_dtype(acts);
    }
    println!(
        "{dtype}: activations stored as {:?}",
        tower.act_layout(plan.patches)
    );
    let mut rng = SplitMix::new(5);
    let pixels: Vec<f32> = (0..plan.patches * cfg.patch_dim())
        .map(|_| rng.unit() * 2.0 - 1.0)
        .collect();
    println!(
        "Qwen2.5-VL-3B vision tower: {depth} blocks (full attention in {:?}), 448 × 448 image = {} patches, {} merged tokens; {} threads",
        cfg.fullatt_block_indexes,
        plan.patches,
        plan.units,
        rayon::current_num_threads()
    );

    let mut infer = tower.activations(&be, plan.clone(), false).expect("arena");
    println!(
        "activation memory: inference {:.1} MiB",
        infer.bytes() as f64 / (1 << 20) as f64
    );
    let t = best_and_median(runs, || {
        tower.forward(&be, &pixels, &mut infer).expect("forward");
    });
    report("vision forward", plan.patches, "patches", t);

    let start = Instant::now();
    let mut train = tower.activations(&be, plan.clone(), true).expect("arena");
    println!(
        "activation memory: training {:.1} MiB (arena planned in {:.1} ms)",
        train.bytes() as f64 / (1 << 20) as f64,
        start.elapsed().as_secs_f64() * 1e3
    );
    let dout_host: Vec<f32> = (0..plan.units * cfg.out_hidden)
        .map(|_| rng.unit() - 0.5)
        .collect();
    let mut dout = be.alloc(dout_host.len()).expect("alloc");
    be.upload(&dout_host, ViewMut::whole(&mut dout))
        .expect("upload");
    let mut grads = tower.zero_grads(&be).expect("grads");
    let t = best_and_median(runs, || {
        tower.forward(&be, &pixels, &mut train).expect("forward");
        tower
            .backward(&be, &mut train, View::whole(&dout), &mut grads)
            .expect("backward");
    });
    report("vision forward+backward", plan.patches, "patches", t);
}

/// A small Qwen2.5-VL-shaped `config.json` (Hub layout).
const SMALL_VL: &str = r#"{
    "model_type": "qwen2_5_vl", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "tie_word_embeddings": false, "image_token_id": 500, "video_token_id": 501,
    "vision_start_token_id": 502, "vision_end_token_id": 503,
    "vision_config": {"depth": 4, "hidden_size": 128, "num_heads": 4, "intermediate_size": 256,
        "out_hidden_size": 128, "fullatt_block_indexes": [3], "window_size": 112,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
}"#;

fn rollout() {
    use ares_model::hf::weights::ModelWeights;
    use ares_model::model::{GenerateRequest, Sampling};
    use ares_model::vision::checkpoint::{VlCheckpoint, WeightLayout};
    use ares_model::vision::config::VlConfig;
    use ares_model::vision::model::{VisionBatch, VlModel};

    let raw: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(SMALL_VL).expect("bench config JSON");
    let config =
        VlConfig::from_map(std::path::Path::new("bench/config.json"), raw).expect("bench config");
    let mut rng = SplitMix::new(9);
    let text: ModelWeights = ares_benches::model::random_weights(&config.text, &mut rng);
    let ck = VlCheckpoint {
        vision: VisionWeights::random(&config.vision, 0.02, 3),
        config,
        generation: None,
        text,
        layout: WeightLayout::Hub,
    };
    let model = VlModel::from_checkpoint(CpuBackend, &ck).expect("bench model");
    let (n, new_tokens) = (8usize, 32usize);
    let grid = [1usize, 16, 16];
    let patches = grid.iter().product::<usize>();
    let units = patches / 4;
    let pixels: Vec<f32> = (0..patches * ck.config.vision.patch_dim())
        .map(|_| rng.unit() * 2.0 - 1.0)
        .collect();
    let vision = VisionBatch {
        image_pixels: pixels,
        image_grids: vec![grid],
        ..VisionBatch::default()
    };
    // <|vision_start|> 64 × <|image_pad|> <|vision_end|> then 40 text tokens
    let mut prompt = vec![502u32];
    prompt.extend(std::iter::repeat_n(500u32, units));
    prompt.push(503);
    prompt.extend((0..40).map(|i| (i * 7 % 400) as u32 + 10));
    let request = GenerateRequest {
        prompts: vec![prompt; n],
        max_new_tokens: new_tokens,
        eos_ids: Vec::new(),
        sampling: Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        },
        seed: 1,
    };
    let visions = vec![vision; n];
    let runs = env_usize("ARES_BENCH_RUNS", 5);
    println!(
        "rollout: n = {n} samples × {new_tokens} new tokens of one 224 × 224 image prompt ({} tokens, {units} image tokens), tower 4 × 128, LM 2 × 128; {} threads",
        request.prompts[0].len(),
        rayon::current_num_threads()
    );
    let shared = model.generator().expect("generator");
    let t = best_and_median(runs, || {
        shared
            .generate(&request, &visions, |_, _| {})
            .expect("generate");
    });
    report(
        "rollout, tower and prefill shared by the n samples",
        n * new_tokens,
        "tokens",
        t,
    );
    let each = model
        .generator()
        .expect("generator")
        .without_tower_sharing();
    let t = best_and_median(runs, || {
        each.generate(&request, &visions, |_, _| {})
            .expect("generate");
    });
    report(
        "rollout, tower and prefill run per sample",
        n * new_tokens,
        "tokens",
        t,
    );
}
