//! Training a vision-language model (the tiny random Qwen2.5-VL of
//! `ares-model/tests/fixtures/vl`, scripts/make_vl_fixtures.py) on a dataset of image, video
//! and text rows: two steps run with finite metrics and save a Qwen2.5-VL checkpoint with
//! the tower's optimizer moments; a frozen tower keeps its weights bit for bit; 2 + resume
//! + 2 steps equal 4; a text model refuses image rows.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::config::Config;
use ares_runner::metrics::read_metrics;
use ares_runner::trainer::Trainer;
use ares_runner::vision::checkpoint::VlCheckpoint;
use serde_json::{Map, Value};

mod common;
use common::deterministic;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny")
}

/// A small dataset: image rows (EasyR1's `<image>` placeholder and `images` column), a
/// video row (a list of frames), and text rows (the vision model answers those too).
fn dataset(dir: &Path) -> PathBuf {
    let images =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl/images");
    let image = |name: &str| images.join(name).display().to_string();
    let frames: Vec<String> = (0..4)
        .map(|i| image(&format!("video_frame_{i}.png")))
        .collect();
    let path = dir.join("train.jsonl");
    let mut rows: Vec<String> = Vec::new();
    for i in 0..6 {
        let difficulty = ["easy", "medium", "hard"][i % 3];
        let row = match i % 3 {
            0 => serde_json::json!({
                "prompt": format!("<image>How many shapes are there? ({i})"),
                "images": [image("image_56x84.png")],
                "answer": format!("{i}"), "difficulty": difficulty,
            }),
            1 if i == 1 => serde_json::json!({
                "prompt": "<video>What happens here?",
                "videos": [frames],
                "answer": "1", "difficulty": difficulty,
            }),
            _ => serde_json::json!({
                "prompt": format!("Tell me a story about {i} cats."),
                "answer": format!("{i}"), "difficulty": difficulty,
            }),
        };
        rows.push(row.to_string());
    }
    std::fs::write(&path, rows.join("\n")).unwrap();
    path
}

/// A 2-step config over the VL fixture writing to `run`, then `overrides`; rollout seed 2
/// gives the random model groups of unequal rewards (tests that need a gradient check it).
fn config(dir: &Path, run: &Path, overrides: &[&str]) -> Config {
    let train = dataset(dir);
    let text = format!(
        "\
data:
  train_files: {train}
  max_prompt_length: 128
  max_response_length: 6
  rollout_batch_size: 2
  bootstrap: false
algorithm:
  online_filtering: false
worker:
  actor:
    model_path: {model}
    global_batch_size: 2
    micro_batch_size_per_device_for_update: 4
    optim: {{lr: 1.0e-3}}
  rollout:
    n: 4
    seed: 2
trainer:
  save_checkpoint_path: {run}
  max_steps: 2
  save_freq: 1
  save_limit: 3
",
        train = train.display(),
        model = model_dir().display(),
        run = run.display()
    );
    let path = run.with_extension("yaml");
    std::fs::write(&path, text).unwrap();
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(Some(&path), &overrides).unwrap()
}

fn train(cfg: Config) -> (Vec<Map<String, Value>>, Option<PathBuf>) {
    let mut t = Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false))).unwrap();
    let s = t.run().unwrap();
    (read_metrics(&s.metrics).unwrap(), s.checkpoint)
}

