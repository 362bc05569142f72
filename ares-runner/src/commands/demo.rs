//! The built-in demos of `ares-runner train` (no data configured). The text demo: a synthetic
//! arithmetic task with three difficulty levels and worked solutions of varying length, a
//! tiny Qwen2 model and character tokenizer made by the program. The vision demo (`--demo
//! vision`): counting coloured shapes in small pictures, a tiny Qwen2.5-VL-style model, the
//! images in EasyR1's JSONL format. Both then run a short supervised warm start, then RL —
//! ARES by default, or plain GRPO, GRPO-λ, REINFORCE Pro Max, GRPO with the GSPO, CISPO,
//! Clip-Cov or KL-Cov policy loss, or GRPO with forking tokens, a target-entropy bonus or
//! DAPO's overlong penalty (`--method`). It prints a before/after table (accuracy and mean
//! response length per difficulty) and leaves metrics, a plot, a summary with per-phase
//! times and a checkpoint under `runs/<demo>-<method>/`.
//!
//! Everything is a function of the seed and the configuration; any key can be overridden
//! on the command line (`ares-runner train trainer.max_steps=10`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::sft::{SftOptions, run_sft};
use crate::backend::Backend;
use crate::config::Config;
use crate::demo::tools_task::{ToolsDemoOptions, write_tools_demo_assets};
use crate::demo::vision_assets::{VisionDemoOptions, write_vision_demo_assets_with};
use crate::demo::{DemoOptions, write_demo_assets_with};
use crate::trainer::eval::{EvalReport, EvalRow, format_table};
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
    /// GRPO with the policy gradient on the top 20 % tokens by entropy (forking tokens).
    Forking,
    /// GRPO with an entropy bonus whose coefficient holds the mean token entropy at 0.12.
    TargetEntropy,
    /// GRPO with DAPO's soft overlong penalty over the last 64 of the 96 response tokens.
    DapoOverlong,
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
            Method::Forking => "forking",
            Method::TargetEntropy => "target-entropy",
            Method::DapoOverlong => "dapo-overlong",
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
            Method::Gspo
            | Method::Cispo
            | Method::ClipCov
            | Method::KlCov
            | Method::Forking
            | Method::TargetEntropy
            | Method::DapoOverlong => "  adv_estimator: grpo\n  entropy_reward: {enable: false}\n",
        }
    }

    /// Prompts per optimizer step (EasyR1's unit; × n = 8 samples each). The policy-loss
    /// methods take two mini-batches per RL step:
    /// with one, every update is on-policy (r = 1 exactly), where CISPO and KL-Cov reduce to
    /// PPO's gradient and GSPO to PPO's with its aggregation.
    fn global_batch_size(self) -> usize {
        match self {
            Method::Ares
            | Method::Grpo
            | Method::GrpoLambda
            | Method::ProMax
            | Method::Forking
            | Method::TargetEntropy
            | Method::DapoOverlong => 16,
            Method::Gspo | Method::Cispo | Method::ClipCov | Method::KlCov => 8,
        }
    }

    /// The `worker.actor` keys that select the method's policy loss or loss term (indented
    /// for the demo YAML).
    fn actor_keys(self) -> &'static str {
        match self {
            Method::Ares
            | Method::Grpo
            | Method::GrpoLambda
            | Method::ProMax
            | Method::DapoOverlong => "",
            Method::Forking => "    forking_tokens: {enable: true, rho: 0.2}\n",
            // the demo's entropy starts near 0.14 and falls under GRPO; the bonus holds it
            Method::TargetEntropy => {
                "    entropy_bonus: {coef: 0.0, target: 0.12, lr: 0.1, min_coef: 0.0, max_coef: 0.05}\n"
            }
            Method::Gspo => {
                "    policy_loss: gspo\n    clip_ratio_low: 3.0e-4\n    clip_ratio_high: 4.0e-4\n    loss_agg_mode: seq-mean-token-mean\n"
            }
            Method::Cispo => "    policy_loss: cispo\n    clip_ratio_low: 1.0\n",
            Method::ClipCov => "    policy_loss: clip_cov\n",
            Method::KlCov => "    policy_loss: kl_cov\n    kl_cov_ratio: 0.002\n",
        }
    }
}

