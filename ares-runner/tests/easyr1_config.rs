//! EasyR1's config schema (and the ARES fork's) is known key by key
//! (`config/easyr1.rs`): every key of the hand-written defaults fixtures resolves alone and
//! in its file, each one read differently leaves a note, refused values say why, and
//! unknown keys still stop with the did-you-mean message.

use std::path::{Path, PathBuf};

use ares_runner::config::{
    Config, ConfigNote, KlCtrl, LossAggMode, NoteAction, PolicyLoss, WeightDtype,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/easyr1")
        .join(name)
}

/// The dotted keys and values of the leaves of a YAML file (an empty mapping is a leaf).
fn leaves(path: &Path) -> Vec<(String, Value)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, child) in m {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, child, out);
                }
            }
            leaf => out.push((prefix.to_string(), leaf.clone())),
        }
    }
    let text = std::fs::read_to_string(path).unwrap();
    let tree: Value = serde_saphyr::from_str(&text).unwrap();
    let mut out = Vec::new();
    walk("", &tree, &mut out);
    out
}

fn load(path: Option<&Path>, overrides: &[&str]) -> Result<(Config, Vec<ConfigNote>), String> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load_with_notes(path, &overrides).map_err(|e| e.to_string())
}

fn noted(notes: &[ConfigNote], key: &str) -> bool {
    notes
        .iter()
        .any(|n| n.key == key || n.key == format!("{key}.*"))
}

#[test]
fn every_easyr1_key_resolves_alone() {
    for file in ["easyr1_defaults.yaml", "ares_fork_defaults.yaml"] {
        let keys = leaves(&fixture(file));
        assert!(keys.len() > 10, "{file}: {} keys", keys.len());
        for (key, value) in keys {
            let o = format!("{key}={value}");
            match (key.as_str(), load(None, &[&o])) {
                (_, Ok(_)) => {}
                // EasyR1's own default n = 1 is too small for GRPO there too
                ("worker.rollout.n", Err(e)) => assert!(e.contains("needs n >= 2"), "{e}"),
                (_, Err(e)) => panic!("{file}: {o}: {e}"),
            }
        }
    }
}

#[test]
fn easyr1_defaults_file_resolves_as_easyr1_reads_it() {
    let (c, notes) = load(
        Some(&fixture("easyr1_defaults.yaml")),
        &["worker.rollout.n=2"],
    )
    .unwrap();
    let a = &c.worker.actor;
    assert_eq!(c.data.train_files, None, "'' is no file");
    assert_eq!(c.data.rollout_batch_size, 512);
    assert_eq!(a.global_batch_size, 256);
    assert_eq!(a.micro_batch_size_per_device_for_update, 4);
    assert_eq!(a.loss_agg_mode, LossAggMode::TokenMean);
    assert_eq!(a.policy_loss, PolicyLoss::Ppo);
    assert_eq!(a.optim.min_lr_ratio, 0.0);
    assert_eq!(a.optim.lr_warmup_steps, None);
    assert!(!c.algorithm.use_kl_loss && !c.algorithm.disable_kl);
    assert_eq!(c.algorithm.kl_type, KlCtrl::Fixed);
    assert_eq!(c.worker.rollout.top_k, 0, "-1 is off");
    assert_eq!(c.worker.rollout.weight_dtype, WeightDtype::Bf16);
    // an empty val_override_config: every sampling setting is the rollout's, one sample
    assert_eq!(c.worker.rollout.val_temperature(), 1.0);
    assert_eq!(c.worker.rollout.val_n(), 1);
    assert_eq!(
        (
            c.trainer.save_freq,
            c.trainer.val_freq,
            c.trainer.save_limit
        ),
        (0, 0, 0)
    );
    assert!(c.trainer.find_last_checkpoint);
    for key in [
        "worker.actor.fsdp",
        "worker.actor.offload",
        "worker.critic",
        "worker.ref.fsdp",
        "worker.rollout.tensor_parallel_size",
        "data.val_batch_size",
        "algorithm.lam",
    ] {
        assert!(noted(&notes, key), "no note for {key}: {notes:#?}");
    }
    assert!(
        notes
            .iter()
            .all(|n| n.origin.contains("easyr1_defaults.yaml"))
    );
    // the resolved config, written out, loads back equal and without notes
    let dir = tempfile::tempdir().unwrap();
    let resolved = dir.path().join("resolved.yaml");
    std::fs::write(&resolved, c.to_yaml()).unwrap();
    let (back, again) = load(Some(&resolved), &[]).unwrap();
    assert_eq!(back, c);
    assert!(again.is_empty(), "{again:#?}");
}

