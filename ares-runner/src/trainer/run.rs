//! [`Trainer`]: the RL loop on one backend (ARCHITECTURE.md, *One RL step*) — bootstrap, then
//! per step:
//! rollout with entropies → grading → online filtering with re-generation → ARES
//! controllers → rewards → old/ref log-probs → dynamic KL → advantages → PPO → AdamW —
//! with metrics, checkpoints, resume and clean interruption.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::config::{Config, Logger};
use crate::data::{EpochSampler, Example};
use crate::hf::tensor_files::SaveDtype;
use crate::metrics::{MetricsWriter, PhaseTimes, Record};
use crate::progress::Progress;
use crate::reward::{CallMode, DEFAULT_PYTHON, FunctionSpec, LoggerSetup, PythonWorker};
use crate::tools::episode::EpisodeSettings;
use crate::trainer::TrainError;
use crate::trainer::actor::{Actor, TowerTraining};
use crate::trainer::checkpoints::{CheckpointDir, write_atomic};
use crate::trainer::collect::batch::{Batch, Group};
use crate::trainer::collect::episodes::{
    EpisodeCounts, EpisodeStart, EpisodeTools, rollout_episodes,
};
use crate::trainer::collect::grading::Grader;
use crate::trainer::collect::prompts::{PromptRenderer, graded_system_message};
use crate::trainer::collect::rollout::{
    PromptItem, Response, RolloutParams, decode_responses, encode_responses, rollout_items,
};
use crate::trainer::collect::tokens::TokenBatch;
use crate::trainer::prepare::controllers::{AresSnapshot, AresState};
use crate::trainer::prepare::hwe::hwe_pass_host;
use crate::trainer::prepare::rewards::{FunctionCall, Grade, function_rewards, rewards};
use crate::trainer::prepare::{group_buckets, keep_groups, prepare};
use crate::trainer::report::{Collection, RunCounters, step_record};
use crate::trainer::setup::bootstrap::{BootstrapResult, apply_bootstrap, read_bootstrap};
use crate::trainer::setup::settings::step_settings;
use crate::trainer::setup::settings::{FilterKey, StepSettings};
use crate::trainer::setup::{
    ModelFiles, add_lora, build_actor, build_adamw, build_reference, eos_ids_of, filter_prompts,
    load_examples, lora_settings, renderer, run_dir, save_actor,
};
use crate::trainer::update::{Optimizer, ppo_update};
use crate::vision::model::VisionMoments;
use ares_core::difficulty::{Difficulty, bucket_means};
use ares_core::filter::{is_solved, solved_streak};

/// What `trainer_state.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// RL steps completed.
    pub step: u64,
    /// Optimizer steps taken (the LR schedule's clock).
    pub optimizer_steps: u64,
    /// The data order and position.
    pub sampler: EpochSampler,
    /// τ, targets, α, λ, difficulty per prompt.
    pub ares: AresSnapshot,
    /// Mini-batches skipped for non-finite values so far.
    pub skipped_updates: u64,
    /// Consecutive solved visits per prompt (`drop_solved`).
    pub solved_streaks: BTreeMap<String, u32>,
    /// Prompts removed from training by `drop_solved`.
    pub dropped: BTreeSet<String>,
}

/// The model and data of a run, ready to train.
pub struct Trainer<B: Backend + Clone> {
    /// The resolved configuration.
    pub cfg: Config,
    /// The step settings.
    pub settings: StepSettings,
    /// The run directory (metrics, checkpoints, bootstrap results).
    pub run_dir: PathBuf,
    /// Where the initial model came from (tokenizer files are copied from it).
    pub model_dir: PathBuf,
    pub(super) checkpoint_config: ModelFiles,
    /// The policy.
    pub actor: Actor<B>,
    pub(super) reference: Option<Actor<B>>,
    pub(super) opt: Optimizer<B>,
    /// Prompt rendering.
    pub renderer: PromptRenderer,
    pub(super) grader: Grader,
    /// The Python worker: the reward function (`worker.reward.reward_function`) and the
    /// loggers of `trainer.logger` that run in Python.
    python: Option<PythonWorker>,
    /// Training examples.
    pub train: Vec<Example>,
    /// Rendered training prompts (without graded system messages).
    pub(super) train_ids: Vec<Vec<u32>>,
    /// Evaluation examples.
    pub val: Vec<Example>,
    pub(super) eos_ids: Vec<u32>,
    /// Controller and loop state.
    pub state: TrainerState,
    pub(super) ares: AresState,
    /// RL steps of the whole run.
    pub total_steps: u64,
    pub(super) progress: Progress,
    pub(super) interrupt: Arc<AtomicBool>,
    /// The bootstrap's results are in the state (resumed or reused).
    pub(super) bootstrap_done: bool,
    /// `worker.rollout.multi_turn`: the tools and how the model calls them.
    pub(super) multi_turn: Option<MultiTurn>,
}

/// What a multi-turn rollout runs with.
pub(crate) struct MultiTurn {
    toolbox: crate::tools::ToolBox,
    format: crate::tools::ToolCallFormat,
    max_turns: usize,
    interaction: Option<crate::tools::interaction::Interaction>,
}

impl<B: Backend + Clone> std::fmt::Debug for Trainer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("run_dir", &self.run_dir)
            .field("step", &self.state.step)
            .field("total_steps", &self.total_steps)
            .finish_non_exhaustive()
    }
}