impl Method {
    /// The `worker.reward` keys of the method (indented for the demo YAML).
    fn reward_keys(self) -> &'static str {
        match self {
            // responses run from ~20 to ~90 tokens: the penalty zone is 32–96
            Method::DapoOverlong => {
                "  reward:\n    overlong_buffer: {enable: true, len: 64, penalty_factor: 1.0}\n"
            }
            _ => "",
        }
    }
}

/// Which built-in demo runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Demo {
    /// Arithmetic with a tiny Qwen2 (the default).
    #[default]
    Text,
    /// Counting coloured shapes in pictures with a tiny Qwen2.5-VL-style model.
    Vision,
    /// Arithmetic with a calculator the model may call: multi-turn episodes.
    Tools,
}

impl Demo {
    /// Prefix of the run directories: `runs/<prefix>-<method>`.
    pub fn prefix(self) -> &'static str {
        match self {
            Demo::Text => "demo",
            Demo::Vision => "demo-vision",
            Demo::Tools => "demo-tools",
        }
    }

    /// Worked solutions of the warm start. Text: 560 steps of 32, enough for a model that is
    /// right about half the time and leaves RL something to improve. Vision: see
    /// [`VISION_SFT_EXAMPLES`].
    fn sft_examples(self) -> usize {
        match self {
            Demo::Text => 17_920,
            Demo::Vision => VISION_SFT_EXAMPLES,
            Demo::Tools => TOOLS_SFT_EXAMPLES,
        }
    }

    /// `(data.max_prompt_length, data.max_response_length, sft.max_length)`: the vision
    /// prompt holds the chat template, the picture's 9 tokens between its two markers, and
    /// the question. The vision demo's response budget, 64 tokens, is shorter than about
    /// half of its worked solutions (43–85 tokens; those with two or three `check` lines),
    /// so the redundant lines cost answers there — without it they never do (the checks
    /// are always right) and RL has no reason to drop them (docs/multimodal.md, *The vision
    /// demo*).
    ///
    /// Tools: the prompt is the system turn naming the calculator, the question and the
    /// generation prompt (42 tokens at most); a call (27 tokens and its end of turn), the
    /// tool's turn (24 at most) and the answer (13 at most) take 66 of the 72 response
    /// tokens, so a second call does not fit.
    fn lengths(self) -> (usize, usize, usize) {
        match self {
            Demo::Text => (40, 96, 128),
            Demo::Vision => (80, 64, 176),
            Demo::Tools => (48, 72, 128),
        }
    }

    /// `(sft.epochs, sft.lr, sft.batch_size)` of the warm start. Vision: 1e-3 — at the
    /// text demo's 3e-3 the vision features grow until the model ignores the picture (8.5 %
    /// held-out accuracy after one pass of 32s, vs 24 % at 1e-3 and 20 % at 5e-4); one pass
    /// in steps of 16 gives the model of two passes in steps of 32 (21.0 vs 21.1 % held-out
    /// at the 64-token budget) in about half the time. Tools: six passes over 8192 traces in
    /// steps of 32 (1536 steps) — copying the question into the call and the tool's answer
    /// into the box appears between steps ~400 and ~900 (the loss falls from 0.48 to 0.19);
    /// after 768 steps the model is right on 3.5 % of the held-out problems, after 1536 on
    /// 56 %, and 1536 steps of 16 reach 15 %.
    fn sft_schedule(self) -> (usize, f64, usize) {
        match self {
            Demo::Text => (1, 3.0e-3, 32),
            Demo::Vision => (1, 1.0e-3, 16),
            Demo::Tools => (6, 3.0e-3, 32),
        }
    }

    /// RL steps. Vision: 80 — its training accuracy levels off after ~40 steps (80 steps:
    /// 37.9 % held-out, 120: about 40 %), and 80 keep the demo within 10 minutes on 2 cores.
    fn rl_steps(self) -> usize {
        match self {
            Demo::Text => 120,
            Demo::Vision => 80,
            Demo::Tools => TOOLS_RL_STEPS,
        }
    }

    /// What the demo's model learns, for the opening line.
    fn task(self) -> &'static str {
        match self {
            Demo::Text => "a tiny model learns arithmetic",
            Demo::Vision => "a tiny vision-language model learns to count shapes in pictures",
            Demo::Tools => "a tiny model learns when to call a calculator",
        }
    }

    /// The `worker.rollout` keys of the demo (indented for the demo YAML): episodes with
    /// the built-in calculator for the tools demo, a call and an answer at most.
    fn rollout_keys(self) -> &'static str {
        match self {
            Demo::Text | Demo::Vision => "",
            Demo::Tools => {
                "    multi_turn: {enable: true, max_assistant_turns: 2, call_cost: 0.25}\n"
            }
        }
    }
}

