//! `worker.*`: the actor (policy and its optimiser), the rollout (sampling and graded system
//! prompts), the frozen reference model and the reward.

use ares_core::loss::{IsMode, LossAggMode};
use serde::{Deserialize, Serialize};

use super::choices::{self, Choice, Choices, serde_by_table, spellings};

/// The policy loss (docs/algorithms.md §6; `ares_core::loss`). ares-core has one function
/// per loss (GSPO's two forms are its `GspoLevel`) and no type naming them all, so this is
/// the config's own set; its names and aliases are the table [`POLICY_LOSSES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyLoss {
    /// PPO clip with dual clip (`clip_ratio_low/high/dual`).
    Ppo,
    /// GSPO: the clip on the sequence ratio (geometric mean of token ratios), one loss per
    /// sequence with the sequence's mean advantage.
    Gspo,
    /// GSPO-token: the sequence ratio with a straight-through token factor, clipped per
    /// token (verl's `gspo`).
    GspoToken,
    /// CISPO: REINFORCE with a clipped, stop-gradient importance weight.
    Cispo,
    /// Clip-Cov: PPO clip; up to `clip_cov_ratio` of the tokens with covariance in
    /// `(clip_cov_lb, clip_cov_ub)` lose their gradient.
    ClipCov,
    /// KL-Cov: `−A·r`, plus `ppo_kl_coef·|log r|` on the top `kl_cov_ratio` of tokens by
    /// covariance.
    KlCov,
}

/// The policy losses by name: `worker.actor.policy_loss` reads a name or an alias (verl's
/// `vanilla` for PPO) and writes the name. EasyR1's `loss_type` names (its `gspo` is our
/// `gspo_token`) are translated by the `easyr1` rules, not read here. The trainer's dispatch
/// is the one match of `trainer::settings::step_settings`.
pub const POLICY_LOSSES: [Choice<PolicyLoss>; 6] = [
    Choice {
        value: PolicyLoss::Ppo,
        name: "ppo",
        aliases: &["vanilla"],
    },
    Choice {
        value: PolicyLoss::Gspo,
        name: "gspo",
        aliases: &[],
    },
    Choice {
        value: PolicyLoss::GspoToken,
        name: "gspo_token",
        aliases: &[],
    },
    Choice {
        value: PolicyLoss::Cispo,
        name: "cispo",
        aliases: &[],
    },
    Choice {
        value: PolicyLoss::ClipCov,
        name: "clip_cov",
        aliases: &[],
    },
    Choice {
        value: PolicyLoss::KlCov,
        name: "kl_cov",
        aliases: &[],
    },
];
const POLICY_LOSS_SPELLINGS: [&str; 7] = spellings(&POLICY_LOSSES);

impl Choices for PolicyLoss {
    const TYPE: &'static str = "PolicyLoss";
    const TABLE: &'static [Choice<Self>] = &POLICY_LOSSES;
    const SPELLINGS: &'static [&'static str] = &POLICY_LOSS_SPELLINGS;
}
serde_by_table!(PolicyLoss);

impl PolicyLoss {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        choices::name(self)
    }
}

/// The number format of the rollout's decode weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightDtype {
    /// The f32 weights that are trained (default).
    #[default]
    F32,
    /// A bf16 copy (half the bytes per decode step, as a bf16 vLLM rollout): the sampler's
    /// log-probs are then a little off the trained policy's; correct with
    /// `worker.actor.is_correction` (tis / icepop).
    Bf16,
}

impl From<WeightDtype> for crate::model::WeightDtype {
    fn from(d: WeightDtype) -> Self {
        match d {
            WeightDtype::F32 => Self::F32,
            WeightDtype::Bf16 => Self::Bf16,
        }
    }
}

impl WeightDtype {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        }
    }
}

/// The number format of the rollout's KV cache (`worker.rollout.kv_cache_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    /// The model's f32 keys and values (default).
    #[default]
    F32,
    /// Each key and value rounded to bf16 as it is cached (half the memory; the sampler's
    /// log-probs are then a little off the trained policy's, as with `weight_dtype: bf16`).
    Bf16,
}

impl From<KvCacheDtype> for crate::model::KvCacheDtype {
    fn from(d: KvCacheDtype) -> Self {
        match d {
            KvCacheDtype::F32 => Self::F32,
            KvCacheDtype::Bf16 => Self::Bf16,
        }
    }
}

