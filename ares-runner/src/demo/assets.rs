//! [`write_demo_assets`]: everything the built-in demo trains on, written to disk in the
//! formats a user's own run would use (a Hugging Face model directory and verl-style JSONL),
//! so the demo exercises the same loading path and shows the data format.

use std::path::{Path, PathBuf};

use super::error::DemoError;
use super::model::{TinyModelSpec, write_random_model};
use super::task::{self, Split};
use super::tokenizer::{self, VOCAB_SIZE};

/// What [`write_demo_assets_with`] makes.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoOptions {
    /// Seed of the problems, the SFT examples and the initial weights.
    pub seed: u64,
    /// Training problems per level (RL prompts), from the train split (at most 194: the
    /// easy train split's size).
    pub train_per_level: usize,
    /// Evaluation problems per level, from the held-out split (at most 67: the easy eval
    /// split's size).
    pub eval_per_level: usize,
    /// Supervised cold-start examples (drawn from the train split, with replacement).
    pub sft_examples: usize,
    /// The model's sizes.
    pub model: TinyModelSpec,
    /// Rows of the model's embedding and LM head: the tokenizer's
    /// [`VOCAB_SIZE`] ids, or more (padded, as Qwen pads 151 643 ids to 151 936;
    /// benchmarks use a real vocabulary's size).
    pub vocab_size: usize,
}

impl Default for DemoOptions {
    /// Seed 1, 192 training and 64 evaluation problems per level, 16384 SFT examples (512
    /// steps of 32), the default [`TinyModelSpec`].
    fn default() -> Self {
        Self {
            seed: 1,
            train_per_level: 192,
            eval_per_level: 64,
            sft_examples: 16_384,
            model: TinyModelSpec::default(),
            vocab_size: VOCAB_SIZE,
        }
    }
}

/// Paths of the files [`write_demo_assets`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoAssets {
    /// The directory everything is under.
    pub root: PathBuf,
    /// `root/model`: `config.json`, `model.safetensors`, `generation_config.json`,
    /// `tokenizer.json`, `tokenizer_config.json`.
    pub model_dir: PathBuf,
    /// `root/data/train.jsonl`: `prompt`, `answer`, `difficulty`, `global_id`.
    pub train: PathBuf,
    /// `root/data/eval.jsonl`: same columns, held-out prompts.
    pub eval: PathBuf,
    /// `root/data/sft.jsonl`: `prompt`, `response`.
    pub sft: PathBuf,
}

/// [`write_demo_assets_with`] with the default sizes and `seed`.
///
/// # Errors
/// As [`write_demo_assets_with`].
pub fn write_demo_assets(dir: &Path, seed: u64) -> Result<DemoAssets, DemoError> {
    write_demo_assets_with(
        dir,
        &DemoOptions {
            seed,
            ..DemoOptions::default()
        },
    )
}

/// Writes the demo's model directory (random tiny Qwen2 + character tokenizer) and its
/// train, eval and SFT datasets under `dir` (created if missing; files of the same names are
/// replaced, nothing else is touched). Everything is a function of `options`: the same
/// options give the same bytes.
///
/// # Errors
/// [`DemoError::NotEnoughProblems`] when a split is too small for the sizes asked,
/// [`DemoError::Setting`] for a bad model spec (both before anything is written), else
/// [`DemoError::Io`] / [`DemoError::Hf`] / [`DemoError::Tokenizer`] on writing.
pub fn write_demo_assets_with(dir: &Path, options: &DemoOptions) -> Result<DemoAssets, DemoError> {
    options.model.validate()?;
    if options.vocab_size < VOCAB_SIZE {
        return Err(DemoError::Setting {
            field: "vocab_size",
            value: options.vocab_size.to_string(),
            reason: format!("must be >= {VOCAB_SIZE}, the demo tokenizer's size"),
        });
    }
    let train = task::problems(Split::Train, options.seed, options.train_per_level)?;
    let eval = task::problems(Split::Eval, options.seed, options.eval_per_level)?;
    let sft = task::sft_examples(options.seed, options.sft_examples)?;
    let assets = DemoAssets {
        root: dir.to_path_buf(),
        model_dir: dir.join("model"),
        train: dir.join("data").join("train.jsonl"),
        eval: dir.join("data").join("eval.jsonl"),
        sft: dir.join("data").join("sft.jsonl"),
    };
    let ids = tokenizer::special_ids();
    write_random_model(
        &assets.model_dir,
        &options.model,
        options.vocab_size,
        ids.im_end,
        ids.endoftext,
        None,
        options.seed,
    )?;
    tokenizer::write_tokenizer(&assets.model_dir)?;
    task::to_jsonl(&train, &assets.train)?;
    task::to_jsonl(&eval, &assets.eval)?;
    task::sft_to_jsonl(&sft, &assets.sft)?;
    Ok(assets)
}