impl<B: Backend + Clone> Trainer<B> {
    /// Prepares a run: loads the model (or the latest checkpoint when `trainer.resume`),
    /// the reference model, the data (length-filtered), the grader and the state.
    /// `interrupt` is set by Ctrl-C; the loop stops after the current step and saves.
    ///
    /// # Errors
    /// Missing or malformed model, data or config values, each named.
    pub fn new(cfg: Config, backend: B, interrupt: Arc<AtomicBool>) -> Result<Self, TrainError> {
        let model_path = cfg.worker.actor.model.model_path.clone().ok_or_else(|| {
            TrainError::Invalid(
                "worker.actor.model.model_path is not set: point it at a Hugging Face model directory \
                 (or run `ares-runner train` without a config for the built-in demo)"
                    .into(),
            )
        })?;
        let train_path = cfg.data.train_files.clone().ok_or_else(|| {
            TrainError::Invalid(
                "data.train_files is not set: point it at a JSONL or Parquet file".into(),
            )
        })?;
        let model_dir = crate::data::resolve_model_dir(&model_path).map_err(TrainError::Invalid)?;
        let run_dir = run_dir(&cfg);
        let renderer = renderer(&cfg, &model_dir)?;
        let multi_turn = multi_turn(&cfg, &renderer)?;
        let grader = Grader::new(&cfg)?;
        let python = start_python_worker(&cfg, &run_dir)?;
        let train = load_examples(&cfg, &train_path)?;
        grader.check(&train, "data.train_files")?;
        let val = match &cfg.data.val_files {
            Some(p) => {
                let v = load_examples(&cfg, p)?;
                grader.check(&v, "data.val_files")?;
                v
            }
            None => Vec::new(),
        };
        let kept = filter_prompts(&cfg, &renderer, train)?;
        let eval_vision_tokens = crate::trainer::setup::most_vision_tokens(&renderer, &val)?;
        let (train, train_ids, vision_tokens) = (kept.examples, kept.ids, kept.vision_tokens);
        let per_epoch = (train.len() / cfg.data.rollout_batch_size).max(1) as u64;
        let total_steps = match cfg.trainer.max_steps {
            Some(s) => s as u64,
            None => per_epoch * cfg.trainer.total_epochs as u64,
        };
        let mut settings = step_settings(&cfg, total_steps)?;

        let lora = lora_settings(&cfg)?;
        // under LoRA the reference policy is the base: the actor with its adapters off
        let separate_reference =
            settings.kl.enabled && (lora.is_none() || cfg.worker.ref_.model_path.is_some());
        // (the plan itself counts no reference copy under LoRA)
        settings.max_kv_blocks = check_memory(
            &cfg,
            &model_dir,
            backend.memory_info(),
            settings.kl.enabled,
            (vision_tokens, eval_vision_tokens),
        )?;
        let initial = ModelFiles::load(&model_dir)?;
        let max_positions = initial.text_config().max_position_embeddings;
        let longest = train_ids.iter().map(Vec::len).max().unwrap_or(0);
        if longest + cfg.data.max_response_length > max_positions {
            return Err(TrainError::Invalid(format!(
                "the longest prompt ({longest} tokens) + data.max_response_length ({}) exceeds \
                 the model's max_position_embeddings ({max_positions}); lower \
                 data.max_response_length or data.max_prompt_length",
                cfg.data.max_response_length
            )));
        }
        let eos_ids = eos_ids_of(initial.generation(), &renderer);
        if eos_ids.is_empty() {
            return Err(TrainError::Invalid(format!(
                "{}: no EOS token (generation_config.json eos_token_id or tokenizer_config.json \
                 eos_token); generation would never stop",
                model_dir.display()
            )));
        }
        let reference = if separate_reference {
            let ref_dir = cfg
                .worker
                .ref_
                .model_path
                .as_deref()
                .map(crate::data::resolve_model_dir)
                .transpose()
                .map_err(TrainError::Invalid)?;
            // (the initial model itself when no other is named: no copy of its files)
            let loaded;
            let ref_files = match &ref_dir {
                Some(d) => {
                    loaded = ModelFiles::load(d)?;
                    &loaded
                }
                None => &initial,
            };
            Some(build_reference(backend.clone(), ref_files, &cfg)?)
        } else {
            None
        };
        let state_dtype = cfg.worker.actor.optim.state_dtype.into();
        let ckdir = CheckpointDir::new(&run_dir);
        let latest = match &cfg.trainer.load_checkpoint_path {
            Some(path) => Some(checkpoint_at(Path::new(path))?),
            None => ckdir.latest()?,
        };
        if let (false, None, Some((step, dir))) = (
            cfg.trainer.find_last_checkpoint,
            &cfg.trainer.load_checkpoint_path,
            &latest,
        ) {
            return Err(TrainError::Invalid(format!(
                "{} already holds a checkpoint of this run (step {step}, {}): set \
                 trainer.find_last_checkpoint=true to continue it, or choose another trainer.experiment_name \
                 or trainer.save_checkpoint_path",
                run_dir.display(),
                dir.display()
            )));
        }
        if let Some((_, dir)) = &latest {
            resumable(dir)?;
        }
        let mut bootstrap_done = false;
        let (actor, opt, state, ares, checkpoint_config) = match latest {
            Some((step, dir)) => {
                let adapter_dir = dir.join(ADAPTER_DIR);
                let (actor, ck) = match (&lora, adapter_dir.is_dir()) {
                    (Some(_), true) => {
                        // LoRA: the base of model_path with the checkpoint's adapter
                        let mut actor = build_actor(backend.clone(), &initial, &cfg)?;
                        let adapter = initial.read_adapter(&adapter_dir)?;
                        actor.load_lora(&adapter)?;
                        let mut ck = initial;
                        ck.drop_weights();
                        (actor, ck)
                    }
                    (None, false) => {
                        drop(initial); // the checkpoint's model is trained
                        let mut ck = ModelFiles::load(&dir.join("model"))?;
                        let actor = build_actor(backend.clone(), &ck, &cfg)?;
                        ck.drop_weights();
                        (actor, ck)
                    }
                    (Some(_), false) => {
                        return Err(TrainError::Invalid(format!(
                            "{} was saved without LoRA (no {ADAPTER_DIR}/): resume it with \
                             worker.actor.model.lora.rank=0, or start a LoRA run from its \
                             model/ as worker.actor.model.model_path",
                            dir.display()
                        )));
                    }
                    (None, true) => {
                        return Err(TrainError::Invalid(format!(
                            "{} holds a LoRA adapter ({ADAPTER_DIR}/): resume it with the \
                             run's worker.actor.model.lora settings (its config.yaml)",
                            dir.display()
                        )));
                    }
                };
                let opt_file = dir.join("optimizer.safetensors");
                let adamw = build_adamw(actor.lm(), &cfg, Some(&opt_file))?;
                let text = std::fs::read_to_string(dir.join(TRAINER_STATE_FILE))
                    .map_err(|e| TrainError::io(dir.join(TRAINER_STATE_FILE), e))?;
                let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
                    TrainError::Invalid(format!(
                        "{}: {e}",
                        dir.join("trainer_state.json").display()
                    ))
                })?;
                if state.step != step {
                    return Err(TrainError::Invalid(format!(
                        "{}: trainer_state.json says step {}, the directory says {step}",
                        dir.display(),
                        state.step
                    )));
                }
                let ares = AresState::restore(&settings, &state.ares)?;
                let grads = actor.lm().grads_in(cfg.trainer.grad_dtype())?;
                eprintln!("resuming from {} (step {step})", dir.display());
                bootstrap_done = true;
                let opt = Optimizer {
                    adamw,
                    grads,
                    tower: resume_tower(&actor, &cfg, &dir)?,
                    steps: state.optimizer_steps,
                };
                (actor, opt, state, ares, ck)
            }
            None => {
                let mut actor = build_actor(backend.clone(), &initial, &cfg)?;
                add_lora(&mut actor, &cfg, &initial, cfg.data.seed)?;
                let mut initial = initial;
                initial.drop_weights(); // before the optimizer's memory is taken
                let adamw = build_adamw(actor.lm(), &cfg, None)?;
                let grads = actor.lm().grads_in(cfg.trainer.grad_dtype())?;
                let mut ares = AresState::new(&settings)?;
                let mut state = TrainerState {
                    step: 0,
                    optimizer_steps: 0,
                    sampler: EpochSampler::new(cfg.data.seed, cfg.data.shuffle),
                    ares: ares.snapshot(),
                    skipped_updates: 0,
                    solved_streaks: BTreeMap::new(),
                    dropped: BTreeSet::new(),
                };
                // resuming a run that stopped before its first checkpoint: its bootstrap
                // is reused; a fresh run computes its own
                if cfg.trainer.find_last_checkpoint
                    && let Some(b) = read_bootstrap(&run_dir)?
                {
                    apply_bootstrap(&mut ares, &b)?;
                    state.ares = ares.snapshot();
                    bootstrap_done = true;
                }
                let opt = Optimizer {
                    adamw,
                    grads,
                    tower: if actor.trains_tower(cfg.worker.actor.model.freeze_vision_tower) {
                        actor.tower_training(state_dtype, cfg.trainer.grad_dtype())?
                    } else {
                        None
                    },
                    steps: 0,
                };
                (actor, opt, state, ares, initial)
            }
        };
        Ok(Self {
            cfg,
            settings,
            run_dir,
            model_dir,
            checkpoint_config,
            actor,
            reference,
            opt,
            renderer,
            grader,
            python,
            train,
            train_ids,
            val,
            eos_ids,
            state,
            ares,
            total_steps,
            progress: Progress::from_env(),
            interrupt,
            bootstrap_done,
            multi_turn,
        })
    }

    /// Makes this trainer one rank of a data-parallel run (every rank calls it, before
    /// the first step, with the same config): the rollout, the scoring and the update's
    /// micro-batches are shared out among the ranks, every decision is taken on the whole
    /// batch by every rank, and the numbers do not depend on the world size (see
    /// [`crate::parallel`]). Only rank 0 writes the run's files, prints step lines, shows
    /// progress and runs the Python loggers; every rank keeps the same state.
    ///
    /// # Errors
    /// The Python worker cannot be restarted without its loggers (ranks other than 0).
    pub fn join(&mut self, ranks: crate::parallel::Ranks) -> Result<(), TrainError> {
        if !ranks.is_first() {
            self.progress = Progress::new(crate::progress::ProgressMode::Off);
            if self
                .python
                .as_ref()
                .is_some_and(|w| !w.loggers().is_empty())
            {
                // the loggers report once, from rank 0; a reward function runs on every rank
                let mut cfg = self.cfg.clone();
                cfg.trainer.logger.retain(|l| !l.is_python());
                self.python = start_python_worker(&cfg, &self.run_dir)?;
            }
        }
        if self.cfg.trainer.zero_stage == 1 {
            let sizes = self.actor.lm().trainable_lens();
            let owners = crate::parallel::shares(&sizes, ranks.world());
            let owned = owners.iter().map(|&r| r == ranks.rank()).collect();
            self.opt.adamw.shard(self.actor.backend(), owned)?;
        }
        self.settings.ranks = Some(ranks);
        Ok(())
    }

    /// Whether the run should stop before its next step: Ctrl-C here, or on any rank of a
    /// data-parallel run (the ranks decide together, so none is left waiting).
    ///
    /// # Errors
    /// The ranks lost each other.
    fn interrupted(&self) -> Result<bool, TrainError> {
        let here = self.interrupt.load(Ordering::SeqCst);
        let Some(ranks) = &self.settings.ranks else {
            return Ok(here);
        };
        let all = ranks.all_gather(vec![u8::from(here)])?;
        Ok(all.iter().any(|b| b.first() == Some(&1)))
    }

    /// Bytes of optimizer moments this process holds for the language model (under
    /// ZeRO-1, its share).
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.opt.adamw.moment_bytes()
    }

    /// Whether this process writes the run's files (rank 0, or no ranks).
    pub fn writes_files(&self) -> bool {
        self.settings
            .ranks
            .as_ref()
            .is_none_or(crate::parallel::Ranks::is_first)
    }

    /// Rollout parameters of round `round` of step `step` (seeds derived from both, so
    /// a resumed run samples what the uninterrupted one would have).
    pub(super) fn rollout_params(&self, step: u64, round: u64) -> RolloutParams {
        let seed = self.settings.rollout_seed
            ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03)
            ^ round.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
        RolloutParams {
            max_new_tokens: self.settings.max_new_tokens,
            eos_ids: self.eos_ids.clone(),
            sampling: self.settings.sampling,
            seed,
            chunk: self.settings.rollout_chunk,
            weight_dtype: self.settings.weight_dtype,
            cuda_graphs: self.settings.cuda_graphs,
            kv_cache_dtype: self.settings.kv_cache_dtype,
            max_kv_blocks: self.settings.max_kv_blocks,
            ranks: self.settings.ranks.clone(),
        }
    }

    /// The prompt items of `indices` for `step` (graded system prompts per sample when
    /// enabled).
    pub(super) fn items(
        &self,
        indices: &[usize],
        step: u64,
    ) -> Result<Vec<PromptItem>, TrainError> {
        let n = self.settings.n;
        let graded = &self.cfg.worker.rollout;
        let mut out = Vec::with_capacity(indices.len());
        for &i in indices {
            let e = &self.train[i];
            // images once per prompt, shared by its samples; placeholders expanded to them
            let vision = self.renderer.vision(e)?;
            let plain = self
                .renderer
                .expand(e, self.train_ids[i].clone(), &vision)?;
            let mut rollout_prompts = Vec::with_capacity(n);
            let mut train_prompt = plain.clone();
            if graded.enable_graded_system_prompt && n > 1 && !e.rubrics.is_empty() {
                for k in 0..n {
                    let msg = graded_system_message(
                        &graded.graded,
                        e,
                        k,
                        n,
                        step,
                        self.total_steps,
                        self.cfg.trainer.seed,
                    )?;
                    let ids = match msg {
                        Some(m) => {
                            let ids = self.renderer.ids(e, Some(&m))?;
                            self.renderer.expand(e, ids, &vision)?
                        }
                        None => plain.clone(),
                    };
                    rollout_prompts.push(ids);
                }
                if graded.graded.graded_prompt_in_training {
                    // one training prompt per group: the first sample's (the fullest reveal)
                    train_prompt = rollout_prompts[0].clone();
                }
            } else {
                rollout_prompts = vec![plain; n];
            }
            out.push(PromptItem {
                example: i,
                global_id: e.global_id.clone(),
                train_prompt,
                rollout_prompts,
                vision,
            });
        }
        Ok(out)
    }

    /// Rolls out `items`' `n` samples: as multi-turn episodes when
    /// `worker.rollout.multi_turn` is on, else one turn each.
    ///
    /// # Errors
    /// Generation, tokenizer and template errors.
    fn roll_out(
        &self,
        items: &[PromptItem],
        n: usize,
        params: &RolloutParams,
        on_progress: impl FnMut(usize),
    ) -> Result<(Vec<Response>, EpisodeCounts), TrainError> {
        let Some(tools) = episode_tools(self.multi_turn.as_ref(), &self.renderer)? else {
            let responses = rollout_items(&self.actor, items, n, params, on_progress)?;
            return Ok((responses, EpisodeCounts::default()));
        };
        let starts = items
            .iter()
            .map(|i| {
                let e = &self.train[i.example];
                Ok(EpisodeStart {
                    messages: self.renderer.messages(e)?,
                    tools_kwargs: e.tools_kwargs.clone(),
                    interaction_kwargs: e.interaction_kwargs.clone(),
                })
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        rollout_episodes(&self.actor, items, &starts, n, params, &tools, on_progress)
    }

    /// `worker.rollout.multi_turn.interaction.reward_weight` (0 without an interaction).
    fn interaction_weight(&self) -> f64 {
        let mt = &self.cfg.worker.rollout.multi_turn;
        mt.interaction
            .as_ref()
            .filter(|_| mt.enable)
            .map_or(0.0, |i| i.reward_weight)
    }

    /// `worker.rollout.multi_turn.call_cost` (0 without episodes).
    fn call_cost(&self) -> f64 {
        let mt = &self.cfg.worker.rollout.multi_turn;
        if mt.enable { mt.call_cost } else { 0.0 }
    }

    /// Decodes and grades item-major responses: the model's tokens (an episode's tool
    /// turns are not its answer).
    pub(super) fn grade(
        &mut self,
        items: &[PromptItem],
        responses: &[Response],
    ) -> Result<(Vec<String>, Vec<Grade>), TrainError> {
        let n = self.settings.n;
        let mut texts = Vec::with_capacity(responses.len());
        let mut grades = Vec::with_capacity(responses.len());
        for (r, resp) in responses.iter().enumerate() {
            let e = &self.train[items[r / n].example];
            let text = self
                .renderer
                .tokenizer
                .decode(&resp.model_tokens(), true)
                .map_err(|err| TrainError::Invalid(format!("tokenizer: {err}")))?;
            let mut grade = self.grader.grade(e, &text)?;
            grade.interaction = self.interaction_weight() * resp.interaction.unwrap_or(0.0);
            grade.tool_cost = -self.call_cost() * resp.tool_calls as f64;
            grades.push(grade);
            texts.push(text);
        }
        Ok((texts, grades))
    }

    /// A `[rows, T]` 0/1 mask of trigger-word tokens (`None` without trigger words).
    fn trigger_mask(&self, batch: &Batch) -> Option<Vec<f32>> {
        if self.settings.trigger_words.is_empty() {
            return None;
        }
        let t = batch.tokens.cols();
        let mut mask = vec![0.0f32; batch.rows() * t];
        for (r, resp) in batch.responses.iter().enumerate() {
            for (j, &id) in resp.tokens.iter().enumerate() {
                let word = self
                    .renderer
                    .tokenizer
                    .decode(&[id], true)
                    .unwrap_or_default()
                    .trim()
                    .to_lowercase();
                if self.settings.trigger_words.contains(&word) {
                    mask[r * t + j] = 1.0;
                }
            }
        }
        Some(mask)
    }

    /// Draws the next `count` training prompts, skipping prompts dropped as solved.
    fn next_indices(&mut self, count: usize) -> Result<Vec<usize>, TrainError> {
        let len = self.train.len();
        if self.state.dropped.len() >= len {
            return Err(TrainError::Invalid(
                "every training prompt was dropped as solved (algorithm.drop_solved)".into(),
            ));
        }
        let mut out = Vec::with_capacity(count);
        // bounded: at most a few epochs of draws
        for _ in 0..(4 * len / count.max(1) + 4) {
            let batch = self
                .state
                .sampler
                .next_batch(len, count)
                .map_err(|e| TrainError::Invalid(e.to_string()))?;
            out.extend(
                batch
                    .into_iter()
                    .filter(|&i| !self.state.dropped.contains(&self.train[i].global_id)),
            );
            if out.len() >= count {
                out.truncate(count);
                return Ok(out);
            }
        }
        Ok(out)
    }

    /// One RL step; returns its metrics. Reads as the data flows: rollout → grading →
    /// online filtering (with re-generation) → ARES controllers → rewards → log-probs and
    /// KL → advantages → PPO update → metrics.
    ///
    /// # Errors
    /// Any error of the step's phases (non-finite updates are skipped, not errors).
    pub fn step(&mut self) -> Result<Record, TrainError> {
        let step = self.state.step + 1;
        let mut times = PhaseTimes::new();
        let started = Instant::now();

        // rollout, grading and online filtering with re-generation (docs/algorithms.md §7)
        let (groups, collection) = self.collect_groups(step, &mut times)?;
        let batch = Batch::new(self.settings.n, groups)?;

        // controllers, rewards, log-probs, KL, advantages (docs/algorithms.md §1–§5)
        let t = Instant::now();
        let trigger = self.trigger_mask(&batch);
        let answers = ground_truths(&self.train, &batch.items, batch.n);
        let entropies = mean_entropies(&batch.responses);
        let function = self
            .python
            .as_mut()
            .filter(|w| w.has_function())
            .map(|function| FunctionCall {
                function,
                texts: &batch.texts,
                ground_truths: &answers,
                mean_entropies: &entropies,
            });
        let prep = prepare(
            &self.settings,
            &mut self.ares,
            step,
            &batch,
            trigger.as_deref(),
            &self.actor,
            self.reference.as_ref(),
            function,
        )?;
        times.add("prepare", t.elapsed());
        // the Python reward function's share of the step (filtering and final rewards)
        if let Some(w) = self.python.as_mut().filter(|w| w.has_function()) {
            times.add("reward_function", w.take_elapsed());
        }

        // PPO epochs and AdamW
        let t = Instant::now();
        let minis = batch.rows().div_ceil(self.settings.mini_batch) * self.settings.ppo_epochs;
        let bar = self.progress.bar(minis as u64, "update");
        let update = ppo_update(
            &self.settings,
            &batch,
            &prep,
            &mut self.actor,
            &mut self.opt,
            |done, _| bar.set_position(done as u64),
        )?;
        bar.finish();
        times.add("update", t.elapsed());

        // the ranks' share of the step: collective operations, waiting included
        let traffic = self
            .settings
            .ranks
            .as_ref()
            .map(crate::parallel::Ranks::take_traffic);
        if let Some(t) = traffic {
            times.add("collective", t.time);
        }

        self.state.step = step;
        self.state.optimizer_steps = self.opt.steps;
        self.state.skipped_updates += update.skipped as u64;
        self.state.ares = self.ares.snapshot();
        let counters = RunCounters {
            epoch: self.state.sampler.epoch(),
            skipped_updates: self.state.skipped_updates,
            dropped_solved: self.state.dropped.len(),
        };
        let mut record = step_record(
            step,
            &batch,
            &prep,
            &self.ares,
            &update,
            &collection,
            &counters,
            &times,
            started.elapsed(),
        );
        if let Some(t) = traffic {
            record.insert("perf/collective_bytes_sent", t.bytes_sent as f64);
            record.insert("perf/collective_ops", t.operations as f64);
            record.insert("perf/collective_overlapped_ops", t.overlapped as f64);
        }
        Ok(record)
    }

    /// Rounds of `groups_per_round` prompts, rolled out and graded, until `groups_per_step`
    /// groups pass the online filter (every group passes without one), or
    /// `trainer.max_try_make_batch` rounds are used up; surplus groups of the last round are
    /// dropped, as EasyR1 drops them.
    ///
    /// # Errors
    /// [`TrainError::FilterExhausted`], or any generation or grading error.
    fn collect_groups(
        &mut self,
        step: u64,
        times: &mut PhaseTimes,
    ) -> Result<(Vec<Group>, Collection), TrainError> {
        let (n, wanted) = (self.settings.n, self.settings.groups_per_step);
        let mut kept: Vec<Group> = Vec::with_capacity(wanted);
        let mut c = Collection::default();
        while kept.len() < wanted {
            c.rounds += 1;
            let max_tries = self.settings.max_tries;
            if max_tries > 0 && c.rounds > max_tries as u64 {
                return Err(TrainError::FilterExhausted {
                    kept: kept.len(),
                    wanted,
                    tries: max_tries,
                    filtering: self.settings.filter.is_some(),
                });
            }
            let indices = self.next_indices(self.settings.groups_per_round)?;
            let items = self.items(&indices, step)?;
            let params = self.rollout_params(step, c.rounds);
            let bar = self.progress.bar((items.len() * n) as u64, "rollout");
            let t = Instant::now();
            let (responses, episodes) =
                self.roll_out(&items, n, &params, |d| bar.set_position(d as u64))?;
            c.episodes.add(&episodes);
            bar.finish();
            c.rollout_secs += t.elapsed().as_secs_f64();
            c.generated_tokens += responses.iter().map(|r| r.tokens.len()).sum::<usize>();
            c.generated_groups += items.len();
            let t = Instant::now();
            let (texts, grades) = self.grade(&items, &responses)?;
            times.add("reward", t.elapsed());
            self.track_solved(&items, &responses, &grades)?;
            let keep = self.keep(&items, &responses, &texts, &grades)?;
            let (mut resp, mut txt, mut grd) =
                (responses.into_iter(), texts.into_iter(), grades.into_iter());
            for (item, k) in items.into_iter().zip(keep) {
                let group = Group {
                    item,
                    responses: resp.by_ref().take(n).collect(),
                    texts: txt.by_ref().take(n).collect(),
                    grades: grd.by_ref().take(n).collect(),
                };
                if k && kept.len() < wanted {
                    kept.push(group);
                }
            }
        }
        times.add(
            "rollout",
            std::time::Duration::from_secs_f64(c.rollout_secs),
        );
        Ok((kept, c))
    }

    /// Online filtering of one round: which groups are kept.
    fn keep(
        &mut self,
        items: &[PromptItem],
        responses: &[Response],
        texts: &[String],
        grades: &[Grade],
    ) -> Result<Vec<bool>, TrainError> {
        let n = self.settings.n;
        let Some(f) = self.settings.filter else {
            return Ok(vec![true; grades.len() / n]);
        };
        if f.key == FilterKey::Accuracy {
            return keep_groups(&self.settings, n, grades, None);
        }
        // reward keys: provisional rewards under the controllers in force
        let lengths: Vec<usize> = responses.iter().map(Response::model_len).collect();
        let pass = responses_hwe(
            self.actor.backend(),
            responses,
            &self.settings,
            self.ares.tau.tau(),
        )?;
        let buckets = group_buckets(&self.settings, n, grades)?;
        let values = self.ares.bucket_values();
        let mut parts = rewards(
            &self.settings.reward,
            n,
            grades,
            &pass.counts,
            &lengths,
            &buckets,
            &values,
        )?;
        let answers = ground_truths(&self.train, items, n);
        let entropies = mean_entropies(responses);
        if let Some(function) = self.python.as_mut().filter(|w| w.has_function()) {
            let call = FunctionCall {
                function,
                texts,
                ground_truths: &answers,
                mean_entropies: &entropies,
            };
            function_rewards(
                call,
                n,
                &mut parts,
                &pass.counts,
                &lengths,
                &buckets,
                &values,
            )?;
        }
        keep_groups(&self.settings, n, grades, Some(&parts))
    }

    /// `drop_solved` (docs/algorithms.md §7): a prompt all-correct with mean token entropy below
    /// the threshold for `consecutive` visits in a row leaves the training set (ares-core's
    /// [`solved_streak`] and [`is_solved`]).
    ///
    /// # Errors
    /// A non-finite mean entropy or threshold.
    fn track_solved(
        &mut self,
        items: &[PromptItem],
        responses: &[Response],
        grades: &[Grade],
    ) -> Result<(), TrainError> {
        let ds = &self.cfg.algorithm.drop_solved;
        if !ds.enable {
            return Ok(());
        }
        let consecutive = u32::try_from(ds.consecutive).unwrap_or(u32::MAX);
        let n = self.settings.n;
        for (g, item) in items.iter().enumerate() {
            let rows = g * n..(g + 1) * n;
            let all_correct = grades[rows.clone()].iter().all(|x| x.correct);
            let (s, k) = responses[rows].iter().fold((0.0f64, 0usize), |(s, k), r| {
                (
                    s + r.model_entropies().map(f64::from).sum::<f64>(),
                    k + r.model_len(),
                )
            });
            let mean_entropy = if k > 0 { s / k as f64 } else { 0.0 };
            let streak = self
                .state
                .solved_streaks
                .entry(item.global_id.clone())
                .or_default();
            *streak = solved_streak(*streak, all_correct, mean_entropy, ds.entropy_threshold)?;
            if is_solved(*streak, consecutive) {
                self.state.dropped.insert(item.global_id.clone());
            }
        }
        Ok(())
    }

    /// Saves a checkpoint of the current step (model + tokenizer, or under LoRA the
    /// adapter as PEFT files in `adapter/`; optimizer, trainer state; the model only with
    /// `trainer.save_model_only`), atomically, keeping the newest `trainer.save_limit`.
    ///
    /// # Errors
    /// I/O or serialisation errors.
    pub fn save(&self) -> Result<PathBuf, TrainError> {
        let dtype = match self.cfg.trainer.save_dtype {
            crate::config::SaveDtypeCfg::F32 => SaveDtype::F32,
            crate::config::SaveDtypeCfg::Bf16 => SaveDtype::Bf16,
        };
        let ckdir = CheckpointDir::new(&self.run_dir);
        // ZeRO-1: every rank sends its moments; rank 0 writes the whole optimizer
        let gathered = match (&self.settings.ranks, self.opt.adamw.owned()) {
            (Some(ranks), Some(_)) => Some(crate::trainer::update::zero::gather_moments(
                ranks,
                self.actor.lm(),
                &self.opt.adamw,
            )?),
            _ => None,
        };
        if !self.writes_files() {
            // rank 0 saves; every rank holds the same state
            return Ok(ckdir.path_of(self.state.step));
        }
        ckdir.save(self.state.step, self.cfg.trainer.save_limit, |dir| {
            match self.actor.lora_adapter()? {
                // LoRA: the adapter as PEFT files; the base is model_path's
                Some(adapter) => {
                    let base = std::fs::canonicalize(&self.model_dir)
                        .unwrap_or_else(|_| self.model_dir.clone());
                    adapter
                        .write(&dir.join(ADAPTER_DIR), &base.to_string_lossy())
                        .map_err(|e| TrainError::Invalid(e.to_string()))?
                }
                None => save_actor(
                    &self.actor,
                    &self.checkpoint_config,
                    &self.model_dir,
                    &dir.join("model"),
                    dtype,
                )?,
            }
            write_atomic(&dir.join("config.yaml"), self.cfg.to_yaml().as_bytes())?;
            if self.cfg.trainer.save_model_only {
                return Ok(());
            }
            let opt_file = dir.join("optimizer.safetensors");
            match &gathered {
                Some(g) => self
                    .opt
                    .adamw
                    .save_with(self.actor.lm(), &opt_file, |b, i| {
                        crate::trainer::update::zero::from_gathered(g, b, i)
                    })?,
                None => self.opt.adamw.save(self.actor.lm(), &opt_file)?,
            }
            if let (Some(t), Some(vl)) = (&self.opt.tower, self.actor.vision()) {
                t.moments
                    .save(vl.backend(), vl.tower(), &dir.join(VISION_OPTIMIZER_FILE))?;
            }
            let state = serde_json::to_vec_pretty(&self.state)
                .map_err(|e| TrainError::Internal(format!("trainer_state.json: {e}")))?;
            write_atomic(&dir.join(TRAINER_STATE_FILE), &state)
        })
    }

    /// Evaluates the current policy on `examples` (validation settings of the config).
    ///
    /// # Errors
    /// As [`crate::trainer::eval::evaluate`].
    pub fn evaluate(
        &mut self,
        examples: &[Example],
    ) -> Result<crate::trainer::eval::EvalReport, TrainError> {
        let r = &self.cfg.worker.rollout;
        let sampling = crate::trainer::setup::settings::validation_sampling(&self.cfg);
        let params = RolloutParams {
            max_new_tokens: self.settings.max_new_tokens,
            eos_ids: self.eos_ids.clone(),
            sampling,
            seed: self.cfg.trainer.seed,
            chunk: self.settings.rollout_chunk,
            weight_dtype: self.settings.weight_dtype,
            cuda_graphs: self.settings.cuda_graphs,
            kv_cache_dtype: self.settings.kv_cache_dtype,
            max_kv_blocks: self.settings.max_kv_blocks,
            ranks: self.settings.ranks.clone(),
        };
        let n = r.val_n();
        let to_log = self.cfg.trainer.val_generations_to_log;
        let logging = to_log > 0
            && self
                .python
                .as_ref()
                .is_some_and(|w| !w.loggers().is_empty());
        let mut generations = Vec::new();
        let bar = self.progress.bar((examples.len() * n) as u64, "eval");
        let tools = episode_tools(self.multi_turn.as_ref(), &self.renderer)?;
        let report = crate::trainer::eval::evaluate(
            &self.actor,
            &self.renderer,
            tools.as_ref(),
            &mut self.grader,
            examples,
            n,
            &params,
            |d| bar.set_position(d as u64),
            logging.then_some(&mut generations),
        )?;
        bar.finish();
        if let Some(w) = self.python.as_mut().filter(|_| logging) {
            let picked = crate::trainer::eval::pick_generations(generations, to_log);
            if let Err(e) = w.log_generations(self.state.step, &picked) {
                eprintln!("warning: validation generations: {e}");
            }
        }
        Ok(report)
    }

    /// The whole run: bootstrap, steps until `total_steps` (or an interrupt), periodic
    /// validation and checkpoints, a final checkpoint. Metrics go to
    /// `<run_dir>/metrics.jsonl`, one line per step.
    ///
    /// # Errors
    /// Any step's error (the last checkpoint stays intact).
    pub fn run(&mut self) -> Result<RunSummary, TrainError> {
        let writes = self.writes_files();
        let metrics_path = self.run_dir.join("metrics.jsonl");
        let mut writer = if writes {
            std::fs::create_dir_all(&self.run_dir).map_err(|e| TrainError::io(&self.run_dir, e))?;
            write_atomic(
                &self.run_dir.join("config.yaml"),
                self.cfg.to_yaml().as_bytes(),
            )?;
            let w = if self.state.step > 0 {
                MetricsWriter::resume(&metrics_path, self.state.step)
            } else {
                MetricsWriter::create(&metrics_path, false)
            };
            Some(w.map_err(|e| TrainError::Invalid(e.to_string()))?)
        } else {
            None
        };
        if let Some(b) = self.bootstrap()?.filter(|_| writes) {
            eprintln!(
                "bootstrap: {} responses, accuracy {:.1}%, τ = {}, targets {:?}",
                b.responses,
                100.0 * b.accuracy,
                b.tau.map_or("none".into(), |t| format!("{t:.4}")),
                b.targets
            );
        }
        let save_freq = self.cfg.trainer.save_freq as u64;
        let val_freq = self.cfg.trainer.val_freq as u64;
        let mut interrupted = false;
        // (step, path) of this run's last save: every rank decides the same from it
        let mut last_saved: Option<(u64, PathBuf)> = None;
        while self.state.step < self.total_steps {
            if self.interrupted()? {
                interrupted = true;
                break;
            }
            let mut record = self.step()?;
            if val_freq > 0 && self.state.step.is_multiple_of(val_freq) && !self.val.is_empty() {
                let val = self.val.clone();
                let report = self.evaluate(&val)?;
                for (k, row) in &report {
                    record.insert(format!("eval/accuracy/{k}"), row.accuracy);
                    record.insert(format!("eval/response_length/{k}"), row.mean_length);
                }
            }
            if let Some(w) = writer.as_mut() {
                w.write(&record)
                    .map_err(|e| TrainError::Invalid(e.to_string()))?;
            }
            if writes && self.cfg.trainer.logger.contains(&Logger::Console) {
                eprintln!("{}", step_line(&record, self.state.step, self.total_steps));
            }
            if let Some(w) = self.python.as_mut().filter(|_| writes)
                && let Err(e) = w.log(self.state.step, record.as_map())
            {
                // a logger's failure is reported, and training goes on
                eprintln!("warning: step {}: {e}", self.state.step);
            }
            if save_freq > 0 && self.state.step.is_multiple_of(save_freq) {
                last_saved = Some((self.state.step, self.save()?));
            }
        }
        if let Some(mut w) = writer {
            w.sync().map_err(|e| TrainError::Invalid(e.to_string()))?;
        }
        if let Some(w) = self.python.as_mut()
            && let Err(e) = w.finish()
        {
            eprintln!("warning: closing the loggers: {e}");
        }
        // a save every rank makes (ZeRO-1 gathers the moments for it)
        let final_checkpoint = match last_saved {
            Some((step, path)) if step == self.state.step => Some(path),
            _ if self.state.step > 0 => Some(self.save()?),
            _ => None,
        };
        Ok(RunSummary {
            steps: self.state.step,
            interrupted,
            metrics: metrics_path,
            checkpoint: final_checkpoint,
            skipped_updates: self.state.skipped_updates,
        })
    }
}

/// Starts the Python worker when the config needs one: a reward function
/// (`worker.reward.reward_function`) or a logger that runs in Python (`trainer.logger`).
///
/// # Errors
/// The function cannot be started or imported, or a logger's package is missing (the
/// message has the Python traceback).
fn start_python_worker(cfg: &Config, run_dir: &Path) -> Result<Option<PythonWorker>, TrainError> {
    let r = &cfg.worker.reward;
    let names: Vec<String> = cfg
        .trainer
        .logger
        .iter()
        .filter(|l| l.is_python())
        .map(|l| l.name().to_string())
        .collect();
    if r.reward_function.is_none() && names.is_empty() {
        return Ok(None);
    }
    let kwargs = r.reward_function_kwargs.clone().unwrap_or_default();
    let function = r.reward_function.as_deref().map(|spec| FunctionSpec {
        spec,
        kwargs: &kwargs,
        mode: r.reward_type.map(|t| match t {
            crate::config::RewardType::Batch => CallMode::Batch,
            crate::config::RewardType::Sequential => CallMode::Sequential,
        }),
    });
    let loggers = (!names.is_empty())
        .then(|| -> Result<LoggerSetup, TrainError> {
            std::fs::create_dir_all(run_dir).map_err(|e| TrainError::io(run_dir, e))?;
            let config = serde_json::to_value(cfg)
                .map_err(|e| TrainError::Internal(format!("config as JSON: {e}")))?;
            Ok(LoggerSetup {
                names: names.clone(),
                project: cfg.trainer.project_name.clone(),
                experiment: cfg.trainer.experiment_name.clone(),
                config,
                run_dir: std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf()),
                wandb_run_id: cfg.trainer.wandb_run_id.clone(),
            })
        })
        .transpose()?;
    let python = r.python.as_deref().unwrap_or(DEFAULT_PYTHON);
    let t = Instant::now();
    let worker = PythonWorker::start(
        python,
        function,
        loggers.as_ref(),
        std::time::Duration::from_secs_f64(r.timeout_s),
    )
    .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let what = [
        r.reward_function.as_ref().map(|spec| {
            format!(
                "reward function {spec} ({} calls)",
                match worker.mode() {
                    CallMode::Batch => "batch",
                    CallMode::Sequential => "sequential",
                }
            )
        }),
        (!names.is_empty()).then(|| format!("loggers {}", worker.loggers().join(", "))),
    ];
    eprintln!(
        "python worker ({python}): {}; started in {:.2} s",
        what.into_iter().flatten().collect::<Vec<_>>().join(", "),
        t.elapsed().as_secs_f64()
    );
    Ok(Some(worker))
}