impl KvCacheDtype {
    /// Bytes of one cached key or value element.
    pub const fn bytes(self) -> u64 {
        match self {
            KvCacheDtype::F32 => 4,
            KvCacheDtype::Bf16 => 2,
        }
    }
}

/// How AdamW stores its two moments (`worker.actor.optim.state_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateDtype {
    /// f32, as `torch.optim.AdamW` (8 bytes a parameter; default).
    #[default]
    F32,
    /// Rounded to bf16 stochastically after each update (4 bytes a parameter).
    Bf16,
    /// Block-wise 8-bit codes with a scale per 2 048 elements, bitsandbytes' 8-bit Adam
    /// scheme (≈ 2 bytes a parameter; tensors under 4 096 elements keep f32).
    Int8,
}

impl From<StateDtype> for crate::model::StateDtype {
    fn from(d: StateDtype) -> Self {
        match d {
            StateDtype::F32 => Self::F32,
            StateDtype::Bf16 => Self::Bf16,
            StateDtype::Int8 => Self::Int8,
        }
    }
}

/// Learning-rate schedule after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    /// `lr` throughout.
    Constant,
    /// Cosine decay from `lr` to `min_lr_ratio·lr` at the last step.
    Cosine,
}

impl LrScheduler {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            LrScheduler::Constant => "constant",
            LrScheduler::Cosine => "cosine",
        }
    }
}

/// AdamW and its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate, > 0 (default 1e−6).
    pub lr: f64,
    /// Adam β₁, β₂, each in `[0, 1)` (default `[0.9, 0.999]`).
    pub betas: [f64; 2],
    /// Adam ε, > 0 (default 1e−8).
    pub eps: f64,
    /// Decoupled weight decay, ≥ 0 (default 0.01).
    pub weight_decay: f64,
    /// Linear warm-up from 0 over this many optimiser steps (default null: from
    /// `lr_warmup_ratio`).
    pub lr_warmup_steps: Option<usize>,
    /// Warm-up as a fraction of the run's optimiser steps, in `[0, 1]`, used when
    /// `lr_warmup_steps` is null (default 0). EasyR1 counts training steps; the fraction of
    /// the run is the same.
    pub lr_warmup_ratio: f64,
    /// Schedule after the warm-up (default `constant`). (Older name: `lr_scheduler`; the
    /// ARES fork's: `warmup_style`.)
    pub lr_scheduler_type: LrScheduler,
    /// Final learning rate of the cosine schedule as a fraction of `lr`, in `[0, 1]`
    /// (default 0).
    pub min_lr_ratio: f64,
    /// How the moments are stored: `f32` (default), `bf16` or `int8` (the update is f32
    /// arithmetic in every case; the moments are rounded or quantised after it).
    pub state_dtype: StateDtype,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            lr_warmup_steps: None,
            lr_warmup_ratio: 0.0,
            lr_scheduler_type: LrScheduler::Constant,
            min_lr_ratio: 0.0,
            state_dtype: StateDtype::F32,
        }
    }
}

/// `worker.actor.model`: the weights that are trained (EasyR1's `ModelConfig`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Hugging Face model directory. `None` → the demo's tiny model. (ares's older name:
    /// `worker.actor.model_path`.)
    pub model_path: Option<String>,
    /// Directory of the tokenizer and chat template (`tokenizer.json`,
    /// `tokenizer_config.json`); `None` (default) → `model_path`.
    pub tokenizer_path: Option<String>,
    /// Vision-language models: keep the vision tower's weights fixed (no tower backward,
    /// no tower optimizer state). EasyR1's default, false, trains it. (Older name:
    /// `worker.actor.freeze_vision_tower`.)
    pub freeze_vision_tower: bool,
    /// Activation checkpointing per decoder layer and per vision block: keep each one's
    /// input and recompute the rest of its activations in the backward pass — the same
    /// gradients bit for bit, a fraction of the activation memory, one more forward pass of
    /// the layers and blocks per update (default false; EasyR1's default is true).
    pub enable_gradient_checkpointing: bool,
    /// LoRA: train low-rank pairs on the language model's linear layers, the base frozen
    /// (EasyR1's `worker.actor.model.lora`; off at rank 0, the default).
    pub lora: LoraSettings,
}

