//! `ares-runner generate`: text from a Hugging Face model directory, for prompts given on
//! the command line (`--prompt`, repeatable) or in a JSONL file (`--prompts`).
//!
//! Each prompt is a conversation rendered with the model's chat template and its
//! generation prompt (`--no-chat-template`: the text as is, through the tokenizer with its
//! special tokens), generated alone (one request per prompt, the linear weights transposed
//! once for all of them) until an EOS id of `generation_config.json` / `config.json` /
//! `tokenizer_config.json` or `--max-new-tokens`.
//!
//! Decoding follows transformers' defaults: greedy unless `generation_config.json` sets
//! `do_sample: true` or a sampling flag is given; then its `temperature`, `top_p`, `top_k`
//! and `min_p` (transformers' 1.0, 1.0, 50 and off when absent), each overridden by its
//! flag.
//! Prompt `i` samples with the seed `--seed ^ i·0x9E3779B97F4A7C15` (prompt 0: `--seed`).
//!
//! Output: without `--json`, the text is streamed to stdout as tokens are produced
//! (decoded incrementally, special tokens skipped), one completion per prompt, with
//! progress notes on stderr; with `--json`, one line per prompt:
//! `{"prompt_index", "text", "token_ids", "input_ids", "finish_reason": "eos"|"length"}`.
//!
//! Images and videos (`--image`, `--video`, `"images"` / `"videos"` in a JSONL line) are
//! for vision-language models (`model_type` qwen2_vl, qwen2_5_vl) only; a text model refuses
//! them. A `--prompt` (or a line's `"prompt"`) with media is one user message whose content
//! is an `{"type": "image"}` item per image, then a `{"type": "video"}` item per video, then
//! `{"type": "text", "text": ...}`; a line's `"messages"` are kept as given, their image and
//! video content items (`"type": "image"` or an `image` / `image_url` key; `"type": "video"`
//! or a `video` key, as Qwen's chat templates read them) taking the line's `"images"` /
//! `"videos"` in order, as many items as paths. The chat template writes one
//! `<|image_pad|>` / `<|video_pad|>` per item, which becomes one per merged patch of its
//! image or video (`input_ids` in `--json` are these expanded ids). Images are PNG, JPEG or
//! WebP files; a video is a directory of frame images (sorted by name) or a video file
//! (decoded by ffmpeg), every frame kept unless `--video-fps` is given: then files are
//! sampled at that rate, frame directories are taken as recorded at it, and Qwen2.5-VL's
//! temporal positions step by `temporal_patch_size / fps` seconds (`second_per_grid_ts`, as
//! the trainer's `data.video_fps`); without it they take one second per temporal patch. Text prompts on a vision-language model need no processor config.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use crate::backend::Backend;
use crate::config::Config;
use crate::hf::chat::{ChatError, ChatMessage, ChatTemplate};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::generation::GenerationConfig;
use crate::hf::tokenizer::{TOKENIZER_FILE, Tokenizer};
use crate::model::{GenerateOutput, GenerateRequest, Sampling};
use crate::tools::episode::{EpisodeSettings, Stop, TurnModel, TurnText, run_episode};
use crate::tools::{Calculator, ToolBox, ToolCallFormat};
use crate::trainer::TrainError;
use crate::trainer::actor::ActorGenerator;
use crate::trainer::collect::prompts::TemplateInputs;
use crate::trainer::setup::{ModelFiles, build_actor};
use crate::vision::checkpoint::VlCheckpoint;
use crate::vision::config::{VlConfig, VlKind};
use crate::vision::model::VisionBatch;
use crate::vision::processor::{
    ProcessedImage, ProcessedVideo, ProcessorConfig, VideoSampling, process_image_file,
};
use crate::vision::video::process_video_path;

/// New tokens per prompt when neither `--max-new-tokens` nor `generation_config.json`'s
/// `max_new_tokens` says.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

/// transformers' `top_k` when sampling and `generation_config.json` does not set one.
const TRANSFORMERS_TOP_K: usize = 50;

