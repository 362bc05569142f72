//! `ares-runner sft`: supervised fine-tuning on prompt/response pairs (the ARES cold-start
//! stage), saving a Hugging Face model directory the RL run starts from.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::config::Config;
use crate::data::{Example, Prompt};
use crate::hf::chat::ChatMessage;
use crate::hf::tensor_files::SaveDtype;
use crate::metrics::{MetricsWriter, Record};
use crate::model::AdamW;
use crate::progress::Progress;
use crate::trainer::TrainError;
use crate::trainer::setup::{
    ModelFiles, adamw_config, build_actor, eos_ids_of, renderer, run_dir, save_actor,
};
use crate::trainer::sft::{SftExample, sft_step};
use crate::trainer::update::Optimizer;

/// How an SFT run went.
#[derive(Debug, Clone, PartialEq)]
pub struct SftReport {
    /// Optimizer steps.
    pub steps: usize,
    /// Mean NLL per token over the first and the last tenth of the steps.
    pub first_loss: f64,
    /// See `first_loss`.
    pub last_loss: f64,
    /// Steps skipped for non-finite values.
    pub skipped: usize,
    /// The saved model directory.
    pub output: PathBuf,
}

/// Reads `prompt`/`response` pairs from a JSONL file (`prompt` as text or chat messages).
///
/// # Errors
/// Missing file, malformed lines, missing keys — naming file and line.
pub fn read_pairs(
    path: &Path,
    prompt_key: &str,
    response_key: &str,
) -> Result<Vec<(Prompt, String)>, TrainError> {
    let file = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| TrainError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| TrainError::Invalid(format!("{}: malformed JSON: {e}", at())))?;
        let prompt = match v.get(prompt_key) {
            Some(serde_json::Value::String(s)) => Prompt::Text(s.clone()),
            Some(m @ serde_json::Value::Array(_)) => Prompt::Messages(
                serde_json::from_value::<Vec<ChatMessage>>(m.clone()).map_err(|e| {
                    TrainError::Invalid(format!("{}: {prompt_key:?} messages: {e}", at()))
                })?,
            ),
            _ => {
                return Err(TrainError::Invalid(format!(
                    "{}: no {prompt_key:?} (text or chat messages)",
                    at()
                )));
            }
        };
        let response = v
            .get(response_key)
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                TrainError::Invalid(format!(
                    "{}: no {response_key:?} text (sft.response_key)",
                    at()
                ))
            })?;
        out.push((prompt, response.to_string()));
    }
    if out.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{}: no examples",
            path.display()
        )));
    }
    Ok(out)
}

/// SFT options.
#[derive(Debug, Clone, PartialEq)]
pub struct SftOptions {
    /// Passes over the data.
    pub epochs: usize,
    /// Examples per optimizer step.
    pub batch_size: usize,
    /// Examples per forward/backward.
    pub micro_batch: usize,
    /// Peak learning rate (linear warm-up over the first 5 % of steps, then cosine to 10 %).
    pub lr: f64,
    /// Longest prompt + response in tokens; longer pairs are dropped.
    pub max_length: usize,
    /// Data order seed.
    pub seed: u64,
}

