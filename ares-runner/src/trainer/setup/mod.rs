//! Setting a run up from its configuration: the run directory, datasets, the prompt
//! renderer, EOS ids, prompt-length filtering, the optimizer's hyper-parameters, and saving
//! a model with its tokenizer files.

pub mod bootstrap;
pub mod memory;
pub mod settings;

use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::config::Config;
use crate::data::{DataKeys, Example, PromptTemplate};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::config::ModelConfig;
use crate::hf::generation::GenerationConfig;
use crate::hf::tensor_files::SaveDtype;
use crate::model::Model;
use crate::trainer::TrainError;
use crate::trainer::actor::Actor;
use crate::trainer::collect::prompts::PromptRenderer;
use crate::vision::checkpoint::VlCheckpoint;
use crate::vision::config::VlConfig;
use crate::vision::model::VlModel;

/// Files of the tokenizer (and a vision-language model's processor) copied next to every
/// saved model.
pub(crate) const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
];

/// A model directory's contents: a text decoder's checkpoint or a vision-language
/// model's (Qwen2-VL / Qwen2.5-VL, told apart by `config.json`'s `model_type`).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one or two per run
pub enum ModelFiles {
    /// Qwen2 / Qwen3 / Llama.
    Text(Checkpoint),
    /// Qwen2-VL / Qwen2.5-VL.
    Vision(VlCheckpoint),
}

impl ModelFiles {
    /// Loads the model directory `dir`.
    ///
    /// # Errors
    /// Missing or malformed files, each named.
    pub fn load(dir: &Path) -> Result<Self, TrainError> {
        let invalid = |e: crate::hf::HfError| TrainError::Invalid(e.to_string());
        Ok(if VlConfig::is_vl_dir(dir) {
            ModelFiles::Vision(VlCheckpoint::load(dir).map_err(invalid)?)
        } else {
            ModelFiles::Text(Checkpoint::load(dir).map_err(invalid)?)
        })
    }

    /// Merges the PEFT LoRA adapter in `dir` (or in `dir/adapter`, a LoRA run's checkpoint)
    /// into the weights (`hf::lora`: its language model's pairs, as peft's
    /// `merge_and_unload`), and returns it.
    ///
    /// # Errors
    /// The adapter missing, malformed, unsupported or made for another model (named).
    pub fn merge_adapter(
        &mut self,
        dir: &Path,
    ) -> Result<crate::hf::lora::LoraAdapter, TrainError> {
        // a LoRA run's checkpoint holds its adapter in `adapter/`
        let nested = dir.join("adapter");
        let dir = if !dir.join(crate::hf::lora::CONFIG_FILE).exists()
            && nested.join(crate::hf::lora::CONFIG_FILE).is_file()
        {
            nested.as_path()
        } else {
            dir
        };
        let invalid =
            |e: crate::hf::HfError| TrainError::Invalid(format!("adapter {}: {e}", dir.display()));
        let adapter = self.read_adapter(dir)?;
        match self {
            ModelFiles::Text(c) => adapter.merge_into(&mut c.weights).map_err(invalid)?,
            ModelFiles::Vision(c) => {
                adapter.merge_into(&mut c.text).map_err(invalid)?;
                adapter
                    .merge_into_tower(&c.config.vision, &mut c.vision)
                    .map_err(invalid)?;
            }
        }
        Ok(adapter)
    }

    /// Reads the PEFT LoRA adapter in `dir` made for this model (a vision-language model's
    /// may hold pairs on its tower).
    ///
    /// # Errors
    /// The adapter missing, malformed, unsupported or made for another model (named).
    pub fn read_adapter(&self, dir: &Path) -> Result<crate::hf::lora::LoraAdapter, TrainError> {
        use crate::hf::lora::LoraAdapter;
        match self {
            ModelFiles::Text(c) => LoraAdapter::read(dir, &c.config),
            ModelFiles::Vision(c) => LoraAdapter::read_vl(dir, &c.config.text, &c.config.vision),
        }
        .map_err(|e| TrainError::Invalid(format!("adapter {}: {e}", dir.display())))
    }