/// The flags of `ares-runner generate`.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "generate")]
pub struct GenerateArgs {
    /// Hugging Face model directory: config.json, safetensors weights, tokenizer.json,
    /// tokenizer_config.json (with the chat template), generation_config.json (optional).
    #[arg(short, long, value_name = "MODEL_DIR")]
    pub model: PathBuf,
    /// A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) to merge
    /// into the model's weights before generating.
    #[arg(long, value_name = "ADAPTER_DIR")]
    pub adapter: Option<PathBuf>,
    /// A user message, rendered with the model's chat template and generation prompt
    /// (repeatable: one completion each).
    #[arg(long, value_name = "TEXT", conflicts_with = "prompts")]
    pub prompt: Vec<String>,
    /// JSONL file, one prompt a line: {"messages": [{"role": ..., "content": ...}, ...]} or
    /// {"prompt": "text"}, optionally with "images": [...] and "videos": [...] (paths
    /// relative to the file's directory).
    #[arg(long, value_name = "FILE.jsonl")]
    pub prompts: Option<PathBuf>,
    /// An image attached to every --prompt (repeatable; vision-language models only).
    #[arg(long, value_name = "PATH", conflicts_with = "prompts")]
    pub image: Vec<PathBuf>,
    /// A video attached to every --prompt: a video file or a directory of frame images
    /// (repeatable; vision-language models only).
    #[arg(long, value_name = "PATH", conflicts_with = "prompts")]
    pub video: Vec<PathBuf>,
    /// Frames per second of the videos (as `data.video_fps` in training): video files are
    /// sampled at this rate, a directory of frames is taken as recorded at it, and
    /// Qwen2.5-VL's M-RoPE time step is `temporal_patch_size / fps` [default: every frame of
    /// a file kept, one second per temporal patch].
    #[arg(long, value_name = "FPS")]
    pub video_fps: Option<f64>,
    /// Most new tokens per prompt [default: generation_config.json's max_new_tokens, else 256].
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,
    /// Sampling temperature (0: greedy) [default: generation_config.json's, else 1.0].
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in (0, 1] [default: generation_config.json's, else 1.0].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Sample from the K most likely tokens (0: all) [default: generation_config.json's,
    /// else 50 as transformers].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Keep tokens at least P times as likely as the most likely, in [0, 1] (0: off)
    /// [default: generation_config.json's, else off].
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Seed of the sampling streams.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Greedy decoding, whatever generation_config.json says.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k", "min_p"])]
    pub greedy: bool,
    /// Device: cpu, cuda or auto (as `train --device`) [default: cpu].
    #[arg(long, value_name = "DEVICE", value_parser = ["cpu", "cuda", "auto"])]
    pub device: Option<String>,
    /// Decode weights: f32, or a bf16 copy (half the bytes per token; as
    /// `worker.rollout.weight_dtype` in training) [default: f32].
    #[arg(long, value_name = "DTYPE", value_parser = ["f32", "bf16"])]
    pub weight_dtype: Option<String>,
    /// KV cache: f32, or bf16 (half its memory; as `worker.rollout.kv_cache_dtype` in
    /// training) [default: f32].
    #[arg(long, value_name = "DTYPE", value_parser = ["f32", "bf16"])]
    pub kv_cache_dtype: Option<String>,
    /// Pad decode passes to buckets and replay each bucket's pass as a captured CUDA graph
    /// (a GPU only; as `worker.rollout.cuda_graphs` in training). Same tokens.
    #[arg(long)]
    pub cuda_graphs: bool,
    /// One JSON line per prompt instead of streamed text.
    #[arg(long)]
    pub json: bool,
    /// Tokenize the prompt text as is (no chat template).
    #[arg(long)]
    pub no_chat_template: bool,
    /// A JSON file of tool schemas (a list, as transformers' `tools=`) the chat template
    /// renders into every prompt (as `data.tools` in training).
    #[arg(long, value_name = "FILE.json", conflicts_with = "no_chat_template")]
    pub tools: Option<PathBuf>,
    /// Extra chat-template variables as a JSON object, e.g. '{"enable_thinking": false}'
    /// (as `data.apply_chat_template_kwargs` in training).
    #[arg(long, value_name = "JSON", conflicts_with = "no_chat_template")]
    pub chat_template_kwargs: Option<String>,
    /// Model turns per prompt: above 1 the model's tool calls are run with the built-in
    /// tools (`calculator`; shown to the model unless --tools says otherwise), their
    /// results appended through the chat template, and generation resumed; the new-token
    /// limit counts the model's and the tools' tokens together. A prompt's images stay
    /// with it in every turn.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        conflicts_with = "no_chat_template"
    )]
    pub max_turns: usize,
    /// A tool answered by a program, `NAME=COMMAND` (repeatable; with --max-turns above 1):
    /// its schema is NAME's entry of --tools; the command reads one JSON line per call,
    /// `{"name", "arguments"}`, and answers `{"content": …}` or `{"error": …}`.
    #[arg(long, value_name = "NAME=COMMAND", requires = "tools")]
    pub tool_command: Vec<String>,
    /// Seconds a tool command may take per call before it is killed and the call fails
    /// (the model is told) [default: 30].
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub tool_timeout: f64,
    /// A program that answers each turn without tool calls as a user would (with
    /// --max-turns above 1): it reads `{"messages", "kwargs", "turn"}` a line and answers
    /// `{"content": …, "done": …, "reward": …}`; `done` ends the episode. Its timeout is
    /// --tool-timeout's.
    #[arg(long, value_name = "COMMAND")]
    pub interaction_command: Option<String>,
}

/// The chat template's inputs of `--tools` and `--chat-template-kwargs`.
///
/// # Errors
/// An unreadable or malformed tools file; kwargs that are not a JSON object, or name a
/// variable the render sets.
fn template_inputs(args: &GenerateArgs) -> Result<TemplateInputs, TrainError> {
    let tools = args
        .tools
        .as_deref()
        .map(|f| crate::hf::chat::read_tools(f).map_err(|e| invalid(format!("--tools: {e}"))))
        .transpose()?;
    let kwargs = match &args.chat_template_kwargs {
        None => None,
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => {
                if let Some(k) = map
                    .keys()
                    .find(|k| crate::hf::chat::RENDER_VARIABLES.contains(&k.as_str()))
                {
                    return Err(invalid(format!(
                        "--chat-template-kwargs: `{k}` is set by ares itself (tools come from \
                         --tools)"
                    )));
                }
                Some(map)
            }
            Ok(_) | Err(_) => {
                return Err(invalid(format!(
                    "--chat-template-kwargs {text:?}: expected a JSON object, e.g. \
                     '{{\"enable_thinking\": false}}'"
                )));
            }
        },
    };
    Ok(TemplateInputs { tools, kwargs })
}

/// What a prompt says: a text (a `--prompt` or `{"prompt": "..."}`) or a conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// One user message (`--no-chat-template`: the raw text).
    Text(String),
    /// Chat messages (`role`, `content`, and whatever else the template reads).
    Messages(Vec<Value>),
}

/// One prompt to complete, with its media.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// Where it came from, for messages (`--prompt 2`, `prompts.jsonl line 7`).
    pub origin: String,
    /// The text or conversation.
    pub input: PromptInput,
    /// Image files.
    pub images: Vec<PathBuf>,
    /// Video files or directories of frame images.
    pub videos: Vec<PathBuf>,
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS id was produced (it is the last of `token_ids`).
    Eos,
    /// The new-token limit was reached.
    Length,
}

/// One prompt's completion (a `--json` line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    /// Index of the prompt (order of `--prompt`s or of the file's prompt lines).
    pub prompt_index: usize,
    /// The new tokens decoded, special tokens skipped.
    pub text: String,
    /// The new token ids, the EOS id included when one ended the completion.
    pub token_ids: Vec<u32>,
    /// The prompt's token ids, as the model saw them.
    pub input_ids: Vec<u32>,
    /// Why the completion ended.
    pub finish_reason: FinishReason,
    /// With `--max-turns` above 1: the model's turns, the tool calls run and how many of
    /// them failed, and per token of `token_ids` whether the model wrote it (the rest are
    /// the chat template's and the tools').
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<ToolUse>,
}

/// What a multi-turn completion did with tools.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolUse {
    /// Model turns.
    pub turns: usize,
    /// Tool calls run.
    pub calls: usize,
    /// Of them, those that failed (malformed, unknown tool, tool error).
    pub failed_calls: usize,
    /// Per new token: written by the model.
    pub from_model: Vec<bool>,
    /// The interaction's score of each turn it answered (with --interaction-command).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub turn_scores: Vec<f64>,
    /// The interaction's failure that ended the episode, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interaction_error: Option<String>,
}

/// `ares-runner generate`: completions of the prompts of `args`, on stdout.
///
/// # Errors
/// As [`generate`].
pub fn run(args: &GenerateArgs) -> Result<(), TrainError> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    generate(args, &mut out).map(|_| ())
}

