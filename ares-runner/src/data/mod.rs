//! Datasets for the trainer: verl/EasyR1-style JSON lines and Parquet files into validated
//! [`Example`]s, prompt templates, prompt-length filtering and the seeded per-epoch sampler.
//!
//! A row holds a prompt (text, or chat messages `[{"role", "content"}]`), a reference answer
//! (`answer`, else `ground_truth`, else verl's `reward_model.ground_truth`), and optionally a
//! `difficulty` label, a `global_id` (generated as `<file stem>-<row>` when absent) and rubric
//! criteria (`reward_model.rubrics`, docs/algorithms.md §9). Column names are configurable with
//! [`DataKeys`].
//!
//! Multimodal rows (EasyR1 / verl) carry `images` and `videos` ([`MediaKeys`]): paths relative
//! to the dataset file, or `{bytes, path}` structs as Hugging Face `datasets` stores images in
//! Parquet ([`MediaSource`]); the prompt has one `<image>` / `<video>` placeholder per item, or
//! chat messages with `{"type": "image"}` content items. [`MediaProcessor`] and [`load_media`]
//! turn them into the vision model's inputs, [`vision_token_count`] counts the tokens they
//! expand to for prompt-length filtering, [`render_prompt`] renders a Qwen2-VL prompt.
//!
//! ```text
//! {"prompt": "What is 2+3?", "answer": "5", "difficulty": "easy"}
//! {"prompt": [{"role": "user", "content": "…"}], "reward_model": {"ground_truth": "7"}}
//! {"prompt": [{"role": "user", "content": "…"}],
//!  "reward_model": {"rubrics": [{"criterion": "Names the symptoms", "points": 8,
//!                                "keywords": ["fever", "cough"]}]}}
//! {"prompt": "<image>Find x in the figure.", "answer": "3", "images": ["img/7.png"]}
//! {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]}],
//!  "answer": "3", "images": [{"bytes": "<base64>", "path": null}]}
//! ```

mod criterion;
mod error;
mod example;
mod filter;
mod hub;
mod jsonl;
mod keys;
mod load;
mod media;
mod parquet;
mod row;
mod sampler;
mod template;
mod vision;

pub use criterion::Criterion;
pub use error::{DataError, Location, Result};
pub use example::{Example, Prompt};
pub use filter::filter_by_prompt_length;
pub use hub::{resolve_data_files, resolve_data_files_in, resolve_model_dir};
pub use keys::{ANSWER_FALLBACKS, DataKeys, MediaKeys};
pub use load::{SftTarget, load_dataset, load_dataset_with_media, load_sft_dataset};
pub use media::{IMAGE_PLACEHOLDER, MediaSource, VIDEO_PLACEHOLDER};
pub use sampler::EpochSampler;
pub use template::PromptTemplate;
pub use vision::{
    ExampleMedia, MediaProcessor, load_media, render_prompt, render_prompt_with, vision_token_count,
};
