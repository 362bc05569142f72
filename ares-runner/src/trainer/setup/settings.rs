//! [`StepSettings`]: everything one RL step reads, and [`step_settings`], which resolves it
//! from the validated configuration into ares-core's types (so the step itself never parses
//! strings or re-validates keys).

use ares_core::advantage::ProMaxConfig;
use ares_core::difficulty::{DifficultyConfig, PerBucket};
use ares_core::kl::{KlController, KlEstimator};
use ares_core::length::GrpoLambda;
use ares_core::loss::{
    ClipCovParams, ClipParams, GspoLevel, IsCorrection, IsMode, KlCovParams, PolicyLossConfig,
};
use ares_core::shaping::{BucketShaping, ShapingConfig};

use crate::config::{self, Config};
use crate::model::Sampling;
use crate::trainer::TrainError;
use crate::trainer::prepare::advantages::Estimator;
use crate::trainer::prepare::hwe::HweParams;
use crate::trainer::prepare::rewards::{Base, RewardParams};
use crate::trainer::update::policy::Objective;

/// The KL coefficient β and how it moves (docs/algorithms.md §4, §2): one type from the
/// resolved configuration to the step, carried between steps in the controllers' state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlControl {
    /// One β for every row: ares-core's fixed or adaptive controller (`kl_coef`, and for
    /// `adaptive` `kl_target` / `kl_horizon`).
    Global(KlController<f64>),
    /// β of a row is its bucket's λ_d, moved by dual ascent (the bucket controller of
    /// [`DifficultyConfig`]).
    DualAscent,
}

/// KL settings (docs/algorithms.md §4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlSettings {
    /// KL as a loss term (true) or folded into the rewards (false).
    pub use_kl_loss: bool,
    /// Estimator of the per-token KL.
    pub estimator: KlEstimator,
    /// Where β comes from.
    pub control: KlControl,
    /// Dynamic token-level KL: HWE tokens get `low_ratio·β`.
    pub dynamic: bool,
    /// Weight factor of HWE tokens.
    pub low_ratio: f64,
    /// Whether a reference model is used at all (false when β ≡ 0 and the KL is not
    /// needed; saves a forward pass).
    pub enabled: bool,
}

/// What online filtering averages per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterKey {
    /// Accuracy (0/1).
    Accuracy,
    /// The overall reward.
    Overall,
    /// The entropy reward `S`.
    Entropy,
    /// The format reward.
    Format,
}

/// Online filtering (docs/algorithms.md §7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterSettings {
    /// The averaged metric.
    pub key: FilterKey,
    /// Keep iff `low < mean < high`.
    pub low: f64,
    /// Upper bound.
    pub high: f64,
}

/// The optimizer schedule of the actor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimSettings {
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Cosine decay to `min_lr_ratio·lr` over the run (else constant).
    pub cosine: bool,
    /// Floor of the cosine schedule.
    pub min_lr_ratio: f64,
    /// Optimizer steps of the whole run (for the cosine schedule).
    pub total_steps: u64,
    /// Global grad-norm clip (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
}

impl OptimSettings {
    /// Learning rate at optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if !self.cosine || self.total_steps <= self.warmup_steps {
            return self.lr;
        }
        let span = (self.total_steps - self.warmup_steps) as f64;
        let x = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let min = self.lr * self.min_lr_ratio;
        min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * x).cos())
    }
}

