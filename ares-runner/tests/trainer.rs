//! End-to-end training on a tiny random model (the demo's task and tokenizer): every
//! estimator and method runs 2 steps with finite metrics, the controllers move as the spec
//! says, a 2 + resume + 2 run equals a 4-step run, and bad inputs fail before any work
//! with errors that name what is wrong.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::config::Config;
use ares_runner::demo::model::TinyModelSpec;
use ares_runner::demo::{DemoAssets, DemoOptions, write_demo_assets_with};
use ares_runner::metrics::read_metrics;
use ares_runner::trainer::{TrainError, Trainer};
use serde_json::{Map, Value};

mod common;
use common::deterministic;

/// Demo assets with a very small model and few problems.
fn assets(dir: &Path) -> DemoAssets {
    assets_sized(dir, 64)
}

/// [`assets`] with an MLP of `intermediate` features.
fn assets_sized(dir: &Path, intermediate: usize) -> DemoAssets {
    write_demo_assets_with(
        dir,
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
                intermediate,
                // room for graded system prompts (long rubric messages, one token per char)
                max_positions: 2048,
                ..TinyModelSpec::default()
            },
            ..DemoOptions::default()
        },
    )
    .unwrap()
}

/// A 2-step config over `assets` writing to `run`, then `overrides`. The random model's
/// rewards are luck: rollout seed 2 gives groups of unequal rewards, so gradients, in both
/// steps (tests that need one check `actor/grad_norm > 0`).
fn config(a: &DemoAssets, run: &Path, overrides: &[&str]) -> Result<Config, String> {
    let base = format!(
        "\
data:
  train_files: {train}
  val_files: {val}
  max_prompt_length: 40
  max_response_length: 12
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
        train = a.train.display(),
        val = a.eval.display(),
        model = a.model_dir.display(),
        run = run.display()
    );
    let path = run.with_extension("yaml");
    std::fs::write(&path, base).unwrap();
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(Some(&path), &overrides).map_err(|e| e.to_string())
}

/// Whether `python3` runs (the Python reward tests skip without it; CI has it).
fn has_python() -> bool {
    let ok = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("python3 not found: skipping");
    }
    ok
}

fn trainer(cfg: Config) -> Result<Trainer<CpuBackend>, TrainError> {
    Trainer::new(cfg, CpuBackend, Arc::new(AtomicBool::new(false)))
}

/// Runs `overrides` for its steps and returns the metrics lines.
fn run(dir: &Path, name: &str, overrides: &[&str]) -> Vec<Map<String, Value>> {
    let a = assets(&dir.join("assets"));
    let run = dir.join(name);
    let cfg = config(&a, &run, overrides).unwrap();
    let summary = trainer(cfg).unwrap().run().unwrap();
    assert!(summary.checkpoint.is_some());
    read_metrics(&summary.metrics).unwrap()
}

fn num(line: &Map<String, Value>, key: &str) -> f64 {
    line.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no numeric {key:?} in {line:?}"))
}

/// Every numeric metric is finite (non-finite ones are written as null).
fn assert_finite(lines: &[Map<String, Value>]) {
    for line in lines {
        for (k, v) in line {
            assert!(!v.is_null(), "{k} is not finite in {line:?}");
        }
        for key in [
            "reward/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "advantage/std",
        ] {
            assert!(num(line, key).is_finite(), "{key}");
        }
    }
}

#[test]
fn every_estimator_trains_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    for est in [
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce",
        "reinforce_baseline",
        "reinforce_pro_max",
    ] {
        let lines = run(
            dir.path(),
            est,
            &[&format!("algorithm.adv_estimator={est}")],
        );
        assert_eq!(lines.len(), 2, "{est}");
        assert_finite(&lines);
        assert_eq!(num(&lines[1], "step"), 2.0);
    }
}

#[test]
fn every_policy_loss_trains_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    for (loss, extra) in [
        (
            "gspo",
            &["worker.actor.loss_agg_mode=seq-mean-token-mean"][..],
        ),
        ("gspo_token", &[][..]),
        ("cispo", &["worker.actor.clip_ratio_low=1"][..]),
        // a wide covariance window so Clip-Cov has candidates on a random model
        (
            "clip_cov",
            &[
                "worker.actor.clip_cov_ratio=0.5",
                "worker.actor.clip_cov_lb=-100",
                "worker.actor.clip_cov_ub=100",
            ][..],
        ),
        ("kl_cov", &["worker.actor.kl_cov_ratio=0.1"][..]),
    ] {
        let mut overrides = vec![
            format!("worker.actor.policy_loss={loss}"),
            // k3+ in the loss: the straight-through KL runs end to end too
            "algorithm.kl_penalty=k3+".to_string(),
            // two PPO epochs so the second pass sees ratios ≠ 1
            "worker.actor.ppo_epochs=2".to_string(),
        ];
        overrides.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let lines = run(dir.path(), loss, &refs);
        assert_eq!(lines.len(), 2, "{loss}");
        assert_finite(&lines);
        for line in &lines {
            match loss {
                "clip_cov" | "kl_cov" => {
                    let f = num(line, "actor/selected_frac");
                    assert!(f > 0.0 && f <= 0.5, "{loss}: selected_frac {f}");
                }
                _ => assert!(!line.contains_key("actor/selected_frac"), "{loss}"),
            }
        }
    }
}

/// `worker.actor.padding_free` (the default) lays the text model's passes out back to back
/// on the CPU; `false` pads them. The same training up to summation order: every loss,
/// norm and statistic of two steps agrees.
#[test]
fn padding_free_trains_as_the_padded_layout() {
    let dir = tempfile::tempdir().unwrap();
    // responses long enough to end at different lengths
    let long = "data.max_response_length=48";
    let packed = run(dir.path(), "packed", &[long]);
    let padded = run(
        dir.path(),
        "padded",
        &[long, "worker.actor.padding_free=false"],
    );
    assert_eq!(packed.len(), 2);
    for (a, b) in packed.iter().zip(&padded) {
        for key in [
            "reward/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "entropy/mean",
            "advantage/std",
            "response_length/mean",
        ] {
            let (x, y) = (num(a, key), num(b, key));
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "step {}: {key} {x} packed against {y} padded",
                num(a, "step")
            );
        }
    }
}

#[test]
fn pro_max_uniform_scale_keeps_a_signal_on_uniform_groups() {
    let dir = tempfile::tempdir().unwrap();
    // a random model answers nothing right: every group is uniform (all wrong, reward 0
    // plus shaping); with uniform_scale and shaping off the advantages are r/n = 0, without
    // it RLOO gives 0 too — the run must stay finite either way
    let lines = run(
        dir.path(),
        "pm",
        &[
            "algorithm.adv_estimator=reinforce_pro_max",
            "algorithm.uniform_scale=true",
            "algorithm.entropy_reward.enable=false",
            "worker.reward.format_weight=0.5",
        ],
    );
    assert_finite(&lines);
}

#[test]
fn ares_with_bootstrap_sets_tau_targets_and_moves_alpha_and_lambda() {
    let dir = tempfile::tempdir().unwrap();
    // filtering on the overall reward: a random model is wrong everywhere, but the entropy
    // reward of wrong answers differs per sample, so groups stay strictly inside (0.01, 0.99)
    let lines = run(
        dir.path(),
        "ares",
        &[
            "data.bootstrap=true",
            "algorithm.online_filtering=true",
            "algorithm.filter_key=overall",
        ],
    );
    assert_finite(&lines);
    for l in &lines {
        let keep = num(l, "filter/keep_ratio");
        assert!(keep > 0.0 && keep <= 1.0, "{keep}");
    }
    let b: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("ares").join("bootstrap.json")).unwrap(),
    )
    .unwrap();
    assert!(b["tau"].as_f64().is_some(), "{b}");
    let hard_target = b["targets"]["hard"]
        .as_f64()
        .expect("random model: all hard");
    // τ in force at step 1 is the bootstrap's
    assert_eq!(num(&lines[0], "tau/used"), b["tau"].as_f64().unwrap());
    // α_hard moves by lr_α·(T − h̄) = 0.05·(T − h̄)
    let h = num(&lines[0], "hwe/hard");
    let t = num(&lines[0], "target/hard");
    let expected_alpha = (0.5 + 0.05 * (hard_target - h)).clamp(0.0, 2.0);
    assert!((num(&lines[0], "alpha/hard") - expected_alpha).abs() < 1e-9);
    // target jumps to s·h̄ (μ = 1), rounded
    assert_eq!(t, h.round_ties_even());
    // dual ascent: λ_hard = max(0, 0.0005 + 0.01·(KL − 0.2))
    let kl = num(&lines[0], "kl/hard");
    let lambda = (0.0005 + 0.01 * (kl - 0.2)).max(0.0);
    assert!((num(&lines[0], "lambda/hard") - lambda).abs() < 1e-9);
    // τ after step 1 is the EMA of the bootstrap τ and the batch's median
    assert_ne!(num(&lines[0], "tau"), num(&lines[0], "tau/used"));
}

