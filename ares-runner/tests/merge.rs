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

/// `got`, our merged weight `ours`, within 1e-6 of peft's `merged.<theirs>` in the adapter
/// fixture's `expected.safetensors`.
fn assert_merged_as_peft(adapter: &Path, ours: &str, theirs: &str, got: &[f32]) {
    let bytes = std::fs::read(adapter.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor(&format!("merged.{theirs}"))
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got.len(), want.len(), "{ours}");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 1e-6, "merged {ours} off by {worst:e}");
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
    assert_merged_as_peft(&adapter, q, q, &got);
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
        assert_merged_as_peft(&adapter, ours, theirs, &got);
    }
    assert!(out.join("preprocessor_config.json").exists());
}

/// `eval --adapter`: the demo model with an adapter merged at load scores as the merged
/// model `merge` writes, response for response.
#[test]
fn eval_with_an_adapter_equals_eval_of_the_merged_model() {
    use ares_runner::backend::cpu::CpuBackend;
    use ares_runner::commands::demo::{Demo, Method, config, evaluate_model_with};
    use ares_runner::demo::model::TinyModelSpec;
    use ares_runner::demo::{DemoOptions, write_demo_assets_with};
    use ares_runner::hf::lora::{LoraAdapter, LoraConfig, LoraPair};

    let dir = tempfile::tempdir().unwrap();
    let a = write_demo_assets_with(
        &dir.path().join("assets"),
        &DemoOptions {
            seed: 3,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 32,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                intermediate: 64,
                max_positions: 2048,
                ..TinyModelSpec::default()
            },
            ..DemoOptions::default()
        },
    )
    .unwrap();
    // a rank-2 adapter on layer 0's q_proj [32, 32] and down_proj [32, 64]
    let values = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin() * 0.3).collect();
    let pair = |out: usize, inp: usize| LoraPair {
        a: values(2 * inp, 0.37),
        b: values(out * 2, 0.71),
        out_in: [out, inp],
        kernel: Vec::new(),
    };
    let adapter = LoraAdapter {
        config: LoraConfig {
            r: 2,
            lora_alpha: 4.0,
            use_rslora: false,
            target_modules: vec!["q_proj".into(), "down_proj".into()],
            layers_to_transform: None,
            exclude_modules: None,
        },
        pairs: [
            (
                "model.layers.0.self_attn.q_proj.weight".to_string(),
                pair(32, 32),
            ),
            (
                "model.layers.0.mlp.down_proj.weight".to_string(),
                pair(32, 64),
            ),
        ]
        .into_iter()
        .collect(),
        language_model: false,
    };
    let adapter_dir = dir.path().join("adapter");
    adapter.write(&adapter_dir, "demo").unwrap();
    let merged = dir.path().join("merged");
    merge(&a.model_dir, &adapter_dir, &merged, SaveDtype::F32).unwrap();

    let cfg = config(
        Demo::Text,
        Method::Ares,
        &["data.max_response_length=16".into()],
    )
    .unwrap();
    let data = a.eval.display().to_string();
    // the responses themselves: accuracy and lengths alone may coincide
    let eval = |model: &Path, adapter: Option<&Path>| {
        let mut responses = Vec::new();
        let report = evaluate_model_with(
            &cfg,
            CpuBackend,
            model,
            adapter,
            &data,
            Some(&mut responses),
        )
        .unwrap();
        (report, responses)
    };
    let with = eval(&a.model_dir, Some(&adapter_dir));
    let of_merged = eval(&merged, None);
    let base = eval(&a.model_dir, None);
    let rows = |r: &ares_runner::trainer::eval::EvalReport| -> Vec<(String, f64, f64)> {
        r.iter()
            .map(|(k, v)| (k.clone(), v.accuracy, v.mean_length))
            .collect()
    };
    assert_eq!(rows(&with.0), rows(&of_merged.0));
    assert_eq!(with.1, of_merged.1);
    assert_ne!(with.1, base.1, "the adapter changes the responses");
}