    /// Frees the weights, keeping the configs and the tensor layout — all that saving the
    /// trained model needs once it is built — so a run does not hold a second f32 copy of
    /// the model on the host.
    pub fn drop_weights(&mut self) {
        let clear = |t: &mut crate::hf::weights::Tensor| t.data = Vec::new();
        match self {
            ModelFiles::Text(c) => c
                .weights
                .tensors_mut()
                .into_iter()
                .for_each(|(_, t)| clear(t)),
            ModelFiles::Vision(c) => {
                c.text.tensors_mut().into_iter().for_each(|(_, t)| clear(t));
                c.vision.values_mut().for_each(clear);
            }
        }
    }

    /// The language model's config.
    pub fn text_config(&self) -> &ModelConfig {
        match self {
            ModelFiles::Text(c) => &c.config,
            ModelFiles::Vision(c) => &c.config.text,
        }
    }

    /// `generation_config.json`, when present.
    pub fn generation(&self) -> Option<&GenerationConfig> {
        match self {
            ModelFiles::Text(c) => c.generation.as_ref(),
            ModelFiles::Vision(c) => c.generation.as_ref(),
        }
    }
}

/// The model of `files` on `backend`, multiplying in `trainer.matmul_precision` (in bf16,
/// with bf16 copies of the decoder's weights where the backend keeps them:
/// `Backend::keeps_bf16_weights`), its decoder checkpointed as
/// `worker.actor.model.enable_gradient_checkpointing` says.
///
/// # Errors
/// As [`Model::from_checkpoint`] and [`VlModel::from_checkpoint`].
pub fn build_actor<B: Backend>(
    backend: B,
    files: &ModelFiles,
    cfg: &Config,
) -> Result<Actor<B>, TrainError> {
    let mut actor = build_reference(backend, files, cfg)?;
    let activations = cfg.activation_dtype();
    match &mut actor {
        Actor::Text(m) => keep_bf16_weights(m, activations)?,
        Actor::Vision(m) => {
            keep_bf16_weights(m.lm_mut(), activations)?;
            // the tower's activations in bf16 where it can (`tower_act_layout`)
            m.tower_mut().set_activation_dtype(activations);
        }
    }
    Ok(actor)
}

/// [`build_actor`] without bf16 weight copies: the reference policy, whose forward passes
/// round the f32 weights per product instead (2 fewer bytes a weight, for a conversion per
/// product of its one forward pass a step). Under `trainer.weight_dtype: bf16` its linear
/// weights are stored in bf16, as the actor's.
///
/// # Errors
/// As [`build_actor`].
pub fn build_reference<B: Backend>(
    backend: B,
    files: &ModelFiles,
    cfg: &Config,
) -> Result<Actor<B>, TrainError> {
    let precision = cfg.trainer.matmul_precision.precision();
    Ok(match files {
        ModelFiles::Text(ck) => Actor::Text(build_model(backend, ck, cfg)?),
        ModelFiles::Vision(ck) => {
            let mut m = VlModel::from_checkpoint(backend, ck)?;
            m.lm_mut().set_matmul_precision(precision);
            m.tower_mut().set_matmul_precision(precision);
            m.set_weight_storage(cfg.trainer.weight_dtype.storage())?;
            let checkpointing = cfg.worker.actor.model.enable_gradient_checkpointing;
            m.lm_mut().set_gradient_checkpointing(checkpointing);
            m.tower_mut().set_gradient_checkpointing(checkpointing);
            Actor::Vision(m)
        }
    })
}

/// AdamW for `model` as the config says (`worker.actor.optim`: hyper-parameters, the
/// moments' dtype; the stochastic rounding of weights stored in bf16 seeded by
/// `trainer.seed`), fresh or, with `state`, loaded from a saved optimizer file.
///
/// # Errors
/// A bad hyper-parameter; a state file that is not this model's; a backend failure.
pub fn build_adamw<B: Backend>(
    model: &Model<B>,
    cfg: &Config,
    state: Option<&Path>,
) -> Result<crate::model::AdamW<B>, TrainError> {
    use crate::model::AdamW;
    let dtype = cfg.worker.actor.optim.state_dtype.into();
    let mut adamw = match state {
        Some(path) => AdamW::load_as(model, adamw_config(cfg), dtype, path)?,
        None => AdamW::with_state_dtype(model, adamw_config(cfg), dtype)?,
    };
    adamw.set_rounding_seed(cfg.trainer.seed);
    Ok(adamw)
}