/// Everything one RL step reads.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSettings {
    /// Samples per prompt.
    pub n: usize,
    /// Groups (prompts) per step.
    pub groups_per_step: usize,
    /// Prompts generated per round (`data.mini_rollout_batch_size`, else `groups_per_step`).
    pub groups_per_round: usize,
    /// Generation rounds per step at most (0: unlimited).
    pub max_tries: usize,
    /// Rollout sampling.
    pub sampling: Sampling,
    /// New tokens per response at most.
    pub max_new_tokens: usize,
    /// Sequences generated together (bounds the KV cache).
    pub rollout_chunk: usize,
    /// Decode weights of every generation of the run.
    pub weight_dtype: crate::model::WeightDtype,
    /// Decode buckets and CUDA graphs in every generation of the run.
    pub cuda_graphs: bool,
    /// The KV cache's number format in every generation of the run.
    pub kv_cache_dtype: crate::model::KvCacheDtype,
    /// The KV pool's cap in blocks when the memory plan needs one to fit (`None`: it grows
    /// as the sequences need).
    pub max_kv_blocks: Option<usize>,
    /// Base seed of the rollout streams.
    pub rollout_seed: u64,
    /// HWE windows and thresholds.
    pub hwe: HweParams,
    /// EMA factor ρ of τ.
    pub tau_momentum: f64,
    /// Trigger words (lower-case, trimmed); empty: every token is a candidate.
    pub trigger_words: Vec<String>,
    /// Targets, α, λ.
    pub difficulty: DifficultyConfig<f64>,
    /// Rewards.
    pub reward: RewardParams,
    /// Advantage estimator.
    pub estimator: Estimator,
    /// KL.
    pub kl: KlSettings,
    /// Online filtering (`None`: off).
    pub filter: Option<FilterSettings>,
    /// Clip, aggregation and importance correction of the policy loss.
    pub policy: PolicyLossConfig<f32>,
    /// Which policy loss (`worker.actor.policy_loss`).
    pub objective: Objective,
    /// The entropy bonus's coefficient controller in its starting state (`None`: no bonus).
    /// A fixed coefficient is a controller with `lr = 0` and bounds `[coef, coef]`.
    pub entropy_bonus: Option<ares_core::entropy_bonus::EntropyCoefController<f64>>,
    /// Forking tokens: ρ, the fraction of the step's response tokens that keep their
    /// policy gradient (`None`: every token).
    pub forking_rho: Option<f32>,
    /// Whether the sampler's log-probs are needed (importance correction on).
    pub uses_rollout_log_probs: bool,
    /// PPO epochs over each batch.
    pub ppo_epochs: usize,
    /// Samples per optimizer step.
    pub mini_batch: usize,
    /// Samples per forward/backward.
    pub micro_batch: usize,
    /// Passes laid out without padding where the model takes it
    /// (`worker.actor.padding_free`).
    pub padding_free: bool,
    /// Optimizer schedule.
    pub optim: OptimSettings,
    /// The ranks of a data-parallel run (`None`: one process alone). Set by
    /// [`Trainer::join`](crate::trainer::Trainer::join).
    pub ranks: Option<crate::parallel::Ranks>,
    /// How the ranks add their gradients (`trainer.gradient_sum`).
    pub gradient_sum: crate::config::GradientSum,
    /// Whether the ranks' sum starts during the backward (`trainer.overlap_gradient_sum`;
    /// `None`: where it runs on the device).
    pub overlap_gradient_sum: Option<bool>,
}

/// The sampling of the rollout (`temperature`, `top_k` 0 = off, `top_p`, `min_p` 0 = off).
pub fn rollout_sampling(cfg: &Config) -> Sampling {
    let r = &cfg.worker.rollout;
    Sampling::Sample {
        temperature: r.temperature as f32,
        top_k: (r.top_k > 0).then_some(r.top_k),
        top_p: r.top_p as f32,
        min_p: r.min_p as f32,
    }
}

/// The sampling of validation (`worker.rollout.val_override_config` over the rollout's):
/// greedy at temperature 0.
pub fn validation_sampling(cfg: &Config) -> Sampling {
    let r = &cfg.worker.rollout;
    if r.val_temperature() == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Sample {
            temperature: r.val_temperature() as f32,
            top_k: (r.val_top_k() > 0).then_some(r.val_top_k()),
            top_p: r.val_top_p() as f32,
            min_p: r.val_min_p() as f32,
        }
    }
}