/// Seed of the demo's problems and initial weights.
const DEMO_SEED: u64 = 1;

/// Worked solutions of the vision demo's warm start.
const VISION_SFT_EXAMPLES: usize = 16_384;

/// Worked traces of the tools demo's warm start.
const TOOLS_SFT_EXAMPLES: usize = 8192;

/// RL steps of the tools demo.
const TOOLS_RL_STEPS: usize = 60;

/// The demo's configuration (YAML), before command-line overrides.
fn base_yaml(demo: Demo, method: Method, warm: &Path) -> String {
    let assets = warm.join("assets");
    let data = assets.join("data");
    let (max_prompt, max_response, sft_max) = demo.lengths();
    let (sft_epochs, sft_lr, sft_batch) = demo.sft_schedule();
    format!(
        "\
data:
  train_files: {train}
  val_files: {val}
  max_prompt_length: {max_prompt}
  max_response_length: {max_response}
  rollout_batch_size: 16
  bootstrap: true
  seed: 1
algorithm:
  kl_type: dual_ascent
  online_filtering: true
  filter_key: overall
{method_keys}worker:
  actor:
    model:
      model_path: {model}
    global_batch_size: {global_batch_size}
    micro_batch_size_per_device_for_update: 64
    ppo_epochs: 1
    max_grad_norm: 1.0
{actor_keys}    optim: {{lr: 1.0e-4, weight_decay: 0.0}}
  rollout:
    n: 8
    temperature: 1.0
    seed: 1
    val_override_config: {{temperature: 1.0, n: 4}}
{rollout_keys}{reward_keys}trainer:
  max_try_make_batch: 8
  experiment_name: {prefix}-{name}
  max_steps: {rl_steps}
  val_freq: 0
  save_freq: 40
  save_limit: 1
  val_before_train: false
  seed: 1
sft:
  epochs: {sft_epochs}
  lr: {sft_lr:?}
  batch_size: {sft_batch}
  max_length: {sft_max}
",
        train = data.join("train.jsonl").display(),
        val = data.join("eval.jsonl").display(),
        model = warm.join("sft").display(),
        method_keys = method.keys(),
        actor_keys = method.actor_keys(),
        reward_keys = method.reward_keys(),
        rollout_keys = demo.rollout_keys(),
        global_batch_size = method.global_batch_size(),
        name = method.name(),
        prefix = demo.prefix(),
        rl_steps = demo.rl_steps(),
    )
}

/// The config of `demo` with `method` and `overrides`.
///
/// # Errors
/// Bad overrides.
pub fn config(demo: Demo, method: Method, overrides: &[String]) -> Result<Config, TrainError> {
    let warm = warm_start_dir(demo);
    let text = base_yaml(demo, method, &warm);
    let tmp = std::env::temp_dir().join(format!(
        "ares-{}-{}-{}.yaml",
        demo.prefix(),
        method.name(),
        std::process::id()
    ));
    std::fs::write(&tmp, &text).map_err(|e| TrainError::io(&tmp, e))?;
    let cfg = Config::load(Some(&tmp), overrides);
    let _ = std::fs::remove_file(&tmp);
    cfg.map_err(|e| TrainError::Invalid(e.to_string()))
}

/// Where the assets and the warm-started model live (shared by every method).
fn warm_start_dir(demo: Demo) -> PathBuf {
    PathBuf::from("runs").join(format!("{}-warmstart-seed{DEMO_SEED}", demo.prefix()))
}

