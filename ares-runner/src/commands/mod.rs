//! The `ares-runner` subcommands as library functions (the binary only parses arguments):
//! [`train`] (with the built-in [`demo`] when no data is configured), [`eval`], [`sft`]
//! and [`generate`].

pub mod demo;
pub mod generate;
pub mod init;
pub mod merge;
mod sft;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::config::{Config, Device};
use crate::parallel::Ranks;
use crate::parallel::launch::{LaunchEnv, TcpRanks};
use crate::trainer::eval::format_table;
use crate::trainer::{TrainError, Trainer};

pub use sft::{SftOptions, SftReport, read_sft_pairs, run_sft, sft};

/// `ares-runner plan`: the memory plan of a run of `cfg` (its model's config files, and for
/// a vision-language model the sizes of the images of `data.train_files` when it is set;
/// nothing allocated), as a table, and whether it fits: `memory` bytes when given (a GPU's,
/// `plan --memory 80G`), else this machine's host memory for a CPU run.
///
/// # Errors
/// No model configured, unreadable model configs, an invalid config.
pub fn plan(cfg: &Config, memory: Option<u64>) -> Result<String, TrainError> {
    let path = cfg
        .worker
        .actor
        .model
        .model_path
        .as_deref()
        .ok_or_else(|| {
            TrainError::Invalid(
                "worker.actor.model.model_path is not set: the plan is made from the model's \
             config.json"
                    .into(),
            )
        })?;
    let model_dir = crate::data::resolve_model_dir(path).map_err(TrainError::Invalid)?;
    let reference = crate::trainer::setup::settings::step_settings(cfg, 1)?
        .kl
        .enabled;
    let on_cpu = cfg.trainer.device == Device::Cpu;
    // a vision-language model's tower scales with the data's images: read their sizes
    // when the data is named (as the trainer does at its start)
    let mut note = String::new();
    let vl = crate::vision::config::VlConfig::is_vl_dir(&model_dir);
    // one renderer (tokenizer and processor) for both files; its error, said per file
    let renderer =
        vl.then(|| crate::trainer::setup::renderer(cfg, &model_dir).map_err(|e| e.to_string()));
    let read = |files: Option<&str>, most: &dyn Fn(&_, Vec<_>) -> Result<usize, TrainError>| {
        let (Some(r), Some(files)) = (renderer.as_ref(), files) else {
            return Ok(None);
        };
        let r = r.as_ref().map_err(Clone::clone)?;
        let examples =
            crate::trainer::setup::load_examples(cfg, files).map_err(|e| e.to_string())?;
        most(r, examples).map(Some).map_err(|e| e.to_string())
    };
    let train = read(cfg.data.train_files.as_deref(), &|r, examples| {
        Ok(crate::trainer::setup::filter_prompts(cfg, r, examples)?.vision_tokens)
    });
    let vision_tokens = train.unwrap_or_else(|e| {
        note = format!("(the vision tower's activations: data.train_files: {e})\n");
        None
    });
    // the validation prompts bound the rollout's tower arena too (evaluation generates)
    let val = read(cfg.data.val_files.as_deref(), &|r, examples| {
        crate::trainer::setup::most_vision_tokens(r, &examples)
    });
    let eval_vision_tokens = val.map(Option::unwrap_or_default).unwrap_or_else(|e| {
        note.push_str(&format!(
            "(the vision tower's activations: data.val_files: {e}; not counted)\n"
        ));
        0
    });
    let plan = crate::trainer::run::memory_plan(
        cfg,
        &model_dir,
        on_cpu,
        reference,
        vision_tokens,
        eval_vision_tokens,
    )?;
    let mut out = plan.table();
    out.push_str(&note);
    let available = match (memory, on_cpu) {
        (Some(bytes), _) => Some((bytes, "given: --memory".to_string())),
        (None, true) => crate::host_memory::available_host_memory().map_err(TrainError::Invalid)?,
        (None, false) => None,
    };
    if let Some((available, source)) = available {
        match crate::trainer::setup::memory::check(&plan, available, &source, cfg) {
            Ok(crate::trainer::setup::memory::Fit::Whole) => out.push_str(&format!(
                "fits: {} available ({source})\n",
                crate::host_memory::human_bytes(available)
            )),
            Ok(crate::trainer::setup::memory::Fit::KvCapped { blocks, sequences }) => {
                out.push_str(&format!(
                    "fits with the rollout's KV cache capped at {blocks} blocks (about \
                     {sequences} sequences at their longest at once): {} available ({source})\n",
                    crate::host_memory::human_bytes(available)
                ));
            }
            Err(e) => out.push_str(&format!(
                "does not fit: {}\n",
                e.to_string().lines().next().unwrap_or_default()
            )),
        }
    }
    Ok(out)
}