/// What episodes run with (None without `worker.rollout.multi_turn`).
///
/// # Errors
/// Episodes without a chat template (refused at start already).
pub(crate) fn episode_tools<'a>(
    mt: Option<&'a MultiTurn>,
    renderer: &'a PromptRenderer,
) -> Result<Option<EpisodeTools<'a>>, TrainError> {
    let Some(mt) = mt else {
        return Ok(None);
    };
    let chat = renderer
        .chat
        .as_ref()
        .ok_or_else(|| TrainError::Internal("multi-turn without a chat template".into()))?;
    Ok(Some(EpisodeTools {
        settings: EpisodeSettings {
            template: chat,
            options: renderer.template_inputs.generation(),
            format: mt.format,
            toolbox: &mt.toolbox,
            max_turns: mt.max_turns,
            interaction: mt.interaction.as_ref(),
        },
        tokenizer: &renderer.tokenizer,
    }))
}

/// The tools and call format of `worker.rollout.multi_turn` (None when off).
///
/// # Errors
/// Episodes without a chat template, or with one that shows no tool-call format.
pub(crate) fn multi_turn(
    cfg: &Config,
    renderer: &PromptRenderer,
) -> Result<Option<MultiTurn>, TrainError> {
    let mt = &cfg.worker.rollout.multi_turn;
    if !mt.enable {
        return Ok(None);
    }
    let chat = renderer.chat.as_ref().ok_or_else(|| {
        TrainError::Invalid(
            "worker.rollout.multi_turn.enable: the model has no chat template to render tool \
             turns with (set data.override_chat_template)"
                .into(),
        )
    })?;
    let source = chat
        .source(true)
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let format = crate::tools::ToolCallFormat::of_template(source).ok_or_else(|| {
        TrainError::Invalid(
            "worker.rollout.multi_turn.enable: the chat template shows no tool-call format \
             (neither <tool_call> nor Llama 3's JSON calls), so the model's calls cannot be read"
                .into(),
        )
    })?;
    let interaction = match &mt.interaction {
        None => None,
        Some(i) => Some(
            crate::tools::interaction::Interaction::new(
                &i.command,
                std::time::Duration::from_secs_f64(i.timeout_s),
                i.max_concurrency,
            )
            .map_err(|e| {
                TrainError::Invalid(format!(
                    "worker.rollout.multi_turn.interaction.command: {e}"
                ))
            })?,
        ),
    };
    Ok(Some(MultiTurn {
        toolbox: crate::trainer::setup::episode_tools(
            cfg,
            renderer.template_inputs.tools.as_deref(),
        )?,
        format,
        max_turns: mt.max_assistant_turns,
        interaction,
    }))
}