#[test]
fn ares_fork_defaults_file_resolves() {
    let (c, notes) = load(Some(&fixture("ares_fork_defaults.yaml")), &[]).unwrap();
    assert_eq!(c.algorithm.kl_type, KlCtrl::Adaptive);
    assert!(!c.worker.actor.dynamic_kl_loss);
    assert_eq!(
        c.worker.reward.reward_type,
        Some(ares_runner::config::RewardType::Batch)
    );
    assert!(noted(&notes, "algorithm.difficulty_aware_kl_penalty"));
    assert!(noted(&notes, "worker.actor.enable_second_chance_kl"));
    assert!(
        notes
            .iter()
            .any(|n| n.key == "worker.actor.optim.warmup_style"
                && n.action
                    == NoteAction::Renamed {
                        to: "worker.actor.optim.lr_scheduler_type".into()
                    })
    );
}

#[test]
fn older_names_and_easyr1_values_are_read_with_a_note() {
    let (c, notes) = load(
        None,
        &[
            "worker.actor.model_path=/m",
            "trainer.output_dir=/runs/x",
            "trainer.resume=true",
            "worker.rollout.val_temperature=0.5",
            "worker.actor.loss_avg_mode=seq",
            "worker.actor.loss_type=gspo",
            "worker.reward.reward_type=rubric",
            "algorithm.max_try_make_batch=-1",
            "algorithm.entropy_reward.enable=false",
        ],
    )
    .unwrap();
    assert_eq!(c.worker.actor.model.model_path.as_deref(), Some("/m"));
    assert_eq!(c.trainer.save_checkpoint_path.as_deref(), Some("/runs/x"));
    assert!(c.trainer.find_last_checkpoint);
    assert_eq!(c.worker.rollout.val_temperature(), 0.5);
    assert_eq!(c.worker.actor.loss_agg_mode, LossAggMode::SeqMeanTokenMean);
    assert_eq!(c.worker.actor.policy_loss, PolicyLoss::GspoToken);
    assert_eq!(
        c.worker.reward.grader,
        ares_runner::config::RewardGrader::Rubric
    );
    assert_eq!(c.worker.reward.reward_type, None);
    assert_eq!(c.trainer.max_try_make_batch, -1);
    assert_eq!(notes.len(), 8, "{notes:#?}");
    assert!(notes.iter().all(|n| n.origin.starts_with("from override")));
    let shown = notes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        shown.contains("worker.actor.model_path (from override `worker.actor.model_path=/m`): read as `worker.actor.model.model_path`"),
        "{shown}"
    );
    assert!(
        shown.contains("read as `worker.actor.loss_agg_mode: seq-mean-token-mean`"),
        "{shown}"
    );
}

#[test]
fn a_file_with_both_names_of_a_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("both.yaml");
    std::fs::write(
        &path,
        "worker:\n  actor:\n    model_path: /a\n    model:\n      model_path: /b\n",
    )
    .unwrap();
    let e = load(Some(&path), &[]).unwrap_err();
    assert!(
        e.contains("worker.actor.model_path") && e.contains("also set"),
        "{e}"
    );
}