/// Completes the prompts of `args`, writing streamed text (or, with `--json`, one JSON line
/// per prompt) to `out`, notes to stderr; returns the completions.
///
/// # Errors
/// Anything a user can fix, named: no prompt, a missing model directory or file, a prompt
/// file line that is not a prompt, images for a text model, a missing or undecodable image
/// or video, image / video items that do not match a line's paths, media with
/// `--no-chat-template`, conflicting or invalid decoding flags, a prompt too long for the
/// model, an unusable device; also generation failures and write errors on `out`.
pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<Vec<Completion>, TrainError> {
    check_decoding_flags(args)?;
    let model_type = model_type(&args.model)?;
    let prompts = collect_prompts(args)?;
    let vision = VlKind::from_model_type(&model_type).is_some();
    if !vision {
        for p in &prompts {
            for (what, media) in [("images", &p.images), ("videos", &p.videos)] {
                if !media.is_empty() {
                    return Err(invalid(format!(
                        "model {} (model_type {model_type}) takes no {what} ({}: {})",
                        args.model.display(),
                        p.origin,
                        media[0].display()
                    )));
                }
            }
        }
    }
    let tokenizer = load_tokenizer(&args.model)?;
    let mut inputs = template_inputs(args)?;
    let episodes = episode_setup(args, &prompts, &mut inputs)?;
    let mut input_ids = prompt_ids(
        &args.model,
        &tokenizer,
        &prompts,
        args.no_chat_template,
        &inputs,
    )?;
    // the media before the device and the weights: a bad image fails fast
    let media = if vision {
        vision_inputs(&args.model, &prompts, &mut input_ids, args.video_fps)?
    } else {
        Vec::new()
    };

    // the device before the weights: a missing GPU fails fast
    let mut overrides = Vec::new();
    if let Some(d) = &args.device {
        overrides.push(format!("trainer.device={d}"));
    }
    if let Some(d) = &args.weight_dtype {
        overrides.push(format!("worker.rollout.weight_dtype={d}"));
    }
    if let Some(d) = &args.kv_cache_dtype {
        overrides.push(format!("worker.rollout.kv_cache_dtype={d}"));
    }
    if args.cuda_graphs {
        if args.device.as_deref().is_none_or(|d| d == "cpu") {
            return Err(invalid(
                "--cuda-graphs needs --device cuda or auto: the CPU replays no graph (the \
                 decode buckets would only add their padding's compute)"
                    .into(),
            ));
        }
        overrides.push("worker.rollout.cuda_graphs=true".into());
    }
    let cfg = Config::load(None, &overrides).map_err(|e| invalid(e.to_string()))?;
    let selected = super::select_backend(&cfg)?;

    let load_error =
        |e: crate::hf::HfError| invalid(format!("loading model {}: {e}", args.model.display()));
    let mut files = if vision {
        ModelFiles::Vision(VlCheckpoint::load(&args.model).map_err(load_error)?)
    } else {
        ModelFiles::Text(Checkpoint::load(&args.model).map_err(load_error)?)
    };
    if let Some(dir) = &args.adapter {
        let lora = files.merge_adapter(dir)?;
        eprintln!(
            "merged the LoRA adapter {} ({} pairs, rank {})",
            dir.display(),
            lora.pairs.len(),
            lora.config.r
        );
    }
    let sampling = decoding(args, files.generation());
    note_unapplied(files.generation());
    let limits = new_token_limits(args, &files, &prompts, &input_ids)?;
    let eos_ids = eos_ids(&files, &tokenizer);
    if eos_ids.is_empty() {
        eprintln!(
            "note: {} names no EOS token; every completion runs to its token limit",
            args.model.display()
        );
    }
    eprintln!("generate: {}", describe(sampling, args.seed));
    let job = Job {
        files: &files,
        cfg: &cfg,
        tokenizer: &tokenizer,
        input_ids: &input_ids,
        media: &media,
        limits: &limits,
        eos_ids: &eos_ids,
        sampling,
        seed: args.seed,
        json: args.json,
        episodes: episodes.as_ref().map(|e| (e, &inputs)),
    };
    crate::with_backend!(selected, b => job.run(b, out))
}

/// The token ids of the prompts: each rendered with the chat template of `model_dir` and its
/// generation prompt (a text with images or videos as one user message with their content
/// items, [`prompt_messages`]), or (`raw`) tokenized as is with the special tokens of the
/// tokenizer (its post-processor: a BOS for Llama). Placeholders are not expanded yet
/// ([`vision_inputs`] does it).
///
/// # Errors
/// Missing tokenizer files or chat template, a conversation or media with `raw`, template
/// or tokenizer errors, an empty prompt; each naming the prompt.
fn prompt_ids(
    model_dir: &Path,
    tokenizer: &Tokenizer,
    prompts: &[Prompt],
    raw: bool,
    inputs: &TemplateInputs,
) -> Result<Vec<Vec<u32>>, TrainError> {
    let chat = if raw {
        None
    } else {
        Some(ChatTemplate::from_dir(model_dir).map_err(|e| match e {
            ChatError::NoTemplate { .. } => invalid(format!(
                "model {} has no chat template (no `chat_template` in tokenizer_config.json, \
                 no chat_template.jinja); pass --no-chat-template to tokenize the prompt \
                 text as is",
                model_dir.display()
            )),
            e => invalid(format!("model {}: {e}", model_dir.display())),
        })?)
    };
    let mut all = Vec::with_capacity(prompts.len());
    for p in prompts {
        let ids = match (&chat, &p.input) {
            (Some(chat), _) => {
                let text = chat
                    .render(&prompt_messages(p)?, &inputs.generation())
                    .map_err(|e| invalid(format!("{}: {e}", p.origin)))?;
                tokenizer.encode(&text, false)
            }
            (None, _) if !p.images.is_empty() || !p.videos.is_empty() => {
                return Err(invalid(format!(
                    "{}: images and videos need the chat template (it writes their \
                     <|image_pad|> / <|video_pad|> placeholders); drop --no-chat-template",
                    p.origin
                )));
            }
            (None, PromptInput::Text(t)) => tokenizer.encode(t, true),
            (None, PromptInput::Messages(_)) => {
                return Err(invalid(format!(
                    "{}: a conversation (\"messages\") needs the chat template; drop \
                     --no-chat-template or give {{\"prompt\": \"text\"}}",
                    p.origin
                )));
            }
        }
        .map_err(|e| invalid(format!("{}: {e}", p.origin)))?;
        if ids.is_empty() {
            return Err(invalid(format!("{}: the prompt has no tokens", p.origin)));
        }
        all.push(ids);
    }
    Ok(all)
}

/// The chat messages of a prompt: its `messages` as given; a text as one user message, whose
/// content, when the prompt has images or videos, is an image item per image, a video item
/// per video, then the text.
fn prompt_messages(p: &Prompt) -> Result<Vec<Value>, TrainError> {
    match &p.input {
        PromptInput::Messages(m) => Ok(m.clone()),
        PromptInput::Text(t) if p.images.is_empty() && p.videos.is_empty() => Ok(vec![
            serde_json::to_value(ChatMessage::user(t))
                .map_err(|e| TrainError::Internal(e.to_string()))?,
        ]),
        PromptInput::Text(t) => {
            let mut content: Vec<Value> = Vec::new();
            content.extend(
                p.images
                    .iter()
                    .map(|_| serde_json::json!({"type": "image"})),
            );
            content.extend(
                p.videos
                    .iter()
                    .map(|_| serde_json::json!({"type": "video"})),
            );
            content.push(serde_json::json!({"type": "text", "text": t}));
            Ok(vec![
                serde_json::json!({"role": "user", "content": content}),
            ])
        }
    }
}