/// Writes `demo`'s assets; returns the model directory and the SFT file.
fn write_assets(demo: Demo, assets: &Path) -> Result<(PathBuf, PathBuf), TrainError> {
    let invalid = |e: crate::demo::DemoError| TrainError::Invalid(e.to_string());
    Ok(match demo {
        Demo::Text => {
            let w = write_demo_assets_with(
                assets,
                &DemoOptions {
                    seed: DEMO_SEED,
                    sft_examples: demo.sft_examples(),
                    ..DemoOptions::default()
                },
            )
            .map_err(invalid)?;
            (w.model_dir, w.sft)
        }
        Demo::Vision => {
            let w = write_vision_demo_assets_with(
                assets,
                &VisionDemoOptions {
                    seed: DEMO_SEED,
                    sft_examples: demo.sft_examples(),
                    ..VisionDemoOptions::default()
                },
            )
            .map_err(invalid)?;
            (w.model_dir, w.sft)
        }
        Demo::Tools => {
            let w = write_tools_demo_assets(
                assets,
                &ToolsDemoOptions {
                    seed: DEMO_SEED,
                    sft_examples: demo.sft_examples(),
                    ..ToolsDemoOptions::default()
                },
            )
            .map_err(invalid)?;
            (w.model_dir, w.sft)
        }
    })
}

/// What a warm start was made with (`warmstart.json` beside it): it is reused only by a run
/// with the same settings, so a changed schedule (an override, a newer version) never
/// trains on a stale model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WarmStartRecord {
    sft_examples: usize,
    epochs: usize,
    batch_size: usize,
    lr: f64,
    max_length: usize,
    seed: u64,
    /// How the warm start's AdamW stored its moments (absent in older records: f32).
    #[serde(default = "f32_states")]
    state_dtype: String,
}

fn f32_states() -> String {
    "f32".into()
}

