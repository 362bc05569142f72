//! Range and consistency checks of a typed [`Config`]. The first violation is returned,
//! naming the dotted key, its value and the accepted range or values.
//!
//! Choices made here (the spec leaves them open):
//! - `worker.actor.global_batch_size` (prompts, as EasyR1 counts) may exceed
//!   `data.rollout_batch_size`; the trainer takes the whole step as one mini-batch. Its
//!   samples (`· worker.rollout.n`) must be a multiple of
//!   `micro_batch_size_per_device_for_update`.
//! - `filter_low`/`filter_high` lie in `[0, 1]` when the filter averages `accuracy` (a 0/1
//!   value); other metrics (`overall` = accuracy + S) only need finite, ordered bounds.
//! - ARES shaping, GRPO-λ and the rubric reward are alternative rewards (docs/algorithms.md §3, §8, §9):
//!   at most one may be on.
//! - `trainer.device: cuda` is accepted here; the trainer decides whether a GPU is usable.

use ares_core::difficulty::PerBucket;

use super::Config;
use super::algorithm::{AlgorithmConfig, EntropyRewardConfig};
use super::data::DataConfig;
use super::error::ConfigError;
use super::trainer::{SftConfig, TrainerConfig};
use super::worker::{ActorConfig, RewardConfig, RewardGrader, RolloutConfig, RubricGrader};

/// Errors unless `value` is finite and `ok`.
fn real(key: &str, value: f64, ok: bool, expected: &str) -> Result<(), ConfigError> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(out_of_range(key, value, expected))
    }
}