/// `worker.actor.model.lora`: LoRA pairs on linear layers, as PEFT puts them (`y = x·Wᵀ +
/// (α/r)·x·Aᵀ·Bᵀ`, `A` uniform on `±1/√in`, `B = 0`) and selects them (a name selects every
/// module whose path ends with it, the vision tower's included). The base weights are
/// frozen; the reference policy is the base (the adapters off), not a second copy;
/// checkpoints hold the adapter as PEFT files (`adapter/`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSettings {
    /// The rank `r`; 0 (default) turns LoRA off.
    pub rank: usize,
    /// `lora_alpha`, finite and > 0 (default 64, EasyR1's).
    pub alpha: f64,
    /// The adapted layers: `all-linear` (default: every linear layer but the LM head — the
    /// decoder's q/k/v/o and gate/up/down and, in a vision-language model, the tower's qkv,
    /// attn.proj, MLP and merger), one module name, or a list of them (a YAML list or one
    /// comma-separated string): the decoder's `q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`; the tower's `qkv`, `attn.proj`, `proj` (with the
    /// patch embedding), `fc1`, `fc2`, `mlp.0`, `mlp.2`.
    pub target_modules: LoraTargets,
    /// Modules left out (EasyR1's key): `null`, or a pattern naming the vision tower
    /// (`.*visual.*`): the language model's layers only.
    pub exclude_modules: Option<String>,
    /// Scale `α/√r` instead of `α/r` (rsLoRA; default false).
    pub use_rslora: bool,
    /// Start from this PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`,
    /// e.g. a LoRA cold start made with peft) instead of fresh pairs; `rank`, `alpha`,
    /// `target_modules` and `use_rslora` must say what its config says (the memory plan
    /// and the checks read them from here). Default none.
    pub adapter_path: Option<String>,
}

impl Default for LoraSettings {
    fn default() -> Self {
        Self {
            rank: 0,
            alpha: 64.0,
            target_modules: LoraTargets::One("all-linear".into()),
            exclude_modules: None,
            use_rslora: false,
            adapter_path: None,
        }
    }
}

/// `target_modules`: one name (or `all-linear`) or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LoraTargets {
    /// `all-linear` or one module name.
    One(String),
    /// Module names.
    Many(Vec<String>),
}

impl LoraSettings {
    /// The PEFT configuration of these settings (`None` at rank 0), or what is wrong with
    /// them as `(key suffix, value, expected)`.
    pub fn peft(&self) -> Result<Option<crate::hf::lora::LoraConfig>, (String, String, String)> {
        use crate::hf::lora::{TARGETS, is_tower_exclusion, target_names};
        if self.rank == 0 {
            if let Some(p) = &self.adapter_path {
                return Err((
                    "rank".into(),
                    "0".into(),
                    format!(
                        "the rank of the adapter in adapter_path ({p}), with its alpha and \
                         target_modules (LoRA is off at rank 0)"
                    ),
                ));
            }
            return Ok(None);
        }
        let bad = |k: &str, v: String, e: &str| Err((k.to_string(), v, e.to_string()));
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad("alpha", self.alpha.to_string(), "finite and > 0");
        }
        let names: Vec<String> = match &self.target_modules {
            LoraTargets::One(s) if s == "all-linear" => vec![s.clone()],
            // one name, or names written as one string (`q_proj, v_proj`, `[q_proj, v_proj]`)
            LoraTargets::One(s) => s
                .trim_matches(|c: char| c == '[' || c == ']' || c.is_whitespace())
                .split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
            LoraTargets::Many(v) => v.clone(),
        };
        let expected = format!(
            "all-linear or some of {}; a vision tower's qkv, attn.proj, proj, fc1, fc2, mlp.0, mlp.2",
            TARGETS.join(", ")
        );
        let target_modules = match target_names(&names) {
            Ok(t) => t,
            Err(n) => return bad("target_modules", n, &expected),
        };
        if let Some(x) = &self.exclude_modules
            && !is_tower_exclusion(x)
        {
            return bad(
                "exclude_modules",
                x.clone(),
                "null, or a pattern naming the vision tower (.*visual.*); to leave out \
                 language-model layers list the others in target_modules",
            );
        }
        Ok(Some(crate::hf::lora::LoraConfig {
            r: self.rank,
            lora_alpha: self.alpha,
            use_rslora: self.use_rslora,
            target_modules,
            layers_to_transform: None,
            exclude_modules: self.exclude_modules.clone(),
        }))
    }
}