/// The memory plan of a run of `cfg` on the model in `model_dir` ([`crate::trainer::setup::memory`]), from
/// its config files and, for a vision-language model, the most merged image/video tokens
/// one prompt of the data holds (`vision_tokens`; `None`: the tower's activations are left
/// out, the table says so) and one of the validation data (`eval_vision_tokens`: the
/// rollout's bound only; 0 for none).
///
/// # Errors
/// Unreadable model configs.
pub fn memory_plan(
    cfg: &Config,
    model_dir: &Path,
    on_cpu: bool,
    reference: bool,
    vision_tokens: Option<usize>,
    eval_vision_tokens: usize,
) -> Result<crate::trainer::setup::memory::MemoryPlan, TrainError> {
    let invalid = |e: crate::hf::HfError| TrainError::Invalid(e.to_string());
    let (text, vision) = if crate::vision::config::VlConfig::is_vl_dir(model_dir) {
        let vl = crate::vision::config::VlConfig::from_dir(model_dir).map_err(invalid)?;
        (vl.text, Some(vl.vision))
    } else {
        (
            crate::hf::config::ModelConfig::from_dir(model_dir).map_err(invalid)?,
            None,
        )
    };
    let model = crate::trainer::setup::memory::PlanModel {
        text: &text,
        tower_params: vision
            .as_ref()
            .map_or(0, crate::vision::weights::tower_parameters),
        vision: vision.as_ref(),
        vision_tokens: vision_tokens.map(|t| t as u64),
        eval_vision_tokens: eval_vision_tokens as u64,
        on_cpu,
        reference,
    };
    crate::trainer::setup::memory::plan(cfg, model)
}