#[test]
fn grpo_lambda_and_kl_in_reward_train() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run(
        dir.path(),
        "gl",
        &[
            "algorithm.entropy_reward.enable=false",
            "algorithm.grpo_lambda.enable=true",
            "algorithm.use_kl_loss=false",
            "algorithm.kl_type=adaptive",
        ],
    );
    assert_finite(&lines);
    assert!(num(&lines[1], "kl/beta") > 0.0);
    // with KL folded into the reward there is no KL loss term
    assert_eq!(num(&lines[1], "actor/kl_loss"), 0.0);
}

/// A rubric dataset whose keyword criteria a random model meets now and then.
fn rubric_data(dir: &Path) -> PathBuf {
    let path = dir.join("rubric.jsonl");
    let mut text = String::new();
    for i in 0..4 {
        text.push_str(&format!(
            "{{\"prompt\": \"{i}+{i}\", \"global_id\": \"r{i}\", \"reward_model\": {{\"rubrics\": [\
             {{\"criterion\": \"mentions one\", \"points\": 2, \"keywords\": [\"1\"]}}, \
             {{\"criterion\": \"mentions two\", \"points\": 1, \"keywords\": [\"2\"]}}, \
             {{\"criterion\": \"no nines\", \"points\": -1, \"keywords\": [\"9\"]}}]}}}}\n"
        ));
    }
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn graded_system_prompts_with_rubric_rewards_and_online_filtering() {
    let dir = tempfile::tempdir().unwrap();
    let data = rubric_data(dir.path());
    let lines = run(
        dir.path(),
        "rubric",
        &[
            &format!("data.train_files={}", data.display()),
            "data.val_files=null",
            "data.max_response_length=24",
            "algorithm.entropy_reward.enable=false",
            "worker.reward.grader=rubric",
            "worker.rollout.enable_graded_system_prompt=true",
            "algorithm.online_filtering=true",
            "algorithm.filter_key=overall",
            "algorithm.filter_low=0.0",
            "algorithm.filter_high=1.0",
            "trainer.max_try_make_batch=0",
        ],
    );
    assert_finite(&lines);
    for l in &lines {
        assert!((0.0..=1.0).contains(&num(l, "filter/keep_ratio")));
    }
}

#[test]
fn filtering_that_keeps_nothing_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let cfg = config(
        &a,
        &dir.path().join("f"),
        &[
            "algorithm.online_filtering=true",
            "trainer.max_try_make_batch=2",
        ],
    )
    .unwrap();
    let err = trainer(cfg).unwrap().run().unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("max_try_make_batch = 2"), "{msg}");
    assert!(msg.contains("collected 0 of 2 groups"), "{msg}");
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Two steps, a checkpoint, two more steps: the metrics of four straight steps (`extra`
/// overrides on both runs, a model whose MLP has `intermediate` features). Returns the
/// header of the last checkpoint's optimizer file.
fn resume_equals_straight(extra: &[&str], intermediate: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    let a = assets_sized(&dir.path().join("assets"), intermediate);
    let with = |more: &[&str]| -> Vec<String> {
        let mut all: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        all.push("data.bootstrap=true".into());
        all.extend(more.iter().map(|s| s.to_string()));
        all
    };
    let straight_o = with(&["trainer.max_steps=4"]);
    let cfg = config(&a, &dir.path().join("straight"), &as_strs(&straight_o)).unwrap();
    let straight = trainer(cfg).unwrap().run().unwrap();
    let want = deterministic(read_metrics(&straight.metrics).unwrap());

    let resumed_dir = dir.path().join("resumed");
    let first = with(&["trainer.max_steps=2"]);
    let cfg = config(&a, &resumed_dir, &as_strs(&first)).unwrap();
    trainer(cfg).unwrap().run().unwrap();
    let second = with(&["trainer.max_steps=4", "trainer.find_last_checkpoint=true"]);
    let cfg = config(&a, &resumed_dir, &as_strs(&second)).unwrap();
    let t = trainer(cfg).unwrap();
    assert_eq!(t.state.step, 2);
    let mut t = t;
    let resumed = t.run().unwrap();
    let got = deterministic(read_metrics(&resumed.metrics).unwrap());
    assert_eq!(got.len(), 4);
    assert_eq!(got, want, "{extra:?}");
    let checkpoint = resumed.checkpoint.expect("a checkpoint");
    let bytes = std::fs::read(checkpoint.join("optimizer.safetensors")).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    String::from_utf8_lossy(&bytes[8..8 + len]).into_owned()
}

#[test]
fn two_steps_resume_two_steps_equals_four_steps() {
    let header = resume_equals_straight(&[], 64);
    assert!(header.contains(r#""state_dtype":"f32""#), "{header}");
}

/// Resume is exact with bf16 and 8-bit optimizer moments too (saved as stored; an MLP of
/// 32 × 128 = 4 096 elements, the shortest tensor 8-bit moments quantise). At this size the
/// f32 case caught serde_json's default float parsing, off by an ulp on some of
/// `trainer_state.json`'s numbers (its `float_roundtrip` feature is on since).
#[test]
fn low_memory_optimizer_states_resume_exactly() {
    for (dtype, stored) in [("f32", "F32"), ("bf16", "BF16"), ("int8", "U8")] {
        let o = format!("worker.actor.optim.state_dtype={dtype}");
        let header = resume_equals_straight(&[&o], 128);
        let tag = format!(r#""state_dtype":"{dtype}""#);
        assert!(header.contains(&tag), "{header}");
        assert!(
            header.contains(&format!(r#""dtype":"{stored}""#)),
            "{header}"
        );
    }
}

/// Linear weights stored in bf16 (`trainer.weight_dtype: bf16`, stochastic rounding in
/// the update, seeded; with them their gradients in bf16, `trainer.grad_dtype` unset)
/// resume exactly — with 8-bit moments, the leanest run, and under LoRA — as do bf16
/// gradients accumulated over two micro-batches beside f32 weights; each storage takes
/// effect, and the weights' storage needs bf16 products, said when the config asks
/// otherwise.
#[test]
fn bf16_weights_resume_exactly() {
    let bf16 = [
        "trainer.matmul_precision=bf16",
        "trainer.weight_dtype=bf16",
        "worker.actor.optim.state_dtype=int8",
    ];
    let header = resume_equals_straight(&bf16, 128);
    assert!(header.contains(r#""state_dtype":"int8""#), "{header}");
    // LoRA on a base stored in bf16 (frozen; the reference is the base with the adapters
    // off, generation merges the pairs into widened weights)
    let lora = [
        "trainer.precision=bf16",
        "worker.actor.model.lora.rank=4",
        "worker.actor.model.lora.alpha=8",
    ];
    let header = resume_equals_straight(&lora, 128);
    assert!(header.contains("lora_A"), "{header}");
    let grads = [
        "trainer.grad_dtype=bf16",
        "worker.actor.micro_batch_size_per_device_for_update=4",
    ];
    resume_equals_straight(&grads, 128);
    // the MLP's activations in bf16 over f32 weights (the products read bf16 copies)
    let acts = [
        "trainer.matmul_precision=bf16",
        "trainer.activation_dtype=bf16",
    ];
    resume_equals_straight(&acts, 128);
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    // the storage takes effect: the same run with f32 weights (bf16 products) differs
    let metrics = |storage: &[&str], run: &str| {
        let mut o = vec![
            "trainer.matmul_precision=bf16",
            "trainer.max_steps=2",
            "data.bootstrap=true",
        ];
        o.extend(storage);
        let cfg = config(&a, &dir.path().join(run), &o).unwrap();
        deterministic(read_metrics(&trainer(cfg).unwrap().run().unwrap().metrics).unwrap())
    };
    let w16 = metrics(&["trainer.weight_dtype=bf16"], "w16");
    assert_ne!(w16, metrics(&["trainer.weight_dtype=f32"], "w32"));
    let g32 = ["trainer.weight_dtype=bf16", "trainer.grad_dtype=f32"];
    assert_ne!(w16, metrics(&g32, "w16g32"));
    // and so does the activations' (bf16 by default with bf16 weights)
    let a32 = ["trainer.weight_dtype=bf16", "trainer.activation_dtype=f32"];
    assert_ne!(w16, metrics(&a32, "w16a32"));
    let err = config(&a, &dir.path().join("run"), &["trainer.weight_dtype=bf16"]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("trainer.weight_dtype") && msg.contains("trainer.matmul_precision: bf16"),
        "{msg}"
    );
}

/// A LoRA run (the base frozen, pairs on every linear layer, int8 moments) resumes
/// exactly; its checkpoints hold the adapter as PEFT files and no model copy, and the
/// optimizer state names the pairs.
#[test]
fn lora_runs_resume_exactly_and_save_peft_adapters() {
    let lora = [
        "worker.actor.model.lora.rank=4",
        "worker.actor.model.lora.alpha=8",
        "worker.actor.optim.state_dtype=int8",
    ];
    let header = resume_equals_straight(&lora, 128);
    assert!(
        header.contains("model.layers.0.self_attn.q_proj.lora_A.weight.exp_avg")
            && !header.contains("\"model.embed_tokens.weight"),
        "{header}"
    );

    // one more run, to look at its checkpoint
    let dir = tempfile::tempdir().unwrap();
    let a = assets_sized(&dir.path().join("assets"), 64);
    let mut o: Vec<&str> = lora.to_vec();
    o.push("trainer.max_steps=2");
    let cfg = config(&a, &dir.path().join("run"), &o).unwrap();
    let summary = trainer(cfg).unwrap().run().unwrap();
    // the reference is the base (adapters off): no KL before the first update, some after
    let kl: Vec<f64> = read_metrics(&summary.metrics)
        .unwrap()
        .iter()
        .map(|r| r["kl/mean"].as_f64().unwrap())
        .collect();
    assert!(kl[0] == 0.0 && kl[1] > 0.0, "{kl:?}");
    let ck = summary.checkpoint.expect("a checkpoint");
    assert!(ck.join("adapter/adapter_config.json").is_file());
    assert!(ck.join("adapter/adapter_model.safetensors").is_file());
    assert!(!ck.join("model").exists(), "no copy of the frozen base");
    let model = ares_runner::hf::config::ModelConfig::from_dir(&a.model_dir).unwrap();
    let adapter = ares_runner::hf::lora::LoraAdapter::read(&ck.join("adapter"), &model).unwrap();
    assert_eq!(adapter.config.r, 4);
    assert_eq!(adapter.pairs.len(), 7 * model.num_hidden_layers);
    assert!(
        adapter
            .pairs
            .values()
            .any(|p| p.b.iter().any(|&x| x != 0.0)),
        "the pairs were trained"
    );

    // `merge` takes the checkpoint itself (its adapter/) and writes the trained model
    let merged = dir.path().join("merged");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"))
        .args(["merge", "--model"])
        .arg(&a.model_dir)
        .arg("--adapter")
        .arg(&ck)
        .arg("-o")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(merged.join("model.safetensors").is_file());

    // a new run from that adapter (as from one peft wrote): the policy starts away from
    // the base, so its first step already has a KL; other settings than the adapter's are
    // refused with the ones to use
    let adapter_dir = ck.join("adapter");
    let from = format!(
        "worker.actor.model.lora.adapter_path={}",
        adapter_dir.display()
    );
    let mut o: Vec<&str> = lora.to_vec();
    o.extend(["trainer.max_steps=1", &from]);
    let cfg = config(&a, &dir.path().join("from_adapter"), &o).unwrap();
    let summary = trainer(cfg).unwrap().run().unwrap();
    let kl = read_metrics(&summary.metrics).unwrap()[0]["kl/mean"]
        .as_f64()
        .unwrap();
    assert!(kl > 0.0, "{kl}");
    let o = [
        "worker.actor.model.lora.rank=8",
        "trainer.max_steps=1",
        from.as_str(),
    ];
    let cfg = config(&a, &dir.path().join("wrong_rank"), &o).unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(e.contains("r = 4") && e.contains("rank=4"), "{e}");
    let o = ["trainer.max_steps=1", from.as_str()];
    let e = config(&a, &dir.path().join("no_rank"), &o).unwrap_err();
    assert!(e.contains("worker.actor.model.lora.rank"), "{e}");

    // resuming a LoRA checkpoint without LoRA is refused, naming the setting
    let o = ["trainer.max_steps=3", "trainer.find_last_checkpoint=true"];
    let cfg = config(&a, &dir.path().join("run"), &o).unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(e.contains("worker.actor.model.lora"), "{e}");
}

#[test]
fn bad_inputs_fail_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let run = dir.path().join("bad");
    let err = |overrides: &[&str]| -> String {
        match config(&a, &run, overrides) {
            Err(e) => e,
            Ok(cfg) => trainer(cfg).unwrap_err().to_string(),
        }
    };
    let missing = err(&["data.train_files=/nonexistent/train.jsonl"]);
    assert!(missing.contains("/nonexistent/train.jsonl"), "{missing}");

    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let e = err(&[&format!("data.train_files={}", empty.display())]);
    assert!(e.contains("empty.jsonl"), "{e}");

    let no_answer = dir.path().join("no_answer.jsonl");
    std::fs::write(&no_answer, "{\"prompt\": \"1+1\"}\n").unwrap();
    let e = err(&[&format!("data.train_files={}", no_answer.display())]);
    assert!(e.contains("answer"), "{e}");

    let e = err(&["worker.rollout.n=1"]);
    assert!(e.contains("grpo"), "{e}");

    let e = err(&["worker.actor.model.model_path=/nonexistent/model"]);
    assert!(e.contains("/nonexistent/model"), "{e}");

    assert!(!run.exists(), "a failed start wrote {run:?}");
}

#[test]
fn drop_solved_removes_prompts_solved_with_low_entropy() {
    let dir = tempfile::tempdir().unwrap();
    // every response meets the only criterion (regex `.*`): every group is all-correct
    let path = dir.path().join("solved.jsonl");
    let mut text = String::new();
    for i in 0..4 {
        text.push_str(&format!(
            "{{\"prompt\": \"{i}+1\", \"global_id\": \"s{i}\", \"reward_model\": {{\"rubrics\": \
             [{{\"criterion\": \"anything\", \"points\": 1, \"regex\": \".*\"}}]}}}}\n"
        ));
    }
    std::fs::write(&path, text).unwrap();
    let lines = run(
        dir.path(),
        "solved",
        &[
            &format!("data.train_files={}", path.display()),
            "data.val_files=null",
            "data.shuffle=false",
            "algorithm.entropy_reward.enable=false",
            "worker.reward.grader=rubric",
            "algorithm.drop_solved.enable=true",
            "algorithm.drop_solved.entropy_threshold=100.0",
            "algorithm.drop_solved.consecutive=1",
        ],
    );
    assert_eq!(num(&lines[0], "data/dropped_solved"), 2.0);
    assert_eq!(num(&lines[1], "data/dropped_solved"), 4.0);
    assert_eq!(num(&lines[0], "accuracy/mean"), 1.0);
}

#[test]
fn an_interrupt_stops_before_the_next_step() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let cfg = config(&a, &dir.path().join("int"), &[]).unwrap();
    let flag = Arc::new(AtomicBool::new(true));
    let mut t = Trainer::new(cfg, CpuBackend, flag).unwrap();
    let summary = t.run().unwrap();
    assert!(summary.interrupted);
    assert_eq!(summary.steps, 0);
    assert_eq!(summary.checkpoint, None);
}

#[test]
fn a_fresh_run_refuses_a_directory_with_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let run_dir = dir.path().join("twice");
    let cfg = config(&a, &run_dir, &["trainer.max_steps=1"]).unwrap();
    trainer(cfg.clone()).unwrap().run().unwrap();
    let err = trainer(cfg).unwrap_err().to_string();
    assert!(err.contains("trainer.find_last_checkpoint=true"), "{err}");
    assert!(err.contains("step 1"), "{err}");
    // the checkpoint is still there
    assert!(run_dir.join("checkpoints").join("step_000001").exists());
}

#[test]
fn reduced_precision_matmuls_train_and_reach_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let exact = run(dir.path(), "f32", &[]);
    for p in ["tf32", "bf16"] {
        let lines = run(dir.path(), p, &[&format!("trainer.matmul_precision={p}")]);
        assert_eq!(lines.len(), 2, "{p}");
        assert_finite(&lines);
        // The first step starts from the same weights and seed: only the rounded products
        // can move its gradient norm (through the update's products, and through sampling,
        // which may pick other tokens from the slightly different probabilities).
        let (g, g32) = (
            num(&lines[0], "actor/grad_norm"),
            num(&exact[0], "actor/grad_norm"),
        );
        assert!(g != g32, "{p}: grad norm {g} equals f32's");
    }
    let a = assets(&dir.path().join("assets"));
    let e = config(
        &a,
        &dir.path().join("bad"),
        &["trainer.matmul_precision=fp8"],
    )
    .unwrap_err();
    assert!(e.contains("matmul_precision") && e.contains("fp8"), "{e}");
}

/// DAPO's soft overlong penalty (`worker.reward.overlong_buffer`) runs two steps and is
/// reported; a buffer longer than `data.max_response_length` is refused naming the key.
#[test]
fn dapo_overlong_penalty_trains_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run(
        dir.path(),
        "overlong",
        &[
            "worker.reward.overlong_buffer.enable=true",
            "worker.reward.overlong_buffer.len=6",
        ],
    );
    assert_eq!(lines.len(), 2);
    assert_finite(&lines);
    for l in &lines {
        let penalty = num(l, "reward/overlong");
        let frac = num(l, "response_length/overlong_frac");
        assert!(penalty <= 0.0 && (0.0..=1.0).contains(&frac), "{l:?}");
        assert_eq!(penalty < 0.0, frac > 0.0, "{l:?}");
    }
    let a = assets(&dir.path().join("assets"));
    let err = config(
        &a,
        &dir.path().join("bad"),
        &[
            "worker.reward.overlong_buffer.enable=true",
            "worker.reward.overlong_buffer.len=13",
        ],
    )
    .unwrap_err();
    assert!(err.contains("worker.reward.overlong_buffer.len"), "{err}");
}

/// bf16 decode weights, and a bf16 KV cache, for the rollout (with TIS correcting the
/// sampler/trainer gap) train two steps; each run differs from the f32 one; an unknown dtype
/// names the key.
#[test]
fn bf16_rollout_weights_and_kv_cache_train_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    let tis = "worker.actor.is_correction=tis";
    let f32_lines = deterministic(run(dir.path(), "f32", &[tis]));
    let a = assets(&dir.path().join("assets"));
    for key in ["weight_dtype", "kv_cache_dtype"] {
        let bf16 = format!("worker.rollout.{key}=bf16");
        let lines = run(dir.path(), key, &[&bf16, tis]);
        assert_eq!(lines.len(), 2);
        assert_finite(&lines);
        assert_ne!(
            deterministic(lines),
            f32_lines,
            "{key}: bf16 changed nothing"
        );
        let bad = format!("worker.rollout.{key}=fp8");
        let e = config(&a, &dir.path().join("bad"), &[&bad]).unwrap_err();
        assert!(e.contains(key) && e.contains("fp8"), "{e}");
    }
}

/// Forking tokens (docs/algorithms.md §16.1): two steps train with the kept fraction at
/// ⌈ρ·N⌉/N and a threshold reported; ρ = 1 keeps every token, so its run equals a run
/// without the option, metric for metric; ρ = 0.2 changes the update; ρ outside (0, 1] is an
/// error naming the key.
#[test]
fn forking_tokens_train_two_steps() {
    let dir = tempfile::tempdir().unwrap();
    let on = ["worker.actor.forking_tokens.enable=true"];
    let lines = run(dir.path(), "forking", &on);
    assert_eq!(lines.len(), 2);
    assert_finite(&lines);
    for l in &lines {
        // exactly ⌈0.2·N⌉ of the step's N response tokens (8 rows: 2 prompts × n = 4)
        let valid = (8.0 * num(l, "response_length/mean")).round();
        let kept = num(l, "forking/kept_frac") * valid;
        assert!(
            (kept - (0.2 * valid).ceil()).abs() < 1e-3,
            "{kept} of {valid}: {l:?}"
        );
        assert!(num(l, "forking/entropy_threshold") > 0.0, "{l:?}");
    }
    let strip = |lines: Vec<Map<String, Value>>| -> Vec<Map<String, Value>> {
        deterministic(lines)
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .filter(|(k, _)| !k.starts_with("forking/"))
                    .collect()
            })
            .collect()
    };
    let all = run(
        dir.path(),
        "forking-all",
        &[
            "worker.actor.forking_tokens.enable=true",
            "worker.actor.forking_tokens.rho=1",
        ],
    );
    assert_eq!(num(&all[0], "forking/kept_frac"), 1.0);
    let plain = run(dir.path(), "plain", &[]);
    assert_eq!(
        strip(all),
        strip(plain.clone()),
        "ρ = 1 must equal no forking"
    );
    assert_ne!(
        num(&lines[1], "actor/grad_norm"),
        num(&plain[1], "actor/grad_norm"),
        "ρ = 0.2 must change the update"
    );
    let a = assets(&dir.path().join("assets"));
    let err = config(
        &a,
        &dir.path().join("bad"),
        &["worker.actor.forking_tokens.rho=1.5"],
    )
    .unwrap_err();
    assert!(err.contains("worker.actor.forking_tokens.rho"), "{err}");
}

