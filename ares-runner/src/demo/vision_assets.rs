//! [`write_vision_demo_assets`]: everything the vision demo trains on, written to disk in
//! the formats a user's own multimodal run would use — a Qwen2.5-VL-style Hugging Face model
//! directory and EasyR1-style JSONL with `images` columns and `<image>` placeholders — so the
//! demo exercises the same loading path and shows the data format.
//!
//! ```text
//! <dir>/model/  config.json  model.safetensors  generation_config.json
//!               preprocessor_config.json  tokenizer.json  tokenizer_config.json
//! <dir>/data/   train.jsonl  eval.jsonl  sft.jsonl
//!               images/train-000000.png …  images/eval-000000.png …  images/sft-000000.png …
//! ```

use std::path::{Path, PathBuf};

use super::error::DemoError;
use super::model::TinyModelSpec;
use super::vision_model::{TinyVisionSpec, VL_VOCAB_SIZE, write_vl_model_dir};
use super::vision_task::{self, Split};

/// What [`write_vision_demo_assets_with`] makes.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionDemoOptions {
    /// Seed of the pictures, the SFT examples and the initial weights.
    pub seed: u64,
    /// Training problems per level (RL prompts), from the train split.
    pub train_per_level: usize,
    /// Evaluation problems per level, from the held-out split.
    pub eval_per_level: usize,
    /// Distinct pictures per level the SFT examples are drawn from (train split, other
    /// pictures than the RL prompts).
    pub sft_images_per_level: usize,
    /// Supervised cold-start examples (pictures drawn with replacement from the SFT pool).
    pub sft_examples: usize,
    /// The language model's sizes (the text demo's by default).
    pub model: TinyModelSpec,
    /// The vision tower's sizes.
    pub vision: TinyVisionSpec,
    /// Rows of the embedding and LM head: [`VL_VOCAB_SIZE`] or more (padded).
    pub vocab_size: usize,
}

impl Default for VisionDemoOptions {
    /// Seed 1, 192 training and 64 evaluation problems per level, 1024 SFT pictures per
    /// level, 16384 SFT examples, the default [`TinyModelSpec`] and [`TinyVisionSpec`].
    fn default() -> Self {
        Self {
            seed: 1,
            train_per_level: 192,
            eval_per_level: 64,
            sft_images_per_level: 1024,
            sft_examples: 16_384,
            model: TinyModelSpec::default(),
            vision: TinyVisionSpec::default(),
            vocab_size: VL_VOCAB_SIZE,
        }
    }
}

/// Paths of the files [`write_vision_demo_assets`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionDemoAssets {
    /// The directory everything is under.
    pub root: PathBuf,
    /// `root/model`: `config.json`, `model.safetensors`, `generation_config.json`,
    /// `preprocessor_config.json`, `tokenizer.json`, `tokenizer_config.json`.
    pub model_dir: PathBuf,
    /// `root/data/train.jsonl`: `prompt`, `images`, `answer`, `difficulty`, `global_id`.
    pub train: PathBuf,
    /// `root/data/eval.jsonl`: same columns, held-out pictures.
    pub eval: PathBuf,
    /// `root/data/sft.jsonl`: `prompt`, `response`, `images`.
    pub sft: PathBuf,
    /// `root/data/images`: every picture (paths in the JSONL files are relative to
    /// `root/data`).
    pub images: PathBuf,
}

/// [`write_vision_demo_assets_with`] with the default sizes and `seed`.
///
/// # Errors
/// As [`write_vision_demo_assets_with`].
pub fn write_vision_demo_assets(dir: &Path, seed: u64) -> Result<VisionDemoAssets, DemoError> {
    write_vision_demo_assets_with(
        dir,
        &VisionDemoOptions {
            seed,
            ..VisionDemoOptions::default()
        },
    )
}

/// Writes the vision demo's model directory (random tiny Qwen2.5-VL-style model, vision
/// tokenizer, image processor config) and its train, eval and SFT datasets with their
/// pictures under `dir` (created if missing; files of the same names are replaced, nothing
/// else is touched). Everything is a function of `options`: the same options give the same
/// bytes.
///
/// # Errors
/// [`DemoError::Setting`] for a bad model spec or vocabulary (before anything is written),
/// else [`DemoError::Io`] / [`DemoError::Hf`] / [`DemoError::Tokenizer`] on writing.
pub fn write_vision_demo_assets_with(
    dir: &Path,
    options: &VisionDemoOptions,
) -> Result<VisionDemoAssets, DemoError> {
    let seed = options.seed;
    let train = vision_task::problems(Split::Train, seed, options.train_per_level)?;
    let eval = vision_task::problems(Split::Eval, seed, options.eval_per_level)?;
    let pool = vision_task::sft_problems(seed, options.sft_images_per_level)?;
    let sft = vision_task::sft_examples(&pool, seed, options.sft_examples)?;
    let data = dir.join("data");
    let assets = VisionDemoAssets {
        root: dir.to_path_buf(),
        model_dir: dir.join("model"),
        train: data.join("train.jsonl"),
        eval: data.join("eval.jsonl"),
        sft: data.join("sft.jsonl"),
        images: data.join("images"),
    };
    // the model first: it validates every setting before writing
    write_vl_model_dir(
        &assets.model_dir,
        &options.model,
        &options.vision,
        options.vocab_size,
        seed,
    )?;
    vision_task::write_images(&train, &data, "train")?;
    vision_task::write_images(&eval, &data, "eval")?;
    vision_task::write_images(&pool, &data, "sft")?;
    vision_task::to_jsonl(&train, "train", &assets.train)?;
    vision_task::to_jsonl(&eval, "eval", &assets.eval)?;
    vision_task::sft_to_jsonl(&sft, "sft", &assets.sft)?;
    Ok(assets)
}