/// The policy being trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActorConfig {
    /// The model.
    pub model: ModelConfig,
    /// Prompts per optimiser step (mini-batch), each with its `worker.rollout.n` responses,
    /// as EasyR1 counts them, ≥ 1 (default 8: 64 samples at n = 8). It may exceed
    /// `data.rollout_batch_size`: the trainer then takes the whole step as one mini-batch,
    /// so this is not an error.
    pub global_batch_size: usize,
    /// Samples per forward/backward of the update; gradients accumulate over
    /// `global_batch_size / micro_batch_size_per_device_for_update` micro-batches, ≥ 1
    /// (default 8). (Older name: `micro_batch_size_per_device`.)
    pub micro_batch_size_per_device_for_update: usize,
    /// Passes over a step's samples, ≥ 1 (default 1).
    pub ppo_epochs: usize,
    /// ε_low of the PPO clip `clamp(r, 1 − ε_low, 1 + ε_high)`, in `[0, 1]` (default 0.2).
    pub clip_ratio_low: f64,
    /// ε_high, ≥ 0 (default 0.3).
    pub clip_ratio_high: f64,
    /// Dual-clip bound c for negative advantages: 0 disables it, otherwise > 1 (default 3).
    /// Only `ppo` uses it.
    pub clip_ratio_dual: f64,
    /// The policy loss (default `ppo`). The clip ratios above apply to `ppo`, `gspo`,
    /// `gspo_token`, `cispo` and `clip_cov`.
    pub policy_loss: PolicyLoss,
    /// Clip-Cov: fraction of a micro-batch's tokens that may lose their gradient, in
    /// `(0, 1]` (default 0.0002).
    pub clip_cov_ratio: f64,
    /// Clip-Cov: lower covariance bound of the candidates (default 1).
    pub clip_cov_lb: f64,
    /// Clip-Cov: upper covariance bound, > `clip_cov_lb` (default 5).
    pub clip_cov_ub: f64,
    /// KL-Cov: fraction of a micro-batch's tokens penalised, in `(0, 1]` (default 0.0002).
    pub kl_cov_ratio: f64,
    /// KL-Cov: coefficient of `|log r|` on the selected tokens, ≥ 0 (default 1).
    pub ppo_kl_coef: f64,
    /// Loss aggregation (default `token-mean`; each mode also read with underscores,
    /// `token_mean`).
    pub loss_agg_mode: LossAggMode,
    /// Dynamic token-level KL (docs/algorithms.md §4): HWE tokens get `β·dynamic_kl_low_ratio`
    /// (default true).
    pub dynamic_kl_loss: bool,
    /// KL weight ratio of HWE tokens, in `[0, 1]` (default 0.5).
    pub dynamic_kl_low_ratio: f64,
    /// Gradient-norm clip, > 0 (default 1).
    pub max_grad_norm: f64,
    /// Lay a text model's scoring passes, update micro-batches and SFT chunks out back to
    /// back without padding (EasyR1's key, default true): the same numbers up to summation
    /// order, less work. Applies where the backend's attention takes packed sequences (the
    /// CPU); CUDA and vision-language models pad either way.
    pub padding_free: bool,
    /// Rollout/training importance correction (default `none`): `none`, `tis` (weights
    /// capped at `is_threshold_high`), `icepop` (tokens whose ratio leaves
    /// `[is_threshold_low, is_threshold_high]` are masked) or `reinforce_pro` (clamped to
    /// both thresholds).
    pub is_correction: IsMode,
    /// Lower ratio threshold, in `[0, 1]` (default 0.5).
    pub is_threshold_low: f64,
    /// Upper ratio threshold, ≥ 1 (default 5).
    pub is_threshold_high: f64,
    /// AdamW.
    pub optim: OptimConfig,
    /// Forking-token policy gradient (docs/algorithms.md §16.1): the policy gradient only on
    /// the batch's highest-entropy response tokens.
    pub forking_tokens: ForkingTokensConfig,
    /// Entropy bonus `−c·agg(H_t)` in the loss, fixed or held at a target entropy
    /// (docs/algorithms.md §16.2).
    pub entropy_bonus: EntropyBonusConfig,
}

/// `worker.actor.forking_tokens` ("Beyond the 80/20 rule", 2025).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ForkingTokensConfig {
    /// Keep the policy gradient only on the top-ρ tokens by entropy (default false).
    pub enable: bool,
    /// ρ, the kept fraction of the step's response tokens, in (0, 1] (default 0.2, the
    /// paper's). Ties at the threshold are broken by position (earlier rows and tokens
    /// first), so the kept count is exactly `⌈ρ·N⌉`.
    pub rho: f64,
}

