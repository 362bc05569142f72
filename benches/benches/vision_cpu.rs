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
    let tower = VisionTower::new(&be, &cfg, &weights).expect("the bench tower builds");
    let grids = [[1, 32, 32]];
    let plan = VisionPlan::new(&cfg, &grids).expect("plan");
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
            .backward(&be, &train, View::whole(&dout), &mut grads)
            .expect("backward");
    });
    report("vision forward+backward", plan.patches, "patches", t);
}
