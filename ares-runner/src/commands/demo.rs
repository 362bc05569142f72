//! The built-in demo of `ares-runner train` (no data configured): a synthetic arithmetic
//! task with three difficulty levels and worked solutions of varying length, a tiny Qwen2
//! model and character tokenizer made by the program, a short supervised warm start, then
//! RL — ARES by default, or plain GRPO, GRPO-λ, REINFORCE Pro Max, or GRPO with the GSPO,
//! CISPO, Clip-Cov or KL-Cov policy loss (`--method`). It prints
//! a before/after table (accuracy and mean response length per difficulty) and leaves
//! metrics, a plot, a summary and a checkpoint under `runs/`.
//!
//! Everything is a function of the seed and the configuration; any key can be overridden
//! on the command line (`ares-runner train trainer.max_steps=10`).

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::sft::{SftOptions, run_sft};
use crate::backend::Backend;
use crate::config::Config;
use crate::demo::{DemoOptions, write_demo_assets_with};
use crate::trainer::eval::{EvalReport, format_table};
use crate::trainer::setup::{load_examples, renderer, run_dir};
use crate::trainer::{TrainError, Trainer};

/// The RL method of a demo run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// ARES: difficulty-aware entropy shaping, dual-ascent dynamic KL (the default).
    Ares,
    /// Plain GRPO on accuracy.
    Grpo,
    /// GRPO-λ: length-penalised rewards in the most accurate groups.
    GrpoLambda,
    /// REINFORCE Pro Max with `uniform_scale`.
    ProMax,
    /// GRPO advantages with the GSPO loss (sequence ratio, clip 3e-4 / 4e-4,
    /// `seq-mean-token-mean`); this and the three below take two mini-batches per step.
    Gspo,
    /// GRPO advantages with the CISPO loss (no lower clip, ε_high 0.3).
    Cispo,
    /// GRPO advantages with the Clip-Cov loss (its defaults).
    ClipCov,
    /// GRPO advantages with the KL-Cov loss (`kl_cov_ratio` 0.002).
    KlCov,
}

impl Method {
    /// Name used in run directories.
    pub fn name(self) -> &'static str {
        match self {
            Method::Ares => "ares",
            Method::Grpo => "grpo",
            Method::GrpoLambda => "grpo-lambda",
            Method::ProMax => "pro-max",
            Method::Gspo => "gspo",
            Method::Cispo => "cispo",
            Method::ClipCov => "clip-cov",
            Method::KlCov => "kl-cov",
        }
    }

    /// The config keys that select the method.
    fn keys(self) -> &'static str {
        match self {
            Method::Ares => "  adv_estimator: grpo\n",
            Method::Grpo => "  adv_estimator: grpo\n  entropy_reward: {enable: false}\n",
            Method::GrpoLambda => {
                "  adv_estimator: grpo\n  entropy_reward: {enable: false}\n  grpo_lambda: {enable: true}\n"
            }
            Method::ProMax => {
                "  entropy_reward: {enable: false}\n  adv_estimator: reinforce_pro_max\n  uniform_scale: true\n"
            }
            // the policy-loss methods change only `worker.actor` (see `actor_keys`)
            Method::Gspo | Method::Cispo | Method::ClipCov | Method::KlCov => {
                "  adv_estimator: grpo\n  entropy_reward: {enable: false}\n"
            }
        }
    }

    /// Samples per optimizer step. The policy-loss methods take two mini-batches per RL step:
    /// with one, every update is on-policy (r = 1 exactly), where CISPO and KL-Cov reduce to
    /// PPO's gradient and GSPO to PPO's with its aggregation.
    fn global_batch_size(self) -> usize {
        match self {
            Method::Ares | Method::Grpo | Method::GrpoLambda | Method::ProMax => 128,
            Method::Gspo | Method::Cispo | Method::ClipCov | Method::KlCov => 64,
        }
    }

    /// The `worker.actor` keys that select the method's policy loss (indented for the demo
    /// YAML).
    fn actor_keys(self) -> &'static str {
        match self {
            Method::Ares | Method::Grpo | Method::GrpoLambda | Method::ProMax => "",
            Method::Gspo => {
                "    policy_loss: gspo\n    clip_ratio_low: 3.0e-4\n    clip_ratio_high: 4.0e-4\n    loss_agg_mode: seq-mean-token-mean\n"
            }
            Method::Cispo => "    policy_loss: cispo\n    clip_ratio_low: 1.0\n",
            Method::ClipCov => "    policy_loss: clip_cov\n",
            Method::KlCov => "    policy_loss: kl_cov\n    kl_cov_ratio: 0.002\n",
        }
    }
}