/// `ares-runner plan` on a vision-language run counts the tower's activations from the
/// data's images: the video row's 4 frames of 56 × 56 are its largest prompt, 2 temporal
/// × 4 × 4 = 32 patches (the image row's 56 × 84: 24).
#[test]
fn the_plan_counts_the_towers_activations_from_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &dir.path().join("run"), &[]);
    let table = ares_runner::commands::plan(&cfg, None).unwrap();
    let row = table
        .lines()
        .filter(|l| l.contains("vision tower activations"))
        .collect::<Vec<_>>();
    // rollout, scoring, update
    assert_eq!(row.len(), 3, "{table}");
    assert!(
        row.iter().all(|r| r.contains("32 patches a prompt")),
        "{table}"
    );
    assert!(row[2].contains("kept for the backward"), "{table}");
    // a validation prompt of two 56 × 84 images (48 patches) bounds the rollout's arena
    // (evaluation generates from it), not scoring's nor the update's
    let images =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl/images");
    let image = images.join("image_56x84.png").display().to_string();
    let val = dir.path().join("val.jsonl");
    let row = serde_json::json!({
        "prompt": "<image><image>Which has more shapes?",
        "images": [image, image],
        "answer": "1",
    });
    std::fs::write(&val, row.to_string()).unwrap();
    let mut with_val = cfg.clone();
    with_val.data.val_files = Some(val.display().to_string());
    let larger = ares_runner::commands::plan(&with_val, None).unwrap();
    let tower_row = |table: &str, n: usize| {
        let row = table
            .lines()
            .filter(|l| l.contains("vision tower activations"))
            .nth(n)
            .unwrap()
            .to_string();
        let ours = table.lines().filter(|l| l.contains("vision tower")).count();
        assert_eq!(ours, 3, "{table}");
        row
    };
    assert!(
        tower_row(&larger, 0).contains("48 patches a prompt of the validation data"),
        "{larger}"
    );
    for n in [1, 2] {
        assert_eq!(tower_row(&larger, n), tower_row(&table, n), "{larger}");
    }
    assert_ne!(tower_row(&larger, 0), tower_row(&table, 0));
    // an unreadable validation image is said, not fatal to the plan
    let bad = dir.path().join("bad.jsonl");
    let row = serde_json::json!({
        "prompt": "<image>?", "images": [dir.path().join("missing.png")], "answer": "1",
    });
    std::fs::write(&bad, row.to_string()).unwrap();
    with_val.data.val_files = Some(bad.display().to_string());
    let noted = ares_runner::commands::plan(&with_val, None).unwrap();
    assert!(noted.contains("data.val_files"), "{noted}");
    // without the data the table says it leaves them out
    let mut no_data = cfg.clone();
    no_data.data.train_files = None;
    let table = ares_runner::commands::plan(&no_data, None).unwrap();
    assert!(
        table.contains("vision tower activations: not counted"),
        "{table}"
    );
}

#[test]
fn two_steps_train_and_save_the_tower() {
    let dir = tempfile::tempdir().unwrap();
    // every row (images, a video, text) in each of the two steps
    let all_rows = [
        "data.rollout_batch_size=6",
        "worker.actor.global_batch_size=6",
    ];
    let (lines, ck) = train(config(dir.path(), &dir.path().join("run"), &all_rows));
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let g = l["actor/grad_norm"].as_f64().unwrap();
        assert!(g.is_finite(), "{l:?}");
    }
    let ck = ck.expect("a checkpoint");
    assert!(ck.join("vision_optimizer.safetensors").is_file());
    let saved = VlCheckpoint::load(&ck.join("model")).unwrap();
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    assert_ne!(saved.vision, initial.vision, "the tower was stepped");
    assert_ne!(saved.text, initial.text);
    assert!(ck.join("model/preprocessor_config.json").is_file());
}

/// A vision-language model's passes packed back to back (`worker.actor.padding_free`, the
/// default: M-RoPE positions of each sample moved from its padded row, the tower's
/// rows to their packed tokens) train as the padded layout: every loss, norm and
/// statistic of two steps over image, video and text rows agrees (sabotage: packed
/// tokens given position 0's rotary rows, or their left neighbour's cos, fail it).
#[test]
fn packed_vision_batches_train_as_the_padded_layout() {
    let dir = tempfile::tempdir().unwrap();
    // every row (images, a video, text) in two micro-batches of each step; an entropy
    // bonus gives a gradient from every token whatever the rewards
    let micro = [
        "data.rollout_batch_size=6",
        "worker.actor.global_batch_size=6",
        "worker.actor.micro_batch_size_per_device_for_update=12",
        "worker.actor.entropy_bonus.coef=0.01",
    ];
    let run = |name: &str, more: &[&str]| {
        let mut o: Vec<&str> = micro.to_vec();
        o.extend(more);
        train(config(dir.path(), &dir.path().join(name), &o)).0
    };
    let packed = run("packed", &[]);
    let padded = run("padded", &["worker.actor.padding_free=false"]);
    assert_eq!(packed.len(), 2);
    for (a, b) in packed.iter().zip(&padded) {
        assert!(b["actor/grad_norm"].as_f64().unwrap() > 0.0, "{b:?}");
        for key in [
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "advantage/std",
        ] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{key}: {x} packed against {y} padded"
            );
        }
    }
}

