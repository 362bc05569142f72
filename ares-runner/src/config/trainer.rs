//! `trainer.*` (run bookkeeping: output, checkpoints, validation, device) and `sft.*` (the
//! supervised cold start).

use serde::{Deserialize, Serialize};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (the trainer errors when no GPU is usable).
    Cuda,
    /// CUDA when a GPU is usable, else the CPU.
    Auto,
}

impl Device {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Auto => "auto",
        }
    }
}

/// How the ranks of a data-parallel run add their gradients (`trainer.gradient_sum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradientSum {
    /// Each micro-batch's gradient is a slice, the slices added in micro-batch order on
    /// every rank: the same bits at any world size; every rank receives every slice.
    Slices,
    /// Each rank adds its micro-batches inside its backward GEMMs and the ranks' sums are
    /// added in rank order: one gradient exchanged a rank, a world of one equal to a run
    /// without ranks, other worlds equal to it to rounding (what an all-reduce does).
    Ranks,
}

/// Precision of the saved weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SaveDtypeCfg {
    /// 32-bit floats.
    F32,
    /// bfloat16 (half the size; what Hub checkpoints usually hold).
    Bf16,
}

impl SaveDtypeCfg {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            SaveDtypeCfg::F32 => "f32",
            SaveDtypeCfg::Bf16 => "bf16",
        }
    }
}

/// How the linear layers multiply (`ares_cpu::ops::precision::MatmulPrecision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MatmulPrecisionCfg {
    /// Exact f32 products.
    F32,
    /// Operands rounded to TF32 (GPU tensor cores; emulated on the CPU).
    Tf32,
    /// Operands rounded to bf16 in products of ≥ 64 tokens (GPU tensor cores; emulated on
    /// the CPU).
    Bf16,
}

impl MatmulPrecisionCfg {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        self.precision().name()
    }

    /// The runtime setting.
    pub const fn precision(self) -> crate::backend::MatmulPrecision {
        use crate::backend::MatmulPrecision as P;
        match self {
            MatmulPrecisionCfg::F32 => P::F32,
            MatmulPrecisionCfg::Tf32 => P::Tf32,
            MatmulPrecisionCfg::Bf16 => P::Bf16,
        }
    }
}

/// How the decoder's linear weights are stored (`ares_model::model::WeightStorage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightDtypeCfg {
    /// f32 (the optimizer's master), bf16 copies beside them where bf16 products pay.
    F32,
    /// bf16 only, updated with stochastic rounding: half the weights' memory.
    Bf16,
}

impl WeightDtypeCfg {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        self.storage().name()
    }

    /// The runtime setting.
    pub const fn storage(self) -> crate::model::WeightStorage {
        match self {
            WeightDtypeCfg::F32 => crate::model::WeightStorage::F32,
            WeightDtypeCfg::Bf16 => crate::model::WeightStorage::Bf16,
        }
    }
}

/// How the decoder's linear weight gradients (`trainer.grad_dtype`,
/// `ares_model::model::GradDtype`) or the MLP block's activations (`trainer.activation_dtype`,
/// `ares_model::model::ActivationDtype`) are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageDtypeCfg {
    /// f32.
    F32,
    /// bf16: half the memory.
    Bf16,
}

impl StorageDtypeCfg {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        self.dtype().name()
    }

    /// The runtime setting of the gradients.
    pub const fn dtype(self) -> crate::model::GradDtype {
        match self {
            StorageDtypeCfg::F32 => crate::model::GradDtype::F32,
            StorageDtypeCfg::Bf16 => crate::model::GradDtype::Bf16,
        }
    }

    /// The runtime setting of the activations.
    pub const fn activations(self) -> crate::model::ActivationDtype {
        match self {
            StorageDtypeCfg::F32 => crate::model::ActivationDtype::F32,
            StorageDtypeCfg::Bf16 => crate::model::ActivationDtype::Bf16,
        }
    }
}

impl TrainerConfig {
    /// How the gradients are stored on each rank: `grad_dtype` when given, else bf16 with
    /// the weight matrices stored in bf16 (`weight_dtype: bf16`, which `precision: bf16`
    /// sets) and f32 otherwise.
    pub fn grad_dtype(&self) -> crate::model::GradDtype {
        match (self.grad_dtype, self.weight_dtype) {
            (Some(g), _) => g.dtype(),
            (None, WeightDtypeCfg::Bf16) => crate::model::GradDtype::Bf16,
            (None, WeightDtypeCfg::F32) => crate::model::GradDtype::F32,
        }
    }

