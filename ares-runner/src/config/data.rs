//! `data.*`: where the prompts come from and how they are turned into model inputs.

use serde::{Deserialize, Serialize};

/// The dataset section. Column names follow verl/EasyR1 (`prompt`, `answer`, `difficulty`,
/// `global_id`, `reward_model.rubrics`, `images`, `videos`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training set (JSONL or Parquet). `None` → the built-in demo task.
    pub train_files: Option<String>,
    /// Validation set. `None` → no validation data (the demo makes its own).
    pub val_files: Option<String>,
    /// Column of the prompt: text, or chat messages (default `prompt`).
    pub prompt_key: String,
    /// Column of the reference answer (default `answer`).
    pub answer_key: String,
    /// Column of an optional difficulty label (default `difficulty`).
    pub difficulty_key: String,
    /// Column of an optional stable prompt id; generated when absent (default `global_id`).
    pub global_id_key: String,
    /// Dotted path of the rubric list inside a row (default `reward_model.rubrics`).
    pub rubrics_key: String,
    /// Column of a row's images (EasyR1's `image_key`, default `images`): a list of paths
    /// (relative to `image_dir`, else to the dataset file's directory) or `{bytes, path}`
    /// structs, one per `<image>` placeholder (or `{"type": "image"}` content item) of the
    /// prompt.
    pub image_key: String,
    /// Directory that relative image and video paths of the rows are joined to, as EasyR1
    /// joins them (default null: the dataset file's directory).
    pub image_dir: Option<String>,
    /// Column of a row's videos (EasyR1's `video_key`, default `videos`): video files, frame
    /// directories or lists of frame files, one per `<video>` placeholder.
    pub video_key: String,
    /// Lower pixel bound of a resized image; `None` (default) → the model's
    /// `preprocessor_config.json`.
    pub min_pixels: Option<usize>,
    /// Upper pixel bound of a resized image; `None` (default) → the model's
    /// `preprocessor_config.json`.
    pub max_pixels: Option<usize>,
    /// Frames per second sampled from a video file (default 2.0, the Qwen2-VL processor's);
    /// `second_per_grid_ts = temporal_patch_size / video_fps`.
    pub video_fps: f64,
    /// A jinja template file the prompt text is rendered through before the chat template
    /// (like `examples/format_prompt/math.jinja`). `None` → the prompt as it is.
    pub format_prompt: Option<String>,
    /// A jinja file that replaces the model's chat template (EasyR1 reads a file; the ARES
    /// fork's literal template text is not accepted) (default null: the model's).
    pub override_chat_template: Option<String>,
    /// Variables the chat template is rendered with, as transformers'
    /// `apply_chat_template(**kwargs)` takes them and verl names the key (e.g.
    /// `enable_thinking: false`); `messages`, `tools`, `documents` and
    /// `add_generation_prompt` are set by ares (default null: none).
    pub apply_chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// A JSON file of tool schemas — a list, as transformers' `apply_chat_template(tools=…)`
    /// takes them — that the chat template renders into every prompt (default null: none).
    pub tools: Option<String>,
    /// Longest prompt in tokens, ≥ 1 (default 512).
    pub max_prompt_length: usize,
    /// Longest response in tokens, ≥ 1 (default 512).
    pub max_response_length: usize,
    /// Drop prompts longer than `max_prompt_length` instead of failing (default true).
    pub filter_overlong_prompts: bool,
    /// Prompts (groups of `worker.rollout.n` samples) kept per step, after online filtering,
    /// ≥ 1 (default 8).
    pub rollout_batch_size: usize,
    /// Prompts generated per round while a step collects `rollout_batch_size` groups (verl's
    /// `gen_batch_size`); surplus kept groups of the last round are dropped, as EasyR1 does
    /// (default null: `rollout_batch_size`).
    pub mini_rollout_batch_size: Option<usize>,
    /// Shuffle the training set, differently each epoch (default true).
    pub shuffle: bool,
    /// Seed of the data order (default 1).
    pub seed: u64,
    /// Bootstrap pass before training (docs/algorithms.md §2): one rollout over the training set fills the
    /// difficulty of every prompt, the initial targets `T_d` and the first `τ` (default true).
    pub bootstrap: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train_files: None,
            val_files: None,
            prompt_key: "prompt".into(),
            answer_key: "answer".into(),
            difficulty_key: "difficulty".into(),
            global_id_key: "global_id".into(),
            rubrics_key: "reward_model.rubrics".into(),
            image_key: "images".into(),
            video_key: "videos".into(),
            image_dir: None,
            min_pixels: None,
            max_pixels: None,
            video_fps: 2.0,
            format_prompt: None,
            override_chat_template: None,
            apply_chat_template_kwargs: None,
            tools: None,
            max_prompt_length: 512,
            max_response_length: 512,
            filter_overlong_prompts: true,
            rollout_batch_size: 8,
            mini_rollout_batch_size: None,
            shuffle: true,
            seed: 1,
            bootstrap: true,
        }
    }
}
