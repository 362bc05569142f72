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
//!
//! Where ares-core checks a parameter the config sets (the clip, Clip-Cov and KL-Cov
//! parameters, the KL controller, the difficulty controller, GRPO-λ's α, the entropy
//! bonus's controller, the EMA of τ, forking tokens' ρ), the check is core's: its error is
//! reported under the config's key with the value ([`from_core`]). The checks left here are
//! the config's own: its keys, or ranges narrower or wider than core's. (With several values
//! wrong at once, the one reported among the difficulty controller's is the first in core's
//! order of checks.)

use ares_core::difficulty::PerBucket;
use ares_core::entropy::ThresholdEma;
use ares_core::entropy_bonus::EntropyCoefController;
use ares_core::forking::forking_token_count;
use ares_core::kl::AdaptiveKlController;
use ares_core::length::GrpoLambda;
use ares_core::loss::{ClipCovParams, ClipParams, KlCovParams};

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

/// A parameter ares-core checks, as the config names it.
struct CoreKey {
    /// Its name in ares-core's error (`Error::OutOfRange::what`); a per-bucket name
    /// (`lambda_init.easy`) also matches a key given without the bucket.
    core: &'static str,
    /// The dotted config key.
    key: String,
    /// The accepted range in the config's words, where core's differ (core names its own
    /// fields; the config names keys, with their values).
    expected: Option<String>,
}

/// `core` is the config's `key`, with core's wording of the range (less a leading
/// `finite and `: every range here is of finite values).
fn key(core: &'static str, key: impl Into<String>) -> CoreKey {
    CoreKey {
        core,
        key: key.into(),
        expected: None,
    }
}

/// `core` is the config's `key`, and the range is worded `expected`.
fn worded(core: &'static str, key: impl Into<String>, expected: impl Into<String>) -> CoreKey {
    CoreKey {
        core,
        key: key.into(),
        expected: Some(expected.into()),
    }
}

/// The outcome of one of ares-core's checks as the config's error: core's `OutOfRange`
/// names its field, which `keys` maps to the config key (a bucket suffix kept), with the
/// value. An error no key maps is a bug here, reported as [`ConfigError::Internal`].
fn from_core(checked: ares_core::Result<()>, keys: &[CoreKey]) -> Result<(), ConfigError> {
    let Err(error) = checked else {
        return Ok(());
    };
    let ares_core::Error::OutOfRange {
        what,
        value,
        expected,
    } = error
    else {
        return Err(ConfigError::Internal(format!(
            "ares-core rejected the configuration: {error}"
        )));
    };
    let mapped = keys.iter().find_map(|k| {
        let key = if what == k.core {
            k.key.clone()
        } else {
            let bucket = what.strip_prefix(k.core)?.strip_prefix('.')?;
            format!("{}.{bucket}", k.key)
        };
        let core_words = expected.strip_prefix("finite and ").unwrap_or(expected);
        Some((key, k.expected.as_deref().unwrap_or(core_words)))
    });
    match mapped {
        Some((key, expected)) => Err(out_of_range(&key, value, expected)),
        None => Err(ConfigError::Internal(format!(
            "no config key for ares-core's `{what}`: {error}"
        ))),
    }
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
        if self.trainer.activation_dtype == Some(super::StorageDtypeCfg::Bf16)
            && self.lora_adapts_mlp()
        {
            return Err(ConfigError::Inconsistent {
                key: "trainer.activation_dtype".into(),
                value: "bf16".into(),
                reason: "worker.actor.model.lora adapts the MLP (gate_proj, up_proj or \
                         down_proj), whose pairs read f32 activations: set f32, or leave it \
                         unset (f32 then)"
                    .into(),
            });
        }
        if self.worker.rollout.cuda_graphs && self.trainer.device == super::Device::Cpu {
            return Err(ConfigError::Inconsistent {
                key: "worker.rollout.cuda_graphs".into(),
                value: "true".into(),
                reason: "needs a GPU (trainer.device: cuda or auto): on the CPU the decode \
                         buckets would only add their padding's compute"
                    .into(),
            });
        }
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
    // the adaptive controller's checks (`kl_coef` alone is the fixed one's)
    from_core(
        AdaptiveKlController::new(a.kl_coef, a.kl_target, a.kl_horizon).map(drop),
        &[
            key("init_kl_coef", "algorithm.kl_coef"),
            key("kl_target", "algorithm.kl_target"),
            key("kl_horizon", "algorithm.kl_horizon"),
        ],
    )?;
    validate_difficulty(a)?;

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
    let grpo_lambda = GrpoLambda {
        lambda_: gl.lambda,
        alpha: gl.alpha,
    };
    from_core(
        grpo_lambda.validate(),
        &[
            key("lambda_", "algorithm.grpo_lambda.lambda"),
            key("alpha", "algorithm.grpo_lambda.alpha"),
        ],
    )
}