#[test]
fn a_frozen_tower_keeps_its_weights() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &dir.path().join("run"),
        &["worker.actor.model.freeze_vision_tower=true"],
    );
    let (_, ck) = train(cfg);
    let ck = ck.expect("a checkpoint");
    assert!(!ck.join("vision_optimizer.safetensors").exists());
    let saved = VlCheckpoint::load(&ck.join("model")).unwrap();
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    assert_eq!(saved.vision, initial.vision, "frozen tower bit-identical");
    assert_ne!(saved.text, initial.text);
}

#[test]
fn two_steps_resume_two_steps_equals_four() {
    let dir = tempfile::tempdir().unwrap();
    let (want, _) = train(config(
        dir.path(),
        &dir.path().join("straight"),
        &["trainer.max_steps=4"],
    ));
    let resumed = dir.path().join("resumed");
    train(config(dir.path(), &resumed, &["trainer.max_steps=2"]));
    let (got, _) = train(config(
        dir.path(),
        &resumed,
        &["trainer.max_steps=4", "trainer.find_last_checkpoint=true"],
    ));
    assert_eq!(deterministic(got), deterministic(want));
}

/// Weight matrices stored in bf16 (`trainer.precision: bf16`) in a vision-language model:
/// the tower's linear layers too — saved as bf16 values, stepped (stochastic rounding) —
/// and 2 + resume + 2 steps equal 4.
#[test]
fn bf16_weights_store_the_tower_in_bf16_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = "trainer.precision=bf16";
    let (want, ck) = train(config(
        dir.path(),
        &dir.path().join("straight"),
        &[bf16, "trainer.max_steps=4"],
    ));
    let saved = VlCheckpoint::load(&ck.expect("a checkpoint").join("model")).unwrap();
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    let mut linear = 0;
    for (slot, t) in saved.vision.iter() {
        let start = initial.vision.get(slot).unwrap();
        let rounded = |x: f32| {
            f32::from_bits((x.to_bits() + 0x7fff + ((x.to_bits() >> 16) & 1)) & 0xffff_0000)
        };
        if slot.is_linear() {
            linear += 1;
            assert!(
                t.data.iter().all(|&x| rounded(x) == x),
                "{slot:?}: bf16 values"
            );
            assert_ne!(
                t.data,
                start.data.iter().map(|&x| rounded(x)).collect::<Vec<_>>(),
                "{slot:?} stepped"
            );
        } else {
            assert!(
                t.data.iter().any(|&x| rounded(x) != x),
                "{slot:?} stays f32"
            );
        }
    }
    assert!(linear >= 6, "{linear} linear slots");
    let resumed = dir.path().join("resumed");
    train(config(dir.path(), &resumed, &[bf16, "trainer.max_steps=2"]));
    let (got, _) = train(config(
        dir.path(),
        &resumed,
        &[
            bf16,
            "trainer.max_steps=4",
            "trainer.find_last_checkpoint=true",
        ],
    ));
    assert_eq!(deterministic(got), deterministic(want));
}

