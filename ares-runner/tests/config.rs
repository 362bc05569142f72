//! The trainer configuration end to end: defaults against the spec, YAML files, dotted
//! overrides, the errors a user sees, the resolved-YAML round trip and the example configs.

use std::path::{Path, PathBuf};

use ares_runner::config::{
    AdvEstimator, Config, ConfigError, Device, IsMode, KlCtrl, KlEstimator, LossAggMode,
    LrScheduler, PerBucket, PolicyLoss, RewardGrader, RubricGrader, RubricSchedule, SaveDtypeCfg,
};

fn load(yaml: &str, overrides: &[&str]) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("cfg.yaml");
    std::fs::write(&path, yaml).expect("write config");
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(Some(&path), &overrides)
}

fn with_overrides(overrides: &[&str]) -> Result<Config, ConfigError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(None, &overrides)
}

fn message(result: Result<Config, ConfigError>) -> String {
    result.expect_err("should be rejected").to_string()
}

#[test]
fn defaults_are_the_spec_values() {
    let c = Config::load(None, &[]).expect("defaults load");
    assert_eq!(c, Config::default());

    // data
    assert_eq!(c.data.train_files, None);
    assert_eq!(c.data.prompt_key, "prompt");
    assert_eq!(c.data.answer_key, "answer");
    assert_eq!(c.data.rubrics_key, "reward_model.rubrics");
    assert_eq!(
        (c.data.max_prompt_length, c.data.max_response_length),
        (512, 512)
    );
    assert_eq!(c.data.rollout_batch_size, 8);
    assert!(c.data.bootstrap && c.data.shuffle && c.data.filter_overlong_prompts);

    // §1–§3: entropy, difficulty, shaping
    let a = &c.algorithm;
    let e = &a.entropy_reward;
    assert!(e.enable && !e.window_includes_self);
    assert_eq!(c.worker.rollout.window_size, 4);
    assert_eq!((e.percentile, e.tau_momentum), (95.0, 0.99));
    assert!(e.trigger_words.is_empty());
    assert_eq!(
        (e.alpha_init, e.alpha_lr, e.alpha_min, e.alpha_max),
        (0.5, 0.05, 0.0, 2.0)
    );
    assert_eq!((e.target_update_interval, e.target_momentum), (1, 1.0));
    assert_eq!(e.target_scale, PerBucket::new(1.0, 1.0, 1.0));
    assert_eq!(e.margin_fraction, PerBucket::new(0.15, 0.25, 0.35));
    assert_eq!(e.huber_kappa, PerBucket::new(2.0, 3.0, 4.0));
    assert_eq!(e.sigmoid_temperature, PerBucket::new(2.0, 2.5, 3.0));
    assert_eq!(e.cap_scale, PerBucket::new(1.0, 1.0, 1.2));
    assert_eq!(e.wrong_factor, PerBucket::new(0.6, 0.8, 1.0));
    assert_eq!(a.difficulty_thresholds.easy, 2.0 / 3.0);
    assert_eq!(a.difficulty_thresholds.medium, 1.0 / 3.0);
    assert_eq!(
        a.dual_ascent.lambda_init,
        PerBucket::new(0.002, 0.001, 0.0005)
    );
    assert_eq!(a.dual_ascent.budget, PerBucket::new(0.05, 0.1, 0.2));
    assert_eq!((a.dual_ascent.eta, a.dual_ascent.lambda_max), (0.01, 10.0));

    // §4 KL
    assert!(a.use_kl_loss);
    assert_eq!(a.kl_penalty, KlEstimator::K3);
    assert_eq!(a.kl_type, KlCtrl::DualAscent);
    assert_eq!((a.kl_coef, a.kl_target, a.kl_horizon), (1e-3, 0.1, 10000.0));
    assert!(c.worker.actor.dynamic_kl_loss);
    assert_eq!(c.worker.actor.dynamic_kl_low_ratio, 0.5);

    // §5 advantages
    assert_eq!(a.adv_estimator, AdvEstimator::Grpo);
    assert!(a.norm_adv_by_std_in_grpo && !a.uniform_scale);
    assert_eq!((a.gamma, a.pro_max_max_scale), (1.0, 10.0));

    // §6 policy loss
    let actor = &c.worker.actor;
    assert_eq!(
        (
            actor.clip_ratio_low,
            actor.clip_ratio_high,
            actor.clip_ratio_dual
        ),
        (0.2, 0.3, 3.0)
    );
    assert_eq!(actor.loss_agg_mode, LossAggMode::TokenMean);
    assert_eq!(actor.is_correction, IsMode::None);
    assert_eq!(
        (actor.is_threshold_low, actor.is_threshold_high),
        (0.5, 5.0)
    );
    assert_eq!(actor.optim.lr, 1e-6);
    assert_eq!(actor.optim.betas, [0.9, 0.999]);
    assert_eq!(actor.optim.lr_scheduler_type, LrScheduler::Constant);

    // §7 filtering
    assert!(a.online_filtering);
    assert_eq!(a.filter_key, "accuracy");
    assert_eq!(
        (a.filter_low, a.filter_high, c.trainer.max_try_make_batch),
        (0.01, 0.99, 20)
    );
    assert!(!a.drop_solved.enable);

    // §8 GRPO-λ
    assert!(!a.grpo_lambda.enable);
    assert_eq!((a.grpo_lambda.lambda, a.grpo_lambda.alpha), (0.2, 0.6));

    // §9 graded prompts, rollout, reward
    let r = &c.worker.rollout;
    assert_eq!((r.n, r.temperature, r.top_p, r.top_k), (8, 1.0, 1.0, 0));
    assert_eq!((r.val_temperature(), r.val_n()), (0.0, 1));
    assert!(!r.enable_graded_system_prompt);
    assert_eq!(r.graded.schedule, RubricSchedule::Linear);
    assert_eq!(r.graded.full_reveal_count, 1);
    assert_eq!((r.graded.power, r.graded.x0, r.graded.k), (2.0, 0.3, 10.0));
    assert!(r.graded.hide_criteria_instruction);
    assert!(!r.graded.add_base_when_zero && !r.graded.graded_prompt_in_training);
    assert_eq!(c.worker.reward.grader, RewardGrader::Math);
    assert_eq!(c.worker.reward.format_weight, 0.0);
    assert_eq!(c.worker.reward.rubric_grader, RubricGrader::Builtin);

    // trainer, sft
    assert_eq!(c.trainer.device, Device::Cpu);
    assert_eq!(c.trainer.save_dtype, SaveDtypeCfg::F32);
    assert_eq!((c.trainer.save_freq, c.trainer.save_limit), (0, 2));
    assert_eq!(c.trainer.max_steps, None);
    assert!(!c.sft.enable);
    assert_eq!(
        (c.sft.lr, c.sft.batch_size, c.sft.max_length),
        (1e-4, 16, 1024)
    );
}

