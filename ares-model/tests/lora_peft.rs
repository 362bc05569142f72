//! PEFT LoRA adapters (`tests/fixtures/lora`, made by peft: `scripts/make_lora_fixtures.py`):
//! read, merged into the base model, and the merged model's logits against the PeftModel's;
//! written back and read again; unsupported adapters refused with the field named.

use std::path::Path;

use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::HfError;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::lora::{CONFIG_FILE, LoraAdapter, WEIGHTS_FILE};
use ares_model::model::{Inputs, Model};
use safetensors::SafeTensors;

mod common;
use common::{fixture, u32s};

fn lora_dir(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora")
        .join(name)
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The largest `|ours − theirs| / max(1, |theirs|)` over the valid rows of the base
/// model's `right` input set, ours from `model`.
fn logits_error(model: &Model<CpuBackend>, base: &str, want: &[f32]) -> f32 {
    let bytes = std::fs::read(fixture(base).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, input_ids) = u32s(&st, "right.input_ids");
    let (_, attention_mask) = u32s(&st, "right.attention_mask");
    let (_, position_ids) = u32s(&st, "right.position_ids");
    let inputs = Inputs {
        batch: shape[0],
        seq: shape[1],
        input_ids: &input_ids,
        attention_mask: &attention_mask,
        position_ids: &position_ids,
    };
    let logits = model.forward_logits(&inputs).unwrap();
    let vocab = model.spec().vocab;
    let mut worst = 0.0f32;
    for (row, &m) in attention_mask.iter().enumerate() {
        if m == 1 {
            let span = row * vocab..(row + 1) * vocab;
            for (&ours, &theirs) in logits[span.clone()].iter().zip(&want[span]) {
                worst = worst.max((ours - theirs).abs() / theirs.abs().max(1.0));
            }
        }
    }
    worst
}

/// Merged into its base model, each adapter gives the PeftModel's logits; without it the
/// base model gives the disabled adapter's.
#[test]
fn merged_adapters_give_peft_logits() {
    for (name, base, pairs) in [
        ("qwen2_all", "qwen2_tiny", 14),
        ("llama_attn", "llama_tiny", 2),
    ] {
        let mut checkpoint = Checkpoint::load(&fixture(base)).unwrap();
        let adapter = LoraAdapter::read(&lora_dir(name), &checkpoint.config).unwrap();
        assert_eq!(adapter.pairs.len(), pairs, "{name}");
        let bytes = std::fs::read(lora_dir(name).join("expected.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();

        let plain = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        let off = logits_error(&plain, base, &f32s(&st, "right.base_logits"));
        assert!(off <= 1e-4, "{name} without the adapter: {off:e}");

        adapter.merge_into(&mut checkpoint.weights).unwrap();
        let merged = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        let on = logits_error(&merged, base, &f32s(&st, "right.logits"));
        eprintln!("{name}: merged logits within {on:.2e} of peft's");
        assert!(on <= 1e-4, "{name} merged: {on:e}");

        let q = "model.layers.1.self_attn.q_proj.weight";
        let want = f32s(&st, &format!("merged.{q}"));
        let got = &checkpoint
            .weights
            .tensors()
            .into_iter()
            .find(|(n, _)| n == q)
            .unwrap()
            .1
            .data;
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-6, "{name}: merged {q} off by {worst:e}");
    }
}

/// Written as PEFT writes it and read back: the same adapter.
#[test]
fn adapters_round_trip_through_peft_files() {
    let checkpoint = Checkpoint::load(&fixture("llama_tiny")).unwrap();
    let adapter = LoraAdapter::read(&lora_dir("llama_attn"), &checkpoint.config).unwrap();
    assert!(adapter.config.use_rslora);
    assert_eq!(adapter.config.layers_to_transform, Some(vec![1]));
    assert!((adapter.config.scale() - 5.0 / 3f64.sqrt()).abs() < 1e-12);
    let dir = tempfile::tempdir().unwrap();
    adapter.write(dir.path(), "llama_tiny").unwrap();
    let again = LoraAdapter::read(dir.path(), &checkpoint.config).unwrap();
    assert_eq!(again, adapter);
}

/// Copies adapter `name` into a temporary directory, with `edit` applied to its config.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = lora_dir(name);
    std::fs::copy(src.join(WEIGHTS_FILE), dir.path().join(WEIGHTS_FILE)).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join(CONFIG_FILE)).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.path().join(CONFIG_FILE), config.to_string()).unwrap();
    dir
}