/// LoRA on a vision-language model's language model (image, video and text rows): the
/// tower frozen, the checkpoint a PEFT adapter in transformers' `model.language_model.`
/// names, and 2 + resume + 2 steps equal 4.
#[test]
fn lora_on_the_language_model_trains_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let lora = [
        "worker.actor.model.lora.rank=4",
        "worker.actor.model.lora.exclude_modules=.*visual.*",
    ];
    let with = |more: &[&'static str]| -> Vec<&'static str> {
        let mut o = lora.to_vec();
        o.extend_from_slice(more);
        o
    };
    let (want, _) = train(config(
        dir.path(),
        &dir.path().join("straight"),
        &with(&["trainer.max_steps=4"]),
    ));
    let resumed = dir.path().join("resumed");
    train(config(
        dir.path(),
        &resumed,
        &with(&["trainer.max_steps=2"]),
    ));
    let (got, ck) = train(config(
        dir.path(),
        &resumed,
        &with(&["trainer.max_steps=4", "trainer.find_last_checkpoint=true"]),
    ));
    assert_eq!(deterministic(got), deterministic(want.clone()));
    // (a step whose rewards are all equal has no advantage, so no gradient)
    assert!(
        want.iter()
            .any(|l| l["actor/grad_norm"].as_f64().unwrap() > 0.0)
    );
    let ck = ck.expect("a checkpoint");
    assert!(!ck.join("model").exists() && !ck.join("vision_optimizer.safetensors").exists());
    let bytes = std::fs::read(ck.join("adapter/adapter_model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]);
    assert!(
        header.contains(
            "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
        ),
        "{header}"
    );
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    let adapter =
        ares_runner::hf::lora::LoraAdapter::read(&ck.join("adapter"), &initial.config.text)
            .unwrap();
    assert!(adapter.language_model);
    assert!(
        adapter
            .pairs
            .values()
            .any(|p| p.b.iter().any(|&x| x != 0.0))
    );
}

/// LoRA on every linear layer of a vision-language model (the default `all-linear`,
/// nothing excluded): pairs on the tower too, trained beside the language model's; the
/// tower's moments saved with the adapter; 2 + resume + 2 steps equal 4; and with
/// `freeze_vision_tower` the tower carries no pairs.
#[test]
fn lora_on_the_tower_trains_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (want, _) = train(config(
        dir.path(),
        &dir.path().join("straight"),
        &["worker.actor.model.lora.rank=4", "trainer.max_steps=4"],
    ));
    let resumed = dir.path().join("resumed");
    train(config(
        dir.path(),
        &resumed,
        &["worker.actor.model.lora.rank=4", "trainer.max_steps=2"],
    ));
    let (got, ck) = train(config(
        dir.path(),
        &resumed,
        &[
            "worker.actor.model.lora.rank=4",
            "trainer.max_steps=4",
            "trainer.find_last_checkpoint=true",
        ],
    ));
    assert_eq!(deterministic(got), deterministic(want));
    let ck = ck.expect("a checkpoint");
    assert!(!ck.join("model").exists());
    assert!(ck.join("vision_optimizer.safetensors").is_file());
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    let (text, vision) = (&initial.config.text, &initial.config.vision);
    let adapter =
        ares_runner::hf::lora::LoraAdapter::read_vl(&ck.join("adapter"), text, vision).unwrap();
    let trained = |prefix: &str| {
        adapter
            .pairs
            .iter()
            .any(|(k, p)| k.starts_with(prefix) && p.b.iter().any(|&x| x != 0.0))
    };
    assert!(trained("visual.blocks."), "the tower's pairs trained");
    assert!(trained("visual.merger."), "the merger's pairs trained");
    assert!(
        trained("model.layers."),
        "the language model's pairs trained"
    );
    // a text model's reader refuses it, naming the tower
    let err = ares_runner::hf::lora::LoraAdapter::read(&ck.join("adapter"), text).unwrap_err();
    assert!(err.to_string().contains("vision tower"), "{err}");

    // freeze_vision_tower: the language model's pairs only
    let (_, ck) = train(config(
        dir.path(),
        &dir.path().join("frozen"),
        &[
            "worker.actor.model.lora.rank=4",
            "worker.actor.model.freeze_vision_tower=true",
            "trainer.max_steps=1",
        ],
    ));
    let ck = ck.expect("a checkpoint");
    assert!(!ck.join("vision_optimizer.safetensors").exists());
    let adapter =
        ares_runner::hf::lora::LoraAdapter::read_vl(&ck.join("adapter"), text, vision).unwrap();
    assert!(adapter.pairs.keys().all(|k| k.starts_with("model.layers.")));
    assert_eq!(
        adapter.config.exclude_modules.as_deref(),
        Some(".*visual.*")
    );
}

#[test]
fn a_text_model_refuses_image_rows() {
    let dir = tempfile::tempdir().unwrap();
    // a text model (qwen2_tiny) with a tokenizer (the VL fixture's)
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures");
    let text_model = dir.path().join("text_model");
    std::fs::create_dir(&text_model).unwrap();
    for entry in std::fs::read_dir(fixtures.join("models/qwen2_tiny")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, text_model.join(p.file_name().unwrap())).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            fixtures.join("vl/qwen2_vl_tiny").join(f),
            text_model.join(f),
        )
        .unwrap();
    }
    let cfg = config(
        dir.path(),
        &dir.path().join("run"),
        &[&format!(
            "worker.actor.model.model_path={}",
            text_model.display()
        )],
    );
    let err = match Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false))) {
        Ok(_) => panic!("a text model trained on image rows"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("images or videos"), "{err}");
}