/// The entropy bonus (docs/algorithms.md §16.2). A fixed coefficient changes the update and
/// reports `actor/entropy_loss = −c·actor/entropy`. With a target above the batch entropy
/// the controller raises the coefficient by `lr·(target − H̄)` from the step's mean entropy
/// and stays within its bounds; 2 + resume + 2 steps equal 4 (the coefficient is in
/// `trainer_state.json`); bad keys are errors naming them.
#[test]
fn entropy_bonus_fixed_and_target_train_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = run(
        dir.path(),
        "fixed",
        &["worker.actor.entropy_bonus.coef=0.05"],
    );
    assert_finite(&fixed);
    let plain = run(dir.path(), "plain", &[]);
    for l in &fixed {
        assert_eq!(num(l, "actor/entropy_coef"), 0.05);
        let (h, loss) = (num(l, "actor/entropy"), num(l, "actor/entropy_loss"));
        assert!(h > 0.0 && (loss + 0.05 * h).abs() < 1e-9, "{l:?}");
    }
    assert_ne!(
        num(&fixed[0], "actor/grad_norm"),
        num(&plain[0], "actor/grad_norm"),
        "the bonus must change the gradient"
    );

    let target = [
        "worker.actor.entropy_bonus.target=5.0",
        "worker.actor.entropy_bonus.lr=0.001",
        "worker.actor.entropy_bonus.max_coef=0.1",
    ];
    let a = assets(&dir.path().join("assets"));
    let with = |run: &str, extra: &[&str]| {
        let mut o: Vec<&str> = target.to_vec();
        o.extend_from_slice(extra);
        config(&a, &dir.path().join(run), &o).unwrap()
    };
    let straight = trainer(with("straight", &["trainer.max_steps=4"]))
        .unwrap()
        .run()
        .unwrap();
    let want = deterministic(read_metrics(&straight.metrics).unwrap());
    // step 1 uses the starting 0; each step adds 0.001·(5 − H̄) with H̄ the step's entropy
    assert_eq!(num(&want[0], "actor/entropy_coef"), 0.0);
    for k in 1..4 {
        let step = 0.001 * (5.0 - num(&want[k - 1], "entropy/mean"));
        let got = num(&want[k], "actor/entropy_coef") - num(&want[k - 1], "actor/entropy_coef");
        assert!((got - step).abs() < 1e-9, "step {k}: {got} vs {step}");
    }
    trainer(with("resumed", &["trainer.max_steps=2"]))
        .unwrap()
        .run()
        .unwrap();
    let resumed = trainer(with(
        "resumed",
        &["trainer.max_steps=4", "trainer.find_last_checkpoint=true"],
    ))
    .unwrap()
    .run()
    .unwrap();
    let got = deterministic(read_metrics(&resumed.metrics).unwrap());
    assert_eq!(
        got, want,
        "2 + resume + 2 must equal 4 with the controller's state"
    );

    for (key, bad) in [
        ("worker.actor.entropy_bonus.target", "-0.1"),
        ("worker.actor.entropy_bonus.coef", "-1"),
        ("worker.actor.entropy_bonus.max_coef", "-1"),
    ] {
        let e = config(&a, &dir.path().join("bad"), &[&format!("{key}={bad}")]).unwrap_err();
        assert!(e.contains(key), "{e}");
    }
    // a starting coefficient outside the controller's bounds
    let e = config(
        &a,
        &dir.path().join("bad"),
        &[
            "worker.actor.entropy_bonus.target=0.5",
            "worker.actor.entropy_bonus.coef=0.5",
        ],
    )
    .unwrap_err();
    assert!(e.contains("worker.actor.entropy_bonus.coef"), "{e}");
}