impl Default for ForkingTokensConfig {
    fn default() -> Self {
        ForkingTokensConfig {
            enable: false,
            rho: ares_core::forking::DEFAULT_FORKING_RHO,
        }
    }
}

/// `worker.actor.entropy_bonus`: the loss gains `−coef·agg(H_t)` over the response tokens
/// (verl's `actor.entropy_coeff`); with `target` set, `coef` is the controller's starting
/// value and is moved each step by `lr·(target − H̄)`, clamped to `[min_coef, max_coef]`,
/// where H̄ is the step's mean token entropy (docs/algorithms.md §16.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EntropyBonusConfig {
    /// The coefficient c, ≥ 0 (default 0: no bonus unless `target` is set).
    pub coef: f64,
    /// Target mean token entropy in nats, ≥ 0 (default null: a fixed coefficient).
    pub target: Option<f64>,
    /// Controller step: coefficient change per nat of entropy error per step, ≥ 0
    /// (default 0.001).
    pub lr: f64,
    /// Lower bound of the coefficient, ≥ 0 (default 0).
    pub min_coef: f64,
    /// Upper bound, ≥ `min_coef` (default 0.005, Skywork-OR1's).
    pub max_coef: f64,
}

impl Default for EntropyBonusConfig {
    fn default() -> Self {
        EntropyBonusConfig {
            coef: 0.0,
            target: None,
            lr: ares_core::entropy_bonus::DEFAULT_ENTROPY_COEFF_LR,
            min_coef: 0.0,
            max_coef: ares_core::entropy_bonus::DEFAULT_ENTROPY_COEFF_MAX,
        }
    }
}

impl EntropyBonusConfig {
    /// Whether the loss has an entropy term (a nonzero fixed coefficient, or a target).
    pub fn active(&self) -> bool {
        self.coef != 0.0 || self.target.is_some()
    }
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            model: ModelConfig::default(),
            global_batch_size: 8,
            micro_batch_size_per_device_for_update: 8,
            ppo_epochs: 1,
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.3,
            clip_ratio_dual: 3.0,
            policy_loss: PolicyLoss::Ppo,
            clip_cov_ratio: 2e-4,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 2e-4,
            ppo_kl_coef: 1.0,
            loss_agg_mode: LossAggMode::TokenMean,
            dynamic_kl_loss: true,
            dynamic_kl_low_ratio: 0.5,
            max_grad_norm: 1.0,
            padding_free: true,
            is_correction: IsMode::None,
            is_threshold_low: 0.5,
            is_threshold_high: 5.0,
            optim: OptimConfig::default(),
            forking_tokens: ForkingTokensConfig::default(),
            entropy_bonus: EntropyBonusConfig::default(),
        }
    }
}

/// Reveal schedule of the graded system prompt (docs/algorithms.md §9). Each schedule is a
/// pair of ares-core's rubric rules (a `RevealRule` and a `StepRule` with its parameters
/// from [`GradedPromptConfig`]), so the config keeps this flat choice of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RubricSchedule {
    /// Sample k of n sees the fraction `(n−1−k)/(n−1)` of the criteria.
    Linear,
    /// The first `full_reveal_count` samples see all criteria, the others none.
    Binary,
    /// Linear, times `(T−step)/(T−1)`.
    StepLinear,
    /// Linear, times `(1−x)^power` with `x = (step−1)/(T−1)`.
    StepPower,
    /// Linear, times `1/(1 + e^{(x−x0)·k})`.
    StepSigmoid,
}

impl RubricSchedule {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RubricSchedule::Linear => "linear",
            RubricSchedule::Binary => "binary",
            RubricSchedule::StepLinear => "step_linear",
            RubricSchedule::StepPower => "step_power",
            RubricSchedule::StepSigmoid => "step_sigmoid",
        }
    }
}

/// The graded system prompt (docs/algorithms.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GradedPromptConfig {
    /// Reveal schedule (default `linear`).
    pub schedule: RubricSchedule,
    /// Samples that see every criterion under `binary` (default 1).
    pub full_reveal_count: usize,
    /// Exponent p of `step_power`, ≥ 0 (default 2).
    pub power: f64,
    /// Midpoint x0 of `step_sigmoid`, in `[0, 1]` (default 0.3).
    pub x0: f64,
    /// Steepness k of `step_sigmoid`, ≥ 0 (default 10).
    pub k: f64,
    /// Add the instruction not to mention the criteria (default true).
    pub hide_criteria_instruction: bool,
    /// With no criterion shown, still send the intro line as a system message (default
    /// false: no system message).
    pub add_base_when_zero: bool,
    /// Train on the augmented prompt instead of the original one (default false).
    pub graded_prompt_in_training: bool,
}