/// Whether the warm start in `warm` is finished and was made with `record`'s settings.
fn made_with(warm: &Path, record: &WarmStartRecord) -> bool {
    warm.join("sft").join("config.json").exists()
        && std::fs::read(warm.join("warmstart.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<WarmStartRecord>(&b).ok())
            .is_some_and(|r| r == *record)
}

/// Writes the assets and runs the supervised warm start, unless one made with the same
/// settings is there.
fn warm_start<B: Backend + Clone>(
    demo: Demo,
    cfg: &Config,
    backend: &B,
) -> Result<PathBuf, TrainError> {
    let warm = warm_start_dir(demo);
    let assets = warm.join("assets");
    let record = WarmStartRecord {
        sft_examples: demo.sft_examples(),
        epochs: cfg.sft.epochs,
        batch_size: cfg.sft.batch_size,
        lr: cfg.sft.lr,
        max_length: cfg.sft.max_length,
        seed: DEMO_SEED,
        state_dtype: crate::model::StateDtype::from(cfg.worker.actor.optim.state_dtype)
            .name()
            .into(),
    };
    let record_path = warm.join("warmstart.json");
    if made_with(&warm, &record) {
        eprintln!(
            "demo: reusing the warm-started model in {}",
            warm.join("sft").display()
        );
        return Ok(warm);
    }
    if warm.join("sft").exists() {
        eprintln!(
            "demo: the warm start in {} was made with other settings (or by an older version); \
             making it again",
            warm.display()
        );
    }
    eprintln!(
        "demo: writing the task, tokenizer and a random tiny model to {}",
        assets.display()
    );
    let (model_dir, sft) = write_assets(demo, &assets)?;
    let pairs = super::sft::read_sft_pairs(&sft, cfg)?;
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
    // the warm start trains every weight of the random model, whatever the RL run does
    let mut full = cfg.clone();
    full.worker.actor.model.lora = Default::default();
    let report = run_sft(
        &full,
        backend.clone(),
        &model_dir,
        &pairs,
        &options,
        &warm.join("sft"),
        Some(&warm.join("sft_metrics.jsonl")),
    )?;
    eprintln!(
        "demo: warm start done, {} steps, loss {:.3} → {:.3}",
        report.steps, report.first_loss, report.last_loss
    );
    let json =
        serde_json::to_vec_pretty(&record).map_err(|e| TrainError::Internal(e.to_string()))?;
    let tmp = record_path.with_extension("json.tmp");
    std::fs::write(&tmp, json).map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, &record_path).map_err(|e| TrainError::io(&record_path, e))?;
    Ok(warm)
}

/// Accuracy and length per difficulty of the model in `model_dir` on `data` (greedy unless
/// `worker.rollout.val_override_config.temperature` > 0).
///
/// # Errors
/// Loading, generation or grading errors.
pub fn evaluate_model<B: Backend + Clone>(
    cfg: &Config,
    backend: B,
    model_dir: &Path,
    adapter: Option<&Path>,
    data: &str,
) -> Result<EvalReport, TrainError> {
    evaluate_model_with(cfg, backend, model_dir, adapter, data, None)
}

/// [`evaluate_model`], each response also pushed to `generations` as (question, response,
/// answer, score).
///
/// # Errors
/// As [`evaluate_model`].
pub fn evaluate_model_with<B: Backend + Clone>(
    cfg: &Config,
    backend: B,
    model_dir: &Path,
    adapter: Option<&Path>,
    data: &str,
    generations: Option<&mut Vec<crate::reward::Generation>>,
) -> Result<EvalReport, TrainError> {
    let mut c = cfg.clone();
    c.worker.actor.model.model_path = Some(model_dir.to_string_lossy().into_owned());
    let examples = load_examples(&c, data)?;
    let r = renderer(&c, model_dir)?;
    let mut files = crate::trainer::setup::ModelFiles::load(model_dir)?;
    if let Some(dir) = adapter {
        files.merge_adapter(dir)?;
    }
    let eos = crate::trainer::setup::eos_ids_of(files.generation(), &r);
    let model = crate::trainer::setup::build_actor(backend, &files, &c)?;
    let mut files = files;
    files.drop_weights(); // its configs are read below
    let mut grader = crate::trainer::collect::grading::Grader::new(&c)?;
    let rr = &c.worker.rollout;
    let sampling = crate::trainer::setup::settings::validation_sampling(&c);
    // eval must not fail on a config written for another model: cap the new tokens at
    // what the model's positions allow after the longest prompt
    let mut longest = 0;
    for e in &examples {
        longest = longest.max(r.prompt_len(e, &r.ids(e, None)?)?);
    }
    let positions = files.text_config().max_position_embeddings;
    let room = positions.saturating_sub(longest);
    let max_new_tokens = c.data.max_response_length.min(room);
    if max_new_tokens < c.data.max_response_length {
        eprintln!(
            "note: responses capped at {max_new_tokens} tokens (data.max_response_length = {}; \
             the model has {} positions, the longest prompt {longest} tokens)",
            c.data.max_response_length, positions
        );
    }
    let params = crate::trainer::collect::rollout::RolloutParams {
        max_new_tokens,
        eos_ids: eos,
        sampling,
        seed: c.trainer.seed,
        chunk: 64,
        weight_dtype: rr.weight_dtype.into(),
        cuda_graphs: rr.cuda_graphs,
        kv_cache_dtype: rr.kv_cache_dtype.into(),
        max_kv_blocks: None,
        ranks: None,
    };
    let bar =
        crate::progress::Progress::from_env().bar((examples.len() * rr.val_n()) as u64, "eval");
    // a multi-turn config's episodes run their tools here too
    let mt = crate::trainer::run::multi_turn(&c, &r)?;
    let episodes = crate::trainer::run::episode_tools(mt.as_ref(), &r)?;
    let report = crate::trainer::eval::evaluate(
        &model,
        &r,
        episodes.as_ref(),
        &mut grader,
        &examples,
        rr.val_n(),
        &params,
        |d| bar.set_position(d as u64),
        generations,
    )?;
    bar.finish();
    Ok(report)
}

/// The demo's summary file (`summary.json` in the run directory).
#[derive(Debug, Serialize)]
struct Summary<'a> {
    demo: &'a str,
    method: &'a str,
    steps: u64,
    before: &'a EvalReport,
    after: &'a EvalReport,
    seconds: f64,
    phases: PhaseSeconds,
}

/// Wall-clock seconds of the demo's phases (`summary.json`).
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct PhaseSeconds {
    /// Writing the assets and the supervised warm start (≈ 0 when reused).
    warm_start: f64,
    /// Evaluating the warm-started model.
    eval_before: f64,
    /// The RL run.
    rl: f64,
    /// Evaluating the trained model.
    eval_after: f64,
}