/// The backend `trainer.device` selects.
#[derive(Debug, Clone)]
pub enum Selected {
    /// The CPU (ares-cpu ops, rayon threads).
    Cpu(CpuBackend),
    /// GPU 0.
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::CudaBackend),
}

/// Runs `$body` with `$b` bound to the selected backend, whatever its type (the trainer is
/// generic over the backend; this is the one place that picks it).
#[macro_export]
macro_rules! with_backend {
    ($selected:expr, $b:ident => $body:expr) => {
        match $selected {
            $crate::commands::Selected::Cpu($b) => $body,
            #[cfg(feature = "cuda")]
            $crate::commands::Selected::Cuda($b) => $body,
        }
    };
}

/// The backend of `trainer.device`: `cpu`; `cuda` (GPU 0; an error naming what is missing
/// when it cannot start); `auto` (CUDA when it starts, else the CPU, saying why).
/// `trainer.threads > 0` sizes the CPU thread pool.
///
/// `ARES_CPU_ISA` forces the CPU kernels' instruction-set path (`ares_cpu::isa`).
///
/// # Errors
/// `cuda` without a usable GPU, or in a build without the `cuda` feature; an `ARES_CPU_ISA`
/// that names no path or one this CPU lacks.
pub fn select_backend(cfg: &Config) -> Result<Selected, TrainError> {
    select_backend_at(cfg, None)
}

/// [`select_backend`] for one rank of a launched run: the GPU is `LOCAL_RANK`'s
/// (`launch.local_rank`), not the first.
///
/// # Errors
/// As [`select_backend`]; a local rank with no GPU of its index, naming the variable.
pub fn select_backend_at(
    cfg: &Config,
    launch: Option<&crate::parallel::launch::LaunchEnv>,
) -> Result<Selected, TrainError> {
    #[cfg(feature = "cuda")]
    let ordinal = launch.map_or(0, |l| l.local_rank);
    // a launched rank whose local rank names no GPU here: say what to change
    #[cfg(feature = "cuda")]
    if let (Some(l), Device::Cuda, Some(n)) = (launch, cfg.trainer.device, ares_cuda_count()) {
        l.check_device(n)
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
    }
    #[cfg(feature = "cuda")]
    let which = |e: &dyn std::fmt::Display| match launch {
        Some(l) => format!(
            "GPU {ordinal} (local rank {} of a {:?} launch; at most one rank per GPU of this \
             machine): {e}",
            l.local_rank, l.launcher
        ),
        None => e.to_string(),
    };
    #[cfg(not(feature = "cuda"))]
    let _ = launch;
    // the host's kernels run on every device (scoring, sampling, the CPU backend's ops): an
    // invalid ARES_CPU_ISA stops the run here rather than after a warning nobody reads
    let isa = ares_cpu::Isa::setting().map_err(|e| TrainError::Invalid(e.to_string()))?;
    if let Some(isa) = isa.filter(|&isa| isa != ares_cpu::Isa::detected()) {
        eprintln!(
            "CPU kernels on the {isa} path ({}; this CPU has {})",
            ares_cpu::isa::ENV,
            ares_cpu::Isa::detected()
        );
    }
    if cfg.trainer.threads > 0 {
        // the pool can be set once per process; a second call (tests, demo stages) keeps it
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.trainer.threads)
            .build_global();
    }
    match cfg.trainer.device {
        Device::Cpu => Ok(Selected::Cpu(CpuBackend)),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::backend::cuda::CudaBackend::new(ordinal)
            .map(Selected::Cuda)
            .map_err(|e| TrainError::Invalid(format!("trainer.device = cuda: {}", which(&e)))),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(TrainError::Invalid(
            "trainer.device = cuda: this ares-runner was built without the `cuda` feature".into(),
        )),
        #[cfg(feature = "cuda")]
        Device::Auto => match crate::backend::cuda::CudaBackend::new(ordinal) {
            Ok(b) => Ok(Selected::Cuda(b)),
            Err(e) => {
                eprintln!(
                    "trainer.device = auto: no usable GPU ({}); using the CPU",
                    which(&e)
                );
                Ok(Selected::Cpu(CpuBackend))
            }
        },
        #[cfg(not(feature = "cuda"))]
        Device::Auto => Ok(Selected::Cpu(CpuBackend)),
    }
}