/// Seed of the demo's problems and initial weights.
const DEMO_SEED: u64 = 1;

/// Worked solutions of the warm start: 400 steps of 32, enough for a model that is right
/// about half the time and leaves RL something to improve.
const SFT_EXAMPLES: usize = 17_920;

/// The demo's configuration (YAML), before command-line overrides.
fn base_yaml(method: Method, warm: &Path) -> String {
    let assets = warm.join("assets");
    let data = assets.join("data");
    format!(
        "\
data:
  train_files: {train}
  val_files: {val}
  max_prompt_length: 40
  max_response_length: 96
  rollout_batch_size: 16
  bootstrap: true
  seed: 1
algorithm:
  kl_ctrl: dual_ascent
  online_filtering: true
  filter_key: overall
  max_try_make_batch: 8
{method_keys}worker:
  actor:
    model_path: {model}
    global_batch_size: {global_batch_size}
    micro_batch_size_per_device: 64
    ppo_epochs: 1
    max_grad_norm: 1.0
{actor_keys}    optim: {{lr: 1.0e-4, weight_decay: 0.0}}
  rollout:
    n: 8
    temperature: 1.0
    seed: 1
    val_temperature: 1.0
    val_n: 4
trainer:
  experiment_name: demo-{name}
  max_steps: 120
  val_freq: 0
  save_freq: 40
  save_limit: 1
  val_before_train: false
  seed: 1
sft:
  epochs: 1
  lr: 3.0e-3
  batch_size: 32
  max_length: 128
",
        train = data.join("train.jsonl").display(),
        val = data.join("eval.jsonl").display(),
        model = warm.join("sft").display(),
        method_keys = method.keys(),
        actor_keys = method.actor_keys(),
        global_batch_size = method.global_batch_size(),
        name = method.name(),
    )
}

/// The demo's config for `method` with `overrides`.
///
/// # Errors
/// Bad overrides.
pub fn config(method: Method, overrides: &[String]) -> Result<Config, TrainError> {
    let warm = warm_start_dir();
    let text = base_yaml(method, &warm);
    let tmp = std::env::temp_dir().join(format!(
        "ares-demo-{}-{}.yaml",
        method.name(),
        std::process::id()
    ));
    std::fs::write(&tmp, &text).map_err(|e| TrainError::io(&tmp, e))?;
    let cfg = Config::load(Some(&tmp), overrides);
    let _ = std::fs::remove_file(&tmp);
    cfg.map_err(|e| TrainError::Invalid(e.to_string()))
}

/// Where the assets and the warm-started model live (shared by every method).
fn warm_start_dir() -> PathBuf {
    PathBuf::from("runs").join(format!("demo-warmstart-seed{DEMO_SEED}"))
}