/// Refuses, before the model is loaded, a CPU run whose memory plan passes this machine's
/// memory ([`crate::trainer::setup::memory`]) even with the rollout's KV pool capped; on a
/// GPU (`device`: its free and total memory) caps the pool to the free memory, or warns when
/// the plan passes it all the same (the GPU plan is not yet checked against measured peaks),
/// and checks the host's share. Returns the KV pool's cap in blocks, if any.
fn check_memory(
    cfg: &Config,
    model_dir: &Path,
    device: Option<(u64, u64)>,
    reference: bool,
    (vision_tokens, eval_vision_tokens): (usize, usize),
) -> Result<Option<usize>, TrainError> {
    use crate::trainer::setup::memory::{Fit, fit};
    let on_cpu = device.is_none();
    let vision = Some(vision_tokens);
    let mut plan = memory_plan(
        cfg,
        model_dir,
        on_cpu,
        reference,
        vision,
        eval_vision_tokens,
    )?;
    let hint = match cfg.worker.rollout.kv_cache_dtype {
        crate::config::KvCacheDtype::F32 => {
            "; worker.rollout.kv_cache_dtype=bf16 fits twice as many"
        }
        crate::config::KvCacheDtype::Bf16 => "",
    };
    let capped = |fit: Fit, place: &str, available: u64| match fit {
        Fit::Whole => None,
        Fit::KvCapped { blocks, sequences } => {
            eprintln!(
                "memory: the rollout's KV cache is capped at {blocks} blocks of 16 tokens to fit \
                 the {} of {place} memory: about {sequences} sequences at their longest at \
                 once, the others waiting or preempted (the same tokens{hint})",
                crate::host_memory::human_bytes(available),
            );
            usize::try_from(blocks).ok()
        }
    };
    let mut cap = None;
    if let Some((free, total)) = device
        && plan.peak() > free
    {
        match fit(&plan, free) {
            Some(f) => cap = capped(f, "free GPU", free),
            None => eprintln!(
                "memory: this run may need up to {} of GPU memory, more than the {} free of {}; \
                 it may run out of memory (ares-runner plan -c … --device cuda shows the plan)",
                crate::host_memory::human_bytes(plan.peak()),
                crate::host_memory::human_bytes(free),
                crate::host_memory::human_bytes(total),
            ),
        }
    }
    if !on_cpu {
        // the GPU's share is the device's; the host reads the checkpoint in f32 first
        let weights = plan.held[0].bytes;
        plan = crate::trainer::setup::memory::MemoryPlan {
            place: "host",
            held: vec![crate::trainer::setup::memory::Part {
                what: "the checkpoint read on the host (f32)".into(),
                bytes: weights,
            }],
            phases: Vec::new(),
            kv: None,
        };
    }
    if let Some((available, source)) =
        crate::host_memory::available_host_memory().map_err(TrainError::Invalid)?
    {
        let f = crate::trainer::setup::memory::check(&plan, available, &source, cfg)?;
        if on_cpu {
            cap = capped(f, "available host", available);
        }
    }
    Ok(cap)
}

