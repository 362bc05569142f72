//! `algorithm.*`: advantages, KL, online filtering, difficulty buckets, ARES entropy
//! shaping and GRPO-λ — the knobs of `docs/algorithms.md` §§2–8 with its defaults.
//!
//! Per-bucket values are ares-core's `PerBucket` (`{easy, medium, hard}`): all three are
//! required when the map is typed, but a partial map in a config file keeps the spec default
//! of the buckets it leaves out, since the file is merged onto the defaults first.

use ares_core::difficulty::{AccuracyThresholds, DifficultyConfig, PerBucket};
use ares_core::kl::KlEstimator;
use serde::{Deserialize, Serialize};

use super::choices::{self, Choice, Choices, serde_by_table, spellings};

/// Advantage estimator (docs/algorithms.md §5). ares-core has one function per estimator
/// and no type naming them, so this is the config's own set; its names and aliases are
/// the table [`ESTIMATORS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvEstimator {
    /// GRPO: `(r − mean_g)/(std_g + 1e−6)`; Dr.GRPO when `norm_adv_by_std_in_grpo` is false.
    Grpo,
    /// Dr.GRPO: `r − mean_g` (no division by the group std).
    DrGrpo,
    /// RLOO: `r` minus the mean of the other n − 1 samples of the group.
    Rloo,
    /// REINFORCE++: return-to-go of token rewards, whitened over the batch.
    Reinforce,
    /// REINFORCE++-baseline: `r − mean_g`, whitened over the batch.
    ReinforceBaseline,
    /// REINFORCE Pro Max (docs/algorithms.md §5): RLOO, then per-prompt α/β token normalisation.
    ReinforceProMax,
}

/// The advantage estimators by name: `algorithm.adv_estimator` reads a name or an alias
/// (verl's `reinforce_plus_plus`, `reinforce_plus_plus_baseline`) and writes the name.
/// The trainer's dispatch is the one match of `trainer::settings::step_settings`.
pub const ESTIMATORS: [Choice<AdvEstimator>; 6] = [
    Choice {
        value: AdvEstimator::Grpo,
        name: "grpo",
        aliases: &[],
    },
    Choice {
        value: AdvEstimator::DrGrpo,
        name: "dr_grpo",
        aliases: &[],
    },
    Choice {
        value: AdvEstimator::Rloo,
        name: "rloo",
        aliases: &[],
    },
    Choice {
        value: AdvEstimator::Reinforce,
        name: "reinforce",
        aliases: &["reinforce_plus_plus"],
    },
    Choice {
        value: AdvEstimator::ReinforceBaseline,
        name: "reinforce_baseline",
        aliases: &["reinforce_plus_plus_baseline"],
    },
    Choice {
        value: AdvEstimator::ReinforceProMax,
        name: "reinforce_pro_max",
        aliases: &[],
    },
];
const ESTIMATOR_SPELLINGS: [&str; 8] = spellings(&ESTIMATORS);

impl Choices for AdvEstimator {
    const TYPE: &'static str = "AdvEstimator";
    const TABLE: &'static [Choice<Self>] = &ESTIMATORS;
    const SPELLINGS: &'static [&'static str] = &ESTIMATOR_SPELLINGS;
}
serde_by_table!(AdvEstimator);

impl AdvEstimator {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        choices::name(self)
    }

    /// Whether the estimator compares the samples of a prompt's group, so that it needs
    /// `n ≥ 2` (every estimator but plain REINFORCE++).
    pub const fn needs_group(self) -> bool {
        !matches!(self, AdvEstimator::Reinforce)
    }
}

/// How the KL coefficient β evolves (docs/algorithms.md §4). Not ares-core's
/// `KlController`: that one holds a running coefficient and has no `dual_ascent` (the
/// per-bucket λ_d of `DifficultyConfig`), so the config keeps this choice of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlCtrl {
    /// β = `kl_coef` throughout.
    Fixed,
    /// `e = clip(KL/kl_target − 1, ±0.2)`, `β ← β·(1 + e·N/kl_horizon)`.
    Adaptive,
    /// One λ_d per difficulty bucket, by dual ascent on the KL budgets (docs/algorithms.md §2).
    DualAscent,
}