/// Forking tokens and the entropy bonus together work with every advantage estimator, every
/// policy loss and every loss aggregation mode: two steps with finite metrics, the kept
/// fraction reported, the bonus's loss term `−c·entropy`.
#[test]
fn controls_work_with_every_estimator_loss_and_aggregation() {
    let dir = tempfile::tempdir().unwrap();
    let controls = [
        "worker.actor.forking_tokens.enable=true",
        "worker.actor.forking_tokens.rho=0.3",
        "worker.actor.entropy_bonus.coef=0.01",
    ];
    let mut cases: Vec<(String, Vec<String>)> = Vec::new();
    for est in [
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce",
        "reinforce_baseline",
        "reinforce_pro_max",
    ] {
        cases.push((est.into(), vec![format!("algorithm.adv_estimator={est}")]));
    }
    for loss in ["gspo", "gspo_token", "cispo", "clip_cov", "kl_cov"] {
        cases.push((
            loss.into(),
            vec![format!("worker.actor.policy_loss={loss}")],
        ));
    }
    for agg in [
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ] {
        cases.push((
            agg.into(),
            vec![format!("worker.actor.loss_agg_mode={agg}")],
        ));
    }
    for (name, extra) in cases {
        let mut o: Vec<&str> = controls.to_vec();
        o.extend(extra.iter().map(String::as_str));
        o.push("worker.actor.ppo_epochs=2");
        let lines = run(dir.path(), &name, &o);
        assert_eq!(lines.len(), 2, "{name}");
        assert_finite(&lines);
        for l in &lines {
            assert!(num(l, "forking/kept_frac") >= 0.3, "{name}: {l:?}");
            let (h, loss) = (num(l, "actor/entropy"), num(l, "actor/entropy_loss"));
            assert!(h > 0.0 && (loss + 0.01 * h).abs() < 1e-9, "{name}: {l:?}");
        }
    }
}