impl Default for GradedPromptConfig {
    fn default() -> Self {
        GradedPromptConfig {
            schedule: RubricSchedule::Linear,
            full_reveal_count: 1,
            power: 2.0,
            x0: 0.3,
            k: 10.0,
            hide_criteria_instruction: true,
            add_base_when_zero: false,
            graded_prompt_in_training: false,
        }
    }
}

/// Sampling of the responses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Samples per prompt (the group size), ≥ 1; ≥ 2 for group estimators, online
    /// filtering and GRPO-λ (default 8).
    pub n: usize,
    /// Sampling temperature, > 0 (default 1).
    pub temperature: f64,
    /// Nucleus mass, in `(0, 1]` (default 1 = off).
    pub top_p: f64,
    /// Top-k cut; 0 = off (default 0).
    pub top_k: usize,
    /// Min-p cut: keep tokens at least `min_p` times as likely as the most likely, in
    /// `[0, 1]`; 0 = off (default 0; vLLM's and transformers' `min_p`).
    pub min_p: f64,
    /// Seed of the sampling and of the rubric subsets (default 1).
    pub seed: u64,
    /// Most images a prompt may hold; a row with more is an error naming it (vLLM's
    /// `limit_mm_per_prompt`, EasyR1's key); 0 = no limit (default 0).
    pub limit_images: usize,
    /// Window w of the window entropy `W_t` (docs/algorithms.md §1), ≥ 1 (default 4).
    pub window_size: usize,
    /// Validation's sampling (EasyR1's `val_override_config`): each key given replaces the
    /// rollout's; a key left out (null) is the rollout's (default: greedy, one sample).
    /// (Older names: `val_temperature`, `val_n`.)
    pub val_override_config: ValOverrideConfig,
    /// Graded system prompts at rollout time (docs/algorithms.md §9; default false). Active
    /// only while training with n > 1.
    pub enable_graded_system_prompt: bool,
    /// The graded system prompt's schedule and wording options.
    pub graded: GradedPromptConfig,
    /// Decode weights of rollout, bootstrap and validation generation: `f32` (default) or
    /// `bf16`.
    pub weight_dtype: WeightDtype,
    /// Pad decode passes to buckets of rows and, on CUDA, capture each bucket's pass as a
    /// graph and replay it (vLLM's CUDA graphs; the inverse of its `enforce_eager`). Same
    /// tokens. Default false until measured on a GPU; with `trainer.device: cpu` refused
    /// (the CPU replays nothing: the padding would only cost).
    pub cuda_graphs: bool,
    /// The KV cache of rollout, bootstrap and validation generation: `f32` (default) or
    /// `bf16` (half the cache's memory; vLLM's `kv_cache_dtype`) — the default on
    /// `trainer.device: cuda` when `trainer.precision` defaults to bf16 there.
    pub kv_cache_dtype: KvCacheDtype,
    /// Multi-turn rollout with tool calls (verl's `multi_turn` section).
    pub multi_turn: MultiTurnConfig,
}

/// `worker.rollout.multi_turn`: the training rollout as episodes — the model's tool calls
/// run, their results appended through the chat template, generation resumed. Only the
/// model's tokens are its actions (loss, entropy, HWE, KL, length); the response budget
/// `data.max_response_length` counts the model's and the tools' tokens together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiTurnConfig {
    /// Roll out episodes (default false: one turn).
    pub enable: bool,
    /// Model turns per episode at most, ≥ 1 (verl's key; default 4): a call in the last one
    /// is not run.
    pub max_assistant_turns: usize,
    /// Built-in tools the model may call (default `[calculator]`); shown to it unless
    /// `data.tools` lists others.
    pub tools: Vec<String>,
    /// Tools answered by programs (default none): each one's schema is its `name`'s entry
    /// of `data.tools`; the command reads one JSON line per call (`{"name", "arguments"}`)
    /// and answers `{"content": …}` or `{"error": …}`.
    pub tool_commands: Vec<ToolCommandConfig>,
    /// A program that answers each turn without tool calls as a user would (default none:
    /// such a turn is the answer). See `tools::interaction` for its JSON lines.
    pub interaction: Option<InteractionConfig>,
    /// Cost of a tool call, ≥ 0 (default 0): an episode's reward loses `call_cost` per
    /// call run, so a call pays only where it raises the expected reward by more.
    pub call_cost: f64,
}