impl KlCtrl {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            KlCtrl::Fixed => "fixed",
            KlCtrl::Adaptive => "adaptive",
            KlCtrl::DualAscent => "dual_ascent",
        }
    }
}

/// Dual ascent on per-bucket KL budgets (docs/algorithms.md §2):
/// `λ_d ← min(λ_max, max(0, λ_d + η·(KL_d − ε_d)))`; λ_d is the bucket's KL coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DualAscentConfig {
    /// Dual step size η ≥ 0 (default 0.01).
    pub eta: f64,
    /// Initial λ_d, in `[0, lambda_max]` (default easy 0.002, medium 0.001, hard 0.0005).
    pub lambda_init: PerBucket<f64>,
    /// KL budgets ε_d ≥ 0 (default easy 0.05, medium 0.1, hard 0.2).
    pub budget: PerBucket<f64>,
    /// Upper clip of every λ_d, ≥ 0 (default 10).
    pub lambda_max: f64,
}

impl Default for DualAscentConfig {
    fn default() -> Self {
        DualAscentConfig {
            eta: 0.01,
            lambda_init: PerBucket::new(0.002, 0.001, 0.0005),
            budget: PerBucket::new(0.05, 0.1, 0.2),
            lambda_max: 10.0,
        }
    }
}

/// Remove solved prompts from the training set (docs/algorithms.md §7): a prompt whose
/// group is all correct with mean token entropy below `entropy_threshold` on `consecutive`
/// visits in a row is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DropSolvedConfig {
    /// Whether solved prompts are dropped (default false).
    pub enable: bool,
    /// Mean token entropy (nats) below which an all-correct visit counts, ≥ 0 (default 0.3).
    pub entropy_threshold: f64,
    /// Visits in a row needed, ≥ 1 (default 3).
    pub consecutive: usize,
}

impl Default for DropSolvedConfig {
    fn default() -> Self {
        DropSolvedConfig {
            enable: false,
            entropy_threshold: 0.3,
            consecutive: 3,
        }
    }
}

/// ARES difficulty-aware entropy reward (docs/algorithms.md §§1–3): HWE tokens against the global
/// threshold τ, per-bucket targets `T_d`, adaptive coefficients `α_d` and the shaping table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EntropyRewardConfig {
    /// Add the shaping term S to the accuracy reward (default true).
    pub enable: bool,
    /// Window `H_t … H_{t+w−1}` (the paper's variant) instead of `H_{t+1} … H_{t+w}`
    /// (default false). The window size is `worker.rollout.window_size`.
    pub window_includes_self: bool,
    /// Percentile of a response's window means that is its threshold, in `[0, 100]`
    /// (default 95; linear interpolation as numpy).
    pub percentile: f64,
    /// EMA momentum ρ of τ, in `[0, 1]`: `τ ← ρ·τ + (1−ρ)·m` (default 0.99).
    pub tau_momentum: f64,
    /// Restrict HWE candidates to positions whose token decodes (trimmed, lower-cased) to one
    /// of these words; empty (default) = every token is a candidate.
    pub trigger_words: Vec<String>,
    /// Initial α_d of every bucket, in `[alpha_min, alpha_max]` (default 0.5).
    pub alpha_init: f64,
    /// Step size of the α ascent toward the target, ≥ 0 (default 0.05).
    pub alpha_lr: f64,
    /// Lower clip of α, ≥ 0 (default 0).
    pub alpha_min: f64,
    /// Upper clip of α, ≥ `alpha_min` (default 2).
    pub alpha_max: f64,
    /// Update the targets every this many steps, ≥ 1 (default 1).
    pub target_update_interval: usize,
    /// Target momentum μ in `[0, 1]`: `T_d ← round((1−μ)·T_d + μ·s_d·h̄_d)` (default 1).
    pub target_momentum: f64,
    /// Target scale s_d ≥ 0 (default 1 for every bucket).
    pub target_scale: PerBucket<f64>,
    /// Margin fraction f: `m = max(1, f·max(T, 1))`, ≥ 0 (default 0.15, 0.25, 0.35).
    pub margin_fraction: PerBucket<f64>,
    /// Huber κ > 0 (default 2, 3, 4).
    pub huber_kappa: PerBucket<f64>,
    /// Sigmoid temperature t > 0 (default 2, 2.5, 3).
    pub sigmoid_temperature: PerBucket<f64>,
    /// Cap scale c ≥ 0: `cap = α·c` (default 1, 1, 1.2).
    pub cap_scale: PerBucket<f64>,
    /// Wrong-answer factor w ≥ 0 (default 0.6, 0.8, 1.0).
    pub wrong_factor: PerBucket<f64>,
}

