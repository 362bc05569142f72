//! `ares-runner`: the trainer's command line.
//!
//! - `train` — RL training from a YAML config and dotted overrides; with no data configured,
//!   the built-in demo (a tiny model learns arithmetic on the CPU in minutes).
//! - `config` — prints the resolved configuration.
//! - `plan` — prints the memory plan of a run.
//! - `eval` — accuracy and mean response length per difficulty of a model on a dataset.
//! - `sft` — supervised fine-tuning on prompt/response data (the cold-start stage).
//! - `generate` — completions of prompts by a model (streamed text or JSON lines).
//! - `plot` — draws the key curves of a `metrics.jsonl`.
//! - `demo-data` — writes the demo's model, tokenizer and datasets to a directory.
//! - `init` — writes a random-weight model folder at a real model's shape.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use ares_runner::config::{Config, ConfigNote, notes_table};

/// RL training of reasoning LLMs: ARES/AEPO, GRPO-λ, graded rubric prompts, REINFORCE Pro Max.
#[derive(Debug, Parser)]
#[command(name = "ares-runner", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The configuration a command reads: a YAML file and dotted overrides.
#[derive(Debug, clap::Args)]
struct ConfigArgs {
    /// YAML config (verl/EasyR1-style sections); defaults when absent.
    #[arg(short, long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Dotted overrides applied after the file, e.g. `worker.rollout.n=8`.
    #[arg(value_name = "KEY=VALUE")]
    overrides: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train with RL (no data configured: the built-in CPU demo).
    Train {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Device: cpu, cuda or auto (overrides `trainer.device`).
        #[arg(long, value_name = "DEVICE")]
        device: Option<String>,
        /// Method of the built-in demo (no data configured): ares (default), grpo, grpo-lambda,
        /// pro-max, gspo, cispo, clip-cov, kl-cov, forking, target-entropy, dapo-overlong.
        #[arg(long, value_enum)]
        method: Option<ares_runner::commands::demo::Method>,
        /// Which built-in demo (no data configured): text (arithmetic), vision (counting
        /// shapes in pictures with a tiny Qwen2.5-VL-style model) or tools (arithmetic with
        /// a calculator the model learns when to call).
        #[arg(long, value_enum)]
        demo: Option<ares_runner::commands::demo::Demo>,
    },
    /// Print the memory plan of a run (from the model's config.json; nothing is loaded):
    /// what it holds and what each phase of a step adds, at its longest sequences.
    Plan {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Device: cpu or cuda (overrides `trainer.device`).
        #[arg(long, value_name = "DEVICE")]
        device: Option<String>,
        /// Memory to check the plan against, e.g. `80G` for a GPU's (bytes, or a number
        /// with G or M); default: a CPU run's host memory, nothing for a GPU run.
        #[arg(long, value_name = "SIZE", value_parser = memory_size)]
        memory: Option<u64>,
    },
    /// Print the resolved configuration as YAML.
    Config {
        #[command(flatten)]
        cfg: ConfigArgs,
    },
    /// Evaluate a model: accuracy and mean response length per difficulty.
    Eval {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Model directory (default: `worker.actor.model.model_path`).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Dataset (default: `data.val_files`, else `data.train_files`).
        #[arg(long, value_name = "FILE")]
        data: Option<PathBuf>,
        /// A PEFT LoRA adapter to merge into the model's weights first.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
    },
    /// Supervised fine-tuning on prompt/response data (`sft.*` keys).
    Sft {
        #[command(flatten)]
        cfg: ConfigArgs,
    },
    /// Generate completions of prompts with a model (streamed, or JSON lines with --json).
    Generate(Box<ares_runner::commands::generate::GenerateArgs>),
    /// Plot the key curves of a metrics file.
    Plot {
        /// The `metrics.jsonl` of a run.
        metrics: PathBuf,
        /// Output image (.png or .svg).
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
        /// Keys to plot (repeatable; `prefix/*` groups a family); default: the key curves.
        #[arg(short, long = "key", value_name = "KEY")]
        keys: Vec<String>,
    },
    /// Write a model folder of random weights at a real model's shape (a named one, or any
    /// config.json), with the demo's character tokenizer: for measuring time and memory at
    /// that shape with no download. Train on it with the demo's data (`demo-data`).
    Init {
        /// The model folder to write.
        #[arg(value_name = "DIR")]
        output: PathBuf,
        /// A named shape.
        #[arg(
            long,
            value_enum,
            required_unless_present = "config",
            conflicts_with = "config"
        )]
        shape: Option<ares_runner::commands::init::NamedShape>,
        /// A `config.json` to give random weights (Qwen2, Qwen3, Llama; Qwen2-VL, Qwen2.5-VL).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// How the weights are stored.
        #[arg(long, value_enum, default_value_t = InitDtype::Bf16)]
        dtype: InitDtype,
        /// Seed of the weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Merge a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into
    /// its base model and write a full Hugging Face checkpoint (text models).
    Merge {
        /// The base model's directory.
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// The adapter's directory, as `PeftModel.save_pretrained` writes it.
        #[arg(long, value_name = "DIR")]
        adapter: PathBuf,
        /// Where to write the merged model (a new or empty directory).
        #[arg(short, long, value_name = "DIR")]
        output: PathBuf,
        /// How the merged weights are stored.
        #[arg(long, value_enum, default_value_t = InitDtype::Bf16)]
        dtype: InitDtype,
    },
    /// Write the demo's tiny model, tokenizer and datasets to a directory.
    DemoData {
        /// Output directory.
        #[arg(short, long, value_name = "DIR", default_value = "runs/demo/assets")]
        output: PathBuf,
        /// Seed of the model's initialisation and of the problems.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The random model's shape: the demo's tiny one, or Qwen2.5-0.5B's (benchmarks).
        #[arg(long, value_enum, default_value_t = Shape::Demo)]
        shape: Shape,
        /// Rows of the embedding and LM head (at least the demo tokenizer's 59), e.g.
        /// 151936 for a Qwen-sized vocabulary in benchmarks.
        #[arg(long, value_name = "N")]
        vocab: Option<usize>,
    },
}