/// The number of GPUs this process sees (`None`: no CUDA driver).
#[cfg(feature = "cuda")]
fn ares_cuda_count() -> Option<usize> {
    crate::backend::cuda::device_count()
}

/// The Ctrl-C flag: the first Ctrl-C sets it (the trainer finishes its step, saves and
/// stops); a second one exits at once with status 130.
///
/// # Errors
/// The signal handlers cannot be installed.
pub fn interrupt_flag() -> Result<Arc<AtomicBool>, TrainError> {
    let flag = Arc::new(AtomicBool::new(false));
    let io = |e: std::io::Error| TrainError::io("SIGINT handler", e);
    // order matters: the conditional exit sees the flag before the first press sets it
    signal_hook::flag::register_conditional_shutdown(
        signal_hook::consts::SIGINT,
        130,
        Arc::clone(&flag),
    )
    .map_err(io)?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&flag)).map_err(io)?;
    Ok(flag)
}

/// `ares-runner train`: RL training of `cfg`; with no `data.train_files`, the built-in demo.
///
/// # Errors
/// Any error of the run, naming what was wrong.
pub fn train(cfg: Config, overrides: &[String], from_file: bool) -> Result<(), TrainError> {
    // one rank of a run launched by torchrun or srun (None: a process alone)
    let launch = LaunchEnv::from_env().map_err(|e| TrainError::Invalid(e.to_string()))?;
    if cfg.data.train_files.is_none() && !from_file {
        if launch.as_ref().is_some_and(|l| l.world > 1) {
            return Err(TrainError::Invalid(
                "the built-in demo runs as one process; launch a config with data.train_files \
                 on several ranks (ares-runner train -c run.yaml)"
                    .into(),
            ));
        }
        return demo::run(overrides, demo::Demo::Text, None);
    }
    if cfg.trainer.zero_stage > 0 && launch.as_ref().is_none_or(|l| l.world == 1) {
        eprintln!(
            "note: trainer.zero_stage = {} shards optimizer states across ranks; this run has \
             one, so nothing is sharded",
            cfg.trainer.zero_stage
        );
    }
    let selected = select_backend_at(&cfg, launch.as_ref())?;
    let ranks = match &launch {
        None => None,
        Some(l) => {
            eprintln!(
                "rank {} of {} ({:?} launch, local rank {}){}",
                l.rank,
                l.world,
                l.launcher,
                l.local_rank,
                l.master
                    .as_ref()
                    .map_or(String::new(), |(a, p)| format!(": meeting at {a}:{p}"))
            );
            Some(Ranks::new(transport(l)?))
        }
    };
    crate::with_backend!(selected, b => train_on(cfg, b, ranks))
}

/// The ranks' transport that `ARES_TRANSPORT` names: `tcp` (the default) or `nccl` (GPUs;
/// the same bytes, so the same numbers).
///
/// # Errors
/// Another name; the transport's failure to connect.
fn transport(l: &LaunchEnv) -> Result<Arc<dyn crate::parallel::Collective>, TrainError> {
    let name = std::env::var("ARES_TRANSPORT").unwrap_or_default();
    match name.trim() {
        "" | "tcp" => Ok(Arc::new(TcpRanks::connect(l)?)),
        #[cfg(feature = "cuda")]
        "nccl" => Ok(Arc::new(crate::parallel::nccl::NcclRanks::connect(l)?)),
        other => Err(TrainError::Invalid(format!(
            "ARES_TRANSPORT={other:?}: the ranks' transport is tcp (the default) or nccl (GPUs; \
             this ares-runner needs its cuda feature and libnccl)"
        ))),
    }
}

/// Prints the backend's op times (`ARES_PROFILE=1`; [`Backend::op_profile`]) to stderr.
pub(crate) fn print_op_profile<B: Backend>(backend: &B) {
    match backend.op_profile() {
        Ok(Some(table)) => eprint!("{table}"),
        Ok(None) => {}
        Err(e) => eprintln!("warning: no op times: {e}"),
    }
}

