//! `ares-runner sft`: supervised fine-tuning on prompt/response pairs (the ARES cold-start
//! stage), saving a Hugging Face model directory the RL run starts from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::config::Config;
use crate::data::{Example, SftTarget};
use crate::hf::tensor_files::SaveDtype;
use crate::metrics::{MetricsWriter, Record};
use crate::progress::Progress;
use crate::trainer::TrainError;
use crate::trainer::actor::PromptVision;
use crate::trainer::setup::{ModelFiles, build_actor, eos_ids_of, renderer, run_dir, save_actor};
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

/// Reads supervised pairs from a dataset (JSONL, JSON or Parquet, as RL data): each row's
/// prompt at `data.prompt_key` (text or chat messages), its images and videos at
/// `data.image_key` / `data.video_key` (EasyR1's `<image>` placeholders), and the target
/// response at `sft.response_key` (a text, or a multi-turn trace: a list of messages).
///
/// # Errors
/// Missing file, malformed rows, a missing or blank response or a malformed trace, bad
/// media — naming file, row and key.
pub fn read_sft_pairs(path: &Path, cfg: &Config) -> Result<Vec<(Example, SftTarget)>, TrainError> {
    let keys = crate::data::DataKeys::from_config(&cfg.data);
    let media = crate::data::MediaKeys::from_config(&cfg.data);
    crate::data::load_sft_dataset(path, &keys, &cfg.sft.response_key, &media)
        .map_err(|e| TrainError::Invalid(e.to_string()))
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

/// Fine-tunes the model of `model_dir` on `pairs` (prompt row, target response or
/// multi-turn trace — whose tool turns are rendered through the chat template as a rollout
/// appends them and left out of the loss) and saves it
/// (with the tokenizer and processor files) to `output` — under `worker.actor.model.lora`
/// the pairs alone are trained, and `output` holds the merged model and the adapter as PEFT
/// files in `output/adapter` (for a LoRA run's `lora.adapter_path`); one metrics line per step goes to
/// `metrics` when given. Pairs that show the same images and videos share one processed copy
/// of their pixels.
///
/// # Errors
/// Model, data or I/O errors.
pub fn run_sft<B: Backend + Clone>(
    cfg: &Config,
    backend: B,
    model_dir: &Path,
    pairs: &[(Example, SftTarget)],
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
    // the same picture in many pairs is processed once (a cold start draws pictures with
    // replacement; each would otherwise hold its own copy of the pixels)
    let mut shared: HashMap<String, PromptVision> = HashMap::new();
    for (ex, response) in pairs {
        let ids = renderer.ids(ex, None)?;
        let vision = if ex.has_media() {
            let key = serde_json::to_string(&(&ex.images, &ex.videos))
                .map_err(|e| TrainError::Internal(e.to_string()))?;
            match shared.get(&key) {
                Some(v) => v.clone(),
                None => {
                    let v = renderer.vision(ex)?;
                    shared.insert(key, v.clone());
                    v
                }
            }
        } else {
            None
        };
        let p = renderer.expand(ex, ids, &vision)?;
        let (r, from_model) = match response {
            SftTarget::Text(text) => {
                let mut r = renderer
                    .tokenizer
                    .encode(text, false)
                    .map_err(|e| TrainError::Invalid(format!("tokenizer: {e}")))?;
                r.push(eos_id);
                (r, None)
            }
            SftTarget::Turns(turns) => {
                let (r, mask) = trace_tokens(&renderer, ex, turns, eos_id)?;
                (r, Some(mask))
            }
        };
        if p.len() + r.len() > options.max_length || p.is_empty() {
            dropped += 1;
            continue;
        }
        examples.push(SftExample {
            prompt: p,
            response: r,
            from_model,
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
    // LoRA: fresh pairs (or an adapter's), every base weight frozen
    crate::trainer::setup::add_lora(&mut model, cfg, &files, options.seed)?;
    let mut files = files;
    files.drop_weights(); // saving needs its configs only
    let mut opt = Optimizer {
        adamw: crate::trainer::setup::build_adamw(model.lm(), cfg, None)?,
        grads: model.lm().grads_in(cfg.trainer.grad_dtype())?,
        tower: if model.trains_tower(cfg.worker.actor.model.freeze_vision_tower) {
            model.tower_training(
                cfg.worker.actor.optim.state_dtype.into(),
                cfg.trainer.grad_dtype(),
            )?
        } else {
            None
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
            (options.micro_batch, cfg.worker.actor.padding_free),
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
    // under LoRA: the adapter as PEFT files in `adapter/`, beside the merged model
    let adapter = model.lora_adapter()?;
    model.merge_lora()?;
    save_actor(&model, &files, model_dir, &tmp, SaveDtype::F32)?;
    if let Some(adapter) = adapter {
        let base = std::fs::canonicalize(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
        adapter
            .write(&tmp.join("adapter"), &base.to_string_lossy())
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
    }
    if output.exists() {
        std::fs::remove_dir_all(output).map_err(|e| TrainError::io(output, e))?;
    }
    std::fs::rename(&tmp, output).map_err(|e| TrainError::io(output, e))?;
    Ok(report)
}

/// The tokens of `ex`'s multi-turn trace `turns` after its prompt, and which are the
/// model's ([`crate::tools::episode::trace_tokens`]).
///
/// # Errors
/// A model without a chat template; the template's and tokenizer's errors, naming the row.
fn trace_tokens(
    renderer: &crate::trainer::collect::prompts::PromptRenderer,
    ex: &Example,
    turns: &[serde_json::Value],
    eos_id: u32,
) -> Result<(Vec<u32>, Vec<bool>), TrainError> {
    let at =
        |e: TrainError| TrainError::Invalid(format!("sft row {} ({}): {e}", ex.row, ex.global_id));
    let Some(template) = &renderer.chat else {
        return Err(at(TrainError::Invalid(
            "a multi-turn trace is rendered by the chat template, and the model has none \
             (set data.override_chat_template)"
                .into(),
        )));
    };
    crate::tools::episode::trace_tokens(
        template,
        &renderer.template_inputs.generation(),
        &renderer.tokenizer,
        renderer.messages(ex)?,
        turns,
        eos_id,
    )
    .map_err(at)
}

/// `ares-runner sft`: `sft.train_files` (JSONL with `data.prompt_key` and
/// `sft.response_key`) on `worker.actor.model.model_path`, saved to `<run dir>/sft`.
///
/// # Errors
/// Missing settings or files, and the run's errors.
pub fn sft(cfg: &Config) -> Result<(), TrainError> {
    // several processes would write one run directory at once
    let launch = crate::parallel::launch::LaunchEnv::from_env()
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    if let Some(l) = launch.filter(|l| l.world > 1) {
        return Err(TrainError::Invalid(format!(
            "ares-runner sft runs as one process, and this is rank {} of {} ({:?} launch): \
             start it without torchrun or srun (data parallelism is train's)",
            l.rank, l.world, l.launcher
        )));
    }
    let data = cfg.sft.train_files.as_deref().ok_or_else(|| {
        TrainError::Invalid(
            "sft.train_files is not set: a JSONL file of prompt/response pairs".into(),
        )
    })?;
    let model_dir = cfg
        .worker
        .actor
        .model
        .model_path
        .as_deref()
        .ok_or_else(|| {
            TrainError::Invalid(
                "worker.actor.model.model_path is not set: the model to fine-tune".into(),
            )
        })?;
    let pairs = read_sft_pairs(Path::new(data), cfg)?;
    let out = run_dir(cfg).join("sft");
    let options = SftOptions {
        epochs: cfg.sft.epochs,
        batch_size: cfg.sft.batch_size,
        micro_batch: cfg.worker.actor.micro_batch_size_per_device_for_update,
        lr: cfg.sft.lr,
        max_length: cfg.sft.max_length,
        seed: cfg.data.seed,
    };
    let report = crate::with_backend!(super::select_backend(cfg)?, backend => run_sft(
        cfg,
        backend,
        &crate::data::resolve_model_dir(model_dir).map_err(TrainError::Invalid)?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::demo::model::TinyModelSpec;
    use crate::demo::tools_task::{ToolsDemoOptions, write_tools_demo_assets};

    /// A trace's tool turn is not in the loss: a trace whose mask keeps its first `k`
    /// tokens has the loss and gradient of the response cut after them; its rows read back
    /// as traces, and a malformed trace names its row and what is wrong.
    #[test]
    fn traces_learn_the_models_tokens_only() {
        let dir = tempfile::tempdir().unwrap();
        let a = write_tools_demo_assets(
            dir.path(),
            &ToolsDemoOptions {
                seed: 2,
                train_per_level: 2,
                eval_per_level: 2,
                sft_examples: 16,
                model: TinyModelSpec {
                    hidden: 32,
                    layers: 1,
                    heads: 2,
                    kv_heads: 1,
                    intermediate: 48,
                    ..TinyModelSpec::default()
                },
            },
        )
        .unwrap();
        let yaml = "worker: {rollout: {multi_turn: {enable: true}}}";
        let cfg = Config::from_yaml_str(yaml, "test").unwrap();
        let pairs = read_sft_pairs(&a.sft, &cfg).unwrap();
        assert_eq!(pairs.len(), 16);
        let (ex, turns) = pairs
            .iter()
            .find_map(|(e, t)| match t {
                SftTarget::Turns(t) if t.len() == 3 => Some((e, t.clone())),
                _ => None,
            })
            .expect("a trace with a call");
        let r = renderer(&cfg, &a.model_dir).unwrap();
        let files = ModelFiles::load(&a.model_dir).unwrap();
        let eos = eos_ids_of(files.generation(), &r)[0];
        let prompt = r.ids(ex, None).unwrap();
        let (tokens, mask) = trace_tokens(&r, ex, &turns, eos).unwrap();
        let k = mask.iter().position(|&m| !m).unwrap();
        assert!(
            mask[k..].iter().any(|&m| m),
            "the answer after the tool turn"
        );
        let first_only = SftExample {
            prompt: prompt.clone(),
            response: tokens.clone(),
            from_model: Some((0..tokens.len()).map(|t| t < k).collect()),
            vision: None,
        };
        let cut = SftExample {
            prompt,
            response: tokens[..k].to_vec(),
            from_model: None,
            vision: None,
        };
        let step = |e: &SftExample| {
            let mut model = build_actor(CpuBackend, &files, &cfg).unwrap();
            let mut opt = Optimizer {
                adamw: crate::model::AdamW::with_state_dtype(
                    model.lm(),
                    crate::trainer::setup::adamw_config(&cfg),
                    crate::model::StateDtype::F32,
                )
                .unwrap(),
                grads: model.lm().grads().unwrap(),
                tower: None,
                steps: 0,
            };
            sft_step(&mut model, &mut opt, &[e], (1, true), 0.0, None).unwrap()
        };
        let (masked, plain) = (step(&first_only), step(&cut));
        assert_eq!((masked.tokens, plain.tokens), (k, k));
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * y.abs().max(1.0);
        assert!(close(masked.loss, plain.loss), "{masked:?} vs {plain:?}");
        assert!(
            close(masked.grad_norm, plain.grad_norm),
            "{masked:?} vs {plain:?}"
        );

        let bad = dir.path().join("bad.jsonl");
        for (row, needle) in [
            (r#"{"prompt": "1+1", "response": []}"#, "an empty trace"),
            (
                r#"{"prompt": "1+1", "response": [{"role": "tool", "content": "2"}]}"#,
                "starts and ends with the assistant",
            ),
            (
                r#"{"prompt": "1+1", "response": [{"role": "robot", "content": "2"}]}"#,
                "role \"robot\"",
            ),
            (
                r#"{"prompt": "1+1", "response": [{"role": "assistant", "content": 2}]}"#,
                "no string `content`",
            ),
            (r#"{"prompt": "1+1", "response": 7}"#, "or a trace"),
        ] {
            std::fs::write(&bad, row).unwrap();
            let e = read_sft_pairs(&bad, &cfg).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("response"), "{e}");
        }
        // one assistant turn is a trace too
        std::fs::write(
            &bad,
            r#"{"prompt": "1+1", "response": [{"role": "assistant", "content": "2"}]}"#,
        )
        .unwrap();
        let pairs = read_sft_pairs(&bad, &cfg).unwrap();
        assert!(matches!(&pairs[0].1, SftTarget::Turns(t) if t.len() == 1));
    }
}