fn out_of_range(key: &str, value: impl ToString, expected: &str) -> ConfigError {
    ConfigError::OutOfRange {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Errors unless `value ≥ min`.
fn at_least(key: &str, value: usize, min: usize) -> Result<(), ConfigError> {
    if value >= min {
        Ok(())
    } else {
        Err(out_of_range(key, value, &format!(">= {min}")))
    }
}

/// Errors when `value` is empty or only blanks.
fn non_empty(key: &str, value: &str) -> Result<(), ConfigError> {
    if value.trim().is_empty() {
        Err(out_of_range(
            key,
            format!("{value:?}"),
            "a non-empty string",
        ))
    } else {
        Ok(())
    }
}

/// Errors when a path is given but empty.
fn non_empty_path(key: &str, value: Option<&str>) -> Result<(), ConfigError> {
    value.map_or(Ok(()), |v| non_empty(key, v))
}

/// `lo ≤ value ≤ hi`, finite.
fn within(key: &str, value: f64, lo: f64, hi: f64) -> Result<(), ConfigError> {
    real(
        key,
        value,
        (lo..=hi).contains(&value),
        &format!("in [{lo}, {hi}]"),
    )
}

/// Every bucket finite and `ok`.
fn buckets(
    key: &str,
    values: &PerBucket<f64>,
    ok: impl Fn(f64) -> bool,
    expected: &str,
) -> Result<(), ConfigError> {
    for (bucket, &v) in values.iter() {
        real(&format!("{key}.{}", bucket.name()), v, ok(v), expected)?;
    }
    Ok(())
}

impl Config {
    /// Checks every value's range and the settings that depend on each other.
    ///
    /// Errors: [`ConfigError::OutOfRange`] (key, value, accepted range),
    /// [`ConfigError::GroupSize`] (n = 1 with a method that compares a group's samples,
    /// naming the method), [`ConfigError::Inconsistent`] (a required value missing, or two
    /// settings that exclude each other).
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_data(&self.data)?;
        validate_algorithm(&self.algorithm)?;
        validate_actor(&self.worker.actor, self.worker.rollout.n)?;
        validate_rollout(&self.worker.rollout)?;
        non_empty_path(
            "worker.ref.model_path",
            self.worker.ref_.model_path.as_deref(),
        )?;
        validate_reward(&self.worker.reward)?;
        let o = &self.worker.reward.overlong_buffer;
        if o.enable && (o.len == 0 || o.len > self.data.max_response_length) {
            return Err(ConfigError::Inconsistent {
                key: "worker.reward.overlong_buffer.len".into(),
                value: o.len.to_string(),
                reason: format!(
                    "must be in [1, data.max_response_length = {}]",
                    self.data.max_response_length
                ),
            });
        }
        validate_trainer(&self.trainer)?;
        validate_sft(&self.sft)?;
        self.validate_group_size()?;
        self.validate_reward_choice()
    }

    /// n ≥ 2 for everything that compares the samples of a group (docs/algorithms.md §5: "n = 1 is an
    /// error for every group estimator").
    fn validate_group_size(&self) -> Result<(), ConfigError> {
        let n = self.worker.rollout.n;
        if n >= 2 {
            return Ok(());
        }
        let a = &self.algorithm;
        let user = if a.adv_estimator.needs_group() {
            Some(format!(
                "algorithm.adv_estimator = {}",
                a.adv_estimator.name()
            ))
        } else if a.grpo_lambda.enable {
            Some("GRPO-λ (algorithm.grpo_lambda.enable = true)".to_string())
        } else if a.online_filtering {
            Some("online filtering (algorithm.online_filtering = true)".to_string())
        } else {
            None
        };
        match user {
            Some(user) => Err(ConfigError::GroupSize { n, user }),
            None => Ok(()),
        }
    }

    /// At most one of ARES shaping, GRPO-λ and the rubric reward.
    fn validate_reward_choice(&self) -> Result<(), ConfigError> {
        let ares = self.algorithm.entropy_reward.enable;
        let lambda = self.algorithm.grpo_lambda.enable;
        let rubric = self.worker.reward.grader == RewardGrader::Rubric;
        let clash = |key: &str, value: &str, other: &str| ConfigError::Inconsistent {
            key: key.to_string(),
            value: value.to_string(),
            reason: format!("it is an alternative to {other}; turn one of them off"),
        };
        if lambda && ares {
            return Err(clash(
                "algorithm.grpo_lambda.enable",
                "true",
                "the ARES entropy reward (algorithm.entropy_reward.enable = true)",
            ));
        }
        if rubric && ares {
            return Err(clash(
                "worker.reward.grader",
                "rubric",
                "the ARES entropy reward, which shapes 0/1 correctness \
                 (algorithm.entropy_reward.enable = true)",
            ));
        }
        if rubric && lambda {
            return Err(clash(
                "worker.reward.grader",
                "rubric",
                "GRPO-λ, which needs 0/1 correctness (algorithm.grpo_lambda.enable = true)",
            ));
        }
        self.validate_reward_function()
    }

    /// A Python reward function's `overall` is the whole reward: the built-in terms that
    /// would be added to it are refused rather than dropped.
    fn validate_reward_function(&self) -> Result<(), ConfigError> {
        let r = &self.worker.reward;
        let Some(function) = &r.reward_function else {
            return Ok(());
        };
        let clash = |key: &str, value: &str| ConfigError::Inconsistent {
            key: key.to_string(),
            value: value.to_string(),
            reason: format!(
                "worker.reward.reward_function = {function} gives the whole reward (its \
                 `overall`); put this term into the function, or turn it off"
            ),
        };
        if self.algorithm.grpo_lambda.enable {
            return Err(clash("algorithm.grpo_lambda.enable", "true"));
        }
        if r.grader == RewardGrader::Rubric {
            return Err(clash("worker.reward.grader", "rubric"));
        }
        if r.overlong_buffer.enable {
            return Err(clash("worker.reward.overlong_buffer.enable", "true"));
        }
        if r.format_weight != 0.0 {
            return Err(clash(
                "worker.reward.format_weight",
                &r.format_weight.to_string(),
            ));
        }
        Ok(())
    }
}

fn validate_data(d: &DataConfig) -> Result<(), ConfigError> {
    non_empty_path("data.train_files", d.train_files.as_deref())?;
    non_empty_path("data.val_files", d.val_files.as_deref())?;
    non_empty_path("data.format_prompt", d.format_prompt.as_deref())?;
    non_empty_path("data.tools", d.tools.as_deref())?;
    if let Some(key) = d
        .apply_chat_template_kwargs
        .iter()
        .flat_map(|m| m.keys())
        .find(|k| crate::hf::chat::RENDER_VARIABLES.contains(&k.as_str()))
    {
        return Err(ConfigError::Inconsistent {
            key: format!("data.apply_chat_template_kwargs.{key}"),
            value: "given".into(),
            reason: "ares sets this variable of the chat template itself (tools come from \
                     data.tools)"
                .into(),
        });
    }
    non_empty("data.prompt_key", &d.prompt_key)?;
    non_empty("data.answer_key", &d.answer_key)?;
    non_empty("data.difficulty_key", &d.difficulty_key)?;
    non_empty("data.global_id_key", &d.global_id_key)?;
    non_empty("data.rubrics_key", &d.rubrics_key)?;
    non_empty("data.image_key", &d.image_key)?;
    non_empty("data.video_key", &d.video_key)?;
    if let Some(min) = d.min_pixels {
        at_least("data.min_pixels", min, 1)?;
    }
    if let Some(max) = d.max_pixels {
        at_least("data.max_pixels", max, 1)?;
    }
    if let (Some(min), Some(max)) = (d.min_pixels, d.max_pixels)
        && min > max
    {
        return Err(ConfigError::Inconsistent {
            key: "data.min_pixels".into(),
            value: min.to_string(),
            reason: format!("it exceeds data.max_pixels = {max}"),
        });
    }
    real("data.video_fps", d.video_fps, d.video_fps > 0.0, "> 0")?;
    at_least("data.max_prompt_length", d.max_prompt_length, 1)?;
    at_least("data.max_response_length", d.max_response_length, 1)?;
    at_least("data.rollout_batch_size", d.rollout_batch_size, 1)
}

fn validate_algorithm(a: &AlgorithmConfig) -> Result<(), ConfigError> {
    within("algorithm.gamma", a.gamma, 0.0, 1.0)?;
    real(
        "algorithm.pro_max_max_scale",
        a.pro_max_max_scale,
        a.pro_max_max_scale > 0.0,
        "> 0",
    )?;
    real("algorithm.kl_coef", a.kl_coef, a.kl_coef >= 0.0, ">= 0")?;
    real("algorithm.kl_target", a.kl_target, a.kl_target > 0.0, "> 0")?;
    real(
        "algorithm.kl_horizon",
        a.kl_horizon,
        a.kl_horizon > 0.0,
        "> 0",
    )?;

    let da = &a.dual_ascent;
    real("algorithm.dual_ascent.eta", da.eta, da.eta >= 0.0, ">= 0")?;
    real(
        "algorithm.dual_ascent.lambda_max",
        da.lambda_max,
        da.lambda_max >= 0.0,
        ">= 0",
    )?;
    let lambda_max = da.lambda_max;
    buckets(
        "algorithm.dual_ascent.lambda_init",
        &da.lambda_init,
        |l| (0.0..=lambda_max).contains(&l),
        &format!("in [0, algorithm.dual_ascent.lambda_max = {lambda_max}]"),
    )?;
    buckets(
        "algorithm.dual_ascent.budget",
        &da.budget,
        |e| e >= 0.0,
        ">= 0",
    )?;

    let th = &a.difficulty_thresholds;
    within(
        "algorithm.difficulty_thresholds.medium",
        th.medium,
        0.0,
        1.0,
    )?;
    real(
        "algorithm.difficulty_thresholds.easy",
        th.easy,
        th.easy >= th.medium && th.easy <= 1.0,
        &format!(
            "in [algorithm.difficulty_thresholds.medium = {}, 1]",
            th.medium
        ),
    )?;

    non_empty("algorithm.filter_key", &a.filter_key)?;
    if a.filter_key == "accuracy" {
        within("algorithm.filter_low", a.filter_low, 0.0, 1.0)?;
    } else {
        real(
            "algorithm.filter_low",
            a.filter_low,
            true,
            "a finite number",
        )?;
    }
    let high_range = if a.filter_key == "accuracy" {
        format!("in (algorithm.filter_low = {}, 1]", a.filter_low)
    } else {
        format!("> algorithm.filter_low = {}", a.filter_low)
    };
    real(
        "algorithm.filter_high",
        a.filter_high,
        a.filter_high > a.filter_low && (a.filter_key != "accuracy" || a.filter_high <= 1.0),
        &high_range,
    )?;

    let ds = &a.drop_solved;
    real(
        "algorithm.drop_solved.entropy_threshold",
        ds.entropy_threshold,
        ds.entropy_threshold >= 0.0,
        ">= 0",
    )?;
    at_least("algorithm.drop_solved.consecutive", ds.consecutive, 1)?;

    validate_entropy_reward(&a.entropy_reward)?;

    let gl = &a.grpo_lambda;
    real(
        "algorithm.grpo_lambda.lambda",
        gl.lambda,
        gl.lambda > 0.0 && gl.lambda <= 1.0,
        "in (0, 1]",
    )?;
    within("algorithm.grpo_lambda.alpha", gl.alpha, 0.0, 1.0)
}

fn validate_entropy_reward(e: &EntropyRewardConfig) -> Result<(), ConfigError> {
    const P: &str = "algorithm.entropy_reward";
    within(&format!("{P}.percentile"), e.percentile, 0.0, 100.0)?;
    within(&format!("{P}.tau_momentum"), e.tau_momentum, 0.0, 1.0)?;
    for (i, word) in e.trigger_words.iter().enumerate() {
        non_empty(&format!("{P}.trigger_words[{i}]"), word)?;
    }
    real(
        &format!("{P}.alpha_lr"),
        e.alpha_lr,
        e.alpha_lr >= 0.0,
        ">= 0",
    )?;
    real(
        &format!("{P}.alpha_min"),
        e.alpha_min,
        e.alpha_min >= 0.0,
        ">= 0",
    )?;
    real(
        &format!("{P}.alpha_max"),
        e.alpha_max,
        e.alpha_max >= e.alpha_min,
        &format!(">= {P}.alpha_min = {}", e.alpha_min),
    )?;
    real(
        &format!("{P}.alpha_init"),
        e.alpha_init,
        e.alpha_init >= e.alpha_min && e.alpha_init <= e.alpha_max,
        &format!(
            "in [{P}.alpha_min = {}, {P}.alpha_max = {}]",
            e.alpha_min, e.alpha_max
        ),
    )?;
    at_least(
        &format!("{P}.target_update_interval"),
        e.target_update_interval,
        1,
    )?;
    within(&format!("{P}.target_momentum"), e.target_momentum, 0.0, 1.0)?;
    buckets(
        &format!("{P}.target_scale"),
        &e.target_scale,
        |s| s >= 0.0,
        ">= 0",
    )?;
    buckets(
        &format!("{P}.margin_fraction"),
        &e.margin_fraction,
        |f| f >= 0.0,
        ">= 0",
    )?;
    // κ = 0 would divide 0 by 0 in the Huber branch x⁺²/(2κ) at x⁺ = 0.
    buckets(
        &format!("{P}.huber_kappa"),
        &e.huber_kappa,
        |k| k > 0.0,
        "> 0",
    )?;
    buckets(
        &format!("{P}.sigmoid_temperature"),
        &e.sigmoid_temperature,
        |t| t > 0.0,
        "> 0",
    )?;
    buckets(
        &format!("{P}.cap_scale"),
        &e.cap_scale,
        |c| c >= 0.0,
        ">= 0",
    )?;
    buckets(
        &format!("{P}.wrong_factor"),
        &e.wrong_factor,
        |w| w >= 0.0,
        ">= 0",
    )
}

/// `n` is `worker.rollout.n`: the mini-batch holds `global_batch_size · n` samples.
fn validate_actor(a: &ActorConfig, n: usize) -> Result<(), ConfigError> {
    const P: &str = "worker.actor";
    non_empty_path(
        &format!("{P}.model.model_path"),
        a.model.model_path.as_deref(),
    )?;
    non_empty_path(
        &format!("{P}.model.tokenizer_path"),
        a.model.tokenizer_path.as_deref(),
    )?;
    at_least(&format!("{P}.global_batch_size"), a.global_batch_size, 1)?;
    at_least(
        &format!("{P}.micro_batch_size_per_device_for_update"),
        a.micro_batch_size_per_device_for_update,
        1,
    )?;
    let samples = a.global_batch_size * n.max(1);
    // a micro-batch as large as the mini-batch is the mini-batch (the trainer clamps it)
    let micro = a.micro_batch_size_per_device_for_update;
    if micro < samples && !samples.is_multiple_of(micro) {
        return Err(ConfigError::Inconsistent {
            key: format!("{P}.micro_batch_size_per_device_for_update"),
            value: a.micro_batch_size_per_device_for_update.to_string(),
            reason: format!(
                "it must divide the {samples} samples of a mini-batch ({P}.global_batch_size \
                 = {} prompts × worker.rollout.n = {n}; gradients accumulate over whole \
                 micro-batches)",
                a.global_batch_size
            ),
        });
    }
    at_least(&format!("{P}.ppo_epochs"), a.ppo_epochs, 1)?;
    within(&format!("{P}.clip_ratio_low"), a.clip_ratio_low, 0.0, 1.0)?;
    real(
        &format!("{P}.clip_ratio_high"),
        a.clip_ratio_high,
        a.clip_ratio_high >= 0.0,
        ">= 0",
    )?;
    real(
        &format!("{P}.clip_ratio_dual"),
        a.clip_ratio_dual,
        a.clip_ratio_dual == 0.0 || a.clip_ratio_dual > 1.0,
        "0 (off) or > 1",
    )?;
    for (key, ratio) in [
        ("clip_cov_ratio", a.clip_cov_ratio),
        ("kl_cov_ratio", a.kl_cov_ratio),
    ] {
        real(
            &format!("{P}.{key}"),
            ratio,
            ratio > 0.0 && ratio <= 1.0,
            "in (0, 1]",
        )?;
    }
    real(&format!("{P}.clip_cov_lb"), a.clip_cov_lb, true, "finite")?;
    real(
        &format!("{P}.clip_cov_ub"),
        a.clip_cov_ub,
        a.clip_cov_ub > a.clip_cov_lb,
        "> worker.actor.clip_cov_lb",
    )?;
    real(
        &format!("{P}.ppo_kl_coef"),
        a.ppo_kl_coef,
        a.ppo_kl_coef >= 0.0,
        ">= 0",
    )?;
    within(
        &format!("{P}.dynamic_kl_low_ratio"),
        a.dynamic_kl_low_ratio,
        0.0,
        1.0,
    )?;
    real(
        &format!("{P}.max_grad_norm"),
        a.max_grad_norm,
        a.max_grad_norm > 0.0,
        "> 0",
    )?;
    within(
        &format!("{P}.is_threshold_low"),
        a.is_threshold_low,
        0.0,
        1.0,
    )?;
    real(
        &format!("{P}.is_threshold_high"),
        a.is_threshold_high,
        a.is_threshold_high >= 1.0,
        ">= 1",
    )?;

    let o = &a.optim;
    real(&format!("{P}.optim.lr"), o.lr, o.lr > 0.0, "> 0")?;
    for (i, beta) in o.betas.iter().enumerate() {
        real(
            &format!("{P}.optim.betas[{i}]"),
            *beta,
            (0.0..1.0).contains(beta),
            "in [0, 1)",
        )?;
    }
    real(&format!("{P}.optim.eps"), o.eps, o.eps > 0.0, "> 0")?;
    real(
        &format!("{P}.optim.weight_decay"),
        o.weight_decay,
        o.weight_decay >= 0.0,
        ">= 0",
    )?;
    within(&format!("{P}.optim.min_lr_ratio"), o.min_lr_ratio, 0.0, 1.0)?;
    within(
        &format!("{P}.optim.lr_warmup_ratio"),
        o.lr_warmup_ratio,
        0.0,
        1.0,
    )?;
    let f = &a.forking_tokens;
    real(
        &format!("{P}.forking_tokens.rho"),
        f.rho,
        f.rho > 0.0 && f.rho <= 1.0,
        "in (0, 1]",
    )?;
    let e = &a.entropy_bonus;
    real(
        &format!("{P}.entropy_bonus.coef"),
        e.coef,
        e.coef >= 0.0,
        ">= 0",
    )?;
    if let Some(t) = e.target {
        real(&format!("{P}.entropy_bonus.target"), t, t >= 0.0, ">= 0")?;
    }
    real(&format!("{P}.entropy_bonus.lr"), e.lr, e.lr >= 0.0, ">= 0")?;
    real(
        &format!("{P}.entropy_bonus.min_coef"),
        e.min_coef,
        e.min_coef >= 0.0,
        ">= 0",
    )?;
    real(
        &format!("{P}.entropy_bonus.max_coef"),
        e.max_coef,
        e.max_coef >= e.min_coef,
        ">= entropy_bonus.min_coef",
    )?;
    if e.target.is_some() && !(e.min_coef..=e.max_coef).contains(&e.coef) {
        return Err(ConfigError::Inconsistent {
            key: format!("{P}.entropy_bonus.coef"),
            value: e.coef.to_string(),
            reason: format!(
                "the controller's starting value must lie in [min_coef, max_coef] = [{}, {}]",
                e.min_coef, e.max_coef
            ),
        });
    }
    Ok(())
}

fn validate_rollout(r: &RolloutConfig) -> Result<(), ConfigError> {
    const P: &str = "worker.rollout";
    at_least(&format!("{P}.n"), r.n, 1)?;
    real(
        &format!("{P}.temperature"),
        r.temperature,
        r.temperature > 0.0,
        "> 0",
    )?;
    real(
        &format!("{P}.top_p"),
        r.top_p,
        r.top_p > 0.0 && r.top_p <= 1.0,
        "in (0, 1]",
    )?;
    at_least(&format!("{P}.window_size"), r.window_size, 1)?;
    let m = &r.multi_turn;
    at_least(
        &format!("{P}.multi_turn.max_assistant_turns"),
        m.max_assistant_turns,
        1,
    )?;
    if let Some(t) = m.tools.iter().find(|t| t.as_str() != "calculator") {
        return Err(out_of_range(
            &format!("{P}.multi_turn.tools"),
            format!("{t:?}"),
            "built-in tools: calculator",
        ));
    }
    for (i, t) in m.tool_commands.iter().enumerate() {
        let key = format!("{P}.multi_turn.tool_commands[{i}]");
        non_empty(&format!("{key}.name"), &t.name)?;
        non_empty(&format!("{key}.command"), &t.command)?;
        real(
            &format!("{key}.timeout_s"),
            t.timeout_s,
            t.timeout_s > 0.0,
            "> 0",
        )?;
        at_least(&format!("{key}.max_concurrency"), t.max_concurrency, 1)?;
    }
    if let Some(t) = &m.interaction {
        let key = format!("{P}.multi_turn.interaction");
        non_empty(&format!("{key}.command"), &t.command)?;
        real(
            &format!("{key}.timeout_s"),
            t.timeout_s,
            t.timeout_s > 0.0,
            "> 0",
        )?;
        at_least(&format!("{key}.max_concurrency"), t.max_concurrency, 1)?;
        real(
            &format!("{key}.reward_weight"),
            t.reward_weight,
            t.reward_weight.is_finite(),
            "a finite number",
        )?;
    }
    if m.enable && r.enable_graded_system_prompt {
        return Err(ConfigError::Inconsistent {
            key: format!("{P}.multi_turn.enable"),
            value: "true".into(),
            reason: "graded system prompts give each sample its own conversation; \
                     multi-turn episodes with them are not supported yet"
                .into(),
        });
    }
    let v = &r.val_override_config;
    if let Some(t) = v.temperature {
        real(
            &format!("{P}.val_override_config.temperature"),
            t,
            t >= 0.0,
            ">= 0 (0 = greedy)",
        )?;
    }
    if let Some(p) = v.top_p {
        real(
            &format!("{P}.val_override_config.top_p"),
            p,
            p > 0.0 && p <= 1.0,
            "in (0, 1]",
        )?;
    }
    if let Some(n) = v.n {
        at_least(&format!("{P}.val_override_config.n"), n, 1)?;
    }
    let g = &r.graded;
    real(
        &format!("{P}.graded.power"),
        g.power,
        g.power >= 0.0,
        ">= 0",
    )?;
    within(&format!("{P}.graded.x0"), g.x0, 0.0, 1.0)?;
    real(&format!("{P}.graded.k"), g.k, g.k >= 0.0, ">= 0")
}

fn validate_reward(r: &RewardConfig) -> Result<(), ConfigError> {
    non_empty_path(
        "worker.reward.reward_function",
        r.reward_function.as_deref(),
    )?;
    non_empty_path("worker.reward.python", r.python.as_deref())?;
    real(
        "worker.reward.timeout_s",
        r.timeout_s,
        r.timeout_s > 0.0,
        "> 0 seconds",
    )?;
    real(
        "worker.reward.format_weight",
        r.format_weight,
        r.format_weight >= 0.0,
        ">= 0",
    )?;
    let o = &r.overlong_buffer;
    real(
        "worker.reward.overlong_buffer.penalty_factor",
        o.penalty_factor,
        o.penalty_factor >= 0.0,
        ">= 0",
    )?;
    match (r.rubric_grader, r.rubric_command.as_deref()) {
        (RubricGrader::Command, None) => Err(ConfigError::Inconsistent {
            key: "worker.reward.rubric_command".into(),
            value: "null".into(),
            reason: "required when worker.reward.rubric_grader = command (the grader's \
                     command line)"
                .into(),
        }),
        (_, command) => non_empty_path("worker.reward.rubric_command", command),
    }
}

fn validate_trainer(t: &TrainerConfig) -> Result<(), ConfigError> {
    non_empty("trainer.project_name", &t.project_name)?;
    non_empty("trainer.experiment_name", &t.experiment_name)?;
    // The name becomes a directory under runs/ when no save_checkpoint_path is given.
    if t.experiment_name.contains(['/', '\\']) || t.experiment_name == ".." {
        return Err(out_of_range(
            "trainer.experiment_name",
            format!("{:?}", t.experiment_name),
            "a name without path separators (use trainer.save_checkpoint_path for a path)",
        ));
    }
    non_empty_path(
        "trainer.save_checkpoint_path",
        t.save_checkpoint_path.as_deref(),
    )?;
    non_empty_path(
        "trainer.load_checkpoint_path",
        t.load_checkpoint_path.as_deref(),
    )?;
    if t.val_only && !t.val_before_train {
        return Err(ConfigError::Inconsistent {
            key: "trainer.val_only".into(),
            value: "true".into(),
            reason: "it stops after the validation before training, which \
                     trainer.val_before_train = false turns off (EasyR1 would train instead)"
                .into(),
        });
    }
    at_least("trainer.total_epochs", t.total_epochs, 1)?;
    if let Some(steps) = t.max_steps {
        at_least("trainer.max_steps", steps, 1)?;
    }
    Ok(())
}

fn validate_sft(s: &SftConfig) -> Result<(), ConfigError> {
    non_empty_path("sft.train_files", s.train_files.as_deref())?;
    non_empty("sft.response_key", &s.response_key)?;
    at_least("sft.epochs", s.epochs, 1)?;
    real("sft.lr", s.lr, s.lr > 0.0, "> 0")?;
    at_least("sft.batch_size", s.batch_size, 1)?;
    at_least("sft.max_length", s.max_length, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::algorithm::AdvEstimator;

    fn err(c: &Config) -> String {
        c.validate().expect_err("should be rejected").to_string()
    }

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().expect("spec defaults");
    }

    #[test]
    fn ranges_name_key_value_and_range() {
        let mut c = Config::default();
        c.worker.rollout.top_p = 0.0;
        assert_eq!(
            err(&c),
            "worker.rollout.top_p = 0 is out of range: expected in (0, 1]"
        );
        let mut c = Config::default();
        c.worker.actor.optim.betas = [0.9, 1.0];
        assert_eq!(
            err(&c),
            "worker.actor.optim.betas[1] = 1 is out of range: expected in [0, 1)"
        );
        let mut c = Config::default();
        c.algorithm.entropy_reward.huber_kappa.medium = 0.0;
        assert!(err(&c).starts_with("algorithm.entropy_reward.huber_kappa.medium = 0"));
        let mut c = Config::default();
        c.worker.actor.optim.lr = f64::NAN;
        assert_eq!(
            err(&c),
            "worker.actor.optim.lr = NaN is out of range: expected > 0"
        );
    }

    #[test]
    fn filter_bounds_are_probabilities_only_for_accuracy() {
        let mut c = Config::default();
        c.algorithm.filter_high = 1.5;
        assert!(err(&c).contains("algorithm.filter_high = 1.5"));
        c.algorithm.filter_key = "overall".into();
        c.validate().expect("overall may exceed 1");
        c.algorithm.filter_low = 2.0;
        assert!(err(&c).contains("algorithm.filter_high = 1.5"));
    }

    #[test]
    fn group_estimators_need_two_samples() {
        let mut c = Config::default();
        c.worker.rollout.n = 1;
        assert!(err(&c).contains("algorithm.adv_estimator = grpo"));
        c.algorithm.adv_estimator = AdvEstimator::Reinforce;
        assert!(err(&c).contains("online filtering"));
        c.algorithm.online_filtering = false;
        c.validate().expect("plain REINFORCE++ works with n = 1");
        c.algorithm.entropy_reward.enable = false;
        c.algorithm.grpo_lambda.enable = true;
        assert!(err(&c).contains("GRPO-λ"));
    }

    #[test]
    fn micro_batch_must_divide_global_batch() {
        let mut c = Config::default();
        c.worker.actor.micro_batch_size_per_device_for_update = 12;
        assert!(err(&c).contains("must divide the 64 samples of a mini-batch"));
    }

    #[test]
    fn alternative_rewards_exclude_each_other() {
        let mut c = Config::default();
        c.algorithm.grpo_lambda.enable = true;
        assert!(err(&c).starts_with("algorithm.grpo_lambda.enable = true"));
        c.algorithm.entropy_reward.enable = false;
        c.validate().expect("GRPO-λ alone");
    }

    #[test]
    fn media_keys_and_pixel_bounds() {
        let mut c = Config::default();
        c.data.image_key = " ".into();
        assert_eq!(
            err(&c),
            "data.image_key = \" \" is out of range: expected a non-empty string"
        );
        let mut c = Config::default();
        c.data.video_key = String::new();
        assert!(err(&c).starts_with("data.video_key = \"\""));
        let mut c = Config::default();
        c.data.min_pixels = Some(0);
        assert_eq!(
            err(&c),
            "data.min_pixels = 0 is out of range: expected >= 1"
        );
        let mut c = Config::default();
        c.data.max_pixels = Some(0);
        assert!(err(&c).starts_with("data.max_pixels = 0"));
        let mut c = Config::default();
        c.data.min_pixels = Some(4096);
        c.data.max_pixels = Some(1024);
        assert_eq!(
            err(&c),
            "data.min_pixels = 4096: it exceeds data.max_pixels = 1024"
        );
        c.data.max_pixels = Some(4096);
        c.validate().expect("min = max");
        c.data.max_pixels = None;
        c.validate().expect("one bound, the other from the model");
        for fps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let mut c = Config::default();
            c.data.video_fps = fps;
            assert!(err(&c).starts_with("data.video_fps = "), "{fps}");
        }
    }

    #[test]
    fn command_grader_needs_a_command() {
        let mut c = Config::default();
        c.worker.reward.rubric_grader = RubricGrader::Command;
        assert!(err(&c).starts_with("worker.reward.rubric_command = null: required"));
        c.worker.reward.rubric_command = Some("python judge.py".into());
        c.validate().expect("with a command");
    }
}