/// The reference answer of every row of groups of `n` samples of `items` (of `train`).
fn ground_truths<'a>(train: &'a [Example], items: &[PromptItem], n: usize) -> Vec<&'a str> {
    items
        .iter()
        .flat_map(|item| std::iter::repeat_n(train[item.example].answer.as_str(), n))
        .collect()
}

/// The mean sampled-token entropy of each response.
fn mean_entropies(responses: &[Response]) -> Vec<f64> {
    responses
        .iter()
        .map(|r| {
            let sum: f64 = r.model_entropies().map(f64::from).sum();
            sum / r.model_len().max(1) as f64
        })
        .collect()
}

/// The trainer's state in a checkpoint (absent from a `save_model_only` one).
const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// A LoRA run's checkpoint keeps its adapter here, as PEFT files.
pub const ADAPTER_DIR: &str = "adapter";

/// `(step, dir)` of the checkpoint at `dir` (`trainer.load_checkpoint_path`): the step from
/// its `trainer_state.json`.
///
/// # Errors
/// `dir` is not a checkpoint directory of ares-runner, or cannot be resumed from.
fn checkpoint_at(dir: &Path) -> Result<(u64, PathBuf), TrainError> {
    if !dir.join("model").is_dir() {
        return Err(TrainError::Invalid(format!(
            "trainer.load_checkpoint_path = {}: not a checkpoint directory (expected a \
             checkpoints/step_* directory of an earlier run, with model/ and {TRAINER_STATE_FILE})",
            dir.display()
        )));
    }
    resumable(dir)?;
    let path = dir.join(TRAINER_STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
    Ok((state.step, dir.to_path_buf()))
}

/// Errors unless the checkpoint at `dir` holds what a resume needs (a `save_model_only`
/// checkpoint does not).
fn resumable(dir: &Path) -> Result<(), TrainError> {
    if dir.join(TRAINER_STATE_FILE).is_file() && dir.join("optimizer.safetensors").is_file() {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "{} holds no optimizer and trainer state (saved with trainer.save_model_only?), so \
         training cannot resume from it; start a new run from its weights with \
         worker.actor.model.model_path={} (and another trainer.save_checkpoint_path)",
        dir.display(),
        dir.join("model").display()
    )))
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// Steps completed (in total, across resumes).
    pub steps: u64,
    /// Stopped early by Ctrl-C.
    pub interrupted: bool,
    /// The metrics file.
    pub metrics: PathBuf,
    /// The last checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// Mini-batches skipped for non-finite values.
    pub skipped_updates: u64,
}