/// The difficulty controller the trainer runs ([`AlgorithmConfig::difficulty`]: bucket
/// thresholds, dual ascent, α and targets), by ares-core's checks; and `alpha_min ≥ 0`,
/// which only the config asks (core takes any finite lower clip).
fn validate_difficulty(a: &AlgorithmConfig) -> Result<(), ConfigError> {
    const E: &str = "algorithm.entropy_reward";
    const D: &str = "algorithm.dual_ascent";
    const T: &str = "algorithm.difficulty_thresholds";
    let (e, da) = (&a.entropy_reward, &a.dual_ascent);
    real(
        &format!("{E}.alpha_min"),
        e.alpha_min,
        e.alpha_min >= 0.0,
        ">= 0",
    )?;
    from_core(
        a.difficulty().validate(),
        &[
            key("accuracy_thresholds.medium", format!("{T}.medium")),
            worded(
                "accuracy_thresholds.easy",
                format!("{T}.easy"),
                format!("in [{T}.medium = {}, 1]", a.difficulty_thresholds.medium),
            ),
            key("target_momentum", format!("{E}.target_momentum")),
            key("target_scale", format!("{E}.target_scale")),
            key(
                "target_update_interval",
                format!("{E}.target_update_interval"),
            ),
            key("alpha_lr", format!("{E}.alpha_lr")),
            key("alpha_min", format!("{E}.alpha_min")),
            worded(
                "alpha_max",
                format!("{E}.alpha_max"),
                format!(">= {E}.alpha_min = {}", e.alpha_min),
            ),
            // one α for every bucket: the first bucket is the one reported
            worded(
                "alpha_init.easy",
                format!("{E}.alpha_init"),
                format!(
                    "in [{E}.alpha_min = {}, {E}.alpha_max = {}]",
                    e.alpha_min, e.alpha_max
                ),
            ),
            key("lambda_max", format!("{D}.lambda_max")),
            worded(
                "lambda_init",
                format!("{D}.lambda_init"),
                format!("in [0, {D}.lambda_max = {}]", da.lambda_max),
            ),
            key("kl_budget", format!("{D}.budget")),
            key("lambda_lr", format!("{D}.eta")),
        ],
    )
}