/// Saves `actor` as a Hugging Face directory (the layout and configs of `files`) with the
/// tokenizer and processor files of `source_dir`.
///
/// # Errors
/// I/O errors.
pub fn save_actor<B: Backend>(
    actor: &Actor<B>,
    files: &ModelFiles,
    source_dir: &Path,
    dir: &Path,
    dtype: SaveDtype,
) -> Result<(), TrainError> {
    match (actor, files) {
        (Actor::Text(m), ModelFiles::Text(ck)) => {
            m.save_pretrained(dir, &ck.config, ck.generation.as_ref(), dtype)?;
        }
        (Actor::Vision(m), ModelFiles::Vision(ck)) => {
            m.to_checkpoint(ck)?
                .save(dir, dtype, ck.layout)
                .map_err(|e| TrainError::Invalid(e.to_string()))?;
        }
        _ => {
            return Err(TrainError::Internal(
                "save_actor: the model and its files are of different kinds".into(),
            ));
        }
    }
    copy_tokenizer_files(source_dir, dir)
}

pub(crate) fn copy_tokenizer_files(source_dir: &Path, dir: &Path) -> Result<(), TrainError> {
    for name in TOKENIZER_FILES {
        let src = source_dir.join(name);
        if src.exists() {
            std::fs::copy(&src, dir.join(name)).map_err(|e| TrainError::io(&src, e))?;
        }
    }
    Ok(())
}

/// The model of `ckpt` on `backend`, multiplying in `trainer.matmul_precision`.
///
/// # Errors
/// As [`Model::from_checkpoint`].
pub fn build_model<B: Backend>(
    backend: B,
    ckpt: &Checkpoint,
    cfg: &Config,
) -> Result<Model<B>, TrainError> {
    let mut model = Model::from_checkpoint(backend, ckpt)?;
    model.set_matmul_precision(cfg.trainer.matmul_precision.precision());
    model.set_weight_storage(cfg.trainer.weight_dtype.storage())?;
    model.set_gradient_checkpointing(cfg.worker.actor.model.enable_gradient_checkpointing);
    Ok(model)
}

/// Gives `model` bf16 copies of its weights when it multiplies in bf16 on a backend where
/// they pay (`Backend::keeps_bf16_weights`: the GPU's products then skip converting each
/// weight) or its MLP's activations are stored in bf16 (`activations`, whose products read
/// bf16 weights) and its weights are not, and stores its training activations so.
fn keep_bf16_weights<B: Backend>(
    model: &mut Model<B>,
    activations: crate::model::ActivationDtype,
) -> Result<(), TrainError> {
    let bf16 = model.matmul_precision() == crate::backend::MatmulPrecision::Bf16;
    let stored = model.weight_storage() == crate::model::WeightStorage::Bf16;
    let act16 = activations == crate::model::ActivationDtype::Bf16;
    if bf16 && (model.backend().keeps_bf16_weights() || (act16 && !stored)) {
        model.set_bf16_weights(true)?;
    }
    model.set_activation_dtype(activations);
    Ok(())
}

/// Loads a dataset with the config's keys.
///
/// # Errors
/// Missing file, malformed rows, empty dataset.
pub fn load_examples(cfg: &Config, path: &str) -> Result<Vec<Example>, TrainError> {
    let keys = DataKeys {
        prompt: cfg.data.prompt_key.clone(),
        answer: cfg.data.answer_key.clone(),
        difficulty: cfg.data.difficulty_key.clone(),
        global_id: cfg.data.global_id_key.clone(),
        rubrics: cfg.data.rubrics_key.clone(),
    };
    let media = crate::data::MediaKeys::from_config(&cfg.data);
    let examples = crate::data::load_dataset_with_media(Path::new(path), &keys, &media)
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let limit = cfg.worker.rollout.limit_images;
    if let Some(e) = examples
        .iter()
        .find(|e| limit > 0 && e.images.len() > limit)
    {
        return Err(TrainError::Invalid(format!(
            "{path}: row {} ({}) has {} images, more than worker.rollout.limit_images = {limit}",
            e.row,
            e.global_id,
            e.images.len()
        )));
    }
    Ok(examples)
}