/// Writes the assets and runs the supervised warm start, unless already done.
fn warm_start<B: Backend + Clone>(cfg: &Config, backend: &B) -> Result<PathBuf, TrainError> {
    let warm = warm_start_dir();
    let done = warm.join("sft").join("config.json");
    let assets = warm.join("assets");
    if done.exists() {
        eprintln!(
            "demo: reusing the warm-started model in {}",
            warm.join("sft").display()
        );
        return Ok(warm);
    }
    eprintln!(
        "demo: writing the task, tokenizer and a random tiny model to {}",
        assets.display()
    );
    let written = write_demo_assets_with(
        &assets,
        &DemoOptions {
            seed: DEMO_SEED,
            sft_examples: SFT_EXAMPLES,
            ..DemoOptions::default()
        },
    )
    .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let pairs = super::sft::read_pairs(&written.sft, "prompt", "response")?;
    let options = SftOptions {
        epochs: cfg.sft.epochs,
        batch_size: cfg.sft.batch_size,
        micro_batch: cfg.sft.batch_size,
        lr: cfg.sft.lr,
        max_length: cfg.sft.max_length,
        seed: DEMO_SEED,
    };
    eprintln!(
        "demo: supervised warm start on {} worked solutions",
        pairs.len()
    );
    let report = run_sft(
        cfg,
        backend.clone(),
        &written.model_dir,
        &pairs,
        &options,
        &warm.join("sft"),
        Some(&warm.join("sft_metrics.jsonl")),
    )?;
    eprintln!(
        "demo: warm start done, {} steps, loss {:.3} → {:.3}",
        report.steps, report.first_loss, report.last_loss
    );
    Ok(warm)
}

/// Accuracy and length per difficulty of the model in `model_dir` on `data` (greedy unless
/// `worker.rollout.val_temperature` > 0).
///
/// # Errors
/// Loading, generation or grading errors.
pub fn evaluate_model<B: Backend + Clone>(
    cfg: &Config,
    backend: B,
    model_dir: &Path,
    data: &str,
) -> Result<EvalReport, TrainError> {
    let mut c = cfg.clone();
    c.worker.actor.model_path = Some(model_dir.to_string_lossy().into_owned());
    let examples = load_examples(&c, data)?;
    let r = renderer(&c, model_dir)?;
    let ckpt = crate::hf::checkpoint::Checkpoint::load(model_dir)
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let eos = crate::trainer::setup::eos_ids(&ckpt, &r);
    let model =
        crate::trainer::actor::Actor::Text(crate::trainer::setup::build_model(backend, &ckpt, &c)?);
    let mut grader = crate::trainer::grading::Grader::new(&c)?;
    let rr = &c.worker.rollout;
    let sampling = crate::trainer::settings::validation_sampling(&c);
    // eval must not fail on a config written for another model: cap the new tokens at
    // what the model's positions allow after the longest prompt
    let mut longest = 0;
    for e in &examples {
        longest = longest.max(r.ids(e, None)?.len());
    }
    let room = ckpt.config.max_position_embeddings.saturating_sub(longest);
    let max_new_tokens = c.data.max_response_length.min(room);
    if max_new_tokens < c.data.max_response_length {
        eprintln!(
            "note: responses capped at {max_new_tokens} tokens (data.max_response_length = {}; \
             the model has {} positions, the longest prompt {longest} tokens)",
            c.data.max_response_length, ckpt.config.max_position_embeddings
        );
    }
    let params = crate::trainer::rollout::RolloutParams {
        max_new_tokens,
        eos_ids: eos,
        sampling,
        seed: c.trainer.seed,
        chunk: 64,
    };
    let bar = crate::progress::Progress::from_env()
        .bar((examples.len() * rr.val_n.max(1)) as u64, "eval");
    let report = crate::trainer::eval::evaluate(
        &model,
        &r,
        &mut grader,
        &examples,
        rr.val_n.max(1),
        &params,
        |d| bar.set_position(d as u64),
    )?;
    bar.finish();
    Ok(report)
}

/// The demo's summary file (`summary.json` in the run directory).
#[derive(Debug, Serialize)]
struct Summary<'a> {
    method: &'a str,
    steps: u64,
    before: &'a EvalReport,
    after: &'a EvalReport,
    seconds: f64,
}