#[test]
fn every_estimator_trains_two_steps_with_images() {
    let dir = tempfile::tempdir().unwrap();
    for est in [
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce",
        "reinforce_baseline",
        "reinforce_pro_max",
    ] {
        let estimator = format!("algorithm.adv_estimator={est}");
        let cfg = config(
            dir.path(),
            &dir.path().join(est),
            &[
                &estimator,
                "data.rollout_batch_size=6",
                "worker.actor.global_batch_size=6",
            ],
        );
        let (lines, _) = train(cfg);
        assert_eq!(lines.len(), 2, "{est}");
        for l in &lines {
            for (k, v) in l {
                if let Some(x) = v.as_f64() {
                    assert!(x.is_finite(), "{est}: {k} = {x}");
                }
            }
        }
    }
}

/// Supervised fine-tuning of a vision-language model on an SFT file with image rows
/// (EasyR1's `images` column and `<image>` placeholder, read by `read_sft_pairs`) and text
/// rows lowers the loss and saves a Qwen2.5-VL checkpoint whose language model and tower
/// were both stepped; a row without its response is an error naming the row and the key.
#[test]
fn sft_fine_tunes_a_vision_language_model() {
    use ares_runner::commands::{SftOptions, read_sft_pairs, run_sft};
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &dir.path().join("run"), &[]);
    let images =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl/images");
    let sft = dir.path().join("sft.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                serde_json::json!({
                    "prompt": format!("<image>Count the shapes ({i})."),
                    "images": [images.join("image_56x84.png").display().to_string()],
                    "response": format!("shapes {i}"),
                })
            } else {
                serde_json::json!({
                    "prompt": format!("Tell me a story about {i} cats."),
                    "response": format!("cats {i}"),
                })
            }
            .to_string()
        })
        .collect();
    std::fs::write(&sft, rows.join("\n")).unwrap();
    let pairs = read_sft_pairs(&sft, &cfg).unwrap();
    assert_eq!(pairs.len(), 8);
    assert_eq!(pairs[0].0.images.len(), 1);
    assert_eq!(
        pairs[0].1,
        ares_runner::data::SftTarget::Text("shapes 0".into())
    );
    let options = SftOptions {
        epochs: 6,
        batch_size: 4,
        micro_batch: 2,
        lr: 1e-2,
        max_length: 128,
        seed: 1,
    };
    let out = dir.path().join("sft");
    let report = run_sft(&cfg, CpuBackend, &model_dir(), &pairs, &options, &out, None).unwrap();
    assert!(report.last_loss < report.first_loss, "{report:?}");
    let saved = VlCheckpoint::load(&out).unwrap();
    let initial = VlCheckpoint::load(&model_dir()).unwrap();
    assert_ne!(saved.text, initial.text);
    assert_ne!(saved.vision, initial.vision, "the tower was not trained");

    // LoRA (all-linear: the tower's layers too): the pairs alone learn; the output is the
    // merged model with the adapter beside it, and merging that adapter into the base
    // gives the output
    let lora = config(
        dir.path(),
        &dir.path().join("run_lora"),
        &[
            "worker.actor.model.lora.rank=8",
            "worker.actor.model.lora.alpha=16",
        ],
    );
    let out = dir.path().join("sft_lora");
    let report = run_sft(
        &lora,
        CpuBackend,
        &model_dir(),
        &pairs,
        &options,
        &out,
        None,
    )
    .unwrap();
    assert!(report.last_loss < report.first_loss, "{report:?}");
    let saved = VlCheckpoint::load(&out).unwrap();
    assert_ne!(saved.text, initial.text);
    assert_ne!(saved.vision, initial.vision, "the tower's pairs merged");
    let adapter = ares_runner::hf::lora::LoraAdapter::read_vl(
        &out.join("adapter"),
        &initial.config.text,
        &initial.config.vision,
    )
    .unwrap();
    let mut merged = initial.clone();
    adapter.merge_into(&mut merged.text).unwrap();
    adapter
        .merge_into_tower(&initial.config.vision, &mut merged.vision)
        .unwrap();
    let close = |n: &str, a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff / scale < 1e-5, "{n}: {}", diff / scale);
    };
    for ((n, a), (_, b)) in merged.text.tensors().iter().zip(saved.text.tensors()) {
        close(n, &a.data, &b.data);
    }
    let cfg_v = &initial.config.vision;
    for ((n, _, a), (_, _, b)) in merged
        .vision
        .named(cfg_v)
        .iter()
        .zip(saved.vision.named(cfg_v))
    {
        close(n, a, b);
    }

    // freeze_vision_tower under LoRA: the tower as it was
    let frozen = config(
        dir.path(),
        &dir.path().join("run_lora_frozen"),
        &[
            "worker.actor.model.lora.rank=8",
            "worker.actor.model.freeze_vision_tower=true",
        ],
    );
    let out = dir.path().join("sft_lora_frozen");
    let short = SftOptions {
        epochs: 1,
        ..options
    };
    run_sft(
        &frozen,
        CpuBackend,
        &model_dir(),
        &pairs,
        &short,
        &out,
        None,
    )
    .unwrap();
    let saved = VlCheckpoint::load(&out).unwrap();
    assert_eq!(saved.vision, initial.vision, "the tower frozen");

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, format!("{}\n{{\"prompt\": \"hi\"}}\n", rows[0])).unwrap();
    let err = read_sft_pairs(&bad, &cfg).unwrap_err().to_string();
    assert!(err.contains("response") && err.contains("row 1"), "{err}");
}