#[test]
fn file_values_override_defaults_and_partial_sections_keep_the_rest() {
    let c = load(
        "worker:\n  rollout:\n    n: 4\n  ref:\nalgorithm:\n  dual_ascent:\n    budget: {easy: 0.5}\n",
        &[],
    )
    .expect("valid");
    assert_eq!(c.worker.rollout.n, 4);
    assert_eq!(c.worker.rollout.temperature, 1.0);
    // Medium and hard keep their own spec defaults, not some shared fallback.
    assert_eq!(
        c.algorithm.dual_ascent.budget,
        PerBucket::new(0.5, 0.1, 0.2)
    );
    assert_eq!(c.worker.ref_.model_path, None);
}

#[test]
fn overrides_set_nested_list_null_and_enum_values() {
    let c = load(
        "data:\n  train_files: data/train.jsonl\n",
        &[
            "worker.rollout.n=4",
            "algorithm.adv_estimator=rloo",
            "worker.actor.optim.betas=[0.9,0.99]",
            "data.train_files=null",
            "algorithm.entropy_reward.trigger_words=[wait, hmm]",
            "algorithm.dual_ascent.lambda_init.hard=0.01",
            "algorithm.entropy_reward.huber_kappa={easy: 1.5}",
            "trainer.experiment_name=2024",
            "trainer.max_steps=10",
            "worker.ref.model_path=models/ref",
        ],
    )
    .expect("valid overrides");
    assert_eq!(c.worker.rollout.n, 4);
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Rloo);
    assert_eq!(c.worker.actor.optim.betas, [0.9, 0.99]);
    assert_eq!(c.data.train_files, None);
    assert_eq!(c.algorithm.entropy_reward.trigger_words, ["wait", "hmm"]);
    assert_eq!(c.algorithm.dual_ascent.lambda_init.hard, 0.01);
    assert_eq!(
        c.algorithm.entropy_reward.huber_kappa,
        PerBucket::new(1.5, 3.0, 4.0)
    );
    assert_eq!(c.trainer.experiment_name, "2024");
    assert_eq!(c.trainer.max_steps, Some(10));
    assert_eq!(c.worker.ref_.model_path.as_deref(), Some("models/ref"));
}