/// EasyR1's LoRA block as its example configs write it turns LoRA on: every linear layer
/// (of the language model, with the tower excluded) at `α = 64` unless named otherwise.
#[test]
fn easyr1_lora_settings_load() {
    let (c, _) = load(
        None,
        &["worker.actor.model.lora={rank: 8, alpha: 16, target_modules: all-linear, exclude_modules: .*visual.*}"],
    )
    .unwrap();
    let peft = c.worker.actor.model.lora.peft().unwrap().unwrap();
    assert_eq!((peft.r, peft.lora_alpha), (8, 16.0));
    assert_eq!(peft.target_modules, ares_runner::hf::lora::ALL_LINEAR);
    assert_eq!(peft.exclude_modules.as_deref(), Some(".*visual.*"));
    let (c, _) = load(
        None,
        &[
            "worker.actor.model.lora.rank=4",
            "worker.actor.model.lora.target_modules=[v_proj, q_proj]",
        ],
    )
    .unwrap();
    let peft = c.worker.actor.model.lora.peft().unwrap().unwrap();
    assert_eq!((peft.r, peft.lora_alpha), (4, 64.0));
    assert_eq!(peft.target_modules, ["v_proj", "q_proj"]);
    assert_eq!(peft.exclude_modules, None);
    let (c, _) = load(None, &[]).unwrap();
    assert_eq!(
        c.worker.actor.model.lora.peft().unwrap(),
        None,
        "off by default"
    );
}

#[test]
fn values_easyr1_has_and_ares_does_not_are_refused_with_the_reason() {
    for (o, want) in [
        (
            "worker.actor.model.lora={rank: 16, target_modules: [q_proj, lm_head]}",
            "worker.actor.model.lora.target_modules",
        ),
        (
            "worker.actor.model.lora={rank: 16, exclude_modules: .*mlp.*}",
            "worker.actor.model.lora.exclude_modules",
        ),
        ("worker.actor.loss_type=sapo", "SAPO loss is not built"),
        (
            "worker.actor.loss_avg_mode=tokens",
            "expected `token` or `seq`",
        ),
        ("worker.actor.optim.strategy=sgd", "expected `adamw`"),
        (
            "worker.actor.optim.strategy=adamw_bf16",
            "`worker.actor.optim.state_dtype: bf16`",
        ),
        ("worker.rollout.ignore_eos=true", "stops a response at EOS"),
        ("worker.rollout.dtype=fp16", "expected `bf16` or `fp32`"),
        (
            "worker.actor.model.override_config={hidden_act: gelu}",
            "config.json",
        ),
        (
            "trainer.logger=[console, neptune]",
            "unknown variant `neptune`",
        ),
        (
            "worker.rollout.val_override_config={temperature: 0.5, repetition_penalty: 1.1}",
            "`repetition_penalty` cannot be overridden",
        ),
        ("trainer.val_only=true", "trainer.val_before_train = false"),
    ] {
        let r = load(None, &[o, "trainer.val_before_train=false"]);
        let e = r.err().unwrap_or_else(|| panic!("{o} was accepted"));
        assert!(e.contains(want), "{o}: {e}");
    }
}

#[test]
fn unknown_keys_still_stop_with_a_suggestion() {
    let e = load(None, &["worker.actor.global_batchsize=8"]).unwrap_err();
    assert!(e.contains("did you mean `global_batch_size`"), "{e}");
    let e = load(None, &["worker.critic_x.model_path=/m"]).unwrap_err();
    assert!(e.contains("unknown key `worker.critic_x`"), "{e}");
}

#[test]
fn val_override_config_replaces_the_default_as_easyr1_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.yaml");
    std::fs::write(
        &path,
        "worker:\n  rollout:\n    temperature: 0.9\n    top_p: 0.8\n    val_override_config: {top_p: 0.95, n: 2}\n",
    )
    .unwrap();
    let (c, _) = load(Some(&path), &[]).unwrap();
    let r = &c.worker.rollout;
    // temperature left out: the rollout's, not the default's greedy 0
    assert_eq!(
        (r.val_temperature(), r.val_top_p(), r.val_n()),
        (0.9, 0.95, 2)
    );
    // without the key: greedy, one sample (ares's default)
    let (c, _) = load(None, &[]).unwrap();
    assert_eq!(
        (c.worker.rollout.val_temperature(), c.worker.rollout.val_n()),
        (0.0, 1)
    );
}