impl Default for EntropyRewardConfig {
    fn default() -> Self {
        EntropyRewardConfig {
            enable: true,
            window_includes_self: false,
            percentile: 95.0,
            tau_momentum: 0.99,
            trigger_words: Vec::new(),
            alpha_init: 0.5,
            alpha_lr: 0.05,
            alpha_min: 0.0,
            alpha_max: 2.0,
            target_update_interval: 1,
            target_momentum: 1.0,
            target_scale: PerBucket::splat(1.0),
            margin_fraction: PerBucket::new(0.15, 0.25, 0.35),
            huber_kappa: PerBucket::new(2.0, 3.0, 4.0),
            sigmoid_temperature: PerBucket::new(2.0, 2.5, 3.0),
            cap_scale: PerBucket::new(1.0, 1.0, 1.2),
            wrong_factor: PerBucket::new(0.6, 0.8, 1.0),
        }
    }
}

/// GRPO-λ (docs/algorithms.md §8): the top `max(1, ceil(λ·G))` groups by accuracy get the length
/// reward `1 − α·sig(z)` on their correct samples; the others keep 0/1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoLambdaConfig {
    /// Use the GRPO-λ reward instead of 0/1 (default false).
    pub enable: bool,
    /// Fraction λ of the batch's groups that are efficiency-priority, in `(0, 1]`
    /// (default 0.2).
    pub lambda: f64,
    /// Length-penalty weight α, in `[0, 1]` so that a correct answer never scores below 0
    /// (default 0.6).
    pub alpha: f64,
}

impl Default for GrpoLambdaConfig {
    fn default() -> Self {
        GrpoLambdaConfig {
            enable: false,
            lambda: 0.2,
            alpha: 0.6,
        }
    }
}

