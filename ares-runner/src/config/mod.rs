//! The trainer's configuration: YAML with verl/EasyR1-style sections (`data`, `algorithm`,
//! `worker.{actor,rollout,ref,reward}`, `trainer`, `sft`) covering every knob of
//! `docs/algorithms.md` with its defaults, plus dotted command-line overrides.
//!
//! Resolution ([`Config::load`]):
//! 1. the defaults ([`Config::default`], the spec's values) as a tree;
//! 2. the YAML file, if any, merged onto it key by key (a key the defaults do not have is an
//!    error naming the full dotted key and the valid keys of its section);
//! 3. each override `dotted.key=value` in order (`worker.rollout.n=8`,
//!    `algorithm.adv_estimator=grpo`, `worker.actor.optim.betas=[0.9,0.99]`,
//!    `data.train_files=null`), with the same key checks;
//! 4. typed deserialization of the resolved tree — a wrong type or an unknown enum value
//!    names the dotted key and where the value came from;
//! 5. [`Config::validate`]: ranges and cross-checks.
//!
//! ```
//! use ares_runner::config::{AdvEstimator, Config};
//!
//! let cfg = Config::load(None, &["worker.rollout.n=4".into(), "algorithm.adv_estimator=rloo".into()])?;
//! assert_eq!(cfg.worker.rollout.n, 4);
//! assert_eq!(cfg.algorithm.adv_estimator, AdvEstimator::Rloo);
//! assert_eq!(Config::from_yaml_str(&cfg.to_yaml(), "resolved")?, cfg);
//! # Ok::<(), ares_runner::config::ConfigError>(())
//! ```

mod algorithm;
mod choices;
mod data;
mod easyr1;
mod error;
mod trainer;
mod tree;
mod validate;
mod worker;

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use algorithm::{
    AdvEstimator, AlgorithmConfig, DropSolvedConfig, DualAscentConfig, ESTIMATORS,
    EntropyRewardConfig, GrpoLambdaConfig, KlCtrl,
};
// ares-core's types that the config reads as they are (its `serde` feature).
pub use ares_core::difficulty::{AccuracyThresholds, PerBucket};
pub use ares_core::kl::KlEstimator;
pub use ares_core::loss::{IsMode, LossAggMode};
pub use choices::Choice;
pub use data::DataConfig;
pub use easyr1::{ConfigNote, NoteAction, notes_table};
pub use error::ConfigError;
pub use trainer::{
    Device, GradientSum, Logger, MatmulPrecisionCfg, SaveDtypeCfg, SftConfig, StorageDtypeCfg,
    TrainerConfig, WeightDtypeCfg,
};
pub use worker::{
    ActorConfig, EntropyBonusConfig, ForkingTokensConfig, GradedPromptConfig, KvCacheDtype,
    LoraSettings, LoraTargets, LrScheduler, ModelConfig, MultiTurnConfig, OptimConfig,
    POLICY_LOSSES, PolicyLoss, RefConfig, RewardConfig, RewardGrader, RewardType, RolloutConfig,
    RubricGrader, RubricSchedule, StateDtype, ToolCommandConfig, ValOverrideConfig, WeightDtype,
    WorkerConfig,
};

use tree::Override;

/// The whole configuration of a run. `Default` is the spec's defaults, which train the
/// built-in demo.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The dataset.
    pub data: DataConfig,
    /// Advantages, KL, filtering, entropy shaping, GRPO-λ.
    pub algorithm: AlgorithmConfig,
    /// Actor, rollout, reference and reward.
    pub worker: WorkerConfig,
    /// Output, checkpoints, validation, device.
    pub trainer: TrainerConfig,
    /// Supervised cold start.
    pub sft: SftConfig,
}

impl Config {
    /// How the actor's training passes store the MLP block's activations:
    /// `trainer.activation_dtype` when given, else bf16 with the weight matrices stored in
    /// bf16 (`trainer.weight_dtype: bf16`, which `precision: bf16` sets) unless LoRA adapts
    /// the MLP, and f32 otherwise.
    pub fn activation_dtype(&self) -> crate::model::ActivationDtype {
        use crate::model::ActivationDtype;
        match (self.trainer.activation_dtype, self.trainer.weight_dtype) {
            (Some(a), _) => a.activations(),
            (None, WeightDtypeCfg::Bf16) if !self.lora_adapts_mlp() => ActivationDtype::Bf16,
            (None, _) => ActivationDtype::F32,
        }
    }