#[test]
fn unsupported_or_foreign_adapters_are_refused_with_the_reason() {
    let qwen3 = Checkpoint::load(&fixture("qwen3_tiny")).unwrap().config;
    let llama = Checkpoint::load(&fixture("llama_tiny")).unwrap().config;
    let message = |dir: &Path, config| match LoraAdapter::read(dir, config) {
        Ok(_) => panic!("{} was read for a model it does not fit", dir.display()),
        Err(e) => e.to_string(),
    };
    for (key, value, want) in [
        ("use_dora", serde_json::json!(true), "DoRA"),
        ("target_modules", serde_json::json!(".*q_proj"), "regex"),
        (
            "target_modules",
            serde_json::json!(["q_proj", "lm_head"]),
            "`lm_head`",
        ),
        ("bias", serde_json::json!("all"), "bias"),
        (
            "modules_to_save",
            serde_json::json!(["lm_head"]),
            "modules_to_save",
        ),
        (
            "rank_pattern",
            serde_json::json!({"q_proj": 8}),
            "per-module ranks",
        ),
        ("peft_type", serde_json::json!("IA3"), "only LORA"),
        ("r", serde_json::json!(0), "r"),
        (
            "layers_to_transform",
            serde_json::json!([5]),
            "the model has 2 layers",
        ),
    ] {
        let dir = edited("llama_attn", |c| c[key] = value);
        let e = message(dir.path(), &llama);
        assert!(e.contains(want) && e.contains(CONFIG_FILE), "{key}: {e}");
    }
    // llama's adapter on qwen3 (head_dim 12: q_proj is 72 × 48 there, not 48 × 48)
    let e = message(&lora_dir("llama_attn"), &qwen3);
    assert!(e.contains("q_proj.lora_B") && e.contains("[72, 3]"), "{e}");
    // an adapter of layer 1 read as one of layer 0: its tensors are not this adapter's
    let dir = edited("llama_attn", |c| {
        c["layers_to_transform"] = serde_json::json!([0])
    });
    let e = message(dir.path(), &llama);
    assert!(
        e.contains("layers.1.self_attn.q_proj.lora_A") && e.contains("not a LoRA pair"),
        "{e}"
    );
    // a pair missing: every module is adapted but the file holds only q and v
    let dir = edited("llama_attn", |c| {
        c["target_modules"] = serde_json::json!(["q_proj", "v_proj", "k_proj"]);
    });
    let e = LoraAdapter::read(dir.path(), &llama).err().unwrap();
    assert!(
        matches!(e, HfError::MissingTensor { .. }) && e.to_string().contains("k_proj"),
        "{e}"
    );
    // an adapter on a vision tower
    let dir = edited("llama_attn", |_| {});
    let key = "base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_A.weight";
    let data = [0.0f32; 6];
    let tensors: [(&str, &[usize], &[f32]); 1] = [(key, &[3, 2], &data)];
    ares_model::hf::tensor_files::write_safetensors(
        &dir.path().join(WEIGHTS_FILE),
        &tensors,
        ares_model::hf::tensor_files::SaveDtype::F32,
    )
    .unwrap();
    let e = message(dir.path(), &llama);
    assert!(e.contains("vision tower") && e.contains(key), "{e}");
    // no adapter there
    let empty = tempfile::tempdir().unwrap();
    let e = message(empty.path(), &qwen3);
    assert!(e.contains("not found") && e.contains(CONFIG_FILE), "{e}");
}

/// Writes each fixture adapter as ares writes it, for `scripts/check_peft_roundtrip.py`
/// (peft loads them onto the base models and must give the fixtures' logits):
///
/// ```text
/// ARES_PEFT_ROUNDTRIP_DIR=/tmp/ares_peft cargo test -p ares-model --test lora_peft \
///     -- --ignored write_peft_roundtrip
/// ```
#[test]
#[ignore = "writes adapters for scripts/check_peft_roundtrip.py"]
fn write_peft_roundtrip() {
    let root = std::env::var("ARES_PEFT_ROUNDTRIP_DIR").expect("ARES_PEFT_ROUNDTRIP_DIR");
    for (name, base) in [("qwen2_all", "qwen2_tiny"), ("llama_attn", "llama_tiny")] {
        let config = Checkpoint::load(&fixture(base)).unwrap().config;
        let adapter = LoraAdapter::read(&lora_dir(name), &config).unwrap();
        let base_path = fixture(base).display().to_string();
        adapter
            .write(&Path::new(&root).join(name), &base_path)
            .unwrap();
    }
}