/// The tools of `worker.rollout.multi_turn`: the built-in ones of `tools`, and the
/// programs of `tool_commands` with their schemas from `schemas` (`data.tools`).
///
/// # Errors
/// A tool name that is not built in, a command whose schema `data.tools` lacks, a command
/// line that does not split, two tools of one name.
pub fn episode_tools(
    cfg: &Config,
    schemas: Option<&[serde_json::Value]>,
) -> Result<crate::tools::ToolBox, TrainError> {
    const KEY: &str = "worker.rollout.multi_turn";
    let mt = &cfg.worker.rollout.multi_turn;
    let mut toolbox = crate::tools::ToolBox::default();
    for name in &mt.tools {
        let tool: Box<dyn crate::tools::Tool> = match name.as_str() {
            "calculator" => Box::new(crate::tools::Calculator),
            other => {
                return Err(TrainError::Invalid(format!(
                    "{KEY}.tools: no built-in tool named {other:?} (built in: calculator)"
                )));
            }
        };
        toolbox
            .add(tool)
            .map_err(|e| TrainError::Invalid(format!("{KEY}.tools: {e}")))?;
    }
    for t in &mt.tool_commands {
        let schema = schemas
            .into_iter()
            .flatten()
            .find(|s| crate::tools::schema_name(s) == Some(t.name.as_str()))
            .ok_or_else(|| {
                TrainError::Invalid(format!(
                    "{KEY}.tool_commands: `{}` has no schema in data.tools (a JSON file of \
                     tool schemas; the tool's is the one whose function.name is `{}`)",
                    t.name, t.name
                ))
            })?;
        let tool = crate::tools::external::CommandTool::new(
            schema.clone(),
            &t.command,
            std::time::Duration::from_secs_f64(t.timeout_s),
            t.max_concurrency,
        )
        .map_err(|e| TrainError::Invalid(format!("{KEY}.tool_commands `{}`: {e}", t.name)))?;
        toolbox
            .add(Box::new(tool))
            .map_err(|e| TrainError::Invalid(format!("{KEY}.tool_commands: {e}")))?;
    }
    Ok(toolbox)
}

/// The run directory of a config: `trainer.save_checkpoint_path`, else `runs/<experiment_name>`.
pub fn run_dir(cfg: &Config) -> PathBuf {
    cfg.trainer.save_checkpoint_path.as_ref().map_or_else(
        || Path::new("runs").join(&cfg.trainer.experiment_name),
        PathBuf::from,
    )
}

/// The EOS ids of a model: `generation_config.json`'s `eos_token_id`, else the
/// tokenizer's EOS token.
pub fn eos_ids(ckpt: &Checkpoint, renderer: &PromptRenderer) -> Vec<u32> {
    eos_ids_of(ckpt.generation.as_ref(), renderer)
}

/// [`eos_ids`] from a model's generation config.
pub fn eos_ids_of(generation: Option<&GenerationConfig>, renderer: &PromptRenderer) -> Vec<u32> {
    let mut ids: Vec<u32> = generation
        .and_then(|g| g.eos_token_ids.clone())
        .unwrap_or_default();
    if ids.is_empty()
        && let Some(id) = renderer
            .tokenizer
            .config()
            .and_then(|c| c.special.eos_token.clone())
            .and_then(|t| renderer.tokenizer.token_to_id(&t))
    {
        ids.push(id);
    }
    ids
}