    /// Sets `matmul_precision` and `weight_dtype` from `precision` when it is given.
    ///
    /// # Errors
    /// [`ConfigError::Inconsistent`](super::ConfigError::Inconsistent): a finer key set to
    /// another value than `precision` implies (its default, f32, always gives way).
    pub(crate) fn apply_precision(&mut self) -> Result<(), super::ConfigError> {
        let Some(p) = self.precision else {
            return Ok(());
        };
        let weights = match p {
            MatmulPrecisionCfg::Bf16 => WeightDtypeCfg::Bf16,
            MatmulPrecisionCfg::F32 | MatmulPrecisionCfg::Tf32 => WeightDtypeCfg::F32,
        };
        let clash = |key: &str, value: &str, implied: &str| super::ConfigError::Inconsistent {
            key: key.into(),
            value: value.into(),
            reason: format!(
                "trainer.precision: {} implies {key}: {implied}; drop one of them",
                p.name()
            ),
        };
        if ![MatmulPrecisionCfg::F32, p].contains(&self.matmul_precision) {
            let m = self.matmul_precision.name();
            return Err(clash("trainer.matmul_precision", m, p.name()));
        }
        if ![WeightDtypeCfg::F32, weights].contains(&self.weight_dtype) {
            let w = self.weight_dtype.name();
            return Err(clash("trainer.weight_dtype", w, weights.name()));
        }
        self.matmul_precision = p;
        self.weight_dtype = weights;
        Ok(())
    }
}

/// An experiment logger (EasyR1's `trainer.logger` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Logger {
    /// A line per step on stderr.
    Console,
    /// `metrics.jsonl` in the run directory (written whatever the list says: resume and
    /// `ares-runner plot` read it).
    File,
    /// Weights & Biases, through the `wandb` package (`WANDB_MODE=offline` works offline).
    Wandb,
    /// TensorBoard event files, through `torch.utils.tensorboard` or `tensorboardX`, under
    /// `$TENSORBOARD_DIR` else `<run dir>/tensorboard`.
    Tensorboard,
    /// SwanLab, through the `swanlab` package (`SWANLAB_MODE=local` works offline).
    Swanlab,
    /// MLflow, through the `mlflow` package (`MLFLOW_TRACKING_URI`, else `./mlruns`).
    Mlflow,
}

impl Logger {
    /// The YAML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Logger::Console => "console",
            Logger::File => "file",
            Logger::Wandb => "wandb",
            Logger::Tensorboard => "tensorboard",
            Logger::Swanlab => "swanlab",
            Logger::Mlflow => "mlflow",
        }
    }

    /// Whether the logger runs in the Python worker.
    pub const fn is_python(self) -> bool {
        !matches!(self, Logger::Console | Logger::File)
    }
}