/// One log line per step.
fn step_line(r: &Record, step: u64, total: u64) -> String {
    let get = |k: &str| r.get(k).and_then(serde_json::Value::as_f64);
    let f = |k: &str, digits: usize| get(k).map_or("-".to_string(), |v| format!("{v:.digits$}"));
    format!(
        "step {step}/{total}: reward {} acc {} len {} hwe {} τ {} kl {} pg_loss {} grad_norm {} ({}s)",
        f("reward/mean", 3),
        f("accuracy/mean", 3),
        f("response_length/mean", 1),
        f("hwe/count_mean", 2),
        f("tau", 3),
        f("kl/mean", 4),
        f("actor/pg_loss", 4),
        f("actor/grad_norm", 3),
        f("time/step", 1),
    )
}

/// The bootstrap pass (docs/algorithms.md §2): one rollout over the training set without
/// updates; its result is saved as `bootstrap.json` (see [`crate::trainer::setup::bootstrap`]).
impl<B: Backend + Clone> Trainer<B> {
    /// Bootstrap (docs/algorithms.md §2): one rollout over the training set without updates; sets the
    /// first τ, the targets `T_d` and every prompt's difficulty, and saves them as
    /// `bootstrap.json` (reused on resume). Skipped when already done.
    ///
    /// # Errors
    /// Generation, grading or I/O errors.
    pub fn bootstrap(&mut self) -> Result<Option<BootstrapResult>, TrainError> {
        if !self.cfg.data.bootstrap || self.state.step > 0 || self.bootstrap_done {
            return Ok(None);
        }
        let n = self.settings.n;
        let indices: Vec<usize> = (0..self.train.len()).collect();
        let params = self.rollout_params(0, u64::MAX);
        let bar = self.progress.bar((indices.len() * n) as u64, "bootstrap");
        let chunks: Vec<&[usize]> = indices
            .chunks(self.settings.rollout_chunk.max(n) / n.max(1))
            .collect();
        let roll = |c: usize, params: &RolloutParams| -> Result<Vec<Response>, TrainError> {
            let items = self.items(chunks[c], 0)?;
            let base = (c * chunks[0].len() * n) as u64;
            let (responses, _) = self.roll_out(&items, n, params, |d| {
                bar.set_position(base + d as u64);
            })?;
            Ok(responses)
        };
        // each chunk is rolled out alone (its own seed stream), so ranks share them out
        let rolled: Vec<Vec<Response>> = match &params.ranks {
            None => (0..chunks.len())
                .map(|c| roll(c, &params))
                .collect::<Result<_, _>>()?,
            Some(ranks) => {
                let local = RolloutParams {
                    ranks: None,
                    ..params.clone()
                };
                ranks
                    .map_units(chunks.len(), |c| Ok(encode_responses(&roll(c, &local)?)))?
                    .iter()
                    .map(|b| decode_responses(b).map_err(|e| e.at(ranks.rank())))
                    .collect::<Result<_, _>>()?
            }
        };
        bar.set_position((indices.len() * n) as u64);
        let mut all_responses = Vec::new();
        let mut all_grades = Vec::new();
        let mut items_all = Vec::new();
        for (chunk, responses) in chunks.iter().zip(rolled) {
            let items = self.items(chunk, 0)?;
            let (_, grades) = self.grade(&items, &responses)?;
            all_responses.extend(responses);
            all_grades.extend(grades);
            items_all.extend(items);
        }
        bar.finish();
        let pass = responses_hwe(self.actor.backend(), &all_responses, &self.settings, None)?;
        let buckets = group_buckets(&self.settings, n, &all_grades)?;
        // h̄_d over every sample of the bucket's prompts (docs/algorithms.md §2)
        let row_buckets: Vec<Difficulty> = (0..pass.counts.len()).map(|r| buckets[r / n]).collect();
        let counts: Vec<f64> = pass.counts.iter().map(|&c| c as f64).collect();
        let mean_hwe = bucket_means(&row_buckets, &counts)?;
        let mut result = BootstrapResult {
            tau: pass.batch_threshold,
            targets: BTreeMap::new(),
            difficulty: BTreeMap::new(),
            accuracy: all_grades.iter().filter(|g| g.correct).count() as f64
                / all_grades.len().max(1) as f64,
            responses: all_grades.len(),
        };
        for d in Difficulty::ALL {
            if let Some(mean) = mean_hwe[d] {
                result
                    .targets
                    .insert(d.name().into(), ares_core::round_half_even(mean));
            }
        }
        for (item, d) in items_all.iter().zip(&buckets) {
            result
                .difficulty
                .insert(item.global_id.clone(), d.name().into());
        }
        apply_bootstrap(&mut self.ares, &result)?;
        self.state.ares = self.ares.snapshot();
        if self.writes_files() {
            let json = serde_json::to_vec_pretty(&result)
                .map_err(|e| TrainError::Internal(format!("bootstrap.json: {e}")))?;
            write_atomic(&self.run_dir.join("bootstrap.json"), &json)?;
        }
        self.bootstrap_done = true;
        Ok(Some(result))
    }
}