/// The image and video content items of `messages`, counted as Qwen's chat templates tell
/// them apart: an item with `"type": "image"` or an `image` / `image_url` key is an image,
/// else one with `"type": "video"` or a `video` key is a video.
fn media_items(messages: &[Value]) -> (usize, usize) {
    let (mut images, mut videos) = (0, 0);
    for m in messages {
        let Some(items) = m.get("content").and_then(Value::as_array) else {
            continue;
        };
        for item in items {
            let kind = item.get("type").and_then(Value::as_str);
            let has = |key: &str| item.get(key).is_some();
            if kind == Some("image") || has("image") || has("image_url") {
                images += 1;
            } else if kind == Some("video") || has("video") {
                videos += 1;
            }
        }
    }
    (images, videos)
}

/// The images and videos of each prompt for the vision-language model in `model_dir`, as
/// one [`VisionBatch`] per prompt (empty for a text prompt); each prompt's `ids` get their
/// `<|image_pad|>` / `<|video_pad|>` placeholders expanded to one per merged patch.
///
/// # Errors
/// A malformed `config.json` or processor config; a line whose image / video items are not
/// as many as its paths; placeholders the chat template wrote that do not match the media;
/// a missing, unreadable or undecodable image or video; each naming the prompt.
fn vision_inputs(
    model_dir: &Path,
    prompts: &[Prompt],
    ids: &mut [Vec<u32>],
    video_fps: Option<f64>,
) -> Result<Vec<VisionBatch>, TrainError> {
    if let Some(fps) = video_fps
        && !(fps.is_finite() && fps > 0.0)
    {
        return Err(invalid(format!(
            "--video-fps {fps}: must be a positive, finite frame rate"
        )));
    }
    let config = VlConfig::from_dir(model_dir)
        .map_err(|e| invalid(format!("loading model {}: {e}", model_dir.display())))?;
    let with_media = |p: &Prompt| !p.images.is_empty() || !p.videos.is_empty();
    let processor = if prompts.iter().any(with_media) {
        Some(
            ProcessorConfig::from_model_dir(model_dir)
                .map_err(|e| invalid(format!("model {}: {e}", model_dir.display())))?,
        )
    } else {
        None
    };
    // an --image given with several --prompts is processed once
    let mut images: HashMap<&Path, ProcessedImage> = HashMap::new();
    let mut videos: HashMap<&Path, ProcessedVideo> = HashMap::new();
    let mut batches = Vec::with_capacity(prompts.len());
    for (p, ids) in prompts.iter().zip(ids.iter_mut()) {
        let at = |e: &dyn std::fmt::Display| invalid(format!("{}: {e}", p.origin));
        if let PromptInput::Messages(m) = &p.input {
            let (image_items, video_items) = media_items(m);
            for (what, items, paths, key) in [
                ("image", image_items, p.images.len(), "images"),
                ("video", video_items, p.videos.len(), "videos"),
            ] {
                if items != paths {
                    return Err(invalid(format!(
                        "{}: the messages have {items} {what} content item(s) but the line \
                         gives {paths} path(s) in \"{key}\"; each {what} item takes the next \
                         path of \"{key}\", so give as many paths as items",
                        p.origin
                    )));
                }
            }
        }
        let tokens = config.tokens;
        for (pad, id, n, what) in [
            ("<|image_pad|>", tokens.image_pad, p.images.len(), "image"),
            ("<|video_pad|>", tokens.video_pad, p.videos.len(), "video"),
        ] {
            let found = ids.iter().filter(|&&t| t == id).count();
            if found != n {
                return Err(invalid(format!(
                    "{}: the prompt holds {found} {pad} placeholder(s) for {n} {what}(s) \
                     (the chat template writes one per {what} content item); does the \
                     model's chat template render {what} items?",
                    p.origin
                )));
            }
        }
        let Some(processor) = processor.as_ref().filter(|_| with_media(p)) else {
            batches.push(VisionBatch::default());
            continue;
        };
        for path in &p.images {
            if !path.exists() {
                return Err(at(&format!("image {} does not exist", path.display())));
            }
            if !images.contains_key(path.as_path()) {
                let image = process_image_file(path, processor).map_err(|e| at(&e))?;
                images.insert(path, image);
            }
        }
        for path in &p.videos {
            if !path.exists() {
                return Err(at(&format!(
                    "video {} does not exist (give a video file or a directory of frame \
                     images)",
                    path.display()
                )));
            }
            if !videos.contains_key(path.as_path()) {
                // a file is sampled at --video-fps; a directory keeps every frame
                let sampling = match video_fps {
                    Some(fps) if !path.is_dir() => VideoSampling {
                        source_fps: None,
                        fps: Some(fps),
                    },
                    _ => VideoSampling::default(),
                };
                let video = process_video_path(path, sampling, processor).map_err(|e| at(&e))?;
                videos.insert(path, video);
            }
        }
        let prompt_images: Vec<ProcessedImage> = p
            .images
            .iter()
            .map(|i| images[i.as_path()].clone())
            .collect();
        let prompt_videos: Vec<ProcessedVideo> = p
            .videos
            .iter()
            .map(|v| videos[v.as_path()].clone())
            .collect();
        // without a frame rate rope_index takes one second per temporal patch
        let seconds: Vec<f64> = video_fps
            .map(|fps| vec![processor.temporal_patch_size as f64 / fps; prompt_videos.len()])
            .unwrap_or_default();
        let batch = VisionBatch::from_processed(&prompt_images, &prompt_videos, &seconds);
        *ids = config
            .expand_prompt(ids, &batch.image_grids, &batch.video_grids)
            .map_err(|e| at(&e))?;
        batches.push(batch);
    }
    Ok(batches)
}

/// The tokenizer of `model_dir`, or an error saying which file is missing.
fn load_tokenizer(model_dir: &Path) -> Result<Tokenizer, TrainError> {
    if !model_dir.join(TOKENIZER_FILE).is_file() {
        return Err(invalid(format!(
            "model {} has no {TOKENIZER_FILE}: generate needs the tokenizer files \
             ({TOKENIZER_FILE}, tokenizer_config.json) next to the weights",
            model_dir.display()
        )));
    }
    Tokenizer::from_dir(model_dir)
        .map_err(|e| invalid(format!("model {}: {e}", model_dir.display())))
}