/// A Python reward function in EasyR1's interface that computes ARES's shaping from the
/// fields the trainer passes gives the built-in rewards (step 1: same rollout), and trains.
#[test]
fn python_reward_function_gives_the_builtin_rewards() {
    if !has_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "worker.reward.reward_function={}:compute_score",
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/reward_function/ares_entropy_shaping.py")
            .display()
    );
    let builtin = run(dir.path(), "builtin", &[]);
    let function = run(dir.path(), "function", &[&spec]);
    assert_eq!(function.len(), 2);
    assert_finite(&function);
    let (b, f) = (&builtin[0], &function[0]);
    assert!(
        num(b, "reward/entropy") != 0.0,
        "the step must shape: {b:?}"
    );
    for (key, other) in [
        ("reward/mean", "reward/mean"),
        ("reward/mean", "reward_function/overall"),
        ("reward/entropy", "reward_function/entropy"),
        ("accuracy/mean", "reward_function/accuracy"),
    ] {
        assert!(
            (num(b, key) - num(f, other)).abs() <= 1e-12,
            "{key} {} vs {other} {}",
            num(b, key),
            num(f, other)
        );
    }
    // the function's reward replaces the built-in terms, which may not be added to it
    let a = assets(&dir.path().join("assets"));
    let err = config(
        &a,
        &dir.path().join("clash"),
        &[&spec, "worker.reward.format_weight=0.5"],
    )
    .unwrap_err();
    assert!(
        err.contains("worker.reward.format_weight") && err.contains("gives the whole reward"),
        "{err}"
    );
}

/// `examples/configs/easyr1_aepo_math.yaml`, an EasyR1 / ARES-fork config with engine knobs
/// and a Python reward function, trains two steps on the demo model with only its data,
/// model and sizes overridden.
#[test]
fn easyr1_style_example_config_trains_two_steps() {
    if !has_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = root.join("examples/configs/easyr1_aepo_math.yaml");
    let run_dir = dir.path().join("easyr1");
    let overrides = [
        format!("data.train_files={}", a.train.display()),
        format!("data.val_files={}", a.eval.display()),
        "data.prompt_key=prompt".into(),
        "data.format_prompt=null".into(),
        "data.max_prompt_length=40".into(),
        "data.max_response_length=12".into(),
        "data.rollout_batch_size=2".into(),
        "data.bootstrap=false".into(),
        "algorithm.online_filtering=false".into(),
        format!("worker.actor.model.model_path={}", a.model_dir.display()),
        "worker.actor.global_batch_size=2".into(),
        "worker.actor.micro_batch_size_per_device_for_update=4".into(),
        "worker.rollout.n=4".into(),
        format!(
            "worker.reward.reward_function={}:compute_score",
            root.join("examples/reward_function/ares_entropy_shaping.py")
                .display()
        ),
        format!("trainer.save_checkpoint_path={}", run_dir.display()),
        "trainer.max_steps=2".into(),
        "trainer.val_before_train=false".into(),
    ];
    let (cfg, notes) = Config::load_with_notes(Some(&example), &overrides).unwrap();
    assert!(notes.len() > 10, "{notes:#?}");
    assert_eq!(cfg.worker.actor.loss_agg_mode.name(), "token-mean");
    let summary = trainer(cfg).unwrap().run().unwrap();
    let lines = read_metrics(&summary.metrics).unwrap();
    assert_eq!(lines.len(), 2);
    assert_finite(&lines);
    for l in &lines {
        assert_eq!(num(l, "reward/mean"), num(l, "reward_function/overall"));
    }
}

/// EasyR1's checkpoint modes: resuming from a named checkpoint of another run gives the
/// uninterrupted run's steps; a model-only checkpoint holds no optimizer or trainer state
/// and is refused for resuming, saying what to do instead; `val_only` validates and stops.
#[test]
fn checkpoint_paths_and_modes() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let cfg = config(&a, &dir.path().join("straight"), &["trainer.max_steps=4"]).unwrap();
    let straight = trainer(cfg).unwrap().run().unwrap();
    let want = deterministic(read_metrics(&straight.metrics).unwrap());

    // trainer.load_checkpoint_path: step 2 of another run, into a new run directory
    let cfg = config(&a, &dir.path().join("first"), &["trainer.max_steps=2"]).unwrap();
    trainer(cfg).unwrap().run().unwrap();
    let step2 = dir.path().join("first/checkpoints/step_000002");
    let cfg = config(
        &a,
        &dir.path().join("second"),
        &[
            "trainer.max_steps=4",
            &format!("trainer.load_checkpoint_path={}", step2.display()),
        ],
    )
    .unwrap();
    let mut t = trainer(cfg).unwrap();
    assert_eq!(t.state.step, 2);
    let got = deterministic(read_metrics(&t.run().unwrap().metrics).unwrap());
    assert_eq!(got, want[2..]);

    // trainer.save_model_only
    let only = dir.path().join("only");
    let cfg = config(
        &a,
        &only,
        &["trainer.max_steps=1", "trainer.save_model_only=true"],
    )
    .unwrap();
    let saved = trainer(cfg).unwrap().run().unwrap().checkpoint.unwrap();
    assert!(saved.join("model/config.json").is_file());
    assert!(!saved.join("optimizer.safetensors").exists());
    assert!(!saved.join("trainer_state.json").exists());
    let cfg = config(
        &a,
        &only,
        &["trainer.max_steps=2", "trainer.find_last_checkpoint=true"],
    )
    .unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(
        e.contains("holds no optimizer and trainer state")
            && e.contains("worker.actor.model.model_path="),
        "{e}"
    );
    let cfg = config(
        &a,
        &dir.path().join("third"),
        &[&format!("trainer.load_checkpoint_path={}", saved.display())],
    )
    .unwrap();
    assert!(
        trainer(cfg)
            .unwrap_err()
            .to_string()
            .contains("save_model_only")
    );
    let cfg = config(
        &a,
        &dir.path().join("fourth"),
        &[&format!(
            "trainer.load_checkpoint_path={}",
            dir.path().display()
        )],
    )
    .unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(e.contains("not a checkpoint directory"), "{e}");
}

/// `trainer.val_only` validates before training and stops: no step, no checkpoint.
#[test]
fn val_only_validates_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let run = dir.path().join("val_only");
    let cfg = config(&a, &run, &["trainer.val_only=true"]).unwrap();
    ares_runner::commands::train(cfg, &[], true).unwrap();
    assert!(!run.join("metrics.jsonl").exists());
    assert!(!run.join("checkpoints").exists());
    let cfg = config(&a, &run, &["trainer.val_only=true", "data.val_files=null"]).unwrap();
    let e = ares_runner::commands::train(cfg, &[], true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("set data.val_files"), "{e}");
}

/// `data.override_chat_template` replaces the model's chat template (a jinja file, as EasyR1
/// reads it); `worker.actor.model.tokenizer_path` reads the tokenizer and template from
/// another folder than the weights.
#[test]
fn chat_template_override_and_tokenizer_path() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let template = dir.path().join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}:{% endif %}",
    )
    .unwrap();
    let cfg = config(
        &a,
        &dir.path().join("t"),
        &[&format!(
            "data.override_chat_template={}",
            template.display()
        )],
    )
    .unwrap();
    let r = ares_runner::trainer::setup::renderer(&cfg, &a.model_dir).unwrap();
    let examples =
        ares_runner::trainer::setup::load_examples(&cfg, &a.train.display().to_string()).unwrap();
    let text = r.text(&examples[0], None).unwrap();
    assert!(text.starts_with('[') && text.ends_with("]:"), "{text}");
    let cfg = config(
        &a,
        &dir.path().join("t"),
        &["data.override_chat_template=/nonexistent/t.jinja"],
    )
    .unwrap();
    let e = ares_runner::trainer::setup::renderer(&cfg, &a.model_dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.override_chat_template = /nonexistent/t.jinja"),
        "{e}"
    );

    // the weights alone in one folder, the tokenizer in another
    let bare = dir.path().join("weights");
    std::fs::create_dir_all(&bare).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(a.model_dir.join(f), bare.join(f)).unwrap();
    }
    let with = |tokenizer: Option<&Path>| {
        let mut o = vec![format!("worker.actor.model.model_path={}", bare.display())];
        if let Some(t) = tokenizer {
            o.push(format!("worker.actor.model.tokenizer_path={}", t.display()));
        }
        let o: Vec<&str> = o.iter().map(String::as_str).collect();
        config(&a, &dir.path().join("w"), &o).unwrap()
    };
    let e = trainer(with(None)).unwrap_err().to_string();
    assert!(e.contains("weights"), "{e}");
    let mut t = trainer(with(Some(&a.model_dir))).unwrap();
    assert_eq!(t.run().unwrap().steps, 2);
}

/// `data.mini_rollout_batch_size`: prompts generated per round; a step takes rounds until
/// its batch is full, within `trainer.max_try_make_batch`.
#[test]
fn mini_rollout_batches_fill_a_step_in_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run(dir.path(), "mini", &["data.mini_rollout_batch_size=1"]);
    for l in &lines {
        assert_eq!(num(l, "filter/rounds"), 2.0, "{l:?}");
    }
    let a = assets(&dir.path().join("assets"));
    let cfg = config(
        &a,
        &dir.path().join("mini_short"),
        &[
            "data.mini_rollout_batch_size=1",
            "trainer.max_try_make_batch=1",
        ],
    )
    .unwrap();
    let e = trainer(cfg).unwrap().run().unwrap_err().to_string();
    assert!(
        e.contains("collected 1 of 2 groups") && e.contains("data.mini_rollout_batch_size"),
        "{e}"
    );
}