/// The settings of a run of `total_steps` RL steps.
///
/// # Errors
/// A filter key that is not a reward metric, or parameters ares-core rejects.
pub fn step_settings(cfg: &Config, total_steps: u64) -> Result<StepSettings, TrainError> {
    let alg = &cfg.algorithm;
    let er = &alg.entropy_reward;
    let actor = &cfg.worker.actor;
    let rollout = &cfg.worker.rollout;
    let difficulty = alg.difficulty();
    difficulty.validate()?;
    // (in this order: which error a config with several shows first)
    let reward = reward_params(cfg)?;
    let estimator = estimator(alg);
    let kl = kl_settings(cfg)?;
    let filter = filter(alg)?;
    let (policy, objective) = policy_loss(actor)?;
    let (mini_batch, micro_batch, optim) = batches(cfg, total_steps);
    Ok(StepSettings {
        n: rollout.n,
        groups_per_step: cfg.data.rollout_batch_size,
        groups_per_round: cfg
            .data
            .mini_rollout_batch_size
            .unwrap_or(cfg.data.rollout_batch_size),
        max_tries: usize::try_from(cfg.trainer.max_try_make_batch.max(0)).unwrap_or(0),
        sampling: rollout_sampling(cfg),
        max_new_tokens: cfg.data.max_response_length,
        rollout_chunk: 64,
        weight_dtype: rollout.weight_dtype.into(),
        cuda_graphs: rollout.cuda_graphs,
        kv_cache_dtype: rollout.kv_cache_dtype.into(),
        max_kv_blocks: None,
        rollout_seed: rollout.seed,
        hwe: HweParams {
            window_size: rollout.window_size,
            window_includes_self: er.window_includes_self,
            percentile: er.percentile,
        },
        tau_momentum: er.tau_momentum,
        trigger_words: er
            .trigger_words
            .iter()
            .map(|w| w.trim().to_lowercase())
            .collect(),
        difficulty,
        reward,
        estimator,
        kl,
        filter,
        uses_rollout_log_probs: policy.is_correction.mode != IsMode::None,
        policy,
        objective,
        entropy_bonus: entropy_bonus(&actor.entropy_bonus)?,
        forking_rho: {
            let f = &actor.forking_tokens;
            f.enable.then_some(f.rho as f32)
        },
        ppo_epochs: actor.ppo_epochs.max(1),
        mini_batch,
        micro_batch,
        padding_free: cfg.worker.actor.padding_free,
        optim,
        ranks: None,
        gradient_sum: cfg.trainer.gradient_sum,
        overlap_gradient_sum: cfg.trainer.overlap_gradient_sum,
    })
}

/// The rewards (docs/algorithms.md §3, §8, §9): the base (accuracy, GRPO-λ or a rubric
/// score), ARES's per-bucket shaping when enabled, the format weight and DAPO's overlong
/// penalty.
fn reward_params(cfg: &Config) -> Result<RewardParams, TrainError> {
    let alg = &cfg.algorithm;
    let er = &alg.entropy_reward;
    let shaping = er
        .enable
        .then(|| {
            let (f, k, t) = (er.margin_fraction, er.huber_kappa, er.sigmoid_temperature);
            let (c, w) = (er.cap_scale, er.wrong_factor);
            let b = |d| BucketShaping::new(f[d], k[d], t[d], c[d], w[d]);
            use ares_core::difficulty::Difficulty::{Easy, Hard, Medium};
            let s = ShapingConfig {
                buckets: PerBucket::new(b(Easy), b(Medium), b(Hard)),
                format_weight: cfg.worker.reward.format_weight,
            };
            s.validate().map(|()| s)
        })
        .transpose()?;
    let base = if alg.grpo_lambda.enable {
        Base::GrpoLambda(GrpoLambda {
            lambda_: alg.grpo_lambda.lambda,
            alpha: alg.grpo_lambda.alpha,
        })
    } else if cfg.worker.reward.grader == config::RewardGrader::Rubric {
        Base::Rubric
    } else {
        Base::Accuracy
    };

    let o = &cfg.worker.reward.overlong_buffer;
    Ok(RewardParams {
        base,
        shaping,
        format_weight: cfg.worker.reward.format_weight,
        overlong: o
            .enable
            .then_some(crate::trainer::prepare::rewards::Overlong {
                max_len: cfg.data.max_response_length,
                buffer_len: o.len,
                penalty_factor: o.penalty_factor,
                only_correct: o.only_correct,
            }),
    })
}