/// The `model_type` of `model_dir/config.json` (checking the directory is a model's).
fn model_type(model_dir: &Path) -> Result<String, TrainError> {
    if !model_dir.exists() {
        return Err(invalid(format!(
            "model directory {} does not exist",
            model_dir.display()
        )));
    }
    if !model_dir.is_dir() {
        return Err(invalid(format!(
            "--model {} is not a directory (give a Hugging Face model directory)",
            model_dir.display()
        )));
    }
    let path = model_dir.join("config.json");
    if !path.is_file() {
        return Err(invalid(format!(
            "model directory {} has no config.json (is it a Hugging Face model directory?)",
            model_dir.display()
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| invalid(format!("{}: not valid JSON: {e}", path.display())))?;
    Ok(json
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_string())
}

/// The prompts of `args`: the `--prompt`s (each with every `--image` and `--video`) or the
/// lines of `--prompts`.
///
/// # Errors
/// No prompt, both sources, or a prompt file error.
pub fn collect_prompts(args: &GenerateArgs) -> Result<Vec<Prompt>, TrainError> {
    match (&args.prompts, args.prompt.is_empty()) {
        (Some(_), false) => Err(invalid("give --prompt or --prompts, not both".to_string())),
        (Some(file), true) => {
            if !args.image.is_empty() || !args.video.is_empty() {
                return Err(invalid(
                    "--image and --video go with --prompt; in a --prompts file, give each \
                     line its \"images\" / \"videos\""
                        .to_string(),
                ));
            }
            read_prompts_file(file)
        }
        (None, true) => Err(invalid(
            "no prompt: give --prompt TEXT (repeatable) or --prompts FILE.jsonl".to_string(),
        )),
        (None, false) => Ok(args
            .prompt
            .iter()
            .enumerate()
            .map(|(i, text)| Prompt {
                origin: format!("--prompt {}", i + 1),
                input: PromptInput::Text(text.clone()),
                images: args.image.clone(),
                videos: args.video.clone(),
            })
            .collect()),
    }
}

/// The prompts of a JSONL file: one per non-blank line, `{"messages": [...]}` or
/// `{"prompt": "text"}` (a list of messages under `prompt` is taken as `messages`), with
/// optional `"images"` and `"videos"` lists of paths (relative to the file's directory).
/// Other keys are ignored.
///
/// # Errors
/// The file cannot be read, has no prompt, or a line is not such an object (naming the
/// line number).
pub fn read_prompts_file(path: &Path) -> Result<Vec<Prompt>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
    let base = path.parent().unwrap_or(Path::new(""));
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let origin = format!("{} line {}", path.display(), n + 1);
        prompts.push(parse_prompt_line(line, base, origin)?);
    }
    if prompts.is_empty() {
        return Err(invalid(format!(
            "{}: no prompts in the file",
            path.display()
        )));
    }
    Ok(prompts)
}

/// One line of a prompt file (see [`read_prompts_file`]).
fn parse_prompt_line(line: &str, base: &Path, origin: String) -> Result<Prompt, TrainError> {
    const EXPECTED: &str = "expected {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} or {\"prompt\": \"text\"}";
    let bad = |what: String| invalid(format!("{origin}: {what}"));
    let value: Value =
        serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e}); {EXPECTED}")))?;
    let Value::Object(obj) = value else {
        return Err(bad(format!("not a JSON object; {EXPECTED}")));
    };
    let messages = |v: &Value, key: &str| -> Result<Vec<Value>, TrainError> {
        let Some(list) = v.as_array().filter(|l| !l.is_empty()) else {
            return Err(bad(format!("`{key}` must be a non-empty list of messages")));
        };
        for (i, m) in list.iter().enumerate() {
            let ok = m.get("role").is_some_and(Value::is_string) && m.get("content").is_some();
            if !ok {
                return Err(bad(format!(
                    "`{key}[{i}]` must be an object with a string \"role\" and a \"content\""
                )));
            }
        }
        Ok(list.clone())
    };
    let input = match (obj.get("messages"), obj.get("prompt")) {
        (Some(_), Some(_)) => {
            return Err(bad("has both `messages` and `prompt`; give one".to_string()));
        }
        (Some(m), None) => PromptInput::Messages(messages(m, "messages")?),
        (None, Some(Value::String(t))) => PromptInput::Text(t.clone()),
        (None, Some(p @ Value::Array(_))) => PromptInput::Messages(messages(p, "prompt")?),
        (None, Some(_)) => {
            return Err(bad(
                "`prompt` must be a string (or a list of messages)".to_string()
            ));
        }
        (None, None) => return Err(bad(format!("no `messages` or `prompt`; {EXPECTED}"))),
    };
    let paths = |key: &str| -> Result<Vec<PathBuf>, TrainError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(list)) => list
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(|s| base.join(s))
                        .ok_or_else(|| bad(format!("`{key}` must be a list of paths (strings)")))
                })
                .collect(),
            Some(_) => Err(bad(format!("`{key}` must be a list of paths (strings)"))),
        }
    };
    Ok(Prompt {
        images: paths("images")?,
        videos: paths("videos")?,
        input,
        origin,
    })
}

/// Checks the decoding flags.
///
/// # Errors
/// `--greedy` with a sampling flag; a temperature, top-p or min-p out of range.
fn check_decoding_flags(args: &GenerateArgs) -> Result<(), TrainError> {
    let sampling_flags = [
        args.temperature.map(|_| "--temperature"),
        args.top_p.map(|_| "--top-p"),
        args.top_k.map(|_| "--top-k"),
        args.min_p.map(|_| "--min-p"),
    ];
    if args.greedy
        && let Some(flag) = sampling_flags.iter().flatten().next()
    {
        return Err(invalid(format!(
            "--greedy conflicts with {flag}: greedy decoding does not sample"
        )));
    }
    if let Some(t) = args.temperature
        && !(t.is_finite() && t >= 0.0)
    {
        return Err(invalid(format!(
            "--temperature {t}: must be >= 0 (0: greedy)"
        )));
    }
    if let Some(p) = args.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(invalid(format!("--top-p {p}: must be in (0, 1]")));
    }
    if let Some(p) = args.min_p
        && !(0.0..=1.0).contains(&p)
    {
        return Err(invalid(format!("--min-p {p}: must be in [0, 1] (0: off)")));
    }
    Ok(())
}