/// `worker.rollout.multi_turn.interaction`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InteractionConfig {
    /// The command line, split as a shell would and run without one.
    pub command: String,
    /// Seconds a reply may take before the program is killed and the episode ends, > 0
    /// (default 30).
    #[serde(default = "default_tool_timeout")]
    pub timeout_s: f64,
    /// Copies of the program running at once at most, ≥ 1 (default 4).
    #[serde(default = "default_tool_concurrency")]
    pub max_concurrency: usize,
    /// Weight of an episode's interaction score (the sum of its turns' `reward`s) in its
    /// reward, added to the graded reward (default 1; 0: the scores are metrics only, as
    /// verl's `turn_scores`).
    #[serde(default = "default_interaction_weight")]
    pub reward_weight: f64,
}

fn default_interaction_weight() -> f64 {
    1.0
}

/// One entry of `worker.rollout.multi_turn.tool_commands`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCommandConfig {
    /// The tool's name (its schema's `function.name` in `data.tools`).
    pub name: String,
    /// The command line, split as a shell would and run without one.
    pub command: String,
    /// Seconds a call may take before the program is killed and the call fails (the model
    /// is told), > 0 (default 30).
    #[serde(default = "default_tool_timeout")]
    pub timeout_s: f64,
    /// Copies of the program running at once at most, ≥ 1 (default 4).
    #[serde(default = "default_tool_concurrency")]
    pub max_concurrency: usize,
}

fn default_tool_timeout() -> f64 {
    30.0
}

fn default_tool_concurrency() -> usize {
    4
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            enable: false,
            max_assistant_turns: 4,
            tools: vec!["calculator".into()],
            tool_commands: Vec::new(),
            interaction: None,
            call_cost: 0.0,
        }
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            n: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 1,
            limit_images: 0,
            window_size: 4,
            val_override_config: ValOverrideConfig::default(),
            enable_graded_system_prompt: false,
            graded: GradedPromptConfig::default(),
            weight_dtype: WeightDtype::F32,
            cuda_graphs: false,
            kv_cache_dtype: KvCacheDtype::F32,
            multi_turn: MultiTurnConfig::default(),
        }
    }
}

/// `worker.rollout.val_override_config`: validation's sampling settings; null = the
/// rollout's. As in EasyR1, a mapping given in a file replaces the whole default (a key it
/// leaves out is the rollout's, not greedy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValOverrideConfig {
    /// Temperature, ≥ 0; 0 = greedy (default 0).
    pub temperature: Option<f64>,
    /// Nucleus mass, in `(0, 1]` (default null: the rollout's).
    pub top_p: Option<f64>,
    /// Top-k cut; 0 = off (default null: the rollout's).
    pub top_k: Option<usize>,
    /// Min-p cut, in `[0, 1]`; 0 = off (default null: the rollout's).
    pub min_p: Option<f64>,
    /// Samples per prompt, ≥ 1 (default 1).
    pub n: Option<usize>,
}

impl Default for ValOverrideConfig {
    fn default() -> Self {
        ValOverrideConfig {
            temperature: Some(0.0),
            top_p: None,
            top_k: None,
            min_p: None,
            n: Some(1),
        }
    }
}

impl RolloutConfig {
    /// Validation's temperature (0 = greedy).
    pub fn val_temperature(&self) -> f64 {
        self.val_override_config
            .temperature
            .unwrap_or(self.temperature)
    }

    /// Validation's nucleus mass.
    pub fn val_top_p(&self) -> f64 {
        self.val_override_config.top_p.unwrap_or(self.top_p)
    }

    /// Validation's top-k (0 = off).
    pub fn val_top_k(&self) -> usize {
        self.val_override_config.top_k.unwrap_or(self.top_k)
    }

    /// Validation's min-p (0 = off).
    pub fn val_min_p(&self) -> f64 {
        self.val_override_config.min_p.unwrap_or(self.min_p)
    }

    /// Validation's samples per prompt, ≥ 1 (EasyR1 validates one sample unless `n` is
    /// given).
    pub fn val_n(&self) -> usize {
        self.val_override_config.n.unwrap_or(1).max(1)
    }
}

/// The frozen reference policy of the KL term.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RefConfig {
    /// Hugging Face model directory. `None` → the actor's initial weights.
    pub model_path: Option<String>,
}