/// The before/after table.
fn before_after(before: &EvalReport, after: &EvalReport) -> String {
    let mut out = format!(
        "{:<10} {:>10} {:>10} {:>12} {:>12}\n",
        "difficulty", "acc before", "acc after", "len before", "len after"
    );
    for k in ["easy", "medium", "hard", "all"] {
        if let (Some(b), Some(a)) = (before.get(k), after.get(k)) {
            out.push_str(&format!(
                "{:<10} {:>9.1}% {:>9.1}% {:>12.1} {:>12.1}\n",
                k,
                100.0 * b.accuracy,
                100.0 * a.accuracy,
                b.mean_length,
                a.mean_length
            ));
        }
    }
    out
}

/// Runs the demo with `method` (default ARES) and `overrides`.
///
/// # Errors
/// Any stage's error.
pub fn run(overrides: &[String], method: Option<Method>) -> Result<(), TrainError> {
    let started = std::time::Instant::now();
    let method = method.unwrap_or(Method::Ares);
    let cfg = config(method, overrides)?;
    let selected = super::select_backend(&cfg)?;
    crate::with_backend!(selected, b => run_on(&cfg, method, b, started))
}

/// [`run`] on a chosen backend.
fn run_on<B: Backend + Clone>(
    cfg: &Config,
    method: Method,
    backend: B,
    started: std::time::Instant,
) -> Result<(), TrainError> {
    let cfg = cfg.clone();
    eprintln!(
        "ares-runner demo ({}) on {}: a tiny model learns arithmetic; `ares-runner train \
         -c config.yaml` trains your own model",
        method.name(),
        backend.name()
    );
    // the demo owns its run directory: a new demo run replaces the previous one's outputs
    // (unless it is asked to resume it)
    let run = run_dir(&cfg);
    if !cfg.trainer.resume && run.exists() {
        eprintln!("demo: replacing the previous demo run in {}", run.display());
        std::fs::remove_dir_all(&run).map_err(|e| TrainError::io(&run, e))?;
    }
    warm_start(&cfg, &backend)?;
    let sft_dir = PathBuf::from(cfg.worker.actor.model_path.clone().unwrap_or_default());
    let val = cfg.data.val_files.clone().unwrap_or_default();
    eprintln!("demo: evaluating the warm-started model on the held-out problems");
    let before = evaluate_model(&cfg, backend.clone(), &sft_dir, &val)?;
    eprint!("{}", format_table(&before));

    let interrupt = super::interrupt_flag()?;
    let mut trainer = Trainer::new(cfg.clone(), backend, interrupt)?;
    let summary = trainer.run()?;
    let val_examples = trainer.val.clone();
    eprintln!("demo: evaluating the trained model on the held-out problems");
    let after = trainer.evaluate(&val_examples)?;

    let r = &cfg.worker.rollout;
    let decoding = if r.val_temperature == 0.0 {
        "greedy decoding".to_string()
    } else {
        format!(
            "{} samples per problem at temperature {}",
            r.val_n.max(1),
            r.val_temperature
        )
    };
    println!(
        "\nARES demo ({}), {} RL steps; held-out problems, {decoding}:\n{}",
        method.name(),
        summary.steps,
        before_after(&before, &after)
    );
    let plot = run.join("plot.png");
    match crate::plot::plot_metrics(&summary.metrics, &plot, None) {
        Ok(_) => eprintln!("plot: {}", plot.display()),
        Err(e) => eprintln!("warning: no plot: {e}"),
    }
    let json = serde_json::to_vec_pretty(&Summary {
        method: method.name(),
        steps: summary.steps,
        before: &before,
        after: &after,
        seconds: started.elapsed().as_secs_f64(),
    })
    .map_err(|e| TrainError::Internal(e.to_string()))?;
    crate::trainer::checkpoints::write_atomic(&run.join("summary.json"), &json)?;
    eprintln!(
        "demo: {:.0} s; metrics {}, checkpoint {}, summary {}",
        started.elapsed().as_secs_f64(),
        summary.metrics.display(),
        summary
            .checkpoint
            .map_or("none".into(), |p| p.display().to_string()),
        run.join("summary.json").display()
    );
    Ok(())
}