/// Fine-tunes the model of `model_dir` on `pairs` and saves it (with the tokenizer files)
/// to `output`; one metrics line per step goes to `metrics` when given.
///
/// # Errors
/// Model, data or I/O errors.
pub fn run_sft<B: Backend + Clone>(
    cfg: &Config,
    backend: B,
    model_dir: &Path,
    pairs: &[(Prompt, String)],
    options: &SftOptions,
    output: &Path,
    metrics: Option<&Path>,
) -> Result<SftReport, TrainError> {
    let renderer = renderer(cfg, model_dir)?;
    let files = ModelFiles::load(model_dir)?;
    let eos = eos_ids_of(files.generation(), &renderer);
    let eos_id = *eos.first().ok_or_else(|| {
        TrainError::Invalid(format!(
            "{}: no EOS token to end responses with",
            model_dir.display()
        ))
    })?;
    let mut examples = Vec::with_capacity(pairs.len());
    let mut dropped = 0usize;
    for (i, (prompt, response)) in pairs.iter().enumerate() {
        let ex = Example {
            global_id: format!("sft-{i}"),
            prompt: prompt.clone(),
            answer: String::new(),
            difficulty: None,
            rubrics: Vec::new(),
            row: i,
            images: Vec::new(),
            videos: Vec::new(),
        };
        let (p, vision) = renderer.inputs(&ex, None)?;
        let mut r = renderer
            .tokenizer
            .encode(response, false)
            .map_err(|e| TrainError::Invalid(format!("tokenizer: {e}")))?;
        r.push(eos_id);
        if p.len() + r.len() > options.max_length || p.is_empty() {
            dropped += 1;
            continue;
        }
        examples.push(SftExample {
            prompt: p,
            response: r,
            vision,
        });
    }
    if examples.is_empty() {
        return Err(TrainError::Invalid(format!(
            "sft: every example is longer than sft.max_length = {}",
            options.max_length
        )));
    }
    if dropped > 0 {
        eprintln!(
            "sft: dropped {dropped} examples longer than {} tokens",
            options.max_length
        );
    }
    let mut model = build_actor(backend, &files, cfg)?;
    let mut opt = Optimizer {
        adamw: AdamW::new(model.lm(), adamw_config(cfg))?,
        grads: model.lm().grads()?,
        tower: if cfg.worker.actor.freeze_vision_tower {
            None
        } else {
            model.tower_training()?
        },
        steps: 0,
    };
    let per_epoch = examples.len().div_ceil(options.batch_size.max(1));
    let total = per_epoch * options.epochs.max(1);
    let warmup = (total / 20).max(1);
    let lr_at = |s: usize| -> f64 {
        if s < warmup {
            return options.lr * (s + 1) as f64 / warmup as f64;
        }
        let x = (s - warmup) as f64 / (total - warmup).max(1) as f64;
        let min = 0.1 * options.lr;
        min + (options.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * x).cos())
    };
    let mut writer = metrics
        .map(|p| MetricsWriter::create(p, false).map_err(|e| TrainError::Invalid(e.to_string())))
        .transpose()?;
    let bar = Progress::from_env().bar(total as u64, "sft");
    let mut losses = Vec::with_capacity(total);
    let mut skipped = 0usize;
    let mut sampler = crate::data::EpochSampler::new(options.seed, true);
    for s in 0..total {
        let idx = sampler
            .next_batch(examples.len(), options.batch_size.min(examples.len()))
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        let batch: Vec<&SftExample> = idx.iter().map(|&i| &examples[i]).collect();
        let r = sft_step(
            &mut model,
            &mut opt,
            &batch,
            options.micro_batch,
            lr_at(s),
            Some(cfg.worker.actor.max_grad_norm as f32),
        )?;
        if r.applied {
            losses.push(r.loss);
        } else {
            skipped += 1;
        }
        if let Some(w) = writer.as_mut() {
            let mut rec = Record::with_step(s as u64 + 1);
            rec.insert("sft/loss", r.loss);
            rec.insert("sft/grad_norm", r.grad_norm);
            rec.insert("sft/lr", lr_at(s));
            w.write(&rec)
                .map_err(|e| TrainError::Invalid(e.to_string()))?;
        }
        bar.set_position(s as u64 + 1);
    }
    bar.finish();
    let tenth = (losses.len() / 10).max(1);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let report = SftReport {
        steps: total,
        first_loss: mean(&losses[..tenth.min(losses.len())]),
        last_loss: mean(&losses[losses.len().saturating_sub(tenth)..]),
        skipped,
        output: output.to_path_buf(),
    };
    // atomic: write beside, then rename over
    let tmp = output.with_extension("tmp-sft");
    let _ = std::fs::remove_dir_all(&tmp);
    save_actor(&model, &files, model_dir, &tmp, SaveDtype::F32)?;
    if output.exists() {
        std::fs::remove_dir_all(output).map_err(|e| TrainError::io(output, e))?;
    }
    std::fs::rename(&tmp, output).map_err(|e| TrainError::io(output, e))?;
    Ok(report)
}

/// `ares-runner sft`: `sft.train_files` (JSONL with `data.prompt_key` and
/// `sft.response_key`) on `worker.actor.model_path`, saved to `<run dir>/sft`.
///
/// # Errors
/// Missing settings or files, and the run's errors.
pub fn sft(cfg: &Config) -> Result<(), TrainError> {
    let data = cfg.sft.train_files.as_deref().ok_or_else(|| {
        TrainError::Invalid(
            "sft.train_files is not set: a JSONL file of prompt/response pairs".into(),
        )
    })?;
    let model_dir = cfg.worker.actor.model_path.as_deref().ok_or_else(|| {
        TrainError::Invalid("worker.actor.model_path is not set: the model to fine-tune".into())
    })?;
    let pairs = read_pairs(Path::new(data), &cfg.data.prompt_key, &cfg.sft.response_key)?;
    let out = run_dir(cfg).join("sft");
    let options = SftOptions {
        epochs: cfg.sft.epochs,
        batch_size: cfg.sft.batch_size,
        micro_batch: cfg.worker.actor.micro_batch_size_per_device,
        lr: cfg.sft.lr,
        max_length: cfg.sft.max_length,
        seed: cfg.data.seed,
    };
    let report = crate::with_backend!(super::select_backend(cfg)?, backend => run_sft(
        cfg,
        backend,
        Path::new(model_dir),
        &pairs,
        &options,
        &out,
        Some(&run_dir(cfg).join("sft_metrics.jsonl")),
    ))?;
    eprintln!(
        "sft: {} steps, loss {:.4} → {:.4}, {} skipped; saved {}",
        report.steps,
        report.first_loss,
        report.last_loss,
        report.skipped,
        report.output.display()
    );
    Ok(())
}