/// The algorithm section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmConfig {
    /// Advantage estimator (default `grpo`).
    pub adv_estimator: AdvEstimator,
    /// GRPO divides by the group std (default true); false gives Dr.GRPO.
    pub norm_adv_by_std_in_grpo: bool,
    /// Discount γ of the return-to-go, in `[0, 1]` (default 1; Pro Max forces 1).
    pub gamma: f64,
    /// Pro Max `uniform_scale`: a group of equal rewards gets `r/n` and skips the α/β
    /// normalisation (default false).
    pub uniform_scale: bool,
    /// Pro Max upper clamp of α and β, > 0 (default 10).
    pub pro_max_max_scale: f64,
    /// No KL anywhere and no reference model (EasyR1's `disable_kl`; default false).
    pub disable_kl: bool,
    /// KL as a loss term (default true) or folded into the token rewards (false).
    pub use_kl_loss: bool,
    /// KL estimator (default `low_var_kl`, k3; also read as `k1`/`kl`, `abs`, `k2`/`mse`,
    /// `k3`, `k1+`/`kl+`, `k3+`/`low_var_kl+`).
    pub kl_penalty: KlEstimator,
    /// KL coefficient β of the `fixed` and `adaptive` controllers, ≥ 0 (default 1e−3).
    pub kl_coef: f64,
    /// KL controller (default `dual_ascent`). (Older name: `kl_ctrl`.)
    pub kl_type: KlCtrl,
    /// Target KL of the adaptive controller, > 0 (default 0.1).
    pub kl_target: f64,
    /// Horizon of the adaptive controller, > 0 (default 10000).
    pub kl_horizon: f64,
    /// Dual ascent on per-bucket KL budgets.
    pub dual_ascent: DualAscentConfig,
    /// Accuracy thresholds of the difficulty buckets (added to the contract: docs/algorithms.md §2's 2/3
    /// and 1/3 are knobs too): easy iff `accuracy ≥ easy`, medium iff `accuracy ≥ medium`,
    /// else hard. With n = 8: 6–8 correct easy, 3–5 medium, 0–2 hard. Requires
    /// `0 ≤ medium ≤ easy ≤ 1` (default easy 2/3, medium 1/3).
    pub difficulty_thresholds: AccuracyThresholds<f64>,
    /// Keep only groups with `filter_low < mean(filter_key) < filter_high` and sample more
    /// batches until `data.rollout_batch_size` groups are kept (default true).
    pub online_filtering: bool,
    /// Per-sample metric the filter averages: `accuracy` (default), `overall`, or any reward
    /// metric.
    pub filter_key: String,
    /// Lower bound (exclusive) of the kept group mean (default 0.01).
    pub filter_low: f64,
    /// Upper bound (exclusive) of the kept group mean (default 0.99).
    pub filter_high: f64,
    /// Removal of solved prompts.
    pub drop_solved: DropSolvedConfig,
    /// ARES entropy shaping.
    pub entropy_reward: EntropyRewardConfig,
    /// GRPO-λ length reward.
    pub grpo_lambda: GrpoLambdaConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        AlgorithmConfig {
            adv_estimator: AdvEstimator::Grpo,
            norm_adv_by_std_in_grpo: true,
            gamma: 1.0,
            uniform_scale: false,
            pro_max_max_scale: 10.0,
            disable_kl: false,
            use_kl_loss: true,
            kl_penalty: KlEstimator::K3,
            kl_coef: 1e-3,
            kl_type: KlCtrl::DualAscent,
            kl_target: 0.1,
            kl_horizon: 10000.0,
            dual_ascent: DualAscentConfig::default(),
            difficulty_thresholds: AccuracyThresholds::default(),
            online_filtering: true,
            filter_key: "accuracy".into(),
            filter_low: 0.01,
            filter_high: 0.99,
            drop_solved: DropSolvedConfig::default(),
            entropy_reward: EntropyRewardConfig::default(),
            grpo_lambda: GrpoLambdaConfig::default(),
        }
    }
}

impl AlgorithmConfig {
    /// ares-core's settings of the difficulty controller: the bucket thresholds, the dual
    /// ascent on the KL budgets (`dual_ascent`) and the α and target settings of
    /// `entropy_reward` (α starts at `alpha_init` in every bucket). The trainer runs it and
    /// validation checks it with ares-core's [`DifficultyConfig::validate`].
    pub fn difficulty(&self) -> DifficultyConfig<f64> {
        let (er, da) = (&self.entropy_reward, &self.dual_ascent);
        DifficultyConfig {
            accuracy_thresholds: self.difficulty_thresholds,
            target_momentum: er.target_momentum,
            target_scale: er.target_scale,
            target_update_interval: er.target_update_interval as u64,
            alpha_init: PerBucket::splat(er.alpha_init),
            alpha_lr: er.alpha_lr,
            alpha_min: er.alpha_min,
            alpha_max: er.alpha_max,
            lambda_init: da.lambda_init,
            kl_budget: da.budget,
            lambda_lr: da.eta,
            lambda_max: da.lambda_max,
        }
    }
}