/// `examples/configs/easyr1_qwen25_vl_geo3k.yaml`, EasyR1's multimodal layout with engine
/// knobs, trains two steps on the tiny Qwen2.5-VL with only data, model and sizes overridden.
#[test]
fn easyr1_style_vl_example_config_trains_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dataset(dir.path());
    let run = dir.path().join("easyr1_vl");
    let example = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/configs/easyr1_qwen25_vl_geo3k.yaml");
    let overrides: Vec<String> = vec![
        format!("data.train_files={}", rows.display()),
        "data.val_files=null".into(),
        "data.prompt_key=prompt".into(),
        "data.format_prompt=null".into(),
        "data.max_prompt_length=128".into(),
        "data.max_response_length=6".into(),
        "data.rollout_batch_size=2".into(),
        "data.min_pixels=null".into(),
        "data.max_pixels=null".into(),
        format!("worker.actor.model.model_path={}", model_dir().display()),
        "worker.actor.global_batch_size=2".into(),
        "worker.rollout.n=4".into(),
        format!("trainer.save_checkpoint_path={}", run.display()),
        "trainer.max_steps=2".into(),
        "trainer.val_before_train=false".into(),
    ];
    let cfg = Config::load(Some(&example), &overrides).unwrap();
    let (lines, checkpoint) = train(cfg);
    assert_eq!(lines.len(), 2);
    assert!(checkpoint.is_some());
    for l in &lines {
        let reward = l["reward/mean"].as_f64().unwrap();
        assert!(reward.is_finite());
    }
}