#[test]
fn later_overrides_win() {
    let c = with_overrides(&["worker.rollout.n=4", "worker.rollout.n=6"]).expect("valid");
    assert_eq!(c.worker.rollout.n, 6);
}

#[test]
fn aliases_of_enum_spellings_are_accepted() {
    let c = with_overrides(&[
        "algorithm.kl_penalty=k1",
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "worker.actor.loss_agg_mode=seq_mean_token_sum_norm",
    ])
    .expect("aliases");
    assert_eq!(c.algorithm.kl_penalty, KlEstimator::K1);
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::ReinforceBaseline);
    assert_eq!(
        c.worker.actor.loss_agg_mode,
        LossAggMode::SeqMeanTokenSumNorm
    );
    let c = with_overrides(&["algorithm.kl_penalty=k2"]).expect("k2");
    assert_eq!(c.algorithm.kl_penalty, KlEstimator::K2);
    let c = with_overrides(&["algorithm.kl_penalty=k3"]).expect("k3");
    assert_eq!(c.algorithm.kl_penalty, KlEstimator::K3);
}

#[test]
fn unknown_key_in_a_file_names_the_key_and_the_valid_keys() {
    let text = message(load("worker:\n  rollout:\n    temprature: 0.7\n", &[]));
    assert!(
        text.contains("unknown key `worker.rollout.temprature`"),
        "{text}"
    );
    assert!(text.contains("cfg.yaml"), "{text}");
    assert!(text.contains("did you mean `temperature`"), "{text}");
    assert!(
        text.contains("valid keys of `worker.rollout`: n, temperature, top_p"),
        "{text}"
    );

    let text = message(load("trainers:\n  seed: 3\n", &[]));
    assert!(text.contains("unknown key `trainers`"), "{text}");
    assert!(
        text.contains("valid keys of the top level: data, algorithm, worker, trainer, sft"),
        "{text}"
    );
}

#[test]
fn unknown_key_in_an_override_names_the_key_and_the_valid_keys() {
    let text = message(with_overrides(&["worker.actor.optim.learning_rate=1e-5"]));
    assert!(
        text.contains("unknown key `worker.actor.optim.learning_rate`"),
        "{text}"
    );
    assert!(
        text.contains("from override `worker.actor.optim.learning_rate=1e-5`"),
        "{text}"
    );
    assert!(
        text.contains("valid keys of `worker.actor.optim`: lr, betas, eps"),
        "{text}"
    );
    let text = message(with_overrides(&["worker.rolout.n=4"]));
    assert!(text.contains("unknown key `worker.rolout`"), "{text}");
    assert!(text.contains("did you mean `rollout`"), "{text}");
    let text = message(with_overrides(&["worker.rollout.n.x=4"]));
    assert!(
        text.contains("`worker.rollout.n` is a value, not a section"),
        "{text}"
    );
}

#[test]
fn wrong_types_name_the_key_and_the_source() {
    let text = message(with_overrides(&["worker.rollout.n=x"]));
    assert_eq!(
        text,
        "`worker.rollout.n` (from override `worker.rollout.n=x`): invalid type: string \"x\", expected usize"
    );
    let text = message(load("algorithm:\n  gamma: high\n", &[]));
    assert!(text.starts_with("`algorithm.gamma` (in "), "{text}");
    assert!(
        text.contains("cfg.yaml): invalid type: string \"high\", expected f64"),
        "{text}"
    );
    let text = message(with_overrides(&[
        "worker.actor.optim.betas=[0.9, 0.99, 0.5]",
    ]));
    assert!(text.starts_with("`worker.actor.optim.betas`"), "{text}");
    let text = message(with_overrides(&["algorithm.adv_estimator=ppo"]));
    assert!(text.contains("`algorithm.adv_estimator`"), "{text}");
    assert!(text.contains("unknown variant `ppo`"), "{text}");
    assert!(text.contains("`reinforce_pro_max`"), "{text}");
    let text = message(load("algorithm:\n  dual_ascent:\n    budget: 0.1\n", &[]));
    assert!(
        text.contains("`algorithm.dual_ascent.budget`") && text.contains("must be a mapping"),
        "{text}"
    );
    let text = message(with_overrides(&["trainer.experiment_name=null"]));
    assert!(text.contains("`trainer.experiment_name`"), "{text}");
}