/// The advantage estimator (docs/algorithms.md §5): the one match of the config's
/// estimators.
fn estimator(alg: &config::AlgorithmConfig) -> Estimator {
    match alg.adv_estimator {
        config::AdvEstimator::Grpo => Estimator::Grpo {
            norm_by_std: alg.norm_adv_by_std_in_grpo,
        },
        config::AdvEstimator::DrGrpo => Estimator::Grpo { norm_by_std: false },
        config::AdvEstimator::Rloo => Estimator::Rloo,
        config::AdvEstimator::Reinforce => Estimator::Reinforce {
            gamma: alg.gamma as f32,
        },
        config::AdvEstimator::ReinforceBaseline => Estimator::ReinforceBaseline {
            gamma: alg.gamma as f32,
        },
        config::AdvEstimator::ReinforceProMax => {
            if alg.gamma != 1.0 {
                tracing_warn(&format!(
                    "algorithm.gamma = {} is ignored by reinforce_pro_max (γ is 1 by definition)",
                    alg.gamma
                ));
            }
            Estimator::ProMax(ProMaxConfig {
                uniform_scale: alg.uniform_scale,
                max_scale: alg.pro_max_max_scale as f32,
                ..ProMaxConfig::default()
            })
        }
    }
}

/// The KL penalty (docs/algorithms.md §4): its estimator, control (fixed, adaptive or dual
/// ascent), and whether it is on at all.
fn kl_settings(cfg: &Config) -> Result<KlSettings, TrainError> {
    let alg = &cfg.algorithm;
    let actor = &cfg.worker.actor;
    let control = match alg.kl_type {
        config::KlCtrl::Fixed => KlControl::Global(KlController::fixed(alg.kl_coef)?),
        config::KlCtrl::Adaptive => KlControl::Global(KlController::adaptive(
            alg.kl_coef,
            alg.kl_target,
            alg.kl_horizon,
        )?),
        config::KlCtrl::DualAscent => KlControl::DualAscent,
    };
    let kl_off =
        alg.disable_kl || matches!(control, KlControl::Global(KlController::Fixed(b)) if b == 0.0);
    Ok(KlSettings {
        use_kl_loss: alg.use_kl_loss,
        estimator: alg.kl_penalty,
        control,
        dynamic: actor.dynamic_kl_loss,
        low_ratio: actor.dynamic_kl_low_ratio,
        enabled: !kl_off,
    })
}

/// Online filtering (docs/algorithms.md §7), when enabled: the group statistic and its
/// bounds.
fn filter(alg: &config::AlgorithmConfig) -> Result<Option<FilterSettings>, TrainError> {
    if !alg.online_filtering {
        return Ok(None);
    }
    let key = match alg.filter_key.as_str() {
        "accuracy" | "acc" => FilterKey::Accuracy,
        "overall" | "reward" => FilterKey::Overall,
        "entropy" | "entropy_reward" => FilterKey::Entropy,
        "format" => FilterKey::Format,
        other => {
            return Err(TrainError::Invalid(format!(
                "algorithm.filter_key = {other:?}: expected one of accuracy, overall, \
                 entropy, format"
            )));
        }
    };
    Ok(Some(FilterSettings {
        key,
        low: alg.filter_low,
        high: alg.filter_high,
    }))
}

/// The policy loss (docs/algorithms.md §6, §12): clipping, aggregation, the rollout
/// importance correction, and the objective — the one match of the config's losses.
fn policy_loss(
    actor: &config::ActorConfig,
) -> Result<(PolicyLossConfig<f32>, Objective), TrainError> {
    let is_mode = actor.is_correction;
    let policy = PolicyLossConfig {
        clip: ClipParams::new(
            actor.clip_ratio_low as f32,
            actor.clip_ratio_high as f32,
            actor.clip_ratio_dual as f32,
        )?,
        agg: actor.loss_agg_mode,
        is_correction: IsCorrection {
            mode: is_mode,
            low: actor.is_threshold_low as f32,
            high: actor.is_threshold_high as f32,
        },
    };
    let objective = match actor.policy_loss {
        config::PolicyLoss::Ppo => Objective::Ppo,
        config::PolicyLoss::Gspo => Objective::Gspo(GspoLevel::Sequence),
        config::PolicyLoss::GspoToken => Objective::Gspo(GspoLevel::Token),
        config::PolicyLoss::Cispo => Objective::Cispo,
        config::PolicyLoss::ClipCov => {
            let p = ClipCovParams {
                ratio: actor.clip_cov_ratio as f32,
                lb: actor.clip_cov_lb as f32,
                ub: actor.clip_cov_ub as f32,
                seed: 0,
            };
            p.validate()?;
            Objective::ClipCov(p)
        }
        config::PolicyLoss::KlCov => {
            let p = KlCovParams {
                ratio: actor.kl_cov_ratio as f32,
                coef: actor.ppo_kl_coef as f32,
            };
            p.validate()?;
            Objective::KlCov(p)
        }
    };
    Ok((policy, objective))
}

