//! `ares-runner merge`: a PEFT adapter (made by peft, `scripts/make_lora_fixtures.py`) merged
//! into its base model and written as a checkpoint that loads with peft's merged weight.

use std::path::{Path, PathBuf};

use ares_runner::commands::merge::merge;
use ares_runner::hf::checkpoint::Checkpoint;
use ares_runner::hf::tensor_files::SaveDtype;
use safetensors::SafeTensors;

fn model_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures")
}

#[test]
fn merge_writes_peft_merged_weights() {
    let base = model_fixtures().join("models/qwen2_tiny");
    let adapter = model_fixtures().join("lora/qwen2_all");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("merged");
    let report = merge(&base, &adapter, &out, SaveDtype::F32).unwrap();
    assert_eq!((report.merged, report.rank, report.scale), (14, 4, 2.0));
    let merged = Checkpoint::load(&out).unwrap();
    let q = "model.layers.1.self_attn.q_proj.weight";
    let got = merged
        .weights
        .tensors()
        .into_iter()
        .find(|(n, _)| n == q)
        .unwrap()
        .1
        .data
        .clone();
    let bytes = std::fs::read(adapter.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor(&format!("merged.{q}"))
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 1e-6, "merged {q} off by {worst:e}");
    assert!(out.join("generation_config.json").exists());

    // never over an input or a non-empty directory
    let e = merge(&base, &adapter, &base, SaveDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("input directory"), "{e}");
    let e = merge(&base, &adapter, &out, SaveDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not empty"), "{e}");
    // an adapter that is not there
    let e = merge(
        &base,
        &dir.path().join("nope"),
        &dir.path().join("o2"),
        SaveDtype::F32,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("adapter_config.json") && e.contains("not found"),
        "{e}"
    );
}

/// A vision-language model: the adapter on its language model (transformers' module names,
/// `model.language_model.…`) merged as peft merges it, the tower and processor kept.
#[test]
fn merge_writes_a_vision_language_model() {
    use ares_runner::vision::checkpoint::VlCheckpoint;
    let base = model_fixtures().join("vl/qwen2_5_vl_tiny");
    let adapter = model_fixtures().join("lora/qwen2_5_vl_lm");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("merged");
    let report = merge(&base, &adapter, &out, SaveDtype::F32).unwrap();
    assert_eq!((report.rank, report.scale), (2, 2.0));
    let before = VlCheckpoint::load(&base).unwrap();
    let merged = VlCheckpoint::load(&out).unwrap();
    assert_eq!(merged.layout, before.layout);
    assert_eq!(merged.vision, before.vision, "the tower is untouched");
    let bytes = std::fs::read(adapter.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (ours, theirs) in [
        (
            "model.layers.1.self_attn.q_proj.weight",
            "model.language_model.layers.1.self_attn.q_proj.weight",
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            "model.language_model.layers.0.self_attn.o_proj.weight",
        ),
    ] {
        let got = merged
            .text
            .tensors()
            .into_iter()
            .find(|(n, _)| n == ours)
            .unwrap()
            .1
            .data
            .clone();
        let want: Vec<f32> = st
            .tensor(&format!("merged.{theirs}"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-6, "merged {ours} off by {worst:e}");
    }
    assert!(out.join("preprocessor_config.json").exists());
}