/// The before/after table: accuracy per difficulty, then calls per answer when either
/// model called tools, else mean length.
fn before_after(before: &EvalReport, after: &EvalReport) -> String {
    let calls = before
        .values()
        .chain(after.values())
        .any(|r| r.calls_per_response > 0.0);
    // the second pair of columns: calls per answer, else mean length
    let (name, width, digits, value): (_, usize, usize, fn(&EvalRow) -> f64) = if calls {
        ("calls", 13, 2, |r| r.calls_per_response)
    } else {
        ("len", 12, 1, |r| r.mean_length)
    };
    let mut out = format!(
        "{:<10} {:>10} {:>10} {:>width$} {:>width$}\n",
        "difficulty",
        "acc before",
        "acc after",
        format!("{name} before"),
        format!("{name} after"),
    );
    for k in ["easy", "medium", "hard", "all"] {
        if let (Some(b), Some(a)) = (before.get(k), after.get(k)) {
            out.push_str(&format!(
                "{:<10} {:>9.1}% {:>9.1}% {:>width$.digits$} {:>width$.digits$}\n",
                k,
                100.0 * b.accuracy,
                100.0 * a.accuracy,
                value(b),
                value(a),
            ));
        }
    }
    out
}

/// Runs `demo` with `method` (default ARES) and `overrides`.
///
/// # Errors
/// Any stage's error.
pub fn run(overrides: &[String], demo: Demo, method: Option<Method>) -> Result<(), TrainError> {
    let started = std::time::Instant::now();
    let method = method.unwrap_or(Method::Ares);
    let cfg = config(demo, method, overrides)?;
    let selected = super::select_backend(&cfg)?;
    crate::with_backend!(selected, b => run_on(&cfg, demo, method, b, started))
}