/// The renderer of a model directory with the config's `format_prompt`.
///
/// # Errors
/// Missing or malformed tokenizer files or template.
pub fn renderer(cfg: &Config, model_dir: &Path) -> Result<PromptRenderer, TrainError> {
    // `worker.actor.model.tokenizer_path` holds the tokenizer and chat template when set
    let tokenizer_dir = cfg
        .worker
        .actor
        .model
        .tokenizer_path
        .as_deref()
        .map_or(model_dir, Path::new);
    let tokenizer = crate::hf::tokenizer::Tokenizer::from_dir(tokenizer_dir)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", tokenizer_dir.display())))?;
    let chat = match &cfg.data.override_chat_template {
        Some(file) => Some(
            crate::hf::chat::ChatTemplate::from_file_for_dir(Path::new(file), tokenizer_dir)
                .map_err(|e| {
                    TrainError::Invalid(format!("data.override_chat_template = {file}: {e}"))
                })?,
        ),
        None => match crate::hf::chat::ChatTemplate::from_dir(tokenizer_dir) {
            Ok(c) => Some(c),
            Err(crate::hf::chat::ChatError::NoTemplate { .. }) => {
                eprintln!(
                    "note: {} has no chat template; prompts are used as plain text",
                    tokenizer_dir.display()
                );
                None
            }
            Err(e) => {
                return Err(TrainError::Invalid(format!(
                    "{}: {e}",
                    tokenizer_dir.display()
                )));
            }
        },
    };
    let format = cfg
        .data
        .format_prompt
        .as_deref()
        .map(|p| {
            PromptTemplate::from_file(Path::new(p)).map_err(|e| TrainError::Invalid(e.to_string()))
        })
        .transpose()?;
    let media = if VlConfig::is_vl_dir(model_dir) {
        let invalid = |e: String| TrainError::Invalid(e);
        Some(crate::trainer::collect::prompts::MediaPrompts {
            processor: crate::data::MediaProcessor::from_model_dir(model_dir, &cfg.data)
                .map_err(|e| invalid(e.to_string()))?,
            config: VlConfig::from_dir(model_dir).map_err(|e| invalid(e.to_string()))?,
        })
    } else {
        None
    };
    let tools = cfg
        .data
        .tools
        .as_deref()
        .map(|file| {
            crate::hf::chat::read_tools(Path::new(file))
                .map_err(|e| TrainError::Invalid(format!("data.tools: {e}")))
        })
        .transpose()?;
    // episodes show the model their built-in tools unless data.tools lists others
    let tools = match tools {
        None if cfg.worker.rollout.multi_turn.enable => Some(episode_tools(cfg, None)?.schemas()),
        t => t,
    };
    if chat.is_none() && (tools.is_some() || cfg.data.apply_chat_template_kwargs.is_some()) {
        return Err(TrainError::Invalid(format!(
            "data.tools and data.apply_chat_template_kwargs are rendered by the chat template, \
             and {} has none (set data.override_chat_template)",
            tokenizer_dir.display()
        )));
    }
    Ok(PromptRenderer {
        tokenizer,
        chat,
        format,
        media,
        template_inputs: crate::trainer::collect::prompts::TemplateInputs {
            tools,
            kwargs: cfg.data.apply_chat_template_kwargs.clone(),
        },
    })
}

/// AdamW hyper-parameters of the config.
pub fn adamw_config(cfg: &Config) -> crate::model::AdamWConfig {
    let o = &cfg.worker.actor.optim;
    crate::model::AdamWConfig {
        beta1: o.betas[0],
        beta2: o.betas[1],
        eps: o.eps,
        weight_decay: o.weight_decay,
    }
}

/// Saves `model` as a Hugging Face directory with the tokenizer files of `source_dir`.
///
/// # Errors
/// I/O errors.
pub fn save_model<B: Backend>(
    model: &Model<B>,
    ckpt: &Checkpoint,
    source_dir: &Path,
    dir: &Path,
    dtype: SaveDtype,
) -> Result<(), TrainError> {
    model.save_pretrained(dir, &ckpt.config, ckpt.generation.as_ref(), dtype)?;
    copy_tokenizer_files(source_dir, dir)
}

