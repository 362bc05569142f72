//! Datasets for the trainer: verl/EasyR1-style JSON lines and Parquet files into validated
//! [`Example`]s, prompt templates, prompt-length filtering and the seeded per-epoch sampler.
//!
//! A row holds a prompt (text, or chat messages `[{"role", "content"}]`), a reference answer
//! (`answer`, else `ground_truth`, else verl's `reward_model.ground_truth`), and optionally a
//! `difficulty` label, a `global_id` (generated as `<file stem>-<row>` when absent) and rubric
//! criteria (`reward_model.rubrics`, seed 003). Column names are configurable with
//! [`DataKeys`]. Images and videos are refused ("not supported yet"): training is text-only.
//!
//! ```text
//! {"prompt": "What is 2+3?", "answer": "5", "difficulty": "easy"}
//! {"prompt": [{"role": "user", "content": "…"}], "reward_model": {"ground_truth": "7"}}
//! {"prompt": [{"role": "user", "content": "…"}],
//!  "reward_model": {"rubrics": [{"criterion": "Names the symptoms", "points": 8,
//!                                "keywords": ["fever", "cough"]}]}}
//! ```

mod criterion;
mod error;
mod example;
mod filter;
mod jsonl;
mod keys;
mod load;
mod parquet;
mod row;
mod sampler;
mod template;

pub use criterion::Criterion;
pub use error::{DataError, Location, Result};
pub use example::{Example, Prompt};
pub use filter::filter_by_prompt_length;
pub use keys::{ANSWER_FALLBACKS, DataKeys};
pub use load::load_dataset;
pub use sampler::EpochSampler;
pub use template::PromptTemplate;