/// [`train`] on a chosen backend, as one of `ranks` when launched.
fn train_on<B: Backend + Clone>(
    cfg: Config,
    backend: B,
    ranks: Option<Ranks>,
) -> Result<(), TrainError> {
    let interrupt = interrupt_flag()?;
    let probe = backend.clone();
    let mut trainer = Trainer::new(cfg, backend, interrupt)?;
    if let Some(r) = ranks {
        trainer.join(r)?;
    }
    let prints = trainer.writes_files();
    if trainer.cfg.trainer.val_before_train && !trainer.val.is_empty() {
        let val = trainer.val.clone();
        let report = trainer.evaluate(&val)?;
        if prints {
            eprintln!("validation before training:\n{}", format_table(&report));
        }
    }
    if trainer.cfg.trainer.val_only {
        if trainer.val.is_empty() {
            return Err(TrainError::Invalid(
                "trainer.val_only = true, but there is nothing to validate: set data.val_files"
                    .into(),
            ));
        }
        eprintln!("trainer.val_only: stopping after the validation");
        return Ok(());
    }
    let summary = trainer.run()?;
    if !prints {
        return Ok(());
    }
    print_op_profile(&probe);
    eprintln!(
        "{} after {} steps; metrics: {}; checkpoint: {}",
        if summary.interrupted {
            "stopped (Ctrl-C)"
        } else {
            "done"
        },
        summary.steps,
        summary.metrics.display(),
        summary
            .checkpoint
            .as_ref()
            .map_or("none".into(), |p| p.display().to_string())
    );
    Ok(())
}

/// `ares-runner eval`: accuracy and mean response length per difficulty of `model`
/// (default `worker.actor.model.model_path`) on `data` (default `data.val_files`, else
/// `data.train_files`), with the validation sampling of the config.
///
/// # Errors
/// Missing model or data, generation or grading errors.
pub fn eval(
    cfg: &Config,
    model: Option<&Path>,
    adapter: Option<&Path>,
    data: Option<&Path>,
) -> Result<(), TrainError> {
    let model_dir = match model {
        Some(m) => m.to_path_buf(),
        None => cfg
            .worker
            .actor
            .model
            .model_path
            .as_deref()
            .map(|m| crate::data::resolve_model_dir(m).map_err(TrainError::Invalid))
            .ok_or_else(|| {
                TrainError::Invalid(
                    "eval: give --model DIR or set worker.actor.model.model_path".into(),
                )
            })??,
    };
    let data = match data {
        Some(d) => d.to_string_lossy().into_owned(),
        None => cfg
            .data
            .val_files
            .clone()
            .or_else(|| cfg.data.train_files.clone())
            .ok_or_else(|| {
                TrainError::Invalid("eval: give --data FILE or set data.val_files".into())
            })?,
    };
    let report = crate::with_backend!(select_backend(cfg)?, b => demo::evaluate_model(cfg, b, &model_dir, adapter, &data))?;
    println!("{}", format_table(&report));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `plan --memory` checks a GPU run's plan against the size given: it fits a large
    /// one, and a small one is refused with what would shrink the run (bf16 gradients
    /// among them); without it a GPU plan says nothing of fitting.
    #[test]
    fn plan_checks_a_given_memory() {
        let dir = tempfile::tempdir().unwrap();
        let json = crate::trainer::setup::memory::tests::TINY_CONFIG;
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        let mut cfg = Config::default();
        cfg.worker.actor.model.model_path = Some(dir.path().display().to_string());
        cfg.trainer.device = Device::Cuda;
        let fits = plan(&cfg, Some(1 << 40)).unwrap();
        assert!(
            fits.contains("fits: 1.0 TiB available (given: --memory)"),
            "{fits}"
        );
        let small = plan(&cfg, Some(1 << 20)).unwrap();
        assert!(small.contains("does not fit"), "{small}");
        // f32 gradients: bf16 ones are among the ways to shrink the run
        assert!(small.contains("trainer.grad_dtype=bf16"), "{small}");
        let silent = plan(&cfg, None).unwrap();
        assert!(!silent.contains("fit"), "{silent}");
    }
}