/// The decoding of a run, as transformers picks it: greedy with `--greedy`, or unless a
/// sampling flag is given or `generation` sets `do_sample: true`; then the flags'
/// temperature, top-p, top-k and min-p, else `generation`'s, else transformers' 1.0, 1.0,
/// 50 and off (temperature 0 is greedy, top-k 0 no limit).
fn decoding(args: &GenerateArgs, generation: Option<&GenerationConfig>) -> Sampling {
    let flagged = args.temperature.is_some()
        || args.top_p.is_some()
        || args.top_k.is_some()
        || args.min_p.is_some();
    let do_sample = flagged || generation.and_then(|g| g.do_sample) == Some(true);
    if args.greedy || !do_sample {
        return Sampling::Greedy;
    }
    let g = |f: fn(&GenerationConfig) -> Option<f64>| generation.and_then(f).map(|v| v as f32);
    let temperature = args
        .temperature
        .or_else(|| g(|c| c.temperature))
        .unwrap_or(1.0);
    if temperature == 0.0 {
        return Sampling::Greedy;
    }
    let top_k = args
        .top_k
        .or_else(|| generation.and_then(|c| c.top_k))
        .unwrap_or(TRANSFORMERS_TOP_K);
    Sampling::Sample {
        temperature,
        top_k: (top_k > 0).then_some(top_k),
        top_p: args.top_p.or_else(|| g(|c| c.top_p)).unwrap_or(1.0),
        min_p: args.min_p.or_else(|| g(|c| c.min_p)).unwrap_or(0.0),
    }
}

/// Notes on the settings of `generation_config.json` that generate does not apply.
fn note_unapplied(generation: Option<&GenerationConfig>) {
    let Some(g) = generation else { return };
    if let Some(r) = g.repetition_penalty.filter(|&r| r != 1.0) {
        eprintln!("note: generation_config.json's repetition_penalty {r} is not applied");
    }
}

/// How a run decodes, for the log.
fn describe(sampling: Sampling, seed: u64) -> String {
    match sampling {
        Sampling::Greedy => "greedy decoding".to_string(),
        Sampling::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
        } => format!(
            "sampling with temperature {temperature}, top_k {}, top_p {top_p}, min_p {min_p}, \
             seed {seed}",
            top_k.map_or("off".to_string(), |k| k.to_string())
        ),
    }
}

/// The new-token limit of each prompt: `--max-new-tokens`, else `generation_config.json`'s
/// `max_new_tokens`, else [`DEFAULT_MAX_NEW_TOKENS`]; a default is capped at what the
/// model's positions leave after the prompt (with a note), a flag is not.
///
/// # Errors
/// A prompt that fills the model's positions, or one that with `--max-new-tokens` would
/// need more positions than the model has.
fn new_token_limits(
    args: &GenerateArgs,
    files: &ModelFiles,
    prompts: &[Prompt],
    input_ids: &[Vec<u32>],
) -> Result<Vec<usize>, TrainError> {
    let wanted = args
        .max_new_tokens
        .or_else(|| files.generation().and_then(|g| g.max_new_tokens))
        .unwrap_or(DEFAULT_MAX_NEW_TOKENS);
    let positions = files.text_config().max_position_embeddings;
    let mut limits = Vec::with_capacity(prompts.len());
    for (p, ids) in prompts.iter().zip(input_ids) {
        let room = positions.saturating_sub(ids.len());
        if room == 0 {
            return Err(invalid(format!(
                "{}: the prompt has {} tokens, the model's whole context \
                 (max_position_embeddings = {positions}); shorten it",
                p.origin,
                ids.len()
            )));
        }
        if wanted > room {
            if args.max_new_tokens.is_some() {
                return Err(invalid(format!(
                    "{}: {} prompt tokens + --max-new-tokens {wanted} exceed the model's \
                     context of {positions} tokens (max_position_embeddings); use \
                     --max-new-tokens {room} or less",
                    p.origin,
                    ids.len()
                )));
            }
            eprintln!(
                "note: {}: at most {room} new tokens (the model's context is {positions} \
                 tokens, the prompt {})",
                p.origin,
                ids.len()
            );
        }
        limits.push(wanted.min(room));
    }
    Ok(limits)
}

/// The ids that end a completion: `generation_config.json`'s `eos_token_id` (else
/// `config.json`'s), then the tokenizer config's `eos_token`.
fn eos_ids(files: &ModelFiles, tokenizer: &Tokenizer) -> Vec<u32> {
    let model_eos = files
        .generation()
        .and_then(|g| g.eos_token_ids.clone())
        .unwrap_or_else(|| files.text_config().eos_token_ids.clone());
    tokenizer.eos_ids(&model_eos)
}

/// The seed of prompt `index`'s sampling stream.
fn prompt_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// An [`TrainError::Invalid`] with `message`.
fn invalid(message: String) -> TrainError {
    TrainError::Invalid(message)
}

/// Everything the generation loop needs, backend aside.
struct Job<'a> {
    files: &'a ModelFiles,
    cfg: &'a Config,
    tokenizer: &'a Tokenizer,
    /// Each prompt's ids (placeholders expanded).
    input_ids: &'a [Vec<u32>],
    /// Each prompt's images and videos (a vision-language model; empty for a text model).
    media: &'a [VisionBatch],
    limits: &'a [usize],
    eos_ids: &'a [u32],
    sampling: Sampling,
    seed: u64,
    json: bool,
    /// With `--max-turns` above 1: the episodes' settings and the template's inputs.
    episodes: Option<(&'a Episodes, &'a TemplateInputs)>,
}

/// What `--max-turns` above 1 runs each prompt with.
struct Episodes {
    template: ChatTemplate,
    format: ToolCallFormat,
    toolbox: ToolBox,
    max_turns: usize,
    interaction: Option<crate::tools::interaction::Interaction>,
    /// Each prompt's conversation.
    messages: Vec<Vec<Value>>,
}