/// The override of `worker.rollout.multi_turn.interaction` with a program that answers
/// every turn "more" (written into `dir` by a child, so no test thread holds the file
/// open when it runs).
fn more_interaction(dir: &Path) -> String {
    let script = dir.join("more.sh");
    let status = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "echo 'while read -r l; do echo \"{{\\\"content\\\": \\\"more\\\"}}\"; done' > '{}'",
                script.display()
            ),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    format!(
        "worker.rollout.multi_turn.interaction={{command: 'sh {}', reward_weight: 0}}",
        script.display()
    )
}

/// The override of `data.override_chat_template` with the fixture's template marked as
/// teaching `<tool_call>` (it ignores tools otherwise), written into `dir`.
fn tool_template(dir: &Path) -> String {
    let config_json: Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let template = dir.join("tools.jinja");
    std::fs::write(
        &template,
        format!(
            "{{# calls go in <tool_call></tool_call> #}}{}",
            config_json["chat_template"].as_str().unwrap()
        ),
    )
    .unwrap();
    format!("data.override_chat_template={}", template.display())
}

/// Multi-turn episodes keep a prompt's images and videos in every turn: a vision model
/// that calls no tool trains exactly as the single-turn rollout.
#[test]
fn vision_episodes_without_calls_train_as_single_turn() {
    let dir = tempfile::tempdir().unwrap();
    let t = tool_template(dir.path());
    let all_rows = [
        "data.rollout_batch_size=6",
        "worker.actor.global_batch_size=6",
    ];
    let mut plain = all_rows.to_vec();
    plain.push(&t);
    let (single, _) = train(config(dir.path(), &dir.path().join("single"), &plain));
    let mut on = plain.clone();
    on.push("worker.rollout.multi_turn.enable=true");
    let (episodes, _) = train(config(dir.path(), &dir.path().join("episodes"), &on));
    for (s, e) in single.iter().zip(&episodes) {
        assert_eq!(e["tools/turns_per_response"].as_f64(), Some(1.0));
        let e: Map<String, Value> = e
            .iter()
            .filter(|(k, _)| !k.starts_with("tools/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(deterministic(vec![e]), deterministic(vec![s.clone()]));
    }
}

/// Vision-language episodes that go on for several turns (an interaction program answers
/// each turn as a user, as tools do) continue over their kept KV blocks in the trainer's
/// rollout, and the run trains with finite metrics; a turn ended by `<|endoftext|>`, which
/// the ChatML template does not close turns with, ends its episode instead of failing
/// the run. (That continuations equal generating after the whole conversation is checked
/// on the engine: `ares-model/tests/vision_model.rs`.)
#[test]
fn vision_episodes_continue_over_kept_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let t = tool_template(dir.path());
    let interaction = more_interaction(dir.path());
    let (lines, _) = train(config(
        dir.path(),
        &dir.path().join("episodes"),
        &[
            &t,
            "worker.rollout.multi_turn.enable=true",
            "worker.rollout.multi_turn.max_assistant_turns=3",
            "data.max_response_length=48",
            &interaction,
        ],
    ));
    assert_eq!(lines.len(), 2);
    let mut continued = 0.0;
    for l in &lines {
        // (the random model's turns mostly run to the budget; those that end go on)
        let turns = l["tools/turns_per_response"].as_f64().unwrap();
        assert!(turns >= 1.0, "{l:?}");
        continued += turns - 1.0;
        assert_eq!(l["tools/interaction_error_ratio"].as_f64(), Some(0.0));
        assert!(l["tools/prefill_saving"].as_f64().unwrap() > 1.0, "{l:?}");
        assert!(l["actor/grad_norm"].as_f64().unwrap().is_finite(), "{l:?}");
    }
    assert!(
        continued > 0.0,
        "no episode had a second turn: the test tests nothing"
    );
}

/// A run's metrics lines and checkpoint files.
type Outcome = (Vec<Map<String, Value>>, Vec<(String, Vec<u8>)>);

/// Runs `overrides` (with a bootstrap, rollout chunks of two sequences, micro-batches of
/// two rows, the tower trained) at each of `worlds` thread ranks; each world's metrics
/// (but the prefill counts, which follow how rows are shared out) and checkpoint files.
fn data_parallel_outcomes(dir: &Path, overrides: &[&str], worlds: &[usize]) -> Vec<Outcome> {
    use ares_runner::parallel::Ranks;
    use ares_runner::parallel::threads::ThreadGroup;
    let mut outcomes = Vec::new();
    for &world in worlds {
        let run = dir.join(format!("world{world}"));
        let mut all = vec![
            "data.bootstrap=true",
            "worker.actor.micro_batch_size_per_device_for_update=2",
            "trainer.save_freq=0",
        ];
        all.extend_from_slice(overrides);
        let cfg = config(dir, &run, &all);
        let ranks = ThreadGroup::ranks(world, std::time::Duration::from_secs(120));
        let summaries: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|rank| {
                    let cfg = cfg.clone();
                    s.spawn(move || {
                        let mut t = Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false)))
                            .unwrap();
                        t.settings.rollout_chunk = 2;
                        t.join(Ranks::new(Arc::new(rank))).unwrap();
                        t.run().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let files = common::checkpoint_files(&summaries[0].checkpoint.clone().unwrap());
        let m = deterministic(read_metrics(&summaries[0].metrics).unwrap())
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .filter(|(k, _)| !k.starts_with("tools/prefill"))
                    .collect()
            })
            .collect();
        outcomes.push((m, files));
    }
    for (i, o) in outcomes.iter().enumerate().skip(1) {
        assert_eq!(o.0, outcomes[0].0, "world {}: metrics", worlds[i]);
        common::assert_same_files(&o.1, &outcomes[0].1, &format!("world {}", worlds[i]));
    }
    outcomes
}