/// HWE tokens of unpadded responses (padded here) under `tau` (`None`: the batch's own
/// threshold), on `backend`'s device.
pub(super) fn responses_hwe<B: Backend>(
    backend: &B,
    responses: &[Response],
    settings: &StepSettings,
    tau: Option<f64>,
) -> Result<crate::trainer::prepare::hwe::HwePass<B>, TrainError> {
    let tokens = TokenBatch::from_responses(responses);
    let ent: Vec<Vec<f32>> = responses.iter().map(|r| r.entropies.clone()).collect();
    let entropies = tokens.pad(&ent, 0.0);
    hwe_pass_host(
        backend,
        tokens.shape,
        &entropies,
        &tokens.mask,
        &settings.hwe,
        tau,
    )
}

/// The vision tower's optimizer moments beside `optimizer.safetensors` in a checkpoint.
const VISION_OPTIMIZER_FILE: &str = "vision_optimizer.safetensors";

/// The tower's training state when resuming from checkpoint `dir`: none for a text model
/// or a frozen tower, else zeroed gradients and the saved moments (of its weights, or of
/// its LoRA pairs).
fn resume_tower<B: Backend>(
    actor: &Actor<B>,
    cfg: &Config,
    dir: &Path,
) -> Result<Option<TowerTraining<B>>, TrainError> {
    let Some(vl) = actor.vision() else {
        return Ok(None);
    };
    if !actor.trains_tower(cfg.worker.actor.model.freeze_vision_tower) {
        return Ok(None);
    }
    let state_dtype = cfg.worker.actor.optim.state_dtype.into();
    let path = dir.join(VISION_OPTIMIZER_FILE);
    if !path.is_file() {
        let fix = if actor.lm().lora_config().is_some() {
            "its adapter has no pairs on the vision tower (resume it with \
             worker.actor.model.lora.exclude_modules=.*visual.*)"
        } else {
            "the checkpoint was saved with a frozen vision tower (set \
             worker.actor.model.freeze_vision_tower=true to resume it)"
        };
        return Err(TrainError::Invalid(format!(
            "{}: missing; {fix}",
            path.display()
        )));
    }
    let mut t = actor
        .tower_training(state_dtype, cfg.trainer.grad_dtype())?
        .ok_or_else(|| TrainError::Internal("a vision model without a tower".into()))?;
    t.moments = VisionMoments::load(vl.backend(), vl.tower(), state_dtype, &path)?;
    Ok(Some(t))
}