/// Storage of the weights `init` and `merge` write.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum InitDtype {
    /// bfloat16: half the size.
    Bf16,
    /// 32-bit floats.
    F32,
}

/// Model shapes `demo-data` can write.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Shape {
    /// The demo's 0.56 M-parameter model.
    Demo,
    /// Qwen2.5-0.5B's sizes, random weights.
    #[value(name = "qwen2.5-0.5b")]
    Qwen2_5_0_5b,
}

/// Loads a config and applies `--device`; the EasyR1 keys read differently go to stderr.
/// `plan --memory`'s size.
fn memory_size(text: &str) -> Result<u64, String> {
    ares_runner::host_memory::parse_size(text)
        .ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with G or M)"))
}

fn load(cfg: &ConfigArgs, device: Option<&str>) -> Result<Config, Box<dyn std::error::Error>> {
    let (config, notes) = load_with_notes(cfg, device)?;
    eprint!("{}", notes_table(&notes));
    Ok(config)
}

/// [`load`] without printing the notes.
fn load_with_notes(
    cfg: &ConfigArgs,
    device: Option<&str>,
) -> Result<(Config, Vec<ConfigNote>), Box<dyn std::error::Error>> {
    let mut overrides = cfg.overrides.clone();
    if let Some(d) = device {
        overrides.push(format!("trainer.device={d}"));
    }
    Ok(Config::load_with_notes(cfg.config.as_deref(), &overrides)?)
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Train {
            cfg,
            device,
            method,
            demo,
        } => {
            let mut overrides = cfg.overrides.clone();
            if let Some(d) = &device {
                overrides.push(format!("trainer.device={d}"));
            }
            let config = load(&cfg, device.as_deref())?;
            if config.data.train_files.is_none() && cfg.config.is_none() {
                ares_runner::commands::demo::run(&overrides, demo.unwrap_or_default(), method)?;
            } else {
                if method.is_some() || demo.is_some() {
                    return Err(
                        "--method and --demo select the built-in demo; with your own data \
                                set algorithm.* keys instead"
                            .into(),
                    );
                }
                ares_runner::commands::train(config, &overrides, cfg.config.is_some())?;
            }
        }
        Command::Plan {
            cfg,
            device,
            memory,
        } => {
            let config = load(&cfg, device.as_deref())?;
            print!("{}", ares_runner::commands::plan(&config, memory)?);
        }
        Command::Config { cfg } => {
            // the notes follow as YAML comments, so the output still loads as a config
            let (config, notes) = load_with_notes(&cfg, None)?;
            print!("{}", config.to_yaml());
            for line in notes_table(&notes).lines() {
                println!("# {line}");
            }
        }
        Command::Eval {
            cfg,
            model,
            data,
            adapter,
        } => {
            let config = load(&cfg, None)?;
            let (model, adapter, data) = (model.as_deref(), adapter.as_deref(), data.as_deref());
            ares_runner::commands::eval(&config, model, adapter, data)?;
        }
        Command::Sft { cfg } => {
            let config = load(&cfg, None)?;
            ares_runner::commands::sft(&config)?;
        }
        Command::Generate(args) => ares_runner::commands::generate::run(&args)?,
        Command::Plot {
            metrics,
            output,
            keys,
        } => {
            let keys = (!keys.is_empty()).then_some(keys.as_slice());
            let summary = ares_runner::plot::plot_metrics(&metrics, &output, keys)?;
            for k in &summary.skipped {
                eprintln!("warning: no data for {k:?} in {}", metrics.display());
            }
            eprintln!(
                "wrote {} ({} panels: {})",
                output.display(),
                summary.panels.len(),
                summary.panels.join(", ")
            );
        }
        Command::Merge {
            model,
            adapter,
            output,
            dtype,
        } => {
            use ares_runner::hf::tensor_files::SaveDtype;
            let dtype = match dtype {
                InitDtype::Bf16 => SaveDtype::Bf16,
                InitDtype::F32 => SaveDtype::F32,
            };
            let report = ares_runner::commands::merge::merge(&model, &adapter, &output, dtype)?;
            eprintln!(
                "merged {} LoRA pairs (rank {}, scale {}) into {}",
                report.merged,
                report.rank,
                report.scale,
                report.output.display()
            );
        }
        Command::Init {
            output,
            shape,
            config,
            dtype,
            seed,
        } => {
            use ares_runner::commands::init::{InitOptions, init};
            use ares_runner::hf::tensor_files::SaveDtype;
            let dtype = match dtype {
                InitDtype::Bf16 => SaveDtype::Bf16,
                InitDtype::F32 => SaveDtype::F32,
            };
            let shape = match (shape, config) {
                (Some(s), _) => Ok(s),
                (None, Some(path)) => Err(path),
                (None, None) => return Err("give --shape or --config".into()),
            };
            let started = std::time::Instant::now();
            let report = init(&InitOptions {
                output: output.clone(),
                shape,
                dtype,
                seed,
            })?;
            eprintln!(
                "wrote {} with {:.3} B random parameters ({}, {}) in {:.1} s; its tokenizer is \
                 the demo's: train on it with `ares-runner demo-data -o D` and \
                 `ares-runner train data.train_files=D/data/train.jsonl \
                 data.val_files=D/data/eval.jsonl worker.actor.model.model_path={}`",
                output.display(),
                report.parameters as f64 / 1e9,
                if report.vision {
                    "vision-language"
                } else {
                    "text"
                },
                dtype.torch_name(),
                started.elapsed().as_secs_f64(),
                output.display(),
            );
        }
        Command::DemoData {
            output,
            seed,
            shape,
            vocab,
        } => {
            use ares_runner::demo::DemoOptions;
            use ares_runner::demo::model::TinyModelSpec;
            let defaults = DemoOptions::default();
            let options = DemoOptions {
                seed,
                model: match shape {
                    Shape::Demo => TinyModelSpec::default(),
                    Shape::Qwen2_5_0_5b => TinyModelSpec::qwen2_5_0_5b(),
                },
                vocab_size: vocab.unwrap_or(defaults.vocab_size),
                ..defaults
            };
            let assets = ares_runner::demo::write_demo_assets_with(&output, &options)?;
            eprintln!("wrote the demo assets to {}: {assets:?}", output.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    ares_runner::host_memory::release_big_buffers();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