    /// Whether `worker.actor.model.lora` puts pairs on the MLP (gate, up or down), whose
    /// LoRA products read f32 activations.
    pub(crate) fn lora_adapts_mlp(&self) -> bool {
        self.lora_adapts(&["gate_proj", "up_proj", "down_proj"])
    }

    /// Whether the actor's LoRA pairs adapt q, k or v (they read the input norm's output
    /// in f32, so it stays f32 under `activation_dtype: bf16`).
    pub(crate) fn lora_adapts_qkv(&self) -> bool {
        self.lora_adapts(&["q_proj", "k_proj", "v_proj"])
    }

    /// Whether the actor's LoRA pairs adapt o (they read the attention's output in f32).
    pub(crate) fn lora_adapts_o(&self) -> bool {
        self.lora_adapts(&["o_proj"])
    }

    /// Whether the actor's LoRA pairs adapt one of `modules`.
    fn lora_adapts(&self, modules: &[&str]) -> bool {
        match self.worker.actor.model.lora.peft() {
            Ok(Some(c)) => modules.iter().any(|m| c.adapts_module(m)),
            _ => false,
        }
    }

    /// The configuration in YAML `text` (named `source_name` in messages) over the defaults,
    /// validated.
    ///
    /// Errors: malformed YAML (with line and column), unknown keys, wrong types, values out
    /// of range — see [`ConfigError`].
    pub fn from_yaml_str(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        resolve(Some((text, source_name)), &[], &gpu_present).map(|(config, _)| config)
    }

    /// The configuration of a run: the defaults, then the YAML file at `path` if given, then
    /// the `overrides` (`dotted.key=value`) in order; validated.
    ///
    /// Errors: the file cannot be read ([`ConfigError::Io`]), and everything
    /// [`Config::from_yaml_str`] reports, for the file and the overrides alike.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        Self::load_with_notes(path, overrides).map(|(config, _)| config)
    }

    /// [`Config::load`], with a note for every EasyR1 key that was read under another name,
    /// mapped onto a setting of ours, or ignored as an engine knob (see the `easyr1` rules);
    /// `ares-runner` prints them at start.
    ///
    /// Errors: as [`Config::load`].
    pub fn load_with_notes(
        path: Option<&Path>,
        overrides: &[String],
    ) -> Result<(Config, Vec<ConfigNote>), ConfigError> {
        match path {
            None => resolve(None, overrides, &gpu_present),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                let name = path.display().to_string();
                resolve(Some((&text, &name)), overrides, &gpu_present)
            }
        }
    }

    /// The resolved configuration as YAML, every key written out; it loads back into an
    /// equal `Config`. (Serialising plain numbers, strings and enums cannot fail; should it
    /// ever, the text is a YAML comment saying why, which loads back as the defaults.)
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self)
            .unwrap_or_else(|e| format!("# the configuration could not be written: {e}\n"))
    }
}