/// The episodes of `--max-turns` (None for 1): the built-in tools, shown to the model
/// unless `--tools` lists others, and the tool-call format of the chat template.
///
/// # Errors
/// `--max-turns 0`; several turns with a template that teaches no tool-call format.
fn episode_setup(
    args: &GenerateArgs,
    prompts: &[Prompt],
    inputs: &mut TemplateInputs,
) -> Result<Option<Episodes>, TrainError> {
    match args.max_turns {
        0 => {
            return Err(invalid(
                "--max-turns 0: a completion takes at least one turn".into(),
            ));
        }
        1 if !args.tool_command.is_empty() || args.interaction_command.is_some() => {
            return Err(invalid(
                "--tool-command and --interaction-command answer between turns: give \
                 --max-turns 2 or more"
                    .into(),
            ));
        }
        1 => return Ok(None),
        _ => {}
    }
    let mut toolbox = ToolBox::default();
    toolbox.add(Box::new(Calculator)).map_err(invalid)?;
    if !(args.tool_timeout.is_finite() && args.tool_timeout > 0.0) {
        return Err(invalid(format!(
            "--tool-timeout {}: must be a number of seconds above 0",
            args.tool_timeout
        )));
    }
    for spec in &args.tool_command {
        let (name, command) = spec
            .split_once('=')
            .ok_or_else(|| invalid(format!("--tool-command {spec:?}: expected NAME=COMMAND")))?;
        let schema = inputs
            .tools
            .iter()
            .flatten()
            .find(|t| crate::tools::schema_name(t) == Some(name))
            .ok_or_else(|| {
                invalid(format!(
                    "--tool-command {name}=…: --tools has no schema named `{name}`"
                ))
            })?;
        let tool = crate::tools::external::CommandTool::new(
            schema.clone(),
            command,
            std::time::Duration::from_secs_f64(args.tool_timeout),
            4,
        )
        .map_err(|e| invalid(format!("--tool-command {name}: {e}")))?;
        toolbox
            .add(Box::new(tool))
            .map_err(|e| invalid(format!("--tool-command {name}: {e}")))?;
    }
    if inputs.tools.is_none() {
        inputs.tools = Some(toolbox.schemas());
    }
    let interaction = match &args.interaction_command {
        None => None,
        Some(command) => Some(
            crate::tools::interaction::Interaction::new(
                command,
                std::time::Duration::from_secs_f64(args.tool_timeout),
                4,
            )
            .map_err(|e| invalid(format!("--interaction-command: {e}")))?,
        ),
    };
    let template = ChatTemplate::from_dir(&args.model)
        .map_err(|e| invalid(format!("model {}: {e}", args.model.display())))?;
    let source = template.source(true).map_err(|e| invalid(e.to_string()))?;
    let format = ToolCallFormat::of_template(source).ok_or_else(|| {
        invalid(format!(
            "--max-turns {}: the chat template of {} shows no tool-call format (neither \
             <tool_call> nor Llama 3's JSON calls), so the model's calls cannot be read",
            args.max_turns,
            args.model.display()
        ))
    })?;
    let messages = prompts
        .iter()
        .map(prompt_messages)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Episodes {
        template,
        format,
        toolbox,
        max_turns: args.max_turns,
        interaction,
        messages,
    }))
}

/// A [`TurnModel`] of `generate`: one request per turn, on the prompt's seed mixed with the
/// turn's number.
struct CliTurns<'r, 'm, B: Backend> {
    runtime: &'r Runtime<'m, B>,
    tokenizer: &'r Tokenizer,
    eos_ids: &'r [u32],
    sampling: Sampling,
    seed: u64,
    index: usize,
    turn: usize,
}

impl<B: Backend> TurnModel for CliTurns<'_, '_, B> {
    fn generate(&mut self, ids: &[u32], max_new: usize) -> Result<(Vec<u32>, bool), TrainError> {
        let request = GenerateRequest {
            prompts: vec![ids.to_vec()],
            max_new_tokens: max_new,
            eos_ids: self.eos_ids.to_vec(),
            sampling: self.sampling,
            seed: prompt_seed(self.seed, self.turn),
        };
        self.turn += 1;
        let out = self.runtime.generate(&request, self.index, |_, _| {})?;
        let ended = out.finished_by_eos.first() == Some(&true);
        Ok((out.tokens.into_iter().next().unwrap_or_default(), ended))
    }
}

impl<B: Backend> TurnText for CliTurns<'_, '_, B> {
    fn decode(&self, ids: &[u32], special: bool) -> Result<String, TrainError> {
        TurnText::decode(self.tokenizer, ids, special)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        TurnText::encode(self.tokenizer, text)
    }
}

impl Job<'_> {
    /// Prompt `index` as a multi-turn episode with tools.
    fn episode<B: Backend>(
        &self,
        runtime: &Runtime<'_, B>,
        episodes: &Episodes,
        inputs: &TemplateInputs,
        index: usize,
        ids: &[u32],
        limit: usize,
    ) -> Result<Completion, TrainError> {
        let mut turns = CliTurns {
            runtime,
            tokenizer: self.tokenizer,
            eos_ids: self.eos_ids,
            sampling: self.sampling,
            seed: prompt_seed(self.seed, index),
            index,
            turn: 0,
        };
        let settings = EpisodeSettings {
            template: &episodes.template,
            options: inputs.generation(),
            format: episodes.format,
            toolbox: &episodes.toolbox,
            max_turns: episodes.max_turns,
            interaction: episodes.interaction.as_ref(),
        };
        let messages = episodes.messages[index].clone();
        let e = run_episode(&mut turns, ids, messages, &settings, limit)?;
        Ok(Completion {
            prompt_index: index,
            text: self
                .tokenizer
                .decode(&e.tokens, true)
                .map_err(|err| invalid(err.to_string()))?,
            token_ids: e.tokens,
            input_ids: ids.to_vec(),
            finish_reason: if e.stop == Stop::Answered {
                FinishReason::Eos
            } else {
                FinishReason::Length
            },
            tools: Some(ToolUse {
                turns: e.turns,
                calls: e.calls,
                failed_calls: e.failed_calls,
                from_model: e.from_model,
                turn_scores: e.turn_scores,
                interaction_error: e.interaction_error,
            }),
        })
    }

    /// Writes a finished multi-turn completion: its JSON line, or its text and a note.
    fn write(&self, out: &mut dyn Write, c: &Completion, n: usize) -> Result<(), TrainError> {
        let write_err = |e: std::io::Error| TrainError::io("<output>", e);
        if self.json {
            let line = serde_json::to_string(c).map_err(|e| TrainError::Internal(e.to_string()))?;
            writeln!(out, "{line}").map_err(write_err)?;
        } else {
            if n > 1 {
                eprintln!("--- prompt {}/{n} ---", c.prompt_index + 1);
            }
            writeln!(out, "{}", c.text).map_err(write_err)?;
            if let Some(t) = &c.tools {
                eprintln!(
                    "({} turns, {} tool calls, {} failed, {} tokens)",
                    t.turns,
                    t.calls,
                    t.failed_calls,
                    c.token_ids.len()
                );
            }
        }
        out.flush().map_err(write_err)
    }

    /// Generates every prompt on `backend`, one request each, writing to `out`.
    fn run<B: Backend>(
        &self,
        backend: B,
        out: &mut dyn Write,
    ) -> Result<Vec<Completion>, TrainError> {
        let write_err = |e: std::io::Error| TrainError::io("<output>", e);
        let model = build_actor(backend, self.files, self.cfg)?;
        let runtime = Runtime {
            generator: model
                .generator_with(self.cfg.worker.rollout.weight_dtype.into())?
                .decode_buckets(self.cfg.worker.rollout.cuda_graphs)
                .kv_cache_dtype(self.cfg.worker.rollout.kv_cache_dtype.into()),
            media: self.media,
        };
        let n = self.input_ids.len();
        let mut completions = Vec::with_capacity(n);
        for (index, (ids, &limit)) in self.input_ids.iter().zip(self.limits).enumerate() {
            if let Some((episodes, inputs)) = self.episodes {
                let completion = self.episode(&runtime, episodes, inputs, index, ids, limit)?;
                self.write(out, &completion, n)?;
                completions.push(completion);
                continue;
            }
            let request = GenerateRequest {
                prompts: vec![ids.clone()],
                max_new_tokens: limit,
                eos_ids: self.eos_ids.to_vec(),
                sampling: self.sampling,
                seed: prompt_seed(self.seed, index),
            };
            let started = Instant::now();
            let output = if self.json {
                runtime.generate(&request, index, |_, _| {})?
            } else {
                if n > 1 {
                    eprintln!("--- prompt {}/{n} ---", index + 1);
                }
                let mut stream = TextStream::new(self.tokenizer);
                let mut failed: Option<TrainError> = None;
                let output = runtime.generate(&request, index, |_, id| {
                    if failed.is_some() {
                        return;
                    }
                    let written = stream.push(id).and_then(|delta| {
                        out.write_all(delta.as_bytes())
                            .and_then(|()| out.flush())
                            .map_err(write_err)
                    });
                    if let Err(e) = written {
                        failed = Some(e);
                    }
                })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                let rest = stream.finish()?;
                out.write_all(rest.as_bytes()).map_err(write_err)?;
                writeln!(out).map_err(write_err)?;
                out.flush().map_err(write_err)?;
                output
            };
            let token_ids = output.tokens.into_iter().next().unwrap_or_default();
            let finish_reason = if output.finished_by_eos.first() == Some(&true) {
                FinishReason::Eos
            } else {
                FinishReason::Length
            };
            let completion = Completion {
                prompt_index: index,
                text: self
                    .tokenizer
                    .decode(&token_ids, true)
                    .map_err(|e| invalid(e.to_string()))?,
                token_ids,
                input_ids: ids.clone(),
                finish_reason,
                tools: None,
            };
            if self.json {
                let line = serde_json::to_string(&completion)
                    .map_err(|e| TrainError::Internal(e.to_string()))?;
                writeln!(out, "{line}").map_err(write_err)?;
                out.flush().map_err(write_err)?;
            } else {
                let secs = started.elapsed().as_secs_f64();
                let k = completion.token_ids.len();
                eprintln!(
                    "({}: {k} tokens in {secs:.2} s, {:.1} tokens/s)",
                    match finish_reason {
                        FinishReason::Eos => "eos",
                        FinishReason::Length => "length limit",
                    },
                    k as f64 / secs.max(1e-9)
                );
            }
            completions.push(completion);
        }
        super::print_op_profile(model.backend());
        Ok(completions)
    }
}

