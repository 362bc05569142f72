//! The Qwen2-VL / Qwen2.5-VL runtime (`ares_model::vision::{checkpoint, tower, model}`) on the
//! CPU backend against transformers 5.24: the tiny random models of
//! `scripts/make_vl_fixtures.py` (`tests/fixtures/vl/`, README there), one in the Hub tensor
//! layout and one in transformers 5's. Checked per case (one image, two images of other
//! sizes, a video, text only): the window order, the tower's last hidden state and merged
//! tokens, the M-RoPE positions, the last-position logits (and every position's for `image`),
//! the gradients of `Σ logits · W` for every tower parameter and some of the language
//! model's, and the greedy continuation.

mod common;

use ares_model::backend::cpu::CpuBackend;
use ares_model::vision::checkpoint::{VlCheckpoint, WeightLayout};
use common::vl::{self, MODELS, dir};

#[test]
fn loads_both_layouts_with_every_tensor() {
    for model in MODELS {
        let ck = VlCheckpoint::load(&dir(model)).unwrap();
        // transformers 5.24's save_pretrained writes the Hub names for both families
        assert_eq!(ck.layout, WeightLayout::Hub, "{model}");
        let params: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir(model).join("params.json")).unwrap())
                .unwrap();
        let params = params.as_object().unwrap();
        let named = ck.named(ck.layout);
        assert_eq!(named.len(), params.len(), "{model}: tensor count");
        for (name, shape, data) in named {
            let p = &params[&name];
            let want: Vec<usize> = serde_json::from_value(p["shape"].clone()).unwrap();
            assert_eq!(shape, want, "{model} {name}");
            let sum: f64 = data.iter().map(|&x| f64::from(x)).sum();
            let want = p["sum"].as_f64().unwrap();
            assert!(
                (sum - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{model} {name}: {sum} vs {want}"
            );
        }
    }
}

#[test]
fn saves_and_reloads_in_both_layouts() {
    let tmp = std::env::temp_dir().join(format!("ares-vl-roundtrip-{}", std::process::id()));
    for model in MODELS {
        let ck = VlCheckpoint::load(&dir(model)).unwrap();
        for layout in [WeightLayout::Hub, WeightLayout::Nested] {
            let out = tmp.join(format!("{model}-{layout:?}"));
            ck.save(&out, ares_model::hf::tensor_files::SaveDtype::F32, layout)
                .unwrap();
            let back = VlCheckpoint::load(&out).unwrap();
            assert_eq!(back.layout, layout, "{model}");
            assert_eq!(back.text, ck.text, "{model} {layout:?}: language model");
            assert_eq!(back.vision, ck.vision, "{model} {layout:?}: vision tower");
            assert_eq!(back.config, ck.config, "{model} {layout:?}: config");
            if layout == WeightLayout::Nested {
                let files = ares_model::hf::tensor_files::TensorFiles::open(&out).unwrap();
                assert!(
                    files
                        .names()
                        .any(|n| n.starts_with("model.language_model.layers.0."))
                );
                assert!(
                    files
                        .names()
                        .any(|n| n.starts_with("model.visual.blocks.0."))
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn window_order_and_tower_match_transformers() {
    vl::window_order_and_tower_match_transformers(|| CpuBackend);
}

#[test]
fn positions_and_logits_match_transformers() {
    vl::positions_and_logits_match_transformers(|| CpuBackend);
}

#[test]
fn gradients_match_transformers_autograd() {
    vl::gradients_match_transformers_autograd(|| CpuBackend);
}

#[test]
fn greedy_generation_matches_transformers() {
    vl::greedy_generation_matches_transformers(|| CpuBackend);
}
