//! [`StepSettings`]: everything one RL step reads, resolved from the configuration into
//! ares-core's types (so the step itself never parses strings or re-validates keys).

use ares_core::difficulty::DifficultyConfig;
use ares_core::kl::KlEstimator;
use ares_core::loss::PolicyLossConfig;

use super::advantages::Estimator;
use super::hwe::HweParams;
use super::policy::Objective;
use super::rewards::RewardParams;
use crate::model::Sampling;

/// Which KL coefficient a sample gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlControl {
    /// `kl_coef`, constant.
    Fixed(f64),
    /// The adaptive controller: initial β, target KL, horizon.
    Adaptive {
        /// Initial β.
        init: f64,
        /// Target KL.
        target: f64,
        /// Horizon.
        horizon: f64,
    },
    /// Per-bucket λ_d by dual ascent (the controller in [`DifficultyConfig`]).
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
    /// Generation rounds per step at most (0: unlimited).
    pub max_tries: usize,
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
    /// Rollout sampling.
    pub sampling: Sampling,
    /// New tokens per response at most.
    pub max_new_tokens: usize,
    /// Sequences generated together (bounds the KV cache).
    pub rollout_chunk: usize,
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
    /// Whether the sampler's log-probs are needed (importance correction on).
    pub uses_rollout_log_probs: bool,
    /// PPO epochs over each batch.
    pub ppo_epochs: usize,
    /// Samples per optimizer step.
    pub mini_batch: usize,
    /// Samples per forward/backward.
    pub micro_batch: usize,
    /// Optimizer schedule.
    pub optim: OptimSettings,
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
}