/// The generator of either model kind with the prompts' images and videos: one call per
/// prompt, streaming each new token to `on_token`.
struct Runtime<'m, B: Backend> {
    generator: ActorGenerator<'m, B>,
    /// Prompt `i`'s images and videos (a vision-language model; empty for a text model).
    media: &'m [VisionBatch],
}

impl<B: Backend> Runtime<'_, B> {
    /// Generates `request` (prompt `index` alone), calling `on_token(0, id)` per new token.
    fn generate(
        &self,
        request: &GenerateRequest,
        index: usize,
        on_token: impl FnMut(usize, u32),
    ) -> Result<GenerateOutput, TrainError> {
        match &self.generator {
            ActorGenerator::Text(g) => Ok(g.generate_streaming(request, on_token)?),
            ActorGenerator::Vision(g) => {
                let empty = VisionBatch::default();
                let media = self.media.get(index).unwrap_or(&empty);
                Ok(g.generate(request, std::slice::from_ref(media), on_token)?)
            }
        }
    }
}

/// Incremental decoding for streaming (text-generation-inference's scheme): the text of the
/// tokens since `prefix` minus that of `prefix..read` is what the newest tokens added; it is
/// held back while it ends in an incomplete UTF-8 character (U+FFFD).
struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl<'t> TextStream<'t> {
    fn new(tokenizer: &'t Tokenizer) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds `id`; returns the text it completes (possibly empty).
    fn push(&mut self, id: u32) -> Result<String, TrainError> {
        self.ids.push(id);
        self.delta(false)
    }

    /// The text not yet returned, whether or not it ends in a complete character.
    fn finish(&mut self) -> Result<String, TrainError> {
        self.delta(true)
    }

    fn delta(&mut self, last: bool) -> Result<String, TrainError> {
        let decode = |ids: &[u32]| {
            self.tokenizer
                .decode(ids, true)
                .map_err(|e| invalid(e.to_string()))
        };
        let before = decode(&self.ids[self.prefix..self.read])?;
        let now = decode(&self.ids[self.prefix..])?;
        let complete = last || !now.ends_with('\u{FFFD}');
        match now.get(before.len()..) {
            Some(delta) if complete && now.len() > before.len() && now.starts_with(&before) => {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                Ok(delta)
            }
            _ => Ok(String::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer with one token per byte (no merges), as GPT-2 / Qwen encode
    /// text before their merges: "é" is two tokens.
    fn byte_tokenizer(dir: &Path) -> Tokenizer {
        use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let vocab: tokenizers::models::bpe::Vocab = ByteLevel::alphabet()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .unwrap();
        let mut tok = tokenizers::Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)))
            .with_decoder(Some(ByteLevelDecoder::default()));
        let path = dir.join(TOKENIZER_FILE);
        tok.save(&path, false).unwrap();
        Tokenizer::from_file(&path).unwrap()
    }

    #[test]
    fn the_stream_holds_back_partial_characters() {
        let dir = tempfile::tempdir().unwrap();
        let tok = byte_tokenizer(dir.path());
        let text = "né, 漢字 ok";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        let mut stream = TextStream::new(&tok);
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(stream.push(id).unwrap());
        }
        pieces.push(stream.finish().unwrap());
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), text);
        // "é" (2 bytes) appears whole at its second byte, nothing at its first
        assert_eq!((pieces[1].as_str(), pieces[2].as_str()), ("", "é"));
        // a truncated character at the end is flushed as decoded
        let mut stream = TextStream::new(&tok);
        let cut = &ids[..2];
        let mut out = String::new();
        for &id in cut {
            out.push_str(&stream.push(id).unwrap());
        }
        out.push_str(&stream.finish().unwrap());
        assert_eq!(out, tok.decode(cut, true).unwrap());
    }

    #[test]
    fn prompt_seeds_keep_the_first_and_differ() {
        assert_eq!(prompt_seed(42, 0), 42);
        assert_ne!(prompt_seed(42, 1), prompt_seed(42, 2));
    }
}