/// Mini- and micro-batch sizes in samples, and the optimizer's schedule over the run's
/// `total_steps` steps.
fn batches(cfg: &Config, total_steps: u64) -> (usize, usize, OptimSettings) {
    let actor = &cfg.worker.actor;
    let n = cfg.worker.rollout.n;
    let step_rows = cfg.data.rollout_batch_size * n;
    // EasyR1 counts the mini-batch in prompts, each with its n responses
    let mini_batch = (actor.global_batch_size * n).min(step_rows).max(1);
    let micro_batch = actor
        .micro_batch_size_per_device_for_update
        .min(mini_batch)
        .max(1);
    let optimizer_steps = total_steps * (step_rows.div_ceil(mini_batch) * actor.ppo_epochs) as u64;
    let optim = OptimSettings {
        lr: actor.optim.lr,
        // EasyR1: the step count wins over the ratio of the run's steps
        warmup_steps: actor.optim.lr_warmup_steps.map_or_else(
            || (actor.optim.lr_warmup_ratio * optimizer_steps as f64).floor() as u64,
            |s| s as u64,
        ),
        cosine: actor.optim.lr_scheduler_type == config::LrScheduler::Cosine,
        min_lr_ratio: actor.optim.min_lr_ratio,
        total_steps: optimizer_steps,
        max_grad_norm: Some(actor.max_grad_norm as f32),
    };
    (mini_batch, micro_batch, optim)
}

/// The controller of `worker.actor.entropy_bonus` (`None` when the bonus is off).
fn entropy_bonus(
    e: &config::EntropyBonusConfig,
) -> Result<Option<ares_core::entropy_bonus::EntropyCoefController<f64>>, TrainError> {
    use ares_core::entropy_bonus::EntropyCoefController;
    if !e.active() {
        return Ok(None);
    }
    let c = match e.target {
        Some(target) => EntropyCoefController::new(e.coef, target, e.lr, e.min_coef, e.max_coef),
        None => EntropyCoefController::new(e.coef, 0.0, 0.0, e.coef, e.coef),
    };
    Ok(Some(c?))
}

/// A warning on stderr (the trainer's log).
fn tracing_warn(message: &str) {
    eprintln!("warning: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let o = OptimSettings {
            lr: 1.0,
            warmup_steps: 2,
            cosine: true,
            min_lr_ratio: 0.1,
            total_steps: 12,
            max_grad_norm: None,
        };
        assert_eq!(o.lr_at(0), 0.5);
        assert_eq!(o.lr_at(1), 1.0);
        assert_eq!(o.lr_at(2), 1.0);
        assert!((o.lr_at(7) - 0.55).abs() < 1e-12);
        assert!((o.lr_at(12) - 0.1).abs() < 1e-12);
        let c = OptimSettings { cosine: false, ..o };
        assert_eq!(c.lr_at(100), 1.0);
    }

    #[test]
    fn defaults_resolve() {
        let cfg = Config::default();
        let s = step_settings(&cfg, 10).unwrap();
        assert_eq!(s.n, 8);
        assert_eq!(s.kl.control, KlControl::DualAscent);
        assert!(s.reward.shaping.is_some());
        assert_eq!(s.reward.base, Base::Accuracy);
        assert_eq!(s.mini_batch, 64);
        assert_eq!(s.micro_batch, 8);
        assert_eq!(s.optim.total_steps, 10);
        assert!(s.filter.is_some());
    }
}