/// The trainer section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// Project name, non-empty (default `ares`).
    pub project_name: String,
    /// Run name, non-empty, without path separators (default `demo`).
    pub experiment_name: String,
    /// The run directory: checkpoints (`checkpoints/step_*`), `metrics.jsonl`, the resolved
    /// `config.yaml`. `None` → `runs/<experiment_name>` (EasyR1's default is
    /// `checkpoints/<project>/<experiment>`). (Older name: `output_dir`.)
    pub save_checkpoint_path: Option<String>,
    /// Resume from this checkpoint directory (a `step_*` directory of an earlier run)
    /// instead of the newest one in the run directory (default null).
    pub load_checkpoint_path: Option<String>,
    /// Passes over the training set, ≥ 1 (default 1).
    pub total_epochs: usize,
    /// Stop after this many steps, ≥ 1 when set (default none: `total_epochs` decides).
    pub max_steps: Option<usize>,
    /// Most generation rounds per step while `algorithm.online_filtering` keeps too few
    /// groups; ≤ 0 = unlimited (default 20). (Older name: `algorithm.max_try_make_batch`.)
    pub max_try_make_batch: i64,
    /// Save every this many steps; 0 = only at the end (default 0).
    pub save_freq: usize,
    /// Checkpoints kept (the newest); 0 = all (EasyR1's -1 is read as 0) (default 2).
    pub save_limit: usize,
    /// Precision of the saved weights (default `f32`).
    pub save_dtype: SaveDtypeCfg,
    /// Continue from the newest checkpoint in the run directory (default false: a run
    /// directory that holds a checkpoint is an error, so nothing is overwritten by
    /// accident; EasyR1's default is true). (Older name: `resume`.)
    pub find_last_checkpoint: bool,
    /// Checkpoints hold the model only, no optimizer or trainer state, so they cannot be
    /// resumed from (default false).
    pub save_model_only: bool,
    /// Validate every this many steps; 0 = only before and after training as configured
    /// (default 0).
    pub val_freq: usize,
    /// Validate before the first step (default true).
    pub val_before_train: bool,
    /// Only validate (before training, so `val_before_train` must be on) and stop (default
    /// false).
    pub val_only: bool,
    /// Experiment loggers (default `[console, file]`); wandb, tensorboard, swanlab and
    /// mlflow run in the Python worker (`worker.reward.python`) through their own packages.
    pub logger: Vec<Logger>,
    /// Resume this wandb run id (the ARES fork's key; default null: a new run).
    pub wandb_run_id: Option<String>,
    /// Validation generations sent to the loggers after each validation, a seeded sample
    /// as EasyR1 picks them (default 0).
    pub val_generations_to_log: usize,
    /// Backend (default `cpu`).
    pub device: Device,
    /// How the linear layers and the LM head multiply: `f32` (exact, default; on
    /// `device: cuda`, `precision` below makes it bf16 unless a precision key is given),
    /// `tf32` or `bf16` (operands rounded, f32 sums; weights, activations and optimizer
    /// state stay f32). In bf16, training attention at head_dim 64, 80 or 128 runs on tensor cores
    /// too. The speed-up is the GPU's; the CPU emulates the rounding, slightly slower.
    pub matmul_precision: MatmulPrecisionCfg,
    /// How the weight matrices — the decoder's linear layers (q, k, v, o, gate, up, down),
    /// the embedding and the LM head, a vision tower's linear layers — are stored, in the
    /// actor and the reference policy:
    /// `f32` (default) or `bf16` — half their memory, no f32 master: every product of those
    /// layers and of the head in bf16 (needs `matmul_precision: bf16`), the embedding's rows
    /// gathered from bf16, and each optimizer update rounded to bf16 stochastically (seeded
    /// by `seed`), so an update smaller than half a bf16 ulp moves a weight with the
    /// probability that keeps it unbiased. Norms and biases stay f32.
    pub weight_dtype: WeightDtypeCfg,
    /// How the decoder's linear weight gradients (q, k, v, o, gate, up, down: nearly all
    /// of them) are stored: `f32`, or `bf16` — half their memory, each layer's gradient
    /// written in f32 and added into the bf16 one with stochastic rounding (seeded by
    /// `seed`), so an accumulation over micro-batches stays unbiased; the embedding's,
    /// head's, norms', biases', a vision tower's and LoRA pairs' gradients stay f32.
    /// Default null: `bf16` with `weight_dtype: bf16` (and so under `precision: bf16`,
    /// CUDA's default), `f32` otherwise. In a data-parallel run each micro-batch's rounding
    /// is keyed by the micro-batch, and the ranks' sum is made in f32 and rounded once to
    /// nearest (through the host), or by NCCL in bf16 (`gradient_sum: ranks` on GPUs).
    pub grad_dtype: Option<StorageDtypeCfg>,
    /// How the activations the actor's training passes save in its MLP blocks (the
    /// post-attention norm's output, gate, up and their SwiGLU: most of a layer's) are
    /// stored: `f32`, or `bf16` — half their memory, each rounded once to nearest where it
    /// is written, the MLP's products reading and writing them as they are (on a GPU no
    /// conversion per product). Where the attention runs on the tensor cores (a head size
    /// of 64, 80 or 128) the attention block's input-norm output, q, k and v follow (the
    /// norm's output f32 under a LoRA pair on q, k or v), the same numbers bit for bit, and
    /// the attention's output (rounded as the output projection rounds it; f32 under a
    /// LoRA pair on o); the residual stream and the gradients stay f32. A vision tower's
    /// blocks follow where they can (weights stored in bf16, no LoRA pairs on the tower:
    /// the MLP block's for Qwen2.5-VL, the attention block's at ≥ 64 patches).
    /// Needs `matmul_precision: bf16`; not with a LoRA pair on gate/up/down. Default null:
    /// `bf16` with `weight_dtype: bf16` (and so under `precision: bf16`, CUDA's default)
    /// unless LoRA adapts the MLP, `f32` otherwise.
    pub activation_dtype: Option<StorageDtypeCfg>,
    /// The two settings above at once: `f32` (exact products, f32 weights), `tf32` (TF32
    /// products, f32 weights) or `bf16` (bf16 products and weight matrices stored in bf16).
    /// Default null — each its own — but `bf16` on `device: cuda` (and on `auto` where a
    /// GPU is found when the config is read) when none of `precision`,
    /// `matmul_precision` and `weight_dtype` is given (in the file or as an override; the
    /// resolved config records it), with `worker.rollout.kv_cache_dtype: bf16` unless that
    /// is given. Set with a finer key that says otherwise, an error.
    pub precision: Option<MatmulPrecisionCfg>,
    /// Seed of everything not seeded elsewhere (default 1).
    pub seed: u64,
    /// CPU threads; 0 = all cores (default 0).
    pub threads: usize,
    /// Data parallelism's optimizer sharding (a run launched on several ranks): 0 = every
    /// rank holds every optimizer moment, 1 = ZeRO-1, each rank the moments of its share
    /// of the weights, which it updates and sends to the others (default 0).
    pub zero_stage: u8,
    /// How the ranks add their gradients: `slices` (the same bits at any world size) or
    /// `ranks` (one gradient exchanged a rank; equal to rounding) (default `slices`).
    pub gradient_sum: GradientSum,
    /// With `gradient_sum: ranks`: start each decoder layer's sum over the ranks as soon as
    /// the backward has finished it, while the layers below are differentiated (through
    /// the host the same bits as summing after the backward). Default null: on where the
    /// sums run on the GPU (NCCL), off through the host (threads, TCP), where summing
    /// competes with the backward for the CPU.
    pub overlap_gradient_sum: Option<bool>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            project_name: "ares".into(),
            experiment_name: "demo".into(),
            save_checkpoint_path: None,
            load_checkpoint_path: None,
            total_epochs: 1,
            max_steps: None,
            max_try_make_batch: 20,
            save_freq: 0,
            save_limit: 2,
            save_dtype: SaveDtypeCfg::F32,
            find_last_checkpoint: false,
            save_model_only: false,
            val_freq: 0,
            val_before_train: true,
            val_only: false,
            logger: vec![Logger::Console, Logger::File],
            wandb_run_id: None,
            val_generations_to_log: 0,
            device: Device::Cpu,
            matmul_precision: MatmulPrecisionCfg::F32,
            weight_dtype: WeightDtypeCfg::F32,
            grad_dtype: None,
            activation_dtype: None,
            precision: None,
            seed: 1,
            threads: 0,
            zero_stage: 0,
            gradient_sum: GradientSum::Slices,
            overlap_gradient_sum: None,
        }
    }
}

/// Supervised fine-tuning on prompt/response pairs (the ARES cold-start stage).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Run the SFT stage (default false).
    pub enable: bool,
    /// Prompt/response data (JSONL or Parquet). `None` → the demo's worked solutions.
    pub train_files: Option<String>,
    /// Column of the target response, non-empty (default `response`).
    pub response_key: String,
    /// Passes over the data, ≥ 1 (default 1).
    pub epochs: usize,
    /// Learning rate, > 0 (default 1e−4).
    pub lr: f64,
    /// Sequences per optimiser step, ≥ 1 (default 16).
    pub batch_size: usize,
    /// Longest prompt + response in tokens, ≥ 1 (default 1024).
    pub max_length: usize,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            enable: false,
            train_files: None,
            response_key: "response".into(),
            epochs: 1,
            lr: 1e-4,
            batch_size: 16,
            max_length: 1024,
        }
    }
}