/// The UTF-8 bytes of a prompt's text (every message's content).
fn prompt_bytes(p: &crate::data::Prompt) -> usize {
    match p {
        crate::data::Prompt::Text(t) => t.len(),
        crate::data::Prompt::Messages(m) => m.iter().map(|m| m.content.len()).sum(),
    }
}

/// The prompts [`filter_prompts`] keeps.
#[derive(Debug)]
pub struct KeptPrompts {
    /// The examples.
    pub examples: Vec<Example>,
    /// Their rendered prompts' ids.
    pub ids: Vec<Vec<u32>>,
    /// The most merged image/video tokens one of them holds once its placeholders are
    /// expanded (0 without media): what the vision tower's activations scale with.
    pub vision_tokens: usize,
}

/// The most merged image/video tokens one prompt of `examples` holds once its
/// placeholders are expanded (0 without media): the validation prompts' bound on the
/// rollout's vision tower arena (they are generated from, never trained on).
///
/// # Errors
/// Rendering errors; unreadable media, naming the row.
pub fn most_vision_tokens(
    renderer: &PromptRenderer,
    examples: &[Example],
) -> Result<usize, TrainError> {
    let mut most = 0;
    for e in examples.iter().filter(|e| e.has_media()) {
        let ids = renderer.ids(e, None)?;
        most = most.max(renderer.expanded_len(e, &ids)?.1);
    }
    Ok(most)
}

/// Keeps the examples whose rendered prompt fits `data.max_prompt_length` (when
/// `filter_overlong_prompts`; else such a prompt is an error).
///
/// # Errors
/// Rendering errors; every prompt too long; a too-long prompt without filtering.
pub fn filter_prompts(
    cfg: &Config,
    renderer: &PromptRenderer,
    examples: Vec<Example>,
) -> Result<KeptPrompts, TrainError> {
    let max = cfg.data.max_prompt_length;
    // a prompt of more bytes than `max` tokens can cover is overlong whatever the tokenizer
    // makes of it: it is not rendered nor tokenized (a book in a row costs nothing)
    let bytes_per_token = renderer.tokenizer.max_token_bytes();
    let byte_limit = max.saturating_mul(bytes_per_token);
    let mut ids = Vec::with_capacity(examples.len());
    let mut lengths = Vec::with_capacity(examples.len());
    let mut vision = Vec::with_capacity(examples.len());
    for e in &examples {
        let bytes = prompt_bytes(&e.prompt);
        if bytes > byte_limit {
            lengths.push(bytes.div_ceil(bytes_per_token));
            vision.push(0);
            ids.push(Vec::new());
            continue;
        }
        let i = renderer.ids(e, None)?;
        // images and videos count with their expanded placeholders
        let (len, units) = renderer.expanded_len(e, &i)?;
        lengths.push(len);
        vision.push(units);
        ids.push(i);
    }
    let most_vision = vision
        .iter()
        .zip(&lengths)
        .filter(|(_, l)| **l <= max)
        .map(|(v, _)| *v)
        .max()
        .unwrap_or(0);
    if !cfg.data.filter_overlong_prompts
        && let Some((e, &len)) = examples.iter().zip(&lengths).find(|(_, l)| **l > max)
    {
        return Err(TrainError::Invalid(format!(
            "row {} ({}): prompt of {}{} tokens exceeds data.max_prompt_length = {max} \
                 (set data.filter_overlong_prompts: true to drop such rows)",
            e.row,
            e.global_id,
            if prompt_bytes(&e.prompt) > byte_limit {
                "at least "
            } else {
                ""
            },
            len
        )));
    }
    let (kept, dropped) = crate::data::filter_by_prompt_length(examples, &lengths, max)
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    if dropped > 0 {
        eprintln!("data: dropped {dropped} prompts longer than data.max_prompt_length = {max}");
    }
    let ids: Vec<Vec<u32>> = ids
        .into_iter()
        .zip(&lengths)
        .filter(|(_, l)| **l <= max)
        .map(|(i, _)| i)
        .collect();
    Ok(KeptPrompts {
        examples: kept,
        ids,
        vision_tokens: most_vision,
    })
}