/// `algorithm.disable_kl`: no KL anywhere; `optim.lr_warmup_ratio`: the warm-up as a
/// fraction of the run's optimizer steps, `lr_warmup_steps` winning when both are set.
#[test]
fn disable_kl_and_warmup_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run(
        dir.path(),
        "nokl",
        &[
            "algorithm.disable_kl=true",
            "worker.actor.optim.lr_warmup_ratio=1.0",
        ],
    );
    for l in &lines {
        assert!(l.get("kl/mean").is_none(), "{l:?}");
        assert_eq!(num(l, "actor/kl_loss"), 0.0);
    }
    // 2 steps of one optimizer step each, both warm-up: lr/2, then lr
    assert_eq!(num(&lines[0], "actor/lr"), 0.5e-3);
    assert_eq!(num(&lines[1], "actor/lr"), 1.0e-3);
    let lines = run(
        dir.path(),
        "steps_win",
        &[
            "worker.actor.optim.lr_warmup_ratio=1.0",
            "worker.actor.optim.lr_warmup_steps=0",
        ],
    );
    assert_eq!(num(&lines[0], "actor/lr"), 1.0e-3);
}

/// A prompt of more bytes than `data.max_prompt_length` tokens can cover is overlong without
/// being rendered or tokenized (a book in a row costs nothing): dropped when filtering,
/// else named with its lower bound.
#[test]
fn book_length_prompts_are_refused_before_tokenizing() {
    // tokenizing the 16 MiB row would hold millions of tokens with their offsets; reading
    // the file (twice: read and parsed) and training the tiny model stay far below
    let Some(_peak) = ares_tests::bounded::rerun(
        "book_length_prompts_are_refused_before_tokenizing",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 256,
        },
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let train = dir.path().join("with_book.jsonl");
    let mut rows = std::fs::read_to_string(&a.train).unwrap();
    let book = "1+1 ".repeat(4 << 20); // 16 MiB
    rows.push_str(&format!(
        "{{\"prompt\": \"{book}\", \"answer\": \"2\", \"global_id\": \"book\"}}\n"
    ));
    std::fs::write(&train, rows).unwrap();
    let cfg = config(
        &a,
        &dir.path().join("book"),
        &[&format!("data.train_files={}", train.display())],
    )
    .unwrap();
    let t = std::time::Instant::now();
    let mut tr = trainer(cfg).unwrap();
    assert!(!tr.train.iter().any(|e| e.global_id == "book"));
    assert_eq!(tr.run().unwrap().steps, 2);
    eprintln!("with a 16 MiB row: {:?}", t.elapsed());
    let cfg = config(
        &a,
        &dir.path().join("book2"),
        &[
            &format!("data.train_files={}", train.display()),
            "data.filter_overlong_prompts=false",
        ],
    )
    .unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(
        e.contains("(book): prompt of at least") && e.contains("data.max_prompt_length = 40"),
        "{e}"
    );
}

/// A model whose `config.json` declares more than this machine holds is refused before its
/// weights are read, with its memory plan and the settings that would shrink it; under the
/// bound a child process
/// checks that nothing of that size was reserved.
#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_before_loading() {
    let Some(_peak) = ares_tests::bounded::rerun(
        "a_run_that_cannot_fit_in_memory_is_refused_before_loading",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 256,
        },
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let path = a.model_dir.join("config.json");
    let mut c: Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // ~2.7 × 10¹² parameters: 10 TB in f32, 50 TB with gradients, moments and reference
    c.insert("num_hidden_layers".into(), 4096.into());
    c.insert("intermediate_size".into(), 100_000_000.into());
    std::fs::write(&path, serde_json::to_string(&c).unwrap()).unwrap();
    let cfg = config(&a, &dir.path().join("run"), &[]).unwrap();
    let e = trainer(cfg).unwrap_err().to_string();
    assert!(
        e.contains("this run needs up to")
            && e.contains("weights and RoPE tables (f32)")
            && e.contains("AdamW moments")
            && e.contains("available"),
        "{e}"
    );
}

/// The memory plan against the measured peak: a run whose sequences all reach their
/// longest (a random model rarely ends a response) peaks within 10 % of the plan's figure
/// (resident memory over what the process held before the trainer began, in a child
/// process of its own).
#[test]
fn the_memory_plan_is_within_10_percent_of_the_measured_peak() {
    plan_against_peak(
        "the_memory_plan_is_within_10_percent_of_the_measured_peak",
        &[],
        true,
    );
}

/// [`the_memory_plan_is_within_10_percent_of_the_measured_peak`] with 8-bit optimizer
/// moments (a quarter of the f32 moments' bytes in the plan, and in the run).
#[test]
fn the_memory_plan_holds_with_int8_optimizer_states() {
    let name = "the_memory_plan_holds_with_int8_optimizer_states";
    plan_against_peak(name, &["worker.actor.optim.state_dtype=int8"], true);
}

/// The plan of a LoRA run (rank 8 on every linear layer): no base gradients or moments,
/// no reference copy (the base with the adapters off), the pairs and their activations.
#[test]
fn the_memory_plan_holds_with_lora() {
    let name = "the_memory_plan_holds_with_lora";
    // (responses of 64 tokens: the few MiB no plan counts — threads, the allocator —
    // stay a small part of a plan this small)
    let o = [
        "worker.actor.model.lora.rank=8",
        "data.max_response_length=64",
    ];
    plan_against_peak(name, &o, false);
}

/// The run of the plan tests, in a child process re-running test `name`, with `extra`
/// overrides; `reference`: the run holds a reference copy.
fn plan_against_peak(name: &str, extra: &[&str], reference: bool) {
    let Some(mut peak) = ares_tests::bounded::rerun(
        name,
        ares_tests::bounded::Bounds {
            address_space_mib: 16_384,
            peak_rss_mib: 4096,
        },
    ) else {
        return;
    };
    ares_runner::host_memory::release_big_buffers();
    let dir = tempfile::tempdir().unwrap();
    let a = write_demo_assets_with(
        &dir.path().join("assets"),
        &DemoOptions {
            seed: 3,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 384,
                layers: 6,
                heads: 6,
                kv_heads: 2,
                intermediate: 1024,
                max_positions: 2048,
                ..TinyModelSpec::default()
            },
            vocab_size: 8192,
        },
    )
    .unwrap();
    let mut overrides = vec!["data.max_response_length=24", "trainer.save_freq=0"];
    overrides.extend_from_slice(extra);
    let cfg = config(&a, &dir.path().join("run"), &overrides).unwrap();
    let longest = cfg.data.max_response_length as f64;
    let plan = ares_runner::trainer::run::memory_plan(&cfg, &a.model_dir, true, reference, None, 0)
        .unwrap();
    peak.restart();
    let summary = trainer(cfg).unwrap().run().unwrap();
    let measured = peak.added_kib().map(|k| k << 10);
    let lines = read_metrics(&summary.metrics).unwrap();
    assert_eq!(
        num(&lines[0], "response_length/mean"),
        longest,
        "every response at its longest"
    );
    if let Some(measured) = measured {
        let planned = plan.peak();
        let ratio = measured as f64 / planned as f64;
        eprintln!(
            "measured {measured} bytes, planned {planned}: {ratio:.3}\n{}",
            plan.table()
        );
        assert!(
            (0.9..=1.1).contains(&ratio),
            "measured / planned = {ratio:.3}\n{}",
            plan.table()
        );
    }
}

/// `data.tools` and `data.apply_chat_template_kwargs` (verl's key) are rendered into every
/// prompt by the chat template; a variable ares sets itself and a malformed tools file are
/// refused by key.
#[test]
fn tools_and_template_variables_reach_every_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let template = dir.path().join("t.jinja");
    std::fs::write(
        &template,
        "{{ tools|length if tools else 0 }}{{ 7 if enable_thinking is false else 3 }}|\
         {% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    .unwrap();
    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "calc"}},
            {"type": "function", "function": {"name": "search"}}]"#,
    )
    .unwrap();
    let t = format!("data.override_chat_template={}", template.display());
    let text = |overrides: &[&str]| {
        let mut all = vec![t.as_str()];
        all.extend_from_slice(overrides);
        let cfg = config(&a, &dir.path().join("t"), &all).unwrap();
        let r = ares_runner::trainer::setup::renderer(&cfg, &a.model_dir)?;
        let examples =
            ares_runner::trainer::setup::load_examples(&cfg, &a.train.display().to_string())
                .unwrap();
        r.text(&examples[0], None)
    };
    assert!(text(&[]).unwrap().starts_with("03|"));
    let tools_key = format!("data.tools={}", tools.display());
    let with = text(&[
        &tools_key,
        "data.apply_chat_template_kwargs.enable_thinking=false",
    ])
    .unwrap();
    assert!(with.starts_with("27|"), "{with}");

    let e = config(
        &a,
        &dir.path().join("t"),
        &["data.apply_chat_template_kwargs.add_generation_prompt=false"],
    )
    .unwrap_err();
    assert!(
        e.contains("data.apply_chat_template_kwargs.add_generation_prompt"),
        "{e}"
    );
    std::fs::write(&tools, "not json").unwrap();
    let e = text(&[&tools_key]).unwrap_err().to_string();
    assert!(e.contains("data.tools") && e.contains("not JSON"), "{e}");
}