#[test]
fn malformed_yaml_reports_file_and_line() {
    let err = load("data:\n  train_files: [a,\nworker: {}\n", &[]).expect_err("malformed");
    match &err {
        ConfigError::Yaml {
            source_name, line, ..
        } => {
            assert!(source_name.ends_with("cfg.yaml"), "{source_name}");
            assert!(*line >= 2, "line {line}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("malformed YAML in"), "{text}");

    let text = message(load("worker:\n  rollout:\n    n: 4\n    n: 5\n", &[]));
    assert!(text.contains("line 4"), "{text}");
    assert!(text.contains("duplicate"), "{text}");
    let text = message(load("algorithm:\n  gamma: .nan\n", &[]));
    assert!(text.contains("line 2"), "{text}");
    let text = message(load("- data\n- worker\n", &[]));
    assert!(text.contains("must be a mapping"), "{text}");
}

#[test]
fn bad_override_text_is_explained() {
    let text = message(with_overrides(&["worker.rollout.n"]));
    assert!(text.starts_with("bad override `worker.rollout.n`: expected dotted.key=value"));
    let text = message(with_overrides(&["worker.rollout.n="]));
    assert!(text.contains("no value after `=`"), "{text}");
    let text = message(with_overrides(&["worker.actor.optim.betas=[0.9,"]));
    assert!(text.contains("malformed YAML in override"), "{text}");
}

#[test]
fn out_of_range_values_name_key_value_and_range() {
    let text = message(with_overrides(&["worker.rollout.temperature=0"]));
    assert_eq!(
        text,
        "worker.rollout.temperature = 0 is out of range: expected > 0"
    );
    let text = message(with_overrides(&[
        "algorithm.filter_low=0.5",
        "algorithm.filter_high=0.4",
    ]));
    assert_eq!(
        text,
        "algorithm.filter_high = 0.4 is out of range: expected in (algorithm.filter_low = 0.5, 1]"
    );
    let text = message(with_overrides(&["algorithm.entropy_reward.alpha_init=3"]));
    assert!(
        text.starts_with("algorithm.entropy_reward.alpha_init = 3 is out of range"),
        "{text}"
    );
    assert!(text.contains("alpha_max = 2"), "{text}");
    let text = message(with_overrides(&["worker.rollout.window_size=0"]));
    assert_eq!(
        text,
        "worker.rollout.window_size = 0 is out of range: expected >= 1"
    );
    let text = message(with_overrides(&[
        "worker.rollout.multi_turn.call_cost=-0.1",
    ]));
    assert_eq!(
        text,
        "worker.rollout.multi_turn.call_cost = -0.1 is out of range: expected >= 0 and finite"
    );
    let text = message(with_overrides(&["worker.rollout.n=0"]));
    assert!(
        text.starts_with("worker.rollout.n = 0 is out of range"),
        "{text}"
    );
    let text = message(with_overrides(&["worker.actor.clip_ratio_dual=0.5"]));
    assert!(text.contains("0 (off) or > 1"), "{text}");
    let text = message(with_overrides(&["algorithm.entropy_reward.percentile=101"]));
    assert!(text.contains("in [0, 100]"), "{text}");
    with_overrides(&["worker.actor.clip_ratio_dual=0", "trainer.device=cuda"])
        .expect("dual clip off, cuda allowed");
    let text = message(with_overrides(&["worker.actor.clip_cov_ub=0.5"]));
    assert_eq!(
        text,
        "worker.actor.clip_cov_ub = 0.5 is out of range: expected > worker.actor.clip_cov_lb"
    );
    let text = message(with_overrides(&["worker.actor.kl_cov_ratio=0"]));
    assert!(
        text.contains("kl_cov_ratio = 0") && text.contains("(0, 1]"),
        "{text}"
    );
    let text = message(with_overrides(&["worker.actor.ppo_kl_coef=-1"]));
    assert!(text.contains("ppo_kl_coef = -1"), "{text}");
}

#[test]
fn policy_losses_and_straight_through_kl_are_selectable() {
    for (name, loss) in [
        ("ppo", PolicyLoss::Ppo),
        ("vanilla", PolicyLoss::Ppo),
        ("gspo", PolicyLoss::Gspo),
        ("gspo_token", PolicyLoss::GspoToken),
        ("cispo", PolicyLoss::Cispo),
        ("clip_cov", PolicyLoss::ClipCov),
        ("kl_cov", PolicyLoss::KlCov),
    ] {
        let c = with_overrides(&[&format!("worker.actor.policy_loss={name}")]).expect(name);
        assert_eq!(c.worker.actor.policy_loss, loss);
        let back = Config::from_yaml_str(&c.to_yaml(), "resolved").expect("round trip");
        assert_eq!(back.worker.actor.policy_loss, loss);
    }
    let text = message(with_overrides(&["worker.actor.policy_loss=grpo"]));
    assert!(text.contains("worker.actor.policy_loss"), "{text}");
    for (name, kl) in [("k1+", KlEstimator::K1Plus), ("k3+", KlEstimator::K3Plus)] {
        let c = with_overrides(&[&format!("algorithm.kl_penalty={name}")]).expect(name);
        assert_eq!(c.algorithm.kl_penalty, kl);
        let back = Config::from_yaml_str(&c.to_yaml(), "resolved").expect("round trip");
        assert_eq!(back.algorithm.kl_penalty, kl);
    }
    let c = with_overrides(&["worker.actor.loss_agg_mode=token-sum"]).expect("token-sum");
    assert_eq!(c.worker.actor.loss_agg_mode, LossAggMode::TokenSum);
}

#[test]
fn one_sample_per_prompt_is_refused_by_group_methods() {
    let text = message(with_overrides(&["worker.rollout.n=1"]));
    assert!(text.contains("worker.rollout.n = 1"), "{text}");
    assert!(text.contains("algorithm.adv_estimator = grpo"), "{text}");
    for estimator in ["dr_grpo", "rloo", "reinforce_baseline", "reinforce_pro_max"] {
        let text = message(with_overrides(&[
            "worker.rollout.n=1",
            &format!("algorithm.adv_estimator={estimator}"),
        ]));
        assert!(text.contains(&format!("= {estimator}")), "{text}");
    }
    let text = message(with_overrides(&[
        "worker.rollout.n=1",
        "algorithm.adv_estimator=reinforce",
    ]));
    assert!(text.contains("online filtering"), "{text}");
    with_overrides(&[
        "worker.rollout.n=1",
        "algorithm.adv_estimator=reinforce",
        "algorithm.online_filtering=false",
    ])
    .expect("REINFORCE++ needs no group");
}

#[test]
fn rubric_command_is_required_for_the_command_grader() {
    let base = [
        "worker.reward.grader=rubric",
        "algorithm.entropy_reward.enable=false",
        "worker.reward.rubric_grader=command",
    ];
    let text = message(with_overrides(&base));
    assert!(text.contains("worker.reward.rubric_command"), "{text}");
    let mut ok = base.to_vec();
    ok.push("worker.reward.rubric_command=python3 judge.py --model x");
    let c = with_overrides(&ok).expect("with a command");
    assert_eq!(
        c.worker.reward.rubric_command.as_deref(),
        Some("python3 judge.py --model x")
    );
}

#[test]
fn missing_file_names_the_path() {
    let err = Config::load(Some(Path::new("/nonexistent/ares.yaml")), &[]).expect_err("missing");
    assert!(matches!(err, ConfigError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/ares.yaml"));
}

/// A configuration with every enum and many values away from their defaults.
fn unusual() -> Config {
    let mut c = Config::default();
    c.data.train_files = Some("data/x.parquet".into());
    c.data.format_prompt = Some("a: b #c.jinja".into());
    c.algorithm.adv_estimator = AdvEstimator::ReinforceProMax;
    c.algorithm.kl_penalty = KlEstimator::Abs;
    c.algorithm.kl_type = KlCtrl::Adaptive;
    c.algorithm.kl_coef = 1e-7;
    c.algorithm.difficulty_thresholds.easy = 0.7;
    c.algorithm.entropy_reward.trigger_words = vec!["wait".into(), "yes".into(), "1".into()];
    c.algorithm.entropy_reward.alpha_init = 0.1 + 0.2;
    c.trainer.max_try_make_batch = -1;
    c.worker.actor.loss_agg_mode = LossAggMode::SeqMeanTokenMean;
    c.worker.actor.is_correction = IsMode::ReinforcePro;
    c.worker.actor.optim.lr_scheduler_type = LrScheduler::Cosine;
    c.worker.actor.optim.betas = [0.0, 0.95];
    c.worker.rollout.graded.schedule = RubricSchedule::StepSigmoid;
    c.worker.rollout.top_p = 0.95;
    c.worker.ref_.model_path = Some("null".into());
    c.worker.reward.rubric_grader = RubricGrader::Command;
    c.worker.reward.rubric_command = Some("judge --x 'y'".into());
    c.trainer.experiment_name = "007".into();
    c.trainer.max_steps = Some(3);
    c.trainer.device = Device::Auto;
    c.trainer.save_dtype = SaveDtypeCfg::Bf16;
    c.trainer.seed = u64::MAX;
    c
}

#[test]
fn resolved_yaml_loads_back_equal() {
    for c in [Config::default(), unusual()] {
        c.validate().expect("valid");
        let yaml = c.to_yaml();
        let back = Config::from_yaml_str(&yaml, "resolved.yaml")
            .unwrap_or_else(|e| panic!("{e}\n--- yaml ---\n{yaml}"));
        assert_eq!(back, c, "{yaml}");
    }
    let yaml = Config::default().to_yaml();
    assert!(yaml.contains("adv_estimator: grpo"), "{yaml}");
    assert!(yaml.contains("loss_agg_mode: token-mean"), "{yaml}");
    assert!(yaml.contains("ref:"), "{yaml}");
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs")
}

#[test]
fn example_configs_load() {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(examples_dir()).expect("examples/configs") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let c = Config::load(Some(&path), &[])
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let back = Config::from_yaml_str(&c.to_yaml(), "resolved").expect("round trip");
            assert_eq!(back, c, "{}", path.display());
            names.push(path.file_name().map(|n| n.to_string_lossy().into_owned()));
        }
    }
    names.sort();
    let names: Vec<_> = names.into_iter().flatten().collect();
    assert_eq!(
        names,
        [
            "ares_math.yaml",
            "ares_qwen25_vl_geo3k.yaml",
            "bench_grpo_step.yaml",
            "bf16_rollout.yaml",
            "cispo.yaml",
            "clip_cov.yaml",
            "dapo_overlong.yaml",
            "easyr1_aepo_math.yaml",
            "easyr1_qwen25_vl_geo3k.yaml",
            "forking_tokens.yaml",
            "grpo_lambda.yaml",
            "gspo.yaml",
            "kl_cov.yaml",
            "lora.yaml",
            "multi_turn_tools.yaml",
            "pro_max.yaml",
            "rubric.yaml",
            "target_entropy.yaml"
        ]
    );
}

#[test]
fn example_configs_select_their_method() {
    let load_example =
        |name: &str| Config::load(Some(&examples_dir().join(name)), &[]).expect(name);
    let lora = load_example("lora.yaml").worker.actor;
    let peft = lora.model.lora.peft().unwrap().expect("LoRA on");
    assert_eq!(
        (peft.r, peft.lora_alpha, peft.exclude_modules.as_deref()),
        (64, 128.0, Some(".*visual.*"))
    );
    // all-linear, the language model's seven
    assert!(
        ares_runner::hf::lora::TARGETS
            .iter()
            .all(|t| peft.adapts_module(t))
    );
    assert!(lora.model.enable_gradient_checkpointing);
    let tools = load_example("multi_turn_tools.yaml");
    assert!(tools.worker.rollout.multi_turn.enable);
    assert_eq!(tools.worker.rollout.multi_turn.tools, ["calculator"]);
    let forking = load_example("forking_tokens.yaml");
    assert!(forking.worker.actor.forking_tokens.enable);
    assert_eq!(forking.worker.actor.forking_tokens.rho, 0.2);
    let target = load_example("target_entropy.yaml");
    assert_eq!(target.worker.actor.entropy_bonus.target, Some(0.2));
    assert!(target.worker.actor.entropy_bonus.active());
    let overlong = load_example("dapo_overlong.yaml");
    assert!(overlong.worker.reward.overlong_buffer.enable);
    assert_eq!(overlong.worker.reward.overlong_buffer.len, 1024);
    let ares = load_example("ares_math.yaml");
    assert!(ares.algorithm.entropy_reward.enable && ares.data.bootstrap);
    assert_eq!(ares.algorithm.kl_type, KlCtrl::DualAscent);
    assert_eq!(ares.trainer.device, Device::Cuda);

    let vl = load_example("ares_qwen25_vl_geo3k.yaml");
    assert_eq!(vl.data.image_key, "images");
    assert_eq!(vl.data.min_pixels, Some(262_144));
    assert!(!vl.worker.actor.model.freeze_vision_tower && vl.algorithm.entropy_reward.enable);

    let lambda = load_example("grpo_lambda.yaml");
    assert!(lambda.algorithm.grpo_lambda.enable && !lambda.algorithm.entropy_reward.enable);

    let rubric = load_example("rubric.yaml");
    assert!(rubric.worker.rollout.enable_graded_system_prompt);
    assert_eq!(rubric.worker.reward.grader, RewardGrader::Rubric);

    let pro_max = load_example("pro_max.yaml");
    assert_eq!(
        pro_max.algorithm.adv_estimator,
        AdvEstimator::ReinforceProMax
    );
    assert!(pro_max.algorithm.uniform_scale && !pro_max.algorithm.use_kl_loss);

    for (name, loss) in [
        ("gspo.yaml", PolicyLoss::Gspo),
        ("cispo.yaml", PolicyLoss::Cispo),
        ("clip_cov.yaml", PolicyLoss::ClipCov),
        ("kl_cov.yaml", PolicyLoss::KlCov),
    ] {
        let c = load_example(name);
        assert_eq!(c.worker.actor.policy_loss, loss, "{name}");
        assert!(!c.algorithm.entropy_reward.enable, "{name}");
    }
    assert_eq!(
        load_example("ares_math.yaml").worker.actor.policy_loss,
        PolicyLoss::Ppo
    );

    // Overrides apply on top of a file.
    let c = Config::load(
        Some(&examples_dir().join("pro_max.yaml")),
        &["algorithm.uniform_scale=false".to_string()],
    )
    .expect("override on a file");
    assert!(!c.algorithm.uniform_scale);
}

#[test]
fn example_format_prompts_exist_and_render() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for entry in std::fs::read_dir(examples_dir()).expect("examples/configs") {
        let path = entry.expect("entry").path();
        let c = Config::load(Some(&path), &[]).expect("loads");
        if let Some(p) = &c.data.format_prompt {
            let template = ares_runner::data::PromptTemplate::from_file(&root.join(p))
                .unwrap_or_else(|e| panic!("{}: format_prompt {p}: {e}", path.display()));
            let text = template.render("What is 1+1?").expect("renders");
            assert!(
                text.starts_with("What is 1+1?") && text.contains("\\boxed"),
                "{text}"
            );
        }
    }
}

/// `trainer.precision` sets the products' precision and the weights' storage at once
/// (`bf16`: both bf16); a finer key left at its default gives way, one that says otherwise
/// is refused naming both; weights in bf16 under f32 products are refused too; the
/// resolved config loads back as itself.
#[test]
fn precision_sets_products_and_weights() {
    use ares_runner::config::{MatmulPrecisionCfg, WeightDtypeCfg};
    let c = with_overrides(&["trainer.precision=bf16"]).unwrap();
    assert_eq!(c.trainer.matmul_precision, MatmulPrecisionCfg::Bf16);
    assert_eq!(c.trainer.weight_dtype, WeightDtypeCfg::Bf16);
    let again = load(&c.to_yaml(), &[]).unwrap();
    assert_eq!(again, c);
    let c = with_overrides(&["trainer.precision=tf32"]).unwrap();
    assert_eq!(c.trainer.matmul_precision, MatmulPrecisionCfg::Tf32);
    assert_eq!(c.trainer.weight_dtype, WeightDtypeCfg::F32);
    let msg = message(with_overrides(&[
        "trainer.precision=bf16",
        "trainer.matmul_precision=tf32",
    ]));
    assert!(
        msg.contains("trainer.matmul_precision") && msg.contains("trainer.precision: bf16"),
        "{msg}"
    );
    let msg = message(with_overrides(&[
        "trainer.precision=tf32",
        "trainer.weight_dtype=bf16",
    ]));
    assert!(msg.contains("trainer.weight_dtype"), "{msg}");
    let msg = message(with_overrides(&["trainer.weight_dtype=bf16"]));
    assert!(msg.contains("trainer.matmul_precision: bf16"), "{msg}");
}

/// `trainer.activation_dtype`: unset it follows the weights' storage (bf16 under
/// `precision: bf16`) unless LoRA adapts the MLP; bf16 needs bf16 products and no LoRA pair
/// on gate/up/down, refused naming the key.
#[test]
fn activation_dtype_follows_bf16_weights_and_refuses_what_cannot_read_it() {
    use ares_runner::model::ActivationDtype;
    let dtype = |o: &[&str]| with_overrides(o).unwrap().activation_dtype();
    assert_eq!(dtype(&[]), ActivationDtype::F32);
    assert_eq!(dtype(&["trainer.precision=bf16"]), ActivationDtype::Bf16);
    let f32_acts = ["trainer.precision=bf16", "trainer.activation_dtype=f32"];
    assert_eq!(dtype(&f32_acts), ActivationDtype::F32);
    let lora = ["trainer.precision=bf16", "worker.actor.model.lora.rank=8"];
    assert_eq!(
        dtype(&lora),
        ActivationDtype::F32,
        "all-linear adapts the MLP"
    );
    let attention_lora = [
        "trainer.precision=bf16",
        "worker.actor.model.lora.rank=8",
        "worker.actor.model.lora.target_modules=q_proj,v_proj",
    ];
    assert_eq!(dtype(&attention_lora), ActivationDtype::Bf16);
    let msg = message(with_overrides(&["trainer.activation_dtype=bf16"]));
    assert!(
        msg.contains("trainer.activation_dtype") && msg.contains("trainer.matmul_precision: bf16"),
        "{msg}"
    );
    let msg = message(with_overrides(&[
        "trainer.precision=bf16",
        "trainer.activation_dtype=bf16",
        "worker.actor.model.lora.rank=8",
    ]));
    assert!(
        msg.contains("trainer.activation_dtype") && msg.contains("lora adapts the MLP"),
        "{msg}"
    );
}

/// bf16 is CUDA's default: `trainer.device: cuda` with none of the three precision keys
/// given runs `precision: bf16` and a bf16 KV cache unless that is given (written out, so
/// the resolved config loads back as itself, on any device); a key given — in the file or
/// as an override, even at its default value — keeps each setting its own; the CPU keeps
/// f32, and `auto` does where no GPU is found.
#[test]
fn bf16_is_the_default_on_cuda() {
    use ares_runner::config::{MatmulPrecisionCfg as P, WeightDtypeCfg as W};
    let both = |c: &Config| {
        (
            c.trainer.precision,
            c.trainer.matmul_precision,
            c.trainer.weight_dtype,
        )
    };
    use ares_runner::config::KvCacheDtype as Kv;
    let kv = |c: &Config| c.worker.rollout.kv_cache_dtype;
    let c = with_overrides(&["trainer.device=cuda"]).unwrap();
    assert_eq!(both(&c), (Some(P::Bf16), P::Bf16, W::Bf16));
    assert_eq!(kv(&c), Kv::Bf16, "the KV cache too");
    let given = with_overrides(&["trainer.device=cuda", "worker.rollout.kv_cache_dtype=f32"]);
    assert_eq!(kv(&given.unwrap()), Kv::F32, "given, kept");
    let exact = with_overrides(&["trainer.device=cuda", "trainer.precision=f32"]).unwrap();
    assert_eq!(kv(&exact), Kv::F32, "a precision given: f32 cache");
    assert_eq!(load(&c.to_yaml(), &[]).unwrap(), c);
    let cpu = load(&c.to_yaml(), &["trainer.device=cpu"]).unwrap();
    assert_eq!(both(&cpu), (Some(P::Bf16), P::Bf16, W::Bf16), "as written");
    for given in [
        "trainer.precision=f32",
        "trainer.matmul_precision=f32",
        "trainer.weight_dtype=f32",
    ] {
        let c = with_overrides(&["trainer.device=cuda", given]).unwrap();
        assert_eq!(
            (c.trainer.matmul_precision, c.trainer.weight_dtype),
            (P::F32, W::F32),
            "{given}"
        );
    }
    let c = with_overrides(&["trainer.device=cuda", "trainer.matmul_precision=tf32"]).unwrap();
    assert_eq!(both(&c), (None, P::Tf32, W::F32));
    let c = load("trainer: {device: cuda, matmul_precision: f32}\n", &[]).unwrap();
    assert_eq!(both(&c), (None, P::F32, W::F32), "given in the file");
    let c = with_overrides(&["trainer.device=cpu"]).unwrap();
    assert_eq!(both(&c), (None, P::F32, W::F32), "cpu");
    // `auto` as the machine has it: CUDA's default where a GPU is found
    let c = with_overrides(&["trainer.device=auto"]).unwrap();
    match ares_runner::config::gpu_present() {
        true => assert_eq!(both(&c), (Some(P::Bf16), P::Bf16, W::Bf16), "auto, a GPU"),
        false => assert_eq!(both(&c), (None, P::F32, W::F32), "auto, no GPU"),
    }
}