/// [`run`] on a chosen backend.
fn run_on<B: Backend + Clone>(
    cfg: &Config,
    demo: Demo,
    method: Method,
    backend: B,
    started: std::time::Instant,
) -> Result<(), TrainError> {
    let cfg = cfg.clone();
    eprintln!(
        "ares-runner {} ({}) on {}: {}; `ares-runner train -c config.yaml` trains your own \
         model",
        demo.prefix(),
        method.name(),
        backend.name(),
        demo.task()
    );
    // the demo owns its run directory: a new demo run replaces the previous one's outputs
    // (unless it is asked to resume it)
    let run = run_dir(&cfg);
    if !cfg.trainer.find_last_checkpoint && run.exists() {
        eprintln!("demo: replacing the previous demo run in {}", run.display());
        std::fs::remove_dir_all(&run).map_err(|e| TrainError::io(&run, e))?;
    }
    let mut phases = PhaseSeconds::default();
    let mut clock = std::time::Instant::now();
    let mut lap = |slot: &mut f64| {
        *slot = clock.elapsed().as_secs_f64();
        clock = std::time::Instant::now();
    };
    warm_start(demo, &cfg, &backend)?;
    lap(&mut phases.warm_start);
    let sft_dir = PathBuf::from(
        cfg.worker
            .actor
            .model
            .model_path
            .clone()
            .unwrap_or_default(),
    );
    let val = cfg.data.val_files.clone().unwrap_or_default();
    eprintln!("demo: evaluating the warm-started model on the held-out problems");
    let before = evaluate_model(&cfg, backend.clone(), &sft_dir, None, &val)?;
    eprint!("{}", format_table(&before));
    lap(&mut phases.eval_before);

    let interrupt = super::interrupt_flag()?;
    let probe = backend.clone();
    let mut trainer = Trainer::new(cfg.clone(), backend, interrupt)?;
    let summary = trainer.run()?;
    lap(&mut phases.rl);
    let val_examples = trainer.val.clone();
    eprintln!("demo: evaluating the trained model on the held-out problems");
    let after = trainer.evaluate(&val_examples)?;
    lap(&mut phases.eval_after);

    let r = &cfg.worker.rollout;
    let decoding = if r.val_temperature() == 0.0 {
        "greedy decoding".to_string()
    } else {
        format!(
            "{} samples per problem at temperature {}",
            r.val_n(),
            r.val_temperature()
        )
    };
    println!(
        "\nARES {} ({}), {} RL steps; held-out problems, {decoding}:\n{}",
        demo.prefix(),
        method.name(),
        summary.steps,
        before_after(&before, &after)
    );
    super::print_op_profile(&probe);
    let plot = run.join("plot.png");
    match crate::plot::plot_metrics(&summary.metrics, &plot, None) {
        Ok(_) => eprintln!("plot: {}", plot.display()),
        Err(e) => eprintln!("warning: no plot: {e}"),
    }
    eprintln!(
        "demo: phases: warm start {:.0} s (assets and SFT; 0 when reused), eval before {:.0} s, \
         RL {:.0} s, eval after {:.0} s",
        phases.warm_start, phases.eval_before, phases.rl, phases.eval_after
    );
    let json = serde_json::to_vec_pretty(&Summary {
        demo: demo.prefix(),
        method: method.name(),
        steps: summary.steps,
        before: &before,
        after: &after,
        seconds: started.elapsed().as_secs_f64(),
        phases,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    /// Every demo × method gives a valid config that selects what the method says, and
    /// command-line overrides still apply on top.
    #[test]
    fn every_demo_and_method_configures() {
        for &demo in Demo::value_variants() {
            for &method in Method::value_variants() {
                let c = config(demo, method, &[]).unwrap();
                let name = format!("{}-{}", demo.prefix(), method.name());
                assert_eq!(c.trainer.experiment_name, name);
                let a = &c.worker.actor;
                assert_eq!(a.forking_tokens.enable, method == Method::Forking, "{name}");
                assert_eq!(
                    a.entropy_bonus.target.is_some(),
                    method == Method::TargetEntropy,
                    "{name}"
                );
                assert_eq!(
                    c.worker.reward.overlong_buffer.enable,
                    method == Method::DapoOverlong,
                    "{name}"
                );
                let (epochs, lr, batch) = demo.sft_schedule();
                assert_eq!(
                    (c.sft.epochs, c.sft.lr, c.sft.batch_size),
                    (epochs, lr, batch),
                    "{name}"
                );
                assert_eq!(c.trainer.max_steps, Some(demo.rl_steps()), "{name}");
                assert_eq!(c.data.max_prompt_length, demo.lengths().0, "{name}");
            }
        }
        let c = config(Demo::Vision, Method::Grpo, &["trainer.max_steps=3".into()]).unwrap();
        assert_eq!(c.trainer.max_steps, Some(3));
        assert!(config(Demo::Text, Method::Ares, &["nope.key=1".into()]).is_err());
    }

    /// The before/after table shows lengths, or calls per answer when a model called.
    #[test]
    fn the_table_shows_calls_when_there_are_any() {
        let row = |accuracy, mean_length, calls_per_response| EvalRow {
            responses: 4,
            accuracy,
            mean_length,
            calls_per_response,
        };
        let report = |r: EvalRow| EvalReport::from([("easy".to_string(), r)]);
        let t = before_after(&report(row(0.5, 30.0, 0.0)), &report(row(0.75, 20.0, 0.0)));
        assert_eq!(
            t,
            "difficulty acc before  acc after   len before    len after\n\
             easy            50.0%      75.0%         30.0         20.0\n"
        );
        let t = before_after(&report(row(0.5, 30.0, 0.25)), &report(row(0.75, 20.0, 1.0)));
        assert_eq!(
            t,
            "difficulty acc before  acc after  calls before   calls after\n\
             easy            50.0%      75.0%          0.25          1.00\n"
        );
    }

    /// A warm start is reused only when it is finished and its record matches the settings.
    #[test]
    fn warm_start_is_reused_only_with_the_same_settings() {
        let dir = std::env::temp_dir().join(format!("ares-warm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sft")).unwrap();
        let record = WarmStartRecord {
            sft_examples: 16,
            epochs: 1,
            batch_size: 4,
            lr: 1e-3,
            max_length: 64,
            seed: 1,
            state_dtype: "f32".into(),
        };
        // no record (a warm start of an older version), then no model, then a match
        std::fs::write(dir.join("sft").join("config.json"), "{}").unwrap();
        assert!(!made_with(&dir, &record));
        std::fs::write(
            dir.join("warmstart.json"),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        assert!(made_with(&dir, &record));
        let int8 = WarmStartRecord {
            state_dtype: "int8".into(),
            ..record.clone()
        };
        assert!(!made_with(&dir, &int8));
        // a record written before the state dtype was recorded: f32 moments
        let old =
            r#"{"sft_examples":16,"epochs":1,"batch_size":4,"lr":0.001,"max_length":64,"seed":1}"#;
        std::fs::write(dir.join("warmstart.json"), old).unwrap();
        assert!(made_with(&dir, &record));
        let other = WarmStartRecord {
            batch_size: 8,
            ..record.clone()
        };
        assert!(!made_with(&dir, &other));
        std::fs::remove_file(dir.join("sft").join("config.json")).unwrap();
        assert!(!made_with(&dir, &record));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