/// What the built-in reward grades.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardGrader {
    /// Math answers: the last `\boxed{…}` against the reference (docs/algorithms.md §10).
    Math,
    /// Rubric criteria: Σ points of met criteria / Σ positive points (docs/algorithms.md §9).
    Rubric,
}

impl RewardGrader {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RewardGrader::Math => "math",
            RewardGrader::Rubric => "rubric",
        }
    }
}

/// How a Python reward function is called (EasyR1's `reward_type`, the ARES fork's key;
/// EasyR1 itself reads the module's `REWARD_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardType {
    /// Once per batch with the list of every response's inputs; returns a list of dicts.
    Batch,
    /// Once per response with its inputs; returns a dict.
    Sequential,
}

impl RewardType {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RewardType::Batch => "batch",
            RewardType::Sequential => "sequential",
        }
    }
}

/// Who judges rubric criteria.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RubricGrader {
    /// Built-in keyword/regex matchers of the criteria.
    Builtin,
    /// An external command speaking JSON lines over stdin/stdout (`rubric_command`).
    Command,
}

impl RubricGrader {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RubricGrader::Builtin => "builtin",
            RubricGrader::Command => "command",
        }
    }
}

/// The reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// What the built-in reward grades (default `math`), when no `reward_function` is set.
    /// (Older name: `reward_type: math | rubric`.)
    pub grader: RewardGrader,
    /// A Python reward function in EasyR1's interface, `path.py:name` (`path.py` alone
    /// calls `main`); relative paths are from the working directory. Its dicts' `overall`
    /// is the whole reward and every other key a metric (`reward_function/<key>`); the
    /// built-in grader still decides correctness (difficulty buckets, the `accuracy`
    /// filter, validation), and with `algorithm.entropy_reward.enable` the ARES controllers
    /// run and pass their values (`difficulty`, `target_high_entropy_token_num`,
    /// `alpha_entropy`) to the function, which does the shaping (default null: the built-in
    /// reward).
    pub reward_function: Option<String>,
    /// Keyword arguments passed to the reward function (default null: none).
    pub reward_function_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// `batch` or `sequential` calls; null (default) → the module's `REWARD_TYPE`, else
    /// `batch`.
    pub reward_type: Option<RewardType>,
    /// The Python interpreter of the reward worker (default null: `python3` on `PATH`).
    pub python: Option<String>,
    /// Longest a call of the Python reward function (a batch) or of the rubric grader
    /// command (a response) may take, in seconds, > 0 (default 600); the helper is killed
    /// and the run stops with an error naming the call when it is exceeded.
    pub timeout_s: f64,
    /// Weight of the format reward in the total, ≥ 0; 0 = reported only (default 0).
    pub format_weight: f64,
    /// Rubric grader (default `builtin`).
    pub rubric_grader: RubricGrader,
    /// The grader command line; required when `rubric_grader` is `command`.
    pub rubric_command: Option<String>,
    /// DAPO's soft overlong penalty (docs/algorithms.md §16.3).
    pub overlong_buffer: OverlongBufferConfig,
}

/// `worker.reward.overlong_buffer`: DAPO's soft overlong penalty, a linear penalty over the
/// last `len` tokens before `data.max_response_length` (verl's `reward_model.overlong_buffer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlongBufferConfig {
    /// Apply the penalty (default false).
    pub enable: bool,
    /// `L_cache`: tokens of the penalty zone, in `[1, data.max_response_length]` (default 64).
    pub len: usize,
    /// The penalty at the length limit, ≥ 0 (default 1, DAPO's).
    pub penalty_factor: f64,
    /// Penalise only correct responses (default false: every response, as DAPO).
    pub only_correct: bool,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        OverlongBufferConfig {
            enable: false,
            len: 64,
            penalty_factor: 1.0,
            only_correct: false,
        }
    }
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            grader: RewardGrader::Math,
            reward_function: None,
            reward_function_kwargs: None,
            reward_type: None,
            python: None,
            timeout_s: 600.0,
            format_weight: 0.0,
            rubric_grader: RubricGrader::Builtin,
            rubric_command: None,
            overlong_buffer: OverlongBufferConfig::default(),
        }
    }
}

/// The worker section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// The policy.
    pub actor: ActorConfig,
    /// Sampling.
    pub rollout: RolloutConfig,
    /// The reference model (YAML key `ref`).
    #[serde(rename = "ref")]
    pub ref_: RefConfig,
    /// The reward.
    pub reward: RewardConfig,
}
