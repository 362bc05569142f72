//! The Qwen2-VL / Qwen2.5-VL runtime on the CUDA backend against transformers 5.24: the same
//! checks as `tests/vision_model.rs` (tower, positions, logits, gradients, greedy
//! generation on the tiny fixtures), through `VlModel<CudaBackend>`.
//!
//! Needs a GPU: without one every test is skipped with a message, unless
//! `ARES_REQUIRE_GPU=1` (set by the GPU bundle's runner), which makes the skip a failure.
#![cfg(feature = "cuda")]

mod common;

use ares_model::backend::cuda::CudaBackend;
use common::{lora_vl, vl};

fn gpu_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(be) => Some(be),
        Err(e) => {
            let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_GPU=1 but no usable GPU: {e}");
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

#[test]
fn window_order_and_tower_match_transformers() {
    if let Some(be) = gpu_or_skip() {
        vl::window_order_and_tower_match_transformers(|| be.clone());
    }
}

#[test]
fn positions_and_logits_match_transformers() {
    if let Some(be) = gpu_or_skip() {
        vl::positions_and_logits_match_transformers(|| be.clone());
    }
}

#[test]
fn gradients_match_transformers_autograd() {
    if let Some(be) = gpu_or_skip() {
        vl::gradients_match_transformers_autograd(|| be.clone());
    }
}

#[test]
fn checkpointed_gradients_are_the_stored_ones() {
    if let Some(be) = gpu_or_skip() {
        vl::checkpointed_gradients_are_the_stored_ones(|| be.clone());
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    if let Some(be) = gpu_or_skip() {
        vl::greedy_generation_matches_transformers(|| be.clone());
    }
}

#[test]
fn vision_turns_continued_over_kept_blocks_equal_the_whole_conversation() {
    if let Some(be) = gpu_or_skip() {
        vl::continued_turns_equal_the_whole_conversation(|| be.clone());
    }
}

#[test]
fn peft_tower_adapters_give_peft_logits_and_merged_weights() {
    if let Some(be) = gpu_or_skip() {
        lora_vl::peft_tower_adapters_give_peft_logits_and_merged_weights(|| be.clone());
    }
}

#[test]
fn tower_pair_gradients_are_the_full_gradient_projected() {
    if let Some(be) = gpu_or_skip() {
        lora_vl::tower_pair_gradients_are_the_full_gradient_projected(|| be.clone());
    }
}

/// The tower's linear weights stored in bf16 on the GPU (`VisionTower::set_weight_storage`,
/// cuBLAS on the bf16 bits) against the CPU's stored tower: a forward and backward of the
/// tiny Qwen2.5-VL fixture's tower in bf16 at 256 patches, output and gradients within
/// bf16 rounding of each other (the sums' order differs), with the gradients stored in bf16
/// over two passes.
#[test]
fn tower_weights_stored_in_bf16_match_the_cpu() {
    use ares_model::backend::cpu::CpuBackend;
    use ares_model::backend::{Backend, MatmulPrecision};
    use ares_model::model::WeightStorage;
    use ares_model::vision::checkpoint::VlCheckpoint;
    use ares_model::vision::tower::{VisionPlan, VisionTower};
    let Some(gpu) = gpu_or_skip() else { return };
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vl/qwen2_5_vl_tiny");
    let ck = VlCheckpoint::load(&dir).unwrap();
    let plan = VisionPlan::new(&ck.config.vision, &[[1, 16, 16]]).unwrap();
    // gradients in bf16 too (the linear layers' folded with stochastic rounding), over two
    // passes; the MLP block's activations in f32, then in bf16 (read as stored)
    fn run<B: Backend>(
        be: &B,
        ck: &VlCheckpoint,
        plan: &VisionPlan,
        activations: ares_model::model::ActivationDtype,
    ) -> (Vec<f32>, Vec<(bool, Vec<f32>)>) {
        use ares_model::model::GradDtype;
        let mut tower = VisionTower::new(be, &ck.config.vision, &ck.vision).unwrap();
        tower.set_matmul_precision(MatmulPrecision::Bf16);
        tower.set_weight_storage(be, WeightStorage::Bf16).unwrap();
        tower.set_activation_dtype(activations);
        common::tower_passes(be, &tower, plan, GradDtype::Bf16, 2)
    }
    use ares_model::model::ActivationDtype;
    for activations in [ActivationDtype::F32, ActivationDtype::Bf16] {
        let (want, want_g) = run(&CpuBackend, &ck, &plan, activations);
        let (got, got_g) = run(&gpu, &ck, &plan, activations);
        let err = common::rel_err(&got, &want);
        assert!(err < 1e-2, "tower output ({activations:?}): {err:e}");
        for (i, ((bf16, a), (was, b))) in got_g.iter().zip(&want_g).enumerate() {
            assert_eq!(bf16, was, "gradient {i}: the same dtype");
            let err = common::rel_err(a, b);
            assert!(err < 3e-2, "gradient {i} ({activations:?}): {err:e}");
        }
    }
}

/// A tower at Qwen2.5-VL's head size (80) on the GPU against the CPU, bf16 weights,
/// products, gradients and activations: 256 patches in windows of 64 and one
/// full-attention block, so both blocks keep their activations in bf16 — the MLP block's
/// and the attention block's (the segment tensor-core kernels reading q, k, v as stored
/// and storing their output rounded) — forward and backward over two passes, within bf16
/// rounding of each other (the sums' order differs); checkpointed, the same bits as kept.
#[test]
fn tower_in_bf16_at_head_size_80_matches_the_cpu() {
    use ares_model::backend::cpu::CpuBackend;
    use ares_model::backend::{Backend, MatmulPrecision};
    use ares_model::model::{ActivationDtype, GradDtype, WeightStorage};
    use ares_model::vision::config::VisionConfig;
    use ares_model::vision::tower::{TowerActLayout, VisionPlan, VisionTower};
    use ares_model::vision::weights::VisionWeights;
    let Some(gpu) = gpu_or_skip() else { return };
    let cfg = common::tower_at_head(80);
    let weights = VisionWeights::random(&cfg, 0.1, 12);
    let plan = VisionPlan::new(&cfg, &[[1, 16, 16]]).unwrap();
    fn run<B: Backend>(
        be: &B,
        cfg: &VisionConfig,
        weights: &VisionWeights,
        plan: &VisionPlan,
        checkpointed: bool,
    ) -> (Vec<f32>, Vec<(bool, Vec<f32>)>) {
        let mut tower = VisionTower::new(be, cfg, weights).unwrap();
        tower.set_matmul_precision(MatmulPrecision::Bf16);
        tower.set_weight_storage(be, WeightStorage::Bf16).unwrap();
        tower.set_activation_dtype(ActivationDtype::Bf16);
        tower.set_gradient_checkpointing(checkpointed);
        let both = TowerActLayout {
            mlp: true,
            attention: true,
        };
        assert_eq!(tower.act_layout(plan.patches), both);
        common::tower_passes(be, &tower, plan, GradDtype::Bf16, 2)
    }
    let (want, want_g) = run(&CpuBackend, &cfg, &weights, &plan, false);
    let (got, got_g) = run(&gpu, &cfg, &weights, &plan, false);
    let err = common::rel_err(&got, &want);
    assert!(err < 1e-2, "tower output: {err:e}");
    for (i, ((bf16, a), (was, b))) in got_g.iter().zip(&want_g).enumerate() {
        assert_eq!(bf16, was, "gradient {i}: the same dtype");
        let err = common::rel_err(a, b);
        assert!(err < 3e-2, "gradient {i}: {err:e}");
    }
    let (ck, ck_g) = run(&gpu, &cfg, &weights, &plan, true);
    assert_eq!(ck, got, "checkpointed output");
    assert_eq!(ck_g, got_g, "checkpointed gradients");
}