/// Steps 1–5 of the module docs, with EasyR1's keys translated in steps 2 and 3.
/// Whether a CUDA driver sees a GPU — the first thing `trainer.device: auto` checks
/// (`false` in a build without the `cuda` feature).
pub fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::backend::cuda::device_count().is_some_and(|n| n > 0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The configuration of `file` and `overrides` over the defaults, validated; `gpu` says
/// whether `trainer.device: auto` finds a GPU (it is asked only then).
fn resolve(
    file: Option<(&str, &str)>,
    overrides: &[String],
    gpu: &dyn Fn() -> bool,
) -> Result<(Config, Vec<ConfigNote>), ConfigError> {
    let mut resolved = serde_json::to_value(Config::default())
        .map_err(|e| ConfigError::Internal(e.to_string()))?;
    let mut notes = Vec::new();
    let mut file_tree = None;
    if let Some((text, source_name)) = file {
        let mut parsed = tree::parse_yaml(text, source_name)?;
        easyr1::translate_tree(&mut parsed, &format!("in {source_name}"), &mut notes)?;
        tree::merge(
            &mut resolved,
            parsed.clone(),
            "",
            &format!("in {source_name}"),
        )?;
        file_tree = Some((parsed, source_name));
    }
    let mut translated = Vec::with_capacity(overrides.len());
    for text in overrides {
        if let Some(o) = easyr1::translate_override(Override::parse(text)?, &mut notes)? {
            translated.push(o);
        }
    }
    let overrides = translated;
    for o in &overrides {
        o.apply(&mut resolved)?;
    }
    let mut config: Config = serde_path_to_error::deserialize(resolved).map_err(|e| {
        let keys: Vec<String> = e
            .path()
            .iter()
            .map_while(|segment| match segment {
                serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                _ => None,
            })
            .collect();
        let origin = origin_of(&keys, &overrides, file_tree.as_ref());
        ConfigError::Type {
            key: e.path().to_string(),
            origin,
            message: e.into_inner().to_string(),
        }
    })?;
    // bf16 is CUDA's default: on `trainer.device: cuda` (or `auto` where a GPU is found)
    // with none of the precision keys given, `trainer.precision: bf16` and, unless it is
    // given, a bf16 KV cache (written out with the resolved config, so a resumed run reads
    // them back as given)
    let given = |key: &str| {
        let keys: Vec<String> = key.split('.').map(str::to_string).collect();
        origin_of(&keys, &overrides, file_tree.as_ref()) != DEFAULT_ORIGIN
    };
    let precision_keys = [
        "trainer.precision",
        "trainer.matmul_precision",
        "trainer.weight_dtype",
    ];
    let on_gpu = match config.trainer.device {
        Device::Cuda => true,
        Device::Auto => gpu(),
        Device::Cpu => false,
    };
    if on_gpu && !precision_keys.into_iter().any(given) {
        config.trainer.precision = Some(MatmulPrecisionCfg::Bf16);
        if !given("worker.rollout.kv_cache_dtype") {
            config.worker.rollout.kv_cache_dtype = KvCacheDtype::Bf16;
        }
    }
    config.trainer.apply_precision()?;
    config.validate()?;
    Ok((config, notes))
}

/// [`origin_of`] a value no file or override set.
const DEFAULT_ORIGIN: &str = "default";

/// Which source set the value at `keys`: the last override at or above it, else the file,
/// else the defaults.
fn origin_of(keys: &[String], overrides: &[Override], file: Option<&(Value, &str)>) -> String {
    if let Some(o) = overrides
        .iter()
        .rev()
        .find(|o| keys.starts_with(&o.segments))
    {
        return o.origin();
    }
    match file {
        Some((parsed, name)) if tree::contains(parsed, keys) => format!("in {name}"),
        _ => DEFAULT_ORIGIN.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `trainer.device: auto` takes CUDA's bf16 default where a GPU is found and keeps f32
    /// where none is; the probe is asked for `auto` only; a precision key given wins.
    #[test]
    fn auto_takes_cudas_default_where_a_gpu_is_found() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let auto = o(&["trainer.device=auto"]);
        let (found, _) = resolve(None, &auto, &|| true).unwrap();
        assert_eq!(found.trainer.precision, Some(MatmulPrecisionCfg::Bf16));
        assert_eq!(found.trainer.weight_dtype, WeightDtypeCfg::Bf16);
        assert_eq!(found.worker.rollout.kv_cache_dtype, KvCacheDtype::Bf16);
        let (none, _) = resolve(None, &auto, &|| false).unwrap();
        assert_eq!(none.trainer.precision, None);
        assert_eq!(none.trainer.weight_dtype, WeightDtypeCfg::F32);
        let cpu = o(&["trainer.device=cpu"]);
        let (cpu, _) = resolve(None, &cpu, &|| panic!("the CPU asks for no GPU")).unwrap();
        assert_eq!(cpu.trainer.precision, None);
        let exact = o(&["trainer.device=auto", "trainer.precision=f32"]);
        let (exact, _) = resolve(None, &exact, &|| true).unwrap();
        assert_eq!(exact.trainer.matmul_precision, MatmulPrecisionCfg::F32);
        // the resolved config records the choice: it loads back as itself without a GPU
        let again = resolve(Some((&found.to_yaml(), "resolved")), &[], &|| false).unwrap();
        assert_eq!(again.0, found);
    }
}
