//! LoRA on the vision tower of Qwen2-VL / Qwen2.5-VL (`vision/lora.rs`) against peft 0.21.2
//! and transformers 5.24: adapters peft wrote (`scripts/make_lora_fixtures.py`,
//! `tests/fixtures/lora/qwen2_5_vl_all`: every linear layer but the LM head;
//! `qwen2_vl_tower`: the tower's qkv, attn.proj, fc1, merger mlp.0 and the patch
//! embedding's Conv3d, rsLoRA) give peft's logits with the adapter on and off, merge to
//! peft's weights, round-trip through PEFT files; the pairs' gradients are the full
//! model's gradient projected onto `B·A`, bit-identical under activation checkpointing;
//! training moves the pairs only.

mod common;

use std::path::Path;

use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::lora::{LoraAdapter, LoraConfig};
use ares_model::model::{AdamW, AdamWConfig, StateDtype};
use ares_model::vision::model::VlModel;
use common::lora_vl::{self, CASES, adapter, bits, logits, tower_grads};
use common::rel_err;
use common::vl::{case, grads_of_case, load};
use safetensors::SafeTensors;

#[test]
fn peft_tower_adapters_give_peft_logits_and_merged_weights() {
    lora_vl::peft_tower_adapters_give_peft_logits_and_merged_weights(|| CpuBackend);
}

#[test]
fn tower_pair_gradients_are_the_full_gradient_projected() {
    lora_vl::tower_pair_gradients_are_the_full_gradient_projected(|| CpuBackend);
}

#[test]
fn tower_adapters_round_trip_through_peft_files() {
    for (name, model) in CASES {
        let (ck, _) = load(model);
        let a = adapter(name, &ck);
        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        m.load_lora(&a).unwrap();
        let back = m.lora_adapter().unwrap().unwrap();
        assert_eq!(back, a, "{name}: downloaded adapter");
        let dir = tempfile::tempdir().unwrap();
        back.write(dir.path(), "base").unwrap();
        let again = LoraAdapter::read_vl(dir.path(), &ck.config.text, &ck.config.vision).unwrap();
        assert_eq!(again, a, "{name}: written and read back");
        // a text model's reader refuses the tower's pairs, naming one
        let err = LoraAdapter::read(dir.path(), &ck.config.text).unwrap_err();
        assert!(err.to_string().contains("vision tower"), "{err}");
    }
}

#[test]
fn training_moves_the_pairs_only() {
    let (ck, bytes) = load("qwen2_5_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cs = case(&st, "image");
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let base = logits(&m, &cs);
    m.add_lora(&LoraConfig::all_linear(4, 8.0), 7).unwrap();
    assert!(m.tower().has_lora());
    // fresh pairs (B = 0) change nothing
    assert_eq!(bits(&logits(&m, &cs)), bits(&base));
    let names: Vec<String> = m
        .tower()
        .trainable_names()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.contains(&"patch_embed.proj.lora_A.weight".to_string()));
    assert!(names.contains(&"blocks.#.attn.qkv.lora_B.weight".to_string()));
    assert!(names.contains(&"merger.mlp.2.lora_A.weight".to_string()));

    let be = CpuBackend;
    let grads = tower_grads(&m, &st);
    let nonzero = grads
        .iter()
        .filter(|(n, g)| n.contains("lora_B") && g.iter().any(|&x| x != 0.0))
        .count();
    assert_eq!(nonzero, grads.len() / 2, "every B gets a gradient");

    // one AdamW step over both parts' pairs: the base weights do not move
    let (lm_grads, vg) = grads_of_case(&m, &st, "image");
    assert!(vg.get(ares_model::vision::weights::Slot::Qkv).is_none());
    let mut opt = AdamW::new(m.lm(), AdamWConfig::default()).unwrap();
    let mut moments = m.vision_moments(StateDtype::Int8).unwrap();
    let report = m
        .optimizer_step(&mut opt, &lm_grads, Some((&mut moments, &vg)), 1e-3, None)
        .unwrap();
    assert!(report.applied);
    let after = m.to_checkpoint(&ck).unwrap();
    assert_eq!(after.vision, ck.vision, "tower weights frozen");
    assert_eq!(after.text, ck.text, "language model weights frozen");
    let moved = logits(&m, &cs);
    assert!(rel_err(&moved, &base) > 1e-6, "the pairs moved");
    {
        let _off = m.adapters_off();
        assert_eq!(bits(&logits(&m, &cs)), bits(&base), "reference = base");
    }

    // the tower's moments save and load exactly (the pairs' names)
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vision_optimizer.safetensors");
    moments.save(&be, m.tower(), &path).unwrap();
    let back =
        ares_model::vision::model::VisionMoments::load(&be, m.tower(), StateDtype::Int8, &path)
            .unwrap();
    let again = dir.path().join("again.safetensors");
    back.save(&be, m.tower(), &again).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&again).unwrap()
    );
    // a full fine-tuning tower cannot load the pairs' moments
    let plain = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let err =
        ares_model::vision::model::VisionMoments::load(&be, plain.tower(), StateDtype::Int8, &path)
            .err()
            .unwrap();
    assert!(err.to_string().contains("patch_embed.proj"), "{err}");
}