fn validate_entropy_reward(e: &EntropyRewardConfig) -> Result<(), ConfigError> {
    const P: &str = "algorithm.entropy_reward";
    within(&format!("{P}.percentile"), e.percentile, 0.0, 100.0)?;
    from_core(
        ThresholdEma::new(e.tau_momentum).map(drop),
        &[key("rho", format!("{P}.tau_momentum"))],
    )?;
    for (i, word) in e.trigger_words.iter().enumerate() {
        non_empty(&format!("{P}.trigger_words[{i}]"), word)?;
    }
    // α, the targets: validate_difficulty. The shaping constants stay the config's: core's
    // `BucketShaping` also bounds margin_fraction and wrong_factor by 1, which the config
    // does not (the trainer then refuses them when the ARES reward is on).
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
    if let Err((k, value, expected)) = a.model.lora.peft() {
        return Err(ConfigError::OutOfRange {
            key: format!("{P}.model.lora.{k}"),
            value,
            expected,
        });
    }
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
    from_core(
        ClipParams::new(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_dual).map(drop),
        &[
            key("clip_ratio_low", format!("{P}.clip_ratio_low")),
            key("clip_ratio_high", format!("{P}.clip_ratio_high")),
            key("clip_ratio_c", format!("{P}.clip_ratio_dual")),
        ],
    )?;
    let clip_cov = ClipCovParams {
        ratio: a.clip_cov_ratio,
        lb: a.clip_cov_lb,
        ub: a.clip_cov_ub,
        seed: 0,
    };
    let kl_cov = KlCovParams {
        ratio: a.kl_cov_ratio,
        coef: a.ppo_kl_coef,
    };
    from_core(
        clip_cov.validate().and_then(|()| kl_cov.validate()),
        &[
            key("clip_cov_ratio", format!("{P}.clip_cov_ratio")),
            key("clip_cov_lb", format!("{P}.clip_cov_lb")),
            worded(
                "clip_cov_ub",
                format!("{P}.clip_cov_ub"),
                "> worker.actor.clip_cov_lb",
            ),
            key("kl_cov_ratio", format!("{P}.kl_cov_ratio")),
            key("ppo_kl_coef", format!("{P}.ppo_kl_coef")),
        ],
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
    // (ρ of no tokens keeps none: only the check of ρ)
    from_core(
        forking_token_count(a.forking_tokens.rho, 0).map(drop),
        &[key("rho", format!("{P}.forking_tokens.rho"))],
    )?;
    let e = &a.entropy_bonus;
    real(
        &format!("{P}.entropy_bonus.coef"),
        e.coef,
        e.coef >= 0.0,
        ">= 0",
    )?;
    // the controller's checks (a fixed coefficient has target 0); its starting value is
    // checked below, only with a target and in the config's words
    let controller = EntropyCoefController {
        coef: e.min_coef,
        target: e.target.unwrap_or(0.0),
        lr: e.lr,
        min: e.min_coef,
        max: e.max_coef,
    };
    const B: &str = "worker.actor.entropy_bonus";
    from_core(
        controller.validate(),
        &[
            key("target_entropy", format!("{B}.target")),
            key("entropy_coeff_lr", format!("{B}.lr")),
            key("entropy_coeff_min", format!("{B}.min_coef")),
            worded(
                "entropy_coeff_max",
                format!("{B}.max_coef"),
                ">= entropy_bonus.min_coef",
            ),
        ],
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
    real(
        &format!("{P}.min_p"),
        r.min_p,
        (0.0..=1.0).contains(&r.min_p),
        "in [0, 1] (0 = off)",
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
    real(
        &format!("{P}.multi_turn.call_cost"),
        m.call_cost,
        m.call_cost >= 0.0 && m.call_cost.is_finite(),
        ">= 0 and finite",
    )?;
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
    if let Some(p) = v.min_p {
        real(
            &format!("{P}.val_override_config.min_p"),
            p,
            (0.0..=1.0).contains(&p),
            "in [0, 1] (0 = off)",
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
    if t.weight_dtype == super::WeightDtypeCfg::Bf16
        && t.matmul_precision != super::MatmulPrecisionCfg::Bf16
    {
        return Err(ConfigError::Inconsistent {
            key: "trainer.weight_dtype".into(),
            value: "bf16".into(),
            reason: format!(
                "weights stored in bf16 multiply in bf16: set trainer.matmul_precision: bf16 \
                 (it is {})",
                t.matmul_precision.name()
            ),
        });
    }
    if t.activation_dtype == Some(super::StorageDtypeCfg::Bf16)
        && t.matmul_precision != super::MatmulPrecisionCfg::Bf16
    {
        return Err(ConfigError::Inconsistent {
            key: "trainer.activation_dtype".into(),
            value: "bf16".into(),
            reason: format!(
                "activations stored in bf16 are multiplied in bf16: set \
                 trainer.matmul_precision: bf16 (it is {})",
                t.matmul_precision.name()
            ),
        });
    }
    if t.zero_stage > 1 {
        return Err(out_of_range(
            "trainer.zero_stage",
            t.zero_stage.to_string(),
            "0 (no sharding) or 1 (optimizer states sharded across ranks)",
        ));
    }
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
    fn cuda_graphs_need_a_gpu() {
        let mut c = Config::default();
        c.worker.rollout.cuda_graphs = true;
        c.trainer.device = crate::config::Device::Cpu;
        let e = err(&c);
        assert!(
            e.contains("worker.rollout.cuda_graphs") && e.contains("needs a GPU"),
            "{e}"
        );
        for device in [crate::config::Device::Cuda, crate::config::Device::Auto] {
            c.trainer.device = device;
            c.validate()
                .expect("graphs on a GPU, or on one found at run time");
        }
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

    /// Every key whose check is ares-core's, with the message the config gave before it
    /// called core (key, value and range in the config's words).
    #[test]
    fn core_checks_are_reported_under_config_keys() {
        type Case = (fn(&mut Config), &'static str);
        let cases: &[Case] = &[
            (
                |c| c.algorithm.kl_coef = -1.0,
                "algorithm.kl_coef = -1: >= 0",
            ),
            (
                |c| c.algorithm.kl_target = 0.0,
                "algorithm.kl_target = 0: > 0",
            ),
            (
                |c| c.algorithm.kl_horizon = -2.0,
                "algorithm.kl_horizon = -2: > 0",
            ),
            (
                |c| c.algorithm.dual_ascent.eta = -1.0,
                "algorithm.dual_ascent.eta = -1: >= 0",
            ),
            (
                |c| c.algorithm.dual_ascent.lambda_max = -1.0,
                "algorithm.dual_ascent.lambda_max = -1: >= 0",
            ),
            (
                |c| c.algorithm.dual_ascent.lambda_init.hard = 100.0,
                "algorithm.dual_ascent.lambda_init.hard = 100: \
                 in [0, algorithm.dual_ascent.lambda_max = 10]",
            ),
            (
                |c| c.algorithm.dual_ascent.budget.medium = -1.0,
                "algorithm.dual_ascent.budget.medium = -1: >= 0",
            ),
            (
                |c| c.algorithm.difficulty_thresholds.medium = 1.5,
                "algorithm.difficulty_thresholds.medium = 1.5: in [0, 1]",
            ),
            (
                |c| c.algorithm.difficulty_thresholds.easy = 0.25,
                "algorithm.difficulty_thresholds.easy = 0.25: \
                 in [algorithm.difficulty_thresholds.medium = 0.3333333333333333, 1]",
            ),
            (
                |c| c.algorithm.entropy_reward.tau_momentum = 2.0,
                "algorithm.entropy_reward.tau_momentum = 2: in [0, 1]",
            ),
            (
                |c| c.algorithm.entropy_reward.alpha_lr = -1.0,
                "algorithm.entropy_reward.alpha_lr = -1: >= 0",
            ),
            (
                |c| c.algorithm.entropy_reward.alpha_min = -1.0,
                "algorithm.entropy_reward.alpha_min = -1: >= 0",
            ),
            (
                |c| c.algorithm.entropy_reward.alpha_max = -1.0,
                "algorithm.entropy_reward.alpha_max = -1: \
                 >= algorithm.entropy_reward.alpha_min = 0",
            ),
            (
                |c| c.algorithm.entropy_reward.alpha_init = 3.0,
                "algorithm.entropy_reward.alpha_init = 3: in [algorithm.entropy_reward.alpha_min \
                 = 0, algorithm.entropy_reward.alpha_max = 2]",
            ),
            (
                |c| c.algorithm.entropy_reward.target_update_interval = 0,
                "algorithm.entropy_reward.target_update_interval = 0: >= 1",
            ),
            (
                |c| c.algorithm.entropy_reward.target_momentum = -0.5,
                "algorithm.entropy_reward.target_momentum = -0.5: in [0, 1]",
            ),
            (
                |c| c.algorithm.entropy_reward.target_scale.hard = -1.0,
                "algorithm.entropy_reward.target_scale.hard = -1: >= 0",
            ),
            (
                |c| {
                    c.algorithm.entropy_reward.enable = false;
                    c.algorithm.grpo_lambda.enable = true;
                    c.algorithm.grpo_lambda.alpha = 2.0;
                },
                "algorithm.grpo_lambda.alpha = 2: in [0, 1]",
            ),
            (
                |c| c.worker.actor.clip_ratio_low = 1.5,
                "worker.actor.clip_ratio_low = 1.5: in [0, 1]",
            ),
            (
                |c| c.worker.actor.clip_ratio_high = -1.0,
                "worker.actor.clip_ratio_high = -1: >= 0",
            ),
            (
                |c| c.worker.actor.clip_ratio_dual = 0.5,
                "worker.actor.clip_ratio_dual = 0.5: 0 (off) or > 1",
            ),
            (
                |c| c.worker.actor.clip_cov_ratio = 0.0,
                "worker.actor.clip_cov_ratio = 0: in (0, 1]",
            ),
            (
                |c| c.worker.actor.clip_cov_ub = 1.0,
                "worker.actor.clip_cov_ub = 1: > worker.actor.clip_cov_lb",
            ),
            (
                |c| c.worker.actor.kl_cov_ratio = 2.0,
                "worker.actor.kl_cov_ratio = 2: in (0, 1]",
            ),
            (
                |c| c.worker.actor.ppo_kl_coef = -1.0,
                "worker.actor.ppo_kl_coef = -1: >= 0",
            ),
            (
                |c| c.worker.actor.forking_tokens.rho = 0.0,
                "worker.actor.forking_tokens.rho = 0: in (0, 1]",
            ),
            (
                |c| c.worker.actor.entropy_bonus.target = Some(-1.0),
                "worker.actor.entropy_bonus.target = -1: >= 0",
            ),
            (
                |c| c.worker.actor.entropy_bonus.lr = -1.0,
                "worker.actor.entropy_bonus.lr = -1: >= 0",
            ),
            (
                |c| c.worker.actor.entropy_bonus.min_coef = -1.0,
                "worker.actor.entropy_bonus.min_coef = -1: >= 0",
            ),
            (
                |c| c.worker.actor.entropy_bonus.max_coef = -1.0,
                "worker.actor.entropy_bonus.max_coef = -1: >= entropy_bonus.min_coef",
            ),
        ];
        for (change, want) in cases {
            let mut c = Config::default();
            change(&mut c);
            let (key_value, range) = want.split_once(": ").expect("key = value: range");
            assert_eq!(
                err(&c),
                format!("{key_value} is out of range: expected {range}")
            );
        }
        let mut c = Config::default();
        c.worker.actor.entropy_bonus.target = Some(0.2);
        c.worker.actor.entropy_bonus.coef = 1.0;
        assert_eq!(
            err(&c),
            "worker.actor.entropy_bonus.coef = 1: the controller's starting value must lie in \
             [min_coef, max_coef] = [0, 0.005]"
        );
        c.worker.actor.entropy_bonus.target = None;
        c.validate().expect("a fixed coefficient has no bounds");
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