/// Data parallelism with images: worlds of 1, 2 and 3 threads give the same metrics and
/// checkpoint bytes, the tower's moments included.
#[test]
fn data_parallel_worlds_give_the_same_bits_with_images() {
    let dir = tempfile::tempdir().unwrap();
    let outcomes = data_parallel_outcomes(dir.path(), &[], &[1, 2, 3]);
    let files = &outcomes[0].1;
    assert!(
        files.iter().any(|(n, _)| n.contains("vision")),
        "the tower's moments: {:?}",
        files.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
}

/// Data parallelism with images in bf16 (`trainer.precision=bf16`: weights and gradients
/// in bf16, the tower's linear layers' too): worlds of 1 and 2 threads give the same
/// metrics and checkpoint bytes.
#[test]
fn data_parallel_worlds_give_the_same_bits_with_bf16_gradients() {
    let dir = tempfile::tempdir().unwrap();
    data_parallel_outcomes(dir.path(), &["trainer.precision=bf16"], &[1, 2]);
}

/// ZeRO-1 with a trained tower: the language model's gradients reduce-scattered to their
/// owners, the tower's to every rank (each holds its moments) — world 1's bits.
#[test]
fn zero_1_with_images_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, zero) = (dir.path().join("plain"), dir.path().join("zero"));
    std::fs::create_dir_all(&plain).unwrap();
    std::fs::create_dir_all(&zero).unwrap();
    let want = data_parallel_outcomes(&plain, &[], &[1]);
    let got = data_parallel_outcomes(&zero, &["trainer.zero_stage=1"], &[2]);
    assert_eq!(got[0].0, want[0].0, "metrics");
    common::assert_same_files(&got[0].1, &want[0].1, "ZeRO-1 at world 2");
}

/// Multi-turn vision episodes shared out among ranks (an interaction answers each turn)
/// give the same bits at worlds of 1, 2 and 3, the episode counts summed.
#[test]
fn data_parallel_episodes_give_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let t = tool_template(dir.path());
    let interaction = more_interaction(dir.path());
    let outcomes = data_parallel_outcomes(
        dir.path(),
        &[
            &t,
            "worker.rollout.multi_turn.enable=true",
            "worker.rollout.multi_turn.max_assistant_turns=3",
            "data.max_response_length=48",
            &interaction,
        ],
        &[1, 2, 3],
    );
    let turns: f64 = outcomes[0]
        .0
        .iter()
        .map(|l| l["tools/turns_per_response"].as_f64().unwrap())
        .sum();
    assert!(turns > 2.0, "some episodes went on: {turns}");
}