/// A dataset whose files hold more bytes than the memory available is refused before its
/// rows are read (here the memory is stated with `ARES_MEMORY_LIMIT`, in a child process);
/// a limit that is not a size is named.
#[test]
fn a_dataset_larger_than_memory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let cfg = dir.path().join("run.yaml");
    std::fs::write(
        &cfg,
        format!(
            "data:\n  train_files: {}\nworker:\n  actor:\n    model:\n      model_path: {}\n\
             trainer:\n  save_checkpoint_path: {}\n",
            a.train.display(),
            a.model_dir.display(),
            dir.path().join("out").display()
        ),
    )
    .unwrap();
    let train = |limit: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"))
            .args(["train", "-c"])
            .arg(&cfg)
            .env("ARES_MEMORY_LIMIT", limit)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = train("100");
    assert!(
        e.contains("the dataset's files hold")
            && e.contains("(ARES_MEMORY_LIMIT)")
            && e.contains("loaded into memory whole"),
        "{e}"
    );
    let e = train("lots");
    assert!(
        e.contains("ARES_MEMORY_LIMIT=\"lots\" is not a size"),
        "{e}"
    );
}

/// A rollout whose KV cache passes the memory available (stated with `ARES_MEMORY_LIMIT`,
/// in a child process) runs with the pool capped to what the rest of the plan leaves, and
/// trains as the uncapped run does — the engine holds fewer sequences at once, preempting
/// and restarting the others with the same tokens; a limit without room for one sequence
/// is refused, naming the bf16 cache among the ways to fit.
#[test]
fn a_rollout_too_large_for_memory_runs_with_its_kv_pool_capped() {
    use ares_runner::trainer::setup::memory::{Fit, fit};
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let overrides = [
        "data.max_response_length=64",
        "data.rollout_batch_size=8",
        "trainer.max_steps=1",
    ];
    let cfg = config(&a, &dir.path().join("capped"), &overrides).unwrap();
    let reference = ares_runner::trainer::setup::settings::step_settings(&cfg, 1)
        .unwrap()
        .kl
        .enabled;
    let plan = ares_runner::trainer::run::memory_plan(&cfg, &a.model_dir, true, reference, None, 0)
        .unwrap();
    assert_eq!(
        plan.peak_phase().unwrap().name,
        "rollout",
        "{}",
        plan.table()
    );
    let kv = plan.kv.unwrap();
    let rollout = plan.phases.iter().find(|p| p.name == "rollout").unwrap();
    let pool = rollout.parts[kv.part].bytes;
    let without_pool = plan.peak() - pool;
    // the other phases must fit too: room for a quarter of the planned pool's blocks
    let others = plan
        .phases
        .iter()
        .filter(|p| p.name != "rollout")
        .map(|p| plan.held_total() + p.total())
        .max()
        .unwrap();
    let per = kv.blocks_per_sequence;
    let blocks = (pool / kv.block_bytes / 4).max(per);
    let limit = (without_pool + (blocks + 1) * kv.block_bytes).max(others);
    let blocks = (limit - without_pool) / kv.block_bytes - 1;
    let sequences = blocks / per;
    assert!(limit < plan.peak() && sequences >= 1, "{}", plan.table());
    assert_eq!(fit(&plan, limit), Some(Fit::KvCapped { blocks, sequences }));
    assert_eq!(fit(&plan, without_pool + per * kv.block_bytes), None);
    let train = |name: &str, limit: Option<u64>| {
        config(&a, &dir.path().join(name), &[]).unwrap(); // writes <name>.yaml
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"));
        cmd.args(["train", "-c"])
            .arg(dir.path().join(name).with_extension("yaml"))
            .args(overrides);
        if let Some(l) = limit {
            cmd.env("ARES_MEMORY_LIMIT", l.to_string());
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (
            out.status.success(),
            err,
            dir.path().join(name).join("metrics.jsonl"),
        )
    };
    let (ok, err, capped) = train("capped", Some(limit));
    assert!(ok, "{err}");
    assert!(
        err.contains(&format!("KV cache is capped at {blocks} blocks"))
            && err.contains(&format!("about {sequences} sequences")),
        "{err}"
    );
    let (ok, err, whole) = train("whole", None);
    assert!(ok && !err.contains("capped"), "{err}");
    let (capped, whole) = (
        read_metrics(&capped).unwrap(),
        read_metrics(&whole).unwrap(),
    );
    assert_eq!(deterministic(capped), deterministic(whole));
    let (ok, err, _) = train("refused", Some(without_pool + per * kv.block_bytes));
    assert!(
        !ok && err.contains("worker.rollout.kv_cache_dtype=bf16"),
        "{err}"
    );
}

/// `worker.actor.model.enable_gradient_checkpointing` recomputes each layer's
/// activations in the backward pass: the run is the stored run, metric for metric.
#[test]
fn gradient_checkpointing_trains_as_the_stored_activations() {
    let dir = tempfile::tempdir().unwrap();
    // three layers: the arena keeps one layer's activations of three
    let a = write_demo_assets_with(
        &dir.path().join("assets"),
        &DemoOptions {
            seed: 3,
            train_per_level: 4,
            eval_per_level: 2,
            sft_examples: 8,
            model: TinyModelSpec {
                hidden: 32,
                layers: 3,
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
    let go = |name: &str, overrides: &[&str]| {
        let cfg = config(&a, &dir.path().join(name), overrides).unwrap();
        let summary = trainer(cfg).unwrap().run().unwrap();
        read_metrics(&summary.metrics).unwrap()
    };
    let stored = go("stored", &[]);
    let checkpointed = go(
        "checkpointed",
        &["worker.actor.model.enable_gradient_checkpointing=true"],
    );
    assert!(num(&stored[1], "actor/grad_norm") > 0.0);
    assert_eq!(deterministic(checkpointed), deterministic(stored));
}

/// An interaction program answers every turn without calls: its turns are counted, its
/// scores reach the reward (`reward/interaction`, weight 1), and a program that fails ends
/// its episodes without stopping the run; a bad interaction setting is refused by key.
#[test]
fn an_interaction_answers_turns_and_scores_them() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let config_json: Value = serde_json::from_str(
        &std::fs::read_to_string(a.model_dir.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let template = dir.path().join("tools.jinja");
    std::fs::write(
        &template,
        format!(
            "{{# calls go in <tool_call></tool_call> #}}{}",
            config_json["chat_template"].as_str().unwrap()
        ),
    )
    .unwrap();
    let t = format!("data.override_chat_template={}", template.display());
    let on = "worker.rollout.multi_turn.enable=true";
    let turns = "worker.rollout.multi_turn.max_assistant_turns=3";
    let long = "data.max_response_length=48";
    // (scripts in files: written by a child, so no test thread holds them open)
    let script = |name: &str, body: &str| {
        let path = dir.path().join(name);
        let status = std::process::Command::new("sh")
            .args(["-c", &format!("cat > '{}'", path.display())])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(body.as_bytes())?;
                c.wait()
            })
            .unwrap();
        assert!(status.success());
        path
    };
    let more = script(
        "more.sh",
        "while read -r l; do echo '{\"content\": \"more\", \"reward\": 0.5}'; done\n",
    );
    let more = format!(
        "worker.rollout.multi_turn.interaction={{command: 'sh {}'}}",
        more.display()
    );
    let lines = run(dir.path(), "more", &[&t, on, turns, long, &more]);
    let mut answered = 0.0;
    for line in &lines {
        let per = num(line, "tools/interaction_turns_per_response");
        // every response of the batch: its turns answered times 0.5
        assert!(
            (num(line, "reward/interaction") - 0.5 * per).abs() < 1e-9,
            "{line:?}"
        );
        assert_eq!(num(line, "tools/interaction_error_ratio"), 0.0);
        answered += per;
    }
    assert!(
        answered > 0.0,
        "no turn ended for the interaction to answer"
    );
    let broken = script("broken.sh", "read -r l; exit 1\n");
    let broken = format!(
        "worker.rollout.multi_turn.interaction={{command: 'sh {}', reward_weight: 0}}",
        broken.display()
    );
    let lines = run(dir.path(), "broken", &[&t, on, turns, long, &broken]);
    let failed: f64 = lines
        .iter()
        .map(|l| num(l, "tools/interaction_error_ratio"))
        .sum();
    assert!(failed > 0.0);
    for line in &lines {
        assert_eq!(num(line, "reward/interaction"), 0.0);
    }
    let e = config(
        &a,
        &dir.path().join("bad"),
        &["worker.rollout.multi_turn.interaction={command: x, timeout_s: -1}"],
    )
    .unwrap_err();
    assert!(e.contains("multi_turn.interaction.timeout_s"), "{e}");
}

/// `worker.rollout.multi_turn` rolls out episodes: a model that calls no tool trains
/// exactly as the single-turn rollout (its first round samples alike, and no token is
/// masked out), with the tool counts reported; without a chat template that shows a
/// tool-call format, episodes are refused.
#[test]
fn multi_turn_without_calls_trains_as_single_turn() {
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let single = run(dir.path(), "single", &[]);
    let e = trainer(
        config(
            &a,
            &dir.path().join("refused"),
            &["worker.rollout.multi_turn.enable=true"],
        )
        .unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("shows no tool-call format"), "{e}");
    // the demo's template, marked as teaching <tool_call> (it ignores the tools otherwise)
    let config_json: Value = serde_json::from_str(
        &std::fs::read_to_string(a.model_dir.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let template = dir.path().join("tools.jinja");
    std::fs::write(
        &template,
        format!(
            "{{# calls go in <tool_call></tool_call> #}}{}",
            config_json["chat_template"].as_str().unwrap()
        ),
    )
    .unwrap();
    let t = format!("data.override_chat_template={}", template.display());
    let plain = run(dir.path(), "plain", &[&t]);
    let episodes = run(
        dir.path(),
        "episodes",
        &[&t, "worker.rollout.multi_turn.enable=true"],
    );
    assert_eq!(deterministic(plain.clone()), deterministic(single));
    for (p, e) in plain.iter().zip(&episodes) {
        assert_eq!(num(e, "tools/turns_per_response"), 1.0);
        assert_eq!(num(e, "tools/calls_per_response"), 0.0);
        // no call: the prompts prefilled once for their samples
        assert!(num(e, "tools/prefill_saving") >= 1.0);
        let e: Map<String, Value> = e
            .iter()
            .filter(|(k, _)| !k.starts_with("tools/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(deterministic(vec![e]), deterministic(vec![p.clone()]));
    }

    // tools answered by programs take their schemas from data.tools
    let commands = "worker.rollout.multi_turn.tool_commands=[{name: lookup, command: cat}]";
    let on = "worker.rollout.multi_turn.enable=true";
    let e = trainer(config(&a, &dir.path().join("no_schema"), &[&t, on, commands]).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`lookup` has no schema in data.tools"), "{e}");
    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "lookup", "parameters": {}}}]"#,
    )
    .unwrap();
    let with_tools = format!("data.tools={}", tools.display());
    // (and the bootstrap rolls out episodes too)
    let lines = run(
        dir.path(),
        "commands",
        &[&t, on, commands, &with_tools, "data.bootstrap=true"],
    );
    assert_eq!(lines.len(), episodes.len());
    let e = config(
        &a,
        &dir.path().join("bad"),
        &["worker.rollout.multi_turn.tool_commands=[{name: x, command: cat, timeout_s: 0}]"],
    )
    .unwrap_err();
    assert!(e.contains("tool_commands[0].timeout_s"), "{e}");
}

/// The loss on the device (`Backend::actor_loss`, what every run takes) and on the host
/// (the path of a backend that declines) train alike, bit for bit, with every term on: the
/// importance correction, the forking mask, the dynamic KL term and the entropy bonus, over
/// the aggregations and every policy loss (Clip-Cov's seed derived alike on both paths).
#[test]
fn device_and_host_losses_train_alike() {
    use ares_runner::backend::Counting;
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let base = [
        "trainer.max_steps=2",
        "data.bootstrap=true",
        "algorithm.use_kl_loss=true",
        "worker.actor.entropy_bonus.coef=0.01",
        "worker.actor.forking_tokens.enable=true",
        "worker.actor.is_correction=tis",
    ];
    let losses: [&[&str]; 5] = [
        &[
            "worker.actor.policy_loss=ppo",
            "worker.actor.loss_agg_mode=token-mean",
        ],
        &[
            "worker.actor.policy_loss=gspo",
            "worker.actor.loss_agg_mode=seq-mean-token-mean",
        ],
        &[
            "worker.actor.policy_loss=cispo",
            "worker.actor.loss_agg_mode=seq-mean-token-sum-norm",
        ],
        &[
            "worker.actor.policy_loss=clip_cov",
            "worker.actor.clip_cov_ratio=0.3",
            "worker.actor.clip_cov_lb=-100",
            "worker.actor.clip_cov_ub=100",
            "worker.actor.loss_agg_mode=token-sum",
        ],
        &[
            "worker.actor.policy_loss=kl_cov",
            "worker.actor.kl_cov_ratio=0.1",
            "worker.actor.loss_agg_mode=seq-mean-token-sum",
        ],
    ];
    for (i, extra) in losses.iter().enumerate() {
        let o: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        let run = |host: bool| {
            let name = format!("run{i}{}", if host { "h" } else { "d" });
            let cfg = config(&a, &dir.path().join(name), &o).unwrap_or_else(|e| panic!("{e}"));
            let be = if host {
                Counting::with_host_loss(CpuBackend)
            } else {
                Counting::new(CpuBackend)
            };
            let probe = be.clone();
            let mut t = Trainer::new(cfg, be, Arc::new(AtomicBool::new(false))).unwrap();
            let summary = t.run().unwrap();
            let calls = probe.take().calls;
            (
                deterministic(read_metrics(&summary.metrics).unwrap()),
                calls,
            )
        };
        let (device, dc) = run(false);
        let (host, hc) = run(true);
        assert_eq!(device, host, "{extra:?}");
        // the device path called the op; the host path never did
        assert!(dc.contains(&"actor_loss"), "{extra:?}");
        assert!(!hc.contains(&"actor_loss"), "{extra:?}");
    }
}

/// The host waits of a step are the ones where the host decides: the HWE pass reads its
/// per-row thresholds (τ moves on the host) and then its counts; the actor's and the
/// reference's scoring passes and the KL run back to back, and their results come back
/// together after the KL; the micro-batches' loss reports are read once the mini-batch's
/// backwards are all queued.
#[test]
fn a_steps_waits_are_where_the_host_decides() {
    use ares_runner::backend::Counting;
    const WAITS: [&str; 6] = [
        "download",
        "download_ids",
        "download_half",
        "synchronize",
        "pick_tokens",
        "sums_of_squares",
    ];
    let dir = tempfile::tempdir().unwrap();
    let a = assets(&dir.path().join("assets"));
    let o = ["trainer.max_steps=1", "algorithm.use_kl_loss=true"];
    let cfg = config(&a, &dir.path().join("r"), &o).unwrap();
    let be = Counting::new(CpuBackend);
    let probe = be.clone();
    Trainer::new(cfg, be, Arc::new(AtomicBool::new(false)))
        .unwrap()
        .run()
        .unwrap();
    let calls = probe.take().calls;
    let at = |name: &str| calls.iter().position(|c| *c == name).unwrap();
    let rollout_end = calls.iter().rposition(|c| *c == "pick_tokens").unwrap();
    let (kl, loss) = (at("masked_dynamic_kl"), at("actor_loss"));
    let waits = |from: usize, to: usize| -> Vec<&str> {
        calls[from..to]
            .iter()
            .copied()
            .filter(|c| WAITS.contains(c))
            .collect()
    };
    // the HWE pass: thresholds and their validity, then counts and soft costs
    assert_eq!(waits(rollout_end + 1, kl), ["download"; 4], "{calls:?}");
    let hwe_done = (rollout_end + 1..kl)
        .rev()
        .find(|&i| calls[i] == "download")
        .unwrap();
    // ... before the scoring passes begin (each starts with the token embedding)
    let scoring = (rollout_end + 1..kl)
        .find(|&i| calls[i] == "embedding")
        .unwrap();
    assert!(hwe_done < scoring, "{:?}", &calls[rollout_end..kl]);
    // after the KL: logπ_old, the rows' mean KL, logπ_ref and the HWE mask (the host loss's
    // inputs), then the update
    assert_eq!(waits(kl, loss), ["download"; 4], "{calls:?}");
    // the loss is queued and the backward after it with no wait between them (a loss that
    // waited was noted a second time under its name), and then its report is read
    let backward = (loss..calls.len())
        .find(|&i| calls[i] == "embedding_backward")
        .unwrap();
    let between = &calls[loss + 1..backward];
    assert!(
        between
            .iter()
            .all(|c| !WAITS.contains(c) && *c != "actor_loss"),
        "{between:?}"
    );
    assert_eq!(
        calls[backward..].iter().find(|c| WAITS.contains(c)),
        Some(&"download"),
        "the report"
    );
    // ... and only once the mini-batch's other micro-batches are queued too (two here: 8
    // rows, 4 a micro-batch)
    let second = (loss + 1..calls.len())
        .find(|&i| calls[i] == "actor_loss")
        .unwrap();
    assert!(
        waits(loss + 1, second).is_empty(),
        "{:?}",
        &calls[loss..=second]
    );
}