/// The run's LoRA settings (`worker.actor.model.lora`) as PEFT's configuration; `None` at
/// rank 0. `worker.actor.model.freeze_vision_tower` keeps the tower as loaded: no pairs on
/// it (as `exclude_modules: .*visual.*`).
///
/// # Errors
/// A setting out of range, named.
pub fn lora_settings(cfg: &Config) -> Result<Option<crate::hf::lora::LoraConfig>, TrainError> {
    let mut lora = cfg.worker.actor.model.lora.peft().map_err(|(k, v, e)| {
        TrainError::Invalid(format!("worker.actor.model.lora.{k} = {v}: expected {e}"))
    })?;
    if let Some(l) = lora.as_mut()
        && cfg.worker.actor.model.freeze_vision_tower
        && l.exclude_modules.is_none()
    {
        l.exclude_modules = Some(".*visual.*".into());
    }
    Ok(lora)
}

/// Puts the run's LoRA pairs on `actor` (built from `base`): the adapter of
/// `lora.adapter_path`, or fresh pairs drawn from `seed`; nothing at rank 0. Returns the
/// configuration.
///
/// # Errors
/// As [`lora_settings`]; the adapter unreadable, made for another model or with other
/// settings; a backend failure.
pub fn add_lora<B: Backend>(
    actor: &mut Actor<B>,
    cfg: &Config,
    base: &ModelFiles,
    seed: u64,
) -> Result<Option<crate::hf::lora::LoraConfig>, TrainError> {
    let Some(lora) = lora_settings(cfg)? else {
        return Ok(None);
    };
    let added = match &cfg.worker.actor.model.lora.adapter_path {
        Some(dir) => {
            let adapter = starting_adapter(Path::new(dir), &lora, base)?;
            actor.load_lora(&adapter)
        }
        None => actor.add_lora(&lora, seed),
    };
    added.map_err(|e| match e {
        TrainError::Model(m) if cfg.worker.actor.model.freeze_vision_tower => {
            TrainError::Invalid(format!(
                "{m} (worker.actor.model.freeze_vision_tower=true keeps the tower without pairs)"
            ))
        }
        e => e,
    })?;
    Ok(Some(lora))
}

/// The PEFT adapter in `dir` a LoRA run starts from, checked against the run's settings
/// `want` (rank, alpha, targets, rsLoRA).
///
/// # Errors
/// The adapter unreadable or made for another model, or settings that differ from its
/// config (the message gives the settings to use).
fn starting_adapter(
    dir: &Path,
    want: &crate::hf::lora::LoraConfig,
    base: &ModelFiles,
) -> Result<crate::hf::lora::LoraAdapter, TrainError> {
    let adapter = base
        .read_adapter(dir)
        .map_err(|e| TrainError::Invalid(format!("worker.actor.model.lora.adapter_path: {e}")))?;
    let c = &adapter.config;
    // the same modules adapted, however the names select them
    let (text, vision) = match base {
        ModelFiles::Text(c) => (&c.config, None),
        ModelFiles::Vision(c) => (&c.config.text, Some(&c.config.vision)),
    };
    let modules = |l: &crate::hf::lora::LoraConfig| {
        crate::hf::lora::adapted_weights(l, text, vision)
            .map(|w| w.into_keys().collect::<Vec<_>>())
            .map_err(|e| TrainError::Invalid(format!("worker.actor.model.lora: {e}")))
    };
    if (c.r, c.lora_alpha, c.use_rslora) != (want.r, want.lora_alpha, want.use_rslora)
        || modules(c)? != modules(want)?
    {
        return Err(TrainError::Invalid(format!(
            "worker.actor.model.lora: the adapter in {} has r = {}, lora_alpha = {}, \
             use_rslora = {}, target_modules = [{}]; set worker.actor.model.lora.rank={}, \
             alpha={}, use_rslora={} and target_modules=[{}] to train it",
            dir.display(),
            c.r,
            c.lora_alpha,
            c.use_rslora,
            c.target_modules.join(", "),
            c.r,
            c.lora_alpha,
            c.use_rslora,
            c.target_modules.join(", "),
        )));
    }
    Ok(adapter)
}
