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