#[test]
fn tower_settings_are_checked() {
    let (ck, _) = load("qwen2_5_vl_tiny");
    // the language model only: exclude_modules names the tower
    let mut lm_only = LoraConfig::all_linear(2, 4.0);
    lm_only.exclude_modules = Some(".*visual.*".into());
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    m.add_lora(&lm_only, 1).unwrap();
    assert!(!m.tower().has_lora());
    let adapter = m.lora_adapter().unwrap().unwrap();
    assert!(adapter.pairs.keys().all(|k| k.starts_with("model.layers.")));

    // the tower only
    let tower_only = LoraConfig {
        target_modules: vec!["qkv".into(), "mlp.2".into()],
        ..LoraConfig::all_linear(2, 4.0)
    };
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    m.add_lora(&tower_only, 1).unwrap();
    assert!(m.tower().has_lora());
    let adapter = m.lora_adapter().unwrap().unwrap();
    assert_eq!(adapter.pairs.len(), ck.config.vision.depth + 1);

    // layers_to_transform with pairs on the tower: refused, naming the way out
    let mut layered = LoraConfig::all_linear(2, 4.0);
    layered.layers_to_transform = Some(vec![0]);
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let err = m.add_lora(&layered, 1).unwrap_err().to_string();
    assert!(err.contains("exclude_modules"), "{err}");

    // nothing selected
    let none = LoraConfig {
        target_modules: vec!["qkv".into()],
        exclude_modules: Some(".*visual.*".into()),
        ..LoraConfig::all_linear(2, 4.0)
    };
    let err = m.add_lora(&none, 1).unwrap_err().to_string();
    assert!(err.contains("selects no linear layer"), "{err}");

    // a text model: tower names alone select nothing of its decoder
    let text = ares_model::hf::checkpoint::Checkpoint::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2_tiny"),
    )
    .unwrap();
    let mut lm = ares_model::model::Model::from_checkpoint(CpuBackend, &text).unwrap();
    let err = lm
        .add_lora(
            &LoraConfig {
                target_modules: vec!["fc1".into()],
                ..LoraConfig::all_linear(2, 4.0)
            },
            1,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("selects no linear layer of the decoder"),
        "{err}"
    );
    // all-linear on a text model is its decoder's seven
    lm.add_lora(&LoraConfig::all_linear(2, 4.0), 1).unwrap();
    let adapter = lm.lora_adapter().unwrap().unwrap();
    assert_eq!(adapter.pairs.len(), 7 * text.config.num_hidden_layers);
}

/// The tower's LoRA intermediates take what `tower_lora_elements` says (the figure a memory
/// plan counts), stored or checkpointed.
#[test]
fn tower_lora_arena_is_what_the_plan_counts() {
    use ares_model::vision::lora::tower_lora_elements;
    use ares_model::vision::tower::VisionPlan;
    let (ck, bytes) = load("qwen2_5_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cs = case(&st, "image");
    let cfg = &ck.config.vision;
    let plan = VisionPlan::new(cfg, &cs.vision.image_grids).unwrap();
    let config = LoraConfig::all_linear(3, 6.0);
    let be = CpuBackend;
    for checkpointed in [false, true] {
        let mut plain = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        plain.tower_mut().set_gradient_checkpointing(checkpointed);
        let base = plain.tower().activations(&be, plan.clone(), true).unwrap();
        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        m.tower_mut().set_gradient_checkpointing(checkpointed);
        m.add_lora(&config, 1).unwrap();
        let with = m.tower().activations(&be, plan.clone(), true).unwrap();
        let blocks = if checkpointed { 1 } else { cfg.depth as u64 };
        let want =
            tower_lora_elements(cfg, &config, plan.patches as u64, plan.units as u64, blocks);
        assert_eq!(
            ((with.bytes() - base.bytes()) / 4) as u64,
            want,
            "checkpointed {checkpointed}"
        );
    }
}
